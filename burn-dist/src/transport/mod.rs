//! Framed messages between ranks.
//!
//! A [`Transport`] sends a payload to a rank under a `(kind, tag)` and receives the payload a
//! given rank sent under a given `(kind, tag)`, waiting at most until a deadline. Matching by tag
//! lets operations overlap (a collective's chunks, metric averaging beside gradient traffic) and
//! makes arrival order irrelevant. A peer that fails makes every later receive from it fail with
//! [`DistError::PeerFailed`] naming it.
//!
//! Implementations side by side, each over this module alone: [`memory::MemoryTransport`]
//! (threads in one process, for tests), [`quic::QuicTransport`] (quinn, TLS always on) and
//! [`crate::shm::ShmTransport`] (the ranks of one host). [`crate::routed::RoutedTransport`],
//! above QUIC and shared memory, is what a job's rank uses: it sends each message the way its
//! peer is reached. [`group::Group`] is a sub-world of any transport.
//!
//! Each of the four that moves bytes is an [`Endpoint`]: it says how a message leaves and which
//! [`Inbox`] messages arrive in, and its receives, peer checks and failure reports come from
//! the inbox, written once.

mod endpoint;
pub mod group;
pub mod memory;
pub mod quic;
mod topology;

pub use endpoint::Endpoint;
pub use topology::{HostGroup, SharedBuf, Topology};

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::wire::Kind;
use crate::{DistError, Result};

/// Point-to-point framed messages with deadlines.
pub trait Transport: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Queues `payload` for `to`. Returns once the transport owns it; delivery failures show up
    /// as [`DistError::PeerFailed`] on later operations with that peer.
    fn send(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()>;
    /// The payload `from` sent under `(kind, tag)`, waiting until `deadline`.
    fn recv(&self, from: usize, kind: Kind, tag: u64, deadline: Instant) -> Result<Vec<u8>>;

    /// As [`Transport::recv`], in the pieces the transport read it in when it has them (QUIC:
    /// quinn's own buffers), so a collective decodes them without joining them first.
    fn recv_payload(
        &self,
        from: usize,
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<Payload> {
        self.recv(from, kind, tag, deadline).map(Payload::Whole)
    }

    /// The first payload any rank of `from` sent under `(kind, tag)`, with its sender, waiting
    /// until `deadline`: a server answering whichever worker asks first. A failed rank of
    /// `from` is a [`DistError::PeerFailed`] naming it (after [`Transport::accept_losses`] the
    /// caller can take it out of `from` and go on).
    fn recv_any(
        &self,
        from: &[usize],
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<(usize, Vec<u8>)>;

    /// Goes on without the ranks that failed: by default a failed rank fails every later
    /// receive (the job cannot go on); after this, only receives from the failed ranks do,
    /// for ranks failed so far and any that fail later, so an elastic job's survivors can
    /// still talk over the old world (to agree on the next one) and a parameter server goes
    /// on without a dead worker.
    fn accept_losses(&self) {}

    /// Why `peer` is known to have failed or left, if it is (`None` where this transport
    /// does not keep track).
    fn lost(&self, _peer: usize) -> Option<String> {
        None
    }

    /// Which ranks share memory with which, when this transport knows (see [`Topology`]):
    /// allreduce then reduces within each host in shared memory and runs the ring only among
    /// one rank per host.
    fn topology(&self) -> Option<&Topology> {
        None
    }
}

pub(crate) fn check_peer(t: &dyn Transport, peer: usize, op: &str) -> Result<()> {
    if peer >= t.world() || peer == t.rank() {
        return Err(DistError::Config(format!(
            "{op}: peer {peer} is not another rank of a world of {} (this is rank {})",
            t.world(),
            t.rank()
        )));
    }
    Ok(())
}

/// A received message: one buffer, or the pieces a network transport read it in.
#[derive(Debug)]
pub enum Payload {
    Whole(Vec<u8>),
    Pieces(Vec<bytes::Bytes>),
}

impl Payload {
    pub fn len(&self) -> usize {
        match self {
            Payload::Whole(v) => v.len(),
            Payload::Pieces(p) => p.iter().map(|b| b.len()).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes in order, piece by piece.
    pub fn pieces(&self) -> Box<dyn Iterator<Item = &[u8]> + '_> {
        match self {
            Payload::Whole(v) => Box::new(std::iter::once(v.as_slice())),
            Payload::Pieces(p) => Box::new(p.iter().map(|b| b.as_ref())),
        }
    }

    /// One buffer (joining pieces is the one copy).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            Payload::Whole(v) => v,
            Payload::Pieces(mut p) if p.len() == 1 => p.pop().map(Vec::from).unwrap_or_default(),
            Payload::Pieces(p) => {
                let mut v = Vec::with_capacity(p.iter().map(|b| b.len()).sum());
                p.iter().for_each(|b| v.extend_from_slice(b));
                v
            }
        }
    }
}

#[derive(Default)]
struct InboxState {
    messages: HashMap<(usize, Kind, u64), VecDeque<Payload>>,
    /// Bytes reserved for frames being read plus bytes delivered and not yet taken.
    held: usize,
    /// Peers whose link ended, gracefully or not.
    failed: HashMap<usize, String>,
    /// The first peer that failed abnormally: it fails every receive, whoever it waits for, since
    /// a collective cannot finish without every rank.
    job_failure: Option<(usize, String)>,
    /// Set by [`Inbox::accept_losses`]: failures no longer fail receives from other peers.
    tolerant: bool,
}

/// Received messages by (from, kind, tag), and the peers known to have failed.
///
/// A network transport reserves room for a frame ([`Inbox::try_reserve`]) before reading its
/// payload, so the bytes held for messages nobody has taken yet stay under a budget: a peer
/// that sends faster than this rank consumes is slowed down (QUIC flow control), and a frame
/// header cannot make this rank allocate more than the budget.
pub struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
    budget: usize,
}

impl Default for Inbox {
    fn default() -> Self {
        Self::with_budget(usize::MAX)
    }
}

impl Inbox {
    /// An inbox holding at most `budget` bytes of reserved and untaken payloads.
    pub fn with_budget(budget: usize) -> Self {
        Self {
            state: Mutex::new(InboxState::default()),
            arrived: Condvar::new(),
            budget,
        }
    }

    /// Reserves `bytes` for a frame about to be read; `false` while the budget is used up.
    /// [`Inbox::deliver_reserved`] hands the frame over; [`Inbox::release`] gives the room back
    /// if the read fails.
    pub fn try_reserve(&self, bytes: usize) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match s.held.checked_add(bytes) {
            Some(total) if total <= self.budget => {
                s.held = total;
                true
            }
            _ => false,
        }
    }

    pub fn release(&self, bytes: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.held = s.held.saturating_sub(bytes);
    }

    /// Bytes reserved or delivered and not yet taken.
    pub fn held(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).held
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Delivers a frame whose room was reserved with [`Inbox::try_reserve`].
    pub fn deliver_reserved(&self, from: usize, kind: Kind, tag: u64, payload: Vec<u8>) {
        self.deliver_reserved_payload(from, kind, tag, Payload::Whole(payload));
    }

    /// [`Inbox::deliver_reserved`] for a message in pieces.
    pub fn deliver_reserved_payload(&self, from: usize, kind: Kind, tag: u64, payload: Payload) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.messages
            .entry((from, kind, tag))
            .or_default()
            .push_back(payload);
        self.arrived.notify_all();
    }

    /// Delivers a frame without a reservation (in-process transports); it counts against the
    /// budget until taken.
    pub fn deliver(&self, from: usize, kind: Kind, tag: u64, payload: Vec<u8>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.held = s.held.saturating_add(payload.len());
        s.messages
            .entry((from, kind, tag))
            .or_default()
            .push_back(Payload::Whole(payload));
        self.arrived.notify_all();
    }

    /// Marks `peer` failed: pending and later receives from any rank return an error naming
    /// `peer` with `reason` (a rank died: the job cannot go on).
    pub fn fail(&self, peer: usize, reason: String) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.failed.entry(peer).or_insert(reason.clone());
        if s.job_failure.is_none() && !s.tolerant {
            s.job_failure = Some((peer, reason));
        }
        self.arrived.notify_all();
    }

    /// Marks `peer` as gone after a clean shutdown: only receives from it fail.
    pub fn left(&self, peer: usize, reason: String) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.failed.entry(peer).or_insert(reason);
        self.arrived.notify_all();
    }

    /// Only receives from failed peers fail from now on, for failures so far and later ones
    /// (see [`Transport::accept_losses`]).
    pub fn accept_losses(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.job_failure = None;
        s.tolerant = true;
    }

    pub fn failure(&self, peer: usize) -> Option<String> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.failed.get(&peer).cloned()
    }

    pub fn take(
        &self,
        from: usize,
        kind: Kind,
        tag: u64,
        deadline: Instant,
        op: &str,
    ) -> Result<Vec<u8>> {
        self.take_any(&[from], kind, tag, deadline, op)
            .map(|(_, m)| m)
    }

    /// [`Inbox::take`] without joining a message's pieces.
    pub fn take_payload(
        &self,
        from: usize,
        kind: Kind,
        tag: u64,
        deadline: Instant,
        op: &str,
    ) -> Result<Payload> {
        self.take_any_payload(&[from], kind, tag, deadline, op)
            .map(|(_, m)| m)
    }
}

impl Inbox {
    /// [`Inbox::take`] from whichever of `from` sent first (lowest rank first among those
    /// already there).
    pub fn take_any(
        &self,
        from: &[usize],
        kind: Kind,
        tag: u64,
        deadline: Instant,
        op: &str,
    ) -> Result<(usize, Vec<u8>)> {
        self.take_any_payload(from, kind, tag, deadline, op)
            .map(|(r, m)| (r, m.into_vec()))
    }

    fn take_any_payload(
        &self,
        from: &[usize],
        kind: Kind,
        tag: u64,
        deadline: Instant,
        op: &str,
    ) -> Result<(usize, Payload)> {
        if from.is_empty() {
            return Err(DistError::Config(format!("{op}: no rank to receive from")));
        }
        let started = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            for &r in from {
                if let Some(q) = s.messages.get_mut(&(r, kind, tag))
                    && let Some(m) = q.pop_front()
                {
                    if q.is_empty() {
                        s.messages.remove(&(r, kind, tag));
                    }
                    s.held = s.held.saturating_sub(m.len());
                    return Ok((r, m));
                }
            }
            for &r in from {
                if let Some(reason) = s.failed.get(&r) {
                    return Err(DistError::PeerFailed {
                        rank: r,
                        reason: reason.clone(),
                    });
                }
            }
            if let Some((rank, reason)) = &s.job_failure {
                return Err(DistError::PeerFailed {
                    rank: *rank,
                    reason: reason.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DistError::Timeout {
                    op: op.to_string(),
                    rank: from[0],
                    after: now - started,
                });
            }
            let wait = (deadline - now).min(Duration::from_millis(500));
            s = self
                .arrived
                .wait_timeout(s, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

/// Checks that every rank of `from` is another rank of the world.
pub(crate) fn check_peers(t: &dyn Transport, from: &[usize], op: &str) -> Result<()> {
    from.iter().try_for_each(|&r| check_peer(t, r, op))
}

/// The checks every [`Transport`] must pass (used by both implementations' tests).
#[doc(hidden)]
pub mod conformance;
