//! The update rules, as plain functions on flat `f32` slices (the server's shard or the
//! worker's whole vector). Window `W`, server parameters `θ`, worker parameters `w`:
//!
//! | mode | worker, every `W` steps | server |
//! |------|-------------------------|--------|
//! | `sync` | pushes its gradient each step | averages the gradients weighted by samples, then one step of its optimizer ([`crate::flat::optim`]: SGD with momentum, Adam, AdamW; state per shard) |
//! | `downpour` | `Δ = w − w_at_last_pull`, pushes `Δ`, pulls `θ` | `θ ← θ + Δ` |
//! | `adag` | as downpour | `θ ← θ + Δ / W` |
//! | `dynsgd` | as downpour | `θ ← θ + Δ / (staleness + 1)`, staleness = server updates since that worker's pull |
//! | `easgd` | pulls `θ`, `E = α (w − θ)` with `α = η ρ`, `w ← w − E`, pushes `E` | `θ ← θ + E` |
//!
//! Sources: DOWNPOUR, Dean et al., "Large Scale Distributed Deep Networks" (NIPS 2012), as
//! dist-keras implements it (workers send the change of their weights, not gradients); ADAG,
//! Hermans, "On Scalable Deep Learning and Parallelizing Gradient Descent" (2017), the
//! dist-keras author's thesis; DynSGD, Jiang et al., "Heterogeneity-aware Distributed
//! Parameter Servers" (SIGMOD 2017); asynchronous EASGD, Zhang, Choromanska and LeCun, "Deep
//! learning with Elastic Averaging SGD" (NIPS 2015), Algorithm 1. Between exchanges, workers of
//! the asynchronous modes take plain SGD steps `w ← w − η g` locally.

/// `params ← params − lr · v` with `v ← momentum · v + grad` (PyTorch's and Burn's SGD with
/// momentum, no dampening; the first step's `v` is the gradient since `v` starts at zero).
pub fn sgd_momentum(
    params: &mut [f32],
    grad: &[f32],
    velocity: &mut [f32],
    lr: f32,
    momentum: f32,
) {
    for ((p, g), v) in params.iter_mut().zip(grad).zip(velocity.iter_mut()) {
        *v = momentum * *v + g;
        *p -= lr * *v;
    }
}

/// `params ← params − lr · grad` (a worker's local step in the asynchronous modes).
pub fn sgd(params: &mut [f32], grad: &[f32], lr: f32) {
    for (p, g) in params.iter_mut().zip(grad) {
        *p -= lr * g;
    }
}

/// `θ ← θ + scale · Δ`: the server side of downpour (scale 1), adag (1 / W), dynsgd
/// (1 / (staleness + 1)) and easgd (1, `Δ` being `E`).
pub fn add_scaled(theta: &mut [f32], delta: &[f32], scale: f32) {
    for (t, d) in theta.iter_mut().zip(delta) {
        *t += scale * d;
    }
}

/// The asynchronous EASGD exchange on the worker: `E = α (w − θ)`, `w ← w − E`; returns `E`
/// for the server to add.
pub fn easgd_elastic(w: &mut [f32], theta: &[f32], alpha: f32) -> Vec<f32> {
    w.iter_mut()
        .zip(theta)
        .map(|(wi, t)| {
            let e = alpha * (*wi - t);
            *wi -= e;
            e
        })
        .collect()
}

/// The sum of the squares of `grad`, in f64.
pub fn squares(grad: &[f32]) -> f64 {
    grad.iter().map(|&g| f64::from(g) * f64::from(g)).sum()
}

/// Gradient clipping by the global norm, PyTorch's `clip_grad_norm_` rule: `grad` multiplied
/// by `max_norm / (norm + 1e-6)` where that is below 1, `norm` the square root of `squares`
/// (the sum over every piece of the gradient: the shards of all servers, or this vector
/// alone). Returns the norm before clipping.
pub fn clip_to_norm(grad: &mut [f32], squares: f64, max_norm: f64) -> f64 {
    let norm = squares.max(0.0).sqrt();
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        let c = coef as f32;
        grad.iter_mut().for_each(|g| *g *= c);
    }
    norm
}

/// Gradients of several workers averaged weighted by their sample counts.
pub fn weighted_mean(grads: &[(u64, Vec<f32>)]) -> Vec<f32> {
    // Counts come from the workers' messages: summed in f64, which cannot overflow.
    let total: f64 = grads.iter().map(|g| g.0 as f64).sum();
    let len = grads.first().map_or(0, |g| g.1.len());
    let mut out = vec![0f32; len];
    if total == 0.0 {
        return out;
    }
    for (n, g) in grads {
        let w = (*n as f64 / total) as f32;
        for (o, x) in out.iter_mut().zip(g) {
            *o += w * x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_do_what_the_table_says() {
        let mut p = vec![1.0, 2.0];
        let mut v = vec![0.0, 0.0];
        sgd_momentum(&mut p, &[1.0, -1.0], &mut v, 0.1, 0.9);
        assert_eq!(v, vec![1.0, -1.0]);
        sgd_momentum(&mut p, &[1.0, -1.0], &mut v, 0.1, 0.9);
        assert!((p[0] - (1.0 - 0.1 - 0.19)).abs() < 1e-6, "{p:?}");

        let mut theta = vec![1.0, 1.0];
        add_scaled(&mut theta, &[2.0, -4.0], 0.5);
        assert_eq!(theta, vec![2.0, -1.0]);

        // EASGD moves the worker and the centre towards each other by the same amount.
        let mut w = vec![3.0, 0.0];
        let e = easgd_elastic(&mut w, &[1.0, 0.0], 0.25);
        assert_eq!(e, vec![0.5, 0.0]);
        assert_eq!(w, vec![2.5, 0.0]);

        let m = weighted_mean(&[(1, vec![4.0]), (3, vec![0.0])]);
        assert_eq!(m, vec![1.0]);

        // Clipping: (3, 4) has norm 5; to 1 it becomes (0.6, 0.8) (PyTorch's 1e-6 aside);
        // a bound above the norm leaves it; the squares of other pieces count too.
        let mut g = vec![3.0, 4.0];
        assert_eq!(squares(&g), 25.0);
        assert_eq!(clip_to_norm(&mut g, 25.0, 1.0), 5.0);
        assert!(
            (g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6,
            "{g:?}"
        );
        let mut g = vec![3.0, 4.0];
        clip_to_norm(&mut g, 25.0, 10.0);
        assert_eq!(g, vec![3.0, 4.0]);
        clip_to_norm(&mut g, 100.0, 5.0);
        assert!(
            (g[0] - 1.5).abs() < 1e-6,
            "a norm of 10 over the pieces halves: {g:?}"
        );
    }
}
