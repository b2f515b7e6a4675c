//! A pipeline stage of Hearth's models: consecutive units of one model as a
//! [`PipelineStage`] (below the step's unit-by-unit passes and stage 3's gathered ones, which
//! both run units as stages).

use burn::module::Module;
use burn_dist::pipeline::{Activation, PipelineStage};
use hearth_models::stages::{Unit, UnitOutput};

/// A pipeline stage: consecutive units of one model.
#[derive(Module, Debug)]
pub struct StageModel {
    pub units: Vec<Unit>,
    /// The type the stage computes in (`--precision`): its input is cast to it and its output
    /// back to f32, so activations and their gradients travel between stages in f32 and the
    /// parameters stay f32.
    #[module(skip)]
    pub precision: crate::train::Precision,
}

impl StageModel {
    /// Units in f32.
    pub fn new(units: Vec<Unit>) -> Self {
        Self {
            units,
            precision: crate::train::Precision::Fp32,
        }
    }
}

impl PipelineStage for StageModel {
    fn forward(&self, x: Activation) -> burn_dist::Result<Activation> {
        use burn::tensor::FloatDType;
        let low = self.precision.is_low();
        let mut x = x.rank4("a model stage's input")?;
        if low {
            x = x.cast(self.precision.dtype());
        }
        for (i, unit) in self.units.iter().enumerate() {
            match unit.forward(x) {
                UnitOutput::Features(f) => x = f,
                UnitOutput::Logits(l) if i + 1 == self.units.len() => {
                    return Ok(Activation::Rank2(if low {
                        l.cast(FloatDType::F32)
                    } else {
                        l
                    }));
                }
                UnitOutput::Logits(_) => {
                    return Err(burn_dist::DistError::Config(format!(
                        "unit {i} of a stage of {} produces logits: the head must end its stage",
                        self.units.len()
                    )));
                }
            }
        }
        Ok(Activation::Rank4(if low {
            x.cast(FloatDType::F32)
        } else {
            x
        }))
    }

    /// The forward again with batch norm's running statistics left alone (they moved in the
    /// first pass).
    fn forward_again(&self, x: Activation) -> burn_dist::Result<Activation> {
        hearth_kernels::norm::replaying(|| self.forward(x))
    }

    /// A feature map (`[batch, channels, h, w]`) with the channels of the first unit.
    fn accepts(&self, dims: &[usize]) -> std::result::Result<(), String> {
        let Some(first) = self.units.first() else {
            return Ok(());
        };
        let channels = first.in_channels();
        if dims.len() == 4 && dims[1] == channels {
            Ok(())
        } else {
            Err(format!(
                "a [batch, {channels}, height, width] feature map (its first unit is a {})",
                first.kind()
            ))
        }
    }
}
