//! What a Hearth model file holds beside its tensors (the configuration, the head's activation,
//! class names, input preprocessing), and the file written from a checkpoint a tensor at a
//! time. Below `weights.rs`, which reads and writes whole models; above `pack.rs`.

use std::path::Path;

/// Metadata keys of a Hearth model file.
pub(crate) const META_CONFIG: &str = "hearth.model_config";
pub(crate) const META_HEAD: &str = "hearth.head_activation";
pub(crate) const META_CLASSES: &str = "hearth.class_names";
pub(crate) const META_PREPROCESSING: &str = "hearth.preprocessing";

/// How inputs were prepared for a model: shorter side resized to `resize`, center crop of
/// `crop`, then `(v / 255 - mean) / std` per channel. Stored in Hearth model files so that
/// prediction prepares images as training validated them.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocessing {
    pub resize: u32,
    pub crop: u32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Preprocessing {
    /// torchvision's evaluation recipe for inputs of `size`: resize to `size * 256 / 224`,
    /// center crop `size`, ImageNet mean and std (Hearth's validation transform).
    pub fn eval(size: u32) -> Self {
        Self {
            resize: (size as f64 * 256.0 / 224.0).round() as u32,
            crop: size,
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        }
    }

    pub(crate) fn to_json(&self) -> String {
        serde_json::json!({
            "resize": self.resize,
            "crop": self.crop,
            "mean": self.mean,
            "std": self.std,
        })
        .to_string()
    }

    pub(crate) fn from_json(text: &str) -> std::result::Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let side = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("'{k}' is not a positive integer"))
        };
        let triple = |k: &str| -> std::result::Result<[f32; 3], String> {
            let list: Vec<f32> = v
                .get(k)
                .and_then(serde_json::Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_f64().map(|x| x as f32))
                        .collect()
                })
                .unwrap_or_default();
            list.try_into()
                .map_err(|_| format!("'{k}' is not a list of 3 numbers"))
        };
        let p = Self {
            resize: side("resize")?,
            crop: side("crop")?,
            mean: triple("mean")?,
            std: triple("std")?,
        };
        if p.std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(format!("std {:?} must be positive", p.std));
        }
        Ok(p)
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
    preprocessing: Option<&Preprocessing>,
    path: &Path,
) -> crate::Result<()> {
    let tensors = crate::pack::checkpoint_tensors(weights, model)?;
    let metadata = model_metadata(model, config, class_names, preprocessing, path)?;
    crate::pack::write_pack(tensors, &metadata, path)
}

/// What a Hearth model file records beside the tensors: Burn's store's default metadata, the
/// configuration, the head's activation, and the class names and preprocessing when given.
pub(crate) fn model_metadata(
    model: &crate::Classifier,
    config: &crate::ModelConfig,
    class_names: Option<&[String]>,
    preprocessing: Option<&Preprocessing>,
    path: &Path,
) -> crate::Result<std::collections::BTreeMap<String, String>> {
    let mut metadata = burn::store::BurnpackStore::default_metadata();
    metadata.insert(META_CONFIG.into(), config.to_json());
    metadata.insert(META_HEAD.into(), model.head_activation().name().into());
    if let Some(names) = class_names {
        let json = serde_json::to_string(names).map_err(|e| crate::ModelError::Save {
            path: path.to_path_buf(),
            reason: format!("class names: {e}"),
        })?;
        metadata.insert(META_CLASSES.into(), json);
    }
    if let Some(p) = preprocessing {
        metadata.insert(META_PREPROCESSING.into(), p.to_json());
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::Preprocessing;

    #[test]
    fn preprocessing_round_trips_and_bad_records_are_errors() {
        let p = Preprocessing::eval(32);
        assert_eq!(p.resize, 37);
        assert_eq!(Preprocessing::from_json(&p.to_json()), Ok(p));
        assert_eq!(Preprocessing::eval(224).resize, 256);
        for bad in [
            "{}",
            "not json",
            r#"{"resize": 0, "crop": 1, "mean": [0,0,0], "std": [1,1,1]}"#,
            r#"{"resize": 8, "crop": 8, "mean": [0,0], "std": [1,1,1]}"#,
            r#"{"resize": 8, "crop": 8, "mean": [0,0,0], "std": [1,0,1]}"#,
        ] {
            assert!(Preprocessing::from_json(bad).is_err(), "{bad}");
        }
    }
}
