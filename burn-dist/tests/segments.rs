//! The backward cut at segment boundaries in one process (`burn_dist::pipeline::
//! segmented_gradients`) equals one backward through the whole chain, and the exchange
//! overlapped with it (`burn_dist::overlap`) equals the exchange after it: ranks as threads over
//! the in-memory transport.

mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn_dist::Communicator;
use burn_dist::ddp::{allreduce_grads, module_values};
use burn_dist::pipeline::Activation;
use burn_dist::transport::memory::MemoryTransport;
use common::cnn::{Part, assert_close, micro, mse, parts, random_lock, whole_backward};

/// Each parameter's gradient in `grads`, in `model`'s visiting order (empty where it has none).
fn grad_values<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Read<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            let v = self
                .0
                .get::<D>(p.id)
                .map(|g| g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap())
                .unwrap_or_default();
            self.1.push(v);
        }
    }
    let mut r = Read(grads, Vec::new());
    model.visit(&mut r);
    r.1
}

/// The segmented backward with `done` on each segment; the segments' gradients merged.
/// The loss is multiplied by `factor` (as fp16's loss scaling does).
fn segmented(
    model: &[Part],
    x: Tensor<4>,
    y: Tensor<2>,
    factor: f32,
    done: &mut burn_dist::pipeline::SegmentDone<'_, Part>,
) -> GradientsParams {
    let parts = burn_dist::pipeline::segmented_gradients(
        model,
        Activation::Rank4(x),
        &mut |out| Ok(mse(out.rank2("out")?, y.clone()).mul_scalar(factor)),
        done,
    )
    .unwrap();
    assert_eq!(parts.len(), model.len());
    let whole = model.to_vec();
    let mut acc = GradientsAccumulator::<Vec<Part>>::new();
    for g in parts {
        acc.accumulate(&whole, g);
    }
    acc.grads()
}

#[test]
fn a_segmented_backward_equals_one_backward_and_hands_out_the_last_segment_first() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    for convs in [1, 3] {
        let model = parts(convs, &device);
        let (x, y) = micro(0, 0, &device);
        let want = grad_values(
            &model.to_vec(),
            &whole_backward(&model, x.clone(), y.clone()),
        );
        let mut order = Vec::new();
        let got = segmented(&model, x, y, 1.0, &mut |k, _, g| {
            order.push(k);
            Ok(g)
        });
        assert_close(
            "segmented",
            &grad_values(&model.to_vec(), &got),
            &want,
            1e-6,
        );
        assert!(want.iter().all(|g| !g.is_empty()));
        assert_eq!(order, (0..=convs).rev().collect::<Vec<_>>());
    }
    // A frozen first segment: no gradient for it, the others' unchanged, and nothing is
    // differentiated through it.
    let mut model = parts(2, &device);
    model[0] = model[0].clone().no_grad();
    let (x, y) = micro(1, 0, &device);
    let want = grad_values(
        &model.to_vec(),
        &whole_backward(&model, x.clone(), y.clone()),
    );
    let got = grad_values(
        &model.to_vec(),
        &segmented(&model, x, y, 1.0, &mut |_, _, g| Ok(g)),
    );
    assert!(want[0].is_empty() && got[0].is_empty(), "{:?}", got[0]);
    assert_close("frozen first", &got, &want, 1e-6);
}

/// What a [`burn_dist::pipeline::Regather`] was asked, in order (it keys nothing: its
/// segments keep their values, so the gradients must equal one backward's); `fetch`: it says
/// it fetches its values itself; `keep`: it keeps the segments from this one on (`None`: the
/// trait's default, the last alone).
#[derive(Default)]
struct Recorded {
    calls: Vec<String>,
    fetch: bool,
    keep: Option<usize>,
}

impl burn_dist::pipeline::Regather<Part> for Recorded {
    fn forward(
        &mut self,
        k: usize,
        gathered: Part,
        release: bool,
        forward: &mut dyn FnMut(&Part) -> burn_dist::Result<Activation>,
    ) -> burn_dist::Result<(Activation, Part)> {
        self.calls.push(format!("forward {k} release {release}"));
        Ok((forward(&gathered)?, gathered))
    }
    fn backward(
        &mut self,
        k: usize,
        values: Option<Part>,
        backward: &mut dyn FnMut() -> burn_dist::Result<burn::tensor::Gradients>,
    ) -> burn_dist::Result<(burn::tensor::Gradients, Option<Part>)> {
        let how = if values.is_some() { "" } else { " fetching" };
        self.calls.push(format!("backward {k}{how}"));
        Ok((backward()?, values))
    }
    fn fetches(&self) -> bool {
        self.fetch
    }
    fn keeps(&self, k: usize, segments: usize) -> bool {
        match self.keep {
            Some(from) => k >= from,
            None => k + 1 == segments,
        }
    }
    fn add_keyed(&mut self, k: usize, _: &Part, _: &mut GradientsParams) -> burn_dist::Result<()> {
        self.calls.push(format!("add {k}"));
        Ok(())
    }
}

/// The regathered backward (ZeRO stage 3 without recomputation) gathers every segment in
/// forward order, then every segment but the last again in reverse order, each just before
/// its backward; the last segment's own values go to its backward, and those of any segment
/// the regather keeps (gathered once); and the gradients are one backward's.
#[test]
fn a_regathered_backward_gathers_each_segment_but_the_last_again_before_its_backward() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    let model = parts(3, &device);
    let (x, y) = micro(2, 0, &device);
    let want = grad_values(
        &model.to_vec(),
        &whole_backward(&model, x.clone(), y.clone()),
    );
    for (fetch, keep) in [
        (false, None),
        (true, None),
        (false, Some(2)),
        (true, Some(2)),
    ] {
        let gathers = std::cell::RefCell::new(Vec::new());
        let mut gather = |k: usize, s: &Part| {
            gathers.borrow_mut().push(k);
            Ok(s.clone())
        };
        let mut recorded = Recorded {
            fetch,
            keep,
            ..Recorded::default()
        };
        let parts = burn_dist::pipeline::segmented_gradients_regathered(
            &model,
            &mut gather,
            &mut recorded,
            Activation::Rank4(x.clone()),
            &mut |out| Ok(mse(out.rank2("out")?, y.clone())),
            &mut |_, _, g| Ok(g),
        )
        .unwrap();
        // A regather that fetches its own values is not handed the segments gathered again.
        // A kept segment (2, with `keep`) is gathered once and handed its own values.
        let kept = keep.is_some();
        let (gathered, how): (&[usize], &str) = match (fetch, kept) {
            (false, false) => (&[0, 1, 2, 3, 2, 1, 0], ""),
            (false, true) => (&[0, 1, 2, 3, 1, 0], ""),
            (true, _) => (&[0, 1, 2, 3], " fetching"),
        };
        assert_eq!(*gathers.borrow(), gathered, "fetch {fetch}, keep {keep:?}");
        let calls: Vec<&str> = recorded.calls.iter().map(String::as_str).collect();
        let again = |k: usize| format!("backward {k}{how}");
        let (release_2, backward_2) = match kept {
            true => ("forward 2 release false", "backward 2".to_string()),
            false => ("forward 2 release true", again(2)),
        };
        assert_eq!(
            calls,
            [
                "forward 0 release true",
                "forward 1 release true",
                release_2,
                "forward 3 release false",
                "backward 3",
                "add 3",
                &backward_2,
                "add 2",
                &again(1),
                "add 1",
                &again(0),
                "add 0",
            ]
        );
        let whole = model.to_vec();
        let mut acc = GradientsAccumulator::<Vec<Part>>::new();
        for g in parts {
            acc.accumulate(&whole, g);
        }
        assert_close(
            "regathered",
            &grad_values(&whole, &acc.grads()),
            &want,
            1e-6,
        );
    }
}

#[test]
fn an_overlapped_exchange_equals_the_exchange_after_the_backward() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    // Every rank the same weights in parameters of its own: ranks as threads must not share
    // parameter tensors, or Burn's autodiff joins their graphs (and its graph locks deadlock
    // between a forward and a backward on two threads).
    let weights: Vec<Vec<Vec<f32>>> = parts(3, &device).iter().map(module_values).collect();
    let world = 3;
    let (tx, rx) = std::sync::mpsc::channel();
    for (r, t) in MemoryTransport::mesh(world).into_iter().enumerate() {
        let model: Vec<Part> = parts(3, &device)
            .into_iter()
            .zip(weights.clone())
            .map(|(p, w)| burn_dist::ddp::with_module_values(p, w).unwrap())
            .collect();
        let (tx, device) = (tx.clone(), device.clone());
        std::thread::spawn(move || {
            let comm =
                Arc::new(Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(30)));
            let whole = model.to_vec();
            let mut out = Vec::new();
            // Buckets of one tensor, of a few, of everything; then a weighted sum with an
            // fp16-style unscaling of what is handed over.
            for (bucket, op, weight, unscale) in [
                (4usize, burn_dist::ReduceOp::Mean, 1.0f32, None),
                (600, burn_dist::ReduceOp::Mean, 1.0, None),
                (1 << 20, burn_dist::ReduceOp::Mean, 1.0, None),
                (
                    600,
                    burn_dist::ReduceOp::Sum,
                    0.25 * (r + 1) as f32,
                    Some(8.0f32),
                ),
            ] {
                let (x, y) = micro(2, r, &device);
                // The reference: one backward, then the exchange in module order.
                let mut want = whole_backward(&model, x.clone(), y.clone());
                let scale = (op == burn_dist::ReduceOp::Sum).then_some(weight);
                match scale {
                    None => allreduce_grads(&whole, &mut want, &comm, bucket).unwrap(),
                    Some(w) => burn_dist::ddp::allreduce_grads_scaled(
                        &whole,
                        &mut want,
                        &comm,
                        bucket,
                        w,
                        burn_dist::Compression::None,
                    )
                    .unwrap(),
                }
                let step = burn_dist::overlap::OverlappedStep::begin(
                    comm.clone(),
                    bucket,
                    op,
                    burn_dist::Compression::None,
                    weight,
                )
                .unwrap();
                assert!(burn_dist::overlap::handing_over());
                let factor = unscale.unwrap_or(1.0);
                if let Some(s) = unscale {
                    burn_dist::overlap::unscale_by(s);
                }
                let mut handed = 0;
                let mut got = segmented(&model, x, y, factor, &mut |_, seg, g| {
                    handed += 1;
                    Ok(burn_dist::overlap::hand_over(seg, g))
                });
                // Everything was handed over: nothing is left for after the backward.
                assert!(grad_values(&whole, &got).iter().all(Vec::is_empty));
                assert_eq!(handed, 4);
                let n = step.finish(&whole, &mut got).unwrap();
                assert!(!burn_dist::overlap::handing_over());
                assert_eq!(n, 8, "two tensors per segment");
                out.push((grad_values(&whole, &want), grad_values(&whole, &got)));
            }
            let _ = tx.send((r, out));
        });
    }
    drop(tx);
    let mut seen = 0;
    while let Ok((r, out)) = rx.recv_timeout(Duration::from_secs(120)) {
        for (i, (want, got)) in out.iter().enumerate() {
            // Case 3's loss is scaled by 8 and its handed-over gradients unscaled by 8.
            assert_close(&format!("rank {r}, case {i}"), got, want, 1e-5);
        }
        seen += 1;
    }
    assert_eq!(seen, world, "a rank failed or hung");
}
