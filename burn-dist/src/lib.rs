//! # burn-dist
//!
//! Distributed training for Burn on CPU and wgpu devices, across processes and machines, over
//! QUIC. Burn's own data parallelism (`ExecutionStrategy::ddp`) runs only on CUDA inside one
//! machine through NCCL; this crate is how Hearth trains everywhere else.
//!
//! **Status: skeleton.** The layout below is the plan (see `ARCHITECTURE.md` and
//! `../shared/DESIGN.md`); the modules arrive with the distributed-training issue:
//!
//! - `transport`: a `Transport` trait (framed messages to a rank, with deadlines), with an
//!   in-memory implementation for tests and a QUIC (quinn) one.
//! - `wire`: the frame (magic, version, kind, membership epoch, sequence, length) and a decoder
//!   that never panics on bad bytes.
//! - `rendezvous`: rank discovery from `HEARTH_*`, torchrun, Slurm and Open MPI variables.
//! - `collective`: ring allreduce, broadcast, all-gather, reduce-scatter, barrier on flat `f32`.
//! - `bucket`, `ddp`, `ps`, `pipeline`, `elastic`: data parallel, parameter servers, model
//!   parallel, elastic membership.
//!
//! The crate knows nothing about images or models: it moves flat buffers.

/// Errors of burn-dist.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A feature of the plan above that is not built yet.
    #[error("burn-dist: {0} is not implemented yet")]
    NotImplemented(&'static str),
}
