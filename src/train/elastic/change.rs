//! A change of membership after a leave, a join or a loss: the lowest survivor announces the
//! next world, each member checks it is admitted, the announced world forms (or the change is
//! tried again without whoever was lost meanwhile).

use super::settle::{FORMING_ATTEMPTS, Settled};
use super::*;

impl<T: Trainee> ElasticRun<'_, T> {
    /// A change of membership after `leaving` asked to go and `lost` were lost: the lowest
    /// survivor coordinates, every survivor forms the next world and takes its rank 0's
    /// state. A member lost while the next world forms (in its rendezvous, or before rank 0's
    /// state reached everyone) is found when the survivors settle it over the old links
    /// ([`ElasticRun::settle`]): they form the world after it without that member, a
    /// membership epoch number further on.
    pub(super) fn change(
        &mut self,
        world: &World,
        commit: Commit<T::Model>,
        leaving: &[usize],
        lost: &[usize],
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit<T::Model>)> {
        let mut gone: Vec<usize> = leaving.iter().chain(lost).copied().collect();
        let mut next = world.number + 1;
        for attempt in 1.. {
            let (lowest, announcement) =
                self.announced(world, &commit, leaving, &mut gone, next, log)?;
            let rank = self.admitted(&announcement, world.rank(), world.size(), next)?;
            self.faults.announced(u64::from(next));
            let formed = self.form_announced(world, &announcement, rank, &commit, log);
            match self.settle(world, lowest, &announcement, formed, log)? {
                Settled::Formed(formed) => return Ok(*formed),
                Settled::Again(lost_now) => {
                    let names: Vec<&str> = lost_now
                        .iter()
                        .map(|&r| world.members[r].id.as_str())
                        .collect();
                    if attempt >= FORMING_ATTEMPTS {
                        return Err(HearthError::Training(format!(
                            "membership epoch {next} did not form after {attempt} attempts \
                             (the last lost {}): giving up",
                            if names.is_empty() {
                                "nobody".into()
                            } else {
                                names.join(", ")
                            }
                        )));
                    }
                    log(&format!(
                        "{}: membership epoch {next} did not form{}; forming epoch {} without \
                         {}",
                        self.me.id,
                        if names.is_empty() {
                            String::new()
                        } else {
                            format!(" (lost {} while it formed)", names.join(", "))
                        },
                        next + 1,
                        if names.is_empty() { "them" } else { "it" }
                    ));
                    gone.extend(lost_now);
                    gone.sort_unstable();
                    gone.dedup();
                    next += 1;
                }
            }
        }
        unreachable!("the attempts loop returns")
    }

    /// Membership epoch `next`'s announcement and the old rank of the survivor that made it:
    /// this worker's own when it is the lowest survivor (after the quorum check), else the
    /// lowest survivor's, or the next one's when that one is gone too (added to `gone`).
    fn announced(
        &mut self,
        world: &World,
        commit: &Commit<T::Model>,
        leaving: &[usize],
        gone: &mut Vec<usize>,
        next: u32,
        log: &mut dyn FnMut(&str),
    ) -> Result<(usize, Announcement)> {
        let me = world.rank();
        loop {
            let Some(lowest) = (0..world.size()).find(|r| !gone.contains(r)) else {
                return Err(HearthError::Training("no member survived".into()));
            };
            if lowest == me {
                // Over the world after the leave: a leaver counts toward neither side.
                let lost: Vec<usize> = gone
                    .iter()
                    .copied()
                    .filter(|r| !leaving.contains(r))
                    .collect();
                if let Err(need) = quorum(world.size(), leaving, &lost) {
                    return Err(self.cut_off(world, leaving, gone, next, need));
                }
                return Ok((
                    me,
                    self.coordinate(world, commit, leaving, gone, next, log)?,
                ));
            }
            self.join.set_role(Role::Busy);
            let wait = self.opts.rejoin_timeout + collective_timeout();
            match Announcement::receive(
                world.transport.as_ref(),
                lowest,
                next,
                Instant::now() + wait,
            ) {
                Ok(a) => return Ok((lowest, a)),
                // The coordinator died too: the next survivor coordinates.
                Err(_) => gone.push(lowest),
            }
        }
    }

    /// This worker's rank in the announced epoch `next`, or the error that ends it: the job
    /// gave up (below the minimum, or no quorum), or this worker was left out.
    fn admitted(
        &self,
        announcement: &Announcement,
        me: usize,
        old_world: usize,
        next: u32,
    ) -> Result<usize> {
        if announcement.members.is_empty() && !announcement.coordinator.is_empty() {
            // The coordinator found no quorum: its reason.
            return Err(HearthError::CutOff(announcement.coordinator.clone()));
        }
        if announcement.members.is_empty() {
            return Err(HearthError::Training(format!(
                "the job gave up: fewer than `ElasticOptions.min_workers` {} workers and nobody joined within \
                 `ElasticOptions.rejoin_timeout` {:?} (state saved by the coordinator in {})",
                self.opts.min_workers,
                self.opts.rejoin_timeout,
                self.state_file().display()
            )));
        }
        // Old ranks come off the wire: each inside the old world, and each once.
        let mut seen = vec![false; old_world];
        for &old in announcement.members.iter().flatten() {
            match seen.get_mut(old) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(HearthError::Training(format!(
                        "membership epoch {next}'s announcement names old rank {old} {}",
                        if old < seen.len() {
                            "twice"
                        } else {
                            "outside the old world"
                        }
                    )));
                }
            }
        }
        announcement.rank_of(me).ok_or_else(|| {
            HearthError::Training(format!(
                "{} was left out of membership epoch {next}",
                self.me.id
            ))
        })
    }

    /// The announced world formed by rendezvous, with its rank 0's commit on every member.
    fn form_announced(
        &mut self,
        world: &World,
        announcement: &Announcement,
        rank: usize,
        commit: &Commit<T::Model>,
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit<T::Model>)> {
        let next = announcement.epoch;
        let info = RankInfo {
            rank,
            world: announcement.members.len(),
            local_rank: None,
            coordinator: announcement.coordinator.clone(),
            source: "elastic",
        };
        let bound = self.bound.take();
        // A member lost on the old world's links meanwhile will never arrive: the rendezvous
        // ends with it instead of waiting out its timeout.
        let old = world.transport.clone();
        let watched: Vec<(usize, String)> = announcement
            .members
            .iter()
            .flatten()
            .filter(|&&r| r != world.rank())
            .map(|&r| (r, world.members[r].id.clone()))
            .collect();
        let abort: Abort = Arc::new(move || {
            watched.iter().find_map(|(r, id)| {
                old.lost(*r).map(|reason| DistError::PeerFailed {
                    rank: *r,
                    reason: format!(
                        "{id} was lost while membership epoch {next} formed (rank {r} of the \
                         epoch before: {reason})"
                    ),
                })
            })
        });
        let transport = connect_epoch_watched(
            bound,
            &info,
            &self.membership,
            &RendezvousOptions::from_env(),
            next,
            Some(abort),
        )?;
        let members: Vec<Worker> = announcement
            .members
            .iter()
            .map(|m| match m {
                Some(old) => world.members[*old].clone(),
                None => Worker {
                    id: String::new(),
                    host: String::new(),
                },
            })
            .collect();
        let members = if rank == 0 {
            self.next_members.take().unwrap_or(members)
        } else {
            members
        };
        self.form(
            next,
            Arc::new(transport),
            members,
            (rank == 0).then(|| commit.clone()),
            log,
        )
    }

    /// No quorum ([`quorum`]): this worker and the survivors it reached are the smaller part
    /// of the last world. It tells them (an announcement with no members, the reason in place
    /// of the coordinator), writes nothing, and returns the error that ends it.
    fn cut_off(
        &self,
        world: &World,
        leaving: &[usize],
        gone: &[usize],
        next: u32,
        need: usize,
    ) -> HearthError {
        let reached: Vec<usize> = (0..world.size()).filter(|r| !gone.contains(r)).collect();
        let stayed = (0..world.size()).filter(|r| !leaving.contains(r)).count();
        let lost: Vec<usize> = gone
            .iter()
            .copied()
            .filter(|r| !leaving.contains(r))
            .collect();
        let names = |rs: &mut dyn Iterator<Item = usize>| {
            rs.map(|r| world.members[r].id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let why = format!(
            "{} reached {} of the {stayed} members of membership epoch {} that did not leave \
             ({}; lost {}), and a new epoch needs {need} of them (a majority, or exactly half \
             with the lowest of them), so the others may go on without them; nothing was \
             written to {}",
            self.me.id,
            reached.len(),
            world.number,
            names(&mut reached.iter().copied()),
            names(&mut lost.iter().copied()),
            self.cfg.run_dir.display()
        );
        let give_up = Announcement {
            epoch: next,
            coordinator: why.clone(),
            members: Vec::new(),
        };
        let _ = give_up.send_to(world.transport.as_ref(), &reached);
        HearthError::CutOff(why)
    }
}
