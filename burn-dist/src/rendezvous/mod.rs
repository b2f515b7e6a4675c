//! How ranks find each other.
//!
//! [`RankInfo::from_env`] reads this process's rank, the world size and the coordinator from the
//! first complete set of:
//!
//! | source | rank | world | coordinator |
//! | --- | --- | --- | --- |
//! | Hearth | `HEARTH_RANK` | `HEARTH_WORLD_SIZE` | `HEARTH_COORDINATOR` (`host:port`) |
//! | torchrun | `RANK` | `WORLD_SIZE` | `MASTER_ADDR`:`MASTER_PORT` |
//! | Slurm | `SLURM_PROCID` | `SLURM_NTASKS` | first host of `SLURM_JOB_NODELIST`, else `SLURM_LAUNCH_NODE_IPADDR`; port `HEARTH_PORT` (default 29400) |
//! | Open MPI | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `HEARTH_COORDINATOR`, or `MASTER_ADDR`:`MASTER_PORT` |
//!
//! [`connect`] then forms the job: rank 0 listens on the coordinator address; every other rank
//! connects to it (retrying until the timeout) and announces its own listening port; once all
//! have arrived rank 0 sends everyone the table of addresses, and each rank connects to the
//! ranks below it. A rank that never arrives makes rank 0 fail with
//! [`crate::DistError::MissingRanks`] naming it, within the timeout.
//!
//! **Ranks that members cannot forge.** With a job secret every holder could make a certificate
//! for any rank, so the secret only admits a process to the rendezvous: rank 0 makes a fresh
//! rank authority ([`crate::tls::RankAuthority`], a key that never leaves it), and once every
//! rank has said hello it issues each one a certificate for the rank it was admitted as, over
//! the key that member proved it holds in its handshake. Each member then accepts and presents
//! only issued certificates with the other members, and says so; rank 0 hands out the table
//! only when every member has. A second process claiming a rank fails the rendezvous naming the
//! rank; after it, a member holding the secret cannot present another rank's certificate. With
//! a user's CA the ranks come from the user's certificates and nothing is issued. The QUIC links then carry the
//! shared-memory negotiation, and the rank's transport is a [`RoutedTransport`] over both.
//!
//! Files: `rank_info` (the launchers' variables), `messages` (hello and table), `accept`
//! (concurrent handshakes, each with its own timeout), `coordinate` (rank 0), `join` (the
//! others); this file forms the job from them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use crate::Result;
use crate::routed::RoutedTransport;
use crate::shm::ShmOptions;
use crate::tls::{Identity, Membership};
use crate::transport::quic::{QuicNode, QuicOptions, QuicProfiles, QuicTransport};

mod accept;
mod coordinate;
mod join;
mod link;
mod messages;
mod rank_info;
#[cfg(test)]
mod tests;

pub use link::Abort;
use link::Link;
pub use rank_info::{DEFAULT_PORT, RankInfo, first_slurm_host};

/// Rendezvous settings.
#[derive(Debug, Clone)]
pub struct RendezvousOptions {
    /// How long rank 0 waits for everyone, and others for rank 0 and their peers (default
    /// 120 s, or `HEARTH_RENDEZVOUS_TIMEOUT` seconds).
    pub timeout: Duration,
    /// QUIC settings; `None` picks from `profiles` by the coordinator's address.
    pub quic: Option<QuicOptions>,
    /// The QUIC settings for a loopback coordinator and for a remote one, where `quic` is
    /// `None`.
    pub profiles: QuicProfiles,
    /// Address to listen on for peers (non-zero ranks); default: 127.0.0.1 for a loopback
    /// coordinator, else 0.0.0.0 (`HEARTH_BIND` overrides).
    pub bind_ip: Option<IpAddr>,
    /// Shared memory between ranks of one host (on unless `HEARTH_SHM=0`; see [`crate::shm`]).
    pub shm: ShmOptions,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            quic: None,
            profiles: QuicProfiles::default(),
            bind_ip: None,
            shm: ShmOptions::default(),
        }
    }
}

impl RendezvousOptions {
    /// The QUIC settings for a coordinator at `ip`: `quic` where set, else its profile.
    pub fn quic_for(&self, ip: IpAddr) -> QuicOptions {
        self.quic
            .clone()
            .unwrap_or_else(|| self.profiles.for_ip(ip).clone())
    }
}

/// Forms the job described by `info` and returns this rank's transport.
pub fn connect(
    info: &RankInfo,
    membership: &Membership,
    options: &RendezvousOptions,
) -> Result<RoutedTransport> {
    connect_epoch(info, membership, options, 0)
}

/// [`connect`] for membership epoch `epoch` of an elastic job: the transport stamps its frames
/// with the epoch and drops any of another (a late frame of the world before a change).
pub fn connect_epoch(
    info: &RankInfo,
    membership: &Membership,
    options: &RendezvousOptions,
    epoch: u32,
) -> Result<RoutedTransport> {
    connect_epoch_on(None, info, membership, options, epoch)
}

/// Binds a coordinator's endpoint on `ip` at a free port before the rendezvous, so an elastic
/// job's new rank 0 can announce where it waits (its [`QuicNode::local_addr`]) and then run
/// [`connect_epoch_on`] with it.
pub fn bind_coordinator(
    ip: IpAddr,
    membership: &Membership,
    options: &RendezvousOptions,
) -> Result<QuicNode> {
    let quic = options.quic_for(ip);
    QuicNode::bind(
        SocketAddr::new(ip, 0),
        &Identity::new(membership, 0)?,
        &quic,
    )
}

/// [`connect_epoch`], rank 0 on an endpoint already bound by [`bind_coordinator`] (`None`:
/// bind the coordinator address, as [`connect_epoch`] does).
pub fn connect_epoch_on(
    bound: Option<QuicNode>,
    info: &RankInfo,
    membership: &Membership,
    options: &RendezvousOptions,
    epoch: u32,
) -> Result<RoutedTransport> {
    connect_epoch_watched(bound, info, membership, options, epoch, None)
}

/// [`connect_epoch_on`], given up as soon as `abort` says so (see [`Abort`]).
pub fn connect_epoch_watched(
    bound: Option<QuicNode>,
    info: &RankInfo,
    membership: &Membership,
    options: &RendezvousOptions,
    epoch: u32,
    abort: Option<Abort>,
) -> Result<RoutedTransport> {
    let coordinator = info.coordinator_addr()?;
    let loopback = coordinator.ip().is_loopback();
    let quic = options.quic_for(coordinator.ip());
    let identity = Identity::new(membership, info.rank)?;
    let bind_ip = options.bind_ip.unwrap_or(if loopback {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    });
    let bind = if info.rank == 0 {
        SocketAddr::new(bind_ip, coordinator.port())
    } else {
        SocketAddr::new(bind_ip, 0)
    };
    let node = match bound {
        Some(node) if info.rank == 0 => node,
        _ => QuicNode::bind(bind, &identity, &quic)?,
    };
    let deadline = Instant::now() + options.timeout;
    let link = Link {
        deadline,
        timeout: options.timeout,
        lanes: quic.lanes.max(1),
        issues: membership.rank_zero_issues(),
        abort,
    };
    let peers = if info.rank == 0 {
        coordinate::coordinate(&node, info, &link)?
    } else {
        join::join(&node, info, coordinator, &link, &identity)?
    };
    let quic = QuicTransport::start_lanes(node, info.rank, epoch, peers, &quic);
    // Ranks of one host move to shared memory (every rank takes part, whatever its host).
    RoutedTransport::over(
        quic,
        &options.shm,
        deadline.max(Instant::now() + options.timeout / 2),
    )
}
