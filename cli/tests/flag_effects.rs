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

#[path = "flag_effects/check.rs"]
mod check;
mod common;
#[path = "flag_effects/effects.rs"]
mod effects;
mod flag_table;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use check::check;
use effects::{Effect, args, effect};
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
    let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join(file);
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
