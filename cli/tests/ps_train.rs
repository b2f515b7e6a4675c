//! `hearth train --ps`: parameter-server runs as real process trees over QUIC on 127.0.0.1.
//! ADAG with a dedicated server learns and records every worker's curve; colocated sync
//! servers stop and resume from their checkpoint; a dead server fails every worker within
//! 10 s naming its shard; a dead worker does not stop asynchronous training; sync names its
//! straggler every epoch, and ADAG runs ahead of it. Every process is bounded in time.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Job, elastic_data, folder_accuracy, metrics, wait_bounded};

/// A sync-server job of `servers` servers and 2 workers into `dir/name` (`base`, then `extra`),
/// which must succeed; the lead's log.
fn sync_job(
    dir: &Path,
    data: &Path,
    name: &str,
    servers: usize,
    base: &[&str],
    extra: &[&str],
) -> String {
    let n = servers.to_string();
    let mut args = vec!["--ps", &n, "--mode", "sync"];
    args.extend_from_slice(extra);
    let mut job = Job::spawn(dir, data, &dir.join(name), servers + 2, base, &args, &[]);
    let ok = job.wait(300);
    assert!(
        ok.iter().all(|&o| o),
        "{name} {extra:?}: {}",
        job.all_logs()
    );
    job.log(0)
}

/// The tensors of `dir/name`'s checkpoint of `epoch`, by name.
fn last_model(dir: &Path, name: &str, epoch: usize) -> BTreeMap<String, Vec<f32>> {
    common::tensors(&dir.join(name).join(format!("checkpoint/model-{epoch}.bpk")))
        .into_iter()
        .collect()
}

/// The largest difference between two models' tensors of the same names.
fn largest_gap(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    a.iter()
        .map(|(k, x)| common::max_abs_diff(x, &b[k]))
        .fold(0f32, f32::max)
}

fn wait_for_file(path: &Path, job: &mut Job) {
    let until = Instant::now() + Duration::from_secs(120);
    while !path.is_file() {
        let ended = job
            .children
            .iter_mut()
            .any(|c| c.try_wait().unwrap().is_some());
        if Instant::now() > until || ended {
            panic!("training did not get under way:\n{}", job.all_logs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn adag_with_a_dedicated_server_learns_and_records_every_worker() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let run = dir.path().join("run");
    let args = [
        "--ps", "1", "--mode", "adag", "--window", "2", "--epochs", "4",
    ];
    let mut job = Job::start(dir.path(), &data, &run, 3, &args, &[]);
    let ok = job.wait(240);
    assert!(ok.iter().all(|&o| o), "{}", job.all_logs());
    let rows = metrics(&run);
    assert_eq!(rows.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    for (e, row) in &rows {
        for col in [
            "train_accuracy_rank0",
            "train_accuracy_rank1",
            "wait_seconds_rank1",
            "bytes_per_sample",
            "val_accuracy",
        ] {
            assert!(row.contains_key(col), "epoch {e} lacks {col}: {row:?}");
        }
        assert!(
            !row.keys().any(|k| k.ends_with("rank2")),
            "rank 2 is the server"
        );
    }
    let best = rows.values().map(|r| r["val_accuracy"]).fold(0.0, f64::max);
    assert!(best >= 70.0, "ADAG must learn: {rows:?}");
    // The exported model is the best epoch's servers' model with the lead's statistics.
    let exported = folder_accuracy(&run.join("model.bpk"), &data.join("val"), 32);
    assert!((exported - best).abs() < 1e-6, "{exported} vs {best}");
    assert!(run.join("metrics.png").is_file());
    assert!(run.join("checkpoint").join("ps.state").is_file());
    let server = job.log(2);
    assert!(server.contains("parameter server 0:"), "{server}");
}

/// Early stopping reaches every asynchronous worker at the same epoch: with `--min-delta 100`
/// no epoch after the first improves, so `--patience 1` ends the run after epoch 2 on every
/// rank, and the export is epoch 1's servers' model.
#[test]
fn patience_stops_every_asynchronous_worker_and_exports_the_best_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let run = dir.path().join("run");
    let args = [
        "--ps",
        "1",
        "--mode",
        "adag",
        "--window",
        "2",
        "--epochs",
        "6",
        "--patience",
        "1",
        "--min-delta",
        "100",
    ];
    let mut job = Job::start(dir.path(), &data, &run, 3, &args, &[]);
    let ok = job.wait(240);
    assert!(ok.iter().all(|&o| o), "{}", job.all_logs());
    let rows = metrics(&run);
    assert_eq!(
        rows.keys().copied().collect::<Vec<_>>(),
        vec![1, 2],
        "{rows:?}"
    );
    // Both workers trained both epochs (and no more): their curves are in every row.
    for row in rows.values() {
        assert!(row.contains_key("train_loss_rank1"), "{row:?}");
    }
    let lead = job.log(0);
    assert!(
        lead.contains("early stopping after epoch 2: no improvement of val_accuracy in 1 epochs"),
        "{lead}"
    );
    assert!(lead.contains("epoch 2/6: train loss"), "{lead}");
    let exported = folder_accuracy(&run.join("model.bpk"), &data.join("val"), 32);
    let first = rows[&1]["val_accuracy"];
    assert!(
        (exported - first).abs() < 1e-6,
        "{exported} vs epoch 1's {first}"
    );
}

#[test]
fn sync_servers_train_like_data_parallel_with_the_default_flags() {
    // Defaults included: SGD with momentum 0.9, weight decay 5e-4 on layer weights, one
    // warmup epoch then cosine decay, light augmentation.
    sync_servers_equal_data_parallel(&[], false, 1);
}

#[test]
fn sync_servers_accumulate_gradients_like_data_parallel() {
    // Ten batches per worker and epoch: steps of three batches, and a last one of one.
    sync_servers_equal_data_parallel(
        &["--grad-accum", "3", "--optimizer", "adam", "--lr", "0.002"],
        false,
        1,
    );
}

#[test]
fn sync_servers_fine_tune_after_a_frozen_phase_like_data_parallel() {
    // Epoch 1 trains the head on head-only shards; then the servers re-shard the whole model,
    // the head's momentum moving with it, at --finetune-lr from the step reached.
    sync_servers_equal_data_parallel(
        &[
            "--freeze-backbone",
            "--unfreeze-after",
            "1",
            "--finetune-lr",
            "0.005",
        ],
        false,
        // Two servers: each session's rounds agreed between them, and none of the first
        // session's messages read in the second.
        2,
    );
}

#[test]
fn sync_servers_resume_exactly_at_and_after_the_fine_tuning_switch() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let base = [
        "--batch-size",
        "24",
        "--model",
        "vgg-mini-plain",
        "--epochs",
        "3",
        "--freeze-backbone",
        "--unfreeze-after",
        "1",
    ];
    let run = |name: &str, extra: &[&str]| sync_job(dir.path(), &data, name, 1, &base, extra);
    run("straight", &[]);
    let last = |name: &str| last_model(dir.path(), name, 3);
    let straight = last("straight");
    // Stopped after the frozen epoch (the switch comes first on resume) and after the first
    // fine-tuning epoch (the checkpoint holds the whole model's shards).
    for (name, stop) in [("at", "1"), ("after", "2")] {
        run(name, &["--stop-after-epoch", stop]);
        let log = run(name, &["--resume"]);
        assert!(
            log.contains(&format!("resuming after epoch {stop}")),
            "{log}"
        );
        let resumed = last(name);
        let worst = largest_gap(&straight, &resumed);
        assert!(worst <= 1e-5, "resumed after epoch {stop}: {worst}");
    }
}

#[test]
fn a_servers_state_resumes_on_another_number_of_servers() {
    // Sync servers with momentum: a run stopped on 2 servers resumes on 1 (the shards joined),
    // one stopped on 1 resumes on 2 (cut anew); both end where the uninterrupted run does.
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let base = ["--batch-size", "24", "--epochs", "2"];
    let run = |name: &str, servers: usize, extra: &[&str]| {
        sync_job(dir.path(), &data, name, servers, &base, extra)
    };
    let last = |name: &str| last_model(dir.path(), name, 2);
    run("straight", 1, &[]);
    let straight = last("straight");
    for (name, before, after) in [("joined", 2, 1), ("cut", 1, 2)] {
        run(name, before, &["--stop-after-epoch", "1"]);
        let log = run(name, after, &["--resume"]);
        assert!(
            log.contains(&format!(
                "written by {before} server(s): cut anew for {after}"
            )),
            "{log}"
        );
        let resumed = last(name);
        let worst = largest_gap(&straight, &resumed);
        assert!(worst <= 1e-5, "{before} -> {after} servers: {worst}");
    }
}

#[test]
fn sync_servers_train_multi_label_sets_like_data_parallel() {
    // Binary cross-entropy per label, the Hamming score, the lead's AUROC and auroc.csv.
    sync_servers_equal_data_parallel(&["--optimizer", "adamw", "--lr", "0.002"], true, 1);
}

/// `--ps 1 --mode sync` on 2 workers and `--nproc 2` with the same `flags` train the same
/// curves and export the same model. A model without batch norm or dropout, so the two runs
/// compute the same thing. `multi_label`: on a multi-label CSV over the same images.
fn sync_servers_equal_data_parallel(flags: &[&str], multi_label: bool, servers: usize) {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let labels = common::multi_label_csv(&data);
    let mut base = vec![
        "--batch-size",
        "24",
        "--model",
        "vgg-mini-plain",
        "--epochs",
        "3",
    ];
    base.extend_from_slice(flags);
    if multi_label {
        // 216 training images (strata of 140, 70 and 70 by first label): full batches, where
        // burn-train's loss metric (batches weighted equally) and ours (by samples) agree.
        base.extend([
            "--labels",
            labels.to_str().unwrap(),
            "--val-fraction",
            "0.2286",
        ]);
    }
    let ddp_run = dir.path().join("ddp");
    let mut ddp = Job::spawn(dir.path(), &data, &ddp_run, 2, &base, &[], &[]);
    let ok = ddp.wait(300);
    assert!(ok.iter().all(|&o| o), "{}", ddp.all_logs());
    let ps_run = dir.path().join("ps");
    let n = servers.to_string();
    let args = ["--ps", &n, "--mode", "sync"];
    let mut ps = Job::spawn(dir.path(), &data, &ps_run, 2 + servers, &base, &args, &[]);
    let ok = ps.wait(300);
    assert!(ok.iter().all(|&o| o), "{}", ps.all_logs());
    let (a, b) = (metrics(&ddp_run), metrics(&ps_run));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    // The training curves (every worker's) and the rate; validation is compared on the
    // models themselves below (burn-train's val_loss is not the exported weights' loss on
    // the validation set to 1e-5 even in one process: see ARCHITECTURE.md).
    for (epoch, row) in &a {
        let cols = [
            "train_loss",
            "train_loss_rank0",
            "train_loss_rank1",
            "train_lr",
        ];
        for col in cols {
            let (x, y) = (row[col], b[epoch][col]);
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "epoch {epoch} {col}: data parallel {x}, sync servers {y}\n{a:?}\n{b:?}"
            );
        }
    }
    // The schedule ran: warmup then decay, not the constant --lr.
    let lr: Vec<f64> = b.values().map(|r| r["train_lr"]).collect();
    assert!(lr[2] < lr[0], "{lr:?}");
    // The exported models (the best epoch's weights, the same epoch in both) give the same
    // logits.
    let ddp_log = ddp.log(0);
    let ps_log = ps.log(0);
    assert_eq!(
        common::best_epoch(&ddp_log),
        common::best_epoch(&ps_log),
        "both export the same epoch"
    );
    let worst = common::exported_logit_gap(
        &ddp_run.join("model.bpk"),
        &ps_run.join("model.bpk"),
        &data.join("val"),
        32,
    );
    assert!(worst <= 1e-5, "exported models differ by {worst}");
    if multi_label {
        for row in b.values() {
            assert!((0.0..=100.0).contains(&row["val_auroc"]), "{b:?}");
            assert!((0.0..=100.0).contains(&row["train_accuracy"]), "{b:?}");
        }
        let written = std::fs::read_to_string(ps_run.join("auroc.csv")).unwrap();
        assert_eq!(
            written.lines().count(),
            4,
            "a header and a, b, c: {written}"
        );
    }
}

#[test]
fn colocated_sync_servers_stop_and_resume_from_their_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let run = dir.path().join("run");
    let common = ["--ps", "colocated", "--mode", "sync", "--epochs", "4"];
    let mut first: Vec<&str> = common.to_vec();
    first.extend(["--stop-after-epoch", "2"]);
    let mut job = Job::start(dir.path(), &data, &run, 2, &first, &[]);
    let ok = job.wait(240);
    assert!(ok.iter().all(|&o| o), "{}", job.all_logs());
    assert!(
        job.log(0).contains("2 colocated, 2 workers"),
        "{}",
        job.log(0)
    );
    assert_eq!(metrics(&run).len(), 2);
    drop(job);

    // --resume takes the run directory in place of --run-dir.
    let mut second: Vec<&str> = common.to_vec();
    second.push("--resume");
    let mut job = Job::start(dir.path(), &data, &run, 2, &second, &[]);
    let ok = job.wait(240);
    assert!(ok.iter().all(|&o| o), "{}", job.all_logs());
    assert!(
        job.log(0).contains("resuming after epoch 2"),
        "{}",
        job.log(0)
    );
    let rows = metrics(&run);
    assert_eq!(rows.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    // The servers went on from the checkpoint's version: 10 steps per epoch.
    assert_eq!(rows[&4]["server_version"], 40.0, "{rows:?}");
    let best = rows.values().map(|r| r["val_accuracy"]).fold(0.0, f64::max);
    assert!(best >= 70.0, "sync must learn: {rows:?}");
}

#[test]
fn a_dead_server_fails_every_worker_within_10_s_naming_its_shard() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let run = dir.path().join("run");
    let args = [
        "--ps", "2", "--mode", "downpour", "--window", "1", "--epochs", "200",
    ];
    let mut job = Job::start(dir.path(), &data, &run, 4, &args, &[]);
    wait_for_file(&run.join("metrics.csv"), &mut job);
    job.children[3].kill().unwrap(); // shard 1's server, SIGKILL
    let killed = Instant::now();
    let until = killed + Duration::from_secs(60);
    for r in 0..2 {
        let status = wait_bounded(&mut job.children[r], until);
        let took = killed.elapsed();
        let text = job.log(r);
        let status = status.unwrap_or_else(|| panic!("worker {r} hung:\n{text}"));
        assert!(!status.success(), "worker {r} must fail:\n{text}");
        assert!(
            text.contains("shard 1 of 2"),
            "worker {r} names the shard:\n{text}"
        );
        assert!(
            took < Duration::from_secs(10),
            "worker {r} noticed after {took:?}:\n{text}"
        );
    }
}

#[test]
fn a_dead_worker_does_not_stop_asynchronous_training() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let run = dir.path().join("run");
    // Workers 0, 1, 2; rank 3 serves. Worker 2 dies at its 5th step.
    let args = [
        "--ps", "1", "--mode", "adag", "--window", "2", "--epochs", "3",
    ];
    let mut job = Job::start(
        dir.path(),
        &data,
        &run,
        4,
        &args,
        &[("HEARTH_PS_DIE_AT_STEP", "w2:5")],
    );
    let ok = job.wait(240);
    let logs = job.all_logs();
    assert!(ok[0] && ok[1] && ok[3], "{logs}");
    assert!(!ok[2], "worker 2 was killed:\n{logs}");
    assert!(job.log(3).contains("dropped worker 2"), "{logs}");
    assert!(job.log(0).contains("worker 2 was lost"), "{logs}");
    let rows = metrics(&run);
    assert_eq!(rows.len(), 3);
    assert!(rows[&3].contains_key("train_accuracy_rank1"));
    assert!(!rows[&3].contains_key("train_accuracy_rank2"));
}

/// Issue 55: with every flag but the data and the epochs at its default, each asynchronous
/// mode learns close to sync on a 10-class set of 1,440 images. Each worker's momentum of 0.9
/// compounded by the servers' sum of 4 workers' changes made DOWNPOUR fall apart (best 42%
/// against sync's 84% with this seed); it now defaults to plain local steps, and EASGD's
/// elastic force to 0.5 at the peak rate (best 70% with ρ = 5). Measured with these settings
/// (BENCHMARKS.md): every asynchronous mode 3 to 12 points under sync's best epoch, the
/// asynchronous modes learning slower per sample; 20 points is the bound that divergence
/// crosses and noise does not.
#[test]
fn every_asynchronous_mode_learns_near_sync_with_the_default_flags() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    hearth::datasets::synth::generate(
        &data,
        &hearth::datasets::synth::SynthConfig::new(10, 144, 32)
            .with_seed(3)
            .with_val(36),
    )
    .unwrap();
    let best = |mode: &str| -> f64 {
        let run = dir.path().join(mode);
        let args = ["--ps", "1", "--mode", mode, "--epochs", "8", "--seed", "1"];
        Job::spawn_ok(dir.path(), &data, &run, 5, &[], &args, &[]);
        let rows = metrics(&run);
        assert_eq!(rows.len(), 8, "{mode}");
        rows.values()
            .map(|r| r["val_accuracy"])
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let sync = best("sync");
    assert!(sync > 60.0, "sync learned to only {sync:.1}%");
    let gaps: Vec<(&str, f64)> = ["downpour", "adag", "dynsgd", "easgd"]
        .into_iter()
        .map(|m| (m, sync - best(m)))
        .collect();
    eprintln!("points under sync's best {sync:.1}%: {gaps:?}");
    assert!(
        gaps.iter().all(|&(_, gap)| gap < 20.0),
        "points under sync's best {sync:.1}%: {gaps:?}"
    );
    // hparams.json records what ran, so that a resume takes the same.
    let text = std::fs::read_to_string(dir.path().join("downpour/hparams.json")).unwrap();
    let h: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(h["momentum"], 0.0, "{text}");
    assert_eq!(h["ps"]["window"], 2, "{text}");
}

#[test]
fn sync_names_the_slow_worker_every_epoch_and_adag_does_not_wait_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let run = dir.path().join("run");
    let args = ["--ps", "1", "--mode", "sync", "--epochs", "2"];
    let mut job = Job::start(
        dir.path(),
        &data,
        &run,
        3,
        &args,
        &[("HEARTH_PS_DELAY_MS", "w1:60")],
    );
    let ok = job.wait(240);
    assert!(ok.iter().all(|&o| o), "{}", job.all_logs());
    let lead = job.log(0);
    for e in 1..=2 {
        assert!(
            lead.contains(&format!(
                "epoch {e}: the sync rounds waited mostly for worker 1"
            )),
            "{lead}"
        );
    }
    let rows = metrics(&run);
    for row in rows.values() {
        assert!(
            row["wait_seconds_rank0"] > row["wait_seconds_rank1"],
            "{row:?}"
        );
    }
    drop(job);

    // ADAG does not wait for it: the fast worker runs ahead (the server's largest lead is in
    // steps, not time). Sync's lead is 0 by construction.
    let run = dir.path().join("run-adag");
    let args = [
        "--ps", "1", "--mode", "adag", "--window", "2", "--epochs", "2",
    ];
    let mut job = Job::start(
        dir.path(),
        &data,
        &run,
        3,
        &args,
        &[("HEARTH_PS_DELAY_MS", "w1:60")],
    );
    let ok = job.wait(240);
    assert!(ok.iter().all(|&o| o), "{}", job.all_logs());
    let server = job.log(2);
    let lead: u64 = server
        .split("largest lead ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no lead in the server's log:\n{server}"));
    assert!(
        lead >= 6,
        "the fast worker was held back (lead {lead}):\n{server}"
    );
}

/// The error `train` stops with before it joins any job.
fn refused(cfg: &hearth::train::TrainConfig) -> String {
    hearth::train::train(cfg, &burn::prelude::Device::flex(), &mut |_| {})
        .map(|_| ())
        .unwrap_err()
        .to_string()
}

/// Through the library, so the refusals name settings (`optim.optimizer`); the command line's
/// flags for the same refusals are checked in `tests/flags.rs`.
#[test]
fn settings_that_do_not_fit_a_parameter_server_run_are_refused() {
    use hearth::train::TrainingMode::ParameterServers;
    let mut cfg = hearth::train::TrainConfig::new("unused".into());
    cfg.dist = Some(hearth::dist::rendezvous::RankInfo {
        rank: 0,
        world: 3,
        local_rank: None,
        coordinator: "127.0.0.1:1".into(),
        source: "test",
    });
    let ps = |servers| hearth::train::PsOptions {
        servers,
        ..Default::default()
    };
    cfg.batch_size = 24;
    cfg.mode = ParameterServers(ps(hearth::train::PsServers::Dedicated(3)));
    let e = refused(&cfg);
    assert!(e.contains("no worker"), "{e}");
    cfg.mode = ParameterServers(ps(hearth::train::PsServers::Dedicated(1)));
    cfg.batch_size = 25;
    let e = refused(&cfg);
    assert!(e.contains("2 workers"), "{e}");
    cfg.batch_size = 24;
    cfg.optim.optimizer = hearth::train::OptimizerKind::Lars;
    let e = refused(&cfg);
    assert!(
        e.contains("`optim.optimizer` lars does not work with `TrainingMode::ParameterServers`"),
        "{e}"
    );
    cfg.optim.optimizer = hearth::train::OptimizerKind::Sgd;
    cfg.exchange.compression = hearth::dist::Compression::Bf16;
    let e = refused(&cfg);
    assert!(
        e.contains(
            "`exchange.compression` bf16 does not apply to `TrainingMode::ParameterServers`"
        ),
        "{e}"
    );
    cfg.exchange.compression = hearth::dist::Compression::None;
    assert!("fast".parse::<hearth::train::PsMode>().is_err());
    // EASGD's elastic force α = rate x rho above 1 overshoots the centre.
    let easgd = |rho| hearth::train::PsOptions {
        mode: hearth::train::PsMode::Easgd,
        rho,
        ..ps(hearth::train::PsServers::Dedicated(1))
    };
    cfg.optim.lr = 0.05;
    cfg.mode = ParameterServers(easgd(Some(30.0)));
    let e = refused(&cfg);
    assert!(
        e.contains("`PsOptions.rho` 30") && e.contains("at most 20"),
        "{e}"
    );
    cfg.mode = ParameterServers(hearth::train::PsOptions {
        mode: hearth::train::PsMode::Sync,
        window: Some(5),
        ..ps(hearth::train::PsServers::Dedicated(1))
    });
    let e = refused(&cfg);
    assert!(
        e.contains("`PsOptions.window` 5") && e.contains("`PsOptions.mode` sync"),
        "{e}"
    );
}

/// The modes' defaults where a flag is not given: what the asynchronous modes need to learn
/// (issue 55), and the rest as before.
#[test]
fn each_mode_takes_its_own_defaults_where_a_flag_is_not_given() {
    use hearth::train::{PsMode, PsOptions, TrainConfig};
    let mut cfg = TrainConfig::new("unused".into());
    assert_eq!(cfg.momentum(), 0.9);
    for (mode, momentum, window) in [
        (PsMode::Sync, 0.9, 1),
        (PsMode::Downpour, 0.0, 2),
        (PsMode::Adag, 0.5, 5),
        (PsMode::DynSgd, 0.0, 5),
        (PsMode::Easgd, 0.9, 2),
    ] {
        let opts = PsOptions {
            mode,
            ..Default::default()
        };
        assert_eq!(opts.window(), window, "{mode}");
        cfg.mode = hearth::train::TrainingMode::ParameterServers(opts);
        assert_eq!(cfg.momentum(), momentum, "{mode}");
        cfg.optim.momentum = Some(0.7);
        assert_eq!(cfg.momentum(), 0.7, "{mode}: a given momentum stands");
        cfg.optim.momentum = None;
        // Fine-tuning from weights: ADAG's momentum is the usual one again (seed 000's recipe
        // learned too slowly with 0.5), the other modes' stay.
        cfg.model.weights = Some("resnet18.pth".into());
        let tuned = if mode == PsMode::Adag { 0.9 } else { momentum };
        assert_eq!(cfg.momentum(), tuned, "{mode} from weights");
        cfg.model.weights = None;
    }
}
