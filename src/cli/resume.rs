//! `hearth train --resume RUN`: the settings the run recorded in `hparams.json`, taken for
//! every one the command line does not set.

use anyhow::{Context, Result};

/// `--resume RUN`: the run's recorded settings (`hparams.json`) for every one the command line
/// does not set. Runs whose file predates typed values keep the command line's.
pub(crate) fn take_recorded(cfg: &mut hearth::train::TrainConfig) -> Result<Vec<String>> {
    if !cfg.resume {
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
    let args: Vec<String> = std::env::args().collect();
    let given = |key: &str| {
        recorded_flags(key).iter().any(|f| {
            args.iter()
                .any(|a| a == f || a.starts_with(&format!("{f}=")))
        })
    };
    Ok(cfg.take_recorded(&saved, &given)?)
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
        ],
        "seed" => &["--seed"],
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
