//! # burn-dist
//!
//! Distributed training for Burn on CPU and wgpu devices, across processes and machines, over
//! QUIC. Burn's own data parallelism runs only on CUDA inside one machine through NCCL; this
//! crate is how Hearth trains everywhere else. It knows nothing about images or models: it moves
//! flat `f32` buffers.
//!
//! The modules, bottom up: each uses only those above it in this list.
//!
//! - [`wire`]: the frame (magic, version, kind, membership epoch, sequence, length) and a decoder
//!   that never panics on bad bytes.
//! - [`tls`]: job membership: certificates derived from a job secret, or a CA the user gives.
//! - [`transport`]: the [`Transport`] trait (framed messages to a rank, with deadlines) and the
//!   [`transport::Topology`] a transport reports; beside it, each over the trait alone, an
//!   in-memory transport for tests, a QUIC one (quinn, TLS always on) and [`shm`], shared
//!   memory between the ranks of one host (pipes and in-place allreduce).
//! - [`routed`]: a job rank's transport, QUIC or shared memory chosen per peer.
//! - [`rendezvous`]: ranks from `HEARTH_*`, torchrun, Slurm or Open MPI variables; rank 0
//!   coordinates, then the links become a [`routed::RoutedTransport`].
//! - [`collective`]: ring allreduce, broadcast, all-gather, reduce-scatter, barrier on `f32`.
//! - [`bucket`]: fusion buffers for gradients in one fixed order.
//! - [`overlap`]: the gradient exchange overlapped with the backward pass: buckets reduced on a
//!   thread of their own as the gradients are handed over.
//! - [`flat`]: a model as one flat vector of named tensors: its cut into shards, a Burn
//!   module's trainable values and gradients as that vector, the optimizers as loops over it.
//! - [`zero`]: data parallel's sharded optimizer (ZeRO stages 1 and 2), its state as whole
//!   named vectors any world size reads.
//! - [`ps`]: parameter servers (sharded; sync, DOWNPOUR, ADAG, DynSGD, EASGD; staleness bound).
//! - [`ddp`]: data parallel for Burn modules: parameter broadcast, bucketed gradient averaging,
//!   and a burn-train `SupervisedLearningStrategy`.
//! - [`env`](mod@env): the edge, above everything: every `HEARTH_*` variable, read into the options
//!   (`RendezvousOptions::from_env`, `Communicator::from_env`, ...). No other module reads the
//!   environment; options built by hand are what they say.
//!
//! ```
//! use std::sync::Arc;
//! use burn_dist::collective::{Communicator, ReduceOp};
//! use burn_dist::transport::memory::MemoryTransport;
//!
//! // Two ranks as threads; with QUIC, `rendezvous::connect` gives the transport instead.
//! let handles: Vec<_> = MemoryTransport::mesh(2)
//!     .into_iter()
//!     .map(|t| std::thread::spawn(move || {
//!         let comm = Communicator::new(Arc::new(t));
//!         let mut grads = vec![comm.rank() as f32 + 1.0; 4];
//!         comm.allreduce(&mut grads, ReduceOp::Mean).unwrap();
//!         grads
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![1.5; 4]);
//! }
//! ```

pub mod bucket;
pub mod collective;
pub mod ddp;
pub mod elastic;
pub mod env;
mod error;
pub mod flat;
#[doc(hidden)]
pub mod fuzz;
mod grads;
pub mod overlap;
pub mod pipeline;
pub mod ps;
pub mod rendezvous;
pub mod room;
pub mod routed;
pub mod secret;
pub mod shm;
mod split;
pub mod tls;
pub mod transport;
pub mod wire;
pub mod zero;

pub use collective::buffer::ReduceBuffer;
pub use collective::{Communicator, Compression, ReduceOp};
pub use error::{DistError, Result};
pub use transport::Transport;
