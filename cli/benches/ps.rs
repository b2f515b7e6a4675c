//! Parameter servers against allreduce (issue 13's accuracy study): the same model on the same
//! data with 4 workers and the same number of samples seen (the same epochs), trained by
//! allreduce data parallelism and by one parameter server in sync, DOWNPOUR, ADAG and EASGD
//! mode, 3 seeds each. Prints final validation accuracy (mean and spread), wall time and bytes
//! exchanged per training sample, and writes `target/ps-bench/val_accuracy.png` (validation
//! accuracy against time, seed 0 of every mode).
//!
//! `cargo bench --bench ps --features test-hooks` (the straggler hook needs it; `HEARTH_PS_EPOCHS`, default 8; `HEARTH_PS_SEEDS`, default 3;
//! `HEARTH_PS_WINDOW`, default 4).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

type Rows = BTreeMap<usize, BTreeMap<String, f64>>;

fn rows(run: &Path) -> Rows {
    let text = std::fs::read_to_string(run.join("metrics.csv")).expect("metrics.csv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    lines
        .filter_map(|l| {
            let v: Vec<&str> = l.split(',').collect();
            let row = header[1..]
                .iter()
                .zip(&v[1..])
                .filter_map(|(h, x)| Some((h.to_string(), x.parse().ok()?)))
                .collect();
            Some((v[0].parse().ok()?, row))
        })
        .collect()
}

struct Outcome {
    wall: f64,
    val_accuracy: f64,
    bytes_per_sample: Option<f64>,
    /// (seconds, validation accuracy) per epoch.
    curve: Vec<(f64, f64)>,
    values: Option<f64>,
}

fn run(data: &Path, dir: &Path, mode: &str, seed: u64, epochs: &str, window: &str) -> Outcome {
    run_with(data, dir, mode, seed, epochs, window, &[])
}

fn run_with(
    data: &Path,
    dir: &Path,
    mode: &str,
    seed: u64,
    epochs: &str,
    window: &str,
    env: &[(&str, &str)],
) -> Outcome {
    let _ = std::fs::remove_dir_all(dir);
    let log_path = dir.with_extension("log");
    let log = std::fs::File::create(&log_path).expect("log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.args(["train", "--data"])
        .arg(data)
        .arg("--run-dir")
        .arg(dir)
        .args(["--epochs", epochs, "--batch-size", "32", "--lr", "0.05"])
        .args([
            "--momentum",
            "0.9",
            "--schedule",
            "constant",
            "--warmup-epochs",
            "0",
        ])
        .args(["--workers", "1", "--size", "32", "--augment", "none"])
        .args(["--seed", &seed.to_string()]);
    if mode == "allreduce" {
        cmd.args(["--nproc", "4"]);
    } else {
        cmd.args(["--nproc", "5", "--ps", "1", "--mode", mode]);
        // Sync exchanges every step: it has no window (and refuses one).
        if mode != "sync" {
            cmd.args(["--window", window]);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::from(log.try_clone().expect("log")))
        .stderr(Stdio::from(log))
        .spawn()
        .expect("hearth train");
    let until = Instant::now() + Duration::from_secs(3600);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < until, "the run hung");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "see {}", log_path.display());
    let wall = t.elapsed().as_secs_f64();
    let rows = rows(dir);
    let last = rows.values().last().expect("an epoch");
    let n = rows.len() as f64;
    let curve = rows
        .iter()
        .map(|(e, r)| {
            // Allreduce runs do not log time per epoch: spread the wall time evenly.
            let t = r
                .get("elapsed_seconds")
                .copied()
                .unwrap_or(wall * *e as f64 / n);
            (t, r["val_accuracy"])
        })
        .collect();
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let values = text.lines().find_map(|l| {
        let rest = l.split("parameter server 0: ").nth(1)?;
        rest.split(' ').next()?.parse().ok()
    });
    Outcome {
        wall,
        val_accuracy: last["val_accuracy"],
        bytes_per_sample: last.get("bytes_per_sample").copied(),
        curve,
        values,
    }
}

fn main() {
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .join("target")
        .join("ps-bench");
    let data = root.join("data");
    if !data.join("val").is_dir() {
        hearth::datasets::synth::generate(
            &data,
            &hearth::datasets::synth::SynthConfig::new(6, 100, 32)
                .with_seed(11)
                .with_val(30),
        )
        .expect("synthetic data");
    }
    let epochs = std::env::var("HEARTH_PS_EPOCHS").unwrap_or_else(|_| "8".into());
    let seeds: u64 = std::env::var("HEARTH_PS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let window = std::env::var("HEARTH_PS_WINDOW").unwrap_or_else(|_| "4".into());
    let modes = ["allreduce", "sync", "downpour", "adag", "easgd"];
    let mut results: Vec<(&str, Vec<Outcome>)> = Vec::new();
    for mode in modes {
        let mut outs = Vec::new();
        for seed in 0..seeds {
            println!("{mode}, seed {seed} ...");
            outs.push(run(
                &data,
                &root.join(format!("{mode}-{seed}")),
                mode,
                seed,
                &epochs,
                &window,
            ));
        }
        results.push((mode, outs));
    }
    let values = results
        .iter()
        .flat_map(|(_, o)| o.iter().filter_map(|x| x.values))
        .next()
        .unwrap_or(f64::NAN);
    println!(
        "4 workers, {epochs} epochs of 600 images, batch 32 (8 per worker), lr 0.05, window {window}, {} seeds",
        seeds
    );
    println!("| mode | val accuracy % (mean) | min-max | wall s (mean) | bytes per sample |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (mode, outs) in &results {
        let acc: Vec<f64> = outs.iter().map(|o| o.val_accuracy).collect();
        let mean = acc.iter().sum::<f64>() / acc.len() as f64;
        let lo = acc.iter().copied().fold(f64::MAX, f64::min);
        let hi = acc.iter().copied().fold(f64::MIN, f64::max);
        let wall = outs.iter().map(|o| o.wall).sum::<f64>() / outs.len() as f64;
        let bytes = match outs[0].bytes_per_sample {
            Some(b) => format!("{b:.0}"),
            // Ring allreduce: every one of n workers sends and receives 2(n-1)/n of the
            // gradient per step, 4(n-1) x 4 bytes x values per step in all, over 32 samples.
            None => format!("{:.0} (ring, computed)", 4.0 * 3.0 * 4.0 * values / 32.0),
        };
        println!("| {mode} | {mean:.2} | {lo:.1}-{hi:.1} | {wall:.1} | {bytes} |");
    }
    // A straggler: worker 1 sleeps 100 ms in every step (the test-only delay).
    println!("straggler: worker 1 delayed 100 ms per step, seed 0");
    println!("| mode | wall s | val accuracy % |");
    println!("| --- | ---: | ---: |");
    for mode in ["sync", "adag"] {
        let o = run_with(
            &data,
            &root.join(format!("{mode}-straggler")),
            mode,
            0,
            &epochs,
            &window,
            &[("HEARTH_PS_DELAY_MS", "w1:100")],
        );
        println!("| {mode} | {:.1} | {:.2} |", o.wall, o.val_accuracy);
    }
    let curves: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .map(|(m, o)| (m.to_string(), o[0].curve.clone()))
        .collect();
    let png = root.join("val_accuracy.png");
    match hearth::plot::plot_curves(
        "validation accuracy, 4 workers (seed 0)",
        "seconds",
        "validation accuracy (%)",
        &curves,
        &png,
    ) {
        Ok(()) => println!("plot: {}", png.display()),
        Err(e) => println!("no plot: {e}"),
    }
}
