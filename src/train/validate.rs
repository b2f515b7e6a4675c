//! [`TrainConfig::validate`]: every setting checked alone and together before anything is read
//! or launched, so that a combination a mode cannot run is an error naming the flag. It sits
//! above the settings and the modes it asks (the model catalogue, the parameter servers'
//! roles), so that the settings themselves depend on none of them.

use super::TrainConfig;
use super::catalog::model_config;
use super::ps::Roles;
use crate::settings::{
    DEFAULT_MOMENTUM, EASGD_PEAK_ALPHA, ElasticOptions, FinetuneBn, OptimizerKind, PipelineOptions,
    PsOptions, TrainingMode,
};
use crate::{HearthError, Result};

impl TrainConfig {
    /// Checks the settings, alone and together: every combination a mode cannot run is an
    /// error naming the flag (and why), before anything is read or launched.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        // An unknown --model is said before any data is read or generated.
        model_config(&self.model.name, 2)?;
        self.validate_run()?;
        self.validate_fine_tuning()?;
        let monitor = self.checkpoint.monitor;
        if monitor.auroc() && self.data.labels.is_none() {
            return bad(format!(
                "`checkpoint.monitor` {} needs a multi-label data set (`data.labels` FILE.csv)",
                monitor.column()
            ));
        }
        if monitor.averaged() && self.optim.model_ema.is_none() {
            return bad(format!(
                "`checkpoint.monitor` {} reads the weight average: it needs `optim.model_ema`",
                monitor.column()
            ));
        }
        if self.exchange.bucket_bytes == Some(0) {
            return bad("`exchange.bucket_bytes` must be positive".into());
        }
        self.validate_optimizer()?;
        self.validate_batches()?;
        match &self.mode {
            TrainingMode::Pipeline(p) => self.validate_pipeline(p)?,
            TrainingMode::Elastic(e) => self.validate_elastic(e)?,
            TrainingMode::ParameterServers(p) => self.validate_ps(p)?,
            TrainingMode::DataParallel => {}
        }
        self.validate_zero()?;
        self.validate_overlap()?;
        self.validate_exchange()
    }

    /// The run's length, rate, smoothing and early stopping.
    fn validate_run(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if self.batch_size == 0 {
            return bad("`batch_size` must be at least 1 (got 0)".into());
        }
        if self.epochs == 0 {
            return bad("`epochs` must be at least 1".into());
        }
        // Each would not do what it says within the run's epochs.
        let epochs = self.epochs;
        let warmup = self.optim.warmup_epochs;
        if warmup > epochs {
            return bad(format!(
                "`optim.warmup_epochs` {warmup} is longer than the run (`epochs` {epochs}): the \
                 learning rate would never reach `optim.lr`"
            ));
        }
        if let Some(stop) = self.checkpoint.stop_after_epoch.filter(|&s| s > epochs) {
            return bad(format!(
                "`checkpoint.stop_after_epoch` {stop} is past the run's last epoch (`epochs` \
                 {epochs}): it would stop nothing"
            ));
        }
        let off = self.data.mixup_off_epoch;
        if off >= epochs {
            return bad(format!(
                "`data.mixup_off_epoch` {off} is not before the run's last epoch (`epochs` \
                 {epochs}): mixing would never stop"
            ));
        }
        if !(self.optim.lr.is_finite() && self.optim.lr > 0.0) {
            return bad(format!("`optim.lr` {} must be positive", self.optim.lr));
        }
        if let Some(c) = self.optim.clip_grad
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("`optim.clip_grad` {c} must be a positive norm"));
        }
        if let Some(d) = self.optim.model_ema
            && !(d > 0.0 && d < 1.0)
        {
            return bad(format!("`optim.model_ema` decay {d} must be in (0, 1)"));
        }
        if !(0.0..1.0).contains(&self.optim.label_smoothing) {
            return bad("`optim.label_smoothing` must be in [0, 1)".into());
        }
        if self.optim.label_smoothing > 0.0 && self.data.labels.is_some() {
            return bad(
                "`optim.label_smoothing` smooths single-label cross-entropy; a multi-label run \
                 (`data.labels`) trains one sigmoid per class with binary cross-entropy"
                    .into(),
            );
        }
        if !(self.checkpoint.min_delta.is_finite() && self.checkpoint.min_delta >= 0.0) {
            return bad(format!(
                "`checkpoint.min_delta` {} must be 0 or more",
                self.checkpoint.min_delta
            ));
        }
        if self.checkpoint.log_every == Some(0) {
            return bad("`checkpoint.log_every` must be at least 1 step".into());
        }
        if self.checkpoint.patience == Some(0) {
            return bad("`checkpoint.patience` must be at least 1".into());
        }
        Ok(())
    }

    /// `--unfreeze-after`, `--finetune-bn` and `--finetune-lr`, which go together.
    fn validate_fine_tuning(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if let Some(n) = self.model.unfreeze_after {
            if !self.model.freeze_backbone {
                return bad("`model.unfreeze_after` needs `model.freeze_backbone`".into());
            }
            if n == 0 || n >= self.epochs {
                return bad(format!(
                    "`model.unfreeze_after` {n} must be between 1 and `epochs` - 1 ({})",
                    self.epochs - 1
                ));
            }
        }
        if self.model.finetune_bn != FinetuneBn::default()
            && (self.model.unfreeze_after.is_none() || !self.model.freeze_backbone)
        {
            return bad(
                "`model.finetune_bn` applies to the fine-tuning phase: it needs `model.freeze_backbone` \
                 `model.unfreeze_after` N"
                    .into(),
            );
        }
        if let Some(lr) = self.model.finetune_lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return bad(format!("`model.finetune_lr` {lr} must be positive"));
        }
        Ok(())
    }

    /// Accumulation, how the global batch divides over the replicas, the input size and
    /// augmentation.
    fn validate_batches(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if self.optim.grad_accum == Some(0) {
            return bad("`optim.grad_accum` must be at least 1".into());
        }
        // The global batch is split over the data-parallel replicas: every rank, or every
        // pipeline (a pipeline's stages share their replica's batch).
        let parts = match (&self.dist, &self.mode) {
            (Some(d), TrainingMode::Pipeline(p)) => {
                Some(((d.world / p.stages.max(1)).max(1), "pipelines"))
            }
            (Some(d), TrainingMode::DataParallel) => Some((d.world, "ranks")),
            _ => None,
        };
        if let Some((parts, what)) = parts
            && !self.batch_size.is_multiple_of(parts)
        {
            return bad(format!(
                "`batch_size` {} (the global batch) must divide evenly over {parts} {what}",
                self.batch_size
            ));
        }
        if self.data.image_size < hearth_models::MIN_INPUT_SIZE as u32 {
            return bad(format!(
                "`data.image_size` {} is below the minimum of {}",
                self.data.image_size,
                hearth_models::MIN_INPUT_SIZE
            ));
        }
        // Checked here, not first where a folder is split or read: a dry run says it, and a
        // run stops before it makes its folder.
        let fraction = self.data.val_fraction;
        if fraction.is_nan() || fraction <= 0.0 || fraction >= 1.0 {
            return bad(format!(
                "`data.val_fraction` {fraction} must be in (0, 1): the share of a folder held out"
            ));
        }
        // The generated set comes with its own val/ (`data.folder` splits a folder).
        if self.data.folder.is_none()
            && self.data.labels.is_none()
            && fraction != super::DataSettings::default().val_fraction
        {
            return bad(format!(
                "`data.val_fraction` {fraction}: without `data.folder` the generated synthetic \
                 set is used, and its own val/ is the validation set (nothing is split)"
            ));
        }
        if self.data.workers == 0 {
            return bad("`data.workers` 0: at least 1 thread decodes the images".into());
        }
        let decay = self.optim.weight_decay;
        if decay.is_nan() || decay < 0.0 {
            return bad(format!("`optim.weight_decay` {decay} must be 0 or more"));
        }
        if let Some(price) = self.price_per_hour.filter(|p| p.is_nan() || *p < 0.0) {
            return bad(format!("`price_per_hour` {price} must be 0 or more"));
        }
        if self.checkpoint.stop_after_epoch == Some(0) {
            return bad(
                "`checkpoint.stop_after_epoch` 0: the run would end before its first epoch".into(),
            );
        }
        if self.data.image_size > hearth_datasets::MAX_IMAGE_SIZE {
            return bad(format!(
                "`data.image_size` {} is above the maximum of {}",
                self.data.image_size,
                hearth_datasets::MAX_IMAGE_SIZE
            ));
        }
        self.data.augmentation.pipeline(self.data.image_size)?;
        if let Some((name, why)) = self.data.mixing().check() {
            return bad(format!("`data.{name}` {why}"));
        }
        Ok(())
    }

    /// `--pipeline-stages` and what goes with it.
    fn validate_pipeline(&self, p: &PipelineOptions) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if p.stages == 0 || p.micro_batches == 0 {
            return bad(
                "`PipelineOptions.stages` and `PipelineOptions.micro_batches` must be at least 1"
                    .into(),
            );
        }
        if let Some(split) = &p.split
            && split.len() != p.stages
        {
            return bad(format!(
                "`PipelineOptions.split` gives {} stages, `PipelineOptions.stages` {}",
                split.len(),
                p.stages
            ));
        }
        // The split must cover the model's units exactly (known from its name alone).
        if let Some(end) = p.split.as_ref().and_then(|s| s.last()).map(|r| r.end) {
            let units = model_config(&self.model.name, 2)?.units();
            if end != units {
                return bad(format!(
                    "`PipelineOptions.split` ends at unit {end}, but `model.name` {} has {units} units \
                     (0..{units}; `ModelConfig::init_units` gives them, each with its `kind`)",
                    self.model.name
                ));
            }
        }
        // Without a meaning here: a pipeline's micro-batches are its accumulation.
        if self.optim.grad_accum.is_some() {
            return bad(
                "`optim.grad_accum` does not apply to `PipelineOptions.stages`: a pipeline step \
                        already sums the gradients of `PipelineOptions.micro_batches` micro-batches; raise \
                        `PipelineOptions.micro_batches` (and `batch_size`) instead"
                    .into(),
            );
        }
        Ok(())
    }

    /// `--elastic`'s worker bounds against the batch and the modes it cannot join.
    fn validate_elastic(&self, e: &ElasticOptions) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if e.min_workers == 0 || e.min_workers > e.max_workers {
            return bad(format!(
                "`ElasticOptions.min_workers` {} and `ElasticOptions.max_workers` {} need 1 <= min <= max",
                e.min_workers, e.max_workers
            ));
        }
        if self.batch_size < e.max_workers {
            return bad(format!(
                "`batch_size` {} (the global batch) must give each of `ElasticOptions.max_workers` {} a sample",
                self.batch_size, e.max_workers
            ));
        }
        Ok(())
    }

    /// The optimizer's settings: momentum and Nesterov only where the optimizer has them.
    fn validate_optimizer(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        let name = match self.optim.optimizer {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Lars => "lars",
        };
        let momentum = self.momentum();
        if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
            return bad(format!("`optim.momentum` {momentum} must be in [0, 1)"));
        }
        let adaptive = matches!(
            self.optim.optimizer,
            OptimizerKind::Adam | OptimizerKind::AdamW
        );
        // hparams.json records 0.9 for adam runs too: only another value is refused.
        if adaptive && self.optim.momentum.is_some_and(|m| m != DEFAULT_MOMENTUM) {
            return bad(format!(
                "`optim.momentum` {momentum} applies to sgd and lars; `optim.optimizer` {name} keeps its own \
                 moment estimates (betas 0.9 and 0.999)"
            ));
        }
        if self.optim.nesterov {
            if self.optim.optimizer != OptimizerKind::Sgd {
                return bad(format!(
                    "`optim.nesterov` applies to `optim.optimizer` sgd; {name} has no Nesterov variant here"
                ));
            }
            if momentum == 0.0 {
                return bad(format!(
                    "`optim.nesterov` needs `optim.momentum` above 0 (0 is plain SGD{})",
                    if self.optim.momentum.is_none() {
                        ", this mode's default"
                    } else {
                        ""
                    }
                ));
            }
        }
        Ok(())
    }

    /// `--overlap`: data parallel over two ranks or more, or elastic; what it does not work
    /// with refused by name.
    fn validate_overlap(&self) -> Result<()> {
        if !self.exchange.overlap {
            return Ok(());
        }
        let why = if self.mode.ps().is_some() {
            Some(
                "`TrainingMode::ParameterServers` (workers exchange values with the servers, not by allreduce)",
            )
        } else if self.mode.pipeline().is_some() {
            Some("`PipelineOptions.stages` (not built: a stage's replicas exchange after its step)")
        } else if self.exchange.zero > 0 && self.mode.elastic().is_some() {
            Some(
                "`exchange.zero` in `TrainingMode::Elastic` (not built: its sharded step reduces \
                 after the backward, with the members of the step)",
            )
        } else if self.optim.grad_accum.is_some_and(|k| k > 1) {
            Some("`optim.grad_accum` (a step's gradients are exchanged on its last backward only)")
        } else if self.mode.elastic().is_none() && self.dist.as_ref().is_none_or(|d| d.world < 2) {
            Some(
                "a one-process run: it exchanges no gradients (add `dist.world` N, or launch it as \
                 a job)",
            )
        } else {
            None
        };
        match why {
            Some(why) => Err(HearthError::InvalidArgument(format!(
                "`exchange.overlap` does not work with {why}"
            ))),
            None => Ok(()),
        }
    }

    /// `--zero`: data parallel over two ranks or more, and what is not built yet refused by
    /// name.
    fn validate_zero(&self) -> Result<()> {
        if self.exchange.zero == 0 {
            return Ok(());
        }
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if self.exchange.zero > 3 {
            return bad(format!(
                "`exchange.zero` {}: the stages are 0 (off), 1 (optimizer state sharded), 2 (gradients \
                 too) and 3 (parameters too)",
                self.exchange.zero
            ));
        }
        if self.exchange.zero == 3 {
            self.validate_zero_3()?;
        }
        let mode = if self.mode.ps().is_some() {
            Some(
                "`TrainingMode::ParameterServers`: its servers already hold the optimizer state, sharded",
            )
        } else if let Some(p) = self.mode.pipeline() {
            // A stage's replicas shard its state: P stages x D replicas, D at least 2.
            let world = self.dist.as_ref().map_or(1, |d| d.world);
            (world / p.stages.max(1) < 2).then_some(
                "`PipelineOptions.stages` and one replica per stage: `exchange.zero` shards a stage's state over \
                 its replicas (`dist.world` P x D with D of 2 or more)",
            )
        } else if self.mode.elastic().is_some()
            && self.model.freeze_backbone
            && self.model.unfreeze_after.is_some()
        {
            Some(
                "`TrainingMode::Elastic` and `model.unfreeze_after`: not built yet (the fine-tuning switch would \
                 re-shard the state over the tensors it adds)",
            )
        } else {
            None
        };
        if let Some(why) = mode {
            return bad(format!("`exchange.zero` does not work with {why}"));
        }
        // An elastic job's workers come and go (a joiner has no launch world at all).
        if self.mode.elastic().is_none() && self.dist.as_ref().is_none_or(|d| d.world < 2) {
            return bad(format!(
                "`exchange.zero` {} shards the optimizer over data-parallel ranks, and a one-process run \
                 has one: add `dist.world` N (or launch it as a job)",
                self.exchange.zero
            ));
        }
        Ok(())
    }

    /// `--zero 3`: data parallel alone, and what it does not work with yet refused by name.
    fn validate_zero_3(&self) -> Result<()> {
        let why = if self.mode.elastic().is_some() {
            Some(
                "`TrainingMode::Elastic` (not built: a change of membership would re-shard the parameters)",
            )
        } else if self.mode.pipeline().is_some() {
            Some("`PipelineOptions.stages` (not built: stage 3 shards data parallel's whole model)")
        } else if self.optim.model_ema.is_some() {
            Some(
                "`optim.model_ema` (not built: the average would hold the whole model on every rank)",
            )
        } else if self.model.freeze_backbone {
            Some("`model.freeze_backbone` (not built: a phase change would cut the shards again)")
        } else if self.optim.grad_accum.is_some_and(|k| k > 1) {
            Some("`optim.grad_accum` (not built: each unit's gradients leave as its backward ends)")
        } else {
            None
        };
        match why {
            Some(why) => Err(HearthError::InvalidArgument(format!(
                "`exchange.zero` 3 does not work with {why}"
            ))),
            None => Ok(()),
        }
    }

    /// `--compression` and `--bucket-mb` shape the gradients ranks exchange by allreduce: an
    /// error where a run exchanges none (one process, a pipeline of one replica) or exchanges
    /// them otherwise (parameter servers).
    fn validate_exchange(&self) -> Result<()> {
        let (allreduce, why) = self.allreduce_exchange();
        if allreduce {
            return Ok(());
        }
        if self.exchange.compression != burn_dist::Compression::None && self.mode.ps().is_none() {
            return Err(HearthError::InvalidArgument(format!(
                "`exchange.compression` {} does not apply: {why}",
                self.exchange.compression.name()
            )));
        }
        if self.exchange.bucket_bytes.is_some() {
            return Err(HearthError::InvalidArgument(format!(
                "`exchange.bucket_bytes` does not apply: {why}"
            )));
        }
        Ok(())
    }

    /// Whether this run averages gradients by allreduce (so `--compression` applies), and if
    /// not, why.
    pub fn exchanges_by_allreduce(&self) -> bool {
        self.allreduce_exchange().0
    }

    fn allreduce_exchange(&self) -> (bool, &'static str) {
        let ranks = self.dist.as_ref().map_or(1, |d| d.world);
        match &self.mode {
            TrainingMode::ParameterServers(_) => (
                false,
                "`TrainingMode::ParameterServers` exchanges values with the servers, not by allreduce",
            ),
            TrainingMode::Elastic(_) => (true, ""),
            TrainingMode::Pipeline(p) => (
                ranks > p.stages,
                "a pipeline of one replica has no gradients to average (add replicas: `dist.world` \
                 a multiple of `PipelineOptions.stages`)",
            ),
            TrainingMode::DataParallel => (ranks > 1, "a one-process run exchanges no gradients"),
        }
    }

    fn validate_ps(&self, p: &PsOptions) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if p.window == Some(0) {
            return bad("`PsOptions.window` must be at least 1".into());
        }
        // A setting the mode does not read is refused, not ignored.
        let mode = p.mode.name();
        if let Some(rho) = p.rho {
            if !(rho.is_finite() && rho > 0.0) {
                return bad(format!("`PsOptions.rho` {rho} must be positive"));
            }
            if p.mode != burn_dist::ps::Mode::Easgd {
                return bad(format!(
                    "`PsOptions.rho` {rho} is EASGD's elastic force; `PsOptions.mode` {mode} does not use it (`PsOptions.mode` \
                     easgd does)"
                ));
            }
            // α = rate · ρ above 1 moves a worker past the centre at each exchange.
            let peak = self
                .scaled_lr(&mut |_| {})?
                .max(self.model.finetune_lr.unwrap_or(0.0));
            if rho * peak > 1.0 {
                return bad(format!(
                    "`PsOptions.rho` {rho} with a peak rate of {peak} makes EASGD's elastic force α = rate x \
                     rho {} (above 1 a worker overshoots the centre at each exchange); give \
                     `PsOptions.rho` at most {} or leave it out (α = {} at the peak)",
                    rho * peak,
                    1.0 / peak,
                    EASGD_PEAK_ALPHA
                ));
            }
        }
        if p.mode == burn_dist::ps::Mode::Sync {
            if let Some(w) = p.window {
                return bad(format!(
                    "`PsOptions.window` {w} sets how often an asynchronous worker exchanges; `PsOptions.mode` sync \
                     exchanges every step"
                ));
            }
            if let Some(s) = p.staleness {
                return bad(format!(
                    "`PsOptions.staleness` {s} bounds how far asynchronous workers run ahead; `PsOptions.mode` sync \
                     waits for every worker at every step"
                ));
            }
        }
        if let Some(d) = &self.dist {
            let roles = Roles::new(p.servers, d.world)?;
            if !self.batch_size.is_multiple_of(roles.workers) {
                return bad(format!(
                    "`batch_size` {} (the global batch) must divide evenly over {} workers",
                    self.batch_size, roles.workers
                ));
            }
        }
        // Combinations without a meaning here, refused for good.
        if self.optim.optimizer == OptimizerKind::Lars {
            return bad(
                "`optim.optimizer` lars does not work with `TrainingMode::ParameterServers`: a server holds slices of layers, and \
                 LARS's trust ratio needs each layer's whole norm"
                    .into(),
            );
        }
        if self.exchange.compression != burn_dist::Compression::None {
            return bad(format!(
                "`exchange.compression` {} does not apply to `TrainingMode::ParameterServers`: workers and servers exchange exact \
                 f32 values (it compresses allreduce traffic)",
                self.exchange.compression.name()
            ));
        }
        Ok(())
    }

    /// Settings that run but are probably not what was meant, each a sentence.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.model.freeze_backbone && self.model.weights.is_none() {
            out.push(
                "`model.freeze_backbone` without `model.weights` freezes a randomly initialised backbone: \
                 only the head learns, on random features (give `model.weights` to fine-tune a \
                 pretrained network)"
                    .into(),
            );
        }
        out
    }
}
