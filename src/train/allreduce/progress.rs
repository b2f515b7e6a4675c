//! Rank 0's progress lines through an epoch's training batches.

/// Rank 0's progress through an epoch's training batches: a line at each tenth.
pub(super) struct Progress {
    epoch: usize,
    epochs: usize,
    batches: usize,
    said: usize,
    on: bool,
}

impl Progress {
    pub(super) fn new(epoch: usize, epochs: usize, batches: usize, on: bool) -> Self {
        Self {
            epoch,
            epochs,
            batches,
            said: 0,
            on,
        }
    }

    /// `seen` batches of the epoch are done.
    pub(super) fn batch(&mut self, seen: usize, log: &mut dyn FnMut(&str)) {
        if !self.on || self.batches == 0 {
            return;
        }
        let tenth = seen * 10 / self.batches;
        if tenth > self.said && tenth < 10 {
            self.said = tenth;
            log(&format!(
                "epoch {}/{} train: {seen}/{} batches",
                self.epoch, self.epochs, self.batches
            ));
        }
    }
}
