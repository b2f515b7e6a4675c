//! What a program that trains with Hearth does first in `main`, as the `hearth` binary does.

use crate::Result;
use crate::device::DeviceSpec;

/// Prepares this process to run on `device` (a `--device` name: `flex`, `wgpu`, `cuda:1`, ...)
/// and returns it parsed:
///
/// - pins Burn's default device to its backend ([`crate::device::pin_burn_default`]), so that
///   resuming, the fine-tuning switch and elastic re-forming load optimizer state there;
/// - applies the freed-memory policy ([`crate::alloc::apply_freed_memory_policy`]; freed
///   tensors stay for the next step, `HEARTH_MALLOC=system` opts out);
/// - makes this thread one of the CPU kernels' threads
///   ([`crate::kernels::join_global_pool`], `HEARTH_JOIN_POOL=0` opts out).
///
/// An unknown device name is an error naming the ones this build has.
///
/// # Safety
///
/// Sets an environment variable: call it first thing in `main`, before any other thread of the
/// process starts.
pub unsafe fn start(device: &str) -> Result<DeviceSpec> {
    let spec: DeviceSpec = device.parse()?;
    // SAFETY: the caller guarantees no other thread runs yet.
    unsafe { crate::device::pin_burn_default(spec.choice) }
    crate::alloc::apply_freed_memory_policy()?;
    crate::kernels::join_global_pool();
    Ok(spec)
}

/// [`start`] on the device `HEARTH_DEVICE` names, `flex` (the CPU) where it is unset: what the
/// examples do.
///
/// # Safety
///
/// As [`start`]: first thing in `main`, before any other thread starts.
pub unsafe fn start_from_env() -> Result<DeviceSpec> {
    let name = std::env::var("HEARTH_DEVICE").unwrap_or_else(|_| "flex".into());
    // SAFETY: forwarded from the caller.
    unsafe { start(&name) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_unknown_device_is_named_before_anything_is_set() {
        // SAFETY: the name fails to parse before any variable is set.
        let err = unsafe { super::start("tpu") }.unwrap_err().to_string();
        assert!(err.contains("tpu"), "{err}");
    }
}
