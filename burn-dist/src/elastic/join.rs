//! The join service: how a process that is not yet a member reaches the coordinator of an
//! elastic job.
//!
//! Every member listens on its own join address ([`JoinService`], for its whole life). A
//! joiner ([`request_join`]) dials the addresses it knows (the host list) in order and sends a
//! hello naming itself (a worker id unique in the job and its host). The member answers by its
//! [`Role`]: rank 0 holds the hello until the next step boundary, where it admits the joiner
//! with the next epoch's [`Announcement`] and the joiner's rank in it, or refuses it (a
//! blacklisted host, a duplicate id); any other member redirects the joiner to rank 0's join
//! address; a member in the middle of a change says "retry". A dead address, a refused TLS
//! handshake or a lost connection makes the joiner try the next address, until its deadline.
//! Only processes with the job's credentials get through the TLS handshake.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn::{Connection, Endpoint};
use tokio::sync::oneshot;

use super::membership::Worker;
use super::reform::Announcement;
use crate::tls::{Identity, Membership, SERVER_NAME};
use crate::transport::quic::recv_control;
use crate::transport::quic::{QuicNode, QuicOptions, QuicProfiles, write_frame};
use crate::wire::{Header, Kind, Reader, Writer};
use crate::{DistError, Result};

/// What a member answers joiners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Rank 0: hold hellos for the next step boundary.
    Coordinator,
    /// Another member: send joiners to rank 0's join address.
    Redirect(String),
    /// A change is under way: joiners try again shortly.
    Busy,
}

/// A member's answer to a joiner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Redirect(String),
    /// Admitted as `rank` of the announced epoch.
    Admit {
        rank: usize,
        announcement: Announcement,
    },
    Refused(String),
    Retry,
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Reply::Redirect(a) => Writer::default().u64(0).string(a).bytes,
            Reply::Admit { rank, announcement } => {
                let mut w = Writer::default().u64(1).u64(*rank as u64);
                w.bytes.extend(announcement.encode());
                w.bytes
            }
            Reply::Refused(r) => Writer::default().u64(2).string(r).bytes,
            Reply::Retry => Writer::default().u64(3).bytes,
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b);
        let reply = match r.u64()? {
            0 => Reply::Redirect(r.string()?),
            1 => {
                let rank = r.u64()? as usize;
                let announcement = Announcement::decode(&b[16..])?;
                if rank >= announcement.members.len() {
                    return Err(DistError::Mismatch {
                        op: "join reply".into(),
                        reason: format!(
                            "rank {rank} in an epoch of {} members",
                            announcement.members.len()
                        ),
                    });
                }
                return Ok(Reply::Admit { rank, announcement });
            }
            2 => Reply::Refused(r.string()?),
            3 => Reply::Retry,
            other => {
                return Err(DistError::Mismatch {
                    op: "join reply".into(),
                    reason: format!("unknown reply {other}"),
                });
            }
        };
        r.finish()?;
        Ok(reply)
    }
}

fn hello(w: &Worker) -> Vec<u8> {
    Writer::default().string(&w.id).string(&w.host).bytes
}

fn parse_hello(b: &[u8]) -> Result<Worker> {
    let mut r = Reader::new(b);
    let id = r.string()?;
    let host = r.string()?;
    r.finish()?;
    if id.is_empty() || id.len() > 256 || host.len() > 256 {
        return Err(DistError::Mismatch {
            op: "join hello".into(),
            reason: "a worker id must have 1 to 256 bytes".into(),
        });
    }
    Ok(Worker { id, host })
}

struct Shared {
    role: Role,
    waiting: Vec<(Worker, oneshot::Sender<Reply>)>,
}

/// A member's listener for joiners (see the module docs).
pub struct JoinService {
    node: QuicNode,
    shared: Arc<Mutex<Shared>>,
}

impl JoinService {
    /// Listens on `addr` (port 0: any free port) until dropped, answering as `role`, with
    /// `quic`'s settings for that address.
    pub fn bind(
        addr: SocketAddr,
        membership: &Membership,
        role: Role,
        quic: &QuicProfiles,
    ) -> Result<Self> {
        let node = QuicNode::bind(addr, &Identity::new(membership, 0)?, quic.for_ip(addr.ip()))?;
        let shared = Arc::new(Mutex::new(Shared {
            role,
            waiting: Vec::new(),
        }));
        let endpoint = node.endpoint.clone();
        node.rt.spawn(serve(endpoint, shared.clone()));
        Ok(Self { node, shared })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.node.local_addr()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers as `role` from now on; joiners held by a coordinator that is no longer one are
    /// told to retry (they find the new coordinator).
    pub fn set_role(&self, role: Role) {
        let mut s = self.lock();
        if role != Role::Coordinator {
            for (_, tx) in s.waiting.drain(..) {
                let _ = tx.send(Reply::Retry);
            }
        }
        s.role = role;
    }

    /// The joiners waiting for the next step boundary (coordinator only), in arrival order;
    /// joiners whose connection ended are dropped.
    pub fn waiting(&self) -> Vec<Worker> {
        let mut s = self.lock();
        s.waiting.retain(|(_, tx)| !tx.is_closed());
        s.waiting.iter().map(|(w, _)| w.clone()).collect()
    }

    /// Answers the waiting joiner `id` (false if it is no longer waiting).
    pub fn answer(&self, id: &str, reply: Reply) -> bool {
        let mut s = self.lock();
        match s.waiting.iter().position(|(w, _)| w.id == id) {
            Some(i) => s.waiting.remove(i).1.send(reply).is_ok(),
            None => false,
        }
    }
}

impl Drop for JoinService {
    fn drop(&mut self) {
        self.set_role(Role::Busy);
        self.node.endpoint.close(0u32.into(), b"member gone");
    }
}

async fn serve(endpoint: Endpoint, shared: Arc<Mutex<Shared>>) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            // Another job's credentials, a scanner: the handshake fails and that is all.
            let Ok(Ok(conn)) = tokio::time::timeout(Duration::from_secs(10), incoming).await else {
                return;
            };
            let Ok(Ok(bytes)) =
                tokio::time::timeout(Duration::from_secs(10), recv_control(&conn, Kind::Hello))
                    .await
            else {
                return;
            };
            let reply = match parse_hello(&bytes) {
                Err(e) => Reply::Refused(format!("malformed hello: {e}")),
                Ok(worker) => {
                    let rx = {
                        let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
                        match s.role.clone() {
                            Role::Redirect(a) => Err(Reply::Redirect(a)),
                            Role::Busy => Err(Reply::Retry),
                            Role::Coordinator => {
                                let (tx, rx) = oneshot::channel();
                                s.waiting.retain(|(w, _)| w.id != worker.id);
                                s.waiting.push((worker, tx));
                                Ok(rx)
                            }
                        }
                    };
                    match rx {
                        Err(r) => r,
                        // Held until the next step boundary, or until the joiner goes away.
                        Ok(rx) => tokio::select! {
                            r = rx => r.unwrap_or(Reply::Retry),
                            _ = conn.closed() => return,
                        },
                    }
                }
            };
            let b = reply.encode();
            let _ = write_frame(&conn, Header::new(Kind::Control, 0, 0, b.len()), b).await;
            conn.close(0u32.into(), b"answered");
        });
    }
}

/// Asks to join the job through the members at `peers` (`host:port` join addresses, tried in
/// order, redirects followed), waiting up to `timeout` in all, with `quic`'s settings. Returns
/// the admission: this process's rank and the epoch to form. A refusal is an error naming its reason.
pub fn request_join(
    peers: &dyn Fn() -> Vec<String>,
    worker: &Worker,
    membership: &Membership,
    timeout: Duration,
    quic: &QuicOptions,
) -> Result<(usize, Announcement)> {
    let deadline = Instant::now() + timeout;
    let identity = Identity::new(membership, 0)?;
    let node = QuicNode::bind(SocketAddr::from(([0, 0, 0, 0], 0)), &identity, quic)?;
    let mut last = String::from("no member answered");
    while Instant::now() < deadline {
        let mut targets: Vec<String> = peers();
        let mut hops = 0;
        while let Some(target) = (!targets.is_empty()).then(|| targets.remove(0)) {
            match ask(&node, &target, worker, deadline) {
                Ok(Reply::Admit { rank, announcement }) => return Ok((rank, announcement)),
                Ok(Reply::Refused(reason)) => {
                    return Err(DistError::Config(format!(
                        "the job refused worker {}: {reason}",
                        worker.id
                    )));
                }
                Ok(Reply::Redirect(a)) if hops < 4 => {
                    hops += 1;
                    targets.insert(0, a);
                }
                Ok(other) => last = format!("{target}: {other:?}"),
                Err(e) => last = format!("{target}: {e}"),
            }
        }
        std::thread::sleep(
            Duration::from_millis(300).min(deadline.saturating_duration_since(Instant::now())),
        );
    }
    Err(DistError::Timeout {
        op: format!("joining the job as {} (last: {last})", worker.id),
        rank: 0,
        after: timeout,
    })
}

fn ask(node: &QuicNode, target: &str, worker: &Worker, deadline: Instant) -> Result<Reply> {
    let addr: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(target)
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| DistError::Config(format!("join address {target} does not resolve")))?;
    let endpoint = node.endpoint.clone();
    let h = hello(worker);
    node.rt.block_on(async move {
        let left = || deadline.saturating_duration_since(Instant::now());
        let conn: Connection = tokio::time::timeout(Duration::from_secs(3).min(left()), async {
            endpoint
                .connect(addr, SERVER_NAME)
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|_| DistError::Quic {
            context: format!("join service {addr}"),
            reason: "no answer".into(),
        })?
        .map_err(|reason| DistError::Quic {
            context: format!("join service {addr}"),
            reason,
        })?;
        write_frame(&conn, Header::new(Kind::Hello, 0, 0, h.len()), h)
            .await
            .map_err(|reason| DistError::Quic {
                context: format!("hello to {addr}"),
                reason,
            })?;
        let b = tokio::time::timeout(left(), recv_control(&conn, Kind::Control))
            .await
            .map_err(|_| DistError::Timeout {
                op: format!("waiting for {addr} to admit this worker"),
                rank: 0,
                after: Duration::ZERO,
            })?
            .map_err(|reason| DistError::Quic {
                context: format!("join reply from {addr}"),
                reason,
            })?;
        conn.close(0u32.into(), b"done");
        Reply::decode(&b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> Membership {
        Membership::secret("b9a95fa04c2958aa27c34d38a2908386", "test-job").unwrap()
    }

    fn worker(id: &str) -> Worker {
        Worker {
            id: id.into(),
            host: "127.0.0.1".into(),
        }
    }

    /// Waits (at most 20 s) until a joiner's hello is held by `coordinator`.
    fn hello_arrives(coordinator: &JoinService) {
        let t = Instant::now();
        while coordinator.waiting().is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the hello never arrived"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn replies_round_trip_and_garbage_is_an_error() {
        let a = Announcement {
            epoch: 2,
            coordinator: "127.0.0.1:9".into(),
            members: vec![Some(0), None],
        };
        for r in [
            Reply::Redirect("127.0.0.1:7".into()),
            Reply::Admit {
                rank: 1,
                announcement: a.clone(),
            },
            Reply::Refused("blacklisted".into()),
            Reply::Retry,
        ] {
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        }
        let bad = Reply::Admit {
            rank: 5,
            announcement: a,
        };
        assert!(Reply::decode(&bad.encode()).is_err());
        assert!(Reply::decode(&[9; 8]).is_err());
        assert!(Reply::decode(&[]).is_err());
        assert!(parse_hello(&[1, 2, 3]).is_err());
    }

    #[test]
    fn a_joiner_follows_a_redirect_past_a_dead_address_and_is_admitted() {
        let m = secret();
        let coordinator = JoinService::bind(
            "127.0.0.1:0".parse().unwrap(),
            &m,
            Role::Coordinator,
            &QuicProfiles::default(),
        )
        .unwrap();
        let c_addr = coordinator.local_addr().unwrap().to_string();
        let other = JoinService::bind(
            "127.0.0.1:0".parse().unwrap(),
            &m,
            Role::Redirect(c_addr),
            &QuicProfiles::default(),
        )
        .unwrap();
        // An address where nobody listens comes first.
        let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let peers = vec![dead_addr, other.local_addr().unwrap().to_string()];
        let joiner = std::thread::spawn(move || {
            request_join(
                &|| peers.clone(),
                &worker("w9"),
                &secret(),
                Duration::from_secs(30),
                &QuicOptions::default(),
            )
        });
        hello_arrives(&coordinator);
        assert_eq!(coordinator.waiting(), vec![worker("w9")]);
        let announcement = Announcement {
            epoch: 4,
            coordinator: "127.0.0.1:1234".into(),
            members: vec![Some(0), Some(1), None],
        };
        assert!(coordinator.answer(
            "w9",
            Reply::Admit {
                rank: 2,
                announcement: announcement.clone()
            }
        ));
        let (rank, got) = joiner.join().unwrap().unwrap();
        assert_eq!((rank, got), (2, announcement));
    }

    #[test]
    fn refusals_and_other_secrets_fail_the_joiner_within_its_deadline() {
        let m = secret();
        let coordinator = JoinService::bind(
            "127.0.0.1:0".parse().unwrap(),
            &m,
            Role::Coordinator,
            &QuicProfiles::default(),
        )
        .unwrap();
        let addr = coordinator.local_addr().unwrap().to_string();
        let peers = vec![addr.clone()];
        let joiner = std::thread::spawn(move || {
            request_join(
                &|| peers.clone(),
                &worker("w1"),
                &secret(),
                Duration::from_secs(30),
                &QuicOptions::default(),
            )
        });
        hello_arrives(&coordinator);
        coordinator.answer("w1", Reply::Refused("host 127.0.0.1 is blacklisted".into()));
        let e = joiner.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("blacklisted"), "{e}");

        let wrong = Membership::secret("f0fb17856b40a8d3cb642c7b81144402", "test-job").unwrap();
        let t = Instant::now();
        let e = request_join(
            &|| vec![addr.clone()],
            &worker("w2"),
            &wrong,
            Duration::from_secs(4),
            &QuicOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(t.elapsed() < Duration::from_secs(15));
        assert!(e.contains("joining the job"), "{e}");
        assert!(coordinator.waiting().is_empty(), "no hello got through");
    }
}
