//! Every run writes a TensorBoard event file beside `metrics.csv` (issue 57, item 3): read back
//! here with TensorBoard's own reader (the `tensorboard` package from PyPI, which `.ci/run`
//! installs), its scalars equal `metrics.csv` and its hyperparameters `hparams.json`; a
//! resumed run keeps each earlier epoch's wall time.

mod common;

use std::path::Path;
use std::process::Command;

use hearth::tensorboard::{FILE_NAME, read};

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
