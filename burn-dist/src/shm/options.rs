//! The shared-memory settings ([`ShmOptions`]) and what they depend on, below the pipes, the
//! reductions and the setup that read them.

use std::time::Duration;

/// Shared-memory settings.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    pub enabled: bool,
    pub ring_bytes: usize,
    /// Each rank's reduction slot in bytes; 0 lets [`ShmOptions::slot_bytes_for`] choose by
    /// the number of ranks on the host.
    pub slot_bytes: usize,
    /// The allreduce as a chain ([`super::reduce`]): `Some` forces it on or off; `None` lets
    /// [`ShmOptions::chain_for`] choose by the number of ranks on the host.
    pub chain: Option<bool>,
    pub stale: Duration,
    pub max_frame_bytes: usize,
    pub frame_timeout: Duration,
}

impl Default for ShmOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            ring_bytes: 4 << 20,
            slot_bytes: 0,
            chain: None,
            stale: Duration::from_secs(8),
            max_frame_bytes: 256 << 20,
            frame_timeout: Duration::from_secs(120),
        }
    }
}

impl ShmOptions {
    /// The slot size a segment for `ranks` ranks gets: `slot_bytes` when set, else 1 MiB, or
    /// 256 KiB when the ranks outnumber this host's cores. Only the segment's creator calls
    /// it; the others read the size from the segment's header, so the ranks always agree.
    ///
    /// Small pieces stay in cache between the copy in, the reduction and the copy out: 100 MB
    /// over 2 ranks took 10.8 ms with 1 MiB slots, 17 ms with 8 MiB, 32 ms with 64 MiB. With
    /// two ranks per core the two share a cache, and 256 KiB slots took 38.8-39.4 ms for 4
    /// ranks on 2 cores against 1 MiB's 42.5-42.9 (BENCHMARKS.md).
    pub fn slot_bytes_for(&self, ranks: usize) -> usize {
        if self.slot_bytes > 0 {
            return self.slot_bytes;
        }
        if outnumber_cores(ranks) {
            256 << 10
        } else {
            1 << 20
        }
    }

    /// Whether a segment for `ranks` ranks runs its allreduce as a chain: `chain` when set,
    /// else when the ranks outnumber this host's cores. Only the creator calls it and records
    /// the answer in the segment, so the ranks always agree.
    ///
    /// A chain passes each piece from rank to rank without barriers, so a rank that holds a
    /// core works through every piece it can before it sleeps; with more ranks than cores the
    /// two barriers per piece of the other path cost a context switch each.
    pub fn chain_for(&self, ranks: usize) -> bool {
        self.chain.unwrap_or_else(|| outnumber_cores(ranks))
    }
}

/// Whether `ranks` ranks outnumber this host's cores (one core when the count is unknown).
pub(crate) fn outnumber_cores(ranks: usize) -> bool {
    ranks > std::thread::available_parallelism().map_or(1, |c| c.get())
}
