//! `hearth train --pipeline-stages`: a run split over processes validates every epoch, writes
//! metrics.csv, exports the whole model (which, loaded on one process, scores exactly the
//! validation accuracy the pipeline reported for the best epoch), resumes exactly from the
//! stages' checkpoints, and trains 2 pipelines x 2 stages as 4 processes. Every run is a real
//! `hearth` process tree, bounded in time.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{folder_accuracy, metrics, small_data, tensors};

/// Runs `hearth train` with `args` (plus the small run's settings); (success, output).
fn hearth_train(data: &Path, args: &[&str]) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.txt");
    let file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["train", "--data"])
        .arg(data)
        .args([
            "--batch-size",
            "8",
            "--lr",
            "0.05",
            "--warmup-epochs",
            "0",
            "--workers",
            "1",
            "--size",
            "32",
        ])
        .args(args)
        .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap();
    let status = common::wait_bounded(&mut child, Instant::now() + Duration::from_secs(300));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    (status.is_some_and(|s| s.success()), text)
}

/// The epoch of the highest validation accuracy (the first of equals), as the run picks it.
fn best_by_accuracy(rows: &BTreeMap<usize, BTreeMap<String, f64>>) -> (usize, f64) {
    rows.iter()
        .map(|(e, r)| (*e, r["val_accuracy"]))
        .fold((0, f64::MIN), |b, (e, a)| if a > b.1 { (e, a) } else { b })
}

#[test]
fn a_pipeline_run_exports_what_it_validated_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let straight = dir.path().join("straight");
    let split = dir.path().join("split");
    let pipeline = [
        "--pipeline-stages",
        "2",
        "--micro-batches",
        "2",
        "--epochs",
        "3",
    ];

    let run = |run_dir: &Path, extra: &[&str]| {
        let mut args: Vec<&str> = pipeline.to_vec();
        args.extend(extra);
        let (ok, text) = hearth_train(&data, &args);
        assert!(ok, "{} {extra:?}:\n{text}", run_dir.display());
        text
    };
    let text = run(&straight, &["--run-dir", straight.to_str().unwrap()]);
    assert!(
        text.contains("stage 0: units 0.."),
        "the split is printed:\n{text}"
    );
    assert!(text.contains("stage 1: units"), "{text}");
    // Settings are printed as the command line spells them, not as Rust debug text.
    assert!(text.contains(", 1f1b schedule"), "{text}");
    assert!(!text.contains("OneFOneB"), "{text}");

    let rows = metrics(&straight);
    assert_eq!(rows.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
    for row in rows.values() {
        for column in ["train_loss", "train_accuracy", "val_loss", "val_accuracy"] {
            assert!(row[column].is_finite(), "{column}: {row:?}");
        }
    }
    assert!(
        rows[&3]["train_loss"] < rows[&1]["train_loss"],
        "training lowers the loss: {rows:?}"
    );
    // The whole model assembled from the stages scores, on one process, what the pipeline
    // reported for the best epoch.
    let (best, reported) = best_by_accuracy(&rows);
    let measured = folder_accuracy(&straight.join("model.bpk"), &data.join("val"), 32);
    assert!(
        (measured - reported).abs() < 1e-3,
        "model.bpk scores {measured}%, the pipeline reported {reported}% for epoch {best}"
    );
    assert!(straight.join("metrics.png").is_file());
    // Each stage kept only the best and the last epochs.
    for stage in 0..2 {
        let d = straight.join(format!("checkpoint/stage-{stage}"));
        let mut kept: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with("model-"))
            .collect();
        kept.sort();
        let mut want: Vec<String> = [best, 3].iter().map(|e| format!("model-{e}.bpk")).collect();
        want.sort();
        want.dedup();
        assert_eq!(kept, want, "stage {stage}");
    }

    // Stopped after epoch 2 and resumed: the same epochs and the same model, bit for bit.
    run(
        &split,
        &[
            "--run-dir",
            split.to_str().unwrap(),
            "--stop-after-epoch",
            "2",
        ],
    );
    let text = run(&split, &["--resume", split.to_str().unwrap()]);
    assert!(text.contains("resuming after epoch 2"), "{text}");
    let resumed = metrics(&split);
    for (epoch, row) in &rows {
        for column in ["train_loss", "train_accuracy", "val_loss", "val_accuracy"] {
            assert_eq!(
                row[column], resumed[epoch][column],
                "epoch {epoch} {column}"
            );
        }
    }
    assert_eq!(
        tensors(&straight.join("model.bpk")),
        tensors(&split.join("model.bpk"))
    );
}

/// Transfer learning split over processes: a pipeline started from pretrained weights with a
/// frozen backbone, then unfrozen and fine-tuned, trains what one process trains (the same
/// head seeded by `--seed`, the same steps at the same rates), and exports the same model.
/// One micro-batch and a model without batch norm or dropout, so both compute the same thing.
#[test]
fn pretrained_frozen_then_fine_tuned_pipeline_trains_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let pre = dir.path().join("pretrained");
    let model = ["--model", "vgg-mini-plain", "--augment", "none"];
    let mut args: Vec<&str> = model.to_vec();
    args.extend(["--epochs", "1", "--run-dir", pre.to_str().unwrap()]);
    let (ok, text) = hearth_train(&data, &args);
    assert!(ok, "{text}");
    let weights = pre.join("model.bpk");
    let recipe = [
        "--weights",
        weights.to_str().unwrap(),
        "--freeze-backbone",
        "--unfreeze-after",
        "1",
        "--finetune-lr",
        "0.01",
        "--epochs",
        "3",
    ];
    let one = dir.path().join("one");
    let mut args: Vec<&str> = model.to_vec();
    args.extend(recipe);
    args.extend(["--run-dir", one.to_str().unwrap()]);
    let (ok, text) = hearth_train(&data, &args);
    assert!(ok, "{text}");
    let piped = dir.path().join("piped");
    let mut args: Vec<&str> = model.to_vec();
    args.extend(recipe);
    args.extend([
        "--pipeline-stages",
        "2",
        "--micro-batches",
        "1",
        "--run-dir",
        piped.to_str().unwrap(),
    ]);
    let (ok, text) = hearth_train(&data, &args);
    assert!(ok, "{text}");
    assert!(
        text.contains("unfreezing the backbone after epoch 1"),
        "{text}"
    );
    let (a, b) = (metrics(&one), metrics(&piped));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (epoch, row) in &a {
        for col in ["train_loss", "train_lr"] {
            let (x, y) = (row[col], b[epoch][col]);
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "epoch {epoch} {col}: one process {x}, pipeline {y}\n{a:?}\n{b:?}"
            );
        }
    }
    // The backbone trained only after epoch 1: epoch 2's rate is the fine-tuning one.
    assert!(b[&2]["train_lr"] <= 0.01 + 1e-9, "{b:?}");
    let worst = common::exported_logit_gap(
        &one.join("model.bpk"),
        &piped.join("model.bpk"),
        &data.join("val"),
        32,
    );
    assert!(worst <= 1e-4, "exported models differ by {worst}");
}

#[test]
fn two_pipelines_of_two_stages_train_as_four_processes() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let run = dir.path().join("run");
    let (ok, text) = hearth_train(
        &data,
        &[
            "--pipeline-stages",
            "2",
            "--nproc",
            "4",
            "--pipeline-schedule",
            "gpipe",
            "--epochs",
            "2",
            "--run-dir",
            run.to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    assert!(text.contains("2 stages x 2 replicas"), "{text}");
    let rows = metrics(&run);
    assert_eq!(rows.len(), 2);
    let (_, reported) = best_by_accuracy(&rows);
    let measured = folder_accuracy(&run.join("model.bpk"), &data.join("val"), 32);
    assert!(
        (measured - reported).abs() < 1e-3,
        "{measured} vs {reported}"
    );
}

#[test]
fn bad_pipeline_layouts_fail_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for (args, why) in [
        (
            vec!["--pipeline-stages", "3", "--nproc", "4"],
            "multiple of the number of stages",
        ),
        (
            vec!["--pipeline-stages", "2", "--pipeline-split", "0:2,2:3"],
            "ends at unit 3, but --model resnet-mini has 6 units",
        ),
        (
            vec!["--pipeline-stages", "2", "--grad-accum", "2"],
            "--grad-accum",
        ),
    ] {
        let run = dir.path().join(format!("run-{}", args.len()));
        let mut all = args.clone();
        all.extend(["--epochs", "1", "--run-dir", run.to_str().unwrap()]);
        let (ok, text) = hearth_train(&data, &all);
        assert!(!ok, "{args:?} must fail:\n{text}");
        assert!(text.contains(why), "{args:?}: expected '{why}' in:\n{text}");
    }
}

/// Two ranks of `hearth train --pipeline-stages 2` on `data` into `run`, each with its own
/// extra arguments and its output in `dir/<name>-rank<r>.txt`; the children and their logs.
fn two_stage_ranks(
    dir: &Path,
    data: &Path,
    run: &Path,
    name: &str,
    extra: [&[&str]; 2],
) -> (Vec<std::process::Child>, Vec<std::path::PathBuf>) {
    let port = common::coordinator_port();
    let logs: Vec<_> = (0..2)
        .map(|r| dir.join(format!("{name}-rank{r}.txt")))
        .collect();
    let ranks = (0..2)
        .map(|r| {
            let file = std::fs::File::create(&logs[r]).unwrap();
            Command::new(env!("CARGO_BIN_EXE_hearth"))
                .args(["train", "--data"])
                .arg(data)
                .args(["--batch-size", "8", "--workers", "1", "--size", "32"])
                .args(["--pipeline-stages", "2", "--run-dir"])
                .arg(run)
                .args(extra[r])
                .env("HEARTH_RANK", r.to_string())
                .env("HEARTH_WORLD_SIZE", "2")
                .env("HEARTH_COORDINATOR", format!("127.0.0.1:{port}"))
                .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
                .env("HEARTH_JOB_SECRET", "3191845343c8df2c56705d005db6cc2e")
                .stdout(Stdio::from(file.try_clone().unwrap()))
                .stderr(Stdio::from(file))
                .spawn()
                .unwrap()
        })
        .collect();
    (ranks, logs)
}

#[test]
fn ranks_started_with_other_splits_or_micro_batches_fail_before_the_first_step_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for (case, extra, field) in [
        (
            "micro",
            ["--micro-batches", "4"],
            "--micro-batches (rank 1 has \"4\"; rank(s) [0] another)",
        ),
        (
            "split",
            ["--pipeline-split", "0:2,2:6"],
            "pipeline split (rank 1 has \"0:2,2:6\"; rank(s) [0] another)",
        ),
    ] {
        let run = dir.path().join(case);
        let rank_0: &[&str] = &[
            "--epochs",
            "1",
            "--pipeline-split",
            "0:3,3:6",
            "--micro-batches",
            "2",
        ];
        let mut rank_1 = vec!["--epochs", "1"];
        rank_1.extend(extra);
        let (mut ranks, logs) = two_stage_ranks(dir.path(), &data, &run, case, [rank_0, &rank_1]);
        let until = Instant::now() + Duration::from_secs(120);
        for (r, child) in ranks.iter_mut().enumerate() {
            let status = common::wait_bounded(child, until);
            let text = std::fs::read_to_string(&logs[r]).unwrap_or_default();
            let status = status.unwrap_or_else(|| panic!("{case}: rank {r} hung:\n{text}"));
            assert!(!status.success(), "{case}: rank {r} must fail:\n{text}");
            assert!(
                text.contains("started with different settings") && !text.contains("epoch 1/1"),
                "{case}: rank {r} must stop before training:\n{text}"
            );
            if r == 1 {
                assert!(text.contains(field), "{case}: {field:?} missing:\n{text}");
            }
        }
        let other = std::fs::read_to_string(&logs[0]).unwrap_or_default();
        assert!(
            !other.contains("epoch 1/1") && !run.join("metrics.csv").exists(),
            "{case}: nothing trained:\n{other}"
        );
    }
}

#[test]
fn a_stage_killed_mid_training_fails_the_other_naming_it_within_10_s() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let run = dir.path().join("run");
    let long: &[&str] = &["--epochs", "200"];
    let (mut ranks, logs) = two_stage_ranks(dir.path(), &data, &run, "killed", [long, long]);
    // Training is under way once the first epoch is in metrics.csv.
    let until = Instant::now() + Duration::from_secs(120);
    while !run.join("metrics.csv").is_file() {
        if Instant::now() > until || ranks.iter_mut().any(|c| c.try_wait().unwrap().is_some()) {
            for c in &mut ranks {
                let _ = c.kill();
            }
            panic!(
                "training did not get under way:\n{}",
                std::fs::read_to_string(&logs[0]).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ranks[1].kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    let _ = ranks[1].wait();
    let status = loop {
        if let Some(s) = ranks[0].try_wait().unwrap() {
            break Some(s);
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = ranks[0].kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = killed.elapsed();
    let text = std::fs::read_to_string(&logs[0]).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("rank 0 hung after its neighbour died:\n{text}"));
    assert!(!status.success(), "rank 0 must fail:\n{text}");
    assert!(
        text.contains("rank 1"),
        "the error names the dead stage:\n{text}"
    );
    assert!(
        took < Duration::from_secs(10),
        "noticed after {took:?}:\n{text}"
    );
}

#[test]
fn splits_balanced_by_measured_time_or_memory_are_printed_recorded_and_kept_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let run = dir.path().join("run");
    let common = [
        "--pipeline-stages",
        "2",
        "--pipeline-balance",
        "time",
        "--epochs",
        "2",
    ];
    let mut first: Vec<&str> = common.to_vec();
    first.extend([
        "--stop-after-epoch",
        "1",
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    let (ok, text) = hearth_train(&data, &first);
    assert!(ok, "{text}");
    assert!(text.contains("split (balanced by measured time)"), "{text}");
    assert!(text.contains("ms per micro-batch pass"), "{text}");
    let recorded = std::fs::read_to_string(run.join("pipeline_split.txt")).unwrap();
    let ranges = hearth::train::PipelineOptions::parse_split(recorded.trim()).unwrap();
    assert_eq!(ranges.len(), 2);
    assert_eq!(ranges[1].end, 6, "resnet-mini has 6 units: {recorded}");

    let mut second: Vec<&str> = common.to_vec();
    second.extend(["--resume", run.to_str().unwrap()]);
    let (ok, text) = hearth_train(&data, &second);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!(
            "split (as the run recorded it): {}",
            recorded.trim()
        )),
        "{text}"
    );
    assert_eq!(metrics(&run).len(), 2);

    // By memory: the same measurement, and each stage's estimate is printed.
    let other = dir.path().join("memory");
    let (ok, text) = hearth_train(
        &data,
        &[
            "--pipeline-stages",
            "2",
            "--pipeline-balance",
            "memory",
            "--epochs",
            "1",
            "--run-dir",
            other.to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    assert!(
        text.contains("split (balanced by estimated memory)"),
        "{text}"
    );
    assert!(text.contains(" MB (ranks [1])"), "{text}");
}

#[test]
fn hearth_units_lists_what_a_split_cuts_between() {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["units", "--model", "resnet-mini", "--classes", "3"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.trim_start()
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
        .filter(|l| !l.contains("units,"))
        .collect();
    assert_eq!(rows.len(), 6, "{text}");
    assert!(
        rows[0].contains("ResNet stem") && rows[5].contains("head"),
        "{text}"
    );
    assert!(rows[5].trim_end().ends_with("100.0%"), "{text}");
    assert!(text.contains("--pipeline-split 0:3,3:6"), "{text}");
    let bad = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["units", "--model", "resnet-huge"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown model"));
}

#[test]
fn a_multi_label_pipeline_trains_like_one_process_and_its_auroc_is_the_exported_models() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let labels = common::multi_label_csv(&data);
    let recipe = [
        "--labels",
        labels.to_str().unwrap(),
        "--monitor",
        "val_auroc",
        "--model",
        "vgg-mini-plain",
        "--augment",
        "none",
        "--epochs",
        "2",
        // 48 training images (strata of 44, 11 and 11 by first label): even batches of 8,
        // where burn-train's loss metric (each batch's mean weighted equally) and the
        // pipeline's (weighted by samples) agree.
        "--val-fraction",
        "0.27",
    ];
    let one = dir.path().join("one");
    let mut args = recipe.to_vec();
    args.extend(["--run-dir", one.to_str().unwrap()]);
    let (ok, text) = hearth_train(&data, &args);
    assert!(ok, "{text}");
    let piped = dir.path().join("piped");
    let mut args = recipe.to_vec();
    args.extend([
        "--pipeline-stages",
        "2",
        "--micro-batches",
        "2",
        "--run-dir",
        piped.to_str().unwrap(),
    ]);
    let (ok, text) = hearth_train(&data, &args);
    assert!(ok, "{text}");
    let (a, b) = (metrics(&one), metrics(&piped));
    for (epoch, row) in &a {
        // Binary cross-entropy per label, the Hamming score as accuracy: the same numbers.
        for col in ["train_loss", "train_accuracy", "train_lr"] {
            let (x, y) = (row[col], b[epoch][col]);
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1.0),
                "epoch {epoch} {col}: one process {x}, pipeline {y}\n{a:?}\n{b:?}"
            );
        }
        assert!((0.0..=100.0).contains(&b[epoch]["val_auroc"]), "{b:?}");
    }
    // The epoch's AUROC (gathered from the last stage) is the exported best model's, which
    // rank 0 scores again over the whole validation set.
    let best = b
        .iter()
        .map(|(e, r)| (*e, r["val_auroc"]))
        .fold((0, f64::MIN), |m, (e, v)| if v > m.1 { (e, v) } else { m });
    let mean = common::auroc_csv_mean(&piped);
    assert!(
        (mean - best.1).abs() < 1e-2,
        "auroc.csv mean {mean} vs best epoch {best:?}\n{text}"
    );
    let saved =
        hearth::models::load_model(&piped.join("model.bpk"), &burn::prelude::Device::flex())
            .unwrap();
    assert_eq!(
        saved.model.head_activation(),
        hearth::models::HeadActivation::Sigmoid
    );
    let worst = common::exported_logit_gap(
        &one.join("model.bpk"),
        &piped.join("model.bpk"),
        &data.join("val"),
        32,
    );
    assert!(worst <= 1e-4, "exported models differ by {worst}");
}
