//! ONNX export (issue 57, item 4): every parity fixture (torchvision's own networks and
//! weights, scripts/make_parity_fixtures.py) loaded into Hearth and exported runs in
//! onnxruntime (PyPI) and gives PyTorch's logits within 1e-4, at the fixture's batch of 2 and
//! at batches of 1 and 4 (the batch is a dynamic axis); `hearth export --format onnx` writes
//! the same from a model file, with the class names and preprocessing in the graph's metadata,
//! and refuses what it cannot do by name.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::Distribution;
use common::*;
use hearth::device::DeviceChoice;
use hearth::models::{LoadOptions, Preprocessing, load_torchvision, save_model_with};
use hearth::npy;

const TOLERANCE: f32 = 1e-4;

/// Runs `model` in onnxruntime on `input` at batches 1, 2·k and 4 (the input's first row, the
/// input, the input twice); writes `out{1,2,4}.npy` and prints the metadata as JSON.
const RUN: &str = r#"
import json, sys
import numpy as np
import onnxruntime as ort
model, x, out = sys.argv[1], np.load(sys.argv[2]), sys.argv[3]
s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
assert [i.name for i in s.get_inputs()] == ["input"], s.get_inputs()
assert s.get_inputs()[0].shape[0] == "batch", s.get_inputs()[0].shape
for tag, batch in (("1", x[:1]), ("2", x), ("4", np.concatenate([x, x]))):
    np.save(f"{out}/out{tag}.npy", s.run(["logits"], {"input": batch.astype(np.float32)})[0])
print(json.dumps(s.get_modelmeta().custom_metadata_map))
"#;

/// Whether `python3` has onnxruntime; a failure unless `HEARTH_ALLOW_SKIP` names it.
fn onnxruntime() -> bool {
    let has = Command::new("python3")
        .args(["-c", "import onnxruntime, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            may_skip("onnxruntime"),
            "the onnxruntime Python package is missing: `python3 -m pip install onnxruntime` \
             (as .ci/run does), or HEARTH_ALLOW_SKIP=onnxruntime to skip"
        );
        eprintln!("SKIPPED: no onnxruntime package (HEARTH_ALLOW_SKIP=onnxruntime)");
    }
    has
}

/// onnxruntime's logits at batches 1, 2 (the input) and 4, and the model's metadata.
fn run_onnx(model: &Path, input: &Path, dir: &Path) -> ([Vec<f32>; 3], serde_json::Value) {
    let stdout = dir.join("ort.out");
    let stderr = dir.join("ort.err");
    let mut child = Command::new("python3")
        .args(["-c", RUN])
        .arg(model)
        .arg(input)
        .arg(dir)
        .stdout(Stdio::from(std::fs::File::create(&stdout).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut child, Instant::now() + Duration::from_secs(300))
        .expect("onnxruntime ran past 300 s");
    assert!(
        status.success(),
        "onnxruntime on {}: {}",
        model.display(),
        std::fs::read_to_string(&stderr).unwrap_or_default()
    );
    let read = |tag: &str| npy::read(&dir.join(format!("out{tag}.npy"))).unwrap().data;
    let meta = serde_json::from_str(&std::fs::read_to_string(&stdout).unwrap()).unwrap();
    ([read("1"), read("2"), read("4")], meta)
}

/// The three batches' logits against `expected` (the batch of 2).
fn check(what: &str, got: &[Vec<f32>; 3], expected: &[f32]) -> f32 {
    let half = expected.len() / 2;
    let twice: Vec<f32> = expected.iter().chain(expected).copied().collect();
    let diffs = [
        max_abs_diff(&got[0], &expected[..half]),
        max_abs_diff(&got[1], expected),
        max_abs_diff(&got[2], &twice),
    ];
    let worst = diffs.iter().copied().fold(0.0, f32::max);
    assert!(
        worst <= TOLERANCE,
        "{what}: onnxruntime's logits off by {diffs:?} at batches 1, 2, 4"
    );
    worst
}

#[test]
fn every_fixture_exported_to_onnx_gives_pytorchs_logits_in_onnxruntime() {
    if !onnxruntime() {
        return;
    }
    let device = DeviceChoice::Flex.device().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (name, file) in [
        ("resnet_basic", "resnet_basic.pth"),
        ("resnet_bottleneck", "resnet_bottleneck.pth"),
        ("densenet", "densenet.pth"),
        ("vgg_bn", "vgg_bn.pth"),
        ("vgg", "vgg.safetensors"),
    ] {
        let mut model = fixture_config(name).init(&device).unwrap();
        load_torchvision(&mut model, &fixture(file), &LoadOptions::default()).unwrap();
        let model = model.valid();
        let input_path = fixture(&format!("{name}_input.npy"));
        let input = npy::read(&input_path).unwrap();
        let expected = npy::read(&fixture(&format!("{name}_logits.npy"))).unwrap();
        let out = dir.path().join(format!("{name}.onnx"));
        let size = [input.shape[2], input.shape[3]];
        let summary = hearth::onnx::export_onnx(&model, size, &[], &out).unwrap();
        assert_eq!(
            std::fs::metadata(&out).unwrap().len() as usize,
            summary.bytes
        );
        let work = dir.path().join(name);
        std::fs::create_dir_all(&work).unwrap();
        let (got, _) = run_onnx(&out, &input_path, &work);
        let worst = check(file, &got, &expected.data);
        eprintln!(
            "{file} {size:?}: {} nodes, max |onnxruntime - PyTorch| {worst:.2e}",
            summary.nodes
        );
    }
}

fn write_model(dir: &Path) -> (PathBuf, Tensor<4>, Vec<f32>) {
    let device = DeviceChoice::Flex.device().unwrap();
    let config = fixture_config("resnet_bottleneck");
    let model = config.init(&device).unwrap().valid();
    let path = dir.join("model.bpk");
    let names: Vec<String> = (0..7).map(|i| format!("class{i}")).collect();
    let prep = Preprocessing::eval(48);
    save_model_with(&model, &config, Some(&names), Some(&prep), &path).unwrap();
    let x = Tensor::<4>::random([2, 3, 48, 48], Distribution::Normal(0.0, 1.0), &device);
    let logits = model
        .forward(x.clone())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    (path, x, logits)
}

#[test]
fn hearth_export_writes_onnx_at_the_trained_size_with_classes_and_preprocessing() {
    if !onnxruntime() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (model, x, logits) = write_model(dir.path());
    let input = dir.path().join("x.npy");
    npy::write(
        &input,
        &x.dims(),
        &x.into_data().try_to_vec::<f32>().unwrap(),
    )
    .unwrap();
    let out = hearth_cli(&[
        "export",
        "--weights",
        model.to_str().unwrap(),
        "--format",
        "onnx",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The size the file records (Preprocessing::eval(48)), the default path beside it.
    assert!(stdout.contains("[batch, 3, 48, 48]"), "{stdout}");
    let onnx = dir.path().join("model.onnx");
    let (got, meta) = run_onnx(&onnx, &input, dir.path());
    check("hearth export", &got, &logits);
    let classes: Vec<String> = serde_json::from_str(meta["class_names"].as_str().unwrap()).unwrap();
    assert_eq!(classes.len(), 7);
    assert_eq!(classes[6], "class6");
    let prep: serde_json::Value =
        serde_json::from_str(meta["preprocessing"].as_str().unwrap()).unwrap();
    assert_eq!(prep["crop"], 48, "{prep}");
}

#[test]
fn hearth_export_refuses_by_name_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _, _) = write_model(dir.path());
    let m = model.to_str().unwrap();
    let garbage = dir.path().join("garbage.bpk");
    std::fs::write(&garbage, b"not a model").unwrap();
    for (args, says) in [
        (vec!["--format", "onnx", "--size", "16"], "at least 32"),
        (
            vec!["--format", "onnx", "--size", "64xq"],
            "'q' is not a whole number",
        ),
        (vec!["--size", "64"], "--size sets the ONNX graph's input"),
        (vec!["--format", "tflite"], "unknown --format tflite"),
        (
            vec!["--format", "pth", "--out", m],
            "is the model file itself",
        ),
        (
            vec!["--format", "pth", "--out", "x.safetensors"],
            "--out x.safetensors names a safetensors file, but --format is pth",
        ),
        (
            vec!["--format", "safetensors", "--out", "x.ONNX"],
            "names a onnx file, but --format is safetensors",
        ),
    ] {
        let mut all = vec!["export", "--weights", m];
        all.extend(&args);
        let out = hearth_cli(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let out = hearth_cli(&[
        "export",
        "--weights",
        garbage.to_str().unwrap(),
        "--format",
        "onnx",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("garbage.bpk"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!dir.path().join("garbage.onnx").exists());
    assert!(!Path::new("x.safetensors").exists() && !Path::new("x.ONNX").exists());
}

#[test]
fn hearth_export_takes_the_format_outs_extension_names() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _, _) = write_model(dir.path());
    // A zip archive (PyTorch's format), a protobuf starting with ir_version (field 1, a
    // varint), and safetensors' 8-byte header length followed by its JSON.
    type IsFormat = fn(&[u8]) -> bool;
    let zip: IsFormat = |b| b.starts_with(b"PK");
    let onnx: IsFormat = |b| b.first() == Some(&0x08);
    let safetensors: IsFormat = |b| b.get(8) == Some(&b'{');
    let cases = [
        ("as.pt", "written to", zip),
        ("as.onnx", "[batch, 3, 48, 48]", onnx),
        ("as.weights", "written to", safetensors),
    ];
    for (name, says, is_format) in cases {
        let out_path = dir.path().join(name);
        let out = hearth_cli(&[
            "export",
            "--weights",
            model.to_str().unwrap(),
            "--out",
            out_path.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(says),
            "{name}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&out_path).unwrap();
        assert!(
            is_format(&bytes),
            "{name}: {:?}",
            &bytes[..bytes.len().min(12)]
        );
    }
}
