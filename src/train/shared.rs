//! What the training modes share, below all of them: the collective
//! timeout, the epoch's learning rate, and the per-worker test hooks (the loss and metrics of a
//! batch are [`super::objective`]). No mode imports a
//! helper from a sibling mode; what two need lives here (or in [`super::epochs`]).

use std::time::Duration;

use super::TrainConfig;
use crate::Result;
use crate::schedule::Schedule;

/// The first `count` length-prefixed parts of `bytes` (each a little-endian u64 byte count,
/// then that many bytes), for the states ranks send each other; `what` names the state in the
/// error. An announced length is checked against the bytes there before any arithmetic.
pub(crate) fn prefixed_parts<'a>(
    bytes: &'a [u8],
    count: usize,
    what: &str,
) -> Result<Vec<&'a [u8]>> {
    let bad = |m: String| crate::HearthError::Training(format!("{what}: {m}"));
    let mut parts = Vec::with_capacity(count);
    let mut at = 0usize;
    for _ in 0..count {
        let len = bytes
            .get(at..)
            .and_then(|rest| rest.get(..8))
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .ok_or_else(|| bad("truncated".into()))?;
        let left = bytes.len() - (at + 8);
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len <= left)
            .ok_or_else(|| bad(format!("truncated: {len} bytes announced, {left} left")))?;
        parts.push(&bytes[at + 8..at + 8 + len]);
        at += 8 + len;
    }
    Ok(parts)
}

/// Most bytes of skipped-image lines one rank sends for the summary (about 20,000 paths);
/// below 2^24, so their count travels exactly as an `f32`.
const MAX_LINES_BYTES: usize = 4 << 20;

/// `lines` as bytes for another rank: a count, then each line length-prefixed (cut to 4,000
/// bytes), stopping at [`MAX_LINES_BYTES`] with a line saying how many were left out.
pub(crate) fn encode_lines(lines: &[String]) -> Vec<u8> {
    let mut kept: Vec<String> = Vec::new();
    let mut size = 8;
    for (i, l) in lines.iter().enumerate() {
        let mut l = l.clone();
        if l.len() > 4000 {
            let mut cut = 4000;
            while !l.is_char_boundary(cut) {
                cut -= 1;
            }
            l.truncate(cut);
        }
        if size + 8 + l.len() > MAX_LINES_BYTES - 128 {
            kept.push(format!("... and {} more", lines.len() - i));
            break;
        }
        size += 8 + l.len();
        kept.push(l);
    }
    let mut w = burn_dist::wire::Writer::default().u64(kept.len() as u64);
    for l in &kept {
        w = w.string(l);
    }
    w.bytes
}

/// The lines [`encode_lines`] wrote, or an error naming what was wrong.
pub(crate) fn decode_lines(b: &[u8]) -> std::result::Result<Vec<String>, String> {
    let mut r = burn_dist::wire::Reader::new(b);
    let n = r.u64().map_err(|e| e.to_string())?;
    if n > (MAX_LINES_BYTES / 8) as u64 {
        return Err(format!("{n} lines"));
    }
    let lines = (0..n)
        .map(|_| r.string().map_err(|e| e.to_string()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    r.finish().map_err(|e| e.to_string())?;
    Ok(lines)
}

/// Every rank's `mine` on rank 0, in rank order, each line once (a file every rank reads is
/// reported by each); other ranks get their own back. Every rank of `comm` calls it.
pub(crate) fn gather_lines(comm: &burn_dist::Communicator, mine: &[String]) -> Result<Vec<String>> {
    if comm.world() == 1 {
        return Ok(mine.to_vec());
    }
    let bytes = encode_lines(mine);
    let words: Vec<f32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect();
    let lens = comm.all_gather(&[bytes.len() as f32])?;
    let lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
    let mut bounds = vec![0usize];
    for l in &lens {
        bounds.push(bounds[bounds.len() - 1] + l.div_ceil(4));
    }
    let Some(whole) = comm.gather_to(0, &words, &bounds)? else {
        return Ok(mine.to_vec());
    };
    let mut out: Vec<String> = Vec::new();
    for (r, len) in lens.iter().enumerate() {
        let mut b: Vec<u8> = whole[bounds[r]..bounds[r + 1]]
            .iter()
            .flat_map(|w| w.to_bits().to_le_bytes())
            .collect();
        b.truncate(*len);
        match decode_lines(&b) {
            Ok(lines) => {
                for l in lines {
                    if !out.contains(&l) {
                        out.push(l);
                    }
                }
            }
            Err(e) => out.push(format!("(rank {r}'s list could not be read: {e})")),
        }
    }
    Ok(out)
}

/// The most bytes of training state a rank takes from rank 0 for a model of `params`
/// parameters: the weights, up to three optimizer slots per weight and the records' own
/// framing, with room to spare; a larger announcement is refused before anything is
/// allocated for it.
pub(crate) fn state_limit(params: usize) -> usize {
    params.saturating_mul(4 * 8).saturating_add(256 << 20)
}

/// What a run with `--overlap` says when every rank of `comm`'s world is on this host (the
/// exchange then runs through shared memory on the cores the backward uses): `None` otherwise.
pub(super) fn one_host_overlap_notice(comm: &burn_dist::Communicator) -> Option<&'static str> {
    comm.transport()
        .topology()
        .is_some_and(|t| t.shares_memory() && t.group_leaders().len() == 1)
        .then_some(
            "`exchange.overlap`: every rank is on this host, so the exchange runs through shared memory \
             on the cores the backward pass uses; on one host it measured no faster (a ResNet-50 \
             step 1.02-1.08x longer, BENCHMARKS.md): it pays off between hosts",
        )
}

/// The line every mode prints when the fine-tuning phase starts after epoch `after`, at base
/// rate `lr` (`--finetune-lr`).
pub(super) fn unfreeze_line(after: usize, lr: f64) -> String {
    format!("unfreezing the backbone after epoch {after}: fine-tuning everything at lr {lr}")
}

/// The rate of every optimizer step and the transfer-learning phases, as one process runs
/// them: `--freeze-backbone` trains only the head; `--unfreeze-after N` then fine-tunes
/// everything from epoch N + 1 at `--finetune-lr` (default a tenth of the rate), each phase's
/// schedule taken at the run's optimizer step.
pub(super) struct Rates {
    lr: Schedule,
    finetune: Option<Schedule>,
    /// The two phases' base rates (the fine-tuning one only with `--unfreeze-after`).
    bases: (f64, f64),
    freeze_backbone: bool,
    unfreeze_after: Option<usize>,
}

impl Rates {
    /// `lr`: the run's rate after `--scale-lr`; `batches`: loader batches per epoch.
    pub fn new(cfg: &TrainConfig, lr: f64, batches: usize) -> Result<Self> {
        let unfreeze_after = cfg
            .model
            .unfreeze_after
            .filter(|_| cfg.model.freeze_backbone);
        let finetune_lr = cfg.model.finetune_lr.unwrap_or(lr / 10.0);
        Ok(Self {
            lr: cfg.lr_schedule(lr, batches)?,
            finetune: match unfreeze_after {
                Some(_) => Some(cfg.lr_schedule(finetune_lr, batches)?),
                None => None,
            },
            bases: (lr, finetune_lr),
            freeze_backbone: cfg.model.freeze_backbone,
            unfreeze_after,
        })
    }

    /// Whether epoch `epoch` (from 1) belongs to the fine-tuning phase.
    pub fn fine_tuning(&self, epoch: usize) -> bool {
        self.finetune.is_some() && self.unfreeze_after.is_some_and(|n| epoch > n)
    }

    /// Whether the backbone is frozen in epoch `epoch` (from 1).
    pub fn frozen(&self, epoch: usize) -> bool {
        self.freeze_backbone && !self.fine_tuning(epoch)
    }

    /// The base rate of epoch `epoch`'s phase (its schedule's peak).
    pub fn base(&self, epoch: usize) -> f64 {
        if self.fine_tuning(epoch) {
            self.bases.1
        } else {
            self.bases.0
        }
    }

    /// The line every mode prints when the fine-tuning phase starts after epoch `after`.
    pub fn unfreeze_line(&self, after: usize) -> String {
        unfreeze_line(after, self.bases.1)
    }

    /// The rate of the run's optimizer step `step` (from 0), taken in epoch `epoch`.
    pub fn rate(&self, epoch: usize, step: usize) -> f64 {
        match (&self.finetune, self.fine_tuning(epoch)) {
            (Some(f), true) => f.lr_at(step),
            _ => self.lr.lr_at(step),
        }
    }
}

/// How long a rank waits for a peer in a collective or a pipeline neighbour
/// (`HEARTH_COLLECTIVE_TIMEOUT`, default 120 s); a peer that dies is reported sooner by the
/// transport.
pub(super) fn collective_timeout() -> Duration {
    burn_dist::env::collective_timeout()
}

/// `train_lr` of `epoch` as burn-train writes it, for every mode to write the same: the mean
/// over the epoch's `batches` of the rate of the latest optimizer step taken at or before each
/// batch (`lr_at(i)`: the rate of the run's optimizer step `i`, counted from 0; with
/// `--grad-accum K`, a step on every K-th batch and on the last; before the run's first step,
/// 0). Without accumulation: the mean rate of the epoch's steps.
pub(super) fn epoch_lr(
    lr_at: impl Fn(usize) -> f64,
    epoch: usize,
    batches: usize,
    k: usize,
) -> f64 {
    let k = k.max(1);
    let batches = batches.max(1);
    let first = (epoch.max(1) - 1) * batches.div_ceil(k);
    let sum: f64 = (0..batches)
        .map(|b| {
            let taken = (b + 1) / k + usize::from(b + 1 == batches && (b + 1) % k != 0);
            match (taken, first) {
                (0, 0) => 0.0,
                (0, _) => lr_at(first - 1),
                (t, _) => lr_at(first + t - 1),
            }
        })
        .sum();
    sum / batches as f64
}

/// `rank`'s part of a validation set of `n` examples validated by `world` ranks together:
/// every `world`-th example from `rank`, in batches of its share of the global `batch`.
pub(crate) fn val_share(n: usize, rank: usize, world: usize, batch: usize) -> Vec<Vec<usize>> {
    let world = world.max(1);
    let per = (batch / world).max(1);
    let mine: Vec<usize> = (rank..n).step_by(world).collect();
    mine.chunks(per).map(<[usize]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::{epoch_lr, prefixed_parts};

    #[test]
    fn prefixed_parts_round_trip_and_any_bytes_decode_without_a_panic() {
        let mut state = Vec::new();
        for part in [&b"meta"[..], &[1u8; 20][..], &[][..]] {
            state.extend_from_slice(&(part.len() as u64).to_le_bytes());
            state.extend_from_slice(part);
        }
        let parts = prefixed_parts(&state, 3, "test state").unwrap();
        assert_eq!(parts, [&b"meta"[..], &[1u8; 20][..], &[][..]]);
        let e = prefixed_parts(&state[..20], 3, "test state").unwrap_err();
        assert!(e.to_string().contains("test state: truncated"), "{e}");
        let mut rng = burn_dist::fuzz::Rng::new(21);
        let mut refused = 0;
        for input in burn_dist::fuzz::inputs(&[state], 20_000, &mut rng) {
            refused += usize::from(prefixed_parts(&input, 3, "fuzzed").is_err());
        }
        assert!(refused > 5_000, "{refused}");
    }

    #[test]
    fn the_epoch_rate_is_burn_trains_per_batch_mean() {
        let lr = |i: usize| (i + 1) as f64;
        // One step per batch: the mean of the epoch's steps (epoch 2: steps 4..8).
        assert_eq!(epoch_lr(lr, 2, 4, 1), (5.0 + 6.0 + 7.0 + 8.0) / 4.0);
        // K = 3 over 4 batches: steps after batches 3 and 4; batches 1-2 see no step in
        // epoch 1 (0), and the previous epoch's last step in epoch 2.
        assert_eq!(epoch_lr(lr, 1, 4, 3), (0.0 + 0.0 + 1.0 + 2.0) / 4.0);
        assert_eq!(epoch_lr(lr, 2, 4, 3), (2.0 + 2.0 + 3.0 + 4.0) / 4.0);
    }
}
