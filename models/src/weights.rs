//! Weight files: torchvision state_dicts (`.pth`/`.pt`, `.safetensors`) in, and Hearth's own
//! model files (burnpack `.bpk`, with the model configuration in the metadata) in and out.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::store::{
    ApplyError, ApplyResult, BurnpackStore, KeyRemapper, ModuleSnapshot, ModuleStore,
    PyTorchToBurnAdapter, PytorchStore, SafetensorsStore,
};

use crate::layers::HeadActivation;
use crate::model_file::{META_CLASSES, META_CONFIG, META_HEAD, META_PREPROCESSING, Preprocessing};
use crate::zoo::{Classifier, ModelConfig};
use crate::{ModelError, Result};

/// How many key names an error lists before "...".
const LIST: usize = 8;

/// On-disk formats Hearth reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsFormat {
    /// `torch.save(model.state_dict())`: `.pth`, `.pt`, `.pth.tar`, `.bin`.
    Pytorch,
    /// A SafeTensors file with torchvision's key names and layouts.
    Safetensors,
    /// Hearth's own model file (burnpack).
    Hearth,
}

impl WeightsFormat {
    pub fn of(path: &Path) -> Result<Self> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if name.ends_with(".pth")
            || name.ends_with(".pt")
            || name.ends_with(".pth.tar")
            || name.ends_with(".bin")
        {
            Ok(Self::Pytorch)
        } else if name.ends_with(".safetensors") {
            Ok(Self::Safetensors)
        } else if name.ends_with(".bpk") {
            Ok(Self::Hearth)
        } else {
            Err(ModelError::UnknownFormat {
                path: path.to_path_buf(),
            })
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Pytorch => "PyTorch",
            Self::Safetensors => "SafeTensors",
            Self::Hearth => "Hearth (burnpack)",
        }
    }
}

/// What to load from a torchvision file.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Leave the head as it is and ignore the file's head: for loading ImageNet weights into a
    /// network with another class count.
    pub skip_head: bool,
    /// A key holding the state_dict inside the file (`state_dict`, `model`), for checkpoints that
    /// wrap it.
    pub top_level_key: Option<String>,
}

/// What a successful load did.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub path: PathBuf,
    pub format: WeightsFormat,
    /// Tensors applied to the model.
    pub applied: usize,
    /// File tensors deliberately left out (batch norm counters, the head with `skip_head`).
    pub ignored: Vec<String>,
}

pub(crate) fn check_readable(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .map(|_| ())
        .map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
}

fn head_key(key: &str, head_prefix: &str) -> bool {
    key.starts_with(head_prefix)
}

/// Turns burn-store's report into our errors: shape mismatches first, then missing, then
/// unexpected keys.
pub(crate) fn check_apply(
    path: &Path,
    model_name: &str,
    head_prefix: Option<&str>,
    result: ApplyResult,
    format: WeightsFormat,
) -> Result<LoadReport> {
    let in_head = |k: &str| head_prefix.is_some_and(|p| head_key(k, p));
    let mut head_errors = Vec::new();
    for error in &result.errors {
        match error {
            ApplyError::ShapeMismatch {
                path: key,
                expected,
                found,
            } if !in_head(key) => {
                return Err(ModelError::ShapeMismatch {
                    path: path.to_path_buf(),
                    key: key.clone(),
                    expected: expected.to_vec(),
                    found: found.to_vec(),
                });
            }
            ApplyError::ShapeMismatch { path: key, .. } => head_errors.push(key.clone()),
            ApplyError::DTypeMismatch { path: key, .. }
            | ApplyError::AdapterError { path: key, .. }
            | ApplyError::LoadError { path: key, .. } => {
                if !in_head(key) {
                    return Err(ModelError::TensorLoad {
                        path: path.to_path_buf(),
                        key: key.clone(),
                        reason: error.to_string(),
                    });
                }
                head_errors.push(key.clone());
            }
        }
    }
    let missing: Vec<String> = result
        .missing
        .iter()
        .map(|(k, _)| k.clone())
        .filter(|k| !in_head(k))
        .collect();
    let (mut ignored, unexpected): (Vec<String>, Vec<String>) = result
        .unused
        .iter()
        .cloned()
        .partition(|k| k.ends_with("num_batches_tracked") || in_head(k));
    // With skip_head, the file's head (of another class count) is left out on purpose.
    ignored.extend(head_errors);
    if !missing.is_empty() {
        let hint = if result.applied.is_empty() {
            "; nothing matched: is this a weights file for another architecture?".to_string()
        } else {
            String::new()
        };
        return Err(ModelError::MissingKeys {
            path: path.to_path_buf(),
            model: model_name.to_string(),
            count: missing.len(),
            first: missing.into_iter().take(LIST).collect(),
            hint,
        });
    }
    if !unexpected.is_empty() {
        return Err(ModelError::UnexpectedKeys {
            path: path.to_path_buf(),
            model: model_name.to_string(),
            count: unexpected.len(),
            first: unexpected.into_iter().take(LIST).collect(),
            hint: "; a file for a deeper variant of the same family?".to_string(),
        });
    }
    Ok(LoadReport {
        path: path.to_path_buf(),
        format,
        applied: result.applied.len(),
        ignored,
    })
}

pub(crate) fn remapper(model: &Classifier) -> Result<KeyRemapper> {
    KeyRemapper::from_patterns(model.torchvision_remaps()).map_err(|e| {
        // The patterns are ours; a failure here is a bug, reported rather than panicking.
        ModelError::InvalidConfig {
            model: model.family(),
            reason: format!("internal key remap pattern: {e}"),
        }
    })
}

/// A torchvision `.pth` file as a store, with `remap` applied to its keys and its sequential
/// indices kept as they are (burn-store renumbers them contiguously by default, which turns
/// VGG's `classifier.6` into `classifier.2`). The load and the head lookup both read through
/// this, so they see the same keys.
fn pytorch_store(path: &Path, remap: KeyRemapper) -> PytorchStore {
    PytorchStore::from_file(path)
        .remap(remap)
        .map_indices_contiguous(false)
}

/// A checkpoint that wraps its state_dict (PyTorch Lightning's `{'state_dict': ..., 'epoch':
/// ...}`, or `model`/`model_state_dict`/`net` in hand-written loops): the key holding it, and
/// the first name every key inside shares when there is one (Lightning's `model.`, the
/// LightningModule's attribute; a torchvision network itself has several top-level modules).
fn wrapped_state_dict(path: &Path) -> Option<(String, Option<String>)> {
    let keys = PytorchStore::from_file(path).keys().ok()?;
    for top in ["state_dict", "model_state_dict", "model", "net"] {
        let dotted = format!("{top}.");
        let inner: Vec<&str> = keys
            .iter()
            .filter_map(|k| k.strip_prefix(&dotted))
            .collect();
        if inner.is_empty() || inner.len() * 2 < keys.len() {
            continue;
        }
        let first = inner[0].split('.').next().unwrap_or_default();
        let shared = inner.len() > 1
            && inner
                .iter()
                .all(|k| k.split('.').next() == Some(first) && k.len() > first.len());
        return Some((top.to_string(), shared.then(|| format!("{first}."))));
    }
    None
}

/// The remapper of `model`'s torchvision keys, after `prefix` (a wrapper's attribute name)
/// is taken off every key.
fn remapper_without(model: &Classifier, prefix: Option<&str>) -> Result<KeyRemapper> {
    let mut patterns: Vec<(String, String)> = prefix
        .map(|p| (format!("^{}", p.replace('.', r"\.")), String::new()))
        .into_iter()
        .collect();
    patterns.extend(model.torchvision_remaps());
    KeyRemapper::from_patterns(patterns).map_err(|e| ModelError::InvalidConfig {
        model: model.family(),
        reason: format!("internal key remap pattern: {e}"),
    })
}

/// [`pytorch_store`] for a `.safetensors` file.
pub(crate) fn safetensors_store(path: &Path, remap: KeyRemapper) -> SafetensorsStore {
    SafetensorsStore::from_file(path)
        .remap(remap)
        .map_indices_contiguous(false)
}

/// The store of a torchvision `.pth` for `model`: its keys remapped to the model's, the
/// state_dict inside a checkpoint that wraps it, nothing read yet (its tensors are read from
/// the file as they are applied).
pub(crate) fn torchvision_pth(
    model: &Classifier,
    path: &Path,
    options: &LoadOptions,
) -> Result<PytorchStore> {
    let (top, remap) = pth_keys(model, path, options)?;
    let mut store = pytorch_store(path, remap)
        .allow_partial(true)
        .validate(false);
    if let Some(key) = top {
        store = store.with_top_level_key(key);
    }
    Ok(store)
}

/// Where a torchvision `.pth`'s state_dict is (the key of a checkpoint that wraps it) and how
/// its keys become `model`'s: what [`torchvision_pth`] reads the file with.
pub(crate) fn pth_keys(
    model: &Classifier,
    path: &Path,
    options: &LoadOptions,
) -> Result<(Option<String>, KeyRemapper)> {
    let (top, prefix) = match &options.top_level_key {
        Some(key) => (Some(key.clone()), None),
        None => match wrapped_state_dict(path) {
            Some((key, prefix)) => (Some(key), prefix),
            None => (None, None),
        },
    };
    Ok((top, remapper_without(model, prefix.as_deref())?))
}

/// Loads a torchvision state_dict (`.pth`/`.pt` or `.safetensors`) into `model`.
///
/// Every parameter and batch-norm statistic must be in the file with the right shape
/// (except the head when [`LoadOptions::skip_head`] is set), and the file may not hold tensors
/// the model lacks; otherwise the error names the keys and shapes. On error the model may be
/// partly updated: discard it.
pub fn load_torchvision(
    model: &mut Classifier,
    path: &Path,
    options: &LoadOptions,
) -> Result<LoadReport> {
    check_readable(path)?;
    let format = WeightsFormat::of(path)?;
    let name = format!("{} ({} classes)", model.family(), model.num_classes());
    let head = options.skip_head.then(|| model.head_prefix());
    let corrupt = |reason: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        format: format.label(),
        reason,
    };
    let result = match format {
        WeightsFormat::Pytorch => model
            .load_from(&mut torchvision_pth(model, path, options)?)
            .map_err(|e| corrupt(e.to_string()))?,
        WeightsFormat::Safetensors => {
            let mut store = safetensors_store(path, remapper(model)?)
                .with_from_adapter(PyTorchToBurnAdapter)
                .skip_enum_variants(true)
                .allow_partial(true)
                .validate(false);
            model
                .load_from(&mut store)
                .map_err(|e| corrupt(e.to_string()))?
        }
        WeightsFormat::Hearth => {
            return Err(corrupt(
                "this is a Hearth model file: load it with `load_model`".into(),
            ));
        }
    };
    check_apply(path, &name, head, result, format)
}

/// The class count of the head stored in a torchvision file for `arch` (the first dimension
/// of the head's weight), so a fine-tuned checkpoint loads without being told its classes.
pub fn torchvision_num_classes(arch: crate::Architecture, path: &Path) -> Result<usize> {
    check_readable(path)?;
    let format = WeightsFormat::of(path)?;
    // torchvision's key for the head weight.
    let key = match arch.config(1) {
        ModelConfig::ResNet(_) => "fc.weight",
        ModelConfig::Vgg(_) => "classifier.6.weight",
        ModelConfig::DenseNet(_) => "classifier.weight",
    };
    let corrupt = |reason: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        format: format.label(),
        reason,
    };
    // Only the DataParallel prefix is removed: the key looked up is torchvision's own.
    let prefix =
        || KeyRemapper::from_patterns(vec![(r"^module\.", "")]).map_err(|e| corrupt(e.to_string()));
    let shape = match format {
        WeightsFormat::Pytorch => {
            // A wrapped state_dict (a Lightning checkpoint): the head inside it.
            let (store, key) = match wrapped_state_dict(path) {
                Some((top, inner)) => (
                    pytorch_store(path, prefix()?).with_top_level_key(top),
                    format!("{}{key}", inner.unwrap_or_default()),
                ),
                None => (pytorch_store(path, prefix()?), key.to_string()),
            };
            let mut store = store;
            store
                .get_tensor(&key)
                .map_err(|e| corrupt(e.to_string()))?
                .map(|t| t.shape.to_vec())
        }
        WeightsFormat::Safetensors => safetensors_store(path, prefix()?)
            .get_tensor(key)
            .map_err(|e| corrupt(e.to_string()))?
            .map(|t| t.shape.to_vec()),
        WeightsFormat::Hearth => None,
    };
    match shape.as_deref() {
        Some([classes, _]) if *classes > 0 => Ok(*classes),
        Some(other) => Err(ModelError::ShapeMismatch {
            path: path.to_path_buf(),
            key: key.to_string(),
            expected: vec![0, 0],
            found: other.to_vec(),
        }),
        None => {
            // No head: say what loading the whole file says (every tensor it lacks), as
            // `hearth train --weights` would, not only the head's one.
            let mut model = arch.init(1000, &Device::flex())?;
            let options = LoadOptions {
                skip_head: true,
                ..LoadOptions::default()
            };
            match load_torchvision(&mut model, path, &options) {
                Err(e) => Err(e),
                Ok(_) => Err(ModelError::MissingKeys {
                    path: path.to_path_buf(),
                    model: arch.name().to_string(),
                    count: 1,
                    first: vec![key.to_string()],
                    hint: "; the file has every tensor but the head".to_string(),
                }),
            }
        }
    }
}

/// A model with what is needed to use it: its configuration, class names and preprocessing.
#[derive(Debug)]
pub struct SavedModel {
    pub model: Classifier,
    pub config: ModelConfig,
    /// Class names in output order, when known (JSON list in the file).
    pub class_names: Option<Vec<String>>,
    /// How inputs were prepared in training (`None` for files written before it was stored).
    pub preprocessing: Option<Preprocessing>,
}

/// Saves a model and its configuration as a Hearth model file (burnpack), atomically: the file
/// is written beside its destination and renamed into place.
pub fn save_model(
    model: &Classifier,
    config: &ModelConfig,
    class_names: Option<&[String]>,
    path: &Path,
) -> Result<()> {
    save_model_with(model, config, class_names, None, path)
}

/// [`save_model`], also recording the input preprocessing.
pub fn save_model_with(
    model: &Classifier,
    config: &ModelConfig,
    class_names: Option<&[String]>,
    preprocessing: Option<&Preprocessing>,
    path: &Path,
) -> Result<()> {
    // Burn's burnpack store's file (its default metadata and ours, the tensors in visiting
    // order), each tensor read only as the writer reaches it ([`crate::pack`]).
    let metadata =
        crate::model_file::model_metadata(model, config, class_names, preprocessing, path)?;
    crate::pack::write_pack(crate::pack::deferred_tensors(model), &metadata, path)
}

/// Loads a Hearth model file written by [`save_model`]: rebuilds the network from the stored
/// configuration, then fills in the weights.
pub fn load_model(path: &Path, device: &Device) -> Result<SavedModel> {
    check_readable(path)?;
    let corrupt = |reason: String| ModelError::Corrupt {
        path: path.to_path_buf(),
        format: "Hearth (burnpack)",
        reason,
    };
    let reader =
        burn::store::burn_pack::Reader::from_file(path).map_err(|e| corrupt(e.to_string()))?;
    let meta = reader.metadata();
    let config_json = meta.get(META_CONFIG).ok_or_else(|| {
        corrupt(format!(
            "no '{META_CONFIG}' metadata: not written by Hearth's save_model"
        ))
    })?;
    let config = ModelConfig::from_json(config_json)
        .map_err(|e| corrupt(format!("bad model configuration: {e}")))?;
    let activation = match meta.get(META_HEAD).map(String::as_str) {
        Some("sigmoid") => HeadActivation::Sigmoid,
        _ => HeadActivation::Softmax,
    };
    let class_names = match meta.get(META_CLASSES) {
        Some(json) => Some(
            serde_json::from_str::<Vec<String>>(json)
                .map_err(|e| corrupt(format!("bad class names: {e}")))?,
        ),
        None => None,
    };
    let preprocessing = match meta.get(META_PREPROCESSING) {
        Some(json) => Some(
            Preprocessing::from_json(json)
                .map_err(|e| corrupt(format!("bad preprocessing record: {e}")))?,
        ),
        None => None,
    };
    drop(reader);
    let mut model = config.init(device)?.with_head_activation(activation);
    let mut store = BurnpackStore::from_file(path)
        .auto_extension(false)
        .allow_partial(true)
        .validate(false);
    let result = model
        .load_from(&mut store)
        .map_err(|e| corrupt(e.to_string()))?;
    let name = format!("{} ({} classes)", model.family(), model.num_classes());
    check_apply(path, &name, None, result, WeightsFormat::Hearth)?;
    Ok(SavedModel {
        model,
        config,
        class_names,
        preprocessing,
    })
}
