//! `hearth export`: a Hearth model file out to another framework's format.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use hearth::models::{
    Architecture, SavedModel, export_torchvision, export_torchvision_pth, load_model,
};

#[derive(Args)]
pub struct ExportArgs {
    /// A Hearth model file: a run's model.bpk, or any file `hearth train` wrote.
    #[arg(long)]
    pub weights: PathBuf,
    /// `safetensors`: torchvision's state_dict (its key names and layouts), which
    /// `model.load_state_dict(safetensors.torch.load_file(FILE))` takes in PyTorch. `pth`: the
    /// same state_dict in PyTorch's own format, for `torch.load(FILE, weights_only=True)`.
    /// `onnx`: an inference graph (opset 13) from `input` [batch, 3, H, W] to `logits`
    /// [batch, classes], the batch dynamic, for onnxruntime and the like. Default: the one
    /// `--out`'s extension names (`.safetensors`, `.pth` or `.pt`, `.onnx`), else
    /// `safetensors`.
    #[arg(long)]
    pub format: Option<String>,
    /// The ONNX graph's image size, `N` or `HxW` (default: the size the model was trained
    /// at, as its file records, else 224). Only with `--format onnx`.
    #[arg(long)]
    pub size: Option<String>,
    /// The file to write (default: the weights' path with the format's extension). An
    /// extension that names another format than `--format` is refused.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The torchvision constructor that builds `config`'s network, if one does.
fn torchvision_name(config: &hearth::models::ModelConfig) -> Option<&'static str> {
    let json = config.to_json();
    Architecture::ALL
        .iter()
        .find(|a| a.config(config.num_classes()).to_json() == json)
        .map(|a| a.name())
}

/// `--size`: `N` (square) or `HxW`.
fn parse_size(text: &str) -> Result<[usize; 2]> {
    let side = |s: &str| {
        s.trim()
            .parse::<usize>()
            .with_context(|| format!("--size {text}: '{s}' is not a whole number of pixels"))
    };
    match text.split_once(['x', 'X']) {
        Some((h, w)) => Ok([side(h)?, side(w)?]),
        None => {
            let s = side(text)?;
            Ok([s, s])
        }
    }
}

/// The format a file's extension names, if it names one.
fn format_of(path: &Path) -> Option<&'static str> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "safetensors" => Some("safetensors"),
        "pth" | "pt" => Some("pth"),
        "onnx" => Some("onnx"),
        _ => None,
    }
}

/// `--format`, given or named by `--out`'s extension; a given one that `--out`'s extension
/// contradicts is refused, so that no file is written under another format's name.
fn chosen_format(args: &ExportArgs) -> Result<String> {
    let named = args.out.as_deref().and_then(format_of);
    let Some(format) = &args.format else {
        return Ok(named.unwrap_or("safetensors").to_string());
    };
    if !matches!(format.as_str(), "safetensors" | "pth" | "onnx") {
        bail!("unknown --format {format}: safetensors, pth or onnx");
    }
    if let (Some(named), Some(out)) = (named, &args.out)
        && named != format
    {
        bail!(
            "--out {} names a {named} file, but --format is {format}: change the one that is \
             wrong (or leave --format out: the extension chooses it)",
            out.display()
        );
    }
    Ok(format.clone())
}

pub fn export_cmd(device_name: &str, args: ExportArgs) -> Result<()> {
    let format = chosen_format(&args)?;
    if args.size.is_some() && format != "onnx" {
        bail!("--size sets the ONNX graph's input; --format {format} has none");
    }
    let device = hearth::device::select(device_name)?;
    let saved = load_model(&args.weights, &device)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| args.weights.with_extension(format.as_str()));
    if out == args.weights {
        bail!("--out {} is the model file itself", out.display());
    }
    if format == "onnx" {
        return export_onnx_cmd(&args, &saved, &out);
    }
    let count = if format == "pth" {
        export_torchvision_pth(&saved.model, &out)
    } else {
        export_torchvision(&saved.model, &out)
    }
    .with_context(|| format!("exporting {}", args.weights.display()))?;
    let load = if format == "pth" {
        "torch.load"
    } else {
        "safetensors.torch.load_file"
    };
    let classes = saved.config.num_classes();
    println!(
        "{count} tensors of {} ({classes} classes) written to {}",
        saved.model.family(),
        out.display()
    );
    match torchvision_name(&saved.config) {
        Some(name) => println!(
            "in PyTorch: torchvision.models.{name}(num_classes={classes}).load_state_dict(\
             {load}({:?}))",
            out.display().to_string()
        ),
        None => println!(
            "no torchvision constructor builds this network (a Hearth test-size one or a \
             changed head); the keys are torchvision's"
        ),
    }
    if let Some(names) = &saved.class_names {
        println!("class order: {}", names.join(", "));
    }
    Ok(())
}

/// `--format onnx`: the graph, with the class names and the preprocessing in its metadata.
fn export_onnx_cmd(args: &ExportArgs, saved: &SavedModel, out: &std::path::Path) -> Result<()> {
    let size = match &args.size {
        Some(text) => parse_size(text)?,
        None => {
            let side = saved
                .preprocessing
                .as_ref()
                .map_or(224, |p| p.crop as usize);
            [side, side]
        }
    };
    let mut metadata = Vec::new();
    if let Some(names) = &saved.class_names {
        metadata.push(("class_names".to_string(), serde_json::to_string(names)?));
    }
    if let Some(p) = &saved.preprocessing {
        let json = serde_json::json!({
            "resize": p.resize, "crop": p.crop, "mean": p.mean, "std": p.std,
        });
        metadata.push(("preprocessing".to_string(), json.to_string()));
    }
    let summary = hearth::onnx::export_onnx(&saved.model, size, &metadata, out)
        .with_context(|| format!("exporting {}", args.weights.display()))?;
    println!(
        "{} ({} classes) written to {}: {} nodes, {} weight tensors, {:.1} MB; input '{}' \
         [batch, 3, {}, {}], output '{}' [batch, {}] (logits)",
        saved.model.family(),
        saved.config.num_classes(),
        out.display(),
        summary.nodes,
        summary.initializers,
        summary.bytes as f64 / 1e6,
        hearth::onnx::INPUT,
        size[0],
        size[1],
        hearth::onnx::OUTPUT,
        saved.config.num_classes(),
    );
    if let Some(p) = &saved.preprocessing {
        println!(
            "inputs as in training: resize {}, center crop {}, mean {:?}, std {:?} (also in \
             the file's metadata)",
            p.resize, p.crop, p.mean, p.std
        );
    }
    Ok(())
}
