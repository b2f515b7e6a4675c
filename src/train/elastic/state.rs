//! The committed state as bytes: what a new world's rank 0 sends its members, and
//! `checkpoint/elastic.state`.

use super::*;

/// A committed state as rank 0 sent or saved it.
pub(super) struct Decoded<M: Net> {
    pub members: Vec<Worker>,
    /// Rank 0's join address.
    pub join: String,
    pub commit: Commit<M>,
    pub health: Health,
    /// The launch it was sent in (empty in states written before fencing).
    pub launch: String,
}

impl<T: Trainee> ElasticRun<'_, T> {
    pub(super) fn encode(
        &self,
        c: &Commit<T::Model>,
        number: u32,
        members: &[Worker],
        join: &str,
    ) -> Result<Vec<u8>> {
        burn_dist::ddp::sync_running_stats(&c.model);
        let health = self.coordinator.health(Instant::now());
        let module = c
            .model
            .clone()
            .into_record()
            .into_bytes()
            .map_err(|e| HearthError::Training(format!("serialising the model: {e}")))?;
        let optim = c
            .optim
            .to_record()
            .into_bytes()
            .map_err(|e| HearthError::Training(format!("serialising the optimizer: {e}")))?;
        let rows: serde_json::Map<String, serde_json::Value> = c
            .rows
            .iter()
            .map(|(e, r)| (e.to_string(), serde_json::json!(r)))
            .collect();
        let meta = serde_json::json!({
            "number": number,
            "members": members.iter().map(|m| [m.id.clone(), m.host.clone()]).collect::<Vec<_>>(),
            "join": join,
            "step": c.step, "epoch": c.epoch, "position": c.position,
            "sums": c.sums, "elapsed": c.elapsed, "epoch_started": c.epoch_started,
            "start_unix": c.start_unix,
            "worker_seconds": c.worker_seconds,
            "world_log": c.world_log,
            "rows": rows,
            "finished": c.finished,
            "loss_scale": c.scaler.as_ref().map(LossScaler::to_json),
            "epoch_skipped": c.epoch_skipped,
            // --zero: the optimizer state is in checkpoint/elastic-zero/, not below.
            "zero": self.cfg.exchange.zero > 0,
            "launch": self.launch,
            // The coordinator's blacklist and failure counts, for whoever coordinates next.
            "health": {
                "failures": health.failures,
                "blacklist": health.blacklist,
            },
        })
        .to_string();
        // A multi-label epoch's training outputs so far (a fourth part: states from before
        // it have three, and their epoch's `train_auroc` covers the steps after them).
        let scores = c.train_scores.encode();
        // `optim.model_ema`'s average (a fifth part, empty without it).
        let average = Self::encode_average(c)?;
        let mut out = Vec::with_capacity(
            40 + meta.len() + module.len() + optim.len() + scores.len() + average.len(),
        );
        for part in [
            meta.as_bytes(),
            &module[..],
            &optim[..],
            &scores[..],
            &average[..],
        ] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(part);
        }
        Ok(out)
    }

    /// The members, rank 0's join address and the commit, the coordinator's [`Health`]
    /// (empty in states written before it was kept), and the launch.
    pub(super) fn decode(&self, bytes: &[u8]) -> Result<Decoded<T::Model>> {
        let bad = |m: String| HearthError::Training(format!("elastic state: {m}"));
        // States written before the training outputs (3 parts) and the average (4) still load.
        let parts = super::super::shared::prefixed_parts(bytes, 5, "elastic state")
            .or_else(|_| super::super::shared::prefixed_parts(bytes, 4, "elastic state"))
            .or_else(|_| super::super::shared::prefixed_parts(bytes, 3, "elastic state"))?;
        let train_scores = match parts.get(3) {
            Some(b) => ValScores::decode(b, "elastic state")?,
            None => ValScores::default(),
        };
        let meta: serde_json::Value =
            serde_json::from_slice(parts[0]).map_err(|e| bad(e.to_string()))?;
        let num = |k: &str| meta[k].as_f64().ok_or_else(|| bad(format!("no {k}")));
        let members = meta["members"]
            .as_array()
            .ok_or_else(|| bad("no members".into()))?
            .iter()
            .map(|m| {
                Some(Worker {
                    id: m.get(0)?.as_str()?.to_string(),
                    host: m.get(1)?.as_str()?.to_string(),
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("malformed members".into()))?;
        let sums = meta["sums"]
            .as_array()
            .filter(|a| a.len() == 3 || a.len() == 4)
            .ok_or_else(|| bad("no sums".into()))?;
        let (world_log, rows) = (world_log(&meta)?, epoch_rows(&meta)?);
        let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(parts[1].to_vec()))
            .map_err(|e| bad(format!("model: {e}")))?;
        let optim_record = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(parts[2].to_vec()))
            .map_err(|e| bad(format!("optimizer: {e}")))?;
        let skeleton = self.skeleton(&self.device)?;
        crate::device::check_burn_default(&self.device)?;
        let epoch = num("epoch")? as u64;
        // fp16's loss scale: a state of another precision (or from before it was kept) starts
        // the scale afresh.
        let scaler = match (self.cfg.compute.precision, &meta["loss_scale"]) {
            (Precision::Fp16, serde_json::Value::Null) => Some(LossScaler::default()),
            (Precision::Fp16, v) => {
                Some(LossScaler::from_json(v).ok_or_else(|| bad("malformed loss scale".into()))?)
            }
            _ => None,
        };
        let model = self.in_phase(
            skeleton
                .try_load_record(record)
                .map_err(|e| bad(format!("model: {e}")))?,
            epoch,
        );
        let ema = self.decode_average(&model, parts.get(4).copied(), epoch as usize)?;
        let commit = Commit {
            step: num("step")? as u64,
            epoch,
            position: num("position")? as u64,
            sums: [
                sums[0].as_f64().unwrap_or(0.0),
                sums[1].as_f64().unwrap_or(0.0),
                sums[2].as_f64().unwrap_or(0.0),
                // A state from before top-5 was counted (3 sums): the epoch's top-5 is
                // unknown (NaN in its row), the next epoch counts again.
                sums.get(3).and_then(|v| v.as_f64()).unwrap_or(f64::NAN),
            ],
            elapsed: num("elapsed")?,
            start_unix: num("start_unix")?,
            epoch_started: num("epoch_started")?,
            worker_seconds: num("worker_seconds")?,
            world_log,
            rows,
            finished: meta["finished"].as_bool().unwrap_or(false),
            model,
            optim: optimizer(self.cfg).load_record(optim_record),
            scaler,
            epoch_skipped: meta["epoch_skipped"].as_u64().unwrap_or(0),
            train_scores,
            ema,
        };
        let join = meta["join"].as_str().unwrap_or_default().to_string();
        let health = Health {
            failures: serde_json::from_value(meta["health"]["failures"].clone())
                .unwrap_or_default(),
            blacklist: serde_json::from_value(meta["health"]["blacklist"].clone())
                .unwrap_or_default(),
        };
        Ok(Decoded {
            members,
            join,
            commit,
            health,
            launch: meta["launch"].as_str().unwrap_or_default().to_string(),
        })
    }

    pub(super) fn state_file(&self) -> PathBuf {
        self.cfg.run_dir.join("checkpoint").join("elastic.state")
    }

    /// Writes `checkpoint/elastic.state` atomically, unless the file already holds a later
    /// step: a worker cut off from the job (its own world of one, giving up) shares the run
    /// directory with the part that goes on, and must not put the run back. Returns whether
    /// it wrote.
    pub(super) fn save_state(&self, c: &Commit<T::Model>, world: &World) -> Result<bool> {
        self.fenced()?;
        let path = self.state_file();
        if let Ok(bytes) = std::fs::read(&path)
            && let Some(on_disk) = saved_step(&bytes)
            && on_disk > c.step
        {
            return Ok(false);
        }
        if self.zero.is_some()
            && !crate::train::zero::state_file(&shard::state_dir(self.cfg), c.step as usize)
                .is_file()
        {
            // The sharded state of this step was not written (one worker cannot alone).
            return Ok(false);
        }
        let bytes = self.encode(c, world.number, &world.members, &world.coordinator_join)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        self.gate().write(&path, &bytes)?;
        Ok(true)
    }

    pub(super) fn load_state(&self) -> Result<Commit<T::Model>> {
        let path = self.state_file();
        let bytes = std::fs::read(&path).map_err(|e| {
            HearthError::InvalidArgument(format!(
                "`checkpoint.resume`: {} cannot be read ({e}); an elastic run resumes from it",
                path.display()
            ))
        })?;
        let zero = saved_meta(&bytes)
            .and_then(|m| m["zero"].as_bool())
            .unwrap_or(false);
        if zero != (self.cfg.exchange.zero > 0) {
            return Err(HearthError::InvalidArgument(format!(
                "`checkpoint.resume`: {} was written {}; resume {}",
                path.display(),
                if zero {
                    "with `exchange.zero` (its optimizer state is in checkpoint/elastic-zero/)"
                } else {
                    "without `exchange.zero`"
                },
                if zero {
                    "with `exchange.zero` 1 or 2, on any number of workers"
                } else {
                    "without `exchange.zero`"
                }
            )));
        }
        let mut c = self
            .decode(&bytes)
            .map_err(|e| {
                HearthError::InvalidArgument(format!(
                    "`checkpoint.resume`: {}: {e}",
                    path.display()
                ))
            })?
            .commit;
        // The clock goes on from where the saved run stopped.
        c.start_unix = unix_now() - c.elapsed;
        Ok(c)
    }

    // ---- training --------------------------------------------------------------------------
}

/// The step a saved state holds, from its leading metadata alone (no model is built).
fn saved_step(bytes: &[u8]) -> Option<u64> {
    saved_meta(bytes)?["step"].as_u64()
}

/// A saved state's leading metadata.
fn saved_meta(bytes: &[u8]) -> Option<serde_json::Value> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    serde_json::from_slice(bytes.get(8..8usize.checked_add(len)?)?).ok()
}

fn malformed(m: String) -> HearthError {
    HearthError::Training(format!("elastic state: {m}"))
}

/// The state's world log: (step, seconds, workers) at each change.
fn world_log(meta: &serde_json::Value) -> Result<Vec<(u64, f64, usize)>> {
    meta["world_log"]
        .as_array()
        .ok_or_else(|| malformed("no world log".into()))?
        .iter()
        .map(|p| {
            Some((
                p.get(0)?.as_u64()?,
                p.get(1)?.as_f64()?,
                p.get(2)?.as_u64()? as usize,
            ))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| malformed("malformed world log".into()))
}

/// The state's rows of `metrics.csv`, by epoch.
fn epoch_rows(meta: &serde_json::Value) -> Result<EpochRows> {
    let mut rows = EpochRows::new();
    for (e, r) in meta["rows"]
        .as_object()
        .ok_or_else(|| malformed("no rows".into()))?
    {
        let e: usize = e.parse().map_err(|_| malformed(format!("epoch {e}")))?;
        let r = r
            .as_object()
            .ok_or_else(|| malformed("malformed row".into()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(f64::NAN)))
            .collect();
        rows.insert(e, r);
    }
    Ok(rows)
}
