//! Forming worlds: the first one, a joiner's, and every change after a leave, a join or a
//! loss (the lowest survivor coordinates; everyone takes rank 0's commit).

use super::settle::FORMING_ATTEMPTS;
use super::*;

impl<T: Trainee> ElasticRun<'_, T> {
    /// The world `hearth launch --elastic` started: members `w0..`, rank 0's commit (fresh,
    /// or `checkpoint/elastic.state` with `--resume`) sent to all.
    pub(super) fn first_world(
        &mut self,
        info: &RankInfo,
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit<T::Model>)> {
        // Every starting worker refuses (none waits for a peer that gave up): the cap binds
        // joiners, and a first world above it would train as if it were not there.
        if info.world > self.opts.max_workers {
            return Err(HearthError::InvalidArgument(format!(
                "`ElasticOptions.max_workers` {} is below the {} workers this elastic job starts with: \
                 start at most {} or raise `ElasticOptions.max_workers`",
                self.opts.max_workers, info.world, self.opts.max_workers
            )));
        }
        // Rank 0's refusals (a used run directory, a checkpoint that does not resume) still go
        // through the rendezvous, so that every member ends with rank 0's reason at once
        // instead of waiting for it until the rendezvous times out.
        let mut refusal = None;
        if info.rank == 0
            && let Err(e) = self.start_run_dir(info, log)
        {
            refusal = Some(e);
        }
        let transport = match connect_epoch_on(
            None,
            info,
            &self.membership,
            &RendezvousOptions::from_env(),
            0,
        ) {
            Ok(t) => t,
            // No world to tell: rank 0's own reason comes first.
            Err(e) => return Err(refusal.unwrap_or(e.into())),
        };
        let members: Vec<Worker> = (0..info.world)
            .map(|r| Worker {
                id: format!("w{r}"),
                host: format!("w{r}"),
            })
            .collect();
        let mut mine = None;
        if info.rank == 0 && refusal.is_none() {
            match self.first_commit(log) {
                Ok(c) => mine = Some(c),
                Err(e) => refusal = Some(e),
            }
        }
        start_verdict(&transport, info, refusal)?;
        self.form(0, Arc::new(transport), members, mine, log)
    }

    /// Rank 0 before the first world: the run directory checked and started.
    fn start_run_dir(&self, info: &RankInfo, log: &mut dyn FnMut(&str)) -> Result<()> {
        run_dir::start(self.cfg, log)?;
        if !self.cfg.checkpoint.resume {
            // What the run is, for `--resume` (a bare one refuses to start it outside
            // `hearth launch --elastic`).
            run_dir::record(
                &self.cfg.run_dir,
                &self.trainee.describe(),
                &self.cfg.hyperparameters(),
            )?;
        }
        log(&format!(
            "elastic: {} workers to start (min {}, max {}), global batch {}, shares {}",
            info.world,
            self.opts.min_workers,
            self.opts.max_workers,
            self.cfg.batch_size,
            match self.opts.balance {
                Balance::Even => "even",
                Balance::Throughput => "by throughput",
            }
        ));
        Ok(())
    }

    /// Rank 0's first commit: fresh, or `checkpoint/elastic.state` with `--resume`.
    fn first_commit(&mut self, log: &mut dyn FnMut(&str)) -> Result<Commit<T::Model>> {
        // This launch's id, for the fence: a --resume is a new launch.
        self.launch = burn_dist::tls::random_secret()?[..16].to_string();
        if !self.cfg.checkpoint.resume {
            return self.fresh_commit();
        }
        let mut c = self.load_state()?;
        // The saved state says whether that launch ended (`--stop-after-epoch`, patience);
        // this one trains on from it, unless every epoch is done.
        Epochs::new(self.cfg, true).check_left(c.epoch as usize)?;
        c.finished = false;
        log(&format!(
            "resuming at step {} (epoch {}, sample {})",
            c.step,
            c.epoch + 1,
            c.position
        ));
        Ok(c)
    }

    /// A joiner: ask the members for admission, then form the announced world.
    pub(super) fn join_world(
        &mut self,
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit<T::Model>)> {
        let addrs = self.opts.join_addresses();
        if addrs.is_empty() {
            return Err(HearthError::InvalidArgument(
                "joining an elastic job needs join addresses: HEARTH_ELASTIC_PEERS or `ElasticOptions.hosts_file`"
                    .into(),
            ));
        }
        log(&format!(
            "{}: asking to join through {}",
            self.me.id,
            addrs.join(", ")
        ));
        for attempt in 1.. {
            let opts = self.opts.clone();
            let (rank, a) = request_join(
                &move || opts.join_addresses(),
                &self.me,
                &self.membership,
                self.opts.rejoin_timeout.max(Duration::from_secs(30)),
                &burn_dist::transport::quic::QuicOptions::from_env(),
            )?;
            let info = RankInfo {
                rank,
                world: a.members.len(),
                local_rank: None,
                coordinator: a.coordinator.clone(),
                source: "elastic join",
            };
            // Members and everything else come with rank 0's state.
            let formed = connect_epoch_on(
                None,
                &info,
                &self.membership,
                &RendezvousOptions::from_env(),
                a.epoch,
            )
            .map_err(HearthError::from)
            .and_then(|t| self.form(a.epoch, Arc::new(t), Vec::new(), None, log));
            match formed {
                // A member lost while the epoch formed: the members form another, and this
                // worker asks again to be in it.
                Err(HearthError::Dist(e)) if attempt < FORMING_ATTEMPTS => log(&format!(
                    "{}: membership epoch {} did not form here ({e}): asking to join again",
                    self.me.id, a.epoch
                )),
                formed => return formed,
            }
        }
        unreachable!("the attempts loop returns")
    }

    /// Every member of a freshly formed world: rank 0 sends its commit and the member list;
    /// each member takes them, answers joiners by its role, and is ready to train.
    pub(super) fn form(
        &mut self,
        number: u32,
        transport: Arc<RoutedTransport>,
        members: Vec<Worker>,
        mine: Option<Commit<T::Model>>,
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit<T::Model>)> {
        let comm = Communicator::from_env(transport.clone() as Arc<dyn Transport>)
            .with_timeout(collective_timeout());
        let rank = comm.rank();
        let my_join = self.join.local_addr()?.to_string();
        let bytes = match (&mine, rank) {
            (Some(c), 0) => self.encode(c, number, &members, &my_join)?,
            _ => Vec::new(),
        };
        let limit = match self.state_limit.get() {
            Some(&l) => l,
            None => {
                let params = self.skeleton(&self.device)?.num_params();
                *self
                    .state_limit
                    .get_or_init(|| super::super::shared::state_limit(params))
            }
        };
        let bytes = broadcast_bytes(&comm, bytes, limit)?;
        let state::Decoded {
            members,
            join: coordinator_join,
            commit,
            health,
            launch,
        } = self.decode(&bytes)?;
        // Rank 0 of every new epoch raises the run directory's fence; everyone keeps the
        // token, for the files it writes should it be rank 0 (see fence.rs).
        self.launch = launch;
        let token = fence::Token {
            launch: self.launch.clone(),
            epoch: number,
            by: members.first().map(|m| m.id.clone()).unwrap_or_default(),
        };
        if rank == 0 {
            self.fence.raise(&token, number == 0)?;
        }
        self.token = Some(token);
        if rank != 0 {
            // Should this member coordinate later, it refuses the hosts rank 0 refused.
            self.coordinator.restore_health(&health, Instant::now());
        }
        if members.len() != comm.world() {
            return Err(HearthError::Training(format!(
                "membership epoch {number}: {} members listed, {} in the world",
                members.len(),
                comm.world()
            )));
        }
        if rank == 0 {
            self.coordinator.adopt(Epoch {
                number: u64::from(number),
                members: members.clone(),
            });
            self.join.set_role(Role::Coordinator);
            log(&format!(
                "membership epoch {number}: {} workers [{}], from step {}",
                members.len(),
                members
                    .iter()
                    .map(|m| m.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                commit.step
            ));
        } else {
            self.join.set_role(Role::Redirect(coordinator_join.clone()));
        }
        let weights = vec![1.0; members.len()];
        let sharded = comm
            .sibling(Kind::Sharded)
            .with_compression(self.cfg.exchange.compression);
        Ok((
            World {
                number,
                transport,
                comm: Arc::new(comm),
                sharded,
                members,
                weights,
                coordinator_join,
            },
            commit,
        ))
    }

    // ---- the committed state as bytes ----------------------------------------------------

    /// Before a change: greet every member but `leaving` over the links that still work;
    /// those that answer (in time) survive. Returns the lost members' ranks. After a failed
    /// step this is how the survivors find each other; before a planned change it finds a
    /// member that died after the step's last collective (with `--overlap` the gradient
    /// exchange ends before the control allreduce), which the rendezvous would otherwise
    /// wait for until it timed out.
    pub(super) fn unanswered(&self, world: &World, leaving: &[usize]) -> Vec<usize> {
        let t = &world.transport;
        t.accept_losses();
        let tag = greeting_tag(world.number);
        let me = world.rank();
        let others: Vec<usize> = (0..world.size())
            .filter(|r| *r != me && !leaving.contains(r))
            .collect();
        for &r in &others {
            let _ = t.send(r, Kind::Control, tag, vec![1]);
        }
        let deadline = Instant::now() + collective_timeout();
        others
            .into_iter()
            .filter(|&r| t.recv(r, Kind::Control, tag, deadline).is_err())
            .collect()
    }

    /// The lowest survivor decides the next epoch's members (survivors in their order, then
    /// joiners admitted by the membership rules), binds the next rendezvous, and announces it
    /// to the survivors over the old links and to the joiners through the join service.
    pub(super) fn coordinate(
        &mut self,
        world: &World,
        commit: &Commit<T::Model>,
        leaving: &[usize],
        gone: &[usize],
        next: u32,
        log: &mut dyn FnMut(&str),
    ) -> Result<Announcement> {
        let now = Instant::now();
        self.coordinator.adopt(Epoch {
            number: u64::from(world.number),
            members: world.members.clone(),
        });
        for &r in gone {
            let id = &world.members[r].id;
            if leaving.contains(&r) {
                self.coordinator.leave(id);
            } else {
                self.coordinator.lost(id, now);
            }
        }
        self.join.set_role(Role::Coordinator);
        let survivors: Vec<usize> = (0..world.size()).filter(|r| !gone.contains(r)).collect();
        let mut said = false;
        let members = loop {
            let now = Instant::now();
            let waiting = self.join.waiting();
            let queued: Vec<String> = self.coordinator.waiting().map(|w| w.id.clone()).collect();
            // Joiners that went away are dropped; new ones are vetted (blacklist, duplicates).
            for id in queued
                .iter()
                .filter(|id| !waiting.iter().any(|w| &w.id == *id))
            {
                self.coordinator.lost(id, now);
            }
            for w in waiting.iter().filter(|w| !queued.contains(&w.id)) {
                if let Err(refusal) = self.coordinator.hello(w.clone(), now) {
                    log(&format!("refused joiner {}: {refusal:?}", w.id));
                    self.join
                        .answer(&w.id, Reply::Refused(format!("{refusal:?}")));
                }
            }
            match self.coordinator.decide(now) {
                Decision::Change { epoch, .. } => break epoch.members,
                Decision::Continue => break self.coordinator.current().members.clone(),
                Decision::Wait { have, need, until } => {
                    if !said {
                        log(&format!(
                            "{have} workers, {need} needed: waiting up to {:.0} s for joiners",
                            until.saturating_duration_since(now).as_secs_f64()
                        ));
                        said = true;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Decision::GiveUp { have, need, waited } => {
                    return Err(self.give_up(
                        world,
                        commit,
                        &survivors,
                        next,
                        (have, need),
                        waited,
                    ));
                }
            }
        };
        let ip = match self.join.local_addr()?.ip() {
            ip if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            ip => ip,
        };
        let node = bind_coordinator(ip, &self.membership, &RendezvousOptions::from_env())?;
        let old_rank = |w: &Worker| world.members.iter().position(|m| m.id == w.id);
        let announcement = Announcement {
            epoch: next,
            coordinator: node.local_addr()?.to_string(),
            members: members.iter().map(old_rank).collect(),
        };
        if let Err(e) = announcement.send_to(world.transport.as_ref(), &survivors) {
            log(&format!("announcing membership epoch {next}: {e}"));
        }
        for (rank, w) in members.iter().enumerate() {
            if old_rank(w).is_none() {
                self.join.answer(
                    &w.id,
                    Reply::Admit {
                        rank,
                        announcement: announcement.clone(),
                    },
                );
            }
        }
        self.bound = Some(node);
        self.next_members = Some(members);
        Ok(announcement)
    }

    /// Too few workers after `--rejoin-timeout` (`have` of the `need`ed): saves the state where
    /// it can, tells the `survivors` the job ends, and returns the error that says where the
    /// state is.
    fn give_up(
        &self,
        world: &World,
        commit: &Commit<T::Model>,
        survivors: &[usize],
        next: u32,
        (have, need): (usize, usize),
        waited: Duration,
    ) -> HearthError {
        let saved = match self.save_state(commit, world) {
            Ok(saved) => saved,
            Err(e) => return e,
        };
        let give_up = Announcement {
            epoch: next,
            coordinator: String::new(),
            members: Vec::new(),
        };
        let _ = give_up.send_to(world.transport.as_ref(), survivors);
        let sharded =
            crate::train::zero::state_file(&shard::state_dir(self.cfg), commit.step as usize);
        let state = if !saved && self.zero.is_some() && !sharded.is_file() {
            format!(
                "the optimizer state is sharded over the workers (`exchange.zero`) and one \
                 cannot write it alone: {} keeps the last state saved, at an \
                 epoch's end (the steps since are lost)",
                self.state_file().display()
            )
        } else if saved {
            format!("state saved in {}", self.state_file().display())
        } else {
            format!(
                "{} already holds a later step, kept (this worker was cut off \
                 while the others went on)",
                self.state_file().display()
            )
        };
        HearthError::Training(format!(
            "only {have} of the `ElasticOptions.min_workers` {need} workers after waiting {:.0} s \
             (`ElasticOptions.rejoin_timeout`) for joiners; {state} (`checkpoint.resume` continues it)",
            waited.as_secs_f64(),
        ))
    }
}

/// Tag of rank 0's word on starting the job, sent once over the first world's links.
const START_TAG: u64 = 0xE1A6_57A7_0000_0000;

/// The longest refusal a member repeats from rank 0 (the rest is cut).
const REFUSAL_LIMIT: usize = 4096;

/// Rank 0 tells every member whether the job starts (an empty word) or why not; a refusing
/// rank 0 returns its own error, the others return it as rank 0's.
fn start_verdict(
    transport: &RoutedTransport,
    info: &RankInfo,
    refusal: Option<HearthError>,
) -> Result<()> {
    if info.rank == 0 {
        let word = refusal
            .as_ref()
            .map_or_else(Vec::new, |e| e.to_string().into_bytes());
        for r in 1..info.world {
            // A member already gone fails the forming that follows, with its own error.
            let _ = transport.send(r, Kind::Control, START_TAG, word.clone());
        }
        return match refusal {
            None => Ok(()),
            Some(e) => {
                // The word reaches the members before this worker's links close.
                transport.shutdown(Duration::from_secs(2));
                Err(e)
            }
        };
    }
    let word = transport.recv(
        0,
        Kind::Control,
        START_TAG,
        Instant::now() + collective_timeout(),
    )?;
    if word.is_empty() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&word[..word.len().min(REFUSAL_LIMIT)]).into_owned();
    Err(HearthError::Training(format!(
        "rank 0 of the elastic job did not start it: {said}"
    )))
}
