use burn::module::{Param, RunningState};
use burn::nn::conv::Conv2dConfig;
use burn::nn::{BatchNormConfig, PaddingConfig2d};
use burn::tensor::Distribution;

use super::*;

/// A convolution without bias and a batch norm with statistics of its own (not the
/// initial zeros and ones), on `device`.
fn layer(ci: usize, co: usize, k: usize, stride: usize, device: &Device) -> (Conv2d, BatchNorm) {
    let conv = Conv2dConfig::new([ci, co], [k, k])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(k / 2, k / 2, k / 2, k / 2))
        .with_bias(false)
        .init(device);
    let mut bn = BatchNormConfig::new(co).init(device);
    let normal = Distribution::Normal(0.0, 1.0);
    bn.gamma = Param::from_tensor(Tensor::random([co], normal, device));
    bn.beta = Param::from_tensor(Tensor::random([co], normal, device));
    bn.running_mean = RunningState::new(Tensor::random([co], normal, device));
    bn.running_var = RunningState::new(Tensor::random(
        [co],
        Distribution::Uniform(0.2, 3.0),
        device,
    ));
    (conv, bn)
}

/// The separate ops [`conv2d_batch_norm`] stands for.
fn separate(conv: &Conv2d, bn: &BatchNorm, x: Tensor<4>, after: &After) -> Tensor<4> {
    let relu = matches!(after, After::Relu);
    let y = crate::norm::batch_norm(bn, crate::conv2d(conv, x), relu);
    match after {
        After::AddRelu(r) => burn::tensor::activation::relu(y + r.clone()),
        _ => y,
    }
}

fn values(t: Tensor<4>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 values")
}

/// Every path of our forward (1x1 cut by columns or by output channels, a strided 1x1 and 3x3
/// by im2col, Winograd's F(2x2, 3x3), the 3-channel stem), at batch 1 and 2, with nothing,
/// ReLU, or a residual and ReLU after the batch norm: the one op gives the separate ops'
/// values exactly.
#[test]
fn the_one_op_gives_the_separate_ops_values() {
    let device = Device::flex();
    for (ci, co, k, stride, side) in [
        (32, 48, 1, 1, 28),
        (64, 96, 1, 1, 7),
        (32, 64, 1, 2, 14),
        (16, 24, 3, 2, 15),
        (64, 32, 3, 1, 28),
        (64, 64, 3, 1, 7),
        (3, 16, 7, 2, 32),
    ] {
        let (conv, bn) = layer(ci, co, k, stride, &device);
        for n in [1, 2] {
            let x =
                Tensor::<4>::random([n, ci, side, side], Distribution::Normal(0.0, 1.0), &device);
            assert!(
                folds(&conv, &x),
                "{ci}->{co} {k}x{k} s{stride} takes the one op"
            );
            let out = side.div_ceil(stride);
            let residual =
                Tensor::<4>::random([n, co, out, out], Distribution::Normal(0.0, 1.0), &device);
            for after in [After::Nothing, After::Relu, After::AddRelu(residual)] {
                let want = values(separate(&conv, &bn, x.clone(), &after));
                let name = match &after {
                    After::Nothing => "nothing",
                    After::Relu => "relu",
                    After::AddRelu(_) => "residual and relu",
                };
                let got = values(conv2d_batch_norm(&conv, &bn, x.clone(), after));
                assert_eq!(
                    got.len(),
                    want.len(),
                    "{ci}->{co} {k}x{k} s{stride} batch {n}"
                );
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differ, 0,
                    "{ci}->{co} {k}x{k} s{stride} on {side}, batch {n}, {name}: {differ} values differ"
                );
                if name != "nothing" {
                    assert!(got.iter().all(|&v| v >= 0.0), "ReLU applied ({name})");
                }
            }
        }
    }
}

/// While training (autodiff), the separate ops run and gradients flow through them.
#[test]
fn training_takes_the_separate_ops() {
    let device = Device::flex().autodiff();
    let (conv, bn) = layer(8, 16, 3, 1, &device);
    let x = Tensor::<4>::random([2, 8, 10, 10], Distribution::Normal(0.0, 1.0), &device);
    assert!(!folds(&conv, &x));
    let y = conv2d_batch_norm(&conv, &bn, x, After::Relu);
    let grads = y.sum().backward();
    let dw = conv.weight.grad(&grads).expect("a weight gradient");
    assert!(dw.abs().sum().into_scalar::<f32>() > 0.0);
}

/// A shape the one op cannot take (the residual's shape wrong) is refused as the separate ops
/// refuse it, not computed into the wrong places.
#[test]
fn a_residual_of_another_shape_is_refused() {
    let device = Device::flex();
    let (conv, bn) = layer(8, 16, 3, 1, &device);
    let x = Tensor::<4>::random([1, 8, 10, 10], Distribution::Normal(0.0, 1.0), &device);
    let residual = Tensor::<4>::zeros([1, 16, 9, 10], &device);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        conv2d_batch_norm(&conv, &bn, x, After::AddRelu(residual))
    }));
    assert!(
        result.is_err(),
        "a [1, 16, 9, 10] residual for a [1, 16, 10, 10] output"
    );
}
