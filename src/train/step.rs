//! The training and validation steps of an image classifier, for burn-train's Learner:
//! [`SingleLabel`] (cross-entropy, optional label smoothing) and [`MultiLabel`] (binary
//! cross-entropy on logits, one sigmoid per class, as CheXNet trains).

use burn::module::Module;
use burn::nn::loss::{BinaryCrossEntropyLossConfig, CrossEntropyLossConfig};
use burn::train::SupervisedTraining;
use burn::train::metric::{
    AccuracyMetric, AurocMetric, ClassReduction, HammingScore, LossMetric, TopKAccuracyMetric,
};
use burn::train::{
    ClassificationOutput, InferenceStep, MultiLabelClassificationOutput, TrainOutput, TrainStep,
};
use hearth_models::Classifier;

use super::data::ImageBatch;
use super::precision::Mixed;

/// Whether a step runs its model unit by unit: `--recompute`, or an overlapped exchange
/// installed on this thread (`--overlap`: each unit's gradients are handed over as soon as
/// they exist).
fn by_units(mixed: &Mixed) -> bool {
    mixed.recompute || burn_dist::overlap::handing_over()
}

/// The training step of `--recompute` or `--overlap` ([`by_units`]): the gradients of
/// `loss(logits)` for `task` (scaled and checked as `mixed` says), with `model` run unit by
/// unit ([`crate::pipeline::unit_gradients`]); the loss and the logits, detached, for the
/// metrics.
fn unit_by_unit<T: Module>(
    task: &T,
    model: &Classifier,
    mixed: &Mixed,
    images: burn::prelude::Tensor<4>,
    loss: impl Fn(burn::prelude::Tensor<2>) -> burn::prelude::Tensor<1>,
) -> (
    burn::optim::GradientsParams,
    burn::prelude::Tensor<1>,
    burn::prelude::Tensor<2>,
) {
    let mut kept = None;
    let grads = mixed.gradients_with(task, |factor| {
        crate::pipeline::unit_gradients(
            task,
            model,
            images,
            mixed.precision,
            mixed.recompute,
            &mut |l| {
                let value = loss(l.clone());
                kept = Some((value.clone().detach(), l.detach()));
                Ok(if factor == 1.0 {
                    value
                } else {
                    value.mul_scalar(factor)
                })
            },
        )
        // A model's own units chained: a failure is a bug, as a shape error in its forward is.
        .unwrap_or_else(|e| panic!("a unit-by-unit step: {e}"))
    });
    let (loss, logits) =
        kept.unwrap_or_else(|| panic!("a unit-by-unit step: the loss was never computed"));
    (grads, loss, logits)
}

/// A trainee the Learner drives: a [`Classifier`] with its loss.
pub trait Task:
    burn::train::LearnerModel
    + TrainStep<Input = ImageBatch>
    + InferenceStep<Input = ImageBatch>
    + Sized
{
    /// Whether the task is multi-label (sigmoid head, BCE, AUROC).
    const MULTI_LABEL: bool;
    fn wrap(model: Classifier, smoothing: f32) -> Self;
    /// The trainee computing in `mixed`'s precision (default f32).
    fn with_mixed(self, mixed: Mixed) -> Self;
    fn mixed(&self) -> &Mixed;
    fn classifier(&self) -> &Classifier;
    fn into_classifier(self) -> Classifier;
    /// Registers the task's metrics (besides learning rate and images/s).
    fn register_metrics(
        training: SupervisedTraining<Self>,
        classes: usize,
    ) -> SupervisedTraining<Self>;
}

/// A classifier with its loss: cross-entropy with optional label smoothing.
#[derive(Module, Debug)]
pub struct SingleLabel {
    pub model: Classifier,
    /// Label smoothing in [0, 1) (0: none).
    #[module(skip)]
    pub smoothing: f32,
    /// The precision steps compute in (f32 parameters either way).
    #[module(skip)]
    pub mixed: Mixed,
}

impl SingleLabel {
    pub fn forward_classification(&self, batch: ImageBatch) -> ClassificationOutput {
        let device = batch.images.device();
        let logits = self
            .model
            .forward_in(batch.images, self.mixed.precision.dtype());
        let smoothing = (self.smoothing > 0.0).then_some(self.smoothing);
        let loss = CrossEntropyLossConfig::new()
            .with_smoothing(smoothing)
            .init(&device)
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl TrainStep for SingleLabel {
    type Input = ImageBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: ImageBatch) -> TrainOutput<ClassificationOutput> {
        if by_units(&self.mixed) {
            let device = batch.images.device();
            let smoothing = (self.smoothing > 0.0).then_some(self.smoothing);
            let loss = CrossEntropyLossConfig::new()
                .with_smoothing(smoothing)
                .init(&device);
            let targets = batch.targets.clone();
            let (grads, loss, logits) =
                unit_by_unit(self, &self.model, &self.mixed, batch.images, |l| {
                    loss.forward(l, targets.clone())
                });
            let item = ClassificationOutput::new(loss, logits, batch.targets);
            return TrainOutput { grads, item };
        }
        let out = self.forward_classification(batch);
        let grads = self.mixed.gradients(self, out.loss.clone());
        TrainOutput { grads, item: out }
    }
}

impl InferenceStep for SingleLabel {
    type Input = ImageBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: ImageBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

impl Task for SingleLabel {
    const MULTI_LABEL: bool = false;
    fn wrap(model: Classifier, smoothing: f32) -> Self {
        Self {
            model,
            smoothing,
            mixed: Mixed::default(),
        }
    }
    fn with_mixed(self, mixed: Mixed) -> Self {
        Self { mixed, ..self }
    }
    fn mixed(&self) -> &Mixed {
        &self.mixed
    }
    fn classifier(&self) -> &Classifier {
        &self.model
    }
    fn into_classifier(self) -> Classifier {
        self.model
    }
    fn register_metrics(
        training: SupervisedTraining<Self>,
        classes: usize,
    ) -> SupervisedTraining<Self> {
        let training = training.metrics((AccuracyMetric::new(), LossMetric::new()));
        // Top-5 says something only with more than 5 classes (with 5 or fewer it is 100%).
        if classes > 5 {
            training
                .metric_train_numeric(TopKAccuracyMetric::new(5))
                .metric_valid_numeric(TopKAccuracyMetric::new(5))
        } else {
            training
        }
    }
}

/// A multi-label classifier: one independent sigmoid per class, binary cross-entropy on the
/// logits (numerically stable), outputs as logits (AUROC ranks them; the Hamming score applies
/// the sigmoid itself).
#[derive(Module, Debug)]
pub struct MultiLabel {
    pub model: Classifier,
    /// The precision steps compute in (f32 parameters either way).
    #[module(skip)]
    pub mixed: Mixed,
}

impl MultiLabel {
    pub fn forward_classification(&self, batch: ImageBatch) -> MultiLabelClassificationOutput {
        let device = batch.images.device();
        let logits = self
            .model
            .forward_in(batch.images, self.mixed.precision.dtype());
        let [_, k] = logits.dims();
        // A single-label set trained as multi-label: its class indices as one-hot rows.
        let targets = match batch.multi_hot {
            Some(hot) => hot.int(),
            None => batch.targets.one_hot::<2>(k),
        };
        let loss = BinaryCrossEntropyLossConfig::new()
            .with_logits(true)
            .init(&device)
            .forward(logits.clone(), targets.clone());
        MultiLabelClassificationOutput::new(loss, logits, targets)
    }
}

impl TrainStep for MultiLabel {
    type Input = ImageBatch;
    type Output = MultiLabelClassificationOutput;

    fn step(&self, batch: ImageBatch) -> TrainOutput<MultiLabelClassificationOutput> {
        if by_units(&self.mixed) {
            let device = batch.images.device();
            let k = self.model.num_classes();
            let targets = match batch.multi_hot {
                Some(hot) => hot.int(),
                None => batch.targets.one_hot::<2>(k),
            };
            let bce = BinaryCrossEntropyLossConfig::new()
                .with_logits(true)
                .init(&device);
            let (grads, loss, logits) =
                unit_by_unit(self, &self.model, &self.mixed, batch.images, |l| {
                    bce.forward(l, targets.clone())
                });
            let item = MultiLabelClassificationOutput::new(loss, logits, targets);
            return TrainOutput { grads, item };
        }
        let out = self.forward_classification(batch);
        let grads = self.mixed.gradients(self, out.loss.clone());
        TrainOutput { grads, item: out }
    }
}

impl InferenceStep for MultiLabel {
    type Input = ImageBatch;
    type Output = MultiLabelClassificationOutput;

    fn step(&self, batch: ImageBatch) -> MultiLabelClassificationOutput {
        self.forward_classification(batch)
    }
}

/// The Hamming score (per-label accuracy after a sigmoid at 0.5): the `accuracy` column of a
/// multi-label run.
fn hamming() -> HammingScore {
    HammingScore::new().with_sigmoid(true)
}

/// Mean of the per-class AUROCs over the epoch (CheXNet's summary number).
fn auroc() -> AurocMetric {
    AurocMetric::multilabel(ClassReduction::Macro)
}

impl Task for MultiLabel {
    const MULTI_LABEL: bool = true;
    fn wrap(model: Classifier, _smoothing: f32) -> Self {
        Self {
            model,
            mixed: Mixed::default(),
        }
    }
    fn with_mixed(self, mixed: Mixed) -> Self {
        Self { mixed, ..self }
    }
    fn mixed(&self) -> &Mixed {
        &self.mixed
    }
    fn classifier(&self) -> &Classifier {
        &self.model
    }
    fn into_classifier(self) -> Classifier {
        self.model
    }
    fn register_metrics(training: SupervisedTraining<Self>, _: usize) -> SupervisedTraining<Self> {
        training.metrics((hamming(), LossMetric::new(), auroc()))
    }
}
