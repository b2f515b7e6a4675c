//! README's commands work as written. Every `hearth ...` or `cargo run --release -- ...` line
//! of README.md's shell blocks (and deploy/README.md's and those of every file in docs/) is
//! taken apart and checked the cheapest way that proves it:
//! - `train`: with `--dry-run`, every check a run makes before reading data (flags, values,
//!   their combinations, the pipeline split against the model's units);
//! - `data synth`, `models`, `devices`, `units`: run for real (in a scratch folder);
//! - `launch ... -- hearth CMD`: its own flags against `hearth launch --help`, CMD as above;
//! - commands that need files or time this test does not have (`predict` with weights,
//!   `bench`): every flag they use is one their `--help` lists.
//!
//! A README example that a change breaks fails here, not in a newcomer's terminal.

mod common;

use std::path::Path;
use std::process::Command;

/// Splits a shell line into words: whitespace-separated, `"..."` and `'...'` kept whole, a `#`
/// at a word's start ends the line.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut in_word = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, '#') if !in_word => break,
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// A documented command: the environment it sets, and hearth's arguments.
type Documented = (Vec<(String, String)>, Vec<String>);

/// The commands of `file`'s shell blocks.
fn commands(file: &Path) -> Vec<Documented> {
    let Ok(text) = std::fs::read_to_string(file) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_block = t == "```bash" || t == "```sh";
            pending.clear();
            continue;
        }
        if !in_block {
            continue;
        }
        // Continuation lines join the next.
        if let Some(head) = t.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        let full = std::mem::take(&mut pending) + t;
        let mut w = words(&full);
        let mut env = Vec::new();
        while let Some((k, v)) = w.first().and_then(|x| x.split_once('=')) {
            if !k.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                break;
            }
            env.push((k.to_string(), v.to_string()));
            w.remove(0);
        }
        // `...` stands for the reader's other flags.
        w.retain(|x| x != "...");
        let args: Vec<String> = match w.first().map(String::as_str) {
            Some("hearth") => w[1..].to_vec(),
            Some("cargo")
                if w.get(1..4) == Some(&["run".into(), "--release".into(), "--".into()]) =>
            {
                w[4..].to_vec()
            }
            _ => continue,
        };
        out.push((env, args));
    }
    out
}

fn hearth(args: &[String], env: &[(String, String)], cwd: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(args)
        // Only the job variables the command itself sets (a rank of a documented job).
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(cwd)
        .output()
        .unwrap()
}

/// The `--flags` a `--help` text lists, each whole (the long name on an option line), so that
/// `--size` is not found inside `--size-mb`.
fn help_flags(help: &str) -> std::collections::BTreeSet<String> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            // "--size <SIZE>  ...", "-h, --help  ...", "-n <N>  ..." (no long name: none).
            let long = if l.starts_with("--") {
                l
            } else if l.starts_with('-') {
                l.split_once(", ")?.1
            } else {
                return None;
            };
            let flag = long.split([' ', '=', '\t']).next()?;
            (flag.starts_with("--") && flag.len() > 2).then(|| flag.to_string())
        })
        .collect()
}

/// The `--flags` of `args` missing from `hearth SUBCOMMAND --help`.
fn unknown_flags(sub: &[&str], args: &[String], cwd: &Path) -> Vec<String> {
    let mut help_args: Vec<String> = sub.iter().map(|s| s.to_string()).collect();
    help_args.push("--help".into());
    let help = String::from_utf8_lossy(&hearth(&help_args, &[], cwd).stdout).into_owned();
    let flags = help_flags(&help);
    args.iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_string())
        .filter(|f| !flags.contains(f))
        .collect()
}

/// Checks one command; `Err` says what failed.
fn check(env: &[(String, String)], args: &[String], cwd: &Path) -> Result<(), String> {
    let run = |a: &[String]| {
        let out = hearth(a, env, cwd);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    };
    match args.first().map(String::as_str) {
        Some("train") => {
            let mut a = args.to_vec();
            if !a.iter().any(|x| x == "--dry-run") {
                a.push("--dry-run".into());
            }
            run(&a)
        }
        Some("data" | "models" | "devices" | "units") => run(args),
        Some("launch") => {
            let split = args
                .iter()
                .position(|a| a == "--")
                .ok_or("no -- in launch")?;
            let missing = unknown_flags(&["launch"], &args[..split], cwd);
            if !missing.is_empty() {
                return Err(format!("launch has no {missing:?}"));
            }
            let inner = &args[split + 1..];
            match inner.first().map(String::as_str) {
                Some("hearth") => check(env, &inner[1..], cwd),
                _ => Ok(()),
            }
        }
        Some(sub @ ("predict" | "eval" | "bench" | "export")) => {
            let mut path = vec![sub];
            if sub == "bench"
                && let Some(s) = args.get(1)
            {
                path.push(s.as_str());
            }
            let missing = unknown_flags(&path, &args[path.len()..], cwd);
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("{path:?} has no {missing:?}"))
            }
        }
        other => Err(format!("no check for {other:?}")),
    }
}

#[test]
fn every_readme_command_works_as_written() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut files = vec![root.join("README.md"), root.join("deploy/README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let readme = commands(&files[0]);
    assert!(
        readme.len() >= 10,
        "README's commands were not found: {readme:?}"
    );
    let mut failures = Vec::new();
    let mut count = 0;
    for file in &files {
        // A scratch folder per file, where its `data synth` commands write their sets (each
        // file is read on its own, from the top).
        let tmp = tempfile::tempdir().unwrap();
        for (env, args) in commands(file) {
            count += 1;
            if let Err(e) = check(&env, &args, tmp.path()) {
                failures.push(format!(
                    "{}: hearth {}:\n  {e}",
                    file.strip_prefix(root).unwrap_or(file).display(),
                    args.join(" ")
                ));
            }
        }
    }
    assert!(count >= 40, "the docs' commands were not found ({count})");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn flags_are_matched_whole_against_the_help() {
    let help =
        "Options:\n      --size-mb <MB>  Sizes\n  -n, --nproc <N>  Ranks\n  -h, --help  Help\n";
    let flags = help_flags(help);
    assert!(flags.contains("--size-mb") && flags.contains("--nproc") && flags.contains("--help"));
    assert!(!flags.contains("--size"), "{flags:?}");
}

/// README's headline command, run for real as a newcomer runs it (the release build's
/// `cargo run --release --` is this test's own build of `hearth`): it generates its data,
/// trains on 2 processes and ends with the validation accuracy README promises.
#[test]
fn the_headline_command_trains_to_the_accuracy_readme_states() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let first = readme
        .lines()
        .find(|l| l.starts_with("cargo run --release -- "))
        .expect("README's first lines give the main job's command");
    let args: Vec<String> = words(first.trim_start_matches("cargo run --release -- "));
    let promised: f64 = readme
        .split("validation accuracy (")
        .nth(1)
        .and_then(|t| t.split('%').next())
        .and_then(|v| v.trim().parse().ok())
        .expect("README states the headline's validation accuracy");
    let tmp = tempfile::tempdir().unwrap();
    // Output to a file: a pipe nobody reads until the end could fill and stall the run.
    let log = tmp.path().join("headline.log");
    let file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(&args)
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR")
        .current_dir(tmp.path())
        .stdout(std::process::Stdio::from(file.try_clone().unwrap()))
        .stderr(std::process::Stdio::from(file))
        .spawn()
        .unwrap();
    let status = common::wait_bounded(
        &mut child,
        std::time::Instant::now() + std::time::Duration::from_secs(600),
    );
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.is_some_and(|s| s.success()),
        "hearth {args:?}:\n{out}"
    );
    let accuracy: f64 = out
        .lines()
        .filter_map(|l| l.split("validation accuracy: ").nth(1))
        .filter_map(|v| v.trim().trim_end_matches('%').parse().ok())
        .next_back()
        .unwrap_or_else(|| panic!("no validation accuracy line:\n{out}"));
    assert!(
        accuracy >= promised - 1e-9,
        "README promises {promised}%, the run reached {accuracy}%:\n{out}"
    );
}

#[test]
fn the_line_splitter_keeps_quotes_and_drops_comments() {
    assert_eq!(
        words(r#"a --churn "t=30s:-1,t=60s:+2" -- b   # comment"#),
        ["a", "--churn", "t=30s:-1,t=60s:+2", "--", "b"]
    );
    assert_eq!(
        words("x --size-mb 1 10 100"),
        ["x", "--size-mb", "1", "10", "100"]
    );
}
