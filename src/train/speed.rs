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

/// A count per epoch read from a running total (a burn-train metric): the total at the
/// metric's last read less the total when the epoch began. Two of them:
/// [`EpochCount::skipped_images`] and [`EpochCount::skipped_steps`].
#[derive(Clone)]
pub struct EpochCount {
    name: MetricName,
    /// The running total.
    total: Arc<dyn Fn() -> u64 + Send + Sync>,
    /// The epoch line's text for a count.
    describe: Arc<dyn Fn(f64) -> String + Send + Sync>,
    /// The total when the epoch began.
    base: u64,
    count: f64,
}

impl EpochCount {
    pub fn new(
        name: &str,
        total: impl Fn() -> u64 + Send + Sync + 'static,
        describe: impl Fn(f64) -> String + Send + Sync + 'static,
    ) -> Self {
        let base = total();
        Self {
            name: Arc::new(name.to_string()),
            total: Arc::new(total),
            describe: Arc::new(describe),
            base,
            count: 0.0,
        }
    }

    /// Images of the epoch that failed to decode and were skipped (over a loader's record of
    /// bad files): the `skipped_images` columns and the epoch line's count.
    pub fn skipped_images(loader: hearth_datasets::Loader) -> Self {
        Self::new(
            "Skipped images",
            move || loader.decode_problems().len() as u64,
            |n| format!("{n} skipped"),
        )
    }

    /// Optimizer steps fp16 loss scaling skipped in the epoch (gradients not finite): the
    /// `skipped_steps` column of an fp16 run.
    pub fn skipped_steps(scaler: super::precision::SharedScaler) -> Self {
        let total = scaler.clone();
        Self::new(
            "Skipped steps",
            move || total.skipped(),
            move |n| format!("{n} skipped (loss scale {})", scaler.scale()),
        )
    }

    fn entry(&self, entry: NumericEntry) -> SerializedEntry {
        SerializedEntry::new((self.describe)(self.count), entry.serialize())
    }
}

impl Metric for EpochCount {
    type Input = ();

    fn update(&mut self, _: &(), _: &MetricMetadata) -> Result<SerializedEntry, TensorReadError> {
        self.count = (self.total)().saturating_sub(self.base) as f64;
        Ok(self.entry(NumericEntry::Value(self.count)))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.entry(NumericEntry::Final(self.count)))
    }

    fn clear(&mut self) {
        self.base = (self.total)();
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

impl Numeric for EpochCount {
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
