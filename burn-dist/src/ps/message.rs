//! The messages between workers and servers (`Kind::Ps`): a worker's request under tag
//! [`REQUEST`], the server's answer under [`REPLY`]; a shard's whole state ([`ShardState`])
//! from the lead worker to its server under [`INIT`] and back at the end under [`FINAL`]. Every
//! field is checked on decoding; a malformed request is answered with a refusal and its sender
//! dropped. Tags from [`APP_TAGS`] up are left to the application on `Kind::Ps`.

use crate::wire::{Reader, Writer, bytes_to_f32, f32_to_bytes};
use crate::{DistError, Result};

pub const REQUEST: u64 = 1;
pub const REPLY: u64 = 2;
/// The lead worker gives a server its shard's starting state.
pub const INIT: u64 = 3;
/// A server gives the lead worker its shard's final state once every worker is done.
pub const FINAL: u64 = 4;
/// Sync, between servers: a server's round is ready, with the workers whose gradients it
/// holds, or its session is over ([`RoundSet::last`]) ([`RoundSet`], to the first server).
pub const ROUND_READY: u64 = 5;
/// Sync, between servers: the workers whose gradients every shard holds, which each applies
/// ([`RoundSet`], from the first server).
pub const ROUND_COMMIT: u64 = 6;
/// Sync with gradient clipping, between servers: a server's sum of the squares of its shard
/// of the round's mean gradient ([`RoundNorm`], to the first server).
pub const ROUND_NORM: u64 = 7;
/// Sync with gradient clipping: the sum over every shard ([`RoundNorm`], from the first
/// server), the squared global norm each server clips by.
pub const ROUND_TOTAL: u64 = 8;
/// The first tag the parameter servers do not use.
pub const APP_TAGS: u64 = 100;

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
    /// A checkpoint's first phase: stop applying pushes (they wait) and answer with the pushes
    /// applied so far per worker.
    Freeze = 5,
    /// Second phase: apply the waiting pushes up to the cut (per worker, the most any shard has
    /// applied) and answer with the shard's state at exactly that cut.
    Cut = 6,
    /// Last phase: apply what waited and go on.
    Thaw = 7,
}

impl Op {
    fn from_u64(v: u64) -> Option<Op> {
        Some(match v {
            1 => Op::Pull,
            2 => Op::PushGrad,
            3 => Op::PushDelta,
            4 => Op::Done,
            5 => Op::Freeze,
            6 => Op::Cut,
            7 => Op::Thaw,
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
    /// `Cut`: per worker rank, the pushes the shard's state must contain.
    pub cut: Vec<(u64, u64)>,
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
        if self.op == Op::Cut {
            w.extend(encode_pairs(&self.cut));
        }
        w
    }

    /// A request whose values, if any, must be `shard_len` long.
    pub fn decode(b: &[u8], shard_len: usize) -> Result<Self> {
        let mut r = Reader::new(b);
        let op = r.u64()?;
        let op = Op::from_u64(op)
            .ok_or_else(|| DistError::Config(format!("unknown parameter-server request {op}")))?;
        let (clock, version, samples) = (r.u64()?, r.u64()?, r.u64()?);
        let mut cut = Vec::new();
        if op == Op::Cut {
            cut = decode_pairs(&mut r)?;
            r.finish()?;
        }
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
            cut,
        })
    }
}

/// A synchronous round's number (the shards' version) and a set of worker ranks: what a server
/// holds ([`ROUND_READY`]) or what every server applies ([`ROUND_COMMIT`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundSet {
    pub round: u64,
    pub workers: Vec<u64>,
    /// The sender's session is over (it has no live worker left): it holds nothing now and
    /// sends nothing more.
    pub last: bool,
}

impl RoundSet {
    /// Little-endian `u64`s: the round, whether it is the last (0 or 1), the number of
    /// workers, the workers.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default()
            .u64(self.round)
            .u64(self.last as u64)
            .u64(self.workers.len() as u64);
        for &r in &self.workers {
            w = w.u64(r);
        }
        w.bytes
    }

    /// A set whose workers are distinct ranks below `world`; anything else is an error
    /// naming it.
    pub fn decode(b: &[u8], world: usize) -> Result<Self> {
        let mut r = Reader::new(b);
        let round = r.u64()?;
        let last = match r.u64()? {
            0 => false,
            1 => true,
            other => {
                return Err(DistError::Config(format!(
                    "a round's set with a last flag of {other}"
                )));
            }
        };
        let n = r.u64()?;
        if n > world as u64 {
            return Err(DistError::Config(format!(
                "a round's set of {n} workers in a job of {world} ranks"
            )));
        }
        let mut workers = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let w = r.u64()?;
            if w >= world as u64 || workers.contains(&w) {
                return Err(DistError::Config(format!(
                    "worker rank {w} in a round's set (job of {world} ranks, or named twice)"
                )));
            }
            workers.push(w);
        }
        r.finish()?;
        Ok(Self {
            round,
            workers,
            last,
        })
    }
}

/// A round's sum of squares ([`ROUND_NORM`], [`ROUND_TOTAL`]): finite and not negative.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundNorm {
    pub round: u64,
    pub squares: f64,
}

impl RoundNorm {
    pub fn encode(&self) -> Vec<u8> {
        Writer::default()
            .u64(self.round)
            .u64(self.squares.to_bits())
            .bytes
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b);
        let round = r.u64()?;
        let squares = f64::from_bits(r.u64()?);
        r.finish()?;
        // An infinite sum is a real one (an overflowing gradient); NaN or below zero is not.
        if squares.is_nan() || squares < 0.0 {
            return Err(DistError::Config(format!(
                "a round's sum of squares of {squares}"
            )));
        }
        Ok(Self { round, squares })
    }
}

/// (rank, count) pairs, as a count and the pairs.
fn encode_pairs(pairs: &[(u64, u64)]) -> Vec<u8> {
    let mut w = Writer::default().u64(pairs.len() as u64);
    for &(a, b) in pairs {
        w = w.u64(a).u64(b);
    }
    w.bytes
}

fn decode_pairs(r: &mut Reader) -> Result<Vec<(u64, u64)>> {
    let n = r.u64()?;
    if n > 1 << 20 {
        return Err(DistError::Config(format!("{n} clock entries")));
    }
    (0..n).map(|_| Ok((r.u64()?, r.u64()?))).collect()
}

/// A shard's whole state: its values, the state of the servers' optimizer (sync mode: the
/// velocity or Adam's moments, see [`crate::flat::optim`]; empty otherwise) and its version (updates
/// applied).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardState {
    pub version: u64,
    pub values: Vec<f32>,
    pub optim_state: Vec<f32>,
}

impl ShardState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default()
            .u64(self.version)
            .u64(self.values.len() as u64)
            .u64(self.optim_state.len() as u64)
            .bytes;
        w.extend_from_slice(&f32_to_bytes(&self.values));
        w.extend_from_slice(&f32_to_bytes(&self.optim_state));
        w
    }

    /// A state of `shard_len` values, or of any length the bytes hold if `None`.
    pub fn decode(b: &[u8], shard_len: Option<usize>) -> Result<Self> {
        let mut r = Reader::new(b);
        let version = r.u64()?;
        let (n, m) = (r.u64()?, r.u64()?);
        // Optimizer state: none yet, one value per parameter (momentum) or two (Adam's
        // moments); the optimizer checks its own length when it steps. Counts from the wire
        // are checked before any arithmetic on them.
        if shard_len.is_some_and(|l| l as u64 != n)
            || (m != 0 && m != n && Some(m) != n.checked_mul(2))
        {
            return Err(DistError::Config(format!(
                "a shard state of {n} values and {m} optimizer state values where {} values \
                 and 0, 1 or 2 state values each were expected",
                shard_len.map_or("as many".to_string(), |l| l.to_string())
            )));
        }
        let rest = r.rest();
        let want = n.checked_add(m).and_then(|v| v.checked_mul(4));
        if want != Some(rest.len() as u64) {
            return Err(DistError::Config(format!(
                "a shard state of {} bytes for {n} + {m} values",
                rest.len(),
            )));
        }
        // Both fit in the bytes at hand, so in usize.
        let (n, m) = (n as usize, m as usize);
        let (a, b) = rest.split_at(4 * n);
        Ok(Self {
            version,
            values: bytes_to_f32(a, n)?,
            optim_state: bytes_to_f32(b, m)?,
        })
    }
}

/// A server's answer: the shard's values at `version`, the pushes it applied per worker
/// (`Freeze`, `Thaw`), its whole state (`Cut`), or a refusal.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Values { version: u64, values: Vec<f32> },
    Refused(String),
    Clocks(Vec<(u64, u64)>),
    State(ShardState),
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Values { version, values } => Reply::values_bytes(*version, values),
            Reply::Refused(why) => Writer::default().u64(1).string(why).bytes,
            Reply::Clocks(c) => {
                let mut w = Writer::default().u64(2).bytes;
                w.extend(encode_pairs(c));
                w
            }
            Reply::State(s) => {
                let mut w = Writer::default().u64(3).bytes;
                w.extend(s.encode());
                w
            }
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
            2 => {
                let c = decode_pairs(&mut r)?;
                r.finish()?;
                Ok(Reply::Clocks(c))
            }
            3 => Ok(Reply::State(ShardState::decode(r.rest(), Some(shard_len))?)),
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
            cut: Vec::new(),
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
        let cut = Request {
            op: Op::Cut,
            clock: 0,
            version: 0,
            samples: 0,
            values: Vec::new(),
            cut: vec![(1, 7), (2, 9)],
        };
        assert_eq!(Request::decode(&cut.encode(), 2).unwrap(), cut);
        let clocks = Reply::Clocks(vec![(3, 4)]);
        assert_eq!(Reply::decode(&clocks.encode(), 3).unwrap(), clocks);
        let state = ShardState {
            version: 5,
            values: vec![1.0; 3],
            optim_state: vec![0.5; 3],
        };
        let r = Reply::State(state.clone());
        assert_eq!(Reply::decode(&r.encode(), 3).unwrap(), r);
        assert!(Reply::decode(&r.encode(), 2).is_err(), "wrong shard length");
        assert_eq!(ShardState::decode(&state.encode(), None).unwrap(), state);
        let enc = state.encode();
        assert!(ShardState::decode(&enc[..enc.len() - 1], None).is_err());
        // Adam's two moments per value decode; three do not.
        let adam = ShardState {
            version: 3,
            values: vec![1.0, 2.0],
            optim_state: vec![0.5; 4],
        };
        assert_eq!(ShardState::decode(&adam.encode(), Some(2)).unwrap(), adam);
        let odd = ShardState {
            optim_state: vec![0.5; 6],
            ..adam
        };
        assert!(ShardState::decode(&odd.encode(), Some(2)).is_err());
    }
}
