//! Where in a training step its live heap peaked: the step's thread marks what it is doing
//! ([`mark`]: a unit's forward or backward), and the counting allocator notes the mark each
//! time the step's peak rises, so the largest rise comes with the part of the step it fell in
//! ([`at_largest_rise`]). Allocations on other threads (a gather or exchange thread) count
//! against what the step's thread is doing then, which is the question: what the step was
//! running when it held the most.
//!
//! Marked by the pipeline's units (ZeRO stage 3, `--recompute`); elsewhere a step has one part.

use std::sync::atomic::{AtomicUsize, Ordering};

/// A part of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Nothing marked since the step began: its batch, and in modes without units all of it.
    Step,
    /// Unit `k`'s forward (units counted from the input).
    Forward(usize),
    /// Unit `k`'s backward.
    Backward(usize),
    /// After the last unit's backward: the exchange's end and the optimizer's update.
    Update,
}

impl Phase {
    fn code(self) -> usize {
        match self {
            Phase::Step => 0,
            Phase::Update => 1,
            Phase::Forward(k) => 2 + 2 * k,
            Phase::Backward(k) => 3 + 2 * k,
        }
    }

    fn of(code: usize) -> Self {
        match code {
            0 => Phase::Step,
            1 => Phase::Update,
            c if c % 2 == 0 => Phase::Forward((c - 2) / 2),
            c => Phase::Backward((c - 3) / 2),
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Step => write!(f, "the step outside its units"),
            Phase::Forward(k) => write!(f, "unit {k}'s forward"),
            Phase::Backward(k) => write!(f, "unit {k}'s backward"),
            Phase::Update => write!(f, "the update after the backward"),
        }
    }
}

static NOW: AtomicUsize = AtomicUsize::new(0);
/// The mark when the running step's peak last rose.
static AT_STEP_PEAK: AtomicUsize = AtomicUsize::new(0);
/// The mark at the peak of the step with the largest rise so far.
static AT_LARGEST_RISE: AtomicUsize = AtomicUsize::new(0);

/// The step's thread is now doing `phase`.
pub fn mark(phase: Phase) {
    NOW.store(phase.code(), Ordering::Relaxed);
}

/// The step's peak rose (the allocator, on the allocating thread).
pub(super) fn peak_rose() {
    AT_STEP_PEAK.store(NOW.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// A step ended with `largest` true when its rise is the largest so far; the next step begins.
pub(super) fn step_ended(largest: bool) {
    if largest {
        AT_LARGEST_RISE.store(AT_STEP_PEAK.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    NOW.store(Phase::Step.code(), Ordering::Relaxed);
    AT_STEP_PEAK.store(Phase::Step.code(), Ordering::Relaxed);
}

/// The part of the step with the largest rise ([`super::step_rise_bytes`]) where its heap
/// peaked; [`Phase::Step`] where nothing was marked.
pub fn at_largest_rise() -> Phase {
    Phase::of(AT_LARGEST_RISE.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_survives_its_code() {
        for p in [
            Phase::Step,
            Phase::Update,
            Phase::Forward(0),
            Phase::Forward(17),
            Phase::Backward(0),
            Phase::Backward(17),
        ] {
            assert_eq!(Phase::of(p.code()), p);
        }
        assert_eq!(Phase::Backward(3).to_string(), "unit 3's backward");
    }
}
