//! `--overlap`: data parallel's gradient exchange overlapped with the backward pass, as real
//! process trees. Each run trains as the same run without it does, to 1e-6 in the weights and
//! the curves: ResNet over QUIC, DenseNet over shared memory, VGG with `--recompute`, and
//! ResNet in fp16 with an overflow forced on one rank (the step skipped on both). Buckets of
//! 10 KB, so every step reduces several while the backward runs. Each overlapped run must
//! say that its exchange overlapped (the step handed its gradients over, unit by unit), and
//! never that it ran its backward whole; on shared memory it says it is not expected to pay
//! on one host.

mod common;

use common::{CURVES, Job, USUAL, metrics, same_curves, same_weights, small_data};

#[test]
fn overlap_trains_exactly_as_the_exchange_after_the_backward() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    // (name, extra flags, extra environment).
    type Case<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: [Case; 4] = [
        ("resnet-quic", &[], &[("HEARTH_SHM", "0")]),
        ("densenet-shm", &["--model", "densenet-mini"], &[]),
        (
            "vgg-recompute",
            &["--model", "vgg-mini-plain", "--recompute"],
            &[],
        ),
        (
            "fp16-overflow",
            &["--precision", "fp16"],
            &[("HEARTH_FP16_OVERFLOW_AT_STEP", "1:3")],
        ),
    ];
    for (name, args, env) in cases {
        let run = |on: bool| dir.path().join(format!("{name}-{on}"));
        for on in [false, true] {
            let mut all = vec!["--epochs", "2", "--bucket-mb", "0.01"];
            all.extend_from_slice(args);
            if on {
                all.push("--overlap");
            }
            let logs = Job::spawn_ok(dir.path(), &data, &run(on), 2, &USUAL, &all, env);
            let overlapped = logs.contains("gradient exchange (overlapped with the backward)");
            assert_eq!(overlapped, on, "{name} {all:?}:\n{logs}");
            assert!(!logs.contains("ran its backward whole"), "{name}:\n{logs}");
            // Every rank on one host through shared memory: the run says the overlap is not
            // expected to pay there (not over QUIC, and not without --overlap).
            let one_host = logs.contains("--overlap: every rank is on this host");
            assert_eq!(
                one_host,
                on && name != "resnet-quic",
                "{name} {all:?}:\n{logs}"
            );
            if name == "fp16-overflow" {
                // The hook's step 3 falls in epoch 2 (2 steps an epoch): counted over the run.
                let skipped: f64 = metrics(&run(on))
                    .values()
                    .map(|r| r["train_skipped_steps"])
                    .sum();
                assert!(
                    skipped >= 1.0,
                    "{name} {on}: the forced overflow was not skipped"
                );
            }
        }
        same_curves(
            (name, &metrics(&run(false))),
            ("with --overlap", &metrics(&run(true))),
            &CURVES,
            1e-6,
        );
        same_weights(
            &run(false).join("model.bpk"),
            &run(true).join("model.bpk"),
            1e-6,
        );
    }
}

#[test]
fn a_run_resumed_with_overlap_goes_on_as_it_would_have() {
    // Not a hyperparameter: stopped after epoch 1 without --overlap and resumed with it, the
    // run ends where the uninterrupted one without it does.
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let run = |name: &str, args: &[&str]| {
        Job::spawn_ok(
            dir.path(),
            &data,
            &dir.path().join(name),
            2,
            &USUAL,
            args,
            &[],
        )
    };
    run("straight", &["--epochs", "2"]);
    run("resumed", &["--epochs", "2", "--stop-after-epoch", "1"]);
    let logs = run("resumed", &["--resume", "--overlap"]);
    assert!(
        logs.contains("resuming after epoch 1") && logs.contains("(overlapped with the backward)"),
        "{logs}"
    );
    same_curves(
        ("straight", &metrics(&dir.path().join("straight"))),
        (
            "resumed with --overlap",
            &metrics(&dir.path().join("resumed")),
        ),
        &CURVES,
        1e-6,
    );
    same_weights(
        &dir.path().join("straight").join("model.bpk"),
        &dir.path().join("resumed").join("model.bpk"),
        1e-6,
    );
}
