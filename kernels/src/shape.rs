//! The geometry of a 2-D convolution, shared by its forward and backward kernels (re-exported
//! from [`crate::weight_grad`], where it began).

/// Convolution geometry passed through the extension (stride, padding, dilation).
pub type Geometry2 = [[usize; 2]; 3];

/// The shape of a convolution of an `input` by a `weight` of these dims.
pub(crate) fn conv_shape(
    input: [usize; 4],
    weight: [usize; 4],
    [stride, padding, dilation]: Geometry2,
) -> ConvShape {
    ConvShape {
        input,
        out_channels: weight[0],
        kernel: [weight[2], weight[3]],
        stride,
        padding,
        dilation,
    }
}

/// The geometry of a 2-D convolution with one group: what its kernels are computed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvShape {
    /// Input `[N, Ci, H, W]`.
    pub input: [usize; 4],
    /// Output channels.
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl ConvShape {
    /// The output side along axis 0 (rows) or 1 (columns); `None` when the kernel does not fit.
    pub fn out_side(&self, axis: usize) -> Option<usize> {
        let input = self.input[2 + axis] + 2 * self.padding[axis];
        let span = self.dilation[axis] * (self.kernel[axis].max(1) - 1) + 1;
        (input >= span && self.stride[axis] > 0).then(|| (input - span) / self.stride[axis] + 1)
    }

    /// The input rows and columns a strided convolution with output `out` left unread at the
    /// far edge: a transposed convolution computing the input gradient gives them back (zero
    /// gradient) to restore the input's size (its `padding_out`).
    pub fn unread_edge(&self, out: [usize; 4]) -> [usize; 2] {
        std::array::from_fn(|a| {
            let reach = self.dilation[a] * (self.kernel[a] - 1) + 1;
            let covered = (out[2 + a].max(1) - 1) * self.stride[a] + reach;
            (self.input[2 + a] + 2 * self.padding[a]).saturating_sub(covered)
        })
    }

    /// `[N, Co, Ho, Wo]`, or `None` when the kernel does not fit.
    pub fn output(&self) -> Option<[usize; 4]> {
        Some([
            self.input[0],
            self.out_channels,
            self.out_side(0)?,
            self.out_side(1)?,
        ])
    }

    /// `[Co, Ci, kh, kw]`.
    pub fn weight(&self) -> [usize; 4] {
        [
            self.out_channels,
            self.input[1],
            self.kernel[0],
            self.kernel[1],
        ]
    }
}
