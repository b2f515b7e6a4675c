//! Large blocks (512 KiB and more) mapped straight from the kernel, each kept after it is freed
//! for the next request of the same size, and handed back once a whole training step has
//! passed without one. A request of a length nothing kept has takes a kept block of another
//! length: the shortest one long enough, cut to it (the tail stays kept), or else the longest,
//! grown (`mremap`). A new mapping is faulted in and zeroed by the kernel page by page; a
//! DenseNet's step asks for new lengths at every layer, and before this it faulted in about
//! 1 GB a step at batch 16 (about 0.4 s of a 3.6 s step on a Zen 4), after it about 0.1 GB.
//!
//! Why not glibc's heap with its mmap path turned off (what `HEARTH_MALLOC=keep` did before):
//! a heap grows at its top and reuses a hole only for a block that fits it, so a run whose
//! large blocks change size between phases (ZeRO's first step, when the sharded optimizer state
//! appears; a checkpoint; validation's batches) leaves holes nothing fills, and they stay
//! resident. VGG-16 with Adam on 2 ranks: `--zero 1` held 0.6 GB more resident memory than
//! plain data parallel while its live heap was 0.57 GB smaller. A mapped block is returned
//! whole, so nothing fragments; what is kept is only blocks of the sizes the last step used,
//! which the next step asks for again (a training step allocates the same tensors every step:
//! reusing them is what spares the kernel's page faults and zeroing, the reason for keeping).
//! And what is kept never takes the process past the footprint it would have had without
//! keeping: a block is kept only within the room under that footprint's peak (glibc's heap and
//! the large blocks in use; the caller computes it, `super::room`), and a new mapping hands kept
//! ones back to stay in it (the end of a ZeRO epoch, when rank 0 writes checkpoints of sizes no
//! step uses, had kept 1.3 GB more than it ever had live). The room is checked before every
//! allocation that may grow that footprint, small ones (glibc's) included.
//!
//! Self-contained: the counting allocator above calls in, nothing here calls out.

use std::alloc::Layout;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Blocks of at least this many bytes are mapped here. 512 KiB, not 1 MiB: ZeRO stage 3 with
/// its default 1 MiB buckets moves pieces of parameters and gradients just under 1 MiB on
/// three threads (the gathers ahead and the exchange), which glibc served from each thread's
/// arena and kept there, fragmented: ResNet-50 at 2 ranks with `--overlap` peaked at 311-409
/// MB resident against 217 MB live, and at 285-309 MB with them mapped here (2026-12-05).
pub const LARGE: usize = 1 << 19;
/// How many freed blocks can be kept at once; one freed when all are taken goes back.
const SLOTS: usize = 1024;

/// The kept blocks: parallel arrays, so a lookup scans one array of lengths.
struct Kept {
    /// Page-rounded length of each kept block; 0 marks an empty slot.
    lens: [usize; SLOTS],
    ptrs: [usize; SLOTS],
    /// The step count when each was freed.
    freed_in: [u64; SLOTS],
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    lens: [0; SLOTS],
    ptrs: [0; SLOTS],
    freed_in: [0; SLOTS],
});
/// Whether freed blocks are kept (the `keep` policy) or unmapped at once.
static KEEP: AtomicBool = AtomicBool::new(false);
/// Steps ended so far ([`step_done`]).
static STEPS: AtomicU64 = AtomicU64::new(0);
/// Bytes of blocks kept now, and mapped now (in use or kept).
static KEPT_BYTES: AtomicUsize = AtomicUsize::new(0);
static MAPPED_BYTES: AtomicUsize = AtomicUsize::new(0);
static PAGE: AtomicUsize = AtomicUsize::new(0);
/// New mappings made so far (each one page-faulted in afresh), and their bytes.
static MAPS: AtomicUsize = AtomicUsize::new(0);
static MAPS_BYTES: AtomicUsize = AtomicUsize::new(0);
/// Kept blocks resized for a request of another length so far.
static RECYCLED: AtomicUsize = AtomicUsize::new(0);

fn page() -> usize {
    let p = PAGE.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: sysconf reads a constant of the system.
    let p = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    };
    PAGE.store(p, Ordering::Relaxed);
    p
}

fn rounded(size: usize) -> usize {
    let p = page();
    size.div_ceil(p) * p
}

/// A change of `size` bytes (negative: a block freed) in whole pages, as blocks are mapped.
pub fn rounded_change(size: isize) -> isize {
    let r = rounded(size.unsigned_abs()) as isize;
    if size < 0 { -r } else { r }
}

fn kept() -> std::sync::MutexGuard<'static, Kept> {
    // A panic cannot happen while the lock is held (no code here panics), but a poisoned lock
    // would still hold consistent arrays.
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `layout` is served here: large, and aligned no stricter than a page.
pub fn serves(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= page()
}

/// A block for `layout` (one that [`serves`] says yes to): a kept one of the same length, else
/// a kept one of another length cut or grown to it, else a new mapping; zeroed where asked.
/// Null when the kernel refuses.
///
/// `room`: the bytes the process may keep unused once this block is in use (the process's
/// footprint without keeping at its most, less that footprint with this block). A new mapping
/// first hands back kept blocks beyond it, oldest first, so that keeping never takes the
/// resident set past where it would have been without keeping.
///
/// # Safety
/// `layout` must be one that [`serves`] accepts.
pub unsafe fn alloc(layout: Layout, zeroed: bool, room: usize) -> *mut u8 {
    let len = rounded(layout.size());
    if let Some(p) = take(len) {
        if zeroed {
            // SAFETY: the block is `len >= layout.size()` bytes, ours alone.
            unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
        }
        return p;
    }
    // A kept block of another length, resized: the pages it has already faulted in serve this
    // block too (a step's sizes vary, DenseNet's with every layer; a fresh mapping would fault
    // in and zero every page again).
    if let Some((p, had)) = recycle(len) {
        if zeroed {
            // Pages a block grew by come zeroed from the kernel.
            // SAFETY: the block is `len >= layout.size()` bytes, ours alone.
            unsafe { std::ptr::write_bytes(p, 0, layout.size().min(had)) };
        }
        keep_within(room);
        return p;
    }
    keep_within(room);
    map(len)
}

/// A kept block of another length made `len` bytes long: the shortest kept block at least
/// `len` long, cut (its tail stays kept), or else the longest, grown (only the new pages to
/// fault in). The block and how many of its bytes it had before (the rest are zeros). None
/// when nothing is kept or the kernel refuses (the block then goes back).
fn recycle(len: usize) -> Option<(*mut u8, usize)> {
    if KEPT_BYTES.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let (ptr, old) = {
        let mut k = kept();
        // The smallest at least `len` long (its tail stays kept: nothing to fault in), else
        // the longest (the fewest new pages).
        let taken = (0..SLOTS).filter(|&i| k.lens[i] != 0);
        let i = taken
            .clone()
            .filter(|&i| k.lens[i] >= len)
            .min_by_key(|&i| k.lens[i])
            .or_else(|| taken.max_by_key(|&i| k.lens[i]))?;
        let old = k.lens[i];
        k.lens[i] = 0;
        KEPT_BYTES.fetch_sub(old, Ordering::Relaxed);
        (k.ptrs[i], old)
    };
    if old > len {
        // The tail stays kept as a block of its own: its pages are faulted in already.
        let tail = ptr + len;
        if put(tail as *mut u8, old - len) {
            RECYCLED.fetch_add(1, Ordering::Relaxed);
            return Some((ptr as *mut u8, len));
        }
    }
    // SAFETY: `ptr` is a whole mapping of `old` bytes of ours that nobody uses; MAYMOVE keeps
    // the pages it has.
    let p = unsafe { libc::mremap(ptr as *mut libc::c_void, old, len, libc::MREMAP_MAYMOVE) };
    if p == libc::MAP_FAILED {
        unmap(ptr, old);
        return None;
    }
    if len > old {
        MAPPED_BYTES.fetch_add(len - old, Ordering::Relaxed);
    } else {
        MAPPED_BYTES.fetch_sub(old - len, Ordering::Relaxed);
    }
    RECYCLED.fetch_add(1, Ordering::Relaxed);
    Some((p.cast(), old.min(len)))
}

/// Hands kept blocks back until at most `room` bytes are kept: the blocks of earlier steps
/// first, then any. The counting allocator calls it before every allocation that may grow the
/// process's footprint, small ones included (glibc serves those, and they may grow its heap as
/// surely as a mapping does). One relaxed load when nothing needs handing back.
pub fn keep_within(room: usize) {
    if KEPT_BYTES.load(Ordering::Relaxed) <= room {
        return;
    }
    let now = STEPS.load(Ordering::Relaxed);
    release_until(room, |freed_in| freed_in < now);
    release_until(room, |_| true);
}

/// Frees a block [`alloc`] gave for `layout`: kept under the keep policy, while a slot is free
/// and the kept bytes stay within `room` (the process's footprint without keeping at its most,
/// less that footprint without this block); unmapped otherwise.
///
/// # Safety
/// `ptr` must come from [`alloc`] (or [`realloc`]) with this `layout`, and not be used again.
pub unsafe fn dealloc(ptr: *mut u8, layout: Layout, room: usize) {
    let len = rounded(layout.size());
    // The room counts requested bytes, the kept set whole pages: a block's rounding is not
    // held against it.
    if KEEP.load(Ordering::Relaxed)
        && KEPT_BYTES.load(Ordering::Relaxed) + layout.size() <= room
        && put(ptr, len)
    {
        return;
    }

    unmap(ptr as usize, len);
}

/// Grows or shrinks a block between two sizes that [`serves`] both accepts, moving its pages
/// rather than copying them. Null (the old block untouched) when the kernel refuses.
///
/// # Safety
/// As [`dealloc`] for `ptr` and `layout`; `new_size` at least [`LARGE`].
pub unsafe fn realloc(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    let (old, new) = (rounded(layout.size()), rounded(new_size));
    if old == new {
        return ptr;
    }
    // SAFETY: `ptr` is a mapping of `old` bytes of ours; MAYMOVE keeps the contents.
    let p = unsafe { libc::mremap(ptr.cast(), old, new, libc::MREMAP_MAYMOVE) };
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    if new > old {
        MAPPED_BYTES.fetch_add(new - old, Ordering::Relaxed);
    } else {
        MAPPED_BYTES.fetch_sub(old - new, Ordering::Relaxed);
    }
    p.cast()
}

fn map(len: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping; no file, no address asked for.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    MAPPED_BYTES.fetch_add(len, Ordering::Relaxed);
    MAPS.fetch_add(1, Ordering::Relaxed);
    MAPS_BYTES.fetch_add(len, Ordering::Relaxed);
    p.cast()
}

fn unmap(ptr: usize, len: usize) {
    // SAFETY: `ptr` is a whole mapping of `len` bytes of ours that nobody uses any more.
    unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
    MAPPED_BYTES.fetch_sub(len, Ordering::Relaxed);
}

/// A kept block of exactly `len` bytes, taken out of the kept set.
fn take(len: usize) -> Option<*mut u8> {
    if KEPT_BYTES.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let mut k = kept();
    let i = k.lens.iter().position(|&l| l == len)?;
    k.lens[i] = 0;
    KEPT_BYTES.fetch_sub(len, Ordering::Relaxed);
    Some(k.ptrs[i] as *mut u8)
}

/// Keeps a freed block; false when every slot is taken.
fn put(ptr: *mut u8, len: usize) -> bool {
    let mut k = kept();
    let Some(i) = k.lens.iter().position(|&l| l == 0) else {
        return false;
    };
    k.lens[i] = len;
    k.ptrs[i] = ptr as usize;
    k.freed_in[i] = STEPS.load(Ordering::Relaxed);
    KEPT_BYTES.fetch_add(len, Ordering::Relaxed);
    true
}

/// Keeps freed blocks from now on (`true`), or unmaps every kept block and keeps none.
pub fn set_keep(keep: bool) {
    KEEP.store(keep, Ordering::Relaxed);
    if !keep {
        release(|_| true);
    }
}

/// Marks the end of a training step: blocks freed before the step that just ended and not
/// asked for again during it go back to the kernel (the sizes a run no longer uses: the first
/// step's, a finished phase's). Returns the bytes handed back.
pub fn step_done() -> usize {
    let now = STEPS.fetch_add(1, Ordering::Relaxed) + 1;
    release(|freed_in| freed_in + 2 <= now)
}

/// Unmaps the kept blocks whose step of freeing `stale` says so; the bytes unmapped.
fn release(stale: impl Fn(u64) -> bool) -> usize {
    release_until(0, stale)
}

/// Unmaps kept blocks that `stale` picks (by their step of freeing) until at most `keep` bytes
/// are kept; the bytes unmapped.
fn release_until(keep: usize, stale: impl Fn(u64) -> bool) -> usize {
    if KEPT_BYTES.load(Ordering::Relaxed) <= keep {
        return 0;
    }
    let mut k = kept();
    let mut freed = 0;
    for i in 0..SLOTS {
        if KEPT_BYTES.load(Ordering::Relaxed) <= keep {
            break;
        }
        let len = k.lens[i];
        if len != 0 && stale(k.freed_in[i]) {
            unmap(k.ptrs[i], len);
            k.lens[i] = 0;
            KEPT_BYTES.fetch_sub(len, Ordering::Relaxed);
            freed += len;
        }
    }
    freed
}

/// Bytes of large blocks in use now (mapped, not kept), in whole pages.
pub fn in_use_bytes() -> usize {
    MAPPED_BYTES
        .load(Ordering::Relaxed)
        .saturating_sub(KEPT_BYTES.load(Ordering::Relaxed))
}

/// Bytes of freed blocks kept for reuse now.
pub fn kept_bytes() -> usize {
    KEPT_BYTES.load(Ordering::Relaxed)
}

/// Bytes mapped here now: blocks in use and blocks kept.
pub fn mapped_bytes() -> usize {
    MAPPED_BYTES.load(Ordering::Relaxed)
}

/// New mappings made so far (each one's pages faulted in and zeroed by the kernel afresh: what
/// keeping spares), and their bytes.
pub fn maps() -> (usize, usize) {
    (
        MAPS.load(Ordering::Relaxed),
        MAPS_BYTES.load(Ordering::Relaxed),
    )
}

/// Kept blocks resized for a request of another length so far (each spared a new mapping).
pub fn recycled() -> usize {
    RECYCLED.load(Ordering::Relaxed)
}
