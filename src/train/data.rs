//! Hearth's streaming loader as a burn `DataLoader`, so burn-train's Learner consumes it.
//!
//! burn-train asks for an iterator once per epoch without saying which epoch; the adapter counts
//! epochs itself (starting where a resumed run left off), so the data order of epoch `e` is
//! always `(seed, e)`: a resumed run sees the same batches as an uninterrupted one. The training
//! adapter also reseeds the device's random generator at the start of every epoch from
//! `(seed, epoch, rank)`, so dropout masks too continue exactly after a resume.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::prelude::*;
use hearth_datasets::{BatchStream, Loader};

/// A batch for training: normalised images, class indices and, from a multi-label set, the
/// multi-hot label matrix.
#[derive(Debug, Clone)]
pub struct ImageBatch {
    pub images: Tensor<4>,
    /// `[n]` class indices (a multi-label sample's first label).
    pub targets: Tensor<1, Int>,
    /// `[n, classes]` 0/1 labels of a multi-label set.
    pub multi_hot: Option<Tensor<2>>,
}

/// [`Loader`] as a burn [`DataLoader`] of [`ImageBatch`].
pub struct LoaderAdapter {
    loader: Loader,
    device: Device,
    next_epoch: Arc<AtomicU64>,
    /// Sub-range of this rank's batches (burn's `slice`), in samples.
    range: Option<(usize, usize)>,
    /// (seed, rank): reseed the device at each epoch start.
    reseed: Option<(u64, usize)>,
}

impl LoaderAdapter {
    /// `first_epoch` is the epoch the next `iter()` streams (0, or the resume point).
    pub fn new(loader: Loader, device: Device, first_epoch: u64) -> Self {
        Self {
            loader,
            device,
            next_epoch: Arc::new(AtomicU64::new(first_epoch)),
            range: None,
            reseed: None,
        }
    }

    /// Reseeds the device's random generator with
    /// [`epoch_seed`](super::model::epoch_seed)`(seed, epoch, rank)` before each epoch.
    pub fn with_epoch_seed(mut self, seed: u64, rank: usize) -> Self {
        self.reseed = Some((seed, rank));
        self
    }

    fn samples(&self) -> usize {
        let cfg = self.loader.config();
        let n = self
            .loader
            .shard_indices(0, 0, cfg.rank, cfg.world_size)
            .len();
        match self.range {
            Some((a, b)) => b.min(n).saturating_sub(a),
            None => n,
        }
    }
}

struct AdapterIter {
    stream: BatchStream,
    done: usize,
    total: usize,
    skip: usize,
    take: usize,
}

impl Iterator for AdapterIter {
    type Item = Result<ImageBatch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.take == 0 {
                return None;
            }
            let batch = self.stream.next()?;
            let batch = match batch {
                Ok(b) => b,
                Err(e) => return Some(Err(DatasetError::new(e))),
            };
            let n = batch.indices.len();
            if self.skip >= n {
                self.skip -= n;
                continue;
            }
            self.take = self.take.saturating_sub(n);
            self.done += n;
            let Some(targets) = batch.classes else {
                return Some(Err(DatasetError::new(
                    hearth_datasets::DataError::InvalidArgument(
                        "the loader produced a batch without class indices".into(),
                    ),
                )));
            };
            return Some(Ok(ImageBatch {
                images: batch.images,
                targets,
                multi_hot: batch.multi_hot,
            }));
        }
    }
}

impl DataLoaderIterator<ImageBatch> for AdapterIter {
    fn progress(&self) -> Progress {
        Progress::new(self.done, self.total, Some("images".into()))
    }
}

impl DataLoader<ImageBatch> for LoaderAdapter {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<ImageBatch> + 'a> {
        let epoch = self.next_epoch.fetch_add(1, Ordering::SeqCst);
        if let Some((seed, rank)) = self.reseed {
            super::model::seed_stream(&self.device, seed, epoch, rank);
        }
        let total = self.samples();
        let (skip, take) = match self.range {
            Some((a, b)) => (a, b.saturating_sub(a)),
            None => (0, usize::MAX),
        };
        Box::new(AdapterIter {
            stream: self.loader.epoch(epoch, &self.device),
            done: 0,
            total,
            skip,
            take,
        })
    }

    fn num_items(&self) -> usize {
        self.samples()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<ImageBatch>> {
        Arc::new(Self {
            loader: self.loader.clone(),
            device: device.clone(),
            next_epoch: self.next_epoch.clone(),
            range: self.range,
            reseed: self.reseed,
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<ImageBatch>> {
        let (base, _) = self.range.unwrap_or((0, usize::MAX));
        Arc::new(Self {
            loader: self.loader.clone(),
            device: self.device.clone(),
            next_epoch: self.next_epoch.clone(),
            range: Some((base + start, base + end)),
            reseed: self.reseed,
        })
    }
}
