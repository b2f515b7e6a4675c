//! What a run records of its settings (`hparams.json`) and how `--resume` takes them back:
//! [`TrainConfig::hyperparameters`] and [`TrainConfig::take_recorded`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::TrainConfig;
use crate::settings::*;
use crate::{HearthError, Result};

impl TrainConfig {
    /// `--resume`: the settings recorded in the run's `hparams.json` (`saved`) for every one
    /// `given` says the command line did not set, so `hearth train --resume RUN` alone
    /// continues the run as it was started. Returns the names taken; a value that does not
    /// read is an error naming it.
    pub fn take_recorded(
        &mut self,
        saved: &serde_json::Map<String, serde_json::Value>,
        given: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<String>> {
        use serde_json::Value;
        let bad = |k: &str, v: &Value| {
            HearthError::InvalidArgument(format!(
                "{}: {k} = {v} does not read as a setting",
                self.run_dir.join("hparams.json").display()
            ))
        };
        let f = |k: &str, v: &Value| v.as_f64().ok_or_else(|| bad(k, v));
        let n = |k: &str, v: &Value| v.as_u64().map(|x| x as usize).ok_or_else(|| bad(k, v));
        let b = |k: &str, v: &Value| v.as_bool().ok_or_else(|| bad(k, v));
        let text = |k: &str, v: &Value| v.as_str().map(str::to_string).ok_or_else(|| bad(k, v));
        let opt = |v: &Value| (!v.is_null()).then_some(v.clone());
        let named = |k: &str, v: &Value| -> Result<String> { text(k, v) };
        let mut taken = Vec::new();
        for (k, v) in saved {
            if given(k) {
                continue;
            }
            let path = |v: &Value| -> Result<Option<PathBuf>> {
                opt(v).map(|v| text(k, &v).map(PathBuf::from)).transpose()
            };
            match k.as_str() {
                "data" => self.data = path(v)?,
                "labels" => self.labels = path(v)?,
                "weights" => self.weights = path(v)?,
                "val_fraction" => self.val_fraction = f(k, v)?,
                "model" => self.model = text(k, v)?,
                "freeze_backbone" => self.freeze_backbone = b(k, v)?,
                "unfreeze_after" => self.unfreeze_after = opt(v).map(|v| n(k, &v)).transpose()?,
                "finetune_lr" => self.finetune_lr = opt(v).map(|v| f(k, &v)).transpose()?,
                "finetune_bn" => {
                    self.finetune_bn =
                        FinetuneBn::from_name(&named(k, v)?).ok_or_else(|| bad(k, v))?
                }
                "epochs" => self.epochs = n(k, v)?,
                "batch_size" => self.batch_size = n(k, v)?,
                "lr" => self.lr = f(k, v)?,
                "optimizer" => {
                    self.optimizer =
                        OptimizerKind::from_name(&named(k, v)?).ok_or_else(|| bad(k, v))?
                }
                "momentum" => self.momentum = Some(f(k, v)?),
                "nesterov" => self.nesterov = b(k, v)?,
                "weight_decay" => self.weight_decay = f(k, v)?,
                "schedule" => {
                    use crate::schedule::Decay;
                    self.schedule = match v["decay"].as_str() {
                        Some("constant") => Decay::Constant,
                        Some("step") => Decay::Step {
                            step_size: n(k, &v["step_size"])?,
                            gamma: f(k, &v["gamma"])?,
                        },
                        Some("cosine") => Decay::Cosine {
                            min_lr: f(k, &v["min_lr"])?,
                        },
                        _ => return Err(bad(k, v)),
                    }
                }
                "warmup_epochs" => self.warmup_epochs = n(k, v)?,
                "scale_lr" => {
                    self.scale_lr = match opt(v) {
                        None => None,
                        Some(s) => Some((
                            crate::schedule::LrScaling::from_name(&named(k, &s["rule"])?)
                                .ok_or_else(|| bad(k, &s))?,
                            n(k, &s["base_batch"])?,
                        )),
                    }
                }
                "label_smoothing" => self.label_smoothing = f(k, v)? as f32,
                "monitor" => {
                    self.monitor = Monitor::from_name(&named(k, v)?).ok_or_else(|| bad(k, v))?
                }
                "patience" => self.patience = opt(v).map(|v| n(k, &v)).transpose()?,
                "min_delta" => self.min_delta = f(k, v)?,
                "image_size" => self.image_size = n(k, v)? as u32,
                "augmentation" => {
                    self.augmentation = hearth_datasets::Augmentation {
                        crop_scale: match opt(&v["crop_scale"]) {
                            None => None,
                            Some(c) => Some((f(k, &c[0])?, f(k, &c[1])?)),
                        },
                        flip: b(k, &v["flip"])?,
                        rotate: f(k, &v["rotate"])?,
                        shear: f(k, &v["shear"])?,
                        color_jitter: f(k, &v["color_jitter"])?,
                    }
                }
                "seed" => self.seed = n(k, v)? as u64,
                "grad_accum" => self.grad_accum = opt(v).map(|v| n(k, &v)).transpose()?,
                "compression" => {
                    self.compression =
                        burn_dist::Compression::from_name(&named(k, v)?).ok_or_else(|| bad(k, v))?
                }
                "precision" => {
                    self.precision =
                        super::Precision::from_name(&named(k, v)?).ok_or_else(|| bad(k, v))?
                }
                "zero" => {
                    self.zero = u8::try_from(n(k, v)?).map_err(|_| bad(k, v))?;
                }
                "recompute" => self.recompute = b(k, v)?,
                "pipeline" => {
                    let split = match opt(&v["split"]) {
                        None => None,
                        Some(s) => {
                            let parts: Vec<String> = s
                                .as_array()
                                .ok_or_else(|| bad(k, v))?
                                .iter()
                                .map(|p| text(k, p))
                                .collect::<Result<_>>()?;
                            Some(PipelineOptions::parse_split(&parts.join(","))?)
                        }
                    };
                    self.pipeline = Some(PipelineOptions {
                        stages: n(k, &v["stages"])?,
                        micro_batches: n(k, &v["micro_batches"])?,
                        schedule: burn_dist::pipeline::Schedule::from_name(&named(
                            k,
                            &v["schedule"],
                        )?)
                        .ok_or_else(|| bad(k, v))?,
                        split,
                        balance: PipelineBalance::from_name(&named(k, &v["balance"])?)
                            .ok_or_else(|| bad(k, v))?,
                    })
                }
                "ps" => {
                    use burn_dist::ps::Mode;
                    let mode: Mode = named(k, &v["mode"])?.parse()?;
                    // Runs before issue 55 recorded a window for sync and a rho for every
                    // mode, which the mode never read (and the settings now refuse).
                    let window = opt(&v["window"]).filter(|_| mode != Mode::Sync);
                    let rho = opt(&v["rho"]).filter(|_| mode == Mode::Easgd);
                    self.ps = Some(super::PsOptions {
                        servers: match &v["servers"] {
                            Value::String(s) => s.parse()?,
                            other => super::PsServers::Dedicated(n(k, other)?),
                        },
                        mode,
                        window: window.map(|w| n(k, &w)).transpose()?,
                        rho: rho.map(|r| f(k, &r)).transpose()?,
                        staleness: opt(&v["staleness"])
                            .map(|s| n(k, &s).map(|x| x as u64))
                            .transpose()?,
                    })
                }
                // A setting this version does not know: the run's check says so if it matters.
                _ => continue,
            }
            taken.push(k.clone());
        }
        Ok(taken)
    }

    /// The hyperparameters a resumed run must share with the original, by name
    /// (`hparams.json`).
    pub fn hyperparameters(&self) -> BTreeMap<&'static str, serde_json::Value> {
        use serde_json::{Value, json};
        let path = |p: &Option<PathBuf>| {
            p.as_ref()
                .map_or(Value::Null, |p| json!(p.display().to_string()))
        };
        let schedule = match self.schedule {
            crate::schedule::Decay::Constant => json!({"decay": "constant"}),
            crate::schedule::Decay::Step { step_size, gamma } => {
                json!({"decay": "step", "step_size": step_size, "gamma": gamma})
            }
            crate::schedule::Decay::Cosine { min_lr } => {
                json!({"decay": "cosine", "min_lr": min_lr})
            }
        };
        let scale_lr = self.scale_lr.map_or(
            Value::Null,
            |(rule, base)| json!({"rule": rule.name(), "base_batch": base}),
        );
        BTreeMap::from([
            ("data", path(&self.data)),
            ("labels", path(&self.labels)),
            ("val_fraction", json!(self.val_fraction)),
            ("model", json!(self.model)),
            ("weights", path(&self.weights)),
            ("freeze_backbone", json!(self.freeze_backbone)),
            ("unfreeze_after", json!(self.unfreeze_after)),
            ("finetune_lr", json!(self.finetune_lr)),
            ("finetune_bn", json!(self.finetune_bn.name())),
            ("epochs", json!(self.epochs)),
            ("batch_size", json!(self.batch_size)),
            ("lr", json!(self.lr)),
            ("optimizer", json!(self.optimizer.name())),
            ("momentum", json!(self.momentum())),
            ("nesterov", json!(self.nesterov)),
            ("weight_decay", json!(self.weight_decay)),
            ("schedule", schedule),
            ("warmup_epochs", json!(self.warmup_epochs)),
            ("scale_lr", scale_lr),
            // As typed (0.1, not the f32's 0.10000000149...).
            (
                "label_smoothing",
                json!((f64::from(self.label_smoothing) * 1e6).round() / 1e6),
            ),
            ("monitor", json!(self.monitor.column())),
            ("patience", json!(self.patience)),
            ("min_delta", json!(self.min_delta)),
            ("image_size", json!(self.image_size)),
            (
                "augmentation",
                json!({
                    "crop_scale": self.augmentation.crop_scale.map(|(a, b)| [a, b]),
                    "flip": self.augmentation.flip,
                    "rotate": self.augmentation.rotate,
                    "shear": self.augmentation.shear,
                    "color_jitter": self.augmentation.color_jitter,
                }),
            ),
            ("seed", json!(self.seed)),
            ("grad_accum", json!(self.grad_accum)),
            ("compression", json!(self.compression.name())),
            ("precision", json!(self.precision.name())),
            ("zero", json!(self.zero)),
            ("recompute", json!(self.recompute)),
            // How the run was started, for a bare `--resume RUN` to start it the same way
            // (the processes may change on resume).
            (
                "launch",
                json!({
                    "processes": self.dist.as_ref().map_or(1, |d| d.world),
                    "elastic": self.elastic.is_some(),
                }),
            ),
        ])
        .into_iter()
        .chain(self.mode_hyperparameters())
        .collect()
    }

    /// The hyperparameters of the pipeline and parameter-server modes, where the run is one.
    fn mode_hyperparameters(&self) -> Vec<(&'static str, serde_json::Value)> {
        use serde_json::json;
        let pipeline = self.pipeline.as_ref().map(|p| {
            (
                "pipeline",
                json!({
                    "stages": p.stages,
                    "micro_batches": p.micro_batches,
                    "schedule": p.schedule.name(),
                    "split": p.split.as_ref().map(|s| {
                        s.iter().map(|r| format!("{}:{}", r.start, r.end)).collect::<Vec<_>>()
                    }),
                    "balance": p.balance.name(),
                }),
            )
        });
        let ps = self.ps.as_ref().map(|p| {
            (
                "ps",
                json!({
                    "servers": match p.servers {
                        super::PsServers::Dedicated(n) => json!(n),
                        super::PsServers::Colocated => json!("colocated"),
                    },
                    "mode": p.mode.name(),
                    // What ran (the mode's default where not given); sync has none.
                    "window": (p.mode != burn_dist::ps::Mode::Sync).then(|| p.window()),
                    "rho": p.rho,
                    "staleness": p.staleness,
                }),
            )
        });
        pipeline.into_iter().chain(ps).collect()
    }
}
