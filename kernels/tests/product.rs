//! The linear layers' product on Flex (`hearth_kernels::product`): the same values as Flex's
//! matmul on plain and strided matrices, the same gradients as Burn's `Linear` under autodiff
//! (frozen weights and inputs without a gradient included), and its result held once where
//! Flex's product holds it twice for a moment: the live bytes are counted by this test
//! binary's allocator.

use std::sync::atomic::Ordering;

use burn::nn::LinearConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::ext::matmul2;

mod common;
mod counting;
use common::{Shapes, close, values};
use counting::{ONE_AT_A_TIME, PEAK, reset_peak};

fn product(lhs: Tensor<2>, rhs: Tensor<2>) -> Tensor<2> {
    matmul2(lhs, rhs)
}

#[test]
fn the_product_equals_flex_on_plain_strided_and_empty_matrices() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let flex = Device::flex();
    let mut g = Shapes(0x9e37_79b9_7f4a_7c15);
    // One row, k of 1 and 2 (gemm's vector paths), a parallel size, then random ones.
    let mut cases = vec![(1, 7, 5), (9, 1, 4), (33, 2, 65), (300, 200, 250)];
    for _ in 0..12 {
        cases.push((g.next(1, 80), g.next(1, 80), g.next(1, 80)));
    }
    let normal = Distribution::Normal(0.0, 1.0);
    for (m, k, n) in cases {
        let a = Tensor::<2>::random([m, k], normal, &flex);
        let b = Tensor::<2>::random([k, n], normal, &flex);
        let what = format!("{m} x {k} x {n}");
        close(
            &values(product(a.clone(), b.clone())),
            &values(a.clone().matmul(b.clone())),
            &what,
        );
        // Transposed views of both (a weight's and an input's, as the backward reads them).
        let at = Tensor::<2>::random([k, m], normal, &flex).transpose();
        let bt = Tensor::<2>::random([n, k], normal, &flex).transpose();
        close(
            &values(product(at.clone(), bt.clone())),
            &values(at.clone().matmul(bt.clone())),
            &format!("{what}, transposed"),
        );
        // A slice that starts inside its storage.
        let wide = Tensor::<2>::random([m, k + 3], normal, &flex);
        let sliced = wide.slice([0..m, 2..k + 2]);
        close(
            &values(product(sliced.clone(), b.clone())),
            &values(sliced.matmul(b)),
            &format!("{what}, sliced"),
        );
    }
    let empty = product(
        Tensor::<2>::zeros([3, 0], &flex),
        Tensor::<2>::zeros([0, 4], &flex),
    );
    assert_eq!(empty.dims(), [3, 4]);
    assert_eq!(values(empty), vec![0.0; 12], "k = 0 gives zeros");
}

#[test]
fn a_linear_layer_trains_with_burns_gradients() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ad = Device::flex().autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    for (rows, inputs, outputs) in [(2, 50, 30), (16, 300, 100), (1, 7, 3)] {
        let layer = LinearConfig::new(inputs, outputs).init(&ad);
        let x = Tensor::<3>::random([rows, 2, inputs], normal, &ad);
        let target = Tensor::<3>::random([rows, 2, outputs], normal, &ad);
        let what = format!("{rows} x 2 x {inputs} -> {outputs}");
        let run = |ours: bool, x: Tensor<3>| {
            let y = if ours {
                hearth_kernels::linear(&layer, x.clone())
            } else {
                layer.forward(x.clone())
            };
            let loss = (y.clone() - target.clone()).powi_scalar(2).sum();
            let grads = loss.backward();
            let dx = x.grad(&grads).map(values);
            let dw = layer.weight.val().grad(&grads).map(values);
            let db = layer
                .bias
                .as_ref()
                .and_then(|b| b.val().grad(&grads))
                .map(values);
            (values(y), dx, dw, db)
        };
        let x_grad = x.clone().require_grad();
        let (ours, theirs) = (run(true, x_grad.clone()), run(false, x_grad));
        close(&ours.0, &theirs.0, &format!("{what}: output"));
        for (o, t, name) in [
            (&ours.1, &theirs.1, "input"),
            (&ours.2, &theirs.2, "weight"),
            (&ours.3, &theirs.3, "bias"),
        ] {
            let (o, t) = (
                o.as_ref()
                    .unwrap_or_else(|| panic!("{what}: no {name} gradient of ours")),
                t.as_ref()
                    .unwrap_or_else(|| panic!("{what}: no {name} gradient of Burn's")),
            );
            close(o, t, &format!("{what}: {name} gradient"));
        }
        // An input that needs no gradient: the weight's still flows, the input has none.
        let (ours, theirs) = (run(true, x.clone()), run(false, x.clone()));
        assert!(
            ours.1.is_none(),
            "{what}: an untracked input got a gradient"
        );
        close(
            ours.2.as_deref().unwrap_or_default(),
            theirs.2.as_deref().unwrap_or_default(),
            &format!("{what}: weight gradient, input untracked"),
        );
        assert!(ours.2.is_some(), "{what}: no weight gradient");
    }
    // A frozen layer: the input's gradient flows through it, the weight gets none.
    let frozen = LinearConfig::new(40, 20).init(&ad).no_grad();
    let x = Tensor::<2>::random([4, 40], normal, &ad).require_grad();
    let grads = hearth_kernels::linear(&frozen, x.clone()).sum().backward();
    let burns = frozen.forward(x.clone()).sum().backward();
    assert!(
        frozen.weight.val().grad(&grads).is_none(),
        "a frozen weight got a gradient"
    );
    close(
        &values(
            x.grad(&grads)
                .expect("the input's gradient through a frozen layer"),
        ),
        &values(x.grad(&burns).expect("Burn's input gradient")),
        "input gradient through a frozen layer",
    );
}

#[test]
fn the_weight_gradient_is_held_once() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let flex = Device::flex();
    // A weight gradient's product: a transposed [2, 2048] input times a [2, 4096] output
    // gradient, 32 MiB of result.
    let x = Tensor::<2>::random([2, 2048], Distribution::Default, &flex);
    let dy = Tensor::<2>::random([2, 4096], Distribution::Default, &flex);
    let result = 2048 * 4096 * 4;
    let extra = |f: &dyn Fn() -> Tensor<2>| {
        let before = reset_peak();
        let y = f();
        let peak = PEAK.load(Ordering::Relaxed);
        assert_eq!(y.dims(), [2048, 4096]);
        drop(y);
        peak - before
    };
    let ours = extra(&|| product(x.clone().transpose(), dy.clone()));
    let flexs = extra(&|| x.clone().transpose().matmul(dy.clone()));
    println!("peak above the inputs: ours {ours} bytes, Flex's {flexs}, the result {result}");
    assert!(
        ours < result + result / 16,
        "our product's peak is {ours} bytes above its inputs for a result of {result}"
    );
    // What this path exists for: Flex's product held its result twice (if a later Flex no
    // longer does, this test says so and the path can go).
    assert!(
        flexs >= 2 * result,
        "Flex's product peaked {flexs} bytes above its inputs for a result of {result}: it no \
         longer holds the result twice, so `hearth_kernels::product` may be dropped"
    );
}
