//! The counting allocator's large blocks as the `hearth` binary uses them (installed as the
//! global allocator): kept after they are freed for the next request of their size (or cut or
//! grown for a request of another length), handed back after a step without one or when keeping
//! it would take the process past its footprint without keeping at its most (glibc's heap and
//! the large blocks in use: a small block's growth of glibc's live bytes included), contents kept
//! across every kind of resize, the resident set falling when they go back, and everything
//! kept, glibc's free heap included, handed back at a change of phase. One test, in order: the
//! kept set is process-wide state.

#[global_allocator]
static ALLOC: hearth::alloc::CountingAllocator = hearth::alloc::CountingAllocator;

use hearth::alloc::{
    blocks, c_heap_bytes, footprint_peak_bytes, kept_bytes, live_bytes, step_done,
};

/// The process's footprint without keeping now, as the room reckons it: glibc's heap (at least
/// what it serves live) and the large blocks in use.
fn footprint() -> usize {
    let in_use = blocks::in_use_bytes();
    let glibc = live_bytes().expect("counting").saturating_sub(in_use);
    c_heap_bytes().max(glibc) + in_use
}

/// Resident memory now, MB (`VmRSS`).
fn rss_mb() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("a VmRSS line");
    let kb: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in kB");
    kb / 1024.0
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn large_blocks_are_reused_by_size_released_after_a_step_and_keep_their_contents() {
    assert!(blocks::serves(
        std::alloc::Layout::from_size_align(blocks::LARGE, 64).unwrap()
    ));
    assert!(!blocks::serves(
        std::alloc::Layout::from_size_align(blocks::LARGE - 1, 8).unwrap()
    ));
    blocks::set_keep(true);
    // Room under the footprint's peak for what follows (the test harness's own peak is small).
    drop(pattern(64 << 20, 0));
    step_done();
    step_done();
    assert_eq!(kept_bytes(), 0, "the block that made room went back");
    // An odd size nothing else in the process asks for.
    let n = 3 * blocks::LARGE + 12_345;

    // Freed, kept, and the same block given to the next request of its size, zeroed when asked
    // for zeros (the block held the pattern).
    let live0 = live_bytes().expect("the counting allocator is installed");
    let a = pattern(n, 7);
    assert!(live_bytes().unwrap() >= live0 + n);
    let at = a.as_ptr() as usize;
    let kept0 = kept_bytes();
    drop(a);
    assert!(kept_bytes() >= kept0 + n, "the freed block is kept");
    let z = vec![0u8; n];
    assert_eq!(
        z.as_ptr() as usize,
        at,
        "the kept block of the same size is reused"
    );
    assert!(
        z.iter().all(|&b| b == 0),
        "a reused block asked for zeroed is zeroed"
    );
    assert_eq!(kept_bytes(), kept0, "taken out of the kept set");
    drop(z);

    // A step passes without a request of that size: at its end the block is still kept (it was
    // freed during the step); after one more it goes back.
    step_done();
    assert!(kept_bytes() >= n);
    step_done();
    assert_eq!(kept_bytes(), 0, "blocks no step asked for go back");

    // Resizes keep the contents: large to larger (moved pages), large to small, small to large.
    let mut v = pattern(2 * blocks::LARGE, 3);
    let want = v.clone();
    v.reserve_exact(40 * blocks::LARGE);
    assert_eq!(&v[..], &want[..]);
    v.truncate(1000);
    v.shrink_to_fit();
    assert_eq!(&v[..], &want[..1000]);
    v.reserve_exact(5 * blocks::LARGE);
    assert_eq!(&v[..], &want[..1000]);
    drop((v, want));

    // The resident set falls when kept blocks go back.
    step_done();
    step_done();
    let before = rss_mb();
    let big = pattern(256 << 20, 1);
    // A peak above what is kept.
    let pad = pattern(32 << 20, 6);
    assert!(rss_mb() > before + 200.0, "256 MB written are resident");
    drop(pad);
    drop(big);
    assert!(rss_mb() > before + 200.0, "kept for reuse");
    step_done();
    step_done();
    assert!(
        rss_mb() < before + 50.0,
        "handed back: {} MB resident, {before} MB before",
        rss_mb()
    );

    // Keeping never takes the process past its footprint without keeping at its most: a block
    // of a new size that raises that peak first hands back what is kept.
    let a = pattern(64 << 20, 2);
    drop(a);
    assert!(
        kept_bytes() >= 64 << 20,
        "within the room under the peak: kept"
    );
    let b = pattern(300 << 20, 4);
    assert_eq!(
        kept_bytes(),
        0,
        "a new peak leaves no room: the kept block went back"
    );
    let pad = pattern(32 << 20, 6);
    drop(pad);
    drop(b);

    // Small blocks (glibc's, below `LARGE`) grow glibc's heap: as they fill the room under the
    // peak, what is kept goes back, so kept bytes and the footprint never pass the peak.
    let kept_then = kept_bytes();
    assert!(kept_then >= 300 << 20, "the 300 MB block is kept");
    let mut small: Vec<Vec<u8>> = Vec::new();
    for i in 0..3200u32 {
        small.push(pattern(64 << 10, i as u8));
        let (foot, peak) = (footprint(), footprint_peak_bytes());
        assert!(
            kept_bytes() + foot <= peak,
            "after {} small blocks: {} kept + {foot} footprint > peak {peak}",
            i + 1,
            kept_bytes()
        );
    }
    assert!(
        kept_bytes() < kept_then,
        "200 MB of small blocks made the kept block go back"
    );
    drop(small);
    // At a step's end glibc's heap is read (its free chunks are resident too) and left out of
    // the room.
    step_done();
    let (foot, peak) = (footprint(), footprint_peak_bytes());
    assert!(c_heap_bytes() > 0, "glibc's heap was read");
    assert!(
        kept_bytes() + foot <= peak,
        "{} kept + {foot} footprint (glibc's heap {}) > peak {peak}",
        kept_bytes(),
        c_heap_bytes()
    );

    // Threads allocating and freeing large blocks of a few sizes at once: each sees its own
    // contents, and the live count comes back to where it was.
    let live1 = live_bytes().unwrap();
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            std::thread::spawn(move || {
                for round in 0..50usize {
                    let size = blocks::LARGE * (1 + (round + t as usize) % 3) + 4096 * t as usize;
                    let v = pattern(size, t.wrapping_add(round as u8));
                    assert_eq!(
                        v[size - 1],
                        pattern(size, t.wrapping_add(round as u8))[size - 1]
                    );
                    if round % 10 == 9 {
                        step_done();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread failed");
    }
    let drift = live_bytes().unwrap() as i64 - live1 as i64;
    assert!(drift.abs() < (1 << 20), "live bytes drifted by {drift}");

    // A request of a length nothing kept has takes a kept block of another length instead of a
    // new mapping (whose every page the kernel would fault in and zero again): a longer one is
    // cut, its tail kept; a shorter one grown. Zeroed when asked for zeros; contents kept
    // through a resize afterwards.
    step_done();
    step_done();
    assert_eq!(kept_bytes(), 0);
    drop(pattern(8 * blocks::LARGE, 5));
    assert_eq!(
        kept_bytes(),
        8 * blocks::LARGE,
        "the block of 8 x LARGE is kept"
    );
    let (maps0, _) = blocks::maps();
    let recycled0 = blocks::recycled();
    let a = vec![0u8; 3 * blocks::LARGE + 100];
    assert!(a.iter().all(|&b| b == 0), "a cut block asked for zeros");
    assert_eq!(blocks::maps().0, maps0, "no new mapping for the cut block");
    assert_eq!(blocks::recycled(), recycled0 + 1);
    let tail = kept_bytes();
    assert!(
        tail > 4 * blocks::LARGE && tail < 5 * blocks::LARGE,
        "the tail stays kept: {tail} bytes"
    );
    let mut b = pattern(6 * blocks::LARGE, 2);
    assert_eq!(
        blocks::maps().0,
        maps0,
        "no new mapping for the grown block"
    );
    assert_eq!(blocks::recycled(), recycled0 + 2);
    assert_eq!(kept_bytes(), 0, "the tail was grown into the second block");
    let want = b.clone();
    b.reserve_exact(10 * blocks::LARGE);
    assert_eq!(
        &b[..],
        &want[..],
        "a recycled block resized keeps its contents"
    );
    drop((a, b, want));

    // A block freed right at the footprint's peak is kept while glibc holds free memory (its
    // heap counts in the footprint as it is, free chunks included), and the next request of its
    // size takes it: no new mapping to fault in. Against the live peak less glibc's free bytes
    // (the rule before), such a block went back at once: a ZeRO stage 3 step near its own peak
    // faulted in 600 MB again every step.
    assert!(
        hearth::alloc::keep_freed_memory(),
        "glibc takes the keep settings"
    );
    let small: Vec<Vec<u8>> = (0..3200u32).map(|i| pattern(64 << 10, i as u8)).collect();
    // One block after them stays live, so that glibc cannot hand their heap back (a thread's
    // arena gives back a heap left wholly free whatever the trim setting).
    let pin = pattern(64 << 10, 0);
    drop(small);
    step_done();
    assert!(
        c_heap_bytes() >= 200 << 20,
        "glibc keeps the 200 MB freed: its heap is {} bytes",
        c_heap_bytes()
    );
    // A block that takes the footprint 64 MB past its peak.
    let big = footprint_peak_bytes() - footprint() + (64 << 20);
    let x = pattern(big, 1);
    assert_eq!(footprint_peak_bytes(), footprint(), "a new peak");
    drop(x);
    assert!(kept_bytes() >= big, "freed at the peak: kept");
    let (maps0, _) = blocks::maps();
    let y = pattern(big, 2);
    assert_eq!(
        blocks::maps().0,
        maps0,
        "the kept block serves the next request"
    );
    drop(y);

    // At a change of phase (the end of training) both go back to the kernel: the kept blocks,
    // and glibc's free heap pages, which a live block above them pins in its heap (its trim
    // setting keeps them otherwise).
    assert!(kept_bytes() >= big, "freed again: kept");
    let rss = rss_mb();
    assert!(
        hearth::alloc::release_freed_memory() >= big,
        "the kept block went back"
    );
    assert_eq!(kept_bytes(), 0);
    let fell = rss - rss_mb();
    assert!(
        fell >= 200.0,
        "the resident set fell {fell:.0} MB (a {} MB kept block and 200 MB free in glibc)",
        big >> 20
    );
    drop(pin);

    // Without keeping (`HEARTH_MALLOC=system`) nothing is kept and what was goes back.
    drop(pattern(n, 9));
    assert!(kept_bytes() >= n);
    blocks::set_keep(false);
    assert_eq!(kept_bytes(), 0);
    drop(pattern(n, 9));
    assert_eq!(kept_bytes(), 0);
}
