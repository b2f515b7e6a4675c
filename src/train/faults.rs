//! Fault injection for the tests and benches, in one place, below every mode: the hook
//! variables are read here (once, when a worker or rank starts) and acted on only here.
//!
//! Each hook is `ID:N[,ID:N...]`, a number for the worker or rank `ID` names:
//! - `HEARTH_ELASTIC_THROTTLE` / `HEARTH_PS_DELAY_MS`: N ms of extra compute per step (a
//!   slow elastic or parameter-server worker);
//! - `HEARTH_ELASTIC_LEAVE_AT_STEP`: leave gracefully after step N, as SIGTERM would;
//! - `HEARTH_ELASTIC_DIE_AT_STEP` / `HEARTH_PS_DIE_AT_STEP`: SIGKILL itself inside step N
//!   (elastic: between the control and the gradient allreduce);
//! - `HEARTH_ELASTIC_DIE_IN_CHANGE`: SIGKILL itself after the announcement of membership
//!   epoch N, before its rendezvous;
//! - `HEARTH_ELASTIC_FREEZE_AT_STEP`: SIGSTOP itself inside step N, a worker cut off
//!   (`HEARTH_ELASTIC_FREEZE_SECS`: continued after N s);
//! - `HEARTH_FP16_OVERFLOW_AT_STEP`: an fp16 rank's gradients of step N made infinite (the
//!   loss scaler acts on it: [`super::precision::LossScaler::loss_factor`]).
//!
//! Only builds with the `test-hooks` feature (the test command and the benches that need it)
//! read the variables and compile the acting code; elsewhere a hook variable is refused by
//! name on stderr and does nothing.

use crate::settings::Precision;

/// A process's hooks (each for its own id).
#[derive(Debug, Default)]
pub(super) struct Faults {
    /// Milliseconds of extra compute per step.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    throttle_ms: Option<u64>,
    /// Leave gracefully after this step.
    leave_at: Option<u64>,
    /// SIGKILL inside this step.
    die_at: Option<u64>,
    /// SIGKILL after the announcement of this membership epoch.
    die_in_change: Option<u64>,
    /// SIGSTOP inside this step, until killed or `freeze_secs` later.
    freeze_at: Option<u64>,
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    freeze_secs: Option<u64>,
    /// The fp16 step whose gradients are made infinite.
    overflow_at: Option<u64>,
}

impl Faults {
    /// An elastic worker's hooks, for its id.
    pub fn elastic(id: &str, precision: Precision) -> Self {
        Self {
            throttle_ms: hook("HEARTH_ELASTIC_THROTTLE", id),
            leave_at: hook("HEARTH_ELASTIC_LEAVE_AT_STEP", id),
            die_at: hook("HEARTH_ELASTIC_DIE_AT_STEP", id),
            die_in_change: hook("HEARTH_ELASTIC_DIE_IN_CHANGE", id),
            freeze_at: hook("HEARTH_ELASTIC_FREEZE_AT_STEP", id),
            freeze_secs: hook("HEARTH_ELASTIC_FREEZE_SECS", id),
            overflow_at: overflow_hook(precision, id),
        }
    }

    /// A parameter-server worker's hooks, for its id (`w<rank>`).
    pub fn ps_worker(id: &str, precision: Precision) -> Self {
        Self {
            throttle_ms: hook("HEARTH_PS_DELAY_MS", id),
            die_at: hook("HEARTH_PS_DIE_AT_STEP", id),
            overflow_at: overflow_hook(precision, id),
            ..Self::default()
        }
    }

    /// A data-parallel or pipeline rank's hooks (fp16 overflow only), for its rank.
    pub fn rank(rank: usize, precision: Precision) -> Self {
        Self {
            overflow_at: overflow_hook(precision, &rank.to_string()),
            ..Self::default()
        }
    }

    /// The fp16 step whose gradients are to be made infinite.
    pub fn overflow_at(&self) -> Option<u64> {
        self.overflow_at
    }

    /// After the compute of the step following `step` done steps: the slow worker's extra
    /// time; `true` when this worker is to leave gracefully after the step.
    pub fn after_compute(&self, step: u64) -> bool {
        #[cfg(feature = "test-hooks")]
        if let Some(ms) = self.throttle_ms {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        self.leave_at.is_some_and(|at| step + 1 >= at)
    }

    /// Later in that step (elastic: after its control allreduce, before its gradient
    /// exchange): an abrupt loss (the others then wait in the exchange when this worker
    /// vanishes, with no goodbye), or a worker cut off (alive, but not a packet in or out).
    pub fn in_step(&mut self, step: u64) {
        if self.die_at.is_some_and(|at| step + 1 >= at) {
            kill_self(Signal::Kill);
        }
        if self.freeze_at.is_some_and(|at| step + 1 >= at) {
            self.freeze_at = None;
            #[cfg(feature = "test-hooks")]
            if let Some(secs) = self.freeze_secs {
                // A process left behind continues this one after `freeze_secs`.
                let _ = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(format!("sleep {secs}; kill -CONT {}", std::process::id()))
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn();
            }
            kill_self(Signal::Stop);
        }
    }

    /// After the announcement of membership epoch `next`, before this worker's rendezvous: a
    /// loss while the next world forms.
    pub fn announced(&self, next: u64) {
        if self.die_in_change == Some(next) {
            kill_self(Signal::Kill);
        }
    }
}

enum Signal {
    Kill,
    Stop,
}

/// Signals this very process (a `test-hooks` build only: elsewhere no hook is ever set).
fn kill_self(signal: Signal) {
    #[cfg(feature = "test-hooks")]
    // SAFETY: signals this very process.
    unsafe {
        libc::kill(
            libc::getpid(),
            match signal {
                Signal::Kill => libc::SIGKILL,
                Signal::Stop => libc::SIGSTOP,
            },
        );
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = signal;
}

/// The step of `HEARTH_FP16_OVERFLOW_AT_STEP` for the process `id` names, in an fp16 run.
fn overflow_hook(precision: Precision, id: &str) -> Option<u64> {
    (precision == Precision::Fp16)
        .then(|| hook("HEARTH_FP16_OVERFLOW_AT_STEP", id))
        .flatten()
}

/// `id`'s number in the hook variable `name`, in a `test-hooks` build.
fn hook(name: &str, id: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    if !cfg!(feature = "test-hooks") {
        eprintln!(
            "warning: {name} is a test hook, and this build of hearth has none (the \
             `test-hooks` cargo feature is off): ignored"
        );
        return None;
    }
    hook_value(&value, id)
}

/// `id`'s number in a hook value `ID:N[,ID:N...]`.
fn hook_value(value: &str, id: &str) -> Option<u64> {
    value.split(',').find_map(|part| {
        let (who, n) = part.trim().split_once(':')?;
        (who == id).then(|| n.parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_values_name_workers() {
        assert_eq!(hook_value("w0:3, w12:40", "w12"), Some(40));
        assert_eq!(hook_value("w0:3", "w1"), None);
        assert_eq!(hook_value("w0:x,garbage", "w0"), None);
        // PATH is set in every test environment: no worker's hook either way.
        assert_eq!(hook("PATH", "w0"), None);
    }

    #[test]
    fn a_worker_without_hooks_never_leaves_or_stops() {
        let mut none = Faults::default();
        assert!(!none.after_compute(1_000));
        none.in_step(1_000);
        none.announced(7);
        assert_eq!(none.overflow_at(), None);
        let leaver = Faults {
            leave_at: Some(3),
            ..Faults::default()
        };
        assert!(!leaver.after_compute(1));
        assert!(leaver.after_compute(2));
    }
}
