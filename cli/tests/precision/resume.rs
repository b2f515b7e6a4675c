//! bf16 and fp16 runs stopped and resumed equal the uninterrupted runs, the loss scale
//! included: one process, data parallel, elastic, pipelines and parameter servers.

use super::*;

#[test]
fn bf16_and_fp16_runs_resume_exactly_the_loss_scale_included() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    for precision in ["bf16", "fp16"] {
        let straight = dir.path().join(format!("{precision}-straight"));
        let resumed = dir.path().join(format!("{precision}-resumed"));
        train_cli(&data, &straight, precision, 3, &[], "0:3");
        train_cli(
            &data,
            &resumed,
            precision,
            3,
            &["--stop-after-epoch", "1"],
            "0:3",
        );
        // `--resume RUN` alone: the run's settings, precision included, come from its
        // hparams.json.
        let (ok, log) = hearth(
            &["train", "--resume", resumed.to_str().unwrap()],
            &[("HEARTH_FP16_OVERFLOW_AT_STEP", "0:3")],
            Duration::from_secs(300),
        );
        assert!(ok, "{log}");
        let last = |run: &Path| common::tensors(&run.join("checkpoint/model-3.bpk"));
        let (a, b) = (last(&straight), last(&resumed));
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(va == vb, "{precision}: {na} differs after a resume:\n{log}");
        }
        if precision == "fp16" {
            // The overflow forced at step 3 (in the first launch) halved the scale; the resumed
            // launch went on from the halved scale instead of 2^16, and did not count step 3
            // again.
            let scale = |run: &Path| {
                std::fs::read_to_string(run.join("checkpoint/loss-scale-3.json")).unwrap()
            };
            assert_eq!(scale(&straight), scale(&resumed));
            assert!(
                scale(&resumed).contains(r#""scale":32768.0"#),
                "{}",
                scale(&resumed)
            );
            assert!(
                !log.contains("optimizer step 3:"),
                "step 3 counted again:\n{log}"
            );
        }
    }
}

/// fp16 elastic (2 workers), pipeline (2 stages) and sync parameter-server (2 workers, 1
/// server) runs stopped after epoch 1 and resumed equal the straight runs (bit for bit; the
/// servers to 1e-5): the loss scale, halved by the overflow forced at step 3, travels in the
/// elastic state, in each stage's checkpoint and in each server worker's own file, so the
/// resumed launch goes on from it (and does not count step 3 again).
#[test]
fn fp16_elastic_pipeline_and_server_runs_resume_exactly_with_their_loss_scale() {
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let mut base = MODE_BASE.to_vec();
    base[1] = "3";
    // Sync servers resume to 1e-5 (tests/ps_train.rs: the servers' sums), the others exactly.
    for (name, world, mode, hook, tolerance) in [
        ("elastic", 2, vec!["--elastic"], "w1:3", 0.0),
        ("pipeline", 2, vec!["--pipeline-stages", "2"], "1:3", 0.0),
        ("ps", 3, vec!["--ps", "1", "--mode", "sync"], "w1:3", 1e-5),
    ] {
        let env = [("HEARTH_FP16_OVERFLOW_AT_STEP", hook)];
        let job = |run: &Path, extra: &[&str]| -> String {
            let mut args = mode.clone();
            args.extend(["--precision", "fp16"]);
            args.extend_from_slice(extra);
            let mut job = common::Job::spawn(dir.path(), &data, run, world, &base, &args, &env);
            let ok = job.wait(300);
            let logs = job.all_logs();
            assert!(ok.iter().all(|&o| o), "{name} {extra:?}:\n{logs}");
            logs
        };
        let straight = dir.path().join(format!("{name}-straight"));
        let resumed = dir.path().join(format!("{name}-resumed"));
        let first = job(&straight, &[]);
        assert!(
            first.contains("fp16: optimizer step 3: gradients not finite"),
            "{first}"
        );
        job(&resumed, &["--stop-after-epoch", "1"]);
        let log = job(&resumed, &["--resume"]);
        // "resuming after epoch 1" (pipeline), "resuming at step 8 (epoch 2, ..." (elastic).
        assert!(log.contains("resuming"), "{log}");
        assert!(
            !log.contains("optimizer step 3:"),
            "{name}: step 3 counted again:\n{log}"
        );
        let (a, b) = (
            common::tensors(&straight.join("model.bpk")),
            common::tensors(&resumed.join("model.bpk")),
        );
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            let gap = common::max_abs_diff(va, vb);
            assert!(
                gap <= tolerance,
                "{name}: {na} differs by {gap} after a resume:\n{log}"
            );
        }
        let (ma, mb) = (common::metrics(&straight), common::metrics(&resumed));
        for (epoch, row) in &ma {
            assert_eq!(
                row["train_skipped_steps"], mb[epoch]["train_skipped_steps"],
                "{name} epoch {epoch}"
            );
            let gap = (row["val_loss"] - mb[epoch]["val_loss"]).abs();
            assert!(
                gap <= 1e3 * f64::from(tolerance),
                "{name} epoch {epoch}: val_loss {gap}"
            );
        }
    }
}
