//! How a buffer is cut into near-equal pieces: the one rule the ring collectives, the gather
//! helpers and the shared-memory reduction share, so every rank's pieces line up whichever
//! path reduced them.

/// `[start, end)` of segment `i` when `len` values are split into `n` near-equal segments.
pub(crate) fn segment(len: usize, n: usize, i: usize) -> (usize, usize) {
    (i * len / n, (i + 1) * len / n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn segments_cover_the_buffer_once_and_differ_by_at_most_one() {
        for len in [0, 1, 7, 100, 1001] {
            for n in 1..9 {
                let segs: Vec<_> = (0..n).map(|i| super::segment(len, n, i)).collect();
                assert_eq!(segs[0].0, 0);
                assert_eq!(segs[n - 1].1, len);
                for w in segs.windows(2) {
                    assert_eq!(w[0].1, w[1].0);
                }
                let sizes: Vec<_> = segs.iter().map(|(a, b)| b - a).collect();
                let (lo, hi) = (sizes.iter().min(), sizes.iter().max());
                assert!(hi.unwrap() - lo.unwrap() <= 1, "{len} in {n}: {sizes:?}");
            }
        }
    }
}
