//! The elastic worker's fault injection, in one place: the test and benchmark hooks (see
//! `hook` in `train/shared.rs`) are read once when the worker starts and acted on only here. Outside a
//! `test-hooks` build every one of them is `None`, and none of this does anything.

use std::time::Duration;

use crate::train::shared::hook;

/// This worker's hooks (each `ID:N` in its variable, for this worker's id).
#[derive(Debug, Default)]
pub(super) struct Faults {
    /// `HEARTH_ELASTIC_THROTTLE`: milliseconds of extra compute per step (a slow worker).
    throttle: Option<u64>,
    /// `HEARTH_ELASTIC_LEAVE_AT_STEP`: leave gracefully after this step, as SIGTERM would.
    leave_at: Option<u64>,
    /// `HEARTH_ELASTIC_DIE_AT_STEP`: SIGKILL inside this step, between the control and the
    /// gradient allreduce.
    die_at: Option<u64>,
    /// `HEARTH_ELASTIC_DIE_IN_CHANGE`: SIGKILL after the announcement of this membership
    /// epoch, before its rendezvous.
    die_in_change: Option<u64>,
    /// `HEARTH_ELASTIC_FREEZE_AT_STEP`: SIGSTOP inside this step (a worker cut off), until
    /// killed or `HEARTH_ELASTIC_FREEZE_SECS` later.
    freeze_at: Option<u64>,
    freeze_secs: Option<u64>,
}

impl Faults {
    /// The hooks the environment sets for worker `id`.
    pub(super) fn from_env(id: &str) -> Self {
        Self {
            throttle: hook("HEARTH_ELASTIC_THROTTLE", id),
            leave_at: hook("HEARTH_ELASTIC_LEAVE_AT_STEP", id),
            die_at: hook("HEARTH_ELASTIC_DIE_AT_STEP", id),
            die_in_change: hook("HEARTH_ELASTIC_DIE_IN_CHANGE", id),
            freeze_at: hook("HEARTH_ELASTIC_FREEZE_AT_STEP", id),
            freeze_secs: hook("HEARTH_ELASTIC_FREEZE_SECS", id),
        }
    }

    /// After the compute of the step following `step` committed steps, before its control
    /// allreduce: the slow worker's extra time; `true` when this worker is to leave gracefully
    /// after the step, as SIGTERM would have it.
    pub(super) fn after_compute(&self, step: u64) -> bool {
        if let Some(ms) = self.throttle {
            std::thread::sleep(Duration::from_millis(ms));
        }
        self.leave_at.is_some_and(|at| step + 1 >= at)
    }

    /// After that step's control allreduce, before its gradient exchange: an abrupt loss
    /// (the others then wait in the exchange when this worker vanishes, with no goodbye), or
    /// a worker cut off (alive, but not a packet in or out).
    pub(super) fn after_control(&mut self, step: u64) {
        if self.die_at.is_some_and(|at| step + 1 >= at) {
            kill_self(libc::SIGKILL);
        }
        if self.freeze_at.is_some_and(|at| step + 1 >= at) {
            self.freeze_at = None;
            // A process left behind continues this one after `freeze_secs`.
            if let Some(secs) = self.freeze_secs {
                let _ = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(format!("sleep {secs}; kill -CONT {}", std::process::id()))
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn();
            }
            kill_self(libc::SIGSTOP);
        }
    }

    /// After the announcement of membership epoch `next`, before this worker's rendezvous: a
    /// loss while the next world forms.
    pub(super) fn announced(&self, next: u64) {
        if self.die_in_change == Some(next) {
            kill_self(libc::SIGKILL);
        }
    }
}

fn kill_self(signal: libc::c_int) {
    // SAFETY: signals this very process.
    unsafe {
        libc::kill(libc::getpid(), signal);
    }
}
