//! The weight gradient of a 3x3 stride-1 convolution by F(2x2, 3x3): the forward's products
//! `M[co][e][t] = Σ_ci U[co][e][ci] · V[ci][e][t]` turned around, for every tile `t` and the 16
//! points `e` of the transformed patch:
//!
//! - input: `V[ci][e][t]`, the forward's transform of each 4x4 patch;
//! - output gradient: `dM[co][e][t] = (A dy A')[e]` for each tile's 2x2 gradient `dy` (zero
//!   past the output's edge), the transpose of the forward's output transform;
//! - products: `dU[e] = Σ_t dM[·][e][t] · V[·][e][t]ᵀ`, 16 GEMMs of `Co x T` by `T x Ci` whose
//!   depth is the tiles, added into one sum per run of images;
//! - weights: `dW[co][ci] = G' dU[·][co][ci] G`, once at the end (the transpose of the
//!   forward's weight transform).
//!
//! The products do 16 multiply-adds per tile and channel pair where one GEMM per kernel tap
//! over the pixels ([`crate::weight_grad::conv2d_weight_grad_shifted`]) does 36 for the same
//! four pixels. The transforms hold only 0, ±1 and ½, so the result rounds like the direct
//! sum within a few units in the last place of its largest values (tested against it).
//!
//! Images are summed in runs of [`RUN`], as the shifted weight gradient does: each run's sum
//! depends on its images alone, the runs go on the threads in parallel (or, with fewer runs
//! than threads, each band's transforms split by channels and its 16 products by `e`), and
//! the runs' sums are added in order. The result depends on the batch only, never on the
//! number of threads or on timing.

use std::ops::Range;

use rayon::prelude::*;

use super::{BAND_FLOATS, Geometry, line_floats, transform_input};
use crate::base::Out;
use crate::shape::ConvShape;

/// How many consecutive images one partial sum holds (the shifted weight gradient's
/// [`crate::weight_grad::SHIFTED_RUN`] too).
pub const RUN: usize = 4;

/// Whether [`conv2d_weight_grad`] beat the weight gradient the other paths give `s` (the
/// shifted products, or im2col's for wide layers), where [`super::applies`] holds, on this CPU: see
/// [`weight_grad_pays_on`].
pub fn weight_grad_pays(s: &ConvShape) -> bool {
    weight_grad_pays_on(s, wide_gemm())
}

/// Whether gemm runs its AVX-512 kernels here (this crate's `avx512` feature on a CPU that has
/// AVX-512).
fn wide_gemm() -> bool {
    #[cfg(all(feature = "avx512", target_arch = "x86_64"))]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(all(feature = "avx512", target_arch = "x86_64")))]
    {
        false
    }
}

/// [`weight_grad_pays`] with gemm's AVX-512 kernels (`wide`) or its AVX2 ones, as measured per
/// 3x3 stride-1 shape of VGG-16, ResNet-50 and DenseNet-121 at batch 16 (the paths alternated
/// in one process, best of 5; AMD EPYC Zen 5, 2 cores, 2026-12-02; the other path's time over
/// Winograd's; `kernels/examples/conv_paths.rs` times both per shape, "weight grad shifted"
/// and "weight grad Winograd"):
///
/// - AVX2 (the AVX2 build on the same CPU): Winograd won on every map of 14x14 or more,
///   DenseNet-121's 128→32 1.07-1.20x, ResNet-50's 1.59-1.69x, VGG-16's 1.16-1.92x, and lost
///   on 7x7 (0.80-0.81x: 16 tiles an image, a quarter of them past the edge);
/// - AVX-512: the other paths' products run near twice as fast while the transforms do not,
///   so Winograd won only with 64 channels or more on both sides and 784 to 12544 pixels, or
///   196 with at most 256 x 256 channels (ResNet-50 1.24-1.43x, VGG-16 1.18-1.72x; 512→512 on
///   14x14 tied, 1.00x), and lost
///   on DenseNet-121's 128→32 (0.85-0.95x), on 224x224 maps (0.73-0.88x) and on 7x7 (0.54x).
///
/// Two images or more (one would be one run on one thread).
pub fn weight_grad_pays_on(s: &ConvShape, wide: bool) -> bool {
    let [n, ci, ..] = s.input;
    let co = s.out_channels;
    let pixels = s.output().map_or(0, |[_, _, ho, wo]| ho * wo);
    if n < 2 || pixels < 196 {
        return false;
    }
    !wide || (ci >= 64 && co >= 64 && pixels <= 12544 && (pixels >= 784 || ci * co <= 256 * 256))
}

/// The weight gradient `[Co, Ci, 3, 3]` of a 3x3 stride-1 convolution from its input `x`
/// (`[N, Ci, H, W]`) and output gradient `dy` (`[N, Co, Ho, Wo]`), all row-major. Panics where
/// [`super::applies`] is false or the lengths do not match `s`.
pub fn conv2d_weight_grad(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    conv2d_weight_grad_in_bands(x, dy, s, BAND_FLOATS)
}

/// [`conv2d_weight_grad`] with bands of about `band_floats` floats of `V` and `dM` (for
/// measuring and testing).
pub fn conv2d_weight_grad_in_bands(
    x: &[f32],
    dy: &[f32],
    s: &ConvShape,
    band_floats: usize,
) -> Vec<f32> {
    let g = Geometry::checked(s, x, "weight gradient");
    let (n, ci, co) = (s.input[0], g.ci, g.co);
    assert_eq!(
        dy.len(),
        n * co * g.ho * g.wo,
        "winograd weight gradient: output gradient length for {s:?}"
    );
    if g.is_empty(n) {
        return vec![0f32; co * ci * 9];
    }
    let per_row = 16 * (ci + co) * g.tw;
    // Bands of the run's tile rows, across its images where they are small: the products'
    // depth is the band's tiles, and each adds into all of dU.
    let band_rows = (band_floats / per_row).clamp(1, RUN.min(n) * g.th);
    let runs: Vec<Range<usize>> = (0..n).step_by(RUN).map(|b| b..(b + RUN).min(n)).collect();
    let threads = rayon::current_num_threads().max(1);
    let mut sum = vec![0f32; 16 * co * ci];
    // Waves of one run per thread, so that as many partial sums as threads are held at once.
    for wave in runs.chunks(threads) {
        let partials: Vec<Vec<f32>> = if wave.len() < threads {
            let mut scratch = Scratch::new(&g, band_rows);
            wave.iter()
                .map(|run| run_sum(x, dy, &g, run.clone(), band_rows, &mut scratch, true))
                .collect()
        } else {
            wave.par_iter()
                .map_init(
                    || Scratch::new(&g, band_rows),
                    |scratch, run| run_sum(x, dy, &g, run.clone(), band_rows, scratch, false),
                )
                .collect()
        };
        for p in partials {
            for (a, b) in sum.iter_mut().zip(&p) {
                *a += b;
            }
        }
    }
    to_weights(&sum, co, ci)
}

/// Scratch for one band: `V` (`[Ci][16][T]`), `dM` (`[Co][16][T]`), the input transform's
/// lines and the gradient transform's (a tile row's two gradient rows, even and odd columns).
struct Scratch {
    v: Vec<f32>,
    m: Vec<f32>,
    lines: Vec<f32>,
    dy_lines: Vec<f32>,
}

impl Scratch {
    fn new(g: &Geometry, band_rows: usize) -> Self {
        let t = band_rows * g.tw;
        Scratch {
            v: vec![0f32; g.ci * 16 * t],
            m: vec![0f32; g.co * 16 * t],
            lines: vec![0f32; line_floats(g)],
            dy_lines: vec![0f32; 4 * g.tw],
        }
    }
}

/// `dU` (`[16][Co][Ci]`) of the images `run`: its tile rows in bands of `band_rows`, in order.
fn run_sum(
    x: &[f32],
    dy: &[f32],
    g: &Geometry,
    run: Range<usize>,
    band_rows: usize,
    scratch: &mut Scratch,
    parallel: bool,
) -> Vec<f32> {
    let mut du = vec![0f32; 16 * g.co * g.ci];
    let (first, end) = (run.start * g.th, run.end * g.th);
    for r in (first..end).step_by(band_rows) {
        band(
            x,
            dy,
            g,
            r..(r + band_rows).min(end),
            &mut du,
            scratch,
            parallel,
        );
    }
    du
}

/// Adds the products of the batch's tile rows `rows` to `du` (`[16][Co][Ci]`). `parallel`:
/// split the transforms by channels and the products by `e` across the threads.
fn band(
    x: &[f32],
    dy: &[f32],
    g: &Geometry,
    rows: Range<usize>,
    du: &mut [f32],
    scratch: &mut Scratch,
    parallel: bool,
) {
    let t = rows.len() * g.tw;
    let (ci, co) = (g.ci, g.co);
    let v = &mut scratch.v[..ci * 16 * t];
    let m = &mut scratch.m[..co * 16 * t];
    if parallel {
        v.par_chunks_mut(16 * t).enumerate().for_each_init(
            || vec![0f32; line_floats(g)],
            |lines, (c, v)| transform_input(x, c, g, rows.clone(), v, lines),
        );
        m.par_chunks_mut(16 * t).enumerate().for_each_init(
            || vec![0f32; 4 * g.tw],
            |lines, (o, m)| transform_gradient(dy, o, g, rows.clone(), m, lines),
        );
    } else {
        for (c, v) in v.chunks_mut(16 * t).enumerate() {
            transform_input(x, c, g, rows.clone(), v, &mut scratch.lines);
        }
        for (o, m) in m.chunks_mut(16 * t).enumerate() {
            transform_gradient(dy, o, g, rows.clone(), m, &mut scratch.dy_lines);
        }
    }
    let (vp, mp, dup) = (
        v.as_ptr() as usize,
        m.as_ptr() as usize,
        Out(du.as_mut_ptr()),
    );
    let product = |e: usize| {
        // SAFETY: dU's block for point e (Co x Ci, contiguous) is read and written by this
        // product only; dM's rows for e (Co x T, row stride 16·T) and V's (Ci x T, read as
        // its transpose: T x Ci with column stride 16·T) are read.
        unsafe {
            gemm::gemm(
                co,
                ci,
                t,
                dup.at(e * co * ci),
                1,
                ci as isize,
                true,
                (mp as *const f32).wrapping_add(e * t),
                1,
                (16 * t) as isize,
                (vp as *const f32).wrapping_add(e * t),
                (16 * t) as isize,
                1,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    if parallel {
        (0..16).into_par_iter().for_each(product);
    } else {
        (0..16).for_each(product);
    }
}

/// `dM[o][e][·]` (`m`, `16 x t`) for the batch's tile rows `rows` of output channel `o` of `dy`
/// (`[N, Co, Ho, Wo]`); `lines` is `4 · tw` floats of scratch.
///
/// A tile's gradient `[[a, b], [c, d]]` (zero past the output's edge) becomes `A dy`, rows
/// `(a, b)`, `(a + c, b + d)`, `(a - c, b - d)`, `(-c, -d)`, and each row `(p, q)` of it
/// `p, p + q, p - q, -q` across (`A = [[1, 0], [1, 1], [1, -1], [0, -1]]`, the forward's
/// output transform `A'` transposed). Each gradient row is read as its even and its odd
/// columns, so every combination runs over contiguous lines.
fn transform_gradient(
    dy: &[f32],
    o: usize,
    g: &Geometry,
    rows: Range<usize>,
    m: &mut [f32],
    lines: &mut [f32],
) {
    let t = rows.len() * g.tw;
    let n = g.tw;
    let (top, bottom) = lines[..4 * n].split_at_mut(2 * n);
    for (k, row) in rows.enumerate() {
        let (b, tr) = g.split(row);
        let plane = &dy[(b * g.co + o) * g.ho * g.wo..][..g.ho * g.wo];
        for (r, line) in [&mut *top, &mut *bottom].into_iter().enumerate() {
            line.fill(0.0);
            let y = 2 * tr + r;
            if y >= g.ho {
                continue;
            }
            let src = &plane[y * g.wo..][..g.wo];
            let (even, odd) = line.split_at_mut(n);
            for (d, &v) in even.iter_mut().zip(src.iter().step_by(2)) {
                *d = v;
            }
            for (d, &v) in odd.iter_mut().zip(src.iter().skip(1).step_by(2)) {
                *d = v;
            }
        }
        let (e0, o0) = top.split_at(n);
        let (e1, o1) = bottom.split_at(n);
        let base = k * n;
        for i in 0..4 {
            let (m0, mr) = m[4 * i * t..].split_at_mut(t);
            let (m1, mr) = mr.split_at_mut(t);
            let (m2, m3) = mr.split_at_mut(t);
            let (m0, m1, m2, m3) = (
                &mut m0[base..][..n],
                &mut m1[base..][..n],
                &mut m2[base..][..n],
                &mut m3[base..][..n],
            );
            let four = [m0, m1, m2, m3];
            match i {
                0 => spread(four, |tc| (e0[tc], o0[tc])),
                1 => spread(four, |tc| (e0[tc] + e1[tc], o0[tc] + o1[tc])),
                2 => spread(four, |tc| (e0[tc] - e1[tc], o0[tc] - o1[tc])),
                _ => spread(four, |tc| (-e1[tc], -o1[tc])),
            }
        }
    }
}

/// One row `(p, q)` of `A dy` across: `p, p + q, p - q, -q` into the four lines `m` (a generic
/// function, so that each row's loop is compiled with its own combination and vectorizes).
#[inline(always)]
fn spread([m0, m1, m2, m3]: [&mut [f32]; 4], pq: impl Fn(usize) -> (f32, f32)) {
    for tc in 0..m0.len() {
        let (p, q) = pq(tc);
        m0[tc] = p;
        m1[tc] = p + q;
        m2[tc] = p - q;
        m3[tc] = -q;
    }
}

/// `dW` (`[Co][Ci][3][3]`) from `dU` (`[16][Co][Ci]`): `G' u G` for each pair's 4x4 `u`, with
/// `G' = [[1, ½, ½, 0], [0, ½, -½, 0], [0, ½, ½, 1]]` (the forward's weight transform `G`
/// transposed).
fn to_weights(du: &[f32], co: usize, ci: usize) -> Vec<f32> {
    let plane = co * ci;
    let mut dw = vec![0f32; plane * 9];
    dw.par_chunks_mut(ci * 9).enumerate().for_each(|(o, dw)| {
        for (c, w) in dw.chunks_exact_mut(9).enumerate() {
            let u = |e: usize| du[e * plane + o * ci + c];
            // u G: each row's four points to three.
            let across: [[f32; 3]; 4] = std::array::from_fn(|i| {
                let (a, b, d, f) = (u(4 * i), u(4 * i + 1), u(4 * i + 2), u(4 * i + 3));
                [a + 0.5 * (b + d), 0.5 * (b - d), 0.5 * (b + d) + f]
            });
            // G' (u G): the same down each column.
            let [r0, r1, r2, r3] = across;
            for j in 0..3 {
                w[j] = r0[j] + 0.5 * (r1[j] + r2[j]);
                w[3 + j] = 0.5 * (r1[j] - r2[j]);
                w[6 + j] = 0.5 * (r1[j] + r2[j]) + r3[j];
            }
        }
    });
    dw
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight_grad::conv2d_weight_grad_im2col;
    use crate::winograd::applies;
    use crate::winograd::tests::values;

    fn shape(n: usize, ci: usize, co: usize, h: usize, w: usize, p: usize) -> ConvShape {
        ConvShape {
            input: [n, ci, h, w],
            out_channels: co,
            kernel: [3, 3],
            stride: [1, 1],
            padding: [p, p],
            dilation: [1, 1],
        }
    }

    #[test]
    fn equals_the_direct_sum_on_odd_and_even_maps_every_padding_and_band() {
        // (batch, in, out, height, width, padding, band floats): odd and even sides, sides
        // smaller than a tile, one band per image and many (a band of one tile row), batch 1
        // (one run: phases in parallel), 5 (a run and a remainder) and 9 (runs in waves).
        let cases = [
            (1, 16, 16, 8, 8, 1, BAND_FLOATS),
            (1, 17, 19, 7, 9, 1, BAND_FLOATS),
            (1, 16, 24, 7, 5, 1, 1),
            (5, 20, 16, 9, 6, 1, 1),
            (3, 16, 16, 6, 7, 0, BAND_FLOATS),
            (2, 16, 18, 5, 5, 2, 3000),
            (1, 32, 16, 3, 3, 0, BAND_FLOATS),
            (2, 16, 16, 2, 2, 1, BAND_FLOATS),
            (9, 8, 5, 4, 3, 1, 500),
            (2, 64, 32, 14, 14, 1, 40_000),
            (3, 3, 2, 1, 1, 1, BAND_FLOATS),
        ];
        for (i, &(n, ci, co, h, w, p, band)) in cases.iter().enumerate() {
            let s = shape(n, ci, co, h, w, p);
            assert!(applies(&s), "{s:?}");
            let [_, _, ho, wo] = s.output().unwrap_or_default();
            let x = values(n * ci * h * w, 2 * i as u64);
            let dy = values(n * co * ho * wo, 2 * i as u64 + 1);
            let want = conv2d_weight_grad_im2col(&x, &dy, &s);
            let got = conv2d_weight_grad_in_bands(&x, &dy, &s, band);
            assert_eq!(got.len(), want.len(), "{s:?}");
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * scale.max(1.0),
                    "{s:?} band {band}: element {k}: winograd {a}, direct {b}"
                );
            }
        }
    }

    #[test]
    fn takes_the_measured_shapes_on_each_vector_width() {
        // (in, out, side, AVX2, AVX-512): the measurement in `weight_grad_pays_on`'s doc.
        let measured = [
            (128, 32, 56, true, false),
            (128, 32, 14, true, false),
            (128, 32, 7, false, false),
            (64, 64, 56, true, true),
            (256, 256, 14, true, true),
            (512, 512, 14, true, false),
            (512, 512, 7, false, false),
            (3, 64, 224, true, false),
            (64, 64, 224, true, false),
            (64, 128, 112, true, true),
            (512, 512, 28, true, true),
        ];
        for (ci, co, side, avx2, avx512) in measured {
            let s = shape(16, ci, co, side, side, 1);
            assert_eq!(weight_grad_pays_on(&s, false), avx2, "AVX2 {s:?}");
            assert_eq!(weight_grad_pays_on(&s, true), avx512, "AVX-512 {s:?}");
            // One image: never (one run on one thread).
            assert!(!weight_grad_pays_on(
                &shape(1, ci, co, side, side, 1),
                false
            ));
        }
    }

    #[test]
    fn the_same_bits_on_any_number_of_threads_and_nothing_from_nothing() {
        let s = shape(6, 12, 10, 9, 8, 1);
        let [_, _, ho, wo] = s.output().unwrap_or_default();
        let x = values(6 * 12 * 9 * 8, 7);
        let dy = values(6 * 10 * ho * wo, 8);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            pool.install(|| conv2d_weight_grad_in_bands(&x, &dy, &s, 2000))
        };
        let one = on(1);
        for threads in [2, 3, 4] {
            assert!(
                on(threads)
                    .iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{threads} threads changed the gradient"
            );
        }
        // No output channels, no images, an all-zero gradient.
        assert!(conv2d_weight_grad(&x, &[], &shape(6, 12, 0, 9, 8, 1)).is_empty());
        let none = shape(0, 12, 10, 9, 8, 1);
        assert_eq!(conv2d_weight_grad(&[], &[], &none), vec![0f32; 10 * 12 * 9]);
        let zero = conv2d_weight_grad(&x, &vec![0f32; dy.len()], &s);
        assert!(zero.iter().all(|&v| v == 0.0));
    }
}
