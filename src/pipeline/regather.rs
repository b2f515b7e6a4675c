//! ZeRO stage 3 without recomputation: each unit's gathered parameters let go after its
//! forward and gathered again for its backward (the last unit's kept), each weight let go
//! again as soon as its backward is done ([`burn_dist::pipeline::Regather`] over
//! [`hearth_kernels::keyed`]). The convolutions' and linear layers' graphs keep their weights'
//! parameter ids instead of the weights; what other ops keep (batch norm's scale and shift,
//! the biases' shapes) stays with the unit between its passes.
//!
//! The backward gathers a bucket at a time: the bucket of a weight when its first op's
//! backward needs it (`Fetch`), and each weight's gradient goes to the step's exchange as soon
//! as its ops are done, where its bucket is reduce-scattered once whole
//! ([`burn_dist::overlap::hand_over_one`]). With buckets of one weight each (`--bucket-mb`
//! below the smallest weight worth it), a unit's backward holds a weight or two and their
//! gradients instead of the unit's; with the default buckets, a unit's buckets are its whole.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::Tensor;
use burn::tensor::TensorData;
use burn_dist::pipeline::{Activation, Regather};

use super::gathered::Gathering;
use super::stage::StageModel;

/// The keys each unit's graph kept, from its forward to its backward, the gradients of the
/// keyed weights from a backward to their hand-over, and the shards the backward fetches the
/// keyed weights from.
pub(super) struct Regathered<'a> {
    keys: HashMap<usize, hearth_kernels::keyed::Uses>,
    grads: HashMap<u64, TensorData>,
    shards: &'a Gathering<'a>,
}

impl<'a> Regathered<'a> {
    pub(super) fn new(shards: &'a Gathering<'a>) -> Self {
        Self {
            keys: HashMap::new(),
            grads: HashMap::new(),
            shards,
        }
    }
}

impl Regather<StageModel> for Regathered<'_> {
    fn forward(
        &mut self,
        k: usize,
        gathered: StageModel,
        release: bool,
        forward: &mut dyn FnMut(&StageModel) -> burn_dist::Result<Activation>,
    ) -> burn_dist::Result<(Activation, StageModel)> {
        let (y, keys) = hearth_kernels::keyed::forward(|| forward(&gathered));
        let y = y?;
        let kept = match release {
            true => gathered.map(&mut Release { keys: &keys }),
            false => gathered,
        };
        self.keys.insert(k, keys);
        Ok((y, kept))
    }

    fn backward(
        &mut self,
        k: usize,
        values: Option<StageModel>,
        backward: &mut dyn FnMut() -> burn_dist::Result<burn::tensor::Gradients>,
    ) -> burn_dist::Result<(burn::tensor::Gradients, Option<StageModel>)> {
        let keys = self.keys.remove(&k).unwrap_or_default();
        let mut take = Take {
            keys: &keys,
            values: HashMap::with_capacity(keys.len()),
        };
        // The keyed values handed in (the last unit's own) move out of the module into the
        // backward's; the others are fetched bucket by bucket as the ops need them.
        let rest = values.map(|v| v.map(&mut take));
        let mut fetch = Fetch {
            shards: self.shards,
            keys: &keys,
        };
        let (g, grads) =
            hearth_kernels::keyed::backward_from(take.values, &keys, &mut fetch, backward);
        let grads = grads.map_err(|e| {
            burn_dist::DistError::Config(format!("unit {k}'s backward by key: {e}"))
        })?;
        self.grads.extend(grads);
        Ok((g?, rest))
    }

    fn fetches(&self) -> bool {
        true
    }

    fn add_keyed(
        &mut self,
        k: usize,
        segment: &StageModel,
        grads: &mut GradientsParams,
    ) -> burn_dist::Result<()> {
        let mut add = Add {
            grads: &mut self.grads,
            into: grads,
            error: None,
        };
        segment.visit(&mut add);
        if let Some(e) = add.error {
            return Err(burn_dist::DistError::Config(format!("unit {k}: {e}")));
        }
        match self.grads.keys().next() {
            Some(id) => Err(burn_dist::DistError::Config(format!(
                "unit {k}: a gradient for parameter {id}, which is not the unit's"
            ))),
            None => Ok(()),
        }
    }
}

/// A unit's keyed weights from the ranks' shards, a bucket at a time as the backward's ops
/// first need them (every rank's backward runs its ops in one order, so every rank gathers the
/// same buckets in the same order), and their gradients handed to the step's exchange as soon
/// as each is whole.
struct Fetch<'a> {
    shards: &'a Gathering<'a>,
    keys: &'a hearth_kernels::keyed::Uses,
}

impl hearth_kernels::keyed::Source for Fetch<'_> {
    fn fetch(&mut self, key: u64) -> Result<Vec<(u64, TensorData)>, String> {
        let g = self.shards;
        let bucket = g
            .params
            .gather_bucket_of(g.zero, g.comm, &ParamId::from(key))
            .map_err(|e| format!("gathering weight {key}'s bucket: {e}"))?;
        // The bucket's other tensors that the graph did not key (batch norm's, the biases)
        // are the unit's own between its passes: dropped here.
        Ok(bucket
            .into_iter()
            .filter(|(id, ..)| self.keys.contains_key(&id.val()))
            .map(|(id, shape, v)| (id.val(), TensorData::new(v, shape)))
            .collect())
    }

    fn gradient(&mut self, key: u64, grad: TensorData) -> Result<Option<TensorData>, String> {
        let dims = grad.shape().to_vec();
        let values = grad
            .try_into_vec::<f32>()
            .map_err(|e| format!("weight {key}'s gradient is not f32: {e:?}"))?;
        Ok(
            burn_dist::overlap::hand_over_one(ParamId::from(key), dims.clone(), values)
                .map(|v| TensorData::new(v, dims)),
        )
    }
}

/// Empties the parameters the graph keeps by key (their values go with the module).
struct Release<'a> {
    keys: &'a hearth_kernels::keyed::Uses,
}

impl ModuleMapper for Release<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.keys.contains_key(&param.id.val()) {
            return param;
        }
        param.map(|t| {
            let device = t.device();
            drop(t);
            Tensor::<D>::empty([0; D], &device).set_require_grad(true)
        })
    }
}

/// Moves the keyed parameters' values out of a unit (gathered again, or the last unit's own).
struct Take<'a> {
    keys: &'a hearth_kernels::keyed::Uses,
    values: HashMap<u64, TensorData>,
}

impl ModuleMapper for Take<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id.val();
        if !self.keys.contains_key(&id) {
            return param;
        }
        let values = &mut self.values;
        param.map(|t| {
            let device = t.device();
            values.insert(id, t.into_data());
            Tensor::<D>::empty([0; D], &device)
        })
    }
}

/// Registers the keyed gradients under their parameters' ids, each as a tensor of its rank.
struct Add<'a> {
    grads: &'a mut HashMap<u64, TensorData>,
    into: &'a mut GradientsParams,
    error: Option<String>,
}

impl ModuleVisitor for Add<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(data) = self.grads.remove(&param.id.val()) else {
            return;
        };
        if data.shape().len() != D {
            self.error.get_or_insert(format!(
                "parameter {}'s gradient has shape {:?}, not rank {D}",
                param.id,
                data.shape()
            ));
            return;
        }
        let device = param.val().device().without_autodiff();
        self.into
            .register(param.id, Tensor::<D>::from_data(data, &device));
    }
}
