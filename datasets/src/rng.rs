//! A small deterministic RNG (SplitMix64). Augmentation and shuffling must give the same
//! numbers for the same (seed, epoch, index) on every machine and every version, which a
//! general-purpose RNG crate does not promise; this one is fixed by its definition.

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator for one (seed, epoch, index) triple, independent of the others.
    pub fn for_sample(seed: u64, epoch: u64, index: u64) -> Self {
        let mut g = Self(seed ^ 0x9E37_79B9_7F4A_7C15);
        let a = g.next_u64() ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut g = Self(a);
        let b = g.next_u64() ^ index.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
        Self(b)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Uniform integer in [0, n); `n` must be positive.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// FNV-1a, 64 bits: a hash fixed by its definition, so keys made from it (disk-cache file
/// names, data fingerprints) stay the same across Rust releases and machines, unlike
/// `std`'s `DefaultHasher`.
#[derive(Debug, Clone)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv64 {
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    /// Adds `bytes`, then a separator, so `("ab", "c")` and `("a", "bc")` differ.
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().chain(&[0xFF]) {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01B3);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv64_is_the_published_function() {
        // FNV-1a 64 of "a" is 0xaf63dc4c8601ec8c; ours appends a 0xFF separator.
        let mut h = Fnv64::new();
        h.write(b"");
        let mut manual: u64 = 0xcbf2_9ce4_8422_2325;
        manual ^= 0xFF;
        manual = manual.wrapping_mul(0x0000_0100_0000_01B3);
        assert_eq!(h.finish(), manual);
        let (mut a, mut b) = (Fnv64::new(), Fnv64::new());
        a.write(b"ab");
        a.write(b"c");
        b.write(b"a");
        b.write(b"bc");
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn known_sequence_and_independent_streams() {
        // Reference values of SplitMix64 seeded with 0.
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let a = SplitMix64::for_sample(1, 0, 5).next_u64();
        let b = SplitMix64::for_sample(1, 1, 5).next_u64();
        let c = SplitMix64::for_sample(1, 0, 6).next_u64();
        assert!(a != b && a != c && b != c);
        assert_eq!(a, SplitMix64::for_sample(1, 0, 5).next_u64());
    }

    #[test]
    fn below_and_shuffle_stay_in_range() {
        let mut g = SplitMix64::new(7);
        for n in 1..50 {
            assert!(g.below(n) < n);
        }
        let mut v: Vec<usize> = (0..100).collect();
        g.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(v, sorted);
    }
}
