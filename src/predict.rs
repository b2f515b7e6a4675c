//! Inputs and outputs of `hearth predict`.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use hearth_datasets::preprocess::{eval_preprocess_with, load_rgb};
use hearth_models::{
    Architecture, Classifier, LoadOptions, MIN_INPUT_SIZE, Preprocessing, WeightsFormat,
    load_model, load_torchvision,
};

use crate::{HearthError, Result, npy};

/// A model ready to predict, and where it came from.
pub struct PredictModel {
    pub model: Classifier,
    pub class_names: Option<Vec<String>>,
    /// `None` when the weights are random (no file given).
    pub weights: Option<PathBuf>,
    /// How inputs are prepared: the model file's record, or torchvision's 256/224 ImageNet
    /// evaluation recipe for torchvision weights and older model files.
    pub preprocessing: Preprocessing,
}

/// Builds the model for `hearth predict`. A Hearth model file carries its own architecture and
/// class count: `arch` and `num_classes` are refused where they say otherwise than the file.
/// torchvision files need `arch`, and their class count is read from the head in the file.
pub fn load_for_predict(
    arch: Option<&str>,
    weights: Option<&Path>,
    num_classes: Option<usize>,
    device: &Device,
) -> Result<PredictModel> {
    match weights {
        Some(path) if WeightsFormat::of(path)? == WeightsFormat::Hearth => {
            let saved = load_model(path, device)?;
            let held = saved.config.num_classes();
            if let Some(n) = num_classes.filter(|&n| n != held) {
                return Err(HearthError::InvalidArgument(format!(
                    "`model.num_classes` {n}: the model file {} has a head of {held} classes \
                     (a Hearth model file records its own; leave it out)",
                    path.display()
                )));
            }
            if let Some(name) = arch {
                let named = crate::train::model_config(name, held)?;
                if named.to_json() != saved.config.to_json() {
                    return Err(HearthError::InvalidArgument(format!(
                        "`model.name` {name}: the model file {} holds another network (a Hearth \
                         model file records its own architecture; leave it out)",
                        path.display()
                    )));
                }
            }
            if let Some(p) = &saved.preprocessing {
                check_sides(p).map_err(|why| {
                    HearthError::InvalidArgument(format!(
                        "the model file {} records {why}: the file is damaged, or not one \
                         Hearth wrote",
                        path.display()
                    ))
                })?;
            }
            Ok(PredictModel {
                model: saved.model,
                class_names: saved.class_names,
                weights: Some(path.to_path_buf()),
                preprocessing: saved.preprocessing.unwrap_or(Preprocessing::eval(224)),
            })
        }
        _ => {
            let name = arch.ok_or_else(|| {
                HearthError::InvalidArgument(
                    "`model.name` is required unless `model.weights` is a Hearth .bpk model file"
                        .into(),
                )
            })?;
            if crate::train::MINI_MODELS.contains(&name) {
                return Err(HearthError::InvalidArgument(format!(
                    "{name} is a Hearth test-size network: give the model.bpk of a run that \
                     trained it (`model.weights` RUN/model.bpk, no `model.name`)"
                )));
            }
            let arch = Architecture::from_name(name)?;
            let classes = match (num_classes, weights) {
                (Some(n), _) => n,
                (None, Some(path)) => hearth_models::weights::torchvision_num_classes(arch, path)?,
                (None, None) => 1000,
            };
            let mut model = arch.init(classes, device)?;
            if let Some(path) = weights {
                load_torchvision(&mut model, path, &LoadOptions::default())?;
            }
            Ok(PredictModel {
                model,
                class_names: None,
                weights: weights.map(Path::to_path_buf),
                preprocessing: Preprocessing::eval(224),
            })
        }
    }
}

/// Why `p`'s resize or crop cannot be prepared: above [`hearth_datasets::MAX_IMAGE_SIZE`], where
/// one image alone would need gigabytes.
fn check_sides(p: &Preprocessing) -> std::result::Result<(), String> {
    let max = hearth_datasets::MAX_IMAGE_SIZE;
    if p.resize > max || p.crop > max {
        return Err(format!(
            "images resized to {} and cropped to {}, above the largest side Hearth prepares \
             ({max})",
            p.resize, p.crop
        ));
    }
    Ok(())
}

/// Images through `p` (resize, center crop, normalise), stacked into `[N, 3, crop, crop]`.
pub fn images_to_tensor(
    paths: &[PathBuf],
    p: &Preprocessing,
    device: &Device,
) -> Result<Tensor<4>> {
    check_sides(p)
        .map_err(|why| HearthError::InvalidArgument(format!("preprocessing of {why}")))?;
    let crop = p.crop;
    let mut data = Vec::with_capacity(paths.len() * 3 * (crop * crop) as usize);
    for path in paths {
        let img = load_rgb(path)?;
        data.extend(eval_preprocess_with(&img, p.resize, crop, p.mean, p.std)?);
    }
    let shape = [paths.len(), 3, crop as usize, crop as usize];
    Ok(Tensor::from_data(TensorData::new(data, shape), device))
}

/// A raw NCHW float tensor from `.npy`, used as is.
pub fn npy_to_tensor(path: &Path, device: &Device) -> Result<Tensor<4>> {
    let array = npy::read(path)?;
    let shape: [usize; 4] = array
        .shape
        .as_slice()
        .try_into()
        .map_err(|_| HearthError::Npy {
            path: path.to_path_buf(),
            reason: format!("expected a 4-d NCHW array, got shape {:?}", array.shape),
        })?;
    if shape[1] != 3 || shape[2] < MIN_INPUT_SIZE || shape[3] < MIN_INPUT_SIZE || shape[0] == 0 {
        return Err(HearthError::Npy {
            path: path.to_path_buf(),
            reason: format!(
                "expected [N>=1, 3, H>={MIN_INPUT_SIZE}, W>={MIN_INPUT_SIZE}], got {shape:?}"
            ),
        });
    }
    Ok(Tensor::from_data(
        TensorData::new(array.data, shape),
        device,
    ))
}

/// The `k` best (class, probability) of each row.
/// How a low-precision pass's logits compare with an f32 pass's over the same inputs
/// (`hearth predict --precision`): the largest difference, the largest |logit| for scale, how
/// many inputs keep their top-1 class, and the time of each pass.
#[derive(Debug, Clone)]
pub struct PrecisionGap {
    /// The low precision's name (`bf16`, `fp16`).
    pub precision: &'static str,
    pub largest_gap: f32,
    pub largest_logit: f32,
    pub same_top1: usize,
    pub inputs: usize,
    pub low_secs: f64,
    pub f32_secs: f64,
}

impl PrecisionGap {
    /// An empty comparison of `dtype` against f32.
    pub fn new(dtype: burn::tensor::FloatDType) -> Self {
        Self {
            precision: match dtype {
                burn::tensor::FloatDType::BF16 => "bf16",
                burn::tensor::FloatDType::F16 => "fp16",
                _ => "f32",
            },
            largest_gap: 0.0,
            largest_logit: 0.0,
            same_top1: 0,
            inputs: 0,
            low_secs: 0.0,
            f32_secs: 0.0,
        }
    }

    /// Adds a batch: its `low` and `reference` (f32) logits, rows of `classes`.
    pub fn add(&mut self, low: &[f32], reference: &[f32], classes: usize) {
        self.largest_logit = reference
            .iter()
            .fold(self.largest_logit, |m, v| m.max(v.abs()));
        self.largest_gap = low
            .iter()
            .zip(reference)
            .fold(self.largest_gap, |m, (a, b)| m.max((a - b).abs()));
        let top1 = |row: &[f32]| {
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                    if x > best.1 { (i, x) } else { best }
                })
                .0
        };
        let k = classes.max(1);
        for (a, b) in low.chunks(k).zip(reference.chunks(k)) {
            self.inputs += 1;
            self.same_top1 += usize::from(top1(a) == top1(b));
        }
    }
}

impl std::fmt::Display for PrecisionGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{p} against f32: largest logit difference {:.4} (largest |logit| {:.3}), the same \
             top-1 class for {}/{} input(s); {p} {:.1} ms, f32 {:.1} ms",
            self.largest_gap,
            self.largest_logit,
            self.same_top1,
            self.inputs,
            self.low_secs * 1e3,
            self.f32_secs * 1e3,
            p = self.precision,
        )
    }
}

pub fn top_k(probs: &[f32], classes: usize, k: usize) -> Vec<Vec<(usize, f32)>> {
    probs
        .chunks(classes.max(1))
        .map(|row| {
            let mut idx: Vec<usize> = (0..row.len()).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            idx.into_iter().take(k).map(|i| (i, row[i])).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::top_k;

    #[test]
    fn top_k_orders_each_row() {
        let rows = top_k(&[0.1, 0.7, 0.2, 0.5, 0.1, 0.4], 3, 2);
        assert_eq!(rows[0], vec![(1, 0.7), (2, 0.2)]);
        assert_eq!(rows[1], vec![(0, 0.5), (2, 0.4)]);
    }
}
