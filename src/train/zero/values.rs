//! ZeRO stage 3's resume on rank 0: the checkpoint's trainable values read from the file a
//! bucket's window at a time as rank 0 hands them out ([`CheckpointValues`]), and its other
//! tensors (batch norm's running statistics) loaded into the skeleton.
//!
//! Why: rank 0 loaded the whole checkpoint into its model and handed the values out from it,
//! each tensor read whole from the file at its first bucket: VGG-16's 411 MB first classifier
//! weight beside the 403 MB rank 0 holds made it the largest rank of a resumed run (819 MB
//! live at 4 ranks, where the others peaked at 567). A checkpoint's tensors are windows of the
//! file (burn-pack's reader), and a window of a window reads only its own bytes.

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::store::{ModuleRecord, burn_pack};
use burn::tensor::{Bytes, DType};
use burn_dist::zero::StepSource;

use crate::{HearthError, Result};

/// The trainable values of a checkpoint file, in the trainable order of the model it was
/// written from, read a window at a time ([`StepSource::values`]).
pub struct CheckpointValues {
    path: PathBuf,
    /// Each trainable tensor's bytes in the file (empty once let go), in order.
    tensors: Vec<Bytes>,
    /// Each tensor's first value in the flat vector, and the end.
    offsets: Vec<usize>,
    /// Why a read failed (the values then read as zeros: see [`Self::failure`]).
    failed: Option<String>,
}

impl CheckpointValues {
    /// Opens checkpoint `path` of a model whose trainable tensors are `names` (module path,
    /// number of values: `burn_dist::flat::module::trainable_names`): those tensors read
    /// later, the file's others as a record to load into the model (`allow_partial`: the
    /// trainable tensors are not in it). An error names the file and what is wrong: a
    /// trainable tensor missing, of another length or not f32, a file cut short.
    pub fn open(path: &Path, names: &[(String, usize)]) -> Result<(Self, ModuleRecord)> {
        let bad = |reason: String| {
            HearthError::Training(format!("checkpoint {}: {reason}", path.display()))
        };
        let tensors = burn_pack::Reader::from_file_exact(path)
            .and_then(burn_pack::Reader::into_tensors)
            .map_err(|e| bad(e.to_string()))?;
        let mut found: std::collections::BTreeMap<String, burn_pack::Tensor> = tensors
            .into_iter()
            .map(|t| (module_path(&t.name), t))
            .collect();
        let mut out = Vec::with_capacity(names.len());
        let mut offsets = vec![0];
        for (name, len) in names {
            let t = found
                .remove(&module_path(name))
                .ok_or_else(|| bad(format!("no tensor '{name}'")))?;
            if t.dtype != DType::F32 || t.shape.num_elements() != *len {
                return Err(bad(format!(
                    "'{name}' is {:?} {:?}, where the model's is {len} f32 values",
                    t.dtype,
                    t.shape.to_vec()
                )));
            }
            out.push(t.into_bytes().map_err(|e| bad(e.to_string()))?);
            offsets.push(offsets[offsets.len() - 1] + len);
        }
        // What does not train (batch norm's running statistics): small, loaded whole.
        let rest: Vec<burn_pack::Tensor> = found.into_values().collect();
        let rest = burn_pack::Writer::new(rest)
            .into_bytes()
            .map_err(|e| bad(e.to_string()))?;
        let record = ModuleRecord::from_bytes(rest)
            .map_err(|e| bad(e.to_string()))?
            .allow_partial(true);
        let values = Self {
            path: path.to_path_buf(),
            tensors: out,
            offsets,
            failed: None,
        };
        Ok((values, record))
    }

    /// Why a read failed, if one did (an I/O error after the file was opened): the values
    /// handed out are then wrong, and the run must stop.
    pub fn failure(&self) -> Option<HearthError> {
        self.failed.as_ref().map(|e| {
            HearthError::Training(format!(
                "reading the checkpoint {}: {e}",
                self.path.display()
            ))
        })
    }

    /// Values `range` of tensor `k` (indices within the tensor), read from the file.
    fn read(&mut self, k: usize, range: Range<usize>) -> Vec<f32> {
        let n = range.len();
        let size = DType::F32.size();
        let window = self.tensors[k].view(range.start * size, range.end * size);
        let read = match &window {
            Ok(w) => w.read(Default::default()).map_err(|e| e.to_string()),
            Err(e) => Err(format!(
                "tensor {k} was let go or read whole already ({e:?})"
            )),
        };
        match read {
            Ok(bytes) => bytes
                .chunks_exact(size)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Err(e) => {
                self.failed.get_or_insert(e);
                vec![0.0; n]
            }
        }
    }
}

/// Values `range` of a flat vector of tensors whose first values are at `offsets` (and the
/// end after the last), each tensor's part read by `read(tensor, range within it)`.
pub(super) fn cut(
    offsets: &[usize],
    range: Range<usize>,
    mut read: impl FnMut(usize, Range<usize>) -> Vec<f32>,
) -> Vec<f32> {
    let total = offsets.last().copied().unwrap_or(0);
    let (start, end) = (range.start.min(total), range.end.min(total));
    let mut out = Vec::with_capacity(end.saturating_sub(start));
    // The first tensor that ends after `start`, and each after it that `range` reaches.
    let first = offsets.partition_point(|&o| o <= start).saturating_sub(1);
    for k in first..offsets.len().saturating_sub(1) {
        let (a, b) = (offsets[k], offsets[k + 1]);
        if a >= end {
            break;
        }
        let (from, to) = (start.max(a) - a, end.min(b) - a);
        if from < to {
            out.extend(read(k, from..to));
        }
    }
    out
}

/// A module path without empty parts (Burn's visitor may name a level "").
fn module_path(name: &str) -> String {
    name.split('.')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(".")
}

impl StepSource for CheckpointValues {
    /// Never asked for: a checkpoint is read to start, not to step.
    fn grads(&mut self, _tensors: Range<usize>) -> Vec<f32> {
        Vec::new()
    }

    fn values(&mut self, range: Range<usize>) -> Vec<f32> {
        let offsets = std::mem::take(&mut self.offsets);
        let out = cut(&offsets, range, |k, r| self.read(k, r));
        self.offsets = offsets;
        out
    }

    fn release(&mut self, tensors: Range<usize>) {
        for t in &mut self.tensors[tensors.start..tensors.end.min(self.offsets.len() - 1)] {
            *t = Bytes::from_bytes_vec(Vec::new());
        }
    }

    fn value_count(&mut self) -> Option<usize> {
        Some(self.offsets[self.offsets.len() - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values of a checkpoint read window by window, across tensors, as the model's own
    /// flat vector has them; the buffers come back as a record; a tensor let go reads as
    /// zeros with the failure named; a missing or mismatched tensor is refused by name.
    #[test]
    fn a_checkpoint_s_values_are_read_a_window_at_a_time_in_the_trainable_order() {
        use burn::module::Module;
        use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
        #[derive(Module, Debug)]
        struct Net {
            fc: Linear,
            norm: BatchNorm,
            out: Linear,
        }
        // Trainable: an autodiff device's parameters.
        let device = burn::prelude::Device::flex().autodiff();
        let net = Net {
            fc: LinearConfig::new(7, 5).init(&device),
            norm: BatchNormConfig::new(5).init(&device),
            out: LinearConfig::new(5, 3).init(&device),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model-1.bpk");
        net.clone().into_record().save(&path).unwrap();
        let names = burn_dist::flat::module::trainable_names(&net);
        let whole = burn_dist::flat::module::trainable_values(&net);
        assert_eq!(names.len(), 6, "{names:?}");
        let (mut v, record) = CheckpointValues::open(&path, &names).unwrap();
        assert_eq!(v.value_count(), Some(whole.len()));
        // Windows of 4 values: tensors start and end inside them.
        let mut got = Vec::new();
        for start in (0..whole.len()).step_by(4) {
            got.extend(v.values(start..(start + 4).min(whole.len())));
        }
        assert_eq!(got, whole);
        assert!(v.values(whole.len()..whole.len() + 1).is_empty());
        assert!(v.failure().is_none());
        // The running statistics, alone in the record.
        assert_eq!(record.len(), 2, "{record:?}");

        // A tensor let go, then read: zeros, and the failure says so.
        v.release(0..1);
        assert_eq!(v.values(0..3), vec![0.0; 3]);
        let e = v.failure().unwrap().to_string();
        assert!(e.contains("let go") && e.contains("model-1.bpk"), "{e}");

        // Another model's names: refused by name.
        let mut wrong = names.clone();
        wrong[1].1 += 1;
        let e = CheckpointValues::open(&path, &wrong)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&wrong[1].0) && e.contains("f32 values"), "{e}");
        wrong[1].0 = "fc.nothing".into();
        let e = CheckpointValues::open(&path, &wrong)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no tensor 'fc.nothing'"), "{e}");
        // A file cut short.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let e = CheckpointValues::open(&path, &names)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("model-1.bpk"), "{e}");
    }
}
