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

/// The fixture `name`'s network loaded from `weights` (an export): the largest gap between
/// its logits and PyTorch's on the fixture's input.
fn reloaded_gap(name: &str, weights: &std::path::Path, device: &Device) -> f32 {
    let mut again = fixture_config(name).init(device).unwrap();
    load_torchvision(&mut again, weights, &LoadOptions::default()).unwrap();
    let input = npy::read(&fixture(&format!("{name}_input.npy"))).unwrap();
    let expected = npy::read(&fixture(&format!("{name}_logits.npy"))).unwrap();
    let shape: [usize; 4] = input.shape.clone().try_into().unwrap();
    let x = Tensor::<4>::from_data(TensorData::new(input.data, shape), device);
    let got: Vec<f32> = again
        .valid()
        .forward(x)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    max_abs_diff(&got, &expected.data)
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

        let diff = reloaded_gap(name, &out, &device);
        assert!(
            diff <= TOLERANCE,
            "{file} exported and loaded again: {diff}"
        );
    }
}

/// Reads a `.pth` as `torch.load(path, weights_only=True)` does, with Python's own `zipfile`
/// (CRCs checked) and `pickle`, allowing only the globals torch's weights-only unpickler
/// allows; prints each tensor's shape, stride and the SHA-256 of its values as JSON, and
/// fails on a data record not at a 64-byte boundary (PyTorch's alignment).
const READ_PTH: &str = r#"
import collections, hashlib, json, pickle, struct, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
prefix = names[0].split("/")[0]
assert all(n.startswith(prefix + "/") for n in names), names
assert z.read(prefix + "/version").strip() == b"3"
assert z.read(prefix + "/byteorder") == b"little"
raw = open(sys.argv[1], "rb").read()
for info in z.infolist():
    local = raw[info.header_offset:info.header_offset + 30]
    assert local[:4] == b"PK\x03\x04", info
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    assert info.compress_type == zipfile.ZIP_STORED, info
    if "/data/" in info.filename:
        assert start % 64 == 0, (info.filename, start)
def rebuild(storage, offset, size, stride, requires_grad, hooks):
    kind, key, numel = storage
    data = z.read(f"{prefix}/data/{key}")
    width = {"FloatStorage": 4, "LongStorage": 8}[kind]
    assert len(data) == numel * width and offset == 0 and requires_grad is False
    return {"shape": list(size), "stride": list(stride), "sha256": hashlib.sha256(data).hexdigest()}
ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): rebuild,
    ("torch", "FloatStorage"): "FloatStorage",
    ("torch", "LongStorage"): "LongStorage",
}
class WeightsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        return ALLOWED[(module, name)]
    def persistent_load(self, pid):
        tag, kind, key, location, numel = pid
        assert tag == "storage" and location == "cpu", pid
        return (kind, key, numel)
state = WeightsOnly(z.open(prefix + "/data.pkl")).load()
assert type(state) is collections.OrderedDict
print(json.dumps(state))
"#;

/// `hearth export --format pth`'s writer: the same state_dict as the SafeTensors export, read
/// by Python's `zipfile` and a weights-only `pickle` (every tensor's shape, row-major stride
/// and value bytes), and by burn-store's PyTorch reader, which gives torchvision's logits
/// again. (PyTorch itself, `torch.load(weights_only=True)` into torchvision's constructors,
/// was checked by hand: docs/usage.md; CI has no PyTorch.)
#[test]
fn the_pth_export_is_the_state_dict_pickled_as_pytorch_does() {
    let device = DeviceChoice::Flex.device().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (name, file) in CASES {
        let mut model = fixture_config(name).init(&device).unwrap();
        load_torchvision(&mut model, &fixture(file), &LoadOptions::default()).unwrap();
        let st = dir.path().join(format!("{name}.safetensors"));
        let pth = dir.path().join(format!("{name}.pth"));
        let n = hearth::models::export_torchvision(&model, &st).unwrap();
        assert_eq!(
            hearth::models::export_torchvision_pth(&model, &pth).unwrap(),
            n
        );

        let (out, err) = (dir.path().join("py.out"), dir.path().join("py.err"));
        let file_of =
            |p: &std::path::Path| std::process::Stdio::from(std::fs::File::create(p).unwrap());
        let mut child = std::process::Command::new("python3")
            .args(["-c", READ_PTH])
            .arg(&pth)
            .stdout(file_of(&out))
            .stderr(file_of(&err))
            .spawn()
            .unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
        let status = wait_bounded(&mut child, until).expect("python3 ran past 120 s");
        let err = std::fs::read_to_string(&err).unwrap_or_default();
        assert!(status.success(), "{file}: Python's reader: {err}");
        let out = std::fs::read_to_string(&out).unwrap();
        let read: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();

        let bytes = std::fs::read(&st).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(read.len(), n, "{file}");
        for (key, view) in st.tensors() {
            let got = &read[&key];
            let shape: Vec<usize> = view.shape().to_vec();
            let mut stride = vec![1usize; shape.len()];
            for i in (0..shape.len().saturating_sub(1)).rev() {
                stride[i] = stride[i + 1] * shape[i + 1];
            }
            let sha = ring::digest::digest(&ring::digest::SHA256, view.data());
            let hex: String = sha.as_ref().iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(got["shape"], serde_json::json!(shape), "{file}: {key}");
            assert_eq!(got["stride"], serde_json::json!(stride), "{file}: {key}");
            assert_eq!(
                got["sha256"],
                serde_json::json!(hex),
                "{file}: {key}'s values"
            );
        }

        let diff = reloaded_gap(name, &pth, &device);
        assert!(diff <= TOLERANCE, "{file} as .pth and loaded again: {diff}");
    }
}
