//! What a run records of its settings (`hparams.json`) and how `--resume` takes them back.
//!
//! [`Hparams`] is the file, field for field, written and read by serde. A resume lays the
//! recorded values the command line did not set over the run's own settings and reads the
//! result back as one [`Hparams`]: no setting is parsed by hand.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::TrainConfig;
use super::config::{
    CheckpointSettings, ComputeSettings, DataSettings, ExchangeSettings, ModelSettings,
    OptimSettings,
};
use crate::names::by_name;
use crate::settings::*;
use crate::{HearthError, Result};

/// `hparams.json` as a map from each setting's name to its value (what a resume compares).
pub type Recorded = BTreeMap<String, Value>;

/// The settings a run records in `hparams.json`, under the names the file uses: the
/// settings' own sections, written and read by their serde derives (flattened into one
/// object), plus how the run was launched and its mode's options.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hparams {
    #[serde(flatten)]
    pub data: DataSettings,
    #[serde(flatten)]
    pub model: ModelSettings,
    pub epochs: usize,
    pub batch_size: usize,
    /// `momentum` is what ran: the mode's default where the command line gave none.
    #[serde(flatten)]
    pub optim: OptimSettings,
    #[serde(flatten)]
    pub checkpoint: CheckpointSettings,
    pub seed: u64,
    #[serde(flatten)]
    pub compute: ComputeSettings,
    #[serde(flatten)]
    pub exchange: ExchangeSettings,
    /// How the run was started, for a bare `--resume RUN` to start it the same way (the
    /// processes may change on resume). Recorded, never taken back into the settings.
    pub launch: LaunchRecord,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ps: Option<PsRecord>,
}

/// How many processes started the run, and whether elastically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchRecord {
    pub processes: usize,
    pub elastic: bool,
}

/// [`PipelineOptions`] as recorded: the split as `START:END` per stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PipelineRecord {
    pub stages: usize,
    pub micro_batches: usize,
    #[serde(with = "by_name")]
    pub schedule: burn_dist::pipeline::Schedule,
    pub split: Option<Vec<String>>,
    #[serde(with = "by_name")]
    pub balance: PipelineBalance,
}

/// [`PsOptions`] as recorded: `servers` is a count or `"colocated"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PsRecord {
    pub servers: ServersRecord,
    #[serde(with = "by_name")]
    pub mode: burn_dist::ps::Mode,
    /// What ran (the mode's default where not given); sync has none.
    pub window: Option<usize>,
    pub rho: Option<f64>,
    pub staleness: Option<u64>,
}

/// [`PsServers`]: a number of dedicated servers, or a name (`"colocated"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ServersRecord {
    Count(usize),
    Named(String),
}

/// The keys of the modes' own sections, present only in runs of that mode.
const MODE_KEYS: [&str; 2] = ["pipeline", "ps"];

impl Hparams {
    /// What `cfg` records.
    pub fn of(cfg: &TrainConfig) -> Self {
        Self {
            data: cfg.data.clone(),
            model: cfg.model.clone(),
            epochs: cfg.epochs,
            batch_size: cfg.batch_size,
            optim: OptimSettings {
                momentum: Some(cfg.momentum()),
                ..cfg.optim.clone()
            },
            checkpoint: cfg.checkpoint.clone(),
            seed: cfg.seed,
            compute: cfg.compute.clone(),
            exchange: cfg.exchange.clone(),
            launch: LaunchRecord {
                processes: cfg.dist.as_ref().map_or(1, |d| d.world),
                elastic: cfg.mode.elastic().is_some(),
            },
            pipeline: cfg.mode.pipeline().map(|p| PipelineRecord {
                stages: p.stages,
                micro_batches: p.micro_batches,
                schedule: p.schedule,
                split: p
                    .split
                    .as_ref()
                    .map(|s| s.iter().map(|r| format!("{}:{}", r.start, r.end)).collect()),
                balance: p.balance,
            }),
            ps: cfg.mode.ps().map(|p| PsRecord {
                servers: match p.servers {
                    PsServers::Dedicated(n) => ServersRecord::Count(n),
                    PsServers::Colocated => ServersRecord::Named("colocated".into()),
                },
                mode: p.mode,
                window: (p.mode != burn_dist::ps::Mode::Sync).then(|| p.window()),
                rho: p.rho,
                staleness: p.staleness,
            }),
        }
    }

    /// [`Hparams::of`] with the two values the file records as they ran (momentum and the
    /// parameter servers' window) left as the command line gave them, so that reading it
    /// back changes nothing.
    fn as_given(cfg: &TrainConfig) -> Self {
        let mut h = Self::of(cfg);
        h.optim.momentum = cfg.optim.momentum;
        if let (Some(r), Some(p)) = (h.ps.as_mut(), cfg.mode.ps()) {
            r.window = p.window;
        }
        h
    }

    /// The file's map, by setting name.
    pub fn to_map(&self) -> Recorded {
        match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m.into_iter().collect(),
            // A struct of strings, numbers and options always writes as an object.
            _ => Recorded::new(),
        }
    }

    /// Sets every setting of `cfg` this records (all but `launch`); what the file does not
    /// record (threads, the run's bookkeeping and logs, bucket size, overlap) stays as `cfg`
    /// has it.
    fn apply(self, cfg: &mut TrainConfig) -> Result<()> {
        let Hparams {
            data,
            model,
            epochs,
            batch_size,
            optim,
            checkpoint,
            seed,
            compute,
            exchange,
            launch: _,
            pipeline,
            ps,
        } = self;
        cfg.mode = match (pipeline, ps, &cfg.mode) {
            (Some(_), Some(_), _) => {
                return Err(HearthError::InvalidArgument(
                    "the run's settings name both a pipeline and parameter servers; a run has \
                     one mode"
                        .into(),
                ));
            }
            (Some(_), None, TrainingMode::Elastic(_))
            | (None, Some(_), TrainingMode::Elastic(_)) => {
                return Err(HearthError::InvalidArgument(
                    "`TrainingMode::Elastic`: this run was not elastic (it recorded a pipeline or parameter \
                     servers); resume it without `TrainingMode::Elastic`"
                        .into(),
                ));
            }
            (Some(p), None, _) => TrainingMode::Pipeline(p.options()?),
            (None, Some(p), _) => TrainingMode::ParameterServers(p.options()?),
            // Elastic membership comes from the launch (hparams.json records only that it was).
            (None, None, TrainingMode::Elastic(e)) => TrainingMode::Elastic(e.clone()),
            (None, None, _) => TrainingMode::DataParallel,
        };
        cfg.data = DataSettings {
            workers: cfg.data.workers,
            ..data
        };
        cfg.model = model;
        cfg.epochs = epochs;
        cfg.batch_size = batch_size;
        cfg.optim = optim;
        cfg.checkpoint = CheckpointSettings {
            resume: cfg.checkpoint.resume,
            overwrite: cfg.checkpoint.overwrite,
            stop_after_epoch: cfg.checkpoint.stop_after_epoch,
            log_every: cfg.checkpoint.log_every,
            ..checkpoint
        };
        cfg.seed = seed;
        cfg.compute = compute;
        cfg.exchange = ExchangeSettings {
            bucket_bytes: cfg.exchange.bucket_bytes,
            overlap: cfg.exchange.overlap,
            ..exchange
        };
        Ok(())
    }
}

impl PipelineRecord {
    fn options(self) -> Result<PipelineOptions> {
        Ok(PipelineOptions {
            stages: self.stages,
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            split: self
                .split
                .map(|s| PipelineOptions::parse_split(&s.join(",")))
                .transpose()?,
            balance: self.balance,
        })
    }
}

impl PsRecord {
    fn options(self) -> Result<PsOptions> {
        Ok(PsOptions {
            servers: match self.servers {
                ServersRecord::Count(n) => PsServers::Dedicated(n),
                ServersRecord::Named(s) => s.parse()?,
            },
            mode: self.mode,
            window: self.window,
            rho: self.rho,
            staleness: self.staleness,
        })
    }
}

/// A recorded value as this version reads it. Runs before issue 55 recorded a window for
/// sync and a rho for every mode, which the mode never read (and the settings now refuse).
fn upgraded(key: &str, value: &Value) -> Value {
    let mut value = value.clone();
    if key == "ps"
        && let Some(ps) = value.as_object_mut()
    {
        let mode = ps.get("mode").and_then(Value::as_str).map(str::to_string);
        if mode.as_deref() == Some("sync") {
            ps.insert("window".into(), Value::Null);
        }
        if mode.as_deref() != Some("easgd") {
            ps.insert("rho".into(), Value::Null);
        }
    }
    value
}

impl TrainConfig {
    /// `--resume`: the settings recorded in the run's `hparams.json` (`saved`) for every one
    /// `given` says the command line did not set, so `hearth train --resume RUN` alone
    /// continues the run as it was started. Returns the names taken; a value that does not
    /// read is an error naming it. Names this version does not know are left alone.
    pub fn take_recorded(
        &mut self,
        saved: &Map<String, Value>,
        given: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<String>> {
        let Value::Object(base) = serde_json::to_value(Hparams::as_given(self))
            .map_err(|e| HearthError::InvalidArgument(format!("the run's settings: {e}")))?
        else {
            return Err(HearthError::InvalidArgument(
                "the run's settings do not write as an object".into(),
            ));
        };
        let taken: Vec<String> = saved
            .keys()
            .filter(|k| k.as_str() != "launch" && !given(k))
            .filter(|k| base.contains_key(*k) || MODE_KEYS.contains(&k.as_str()))
            .cloned()
            .collect();
        let read = |keys: &[String]| {
            let mut merged = base.clone();
            for k in keys {
                merged.insert(k.clone(), upgraded(k, &saved[k]));
            }
            serde_json::from_value::<Hparams>(Value::Object(merged))
        };
        let file = self.run_dir.join("hparams.json");
        let recorded = read(&taken).map_err(|all| {
            // Name the setting that does not read.
            let (key, e) = taken
                .iter()
                .find_map(|k| read(std::slice::from_ref(k)).err().map(|e| (k.as_str(), e)))
                .unwrap_or(("settings", all));
            HearthError::InvalidArgument(format!(
                "{}: {key} = {} does not read as a setting ({e})",
                file.display(),
                saved.get(key).unwrap_or(&Value::Null)
            ))
        })?;
        recorded.apply(self)?;
        Ok(taken)
    }

    /// The hyperparameters a resumed run must share with the original, by name
    /// (`hparams.json`).
    pub fn hyperparameters(&self) -> Recorded {
        Hparams::of(self).to_map()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Decay, LrScaling};

    fn config() -> TrainConfig {
        let mut c = TrainConfig::new("run".into());
        c.data.folder = Some("/data/set".into());
        c.optim.lr = 0.02;
        c.optim.label_smoothing = 0.1;
        c.optim.schedule = Decay::Step {
            step_size: 7,
            gamma: 0.5,
        };
        c.optim.scale_lr = Some((LrScaling::Sqrt, 64));
        c.data.augmentation.crop_scale = Some((0.3, 1.0));
        c.mode = TrainingMode::ParameterServers(PsOptions {
            servers: PsServers::Colocated,
            mode: burn_dist::ps::Mode::Easgd,
            window: Some(3),
            rho: Some(2.5),
            staleness: None,
        });
        c
    }

    #[test]
    fn the_file_keeps_its_names_and_values() {
        let h = config().hyperparameters();
        assert_eq!(h["label_smoothing"], serde_json::json!(0.1));
        assert_eq!(
            h["schedule"],
            serde_json::json!({"decay": "step", "step_size": 7, "gamma": 0.5})
        );
        assert_eq!(
            h["scale_lr"],
            serde_json::json!({"rule": "sqrt", "base_batch": 64})
        );
        assert_eq!(
            h["augmentation"]["crop_scale"],
            serde_json::json!([0.3, 1.0])
        );
        assert_eq!(h["ps"]["servers"], "colocated");
        assert_eq!(h["ps"]["mode"], "easgd");
        assert_eq!(
            h["launch"],
            serde_json::json!({"processes": 1, "elastic": false})
        );
        assert_eq!(h["momentum"], serde_json::json!(DEFAULT_MOMENTUM));
        assert!(!h.contains_key("pipeline"));
    }

    #[test]
    fn a_bare_resume_takes_back_every_setting() {
        let original = config();
        let saved: Map<String, Value> = original.hyperparameters().into_iter().collect();
        let mut resumed = TrainConfig::new("run".into());
        let taken = resumed.take_recorded(&saved, &|_| false).unwrap();
        assert!(taken.contains(&"ps".to_string()) && !taken.contains(&"launch".to_string()));
        assert_eq!(resumed.hyperparameters(), original.hyperparameters());
        assert_eq!(resumed.data.folder, original.data.folder);
        assert_eq!(
            resumed.optim.label_smoothing,
            original.optim.label_smoothing
        );
    }

    #[test]
    fn what_the_command_line_sets_stays() {
        let saved: Map<String, Value> = config().hyperparameters().into_iter().collect();
        let mut resumed = TrainConfig::new("run".into());
        resumed.optim.lr = 0.5;
        resumed.optim.label_smoothing = 0.123_456_7;
        let given = |k: &str| matches!(k, "lr" | "label_smoothing" | "momentum");
        let taken = resumed.take_recorded(&saved, &given).unwrap();
        assert!(!taken.contains(&"lr".to_string()));
        assert_eq!(resumed.optim.lr, 0.5);
        assert_eq!(resumed.optim.label_smoothing, 0.123_456_7);
        assert_eq!(resumed.optim.momentum, None, "left for the mode to choose");
        assert_eq!(resumed.seed, config().seed);
    }

    #[test]
    fn a_value_that_does_not_read_is_named() {
        let mut saved: Map<String, Value> = config().hyperparameters().into_iter().collect();
        saved.insert("optimizer".into(), "adamx".into());
        saved.insert("unknown_to_this_version".into(), 3.into());
        let err = TrainConfig::new("run".into())
            .take_recorded(&saved, &|_| false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("optimizer = \"adamx\" does not read"), "{err}");
        saved.insert("optimizer".into(), "adam".into());
        saved.insert("zero".into(), 300.into());
        let err = TrainConfig::new("run".into())
            .take_recorded(&saved, &|_| false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("zero = 300"), "{err}");
    }

    #[test]
    fn old_files_lose_the_ps_values_their_mode_never_read() {
        let mut saved = Map::new();
        saved.insert(
            "ps".into(),
            serde_json::json!({"servers": 2, "mode": "sync", "window": 1, "rho": 1.0,
                               "staleness": null}),
        );
        let mut c = TrainConfig::new("run".into());
        assert_eq!(c.take_recorded(&saved, &|_| false).unwrap(), ["ps"]);
        let ps = c.mode.ps().unwrap();
        assert_eq!(ps.servers, PsServers::Dedicated(2));
        assert_eq!((ps.window, ps.rho), (None, None));
    }

    #[test]
    fn the_recorded_mode_comes_back_and_a_conflicting_one_is_refused() {
        let saved: Map<String, Value> = config().hyperparameters().into_iter().collect();
        // A bare resume takes the recorded parameter servers.
        let mut back = TrainConfig::new("run".into());
        back.take_recorded(&saved, &|_| false).unwrap();
        assert_eq!(back.mode.ps().unwrap().mode, burn_dist::ps::Mode::Easgd);
        // An elastic launch of a run recorded with parameter servers is refused by name.
        let mut elastic = TrainConfig::new("run".into());
        elastic.mode = TrainingMode::Elastic(Default::default());
        let e = elastic
            .take_recorded(&saved, &|_| false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`TrainingMode::Elastic`") && e.contains("was not elastic"),
            "{e}"
        );
        // An elastic run (no pipeline, no servers recorded) stays elastic.
        let plain: Map<String, Value> = TrainConfig::new("run".into())
            .hyperparameters()
            .into_iter()
            .collect();
        let mut again = TrainConfig::new("run".into());
        again.mode = TrainingMode::Elastic(Default::default());
        again.take_recorded(&plain, &|_| false).unwrap();
        assert!(again.mode.elastic().is_some());
    }

    #[test]
    fn a_pipeline_split_reads_back_as_ranges() {
        let mut c = TrainConfig::new("run".into());
        c.mode = TrainingMode::Pipeline(PipelineOptions {
            stages: 2,
            micro_batches: 4,
            schedule: burn_dist::pipeline::Schedule::default(),
            split: Some(vec![0..2, 2..5]),
            balance: PipelineBalance::Params,
        });
        let saved: Map<String, Value> = c.hyperparameters().into_iter().collect();
        assert_eq!(
            saved["pipeline"]["split"],
            serde_json::json!(["0:2", "2:5"])
        );
        let mut back = TrainConfig::new("run".into());
        back.take_recorded(&saved, &|_| false).unwrap();
        assert_eq!(back.mode.pipeline().unwrap().split, Some(vec![0..2, 2..5]));
    }
}
