//! Every record loads on the run's own device (issue 55).
//!
//! burn-optim builds loaded optimizer state on Burn's default device (`Device::default()`),
//! which is the first backend compiled in unless `BURN_DEVICE` names another. A CUDA build on a
//! machine without a GPU panicked there on every resume, at the fine-tuning switch and in an
//! elastic re-forming. Here every process runs with `BURN_DEVICE=cuda`, a backend this build
//! lacks (Burn panics when asked for it, as a CUDA build panics without a driver), on
//! `--device flex`: each mode that loads a checkpoint or a peer's state must finish. A program
//! embedding the library without pinning Burn's default gets a clear error, not a panic.
//! Every process is bounded in time.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The small run every test here trains (its data, epochs and run directory aside).
const SMALL: [&str; 8] = [
    "--model",
    "resnet-mini",
    "--size",
    "32",
    "--batch-size",
    "8",
    "--workers",
    "1",
];

/// A backend Burn cannot start in this build.
const UNUSABLE_DEFAULT: (&str, &str) = ("BURN_DEVICE", "cuda");

/// `hearth ARGS` with Burn's default device unusable; its log, after asserting it succeeded.
fn hearth_ok(dir: &Path, args: &[&str]) -> String {
    let log = dir.join(format!(
        "log-{}.txt",
        args.join("_").replace(['/', '.'], "")
    ));
    let file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(args)
        .env(UNUSABLE_DEFAULT.0, UNUSABLE_DEFAULT.1)
        .env("HEARTH_JOB_SECRET", "08b34a1c32b732f5e950f6c201136522")
        .env("HEARTH_COLLECTIVE_TIMEOUT", "120")
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap();
    let status = common::wait_bounded(&mut child, Instant::now() + Duration::from_secs(300));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.is_some_and(|s| s.success()),
        "hearth {args:?} failed with BURN_DEVICE=cuda:\n{text}"
    );
    assert!(!text.contains("panicked"), "{args:?}:\n{text}");
    text
}

/// Trains `extra` for one epoch of two into `run`, then resumes it (with `resume_extra`); the
/// resumed run's log.
fn stop_and_resume(
    dir: &Path,
    data: &Path,
    run: &str,
    extra: &[&str],
    resume_extra: &[&str],
) -> String {
    let run = dir.join(run);
    let mut first = vec!["train", "--data", data.to_str().unwrap()];
    first.extend(SMALL);
    first.extend([
        "--epochs",
        "2",
        "--stop-after-epoch",
        "1",
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    first.extend(extra);
    hearth_ok(dir, &first);
    assert_eq!(common::metrics(&run).len(), 1, "{}", run.display());
    let mut again = vec!["train", "--resume", run.to_str().unwrap()];
    again.extend(resume_extra);
    let log = hearth_ok(dir, &again);
    assert!(log.contains("resum"), "{log}");
    assert_eq!(
        common::metrics(&run).keys().copied().collect::<Vec<_>>(),
        [1, 2],
        "{} resumed at epoch 2:\n{log}",
        run.display()
    );
    log
}

#[test]
fn one_process_data_parallel_servers_and_a_pipeline_resume_with_burns_default_unusable() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    stop_and_resume(dir.path(), &data, "one", &[], &[]);
    // A bare `--resume RUN` starts the run on the processes it was trained on (issue 55: it
    // resumed a data-parallel run as one process).
    let ps = ["--nproc", "3", "--ps", "1", "--mode", "sync"];
    let pipeline = ["--nproc", "2", "--pipeline-stages", "2"];
    for (name, extra, ranks) in [
        ("dp", &["--nproc", "2"][..], 2),
        ("ps", &ps[..], 3),
        ("pipeline", &pipeline[..], 2),
    ] {
        let log = stop_and_resume(dir.path(), &data, name, extra, &[]);
        let said = format!("--resume: {ranks} processes, as");
        assert!(log.contains(&said), "{name}:\n{log}");
        let last = format!("[rank {}]", ranks - 1);
        assert!(
            log.contains(&last),
            "{name} resumed on {ranks} ranks:\n{log}"
        );
    }
}

#[test]
fn a_bare_resume_without_hparams_json_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    let run = dir.path().join("one");
    stop_and_resume(dir.path(), &data, "one", &[], &[]);
    std::fs::remove_file(run.join("hparams.json")).unwrap();
    let out = common::hearth_cli(&["train", "--resume", run.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("hparams.json is missing"), "{err}");
}

#[test]
fn the_fine_tuning_switch_loads_its_checkpoint_with_burns_default_unusable() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    stop_and_resume(dir.path(), &data, "pretrained", &[], &[]);
    let weights = dir.path().join("pretrained/model.bpk");
    let run = dir.path().join("tuned");
    let log = hearth_ok(
        dir.path(),
        &[
            &["train", "--data", data.to_str().unwrap()][..],
            &SMALL,
            &[
                "--epochs",
                "3",
                "--weights",
                weights.to_str().unwrap(),
                "--freeze-backbone",
                "--unfreeze-after",
                "1",
                "--run-dir",
                run.to_str().unwrap(),
            ][..],
        ]
        .concat(),
    );
    assert_eq!(common::metrics(&run).len(), 3, "{log}");
}

#[test]
fn an_elastic_world_re_forms_after_rank_0_dies_and_resumes_with_burns_default_unusable() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::elastic_data(dir.path());
    let run = dir.path().join("elastic");
    let elastic = |how: &str, extra: &[&str], env: &[(&str, &str)]| {
        let log = dir.path().join(format!("elastic{how}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args(["launch", "--elastic", "-n", "3", "--min", "2", "--max", "3"])
            .args(["--", "hearth", "train", "--elastic", "--data"])
            .arg(&data)
            .args([how, run.to_str().unwrap()])
            .args(common::ELASTIC_TRAIN)
            .args(["--epochs", "3"])
            .args(extra)
            .envs(env.iter().copied())
            .env(UNUSABLE_DEFAULT.0, UNUSABLE_DEFAULT.1)
            .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
            .stdout(Stdio::from(file.try_clone().unwrap()))
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap();
        let status = common::wait_bounded(&mut child, Instant::now() + Duration::from_secs(240));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(status.is_some_and(|s| s.success()), "{how}:\n{text}");
        assert!(!text.contains("panicked"), "{how}:\n{text}");
        text
    };
    // w0 dies in epoch 2: w1 and w2 re-form from the last commit's state.
    let log = elastic(
        "--run-dir",
        &["--stop-after-epoch", "2"],
        &[("HEARTH_ELASTIC_DIE_AT_STEP", "w0:15")],
    );
    assert!(
        log.contains("membership epoch 1: 2 workers [w1, w2]"),
        "{log}"
    );
    let finals: Vec<_> = log.lines().filter_map(common::final_weights).collect();
    assert_eq!(finals.len(), 2, "{log}");
    // The run stopped after epoch 2 resumes from its checkpoint.
    // A bare resume outside `hearth launch --elastic` is refused, naming the way.
    let out = common::hearth_cli(&["train", "--resume", run.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("hearth launch --elastic"),
        "{err}"
    );
    let log = elastic("--resume", &[], &[]);
    assert!(log.contains("resum"), "{log}");
    assert_eq!(common::metrics(&run).len(), 3, "{log}");
}

#[test]
fn the_library_refuses_to_load_optimizer_state_where_burns_default_is_another_backend() {
    // This test binary never pins Burn's default device: it is wgpu in this build (the first
    // GPU backend compiled in), and the run is on Flex.
    assert!(
        std::env::var_os("BURN_DEVICE").is_none(),
        "run this test without BURN_DEVICE set"
    );
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    let mut cfg = common::small_config(&data, dir.path().join("run"));
    cfg.checkpoint.stop_after_epoch = Some(1);
    let flex = burn::prelude::Device::flex();
    hearth::train::train(&cfg, &flex, &mut |_| {}).unwrap();
    cfg.checkpoint.stop_after_epoch = None;
    cfg.checkpoint.resume = true;
    let e = hearth::train::train(&cfg, &flex, &mut |_| {})
        .expect_err("a resume with Burn's default on another backend is refused")
        .to_string();
    assert!(
        e.contains("Burn's default device is wgpu")
            && e.contains("BURN_DEVICE=flex")
            && e.contains("pin_burn_default"),
        "{e}"
    );
    // Pinned, as the message says, the same resume finishes.
    // SAFETY: no other test of this binary reads the environment from C.
    unsafe { hearth::device::pin_burn_default(hearth::device::DeviceChoice::Flex) }
    let report = hearth::train::train(&cfg, &flex, &mut |_| {}).unwrap();
    assert_eq!(report.epochs_run, 2);
    assert_eq!(common::metrics(&dir.path().join("run")).len(), 2);
}
