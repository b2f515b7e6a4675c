//! A model as one flat `f32` vector of named tensors, below the modes that shard it: the
//! parameter servers ([`crate::ps`]) and the sharded optimizer of data parallel
//! ([`crate::zero`]).
//!
//! - [`layout`]: the named tensors and their cut into contiguous shards balanced by bytes.
//! - [`module`]: a Burn module's trainable tensors (and their gradients) as that vector, and
//!   back.
//! - [`optim`]: SGD with momentum, Adam, AdamW and LARS as loops over a slice of it,
//!   operation for operation as burn-optim (and Hearth's LARS) compute them.

pub mod layout;
pub mod module;
pub mod optim;
