//! ZeRO stage 3 with `--overlap`: a thread that gathers the forward's units ahead of it
//! (PyTorch FSDP's forward prefetch), so that a unit's gathers run while the units before it
//! compute instead of between them.
//!
//! How far ahead is a budget of bytes, not a number of units: the thread starts a unit's
//! gathers while what it has handed over and the forward has not taken yet, with that unit, fits
//! in one bucket (`--bucket-mb`), or when nothing waits. A ResNet's first units compute long on
//! large activations and hold few parameters, its last ones the reverse: one unit ahead left the
//! link idle during the first and the forward waiting on it during the last, where a bucket's
//! worth of small units ahead moves some of those gathers into the idle time. A unit larger
//! than the budget is still gathered one ahead, alone.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, channel};

use burn_dist::zero::module::GatheredValues;

use super::gathered::{Gathering, Shards};
use super::room::Room;
use super::stage::StageModel;

/// The forward's units' parameters from the thread, in the forward's order.
pub(super) struct ForwardAhead<'a> {
    rx: Receiver<(burn_dist::Result<GatheredValues>, usize)>,
    room: Arc<Room>,
    params: &'a burn_dist::zero::module::ShardedParams,
}

/// Starts the thread that gathers `segments`' parameters in the forward's order, ahead of it
/// by at most a bucket's bytes (or one unit). It ends after the last unit, before the first
/// unit's backward can start its own thread on the same communicator, or, if the forward stops
/// early, once the forward drops its end.
pub(super) fn forward_ahead<'s, 'e, 'a: 's>(
    scope: &'s std::thread::Scope<'s, 'e>,
    g: &'a Gathering<'a>,
    segments: &[StageModel],
) -> burn_dist::Result<ForwardAhead<'a>> {
    let units = segments
        .iter()
        .map(|s| {
            let tensors = g.params.tensors_of(s)?;
            let bytes = g.params.len_of(tensors.clone()) * std::mem::size_of::<f32>();
            Ok((tensors, bytes))
        })
        .collect::<burn_dist::Result<Vec<_>>>()?;
    let shards = Shards::of(g);
    let room = Arc::new(Room::new(g.zero.bucket_bytes()));
    let (tx, rx) = channel();
    let thread_room = room.clone();
    std::thread::Builder::new()
        .name("hearth-zero3-forward-ahead".into())
        .spawn_scoped(scope, move || {
            for (tensors, bytes) in units {
                if !thread_room.admit(bytes) {
                    return;
                }
                let values = shards
                    .params
                    .gather_values(shards.zero, shards.comm, tensors);
                let failed = values.is_err();
                if tx.send((values, bytes)).is_err() || failed {
                    return;
                }
            }
        })
        .map_err(|e| {
            burn_dist::DistError::Config(format!("starting stage 3's forward gather thread: {e}"))
        })?;
    Ok(ForwardAhead {
        rx,
        room,
        params: g.params,
    })
}

impl ForwardAhead<'_> {
    /// Unit `k` (`skeleton`, the forward's next) with its parameters from the thread.
    pub(super) fn take(
        &mut self,
        k: usize,
        skeleton: &StageModel,
    ) -> burn_dist::Result<StageModel> {
        match self.rx.recv() {
            Ok((values, bytes)) => {
                self.room.taken(bytes);
                self.params.with_values(skeleton, values?)
            }
            Err(_) => Err(burn_dist::DistError::Config(format!(
                "unit {k}'s parameters: the thread gathering the forward's units ended before it"
            ))),
        }
    }
}

impl Drop for ForwardAhead<'_> {
    /// A thread waiting for room stops (the forward ended early, or failed).
    fn drop(&mut self) {
        self.room.close();
    }
}
