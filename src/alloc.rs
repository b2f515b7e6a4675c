//! A global allocator that counts the bytes live in the process, for measuring what a piece of
//! work holds (the pipeline's memory-balanced split measures each unit's activations with it).
//! A program opts in:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: hearth::alloc::CountingAllocator = hearth::alloc::CountingAllocator;
//! ```
//!
//! The `hearth` binary and the pipeline bench do. Without it [`live_bytes`] is `None` and the
//! callers fall back to the resident set size, which the C allocator's reuse of freed memory
//! blurs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most bytes ever live at once.
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes (two relaxed atomic operations per call).
pub struct CountingAllocator;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counters
// are plain atomics that never affect what is allocated.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
            INSTALLED.store(true, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
            INSTALLED.store(true, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let now = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(now, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

/// The most bytes live at once since the process started (what its memory needs, apart from
/// what the C allocator keeps of freed memory), when the program uses [`CountingAllocator`].
pub fn peak_live_bytes() -> Option<usize> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| PEAK.load(Ordering::Relaxed))
}

/// Bytes live in the process now, when the program uses [`CountingAllocator`].
pub fn live_bytes() -> Option<usize> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| LIVE.load(Ordering::Relaxed))
}

/// What the process does with memory it frees, chosen by `HEARTH_MALLOC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreedMemory {
    /// Kept for reuse (the default of the `hearth` binary and the benches): see
    /// [`keep_freed_memory`].
    Keep,
    /// The C allocator's defaults (`HEARTH_MALLOC=system`): blocks of 32 MiB and more come
    /// from `mmap` and go back to the kernel when freed.
    System,
}

impl FreedMemory {
    /// `HEARTH_MALLOC`'s value: unset, `keep` or `system`; anything else is an error naming it.
    pub fn from_env() -> crate::Result<Self> {
        match std::env::var("HEARTH_MALLOC") {
            Err(std::env::VarError::NotPresent) => Self::parse(None),
            Ok(v) => Self::parse(Some(&v)),
            Err(e) => Err(crate::HearthError::InvalidArgument(format!(
                "HEARTH_MALLOC: {e}"
            ))),
        }
    }

    /// The policy a `HEARTH_MALLOC` value names (`None`: unset).
    pub fn parse(value: Option<&str>) -> crate::Result<Self> {
        match value.map(str::trim) {
            None | Some("") | Some("keep") => Ok(FreedMemory::Keep),
            Some("system") => Ok(FreedMemory::System),
            Some(v) => Err(crate::HearthError::InvalidArgument(format!(
                "HEARTH_MALLOC={v:?} is not one of keep, system"
            ))),
        }
    }
}

/// Has glibc's allocator keep the memory a process frees, for the next allocation of the same
/// size, instead of handing large blocks back to the kernel; `false` where it cannot (not
/// glibc, or `mallopt` refused).
///
/// Why: a training step allocates and frees the same large tensors every step (DenseNet-121's
/// feature maps at batch 16 are 50 MB). glibc serves blocks above its mmap threshold (at most
/// 32 MiB) with `mmap` and returns them with `munmap`, so every step the kernel zeroed and
/// mapped fresh pages again: page faults and `clear_page` took about a sixth of a DenseNet-121
/// training step on 2 cores (perf). Here `M_MMAP_MAX = 0` serves every block from the heap and
/// `M_TRIM_THRESHOLD = 2 GiB` keeps up to that much free memory at the heap's top: DenseNet-121
/// training 7.7 -> 10.9 images/s, VGG-16 2.4 -> 3.3, ResNet-50 8.5 -> 9.4 (BENCHMARKS.md). The
/// cost is resident memory that the process keeps once it has needed it (VmHWM: DenseNet-121
/// +3%, VGG-16 +23%). Call it before the work starts; it changes the whole process, so a
/// library never calls it by itself: the `hearth` binary and the benches do, as
/// [`FreedMemory::from_env`] says.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets the allocator's parameters; it is called before the
        // program's threads allocate (and glibc takes its own lock anyway).
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// [`keep_freed_memory`] unless `HEARTH_MALLOC=system`; an error names a value that is
/// neither. Returns the policy in force.
pub fn apply_freed_memory_policy() -> crate::Result<FreedMemory> {
    let policy = FreedMemory::from_env()?;
    if policy == FreedMemory::Keep && !keep_freed_memory() {
        return Ok(FreedMemory::System);
    }
    Ok(policy)
}

/// Peak resident set size of this process in MB (Linux `VmHWM`), 0 where unknown.
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_parses_and_a_bad_value_is_named() {
        assert_eq!(FreedMemory::parse(None).unwrap(), FreedMemory::Keep);
        assert_eq!(
            FreedMemory::parse(Some(" keep")).unwrap(),
            FreedMemory::Keep
        );
        assert_eq!(
            FreedMemory::parse(Some("system")).unwrap(),
            FreedMemory::System
        );
        let e = FreedMemory::parse(Some("jemalloc"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("HEARTH_MALLOC=\"jemalloc\""), "{e}");
    }

    /// glibc accepts both settings (a mallopt that refused would leave the policy unapplied).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_settings_and_memory_still_works() {
        assert!(keep_freed_memory());
        // A block above the default mmap threshold, written, freed and taken again.
        for round in 0..3u8 {
            let mut v = vec![round; 64 << 20];
            v[(64 << 20) - 1] = round.wrapping_add(1);
            assert_eq!(v[0], round);
            assert_eq!(v[(64 << 20) - 1], round.wrapping_add(1));
        }
    }
}
