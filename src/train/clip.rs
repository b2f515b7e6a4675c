//! Gradient clipping by global norm (`optim.clip_grad`, `--clip-grad`), below every mode that
//! uses it: PyTorch's `clip_grad_norm_` rule, each gradient multiplied by
//! `max_norm / (norm + 1e-6)` where that is below 1, `norm` the L2 norm over every parameter's
//! gradient. Where the gradients are spread (a pipeline's stages), the caller sums the squares
//! over the pieces.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;

use super::precision::divide;
use crate::Result;

/// The sum of the squares of `module`'s gradients in `grads`.
pub(super) fn squared_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    struct Sum<'a> {
        grads: &'a GradientsParams,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let s = g.powi_scalar(2).sum();
                self.total = Some(match self.total.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    let mut v = Sum { grads, total: None };
    module.visit(&mut v);
    v.total.map_or(0.0, |t| f64::from(t.into_scalar::<f32>()))
}

/// Clips `grads` to `max_norm` by the global norm: `total` turns this process's sum of
/// squares into the sum over every piece of the gradient (the identity where this process
/// holds it all). Returns the norm before clipping.
pub(super) fn clip_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
    total: impl FnOnce(f64) -> Result<f64>,
) -> Result<f64> {
    let norm = total(squared_norm(module, grads))?.max(0.0).sqrt();
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        divide(module, grads, (1.0 / coef) as f32);
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    #[test]
    fn gradients_above_the_norm_are_scaled_to_it_and_those_below_stay() {
        let device = Device::flex().autodiff();
        let model: Linear = LinearConfig::new(4, 3).init(&device);
        let x = Tensor::<2>::from_floats([[1.0, -2.0, 3.0, 0.5], [0.2, 0.1, -1.0, 2.0]], &device);
        let grads_of = || {
            let loss = model.forward(x.clone()).powi_scalar(2).sum();
            GradientsParams::from_grads(loss.backward(), &model)
        };
        let norm = squared_norm(&model, &grads_of()).sqrt();
        assert!(norm > 1.0, "{norm}");
        // Clipped to half: the norm after is half (PyTorch's 1e-6 aside).
        let mut g = grads_of();
        let before = clip_grads(&model, &mut g, norm / 2.0, Ok).unwrap();
        assert!((before - norm).abs() < 1e-9);
        let after = squared_norm(&model, &g).sqrt();
        assert!(
            (after - norm / 2.0).abs() < 1e-4 * norm,
            "{after} against {}",
            norm / 2.0
        );
        // A bound above the norm leaves every value as it was.
        let mut g = grads_of();
        clip_grads(&model, &mut g, norm * 2.0, Ok).unwrap();
        assert_eq!(squared_norm(&model, &g), squared_norm(&model, &grads_of()));
        // The pieces' sum is what counts: twice the squares, so the norm is sqrt(2) larger.
        let mut g = grads_of();
        let seen = clip_grads(&model, &mut g, norm, |s| Ok(2.0 * s)).unwrap();
        assert!((seen - norm * 2f64.sqrt()).abs() < 1e-4 * norm);
        let after = squared_norm(&model, &g).sqrt();
        assert!((after - norm / 2f64.sqrt()).abs() < 1e-4 * norm, "{after}");
    }
}
