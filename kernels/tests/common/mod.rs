//! Helpers shared by the kernel equality tests.
#![allow(dead_code)]

use burn::prelude::*;

pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// `a` equals `b` within 1e-4 relative to `b`'s largest magnitude (at least 1).
pub fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

/// A small deterministic generator (xorshift) for the shapes.
pub struct Shapes(pub u64);
impl Shapes {
    pub fn next(&mut self, lo: usize, hi: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + (self.0 % (hi - lo + 1) as u64) as usize
    }
}
