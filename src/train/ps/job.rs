//! What the lead, the servers and the workers of a parameter-server job share: who does what
//! ([`Roles`]) and what they tell each other beside burn-dist's protocol (the setup and the
//! end-of-run tags).

use std::ops::Range;

use crate::settings::PsServers;
use crate::{HearthError, Result};

/// Who does what in a job of `world` launched ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Roles {
    pub workers: usize,
    pub servers: usize,
    pub colocated: bool,
}

impl Roles {
    pub fn new(servers: PsServers, world: usize) -> Result<Self> {
        match servers {
            PsServers::Dedicated(p) if p < world => Ok(Self {
                workers: world - p,
                servers: p,
                colocated: false,
            }),
            PsServers::Dedicated(p) => Err(HearthError::InvalidArgument(format!(
                "`TrainingMode::ParameterServers` {p} leaves no worker among {world} ranks (`dist.world` must exceed `TrainingMode::ParameterServers`)"
            ))),
            PsServers::Colocated => Ok(Self {
                workers: world,
                servers: world,
                colocated: true,
            }),
        }
    }

    /// Ranks of the parameter-server job (twice the launched ranks when colocated).
    pub fn world(&self) -> usize {
        self.workers + self.servers
    }

    pub fn worker_ranks(&self) -> Vec<usize> {
        (0..self.workers).collect()
    }

    pub fn server_ranks(&self) -> Vec<usize> {
        (self.workers..self.world()).collect()
    }
}

/// The lead worker's goodbye: everything it needed from this rank has arrived.
pub(crate) const BYE: u64 = burn_dist::ps::message::APP_TAGS + 1;
/// A worker's per-epoch statistics, sent to the lead when it is done.
pub(crate) const STATS: u64 = burn_dist::ps::message::APP_TAGS;
/// A worker's skipped images (`path: reason` lines), sent to the lead after its statistics.
pub(crate) const SKIPPED: u64 = burn_dist::ps::message::APP_TAGS + 3;
/// A multi-label run's training outputs of each epoch on a worker, sent to the lead after its
/// skipped images (for `train_auroc`).
pub(crate) const SCORES: u64 = burn_dist::ps::message::APP_TAGS + 4;

/// The lead's settings for one server's optimizer, sent before each session's values: the
/// optimizer steps per epoch (the schedule's unit), the phase's base rate and its shard's
/// weight-decay ranges. A run has one session, or two with `--unfreeze-after` (the frozen
/// phase's shards of the head, then the fine-tuning phase's shards of the whole model); an
/// empty [`SETUP`] says there is no further session.
pub(crate) const SETUP: u64 = burn_dist::ps::message::APP_TAGS + 2;

/// What [`SETUP`] carries.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerSetup {
    pub batches_per_epoch: u64,
    /// The phase's rate (after `--scale-lr`; `--finetune-lr` in the fine-tuning phase).
    pub lr: f64,
    /// Value ranges of the shard (shard indices) that weight decay applies to.
    pub decay: Vec<Range<usize>>,
}

impl ServerSetup {
    /// Little-endian `u64`s: steps per epoch, the rate's bits, the number of ranges, then each
    /// start and end.
    pub fn encode(&self) -> Vec<u8> {
        let mut words = vec![
            self.batches_per_epoch,
            self.lr.to_bits(),
            self.decay.len() as u64,
        ];
        for r in &self.decay {
            words.extend([r.start as u64, r.end as u64]);
        }
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// The setup for a shard of `shard_len` values; anything else is an error naming it.
    pub fn decode(bytes: &[u8], shard_len: usize) -> Result<Self> {
        let bad = |m: String| HearthError::Training(format!("parameter server setup: {m}"));
        if !bytes.len().is_multiple_of(8) || bytes.len() < 24 {
            return Err(bad(format!("{} bytes", bytes.len())));
        }
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        let lr = f64::from_bits(words[1]);
        if !(lr.is_finite() && lr > 0.0) {
            return Err(bad(format!("a rate of {lr}")));
        }
        let n = usize::try_from(words[2]).unwrap_or(usize::MAX);
        if words.len() != n.saturating_mul(2).saturating_add(3) {
            return Err(bad(format!(
                "{n} ranges in {} words",
                words.len().saturating_sub(3)
            )));
        }
        let mut decay = Vec::with_capacity(n);
        for pair in words[3..].chunks_exact(2) {
            let (a, b) = (pair[0] as usize, pair[1] as usize);
            if a >= b || b > shard_len {
                return Err(bad(format!(
                    "range {a}..{b} outside a shard of {shard_len} values"
                )));
            }
            decay.push(a..b);
        }
        Ok(Self {
            batches_per_epoch: words[0].max(1),
            lr,
            decay,
        })
    }
}
