//! An on-disk cache of decoded, resized images (as Petastorm's local-disk cache): decoding a
//! JPEG or PNG and shrinking it costs far more than reading raw pixels back.
//!
//! An entry is keyed by the source path, its size and modification time, and the cache's
//! resize side; a changed source file gets a new key, so it is decoded again. When the cache is
//! full (`max_bytes`), new entries are not written and images are decoded as usual.
//! Entry format: magic `HRC1`, width and height (u32 LE), then RGB bytes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use image::RgbImage;

use crate::preprocess::{decode_rgb, resize_shorter};
use crate::{DataError, Result};

const MAGIC: &[u8; 4] = b"HRC1";

pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
    /// Resize the shorter side to this before caching (0: keep the original size).
    resize: u32,
    used: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
}

impl DiskCache {
    /// Opens (creating) a cache directory, counting the bytes already there.
    pub fn open(dir: &Path, max_bytes: u64, resize: u32) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| DataError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut used = 0;
        let entries = std::fs::read_dir(dir).map_err(|source| DataError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        for e in entries.flatten() {
            if let Ok(m) = e.metadata() {
                used += m.len();
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            max_bytes,
            resize,
            used: AtomicU64::new(used),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    fn key(&self, source: &Path) -> Result<PathBuf> {
        let meta = std::fs::metadata(source).map_err(|e| DataError::Io {
            path: source.to_path_buf(),
            source: e,
        })?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        // A stable hash: the same file has the same entry under every Rust release.
        let mut h = crate::rng::Fnv64::new();
        h.write(source.as_os_str().as_encoded_bytes());
        h.write(&meta.len().to_le_bytes());
        h.write(&mtime.to_le_bytes());
        h.write(&self.resize.to_le_bytes());
        Ok(self.dir.join(format!("{:016x}.rgb", h.finish())))
    }

    /// An entry, or `None` when it is missing or damaged in any way (wrong magic, a zero or
    /// inconsistent size, a shorter side other than the cache's resize): a miss, never a panic
    /// further down the pipeline.
    fn read_entry(&self, path: &Path) -> Option<RgbImage> {
        let bytes = std::fs::read(path).ok()?;
        if bytes.len() < 12 || &bytes[..4] != MAGIC {
            return None;
        }
        let w = u32::from_le_bytes(bytes[4..8].try_into().ok()?);
        let h = u32::from_le_bytes(bytes[8..12].try_into().ok()?);
        let expected = (w as usize)
            .checked_mul(h as usize)?
            .checked_mul(3)?
            .checked_add(12)?;
        if w == 0 || h == 0 || bytes.len() != expected {
            return None;
        }
        if self.resize > 0 && w.min(h) != self.resize {
            return None;
        }
        RgbImage::from_raw(w, h, bytes[12..].to_vec())
    }

    /// The decoded (and resized) image, from the cache when present and intact.
    pub fn load(&self, source: &Path) -> Result<RgbImage> {
        let entry = self.key(source)?;
        if let Some(img) = self.read_entry(&entry) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(img);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let bytes = std::fs::read(source).map_err(|e| DataError::Io {
            path: source.to_path_buf(),
            source: e,
        })?;
        let mut img = decode_rgb(&bytes, source)?;
        if self.resize > 0 {
            img = resize_shorter(&img, self.resize);
        }
        let size = 12 + img.as_raw().len() as u64;
        if self.used.fetch_add(size, Ordering::Relaxed) + size <= self.max_bytes {
            let mut data = Vec::with_capacity(size as usize);
            data.extend_from_slice(MAGIC);
            data.extend_from_slice(&img.width().to_le_bytes());
            data.extend_from_slice(&img.height().to_le_bytes());
            data.extend_from_slice(img.as_raw());
            // Atomic: a reader never sees half an entry. A failed write only loses the cache.
            let tmp = entry.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &data).is_err() || std::fs::rename(&tmp, &entry).is_err() {
                let _ = std::fs::remove_file(&tmp);
                self.used.fetch_sub(size, Ordering::Relaxed);
            }
        } else {
            self.used.fetch_sub(size, Ordering::Relaxed);
        }
        Ok(img)
    }
}
