//! Rank 0's side: accept every rank's hello (concurrently, see [`super::accept`]), with a secret
//! issue each its rank certificate, then send each the table of addresses.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quinn::{Connection, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::task::JoinSet;

use super::accept;
use super::link::{Link, peer_certs, remaining, watched};
use super::messages::{issue, table};
use super::rank_info::RankInfo;
use crate::tls::RankAuthority;
use crate::transport::quic::{QuicNode, recv_control, write_frame};
use crate::wire::{Header, Kind};
use crate::{DistError, Result};

/// Rank 0: accept every rank's hello, then send each the table.
pub(super) fn coordinate(
    node: &QuicNode,
    info: &RankInfo,
    link: &Link,
) -> Result<Vec<Vec<Connection>>> {
    let (deadline, timeout, lanes) = (link.deadline, link.timeout, link.lanes);
    let world = info.world;
    let endpoint = node.endpoint.clone();
    let coordinator = info.coordinator.clone();
    node.rt.block_on(watched(link.abort.clone(), async move {
        let mut conns: BTreeMap<usize, (Connection, SocketAddr)> = BTreeMap::new();
        // Each rank's further connections (lanes 1..).
        let mut extra: BTreeMap<usize, Vec<Connection>> = BTreeMap::new();
        let complete = |conns: &BTreeMap<usize, (Connection, SocketAddr)>,
                        extra: &BTreeMap<usize, Vec<Connection>>,
                        r: usize| {
            conns.contains_key(&r) && extra.get(&r).map_or(0, Vec::len) + 1 >= lanes
        };
        let mut acceptor = accept::Acceptor::start(endpoint.clone(), world);
        let mut refused: Vec<String> = Vec::new();
        while !(1..world).all(|r| complete(&conns, &extra, r)) {
            let Some(accept::Hello { rank, port, lane, conn }) = acceptor.next(deadline).await else {
                let missing: Vec<usize> =
                    (1..world).filter(|&r| !complete(&conns, &extra, r)).collect();
                return Err(DistError::MissingRanks {
                    missing,
                    world,
                    coordinator,
                    after: timeout,
                    refused: std::mem::take(&mut refused),
                });
            };
            // A claim no member can make is refused and logged, never fatal: anyone holding the
            // secret could otherwise end any rendezvous with one hello. Should the real ranks
            // never come, the timeout's error lists what was refused.
            let from = conn.remote_address();
            if rank == 0 || rank >= world {
                let why = format!(
                    "{from} claimed rank {rank}, outside 1..{world} (do all ranks agree on the world size?)"
                );
                log::warn!("refused during rendezvous: {why}");
                conn.close(VarInt::from_u32(5), b"rank outside the world");
                refused.push(why);
                continue;
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
                let why = format!("{from} claimed rank {rank}, which another process holds");
                log::warn!("refused during rendezvous: {why}");
                conn.close(VarInt::from_u32(6), b"rank taken");
                refused.push(why);
                continue;
            }
            let addr = SocketAddr::new(conn.remote_address().ip(), port);
            conns.insert(rank, (conn, addr));
        }
        drop(acceptor);
        if link.issues {
            issue_ranks(&conns, &extra, deadline, timeout).await?;
        }
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
    }))
}

/// The first certificate the peer of `conn` presented.
fn presented(conn: &Connection) -> Option<CertificateDer<'static>> {
    peer_certs(conn).and_then(|chain| chain.first().cloned())
}

/// Issues every member the certificate of the rank it was admitted as (see the
/// [module docs](super)) and waits until each says it now uses it, so that no member dials a
/// peer that would still refuse it.
async fn issue_ranks(
    conns: &BTreeMap<usize, (Connection, SocketAddr)>,
    extra: &BTreeMap<usize, Vec<Connection>>,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    let authority = RankAuthority::new()?;
    let mut acks = JoinSet::new();
    for (&rank, (conn, _)) in conns {
        let cert = presented(conn).ok_or_else(|| {
            DistError::Tls(format!(
                "the process admitted as rank {rank} presented no certificate"
            ))
        })?;
        // A rank's further connections come from the same process: the same certificate.
        if extra
            .get(&rank)
            .into_iter()
            .flatten()
            .any(|c| presented(c).as_ref() != Some(&cert))
        {
            return Err(DistError::Config(format!(
                "two processes claim rank {rank}: a further connection for it came with another \
                 certificate than its first"
            )));
        }
        let issued = authority.issue(rank, &cert)?;
        let m = issue(authority.ca(), &issued);
        write_frame(conn, Header::new(Kind::Issue, 0, 0, m.len()), m)
            .await
            .map_err(|reason| DistError::PeerFailed { rank, reason })?;
        let conn = conn.clone();
        acks.spawn(async move {
            let ack = tokio::time::timeout(remaining(deadline), recv_control(&conn, Kind::Issue));
            (rank, ack.await)
        });
    }
    while let Some(done) = acks.join_next().await {
        let (rank, ack) = done.map_err(|e| DistError::Config(format!("a rendezvous task: {e}")))?;
        match ack {
            Ok(Ok(_)) => {}
            Ok(Err(reason)) => return Err(DistError::PeerFailed { rank, reason }),
            Err(_) => {
                return Err(DistError::Timeout {
                    op: format!("waiting for rank {rank} to take its rank certificate"),
                    rank,
                    after: timeout,
                });
            }
        }
    }
    Ok(())
}
