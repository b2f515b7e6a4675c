//! What a run records of its settings (`hparams.json`) and how `--resume` takes them back.
//!
//! [`Hparams`] is the file, field for field, written and read by serde. A resume lays the
//! recorded values the command line did not set over the run's own settings and reads the
//! result back as one [`Hparams`]: no setting is parsed by hand.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::TrainConfig;
use crate::names::by_name;
use crate::schedule::{Decay, LrScaling};
use crate::settings::*;
use crate::{HearthError, Result};

/// `hparams.json` as a map from each setting's name to its value (what a resume compares).
pub type Recorded = BTreeMap<String, Value>;

/// The settings a run records in `hparams.json`, under the names the file uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hparams {
    pub data: Option<String>,
    pub labels: Option<String>,
    pub val_fraction: f64,
    pub model: String,
    pub weights: Option<String>,
    pub freeze_backbone: bool,
    pub unfreeze_after: Option<usize>,
    pub finetune_lr: Option<f64>,
    #[serde(with = "by_name")]
    pub finetune_bn: FinetuneBn,
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    #[serde(with = "by_name")]
    pub optimizer: OptimizerKind,
    /// What ran: the mode's default where the command line gave none.
    pub momentum: Option<f64>,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub schedule: Decay,
    pub warmup_epochs: usize,
    pub scale_lr: Option<ScaleLr>,
    /// As typed (0.1, not the f32's 0.10000000149...).
    #[serde(with = "shortest_f32")]
    pub label_smoothing: f32,
    #[serde(with = "by_name")]
    pub monitor: Monitor,
    pub patience: Option<usize>,
    pub min_delta: f64,
    pub image_size: u32,
    #[serde(with = "AugmentationDef")]
    pub augmentation: hearth_datasets::Augmentation,
    pub seed: u64,
    pub grad_accum: Option<usize>,
    #[serde(with = "by_name")]
    pub compression: burn_dist::Compression,
    #[serde(with = "by_name")]
    pub precision: Precision,
    pub zero: u8,
    pub recompute: bool,
    /// How the run was started, for a bare `--resume RUN` to start it the same way (the
    /// processes may change on resume). Recorded, never taken back into the settings.
    pub launch: LaunchRecord,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ps: Option<PsRecord>,
}

/// `--scale-lr RULE --base-batch N`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScaleLr {
    #[serde(with = "by_name")]
    pub rule: LrScaling,
    pub base_batch: usize,
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

/// serde's view of [`hearth_datasets::Augmentation`] (a crate without serde).
#[derive(Serialize, Deserialize)]
#[serde(remote = "hearth_datasets::Augmentation")]
struct AugmentationDef {
    crop_scale: Option<(f64, f64)>,
    flip: bool,
    rotate: f64,
    shear: f64,
    color_jitter: f64,
}

/// An f32 written as the shortest decimal that reads back to it.
mod shortest_f32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(v.to_string().parse().unwrap_or(f64::from(*v)))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        f64::deserialize(d).map(|v| v as f32)
    }
}

/// The keys of the modes' own sections, present only in runs of that mode.
const MODE_KEYS: [&str; 2] = ["pipeline", "ps"];

impl Hparams {
    /// What `cfg` records.
    pub fn of(cfg: &TrainConfig) -> Self {
        let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
        Self {
            data: path(&cfg.data.folder),
            labels: path(&cfg.data.labels),
            val_fraction: cfg.data.val_fraction,
            model: cfg.model.name.clone(),
            weights: path(&cfg.model.weights),
            freeze_backbone: cfg.model.freeze_backbone,
            unfreeze_after: cfg.model.unfreeze_after,
            finetune_lr: cfg.model.finetune_lr,
            finetune_bn: cfg.model.finetune_bn,
            epochs: cfg.epochs,
            batch_size: cfg.batch_size,
            lr: cfg.optim.lr,
            optimizer: cfg.optim.optimizer,
            momentum: Some(cfg.momentum()),
            nesterov: cfg.optim.nesterov,
            weight_decay: cfg.optim.weight_decay,
            schedule: cfg.optim.schedule,
            warmup_epochs: cfg.optim.warmup_epochs,
            scale_lr: cfg
                .optim
                .scale_lr
                .map(|(rule, base_batch)| ScaleLr { rule, base_batch }),
            label_smoothing: cfg.optim.label_smoothing,
            monitor: cfg.checkpoint.monitor,
            patience: cfg.checkpoint.patience,
            min_delta: cfg.checkpoint.min_delta,
            image_size: cfg.data.image_size,
            augmentation: cfg.data.augmentation.clone(),
            seed: cfg.seed,
            grad_accum: cfg.optim.grad_accum,
            compression: cfg.exchange.compression,
            precision: cfg.compute.precision,
            zero: cfg.exchange.zero,
            recompute: cfg.compute.recompute,
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
        h.momentum = cfg.optim.momentum;
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

    /// Sets every setting of `cfg` this records (all but `launch`).
    fn apply(self, cfg: &mut TrainConfig) -> Result<()> {
        let Hparams {
            data,
            labels,
            val_fraction,
            model,
            weights,
            freeze_backbone,
            unfreeze_after,
            finetune_lr,
            finetune_bn,
            epochs,
            batch_size,
            lr,
            optimizer,
            momentum,
            nesterov,
            weight_decay,
            schedule,
            warmup_epochs,
            scale_lr,
            label_smoothing,
            monitor,
            patience,
            min_delta,
            image_size,
            augmentation,
            seed,
            grad_accum,
            compression,
            precision,
            zero,
            recompute,
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
        cfg.data.folder = data.map(Into::into);
        cfg.data.labels = labels.map(Into::into);
        cfg.data.val_fraction = val_fraction;
        cfg.model.name = model;
        cfg.model.weights = weights.map(Into::into);
        cfg.model.freeze_backbone = freeze_backbone;
        cfg.model.unfreeze_after = unfreeze_after;
        cfg.model.finetune_lr = finetune_lr;
        cfg.model.finetune_bn = finetune_bn;
        cfg.epochs = epochs;
        cfg.batch_size = batch_size;
        cfg.optim.lr = lr;
        cfg.optim.optimizer = optimizer;
        cfg.optim.momentum = momentum;
        cfg.optim.nesterov = nesterov;
        cfg.optim.weight_decay = weight_decay;
        cfg.optim.schedule = schedule;
        cfg.optim.warmup_epochs = warmup_epochs;
        cfg.optim.scale_lr = scale_lr.map(|s| (s.rule, s.base_batch));
        cfg.optim.label_smoothing = label_smoothing;
        cfg.checkpoint.monitor = monitor;
        cfg.checkpoint.patience = patience;
        cfg.checkpoint.min_delta = min_delta;
        cfg.data.image_size = image_size;
        cfg.data.augmentation = augmentation;
        cfg.seed = seed;
        cfg.optim.grad_accum = grad_accum;
        cfg.exchange.compression = compression;
        cfg.compute.precision = precision;
        cfg.exchange.zero = zero;
        cfg.compute.recompute = recompute;
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
