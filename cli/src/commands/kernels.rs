//! The global GPU kernel flags, `--autotune` and `--kernel-bundle`: checked against the
//! command's device and handed on (through the environment) to the ranks a command starts.

use std::path::Path;

use anyhow::Result;
use hearth::device::DeviceChoice;

/// Sets how GPU kernels are chosen (`--autotune`) for this process and the ranks it starts, and
/// refuses `full` (and `--kernel-bundle`) where the command's device (`uses_device`: the
/// command starts one) has no GPU kernels.
pub(crate) fn set_autotune(
    autotune: &str,
    kernel_bundle: Option<&Path>,
    device: &str,
    uses_device: bool,
) -> Result<()> {
    use hearth::kernels::select::{Selection, set_selection};
    let selection = Selection::parse(autotune).ok_or_else(|| {
        anyhow::anyhow!(
            "--autotune {}: expected off (kernels chosen by rule) or full (Burn's autotune)",
            autotune
        )
    })?;
    let gpus = || {
        DeviceChoice::ALL
            .iter()
            .filter(|d| d.is_cubecl())
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if uses_device && (selection == Selection::Autotune || kernel_bundle.is_some()) {
        let spec: hearth::device::DeviceSpec = device.parse()?;
        if !spec.choice.is_cubecl() {
            let flag = if selection == Selection::Autotune {
                "--autotune full"
            } else {
                "--kernel-bundle"
            };
            anyhow::bail!(
                "{flag}: {} has no GPU kernels to tune or bundle (GPU devices of this build: {})",
                spec.choice,
                match gpus() {
                    g if g.is_empty() => "none; build with the wgpu or cuda feature".into(),
                    g => g,
                }
            );
        }
    }
    if let Some(path) = kernel_bundle
        && !path.is_file()
    {
        anyhow::bail!("--kernel-bundle {}: no such file", path.display());
    }
    set_selection(selection);
    // SAFETY: before any thread of this process starts; ranks it spawns inherit the choices.
    unsafe {
        std::env::set_var("HEARTH_AUTOTUNE", selection.name());
        if let Some(path) = kernel_bundle {
            std::env::set_var(hearth::gpu::KERNEL_BUNDLE_ENV, path);
        }
    }
    Ok(())
}
