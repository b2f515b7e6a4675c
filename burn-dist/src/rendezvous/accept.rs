//! Accepting connections during a rendezvous: every incoming connection's TLS handshake and
//! hello run as a task of their own, each bounded by [`HANDSHAKE`], so a peer that starts a
//! handshake and stalls (a scanner, a flood of half-open connections, a member that hangs)
//! holds up only its own task; the rendezvous takes the members' hellos in the order they
//! complete.

use std::time::{Duration, Instant};

use quinn::{Connection, Endpoint, Incoming, VarInt};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use super::link::{check_rank, remaining};
use super::messages::parse_hello;
use crate::transport::quic::recv_control;
use crate::wire::Kind;

/// How long one incoming connection may take for its handshake, and then for its hello.
pub(super) const HANDSHAKE: Duration = Duration::from_secs(10);

/// A member's hello on a connection that passed the handshake: the rank it claims (checked
/// against its certificate when the rank lies inside the world), its listening port, and which
/// of its connections this is.
pub(super) struct Hello {
    pub rank: usize,
    pub port: u16,
    pub lane: usize,
    pub conn: Connection,
}

/// Accepts on an endpoint until dropped (which stops the accepting and every handshake still
/// running).
pub(super) struct Acceptor {
    task: JoinHandle<()>,
    hellos: mpsc::Receiver<Hello>,
}

impl Acceptor {
    /// Starts accepting on `endpoint` for a world of `world` ranks; must run inside the
    /// endpoint's runtime.
    pub fn start(endpoint: Endpoint, world: usize) -> Self {
        let (tx, hellos) = mpsc::channel(64);
        let task = tokio::spawn(async move {
            let mut handshakes = JoinSet::new();
            loop {
                tokio::select! {
                    incoming = endpoint.accept() => match incoming {
                        Some(i) => {
                            handshakes.spawn(handshake(i, world));
                        }
                        None => break,
                    },
                    Some(done) = handshakes.join_next() => {
                        if let Ok(Some(hello)) = done
                            && tx.send(hello).await.is_err()
                        {
                            break;
                        }
                    }
                }
            }
        });
        Self { task, hellos }
    }

    /// The next hello, or `None` once `deadline` passes (or the endpoint closed).
    pub async fn next(&mut self, deadline: Instant) -> Option<Hello> {
        tokio::time::timeout(remaining(deadline), self.hellos.recv())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One incoming connection: its handshake, its hello and the certificate check, each within
/// [`HANDSHAKE`]. Anything that fails is logged and dropped.
async fn handshake(incoming: Incoming, world: usize) -> Option<Hello> {
    let from = incoming.remote_address();
    let conn = match tokio::time::timeout(HANDSHAKE, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            // Another job's secret, a scanner.
            log::warn!("refused a connection from {from} during rendezvous: {e}");
            return None;
        }
        Err(_) => {
            log::warn!("{from} started a handshake and stalled for {HANDSHAKE:?}: dropped");
            return None;
        }
    };
    let hello = match tokio::time::timeout(HANDSHAKE, recv_control(&conn, Kind::Hello)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            log::warn!("{from}: its hello failed: {e}");
            return None;
        }
        Err(_) => {
            log::warn!("{from}: no hello within {HANDSHAKE:?}: dropped");
            conn.close(VarInt::from_u32(4), b"no hello");
            return None;
        }
    };
    let Some((rank, port, lane)) = parse_hello(&hello) else {
        log::warn!("{from}: malformed hello");
        conn.close(VarInt::from_u32(4), b"malformed hello");
        return None;
    };
    // One rank may not pose as another: the claim must match the certificate. A claim outside
    // the world goes to the caller, which fails the rendezvous naming it.
    if rank < world
        && let Err(e) = check_rank(&conn, rank, world)
    {
        log::warn!("refused {from} during rendezvous: {e}");
        conn.close(VarInt::from_u32(3), b"rank does not match certificate");
        return None;
    }
    Some(Hello {
        rank,
        port,
        lane,
        conn,
    })
}
