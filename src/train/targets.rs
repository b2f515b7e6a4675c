//! A batch's targets (class indices or multi-hot rows), below the trainees that make them and
//! the objective that scores them.

use burn::prelude::*;

use crate::{HearthError, Result};

/// A batch's targets.
#[derive(Clone, Debug)]
pub enum Targets {
    /// Class indices `[n]`.
    Classes(Tensor<1, Int>),
    /// Multi-hot rows `[n, classes]` (0 or 1).
    MultiHot(Tensor<2>),
}

impl Targets {
    /// Samples `start..start + len` (a micro-batch).
    pub fn narrow(&self, start: usize, len: usize) -> Self {
        match self {
            Self::Classes(t) => Self::Classes(t.clone().narrow(0, start, len)),
            Self::MultiHot(t) => Self::MultiHot(t.clone().narrow(0, start, len)),
        }
    }
}

/// A loader batch's images and targets.
pub(crate) fn targets(
    batch: hearth_datasets::Batch,
    multi_label: bool,
) -> Result<(Tensor<4>, Targets)> {
    let targets = match (multi_label, batch.multi_hot, batch.classes) {
        (true, Some(hot), _) => Targets::MultiHot(hot),
        (false, _, Some(classes)) => Targets::Classes(classes),
        (true, None, _) => {
            return Err(HearthError::Training(
                "a multi-label run's loader gave no multi-hot labels".into(),
            ));
        }
        (false, _, None) => {
            return Err(HearthError::Training(
                "the loader gave no class indices".into(),
            ));
        }
    };
    Ok((batch.images, targets))
}
