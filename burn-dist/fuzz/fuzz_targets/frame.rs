//! The frame decoder and control-message reader on arbitrary bytes: any input must give `Ok` or
//! an error, never a panic.
//!
//!   cargo +nightly fuzz run frame      (from burn-dist/)
#![no_main]

use burn_dist::wire::{Header, Reader, decode_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((header, payload)) = decode_frame(data) {
        assert_eq!(header.len as usize, payload.len());
        assert_eq!(Header::decode(&header.encode()), Ok(header));
    }
    let mut r = Reader::new(data);
    let _ = r.u64();
    let _ = r.string();
    let _ = r.finish();
});
