//! A newcomer's mistakes lose no data: `hearth data synth` never writes into (or deletes)
//! another data set, and `hearth train --run-dir` never writes over an earlier run, not even
//! through `--nproc` (refused before any rank starts). A first run on a GPU device says that its
//! first steps will tune kernels, so that minutes of tuning do not look like a hang.

/// Image sides and bench settings refused by name before anything is written or run.
#[path = "newcomer/bench_settings.rs"]
mod bench_settings;
mod common;
/// Truncated images skipped and named, in one process and in every distributed mode.
#[path = "newcomer/damaged_images.rs"]
mod damaged_images;

use std::path::Path;
use std::process::Output;

fn hearth(args: &[&str]) -> Output {
    common::hearth_cli(args)
}

fn synth(out: &Path, classes: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "data",
        "synth",
        "--out",
        out.to_str().unwrap(),
        "--classes",
        classes,
        "--per-class",
        "2",
        "--size",
        "16",
    ];
    args.extend_from_slice(extra);
    hearth(&args)
}

/// Class folders of a set written without a validation part (they sit at its top).
fn classes(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().is_dir())
        .count()
}

#[test]
fn data_synth_refuses_another_data_set_and_replaces_only_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    // A real data set: never written into, never deleted.
    let real = tmp.path().join("photos");
    std::fs::create_dir_all(real.join("cats")).unwrap();
    std::fs::write(real.join("cats/1.jpg"), b"not really").unwrap();
    for extra in [&[][..], &["--overwrite"][..]] {
        let out = synth(&real, "3", extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}");
        assert!(err.contains("no synthetic set this command wrote"), "{err}");
        assert!(real.join("cats/1.jpg").is_file());
        assert_eq!(classes(&real), 1, "nothing written into it");
    }
    // Its own set: refused without --overwrite, replaced (not merged) with it.
    let set = tmp.path().join("shapes");
    assert!(synth(&set, "5", &[]).status.success());
    assert_eq!(classes(&set), 5);
    let out = synth(&set, "3", &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--overwrite replaces it"), "{err}");
    assert_eq!(classes(&set), 5);
    // Files the user put beside the set stay (issue 55: --overwrite deleted the whole folder).
    std::fs::write(set.join("notes.txt"), b"mine").unwrap();
    std::fs::create_dir_all(set.join("extra")).unwrap();
    std::fs::write(set.join("extra/my-photo.png"), b"mine too").unwrap();
    assert!(synth(&set, "3", &["--overwrite"]).status.success());
    assert_eq!(
        classes(&set),
        3 + 1,
        "replaced, not merged; the user's folder kept"
    );
    assert_eq!(std::fs::read(set.join("notes.txt")).unwrap(), b"mine");
    assert_eq!(
        std::fs::read(set.join("extra/my-photo.png")).unwrap(),
        b"mine too"
    );
}

#[test]
fn train_into_an_earlier_run_is_refused_before_launching() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    std::fs::create_dir_all(run.join("checkpoint")).unwrap();
    std::fs::write(run.join("model.bpk"), b"an earlier run's model").unwrap();
    let out = hearth(&["train", "--nproc", "2", "--run-dir", run.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("already holds a run"), "{err}");
    assert!(
        !err.contains("launching"),
        "refused before launching: {err}"
    );
    assert_eq!(
        std::fs::read(run.join("model.bpk")).unwrap(),
        b"an earlier run's model"
    );
}

#[test]
fn a_run_that_fails_at_once_leaves_no_empty_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = hearth(&[
        "train",
        "--data",
        tmp.path().join("no-such-folder").to_str().unwrap(),
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(!run.exists(), "an empty run folder was left behind");
}

/// A generated JPEG set (3 classes, 12 training and 4 validation images each).
fn jpeg_set(dir: &Path) -> std::path::PathBuf {
    let d = dir.join("jpegs");
    hearth::datasets::synth::generate(
        &d,
        &hearth::datasets::synth::SynthConfig::new(3, 12, 36)
            .with_seed(2)
            .with_val(4)
            .with_jpeg(true),
    )
    .unwrap();
    d
}

/// Every image file under `dir`, sorted.
fn images(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in walk(dir) {
        if entry.extension().is_some_and(|e| e == "jpg" || e == "png") {
            out.push(entry);
        }
    }
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Cuts `file` to half its bytes (a download that stopped).
fn truncate(file: &Path) {
    let bytes = std::fs::read(file).unwrap();
    std::fs::write(file, &bytes[..bytes.len() / 2]).unwrap();
}

fn small_run(data: &Path, run: std::path::PathBuf) -> hearth::train::TrainConfig {
    let mut cfg = common::small_config(data, run);
    cfg.epochs = 1;
    cfg
}

#[test]
fn a_one_replica_pipeline_splits_no_batch_over_its_stages() {
    // README's example: 3 stages of one pipeline with the default batch of 32 (not a multiple
    // of 3): the batch goes to the one pipeline whole.
    let out = hearth(&[
        "train",
        "--pipeline-stages",
        "3",
        "--pipeline-split",
        "0:3,3:5,5:6",
        "--pipeline-schedule",
        "gpipe",
        "--dry-run",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // Two pipelines of 3 stages do split it: 32 over 2.
    let out = hearth(&[
        "train",
        "--pipeline-stages",
        "3",
        "--nproc",
        "6",
        "--batch-size",
        "33",
        "--dry-run",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("divide evenly over 2 pipelines"), "{err}");
}

#[test]
fn the_test_size_networks_are_listed_and_named_where_they_do_not_apply() {
    let out = hearth(&["models"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for name in [
        "resnet-mini",
        "vgg-mini",
        "vgg-mini-plain",
        "densenet-mini",
        "resnet50",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
    // A typo is refused before anything is read or generated, with every name it could be.
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = hearth(&[
        "train",
        "--model",
        "resnet-mni",
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("unknown model 'resnet-mni'") && err.contains("resnet-mini"),
        "{err}"
    );
    assert!(!run.exists(), "nothing generated for a typo");
    // Where only torchvision's architectures apply, the mini networks are named as such.
    let out = hearth(&["bench", "model", "--model", "resnet-mini"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("test-size network"), "{err}");
    let out = hearth(&["predict", "--model", "resnet-mini", "--image", "x.png"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("model.bpk"), "{err}");
}

#[test]
fn freezing_a_random_backbone_is_said() {
    let out = hearth(&["train", "--freeze-backbone", "--dry-run"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: --freeze-backbone without --weights"),
        "{err}"
    );
    let out = hearth(&["train", "--dry-run"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"));
}

#[test]
fn a_device_index_the_machine_lacks_is_named_not_a_backend_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = hearth(&[
        "train",
        "--device",
        "vulkan:7",
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("'vulkan:7'"), "{err}");
    assert!(
        !err.contains("unwrap") && !err.contains("RecvError") && !err.contains("panicked"),
        "{err}"
    );
    if common::device_or_skip(hearth::device::DeviceChoice::Vulkan, "vulkan:7 message").is_some() {
        // Vulkan works here without an index: the index is what is missing.
        assert!(err.contains("no discrete GPU 7"), "{err}");
    }
    assert!(!run.exists());
}

#[test]
fn a_folder_one_level_off_says_what_the_layout_should_be() {
    let tmp = tempfile::tempdir().unwrap();
    let data = jpeg_set(tmp.path());
    let trained = tmp.path().join("trained");
    hearth::train::train(
        &small_run(&data, trained.clone()),
        &burn::prelude::Device::flex(),
        &mut |_| {},
    )
    .unwrap();
    let weights = trained.join("model.bpk");
    // eval on a training layout (train/ and val/ beside each other).
    let out = hearth(&[
        "eval",
        "--weights",
        weights.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("holds train/ and val/"), "{err}");
    assert!(
        err.contains(&data.join("val").display().to_string()),
        "{err}"
    );
    // train on a folder with only train/.
    std::fs::remove_dir_all(data.join("val")).unwrap();
    let run = tmp.path().join("run");
    let out = hearth(&[
        "train",
        "--data",
        data.to_str().unwrap(),
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("holds only train/"), "{err}");
    assert!(
        err.contains(&format!("train on {}", data.join("train").display())),
        "{err}"
    );
}

#[test]
fn every_option_says_what_it_does_and_readme_subcommands_exist() {
    // Each option of these commands has a help text (beside it, or on the next line).
    for cmd in [
        &["train"][..],
        &["data", "synth"][..],
        &["data", "check"][..],
        &["bench", "model"][..],
        &["bench", "loader"][..],
        &["units"][..],
    ] {
        let mut args = cmd.to_vec();
        args.push("--help");
        let text = String::from_utf8_lossy(&hearth(&args).stdout).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            if t.starts_with("--") && !t.starts_with("--help") {
                // The text beside the option (two spaces or more after it), or on the next line.
                let beside = t.split_once("  ").map_or("", |(_, rest)| rest.trim());
                let next = lines.get(i + 1).map_or("", |n| n.trim());
                assert!(
                    !beside.is_empty() || (!next.is_empty() && !next.starts_with('-')),
                    "{cmd:?}: {t} has no help text"
                );
            }
        }
    }
    let bench = String::from_utf8_lossy(&hearth(&["bench", "--help"]).stdout).into_owned();
    assert!(bench.contains("allreduce-rank"), "{bench}");
}

#[test]
fn hparams_json_holds_typed_values_not_debug_text() {
    let out = hearth(&[
        "train",
        "--dry-run",
        "--nproc",
        "3",
        "--ps",
        "1",
        "--patience",
        "2",
        "--label-smoothing",
        "0.1",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = &text[text.find('{').unwrap()..];
    let h: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(h["patience"], 2);
    assert_eq!(h["finetune_lr"], serde_json::Value::Null);
    assert_eq!(h["optimizer"], "sgd");
    assert_eq!(h["label_smoothing"], 0.1);
    assert_eq!(h["ps"]["mode"], "adag");
    assert_eq!(h["ps"]["servers"], 1);
    for debug in ["Some(", "None", "Options {", "Dedicated(", "OneFOneB"] {
        assert!(!json.contains(debug), "{debug} in {json}");
    }
}

#[test]
fn resuming_a_mistyped_path_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let typo = tmp.path().join("rnu");
    let out = hearth(&["train", "--resume", typo.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no run there"), "{err}");
    assert!(!typo.exists(), "no folder, no synthetic set for a typo");
}

#[test]
fn resume_takes_the_runs_settings_and_extends_a_finished_run() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::small_data(tmp.path());
    let run = tmp.path().join("run");
    let (d, r) = (data.to_str().unwrap(), run.to_str().unwrap());
    let first = hearth(&[
        "train",
        "--data",
        d,
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--lr",
        "0.02",
        "--seed",
        "3",
        "--augment",
        "none",
        "--workers",
        "1",
        "--run-dir",
        r,
    ]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    // Finished: --resume alone has nothing left to train, and says so.
    let out = hearth(&["train", "--resume", r]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("already finished epoch 2 of 2"), "{err}");
    // A changed setting that must not change is refused by name.
    let out = hearth(&["train", "--resume", r, "--epochs", "3", "--lr", "0.5"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("lr: 0.02 then, 0.5 now"), "{err}");
    // More epochs: every other setting from the run (its data, rate, seed, augmentation).
    let out = hearth(&["train", "--resume", r, "--epochs", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("--resume: ") && err.contains("hparams.json"),
        "{err}"
    );
    assert!(err.contains("resuming after epoch 2"), "{err}");
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 3, "{csv}");
    let h: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("hparams.json")).unwrap()).unwrap();
    assert_eq!(h["epochs"], 3);
    assert_eq!(h["lr"], 0.02);
    assert_eq!(h["seed"], 3);
}

#[test]
fn data_check_reports_what_training_would_do_with_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let data = jpeg_set(tmp.path());
    let d = data.to_str().unwrap();
    let out = hearth(&["data", "check", "--data", d]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("train/ and val/ class folders"), "{text}");
    assert!(
        text.contains("3 classes, 36 training and 12 validation images"),
        "{text}"
    );
    assert!(
        text.contains("every image decodes") && text.contains("no image is in both"),
        "{text}"
    );
    assert!(text.contains("sizes: smallest 36x36"), "{text}");
    // A cut file and a training image copied into val/.
    let files = images(&data);
    truncate(&files[3]);
    let copy = data.join("val").join("c00_red_disc").join("copy.jpg");
    std::fs::copy(&files[5], &copy).unwrap();
    let out = hearth(&["data", "check", "--data", d]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "problems found: exit 1\n{text}");
    assert!(text.contains("1 image(s) fail to decode"), "{text}");
    assert!(text.contains(&files[3].display().to_string()), "{text}");
    assert!(text.contains("1 image(s) in both train and val"), "{text}");
    assert!(text.contains(&copy.display().to_string()), "{text}");
}

#[test]
fn a_job_that_cannot_run_is_refused_once_before_any_rank_starts() {
    let out = hearth(&["train", "--nproc", "3", "--ps", "3", "--epochs", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(
        err.matches("leaves no worker").count(),
        1,
        "said once: {err}"
    );
    assert!(
        !err.contains("launching") && !err.contains("rank 0 failed"),
        "{err}"
    );
}

#[test]
fn a_killed_rank_is_reported_as_killed() {
    let out = hearth(&["launch", "-n", "2", "--", "sh", "-c", "kill -9 $$"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("was killed by a signal"), "{err}");
    assert!(!err.contains("None") && !err.contains("Some("), "{err}");
}

/// A first run on a GPU device with `--autotune full` says that its first steps will tune
/// kernels (minutes on a fresh GPU, which would look like a hang), naming where the decisions
/// go; a second run, which reuses them, says nothing, and neither does a run with kernels chosen
/// by rule (the default), which has nothing long to announce. On `vulkan-cpu` (lavapipe), with
/// cubecl's cache in a fresh folder (no Cargo.toml above the working directory, so the user
/// cache folder: `XDG_CACHE_HOME`).
#[test]
fn a_first_gpu_run_says_its_first_steps_will_tune_and_a_second_does_not() {
    use hearth::device::DeviceChoice;
    if common::device_or_skip(DeviceChoice::VulkanCpu, "autotune note").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    assert!(synth(&data, "2", &[]).status.success());
    let cache = dir.path().join("cache");
    let run = |autotune: &str, cache: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args(["--device", "vulkan-cpu", "--autotune", autotune])
            .args(["bench", "loader", "--data"])
            .arg(&data)
            .args(["--batch-size", "2", "--size", "16", "--batches", "1"])
            .args(["--workers", "1"])
            .current_dir(dir.path())
            .env("XDG_CACHE_HOME", cache)
            .env_remove("CUBECL_AUTOTUNE_CACHE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        err
    };
    // In a cache folder of its own: starting the device may already write to cubecl's database.
    let by_rule = run("off", &dir.path().join("cache-by-rule"));
    assert!(!by_rule.contains("note: autotune"), "{by_rule}");
    let first = run("full", &cache);
    let db = cache.join("cubecl").join("default.db");
    assert!(
        first.contains("note: autotune on vulkan-cpu: no earlier decisions in")
            && first.contains(&db.display().to_string())
            && first.contains("can take minutes"),
        "{first}"
    );
    assert!(db.exists(), "no database at {}:\n{first}", db.display());
    let second = run("full", &cache);
    assert!(!second.contains("note: autotune"), "{second}");
}
