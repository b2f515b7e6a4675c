//! Backward passes cut at segment boundaries in one process: activation recomputation
//! (`--recompute` outside pipelines) and the segmented backward that hands each segment's
//! gradients on as soon as they exist (`--overlap`).

use burn::optim::GradientsParams;
use burn::prelude::*;

use super::{Activation, Materialize, PipelineStage, mismatch};
use crate::{DistError, Result};

/// Activation recomputation in one process: the gradients of `loss(segments[K-1](...
/// segments[0](input)))` for every segment's parameters (one [`GradientsParams`] per segment,
/// keyed by their parameters' ids), holding between the forward and the backward only each
/// segment's input, and at any time one segment's graph.
///
/// The forward runs each segment but the last without a graph (its parameters untracked;
/// batch norm trains and updates its running statistics as usual); the last runs with its
/// graph and `loss` (which may keep what it needs of the output, e.g. for metrics), then the
/// backward goes from the last segment to the first, running each one's forward again
/// ([`PipelineStage::forward_again`]) with its graph before differentiating it. Random draws
/// (dropout) of every segment but the last come from a seed per segment drawn from the
/// device's stream and set again for the recomputation, so both passes draw the same. The
/// results equal one backward through the whole chain, bar those draws.
pub fn recomputed_gradients<M: PipelineStage>(
    segments: &[M],
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    device: &Device,
) -> Result<Vec<GradientsParams>> {
    recomputed_gradients_each(segments, input, loss, device, &mut |_, _, g| Ok(g))
}

/// What a segmented backward does with each segment's gradients as soon as they are done
/// (the last segment's first): `done(k, segment, grads)` returns what it leaves of them for
/// the result (all of them, or nothing once it has handed them on, e.g. to an
/// [`crate::overlap`] exchange).
pub type SegmentDone<'a, M> = dyn FnMut(usize, &M, GradientsParams) -> Result<GradientsParams> + 'a;

/// Where a segment's values come from when it runs: `gather(k, segment)` returns segment `k`
/// ready to run. ZeRO stage 3's segments are skeletons whose parameters are gathered from the
/// ranks' shards before each forward and recomputation ([`crate::zero::module::ShardedParams`]),
/// and let go when the module returned is dropped; elsewhere the segment itself (a clone).
pub type Gather<'a, M> = dyn FnMut(usize, &M) -> Result<M> + 'a;

/// [`recomputed_gradients`], each segment's gradients passed to `done` as soon as its
/// backward is over.
pub fn recomputed_gradients_each<M: PipelineStage>(
    segments: &[M],
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    device: &Device,
    done: &mut SegmentDone<'_, M>,
) -> Result<Vec<GradientsParams>> {
    let mut itself = |_: usize, s: &M| Ok(s.clone());
    recomputed_gradients_gathered(segments, &mut itself, input, loss, device, done)
}

/// [`recomputed_gradients_each`] with each segment's values from `gather` before each of its
/// forwards (once without a graph, once again with it for its backward; the last segment
/// once): at any time one segment's gathered values are held, and the forward's are let go
/// before the next segment's are gathered. `done` gets the caller's segment (the same
/// parameter ids), after the gathered one is let go.
pub fn recomputed_gradients_gathered<M: PipelineStage>(
    segments: &[M],
    gather: &mut Gather<'_, M>,
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    device: &Device,
    done: &mut SegmentDone<'_, M>,
) -> Result<Vec<GradientsParams>> {
    let Some((last, rest)) = segments.split_last() else {
        return Err(DistError::Config("recomputation over no segments".into()));
    };
    for s in segments {
        s.visit(&mut Materialize);
    }
    let fail = |k: usize, e: DistError| mismatch("recomputed forward", format!("segment {k}: {e}"));
    // Forward without graphs: each segment's input and seed.
    let mut held: Vec<(Activation, u64)> = Vec::with_capacity(rest.len());
    let mut x = input;
    for (k, s) in rest.iter().enumerate() {
        let seed = draw_seed(device);
        device.seed(seed);
        let y = gather(k, s)?
            .no_grad()
            .forward(x.clone())
            .map_err(|e| fail(k, e))?;
        held.push((x, seed));
        x = y;
    }
    let mut grads = Vec::with_capacity(segments.len());
    let k_last = rest.len();
    let x_last = if k_last == 0 { x } else { x.require_grad() };
    let used = gather(k_last, last)?;
    let y = used.forward(x_last.clone()).map_err(|e| fail(k_last, e))?;
    let g = loss(y)?.backward();
    let mut upstream = if k_last == 0 {
        None
    } else {
        x_last.grad_activation(&g)
    };
    grads.push(hand_on(done, k_last, last, used, g)?);
    for (k, (x, seed)) in held.into_iter().enumerate().rev() {
        let Some(dy) = upstream.take() else {
            // Nothing flows further back (a frozen segment whose input needs no gradient).
            grads.push(GradientsParams::new());
            continue;
        };
        device.seed(seed);
        let x = if k == 0 { x } else { x.require_grad() };
        let segment = gather(k, &segments[k])?;
        let y = segment.forward_again(x.clone()).map_err(|e| fail(k, e))?;
        if !y.is_tracked() {
            grads.push(GradientsParams::new());
            continue;
        }
        let g = y.inject_activation(dy)?.backward();
        if k > 0 {
            upstream = x.grad_activation(&g);
        }
        grads.push(hand_on(done, k, &segments[k], segment, g)?);
    }
    grads.reverse();
    Ok(grads)
}

/// The gradients of `loss(segments[K-1](... segments[0](input)))` for every segment's
/// parameters, computed segment by segment from the last (one [`GradientsParams`] per
/// segment, in segment order), each passed to `done` as soon as its backward is over, while
/// the segments before it are still to run: what overlapping the gradient exchange with the
/// backward pass needs ([`crate::overlap`]): Burn's own per-parameter hook feeds only its
/// in-process multi-device sync server.
///
/// The forward keeps every segment's graph, each cut from the one before at its input (which
/// requires a gradient where a segment before it trains), so it holds what one graph through
/// the whole chain holds. The backward starts from the loss and runs each segment's graph
/// with the gradient of its output that the segment after it produced. The results equal one
/// backward through the whole chain (the same operations; only the sums across a cut are
/// made at the cut).
pub fn segmented_gradients<M: PipelineStage>(
    segments: &[M],
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    done: &mut SegmentDone<'_, M>,
) -> Result<Vec<GradientsParams>> {
    let mut itself = |_: usize, s: &M| Ok(s.clone());
    segmented_gradients_gathered(segments, &mut itself, input, loss, done)
}

/// [`segmented_gradients`] with each segment's values from `gather` before its forward. Each
/// segment's graph holds its gathered values until its backward is over (then they go, before
/// `done` gets the caller's segment): ZeRO stage 3 without recomputation holds every segment's
/// values at the end of the forward, unless [`segmented_gradients_regathered`] lets them go.
pub fn segmented_gradients_gathered<M: PipelineStage>(
    segments: &[M],
    gather: &mut Gather<'_, M>,
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    done: &mut SegmentDone<'_, M>,
) -> Result<Vec<GradientsParams>> {
    segmented(segments, gather, None, input, loss, done)
}

/// How a segment's gathered values leave its graph between its forward and its backward, the
/// graph keeping keys in their place, and come back for its backward, gathered again (ZeRO
/// stage 3 without recomputation; PyTorch FSDP's "reshard after forward"). The ops that can
/// keep a value by key are the caller's: burn-dist only orders the passes and the gathers.
pub trait Regather<M> {
    /// Runs segment `k`'s `forward` on `gathered` with its graph keeping keys where it can;
    /// returns the output and `gathered`, without the values kept by key where `release` (what
    /// is left is what the graph's other ops need: the caller holds it until the backward).
    fn forward(
        &mut self,
        k: usize,
        gathered: M,
        release: bool,
        forward: &mut dyn FnMut(&M) -> Result<Activation>,
    ) -> Result<(Activation, M)>;
    /// Runs segment `k`'s `backward` with `values` (the segment gathered again, or still
    /// whole; `None` where [`Regather::fetches`]: the values kept by key are fetched as its
    /// ops first need them) providing the values its graph kept by key, each let go once its
    /// ops are done; returns the backward's gradients and `values` without them. The
    /// gradients of the values kept by key are handed on or held for
    /// [`Regather::add_keyed`].
    fn backward(
        &mut self,
        k: usize,
        values: Option<M>,
        backward: &mut dyn FnMut() -> Result<burn::tensor::Gradients>,
    ) -> Result<(burn::tensor::Gradients, Option<M>)>;
    /// Whether [`Regather::backward`] fetches the values a segment's graph kept by key itself,
    /// as its ops need them (a gather finer than a segment's), instead of being handed the
    /// segment gathered again.
    fn fetches(&self) -> bool {
        false
    }
    /// Whether segment `k` of `segments` keeps its gathered values from its forward to its
    /// backward (neither let go nor gathered again), its backward handed them as the last
    /// segment's is. The last always keeps them (its backward follows its forward at once);
    /// a caller may keep a few before it too, trading their memory between the passes for a
    /// gather less (FSDP's `reshard_after_forward=False` on those).
    fn keeps(&self, k: usize, segments: usize) -> bool {
        k + 1 == segments
    }
    /// Adds segment `k`'s gradients of the values kept by key to `grads` (`segment`: the
    /// caller's, whose parameter ids they carry).
    fn add_keyed(&mut self, k: usize, segment: &M, grads: &mut GradientsParams) -> Result<()>;
}

/// [`segmented_gradients_gathered`] with each segment's gathered values let go after its
/// forward and gathered again for its backward ([`Regather`]): every rank gathers each segment
/// but the last twice, in forward then reverse order, and between its two passes a segment
/// holds only what its graph keeps by value. The last segment keeps its values for its
/// backward, which follows its forward at once (as FSDP keeps its root's), and so does each
/// segment the regather [keeps](Regather::keeps), gathered once a step; in every segment's
/// backward each value kept by key goes as soon as its ops are done. A regather that
/// [fetches](Regather::fetches) its values itself is not handed the segment gathered again:
/// its backward gathers what its ops need as they need it.
pub fn segmented_gradients_regathered<M: PipelineStage>(
    segments: &[M],
    gather: &mut Gather<'_, M>,
    regather: &mut dyn Regather<M>,
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    done: &mut SegmentDone<'_, M>,
) -> Result<Vec<GradientsParams>> {
    segmented(segments, gather, Some(regather), input, loss, done)
}

fn segmented<M: PipelineStage>(
    segments: &[M],
    gather: &mut Gather<'_, M>,
    mut regather: Option<&mut dyn Regather<M>>,
    input: Activation,
    loss: &mut dyn FnMut(Activation) -> Result<Tensor<1>>,
    done: &mut SegmentDone<'_, M>,
) -> Result<Vec<GradientsParams>> {
    if segments.is_empty() {
        return Err(DistError::Config(
            "a segmented backward over no segments".into(),
        ));
    }
    for s in segments {
        s.visit(&mut Materialize);
    }
    let fail = |k: usize, e: DistError| mismatch("segmented forward", format!("segment {k}: {e}"));
    // A segment's input needs a gradient when a segment before it trains.
    let mut upstream_trains = Vec::with_capacity(segments.len());
    let mut trains = false;
    for s in segments {
        upstream_trains.push(trains);
        let mut t = Trains(false);
        s.visit(&mut t);
        trains |= t.0;
    }
    // Forward with graphs: each segment (gathered; with `regather`, without what its graph
    // keeps by key), its input (cut from the graph before) and output.
    let mut cut: Vec<(M, Activation, Activation)> = Vec::with_capacity(segments.len());
    let mut x = input;
    for (k, s) in segments.iter().enumerate() {
        let input = match (k, upstream_trains[k]) {
            (0, _) => x,
            (_, true) => x.detach().require_grad(),
            (_, false) => x.detach(),
        };
        let s = gather(k, s)?;
        let mut forward = |m: &M| m.forward(input.clone()).map_err(|e| fail(k, e));
        // The last segment's backward follows its forward at once: it keeps its values (and
        // so does any segment the regather keeps).
        let (y, s) = match regather.as_deref_mut() {
            Some(r) => {
                let release = !r.keeps(k, segments.len()) && k + 1 < segments.len();
                r.forward(k, s, release, &mut forward)?
            }
            None => (forward(&s)?, s),
        };
        x = y.clone();
        cut.push((s, input, y));
    }
    let mut grads: Vec<GradientsParams> = Vec::with_capacity(segments.len());
    let mut upstream: Option<Activation> = None;
    while let Some((segment, input, y)) = cut.pop() {
        let k = cut.len();
        let last = k + 1 == segments.len();
        let dy = if last { None } else { upstream.take() };
        if !last && (dy.is_none() || !y.is_tracked()) {
            // Nothing flows back into this segment (it and all before it are frozen).
            grads.push(GradientsParams::new());
            continue;
        }
        let mut slot = Some((y, dy));
        let mut backward = || match slot.take() {
            Some((y, None)) => Ok(loss(y)?.backward()),
            Some((y, Some(dy))) => Ok(y.inject_activation(dy)?.backward()),
            None => Err(DistError::Config("a segment's backward ran twice".into())),
        };
        let (g, segment) = match regather.as_deref_mut() {
            // The last segment (and any the regather keeps) still holds its values: they go
            // into its backward.
            Some(r) if last || r.keeps(k, segments.len()) => {
                match r.backward(k, Some(segment), &mut backward)? {
                    (g, Some(rest)) => (g, rest),
                    (_, None) => {
                        return Err(DistError::Config(format!(
                            "segment {k}'s backward kept nothing of the values handed to it"
                        )));
                    }
                }
            }
            Some(r) if r.fetches() => (r.backward(k, None, &mut backward)?.0, segment),
            Some(r) => {
                let again = gather(k, &segments[k])?;
                (r.backward(k, Some(again), &mut backward)?.0, segment)
            }
            None => (backward()?, segment),
        };
        if upstream_trains[k] {
            upstream = input.grad_activation(&g);
        }
        let mut g = GradientsParams::from_grads(g, &segment);
        if let Some(r) = regather.as_deref_mut() {
            r.add_keyed(k, &segments[k], &mut g)?;
        }
        drop(segment);
        grads.push(done(k, &segments[k], g)?);
    }
    grads.reverse();
    Ok(grads)
}

/// Segment `k`'s gradients from a backward's `grads` through `used` (the segment as it ran,
/// gathered or a clone), passed to `done` with `segment` (the caller's, the same parameter
/// ids) once `used` is let go: a gathered segment's values are gone before `done` hands the
/// gradients on (ZeRO stage 3 holds a unit's parameters or its gradients' copies, not both).
fn hand_on<M: PipelineStage>(
    done: &mut SegmentDone<'_, M>,
    k: usize,
    segment: &M,
    used: M,
    grads: burn::tensor::Gradients,
) -> Result<GradientsParams> {
    let g = GradientsParams::from_grads(grads, &used);
    drop(used);
    done(k, segment, g)
}

/// Whether a visit reaches a parameter that requires a gradient.
struct Trains(bool);

impl burn::module::ModuleVisitor for Trains {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        self.0 |= param.val().is_require_grad();
    }
}

/// A seed from the device's random stream (so it follows the run's seeding).
fn draw_seed(device: &Device) -> u64 {
    let t = Tensor::<1>::random([2], burn::tensor::Distribution::Uniform(0.0, 1.0), device);
    let v = t
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    v.iter()
        .fold(0u64, |acc, x| (acc << 32) | u64::from(x.to_bits()))
}
