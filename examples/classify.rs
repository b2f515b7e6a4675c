//! Classify an image with a torchvision model from Rust.
//!
//!   cargo run --release --example classify -- resnet50 resnet50.pth cat.jpg
//!   cargo run --release --example classify            # random ResNet-18 on a generated image
//!
//! Arguments: MODEL [WEIGHTS [IMAGE]]. Without weights the network is random (and says so);
//! without an image a synthetic one is drawn.

use anyhow::Result;
use burn::module::Module;
use burn::prelude::*;
use hearth::datasets::preprocess::{eval_preprocess, load_rgb};
use hearth::models::{Architecture, LoadOptions, load_torchvision};

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend (where
    // a resume loads optimizer state), freed memory kept for the next step, this thread one of
    // the kernels' threads. SAFETY: first thing in main, before any thread starts.
    let spec = unsafe { hearth::process::start_from_env() }?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arch = Architecture::from_name(args.first().map_or("resnet18", String::as_str))?;
    let device = spec.device()?;

    let mut model = arch.init(1000, &device)?;
    match args.get(1) {
        Some(weights) => {
            let report = load_torchvision(&mut model, weights.as_ref(), &LoadOptions::default())?;
            println!("loaded {} tensors from {weights}", report.applied);
        }
        None => println!("no weights given: {arch} has RANDOM weights"),
    }
    let model = model.valid();

    let image = match args.get(2) {
        Some(path) => load_rgb(path.as_ref())?,
        None => hearth::datasets::synth::render(0, 0, 256, 0),
    };
    let pixels = eval_preprocess(&image, 256, 224)?;
    let x = Tensor::<4>::from_data(TensorData::new(pixels, [1, 3, 224, 224]), &device);
    let probs: Vec<f32> = model
        .predict(x)
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let top = hearth::predict::top_k(&probs, probs.len(), 5);
    for (class, p) in &top[0] {
        println!("class {class:>4}: {p:.4}");
    }
    Ok(())
}
