//! `hearth train`'s flags (clap): what each sets, its default, and the flags it goes with.

use std::path::PathBuf;

use clap::Args;
use hearth::dist::Compression;
use hearth::dist::pipeline::Schedule;
use hearth::schedule::{LrScaling, ScheduleKind};
use hearth::train::{AugmentPreset, FinetuneBn, Monitor, OptimizerKind, PipelineBalance};

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Image folder: train/ and val/ class folders, or one folder split by --val-fraction.
    /// Without it a synthetic data set is generated into the run directory.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Multi-label CSV (`path,label1|label2|...`; paths relative to --data or the CSV's folder):
    /// one sigmoid per label, binary cross-entropy, per-class AUROC (CheXNet style).
    #[arg(long)]
    pub(crate) labels: Option<PathBuf>,
    /// Share of the images held out for validation when --data has no val/ (stratified by
    /// class, seeded by --seed).
    #[arg(long, default_value_t = 0.2)]
    pub(crate) val_fraction: f64,
    /// torchvision name (resnet50, densenet121, vgg16, ...), or a small test-size network:
    /// resnet-mini (the default), vgg-mini, vgg-mini-plain (no batch norm, no dropout),
    /// densenet-mini.
    #[arg(long, default_value = hearth::train::DEFAULT_MODEL)]
    pub(crate) model: String,
    /// torchvision weights to start from (a file, or `imagenet`: torchvision's ImageNet weights
    /// of --model, downloaded once into Hearth's cache); the head is replaced to fit the data's
    /// classes.
    #[arg(long)]
    pub(crate) weights: Option<PathBuf>,
    /// Train only the new head.
    #[arg(long)]
    pub(crate) freeze_backbone: bool,
    /// With --freeze-backbone: after N epochs, unfreeze everything and fine-tune at
    /// --finetune-lr (early-stopping patience counts from then).
    #[arg(long, requires = "freeze_backbone")]
    pub(crate) unfreeze_after: Option<usize>,
    /// Learning rate of the fine-tuning phase (default: --lr / 10).
    #[arg(long, requires = "unfreeze_after")]
    pub(crate) finetune_lr: Option<f64>,
    /// Batch norm in the fine-tuning phase: `frozen` normalises by the running statistics of
    /// the frozen phase and keeps them (scales and shifts still train; Keras's way, robust to
    /// small per-rank batches), `batch` by each batch's statistics (PyTorch's train mode).
    #[arg(long, value_enum, default_value_t = FinetuneBn::Frozen, requires = "unfreeze_after")]
    pub(crate) finetune_bn: FinetuneBn,
    /// Passes over the training set.
    #[arg(long, default_value_t = 12)]
    pub(crate) epochs: usize,
    /// The global batch: images per optimizer step over all ranks together (split evenly
    /// over data-parallel ranks or pipelines).
    #[arg(long, default_value_t = 32)]
    pub(crate) batch_size: usize,
    /// Peak learning rate (after --scale-lr), reached after --warmup-epochs and decayed by
    /// --schedule.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) lr: f64,
    /// The optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    pub(crate) optimizer: OptimizerKind,
    /// SGD and LARS momentum (PyTorch semantics: no dampening; 0 for plain SGD). Refused with
    /// adam and adamw, which keep their own moment estimates.
    /// (default 0.9; 0 in the local steps of --mode downpour and dynsgd, whose servers add up
    /// the workers' changes)
    #[arg(long)]
    pub(crate) momentum: Option<f64>,
    /// Nesterov momentum (SGD with momentum above 0).
    #[arg(long)]
    pub(crate) nesterov: bool,
    /// L2 weight decay (SGD, Adam: not applied to biases and batch norm; AdamW: decoupled).
    #[arg(long, default_value_t = 5e-4)]
    pub(crate) weight_decay: f64,
    /// Learning-rate decay after warmup.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    pub(crate) schedule: ScheduleKind,
    /// Epochs of linear warmup from 0 to --lr before the --schedule decay.
    #[arg(long, default_value_t = 1)]
    pub(crate) warmup_epochs: usize,
    /// Scale --lr by the batch ratio: linear (Goyal et al.) or sqrt.
    #[arg(long, value_enum, requires = "base_batch")]
    pub(crate) scale_lr: Option<LrScaling>,
    /// The batch size --lr was tuned for (with --scale-lr).
    #[arg(long, requires = "scale_lr")]
    pub(crate) base_batch: Option<usize>,
    /// Scale each step's gradients down to at most this global L2 norm (PyTorch's
    /// clip_grad_norm_; the norm over every parameter, across ranks and pipeline stages).
    #[arg(long, value_name = "NORM")]
    pub(crate) clip_grad: Option<f64>,
    /// Keep an exponential moving average of the weights (timm's --model-ema), updated after
    /// every optimizer step, validated each epoch (val_ema_loss, val_ema_accuracy) and
    /// exported from the best epoch as model_ema.bpk. One process, data parallel and elastic.
    #[arg(long)]
    pub(crate) model_ema: bool,
    /// The average's decay per step, with --model-ema [default: 0.9998, timm's].
    #[arg(long, value_name = "D")]
    pub(crate) model_ema_decay: Option<f64>,
    /// Label smoothing of the cross-entropy loss, in [0, 1) (single-label sets).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) label_smoothing: f32,
    /// Metric for early stopping and the exported (best) epoch; val_auroc needs multi-label data.
    #[arg(long, value_enum, default_value_t = Monitor::ValAccuracy)]
    pub(crate) monitor: Monitor,
    /// Stop after this many epochs without improvement of --monitor.
    #[arg(long)]
    pub(crate) patience: Option<usize>,
    /// Smallest change of --monitor that counts as an improvement, for early stopping and for
    /// picking the exported epoch.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) min_delta: f64,
    /// Input side in pixels.
    #[arg(long, default_value_t = 32)]
    pub(crate) size: u32,
    /// Training augmentation recipe; the flags below adjust it. light suits short fine-tuning
    /// runs and small data sets; imagenet is torchvision's recipe for long runs on large sets.
    #[arg(long, value_enum, default_value_t = AugmentPreset::Light)]
    pub(crate) augment: AugmentPreset,
    /// Random resized crop of MIN,MAX of the image area (e.g. 0.5,1), replacing the preset's.
    #[arg(long, value_name = "MIN,MAX")]
    pub(crate) crop_scale: Option<String>,
    /// Random horizontal flips (on in light and imagenet).
    #[arg(long, overrides_with = "no_flip")]
    pub(crate) flip: bool,
    /// No flips: for text, digits, and images whose left and right differ in meaning.
    #[arg(long, overrides_with = "flip")]
    pub(crate) no_flip: bool,
    /// Random rotation up to DEG degrees either way.
    #[arg(long, value_name = "DEG")]
    pub(crate) rotate: Option<f64>,
    /// Random horizontal shear up to DEG degrees either way.
    #[arg(long, value_name = "DEG")]
    pub(crate) shear: Option<f64>,
    /// Brightness, contrast and saturation jitter of up to X (0-1).
    #[arg(long, value_name = "X")]
    pub(crate) color_jitter: Option<f64>,
    /// torchvision's RandomErasing with probability P (0-1): a box of 2-33% of the image set
    /// to the mean colour.
    #[arg(long, value_name = "P")]
    pub(crate) random_erasing: Option<f64>,
    /// RandAugment, TrivialAugmentWide or AugMix after the flip, as torchvision defines them:
    /// rand-mM-nN (N operations at magnitude bin M of 0-30; rand is rand-m9-n2, timm's
    /// spelling), trivialaugment (also ta_wide), or augmix-mS-wW-dD-aA (severity S of 1-10,
    /// W chains of depth D, 0 drawing 1-3, Dirichlet/Beta alpha A; augmix is m3-w3-d0-a1).
    /// Alias --aa.
    #[arg(long, visible_alias = "aa", value_name = "POLICY")]
    pub(crate) auto_augment: Option<String>,
    /// Mixup on training batches: each image blended with the one before it in the batch,
    /// the weight drawn per batch from Beta(ALPHA, ALPHA), the labels mixed alike (timm's
    /// --mixup; 0.2 is common).
    #[arg(long, value_name = "ALPHA", default_value_t = 0.0)]
    pub(crate) mixup: f64,
    /// CutMix on training batches: a box of the image before it pasted in, its size from
    /// Beta(ALPHA, ALPHA), the labels mixed by the area (timm's --cutmix; 1.0 is common).
    #[arg(long, value_name = "ALPHA", default_value_t = 0.0)]
    pub(crate) cutmix: f64,
    /// Probability that a batch is mixed at all, with --mixup or --cutmix.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub(crate) mixup_prob: f64,
    /// With --mixup and --cutmix both on: the probability that a batch takes cutmix.
    #[arg(long, value_name = "P", default_value_t = 0.5)]
    pub(crate) mixup_switch_prob: f64,
    /// Stop mixing after this epoch (0: never), as timm's --mixup-off-epoch.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) mixup_off_epoch: usize,
    /// Decoding threads.
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: usize,
    /// Seed of the initialisation, the data split, the shuffling and the augmentation: the
    /// same seed and flags train the same run.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Default: runs/<timestamp>.
    #[arg(long)]
    pub(crate) run_dir: Option<PathBuf>,
    /// Continue the run in this directory from its last checkpoint.
    #[arg(long, conflicts_with = "run_dir")]
    pub(crate) resume: Option<PathBuf>,
    /// Replace the run already in --run-dir (its metrics, checkpoints and model files are
    /// deleted first); without it, a --run-dir holding a run is an error.
    #[arg(long, conflicts_with = "resume")]
    pub(crate) overwrite: bool,
    /// End this run after that epoch (its checkpoint written); --resume continues it exactly.
    #[arg(long)]
    pub(crate) stop_after_epoch: Option<usize>,
    /// TensorBoard scalars of the training loss, accuracy and rate every N optimizer steps
    /// (events.out.tfevents.hearth.steps in the run directory), beside the per-epoch ones.
    #[arg(long, value_name = "N")]
    pub(crate) log_every: Option<usize>,
    /// Price of one process-hour (a GPU or a machine per rank), for the cost line of the
    /// summary: the job's wall time times its processes (an elastic job: its worker-hours).
    #[arg(long)]
    pub(crate) price_per_hour: Option<f64>,
    /// Accumulate gradients over K micro-batches per optimizer step (in a distributed run they
    /// are averaged across ranks only on the K-th).
    #[arg(long)]
    pub(crate) grad_accum: Option<usize>,
    /// Train data parallel on N local processes (`hearth launch`); --batch-size stays the global
    /// batch. Inside a launched job (HEARTH_RANK, torchrun, Slurm or mpirun variables) the rank
    /// joins that job instead.
    #[arg(long, default_value_t = 1)]
    pub(crate) nproc: usize,
    /// Gradient fusion bucket size in MiB (allreduce: data parallel, elastic, pipeline replicas;
    /// --zero: the buckets each rank keeps a segment of) [default: 25; 1 with --zero 3]. With
    /// --zero 3 also how finely parameters are gathered and reduced: small buckets (1) gather a
    /// weight, or a piece of rows of a larger one, at a time and reduce each as soon as its
    /// gradient is whole, for less memory per rank and more, smaller exchanges; 25 gathers a
    /// unit's weights whole.
    #[arg(long, value_name = "MIB")]
    pub(crate) bucket_mb: Option<f64>,
    /// Wire format of gradient averaging in distributed runs (default: the training
    /// precision's, so none in fp32, bf16 in a bf16 run, fp16 in an fp16 run).
    #[arg(long, value_enum)]
    pub(crate) compression: Option<Compression>,
    /// The type steps compute in: fp32, or bf16/fp16 mixed precision with f32 master weights
    /// (fp16 with dynamic loss scaling; skipped steps in metrics.csv). Every mode; wgpu
    /// devices have no bf16.
    #[arg(long, value_enum, default_value_t = hearth::train::Precision::Fp32)]
    pub(crate) precision: hearth::train::Precision,
    /// Sharded optimizer (ZeRO) in data parallel, pipelines with replicas and elastic
    /// training: 1 keeps 1/N of the optimizer state on each of the N ranks, 2 the averaged
    /// gradients too, 3 (data parallel, Hearth's models) the parameters too, each unit's
    /// gathered for its forward and backward (with --recompute one unit's at a time); 0 off
    /// (elastic workers also keep a replica of the next one's share, so a lost worker loses no
    /// state). The state is checkpointed as whole named tensors, so a run resumes on any number
    /// of ranks. With --overlap (data parallel), each bucket of the gradient is reduced during
    /// the backward pass and dropped at once: stage 2's saving (stage 3: on a thread of its own
    /// while the next unit is gathered).
    #[arg(long, value_name = "STAGE", default_value_t = 0)]
    pub(crate) zero: u8,
    /// Activation recomputation: keep only each unit's input (a ResNet block, a DenseNet
    /// layer; in pipelines each stage's) from the forward and compute the unit again in the
    /// backward. Less memory for one more forward per step; every mode of the image models.
    #[arg(long, overrides_with = "no_recompute")]
    pub(crate) recompute: bool,
    /// No activation recomputation (the default): turns a resumed run's --recompute off.
    #[arg(long, overrides_with = "recompute")]
    pub(crate) no_recompute: bool,
    /// Data parallel and elastic: overlap the gradient exchange with the backward pass. The
    /// model runs unit by unit and each unit's gradients are averaged, in --bucket-mb buckets,
    /// while the units before it compute (as PyTorch DDP's buckets do). The same result as
    /// without it. Pays off between hosts (1 Gbit/s: a ResNet-50 step 20% shorter); on one
    /// host the exchange shares the backward pass's cores and measured no faster.
    #[arg(long)]
    pub(crate) overlap: bool,
    /// Pipeline model parallelism: split the model into P stages, one per process (--nproc
    /// defaults to P; a multiple P x D trains D pipelines data parallel).
    #[arg(long, value_name = "P")]
    pub(crate) pipeline_stages: Option<usize>,
    /// Micro-batches per step of each pipeline (its batch is cut into M).
    /// (default 4)
    #[arg(long, value_name = "M", requires = "pipeline_stages")]
    pub(crate) micro_batches: Option<usize>,
    /// Pipeline schedule: 1f1b holds at most P micro-batches of activations, gpipe all M.
    /// (default 1f1b)
    #[arg(long, value_enum, requires = "pipeline_stages")]
    pub(crate) pipeline_schedule: Option<Schedule>,
    /// Unit ranges of the stages, e.g. 0:2,2:5 (default: balanced by --pipeline-balance).
    #[arg(long, value_name = "A:B,...", requires = "pipeline_stages")]
    pub(crate) pipeline_split: Option<String>,
    /// How the stages are balanced when no --pipeline-split is given.
    /// (default params)
    #[arg(long, value_enum, requires = "pipeline_stages")]
    pub(crate) pipeline_balance: Option<PipelineBalance>,
    /// Elastic data parallelism: workers may join and leave between steps while the global
    /// batch stays --batch-size (run under `hearth launch --elastic`, or join a running job
    /// given HEARTH_ELASTIC_PEERS or --hosts).
    #[arg(long, conflicts_with = "pipeline_stages")]
    pub(crate) elastic: bool,
    /// Fewest workers an elastic job trains with; below it, it waits --rejoin-timeout for
    /// joiners, then saves its state and fails.
    /// (default 1)
    #[arg(long, requires = "elastic")]
    pub(crate) min_workers: Option<usize>,
    /// Most workers an elastic job admits (later joiners wait for room); default 64, or
    /// --batch-size when smaller (each worker needs a sample of the global batch).
    #[arg(long, requires = "elastic")]
    pub(crate) max_workers: Option<usize>,
    /// Seconds an elastic job below --min-workers waits for joiners.
    /// (default 300)
    #[arg(long, requires = "elastic")]
    pub(crate) rejoin_timeout: Option<f64>,
    /// How an elastic job shares the global batch: even, or by each worker's measured speed.
    /// (default even)
    #[arg(long, value_enum, requires = "elastic")]
    pub(crate) balance: Option<hearth::train::Balance>,
    /// File of elastic join addresses (host:port per line), re-read while joining.
    #[arg(long, requires = "elastic")]
    pub(crate) hosts: Option<PathBuf>,
    /// Parameter servers: P of the --nproc ranks serve the model's shards and the others
    /// train, or `colocated` (every rank trains and also serves a shard).
    #[arg(long, value_name = "P|colocated", conflicts_with_all = ["elastic", "pipeline_stages"])]
    pub(crate) ps: Option<String>,
    /// Parameter-server mode: sync (equals allreduce data parallel), downpour, adag, dynsgd,
    /// easgd (update rules and sources in `burn_dist::ps::rules`).
    /// (default adag)
    #[arg(long, requires = "ps")]
    pub(crate) mode: Option<String>,
    /// Steps between a worker's exchanges with the servers (asynchronous modes).
    /// (default 2 for downpour and easgd, 5 for adag and dynsgd)
    #[arg(long, requires = "ps")]
    pub(crate) window: Option<usize>,
    /// EASGD's rho: the elastic force is alpha = rate x rho, following the schedule (at most 1).
    /// (default: 0.5 / the peak rate, so that alpha is 0.5 at the peak)
    #[arg(long, requires = "ps")]
    pub(crate) rho: Option<f64>,
    /// Most steps a worker may run ahead of the slowest one (stale synchronous parallel).
    #[arg(long, value_name = "S", requires = "ps")]
    pub(crate) staleness: Option<u64>,
    /// Check the settings and print what hparams.json would record, then exit: no data is
    /// read, nothing is launched or written.
    #[arg(long)]
    pub(crate) dry_run: bool,
}
