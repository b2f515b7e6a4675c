//! The in-place collectives on buffers every member maps (see `shm::shared`): making the
//! buffers ([`LocalGroup::share`]), finding whether a buffer is one of them, and the allreduce
//! that sums where the values lie instead of through the slots.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::segment::Watch;
use super::super::shared::{self, Shared};
use super::LocalGroup;
use crate::transport::SharedBuf;
use crate::{DistError, Result};

/// Values the in-place allreduce sums at a time, in registers (one AVX-512 register, two AVX2
/// or four SSE ones).
const LANES: usize = 16;

/// Values `lo..hi` of every buffer in `srcs` summed in their order, the sum written into every
/// buffer in `outs`: one pass, each value read once and each sum written once, `LANES` values
/// at a time in registers. Summing a cache-sized piece into a scratch buffer, then copying it
/// out, took 1.3-1.9x as long (4 and 2 ranks, 100 MB; BENCHMARKS.md): four more passes over
/// the scratch.
///
/// # Safety
/// Every pointer is valid for reads (`srcs`) or writes (`outs`) of `hi` values, and nothing
/// else reads or writes `lo..hi` of them meanwhile.
unsafe fn sum_across(srcs: &[*mut f32], outs: &[*mut f32], lo: usize, hi: usize) {
    let Some((first, rest)) = srcs.split_first() else {
        return;
    };
    let mut i = lo;
    // SAFETY (all blocks below): in bounds by the contract; `[f32; LANES]` has `f32`'s
    // alignment.
    while i + LANES <= hi {
        let mut sum = unsafe { first.add(i).cast::<[f32; LANES]>().read() };
        for p in rest {
            let x = unsafe { p.add(i).cast::<[f32; LANES]>().read() };
            sum.iter_mut().zip(x).for_each(|(s, v)| *s += v);
        }
        for p in outs {
            unsafe { p.add(i).cast::<[f32; LANES]>().write(sum) };
        }
        i += LANES;
    }
    while i < hi {
        let mut sum = unsafe { first.add(i).read() };
        for p in rest {
            sum += unsafe { p.add(i).read() };
        }
        for p in outs {
            unsafe { p.add(i).write(sum) };
        }
        i += 1;
    }
}

impl LocalGroup {
    /// Where `buf` lies in this rank's latest shared buffer, if it does: the buffers, the
    /// place to announce and the offset.
    pub(super) fn place_of(&self, buf: &[f32]) -> Option<(Arc<Shared>, u64, usize)> {
        let shared = self
            .shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        let (place, offset) = shared.place_of(self.me, buf)?;
        Some((shared, place, offset))
    }

    /// Makes every member's shared buffer of `len` values (module `shm::shared`): each
    /// member creates its file, maps every member's, and removes its own once all have mapped
    /// it. A failure on any member (a full `/dev/shm`, a file that is not what it should be)
    /// is an error on every member, naming the rank it happened on. The buffers replace the
    /// previous ones as the ones collectives run in place on; earlier buffers stay valid memory
    /// (reduced through the slots).
    pub fn share(&self, len: usize, deadline: Instant) -> Result<SharedBuf> {
        let n = self.members.len();
        let mut watch = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.agree_on_length(len, &mut watch, deadline, "buffer sharing")?;
        let generation = self.shares.fetch_add(1, Ordering::Relaxed) + 1;
        let name = self.seg.name();
        let paths: Vec<_> = (0..n)
            .map(|k| {
                let e = self.seg.entry(k);
                shared::path_for(
                    &name,
                    e.pid.load(Ordering::Relaxed),
                    e.start_time.load(Ordering::Relaxed),
                    generation,
                    k,
                )
            })
            .collect();
        let mine = &paths[self.me];
        let entry = self.seg.entry(self.me);
        let made = shared::create(mine, len);
        let created = made.is_ok();
        if created {
            entry.sharing.store(4 * generation + 1, Ordering::Release);
        }
        let stage = |want: u64, what: &str, watch: &mut Watch| -> Result<()> {
            self.barrier(watch, deadline, "buffer sharing")?;
            match (0..n).find(|&k| {
                self.seg.entry(k).sharing.load(Ordering::Acquire) < 4 * generation + want
            }) {
                Some(k) => Err(DistError::PeerFailed {
                    rank: self.members[k],
                    reason: format!("it could not {what} (its own error says why)"),
                }),
                None => Ok(()),
            }
        };
        // Every member comes to both barriers whatever happened before them (a member that
        // failed arrives too), so each ends at the same point with the same verdict.
        let all_made = stage(1, "create its shared buffer", &mut watch);
        let shared = made.and(all_made).and_then(|()| {
            let mapped = shared::map_all(&paths, len, generation);
            if mapped.is_ok() {
                entry.sharing.store(4 * generation + 2, Ordering::Release);
            }
            let all = stage(2, "map every rank's shared buffer", &mut watch);
            let mapped = mapped?;
            all.map(|()| mapped)
        });
        // Every member that got here has mapped it, or given up: the name is no longer needed
        // (and a file this member did not make is not its to remove).
        if created {
            let _ = std::fs::remove_file(mine);
        }
        let shared = Arc::new(shared?);
        let me = shared.base(self.me);
        *self.shared.lock().unwrap_or_else(|e| e.into_inner()) = Some(shared.clone());
        // SAFETY: this member's mapping of `len` values (zeros: a new file), kept by `shared`;
        // peers write it only inside collectives it is passed to.
        Ok(unsafe { SharedBuf::new(me, shared.len(), shared) })
    }

    /// [`Self::reduce`] of the same range of every member's shared buffer, in place: this
    /// member sums its segment of the range over every member's buffer in one pass (in rank
    /// order, `((x0 + x1) + x2) + ...`, as the chain does), and writes the sum into every
    /// member's buffer (into the leader's only, when not `everyone`); a barrier then marks
    /// every sum written. Each value of every buffer is read once and written once, and no
    /// value is copied through the slots. Every segment is summed by one member, so every
    /// member ends with identical values. The barrier at the call's start (where the members
    /// agreed on the range) orders every member's writes of its values before these reads;
    /// the one at the end orders the sums before anyone uses or refills its buffer.
    ///
    /// Members taking pieces from a shared counter instead of a segment each (so that ranks
    /// holding a core do all the work) was slower with 4 ranks on 2 cores: 14.5-15.6 ms
    /// against 13.9-14.4 for 100 MB, alternating runs of an earlier version that summed through
    /// a scratch piece (BENCHMARKS.md).
    pub(super) fn reduce_in_place(
        &self,
        shared: &Shared,
        offset: usize,
        buf: &mut [f32],
        everyone: bool,
        watch: &mut Watch,
        deadline: Instant,
    ) -> Result<()> {
        let n = self.members.len();
        let len = buf.len();
        // Segment bounds on 64-byte steps of the range, so neighbours rarely share a line.
        let cut = |k: usize| if k >= n { len } else { (len / n * k) & !15 };
        let (a, b) = (cut(self.me), cut(self.me + 1));
        let mine = buf.as_mut_ptr();
        // Every member's copy of the range; this member's own through `buf`.
        let at: Vec<*mut f32> = (0..n)
            .map(|k| {
                if k == self.me {
                    mine
                } else {
                    // SAFETY: member k's buffer holds `offset + len` values (agreed range).
                    unsafe { shared.base(k).add(offset) }
                }
            })
            .collect();
        let outs = if everyone { &at[..] } else { &at[..1] };
        // SAFETY: [a, b) lies in this member's segment of the agreed range, which every buffer
        // holds: between the two barriers no other member reads or writes it.
        unsafe { sum_across(&at, outs, a, b) };
        self.barrier(watch, deadline, "allreduce")
    }
}
