//! Gradient fusion: many tensors packed into few flat buffers ("buckets") so one allreduce moves
//! many small gradients, in one fixed order on every rank.

/// Default bucket size: 25 MB, PyTorch DDP's default.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// Which consecutive tensors share a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// Number of values of each tensor, in the fixed order.
    pub sizes: Vec<usize>,
    /// Tensor index ranges, one per bucket.
    pub buckets: Vec<std::ops::Range<usize>>,
}

impl BucketPlan {
    /// Greedy packing in order: a bucket closes when the next tensor would take it past
    /// `bucket_bytes` (a tensor larger than that gets a bucket of its own).
    pub fn new(sizes: &[usize], bucket_bytes: usize) -> Self {
        Self::with_cuts(sizes, bucket_bytes, &[])
    }

    /// [`Self::new`], a bucket also closing before each tensor index of `cuts`, so that no
    /// bucket spans a cut (ZeRO stage 3 gathers a unit's parameters by whole buckets: its
    /// units' first tensors are the cuts).
    pub fn with_cuts(sizes: &[usize], bucket_bytes: usize, cuts: &[usize]) -> Self {
        let cap = (bucket_bytes / 4).max(1);
        let mut buckets = Vec::new();
        let (mut start, mut fill) = (0, 0);
        for (i, &s) in sizes.iter().enumerate() {
            if (fill > 0 && fill + s > cap) || (i > start && cuts.contains(&i)) {
                buckets.push(start..i);
                start = i;
                fill = 0;
            }
            fill += s;
        }
        if start < sizes.len() {
            buckets.push(start..sizes.len());
        }
        Self {
            sizes: sizes.to_vec(),
            buckets,
        }
    }

    pub fn total(&self) -> usize {
        self.sizes.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_pack_in_order_and_never_split_a_tensor() {
        let plan = BucketPlan::new(&[10, 10, 10, 50, 1, 1], 80);
        // 20 values per bucket.
        assert_eq!(plan.buckets, vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(plan.total(), 82);
        assert_eq!(
            BucketPlan::new(&[], 80).buckets,
            Vec::<std::ops::Range<usize>>::new()
        );
        let one = BucketPlan::new(&[3, 4, 5], DEFAULT_BUCKET_BYTES);
        assert_eq!(one.buckets, vec![0..3]);
    }

    #[test]
    fn cuts_close_buckets_and_a_cut_at_a_bucket_s_start_adds_none() {
        // 20 values per bucket: without cuts [0..2, 2..3, 3..4, 4..6]. The cut at 1 splits the
        // first (and 1 and 2 then fill one), the cut at 3 falls where a bucket starts anyway,
        // the cut at 5 splits the last.
        let plan = BucketPlan::with_cuts(&[10, 10, 10, 50, 1, 1], 80, &[0, 1, 3, 5]);
        assert_eq!(plan.buckets, vec![0..1, 1..3, 3..4, 4..5, 5..6]);
        let plan = BucketPlan::with_cuts(&[1, 1, 1, 1], 80, &[2]);
        assert_eq!(plan.buckets, vec![0..2, 2..4]);
    }
}
