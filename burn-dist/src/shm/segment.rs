//! The shared-memory segment: a file in `/dev/shm` with owner-only permissions, mapped by every
//! rank of one host, and the layout of what lives in it.
//!
//! ```text
//! header (one cache line)      magic, version, world, nonce, ring and slot sizes, barrier word,
//!                              chain choice and word
//! rank entries (world)         pid, pid namespace, start time, heartbeat, closed, arrived, doorbell,
//!                              chain progress, where its buffer lies, shared-buffer progress
//! ring controls (w(w-1))       head (written), tail (read), space word: one per ordered pair
//! ring data (w(w-1))           ring_bytes each: the pipes behind the Transport trait
//! slots (world)                slot_bytes each, in two halves: the in-place reduction
//! ```
//!
//! The creator unlinks the file as soon as every rank has mapped it, so a killed job leaves
//! nothing behind; files of jobs killed before that are removed by [`remove_stale`] at the next
//! job's start.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::{DistError, Result};

mod futex;
mod liveness;

pub(crate) use futex::{futex_wait, futex_wake};
#[cfg(test)]
pub(crate) use liveness::proc_stat;
pub(crate) use liveness::{ProcessId, namespace_inode};
use liveness::{Seen, process_seen};

/// Where segments live (tmpfs).
pub const SHM_DIR: &str = "/dev/shm";
/// Every segment's file name starts with this, then `<pid>-<start time>-<random>`.
pub const PREFIX: &str = "hearth-";
const MAGIC: u64 = u64::from_le_bytes(*b"HEARTHSM");
const VERSION: u32 = 3;
const LINE: usize = 128;
const PAGE: usize = 4096;

/// A value alone on its cache line (no false sharing between writer and reader).
#[repr(C, align(128))]
pub(crate) struct Line<T>(pub T);

#[repr(C)]
pub(crate) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    world: AtomicU32,
    nonce: [AtomicU64; 2],
    ring_bytes: AtomicU64,
    slot_bytes: AtomicU64,
    /// Bumped at every barrier arrival; waiters sleep on it.
    pub barrier_word: AtomicU32,
    /// 1 when the host's allreduce runs as a chain (set by the creator before anyone attaches,
    /// so every rank of the host takes the same path).
    chain: AtomicU32,
    /// Bumped after a chain step that someone may wait for; waiters sleep on it.
    pub chain_word: AtomicU32,
    /// Ranks asleep on `chain_word` (a stepping rank wakes them only when there are any).
    pub chain_sleepers: AtomicU32,
}

/// One rank's public state.
#[repr(C, align(128))]
pub(crate) struct RankEntry {
    pub pid: AtomicU32,
    /// 1 once the rank has mapped the segment.
    pub attached: AtomicU32,
    /// 1 once the rank has left cleanly (after its last write).
    pub closed: AtomicU32,
    /// Barriers this rank has arrived at.
    pub arrived: AtomicU32,
    /// Bumped by every writer to this rank; its reader sleeps on it.
    pub doorbell: AtomicU32,
    pub pid_ns: AtomicU64,
    pub start_time: AtomicU64,
    /// Bumped every 100 ms by the rank's reader thread.
    pub heartbeat: AtomicU64,
    /// The buffer length this rank passed to its last two in-place collectives (by parity).
    pub lens: [AtomicU64; 2],
    /// Chain allreduce: pieces this rank has added into the ring (counted over the job).
    pub chain_added: AtomicU64,
    /// Chain allreduce: pieces this rank is finished with (their sum copied out, or not needed).
    pub chain_done: AtomicU64,
    /// The local rank (plus one; 0 for none) whose failure made this rank give up a collective,
    /// so a rank that finds this one gone names the rank that failed first.
    pub gave_up_on: AtomicU32,
    /// Where the buffer of this rank's last two in-place collectives lies (by parity, as
    /// `lens`): a shared buffer's generation and offset ([`crate::shm::shared`]), or
    /// `u64::MAX` for a buffer of the rank's own.
    pub places: [AtomicU64; 2],
    /// How far this rank got in making its latest shared buffer: `4 * generation + stage`,
    /// stage 1 when its file exists, 2 when it has mapped every peer's.
    pub sharing: AtomicU64,
}

/// One ordered pair's byte ring: positions only grow; `head - tail` bytes are unread.
#[repr(C)]
pub(crate) struct RingCtl {
    pub head: Line<AtomicU64>,
    pub tail: Line<AtomicU64>,
    /// Bumped by the reader after consuming; a writer waiting for room sleeps on it.
    pub space_word: Line<AtomicU32>,
}

/// Byte offsets of everything in a segment of `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub world: usize,
    pub ring_bytes: usize,
    pub slot_bytes: usize,
    entries: usize,
    ctls: usize,
    rings: usize,
    slots: usize,
    pub total: usize,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl Layout {
    pub fn new(world: usize, ring_bytes: usize, slot_bytes: usize) -> Layout {
        let ring_bytes = align(ring_bytes.max(PAGE), PAGE);
        let slot_bytes = align(slot_bytes.max(2 * PAGE), 2 * PAGE);
        let pairs = world * world.saturating_sub(1);
        let entries = align(size_of::<Header>(), LINE);
        let ctls = align(entries + world * size_of::<RankEntry>(), LINE);
        let rings = align(ctls + pairs * size_of::<RingCtl>(), PAGE);
        let slots = rings + pairs * ring_bytes;
        Layout {
            world,
            ring_bytes,
            slot_bytes,
            entries,
            ctls,
            rings,
            slots,
            total: slots + world * slot_bytes,
        }
    }

    /// Index of the ring `from` -> `to` (local ranks, distinct).
    fn pair(&self, from: usize, to: usize) -> usize {
        from * (self.world - 1) + if to > from { to - 1 } else { to }
    }
}

/// A mapped segment.
pub struct Segment {
    base: *mut u8,
    layout: Layout,
    path: PathBuf,
    nonce: [u64; 2],
    /// The creator removes the file if it is still there when it drops the segment.
    creator: bool,
    _file: File,
}

// The mapping is plain shared memory; all cross-process state in it is atomic, and the ring and
// slot bytes are handed out under the protocols of `pipe` and `reduce`.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn io(context: String) -> impl FnOnce(std::io::Error) -> DistError {
    move |source| DistError::Io { context, source }
}

fn random_u64s<const N: usize>() -> Result<[u64; N]> {
    use ring::rand::SecureRandom;
    let mut bytes = vec![0u8; 8 * N];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| DistError::Config("no system randomness for a segment name".into()))?;
    let mut out = [0u64; N];
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
        *o = u64::from_le_bytes(c.try_into().unwrap_or_default());
    }
    Ok(out)
}

/// Creates `path` (owner-only, never an existing file) with `bytes` reserved up front, so a
/// full tmpfs is an error here, never a SIGBUS later; `hint` says what sets the size. The file
/// is removed again when the space cannot be reserved.
pub(crate) fn create_reserved(path: &Path, bytes: usize, hint: &str) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io(format!("creating {}", path.display())))?;
    // SAFETY: a valid open descriptor; the range is the file's whole new length.
    #[cfg(target_os = "linux")]
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes as i64) };
    // Elsewhere the length only (no /dev/shm there in practice: creating fails first).
    #[cfg(not(target_os = "linux"))]
    let rc = match file.set_len(bytes as u64) {
        Ok(()) => 0,
        Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
    };
    if rc != 0 {
        let _ = std::fs::remove_file(path);
        return Err(DistError::Io {
            context: format!(
                "reserving {} MiB for {} in {SHM_DIR} (too small? {hint})",
                bytes >> 20,
                path.display()
            ),
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    Ok(file)
}

/// Opens a file another rank made for this job: a regular file of this user with owner-only
/// permissions (anything else is refused), with its metadata.
pub(crate) fn open_owned(path: &Path) -> Result<(File, std::fs::Metadata)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io(format!("opening {}", path.display())))?;
    let meta = file
        .metadata()
        .map_err(io(format!("inspecting {}", path.display())))?;
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(DistError::Config(format!(
            "{} is not an owner-only file of this user (mode {:o}, owner {}): refusing it",
            path.display(),
            meta.mode() & 0o7777,
            meta.uid()
        )));
    }
    Ok((file, meta))
}

impl Segment {
    /// Creates a new segment for `world` ranks in [`SHM_DIR`] (owner-only, never an existing
    /// file), with its space reserved up front: a full tmpfs is an error here, never a SIGBUS
    /// later.
    pub fn create(world: usize, ring_bytes: usize, slot_bytes: usize) -> Result<Segment> {
        let layout = Layout::new(world, ring_bytes, slot_bytes);
        let me = ProcessId::current();
        let [rand, n0, n1] = random_u64s::<3>()?;
        let path =
            Path::new(SHM_DIR).join(format!("{PREFIX}{}-{}-{rand:016x}", me.pid, me.start_time));
        let file = create_reserved(
            &path,
            layout.total,
            "HEARTH_SHM_SLOT_MB and HEARTH_SHM_RING_MB set the size; HEARTH_SHM=0 turns shared \
             memory off",
        )?;
        let mut seg = Segment {
            base: std::ptr::null_mut(),
            layout,
            path,
            nonce: [n0, n1],
            creator: true,
            _file: file,
        };
        seg.map()?;
        let h = seg.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.world.store(world as u32, Ordering::Relaxed);
        h.nonce[0].store(n0, Ordering::Relaxed);
        h.nonce[1].store(n1, Ordering::Relaxed);
        h.ring_bytes
            .store(layout.ring_bytes as u64, Ordering::Relaxed);
        h.slot_bytes
            .store(layout.slot_bytes as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps the segment another rank created and announced (file name and nonce, received over
    /// the job's authenticated connection). The file must be a regular file of this user with
    /// owner-only permissions, of the expected size, carrying the announced nonce.
    pub fn attach(name: &str, nonce: [u64; 2], world: usize) -> Result<Segment> {
        if !name.starts_with(PREFIX)
            || name.contains('/')
            || name.contains("..")
            || name.len() > 128
        {
            return Err(DistError::Config(format!(
                "{name:?} is not a shared-memory segment name of a Hearth job"
            )));
        }
        let path = Path::new(SHM_DIR).join(name);
        let (file, meta) = open_owned(&path)?;
        let mut seg = Segment {
            base: std::ptr::null_mut(),
            layout: Layout::new(world, 0, 0),
            path,
            nonce,
            creator: false,
            _file: file,
        };
        // Map the header first to learn the sizes, then the whole segment.
        seg.layout.total = PAGE;
        if (meta.len() as usize) < PAGE {
            return Err(seg.mismatch("shorter than its header"));
        }
        seg.map()?;
        let h = seg.header();
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version.load(Ordering::Relaxed) != VERSION
        {
            return Err(seg.mismatch("not a segment of this version"));
        }
        let got = [
            h.nonce[0].load(Ordering::Relaxed),
            h.nonce[1].load(Ordering::Relaxed),
        ];
        if got != nonce || h.world.load(Ordering::Relaxed) as usize != world {
            return Err(seg.mismatch("its nonce or world size is not the announced one"));
        }
        let layout = Layout::new(
            world,
            h.ring_bytes.load(Ordering::Relaxed) as usize,
            h.slot_bytes.load(Ordering::Relaxed) as usize,
        );
        if meta.len() as usize != layout.total {
            return Err(seg.mismatch("its size does not match its header"));
        }
        seg.unmap();
        seg.layout = layout;
        seg.map()?;
        Ok(seg)
    }

    fn mismatch(&self, what: &str) -> DistError {
        DistError::Config(format!(
            "shared-memory segment {}: {what}",
            self.path.display()
        ))
    }

    fn map(&mut self) -> Result<()> {
        // SAFETY: maps `total` bytes of an open file that is at least that long, shared.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.layout.total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self._file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(DistError::Io {
                context: format!("mapping {}", self.path.display()),
                source: std::io::Error::last_os_error(),
            });
        }
        self.base = p.cast();
        Ok(())
    }

    fn unmap(&mut self) {
        if !self.base.is_null() {
            // SAFETY: `base` came from mmap with this length and nothing borrows it any more.
            unsafe { libc::munmap(self.base.cast(), self.layout.total) };
            self.base = std::ptr::null_mut();
        }
    }

    /// Removes the file; the ranks keep their mappings.
    pub fn unlink(&self) -> Result<()> {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(DistError::Io {
                context: format!("removing {}", self.path.display()),
                source: e,
            }),
            _ => Ok(()),
        }
    }

    /// The file name to announce to the other ranks.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn nonce(&self) -> [u64; 2] {
        self.nonce
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    fn at<T>(&self, offset: usize) -> &T {
        debug_assert!(offset + size_of::<T>() <= self.layout.total);
        // SAFETY: in bounds, aligned by the layout, and every such type is made of atomics.
        unsafe { &*self.base.add(offset).cast::<T>() }
    }

    pub(crate) fn header(&self) -> &Header {
        self.at(0)
    }

    pub(crate) fn entry(&self, r: usize) -> &RankEntry {
        self.at(self.layout.entries + r * size_of::<RankEntry>())
    }

    pub(crate) fn ring(&self, from: usize, to: usize) -> (&RingCtl, *mut u8) {
        let p = self.layout.pair(from, to);
        let ctl = self.at(self.layout.ctls + p * size_of::<RingCtl>());
        // SAFETY: in bounds by the layout.
        let data = unsafe {
            self.base
                .add(self.layout.rings + p * self.layout.ring_bytes)
        };
        (ctl, data)
    }

    /// Whether this host's allreduce runs as a chain ([`crate::shm::reduce`]).
    pub(crate) fn chain(&self) -> bool {
        self.header().chain.load(Ordering::Acquire) != 0
    }

    /// Chooses the chain allreduce for every rank of the host: the creator calls it before any
    /// other rank attaches (or builds its group).
    pub(crate) fn set_chain(&self, on: bool) {
        self.header().chain.store(u32::from(on), Ordering::Release);
    }

    /// Half `half` (0 or 1) of rank `r`'s slot, as `f32`s.
    pub(crate) fn slot(&self, r: usize, half: usize) -> (*mut f32, usize) {
        let bytes = self.layout.slot_bytes / 2;
        // SAFETY: in bounds by the layout, page-aligned.
        let p = unsafe {
            self.base
                .add(self.layout.slots + r * self.layout.slot_bytes + half * bytes)
        };
        (p.cast(), bytes / 4)
    }

    /// Fills rank `r`'s entry with this process's identity and marks it attached.
    pub(crate) fn register(&self, r: usize) {
        let me = ProcessId::current();
        let e = self.entry(r);
        e.pid.store(me.pid, Ordering::Relaxed);
        e.pid_ns.store(me.pid_ns, Ordering::Relaxed);
        e.start_time.store(me.start_time, Ordering::Relaxed);
        e.attached.store(1, Ordering::Release);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unmap();
        if self.creator {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Watches other ranks of a segment for death: their process gone when it is in this pid
/// namespace (a running process is alive, however busy), else, or when it is stopped
/// (SIGSTOP: it could stay so forever), their heartbeat still for longer than `stale`.
pub(crate) struct Watch {
    seen: Vec<(u64, Instant)>,
    stale: Duration,
}

impl Watch {
    pub fn new(world: usize, stale: Duration) -> Watch {
        Watch {
            seen: vec![(u64::MAX, Instant::now()); world],
            stale,
        }
    }

    /// Why rank `r` is dead, if it is.
    pub fn dead(&mut self, seg: &Segment, r: usize) -> Option<String> {
        let e = seg.entry(r);
        let id = ProcessId {
            pid: e.pid.load(Ordering::Relaxed),
            pid_ns: e.pid_ns.load(Ordering::Relaxed),
            start_time: e.start_time.load(Ordering::Relaxed),
        };
        let stopped = match process_seen(id) {
            Seen::Running => return None,
            Seen::Gone(why) => return Some(format!("{why} (shared memory)")),
            Seen::Stopped => true,
            Seen::Hidden => false,
        };
        let beat = e.heartbeat.load(Ordering::Relaxed);
        let (last, since) = &mut self.seen[r];
        if beat != *last {
            *last = beat;
            *since = Instant::now();
            None
        } else if since.elapsed() > self.stale {
            Some(format!(
                "no shared-memory heartbeat for {:?} (HEARTH_SHM_STALE){}",
                self.stale,
                if stopped {
                    format!("; its process {} is stopped", id.pid)
                } else {
                    String::new()
                }
            ))
        } else {
            None
        }
    }
}

/// Removes segments of this user whose creator is no longer running (jobs killed between
/// creating a segment and every rank attaching it). Returns how many.
pub fn remove_stale() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return 0;
    };
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let pid_ns = namespace_inode("pid").unwrap_or(0);
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let mut parts = rest.split('-');
        let (Some(Ok(pid)), Some(Ok(start_time))) = (
            parts.next().map(str::parse::<u32>),
            parts.next().map(str::parse::<u64>),
        ) else {
            continue;
        };
        let mine = entry.metadata().is_ok_and(|m| m.uid() == uid);
        let id = ProcessId {
            pid,
            pid_ns,
            start_time,
        };
        let gone = matches!(process_seen(id), Seen::Gone(_));
        if mine && gone && std::fs::remove_file(entry.path()).is_ok() {
            log::info!("removed a stale shared-memory segment {name}");
            removed += 1;
        }
    }
    removed
}
