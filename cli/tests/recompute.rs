//! `--recompute`, activation recomputation, as real process trees in every training mode of
//! Hearth's image models (ResNet; DenseNet and VGG in one process and data parallel): it trains exactly as the run without it does (the default ResNet has
//! batch norm, whose running statistics must move once per batch, not again in the
//! recomputation), and a custom module, which has no units, refuses it by name.

mod common;

use common::{CURVES, Job, USUAL, metrics, same_curves, same_weights, small_data};

#[test]
fn recompute_trains_exactly_as_without_it_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let frozen: &[&str] = &["--freeze-backbone", "--unfreeze-after", "1"];
    let frozen_pipeline: &[&str] = &[
        "--pipeline-stages",
        "2",
        "--freeze-backbone",
        "--unfreeze-after",
        "1",
    ];
    let modes: [(&str, usize, &[&str]); 10] = [
        // A frozen backbone (nothing flows back through it), then fine-tuning.
        ("frozen", 1, frozen),
        ("frozen-pipeline", 2, frozen_pipeline),
        ("single", 1, &[]),
        // DenseNet's units concatenate their input; VGG's are single convolutions and the
        // classifier.
        ("densenet", 1, &["--model", "densenet-mini"]),
        ("vgg", 2, &["--model", "vgg-mini-plain"]),
        ("dp", 2, &[]),
        ("dp-bf16", 2, &["--precision", "bf16"]),
        ("elastic", 2, &["--elastic"]),
        ("ps", 3, &["--ps", "1", "--mode", "sync"]),
        (
            "pipeline",
            2,
            &["--pipeline-stages", "2", "--micro-batches", "3"],
        ),
    ];
    for (name, world, args) in modes {
        let run = |on: bool| dir.path().join(format!("{name}-{on}"));
        for on in [false, true] {
            let mut all = vec!["--epochs", "2"];
            all.extend_from_slice(args);
            if on {
                all.push("--recompute");
            }
            let logs = Job::spawn_ok(dir.path(), &data, &run(on), world, &USUAL, &all, &[]);
            if on {
                assert!(logs.contains("--recompute: each"), "{name}:\n{logs}");
            }
        }
        same_curves(
            (name, &metrics(&run(false))),
            ("with --recompute", &metrics(&run(true))),
            &CURVES,
            1e-5,
        );
        same_weights(
            &run(false).join("model.bpk"),
            &run(true).join("model.bpk"),
            1e-5,
        );
    }
}

#[test]
fn a_run_resumed_without_recompute_goes_on_as_it_would_have() {
    // Stopped after epoch 1 with --recompute, resumed with --no-recompute: the same curve as
    // the uninterrupted run, and the resumed launch says nothing of recomputation; resumed
    // without either flag, it recomputes as recorded.
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let run = |name: &str, args: &[&str]| {
        Job::spawn_ok(
            dir.path(),
            &data,
            &dir.path().join(name),
            1,
            &USUAL,
            args,
            &[],
        )
    };
    run("straight", &["--epochs", "2"]);
    run(
        "resumed",
        &["--epochs", "2", "--recompute", "--stop-after-epoch", "1"],
    );
    let logs = run("resumed", &["--resume", "--no-recompute"]);
    assert!(
        logs.contains("resuming after epoch 1") && !logs.contains("--recompute: each"),
        "{logs}"
    );
    same_curves(
        ("straight", &metrics(&dir.path().join("straight"))),
        (
            "resumed without --recompute",
            &metrics(&dir.path().join("resumed")),
        ),
        &CURVES,
        1e-5,
    );
    // Without either flag a resume keeps the recorded setting.
    run(
        "kept",
        &["--epochs", "2", "--recompute", "--stop-after-epoch", "1"],
    );
    let logs = run("kept", &["--resume"]);
    assert!(logs.contains("--recompute: each"), "{logs}");
}
