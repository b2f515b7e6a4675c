//! `hearth train --resume RUN`: the settings the run recorded in `hparams.json`, taken for
//! every one the command line does not set.

use anyhow::{Context, Result, bail};
use hearth::train::LaunchRecord;

/// Whether the command line sets `flag` (`--flag V` or `--flag=V`).
pub(crate) fn given(flag: &str) -> bool {
    std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

/// `--resume RUN` outside a launched job: how RUN was started (`launch` in its
/// `hparams.json`), so that a bare resume starts it the same way. `None` for a run whose file
/// predates the record. A missing `hparams.json` is an error when the command line gives
/// nothing else to go by, and said otherwise.
pub(crate) fn recorded_launch(run: &std::path::Path) -> Result<Option<LaunchRecord>> {
    let path = run.join("hparams.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // No run there at all: the run directory's own check says so (a mistyped path).
            if !run.join("metrics.csv").exists() && !run.join("checkpoint").exists() {
                return Ok(None);
            }
            // Only `train --resume RUN` (and its device) on the command line: nothing to go by.
            let bare = std::env::args()
                .skip(2)
                .filter(|a| a.starts_with("--"))
                .all(|a| {
                    ["--resume", "--device", "--autotune", "--kernel-bundle"]
                        .iter()
                        .any(|f| a == *f || a.starts_with(&format!("{f}=")))
                });
            if bare {
                bail!(
                    "cannot resume {}: {} is missing, so the run's settings (model, data, batch \
                     size, schedule, processes) cannot be restored; give them on the command \
                     line with --resume",
                    run.display(),
                    path.display()
                );
            }
            eprintln!(
                "warning: --resume: {} is missing; nothing is restored from it, the command \
                 line's settings (and their defaults) apply",
                path.display()
            );
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut saved: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    let launch = match saved.remove("launch") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(l) => serde_json::from_value::<LaunchRecord>(l)
            .with_context(|| format!("{}: launch", path.display()))?,
    };
    if launch.processes == 0 {
        bail!("{}: launch.processes is 0", path.display());
    }
    Ok(Some(launch))
}

/// `--resume RUN`: the run's recorded settings (`hparams.json`) for every one the command line
/// does not set. Runs whose file predates typed values keep the command line's.
pub(crate) fn take_recorded(cfg: &mut hearth::train::TrainConfig) -> Result<Vec<String>> {
    if !cfg.checkpoint.resume {
        return Ok(Vec::new());
    }
    let path = cfg.run_dir.join("hparams.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let saved: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    if saved.values().all(serde_json::Value::is_string) {
        return Ok(Vec::new());
    }
    let set = |key: &str| recorded_flags(key).iter().any(|f| given(f));
    Ok(cfg.take_recorded(&saved, &set)?)
}

/// The flags that set each setting `hparams.json` records.
fn recorded_flags(key: &str) -> &'static [&'static str] {
    match key {
        "data" => &["--data"],
        "labels" => &["--labels"],
        "val_fraction" => &["--val-fraction"],
        "model" => &["--model"],
        "weights" => &["--weights"],
        "freeze_backbone" => &["--freeze-backbone"],
        "unfreeze_after" => &["--unfreeze-after"],
        "finetune_lr" => &["--finetune-lr"],
        "finetune_bn" => &["--finetune-bn"],
        "epochs" => &["--epochs"],
        "batch_size" => &["--batch-size"],
        "lr" => &["--lr"],
        "optimizer" => &["--optimizer"],
        "momentum" => &["--momentum"],
        "nesterov" => &["--nesterov"],
        "weight_decay" => &["--weight-decay"],
        "schedule" => &["--schedule"],
        "warmup_epochs" => &["--warmup-epochs"],
        "scale_lr" => &["--scale-lr", "--base-batch"],
        "label_smoothing" => &["--label-smoothing"],
        "clip_grad" => &["--clip-grad"],
        "model_ema" => &["--model-ema", "--model-ema-decay"],
        "monitor" => &["--monitor"],
        "patience" => &["--patience"],
        "min_delta" => &["--min-delta"],
        "image_size" => &["--size"],
        "augmentation" => &[
            "--augment",
            "--crop-scale",
            "--flip",
            "--no-flip",
            "--rotate",
            "--shear",
            "--color-jitter",
            "--random-erasing",
            "--auto-augment",
        ],
        "seed" => &["--seed"],
        "mixup" => &["--mixup"],
        "cutmix" => &["--cutmix"],
        "mixup_prob" => &["--mixup-prob"],
        "mixup_switch_prob" => &["--mixup-switch-prob"],
        "mixup_off_epoch" => &["--mixup-off-epoch"],
        "grad_accum" => &["--grad-accum"],
        "compression" => &["--compression"],
        "precision" => &["--precision"],
        "zero" => &["--zero"],
        "recompute" => &["--recompute", "--no-recompute"],
        "pipeline" => &[
            "--pipeline-stages",
            "--micro-batches",
            "--pipeline-schedule",
            "--pipeline-split",
            "--pipeline-balance",
        ],
        "ps" => &["--ps", "--mode", "--window", "--rho", "--staleness"],
        _ => &[],
    }
}
