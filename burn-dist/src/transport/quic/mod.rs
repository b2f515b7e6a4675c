//! QUIC transport on quinn: one connection per pair of ranks, one unidirectional stream per
//! message (streams are cheap in QUIC and run in parallel, so a collective's chunks overlap),
//! TLS 1.3 with mutual job authentication always on (see [`crate::tls`]).
//!
//! Sends are handed to a tokio runtime the transport owns, so `send` returns at once and the
//! collectives' receives overlap their sends. A connection that ends (the peer exited, or was
//! silent past the idle timeout while keep-alives run every second) marks the peer failed: every
//! receive from it fails with [`DistError::PeerFailed`] naming the rank.
//!
//! This transport knows only QUIC: the ranks of one host that reach each other through shared
//! memory are routed there by [`crate::routed::RoutedTransport`], which hands those peers over
//! (`QuicTransport::hand_over`) and shares this transport's inbox.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, VarInt};

mod options;
mod stream;

pub use options::{Congestion, QuicOptions, QuicProfiles};
use stream::receive_frame;
pub(crate) use stream::{recv_control, write_frame};

use super::Inbox;
use crate::tls::{self, Identity};
use crate::wire::{Header, Kind};
use crate::{DistError, Result};

fn quic_err(context: &str) -> impl Fn(String) -> DistError + '_ {
    move |reason| DistError::Quic {
        context: context.to_string(),
        reason,
    }
}

fn server_as(
    identity: &Identity,
    transport: &Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig> {
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(tls::server_config(identity)?)
            .map_err(|e| quic_err("server TLS")(e.to_string()))?,
    ));
    server.transport_config(transport.clone());
    Ok(server)
}

fn client_as(
    identity: &Identity,
    transport: &Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig> {
    let mut client = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tls::client_config(identity)?)
            .map_err(|e| quic_err("client TLS")(e.to_string()))?,
    ));
    client.transport_config(transport.clone());
    Ok(client)
}

/// A QUIC endpoint with the job's TLS identity, before connections exist.
pub struct QuicNode {
    pub(crate) rt: Arc<tokio::runtime::Runtime>,
    pub(crate) endpoint: Endpoint,
    /// The connection settings every server and client configuration of this node gets.
    transport: Arc<quinn::TransportConfig>,
}

impl QuicNode {
    /// Binds `bind` (port 0: any free port) with `identity` as server and client.
    pub fn bind(bind: SocketAddr, identity: &Identity, options: &QuicOptions) -> Result<Self> {
        let threads = options.threads.max(1);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("burn-dist-quic")
            .enable_all()
            .build()
            .map_err(|source| DistError::Io {
                context: "starting the QUIC runtime".into(),
                source,
            })?;
        let transport = Arc::new(options.transport_config()?);
        let server = server_as(identity, &transport)?;
        let client = client_as(identity, &transport)?;
        let mut endpoint_cfg = quinn::EndpointConfig::default();
        if let Some(mtu) = options.fixed_mtu {
            endpoint_cfg
                .max_udp_payload_size(mtu.saturating_add(28).max(1500))
                .map_err(|e| quic_err("UDP payload size")(e.to_string()))?;
        }
        let socket = UdpSocket::bind(bind).map_err(|source| DistError::Io {
            context: format!("binding UDP {bind}"),
            source,
        })?;
        // Large socket buffers: bursts of big datagrams overflow the default ones, and every
        // drop costs a congestion back-off. The kernel caps them at net.core.{r,w}mem_max.
        let sock = socket2::SockRef::from(&socket);
        let _ = sock.set_recv_buffer_size(options.socket_buffer);
        let _ = sock.set_send_buffer_size(options.socket_buffer);
        if options.debug {
            eprintln!(
                "burn-dist: UDP buffers recv {:?} send {:?}",
                sock.recv_buffer_size(),
                sock.send_buffer_size()
            );
        }
        let mut endpoint = {
            let _guard = rt.enter();
            Endpoint::new(
                endpoint_cfg,
                Some(server),
                socket,
                Arc::new(quinn::TokioRuntime),
            )
            .map_err(|source| DistError::Io {
                context: format!("QUIC endpoint on {bind}"),
                source,
            })?
        };
        endpoint.set_default_client_config(client);
        Ok(Self {
            rt: Arc::new(rt),
            endpoint,
            transport,
        })
    }

    /// From now on, accepts only clients of `identity`'s CA and presents its certificate
    /// (a member once rank 0 has issued its rank certificate).
    pub(crate) fn serve_as(&self, identity: &Identity) -> Result<()> {
        self.endpoint
            .set_server_config(Some(server_as(identity, &self.transport)?));
        Ok(())
    }

    /// A client configuration presenting `identity` and trusting only its CA, for
    /// [`Endpoint::connect_with`].
    pub(crate) fn client_as(&self, identity: &Identity) -> Result<quinn::ClientConfig> {
        client_as(identity, &self.transport)
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.endpoint.local_addr().map_err(|source| DistError::Io {
            context: "local address of the QUIC endpoint".into(),
            source,
        })
    }
}

/// One rank's QUIC links to every other rank.
pub struct QuicTransport {
    rank: usize,
    epoch: u32,
    node: QuicNode,
    /// Every connection to each rank (its lanes; none for this rank).
    peers: Vec<Vec<Connection>>,
    inbox: Arc<Inbox>,
    in_flight: Arc<AtomicUsize>,
    /// Peers handed over to another transport ([`QuicTransport::hand_over`]): that transport,
    /// not their QUIC connection, says when they have left (it may still hold their last
    /// messages when the connection closes).
    elsewhere: Arc<Vec<AtomicBool>>,
    /// Per-peer statistics on stderr at shutdown ([`QuicOptions::debug`]).
    debug: bool,
}

impl QuicTransport {
    /// Wraps established connections (`peers[r]` for every `r` but this rank) and starts reading.
    #[cfg(test)]
    pub(crate) fn start(
        node: QuicNode,
        rank: usize,
        epoch: u32,
        peers: Vec<Option<Connection>>,
        options: &QuicOptions,
    ) -> Self {
        let peers = peers.into_iter().map(|c| c.into_iter().collect()).collect();
        Self::start_lanes(node, rank, epoch, peers, options)
    }

    /// [`QuicTransport::start`] with any number of connections to each rank.
    pub(crate) fn start_lanes(
        node: QuicNode,
        rank: usize,
        epoch: u32,
        peers: Vec<Vec<Connection>>,
        options: &QuicOptions,
    ) -> Self {
        let inbox = Arc::new(Inbox::with_budget(options.inbox_bytes));
        let options = Arc::new(options.clone());
        let elsewhere: Arc<Vec<AtomicBool>> =
            Arc::new(peers.iter().map(|_| AtomicBool::new(false)).collect());
        // A peer has left when all its lanes closed cleanly.
        let open: Arc<Vec<AtomicUsize>> =
            Arc::new(peers.iter().map(|l| AtomicUsize::new(l.len())).collect());
        let lanes = peers
            .iter()
            .enumerate()
            .flat_map(|(from, l)| l.iter().map(move |c| (from, c.clone())));
        for (from, conn) in lanes {
            let inbox = inbox.clone();
            let options = options.clone();
            let elsewhere = elsewhere.clone();
            let open = open.clone();
            node.rt.spawn(async move {
                // The frames being read: a peer's last messages are delivered before its clean
                // close counts (quinn hands out streams received before a close first, but
                // their reading runs beside this loop).
                let mut frames = tokio::task::JoinSet::new();
                loop {
                    while frames.try_join_next().is_some() {}
                    match conn.accept_uni().await {
                        Ok(mut stream) => {
                            let inbox = inbox.clone();
                            let conn = conn.clone();
                            let options = options.clone();
                            frames.spawn(async move {
                                match receive_frame(&mut stream, &inbox, &options).await {
                                    Ok((h, payload)) if h.epoch == epoch => inbox
                                        .deliver_reserved_payload(from, h.kind, h.seq, payload),
                                    Ok((h, payload)) => {
                                        inbox.release(payload.len());
                                        log::warn!(
                                            "rank {from} sent a frame of membership epoch {} (now {epoch}); dropped",
                                            h.epoch
                                        )
                                    }
                                    Err(e) => {
                                        // An authenticated peer that breaks the protocol is cut off.
                                        inbox.fail(from, e.clone());
                                        conn.close(VarInt::from_u32(2), e.as_bytes());
                                    }
                                }
                            });
                        }
                        // A clean close (code 0) is a rank that finished; anything else a failure.
                        Err(quinn::ConnectionError::ApplicationClosed(c))
                            if c.error_code == VarInt::from_u32(0) =>
                        {
                            while frames.join_next().await.is_some() {}
                            let last = open[from].fetch_sub(1, Ordering::AcqRel) == 1;
                            if last && !elsewhere[from].load(Ordering::Acquire) {
                                inbox.left(from, "it closed its connection (finished)".into());
                            }
                            return;
                        }
                        Err(e) => {
                            inbox.fail(from, format!("connection lost: {e}"));
                            return;
                        }
                    }
                }
            });
        }
        // Nobody else may connect once the job is formed: refuse late or foreign connections.
        let endpoint = node.endpoint.clone();
        node.rt.spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                incoming.refuse();
            }
        });
        Self {
            rank,
            epoch,
            node,
            peers,
            inbox,
            in_flight: Arc::new(AtomicUsize::new(0)),
            elsewhere,
            debug: options.debug,
        }
    }

    /// The inbox every message for this rank lands in: another transport serving some of the
    /// peers ([`QuicTransport::hand_over`]) delivers into it too, so one receive waits on both.
    pub(crate) fn shared_inbox(&self) -> Arc<Inbox> {
        self.inbox.clone()
    }

    /// `peers` are now reached another way: their connection closing no longer says they left
    /// (the other transport says so), and [`Transport::send`] to them is the caller's to route.
    pub(crate) fn hand_over(&self, peers: &[usize]) {
        for &r in peers {
            if let Some(flag) = self.elsewhere.get(r) {
                flag.store(true, Ordering::Release);
            }
        }
    }

    /// Waits (up to `timeout`) for queued sends to reach the peers, then closes every connection.
    pub fn shutdown(&self, timeout: Duration) {
        let until = Instant::now() + timeout;
        while self.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
        for c in self.peers.iter().flatten() {
            if self.debug {
                let st = c.stats();
                eprintln!(
                    "burn-dist rank {}: to {}: sent {} datagrams in {} sends, received {} in {}, lost {} packets, cwnd {}, rtt {:?}, mtu {}",
                    self.rank,
                    c.remote_address(),
                    st.udp_tx.datagrams,
                    st.udp_tx.ios,
                    st.udp_rx.datagrams,
                    st.udp_rx.ios,
                    st.path.lost_packets,
                    st.path.cwnd,
                    st.path.rtt,
                    st.path.current_mtu
                );
                eprintln!(
                    "burn-dist rank {}: to {}: congestion events {}, acks sent {} received {}, \
                     blocked by flow control (data/stream/streams) {}/{}/{}, min rtt {:?}",
                    self.rank,
                    c.remote_address(),
                    st.path.congestion_events,
                    st.frame_tx.acks,
                    st.frame_rx.acks,
                    st.frame_tx.data_blocked,
                    st.frame_tx.stream_data_blocked,
                    st.frame_tx.streams_blocked_uni,
                    st.path.min_rtt
                );
            }
            c.close(VarInt::from_u32(0), b"done");
        }
        let endpoint = self.node.endpoint.clone();
        let _ = self.node.rt.block_on(async move {
            tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await
        });
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.node.local_addr()
    }

    /// QUIC connections to `peer` (its lanes; 0 for this rank).
    pub fn connections(&self, peer: usize) -> usize {
        self.peers.get(peer).map_or(0, Vec::len)
    }

    /// The certificate `peer` authenticated with on its first connection (`None` for this
    /// rank): says who a peer proved to be, for diagnostics and tests.
    pub fn peer_certificate(
        &self,
        peer: usize,
    ) -> Option<rustls::pki_types::CertificateDer<'static>> {
        let conn = self.peers.get(peer)?.first()?;
        let chain = conn
            .peer_identity()?
            .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
            .ok()?;
        chain.first().cloned()
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.shutdown(Duration::from_secs(5));
    }
}

impl super::Endpoint for QuicTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.peers.len()
    }

    fn transmit(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        let lanes = &self.peers[to];
        if lanes.is_empty() {
            return Err(DistError::PeerFailed {
                rank: to,
                reason: "no connection".into(),
            });
        }
        // Consecutive chunks of a collective (consecutive tags) take consecutive lanes.
        let conn = lanes[(tag % lanes.len() as u64) as usize].clone();
        let header = Header::new(kind, self.epoch, tag, payload.len());
        let inbox = self.inbox.clone();
        let in_flight = self.in_flight.clone();
        in_flight.fetch_add(1, Ordering::SeqCst);
        self.node.rt.spawn(async move {
            if let Err(e) = write_frame(&conn, header, payload).await {
                inbox.fail(to, format!("sending to it failed: {e}"));
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(())
    }

    fn inbox(&self) -> &Inbox {
        &self.inbox
    }
}

#[cfg(test)]
mod tests;
