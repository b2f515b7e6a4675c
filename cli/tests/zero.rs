//! `--zero 1|2|3`, data parallel's sharded optimizer, as real process trees: it trains exactly
//! as plain data parallel does (Hearth's image models and a user's module, both through the
//! allreduce strategy; stage 3 Hearth's models), resumes exactly, and its checkpoint resumes on
//! another number of ranks.

mod common;
/// Stage 3's own tests (validation shares, regathering, a bucket per weight).
#[path = "zero/stage3.rs"]
mod stage3;

#[path = "../../examples/custom_model.rs"]
#[allow(dead_code)]
mod example;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Job, metrics, same_curves, same_weights, small_data, wait_bounded};

/// Every value of two runs' `columns`, epoch by epoch, within `tolerance`.
/// The settings every job here shares (the rate and optimizer are each test's; SGD's momentum
/// is its default 0.9, not given: adam refuses `--momentum`).
const BASE: [&str; 8] = [
    "--batch-size",
    "24",
    "--schedule",
    "constant",
    "--warmup-epochs",
    "0",
    "--augment",
    "none",
];

fn run_job(
    dir: &Path,
    data: &Path,
    run: &Path,
    world: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> String {
    Job::spawn_ok(dir, data, run, world, &BASE, args, env)
}

const COLUMNS: [&str; 4] = ["train_loss", "train_accuracy", "val_loss", "val_accuracy"];

#[test]
fn zero_1_2_and_3_train_an_image_model_as_plain_data_parallel_does_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for (name, opts, env) in [
        (
            "sgd",
            &[
                "--optimizer",
                "sgd",
                "--lr",
                "0.05",
                "--weight-decay",
                "0.001",
            ][..],
            &[][..],
        ),
        (
            "adam",
            &["--optimizer", "adam", "--lr", "0.003"][..],
            &[][..],
        ),
        (
            "lars",
            &[
                "--optimizer",
                "lars",
                "--lr",
                "0.5",
                "--weight-decay",
                "0.001",
            ][..],
            &[][..],
        ),
        // fp16 with rank 1's gradients of step 2 forced to overflow: one verdict, the step
        // skipped on both ranks and counted, under both stages.
        (
            "fp16",
            &[
                "--precision",
                "fp16",
                "--optimizer",
                "adam",
                "--lr",
                "0.003",
            ][..],
            &[("HEARTH_FP16_OVERFLOW_AT_STEP", "1:2")][..],
        ),
    ] {
        let run = |zero: &str| dir.path().join(format!("{name}-zero{zero}"));
        let mut curves = Vec::new();
        // "2o": `--zero 2 --overlap`, each bucket reduce-scattered during the backward; "3r":
        // `--zero 3 --recompute`, one unit's parameters gathered at a time; "3o": stage 3's
        // reductions on a thread of their own beside its gathers.
        let stages: &[&str] = match name {
            "adam" => &["0", "1", "2", "1o", "2o", "3", "3r", "3o", "3ro"],
            "fp16" => &["0", "1", "2", "2o", "3", "3o"],
            _ => &["0", "1", "2", "3"],
        };
        for &label in stages {
            let zero = &label[..1];
            let mut args = vec!["--epochs", "2", "--zero", zero];
            let (overlap, recompute) = (label[1..].contains('o'), label[1..].contains('r'));
            if overlap {
                args.push("--overlap");
            }
            if recompute {
                args.push("--recompute");
            }
            args.extend_from_slice(opts);
            let logs = run_job(dir.path(), &data, &run(label), 2, &args, env);
            if overlap {
                assert!(
                    logs.contains("were exchanged during the backward pass")
                        && !logs.contains("`exchange.overlap`: 0 gradient tensors"),
                    "{logs}"
                );
            }
            if zero == "3" {
                assert!(logs.contains("parameter values"), "{logs}");
            }
            if zero == "3" && !overlap {
                // The model's values live in the shards, and every gradient left as its unit's
                // backward ended (no `--overlap` line: nothing overlapped).
                assert!(
                    logs.contains("were reduce-scattered as their units' backward ended"),
                    "{logs}"
                );
                assert!(!logs.contains("--overlap:"), "{logs}");
            }
            if zero != "0" {
                assert!(
                    logs.contains(&format!("ZeRO stage {zero}: rank 0 keeps")),
                    "{logs}"
                );
                assert!(
                    run(label)
                        .join("checkpoint/optim-zero-2.safetensors")
                        .is_file()
                );
            }
            if name == "fp16" {
                assert!(
                    logs.contains("optimizer step 2: gradients not finite, skipped"),
                    "{logs}"
                );
            }
            curves.push(metrics(&run(label)));
        }
        stages_equal_plain(name, stages, &curves, &run);
        if name == "fp16" {
            // The forced skip and any the scale's first steps make on their own (it comes down
            // from 2^16), the same in every run.
            let skipped = |c: &BTreeMap<usize, BTreeMap<String, f64>>| -> f64 {
                c.values().map(|r| r["train_skipped_steps"]).sum()
            };
            assert!(skipped(&curves[0]) >= 1.0, "{:?}", curves[0]);
            for c in &curves[1..] {
                assert_eq!(skipped(c), skipped(&curves[0]), "{c:?}");
            }
        }
    }

    // Stopped after epoch 1 and resumed: the same as straight through (the state restored),
    // on the same two ranks, and on three (re-sharded).
    let stopped = dir.path().join("adam-stopped");
    let adam = [
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--epochs",
        "2",
        "--zero",
        "2",
    ];
    let mut first = adam.to_vec();
    first.extend(["--stop-after-epoch", "1"]);
    resumes_as_straight(dir.path(), &data, &stopped, 2, &first, "adam-zero2", "1");
    // Stage 3 stopped, resumed in stage 3: its checkpoint holds the whole model.
    let stopped = dir.path().join("adam-stopped-3");
    let mut first_3 = first.clone();
    first_3[7] = "3";
    resumes_as_straight(dir.path(), &data, &stopped, 2, &first_3, "adam-zero3", "3");
    let three = dir.path().join("adam-three");
    run_job(dir.path(), &data, &three, 2, &first, &[]);
    let logs = run_job(dir.path(), &data, &three, 3, &["--resume"], &[]);
    assert!(
        logs.contains("ZeRO stage 2: rank 0 keeps") && logs.contains("segment 0 of 3"),
        "{logs}"
    );
    assert_eq!(metrics(&three).len(), 2);

    // Switching sharding off on resume is refused by name (its Burn optimizer file is empty).
    let args = ["--resume", "--zero", "0", "--epochs", "3"];
    let mut job = Job::spawn(dir.path(), &data, &three, 2, &BASE, &args, &[]);
    let ok = job.wait(120);
    assert!(!ok[0], "{}", job.all_logs());
    assert!(job.log(0).contains("without --zero"), "{}", job.log(0));
}

/// The example's binary, built by `cargo test` into the target's `examples/` folder.
fn example_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    profile.join("examples").join("custom_model")
}

/// `hearth launch -n N -- custom_model dp RUN ARGS` to the end; its output.
fn launch(n: usize, run: &Path, args: &[&str]) -> String {
    let (ok, out) = launch_status(n, run, args);
    assert!(ok, "custom_model dp {args:?} on {n} failed or hung:\n{out}");
    out
}

/// [`launch`], whether it succeeded beside its output.
fn launch_status(n: usize, run: &Path, args: &[&str]) -> (bool, String) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let file = log.reopen().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["launch", "-n", &n.to_string(), "--"])
        .arg(example_bin())
        .arg("dp")
        .arg(run)
        .args(args)
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR")
        .env("HEARTH_COLLECTIVE_TIMEOUT", "300")
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut child, Instant::now() + Duration::from_secs(300));
    let out = std::fs::read_to_string(log.path()).unwrap();
    (
        status.is_some_and(|s| s.success()),
        format!("{status:?}\n{out}"),
    )
}

/// A module without batch norm computes the same on any number of ranks (each rank's share of
/// every global batch, averaged), so there the re-sharded resume can be held to the
/// uninterrupted run: 4 ranks stop after epoch 1, 2 ranks resume, and the curve is the
/// 4-rank run's (and plain data parallel's).
#[test]
fn a_state_written_by_four_ranks_resumes_exactly_on_two() {
    let dir = tempfile::tempdir().unwrap();
    let run = |n: &str| dir.path().join(n);
    // Stage 3 gathers a model unit by unit: a user's module without units is refused by name.
    let (ok, out) = launch_status(2, &run("stage-3"), &["--epochs", "1", "--zero", "3"]);
    assert!(!ok && out.contains("this model has no units"), "{out}");
    for (optimizer, lr) in [("adam", "0.01"), ("lars", "5")] {
        let base = ["--epochs", "3", "--optimizer", optimizer, "--lr", lr];
        let mut zero = base.to_vec();
        zero.extend(["--zero", "2"]);
        launch(4, &run(&format!("{optimizer}-plain")), &base);
        let out = launch(4, &run(&format!("{optimizer}-straight")), &zero);
        assert!(out.contains("ZeRO stage 2"), "{out}");
        let mut stop = zero.clone();
        stop.extend(["--stop-after-epoch", "1"]);
        let resumed = run(&format!("{optimizer}-resumed"));
        launch(4, &resumed, &stop);
        let mut again = base.to_vec();
        again.extend(["--resume", "--zero", "1"]);
        let out = launch(2, &resumed, &again);
        assert!(
            out.contains("resuming after epoch 1") && out.contains("segment 0 of 2"),
            "{out}"
        );
        let plain = metrics(&run(&format!("{optimizer}-plain")));
        let straight = metrics(&run(&format!("{optimizer}-straight")));
        same_curves(("plain", &plain), ("zero 2", &straight), &COLUMNS, 1e-5);
        same_curves(
            ("4 ranks", &straight),
            ("4 then 2", &metrics(&resumed)),
            &COLUMNS,
            1e-5,
        );
        // It learned: the spirals are not at chance (33%) after 3 epochs.
        assert!(straight[&3]["val_accuracy"] > 40.0, "{straight:?}");
    }
}

/// A pipeline of 2 stages x 2 replicas (4 processes): each stage's replicas shard its
/// optimizer state. Stages 1 and 2 train exactly as the plain pipeline does (Adam, and SGD with
/// fp16 and a forced overflow on one rank, skipped by every stage), and a stopped run resumes
/// exactly from each stage's state file.
#[test]
fn zero_shards_each_pipeline_stage_over_its_replicas_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let pipe = ["--pipeline-stages", "2", "--micro-batches", "2"];
    for (name, opts, env) in [
        (
            "adam",
            &["--optimizer", "adam", "--lr", "0.003"][..],
            &[][..],
        ),
        // Exact f32 on the wire: with fp16's default wire the replicas' allreduce (plain, stage
        // 1) rounds the averaged gradient to fp16 once more in its all-gather, which stage 2's
        // reduce-scatter does not (its segment's sums stay f32), so they differ by that rounding.
        (
            "fp16",
            &[
                "--precision",
                "fp16",
                "--compression",
                "none",
                "--optimizer",
                "sgd",
                "--lr",
                "0.05",
            ][..],
            &[("HEARTH_FP16_OVERFLOW_AT_STEP", "3:2")][..],
        ),
    ] {
        let run = |zero: &str| dir.path().join(format!("pipe-{name}-zero{zero}"));
        let mut curves = Vec::new();
        for zero in ["0", "1", "2"] {
            let mut args = vec!["--epochs", "2", "--zero", zero];
            args.extend_from_slice(&pipe);
            args.extend_from_slice(opts);
            let logs = run_job(dir.path(), &data, &run(zero), 4, &args, env);
            if zero != "0" {
                assert!(
                    logs.contains(&format!("ZeRO stage {zero} over each stage's 2 replicas")),
                    "{logs}"
                );
                for s in 0..2 {
                    let file = format!("checkpoint/stage-{s}/optim-zero-2.safetensors");
                    assert!(run(zero).join(&file).is_file(), "{file}");
                }
            }
            if name == "fp16" {
                assert!(
                    metrics(&run(zero))
                        .values()
                        .map(|r| r["train_skipped_steps"])
                        .sum::<f64>()
                        >= 1.0
                );
            }
            curves.push(metrics(&run(zero)));
        }
        stages_equal_plain(&format!("pipeline {name}"), &["0", "1", "2"], &curves, &run);
    }
    // Stopped after epoch 1, resumed with the other stage: the uninterrupted run's curve.
    let stopped = dir.path().join("pipe-stopped");
    let mut first = vec![
        "--epochs",
        "2",
        "--zero",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
    ];
    first.extend_from_slice(&pipe);
    first.extend(["--stop-after-epoch", "1"]);
    resumes_as_straight(
        dir.path(),
        &data,
        &stopped,
        4,
        &first,
        "pipe-adam-zero2",
        "1",
    );
}

/// Every stage's run (`run(label)`, its curve beside) equals `run("0")` (curve 0): curves and
/// exported weights, to 1e-5.
fn stages_equal_plain(
    name: &str,
    stages: &[&str],
    curves: &[BTreeMap<usize, BTreeMap<String, f64>>],
    run: &dyn Fn(&str) -> PathBuf,
) {
    for (i, zero) in stages.iter().enumerate().skip(1) {
        same_curves(
            (&format!("{name} plain"), &curves[0]),
            (&format!("{name} zero {zero}"), &curves[i]),
            &COLUMNS,
            1e-5,
        );
        same_weights(
            &run("0").join("model.bpk"),
            &run(zero).join("model.bpk"),
            1e-5,
        );
    }
}

/// `first` (a run stopped after epoch 1) on `world` ranks into `stopped`, then resumed with
/// `--zero <zero>`: the same curve as the uninterrupted run `straight` (in `dir`).
fn resumes_as_straight(
    dir: &Path,
    data: &Path,
    stopped: &Path,
    world: usize,
    first: &[&str],
    straight: &str,
    zero: &str,
) {
    run_job(dir, data, stopped, world, first, &[]);
    let logs = run_job(
        dir,
        data,
        stopped,
        world,
        &["--resume", "--zero", zero],
        &[],
    );
    assert!(logs.contains("resuming after epoch 1"), "{logs}");
    same_curves(
        ("straight", &metrics(&dir.join(straight))),
        ("resumed", &metrics(stopped)),
        &COLUMNS,
        1e-5,
    );
}

/// `--freeze-backbone --unfreeze-after 1` with SGD and Adam: the frozen phase shards the
/// head's state; at the switch the backbone's tensors join, their state starting from zero and
/// Adam's bias correction counting their own steps from there, as burn's optimizer's do. Data
/// parallel (also resumed right at the switch) and a 2 x 2 pipeline train as without `--zero`.
#[test]
fn zero_takes_the_fine_tuning_switch_with_sgd_and_adam() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for (optimizer, lr) in [("sgd", "0.05"), ("adam", "0.003")] {
        let phases = [
            "--freeze-backbone",
            "--unfreeze-after",
            "1",
            "--epochs",
            "2",
            "--optimizer",
            optimizer,
            "--lr",
            lr,
        ];
        for (name, world, layout) in [
            ("dp", 2, &[][..]),
            ("pipe", 4, &["--pipeline-stages", "2"][..]),
        ] {
            let run = |zero: &str| dir.path().join(format!("ft-{optimizer}-{name}-zero{zero}"));
            let mut curves = Vec::new();
            // Data parallel also with `--overlap` ("2o"): the frozen phase hands over the
            // head's gradients alone, the fine-tuning phase every unit's.
            let stages: &[&str] = if world == 2 {
                &["0", "1", "2", "2o"]
            } else {
                &["0", "1", "2"]
            };
            for &label in stages {
                let mut args = vec!["--zero", &label[..1]];
                if label.ends_with('o') {
                    args.push("--overlap");
                }
                args.extend_from_slice(&phases);
                args.extend_from_slice(layout);
                run_job(dir.path(), &data, &run(label), world, &args, &[]);
                curves.push(metrics(&run(label)));
            }
            stages_equal_plain(&format!("{optimizer} {name}"), stages, &curves, &run);
            // Stopped at the switch, resumed: the fine-tuning phase starts from the head's file
            // (in the pipeline, stage 0 trained nothing before it and wrote none).
            let stopped = dir.path().join(format!("ft-{optimizer}-{name}-stopped"));
            let mut first = vec!["--zero", "2", "--stop-after-epoch", "1"];
            first.extend_from_slice(&phases);
            first.extend_from_slice(layout);
            let straight = format!("ft-{optimizer}-{name}-zero2");
            resumes_as_straight(dir.path(), &data, &stopped, world, &first, &straight, "1");
        }
    }
}
