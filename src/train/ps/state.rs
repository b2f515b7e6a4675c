//! What the parameter-server mode writes and sends as bytes: `checkpoint/ps.state` (every
//! shard's state at one consistent cut, after an epoch) and a worker's per-epoch statistics.

use std::path::{Path, PathBuf};

use burn_dist::flat::layout::Layout;
use burn_dist::ps::message::ShardState;
use burn_dist::wire::{Reader, Writer};

use crate::train::scores::ValScores;
use crate::{HearthError, Result};

const MAGIC: &str = "hearth-ps-state-1";

/// The servers' state after `epoch`, one entry per shard.
#[derive(Debug, Clone, PartialEq)]
pub struct PsState {
    pub epoch: usize,
    pub shards: Vec<ShardState>,
}

pub fn state_file(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoint").join("ps.state")
}

impl PsState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default()
            .string(MAGIC)
            .u64(self.epoch as u64)
            .u64(self.shards.len() as u64)
            .bytes;
        for s in &self.shards {
            let b = s.encode();
            w.extend((b.len() as u64).to_le_bytes());
            w.extend(b);
        }
        w
    }

    pub fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        let mut r = Reader::new(b);
        let magic = r.string().map_err(|e| e.to_string())?;
        if magic != MAGIC {
            return Err(format!("not a parameter-server state ({magic:?})"));
        }
        let epoch = r.u64().map_err(|e| e.to_string())? as usize;
        let n = r.u64().map_err(|e| e.to_string())?;
        if n > 1 << 16 {
            return Err(format!("{n} shards"));
        }
        let mut rest = r.rest();
        let mut shards = Vec::new();
        for i in 0..n {
            if rest.len() < 8 {
                return Err(format!("truncated before shard {i}"));
            }
            let (len, tail) = rest.split_at(8);
            let mut a = [0u8; 8];
            a.copy_from_slice(len);
            let len = u64::from_le_bytes(a) as usize;
            if tail.len() < len {
                return Err(format!(
                    "shard {i} truncated: {} of {len} bytes",
                    tail.len()
                ));
            }
            let (body, tail) = tail.split_at(len);
            shards.push(ShardState::decode(body, None).map_err(|e| format!("shard {i}: {e}"))?);
            rest = tail;
        }
        if !rest.is_empty() {
            return Err(format!("{} trailing bytes", rest.len()));
        }
        Ok(Self { epoch, shards })
    }

    /// Writes atomically (a temporary file, then a rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let write = |source| HearthError::Write {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(write)?;
        }
        let tmp = path.with_extension("state.tmp");
        std::fs::write(&tmp, self.encode()).map_err(write)?;
        std::fs::rename(&tmp, path).map_err(write)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| HearthError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::decode(&bytes)
            .map_err(|e| HearthError::Training(format!("{} is damaged: {e}", path.display())))
    }
}

/// One worker's epoch: training loss × samples, correct predictions, samples, seconds spent
/// waiting for the servers, seconds since the start when the epoch ended, and the epoch's own
/// seconds (its training, waits included).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpochStats {
    pub epoch: usize,
    pub loss_sum: f64,
    pub correct: f64,
    pub samples: f64,
    pub wait: f64,
    pub elapsed: f64,
    /// Bytes this worker sent to and received from the servers so far.
    pub bytes: f64,
    /// Steps this worker skipped for non-finite fp16 gradients.
    pub skipped: f64,
    pub seconds: f64,
    /// Samples with their class among the 5 highest scores (0 where top-5 does not apply;
    /// NaN when read from a worker's stats written before top-5 was counted).
    pub top5: f64,
}

impl EpochStats {
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.samples.max(1.0)
    }
    pub fn accuracy(&self) -> f64 {
        100.0 * self.correct / self.samples.max(1.0)
    }
}

/// A multi-label run's training outputs of each epoch on one worker, for the lead's
/// `train_auroc` over every worker's.
pub(crate) fn encode_scores(epochs: &[(usize, ValScores)]) -> Vec<u8> {
    let mut w = Writer::default().u64(epochs.len() as u64);
    for (epoch, s) in epochs {
        w = w.u64(*epoch as u64).blob(&s.encode());
    }
    w.bytes
}

pub(crate) fn decode_scores(b: &[u8]) -> Result<Vec<(usize, ValScores)>> {
    let bad = |m: String| HearthError::Training(format!("a worker's training outputs: {m}"));
    let mut r = Reader::new(b);
    let n = r.u64().map_err(|e| bad(e.to_string()))?;
    if n > 1 << 20 {
        return Err(bad(format!("{n} epochs")));
    }
    let mut out = Vec::new();
    for _ in 0..n {
        let epoch = r.u64().map_err(|e| bad(e.to_string()))? as usize;
        let blob = r.blob().map_err(|e| bad(e.to_string()))?;
        out.push((
            epoch,
            ValScores::decode(blob, "a worker's training outputs")?,
        ));
    }
    r.finish().map_err(|e| bad(e.to_string()))?;
    Ok(out)
}

pub fn encode_stats(rows: &[EpochStats]) -> Vec<u8> {
    let mut w = Writer::default().u64(rows.len() as u64);
    for r in rows {
        w = w.u64(r.epoch as u64);
        for v in [
            r.loss_sum, r.correct, r.samples, r.wait, r.elapsed, r.bytes, r.skipped, r.seconds,
        ] {
            w = w.u64(v.to_bits());
        }
    }
    // Top-5 after every row: stats written before it was counted end before it.
    for r in rows {
        w = w.u64(r.top5.to_bits());
    }
    w.bytes
}

pub fn decode_stats(b: &[u8]) -> std::result::Result<Vec<EpochStats>, String> {
    let mut r = Reader::new(b);
    let n = r.u64().map_err(|e| e.to_string())?;
    if n > 1 << 20 {
        return Err(format!("{n} epochs"));
    }
    let mut out = Vec::new();
    for _ in 0..n {
        let epoch = r.u64().map_err(|e| e.to_string())? as usize;
        let mut f = [0f64; 8];
        for v in &mut f {
            *v = f64::from_bits(r.u64().map_err(|e| e.to_string())?);
        }
        out.push(EpochStats {
            epoch,
            loss_sum: f[0],
            correct: f[1],
            samples: f[2],
            wait: f[3],
            elapsed: f[4],
            bytes: f[5],
            skipped: f[6],
            seconds: f[7],
            top5: f64::NAN,
        });
    }
    let top5 = r.rest();
    if !top5.is_empty() {
        if top5.len() != 8 * out.len() {
            return Err(format!(
                "{} bytes of top-5 counts for {} epochs",
                top5.len(),
                out.len()
            ));
        }
        for (s, b) in out.iter_mut().zip(top5.chunks_exact(8)) {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            s.top5 = f64::from_bits(u64::from_le_bytes(a));
        }
    }
    Ok(out)
}

/// `shards` (a checkpoint's, written by another number of servers) cut anew for `layout`:
/// the same flat vector of `tensors`, each value with its optimizer state, at the new servers'
/// ranges. Shards of one consistent cut hold the same version (the updates applied); where
/// they differ, the new shards take the largest.
pub(super) fn reshard(
    shards: &[ShardState],
    layout: &Layout,
    tensors: &[(String, usize)],
) -> std::result::Result<Vec<ShardState>, String> {
    let mut values = Vec::with_capacity(layout.total());
    let mut old_ranges = Vec::with_capacity(shards.len());
    for s in shards {
        old_ranges.push(values.len()..values.len() + s.values.len());
        values.extend_from_slice(&s.values);
    }
    let new_ranges: Vec<std::ops::Range<usize>> =
        (0..layout.servers()).map(|i| layout.range(i)).collect();
    let optim = reshard_optim_state(
        Sharding {
            tensors,
            ranges: &old_ranges,
        },
        shards,
        Sharding {
            tensors,
            ranges: &new_ranges,
        },
    );
    let had_state = shards.iter().any(|s| !s.optim_state.is_empty());
    if had_state && optim.iter().all(Vec::is_empty) {
        return Err(format!(
            "the optimizer state of its {} shards does not fit their values",
            shards.len()
        ));
    }
    let version = shards.iter().map(|s| s.version).max().unwrap_or(0);
    Ok(new_ranges
        .into_iter()
        .zip(optim)
        .map(|(r, optim_state)| ShardState {
            version,
            values: values[r].to_vec(),
            optim_state,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_and_stats_round_trip_and_damage_is_named() {
        let s = PsState {
            epoch: 3,
            shards: vec![
                ShardState {
                    version: 7,
                    values: vec![1.0, 2.0],
                    optim_state: vec![0.1, 0.2],
                },
                ShardState {
                    version: 7,
                    values: vec![3.0],
                    optim_state: Vec::new(),
                },
            ],
        };
        assert_eq!(PsState::decode(&s.encode()).unwrap(), s);
        let b = s.encode();
        for cut in [0, 10, b.len() - 1] {
            assert!(PsState::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let dir = std::env::temp_dir().join(format!("hearth-ps-state-{}", std::process::id()));
        let path = state_file(&dir);
        s.save(&path).unwrap();
        assert_eq!(PsState::load(&path).unwrap(), s);
        std::fs::write(&path, &b[..b.len() - 3]).unwrap();
        let e = PsState::load(&path).unwrap_err().to_string();
        assert!(e.contains("ps.state is damaged"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        let rows = vec![EpochStats {
            epoch: 1,
            loss_sum: 2.0,
            correct: 3.0,
            samples: 4.0,
            wait: 0.5,
            elapsed: 9.0,
            bytes: 1e6,
            skipped: 2.0,
            seconds: 3.5,
            top5: 4.0,
        }];
        let b = encode_stats(&rows);
        assert_eq!(decode_stats(&b).unwrap(), rows);
        assert!(decode_stats(&b[..20]).is_err());
        // Stats written before top-5 was counted read with an unknown top-5; a cut count is
        // damage.
        let old = decode_stats(&b[..b.len() - 8]).unwrap();
        assert!(old[0].top5.is_nan() && old[0].seconds == 3.5, "{old:?}");
        let e = decode_stats(&b[..b.len() - 3]).unwrap_err();
        assert!(e.contains("top-5 counts"), "{e}");
    }
}

/// Trainable tensors (name, values) in flat order, and the shards' ranges of that vector.
#[derive(Clone, Copy)]
pub(super) struct Sharding<'a> {
    pub tensors: &'a [(String, usize)],
    pub ranges: &'a [std::ops::Range<usize>],
}

/// The servers' optimizer state re-sharded for a new set of trainable tensors (the fine-tuning
/// phase after `--unfreeze-after`): each shard's state is `k` arrays over its values (momentum;
/// or Adam's two moments); a tensor trained before keeps its state at its new place, a tensor
/// new to training starts at zero (SGD's first step from a zero buffer is its first step from
/// none). `old` before, with each shard's `states`; `new` after. Returns each new shard's
/// state (all empty when the old states are empty or do not fit).
pub(super) fn reshard_optim_state(
    old: Sharding,
    states: &[ShardState],
    new: Sharding,
) -> Vec<Vec<f32>> {
    let (old_tensors, old_ranges) = (old.tensors, old.ranges);
    let (new_tensors, new_ranges) = (new.tensors, new.ranges);
    let empty = || vec![Vec::new(); new_ranges.len()];
    let old_total: usize = old_tensors.iter().map(|t| t.1).sum();
    let new_total: usize = new_tensors.iter().map(|t| t.1).sum();
    let Some(first) = states.first() else {
        return empty();
    };
    let k = first.optim_state.len() / first.values.len().max(1);
    let fits = k > 0
        && states.len() == old_ranges.len()
        && states
            .iter()
            .zip(old_ranges)
            .all(|(s, r)| s.values.len() == r.len() && s.optim_state.len() == k * r.len());
    if !fits {
        return empty();
    }
    // Each of the k arrays over the old flat vector, then over the new one.
    let mut new_arrays = vec![vec![0f32; new_total]; k];
    let mut old_arrays = vec![vec![0f32; old_total]; k];
    for (s, r) in states.iter().zip(old_ranges) {
        for (j, array) in old_arrays.iter_mut().enumerate() {
            array[r.clone()].copy_from_slice(&s.optim_state[j * r.len()..(j + 1) * r.len()]);
        }
    }
    let offsets = |tensors: &[(String, usize)]| {
        let mut at = 0;
        tensors
            .iter()
            .map(|(name, len)| {
                at += len;
                (name.clone(), (at - len, *len))
            })
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let new_at = offsets(new_tensors);
    for (name, (from, len)) in offsets(old_tensors) {
        if let Some(&(to, n)) = new_at.get(&name)
            && n == len
        {
            for (o, a) in old_arrays.iter().zip(new_arrays.iter_mut()) {
                a[to..to + len].copy_from_slice(&o[from..from + len]);
            }
        }
    }
    new_ranges
        .iter()
        .map(|r| {
            new_arrays
                .iter()
                .flat_map(|a| a[r.clone()].iter().copied())
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod reshard_tests {
    use super::*;

    #[test]
    fn a_head_keeps_its_state_and_a_new_tensor_starts_at_zero() {
        let t = |n: &str, l: usize| (n.to_string(), l);
        // Before: the head (fc.w 2, fc.b 1) on 2 shards, Adam (k = 2).
        let old_tensors = [t("fc.w", 2), t("fc.b", 1)];
        let old_ranges = [0..2, 2..3];
        let states = [
            ShardState {
                version: 4,
                values: vec![0.0; 2],
                optim_state: vec![1.0, 2.0, 10.0, 20.0],
            },
            ShardState {
                version: 4,
                values: vec![0.0; 1],
                optim_state: vec![3.0, 30.0],
            },
        ];
        // After: conv.w 3 in front, on 2 shards of 3.
        let new_tensors = [t("conv.w", 3), t("fc.w", 2), t("fc.b", 1)];
        let new_ranges = [0..3, 3..6];
        let old = Sharding {
            tensors: &old_tensors,
            ranges: &old_ranges,
        };
        let new = Sharding {
            tensors: &new_tensors,
            ranges: &new_ranges,
        };
        let out = reshard_optim_state(old, &states, new);
        assert_eq!(out[0], vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(out[1], vec![1.0, 2.0, 3.0, 10.0, 20.0, 30.0]);
        // No state (an asynchronous mode, or nothing stepped): none after.
        let bare: Vec<ShardState> = states
            .iter()
            .map(|s| ShardState {
                optim_state: Vec::new(),
                ..s.clone()
            })
            .collect();
        let out = reshard_optim_state(old, &bare, new);
        assert!(out.iter().all(Vec::is_empty));
    }
}
