//! Bad weight files give errors that name the file, the key or the shapes; never a panic.

mod common;

use std::path::Path;

use burn::module::Module;
use burn::prelude::*;
use common::*;
use hearth::models::{
    BlockKind, LoadOptions, ModelConfig, ModelError, ResNetConfig, load_model, load_torchvision,
    save_model,
};

fn resnet(layers: [usize; 4], classes: usize) -> hearth::models::Classifier {
    ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Basic, layers, classes)
            .with_stem_width(16)
            .with_stage_widths([16, 32, 64, 128]),
    )
    .init(&Device::flex())
    .unwrap()
}

fn load(model: &mut hearth::models::Classifier, path: &Path) -> Result<(), ModelError> {
    load_torchvision(model, path, &LoadOptions::default()).map(|_| ())
}

#[test]
fn missing_file_names_the_path() {
    let err = load(
        &mut resnet([1, 1, 1, 1], 10),
        Path::new("/nonexistent/w.pth"),
    )
    .unwrap_err();
    assert!(matches!(err, ModelError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/w.pth"), "{err}");
}

#[test]
fn unknown_extension_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("weights.txt");
    std::fs::write(&p, b"hello").unwrap();
    let err = load(&mut resnet([1, 1, 1, 1], 10), &p).unwrap_err();
    assert!(matches!(err, ModelError::UnknownFormat { .. }), "{err}");
}

#[test]
fn truncated_and_non_weight_files_are_corrupt_errors() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(fixture("resnet_basic.pth")).unwrap();
    for (name, bytes) in [
        ("half.pth", full[..full.len() / 2].to_vec()),
        ("head.pth", full[..100].to_vec()),
        ("empty.pth", Vec::new()),
        ("text.pth", b"this is not a pickle".to_vec()),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, &bytes).unwrap();
        let err = load(&mut resnet([1, 1, 1, 1], 10), &p).unwrap_err();
        assert!(err.to_string().contains(name), "{name}: {err}");
    }
    let st = std::fs::read(fixture("densenet.safetensors")).unwrap();
    let p = dir.path().join("cut.safetensors");
    std::fs::write(&p, &st[..st.len() - 1000]).unwrap();
    let mut m = fixture_config("densenet").init(&Device::flex()).unwrap();
    let err = load(&mut m, &p).unwrap_err();
    assert!(err.to_string().contains("cut.safetensors"), "{err}");
}

#[test]
fn weights_of_another_architecture_are_refused() {
    let err = load(&mut resnet([1, 1, 1, 1], 10), &fixture("densenet.pth")).unwrap_err();
    assert!(matches!(err, ModelError::MissingKeys { .. }), "{err}");
    assert!(err.to_string().contains("another architecture"), "{err}");
}

#[test]
fn missing_keys_are_named() {
    // A [2,1,1,1] network needs layer1.1, which the [1,1,1,1] file lacks.
    let err = load(&mut resnet([2, 1, 1, 1], 10), &fixture("resnet_basic.pth")).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::MissingKeys { .. }), "{msg}");
    assert!(msg.contains("layer1.1."), "{msg}");
}

#[test]
fn unexpected_keys_are_named() {
    // The bottleneck file has layer1.1; a [1,1,1,1] bottleneck network does not.
    let mut model = ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Bottleneck, [1, 1, 1, 1], 7)
            .with_stem_width(16)
            .with_stage_widths([8, 16, 32, 64]),
    )
    .init(&Device::flex())
    .unwrap();
    let err = load(&mut model, &fixture("resnet_bottleneck.pth")).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::UnexpectedKeys { .. }), "{msg}");
    assert!(msg.contains("layer1.1."), "{msg}");
}

#[test]
fn shape_mismatches_name_key_and_shapes_and_skip_head_allows_new_classes() {
    let err = load(&mut resnet([1, 1, 1, 1], 3), &fixture("resnet_basic.pth")).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::ShapeMismatch { .. }), "{msg}");
    assert!(msg.contains("fc.weight") && msg.contains("128"), "{msg}");
    // Transfer learning: a 3-class network takes everything but the head.
    let mut model = resnet([1, 1, 1, 1], 3);
    let report = load_torchvision(
        &mut model,
        &fixture("resnet_basic.pth"),
        &LoadOptions {
            skip_head: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        report.ignored.iter().any(|k| k.starts_with("fc.")),
        "{:?}",
        report.ignored
    );
    assert_eq!(model.num_classes(), 3);
}

#[test]
fn hearth_model_files_round_trip_and_reject_damage() {
    let device = Device::flex();
    let dir = tempfile::tempdir().unwrap();
    let config = fixture_config("resnet_basic");
    let mut model = config.init(&device).unwrap();
    load(&mut model, &fixture("resnet_basic.pth")).unwrap();
    let path = dir.path().join("model.bpk");
    let names: Vec<String> = (0..10).map(|i| format!("class \"{i}\"")).collect();
    save_model(&model, &config, Some(&names), &path).unwrap();

    let saved = load_model(&path, &device).unwrap();
    assert_eq!(saved.class_names.as_deref(), Some(names.as_slice()));
    let x = Tensor::<4>::ones([1, 3, 32, 32], &device);
    let a: Vec<f32> = model
        .valid()
        .forward(x.clone())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let b: Vec<f32> = saved
        .model
        .valid()
        .forward(x)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(a, b);

    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.bpk");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_model(&cut, &device).unwrap_err();
    assert!(err.to_string().contains("cut.bpk"), "{err}");
    let junk = dir.path().join("junk.bpk");
    std::fs::write(&junk, b"BURNPACK? no").unwrap();
    assert!(load_model(&junk, &device).is_err());
}
