//! A rank above 0: hello to the coordinator, with a secret its rank certificate back, then the
//! table, then a connection to every rank below it while accepting those above.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quinn::Connection;

use super::accept;
use super::link::{Link, check_rank, remaining, watched};
use super::messages::{hello, parse_issue, parse_table};
use super::rank_info::RankInfo;
use crate::tls::{Identity, SERVER_NAME};
use crate::transport::quic::{QuicNode, recv_control, write_frame};
use crate::wire::{Header, Kind};
use crate::{DistError, Result};

/// Rank r > 0: hello to the coordinator, get the table, connect to ranks 1..r, accept r+1..
pub(super) fn join(
    node: &QuicNode,
    info: &RankInfo,
    coordinator: SocketAddr,
    link: &Link,
    identity: &Identity,
) -> Result<Vec<Vec<Connection>>> {
    let (rank, world, lanes) = (info.rank, info.world, link.lanes);
    let dialer = Dialer {
        endpoint: node.endpoint.clone(),
        deadline: link.deadline,
        timeout: link.timeout,
        rank,
        world,
        port: node.local_addr()?.port(),
    };
    node.rt.block_on(watched(link.abort.clone(), async move {
        let conn = dialer.reach_coordinator(coordinator).await?;
        let h = hello(rank, dialer.port, 0);
        write_frame(&conn, Header::new(Kind::Hello, 0, 0, h.len()), h)
            .await
            .map_err(|reason| DistError::PeerFailed { rank: 0, reason })?;
        let mut to_coordinator = vec![conn];
        for lane in 1..lanes {
            to_coordinator.push(dialer.dial(0, coordinator, lane, None).await?);
        }
        let conn = to_coordinator[0].clone();
        let with_peers = if link.issues {
            Some(
                take_rank_certificate(node, &conn, identity, rank, dialer.deadline, dialer.timeout)
                    .await?,
            )
        } else {
            None
        };
        let addrs = parse_table(&dialer.table(&conn).await?, world)?;
        let mut peers: Vec<Vec<Connection>> = vec![Vec::new(); world];
        peers[0] = to_coordinator;
        // Dial the ranks below; accept the ranks above.
        #[allow(clippy::needless_range_loop)] // `peer` is a rank, named in the errors
        for peer in 1..rank {
            let Some(addr) = addrs.get(&peer).copied() else {
                return Err(DistError::Config(format!(
                    "rank {peer} missing from the table"
                )));
            };
            for lane in 0..lanes {
                let c = dialer.dial(peer, addr, lane, with_peers.clone()).await?;
                peers[peer].push(c);
            }
        }
        dialer.accept_above(&mut peers, lanes, coordinator).await?;
        Ok(peers)
    }))
}

/// What a joining rank dials with: its endpoint, its rank and port to announce, the deadline.
struct Dialer {
    endpoint: quinn::Endpoint,
    deadline: Instant,
    timeout: Duration,
    rank: usize,
    world: usize,
    port: u16,
}

impl Dialer {
    /// The first connection to the coordinator, which may start later than this rank: retried
    /// until the deadline, and refused at once when the coordinator rejects the credentials.
    async fn reach_coordinator(&self, coordinator: SocketAddr) -> Result<Connection> {
        let conn = loop {
            let attempt = async {
                let connecting = self
                    .endpoint
                    .connect(coordinator, SERVER_NAME)
                    .map_err(|e| e.to_string())?;
                connecting.await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(
                Duration::from_secs(3).min(remaining(self.deadline)),
                attempt,
            )
            .await
            {
                Ok(Ok(c)) => break c,
                Ok(Err(e))
                    if e.contains("certificate")
                        || e.contains("handshake")
                        || e.contains("crypto") =>
                {
                    return Err(DistError::Tls(format!(
                        "the coordinator {coordinator} refused this rank's credentials: {e} (same job secret or CA on every rank?)"
                    )));
                }
                _ if Instant::now() >= self.deadline => {
                    return Err(DistError::Timeout {
                        op: format!("rendezvous with the coordinator {coordinator}"),
                        rank: 0,
                        after: self.timeout,
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        check_rank(&conn, 0, self.world)
            .map_err(|e| DistError::Tls(format!("the coordinator {coordinator}: {e}")))?;
        Ok(conn)
    }

    /// A connection to `peer` at `addr` announcing this rank's `lane` (`config`: the issued
    /// certificate, for the members; `None`: the endpoint's own, for rank 0).
    async fn dial(
        &self,
        peer: usize,
        addr: SocketAddr,
        lane: usize,
        config: Option<quinn::ClientConfig>,
    ) -> Result<Connection> {
        let c = tokio::time::timeout(remaining(self.deadline), async {
            let connecting = match config {
                Some(config) => self.endpoint.connect_with(config, addr, SERVER_NAME),
                None => self.endpoint.connect(addr, SERVER_NAME),
            };
            connecting
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|_| DistError::Timeout {
            op: format!("connecting to rank {peer} at {addr}"),
            rank: peer,
            after: self.timeout,
        })?
        .map_err(|reason| DistError::PeerFailed { rank: peer, reason })?;
        check_rank(&c, peer, self.world)
            .map_err(|e| DistError::Tls(format!("rank {peer} at {addr}: {e}")))?;
        let h = hello(self.rank, self.port, lane);
        write_frame(&c, Header::new(Kind::Hello, 0, 0, h.len()), h)
            .await
            .map_err(|reason| DistError::PeerFailed { rank: peer, reason })?;
        Ok(c)
    }

    /// The table of every rank's address, sent by the coordinator once all have arrived.
    async fn table(&self, conn: &Connection) -> Result<Vec<u8>> {
        match tokio::time::timeout(remaining(self.deadline), recv_control(conn, Kind::Table)).await
        {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(reason)) => Err(DistError::PeerFailed { rank: 0, reason }),
            Err(_) => Err(DistError::Timeout {
                op: "waiting for the other ranks to arrive".into(),
                rank: 0,
                after: self.timeout,
            }),
        }
    }

    /// Accepts `lanes` connections from every rank above this one into `peers`.
    async fn accept_above(
        &self,
        peers: &mut [Vec<Connection>],
        lanes: usize,
        coordinator: SocketAddr,
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let mut acceptor = accept::Acceptor::start(self.endpoint.clone(), world);
        while (rank + 1..world).any(|r| peers[r].len() < lanes) {
            let missing: Vec<usize> = (rank + 1..world)
                .filter(|&r| peers[r].len() < lanes)
                .collect();
            let Some(accept::Hello {
                rank: peer,
                conn: c,
                ..
            }) = acceptor.next(self.deadline).await
            else {
                return Err(DistError::MissingRanks {
                    missing,
                    world,
                    coordinator: coordinator.to_string(),
                    after: self.timeout,
                    refused: Vec::new(),
                });
            };
            if peer <= rank || peer >= world || peers[peer].len() >= lanes {
                log::warn!("unexpected hello from rank {peer}");
                continue;
            }
            peers[peer].push(c);
        }
        Ok(())
    }
}

/// Takes the certificate rank 0 issued this rank (see the [module docs](super)): from now on
/// this rank's endpoint accepts only members with issued certificates and presents its own;
/// then tells rank 0. Returns the client configuration to dial the other members with.
async fn take_rank_certificate(
    node: &QuicNode,
    conn: &Connection,
    identity: &Identity,
    rank: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<quinn::ClientConfig> {
    let m = match tokio::time::timeout(remaining(deadline), recv_control(conn, Kind::Issue)).await {
        Ok(Ok(m)) => m,
        Ok(Err(reason)) => return Err(DistError::PeerFailed { rank: 0, reason }),
        Err(_) => {
            return Err(DistError::Timeout {
                op: "waiting for the other ranks to arrive (rank 0 issues certificates once all have)".into(),
                rank: 0,
                after: timeout,
            });
        }
    };
    let (ca, cert) = parse_issue(&m)?;
    let issued = identity.issued(ca, cert, rank)?;
    node.serve_as(&issued)?;
    let client = node.client_as(&issued)?;
    write_frame(conn, Header::new(Kind::Issue, 0, 0, 0), Vec::new())
        .await
        .map_err(|reason| DistError::PeerFailed { rank: 0, reason })?;
    Ok(client)
}
