//! A Burn module's trainable tensors as the named flat vector the servers hold: the
//! parameters that require gradients, in visiting order, named by their module path
//! (`layer1.0.conv1.weight`). Buffers (batch-norm running statistics) and frozen parameters
//! stay with the worker, as DDP keeps rank 0's buffers. Reading them out is here; putting
//! values back is `put.rs`, re-exported.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;

mod lazy;
mod put;
pub use lazy::trainable_shape;
pub use put::{
    Shapes, release_trainable_range, with_trainable_parts, with_trainable_range,
    with_trainable_values,
};

fn flat<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    // A read that fails leaves an empty vector, which the length checks report.
    // Moved out of the tensor's storage where Burn allows it, copied otherwise.
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

#[derive(Default)]
struct Names {
    path: Vec<String>,
    out: Vec<(String, usize)>,
    /// Each trainable tensor's rank, beside `out`.
    ranks: Vec<usize>,
}

impl ModuleVisitor for Names {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(shape) = trainable_shape(param) {
            let name = self
                .path
                .iter()
                .filter(|p| !p.is_empty())
                .cloned()
                .collect::<Vec<_>>()
                .join(".");
            self.out.push((name, shape.num_elements()));
            self.ranks.push(D);
        }
    }
}

/// The trainable tensors of `module`: (path, number of values), in the flat vector's order.
pub fn trainable_names<M: Module>(module: &M) -> Vec<(String, usize)> {
    let mut v = Names::default();
    module.visit(&mut v);
    v.out
}

/// The trainable tensors' shapes, in [`trainable_names`] order.
pub fn trainable_shapes<M: Module>(module: &M) -> Vec<Vec<usize>> {
    struct Dims(Vec<Vec<usize>>);
    impl ModuleVisitor for Dims {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(shape) = trainable_shape(param) {
                self.0.push(shape.to_vec());
            }
        }
    }
    let mut v = Dims(Vec::new());
    module.visit(&mut v);
    v.0
}

/// The trainable tensors' parameter ids, in [`trainable_names`] order.
pub fn trainable_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if trainable_shape(param).is_some() {
                self.0.push(param.id);
            }
        }
    }
    let mut v = Ids(Vec::new());
    module.visit(&mut v);
    v.0
}

/// The flat ranges (in [`trainable_values`] order) of the trainable tensors of rank 2 or more:
/// the weights of layers, not biases or batch-norm scales, which is where Hearth's optimizers
/// apply weight decay ([`super::optim::ShardOptimizer::decay`]).
pub fn matrix_ranges<M: Module>(module: &M) -> Vec<std::ops::Range<usize>> {
    let mut v = Names::default();
    module.visit(&mut v);
    let mut at = 0;
    let mut out = Vec::new();
    for ((_, len), rank) in v.out.iter().zip(&v.ranks) {
        if *rank > 1 {
            out.push(at..at + len);
        }
        at += len;
    }
    out
}

struct Values<'a> {
    out: Vec<f32>,
    grads: Option<&'a GradientsParams>,
}

impl ModuleVisitor for Values<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(shape) = trainable_shape(param) else {
            return;
        };
        let n = shape.num_elements();
        match self.grads {
            None => self.out.extend(flat(param.val())),
            Some(g) => match g.get::<D>(param.id) {
                Some(g) => self.out.extend(flat(g)),
                // A parameter the loss does not reach has a zero gradient.
                None => self.out.extend(std::iter::repeat_n(0.0, n)),
            },
        }
    }
}

/// The trainable values of `module`, concatenated in [`trainable_names`] order.
pub fn trainable_values<M: Module>(module: &M) -> Vec<f32> {
    let mut v = Values {
        out: Vec::new(),
        grads: None,
    };
    module.visit(&mut v);
    v.out
}

/// The gradients of trainable tensors `tensors` (indices in [`trainable_names`] order),
/// concatenated, each taken out of `grads` as it is copied so its memory can go (zero where a
/// tensor has none): one bucket of a sharded optimizer's step, without a copy of the whole.
pub fn take_trainable_grads_of<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    tensors: std::ops::Range<usize>,
) -> Vec<f32> {
    // The bucket's length first: a vector grown by doubling held up to three times the
    // bucket for a moment (the old and new buffers, and the tensors not yet copied).
    let len = trainable_len(module, tensors.clone());
    let mut out = Vec::new();
    let want = |i, _| tensors.contains(&i);
    take_trainable_grads_each(module, grads, &want, true, &mut |_, g| {
        // A bucket of one tensor is that tensor's own buffer, not a copy.
        if out.is_empty() && g.len() == len {
            out = g;
        } else {
            out.reserve_exact(len.saturating_sub(out.len()));
            out.extend_from_slice(&g);
        }
    });
    out
}

/// The number of values of trainable tensors `tensors` (indices in [`trainable_names`] order).
fn trainable_len<M: Module>(module: &M, tensors: std::ops::Range<usize>) -> usize {
    struct Len {
        want: std::ops::Range<usize>,
        index: usize,
        len: usize,
    }
    impl ModuleVisitor for Len {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(shape) = trainable_shape(param) {
                if self.want.contains(&self.index) {
                    self.len += shape.num_elements();
                }
                self.index += 1;
            }
        }
    }
    let mut v = Len {
        want: tensors,
        index: 0,
        len: 0,
    };
    module.visit(&mut v);
    v.len
}

/// Takes the gradients of the trainable tensors that `want(index, id)` picks (indices in
/// [`trainable_names`] order) out of `grads`, handing each to `each(index, values)` as it is
/// read, so its memory can go at once (where a tensor has none: zeros of its shape with
/// `zeros`, else nothing, as for a tensor released by ZeRO stage 3, whose module holds an
/// empty one; an empty vector where a read failed, which the caller's length check reports).
pub fn take_trainable_grads_each<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    want: &dyn Fn(usize, ParamId) -> bool,
    zeros: bool,
    each: &mut dyn FnMut(usize, Vec<f32>),
) {
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        want: &'a dyn Fn(usize, ParamId) -> bool,
        zeros: bool,
        each: &'a mut dyn FnMut(usize, Vec<f32>),
        index: usize,
    }
    impl ModuleVisitor for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(shape) = trainable_shape(param) else {
                return;
            };
            let i = self.index;
            self.index += 1;
            if !(self.want)(i, param.id) {
                return;
            }
            let values = match self.grads.remove::<D>(param.id) {
                Some(g) => flat(g),
                None if self.zeros => vec![0.0; shape.num_elements()],
                None => return,
            };
            (self.each)(i, values);
        }
    }
    module.visit(&mut Take {
        grads,
        want,
        zeros,
        each,
        index: 0,
    });
}

/// Values `range` of [`trainable_values`], reading only the tensors that meet it (a shard's
/// values, without a copy of the whole vector).
pub fn trainable_values_in<M: Module>(module: &M, range: std::ops::Range<usize>) -> Vec<f32> {
    trainable_values_in_released(module, range, &Shapes::new())
}

/// [`trainable_values_in`] of a module whose tensors `released` holds the shapes of are let go
/// ([`release_trainable_range`]): they keep their place in the vector (their values are not
/// in `range`, or come back empty).
pub fn trainable_values_in_released<M: Module>(
    module: &M,
    range: std::ops::Range<usize>,
    released: &Shapes,
) -> Vec<f32> {
    struct Ranged<'a> {
        want: std::ops::Range<usize>,
        at: usize,
        index: usize,
        released: &'a Shapes,
        out: Vec<f32>,
    }
    impl ModuleVisitor for Ranged<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(shape) = trainable_shape(param) else {
                return;
            };
            self.index += 1;
            if let Some(kept) = self.released.get(&(self.index - 1)) {
                self.at += kept.num_elements();
                return;
            }
            let n = shape.num_elements();
            let (lo, hi) = (
                self.at.max(self.want.start),
                (self.at + n).min(self.want.end),
            );
            if lo < hi {
                // Only the part in the range is read: a shard of a large tensor (VGG-16's
                // first classifier layer, 411 MB) is not copied whole to take half of it,
                // which had set a ZeRO step's peak.
                let t = param.val();
                let v = if hi - lo == n {
                    flat(t)
                } else {
                    // Burn's slice takes one range per dimension: one here.
                    #[allow(clippy::single_range_in_vec_init)]
                    flat(t.reshape([n]).slice([lo - self.at..hi - self.at]))
                };
                if self.out.is_empty() && v.len() == self.want.len() {
                    self.out = v;
                } else {
                    self.out.extend_from_slice(&v);
                }
            }
            self.at += n;
        }
    }
    let mut v = Ranged {
        out: Vec::with_capacity(range.len()),
        want: range,
        at: 0,
        index: 0,
        released,
    };
    module.visit(&mut v);
    v.out
}

/// The trainable tensors' extents in the flat vector, and which are layers' weights (rank 2 or
/// more): what LARS's per-tensor trust ratio needs
/// ([`super::optim::ShardOptimizer::tensors`]).
pub fn trainable_extents<M: Module>(module: &M) -> Vec<super::optim::Extent> {
    let mut v = Names::default();
    module.visit(&mut v);
    let mut at = 0;
    v.out
        .iter()
        .zip(&v.ranks)
        .map(|((_, len), rank)| {
            let e = super::optim::Extent {
                range: at..at + len,
                matrix: *rank > 1,
            };
            at += len;
            e
        })
        .collect()
}

/// The gradients of `module`'s trainable values, in the same order (zero where absent).
pub fn trainable_grads<M: Module>(module: &M, grads: &GradientsParams) -> Vec<f32> {
    let mut v = Values {
        out: Vec::new(),
        grads: Some(grads),
    };
    module.visit(&mut v);
    v.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{BatchNormConfig, Linear, LinearConfig};

    #[derive(Module, Debug)]
    struct Net {
        fc: Linear,
        bn: burn::nn::BatchNorm,
    }

    /// Each float parameter's state: `None` while Burn has not initialised it, else its
    /// number of values.
    fn states<M: Module>(module: &M) -> Vec<Option<usize>> {
        struct States(Vec<Option<usize>>);
        impl ModuleVisitor for States {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let n = param.is_initialized();
                self.0.push(n.then(|| param.val().shape().num_elements()));
            }
        }
        let mut v = States(Vec::new());
        module.visit(&mut v);
        v.0
    }

    /// A module Burn has not initialised (ZeRO stage 3's ranks but the root build their model
    /// so): counting, naming and releasing its trainable tensors never makes their values, a
    /// frozen parameter stays out of the trainable order as an initialised one does, and the
    /// values put back into the released tensors are what the module then holds.
    #[test]
    fn lazy_parameters_stay_lazy_while_counted_named_and_released() {
        let device = Device::flex().autodiff();
        let net = Net {
            fc: LinearConfig::new(3, 2).init(&device),
            bn: BatchNormConfig::new(2).init(&device).no_grad(),
        };
        // The norm's running statistics (buffers) are made at once.
        let buffers = [Some(2), Some(2)];
        let lazy = [[None; 4].as_slice(), &buffers].concat();
        assert_eq!(states(&net), lazy, "Burn's parameters start lazy");
        let names = trainable_names(&net);
        let listed: Vec<(&str, usize)> = names.iter().map(|(n, l)| (n.as_str(), *l)).collect();
        assert_eq!(
            listed,
            [("fc.weight", 6), ("fc.bias", 2)],
            "the frozen norm left out"
        );
        assert_eq!(trainable_shapes(&net), [vec![3, 2], vec![2]]);
        assert_eq!(
            trainable_ids(&net),
            [net.fc.weight.id, net.fc.bias.as_ref().unwrap().id]
        );
        assert_eq!(matrix_ranges(&net), vec![0..6]);
        assert_eq!(trainable_extents(&net).len(), 2);
        assert_eq!(trainable_len(&net, 0..2), 8);
        assert_eq!(
            states(&net),
            lazy,
            "nothing initialised by reading the order"
        );

        let mut shapes = Shapes::new();
        let net = release_trainable_range(net, 0..2, &mut shapes);
        let kept: Vec<Vec<usize>> = shapes.values().map(|s| s.to_vec()).collect();
        assert_eq!(kept, [vec![3, 2], vec![2]]);
        assert_eq!(
            states(&net),
            [Some(0), Some(0), None, None, Some(2), Some(2)],
            "released empty, never made; the frozen norm still lazy"
        );
        let parts = vec![(0..6).map(|i| i as f32).collect(), vec![6.0, 7.0]];
        let net = with_trainable_range(net, 0..2, parts, &shapes).unwrap();
        assert_eq!(
            trainable_values(&net),
            (0..8).map(|i| i as f32).collect::<Vec<_>>()
        );
        assert_eq!(
            states(&net),
            [Some(6), Some(2), None, None, Some(2), Some(2)]
        );
        assert!(
            net.fc.weight.val().is_require_grad(),
            "the values put back train"
        );
    }

    #[test]
    fn trainable_values_round_trip_and_skip_buffers() {
        let device = Device::flex().autodiff();
        let net = Net {
            fc: LinearConfig::new(3, 2).init(&device),
            bn: BatchNormConfig::new(2).init(&device),
        };
        let names = trainable_names(&net);
        let listed: Vec<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(listed, ["fc.weight", "fc.bias", "bn.gamma", "bn.beta"]);
        let total: usize = names.iter().map(|n| n.1).sum();
        assert_eq!(total, 6 + 2 + 2 + 2, "running mean and variance stay out");
        assert_eq!(
            matrix_ranges(&net),
            vec![0..6],
            "only fc.weight is a matrix"
        );
        let values: Vec<f32> = (0..total).map(|i| i as f32).collect();
        let net = with_trainable_values(net, &values).unwrap();
        assert_eq!(trainable_values(&net), values);
        assert_eq!(trainable_values_in(&net, 5..9), &values[5..9]);
        // Inside one tensor (its slice read alone, moved out as the whole range).
        assert_eq!(trainable_values_in(&net, 1..4), &values[1..4]);
        assert_eq!(trainable_values_in(&net, 0..6), &values[0..6]);
        assert!(trainable_values_in(&net, 12..12).is_empty());
        let extents = trainable_extents(&net);
        assert_eq!(extents.len(), 4);
        assert_eq!((extents[1].range.clone(), extents[1].matrix), (6..8, false));
        assert!(extents[0].matrix);
        let x = Tensor::<2>::ones([4, 3], &device);
        let loss = net.fc.forward(x).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        let g = trainable_grads(&net, &grads);
        assert_eq!(g.len(), total);
        let mut taken = GradientsParams::from_grads(
            net.fc
                .forward(Tensor::<2>::ones([4, 3], &device))
                .sum()
                .backward(),
            &net,
        );
        // Tensors 0..2 (fc's) taken out; bn's have no gradient and read as zeros.
        assert_eq!(take_trainable_grads_of(&net, &mut taken, 0..2), &g[..8]);
        assert!(taken.is_empty(), "fc's gradients were taken out");
        assert_eq!(take_trainable_grads_of(&net, &mut taken, 2..4), &g[8..]);
        assert_eq!(
            &g[..6],
            &[4.0; 6],
            "d sum / d weight = 4 for each of the 4 rows"
        );
        assert_eq!(&g[8..], &[0.0; 4], "bn is not on the loss's path");
        let parts: Vec<Vec<f32>> = vec![
            values[..6].to_vec(),
            values[6..8].to_vec(),
            values[8..10].to_vec(),
            values[10..].iter().map(|x| x + 1.0).collect(),
        ];
        let net = with_trainable_parts(net, parts.clone()).unwrap();
        assert_eq!(trainable_values(&net), parts.concat());
        let e = with_trainable_parts(net.clone(), parts[..3].to_vec()).unwrap_err();
        assert!(e.to_string().contains("fewer parts"), "{e}");
        // A bucket's tensors in place (1 and 2), the others as they were.
        let two = vec![vec![-1.0; 2], vec![-2.0; 2]];
        let none = Shapes::new();
        let net = with_trainable_range(net, 1..3, two.clone(), &none).unwrap();
        let now = trainable_values(&net);
        assert_eq!(&now[..6], &parts[0][..]);
        assert_eq!(&now[6..10], &two.concat()[..]);
        assert_eq!(&now[10..], &parts[3][..]);
        let e = with_trainable_range(net.clone(), 3..5, two.clone(), &none).unwrap_err();
        assert!(e.to_string().contains("3..5"), "{e}");
        let e = with_trainable_range(net.clone(), 0..2, two.clone(), &none).unwrap_err();
        assert!(e.to_string().contains("2 values"), "{e}");
        // Released first (a sharded step's old values let go before the all-gather): empty
        // tensors in their place, their shapes kept, and put back whole from those shapes.
        let mut released = Shapes::new();
        let out = release_trainable_range(net.clone(), 1..3, &mut released);
        assert_eq!(released.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(
            trainable_values(&out).len(),
            12 - 4,
            "tensors 1 and 2 hold nothing"
        );
        let back = with_trainable_range(out, 1..3, two.clone(), &released).unwrap();
        assert_eq!(trainable_values(&back), trainable_values(&net));
        let e = with_trainable_values(net, &values[1..]).unwrap_err();
        assert!(e.to_string().contains("11 values"), "{e}");
    }
}
