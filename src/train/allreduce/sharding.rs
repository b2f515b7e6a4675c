//! The allreduce strategy's ZeRO side: the optimizer's shard at the start of a run (stage 3:
//! the parameters too, the model a skeleton), where stage 3's passes gather a unit's
//! parameters from, and the epoch's report on the exchange, with stage 3's gathers.

use std::sync::Arc;

use burn_dist::Communicator;

use super::Allreduce;
use crate::pipeline::Gathering;
use crate::train::trainee::{Net, Trainee};
use crate::{HearthError, Result};

impl<T: Trainee> Allreduce<'_, T> {
    /// `--zero`: this rank's shard of the optimizer, its state from rank 0's file of epoch
    /// `first` when resuming (written by any number of ranks).
    ///
    /// The model enters the phase of epoch `first + 1` first (`--freeze-backbone`: the shards
    /// cover what trains); a resume right at the fine-tuning switch starts the backbone's state
    /// from zero, the file holding the head's alone.
    pub(super) fn start_sharding(&mut self, first: usize, log: &mut dyn FnMut(&str)) -> Result<()> {
        let frozen = self.rates.frozen(first + 1);
        if frozen {
            log("backbone frozen: only the head trains");
        }
        let model = self.take_model()?;
        self.model = Some(self.trainee.phase(model, frozen));
        self.frozen = frozen;
        let (Some(comm), true) = (self.comm.clone(), self.cfg.exchange.zero > 0) else {
            return Ok(());
        };
        let comm = &comm;
        let at_switch = first > 0 && self.rates.frozen(first) && !frozen;
        let stage_3 = self.cfg.exchange.zero == 3;
        let units = match stage_3 {
            true => Some(self.model()?.unit_tensor_counts().ok_or_else(|| {
                HearthError::InvalidArgument(
                    "`exchange.zero` 3 gathers a model's parameters unit by unit, and this model \
                     has no units (Hearth's ResNet, DenseNet and VGG have): use stage 1 or 2"
                        .into(),
                )
            })??),
            false => None,
        };
        let dir = self.cfg.run_dir.join("checkpoint");
        let rows = match stage_3 {
            true => Some(self.model()?.piece_rows()),
            false => None,
        };
        let pieces = stage_3 && pieces_built(self.cfg).is_ok();
        let at = crate::train::zero::ShardStart {
            dir: &dir,
            resume: first,
            new_at_zero: at_switch,
            units: units.as_deref(),
            rows: rows.as_deref().filter(|_| pieces),
        };
        let mut z = crate::train::zero::start(self.cfg, self.model()?, self.batches, comm, at)?;
        let line = pieces_line(&z, rows.as_deref().unwrap_or(&[]), self.cfg);
        if !line.is_empty() {
            log(&line);
        }
        if stage_3 {
            // The values go into the shard, rank 0's handed out a bucket at a time (in place
            // of data parallel's broadcast of the whole model at the start, which held its
            // largest tensor twice: `resume`); the model keeps its structure, ids and buffers,
            // rank 0's buffers broadcast (the skeleton's trainable tensors are empty).
            let model = self.take_model()?;
            // A resume's values on rank 0: the checkpoint, read a bucket's window at a time.
            let mut values = self.resumed_values.take();
            // A torchvision file's on a fresh run: each tensor read once and cut into windows
            // (its parameter, made, would hold a linear weight twice); the new head drawn now,
            // under the seed lock, as the hand-out would have drawn it.
            let mut weights = match (&values, &self.seed_guard) {
                (None, Some(drawing)) => drawing.file_tensors().map(|(path, files)| {
                    log(&format!(
                        "ZeRO stage 3: rank 0 reads {} a tensor at a time as it hands the values out",
                        path.display()
                    ));
                    crate::train::zero::WeightsValues::new(&model, files, path)
                }),
                _ => None,
            };
            let source = match (values.as_mut(), weights.as_mut()) {
                (Some(v), _) => Some(v as &mut dyn burn_dist::zero::StepSource),
                (None, Some(w)) => Some(w as &mut dyn burn_dist::zero::StepSource),
                (None, None) => None,
            };
            let (skeleton, params) =
                burn_dist::zero::module::shard_params_from(&mut z, comm, 0, model, source)?;
            if let Some(e) = values.as_ref().and_then(|v| v.failure()) {
                return Err(e);
            }
            if let Some(e) = weights.as_ref().and_then(|w| w.failure()) {
                return Err(e);
            }
            // Rank 0 drew its values as it handed them out, in the model's order, under the
            // seed lock it still holds (`train_with`). A rank built without values would still
            // have any tensor that does not train uninitialised (none in Hearth's models, whose
            // tensors all train under stage 3, `--freeze-backbone` being refused): made now
            // under the seed lock (other trainings in this process draw from the same
            // generator), then overwritten by rank 0's with the buffers.
            let skeleton = match self.seed_guard.take() {
                Some(drawing) => {
                    let skeleton = crate::train::model::materialize(skeleton);
                    // A weights file's read that failed after the load checked it: the
                    // values handed out are wrong.
                    drawing.finish()?;
                    skeleton
                }
                None => crate::train::model::materialize_locked(skeleton),
            };
            let skeleton = burn_dist::ddp::broadcast_module(skeleton, comm)?;
            self.model = Some(skeleton);
            self.params = Some(params);
            if self.cfg.exchange.overlap {
                let sibling = |c: &Arc<Communicator>| c.sibling(burn_dist::wire::Kind::Gather);
                self.gathers = self.comm.as_ref().map(sibling).map(Arc::new);
            }
        }
        log(&format!(
            "ZeRO stage {}: rank 0 keeps the optimizer state of {}{}",
            self.cfg.exchange.zero,
            z.describe(),
            if stage_3 {
                format!(", and {} parameter values", z.params_len())
            } else {
                String::new()
            }
        ));
        self.zero = Some(z);
        Ok(())
    }

    /// `--zero 3`: where a unit's parameters come from for its passes (`None` otherwise).
    pub(super) fn gathering(&self) -> Option<Gathering<'_>> {
        match (
            &self.zero,
            self.gathers.as_ref().or(self.comm.as_ref()),
            &self.params,
        ) {
            (Some(zero), Some(comm), Some(params)) => Some(Gathering {
                zero,
                comm,
                params,
                ahead: self.gathers.is_some().then_some(&self.fetch_order),
                kept: Some(&self.kept_units),
            }),
            _ => None,
        }
    }

    /// Rank 0's line on the epoch's time in the gradient exchange (data parallel only).
    pub(super) fn report_exchange(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) {
        let line = self.exchange.report(epoch);
        let (fetched, ahead) = self.fetch_order.borrow_mut().take_counts();
        // Said once a run (each step sets it again).
        let kept = self.kept_units.take().filter(|_| !self.said_kept);
        if let (0, Some(_), Some(line)) = (self.rank, &self.comm, line) {
            log(&line);
            if let Some(k) = kept {
                self.said_kept = true;
                log(&k.describe());
            }
            if fetched > 0 {
                log(&format!(
                    "epoch {epoch}: `exchange.zero` 3's backward fetched {fetched} buckets, \
                     {ahead} of them gathered ahead by a thread while the ops before them ran \
                     (from the second step: each step's in the order of the one before)"
                ));
            }
        }
    }
}

/// Whether stage 3 may cut its weights larger than a bucket into pieces of rows, each
/// gathered and multiplied alone (`hearth_kernels::keyed::forward_from`; with
/// `exchange.overlap` its threads gather the pieces in turn): on the keyed forward's path
/// only, in f32. Else what takes the other path.
fn pieces_built(cfg: &crate::train::TrainConfig) -> std::result::Result<(), &'static str> {
    if cfg.compute.recompute {
        Err("`compute.recompute` (its backward runs each unit's forward again, gathered whole)")
    } else if cfg.compute.precision != crate::train::Precision::Fp32 {
        Err("`compute.precision` other than f32 (the weights are cast whole)")
    } else {
        Ok(())
    }
}

/// The run's line on stage 3's weights larger than a bucket: cut into pieces of rows, or
/// gathered whole and why; empty where there is none.
fn pieces_line(
    z: &burn_dist::zero::ZeroOptimizer,
    rows: &[(usize, usize)],
    cfg: &crate::train::TrainConfig,
) -> String {
    let cut: Vec<usize> = rows
        .iter()
        .filter_map(|&(t, _)| z.pieces_of(t).map(|p| p.len()))
        .collect();
    if !cut.is_empty() {
        let n = cut.len();
        return format!(
            "`exchange.zero` 3 cuts {n} {} larger than a bucket into {} pieces of rows in all, \
             each gathered, multiplied and reduced alone (a convolution's: its output channels), \
             so that no step holds {} whole",
            plural(n, "weight", "weights"),
            cut.iter().sum::<usize>(),
            plural(n, "it", "one")
        );
    }
    let large = z.large_tensors(rows);
    match (large, pieces_built(cfg)) {
        (0, _) | (_, Ok(())) => String::new(),
        (n, Err(why)) => format!(
            "`exchange.zero` 3 gathers {n} {} larger than a bucket whole for {} passes with \
             {why}: pieces of rows are taken only without it",
            plural(n, "weight", "weights"),
            plural(n, "its", "their")
        ),
    }
}

fn plural(n: usize, one: &'static str, many: &'static str) -> &'static str {
    match n {
        1 => one,
        _ => many,
    }
}
