//! A module's tensors for burn-pack's writer as deferred tensors: each one's values read only
//! when the writer reaches it and let go after it, a float tensor on the CPU in one copy
//! ([`hearth_kernels::file_bytes`]). What [`crate::save_model_with`] writes a model with, and
//! what Hearth's checkpoints build on; [`checkpoint_tensors`] reads such a checkpoint back for
//! the writer a tensor at a time (`crate::save_model_from_file`), no model built.
//!
//! Why: Burn's store reads a tensor that a module holds with `into_data`, which on Flex copies
//! its values twice and, for a tensor whose values still lie in a mapped file (a model loaded
//! from a checkpoint to be exported), keeps a copy in the process: the export of VGG-16's best
//! epoch raised the process's live heap from 21 to 558 MB and its peak to 1,313 MB.

use std::path::Path;

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

/// The tensors of the burnpack file `weights` (a checkpoint Hearth wrote of `model`'s
/// architecture) for burn-pack's writer, in `model`'s visiting order as the model's own file
/// has them, each one's bytes a window of the file read when the writer reaches it and let go
/// after (a provider that reads its window again, never a tensor that keeps it): written
/// through them, a process holds at most one tensor of the file. `model` gives the
/// architecture only and may be a skeleton whose parameters were never initialised; the file
/// must hold its tensors by name, each of its shape, and no other.
pub fn checkpoint_tensors(
    weights: &Path,
    model: &crate::Classifier,
) -> crate::Result<Vec<burn_pack::Tensor>> {
    let corrupt = |reason: String| crate::ModelError::Corrupt {
        path: weights.to_path_buf(),
        format: "Hearth checkpoint (burnpack)",
        reason,
    };
    let tensors = burn_pack::Reader::from_file_exact(weights)
        .and_then(burn_pack::Reader::into_tensors)
        .map_err(|e| corrupt(e.to_string()))?;
    let mut want = Shapes::default();
    model.visit(&mut want);
    let mut found: std::collections::BTreeMap<String, burn_pack::Tensor> =
        tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
    let mut ordered = Vec::with_capacity(want.out.len());
    for (name, shape) in want.out {
        let Some(t) = found.remove(&name) else {
            return Err(corrupt(format!("no tensor '{name}' (of shape {shape:?})")));
        };
        if t.shape.to_vec() != shape {
            return Err(crate::ModelError::ShapeMismatch {
                path: weights.to_path_buf(),
                key: name,
                expected: shape,
                found: t.shape.to_vec(),
            });
        }
        let (dtype, id, len) = (t.dtype, t.param_id, t.byte_len());
        let read = move || t.to_bytes();
        ordered.push(burn_pack::Tensor::deferred(
            name, dtype, shape, id, len, read,
        ));
    }
    if let Some(extra) = found.keys().next() {
        return Err(corrupt(format!("tensor '{extra}' is not the model's")));
    }
    Ok(ordered)
}

/// Writes `tensors` with `metadata` as the burnpack file `path`, replacing it.
pub fn write_pack(
    tensors: Vec<burn::store::burn_pack::Tensor>,
    metadata: &std::collections::BTreeMap<String, String>,
    path: &Path,
) -> crate::Result<()> {
    let mut writer = burn::store::burn_pack::Writer::new(tensors);
    for (key, value) in metadata {
        writer = writer.with_metadata(key, value);
    }
    writer
        .auto_extension(false)
        .overwrite(true)
        .write_to_file(path)
        .map_err(|e| crate::ModelError::Save {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// Every tensor's module path and shape, read without initialising a lazy parameter.
#[derive(Default)]
struct Shapes {
    path: Vec<String>,
    out: Vec<(String, Vec<usize>)>,
}

impl Shapes {
    fn push(&mut self, shape: burn::tensor::Shape) {
        self.out.push((self.path.join("."), shape.to_vec()));
    }
}

impl ModuleVisitor for Shapes {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.push(param.lazy_shape());
    }
    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.push(param.lazy_shape());
    }
    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.push(param.lazy_shape());
    }
}
