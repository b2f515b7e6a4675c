//! What a convolution's output passes through where the kernel writes it, for inference: batch
//! norm with fixed statistics (a scale and a shift per output channel), then a residual added,
//! then ReLU. Applied to each piece of the output right after its product (or, in Winograd's
//! output transform, to each row as it is written), while the piece is still in the cache,
//! instead of in passes of their own over the whole output: ResNet's batch norms, residual
//! additions and ReLUs were three passes (`crate::infer`).
//!
//! Every value is computed as the separate passes compute it (`x·scale + shift`, then `+
//! residual`, then `max(·, 0)`, no fused multiply-add), so the results are the same.

use crate::base::{Out, on_width, vector_width};

/// The per-channel affine map, the residual and the ReLU of [`crate::epilogue`].
#[derive(Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    /// `γ/sqrt(var + ε)` per output channel.
    pub(crate) scale: &'a [f32],
    /// `β - mean·scale` per output channel.
    pub(crate) shift: &'a [f32],
    /// Added after the affine map: the output's shape, read at the same flat index.
    pub(crate) residual: Option<&'a [f32]>,
    /// ReLU last.
    pub(crate) relu: bool,
}

impl Epilogue<'_> {
    /// Applies itself, in place, to `len` values of output channel `channel` at flat index
    /// `at` of the output `out`.
    ///
    /// # Safety
    /// `out.at(at)..out.at(at + len)` must hold written values that nothing else touches
    /// meanwhile, and `at + len` must be within the residual's length (when there is one).
    pub(crate) unsafe fn apply(&self, out: Out, at: usize, len: usize, channel: usize) {
        let (a, b) = (self.scale[channel], self.shift[channel]);
        // SAFETY: the caller's promise.
        let values = unsafe { std::slice::from_raw_parts_mut(out.at(at), len) };
        let residual = self.residual.map(|r| &r[at..at + len]);
        let relu = self.relu;
        on_width(
            vector_width(),
            #[inline(always)]
            || match residual {
                Some(r) => {
                    for (v, &r) in values.iter_mut().zip(r) {
                        let y = *v * a + b + r;
                        *v = if relu { y.max(0.0) } else { y };
                    }
                }
                None if relu => {
                    for v in values.iter_mut() {
                        *v = (*v * a + b).max(0.0);
                    }
                }
                None => {
                    for v in values.iter_mut() {
                        *v = *v * a + b;
                    }
                }
            },
        )
    }

    /// Applies itself to a block of the output: of image `image` (outputs of `channels` planes
    /// of `plane` values), channels `rows`, values `cols` of each plane; the channels split
    /// across the threads when `parallel` (after a product that had them all).
    ///
    /// # Safety
    /// As [`Self::apply`], for every value of the block.
    pub(crate) unsafe fn apply_block(
        &self,
        out: Out,
        [image, channels, plane]: [usize; 3],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        parallel: bool,
    ) {
        let one = |c: usize| {
            let at = (image * channels + c) * plane + cols.start;
            // SAFETY: forwarded from the caller; each channel's values are its own.
            unsafe { self.apply(out, at, cols.len(), c) };
        };
        if parallel {
            use rayon::prelude::*;
            rows.into_par_iter().for_each(one);
        } else {
            rows.for_each(one);
        }
    }
}

/// Per channel, `scale = γ/sqrt(var + ε)` and `shift = β - mean·scale`, as batch norm's
/// inference pass folds its statistics ([`crate::batch_norm::inference`]).
pub(crate) fn affine(
    gamma: &[f32],
    beta: &[f32],
    mean: &[f32],
    var: &[f32],
    epsilon: f64,
) -> (Vec<f32>, Vec<f32>) {
    gamma
        .iter()
        .zip(beta)
        .zip(mean.iter().zip(var))
        .map(|((&g, &b), (&m, &v))| {
            let a = g / (v as f64 + epsilon).sqrt() as f32;
            (a, b - m * a)
        })
        .unzip()
}
