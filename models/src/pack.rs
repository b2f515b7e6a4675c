//! A module's tensors for burn-pack's writer as deferred tensors: each one's values read only
//! when the writer reaches it and let go after it, a float tensor on the CPU in one copy
//! ([`hearth_kernels::file_bytes`]). What [`crate::save_model_with`] writes a model with, and
//! what Hearth's checkpoints build on.
//!
//! Why: Burn's store reads a tensor that a module holds with `into_data`, which on Flex copies
//! its values twice and, for a tensor whose values still lie in a mapped file (a model loaded
//! from a checkpoint to be exported), keeps a copy in the process: the export of VGG-16's best
//! epoch raised the process's live heap from 21 to 558 MB and its peak to 1,313 MB.

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::{Bool, Int, Tensor};
use burn::store::burn_pack;
use burn::tensor::kind::Basic;

/// Tensor `t` (parameter `id`, module path `path`) for the writer, its bytes read by `direct`
/// where it can (else as Burn reads them, `into_data`) when the writer reaches it.
pub fn deferred<const D: usize, K: Basic + 'static>(
    path: String,
    id: u64,
    t: Tensor<D, K>,
    direct: fn(&Tensor<D, K>) -> Option<burn::tensor::Bytes>,
) -> burn_pack::Tensor
where
    Tensor<D, K>: Send + Sync,
{
    let (dtype, shape) = (t.dtype(), t.shape());
    let len = shape.num_elements() * dtype.size();
    let read = move || {
        if let Some(bytes) = direct(&t) {
            return Ok(bytes);
        }
        let (bytes, _, stored) = t.clone().into_data().into_parts();
        // The type the header declares must be the one the values come in (a backend may
        // store a type in a wider one).
        match stored == dtype {
            true => Ok(bytes),
            false => Err(burn_pack::Error::ValidationError(format!(
                "declared {dtype:?}, read {stored:?}"
            ))),
        }
    };
    burn_pack::Tensor::deferred(path, dtype, shape, Some(id), len, read)
}

/// Every tensor of `module` ([`deferred`]), by module path in visiting order: the tensors of
/// Burn's own burnpack file of the module.
pub fn deferred_tensors<M: Module>(module: &M) -> Vec<burn_pack::Tensor> {
    let mut d = Deferred {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut d);
    d.out
}

struct Deferred {
    path: Vec<String>,
    out: Vec<burn_pack::Tensor>,
}

impl ModuleVisitor for Deferred {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let direct = hearth_kernels::file_bytes::<D>;
        let t = param.transform_for_save().val();
        self.out
            .push(deferred(self.path.join("."), param.id.val(), t, direct));
    }
    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        let t = param.transform_for_save().val();
        self.out
            .push(deferred(self.path.join("."), param.id.val(), t, |_| None));
    }
    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        let t = param.transform_for_save().val();
        self.out
            .push(deferred(self.path.join("."), param.id.val(), t, |_| None));
    }
}
