//! Winograd's transformed weights kept between inference passes.
//!
//! Winograd's forward (`winograd::forward_then`) transforms a layer's 3x3 weights into `U` (16/9 of their size) on
//! every call: one pass over both in memory, a large share of a layer at batch 1 on a small map
//! (ResNet-50's 256 → 256 on 14x14: 0.55 of 2.1 ms on a Zen 3; ResNet-50's layers 3.3 of 20.7
//! ms, VGG-16's 8.8 of 133: `kernels/examples/forward_b1.rs`). At inference the weights do not
//! change between passes, so where a thread runs inference ([`inference`]: Hearth's f32
//! convolutions on Flex without autodiff, outside a keyed forward), the forward takes `U` from
//! here, made once per weight tensor.
//!
//! A weight is known by its storage (Flex's `Arc` of bytes, held here by a `Weak`), the view's
//! offset and its shape. The `Weak` keeps the `Arc`'s allocation, and so its address, from
//! being reused; and Flex writes into a storage only through `Arc::get_mut`, which refuses
//! while a `Weak` is out, or `Arc::make_mut`, which then moves the bytes to a new allocation.
//! So an entry whose `Weak` still upgrades holds the `U` of exactly the values the weight has.
//! An entry whose weight was dropped or written (a training step after validation) is let go
//! at the next convolution forward on Flex, in or out of inference.
//!
//! With `U` kept, Winograd also takes the small maps whose transform cost more than the products
//! saved (`winograd::pays_kept` against `winograd::pays`: ResNet-50's and VGG-16's last 3x3
//! layers), so inference there differs from a training forward in the last bits, as im2col's
//! and Winograd's results do.
//!
//! At most [`MAX_FLOATS`] are kept (a weight beyond them is transformed at each call);
//! `HEARTH_WINOGRAD_CACHE=0` turns the cache off, and with it the shapes only `pays_kept` takes
//! go back to im2col.

use std::any::Any;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use burn_flex::FlexTensor;

use crate::epilogue::Epilogue;
use crate::shape::ConvShape;

/// The most floats of `U` kept at once (1 GiB); a weight beyond it is transformed at each call.
pub const MAX_FLOATS: usize = 1 << 28;

thread_local! {
    /// Whether this thread runs inference ([`inference`]).
    static INFERENCE: Cell<bool> = const { Cell::new(false) };
}

/// One kept `U`.
struct Entry {
    /// The weight's storage: alive while this upgrades.
    storage: Weak<dyn Any + Send + Sync>,
    key: Key,
    u: Arc<Vec<f32>>,
}

/// A weight: its storage's address, and the view's offset in it, shape and strides.
#[derive(Clone, PartialEq, Eq, Debug)]
struct Key {
    storage: usize,
    offset: usize,
    dims: [usize; 4],
    strides: Vec<isize>,
}

static ENTRIES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
/// Whether [`ENTRIES`] may hold anything (read without the lock on every forward).
static ANY: AtomicBool = AtomicBool::new(false);

/// Whether the cache is on (`HEARTH_WINOGRAD_CACHE`, read once; `0`, `false` or `off` turns
/// it off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HEARTH_WINOGRAD_CACHE")
            .map(|v| !matches!(v.trim(), "0" | "false" | "off"))
            .unwrap_or(true)
    })
}

/// Runs `f` with this thread's convolutions marked as inference: their weights do not change
/// during it, and their transformed weights may be kept.
pub fn inference<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            INFERENCE.set(self.0);
        }
    }
    let _restore = Restore(INFERENCE.replace(true));
    f()
}

fn entries() -> MutexGuard<'static, Vec<Entry>> {
    ENTRIES.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Lets go of the entries whose weight was dropped or written.
fn purge(entries: &mut Vec<Entry>) {
    entries.retain(|e| e.storage.strong_count() > 0);
    ANY.store(!entries.is_empty(), Ordering::Relaxed);
}

/// The forward of `x` (contiguous) by `weight` (any view), both f32 of the shapes `s` gives,
/// each output piece through `epi`: `conv::forward_then`, with `U` from the cache
/// where Winograd takes `s` and this thread runs inference.
pub(crate) fn forward(
    x: &FlexTensor,
    weight: &FlexTensor,
    s: &ConvShape,
    epi: Option<&Epilogue>,
) -> Vec<f32> {
    if ANY.load(Ordering::Relaxed) {
        purge(&mut entries());
    }
    if INFERENCE.get()
        && enabled()
        && super::takes_kept(s)
        && let Some(u) = transformed(weight, s)
    {
        return super::forward_transformed(x.storage::<f32>(), &u, s, super::BAND_FLOATS, epi);
    }
    let weight = weight.to_contiguous();
    crate::conv::forward_then(x.storage::<f32>(), weight.storage::<f32>(), s, epi)
}

/// `U` of `weight` (f32, `[Co, Ci, 3, 3]`), kept or made and kept.
fn transformed(weight: &FlexTensor, s: &ConvShape) -> Option<Arc<Vec<f32>>> {
    let storage = weight.data_arc();
    let layout = weight.layout();
    let key = Key {
        storage: Arc::as_ptr(&storage) as *const u8 as usize,
        offset: layout.start_offset(),
        dims: layout.shape().dims::<4>(),
        strides: layout.strides().to_vec(),
    };
    if let Some(e) = entries().iter().find(|e| e.key == key) {
        return Some(e.u.clone());
    }
    let [co, ci] = [s.out_channels, s.input[1]];
    let values = weight.to_contiguous();
    let u = Arc::new(super::transform_weights(values.storage::<f32>(), co, ci));
    let mut entries = entries();
    let held: usize = entries.iter().map(|e| e.u.len()).sum();
    if held + u.len() <= MAX_FLOATS && !entries.iter().any(|e| e.key == key) {
        let storage: Weak<dyn Any + Send + Sync> = Arc::downgrade(&storage) as _;
        entries.push(Entry {
            storage,
            key,
            u: u.clone(),
        });
        ANY.store(true, Ordering::Relaxed);
    }
    Some(u)
}

/// Whether a `U` is kept for the storage at `address` (`Arc::as_ptr` of a tensor's
/// `data_arc`).
#[cfg(test)]
fn holds(address: usize) -> bool {
    entries().iter().any(|e| e.key.storage == address)
}

#[cfg(test)]
mod tests;
