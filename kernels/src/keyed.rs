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

use std::cell::RefCell;
use std::collections::HashMap;

use burn::tensor::TensorData;

/// Each key a graph kept, with the number of its ops that kept it.
pub type Uses = HashMap<u64, usize>;

/// Inside [`backward`]: a weight by key and the number of its ops still to read it.
type Provided = HashMap<u64, (TensorData, usize)>;

#[derive(Default)]
struct State {
    /// Inside [`forward`]: the keys the graph kept so far.
    keying: Option<Uses>,
    /// The key of the weight of the op being called (set by [`with_key`] around one call).
    pending: Option<u64>,
    /// Inside [`backward`]: the weights by key, and the gradients handed out.
    provided: Option<Provided>,
    grads: HashMap<u64, TensorData>,
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
    struct Restore(Option<(Option<Provided>, HashMap<u64, TensorData>)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some((provided, grads)) = self.0.take() {
                STATE.with(|s| {
                    let mut s = s.borrow_mut();
                    s.provided = provided;
                    s.grads = grads;
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
        let provided = s.provided.replace(values);
        (provided, std::mem::take(&mut s.grads))
    });
    let restore = Restore(Some(before));
    let out = f();
    let grads = STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.provided = None;
        std::mem::take(&mut s.grads)
    });
    drop(restore);
    (out, grads)
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

/// The weight `key` as the backward's caller handed it in: taken by the weight's last op, a
/// copy for the others. A keyed op's backward outside [`backward`], or a key missing from its
/// values, is a caller's broken promise: the gradient cannot be computed, so it panics naming
/// the key.
pub(crate) fn value(key: u64) -> TensorData {
    let found = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let provided = s.provided.as_mut()?;
        let Some((data, left)) = provided.get_mut(&key) else {
            return Some(None);
        };
        if *left > 1 {
            *left -= 1;
            return Some(Some(data.clone()));
        }
        Some(provided.remove(&key).map(|(data, _)| data))
    });
    match found {
        Some(Some(v)) => v,
        Some(None) => panic!(
            "hearth-kernels: the backward of an op that kept weight {key} by key was not given \
             that weight (keyed::backward's values miss it)"
        ),
        None => panic!(
            "hearth-kernels: the backward of an op that kept weight {key} by key ran outside \
             keyed::backward"
        ),
    }
}

/// Hands out the gradient of keyed weight `key` (summed with one handed out before).
pub(crate) fn put_grad(key: u64, grad: TensorData) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let sum = match s.grads.remove(&key) {
            Some(before) => add(before, grad),
            None => grad,
        };
        s.grads.insert(key, sum);
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
            let first = value(3);
            (first, value(3))
        });
        assert_eq!(first.try_to_vec::<f32>().ok(), Some(vec![1.0, 2.0]));
        assert_eq!(last.try_to_vec::<f32>().ok(), Some(vec![1.0, 2.0]));
        assert_eq!(grads[&3].try_to_vec::<f32>().ok(), Some(vec![1.5, 3.0]));
        let missing = std::panic::catch_unwind(|| value(3));
        assert!(missing.is_err(), "values are gone after the backward");
        let once = HashMap::from([(4, TensorData::new(vec![1.0f32], [1]))]);
        let (twice, _) = backward(once, &Uses::from([(4, 1)]), || {
            let _ = value(4);
            std::panic::catch_unwind(|| value(4)).is_err()
        });
        assert!(twice, "a weight's last op takes it");
    }
}
