//! Weights kept by key (`hearth_kernels::keyed`): a convolution (3x3), a strided 1x1 (which a
//! keyed forward moves from the pointwise path to the extension op) and a linear layer,
//! trained with their weights let go after the forward and handed back to the backward by
//! key, give the gradients of the ordinary backward; and the graph then holds none of those
//! weights (the live bytes counted by this binary's allocator).

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use burn::module::{Param, ParamId};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::{Distribution, TensorData};
use hearth_kernels::keyed;

mod common;
mod counting;
use common::{close, values};
use counting::{LIVE, ONE_AT_A_TIME};

/// The layers' weights (as data, so that each run builds tensors of its own), with their ids.
struct Weights {
    conv: (ParamId, TensorData),
    pointwise: (ParamId, TensorData),
    linear: (ParamId, TensorData),
}

struct Net {
    conv: Conv2d,
    pointwise: Conv2d,
    linear: Linear,
}

const CLASSES: usize = 4096;

fn weights(device: &Device) -> Weights {
    let normal = Distribution::Normal(0.0, 0.1);
    Weights {
        conv: (
            ParamId::new(),
            Tensor::<4>::random([8, 4, 3, 3], normal, device).into_data(),
        ),
        pointwise: (
            ParamId::new(),
            Tensor::<4>::random([16, 8, 1, 1], normal, device).into_data(),
        ),
        linear: (
            ParamId::new(),
            Tensor::<2>::random([256, CLASSES], normal, device).into_data(),
        ),
    }
}

fn param<const D: usize>((id, data): &(ParamId, TensorData), device: &Device) -> Param<Tensor<D>> {
    Param::initialized(
        *id,
        Tensor::<D>::from_data(data.clone(), device).require_grad(),
    )
}

fn net(w: &Weights, device: &Device) -> Net {
    let mut conv = Conv2dConfig::new([4, 8], [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .with_bias(false)
        .init(device);
    conv.weight = param(&w.conv, device);
    let mut pointwise = Conv2dConfig::new([8, 16], [1, 1])
        .with_stride([2, 2])
        .with_bias(false)
        .init(device);
    pointwise.weight = param(&w.pointwise, device);
    let mut linear = LinearConfig::new(256, CLASSES)
        .with_bias(false)
        .init(device);
    linear.weight = param(&w.linear, device);
    Net {
        conv,
        pointwise,
        linear,
    }
}

fn forward(net: &Net, x: Tensor<4>) -> Tensor<1> {
    let y = hearth_kernels::conv2d(&net.conv, x);
    let y = burn::tensor::activation::relu(y);
    let y = hearth_kernels::conv2d(&net.pointwise, y);
    let y = hearth_kernels::linear(&net.linear, y.reshape([2, 256]));
    y.powi_scalar(2).sum()
}

/// One training step's weight gradients (by id) and input gradient, and the bytes the step
/// added to the live ones after the forward, once the layers are dropped (what the graph
/// holds).
fn step(
    w: &Weights,
    x: &TensorData,
    by_key: bool,
) -> (HashMap<ParamId, Vec<f32>>, Vec<f32>, usize) {
    let start = LIVE.load(Ordering::Relaxed);
    let ad = Device::flex().autodiff();
    let x = Tensor::<4>::from_data(x.clone(), &ad).require_grad();
    let net = net(w, &ad);
    let (loss, uses) = if by_key {
        keyed::forward(|| forward(&net, x.clone()))
    } else {
        (forward(&net, x.clone()), keyed::Uses::new())
    };
    let ids = [
        net.conv.weight.id,
        net.pointwise.weight.id,
        net.linear.weight.id,
    ];
    let held = (
        [net.conv.weight.val(), net.pointwise.weight.val()],
        net.linear.weight.val(),
    );
    drop(net);
    if !by_key {
        let live = LIVE.load(Ordering::Relaxed) - start;
        let grads = loss.backward();
        let mut by_id = HashMap::new();
        for (id, t) in ids.iter().zip(&held.0) {
            by_id.insert(*id, t.grad(&grads).map(values).unwrap_or_default());
        }
        let linear = held.1.grad(&grads).map(values).unwrap_or_default();
        by_id.insert(ids[2], linear);
        let dx = x.grad(&grads).map(values).unwrap_or_default();
        return (by_id, dx, live);
    }
    let want: keyed::Uses = ids.iter().map(|id| (id.val(), 1)).collect();
    assert_eq!(uses, want, "every weight kept by key by its one op");
    drop(held);
    let live = LIVE.load(Ordering::Relaxed) - start;
    let provided: HashMap<u64, TensorData> = [&w.conv, &w.pointwise, &w.linear]
        .into_iter()
        .map(|(id, data)| (id.val(), data.clone()))
        .collect();
    let (grads, by_key) = keyed::backward(provided, &uses, || loss.backward());
    let by_id = ids
        .iter()
        .map(|id| {
            let g = by_key
                .get(&id.val())
                .map(|d| d.try_to_vec::<f32>().unwrap_or_default());
            (*id, g.unwrap_or_default())
        })
        .collect();
    let dx = x.grad(&grads).map(values).unwrap_or_default();
    (by_id, dx, live)
}

#[test]
fn weights_kept_by_key_give_the_same_gradients_and_leave_the_graph() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let flex = Device::flex();
    let w = weights(&flex);
    let x = Tensor::<4>::random([2, 4, 8, 8], Distribution::Normal(0.0, 1.0), &flex).into_data();
    let (plain, plain_dx, plain_live) = step(&w, &x, false);
    let (keyed, keyed_dx, keyed_live) = step(&w, &x, true);
    for (id, name) in [
        (w.linear.0, "linear"),
        (w.pointwise.0, "strided 1x1"),
        (w.conv.0, "3x3"),
    ] {
        assert!(
            !plain[&id].is_empty(),
            "{name}: the plain backward gave a gradient"
        );
        close(
            &keyed[&id],
            &plain[&id],
            &format!("{name}'s weight gradient"),
        );
    }
    close(&keyed_dx, &plain_dx, "the input's gradient");
    // With the layers dropped, a plain graph still holds their weights (the storage this test
    // keeps to read their gradients, counted once); a keyed graph holds none of them.
    let linear_bytes = 256 * CLASSES * 4;
    assert!(
        plain_live >= keyed_live + linear_bytes * 9 / 10,
        "after the forward, without the layers: {plain_live} bytes live with weights held, \
         {keyed_live} by key (the linear weight is {linear_bytes})"
    );
}

#[test]
#[should_panic(expected = "ran outside keyed::backward")]
fn a_keyed_graph_run_without_its_weights_names_the_broken_promise() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ad = Device::flex().autodiff();
    let w = weights(&Device::flex());
    let net = net(&w, &ad);
    let x = Tensor::<4>::random([2, 4, 8, 8], Distribution::Normal(0.0, 1.0), &ad).require_grad();
    let (loss, _) = keyed::forward(|| forward(&net, x));
    let _ = loss.backward();
}

/// A plain layer `layer` on input `x` with its whole `weight`: its output, and the weight's and
/// the input's gradients of the loss `Σ y²`.
fn plain<const D: usize, const W: usize>(
    weight: &Param<Tensor<W>>,
    x: &TensorData,
    device: &Device,
    layer: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x = Tensor::<D>::from_data(x.clone(), device).require_grad();
    let y = layer(x.clone());
    let out = values(y.clone().inner());
    let grads = y.powi_scalar(2).sum().backward();
    let dw = weight.val().grad(&grads).map(values).unwrap_or_default();
    let dx = x.grad(&grads).map(values).unwrap_or_default();
    (out, dw, dx)
}

/// A source that serves a linear weight `[rows, cols]` in pieces, as ZeRO stage 3 gathers
/// them: the pieces it served, in order, and the gradients it took, by piece.
struct Pieces {
    key: u64,
    weight: Vec<f32>,
    pieces: keyed::Pieces,
    served: Vec<usize>,
    grads: HashMap<usize, Vec<f32>>,
    fail_at: Option<usize>,
}

impl Pieces {
    /// Serving weight `w` (parameter `id`) cut into `pieces`, nothing served yet.
    fn of(id: ParamId, w: &TensorData, pieces: &keyed::Pieces) -> Self {
        Self {
            key: id.val(),
            weight: w.try_to_vec::<f32>().unwrap_or_default(),
            pieces: pieces.clone(),
            served: Vec::new(),
            grads: HashMap::new(),
            fail_at: None,
        }
    }
}

impl keyed::Source for Pieces {
    fn fetch(&mut self, key: u64) -> Result<Vec<(u64, TensorData)>, String> {
        Err(format!("weight {key} asked for whole"))
    }
    fn gradient(&mut self, key: u64, _: TensorData) -> Result<Option<TensorData>, String> {
        Err(format!("weight {key}'s gradient handed over whole"))
    }
    fn fetch_piece(&mut self, key: u64, piece: usize) -> Result<TensorData, String> {
        assert_eq!(key, self.key);
        self.served.push(piece);
        if self.fail_at == Some(piece) {
            return Err(format!("the gather of piece {piece} failed"));
        }
        let rows = &self.pieces.rows[piece];
        let c = self.pieces.cols;
        let v = self.weight[rows.start * c..rows.end * c].to_vec();
        Ok(TensorData::new(v, [rows.len(), c]))
    }
    fn piece_gradient(&mut self, key: u64, piece: usize, grad: TensorData) -> Result<(), String> {
        assert_eq!(key, self.key);
        let v = grad.try_to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
        assert!(self.grads.insert(piece, v).is_none(), "piece {piece} twice");
        Ok(())
    }
}

/// A linear layer (with a bias) whose weight is cut into pieces of rows: the forward and the
/// backward fetch it a piece at a time, in order, and give the plain layer's output, input
/// gradient and weight gradient; neither ever holds the whole weight (the live bytes' peak
/// stays under half of it above what the source keeps), nor does a forward without a graph
/// (on the inner device); a piece that cannot be fetched is an error at the pass's end.
#[test]
fn a_weight_cut_into_pieces_is_multiplied_a_piece_at_a_time() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let flex = Device::flex();
    let ad = flex.clone().autodiff();
    let (inputs, outputs) = (256, CLASSES);
    let normal = Distribution::Normal(0.0, 0.1);
    let w = Tensor::<2>::random([inputs, outputs], normal, &flex).into_data();
    let x = Tensor::<2>::random([3, inputs], Distribution::Normal(0.0, 1.0), &flex).into_data();
    let mut linear = LinearConfig::new(inputs, outputs).init(&ad);
    let id = ParamId::new();
    linear.weight = param(&(id, w.clone()), &ad);

    // The plain layer.
    let (plain_y, plain_dw, plain_dx) = plain(&linear.weight, &x, &ad, |x: Tensor<2>| {
        hearth_kernels::linear(&linear, x)
    });

    // The same layer holding its weight empty, the weight in 8 pieces of 32 rows.
    let rows = (0..8).map(|k| k * 32..(k + 1) * 32).collect();
    let pieces = keyed::Pieces {
        rows,
        cols: outputs,
    };
    let mut source = Pieces::of(id, &w, &pieces);
    linear.weight = Param::initialized(id, Tensor::<2>::empty([0, 0], &ad).require_grad());
    let pieced = HashMap::from([(id.val(), pieces.clone())]);
    let xk = Tensor::<2>::from_data(x.clone(), &ad).require_grad();
    counting::reset_peak();
    let start = LIVE.load(Ordering::Relaxed);
    let (y, uses, fetched) = keyed::forward_from(pieced.clone(), &mut source, || {
        hearth_kernels::linear(&linear, xk.clone())
    });
    fetched.expect("every piece fetched");
    assert!(
        uses.is_empty(),
        "a weight in pieces is not kept by the graph"
    );
    close(&values(y.clone().inner()), &plain_y, "the output");
    let loss = y.powi_scalar(2).sum();
    let (grads, by_key) =
        keyed::backward_from(HashMap::new(), &uses, &mut source, || loss.backward());
    let peak = counting::PEAK.load(Ordering::Relaxed).saturating_sub(start);
    assert!(by_key.expect("no failure").is_empty());
    let order: Vec<usize> = (0..8).chain(0..8).collect();
    assert_eq!(source.served, order, "each piece once a pass, in order");
    let dw: Vec<f32> = (0..8).flat_map(|k| source.grads[&k].clone()).collect();
    close(&dw, &plain_dw, "the weight's gradient, by pieces");
    close(
        &xk.grad(&grads).map(values).unwrap_or_default(),
        &plain_dx,
        "the input's gradient",
    );
    // The source keeps every piece's gradient (the whole weight's bytes by the end); the
    // passes themselves add less than half of the weight on top.
    let weight_bytes = inputs * outputs * 4;
    assert!(
        peak < weight_bytes + weight_bytes / 2,
        "the passes' live peak rose {peak} bytes, with the source keeping {weight_bytes} of \
         gradients; the whole weight is {weight_bytes}"
    );

    // Without a graph (the module and the input on the inner device: ZeRO stage 3's
    // validation): each piece fetched once, in order, the plain output, and the pass never
    // holds the whole weight (its live peak under half of it).
    source.served.clear();
    let valid = linear.valid();
    let x_inner = Tensor::<2>::from_data(x.clone(), &flex);
    counting::reset_peak();
    let start = LIVE.load(Ordering::Relaxed);
    let (y, uses, fetched) = keyed::forward_from(pieced.clone(), &mut source, || {
        hearth_kernels::linear(&valid, x_inner.clone())
    });
    let peak = counting::PEAK.load(Ordering::Relaxed).saturating_sub(start);
    fetched.expect("every piece fetched without a graph");
    assert!(uses.is_empty());
    assert_eq!(source.served, (0..8).collect::<Vec<_>>(), "without a graph");
    close(&values(y), &plain_y, "the output without a graph");
    assert!(
        peak < weight_bytes / 2,
        "the pass without a graph rose {peak} bytes; the whole weight is {weight_bytes}"
    );

    // An input that needs no gradient: the weight's pieces still get theirs.
    source.served.clear();
    source.grads.clear();
    let x0 = Tensor::<2>::from_data(x.clone(), &ad);
    let (y, uses, fetched) = keyed::forward_from(pieced.clone(), &mut source, || {
        hearth_kernels::linear(&linear, x0.clone())
    });
    fetched.expect("every piece fetched");
    let loss = y.powi_scalar(2).sum();
    let (_, by_key) = keyed::backward_from(HashMap::new(), &uses, &mut source, || loss.backward());
    assert!(by_key.expect("no failure").is_empty());
    let dw: Vec<f32> = (0..8).flat_map(|k| source.grads[&k].clone()).collect();
    close(&dw, &plain_dw, "the weight's gradient, the input untracked");

    // A piece that cannot be fetched: zeros in its place, the failure at the forward's end.
    source.fail_at = Some(3);
    source.served.clear();
    let (_, _, failed) = keyed::forward_from(pieced, &mut source, || {
        hearth_kernels::linear(&linear, Tensor::<2>::from_data(x.clone(), &ad))
    });
    assert_eq!(
        failed.err().as_deref(),
        Some("the gather of piece 3 failed")
    );
    assert_eq!(
        source.served,
        [0, 1, 2, 3],
        "a failed source is not asked again"
    );
}

/// A convolution's weight `[out, in, kh, kw]` cut into pieces of output channels (rows of
/// `in·kh·kw` values, pieces of unequal sizes): the forward and the backward fetch it a piece
/// at a time, in order, and give the plain layer's output, input gradient and weight gradient,
/// for a padded 3x3 with a bias and a strided 1x1; so does a forward without a graph.
#[test]
fn a_convolution_cut_into_pieces_of_output_channels_gives_the_plain_gradients() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let flex = Device::flex();
    let ad = flex.clone().autodiff();
    let normal = Distribution::Normal(0.0, 0.1);
    for (kernel, stride, padding, bias) in [(3, 1, 1, true), (1, 2, 0, false)] {
        let (inputs, outputs) = (16, 40);
        let conv_of = || {
            Conv2dConfig::new([inputs, outputs], [kernel, kernel])
                .with_stride([stride, stride])
                .with_padding(PaddingConfig2d::Explicit(
                    padding, padding, padding, padding,
                ))
                .with_bias(bias)
                .init(&ad)
        };
        let w = Tensor::<4>::random([outputs, inputs, kernel, kernel], normal, &flex).into_data();
        let x = Tensor::<4>::random([2, inputs, 6, 6], Distribution::Normal(0.0, 1.0), &flex)
            .into_data();
        let id = ParamId::new();
        let mut conv = conv_of();
        conv.weight = param(&(id, w.clone()), &ad);
        let what = format!("{kernel}x{kernel} stride {stride}");

        // The plain layer (its own bias kept for the pieced one: only the weight is cut).
        let (plain_y, plain_dw, plain_dx) = plain(&conv.weight, &x, &ad, |x: Tensor<4>| {
            hearth_kernels::conv2d(&conv, x)
        });

        let cols = inputs * kernel * kernel;
        let pieces = keyed::Pieces {
            rows: vec![0..17, 17..34, 34..40],
            cols,
        };
        let mut source = Pieces::of(id, &w, &pieces);
        conv.weight = Param::initialized(id, Tensor::<4>::empty([0; 4], &ad).require_grad());
        let pieced = HashMap::from([(id.val(), pieces)]);
        let xk = Tensor::<4>::from_data(x.clone(), &ad).require_grad();
        let (y, uses, fetched) = keyed::forward_from(pieced, &mut source, || {
            hearth_kernels::conv2d(&conv, xk.clone())
        });
        fetched.expect("every piece fetched");
        assert!(
            uses.is_empty(),
            "{what}: a weight in pieces is not kept by the graph"
        );
        close(
            &values(y.clone().inner()),
            &plain_y,
            &format!("{what}: the output"),
        );
        let loss = y.powi_scalar(2).sum();
        let (grads, by_key) =
            keyed::backward_from(HashMap::new(), &uses, &mut source, || loss.backward());
        assert!(by_key.expect("no failure").is_empty());
        assert_eq!(
            source.served,
            [0, 1, 2, 0, 1, 2],
            "{what}: each piece once a pass, in order"
        );
        for (k, rows) in [0..17, 17..34, 34..40].into_iter().enumerate() {
            assert_eq!(
                source.grads[&k].len(),
                rows.len() * cols,
                "{what}: piece {k}'s gradient"
            );
        }
        let dw: Vec<f32> = (0..3).flat_map(|k| source.grads[&k].clone()).collect();
        close(
            &dw,
            &plain_dw,
            &format!("{what}: the weight's gradient, by pieces"),
        );

        // Without a graph (ZeRO stage 3's validation, on the inner device): each piece once,
        // in order, and the plain output.
        source.served.clear();
        let valid = conv.valid();
        let pieced = HashMap::from([(id.val(), source.pieces.clone())]);
        let (y, _, fetched) = keyed::forward_from(pieced, &mut source, || {
            hearth_kernels::conv2d(&valid, Tensor::<4>::from_data(x.clone(), &flex))
        });
        fetched.expect("every piece fetched without a graph");
        assert_eq!(source.served, [0, 1, 2], "{what}: without a graph");
        close(
            &values(y),
            &plain_y,
            &format!("{what}: the output without a graph"),
        );
        close(
            &xk.grad(&grads).map(values).unwrap_or_default(),
            &plain_dx,
            &format!("{what}: the input's gradient"),
        );
    }
}
