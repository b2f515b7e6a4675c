//! The membership protocol's core, apart from its I/O (as quinn keeps its protocol apart from
//! its sockets): what the coordinator decides from the events it sees, tested with simulated
//! event sequences. The I/O side (not built yet) feeds it hellos, losses and leaves from the
//! transport and carries its decisions out: a new world formed by rendezvous among the
//! members, the committed state sent to joiners, training resumed at the next step.
//!
//! Rules:
//! - Membership moves in numbered epochs; a change is applied at a step boundary only (the
//!   caller asks [`Membership::decide`] between steps).
//! - Members keep their order from one epoch to the next (survivors first, in their old order,
//!   then joiners in arrival order), so rank 0 of the new epoch is the lowest surviving rank:
//!   it runs the rendezvous and writes checkpoints.
//! - A lost member is gone at the next decision; a member that left gracefully too. Joiners
//!   wait for the next decision; at most `max` members are admitted (the earliest first).
//! - Below `min` members the coordinator waits up to `rejoin_timeout` for joiners, then gives
//!   up: [`Decision::GiveUp`] (the caller writes a checkpoint and exits with an error).
//! - A host lost `blacklist_after` times within `blacklist_window` is refused for `cooldown`.
//! - After a loss, a new epoch forms only from a [`quorum`] of the last one: more than half
//!   of its members reachable (a member that asked to leave counts as reachable), or exactly
//!   half including its rank 0. Two disjoint parts of a world cannot both hold one, so a
//!   worker cut off from the others can never go on as a second job.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// A worker: a name unique in the job (e.g. `host:pid`) and the host it runs on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Worker {
    pub id: String,
    pub host: String,
}

/// One epoch of membership: its number and its members in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epoch {
    pub number: u64,
    pub members: Vec<Worker>,
}

/// What the coordinator does at a step boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing changed: the next step runs in the current epoch.
    Continue,
    /// A new epoch: form it (rendezvous among its members), send the committed state to the
    /// `joined`, and go on from the last committed step.
    Change {
        epoch: Epoch,
        joined: Vec<Worker>,
        lost: Vec<Worker>,
    },
    /// Too few members: wait for joiners until `until`, asking again.
    Wait {
        until: Instant,
        have: usize,
        need: usize,
    },
    /// Too few members for longer than the rejoin timeout.
    GiveUp {
        have: usize,
        need: usize,
        waited: Duration,
    },
}

/// The coordinator's settings.
#[derive(Debug, Clone)]
pub struct Limits {
    pub min: usize,
    pub max: usize,
    pub rejoin_timeout: Duration,
    pub blacklist_after: usize,
    pub blacklist_window: Duration,
    pub cooldown: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            min: 1,
            max: usize::MAX,
            rejoin_timeout: Duration::from_secs(300),
            blacklist_after: 3,
            blacklist_window: Duration::from_secs(600),
            cooldown: Duration::from_secs(600),
        }
    }
}

/// Why a join was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The host failed too often; it may try again after `until`.
    Blacklisted { host: String, until: Instant },
    /// A worker of that name is already a member or waiting.
    Duplicate { id: String },
}

/// What a coordinator knows of the hosts' failures, in seconds relative to one instant: each
/// host's recent losses (seconds ago) and the blacklisted hosts (seconds of cooldown left).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Health {
    pub failures: Vec<(String, Vec<f64>)>,
    pub blacklist: Vec<(String, f64)>,
}

/// The coordinator's view of the job.
#[derive(Debug)]
pub struct Membership {
    limits: Limits,
    current: Epoch,
    /// Members lost or left since the last decision.
    gone: Vec<Worker>,
    /// Workers waiting to join, in arrival order.
    joining: VecDeque<Worker>,
    /// When the membership fell below `min` (for the rejoin timeout).
    short_since: Option<Instant>,
    /// Each host's recent losses.
    failures: HashMap<String, Vec<Instant>>,
    /// Hosts refused until the instant given.
    blacklist: HashMap<String, Instant>,
}

impl Membership {
    /// The first epoch (number 0) with `members` in rank order.
    pub fn new(limits: Limits, members: Vec<Worker>) -> Self {
        Self {
            limits,
            current: Epoch { number: 0, members },
            gone: Vec::new(),
            joining: VecDeque::new(),
            short_since: None,
            failures: HashMap::new(),
            blacklist: HashMap::new(),
        }
    }

    pub fn current(&self) -> &Epoch {
        &self.current
    }

    /// Takes over `epoch` as the current one (a process that becomes coordinator after the
    /// previous one was lost, or a coordinator told of the epoch formed elsewhere); the hosts'
    /// failure counts and the blacklist it kept are kept. Losses and leaves not yet decided on
    /// are dropped, joiners already members too.
    pub fn adopt(&mut self, epoch: Epoch) {
        self.joining
            .retain(|j| !epoch.members.iter().any(|m| m.id == j.id));
        self.gone.clear();
        self.current = epoch;
    }

    /// The hosts' recent failures and the blacklist, relative to `now`, so that a successor
    /// coordinator (sent it with the committed state) refuses the same hosts.
    pub fn health(&self, now: Instant) -> Health {
        let window = self.limits.blacklist_window;
        let mut failures: Vec<(String, Vec<f64>)> = self
            .failures
            .iter()
            .map(|(host, times)| {
                let ago = times
                    .iter()
                    .map(|t| now.saturating_duration_since(*t))
                    .filter(|d| *d < window)
                    .map(|d| d.as_secs_f64())
                    .collect::<Vec<_>>();
                (host.clone(), ago)
            })
            .filter(|(_, ago)| !ago.is_empty())
            .collect();
        failures.sort_by(|a, b| a.0.cmp(&b.0));
        let mut blacklist: Vec<(String, f64)> = self
            .blacklist
            .iter()
            .filter(|(_, until)| **until > now)
            .map(|(host, until)| (host.clone(), until.duration_since(now).as_secs_f64()))
            .collect();
        blacklist.sort_by(|a, b| a.0.cmp(&b.0));
        Health {
            failures,
            blacklist,
        }
    }

    /// Takes over a predecessor's [`Membership::health`] (replacing this one's).
    pub fn restore_health(&mut self, health: &Health, now: Instant) {
        let secs = |s: f64| Duration::from_secs_f64(if s.is_finite() { s.max(0.0) } else { 0.0 });
        self.failures = health
            .failures
            .iter()
            .map(|(host, ago)| {
                let times = ago
                    .iter()
                    .map(|a| now.checked_sub(secs(*a)).unwrap_or(now))
                    .collect();
                (host.clone(), times)
            })
            .collect();
        self.blacklist = health
            .blacklist
            .iter()
            .map(|(host, left)| (host.clone(), now + secs(*left)))
            .collect();
    }

    /// Workers waiting to join, in arrival order.
    pub fn waiting(&self) -> impl Iterator<Item = &Worker> {
        self.joining.iter()
    }

    /// A worker asks to join; it is admitted at the next decision (if there is room).
    pub fn hello(&mut self, worker: Worker, now: Instant) -> Result<(), Refusal> {
        if let Some(&until) = self.blacklist.get(&worker.host) {
            if now < until {
                return Err(Refusal::Blacklisted {
                    host: worker.host,
                    until,
                });
            }
            self.blacklist.remove(&worker.host);
        }
        if self.member(&worker.id).is_some() || self.joining.iter().any(|j| j.id == worker.id) {
            return Err(Refusal::Duplicate { id: worker.id });
        }
        self.joining.push_back(worker);
        Ok(())
    }

    /// A member stopped answering (killed, cut off): gone at the next decision, and counted
    /// against its host.
    pub fn lost(&mut self, id: &str, now: Instant) {
        if let Some(w) = self.member(id) {
            let window = self.limits.blacklist_window;
            let recent = self.failures.entry(w.host.clone()).or_default();
            recent.retain(|t| now.duration_since(*t) < window);
            recent.push(now);
            if recent.len() >= self.limits.blacklist_after {
                recent.clear();
                self.blacklist
                    .insert(w.host.clone(), now + self.limits.cooldown);
            }
            self.gone.push(w);
        }
        // A worker lost while waiting to join is simply dropped.
        self.joining.retain(|j| j.id != id);
    }

    /// A member announced a graceful leave (it finishes the step, then exits 0).
    pub fn leave(&mut self, id: &str) {
        if let Some(w) = self.member(id) {
            self.gone.push(w);
        }
        self.joining.retain(|j| j.id != id);
    }

    /// A current member not already gone.
    fn member(&self, id: &str) -> Option<Worker> {
        self.current
            .members
            .iter()
            .find(|m| m.id == id && !self.gone.iter().any(|g| g.id == id))
            .cloned()
    }

    /// At a step boundary: apply what happened since the last decision.
    pub fn decide(&mut self, now: Instant) -> Decision {
        let survivors: Vec<Worker> = self
            .current
            .members
            .iter()
            .filter(|m| !self.gone.iter().any(|g| g.id == m.id))
            .cloned()
            .collect();
        let room = self.limits.max.saturating_sub(survivors.len());
        // Joiners from a host blacklisted meanwhile are refused now.
        let blacklist = &self.blacklist;
        self.joining
            .retain(|j| blacklist.get(&j.host).is_none_or(|&until| now >= until));
        let have = survivors.len() + self.joining.len().min(room);
        if have < self.limits.min {
            let since = *self.short_since.get_or_insert(now);
            let waited = now.duration_since(since);
            if waited >= self.limits.rejoin_timeout {
                return Decision::GiveUp {
                    have,
                    need: self.limits.min,
                    waited,
                };
            }
            return Decision::Wait {
                until: since + self.limits.rejoin_timeout,
                have,
                need: self.limits.min,
            };
        }
        self.short_since = None;
        if self.gone.is_empty() && (self.joining.is_empty() || room == 0) {
            return Decision::Continue;
        }
        let admitted = self.joining.len().min(room);
        let joined: Vec<Worker> = self.joining.drain(..admitted).collect();
        let lost = std::mem::take(&mut self.gone);
        let mut members = survivors;
        members.extend(joined.iter().cloned());
        self.current = Epoch {
            number: self.current.number + 1,
            members,
        };
        Decision::Change {
            epoch: self.current.clone(),
            joined,
            lost,
        }
    }
}

/// Whether the survivors of an epoch of `world` members may form the next one after the
/// members `left` (graceful leavers, their ranks in that epoch) and `lost` are gone. The quorum
/// is taken over the world after the leave: of the `world - left` members that stayed, more
/// than half remain, or exactly half and the lowest of them (old rank 0 unless it left) among
/// them. Two disjoint sets of survivors cannot both pass, whatever each of them believes about
/// the other and whichever leaves each has heard of (a leave one side missed counts as a loss
/// there, which only makes that side's quorum harder), so a partition leaves at most one part
/// training. A leaver counts toward neither side. Returns the members the survivors need when
/// they do not pass.
pub fn quorum(world: usize, left: &[usize], lost: &[usize]) -> Result<(), usize> {
    let stayed: Vec<usize> = (0..world).filter(|r| !left.contains(r)).collect();
    let gone = stayed.iter().filter(|r| lost.contains(r)).count();
    let have = stayed.len() - gone;
    let holds_tie_breaker = stayed.first().is_some_and(|r| !lost.contains(r));
    if 2 * have > stayed.len() || (2 * have == stayed.len() && have > 0 && holds_tie_breaker) {
        Ok(())
    } else {
        Err(stayed.len() / 2 + 1)
    }
}

#[cfg(test)]
mod tests;
