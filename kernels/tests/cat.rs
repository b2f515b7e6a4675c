//! The parallel join of two tensors equals Burn's `Tensor::cat` bit for bit, along every
//! dimension, for views as well as whole tensors and for tensors long enough to be cut into
//! several pieces; under autodiff each input gets the gradient Burn's `cat` gives it.

use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::cat::{cat, cat2};

mod common;
use common::values;

#[test]
fn joining_equals_burns_cat_along_every_dimension() {
    let device = Device::flex();
    // Else `cat` is Burn's own and the comparisons below compare Burn with itself.
    assert!(hearth_kernels::enabled() && hearth_kernels::is_flex(&device));
    let a = Tensor::<4>::random([2, 3, 4, 5], Distribution::Normal(0.0, 1.0), &device);
    for dim in 0..4 {
        let mut dims = [2, 3, 4, 5];
        dims[dim] = 2;
        let b = Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let ours = cat(a.clone(), b.clone(), dim);
        let theirs = Tensor::cat(vec![a.clone(), b], dim);
        assert_eq!(ours.dims(), theirs.dims(), "dim {dim}: shape");
        assert_eq!(values(ours), values(theirs), "dim {dim}");
    }
    // Views: a transposed tensor (not contiguous) and a slice (contiguous, offset).
    let t =
        Tensor::<4>::random([2, 5, 4, 3], Distribution::Normal(0.0, 1.0), &device).swap_dims(1, 3);
    let s = Tensor::<4>::random([2, 9, 4, 5], Distribution::Normal(0.0, 1.0), &device).slice([
        0..2,
        3..7,
        0..4,
        0..5,
    ]);
    let ours = cat(t.clone(), s.clone(), 1);
    assert_eq!(values(ours), values(Tensor::cat(vec![t, s], 1)), "views");
}

#[test]
fn long_runs_are_cut_into_pieces_that_cover_them_once() {
    // 3 runs of 70,000 + 140,000 values: every run is cut into pieces of 65,536 at most.
    let a: Vec<f32> = (0..3 * 70_000).map(|v| v as f32).collect();
    let b: Vec<f32> = (0..3 * 140_000).map(|v| -(v as f32)).collect();
    let y = cat2(&a, &b, 3, 70_000, 140_000);
    assert_eq!(y.len(), a.len() + b.len());
    for o in 0..3 {
        let run = &y[o * 210_000..(o + 1) * 210_000];
        assert_eq!(
            &run[..70_000],
            &a[o * 70_000..(o + 1) * 70_000],
            "run {o}: a"
        );
        assert_eq!(
            &run[70_000..],
            &b[o * 140_000..(o + 1) * 140_000],
            "run {o}: b"
        );
    }
}

#[test]
fn gradients_equal_burns_cat() {
    let device = Device::flex().autodiff();
    assert!(hearth_kernels::enabled() && hearth_kernels::is_flex(&device));
    let a0 = Tensor::<4>::random([2, 3, 4, 4], Distribution::Normal(0.0, 1.0), &device);
    let b0 = Tensor::<4>::random([2, 2, 4, 4], Distribution::Normal(0.0, 1.0), &device);
    for b_tracked in [true, false] {
        let run = |ours: bool| {
            let a = a0.clone().detach().require_grad();
            let b = b0.clone().detach();
            let b = if b_tracked { b.require_grad() } else { b };
            // `a` is used twice (as a DenseNet layer's input is): the gradients add.
            let y = if ours {
                cat(a.clone(), b.clone(), 1)
            } else {
                Tensor::cat(vec![a.clone(), b.clone()], 1)
            };
            let dy = Tensor::<1, Int>::arange(0..2 * 5 * 16, &device)
                .float()
                .reshape([2, 5, 4, 4])
                .div_scalar(3.0)
                .sin();
            let loss = (y * dy).sum() + (a.clone() * a.clone()).sum();
            let grads = loss.backward();
            let da = values(a.grad(&grads).expect("a is tracked"));
            let db = b.grad(&grads).map(values);
            (da, db)
        };
        let (ours, theirs) = (run(true), run(false));
        assert_eq!(ours.0, theirs.0, "a's gradient (b tracked: {b_tracked})");
        assert_eq!(ours.1, theirs.1, "b's gradient (b tracked: {b_tracked})");
        assert_eq!(ours.1.is_some(), b_tracked);
    }
}
