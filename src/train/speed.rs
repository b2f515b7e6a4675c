//! Throughput as a burn-train metric: images per second since the epoch began.
//!
//! burn-train's `IterationSpeedMetric` counts iterations (batches); Hearth reports images/s, the
//! unit that compares across batch sizes and with the run summary. The loader adapter's progress
//! counts images, so the metric needs no input beyond the step metadata.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::TensorReadError;
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};

#[derive(Clone)]
pub struct ImagesPerSecond {
    name: MetricName,
    /// When the first batch of the epoch finished, and how many images it held.
    start: Option<(Instant, usize)>,
    /// When the epoch's count began (the metric's creation or last clear): the only clock an
    /// epoch of one batch has.
    since: Instant,
    rate: f64,
}

impl Default for ImagesPerSecond {
    fn default() -> Self {
        Self {
            name: Arc::new("Images/s".to_string()),
            start: None,
            since: Instant::now(),
            rate: f64::NAN,
        }
    }
}

impl ImagesPerSecond {
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(&self, entry: NumericEntry) -> SerializedEntry {
        SerializedEntry::new(format!("{:.1} images/s", self.rate), entry.serialize())
    }
}

impl Metric for ImagesPerSecond {
    type Input = ();

    fn update(
        &mut self,
        _: &(),
        metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let seen = metadata.progress.items_processed;
        match self.start {
            // The first batch sets the clock: its own time is unknown, so until a second one
            // the rate counts from the epoch's start (which includes loading the first batch).
            None => {
                let now = Instant::now();
                self.start = Some((now, seen));
                let secs = now.duration_since(self.since).as_secs_f64();
                if secs > 0.0 {
                    self.rate = seen as f64 / secs;
                }
            }
            Some((t0, base)) => {
                let secs = t0.elapsed().as_secs_f64();
                if secs > 0.0 {
                    self.rate = seen.saturating_sub(base) as f64 / secs;
                }
            }
        }
        Ok(self.entry(NumericEntry::Value(self.rate)))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.entry(NumericEntry::Final(self.rate)))
    }

    fn clear(&mut self) {
        self.start = None;
        self.since = Instant::now();
        self.rate = f64::NAN;
    }

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("images/s".to_string()),
            higher_is_better: true,
        }
        .into()
    }
}

impl Numeric for ImagesPerSecond {
    fn value(&self) -> Option<NumericEntry> {
        self.rate
            .is_finite()
            .then_some(NumericEntry::Value(self.rate))
    }

    fn running_value(&self) -> Option<NumericEntry> {
        self.value()
    }

    fn final_value(&self) -> NumericEntry {
        NumericEntry::Final(self.rate)
    }
}

/// Images of the epoch that failed to decode and were skipped (a burn-train metric over a
/// loader's record of bad files): the `skipped_images` columns and the epoch line's count.
#[derive(Clone)]
pub struct SkippedImages {
    name: MetricName,
    loader: hearth_datasets::Loader,
    /// Bad files the loader had recorded when the epoch began.
    base: usize,
    count: f64,
}

impl SkippedImages {
    pub fn new(loader: hearth_datasets::Loader) -> Self {
        let base = loader.decode_problems().len();
        Self {
            name: Arc::new("Skipped images".to_string()),
            loader,
            base,
            count: 0.0,
        }
    }

    fn entry(&self, entry: NumericEntry) -> SerializedEntry {
        SerializedEntry::new(format!("{} skipped", self.count), entry.serialize())
    }
}

impl Metric for SkippedImages {
    type Input = ();

    fn update(&mut self, _: &(), _: &MetricMetadata) -> Result<SerializedEntry, TensorReadError> {
        self.count = self
            .loader
            .decode_problems()
            .len()
            .saturating_sub(self.base) as f64;
        Ok(self.entry(NumericEntry::Value(self.count)))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.entry(NumericEntry::Final(self.count)))
    }

    fn clear(&mut self) {
        self.base = self.loader.decode_problems().len();
        self.count = 0.0;
    }

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }
}

impl Numeric for SkippedImages {
    fn value(&self) -> Option<NumericEntry> {
        Some(NumericEntry::Value(self.count))
    }

    fn running_value(&self) -> Option<NumericEntry> {
        self.value()
    }

    fn final_value(&self) -> NumericEntry {
        NumericEntry::Final(self.count)
    }
}

/// Optimizer steps fp16 loss scaling skipped in the epoch (gradients not finite): the
/// `skipped_steps` column of an fp16 run.
#[derive(Clone)]
pub struct SkippedSteps {
    name: MetricName,
    scaler: super::precision::SharedScaler,
    /// Steps the scaler had skipped when the epoch began.
    base: u64,
    count: f64,
}

impl SkippedSteps {
    pub fn new(scaler: super::precision::SharedScaler) -> Self {
        let base = scaler.skipped();
        Self {
            name: Arc::new("Skipped steps".to_string()),
            scaler,
            base,
            count: 0.0,
        }
    }

    fn entry(&self, entry: NumericEntry) -> SerializedEntry {
        SerializedEntry::new(
            format!(
                "{} skipped (loss scale {})",
                self.count,
                self.scaler.scale()
            ),
            entry.serialize(),
        )
    }
}

impl Metric for SkippedSteps {
    type Input = ();

    fn update(&mut self, _: &(), _: &MetricMetadata) -> Result<SerializedEntry, TensorReadError> {
        self.count = self.scaler.skipped().saturating_sub(self.base) as f64;
        Ok(self.entry(NumericEntry::Value(self.count)))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.entry(NumericEntry::Final(self.count)))
    }

    fn clear(&mut self) {
        self.base = self.scaler.skipped();
        self.count = 0.0;
    }

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }
}

impl Numeric for SkippedSteps {
    fn value(&self) -> Option<NumericEntry> {
        Some(NumericEntry::Value(self.count))
    }

    fn running_value(&self) -> Option<NumericEntry> {
        self.value()
    }

    fn final_value(&self) -> NumericEntry {
        NumericEntry::Final(self.count)
    }
}
