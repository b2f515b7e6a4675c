//! The gradient exchange's share of a data-parallel step, without and with `--overlap`, against
//! PyTorch DDP (which always overlaps) in the same run.
//!
//! `cargo bench --bench overlap` trains ResNet-50 (by default) with `hearth train` on 2 ranks,
//! 2 epochs of a synthetic set, each rank on `cores / ranks` threads, and reads rank 0's
//! report of the second epoch: `gradient exchange X s of Y s in training steps` (with
//! `--overlap`, X is only what the backward pass did not hide: the wait at its end). Each
//! setting runs `HEARTH_BENCH_ROUNDS` rounds of without-then-with, and prints medians:
//!
//! - the step (Y per step), the exchange's exposed share (X / Y), and the effective share
//!   `(step - compute) / step`, where `compute` is the step without `--overlap` less its
//!   exchange: what the exchange costs the step in all, including the segmented backward's
//!   overhead and the exchange's contention with the backward for the cores;
//! - PyTorch DDP's step (gloo, 25 MB buckets) with its exchange and without (`no_sync()`), and
//!   its effective share the same way; and the ratio of the two steps.
//!
//! Settings: the ranks on this host (shared memory), then, when run as root, 2 network
//! namespaces as 2 hosts whose links `tc` shapes to each rate of `HEARTH_OVERLAP_RATES`
//! (default `1gbit,10gbit`; QUIC between them, `scripts/netns_run.sh`).
//!
//! Environment: `HEARTH_OVERLAP_MODEL` (resnet50), `HEARTH_OVERLAP_SIZE` (128),
//! `HEARTH_OVERLAP_BATCH` (16, global), `HEARTH_OVERLAP_STEPS` (8 per epoch),
//! `HEARTH_BENCH_ROUNDS` (2), `HEARTH_OVERLAP_RATES`, `HEARTH_OVERLAP_HERE` (0 skips the
//! one-host setting), `HEARTH_TORCH_PYTHON`, `HEARTH_OVERLAP_MODE` (`dp`, default, or
//! `elastic`: the same with `hearth launch --elastic -n 2 --min 2 --max 2 -- hearth train
//! --elastic` on this host, and `hearth train --elastic --min-workers 2 --max-workers 2` in
//! each namespace), `HEARTH_OVERLAP_ZERO` (unset; `1`, `2` or `3` runs Hearth's jobs with
//! `--zero N`, and each round also plain data parallel with `--overlap`, whose step the
//! sharded one is compared to: ZeRO stage 3's goal of a step within 25% of plain data
//! parallel, overlapped between hosts). `HEARTH_OVERLAP_ZERO_BUCKETS` (with
//! `HEARTH_OVERLAP_ZERO`; a list of MiB, e.g. `25,1,0.05`): each round also runs the sharded
//! job with `--overlap` at each of these `--bucket-mb` (stage 3: how finely its backward
//! gathers and reduces; its default is 1, the other stages' 25), each compared to plain data
//! parallel alike.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const RANKS: usize = 2;

/// The settings every run shares.
struct Setup {
    model: String,
    size: usize,
    batch: usize,
    steps: usize,
    threads: usize,
    /// `HEARTH_OVERLAP_MODE=elastic`: elastic training instead of data parallel.
    elastic: bool,
    /// `HEARTH_OVERLAP_ZERO`: the ZeRO stage of Hearth's jobs.
    zero: Option<String>,
    /// `HEARTH_OVERLAP_ZERO_BUCKETS`: the `--bucket-mb` of further sharded jobs per round.
    zero_buckets: Vec<String>,
    data: PathBuf,
    work: PathBuf,
    python: Option<PathBuf>,
}

/// Where the ranks run.
#[derive(Clone)]
enum Place {
    /// On this host (shared memory between the ranks).
    Here,
    /// In network namespaces, each link shaped to this rate.
    Hosts(String),
}

impl Place {
    fn name(&self) -> String {
        match self {
            Place::Here => format!("{RANKS} ranks on this host (shared memory)"),
            Place::Hosts(rate) => format!("{RANKS} namespace hosts, {rate} links (QUIC)"),
        }
    }
}

/// `(exchange s, training-step s)` from rank 0's report of epoch 2.
fn parse_exchange(log: &str) -> Option<(f64, f64)> {
    let line = log
        .lines()
        .find(|l| l.contains("epoch 2: gradient exchange"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let before = |w: &str| {
        let at = words.windows(2).position(|p| p[0] == "s" && p[1] == w)?;
        words.get(at.checked_sub(1)?)?.parse::<f64>().ok()
    };
    Some((before("of")?, before("in")?))
}

/// `(step s, compute s)` from the PyTorch peer's rank 0.
fn parse_peer(out: &str) -> Option<(f64, f64)> {
    let line = out.lines().find(|l| l.starts_with("peer step_s="))?;
    let value = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((value("step_s=")?, value("compute_s=")?))
}

fn netns_run(rate: &str, logs: &Path, command: &[String]) -> bool {
    let script =
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("scripts/netns_run.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(["--ranks", &RANKS.to_string(), "--rate", rate, "--logs"])
        .arg(logs)
        .arg("--")
        .args(command)
        .status();
    status.is_ok_and(|s| s.success())
}

/// One `hearth train` job at `place` (with `zero`: `--zero` at that stage): (exchange s,
/// training-step s) of epoch 2.
fn hearth_run(
    s: &Setup,
    place: &Place,
    overlap: bool,
    zero: Option<&str>,
    bucket_mb: Option<&str>,
    run: &Path,
) -> Option<(f64, f64)> {
    let _ = std::fs::remove_dir_all(run);
    let mut args: Vec<String> = [
        "train",
        "--model",
        &s.model,
        "--size",
        &s.size.to_string(),
        "--batch-size",
        &s.batch.to_string(),
        "--epochs",
        "2",
        "--augment",
        "none",
        "--workers",
        "1",
        "--data",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.push(s.data.display().to_string());
    args.push("--run-dir".into());
    args.push(run.display().to_string());
    if overlap {
        args.push("--overlap".into());
    }
    if let Some(z) = zero {
        args.extend(["--zero".into(), z.to_string()]);
    }
    if let Some(b) = bucket_mb {
        args.extend(["--bucket-mb".into(), b.to_string()]);
    }
    let hearth = env!("CARGO_BIN_EXE_hearth").to_string();
    let log = match place {
        Place::Here => {
            let mut command = Command::new(&hearth);
            if s.elastic {
                let n = RANKS.to_string();
                command
                    .args([
                        "launch",
                        "--elastic",
                        "-n",
                        &n,
                        "--min",
                        &n,
                        "--max",
                        &n,
                        "--",
                    ])
                    .arg(&hearth)
                    .args(&args)
                    .arg("--elastic");
            } else {
                command.args(&args).args(["--nproc", &RANKS.to_string()]);
            }
            let out = command
                .env("RAYON_NUM_THREADS", s.threads.to_string())
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stderr).to_string()
                + &String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                eprintln!("hearth train failed:\n{text}");
                return None;
            }
            text
        }
        Place::Hosts(rate) => {
            let logs = run.with_extension("logs");
            let mut command = vec![
                "env".to_string(),
                format!("RAYON_NUM_THREADS={}", s.threads),
                hearth,
            ];
            command.extend(args);
            if s.elastic {
                // Each namespace's rank starts as an initial worker of a fixed world (no
                // launcher: netns_run.sh gives it its rank, the world and the coordinator).
                let n = RANKS.to_string();
                command.extend(
                    ["--elastic", "--min-workers", &n, "--max-workers", &n].map(String::from),
                );
            }
            if !netns_run(rate, &logs, &command) {
                eprintln!(
                    "hearth train in namespaces failed:\n{}",
                    std::fs::read_to_string(logs.join("rank0.log")).unwrap_or_default()
                );
                return None;
            }
            std::fs::read_to_string(logs.join("rank0.log")).ok()?
        }
    };
    let parsed = parse_exchange(&log);
    if parsed.is_none() {
        eprintln!("no exchange report in rank 0's log:\n{log}");
    }
    parsed
}

/// The PyTorch DDP peer at `place`: (step s, compute s).
fn torch_run(s: &Setup, place: &Place, python: &Path) -> Option<(f64, f64)> {
    let script = common::peer_script("torch_ddp_exchange.py");
    let args: Vec<String> = vec![
        python.display().to_string(),
        script.display().to_string(),
        "--model".into(),
        s.model.clone(),
        "--size".into(),
        s.size.to_string(),
        "--batch-size".into(),
        (s.batch / RANKS).to_string(),
        "--steps".into(),
        s.steps.to_string(),
        "--warmup".into(),
        "2".into(),
        "--threads".into(),
        s.threads.to_string(),
    ];
    match place {
        Place::Here => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .ok()?
                .port();
            let mut kids: Vec<_> = (0..RANKS)
                .map(|r| {
                    Command::new(&args[0])
                        .args(&args[1..])
                        .env("RANK", r.to_string())
                        .env("WORLD_SIZE", RANKS.to_string())
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", port.to_string())
                        .stdout(std::process::Stdio::piped())
                        .spawn()
                })
                .collect::<std::io::Result<_>>()
                .ok()?;
            let outs: Vec<_> = kids.drain(..).map(|k| k.wait_with_output()).collect();
            let first = outs.into_iter().next()?.ok()?;
            parse_peer(&String::from_utf8_lossy(&first.stdout))
        }
        Place::Hosts(rate) => {
            let logs = s.work.join(format!("torch-{rate}.logs"));
            if !netns_run(rate, &logs, &args) {
                eprintln!(
                    "the PyTorch peer failed in namespaces:\n{}",
                    std::fs::read_to_string(logs.join("rank0.log")).unwrap_or_default()
                );
                return None;
            }
            parse_peer(&std::fs::read_to_string(logs.join("rank0.log")).ok()?)
        }
    }
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rounds = common::env_usize("HEARTH_BENCH_ROUNDS", 2).max(1);
    let work = tempfile::tempdir().expect("a temporary directory");
    let s = Setup {
        model: std::env::var("HEARTH_OVERLAP_MODEL").unwrap_or_else(|_| "resnet50".into()),
        size: common::env_usize("HEARTH_OVERLAP_SIZE", 128),
        batch: common::env_usize("HEARTH_OVERLAP_BATCH", 16),
        steps: common::env_usize("HEARTH_OVERLAP_STEPS", 8),
        threads: (cores / RANKS).max(1),
        elastic: match std::env::var("HEARTH_OVERLAP_MODE").as_deref() {
            Err(_) | Ok("dp") => false,
            Ok("elastic") => true,
            Ok(other) => {
                eprintln!("HEARTH_OVERLAP_MODE={other}: expected dp or elastic");
                std::process::exit(1);
            }
        },
        zero: match std::env::var("HEARTH_OVERLAP_ZERO")
            .ok()
            .filter(|z| !z.is_empty())
        {
            Some(z) if ["1", "2", "3"].contains(&z.as_str()) => Some(z),
            Some(z) => {
                eprintln!("HEARTH_OVERLAP_ZERO={z}: expected 1, 2 or 3");
                std::process::exit(1);
            }
            None => None,
        },
        zero_buckets: common::env_list("HEARTH_OVERLAP_ZERO_BUCKETS", ""),
        data: work.path().join("data"),
        work: work.path().to_path_buf(),
        python: common::torch_python(),
    };
    let classes = 4;
    let per_class = (s.steps * s.batch).div_ceil(classes);
    hearth::datasets::synth::generate(
        &s.data,
        &hearth::datasets::synth::SynthConfig::new(classes, per_class, s.size as u32)
            .with_seed(1)
            .with_val(1),
    )
    .expect("the synthetic data set");
    println!(
        "{}{}{} at {}x{}, global batch {} on {RANKS} ranks, {} steps per epoch (epoch 2 timed), \
         {} thread(s) per rank, {rounds} round(s); CPU: {}",
        if s.elastic {
            "elastic training (hearth launch --elastic), "
        } else {
            ""
        },
        s.zero
            .as_ref()
            .map_or(String::new(), |z| format!("Hearth with --zero {z}, ")),
        s.model,
        s.size,
        s.size,
        s.batch,
        s.steps,
        s.threads,
        common::cpu()
    );
    let mut places = Vec::new();
    if common::env_usize("HEARTH_OVERLAP_HERE", 1) != 0 {
        places.push(Place::Here);
    }
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if is_root {
        for rate in common::env_list("HEARTH_OVERLAP_RATES", "1gbit,10gbit") {
            places.push(Place::Hosts(rate));
        }
    } else {
        println!("(not root: the namespace hosts are skipped)");
    }
    for place in &places {
        println!("\n{}", place.name());
        let (mut off, mut on, mut peer, mut plain) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut by_bucket = vec![Vec::new(); s.zero_buckets.len()];
        for round in 0..rounds {
            for overlap in [false, true] {
                let run = s.work.join(format!("run-{round}-{overlap}"));
                match hearth_run(&s, place, overlap, s.zero.as_deref(), None, &run) {
                    Some(r) => (if overlap { &mut on } else { &mut off }).push(r),
                    None => println!("  round {round}, overlap {overlap}: failed"),
                }
            }
            if s.zero.is_some() {
                let run = s.work.join(format!("run-{round}-plain"));
                match hearth_run(&s, place, true, None, None, &run) {
                    Some(r) => plain.push(r),
                    None => println!("  round {round}, plain data parallel: failed"),
                }
            }
            for (b, mb) in s.zero_buckets.iter().enumerate() {
                let run = s.work.join(format!("run-{round}-bucket-{b}"));
                match hearth_run(&s, place, true, s.zero.as_deref(), Some(mb), &run) {
                    Some(r) => by_bucket[b].push(r),
                    None => println!("  round {round}, --bucket-mb {mb}: failed"),
                }
            }
            if let Some(py) = &s.python
                && let Some(p) = torch_run(&s, place, py)
            {
                peer.push(p);
            }
        }
        report(&s, &off, &on, &peer);
        report_zero(&s, &on, &plain, "");
        for (mb, on) in s.zero_buckets.iter().zip(&by_bucket) {
            report_zero(&s, on, &plain, &format!(" --bucket-mb {mb}"));
        }
    }
}

/// `HEARTH_OVERLAP_ZERO`: the sharded step with `--overlap` against plain data parallel's
/// with `--overlap`, by the medians of the rounds.
fn report_zero(s: &Setup, on: &[(f64, f64)], plain: &[(f64, f64)], with: &str) {
    let Some(z) = &s.zero else {
        return;
    };
    if on.is_empty() || plain.is_empty() {
        println!("  --zero {z}{with} against plain data parallel: no complete round");
        return;
    }
    let steps = s.steps as f64;
    let med = |v: &[(f64, f64)]| common::median(v.iter().map(|r| r.1 / steps));
    let (zero_step, plain_step) = (med(on), med(plain));
    println!(
        "  plain data parallel with --overlap: step {plain_step:.3} s; --zero {z}{with} with \
         --overlap: step {zero_step:.3} s, / plain: {:.3}x (goal for stage 3: at most 1.25x)",
        zero_step / plain_step
    );
}

/// Medians of the rounds, per step.
fn report(s: &Setup, off: &[(f64, f64)], on: &[(f64, f64)], peer: &[(f64, f64)]) {
    let steps = s.steps as f64;
    let med = |v: Vec<f64>| common::median(v.into_iter());
    if off.is_empty() || on.is_empty() {
        println!("  no complete round");
        return;
    }
    let off_step = med(off.iter().map(|r| r.1 / steps).collect());
    let off_x = med(off.iter().map(|r| r.0 / steps).collect());
    let on_step = med(on.iter().map(|r| r.1 / steps).collect());
    let on_x = med(on.iter().map(|r| r.0 / steps).collect());
    let compute = off_step - off_x;
    let pct = |x: f64, of: f64| 100.0 * x / of;
    println!(
        "  hearth without --overlap: step {:.3} s, exchange {:.3} s ({:.1}%)",
        off_step,
        off_x,
        pct(off_x, off_step)
    );
    println!(
        "  hearth with --overlap:    step {:.3} s, exchange waited {:.3} s ({:.1}%), \
         effective share {:.1}% (compute {:.3} s)",
        on_step,
        on_x,
        pct(on_x, on_step),
        pct(on_step - compute, on_step),
        compute
    );
    println!(
        "  step with --overlap / without: {:.3}x",
        on_step / off_step
    );
    if peer.is_empty() {
        println!("  PyTorch DDP: not run (no python with torch: HEARTH_TORCH_PYTHON)");
        return;
    }
    let p_step = med(peer.iter().map(|r| r.0).collect());
    let p_compute = med(peer.iter().map(|r| r.1).collect());
    println!(
        "  PyTorch DDP (overlapped): step {:.3} s, compute {:.3} s, effective share {:.1}%",
        p_step,
        p_compute,
        pct(p_step - p_compute, p_step)
    );
    println!(
        "  Hearth's step with --overlap against PyTorch DDP's: {:.2}x the speed",
        p_step / on_step
    );
}
