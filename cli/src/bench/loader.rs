//! `hearth bench loader`: stream training batches (decode, augmentation, tensor) and measure
//! images/s and peak memory.

use std::path::Path;
use std::time::Instant;

use burn::prelude::*;
use hearth_datasets::{Augmentation, AutoAugment, ImageSet, Loader, LoaderConfig};

use hearth::{HearthError, Result};

#[derive(Debug, Clone)]
pub struct LoaderBench {
    pub batch_size: usize,
    pub workers: usize,
    pub prefetch: usize,
    pub size: u32,
    pub batches: usize,
    /// RandAugment or TrivialAugmentWide after torchvision's training recipe (`None`: the
    /// recipe alone: RandomResizedCrop and a flip).
    pub auto_augment: Option<AutoAugment>,
}

#[derive(Debug, Clone)]
pub struct LoaderReport {
    pub images: usize,
    pub seconds: f64,
    pub images_per_sec: f64,
    /// Peak resident memory of this process (VmHWM), MB.
    pub peak_rss_mb: f64,
    pub skipped: usize,
}

impl LoaderBench {
    fn config(&self) -> LoaderConfig {
        LoaderConfig::new(self.batch_size)
            .with_workers(self.workers)
            .with_prefetch(self.prefetch)
            .with_drop_last(true)
    }

    fn pipeline(&self) -> Result<hearth_datasets::Pipeline> {
        Ok(Augmentation {
            auto_augment: self.auto_augment,
            ..Augmentation::imagenet()
        }
        .pipeline(self.size)?)
    }

    /// Checks the settings (batches, batch size, workers, prefetch, output size) without
    /// reading the folder: what [`LoaderBench::run`] refuses before it starts.
    pub fn validate(&self) -> Result<()> {
        if self.batches == 0 {
            return Err(HearthError::InvalidArgument(
                "the loader bench needs at least 1 batch".into(),
            ));
        }
        self.config().validate()?;
        self.pipeline()?;
        Ok(())
    }

    pub fn run(
        &self,
        data: &Path,
        device: &Device,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<LoaderReport> {
        // The settings first, then the folder.
        self.validate()?;
        let pipeline = self.pipeline()?;
        let set = ImageSet::from_folder(data)?;
        let skipped = set.problems.len();
        let loader = Loader::new(set, pipeline, self.config())?;
        if loader.batches_per_epoch() == 0 {
            return Err(HearthError::InvalidArgument(format!(
                "{} has fewer images than one batch of {}",
                data.display(),
                self.batch_size
            )));
        }
        // Warm-up batch (thread start, first reads), as the peer does.
        let mut epoch = 0;
        let mut stream = loader.epoch(epoch, device);
        stream.next().transpose()?;
        let started = Instant::now();
        let mut images = 0;
        let mut done = 0;
        while done < self.batches {
            match stream.next() {
                Some(batch) => {
                    let batch = batch?;
                    images += batch.indices.len();
                    // Make sure the tensor really exists on the device.
                    let _ = batch.images.dims();
                    done += 1;
                    progress(done, self.batches);
                }
                None => {
                    epoch += 1;
                    stream = loader.epoch(epoch, device);
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        Ok(LoaderReport {
            images,
            seconds,
            images_per_sec: images as f64 / seconds.max(1e-12),
            peak_rss_mb: hearth::alloc::peak_rss_mb(),
            skipped,
        })
    }
}
