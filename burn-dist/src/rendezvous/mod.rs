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
//! [`DistError::MissingRanks`] naming it, within the timeout.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use quinn::Connection;

use crate::shm::ShmOptions;
use crate::tls::{Identity, Membership, SERVER_NAME};
use crate::transport::quic::{QuicNode, QuicOptions, QuicTransport, read_frame, write_frame};
use crate::wire::{Header, Kind, Reader, Writer};
use crate::{DistError, Result};

/// Default coordinator port when only a host is known (Slurm).
pub const DEFAULT_PORT: u16 = 29400;

/// Where this process stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
    /// Rank within its machine, when the launcher says (`LOCAL_RANK`, `SLURM_LOCALID`, ...).
    pub local_rank: Option<usize>,
    /// `host:port` of rank 0.
    pub coordinator: String,
    /// Which variables it came from.
    pub source: &'static str,
}

/// First host of a Slurm node list: `node[03-05,9],gpu1` -> `node03`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let first_end = {
        let mut depth = 0;
        let mut end = list.len();
        for (i, ch) in list.char_indices() {
            match ch {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        end
    };
    let first = &list[..first_end];
    match first.find('[') {
        None => Some(first.to_string()),
        Some(open) => {
            let prefix = &first[..open];
            let inner = first[open + 1..].trim_end_matches(']');
            let range = inner.split(',').next()?;
            let start = range.split('-').next()?;
            Some(format!("{prefix}{start}"))
        }
    }
}

/// The (rank, world size) variable pairs of the launchers [`RankInfo`] reads.
const RANK_PAIRS: [(&str, &str); 4] = [
    ("HEARTH_RANK", "HEARTH_WORLD_SIZE"),
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
];

impl RankInfo {
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// This process's place in a job, `None` when no launcher's variables are set at all (a
    /// single process). Half a pair (`RANK` without `WORLD_SIZE`, ...) or any other malformed
    /// variable is an error naming them: a job must never quietly train as one process.
    pub fn detect() -> Result<Option<Self>> {
        Self::detect_lookup(&|k| std::env::var(k).ok())
    }

    /// As [`RankInfo::detect`], from any variable lookup.
    pub fn detect_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let mut any = false;
        for (r, w) in RANK_PAIRS {
            match (get(r), get(w)) {
                (Some(v), None) => {
                    return Err(DistError::Config(format!(
                        "{r}={v:?} is set but {w} is not: set both (and the coordinator) to \
                         join a job, or neither to train as one process"
                    )));
                }
                (None, Some(v)) => {
                    return Err(DistError::Config(format!(
                        "{w}={v:?} is set but {r} is not: set both (and the coordinator) to \
                         join a job, or neither to train as one process"
                    )));
                }
                (Some(_), Some(_)) => any = true,
                (None, None) => {}
            }
        }
        if !any {
            return Ok(None);
        }
        Self::from_lookup(get).map(Some)
    }

    /// As [`RankInfo::from_env`], from any variable lookup (tests pass a map).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |k: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                    DistError::Config(format!("{k}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let master = || -> Option<String> {
            Some(format!("{}:{}", get("MASTER_ADDR")?, get("MASTER_PORT")?))
        };
        let local = num("LOCAL_RANK")?;
        let (rank, world, coordinator, source, local_rank) = if let (Some(r), Some(w)) =
            (num("HEARTH_RANK")?, num("HEARTH_WORLD_SIZE")?)
        {
            let c = get("HEARTH_COORDINATOR").ok_or_else(|| {
                DistError::Config(
                    "HEARTH_RANK is set but HEARTH_COORDINATOR (host:port) is not".into(),
                )
            })?;
            (r, w, c, "HEARTH_*", local)
        } else if let (Some(r), Some(w)) = (num("RANK")?, num("WORLD_SIZE")?) {
            let c = master().ok_or_else(|| {
                DistError::Config(
                    "RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not".into(),
                )
            })?;
            (r, w, c, "torchrun", local)
        } else if let (Some(r), Some(w)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
            let host = get("SLURM_JOB_NODELIST")
                    .and_then(|l| first_slurm_host(&l))
                    .or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"))
                    .ok_or_else(|| {
                        DistError::Config(
                            "Slurm rank found but neither SLURM_JOB_NODELIST nor SLURM_LAUNCH_NODE_IPADDR".into(),
                        )
                    })?;
            let port = match get("HEARTH_PORT") {
                Some(p) => p
                    .parse::<u16>()
                    .map_err(|_| DistError::Config(format!("HEARTH_PORT={p:?} is not a port")))?,
                None => DEFAULT_PORT,
            };
            let c = get("HEARTH_COORDINATOR").unwrap_or(format!("{host}:{port}"));
            (r, w, c, "Slurm", num("SLURM_LOCALID")?)
        } else if let (Some(r), Some(w)) =
            (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
        {
            let c = get("HEARTH_COORDINATOR").or_else(master).ok_or_else(|| {
                DistError::Config(
                    "Open MPI rank found; set HEARTH_COORDINATOR=host:port (rank 0's address)"
                        .into(),
                )
            })?;
            (r, w, c, "Open MPI", num("OMPI_COMM_WORLD_LOCAL_RANK")?)
        } else {
            return Err(DistError::Config(
                "no rank in the environment: set HEARTH_RANK, HEARTH_WORLD_SIZE and \
                     HEARTH_COORDINATOR (or run under torchrun, Slurm or mpirun)"
                    .into(),
            ));
        };
        if world == 0 || rank >= world {
            return Err(DistError::Config(format!(
                "rank {rank} is outside a world of {world} ({source})"
            )));
        }
        Ok(Self {
            rank,
            world,
            local_rank,
            coordinator,
            source,
        })
    }

    fn coordinator_addr(&self) -> Result<SocketAddr> {
        self.coordinator
            .to_socket_addrs()
            .map_err(|source| DistError::Io {
                context: format!("resolving the coordinator {}", self.coordinator),
                source,
            })?
            .next()
            .ok_or_else(|| {
                DistError::Config(format!("coordinator {} has no address", self.coordinator))
            })
    }
}

/// Rendezvous settings.
#[derive(Debug, Clone)]
pub struct RendezvousOptions {
    /// How long rank 0 waits for everyone, and others for rank 0 and their peers (default
    /// 120 s, or `HEARTH_RENDEZVOUS_TIMEOUT` seconds).
    pub timeout: Duration,
    /// QUIC settings; `None` picks [`QuicOptions::loopback`] when the coordinator is a loopback
    /// address, else [`QuicOptions::default`].
    pub quic: Option<QuicOptions>,
    /// Address to listen on for peers (non-zero ranks); default: 127.0.0.1 for a loopback
    /// coordinator, else 0.0.0.0 (`HEARTH_BIND` overrides).
    pub bind_ip: Option<IpAddr>,
    /// Shared memory between ranks of one host (on unless `HEARTH_SHM=0`; see [`crate::shm`]).
    pub shm: ShmOptions,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        Self {
            timeout: env_secs("HEARTH_RENDEZVOUS_TIMEOUT").unwrap_or(Duration::from_secs(120)),
            quic: None,
            bind_ip: std::env::var("HEARTH_BIND")
                .ok()
                .and_then(|s| s.parse().ok()),
            shm: ShmOptions::default(),
        }
    }
}

/// A duration in seconds from the environment (`None` when unset or not a number).
pub fn env_secs(key: &str) -> Option<Duration> {
    std::env::var(key)
        .ok()?
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
}

/// A rank announcing itself on one of its connections (`lane` 0 first; more with
/// `QuicOptions::lanes`).
fn hello(rank: usize, port: u16, lane: usize) -> Vec<u8> {
    Writer::default()
        .u64(rank as u64)
        .u64(port as u64)
        .u64(lane as u64)
        .bytes
}

/// (rank, port, lane) of a hello.
fn parse_hello(b: &[u8]) -> Option<(usize, u16, usize)> {
    let mut r = Reader::new(b);
    let rank = r.u64().ok()? as usize;
    let port = u16::try_from(r.u64().ok()?).ok()?;
    let lane = r.u64().ok()? as usize;
    Some((rank, port, lane))
}

fn table(addrs: &BTreeMap<usize, SocketAddr>) -> Vec<u8> {
    let mut w = Writer::default().u64(addrs.len() as u64);
    for (r, a) in addrs {
        w = w.u64(*r as u64).string(&a.to_string());
    }
    w.bytes
}

fn parse_table(b: &[u8], world: usize) -> Result<BTreeMap<usize, SocketAddr>> {
    let mut r = Reader::new(b);
    let n = r.u64()? as usize;
    if n != world {
        return Err(DistError::Config(format!(
            "the coordinator's table has {n} ranks, this rank expects {world}"
        )));
    }
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let rank = r.u64()? as usize;
        let addr: SocketAddr = r.string()?.parse().map_err(|_| {
            DistError::Wire(crate::wire::WireError::Control(
                "bad address in table".into(),
            ))
        })?;
        out.insert(rank, addr);
    }
    r.finish()?;
    Ok(out)
}

pub(crate) async fn recv_control(
    conn: &Connection,
    kind: Kind,
) -> std::result::Result<Vec<u8>, String> {
    let mut s = conn.accept_uni().await.map_err(|e| e.to_string())?;
    // Control messages (hello, table) are small.
    let (h, payload) = read_frame(&mut s, 1 << 20).await?;
    if h.kind != kind {
        return Err(format!("expected a {kind:?} frame, got {:?}", h.kind));
    }
    Ok(payload)
}

/// Forms the job described by `info` and returns this rank's transport.
pub fn connect(
    info: &RankInfo,
    membership: &Membership,
    options: &RendezvousOptions,
) -> Result<QuicTransport> {
    connect_epoch(info, membership, options, 0)
}

/// [`connect`] for membership epoch `epoch` of an elastic job: the transport stamps its frames
/// with the epoch and drops any of another (a late frame of the world before a change).
pub fn connect_epoch(
    info: &RankInfo,
    membership: &Membership,
    options: &RendezvousOptions,
    epoch: u32,
) -> Result<QuicTransport> {
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
    let quic = options.quic.clone().unwrap_or_else(|| {
        if ip.is_loopback() {
            QuicOptions::loopback()
        } else {
            QuicOptions::default()
        }
    });
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
) -> Result<QuicTransport> {
    let coordinator = info.coordinator_addr()?;
    let loopback = coordinator.ip().is_loopback();
    let quic = options.quic.clone().unwrap_or_else(|| {
        if loopback {
            QuicOptions::loopback()
        } else {
            QuicOptions::default()
        }
    });
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
    };
    let peers = if info.rank == 0 {
        coordinate(&node, info, &link)?
    } else {
        join(&node, info, coordinator, &link)?
    };
    let transport = QuicTransport::start_lanes(node, info.rank, epoch, peers, &quic);
    // Ranks of one host move to shared memory (every rank takes part, whatever its host).
    transport.share_memory(
        &options.shm,
        deadline.max(Instant::now() + options.timeout / 2),
    )?;
    Ok(transport)
}

/// The peer of `conn` may be rank `claimed`: its certificate names that rank (see
/// [`crate::tls::check_peer_rank`]).
fn check_rank(conn: &Connection, claimed: usize, world: usize) -> std::result::Result<(), String> {
    let certs = conn.peer_identity().and_then(|id| {
        id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
            .ok()
    });
    crate::tls::check_peer_rank(certs.as_deref().map(Vec::as_slice), claimed, world)
}

/// How the rendezvous makes its connections.
struct Link {
    deadline: Instant,
    timeout: Duration,
    /// Connections per pair of ranks.
    lanes: usize,
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Rank 0: accept every rank's hello, then send each the table.
fn coordinate(node: &QuicNode, info: &RankInfo, link: &Link) -> Result<Vec<Vec<Connection>>> {
    let (deadline, timeout, lanes) = (link.deadline, link.timeout, link.lanes);
    let world = info.world;
    let endpoint = node.endpoint.clone();
    let coordinator = info.coordinator.clone();
    node.rt.block_on(async move {
        let mut conns: BTreeMap<usize, (Connection, SocketAddr)> = BTreeMap::new();
        // Each rank's further connections (lanes 1..).
        let mut extra: BTreeMap<usize, Vec<Connection>> = BTreeMap::new();
        let complete = |conns: &BTreeMap<usize, (Connection, SocketAddr)>,
                        extra: &BTreeMap<usize, Vec<Connection>>,
                        r: usize| {
            conns.contains_key(&r) && extra.get(&r).map_or(0, Vec::len) + 1 >= lanes
        };
        let mut acceptor = accept::Acceptor::start(endpoint.clone(), world);
        while !(1..world).all(|r| complete(&conns, &extra, r)) {
            let Some(accept::Hello { rank, port, lane, conn }) = acceptor.next(deadline).await else {
                let missing: Vec<usize> =
                    (1..world).filter(|&r| !complete(&conns, &extra, r)).collect();
                return Err(DistError::MissingRanks {
                    missing,
                    world,
                    coordinator,
                    after: timeout,
                });
            };
            if rank == 0 || rank >= world {
                return Err(DistError::Config(format!(
                    "a process claims rank {rank}, outside 1..{world}: do all ranks agree on the world size?"
                )));
            }
            if lane > 0 {
                let e = extra.entry(rank).or_default();
                if lane < lanes && e.len() + 1 < lanes {
                    e.push(conn);
                } else {
                    log::warn!("rank {rank} opened more connections than {lanes}");
                }
                continue;
            }
            if conns.contains_key(&rank) {
                return Err(DistError::Config(format!("two processes claim rank {rank}")));
            }
            let addr = SocketAddr::new(conn.remote_address().ip(), port);
            conns.insert(rank, (conn, addr));
        }
        drop(acceptor);
        let mut addrs: BTreeMap<usize, SocketAddr> = conns.iter().map(|(r, (_, a))| (*r, *a)).collect();
        addrs.insert(0, endpoint.local_addr().map_err(|source| DistError::Io { context: "local address".into(), source })?);
        let t = table(&addrs);
        for (rank, (conn, _)) in &conns {
            write_frame(conn, Header::new(Kind::Table, 0, 0, t.len()), t.clone())
                .await
                .map_err(|reason| DistError::PeerFailed { rank: *rank, reason })?;
        }
        let mut peers: Vec<Vec<Connection>> = vec![Vec::new(); world];
        for (r, (c, _)) in conns {
            peers[r].push(c);
            peers[r].extend(extra.remove(&r).unwrap_or_default());
        }
        Ok(peers)
    })
}

/// Rank r > 0: hello to the coordinator, get the table, connect to ranks 1..r, accept r+1..
fn join(
    node: &QuicNode,
    info: &RankInfo,
    coordinator: SocketAddr,
    link: &Link,
) -> Result<Vec<Vec<Connection>>> {
    let (deadline, timeout, lanes) = (link.deadline, link.timeout, link.lanes);
    let (rank, world) = (info.rank, info.world);
    let endpoint = node.endpoint.clone();
    let port = node.local_addr()?.port();
    node.rt.block_on(async move {
        // The coordinator may start later than us: retry until the deadline.
        let conn = loop {
            let attempt = async {
                let connecting = endpoint.connect(coordinator, SERVER_NAME).map_err(|e| e.to_string())?;
                connecting.await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(Duration::from_secs(3).min(remaining(deadline)), attempt).await {
                Ok(Ok(c)) => break c,
                Ok(Err(e)) if e.contains("certificate") || e.contains("handshake") || e.contains("crypto") => {
                    return Err(DistError::Tls(format!(
                        "the coordinator {coordinator} refused this rank's credentials: {e} (same job secret or CA on every rank?)"
                    )));
                }
                _ if Instant::now() >= deadline => {
                    return Err(DistError::Timeout {
                        op: format!("rendezvous with the coordinator {coordinator}"),
                        rank: 0,
                        after: timeout,
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        check_rank(&conn, 0, world).map_err(|e| DistError::Tls(format!("the coordinator {coordinator}: {e}")))?;
        let h = hello(rank, port, 0);
        write_frame(&conn, Header::new(Kind::Hello, 0, 0, h.len()), h)
            .await
            .map_err(|reason| DistError::PeerFailed { rank: 0, reason })?;
        // A connection to `peer` at `addr` announcing this rank's `lane`.
        let dial = |peer: usize, addr: SocketAddr, lane: usize| {
            let endpoint = endpoint.clone();
            async move {
                let c = tokio::time::timeout(remaining(deadline), async {
                    endpoint.connect(addr, SERVER_NAME).map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())
                })
                .await
                .map_err(|_| DistError::Timeout { op: format!("connecting to rank {peer} at {addr}"), rank: peer, after: timeout })?
                .map_err(|reason| DistError::PeerFailed { rank: peer, reason })?;
                check_rank(&c, peer, world).map_err(|e| DistError::Tls(format!("rank {peer} at {addr}: {e}")))?;
                let h = hello(rank, port, lane);
                write_frame(&c, Header::new(Kind::Hello, 0, 0, h.len()), h)
                    .await
                    .map_err(|reason| DistError::PeerFailed { rank: peer, reason })?;
                Ok::<_, DistError>(c)
            }
        };
        let mut to_coordinator = vec![conn];
        for lane in 1..lanes {
            to_coordinator.push(dial(0, coordinator, lane).await?);
        }
        let conn = to_coordinator[0].clone();
        let t = match tokio::time::timeout(remaining(deadline), recv_control(&conn, Kind::Table)).await {
            Ok(Ok(t)) => t,
            Ok(Err(reason)) => return Err(DistError::PeerFailed { rank: 0, reason }),
            Err(_) => {
                return Err(DistError::Timeout {
                    op: "waiting for the other ranks to arrive".into(),
                    rank: 0,
                    after: timeout,
                });
            }
        };
        let addrs = parse_table(&t, world)?;
        let mut peers: Vec<Vec<Connection>> = vec![Vec::new(); world];
        peers[0] = to_coordinator;
        // Dial the ranks below; accept the ranks above.
        #[allow(clippy::needless_range_loop)] // `peer` is a rank, named in the errors
        for peer in 1..rank {
            let Some(addr) = addrs.get(&peer).copied() else {
                return Err(DistError::Config(format!("rank {peer} missing from the table")));
            };
            for lane in 0..lanes {
                let c = dial(peer, addr, lane).await?;
                peers[peer].push(c);
            }
        }
        let mut acceptor = accept::Acceptor::start(endpoint.clone(), world);
        while (rank + 1..world).any(|r| peers[r].len() < lanes) {
            let missing: Vec<usize> = (rank + 1..world).filter(|&r| peers[r].len() < lanes).collect();
            let Some(accept::Hello { rank: peer, conn: c, .. }) = acceptor.next(deadline).await else {
                return Err(DistError::MissingRanks {
                    missing,
                    world,
                    coordinator: coordinator.to_string(),
                    after: timeout,
                });
            };
            if peer <= rank || peer >= world || peers[peer].len() >= lanes {
                log::warn!("unexpected hello from rank {peer}");
                continue;
            }
            peers[peer].push(c);
        }
        drop(acceptor);
        Ok(peers)
    })
}

mod accept;
#[cfg(test)]
mod tests;
