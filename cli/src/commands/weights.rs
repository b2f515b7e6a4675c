//! `--weights imagenet` and `hearth weights fetch`: torchvision's ImageNet weights by name
//! (`hearth::hub`), with a progress bar.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;
use hearth::hub::{Hub, imagenet_file};
use hearth::models::Architecture;

#[derive(Subcommand)]
pub enum WeightsCommand {
    /// Download torchvision's ImageNet weights of each model into Hearth's cache (once; the
    /// SHA-256 in the file name is checked), and print where each is. `--weights imagenet`
    /// fetches the same file the first time a run needs it.
    Fetch {
        /// torchvision names: resnet50, densenet121, vgg16_bn, ...
        #[arg(required = true)]
        models: Vec<String>,
    },
}

/// What `--weights` names: `imagenet` is `model`'s torchvision ImageNet file (fetched unless
/// `dry_run`, which only says where it would be); anything else is a path, as given.
pub fn resolve(weights: Option<PathBuf>, model: &str, dry_run: bool) -> Result<Option<PathBuf>> {
    let Some(w) = weights else {
        return Ok(None);
    };
    if w.as_os_str() != "imagenet" {
        return Ok(Some(w));
    }
    let arch = Architecture::from_name(model).map_err(|e| {
        anyhow::anyhow!("--weights imagenet: {e} (torchvision publishes ImageNet weights of these)")
    })?;
    let hub = Hub::from_env();
    if dry_run {
        return Ok(Some(hub.cache_dir.join(imagenet_file(arch))));
    }
    Ok(Some(fetch(&hub, arch)?))
}

fn fetch(hub: &Hub, arch: Architecture) -> Result<PathBuf> {
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes}, {bytes_per_sec}, eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(format!("downloading {}", imagenet_file(arch)));
    let path = hub.imagenet(arch, &mut |done, total| {
        if let Some(t) = total {
            bar.set_length(t);
        }
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let path = path?;
    eprintln!(
        "{arch}: torchvision's ImageNet weights at {}",
        path.display()
    );
    Ok(path)
}

pub fn weights_cmd(cmd: WeightsCommand) -> Result<()> {
    match cmd {
        WeightsCommand::Fetch { models } => {
            let hub = Hub::from_env();
            let archs = models
                .iter()
                .map(|m| Architecture::from_name(m))
                .collect::<hearth::models::Result<Vec<_>>>()?;
            for arch in archs {
                println!("{}", fetch(&hub, arch)?.display());
            }
            Ok(())
        }
    }
}
