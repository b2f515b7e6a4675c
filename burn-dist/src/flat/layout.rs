//! Which server holds what: the model's tensors, in order, form one flat vector, cut into
//! `servers` contiguous shards of equal size (within one value). Balanced by bytes, since every
//! value is an `f32`; a tensor that crosses a cut is split into slices, one per shard.

use std::ops::Range;

use crate::{DistError, Result};

/// A piece of one named tensor held by one shard: values `start..end` of the tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub name: String,
    pub start: usize,
    pub end: usize,
    /// The tensor's whole length.
    pub len: usize,
}

/// The named tensors and the cut of their flat vector into shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    tensors: Vec<(String, usize)>,
    /// Shard `s` holds flat values `bounds[s]..bounds[s + 1]`.
    bounds: Vec<usize>,
}

impl Layout {
    /// `tensors` as (name, number of values), in the order the flat vector concatenates them.
    pub fn new(tensors: &[(String, usize)], servers: usize) -> Result<Self> {
        let total: usize = tensors.iter().map(|t| t.1).sum();
        if servers == 0 {
            return Err(DistError::Config(
                "parameter servers: at least one server is needed".into(),
            ));
        }
        if total < servers {
            return Err(DistError::Config(format!(
                "parameter servers: {total} values cannot be spread over {servers} servers"
            )));
        }
        let bounds = (0..=servers).map(|s| total * s / servers).collect();
        Ok(Self {
            tensors: tensors.to_vec(),
            bounds,
        })
    }

    pub fn servers(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Values in all tensors.
    pub fn total(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }

    /// The flat values shard `shard` holds.
    pub fn range(&self, shard: usize) -> Range<usize> {
        self.bounds[shard]..self.bounds[shard + 1]
    }

    /// The tensor slices of shard `shard`, in order.
    pub fn slices(&self, shard: usize) -> Vec<Slice> {
        let want = self.range(shard);
        let mut out = Vec::new();
        let mut at = 0usize;
        for (name, len) in &self.tensors {
            let (lo, hi) = (at.max(want.start), (at + len).min(want.end));
            if lo < hi {
                out.push(Slice {
                    name: name.clone(),
                    start: lo - at,
                    end: hi - at,
                    len: *len,
                });
            }
            at += len;
        }
        out
    }

    /// What shard `shard` holds, for messages: `conv1.weight[0..120], conv1.bias, ...`
    /// (at most 4 slices named).
    pub fn describe(&self, shard: usize) -> String {
        let slices = self.slices(shard);
        let mut names: Vec<String> = slices
            .iter()
            .take(4)
            .map(|s| {
                if s.start == 0 && s.end == s.len {
                    s.name.clone()
                } else {
                    format!("{}[{}..{}]", s.name, s.start, s.end)
                }
            })
            .collect();
        if slices.len() > 4 {
            names.push(format!("and {} more", slices.len() - 4));
        }
        format!(
            "shard {shard} of {} ({} values: {})",
            self.servers(),
            self.range(shard).len(),
            names.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, len: usize) -> (String, usize) {
        (name.to_string(), len)
    }

    #[test]
    fn shards_are_balanced_and_a_large_tensor_is_sliced() {
        let l = Layout::new(&[t("a", 10), t("big", 100), t("c", 3)], 3).unwrap();
        assert_eq!(l.total(), 113);
        let sizes: Vec<usize> = (0..3).map(|s| l.range(s).len()).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        assert_eq!(sizes.iter().sum::<usize>(), 113);
        // "big" spans all three shards; every value of every tensor is held exactly once.
        for s in 0..3 {
            assert!(l.slices(s).iter().any(|x| x.name == "big"), "shard {s}");
        }
        let mut held = vec![0usize; 3];
        for s in 0..3 {
            for x in l.slices(s) {
                let i = ["a", "big", "c"].iter().position(|n| *n == x.name).unwrap();
                held[i] += x.end - x.start;
            }
        }
        assert_eq!(held, vec![10, 100, 3]);
        assert!(
            l.describe(0)
                .starts_with("shard 0 of 3 (37 values: a, big[0..27])")
        );
    }

    #[test]
    fn no_servers_or_too_few_values_is_an_error() {
        assert!(Layout::new(&[t("a", 4)], 0).is_err());
        assert!(Layout::new(&[t("a", 2)], 3).is_err());
    }
}
