//! [`QuicOptions`]: the connection settings, below the transport and its stream framing.

use std::sync::Arc;
use std::time::Duration;

use quinn::VarInt;

use crate::{DistError, Result};

/// Connection settings.
#[derive(Debug, Clone)]
pub struct QuicOptions {
    /// A silent peer is declared failed after this long (keep-alives go every second).
    pub idle_timeout: Duration,
    /// Fixed UDP payload size, with MTU discovery off. `None`: quinn's default (1200 bytes, then
    /// discovery up to 1452), right for real networks. Loopback takes far larger datagrams.
    pub fixed_mtu: Option<u16>,
    /// Flow-control window per connection.
    pub window_bytes: u64,
    /// UDP socket send and receive buffer sizes requested from the kernel.
    pub socket_buffer: usize,
    /// Largest frame payload accepted (`HEARTH_MAX_FRAME_MB`, default 256 MiB); a larger length
    /// field is a protocol error that cuts the peer off before anything is allocated.
    pub max_frame_bytes: usize,
    /// Bytes of received, not yet consumed messages held at most (`HEARTH_INBOX_MB`, default
    /// 1 GiB); past it, reading pauses and QUIC flow control slows the senders.
    pub inbox_bytes: usize,
    /// A frame must arrive whole within this time once its stream opened, and a paused read
    /// must find room within it (`HEARTH_FRAME_TIMEOUT` seconds, default 120); otherwise the
    /// peer is failed.
    pub frame_timeout: Duration,
    /// Packets a receiver may take before it must acknowledge (`HEARTH_QUIC_ACK_EVERY`,
    /// default 20; 2 is QUIC's usual every other packet), through QUIC's ACK-frequency
    /// extension, which both ends of a Hearth job speak.
    pub ack_every: u32,
    /// QUIC connections per pair of ranks (`HEARTH_QUIC_LANES`, default 1); messages are spread
    /// over them by tag, so a collective's chunks travel on all of them.
    pub lanes: usize,
    /// Threads of the node's I/O runtime (`HEARTH_QUIC_THREADS`, default 2).
    pub threads: usize,
    /// Congestion control (`HEARTH_QUIC_CC`: `bbr` or `newreno`; default quinn's Cubic).
    pub congestion: Congestion,
    /// Socket buffer sizes at bind and per-peer statistics at shutdown on stderr
    /// (`HEARTH_QUIC_DEBUG`).
    pub debug: bool,
}

/// QUIC congestion controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Congestion {
    /// quinn's default.
    #[default]
    Cubic,
    Bbr,
    NewReno,
}

impl Congestion {
    /// `cubic`, `bbr` or `newreno`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name.trim() {
            "cubic" => Some(Self::Cubic),
            "bbr" => Some(Self::Bbr),
            "newreno" => Some(Self::NewReno),
            _ => None,
        }
    }
}

/// The settings for peers on this machine and for remote ones: a node picks by the address it
/// binds or dials.
#[derive(Debug, Clone)]
pub struct QuicProfiles {
    pub loopback: QuicOptions,
    pub remote: QuicOptions,
}

impl Default for QuicProfiles {
    fn default() -> Self {
        Self {
            loopback: QuicOptions::loopback(),
            remote: QuicOptions::default(),
        }
    }
}

impl QuicProfiles {
    /// `loopback` for a loopback address, else `remote`.
    pub fn for_ip(&self, ip: std::net::IpAddr) -> &QuicOptions {
        if ip.is_loopback() {
            &self.loopback
        } else {
            &self.remote
        }
    }
}

impl Default for QuicOptions {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(5),
            fixed_mtu: None,
            window_bytes: 64 << 20,
            socket_buffer: 16 << 20,
            max_frame_bytes: 256 << 20,
            inbox_bytes: 1 << 30,
            frame_timeout: Duration::from_secs(120),
            ack_every: 20,
            lanes: 1,
            threads: 2,
            congestion: Congestion::Cubic,
            debug: false,
        }
    }
}

impl QuicOptions {
    /// Settings for ranks that all run on one machine (bigger datagrams: 6500 bytes,
    /// `HEARTH_QUIC_MTU` through [`QuicOptions::loopback_from_env`]).
    pub fn loopback() -> Self {
        Self {
            fixed_mtu: Some(6500),
            ..Self::default()
        }
    }

    pub(super) fn transport_config(&self) -> Result<quinn::TransportConfig> {
        let mut t = quinn::TransportConfig::default();
        let idle =
            quinn::IdleTimeout::try_from(self.idle_timeout).map_err(|e| DistError::Quic {
                context: "idle timeout".into(),
                reason: e.to_string(),
            })?;
        t.max_idle_timeout(Some(idle));
        t.keep_alive_interval(Some(Duration::from_secs(1).min(self.idle_timeout / 3)));
        t.max_concurrent_uni_streams(VarInt::from_u32(4096));
        t.max_concurrent_bidi_streams(VarInt::from_u32(0));
        let w = VarInt::from_u64(self.window_bytes).unwrap_or(VarInt::MAX);
        t.receive_window(w);
        t.stream_receive_window(w);
        t.send_window(self.window_bytes);
        match self.congestion {
            Congestion::Bbr => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
            }
            Congestion::NewReno => {
                t.congestion_controller_factory(Arc::new(
                    quinn::congestion::NewRenoConfig::default(),
                ));
            }
            Congestion::Cubic => {}
        }
        // Fewer acknowledgements: on a saturated link every ACK packet takes the place of data
        // (quinn's default acknowledges every other packet: a third of all packets).
        if self.ack_every > 2 {
            let mut ack = quinn::AckFrequencyConfig::default();
            ack.ack_eliciting_threshold(VarInt::from_u32(self.ack_every - 1))
                .max_ack_delay(Some(Duration::from_millis(5)));
            t.ack_frequency_config(Some(ack));
        }
        if let Some(mtu) = self.fixed_mtu {
            t.initial_mtu(mtu);
            // QUIC's floor: the path is assumed to carry 1200-byte datagrams at least.
            t.min_mtu(1200);
            t.mtu_discovery_config(None);
        }
        Ok(t)
    }
}
