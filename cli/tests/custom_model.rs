//! A user's own Burn module (the multi-layer perceptron of `examples/custom_model.rs`, not an
//! image model) trained through Hearth's modes by `train_custom`: on parameter servers and
//! elastic, as real process trees under `hearth launch` running the example's binary (which
//! `cargo test` builds beside this test). Both are data parallel on the same global batches
//! from the same seed, so their validation curves agree; the exported `model.bpk` loads into
//! the user's module and scores what the best epoch reported; a stopped run resumes exactly;
//! image-only settings and the modes `train_custom` does not drive are refused by name.

mod common;
#[allow(dead_code)]
#[path = "../../examples/custom_model.rs"]
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
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.arg("launch").args(launch).arg("--").arg(example_bin());
    run(cmd, args)
}

/// Runs `custom_model ARGS` alone, one process (at most 240 s); its output.
fn alone(args: &[&str]) -> String {
    run(Command::new(example_bin()), args)
}

/// [`launch`] with `env` set for every process.
fn launch_with(launch: &[&str], args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.arg("launch").args(launch).arg("--").arg(example_bin());
    cmd.envs(env.iter().copied());
    run(cmd, args)
}

fn run(mut cmd: Command, args: &[&str]) -> String {
    let log = tempfile::NamedTempFile::new().unwrap();
    // One open file for both streams: they share its offset, so neither overwrites the other.
    let file = log.reopen().unwrap();
    let mut child = cmd
        .args(args)
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR")
        .stdout(file.try_clone().unwrap())
        .stderr(file)
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
    let record = ModuleRecord::load(run.join("model.bpk")).unwrap();
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
fn a_user_module_trains_alone_data_parallel_on_servers_and_elastic_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (one, dp, ps, elastic) = (path("one"), path("dp"), path("ps"), path("elastic"));
    let out = alone(&["dp", one.to_str().unwrap()]);
    assert!(out.contains("one process: 1 rank(s)"), "{out}");
    let out = launch(&["-n", "2"], &["dp", dp.to_str().unwrap()]);
    assert!(out.contains("data parallel: 2 rank(s)"), "{out}");
    launch(&["-n", "3"], &["ps", ps.to_str().unwrap()]);
    launch(
        &["--elastic", "-n", "2", "--min", "1", "--max", "3"],
        &["elastic", elastic.to_str().unwrap()],
    );
    // Each epoch's metrics by name.
    type Curve = BTreeMap<usize, BTreeMap<String, f64>>;
    let curves: Vec<(&str, Curve)> = [
        ("one process", &one),
        ("data parallel", &dp),
        ("ps", &ps),
        ("elastic", &elastic),
    ]
    .into_iter()
    .map(|(name, run)| (name, metrics(run)))
    .collect();
    assert_eq!(curves[0].1.len(), 8, "{:?}", curves[0].1);
    // One process on batches of 32, two ranks on 16 each of the same 32, synchronous servers
    // and elastic allreduce: the same global batches, the same mean gradient, the same curve.
    for (name, curve) in &curves[1..] {
        common::same_curves(
            ("one process", &curves[0].1),
            (name, curve),
            &["val_loss", "val_accuracy", "train_loss"],
            1e-3,
        );
    }
    // It learned (a linear model of the spirals stays near 50%), and model.bpk is the best
    // epoch's module.
    for run in [&one, &dp, &ps, &elastic] {
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
    }
    for run in [&one, &ps] {
        let described = std::fs::read_to_string(run.join("model_config.json")).unwrap();
        assert!(described.contains("Mlp"), "{described}");
    }

    // Stopped after epoch 4 and resumed (servers, and data parallel whose rank 0 sends the
    // checkpoint to the other): the same curve as the uninterrupted run.
    for (mode, launched, uninterrupted) in [("ps", "3", &curves[2].1), ("dp", "2", &curves[1].1)] {
        let resumed = path(&format!("{mode}-resumed"));
        let resumed_str = resumed.to_str().unwrap();
        launch(
            &["-n", launched],
            &[mode, resumed_str, "--stop-after-epoch", "4"],
        );
        assert_eq!(metrics(&resumed).len(), 4);
        let out = launch(&["-n", launched], &[mode, resumed_str, "--resume"]);
        assert!(out.contains("resuming after epoch 4"), "{out}");
        common::same_curves(
            (&format!("{mode} resumed"), &metrics(&resumed)),
            (&format!("{mode} uninterrupted"), uninterrupted),
            &["val_loss", "val_accuracy", "train_loss"],
            1e-5,
        );
    }
    // One process: a finished run has nothing left, and says so before anything else.
    let out = Command::new(example_bin())
        .args(["dp", one.to_str().unwrap(), "--resume"])
        .env_remove("HEARTH_RANK")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("nothing left to train"),
        "{err}"
    );
    assert!(!err.contains("resuming after"), "{err}");
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
fn image_settings_are_refused_by_name_for_a_user_module() {
    let dir = tempfile::tempdir().unwrap();
    let base = || {
        let mut cfg = TrainConfig::new(dir.path().join("run"));
        cfg.mode = hearth::train::TrainingMode::ParameterServers(Default::default());
        cfg
    };
    let mut cfg = base();
    cfg.model.weights = Some("resnet18.pth".into());
    assert!(refusal(&cfg).contains("weights"));
    let mut cfg = base();
    cfg.model.freeze_backbone = true;
    assert!(refusal(&cfg).contains("freeze_backbone"));
    let mut cfg = base();
    cfg.data.augmentation = hearth::train::AugmentPreset::Imagenet.augmentation();
    assert!(refusal(&cfg).contains("augmentation"));
    let mut cfg = base();
    cfg.model.name = "resnet50".into();
    assert!(refusal(&cfg).contains("model"));
    let mut cfg = base();
    cfg.checkpoint.monitor = hearth::train::Monitor::ValAuroc;
    assert!(refusal(&cfg).contains("val_auroc"));
    // --recompute recomputes a model's units; a module has none.
    let mut cfg = base();
    cfg.compute.recompute = true;
    assert!(refusal(&cfg).contains("recompute"));
    // --overlap hands over each unit's gradients as the backward finishes it: none here.
    let mut cfg = base();
    cfg.exchange.overlap = true;
    assert!(refusal(&cfg).contains("overlap"));
    // One process too.
    let mut cfg = base();
    cfg.mode = hearth::train::TrainingMode::DataParallel;
    cfg.data.val_fraction = 0.3;
    assert!(refusal(&cfg).contains("val_fraction"));
    // Nothing was written for a refused run.
    assert!(!dir.path().join("run").exists());
}

/// A module that computes in f32 only (the default `Net::logits_in`).
#[derive(Module, Debug)]
struct F32Only {
    mlp: example::Mlp,
}

impl Net for F32Only {
    type Input = Tensor<2>;
    fn logits(&self, x: Tensor<2>) -> Tensor<2> {
        self.mlp.logits(x)
    }
}

/// The example's module computes in the precision asked for (`Net::MIXED_PRECISION`): on 2
/// data-parallel ranks in fp16, rank 1's forced overflow at step 3 (the test hook) skips that
/// step on both, `metrics.csv` counts every skip, and the run learns as the f32 one does. A
/// module that computes in f32 only is refused a low precision by name, before any file.
#[test]
fn a_user_module_trains_in_mixed_precision_and_an_f32_only_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (f32_run, fp16_run) = (dir.path().join("f32"), dir.path().join("fp16"));
    alone(&["dp", f32_run.to_str().unwrap(), "--epochs", "4"]);
    let out = launch_with(
        &["-n", "2"],
        &[
            "dp",
            fp16_run.to_str().unwrap(),
            "--epochs",
            "4",
            "--precision",
            "fp16",
        ],
        &[("HEARTH_FP16_OVERFLOW_AT_STEP", "1:3")],
    );
    let skips = |r: usize| -> Vec<&str> {
        let prefix = format!("[rank {r}] fp16: optimizer step");
        out.lines().filter(|l| l.starts_with(&prefix)).collect()
    };
    assert!(
        skips(0)
            .iter()
            .any(|l| l.contains("optimizer step 3: gradients not finite")),
        "{out}"
    );
    let strip = |v: Vec<&str>| -> Vec<String> {
        v.iter()
            .map(|l| l.split_once("] ").unwrap().1.to_string())
            .collect()
    };
    assert_eq!(
        strip(skips(0)),
        strip(skips(1)),
        "one verdict per step:\n{out}"
    );
    let rows = metrics(&fp16_run);
    let counted: f64 = rows.values().map(|r| r["train_skipped_steps"]).sum();
    assert_eq!(counted as usize, skips(0).len(), "{rows:?}\n{out}");
    let best = |rows: &BTreeMap<usize, BTreeMap<String, f64>>| {
        rows.values()
            .map(|r| r["val_accuracy"])
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let f32_rows = metrics(&f32_run);
    assert!(
        best(&rows) >= best(&f32_rows) - 3.0 && best(&rows) > 50.0,
        "fp16 {rows:?}\nf32 {f32_rows:?}"
    );
    // Master weights: model.bpk holds f32 tensors that load into the user's module.
    assert!(exported_accuracy(&fp16_run) > 50.0);

    let mut cfg = TrainConfig::new(dir.path().join("refused"));
    cfg.compute.precision = hearth::train::Precision::Bf16;
    let custom = hearth::train::Custom::new(
        |d: &Device| F32Only {
            mlp: example::Mlp::new(3, d),
        },
        example::Spirals::new(3, 30, 1),
        example::Spirals::new(3, 30, 2),
        ["red", "green", "blue"].map(String::from).to_vec(),
    );
    let e = hearth::train::train_custom(&cfg, &custom, &Device::flex(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("precision bf16") && e.contains("MIXED_PRECISION"),
        "{e}"
    );
    assert!(!dir.path().join("refused").exists());
}

/// A multi-label set of the user's: points of the plane, labelled "east" (x > 0) and "north"
/// (y > 0), any of the two, both or none.
struct Quadrants {
    points: Vec<[f32; 2]>,
}

impl Quadrants {
    fn new(n: usize, seed: u64) -> Self {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
        };
        Self {
            points: (0..n).map(|_| [next(), next()]).collect(),
        }
    }
}

impl Examples for Quadrants {
    type Input = Tensor<2>;
    fn len(&self) -> usize {
        self.points.len()
    }
    fn batch(
        &self,
        indices: &[usize],
        device: &Device,
    ) -> Result<(Tensor<2>, Targets), hearth::train::ExampleError> {
        let (mut xy, mut hot) = (Vec::new(), Vec::new());
        for &i in indices {
            let p = self.points.get(i).ok_or(format!("no example {i}"))?;
            xy.extend_from_slice(p);
            hot.extend([
                f32::from(u8::from(p[0] > 0.0)),
                f32::from(u8::from(p[1] > 0.0)),
            ]);
        }
        let n = indices.len();
        Ok((
            Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            Targets::MultiHot(Tensor::from_data(TensorData::new(hot, [n, 2]), device)),
        ))
    }
}

#[test]
fn a_multi_label_user_module_trains_in_this_process_by_val_auroc() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let custom = hearth::train::Custom::new(
        |d: &Device| example::Mlp::new(2, d),
        Quadrants::new(256, 1),
        Quadrants::new(64, 2),
        ["east", "north"].map(String::from).to_vec(),
    )
    .multi_label();
    let mut cfg = TrainConfig::new(run.clone());
    cfg.epochs = 4;
    cfg.batch_size = 32;
    cfg.optim.lr = 0.1;
    cfg.optim.weight_decay = 0.0;
    cfg.optim.warmup_epochs = 0;
    cfg.checkpoint.monitor = hearth::train::Monitor::ValAuroc;
    let mut lines = Vec::new();
    let report = hearth::train::train_custom(&cfg, &custom, &Device::flex(), &mut |l| {
        lines.push(l.to_string())
    })
    .unwrap();
    let rows = metrics(&run);
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(
        rows.values().all(|r| r.contains_key("val_auroc")),
        "{rows:?}"
    );
    let best_auroc = rows
        .values()
        .map(|r| r["val_auroc"])
        .fold(f64::NEG_INFINITY, f64::max);
    // Two half-planes through the origin: a linear unit per label separates them.
    assert!(best_auroc > 90.0, "{rows:?}");
    // The best epoch is the one of the highest AUROC (metrics.csv keeps 6 decimals).
    assert_eq!(best_auroc, rows[&report.best_epoch]["val_auroc"]);
    let reported = report.best_val_auroc.expect("the best epoch's AUROC");
    assert!((reported - best_auroc).abs() < 1e-5, "{reported} {rows:?}");
    let per_class = report
        .per_class_auroc
        .expect("per-class AUROC of the export");
    assert_eq!(
        per_class
            .iter()
            .map(|(c, _)| c.as_str())
            .collect::<Vec<_>>(),
        ["east", "north"]
    );
    let csv = std::fs::read_to_string(run.join("auroc.csv")).unwrap();
    assert!(csv.contains("east") && csv.contains("north"), "{csv}");
    assert!(run.join("model.bpk").exists() && run.join("metrics.png").exists());
    assert!(
        lines.iter().any(|l| l.starts_with("epoch 4/4: ")),
        "{lines:?}"
    );
}

/// On `vulkan-cpu` (lavapipe: the wgpu path CI runs), the example's module trained in fp16
/// reaches the f32 run's best validation accuracy on the same device, data and seed (at most
/// 0.5 point below: with 192 validation points, at least as many right). bf16 is refused on
/// wgpu devices (no bf16 in their shaders), by name.
#[test]
fn on_vulkan_cpu_a_user_module_in_fp16_reaches_the_f32_accuracy() {
    let Some(device) = common::device_or_skip(
        hearth::device::DeviceChoice::VulkanCpu,
        "on_vulkan_cpu_a_user_module_in_fp16_reaches_the_f32_accuracy",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // 576 training and 192 validation points: whole batches of 32 only, so lavapipe compiles
    // (and tunes) the kernels of one batch shape.
    let custom = hearth::train::Custom::new(
        |d: &Device| example::Mlp::new(3, d),
        example::Spirals::new(3, 192, 1),
        example::Spirals::new(3, 64, 2),
        ["red", "green", "blue"].map(String::from).to_vec(),
    );
    let mut best = Vec::new();
    for precision in [
        hearth::train::Precision::Fp32,
        hearth::train::Precision::Fp16,
    ] {
        let mut cfg = TrainConfig::new(dir.path().join(precision.name()));
        cfg.epochs = 6;
        cfg.batch_size = 32;
        cfg.optim.lr = 0.1;
        cfg.optim.weight_decay = 0.0;
        cfg.optim.warmup_epochs = 0;
        cfg.compute.precision = precision;
        let t = Instant::now();
        let report = hearth::train::train_custom(&cfg, &custom, &device, &mut |l| {
            eprintln!("[{precision}] {l}")
        })
        .unwrap_or_else(|e| panic!("{precision}: {e}"));
        eprintln!(
            "{precision} on vulkan-cpu: {:.1} s",
            t.elapsed().as_secs_f64()
        );
        best.push(report.best_val_accuracy.unwrap_or(0.0));
    }
    assert!(best[0] > 50.0, "the f32 run itself must learn: {best:?}");
    assert!(
        best[1] >= best[0] - 0.5,
        "fp16 {} against f32 {}",
        best[1],
        best[0]
    );
    let mut cfg = TrainConfig::new(dir.path().join("bf16"));
    cfg.compute.precision = hearth::train::Precision::Bf16;
    let e = hearth::train::train_custom(&cfg, &custom, &device, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`compute.precision` bf16 does not run on this device"),
        "{e}"
    );
}
