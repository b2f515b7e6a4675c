//! `file_bytes` reads a Flex tensor's values as a file stores them (what `into_data` gives),
//! with or without autodiff, and declines what it cannot read whole.

use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::file_bytes;

#[test]
fn a_flex_tensor_s_bytes_are_into_data_s() {
    for device in [Device::flex(), Device::flex().autodiff()] {
        let t = Tensor::<2>::random([7, 5], Distribution::Normal(0.0, 1.0), &device);
        let direct = file_bytes(&t).expect("a contiguous Flex tensor is read directly");
        let (bytes, _, _) = t.clone().into_data().into_parts();
        assert_eq!(&direct[..], &bytes[..], "{device:?}");
        if device.is_autodiff() {
            let tracked = t.clone().require_grad();
            assert!(file_bytes(&tracked).is_some(), "a tracked tensor");
        }
        // A transposed view is not its storage's order: the caller reads it as Burn does.
        assert!(file_bytes(&t.clone().transpose()).is_none(), "{device:?}");
    }
    let half = Tensor::<1>::from_floats([1.5, -2.0, 0.25], &Device::flex())
        .cast(burn::tensor::FloatDType::F16);
    let (bytes, _, _) = half.clone().into_data().into_parts();
    assert_eq!(&file_bytes(&half).expect("an f16 tensor")[..], &bytes[..]);
}
