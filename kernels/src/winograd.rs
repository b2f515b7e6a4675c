//! 3x3 convolutions with stride 1 by Winograd's minimal filtering F(2x2, 3x3) (Lavin and Gray,
//! "Fast Algorithms for Convolutional Neural Networks", 2016): each 2x2 block of outputs
//! ("tile") from its 4x4 input patch with 16 multiplications per input channel instead of 36,
//! so the products that carry the work are 2.25 times smaller than im2col's.
//!
//! For every tile `t` and the 16 points `e` of the transformed patch:
//!
//! - weights: `U[co][e][ci] = (G g G')[e]` for each 3x3 kernel `g` (once per call);
//! - input: `V[ci][e][t] = (B' d B)[e]` for each 4x4 patch `d` (zero outside the image);
//! - products: `M[·][e][·] = U[·][e][·] · V[·][e][·]`, 16 GEMMs of `Co x Ci` by `Ci x T`;
//! - output: the 2x2 tile `A' m A` of each `m = M[co][·][t]`.
//!
//! `B`, `G` and `A` hold only 0, ±1 and ½, so the transforms are additions and the results
//! round like im2col's within a few units in the last place (tested against it).
//!
//! The weight gradient turns the same products around ([`conv2d_weight_grad`]: `V` as here, the
//! output gradient through `A`, 16 GEMMs over the tiles, then `G'` back to 3x3).
//!
//! The tiles go in bands of tile rows whose `V` and `M` fit [`BAND_FLOATS`]: with two images
//! or more, images in parallel and each band's products on its thread; with one, the bands in
//! turn, each band's transform split by channels and its 16 products by `e` across the
//! threads (no product is split, so no weight is packed twice).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::base::{Out, gemm_rows};
use crate::epilogue::Epilogue;
use crate::shape::ConvShape;

pub mod cache;
mod weight_grad;
pub use weight_grad::{
    conv2d_weight_grad, conv2d_weight_grad_in_bands, weight_grad_pays, weight_grad_pays_on,
};

/// Floats of `V` and `M` one band holds: measured on VGG-16's and ResNet-50's 3x3 layers
/// (`kernels/examples/forward_b1.rs`, `HEARTH_WINOGRAD_BAND`).
pub const BAND_FLOATS: usize = 1 << 20;

/// Whether [`conv2d_forward`] computes `s`: a 3x3 kernel, stride and dilation 1, padding up to
/// 2.
pub fn applies(s: &ConvShape) -> bool {
    s.kernel == [3, 3]
        && s.stride == [1, 1]
        && s.dilation == [1, 1]
        && s.padding.iter().all(|&p| p <= 2)
        && s.output().is_some()
}

/// Whether [`conv2d_forward`] beat im2col's GEMM on `s` where it applies, as measured per
/// shape of VGG-16, ResNet-50 and DenseNet-121 (`kernels/examples/forward_b1.rs`, batch 1 and
/// 16, 2-core AMD EPYC Zen 4 with AVX-512, 2026-12-02):
///
/// - at least 64 input channels: the products' depth is the input channels, where im2col's is
///   9 times that (DenseNet-121's input gradient, a 32 → 128 forward, lost at every size:
///   21.3 against 21.6 ms at batch 16 on 56x56, 0.16 against 0.11 ms at batch 1 on 14x14),
///   and at least 16 output channels;
/// - at least 784 output pixels an image, or 196 with at most 256 x 256 channels (per image,
///   never over the batch, so that one image's result does not depend on its batch): the
///   transformed weights (16/9 of the weights' size, made at every call) and their packing
///   cost what the products save on small maps (batch 1: ResNet-50's 512 → 512 on 7x7 took 4.7
///   against 3.2 ms, VGG-16's on 14x14 6.1 against 5.5, ResNet-50's 256 → 256 on 14x14 2.1
///   against 2.6; at batch 16 every one of those won, 1.5-1.9x, but only with bands across
///   images, which made an image's result depend on its batch: those stay im2col's).
///
/// At inference, where the transformed weights are kept, [`pays_kept`] decides instead.
pub fn pays(s: &ConvShape) -> bool {
    let ci = s.input[1];
    let pixels = s.output().map_or(0, |[_, _, ho, wo]| ho * wo);
    ci >= 64
        && s.out_channels >= 16
        && (pixels >= 784 || (pixels >= 196 && ci * s.out_channels <= 256 * 256))
}

/// Whether [`conv2d_forward_transformed`], with `U` made once and kept ([`cache`]: inference
/// only), beats im2col's GEMM on `s` where it applies: [`pays`]' rule without its bound on
/// small maps (the transform's cost), down to 49 output pixels an image. Measured per shape at
/// batch 1 and 16 on a Zen 3 (`kernels/examples/forward_b1.rs`, docs/benchmarks/cpu-models.md):
/// it won at both from 7x7 (ResNet-50's 512 → 512 on 7x7: 1.08 against 1.78 ms at batch 1),
/// and lost at batch 16 below it (512 → 512 on 4x4: 12.9 against 7.8 ms).
pub fn pays_kept(s: &ConvShape) -> bool {
    let pixels = s.output().map_or(0, |[_, _, ho, wo]| ho * wo);
    s.input[1] >= 64 && s.out_channels >= 16 && pixels >= 49
}

/// Whether the forward of `s` runs here: [`applies`], [`pays`] and not turned off
/// (`HEARTH_WINOGRAD=0`).
pub(crate) fn takes(s: &ConvShape) -> bool {
    crate::base::winograd_enabled() && applies(s) && pays(s)
}

/// Whether the forward of `s` runs here with `U` kept ([`cache`]): [`applies`],
/// [`pays_kept`] and not turned off (`HEARTH_WINOGRAD=0`).
pub(crate) fn takes_kept(s: &ConvShape) -> bool {
    crate::base::winograd_enabled() && applies(s) && pays_kept(s)
}

/// `U` as `[Co][16][Ci]` for `weight` `[Co, Ci, 3, 3]`.
pub fn transform_weights(weight: &[f32], co: usize, ci: usize) -> Vec<f32> {
    let mut u = vec![0f32; co * 16 * ci];
    u.par_chunks_mut(16 * ci).enumerate().for_each(|(o, u)| {
        for c in 0..ci {
            let g = &weight[(o * ci + c) * 9..][..9];
            // G g: rows g0, (g0 + g1 + g2)/2, (g0 - g1 + g2)/2, g2 (each three wide).
            let mut gg = [[0f32; 3]; 4];
            for j in 0..3 {
                let (a, b, d) = (g[j], g[3 + j], g[6 + j]);
                gg[0][j] = a;
                gg[1][j] = 0.5 * (a + b + d);
                gg[2][j] = 0.5 * (a - b + d);
                gg[3][j] = d;
            }
            // (G g) G': the same on each row's three.
            for (i, [a, b, d]) in gg.into_iter().enumerate() {
                let row = [a, 0.5 * (a + b + d), 0.5 * (a - b + d), d];
                for (j, v) in row.into_iter().enumerate() {
                    u[(4 * i + j) * ci + c] = v;
                }
            }
        }
    });
    u
}

/// The geometry every band shares.
#[derive(Clone, Copy)]
struct Geometry {
    ci: usize,
    co: usize,
    h: usize,
    w: usize,
    ho: usize,
    wo: usize,
    pad: [usize; 2],
    /// Tiles across (`⌈wo / 2⌉`) and down (`⌈ho / 2⌉`) one image.
    tw: usize,
    th: usize,
}

impl Geometry {
    /// The geometry of `s` for `what` (the forward, the weight gradient), after checking that
    /// [`applies`] holds and that `x` is the input `s` describes.
    fn checked(s: &ConvShape, x: &[f32], what: &str) -> Self {
        assert!(
            applies(s),
            "winograd {what}: not a 3x3 stride-1 convolution it takes, {s:?}"
        );
        let [n, ci, h, w] = s.input;
        let [_, co, ho, wo] = s.output().unwrap_or_default();
        assert_eq!(
            x.len(),
            n * ci * h * w,
            "winograd {what}: input length for {s:?}"
        );
        Geometry {
            ci,
            co,
            h,
            w,
            ho,
            wo,
            pad: s.padding,
            tw: wo.div_ceil(2),
            th: ho.div_ceil(2),
        }
    }

    /// Whether nothing is computed: no image, channel or output pixel.
    fn is_empty(&self, n: usize) -> bool {
        n == 0 || self.ci == 0 || self.co == 0 || self.ho == 0 || self.wo == 0
    }

    /// Image and tile row of the batch's tile row `row` (the images' rows one after another).
    fn split(&self, row: usize) -> (usize, usize) {
        (row / self.th, row % self.th)
    }
}

/// Floats of scratch [`transform_input`] takes: the patch's four rows and their combinations,
/// each as its even and its odd columns (`tw + 1` each).
fn line_floats(g: &Geometry) -> usize {
    16 * (g.tw + 1)
}

/// `V[c][e][·]` for the batch's tile rows `rows` of channel `c` of `x` (`[N, Ci, H, W]`); `v`
/// is `16 x t` with `t = rows.len() · tw`, and `lines` is [`line_floats`] of scratch.
///
/// Each patch row is read as its even and its odd columns (of the zero-padded row), so that a
/// tile's four columns `2·tc .. 2·tc + 4` are `even[tc], odd[tc], even[tc + 1], odd[tc + 1]`:
/// every combination then runs over contiguous lines. Compiled for the CPU's vector width.
fn transform_input(
    x: &[f32],
    c: usize,
    g: &Geometry,
    rows: std::ops::Range<usize>,
    v: &mut [f32],
    lines: &mut [f32],
) {
    // SAFETY: `transform_input_into` writes only initialized values, so `v` stays initialized.
    let v = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<MaybeUninit<f32>>(), v.len())
    };
    transform_input_into(x, c, g, rows, v, lines)
}

/// [`transform_input`] into memory not yet written: every value of `v` is written.
fn transform_input_into(
    x: &[f32],
    c: usize,
    g: &Geometry,
    rows: std::ops::Range<usize>,
    v: &mut [MaybeUninit<f32>],
    lines: &mut [f32],
) {
    crate::base::on_width(
        crate::base::vector_width(),
        #[inline(always)]
        || transform_input_on(x, c, g, rows, v, lines),
    )
}

/// [`transform_input`], inlined into the function for the CPU's vector width.
#[inline(always)]
fn transform_input_on(
    x: &[f32],
    c: usize,
    g: &Geometry,
    rows: std::ops::Range<usize>,
    v: &mut [MaybeUninit<f32>],
    lines: &mut [f32],
) {
    let half = g.tw + 1;
    let t = rows.len() * g.tw;
    let (patch, d) = lines.split_at_mut(8 * half);
    let p = g.pad[1];
    for (k, row) in rows.enumerate() {
        let (b, tr) = g.split(row);
        let plane = &x[(b * g.ci + c) * g.h * g.w..][..g.h * g.w];
        // The patch rows 2·tr - p .. 2·tr - p + 4, zero outside the image. Padded column
        // c = q + p of input column q: an even c lands in `even[c / 2]`, an odd one in
        // `odd[c / 2]`.
        for (r, line) in patch.chunks_mut(2 * half).enumerate() {
            line.fill(0.0);
            let ih = (2 * tr + r) as isize - g.pad[0] as isize;
            if ih < 0 || ih as usize >= g.h {
                continue;
            }
            let src = &plane[ih as usize * g.w..][..g.w];
            let (even, odd) = line.split_at_mut(half);
            let (first, first_at, second, second_at) = if p.is_multiple_of(2) {
                (even, p / 2, odd, p / 2)
            } else {
                (odd, p / 2, even, p / 2 + 1)
            };
            for (dst, &x) in first[first_at..].iter_mut().zip(src.iter().step_by(2)) {
                *dst = x;
            }
            for (dst, &x) in second[second_at..]
                .iter_mut()
                .zip(src.iter().skip(1).step_by(2))
            {
                *dst = x;
            }
        }
        // B' d: the rows' combinations, whole lines at a time.
        let (r0, r) = patch.split_at(2 * half);
        let (r1, r) = r.split_at(2 * half);
        let (r2, r3) = r.split_at(2 * half);
        let (d0, dr) = d.split_at_mut(2 * half);
        let (d1, dr) = dr.split_at_mut(2 * half);
        let (d2, d3) = dr.split_at_mut(2 * half);
        for q in 0..2 * half {
            d0[q] = r0[q] - r2[q];
            d1[q] = r1[q] + r2[q];
            d2[q] = r2[q] - r1[q];
            d3[q] = r1[q] - r3[q];
        }
        // (B' d) B: across, from each combination's even and odd columns.
        let base = k * g.tw;
        for (i, line) in [&*d0, &*d1, &*d2, &*d3].into_iter().enumerate() {
            let (even, odd) = line.split_at(half);
            let (v0, vr) = v[4 * i * t..].split_at_mut(t);
            let (v1, vr) = vr.split_at_mut(t);
            let (v2, v3) = vr.split_at_mut(t);
            let n = g.tw;
            let (v0, v1, v2, v3) = (
                &mut v0[base..][..n],
                &mut v1[base..][..n],
                &mut v2[base..][..n],
                &mut v3[base..][..n],
            );
            let (e0, e1, o0, o1) = (&even[..n], &even[1..=n], &odd[..n], &odd[1..=n]);
            for tc in 0..n {
                v0[tc].write(e0[tc] - e1[tc]);
                v1[tc].write(o0[tc] + e1[tc]);
                v2[tc].write(e1[tc] - o0[tc]);
                v3[tc].write(o0[tc] - o1[tc]);
            }
        }
    }
}

/// Output channel `o`'s tiles of the batch's tile rows `rows` from `m` (`16 x t`) into `y`
/// (`[N, Co, Ho, Wo]`), each output row through `epi` as it is written.
///
/// # Safety
/// `y` must point at the whole output, whose rows of channel `o` in these tile rows nothing
/// else touches meanwhile.
unsafe fn transform_output(
    m: &[f32],
    g: &Geometry,
    rows: std::ops::Range<usize>,
    o: usize,
    y: Out,
    epi: Option<&Epilogue>,
) {
    crate::base::on_width(
        crate::base::vector_width(),
        // SAFETY: the caller's promise, passed on.
        #[inline(always)]
        || unsafe { transform_output_on(m, g, rows, o, y, epi) },
    )
}

/// [`transform_output`], inlined into the function for the CPU's vector width.
///
/// # Safety
/// As [`transform_output`].
#[inline(always)]
unsafe fn transform_output_on(
    m: &[f32],
    g: &Geometry,
    rows: std::ops::Range<usize>,
    o: usize,
    y: Out,
    epi: Option<&Epilogue>,
) {
    let t = rows.len() * g.tw;
    let n = g.tw;
    let pairs = g.wo / 2;
    for (k, row) in rows.enumerate() {
        let (b, tr) = g.split(row);
        let plane_at = (b * g.co + o) * g.ho * g.wo;
        let plane = Out(y.at(plane_at));
        let line: [&[f32]; 16] = std::array::from_fn(|e| &m[e * t + k * n..][..n]);
        let y0 = 2 * tr;
        for l in 0..(g.ho - y0).min(2) {
            // A' m down the 4x4 (row l of A'), then across.
            let (a, b, c) = if l == 0 { (0, 4, 8) } else { (4, 8, 12) };
            let sign = if l == 0 { 1.0 } else { -1.0 };
            let s = |j: usize, tc: usize| {
                line[a + j][tc] + sign * line[b + j][tc] + line[c + j][tc] * sign
            };
            // SAFETY: row y0 + l < ho of the plane, which only this call writes (possibly not
            // yet initialized: written, never read).
            let row = unsafe {
                std::slice::from_raw_parts_mut(
                    plane
                        .at((y0 + l) * g.wo)
                        .cast::<std::mem::MaybeUninit<f32>>(),
                    g.wo,
                )
            };
            for (tc, pair) in row[..2 * pairs].chunks_exact_mut(2).enumerate() {
                let (s0, s1, s2, s3) = (s(0, tc), s(1, tc), s(2, tc), s(3, tc));
                pair[0].write(s0 + s1 + s2);
                pair[1].write(s1 - s2 - s3);
            }
            if g.wo % 2 == 1 {
                let tc = n - 1;
                row[g.wo - 1].write(s(0, tc) + s(1, tc) + s(2, tc));
            }
            if let Some(epi) = epi {
                // SAFETY: the row was written whole just above; only this call touches it.
                unsafe { epi.apply(y, plane_at + (y0 + l) * g.wo, g.wo, o) };
            }
        }
    }
}

/// Scratch for one band: `V` (`[Ci][16][T]`), `M` (`[Co][16][T]`) and padded lines. `V` and
/// `M` are not zeroed: each band writes every value of theirs that it reads (zeroing them was a
/// memset of megabytes per call, on one thread, at batch 1).
struct Scratch {
    v: Box<[MaybeUninit<f32>]>,
    m: Box<[MaybeUninit<f32>]>,
    pad: Vec<f32>,
}

impl Scratch {
    fn new(g: &Geometry, band_rows: usize) -> Self {
        let t = band_rows * g.tw;
        Scratch {
            v: Box::new_uninit_slice(g.ci * 16 * t),
            m: Box::new_uninit_slice(g.co * 16 * t),
            pad: vec![0f32; line_floats(g)],
        }
    }
}

/// One band (the batch's tile rows `rows`) of `x` (`[N, Ci, H, W]`) into `y` (`[N, Co, Ho,
/// Wo]`). `parallel`: split the transforms by channels and the products by `e` across the
/// threads. `epi`: what each output row passes through as it is written.
#[allow(clippy::too_many_arguments)]
fn band(
    x: &[f32],
    u: &[f32],
    g: &Geometry,
    rows: std::ops::Range<usize>,
    y: Out,
    scratch: &mut Scratch,
    parallel: bool,
    epi: Option<&Epilogue>,
) {
    let t = rows.len() * g.tw;
    let (ci, co) = (g.ci, g.co);
    let v = &mut scratch.v[..ci * 16 * t];
    let m = &mut scratch.m[..co * 16 * t];
    if parallel {
        v.par_chunks_mut(16 * t).enumerate().for_each_init(
            || vec![0f32; line_floats(g)],
            |lines, (c, v)| transform_input_into(x, c, g, rows.clone(), v, lines),
        );
    } else {
        for (c, v) in v.chunks_mut(16 * t).enumerate() {
            transform_input_into(x, c, g, rows.clone(), v, &mut scratch.pad);
        }
    }
    // V is written whole above (every point of every tile of every channel), M by the 16
    // products below (each point's Co x T block).
    let (vp, mp) = (v.as_ptr() as usize, Out(m.as_mut_ptr().cast::<f32>()));
    let product = |e: usize| {
        // SAFETY: M's rows for point e (Co x T, row stride 16·T) are written by this product
        // only; U's (Co x Ci, row stride 16·Ci) and V's (Ci x T, row stride 16·T) are read.
        unsafe {
            gemm_rows(
                co,
                t,
                ci,
                mp.at(e * t),
                16 * t,
                u[e * ci..].as_ptr(),
                1,
                16 * ci,
                (vp as *const f32).wrapping_add(e * t),
                16 * t,
                gemm::Parallelism::None,
            );
        }
    };
    // SAFETY: the products above wrote every value of M.
    let m: &[f32] = unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<f32>(), m.len()) };
    // SAFETY (both branches): channel o's rows of these tile rows are written by its own
    // call only, and no other band has these tile rows.
    if parallel {
        (0..16).into_par_iter().for_each(product);
        m.par_chunks(16 * t)
            .enumerate()
            .for_each(|(o, m)| unsafe { transform_output(m, g, rows.clone(), o, y, epi) });
    } else {
        (0..16).for_each(product);
        for (o, m) in m.chunks(16 * t).enumerate() {
            unsafe { transform_output(m, g, rows.clone(), o, y, epi) }
        }
    }
}

/// The forward pass `[N, Co, Ho, Wo]` of `x` (`[N, Ci, H, W]`) with `weight` (`[Co, Ci, 3,
/// 3]`), all row-major. Panics where [`applies`] is false or the lengths do not match `s`.
pub fn conv2d_forward(x: &[f32], weight: &[f32], s: &ConvShape) -> Vec<f32> {
    conv2d_forward_in_bands(x, weight, s, BAND_FLOATS)
}

/// [`conv2d_forward`] with bands of about `band_floats` floats of `V` and `M` (for measuring).
pub fn conv2d_forward_in_bands(
    x: &[f32],
    weight: &[f32],
    s: &ConvShape,
    band_floats: usize,
) -> Vec<f32> {
    forward_then(x, weight, s, band_floats, None)
}

/// [`conv2d_forward_in_bands`], each output row through `epi` as it is written.
pub(crate) fn forward_then(
    x: &[f32],
    weight: &[f32],
    s: &ConvShape,
    band_floats: usize,
    epi: Option<&Epilogue>,
) -> Vec<f32> {
    let [co, ci] = [s.out_channels, s.input[1]];
    assert_eq!(
        weight.len(),
        co * ci * 9,
        "winograd forward: weight length for {s:?}"
    );
    forward_transformed(x, &transform_weights(weight, co, ci), s, band_floats, epi)
}

/// [`conv2d_forward_in_bands`] with the weights already transformed: `u` is
/// [`transform_weights`] of them, as [`cache`] keeps it between inference passes.
pub fn conv2d_forward_transformed(
    x: &[f32],
    u: &[f32],
    s: &ConvShape,
    band_floats: usize,
) -> Vec<f32> {
    forward_transformed(x, u, s, band_floats, None)
}

/// `forward_then` with the weights already transformed: `u` is `U` (`[Co][16][Ci]`) of the
/// weights, as [`cache`] keeps it between inference passes.
pub(crate) fn forward_transformed(
    x: &[f32],
    u: &[f32],
    s: &ConvShape,
    band_floats: usize,
    epi: Option<&Epilogue>,
) -> Vec<f32> {
    let g = Geometry::checked(s, x, "forward");
    let (n, ci, co, ho, wo) = (s.input[0], g.ci, g.co, g.ho, g.wo);
    assert_eq!(
        u.len(),
        co * 16 * ci,
        "winograd forward: transformed weight length for {s:?}"
    );
    if g.is_empty(n) {
        let mut y = vec![0f32; n * co * ho * wo];
        if let Some(epi) = epi {
            // No input channel: every output is the epilogue of zero.
            let out = Out(y.as_mut_ptr());
            for b in 0..n {
                // SAFETY: the whole (zeroed) output, only here.
                unsafe { epi.apply_block(out, [b, co, ho * wo], 0..co, 0..ho * wo, false) };
            }
        }
        return y;
    }
    // Bands of each image's tile rows, never across two images: an image's result is then
    // the same bits whatever batch it comes in (each band's products have the same width), so
    // data-parallel ranks with smaller batches compute what one process does.
    let per_row = 16 * (ci + co) * g.tw;
    let band_rows = (band_floats / per_row).clamp(1, g.th);
    let bands: Vec<std::ops::Range<usize>> = (0..n)
        .flat_map(|b| {
            (0..g.th)
                .step_by(band_rows)
                .map(move |r| b * g.th + r..b * g.th + (r + band_rows).min(g.th))
        })
        .collect();
    // SAFETY: the bands partition the batch's tile rows, and every tile row's output rows
    // (one or two) of every channel are written whole by `transform_output`.
    unsafe {
        crate::base::written_by(n * co * ho * wo, |out| {
            bands_into(x, u, &g, bands, band_rows, out, epi)
        })
    }
}

/// Runs `bands` (of `band_rows` tile rows at most) of `x` with the transformed weights `u`
/// into the output at `out`.
fn bands_into(
    x: &[f32],
    u: &[f32],
    g: &Geometry,
    bands: Vec<std::ops::Range<usize>>,
    band_rows: usize,
    out: Out,
    epi: Option<&Epilogue>,
) {
    let threads = rayon::current_num_threads().max(1);
    if bands.len() < 2 * threads {
        // Too few bands to keep every thread busy: each band's phases in parallel.
        let mut scratch = Scratch::new(g, band_rows);
        for rows in bands {
            band(x, u, g, rows, out, &mut scratch, true, epi);
        }
    } else {
        // Bands in parallel, each on its thread, with one scratch per thread for the whole
        // call (rayon may split the bands into more jobs than threads, and a band's scratch is
        // megabytes).
        let scratches: Vec<std::sync::Mutex<Option<Scratch>>> =
            (0..threads).map(|_| std::sync::Mutex::new(None)).collect();
        bands.into_par_iter().for_each(|rows| {
            let slot = rayon::current_thread_index().unwrap_or(0) % threads;
            let mut scratch = scratches[slot]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let scratch = scratch.get_or_insert_with(|| Scratch::new(g, band_rows));
            band(x, u, g, rows, out, scratch, false, epi);
        });
    }
}

#[cfg(test)]
mod tests;
