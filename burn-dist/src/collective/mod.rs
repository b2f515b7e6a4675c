//! Collectives on flat `f32` buffers over any [`Transport`].
//!
//! Every rank calls the same collectives in the same order; a per-communicator sequence number
//! tags each call, so the messages of consecutive collectives never mix. One file per algorithm:
//! [`allreduce`] (ring: reduce-scatter then all-gather, chunked and pipelined), [`broadcast`]
//! (pipelined chain from the root), [`gather`] (all-gather, reduce-scatter), [`barrier`], and
//! [`hierarchical`] (allreduce through shared memory within a host, which `allreduce` picks
//! by itself when the transport has some), summing in place the [`buffer`]s it hands out. Beside them, [`cost`]: what they cost, as a model
//! fitted to measured times.

pub mod allreduce;
pub mod barrier;
pub mod broadcast;
pub mod buffer;
pub mod cost;
pub mod gather;
mod halves;
pub mod hierarchical;
mod ring;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::transport::{Payload, Transport};
use crate::wire::{Kind, WireError};
use crate::{DistError, Result};

/// How `f32` values travel in reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Compression {
    /// Exact `f32`.
    #[default]
    None,
    /// bfloat16 (half the bytes, `f32`'s range, 8 bits of mantissa).
    Bf16,
    /// IEEE half precision (half the bytes, range +-65504).
    Fp16,
}

impl Compression {
    fn bytes_per_value(self) -> usize {
        match self {
            Compression::None => 4,
            _ => 2,
        }
    }

    pub(crate) fn encode(self, v: &[f32]) -> Vec<u8> {
        // Fixed-size chunks the compiler turns into straight copies (no per-value pushes).
        let w = self.bytes_per_value();
        #[cfg(target_endian = "little")]
        if self == Compression::None {
            // f32s in memory are their little-endian bytes: one copy, no zero-fill first.
            // SAFETY: any initialised memory is valid as u8, and the length is the slice's.
            let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) };
            return bytes.to_vec();
        }
        let mut out = vec![0u8; v.len() * w];
        match self {
            Compression::None => {
                for (o, x) in out.chunks_exact_mut(4).zip(v) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
            Compression::Bf16 => halves::encode_bf16(v, &mut out),
            Compression::Fp16 => halves::encode_f16(v, &mut out),
        }
        out
    }

    /// Decodes `bytes` into `out` with `f(out_value, wire_value)`.
    pub(crate) fn decode_with(
        self,
        bytes: &[u8],
        out: &mut [f32],
        f: impl Fn(&mut f32, f32),
    ) -> std::result::Result<(), WireError> {
        let w = self.bytes_per_value();
        if bytes.len() != out.len() * w {
            return Err(WireError::Length {
                expected: (out.len() * w) as u64,
                got: bytes.len() as u64,
            });
        }
        match self {
            Compression::None => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    f(o, f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                }
            }
            Compression::Bf16 => halves::decode_bf16(bytes, out, f),
            Compression::Fp16 => halves::decode_f16(bytes, out, f),
        }
        Ok(())
    }

    /// [`Compression::decode_with`] over a payload in pieces, which may split a value.
    pub(crate) fn decode_payload_with(
        self,
        payload: &Payload,
        out: &mut [f32],
        f: impl Fn(&mut f32, f32),
    ) -> std::result::Result<(), WireError> {
        let w = self.bytes_per_value();
        if payload.len() != out.len() * w {
            return Err(WireError::Length {
                expected: (out.len() * w) as u64,
                got: payload.len() as u64,
            });
        }
        let (mut i, mut carry, mut have) = (0usize, [0u8; 4], 0usize);
        for mut piece in payload.pieces() {
            if have > 0 {
                let take = (w - have).min(piece.len());
                carry[have..have + take].copy_from_slice(&piece[..take]);
                have += take;
                piece = &piece[take..];
                if have < w {
                    continue;
                }
                self.decode_with(&carry[..w], &mut out[i..i + 1], &f)?;
                i += 1;
            }
            let whole = piece.len() / w * w;
            self.decode_with(&piece[..whole], &mut out[i..i + whole / w], &f)?;
            i += whole / w;
            let rest = &piece[whole..];
            carry[..rest.len()].copy_from_slice(rest);
            have = rest.len();
        }
        Ok(())
    }

    /// Rounds values to what the wire carries (so every rank ends with identical values).
    pub(crate) fn round(self, v: &mut [f32]) {
        match self {
            Compression::None => {}
            Compression::Bf16 => halves::round_bf16(v),
            Compression::Fp16 => halves::round_f16(v),
        }
    }
}

impl Compression {
    /// Every value, in the order the command line lists them.
    pub const ALL: &'static [Compression] =
        &[Compression::None, Compression::Bf16, Compression::Fp16];

    /// The value named `name` (ASCII case ignored), as [`Compression::name`] spells it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|c| c.name().eq_ignore_ascii_case(name))
    }

    /// The name the command line uses for it.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
            Compression::Fp16 => "fp16",
        }
    }
}

/// Sum or mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
}

/// How long a collective waits for a peer by default (`HEARTH_COLLECTIVE_TIMEOUT` through
/// [`Communicator::from_env`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Pipelining granularity in values by default: 1 MiB of `f32` (`HEARTH_CHUNK_KB` through
/// [`Communicator::from_env`]).
pub const DEFAULT_CHUNK_ELEMS: usize = 256 * 1024;

/// A rank's handle on the collectives of one world.
pub struct Communicator {
    transport: Arc<dyn Transport>,
    seq: AtomicU64,
    timeout: Duration,
    chunk_elems: usize,
    compression: Compression,
    kind: Kind,
    /// The host leaders' communicator of a hierarchical allreduce (see [`hierarchical`]).
    leaders: OnceLock<Box<Communicator>>,
}

impl Communicator {
    pub fn new(transport: Arc<dyn Transport>) -> Self {
        Self {
            transport,
            seq: AtomicU64::new(0),
            timeout: DEFAULT_TIMEOUT,
            chunk_elems: DEFAULT_CHUNK_ELEMS,
            compression: Compression::None,
            kind: Kind::Collective,
            leaders: OnceLock::new(),
        }
    }

    /// Frame kind of this communicator's data (default [`Kind::Collective`]). Two communicators
    /// of different kinds over one transport never see each other's messages, so they may run
    /// at the same time from different threads (metric averaging beside gradient traffic).
    pub fn with_kind(mut self, kind: Kind) -> Self {
        self.kind = kind;
        self
    }

    /// The frame kind of this communicator's data.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Another communicator on the same transport and settings, with its own kind and sequence.
    pub fn sibling(&self, kind: Kind) -> Self {
        Self {
            transport: self.transport.clone(),
            seq: AtomicU64::new(0),
            timeout: self.timeout,
            chunk_elems: self.chunk_elems,
            compression: self.compression,
            kind,
            leaders: OnceLock::new(),
        }
    }

    /// Longest wait for one message of a collective (default 120 s, or
    /// `HEARTH_COLLECTIVE_TIMEOUT` seconds). A failed peer is reported sooner, when the transport
    /// notices (QUIC: its idle timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Pipelining granularity in values (default 256 Ki values = 1 MiB of `f32`).
    pub fn with_chunk_elems(mut self, n: usize) -> Self {
        self.chunk_elems = n.max(1);
        self
    }

    /// Wire format of reductions (default exact `f32`).
    pub fn with_compression(mut self, c: Compression) -> Self {
        self.compression = c;
        self
    }

    /// The wire format of this communicator's reductions.
    pub fn compression(&self) -> Compression {
        self.compression
    }

    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    pub fn world(&self) -> usize {
        self.transport.world()
    }

    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    pub(crate) fn next_op(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }

    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    pub(crate) fn send(&self, to: usize, tag: u64, payload: Vec<u8>) -> Result<()> {
        self.transport.send(to, self.kind, tag, payload)
    }

    pub(crate) fn recv(&self, from: usize, tag: u64, op: &str) -> Result<Vec<u8>> {
        self.recv_payload(from, tag, op).map(Payload::into_vec)
    }

    pub(crate) fn recv_payload(&self, from: usize, tag: u64, op: &str) -> Result<Payload> {
        self.transport
            .recv_payload(from, self.kind, tag, self.deadline())
            .map_err(|e| match e {
                DistError::Timeout { rank, after, .. } => DistError::Timeout {
                    op: op.to_string(),
                    rank,
                    after,
                },
                e => e,
            })
    }
}

/// Tag of message `chunk` of `step` of operation `op`.
pub(crate) fn tag(op: u64, step: usize, chunk: usize) -> u64 {
    (op << 32) | ((step as u64 & 0xFFFF) << 16) | (chunk as u64 & 0xFFFF)
}

#[cfg(test)]
pub(crate) mod tests;
