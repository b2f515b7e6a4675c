//! The sharded optimizer of data parallel (ZeRO stages 1 and 2, Rajbhandari et al., "ZeRO:
//! Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).
//!
//! Every rank holds the whole model, as in plain data parallel, but only `1/N` of the
//! optimizer's state: the trainable values form one flat vector ([`crate::flat`]) cut into `N`
//! contiguous shards balanced by bytes (the cut of [`Communicator::reduce_scatter`] and of
//! the parameter servers' [`Layout`]), and rank `r` owns shard `r`. A step:
//!
//! 1. the gradients averaged over the ranks: stage 1 allreduces the whole gradient and keeps its
//!    shard; stage 2 reduce-scatters it, so each rank receives only its shard's sum;
//! 2. one verdict on whether they are finite (fp16 loss scaling), the same on every rank;
//! 3. each rank updates its shard with the whole optimizer ([`ShardOptimizer`]: SGD with
//!    momentum, Adam, AdamW, LARS, whose per-tensor norms are summed over the shards first, so
//!    a tensor cut between two ranks gets its whole norm);
//! 4. an all-gather of the updated shards: every rank ends with the same whole vector.
//!
//! The arithmetic is burn-optim's operation for operation, so a run equals plain data parallel
//! up to the order of the gradient sums (1e-5).
//!
//! The state leaves and enters as whole named vectors ([`ZeroOptimizer::gather_state`],
//! [`ZeroOptimizer::scatter_state`]): one vector per slot (`velocity`, or `moment_1` and
//! `moment_2`) over all the trainable values, gathered on one rank. A checkpoint written by `N`
//! ranks is therefore read by any number of ranks, each taking the shard its own world gives it.

use std::ops::Range;

use crate::collective::{Communicator, ReduceOp};
use crate::flat::layout::Layout;
use crate::flat::optim::ShardOptimizer;
use crate::{DistError, Result};

/// How much of the training state is sharded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Optimizer state: the whole gradient is allreduced, each rank keeps its shard of it.
    One,
    /// Optimizer state and gradients: the gradient is reduce-scattered.
    Two,
}

impl Stage {
    /// `1` or `2`; anything else is an error naming the stages.
    pub fn from_number(n: u8) -> Result<Self> {
        match n {
            1 => Ok(Stage::One),
            2 => Ok(Stage::Two),
            _ => Err(DistError::Config(format!(
                "ZeRO stage {n}: the stages are 1 (optimizer state) and 2 (and gradients)"
            ))),
        }
    }

    pub fn number(self) -> u8 {
        match self {
            Stage::One => 1,
            Stage::Two => 2,
        }
    }
}

/// The optimizer's whole state as named vectors (see the module's documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct WholeState {
    /// The trainable tensors (name, values) the vectors concatenate.
    pub tensors: Vec<(String, usize)>,
    /// Updates taken (Adam's bias correction counts them).
    pub updates: u64,
    /// One vector per slot of [`ShardOptimizer::state_slots`], each over all the values;
    /// empty before the first update.
    pub slots: Vec<(String, Vec<f32>)>,
}

impl WholeState {
    /// Every tensor's part of every slot: `(tensor.slot, values)`, as a checkpoint names them.
    pub fn named(&self) -> Vec<(String, &[f32])> {
        let mut out = Vec::new();
        for (slot, values) in &self.slots {
            let mut at = 0;
            for (name, len) in &self.tensors {
                out.push((format!("{name}.{slot}"), &values[at..at + len]));
                at += len;
            }
        }
        out
    }
}

/// What a step did.
#[derive(Debug, Clone, PartialEq)]
pub enum Stepped {
    /// The whole updated vector (the same on every rank).
    Updated(Vec<f32>),
    /// The averaged gradients were not all finite, or the guard refused: nothing moved.
    Skipped,
}

/// This rank's shard of the optimizer.
pub struct ZeroOptimizer {
    stage: Stage,
    layout: Layout,
    rank: usize,
    /// The whole vector's optimizer (the decay ranges of the whole vector) and this shard's.
    whole: ShardOptimizer,
    mine: ShardOptimizer,
    state: Vec<f32>,
    updates: u64,
}

impl std::fmt::Debug for ZeroOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("shard", &self.layout.describe(self.rank))
            .field("updates", &self.updates)
            .finish()
    }
}

impl ZeroOptimizer {
    /// Rank `comm.rank()`'s shard of `optimizer` (set for the whole vector of `tensors`: its
    /// decay ranges and, for LARS, its extents) over `comm.world()` ranks.
    pub fn new(
        stage: Stage,
        tensors: &[(String, usize)],
        optimizer: ShardOptimizer,
        comm: &Communicator,
    ) -> Result<Self> {
        let layout = Layout::new(tensors, comm.world())?;
        let rank = comm.rank();
        let mine = optimizer.restrict(layout.range(rank));
        Ok(Self {
            stage,
            layout,
            rank,
            whole: optimizer,
            mine,
            state: Vec::new(),
            updates: 0,
        })
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The values this rank updates, in the whole vector.
    pub fn range(&self) -> Range<usize> {
        self.layout.range(self.rank)
    }

    /// Values in the whole vector.
    pub fn total(&self) -> usize {
        self.layout.total()
    }

    /// Updates taken (skipped steps not counted).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The optimizer state this rank holds, in values (what sharding saves: a rank of plain
    /// data parallel holds the whole vector's).
    pub fn state_len(&self) -> usize {
        self.state.len()
    }

    /// A description of this rank's shard, for logs.
    pub fn describe(&self) -> String {
        self.layout.describe(self.rank)
    }

    fn bounds(&self) -> Vec<usize> {
        let n = self.layout.servers();
        let mut b: Vec<usize> = (0..n).map(|s| self.layout.range(s).start).collect();
        b.push(self.layout.total());
        b
    }

    /// One step. `grad` is this rank's whole gradient (the mean over its own samples; every
    /// rank holds the same number, as data parallel splits the global batch evenly), `shard`
    /// the current values of [`Self::range`] (the same on every rank), `lr` the schedule's
    /// rate. `take(finite)` decides, with whether every averaged gradient value is finite,
    /// whether to update (the same on every rank, since `finite` is agreed first). Every rank
    /// must call it alike.
    pub fn step(
        &mut self,
        comm: &Communicator,
        mut grad: Vec<f32>,
        shard: &[f32],
        lr: f32,
        take: &mut dyn FnMut(bool) -> bool,
    ) -> Result<Stepped> {
        let range = self.range();
        if grad.len() != self.total() || shard.len() != range.len() {
            return Err(DistError::Mismatch {
                op: "sharded optimizer step".into(),
                reason: format!(
                    "a gradient of {} values and a shard of {} for a vector of {} ({})",
                    grad.len(),
                    shard.len(),
                    self.total(),
                    self.describe()
                ),
            });
        }
        let g = match self.stage {
            Stage::One => {
                comm.allreduce(&mut grad, ReduceOp::Mean)?;
                // The shard copied out, so the whole gradient's memory goes now.
                let mine = grad[range.clone()].to_vec();
                drop(grad);
                mine
            }
            Stage::Two => comm.reduce_scatter(grad, ReduceOp::Mean)?,
        };
        let mut verdict = [if g.iter().all(|x| x.is_finite()) {
            0.0
        } else {
            1.0
        }];
        comm.allreduce(&mut verdict, ReduceOp::Sum)?;
        let mut values = shard.to_vec();
        if !take(verdict[0] == 0.0) {
            return Ok(Stepped::Skipped);
        }
        let norms = if self.mine.needs_norms() {
            let mut n = self.mine.partial_norms(&values, &g);
            comm.allreduce(&mut n, ReduceOp::Sum)?;
            Some(n)
        } else {
            None
        };
        self.mine.step_at(
            self.updates,
            lr,
            &mut values,
            &g,
            &mut self.state,
            norms.as_deref(),
        );
        self.updates += 1;
        drop(g);
        Ok(Stepped::Updated(self.all_gather(comm, &values)?))
    }

    /// Every rank's shard, concatenated: the shards differ by at most one value, so each is
    /// padded to the longest for the ring and the padding dropped.
    fn all_gather(&self, comm: &Communicator, mine: &[f32]) -> Result<Vec<f32>> {
        let n = self.layout.servers();
        let longest = (0..n)
            .map(|s| self.layout.range(s).len())
            .max()
            .unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(longest, 0.0);
        let gathered = comm.all_gather(&padded)?;
        drop(padded);
        let mut whole = Vec::with_capacity(self.total());
        for s in 0..n {
            let len = self.layout.range(s).len();
            whole.extend_from_slice(&gathered[s * longest..s * longest + len]);
        }
        Ok(whole)
    }

    /// The whole state on `root` (`None` elsewhere); every rank calls it.
    pub fn gather_state(&self, comm: &Communicator, root: usize) -> Result<Option<WholeState>> {
        let names = self.whole.state_slots();
        let n = self.range().len();
        let bounds = self.bounds();
        // A rank that has not stepped yet holds no state; all ranks step together, so they
        // agree (a disagreement is found by the gather's lengths).
        let stepped = !self.state.is_empty();
        let mut slots = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let part: &[f32] = if stepped {
                &self.state[i * n..(i + 1) * n]
            } else {
                &[]
            };
            let b = if stepped {
                bounds.clone()
            } else {
                vec![0; bounds.len()]
            };
            if let Some(whole) = comm.gather_to(root, part, &b)? {
                slots.push((name.to_string(), whole));
            }
        }
        Ok((comm.rank() == root).then(|| WholeState {
            tensors: self.layout_tensors(),
            updates: self.updates,
            slots: if stepped { slots } else { Vec::new() },
        }))
    }

    fn layout_tensors(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = Vec::new();
        for s in 0..self.layout.servers() {
            for slice in self.layout.slices(s) {
                if out.last().is_none_or(|(n, _)| *n != slice.name) {
                    out.push((slice.name.clone(), slice.len));
                }
            }
        }
        out
    }

    /// Takes the state `root` read (any number of ranks wrote it; `None` on the other ranks,
    /// `Some(Err(why))` on `root` when it could not be read): each rank receives its shard of
    /// every slot. The tensors must be this optimizer's, by name and length, and the slots its
    /// update's; otherwise, or when the root could not read it, an error on every rank (the
    /// root's naming the first difference).
    pub fn scatter_state(
        &mut self,
        comm: &Communicator,
        root: usize,
        read: Option<std::result::Result<&WholeState, String>>,
    ) -> Result<()> {
        let names = self.whole.state_slots();
        // The root's verdict first, so every rank fails alike.
        let mut header = [0f32; 3];
        let mut problem = None;
        let mut state = None;
        if comm.rank() == root {
            let s = read.unwrap_or_else(|| {
                Err("sharded optimizer: the root has no state to hand out".into())
            });
            match s {
                Ok(s) => {
                    problem = self.mismatch(s, names);
                    header = [
                        if problem.is_some() { 1.0 } else { 0.0 },
                        if s.slots.is_empty() { 0.0 } else { 1.0 },
                        // Updates travel as two exact halves.
                        (s.updates >> 24) as f32,
                    ];
                    state = Some(s);
                }
                Err(e) => {
                    problem = Some(e);
                    header[0] = 1.0;
                }
            }
        }
        let mut low = [state.map_or(0.0, |s| (s.updates & 0xFF_FFFF) as f32)];
        comm.broadcast(&mut header, root)?;
        comm.broadcast(&mut low, root)?;
        if header[0] != 0.0 {
            return Err(DistError::Mismatch {
                op: "sharded optimizer state".into(),
                reason: problem.unwrap_or_else(|| {
                    format!("rank {root}'s saved state does not fit this model or optimizer")
                }),
            });
        }
        self.updates = ((header[2] as u64) << 24) | low[0] as u64;
        self.state.clear();
        if header[1] == 0.0 {
            return Ok(());
        }
        let bounds = self.bounds();
        let mut parts = Vec::with_capacity(names.len());
        for i in 0..names.len() {
            let whole = state.map(|s| s.slots[i].1.as_slice());
            parts.push(comm.scatter_from(root, whole, &bounds)?);
        }
        self.state = parts.concat();
        Ok(())
    }

    fn mismatch(&self, s: &WholeState, names: &[&str]) -> Option<String> {
        let want = self.layout_tensors();
        if s.tensors.len() != want.len() {
            return Some(format!(
                "the saved state has {} tensors, this model trains {}",
                s.tensors.len(),
                want.len()
            ));
        }
        if let Some(((a, n), (b, m))) = s.tensors.iter().zip(&want).find(|(x, y)| x != y) {
            return Some(format!(
                "the saved state's tensor {a} ({n} values) is {b} ({m} values) here"
            ));
        }
        if !s.slots.is_empty() {
            let saved: Vec<&str> = s.slots.iter().map(|x| x.0.as_str()).collect();
            if saved != names {
                return Some(format!(
                    "the saved state holds {saved:?}, this optimizer keeps {names:?} (was it \
                     written with another --optimizer or --momentum?)"
                ));
            }
            if let Some((slot, v)) = s.slots.iter().find(|x| x.1.len() != self.total()) {
                return Some(format!(
                    "the saved {slot} has {} values for {} trainable values",
                    v.len(),
                    self.total()
                ));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;
    use crate::flat::optim::{Extent, Update};
    use crate::transport::memory::MemoryTransport;

    fn tensors() -> Vec<(String, usize)> {
        vec![
            ("a.weight".into(), 7),
            ("a.bias".into(), 2),
            ("b.weight".into(), 11),
            ("b.bias".into(), 3),
        ]
    }

    fn optimizer(update: Update) -> ShardOptimizer {
        let mut o = ShardOptimizer::sgd(0.05, 0.9);
        o.update = update;
        o.weight_decay = 0.01;
        o.decay = vec![0..7, 9..20];
        o.lr = Arc::new(|step| 0.05 / (1.0 + step as f32));
        o.tensors = vec![
            Extent {
                range: 0..7,
                matrix: true,
            },
            Extent {
                range: 7..9,
                matrix: false,
            },
            Extent {
                range: 9..20,
                matrix: true,
            },
            Extent {
                range: 20..23,
                matrix: false,
            },
        ];
        o
    }

    fn updates() -> Vec<Update> {
        vec![
            Update::Sgd {
                momentum: 0.9,
                nesterov: false,
            },
            Update::Sgd {
                momentum: 0.9,
                nesterov: true,
            },
            Update::adam(),
            Update::adamw(),
            Update::Lars {
                momentum: 0.9,
                trust: 0.02,
                epsilon: 1e-9,
                exclude_1d: true,
            },
        ]
    }

    /// Rank `r`'s gradient at step `t`: different per rank, so the mean matters.
    fn grad(r: usize, t: u64, values: &[f32]) -> Vec<f32> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| v * 0.5 + ((i * 7 + r * 3 + t as usize) % 5) as f32 * 0.1 - 0.2)
            .collect()
    }

    /// `steps` steps on `world` ranks of ZeRO `stage`; every rank's final values and, from
    /// rank 0, the gathered state.
    fn run(
        update: Update,
        stage: Stage,
        world: usize,
        steps: u64,
        start: Option<WholeState>,
        skip_at: Option<u64>,
    ) -> (Vec<Vec<f32>>, WholeState) {
        let handles: Vec<_> = MemoryTransport::mesh(world)
            .into_iter()
            .map(|t| {
                let start = start.clone();
                thread::spawn(move || {
                    let comm = Communicator::new(Arc::new(t))
                        .with_timeout(std::time::Duration::from_secs(20))
                        .with_chunk_elems(4);
                    let o = optimizer(update);
                    let mut z = ZeroOptimizer::new(stage, &tensors(), o.clone(), &comm).unwrap();
                    if let Some(s) = &start {
                        z.scatter_state(&comm, 0, (comm.rank() == 0).then_some(Ok(s)))
                            .unwrap();
                    }
                    let mut values: Vec<f32> = (0..23).map(|i| (i as f32 - 11.0) / 10.0).collect();
                    let first = z.updates();
                    for t in first..first + steps {
                        // Every rank's mean over its samples, as in data parallel.
                        let g: Vec<f32> = grad(comm.rank(), t, &values);
                        let g = if Some(t) == skip_at {
                            let mut g = g;
                            g[comm.rank() % 23] = f32::NAN;
                            g
                        } else {
                            g
                        };
                        let shard = values[z.range()].to_vec();
                        match z
                            .step(&comm, g, &shard, o.lr_at(z.updates()), &mut |f| f)
                            .unwrap()
                        {
                            Stepped::Updated(v) => values = v,
                            Stepped::Skipped => assert_eq!(Some(t), skip_at),
                        }
                    }
                    (values, z.gather_state(&comm, 0).unwrap())
                })
            })
            .collect();
        let mut all = Vec::new();
        let mut state = None;
        for h in handles {
            let (v, s) = h.join().unwrap();
            all.push(v);
            state = state.or(s);
        }
        (all, state.unwrap())
    }

    /// The reference: one process on the whole vector with the mean of the ranks' gradients.
    fn reference(update: Update, world: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
        let o = optimizer(update);
        let mut values: Vec<f32> = (0..23).map(|i| (i as f32 - 11.0) / 10.0).collect();
        let mut state = Vec::new();
        for t in 0..steps {
            let mut mean = vec![0f32; 23];
            for r in 0..world {
                for (m, g) in mean.iter_mut().zip(grad(r, t, &values)) {
                    *m += g / world as f32;
                }
            }
            o.step(t, &mut values, &mean, &mut state);
        }
        (values, state)
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}: value {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn every_stage_and_world_equals_one_process_on_the_whole_vector() {
        for update in updates() {
            let (want, want_state) = reference(update, 3, 4);
            for stage in [Stage::One, Stage::Two] {
                let (got, state) = run(update, stage, 3, 4, None, None);
                for v in &got {
                    close(v, &want, &format!("{update:?} stage {stage:?}"));
                }
                // The gathered state is the whole vector's, slot after slot.
                let flat: Vec<f32> = state.slots.iter().flat_map(|s| s.1.clone()).collect();
                close(&flat, &want_state, &format!("{update:?} state"));
                assert_eq!(state.updates, 4);
            }
        }
    }

    #[test]
    fn a_state_written_by_three_ranks_resumes_on_two_and_on_one() {
        for update in updates() {
            // 3 ranks for 2 steps, then 2 more steps on 2 ranks, against 4 steps on 2 ranks
            // where the first 2 use 3 ranks' gradient means: the reference does exactly that
            // by hand below.
            let (_, saved) = run(update, Stage::Two, 3, 2, None, None);
            assert_eq!(saved.updates, 2);
            let (on_two, after) = run(update, Stage::One, 2, 2, Some(saved.clone()), None);
            let (on_one, _) = run(update, Stage::One, 1, 2, Some(saved.clone()), None);
            // By hand: the state the 3 ranks left, two more steps with the 2-rank mean.
            let o = optimizer(update);
            let mut values: Vec<f32> = (0..23).map(|i| (i as f32 - 11.0) / 10.0).collect();
            let mut state = Vec::new();
            for t in 0..2 {
                let mut mean = vec![0f32; 23];
                for r in 0..3 {
                    for (m, g) in mean.iter_mut().zip(grad(r, t, &values)) {
                        *m += g / 3.0;
                    }
                }
                o.step(t, &mut values, &mean, &mut state);
            }
            // The resumed runs start from the initial values (the model is not part of the
            // optimizer state), so the reference does too, with the saved state.
            let mut v2: Vec<f32> = (0..23).map(|i| (i as f32 - 11.0) / 10.0).collect();
            let mut s2 = state.clone();
            let mut v1 = v2.clone();
            let mut s1 = state;
            for t in 2..4 {
                let mut mean = vec![0f32; 23];
                for r in 0..2 {
                    for (m, g) in mean.iter_mut().zip(grad(r, t, &v2)) {
                        *m += g / 2.0;
                    }
                }
                o.step(t, &mut v2, &mean, &mut s2);
                let g = grad(0, t, &v1);
                o.step(t, &mut v1, &g, &mut s1);
            }
            close(&on_two[0], &v2, &format!("{update:?} resumed on 2"));
            close(&on_two[1], &v2, &format!("{update:?} resumed on 2, rank 1"));
            close(&on_one[0], &v1, &format!("{update:?} resumed on 1"));
            assert_eq!(after.updates, 4);
        }
    }

    #[test]
    fn a_gradient_not_finite_on_one_rank_skips_the_step_on_every_rank() {
        let update = Update::adam();
        let (got, state) = run(update, Stage::Two, 3, 3, None, Some(1));
        assert_eq!(state.updates, 2, "the skipped step is not counted");
        for v in &got[1..] {
            assert_eq!(v, &got[0]);
        }
        assert!(got[0].iter().all(|x| x.is_finite()));
    }

    #[test]
    fn a_state_of_another_model_or_optimizer_is_refused_on_every_rank() {
        let (_, saved) = run(Update::adam(), Stage::One, 2, 1, None, None);
        let mut other = saved.clone();
        other.tensors[2].0 = "c.weight".into();
        let sgd = Update::Sgd {
            momentum: 0.9,
            nesterov: false,
        };
        for (bad, update, want) in [
            (other, Update::adam(), "c.weight"),
            (saved, sgd, "velocity"),
        ] {
            let handles: Vec<_> = MemoryTransport::mesh(2)
                .into_iter()
                .map(|t| {
                    let bad = bad.clone();
                    thread::spawn(move || {
                        let comm = Communicator::new(Arc::new(t))
                            .with_timeout(std::time::Duration::from_secs(20));
                        let mut z =
                            ZeroOptimizer::new(Stage::Two, &tensors(), optimizer(update), &comm)
                                .unwrap();
                        let s = (comm.rank() == 0).then_some(Ok(&bad));
                        z.scatter_state(&comm, 0, s).unwrap_err().to_string()
                    })
                })
                .collect();
            for h in handles {
                let e = h.join().unwrap();
                assert!(e.contains("sharded optimizer state"), "{e}");
                if !e.contains("does not fit") {
                    assert!(e.contains(want), "{e}");
                }
            }
        }
        assert!(Stage::from_number(3).is_err());
    }

    #[test]
    fn named_state_cuts_each_slot_by_tensor() {
        let s = WholeState {
            tensors: vec![("x".into(), 2), ("y".into(), 1)],
            updates: 1,
            slots: vec![
                ("moment_1".into(), vec![1.0, 2.0, 3.0]),
                ("moment_2".into(), vec![4.0, 5.0, 6.0]),
            ],
        };
        let named = s.named();
        let names: Vec<&str> = named.iter().map(|n| n.0.as_str()).collect();
        assert_eq!(
            names,
            ["x.moment_1", "y.moment_1", "x.moment_2", "y.moment_2"]
        );
        assert_eq!(named[3].1, &[6.0]);
    }
}
