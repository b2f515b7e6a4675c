//! The training and validation steps of an image classifier, for burn-train's Learner.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use hearth_models::Classifier;

use super::data::ImageBatch;

/// A classifier with its loss: cross-entropy with optional label smoothing.
#[derive(Module, Debug)]
pub struct SingleLabel {
    pub model: Classifier,
    /// Label smoothing in [0, 1) (0: none).
    #[module(skip)]
    pub smoothing: f32,
}

impl SingleLabel {
    pub fn forward_classification(&self, batch: ImageBatch) -> ClassificationOutput {
        let device = batch.images.device();
        let logits = self.model.forward(batch.images);
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
        let out = self.forward_classification(batch);
        TrainOutput::new(self, out.loss.backward(), out)
    }
}

impl InferenceStep for SingleLabel {
    type Input = ImageBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: ImageBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}
