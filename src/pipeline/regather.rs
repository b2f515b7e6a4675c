//! ZeRO stage 3 without recomputation: each unit's gathered parameters let go after its
//! forward and gathered again for its backward (the last unit's kept), each weight let go
//! again as soon as its backward is done ([`burn_dist::pipeline::Regather`] over
//! [`hearth_kernels::keyed`]). The convolutions' and linear layers' graphs keep their weights'
//! parameter ids instead of the weights; what other ops keep (batch norm's scale and shift,
//! the biases' shapes) stays with the unit between its passes.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::Tensor;
use burn::tensor::TensorData;
use burn_dist::pipeline::{Activation, Regather};

use super::stage::StageModel;

/// The keys each unit's graph kept, from its forward to its backward, and the gradients of
/// the keyed weights from a backward to their hand-over.
#[derive(Default)]
pub(super) struct Regathered {
    keys: HashMap<usize, hearth_kernels::keyed::Uses>,
    grads: HashMap<u64, TensorData>,
}

impl Regather<StageModel> for Regathered {
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
        values: StageModel,
        backward: &mut dyn FnMut() -> burn_dist::Result<burn::tensor::Gradients>,
    ) -> burn_dist::Result<(burn::tensor::Gradients, StageModel)> {
        let keys = self.keys.remove(&k).unwrap_or_default();
        let mut take = Take {
            keys: &keys,
            values: HashMap::with_capacity(keys.len()),
        };
        // The keyed values move out of the module into the backward's.
        let rest = values.map(&mut take);
        if let Some(missing) = keys.keys().find(|key| !take.values.contains_key(key)) {
            return Err(burn_dist::DistError::Config(format!(
                "unit {k}'s parameter {missing} was kept by key in its forward but is not among \
                 the values handed to its backward"
            )));
        }
        let (g, grads) = hearth_kernels::keyed::backward(take.values, &keys, backward);
        self.grads.extend(grads);
        Ok((g?, rest))
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
