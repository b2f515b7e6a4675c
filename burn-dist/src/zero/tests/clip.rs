//! `ZeroOptimizer::with_clip_norm` against one process clipping the mean gradient.

use super::*;

/// Plain momentum SGD: the step scales with the gradient, so a clip left out would show.
const SGD: Update = Update::Sgd {
    momentum: 0.9,
    nesterov: false,
};

/// `with_clip_norm`: every rank's segments scaled by the whole averaged gradient's norm, as
/// one process clips the mean gradient (PyTorch's rule), with and without a replica (whose
/// segments count once: their owner's).
#[test]
fn clipping_takes_the_norm_over_every_ranks_segments() {
    let (world, steps, max) = (3usize, 3u64, 0.1f64);
    for stage in [Stage::One, Stage::Two] {
        for replica in [false, true] {
            let handles: Vec<_> = MemoryTransport::mesh(world)
                .into_iter()
                .map(|t| {
                    thread::spawn(move || {
                        let comm = rank_comm(t);
                        let o = optimizer(SGD);
                        let mut z = ZeroOptimizer::new(stage, &tensors(), o.clone(), &comm, 40)
                            .unwrap()
                            .with_clip_norm(Some(max));
                        if replica {
                            z = z.with_replica();
                        }
                        let mut values = start_values();
                        for t in 0..steps {
                            let g = grad(comm.rank(), t, &values);
                            match step_on(&mut z, &comm, &o, &g, &values) {
                                Stepped::Updated(v) => values = v.concat(),
                                Stepped::Skipped => panic!("no step is skipped"),
                            }
                        }
                        values
                    })
                })
                .collect();
            // One process: the mean gradient clipped, then the same rule.
            let o = optimizer(SGD);
            let mut want = start_values();
            let mut state = Vec::new();
            let mut clipped = false;
            for t in 0..steps {
                let mut mean = vec![0f32; 23];
                for r in 0..world {
                    for (m, g) in mean.iter_mut().zip(grad(r, t, &want)) {
                        *m += g / world as f32;
                    }
                }
                let norm = mean
                    .iter()
                    .map(|&g| f64::from(g).powi(2))
                    .sum::<f64>()
                    .sqrt();
                let coef = max / (norm + 1e-6);
                if coef < 1.0 {
                    clipped = true;
                    mean.iter_mut().for_each(|g| *g *= coef as f32);
                }
                o.step(t, &mut want, &mean, &mut state);
            }
            assert!(clipped, "the bound binds");
            for h in handles {
                close(
                    &h.join().unwrap(),
                    &want,
                    &format!("stage {stage:?}, replica {replica}"),
                );
            }
        }
    }
}
