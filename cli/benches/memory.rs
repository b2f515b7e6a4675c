//! Memory at scale: each rank's peak resident memory and the step time of data parallel with
//! the plain optimizer and with the sharded one (`--zero 1|2|3`), against PyTorch DDP over gloo
//! (plain, and `ZeroRedundancyOptimizer`, PyTorch's stage 1) on this machine, in the same run.
//!
//!   cargo bench --bench memory
//!   HEARTH_MEM_MODELS=resnet50 HEARTH_MEM_RANKS=2 cargo bench --bench memory     # a part
//!   HEARTH_MEM_OPTIMIZERS=sgd,adam HEARTH_MEM_RANKS=1,2,4 ...                     # more rows
//!   HEARTH_MEM_RECOMPUTE=both HEARTH_MEM_SIZE=224 HEARTH_MEM_PER_RANK=8 ...        # --recompute
//!
//! `HEARTH_MEM_RECOMPUTE=on|both` runs every configuration with `--recompute` (or both without
//! and with it); its "saved" column is then against the same N without either.
//!
//! Every configuration is a real job: `hearth train --nproc N --model M --size 32
//! --batch-size 2N --epochs 1` over a synthetic set of 3 classes x 32 images (2 each for
//! validation) (2 images per rank and step, so the activations per rank stay the same and only
//! what sharding moves changes). Each rank prints its peak (VmHWM) at the end; the step time is
//! the global batch over the epoch's `train_images_per_sec`. What sharding should free is
//! counted from the model: SGD with momentum keeps one value per trainable parameter, Adam two;
//! `--zero` keeps 1/N of them, `--zero 2` also 1/N of the gradients, and `--zero 3` also 1/N of
//! the parameters. The goal (issue 58):
//! the peak resident memory saved against plain data parallel at least 80% of that share, at
//! N = 2 and 4, for VGG-16 and ResNet-50 with Adam; the last column says whether it is met.
//! Stage 2 runs twice: as it is, and with `--overlap` ("2 + overlap"), where each bucket's
//! gradient is reduce-scattered during the backward and dropped, which is where stage 2 saves
//! the gradients' share. Stage 3 (each unit's weights let go after its forward and gathered
//! again for its backward, the last unit's kept) runs twice: with 25 MiB buckets (the other
//! stages' default; stage 3's own is 1 MiB), where a unit's backward gathers its weights
//! whole, and with small ones (`--bucket-mb` from
//! `HEARTH_MEM_FINE_MB`, default 1, stage 3's own default), where its backward gathers a weight's bucket as the
//! weight's op needs it and reduces it as soon as its gradient is whole, and then with the
//! small buckets and `--overlap` ("3 + overlap": threads gather ahead, the pieces of a matrix
//! larger than a bucket in turn);
//! `HEARTH_MEM_RECOMPUTE=both` adds its `--recompute` row, where a rank holds one unit's
//! parameters at a time. PyTorch's column beside any stage is its stage 1.
//! `HEARTH_MEM_STAGES` (default `0,1,2,3`) keeps the rows of the stages it lists (without 0,
//! the "saved" columns have nothing to compare with).
//!
//! A second table holds stage 3 to issue 58's stricter goal: parameters, gradients and
//! optimizer state per rank at a step's peak within 10% of 1/N of the unsharded total. What a
//! rank holds between steps (its parameter shard and optimizer state) is counted; what a step
//! adds is each rank's printed rise of the live heap above what steps leave held, which also
//! counts activations, so the sum is an upper bound.
//!
//! Without `--bench` (`cargo test --benches`) it runs a small smoke configuration.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One measured job.
#[derive(Debug, Clone, Default)]
struct Measured {
    /// Each rank's peak, MB: resident (VmHWM), and live heap bytes (Hearth's counting
    /// allocator; what the process needed, apart from what the C allocator kept of freed memory).
    peaks: Vec<f64>,
    heaps: Vec<f64>,
    step_ms: f64,
    /// Each rank's largest rise of the live heap within a training step above what steps leave
    /// held, MB.
    rises: Vec<f64>,
    /// Trainable values (from the ZeRO line; 0 where the run printed none).
    values: u64,
}

/// `hearth train` as one job of `ranks`; what it measured.
#[allow(clippy::too_many_arguments)]
fn hearth(
    dir: &Path,
    data: &Path,
    model: &str,
    optimizer: &str,
    ranks: usize,
    zero: u8,
    overlap: bool,
    recompute: bool,
    bucket_mb: Option<&str>,
    size: usize,
    per_rank: usize,
) -> Result<Measured, String> {
    let run = dir.join(format!(
        "{model}-{optimizer}-{ranks}-{zero}-{overlap}-{recompute}-{}",
        bucket_mb.unwrap_or("default")
    ));
    let batch = (per_rank * ranks).to_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.args(["train", "--data"])
        .arg(data)
        .args(["--model", model, "--optimizer", optimizer])
        .args(["--size", &size.to_string(), "--batch-size", &batch])
        .args(["--epochs", "1", "--warmup-epochs", "0", "--augment", "none"])
        .args(["--workers", "1", "--nproc", &ranks.to_string()])
        .args(["--lr", if optimizer == "adam" { "0.001" } else { "0.01" }])
        .arg("--run-dir")
        .arg(&run)
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR");
    if zero > 0 {
        cmd.args(["--zero", &zero.to_string()]);
    }
    if recompute {
        cmd.arg("--recompute");
    }
    if overlap {
        cmd.arg("--overlap");
    }
    if let Some(mb) = bucket_mb {
        cmd.args(["--bucket-mb", mb]);
    }
    let out = cmd.output().map_err(|e| format!("hearth: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!(
            "hearth {model} {optimizer} N={ranks} zero {zero} overlap {overlap} recompute \
             {recompute} failed:\n{text}"
        ));
    }
    let mut m = Measured {
        peaks: vec![0.0; ranks],
        heaps: vec![0.0; ranks],
        rises: vec![0.0; ranks],
        ..Default::default()
    };
    for line in text.lines() {
        if let Some(rest) = line.split("peak memory of rank ").nth(1) {
            let rank: usize = rest
                .split(' ')
                .next()
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            // The megabytes printed after `label` (0 where the line has none).
            let mb_after = |label: &str| -> f64 {
                rest.split(label)
                    .nth(1)
                    .and_then(|v| v.split(" MB").next())
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0.0)
            };
            if rank < ranks {
                m.peaks[rank] = mb_after("VmHWM): ");
                m.heaps[rank] = mb_after("heap at most ");
                m.rises[rank] = mb_after("a training step at most ");
            }
        }
        if let Some(rest) = line.split("keeps the optimizer state of ").nth(1)
            && let Some(v) = rest.split(" of ").nth(1).and_then(|v| v.split(' ').next())
        {
            m.values = v.parse().unwrap_or(0);
        }
    }
    let csv = std::fs::read_to_string(run.join("metrics.csv")).map_err(|e| e.to_string())?;
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let row: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let col = header
        .iter()
        .position(|h| *h == "train_images_per_sec")
        .ok_or("no train_images_per_sec")?;
    let ips: f64 = row.get(col).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    m.step_ms = 1000.0 * (per_rank * ranks) as f64 / ips.max(1e-9);
    let _ = std::fs::remove_dir_all(&run);
    Ok(m)
}

/// PyTorch's job of the same shape (`zero` 1 or 2: ZeroRedundancyOptimizer, its stage 1).
#[allow(clippy::too_many_arguments)]
fn torch(
    python: &Path,
    model: &str,
    optimizer: &str,
    ranks: usize,
    zero: u8,
    size: usize,
    per_rank: usize,
    steps: usize,
) -> Result<Measured, String> {
    let out = Command::new(python)
        .arg(common::peer_script("torch_memory.py"))
        .args(["--model", model, "--optimizer", optimizer])
        .args([
            "--ranks",
            &ranks.to_string(),
            "--zero",
            &(zero.min(1)).to_string(),
        ])
        .args([
            "--batch",
            &per_rank.to_string(),
            "--size",
            &size.to_string(),
        ])
        .args(["--steps", &steps.to_string()])
        .output()
        .map_err(|e| format!("python: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "torch {model} N={ranks} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut m = Measured {
        peaks: vec![0.0; ranks],
        ..Default::default()
    };
    let mut times = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let field = |k: &str| -> Option<f64> {
            line.split(&format!("\"{k}\": "))
                .nth(1)?
                .split([',', '}'])
                .next()?
                .trim()
                .parse()
                .ok()
        };
        if let (Some(r), Some(p), Some(t)) = (field("rank"), field("peak_mb"), field("step_ms")) {
            if (r as usize) < ranks {
                m.peaks[r as usize] = p;
            }
            times.push(t);
        }
    }
    m.step_ms = times.iter().cloned().fold(0.0, f64::max);
    Ok(m)
}

fn max(v: &[f64]) -> f64 {
    v.iter().cloned().fold(0.0, f64::max)
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (models, optimizers, ranks, size, per_rank) = if bench {
        (
            common::env_list("HEARTH_MEM_MODELS", "vgg16,resnet50"),
            common::env_list("HEARTH_MEM_OPTIMIZERS", "adam"),
            common::env_list("HEARTH_MEM_RANKS", "2,4"),
            common::env_usize("HEARTH_MEM_SIZE", 32),
            common::env_usize("HEARTH_MEM_PER_RANK", 2),
        )
    } else {
        // Smoke: a tiny model, plain and sharded on 2 ranks, no peer.
        (
            vec!["resnet-mini".to_string()],
            vec!["adam".to_string()],
            vec!["2".to_string()],
            32,
            2,
        )
    };
    let dir = tempfile_dir();
    let data = dir.join("data");
    let per_class = 32;
    hearth::datasets::synth::generate(
        &data,
        &hearth::datasets::synth::SynthConfig::new(3, per_class, 32)
            .with_seed(3)
            // 6 validation images: every rank of 4 validates at least one.
            .with_val(2),
    )
    .expect("writing the synthetic set");
    let python = if bench { common::torch_python() } else { None };
    if bench && python.is_none() {
        eprintln!(
            "PyTorch not found (bash scripts/setup_pytorch.sh): the peer columns are skipped"
        );
    }
    // HEARTH_MEM_RECOMPUTE: off (default), on, or both (each configuration without and with
    // `--recompute`; the PyTorch columns stay its run without checkpointing).
    let recomputes: Vec<bool> = match std::env::var("HEARTH_MEM_RECOMPUTE").as_deref() {
        Ok("on") | Ok("1") => vec![true],
        Ok("both") => vec![false, true],
        _ => vec![false],
    };
    println!(
        "# {}; per-rank batch {per_rank} at {size}x{size}",
        common::cpu()
    );
    println!(
        "| model | optimizer | N | zero | recompute | Hearth peak per rank, MB: resident / live heap | optimizer state per rank, MB | saved vs zero 0, MB: resident / heap (sharding's share) | goal: resident saved >= 80% of the share | step, ms | PyTorch peak per rank, MB | PyTorch step, ms | peak ratio Hearth/PyTorch | step ratio |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    // Trainable values per model (3 classes), counted on the model itself.
    let mut values: BTreeMap<String, u64> = BTreeMap::new();
    for model in &models {
        let n = hearth::train::model_config(model, 3)
            .and_then(|c| Ok(c.init(&burn::prelude::Device::flex())?))
            .map(|m| m.learnable_params() as u64)
            .expect("building the model to count its parameters");
        values.insert(model.clone(), n);
    }
    // Stage 3 runs with 25 MiB buckets (a unit's backward gathers the unit whole) and with
    // these (MiB: `--bucket-mb`; stage 3's default, 1), where its backward gathers a bucket at
    // a time and reduces each weight's bucket as soon as the weight's gradient is whole.
    let fine_mb = std::env::var("HEARTH_MEM_FINE_MB").unwrap_or_else(|_| "1".into());
    let kept_stages: Vec<u8> = common::env_list("HEARTH_MEM_STAGES", "0,1,2,3")
        .iter()
        .map(|s| s.parse().expect("HEARTH_MEM_STAGES: stage numbers"))
        .collect();
    let mut strict: Vec<String> = Vec::new();
    for model in &models {
        for optimizer in &optimizers {
            let slots = if optimizer == "adam" { 2.0 } else { 1.0 };
            for n in &ranks {
                let n: usize = n.parse().expect("HEARTH_MEM_RANKS: numbers");
                // (stage, --overlap, small buckets)
                let stages: &[(u8, bool, bool)] = if n > 1 {
                    &[
                        (0, false, false),
                        (1, false, false),
                        (2, false, false),
                        (2, true, false),
                        (3, false, false),
                        (3, false, true),
                        (3, true, true),
                    ]
                } else {
                    &[(0, false, false)]
                };
                let mut plain: Option<Measured> = None;
                let mut torch_plain: Option<Measured> = None;
                let mut torch_zero: Option<Measured> = None;
                for (&(zero, overlap, fine), &recompute) in stages
                    .iter()
                    .filter(|z| kept_stages.contains(&z.0))
                    .flat_map(|z| recomputes.iter().map(move |r| (z, r)))
                {
                    // Stage 3's coarse row: 25 MiB, the other stages' default (its own is 1 MiB).
                    let buckets = match (zero, fine) {
                        (_, true) => Some(fine_mb.as_str()),
                        (3, false) => Some("25"),
                        _ => None,
                    };
                    let m = match hearth(
                        &dir, &data, model, optimizer, n, zero, overlap, recompute, buckets, size,
                        per_rank,
                    ) {
                        Ok(m) => m,
                        Err(e) => {
                            eprintln!("{e}");
                            continue;
                        }
                    };
                    if m.values > 0 && values.get(model) != Some(&m.values) {
                        eprintln!(
                            "{model}: the sharded run counted {} values, the model {:?}",
                            m.values,
                            values.get(model)
                        );
                    }
                    let steps = (3 * per_class / (per_rank * n)).max(2);
                    let peer = match (&python, zero) {
                        (Some(py), 0) => torch_plain
                            .get_or_insert_with(|| {
                                torch(py, model, optimizer, n, 0, size, per_rank, steps)
                                    .unwrap_or_else(|e| {
                                        eprintln!("{e}");
                                        Measured::default()
                                    })
                            })
                            .clone(),
                        (Some(py), _) => torch_zero
                            .get_or_insert_with(|| {
                                torch(py, model, optimizer, n, 1, size, per_rank, steps)
                                    .unwrap_or_else(|e| {
                                        eprintln!("{e}");
                                        Measured::default()
                                    })
                            })
                            .clone(),
                        _ => Measured::default(),
                    };
                    let total = values.get(model).copied().unwrap_or(0) as f64;
                    let state = |shards: f64| slots * total * 4.0 / 1e6 / shards;
                    let held = if zero > 0 {
                        state(n as f64)
                    } else {
                        state(1.0)
                    };
                    // What sharding frees per rank: (N-1)/N of the state, and of the gradients
                    // with stage 2, and of the parameters too with stage 3.
                    let unsharded = 1.0 - 1.0 / n as f64;
                    let share = match zero {
                        0 => 0.0,
                        1 => state(1.0) * unsharded,
                        2 => (state(1.0) + total * 4.0 / 1e6) * unsharded,
                        _ => (state(1.0) + 2.0 * total * 4.0 / 1e6) * unsharded,
                    };
                    let (saved, goal) = match (&plain, zero) {
                        (Some(p), z) if z > 0 || recompute => {
                            let resident = max(&p.peaks) - max(&m.peaks);
                            (
                                format!(
                                    "{resident:.0} / {:.0} ({share:.0})",
                                    max(&p.heaps) - max(&m.heaps),
                                ),
                                if z == 0 || share <= 0.0 {
                                    "-".to_string()
                                } else {
                                    format!(
                                        "{:.0}%: {}",
                                        100.0 * resident / share,
                                        if resident >= 0.8 * share {
                                            "met"
                                        } else {
                                            "NOT met"
                                        }
                                    )
                                },
                            )
                        }
                        _ => ("-".into(), "-".into()),
                    };
                    let ratio = |a: f64, b: f64| {
                        if b > 0.0 {
                            format!("{:.2}", a / b)
                        } else {
                            "-".into()
                        }
                    };
                    if zero == 3 && total > 0.0 {
                        strict.push(strict_row(StrictRow {
                            model,
                            optimizer,
                            n,
                            recompute,
                            overlap,
                            buckets: buckets.unwrap_or("default"),
                            total,
                            slots,
                            rise: max(&m.rises),
                        }));
                    }
                    println!(
                        "| {model} | {optimizer} | {n} | {zero}{}{} | {} | {:.0} / {:.0} | {} | {saved} | {goal} | {:.0} | {} | {} | {} | {} |",
                        if overlap { " + overlap" } else { "" },
                        buckets
                            .map(|b| format!(", --bucket-mb {b}"))
                            .unwrap_or_default(),
                        if recompute { "yes" } else { "no" },
                        max(&m.peaks),
                        max(&m.heaps),
                        if total > 0.0 {
                            format!("{held:.0}")
                        } else {
                            "?".into()
                        },
                        m.step_ms,
                        if peer.step_ms > 0.0 {
                            format!("{:.0}", max(&peer.peaks))
                        } else {
                            "-".into()
                        },
                        if peer.step_ms > 0.0 {
                            format!("{:.0}", peer.step_ms)
                        } else {
                            "-".into()
                        },
                        ratio(max(&m.peaks), max(&peer.peaks)),
                        ratio(m.step_ms, peer.step_ms),
                    );
                    if zero == 0 && !recompute {
                        plain = Some(m);
                    }
                }
            }
        }
    }
    if !strict.is_empty() {
        println!();
        println!(
            "Stage 3's parameters, gradients and optimizer state per rank at a step's peak, \
             against 1/N of the unsharded total (goal: within 10%). Held between steps: the \
             rank's parameter shard and optimizer state (counted); a step adds at most its live \
             heap's rise above what steps leave held (measured, the largest rank's, over the \
             steps of the epoch: it also counts the step's activations and graph, so the sum \
             bounds the peak from above)."
        );
        println!();
        println!(
            "| model | optimizer | N | recompute | overlap | --bucket-mb | held between steps, MB | a step's rise, MB | bound at the peak, MB | 1/N of the total, MB | goal: bound <= 1.1 x 1/N |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        for row in &strict {
            println!("{row}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stage 3 run's figures for its row of the strict goal's table.
struct StrictRow<'a> {
    model: &'a str,
    optimizer: &'a str,
    n: usize,
    recompute: bool,
    overlap: bool,
    buckets: &'a str,
    /// Trainable values, and optimizer state values per parameter.
    total: f64,
    slots: f64,
    /// The largest rank's rise within a step, MB.
    rise: f64,
}

fn strict_row(r: StrictRow<'_>) -> String {
    let mb = |values: f64| values * 4.0 / 1e6 / r.n as f64;
    // Between steps: the parameter shard and the state; the share adds the gradients' shard.
    let held = mb(r.total * (1.0 + r.slots));
    let share = mb(r.total * (2.0 + r.slots));
    let bound = held + r.rise;
    let verdict = match (r.rise > 0.0, bound <= 1.1 * share) {
        (false, _) => "- (no step's rise printed)".to_string(),
        (true, met) => format!(
            "{:.0}%: {}",
            100.0 * bound / share,
            if met { "met" } else { "NOT met" }
        ),
    };
    format!(
        "| {} | {} | {} | {} | {} | {} | {held:.0} | {:.1} | {bound:.0} | {share:.0} | {verdict} |",
        r.model,
        r.optimizer,
        r.n,
        if r.recompute { "yes" } else { "no" },
        if r.overlap { "yes" } else { "no" },
        r.buckets,
        r.rise,
    )
}

/// A scratch folder under the target directory's tmp (not /tmp: a VGG-16 set of runs writes
/// checkpoints of 1 GB each, removed as it goes).
fn tempfile_dir() -> PathBuf {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("hearth-memory-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating the bench's folder");
    dir
}
