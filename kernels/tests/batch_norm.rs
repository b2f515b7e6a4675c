//! The fused batch norm (+ ReLU) equals Burn's `BatchNorm` (+ `relu`) while training, within
//! 1e-4 relative: output, input / γ / β gradients and the running statistics after the step,
//! over random shapes (batch 1, one channel, 1x1 and odd planes, rank 3 and 4).

use burn::module::Param;
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::activation::relu;
use hearth_kernels::norm::batch_norm;

mod common;
use common::{Shapes, close, values};

/// A batch norm with the given γ and β on `device`.
fn module(gamma: &Tensor<1>, beta: &Tensor<1>, device: &Device) -> BatchNorm {
    let mut bn = BatchNormConfig::new(gamma.dims()[0]).init(device);
    bn.gamma = Param::from_tensor(gamma.clone().detach());
    bn.beta = Param::from_tensor(beta.clone().detach());
    bn
}

struct Outcome {
    out: Vec<f32>,
    dx: Vec<f32>,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    running: (Vec<f32>, Vec<f32>),
}

fn step<const D: usize>(
    bn: &BatchNorm,
    x: &Tensor<D>,
    dy: &Tensor<D>,
    with_relu: bool,
    fused: bool,
) -> Outcome {
    let x = x.clone().detach().require_grad();
    let y = if fused {
        batch_norm(bn, x.clone(), with_relu)
    } else {
        let y = bn.forward(x.clone());
        if with_relu { relu(y) } else { y }
    };
    let out = values(y.clone());
    let grads = (y * dy.clone()).sum().backward();
    Outcome {
        out,
        dx: values(x.grad(&grads).expect("input gradient")),
        dgamma: values(bn.gamma.grad(&grads).expect("γ gradient")),
        dbeta: values(bn.beta.grad(&grads).expect("β gradient")),
        running: (
            values(bn.running_mean.value()),
            values(bn.running_var.value()),
        ),
    }
}

fn compare(fast: Outcome, reference: Outcome, what: &str) {
    close(&fast.out, &reference.out, &format!("{what} output"));
    close(&fast.dx, &reference.dx, &format!("{what} input grad"));
    close(&fast.dgamma, &reference.dgamma, &format!("{what} γ grad"));
    close(&fast.dbeta, &reference.dbeta, &format!("{what} β grad"));
    close(
        &fast.running.0,
        &reference.running.0,
        &format!("{what} running mean"),
    );
    close(
        &fast.running.1,
        &reference.running.1,
        &format!("{what} running var"),
    );
}

#[test]
fn fused_batch_norm_equals_burns_over_random_shapes() {
    let device = Device::flex().autodiff();
    let mut g = Shapes(0x51_7cc1_b727_220a);
    let mut cases = vec![
        (1, 1, 1, 1),
        (1, 3, 1, 1),
        (2, 1, 5, 7),
        (4, 8, 9, 9),
        (1, 5, 3, 2),
    ];
    for _ in 0..20 {
        cases.push((g.next(1, 4), g.next(1, 8), g.next(1, 9), g.next(1, 9)));
    }
    for (i, (n, c, h, w)) in cases.into_iter().enumerate() {
        if n * h * w == 1 {
            continue; // one value per channel: the variance is 0, both sides divide by sqrt(ε)
        }
        let with_relu = i % 2 == 0;
        let what = format!("n{n} c{c} {h}x{w} relu {with_relu}");
        let x = Tensor::<4>::random([n, c, h, w], Distribution::Normal(0.5, 2.0), &device);
        let dy = Tensor::<4>::random([n, c, h, w], Distribution::Normal(0.0, 1.0), &device);
        let gamma = Tensor::<1>::random([c], Distribution::Normal(1.0, 0.5), &device);
        let beta = Tensor::<1>::random([c], Distribution::Normal(0.0, 0.5), &device);
        let fast = step(&module(&gamma, &beta, &device), &x, &dy, with_relu, true);
        let reference = step(&module(&gamma, &beta, &device), &x, &dy, with_relu, false);
        compare(fast, reference, &what);
    }
}

#[test]
fn fused_batch_norm_takes_rank_3_inputs() {
    let device = Device::flex().autodiff();
    let x = Tensor::<3>::random([3, 4, 10], Distribution::Normal(0.0, 1.0), &device);
    let dy = Tensor::<3>::random([3, 4, 10], Distribution::Normal(0.0, 1.0), &device);
    let gamma = Tensor::<1>::random([4], Distribution::Normal(1.0, 0.5), &device);
    let beta = Tensor::<1>::random([4], Distribution::Normal(0.0, 0.5), &device);
    let fast = step(&module(&gamma, &beta, &device), &x, &dy, true, true);
    let reference = step(&module(&gamma, &beta, &device), &x, &dy, true, false);
    compare(fast, reference, "rank 3");
}

/// Without autodiff the one-pass inference kernel uses the running statistics (random ones
/// here, not the initial 0 and 1), leaves them as they were, and equals Burn's `BatchNorm`
/// (+ `relu`), rank 3 and 4, odd planes.
#[test]
fn inference_batch_norm_equals_burns_with_running_statistics() {
    use burn::module::RunningState;
    let plain = Device::flex();
    for (i, dims) in [
        vec![2, 4, 3, 3],
        vec![3, 5, 7],
        vec![1, 6, 1, 1],
        vec![2, 3, 5, 9],
    ]
    .into_iter()
    .enumerate()
    {
        let c = dims[1];
        // Channel 0 gets γ = 1 and (below) one input at -100, far under any running mean here,
        // so the ReLU case always has a value to clip, whatever the random draw.
        // Burn's slice takes one range per dimension: one here.
        #[allow(clippy::single_range_in_vec_init)]
        let gamma = Tensor::<1>::random([c], Distribution::Normal(1.0, 0.5), &plain)
            .slice_assign([0..1], Tensor::<1>::ones([1], &plain));
        let beta = Tensor::<1>::random([c], Distribution::Normal(0.0, 0.5), &plain);
        let mut bn = module(&gamma, &beta, &plain);
        let mean = Tensor::<1>::random([c], Distribution::Normal(0.3, 1.0), &plain);
        let var = Tensor::<1>::random([c], Distribution::Uniform(0.2, 3.0), &plain);
        bn.running_mean = RunningState::new(mean.clone());
        bn.running_var = RunningState::new(var.clone());
        for with_relu in [false, true] {
            let what = format!("inference {dims:?} relu {with_relu}");
            let check = |ours: Vec<f32>, reference: Vec<f32>| {
                close(&ours, &reference, &what);
                if with_relu {
                    assert!(ours.contains(&0.0), "{what}: ReLU clipped nothing");
                }
            };
            if dims.len() == 3 {
                let x = Tensor::<3>::random(
                    [dims[0], c, dims[2]],
                    Distribution::Normal(0.0, 2.0),
                    &plain,
                )
                .slice_assign(
                    [0..1, 0..1, 0..1],
                    Tensor::<3>::full([1, 1, 1], -100.0, &plain),
                );
                let (ours, reference) = both(&bn, x, with_relu);
                check(ours, reference);
            } else {
                let x = Tensor::<4>::random(
                    [dims[0], c, dims[2], dims[3]],
                    Distribution::Normal(0.0, 2.0),
                    &plain,
                )
                .slice_assign(
                    [0..1, 0..1, 0..1, 0..1],
                    Tensor::<4>::full([1, 1, 1, 1], -100.0, &plain),
                );
                let (ours, reference) = both(&bn, x, with_relu);
                check(ours, reference);
            }
        }
        assert_eq!(
            values(bn.running_mean.value()),
            values(mean),
            "case {i}: mean kept"
        );
        assert_eq!(
            values(bn.running_var.value()),
            values(var),
            "case {i}: variance kept"
        );
    }
}

/// `(ours, Burn's BatchNorm + relu)` on `x`, both as values.
fn both<const D: usize>(bn: &BatchNorm, x: Tensor<D>, with_relu: bool) -> (Vec<f32>, Vec<f32>) {
    let reference = bn.forward(x.clone());
    let reference = if with_relu {
        relu(reference)
    } else {
        reference
    };
    (values(batch_norm(bn, x, with_relu)), values(reference))
}

/// A batch norm over an input whose first channels are an earlier batch norm's input, given
/// that batch norm's statistics (DenseNet's layers): output, gradients and running statistics
/// equal computing every statistic afresh bit for bit; statistics that do not fit are not
/// used; and the known statistics are really what it takes (wrong ones change the output).
#[test]
fn batch_norm_after_known_statistics_changes_no_bit() {
    use hearth_kernels::norm::{BatchStats, batch_norm_after};
    let device = Device::flex().autodiff();
    let (n, c1, g, h, w) = (3, 5, 2, 6, 7);
    let prev = Tensor::<4>::random([n, c1, h, w], Distribution::Normal(0.5, 2.0), &device);
    let new = Tensor::<4>::random([n, g, h, w], Distribution::Normal(-0.3, 1.5), &device);
    let ones = |c| Tensor::<1>::ones([c], &device);
    let zeros = |c| Tensor::<1>::zeros([c], &device);
    let (_, known) = batch_norm_after(
        &module(&ones(c1), &zeros(c1), &device),
        prev.clone(),
        true,
        None,
    );
    let known = known.expect("the fused training path returns its statistics");
    let x = Tensor::cat(vec![prev, new], 1);
    let c = c1 + g;
    let gamma = Tensor::<1>::random([c], Distribution::Normal(1.0, 0.5), &device);
    let beta = Tensor::<1>::random([c], Distribution::Normal(0.0, 0.5), &device);
    let dy = Tensor::<4>::random([n, c, h, w], Distribution::Normal(0.0, 1.0), &device);
    let run = |known: Option<&BatchStats>| {
        let bn = module(&gamma, &beta, &device);
        let x = x.clone().detach().require_grad();
        let (y, stats) = batch_norm_after(&bn, x.clone(), true, known);
        let grads = (y.clone() * dy.clone()).sum().backward();
        let stats = stats.expect("statistics of the whole input");
        [
            values(y),
            values(x.grad(&grads).expect("input gradient")),
            values(bn.gamma.grad(&grads).expect("γ gradient")),
            values(bn.beta.grad(&grads).expect("β gradient")),
            values(bn.running_mean.value()),
            values(bn.running_var.value()),
            values(stats.mean),
            values(stats.var),
        ]
    };
    let afresh = run(None);
    assert_eq!(
        run(Some(&known)),
        afresh,
        "known statistics of the first {c1} channels"
    );
    // Statistics for more channels than the input has are not taken.
    let too_many = BatchStats {
        mean: zeros(c + 1),
        var: ones(c + 1),
    };
    assert_eq!(run(Some(&too_many)), afresh, "statistics that do not fit");
    // Wrong statistics for the first channels: the output moves, so the equality above is
    // the known statistics' doing.
    let wrong = BatchStats {
        mean: known.mean.clone().add_scalar(1.0),
        var: known.var.clone(),
    };
    assert_ne!(run(Some(&wrong))[0], afresh[0], "wrong known statistics");
}
