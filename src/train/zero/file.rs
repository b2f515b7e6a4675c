//! The sharded optimizer state on disk: `optim-zero-<epoch>.safetensors`, written from every
//! rank's shard and read back piece by piece (its header checked whole first), below the
//! sharding that saves and loads it.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use burn_dist::zero::module::{StateStore, StateWriter};
use burn_dist::zero::{StateLayout, WholeState};
use safetensors::tensor::{Dtype, View};

use crate::{HearthError, Result};

/// The format's name in a file's metadata.
const FORMAT: &str = "hearth-zero-1";

/// `dir/optim-zero-<epoch>.safetensors`; `dir` is the run's `checkpoint/` folder (data
/// parallel) or a pipeline stage's (`checkpoint/stage-<s>/`).
pub fn state_file(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("optim-zero-{epoch}.safetensors"))
}

/// Epochs with a sharded optimizer state in the checkpoint folder `dir`.
pub(super) fn state_epochs(dir: &Path) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix("optim-zero-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect()
}

/// The sharded states of a checkpoint folder.
pub(super) struct Files {
    pub(super) dir: PathBuf,
}

/// One tensor's part of one slot, as safetensors writes it (no copy on little-endian hosts).
pub(super) struct Part<'a>(pub(super) &'a [f32], pub(super) [usize; 1]);

impl View for Part<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn data(&self) -> Cow<'_, [u8]> {
        #[cfg(target_endian = "little")]
        {
            // SAFETY: any initialised memory reads as bytes; the length is the slice's.
            Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 4)
            })
        }
        #[cfg(not(target_endian = "little"))]
        {
            Cow::Owned(self.0.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    }
    fn data_len(&self) -> usize {
        self.0.len() * 4
    }
}

/// A state file being written: the safetensors header first (every tensor's offsets are
/// known from the layout), then the values as they arrive, a bucket at a time, into a temporary
/// file renamed over the epoch's at the end (a crash leaves the old file or the new one).
struct FileWriter {
    out: std::io::BufWriter<std::fs::File>,
    tmp: PathBuf,
    path: PathBuf,
    dir: PathBuf,
    epoch: usize,
    /// Values still expected.
    left: usize,
}

impl Files {
    fn start(&self, epoch: usize, layout: &StateLayout) -> Result<FileWriter> {
        use std::io::Write;
        let path = state_file(&self.dir, epoch);
        let fail = |e: String| HearthError::Checkpoint(format!("{}: {e}", path.display()));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let tensors: Vec<(&str, usize)> = layout
            .tensors
            .iter()
            .map(|(n, l)| (n.as_str(), *l))
            .collect();
        let mut header = serde_json::Map::new();
        let mut meta = serde_json::json!({
            "format": FORMAT,
            "updates": layout.updates.to_string(),
            "tensors": serde_json::json!(tensors).to_string(),
            "slots": serde_json::json!(layout.slots).to_string(),
        });
        if !layout.born.is_empty() {
            // Adam's per-tensor counts after a fine-tuning switch (absent: all 0).
            meta["born"] = serde_json::json!(layout.born).to_string().into();
        }
        header.insert("__metadata__".into(), meta);
        let mut at = 0usize;
        for slot in &layout.slots {
            for (name, len) in &layout.tensors {
                header.insert(
                    format!("{name}.{slot}"),
                    serde_json::json!({"dtype": "F32", "shape": [len], "data_offsets": [at, at + 4 * len]}),
                );
                at += 4 * len;
            }
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        // safetensors pads the header with spaces to a multiple of 8 bytes.
        text.resize(text.len().next_multiple_of(8), b' ');
        let tmp = path.with_file_name(format!(".optim-zero-{epoch}.safetensors.tmp"));
        let file = std::fs::File::create(&tmp).map_err(|e| fail(e.to_string()))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&text))
            .map_err(|e| fail(e.to_string()))?;
        Ok(FileWriter {
            out,
            tmp,
            path,
            dir: self.dir.clone(),
            epoch,
            left: at / 4,
        })
    }

    /// The whole of `state` as epoch `epoch`'s file (the tests; runs stream it).
    #[cfg(test)]
    pub(super) fn write(&self, epoch: usize, state: &WholeState) -> Result<()> {
        let layout = StateLayout {
            tensors: state.tensors.clone(),
            updates: state.updates,
            slots: state.slots.iter().map(|s| s.0.clone()).collect(),
            born: state.born.clone(),
        };
        let mut w = self.start(epoch, &layout)?;
        for (_, values) in &state.slots {
            w.put(values)?;
        }
        w.done()
    }
}

impl FileWriter {
    fn fail(&self, e: impl std::fmt::Display) -> HearthError {
        HearthError::Checkpoint(format!("{}: {e}", self.path.display()))
    }

    fn put(&mut self, values: &[f32]) -> Result<()> {
        use std::io::Write;
        if values.len() > self.left {
            return Err(self.fail(format!(
                "{} more values than the layout holds",
                values.len() - self.left
            )));
        }
        self.left -= values.len();
        // Little-endian hosts write the values' own bytes (no copy).
        let part = Part(values, [values.len()]);
        let written = self.out.write_all(&part.data());
        written.map_err(|e| self.fail(e))
    }

    fn done(self) -> Result<()> {
        use std::io::Write;
        if self.left != 0 {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(self.fail(format!("{} values never arrived", self.left)));
        }
        let FileWriter {
            mut out,
            tmp,
            path,
            dir,
            epoch,
            ..
        } = self;
        let fail = |e: String| HearthError::Checkpoint(format!("{}: {e}", path.display()));
        out.flush().map_err(|e| fail(e.to_string()))?;
        drop(out);
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            fail(e.to_string())
        })?;
        // The previous epoch's stays until this epoch's burn-train files are complete.
        for old in state_epochs(&dir) {
            if old + 1 < epoch {
                let _ = std::fs::remove_file(state_file(&dir, old));
            }
        }
        Ok(())
    }
}

impl StateWriter for FileWriter {
    fn write(&mut self, values: &[f32]) -> std::result::Result<(), String> {
        self.put(values).map_err(|e| e.to_string())
    }
    fn finish(self: Box<Self>) -> std::result::Result<(), String> {
        self.done().map_err(|e| e.to_string())
    }
}

/// Streams `zero`'s state into epoch `epoch`'s file of the checkpoint folder `dir` (every rank
/// of `comm` calls it; its rank 0 writes, holding one bucket of it at a time).
pub(crate) fn save_state(
    dir: &Path,
    epoch: usize,
    zero: &burn_dist::zero::ZeroOptimizer,
    comm: &burn_dist::Communicator,
) -> Result<()> {
    let files = Files {
        dir: dir.to_path_buf(),
    };
    Ok(burn_dist::zero::module::save_sharded_state(
        zero, comm, &files, epoch,
    )?)
}

/// A state file opened for reading piece by piece: its header checked whole up front (every
/// tensor present, f32, of its length, inside the file), then values read where they lie.
pub struct StateFile {
    file: std::fs::File,
    path: PathBuf,
    tensors: Vec<(String, usize)>,
    updates: u64,
    slots: Vec<String>,
    /// Per slot, per tensor: the byte offset of its values in the file.
    at: Vec<Vec<u64>>,
    /// Per tensor: the update count when it joined (empty: all 0).
    born: Vec<u64>,
}

/// The longest header a state file may have (names and offsets of every tensor and slot).
const MAX_HEADER: u64 = 256 << 20;

/// Opens the state in `path` (`optim-zero-<epoch>.safetensors`); every way it can be wrong is
/// an error naming the file and what is wrong.
pub fn open_state(path: &Path) -> Result<StateFile> {
    use std::io::Read;
    let bad = |what: String| HearthError::Checkpoint(format!("{}: {what}", path.display()));
    let read_err = |source| HearthError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_err)?;
    let size = file.metadata().map_err(read_err)?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad("not a safetensors file (shorter than its header)".into()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > size {
        return Err(bad(format!(
            "not a safetensors file (a {n}-byte header in {size} bytes)"
        )));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact(&mut text)
        .map_err(|e| bad(format!("reading the header: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let meta = header
        .get("__metadata__")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no metadata (not written by a run with `exchange.zero`)".into()))?;
    let field = |k: &str| {
        meta.get(k)
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad(format!("metadata has no {k:?}")))
    };
    if field("format")? != FORMAT {
        return Err(bad(format!(
            "format {:?}, expected {FORMAT:?}",
            field("format")?
        )));
    }
    let updates: u64 = field("updates")?
        .parse()
        .map_err(|_| bad("updates is not a count".into()))?;
    let tensors: Vec<(String, usize)> =
        serde_json::from_str(field("tensors")?).map_err(|e| bad(format!("tensors: {e}")))?;
    let slots: Vec<String> =
        serde_json::from_str(field("slots")?).map_err(|e| bad(format!("slots: {e}")))?;
    let born: Vec<u64> = match meta.get("born").and_then(|v| v.as_str()) {
        Some(text) => serde_json::from_str(text).map_err(|e| bad(format!("born: {e}")))?,
        None => Vec::new(),
    };
    if !born.is_empty() && born.len() != tensors.len() {
        return Err(bad(format!(
            "born lists {} tensors, the file holds {}",
            born.len(),
            tensors.len()
        )));
    }
    let data = 8 + n;
    let mut at = Vec::with_capacity(slots.len());
    for slot in &slots {
        let mut offsets = Vec::with_capacity(tensors.len());
        for (name, len) in &tensors {
            let key = format!("{name}.{slot}");
            offsets.push(tensor_offset(&header, &key, *len, data, size, &bad)?);
        }
        at.push(offsets);
    }
    Ok(StateFile {
        file,
        path: path.to_path_buf(),
        tensors,
        updates,
        slots,
        at,
        born,
    })
}

/// Where tensor `key` (`len` f32 values) starts in a state file of `size` bytes whose data
/// begins at `data`, checked against its header entry.
fn tensor_offset(
    header: &serde_json::Map<String, serde_json::Value>,
    key: &str,
    len: usize,
    data: u64,
    size: u64,
    bad: &dyn Fn(String) -> HearthError,
) -> Result<u64> {
    let t = header
        .get(key)
        .ok_or_else(|| bad(format!("{key} is missing")))?;
    let dtype = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("?");
    let shape: Vec<u64> = t
        .get("shape")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .unwrap_or_default();
    let span: Vec<u64> = t
        .get("data_offsets")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .unwrap_or_default();
    if dtype != "F32" || shape != [len as u64] {
        return Err(bad(format!(
            "{key} is {dtype} {shape:?}, expected F32 [{len}]"
        )));
    }
    let fits = span.len() == 2
        && span[1] >= span[0]
        && span[1] - span[0] == 4 * len as u64
        && data + span[1] <= size;
    if !fits {
        return Err(bad(format!(
            "{key}'s values {span:?} do not fit the file ({size} bytes)"
        )));
    }
    Ok(data + span[0])
}

impl burn_dist::zero::StateReader for StateFile {
    fn tensors(&self) -> &[(String, usize)] {
        &self.tensors
    }

    fn updates(&self) -> u64 {
        self.updates
    }

    fn slot_names(&self) -> Vec<String> {
        self.slots.clone()
    }

    fn born(&self) -> Vec<u64> {
        self.born.clone()
    }

    fn read(
        &mut self,
        slot: usize,
        range: std::ops::Range<usize>,
    ) -> std::result::Result<Vec<f32>, String> {
        use std::io::{Read, Seek, SeekFrom};
        let offsets = self
            .at
            .get(slot)
            .ok_or_else(|| format!("{}: no slot {slot}", self.path.display()))?;
        let mut out = Vec::with_capacity(range.len());
        let mut bytes = Vec::new();
        let mut start = 0usize;
        for ((_, len), &at) in self.tensors.iter().zip(offsets) {
            let (from, to) = (range.start.max(start), range.end.min(start + len));
            if from < to {
                bytes.resize(4 * (to - from), 0);
                self.file
                    .seek(SeekFrom::Start(at + 4 * (from - start) as u64))
                    .and_then(|_| self.file.read_exact(&mut bytes))
                    .map_err(|e| format!("{}: {e}", self.path.display()))?;
                out.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            start += len;
            if start >= range.end {
                break;
            }
        }
        if out.len() != range.len() {
            return Err(format!(
                "{}: values {range:?} of {} lie outside its tensors",
                self.path.display(),
                self.slots[slot]
            ));
        }
        Ok(out)
    }
}

/// The whole state in `path`, in memory (the tests and small tools; runs read it a bucket at
/// a time through [`open_state`]).
pub fn read_state(path: &Path) -> Result<WholeState> {
    use burn_dist::zero::StateReader;
    let mut f = open_state(path)?;
    let total: usize = f.tensors.iter().map(|t| t.1).sum();
    let mut slots = Vec::with_capacity(f.slots.len());
    for (i, name) in f.slot_names().into_iter().enumerate() {
        let values = f.read(i, 0..total).map_err(HearthError::Checkpoint)?;
        slots.push((name, values));
    }
    Ok(WholeState {
        tensors: f.tensors.clone(),
        updates: f.updates,
        slots,
        born: f.born.clone(),
    })
}

impl StateStore for Files {
    fn writer(
        &self,
        epoch: usize,
        layout: &StateLayout,
    ) -> std::result::Result<Box<dyn StateWriter>, String> {
        self.start(epoch, layout)
            .map(|w| Box::new(w) as Box<dyn StateWriter>)
            .map_err(|e| e.to_string())
    }

    fn load(
        &self,
        epoch: usize,
    ) -> std::result::Result<Box<dyn burn_dist::zero::StateReader>, String> {
        open_state(&state_file(&self.dir, epoch))
            .map(|f| Box::new(f) as Box<dyn burn_dist::zero::StateReader>)
            .map_err(|e| e.to_string())
    }
}
