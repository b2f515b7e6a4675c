//! The `hearth` binary's main thread computes as one of rayon's pool threads
//! (`hearth::kernels::join_global_pool`, `HEARTH_JOIN_POOL=0` opts out). Batch norm's running
//! statistics are Burn `RunningState`s, kept per thread and averaged over the threads that
//! updated them: running the steps on other threads than the caller's changed a model's
//! statistics (a first version did, and parameter-server runs stopped resuming exactly). The
//! pool's size stays the same, so a run with the main thread in the pool must equal one
//! without it, running statistics included.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::small_data;

/// `hearth train` of a batch-norm (and a dropout) network into `run`, `HEARTH_JOIN_POOL` set
/// to `join`, 2 pool threads.
fn train(data: &Path, run: &Path, model: &str, join: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["train", "--data"])
        .arg(data)
        .args([
            "--model",
            model,
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--size",
            "32",
        ])
        .args(["--workers", "1", "--run-dir"])
        .arg(run)
        .env("HEARTH_JOIN_POOL", join)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = common::wait_bounded(&mut child, Instant::now() + Duration::from_secs(240));
    assert!(
        status.is_some_and(|s| s.success()),
        "hearth train --model {model} (HEARTH_JOIN_POOL={join}) failed"
    );
}

#[test]
fn the_main_thread_in_the_pool_trains_exactly_as_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for model in ["resnet-mini", "densenet-mini", "vgg-mini"] {
        let (on, off) = (
            dir.path().join(format!("{model}-on")),
            dir.path().join(format!("{model}-off")),
        );
        train(&data, &on, model, "1");
        train(&data, &off, model, "0");
        let gaps = common::tensor_gaps(&on.join("model.bpk"), &off.join("model.bpk"));
        assert!(
            gaps.iter().any(|(name, _)| name.contains("running_var")),
            "{model}: the exported model holds batch norm's running statistics"
        );
        for (name, diff) in gaps {
            assert!(
                diff <= 1e-6,
                "{model} {name}: differs by {diff} with the main thread in the pool"
            );
        }
    }
}
