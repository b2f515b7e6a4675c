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

    // Written a tensor at a time (`hearth_models::pack`), the file is the one Burn's own
    // burnpack store writes with the same metadata, byte for byte.
    use burn::store::{BurnpackStore, ModuleSnapshot};
    let burns = dir.path().join("burns.bpk");
    let mut store = BurnpackStore::from_file(&burns)
        .auto_extension(false)
        .overwrite(true)
        .metadata("hearth.model_config", config.to_json())
        .metadata("hearth.head_activation", model.head_activation().name())
        .metadata("hearth.class_names", serde_json::to_string(&names).unwrap());
    model.save_into(&mut store).unwrap();
    assert!(
        std::fs::read(&path).unwrap() == std::fs::read(&burns).unwrap(),
        "model.bpk differs from Burn's own file of the model"
    );

    // Written from a checkpoint file a tensor at a time (`save_model_from_file`, the
    // export of a run's best epoch), into a skeleton never initialised: the same file again.
    let from_file = dir.path().join("from-file.bpk");
    let skeleton = config.init(&device).unwrap();
    let write = |checkpoint: &Path, skeleton: &hearth::models::Classifier| {
        hearth::models::save_model_from_file(
            checkpoint,
            skeleton,
            &config,
            Some(&names),
            None,
            &from_file,
        )
    };
    write(&burns, &skeleton).unwrap();
    assert!(
        std::fs::read(&from_file).unwrap() == std::fs::read(&path).unwrap(),
        "the model file written from the checkpoint differs from the model's own"
    );
    std::fs::remove_file(&from_file).unwrap();
    // A checkpoint of another model, or a cut one: an error naming the file, nothing written.
    let other = resnet([2, 1, 1, 1], 10);
    let err = write(&burns, &other).unwrap_err().to_string();
    assert!(
        err.contains("burns.bpk") && err.contains("layer1.1"),
        "{err}"
    );
    let wider = resnet([1, 1, 1, 1], 7);
    let err = write(&burns, &wider).unwrap_err().to_string();
    assert!(
        err.contains("shape mismatch for 'ResNet.fc.weight'"),
        "{err}"
    );
    let cut_checkpoint = dir.path().join("cut-checkpoint.bpk");
    let whole = std::fs::read(&burns).unwrap();
    std::fs::write(&cut_checkpoint, &whole[..whole.len() - 100]).unwrap();
    let err = write(&cut_checkpoint, &skeleton).unwrap_err().to_string();
    assert!(err.contains("cut-checkpoint.bpk"), "{err}");
    assert!(!from_file.exists(), "nothing written from a bad checkpoint");

    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.bpk");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_model(&cut, &device).unwrap_err();
    assert!(err.to_string().contains("cut.bpk"), "{err}");
    let junk = dir.path().join("junk.bpk");
    std::fs::write(&junk, b"BURNPACK? no").unwrap();
    assert!(load_model(&junk, &device).is_err());
}

/// A `.safetensors` file holding only `tensors` (name, shape; zero-filled f32), written by hand:
/// 8-byte header length, JSON header, data.
fn safetensors(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * 4;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let json = serde_json::Value::Object(header).to_string();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json.as_bytes());
    out.extend(vec![0u8; offset]);
    std::fs::write(path, out).unwrap();
}

#[test]
fn the_head_size_of_every_family_is_read_from_full_size_torchvision_files() {
    use hearth::models::Architecture;
    use hearth::models::weights::torchvision_num_classes;
    let dir = tempfile::tempdir().unwrap();
    // torchvision's head keys and full-size input widths, 7 classes; DataParallel prefixes too.
    for (arch, key, inputs) in [
        ("resnet50", "fc.weight", 2048),
        ("resnet18", "fc.weight", 512),
        ("vgg16", "classifier.6.weight", 4096),
        ("vgg11_bn", "classifier.6.weight", 4096),
        ("densenet121", "classifier.weight", 1024),
        ("densenet161", "classifier.weight", 2208),
    ] {
        for prefix in ["", "module."] {
            let file = dir.path().join(format!("{arch}{prefix}.safetensors"));
            // VGG's classifier is a Sequential with gaps (0, 3, 6): the lookup must not renumber.
            let mut tensors = vec![(format!("{prefix}{key}"), vec![7, inputs])];
            if arch.starts_with("vgg") {
                tensors.push((format!("{prefix}classifier.0.weight"), vec![4, 4]));
                tensors.push((format!("{prefix}classifier.3.weight"), vec![4, 4]));
            }
            let named: Vec<(&str, Vec<usize>)> = tensors
                .iter()
                .map(|(n, s)| (n.as_str(), s.clone()))
                .collect();
            safetensors(&file, &named);
            let arch = Architecture::from_name(arch).unwrap();
            assert_eq!(
                torchvision_num_classes(arch, &file).unwrap(),
                7,
                "{} {prefix}",
                arch.name()
            );
        }
    }
    // The same through a PyTorch pickle: the VGG parity fixture (torchvision's make_layers and
    // classifier Sequential, 6 classes).
    let vgg = Architecture::from_name("vgg11_bn").unwrap();
    assert_eq!(
        torchvision_num_classes(vgg, &fixture("vgg_bn.pth")).unwrap(),
        6
    );
}

#[test]
fn a_wrong_file_is_told_the_same_way_whether_its_head_or_its_weights_are_read() {
    use hearth::models::Architecture;
    use hearth::models::weights::torchvision_num_classes;
    // DenseNet weights given as a ResNet's: predict reads the head size first, train loads.
    let arch = Architecture::from_name("resnet18").unwrap();
    let file = fixture("densenet.pth");
    let by_head = torchvision_num_classes(arch, &file)
        .unwrap_err()
        .to_string();
    let mut model = arch.init(1000, &Device::flex()).unwrap();
    let options = hearth::models::LoadOptions {
        skip_head: true,
        ..Default::default()
    };
    let by_load = hearth::models::load_torchvision(&mut model, &file, &options)
        .unwrap_err()
        .to_string();
    assert_eq!(by_head, by_load);
    assert!(!by_head.contains("1 parameter"), "{by_head}");
}

#[test]
fn a_lightning_checkpoint_loads_the_state_dict_inside_it() {
    // {'state_dict': {'model.' + key: tensor}, 'epoch': 3, 'global_step': 30}, as PyTorch
    // Lightning saves a LightningModule whose network is `self.model` (written from
    // resnet_basic.pth by scripts/make_lightning_fixture.py).
    let device = Device::flex();
    let config = fixture_config("resnet_basic");
    let mut plain = config.init(&device).unwrap();
    load(&mut plain, &fixture("resnet_basic.pth")).unwrap();
    let mut wrapped = config.init(&device).unwrap();
    load(&mut wrapped, &fixture("resnet_basic_lightning.pth")).unwrap();
    let x = Tensor::<4>::ones([1, 3, 32, 32], &device);
    let a: Vec<f32> = plain
        .valid()
        .forward(x.clone())
        .into_data()
        .iter()
        .collect();
    let b: Vec<f32> = wrapped.valid().forward(x).into_data().iter().collect();
    assert_eq!(a, b);
    // predict reads the head size inside it too.
    let arch = hearth::models::Architecture::from_name("resnet18").unwrap();
    assert_eq!(
        hearth::models::weights::torchvision_num_classes(
            arch,
            &fixture("resnet_basic_lightning.pth")
        )
        .unwrap(),
        10
    );
}

/// Counts a model's float parameters, and those not made yet (Burn's lazy parameters).
#[derive(Default)]
struct Made {
    params: usize,
    unmade: usize,
}

impl burn::module::ModuleVisitor for Made {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        self.params += 1;
        self.unmade += usize::from(!param.is_initialized());
    }
}

/// Every float tensor of `model`, in visiting order (reading makes a deferred one).
fn values(model: &hearth::models::Classifier) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0.push(param.val().into_data().iter().collect());
        }
    }
    let mut v = Values(Vec::new());
    model.visit(&mut v);
    v.0
}

#[test]
fn a_deferred_load_reads_nothing_until_used_then_gives_the_eager_load_s_values() {
    use hearth::models::load_torchvision_deferred;
    let device = Device::flex();
    // ResNet, VGG (its linear weights transposed), DenseNet, a Lightning checkpoint wrapping
    // its state_dict, and SafeTensors files.
    for (file, config) in [
        ("resnet_basic.pth", "resnet_basic"),
        ("vgg_bn.pth", "vgg_bn"),
        ("densenet.pth", "densenet"),
        ("resnet_basic_lightning.pth", "resnet_basic"),
        ("vgg.safetensors", "vgg"),
        ("densenet.safetensors", "densenet"),
    ] {
        let config = fixture_config(config);
        let mut eager = config.init(&device).unwrap();
        let eager_report = load_torchvision(&mut eager, &fixture(file), &Default::default())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let fresh = config.init(&device).unwrap();
        let (deferred, report, reads) =
            load_torchvision_deferred(fresh, &fixture(file), &Default::default())
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(report.applied, eager_report.applied, "{file}");
        assert_eq!(report.ignored, eager_report.ignored, "{file}");
        // Nothing read but what a fresh model has made already: the batch norms' running
        // statistics (buffers) and the head's weight (made to read the class count, as the
        // eager load does), replaced as they are mapped. Every parameter a fresh model leaves
        // unmade is still unmade.
        let (mut made, mut fresh) = (Made::default(), Made::default());
        deferred.visit(&mut made);
        let fresh_model = config.init(&device).unwrap();
        assert!(fresh_model.num_classes() > 0);
        fresh_model.visit(&mut fresh);
        assert!(fresh.unmade > 0, "{file}");
        assert_eq!(
            (made.params, made.unmade),
            (fresh.params, fresh.unmade),
            "{file}"
        );
        assert_eq!(values(&deferred), values(&eager), "{file}");
        let x = Tensor::<4>::ones([1, 3, 32, 32], &device);
        let a: Vec<f32> = eager
            .valid()
            .forward(x.clone())
            .into_data()
            .iter()
            .collect();
        let b: Vec<f32> = deferred.valid().forward(x).into_data().iter().collect();
        assert_eq!(a, b, "{file}");
        assert!(reads.failure().is_none(), "{file}");
        // Every tensor, the Lightning checkpoint's too, is read straight from the file, for
        // ZeRO stage 3's rank 0 to cut into windows (`hearth::train::zero`).
        assert!(reads.file_tensors().is_some(), "{file}");
    }
}

#[test]
fn a_deferred_load_refuses_what_the_eager_load_refuses_with_the_same_error() {
    use hearth::models::{Architecture, load_torchvision_deferred};
    let device = Device::flex();
    let options = LoadOptions {
        skip_head: true,
        ..Default::default()
    };
    // Another architecture's file.
    let arch = Architecture::from_name("resnet18").unwrap();
    for file in [fixture("densenet.pth"), fixture("densenet.safetensors")] {
        let mut model = arch.init(1000, &device).unwrap();
        let eager = load_torchvision(&mut model, &file, &options).unwrap_err();
        let model = arch.init(1000, &device).unwrap();
        let deferred = load_torchvision_deferred(model, &file, &options).unwrap_err();
        assert_eq!(eager.to_string(), deferred.to_string());
    }
    // A deeper variant's weights into a shallower model, and a truncated file.
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(fixture("resnet_basic.pth")).unwrap();
    let half = dir.path().join("half.pth");
    std::fs::write(&half, &full[..full.len() / 2]).unwrap();
    for (file, config) in [
        (fixture("resnet_bottleneck.pth"), "resnet_basic"),
        (half, "resnet_basic"),
    ] {
        let config = fixture_config(config);
        let eager = load(&mut config.init(&device).unwrap(), &file).unwrap_err();
        let deferred =
            load_torchvision_deferred(config.init(&device).unwrap(), &file, &Default::default())
                .unwrap_err();
        assert_eq!(
            eager.to_string(),
            deferred.to_string(),
            "{}",
            file.display()
        );
    }
    // A Hearth model file is not a torchvision file.
    let bpk = dir.path().join("model.bpk");
    let model = fixture_config("resnet_basic").init(&device).unwrap();
    save_model(&model, &fixture_config("resnet_basic"), None, &bpk).unwrap();
    let err = load_torchvision_deferred(model, &bpk, &Default::default()).unwrap_err();
    assert!(err.to_string().contains("load_model"), "{err}");
}

#[test]
fn a_deferred_read_that_fails_later_is_reported_not_a_panic() {
    use hearth::models::load_torchvision_deferred;
    let device = Device::flex();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("w.pth");
    std::fs::copy(fixture("resnet_basic.pth"), &file).unwrap();
    let config = fixture_config("resnet_basic");
    let (model, _, reads) =
        load_torchvision_deferred(config.init(&device).unwrap(), &file, &Default::default())
            .unwrap();
    assert!(reads.failure().is_none());
    // The file cut short under the loaded model (the reader keeps it open: the same file).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(1000)
        .unwrap();
    let read = values(&model);
    let err = reads.failure().expect("a failed read is reported");
    assert!(matches!(err, ModelError::TensorLoad { .. }), "{err}");
    assert!(err.to_string().contains("w.pth"), "{err}");
    // What failed reads as zeros, never garbage.
    assert!(read.iter().any(|v| v.iter().all(|x| *x == 0.0)));
}
