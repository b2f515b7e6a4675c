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

pub mod blocks;
pub mod phase;

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most bytes ever live at once.
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The live bytes when the running training step began ([`step_done`]), the most live since,
/// and the most any step that ended rose above its beginning.
static STEP_BASE: AtomicUsize = AtomicUsize::new(0);
static STEP_PEAK: AtomicUsize = AtomicUsize::new(0);
static STEP_RISE: AtomicUsize = AtomicUsize::new(0);
static STEPPING: AtomicBool = AtomicBool::new(false);
/// The most bytes live at once when the run's start ended ([`start_done`]); 0 before.
static START_PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting live bytes (two relaxed atomic operations per call); blocks
/// of [`blocks::LARGE`] bytes and more are mapped from the kernel and, under the keep policy,
/// kept for the next request of their size until a step passes without one
/// ([`step_done`]).
pub struct CountingAllocator;

fn counted(p: *mut u8, size: usize) -> *mut u8 {
    if !p.is_null() {
        let now = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // A read first: most allocations stay under the step's peak, and a read-modify-write
        // on every one would cost the allocation path more than the peak needs.
        if now > STEP_PEAK.load(Ordering::Relaxed) {
            STEP_PEAK.fetch_max(now, Ordering::Relaxed);
            phase::peak_rose();
        }
        INSTALLED.store(true, Ordering::Relaxed);
    }
    p
}

/// What glibc had taken from the kernel when last read ([`read_c_heap`]): its heap, in use or
/// free. Under the keep policy glibc does not trim its heap, so this mostly grows (a thread's
/// arena still drops a heap that is left wholly free).
static C_HEAP: AtomicUsize = AtomicUsize::new(0);
/// The process's footprint without keeping at its most, as far as known: glibc's heap (at
/// least [`C_HEAP`], at least what glibc serves live now) and the large blocks in use.
static FOOT_PEAK: AtomicUsize = AtomicUsize::new(0);

/// The bytes the process may keep unused (freed large blocks) once glibc serves `small` bytes
/// more and the large blocks in use change by `block` bytes: the process's footprint without
/// keeping at its most (counting this change) less that footprint now. Keeping within it never
/// takes the resident set past where it would have been without keeping.
///
/// The footprint counts glibc's whole heap, not only what is live in it: glibc's free chunks
/// are resident too (the keep policy never trims them), so what is kept leaves room for them
/// (ResNet-50 at 32 px, 4 ranks, `--zero 2`: kept blocks filling that room had put every rank
/// 20-30 MB above its peak), and measuring against the heap's own peak rather than the live
/// peak lets the blocks a step frees be kept for the next one while glibc's heap grows with
/// fragmentation. Against the live peak with glibc's free bytes left out, ZeRO stage 3 with
/// 1 MiB buckets (whose steps stay near their own peak) unmapped and faulted in about 600 MB
/// a step again (ResNet-50, 128 px, 2 ranks: 4.8 million page faults in 2 epochs, and a step
/// 1.35 s long against 1.02 s).
fn room(small: isize, block: isize) -> usize {
    let in_use = blocks::in_use_bytes();
    let glibc = LIVE
        .load(Ordering::Relaxed)
        .saturating_sub(in_use)
        .saturating_add_signed(small);
    let foot = C_HEAP.load(Ordering::Relaxed).max(glibc) + in_use.saturating_add_signed(block);
    // A read first, as for the live peak: most calls stay under it.
    let mut peak = FOOT_PEAK.load(Ordering::Relaxed);
    if foot > peak {
        peak = FOOT_PEAK.fetch_max(foot, Ordering::Relaxed).max(foot);
    }
    peak - foot
}

/// Reads how many bytes glibc has taken from the kernel (`mallinfo2`: the heap of every arena
/// and its own mappings) into [`C_HEAP`]. It takes glibc's arena locks and walks its bins, so it
/// runs once per training step ([`step_done`]), not per allocation.
fn read_c_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    let heap = {
        // SAFETY: mallinfo2 only reads glibc's own bookkeeping under its locks.
        let m = unsafe { libc::mallinfo2() };
        m.arena.saturating_add(m.hblkhd)
    };
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let heap = 0;
    C_HEAP.store(heap, Ordering::Relaxed);
}

/// A block for `layout` from where it belongs, uncounted.
///
/// # Safety
/// As [`GlobalAlloc::alloc`].
unsafe fn raw_alloc(layout: Layout, zeroed: bool) -> *mut u8 {
    // SAFETY: forwarded with the caller's promises; `serves` picks the large path.
    unsafe {
        let size = layout.size() as isize;
        match (blocks::serves(layout), zeroed) {
            (true, z) => blocks::alloc(layout, z, room(0, blocks::rounded_change(size))),
            (false, z) => {
                // A small block may grow glibc's heap: what is kept makes room first.
                blocks::keep_within(room(size, 0));
                if z {
                    System.alloc_zeroed(layout)
                } else {
                    System.alloc(layout)
                }
            }
        }
    }
}

/// Frees a block [`raw_alloc`] gave, uncounted.
///
/// # Safety
/// As [`GlobalAlloc::dealloc`].
unsafe fn raw_dealloc(ptr: *mut u8, layout: Layout) {
    // SAFETY: the layout alone chose where it came from, so it goes back there.
    unsafe {
        if blocks::serves(layout) {
            blocks::dealloc(
                ptr,
                layout,
                room(0, blocks::rounded_change(-(layout.size() as isize))),
            )
        } else {
            System.dealloc(ptr, layout)
        }
    }
}

// SAFETY: small blocks forward to `System` with the caller's arguments unchanged; large ones
// (chosen by the layout alone, so a block goes back where it came from) are whole mappings of
// at least the layout's size, page-aligned, which satisfies any alignment `blocks::serves`
// accepts. The counters are plain atomics that never affect what is allocated.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promises, passed on.
        counted(unsafe { raw_alloc(layout, false) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promises, passed on.
        counted(unsafe { raw_alloc(layout, true) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's promises, passed on.
        unsafe { raw_dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller promises `new_size`, rounded up to the alignment, fits an isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let p = match (blocks::serves(layout), blocks::serves(new_layout)) {
            // SAFETY: both mapped here; the caller's promises about `ptr` hold.
            (true, true) => unsafe { blocks::realloc(ptr, layout, new_size) },
            // SAFETY: forwarded as is; a growing block makes room first, as `raw_alloc` does.
            (false, false) => unsafe {
                blocks::keep_within(room(new_size as isize - layout.size() as isize, 0));
                System.realloc(ptr, layout, new_size)
            },
            // Between the two: a new block, the contents copied, the old one freed.
            // SAFETY: `new_layout` is valid (above); the copy stays inside both blocks.
            _ => unsafe {
                let p = raw_alloc(new_layout, false);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    raw_dealloc(ptr, layout);
                }
                p
            },
        };
        if !p.is_null() {
            counted(p, new_size);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

/// Marks the end of a run's start (the model built, loaded and handed out, before its first
/// epoch): [`start_peak_bytes`] is the live peak until now. Only the first call counts.
pub fn start_done() {
    if INSTALLED.load(Ordering::Relaxed) {
        let peak = PEAK.load(Ordering::Relaxed).max(1);
        let _ = START_PEAK.compare_exchange(0, peak, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The most bytes live at once before the run's first epoch ([`start_done`]): what building,
/// loading and handing out the model took, when the program uses [`CountingAllocator`].
pub fn start_peak_bytes() -> Option<usize> {
    let peak = START_PEAK.load(Ordering::Relaxed);
    (INSTALLED.load(Ordering::Relaxed) && peak > 0).then_some(peak)
}

/// Marks the end of a training step, for the keep policy: large blocks freed before the step
/// that just ended and not asked for again during it go back to the kernel. The training loops
/// call it once per step; a no-op where nothing is kept. Returns the bytes handed back.
pub fn step_done() -> usize {
    let released = blocks::step_done();
    if !INSTALLED.load(Ordering::Relaxed) {
        return released;
    }
    // The step that ended: how far the live heap rose above what is held between steps, the
    // higher of its two ends (a step that adds what stays, the optimizer's state in the first
    // one, rose above its start by that too).
    let live = LIVE.load(Ordering::Relaxed);
    if STEPPING.swap(true, Ordering::Relaxed) {
        let held = STEP_BASE.load(Ordering::Relaxed).max(live);
        let rise = STEP_PEAK.load(Ordering::Relaxed).saturating_sub(held);
        phase::step_ended(STEP_RISE.fetch_max(rise, Ordering::Relaxed) < rise);
    } else {
        phase::step_ended(false);
    }
    STEP_BASE.store(live, Ordering::Relaxed);
    STEP_PEAK.store(live, Ordering::Relaxed);
    // glibc's heap as it is now counts against the room: kept blocks beyond it go.
    read_c_heap();
    let before = blocks::kept_bytes();
    blocks::keep_within(room(0, 0));
    released + before.saturating_sub(blocks::kept_bytes())
}

/// Hands back to the kernel what the keep policy holds of freed memory: the kept large blocks,
/// and glibc's free heap pages (`malloc_trim`, which also returns the free pages inside the
/// heap, not only at its top). For a change of phase after which nothing asks for what the
/// steps used: the end of training, before the export builds the best epoch's model. Without
/// it the training state freed there stayed resident where it lived in glibc's heap (ZeRO
/// stage 3 with small buckets: each bucket's segments of the parameters and the optimizer
/// state, 256 KiB each with 1 MiB buckets on 4 ranks), and the export's model, mapped apart,
/// came on top of it (VGG-16: rank 0's peak 1,755 MB against 1,314 MB live at most). Returns
/// the kept blocks' bytes handed back.
pub fn release_freed_memory() -> usize {
    let kept = blocks::kept_bytes();
    blocks::keep_within(0);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns glibc's free memory to the kernel, under its locks.
    unsafe {
        libc::malloc_trim(0);
    }
    kept.saturating_sub(blocks::kept_bytes())
}

/// Bytes glibc had taken from the kernel (its heap, in use or free) when the last training step
/// ended ([`step_done`]), which the room for kept blocks leaves to it; 0 before the first step
/// or off glibc.
pub fn c_heap_bytes() -> usize {
    C_HEAP.load(Ordering::Relaxed)
}

/// The process's footprint without keeping at its most, as far as known (glibc's heap and the
/// large blocks in use): kept blocks fill only the room under it.
pub fn footprint_peak_bytes() -> usize {
    FOOT_PEAK.load(Ordering::Relaxed)
}

/// Bytes of freed large blocks kept for reuse now (0 without [`CountingAllocator`] or under
/// `HEARTH_MALLOC=system`).
pub fn kept_bytes() -> usize {
    blocks::kept_bytes()
}

/// The most bytes live at once since the process started (what its memory needs, apart from
/// what the C allocator keeps of freed memory), when the program uses [`CountingAllocator`].
pub fn peak_live_bytes() -> Option<usize> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| PEAK.load(Ordering::Relaxed))
}

/// The most bytes the live heap rose within one training step (from one [`step_done`] to the
/// next: the step's batch, forward, backward, exchange and update) above what was live at the
/// higher of its two ends, over the steps that have ended, when the program uses
/// [`CountingAllocator`]; `None` also before a step has ended. What a step adds to the memory
/// held between steps: its activations and, with ZeRO stage 3, the parameters it gathers and
/// the gradients it holds before they are reduced (a first step that creates the optimizer's
/// state counts what it adds above the state).
pub fn step_rise_bytes() -> Option<usize> {
    let rise = STEP_RISE.load(Ordering::Relaxed);
    (INSTALLED.load(Ordering::Relaxed) && rise > 0).then_some(rise)
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
    /// Freed memory goes back (`HEARTH_MALLOC=system`): under [`CountingAllocator`] every
    /// block of [`blocks::LARGE`] bytes and more is unmapped when freed; the C allocator's
    /// defaults for the rest.
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

/// Keeps the memory a process frees for the next allocation of the same size, instead of
/// handing it back to the kernel; `false` where glibc's part cannot be set (not glibc, or
/// `mallopt` refused).
///
/// Why: a training step allocates and frees the same large tensors every step (DenseNet-121's
/// feature maps at batch 16 are 50 MB). glibc serves blocks above its mmap threshold (at most
/// 32 MiB) with `mmap` and returns them with `munmap`, so every step the kernel zeroed and
/// mapped fresh pages again: page faults and `clear_page` took about a sixth of a DenseNet-121
/// training step on 2 cores (perf). Keeping them: DenseNet-121 training 7.7 -> 10.9 images/s,
/// VGG-16 2.4 -> 3.3, ResNet-50 8.5 -> 9.4 (BENCHMARKS.md).
///
/// How, in two parts:
/// - under [`CountingAllocator`], blocks of [`blocks::LARGE`] bytes and more are mapped whole
///   and kept after they are freed, for a request of the same size, until a training step
///   passes without one ([`step_done`]), and only within the room under the process's
///   footprint without keeping at its most (glibc's heap, read at each step's end, and the large
///   blocks in use), checked before every allocation that may grow it, small ones
///   included: nothing fragments, sizes a run stopped using go back, and keeping never takes the
///   resident set past where it would have been without keeping (ZeRO's saving shows in the
///   resident set; see [`blocks`]);
/// - glibc keeps the rest: `M_MMAP_MAX = 0` serves every smaller block (every block, without
///   the counting allocator) from the heap, and `M_TRIM_THRESHOLD = 2 GiB` keeps up to that
///   much free memory at the heap's top.
///
/// Call it before the work starts; it changes the whole process, so a library never calls it
/// by itself: the `hearth` binary and the benches do, as [`FreedMemory::from_env`] says.
pub fn keep_freed_memory() -> bool {
    blocks::set_keep(true);
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
