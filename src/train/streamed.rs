//! A tensor's bytes that arrive in consecutive pieces, for burn-pack's writer: a [`Bytes`]
//! whose windows ([`Bytes::view`]) are filled from the pieces as the writer asks for them, in
//! order, so that a tensor is written without ever being held whole.
//!
//! Why: ZeRO stage 3 gathers a matrix larger than a bucket a piece of rows at a time, and
//! burn-pack's writer takes a tensor as one [`Bytes`]. Joined for it, VGG-16's 411 MB first
//! classifier weight made rank 0 the largest rank of a run (837 MB live at 4 ranks, where the
//! others peaked at 567). The writer copies a tensor in windows of 8 MiB where its bytes can
//! give them (`Bytes::view`, as a file's or a device's do), and [`Streamed`] gives them: each
//! window is filled from the pieces when the writer takes it and let go after, so a rank holds
//! one piece and one window of the tensor at a time.
//!
//! Burn re-exports no way to build such bytes; `burn-std`'s `AllocationController` (the
//! version Burn builds) is the trait its file- and device-backed bytes implement.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use burn::tensor::Bytes;
use burn_std::{
    AccessError, AccessPolicy, AllocationController, AllocationProperty,
    SharedBytesAllocationController,
};

/// The next piece of a tensor's bytes (an error where none came: the feed stopped, or a piece
/// of another tensor came instead).
pub type NextPiece = Box<dyn FnMut() -> Result<Bytes, String> + Send>;

/// Where a [`Streamed`] tensor records why it could not fill a window. The writer only asks
/// for windows (it cannot hear an error from one), so a failed window is written as zeros
/// and the write must then be thrown away by whoever reads this.
pub type Failure = Arc<Mutex<Option<String>>>;

/// `len` bytes made of `first` and the pieces `next` gives after it, read in order by windows
/// (the checkpoint writer's): see the module's documentation. Reading them whole (`Deref`)
/// joins them first, as long as no window was taken yet.
pub fn streamed(len: usize, first: Bytes, next: NextPiece, failure: Failure) -> Bytes {
    let stream = Stream {
        piece: first,
        used: 0,
        next,
        read: 0,
        failure,
    };
    let controller = Streamed {
        len,
        stream: Mutex::new(stream),
        whole: std::sync::OnceLock::new(),
    };
    // SAFETY: `Streamed` reports `len` bytes: every window it gives is exactly the range asked
    // for (zeros where a piece is missing), and its whole memory is `len` bytes or an error.
    unsafe { Bytes::from_controller(Box::new(controller), len) }
}

struct Stream {
    /// The piece being read, `used` of its bytes handed out.
    piece: Bytes,
    used: usize,
    next: NextPiece,
    /// Bytes of the tensor handed out so far (the start of the next window).
    read: usize,
    failure: Failure,
}

impl Stream {
    /// The next `n` bytes of the tensor (zeros from a failure on, which is recorded).
    fn take(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n);
        // After a failure nothing more is taken from the feed: the write is thrown away.
        let failed = self.failure.lock().map_or(true, |f| f.is_some());
        while out.len() < n && !failed {
            if self.used == self.piece.len() {
                match (self.next)() {
                    Ok(p) if !p.is_empty() => (self.piece, self.used) = (p, 0),
                    Ok(_) => {
                        self.fail("an empty piece".into());
                        break;
                    }
                    Err(e) => {
                        self.fail(e);
                        break;
                    }
                }
            }
            let k = (n - out.len()).min(self.piece.len() - self.used);
            out.extend_from_slice(&self.piece[self.used..self.used + k]);
            self.used += k;
        }
        out.resize(n, 0);
        self.read += n;
        out
    }

    fn fail(&self, why: String) {
        if let Ok(mut f) = self.failure.lock() {
            f.get_or_insert(why);
        }
    }
}

struct Streamed {
    len: usize,
    stream: Mutex<Stream>,
    /// The bytes joined, where they were read whole.
    whole: std::sync::OnceLock<Result<Vec<u8>, String>>,
}

impl AllocationController for Streamed {
    fn alloc_align(&self) -> usize {
        1
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        Err(AccessError::Read(
            "a tensor streamed from its pieces is read only".into(),
        ))
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        let whole = self.whole.get_or_init(|| {
            let mut stream = self.stream.lock().map_err(|_| "poisoned".to_string())?;
            if stream.read != 0 {
                return Err(format!(
                    "read whole after {} of its {} bytes were read by windows",
                    stream.read, self.len
                ));
            }
            let bytes = stream.take(self.len);
            match stream.failure.lock().map(|f| f.clone()) {
                Ok(Some(e)) => Err(e),
                _ => Ok(bytes),
            }
        });
        match whole {
            Ok(v) => Ok(as_uninit(v)),
            Err(e) => Err(AccessError::Read(e.clone())),
        }
    }

    fn capacity(&self) -> usize {
        self.len
    }

    fn view(&self, start: usize, end: usize) -> Option<Box<dyn AllocationController>> {
        let mut stream = self.stream.lock().ok()?;
        if start != stream.read || end < start || end > self.len || self.whole.get().is_some() {
            stream.fail(format!(
                "bytes {start}..{end} asked for where {}.. was next (a tensor streamed from its \
                 pieces is read once, in order)",
                stream.read
            ));
            // Still the range asked for: the failure discards the write.
            return Some(window(vec![0; end.saturating_sub(start)]));
        }
        let bytes = stream.take(end - start);
        if stream.read == self.len && stream.used < stream.piece.len() {
            let more = stream.piece.len() - stream.used;
            stream.fail(format!(
                "{more} bytes more than the tensor's {} came in its last piece",
                self.len
            ));
        }
        Some(window(bytes))
    }
}

/// One window's bytes, owned (burn-std's controller of shared bytes: read in place).
fn window(bytes: Vec<u8>) -> Box<dyn AllocationController> {
    Box::new(SharedBytesAllocationController::new(
        bytes.into(),
        AllocationProperty::Native,
    ))
}

fn as_uninit(v: &[u8]) -> &[MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` has `u8`'s layout, and initialised bytes are valid as it.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `values` in pieces of `sizes` (bytes) after the first.
    fn pieces(values: &[u8], sizes: &[usize]) -> (Bytes, NextPiece) {
        let mut cuts = Vec::new();
        let mut at = 0;
        for &s in sizes {
            cuts.push(Bytes::from_bytes_vec(values[at..at + s].to_vec()));
            at += s;
        }
        assert_eq!(at, values.len());
        let mut rest = cuts.into_iter();
        let first = rest.next().unwrap();
        let next: NextPiece = Box::new(move || rest.next().ok_or_else(|| "no more".to_string()));
        (first, next)
    }

    #[test]
    fn windows_across_pieces_give_the_bytes_in_order_and_whole_reads_join_them() {
        let values: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let sizes = [3, 400, 1, 250, 346];
        // By windows of 128 bytes (crossing every piece's end), as the writer reads.
        let failure = Failure::default();
        let (first, next) = pieces(&values, &sizes);
        let b = streamed(values.len(), first, next, failure.clone());
        assert_eq!(b.len(), 1000);
        let mut got = Vec::new();
        let mut at = 0;
        while at < b.len() {
            let end = (at + 128).min(b.len());
            let w = b.view(at, end).expect("a window");
            assert_eq!(w.len(), end - at);
            got.extend_from_slice(&w);
            at = end;
        }
        assert_eq!(got, values);
        assert_eq!(*failure.lock().unwrap(), None);

        // Read whole: joined.
        let failure = Failure::default();
        let (first, next) = pieces(&values, &sizes);
        let b = streamed(values.len(), first, next, failure.clone());
        assert_eq!(&b[..], &values[..]);
        assert_eq!(*failure.lock().unwrap(), None);
    }

    #[test]
    fn a_missing_piece_or_a_window_out_of_order_is_recorded_and_the_window_keeps_its_length() {
        let values: Vec<u8> = (0..100u8).collect();
        // The feed stops after 60 of 100 bytes.
        let failure = Failure::default();
        let (first, next) = pieces(&values[..60], &[30, 30]);
        let b = streamed(100, first, next, failure.clone());
        let w = b.view(0, 80).unwrap();
        assert_eq!(&w[..60], &values[..60]);
        assert_eq!(&w[60..], &[0u8; 20][..]);
        assert_eq!(failure.lock().unwrap().as_deref(), Some("no more"));

        // A window asked for out of order.
        let failure = Failure::default();
        let (first, next) = pieces(&values, &[50, 50]);
        let b = streamed(100, first, next, failure.clone());
        assert_eq!(b.view(50, 60).unwrap().len(), 10);
        let why = failure.lock().unwrap().clone().unwrap();
        assert!(why.contains("50..60 asked for where 0.. was next"), "{why}");

        // Read whole after a window: refused (no partial join).
        let failure = Failure::default();
        let (first, next) = pieces(&values, &[50, 50]);
        let b = streamed(100, first, next, failure);
        let _ = b.view(0, 10).unwrap();
        let e = b.read(Default::default()).unwrap_err().to_string();
        assert!(e.contains("after 10 of its 100 bytes"), "{e}");
    }
}
