//! Buffers that every rank of a host maps: each rank's buffer is a file of its own in
//! [`SHM_DIR`], mapped by every rank of the segment, so an allreduce of it runs where the
//! values lie instead of through the slots.
//!
//! The slots cost each rank more than its own buffer's read and write: its values are copied
//! into a slot, summed there by a peer and copied back out (or passed from rank to rank as a
//! chain), four passes over the data and many hand-offs. In place, local rank `k` sums segment
//! `k` of every rank's buffer and writes the sum back into each of them: each rank reads
//! `1/n` of every buffer and writes `1/n` of every buffer, the least an allreduce can move,
//! with two barriers per call (every buffer ready; every sum written) whatever its size.
//!
//! [`LocalGroup::share`](crate::shm::LocalGroup::share) makes the buffers (a collective: every
//! rank makes its file, maps the others' and removes its own, so nothing outlives the job).
//! A collective runs in place when every member passes the same range of its latest shared
//! buffer (its generation and offset agree, checked at the collective's first barrier);
//! anything else takes the slots, so passing a plain `Vec` stays correct everywhere.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::segment::{PREFIX, SHM_DIR};
use crate::{DistError, Result};

const PAGE: usize = 4096;

/// Where no shared buffer is: a collective's place when its buffer is the rank's own.
pub(crate) const NOWHERE: u64 = u64::MAX;

/// One rank's buffer as mapped in this process.
struct Mapping {
    base: *mut f32,
    bytes: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base` came from mmap with `bytes` and is unmapped only here.
        unsafe { libc::munmap(self.base.cast(), self.bytes) };
    }
}

/// The buffers of one [`LocalGroup::share`](crate::shm::LocalGroup::share) call: every local
/// rank's, mapped here.
pub(crate) struct Shared {
    generation: u64,
    len: usize,
    maps: Vec<Mapping>,
}

// Plain shared memory; its values are written only inside the collectives that are handed a
// range of it (the owner's `&mut` is borrowed for the call), by the protocol of `reduce`.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// Local rank `k`'s buffer.
    pub(crate) fn base(&self, k: usize) -> *mut f32 {
        self.maps[k].base
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Where `buf` lies in local rank `me`'s buffer, as a collective announces it (generation
    /// and offset), when it lies wholly inside.
    pub(crate) fn place_of(&self, me: usize, buf: &[f32]) -> Option<(u64, usize)> {
        let base = self.maps[me].base as usize;
        let at = buf.as_ptr() as usize;
        let offset = at.checked_sub(base)? / 4;
        ((at - base).is_multiple_of(4) && offset + buf.len() <= self.len).then(|| {
            // 24 bits of generation, 40 of offset (4 TB of f32s): distinct for every buffer a
            // job will make, never NOWHERE.
            let place = ((self.generation & 0xff_ffff) << 40) | offset as u64;
            (place, offset)
        })
    }
}

/// The bytes a buffer of `len` values takes (whole pages, at least one).
fn bytes_for(len: usize) -> usize {
    (len.max(1) * 4).div_ceil(PAGE) * PAGE
}

/// The file of local rank `k`'s buffer of generation `generation`: named after its maker's
/// process (as segments are, so [`super::remove_stale`] removes it if the job is killed before
/// it is unlinked) and the segment's random tag.
pub(crate) fn path_for(
    segment_name: &str,
    pid: u32,
    start_time: u64,
    generation: u64,
    k: usize,
) -> PathBuf {
    let tag = segment_name.rsplit('-').next().unwrap_or("x");
    Path::new(SHM_DIR).join(format!(
        "{PREFIX}{pid}-{start_time}-{tag}-buffer{generation}-rank{k}"
    ))
}

fn map(file: &std::fs::File, bytes: usize, path: &Path) -> Result<Mapping> {
    // SAFETY: maps `bytes` of an open file that is at least that long, shared.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(DistError::Io {
            context: format!("mapping {}", path.display()),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(Mapping {
        base: p.cast(),
        bytes,
    })
}

/// Makes this rank's buffer file (owner-only, never an existing file) with its space reserved
/// (a full tmpfs is an error here, never a SIGBUS later).
pub(crate) fn create(path: &Path, len: usize) -> Result<()> {
    super::segment::create_reserved(
        path,
        bytes_for(len),
        "a shared gradient buffer takes 4 bytes per value; HEARTH_SHM=0 turns shared memory off",
    )
    .map(drop)
}

/// Maps a buffer file a rank of this segment made: a regular owner-only file of this user, of
/// the size a buffer of `len` values takes.
fn open(path: &Path, len: usize) -> Result<Mapping> {
    let (file, meta) = super::segment::open_owned(path)?;
    let bytes = bytes_for(len);
    if meta.len() != bytes as u64 {
        return Err(DistError::Config(format!(
            "shared buffer {} holds {} bytes where {len} values take {bytes}",
            path.display(),
            meta.len()
        )));
    }
    map(&file, bytes, path)
}

/// Every local rank's buffer mapped here, from their files (`paths`, by local index).
pub(crate) fn map_all(paths: &[PathBuf], len: usize, generation: u64) -> Result<Shared> {
    let maps = paths
        .iter()
        .map(|p| open(p, len))
        .collect::<Result<Vec<_>>>()?;
    Ok(Shared {
        generation,
        len,
        maps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_found_by_its_range_and_nothing_else_is() {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("hearth-shared-test-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        create(&path, 1000).unwrap();
        let shared = map_all(std::slice::from_ref(&path), 1000, 7).unwrap();
        std::fs::remove_file(&path).unwrap();
        // SAFETY: the mapping holds 1000 values (and nothing else touches it in this test).
        let whole = unsafe { std::slice::from_raw_parts(shared.base(0), 1000) };
        assert!(whole.iter().all(|&v| v == 0.0), "a new buffer is zeros");
        let (p0, o0) = shared.place_of(0, whole).unwrap();
        let (p1, o1) = shared.place_of(0, &whole[100..300]).unwrap();
        assert_eq!((o0, o1), (0, 100));
        assert_ne!(p0, p1);
        assert_eq!(p1 >> 40, 7);
        let own = vec![0f32; 10];
        assert!(shared.place_of(0, &own).is_none());
        // The same buffer made again must be refused as a peer's buffer of another size.
        create(&path, 10_000).unwrap();
        let err = map_all(std::slice::from_ref(&path), 1000, 8).err().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(err.to_string().contains("holds 40960 bytes"), "{err}");
    }
}
