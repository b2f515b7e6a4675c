//! Sync rounds all or nothing across shards: with several servers, the first gathers each
//! server's set of workers whose gradients of the round it holds ([`ROUND_READY`]) and sends
//! back their intersection ([`ROUND_COMMIT`]), which every server applies. A worker lost after
//! pushing to some shards and not others is left out on all of them. A server whose session is
//! over says so ([`RoundSet::last`]); the first drains every other before the next session, so
//! no round message is read in the wrong one.

use std::time::{Duration, Instant};

use super::message::{ROUND_COMMIT, ROUND_NORM, ROUND_READY, ROUND_TOTAL, RoundNorm, RoundSet};
use crate::transport::Transport;
use crate::wire::Kind;
use crate::{DistError, Result};

/// One server's side of the agreement.
pub(super) struct Agreement<'a> {
    t: &'a dyn Transport,
    /// Every server of the job in shard order, this one included; fewer than 2: no exchange.
    peers: Vec<usize>,
    timeout: Duration,
    /// The first server: the servers whose session is over (they hold nothing more).
    departed: Vec<usize>,
}

impl<'a> Agreement<'a> {
    pub fn new(t: &'a dyn Transport, peers: Vec<usize>, timeout: Duration) -> Self {
        Self {
            t,
            peers,
            timeout,
            departed: Vec::new(),
        }
    }

    /// The workers of round `round` whose gradients every shard holds, `mine` being this
    /// shard's: with one server, `mine`. Every server stays in step: a set for another round,
    /// one naming a worker this shard holds no gradient of, or a lost server is an error.
    pub fn round(&mut self, round: u64, mine: Vec<usize>) -> Result<Vec<usize>> {
        let me = self.t.rank();
        if self.peers.len() < 2 {
            return Ok(mine);
        }
        if !self.peers.contains(&me) {
            return Err(DistError::Config(format!(
                "parameter server rank {me} is not among the servers {:?}",
                self.peers
            )));
        }
        let first = self.peers[0];
        if me == first {
            let mut agreed = mine;
            // A copy: the loop takes `self` mutably.
            let others = self.peers[1..].to_vec();
            for p in others {
                if self.departed.contains(&p) {
                    // Its session is over: it holds no gradient of this round.
                    agreed.clear();
                    continue;
                }
                let theirs = self.ready_from(round, p)?;
                agreed.retain(|w| theirs.contains(w));
            }
            let bytes = set(round, &agreed, false).encode();
            for &p in &self.peers[1..] {
                if !self.departed.contains(&p) {
                    self.t.send(p, Kind::Ps, ROUND_COMMIT, bytes.clone())?;
                }
            }
            Ok(agreed)
        } else {
            let ready = set(round, &mine, false).encode();
            self.t.send(first, Kind::Ps, ROUND_READY, ready)?;
            let deadline = Instant::now() + self.timeout;
            let bytes = self.t.recv(first, Kind::Ps, ROUND_COMMIT, deadline)?;
            let agreed = self.in_step(round, first, RoundSet::decode(&bytes, self.t.world())?)?;
            if let Some(w) = agreed.iter().find(|w| !mine.contains(w)) {
                return Err(DistError::Config(format!(
                    "the first parameter server (rank {first}) applies worker {w}'s gradient, \
                     which this shard (rank {me}) does not hold"
                )));
            }
            Ok(agreed)
        }
    }

    /// Gradient clipping: the sum over every shard of `mine`, this shard's sum of the squares
    /// of round `round`'s mean gradient (with one server, `mine`). Called by every server of
    /// a round that steps, after [`Self::round`] agreed its set: the first adds the others'
    /// and sends the total back.
    pub fn total(&mut self, round: u64, mine: f64) -> Result<f64> {
        if self.peers.len() < 2 {
            return Ok(mine);
        }
        let first = self.peers[0];
        let deadline = || Instant::now() + self.timeout;
        let check = |from: usize, n: RoundNorm| {
            if n.round != round {
                return Err(DistError::Config(format!(
                    "parameter server rank {from} sent the norm of round {}, this one (rank {}) \
                     is at {round}",
                    n.round,
                    self.t.rank()
                )));
            }
            Ok(n.squares)
        };
        if self.t.rank() == first {
            let mut total = mine;
            for &p in &self.peers[1..] {
                let bytes = self.t.recv(p, Kind::Ps, ROUND_NORM, deadline())?;
                total += check(p, RoundNorm::decode(&bytes)?)?;
            }
            let bytes = RoundNorm {
                round,
                squares: total,
            }
            .encode();
            for &p in &self.peers[1..] {
                self.t.send(p, Kind::Ps, ROUND_TOTAL, bytes.clone())?;
            }
            Ok(total)
        } else {
            let bytes = RoundNorm {
                round,
                squares: mine,
            }
            .encode();
            self.t.send(first, Kind::Ps, ROUND_NORM, bytes)?;
            let bytes = self.t.recv(first, Kind::Ps, ROUND_TOTAL, deadline())?;
            check(first, RoundNorm::decode(&bytes)?)
        }
    }

    /// The session over at round `round` (no live worker left). Another server says it is
    /// done and leaves; the first answers each round still offered with an empty set (it holds
    /// no gradient) until every other one has said it is done.
    pub fn leave(&mut self, round: u64, log: &mut dyn FnMut(&str)) -> Result<()> {
        let me = self.t.rank();
        if self.peers.len() < 2 || !self.peers.contains(&me) {
            return Ok(());
        }
        let first = self.peers[0];
        if me != first {
            let done = set(round, &[], true).encode();
            if let Err(e) = self.t.send(first, Kind::Ps, ROUND_READY, done) {
                log(&format!(
                    "parameter server: the first server did not hear this one leave: {e}"
                ));
            }
            return Ok(());
        }
        // A copy: the loop takes `self` mutably.
        let others = self.peers[1..].to_vec();
        for p in others {
            while !self.departed.contains(&p) {
                let theirs = self.ready_from(round, p)?;
                if !self.departed.contains(&p) {
                    log(&format!(
                        "parameter server: server rank {p} offered a round with workers \
                         {theirs:?} after every worker left this shard; nothing applied"
                    ));
                    let none = set(round, &[], false).encode();
                    self.t.send(p, Kind::Ps, ROUND_COMMIT, none)?;
                }
            }
        }
        Ok(())
    }

    /// The first server: peer `p`'s next [`ROUND_READY`], its workers (none once its session
    /// is over, which marks it departed).
    fn ready_from(&mut self, round: u64, p: usize) -> Result<Vec<usize>> {
        let deadline = Instant::now() + self.timeout;
        let bytes = self.t.recv(p, Kind::Ps, ROUND_READY, deadline)?;
        let s = RoundSet::decode(&bytes, self.t.world())?;
        let last = s.last;
        let workers = self.in_step(round, p, s)?;
        if last {
            self.departed.push(p);
            return Ok(Vec::new());
        }
        Ok(workers)
    }

    /// The workers of a set for `round`; one for another round is an error.
    fn in_step(&self, round: u64, from: usize, s: RoundSet) -> Result<Vec<usize>> {
        if s.round != round {
            return Err(DistError::Config(format!(
                "parameter server rank {from} is at synchronous round {}, this one (rank {}) at \
                 {round}: the shards went out of step",
                s.round,
                self.t.rank(),
            )));
        }
        Ok(s.workers.iter().map(|&w| w as usize).collect())
    }
}

fn set(round: u64, workers: &[usize], last: bool) -> RoundSet {
    RoundSet {
        round,
        workers: workers.iter().map(|&w| w as u64).collect(),
        last,
    }
}
