//! What every mode (allreduce, elastic, parameter servers, pipeline stages) trains a model
//! against, below all of them, so that they compute the loss and the metrics columns alike:
//!
//! - single-label: cross-entropy (with `--label-smoothing` in training), `accuracy` = the share
//!   of samples whose highest score is their class, and above 5 classes `top5_accuracy`, the
//!   share whose class is among the 5 highest scores;
//! - multi-label (`--labels`): binary cross-entropy on the logits, `accuracy` = burn's Hamming
//!   score (the share of labels right after a sigmoid at 0.5), and `val_auroc` = burn's macro
//!   AUROC over the whole validation set (gathered from every rank that validated a part).

use burn::nn::loss::{BinaryCrossEntropyLossConfig, CrossEntropyLossConfig};
use burn::prelude::*;
use burn_dist::Communicator;

use super::TrainConfig;
use super::scores::ValScores;
use super::targets::Targets;
use super::trainee::{Net, Stream};
use crate::{HearthError, Result};
use burn::optim::GradientsParams;

/// The loss and metrics of a run's classifier.
#[derive(Clone, Copy, Debug)]
pub(super) struct Objective {
    multi_label: bool,
    /// Label smoothing of the training loss (single-label only; validation never smooths).
    smoothing: f32,
    /// The type the model computes in (`--precision`; the loss is always f32).
    precision: super::Precision,
    /// `--recompute`: gradients unit by unit, recomputing each unit's activations.
    recompute: bool,
}

impl Objective {
    pub fn new(cfg: &TrainConfig, multi_label: bool) -> Self {
        Self {
            multi_label,
            smoothing: cfg.optim.label_smoothing,
            precision: cfg.compute.precision,
            recompute: cfg.compute.recompute,
        }
    }

    pub fn multi_label(&self) -> bool {
        self.multi_label
    }

    /// The batch mean of the loss of `logits` against `targets`; `training` applies
    /// `--label-smoothing`.
    pub fn loss(&self, logits: Tensor<2>, targets: &Targets, training: bool) -> Result<Tensor<1>> {
        let device = logits.device();
        match targets {
            Targets::Classes(y) => {
                if logits.dims()[0] != y.dims()[0] {
                    return Err(HearthError::Training(format!(
                        "the model gives {:?} outputs for a batch of {} class indices",
                        logits.dims(),
                        y.dims()[0]
                    )));
                }
                let smoothing = (training && self.smoothing > 0.0).then_some(self.smoothing);
                Ok(CrossEntropyLossConfig::new()
                    .with_smoothing(smoothing)
                    .init(&device)
                    .forward(logits, y.clone()))
            }
            Targets::MultiHot(hot) => {
                if logits.dims() != hot.dims() {
                    return Err(HearthError::Training(format!(
                        "the model gives {:?} outputs for multi-hot labels of {:?}",
                        logits.dims(),
                        hot.dims()
                    )));
                }
                Ok(BinaryCrossEntropyLossConfig::new()
                    .with_logits(true)
                    .init(&device)
                    .forward(logits, hot.clone().int()))
            }
            // Cross-entropy and binary cross-entropy are linear in the target: the mixed
            // target's loss is the weighted sum of the two sides' (label smoothing included,
            // as timm smooths and then mixes).
            Targets::Mixed { own, rolled, lam } => {
                let a = self.loss(logits.clone(), own, training)?;
                let b = self.loss(logits, rolled, training)?;
                Ok(a.mul_scalar(*lam) + b.mul_scalar(1.0 - *lam))
            }
        }
    }

    /// The batch's right answers in samples: samples whose highest score is their class, or
    /// (multi-label) labels right after a sigmoid at 0.5, divided by the class count, so that
    /// `hits / samples` is the accuracy column in both cases.
    pub fn hits(&self, logits: &Tensor<2>, targets: &Targets) -> f64 {
        match targets {
            Targets::Classes(y) => logits
                .clone()
                .argmax(1)
                .flatten::<1>(0, 1)
                .equal(y.clone())
                .int()
                .sum()
                .into_scalar::<i64>() as f64,
            Targets::MultiHot(hot) => {
                let k = hot.dims()[1].max(1);
                // sigmoid(x) > 0.5 exactly where x > 0.
                let right = logits
                    .clone()
                    .greater_elem(0.0)
                    .equal(hot.clone().greater_elem(0.5))
                    .int()
                    .sum()
                    .into_scalar::<i64>();
                right as f64 / k as f64
            }
            // A mixed batch's accuracy is against its soft targets: each side's hits weighed.
            Targets::Mixed { own, rolled, lam } => {
                let lam = f64::from(*lam);
                lam * self.hits(logits, own) + (1.0 - lam) * self.hits(logits, rolled)
            }
        }
    }

    /// The batch's samples whose class is among the 5 highest scores (burn's top-5 accuracy
    /// in samples): `None` for multi-label targets and for 5 classes or fewer, where it would
    /// always be every sample.
    pub fn top5_hits(&self, logits: &Tensor<2>, targets: &Targets) -> Option<f64> {
        let y = match targets {
            Targets::Classes(y) => y,
            Targets::MultiHot(_) => return None,
            Targets::Mixed { own, rolled, lam } => {
                let lam = f64::from(*lam);
                let (a, b) = (
                    self.top5_hits(logits, own)?,
                    self.top5_hits(logits, rolled)?,
                );
                return Some(lam * a + (1.0 - lam) * b);
            }
        };
        let [n, classes] = logits.dims();
        if classes <= 5 || n == 0 {
            return None;
        }
        // A sample's class is in its top 5 where fewer than 5 scores exceed the class's.
        let own = logits.clone().gather(1, y.clone().reshape([n, 1]));
        let above = logits
            .clone()
            .greater(own.expand([n, classes]))
            .int()
            .sum_dim(1)
            .flatten::<1>(0, 1);
        Some(above.lower_elem(5).int().sum().into_scalar::<i64>() as f64)
    }
}

/// Adds `train_top5_accuracy` and `val_top5_accuracy` (percent) to an epoch's row where top-5
/// says something: single-label targets over more than 5 classes (with 5 or fewer it is always
/// 100%). `train` and `val` are (samples with their class among the 5 highest scores,
/// samples); every mode calls this, so the columns are the same in each.
pub(super) fn insert_top5(
    row: &mut std::collections::BTreeMap<String, f64>,
    classes: usize,
    multi_label: bool,
    train: (f64, f64),
    val: (f64, f64),
) {
    if multi_label || classes <= 5 {
        return;
    }
    let pct = |(hits, n): (f64, f64)| if n > 0.0 { 100.0 * hits / n } else { f64::NAN };
    row.insert("train_top5_accuracy".into(), pct(train));
    row.insert("val_top5_accuracy".into(), pct(val));
}

/// What a pass over batches adds up: loss x samples, right answers (in samples, see
/// [`Objective::hits`]) and samples.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sums {
    pub loss: f64,
    pub hits: f64,
    pub samples: f64,
    /// Samples with their class among the 5 highest scores ([`Objective::top5_hits`]; 0 where
    /// it does not apply).
    pub top5: f64,
}

impl Sums {
    pub fn add(&mut self, other: Sums) {
        self.loss += other.loss;
        self.hits += other.hits;
        self.samples += other.samples;
        self.top5 += other.top5;
    }

    /// The mean loss (NaN before any sample).
    pub fn mean_loss(&self) -> f64 {
        if self.samples > 0.0 {
            self.loss / self.samples
        } else {
            f64::NAN
        }
    }

    /// The accuracy column in percent (NaN before any sample).
    pub fn accuracy(&self) -> f64 {
        if self.samples > 0.0 {
            100.0 * self.hits / self.samples
        } else {
            f64::NAN
        }
    }

    /// The sums of every rank of `comm` (each calls it).
    pub fn all_reduce(self, comm: &Communicator) -> Result<Self> {
        let mut v = [
            self.loss as f32,
            self.hits as f32,
            self.samples as f32,
            self.top5 as f32,
        ];
        comm.allreduce(&mut v, burn_dist::ReduceOp::Sum)?;
        Ok(Self {
            loss: f64::from(v[0]),
            hits: f64::from(v[1]),
            samples: f64::from(v[2]),
            top5: f64::from(v[3]),
        })
    }
}

/// A validation pass: its sums and, for multi-label targets, the macro AUROC in percent.
pub(super) struct Validation {
    pub sums: Sums,
    pub auroc: Option<f64>,
}

impl Objective {
    /// One training batch through `model` (autodiff): the gradients of `weight` times the
    /// batch's mean loss, and the batch's sums (of the unweighted loss); the batch's outputs
    /// kept in `scores` when given (a multi-label epoch's `train_auroc`).
    pub fn train_batch_scored<M: Net>(
        &self,
        model: &M,
        input: M::Input,
        targets: &Targets,
        weight: f32,
        scores: Option<&mut ValScores>,
    ) -> Result<(GradientsParams, Sums)> {
        self.train_batch_gathered(model, input, targets, weight, scores, None)
    }

    /// [`Self::train_batch_scored`] on ZeRO stage 3's skeleton when `gathering` is given: unit
    /// by unit, each unit's parameters gathered for its passes.
    pub(super) fn train_batch_gathered<M: Net>(
        &self,
        model: &M,
        input: M::Input,
        targets: &Targets,
        weight: f32,
        mut scores: Option<&mut ValScores>,
        gathering: Option<&crate::pipeline::Gathering<'_>>,
    ) -> Result<(GradientsParams, Sums)> {
        let mut sums = Sums::default();
        let mut weighted = |logits: Tensor<2>| -> Result<Tensor<1>> {
            let n = logits.dims()[0] as f64;
            let hits = self.hits(&logits, targets);
            let top5 = self.top5_hits(&logits, targets).unwrap_or(0.0);
            if let Some(scores) = scores.as_deref_mut() {
                scores.push(&logits, targets)?;
            }
            let loss = self.loss(logits, targets, true)?;
            sums = Sums {
                loss: f64::from(loss.clone().into_scalar::<f32>()) * n,
                hits,
                samples: n,
                top5,
            };
            Ok(if weight == 1.0 {
                loss
            } else {
                loss.mul_scalar(weight)
            })
        };
        // `--recompute`, `--overlap`'s exchange installed on this thread (elastic) or stage 3's
        // gathering: unit by unit, each unit's gradients handed over as soon as its backward
        // is over.
        let overlap = burn_dist::overlap::handing_over();
        if self.recompute || overlap || gathering.is_some() {
            let what = if gathering.is_some() {
                "`exchange.zero` 3"
            } else if self.recompute {
                "`compute.recompute`"
            } else {
                "`exchange.overlap`"
            };
            let grads = model
                .unit_gradients(
                    input,
                    self.precision,
                    self.recompute,
                    gathering,
                    &mut weighted,
                )
                .unwrap_or_else(|| {
                    Err(HearthError::InvalidArgument(format!(
                        "{what}: this model has no units to run one by one"
                    )))
                })?;
            return Ok((grads, sums));
        }
        let loss = weighted(model.logits_in(input, self.precision.dtype()))?;
        Ok((GradientsParams::from_grads(loss.backward(), model), sums))
    }

    /// Validates `model` (pass its `valid()` view) on `batches`. With `comm`, each of its ranks
    /// validated a part: the sums and the AUROC are over all the parts (every rank calls it).
    pub fn validate<M: Net>(
        &self,
        model: &M,
        batches: Stream<M::Input>,
        comm: Option<&Communicator>,
    ) -> Result<Validation> {
        let mut sums = Sums::default();
        let mut scores = ValScores::default();
        for batch in batches {
            let (input, targets) = batch?;
            let logits = model.logits_in(input, self.precision.dtype());
            self.score_batch(logits, &targets, &mut sums, &mut scores)?;
        }
        self.combine(sums, scores, comm)
    }

    /// [`Self::validate`] on ZeRO stage 3's skeleton `model`: each batch's forward gathers
    /// one unit's parameters at a time ([`Net::gathered_logits`]). The gathers are collective,
    /// so every rank runs `rounds` forwards (the most batches any rank's share has): a rank
    /// whose `batches` ran out gathers without computing.
    pub fn validate_gathered<M: Net>(
        &self,
        model: &M,
        mut batches: Stream<M::Input>,
        rounds: usize,
        gathering: &crate::pipeline::Gathering<'_>,
        comm: Option<&Communicator>,
    ) -> Result<Validation> {
        let mut sums = Sums::default();
        let mut scores = ValScores::default();
        for round in 0..rounds {
            let (input, targets) = match batches.next() {
                Some(batch) => {
                    let (input, targets) = batch?;
                    (Some(input), Some(targets))
                }
                None => (None, None),
            };
            let logits = model
                .gathered_logits(input, self.precision, gathering)
                .unwrap_or_else(|| Err(super::net::no_units_to_gather()))?;
            match (logits, targets) {
                (Some(logits), Some(targets)) => {
                    self.score_batch(logits, &targets, &mut sums, &mut scores)?;
                }
                (None, None) => {}
                _ => {
                    return Err(HearthError::Training(format!(
                        "validation round {round}: a batch went in and no logits came out"
                    )));
                }
            }
        }
        if batches.next().is_some() {
            return Err(HearthError::Training(format!(
                "validation: this rank's share has more than the {rounds} batches every rank \
                 was to run"
            )));
        }
        self.combine(sums, scores, comm)
    }

    /// One validation batch's loss, hits, top-5 hits and scores added to the sums.
    fn score_batch(
        &self,
        logits: Tensor<2>,
        targets: &Targets,
        sums: &mut Sums,
        scores: &mut ValScores,
    ) -> Result<()> {
        let n = logits.dims()[0] as f64;
        sums.hits += self.hits(&logits, targets);
        sums.top5 += self.top5_hits(&logits, targets).unwrap_or(0.0);
        scores.push(&logits, targets)?;
        let loss = self.loss(logits, targets, false)?;
        sums.loss += f64::from(loss.into_scalar::<f32>()) * n;
        sums.samples += n;
        Ok(())
    }

    /// A validation's sums (and AUROC) over the ranks that validated parts, with `comm`.
    fn combine(
        &self,
        mut sums: Sums,
        mut scores: ValScores,
        comm: Option<&Communicator>,
    ) -> Result<Validation> {
        if let Some(comm) = comm {
            sums = sums.all_reduce(comm)?;
            if self.multi_label {
                scores = scores.gather(comm)?;
            }
        }
        Ok(Validation {
            sums,
            auroc: if self.multi_label {
                scores.auroc()
            } else {
                None
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::scores::tests::{device, hot, logits};

    #[test]
    fn multi_label_hits_are_the_hamming_score_in_samples() {
        let o = Objective {
            precision: crate::train::Precision::Fp32,
            multi_label: true,
            smoothing: 0.0,
            recompute: false,
        };
        // 3 of 4 labels right: 1.5 samples' worth.
        let h = o.hits(
            &logits(&[[1.0, -1.0], [2.0, 3.0]]),
            &hot(&[[1.0, 0.0], [0.0, 1.0]]),
        );
        assert_eq!(h, 1.5);
        let single = o.hits(
            &logits(&[[1.0, -1.0], [2.0, 3.0]]),
            &Targets::Classes(Tensor::from_ints([0, 0], &device())),
        );
        assert_eq!(single, 1.0);
    }

    /// A mixed batch's loss is the soft target's, computed by hand: cross-entropy (smoothed
    /// too, burn's `y (1 - a) + a / k`) and binary cross-entropy against `lam * own +
    /// (1 - lam) * rolled`; its hits are each side's weighed.
    #[test]
    fn a_mixed_batchs_loss_is_the_soft_targets_and_its_hits_are_weighed() {
        let rows = [[2.0f32, -1.0], [0.5, 1.5]];
        let lam = 0.7f32;
        let mixed = |own: Targets, rolled: Targets| Targets::Mixed {
            own: Box::new(own),
            rolled: Box::new(rolled),
            lam,
        };
        let classes = |c: [i32; 2]| Targets::Classes(Tensor::from_ints(c, &device()));
        for smoothing in [0.0f32, 0.1] {
            let o = Objective {
                precision: crate::train::Precision::Fp32,
                multi_label: false,
                smoothing,
                recompute: false,
            };
            // Sample 0 is class 0 and sample 1 class 1; rolled by one: 1, then 0.
            let t = mixed(classes([0, 1]), classes([1, 0]));
            let got = o
                .loss(logits(&rows), &t, true)
                .unwrap()
                .into_scalar::<f32>();
            let mut want = 0.0f32;
            for (i, r) in rows.iter().enumerate() {
                let lse = (r[0].exp() + r[1].exp()).ln();
                let (a, b) = (i, 1 - i);
                for (c, x) in r.iter().enumerate() {
                    let y = |k: usize| {
                        (1.0 - smoothing) * if c == k { 1.0 } else { 0.0 } + smoothing / 2.0
                    };
                    want -= (lam * y(a) + (1.0 - lam) * y(b)) * (x - lse);
                }
            }
            want /= 2.0;
            assert!(
                (got - want).abs() < 1e-5,
                "smoothing {smoothing}: {got} against {want}"
            );
            // Sample 0 is right (class 0 scores highest) and sample 1 right too: all of
            // `own`'s hits, none of `rolled`'s.
            let hits = o.hits(&logits(&rows), &t);
            assert!((hits - 2.0 * f64::from(lam)).abs() < 1e-6, "{hits}");
        }
        let o = Objective {
            precision: crate::train::Precision::Fp32,
            multi_label: true,
            smoothing: 0.0,
            recompute: false,
        };
        let own = [[1.0f32, 0.0], [1.0, 1.0]];
        let rolled = [[1.0f32, 1.0], [1.0, 0.0]];
        let t = mixed(hot(&own), hot(&rolled));
        let got = o
            .loss(logits(&rows), &t, true)
            .unwrap()
            .into_scalar::<f32>();
        let mut want = 0.0f32;
        for i in 0..2 {
            for c in 0..2 {
                let soft = lam * own[i][c] + (1.0 - lam) * rolled[i][c];
                let p = 1.0 / (1.0 + (-rows[i][c]).exp());
                want -= soft * p.ln() + (1.0 - soft) * (1.0 - p).ln();
            }
        }
        want /= 4.0;
        assert!((got - want).abs() < 1e-5, "BCE: {got} against {want}");
    }
}
