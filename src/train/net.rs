//! The model a custom training mode trains ([`Net`]): a Burn module that maps a batch's input
//! to logits, and Hearth's [`Classifier`] as one, with the unit-by-unit passes that
//! `--recompute`, `--overlap` and ZeRO stage 3 run on it.

use burn::module::Module;
use burn::prelude::*;
use hearth_models::Classifier;

/// A Burn model Hearth's modes can train: any module whose forward pass maps a batch's input
/// to logits `[batch, classes]` (the loss and metrics come from the run: cross-entropy and
/// accuracy, or with multi-label data binary cross-entropy, Hamming score and AUROC).
///
/// ```ignore
/// #[derive(Module, Debug)]
/// struct Mlp { a: Linear, b: Linear }
/// impl hearth::train::Net for Mlp {
///     type Input = Tensor<2>;
///     fn logits(&self, x: Tensor<2>) -> Tensor<2> { self.b.forward(relu(self.a.forward(x))) }
/// }
/// ```
pub trait Net: Module + 'static {
    /// What one batch feeds the model (for an image model, `Tensor<4>`).
    type Input: Send + 'static;
    /// The batch's logits, `[batch, classes]`.
    fn logits(&self, input: Self::Input) -> Tensor<2>;

    /// Whether [`Net::logits_in`] computes in the precision it is asked for. `train_custom`
    /// refuses `precision` bf16 or fp16 for a module that says no (the default: its
    /// [`Net::logits`] runs in f32 whatever the run asks, so the setting would do nothing).
    const MIXED_PRECISION: bool = false;

    /// The logits (in f32) computed in `dtype` (mixed precision: f32 parameters, activations
    /// in `dtype`). By default the module's own [`Net::logits`], in f32. A module that
    /// overrides it casts its input to `dtype`, computes its layers with the precision-aware
    /// layers of [`crate::kernels`] (`linear`, `conv2d`, `norm::batch_norm`: they cast the
    /// f32 parameters to the activation's type on the way in, so gradients and the optimizer
    /// stay f32), casts the logits back to f32, and sets [`Net::MIXED_PRECISION`]:
    ///
    /// ```ignore
    /// impl hearth::train::Net for Mlp {
    ///     type Input = Tensor<2>;
    ///     const MIXED_PRECISION: bool = true;
    ///     fn logits(&self, x: Tensor<2>) -> Tensor<2> { self.logits_in(x, FloatDType::F32) }
    ///     fn logits_in(&self, x: Tensor<2>, dtype: FloatDType) -> Tensor<2> {
    ///         let h = relu(hearth::kernels::linear(&self.a, x.cast(dtype)));
    ///         hearth::kernels::linear(&self.b, h).cast(FloatDType::F32)
    ///     }
    /// }
    /// ```
    ///
    /// fp16's loss scaling and the skipped steps are the run's: the module only computes.
    fn logits_in(&self, input: Self::Input, dtype: burn::tensor::FloatDType) -> Tensor<2> {
        let _ = dtype;
        self.logits(input)
    }

    /// The gradients of `loss(logits)` for this module, computed `precision` unit by unit:
    /// with each unit's activations recomputed in the backward (`recompute`: `--recompute`),
    /// and each unit's gradients handed to the overlapped exchange installed on this thread
    /// if there is one (`--overlap`); with `gathering` (ZeRO stage 3) each unit's parameters
    /// gathered for its passes. `None` (the default) for a module without units, whose runs
    /// refuse these flags.
    #[doc(hidden)]
    fn unit_gradients(
        &self,
        input: Self::Input,
        precision: super::Precision,
        recompute: bool,
        gathering: Option<&crate::pipeline::Gathering<'_>>,
        loss: &mut dyn FnMut(Tensor<2>) -> crate::Result<Tensor<1>>,
    ) -> Option<crate::Result<burn::optim::GradientsParams>> {
        let _ = (input, precision, recompute, gathering, loss);
        None
    }

    /// ZeRO stage 3's validation forward on this module's skeleton: `input`'s logits (f32,
    /// computed in `precision`, no graph) with each unit's parameters gathered for its pass
    /// and let go after it ([`crate::pipeline::gathered_logits`]; `input` `None`: gathers
    /// alone, for a rank with no batch in a round that others have). `None` (the default) for
    /// a module without units, which stage 3 refuses.
    #[doc(hidden)]
    fn gathered_logits(
        &self,
        input: Option<Self::Input>,
        precision: super::Precision,
        gathering: &crate::pipeline::Gathering<'_>,
    ) -> Option<crate::Result<Option<Tensor<2>>>> {
        let _ = (input, precision, gathering);
        None
    }

    /// ZeRO stage 3's checkpoint on this module's skeleton: the units gathered one at a time,
    /// each tensor the skeleton holds empty handed to `each` with its parameter id and a
    /// reader of its bytes, or of each of its pieces in turn
    /// ([`crate::pipeline::gathered_tensors`]). `None` (the default) for
    /// a module without units.
    #[doc(hidden)]
    fn gathered_tensors(
        &self,
        gathering: &crate::pipeline::Gathering<'_>,
        each: &mut dyn FnMut(u64, crate::pipeline::ReadBytes<'_>),
    ) -> Option<crate::Result<()>> {
        let _ = (gathering, each);
        None
    }

    /// Each unit's number of trainable tensors, the units in the order of their tensors in
    /// the module (ZeRO stage 3 gathers a unit at a time); `None` (the default) for a module
    /// without units.
    #[doc(hidden)]
    fn unit_tensor_counts(&self) -> Option<crate::Result<Vec<usize>>> {
        None
    }

    /// ZeRO stage 3: the trainable tensors whose products may take them a piece of rows at a
    /// time, cut where larger than a bucket (index, values per row:
    /// [`burn_dist::zero::ZeroOptimizer::cut_rows`]). By default the matrices (linear
    /// layers' weights).
    #[doc(hidden)]
    fn piece_rows(&self) -> Vec<(usize, usize)> {
        burn_dist::zero::module::ShardedParams::matrices(self)
    }
}

impl Net for Classifier {
    type Input = Tensor<4>;
    const MIXED_PRECISION: bool = true;
    fn logits(&self, input: Tensor<4>) -> Tensor<2> {
        self.forward(input)
    }
    fn logits_in(&self, input: Tensor<4>, dtype: burn::tensor::FloatDType) -> Tensor<2> {
        self.forward_in(input, dtype)
    }
    fn unit_gradients(
        &self,
        input: Tensor<4>,
        precision: super::Precision,
        recompute: bool,
        gathering: Option<&crate::pipeline::Gathering<'_>>,
        loss: &mut dyn FnMut(Tensor<2>) -> crate::Result<Tensor<1>>,
    ) -> Option<crate::Result<burn::optim::GradientsParams>> {
        Some(crate::pipeline::unit_gradients(
            self, self, input, precision, recompute, gathering, loss,
        ))
    }
    fn unit_tensor_counts(&self) -> Option<crate::Result<Vec<usize>>> {
        Some(crate::pipeline::unit_tensor_counts(self))
    }
    fn piece_rows(&self) -> Vec<(usize, usize)> {
        crate::pipeline::piece_rows(self)
    }
    fn gathered_tensors(
        &self,
        gathering: &crate::pipeline::Gathering<'_>,
        each: &mut dyn FnMut(u64, crate::pipeline::ReadBytes<'_>),
    ) -> Option<crate::Result<()>> {
        Some(crate::pipeline::gathered_tensors(self, gathering, each))
    }
    fn gathered_logits(
        &self,
        input: Option<Tensor<4>>,
        precision: super::Precision,
        gathering: &crate::pipeline::Gathering<'_>,
    ) -> Option<crate::Result<Option<Tensor<2>>>> {
        Some(crate::pipeline::gathered_logits(
            self, input, precision, gathering,
        ))
    }
}

/// ZeRO stage 3's validation or checkpoint on a module without units (which stage 3 refuses
/// at its start).
pub(crate) fn no_units_to_gather() -> crate::HearthError {
    crate::HearthError::InvalidArgument(
        "`exchange.zero` 3: this model has no units to gather one by one".into(),
    )
}
