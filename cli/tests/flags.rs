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
        (
            &[][..],
            &["--size", "100000"][..],
            "--size 100000 is above the maximum of 4096",
        ),
        // Said by the dry run, not first by the run after it made its folder.
        (
            &[][..],
            &["--val-fraction", "1.5"][..],
            "--val-fraction 1.5 must be in (0, 1)",
        ),
        (
            &[][..],
            &["--workers", "0"][..],
            "--workers 0: at least 1 thread",
        ),
        (
            &[][..],
            &["--nproc", "0"][..],
            "--nproc 0: a job needs at least 1 process",
        ),
        (
            &[][..],
            &["--weight-decay=-1"][..],
            "--weight-decay -1 must be 0 or more",
        ),
        (
            &[][..],
            &["--price-per-hour=-1"][..],
            "--price-per-hour -1 must be 0 or more",
        ),
        (
            &[][..],
            &["--stop-after-epoch", "0"][..],
            "--stop-after-epoch 0: the run would end",
        ),
        (
            &[][..],
            &["--val-fraction", "0.3"][..],
            "--val-fraction 0.3: without --data the generated synthetic set is used",
        ),
        // Each would do nothing, or not what it says, within the run.
        (
            &[][..],
            &["--epochs", "2", "--warmup-epochs", "3"][..],
            "--warmup-epochs 3 is longer than the run (--epochs 2)",
        ),
        (
            &[][..],
            &["--epochs", "2", "--stop-after-epoch", "3"][..],
            "--stop-after-epoch 3 is past the run's last epoch (--epochs 2)",
        ),
        (
            &[][..],
            &["--epochs", "2", "--mixup", "0.2", "--mixup-off-epoch", "2"][..],
            "--mixup-off-epoch 2 is not before the run's last epoch (--epochs 2)",
        ),
        // A negative angle was taken as no rotation.
        (
            &[][..],
            &["--rotate=-10"][..],
            "angle -10 must be in [0, 180]",
        ),
        (&[][..], &["--shear=-5"][..], "angle -5 must be in [0, 180]"),
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

/// The commands of `hearth --help` (and of its command groups), as their words.
fn commands() -> Vec<String> {
    let listed = |group: &[&str]| -> Vec<String> {
        let mut args = group.to_vec();
        args.push("--help");
        let out = hearth(&args);
        assert!(out.status.success(), "hearth {args:?}");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(String::from)
            .collect()
    };
    let mut all = Vec::new();
    for command in listed(&[]) {
        let subs = match command.as_str() {
            "data" | "bench" | "weights" => listed(&[&command]),
            _ => Vec::new(),
        };
        all.extend(subs.iter().map(|s| format!("{command} {s}")));
        if subs.is_empty() {
            all.push(command);
        }
    }
    all
}

/// `--device`, `--autotune` and `--kernel-bundle` on every command: a command that runs
/// nothing on a device refuses each one the command line gives, by name and before it does
/// anything (set in the environment they pass: the shell's standing choice); `launch` gives
/// each to every rank through that environment, and refuses one its ranks' command gives too.
/// A command added without a row here fails the test until someone decides what it does.
#[test]
fn the_global_flags_act_or_are_refused_by_name_on_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("b.ccb");
    std::fs::write(&bundle, b"not read").unwrap();
    let out = dir.path().join("synth");
    let (out, bundle) = (out.to_str().unwrap(), bundle.to_str().unwrap());
    // (the command's words, arguments it needs to parse, whether a device runs its work)
    let rows: &[(&str, &[&str], bool)] = &[
        ("models", &[], false),
        ("devices", &[], false),
        ("units", &["--model", "resnet18"], false),
        ("predict", &[], true),
        ("eval", &[], true),
        ("export", &[], true),
        ("weights fetch", &["resnet18"], false),
        ("bench model", &[], true),
        ("bench loader", &[], true),
        ("bench allreduce", &[], false),
        ("bench allreduce-rank", &[], false),
        ("data synth", &["--out", out], false),
        ("data check", &["--data", out], false),
        ("train", &[], true),
        ("secret", &[], false),
        ("launch", &[], true),
        ("tune", &[], true),
        ("autotune-report", &["decisions.jsonl"], false),
    ];
    let listed = commands();
    let missing: Vec<&String> = listed
        .iter()
        .filter(|c| !rows.iter().any(|(w, _, _)| w == c))
        .collect();
    assert!(missing.is_empty(), "commands without a row: {missing:?}");
    let clean = [
        ("HEARTH_DEVICE", None),
        ("HEARTH_AUTOTUNE", None),
        ("HEARTH_KERNEL_BUNDLE", None),
    ];
    for (words, needs, _) in rows.iter().filter(|(_, _, device)| !device) {
        for flag in [
            ["--device", "flex"],
            ["--autotune", "off"],
            ["--kernel-bundle", bundle],
        ] {
            let mut args: Vec<&str> = words.split(' ').collect();
            args.extend_from_slice(needs);
            args.extend_from_slice(&flag);
            let run = common::hearth_cli_env(&args, &clean);
            let err = String::from_utf8_lossy(&run.stderr);
            assert_eq!(run.status.code(), Some(1), "hearth {args:?}: {err}");
            let said = format!(
                "error: {}: `hearth {words}` runs nothing on a device",
                flag[0]
            );
            assert!(err.starts_with(&said), "hearth {args:?}: {err}");
            // Refused before it did anything: no synthetic set written, no download tried.
            assert!(run.stdout.is_empty(), "hearth {args:?}");
        }
    }
    assert!(!std::path::Path::new(out).exists());
    // From the environment, the same values pass.
    for (name, value) in [
        ("HEARTH_DEVICE", "flex"),
        ("HEARTH_AUTOTUNE", "off"),
        ("HEARTH_KERNEL_BUNDLE", bundle),
    ] {
        let run = common::hearth_cli_env(&["models"], &[(name, Some(value))]);
        assert!(run.status.success(), "{name}={value} hearth models");
    }
    // launch: each given flag reaches every rank; the launcher's own environment had none.
    let check = "test \"$HEARTH_DEVICE\" = flex && test \"$HEARTH_KERNEL_BUNDLE\" = \"$0\"";
    let args = [
        "--device",
        "flex",
        "--kernel-bundle",
        bundle,
        "launch",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        check,
        bundle,
    ];
    let run = common::hearth_cli_env(&args, &clean);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "launch did not give its ranks the flags: {err}"
    );
    for (args, said) in [
        (
            &[
                "--device",
                "flex",
                "launch",
                "-n",
                "1",
                "--",
                "hearth",
                "train",
                "--device=flex",
            ][..],
            "error: --device: given to `hearth launch` and to the ranks' command",
        ),
        (
            &["--device", "tpu", "launch", "-n", "1", "--", "true"][..],
            "error: --device tpu: unknown device 'tpu'",
        ),
    ] {
        let run = common::hearth_cli_env(args, &clean);
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "hearth {args:?}: {err}");
        assert!(err.starts_with(said), "hearth {args:?}: {err}");
    }
}

/// A folder with train/ and val/ splits nothing: `--val-fraction` (and `data check`'s
/// `--seed`, which only seeds that split) were ignored there without a word.
#[test]
fn a_split_flag_is_refused_where_the_folder_holds_its_own_val() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path());
    let (d, run) = (
        data.to_str().unwrap(),
        dir.path().join("run").to_str().unwrap().to_string(),
    );
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                "train",
                "--data",
                d,
                "--val-fraction",
                "0.3",
                "--epochs",
                "1",
                "--run-dir",
                &run,
            ],
            "--val-fraction 0.3: ",
        ),
        (
            &["data", "check", "--data", d, "--val-fraction", "0.3"],
            "--val-fraction: ",
        ),
        (&["data", "check", "--data", d, "--seed", "7"], "--seed: "),
    ];
    for (args, says) in cases {
        let out = hearth(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran");
        assert!(
            err.contains(says)
                && err.contains("holds train/ and val/, so val/ is the validation set"),
            "{args:?}: {err}"
        );
    }
    assert!(
        !dir.path().join("run").exists(),
        "the refused run made its folder"
    );
    // Split where there is no val/: the folder's train/ alone.
    let train = data.join("train");
    let out = hearth(&[
        "data",
        "check",
        "--data",
        train.to_str().unwrap(),
        "--val-fraction",
        "0.5",
        "--seed",
        "7",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("split by --val-fraction 0.5 (seed 7)"),
        "{text}"
    );
}
