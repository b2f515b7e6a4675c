//! The messages between workers and servers (`Kind::Ps`): a worker's request under tag
//! [`REQUEST`], the server's answer under [`REPLY`]. Every field is checked on decoding; a
//! malformed request is answered with a refusal and its sender dropped.

use crate::wire::{Reader, Writer, bytes_to_f32, f32_to_bytes};
use crate::{DistError, Result};

pub const REQUEST: u64 = 1;
pub const REPLY: u64 = 2;

/// What a worker asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The shard's current values.
    Pull = 1,
    /// A gradient for the synchronous round (answered once every worker pushed).
    PushGrad = 2,
    /// A change to add by the mode's rule (answered with the values after it).
    PushDelta = 3,
    /// The worker is finished; no answer.
    Done = 4,
    /// The values and version, for a checkpoint.
    Snapshot = 5,
}

impl Op {
    fn from_u64(v: u64) -> Option<Op> {
        Some(match v {
            1 => Op::Pull,
            2 => Op::PushGrad,
            3 => Op::PushDelta,
            4 => Op::Done,
            5 => Op::Snapshot,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub op: Op,
    /// Steps the worker has taken.
    pub clock: u64,
    /// The shard's version the worker last received.
    pub version: u64,
    /// Samples behind a gradient (its weight in the synchronous mean).
    pub samples: u64,
    pub values: Vec<f32>,
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default()
            .u64(self.op as u64)
            .u64(self.clock)
            .u64(self.version)
            .u64(self.samples)
            .bytes;
        w.extend_from_slice(&f32_to_bytes(&self.values));
        w
    }

    /// A request whose values, if any, must be `shard_len` long.
    pub fn decode(b: &[u8], shard_len: usize) -> Result<Self> {
        let mut r = Reader::new(b);
        let op = r.u64()?;
        let op = Op::from_u64(op)
            .ok_or_else(|| DistError::Config(format!("unknown parameter-server request {op}")))?;
        let (clock, version, samples) = (r.u64()?, r.u64()?, r.u64()?);
        let rest = r.rest();
        let values = match op {
            Op::PushGrad | Op::PushDelta => bytes_to_f32(rest, shard_len)?,
            _ if rest.is_empty() => Vec::new(),
            _ => {
                return Err(DistError::Config(format!(
                    "a {op:?} request carries {} unexpected bytes",
                    rest.len()
                )));
            }
        };
        Ok(Self {
            op,
            clock,
            version,
            samples,
            values,
        })
    }
}

/// A server's answer: the shard's values at `version`, or a refusal.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Values { version: u64, values: Vec<f32> },
    Refused(String),
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Values { version, values } => Reply::values_bytes(*version, values),
            Reply::Refused(why) => Writer::default().u64(1).string(why).bytes,
        }
    }

    /// The bytes of `Reply::Values` without building one (the server's answers).
    pub fn values_bytes(version: u64, values: &[f32]) -> Vec<u8> {
        let mut w = Writer::default().u64(0).u64(version).bytes;
        w.extend_from_slice(&f32_to_bytes(values));
        w
    }

    pub fn decode(b: &[u8], shard_len: usize) -> Result<Self> {
        let mut r = Reader::new(b);
        match r.u64()? {
            0 => {
                let version = r.u64()?;
                let values = bytes_to_f32(r.rest(), shard_len)?;
                Ok(Reply::Values { version, values })
            }
            1 => {
                let why = r.string()?;
                r.finish()?;
                Ok(Reply::Refused(why))
            }
            other => Err(DistError::Config(format!(
                "unknown parameter-server reply {other}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let q = Request {
            op: Op::PushDelta,
            clock: 3,
            version: 9,
            samples: 16,
            values: vec![1.0, -2.5],
        };
        assert_eq!(Request::decode(&q.encode(), 2).unwrap(), q);
        assert!(
            Request::decode(&q.encode(), 3).is_err(),
            "wrong shard length"
        );
        assert!(Request::decode(&[1, 2, 3], 2).is_err());
        let mut bad = q.encode();
        bad[0] = 42;
        assert!(Request::decode(&bad, 2).is_err());
        let a = Reply::Values {
            version: 4,
            values: vec![0.5; 3],
        };
        assert_eq!(Reply::decode(&a.encode(), 3).unwrap(), a);
        let no = Reply::Refused("no".into());
        assert_eq!(Reply::decode(&no.encode(), 3).unwrap(), no);
        assert!(Reply::decode(&[9; 20], 3).is_err());
    }
}
