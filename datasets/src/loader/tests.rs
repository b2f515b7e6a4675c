use std::sync::atomic::{AtomicUsize, Ordering};

use burn::prelude::Device;

use super::*;

/// The sample whose batch panics while decoding (tests only).
pub(super) static PANIC_AT: AtomicUsize = AtomicUsize::new(usize::MAX);

#[test]
fn a_panicking_worker_is_an_error_of_its_batch_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    crate::synth::generate(dir.path(), &crate::synth::SynthConfig::new(2, 6, 16)).unwrap();
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let loader = Loader::new(
        set,
        Pipeline::eval(16),
        LoaderConfig::new(2).with_shuffle(false).with_workers(2),
    )
    .unwrap();
    PANIC_AT.store(5, Ordering::SeqCst);
    // A hang here would stop the test at the channel wait; the stream must end instead.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let results: Vec<bool> = loader
            .epoch(0, &Device::flex())
            .map(|b| b.is_ok())
            .collect();
        let _ = tx.send(results);
    });
    let results = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the loader hung after a worker panicked");
    PANIC_AT.store(usize::MAX, Ordering::SeqCst);
    // Batches 0 and 1 decode; batch 2 (samples 4, 5) panicked and is reported.
    assert_eq!(&results[..3], &[true, true, false], "{results:?}");
}
