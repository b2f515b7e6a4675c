//! End-to-end training on a tiny generated data set: metrics.csv, the exported model reproducing
//! the reported validation accuracy, exact resume, a frozen backbone, and bad input.

mod common;

use std::path::{Path, PathBuf};

use burn::prelude::*;
use hearth::datasets::synth::{SynthConfig, generate};
use hearth::models::load_model;
use hearth::train::{TrainConfig, TrainReport, train};

fn data(dir: &Path) -> PathBuf {
    let d = dir.join("data");
    generate(&d, &SynthConfig::new(3, 16, 36).with_seed(4).with_val(6)).unwrap();
    d
}

fn config(data: &Path, run: PathBuf) -> TrainConfig {
    let mut cfg = TrainConfig::new(run);
    cfg.data = Some(data.to_path_buf());
    cfg.epochs = 2;
    cfg.batch_size = 8;
    cfg.lr = 0.05;
    cfg.warmup_epochs = 0;
    cfg.workers = 1;
    cfg
}

fn run(cfg: &TrainConfig) -> TrainReport {
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

fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let reader = burn::store::burn_pack::Reader::from_file(path).unwrap();
    let mut names: Vec<String> = reader
        .tensor_names()
        .into_iter()
        .map(String::from)
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let bytes = reader.tensor_data(&n).unwrap();
            let v = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (n, v)
        })
        .collect()
}

/// Two checkpoints hold the same tensors, within 1e-6.
fn assert_same_weights(a: &Path, b: &Path) {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        let diff = va
            .iter()
            .zip(vb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff <= 1e-6, "{na}: resumed weights differ by {diff}");
    }
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
    first.stop_after_epoch = Some(1);
    run(&first);
    assert!(!dir.path().join("resumed/checkpoint/model-2.bpk").exists());
    let mut second = config(&d, dir.path().join("resumed"));
    second.resume = true;
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
    cfg.weights = Some(common::fixture("resnet_basic.pth"));
    cfg.freeze_backbone = true;
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
    assert!(err(c).contains("--batch-size"));

    let c = config(&d, PathBuf::from("/dev/null/run"));
    assert!(err(c).contains("/dev/null/run"));

    let one = dir.path().join("one");
    generate(&one, &SynthConfig::new(2, 3, 32)).unwrap();
    std::fs::remove_dir_all(one.join(&hearth::datasets::synth::class_names(2)[1])).unwrap();
    let mut c = config(&one, dir.path().join("b"));
    c.val_fraction = 0.34;
    assert!(err(c).contains("1 class(es)"));

    let mut c = config(&d, dir.path().join("c"));
    c.weights = Some(common::fixture("densenet.pth"));
    let e = err(c);
    assert!(e.contains("densenet.pth"), "{e}");

    // A diverging run stops with the epoch and step of the first NaN loss.
    let mut c = config(&d, dir.path().join("nan"));
    c.lr = 1e12;
    c.weight_decay = 0.0;
    let e = err(c);
    assert!(e.contains("NaN or infinite at epoch 1, step"), "{e}");

    // Resuming with another class count.
    let mut c = config(&d, dir.path().join("d"));
    c.epochs = 1;
    run(&c);
    let other = dir.path().join("other");
    generate(&other, &SynthConfig::new(4, 8, 32).with_val(2)).unwrap();
    let mut c = config(&other, dir.path().join("d"));
    c.resume = true;
    let e = err(c);
    assert!(e.contains("different model or class count"), "{e}");
}

/// A multi-label CSV over the synthetic images: labels derived from the class, several per image.
fn multi_label_csv(data: &Path) -> PathBuf {
    let names = hearth::datasets::synth::class_names(3);
    // class 0 -> a, class 1 -> a|b, class 2 -> c (and b for every other image).
    let mut csv = String::from("path,labels\n");
    for split in ["train", "val"] {
        for (c, name) in names.iter().enumerate() {
            let mut files: Vec<_> = std::fs::read_dir(data.join(split).join(name))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            files.sort();
            for (i, f) in files.iter().enumerate() {
                let labels = match c {
                    0 => "a".to_string(),
                    1 => "a|b".to_string(),
                    _ if i % 2 == 0 => "b|c".to_string(),
                    _ => "c".to_string(),
                };
                csv.push_str(&format!("{split}/{name}/{f},{labels}\n"));
            }
        }
    }
    let path = data.join("labels.csv");
    std::fs::write(&path, csv).unwrap();
    path
}

#[test]
fn multi_label_training_reports_per_class_auroc_that_matches_the_metric() {
    let dir = tempfile::tempdir().unwrap();
    let d = data(dir.path());
    let mut cfg = config(&d, dir.path().join("run"));
    cfg.labels = Some(multi_label_csv(&d));
    cfg.val_fraction = 0.3;
    cfg.monitor = "val_auroc".parse().unwrap();
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
        cfg.weights = Some(common::fixture("resnet_basic.pth"));
        cfg.freeze_backbone = true;
        cfg.unfreeze_after = Some(1);
        cfg.finetune_lr = Some(0.01);
        cfg
    };
    run(&make("straight"));
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
    let csv = std::fs::read_to_string(dir.path().join("straight/metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");

    // Stopped inside the frozen phase and resumed: the same weights as the straight run.
    let mut first = make("resumed");
    first.stop_after_epoch = Some(1);
    run(&first);
    let mut second = make("resumed");
    second.resume = true;
    run(&second);
    assert_same_weights(&ckpt("straight", 2), &ckpt("resumed", 2));

    // Resuming with other hyperparameters is refused, naming them.
    let mut other = make("resumed");
    other.resume = true;
    other.epochs = 3;
    other.lr = 0.1;
    let e = train(&other, &Device::flex(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lr: 0.05 then, 0.1 now") && e.contains("epochs"),
        "{e}"
    );
}
