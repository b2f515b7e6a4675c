//! A bf16 or f16 convolution or linear layer on Flex takes the f32 kernels on its inputs and
//! weights rounded to the low type, the result rounded to it: exactly that, bit for bit; close
//! to Burn's own low-precision kernels (an independent implementation) in the forward and the
//! input's gradient; the gradient in the activation's type and the parameters' in f32.

use burn::module::Param;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Distribution, FloatDType};

mod common;
use common::values;

/// `|a - b| / |b|` over whole vectors.
fn gap(a: &[f32], b: &[f32]) -> f32 {
    let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let n: f32 = b.iter().map(|y| y * y).sum();
    (d / n.max(f32::MIN_POSITIVE)).sqrt()
}

/// `a` equals `b` bit for bit; else how many values differ, and the first.
fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ: Vec<usize> = (0..a.len())
        .filter(|&i| a[i].to_bits() != b[i].to_bits())
        .collect();
    if let Some(&i) = differ.first() {
        panic!(
            "{what}: {} of {} values differ, the first [{i}]: {} vs {}",
            differ.len(),
            a.len(),
            a[i],
            b[i]
        );
    }
}

/// The low types and the gap each may show against Burn's own kernels of that type (a few of
/// its epsilons: both round the output once, and Burn's may round partial sums).
const TYPES: [(FloatDType, f32); 2] = [(FloatDType::BF16, 2e-2), (FloatDType::F16, 4e-3)];

#[test]
fn a_low_precision_convolution_is_the_f32_kernel_on_rounded_values() {
    let device = Device::flex().autodiff();
    // (in, out, kernel, stride, padding): ResNet's stem, a 3x3, a strided 1x1 (its own path),
    // a plain 1x1.
    let shapes = [
        (3, 8, 7, 2, 3),
        (8, 8, 3, 1, 1),
        (8, 16, 1, 2, 0),
        (16, 8, 1, 1, 0),
    ];
    for (ci, co, k, stride, pad) in shapes {
        let conv = Conv2dConfig::new([ci, co], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
            .with_bias(true)
            .init(&device);
        let x = Tensor::<4>::random([2, ci, 12, 12], Distribution::Normal(0.0, 1.0), &device);
        for (dt, allowed) in TYPES {
            let what = format!("{ci}->{co} {k}x{k} stride {stride}, {dt:?}");
            let low = x.clone().cast(dt).detach().require_grad();
            let y = hearth_kernels::conv2d(&conv, low.clone());
            assert_eq!(y.dtype(), DType::from(dt), "{what}: the output's type");

            // Exactly the f32 kernel on the rounded input, weight and bias, rounded.
            let rounded: Conv2d = Conv2d {
                weight: Param::from_tensor(
                    conv.weight.val().cast(dt).cast(FloatDType::F32).detach(),
                ),
                bias: conv
                    .bias
                    .as_ref()
                    .map(|b| Param::from_tensor(b.val().cast(dt).cast(FloatDType::F32).detach())),
                ..conv.clone()
            };
            let by_f32 =
                hearth_kernels::conv2d(&rounded, low.clone().cast(FloatDType::F32)).cast(dt);
            same_bits(
                &values(y.clone()),
                &values(by_f32),
                &format!("{what}: the f32 kernel's result"),
            );

            // Close to Burn's own kernels in the low type, forward and backward.
            let reference = burn::tensor::module::conv2d(
                low.clone(),
                conv.weight.val().cast(dt),
                conv.bias.as_ref().map(|b| b.val().cast(dt)),
                ConvOptions::new([stride, stride], [pad, pad], [1, 1], 1),
            );
            let g = gap(&values(y.clone()), &values(reference.clone()));
            assert!(
                g <= allowed,
                "{what}: forward gap {g} to Burn's {dt:?} kernel"
            );
            let ours = y.sum().backward();
            let dx = low.grad(&ours).expect("the input's gradient");
            assert_eq!(
                dx.dtype(),
                DType::from(dt),
                "{what}: the input gradient's type"
            );
            let dw = conv
                .weight
                .val()
                .grad(&ours)
                .expect("the weight's gradient");
            assert_eq!(dw.dtype(), DType::F32, "{what}: the weight gradient's type");
            let theirs = reference.sum().backward();
            let dx_ref = low.grad(&theirs).expect("the reference input gradient");
            let g = gap(&values(dx), &values(dx_ref));
            assert!(
                g <= allowed,
                "{what}: input-gradient gap {g} to Burn's {dt:?} kernel"
            );
        }
    }
}

#[test]
fn a_low_precision_linear_layer_is_the_f32_product_on_rounded_values() {
    let device = Device::flex().autodiff();
    let linear = LinearConfig::new(40, 24).init(&device);
    let x = Tensor::<2>::random([5, 40], Distribution::Normal(0.0, 1.0), &device);
    for (dt, allowed) in TYPES {
        let low = x.clone().cast(dt).detach().require_grad();
        let y = hearth_kernels::linear(&linear, low.clone());
        assert_eq!(y.dtype(), DType::from(dt));
        let by_f32 = burn::tensor::module::linear(
            low.clone().cast(FloatDType::F32),
            linear.weight.val().cast(dt).cast(FloatDType::F32),
            linear
                .bias
                .as_ref()
                .map(|b| b.val().cast(dt).cast(FloatDType::F32)),
        )
        .cast(dt);
        same_bits(&values(y.clone()), &values(by_f32), &format!("{dt:?}"));
        let reference = burn::tensor::module::linear(
            low.clone(),
            linear.weight.val().cast(dt),
            linear.bias.as_ref().map(|b| b.val().cast(dt)),
        );
        let g = gap(&values(y.clone()), &values(reference));
        assert!(g <= allowed, "{dt:?}: gap {g} to Burn's kernel");
        let grads = y.sum().backward();
        let dw = linear
            .weight
            .val()
            .grad(&grads)
            .expect("the weight's gradient");
        assert_eq!(dw.dtype(), DType::F32, "{dt:?}: the weight gradient's type");
    }
}

/// Every f32 bit pattern class: zeros, subnormals of both types, ties, the largest finite
/// values, infinities and NaNs (quiet and signalling, both signs), then random patterns.
fn awkward_values() -> Vec<f32> {
    let mut bits: Vec<u32> = vec![
        0,
        0x8000_0000,
        1,
        0x0000_8000,
        0x0001_8000,
        0x3380_0000,
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_1000,
        0x477F_E000,
        0x477F_F000,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0x7F80_0001,
        0xFF80_0001,
        0x7FFF_FFFF,
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..100_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bits.push(state as u32);
    }
    bits.into_iter().map(f32::from_bits).collect()
}

/// The bits of a tensor of any float type, as u32 (16-bit types widened).
fn bits<const D: usize>(t: Tensor<D>) -> Vec<u32> {
    let data = t.into_data();
    match data.dtype() {
        DType::F32 => data
            .try_to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::BF16 => data
            .try_to_vec::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| u32::from(v.to_bits()))
            .collect(),
        DType::F16 => data
            .try_to_vec::<half::f16>()
            .unwrap()
            .iter()
            .map(|v| u32::from(v.to_bits()))
            .collect(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_fast_cast_gives_burns_bits_and_casts_the_gradient_back() {
    let device = Device::flex();
    let v = awkward_values();
    let n = v.len();
    let x = Tensor::<1>::from_data(TensorData::new(v, [n]), &device);
    for dt in [FloatDType::BF16, FloatDType::F16] {
        let ours = hearth_kernels::cast(x.clone(), dt);
        let theirs = x.clone().cast(dt);
        assert_eq!(ours.dtype(), DType::from(dt));
        let (a, b) = (bits(ours.clone()), bits(theirs.clone()));
        let differ = (0..n).filter(|&i| a[i] != b[i]).count();
        assert_eq!(
            differ, 0,
            "{dt:?}: {differ} of {n} values differ from Burn's cast"
        );
        let (a, b) = (
            bits(hearth_kernels::cast(theirs.clone(), FloatDType::F32)),
            bits(theirs.cast(FloatDType::F32)),
        );
        let differ = (0..n).filter(|&i| a[i] != b[i]).count();
        assert_eq!(differ, 0, "{dt:?} -> f32: {differ} of {n} values differ");
    }
    // Under autodiff the gradient comes back in the input's type.
    let device = Device::flex().autodiff();
    let x = Tensor::<2>::random([3, 5], Distribution::Normal(0.0, 1.0), &device).require_grad();
    for dt in [FloatDType::BF16, FloatDType::F16] {
        let y = hearth_kernels::cast(x.clone(), dt);
        let grads = (y * 3.0).sum().backward();
        let g = x.grad(&grads).expect("the input's gradient");
        assert_eq!(g.dtype(), DType::F32, "{dt:?}");
        assert_eq!(values(g), vec![3.0; 15], "{dt:?}");
    }
}

#[test]
fn low_precision_max_pooling_equals_burns_forward_and_backward() {
    use burn::nn::pool::MaxPool2dConfig;
    let device = Device::flex().autodiff();
    let pool = MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init();
    let x = Tensor::<4>::random([2, 3, 9, 9], Distribution::Normal(0.0, 1.0), &device);
    for dt in [FloatDType::BF16, FloatDType::F16] {
        let low = x.clone().cast(dt).detach().require_grad();
        let ours = hearth_kernels::pool::max_pool(&pool, low.clone());
        let theirs = pool.forward(low.clone());
        assert_eq!(ours.dtype(), DType::from(dt));
        assert_eq!(bits(ours.clone()), bits(theirs.clone()), "{dt:?} forward");
        let grad = |y: Tensor<4>, w: Tensor<4>, at: &Tensor<4>| {
            at.grad(&(y * w).sum().backward())
                .expect("the input's gradient")
        };
        // Weights that are multiples of 1/64 below 1: every sum of up to four (3x3 windows at
        // stride 2 overlap at most four times) is exact in bf16 and f16, so ours and Burn's
        // route the same gradients to the same inputs bit for bit, whatever the order of adding.
        let dims = ours.dims();
        let dyadic: Vec<f32> = (0..dims.iter().product::<usize>())
            .map(|i| ((i * 37 + 11) % 64) as f32 / 64.0)
            .collect();
        let dyadic = Tensor::<4>::from_data(TensorData::new(dyadic, dims), &device).cast(dt);
        let (g_ours, g_theirs) = (grad(ours, dyadic.clone(), &low), grad(theirs, dyadic, &low));
        assert_eq!(g_ours.dtype(), DType::from(dt));
        same_bits(
            &values(g_ours),
            &values(g_theirs),
            &format!("{dt:?} backward"),
        );
        // Any weights: ours sums in f32 and rounds once, so it is the f32 pooling's gradient on
        // the same (widened) values rounded to the low type. (Burn's rounds every addition, up
        // to two units in the last place away from that.)
        let weights = Tensor::<4>::random(dims, Distribution::Default, &device).cast(dt);
        let wide = low.clone().cast(FloatDType::F32).detach().require_grad();
        let g_wide = grad(
            pool.forward(wide.clone()),
            weights.clone().cast(FloatDType::F32),
            &wide,
        );
        // (A backward consumes its graph: the forward again.)
        let ours = hearth_kernels::pool::max_pool(&pool, low.clone());
        let g_ours = grad(ours, weights, &low);
        same_bits(
            &values(g_ours),
            &values(g_wide.cast(dt)),
            &format!("{dt:?} backward, rounded once"),
        );
    }
}
