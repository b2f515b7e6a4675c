//! A module's tensors for burn-pack's writer as deferred tensors: each one's values read only
//! when the writer reaches it and let go after it, a float tensor on the CPU in one copy
//! ([`hearth_kernels::file_bytes`]). What [`crate::save_model_with`] writes a model with, and
//! what Hearth's checkpoints build on; [`save_model_from_file`] writes a model file from such a
//! checkpoint a tensor at a time, no model built.
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

/// [`crate::save_model_with`] of the model whose weights are the burnpack file `weights` (a
/// checkpoint Hearth wrote of `model`'s architecture), written from that file a tensor at a
/// time as the writer reaches each one: no model holds them, so the process holds at most one
/// tensor of them (the export of VGG-16's best epoch loaded the whole model, 553 MB, and copied
/// its largest tensor, 411 MB, beside it). `model` gives the architecture only and may be a
/// skeleton whose parameters were never initialised: the file must hold its tensors by name,
/// each of its shape and no other, or nothing is written.
pub fn save_model_from_file(
    weights: &Path,
    model: &crate::Classifier,
    config: &crate::ModelConfig,
    class_names: Option<&[String]>,
    preprocessing: Option<&crate::Preprocessing>,
    path: &Path,
) -> crate::Result<()> {
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
    // In the model's visiting order, as the model's own file has them; each tensor's bytes a
    // window of the file read when the writer asks for them and let go after (a provider
    // that reads its window again, never a tensor that keeps it).
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
    let metadata = model_metadata(model, config, class_names, preprocessing, path)?;
    write_pack(ordered, &metadata, path)
}

/// What a Hearth model file records beside the tensors: Burn's store's default metadata, the
/// configuration, the head's activation, and the class names and preprocessing when given.
pub(crate) fn model_metadata(
    model: &crate::Classifier,
    config: &crate::ModelConfig,
    class_names: Option<&[String]>,
    preprocessing: Option<&crate::Preprocessing>,
    path: &Path,
) -> crate::Result<std::collections::BTreeMap<String, String>> {
    let mut metadata = burn::store::BurnpackStore::default_metadata();
    metadata.insert(crate::weights::META_CONFIG.into(), config.to_json());
    metadata.insert(
        crate::weights::META_HEAD.into(),
        model.head_activation().name().into(),
    );
    if let Some(names) = class_names {
        let json = serde_json::to_string(names).map_err(|e| crate::ModelError::Save {
            path: path.to_path_buf(),
            reason: format!("class names: {e}"),
        })?;
        metadata.insert(crate::weights::META_CLASSES.into(), json);
    }
    if let Some(p) = preprocessing {
        metadata.insert(crate::weights::META_PREPROCESSING.into(), p.to_json());
    }
    Ok(metadata)
}

/// Writes `tensors` with `metadata` as the burnpack file `path`, replacing it.
pub(crate) fn write_pack(
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
