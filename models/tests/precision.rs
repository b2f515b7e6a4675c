//! Mixed precision: a classifier run with `forward_in(x, BF16 | F16)` computes in that type
//! while its parameters, their gradients and the logits stay f32, and agrees with the f32
//! forward to the type's precision, for all three families, in training (autodiff, batch norm
//! in train mode) and in inference.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use hearth_models::{
    BlockKind, Classifier, DenseNetConfig, ModelConfig, ResNetConfig, VggConfig, VggLayer,
};

/// Burn Flex's random generator is one per process and both tests seed it, while the test
/// harness runs them in parallel threads: interleaved, one test's draws took the other's
/// (DenseNet's f16 gradient then differed by 0.067 of its norm, above the 0.062 its criterion
/// allows, 3 runs in 60). Each test holds this for its whole run, so its draws are its seed's.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|e| e.into_inner())
}

fn families(device: &Device) -> Vec<Classifier> {
    use VggLayer::{Conv, Pool};
    [
        ModelConfig::ResNet(
            // Hearth's `resnet-mini` (what the precision training tests train).
            ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], 5)
                .with_stem_width(16)
                .with_stage_widths([16, 32, 64, 128]),
        ),
        ModelConfig::Vgg(
            VggConfig::new(vec![Conv(8), Pool, Conv(16), Pool], true, 5)
                .with_hidden(16)
                .with_pool_size(2)
                .with_dropout(0.0),
        ),
        ModelConfig::DenseNet(DenseNetConfig::new(4, vec![2, 2], 8, 5)),
    ]
    .into_iter()
    .map(|c| c.init(device).unwrap())
    .collect()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

/// Every gradient of `model` as f32 values, named by parameter id order.
fn grads_of(model: &Classifier, loss: Tensor<1>) -> Vec<(DType, Vec<f32>)> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        out: Vec<(DType, Vec<f32>)>,
    }
    impl burn::module::ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                self.out.push((g.dtype(), values(g)));
            }
        }
    }
    let grads = GradientsParams::from_grads(loss.backward(), model);
    let mut c = Collect {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut c);
    c.out
}

/// The largest gap low precision may show where rounding only the input to `dtype` already
/// shows `control`: several times that, since the type rounds after every layer, not once
/// (and a network that amplifies the input's rounding, as a small ResNet's batch norm over few
/// values does, amplifies each of those too; measured here up to 5x for bf16 and 11x for f16's
/// ResNet gradient: most of it is the stem convolution's, behind a max pool, which routes the
/// gradient to the largest of near-equal values, and rounding reorders near-ties), and never
/// less than
/// `floor`. A wrong cast, a parameter left in low precision or statistics taken in the wrong
/// type give gaps of order one.
fn allowed(control: f32, floor: f32) -> f32 {
    (12.0 * control).max(floor)
}

fn norm(v: &[f32]) -> f32 {
    v.iter().map(|x| x * x).sum::<f32>().sqrt()
}

/// `|a - b| / |b|` over whole vectors.
fn l2_gap(a: &[f32], b: &[f32]) -> f32 {
    let d: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    norm(&d) / norm(b).max(1e-12)
}

/// The whole gradient as one vector (single tensors whose gradient is only cancellation, a
/// batch norm's shift before another batch norm, are noise in any precision).
fn flat(g: &[(DType, Vec<f32>)]) -> Vec<f32> {
    g.iter().flat_map(|(_, v)| v.iter().copied()).collect()
}

#[test]
fn low_precision_forward_and_backward_keep_f32_parameters_and_match_f32() {
    let _rng = rng_lock();
    let device = Device::flex().autodiff();
    device.seed(7);
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        let floor = 0.03;
        for model in families(&device) {
            let name = format!("{} {dtype:?}", model.family());
            let x = Tensor::<4>::random(
                [16, 3, 32, 32],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            );
            let rounded = x.clone().cast(dtype).cast(FloatDType::F32);
            let f32_logits = model.forward(x.clone());
            let control_logits = model.forward(rounded);
            let low_logits = model.forward_in(x.clone(), dtype);
            assert_eq!(
                low_logits.dtype(),
                DType::F32,
                "{name}: logits come back f32"
            );
            let (r, c, l) = (
                values(f32_logits.clone()),
                values(control_logits.clone()),
                values(low_logits.clone()),
            );
            let (gap, control) = (l2_gap(&l, &r), l2_gap(&c, &r));
            assert!(
                gap < allowed(control, floor),
                "{name}: logits differ by {gap} of their norm (rounding the input alone: {control})"
            );

            // f16 gradients need the loss scaled (small ones underflow otherwise), as training
            // in f16 does; the scale is a power of two, so unscaling is exact.
            let scale = if dtype == FloatDType::F16 {
                1024.0
            } else {
                1.0
            };
            let reference = grads_of(&model, f32_logits.powi_scalar(2).mean());
            let control = grads_of(&model, control_logits.powi_scalar(2).mean());
            let low = grads_of(&model, low_logits.powi_scalar(2).mean().mul_scalar(scale));
            assert_eq!(reference.len(), low.len());
            assert!(!low.is_empty());
            for (dt, g) in &low {
                assert_eq!(
                    *dt,
                    DType::F32,
                    "{name}: a gradient reached its parameter as {dt:?}"
                );
                assert!(
                    g.iter().all(|v| v.is_finite()),
                    "{name}: a gradient is not finite"
                );
            }
            let low: Vec<f32> = flat(&low).into_iter().map(|v| v / scale).collect();
            let (r, c) = (flat(&reference), flat(&control));
            let (gap, control) = (l2_gap(&low, &r), l2_gap(&c, &r));
            assert!(
                gap < allowed(control, 2.0 * floor),
                "{name}: the gradient differs by {gap} of its norm (rounding the input alone: \
                 {control})"
            );

            // The parameters themselves never changed type.
            struct Types(Vec<DType>);
            impl burn::module::ModuleVisitor for Types {
                fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
                    self.0.push(p.val().dtype());
                }
            }
            let mut types = Types(Vec::new());
            model.visit(&mut types);
            assert!(
                types.0.iter().all(|t| *t == DType::F32),
                "{name}: {:?}",
                types.0
            );
        }
    }
}

#[test]
fn inference_in_low_precision_needs_no_autodiff() {
    let _rng = rng_lock();
    let device = Device::flex();
    device.seed(3);
    for model in families(&device) {
        let x = Tensor::<4>::random(
            [8, 3, 32, 32],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let f = values(model.forward(x.clone()));
        let c = values(model.forward(x.clone().cast(FloatDType::BF16).cast(FloatDType::F32)));
        let b = values(model.forward_in(x, FloatDType::BF16));
        let (gap, control) = (l2_gap(&b, &f), l2_gap(&c, &f));
        assert!(
            gap < allowed(control, 0.03),
            "{}: {gap} ({control})",
            model.family()
        );
    }
}
