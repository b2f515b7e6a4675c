//! A budget of bytes that one thread hands to another and the other has not taken yet
//! ([`Room`]): how far ahead a producer may run. ZeRO stage 3's forward gathers ahead under
//! one (Hearth's `pipeline/forward_ahead.rs`: a bucket's bytes), and the overlapped ZeRO
//! exchange takes gradients under one ([`crate::zero::overlap::ShardedExchange`]: two of its
//! largest buckets), so that a backward that produces gradients faster than they are reduced
//! waits instead of piling them up.
//!
//! Hearth's backward gather thread stays one bucket ahead through a rendezvous instead: with
//! more, its gathers took the link from the gradient reductions beside them and the step got
//! slower (ResNet-50 between two hosts at 1 Gbit/s, 2026-12-04, two runs of 8 steps each:
//! 2.23-2.24 s a step against 2.14-2.16 s).

use std::sync::{Condvar, Mutex};

/// The bytes a thread has handed over and its taker not taken yet, against a budget.
#[derive(Debug)]
pub struct Room {
    state: Mutex<Waiting>,
    changed: Condvar,
    budget: usize,
}

#[derive(Debug, Default)]
struct Waiting {
    bytes: usize,
    /// The taker is gone: the thread stops.
    closed: bool,
}

impl Room {
    /// An empty room of `budget` bytes.
    pub fn new(budget: usize) -> Self {
        Self {
            state: Mutex::new(Waiting::default()),
            changed: Condvar::new(),
            budget,
        }
    }

    /// Waits until `bytes` more fit beside what waits (always when nothing does) and counts
    /// them as handed over; `false` once the taker is gone.
    pub fn admit(&self, bytes: usize) -> bool {
        let Ok(mut w) = self.state.lock() else {
            return false;
        };
        while !w.closed && w.bytes > 0 && w.bytes + bytes > self.budget {
            w = match self.changed.wait(w) {
                Ok(w) => w,
                Err(_) => return false,
            };
        }
        if w.closed {
            return false;
        }
        w.bytes += bytes;
        true
    }

    /// The taker took a unit of `bytes`.
    pub fn taken(&self, bytes: usize) {
        if let Ok(mut w) = self.state.lock() {
            w.bytes = w.bytes.saturating_sub(bytes);
        }
        self.changed.notify_all();
    }

    /// The taker is gone: a thread waiting in [`Self::admit`], and any that comes, gets
    /// `false`.
    pub fn close(&self) {
        if let Ok(mut w) = self.state.lock() {
            w.closed = true;
        }
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    /// Small units go ahead until the budget is full, a unit larger than the budget goes
    /// alone once nothing waits, and a closed room lets a waiting thread go.
    #[test]
    fn units_go_ahead_within_the_budget_or_one_at_a_time() {
        let room = Arc::new(Room::new(10));
        assert!(room.admit(4));
        assert!(room.admit(6), "4 + 6 fit in 10");
        let (tx, rx) = channel();
        let thread_room = room.clone();
        let thread = std::thread::spawn(move || {
            // 10 wait: 25 waits for all of them to be taken, then goes alone.
            let admitted = thread_room.admit(25);
            let _ = tx.send(admitted);
            // 25 waits: the next waits until the room closes.
            let after_close = thread_room.admit(1);
            let _ = tx.send(after_close);
        });
        let wait = Duration::from_millis(200);
        assert!(rx.recv_timeout(wait).is_err(), "25 waits beside 10");
        room.taken(4);
        assert!(rx.recv_timeout(wait).is_err(), "and beside 6");
        room.taken(6);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
        assert!(rx.recv_timeout(wait).is_err(), "1 waits beside 25");
        room.close();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(false));
        thread.join().expect("the thread ends");
    }
}
