//! Which Burn device runs the work: `--device` / `HEARTH_DEVICE`.

use std::str::FromStr;

use burn::prelude::*;

use crate::{HearthError, Result};

/// A device a user can name on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Burn Flex: pure-Rust CPU backend (gemm + SIMD). The default.
    Flex,
    /// Burn NdArray: the older CPU backend (deprecated upstream, much slower for convolutions).
    #[cfg(feature = "ndarray")]
    NdArray,
    /// The best GPU wgpu finds, on any graphics API.
    #[cfg(feature = "wgpu")]
    Wgpu,
    /// The best Vulkan device.
    #[cfg(feature = "wgpu")]
    Vulkan,
    /// Vulkan on the CPU (Mesa lavapipe): the wgpu code path without a GPU, for CI.
    #[cfg(feature = "wgpu")]
    VulkanCpu,
    /// NVIDIA CUDA device 0.
    #[cfg(feature = "cuda-device")]
    Cuda,
}

impl DeviceChoice {
    /// Every device compiled into this build.
    pub const ALL: &'static [DeviceChoice] = &[
        DeviceChoice::Flex,
        #[cfg(feature = "ndarray")]
        DeviceChoice::NdArray,
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu,
        #[cfg(feature = "wgpu")]
        DeviceChoice::Vulkan,
        #[cfg(feature = "wgpu")]
        DeviceChoice::VulkanCpu,
        #[cfg(feature = "cuda-device")]
        DeviceChoice::Cuda,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Flex => "flex",
            #[cfg(feature = "ndarray")]
            DeviceChoice::NdArray => "ndarray",
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => "wgpu",
            #[cfg(feature = "wgpu")]
            DeviceChoice::Vulkan => "vulkan",
            #[cfg(feature = "wgpu")]
            DeviceChoice::VulkanCpu => "vulkan-cpu",
            #[cfg(feature = "cuda-device")]
            DeviceChoice::Cuda => "cuda",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            DeviceChoice::Flex => "CPU, Burn Flex (pure Rust, SIMD) - default",
            #[cfg(feature = "ndarray")]
            DeviceChoice::NdArray => "CPU, Burn NdArray (deprecated upstream, slow convolutions)",
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => "GPU through wgpu (Vulkan, Metal, DX12)",
            #[cfg(feature = "wgpu")]
            DeviceChoice::Vulkan => {
                if cfg!(feature = "vulkan") {
                    "GPU through Vulkan (cubecl SPIR-V)"
                } else {
                    "GPU through Vulkan (wgpu, WGSL shaders)"
                }
            }
            #[cfg(feature = "wgpu")]
            DeviceChoice::VulkanCpu => "Vulkan on the CPU (Mesa lavapipe)",
            #[cfg(feature = "cuda-device")]
            DeviceChoice::Cuda => {
                if cfg!(feature = "cuda") {
                    "NVIDIA GPU through CUDA (kernels compiled by NVRTC)"
                } else {
                    "NVIDIA GPU through CUDA (kernels compiled by LLVM's PTX back end)"
                }
            }
        }
    }

    pub fn choices() -> String {
        Self::ALL
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether the device runs through cubecl (wgpu, Vulkan, CUDA): Burn's autotune and fusion
    /// apply there (`crate::gpu`).
    pub fn is_cubecl(self) -> bool {
        !matches!(self.name(), "flex" | "ndarray")
    }

    /// Whether the device has an index (`cuda:1`, `vulkan:1`): GPUs do, CPU backends do not.
    pub fn indexed(self) -> bool {
        self.is_cubecl() && self.name() != "vulkan-cpu"
    }

    /// The Burn device, without checking that it works (construction is lazy in Burn).
    pub fn device_unchecked(self) -> Device {
        self.device_at(None)
    }

    /// The Burn device with GPU `index` (`None`: the default GPU, CUDA device 0), unchecked.
    /// wgpu and Vulkan count discrete GPUs, as wgpu lists them.
    pub fn device_at(self, index: Option<usize>) -> Device {
        #[cfg(feature = "wgpu")]
        let kind = match index {
            Some(i) => burn::tensor::DeviceKind::DiscreteGpu(i),
            None => burn::tensor::DeviceKind::DefaultDevice,
        };
        #[cfg(not(feature = "wgpu"))]
        let _ = index;
        match self {
            DeviceChoice::Flex => Device::flex(),
            // Deprecated upstream in favour of Flex; kept selectable (DESIGN.md).
            #[cfg(feature = "ndarray")]
            #[allow(deprecated)]
            DeviceChoice::NdArray => Device::ndarray(),
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => Device::wgpu(kind),
            // With the `vulkan` feature: pinned to Vulkan, cubecl's SPIR-V compiler. Without it:
            // wgpu with WGSL shaders, which tries Vulkan first on Linux.
            #[cfg(feature = "vulkan")]
            DeviceChoice::Vulkan => Device::vulkan(kind),
            #[cfg(feature = "vulkan")]
            DeviceChoice::VulkanCpu => Device::vulkan(burn::tensor::DeviceKind::Cpu),
            #[cfg(all(feature = "wgpu", not(feature = "vulkan")))]
            DeviceChoice::Vulkan => Device::wgpu(kind),
            #[cfg(all(feature = "wgpu", not(feature = "vulkan")))]
            DeviceChoice::VulkanCpu => Device::wgpu(burn::tensor::DeviceKind::Cpu),
            #[cfg(feature = "cuda-device")]
            DeviceChoice::Cuda => Device::cuda(index.unwrap_or(0)),
        }
    }

    /// The Burn device after a tiny computation on it proves it works. GPU backends panic on
    /// first use when no adapter exists; that becomes [`HearthError::DeviceUnavailable`].
    pub fn device(self) -> Result<Device> {
        DeviceSpec {
            choice: self,
            index: None,
        }
        .device()
    }

    /// [`DeviceChoice::device`] without the autotune note: for listing which devices work.
    pub fn probe(self) -> Result<Device> {
        DeviceSpec {
            choice: self,
            index: None,
        }
        .probe()
    }
}

/// The variable Burn reads for its default device, `Device::default()`.
pub const BURN_DEVICE_ENV: &str = "BURN_DEVICE";

impl DeviceChoice {
    /// The name `BURN_DEVICE` gives this device's backend: Burn's default device is then one of
    /// the same backend (for a GPU, its default adapter or device 0).
    pub fn burn_device_name(self) -> &'static str {
        match self.name() {
            // One cubecl runtime, wgpu's: pinned to Vulkan where cubecl's own compiler is built.
            "vulkan" | "vulkan-cpu" if cfg!(feature = "vulkan") => "vulkan",
            "vulkan" | "vulkan-cpu" => "wgpu",
            // flex, ndarray, wgpu and cuda are Burn's names too.
            other => other,
        }
    }
}

/// Makes Burn's default device (`Device::default()`) one of `choice`'s backend, for this
/// process and the processes it starts.
///
/// burn-optim's `ModuleOptimizer::load_record` (which burn-train's resume also calls) builds the
/// loaded state on Burn's default device, and moves it to each parameter's device on the next
/// step. Unpinned, that default is the first backend compiled in (CUDA in a CUDA build, wgpu in
/// a wgpu one), which a run on another device may not be able to start: a resume, the
/// fine-tuning switch, a pipeline stage's checkpoint or an elastic re-forming would then panic
/// in the backend. The `hearth` binary pins its `--device` at start; a program embedding the
/// library calls this at the top of `main` (or sets `BURN_DEVICE`), and the loading paths
/// refuse with [`HearthError::BurnDefaultDevice`] where neither was done.
///
/// # Safety
///
/// Sets an environment variable: call it before any other thread of the process starts.
pub unsafe fn pin_burn_default(choice: DeviceChoice) {
    // SAFETY: the caller guarantees no other thread runs yet.
    unsafe { std::env::set_var(BURN_DEVICE_ENV, choice.burn_device_name()) }
}

/// The `BURN_DEVICE` name of `device`'s backend, read from its debug text (Burn's device type
/// does not name its backend otherwise): "flex", "ndarray", "wgpu" or "cuda".
fn burn_backend_name(device: &Device) -> Option<&'static str> {
    let text = format!("{:?}", device.clone().without_autodiff());
    let inner = text.strip_prefix("Device<")?;
    [
        ("Flex(", "flex"),
        ("NdArray(", "ndarray"),
        ("Cube(Wgpu(", "wgpu"),
        ("Cube(Cuda(", "cuda"),
    ]
    .into_iter()
    .find(|(prefix, _)| inner.starts_with(prefix))
    .map(|(_, name)| name)
}

/// Ok where Burn's default device is on `device`'s backend, so that loading optimizer state
/// (which burn-optim does on Burn's default device) cannot reach for a backend the run never
/// asked for; [`HearthError::BurnDefaultDevice`] otherwise. Checked before every such load.
pub fn check_burn_default(device: &Device) -> Result<()> {
    let run = burn_backend_name(device).unwrap_or("another backend");
    let compiled = DeviceChoice::ALL
        .iter()
        .map(|d| d.burn_device_name())
        .collect::<Vec<_>>();
    let mismatch = |default: String| {
        Err(HearthError::BurnDefaultDevice {
            run: run.to_string(),
            default,
        })
    };
    if let Ok(set) = std::env::var(BURN_DEVICE_ENV) {
        // A name this build lacks would make Burn panic: refuse it before asking Burn.
        if !compiled.contains(&set.to_lowercase().as_str()) {
            return mismatch(format!(
                "{BURN_DEVICE_ENV}={set}, which this build cannot start"
            ));
        }
    }
    // Constructing a device is lazy in Burn: nothing starts here.
    let default = Device::default();
    match burn_backend_name(&default) {
        Some(name) if name == run => Ok(()),
        Some(name) => mismatch(name.to_string()),
        None => mismatch(format!("{default:?}")),
    }
}

/// A device as named on the command line: a [`DeviceChoice`] and, for GPUs, an index
/// (`cuda:1`, `vulkan:1`, `wgpu:1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub choice: DeviceChoice,
    pub index: Option<usize>,
}

impl DeviceSpec {
    /// The device a rank uses: an explicit index wins; otherwise a GPU device takes the rank's
    /// local rank (`LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`), so each rank of
    /// a multi-GPU machine gets its own GPU. CPU devices are shared.
    pub fn for_local_rank(self, local_rank: Option<usize>) -> Self {
        match (self.index, local_rank) {
            (None, Some(l)) if self.choice.indexed() => Self {
                index: Some(l),
                ..self
            },
            _ => self,
        }
    }

    /// The Burn device after a tiny computation on it proves it works. On a GPU device whose
    /// autotune has no earlier decisions, says (on stderr) that the first steps will tune.
    pub fn device(self) -> Result<Device> {
        self.start(true)
    }

    /// [`DeviceSpec::device`] without the autotune note: for listing which devices work.
    pub fn probe(self) -> Result<Device> {
        self.start(false)
    }

    fn start(self, note: bool) -> Result<Device> {
        let name = self.to_string();
        quiet_wayland();
        if self.choice.is_cubecl() {
            // No driver library: nothing to start, and no kernel bundle to import (a CUDA
            // build's shipped one is 40 MB written into cubecl's cache).
            if let Some(reason) = missing_driver(self.choice) {
                return Err(HearthError::DeviceUnavailable { name, reason });
            }
            if let Some(warning) = crate::gpu::configure() {
                eprintln!("warning: {warning}");
            }
            #[cfg(feature = "cuda-device")]
            let ships = self.choice == DeviceChoice::Cuda;
            #[cfg(not(feature = "cuda-device"))]
            let ships = false;
            crate::gpu::import_bundles_at_start(ships)?;
            // Before the device's first tensor: fusion fixes its optimizations then.
            crate::gpu::fused_reductions_at_start(note);
        } else if std::env::var_os(crate::gpu::AUTOTUNE_LOG_ENV).is_some() {
            eprintln!(
                "warning: {} is set, but {name} has no autotune (GPU devices only): nothing is logged",
                crate::gpu::AUTOTUNE_LOG_ENV
            );
        }
        // Read before the device starts: starting it opens (creates) autotune's database.
        let notice = if note && self.choice.is_cubecl() {
            crate::gpu::autotune_notice(&name)
        } else {
            None
        };
        let device = self.choice.device_at(self.index);
        let probe = device.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        // An addition, not a reduction: on a cubecl device the first reduction opens its
        // autotune tuner, which must find the reductions' rules already in the cache.
        let outcome = std::panic::catch_unwind(move || {
            let t = Tensor::<1>::from_floats([1.0, 2.0], &probe);
            let out = t.add_scalar(1.0).into_data().try_to_vec::<f32>();
            out.map_or(f32::NAN, |v| v.iter().sum())
        });
        std::panic::set_hook(previous);
        match outcome {
            Ok(v) if (v - 5.0).abs() < 1e-6 => {
                if let Some(note) = notice {
                    eprintln!("note: {note}");
                }
                // Not for a listing of the devices (`probe`): only where work will run.
                if note && self.choice.is_cubecl() {
                    crate::gpu::reductions_at_start(&device);
                }
                Ok(device)
            }
            Ok(v) => Err(HearthError::DeviceUnavailable {
                name,
                reason: format!("a test addition of [1, 2] and 1 summed to {v} instead of 5"),
            }),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "the backend failed to start".into());
                // A device index past the machine's last: say so, not the backend's panic.
                // An index the machine lacks (it counts discrete GPUs) while the default
                // adapter works: say so, not the backend's panic.
                let missing_index = self.index.filter(|_| {
                    Self {
                        index: None,
                        ..self
                    }
                    .probe()
                    .is_ok()
                });
                let reason = if let Some(index) = missing_index {
                    format!(
                        "this machine has no discrete GPU {index} for {} (an index counts the \
                         discrete GPUs from 0); `device` {} without an index takes its default \
                         adapter, which works; `hearth devices` lists the devices. The ranks of \
                         a job take the GPU of their local rank unless the device names one: \
                         `device` {}:0 puts them all on GPU 0",
                        self.choice, self.choice, self.choice
                    )
                } else {
                    missing_driver(self.choice).unwrap_or_else(|| first_line(&msg))
                };
                Err(HearthError::DeviceUnavailable { name, reason })
            }
        }
    }
}

/// Why a GPU device cannot start when the cause is the usual one: no NVIDIA driver library for
/// CUDA, no Vulkan loader for the wgpu devices. (cubecl starts the device on its own thread, so
/// its panic reaches us as a bare channel error: "RecvError".)
fn missing_driver(choice: DeviceChoice) -> Option<String> {
    #[cfg(feature = "cuda-device")]
    if choice == DeviceChoice::Cuda && !loadable(c"libcuda.so.1") {
        return Some(
            "the NVIDIA driver library libcuda.so.1 cannot be loaded (no NVIDIA driver on this machine)"
                .into(),
        );
    }
    #[cfg(feature = "wgpu")]
    if matches!(
        choice,
        DeviceChoice::Wgpu | DeviceChoice::Vulkan | DeviceChoice::VulkanCpu
    ) && !loadable(c"libvulkan.so.1")
    {
        return Some(
            "the Vulkan loader libvulkan.so.1 cannot be loaded (install libvulkan1, and \
             mesa-vulkan-drivers for vulkan-cpu)"
                .into(),
        );
    }
    let _ = choice;
    None
}

/// Whether the shared library `name` loads (the handle is closed at once).
#[cfg_attr(not(any(feature = "cuda-device", feature = "wgpu")), allow(dead_code))]
fn loadable(name: &std::ffi::CStr) -> bool {
    // SAFETY: dlopen with a NUL-terminated name.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: a handle dlopen just returned.
    unsafe { libc::dlclose(handle) };
    true
}

fn first_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or(s);
    if line.len() > 300 {
        format!("{}...", &line[..300])
    } else {
        line.to_string()
    }
}

/// wgpu probes Wayland when `XDG_RUNTIME_DIR` is unset and prints noise; give it a directory.
fn quiet_wayland() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir();
        // SAFETY: called before any backend thread starts (device setup is the first Burn use).
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", dir) };
    }
}

impl FromStr for DeviceChoice {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
        Self::ALL
            .iter()
            .copied()
            .find(|d| d.name() == wanted)
            .ok_or_else(|| match feature_of(&wanted) {
                Some(feature) => HearthError::DeviceNotBuilt {
                    name: s.to_string(),
                    feature,
                    choices: Self::choices(),
                },
                None => HearthError::UnknownDevice {
                    name: s.to_string(),
                    choices: Self::choices(),
                },
            })
    }
}

/// Hearth's devices that a cargo feature compiles in (all but `flex`), each with its feature,
/// whether or not this build has it.
const OPTIONAL_DEVICES: [(&str, &str); 5] = [
    ("ndarray", "ndarray"),
    ("wgpu", "wgpu"),
    ("vulkan", "wgpu"),
    ("vulkan-cpu", "wgpu"),
    ("cuda", "cuda"),
];

fn feature_of(name: &str) -> Option<&'static str> {
    OPTIONAL_DEVICES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, feature)| *feature)
}

impl DeviceChoice {
    /// The devices Hearth has that this build left out, each with the cargo feature that
    /// brings it (`hearth devices` lists them).
    pub fn left_out() -> Vec<(&'static str, &'static str)> {
        OPTIONAL_DEVICES
            .into_iter()
            .filter(|(name, _)| !Self::ALL.iter().any(|d| d.name() == *name))
            .collect()
    }
}

impl FromStr for DeviceSpec {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        let (name, index) = match s.rsplit_once(':') {
            Some((name, i)) => {
                let i = i.trim().parse::<usize>().map_err(|_| {
                    HearthError::InvalidArgument(format!(
                        "device '{s}': the part after ':' must be a GPU index (e.g. cuda:1)"
                    ))
                })?;
                (name, Some(i))
            }
            None => (s, None),
        };
        let choice: DeviceChoice = name.parse()?;
        if index.is_some() && !choice.indexed() {
            return Err(HearthError::InvalidArgument(format!(
                "device '{s}': {} has no device index (only GPU devices do)",
                choice.name()
            )));
        }
        Ok(Self { choice, index })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(i) => write!(f, "{}:{i}", self.choice),
            None => write!(f, "{}", self.choice),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a device name (`flex`, `cuda:1`, ...) and checks that the device works.
pub fn select(name: &str) -> Result<Device> {
    name.parse::<DeviceSpec>()?.device()
}

/// Whether `device` computes in `precision`: wgpu devices (Vulkan, Metal, DX12, lavapipe) have
/// no bf16 in their shaders (cubecl fails each kernel with `UnsupportedType("cube.bf16")`), so
/// bf16 is refused there by name; fp16 runs where the adapter has shader f16 (lavapipe does).
/// Flex (the CPU) and CUDA take both.
pub fn check_precision(device: &Device, precision: crate::train::Precision) -> Result<()> {
    if precision != crate::train::Precision::Bf16 {
        return Ok(());
    }
    let described = format!("{:?}", device.clone().inner());
    if ["Wgpu", "Vulkan", "Metal", "Dx12", "WebGpu"]
        .iter()
        .any(|k| described.contains(k))
    {
        return Err(HearthError::InvalidArgument(format!(
            "`compute.precision` bf16 does not run on this device ({described}): wgpu's shaders \
             have no bf16; use `compute.precision` fp16 here, or bf16 on CUDA or the CPU"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
