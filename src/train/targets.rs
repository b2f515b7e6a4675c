//! A batch's targets (class indices or multi-hot rows), below the trainees that make them and
//! the objective that scores them.

use burn::prelude::*;
use hearth_datasets::mix::{Mixing, roll};

use crate::{HearthError, Result};

/// A batch's targets.
#[derive(Clone, Debug)]
pub enum Targets {
    /// Class indices `[n]`.
    Classes(Tensor<1, Int>),
    /// Multi-hot rows `[n, classes]` (0 or 1).
    MultiHot(Tensor<2>),
    /// A mixed batch (mixup, cutmix): each sample's own targets weigh `lam` and those of the
    /// sample before it in the batch (`rolled`: row `i` holds row `i - 1`'s, row 0 the
    /// last's) `1 - lam`. Losses and hits are the weighted sums of the two sides' (the soft
    /// target's, since both are linear in the target).
    Mixed {
        own: Box<Targets>,
        rolled: Box<Targets>,
        lam: f32,
    },
}

impl Targets {
    /// Samples `start..start + len` (a micro-batch).
    pub fn narrow(&self, start: usize, len: usize) -> Self {
        match self {
            Self::Classes(t) => Self::Classes(t.clone().narrow(0, start, len)),
            Self::MultiHot(t) => Self::MultiHot(t.clone().narrow(0, start, len)),
            Self::Mixed { own, rolled, lam } => Self::Mixed {
                own: Box::new(own.narrow(start, len)),
                rolled: Box::new(rolled.narrow(start, len)),
                lam: *lam,
            },
        }
    }

    /// The batch's samples.
    pub fn len(&self) -> usize {
        match self {
            Self::Classes(t) => t.dims()[0],
            Self::MultiHot(t) => t.dims()[0],
            Self::Mixed { own, .. } => own.len(),
        }
    }

    /// Whether the batch has no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// These targets mixed with the batch rolled by one, `lam` on their own side.
    fn mixed(self, lam: f32) -> Self {
        let rolled = match &self {
            Self::Classes(t) => Self::Classes(roll(t.clone())),
            Self::MultiHot(t) => Self::MultiHot(roll(t.clone())),
            Self::Mixed { .. } => return self,
        };
        Self::Mixed {
            own: Box::new(self),
            rolled: Box::new(rolled),
            lam,
        }
    }
}

/// How a run mixes its training batches (`data.mixup`, `data.cutmix`): the settings and the
/// run's seed, from which each batch's draw follows.
#[derive(Debug, Clone)]
pub(crate) struct BatchMixing {
    pub mixing: Mixing,
    pub seed: u64,
}

impl BatchMixing {
    /// `None` where the run mixes nothing.
    pub fn new(mixing: Mixing, seed: u64) -> Option<Self> {
        mixing.on().then_some(Self { mixing, seed })
    }

    /// A training loader batch of epoch `epoch` (from 0) as (images, targets), mixed by its
    /// draw: the same on every rank and stage that loads the same batch.
    pub fn targets(
        &self,
        batch: hearth_datasets::Batch,
        multi_label: bool,
        epoch: u64,
    ) -> Result<(Tensor<4>, Targets)> {
        let [_, _, h, w] = batch.images.dims();
        let draw = self.mixing.draw(self.seed, epoch, &batch.indices, h, w);
        let (images, targets) = targets(batch, multi_label)?;
        Ok(match draw {
            Some(m) => (m.images(images), targets.mixed(m.lam() as f32)),
            None => (images, targets),
        })
    }
}

/// A training loader batch as (images, targets), mixed where `mixing` says. Every mode takes
/// each training step's batch through here, so this also tells the allocator that a step ended
/// (large blocks no step asked for since go back to the kernel: [`crate::alloc::step_done`]).
pub(crate) fn train_targets(
    batch: hearth_datasets::Batch,
    multi_label: bool,
    mixing: Option<&BatchMixing>,
    epoch: u64,
) -> Result<(Tensor<4>, Targets)> {
    crate::alloc::step_done();
    match mixing {
        Some(m) => m.targets(batch, multi_label, epoch),
        None => targets(batch, multi_label),
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
