//! Pipeline parallelism: peak memory per rank and the pipeline bubble, measured with real
//! processes over QUIC on this machine.
//!
//!   cargo bench --bench pipeline
//!
//! Memory: a model (`HEARTH_PIPE_MODEL`, default resnet152) trained at `HEARTH_PIPE_SIZE`
//! (default 224) for 2 steps of M=4 micro-batches of 2 images, unsplit in one process and split
//! in 2 and 4 stages (balanced by parameters; each rank builds only its own units) with GPipe
//! and 1F1B. Every process reports its peak RSS (VmHWM); the goal is every stage at most
//! 1/P + 15% of the unsplit peak.
//!
//! Bubble: resnet18 at 64x64 (`HEARTH_BUBBLE_MODEL`, `HEARTH_BUBBLE_SIZE`), 2 stages, 1F1B,
//! M = 1, 4, 8 micro-batches of 4 images, each process on one thread (RAYON_NUM_THREADS=1, so
//! the 2 stages have a core each). The ideal step is the unsplit step (one thread) divided by
//! P; the measured overhead 1 - ideal/measured stands beside the bubble formula (P-1)/(M+P-1).
//! Imbalance between the stages and the activation traffic add to the formula's share.
//!
//! `HEARTH_PIPE_BALANCE=time|memory` splits by measured time or estimated memory (`hearth train
//! --pipeline-balance time|memory`) instead of parameters, in both parts.
//!
//! Without `--bench` (`cargo test --benches`) it runs a tiny smoke configuration.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsAccumulator, GradientsParams, SgdConfig};
use burn::prelude::*;
use common::env_usize;
use hearth::dist::pipeline::{Activation, Pipeline, Schedule};
use hearth::dist::rendezvous::{RankInfo, RendezvousOptions, connect};
use hearth::dist::tls::Membership;
use hearth::dist::{Communicator, Transport};
use hearth::models::{Architecture, ModelConfig};
use hearth::pipeline::{StageModel, balance, balance_by, measure_units, stage_memory};

const SECRET: &str = "4968e432276b93ebaa930d1fd7b33ee5";

/// Counts live bytes for the memory-balanced split.
#[global_allocator]
static ALLOC: hearth::alloc::CountingAllocator = hearth::alloc::CountingAllocator;

/// What one run measures.
#[derive(Clone, Debug)]
struct Run {
    model: String,
    size: usize,
    stages: usize,
    schedule: Schedule,
    micro: usize,
    micro_batch: usize,
    warmup: usize,
    steps: usize,
    threads: Option<usize>,
    /// "params" or "time".
    balance: String,
    /// Activation recomputation (`hearth train --recompute`).
    recompute: bool,
}

impl Run {
    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("HEARTH_PIPE_RUN_MODEL", self.model.clone()),
            ("HEARTH_PIPE_RUN_SIZE", self.size.to_string()),
            ("HEARTH_PIPE_RUN_STAGES", self.stages.to_string()),
            (
                "HEARTH_PIPE_RUN_SCHEDULE",
                match self.schedule {
                    Schedule::GPipe => "gpipe".into(),
                    Schedule::OneFOneB => "1f1b".into(),
                },
            ),
            ("HEARTH_PIPE_RUN_MICRO", self.micro.to_string()),
            ("HEARTH_PIPE_RUN_MB", self.micro_batch.to_string()),
            ("HEARTH_PIPE_RUN_WARMUP", self.warmup.to_string()),
            ("HEARTH_PIPE_RUN_STEPS", self.steps.to_string()),
            ("HEARTH_PIPE_RUN_BALANCE", self.balance.clone()),
            (
                "HEARTH_PIPE_RUN_RECOMPUTE",
                if self.recompute { "1" } else { "0" }.into(),
            ),
        ]
    }

    fn from_env() -> anyhow::Result<Self> {
        let get = |k: &str| std::env::var(k).map_err(|_| anyhow::anyhow!("{k} is not set"));
        let num = |k: &str| -> anyhow::Result<usize> { Ok(get(k)?.parse()?) };
        Ok(Self {
            model: get("HEARTH_PIPE_RUN_MODEL")?,
            size: num("HEARTH_PIPE_RUN_SIZE")?,
            stages: num("HEARTH_PIPE_RUN_STAGES")?,
            schedule: match get("HEARTH_PIPE_RUN_SCHEDULE")?.as_str() {
                "gpipe" => Schedule::GPipe,
                _ => Schedule::OneFOneB,
            },
            micro: num("HEARTH_PIPE_RUN_MICRO")?,
            micro_batch: num("HEARTH_PIPE_RUN_MB")?,
            warmup: num("HEARTH_PIPE_RUN_WARMUP")?,
            steps: num("HEARTH_PIPE_RUN_STEPS")?,
            threads: None,
            balance: get("HEARTH_PIPE_RUN_BALANCE")?,
            recompute: get("HEARTH_PIPE_RUN_RECOMPUTE")? == "1",
        })
    }

    fn config(&self) -> anyhow::Result<ModelConfig> {
        Ok(match self.model.as_str() {
            "resnet-mini" => hearth::train::mini_resnet(10),
            name => Architecture::from_name(name)?.config(1000),
        })
    }

    fn classes(&self) -> usize {
        if self.model == "resnet-mini" {
            10
        } else {
            1000
        }
    }
}

/// What one process reports.
#[derive(Debug, Clone, Copy)]
struct Report {
    peak_kb: u64,
    step_s: f64,
}

/// Every rank's report and the split the ranks used.
struct Reports {
    ranks: Vec<Report>,
    split: String,
}

fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn sgd() -> burn::optim::ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init()
}

fn micro_input(run: &Run, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let x = Tensor::<4>::random(
        [run.micro_batch, 3, run.size, run.size],
        burn::tensor::Distribution::Normal(0.0, 1.0),
        device,
    );
    let labels: Vec<i64> = (0..run.micro_batch)
        .map(|i| (i % run.classes()) as i64)
        .collect();
    (x, Tensor::from_ints(labels.as_slice(), device))
}

fn cross_entropy(logits: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, y)
}

/// One rank of a split run, or the unsplit process (`stages == 1`, no transport).
fn rank_main(out: &Path) -> anyhow::Result<()> {
    let run = Run::from_env()?;
    let cfg = run.config()?;
    let device = Device::flex().autodiff();
    let (x, y) = micro_input(&run, &device);
    let mut opt = sgd();
    let mut times = Vec::new();
    let rank = if run.stages == 1 {
        let mut model = StageModel::new(cfg.init_units(0..cfg.units(), &device)?);
        for i in 0..run.warmup + run.steps {
            let t = Instant::now();
            let mut acc = GradientsAccumulator::<StageModel>::new();
            for _ in 0..run.micro {
                if run.recompute {
                    // One segment per unit, as `hearth train --recompute` runs one process.
                    let segments: Vec<StageModel> = model
                        .units
                        .iter()
                        .map(|u| StageModel::new(vec![u.clone()]))
                        .collect();
                    let grads = hearth::dist::pipeline::recomputed_gradients(
                        &segments,
                        Activation::Rank4(x.clone()),
                        &mut |out| Ok(cross_entropy(out.rank2("logits")?, y.clone())),
                        &device,
                    )?;
                    for g in grads {
                        acc.accumulate(&model, g);
                    }
                    continue;
                }
                let logits = hearth::dist::pipeline::PipelineStage::forward(
                    &model,
                    Activation::Rank4(x.clone()),
                )?
                .rank2("logits")?;
                let grads = cross_entropy(logits, y.clone()).backward();
                acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
            }
            model = opt.step(0.01, model, acc.grads());
            if i >= run.warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        0
    } else {
        let info = RankInfo::detect()?.ok_or_else(|| anyhow::anyhow!("no rank variables"))?;
        let transport: Arc<dyn Transport> = Arc::new(connect(
            &info,
            &Membership::from_env()?,
            &RendezvousOptions::from_env(),
        )?);
        let mut ranges = balance(&cfg.unit_params(&device)?, run.stages)?;
        let mut pipe = Pipeline::new(transport.clone(), (0..run.stages).collect(), run.schedule)?
            .with_timeout(Duration::from_secs(600))
            .with_recompute(run.recompute);
        let comm = Communicator::new(transport).with_timeout(Duration::from_secs(600));
        if run.balance != "params" {
            let probe = StageModel::new(cfg.init_units(ranges[info.rank].clone(), &device)?);
            let costs = measure_units(
                &probe,
                ranges[info.rank].start,
                cfg.units(),
                &mut pipe,
                &comm,
                Activation::Rank4(x.clone()),
                &device,
            )?;
            drop(probe);
            ranges = if run.balance == "memory" {
                let params = cfg.unit_params(&device)?;
                // SGD with momentum: weights, gradients, their accumulation, momentum.
                balance_by(costs.len(), run.stages, |s, r| {
                    stage_memory(
                        &params,
                        &costs,
                        r,
                        16.0,
                        run.schedule.held(s, run.stages, run.micro),
                        run.recompute,
                    )
                })?
            } else {
                let weights: Vec<usize> = costs
                    .iter()
                    .map(|c| ((c.seconds * 1e6).round() as usize).max(1))
                    .collect();
                balance(&weights, run.stages)?
            };
        }
        if info.rank == 0 {
            let split: Vec<String> = ranges
                .iter()
                .map(|r| format!("{}:{}", r.start, r.end))
                .collect();
            std::fs::write(out.join("split.txt"), split.join(","))?;
        }
        let mut stage = StageModel::new(cfg.init_units(ranges[info.rank].clone(), &device)?);
        for i in 0..run.warmup + run.steps {
            // Every stage starts the step together, so the step time is the pipeline's.
            comm.barrier()?;
            let t = Instant::now();
            let result = pipe.step(
                &stage,
                &mut |_| Activation::Rank4(x.clone()),
                &mut |logits, _| Ok(cross_entropy(logits.rank2("logits")?, y.clone())),
                run.micro,
                &device,
            )?;
            stage = opt.step(0.01, stage, result.grads);
            comm.barrier()?;
            if i >= run.warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        info.rank
    };
    let step_s = times.iter().sum::<f64>() / times.len().max(1) as f64;
    std::fs::write(
        out.join(format!("rank{rank}.txt")),
        format!("{} {step_s}", peak_rss_kb()),
    )?;
    Ok(())
}

/// Runs `run` as processes of this binary; each rank's report.
fn launch(run: &Run) -> anyhow::Result<Reports> {
    let dir = tempfile::tempdir()?;
    let port = std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let ranks = run.stages;
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            let mut c = Command::new(std::env::current_exe()?);
            c.envs(run.env())
                .env("HEARTH_PIPE_BENCH_RANK_OUT", dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            if let Some(t) = run.threads {
                c.env("RAYON_NUM_THREADS", t.to_string());
            }
            if ranks > 1 {
                c.env("HEARTH_RANK", r.to_string())
                    .env("HEARTH_WORLD_SIZE", ranks.to_string())
                    .env("HEARTH_COORDINATOR", format!("127.0.0.1:{port}"))
                    .env("HEARTH_JOB_SECRET", SECRET);
            }
            Ok(c.spawn()?)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut failures = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            failures.push(format!(
                "rank {r}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    if !failures.is_empty() {
        anyhow::bail!("{}", failures.join("\n"));
    }
    let reports = (0..ranks)
        .map(|r| {
            let text = std::fs::read_to_string(dir.path().join(format!("rank{r}.txt")))?;
            let mut it = text.split_whitespace();
            let peak_kb = it.next().unwrap_or("0").parse()?;
            let step_s = it.next().unwrap_or("0").parse()?;
            Ok(Report { peak_kb, step_s })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Reports {
        ranks: reports,
        split: std::fs::read_to_string(dir.path().join("split.txt")).unwrap_or_else(|_| "-".into()),
    })
}

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

/// `HEARTH_PIPE_RECOMPUTE`: `off`, `on` or `both` (default), which memory rows to run.
fn recompute_choices() -> Vec<bool> {
    match std::env::var("HEARTH_PIPE_RECOMPUTE").as_deref() {
        Ok("off") | Ok("0") => vec![false],
        Ok("on") | Ok("1") => vec![true],
        _ => vec![false, true],
    }
}

fn memory(smoke: bool) -> anyhow::Result<()> {
    let model = std::env::var("HEARTH_PIPE_MODEL")
        .unwrap_or_else(|_| if smoke { "resnet-mini" } else { "resnet152" }.into());
    let size = env_usize("HEARTH_PIPE_SIZE", if smoke { 32 } else { 224 });
    let base = Run {
        model: model.clone(),
        size,
        stages: 1,
        schedule: Schedule::OneFOneB,
        micro: env_usize("HEARTH_PIPE_MICRO", 4),
        micro_batch: env_usize("HEARTH_PIPE_MB", 2),
        warmup: 1,
        steps: 1,
        threads: None,
        balance: balance_choice(),
        recompute: false,
    };
    println!(
        "memory: {model} at {size}x{size}, {} micro-batches of {}, peak RSS (VmHWM) per process, split by {}",
        base.micro, base.micro_batch, base.balance
    );
    // The goal's reference is the unsplit process without recomputation.
    let whole = launch(&base)?.ranks[0];
    println!(
        "{:<10} {:<6} {:<9} {:>6} {:>10} {:>10} {:>7} {:>9}",
        "layout", "sched", "recompute", "rank", "peak MB", "goal MB", "ratio", "step s"
    );
    let row =
        |layout: &str, sched: &str, recompute: bool, r: usize, rep: &Report, goal: Option<f64>| {
            let over = goal.is_some_and(|g| mb(rep.peak_kb) > g);
            println!(
                "{:<10} {:<6} {:<9} {:>6} {:>10.0} {:>10} {:>7.2} {:>9.2}{}",
                layout,
                sched,
                if recompute { "yes" } else { "no" },
                r,
                mb(rep.peak_kb),
                goal.map_or("-".to_string(), |g| format!("{g:.0}")),
                rep.peak_kb as f64 / whole.peak_kb.max(1) as f64,
                rep.step_s,
                if over { "  over goal" } else { "" }
            );
        };
    row("unsplit", "-", false, 0, &whole, None);
    if recompute_choices().contains(&true) {
        let again = launch(&Run {
            recompute: true,
            ..base.clone()
        })?
        .ranks[0];
        row("unsplit", "-", true, 0, &again, None);
    }
    let stage_counts: Vec<usize> = if smoke {
        vec![2]
    } else {
        common::env_list("HEARTH_PIPE_P", "2,4")
            .iter()
            .map(|p| p.parse())
            .collect::<Result<_, _>>()?
    };
    let schedules: Vec<Schedule> = common::env_list("HEARTH_PIPE_SCHEDULES", "gpipe,1f1b")
        .iter()
        .map(|s| {
            if s == "gpipe" {
                Schedule::GPipe
            } else {
                Schedule::OneFOneB
            }
        })
        .collect();
    for &p in &stage_counts {
        for &schedule in &schedules {
            for recompute in recompute_choices() {
                let run = Run {
                    stages: p,
                    schedule,
                    recompute,
                    ..base.clone()
                };
                let out = launch(&run)?;
                println!(
                    "P={p} {}{}: split {}",
                    sched_name(schedule),
                    if recompute { " recompute" } else { "" },
                    out.split
                );
                let goal = mb(whole.peak_kb) * (1.0 / p as f64 + 0.15);
                for (r, rep) in out.ranks.iter().enumerate() {
                    row(
                        &format!("P={p}"),
                        sched_name(schedule),
                        recompute,
                        r,
                        rep,
                        Some(goal),
                    );
                }
            }
        }
    }
    Ok(())
}

fn sched_name(s: Schedule) -> &'static str {
    match s {
        Schedule::GPipe => "gpipe",
        Schedule::OneFOneB => "1f1b",
    }
}

fn bubble(smoke: bool) -> anyhow::Result<()> {
    let model = std::env::var("HEARTH_BUBBLE_MODEL")
        .unwrap_or_else(|_| if smoke { "resnet-mini" } else { "resnet18" }.into());
    let size = env_usize("HEARTH_BUBBLE_SIZE", if smoke { 32 } else { 64 });
    let p = 2;
    let micro_batch = env_usize("HEARTH_BUBBLE_MB", 4);
    let steps = env_usize("HEARTH_BUBBLE_STEPS", if smoke { 1 } else { 3 });
    println!(
        "\nbubble: {model} at {size}x{size}, P={p}, 1F1B, micro-batches of {micro_batch}, one thread per process, split by {}",
        balance_choice()
    );
    println!(
        "{:>3} {:>14} {:>14} {:>12} {:>12}",
        "M", "unsplit s", "pipeline s", "overhead", "formula"
    );
    let micros: &[usize] = if smoke { &[1, 2] } else { &[1, 4, 8] };
    for &m in micros {
        let base = Run {
            model: model.clone(),
            size,
            stages: 1,
            schedule: Schedule::OneFOneB,
            micro: m,
            micro_batch,
            warmup: 1,
            steps,
            threads: Some(1),
            recompute: false,
            balance: balance_choice(),
        };
        let whole = launch(&base)?.ranks[0].step_s;
        let split = launch(&Run {
            stages: p,
            ..base.clone()
        })?;
        if m == micros[0] {
            println!("(split {})", split.split);
        }
        let measured = split.ranks.iter().map(|r| r.step_s).fold(0.0, f64::max);
        let ideal = whole / p as f64;
        let overhead = 1.0 - ideal / measured;
        let formula = (p - 1) as f64 / (m + p - 1) as f64;
        println!(
            "{m:>3} {whole:>14.3} {measured:>14.3} {:>11.1}% {:>11.1}%",
            overhead * 100.0,
            formula * 100.0
        );
    }
    Ok(())
}

fn balance_choice() -> String {
    std::env::var("HEARTH_PIPE_BALANCE").unwrap_or_else(|_| "params".into())
}

fn main() -> anyhow::Result<()> {
    if let Some(out) = std::env::var_os("HEARTH_PIPE_BENCH_RANK_OUT") {
        return rank_main(&PathBuf::from(out));
    }
    let smoke = !std::env::args().any(|a| a == "--bench");
    if smoke {
        println!(
            "pipeline bench: smoke mode (run with `cargo bench --bench pipeline` for figures)"
        );
    }
    let only = std::env::var("HEARTH_PIPE_ONLY").unwrap_or_default();
    if only != "bubble" {
        memory(smoke)?;
    }
    if only != "memory" {
        bubble(smoke)?;
    }
    Ok(())
}
