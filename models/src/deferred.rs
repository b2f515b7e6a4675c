//! Torchvision weights (`.pth`, `.safetensors`) applied without reading them yet: each parameter
//! is left uninitialised (Burn's lazy parameters), its initialiser reading its tensor from the
//! file when the parameter is first used.
//!
//! ZeRO stage 3's rank 0 hands a model's values out a bucket at a time and lets each tensor go
//! after; loaded with burn-store's `Applier`, which reads every tensor as it applies it, a
//! `.pth` or a `.safetensors` file put the whole model in rank 0's memory first (ResNet-50: 120
//! MB live at its start, against 55 from a Hearth model file, whose tensors stay windows of
//! the file). burn-store has
//! no deferred apply, so `Deferring` walks the model as its `Applier` does: keys by path with
//! enum variants left out, PyTorch's names for a norm's parameters, the PyTorch adapter's
//! transpose (itself deferred). Each matched tensor is read once here and let go, so a file
//! that does not read is refused at load as [`crate::load_torchvision`] refuses it; a read that
//! fails later (the file changed under the run) gives zeros and is kept in [`DeferredReads`],
//! which the caller checks after the values are used.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::module::{ModuleMapper, Param, ParamId};
use burn::prelude::*;
use burn::store::burn_pack::Tensor as PackTensor;
use burn::store::{
    ApplyError, ApplyResult, ModuleAdapter, ModuleContext, ModuleStore, PyTorchToBurnAdapter,
    bridge,
};
use burn::tensor::{Bool, DType, Int, Shape};

pub use crate::stored::FileTensor;
use crate::stored::{self, Stored};
use crate::weights::{LoadOptions, LoadReport, WeightsFormat, check_apply, check_readable};
use crate::zoo::Classifier;
use crate::{ModelError, Result};

/// The first read that failed after a deferred load: the key and why.
type Failure = Arc<Mutex<Option<(String, String)>>>;

/// What a deferred load leaves to be checked: whether a parameter's read from the file failed
/// when it was first used (it then holds zeros).
#[derive(Debug, Clone)]
pub struct DeferredReads {
    path: PathBuf,
    failed: Failure,
    /// The file's tensors behind the deferred parameters, by parameter, when every one of
    /// them has its tensor here ([`Self::file_tensors`]).
    files: Option<Arc<HashMap<ParamId, FileTensor>>>,
}

impl DeferredReads {
    /// The weights file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Each deferred parameter's tensor in the file, for a caller that reads them itself a
    /// window at a time (ZeRO stage 3's rank 0) instead of making the parameters: `Some` for a
    /// file whose every deferred parameter is here (f32, read straight from the file).
    /// The parameters not in it are the model's own (a new head).
    pub fn file_tensors(&self) -> Option<&HashMap<ParamId, FileTensor>> {
        self.files.as_deref()
    }

    /// The first read that failed, if one did: the values read since are then wrong.
    pub fn failure(&self) -> Option<ModelError> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.as_ref().map(|(key, reason)| ModelError::TensorLoad {
            path: self.path.clone(),
            key: key.clone(),
            reason: reason.clone(),
        })
    }
}

/// [`crate::load_torchvision`] (a `.pth` or `.safetensors` file), its values read as each
/// parameter is first used (in any order, each once) rather than now: `model` (fresh from its
/// configuration, every parameter trainable) comes back with the file's tensors in place of its
/// own, checked as `load_torchvision` checks them (keys, shapes, kinds, and that each tensor
/// reads). Check [`DeferredReads::failure`] after the values are read.
pub fn load_torchvision_deferred(
    model: Classifier,
    path: &Path,
    options: &LoadOptions,
) -> Result<(Classifier, LoadReport, DeferredReads)> {
    check_readable(path)?;
    let format = WeightsFormat::of(path)?;
    let corrupt = |reason: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        format: format.label(),
        reason,
    };
    // The file's tensors by the model's keys, nothing read (a `.safetensors` file is mapped).
    let tensors = match format {
        WeightsFormat::Pytorch => crate::weights::torchvision_pth(&model, path, options)?
            .get_all_tensors()
            .map_err(|e| corrupt(e.to_string()))?
            .clone(),
        WeightsFormat::Safetensors => {
            let remap = crate::weights::remapper(&model)?;
            crate::weights::safetensors_store(path, remap)
                .get_all_tensors()
                .map_err(|e| corrupt(e.to_string()))?
                .clone()
        }
        WeightsFormat::Hearth => {
            return Err(corrupt(
                "this is a Hearth model file: load it with `load_model`".into(),
            ));
        }
    };
    // The same tensors read straight from the file, one copy each (burn-store's bridge copies
    // each tensor's bytes again to realign them); none where the file does not open so.
    let raw = match format {
        WeightsFormat::Pytorch => stored::pth_tensors(&model, path, options),
        WeightsFormat::Safetensors => stored::safetensors_tensors(&model, path),
        WeightsFormat::Hearth => HashMap::new(),
    };
    let name = format!("{} ({} classes)", model.family(), model.num_classes());
    let head = options.skip_head.then(|| model.head_prefix());
    let failed = Failure::default();
    let mut deferring = Deferring {
        raw,
        files: HashMap::new(),
        deferred: 0,
        tensors,
        adapter: PyTorchToBurnAdapter,
        path: Vec::new(),
        containers: Vec::new(),
        visited: Vec::new(),
        consumed: HashSet::new(),
        applied: Vec::new(),
        errors: Vec::new(),
        failed: failed.clone(),
    };
    let model = model.map(&mut deferring);
    let complete = !deferring.files.is_empty() && deferring.files.len() == deferring.deferred;
    let files = std::mem::take(&mut deferring.files);
    let report = check_apply(path, &name, head, deferring.into_result(), format)?;
    let reads = DeferredReads {
        path: path.to_path_buf(),
        failed,
        files: complete.then(|| Arc::new(files)),
    };
    // A value the walk made already (a buffer) and could not read is refused now.
    if let Some(e) = reads.failure() {
        return Err(e);
    }
    Ok((model, report, reads))
}

/// The mapper: each parameter that the file has a fitting tensor for becomes one that reads it
/// when first used.
struct Deferring {
    /// The file's f32 tensors read straight from it, by the model's keys.
    raw: HashMap<String, Stored>,
    /// The deferred parameters whose tensor is in `raw`, and how many were deferred.
    files: HashMap<ParamId, FileTensor>,
    deferred: usize,
    /// The file's tensors by the model's keys, nothing read.
    tensors: BTreeMap<String, PackTensor>,
    adapter: PyTorchToBurnAdapter,
    /// Where the walk is: the parameter path (enum variants left out) and the containers.
    path: Vec<String>,
    containers: Vec<String>,
    /// Every parameter path met, with its containers; the file's keys matched; the paths given
    /// a tensor; what did not fit.
    visited: Vec<(String, String)>,
    consumed: HashSet<String>,
    applied: Vec<String>,
    errors: Vec<ApplyError>,
    failed: Failure,
}

impl Deferring {
    /// The file's float tensor for the parameter here, if there is one that fits `shape` and
    /// reads (read once to check, then let go), and whether it is to be transposed as it is
    /// read; else `None`, with the reason recorded where one was found.
    fn matched(&mut self, shape: &Shape) -> Option<(PackTensor, bool, Option<FileTensor>)> {
        let path = self.path.join(".");
        self.visited.push((path.clone(), self.containers.join(".")));
        let ctx = ModuleContext::new(&self.containers);
        let mut source = path.clone();
        let mut tensor = self.tensors.get(&source).cloned();
        // Burn's name for a norm's parameter against PyTorch's (`gamma` for `weight`).
        if tensor.is_none()
            && let (Some(module), Some(param)) = (ctx.module_type(), self.path.last())
            && let Some(other) = self.adapter.get_alternative_param_name(param, module)
        {
            let mut other_path = self.path.clone();
            other_path.pop();
            other_path.push(other);
            source = other_path.join(".");
            tensor = self.tensors.get(&source).cloned();
        }
        let mut tensor = tensor?;
        self.consumed.insert(source.clone());
        tensor.name = path.clone();
        let raw = tensor.clone();
        let adapted = self.adapter.adapt(tensor, ctx);
        if !adapted.dtype.is_float() {
            self.errors.push(ApplyError::DTypeMismatch {
                path,
                expected: DType::F32,
                found: adapted.dtype,
            });
            return None;
        }
        if adapted.shape != *shape {
            self.errors.push(ApplyError::ShapeMismatch {
                path,
                expected: shape.clone(),
                found: adapted.shape.clone(),
            });
            return None;
        }
        // Read once to check, straight from the file where it has the tensor in f32 (one copy);
        // a tensor that does not read so is read again the store's way, whose error the eager
        // load gives.
        let direct = self
            .raw
            .get(&source)
            .filter(|t| t.len() == shape.num_elements() && t.read().is_ok())
            .cloned();
        if direct.is_none()
            && let Err(e) = bridge::to_data(&raw)
        {
            self.errors.push(ApplyError::LoadError {
                path,
                message: format!("Failed to load tensor data: {e:?}"),
            });
            return None;
        }
        self.applied.push(path);
        // A linear layer's weight, `[out, in]` in PyTorch and `[in, out]` in Burn: the adapter's
        // transpose holds the bytes read, its copy and the tensor's at once (VGG-16's first
        // classifier weight is 411 MB); read as stored and transposed as a view, it is copied
        // once, the bytes read and the copy at once.
        let linear_weight = ctx.module_type() == Some("Struct:Linear")
            && self.path.last().is_some_and(|p| p == "weight")
            && shape.num_dims() == 2;
        let dims = shape.to_vec();
        let file = direct.map(|t| FileTensor::new(t, linear_weight.then(|| [dims[0], dims[1]])));
        Some(match linear_weight {
            true => (raw, true, file),
            false => (adapted, false, file),
        })
    }

    /// What the walk found, as burn-store's `Applier` reports it.
    fn into_result(self) -> ApplyResult {
        let errored: HashSet<&str> = self
            .errors
            .iter()
            .map(|e| match e {
                ApplyError::ShapeMismatch { path, .. }
                | ApplyError::DTypeMismatch { path, .. }
                | ApplyError::AdapterError { path, .. }
                | ApplyError::LoadError { path, .. } => path.as_str(),
            })
            .collect();
        let applied: HashSet<&str> = self.applied.iter().map(String::as_str).collect();
        let mut missing: Vec<(String, String)> = self
            .visited
            .iter()
            .filter(|(p, _)| !applied.contains(p.as_str()) && !errored.contains(p.as_str()))
            .cloned()
            .collect();
        missing.sort();
        let unused: Vec<String> = self
            .tensors
            .keys()
            .filter(|k| !self.consumed.contains(*k))
            .cloned()
            .collect();
        ApplyResult {
            applied: self.applied,
            skipped: Vec::new(),
            missing,
            unused,
            errors: self.errors,
        }
    }
}

/// `tensor`'s values on `device`, `transposed` (its last two dimensions swapped, copied once
/// from the values read); zeros, with the failure kept, where the file does not read.
fn read<const D: usize>(
    tensor: PackTensor,
    transposed: bool,
    device: &Device,
    failed: &Failure,
) -> Tensor<D> {
    let (key, dtype, shape) = (tensor.name.clone(), tensor.dtype, tensor.shape.clone());
    let value = match bridge::into_data(tensor) {
        Ok(data) => Tensor::from_data(data, (device, dtype)),
        Err(e) => {
            let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
            failed.get_or_insert_with(|| (key, format!("{e:?}")));
            Tensor::zeros(shape, (device, dtype))
        }
    };
    match transposed {
        true => Tensor::from_data(value.transpose().into_data(), (device, dtype)),
        false => value,
    }
}

impl ModuleMapper for Deferring {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.containers.push(container_type.to_string());
        if !container_type.starts_with("Enum:") {
            self.path.push(name.to_string());
        }
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        self.containers.pop();
        if !container_type.starts_with("Enum:") {
            self.path.pop();
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let shape = param.lazy_shape();
        let Some((tensor, transposed, file)) = self.matched(&shape) else {
            return param;
        };
        let device = param.lazy_device();
        if param.is_initialized() {
            // A value made already (a running statistic's buffer): replaced now.
            let grad = param.val().is_require_grad();
            let value = read::<D>(tensor, transposed, &device, &self.failed);
            let value = value.set_require_grad(grad);
            return Param::initialized(param.id, value);
        }
        self.deferred += 1;
        if let Some(file) = file {
            self.files.insert(param.id, file);
        }
        let failed = self.failed.clone();
        Param::uninitialized(
            param.id,
            move |device, grad| {
                read::<D>(tensor, transposed, device, &failed).set_require_grad(grad)
            },
            device,
            true,
            shape,
        )
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        self.refuse_kind("integer");
        param
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        self.refuse_kind("boolean");
        param
    }
}

impl Deferring {
    /// A parameter that is not a float tensor (none in Hearth's models): named as an error
    /// rather than left out in silence.
    fn refuse_kind(&mut self, kind: &str) {
        let path = self.path.join(".");
        self.visited.push((path.clone(), self.containers.join(".")));
        self.errors.push(ApplyError::AdapterError {
            path,
            message: format!("a deferred load takes float parameters only, not {kind} ones"),
        });
    }
}
