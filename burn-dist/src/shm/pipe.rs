//! Framed messages through the segment's byte rings: one ring per ordered pair of local ranks,
//! written by the sender under a lock, read by one reader thread per rank that delivers whole
//! frames into the rank's [`Inbox`] (the same inbox its QUIC links deliver into).
//!
//! A frame in a ring is a 24-byte header (kind, tag, payload length) then the payload; a frame
//! larger than the ring streams through it. Writers wake the reader through its doorbell word,
//! the reader wakes blocked writers through the ring's space word (futexes, so nobody spins
//! while waiting). A rank that leaves cleanly sets its `closed` flag after its last write; its
//! readers drain what it wrote, then mark it gone; a rank that dies is noticed by its process
//! disappearing (or its heartbeat stopping) and fails every receive from it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::options::ShmOptions;
use super::segment::{Segment, Watch, futex_wait, futex_wake};
use crate::transport::Inbox;
use crate::wire::Kind;
use crate::{DistError, Result};

const FRAME_HEADER: usize = 24;
/// How often the reader beats and looks at its peers while idle.
const TICK: Duration = Duration::from_millis(100);

/// This rank's pipes to and from the other ranks of its segment.
pub struct Pipes {
    seg: Arc<Segment>,
    /// Local index of this rank.
    me: usize,
    /// Job rank of each local index.
    members: Vec<usize>,
    writers: Vec<Mutex<()>>,
    options: ShmOptions,
    stop: Arc<AtomicBool>,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl Pipes {
    /// Starts this rank's reader, delivering into `inbox` under the senders' job ranks.
    pub fn start(
        seg: Arc<Segment>,
        me: usize,
        members: Vec<usize>,
        inbox: Arc<Inbox>,
        options: ShmOptions,
    ) -> Result<Pipes> {
        let stop = Arc::new(AtomicBool::new(false));
        let reader = Reader {
            seg: seg.clone(),
            me,
            peers: (0..members.len())
                .filter(|&p| p != me)
                .map(|p| Peer {
                    local: p,
                    job: members[p],
                    frame: Frame::Header([0; FRAME_HEADER], 0),
                    done: false,
                })
                .collect(),
            inbox,
            max_frame: options.max_frame_bytes,
            frame_timeout: options.frame_timeout,
            watch: Watch::new(members.len(), options.stale),
            stop: stop.clone(),
        };
        let handle = std::thread::Builder::new()
            .name(format!("burn-dist-shm-{}", members[me]))
            .spawn(move || reader.run())
            .map_err(|source| DistError::Io {
                context: "starting the shared-memory reader".into(),
                source,
            })?;
        Ok(Pipes {
            writers: (0..members.len()).map(|_| Mutex::new(())).collect(),
            seg,
            me,
            members,
            options,
            stop,
            reader: Mutex::new(Some(handle)),
        })
    }

    /// Local index of job rank `rank`, if it shares this segment.
    pub fn local_index(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }

    /// Writes a frame to local rank `to`, blocking while its ring is full.
    pub fn send(&self, to: usize, kind: Kind, tag: u64, payload: &[u8]) -> Result<()> {
        let _turn = self.writers[to].lock().unwrap_or_else(|e| e.into_inner());
        let mut header = [0u8; FRAME_HEADER];
        header[0] = kind as u8;
        header[8..16].copy_from_slice(&tag.to_le_bytes());
        header[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        let mut waiting = None;
        self.write(to, &header, &mut waiting)?;
        self.write(to, payload, &mut waiting)
    }

    fn write(
        &self,
        to: usize,
        mut bytes: &[u8],
        waiting: &mut Option<(Watch, Instant)>,
    ) -> Result<()> {
        let (ctl, data) = self.seg.ring(self.me, to);
        let cap = self.seg.layout().ring_bytes as u64;
        let mut head = ctl.head.0.load(Ordering::Relaxed);
        let peer = self.seg.entry(to);
        while !bytes.is_empty() {
            let seen = ctl.space_word.0.load(Ordering::Acquire);
            let free = cap - (head - ctl.tail.0.load(Ordering::Acquire));
            if free == 0 {
                let job = self.members[to];
                if peer.closed.load(Ordering::Acquire) != 0 {
                    return Err(DistError::PeerFailed {
                        rank: job,
                        reason: "it left the job (its shared-memory pipe is closed)".into(),
                    });
                }
                let (watch, since) = waiting.get_or_insert_with(|| {
                    (
                        Watch::new(self.members.len(), self.options.stale),
                        Instant::now(),
                    )
                });
                if let Some(why) = watch.dead(&self.seg, to) {
                    return Err(DistError::PeerFailed {
                        rank: job,
                        reason: why,
                    });
                }
                if since.elapsed() > self.options.frame_timeout {
                    return Err(DistError::PeerFailed {
                        rank: job,
                        reason: format!(
                            "it read nothing of its shared-memory pipe for {:?} \
                             (HEARTH_FRAME_TIMEOUT)",
                            self.options.frame_timeout
                        ),
                    });
                }
                futex_wait(&ctl.space_word.0, seen, Duration::from_millis(20));
                continue;
            }
            *waiting = None;
            let n = (free as usize).min(bytes.len());
            let at = (head % cap) as usize;
            let first = n.min(cap as usize - at);
            // SAFETY: `[at, at + first)` and `[0, n - first)` lie in the ring and are free: the
            // reader has consumed them and reads only up to `head`, published below.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(at), first);
                std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), data, n - first);
            }
            head += n as u64;
            ctl.head.0.store(head, Ordering::Release);
            peer.doorbell.fetch_add(1, Ordering::Release);
            futex_wake(&peer.doorbell);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Marks this rank gone (after its last write) and stops its reader. Idempotent.
    pub fn close(&self) {
        let e = self.seg.entry(self.me);
        e.closed.store(1, Ordering::Release);
        for p in (0..self.members.len()).filter(|&p| p != self.me) {
            let d = &self.seg.entry(p).doorbell;
            d.fetch_add(1, Ordering::Release);
            futex_wake(d);
        }
        self.stop.store(true, Ordering::Release);
        e.doorbell.fetch_add(1, Ordering::Release);
        futex_wake(&e.doorbell);
        let handle = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Pipes {
    fn drop(&mut self) {
        self.close();
    }
}

enum Frame {
    /// Header bytes so far.
    Header([u8; FRAME_HEADER], usize),
    Payload {
        kind: Kind,
        tag: u64,
        len: usize,
        buf: Vec<u8>,
        reserved: bool,
        since: Instant,
    },
}

struct Peer {
    local: usize,
    job: usize,
    frame: Frame,
    done: bool,
}

struct Reader {
    seg: Arc<Segment>,
    me: usize,
    peers: Vec<Peer>,
    inbox: Arc<Inbox>,
    max_frame: usize,
    frame_timeout: Duration,
    watch: Watch,
    stop: Arc<AtomicBool>,
}

impl Reader {
    fn run(mut self) {
        let mine = &self.seg.clone();
        let entry = mine.entry(self.me);
        let mut last_tick = Instant::now();
        entry.heartbeat.fetch_add(1, Ordering::Relaxed);
        while !self.stop.load(Ordering::Acquire) {
            let bell = entry.doorbell.load(Ordering::Acquire);
            let mut progressed = false;
            for i in 0..self.peers.len() {
                if !self.peers[i].done {
                    progressed |= self.read(i);
                }
            }
            if last_tick.elapsed() >= TICK {
                last_tick = Instant::now();
                entry.heartbeat.fetch_add(1, Ordering::Relaxed);
                self.check_peers();
            }
            if !progressed {
                futex_wait(&entry.doorbell, bell, TICK);
            }
        }
    }

    /// Peers that left or died: drain what they wrote, then tell the inbox.
    fn check_peers(&mut self) {
        for i in 0..self.peers.len() {
            if self.peers[i].done {
                continue;
            }
            let local = self.peers[i].local;
            let closed = self.seg.entry(local).closed.load(Ordering::Acquire) != 0;
            let dead = if closed {
                None
            } else {
                self.watch.dead(&self.seg, local)
            };
            if !closed && dead.is_none() {
                continue;
            }
            while self.read(i) {}
            let p = &mut self.peers[i];
            if p.done {
                continue;
            }
            p.done = true;
            let idle = matches!(p.frame, Frame::Header(_, 0));
            match dead {
                None if idle => self.inbox.left(p.job, "it left the job (finished)".into()),
                None => self
                    .inbox
                    .fail(p.job, "it left in the middle of a frame".into()),
                Some(why) => self.inbox.fail(p.job, why),
            }
        }
    }

    fn fail(&mut self, i: usize, reason: String) {
        let p = &mut self.peers[i];
        if let Frame::Payload {
            len,
            reserved: true,
            ..
        } = p.frame
        {
            self.inbox.release(len);
        }
        p.done = true;
        self.inbox.fail(p.job, reason);
    }

    /// Reads what peer `i` has written; `true` if anything was consumed.
    fn read(&mut self, i: usize) -> bool {
        let seg = self.seg.clone();
        let (ctl, data) = seg.ring(self.peers[i].local, self.me);
        let mut ring = RingRead {
            data,
            cap: seg.layout().ring_bytes as u64,
            head: ctl.head.0.load(Ordering::Acquire),
            tail: ctl.tail.0.load(Ordering::Relaxed),
        };
        let start = ring.tail;
        while self.read_on(i, &mut ring) {}
        if ring.tail != start {
            ctl.tail.0.store(ring.tail, Ordering::Release);
            ctl.space_word.0.fetch_add(1, Ordering::Release);
            futex_wake(&ctl.space_word.0);
        }
        ring.tail != start
    }

    /// Reads on in peer `i`'s current frame, delivering it when whole; `false` once the ring
    /// is empty, the frame waits for room in the inbox, or the peer failed.
    fn read_on(&mut self, i: usize, ring: &mut RingRead) -> bool {
        let max = self.max_frame.min(self.inbox.budget());
        let Frame::Header(h, got) = &mut self.peers[i].frame else {
            return self.read_payload(i, ring);
        };
        if ring.is_empty() {
            return false;
        }
        let mut w = *got;
        *got += ring.take(FRAME_HEADER - *got, &mut |b| {
            h[w..w + b.len()].copy_from_slice(b);
            w += b.len();
        });
        if *got < FRAME_HEADER {
            return true;
        }
        match frame_announced(h, max) {
            Ok(frame) => {
                self.peers[i].frame = frame;
                true
            }
            Err(reason) => {
                self.fail(i, reason);
                false
            }
        }
    }

    /// [`Self::read_on`] in a frame's payload: room in the inbox first, then the bytes.
    fn read_payload(&mut self, i: usize, ring: &mut RingRead) -> bool {
        let Frame::Payload {
            kind,
            tag,
            len,
            buf,
            reserved,
            since,
        } = &mut self.peers[i].frame
        else {
            return true;
        };
        if !*reserved {
            if !self.inbox.try_reserve(*len) {
                if since.elapsed() > self.frame_timeout {
                    let (len, held) = (*len, self.inbox.held());
                    let budget = self.inbox.budget();
                    let reason = format!(
                        "no room for a {len}-byte frame for {:?}: {held} of {budget} inbox \
                         bytes hold messages this rank has not taken (HEARTH_INBOX_MB)",
                        self.frame_timeout
                    );
                    self.fail(i, reason);
                }
                return false;
            }
            *reserved = true;
            *buf = Vec::with_capacity(*len);
        }
        if buf.len() < *len {
            if ring.is_empty() {
                return false;
            }
            ring.take(*len - buf.len(), &mut |b| buf.extend_from_slice(b));
        }
        if buf.len() == *len {
            let (kind, tag, payload) = (*kind, *tag, std::mem::take(buf));
            let peer = &mut self.peers[i];
            peer.frame = Frame::Header([0; FRAME_HEADER], 0);
            self.inbox.deliver_reserved(peer.job, kind, tag, payload);
        }
        true
    }
}

/// What a whole frame header announces: the frame to read, or why it is refused (a kind no
/// rank sends, a payload over `max` bytes).
fn frame_announced(h: &[u8; FRAME_HEADER], max: usize) -> std::result::Result<Frame, String> {
    let Some(kind) = Kind::from_u8(h[0]) else {
        return Err(format!("malformed shared-memory frame: kind {}", h[0]));
    };
    let tag = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
    let len = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default());
    if len > max as u64 {
        return Err(format!(
            "a frame announces {len} payload bytes, over the limit of {max} \
             (HEARTH_MAX_FRAME_MB)"
        ));
    }
    Ok(Frame::Payload {
        kind,
        tag,
        len: len as usize,
        buf: Vec::new(),
        reserved: false,
        since: Instant::now(),
    })
}

/// The part of a ring one read may consume: `[tail, head)`, as the writer published it.
struct RingRead {
    data: *mut u8,
    cap: u64,
    head: u64,
    tail: u64,
}

impl RingRead {
    fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    /// Hands up to `want` bytes to `out` (two pieces where the ring wraps) and moves past them.
    fn take(&mut self, want: usize, out: &mut dyn FnMut(&[u8])) -> usize {
        let n = ((self.head - self.tail) as usize).min(want);
        let at = (self.tail % self.cap) as usize;
        let first = n.min(self.cap as usize - at);
        // SAFETY: `[tail, head)` was published by the writer (Acquire on `head`) and is not
        // written again before `tail` moves past it.
        unsafe {
            out(std::slice::from_raw_parts(self.data.add(at), first));
            out(std::slice::from_raw_parts(self.data, n - first));
        }
        self.tail += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u8, tag: u64, len: u64) -> [u8; FRAME_HEADER] {
        let mut h = [0u8; FRAME_HEADER];
        h[0] = kind;
        h[8..16].copy_from_slice(&tag.to_le_bytes());
        h[16..24].copy_from_slice(&len.to_le_bytes());
        h
    }

    #[test]
    fn a_header_announces_its_frame_or_is_refused_by_name() {
        match frame_announced(&header(Kind::Ps as u8, 7, 100), 100) {
            Ok(Frame::Payload { kind, tag, len, .. }) => {
                assert_eq!((kind, tag, len), (Kind::Ps, 7, 100));
            }
            Ok(Frame::Header(..)) => panic!("a whole header must start a payload"),
            Err(e) => panic!("a valid header was refused: {e}"),
        }
        let Err(e) = frame_announced(&header(0, 7, 10), 100) else {
            panic!("kind 0 was accepted");
        };
        assert!(e.contains("malformed shared-memory frame: kind 0"), "{e}");
        let Err(e) = frame_announced(&header(Kind::Ps as u8, 7, 101), 100) else {
            panic!("a frame over the limit was accepted");
        };
        assert!(
            e.contains("101 payload bytes, over the limit of 100"),
            "{e}"
        );
    }

    #[test]
    fn a_wrapped_ring_is_read_in_two_pieces_in_order() {
        let mut data: Vec<u8> = (0..8).collect();
        // Four bytes published from position 6: 6, 7, then 0, 1 after the wrap.
        let mut ring = RingRead {
            data: data.as_mut_ptr(),
            cap: 8,
            head: 10,
            tail: 6,
        };
        let mut got = Vec::new();
        assert_eq!(ring.take(3, &mut |b| got.extend_from_slice(b)), 3);
        assert_eq!(got, [6, 7, 0]);
        assert_eq!(ring.take(9, &mut |b| got.extend_from_slice(b)), 1);
        assert_eq!(got, [6, 7, 0, 1]);
        assert!(ring.is_empty());
    }
}
