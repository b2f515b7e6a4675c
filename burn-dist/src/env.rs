//! The edge: every `HEARTH_*` variable burn-dist knows, read here into the options the other
//! modules take. No other module reads the environment (`tests/layers.rs` checks it), so a
//! program that builds its options by hand is never changed by a variable it did not ask for.
//!
//! A variable that is unset, empty, not a number or not positive counts as unset, so the
//! option's default applies.
//!
//! | variable | sets |
//! | --- | --- |
//! | `HEARTH_COLLECTIVE_TIMEOUT` (s) | [`Communicator::from_env`]: how long a collective waits |
//! | `HEARTH_CHUNK_KB` | [`Communicator::from_env`]: pipelining granularity (KiB of `f32`) |
//! | `HEARTH_RENDEZVOUS_TIMEOUT` (s), `HEARTH_BIND` | [`RendezvousOptions::from_env`] |
//! | `HEARTH_QUIC_WINDOW_MB`, `HEARTH_MAX_FRAME_MB`, `HEARTH_INBOX_MB`, `HEARTH_FRAME_TIMEOUT` (s), `HEARTH_QUIC_ACK_EVERY`, `HEARTH_QUIC_LANES` (1-16), `HEARTH_QUIC_THREADS`, `HEARTH_QUIC_CC` (`cubic`, `bbr`, `newreno`), `HEARTH_QUIC_DEBUG`, `HEARTH_QUIC_MTU` (loopback) | [`QuicOptions::from_env`], [`QuicProfiles::from_env`] |
//! | `HEARTH_SHM` (`0`: off), `HEARTH_SHM_RING_MB`, `HEARTH_SHM_SLOT_KB` or `_MB`, `HEARTH_SHM_CHAIN` (1 or 0), `HEARTH_SHM_STALE` (s), `HEARTH_MAX_FRAME_MB`, `HEARTH_FRAME_TIMEOUT` | [`ShmOptions::from_env`] |
//! | `HEARTH_RANK`, `HEARTH_WORLD_SIZE`, `HEARTH_COORDINATOR`, `HEARTH_PORT`, torchrun's, Slurm's and Open MPI's | [`RankInfo::from_env`], [`RankInfo::detect`] |
//! | `HEARTH_JOB_SECRET`, `HEARTH_JOB_SECRET_FILE`, `HEARTH_JOB_ID`, `HEARTH_TLS_CA`/`_CERT`/`_KEY` | [`Membership::from_env`] |

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::Result;
use crate::collective::{Communicator, DEFAULT_TIMEOUT};
use crate::rendezvous::{RankInfo, RendezvousOptions};
use crate::shm::ShmOptions;
use crate::tls::Membership;
use crate::transport::Transport;
use crate::transport::quic::{Congestion, QuicOptions, QuicProfiles};

fn var(key: &str) -> Option<String> {
    std::env::var(key).ok()
}

/// A duration in seconds (fractions allowed), `None` when unset or not a positive number.
fn env_secs(key: &str) -> Option<Duration> {
    secs(&var(key)?)
}

/// A size in MiB, as bytes; `None` when unset or not a positive whole number.
fn env_mb(key: &str) -> Option<usize> {
    mib(&var(key)?)
}

/// Any value that parses from the variable's trimmed text; `None` when unset or unparsable.
fn env_parse<T: FromStr>(key: &str) -> Option<T> {
    var(key)?.trim().parse().ok()
}

/// Whether a switch is off: the variable is set to `0` (unset means on).
fn env_off(key: &str) -> bool {
    var(key).is_some_and(|v| v.trim() == "0")
}

fn secs(text: &str) -> Option<Duration> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
}

fn mib(text: &str) -> Option<usize> {
    text.trim()
        .parse::<usize>()
        .ok()
        .filter(|&mb| mb > 0)
        .map(|mb| mb << 20)
}

/// How long a collective waits for a peer: `HEARTH_COLLECTIVE_TIMEOUT` seconds, else 120 s.
pub fn collective_timeout() -> Duration {
    env_secs("HEARTH_COLLECTIVE_TIMEOUT").unwrap_or(DEFAULT_TIMEOUT)
}

impl Communicator {
    /// [`Communicator::new`] with `HEARTH_COLLECTIVE_TIMEOUT` and `HEARTH_CHUNK_KB` applied.
    pub fn from_env(transport: Arc<dyn Transport>) -> Self {
        let comm = Self::new(transport).with_timeout(collective_timeout());
        match env_parse::<usize>("HEARTH_CHUNK_KB") {
            Some(kb) => comm.with_chunk_elems(kb.saturating_mul(256)),
            None => comm,
        }
    }
}

impl QuicOptions {
    /// [`QuicOptions::default`] with the `HEARTH_QUIC_*`, `HEARTH_MAX_FRAME_MB`,
    /// `HEARTH_INBOX_MB` and `HEARTH_FRAME_TIMEOUT` variables applied.
    pub fn from_env() -> Self {
        Self::default().with_env()
    }

    /// [`QuicOptions::loopback`] with the same variables, and `HEARTH_QUIC_MTU` for its
    /// datagram size.
    pub fn loopback_from_env() -> Self {
        let mut o = Self::loopback().with_env();
        if let Some(mtu) = env_parse("HEARTH_QUIC_MTU") {
            o.fixed_mtu = Some(mtu);
        }
        o
    }

    fn with_env(mut self) -> Self {
        if let Some(b) = env_mb("HEARTH_QUIC_WINDOW_MB") {
            self.window_bytes = b as u64;
        }
        if let Some(b) = env_mb("HEARTH_MAX_FRAME_MB") {
            self.max_frame_bytes = b;
        }
        if let Some(b) = env_mb("HEARTH_INBOX_MB") {
            self.inbox_bytes = b;
        }
        if let Some(t) = env_secs("HEARTH_FRAME_TIMEOUT") {
            self.frame_timeout = t;
        }
        if let Some(n) = env_parse("HEARTH_QUIC_ACK_EVERY") {
            self.ack_every = n;
        }
        if let Some(n) = env_parse::<usize>("HEARTH_QUIC_LANES").filter(|n| (1..=16).contains(n)) {
            self.lanes = n;
        }
        if let Some(n) = env_parse::<usize>("HEARTH_QUIC_THREADS") {
            self.threads = n.max(1);
        }
        if let Some(c) = var("HEARTH_QUIC_CC").and_then(|c| Congestion::from_name(&c)) {
            self.congestion = c;
        }
        self.debug |= std::env::var_os("HEARTH_QUIC_DEBUG").is_some();
        self
    }
}

impl QuicProfiles {
    /// Both profiles from the environment ([`QuicOptions::loopback_from_env`],
    /// [`QuicOptions::from_env`]).
    pub fn from_env() -> Self {
        Self {
            loopback: QuicOptions::loopback_from_env(),
            remote: QuicOptions::from_env(),
        }
    }
}

impl ShmOptions {
    /// [`ShmOptions::default`] with the `HEARTH_SHM*`, `HEARTH_MAX_FRAME_MB` and
    /// `HEARTH_FRAME_TIMEOUT` variables applied.
    pub fn from_env() -> Self {
        let mut o = Self {
            enabled: !env_off("HEARTH_SHM"),
            ..Self::default()
        };
        if let Some(b) = env_mb("HEARTH_SHM_RING_MB") {
            o.ring_bytes = b;
        }
        if let Some(b) = env_parse::<usize>("HEARTH_SHM_SLOT_KB")
            .filter(|&kb| kb > 0)
            .map(|kb| kb << 10)
            .or_else(|| env_mb("HEARTH_SHM_SLOT_MB"))
        {
            o.slot_bytes = b;
        }
        if let Some(v) = env_parse::<u8>("HEARTH_SHM_CHAIN") {
            o.chain = Some(v != 0);
        }
        if let Some(t) = env_secs("HEARTH_SHM_STALE") {
            o.stale = t;
        }
        if let Some(b) = env_mb("HEARTH_MAX_FRAME_MB") {
            o.max_frame_bytes = b;
        }
        if let Some(t) = env_secs("HEARTH_FRAME_TIMEOUT") {
            o.frame_timeout = t;
        }
        o
    }
}

impl RendezvousOptions {
    /// [`RendezvousOptions::default`] with `HEARTH_RENDEZVOUS_TIMEOUT`, `HEARTH_BIND`, and the
    /// QUIC and shared-memory variables applied.
    pub fn from_env() -> Self {
        Self {
            timeout: env_secs("HEARTH_RENDEZVOUS_TIMEOUT").unwrap_or(Duration::from_secs(120)),
            quic: None,
            profiles: QuicProfiles::from_env(),
            bind_ip: var("HEARTH_BIND").and_then(|s| s.trim().parse().ok()),
            shm: ShmOptions::from_env(),
        }
    }
}

impl RankInfo {
    /// This process's place in the job from the launcher's variables (see
    /// [`crate::rendezvous`]); an error names what is missing or malformed.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(&var)
    }

    /// This process's place in a job, `None` when no launcher's variables are set at all (a
    /// single process). Half a pair (`RANK` without `WORLD_SIZE`, ...) or any other malformed
    /// variable is an error naming them: a job must never quietly train as one process.
    pub fn detect() -> Result<Option<Self>> {
        Self::detect_lookup(&var)
    }
}

impl Membership {
    /// From `HEARTH_JOB_SECRET`, `HEARTH_JOB_SECRET_FILE`, or `HEARTH_TLS_CA`/`_CERT`/`_KEY`.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(&var)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_and_non_positive_values_fall_back() {
        assert_eq!(secs(" 2.5 "), Some(Duration::from_millis(2500)));
        for bad in ["-1", "0", "NaN", "inf", "ten", ""] {
            assert_eq!(secs(bad), None, "{bad:?}");
        }
        assert_eq!(mib("3"), Some(3 << 20));
        for bad in ["0", "1.5", "-2", "x"] {
            assert_eq!(mib(bad), None, "{bad:?}");
        }
        assert_eq!(env_secs("BURN_DIST_NEVER_SET_ANYWHERE"), None);
        assert!(!env_off("BURN_DIST_NEVER_SET_ANYWHERE"));
    }

    #[test]
    fn the_defaults_read_no_variable() {
        // The options built by hand are the documented defaults whatever the environment
        // holds; the variables reach them only through `from_env`.
        let q = QuicOptions::default();
        assert_eq!((q.lanes, q.threads, q.ack_every), (1, 2, 20));
        assert_eq!(q.congestion, Congestion::Cubic);
        assert_eq!(QuicOptions::loopback().fixed_mtu, Some(6500));
        let s = ShmOptions::default();
        assert!(s.enabled);
        assert_eq!((s.ring_bytes, s.slot_bytes, s.chain), (4 << 20, 0, None));
        assert_eq!(RendezvousOptions::default().bind_ip, None);
    }
}
