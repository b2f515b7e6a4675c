//! The one-row product on all threads equals the sum it stands for, takes a linear layer at
//! batch 1 for inference on Flex (and only there), and gives what Burn's `Linear` gives.

use burn::nn::LinearConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::gemv::{one_row, row_times_matrix};

mod common;
use common::{Shapes, close, values};

/// `x · w` summed in f64.
fn naive(x: &[f32], w: &[f32], k: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| {
            (0..k)
                .map(|i| x[i] as f64 * w[i * n + j] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

fn noise(len: usize, seed: u64) -> Vec<f32> {
    let mut g = Shapes(seed | 1);
    (0..len)
        .map(|_| g.next(0, 2000) as f32 / 1000.0 - 1.0)
        .collect()
}

#[test]
fn row_times_matrix_equals_the_sum_over_random_and_edge_sizes() {
    let mut g = Shapes(0x2545_f491_4f6c_dd1d);
    // Fewer columns than one thread's share, not a multiple of 16, several shares, one column.
    let mut cases = vec![
        (1, 1),
        (3, 17),
        (64, 255),
        (100, 1000),
        (7, 4096),
        (513, 600),
    ];
    for _ in 0..20 {
        cases.push((g.next(1, 300), g.next(1, 2000)));
    }
    for (i, &(k, n)) in cases.iter().enumerate() {
        let x = noise(k, 2 * i as u64 + 1);
        let w = noise(k * n, 2 * i as u64 + 2);
        close(
            &row_times_matrix(&x, &w, k, n),
            &naive(&x, &w, k, n),
            &format!("{k} x {n}"),
        );
    }
    assert_eq!(row_times_matrix(&[], &[], 0, 5), vec![0.0; 5]);
    assert!(row_times_matrix(&[1.0, 2.0], &[], 2, 0).is_empty());
}

#[test]
fn a_linear_layer_at_batch_1_takes_the_path_and_equals_burn() {
    let flex = Device::flex();
    // 4096 x 1024 weights: the smallest size the path takes.
    let (k, n) = (4096, 1024);
    let layer = LinearConfig::new(k, n).init(&flex);
    let x = Tensor::<2>::random([1, k], Distribution::Normal(0.0, 1.0), &flex);
    let fast = one_row(&x, &layer.weight.val()).expect("a [1, k] f32 row on Flex takes the path");
    close(
        &values(fast),
        &values(x.clone().matmul(layer.weight.val())),
        "one row",
    );
    close(
        &values(hearth_kernels::linear(&layer, x.clone())),
        &values(layer.forward(x.clone())),
        "linear with bias",
    );
    // Any rank whose leading dimensions hold one row.
    let x3 = x.clone().reshape([1, 1, k]);
    let y3 = hearth_kernels::linear(&layer, x3.clone());
    assert_eq!(y3.dims(), [1, 1, n]);
    close(&values(y3), &values(layer.forward(x3)), "rank 3");

    // A weight that is a view (here transposed) is read through its strides by Flex's
    // product, never copied whole: the same values.
    let w_t = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.0), &flex);
    let view = w_t.clone().transpose();
    close(
        &values(one_row(&x, &view).expect("a view is still a [k, n] weight")),
        &values(x.clone().matmul(view)),
        "transposed weight",
    );

    // Not taken: two rows, a small weight, autodiff (training), another float type.
    let x2 = Tensor::<2>::random([2, k], Distribution::Normal(0.0, 1.0), &flex);
    assert!(one_row(&x2, &layer.weight.val()).is_none(), "two rows");
    let small = LinearConfig::new(2048, 1000).init(&flex);
    let xs = Tensor::<2>::random([1, 2048], Distribution::Normal(0.0, 1.0), &flex);
    assert!(one_row(&xs, &small.weight.val()).is_none(), "small weight");
    let ad = flex.clone().autodiff();
    // (`to_device` keeps a tensor's autodiff context: made on the autodiff device instead.)
    let xa = Tensor::<2>::random([1, k], Distribution::Normal(0.0, 1.0), &ad);
    let wa = Tensor::<2>::random([k, n], Distribution::Normal(0.0, 1.0), &ad);
    assert!(xa.device().is_autodiff());
    assert!(one_row(&xa, &wa).is_none(), "autodiff");
    let xh = x.cast(burn::tensor::FloatDType::F16);
    assert!(one_row(&xh, &layer.weight.val()).is_none(), "f16");
}

#[test]
fn the_extension_under_autodiff_is_burns_tracked_product() {
    use burn::backend::Dispatch;
    use hearth_kernels::gemv::LinearBackend;
    let device = Device::flex().autodiff();
    let x = Tensor::<2>::random([1, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let w = Tensor::<2>::random([8, 5], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let y = Tensor::<2>::from_dispatch(<Dispatch as LinearBackend>::hearth_row_matmul(
        x.clone().into_dispatch(),
        w.clone().into_dispatch(),
    ));
    close(
        &values(y.clone()),
        &values(x.clone().matmul(w.clone())),
        "value",
    );
    let grads = y.sum().backward();
    let dw = w.grad(&grads).expect("the weight's gradient");
    // d(sum(x · w))/dw[i, j] = x[i].
    let x_col: Vec<f32> = values(x.clone()).iter().flat_map(|&v| [v; 5]).collect();
    close(&values(dw), &x_col, "weight gradient");
}
