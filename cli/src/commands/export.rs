//! `hearth export`: a Hearth model file out to another framework's format.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use hearth::models::{Architecture, export_torchvision, load_model};

#[derive(Args)]
pub struct ExportArgs {
    /// A Hearth model file: a run's model.bpk, or any file `hearth train` wrote.
    #[arg(long)]
    pub weights: PathBuf,
    /// `safetensors`: torchvision's state_dict (its key names and layouts), which
    /// `model.load_state_dict(safetensors.torch.load_file(FILE))` takes in PyTorch. `pth` and
    /// `onnx` are not built yet and are refused.
    #[arg(long, default_value = "safetensors")]
    pub format: String,
    /// The file to write (default: the weights' path with the format's extension).
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

pub fn export_cmd(device_name: &str, args: ExportArgs) -> Result<()> {
    match args.format.as_str() {
        "safetensors" => {}
        "pth" | "onnx" => bail!(
            "--format {} is not built yet: --format safetensors writes torchvision's \
             state_dict, which PyTorch loads with safetensors.torch.load_file",
            args.format
        ),
        other => bail!("unknown --format {other}: safetensors (pth and onnx are not built yet)"),
    }
    let device = hearth::device::select(device_name)?;
    let saved = load_model(&args.weights, &device)?;
    let out = args
        .out
        .unwrap_or_else(|| args.weights.with_extension("safetensors"));
    if out == args.weights {
        bail!("--out {} is the model file itself", out.display());
    }
    let count = export_torchvision(&saved.model, &out)
        .with_context(|| format!("exporting {}", args.weights.display()))?;
    let classes = saved.config.num_classes();
    println!(
        "{count} tensors of {} ({classes} classes) written to {}",
        saved.model.family(),
        out.display()
    );
    match torchvision_name(&saved.config) {
        Some(name) => println!(
            "in PyTorch: torchvision.models.{name}(num_classes={classes}).load_state_dict(\
             safetensors.torch.load_file({:?}))",
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
