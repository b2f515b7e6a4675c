//! `hearth predict` and `hearth eval`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::Module;
use clap::Args;
use hearth::{npy, predict};

#[derive(Args)]
pub(crate) struct PredictArgs {
    /// Architecture (torchvision name, e.g. resnet50); not needed for a Hearth .bpk model file.
    #[arg(long)]
    model: Option<String>,
    /// Weights: torchvision .pth/.pt or .safetensors, a Hearth .bpk model file, or `imagenet`
    /// (torchvision's ImageNet weights of --model, downloaded once into Hearth's cache).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Image files, prepared as the model file records (a Hearth model trained at --size S:
    /// shorter side S*256/224, center crop S), else torchvision's 256 / 224 recipe;
    /// ImageNet-normalised.
    #[arg(long, num_args = 1.., conflicts_with_all = ["input", "data"], required_unless_present_any = ["input", "data"])]
    image: Vec<PathBuf>,
    /// Every image under this folder (recursively), streamed in batches; results go to --out.
    #[arg(long, conflicts_with = "input", requires = "out")]
    data: Option<PathBuf>,
    /// With --data: the CSV to write (path, then class and probability for each of --top).
    #[arg(long)]
    out: Option<PathBuf>,
    /// With --data: images per batch [default: 32]. (--image and --input go as one batch.)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: Option<u32>,
    /// A float32 NCHW .npy tensor used as is.
    #[arg(long)]
    input: Option<PathBuf>,
    /// How many classes to print per input (all of them where the model has fewer) [default:
    /// 5].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    top: Option<u32>,
    /// With --image or --input: write the logits [N, classes] as float32 .npy.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Class count of torchvision weights' model (default: read from the weights' head; 1000
    /// without weights). A Hearth model file records its own.
    #[arg(long)]
    num_classes: Option<usize>,
    /// Compute in bf16 or fp16 (f32 weights cast on the way in); the outputs are the low
    /// precision's, and the difference to an f32 pass over the same inputs is reported
    /// (--image, --input, or every image of --data).
    #[arg(long, value_enum, default_value_t = hearth::train::Precision::Fp32)]
    precision: hearth::train::Precision,
}

#[derive(Args)]
pub(crate) struct EvalArgs {
    /// A Hearth model file (.bpk), or torchvision weights with --model.
    #[arg(long)]
    weights: PathBuf,
    /// Architecture, for torchvision weights.
    #[arg(long)]
    model: Option<String>,
    /// Class folders to evaluate on; folder names must be the model's class names.
    #[arg(long)]
    data: PathBuf,
    /// Where per_class.csv, confusion.csv and confusion.png go.
    #[arg(long, default_value = "eval")]
    out: PathBuf,
    /// Images per batch.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,
    /// Decoding threads.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
}

/// The flags that act with --data only, or without it only, refused by name on the other side.
fn check_inputs(args: &PredictArgs) -> Result<()> {
    let folder = args.data.is_some();
    let given = [
        ("--out", args.out.is_some()),
        ("--batch-size", args.batch_size.is_some()),
    ];
    if let Some((flag, _)) = given.iter().find(|(_, given)| *given && !folder) {
        anyhow::bail!(
            "{flag}: only with --data (a folder's predictions, in batches, into a CSV); the \
             results of --image and --input are printed, as one batch"
        );
    }
    if folder && args.logits_out.is_some() {
        anyhow::bail!(
            "--logits-out: not with --data (its CSV holds each image's top classes); give the \
             images with --image, or a tensor with --input, for their logits"
        );
    }
    Ok(())
}

pub(crate) fn predict_cmd(device_name: &str, args: PredictArgs) -> Result<()> {
    check_inputs(&args)?;
    let device = hearth::device::select(device_name)?;
    let weights = match (&args.weights, &args.model) {
        (Some(w), Some(model)) => crate::commands::weights::resolve(Some(w.clone()), model, false)?,
        (w, _) => w.clone(),
    };
    let loaded = predict::load_for_predict(
        args.model.as_deref(),
        weights.as_deref(),
        args.num_classes,
        &device,
    )?;
    if loaded.weights.is_none() {
        eprintln!("warning: no --weights given: these outputs are from RANDOM weights");
    }
    let model = loaded.model.valid();
    hearth::device::check_precision(&device, args.precision)?;
    if let (Some(dir), Some(out)) = (&args.data, &args.out) {
        return predict_folder(&args, &model, &loaded, dir, out, &device);
    }
    let (x, labels): (_, Vec<String>) = match &args.input {
        Some(path) => {
            let x = predict::npy_to_tensor(path, &device)?;
            let n = x.dims()[0];
            (
                x,
                (0..n).map(|i| format!("{}[{i}]", path.display())).collect(),
            )
        }
        None => (
            predict::images_to_tensor(&args.image, &loaded.preprocessing, &device)?,
            args.image.iter().map(|p| p.display().to_string()).collect(),
        ),
    };
    let started = Instant::now();
    let logits = model.try_forward(x.clone())?;
    let logits = if args.precision.is_low() {
        in_precision(
            &model,
            x,
            logits,
            args.precision,
            started.elapsed().as_secs_f64(),
        )?
    } else {
        logits
    };
    let [n, classes] = logits.dims();
    let probs = model.head_activation().probabilities(logits.clone());
    let logits: Vec<f32> = logits
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    let probs: Vec<f32> = probs
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading probabilities: {e:?}"))?;
    let elapsed = started.elapsed();
    if let Some(asked) = args.top.filter(|&t| t as usize > classes) {
        eprintln!("--top {asked}: the model has {classes} classes; all {classes} are listed");
    }
    for (label, row) in labels
        .iter()
        .zip(predict::top_k(&probs, classes, top(&args)))
    {
        println!("{label}");
        for (class, p) in row {
            let name = loaded
                .class_names
                .as_ref()
                .and_then(|names| names.get(class))
                .map(|s| format!(" {s}"))
                .unwrap_or_default();
            println!("  class {class:>4}{name}: {p:.4}");
        }
    }
    if let Some(out) = &args.logits_out {
        npy::write(out, &[n, classes], &logits)
            .with_context(|| format!("writing logits to {}", out.display()))?;
        eprintln!("logits [{n}, {classes}] written to {}", out.display());
    }
    eprintln!(
        "{n} input(s) in {:.1} ms on {device_name}",
        elapsed.as_secs_f64() * 1e3
    );
    Ok(())
}

/// How many classes each input lists: `--top`, 5 by default.
fn top(args: &PredictArgs) -> usize {
    args.top.unwrap_or(5) as usize
}

/// `--data DIR --out CSV`: every image of a folder, in batches, into a CSV.
fn predict_folder(
    args: &PredictArgs,
    model: &hearth::models::Classifier,
    loaded: &predict::PredictModel,
    dir: &std::path::Path,
    out: &std::path::Path,
    device: &burn::prelude::Device,
) -> Result<()> {
    let mut progress = progress_bar("predicting");
    let done = hearth::eval::predict_folder(
        model,
        loaded.class_names.as_deref(),
        dir,
        &loaded.preprocessing,
        top(args),
        args.batch_size.unwrap_or(32) as usize,
        2,
        device,
        args.precision.dtype(),
        out,
        &mut |done, total| progress(done, total),
    )?;
    if let Some(summary) = done.problems.summary() {
        eprintln!("{summary}");
    }
    if let Some(gap) = &done.gap {
        eprintln!("{gap}");
    }
    println!(
        "{} image(s) predicted; results in {}",
        done.written,
        out.display()
    );
    Ok(())
}

/// The logits in `precision` (below f32), after saying how far they are from the f32
/// `reference` ones (taken in `f32_secs`) and how long each took.
fn in_precision(
    model: &hearth::models::Classifier,
    x: burn::prelude::Tensor<4>,
    reference: burn::prelude::Tensor<2>,
    precision: hearth::train::Precision,
    f32_secs: f64,
) -> Result<burn::prelude::Tensor<2>> {
    let reference: Vec<f32> = reference
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    let started = Instant::now();
    let low = model.forward_in(x, precision.dtype());
    let values: Vec<f32> = low
        .clone()
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    let mut gap = hearth::predict::PrecisionGap::new(precision.dtype());
    gap.add(&values, &reference, low.dims()[1]);
    gap.low_secs = started.elapsed().as_secs_f64();
    gap.f32_secs = f32_secs;
    eprintln!("{gap}");
    Ok(low)
}

/// An indicatif bar on stderr (hidden when stderr is not a terminal), fed (done, total).
pub(crate) fn progress_bar(what: &'static str) -> impl FnMut(usize, usize) {
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {pos}/{len} images, {per_sec}, eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what);
    move |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        if done >= total {
            bar.finish_and_clear();
        }
    }
}

pub(crate) fn eval_cmd(device_name: &str, args: EvalArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    let loaded =
        predict::load_for_predict(args.model.as_deref(), Some(&args.weights), None, &device)?;
    let model = loaded.model.valid();
    let mut progress = progress_bar("evaluating");
    let report = hearth::eval::evaluate(
        &model,
        loaded.class_names.as_deref(),
        &args.data,
        &loaded.preprocessing,
        args.batch_size as usize,
        args.workers as usize,
        &device,
        &mut |done, total| progress(done, total),
    )?;
    if let Some(summary) = report.problems.summary() {
        eprintln!("{summary}");
    }
    let files = hearth::eval::write_report(&report, &args.out)?;
    println!(
        "{:<24} {:>9} {:>9} {:>8}",
        "class", "precision", "recall", "images"
    );
    let pct = |v: Option<f64>| {
        v.map(|x| format!("{:.2}%", 100.0 * x))
            .unwrap_or("-".into())
    };
    for c in &report.classes {
        println!(
            "{:<24} {:>9} {:>9} {:>8}",
            c.name,
            pct(c.precision),
            pct(c.recall),
            c.support
        );
    }
    println!(
        "accuracy: {:.2}% on {} images",
        report.accuracy, report.images
    );
    for f in files {
        println!("wrote {}", f.display());
    }
    Ok(())
}
