//! Inputs for fuzzing the decoders of what arrives from the network or from files, without a
//! fuzzing engine: seeded, so a failure replays, and bounded, so a test of it ends. Each input
//! is random bytes, or a valid encoding (a seed) with bytes flipped, cut short, extended, or
//! one of its 8-byte fields (lengths and counts, where the overflows hide) set to an extreme.
//! A decoder passes when every input gives a value or an error: no panic, no huge allocation.

/// A small, fast generator (xorshift64*); its sequence depends only on the seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// Values that break length arithmetic: 0, 1, the edges of the integer widths, 2^48.
const EXTREMES: [u64; 9] = [
    0,
    1,
    u64::MAX,
    u64::MAX / 2 + 1,
    u64::MAX / 4,
    u32::MAX as u64,
    u32::MAX as u64 + 1,
    1 << 48,
    (u64::MAX / 4) + 1,
];

/// `count` inputs derived from `seeds` (valid encodings) by `rng`.
pub fn inputs(seeds: &[Vec<u8>], count: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    (0..count).map(|_| input(seeds, rng)).collect()
}

fn input(seeds: &[Vec<u8>], rng: &mut Rng) -> Vec<u8> {
    let random =
        |rng: &mut Rng, len: usize| -> Vec<u8> { (0..len).map(|_| rng.next_u64() as u8).collect() };
    if seeds.is_empty() || rng.below(8) == 0 {
        let len = rng.below(96);
        return random(rng, len);
    }
    let mut b = seeds[rng.below(seeds.len())].clone();
    match rng.below(5) {
        0 => {
            for _ in 0..=rng.below(4) {
                if !b.is_empty() {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
            }
        }
        1 => {
            let keep = rng.below(b.len() + 1);
            b.truncate(keep);
        }
        2 => {
            let more = rng.below(32) + 1;
            b.extend(random(rng, more));
        }
        _ => {
            // An 8-byte field at an 8-aligned offset (how the encoders lay counts out), or
            // anywhere.
            if b.len() >= 8 {
                let slots = b.len() / 8;
                let at = if rng.below(2) == 0 {
                    rng.below(slots) * 8
                } else {
                    rng.below(b.len() - 7)
                };
                let v = if rng.below(3) == 0 {
                    rng.next_u64()
                } else {
                    EXTREMES[rng.below(EXTREMES.len())]
                };
                b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_inputs_and_they_vary() {
        let seeds = vec![vec![7u8; 24]];
        let a = inputs(&seeds, 200, &mut Rng::new(3));
        let b = inputs(&seeds, 200, &mut Rng::new(3));
        assert_eq!(a, b);
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 100, "{}", distinct.len());
        assert!(a.iter().any(|x| x.len() < 24) && a.iter().any(|x| x.len() > 24));
    }
}
