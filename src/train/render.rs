//! Plain progress lines for runs without a terminal (logs, CI, `hearth launch`): burn-train's
//! TUI is used on a terminal. One line per ~10% of a split, on stderr.

use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

#[derive(Default)]
pub struct PlainRenderer {
    /// No progress lines (ranks other than 0 of a distributed run).
    quiet: bool,
    epoch: usize,
    epochs: usize,
    split: String,
    total: usize,
    last_tenth: usize,
}

impl PlainRenderer {
    /// A renderer that prints nothing (ranks other than 0).
    pub fn quiet() -> Self {
        Self {
            quiet: true,
            ..Default::default()
        }
    }
}

impl MetricsRendererTraining for PlainRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
}

impl TrainingProgressLogger for PlainRenderer {
    fn start(
        &mut self,
        total_epochs: usize,
        starting_epoch: usize,
        _items: Option<usize>,
        _label: Option<&str>,
    ) {
        // burn-train counts epochs from 1.
        self.epochs = total_epochs;
        self.epoch = starting_epoch.max(1);
        if starting_epoch > 1 && !self.quiet {
            eprintln!("continuing at epoch {starting_epoch} of {total_epochs}");
        }
    }
    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }
    fn start_split(&mut self, split: &str, total_items: usize) {
        self.split = split.to_string();
        self.total = total_items;
        self.last_tenth = 0;
    }
    fn update_split(&mut self, items_processed: usize) {
        if self.total == 0 || self.quiet {
            return;
        }
        let tenth = items_processed * 10 / self.total;
        if tenth > self.last_tenth && tenth < 10 {
            self.last_tenth = tenth;
            eprintln!(
                "epoch {}/{} {}: {}/{} images",
                self.epoch, self.epochs, self.split, items_processed, self.total
            );
        }
    }
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for PlainRenderer {
    fn start_global_progress(&mut self, _total: usize) {}
    fn start_test(&mut self, _name: &str, _total: usize) {}
    fn update_test_progress(&mut self, _items: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRendererEvaluation for PlainRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl MetricsRenderer for PlainRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}
