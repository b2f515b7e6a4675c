//! The sharded optimizer against one process on the whole vector, in memory.
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
/// A rank's communicator over the in-memory mesh: a 20 s timeout so a bug fails rather than
/// hangs, and chunks of 4 values so the 23-value vector crosses chunk boundaries.
fn rank_comm(t: MemoryTransport) -> Communicator {
    Communicator::new(Arc::new(t))
        .with_timeout(std::time::Duration::from_secs(20))
        .with_chunk_elems(4)
}

/// The parameters every test starts from: 23 values in [-1.1, 1.1].
fn start_values() -> Vec<f32> {
    (0..23).map(|i| (i as f32 - 11.0) / 10.0).collect()
}

fn run(
    update: Update,
    stage: Stage,
    world: usize,
    steps: u64,
    start: Option<WholeState>,
    skip_at: Option<u64>,
) -> (Vec<Vec<f32>>, WholeState) {
    run_cut(update, stage, world, steps, start, skip_at, &[])
}

/// [`run`] with the tensors of `rows` cut into pieces of rows (stage 3).
fn run_cut(
    update: Update,
    stage: Stage,
    world: usize,
    steps: u64,
    start: Option<WholeState>,
    skip_at: Option<u64>,
    rows: &[(usize, usize)],
) -> (Vec<Vec<f32>>, WholeState) {
    let rows = rows.to_vec();
    let handles: Vec<_> = MemoryTransport::mesh(world)
        .into_iter()
        .map(|t| {
            let start = start.clone();
            let rows = rows.clone();
            thread::spawn(move || {
                let comm = rank_comm(t);
                let o = optimizer(update);
                // Buckets of 10 values: [a.weight, a.bias], [b.weight], [b.bias].
                let mut z = ZeroOptimizer::new(stage, &tensors(), o.clone(), &comm, 40).unwrap();
                if !rows.is_empty() {
                    z = z.cut_rows(&rows).unwrap();
                }
                if let Some(s) = &start {
                    z.scatter_state(&comm, 0, (comm.rank() == 0).then_some(Ok(s)))
                        .unwrap();
                }
                let mut values = start_values();
                if stage == Stage::Three {
                    hold(&mut z, &values);
                }
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
                    match step_on(&mut z, &comm, &o, &g, &values) {
                        Stepped::Updated(v) if stage == Stage::Three => {
                            // Nothing gathered by the step: the shard stays with the rank.
                            assert!(v.iter().all(Vec::is_empty), "stage 3 delivered values");
                            values = gather_all(&z, &comm);
                        }
                        Stepped::Updated(v) => {
                            assert_eq!(v.len(), 4, "one vector per tensor");
                            values = v.concat();
                        }
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

/// Stage 3: `z` takes this rank's segments of `values` (the same on every rank).
fn hold(z: &mut ZeroOptimizer, values: &[f32]) {
    let mut source = FlatSource {
        grad: &[],
        values,
        offsets: vec![0, 7, 9, 20, 23],
    };
    z.hold_params(&mut source).unwrap();
}

/// Stage 3: every tensor gathered from the ranks' segments, as one vector.
fn gather_all(z: &ZeroOptimizer, comm: &Communicator) -> Vec<f32> {
    let mut out = vec![Vec::new(); 4];
    z.gather_params(comm, 0..4, &mut |tensors, parts| {
        for (t, v) in tensors.zip(parts) {
            out[t] = v;
        }
        Ok(())
    })
    .unwrap();
    out.concat()
}

/// One step of `z` at `o`'s rate with gradient `g` at `values`.
fn step_on(
    z: &mut ZeroOptimizer,
    comm: &Communicator,
    o: &ShardOptimizer,
    g: &[f32],
    values: &[f32],
) -> Stepped {
    let mut source = FlatSource {
        grad: g,
        values,
        offsets: vec![0, 7, 9, 20, 23],
    };
    let lr = o.lr_at(z.updates());
    z.step(comm, &mut source, lr, &mut |f| f).unwrap()
}

/// The reference: one process on the whole vector with the mean of the ranks' gradients.
fn reference(update: Update, world: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
    let o = optimizer(update);
    let mut values = start_values();
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
        for world in [3, 4] {
            let (want, want_state) = reference(update, world, 4);
            for stage in [Stage::One, Stage::Two, Stage::Three] {
                // 4 ranks: the last bucket (3 values) leaves rank 0 an empty segment.
                let (got, state) = run(update, stage, world, 4, None, None);
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
        let mut values = start_values();
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
        let mut v2 = start_values();
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
                        ZeroOptimizer::new(Stage::Two, &tensors(), optimizer(update), &comm, 40)
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
    assert!(Stage::from_number(4).is_err());
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
        born: Vec::new(),
    };
    let named = s.named();
    let names: Vec<&str> = named.iter().map(|n| n.0.as_str()).collect();
    assert_eq!(
        names,
        ["x.moment_1", "y.moment_1", "x.moment_2", "y.moment_2"]
    );
    assert_eq!(named[3].1, &[6.0]);
}

/// A saved state whose reads fail from the `fail_at`-th on (a file cut or unreadable on the
/// way).
struct Failing {
    whole: WholeState,
    reads: usize,
    fail_at: usize,
}

impl StateReader for Failing {
    fn tensors(&self) -> &[(String, usize)] {
        &self.whole.tensors
    }
    fn updates(&self) -> u64 {
        self.whole.updates
    }
    fn slot_names(&self) -> Vec<String> {
        self.whole.slots.iter().map(|s| s.0.clone()).collect()
    }
    fn read(&mut self, slot: usize, range: Range<usize>) -> std::result::Result<Vec<f32>, String> {
        self.reads += 1;
        if self.reads >= self.fail_at {
            return Err("state.safetensors: unexpected end of file".into());
        }
        Ok(self.whole.slots[slot].1[range].to_vec())
    }
}

#[test]
fn a_read_that_fails_while_scattering_is_an_error_on_every_rank_not_a_hang() {
    let (_, saved) = run(Update::adam(), Stage::One, 2, 1, None, None);
    for fail_at in [1, 2, 5] {
        let handles: Vec<_> = MemoryTransport::mesh(3)
            .into_iter()
            .map(|t| {
                let saved = saved.clone();
                thread::spawn(move || {
                    let comm = Communicator::new(Arc::new(t))
                        .with_timeout(std::time::Duration::from_secs(20));
                    let mut z = ZeroOptimizer::new(
                        Stage::Two,
                        &tensors(),
                        optimizer(Update::adam()),
                        &comm,
                        40,
                    )
                    .unwrap();
                    let mut reader = Failing {
                        whole: saved,
                        reads: 0,
                        fail_at,
                    };
                    let root =
                        (comm.rank() == 0).then_some(Ok(&mut reader as &mut dyn StateReader));
                    z.scatter_from_reader(&comm, 0, root)
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let e = h.join().unwrap();
            assert!(e.contains("sharded optimizer state"), "rank {r}: {e}");
            if r == 0 {
                assert!(e.contains("unexpected end of file"), "{e}");
            }
        }
    }
}

/// `steps` steps on `world` ranks keeping replicas, each rank's gradient weighted by `1/world`
/// and summed (elastic's shares): every rank's optimizer after them and the gathered state.
fn run_replicated(
    update: Update,
    stage: Stage,
    world: usize,
    steps: u64,
) -> (Vec<ZeroOptimizer>, Vec<f32>, WholeState) {
    let handles: Vec<_> = MemoryTransport::mesh(world)
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let comm = rank_comm(t);
                let o = optimizer(update);
                let mut z = ZeroOptimizer::new(stage, &tensors(), o.clone(), &comm, 40)
                    .unwrap()
                    .with_summed_gradients()
                    .with_replica();
                assert!(z.has_replica());
                let mut values = start_values();
                for t in 0..steps {
                    let g: Vec<f32> = grad(comm.rank(), t, &values)
                        .into_iter()
                        .map(|x| x / world as f32)
                        .collect();
                    match step_on(&mut z, &comm, &o, &g, &values) {
                        Stepped::Updated(v) => values = v.concat(),
                        Stepped::Skipped => panic!("no step is skipped here"),
                    }
                }
                let whole = z.gather_state(&comm, 0).unwrap();
                (z, values, whole)
            })
        })
        .collect();
    let mut zs = Vec::new();
    let (mut values, mut state) = (Vec::new(), None);
    for h in handles {
        let (z, v, s) = h.join().unwrap();
        zs.push(z);
        values = v;
        state = state.or(s);
    }
    (zs, values, state.unwrap())
}

/// A new world whose rank `i` was old rank `olds[i]` (`None`: a joiner) takes the old state;
/// each rank's result.
fn reshard(
    update: Update,
    stage: Stage,
    old: &[ZeroOptimizer],
    olds: &[Option<usize>],
) -> Vec<Result<(ZeroOptimizer, Option<WholeState>)>> {
    let handles: Vec<_> = MemoryTransport::mesh(olds.len())
        .into_iter()
        .zip(olds)
        .map(|(t, o)| {
            let mine = o.map(|o| old[o].clone());
            thread::spawn(move || {
                let comm = rank_comm(t);
                let mut z = ZeroOptimizer::new(stage, &tensors(), optimizer(update), &comm, 40)?
                    .with_summed_gradients()
                    .with_replica();
                z.reshard_from(&comm, mine.as_ref())?;
                let whole = z.gather_state(&comm, 0)?;
                Ok((z, whole))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn summed_weighted_gradients_with_replicas_equal_the_mean_without() {
    for update in updates() {
        for stage in [Stage::One, Stage::Two] {
            let (want, want_state) = reference(update, 4, 3);
            let (zs, got, state) = run_replicated(update, stage, 4, 3);
            close(&got, &want, &format!("{update:?} {stage:?} values"));
            let flat: Vec<f32> = state.slots.iter().flat_map(|s| s.1.clone()).collect();
            close(&flat, &want_state, &format!("{update:?} {stage:?} state"));
            // Each replica is its owner's state, bit for bit.
            for z in &zs {
                let r = z.replica.as_ref().unwrap();
                assert_eq!(
                    r.state, zs[r.of].state,
                    "{update:?} {stage:?} replica of {}",
                    r.of
                );
                assert_eq!(z.applied(), 3);
            }
        }
    }
}

#[test]
fn a_lost_rank_s_state_comes_back_from_its_replica_on_any_new_world() {
    for update in updates() {
        for stage in [Stage::One, Stage::Two] {
            let (zs, _, whole) = run_replicated(update, stage, 4, 3);
            // Old rank 2 died: 0, 1, 3 go on with a joiner; then 3 and 1 alone; then
            // 1 and 3 reversed with two joiners (rank 0 must be an old member).
            for olds in [
                vec![Some(0), Some(1), Some(3), None],
                vec![Some(3), Some(1)],
                vec![Some(1), None, Some(3), None, None],
                vec![Some(0), Some(1), Some(2), Some(3)],
            ] {
                let out = reshard(update, stage, &zs, &olds);
                let mut gathered = None;
                for r in out {
                    let (z, w) = r.unwrap_or_else(|e| panic!("{update:?} {olds:?}: {e}"));
                    assert_eq!(z.updates(), 3);
                    if let Some(r) = &z.replica {
                        assert_eq!(r.state.len(), z.state.len());
                    }
                    gathered = gathered.or(w);
                }
                let gathered = gathered.unwrap();
                assert_eq!(gathered.slots, whole.slots, "{update:?} {stage:?} {olds:?}");
                assert_eq!(gathered.updates, whole.updates);
            }
        }
    }
}

#[test]
fn neighbours_lost_together_are_an_error_on_every_rank_naming_them() {
    let update = Update::adam();
    let (zs, _, _) = run_replicated(update, Stage::Two, 4, 2);
    // Old ranks 1 and 2 (2's replica is on 1) both gone.
    for r in reshard(update, Stage::Two, &zs, &[Some(0), Some(3), None]) {
        let e = r.expect_err("an error on every rank").to_string();
        assert!(e.contains("old rank(s) [2]"), "{e}");
    }
    // A joiner as rank 0: refused on every rank, no hang.
    for r in reshard(
        update,
        Stage::Two,
        &zs,
        &[None, Some(0), Some(1), Some(2), Some(3)],
    ) {
        assert!(r.is_err());
    }
}

mod clip;

mod exchange;

mod params;

mod stream;
