//! A multi-label epoch's outputs, kept for its AUROC (`val_auroc`, `train_auroc`): each
//! sample's scores and labels, gathered from the ranks that hold parts of them, or summed into
//! one vector where each rank fills its own rows (an elastic step's control allreduce).

use burn::prelude::*;
use burn_dist::Communicator;

use super::targets::Targets;
use crate::{HearthError, Result};

/// A multi-label run's validation outputs, kept for the epoch's AUROC: each sample's scores
/// and labels, row after row.
#[derive(Debug, Default, Clone)]
pub(super) struct ValScores {
    classes: usize,
    scores: Vec<f32>,
    labels: Vec<f32>,
}

impl ValScores {
    /// Keeps a batch's outputs (nothing for single-label targets).
    pub fn push(&mut self, logits: &Tensor<2>, targets: &Targets) -> Result<()> {
        let hot = match targets {
            Targets::MultiHot(hot) => hot,
            Targets::Classes(_) => return Ok(()),
            // A mixed batch's labels are soft: the side that weighs more stands for them.
            Targets::Mixed { own, rolled, lam } => {
                return self.push(logits, if *lam >= 0.5 { own } else { rolled });
            }
        };
        self.classes = hot.dims()[1];
        let read = |t: Tensor<2>, what: &str| {
            t.into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| HearthError::Training(format!("reading validation {what}: {e:?}")))
        };
        self.scores.extend(read(logits.clone(), "outputs")?);
        self.labels.extend(read(hot.clone(), "labels")?);
        Ok(())
    }

    /// Every rank's outputs, on every rank (`comm`'s ranks all call it; those that validated
    /// nothing add nothing).
    pub fn gather(self, comm: &Communicator) -> Result<Self> {
        let meta = comm.all_gather(&[self.scores.len() as f32, self.classes as f32])?;
        let most = |i: usize| {
            meta.iter()
                .skip(i)
                .step_by(2)
                .fold(0.0f32, |a, &b| a.max(b))
        };
        let (longest, classes) = (most(0) as usize, most(1) as usize);
        if longest == 0 {
            return Ok(self);
        }
        // Each rank's part padded to the longest, its length in front.
        let mut mine = Vec::with_capacity(2 * longest + 1);
        mine.push(self.scores.len() as f32);
        for part in [&self.scores, &self.labels] {
            mine.extend_from_slice(part);
            mine.resize(mine.len() + longest - part.len(), 0.0);
        }
        let all = comm.all_gather(&mine)?;
        let mut out = Self {
            classes,
            ..Self::default()
        };
        for part in all.chunks(2 * longest + 1) {
            let n = (part[0] as usize).min(longest);
            out.scores.extend_from_slice(&part[1..1 + n]);
            out.labels
                .extend_from_slice(&part[1 + longest..1 + longest + n]);
        }
        Ok(out)
    }

    /// Burn's macro AUROC in percent: the mean over the classes that have both outcomes of
    /// each class's AUROC, 50 (chance) where none has; `None` before any multi-label output.
    pub fn auroc(&self) -> Option<f64> {
        let k = self.classes;
        if k == 0 || self.scores.is_empty() {
            return None;
        }
        let per_class: Vec<f64> = (0..k)
            .filter_map(|c| {
                let samples: Vec<(f64, bool)> = self
                    .scores
                    .iter()
                    .zip(&self.labels)
                    .skip(c)
                    .step_by(k)
                    .map(|(&s, &l)| (f64::from(s), l > 0.5))
                    .collect();
                crate::metrics::auroc(&samples)
            })
            .collect();
        Some(if per_class.is_empty() {
            50.0
        } else {
            100.0 * per_class.iter().sum::<f64>() / per_class.len() as f64
        })
    }

    /// Floats one row takes in [`Self::write_rows`]' layout for `classes` labels: the scores,
    /// the labels, and the row's count.
    pub fn row_len(classes: usize) -> usize {
        2 * classes + 1
    }

    /// Writes this store's rows into `out` from row `slot` on, in the layout that ranks sum
    /// (each fills its own rows, zeros elsewhere): a row is its scores, its labels, then 1.
    /// Rows beyond `out` are an error (the caller sized it for every rank's share).
    pub fn write_rows(&self, out: &mut [f32], slot: usize) -> Result<()> {
        let k = self.classes;
        if k == 0 {
            return Ok(());
        }
        let stride = Self::row_len(k);
        let rows = out.len() / stride;
        for (i, (s, l)) in self.scores.chunks(k).zip(self.labels.chunks(k)).enumerate() {
            let at = (slot + i) * stride;
            let row = out.get_mut(at..at + stride).ok_or_else(|| {
                HearthError::Training(format!(
                    "multi-label outputs: row {} does not fit in {} rows",
                    slot + i,
                    rows
                ))
            })?;
            row[..k].copy_from_slice(s);
            row[k..2 * k].copy_from_slice(l);
            row[2 * k] = 1.0;
        }
        Ok(())
    }

    /// Keeps the rows of `summed` ([`Self::write_rows`]' layout after the ranks' sum, for
    /// `classes` labels): each row some rank wrote, divided by its count (a sample that two
    /// ranks took, as an epoch's short last step pads, counts once).
    pub fn read_rows(&mut self, summed: &[f32], classes: usize) {
        if classes == 0 {
            return;
        }
        self.classes = classes;
        for row in summed.chunks_exact(Self::row_len(classes)) {
            let n = row[2 * classes];
            if n > 0.5 {
                self.scores.extend(row[..classes].iter().map(|v| v / n));
                self.labels
                    .extend(row[classes..2 * classes].iter().map(|v| v / n));
            }
        }
    }

    /// Adds `other`'s samples (of the same labels) to these.
    pub fn append(&mut self, other: ValScores) {
        if other.classes == 0 {
            return;
        }
        self.classes = other.classes;
        self.scores.extend(other.scores);
        self.labels.extend(other.labels);
    }

    /// Samples held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.scores.len().checked_div(self.classes).unwrap_or(0)
    }

    /// This store as bytes (the classes, then each row's scores and labels, little-endian),
    /// for a state that another process reads back with [`Self::decode`].
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 4 * (self.scores.len() + self.labels.len()));
        out.extend_from_slice(&(self.classes as u64).to_le_bytes());
        for v in self.scores.iter().chain(&self.labels) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Reads [`Self::encode`]'s bytes; damaged ones are an error naming `what`.
    pub fn decode(bytes: &[u8], what: &str) -> Result<Self> {
        let bad = |m: &str| HearthError::Training(format!("{what}: {m}"));
        let (head, rest) = bytes
            .split_at_checked(8)
            .ok_or_else(|| bad("truncated multi-label outputs"))?;
        let classes = u64::from_le_bytes(head.try_into().unwrap_or([0; 8]));
        let values: Vec<f32> = rest
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let ok = usize::try_from(classes).ok().filter(|&k| {
            rest.len() % 4 == 0
                && (k == 0 && values.is_empty() || k > 0 && values.len().is_multiple_of(2 * k))
        });
        let Some(classes) = ok else {
            return Err(bad("damaged multi-label outputs"));
        };
        let half = values.len() / 2;
        Ok(Self {
            classes,
            scores: values[..half].to_vec(),
            labels: values[half..].to_vec(),
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use burn_dist::transport::memory::MemoryTransport;
    use std::sync::Arc;

    /// Two-label test data, shared with `objective`'s tests.
    pub(crate) fn device() -> Device {
        Device::flex()
    }

    pub(crate) fn hot(rows: &[[f32; 2]]) -> Targets {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        Targets::MultiHot(
            Tensor::<1>::from_floats(flat.as_slice(), &device()).reshape([rows.len(), 2]),
        )
    }

    pub(crate) fn logits(rows: &[[f32; 2]]) -> Tensor<2> {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        Tensor::<1>::from_floats(flat.as_slice(), &device()).reshape([rows.len(), 2])
    }

    #[test]
    fn gathered_scores_give_the_auroc_of_the_whole_set() {
        // Class 0 ranked perfectly, class 1 inverted: macro AUROC 50%.
        let rows = [
            ([0.9f32, 0.1f32], [1.0f32, 1.0f32]),
            ([0.1, 0.9], [0.0, 0.0]),
            ([0.8, 0.2], [1.0, 1.0]),
        ];
        let mut whole = ValScores::default();
        for (l, h) in rows {
            whole.push(&logits(&[l]), &hot(&[h])).unwrap();
        }
        assert_eq!(whole.auroc(), Some(50.0));
        // Split over 2 ranks unevenly (2 rows and 1): the gathered AUROC is the same.
        let handles: Vec<_> = MemoryTransport::mesh(2)
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                std::thread::spawn(move || {
                    let comm = Communicator::from_env(Arc::new(t))
                        .with_timeout(std::time::Duration::from_secs(20));
                    let mut part = ValScores::default();
                    for (i, (l, h)) in rows.iter().enumerate() {
                        if (i == 2) == (r == 1) {
                            part.push(&logits(&[*l]), &hot(&[*h])).unwrap();
                        }
                    }
                    part.gather(&comm).unwrap().auroc()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), Some(50.0));
        }
        assert_eq!(ValScores::default().auroc(), None);
    }

    #[test]
    fn rows_summed_over_ranks_give_the_auroc_of_the_whole_set_and_survive_bytes() {
        let rows = [
            ([0.9f32, 0.1f32], [1.0f32, 1.0f32]),
            ([0.1, 0.9], [0.0, 0.0]),
            ([0.8, 0.2], [1.0, 1.0]),
            ([0.3, 0.6], [0.0, 1.0]),
        ];
        let mut whole = ValScores::default();
        for (l, h) in rows {
            whole.push(&logits(&[l]), &hot(&[h])).unwrap();
        }
        // Rank 0 holds rows 0-1 (slots 0-1), rank 1 rows 2-3 (slots 2-3); a fifth slot
        // stays empty and a sixth is taken by both ranks (a padded sample: counted once).
        let stride = ValScores::row_len(2);
        let mut summed = vec![0.0f32; 6 * stride];
        for (rank, range) in [(0usize, 0..2usize), (1, 2..4)] {
            let mut part = ValScores::default();
            for (l, h) in &rows[range.clone()] {
                part.push(&logits(&[*l]), &hot(&[*h])).unwrap();
            }
            let mut mine = vec![0.0f32; 6 * stride];
            part.write_rows(&mut mine, range.start).unwrap();
            let mut pad = ValScores::default();
            pad.push(&logits(&[rows[3].0]), &hot(&[rows[3].1])).unwrap();
            pad.write_rows(&mut mine, 5).unwrap();
            summed.iter_mut().zip(&mine).for_each(|(s, m)| *s += m);
            let _ = rank;
        }
        let mut back = ValScores::default();
        back.read_rows(&summed, 2);
        assert_eq!(back.len(), 5);
        let mut want = whole.clone();
        want.push(&logits(&[rows[3].0]), &hot(&[rows[3].1]))
            .unwrap();
        assert_eq!(back.auroc(), want.auroc());
        assert_eq!(back.scores, want.scores);
        // A row beyond the vector is an error, not a panic.
        assert!(whole.write_rows(&mut vec![0.0; 3 * stride], 0).is_err());
        // Bytes round trip; damaged bytes are refused by name.
        let bytes = back.encode();
        let again = ValScores::decode(&bytes, "test state").unwrap();
        assert_eq!(
            (again.scores, again.labels),
            (back.scores.clone(), back.labels.clone())
        );
        for cut in [0, 5, 9, bytes.len() - 1] {
            let e = ValScores::decode(&bytes[..cut], "test state").unwrap_err();
            assert!(e.to_string().contains("test state"), "{e}");
        }
        assert_eq!(
            ValScores::decode(&ValScores::default().encode(), "x")
                .unwrap()
                .len(),
            0
        );
    }
}
