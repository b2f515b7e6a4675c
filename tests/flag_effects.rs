//! Issue 55: "`tests/flags.rs` only dry-runs. Give each flag a test that it changes the run or
//! is refused." Here every flag that the table in `tests/flag_table` accepts in a mode runs in
//! that mode, for real, on a small generated set (48 images, 1 to 3 epochs: about a second a
//! run), and shows what it does:
//! - a flag that changes the arithmetic changes the exported model (every tensor compared)
//!   against the same run without it;
//! - a flag that promises the same arithmetic another way (loader threads, recomputation,
//!   ZeRO's sharding, overlap, bucket size, the pipeline's schedule) leaves the model as it
//!   was, and names the test of its mechanism, which must exist and use the flag;
//! - early stopping, the monitored metric, `--stop-after-epoch`, `--price-per-hour`,
//!   `--overwrite`, `--resume`, `--dry-run` and the elastic `--hosts` and `--max-workers` are
//!   checked by what they do to the run's rows, export, summary, files and membership.
//!
//! Each mode is first shown to be deterministic (the baseline twice gives the same model), or
//! "changed" would mean nothing; the parameter servers therefore run one worker. The refusals
//! are `tests/flags.rs`'s. Every process is bounded in time (`common::hearth_cli`).

mod common;
mod flag_table;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flag_table::{Expect, SWITCHES, expect, help_flags};

/// How each mode is started here (elastic: `hearth launch`, 2 workers; parameter servers: one
/// worker and one server, so that the asynchronous default mode is deterministic).
fn launcher(mode: &str) -> Vec<&'static str> {
    match mode {
        "single" => vec!["train"],
        "data parallel" => vec!["train", "--nproc", "2"],
        "elastic" => vec![
            "launch",
            "--elastic",
            "-n",
            "2",
            "--",
            "hearth",
            "train",
            "--elastic",
        ],
        "parameter servers" => vec!["train", "--nproc", "2", "--ps", "1"],
        "pipeline" => vec!["train", "--pipeline-stages", "2"],
        other => panic!("no launcher for {other}"),
    }
}

/// Processes a mode's job runs (for its node-hours).
fn processes(mode: &str) -> f64 {
    if mode == "single" { 1.0 } else { 2.0 }
}

/// What running a flag must show.
#[derive(Debug)]
enum Effect {
    /// The model differs from the run with `reference` (empty: the baseline).
    Changes {
        reference: Vec<String>,
        with: Vec<String>,
    },
    /// The model equals the baseline's within `tolerance` (relative), and `mechanism`
    /// (`FILE::TEST`) exists in a file that uses `uses`: what it changes is tested there.
    Same {
        with: Vec<String>,
        tolerance: f32,
        mechanism: &'static str,
        uses: &'static str,
    },
    /// A pipeline cut where the flag says: `pipeline_split.txt` holds `split`, and the model
    /// is the baseline's within `tolerance`.
    Splits {
        with: Vec<String>,
        split: &'static str,
        tolerance: f32,
    },
    /// Early stopping by validation accuracy: the run ends where the patience rule says on
    /// its own rows, which is before the last epoch in this setting.
    Stops {
        with: Vec<String>,
        patience: usize,
        min_delta: f64,
        epochs: usize,
    },
    /// The exported epoch is the best of `column` (a loss: lower is better), restored by it.
    Monitors {
        with: Vec<String>,
        column: &'static str,
    },
    /// `metrics.csv` has `rows` epochs.
    Rows { with: Vec<String>, rows: usize },
    /// A weight average beside the model: the model as `reference` trained it (the average
    /// only watches), `model_ema.bpk` other than `model.bpk` and than `reference`'s average
    /// where it has one, and `val_ema_accuracy` in every row.
    Averages {
        reference: Vec<String>,
        with: Vec<String>,
    },
    /// The summary prices the job's process-seconds (all ranks, not rank 0's clock).
    Priced,
    /// A second run into a used run directory is refused without the flag and replaces the
    /// first with it.
    Overwrites,
    /// Stopped after epoch 1 and resumed (`--resume RUN` alone), the run equals the straight
    /// one.
    Resumes,
    /// Nothing is written.
    DryRun,
    /// Used by every run here.
    Everywhere,
    /// Tested in `FILE::TEST` (the first), in a file that uses the second.
    Elsewhere(&'static str, &'static str),
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// The folders and files the runs share.
struct Setup {
    dir: tempfile::TempDir,
    /// 3 classes x 16 images, no `val/` (so `--val-fraction` applies).
    data: PathBuf,
    /// The same shapes from another seed.
    other: PathBuf,
    /// A set with `val/` and a multi-label `labels.csv`.
    labelled: PathBuf,
    labels: PathBuf,
    /// A model trained one epoch on `data` in one process.
    weights: PathBuf,
    runs: AtomicUsize,
}

/// One finished run.
struct Run {
    path: PathBuf,
    text: String,
    ok: bool,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let synth = |name: &str, seed: u64, val: usize| {
            let d = dir.path().join(name);
            let mut cfg = hearth::datasets::synth::SynthConfig::new(3, 16, 32).with_seed(seed);
            if val > 0 {
                cfg = cfg.with_val(val);
            }
            hearth::datasets::synth::generate(&d, &cfg).unwrap();
            d
        };
        let data = synth("data", 5, 0);
        let other = synth("other", 6, 0);
        let labelled = synth("labelled", 7, 4);
        let labels = common::multi_label_csv(&labelled);
        let mut s = Self {
            weights: PathBuf::new(),
            dir,
            data,
            other,
            labelled,
            labels,
            runs: AtomicUsize::new(0),
        };
        let pre = s.run_ok("single", &[]);
        s.weights = pre.path.join("model.bpk");
        s
    }

    /// The settings every run starts from; `extra` replaces those it names.
    fn merged(&self, extra: &[String]) -> Vec<String> {
        let given: BTreeSet<&str> = extra
            .iter()
            .filter(|a| a.starts_with("--"))
            .map(String::as_str)
            .collect();
        let data = self.data.to_str().unwrap().to_string();
        let base = [
            ("--data", data.as_str()),
            ("--size", "32"),
            ("--epochs", "1"),
            ("--batch-size", "8"),
            ("--workers", "1"),
            ("--seed", "0"),
        ];
        let mut out = Vec::new();
        for (flag, value) in base {
            if !given.contains(flag) {
                out.extend([flag.to_string(), value.to_string()]);
            }
        }
        out.extend(extra.iter().cloned());
        out
    }

    fn fresh_dir(&self) -> PathBuf {
        let n = self.runs.fetch_add(1, Ordering::SeqCst);
        self.dir.path().join(format!("run{n}"))
    }

    /// `mode`'s launch of `hearth train` with the base settings and `extra`, into `run`.
    fn run_in(&self, mode: &str, extra: &[String], run: &Path) -> Run {
        let mut all: Vec<String> = launcher(mode).iter().map(|s| s.to_string()).collect();
        all.extend(self.merged(extra));
        all.extend(["--run-dir".to_string(), run.to_str().unwrap().to_string()]);
        self.hearth(&all, run)
    }

    fn hearth(&self, all: &[String], run: &Path) -> Run {
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = common::hearth_cli(&refs);
        Run {
            path: run.to_path_buf(),
            text: format!(
                "$ hearth {}\n{}{}",
                all.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            ok: out.status.success(),
        }
    }

    fn run_ok(&self, mode: &str, extra: &[String]) -> Run {
        let run = self.run_in(mode, extra, &self.fresh_dir());
        assert!(run.ok, "{mode}: the run failed:\n{}", run.text);
        assert!(
            run.path.join("metrics.csv").is_file() && run.path.join("model.bpk").is_file(),
            "{mode}: no metrics.csv or model.bpk in {}:\n{}",
            run.path.display(),
            run.text
        );
        run
    }
}

/// The largest relative difference between two model files' tensors; infinite where they
/// hold other tensors (another model, another head).
fn model_gap(a: &Path, b: &Path) -> f32 {
    let (ta, tb) = (common::tensors(a), common::tensors(b));
    if ta.len() != tb.len() {
        return f32::INFINITY;
    }
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in ta.iter().zip(&tb) {
        if na != nb || va.len() != vb.len() {
            return f32::INFINITY;
        }
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs() / (1.0 + y.abs()));
        }
    }
    worst
}

/// Columns of `metrics.csv` that say what a run computed (not how fast).
const CURVE: [&str; 5] = [
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "train_lr",
];

/// How far apart two runs' results are: their exported models ([`model_gap`]) and their
/// curves epoch by epoch (a flag whose effect comes after the exported best epoch shows
/// there); infinite where they ran other epochs.
fn result_gap(a: &Path, b: &Path) -> f32 {
    let (ra, rb) = (common::metrics(a), common::metrics(b));
    if ra.keys().ne(rb.keys()) {
        return f32::INFINITY;
    }
    let mut worst = model_gap(&a.join("model.bpk"), &b.join("model.bpk"));
    for (e, row) in &ra {
        for c in CURVE {
            let (x, y) = (row.get(c), rb[e].get(c));
            let d = match (x, y) {
                (Some(x), Some(y)) => ((x - y).abs() / (1.0 + y.abs())) as f32,
                (None, None) => 0.0,
                _ => f32::INFINITY,
            };
            worst = worst.max(d);
        }
    }
    worst
}

fn model(run: &Run) -> PathBuf {
    run.path.join("model.bpk")
}

/// A number after `label` in the summary's `wall time` line (`... 0.0008 node-hours, cost X`).
fn summary_number(text: &str, before: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.contains("wall time: "))
        .unwrap_or_else(|| panic!("no summary line in:\n{text}"));
    let at = line
        .find(before)
        .unwrap_or_else(|| panic!("no {before:?} in {line:?}"));
    line[at + before.len()..]
        .trim_start()
        .split([' ', ','])
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number after {before:?} in {line:?}"))
}

/// `FILE::TEST` exists, and `FILE` uses `needle` (the flag, or the setting it fills in).
fn check_mechanism(mechanism: &str, needle: &str) -> Result<(), String> {
    let (file, test) = mechanism
        .split_once("::")
        .ok_or_else(|| format!("{mechanism}: not FILE::TEST"))?;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{file}: {e}"))?;
    let defined = text.contains(&format!("fn {test}()"));
    let tested = text
        .split(&format!("fn {test}()"))
        .next()
        .is_some_and(|before| before.trim_end().ends_with("#[test]"));
    if !defined || !tested {
        return Err(format!("{file} has no #[test] fn {test}()"));
    }
    if text.contains(needle) {
        Ok(())
    } else {
        Err(format!("{file} does not use {needle:?}"))
    }
}

/// What running `flag` in `mode` must show (flags the table accepts there).
fn effect(flag: &str, mode: &str, s: &Setup) -> Effect {
    use Effect::*;
    let changes = |with: &[&str]| Changes {
        reference: vec![],
        with: args(with),
    };
    let fine_tune = [
        "--freeze-backbone",
        "--unfreeze-after",
        "1",
        "--epochs",
        "2",
    ];
    let with_fine_tune = |more: &[&str]| {
        let mut w = fine_tune.to_vec();
        w.extend(more);
        Changes {
            reference: args(&fine_tune),
            with: args(&w),
        }
    };
    match flag {
        "--data" => Changes {
            reference: vec![],
            with: vec!["--data".into(), s.other.to_str().unwrap().into()],
        },
        "--labels" => {
            let data = s.labelled.to_str().unwrap();
            Changes {
                reference: args(&["--data", data]),
                with: args(&["--data", data, "--labels", s.labels.to_str().unwrap()]),
            }
        }
        "--val-fraction" => changes(&["--val-fraction", "0.4"]),
        "--model" => changes(&["--model", "vgg-mini"]),
        "--weights" => changes(&["--weights", s.weights.to_str().unwrap()]),
        "--freeze-backbone" => changes(&["--freeze-backbone"]),
        "--unfreeze-after" => Changes {
            reference: args(&["--freeze-backbone", "--epochs", "2"]),
            with: args(&fine_tune),
        },
        "--finetune-lr" => with_fine_tune(&["--finetune-lr", "0.05"]),
        "--finetune-bn" => with_fine_tune(&["--finetune-bn", "batch"]),
        "--epochs" => changes(&["--epochs", "2"]),
        "--batch-size" => changes(&["--batch-size", "16"]),
        "--lr" => changes(&["--lr", "0.1"]),
        "--optimizer" => changes(&["--optimizer", "adam"]),
        // Neither the usual 0.9 nor ADAG's 0.5 from scratch (the walk's servers run ADAG).
        "--momentum" => changes(&["--momentum", "0.7"]),
        "--nesterov" => changes(&["--nesterov"]),
        "--weight-decay" => changes(&["--weight-decay", "0.05"]),
        // Warmup (1 epoch by default) is the same under both: the second epoch differs.
        "--schedule" => Changes {
            reference: args(&["--epochs", "2"]),
            with: args(&["--schedule", "constant", "--epochs", "2"]),
        },
        "--warmup-epochs" => changes(&["--warmup-epochs", "0"]),
        "--scale-lr" => changes(&["--scale-lr", "linear", "--base-batch", "16"]),
        "--base-batch" => Changes {
            reference: args(&["--scale-lr", "linear", "--base-batch", "16"]),
            with: args(&["--scale-lr", "linear", "--base-batch", "4"]),
        },
        "--label-smoothing" => changes(&["--label-smoothing", "0.2"]),
        // A bound far below the gradients' norm: every step is scaled down.
        "--clip-grad" => changes(&["--clip-grad", "0.01"]),
        "--model-ema" => Averages {
            reference: Vec::new(),
            with: args(&["--model-ema", "--model-ema-decay", "0.5"]),
        },
        "--model-ema-decay" => Averages {
            reference: args(&["--model-ema", "--model-ema-decay", "0.5"]),
            with: args(&["--model-ema", "--model-ema-decay", "0.9"]),
        },
        "--monitor" => Monitors {
            with: args(&["--monitor", "val_loss", "--epochs", "3", "--lr", "0.2"]),
            column: "val_loss",
        },
        "--patience" | "--min-delta" => Stops {
            with: args(&["--patience", "1", "--min-delta", "100", "--epochs", "3"]),
            patience: 1,
            min_delta: 100.0,
            epochs: 3,
        },
        "--size" => changes(&["--size", "48"]),
        "--augment" => changes(&["--augment", "none"]),
        "--crop-scale" => changes(&["--crop-scale", "0.4,1"]),
        "--flip" => Changes {
            reference: args(&["--augment", "none"]),
            with: args(&["--augment", "none", "--flip"]),
        },
        "--no-flip" => changes(&["--no-flip"]),
        "--rotate" => changes(&["--rotate", "20"]),
        "--shear" => changes(&["--shear", "20"]),
        "--color-jitter" => changes(&["--color-jitter", "0.4"]),
        "--random-erasing" => changes(&["--random-erasing", "1.0"]),
        "--auto-augment" => changes(&["--auto-augment", "rand-m15-n2"]),
        "--mixup" => changes(&["--mixup", "1.0"]),
        "--cutmix" => changes(&["--cutmix", "1.0"]),
        "--mixup-prob" => Changes {
            reference: args(&["--mixup", "1.0"]),
            with: args(&["--mixup", "1.0", "--mixup-prob", "0.5"]),
        },
        "--mixup-switch-prob" => Changes {
            reference: args(&["--mixup", "1.0", "--cutmix", "1.0"]),
            with: args(&[
                "--mixup",
                "1.0",
                "--cutmix",
                "1.0",
                "--mixup-switch-prob",
                "0.9",
            ]),
        },
        // Mixed in the first epoch alone: the second differs from a run mixing both.
        "--mixup-off-epoch" => Changes {
            reference: args(&["--mixup", "1.0", "--epochs", "2"]),
            with: args(&["--mixup", "1.0", "--epochs", "2", "--mixup-off-epoch", "1"]),
        },
        "--seed" => changes(&["--seed", "3"]),
        "--grad-accum" => changes(&["--grad-accum", "2"]),
        "--compression" => changes(&["--compression", "bf16"]),
        "--precision" => changes(&["--precision", "bf16"]),
        "--micro-batches" => changes(&["--micro-batches", "2"]),
        "--mode" => changes(&["--mode", "easgd"]),
        "--window" => changes(&["--window", "2"]),
        "--workers" => Same {
            with: args(&["--workers", "3"]),
            tolerance: 0.0,
            mechanism: "datasets/tests/datasets.rs::order_and_pixels_are_deterministic_per_seed_and_epoch",
            uses: "with_workers",
        },
        "--zero" => Same {
            with: args(&["--zero", "1"]),
            tolerance: 1e-5,
            mechanism: "tests/zero.rs::zero_1_and_2_train_an_image_model_as_plain_data_parallel_does_and_resume_exactly",
            uses: "--zero",
        },
        "--recompute" => Same {
            with: args(&["--recompute"]),
            tolerance: 1e-5,
            mechanism: "tests/recompute.rs::recompute_trains_exactly_as_without_it_in_every_mode",
            uses: "--recompute",
        },
        "--no-recompute" => Same {
            with: args(&["--recompute", "--no-recompute"]),
            tolerance: 1e-5,
            mechanism: "tests/recompute.rs::a_run_resumed_without_recompute_goes_on_as_it_would_have",
            uses: "--no-recompute",
        },
        "--overlap" => Same {
            with: args(&["--overlap"]),
            tolerance: 1e-5,
            mechanism: "tests/overlap.rs::overlap_trains_exactly_as_the_exchange_after_the_backward",
            uses: "--overlap",
        },
        // Small buckets: several allreduces a step, the same sums.
        "--bucket-mb" => Same {
            with: args(&["--bucket-mb", "0.01"]),
            tolerance: 1e-5,
            mechanism: "burn-dist/tests/ddp_learner.rs::ddp_strategy_through_burn_train_matches_one_process_with_the_whole_batch",
            uses: "with_bucket_bytes",
        },
        "--pipeline-schedule" => Same {
            with: args(&["--pipeline-schedule", "gpipe"]),
            tolerance: 1e-5,
            mechanism: "burn-dist/tests/pipeline.rs::a_split_cnn_trains_exactly_like_the_unsplit_one_with_gpipe_and_1f1b",
            uses: "GPipe",
        },
        "--pipeline-split" => Splits {
            with: args(&["--pipeline-split", "0:2,2:6"]),
            split: "0:2,2:6",
            tolerance: 1e-4,
        },
        "--pipeline-balance" => Same {
            with: args(&["--pipeline-balance", "time"]),
            tolerance: 1e-4,
            mechanism: "tests/pipeline_train.rs::splits_balanced_by_measured_time_or_memory_are_printed_recorded_and_kept_on_resume",
            uses: "--pipeline-balance",
        },
        // One worker: the bound never binds, so the model is the same; the bound holding a
        // fast worker back is tested on the servers.
        "--staleness" => Same {
            with: args(&["--staleness", "1"]),
            tolerance: 0.0,
            mechanism: "burn-dist/tests/ps.rs::the_staleness_bound_holds_a_fast_worker_back",
            uses: "max_staleness",
        },
        // Flex, the default, said again; a process whose Burn default is another backend
        // still trains on the device asked for in tests/resume_any_build.rs.
        "--device" => Same {
            with: args(&["--device", "flex"]),
            tolerance: 0.0,
            mechanism: "tests/resume_any_build.rs::one_process_data_parallel_servers_and_a_pipeline_resume_with_burns_default_unusable",
            uses: "--device",
        },
        "--stop-after-epoch" => Rows {
            with: args(&["--epochs", "3", "--stop-after-epoch", "1"]),
            rows: 1,
        },
        "--price-per-hour" => Priced,
        "--overwrite" => Overwrites,
        "--resume" => Resumes,
        "--run-dir" => Everywhere,
        "--min-workers" | "--rejoin-timeout" => Elsewhere(
            "tests/elastic_train.rs::a_worker_cut_off_is_dropped_and_below_the_minimum_it_gives_up",
            "--rejoin-timeout",
        ),
        "--balance" => Elsewhere(
            "tests/elastic_train.rs::uneven_shares_by_throughput_equal_one_process_on_the_global_batch",
            "--balance",
        ),
        "--hosts" | "--max-workers" => Elsewhere(
            "tests/flag_effects.rs::a_joiner_finds_the_job_through_hosts_and_waits_while_max_workers_is_reached",
            "--hosts",
        ),
        other => panic!(
            "{other} has no effect row in tests/flag_effects.rs for {mode}: say what running it \
             shows"
        ),
    }
}

/// A runtime a mode's test may take, for a message when one hangs.
const BOUND: Duration = Duration::from_secs(900);

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs every accepted flag of `mode` and checks its effect; the failures, all at once.
fn every_flag_in(mode: &str) {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let s = Setup::new();
    let baseline = s.run_ok(mode, &[]);
    let again = s.run_ok(mode, &[]);
    let noise = result_gap(&baseline.path, &again.path);
    assert!(
        noise <= 1e-6,
        "{mode} is not deterministic (the baseline twice differs by {noise}): a changed model \
         would mean nothing"
    );
    let changed = 1e-6f32.max(100.0 * noise);
    let mut references: BTreeMap<Vec<String>, Run> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for flag in help_flags() {
        if SWITCHES.contains(&flag.as_str()) && flag != "--dry-run" {
            continue;
        }
        if flag != "--dry-run" && matches!(expect(&flag, mode), Expect::Refused(_)) {
            continue;
        }
        assert!(
            started.elapsed() < BOUND,
            "{mode}: past {BOUND:?} at {flag}"
        );
        let effect = if flag == "--dry-run" {
            Effect::DryRun
        } else {
            effect(&flag, mode, &s)
        };
        checked += 1;
        let result = check(mode, effect, &s, &baseline, &mut references, changed);
        if let Err(e) = result {
            failures.push(format!("{mode} {flag}: {e}"));
        }
    }
    eprintln!(
        "{mode}: {checked} flags run in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    assert!(checked >= 20, "{mode}: only {checked} flags checked");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

fn check(
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

#[test]
fn every_flag_changes_a_one_process_run_or_keeps_its_promise() {
    every_flag_in("single");
}

#[test]
fn every_flag_changes_a_data_parallel_run_or_keeps_its_promise() {
    every_flag_in("data parallel");
}

#[test]
fn every_flag_changes_an_elastic_run_or_keeps_its_promise() {
    every_flag_in("elastic");
}

#[test]
fn every_flag_changes_a_parameter_server_run_or_keeps_its_promise() {
    every_flag_in("parameter servers");
}

#[test]
fn every_flag_changes_a_pipeline_run_or_keeps_its_promise() {
    every_flag_in("pipeline");
}

/// EASGD's ρ, refused in the table's walk (its servers run adag): with `--mode easgd` it
/// changes the run.
#[test]
fn rho_changes_an_easgd_run() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new();
    let plain = s.run_ok("parameter servers", &args(&["--mode", "easgd"]));
    let with = s.run_ok(
        "parameter servers",
        &args(&["--mode", "easgd", "--rho", "2"]),
    );
    let gap = model_gap(&model(&plain), &model(&with));
    assert!(gap > 1e-6, "--rho 2 left the EASGD model unchanged ({gap})");
}

/// `--hosts`: a worker started outside the launcher (no rank) joins a running elastic job
/// through the address in its hosts file; `--max-workers`: while the job is at it, a joiner
/// waits and the world stays. A first world above `--max-workers` is refused by name.
#[test]
fn a_joiner_finds_the_job_through_hosts_and_waits_while_max_workers_is_reached() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new();
    for (max, joins) in [("2", true), ("1", false)] {
        let run = s.fresh_dir();
        let coordinator = common::coordinator_port();
        let join = common::coordinator_port();
        let secret = "5be2f0c2d1e64d0e8f7a9b3c4d5e6f70";
        let train = |extra: &[&str]| {
            let mut a = vec!["train".to_string(), "--elastic".to_string()];
            a.extend(s.merged(&args(&[
                "--epochs",
                "30",
                "--max-workers",
                max,
                "--batch-size",
                "8",
            ])));
            a.extend(args(extra));
            a.extend(["--run-dir".to_string(), run.to_str().unwrap().to_string()]);
            a
        };
        let log0 = s.dir.path().join(format!("w0-{max}.log"));
        let log1 = s.dir.path().join(format!("w1-{max}.log"));
        let spawn = |a: Vec<String>, log: &Path, env: &[(&str, String)]| {
            let file = std::fs::File::create(log).unwrap();
            let mut c = Command::new(env!("CARGO_BIN_EXE_hearth"));
            c.args(a)
                .env_remove("HEARTH_RANK")
                .env("HEARTH_JOB_SECRET", secret)
                .env("HEARTH_JOB_ID", format!("flag-effects-hosts-{max}"))
                .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
                .stdout(Stdio::from(file.try_clone().unwrap()))
                .stderr(Stdio::from(file));
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().unwrap()
        };
        let mut first = spawn(
            train(&[]),
            &log0,
            &[
                ("HEARTH_RANK", "0".into()),
                ("HEARTH_WORLD_SIZE", "1".into()),
                ("HEARTH_COORDINATOR", format!("127.0.0.1:{coordinator}")),
                ("HEARTH_ELASTIC_ADDR", format!("127.0.0.1:{join}")),
                ("HEARTH_ELASTIC_ID", "w0".into()),
                // Slow steps, so that the job is still training when the joiner asks.
                ("HEARTH_ELASTIC_THROTTLE", "w0:40".into()),
            ],
        );
        let hosts = s.dir.path().join(format!("hosts-{max}.txt"));
        std::fs::write(&hosts, format!("# the job\n127.0.0.1:{join}\n")).unwrap();
        let joiner_port = common::coordinator_port();
        let mut joiner = spawn(
            train(&["--hosts", hosts.to_str().unwrap()]),
            &log1,
            &[
                ("HEARTH_ELASTIC_ADDR", format!("127.0.0.1:{joiner_port}")),
                ("HEARTH_ELASTIC_ID", "w1".into()),
                ("HEARTH_ELASTIC_THROTTLE", "w1:40".into()),
            ],
        );
        let until = Instant::now() + Duration::from_secs(300);
        let status = common::wait_bounded(&mut first, until);
        let text0 = std::fs::read_to_string(&log0).unwrap_or_default();
        if !joins {
            let _ = joiner.kill();
        }
        let status1 = common::wait_bounded(&mut joiner, Instant::now() + Duration::from_secs(60));
        let _ = (first.kill(), joiner.kill());
        let text1 = std::fs::read_to_string(&log1).unwrap_or_default();
        let logs = format!("--- w0\n{text0}\n--- w1\n{text1}");
        assert!(status.is_some_and(|s| s.success()), "w0 failed:\n{logs}");
        assert!(
            text1.contains(&format!("asking to join through 127.0.0.1:{join}")),
            "the joiner takes the address from --hosts:\n{logs}"
        );
        let worlds: Vec<f64> = common::metrics(&run)
            .values()
            .map(|r| r["world_size"])
            .collect();
        if joins {
            assert!(
                status1.is_some_and(|s| s.success()),
                "the joiner trained to the end:\n{logs}"
            );
            assert!(
                worlds.contains(&2.0),
                "with --max-workers 2 the joiner trains in the world: {worlds:?}\n{logs}"
            );
        } else {
            assert!(
                worlds.iter().all(|w| *w == 1.0),
                "with --max-workers 1 the world stays at 1: {worlds:?}\n{logs}"
            );
        }
    }
    // The first world above the cap: every starting worker refuses it by name.
    let run = s.fresh_dir();
    let mut all = launcher("elastic")
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>();
    all.extend(s.merged(&args(&["--max-workers", "1"])));
    all.extend(["--run-dir".to_string(), run.to_str().unwrap().to_string()]);
    let out = s.hearth(&all, &run);
    assert!(
        !out.ok && out.text.contains("--max-workers 1 is below the 2 workers"),
        "{}",
        out.text
    );
}
