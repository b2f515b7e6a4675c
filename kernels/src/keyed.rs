//! Weights a graph keeps by key instead of by value: what lets ZeRO stage 3 without
//! recomputation let a unit's gathered parameters go after its forward and gather them again
//! for its backward (PyTorch FSDP's "reshard after forward").
//!
//! Inside [`forward`], the convolution and linear-product ops of [`crate::ext`] that take a
//! trainable weight with a key (its parameter id, given by [`crate::conv2d`] and
//! [`crate::linear`] on their fast paths) keep the key in their backward state instead of the
//! weight: the graph no longer holds the weight, and it goes when its module does. Inside
//! [`backward`] those ops read the weight by its key from the values handed in, and hand the
//! weight's gradient out by key instead of registering it on the weight's graph node (whose
//! tensor the caller no longer holds).
//!
//! Other paths (Burn's own convolution, a low-precision weight's cast, a frozen weight) keep
//! their weights as before: the result is the same, only what is held differs. The state is
//! per thread: Burn runs an autodiff backward on the thread that calls it.
//!
//! The caller's promise: a weight kept by key reaches the graph through keyed ops only (each
//! of Hearth's layers uses its weight once). A keyed weight that another op also took would
//! have that op's share of its gradient registered on the graph node the caller let go.
//!
//! [`backward_from`] goes one step finer, for a backward that should hold less than a unit's
//! weights and gradients at once: a [`Source`] fetches the weights as the ops first need them
//! (ZeRO stage 3: the bucket that holds the weight, gathered from the ranks' shards) and takes
//! each weight's gradient as soon as all of its ops are done (reduce-scattered and let go).
//!
//! [`forward_from`] goes finer still for a weight too large to hold whole at all (VGG-16's
//! first classifier weight, 411 MB, where a rank's whole budget may be a fraction of that):
//! a linear layer's weight cut into [`Pieces`] of whole rows is neither gathered for the
//! forward nor kept by the graph. Its product is taken a block of rows at a time, each block
//! fetched from the [`Source`] as the product needs it and let go after it (`x · W` as the sum
//! of `x[:, rows] · W[rows]`), and so is its backward's: each block fetched again, its share of
//! the input's gradient taken and its own gradient handed to the source before the next block
//! is fetched. A convolution's weight `[out, in, kh, kw]` is cut the same way, as a matrix of
//! `out` rows of `in·kh·kw` values: each piece computes its own output channels
//! (`conv(x, W[rows])`), and its backward adds each piece's share of the input's gradient
//! (ResNet-50's last 3x3 weights, 9.4 MB each, which ZeRO stage 3 at 4 ranks could not hold
//! two of and stay within a tenth of its share).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::TensorData;

mod pieces;
pub use pieces::{forward_from, is_pieced, pieced_cols};
pub(crate) use pieces::{piece_value, pieces_of, put_piece_grad, take_pieced};

/// Each key a graph kept, with the number of its ops that kept it.
pub type Uses = HashMap<u64, usize>;

/// Inside [`backward`]: a weight by key and the number of its ops still to read it.
type Provided = HashMap<u64, (TensorData, usize)>;

/// A keyed weight of shape `[rows, cols]` (a convolution's: `[out, in·kh·kw]`) cut into
/// pieces of whole rows, in order: how [`forward_from`] takes its product or convolution a
/// block at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pieces {
    /// Each piece's rows, consecutive from 0 to the weight's rows.
    pub rows: Vec<Range<usize>>,
    pub cols: usize,
}

impl Pieces {
    /// The weight's number of rows.
    pub fn total_rows(&self) -> usize {
        self.rows.last().map_or(0, |r| r.end)
    }

    /// Panics naming weight `key` unless its rows are a convolution's of `inputs` channels by
    /// `kernel` (a caller's broken promise: the layer cut is not the one called).
    pub(crate) fn check_conv(&self, key: u64, inputs: usize, [kh, kw]: [usize; 2]) {
        assert_eq!(
            inputs * kh * kw,
            self.cols,
            "hearth-kernels: weight {key}'s pieces have rows of {} values, and its convolution \
             takes {inputs} channels by {kh}x{kw}",
            self.cols
        );
    }

    /// Panics naming weight `key` unless it has a row per input of a product of `inputs`.
    pub(crate) fn check_product(&self, key: u64, inputs: usize) {
        assert_eq!(
            inputs,
            self.total_rows(),
            "hearth-kernels: a product of {inputs} inputs by weight {key} of {} rows",
            self.total_rows()
        );
    }
}

/// The keyed weights cut into pieces, by key.
pub type Pieced = HashMap<u64, Pieces>;

/// Where a keyed backward ([`backward_from`]) gets the weights it was not handed and where
/// each weight's gradient goes once it is whole. Both are called from inside the backward's
/// ops, in the order the backward runs them (the same order for the same graph: Burn runs a
/// backward's steps by depth, each depth in the order of one walk of the graph), so that
/// collectives behind them keep one order on every rank.
pub trait Source {
    /// The values of keyed weight `key` and of any other keyed weights that come with it (a
    /// bucket gathered whole), by key: the backward keeps the others for their ops. An error
    /// names what failed (the backward then goes on with zeros and reports it at its end).
    fn fetch(&mut self, key: u64) -> Result<Vec<(u64, TensorData)>, String>;
    /// Keyed weight `key`'s gradient, whole (every op that kept the key has run): `None` once
    /// taken, or the gradient back for [`backward_from`] to return.
    fn gradient(&mut self, key: u64, grad: TensorData) -> Result<Option<TensorData>, String>;
    /// Piece `piece` of keyed weight `key` (cut into [`Pieces`]: [`forward_from`]), its rows'
    /// values. Called in the forward and again in the backward, piece after piece in order.
    fn fetch_piece(&mut self, key: u64, piece: usize) -> Result<TensorData, String> {
        Err(format!(
            "weight {key} is cut into pieces (piece {piece} asked for), and this source serves \
             none"
        ))
    }
    /// Piece `piece` of keyed weight `key`'s gradient (its rows), whole: the backward keeps
    /// nothing of it.
    fn piece_gradient(&mut self, key: u64, piece: usize, grad: TensorData) -> Result<(), String> {
        let _ = grad;
        Err(format!(
            "weight {key} is cut into pieces (piece {piece}'s gradient handed over), and this \
             source takes none"
        ))
    }
}

/// The source of a [`backward_from`] under way, its lifetime erased: valid while the call's
/// guard lives, which takes it out before the call returns or unwinds.
type ScopedSource = *mut (dyn Source + 'static);

#[derive(Default)]
struct State {
    /// Inside [`forward`]: the keys the graph kept so far.
    keying: Option<Uses>,
    /// The key of the weight of the op being called (set by [`with_key`] around one call).
    pending: Option<u64>,
    /// The kernel's size of the convolution being called ([`with_conv_key`]).
    kernel: Option<[usize; 2]>,
    /// Inside [`backward`]: the weights by key, and the gradients handed out.
    provided: Option<Provided>,
    grads: HashMap<u64, TensorData>,
    /// Inside [`backward_from`]: the source (out of the state while it is called), the keys'
    /// numbers of ops, the ops still to hand out each key's gradient, and the first failure.
    source: Option<ScopedSource>,
    uses: Uses,
    left: Uses,
    failed: Option<String>,
    /// Inside [`forward_from`]: the weights cut into pieces, their source (out of the state
    /// while it is called) and the first failure.
    pieced: Option<Pieced>,
    forward_source: Option<ScopedSource>,
    forward_failed: Option<String>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// Runs `f` (a forward pass with a graph) with the ops that can keep their trainable weights
/// by key doing so; returns its result and the keys kept, each with its number of ops.
pub fn forward<R>(f: impl FnOnce() -> R) -> (R, Uses) {
    struct Restore(Option<Uses>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            STATE.with(|s| s.borrow_mut().keying = before);
        }
    }
    let before = STATE.with(|s| s.borrow_mut().keying.replace(Uses::new()));
    let restore = Restore(before);
    let out = f();
    let keys = STATE
        .with(|s| s.borrow_mut().keying.take())
        .unwrap_or_default();
    drop(restore);
    (out, keys)
}

/// Runs `f` (a backward pass through a graph built inside [`forward`], whose `uses` it gave)
/// with `values` as the weights its keyed ops read; returns its result and the gradients of
/// the keyed weights by key (summed where a weight met several ops). A weight's last op takes
/// it out of `values` (the others read a copy), so it goes as soon as that op is done.
pub fn backward<R>(
    values: HashMap<u64, TensorData>,
    uses: &Uses,
    f: impl FnOnce() -> R,
) -> (R, HashMap<u64, TensorData>) {
    let (out, grads) = run_backward(values, uses, None, f);
    (out, grads.unwrap_or_default())
}

/// [`backward`] with `source` fetching each keyed weight that `values` lack as its first op
/// needs it, and taking each keyed weight's gradient as soon as it is whole: at any time the
/// backward holds the weights fetched and not yet used up, and the gradients not yet taken.
/// Returns `f`'s result and the gradients `source` gave back, or the first failure of
/// `source` (the backward went on with zeros in its place: drop `f`'s result then).
pub fn backward_from<R>(
    values: HashMap<u64, TensorData>,
    uses: &Uses,
    source: &mut dyn Source,
    f: impl FnOnce() -> R,
) -> (R, Result<HashMap<u64, TensorData>, String>) {
    let source: *mut (dyn Source + '_) = source;
    // SAFETY: only the lifetime is erased. The pointer lives in this thread's state only
    // while `run_backward` runs (its guard takes it out on return and on unwinding), and
    // `source` is borrowed mutably for all of that call.
    let source = unsafe { std::mem::transmute::<*mut (dyn Source + '_), ScopedSource>(source) };
    run_backward(values, uses, Some(source), f)
}

type Saved = (
    Option<Provided>,
    HashMap<u64, TensorData>,
    Option<ScopedSource>,
    Uses,
    Uses,
    Option<String>,
);

fn run_backward<R>(
    values: HashMap<u64, TensorData>,
    uses: &Uses,
    source: Option<ScopedSource>,
    f: impl FnOnce() -> R,
) -> (R, Result<HashMap<u64, TensorData>, String>) {
    struct Restore(Option<Saved>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some((provided, grads, source, uses, left, failed)) = self.0.take() {
                STATE.with(|s| {
                    let mut s = s.borrow_mut();
                    s.provided = provided;
                    s.grads = grads;
                    s.source = source;
                    s.uses = uses;
                    s.left = left;
                    s.failed = failed;
                });
            }
        }
    }
    let values = values
        .into_iter()
        .map(|(k, v)| (k, (v, uses.get(&k).copied().unwrap_or(1))))
        .collect();
    let before = STATE.with(|s| {
        let mut s = s.borrow_mut();
        (
            s.provided.replace(values),
            std::mem::take(&mut s.grads),
            std::mem::replace(&mut s.source, source),
            std::mem::replace(&mut s.uses, uses.clone()),
            std::mem::replace(&mut s.left, uses.clone()),
            s.failed.take(),
        )
    });
    let restore = Restore(Some(before));
    let out = f();
    let (grads, failed) = STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.provided = None;
        s.source = None;
        (std::mem::take(&mut s.grads), s.failed.take())
    });
    drop(restore);
    (out, failed.map_or(Ok(grads), Err))
}

/// Calls `op` with `key` as the key of the weight it takes, where a [`forward`] keys weights
/// (else `op` runs as it would).
pub(crate) fn with_key<R>(key: u64, op: impl FnOnce() -> R) -> R {
    let keying = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let on = s.keying.is_some();
        if on {
            s.pending = Some(key);
        }
        on
    });
    let out = op();
    if keying {
        STATE.with(|s| s.borrow_mut().pending = None);
    }
    out
}

/// [`with_key`] for a convolution of a `kernel`-sized kernel: what its op needs to shape its
/// weight's pieces where the weight is cut into pieces of output channels ([`take_kernel`];
/// the module then holds an empty stand-in that tells nothing).
pub(crate) fn with_conv_key<R>(key: u64, kernel: [usize; 2], op: impl FnOnce() -> R) -> R {
    STATE.with(|s| s.borrow_mut().kernel = Some(kernel));
    let out = with_key(key, op);
    STATE.with(|s| s.borrow_mut().kernel = None);
    out
}

/// The kernel's size [`with_conv_key`] gave the convolution being called, taken.
pub(crate) fn take_kernel() -> Option<[usize; 2]> {
    STATE.with(|s| s.borrow_mut().kernel.take())
}

/// Whether a forward keys weights on this thread (a fast path chooses the op that can).
pub fn keying() -> bool {
    STATE.with(|s| s.borrow().keying.is_some())
}

/// The key of the weight the op being recorded takes, if it is to keep the key (taken: one
/// op per [`with_key`]), noted among the forward's keys.
pub(crate) fn take_key() -> Option<u64> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let key = s.pending.take()?;
        *s.keying.as_mut()?.entry(key).or_default() += 1;
        Some(key)
    })
}

/// The weight `key` as the backward's caller handed it in, or its [`Source`] fetched it:
/// taken by the weight's last op, a copy for the others. `shape` is the weight's, for the
/// zeros that stand in where the source failed (the failure is reported at the backward's
/// end). A keyed op's backward outside [`backward`], or a key missing from its values without
/// a source, is a caller's broken promise: the gradient cannot be computed, so it panics
/// naming the key.
pub(crate) fn value(key: u64, shape: &[usize]) -> TensorData {
    if let Some(v) = provided(key) {
        return v;
    }
    // Not handed in: fetched from the source, out of the state while it runs; after a
    // failure, zeros without asking again (a dead peer would time out every fetch).
    let (failed, source) = STATE.with(|s| {
        let mut s = s.borrow_mut();
        match s.failed {
            Some(_) => (true, None),
            None => (false, s.source.take()),
        }
    });
    if failed {
        return TensorData::zeros::<f32, _>(shape.to_vec());
    }
    let Some(source) = source else {
        let inside = STATE.with(|s| s.borrow().provided.is_some());
        match inside {
            true => panic!(
                "hearth-kernels: the backward of an op that kept weight {key} by key was not \
                 given that weight (keyed::backward's values miss it)"
            ),
            false => panic!(
                "hearth-kernels: the backward of an op that kept weight {key} by key ran outside \
                 keyed::backward"
            ),
        }
    };
    // SAFETY: set by `backward_from` for the duration of its call, which this op's backward
    // runs inside; taken out of the state while called, so never aliased.
    let fetched = unsafe { (*source).fetch(key) };
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.source = Some(source);
        match fetched {
            Ok(values) => {
                for (k, v) in values {
                    let left = s.uses.get(&k).copied().unwrap_or(1);
                    if let Some(p) = s.provided.as_mut() {
                        p.entry(k).or_insert((v, left));
                    }
                }
            }
            Err(e) => {
                s.failed.get_or_insert(e);
            }
        }
    });
    provided(key).unwrap_or_else(|| {
        STATE.with(|s| {
            s.borrow_mut().failed.get_or_insert(format!(
                "weight {key} was not among the values its source fetched"
            ));
        });
        TensorData::zeros::<f32, _>(shape.to_vec())
    })
}

/// `key`'s value among those provided (the last op's takes it), if there.
fn provided(key: u64) -> Option<TensorData> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let provided = s.provided.as_mut()?;
        let (data, left) = provided.get_mut(&key)?;
        if *left > 1 {
            *left -= 1;
            return Some(data.clone());
        }
        provided.remove(&key).map(|(data, _)| data)
    })
}

/// Hands out the gradient of keyed weight `key` (summed with one handed out before); inside
/// [`backward_from`], once all of the key's ops have handed theirs, to the source.
pub(crate) fn put_grad(key: u64, grad: TensorData) {
    let (whole, source) = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let sum = match s.grads.remove(&key) {
            Some(before) => add(before, grad),
            None => grad,
        };
        let done = match s.left.get_mut(&key) {
            Some(left) => {
                *left = left.saturating_sub(1);
                *left == 0
            }
            None => false,
        };
        // After a failure the gradients stay here: the source is not asked again.
        let ask = done && s.failed.is_none();
        match (ask, s.source.take()) {
            (true, Some(source)) => (Some(sum), Some(source)),
            (_, source) => {
                s.source = source;
                s.grads.insert(key, sum);
                (None, None)
            }
        }
    });
    let (Some(whole), Some(source)) = (whole, source) else {
        return;
    };
    // SAFETY: as in `value`.
    let taken = unsafe { (*source).gradient(key, whole) };
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.source = Some(source);
        match taken {
            Ok(Some(back)) => {
                s.grads.insert(key, back);
            }
            Ok(None) => {}
            Err(e) => {
                s.failed.get_or_insert(e);
            }
        }
    });
}

fn add(a: TensorData, b: TensorData) -> TensorData {
    let shape = a.shape().clone();
    let (Ok(x), Ok(y)) = (a.try_to_vec::<f32>(), b.try_to_vec::<f32>()) else {
        panic!("hearth-kernels: a keyed weight's gradients are not f32");
    };
    let sum: Vec<f32> = x.iter().zip(&y).map(|(x, y)| x + y).collect();
    TensorData::new(sum, shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_counted_by_op_inside_a_forward_only() {
        assert_eq!(with_key(7, take_key), None);
        let ((), uses) = forward(|| {
            assert_eq!(with_key(7, take_key), Some(7));
            assert_eq!(with_key(7, take_key), Some(7));
            assert_eq!(with_key(9, || ()), ());
            assert_eq!(
                take_key(),
                None,
                "a key not taken by its op is cleared after it"
            );
        });
        assert_eq!(uses, Uses::from([(7, 2)]));
        assert!(!keying());
    }

    #[test]
    fn a_backward_reads_values_and_sums_gradients_by_key() {
        let values = HashMap::from([(3, TensorData::new(vec![1.0f32, 2.0], [2]))]);
        let ((first, last), grads) = backward(values, &Uses::from([(3, 2)]), || {
            put_grad(3, TensorData::new(vec![1.0f32, 1.0], [2]));
            put_grad(3, TensorData::new(vec![0.5f32, 2.0], [2]));
            let first = value(3, &[2]);
            (first, value(3, &[2]))
        });
        assert_eq!(first.try_to_vec::<f32>().ok(), Some(vec![1.0, 2.0]));
        assert_eq!(last.try_to_vec::<f32>().ok(), Some(vec![1.0, 2.0]));
        assert_eq!(grads[&3].try_to_vec::<f32>().ok(), Some(vec![1.5, 3.0]));
        let missing = std::panic::catch_unwind(|| value(3, &[2]));
        assert!(missing.is_err(), "values are gone after the backward");
        let once = HashMap::from([(4, TensorData::new(vec![1.0f32], [1]))]);
        let (twice, _) = backward(once, &Uses::from([(4, 1)]), || {
            let _ = value(4, &[1]);
            std::panic::catch_unwind(|| value(4, &[1])).is_err()
        });
        assert!(twice, "a weight's last op takes it");
    }

    /// A source that fetches weights 5 and 6 together, counts its fetches and takes 5's
    /// gradient; `fail` makes its fetch fail.
    struct Bucket {
        fetches: usize,
        taken: Vec<(u64, Vec<f32>)>,
        fail: bool,
    }

    impl Source for Bucket {
        fn fetch(&mut self, key: u64) -> Result<Vec<(u64, TensorData)>, String> {
            self.fetches += 1;
            if self.fail {
                return Err(format!("the gather of {key}'s bucket failed"));
            }
            Ok(vec![
                (5, TensorData::new(vec![5.0f32, 5.0], [2])),
                (6, TensorData::new(vec![6.0f32], [1])),
            ])
        }
        fn gradient(&mut self, key: u64, grad: TensorData) -> Result<Option<TensorData>, String> {
            if key != 5 {
                return Ok(Some(grad));
            }
            let v = grad.try_to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
            self.taken.push((key, v));
            Ok(None)
        }
    }

    #[test]
    fn a_source_fetches_what_values_lack_once_and_takes_each_gradient_when_whole() {
        let mut source = Bucket {
            fetches: 0,
            taken: Vec::new(),
            fail: false,
        };
        let uses = Uses::from([(5, 2), (6, 1)]);
        let (read, grads) = backward_from(HashMap::new(), &uses, &mut source, || {
            let a = value(5, &[2]);
            put_grad(5, TensorData::new(vec![1.0f32, 2.0], [2]));
            let b = value(6, &[1]);
            let c = value(5, &[2]);
            put_grad(6, TensorData::new(vec![3.0f32], [1]));
            put_grad(5, TensorData::new(vec![1.0f32, 1.0], [2]));
            [a, b, c].map(|d| d.try_to_vec::<f32>().unwrap_or_default())
        });
        assert_eq!(read, [vec![5.0, 5.0], vec![6.0], vec![5.0, 5.0]]);
        assert_eq!(source.fetches, 1, "6 came with 5's bucket");
        assert_eq!(
            source.taken,
            vec![(5, vec![2.0, 3.0])],
            "5 taken once whole"
        );
        let grads = grads.expect("no failure");
        assert_eq!(grads.len(), 1);
        assert_eq!(grads[&6].try_to_vec::<f32>().ok(), Some(vec![3.0]));

        let mut failing = Bucket {
            fetches: 0,
            taken: Vec::new(),
            fail: true,
        };
        let (zeros, failed) = backward_from(HashMap::new(), &uses, &mut failing, || {
            let first = value(5, &[2]).try_to_vec::<f32>().unwrap_or_default();
            let again = value(6, &[1]).try_to_vec::<f32>().unwrap_or_default();
            put_grad(6, TensorData::new(vec![3.0f32], [1]));
            (first, again)
        });
        assert_eq!(
            zeros,
            (vec![0.0, 0.0], vec![0.0]),
            "zeros stand in for a failed fetch"
        );
        assert_eq!(failing.fetches, 1, "a failed source is not asked again");
        assert!(failing.taken.is_empty());
        assert_eq!(
            failed.err().as_deref(),
            Some("the gather of 5's bucket failed")
        );
        assert!(
            std::panic::catch_unwind(|| value(5, &[2])).is_err(),
            "the source is gone after the backward"
        );
    }
}
