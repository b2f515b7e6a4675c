//! The kept transforms: the same bits as a transform made again, never a stale one for a
//! weight written since, nothing kept outside inference, and a dropped weight's let go.

use burn::tensor::TensorData;

use super::*;
use crate::winograd::tests::values;

/// A shape Winograd takes (`takes`: 64 input channels, 28x28).
fn shape() -> ConvShape {
    ConvShape {
        input: [1, 64, 28, 28],
        out_channels: 16,
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
    }
}

fn tensor(values: Vec<f32>, dims: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, dims))
}

/// The address `holds` knows a weight's storage by, and a `Weak` that keeps it from being
/// reused while a test looks (another test's tensor could take a freed address).
fn address(t: &FlexTensor) -> (usize, std::sync::Weak<impl Sized>) {
    let storage = t.data_arc();
    (
        Arc::as_ptr(&storage) as *const u8 as usize,
        Arc::downgrade(&storage),
    )
}

/// The forward with the weights transformed again (no cache).
fn uncached(x: &FlexTensor, w: &FlexTensor, s: &ConvShape) -> Vec<f32> {
    let w = w.to_contiguous();
    crate::conv::conv2d_forward(x.storage::<f32>(), w.storage::<f32>(), s)
}

#[test]
fn a_kept_transform_gives_the_same_bits_and_a_written_weight_is_never_served_stale() {
    let s = shape();
    assert!(super::super::takes(&s), "{s:?}");
    let x = tensor(values(64 * 28 * 28, 1), [1, 64, 28, 28]);
    let mut w = tensor(values(16 * 64 * 9, 2), [16, 64, 3, 3]);
    let want = uncached(&x, &w, &s);
    let (at, _keep) = address(&w);
    for _ in 0..2 {
        let got = inference(|| forward(&x, &w, &s, None));
        assert_eq!(got, want, "kept U gives other bits");
        assert!(holds(at), "not kept under inference");
    }
    // Written in place, as an optimizer step writes a weight no one else holds: Flex's
    // copy-on-write moves the bytes away from the cache's `Weak`.
    w.storage_mut::<f32>()[5] += 0.5;
    let want_written = uncached(&x, &w, &s);
    assert_ne!(want_written, want);
    let got = inference(|| forward(&x, &w, &s, None));
    assert_eq!(
        got, want_written,
        "a written weight got the U of its old values"
    );
    assert!(!holds(at), "the old values' U was not let go");
    let (written_at, _keep_written) = address(&w);
    assert!(holds(written_at));
}

#[test]
fn nothing_is_kept_outside_inference_and_a_dropped_weight_is_let_go() {
    let s = shape();
    let x = tensor(values(64 * 28 * 28, 3), [1, 64, 28, 28]);
    let w = tensor(values(16 * 64 * 9, 4), [16, 64, 3, 3]);
    let (at, _keep) = address(&w);
    assert_eq!(forward(&x, &w, &s, None), uncached(&x, &w, &s));
    assert!(!holds(at), "kept outside inference");
    inference(|| forward(&x, &w, &s, None));
    assert!(holds(at));
    drop(w);
    // The next forward on Flex, inference or not, lets it go.
    let other = tensor(values(16 * 64 * 9, 5), [16, 64, 3, 3]);
    forward(&x, &other, &s, None);
    assert!(!holds(at), "a dropped weight's U is still kept");
}

#[test]
fn two_views_of_one_storage_are_two_weights() {
    let s = shape();
    let x = tensor(values(64 * 28 * 28, 6), [1, 64, 28, 28]);
    let both = tensor(values(32 * 64 * 9, 7), [32, 64, 3, 3]);
    let first = both.narrow(0, 0, 16);
    let second = both.narrow(0, 16, 16);
    let (a, b) = (uncached(&x, &first, &s), uncached(&x, &second, &s));
    assert_ne!(a, b);
    for _ in 0..2 {
        assert_eq!(inference(|| forward(&x, &first, &s, None)), a);
        assert_eq!(inference(|| forward(&x, &second, &s, None)), b);
    }
}

#[test]
fn a_small_map_takes_winograd_only_with_its_transform_kept() {
    // 64 -> 16 on 7x7: `pays_kept`, not `pays`.
    let s = ConvShape {
        input: [1, 64, 7, 7],
        ..shape()
    };
    assert!(
        super::super::takes_kept(&s) && !super::super::takes(&s),
        "{s:?}"
    );
    let x = tensor(values(64 * 7 * 7, 8), [1, 64, 7, 7]);
    let w = tensor(values(16 * 64 * 9, 9), [16, 64, 3, 3]);
    let (at, _keep) = address(&w);
    let contiguous = w.to_contiguous();
    let (xs, ws) = (x.storage::<f32>(), contiguous.storage::<f32>());
    let (wino, im2col) = (
        crate::winograd::conv2d_forward(xs, ws, &s),
        crate::conv::conv2d_forward_im2col(xs, ws, &s),
    );
    assert_ne!(
        wino, im2col,
        "the two paths give the same bits: the test tells nothing"
    );
    // Outside inference the transform would be made at each call: im2col's.
    assert_eq!(forward(&x, &w, &s, None), im2col);
    assert!(!holds(at));
    for _ in 0..2 {
        assert_eq!(inference(|| forward(&x, &w, &s, None)), wino);
        assert!(holds(at), "not kept under inference");
    }
}
