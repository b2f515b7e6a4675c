//! Winograd's convolution against im2col's, and the shapes it refuses.

use super::*;
use crate::conv::conv2d_forward_im2col;

/// Deterministic values in [-1, 1) (the weight gradient's tests take them too).
pub(super) fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn equals_im2col_on_odd_and_even_maps_every_padding_and_band() {
    // (batch, in, out, height, width, padding, band floats): odd and even sides, sides
    // smaller than a tile, one band and many (a band of one tile row), batch 1 (parallel
    // phases) and batch 3 (images in parallel).
    let cases = [
        (1, 16, 16, 8, 8, 1, BAND_FLOATS),
        (1, 17, 19, 7, 9, 1, BAND_FLOATS),
        (1, 16, 24, 7, 5, 1, 1),
        (3, 20, 16, 9, 6, 1, 1),
        (3, 16, 16, 6, 7, 0, BAND_FLOATS),
        (2, 16, 18, 5, 5, 2, 3000),
        (1, 32, 16, 3, 3, 0, BAND_FLOATS),
        (1, 16, 16, 2, 2, 1, BAND_FLOATS),
        (2, 64, 32, 14, 14, 1, 40_000),
    ];
    for (i, &(n, ci, co, h, w, p, band)) in cases.iter().enumerate() {
        let s = ConvShape {
            input: [n, ci, h, w],
            out_channels: co,
            kernel: [3, 3],
            stride: [1, 1],
            padding: [p, p],
            dilation: [1, 1],
        };
        assert!(applies(&s), "{s:?}");
        let x = values(n * ci * h * w, 2 * i as u64);
        let weight = values(co * ci * 9, 2 * i as u64 + 1);
        let want = conv2d_forward_im2col(&x, &weight, &s);
        let got = conv2d_forward_in_bands(&x, &weight, &s, band);
        assert_eq!(got.len(), want.len(), "{s:?}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale.max(1.0),
                "{s:?} band {band}: element {k}: winograd {a}, im2col {b}"
            );
        }
    }
}

#[test]
fn takes_only_what_it_computes() {
    let base = ConvShape {
        input: [1, 64, 14, 14],
        out_channels: 64,
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
    };
    assert!(applies(&base));
    for s in [
        ConvShape {
            stride: [2, 2],
            ..base
        },
        ConvShape {
            dilation: [2, 2],
            ..base
        },
        ConvShape {
            kernel: [1, 1],
            padding: [0, 0],
            ..base
        },
        ConvShape {
            kernel: [5, 5],
            ..base
        },
        ConvShape {
            padding: [3, 3],
            ..base
        },
        ConvShape {
            input: [1, 64, 1, 1],
            padding: [0, 0],
            ..base
        },
    ] {
        assert!(!applies(&s), "{s:?}");
    }
    // Where it applies, the measured rule: deep enough inputs, enough output pixels.
    let pays_at = |n, ci, co, side| {
        pays(&ConvShape {
            input: [n, ci, side, side],
            out_channels: co,
            ..base
        })
    };
    assert!(pays_at(1, 64, 64, 224));
    assert!(pays_at(1, 512, 512, 28));
    assert!(pays_at(1, 256, 256, 14));
    assert!(pays_at(1, 128, 32, 14));
    assert!(!pays_at(16, 512, 512, 7));
    assert!(!pays_at(1, 512, 512, 14));
    assert!(!pays_at(1, 512, 512, 7));
    assert!(!pays_at(16, 32, 128, 56));
    assert!(!pays_at(16, 3, 64, 224));
    assert!(!pays_at(16, 64, 8, 56));
    // With `U` kept (inference): every shape `pays` takes, and the small maps down to 7x7.
    let kept_at = |n, ci, co, side| {
        pays_kept(&ConvShape {
            input: [n, ci, side, side],
            out_channels: co,
            ..base
        })
    };
    for (ci, co, side) in [(64, 64, 224), (512, 512, 28), (256, 256, 14), (128, 32, 14)] {
        assert!(pays_at(1, ci, co, side) && kept_at(1, ci, co, side));
    }
    assert!(kept_at(1, 512, 512, 7) && kept_at(16, 512, 512, 7));
    assert!(kept_at(1, 512, 512, 14));
    assert!(kept_at(1, 128, 32, 7));
    assert!(!kept_at(16, 512, 512, 4));
    assert!(!kept_at(1, 512, 512, 1));
    assert!(!kept_at(16, 32, 128, 56));
    assert!(!kept_at(16, 64, 8, 56));
}

#[test]
fn every_vector_width_gives_the_same_bits() {
    use crate::base::tests::under_each_width;
    // Odd sides (a last half tile), a padding of 0 and 2, and batch 2.
    for (i, (n, ci, co, h, w, p)) in [
        (1, 16, 16, 7, 9, 1),
        (2, 17, 19, 6, 7, 0),
        (1, 16, 24, 5, 5, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let s = ConvShape {
            input: [n, ci, h, w],
            out_channels: co,
            kernel: [3, 3],
            stride: [1, 1],
            padding: [p, p],
            dilation: [1, 1],
        };
        let x = values(n * ci * h * w, 40 + i as u64);
        let weight = values(co * ci * 9, 50 + i as u64);
        let (ho, wo) = (h + 2 * p - 2, w + 2 * p - 2);
        let dy = values(n * co * ho * wo, 60 + i as u64);
        let runs = under_each_width(|| {
            (
                conv2d_forward(&x, &weight, &s),
                super::weight_grad::conv2d_weight_grad(&x, &dy, &s),
            )
        });
        let (_, first) = &runs[0];
        for (width, got) in &runs[1..] {
            assert!(got == first, "{s:?}: {width:?} differs from the baseline");
        }
    }
}
