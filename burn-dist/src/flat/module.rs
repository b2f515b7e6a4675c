//! A Burn module's trainable tensors as the named flat vector the servers hold: the
//! parameters that require gradients, in visiting order, named by their module path
//! (`layer1.0.conv1.weight`). Buffers (batch-norm running statistics) and frozen parameters
//! stay with the worker, as DDP keeps rank 0's buffers.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::{DistError, Result};

fn flat<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    // A read that fails leaves an empty vector, which the length checks report.
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
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
        let t = param.val();
        if t.is_require_grad() {
            let name = self
                .path
                .iter()
                .filter(|p| !p.is_empty())
                .cloned()
                .collect::<Vec<_>>()
                .join(".");
            self.out.push((name, t.shape().num_elements()));
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
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let n = t.shape().num_elements();
        match self.grads {
            None => self.out.extend(flat(t)),
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

/// [`trainable_grads`] taking each gradient out of `grads` as it is copied, so the flat vector
/// grows while the gradients it holds are freed (a rank never holds both whole: what a sharded
/// optimizer's memory depends on). `total` is the vector's length, allocated once.
pub fn take_trainable_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    total: usize,
) -> Vec<f32> {
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        out: Vec<f32>,
    }
    impl ModuleVisitor for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            if !t.is_require_grad() {
                return;
            }
            let n = t.shape().num_elements();
            match self.grads.remove::<D>(param.id) {
                Some(g) => self.out.extend(flat(g)),
                None => self.out.extend(std::iter::repeat_n(0.0, n)),
            }
        }
    }
    let mut v = Take {
        grads,
        out: Vec::with_capacity(total),
    };
    module.visit(&mut v);
    v.out
}

/// Values `range` of [`trainable_values`], reading only the tensors that meet it (a shard's
/// values, without a copy of the whole vector).
pub fn trainable_values_in<M: Module>(module: &M, range: std::ops::Range<usize>) -> Vec<f32> {
    struct Ranged {
        want: std::ops::Range<usize>,
        at: usize,
        out: Vec<f32>,
    }
    impl ModuleVisitor for Ranged {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            if !t.is_require_grad() {
                return;
            }
            let n = t.shape().num_elements();
            let (lo, hi) = (
                self.at.max(self.want.start),
                (self.at + n).min(self.want.end),
            );
            if lo < hi {
                let v = flat(t);
                self.out
                    .extend_from_slice(v.get(lo - self.at..hi - self.at).unwrap_or(&[]));
            }
            self.at += n;
        }
    }
    let mut v = Ranged {
        out: Vec::with_capacity(range.len()),
        want: range,
        at: 0,
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

struct Put<'a> {
    values: &'a [f32],
    at: usize,
    error: Option<String>,
}

impl ModuleMapper for Put<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (values, at, error) = (self.values, &mut self.at, &mut self.error);
        param.map(|t| {
            if !t.is_require_grad() {
                return t;
            }
            let shape = t.shape();
            let n = shape.num_elements();
            let Some(v) = values.get(*at..*at + n) else {
                error.get_or_insert(format!(
                    "{} values for a module with more trainable values",
                    values.len()
                ));
                return t;
            };
            *at += n;
            Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), &t.device())
                .set_require_grad(true)
        })
    }
}

/// `module` with its trainable values replaced by `values` (as from [`trainable_values`]).
pub fn with_trainable_values<M: Module>(module: M, values: &[f32]) -> Result<M> {
    let mut p = Put {
        values,
        at: 0,
        error: None,
    };
    let m = module.map(&mut p);
    if p.error.is_none() && p.at != values.len() {
        p.error = Some(format!(
            "{} values for a module with {} trainable values",
            values.len(),
            p.at
        ));
    }
    match p.error {
        Some(e) => Err(DistError::Mismatch {
            op: "parameter-server values".into(),
            reason: e,
        }),
        None => Ok(m),
    }
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
        assert_eq!(take_trainable_grads(&net, &mut taken, total), g);
        assert!(taken.is_empty(), "every gradient was taken out");
        assert_eq!(
            &g[..6],
            &[4.0; 6],
            "d sum / d weight = 4 for each of the 4 rows"
        );
        assert_eq!(&g[8..], &[0.0; 4], "bn is not on the loss's path");
        let e = with_trainable_values(net, &values[1..]).unwrap_err();
        assert!(e.to_string().contains("11 values"), "{e}");
    }
}
