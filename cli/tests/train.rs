//! End-to-end training on a tiny generated data set: metrics.csv, the exported model reproducing
//! the reported validation accuracy, exact resume, a frozen backbone, and bad input.

mod common;

use std::path::{Path, PathBuf};

use burn::prelude::*;
use hearth::datasets::synth::{SynthConfig, generate};
use hearth::models::load_model;
use hearth::train::{TrainConfig, TrainReport, train};

use common::{small_config as config, small_data as data, tensors};

fn run(cfg: &TrainConfig) -> TrainReport {
    common::pin_flex();
    train(cfg, &Device::flex(), &mut |l| eprintln!("{l}")).unwrap()
}

/// The small ResNet with the parity fixture's weights (what transfer-learning tests start from).
fn fixture_resnet() -> hearth::models::Classifier {
    let mut model = hearth::train::mini_resnet(10)
        .init(&Device::flex())
        .unwrap();
    hearth::models::load_torchvision(
        &mut model,
        &common::fixture("resnet_basic.pth"),
        &Default::default(),
    )
    .unwrap();
    model
}

/// Two checkpoints hold the same tensors, within 1e-6.
fn assert_same_weights(a: &Path, b: &Path) {
    for (name, diff) in common::tensor_gaps(a, b) {
        assert!(diff <= 1e-6, "{name}: resumed weights differ by {diff}");
    }
}

/// The exported model file holds exactly the weights of `checkpoint` (a trainer checkpoint names
/// the same tensors under a prefix, found from the head's weight).
fn assert_exported_is(model: &Path, checkpoint: &Path) {
    let (m, c) = (tensors(model), tensors(checkpoint));
    let prefix = |t: &[(String, Vec<f32>)]| {
        t.iter()
            .find_map(|(n, _)| n.strip_suffix("fc.weight").map(str::to_string))
            .expect("a ResNet head")
    };
    let (pm, pc) = (prefix(&m), prefix(&c));
    let c: std::collections::BTreeMap<String, Vec<f32>> = c
        .into_iter()
        .filter_map(|(n, v)| Some((n.strip_prefix(&pc)?.to_string(), v)))
        .collect();
    let mut compared = 0;
    for (n, v) in &m {
        let Some(name) = n.strip_prefix(&pm) else {
            continue;
        };
        let Some(w) = c.get(name) else { continue };
        assert_eq!(
            v,
            w,
            "{name} of {} differs from {}",
            model.display(),
            checkpoint.display()
        );
        compared += 1;
    }
    assert!(compared >= 10, "only {compared} tensors matched by name");
}

fn checkpoints(run: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(run.join("checkpoint"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The best epoch by a metrics.csv column, computed here from the file (an improvement must
/// exceed `min_delta`).
fn best_by_csv(run: &Path, column: &str, higher: bool, min_delta: f64) -> usize {
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = header.iter().position(|c| *c == column).unwrap();
    let mut best: Option<(usize, f64)> = None;
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        let (e, v): (usize, f64) = (cells[0].parse().unwrap(), cells[at].parse().unwrap());
        let better = match best {
            None => true,
            Some((_, b)) => {
                if higher {
                    v > b + min_delta
                } else {
                    v < b - min_delta
                }
            }
        };
        if better {
            best = Some((e, v));
        }
    }
    best.unwrap().0
}

#[test]
fn patience_stops_at_the_right_epoch_and_the_export_is_the_best_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    // No improvement can exceed a min_delta of 1000 points: epoch 1 stays the best, and patience
    // 2 ends the run after epoch 3 of 5.
    let mut cfg = config(&d, dir.path().join("run"));
    cfg.epochs = 5;
    cfg.checkpoint.patience = Some(2);
    cfg.checkpoint.min_delta = 1000.0;
    let mut said = Vec::new();
    let report = train(&cfg, &Device::flex(), &mut |l| said.push(l.to_string())).unwrap();
    assert_eq!(report.epochs_run, 3);
    assert!(
        said.iter()
            .any(|l| l.starts_with("early stopping after epoch 3: no improvement of val_accuracy")),
        "the stop is said: {said:?}"
    );
    assert_eq!(report.best_epoch, 1);
    let run_dir = dir.path().join("run");
    assert_eq!(
        checkpoints(&run_dir),
        ["model-1.bpk", "model-3.bpk", "optim-3.bpk"],
        "the best epoch's weights and the last epoch's weights and optimizer are kept, nothing else"
    );
    assert_exported_is(&report.model_path, &run_dir.join("checkpoint/model-1.bpk"));

    // Without min_delta, on val_loss: the export is the best epoch by metrics.csv.
    let mut cfg = config(&d, dir.path().join("loss"));
    cfg.epochs = 3;
    cfg.checkpoint.monitor = hearth::train::Monitor::ValLoss;
    let report = run(&cfg);
    let run_dir = dir.path().join("loss");
    let best = best_by_csv(&run_dir, "val_loss", false, 0.0);
    assert_eq!(report.best_epoch, best);
    assert_exported_is(
        &report.model_path,
        &run_dir.join(format!("checkpoint/model-{best}.bpk")),
    );
}

#[test]
fn restore_best_holds_across_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let run_dir = dir.path().join("run");
    let make = || {
        let mut cfg = config(&d, run_dir.clone());
        cfg.epochs = 3;
        cfg.checkpoint.min_delta = 1000.0; // epoch 1 stays the best
        cfg
    };
    let report = common::stop_then_resume(&make(), 1);
    assert_eq!((report.best_epoch, report.epochs_run), (1, 3));
    assert!(run_dir.join("checkpoint/model-1.bpk").is_file());
    assert!(!run_dir.join("checkpoint/model-2.bpk").exists());
    assert_exported_is(&report.model_path, &run_dir.join("checkpoint/model-1.bpk"));
}

#[test]
fn restore_best_across_a_resume_exports_a_middle_epoch_found_after_it() {
    // Six epochs of the small run on val_accuracy: epoch 5 is the best (epoch 6 only ties
    // it, which is no improvement). Stopped after epoch 3 and resumed, the run must find that
    // best after the resume, keep its checkpoint beside the last one, and export it: the same
    // weights as the straight run's export.
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let make = |run: &str| {
        let mut cfg = config(&d, dir.path().join(run));
        cfg.epochs = 6;
        cfg
    };
    let straight = run(&make("straight"));
    let best = best_by_csv(&dir.path().join("straight"), "val_accuracy", true, 0.0);
    assert!(
        1 < best && best < 6,
        "the test needs a best epoch inside the run, got {best}: has the data or the model \
         changed?"
    );
    assert_eq!(straight.best_epoch, best);
    let resumed = common::stop_then_resume(&make("resumed"), 3);
    let run_dir = dir.path().join("resumed");
    assert!(best > 3, "the best epoch comes after the resume");
    assert_eq!((resumed.best_epoch, resumed.epochs_run), (best, 6));
    assert_eq!(
        best_by_csv(&run_dir, "val_accuracy", true, 0.0),
        best,
        "the resumed run's metrics.csv agrees"
    );
    let kept: Vec<String> = checkpoints(&run_dir)
        .into_iter()
        .filter(|f| f.starts_with("model-"))
        .collect();
    assert_eq!(
        kept,
        [format!("model-{best}.bpk"), "model-6.bpk".to_string()]
    );
    assert_exported_is(
        &resumed.model_path,
        &run_dir.join(format!("checkpoint/model-{best}.bpk")),
    );
    assert_same_weights(&resumed.model_path, &straight.model_path);
}

#[test]
fn resume_picks_the_last_complete_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let run_dir = dir.path().join("run");
    let make = || {
        let mut cfg = config(&d, run_dir.clone());
        cfg.epochs = 3;
        cfg.checkpoint.min_delta = 1000.0; // epoch 1 stays the best, so its checkpoint is kept
        cfg
    };
    let mut first = make();
    first.checkpoint.stop_after_epoch = Some(1);
    run(&first);
    // A crash while epoch 2's checkpoint was written: its weights landed, its optimizer file
    // (written last) never arrived.
    std::fs::copy(
        run_dir.join("checkpoint/model-1.bpk"),
        run_dir.join("checkpoint/model-2.bpk"),
    )
    .unwrap();
    let mut lines = Vec::new();
    let mut second = make();
    second.checkpoint.resume = true;
    train(&second, &Device::flex(), &mut |l| lines.push(l.to_string())).unwrap();
    assert!(
        lines.iter().any(|l| l == "resuming after epoch 1"),
        "{lines:?}"
    );
    let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4, "epochs 1-3, each once: {csv}");
}

#[test]
fn a_run_writes_metrics_and_a_model_that_reproduces_its_validation_accuracy() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let report = run(&config(&d, dir.path().join("run")));
    let csv = std::fs::read_to_string(dir.path().join("run/metrics.csv")).unwrap();
    let mut lines = csv.lines();
    let header = lines.next().unwrap();
    for col in [
        "epoch",
        "train_loss",
        "train_accuracy",
        "val_loss",
        "val_accuracy",
    ] {
        assert!(
            header.split(',').any(|c| c == col),
            "{col} missing from {header}"
        );
    }
    assert_eq!(lines.count(), 2, "{csv}");
    assert!(dir.path().join("run/metrics.png").is_file());

    // The exported model, evaluated independently, gives the reported validation accuracy.
    let saved = load_model(&report.model_path, &Device::flex()).unwrap();
    assert_eq!(
        saved.class_names.as_deref(),
        Some(report.class_names.as_slice())
    );
    let acc = common::folder_accuracy(&report.model_path, &d.join("val"), 32);
    let reported = report.best_val_accuracy.unwrap();
    assert!(
        (acc - reported).abs() < 1e-6,
        "recomputed {acc} vs reported {reported}"
    );
}

#[test]
fn resuming_after_an_epoch_ends_with_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let straight = config(&d, dir.path().join("straight"));
    run(&straight);

    // Same configuration, stopped after epoch 1 (as a time limit would), then resumed.
    let mut first = config(&d, dir.path().join("resumed"));
    first.checkpoint.stop_after_epoch = Some(1);
    run(&first);
    assert!(!dir.path().join("resumed/checkpoint/model-2.bpk").exists());
    let mut second = config(&d, dir.path().join("resumed"));
    second.checkpoint.resume = true;
    run(&second);

    assert_same_weights(
        &dir.path().join("straight/checkpoint/model-2.bpk"),
        &dir.path().join("resumed/checkpoint/model-2.bpk"),
    );
}

#[test]
fn a_frozen_backbone_is_unchanged_after_training() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut cfg = config(&d, dir.path().join("run"));
    cfg.epochs = 1;
    // The default small ResNet has the parity fixture's architecture: start from its weights.
    cfg.model.weights = Some(common::fixture("resnet_basic.pth"));
    cfg.model.freeze_backbone = true;
    let report = run(&cfg);
    let trained = load_model(&report.model_path, &Device::flex())
        .unwrap()
        .model;
    let original = fixture_resnet();
    let (hearth::models::Classifier::ResNet(t), hearth::models::Classifier::ResNet(o)) =
        (&trained, &original)
    else {
        panic!("ResNets expected");
    };
    let same = |a: Tensor<4>, b: Tensor<4>| {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            a.into_data().iter().collect(),
            b.into_data().iter().collect(),
        );
        a == b
    };
    assert!(
        same(t.conv1.weight.val(), o.conv1.weight.val()),
        "stem changed"
    );
    assert!(
        same(
            t.layer4[0].conv2.weight.val(),
            o.layer4[0].conv2.weight.val()
        ),
        "layer4 changed"
    );
    let rm = |x: &hearth::models::ResNet| -> Vec<f32> {
        x.bn1.running_mean.value().into_data().iter().collect()
    };
    assert_eq!(rm(t), rm(o), "frozen batch-norm statistics changed");
    assert_eq!(trained.num_classes(), 3);
}

#[test]
fn bad_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let err = |cfg: TrainConfig| {
        train(&cfg, &Device::flex(), &mut |_| {})
            .unwrap_err()
            .to_string()
    };

    let mut c = config(&d, dir.path().join("a"));
    c.batch_size = 0;
    assert!(err(c).contains("`batch_size`"));

    let c = config(&d, PathBuf::from("/dev/null/run"));
    assert!(err(c).contains("/dev/null/run"));

    let one = dir.path().join("one");
    generate(&one, &SynthConfig::new(2, 3, 32)).unwrap();
    std::fs::remove_dir_all(one.join(&hearth::datasets::synth::class_names(2)[1])).unwrap();
    let mut c = config(&one, dir.path().join("b"));
    c.data.val_fraction = 0.34;
    assert!(err(c).contains("1 class(es)"));

    let mut c = config(&d, dir.path().join("c"));
    c.model.weights = Some(common::fixture("densenet.pth"));
    let e = err(c);
    assert!(e.contains("densenet.pth"), "{e}");

    // A diverging run stops with the epoch and step of the first NaN loss.
    let mut c = config(&d, dir.path().join("nan"));
    c.optim.lr = 1e12;
    c.optim.weight_decay = 0.0;
    let e = err(c);
    assert!(e.contains("NaN or infinite at epoch 1, step"), "{e}");

    // Resuming with another class count.
    let mut c = config(&d, dir.path().join("d"));
    c.epochs = 1;
    run(&c);
    let other = dir.path().join("other");
    generate(&other, &SynthConfig::new(4, 8, 32).with_val(2)).unwrap();
    let mut c = config(&other, dir.path().join("d"));
    c.checkpoint.resume = true;
    let e = err(c);
    assert!(e.contains("different model or class count"), "{e}");
}

#[test]
fn multi_label_training_reports_per_class_auroc_that_matches_the_metric() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut cfg = config(&d, dir.path().join("run"));
    cfg.data.labels = Some(common::multi_label_csv(&d));
    cfg.data.val_fraction = 0.3;
    cfg.checkpoint.monitor = hearth::train::Monitor::ValAuroc;
    let report = run(&cfg);

    let csv = std::fs::read_to_string(dir.path().join("run/metrics.csv")).unwrap();
    let header = csv.lines().next().unwrap();
    for col in [
        "val_auroc",
        "val_accuracy",
        "train_images_per_sec",
        "train_lr",
    ] {
        assert!(
            header.split(',').any(|c| c == col),
            "{col} missing: {header}"
        );
    }
    let per_class = report.per_class_auroc.clone().unwrap();
    let names: Vec<&str> = per_class.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    let written = std::fs::read_to_string(dir.path().join("run/auroc.csv")).unwrap();
    assert_eq!(written.lines().count(), 4, "{written}");
    // Our per-class AUROCs of the exported (best) model average to burn's AUROC metric of the
    // best epoch: two independent computations over the same validation set.
    let mean = per_class.iter().map(|(_, a)| a).sum::<f64>() / per_class.len() as f64;
    let metric = report.best_val_auroc.unwrap() / 100.0;
    assert!(
        (mean - metric).abs() < 1e-4,
        "per-class mean {mean} vs metric {metric}"
    );
    let saved = load_model(&report.model_path, &Device::flex()).unwrap();
    assert_eq!(
        saved.model.head_activation(),
        hearth::models::HeadActivation::Sigmoid
    );
    assert_eq!(saved.model.num_classes(), 3);
}

/// Every tensor of the backbone (all but the head `fc`) of a checkpoint, by name.
fn backbone(path: &Path) -> Vec<(String, Vec<f32>)> {
    tensors(path)
        .into_iter()
        .filter(|(n, _)| !n.contains("fc."))
        .collect()
}

#[test]
fn unfreezing_after_an_epoch_fine_tunes_the_backbone_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let make = |run: &str| {
        let mut cfg = config(&d, dir.path().join(run));
        cfg.model.weights = Some(common::fixture("resnet_basic.pth"));
        cfg.model.freeze_backbone = true;
        cfg.model.unfreeze_after = Some(1);
        cfg.model.finetune_lr = Some(0.01);
        // Epoch 1 stays the best (its checkpoint is kept, and it is what gets exported).
        cfg.checkpoint.min_delta = 1000.0;
        cfg
    };
    let report = run(&make("straight"));
    assert_eq!(report.best_epoch, 1);
    let ckpt = |run: &str, e: usize| dir.path().join(format!("{run}/checkpoint/model-{e}.bpk"));
    let (e1, e2) = (
        backbone(&ckpt("straight", 1)),
        backbone(&ckpt("straight", 2)),
    );
    assert!(!e1.is_empty());
    // Epoch 1 (frozen) left the backbone as loaded; epoch 2 (fine-tuning) changed it.
    let original = fixture_resnet();
    let hearth::models::Classifier::ResNet(o) = &original else {
        panic!("a ResNet expected");
    };
    let stem: Vec<f32> = o.conv1.weight.val().into_data().iter().collect();
    let stem_at = |t: &[(String, Vec<f32>)]| {
        t.iter()
            .find(|(n, _)| n.ends_with("conv1.weight") && !n.contains("layer"))
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(stem_at(&e1), stem, "the frozen epoch changed the stem");
    assert_ne!(stem_at(&e2), stem, "fine-tuning did not change the stem");
    // The export across both phases is the best epoch (1), not the last.
    assert_exported_is(&report.model_path, &ckpt("straight", 1));
    let csv = std::fs::read_to_string(dir.path().join("straight/metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");

    // Stopped inside the frozen phase and resumed: the same weights as the straight run.
    common::stop_then_resume(&make("resumed"), 1);
    assert_same_weights(&ckpt("straight", 2), &ckpt("resumed", 2));

    // Resuming with other hyperparameters is refused, naming them.
    let mut other = make("resumed");
    other.checkpoint.resume = true;
    other.epochs = 3;
    other.optim.lr = 0.1;
    let e = train(&other, &Device::flex(), &mut |_| {})
        .unwrap_err()
        .to_string();
    // --epochs may change on resume (extending a run); --lr may not.
    assert!(
        e.contains("lr: 0.05 then, 0.1 now") && !e.contains("epochs"),
        "{e}"
    );

    // Patience counts from fine-tuning: with patience 1 and nothing better than epoch 1, the
    // run ends after the first fine-tuning epoch (2 of 4), exporting epoch 1.
    let mut patient = make("patient");
    patient.epochs = 4;
    patient.checkpoint.patience = Some(1);
    let report = run(&patient);
    assert_eq!((report.epochs_run, report.best_epoch), (2, 1));
    assert_exported_is(&report.model_path, &ckpt("patient", 1));
}

#[test]
fn a_new_run_into_a_finished_runs_directory_is_refused_unless_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let run_dir = dir.path().join("run");
    let mut cfg = config(&d, run_dir.clone());
    cfg.epochs = 1;
    run(&cfg);
    let model = std::fs::read(run_dir.join("model.bpk")).unwrap();
    let metrics = std::fs::read(run_dir.join("metrics.csv")).unwrap();
    // The same command again: an error naming the run and the ways on, nothing touched.
    let e = train(&cfg, &Device::flex(), &mut |_| {})
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("already holds a run"), "{e}");
    assert!(
        e.contains("`checkpoint.resume`") && e.contains("`checkpoint.overwrite`"),
        "{e}"
    );
    assert!(e.contains("model.bpk") && e.contains("checkpoint"), "{e}");
    assert_eq!(std::fs::read(run_dir.join("model.bpk")).unwrap(), model);
    assert_eq!(std::fs::read(run_dir.join("metrics.csv")).unwrap(), metrics);
    // --overwrite: the earlier run's files go, a new run is written in their place.
    std::fs::write(run_dir.join("checkpoint/model-7.bpk"), b"stale").unwrap();
    let mut again = cfg.clone();
    again.checkpoint.overwrite = true;
    again.seed = 5;
    let mut said = Vec::new();
    train(&again, &Device::flex(), &mut |l| said.push(l.to_string())).unwrap();
    assert!(
        said.iter()
            .any(|l| l.contains("`checkpoint.overwrite`: removed")),
        "{said:?}"
    );
    assert!(!run_dir.join("checkpoint/model-7.bpk").exists());
    assert_ne!(std::fs::read(run_dir.join("model.bpk")).unwrap(), model);
}

#[test]
fn an_epoch_of_one_batch_has_a_speed_and_few_classes_no_top5() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut cfg = config(&d, dir.path().join("run"));
    cfg.epochs = 1;
    // 48 training images in one batch.
    cfg.batch_size = 64;
    run(&cfg);
    let csv = std::fs::read_to_string(dir.path().join("run/metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    assert!(
        !header.iter().any(|h| h.contains("top5")),
        "top-5 of 3 classes is always 100%: {csv}"
    );
    let col = header
        .iter()
        .position(|h| *h == "train_images_per_sec")
        .unwrap();
    let speed: f64 = csv
        .lines()
        .nth(1)
        .unwrap()
        .split(',')
        .nth(col)
        .unwrap()
        .parse()
        .unwrap();
    assert!(speed.is_finite() && speed > 0.0, "{csv}");
}
