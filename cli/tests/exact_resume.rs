//! Exact resume where randomness and gradient accumulation are involved: a VGG with dropout
//! (the model's random stream continues across a resume) with early stopping set, and the
//! learning-rate schedule under `grad_accum`, which burn-train advances per optimizer step.
//!
//! The tests of this file run one at a time: Burn's random generator is process-wide, and each
//! training reseeds it at every epoch start.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::prelude::*;
use hearth::schedule::Decay;
use hearth::train::{MINI_VGG, TrainConfig, TrainReport, train};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

use common::{small_data as data, tensors};

fn config(data: &Path, run: PathBuf) -> TrainConfig {
    let mut cfg = common::small_config(data, run);
    cfg.epochs = 3;
    cfg.optim.lr = 0.02;
    cfg
}

fn run(cfg: &TrainConfig) -> TrainReport {
    train(cfg, &Device::flex(), &mut |l| eprintln!("{l}")).unwrap()
}

#[test]
fn a_model_with_dropout_and_patience_resumes_bit_exactly() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let make = |name: &str| {
        let mut cfg = config(&d, dir.path().join(name));
        cfg.model.name = MINI_VGG.into();
        cfg.checkpoint.patience = Some(5);
        cfg
    };
    run(&make("straight"));
    common::stop_then_resume(&make("resumed"), 1);
    let last = |name: &str| dir.path().join(name).join("checkpoint/model-3.bpk");
    let (a, b) = (tensors(&last("straight")), tensors(&last("resumed")));
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(
            va == vb,
            "{na} differs after a resume (dropout stream not continued)"
        );
    }
    // The runs are random where they should be: another seed trains other weights.
    let mut other = make("other");
    other.seed = 1;
    run(&other);
    let c = tensors(&last("other"));
    assert!(a.iter().zip(&c).any(|((_, x), (_, y))| x != y));
}

/// The `train_lr` column of epoch `epoch`.
fn train_lr(run: &Path, epoch: usize) -> f64 {
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = header.iter().position(|c| *c == "train_lr").unwrap();
    let row = lines.nth(epoch - 1).unwrap();
    row.split(',').nth(at).unwrap().parse().unwrap()
}

#[test]
fn with_gradient_accumulation_warmup_ends_after_its_epochs() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    // Warmup over epoch 1, then constant: every batch of epoch 2 trains at the base rate, with
    // and without accumulation. Had the schedule counted batches while burn-train steps it per
    // optimizer step, warmup would last K epochs and epoch 2's rate would still be climbing.
    for k in [None, Some(2), Some(3)] {
        let mut cfg = config(&d, dir.path().join(format!("accum{k:?}")));
        cfg.epochs = 2;
        cfg.optim.warmup_epochs = 1;
        cfg.optim.schedule = Decay::Constant;
        cfg.optim.grad_accum = k;
        let report = run(&cfg);
        let lr2 = train_lr(&report.run_dir, 2);
        assert!(
            (lr2 - cfg.optim.lr).abs() < 1e-6,
            "grad_accum {k:?}: epoch 2 trained at {lr2}, not {}",
            cfg.optim.lr
        );
        let lr1 = train_lr(&report.run_dir, 1);
        assert!(
            lr1 < cfg.optim.lr,
            "grad_accum {k:?}: epoch 1 is warmup ({lr1})"
        );
    }
}

/// `optim.model_ema`: the average is validated every epoch, kept with each checkpoint and
/// exported from the best epoch; stopped after epoch 1 and resumed, the run ends with the
/// straight run's average to the bit (the average continues from the checkpoint's, not from
/// the resumed weights).
#[test]
fn a_weight_average_resumes_bit_exactly_and_is_exported() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let make = |name: &str| {
        let mut cfg = config(&d, dir.path().join(name));
        cfg.optim.model_ema = Some(0.8);
        cfg
    };
    run(&make("straight"));
    common::stop_then_resume(&make("resumed"), 1);
    let file = |name: &str, f: &str| dir.path().join(name).join(f);
    let (a, b) = (
        tensors(&file("straight", "model_ema.bpk")),
        tensors(&file("resumed", "model_ema.bpk")),
    );
    assert!(!a.is_empty());
    assert_eq!(a, b, "the average differs after a resume");
    // It is an average, not the model: the exported weights differ.
    let model = tensors(&file("straight", "model.bpk"));
    assert_eq!(model.len(), a.len());
    assert!(model.iter().zip(&a).any(|((_, x), (_, y))| x != y));
    let rows = common::metrics(&file("straight", ""));
    assert_eq!(rows.len(), 3);
    for row in rows.values() {
        for c in ["val_ema_loss", "val_ema_accuracy"] {
            assert!(row.get(c).is_some_and(|v| v.is_finite()), "{c} in {row:?}");
        }
    }
    // A checkpoint's average is kept beside its weights (the last epoch's at least).
    assert!(file("straight", "checkpoint/ema-3.bpk").is_file());
}

/// `--monitor val_ema_loss`: the best epoch is the average's best, and `model.bpk` holds that
/// epoch's average (the weights whose score won), as `model_ema.bpk` does; without
/// `--model-ema` the monitor is refused by name.
#[test]
fn monitoring_the_average_exports_the_average() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut cfg = config(&d, dir.path().join("ema-monitored"));
    cfg.checkpoint.monitor = hearth::settings::Monitor::ValEmaLoss;
    let e = train(&cfg, &Device::flex(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("val_ema_loss") && e.contains("model_ema"), "{e}");
    cfg.optim.model_ema = Some(0.8);
    let report = run(&cfg);
    let rows = common::metrics(&cfg.run_dir);
    let best = rows
        .iter()
        .min_by(|a, b| a.1["val_ema_loss"].total_cmp(&b.1["val_ema_loss"]))
        .map(|(e, _)| *e)
        .unwrap();
    assert_eq!(report.best_epoch, best, "{rows:?}");
    let file = |f: &str| tensors(&cfg.run_dir.join(f));
    let exported = file("model.bpk");
    assert_eq!(exported, file("model_ema.bpk"));
    assert_eq!(
        exported,
        file(&format!("checkpoint/ema-{best}.bpk")),
        "model.bpk is epoch {best}'s average"
    );
    let live = file(&format!("checkpoint/model-{best}.bpk"));
    assert!(live.iter().zip(&exported).any(|((_, x), (_, y))| x != y));
}
