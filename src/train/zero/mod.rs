//! `--zero 1|2|3`: data parallel with a sharded optimizer (burn-dist's [`burn_dist::zero`]).
//! Each rank keeps `1/N` of the optimizer's state (its segment of every fusion bucket of the
//! trainable values) and updates those values; the updated segments are all-gathered. Stage 2
//! also receives only its segments of the averaged gradient (reduce-scatter). Stage 3 (data
//! parallel on Hearth's models) keeps only its segments of the parameters too: the buckets are
//! cut at the model's units, the model is a skeleton, and each unit is gathered for its passes
//! (`allreduce/`; validation and checkpoints gather the whole model).
//!
//! Checkpoints: at every epoch's checkpoint the shards are gathered on rank 0, which writes
//! `checkpoint/optim-zero-<epoch>.safetensors`: one tensor per trainable tensor and state slot,
//! named `<tensor>.<slot>` (`layer1.0.conv1.weight.velocity`, `fc.bias.moment_2`), the update
//! count and the tensors' order in its metadata; rank 0 streams it to disk a bucket at a time,
//! so it never holds more of the state than its own shard and one bucket. Whole named tensors, so a run written by 4
//! ranks resumes on 2 or 8 (or without sharding's world at all: any safetensors reader opens
//! it). The two latest files are kept (the one a resume may need while the next epoch's
//! optimizer file is being written).
//!
//! Data parallel takes it in its strategy (`allreduce.rs`, Hearth's models and a custom
//! module alike), and a pipeline's stage over the
//! stage's replicas (`pipeline/`, `--nproc P x D`; each stage's file in its
//! `checkpoint/stage-<s>/`); all step through burn-dist's `zero::module::sharded_step`.
//!
//! `--unfreeze-after`: the fine-tuning phase starts from the frozen phase's state of the head,
//! the backbone's tensors from a zero state (burn's optimizers start a tensor without state the
//! same way), and Adam/AdamW count the backbone's steps from the switch (the update count each
//! tensor joined at, `born` in the file's metadata, as burn's per-tensor step count): the
//! data parallel resuming right at the switch reads the head's file with `new_tensors_at_zero`;
//! data parallel at the switch and a pipeline stage move the state over with `refit`.
//!
//! Elastic training keeps a replica of the next worker's shard and re-shards the state at
//! every change of membership (`elastic/sharded.rs`).
//!
//! Not built yet, and refused by name ([`TrainConfig::validate`]): `--zero` with the
//! parameter servers (whose servers already hold the state sharded), pipelines of one replica
//! per stage (nothing to shard over) and `--unfreeze-after` in elastic training.

use std::path::Path;

use burn::module::Module;
use burn_dist::zero::Stage;

mod file;
mod values;
mod weights;

pub(crate) use file::save_state;
pub use file::{StateFile, open_state, read_state, state_file};
pub(crate) use values::CheckpointValues;
pub(crate) use weights::WeightsValues;

use super::TrainConfig;
use crate::{HearthError, Result};

/// Where a shard starts ([`start`]).
pub(super) struct ShardStart<'a> {
    /// The checkpoint folder its state file is in.
    pub dir: &'a Path,
    /// The epoch resumed after (0: a fresh start).
    pub resume: usize,
    /// The file may hold some of the tensors: the fine-tuning phase starting after a frozen one.
    pub new_at_zero: bool,
    /// Stage 3: each unit's number of trainable tensors, where the buckets are cut.
    pub units: Option<&'a [usize]>,
    /// Stage 3: the matrices (trainable index, values per row) that may be cut into pieces of
    /// rows where larger than a bucket ([`burn_dist::zero::ZeroOptimizer::cut_rows`]).
    pub rows: Option<&'a [(usize, usize)]>,
}

/// A rank's sharded optimizer for `model` over `comm` (the run's optimizer; the rate comes from
/// the strategy's schedule at each step, `batches` per epoch); when resuming after
/// `at.resume`, its state from that epoch's file in `at.dir`, read by `comm`'s rank 0 (written
/// by any number of ranks) and scattered.
pub(super) fn start<M: Module>(
    cfg: &TrainConfig,
    model: &M,
    batches: usize,
    comm: &burn_dist::Communicator,
    at: ShardStart<'_>,
) -> Result<burn_dist::zero::ZeroOptimizer> {
    let ShardStart {
        dir,
        resume,
        new_at_zero,
        units,
        rows,
    } = at;
    let stage = Stage::from_number(cfg.exchange.zero)?;
    let optimizer = super::flat::model_optimizer(cfg, cfg.optim.lr, batches, model)?;
    let names = burn_dist::flat::module::trainable_names(model);
    let mut z = burn_dist::zero::ZeroOptimizer::new(
        stage,
        &names,
        optimizer,
        comm,
        cfg.exchange.bucket_size(),
    )?
    .with_new_tensors_at_zero(new_at_zero)
    .with_clip_norm(cfg.optim.clip_grad);
    if let Some(counts) = units {
        z = z.cut_at_units(counts)?;
    }
    if let Some(rows) = rows {
        z = z.cut_rows(rows)?;
    }
    if resume > 0 {
        // Rank 0 reads the file a bucket at a time as it hands the state out.
        let mut read = (comm.rank() == 0)
            .then(|| open_state(&state_file(dir, resume)).map_err(|e| e.to_string()));
        z.scatter_from_reader(
            comm,
            0,
            read.as_mut().map(|r| {
                r.as_mut()
                    .map(|f| f as &mut dyn burn_dist::zero::StateReader)
                    .map_err(|e| e.clone())
            }),
        )?;
    }
    Ok(z)
}

/// `zero` moved to `model`'s trainable tensors at the fine-tuning switch (`--unfreeze-after`):
/// its state (the head's, small) gathered on `comm`'s rank 0 and handed out again over the new
/// set, the tensors new to training starting from zero, as burn's optimizer's do. Every rank of
/// `comm` calls it.
pub(super) fn refit<M: Module>(
    cfg: &TrainConfig,
    zero: &burn_dist::zero::ZeroOptimizer,
    model: &M,
    batches: usize,
    comm: &burn_dist::Communicator,
) -> Result<burn_dist::zero::ZeroOptimizer> {
    let whole = zero.gather_state(comm, 0)?;
    let optimizer = super::flat::model_optimizer(cfg, cfg.optim.lr, batches, model)?;
    let names = burn_dist::flat::module::trainable_names(model);
    let mut z = burn_dist::zero::ZeroOptimizer::new(
        zero.stage(),
        &names,
        optimizer,
        comm,
        cfg.exchange.bucket_size(),
    )?
    .with_new_tensors_at_zero(true)
    .with_clip_norm(cfg.optim.clip_grad);
    z.scatter_state(comm, 0, whole.as_ref().map(Ok))?;
    Ok(z)
}

/// `--resume` after `epoch`: a run written with `--zero` resumes only with it (its Burn
/// optimizer file is empty), and one written without it only without (it has no sharded
/// state); the stage and the number of ranks may change.
pub(super) fn check_resume(cfg: &TrainConfig, epoch: usize) -> Result<()> {
    check_resume_in(cfg, &cfg.run_dir.join("checkpoint"), epoch)
}

/// [`check_resume`] for the checkpoint folder `dir` (a pipeline stage's).
pub(super) fn check_resume_in(cfg: &TrainConfig, dir: &Path, epoch: usize) -> Result<()> {
    let file = state_file(dir, epoch);
    match (cfg.exchange.zero > 0, file.is_file()) {
        (true, false) => Err(HearthError::InvalidArgument(format!(
            "cannot resume {} with `exchange.zero` {}: {} is missing (was the run trained without \
             `exchange.zero`? then resume without it)",
            cfg.run_dir.display(),
            cfg.exchange.zero,
            file.display()
        ))),
        (false, true) => Err(HearthError::InvalidArgument(format!(
            "cannot resume {} without `exchange.zero`: its optimizer state is sharded ({}); resume \
             with `exchange.zero` 1 or 2, on any number of ranks",
            cfg.run_dir.display(),
            file.display()
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::file::{Files, Part, state_epochs};
    use super::*;
    use burn_dist::zero::StateReader;
    use burn_dist::zero::WholeState;
    use safetensors::tensor::SafeTensors;

    #[test]
    fn a_state_round_trips_and_damaged_files_are_errors_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("checkpoint");
        let files = Files { dir: ck.clone() };
        let state = WholeState {
            tensors: vec![("b.weight".into(), 3), ("a.bias".into(), 2)],
            updates: 7,
            slots: vec![
                ("moment_1".into(), vec![1.0, 2.0, 3.0, 4.0, 5.0]),
                (
                    "moment_2".into(),
                    vec![0.5, 0.25, 0.0, -1.0, f32::MIN_POSITIVE],
                ),
            ],
            // b.weight joined at update 3 (a fine-tuning switch), a.bias at 0.
            born: vec![3, 0],
        };
        for epoch in 1..=4 {
            files.write(epoch, &state).unwrap();
        }
        let mut kept = state_epochs(&ck);
        kept.sort();
        assert_eq!(kept, vec![3, 4], "the two latest are kept");
        let path = state_file(&ck, 4);
        assert_eq!(read_state(&path).unwrap(), state);
        // A piece across two tensors, as a bucket of the scatter reads it.
        let mut f = open_state(&path).unwrap();
        assert_eq!(f.slot_names(), ["moment_1", "moment_2"]);
        assert_eq!(f.read(1, 2..4).unwrap(), vec![0.0, -1.0]);
        assert_eq!(f.read(0, 0..1).unwrap(), vec![1.0]);
        assert!(f.read(0, 4..6).is_err());
        // Any safetensors reader sees whole named tensors.
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("a.bias.moment_2").unwrap().shape(), [2]);

        let cut = dir.path().join("cut.safetensors");
        std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
        let e = read_state(&cut).unwrap_err().to_string();
        assert!(e.contains("cut.safetensors"), "{e}");
        std::fs::write(&cut, b"garbage").unwrap();
        let e = read_state(&cut).unwrap_err().to_string();
        assert!(
            e.contains("cut.safetensors") && e.contains("not a safetensors"),
            "{e}"
        );
        let e = read_state(&dir.path().join("none.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("none.safetensors"), "{e}");
        // A file without our metadata (any other safetensors file).
        let plain = dir.path().join("plain.safetensors");
        let v = [1.0f32];
        safetensors::serialize_to_file([("x", Part(&v, [1]))], None, &plain).unwrap();
        let e = read_state(&plain).unwrap_err().to_string();
        assert!(e.contains("no metadata"), "{e}");
    }

    #[test]
    fn resume_refuses_to_switch_sharding_on_or_off() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("checkpoint")).unwrap();
        let mut cfg = TrainConfig::new(dir.path().to_path_buf());
        cfg.exchange.zero = 2;
        let e = check_resume(&cfg, 3).unwrap_err().to_string();
        assert!(e.contains("optim-zero-3.safetensors is missing"), "{e}");
        std::fs::write(state_file(&dir.path().join("checkpoint"), 3), b"x").unwrap();
        check_resume(&cfg, 3).unwrap();
        cfg.exchange.zero = 0;
        let e = check_resume(&cfg, 3).unwrap_err().to_string();
        assert!(
            e.contains("without `exchange.zero`") && e.contains("any number of ranks"),
            "{e}"
        );
    }
}
