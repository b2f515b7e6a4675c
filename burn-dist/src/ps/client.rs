//! A worker's side: [`Client`] pushes and pulls the whole flat vector, each shard to its
//! server, all servers at once; [`PsWorker`] runs a mode's rule around the worker's steps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::message::{FINAL, INIT, Op, REPLY, REQUEST, Reply, Request, ShardState};
use super::{Mode, rules};
use crate::flat::layout::Layout;
use crate::flat::optim::ShardOptimizer;
use crate::transport::Transport;
use crate::wire::Kind;
use crate::{DistError, Result};

/// Pushes and pulls over every server in parallel.
pub struct Client {
    t: Arc<dyn Transport>,
    layout: Layout,
    /// The rank serving each shard.
    servers: Vec<usize>,
    /// How long to wait for a server's answer (a dead server's link fails sooner).
    pub timeout: Duration,
    clock: u64,
    versions: Vec<u64>,
    /// Payload bytes sent and received.
    pub bytes_out: u64,
    pub bytes_in: u64,
}

impl Client {
    /// `servers[s]` serves shard `s` of `layout`.
    pub fn new(t: Arc<dyn Transport>, layout: Layout, servers: Vec<usize>) -> Result<Self> {
        if servers.len() != layout.servers() {
            return Err(DistError::Config(format!(
                "{} server ranks for {} shards",
                servers.len(),
                layout.servers()
            )));
        }
        // Another worker's death must not fail this one's exchanges with the servers.
        t.accept_losses();
        Ok(Self {
            t,
            versions: vec![0; servers.len()],
            layout,
            servers,
            timeout: Duration::from_secs(600),
            clock: 0,
            bytes_out: 0,
            bytes_in: 0,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Steps this worker has taken (sent with every request, for the staleness bound).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// One more local step.
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    fn failed(&self, shard: usize, reason: String) -> DistError {
        DistError::ServerFailed {
            rank: self.servers[shard],
            shard: self.layout.describe(shard),
            reason,
        }
    }

    /// Sends `op` with each shard's part of `values` (or nothing) and the `cut` to every
    /// server.
    fn send_all(
        &mut self,
        op: Op,
        samples: u64,
        values: Option<&[f32]>,
        cut: &[(u64, u64)],
    ) -> Result<()> {
        if let Some(v) = values
            && v.len() != self.layout.total()
        {
            return Err(DistError::Mismatch {
                op: format!("{op:?}"),
                reason: format!(
                    "{} values, the servers hold {}",
                    v.len(),
                    self.layout.total()
                ),
            });
        }
        for s in 0..self.servers.len() {
            let part = values.map(|v| v[self.layout.range(s)].to_vec());
            let bytes = Request {
                op,
                clock: self.clock,
                version: self.versions[s],
                samples,
                values: part.unwrap_or_default(),
                cut: cut.to_vec(),
            }
            .encode();
            self.bytes_out += bytes.len() as u64;
            self.t
                .send(self.servers[s], Kind::Ps, REQUEST, bytes)
                .map_err(|e| self.failed(s, e.to_string()))?;
        }
        Ok(())
    }

    /// One message under `tag` from every server, in shard order.
    fn recv_all(&mut self, tag: u64) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + self.timeout;
        let mut out = Vec::with_capacity(self.servers.len());
        for s in 0..self.servers.len() {
            let bytes = self
                .t
                .recv(self.servers[s], Kind::Ps, tag, deadline)
                .map_err(|e| match e {
                    DistError::PeerFailed { reason, .. } => self.failed(s, reason),
                    DistError::Timeout { after, .. } => {
                        self.failed(s, format!("no answer in {:.1} s", after.as_secs_f64()))
                    }
                    other => other,
                })?;
            self.bytes_in += bytes.len() as u64;
            out.push(bytes);
        }
        Ok(out)
    }

    /// Every server's reply, checked.
    fn replies(&mut self) -> Result<Vec<Reply>> {
        let all = self.recv_all(REPLY)?;
        let mut out = Vec::with_capacity(all.len());
        for (s, bytes) in all.into_iter().enumerate() {
            match Reply::decode(&bytes, self.layout.range(s).len())
                .map_err(|e| self.failed(s, e.to_string()))?
            {
                Reply::Refused(why) => return Err(self.failed(s, format!("refused: {why}"))),
                r => out.push(r),
            }
        }
        Ok(out)
    }

    /// Sends `op` to every server and, unless `op` is `Done`, assembles their values.
    fn exchange(&mut self, op: Op, samples: u64, values: Option<&[f32]>) -> Result<Vec<f32>> {
        self.send_all(op, samples, values, &[])?;
        if op == Op::Done {
            return Ok(Vec::new());
        }
        let mut out = vec![0f32; self.layout.total()];
        for (s, r) in self.replies()?.into_iter().enumerate() {
            match r {
                Reply::Values { version, values } => {
                    self.versions[s] = version;
                    out[self.layout.range(s)].copy_from_slice(&values);
                }
                other => return Err(self.failed(s, format!("an unexpected answer {other:?}"))),
            }
        }
        Ok(out)
    }

    /// Gives each server its shard's starting state (the lead worker, before training).
    pub fn init_servers(&mut self, states: Vec<ShardState>) -> Result<()> {
        if states.len() != self.servers.len() {
            return Err(DistError::Config(format!(
                "{} shard states for {} servers",
                states.len(),
                self.servers.len()
            )));
        }
        for (s, state) in states.into_iter().enumerate() {
            if state.values.len() != self.layout.range(s).len() {
                return Err(self.failed(
                    s,
                    format!("a starting state of {} values", state.values.len()),
                ));
            }
            let bytes = state.encode();
            self.bytes_out += bytes.len() as u64;
            self.t
                .send(self.servers[s], Kind::Ps, INIT, bytes)
                .map_err(|e| self.failed(s, e.to_string()))?;
        }
        Ok(())
    }

    /// A consistent checkpoint of every shard: each holds exactly the same pushes (freeze
    /// every shard, cut at the most pushes any shard applied per worker, let each catch up to
    /// the cut, read the states, thaw). Other workers' pushes wait meanwhile.
    pub fn checkpoint(&mut self) -> Result<Vec<ShardState>> {
        self.send_all(Op::Freeze, 0, None, &[])?;
        let mut cut: BTreeMap<u64, u64> = BTreeMap::new();
        for (s, r) in self.replies()?.into_iter().enumerate() {
            let Reply::Clocks(c) = r else {
                return Err(self.failed(s, format!("{r:?} where its clocks were expected")));
            };
            for (w, n) in c {
                let e = cut.entry(w).or_default();
                *e = (*e).max(n);
            }
        }
        let cut: Vec<(u64, u64)> = cut.into_iter().collect();
        self.send_all(Op::Cut, 0, None, &cut)?;
        let mut states = Vec::with_capacity(self.servers.len());
        for (s, r) in self.replies()?.into_iter().enumerate() {
            let Reply::State(state) = r else {
                return Err(self.failed(s, format!("{r:?} where its state was expected")));
            };
            states.push(state);
        }
        self.send_all(Op::Thaw, 0, None, &[])?;
        self.replies()?;
        Ok(states)
    }

    /// Every server's final state, sent once all workers are done (the lead worker, after
    /// its own `done`). Waits up to the client's timeout.
    pub fn final_states(&mut self) -> Result<Vec<ShardState>> {
        let all = self.recv_all(FINAL)?;
        let mut out = Vec::with_capacity(all.len());
        for (s, bytes) in all.into_iter().enumerate() {
            let len = self.layout.range(s).len();
            out.push(
                ShardState::decode(&bytes, Some(len)).map_err(|e| self.failed(s, e.to_string()))?,
            );
        }
        Ok(out)
    }

    /// Every shard's current values.
    pub fn pull(&mut self) -> Result<Vec<f32>> {
        self.exchange(Op::Pull, 0, None)
    }

    /// Sync: this step's gradient over `samples` samples; returns the values after the round.
    pub fn push_grad(&mut self, grad: &[f32], samples: u64) -> Result<Vec<f32>> {
        self.clock += 1;
        self.exchange(Op::PushGrad, samples, Some(grad))
    }

    /// Asynchronous modes: a change for the servers to add by their rule; returns the values
    /// after it.
    pub fn push_delta(&mut self, delta: &[f32]) -> Result<Vec<f32>> {
        self.exchange(Op::PushDelta, 0, Some(delta))
    }

    /// Tells every server this worker is finished.
    pub fn done(&mut self) -> Result<()> {
        self.exchange(Op::Done, 0, None).map(|_| ())
    }
}

/// A worker's mode: what it does after computing each step's gradient.
pub struct PsWorker {
    pub client: Client,
    mode: Mode,
    window: usize,
    /// The optimizer of the local steps (asynchronous modes; plain SGD at the `lr` given to
    /// [`PsWorker::start`] unless [`PsWorker::with_optimizer`] says otherwise), its state, and
    /// EASGD's ρ (α = the local learning rate · ρ).
    local: ShardOptimizer,
    local_state: Vec<f32>,
    rho: f32,
    steps: u64,
    at_pull: Vec<f32>,
    /// The asynchronous modes: each gradient clipped to this norm before the local step.
    clip: Option<f64>,
}

impl PsWorker {
    /// Pulls the servers' values to start from.
    pub fn start(
        mut client: Client,
        mode: Mode,
        window: usize,
        lr: f32,
        rho: f32,
    ) -> Result<(Self, Vec<f32>)> {
        if window == 0 {
            return Err(DistError::Config(
                "parameter servers: the window (steps between exchanges) must be at least 1".into(),
            ));
        }
        let params = client.pull()?;
        let worker = Self {
            client,
            mode,
            window,
            local: ShardOptimizer::sgd(lr, 0.0),
            local_state: Vec::new(),
            rho,
            steps: 0,
            at_pull: params.clone(),
            clip: None,
        };
        Ok((worker, params))
    }

    /// Applies this step's `grad` (over `samples` samples) to `params` by the mode's rule,
    /// talking to the servers when the rule says so.
    pub fn step(&mut self, params: &mut Vec<f32>, grad: &[f32], samples: u64) -> Result<()> {
        let step = self.steps;
        self.steps += 1;
        if self.mode == Mode::Sync {
            *params = self.client.push_grad(grad, samples)?;
            return Ok(());
        }
        match self.clip {
            Some(max) => {
                let mut clipped = grad.to_vec();
                rules::clip_to_norm(&mut clipped, rules::squares(grad), max);
                self.local
                    .step(step, params, &clipped, &mut self.local_state);
            }
            None => self.local.step(step, params, grad, &mut self.local_state),
        }
        self.client.tick();
        if !self.steps.is_multiple_of(self.window as u64) {
            return Ok(());
        }
        self.exchange(params)
    }

    /// A step without a gradient (one this worker's fp16 loss scaling skipped): it counts
    /// as a step, but changes nothing of its own. Sync: the round gets an empty push (no
    /// samples, so it weighs nothing in the mean; a round where every worker skipped takes
    /// no optimizer step); the asynchronous modes: no local update, and the exchange with
    /// the servers happens when the window says, as after any step.
    pub fn skip(&mut self, params: &mut Vec<f32>) -> Result<()> {
        self.steps += 1;
        if self.mode == Mode::Sync {
            *params = self.client.push_grad(&vec![0.0; params.len()], 0)?;
            return Ok(());
        }
        self.client.tick();
        if self.steps.is_multiple_of(self.window as u64) {
            self.exchange(params)?;
        }
        Ok(())
    }

    /// The asynchronous modes' exchange at the end of a window.
    fn exchange(&mut self, params: &mut Vec<f32>) -> Result<()> {
        if self.mode == Mode::Easgd {
            let theta = self.client.pull()?;
            let alpha = self.local.lr_at(self.steps - 1) * self.rho;
            let e = rules::easgd_elastic(params, &theta, alpha);
            self.client.push_delta(&e)?;
        } else {
            let delta: Vec<f32> = params
                .iter()
                .zip(&self.at_pull)
                .map(|(w, a)| w - a)
                .collect();
            *params = self.client.push_delta(&delta)?;
            self.at_pull = params.clone();
        }
        Ok(())
    }

    /// The learning rate of the worker's local steps from now on (a constant).
    pub fn set_lr(&mut self, lr: f32) {
        self.local.lr = std::sync::Arc::new(move |_| lr);
    }

    /// The optimizer of the local steps of the asynchronous modes (over the whole vector; its
    /// learning rate by the worker's own step count, from 0). Sync mode ignores it: the
    /// servers' optimizer steps.
    pub fn with_optimizer(mut self, optimizer: ShardOptimizer) -> Self {
        self.local = optimizer;
        self.local_state = Vec::new();
        self
    }

    /// Gradient clipping by the norm in the asynchronous modes: each step's gradient is
    /// clipped to `max_norm` (the norm over this worker's whole vector) before its local step,
    /// as one process clips. Sync mode ignores it: the servers clip the round's mean
    /// ([`super::server::ServerConfig::clip_grad`]).
    pub fn with_clip(mut self, max_norm: Option<f64>) -> Self {
        self.clip = max_norm;
        self
    }

    /// Steps taken so far (counted on from [`Self::resumed_at`]).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// A worker resuming a run whose workers took `steps` steps each: the local learning rate
    /// goes on from there.
    pub fn resumed_at(mut self, steps: u64) -> Self {
        self.steps = steps;
        self
    }

    /// Tells the servers this worker is finished; the client stays usable for what follows
    /// (the lead's [`Client::final_states`]).
    pub fn finish(mut self) -> Result<Client> {
        self.client.done()?;
        Ok(self.client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::server::{ServerConfig, serve};
    use crate::transport::memory::MemoryTransport;

    /// An asynchronous worker with `with_clip` clips each gradient by its own norm before its
    /// local step: one downpour step of SGD from zero moves the values by `-lr` times the
    /// clipped gradient, which the server then holds.
    #[test]
    fn an_asynchronous_worker_clips_its_local_steps() {
        let layout = Layout::new(&[("w".to_string(), 2)], 1).unwrap();
        let mut ranks = MemoryTransport::mesh(2).into_iter();
        let server = ranks.next().unwrap();
        let worker = ranks.next().unwrap();
        let cfg = ServerConfig::new(Mode::Downpour);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(serve(&server, &cfg, vec![0.0, 0.0], &[1], &mut |_| {}));
        });
        let client = Client::new(Arc::new(worker), layout, vec![0]).unwrap();
        let (w, mut params) = PsWorker::start(client, Mode::Downpour, 1, 0.5, 0.0).unwrap();
        let mut w = w.with_clip(Some(1.0));
        // (3, 4) has norm 5: clipped to (0.6, 0.8), the step -0.5 times that.
        w.step(&mut params, &[3.0, 4.0], 1).unwrap();
        assert!(
            (params[0] + 0.3).abs() < 1e-5 && (params[1] + 0.4).abs() < 1e-5,
            "{params:?}"
        );
        w.finish().unwrap();
        let report = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the server finished")
            .unwrap();
        assert!((report.values[0] + 0.3).abs() < 1e-5, "{:?}", report.values);
    }
}
