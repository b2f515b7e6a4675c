//! ZeRO stage 3's start on rank 0 from a torchvision `.pth` or `.safetensors` given to
//! `model.weights`: the file's tensors handed out a bucket's window at a time
//! ([`WeightsValues`]), each read whole once, as stored, and let go once its segments are out.
//!
//! Why: rank 0 made each parameter from the file as its first bucket came, and a linear
//! layer's weight, `[out, in]` in the file and `[in, out]` in Burn, was then held twice, read
//! and transposed: VGG-16's 411 MB first classifier weight made rank 0's start the largest
//! moment of a 4-rank run (859 MB live, where every rank's steps peak at 567). Here each
//! window is cut from the bytes as read, transposed as it is cut.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::{Module, ParamId};
use burn_dist::flat::module::{trainable_ids, trainable_names, trainable_values_in};
use burn_dist::zero::StepSource;
use hearth_models::FileTensor;

use crate::HearthError;

/// Where one trainable tensor's values come from.
enum Origin {
    /// The weights file: its bytes once read (`None` before).
    File {
        tensor: FileTensor,
        bytes: Option<Vec<u8>>,
    },
    /// The model's own values (a new head), drawn before the hand-out in the model's order.
    Drawn(Vec<f32>),
    /// Let go: its segments are out.
    Released,
}

/// The trainable values of a model loaded from a torchvision file, in the model's trainable
/// order: the file's tensors read as their windows are asked for, the others (a new head)
/// taken from the model.
pub struct WeightsValues {
    path: PathBuf,
    tensors: Vec<Origin>,
    /// Each tensor's first value in the flat vector, and the end.
    offsets: Vec<usize>,
    /// Why a read failed (the values then read as zeros: see [`Self::failure`]).
    failed: Option<String>,
}

impl WeightsValues {
    /// The values of `model`, whose parameters `files` names are to be read from the file at
    /// `path` (a deferred load's [`hearth_models::DeferredReads::file_tensors`]); the others
    /// are made now, in the model's order (under the seed lock the caller holds: they are the
    /// values the model would have drawn as it was handed out, nothing else drawing between).
    pub fn new<M: Module>(model: &M, files: &HashMap<ParamId, FileTensor>, path: &Path) -> Self {
        let names = trainable_names(model);
        let mut tensors = Vec::with_capacity(names.len());
        let mut offsets = vec![0];
        for (id, (_, len)) in trainable_ids(model).iter().zip(&names) {
            let at = offsets[offsets.len() - 1];
            tensors.push(match files.get(id) {
                Some(t) if t.len() == *len => Origin::File {
                    tensor: t.clone(),
                    bytes: None,
                },
                _ => Origin::Drawn(trainable_values_in(model, at..at + len)),
            });
            offsets.push(at + len);
        }
        Self {
            path: path.to_path_buf(),
            tensors,
            offsets,
            failed: None,
        }
    }

    /// Why a read failed, if one did (the file changed after the load checked it): the values
    /// handed out are then wrong, and the run must stop.
    pub fn failure(&self) -> Option<HearthError> {
        self.failed.as_ref().map(|e| {
            HearthError::Training(format!(
                "reading the weights file {}: {e}",
                self.path.display()
            ))
        })
    }

    /// Values `range` of tensor `k` (indices within the tensor).
    fn read(&mut self, k: usize, range: Range<usize>) -> Vec<f32> {
        let n = range.len();
        let outcome = match &mut self.tensors[k] {
            Origin::Drawn(values) => values
                .get(range)
                .map(<[f32]>::to_vec)
                .ok_or_else(|| format!("tensor {k} has fewer values than asked for")),
            Origin::Released => Err(format!("tensor {k} was asked for after it was let go")),
            Origin::File { tensor, bytes } => {
                if bytes.is_none() {
                    match tensor.read() {
                        Ok(b) => *bytes = Some(b),
                        Err(e) => {
                            // Read once: a tensor that failed stays failed.
                            let _ = self.failed.get_or_insert(e.to_string());
                            return vec![0.0; n];
                        }
                    }
                }
                let b = bytes.as_deref().unwrap_or_default();
                tensor
                    .window(b, range)
                    .ok_or_else(|| format!("tensor '{}' read {} bytes", tensor.key(), b.len()))
            }
        };
        match outcome {
            Ok(values) => values,
            Err(e) => {
                self.failed.get_or_insert(e);
                vec![0.0; n]
            }
        }
    }
}

impl StepSource for WeightsValues {
    /// Never asked for: the weights are read to start, not to step.
    fn grads(&mut self, _tensors: Range<usize>) -> Vec<f32> {
        Vec::new()
    }

    fn values(&mut self, range: Range<usize>) -> Vec<f32> {
        let offsets = std::mem::take(&mut self.offsets);
        let out = super::values::cut(&offsets, range, |k, r| self.read(k, r));
        self.offsets = offsets;
        out
    }

    fn release(&mut self, tensors: Range<usize>) {
        let end = tensors.end.min(self.tensors.len());
        for t in &mut self.tensors[tensors.start.min(end)..end] {
            *t = Origin::Released;
        }
    }

    fn value_count(&mut self) -> Option<usize> {
        Some(self.offsets[self.offsets.len() - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::prelude::Device;
    use burn_dist::flat::module::trainable_values;
    use hearth_models::{
        HeadConfig, LoadOptions, export_torchvision_pth, load_torchvision_deferred,
    };

    /// A `.pth`'s values cut window by window (across tensors, a linear weight transposed) are
    /// the values the deferred parameters themselves make, the new head's among them; a tensor
    /// let go, or a file cut short after the load, reads as zeros with the failure named.
    #[test]
    fn a_pth_s_values_are_cut_a_window_at_a_time_as_its_parameters_make_them() {
        let dir = tempfile::tempdir().unwrap();
        let pth = dir.path().join("pretrained.pth");
        let config = crate::train::model_config("resnet-mini", 5).unwrap();
        export_torchvision_pth(&config.init(&Device::flex()).unwrap(), &pth).unwrap();
        // Trainable: an autodiff device's parameters.
        let device = Device::flex().autodiff();
        let load = || {
            let options = LoadOptions {
                skip_head: true,
                ..Default::default()
            };
            let (model, _, reads) =
                load_torchvision_deferred(config.init(&device).unwrap(), &pth, &options).unwrap();
            let model = model.replace_head(HeadConfig::new(3), &device).unwrap();
            (model, reads)
        };
        let (model, reads) = load();
        let files = reads.file_tensors().expect("every deferred tensor read so");
        let mut v = WeightsValues::new(&model, files, &pth);
        // What the parameters make (the head's drawn already by `new`, the rest read now).
        let whole = trainable_values(&model);
        assert_eq!(v.value_count(), Some(whole.len()));
        let mut got = Vec::new();
        for start in (0..whole.len()).step_by(7) {
            got.extend(v.values(start..(start + 7).min(whole.len())));
        }
        assert_eq!(got, whole);
        assert!(v.failure().is_none());

        // Let go, then asked for: zeros and a failure naming the file.
        v.release(0..1);
        assert_eq!(v.values(0..3), vec![0.0; 3]);
        let e = v.failure().unwrap().to_string();
        assert!(e.contains("let go") && e.contains("pretrained.pth"), "{e}");

        // A file cut short after the load checked it: zeros and the failure, no panic.
        let (model, reads) = load();
        let mut v = WeightsValues::new(&model, reads.file_tensors().unwrap(), &pth);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&pth)
            .unwrap()
            .set_len(1000)
            .unwrap();
        // The first tensor (the stem's weight) is the file's.
        assert_eq!(v.values(0..4), vec![0.0; 4]);
        let e = v.failure().expect("a failed read is reported").to_string();
        assert!(e.contains("pretrained.pth"), "{e}");
    }

    /// A linear layer's weight, `[out, in]` in the file: its windows are the `[in, out]`
    /// parameter's values, in its row-major order.
    #[test]
    fn a_linear_weight_is_cut_transposed() {
        let dir = tempfile::tempdir().unwrap();
        let pth = dir.path().join("vgg.pth");
        let config = crate::train::model_config("vgg-mini", 4).unwrap();
        export_torchvision_pth(&config.init(&Device::flex()).unwrap(), &pth).unwrap();
        let device = Device::flex().autodiff();
        let (model, _, reads) =
            load_torchvision_deferred(config.init(&device).unwrap(), &pth, &Default::default())
                .unwrap();
        let files = reads.file_tensors().expect("every deferred tensor read so");
        assert!(
            files
                .values()
                .any(|t| format!("{t:?}").contains("transposed: Some"))
        );
        let mut v = WeightsValues::new(&model, files, &pth);
        let whole = trainable_values(&model);
        let mut got = Vec::new();
        for start in (0..whole.len()).step_by(5) {
            got.extend(v.values(start..(start + 5).min(whole.len())));
        }
        assert_eq!(got, whole);
    }
}
