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
    #[cfg(feature = "cuda")]
    Cuda,
}

impl DeviceChoice {
    /// Every device compiled into this build.
    pub const ALL: &'static [DeviceChoice] = &[
        DeviceChoice::Flex,
        DeviceChoice::NdArray,
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu,
        #[cfg(feature = "wgpu")]
        DeviceChoice::Vulkan,
        #[cfg(feature = "wgpu")]
        DeviceChoice::VulkanCpu,
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Flex => "flex",
            DeviceChoice::NdArray => "ndarray",
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => "wgpu",
            #[cfg(feature = "wgpu")]
            DeviceChoice::Vulkan => "vulkan",
            #[cfg(feature = "wgpu")]
            DeviceChoice::VulkanCpu => "vulkan-cpu",
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda => "cuda",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            DeviceChoice::Flex => "CPU, Burn Flex (pure Rust, SIMD) - default",
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
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda => "NVIDIA GPU through CUDA",
        }
    }

    pub fn choices() -> String {
        Self::ALL
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The Burn device, without checking that it works (construction is lazy in Burn).
    pub fn device_unchecked(self) -> Device {
        match self {
            DeviceChoice::Flex => Device::flex(),
            // Deprecated upstream in favour of Flex; kept selectable (DESIGN.md).
            #[allow(deprecated)]
            DeviceChoice::NdArray => Device::ndarray(),
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            // With the `vulkan` feature: pinned to Vulkan, cubecl's SPIR-V compiler. Without it:
            // wgpu with WGSL shaders, which tries Vulkan first on Linux.
            #[cfg(feature = "vulkan")]
            DeviceChoice::Vulkan => Device::vulkan(burn::tensor::DeviceKind::DefaultDevice),
            #[cfg(feature = "vulkan")]
            DeviceChoice::VulkanCpu => Device::vulkan(burn::tensor::DeviceKind::Cpu),
            #[cfg(all(feature = "wgpu", not(feature = "vulkan")))]
            DeviceChoice::Vulkan => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            #[cfg(all(feature = "wgpu", not(feature = "vulkan")))]
            DeviceChoice::VulkanCpu => Device::wgpu(burn::tensor::DeviceKind::Cpu),
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda => Device::cuda(0),
        }
    }

    /// The Burn device after a tiny computation on it proves it works. GPU backends panic on
    /// first use when no adapter exists; that becomes [`HearthError::DeviceUnavailable`].
    pub fn device(self) -> Result<Device> {
        quiet_wayland();
        let device = self.device_unchecked();
        let probe = device.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let outcome = std::panic::catch_unwind(move || {
            let t = Tensor::<1>::from_floats([1.0, 2.0], &probe);
            t.sum().into_scalar::<f32>()
        });
        std::panic::set_hook(previous);
        match outcome {
            Ok(v) if (v - 3.0).abs() < 1e-6 => Ok(device),
            Ok(v) => Err(HearthError::DeviceUnavailable {
                name: self.name().into(),
                reason: format!("a test sum gave {v} instead of 3"),
            }),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "the backend failed to start".into());
                Err(HearthError::DeviceUnavailable {
                    name: self.name().into(),
                    reason: first_line(&msg),
                })
            }
        }
    }
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
            .ok_or_else(|| HearthError::UnknownDevice {
                name: s.to_string(),
                choices: Self::choices(),
            })
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a device name and checks that the device works.
pub fn select(name: &str) -> Result<Device> {
    name.parse::<DeviceChoice>()?.device()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_device_lists_the_choices() {
        let err = "tpu".parse::<DeviceChoice>().unwrap_err().to_string();
        assert!(
            err.contains("'tpu'") && err.contains("flex") && err.contains("ndarray"),
            "{err}"
        );
    }

    #[test]
    fn names_round_trip() {
        for d in DeviceChoice::ALL {
            assert_eq!(d.name().parse::<DeviceChoice>().unwrap(), *d);
        }
        assert_eq!("FLEX".parse::<DeviceChoice>().unwrap(), DeviceChoice::Flex);
    }

    #[test]
    fn cpu_devices_work() {
        select("flex").unwrap();
        select("ndarray").unwrap();
    }
}
