//! No silent flags: every flag of `hearth train --help`, in every training mode, is either
//! accepted (and, where it changes the training's arithmetic, recorded in what `hparams.json`
//! would hold) or refused by an error that names it. The walk uses `--dry-run`, which runs
//! every check a real run makes before it reads data or launches ranks. A flag added to
//! `hearth train` without a row here fails the test until someone decides, for each mode,
//! what it does there. (That a mode really applies an accepted flag is each mode's own tests'
//! job: `tests/ps_train.rs`, `tests/pipeline_train.rs`, `tests/elastic_train.rs`, ...)

mod common;

use std::collections::BTreeSet;
use std::process::Output;

const MODES: [(&str, &[&str]); 5] = [
    ("single", &[]),
    ("data parallel", &["--nproc", "2"]),
    ("elastic", &["--elastic"]),
    ("parameter servers", &["--nproc", "3", "--ps", "1"]),
    ("pipeline", &["--pipeline-stages", "2"]),
];

/// What a flag does in a mode.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Accepted; its setting reaches `hparams.json`.
    Recorded,
    /// Accepted; it steers the run's mechanics (threads, files, membership), not its
    /// arithmetic, so `hparams.json` does not hold it.
    Mechanics,
    /// Refused by an error containing this text.
    Refused(&'static str),
}

/// The arguments that set `flag` (with a value, and what it needs beside it).
fn setting(flag: &str) -> Vec<&'static str> {
    let args: &[&'static str] = match flag {
        "--data" => &["--data", "other/folder"],
        "--labels" => &["--labels", "labels.csv"],
        "--val-fraction" => &["--val-fraction", "0.3"],
        "--model" => &["--model", "resnet18"],
        "--weights" => &["--weights", "w.pth"],
        "--freeze-backbone" => &["--freeze-backbone"],
        "--unfreeze-after" => &["--freeze-backbone", "--unfreeze-after", "1"],
        "--finetune-lr" => &[
            "--freeze-backbone",
            "--unfreeze-after",
            "1",
            "--finetune-lr",
            "0.01",
        ],
        "--finetune-bn" => &[
            "--freeze-backbone",
            "--unfreeze-after",
            "1",
            "--finetune-bn",
            "batch",
        ],
        "--epochs" => &["--epochs", "5"],
        "--batch-size" => &["--batch-size", "48"],
        "--lr" => &["--lr", "0.1"],
        "--optimizer" => &["--optimizer", "adam"],
        "--momentum" => &["--momentum", "0.8"],
        "--nesterov" => &["--nesterov"],
        "--weight-decay" => &["--weight-decay", "0.001"],
        "--schedule" => &["--schedule", "constant"],
        "--warmup-epochs" => &["--warmup-epochs", "2"],
        "--scale-lr" => &["--scale-lr", "linear", "--base-batch", "16"],
        "--base-batch" => &["--scale-lr", "sqrt", "--base-batch", "16"],
        "--label-smoothing" => &["--label-smoothing", "0.1"],
        "--monitor" => &["--monitor", "val_loss"],
        "--patience" => &["--patience", "2"],
        "--min-delta" => &["--min-delta", "0.5"],
        "--size" => &["--size", "48"],
        "--augment" => &["--augment", "none"],
        "--crop-scale" => &["--crop-scale", "0.5,1"],
        "--flip" => &["--augment", "none", "--flip"],
        "--no-flip" => &["--no-flip"],
        "--rotate" => &["--rotate", "10"],
        "--shear" => &["--shear", "10"],
        "--color-jitter" => &["--color-jitter", "0.2"],
        "--workers" => &["--workers", "3"],
        "--seed" => &["--seed", "3"],
        "--run-dir" => &["--run-dir", "somewhere"],
        "--resume" => &["--resume", "somewhere"],
        "--overwrite" => &["--overwrite"],
        "--stop-after-epoch" => &["--stop-after-epoch", "2"],
        "--price-per-hour" => &["--price-per-hour", "2.5"],
        "--grad-accum" => &["--grad-accum", "2"],
        "--bucket-mb" => &["--bucket-mb", "4"],
        "--compression" => &["--compression", "bf16"],
        "--precision" => &["--precision", "bf16"],
        "--zero" => &["--zero", "1"],
        "--recompute" => &["--recompute"],
        "--no-recompute" => &["--recompute", "--no-recompute"],
        "--overlap" => &["--overlap"],
        "--micro-batches" => &["--micro-batches", "2"],
        "--pipeline-schedule" => &["--pipeline-schedule", "gpipe"],
        "--pipeline-split" => &["--pipeline-split", "0:2,2:6"],
        "--pipeline-balance" => &["--pipeline-balance", "time"],
        "--min-workers" => &["--min-workers", "2"],
        "--max-workers" => &["--max-workers", "8"],
        "--rejoin-timeout" => &["--rejoin-timeout", "30"],
        "--balance" => &["--balance", "throughput"],
        "--hosts" => &["--hosts", "hosts.txt"],
        "--mode" => &["--mode", "easgd"],
        "--window" => &["--window", "3"],
        "--rho" => &["--rho", "2"],
        "--staleness" => &["--staleness", "4"],
        "--device" => &["--device", "flex"],
        "--autotune" => &["--autotune", "full"],
        "--kernel-bundle" => &["--kernel-bundle", "bundle.db"],
        other => panic!(
            "`hearth train {other}` has no row in tests/flags.rs: say what it does in every \
             mode (setting() and expect())"
        ),
    };
    args.to_vec()
}

/// What `flag` does in `mode`.
fn expect(flag: &str, mode: &str) -> Expect {
    use Expect::*;
    const NOT_ALLREDUCE: [&str; 2] = ["--compression", "--bucket-mb"];
    match (flag, mode) {
        // Each mode's own flags need the mode (clap names it).
        (
            "--micro-batches" | "--pipeline-schedule" | "--pipeline-split" | "--pipeline-balance",
            m,
        ) => {
            if m == "pipeline" {
                Recorded
            } else {
                Refused("--pipeline-stages")
            }
        }
        ("--min-workers" | "--max-workers" | "--rejoin-timeout" | "--balance" | "--hosts", m) => {
            if m == "elastic" {
                Mechanics
            } else {
                Refused("--elastic")
            }
        }
        // The walk's servers run adag, which has no elastic force.
        ("--rho", "parameter servers") => Refused("--rho is EASGD's elastic force"),
        ("--mode" | "--window" | "--rho" | "--staleness", m) => {
            if m == "parameter servers" {
                Recorded
            } else {
                Refused("--ps")
            }
        }
        // Allreduce settings where nothing is averaged by allreduce.
        (f, "single") if NOT_ALLREDUCE.contains(&f) => Refused("a one-process run"),
        (f, "pipeline") if NOT_ALLREDUCE.contains(&f) => Refused("one replica"),
        ("--compression", "parameter servers") => Refused("--compression bf16 does not apply"),
        ("--bucket-mb", "parameter servers") => Refused("--bucket-mb does not apply"),
        ("--bucket-mb", _) => Mechanics,
        // The sharded optimizer shards over data-parallel ranks (tests/zero.rs).
        ("--zero", "single") => Refused("a one-process run has one"),
        ("--zero", "parameter servers") => Refused("--zero does not work with --ps"),
        // The default, said again (it turns a resumed run's --recompute off): what it records
        // is the baseline's.
        ("--no-recompute", _) => Mechanics,
        // A pipeline shards each stage's state over its replicas (tests/zero.rs); the walk's
        // pipeline has one replica per stage.
        ("--zero", "pipeline") => Refused("--pipeline-stages and one replica per stage"),
        // The exchange overlapped with the backward: data parallel's and elastic's allreduce
        // (tests/overlap.rs, tests/elastic_train.rs); the same arithmetic, so a resume may
        // switch it.
        ("--overlap", "data parallel") => Mechanics,
        ("--overlap", "single") => Refused("--overlap does not work with a one-process run"),
        ("--overlap", "elastic") => Mechanics,
        ("--overlap", "parameter servers") => Refused("--overlap does not work with --ps"),
        ("--overlap", "pipeline") => Refused("--overlap does not work with --pipeline-stages"),
        // GPU kernel selection: the walk runs on flex, which has no GPU kernels (on a GPU:
        // tests/gpu_select.rs, tests/autotune_log.rs).
        ("--autotune", _) => Refused("--autotune full: flex has no GPU kernels"),
        ("--kernel-bundle", _) => Refused("--kernel-bundle: flex has no GPU kernels"),
        // Not built yet (said by name).
        // No meaning: a pipeline's micro-batches are its accumulation.
        ("--grad-accum", "pipeline") => Refused("--micro-batches"),
        // The walk's folder holds no run: resuming it is refused before anything is read (real
        // resumes: tests/newcomer.rs, tests/exact_resume.rs).
        ("--resume", _) => Refused("cannot resume somewhere: no run there"),
        (
            "--workers" | "--run-dir" | "--overwrite" | "--stop-after-epoch" | "--price-per-hour"
            | "--device",
            _,
        ) => Mechanics,
        _ => Recorded,
    }
}

fn hearth(args: &[&str]) -> Output {
    common::hearth_cli(args)
}

fn dry_run(mode: &[&str], setting: &[&str]) -> Output {
    let mut args = vec!["train", "--dry-run"];
    args.extend_from_slice(mode);
    args.extend_from_slice(setting);
    hearth(&args)
}

/// Every `--flag` the help of `hearth train` lists.
fn help_flags() -> BTreeSet<String> {
    let help = hearth(&["train", "--help"]);
    assert!(help.status.success());
    String::from_utf8_lossy(&help.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-h, ").unwrap_or(l);
            l.starts_with("--")
                .then(|| l.split([' ', '=', '\t']).next().unwrap_or("").to_string())
        })
        .collect()
}

#[test]
fn every_flag_of_train_is_used_or_refused_by_name_in_every_mode() {
    let flags = help_flags();
    assert!(flags.len() > 40, "{flags:?}");
    let switches = [
        "--nproc",
        "--elastic",
        "--ps",
        "--pipeline-stages",
        "--dry-run",
        "--help",
    ];
    let mut failures = Vec::new();
    for (mode, base) in MODES {
        let baseline = dry_run(base, &[]);
        assert!(
            baseline.status.success(),
            "{mode} with default flags must be valid: {}",
            String::from_utf8_lossy(&baseline.stderr)
        );
        for flag in flags.iter().filter(|f| !switches.contains(&f.as_str())) {
            let out = dry_run(base, &setting(flag));
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            let got = match expect(flag, mode) {
                Expect::Refused(text) if !out.status.success() && err.contains(text) => continue,
                Expect::Refused(text) => format!("accepted, or refused without naming {text:?}"),
                _ if !out.status.success() => format!("refused: {}", err.trim()),
                Expect::Recorded if out.stdout == baseline.stdout => {
                    "accepted but hparams.json would not record it".to_string()
                }
                Expect::Mechanics if out.stdout != baseline.stdout && flag != "--bucket-mb" => {
                    // Not wrong, but then the table should say Recorded.
                    "recorded in hparams.json: mark it Recorded".to_string()
                }
                _ => continue,
            };
            failures.push(format!("{mode} {flag}: {got}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Values a mode cannot run, refused by name; and a refused setting is said once, before any
/// rank is launched.
#[test]
fn values_a_mode_cannot_run_are_refused_before_launching() {
    for (base, setting, text) in [
        (
            &["--nproc", "3", "--ps", "1"][..],
            &["--optimizer", "lars"][..],
            "--optimizer lars does not work with --ps",
        ),
        (&[][..], &["--monitor", "val_auroc"][..], "val_auroc"),
        (
            &["--labels", "labels.csv"][..],
            &["--label-smoothing", "0.1"][..],
            "--label-smoothing smooths single-label cross-entropy",
        ),
        (
            &["--nproc", "2"][..],
            &["--batch-size", "33"][..],
            "2 ranks",
        ),
        (
            &[][..],
            &["--bucket-mb", "0"][..],
            "--bucket-mb must be positive",
        ),
        (
            &["--nproc", "2"][..],
            &["--overlap", "--zero", "1"][..],
            "--overlap does not work with --zero",
        ),
        (
            &["--nproc", "2"][..],
            &["--overlap", "--grad-accum", "2"][..],
            "--overlap does not work with --grad-accum",
        ),
        // Issue 55: flags that were accepted and did nothing.
        (
            &["--nproc", "3", "--ps", "1", "--mode", "sync"][..],
            &["--rho", "5"][..],
            "--mode sync does not use it",
        ),
        (
            &["--nproc", "3", "--ps", "1", "--mode", "sync"][..],
            &["--window", "5"][..],
            "--mode sync exchanges every step",
        ),
        (
            &["--nproc", "3", "--ps", "1", "--mode", "sync"][..],
            &["--staleness", "2"][..],
            "--mode sync waits for every worker",
        ),
        (
            &["--nproc", "3", "--ps", "1", "--mode", "downpour"][..],
            &["--rho", "2"][..],
            "--mode downpour does not use it",
        ),
        (
            &["--optimizer", "adam"][..],
            &["--momentum", "0.9"][..],
            "--optimizer adam keeps its own moment estimates",
        ),
        (
            &["--optimizer", "adamw"][..],
            &["--momentum", "0.5"][..],
            "--optimizer adamw keeps its own moment estimates",
        ),
        (
            &["--optimizer", "adamw"][..],
            &["--nesterov"][..],
            "--nesterov applies to --optimizer sgd",
        ),
        (
            &["--optimizer", "lars"][..],
            &["--nesterov"][..],
            "--nesterov applies to --optimizer sgd",
        ),
        (
            &[][..],
            &["--nesterov", "--momentum", "0"][..],
            "--nesterov needs --momentum above 0",
        ),
        (&[][..], &["--base-batch", "16"][..], "--scale-lr"),
        (
            &["--nproc", "2", "--pipeline-stages", "2"][..],
            &["--pipeline-split", "0:2,2:6", "--pipeline-balance", "time"][..],
            "--pipeline-split gives the split itself",
        ),
    ] {
        let out = dry_run(base, setting);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(text),
            "{setting:?}: {err}"
        );
    }
    // Without --dry-run too: one error from the launching process, no ranks started.
    let out = hearth(&[
        "train",
        "--nproc",
        "2",
        "--compression",
        "bf16",
        "--ps",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--compression bf16 does not apply"), "{err}");
    assert!(
        !err.contains("launching"),
        "refused before launching: {err}"
    );
}
