//! A user's own Burn module (the multi-layer perceptron of `examples/custom_model.rs`, not an
//! image model) trained through Hearth's modes by `train_custom`: on parameter servers and
//! elastic, as real process trees under `hearth launch` running the example's binary (which
//! `cargo test` builds beside this test). Both are data parallel on the same global batches
//! from the same seed, so their validation curves agree; the exported `model.bpk` loads into
//! the user's module and scores what the best epoch reported; a stopped run resumes exactly;
//! image-only settings and the modes `train_custom` does not drive are refused by name.

mod common;
#[allow(dead_code)]
#[path = "../examples/custom_model.rs"]
mod example;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use hearth::train::{Examples, Net, Targets, TrainConfig};

use common::wait_bounded;

/// The example's binary, built by `cargo test` into the target's `examples/` folder.
fn example_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile.join("examples").join("custom_model");
    assert!(
        bin.exists(),
        "{} is missing: `cargo test` builds it (or `cargo build --example custom_model`)",
        bin.display()
    );
    bin
}

/// Runs `hearth launch LAUNCH -- custom_model ARGS` to the end (at most 240 s); its output.
fn launch(launch: &[&str], args: &[&str]) -> String {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .arg("launch")
        .args(launch)
        .arg("--")
        .arg(example_bin())
        .args(args)
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR")
        .stdout(log.reopen().unwrap())
        .stderr(log.reopen().unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut child, Instant::now() + Duration::from_secs(240));
    let out = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "custom_model {args:?} failed or hung ({status:?}):\n{out}"
    );
    out
}

/// metrics.csv: epoch -> column -> value.
fn metrics(run: &Path) -> BTreeMap<usize, BTreeMap<String, f64>> {
    let text = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let mut lines = text.lines();
    let headers: Vec<&str> = lines.next().unwrap().split(',').collect();
    let mut out = BTreeMap::new();
    for line in lines {
        let mut row = BTreeMap::new();
        for (h, v) in headers.iter().zip(line.split(',')) {
            if let Ok(v) = v.parse::<f64>() {
                row.insert(h.to_string(), v);
            }
        }
        out.insert(row["epoch"] as usize, row);
    }
    out
}

/// The accuracy (%) of the module in `run/model.bpk` on the example's validation set.
fn exported_accuracy(run: &Path) -> f64 {
    let device = Device::flex();
    let record = ModuleRecord::load(&run.join("model.bpk")).unwrap();
    let model = example::Mlp::new(3, &device).load_record(record);
    let val = example::Spirals::new(3, 60, 2);
    let all: Vec<usize> = (0..val.len()).collect();
    let (x, targets) = val.batch(&all, &device).unwrap();
    let Targets::Classes(y) = targets else {
        panic!("the example's targets are classes")
    };
    let right = model
        .logits(x)
        .argmax(1)
        .flatten::<1>(0, 1)
        .equal(y)
        .int()
        .sum()
        .into_scalar::<i64>();
    100.0 * right as f64 / val.len() as f64
}

#[test]
fn a_user_module_trains_on_parameter_servers_and_elastic_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let ps = dir.path().join("ps");
    let elastic = dir.path().join("elastic");
    let ps_str = ps.to_str().unwrap();
    launch(&["-n", "3"], &["ps", ps_str]);
    launch(
        &["--elastic", "-n", "2", "--min", "1", "--max", "3"],
        &["elastic", elastic.to_str().unwrap()],
    );
    let (a, b) = (metrics(&ps), metrics(&elastic));
    assert_eq!(a.len(), 8, "{a:?}");
    assert_eq!(b.len(), 8, "{b:?}");
    for (epoch, row) in &a {
        let other = &b[epoch];
        // Synchronous servers and allreduce: the same global batches, the same mean gradient.
        for column in ["val_loss", "val_accuracy"] {
            assert!(
                (row[column] - other[column]).abs() < 1e-3,
                "epoch {epoch} {column}: ps {} elastic {}",
                row[column],
                other[column]
            );
        }
    }
    // It learned (a linear model of the spirals stays near 50%), and model.bpk is the best
    // epoch's module.
    for run in [&ps, &elastic] {
        let rows = metrics(run);
        let (best, row) = rows
            .iter()
            .max_by(|x, y| x.1["val_accuracy"].total_cmp(&y.1["val_accuracy"]))
            .unwrap();
        assert!(row["val_accuracy"] > 75.0, "{}: {rows:?}", run.display());
        let exported = exported_accuracy(run);
        assert!(
            (exported - row["val_accuracy"]).abs() < 0.01,
            "{}: model.bpk scores {exported}%, best epoch {best} reported {}%",
            run.display(),
            row["val_accuracy"]
        );
        let described = std::fs::read_to_string(run.join("model_config.json")).ok();
        if run == &ps {
            assert!(described.is_some_and(|d| d.contains("Mlp")));
        }
    }

    // Stopped after epoch 4 and resumed: the same curve as the uninterrupted run.
    let resumed = dir.path().join("resumed");
    let resumed_str = resumed.to_str().unwrap();
    launch(
        &["-n", "3"],
        &["ps", resumed_str, "--stop-after-epoch", "4"],
    );
    assert_eq!(metrics(&resumed).len(), 4);
    let out = launch(&["-n", "3"], &["ps", resumed_str, "--resume"]);
    assert!(out.contains("resuming after epoch 4"), "{out}");
    for (epoch, row) in metrics(&resumed) {
        for column in ["val_loss", "val_accuracy", "train_loss"] {
            assert!(
                (row[column] - a[&epoch][column]).abs() < 1e-5,
                "epoch {epoch} {column}: resumed {} uninterrupted {}",
                row[column],
                a[&epoch][column]
            );
        }
    }
}

fn custom() -> hearth::train::Custom<example::Mlp, example::Spirals> {
    hearth::train::Custom::new(
        |d: &Device| example::Mlp::new(3, d),
        example::Spirals::new(3, 20, 1),
        example::Spirals::new(3, 5, 2),
        ["a", "b", "c"].map(String::from).to_vec(),
    )
}

fn refusal(cfg: &TrainConfig) -> String {
    hearth::train::train_custom(cfg, &custom(), &Device::flex(), &mut |_| {})
        .err()
        .map(|e| e.to_string())
        .expect("refused")
}

#[test]
fn image_settings_and_undriven_modes_are_refused_by_name_for_a_user_module() {
    let dir = tempfile::tempdir().unwrap();
    let base = || {
        let mut cfg = TrainConfig::new(dir.path().join("run"));
        cfg.ps = Some(Default::default());
        cfg
    };
    let mut cfg = base();
    cfg.weights = Some("resnet18.pth".into());
    assert!(refusal(&cfg).contains("weights"));
    let mut cfg = base();
    cfg.freeze_backbone = true;
    assert!(refusal(&cfg).contains("freeze_backbone"));
    let mut cfg = base();
    cfg.augmentation = hearth::train::AugmentPreset::Imagenet.augmentation();
    assert!(refusal(&cfg).contains("augmentation"));
    let mut cfg = base();
    cfg.model = "resnet50".into();
    assert!(refusal(&cfg).contains("model"));
    let mut cfg = base();
    cfg.monitor = hearth::train::Monitor::ValAuroc;
    assert!(refusal(&cfg).contains("val_auroc"));
    // One process: burn-train's Learner with DdpStrategy is the way, and the error says so.
    let mut cfg = base();
    cfg.ps = None;
    assert!(refusal(&cfg).contains("DdpStrategy"));
    // Nothing was written for a refused run.
    assert!(!dir.path().join("run").exists());
}
