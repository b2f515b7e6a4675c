//! A training step's gradient exchange and commit, shared by every mode: data parallel
//! (`allreduce`), elastic workers, a pipeline stage's replicas and parameter-server workers.
//!
//! A step is four parts, in this order on every rank:
//! - **plan** ([`Exchange::plan`]): with `exchange.overlap`, the hand-over is installed on this
//!   thread before the backward, so each unit's gradients leave as soon as they exist;
//! - **compute**: the caller's forward and backward (its shares, accumulation and loss scale);
//! - **exchange** ([`Exchange::exchange`]): what the backward did not hand over is reduced
//!   over the ranks in buckets, in `exchange.compression`'s wire format;
//! - **commit** ([`Update::apply`]): fp16's verdict on the exchanged gradients, clipping by the
//!   global norm, the optimizer's step. With `exchange.zero` the exchange and the commit are one
//!   ([`Update::sharded`]: reduce-scatter, the shard's update, all-gather); on parameter servers
//!   too ([`Update::served`]: this worker's gradient pushed, the servers' rule applied, the
//!   values pulled), where each worker gives fp16's verdict on its own gradient.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn_dist::overlap::OverlappedStep;
use burn_dist::ps::client::PsWorker;
use burn_dist::zero::{ReducedGradients, ZeroOptimizer};
use burn_dist::{Communicator, DistError, ReduceOp};

use super::config::ExchangeSettings;
use super::precision::{LossScaler, unscale_flat};
use super::shared::one_host_overlap_notice;
use crate::Result;

/// How one rank's gradients become the step's: the plan and exchange parts of a step, and the
/// epoch's time in them.
pub(super) struct Exchange {
    /// `Mean` where each rank's gradients are the mean of its own samples (data parallel);
    /// `Sum` where each rank's share of the global batch is weighted in its loss already
    /// (elastic workers, whose shares differ).
    op: ReduceOp,
    settings: ExchangeSettings,
    /// Whether this rank has said how much of its first overlapped step's exchange ran
    /// during the backward.
    said: bool,
    /// Stage 3: whether this rank has said how many weights' gradients its first step handed
    /// over one by one.
    said_alone: bool,
    clock: Clock,
}

/// Time in training steps and, of it, in the gradient exchange (with `exchange.overlap`: only
/// the wait for what the backward did not hide; with `exchange.zero`: the sharded update too),
/// over one epoch.
#[derive(Debug, Default, Clone, Copy)]
struct Clock {
    stepping: Duration,
    exchanging: Duration,
}

impl Exchange {
    pub(super) fn new(settings: &ExchangeSettings, op: ReduceOp) -> Self {
        Self {
            op,
            settings: settings.clone(),
            said: false,
            said_alone: false,
            clock: Clock::default(),
        }
    }

    /// Plan: with `exchange.overlap`, the step's exchange installed on this thread, so that
    /// the backward hands each unit's gradients over as it goes (`scale`: fp16's loss scale,
    /// divided out as they leave). `None` without overlap.
    pub(super) fn plan(
        &self,
        comm: &Arc<Communicator>,
        scale: Option<f32>,
    ) -> std::result::Result<Option<OverlappedStep>, DistError> {
        if !self.settings.overlap {
            return Ok(None);
        }
        let o = OverlappedStep::begin(
            comm.clone(),
            self.settings.bucket_size(),
            self.op,
            self.settings.compression,
            1.0,
        )?;
        if let Some(s) = scale {
            burn_dist::overlap::unscale_by(s);
        }
        Ok(Some(o))
    }

    /// Plan for `exchange.zero` with `exchange.overlap`: the step's exchange installed on this
    /// thread, each unit's gradients reduced into `z`'s buckets as the backward hands them
    /// over (stage 2: each bucket's whole gradient gone as soon as it is reduce-scattered).
    /// `None` without overlap, except in stage 3 (`z` holds the parameters), whose step always
    /// takes each unit's gradients as its backward ends: reduced on the step's own thread, or
    /// with overlap on a thread of their own over `comm`, while the step's thread gathers the
    /// next units' parameters over `gathers` (a sibling of `comm`: [`Kind::Gather`]) and goes
    /// on backward.
    ///
    /// [`Kind::Gather`]: burn_dist::wire::Kind::Gather
    pub(super) fn plan_sharded<M: Module>(
        &self,
        comm: &Arc<Communicator>,
        scale: Option<f32>,
        z: &ZeroOptimizer,
        model: &M,
        gathers: Option<&Communicator>,
    ) -> std::result::Result<Option<OverlappedStep>, DistError> {
        if !self.settings.overlap && !z.holds_params() {
            return Ok(None);
        }
        let o = match (self.settings.overlap && z.holds_params(), gathers) {
            (true, Some(g)) => {
                OverlappedStep::begin_sharded_beside(comm.clone(), g, z, model, 1.0)?
            }
            // Never inline in its place: `--overlap` would be ignored without a word.
            (true, None) => {
                return Err(DistError::Config(
                    "an overlapped ZeRO stage 3 step was planned without a communicator for its \
                     gathers"
                        .into(),
                ));
            }
            (false, _) => OverlappedStep::begin_sharded(comm.clone(), z, model, 1.0)?,
        };
        if let Some(s) = scale {
            burn_dist::overlap::unscale_by(s);
        }
        Ok(Some(o))
    }

    /// The exchange of a step planned by [`Self::plan_sharded`]: what the backward did not
    /// hand over (in `grads`) joins the last buckets, and the step's gradients come back
    /// reduced to this rank's segments, for [`Update::sharded`]. Timed.
    pub(super) fn reduce_sharded<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
        overlapped: OverlappedStep,
        comm: &Communicator,
        log: &mut dyn FnMut(&str),
    ) -> std::result::Result<ReducedGradients, DistError> {
        let started = Instant::now();
        let alone = overlapped.handed_alone();
        let done = overlapped.finish_sharded(model, grads);
        self.clock.exchanging += started.elapsed();
        let (reduced, handed) = done?;
        self.say_handed(handed, model, comm, log);
        if alone > 0 && !self.said_alone {
            self.said_alone = true;
            log(&format!(
                "`exchange.zero` 3: {alone} weights' gradients handed over one by one as \
                 each was whole, their buckets gathered for the backward as its ops needed them \
                 (buckets of {}, --bucket-mb: a bucket reduced once all of its gradient is \
                 there)",
                match self.settings.bucket_size() as f64 / 1024.0 {
                    kib if kib < 1024.0 => format!("{kib:.1} KiB"),
                    kib => format!("{:.1} MiB", kib / 1024.0),
                }
            ));
        }
        Ok(reduced)
    }

    /// The first overlapped step's line: how many tensors went during the backward.
    fn say_handed<M: Module>(
        &mut self,
        handed: usize,
        model: &M,
        comm: &Communicator,
        log: &mut dyn FnMut(&str),
    ) {
        if self.said {
            return;
        }
        self.said = true;
        let of = burn_dist::ddp::module_values(model).len();
        if !self.settings.overlap {
            // ZeRO stage 3 reduces each unit's gradients as its backward ends, without
            // `--overlap`: on the step's thread, nothing overlapped.
            log(&format!(
                "`exchange.zero` 3: {handed} gradient tensors of {of} were reduce-scattered as \
                 their units' backward ended"
            ));
            return;
        }
        log(&format!(
            "`exchange.overlap`: {handed} gradient tensors of {of} were exchanged during the \
             backward pass"
        ));
        if let Some(notice) = one_host_overlap_notice(comm) {
            log(notice);
        }
    }

    /// Exchange: `grads` become the step's over `comm`'s ranks: what `overlapped` handed over
    /// during the backward, with the rest; without it, the whole gradients in buckets. The
    /// first overlapped step says how many tensors went during the backward. Timed.
    pub(super) fn exchange<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
        comm: &Communicator,
        overlapped: Option<OverlappedStep>,
        log: &mut dyn FnMut(&str),
    ) -> std::result::Result<(), DistError> {
        let started = Instant::now();
        let bytes = self.settings.bucket_size();
        let handed = match overlapped {
            Some(o) => o.finish(model, grads).map(Some),
            None => match self.op {
                // The mean: summed on the wire in the communicator's format, divided after,
                // so that a narrow format (fp16) never holds halved values.
                ReduceOp::Mean => burn_dist::ddp::allreduce_grads(model, grads, comm, bytes),
                // The shares are weighted in the loss already: the sum is the global mean.
                _ => burn_dist::ddp::allreduce_grads_scaled(
                    model,
                    grads,
                    comm,
                    bytes,
                    1.0,
                    self.settings.compression,
                ),
            }
            .map(|()| None),
        };
        self.clock.exchanging += started.elapsed();
        if let Some(handed) = handed? {
            self.say_handed(handed, model, comm, log);
        }
        Ok(())
    }

    /// Times a part of the step that exchanges inside it (`exchange.zero`'s sharded update).
    pub(super) fn timed<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let started = Instant::now();
        let r = f();
        self.clock.exchanging += started.elapsed();
        r
    }

    /// Adds a whole step's time (compute, exchange and commit) to the epoch's.
    pub(super) fn stepped(&mut self, took: Duration) {
        self.clock.stepping += took;
    }

    /// The epoch's line on its time in the exchange (`None` before any step), and a fresh
    /// clock for the next epoch.
    pub(super) fn report(&mut self, epoch: usize) -> Option<String> {
        let clock = std::mem::take(&mut self.clock);
        (!clock.stepping.is_zero()).then(|| {
            burn_dist::ddp::exchange_report(
                epoch,
                self.settings.overlap,
                clock.exchanging,
                clock.stepping,
            )
        })
    }
}

/// A ZeRO step's gradients: this rank's whole (reduced in the step) or reduced to its
/// segments already (during the backward).
pub(super) enum ShardedGrads {
    Whole(GradientsParams),
    Reduced(ReducedGradients),
}

impl From<GradientsParams> for ShardedGrads {
    fn from(g: GradientsParams) -> Self {
        ShardedGrads::Whole(g)
    }
}

/// The commit of a step: `optim.clip_grad`'s bound and fp16's loss scaler (the rate goes to
/// the commits that step an optimizer here; parameter servers schedule theirs).
pub(super) struct Update<'a> {
    pub(super) clip: Option<f64>,
    pub(super) scaler: Option<&'a mut LossScaler>,
}

impl Update<'_> {
    /// Commit on exchanged gradients that this rank holds whole: fp16's verdict (`agree`
    /// turns this rank's "all finite" into the job's, where ranks hold different parts of the
    /// model; asked only with a scaler), clipping by the global norm (`total` turns this rank's
    /// squared norm into the job's), the optimizer's step. The model, and whether it stepped
    /// (fp16 skips a step whose gradients overflowed, on every rank alike).
    pub(super) fn apply<M: Module>(
        self,
        model: M,
        lr: f64,
        mut grads: GradientsParams,
        optim: &mut ModuleOptimizer,
        agree: impl FnOnce(bool) -> Result<bool>,
        total: impl FnOnce(f64) -> Result<f64>,
    ) -> Result<(M, bool)> {
        let take = match self.scaler {
            Some(s) => s.decide(agree(burn_dist::ddp::grads_finite(&model, &grads))?),
            None => true,
        };
        if !take {
            return Ok((model, false));
        }
        if let Some(max) = self.clip {
            super::clip::clip_grads(&model, &mut grads, max, total)?;
        }
        Ok((optim.step(lr, model, grads), true))
    }

    /// `exchange.zero`'s exchange and commit in one: the gradients reduce-scattered into
    /// `z`'s shard, its update, the parameters all-gathered into `model` bucket by bucket
    /// (the caller hands over its copy, so the old values go as the new ones come), with
    /// fp16's verdict on the reduced gradients (`agree` as in [`Self::apply`]). The model, and
    /// whether it stepped (fp16 may skip). Gradients reduced during the backward
    /// ([`Exchange::reduce_sharded`]) go straight to the update.
    pub(super) fn sharded<M: Module>(
        self,
        z: &mut ZeroOptimizer,
        lr: f64,
        model: M,
        grads: impl Into<ShardedGrads>,
        comm: &Communicator,
        mut agree: impl FnMut(bool) -> std::result::Result<bool, DistError>,
    ) -> std::result::Result<(M, bool), DistError> {
        let mut scaler = self.scaler;
        let mut failed = None;
        let mut take = |finite: bool| match scaler.as_deref_mut() {
            None => true,
            Some(s) => match agree(finite) {
                Ok(finite) => s.decide(finite),
                Err(e) => {
                    failed = Some(e);
                    false
                }
            },
        };
        use burn_dist::zero::module::{sharded_step_owned, sharded_step_reduced};
        let stepped = match grads.into() {
            ShardedGrads::Whole(g) => sharded_step_owned(z, model, g, comm, lr, &mut take)?,
            ShardedGrads::Reduced(r) => sharded_step_reduced(z, model, r, comm, lr, &mut take)?,
        };
        match failed {
            Some(e) => Err(e),
            None => Ok(stepped),
        }
    }

    /// Parameter servers' exchange and commit in one: this worker's gradient `grad` (the sum
    /// over `samples` samples, still multiplied by fp16's loss scale when there is a scaler)
    /// pushed to the servers, which apply the mode's rule, and the values pulled into
    /// `params`. fp16: the gradient is divided by the scale, and one that is not finite is
    /// left out (this worker's scale halves): the step still counts (sync: its share of the
    /// round weighs nothing; asynchronous modes: no local update, the exchanges keep their
    /// rhythm). Workers never exchange gradients with each other, so each decides for its
    /// own. Whether this worker's gradient went in. `optim.clip_grad` is the servers' (sync:
    /// the round's mean, by the norm over every shard) or the worker's local steps'
    /// (asynchronous modes), set up with the session.
    pub(super) fn served(
        self,
        ps: &mut PsWorker,
        params: &mut Vec<f32>,
        mut grad: Vec<f32>,
        samples: u64,
    ) -> Result<bool> {
        if let Some(s) = self.scaler {
            let finite = unscale_flat(&mut grad, s.scale());
            if !s.decide(finite) {
                ps.skip(params)?;
                return Ok(false);
            }
        }
        ps.step(params, &grad, samples)?;
        Ok(true)
    }
}
