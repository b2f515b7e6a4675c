//! The library names a setting by its path in [`crate::train::TrainConfig`] (`optim.lr`,
//! `model.weights`, `PsOptions.window`; `device` for the device a command runs on), in
//! backticks, in the errors it returns; the `hearth`
//! command line shows the same errors with its flags instead ([`with_flags`]). One table holds
//! the pairs, so a message is written once and reads right on either side.

/// (setting as the library's errors name it, the `hearth` flag that sets it: `hearth train`'s,
/// and `hearth predict`'s `--num-classes`).
pub const SETTING_FLAGS: &[(&str, &str)] = &[
    ("run_dir", "--run-dir"),
    ("batch_size", "--batch-size"),
    ("epochs", "--epochs"),
    ("data.folder", "--data"),
    ("data.labels", "--labels"),
    ("data.image_size", "--size"),
    ("data.val_fraction", "--val-fraction"),
    ("data.workers", "--workers"),
    ("data.mixup", "--mixup"),
    ("data.cutmix", "--cutmix"),
    ("data.mixup_prob", "--mixup-prob"),
    ("data.mixup_switch_prob", "--mixup-switch-prob"),
    ("data.mixup_off_epoch", "--mixup-off-epoch"),
    ("model.name", "--model"),
    ("model.num_classes", "--num-classes"),
    ("model.weights", "--weights"),
    ("model.freeze_backbone", "--freeze-backbone"),
    ("model.unfreeze_after", "--unfreeze-after"),
    ("model.finetune_lr", "--finetune-lr"),
    ("model.finetune_bn", "--finetune-bn"),
    ("optim.optimizer", "--optimizer"),
    ("optim.lr", "--lr"),
    ("optim.warmup_epochs", "--warmup-epochs"),
    ("optim.momentum", "--momentum"),
    ("optim.nesterov", "--nesterov"),
    ("optim.label_smoothing", "--label-smoothing"),
    ("optim.grad_accum", "--grad-accum"),
    ("optim.clip_grad", "--clip-grad"),
    ("optim.weight_decay", "--weight-decay"),
    ("optim.model_ema", "--model-ema"),
    ("checkpoint.resume", "--resume"),
    ("checkpoint.overwrite", "--overwrite"),
    ("checkpoint.monitor", "--monitor"),
    ("checkpoint.patience", "--patience"),
    ("checkpoint.min_delta", "--min-delta"),
    ("checkpoint.log_every", "--log-every"),
    ("checkpoint.stop_after_epoch", "--stop-after-epoch"),
    ("price_per_hour", "--price-per-hour"),
    ("compute.precision", "--precision"),
    ("device", "--device"),
    ("compute.recompute", "--recompute"),
    ("exchange.bucket_bytes", "--bucket-mb"),
    ("exchange.compression", "--compression"),
    ("exchange.zero", "--zero"),
    ("exchange.overlap", "--overlap"),
    ("dist.world", "--nproc"),
    ("TrainingMode::Elastic", "--elastic"),
    ("ElasticOptions.min_workers", "--min-workers"),
    ("ElasticOptions.max_workers", "--max-workers"),
    ("ElasticOptions.rejoin_timeout", "--rejoin-timeout"),
    ("ElasticOptions.hosts_file", "--hosts"),
    ("TrainingMode::ParameterServers", "--ps"),
    ("PsOptions.mode", "--mode"),
    ("PsOptions.window", "--window"),
    ("PsOptions.rho", "--rho"),
    ("PsOptions.staleness", "--staleness"),
    ("PipelineOptions.stages", "--pipeline-stages"),
    ("PipelineOptions.micro_batches", "--micro-batches"),
    ("PipelineOptions.split", "--pipeline-split"),
    ("PipelineOptions.schedule", "--pipeline-schedule"),
];

/// `text` with every setting the table knows, in backticks, replaced by its flag: what the
/// command line prints for a library error.
pub fn with_flags(text: &str) -> String {
    let mut out = text.to_string();
    for (setting, flag) in SETTING_FLAGS {
        out = out.replace(&format!("`{setting}`"), flag);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_and_each_flag_appears_once_and_the_mapping_reads_both_ways() {
        for (i, (s, f)) in SETTING_FLAGS.iter().enumerate() {
            for (t, g) in &SETTING_FLAGS[i + 1..] {
                assert!(s != t && f != g, "{s} {f} / {t} {g}");
            }
        }
        assert_eq!(
            with_flags("`optim.lr` 0 must be positive; `model.weights` and `lr` stay"),
            "--lr 0 must be positive; --weights and `lr` stay"
        );
    }
}
