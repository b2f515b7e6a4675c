//! Conversions between `f32` and the two 16-bit wire formats, a slice at a time.
//!
//! `half`'s per-value conversions check the CPU for F16C on every value (fp16) or branch on NaN
//! (bf16), so neither vectorises: rounding a 100 MB gradient to fp16 and back took longer than
//! the whole uncompressed allreduce of it (2 ranks of one host: 127-132 ms against 8-9 ms;
//! BENCHMARKS.md). Here fp16 goes through `half`'s slice conversions (F16C, eight values an
//! instruction, one CPU check per call) and bf16 through the same round-to-nearest-even bit
//! arithmetic as `half::bf16::from_f32`, written without branches so the compiler vectorises
//! it. Both give `half`'s bits exactly (tested on edge cases and random patterns).

use half::f16;
use half::slice::HalfFloatSliceExt;

/// Values converted at a time through a buffer on the stack.
const CHUNK: usize = 1024;

/// `half::bf16::from_f32(f32::from_bits(x)).to_bits()`, without branches: a NaN keeps its high
/// bits with the quiet bit set; anything else rounds to nearest, ties to even.
#[inline(always)]
fn bf16_bits(x: u32) -> u16 {
    let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    // Round up when the first dropped bit is set and either any later dropped bit or the
    // kept part's lowest bit is (0x17FFF: bits 0-14 and bit 16).
    let up = (x >> 15) & 1 & u32::from(x & 0x1_7FFF != 0);
    let rounded = (x >> 16) + up;
    let quiet = (x >> 16) | 0x40;
    (if nan { quiet } else { rounded }) as u16
}

/// Every value rounded to fp16 and back.
pub(crate) fn round_f16(v: &mut [f32]) {
    let mut tmp = [f16::ZERO; CHUNK];
    for c in v.chunks_mut(CHUNK) {
        let t = &mut tmp[..c.len()];
        t.convert_from_f32_slice(c);
        t.convert_to_f32_slice(c);
    }
}

/// Every value rounded to bf16 and back.
pub(crate) fn round_bf16(v: &mut [f32]) {
    for x in v.iter_mut() {
        *x = f32::from_bits(u32::from(bf16_bits(x.to_bits())) << 16);
    }
}

/// `v` as little-endian fp16 into `out` (two bytes a value).
pub(crate) fn encode_f16(v: &[f32], out: &mut [u8]) {
    let mut tmp = [f16::ZERO; CHUNK];
    for (c, o) in v.chunks(CHUNK).zip(out.chunks_mut(2 * CHUNK)) {
        let t = &mut tmp[..c.len()];
        t.convert_from_f32_slice(c);
        for (b, h) in o.chunks_exact_mut(2).zip(t.iter()) {
            b.copy_from_slice(&h.to_le_bytes());
        }
    }
}

/// `v` as little-endian bf16 into `out` (two bytes a value).
pub(crate) fn encode_bf16(v: &[f32], out: &mut [u8]) {
    for (b, x) in out.chunks_exact_mut(2).zip(v) {
        b.copy_from_slice(&bf16_bits(x.to_bits()).to_le_bytes());
    }
}

/// Little-endian fp16 `bytes` (two a value, as many values as `out`) into `out` through `f`.
pub(crate) fn decode_f16(bytes: &[u8], out: &mut [f32], f: impl Fn(&mut f32, f32)) {
    let mut tmp = [f16::ZERO; CHUNK];
    let mut wide = [0f32; CHUNK];
    for (b, o) in bytes.chunks(2 * CHUNK).zip(out.chunks_mut(CHUNK)) {
        let t = &mut tmp[..o.len()];
        for (h, pair) in t.iter_mut().zip(b.chunks_exact(2)) {
            *h = f16::from_le_bytes([pair[0], pair[1]]);
        }
        let w = &mut wide[..o.len()];
        t.convert_to_f32_slice(w);
        o.iter_mut().zip(w.iter()).for_each(|(o, &x)| f(o, x));
    }
}

/// Little-endian bf16 `bytes` (two a value, as many values as `out`) into `out` through `f`.
pub(crate) fn decode_bf16(bytes: &[u8], out: &mut [f32], f: impl Fn(&mut f32, f32)) {
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        let i = u16::from_le_bytes([pair[0], pair[1]]);
        // `half::bf16::to_f32`: a NaN gets the quiet bit.
        let i = if i & 0x7FFF > 0x7F80 { i | 0x40 } else { i };
        f(o, f32::from_bits(u32::from(i) << 16));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Edge cases (zeros, subnormals of both formats, the largest finite values, the rounding
    /// boundaries, infinities, NaNs with payloads) and a spread of pseudo-random bit patterns.
    fn patterns() -> Vec<u32> {
        let mut v = vec![
            0,
            0x8000_0000,
            1,
            0x8000_0001,
            0x0000_8000,
            0x0001_8000,
            0x0000_7FFF,
            0x0001_7FFF,
            0x3380_0000,
            0x3300_0000,
            0x3880_0000,
            0x387F_E000,
            0x477F_E000,
            0x477F_F000,
            0x4780_0000,
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F7F_7FFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x7FBF_FFFF,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F80_7FFF,
        ];
        let mut s = 0x9E37_79B9u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            v.push(s);
        }
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn bf16_matches_half_bit_for_bit() {
        for x in patterns() {
            let want = half::bf16::from_f32(f32::from_bits(x)).to_bits();
            assert_eq!(bf16_bits(x), want, "{x:#010x}");
        }
        let values: Vec<f32> = patterns().into_iter().map(f32::from_bits).collect();
        let mut rounded = values.clone();
        round_bf16(&mut rounded);
        let mut bytes = vec![0u8; 2 * values.len()];
        encode_bf16(&values, &mut bytes);
        let mut decoded = vec![0f32; values.len()];
        decode_bf16(&bytes, &mut decoded, |o, x| *o = x);
        for (i, &x) in values.iter().enumerate() {
            let h = half::bf16::from_f32(x);
            assert!(same(rounded[i], h.to_f32()), "{:#010x}", x.to_bits());
            assert_eq!(&bytes[2 * i..2 * i + 2], &h.to_le_bytes());
            assert!(same(decoded[i], h.to_f32()), "{:#010x}", x.to_bits());
        }
    }

    #[test]
    fn fp16_matches_half_value_by_value_at_every_length() {
        let all: Vec<f32> = patterns().into_iter().map(f32::from_bits).collect();
        // Lengths around the chunk and the eight-value steps.
        for len in [0, 1, 7, 8, 9, CHUNK - 1, CHUNK, CHUNK + 3, all.len()] {
            let values = &all[..len];
            let mut rounded = values.to_vec();
            round_f16(&mut rounded);
            let mut bytes = vec![0u8; 2 * len];
            encode_f16(values, &mut bytes);
            let mut summed = vec![1f32; len];
            decode_f16(&bytes, &mut summed, |o, x| *o += x);
            for (i, &x) in values.iter().enumerate() {
                let h = f16::from_f32(x);
                assert!(same(rounded[i], h.to_f32()), "{:#010x}", x.to_bits());
                assert_eq!(
                    &bytes[2 * i..2 * i + 2],
                    &h.to_le_bytes(),
                    "{:#010x}",
                    x.to_bits()
                );
                assert!(same(summed[i], 1.0 + h.to_f32()), "{:#010x}", x.to_bits());
            }
        }
    }
}
