//! Which kernel computes a convolution's input gradient on Flex ([`input_grad_path`], measured
//! per shape), and Flex's own ([`flex_input_grad`]): below the extension op of `ext.rs`, which
//! takes the path chosen here.

use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::ops::ModuleOps;
use burn_flex::FlexTensor;

use crate::weight_grad::ConvShape;

/// Flex splits a convolution's work into tiles of 512 output pixels across the batch; with
/// fewer than four tiles one of two cores idles (at batch 1, Flex's 512→512 3x3 on 14x14
/// maps runs at 40 GFLOP/s, ours at 134).
fn flex_has_few_tiles(s: &ConvShape) -> bool {
    let pixels = s.output().map_or(0, |o| o[2] * o[3]);
    s.input[0] * pixels < 4 * 512
}

/// Flex's input gradient: the transposed convolution `conv2d_x_backward` calls (Burn's
/// `conv2d_x_backward` takes the input only for its shape; building a zero input of that shape
/// cost a pass over memory per call).
pub(crate) fn flex_input_grad(weight: FlexTensor, grad: FlexTensor, s: &ConvShape) -> FlexTensor {
    let padding_out = s.unread_edge(grad.shape().dims::<4>());
    Flex::conv_transpose2d(
        grad,
        weight,
        None,
        burn::tensor::ops::ConvTransposeOptions::new(
            s.stride,
            s.padding,
            padding_out,
            s.dilation,
            1,
        ),
    )
}

/// Which kernel computes a convolution's input gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputGrad {
    /// Flex's transposed convolution.
    Flex,
    /// Ours: `Wᵀ · dY` (col2im for wider kernels; only 1x1 takes it).
    Gemm,
    /// Ours: the forward convolution of `dY` with the flipped kernel (stride 1).
    AsConv,
}

/// Where our input gradients beat Flex's transposed convolution (`kernels/examples/
/// conv_paths.rs`, 2-core AVX-512, batch 16 unless said). With two images or more, ours run
/// images in parallel with single-threaded products, and win wherever they apply:
/// - 1x1, stride 1, no padding: `Wᵀ · dY` (ResNet-50's 64→256 on 56x56: 277 against 153
///   GFLOP/s; 512→128 on 28x28: 288 against 172; 2048→512 on 7x7: 147 against 127);
/// - wider kernels with stride 1: the forward convolution of `dY` with the flipped kernel
///   (DenseNet-121's 128→32 3x3: 169-292 against 49-111; ResNet-50's 3x3: 216-293 against
///   123-247; VGG-16's: 212-365 against 184-322, with 128→256 and 256→512 a tie). Flex
///   scatters `Ci·9` rows of columns back onto the image where the flipped convolution
///   gathers `Co·9`.
///
/// At batch 1 (the image split into pieces of rows or columns, one per thread or more):
/// `Wᵀ · dY` for 1x1 on maps of 28x28 or more or where Flex has few tiles (ResNet-50's and
/// DenseNet-121's: 101-301 against 86-229, except 1024→256 on 14x14: 127 against 193); the
/// flipped convolution with fewer output than input channels (DenseNet-121's 128→32:
/// 58-281 against 43-83), or as many, up to 256, on maps of 28x28 or more (ResNet-50's 64→64
/// on 56x56: 218 against 121; 128→128 on 28x28: 202 against 173; VGG-16's 256→256 on 56x56:
/// 322 against 267); Flex's with 512 channels (VGG-16's 512→512 on 28x28: 294 against 252)
/// or on small maps (ResNet-50's 256→256 on 14x14: 216 against 157).
pub fn input_grad_path(s: &ConvShape) -> InputGrad {
    let [ci, co] = [s.input[1], s.out_channels];
    let batch = s.input[0] >= 2;
    let pointwise = s.kernel == [1, 1];
    if pointwise
        && s.stride == [1, 1]
        && s.padding == [0, 0]
        && (batch || s.input[2] * s.input[3] >= 28 * 28 || flex_has_few_tiles(s))
    {
        InputGrad::Gemm
    } else if !pointwise
        && crate::conv::input_grad_as_conv_applies(s)
        && (batch || co < ci || (co == ci && co <= 256 && s.input[2] * s.input[3] >= 28 * 28))
    {
        InputGrad::AsConv
    } else {
        InputGrad::Flex
    }
}
