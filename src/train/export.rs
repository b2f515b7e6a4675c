//! The end of a run: the best epoch's weights into `model.bpk` with the model's configuration,
//! class names and input preprocessing, the metrics plot, and (multi-label) `auroc.csv`.

use std::path::Path;

use super::run_dir::write_atomic;
use super::targets::Targets;
use super::trainee::{Net, Stream};
use crate::{HearthError, Result};

/// Exports epoch `best`'s checkpoint as the run's `model.bpk` (the trainee's file: for Hearth's
/// classifiers with the model's config, class names and evaluation preprocessing; the weight
/// average's where `checkpoint.monitor` reads it), with `optim.model_ema` that epoch's average
/// as `model_ema.bpk`, and for a multi-label run `auroc.csv` over the whole validation set;
/// returns the per-class AUROCs.
pub(super) fn export_best<T: super::trainee::Trainee>(
    cfg: &super::TrainConfig,
    trainee: &T,
    best: usize,
    device: &burn::prelude::Device,
    gate: &super::gate::Gate,
    log: &mut dyn FnMut(&str),
) -> Result<Option<Vec<(String, f64)>>> {
    // What the steps freed and kept for the next step goes back before the best model is
    // built: no step comes (every mode exports here, after its training).
    crate::alloc::release_freed_memory();
    // The weights the monitored column scored: the average's where it reads the average.
    let monitor = cfg.checkpoint.monitor;
    let (path, what) = if monitor.averaged() {
        (
            super::ema::ema_checkpoint(&cfg.run_dir, best),
            ": its weight average,",
        )
    } else {
        (super::checkpoint::model_checkpoint(&cfg.run_dir, best), "")
    };
    export_file(cfg, trainee, &path, device, "model.bpk", gate)?;
    log(&format!(
        "exported the best epoch ({best}, by {}){what} into {}",
        monitor.column(),
        cfg.run_dir.join("model.bpk").display()
    ));
    if cfg.optim.model_ema.is_some() {
        export_ema(cfg, trainee, best, device, gate, log)?;
    }
    if !trainee.multi_label() {
        return Ok(None);
    }
    let model = super::trainee::load_checkpoint(trainee, &path, device)?;
    auroc_report(
        true,
        &model,
        trainee.classes(),
        trainee.full_val(device),
        &cfg.run_dir,
        log,
    )
}

/// Exports the best epoch's checkpoint file `path` as `run_dir/name`
/// ([`super::trainee::Trainee::export_checkpoint`]), landed through `gate`.
fn export_file<T: super::trainee::Trainee>(
    cfg: &super::TrainConfig,
    trainee: &T,
    path: &Path,
    device: &burn::prelude::Device,
    name: &str,
    gate: &super::gate::Gate,
) -> Result<()> {
    let out = cfg.run_dir.join(name);
    let tmp = super::gate::Gate::temp_for(&out);
    // An error names the checkpoint (`model-<best>.bpk`) and what was wrong with it.
    if let Err(e) = trainee.export_checkpoint(cfg, path, device, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    gate.land(&tmp, &out)
}

/// `optim.model_ema`: the best epoch's weight average as `model_ema.bpk`, in the same form as
/// `model.bpk` (so `hearth eval` and `predict` take it).
fn export_ema<T: super::trainee::Trainee>(
    cfg: &super::TrainConfig,
    trainee: &T,
    best: usize,
    device: &burn::prelude::Device,
    gate: &super::gate::Gate,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    let path = super::ema::ema_checkpoint(&cfg.run_dir, best);
    export_file(cfg, trainee, &path, device, "model_ema.bpk", gate)?;
    log(&format!(
        "exported the best epoch's ({best}) weight average into {}",
        cfg.run_dir.join("model_ema.bpk").display()
    ));
    Ok(())
}

/// A multi-label run's `auroc.csv` for its exported `model` ([`write_auroc`]) over the whole
/// validation set `val`; nothing for a single-label run.
pub(super) fn auroc_report<M: Net>(
    multi_label: bool,
    model: &M,
    classes: &[String],
    val: Stream<M::Input>,
    run_dir: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<Option<Vec<(String, f64)>>> {
    if !multi_label {
        return Ok(None);
    }
    write_auroc(model, classes, val, run_dir, log).map(Some)
}

/// Writes `auroc.csv`: each class's validation AUROC of `model` (the exported one), said in
/// `log`; returns the classes where it is defined.
fn write_auroc<M: Net>(
    model: &M,
    classes: &[String],
    val: Stream<M::Input>,
    run_dir: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<Vec<(String, f64)>> {
    let aucs = per_class_auroc(model, classes.len(), val)?;
    let mut text = String::from("class,auroc\n");
    for (name, auc) in classes.iter().zip(&aucs) {
        let shown = auc.map(|a| format!("{a:.6}")).unwrap_or_default();
        text.push_str(&format!("{name},{shown}\n"));
        log(&format!(
            "  AUROC {name}: {}",
            auc.map(|a| format!("{a:.4}"))
                .unwrap_or("undefined (one outcome only)".into())
        ));
    }
    write_atomic(&run_dir.join("auroc.csv"), &text)?;
    Ok(classes
        .iter()
        .zip(aucs)
        .filter_map(|(n, a)| a.map(|a| (n.clone(), a)))
        .collect())
}

/// Each of the `k` classes' AUROC over the validation set (`None` where a class has one
/// outcome only).
fn per_class_auroc<M: Net>(model: &M, k: usize, val: Stream<M::Input>) -> Result<Vec<Option<f64>>> {
    let model = model.valid();
    let mut scores: Vec<Vec<(f64, bool)>> = vec![Vec::new(); k];
    for batch in val {
        let (input, targets) = batch?;
        let Targets::MultiHot(hot) = targets else {
            return Err(HearthError::Training(
                "AUROC needs multi-hot validation labels".into(),
            ));
        };
        let logits = model.logits(input);
        let [n, outputs] = logits.dims();
        if outputs != k {
            return Err(HearthError::Training(format!(
                "the model gives {outputs} outputs for {k} labels"
            )));
        }
        let logits = logits
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| HearthError::Training(format!("reading outputs: {e:?}")))?;
        let hot = hot
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| HearthError::Training(format!("reading labels: {e:?}")))?;
        for row in 0..n {
            for (c, s) in scores.iter_mut().enumerate() {
                s.push((logits[row * k + c] as f64, hot[row * k + c] > 0.5));
            }
        }
    }
    Ok(scores
        .into_iter()
        .map(|s| crate::metrics::auroc(&s))
        .collect())
}
