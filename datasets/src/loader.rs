//! A streaming, sharded batch loader.
//!
//! - **Bounded memory**: only `prefetch` batches are in flight (decoding or decoded and waiting);
//!   the data set itself is a list of paths.
//! - **Parallel**: `workers` threads decode and augment whole batches.
//! - **Deterministic**: the epoch order is a seeded shuffle of (seed, epoch); augmentation is
//!   seeded by (seed, epoch, sample index). The same configuration yields the same batches.
//! - **Sharded**: rank `r` of `world` takes positions `r, r + world, ...` of the epoch order.
//!   Without `drop_last`, the order is **padded by repeating its first samples** until its length
//!   divides by `world` (as PyTorch's `DistributedSampler`), so every rank sees the same number of
//!   samples and batches (the last batch may be partial, equally on every rank). With
//!   `drop_last`, the tail that does not fill a whole batch on every rank is dropped. Either way
//!   every rank gets the same number of batches: one rank with an extra batch hangs a collective.
//! - **Resharding**: [`Loader::epoch_from`] restarts an epoch at a global position (samples
//!   already consumed by all ranks together) with a new world size; the remaining samples are
//!   dealt out afresh, none repeated or skipped beyond the padding above.
//! - **Bad files**: a file that fails to decode is counted (with its path) and replaced by the
//!   next sample in the epoch order that decodes, so batch counts never change; in strict mode it
//!   is an error.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use burn::prelude::*;

use crate::cache::DiskCache;
use crate::folder::{ImageSet, Problem, ProblemKind, Target};
pub use crate::order::{epoch_order, shard_of};
use crate::preprocess::decode_rgb;
use crate::transform::Pipeline;
use crate::{DataError, Result};

/// How to batch an [`ImageSet`].
#[derive(Debug, Clone)]
pub struct LoaderConfig {
    pub batch_size: usize,
    /// Decoding threads.
    pub workers: usize,
    /// Batches in flight at most (decoding plus ready).
    pub prefetch: usize,
    pub shuffle: bool,
    pub drop_last: bool,
    pub seed: u64,
    pub rank: usize,
    pub world_size: usize,
    /// Without `drop_last`, repeat the first samples so every rank gets as many (training, as
    /// PyTorch's DistributedSampler). Off: the shards are disjoint and may differ by one sample
    /// (validation, where each image must count once).
    pub pad: bool,
    /// Bad files are errors instead of being skipped.
    pub strict: bool,
}

impl LoaderConfig {
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            workers: 2,
            prefetch: 4,
            shuffle: true,
            drop_last: false,
            seed: 0,
            rank: 0,
            world_size: 1,
            pad: true,
            strict: false,
        }
    }
    pub fn with_workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }
    pub fn with_prefetch(mut self, n: usize) -> Self {
        self.prefetch = n;
        self
    }
    pub fn with_shuffle(mut self, on: bool) -> Self {
        self.shuffle = on;
        self
    }
    pub fn with_drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn with_shard(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self
    }
    pub fn with_pad(mut self, on: bool) -> Self {
        self.pad = on;
        self
    }
    pub fn with_strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// Checks the settings without reading any data: what [`Loader::new`] refuses.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DataError::InvalidArgument(m));
        if self.batch_size == 0 {
            return bad("batch size must be at least 1".into());
        }
        if self.workers == 0 || self.prefetch == 0 {
            return bad("workers and prefetch must be at least 1".into());
        }
        if self.world_size == 0 || self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not in a world of {}",
                self.rank, self.world_size
            ));
        }
        Ok(())
    }
}

/// Decoded, augmented samples on the host, before they become tensors.
#[derive(Debug)]
struct HostBatch {
    pixels: Vec<f32>,
    indices: Vec<usize>,
    problems: Vec<Problem>,
}

/// A batch on the device.
#[derive(Debug)]
pub struct Batch {
    /// `[n, 3, size, size]`, normalised.
    pub images: Tensor<4>,
    /// Class indices `[n]`; for a multi-label set, each sample's first label (0 for none).
    pub classes: Option<Tensor<1, Int>>,
    /// Multi-hot `[n, classes]` (multi-label sets).
    pub multi_hot: Option<Tensor<2>>,
    /// Data set indices of the samples, in batch order (after bad-file substitution).
    pub indices: Vec<usize>,
}

/// Batches an [`ImageSet`] through a [`Pipeline`].
#[derive(Clone)]
pub struct Loader {
    set: Arc<ImageSet>,
    pipeline: Arc<Pipeline>,
    config: LoaderConfig,
    cache: Option<Arc<DiskCache>>,
    problems: Arc<Mutex<Vec<Problem>>>,
    decoded: Arc<std::sync::atomic::AtomicUsize>,
}

impl Loader {
    pub fn new(set: ImageSet, pipeline: Pipeline, config: LoaderConfig) -> Result<Self> {
        config.validate()?;
        if set.is_empty() {
            return Err(DataError::Empty {
                path: set.root.clone(),
                reason: "no samples".into(),
            });
        }
        Ok(Self {
            set: Arc::new(set),
            pipeline: Arc::new(pipeline),
            config,
            cache: None,
            problems: Arc::default(),
            decoded: Arc::default(),
        })
    }

    /// Reads decoded images through an on-disk cache.
    pub fn with_cache(mut self, cache: DiskCache) -> Self {
        self.cache = Some(Arc::new(cache));
        self
    }

    pub fn set(&self) -> &ImageSet {
        &self.set
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// Samples decoded so far by this loader (all epochs): shows that streaming decodes only
    /// what is in flight.
    pub fn decoded_samples(&self) -> usize {
        self.decoded.load(Ordering::Relaxed)
    }

    /// Files that failed to decode so far, with their paths.
    pub fn decode_problems(&self) -> Vec<Problem> {
        self.problems.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// The epoch order of all ranks together (before padding).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        epoch_order(self.set.len(), self.config.seed, epoch, self.config.shuffle)
    }

    /// This rank's sample indices for the rest of an epoch that starts at global position
    /// `start` of [`Loader::epoch_order`], dealt over `world` ranks.
    pub fn shard_indices(&self, epoch: u64, start: usize, rank: usize, world: usize) -> Vec<usize> {
        let order = self.epoch_order(epoch);
        shard_of(
            &order[start.min(order.len())..],
            self.config.batch_size,
            rank,
            world,
            self.config.drop_last,
            self.config.pad,
        )
    }

    /// Elastic training's view of an epoch: every step consumes the next `global` samples of
    /// [`Loader::epoch_order`], and a worker takes `share` of them starting at `offset` within
    /// each step's slice. Returns this worker's sample indices of each step from global
    /// position `start` to the end of the epoch. The last, partial step of `r < global` samples
    /// is divided in the same proportions (the worker takes positions `offset*r/global ..
    /// (offset+share)*r/global` of it, rounded down, possibly none). Hence, when the workers'
    /// shares tile `0..global` and change only between steps (recomputed from the position
    /// reached), every sample of the epoch is seen exactly once: none skipped, none twice, and
    /// no padding.
    pub fn step_slices(
        &self,
        epoch: u64,
        start: usize,
        global: usize,
        offset: usize,
        share: usize,
    ) -> Vec<Vec<usize>> {
        let order = self.epoch_order(epoch);
        let global = global.max(1);
        let mut out = Vec::new();
        let mut at = start.min(order.len());
        while at < order.len() {
            let r = (order.len() - at).min(global);
            let (a, b) = if r == global {
                (offset.min(global), (offset + share).min(global))
            } else {
                (offset * r / global, ((offset + share) * r / global).min(r))
            };
            out.push(order[at + a..at + b.max(a)].to_vec());
            at += r;
        }
        out
    }

    /// Batches per rank in an epoch (the same on every rank unless padding is off).
    pub fn batches_per_epoch(&self) -> usize {
        let n = self
            .shard_indices(0, 0, self.config.rank, self.config.world_size)
            .len();
        n.div_ceil(self.config.batch_size)
    }

    fn load_one(
        &self,
        index: usize,
        epoch: u64,
        out: &mut Vec<f32>,
    ) -> std::result::Result<(), Problem> {
        let sample = &self.set.samples[index];
        let problem = |kind| Problem {
            path: sample.path.clone(),
            kind,
        };
        let img = match &self.cache {
            Some(cache) => cache.load(&sample.path),
            None => std::fs::read(&sample.path)
                .map_err(|source| DataError::Io {
                    path: sample.path.clone(),
                    source,
                })
                .and_then(|bytes| decode_rgb(&bytes, &sample.path)),
        };
        match img {
            Ok(img) => {
                self.decoded.fetch_add(1, Ordering::Relaxed);
                self.pipeline
                    .apply(img, self.config.seed, epoch, index as u64, out);
                Ok(())
            }
            Err(DataError::Io { source, .. }) => {
                Err(problem(ProblemKind::Unreadable(source.to_string())))
            }
            Err(e) => Err(problem(ProblemKind::Corrupt(e.to_string()))),
        }
    }

    /// The error for a batch whose decoding panicked, naming its files.
    fn panicked(&self, wanted: &[usize], panic: Box<dyn std::any::Any + Send>) -> DataError {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let files: Vec<String> = wanted
            .iter()
            .take(4)
            .filter_map(|&i| self.set.samples.get(i))
            .map(|s| s.path.display().to_string())
            .collect();
        DataError::Worker(format!(
            "decoding a batch panicked ({message}); its files include {}",
            files.join(", ")
        ))
    }

    /// Decodes one batch; a bad sample is replaced by the next decodable one in order.
    fn load_batch(&self, epoch: u64, wanted: &[usize]) -> Result<HostBatch> {
        #[cfg(test)]
        if wanted.contains(&tests::PANIC_AT.load(Ordering::SeqCst)) {
            panic!("injected decoder panic");
        }
        let per = 3 * (self.pipeline.size * self.pipeline.size) as usize;
        let mut pixels = Vec::with_capacity(wanted.len() * per);
        let mut indices = Vec::with_capacity(wanted.len());
        let mut problems = Vec::new();
        let n = self.set.len();
        for &index in wanted {
            let mut candidate = index;
            let mut tries = 0;
            loop {
                match self.load_one(candidate, epoch, &mut pixels) {
                    Ok(()) => {
                        indices.push(candidate);
                        break;
                    }
                    Err(p) => {
                        if self.config.strict {
                            return Err(DataError::BadFiles {
                                count: 1,
                                report: format!("  {}: {}", p.path.display(), p.kind),
                            });
                        }
                        problems.push(p);
                        tries += 1;
                        if tries >= n.min(64) {
                            return Err(DataError::MostlyBad {
                                failed: tries,
                                decoded: self.decoded_samples(),
                                report: problem_report(&problems),
                            });
                        }
                        candidate = (candidate + 1) % n;
                    }
                }
            }
        }
        Ok(HostBatch {
            pixels,
            indices,
            problems,
        })
    }

    fn to_batch(&self, host: HostBatch, device: &Device) -> Batch {
        let s = self.pipeline.size as usize;
        let n = host.indices.len();
        let images = Tensor::from_data(TensorData::new(host.pixels, [n, 3, s, s]), device);
        let mut multi = None;
        if self.set.multi_label {
            let k = self.set.classes.len();
            let mut hot = vec![0f32; n * k];
            for (row, &i) in host.indices.iter().enumerate() {
                if let Target::Multi(ls) = &self.set.samples[i].target {
                    for &l in ls {
                        hot[row * k + l] = 1.0;
                    }
                }
            }
            multi = Some(Tensor::from_data(TensorData::new(hot, [n, k]), device));
        }
        // Class indices always (a multi-label sample's first label, 0 for none), so
        // single-label metrics and samplers work on any set.
        let ys: Vec<i64> = host
            .indices
            .iter()
            .map(|&i| match &self.set.samples[i].target {
                Target::Class(c) => *c as i64,
                Target::Multi(ls) => ls.first().copied().unwrap_or(0) as i64,
            })
            .collect();
        let classes = Some(Tensor::from_data(TensorData::new(ys, [n]), device));
        Batch {
            images,
            classes,
            multi_hot: multi,
            indices: host.indices,
        }
    }
}

/// The error that stops a run whose images mostly fail to decode: at least
/// [`MOSTLY_FAILING_AFTER`] failures and more failures than decoded images, naming the first
/// few files. A few bad files are skipped (each reported once by path); a folder of them is a
/// data problem, not something to train around.
fn mostly_failing(problems: &[Problem], decoded: usize) -> Option<DataError> {
    let mut paths: Vec<&std::path::Path> = problems.iter().map(|p| p.path.as_path()).collect();
    paths.sort();
    paths.dedup();
    let failed = paths.len();
    if failed < MOSTLY_FAILING_AFTER || failed <= decoded {
        return None;
    }
    let report = problem_report(problems);
    Some(DataError::MostlyBad {
        failed,
        decoded,
        report,
    })
}

/// The first few of `problems`, a line each with its path.
fn problem_report(problems: &[Problem]) -> String {
    problems
        .iter()
        .take(5)
        .map(|p| format!("  {}: {}", p.path.display(), p.kind))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Failed files before [`mostly_failing`] may judge a data set.
const MOSTLY_FAILING_AFTER: usize = 8;

type Job = (usize, Vec<usize>);
type Done = (usize, Result<HostBatch>);

mod stream;

pub use stream::BatchStream;

#[cfg(test)]
mod tests;
