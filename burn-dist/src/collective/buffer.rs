//! Buffers an allreduce sums where they lie: [`Communicator::reduce_buffer`] hands out memory
//! the ranks of a host all map (when the transport shares memory), so the host's part of an
//! allreduce of it, or of a range of it that every rank passes, reads and writes each value
//! once instead of copying it through the segment's slots (see `shm::shared`). Elsewhere it
//! is an ordinary vector, and any buffer, shared or not, gives the same sums.

use std::ops::{Deref, DerefMut};

use super::Communicator;
use crate::Result;
use crate::transport::SharedBuf;
use crate::wire::Kind;

/// A buffer from [`Communicator::reduce_buffer`]: reads and writes as a `[f32]`.
#[derive(Debug)]
pub struct ReduceBuffer(Inner);

#[derive(Debug)]
enum Inner {
    Shared(SharedBuf),
    Owned(Vec<f32>),
}

impl ReduceBuffer {
    /// Whether the host's ranks map this buffer (its allreduce runs in place).
    pub fn is_shared(&self) -> bool {
        matches!(self.0, Inner::Shared(_))
    }
}

impl Deref for ReduceBuffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.0 {
            Inner::Shared(b) => b,
            Inner::Owned(v) => v,
        }
    }
}

impl DerefMut for ReduceBuffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.0 {
            Inner::Shared(b) => b,
            Inner::Owned(v) => v,
        }
    }
}

impl Communicator {
    /// A buffer of `len` zeros for this communicator's allreduces: in memory every rank of
    /// this host maps when the transport shares memory, so [`Communicator::allreduce`] of it
    /// (or of the same range of it on every rank) sums in place, each value read and written
    /// once; an ordinary vector otherwise. A collective: every rank calls it, with the same
    /// length, in the same order as its other collectives. Each call makes new buffers for the
    /// host; the previous ones stay valid but are reduced by copying, as any other memory is.
    pub fn reduce_buffer(&self, len: usize) -> Result<ReduceBuffer> {
        let local = (self.kind == Kind::Collective)
            .then(|| self.transport.topology().and_then(|t| t.local.clone()))
            .flatten()
            .filter(|l| l.members().len() > 1);
        Ok(ReduceBuffer(match local {
            Some(l) => Inner::Shared(l.share(len, self.deadline())?),
            None => Inner::Owned(vec![0.0; len]),
        }))
    }
}
