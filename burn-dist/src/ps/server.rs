//! One parameter server: a shard's values, their optimizer state and version, answering its
//! workers in whatever order they ask ([`Transport::recv_any`]).
//!
//! - `sync`: a round closes when every live worker pushed its gradient. With several servers
//!   ([`ServerConfig::peers`]) the round is all or nothing across shards
//!   (`ps/agreement.rs`): every server applies the gradients of the workers that reached
//!   every shard; a worker lost after pushing to some shards and not others is left out of the
//!   round on all of them, and dropped. The server then takes one step of its optimizer
//!   ([`crate::flat::optim`]: SGD, Adam or AdamW, weight decay, the
//!   learning rate by the round's number) on the weighted mean and answers everyone with the
//!   new values.
//!   It counts, per worker, how often and how long the round waited for it last.
//! - The asynchronous modes apply each push as it comes ([`super::rules`]) and answer at once,
//!   unless `max_staleness` holds the answer: a worker more than that many steps ahead of the
//!   slowest live one waits (stale synchronous parallel, Ho et al. 2013).
//! - A worker that dies or sends garbage is dropped and logged; the others go on.
//! - Checkpoints (`Freeze`, `Cut`, `Thaw` from one worker, see [`super::client::Client::checkpoint`]):
//!   the shard stops applying pushes, tells the pushes it applied per worker, then applies
//!   exactly the ones up to the cut every shard agrees on and answers with its state there, so
//!   the shards of one checkpoint hold the same set of updates. Pushes that arrive meanwhile wait
//!   (their workers block a few milliseconds) and are applied on `Thaw`, or if the worker that
//!   froze the shard is lost.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::Mode;
use super::agreement::Agreement;
use super::message::{FINAL, INIT, Op, REPLY, REQUEST, Reply, Request, ShardState};
use super::rules;
use crate::flat::optim::ShardOptimizer;
use crate::transport::Transport;
use crate::wire::Kind;
use crate::{DistError, Result};

/// How a server updates its shard.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub mode: Mode,
    /// Steps between a worker's exchanges (adag divides by it).
    pub window: usize,
    /// The server's optimizer on its shard (sync mode), with decay ranges in shard indices.
    pub optimizer: ShardOptimizer,
    /// Most steps a worker may run ahead of the slowest one (asynchronous modes); `None`: no
    /// bound.
    pub max_staleness: Option<u64>,
    /// A server with no request for this long stops with an error (default 600 s).
    pub idle_timeout: Duration,
    /// Every server of the job, in shard order, this one included (sync: the first agrees
    /// each round's set of gradients with the others). Empty or one: no agreement.
    pub peers: Vec<usize>,
    /// Sync: the round's mean gradient clipped to this global norm before the optimizer's
    /// step, the norm taken over every server's shard ([`rules::clip_to_norm`]). The
    /// asynchronous modes' workers clip their own ([`super::client::PsWorker::with_clip`]).
    pub clip_grad: Option<f64>,
}

impl ServerConfig {
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            window: 1,
            optimizer: ShardOptimizer::sgd(0.01, 0.0),
            max_staleness: None,
            idle_timeout: Duration::from_secs(600),
            peers: Vec::new(),
            clip_grad: None,
        }
    }
}

/// What a server did, when its last worker is done.
#[derive(Debug, Clone, Default)]
pub struct ServerReport {
    /// The shard's final values and how many updates made them, and the server's optimizer
    /// state (sync mode; empty otherwise).
    pub values: Vec<f32>,
    pub version: u64,
    pub optim_state: Vec<f32>,
    /// Workers dropped (died, or sent a malformed request), with the reason.
    pub dropped: Vec<(usize, String)>,
    /// Sync: per worker, the rounds it was the last to push and the time the round waited
    /// for it after the first push.
    pub waited_for: BTreeMap<usize, (u64, Duration)>,
    /// The largest lead, in steps, of a worker answered over the slowest live worker.
    pub max_lead: u64,
    /// Payload bytes received and sent.
    pub bytes_in: u64,
    pub bytes_out: u64,
}

struct Pending {
    samples: u64,
    grad: Vec<f32>,
    at: Instant,
}

struct Server<'a> {
    t: &'a dyn Transport,
    cfg: &'a ServerConfig,
    values: Vec<f32>,
    optim_state: Vec<f32>,
    version: u64,
    live: Vec<usize>,
    clocks: BTreeMap<usize, u64>,
    pending: BTreeMap<usize, Pending>,
    held: Vec<usize>,
    /// Pushes applied per worker (asynchronous modes), for checkpoint cuts.
    applied: BTreeMap<usize, u64>,
    /// The worker that froze the shard for a checkpoint, the cut once known, whether the
    /// state at the cut is still owed to it, and the pushes waiting meanwhile.
    freezer: Option<usize>,
    cut: Option<BTreeMap<usize, u64>>,
    owed: bool,
    queue: VecDeque<(usize, Request)>,
    report: ServerReport,
    /// What stops this server (a peer server lost, or a round the servers disagree on).
    failure: Option<DistError>,
    /// Sync: each round's set of gradients agreed with the other servers.
    agreement: Agreement<'a>,
}

/// Serves `values` (this server's shard) to `workers` until every one is done or dropped.
pub fn serve(
    t: &dyn Transport,
    cfg: &ServerConfig,
    values: Vec<f32>,
    workers: &[usize],
    log: &mut dyn FnMut(&str),
) -> Result<ServerReport> {
    let state = ShardState {
        version: 0,
        values,
        optim_state: Vec::new(),
    };
    serve_state(t, cfg, state, workers, log)
}

/// A server rank's whole life in a job: its shard's starting state from the `lead` worker
/// ([`INIT`], waited for until `deadline`), serving `workers`, and the final state back to the
/// lead ([`FINAL`]).
pub fn run_server(
    t: &dyn Transport,
    cfg: &ServerConfig,
    lead: usize,
    workers: &[usize],
    deadline: Instant,
    log: &mut dyn FnMut(&str),
) -> Result<ServerReport> {
    let bytes = t.recv(lead, Kind::Ps, INIT, deadline)?;
    let state = ShardState::decode(&bytes, None)?;
    let report = serve_state(t, cfg, state, workers, log)?;
    let last = ShardState {
        version: report.version,
        values: report.values.clone(),
        optim_state: report.optim_state.clone(),
    };
    t.send(lead, Kind::Ps, FINAL, last.encode())?;
    Ok(report)
}

/// [`serve`] from a whole state (a resumed checkpoint: values, optimizer state, version).
pub fn serve_state(
    t: &dyn Transport,
    cfg: &ServerConfig,
    state: ShardState,
    workers: &[usize],
    log: &mut dyn FnMut(&str),
) -> Result<ServerReport> {
    let ShardState {
        version,
        values,
        optim_state,
    } = state;
    if cfg.mode == Mode::Sync {
        cfg.optimizer.check_state(values.len(), &optim_state)?;
    }
    if cfg.window == 0 {
        return Err(DistError::Config(
            "parameter servers: the window (steps between exchanges) must be at least 1".into(),
        ));
    }
    // A worker's death must not fail the receives from the others.
    t.accept_losses();
    let mut s = Server {
        t,
        cfg,
        optim_state,
        values,
        version,
        live: workers.to_vec(),
        clocks: workers.iter().map(|&w| (w, 0)).collect(),
        pending: BTreeMap::new(),
        held: Vec::new(),
        applied: BTreeMap::new(),
        freezer: None,
        cut: None,
        owed: false,
        queue: VecDeque::new(),
        report: ServerReport::default(),
        failure: None,
        agreement: Agreement::new(t, cfg.peers.clone(), cfg.idle_timeout),
    };
    while !s.live.is_empty() {
        let deadline = Instant::now() + cfg.idle_timeout;
        match t.recv_any(&s.live, Kind::Ps, REQUEST, deadline) {
            Ok((from, bytes)) => {
                s.report.bytes_in += bytes.len() as u64;
                match Request::decode(&bytes, s.values.len()) {
                    Ok(req) => {
                        if let Err(why) = s.handle(from, req, log) {
                            s.refuse(from, why, log);
                        }
                    }
                    Err(e) => s.refuse(from, format!("malformed request: {e}"), log),
                }
            }
            Err(DistError::PeerFailed { rank, reason }) if s.live.contains(&rank) => {
                log(&format!(
                    "parameter server: worker rank {rank} lost ({reason}); dropped"
                ));
                s.drop_worker(rank, reason, log);
            }
            Err(e) => return Err(e),
        }
        if let Some(e) = s.failure.take() {
            return Err(e);
        }
        s.release_held();
        s.settle_cut();
    }
    if cfg.mode == Mode::Sync {
        s.agreement.leave(s.version, log)?;
    }
    s.report.values = std::mem::take(&mut s.values);
    s.report.version = s.version;
    if cfg.mode == Mode::Sync {
        s.report.optim_state = std::mem::take(&mut s.optim_state);
    }
    Ok(s.report)
}

impl Server<'_> {
    fn handle(
        &mut self,
        from: usize,
        req: Request,
        log: &mut dyn FnMut(&str),
    ) -> std::result::Result<(), String> {
        let sync = self.cfg.mode == Mode::Sync;
        match req.op {
            Op::Pull => {
                self.clocks.insert(from, req.clock);
                self.answer_or_hold(from);
            }
            Op::Done => self.drop_worker(from, String::new(), log),
            Op::Freeze => {
                if self.freezer.is_some_and(|f| f != from) {
                    return Err("a checkpoint is already under way".into());
                }
                self.freezer = Some(from);
                self.cut = None;
                self.reply(from, &Reply::Clocks(self.clocks_list()));
            }
            Op::Cut => {
                if self.freezer != Some(from) {
                    return Err("a cut without a freeze".into());
                }
                self.cut = Some(
                    req.cut
                        .iter()
                        .map(|&(r, c)| (r as usize, c))
                        .collect::<BTreeMap<_, _>>(),
                );
                self.owed = true;
                // The waiting pushes inside the cut, in the order they came.
                let queue = std::mem::take(&mut self.queue);
                for (w, q) in queue {
                    if self.inside_cut(w) {
                        self.apply_delta(w, &q);
                    } else {
                        self.queue.push_back((w, q));
                    }
                }
            }
            Op::Thaw => {
                if self.freezer != Some(from) {
                    return Err("a thaw without a freeze".into());
                }
                self.thaw();
                self.reply(from, &Reply::Clocks(self.clocks_list()));
            }
            Op::PushDelta if !sync && self.freezer.is_some() && !self.inside_cut(from) => {
                self.queue.push_back((from, req));
            }
            Op::PushGrad if sync => {
                self.clocks.insert(from, req.clock);
                self.pending.insert(
                    from,
                    Pending {
                        samples: req.samples,
                        grad: req.values,
                        at: Instant::now(),
                    },
                );
                self.close_round(log);
            }
            Op::PushDelta if !sync => self.apply_delta(from, &req),
            op => {
                return Err(format!(
                    "a {op:?} request does not belong to the {} mode",
                    self.cfg.mode
                ));
            }
        }
        Ok(())
    }

    fn apply_delta(&mut self, from: usize, req: &Request) {
        let scale = match self.cfg.mode {
            Mode::Adag => 1.0 / self.cfg.window as f32,
            Mode::DynSgd => {
                let staleness = self.version.saturating_sub(req.version);
                1.0 / (staleness as f32 + 1.0)
            }
            _ => 1.0,
        };
        rules::add_scaled(&mut self.values, &req.values, scale);
        self.version += 1;
        *self.applied.entry(from).or_default() += 1;
        self.clocks.insert(from, req.clock);
        self.answer_or_hold(from);
    }

    fn clocks_list(&self) -> Vec<(u64, u64)> {
        self.applied.iter().map(|(&r, &c)| (r as u64, c)).collect()
    }

    /// Whether a push of worker `w` belongs inside the checkpoint's cut (known, not reached).
    fn inside_cut(&self, w: usize) -> bool {
        self.cut.as_ref().is_some_and(|cut| {
            cut.get(&w).copied().unwrap_or(0) > self.applied.get(&w).copied().unwrap_or(0)
        })
    }

    /// Once every push inside the cut is applied (or its worker lost), the state goes to the
    /// worker that asked.
    fn settle_cut(&mut self) {
        let (Some(w), Some(cut)) = (self.freezer, &self.cut) else {
            return;
        };
        let reached = cut.iter().all(|(r, c)| {
            !self.live.contains(r) || self.applied.get(r).copied().unwrap_or(0) >= *c
        });
        if self.owed && reached {
            self.owed = false;
            let state = ShardState {
                version: self.version,
                values: self.values.clone(),
                optim_state: if self.cfg.mode == Mode::Sync {
                    self.optim_state.clone()
                } else {
                    Vec::new()
                },
            };
            self.reply(w, &Reply::State(state));
        }
    }

    /// The end of a checkpoint: the pushes that waited are applied in order.
    fn thaw(&mut self) {
        self.freezer = None;
        self.cut = None;
        self.owed = false;
        for (w, q) in std::mem::take(&mut self.queue) {
            if self.live.contains(&w) {
                self.apply_delta(w, &q);
            }
        }
    }

    fn reply(&mut self, w: usize, r: &Reply) {
        self.send_reply(w, r.encode());
    }

    fn send_reply(&mut self, w: usize, bytes: Vec<u8>) {
        self.report.bytes_out += bytes.len() as u64;
        // A worker that died is seen at the next receive.
        let _ = self.t.send(w, Kind::Ps, REPLY, bytes);
    }

    /// Sync: once every live worker pushed, one optimizer step on the weighted mean (the
    /// round's number, the version, picks the learning rate) of the gradients every shard
    /// holds ([`Agreement::round`]).
    fn close_round(&mut self, log: &mut dyn FnMut(&str)) {
        if self.failure.is_some()
            || self.pending.is_empty()
            || !self.live.iter().all(|w| self.pending.contains_key(w))
        {
            return;
        }
        let mine: Vec<usize> = self.pending.keys().copied().collect();
        let agreed = match self.agreement.round(self.version, mine) {
            Ok(agreed) => agreed,
            Err(e) => {
                self.failure = Some(e);
                return;
            }
        };
        let partial: Vec<usize> = self
            .pending
            .keys()
            .copied()
            .filter(|w| !agreed.contains(w))
            .collect();
        for w in partial {
            let why = "its gradient of this round did not reach every shard (lost on another \
                       server); left out of the round on every shard"
                .to_string();
            log(&format!("parameter server: worker rank {w} dropped: {why}"));
            self.reply(w, &Reply::Refused(why.clone()));
            self.forget(w, why);
        }
        if self.pending.is_empty() {
            // Every gradient left out: nothing to apply, and no worker to answer.
            return;
        }
        let first = self.pending.values().map(|p| p.at).min();
        if let (Some(first), Some((&last, p))) =
            (first, self.pending.iter().max_by_key(|(_, p)| p.at))
            && self.pending.len() > 1
        {
            let e = self.report.waited_for.entry(last).or_default();
            e.0 += 1;
            e.1 += p.at - first;
        }
        let pending = std::mem::take(&mut self.pending);
        let done: Vec<usize> = pending.keys().copied().collect();
        let grads: Vec<(u64, Vec<f32>)> =
            pending.into_values().map(|p| (p.samples, p.grad)).collect();
        // A round without samples (every worker skipped its step: fp16 overflow) moves
        // nothing, momentum included; it still counts for the rate's schedule.
        if grads.iter().any(|(n, _)| *n > 0) {
            let mut mean = rules::weighted_mean(&grads);
            if let Some(max) = self.cfg.clip_grad {
                // Every server steps this round (they agreed its set): each adds its squares.
                match self.agreement.total(self.version, rules::squares(&mean)) {
                    Ok(total) => {
                        rules::clip_to_norm(&mut mean, total, max);
                    }
                    Err(e) => {
                        self.failure = Some(e);
                        return;
                    }
                }
            }
            self.cfg
                .optimizer
                .step(self.version, &mut self.values, &mean, &mut self.optim_state);
        }
        self.version += 1;
        for w in done {
            self.answer(w);
        }
    }

    fn slowest(&self) -> u64 {
        self.live
            .iter()
            .filter_map(|w| self.clocks.get(w))
            .copied()
            .min()
            .unwrap_or(0)
    }

    fn answer_or_hold(&mut self, w: usize) {
        let lead = self
            .clocks
            .get(&w)
            .copied()
            .unwrap_or(0)
            .saturating_sub(self.slowest());
        match self.cfg.max_staleness {
            Some(bound) if lead > bound => self.held.push(w),
            _ => {
                self.report.max_lead = self.report.max_lead.max(lead);
                self.answer(w);
            }
        }
    }

    fn release_held(&mut self) {
        let held = std::mem::take(&mut self.held);
        for w in held {
            if self.live.contains(&w) {
                self.answer_or_hold(w);
            }
        }
    }

    fn answer(&mut self, w: usize) {
        let bytes = Reply::values_bytes(self.version, &self.values);
        self.send_reply(w, bytes);
    }

    fn refuse(&mut self, w: usize, why: String, log: &mut dyn FnMut(&str)) {
        log(&format!(
            "parameter server: worker rank {w} refused and dropped: {why}"
        ));
        self.reply(w, &Reply::Refused(why.clone()));
        self.drop_worker(w, why, log);
    }

    /// A worker done (`reason` empty) or lost: it no longer counts for rounds or staleness,
    /// and a gradient it pushed to a round not yet closed is withdrawn (it may not have
    /// reached every shard); sync: the round closes if it waited only for this worker.
    fn drop_worker(&mut self, w: usize, reason: String, log: &mut dyn FnMut(&str)) {
        self.forget(w, reason);
        if self.cfg.mode == Mode::Sync {
            self.close_round(log);
        }
    }

    /// [`Self::drop_worker`] without closing a round.
    fn forget(&mut self, w: usize, reason: String) {
        self.live.retain(|&x| x != w);
        self.clocks.remove(&w);
        self.held.retain(|&x| x != w);
        self.queue.retain(|(x, _)| *x != w);
        if self.freezer == Some(w) {
            // The checkpoint's owner is gone: nobody will thaw the shard.
            self.thaw();
        }
        if !reason.is_empty() {
            self.pending.remove(&w);
            self.report.dropped.push((w, reason));
        }
    }
}
