//! torchvision parity: small networks built with torchvision's own classes
//! (scripts/make_parity_fixtures.py) load through Hearth's real loaders and give PyTorch's logits
//! within 1e-4, on every CPU device and on Vulkan (lavapipe) when present; on CUDA within the
//! TF32 bound (5e-3 of the largest logit), since cubecl offers no switch to keep f32 there.

mod common;

use burn::module::Module;
use burn::prelude::*;
use common::*;
use hearth::device::DeviceChoice;
use hearth::models::{LoadOptions, load_torchvision};
use hearth::npy;

/// f32 everywhere but on CUDA.
const TOLERANCE: f32 = 1e-4;

/// What a device is held to: f32's absolute 1e-4, or, on CUDA, where cubecl runs f32 products on
/// tensor cores as TF32 with no switch to turn that off (`hearth::gpu`), a relative bound.
#[derive(Clone, Copy, Debug)]
enum Tolerance {
    F32,
    Tf32,
}

impl Tolerance {
    fn for_device(name: &str) -> Self {
        if name.starts_with("cuda") {
            Tolerance::Tf32
        } else {
            Tolerance::F32
        }
    }

    /// `None` when `diff` passes, else what it broke.
    fn check(self, diff: f32, expected: &[f32]) -> Option<String> {
        match self {
            Tolerance::F32 => (diff > TOLERANCE).then(|| format!("{diff:.3e} > {TOLERANCE:e}")),
            Tolerance::Tf32 => {
                let scale = expected.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                let bound = hearth::gpu::TF32_RELATIVE_TOLERANCE * scale;
                (diff > bound)
                    .then(|| format!("{diff:.3e} > {bound:.3e} (TF32: 5e-3 of max |logit|)"))
            }
        }
    }
}

/// (fixture, weights file)
const CASES: &[(&str, &str)] = &[
    ("resnet_basic", "resnet_basic.pth"),
    ("resnet_bottleneck", "resnet_bottleneck.pth"),
    ("densenet", "densenet.pth"),
    ("densenet", "densenet.safetensors"),
    ("vgg_bn", "vgg_bn.pth"),
    ("vgg", "vgg.safetensors"),
];

fn check_parity(device: &Device, device_name: &str) {
    let tolerance = Tolerance::for_device(device_name);
    let mut failures = Vec::new();
    for (name, file) in CASES {
        let mut model = fixture_config(name).init(device).unwrap();
        let report = load_torchvision(&mut model, &fixture(file), &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(report.applied > 0);
        let model = model.valid();
        let input = npy::read(&fixture(&format!("{name}_input.npy"))).unwrap();
        let expected = npy::read(&fixture(&format!("{name}_logits.npy"))).unwrap();
        let shape: [usize; 4] = input.shape.clone().try_into().unwrap();
        let x = Tensor::<4>::from_data(TensorData::new(input.data, shape), device);
        let logits = model.forward(x);
        assert_eq!(
            logits.dims().to_vec(),
            expected.shape,
            "{file}: logits shape"
        );
        let got: Vec<f32> = logits.into_data().try_to_vec::<f32>().unwrap();
        let diff = max_abs_diff(&got, &expected.data);
        eprintln!("{device_name} {file}: max |diff| = {diff:.2e} ({tolerance:?} tolerance)");
        if let Some(broken) = tolerance.check(diff, &expected.data) {
            failures.push(format!("{file}: max |diff| {broken}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{device_name}: {}",
        failures.join("; ")
    );
}

#[test]
fn torchvision_parity_flex() {
    check_parity(&DeviceChoice::Flex.device().unwrap(), "flex");
}

/// NdArray is a cargo feature (`ndarray`) the test command turns on.
#[cfg(feature = "ndarray")]
#[test]
fn torchvision_parity_ndarray() {
    check_parity(&DeviceChoice::NdArray.device().unwrap(), "ndarray");
}

#[cfg(feature = "wgpu")]
#[test]
fn torchvision_parity_vulkan_cpu() {
    if let Some(device) = device_or_skip(DeviceChoice::VulkanCpu, "torchvision_parity_vulkan_cpu") {
        check_parity(&device, "vulkan-cpu");
    }
}

/// Parity on real GPUs: `HEARTH_PARITY_DEVICES=cuda,wgpu,vulkan` runs the same check on each
/// named device (a build with the matching features), and fails if one of them does not work.
/// Unset, it says it skipped (CI has no GPU), unless `HEARTH_REQUIRE_GPU=1` (set by
/// `scripts/gpu_check.sh`) makes that a failure (a missing lavapipe fails without being asked:
/// `common::device_or_skip`).
#[test]
fn torchvision_parity_on_named_devices() {
    let Ok(list) = std::env::var("HEARTH_PARITY_DEVICES") else {
        assert!(
            std::env::var("HEARTH_REQUIRE_GPU").as_deref() != Ok("1"),
            "HEARTH_REQUIRE_GPU=1 but HEARTH_PARITY_DEVICES names no device to check"
        );
        eprintln!(
            "SKIPPED torchvision_parity_on_named_devices: set HEARTH_PARITY_DEVICES=cuda,vulkan,... to run it"
        );
        return;
    };
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let device = hearth::device::select(name)
            .unwrap_or_else(|e| panic!("HEARTH_PARITY_DEVICES names {name}: {e}"));
        check_parity(&device, name);
    }
}

/// The torchvision export (`hearth export`) gives back what PyTorch wrote: for every fixture,
/// the model loaded from torchvision's file and exported has exactly the file's keys
/// (`num_batches_tracked` included, which strict `load_state_dict` asks for), each tensor of a
/// SafeTensors fixture with its shape and values, and the export loaded again gives
/// torchvision's logits.
#[test]
fn the_torchvision_export_has_torchvisions_keys_values_and_logits() {
    let device = DeviceChoice::Flex.device().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (name, file) in CASES {
        let mut model = fixture_config(name).init(&device).unwrap();
        load_torchvision(&mut model, &fixture(file), &LoadOptions::default()).unwrap();
        let out = dir.path().join(format!("{name}-{file}.safetensors"));
        let written = hearth::models::export_torchvision(&model, &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let exported = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut ours: Vec<String> = exported.names().into_iter().map(String::from).collect();
        ours.sort();
        assert_eq!(ours.len(), written);
        let mut theirs: Vec<String> = if file.ends_with(".pth") {
            use burn::store::ModuleStore;
            // Keys as PyTorch wrote them (burn-store renumbers `nn.Sequential` indices by
            // default).
            burn::store::PytorchStore::from_file(fixture(file))
                .map_indices_contiguous(false)
                .keys()
                .unwrap()
        } else {
            let b = std::fs::read(fixture(file)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&b).unwrap();
            // Where torchvision's values are at hand, each one is compared.
            for (key, view) in st.tensors() {
                let mine = exported.tensor(&key).unwrap();
                assert_eq!(mine.shape(), view.shape(), "{file}: {key}");
                if !key.ends_with("num_batches_tracked") {
                    assert_eq!(mine.data(), view.data(), "{file}: {key}");
                }
            }
            st.names().into_iter().map(String::from).collect()
        };
        theirs.sort();
        if file.ends_with(".safetensors") {
            // The fixture script leaves batch norm's counters out of its SafeTensors files
            // (scripts/make_parity_fixtures.py); its .pth files hold them, and match whole.
            ours.retain(|k| !k.ends_with("num_batches_tracked"));
        }
        assert_eq!(
            ours, theirs,
            "{file}: the export's keys against torchvision's"
        );

        let mut again = fixture_config(name).init(&device).unwrap();
        load_torchvision(&mut again, &out, &LoadOptions::default()).unwrap();
        let input = npy::read(&fixture(&format!("{name}_input.npy"))).unwrap();
        let expected = npy::read(&fixture(&format!("{name}_logits.npy"))).unwrap();
        let shape: [usize; 4] = input.shape.clone().try_into().unwrap();
        let x = Tensor::<4>::from_data(TensorData::new(input.data, shape), &device);
        let got: Vec<f32> = again
            .valid()
            .forward(x)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let diff = max_abs_diff(&got, &expected.data);
        assert!(
            diff <= TOLERANCE,
            "{file} exported and loaded again: {diff}"
        );
    }
}
