//! 2-D max pooling on Burn Flex: each output row is the maximum of its window's input rows
//! (taken whole, so the loop vectorizes), then of the window's columns in it. Flex's pooling is
//! a generic 3-D kernel that finds each output's window bounds and records its argmax as an
//! `i64`, which inference throws away: ResNet-50's stem pool took 8.7% of a batch-1 inference
//! step (`perf`, 2-core AVX-512), DenseNet-121's 6.6% at batch 16.
//!
//! Training takes the same forward and keeps no argmax: the backward
//! ([`max_pool2d_backward`]) finds each window's argmax again in the input it keeps (one more
//! read of it, against Flex's pass writing 8 bytes per output in the forward and reading them
//! back), with Flex's rule for ties and NaN, so the gradient lands where Flex's would.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension,
};
use burn::nn::pool::{AvgPool2d, MaxPool2d};
use burn::prelude::*;
use burn::tensor::DType;

use crate::base::f32_tensor;

/// Kernel, stride, padding and dilation, `[rows, columns]` each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl PoolGeometry {
    /// The output side along axis `a` for an input side `len` (floor mode), `None` when the
    /// window does not fit even with the padding, or the kernel or stride is 0.
    pub fn out_side(&self, a: usize, len: usize) -> Option<usize> {
        let reach = self.dilation[a] * self.kernel[a].checked_sub(1)? + 1;
        let padded = len + 2 * self.padding[a];
        (self.stride[a] > 0 && padded >= reach).then(|| (padded - reach) / self.stride[a] + 1)
    }
}

/// `a` or `v`, whichever is larger; NaN wins (it propagates, as in Flex and PyTorch).
#[inline(always)]
fn larger(a: f32, v: f32) -> f32 {
    if v > a || v.is_nan() { v } else { a }
}

/// Max pooling of `x` (`[N, C, H, W]`, row-major): `[N, C, Ho, Wo]`. Padding never wins (it
/// counts as -∞). Panics when the window does not fit ([`PoolGeometry::out_side`]).
pub fn max_pool2d(x: &[f32], [n, c, h, w]: [usize; 4], g: &PoolGeometry) -> Vec<f32> {
    assert_eq!(x.len(), n * c * h * w, "max pool: input length");
    let (Some(ho), Some(wo)) = (g.out_side(0, h), g.out_side(1, w)) else {
        panic!("max pool: a {g:?} window does not fit {h}x{w}");
    };
    let plane = ho * wo;
    // SAFETY: each plane's closure writes all `ho·wo` outputs (one per `(oh, ow)`).
    unsafe {
        crate::base::par_planes(n * c * plane, plane, |p, out| {
            let src = &x[p * h * w..(p + 1) * h * w];
            let mut row = vec![f32::NEG_INFINITY; w];
            for oh in 0..ho {
                row.fill(f32::NEG_INFINITY);
                for i in 0..g.kernel[0] {
                    let ih = (oh * g.stride[0] + i * g.dilation[0]).checked_sub(g.padding[0]);
                    let Some(ih) = ih.filter(|&ih| ih < h) else {
                        continue;
                    };
                    for (r, &v) in row.iter_mut().zip(&src[ih * w..(ih + 1) * w]) {
                        *r = larger(*r, v);
                    }
                }
                for (ow, o) in out[oh * wo..(oh + 1) * wo].iter_mut().enumerate() {
                    let mut m = f32::NEG_INFINITY;
                    for j in 0..g.kernel[1] {
                        let iw = (ow * g.stride[1] + j * g.dilation[1]).checked_sub(g.padding[1]);
                        if let Some(iw) = iw.filter(|&iw| iw < w) {
                            m = larger(m, row[iw]);
                        }
                    }
                    o.write(m);
                }
            }
        })
    }
}

/// The gradient of [`max_pool2d`] with respect to `x`: each output's gradient in `dy`
/// (`[N, C, Ho, Wo]`) added to the input its window's maximum came from. The argmax is Flex's
/// (and PyTorch's): the first of equal values in the window's row-major order, the last NaN;
/// padding never. Windows that overlap add in output order.
pub fn max_pool2d_backward(
    x: &[f32],
    dy: &[f32],
    [n, c, h, w]: [usize; 4],
    g: &PoolGeometry,
) -> Vec<f32> {
    assert_eq!(x.len(), n * c * h * w, "max pool backward: input length");
    let (Some(ho), Some(wo)) = (g.out_side(0, h), g.out_side(1, w)) else {
        panic!("max pool backward: a {g:?} window does not fit {h}x{w}");
    };
    assert_eq!(
        dy.len(),
        n * c * ho * wo,
        "max pool backward: gradient length"
    );
    let plane = h * w;
    // Each window's valid input rows and columns, the same for every plane.
    let span = |a: usize, o: usize, len: usize| -> Vec<usize> {
        (0..g.kernel[a])
            .filter_map(|k| {
                (o * g.stride[a] + k * g.dilation[a])
                    .checked_sub(g.padding[a])
                    .filter(|&i| i < len)
            })
            .collect()
    };
    let rows: Vec<Vec<usize>> = (0..ho).map(|oh| span(0, oh, h)).collect();
    let cols: Vec<Vec<usize>> = (0..wo).map(|ow| span(1, ow, w)).collect();
    // The output columns whose windows lie wholly inside the plane's columns (`lo..hi`) go as
    // one run ([`Phases::run_argmax`]; window by window, DenseNet-121's stem pool took 62 ms of
    // a batch-16 training step on a 2-core Zen 4, and 24 ms this way), the others one by one.
    let full = |ow: usize| cols[ow].len() == g.kernel[1];
    let lo = (0..wo).find(|&ow| full(ow)).unwrap_or(wo);
    let hi = (lo..wo).find(|&ow| !full(ow)).unwrap_or(wo);
    assert!(
        u32::try_from(plane).is_ok_and(|p| p < NONE),
        "max pool backward: a {h}x{w} plane has more values than a u32 index holds"
    );
    // SAFETY: each plane's closure zeroes its `h·w` values before adding into them.
    unsafe {
        crate::base::par_planes(n * c * plane, plane, |p, out| {
            for v in out.iter_mut() {
                v.write(0.0);
            }
            // SAFETY (inside the call's unsafe block): every value was written just above.
            let out: &mut [f32] = &mut *(std::ptr::from_mut(out) as *mut [f32]);
            let src = &x[p * plane..(p + 1) * plane];
            let grad = &dy[p * ho * wo..(p + 1) * ho * wo];
            let phases = Phases::new(src, [h, w], g.stride[1]);
            // Per output column of the row: the argmax (NONE: every tap padding), the maximum.
            let mut best = vec![NONE; wo];
            let mut top = vec![f32::NEG_INFINITY; wo];
            let mut taps: Vec<(usize, u32)> = Vec::with_capacity(g.kernel[0] * g.kernel[1]);
            for (oh, rs) in rows.iter().enumerate() {
                best.fill(NONE);
                top.fill(f32::NEG_INFINITY);
                if lo < hi {
                    let (best, top) = (&mut best[lo..hi], &mut top[lo..hi]);
                    // A NaN wins its window (the last NaN): such rows are scanned again.
                    if phases.run_argmax(rs, g, lo, (best, top), &mut taps) {
                        for ow in lo..hi {
                            (best[ow - lo], top[ow - lo]) = window_argmax(src, w, rs, &cols[ow]);
                        }
                    }
                }
                for ow in (0..lo).chain(hi..wo) {
                    (best[ow], top[ow]) = window_argmax(src, w, rs, &cols[ow]);
                }
                // Added in output order (overlapping windows: the same sums as Flex's).
                for (ow, &b) in best.iter().enumerate() {
                    if b != NONE {
                        out[b as usize] += grad[oh * wo + ow];
                    }
                }
            }
        })
    }
}

/// One plane's columns regrouped by phase of the stride (`c % stride`), row by row: the inputs
/// that one tap of a run of windows reads (every `stride`-th column) lie side by side.
struct Phases {
    values: Vec<f32>,
    /// Rows and columns of the plane, the stride along a row, columns per phase row.
    h: usize,
    w: usize,
    stride: usize,
    len: usize,
}

impl Phases {
    fn new(src: &[f32], [h, w]: [usize; 2], stride: usize) -> Self {
        let len = w.div_ceil(stride);
        let mut values = vec![0f32; stride * h * len];
        for (ih, line) in src.chunks_exact(w).enumerate() {
            for r in 0..stride.min(w) {
                let dst = &mut values[(r * h + ih) * len..][..len];
                for (d, &v) in dst.iter_mut().zip(line[r..].iter().step_by(stride)) {
                    *d = v;
                }
            }
        }
        Self {
            values,
            h,
            w,
            stride,
            len,
        }
    }

    /// The argmax and maximum of the run of windows that starts at output column `lo`, each
    /// wholly inside the plane's columns, over the input rows `rows`: written into `best` and
    /// `top` (the run's columns, NONE and -∞ on entry). The maximum is taken tap by tap across
    /// the whole run, then each window's first tap equal to it, with a mask: no branch per
    /// comparison (a ReLU's output makes them unpredictable). True when a NaN was seen (its
    /// window's argmax is then not Flex's: the caller scans those again). `taps` is scratch.
    fn run_argmax(
        &self,
        rows: &[usize],
        g: &PoolGeometry,
        lo: usize,
        (best, top): (&mut [u32], &mut [f32]),
        taps: &mut Vec<(usize, u32)>,
    ) -> bool {
        let (n, s) = (best.len(), self.stride);
        taps.clear();
        let mut nan = false;
        // Row-major order: the window's rows, then its columns.
        for &ih in rows {
            for j in 0..g.kernel[1] {
                let first = lo * s + j * g.dilation[1] - g.padding[1];
                let at = ((first % s) * self.h + ih) * self.len + first / s;
                taps.push((at, (ih * self.w + first) as u32));
                for (t, &v) in top.iter_mut().zip(&self.values[at..at + n]) {
                    nan |= v.is_nan();
                    *t = if v > *t { v } else { *t };
                }
            }
        }
        // The first tap equal to the maximum: scanned last to first, the earliest is written
        // last (Flex's rule for ties; a window of -∞ takes its first).
        for &(at, first) in taps.iter().rev() {
            let run = &self.values[at..at + n];
            let windows = best.iter_mut().zip(top.iter()).zip(run);
            for (k, ((b, &t), &v)) in windows.enumerate() {
                let take = ((v == t) as u32).wrapping_neg();
                *b = ((first + (k * s) as u32) & take) | (*b & !take);
            }
        }
        nan
    }
}

/// One window's argmax in `src` (`? x w`) over its valid rows and columns, in row-major
/// order: the first of equal values, the last NaN, NONE where it has none; and its maximum.
fn window_argmax(src: &[f32], w: usize, rows: &[usize], cols: &[usize]) -> (u32, f32) {
    let (mut best, mut top) = (NONE, f32::NEG_INFINITY);
    for &ih in rows {
        for &iw in cols {
            let at = ih * w + iw;
            let v = src[at];
            let take = best == NONE || v > top || v.is_nan();
            best = if take { at as u32 } else { best };
            top = if take { v } else { top };
        }
    }
    (best, top)
}

/// No argmax yet (a window wholly in the padding has none).
const NONE: u32 = u32::MAX;

/// Average pooling of `x` (`[N, C, H, W]`, row-major) with every window inside the plane (no
/// padding, floor mode): `[N, C, Ho, Wo]`, each output its window's sum in row-major order
/// divided by the window's size, as Flex computes it (the same bits). Flex's generic 3-D kernel
/// finds each window's bounds and count per output: about 150 CPU-ms of a DenseNet-121
/// training step on its transitions (`perf`, 2-core Zen 4) where PyTorch's took 24 ms. Panics
/// when the window does not fit.
pub fn avg_pool2d(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    kernel: [usize; 2],
    stride: [usize; 2],
) -> Vec<f32> {
    assert_eq!(x.len(), n * c * h * w, "avg pool: input length");
    let g = inside(kernel, stride);
    let (Some(ho), Some(wo)) = (g.out_side(0, h), g.out_side(1, w)) else {
        panic!("avg pool: a {kernel:?} window does not fit {h}x{w}");
    };
    let count = (kernel[0] * kernel[1]) as f32;
    let plane = ho * wo;
    // SAFETY: each plane's closure writes all `ho·wo` outputs (one per `(oh, ow)`).
    unsafe {
        crate::base::par_planes(n * c * plane, plane, |p, out| {
            let src = &x[p * h * w..(p + 1) * h * w];
            for (i, o) in out.iter_mut().enumerate() {
                let first = (i / wo) * stride[0] * w + (i % wo) * stride[1];
                let mut sum = 0.0f32;
                for r in 0..kernel[0] {
                    for &v in &src[first + r * w..first + r * w + kernel[1]] {
                        sum += v;
                    }
                }
                o.write(sum / count);
            }
        })
    }
}

/// The gradient of [`avg_pool2d`] with respect to its input (`[N, C, H, W]`): each output's
/// gradient in `dy` divided by the window's size and added to every input of its window, in
/// output order onto zeros (Flex's order: the same bits; inputs no window covers get 0).
pub fn avg_pool2d_backward(
    dy: &[f32],
    [n, c, h, w]: [usize; 4],
    kernel: [usize; 2],
    stride: [usize; 2],
) -> Vec<f32> {
    let g = inside(kernel, stride);
    let (Some(ho), Some(wo)) = (g.out_side(0, h), g.out_side(1, w)) else {
        panic!("avg pool backward: a {kernel:?} window does not fit {h}x{w}");
    };
    assert_eq!(
        dy.len(),
        n * c * ho * wo,
        "avg pool backward: gradient length"
    );
    let count = (kernel[0] * kernel[1]) as f32;
    let plane = h * w;
    // SAFETY: each plane's closure zeroes its `h·w` values before adding into them.
    unsafe {
        crate::base::par_planes(n * c * plane, plane, |p, out| {
            for v in out.iter_mut() {
                v.write(0.0);
            }
            // SAFETY (inside the call's unsafe block): every value was written just above.
            let out: &mut [f32] = &mut *(std::ptr::from_mut(out) as *mut [f32]);
            let grad = &dy[p * ho * wo..(p + 1) * ho * wo];
            for (i, &gv) in grad.iter().enumerate() {
                let share = gv / count;
                let first = (i / wo) * stride[0] * w + (i % wo) * stride[1];
                for r in 0..kernel[0] {
                    for v in &mut out[first + r * w..first + r * w + kernel[1]] {
                        *v += share;
                    }
                }
            }
        })
    }
}

/// A window without padding or dilation.
fn inside(kernel: [usize; 2], stride: [usize; 2]) -> PoolGeometry {
    PoolGeometry {
        kernel,
        stride,
        padding: [0, 0],
        dilation: [1, 1],
    }
}

/// The extension: max pooling, its forward and its backward; average pooling without padding,
/// its forward and its backward.
#[backend_extension(Flex, Autodiff)]
pub trait PoolBackend: Backend {
    /// `max_pool2d(x)` with `[kernel, stride, padding, dilation]` (floor mode); under autodiff
    /// its backward is [`PoolBackend::hearth_max_pool2d_backward`] (x is kept for it).
    fn hearth_max_pool2d(x: FloatTensor<Self>, geometry: [[usize; 2]; 4]) -> FloatTensor<Self>;
    /// The gradient of `hearth_max_pool2d(x)` for the output gradient `grad` (a backward pass:
    /// not differentiable itself).
    fn hearth_max_pool2d_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        geometry: [[usize; 2]; 4],
    ) -> FloatTensor<Self>;
    /// `avg_pool2d(x)` with `[kernel, stride]`, no padding, floor mode; under autodiff its
    /// backward is [`PoolBackend::hearth_avg_pool2d_backward`] (only x's shape is kept).
    fn hearth_avg_pool2d(x: FloatTensor<Self>, window: [[usize; 2]; 2]) -> FloatTensor<Self>;
    /// The gradient of `hearth_avg_pool2d` of an `input`-shaped tensor for the output gradient
    /// `grad` (a backward pass: not differentiable itself).
    fn hearth_avg_pool2d_backward(
        grad: FloatTensor<Self>,
        input: [usize; 4],
        window: [[usize; 2]; 2],
    ) -> FloatTensor<Self>;
}

fn geometry([kernel, stride, padding, dilation]: [[usize; 2]; 4]) -> PoolGeometry {
    PoolGeometry {
        kernel,
        stride,
        padding,
        dilation,
    }
}

impl PoolBackend for Flex {
    fn hearth_max_pool2d(x: FloatTensor<Self>, g: [[usize; 2]; 4]) -> FloatTensor<Self> {
        let g = geometry(g);
        let [n, c, h, w] = x.shape().dims::<4>();
        let x = x.to_contiguous();
        let y = max_pool2d(x.storage::<f32>(), [n, c, h, w], &g);
        let dims = vec![
            n,
            c,
            g.out_side(0, h).unwrap_or(0),
            g.out_side(1, w).unwrap_or(0),
        ];
        f32_tensor(y, dims)
    }

    fn hearth_max_pool2d_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        g: [[usize; 2]; 4],
    ) -> FloatTensor<Self> {
        let g = geometry(g);
        let dims = x.shape().dims::<4>();
        let (x, grad) = (x.to_contiguous(), grad.to_contiguous());
        let dx = max_pool2d_backward(x.storage::<f32>(), grad.storage::<f32>(), dims, &g);
        f32_tensor(dx, dims.to_vec())
    }

    fn hearth_avg_pool2d(
        x: FloatTensor<Self>,
        [kernel, stride]: [[usize; 2]; 2],
    ) -> FloatTensor<Self> {
        let [n, c, h, w] = x.shape().dims::<4>();
        let x = x.to_contiguous();
        let y = avg_pool2d(x.storage::<f32>(), [n, c, h, w], kernel, stride);
        let g = inside(kernel, stride);
        let (ho, wo) = (g.out_side(0, h), g.out_side(1, w));
        f32_tensor(y, vec![n, c, ho.unwrap_or(0), wo.unwrap_or(0)])
    }

    fn hearth_avg_pool2d_backward(
        grad: FloatTensor<Self>,
        input: [usize; 4],
        [kernel, stride]: [[usize; 2]; 2],
    ) -> FloatTensor<Self> {
        let grad = grad.to_contiguous();
        let dx = avg_pool2d_backward(grad.storage::<f32>(), input, kernel, stride);
        f32_tensor(dx, input.to_vec())
    }
}

/// The backward of [`PoolBackend::hearth_avg_pool2d`] under autodiff: the input's shape and the
/// window (not the input: its values play no part).
#[derive(Debug)]
struct AvgPoolBackward;

impl<B: PoolBackend> Backward<B, 1> for AvgPoolBackward {
    type State = ([usize; 4], [[usize; 2]; 2]);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (input, window) = ops.state;
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::hearth_avg_pool2d_backward(grad, input, window));
        }
    }
}

/// The backward of [`PoolBackend::hearth_max_pool2d`] under autodiff: the kept input and the
/// geometry.
#[derive(Debug)]
struct MaxPoolBackward;

impl<B: PoolBackend> Backward<B, 1> for MaxPoolBackward {
    type State = (NodeId, [[usize; 2]; 4]);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, g) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::hearth_max_pool2d_backward(x, grad, g));
        }
    }
}

impl<B: PoolBackend, C: CheckpointStrategy> PoolBackend for Autodiff<B, C> {
    fn hearth_max_pool2d(x: FloatTensor<Self>, g: [[usize; 2]; 4]) -> FloatTensor<Self> {
        match MaxPoolBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                prep.finish((x_state, g), B::hearth_max_pool2d(x.into_primitive(), g))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hearth_max_pool2d(x.into_primitive(), g)),
        }
    }

    /// Not differentiable itself (it is a backward pass): the result is a constant.
    fn hearth_max_pool2d_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        g: [[usize; 2]; 4],
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_max_pool2d_backward(
            x.into_primitive(),
            grad.into_primitive(),
            g,
        ))
    }

    fn hearth_avg_pool2d(x: FloatTensor<Self>, window: [[usize; 2]; 2]) -> FloatTensor<Self> {
        let input = x.shape().dims::<4>();
        match AvgPoolBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (input, window),
                B::hearth_avg_pool2d(x.into_primitive(), window),
            ),
            OpsKind::UnTracked(prep) => {
                prep.finish(B::hearth_avg_pool2d(x.into_primitive(), window))
            }
        }
    }

    /// Not differentiable itself (it is a backward pass): the result is a constant.
    fn hearth_avg_pool2d_backward(
        grad: FloatTensor<Self>,
        input: [usize; 4],
        window: [[usize; 2]; 2],
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_avg_pool2d_backward(
            grad.into_primitive(),
            input,
            window,
        ))
    }
}

/// `pool.forward(x)`: by [`max_pool2d`] (and, training, [`max_pool2d_backward`]) for f32 on a
/// Flex device with the fast paths on, symmetric explicit padding and floor mode (bf16 and f16
/// pooled in f32, which is exact); by Burn's module otherwise (other devices and types, ceil
/// mode, same-padding).
pub fn max_pool(pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    let device = x.device();
    let padding = crate::base::symmetric(&pool.padding);
    let [_, _, h, w] = x.dims();
    let g = padding.map(|padding| PoolGeometry {
        kernel: pool.kernel_size,
        stride: pool.stride,
        padding,
        dilation: pool.dilation,
    });
    let fits = g.is_some_and(|g| g.out_side(0, h).is_some() && g.out_side(1, w).is_some());
    let fast = fits && !pool.ceil_mode && crate::base::enabled() && crate::base::is_flex(&device);
    if fast && let Some(dt) = crate::low_precision(&x) {
        // The largest of bf16 or f16 values is one of them: pooled in f32, exactly.
        let y = max_pool(pool, crate::cast(x, burn::tensor::FloatDType::F32));
        return crate::cast(y, dt);
    }
    let fast = fast && x.dtype() == DType::F32;
    match g {
        Some(g) if fast => Tensor::from_dispatch(<Dispatch as PoolBackend>::hearth_max_pool2d(
            x.into_dispatch(),
            [g.kernel, g.stride, g.padding, g.dilation],
        )),
        _ => pool.forward(x),
    }
}

/// `pool.forward(x)`: by [`avg_pool2d`] (and, training, [`avg_pool2d_backward`]) for f32 on a
/// Flex device with the fast paths on, without padding and in floor mode (DenseNet's
/// transitions); by Burn's module otherwise (padding, ceil mode, other devices and types).
pub fn avg_pool(pool: &AvgPool2d, x: Tensor<4>) -> Tensor<4> {
    let device = x.device();
    let [_, _, h, w] = x.dims();
    let g = inside(pool.kernel_size, pool.stride);
    let fast = crate::base::symmetric(&pool.padding) == Some([0, 0])
        && !pool.ceil_mode
        && g.out_side(0, h).is_some()
        && g.out_side(1, w).is_some()
        && x.dtype() == DType::F32
        && crate::base::enabled()
        && crate::base::is_flex(&device);
    if !fast {
        return pool.forward(x);
    }
    Tensor::from_dispatch(<Dispatch as PoolBackend>::hearth_avg_pool2d(
        x.into_dispatch(),
        [pool.kernel_size, pool.stride],
    ))
}
