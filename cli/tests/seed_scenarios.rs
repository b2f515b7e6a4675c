//! The seeds' recipes as a newcomer would run them, at test size, through the `hearth` binary.
//!
//! Seed 001 (CheXNet): DenseNet fine-tuned on 14 sigmoid outputs with the AUROC as the model
//! selection metric, across nodes. Here: `densenet-mini` on a multi-label CSV with
//! `--monitor val_auroc`, on 2 ranks as an elastic job and as a 2-stage pipeline; each run
//! writes `val_auroc` every epoch, exports a sigmoid-headed model from the best epoch, and its
//! `auroc.csv` (rank 0 scoring the exported model over the whole validation set alone) agrees
//! with the AUROC the ranks gathered for that epoch.
//!
//! Seed 000: transfer learning on the last layer of a pretrained ResNet with crop, shear and
//! rotation, on asynchronous ADAG workers. Here: `resnet-mini` pretrained by the test on one
//! set of shapes, its backbone frozen under a new head for a set with a class more, then
//! fine-tuned whole (`--freeze-backbone --unfreeze-after 2 --patience 3`), on 4 ADAG workers
//! and a server (the servers re-shard the whole model at the switch), against the same recipe
//! in one process.
//!
//! The goal is "within 1 point". The gap had one cause besides asynchrony: at the
//! switch to fine-tuning, batch norm went from the pretrained running statistics to the
//! statistics of each worker's batch of 4 images, and accuracy dipped (one process at batch 4
//! and synchronous servers dipped the same way). Fine-tuning now keeps the running statistics
//! by default (`--finetune-bn frozen`, Keras's advice): synchronous servers then equal one
//! process exactly, and over 8 seeds (160 validation images, 0.625 points each) ADAG's best
//! accuracy was on average 0.24 points below one process's (mean 94.1%), each run between 3.8
//! below and 2.5 above, later 6.3 below in one run stopped by patience. One run's gap is
//! noise at this size; the mean over seeds meets the goal, no single run is held to it. Before,
//! ADAG ended 2.5 to 11.3 points below (12 runs). The test checks that the recipe runs through
//! every step (frozen phase, switch, fine-tuning, export) and bounds one run's gap at 5
//! points: in the test's form (`--staleness 3`) the run gave 94.4% against one process's 96.9%
//! in every one of 24 runs and of 5 more on 2026-11-27, and a local momentum of 0.5 for ADAG's
//! workers, tried as a default that day, fell to 86.9%, which the old 10-point bound let pass
//! (0.5 is now ADAG's default only from scratch; this recipe gives `--weights` and keeps 0.9).
//! The 1-point goal is met on the mean over seeds, not by this run (2.5 under).
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

/// Held by each scenario for its whole run: they launch 2 to 5 processes each on a 2-core
/// machine, and ADAG's asynchronous workers learn worse when another scenario's processes
/// crowd them (their staleness grows): one scenario at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn seed_001_densenet_multi_label_by_auroc_on_two_ranks_elastic_and_pipeline() {
    let _alone = one_at_a_time();
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

/// The best validation accuracy in a run's `metrics.csv`.
fn best_val_accuracy(run: &Path) -> f64 {
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "val_accuracy").unwrap();
    csv.lines()
        .skip(1)
        .map(|l| l.split(',').nth(col).unwrap().parse::<f64>().unwrap())
        .fold(f64::MIN, f64::max)
}

#[test]
fn seed_000_a_frozen_pretrained_resnet_on_adag_workers_learns_as_one_process_does() {
    let _alone = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let first = common::small_data(dir.path());
    let pre = dir.path().join("pretrained");
    let (ok, text) = hearth(
        &[
            "train",
            "--data",
            first.to_str().unwrap(),
            "--model",
            "resnet-mini",
            "--size",
            "32",
            "--batch-size",
            "8",
            "--epochs",
            "4",
            "--workers",
            "1",
            "--run-dir",
            pre.to_str().unwrap(),
        ],
        &dir.path().join("pretrain.log"),
    );
    assert!(ok, "pretraining:\n{text}");
    // The new task: a class more, other images.
    let data = dir.path().join("new");
    hearth::datasets::synth::generate(
        &data,
        &hearth::datasets::synth::SynthConfig::new(4, 40, 36)
            .with_seed(11)
            .with_val(40),
    )
    .unwrap();
    let weights = pre.join("model.bpk");
    let recipe = [
        "--data",
        data.to_str().unwrap(),
        "--weights",
        weights.to_str().unwrap(),
        "--model",
        "resnet-mini",
        "--freeze-backbone",
        "--unfreeze-after",
        "2",
        "--finetune-lr",
        "0.002",
        "--patience",
        "3",
        "--crop-scale",
        "0.7,1",
        "--shear",
        "10",
        "--rotate",
        "10",
        "--size",
        "32",
        "--batch-size",
        "16",
        "--lr",
        "0.02",
        "--epochs",
        "12",
        "--workers",
        "1",
    ];
    let one = dir.path().join("one");
    let mut args = vec!["train", "--run-dir", one.to_str().unwrap()];
    args.extend(recipe);
    let (ok, text) = hearth(&args, &dir.path().join("one.log"));
    assert!(ok, "one process:\n{text}");
    let adag = dir.path().join("adag");
    // A lead of at most 6 steps (stale synchronous parallel; the pushes are still applied as
    // they come): unbounded, the 4 workers on 2 cores led by up to 10 steps as the scheduler
    // happened to run them, and about 1 run in 20 fell to 79-82% (the fine-tuning epochs
    // dipped and early stopping ended the run there). Bounded at 3 or 6, 24 runs each all
    // reached 94.4%.
    let mut args = vec![
        "train",
        "--nproc",
        "5",
        "--ps",
        "1",
        "--mode",
        "adag",
        "--staleness",
        "3",
    ];
    args.extend(["--run-dir", adag.to_str().unwrap()]);
    args.extend(recipe);
    let (ok, text) = hearth(&args, &dir.path().join("adag.log"));
    assert!(ok, "ADAG:\n{text}");
    assert!(text.contains("backbone frozen"), "{text}");
    assert!(
        text.contains("unfreezing the backbone after epoch 2"),
        "{text}"
    );
    let (a, b) = (best_val_accuracy(&one), best_val_accuracy(&adag));
    eprintln!("seed 000: best validation accuracy, one process {a}%, 4 ADAG workers {b}%");
    assert!(
        b >= a - 5.0,
        "ADAG's best validation accuracy {b}% is more than 5 points below one process's {a}%\n{text}"
    );
    assert!(adag.join("model.bpk").is_file());
}
