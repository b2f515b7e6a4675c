//! Weights out of Hearth in torchvision's form: a SafeTensors state_dict with torchvision's key
//! names and layouts, which `torchvision.models.<arch>(num_classes=N).load_state_dict(
//! safetensors.torch.load_file(path))` takes, and which [`crate::weights::load_torchvision`]
//! reads back.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use burn::store::{BurnToPyTorchAdapter, KeyRemapper, ModuleSnapshot, SafetensorsStore};
use safetensors::tensor::{Dtype, TensorView};

use crate::pth;
use crate::zoo::Classifier;
use crate::{ModelError, Result};

/// Writes `model`'s parameters and batch-norm statistics to `path` as a torchvision
/// state_dict in SafeTensors: torchvision's names (`layer1.0.downsample.0.weight`,
/// `features.denseblock1.denselayer1.conv1.weight`, VGG's `nn.Sequential` indices), its
/// layouts (linear weights as `[out, in]`, batch norm's `weight`/`bias`), and a
/// `num_batches_tracked` of 0 for every batch norm, which `load_state_dict` asks for in
/// strict mode. The file appears whole or not at all (written beside it, then renamed).
/// Returns the number of tensors written.
pub fn export_torchvision(model: &Classifier, path: &Path) -> Result<usize> {
    let (out, count) = state_dict(model, path)?;
    write_atomically(path, &out).map_err(|e| save_error(path, e.to_string()))?;
    Ok(count)
}

/// Writes the same state_dict as [`export_torchvision`] in PyTorch's own `.pth` format
/// (what `torch.save(model.state_dict(), path)` writes; `torch.load(path, weights_only=True)`
/// reads it, [`crate::pth`] says how). Returns the number of tensors written.
pub fn export_torchvision_pth(model: &Classifier, path: &Path) -> Result<usize> {
    let (bytes, count) = state_dict(model, path)?;
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| save_error(path, e.to_string()))?;
    let mut tensors = file.tensors();
    // torch.save keeps a state_dict's module order; by name is as good for load_state_dict
    // and keeps a layer's tensors together.
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut entries = Vec::with_capacity(tensors.len());
    for (key, view) in &tensors {
        let dtype = match view.dtype() {
            Dtype::F32 => pth::Element::F32,
            Dtype::I64 => pth::Element::I64,
            other => return Err(save_error(path, format!("{key} is {other:?}, not f32"))),
        };
        entries.push(pth::Entry {
            key,
            dtype,
            shape: view.shape(),
            data: view.data(),
        });
    }
    let out = pth::encode(&entries).map_err(|e| save_error(path, e))?;
    write_atomically(path, &out).map_err(|e| save_error(path, e.to_string()))?;
    Ok(count)
}

fn save_error(path: &Path, reason: String) -> ModelError {
    ModelError::Save {
        path: path.to_path_buf(),
        reason,
    }
}

/// torchvision's state_dict of `model` as SafeTensors bytes, and its number of tensors.
fn state_dict(model: &Classifier, path: &Path) -> Result<(Vec<u8>, usize)> {
    let failed = |reason: String| save_error(path, reason);
    let remap = KeyRemapper::from_patterns(model.torchvision_export_remaps()).map_err(|e| {
        ModelError::InvalidConfig {
            model: model.family(),
            reason: format!("internal key remap pattern: {e}"),
        }
    })?;
    let mut store = SafetensorsStore::from_bytes(None)
        .with_to_adapter(BurnToPyTorchAdapter)
        .skip_enum_variants(true)
        .remap(remap);
    model
        .save_into(&mut store)
        .map_err(|e| failed(e.to_string()))?;
    let bytes = store.get_bytes().map_err(|e| failed(e.to_string()))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| failed(e.to_string()))?;
    let zero = 0i64.to_le_bytes();
    let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
    for (name, view) in file.tensors() {
        if let Some(layer) = name.strip_suffix(".running_mean") {
            let counter = TensorView::new(Dtype::I64, Vec::new(), &zero)
                .map_err(|e| failed(e.to_string()))?;
            views.push((format!("{layer}.num_batches_tracked"), counter));
        }
        views.push((name, view));
    }
    let count = views.len();
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let out = safetensors::serialize(views, Some(metadata)).map_err(|e| failed(e.to_string()))?;
    Ok((out, count))
}

/// Writes `bytes` to `path` whole or not at all (beside it, then renamed).
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let written = std::fs::File::create(&partial)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}
