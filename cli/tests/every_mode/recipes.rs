//! The recipes' flags in every mode: gradient clipping by the global norm, mixup and cutmix,
//! and the weight average, each against one process's run (a short run of the recipe's model
//! from the same earlier weights).

use super::*;

/// Two epochs of the pretrained model under a new head at a rate that moves it, then `more`.
fn short_run(weights: &Path, more: &[&str]) -> Vec<String> {
    let mut run: Vec<String> = [
        "--model",
        "vgg-mini-plain",
        "--weights",
        weights.to_str().unwrap(),
        "--batch-size",
        "24",
        "--epochs",
        "2",
        "--lr",
        "0.05",
    ]
    .map(str::to_string)
    .to_vec();
    run.extend(more.iter().map(|a| a.to_string()));
    run
}

/// `--clip-grad` clips by the norm over the whole model in every mode: data parallel (the
/// averaged gradient), elastic (the summed one), both with ZeRO (the squares summed over the
/// shards), a pipeline (each stage's squares summed over the stages), a pipeline whose stages
/// shard over their replicas (every rank's segments summed over the job) and sync parameter
/// servers (the round's mean, the squares summed over the servers' shards) train one
/// process's curve; without the bound binding the run would be another (the bound is far
/// below the gradients' norm).
#[test]
fn gradient_clipping_by_the_global_norm_is_the_same_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let base = short_run(&pretrained(dir.path()), &["--clip-grad", "0.05"]);
    let path = |n: &str| dir.path().join(n);
    train(dir.path(), &data, &path("one"), 1, &base, &[]);
    let mut unclipped = base.clone();
    unclipped.truncate(base.len() - 2);
    train(dir.path(), &data, &path("free"), 1, &unclipped, &[]);
    let one = metrics(&path("one"));
    let bound = model_gap(&path("one"), &path("free"), &data);
    assert!(bound > 1e-3, "--clip-grad 0.05 did not bind: {bound}");
    for (name, world, args, tolerance) in [
        ("dp", 2, &[][..], 1e-4),
        ("elastic", 2, &["--elastic"][..], 1e-4),
        // ZeRO: the norm summed over the ranks' shards of the averaged gradient.
        ("dp-zero1", 2, &["--zero", "1"][..], 1e-4),
        ("dp-zero2", 2, &["--zero", "2"][..], 1e-4),
        ("elastic-zero", 2, &["--elastic", "--zero", "2"][..], 1e-4),
        (
            "pipeline",
            1,
            &["--pipeline-stages", "2", "--micro-batches", "2"][..],
            1e-3,
        ),
        // 2 stages x 2 replicas, each stage's gradient sharded over its replicas: the
        // squares of every rank's segments summed over the job.
        (
            "pipeline-zero",
            1,
            &[
                "--pipeline-stages",
                "2",
                "--micro-batches",
                "2",
                "--nproc",
                "4",
                "--zero",
                "1",
            ][..],
            1e-3,
        ),
        // Sync parameter servers: two servers clip the round's mean by the norm over both
        // shards.
        ("ps-sync", 4, &["--ps", "2", "--mode", "sync"][..], 1e-4),
    ] {
        train(dir.path(), &data, &path(name), world, &base, args);
        let rows = metrics(&path(name));
        let worst = gap(&one, &rows, &CURVE);
        assert!(
            worst <= tolerance,
            "{name} with --clip-grad differs from one process by {worst}:\n{one:?}\n{rows:?}"
        );
    }
}

/// `--mixup` and `--cutmix` (both, so batches switch between them) draw from the seed, the
/// epoch and the batch's images alone: a pipeline's first stage mixes the images and its last
/// the targets with the same draw, so it trains one process's curve; data parallel, elastic
/// and a stopped-and-resumed run mix too, the resume exactly as the straight run. Without the
/// mixing the run is another.
#[test]
fn mixup_and_cutmix_mix_alike_on_a_pipelines_stages_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let base = short_run(
        &pretrained(dir.path()),
        &["--mixup", "0.4", "--cutmix", "1.0"],
    );
    let path = |n: &str| dir.path().join(n);
    train(dir.path(), &data, &path("one"), 1, &base, &[]);
    let mut plain = base.clone();
    plain.truncate(base.len() - 4);
    train(dir.path(), &data, &path("plain"), 1, &plain, &[]);
    let one = metrics(&path("one"));
    let moved = model_gap(&path("one"), &path("plain"), &data);
    assert!(moved > 1e-3, "mixing did not change the run: {moved}");
    let hparams: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path("one").join("hparams.json")).unwrap())
            .unwrap();
    assert_eq!(hparams["mixup"], 0.4, "{hparams}");
    assert_eq!(hparams["cutmix"], 1.0, "{hparams}");
    train(
        dir.path(),
        &data,
        &path("pipeline"),
        1,
        &base,
        &["--pipeline-stages", "2", "--micro-batches", "2"],
    );
    let rows = metrics(&path("pipeline"));
    let worst = gap(&one, &rows, &CURVE);
    assert!(
        worst <= 1e-3,
        "a pipeline with mixing differs from one process by {worst}:\n{one:?}\n{rows:?}"
    );
    // Stopped after epoch 1 and resumed: the straight run, in one process and data parallel.
    train(dir.path(), &data, &path("dp"), 2, &base, &[]);
    for (name, world) in [("one", 1), ("dp", 2)] {
        let run = path(&format!("{name}-resumed"));
        train(
            dir.path(),
            &data,
            &run,
            world,
            &base,
            &["--stop-after-epoch", "1"],
        );
        train(dir.path(), &data, &run, world, &base, &["--resume"]);
        let (straight, resumed) = (metrics(&path(name)), metrics(&run));
        let worst = gap(&straight, &resumed, &CURVE);
        assert!(
            worst <= 1e-5,
            "{name} with mixing resumed differs by {worst}:\n{straight:?}\n{resumed:?}"
        );
    }
    // Elastic workers mix their shares of each global batch.
    train(
        dir.path(),
        &data,
        &path("elastic"),
        2,
        &base,
        &["--elastic"],
    );
    let elastic = metrics(&path("elastic"));
    assert_eq!(elastic.len(), 2, "{elastic:?}");
}

/// `--model-ema` in data parallel (with ZeRO too), elastic, sync parameter servers and a pipeline: the average
/// is one process's (validated each epoch as `val_ema_*` and exported as `model_ema.bpk`, a
/// pipeline's assembled from its stages), and elastic, parameter-server and pipeline runs
/// stopped after epoch 1 and resumed go on with the average they had (the elastic state carries
/// it; the servers' lead and each stage read their checkpoint).
#[test]
fn a_weight_average_in_every_data_parallel_mode_is_one_process_s_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let data = elastic_data(dir.path());
    let base = short_run(
        &pretrained(dir.path()),
        &["--model-ema", "--model-ema-decay", "0.5"],
    );
    let path = |n: &str| dir.path().join(n);
    let ema_gap = |a: &str, b: &str| {
        exported_logit_gap(
            &path(a).join("model_ema.bpk"),
            &path(b).join("model_ema.bpk"),
            &data.join("val"),
            32,
        )
    };
    const AVERAGE: [&str; 2] = ["val_ema_loss", "val_ema_accuracy"];
    train(dir.path(), &data, &path("one"), 1, &base, &[]);
    let one = metrics(&path("one"));
    assert!(
        model_gap(&path("one"), &path("one"), &data) == 0.0 && ema_gap("one", "one") == 0.0,
        "the comparison sees no difference where there is none"
    );
    // (name, processes, flags, tolerance: a pipeline sums its micro-batches' gradients in
    // another order, as in the other tests here).
    let modes: [(&str, usize, &[&str], f64); 5] = [
        ("dp", 2, &[], 1e-4),
        ("elastic", 2, &["--elastic"], 1e-4),
        ("ps", 3, &["--ps", "1", "--mode", "sync"], 1e-4),
        (
            "pipeline",
            1,
            &["--pipeline-stages", "2", "--micro-batches", "2"],
            1e-3,
        ),
        // Every rank's average follows the model its shard's update gathered.
        ("dp-zero", 2, &["--zero", "1"], 1e-4),
    ];
    for (name, world, args, tolerance) in modes {
        train(dir.path(), &data, &path(name), world, &base, args);
        let rows = metrics(&path(name));
        let worst = gap(&one, &rows, &AVERAGE);
        assert!(
            worst <= tolerance,
            "{name}: the average's validation differs by {worst}:\n{one:?}\n{rows:?}"
        );
        let logits = ema_gap("one", name);
        assert!(
            logits <= 10.0 * tolerance as f32,
            "{name}: model_ema.bpk is {logits} away"
        );
    }
    // The average is not the model.
    let apart = exported_logit_gap(
        &path("elastic").join("model.bpk"),
        &path("elastic").join("model_ema.bpk"),
        &data.join("val"),
        32,
    );
    assert!(apart > 1e-4, "model_ema.bpk is the model: {apart}");
    // `--monitor val_ema_loss`: a pipeline's `model.bpk` is its stages' averages assembled.
    let monitored = [modes[3].2, &["--monitor", "val_ema_loss"]].concat();
    train(dir.path(), &data, &path("monitored"), 1, &base, &monitored);
    let same = exported_logit_gap(
        &path("monitored").join("model.bpk"),
        &path("monitored").join("model_ema.bpk"),
        &data.join("val"),
        32,
    );
    assert_eq!(same, 0.0, "model.bpk is not the average the monitor chose");
    for (name, world, args, _) in [modes[1], modes[2], modes[3]] {
        let resumed = format!("{name}-resumed");
        let run = path(&resumed);
        let first = [args, &["--stop-after-epoch", "1"]].concat();
        train(dir.path(), &data, &run, world, &base, &first);
        // A pipeline's stages keep theirs beside their weights.
        let kept = match name {
            "pipeline" => "checkpoint/stage-1/ema-1.bpk",
            _ => "checkpoint/ema-1.bpk",
        };
        assert!(run.join(kept).is_file(), "{name}: no {kept}");
        let again = [args, &["--resume"]].concat();
        train(dir.path(), &data, &run, world, &base, &again);
        let (straight, after) = (metrics(&path(name)), metrics(&run));
        let worst = gap(&straight, &after, &AVERAGE);
        assert!(
            worst <= 1e-5,
            "{name} resumed: the average differs by {worst}:\n{straight:?}\n{after:?}"
        );
        let logits = ema_gap(name, &resumed);
        assert!(
            logits <= 1e-5,
            "{name} resumed: model_ema.bpk is {logits} away"
        );
    }
}
