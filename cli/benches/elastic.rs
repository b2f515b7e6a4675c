//! Elastic training's cost and accuracy (issue 12's benchmark): the same model trained on the
//! same samples (the same epochs of the same data) by a fixed world of 4 workers and by a
//! world that churns between 2 and 4 (graceful leaves, joiners, one kill), as spot instances
//! come and go. Prints wall time, worker-seconds (the world size integrated over time: what
//! the workers cost) and the final validation accuracy of each, and writes
//! `target/elastic-bench/world.png` with both runs' world size over time.
//!
//! `cargo bench --bench elastic` (`HEARTH_ELASTIC_EPOCHS`, default 30; `HEARTH_ELASTIC_CHURN`
//! replaces the churn schedule).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Outcome {
    wall: f64,
    worker_seconds: f64,
    val_accuracy: f64,
    world: Vec<(f64, f64)>,
}

fn last_row(run: &Path) -> std::collections::BTreeMap<String, f64> {
    let text = std::fs::read_to_string(run.join("metrics.csv")).expect("metrics.csv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let last: Vec<&str> = lines.last().unwrap_or("").split(',').collect();
    header
        .iter()
        .zip(last)
        .filter_map(|(h, v)| Some((h.to_string(), v.parse().ok()?)))
        .collect()
}

fn run(data: &Path, dir: &Path, launch: &[&str], epochs: &str) -> Outcome {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("bench dir");
    let log = std::fs::File::create(dir.with_extension("log")).expect("log");
    let t = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["launch", "--elastic"])
        .args(launch)
        .args(["--", "hearth", "train", "--elastic", "--data"])
        .arg(data)
        .args(["--run-dir"])
        .arg(dir)
        .args([
            "--epochs",
            epochs,
            "--batch-size",
            "32",
            "--lr",
            "0.05",
            "--workers",
            "1",
            "--size",
            "32",
            "--model",
            "resnet-mini",
            "--seed",
            "3",
        ])
        .stdout(Stdio::from(log.try_clone().expect("log")))
        .stderr(Stdio::from(log))
        .spawn()
        .expect("hearth launch");
    let until = Instant::now() + Duration::from_secs(3600);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < until, "the run hung");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "see {}",
        dir.with_extension("log").display()
    );
    let wall = t.elapsed().as_secs_f64();
    let row = last_row(dir);
    let world = std::fs::read_to_string(dir.join("world.csv"))
        .expect("world.csv")
        .lines()
        .skip(1)
        .filter_map(|l| {
            let c: Vec<&str> = l.split(',').collect();
            Some((c.get(1)?.parse().ok()?, c.get(2)?.parse().ok()?))
        })
        .collect();
    Outcome {
        wall,
        worker_seconds: row["worker_seconds"],
        val_accuracy: row["val_accuracy"],
        world,
    }
}

fn main() {
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .join("target")
        .join("elastic-bench");
    let data = root.join("data");
    if !data.join("val").is_dir() {
        hearth::datasets::synth::generate(
            &data,
            &hearth::datasets::synth::SynthConfig::new(6, 100, 32)
                .with_seed(11)
                .with_val(20),
        )
        .expect("synthetic data");
    }
    let epochs = std::env::var("HEARTH_ELASTIC_EPOCHS").unwrap_or_else(|_| "30".into());
    let churn = std::env::var("HEARTH_ELASTIC_CHURN").unwrap_or_else(|_| {
        "t=8s:-1,t=16s:-1,t=28s:+1,t=36s:-1!,t=44s:+2,t=56s:-2,t=70s:+1".into()
    });
    println!("fixed world of 4 ...");
    let fixed = run(
        &data,
        &root.join("fixed"),
        &["-n", "4", "--max", "4"],
        &epochs,
    );
    println!("churn between 2 and 4 ({churn}) ...");
    let churned = run(
        &data,
        &root.join("churn"),
        &["-n", "4", "--min", "2", "--max", "4", "--churn", &churn],
        &epochs,
    );
    println!("| run | wall s | worker-seconds | val accuracy % |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, o) in [("fixed 4", &fixed), ("churn 2-4", &churned)] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.2} |",
            o.wall, o.worker_seconds, o.val_accuracy
        );
    }
    println!(
        "elastic / fixed: worker-seconds {:.2}x, wall {:.2}x, accuracy {:+.2} points",
        churned.worker_seconds / fixed.worker_seconds,
        churned.wall / fixed.wall,
        churned.val_accuracy - fixed.val_accuracy
    );
    let png = root.join("world.png");
    match hearth::plot::plot_worlds(
        &[("fixed 4", &fixed.world), ("churn 2-4", &churned.world)],
        &png,
    ) {
        Ok(()) => println!("world size over time: {}", png.display()),
        Err(e) => println!("no plot: {e}"),
    }
}
