//! What each flag of `hearth train` does in each training mode: the table that
//! `tests/flags.rs` checks by dry run (recorded in `hparams.json`, or refused by name) and
//! `tests/flag_effects.rs` checks by running (the flag changes the run, or is shown to leave
//! its arithmetic alone). A flag added to `hearth train` without a row here fails both.

// Each test crate that includes this module uses a part of it.
#![allow(dead_code)]

use std::collections::BTreeSet;

pub const MODES: [(&str, &[&str]); 5] = [
    ("single", &[]),
    ("data parallel", &["--nproc", "2"]),
    ("elastic", &["--elastic"]),
    ("parameter servers", &["--nproc", "3", "--ps", "1"]),
    ("pipeline", &["--pipeline-stages", "2"]),
];

/// The flags that choose the mode (and the help): not settings within one.
pub const SWITCHES: [&str; 6] = [
    "--nproc",
    "--elastic",
    "--ps",
    "--pipeline-stages",
    "--dry-run",
    "--help",
];

/// What a flag does in a mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expect {
    /// Accepted; its setting reaches `hparams.json`.
    Recorded,
    /// Accepted; it steers the run's mechanics (threads, files, membership), not its
    /// arithmetic, so `hparams.json` does not hold it.
    Mechanics,
    /// Refused by an error containing this text.
    Refused(&'static str),
}

/// The arguments that set `flag` (with a value, and what it needs beside it).
pub fn setting(flag: &str) -> Vec<&'static str> {
    let args: &[&'static str] = match flag {
        "--data" => &["--data", "other/folder"],
        "--labels" => &["--labels", "labels.csv"],
        // A folder to split: the generated set keeps its own val/ and refuses it.
        "--val-fraction" => &["--data", "other/folder", "--val-fraction", "0.3"],
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
        "--clip-grad" => &["--clip-grad", "1.0"],
        "--model-ema" => &["--model-ema"],
        "--model-ema-decay" => &["--model-ema", "--model-ema-decay", "0.99"],
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
        "--random-erasing" => &["--random-erasing", "0.25"],
        "--auto-augment" => &["--auto-augment", "trivialaugment"],
        "--mixup" => &["--mixup", "0.2"],
        "--cutmix" => &["--cutmix", "1.0"],
        "--mixup-prob" => &["--mixup", "0.2", "--mixup-prob", "0.5"],
        "--mixup-switch-prob" => &[
            "--mixup",
            "0.2",
            "--cutmix",
            "1.0",
            "--mixup-switch-prob",
            "0.3",
        ],
        "--mixup-off-epoch" => &["--mixup", "0.2", "--mixup-off-epoch", "1"],
        "--workers" => &["--workers", "3"],
        "--seed" => &["--seed", "3"],
        "--run-dir" => &["--run-dir", "somewhere"],
        "--resume" => &["--resume", "somewhere"],
        "--overwrite" => &["--overwrite"],
        "--stop-after-epoch" => &["--stop-after-epoch", "2"],
        "--log-every" => &["--log-every", "1"],
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
pub fn expect(flag: &str, mode: &str) -> Expect {
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
            | "--device" | "--log-every",
            _,
        ) => Mechanics,
        _ => Recorded,
    }
}

/// Every `--flag` the help of `hearth train` lists.
pub fn help_flags() -> BTreeSet<String> {
    let help = crate::common::hearth_cli(&["train", "--help"]);
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
