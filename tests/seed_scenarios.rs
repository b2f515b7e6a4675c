//! The seeds' recipes as a newcomer would run them, at test size, through the `hearth` binary.
//!
//! Seed 001 (CheXNet): DenseNet fine-tuned on 14 sigmoid outputs with the AUROC as the model
//! selection metric, across nodes. Here: `densenet-mini` on a multi-label CSV with
//! `--monitor val_auroc`, on 2 ranks as an elastic job and as a 2-stage pipeline; each run
//! writes `val_auroc` every epoch, exports a sigmoid-headed model from the best epoch, and its
//! `auroc.csv` (rank 0 scoring the exported model over the whole validation set alone) agrees
//! with the AUROC the ranks gathered for that epoch.
//!
//! Every run is a real process tree, bounded in time.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `hearth ARGS`, output into `log`; (success, output).
fn hearth(args: &[&str], log: &Path) -> (bool, String) {
    let file = std::fs::File::create(log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(args)
        .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap();
    let status = common::wait_bounded(&mut child, Instant::now() + Duration::from_secs(300));
    let text = std::fs::read_to_string(log).unwrap_or_default();
    (status.is_some_and(|s| s.success()), text)
}

/// Checks a finished multi-label run: `val_auroc` each epoch, a sigmoid head, and `auroc.csv`
/// agreeing with the best epoch's AUROC.
fn check_multi_label_run(run: &Path, epochs: usize, text: &str) {
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header
        .iter()
        .position(|h| *h == "val_auroc")
        .unwrap_or_else(|| panic!("no val_auroc: {csv}"));
    let aurocs: Vec<f64> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(col).unwrap().parse().unwrap())
        .collect();
    assert_eq!(aurocs.len(), epochs, "{csv}");
    assert!(
        aurocs.iter().all(|a| (0.0..=100.0).contains(a)),
        "{aurocs:?}"
    );
    let best = aurocs.iter().copied().fold(f64::MIN, f64::max);
    let written = std::fs::read_to_string(run.join("auroc.csv")).unwrap();
    assert_eq!(written.lines().count(), 4, "a, b and c: {written}");
    let mean = common::auroc_csv_mean(run);
    assert!(
        (mean - best).abs() < 1e-2,
        "auroc.csv mean {mean} vs the best epoch's {best} ({aurocs:?})\n{text}"
    );
    let saved =
        hearth::models::load_model(&run.join("model.bpk"), &burn::prelude::Device::flex()).unwrap();
    assert_eq!(
        saved.model.head_activation(),
        hearth::models::HeadActivation::Sigmoid
    );
    assert_eq!(saved.model.num_classes(), 3);
    assert_eq!(saved.model.family(), "DenseNet");
}

#[test]
fn seed_001_densenet_multi_label_by_auroc_on_two_ranks_elastic_and_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    let labels = common::multi_label_csv(&data);
    let recipe = [
        "--data",
        data.to_str().unwrap(),
        "--labels",
        labels.to_str().unwrap(),
        "--model",
        "densenet-mini",
        "--monitor",
        "val_auroc",
        "--size",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--workers",
        "1",
    ];

    let elastic = dir.path().join("elastic");
    let mut args = vec!["launch", "--elastic", "-n", "2", "--max", "2", "--"];
    args.extend([
        "hearth",
        "train",
        "--elastic",
        "--run-dir",
        elastic.to_str().unwrap(),
    ]);
    args.extend(recipe);
    let (ok, text) = hearth(&args, &dir.path().join("elastic.log"));
    assert!(ok, "elastic:\n{text}");
    check_multi_label_run(&elastic, 2, &text);

    let piped = dir.path().join("pipeline");
    let mut args = vec![
        "train",
        "--pipeline-stages",
        "2",
        "--run-dir",
        piped.to_str().unwrap(),
    ];
    args.extend(recipe);
    let (ok, text) = hearth(&args, &dir.path().join("pipeline.log"));
    assert!(ok, "pipeline:\n{text}");
    check_multi_label_run(&piped, 2, &text);
}
