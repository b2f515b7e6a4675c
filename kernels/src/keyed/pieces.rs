//! Weights too large to hold whole in a step, cut into [`Pieces`] of rows: a forward whose
//! linear products and convolutions fetch them a piece at a time ([`forward_from`]), and the pieces and their
//! gradients passed between the ops and the pass's [`Source`] (the forward's, or the
//! backward's of [`super::backward_from`]).

use burn::tensor::TensorData;

use super::{Pieced, Pieces, STATE, ScopedSource, Source, Uses, forward};

/// [`forward`] with the linear layers' and convolutions' weights of `pieced` taken a piece at a time from
/// `source` ([`Source::fetch_piece`]) instead of from their modules, which hold them empty:
/// nothing of them is kept (their backward fetches them again). Returns `f`'s result, the keys
/// kept, and the first failure of `source` (the product went on with zeros in its place: drop
/// `f`'s result then).
pub fn forward_from<R>(
    pieced: Pieced,
    source: &mut dyn Source,
    f: impl FnOnce() -> R,
) -> (R, Uses, Result<(), String>) {
    let source: *mut (dyn Source + '_) = source;
    // SAFETY: only the lifetime is erased. The pointer lives in this thread's state only
    // while `f` runs (the guard takes it out on return and on unwinding), and `source` is
    // borrowed mutably for all of this call.
    let source = unsafe { std::mem::transmute::<*mut (dyn Source + '_), ScopedSource>(source) };
    type Before = (Option<Pieced>, Option<ScopedSource>, Option<String>);
    struct Restore(Option<Before>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some((pieced, source, failed)) = self.0.take() {
                STATE.with(|s| {
                    let mut s = s.borrow_mut();
                    s.pieced = pieced;
                    s.forward_source = source;
                    s.forward_failed = failed;
                });
            }
        }
    }
    let before = STATE.with(|s| {
        let mut s = s.borrow_mut();
        (
            s.pieced.replace(pieced),
            s.forward_source.replace(source),
            s.forward_failed.take(),
        )
    });
    let restore = Restore(Some(before));
    let (out, uses) = forward(f);
    let failed = STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.forward_source = None;
        s.pieced = None;
        s.forward_failed.take()
    });
    drop(restore);
    (out, uses, failed.map_or(Ok(()), Err))
}

/// The pieces of the weight the op being called takes, where a [`forward_from`] cuts it:
/// its key, taken (one op per [`super::with_key`]), and its pieces. The op then takes its
/// product a piece at a time ([`piece_value`]) and keeps the key alone.
pub(crate) fn take_pieced() -> Option<(u64, Pieces)> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let key = s.pending?;
        let pieces = s.pieced.as_ref()?.get(&key)?.clone();
        s.pending = None;
        Some((key, pieces))
    })
}

/// Whether weight `key` is cut into pieces by the [`forward_from`] under way: its module
/// holds it empty, so a layer must take the product that fetches it a piece at a time.
pub fn is_pieced(key: u64) -> bool {
    STATE.with(|s| {
        s.borrow()
            .pieced
            .as_ref()
            .is_some_and(|p| p.contains_key(&key))
    })
}

/// Weight `key`'s pieces where the [`forward_from`] under way cuts it (a layer that takes
/// them itself: a forward without a graph).
pub(crate) fn pieces_of(key: u64) -> Option<Pieces> {
    STATE.with(|s| s.borrow().pieced.as_ref()?.get(&key).cloned())
}

/// The columns of weight `key` where the [`forward_from`] under way cuts it into pieces.
pub fn pieced_cols(key: u64) -> Option<usize> {
    STATE.with(|s| s.borrow().pieced.as_ref()?.get(&key).map(|p| p.cols))
}

/// Piece `k` (`rows` rows of `cols`) of weight `key` from the source of the pass under way:
/// the forward's inside [`forward_from`], else the backward's ([`super::backward_from`]).
/// After a failure, zeros (reported at the pass's end); a pass without a source is a caller's
/// broken promise, and panics naming the key.
pub(crate) fn piece_value(key: u64, k: usize, rows: usize, cols: usize) -> TensorData {
    let zeros = || TensorData::zeros::<f32, _>(vec![rows, cols]);
    let (forward, failed, source) = STATE.with(|s| {
        let mut s = s.borrow_mut();
        match s.forward_source.is_some() {
            true => (true, s.forward_failed.is_some(), s.forward_source.take()),
            false => (false, s.failed.is_some(), s.source.take()),
        }
    });
    if failed {
        put_back(forward, source);
        return zeros();
    }
    let Some(source) = source else {
        panic!(
            "hearth-kernels: piece {k} of weight {key} was needed outside keyed::forward_from \
             and keyed::backward_from"
        );
    };
    // SAFETY: set by `forward_from` or `backward_from` for the duration of its call, which
    // this op runs inside; taken out of the state while called, so never aliased.
    let fetched = unsafe { (*source).fetch_piece(key, k) };
    put_back(forward, Some(source));
    let fetched = fetched.and_then(|d| match d.shape().as_slice() == [rows, cols] {
        true => Ok(d),
        false => Err(format!(
            "piece {k} of weight {key} came with shape {:?}, not [{rows}, {cols}]",
            d.shape()
        )),
    });
    match fetched {
        Ok(d) => d,
        Err(e) => {
            STATE.with(|s| {
                let mut s = s.borrow_mut();
                match forward {
                    true => s.forward_failed.get_or_insert(e),
                    false => s.failed.get_or_insert(e),
                };
            });
            zeros()
        }
    }
}

/// A source taken out of the state for a call, put back.
fn put_back(forward: bool, source: Option<ScopedSource>) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        match forward {
            true => s.forward_source = source,
            false => s.source = source,
        }
    });
}

/// Hands piece `k` of weight `key`'s gradient to the backward's source
/// ([`Source::piece_gradient`]); after a failure, nothing (the failure is reported).
pub(crate) fn put_piece_grad(key: u64, k: usize, grad: TensorData) {
    let source = STATE.with(|s| {
        let mut s = s.borrow_mut();
        match s.failed {
            Some(_) => None,
            None => s.source.take(),
        }
    });
    let Some(source) = source else {
        STATE.with(|s| {
            s.borrow_mut().failed.get_or_insert(format!(
                "piece {k} of weight {key}'s gradient has no source to take it"
            ));
        });
        return;
    };
    // SAFETY: as in `piece`.
    let taken = unsafe { (*source).piece_gradient(key, k, grad) };
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.source = Some(source);
        if let Err(e) = taken {
            s.failed.get_or_insert(e);
        }
    });
}
