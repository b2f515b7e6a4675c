//! Pipeline model parallelism from Rust: the small ResNet split into one stage per rank
//! (balanced by parameter count; each rank builds only its own units), trained with 1F1B over 4
//! micro-batches per step on a generated image set. Start the ranks with any launcher:
//!
//!   cargo build --release --example pipeline
//!   cargo run --release -- launch -n 2 -- target/release/examples/pipeline
//!
//! The first stage reads the images, the last one the labels (every rank streams the same
//! seeded order), and the last stage prints the loss of every epoch.

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::prelude::*;
use hearth::datasets::synth::{SynthConfig, generate};
use hearth::datasets::{ImageSet, Loader, LoaderConfig};
use hearth::dist::pipeline::{Activation, Pipeline, Schedule};
use hearth::dist::rendezvous::{RankInfo, RendezvousOptions, connect};
use hearth::dist::tls::Membership;
use hearth::dist::{Communicator, Transport};
use hearth::models::ModelConfig;
use hearth::models::stages::Unit;
use hearth::pipeline::{StageModel, balance};

const MICRO: usize = 4;
const MICRO_BATCH: usize = 8;

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend, the CPU
    // (where a resume loads optimizer state), freed memory kept for the next step, this thread
    // one of the kernels' threads. SAFETY: first thing in main, before any thread starts.
    unsafe { hearth::process::start("flex") }?;
    let info = RankInfo::detect()?.context(
        "start this example under `hearth launch -n 2 -- ...` (or torchrun, Slurm, mpirun)",
    )?;
    let transport: Arc<dyn Transport> = Arc::new(connect(
        &info,
        &Membership::from_env()?,
        &RendezvousOptions::from_env(),
    )?);
    let device = Device::flex().autodiff();
    let ModelConfig::ResNet(cfg) = hearth::train::mini_resnet(6) else {
        bail!("resnet-mini is a ResNet");
    };
    // Parameter counts of every unit (parameters are lazy: nothing is allocated here).
    let weights: Vec<usize> = cfg
        .init_units(0..cfg.units(), &device)?
        .iter()
        .map(Unit::learnable_params)
        .collect();
    let ranges = balance(&weights, info.world)?;
    let mine = ranges[info.rank].clone();
    device.seed(info.rank as u64);
    let mut stage = StageModel::new(cfg.init_units(mine.clone(), &device)?);
    let params: usize = stage.units.iter().map(Unit::learnable_params).sum();
    eprintln!(
        "rank {}: units {mine:?} of {}, {params} parameters",
        info.rank,
        cfg.units()
    );

    let dir = std::env::temp_dir().join(format!("hearth-pipeline-example-{}", info.rank));
    if !dir.join(".complete").exists() {
        generate(&dir, &SynthConfig::new(6, 64, 40).with_seed(1))?;
        std::fs::write(dir.join(".complete"), b"")?;
    }
    let loader = Loader::new(
        ImageSet::from_folder(&dir)?,
        hearth::datasets::Pipeline::eval(32),
        LoaderConfig::new(MICRO * MICRO_BATCH)
            .with_seed(3)
            .with_drop_last(true),
    )?;
    let last = info.rank + 1 == info.world;
    let mut pipe = Pipeline::new(
        transport.clone(),
        (0..info.world).collect(),
        Schedule::OneFOneB,
    )?;
    let mut optimizer = SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init();
    for epoch in 0..3 {
        let mut losses = Vec::new();
        for batch in loader.epoch(epoch, &device) {
            let batch = batch?;
            let images = batch.images;
            let classes = batch.classes.context("the loader gives class indices")?;
            let out = pipe.step(
                &stage,
                &mut |m| Activation::Rank4(images.clone().narrow(0, m * MICRO_BATCH, MICRO_BATCH)),
                &mut |logits, m| {
                    let target = classes.clone().narrow(0, m * MICRO_BATCH, MICRO_BATCH);
                    let logits = logits.rank2("logits")?;
                    Ok(CrossEntropyLossConfig::new()
                        .init(&logits.device())
                        .forward(logits, target))
                },
                MICRO,
                &device,
            )?;
            losses.extend(out.losses);
            stage = optimizer.step(0.05, stage, out.grads);
        }
        if last {
            let mean = losses.iter().sum::<f32>() / losses.len().max(1) as f32;
            println!("epoch {}: mean loss {mean:.4}", epoch + 1);
        }
    }
    // Every stage is done before anyone hangs up.
    Communicator::from_env(transport).barrier()?;
    Ok(())
}
