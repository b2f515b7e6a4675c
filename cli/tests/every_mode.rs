//! Issue 25's table, the cells the mode-specific tests leave at their defaults. One recipe turns
//! them all on: an earlier run's `.bpk` under a new head, AdamW with weight decay, linear rate
//! scaling, warmup then cosine decay, gradient accumulation, crop, flip, rotation and shear,
//! and early stopping by validation accuracy. With it:
//! - one process, data parallel (2 ranks), elastic (2 workers) and sync parameter servers
//!   (2 workers, 1 server) train the same curve, stop at the same epoch and export the same
//!   model;
//! - `--compression bf16` changes an elastic run exactly as it changes a data-parallel one;
//! - data-parallel and elastic runs stopped after an epoch and resumed equal the straight ones;
//! - a pipeline (2 stages, and 2 stages x 2 replicas with compression) trains the recipe's
//!   curve without accumulation as one process does;
//! - every mode's `metrics.csv` opens with the same columns, each filled at every epoch;
//! - the recipes' flags (gradient clipping, mixup and cutmix, the weight average) do in every
//!   mode what they do in one process (`every_mode/recipes.rs`).
//!
//! The model has no batch norm or dropout, so every mode computes the same function; the
//! training set (240 images, batches of 24) has only full batches, where burn-train's loss
//! metric and the custom modes' agree. Every process is bounded in time.

mod common;
#[path = "every_mode/recipes.rs"]
mod recipes;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{
    Job, best_epoch, elastic_data, exported_logit_gap, hearth_cli, metrics, patience_end,
};

type Rows = BTreeMap<usize, BTreeMap<String, f64>>;

/// An earlier run's weights: the same model trained one epoch on a 3-class set, so the recipe's
/// 4-class run loads its backbone under a new head.
fn pretrained(dir: &Path) -> PathBuf {
    let data = dir.join("pretrain-data");
    hearth::datasets::synth::generate(
        &data,
        &hearth::datasets::synth::SynthConfig::new(3, 30, 32)
            .with_seed(11)
            .with_val(6),
    )
    .unwrap();
    let run = dir.join("pretrain");
    let out = hearth_cli(&[
        "train",
        "--data",
        data.to_str().unwrap(),
        "--model",
        "vgg-mini-plain",
        "--epochs",
        "1",
        "--batch-size",
        "30",
        "--size",
        "32",
        "--workers",
        "1",
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "pretraining: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    run.join("model.bpk")
}

/// The recipe (`accumulate`: with `--grad-accum 2`).
fn recipe(weights: &Path, accumulate: bool) -> Vec<String> {
    let mut r: Vec<String> = [
        "--model",
        "vgg-mini-plain",
        "--weights",
        weights.to_str().unwrap(),
        "--batch-size",
        "24",
        "--epochs",
        "10",
        "--optimizer",
        "adamw",
        "--lr",
        "0.002",
        "--weight-decay",
        "0.01",
        "--scale-lr",
        "linear",
        "--base-batch",
        "12",
        "--schedule",
        "cosine",
        "--warmup-epochs",
        "1",
        "--augment",
        "light",
        "--crop-scale",
        "0.6,1",
        "--rotate",
        "10",
        "--shear",
        "8",
        "--monitor",
        "val_accuracy",
        "--patience",
        "2",
        // More than one validation image (2.5 points) makes an improvement.
        "--min-delta",
        "2.5",
    ]
    .map(str::to_string)
    .to_vec();
    if accumulate {
        r.extend(["--grad-accum", "2"].map(str::to_string));
    }
    r
}

/// A run of `world` ranks (1: a plain `hearth train`) of `base` and `args` into `run`; its
/// rank 0 log.
fn train(
    dir: &Path,
    data: &Path,
    run: &Path,
    world: usize,
    base: &[String],
    args: &[&str],
) -> String {
    let base: Vec<&str> = base.iter().map(String::as_str).collect();
    if world == 1 {
        let mut all = vec![
            "train",
            "--data",
            data.to_str().unwrap(),
            "--workers",
            "1",
            "--size",
            "32",
        ];
        all.extend(&base);
        all.extend(args.iter().filter(|a| **a != "--resume"));
        all.push(if args.contains(&"--resume") {
            "--resume"
        } else {
            "--run-dir"
        });
        all.push(run.to_str().unwrap());
        let out = hearth_cli(&all);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{} {args:?}:\n{text}", run.display());
        return text;
    }
    let mut job = Job::spawn(dir, data, run, world, &base, args, &[]);
    let ok = job.wait(400);
    assert!(
        ok.iter().all(|&o| o),
        "{} {args:?}:\n{}",
        run.display(),
        job.all_logs()
    );
    job.log(0)
}

/// The largest relative difference of `columns` between two runs' rows; both must have the
/// same epochs.
fn gap(a: &Rows, b: &Rows, columns: &[&str]) -> f64 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same epochs:\n{a:?}\n{b:?}"
    );
    let mut worst = 0f64;
    for (e, row) in a {
        for c in columns {
            let (x, y) = (row[*c], b[e][*c]);
            worst = worst.max((x - y).abs() / x.abs().max(1.0));
        }
    }
    worst
}

/// The largest logit difference between two runs' exported models over the validation images.
fn model_gap(a: &Path, b: &Path, data: &Path) -> f32 {
    exported_logit_gap(
        &a.join("model.bpk"),
        &b.join("model.bpk"),
        &data.join("val"),
        32,
    )
}

const CURVE: [&str; 3] = ["train_loss", "train_lr", "val_accuracy"];

/// The columns every mode's `metrics.csv` starts with, in this order (the library's
/// `SHARED_COLUMNS` after `epoch`), written out here so that a change to either is seen.
const SHARED: [&str; 10] = [
    "epoch",
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "train_lr",
    "train_images_per_sec",
    "elapsed_seconds",
    "train_skipped_images",
    "val_skipped_images",
];

/// `run`'s `metrics.csv` opens with [`SHARED`], each with a value at every epoch, and puts
/// per-rank columns after every other one.
fn shared_columns(name: &str, run: &Path) {
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    assert_eq!(header[..SHARED.len()], SHARED, "{name}: {csv}");
    let first_rank = header.iter().position(|c| c.contains("_rank"));
    if let Some(i) = first_rank {
        assert!(
            header[i..].iter().all(|c| c.contains("_rank")),
            "{name}: per-rank columns last: {header:?}"
        );
    }
    for (epoch, row) in metrics(run) {
        for c in &SHARED[1..] {
            let v = row.get(*c).copied().unwrap_or(f64::NAN);
            assert!(v.is_finite(), "{name}: epoch {epoch} has no {c}: {csv}");
        }
        assert!(row["train_images_per_sec"] > 0.0, "{name}: {csv}");
        assert!(row["elapsed_seconds"] > 0.0, "{name}: {csv}");
    }
    // The TensorBoard event file holds the same rows (tests/tensorboard.rs reads it with
    // TensorBoard itself).
    let file = run.join(hearth::tensorboard::FILE_NAME);
    let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
    let events = hearth::tensorboard::read(&bytes, &file).unwrap();
    let rows = metrics(run);
    let epochs: Vec<(i64, f32)> = events
        .iter()
        .filter_map(|e| {
            let v = e.scalars.iter().find(|(t, _)| t == "val_accuracy")?;
            Some((e.step, v.1))
        })
        .collect();
    let expected: Vec<(i64, f32)> = rows
        .iter()
        .map(|(e, r)| (*e as i64, r["val_accuracy"] as f32))
        .collect();
    // (metrics.csv holds 6 decimals, the event file an f32.)
    assert!(
        epochs.len() == expected.len()
            && epochs
                .iter()
                .zip(&expected)
                .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= 1e-4),
        "{name}: the event file's val_accuracy {epochs:?}, metrics.csv's {expected:?}"
    );
}

#[test]
fn one_recipe_trains_the_same_in_one_process_data_parallel_elastic_and_on_servers() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let weights = pretrained(dir.path());
    let base = recipe(&weights, true);
    let path = |n: &str| dir.path().join(n);

    let one_log = train(dir.path(), &data, &path("one"), 1, &base, &[]);
    let one = metrics(&path("one"));
    // The recipe ran as asked: the schedule warmed up then decayed (at the linearly scaled
    // peak, 2 x 0.002), and patience ended the run where its rule says, before --epochs.
    let lr: Vec<f64> = one.values().map(|r| r["train_lr"]).collect();
    assert!(lr[1] > lr[0] && lr[lr.len() - 1] < lr[1], "{lr:?}");
    assert!(lr.iter().all(|&r| r <= 0.004 + 1e-12), "{lr:?}");
    let end = patience_end(&one, 2, 2.5, 10);
    assert_eq!(*one.keys().last().unwrap(), end, "{one:?}");
    assert!(end < 10, "patience stops this recipe early: {one:?}");
    assert!(
        one_log.contains("loaded the 3-class model") && one_log.contains("new 4-class head"),
        "the weights load under a new head:\n{one_log}"
    );

    let modes: [(&str, usize, &[&str]); 3] = [
        ("dp", 2, &[]),
        ("elastic", 2, &["--elastic"]),
        ("ps", 3, &["--ps", "1", "--mode", "sync"]),
    ];
    let mut logs = BTreeMap::new();
    for (name, world, args) in modes {
        logs.insert(
            name,
            train(dir.path(), &data, &path(name), world, &base, args),
        );
    }
    shared_columns("one", &path("one"));
    for (name, _, _) in modes {
        shared_columns(name, &path(name));
        let rows = metrics(&path(name));
        let worst = gap(&one, &rows, &CURVE);
        assert!(
            worst <= 1e-4,
            "{name} differs from one process by {worst}:\n{one:?}\n{rows:?}"
        );
        assert_eq!(best_epoch(&logs[name]), best_epoch(&one_log), "{name}");
        let logits = model_gap(&path("one"), &path(name), &data);
        assert!(
            logits <= 1e-3,
            "{name}'s exported model differs by {logits}"
        );
    }

    // Compression: bf16 gradients change data parallel and elastic alike. Their first epochs
    // agree; later ones drift apart, as rounding to bf16 turns the last-bit differences of the
    // two modes' sums into whole bf16 steps.
    let mut bf16 = base.clone();
    bf16.extend(["--compression", "bf16"].map(str::to_string));
    train(dir.path(), &data, &path("dp-bf16"), 2, &bf16, &[]);
    train(
        dir.path(),
        &data,
        &path("elastic-bf16"),
        2,
        &bf16,
        &["--elastic"],
    );
    let first = |name: &str| metrics(&path(name))[&1]["train_loss"];
    let same = (first("dp-bf16") - first("elastic-bf16")).abs();
    assert!(
        same <= 1e-4,
        "bf16, epoch 1: data parallel and elastic differ by {same}"
    );
    for name in ["dp", "elastic"] {
        let changed = model_gap(&path(name), &path(&format!("{name}-bf16")), &data);
        assert!(
            changed > 1e-6,
            "--compression bf16 left the {name} run's model unchanged: {changed}"
        );
        let (exact, rounded) = (
            metrics(&path(name)),
            metrics(&path(&format!("{name}-bf16"))),
        );
        let drift = (exact[&1]["train_loss"] - rounded[&1]["train_loss"]).abs();
        assert!(drift < 0.01, "{name}: bf16 moved epoch 1's loss by {drift}");
    }

    // Stopped after epoch 1 and resumed: the straight runs' curves and models.
    for (name, world, args) in [("dp", 2, &[][..]), ("elastic", 2, &["--elastic"][..])] {
        let run = path(&format!("{name}-resumed"));
        let mut first = args.to_vec();
        first.extend(["--stop-after-epoch", "1"]);
        train(dir.path(), &data, &run, world, &base, &first);
        let mut again = args.to_vec();
        again.push("--resume");
        let log = train(dir.path(), &data, &run, world, &base, &again);
        assert!(log.contains("resum"), "{name}: {log}");
        let straight = metrics(&path(name));
        let resumed = metrics(&run);
        let worst = gap(
            &straight,
            &resumed,
            &["train_loss", "train_lr", "val_accuracy"],
        );
        assert!(
            worst <= 1e-5,
            "{name} resumed differs by {worst}:\n{straight:?}\n{resumed:?}"
        );
        let logits = model_gap(&path(name), &run, &data);
        assert!(
            logits <= 1e-5,
            "{name} resumed exports a model {logits} away"
        );
    }
}

/// The recipe without `--grad-accum` (a pipeline's micro-batches are its accumulation, and
/// stage 3 has none) in a pipeline, with and without replicas, and under ZeRO stage 3.
#[test]
fn a_pipeline_and_zero_stage_3_train_the_recipe_as_one_process_and_data_parallel_do() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let weights = pretrained(dir.path());
    // Micro-batches are the pipeline's accumulation: the recipe without --grad-accum.
    let base = recipe(&weights, false);
    let path = |n: &str| dir.path().join(n);
    let one_log = train(dir.path(), &data, &path("one"), 1, &base, &[]);
    let one = metrics(&path("one"));

    // ZeRO stage 3 from the pretrained weights: rank 0 loads them and draws the new head as it
    // hands its values out a bucket at a time; rank 1 never builds its own. As plain data
    // parallel on the same 2 ranks (whose sums differ from one process's in the last bits).
    let log = train(
        dir.path(),
        &data,
        &path("zero3"),
        2,
        &base,
        &["--zero", "3"],
    );
    assert!(
        log.contains("loaded the 3-class model")
            && log.contains("new 4-class head")
            && log.contains("ZeRO stage 3: rank 0 keeps"),
        "{log}"
    );
    let dp_log = train(dir.path(), &data, &path("dp"), 2, &base, &[]);
    shared_columns("zero3", &path("zero3"));
    let (dp, rows) = (metrics(&path("dp")), metrics(&path("zero3")));
    let worst = gap(&dp, &rows, &CURVE);
    assert!(
        worst <= 1e-5,
        "stage 3 differs from data parallel by {worst}:\n{dp:?}\n{rows:?}"
    );
    assert_eq!(best_epoch(&log), best_epoch(&dp_log));
    let logits = model_gap(&path("dp"), &path("zero3"), &data);
    assert!(
        logits <= 1e-5,
        "stage 3's exported model differs by {logits}"
    );

    let stages = ["--pipeline-stages", "2", "--micro-batches", "2"];
    let log = train(dir.path(), &data, &path("pipeline"), 1, &base, &stages);
    shared_columns("pipeline", &path("pipeline"));
    let rows = metrics(&path("pipeline"));
    let worst = gap(&one, &rows, &CURVE);
    assert!(
        worst <= 1e-3,
        "pipeline differs by {worst}:\n{one:?}\n{rows:?}"
    );
    assert_eq!(best_epoch(&log), best_epoch(&one_log));
    let logits = model_gap(&path("one"), &path("pipeline"), &data);
    // Looser than the curve: the pipeline sums two half-batch gradients (another order of
    // float additions), and seven epochs of Adam at 4e-3 carry that into the weights.
    assert!(logits <= 0.1, "the pipeline's model differs by {logits}");

    // 2 stages x 2 replicas exchanging bf16 gradients: close to one process, not equal.
    let mut replicas = stages.to_vec();
    replicas.extend(["--nproc", "4", "--compression", "bf16"]);
    train(dir.path(), &data, &path("replicas"), 1, &base, &replicas);
    let rows = metrics(&path("replicas"));
    let close = gap(&one, &rows, &["train_loss"]);
    assert!(close < 0.05, "bf16 replicas: {rows:?}\n{one:?}");
    let changed = model_gap(&path("one"), &path("replicas"), &data);
    assert!(
        changed > 1e-6,
        "--compression bf16 left the replicas' model unchanged: {changed}"
    );
}

/// The largest difference of `column` between `a` and `b` over their epochs (both must have
/// it at every epoch).
fn column_gap(name: &str, a: &Rows, b: &Rows, column: &str) -> f64 {
    let mut worst = 0f64;
    for (e, row) in a {
        let (x, y) = (row.get(column), b.get(e).and_then(|r| r.get(column)));
        let (Some(x), Some(y)) = (x, y) else {
            panic!("{name}: epoch {e} lacks {column}:\n{a:?}\n{b:?}");
        };
        assert!(y.is_finite(), "{name}: epoch {e}: {column} {y}");
        worst = worst.max((x - y).abs());
    }
    worst
}

/// Top-5 accuracy (above 5 classes) is a column of every mode, counted over the whole epoch:
/// one process, data parallel, elastic, sync parameter servers and a pipeline give the same
/// value to within one sample; multi-label, every mode reports the epoch's `train_auroc` as one
/// process does.
#[test]
fn top5_and_train_auroc_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("seven");
    // 7 classes x 24 training images (7 batches of 24), 6 validation images each.
    hearth::datasets::synth::generate(
        &data,
        &hearth::datasets::synth::SynthConfig::new(7, 24, 32)
            .with_seed(5)
            .with_val(6),
    )
    .unwrap();
    // An earlier run's backbone under a new head: a pipeline's stages start from the weights
    // one process starts from (the same seed initialises a whole model and a stage's part
    // differently).
    let weights = pretrained(dir.path());
    let base: Vec<String> = [
        "--model",
        "vgg-mini-plain",
        "--weights",
        weights.to_str().unwrap(),
        "--batch-size",
        "24",
        "--epochs",
        "3",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
    ]
    .map(str::to_string)
    .to_vec();
    let path = |n: &str| dir.path().join(n);
    train(dir.path(), &data, &path("one"), 1, &base, &[]);
    let one = metrics(&path("one"));
    for row in one.values() {
        for (top5, top1) in [
            ("train_top5_accuracy", "train_accuracy"),
            ("val_top5_accuracy", "val_accuracy"),
        ] {
            let (t5, t1) = (row[top5], row[top1]);
            assert!((t1..=100.0).contains(&t5), "{top5} {t5} below {top1} {t1}");
        }
    }
    let modes: [(&str, usize, &[&str]); 4] = [
        ("dp", 2, &[]),
        ("elastic", 2, &["--elastic"]),
        ("ps", 3, &["--ps", "1", "--mode", "sync"]),
        (
            "pipeline",
            1,
            &["--pipeline-stages", "2", "--micro-batches", "2"],
        ),
    ];
    for (name, world, args) in modes {
        train(dir.path(), &data, &path(name), world, &base, args);
        let rows = metrics(&path(name));
        // One sample of 168 training or 42 validation images.
        for (column, sample) in [
            ("train_top5_accuracy", 100.0 / 168.0),
            ("val_top5_accuracy", 100.0 / 42.0),
        ] {
            let gap = column_gap(name, &one, &rows, column);
            assert!(
                gap <= sample + 1e-6,
                "{name}: {column} differs from one process by {gap}:\n{one:?}\n{rows:?}"
            );
        }
    }

    let labels = common::multi_label_csv(&data);
    let mut multi = base.clone();
    multi.extend(["--labels".to_string(), labels.to_str().unwrap().to_string()]);
    train(dir.path(), &data, &path("one-multi"), 1, &multi, &[]);
    let one = metrics(&path("one-multi"));
    for (name, world, args) in modes {
        let run = format!("{name}-multi");
        train(dir.path(), &data, &path(&run), world, &multi, args);
        let rows = metrics(&path(&run));
        // Over the whole epoch's outputs, every worker's: the same ranking as one process's
        // up to the rounding of a distributed model.
        let gap = column_gap(&run, &one, &rows, "train_auroc");
        assert!(
            gap <= 0.5,
            "{run}: train_auroc differs by {gap}:\n{one:?}\n{rows:?}"
        );
    }
    assert!(
        !one[&1].contains_key("train_top5_accuracy"),
        "no top-5 for multi-label targets: {one:?}"
    );
}
