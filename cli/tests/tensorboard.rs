//! Every run writes a TensorBoard event file beside `metrics.csv` (issue 57, item 3): read back
//! here with TensorBoard's own reader (the `tensorboard` package from PyPI, which `.ci/run`
//! installs), its scalars equal `metrics.csv` and its hyperparameters `hparams.json`; a
//! resumed run keeps each earlier epoch's wall time. With `--log-every N` the step scalars are
//! the job's in every mode (a parameter-server lead's own), and a resume after a crash keeps
//! no step twice.

mod common;

use std::path::Path;
use std::process::Command;

use std::collections::BTreeMap;

use hearth::tensorboard::{FILE_NAME, STEPS_FILE_NAME, read};

/// TensorBoard's reading of `run`: `{"scalars": {tag: [[step, value], ...]}, "hparams":
/// {name: value}}`, or `None` where the `tensorboard` package is missing and
/// `HEARTH_ALLOW_SKIP=tensorboard` allows that.
fn tensorboard_reads(run: &Path) -> Option<serde_json::Value> {
    const SCRIPT: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
ea.Reload()
scalars = {t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
print(json.dumps({"scalars": scalars, "hparams": hparams}))
"#;
    let has = Command::new("python3")
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            common::may_skip("tensorboard"),
            "the tensorboard Python package is missing: `python3 -m pip install tensorboard` \
             (as .ci/run does), or HEARTH_ALLOW_SKIP=tensorboard to skip"
        );
        eprintln!("SKIPPED: no tensorboard package (HEARTH_ALLOW_SKIP=tensorboard)");
        return None;
    }
    let out = Command::new("python3")
        .args(["-c", SCRIPT, run.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tensorboard's reader: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn tensorboard_reads_the_runs_scalars_and_hyperparameters_and_a_resume_keeps_wall_times() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    let run = dir.path().join("run");
    let mut cfg = common::small_config(&data, run.clone());
    cfg.epochs = 3;
    common::pin_flex();
    let device = burn::prelude::Device::flex();
    let mut first = cfg.clone();
    first.checkpoint.stop_after_epoch = Some(1);
    hearth::train::train(&first, &device, &mut |_| {}).unwrap();
    let file = run.join(FILE_NAME);
    let before = read(&std::fs::read(&file).unwrap(), &file).unwrap();
    let wall = |events: &[hearth::tensorboard::Event], step: i64| {
        events
            .iter()
            .find(|e| e.step == step && !e.scalars.is_empty())
            .map(|e| e.wall_time)
    };
    let epoch1 = wall(&before, 1).expect("epoch 1 in the event file");
    assert!(wall(&before, 2).is_none());
    std::thread::sleep(std::time::Duration::from_millis(50));
    let mut again = cfg.clone();
    again.checkpoint.resume = true;
    hearth::train::train(&again, &device, &mut |_| {}).unwrap();
    let after = read(&std::fs::read(&file).unwrap(), &file).unwrap();
    assert_eq!(
        wall(&after, 1),
        Some(epoch1),
        "a resume keeps epoch 1's wall time"
    );
    assert!(wall(&after, 3).unwrap() > epoch1);

    let Some(tb) = tensorboard_reads(&run) else {
        return;
    };
    let rows = common::metrics(&run);
    assert_eq!(rows.len(), 3);
    let mut compared = 0;
    for (epoch, row) in &rows {
        for (column, value) in row {
            if !value.is_finite() {
                continue;
            }
            let points = tb["scalars"][column]
                .as_array()
                .unwrap_or_else(|| panic!("no scalar {column}: {tb}"));
            let point = points
                .iter()
                .find(|p| p[0].as_u64() == Some(*epoch as u64))
                .unwrap_or_else(|| panic!("{column} lacks epoch {epoch}: {points:?}"));
            let v = point[1].as_f64().unwrap();
            assert!(
                (v - value).abs() <= 1e-5 * value.abs().max(1.0),
                "{column} at epoch {epoch}: {v} in TensorBoard, {value} in metrics.csv"
            );
            compared += 1;
        }
    }
    assert!(compared >= 3 * 8, "{compared} values compared");
    let hp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("hparams.json")).unwrap()).unwrap();
    assert_eq!(tb["hparams"]["lr"], hp["lr"], "{tb}");
    assert_eq!(tb["hparams"]["model"], hp["model"], "{tb}");
    assert_eq!(tb["hparams"]["epochs"].as_f64(), Some(3.0), "{tb}");
}

/// The step file's records of `run`: step -> tag -> value.
fn step_records(run: &Path) -> BTreeMap<i64, BTreeMap<String, f32>> {
    let file = run.join(STEPS_FILE_NAME);
    let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut out = BTreeMap::new();
    for e in read(&bytes, &file).unwrap() {
        if e.scalars.is_empty() {
            continue;
        }
        let row: BTreeMap<String, f32> = e.scalars.into_iter().collect();
        assert!(out.insert(e.step, row).is_none(), "step {} twice", e.step);
    }
    out
}

/// `--log-every 2` over 2 epochs of 10 steps: records at steps 2, 4, ..., 20 in one process,
/// data parallel, elastic and a pipeline, each the whole job's mean loss and accuracy of its
/// two steps (one process's within float noise) and the step's rate; a sync parameter-server
/// lead's at the same steps with the same rates (its loss is its own shard's). Stopped after
/// epoch 1, a record past the checkpoint added (as a crash leaves one), and resumed: the
/// straight run's records, none twice. TensorBoard's reader sees the step tags.
#[test]
fn step_scalars_are_the_jobs_in_every_mode_and_a_resume_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::elastic_data(dir.path());
    let path = |n: &str| dir.path().join(n);
    let base = [
        "--model",
        "vgg-mini-plain",
        "--batch-size",
        "24",
        "--epochs",
        "2",
        "--lr",
        "0.05",
        "--augment",
        "none",
        "--log-every",
        "2",
    ];
    let one_process = |run: &Path, more: &[&str]| {
        let mut args = vec!["train", "--data", data.to_str().unwrap(), "--workers", "1"];
        args.extend(["--size", "32"]);
        args.extend(base);
        args.extend(more);
        let resume = more.contains(&"--resume");
        args.retain(|a| *a != "--resume");
        args.extend([
            if resume { "--resume" } else { "--run-dir" },
            run.to_str().unwrap(),
        ]);
        let out = common::hearth_cli(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    one_process(&path("one"), &[]);
    let one = step_records(&path("one"));
    assert_eq!(
        one.keys().copied().collect::<Vec<_>>(),
        (1..=10).map(|k| 2 * k).collect::<Vec<i64>>()
    );
    let value = |r: &BTreeMap<String, f32>, tag: &str| {
        *r.get(tag).unwrap_or_else(|| panic!("no {tag} in {r:?}"))
    };
    let lrs: Vec<f32> = one.values().map(|r| value(r, "step/train_lr")).collect();
    assert!(lrs[0] < lrs[4], "warmup raises the rate: {lrs:?}");
    let modes: [(&str, usize, &[&str]); 4] = [
        ("dp", 2, &[]),
        ("elastic", 2, &["--elastic"]),
        ("ps", 3, &["--ps", "1", "--mode", "sync"]),
        (
            "pipeline",
            1,
            &["--pipeline-stages", "2", "--micro-batches", "2"],
        ),
    ];
    for (name, world, args) in modes {
        if world == 1 {
            one_process(&path(name), args);
        } else {
            let mut job =
                common::Job::spawn(dir.path(), &data, &path(name), world, &base, args, &[]);
            assert!(
                job.wait(400).iter().all(|&ok| ok),
                "{name}:\n{}",
                job.all_logs()
            );
        }
        let got = step_records(&path(name));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            one.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (step, r) in &got {
            let lr = (
                value(r, "step/train_lr"),
                value(&one[step], "step/train_lr"),
            );
            assert!(
                (lr.0 - lr.1).abs() <= 1e-6 * lr.1.abs(),
                "{name} step {step}: {lr:?}"
            );
            let loss = value(r, "step/train_loss");
            assert!(loss.is_finite(), "{name} step {step}: {r:?}");
            if name != "ps" {
                let theirs = value(&one[step], "step/train_loss");
                assert!(
                    (loss - theirs).abs() <= 1e-3 * theirs.abs().max(1.0),
                    "{name} step {step}: loss {loss} against one process's {theirs}"
                );
            }
        }
    }
    // Stopped after epoch 1; a record past the checkpoint, as a crash in epoch 2 leaves it;
    // resumed.
    let run = path("resumed");
    one_process(&run, &["--stop-after-epoch", "1"]);
    let file = run.join(STEPS_FILE_NAME);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes.extend(hearth::tensorboard::scalar_record(
        &hearth::tensorboard::Event {
            wall_time: 1.0,
            step: 14,
            scalars: vec![("step/train_loss".into(), 123.0)],
            other_tags: Vec::new(),
        },
    ));
    std::fs::write(&file, bytes).unwrap();
    one_process(&run, &["--resume"]);
    let resumed = step_records(&run);
    assert_eq!(
        resumed.keys().collect::<Vec<_>>(),
        one.keys().collect::<Vec<_>>()
    );
    for (step, r) in &resumed {
        for tag in ["step/train_loss", "step/train_accuracy", "step/train_lr"] {
            let (a, b) = (value(r, tag), value(&one[step], tag));
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "step {step} {tag}: {a} vs {b}"
            );
        }
    }
    let Some(tb) = tensorboard_reads(&run) else {
        return;
    };
    let points = tb["scalars"]["step/train_loss"]
        .as_array()
        .unwrap_or_else(|| panic!("no step scalars: {tb}"));
    assert_eq!(points.len(), 10, "{points:?}");
    assert_eq!(points[9][0].as_u64(), Some(20));
}
