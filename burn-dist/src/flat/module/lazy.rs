//! What a module's readers ask of a parameter before anything else, below both the reading
//! side (the parent module) and the writing side (`put.rs`).

use burn::module::Param;
use burn::prelude::*;

/// `param`'s shape if it trains (requires gradients), `None` otherwise, without initialising a
/// parameter Burn has not initialised yet (its lazy shape and gradient requirement: a ZeRO
/// stage 3 rank other than the root builds its model this way and never makes the values that
/// the root's replace). Every reader of the trainable order here asks this first, so that
/// counting, naming and releasing a module's tensors leaves its lazy parameters lazy.
pub fn trainable_shape<const D: usize>(param: &Param<Tensor<D>>) -> Option<Shape> {
    if param.is_initialized() {
        let t = param.val();
        return t.is_require_grad().then(|| t.shape());
    }
    // Burn reads a lazy parameter's gradient requirement without initialising it only when a
    // value is loaded into it: an empty one, into a clone (which shares the lazy state and
    // leaves it as it is).
    let probe = param
        .clone()
        .transform_for_load(Tensor::<D>::empty([0; D], &param.lazy_device()), param.id);
    probe.val().is_require_grad().then(|| param.lazy_shape())
}
