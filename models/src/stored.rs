//! A torchvision file's tensors read straight from the file, one copy each: what a deferred
//! load ([`crate::load_torchvision_deferred`]) checks each tensor with, and what ZeRO stage 3's
//! rank 0 cuts into windows ([`FileTensor`]).
//!
//! Why: burn-store hands a tensor's bytes over as Burn's `Bytes`, made with `from_bytes_vec`,
//! which copies every buffer not allocated at 16-byte alignment (a `Vec<u8>` never is): each
//! tensor read through it is held twice for a moment, VGG-16's 411 MB first classifier weight
//! among them.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::store::KeyRemapper;
use burn::store::burn_pack::{self, Tensor as PackTensor};
use burn::store::pytorch_reader::{self, PytorchReader};
use burn::tensor::DType;

use crate::weights::LoadOptions;
use crate::zoo::Classifier;

/// Where an f32 tensor's bytes are in a weights file.
#[derive(Clone)]
pub(crate) enum Stored {
    /// A `.pth`'s, through PyTorch's reader (native byte order).
    Pth(pytorch_reader::Tensor),
    /// A `.safetensors`'s: `len` bytes (little-endian) at `offset` in the file.
    Safetensors {
        path: Arc<PathBuf>,
        key: String,
        offset: u64,
        len: usize,
    },
}

impl Stored {
    /// The number of values.
    pub(crate) fn len(&self) -> usize {
        match self {
            Stored::Pth(t) => t.num_elements(),
            Stored::Safetensors { len, .. } => len / std::mem::size_of::<f32>(),
        }
    }

    fn key(&self) -> &str {
        match self {
            Stored::Pth(t) => &t.name,
            Stored::Safetensors { key, .. } => key,
        }
    }

    /// The bytes, as stored; an error names the tensor.
    pub(crate) fn read(&self) -> io::Result<Vec<u8>> {
        match self {
            Stored::Pth(t) => t.read(),
            Stored::Safetensors {
                path,
                key,
                offset,
                len,
            } => {
                let named = |e: io::Error| {
                    io::Error::new(
                        e.kind(),
                        format!("tensor '{key}' of {}: {e}", path.display()),
                    )
                };
                let file = File::open(path.as_path()).map_err(named)?;
                let mut bytes = vec![0u8; *len];
                file.read_exact_at(&mut bytes, *offset).map_err(named)?;
                Ok(bytes)
            }
        }
    }
}

/// A weights file's tensor that a deferred load gave a parameter, read by the caller: whole, as
/// stored ([`Self::read`]: one copy in memory), then cut a window of the parameter's values at
/// a time ([`Self::window`]), a linear layer's weight transposed as it is cut. The
/// parameter's own initialiser reads the same tensor, and transposes a linear weight into a
/// second whole copy.
#[derive(Clone)]
pub struct FileTensor {
    stored: Stored,
    /// A linear layer's weight: the parameter's `[in, out]` (the file's is `[out, in]`).
    transposed: Option<[usize; 2]>,
}

impl std::fmt::Debug for FileTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileTensor")
            .field("key", &self.key())
            .field("len", &self.len())
            .field("transposed", &self.transposed)
            .finish()
    }
}

impl FileTensor {
    pub(crate) fn new(stored: Stored, transposed: Option<[usize; 2]>) -> Self {
        Self { stored, transposed }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.stored.len()
    }

    /// Whether the tensor holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tensor's key in the file.
    pub fn key(&self) -> &str {
        self.stored.key()
    }

    /// The tensor's bytes as the file stores them (f32, the file's layout); an error names
    /// the tensor.
    pub fn read(&self) -> io::Result<Vec<u8>> {
        self.stored.read()
    }

    /// Values `range` of the parameter (its row-major order) from `bytes`, what [`Self::read`]
    /// gave; `None` where `bytes` is not the whole tensor.
    pub fn window(&self, bytes: &[u8], range: Range<usize>) -> Option<Vec<f32>> {
        const F32: usize = std::mem::size_of::<f32>();
        if bytes.len() != self.len() * F32 || range.end > self.len() || range.start > range.end {
            return None;
        }
        let native = matches!(self.stored, Stored::Pth(_));
        let at = |i: usize| {
            let b = [
                bytes[i * F32],
                bytes[i * F32 + 1],
                bytes[i * F32 + 2],
                bytes[i * F32 + 3],
            ];
            match native {
                true => f32::from_ne_bytes(b),
                false => f32::from_le_bytes(b),
            }
        };
        Some(match self.transposed {
            // Value (i, o) of the parameter's [in, out] is the file's (o, i).
            Some([_, cols]) => {
                let rows = self.len() / cols.max(1);
                range.map(|k| at((k % cols) * rows + k / cols)).collect()
            }
            None => range.map(at).collect(),
        })
    }
}

/// `named`'s tensors by `model`'s keys, as `remap` renames them in burn-store's stores.
fn renamed(remap: &KeyRemapper, named: Vec<(String, Stored)>) -> HashMap<String, Stored> {
    let mut by_name: HashMap<String, Stored> = named.into_iter().collect();
    // Handles that read nothing, renamed by the store's own rule.
    let handles = by_name
        .iter()
        .map(|(name, t)| {
            let unread = || Err(burn_pack::Error::ValidationError("not read here".into()));
            PackTensor::deferred(
                name.clone(),
                DType::F32,
                [t.len()],
                None,
                t.len() * 4,
                unread,
            )
        })
        .collect();
    let (_, pairs) = remap.remap(handles);
    pairs
        .into_iter()
        .filter_map(|(new, old)| by_name.remove(&old).map(|t| (new, t)))
        .collect()
}

/// A `.pth`'s f32 tensors through PyTorch's reader, by `model`'s keys (the keys
/// [`crate::weights::torchvision_pth`] gives them); empty where the file does not open so.
pub(crate) fn pth_tensors(
    model: &Classifier,
    path: &Path,
    options: &LoadOptions,
) -> HashMap<String, Stored> {
    let Ok((top, remap)) = crate::weights::pth_keys(model, path, options) else {
        return HashMap::new();
    };
    let reader = match &top {
        Some(key) => PytorchReader::with_top_level_key(path, key),
        None => PytorchReader::new(path),
    };
    let Ok(reader) = reader else {
        return HashMap::new();
    };
    let named = reader
        .into_tensors()
        .into_values()
        .filter(|t| t.dtype() == pytorch_reader::DType::F32)
        .map(|t| (t.name.clone(), Stored::Pth(t)))
        .collect();
    renamed(&remap, named)
}

/// A `.safetensors`'s f32 tensors, by `model`'s keys: their places in the file, from its header
/// (a little-endian length, then JSON naming each tensor's dtype, shape and byte range in the
/// data after the header); empty where the header does not read so.
pub(crate) fn safetensors_tensors(model: &Classifier, path: &Path) -> HashMap<String, Stored> {
    let Ok(remap) = crate::weights::remapper(model) else {
        return HashMap::new();
    };
    let header = || -> Option<(u64, serde_json::Map<String, serde_json::Value>)> {
        let file = File::open(path).ok()?;
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).ok()?;
        let n = u64::from_le_bytes(n);
        let file_len = file.metadata().ok()?.len();
        // The header is checked against the file before its length sizes an allocation.
        let end = n.checked_add(8).filter(|&e| e <= file_len)?;
        let mut json = vec![0u8; usize::try_from(n).ok()?];
        file.read_exact_at(&mut json, 8).ok()?;
        let serde_json::Value::Object(map) = serde_json::from_slice(&json).ok()? else {
            return None;
        };
        Some((end, map))
    };
    let Some((data, map)) = header() else {
        return HashMap::new();
    };
    let file_len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let shared = Arc::new(path.to_path_buf());
    let named = map
        .into_iter()
        .filter(|(key, _)| key != "__metadata__")
        .filter_map(|(key, entry)| {
            if entry.get("dtype")?.as_str()? != "F32" {
                return None;
            }
            let offsets = entry.get("data_offsets")?.as_array()?;
            let (a, b) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
            let offset = data.checked_add(a)?;
            let len = b.checked_sub(a)?;
            (offset.checked_add(len)? <= file_len && len % 4 == 0).then_some(())?;
            let stored = Stored::Safetensors {
                path: shared.clone(),
                key: key.clone(),
                offset,
                len: usize::try_from(len).ok()?,
            };
            Some((key, stored))
        })
        .collect();
    renamed(&remap, named)
}
