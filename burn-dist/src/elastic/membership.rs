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
mod tests {

    #[test]
    fn only_one_side_of_any_split_holds_a_quorum() {
        assert_eq!(quorum(3, &[], &[2]), Ok(()));
        assert_eq!(quorum(3, &[], &[0, 1]), Err(2), "the cut-off third");
        assert_eq!(quorum(1, &[], &[]), Ok(()));
        assert_eq!(quorum(1, &[], &[0]), Err(1));
        // A tie goes to the half holding rank 0.
        assert_eq!(quorum(2, &[], &[1]), Ok(()));
        assert_eq!(quorum(2, &[], &[0]), Err(2));
        assert_eq!(quorum(4, &[], &[2, 3]), Ok(()));
        assert_eq!(quorum(4, &[], &[0, 3]), Err(3));
        // Duplicates and ranks outside the world count once or not at all.
        assert_eq!(quorum(3, &[], &[2, 2, 7]), Ok(()));
        // Every split of worlds up to 8: never both sides.
        for world in 1..=8usize {
            for mask in 0u32..(1 << world) {
                let a: Vec<usize> = (0..world).filter(|r| mask & (1 << r) != 0).collect();
                let b: Vec<usize> = (0..world).filter(|r| mask & (1 << r) == 0).collect();
                // Side A lost B's members and the other way round.
                let both = quorum(world, &[], &b).is_ok() && quorum(world, &[], &a).is_ok();
                assert!(!both, "world {world}: {a:?} and {b:?} both hold a quorum");
            }
        }
    }

    #[test]
    fn a_graceful_leaver_counts_toward_neither_side_of_a_split() {
        // Issue 55's case: in a world of 3, w2 leaves, then w0 and w1 split. Counting the
        // leaver as nobody's loss, each side saw one of three lost and both passed.
        assert_eq!(quorum(3, &[2], &[1]), Ok(()), "w0: the tie-breaker's half");
        assert_eq!(quorum(3, &[2], &[0]), Err(2), "w1");
        // Rank 0 left: the lowest that stayed breaks ties.
        assert_eq!(quorum(3, &[0], &[2]), Ok(()), "w1 holds the tie");
        assert_eq!(quorum(3, &[0], &[1]), Err(2), "w2");
        // Everyone left or was lost: nobody forms a world.
        assert_eq!(quorum(2, &[0, 1], &[]), Err(1));
        // Every world up to 7, every set of leavers, every split of those who stayed, and
        // each side having heard of all the leaves or of none (a leave it missed is a loss to
        // it): never both sides.
        for world in 1..=7usize {
            for leave_mask in 0u32..(1 << world) {
                let left: Vec<usize> = (0..world).filter(|r| leave_mask & (1 << r) != 0).collect();
                let stayed: Vec<usize> = (0..world).filter(|r| !left.contains(r)).collect();
                for mask in 0u32..(1 << stayed.len()) {
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    for (i, &r) in stayed.iter().enumerate() {
                        if mask & (1 << i) != 0 {
                            a.push(r)
                        } else {
                            b.push(r)
                        }
                    }
                    for (a_heard, b_heard) in [(true, true), (true, false), (false, true)] {
                        let view = |heard: bool, other: &[usize]| {
                            let mut lost = other.to_vec();
                            let left = if heard {
                                left.clone()
                            } else {
                                lost.extend(&left);
                                Vec::new()
                            };
                            quorum(world, &left, &lost).is_ok()
                        };
                        assert!(
                            !(view(a_heard, &b) && view(b_heard, &a)),
                            "world {world}, left {left:?}: {a:?} and {b:?} both hold a quorum"
                        );
                    }
                }
            }
        }
    }
    use super::*;

    fn w(id: &str, host: &str) -> Worker {
        Worker {
            id: id.into(),
            host: host.into(),
        }
    }

    fn ids(e: &Epoch) -> Vec<&str> {
        e.members.iter().map(|m| m.id.as_str()).collect()
    }

    fn limits(min: usize, max: usize) -> Limits {
        Limits {
            min,
            max,
            rejoin_timeout: Duration::from_secs(30),
            blacklist_after: 2,
            blacklist_window: Duration::from_secs(60),
            cooldown: Duration::from_secs(100),
        }
    }

    fn change(d: Decision) -> (Epoch, Vec<Worker>, Vec<Worker>) {
        match d {
            Decision::Change {
                epoch,
                joined,
                lost,
            } => (epoch, joined, lost),
            other => panic!("expected a change, got {other:?}"),
        }
    }

    #[test]
    fn a_successor_coordinator_keeps_the_blacklist_and_failure_counts() {
        let t = Instant::now();
        let members = vec![w("a", "h1"), w("b", "h2"), w("c", "h3")];
        let mut first = Membership::new(limits(1, 4), members.clone());
        // h2 fails twice: blacklisted for 100 s. h3 once: one more and it is too.
        first.lost("b", t);
        change(first.decide(t));
        first.hello(w("b2", "h2"), t).unwrap();
        change(first.decide(t));
        first.lost("b2", t);
        change(first.decide(t));
        assert!(matches!(
            first.hello(w("b3", "h2"), t),
            Err(Refusal::Blacklisted { .. })
        ));
        first.lost("c", t);
        let health = first.health(t + Duration::from_secs(10));
        assert_eq!(health.blacklist, vec![("h2".to_string(), 90.0)]);
        assert_eq!(health.failures, vec![("h3".to_string(), vec![10.0])]);

        // The first coordinator dies; "a"'s successor was sent its health with the state.
        let later = t + Duration::from_secs(10);
        let mut next = Membership::new(limits(1, 4), members);
        next.restore_health(&health, later);
        assert!(
            matches!(
                next.hello(w("b3", "h2"), later),
                Err(Refusal::Blacklisted { .. })
            ),
            "the blacklist survives its coordinator"
        );
        next.lost("c", later);
        assert!(
            matches!(
                next.hello(w("c2", "h3"), later),
                Err(Refusal::Blacklisted { .. })
            ),
            "h3's earlier failure still counts"
        );
        // After the cooldown h2 is welcome again.
        let after = later + Duration::from_secs(91);
        assert_eq!(next.health(after).blacklist.len(), 1, "only h3 left");
        next.hello(w("b4", "h2"), after).unwrap();
    }

    #[test]
    fn survivors_keep_their_order_and_joiners_come_after_them() {
        let t = Instant::now();
        let mut m = Membership::new(limits(1, 4), vec![w("a", "h1"), w("b", "h2"), w("c", "h3")]);
        assert_eq!(m.decide(t), Decision::Continue);
        // Rank 0 dies: the lowest survivor becomes rank 0 of the next epoch.
        m.lost("a", t);
        m.hello(w("d", "h4"), t).unwrap();
        let (epoch, joined, lost) = change(m.decide(t));
        assert_eq!(epoch.number, 1);
        assert_eq!(ids(&epoch), vec!["b", "c", "d"]);
        assert_eq!(joined, vec![w("d", "h4")]);
        assert_eq!(lost, vec![w("a", "h1")]);
        assert_eq!(m.decide(t), Decision::Continue);
    }

    #[test]
    fn joins_stop_at_the_maximum_and_wait_for_room() {
        let t = Instant::now();
        let mut m = Membership::new(limits(1, 2), vec![w("a", "h1")]);
        m.hello(w("b", "h2"), t).unwrap();
        m.hello(w("c", "h3"), t).unwrap();
        let (epoch, _, _) = change(m.decide(t));
        assert_eq!(ids(&epoch), vec!["a", "b"]);
        assert_eq!(m.decide(t), Decision::Continue, "c waits: no room");
        m.leave("a");
        let (epoch, joined, _) = change(m.decide(t));
        assert_eq!(ids(&epoch), vec!["b", "c"]);
        assert_eq!(joined, vec![w("c", "h3")]);
        assert_eq!(
            m.hello(w("b", "h2"), t),
            Err(Refusal::Duplicate { id: "b".into() })
        );
    }

    #[test]
    fn below_the_minimum_it_waits_for_joiners_then_gives_up() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut m = Membership::new(limits(2, 4), vec![w("a", "h1"), w("b", "h2")]);
        m.lost("b", t);
        assert!(matches!(
            m.decide(t),
            Decision::Wait {
                have: 1,
                need: 2,
                ..
            }
        ));
        // A joiner within the timeout restores the job.
        m.hello(w("c", "h3"), t + s(10)).unwrap();
        let (epoch, _, _) = change(m.decide(t + s(10)));
        assert_eq!(ids(&epoch), vec!["a", "c"]);
        // Short again, and nobody comes.
        m.lost("c", t + s(20));
        assert!(matches!(m.decide(t + s(20)), Decision::Wait { .. }));
        let Decision::GiveUp { have, need, waited } = m.decide(t + s(51)) else {
            panic!("expected to give up")
        };
        assert_eq!((have, need), (1, 2));
        assert!(waited >= s(30));
    }

    #[test]
    fn a_host_that_keeps_failing_is_refused_for_a_cooldown() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut m = Membership::new(limits(1, 4), vec![w("a", "h1"), w("b1", "flaky")]);
        m.lost("b1", t);
        m.decide(t);
        m.hello(w("b2", "flaky"), t).unwrap();
        m.decide(t);
        m.lost("b2", t + s(5));
        m.decide(t + s(5));
        let refused = m.hello(w("b3", "flaky"), t + s(6));
        assert!(
            matches!(refused, Err(Refusal::Blacklisted { .. })),
            "{refused:?}"
        );
        // After the cooldown it may come back.
        m.hello(w("b4", "flaky"), t + s(106)).unwrap();
        let (epoch, _, _) = change(m.decide(t + s(106)));
        assert_eq!(ids(&epoch), vec!["a", "b4"]);
    }

    #[test]
    fn fifty_random_joins_and_leaves_keep_a_consistent_membership() {
        let t = Instant::now();
        let mut m = Membership::new(limits(1, 4), vec![w("w0", "h0")]);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next_id = 1;
        let mut changes = 0;
        for event in 0..50u64 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let now = t + Duration::from_secs(event);
            let members: Vec<String> = m.current().members.iter().map(|w| w.id.clone()).collect();
            if state.is_multiple_of(2) || members.len() == 1 {
                let _ = m.hello(w(&format!("w{next_id}"), &format!("h{next_id}")), now);
                next_id += 1;
            } else {
                let victim = &members[(state as usize / 2) % members.len()];
                if state.is_multiple_of(3) {
                    m.leave(victim);
                } else {
                    m.lost(victim, now);
                }
            }
            let before = m.current().number;
            match m.decide(now) {
                Decision::Change { epoch, .. } => {
                    changes += 1;
                    assert_eq!(epoch.number, before + 1);
                    assert!(!epoch.members.is_empty() && epoch.members.len() <= 4);
                    let mut seen: Vec<&str> = ids(&epoch);
                    seen.sort();
                    seen.dedup();
                    assert_eq!(seen.len(), epoch.members.len(), "no worker twice");
                }
                Decision::Continue => assert_eq!(m.current().number, before),
                other => panic!("with min 1 there is always a member: {other:?}"),
            }
        }
        assert!(changes > 20, "the soak changed membership {changes} times");
    }
}
