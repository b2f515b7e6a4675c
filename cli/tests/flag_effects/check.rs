//! What each [`Effect`] means in files: the runs it compares and what it reads from them.

use super::*;

pub(super) fn check(
    mode: &str,
    effect: Effect,
    s: &Setup,
    baseline: &Run,
    references: &mut BTreeMap<Vec<String>, Run>,
    changed: f32,
) -> Result<(), String> {
    let ran = |extra: &[String]| -> Result<Run, String> {
        let run = s.run_in(mode, extra, &s.fresh_dir());
        if run.ok && run.path.join("model.bpk").is_file() {
            Ok(run)
        } else {
            Err(format!("the run failed:\n{}", run.text))
        }
    };
    // The run of `reference` (the baseline where empty), run once however many ask.
    let mut reference_path = |reference: &Vec<String>| -> Result<PathBuf, String> {
        if reference.is_empty() {
            return Ok(baseline.path.clone());
        }
        if !references.contains_key(reference) {
            let r = ran(reference)?;
            references.insert(reference.clone(), r);
        }
        Ok(references[reference].path.clone())
    };
    match effect {
        Effect::Changes { reference, with } => {
            let reference_run = reference_path(&reference)?;
            let run = ran(&with)?;
            let gap = result_gap(&reference_run, &run.path);
            if gap > changed {
                Ok(())
            } else {
                Err(format!(
                    "{with:?} left the model as {reference:?} trained it (largest difference \
                     {gap}):\n{}",
                    run.text
                ))
            }
        }
        Effect::Same {
            with,
            tolerance,
            mechanism,
            uses,
        } => {
            check_mechanism(mechanism, uses)?;
            let run = ran(&with)?;
            let gap = result_gap(&baseline.path, &run.path);
            if gap <= tolerance {
                Ok(())
            } else {
                Err(format!(
                    "{with:?} changed the model by {gap} (promised: the same arithmetic)"
                ))
            }
        }
        Effect::Stops {
            with,
            patience,
            min_delta,
            epochs,
        } => {
            let run = ran(&with)?;
            let rows = common::metrics(&run.path);
            let end = common::patience_end(&rows, patience, min_delta, epochs);
            if end >= epochs {
                return Err(format!("the setting should stop early: {rows:?}"));
            }
            if rows.len() == end {
                Ok(())
            } else {
                Err(format!(
                    "ran {} epochs, the patience rule ends at {end}: {rows:?}\n{}",
                    rows.len(),
                    run.text
                ))
            }
        }
        Effect::Monitors { with, column } => {
            let run = ran(&with)?;
            let rows = common::metrics(&run.path);
            // The first epoch with the lowest loss (an improvement must be strict).
            let mut best = (0, f64::MAX);
            for (&e, r) in &rows {
                if r[column] < best.1 {
                    best = (e, r[column]);
                }
            }
            let said = common::best_epoch(&run.text)
                .ok_or_else(|| format!("no 'best epoch: N' in:\n{}", run.text))?;
            if said != best.0 {
                return Err(format!(
                    "exported epoch {said}, the best {column} is epoch {}: {rows:?}",
                    best.0
                ));
            }
            // The epoch exported is the one restored, by the monitored metric.
            let restored = format!("best epoch ({said}, by {column})");
            if said < rows.len() && !run.text.contains(&restored) {
                return Err(format!("no {restored:?} in:\n{}", run.text));
            }
            Ok(())
        }
        Effect::Rows { with, rows } => {
            let run = ran(&with)?;
            let got = common::metrics(&run.path).len();
            if got == rows {
                Ok(())
            } else {
                Err(format!("{got} epochs, not {rows}:\n{}", run.text))
            }
        }
        Effect::Averages { reference, with } => {
            let reference_run = reference_path(&reference)?;
            let run = ran(&with)?;
            let trained = model_gap(
                &reference_run.join("model.bpk"),
                &run.path.join("model.bpk"),
            );
            let average = run.path.join("model_ema.bpk");
            let own = if average.is_file() {
                model_gap(&run.path.join("model.bpk"), &average)
            } else {
                return Err(format!("no model_ema.bpk:\n{}", run.text));
            };
            let earlier = reference_run.join("model_ema.bpk");
            let other = if earlier.is_file() {
                model_gap(&earlier, &average)
            } else {
                f32::INFINITY
            };
            let rows = common::metrics(&run.path);
            let columns = rows.values().all(|r| r.contains_key("val_ema_accuracy"));
            if trained <= changed / 100.0 && own > changed && other > changed && columns {
                Ok(())
            } else {
                Err(format!(
                    "{with:?}: the model moved by {trained} from {reference:?}'s (it should not), \
                     the average differs from it by {own} and from {reference:?}'s by {other} \
                     (both should), val_ema_accuracy in every row: {columns}:\n{}",
                    run.text
                ))
            }
        }
        Effect::Priced => {
            // At 3600 per node-hour the cost is the job's process-seconds.
            let run = ran(&args(&["--price-per-hour", "3600"]))?;
            let cost = summary_number(&run.text, "cost");
            let wall = summary_number(&run.text, "wall time:");
            let expected = processes(mode) * wall;
            if baseline.text.contains(", cost") {
                return Err("a run without --price-per-hour prints a cost".into());
            }
            // The wall time is printed to 0.1 s; an elastic job counts each worker's own time.
            if (cost - expected).abs() <= 0.1 * processes(mode) + 0.25 * expected {
                Ok(())
            } else {
                Err(format!(
                    "cost {cost} for {} processes of {wall} s:\n{}",
                    processes(mode),
                    run.text
                ))
            }
        }
        Effect::Overwrites => {
            let dir = s.fresh_dir();
            let first = s.run_in(mode, &[], &dir);
            if !first.ok {
                return Err(first.text);
            }
            let refused = s.run_in(mode, &args(&["--epochs", "2"]), &dir);
            if refused.ok || !refused.text.contains("--overwrite") {
                return Err(format!(
                    "a second run into a used directory, without --overwrite:\n{}",
                    refused.text
                ));
            }
            // Elastic: the other worker ends with rank 0's reason, heard through the
            // rendezvous (not after waiting for it until the rendezvous times out).
            if mode == "elastic"
                && !refused
                    .text
                    .contains("rank 0 of the elastic job did not start it")
            {
                return Err(format!(
                    "the second worker did not end with rank 0's refusal:\n{}",
                    refused.text
                ));
            }
            let second = s.run_in(mode, &args(&["--epochs", "2", "--overwrite"]), &dir);
            let rows = common::metrics(&dir).len();
            if second.ok && rows == 2 {
                Ok(())
            } else {
                Err(format!("with --overwrite: {rows} epochs\n{}", second.text))
            }
        }
        Effect::Resumes => {
            let straight = ran(&args(&["--epochs", "2"]))?;
            let dir = s.fresh_dir();
            let first = s.run_in(
                mode,
                &args(&["--epochs", "2", "--stop-after-epoch", "1"]),
                &dir,
            );
            if !first.ok {
                return Err(first.text);
            }
            // `--resume RUN` alone: the mode, its world and every setting come from the run.
            let mut all: Vec<String> = match mode {
                "elastic" => args(&["launch", "--elastic", "-n", "2", "--", "hearth", "train"]),
                _ => args(&["train"]),
            };
            all.extend(["--resume".to_string(), dir.to_str().unwrap().to_string()]);
            let resumed = s.hearth(&all, &dir);
            if !resumed.ok {
                return Err(resumed.text);
            }
            let rows = common::metrics(&dir).len();
            let gap = model_gap(&model(&straight), &dir.join("model.bpk"));
            if rows == 2 && gap <= 1e-5 {
                Ok(())
            } else {
                Err(format!(
                    "resumed: {rows} epochs, {gap} from the straight run\n{}",
                    resumed.text
                ))
            }
        }
        Effect::DryRun => {
            let dir = s.fresh_dir();
            let run = s.run_in(mode, &args(&["--dry-run"]), &dir);
            if run.ok && !dir.exists() {
                Ok(())
            } else {
                Err(format!("--dry-run wrote {}:\n{}", dir.display(), run.text))
            }
        }
        Effect::Everywhere => {
            if baseline.path.join("metrics.csv").is_file() {
                Ok(())
            } else {
                Err("the baseline wrote nothing into its --run-dir".into())
            }
        }
        Effect::Elsewhere(mechanism, uses) => check_mechanism(mechanism, uses),
        Effect::Splits {
            with,
            split,
            tolerance,
        } => {
            let run = ran(&with)?;
            let written = std::fs::read_to_string(run.path.join("pipeline_split.txt"))
                .map_err(|e| format!("pipeline_split.txt: {e}"))?;
            let gap = result_gap(&baseline.path, &run.path);
            if written.trim() != split {
                Err(format!("cut at {written:?}, not {split}"))
            } else if gap > tolerance {
                Err(format!("another cut changed the model by {gap}"))
            } else {
                Ok(())
            }
        }
    }
}
