//! Which ranks share memory with which: what a transport tells the collectives so that
//! allreduce reduces within each host first and runs the ring only among one rank per host.
//!
//! The transport layer defines the shape; the shared-memory transport ([`crate::shm`]) fills
//! it in with its [`HostGroup`] (an in-place reduction in a segment), so the collectives above
//! never name the shared-memory module.

use std::sync::Arc;
use std::time::Instant;

use crate::Result;

/// The ranks of one host as a group for in-place collectives.
pub trait HostGroup: Send + Sync {
    /// The group's job ranks, ascending; the first is the host's leader.
    fn members(&self) -> &[usize];
    /// Sums `buf` across the group: into every member's `buf` when `everyone`, else into the
    /// leader's only.
    fn reduce(&self, buf: &mut [f32], everyone: bool, deadline: Instant) -> Result<()>;
    /// Copies the `root` member's (local index) `buf` into every other member's.
    fn broadcast(&self, buf: &mut [f32], root: usize, deadline: Instant) -> Result<()>;
    /// Member `k` (local index) ends with the group's sum of `buf`'s segment `k` of `n`
    /// near-equal segments (`split::segment`); the rest of its `buf` is unspecified.
    fn reduce_scatter(&self, buf: &mut [f32], deadline: Instant) -> Result<()>;
    /// Member `k`'s segment `k` of `buf` into every other member's `buf`.
    fn all_gather(&self, buf: &mut [f32], deadline: Instant) -> Result<()>;
    /// A buffer of `len` zeros that every member can reach, so that [`HostGroup::reduce`] and
    /// [`HostGroup::broadcast`] of a range of it that every member passes (the same offset
    /// in each member's latest shared buffer) run in place instead of through copies. A
    /// collective: every member calls it with the same length.
    fn share(&self, len: usize, deadline: Instant) -> Result<SharedBuf>;
}

/// A buffer a [`HostGroup`] made with [`HostGroup::share`]: this member's part of memory the
/// whole group maps. It reads and writes as a slice; the group's members write into it only
/// inside the collectives it (or a range of it) is passed to.
pub struct SharedBuf {
    ptr: *mut f32,
    len: usize,
    _mapping: Arc<dyn Send + Sync>,
}

// The memory is this member's alone outside the collectives that borrow it mutably.
unsafe impl Send for SharedBuf {}
unsafe impl Sync for SharedBuf {}

impl SharedBuf {
    /// # Safety
    /// `ptr` points to `len` initialised `f32`s, writable and valid as long as `mapping` lives,
    /// that nobody else writes except inside a collective this buffer is passed to.
    pub unsafe fn new(ptr: *mut f32, len: usize, mapping: Arc<dyn Send + Sync>) -> SharedBuf {
        SharedBuf {
            ptr,
            len,
            _mapping: mapping,
        }
    }
}

impl std::ops::Deref for SharedBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: by `new`'s contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for SharedBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: by `new`'s contract; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for SharedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuf({} values)", self.len)
    }
}

/// For every job rank, the lowest rank of its shared-memory group (itself when it has none),
/// and this rank's group.
pub struct Topology {
    pub leaders: Vec<usize>,
    pub local: Option<Arc<dyn HostGroup>>,
    /// The distinct leaders, ascending (computed once: every allreduce asks).
    group_leaders: Vec<usize>,
}

impl Topology {
    pub fn new(leaders: Vec<usize>, local: Option<Arc<dyn HostGroup>>) -> Topology {
        let mut group_leaders = leaders.clone();
        group_leaders.sort_unstable();
        group_leaders.dedup();
        Topology {
            leaders,
            local,
            group_leaders,
        }
    }

    /// The distinct group leaders, ascending: one rank per host that shares memory.
    pub fn group_leaders(&self) -> &[usize] {
        &self.group_leaders
    }

    /// Whether any ranks share memory at all.
    pub fn shares_memory(&self) -> bool {
        self.group_leaders.len() < self.leaders.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaders_are_distinct_and_sharing_is_seen() {
        let t = Topology::new(vec![0, 0, 2, 2, 4], None);
        assert_eq!(t.group_leaders(), &[0, 2, 4]);
        assert!(t.shares_memory());
        let alone = Topology::new(vec![0, 1, 2], None);
        assert!(!alone.shares_memory());
    }
}
