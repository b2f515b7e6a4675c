//! No silent flags: every flag of `hearth train --help`, in every training mode, is either
//! accepted (and, where it changes the training's arithmetic, recorded in what `hparams.json`
//! would hold) or refused by an error that names it. The walk uses `--dry-run`, which runs
//! every check a real run makes before it reads data or launches ranks. A flag added to
//! `hearth train` without a row here fails the test until someone decides, for each mode,
//! what it does there. That a mode really applies an accepted flag: `tests/flag_effects.rs`
//! runs each one.

mod common;
mod flag_table;

use std::process::Output;

use flag_table::{Expect, MODES, SWITCHES, expect, help_flags, setting};

fn hearth(args: &[&str]) -> Output {
    common::hearth_cli(args)
}

fn dry_run(mode: &[&str], setting: &[&str]) -> Output {
    let mut args = vec!["train", "--dry-run"];
    args.extend_from_slice(mode);
    args.extend_from_slice(setting);
    hearth(&args)
}

#[test]
fn every_flag_of_train_is_used_or_refused_by_name_in_every_mode() {
    let flags = help_flags();
    assert!(flags.len() > 40, "{flags:?}");
    let mut failures = Vec::new();
    for (mode, base) in MODES {
        let baseline = dry_run(base, &[]);
        assert!(
            baseline.status.success(),
            "{mode} with default flags must be valid: {}",
            String::from_utf8_lossy(&baseline.stderr)
        );
        for flag in flags.iter().filter(|f| !SWITCHES.contains(&f.as_str())) {
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
        // Said, even at the default's value: one process exchanges nothing.
        (
            &[][..],
            &["--bucket-mb", "25"][..],
            "--bucket-mb does not apply",
        ),
        (
            &["--elastic"][..],
            &["--overlap", "--zero", "1"][..],
            "--overlap does not work with --zero in --elastic",
        ),
        (
            &["--nproc", "2"][..],
            &["--overlap", "--grad-accum", "2"][..],
            "--overlap does not work with --grad-accum",
        ),
        // ZeRO stage 3: what it does not work with yet.
        (
            &["--nproc", "2"][..],
            &["--zero", "3", "--model-ema"][..],
            "--zero 3 does not work with --model-ema",
        ),
        (
            &["--elastic"][..],
            &["--zero", "3"][..],
            "--zero 3 does not work with --elastic",
        ),
        (
            &["--nproc", "2"][..],
            &["--zero", "4"][..],
            "--zero 4: the stages are",
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
