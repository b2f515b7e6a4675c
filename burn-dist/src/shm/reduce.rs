//! Collectives computed in the segment itself: each rank reduces its `1/n` of the buffer reading
//! the others' values where they lie, instead of passing chunks around a ring.
//!
//! A buffer goes through in pieces of half a slot. For a piece split into `n` segments, rank `r`:
//! 1. copies the segments other ranks reduce into its slot, and arrives at a barrier;
//! 2. adds the other ranks' copies of segment `r` into its own buffer and writes the sum to its
//!    slot, and arrives at a barrier;
//! 3. copies every other segment's sum from its owner's slot.
//!
//! Each rank copies `(n-1)/n` of the buffer in and out and reads `(n-1)/n` of a segment from
//! each peer: no bytes cross a socket, nothing is encrypted, and the `n` reductions run in
//! parallel. Consecutive pieces alternate slot halves, so the reads of one piece never race the
//! writes of the next and two barriers per piece suffice. Every segment is summed by one rank
//! only, so every rank ends with identical values.
//!
//! With more ranks than cores, each of those barriers costs context switches (the ranks a
//! barrier waits for are not running), so the segment's creator may choose a chain instead
//! ([`crate::shm::ShmOptions::chain_for`]): the pieces pass from rank to rank through a ring of
//! the slots without barriers ([`LocalGroup::reduce`] describes it). 100 MB over 4 ranks on 2
//! cores: 23-27 ms with barriers, 18-22 ms as a chain (BENCHMARKS.md).
//!
//! A range of buffers every member maps (`shm::shared`) skips the slots: `reduce/in_place.rs` sums it
//! where it lies.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::segment::{Segment, Watch, futex_wait, futex_wake};
use super::shared::{NOWHERE, Shared};
use crate::split::segment;
use crate::transport::{HostGroup, SharedBuf};
use crate::{DistError, Result};

mod chain;
mod in_place;

/// How long a barrier spins before it sleeps (rounds bound it when the clock is slow to read).
const SPIN: Duration = Duration::from_micros(200);
const SPIN_ROUNDS: u32 = 1 << 20;
/// `acc += src`, value by value. (Compiled for AVX2 or AVX-512 at run time it was no faster on
/// any path here: the additions wait for memory; BENCHMARKS.md.)
fn add(acc: &mut [f32], src: &[f32]) {
    acc.iter_mut().zip(src).for_each(|(a, s)| *a += s);
}

/// The ranks of one host that share a segment, as a group for in-place collectives.
pub struct LocalGroup {
    seg: Arc<Segment>,
    me: usize,
    members: Vec<usize>,
    /// Barriers this rank has passed (the same count on every member).
    barriers: AtomicU32,
    /// Pieces this rank has moved through the slots (picks the slot half).
    pieces: AtomicU64,
    /// Collectives this rank has started (picks the length slot).
    calls: AtomicU64,
    /// One collective at a time from this process.
    busy: Mutex<Watch>,
    /// More ranks on this host than cores.
    oversubscribed: bool,
    /// The allreduce runs as a chain (the segment's choice, the same on every member).
    chain: bool,
    /// Pieces this rank has passed through the chain (the same count on every member).
    chained: AtomicU64,
    /// Shared buffers made so far (the same count on every member).
    shares: AtomicU64,
    /// The latest shared buffers ([`Self::share`]): collectives of a range of them run in
    /// place.
    shared: Mutex<Option<Arc<Shared>>>,
}

impl LocalGroup {
    pub(crate) fn new(seg: Arc<Segment>, me: usize, members: Vec<usize>, stale: Duration) -> Self {
        let n = members.len();
        LocalGroup {
            me,
            members,
            barriers: AtomicU32::new(0),
            pieces: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            busy: Mutex::new(Watch::new(n, stale)),
            oversubscribed: super::options::outnumber_cores(n),
            chain: seg.chain(),
            chained: AtomicU64::new(0),
            shares: AtomicU64::new(0),
            shared: Mutex::new(None),
            seg,
        }
    }

    /// Job ranks of the group, in local order (the first is the host's leader).
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// This rank's local index.
    pub fn local_rank(&self) -> usize {
        self.me
    }

    /// One round of a brief busy wait that began at `since`: spins the core, or yields it when
    /// the ranks outnumber the cores (the ranks waited for need it). False once the wait has
    /// lasted [`SPIN`] (or [`SPIN_ROUNDS`] rounds): time to sleep.
    fn spin(&self, spins: &mut u32, since: Instant) -> bool {
        if *spins >= SPIN_ROUNDS || since.elapsed() >= SPIN {
            return false;
        }
        *spins += 1;
        if self.oversubscribed {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        true
    }

    fn barrier(&self, watch: &mut Watch, deadline: Instant, op: &str) -> Result<()> {
        let round = self
            .barriers
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        let word = &self.seg.header().barrier_word;
        self.seg
            .entry(self.me)
            .arrived
            .store(round, Ordering::Release);
        word.fetch_add(1, Ordering::Release);
        futex_wake(word);
        let started = Instant::now();
        let mut spins = 0u32;
        let mut last_check = Instant::now();
        loop {
            let seen = word.load(Ordering::Acquire);
            let missing = (0..self.members.len()).find(|&k| {
                let a = self.seg.entry(k).arrived.load(Ordering::Acquire);
                (a.wrapping_sub(round) as i32) < 0
            });
            let Some(k) = missing else { return Ok(()) };
            // Spin briefly (the others are usually microseconds away), then sleep on the word.
            // With more ranks than cores the waiting rank yields its core instead: the ranks it
            // waits for need it.
            if self.spin(&mut spins, started) {
                continue;
            }
            if last_check.elapsed() >= Duration::from_millis(100) {
                last_check = Instant::now();
                self.check_alive(k, watch, op)?;
            }
            if Instant::now() >= deadline {
                self.give_up_on(k);
                return Err(DistError::Timeout {
                    op: format!("shared-memory {op}"),
                    rank: self.members[k],
                    after: started.elapsed(),
                });
            }
            futex_wait(word, seen, Duration::from_millis(20));
        }
    }

    /// Every member announces its buffer's length and checks the others': different lengths
    /// are an error on every member, never a hang or a wrong sum. Two length slots alternate,
    /// so a fast rank's next announcement never overwrites one a slow rank still reads.
    fn agree_on_length(
        &self,
        len: usize,
        watch: &mut Watch,
        deadline: Instant,
        op: &str,
    ) -> Result<()> {
        self.agree(len, NOWHERE, watch, deadline, op).map(|_| ())
    }

    /// [`Self::agree_on_length`], with where each member's buffer lies (`place`, from
    /// [`Shared::place_of`], or [`NOWHERE`]): true when every member passes the same range of
    /// its latest shared buffer, so the collective can run in place. Announced with the
    /// length, at the same barrier.
    fn agree(
        &self,
        len: usize,
        place: u64,
        watch: &mut Watch,
        deadline: Instant,
        op: &str,
    ) -> Result<bool> {
        let parity = (self.calls.fetch_add(1, Ordering::Relaxed) % 2) as usize;
        let entry = self.seg.entry(self.me);
        // A new collective: whatever this rank gave up on before is history.
        entry.gave_up_on.store(0, Ordering::Release);
        entry.places[parity].store(place, Ordering::Release);
        entry.lens[parity].store(len as u64, Ordering::Release);
        self.barrier(watch, deadline, op)?;
        let mut in_place = place != NOWHERE;
        for k in 0..self.members.len() {
            let theirs = self.seg.entry(k).lens[parity].load(Ordering::Acquire);
            if theirs != len as u64 {
                return Err(DistError::Mismatch {
                    op: format!("shared-memory {op}"),
                    reason: format!(
                        "rank {} passed {theirs} values and rank {} {len}; do all ranks pass \
                         buffers of the same length?",
                        self.members[k], self.members[self.me]
                    ),
                });
            }
            in_place &= self.seg.entry(k).places[parity].load(Ordering::Acquire) == place;
        }
        Ok(in_place)
    }

    /// Sums `buf` over the group in place. With `everyone` false only the leader (local rank
    /// 0) is guaranteed the sum; the others keep partial values (a hierarchical allreduce
    /// broadcasts the final values afterwards).
    ///
    /// On a segment whose creator chose the chain, each piece instead passes from local rank 0
    /// to the last through a ring of `2n` half slots, each rank adding its values in turn, and
    /// every rank but the last copies the sum out: no barriers, values summed in rank order.
    pub fn reduce(&self, buf: &mut [f32], everyone: bool, deadline: Instant) -> Result<()> {
        let n = self.members.len();
        if n == 1 {
            return Ok(());
        }
        let mut watch = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let found = self.place_of(buf);
        let place = found.as_ref().map_or(NOWHERE, |f| f.1);
        if self.agree(buf.len(), place, &mut watch, deadline, "allreduce")?
            && let Some((shared, _, offset)) = found
        {
            return self.reduce_in_place(&shared, offset, buf, everyone, &mut watch, deadline);
        }
        if self.chain {
            return self.reduce_chain(buf, everyone, &mut watch, deadline);
        }
        let (_, piece_len) = self.seg.slot(0, 0);
        for piece in buf.chunks_mut(piece_len) {
            let half = (self.pieces.fetch_add(1, Ordering::Relaxed) % 2) as usize;
            let len = piece.len();
            let slot = |k: usize| {
                let (p, _) = self.seg.slot(k, half);
                p
            };
            // 1. The segments the others reduce, into this rank's slot.
            for k in (0..n).filter(|&k| k != self.me) {
                let (a, b) = segment(len, n, k);
                // SAFETY: this rank's slot half, written only by it, read by others after the
                // barrier below; `b <= len <= piece_len`.
                unsafe {
                    std::ptr::copy_nonoverlapping(piece[a..b].as_ptr(), slot(self.me).add(a), b - a)
                };
            }
            self.barrier(&mut watch, deadline, "allreduce")?;
            // 2. This rank's segment: its own values plus every other rank's copy.
            let (a, b) = segment(len, n, self.me);
            let mine = &mut piece[a..b];
            for k in (0..n).filter(|&k| k != self.me) {
                // SAFETY: rank k wrote this range before the barrier and does not write its
                // half again before the next piece's barrier.
                let theirs = unsafe { std::slice::from_raw_parts(slot(k).add(a), b - a) };
                add(mine, theirs);
            }
            // SAFETY: this rank's slot, its own segment (no other rank writes it).
            unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), slot(self.me).add(a), b - a) };
            self.barrier(&mut watch, deadline, "allreduce")?;
            // 3. The other segments' sums.
            if everyone || self.me == 0 {
                for k in (0..n).filter(|&k| k != self.me) {
                    let (a, b) = segment(len, n, k);
                    // SAFETY: rank k's sum of its segment, final after the barrier above.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            slot(k).add(a),
                            piece[a..b].as_mut_ptr(),
                            b - a,
                        )
                    };
                }
            }
        }
        Ok(())
    }

    /// An error when local rank `k` has left the job or died. When `k` had itself given up on
    /// a third rank before it went, the error names that rank: the one that failed first.
    fn check_alive(&self, k: usize, watch: &mut Watch, op: &str) -> Result<()> {
        let reason = if self.seg.entry(k).closed.load(Ordering::Acquire) != 0 {
            format!("it left the job during a shared-memory {op}")
        } else if let Some(why) = watch.dead(&self.seg, k) {
            why
        } else {
            return Ok(());
        };
        let first = self.seg.entry(k).gave_up_on.load(Ordering::Acquire) as usize;
        if first > 0 && first - 1 != k && first - 1 != self.me && first - 1 < self.members.len() {
            self.give_up_on(first - 1);
            return Err(DistError::PeerFailed {
                rank: self.members[first - 1],
                reason: format!(
                    "rank {} gave up waiting for it during a shared-memory {op} and is gone \
                     ({reason})",
                    self.members[k]
                ),
            });
        }
        self.give_up_on(k);
        Err(DistError::PeerFailed {
            rank: self.members[k],
            reason,
        })
    }

    /// Records in the segment that this rank gives up its collective because of local rank `k`.
    fn give_up_on(&self, k: usize) {
        self.seg
            .entry(self.me)
            .gave_up_on
            .store(k as u32 + 1, Ordering::Release);
    }

    /// Sums `buf` over the group so that member `k` ends with the sum of its segment
    /// `segment(len, n, k)` of the whole buffer (the rest of its `buf` unspecified): a
    /// reduce-scatter, each rank copying in `(n-1)/n` of the buffer and reading `(n-1)/n` of
    /// its segment, half what [`Self::reduce`] moves. In rounds: each member writes a chunk of
    /// every other member's segment into its slot half, a barrier, each member adds the
    /// others' chunks of its own segment. Consecutive rounds alternate slot halves, so one
    /// barrier per round suffices: a member writes a half again only after every member has
    /// passed the barrier that follows its reads of that half.
    pub fn reduce_scatter(&self, buf: &mut [f32], deadline: Instant) -> Result<()> {
        let n = self.members.len();
        if n == 1 {
            return Ok(());
        }
        let mut watch = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.agree_on_length(buf.len(), &mut watch, deadline, "reduce-scatter")?;
        let (_, half_len) = self.seg.slot(0, 0);
        let chunk = (half_len / n).max(1);
        let len = buf.len();
        let seg = |k: usize| segment(len, n, k);
        let longest = (0..n).map(|k| seg(k).1 - seg(k).0).max().unwrap_or(0);
        for round in 0..longest.div_ceil(chunk) {
            let half = (self.pieces.fetch_add(1, Ordering::Relaxed) % 2) as usize;
            let slot = |k: usize| self.seg.slot(k, half).0;
            let part = |k: usize| {
                let (a, b) = seg(k);
                let lo = (a + round * chunk).min(b);
                (lo, (lo + chunk).min(b))
            };
            for k in (0..n).filter(|&k| k != self.me) {
                let (a, b) = part(k);
                // SAFETY: this rank's slot half, chunk k (k * chunk + (b - a) <= n * chunk
                // <= half_len), read by others only after the barrier below.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf[a..b].as_ptr(),
                        slot(self.me).add(k * chunk),
                        b - a,
                    )
                };
            }
            self.barrier(&mut watch, deadline, "reduce-scatter")?;
            let (a, b) = part(self.me);
            for k in (0..n).filter(|&k| k != self.me) {
                // SAFETY: rank k wrote its chunk of this rank's segment before the barrier and
                // writes this half again only after the next round's barrier.
                let theirs =
                    unsafe { std::slice::from_raw_parts(slot(k).add(self.me * chunk), b - a) };
                add(&mut buf[a..b], theirs);
            }
        }
        Ok(())
    }

    /// Member `k`'s segment `segment(len, n, k)` of its `buf` copied into every other member's
    /// `buf`: an all-gather through the slots, in rounds of a half slot per member, one
    /// barrier each (the halves alternate, as in [`Self::reduce_scatter`]).
    pub fn all_gather(&self, buf: &mut [f32], deadline: Instant) -> Result<()> {
        let n = self.members.len();
        if n == 1 {
            return Ok(());
        }
        let mut watch = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.agree_on_length(buf.len(), &mut watch, deadline, "all-gather")?;
        let (_, chunk) = self.seg.slot(0, 0);
        let len = buf.len();
        let seg = |k: usize| segment(len, n, k);
        let longest = (0..n).map(|k| seg(k).1 - seg(k).0).max().unwrap_or(0);
        for round in 0..longest.div_ceil(chunk) {
            let half = (self.pieces.fetch_add(1, Ordering::Relaxed) % 2) as usize;
            let slot = |k: usize| self.seg.slot(k, half).0;
            let part = |k: usize| {
                let (a, b) = seg(k);
                let lo = (a + round * chunk).min(b);
                (lo, (lo + chunk).min(b))
            };
            let (a, b) = part(self.me);
            // SAFETY: this rank's slot half (b - a <= chunk), read by others after the barrier.
            unsafe { std::ptr::copy_nonoverlapping(buf[a..b].as_ptr(), slot(self.me), b - a) };
            self.barrier(&mut watch, deadline, "all-gather")?;
            for k in (0..n).filter(|&k| k != self.me) {
                let (a, b) = part(k);
                // SAFETY: rank k wrote this chunk before the barrier; it writes this half again
                // only after the next round's barrier.
                unsafe { std::ptr::copy_nonoverlapping(slot(k), buf[a..b].as_mut_ptr(), b - a) };
            }
        }
        Ok(())
    }

    /// Copies local rank `root`'s `buf` into every member's `buf`.
    pub fn broadcast(&self, buf: &mut [f32], root: usize, deadline: Instant) -> Result<()> {
        if self.members.len() == 1 {
            return Ok(());
        }
        let mut watch = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let found = self.place_of(buf);
        let place = found.as_ref().map_or(NOWHERE, |f| f.1);
        if self.agree(buf.len(), place, &mut watch, deadline, "broadcast")?
            && let Some((shared, _, offset)) = found
        {
            if self.me != root {
                // SAFETY: the root's buffer holds `offset + buf.len()` values (the same range
                // on every member, agreed above); the root does not write it before the
                // barrier below, which every member passes after its copy.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        shared.base(root).add(offset),
                        buf.as_mut_ptr(),
                        buf.len(),
                    )
                };
            }
            return self.barrier(&mut watch, deadline, "broadcast");
        }
        let (_, piece_len) = self.seg.slot(0, 0);
        for piece in buf.chunks_mut(piece_len) {
            let half = (self.pieces.fetch_add(1, Ordering::Relaxed) % 2) as usize;
            let (src, _) = self.seg.slot(root, half);
            if self.me == root {
                // SAFETY: the root's slot half, read by others after the barrier.
                unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), src, piece.len()) };
            }
            self.barrier(&mut watch, deadline, "broadcast")?;
            if self.me != root {
                // SAFETY: written by the root before the barrier.
                unsafe { std::ptr::copy_nonoverlapping(src, piece.as_mut_ptr(), piece.len()) };
            }
        }
        Ok(())
    }
}

impl HostGroup for LocalGroup {
    fn members(&self) -> &[usize] {
        LocalGroup::members(self)
    }

    fn reduce(&self, buf: &mut [f32], everyone: bool, deadline: Instant) -> Result<()> {
        LocalGroup::reduce(self, buf, everyone, deadline)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize, deadline: Instant) -> Result<()> {
        LocalGroup::broadcast(self, buf, root, deadline)
    }

    fn reduce_scatter(&self, buf: &mut [f32], deadline: Instant) -> Result<()> {
        LocalGroup::reduce_scatter(self, buf, deadline)
    }

    fn all_gather(&self, buf: &mut [f32], deadline: Instant) -> Result<()> {
        LocalGroup::all_gather(self, buf, deadline)
    }

    fn share(&self, len: usize, deadline: Instant) -> Result<SharedBuf> {
        LocalGroup::share(self, len, deadline)
    }
}
