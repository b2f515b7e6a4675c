//! Batch normalization with the batch's statistics, optionally followed by ReLU, forward and
//! backward in few passes over memory, on plain `f32` slices (`[N, C, S]` row-major, S = H·W).
//!
//! Burn's generic `batch_norm_train` and its backward (`burn-backend`, `modules/base.rs`) are
//! composed of tensor ops: each statistic swaps batch and channel axes (a full copy on Flex)
//! and every elementwise step is its own pass, and ReLU adds two more. Together they took 28%
//! of a ResNet-50 step's ops (docs/benchmarks/cpu-models.md, "CPU profile"). Here:
//! - forward: one pass for the mean, one for the variance (centred, as Burn computes it), one
//!   that writes the normalized, scaled, shifted and rectified output;
//! - backward: one pass for the two per-channel sums, one that writes the input gradient.
//!   The ReLU mask is recomputed from the input, so the output need not be kept.
//!
//! Channels reduce in parallel and planes are written in parallel; each channel's sums run in a
//! fixed order, so results are deterministic.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::{on_width, vector_width};

/// Sum of a plane with eight independent accumulators (vectorizable), in f64 at the end.
#[inline(always)]
fn plane_sum(values: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut acc = [0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    let tail: f32 = rest.iter().map(|&v| f(v)).sum();
    acc.iter().map(|&a| a as f64).sum::<f64>() + tail as f64
}

/// `(Σg, Σg·x̂)` over one plane, `g` being `dy` where `x·a + b` passed the ReLU (all of it
/// without `relu`) and `x̂ = (x - m)·is`: sixteen independent lanes so the loop vectorizes (one
/// running sum is a chain of dependent additions), in f64 at the end. The lanes add in a
/// fixed order, so the result is deterministic.
#[inline(always)]
fn masked_sums(xs: &[f32], gs: &[f32], a: f32, b: f32, m: f32, is: f32, relu: bool) -> (f64, f64) {
    const L: usize = 16;
    let (mut sg, mut sgx) = ([0f32; L], [0f32; L]);
    let pass = |v: f32, g: f32| if relu && v * a + b <= 0.0 { 0.0 } else { g };
    let (xc, gc) = (xs.chunks_exact(L), gs.chunks_exact(L));
    let (xr, gr) = (xc.remainder(), gc.remainder());
    for (xv, gv) in xc.zip(gc) {
        for l in 0..L {
            let g = pass(xv[l], gv[l]);
            sg[l] += g;
            sgx[l] += g * (xv[l] - m);
        }
    }
    let (mut tg, mut tgx) = (0f32, 0f32);
    for (&v, &g) in xr.iter().zip(gr) {
        let g = pass(v, g);
        tg += g;
        tgx += g * (v - m);
    }
    let total =
        |lanes: [f32; L], tail: f32| lanes.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
    (total(sg, tg), total(sgx, tgx) * is as f64)
}

/// The per-channel statistics of the batch: `(mean, biased variance)`.
pub fn statistics(x: &[f32], shape: [usize; 3]) -> (Vec<f32>, Vec<f32>) {
    statistics_after(x, shape, &[], &[])
}

/// [`statistics`] of an input whose first `known_mean.len()` channels are the same values as
/// an earlier input's, whose statistics (`known_mean`, `known_var`) this function computed:
/// those are taken as they are (a channel's statistics depend on its values alone, in a fixed
/// order, so they are the same bits), the rest computed. DenseNet: a layer's input is the
/// layer before's input with its new channels after it.
pub fn statistics_after(
    x: &[f32],
    [n, c, s]: [usize; 3],
    known_mean: &[f32],
    known_var: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(x.len(), n * c * s, "batch norm: input length");
    let known = known_mean.len();
    assert!(
        known_var.len() == known && known <= c,
        "batch norm: {known} known means and {} known variances for {c} channels",
        known_var.len()
    );
    let count = (n * s).max(1) as f64;
    let wide = vector_width();
    (0..c)
        .into_par_iter()
        .map(|ch| {
            if ch < known {
                return (known_mean[ch], known_var[ch]);
            }
            on_width(
                wide,
                #[inline(always)]
                || {
                    let plane = |b: usize| &x[(b * c + ch) * s..(b * c + ch + 1) * s];
                    let mean = (0..n).map(|b| plane_sum(plane(b), |v| v)).sum::<f64>() / count;
                    let m = mean as f32;
                    let var = (0..n)
                        .map(|b| plane_sum(plane(b), |v| (v - m) * (v - m)))
                        .sum::<f64>()
                        / count;
                    (m, var as f32)
                },
            )
        })
        .unzip()
}

/// The forward pass: `y = γ·(x - mean)/sqrt(var + ε) + β`, then `max(y, 0)` when `relu`.
/// Returns `(y, mean, variance)`.
pub fn forward(
    x: &[f32],
    shape: [usize; 3],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f64,
    relu: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    forward_after(x, shape, gamma, beta, [&[], &[]], epsilon, relu)
}

/// [`forward`] with the first channels' statistics known ([`statistics_after`]): the same
/// result, two passes fewer over those channels.
pub fn forward_after(
    x: &[f32],
    shape: [usize; 3],
    gamma: &[f32],
    beta: &[f32],
    [known_mean, known_var]: [&[f32]; 2],
    epsilon: f64,
    relu: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let c = shape[1];
    assert!(
        gamma.len() == c && beta.len() == c,
        "batch norm: {c} channels, γ {}, β {}",
        gamma.len(),
        beta.len()
    );
    let (mean, var) = statistics_after(x, shape, known_mean, known_var);
    let (scale, shift) = crate::epilogue::affine(gamma, beta, &mean, &var, epsilon);
    (scale_shift(x, shape, &scale, &shift, relu), mean, var)
}

/// `y = x·scale[c] + shift[c]` per channel `c`, then `max(y, 0)` when `relu`: one pass.
pub fn scale_shift(
    x: &[f32],
    [_, c, s]: [usize; 3],
    scale: &[f32],
    shift: &[f32],
    relu: bool,
) -> Vec<f32> {
    assert!(
        scale.len() == c && shift.len() == c,
        "scale and shift: {c} channels"
    );
    let wide = vector_width();
    // SAFETY: the closure writes every value of its plane (`out` zipped with the input).
    unsafe {
        crate::base::par_planes(x.len(), s, |i, out| {
            let (a, b) = (scale[i % c], shift[i % c]);
            let inp = &x[i * s..(i + 1) * s];
            on_width(
                wide,
                #[inline(always)]
                || scale_shift_plane(out, inp, a, b, relu),
            )
        })
    }
}

/// Batch norm with fixed statistics (inference): `y = γ·(x - mean)/sqrt(var + ε) + β`, then
/// `max(y, 0)` when `relu`, in one pass over `x` (the statistics folded into a scale and a
/// shift per channel). Burn's generic `batch_norm` makes one pass per arithmetic step.
pub fn inference(
    x: &[f32],
    shape: [usize; 3],
    [gamma, beta, mean, var]: [&[f32]; 4],
    epsilon: f64,
    relu: bool,
) -> Vec<f32> {
    let c = shape[1];
    assert!(
        [gamma, beta, mean, var].iter().all(|v| v.len() == c),
        "batch norm: {c} channels, γ {}, β {}, mean {}, variance {}",
        gamma.len(),
        beta.len(),
        mean.len(),
        var.len()
    );
    assert_eq!(
        x.len(),
        shape.iter().product::<usize>(),
        "batch norm: input length"
    );
    let (scale, shift) = crate::epilogue::affine(gamma, beta, mean, var, epsilon);
    scale_shift(x, shape, &scale, &shift, relu)
}

/// The gradients `(dx, dγ, dβ)` of [`forward`] for the output gradient `dy`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &[f32],
    shape: [usize; 3],
    gamma: &[f32],
    beta: &[f32],
    mean: &[f32],
    var: &[f32],
    epsilon: f64,
    relu: bool,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let [n, c, s] = shape;
    assert_eq!(x.len(), n * c * s, "batch norm backward: input length");
    assert_eq!(
        dy.len(),
        x.len(),
        "batch norm backward: output gradient length"
    );
    let (scale, shift) = crate::epilogue::affine(gamma, beta, mean, var, epsilon);
    let inv_std: Vec<f32> = var
        .iter()
        .map(|&v| 1.0 / (v as f64 + epsilon).sqrt() as f32)
        .collect();
    let wide = vector_width();
    // g = dy where the output passed the ReLU; Σg and Σg·x̂ per channel.
    let (sum_g, sum_gx): (Vec<f64>, Vec<f64>) = (0..c)
        .into_par_iter()
        .map(|ch| {
            let (a, b, m, is) = (scale[ch], shift[ch], mean[ch], inv_std[ch]);
            on_width(
                wide,
                #[inline(always)]
                || {
                    let mut sg = 0f64;
                    let mut sgx = 0f64;
                    for bi in 0..n {
                        let range = (bi * c + ch) * s..(bi * c + ch + 1) * s;
                        let (xs, gs) = (&x[range.clone()], &dy[range]);
                        let (pg, pgx) = masked_sums(xs, gs, a, b, m, is, relu);
                        sg += pg;
                        sgx += pgx;
                    }
                    (sg, sgx)
                },
            )
        })
        .unzip();
    let count = (n * s).max(1) as f64;
    // SAFETY: the closure writes every value of its plane (`out` zipped with the input).
    let dx = unsafe {
        crate::base::par_planes(x.len(), s, |i, out| {
            let ch = i % c;
            let (xs, gs) = (&x[i * s..(i + 1) * s], &dy[i * s..(i + 1) * s]);
            let (a, b, m, is) = (scale[ch], shift[ch], mean[ch], inv_std[ch]);
            let mg = (sum_g[ch] / count) as f32;
            let mgx = (sum_gx[ch] / count) as f32;
            // dx = γ/σ · (g - mean(g) - x̂·mean(g·x̂))
            on_width(
                wide,
                #[inline(always)]
                || input_grad_plane(out, [xs, gs], [a, b, m, is], [mg, mgx], relu),
            )
        })
    };
    let dgamma = sum_gx.iter().map(|&v| v as f32).collect();
    let dbeta = sum_g.iter().map(|&v| v as f32).collect();
    (dx, dgamma, dbeta)
}

/// `out = max(x·a + b, 0)` (without `relu`: `x·a + b`) over one plane. The loops live in
/// functions of slices, one per case: inlined into a closure that captures the output, the
/// loop lost its vectorization in the AVX2 instance (scalar `vmulss`; DenseNet-121's training
/// step with gemm's AVX2 kernels took 3.2-4.0 s against 2.4-3.3 before the width change).
#[inline(always)]
fn scale_shift_plane(out: &mut [MaybeUninit<f32>], x: &[f32], a: f32, b: f32, relu: bool) {
    if relu {
        for (o, &v) in out.iter_mut().zip(x) {
            o.write((v * a + b).max(0.0));
        }
    } else {
        for (o, &v) in out.iter_mut().zip(x) {
            o.write(v * a + b);
        }
    }
}

/// One plane of `dx = γ/σ · (g - mean(g) - x̂·mean(g·x̂))`, `g` being `dy` where `x·a + b`
/// passed the ReLU (all of it without `relu`), `x̂ = (x - m)·is`.
#[inline(always)]
fn input_grad_plane(
    out: &mut [MaybeUninit<f32>],
    [xs, gs]: [&[f32]; 2],
    [a, b, m, is]: [f32; 4],
    [mg, mgx]: [f32; 2],
    relu: bool,
) {
    if relu {
        for ((o, &v), &g) in out.iter_mut().zip(xs).zip(gs) {
            let g = if v * a + b <= 0.0 { 0.0 } else { g };
            o.write(a * (g - mg - (v - m) * is * mgx));
        }
    } else {
        for ((o, &v), &g) in out.iter_mut().zip(xs).zip(gs) {
            o.write(a * (g - mg - (v - m) * is * mgx));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::tests::under_each_width;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104729) % 1009) as f32 / 504.0 - 1.0) * 1.7)
            .collect()
    }

    #[test]
    fn every_vector_width_gives_the_same_bits() {
        // Planes of 49 and 13 values (remainders after 16 and 8 lanes), and one of 64.
        for (k, shape) in [[3, 5, 49], [2, 4, 13], [2, 3, 64]].into_iter().enumerate() {
            let [n, c, s] = shape;
            let (x, dy) = (values(n * c * s, k), values(n * c * s, k + 10));
            let (gamma, beta) = (values(c, k + 20), values(c, k + 30));
            for relu in [false, true] {
                let runs = under_each_width(|| {
                    let (y, mean, var) = forward(&x, shape, &gamma, &beta, 1e-5, relu);
                    let known = forward_after(
                        &x,
                        shape,
                        &gamma,
                        &beta,
                        [&mean[..2], &var[..2]],
                        1e-5,
                        relu,
                    );
                    let fixed = inference(&x, shape, [&gamma, &beta, &mean, &var], 1e-5, relu);
                    let grads = backward(&x, shape, &gamma, &beta, &mean, &var, 1e-5, relu, &dy);
                    (y, mean, var, known, fixed, grads)
                });
                let (_, first) = &runs[0];
                assert_eq!(first.3, (first.0.clone(), first.1.clone(), first.2.clone()));
                for (width, got) in &runs[1..] {
                    assert!(got == first, "{shape:?}, relu {relu}: {width:?} differs");
                }
            }
        }
    }
}
