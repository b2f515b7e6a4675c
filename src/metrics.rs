//! Evaluation measures Hearth computes itself.

/// Area under the ROC curve of `(score, is_positive)` pairs: the probability that a random
/// positive scores above a random negative, ties counting one half (Mann-Whitney U). `None`
/// when there are no positives or no negatives. NaN scores are dropped.
pub fn auroc(samples: &[(f64, bool)]) -> Option<f64> {
    let mut v: Vec<(f64, bool)> = samples.iter().copied().filter(|s| !s.0.is_nan()).collect();
    let positives = v.iter().filter(|s| s.1).count() as f64;
    let negatives = v.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return None;
    }
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Sum of the positives' ranks, tied groups sharing their mean rank.
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j < v.len() && v[j].0 == v[i].0 {
            j += 1;
        }
        let mean_rank = (i + 1 + j) as f64 / 2.0;
        rank_sum += mean_rank * v[i..j].iter().filter(|s| s.1).count() as f64;
        i = j;
    }
    Some((rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives))
}

#[cfg(test)]
mod tests {
    use super::auroc;

    #[test]
    fn auroc_matches_hand_counts() {
        // Perfect and inverted rankings.
        assert_eq!(auroc(&[(0.1, false), (0.9, true)]), Some(1.0));
        assert_eq!(auroc(&[(0.9, false), (0.1, true)]), Some(0.0));
        // Positives {0.8, 0.4}, negatives {0.6, 0.2}: pairs won 0.8>0.6, 0.8>0.2, 0.4>0.2 = 3/4.
        let s = [(0.8, true), (0.4, true), (0.6, false), (0.2, false)];
        assert_eq!(auroc(&s), Some(0.75));
        // A tie counts one half: positive 0.5 vs negatives {0.5, 0.1} = (0.5 + 1) / 2.
        assert_eq!(
            auroc(&[(0.5, true), (0.5, false), (0.1, false)]),
            Some(0.75)
        );
        // One outcome only: undefined.
        assert_eq!(auroc(&[(0.5, true), (0.7, true)]), None);
        assert_eq!(auroc(&[]), None);
    }
}
