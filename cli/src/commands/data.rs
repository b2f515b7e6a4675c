//! `hearth data`: `synth` writes a learnable synthetic image folder, `check` says what training
//! would do with a folder.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub(crate) enum DataCommand {
    /// Write a learnable synthetic image-folder data set (coloured shapes over noise).
    Synth(SynthArgs),
    /// What training would do with a folder: its layout, classes and counts per part, images
    /// that fail to decode, files in both train and val, image sizes. Exits 1 when it finds
    /// undecodable images or train/val duplicates.
    Check(CheckArgs),
}

#[derive(Args)]
pub(crate) struct CheckArgs {
    /// The folder, as `hearth train --data` takes it.
    #[arg(long)]
    data: PathBuf,
    /// A multi-label CSV, as `hearth train --labels` takes it.
    #[arg(long)]
    labels: Option<PathBuf>,
    /// Share held out for validation when the folder has no val/ (as train splits it)
    /// [default: 0.2]. Refused where the folder has train/ and val/: nothing is split.
    #[arg(long)]
    val_fraction: Option<f64>,
    /// Seed of that split (as train's --seed) [default: 0]. Refused where nothing is split.
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(Args)]
pub(crate) struct SynthArgs {
    /// Folder to write (train/<class>/..., and val/ with --val-per-class); it must be new or
    /// empty, or a synthetic set written before (with --overwrite).
    #[arg(long)]
    out: PathBuf,
    /// Number of classes (shapes and colours).
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Training images per class.
    #[arg(long, default_value_t = 200)]
    per_class: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 64)]
    size: u32,
    /// Also write val/ with this many images per class (train/ then holds --per-class).
    #[arg(long, default_value_t = 0)]
    val_per_class: usize,
    /// Seed of the images' randomness (the same seed writes the same images).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write JPEG files instead of PNG.
    #[arg(long)]
    jpeg: bool,
    /// Replace the synthetic set already in --out (only one this command wrote; another
    /// folder's files are never deleted).
    #[arg(long)]
    overwrite: bool,
}

/// The file `hearth data synth` leaves in its folder: how `--overwrite` knows it wrote it.
const SYNTH_MARK: &str = ".hearth-synth";

pub(crate) fn data_check(args: CheckArgs) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("decoding {pos}/{len} images {wide_bar}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if args.labels.is_none() && hearth::datasets::has_train_val(&args.data) {
        let given = [
            ("--val-fraction", args.val_fraction.is_some()),
            ("--seed", args.seed.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
            anyhow::bail!(
                "{flag}: {} holds train/ and val/, so val/ is the validation set and nothing is \
                 split (leave {flag} out, or check {} to see that folder split)",
                args.data.display(),
                args.data.join("train").display()
            );
        }
    }
    let found = crate::commands::data_check::check(
        &args.data,
        args.labels.as_deref(),
        args.val_fraction
            .unwrap_or_else(|| hearth::train::DataSettings::default().val_fraction),
        args.seed.unwrap_or(0),
        &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )?;
    bar.finish_and_clear();
    print!("{}", found.report());
    if found.has_problems() {
        std::process::exit(1);
    }
    Ok(())
}

pub(crate) fn data_synth(args: SynthArgs) -> Result<()> {
    use hearth::datasets::synth::{SynthConfig, generate};
    let cfg = SynthConfig::new(args.classes, args.per_class, args.size)
        .with_seed(args.seed)
        .with_val(args.val_per_class)
        .with_jpeg(args.jpeg);
    let out = &args.out;
    let occupied = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if occupied {
        match (out.join(SYNTH_MARK).is_file(), args.overwrite) {
            (true, true) => remove_synth(out)?,
            (true, false) => anyhow::bail!(
                "{} holds a synthetic set written before: --overwrite replaces it",
                out.display()
            ),
            (false, _) => anyhow::bail!(
                "{} is not empty and is no synthetic set this command wrote: give a new or empty \
                 folder (it never writes into, or deletes, another data set)",
                out.display()
            ),
        }
    }
    let started = Instant::now();
    let before = files_under(out);
    let n = generate(out, &cfg)?;
    // The files this command wrote, so that --overwrite deletes those and nothing else.
    let written: Vec<String> = files_under(out)
        .difference(&before)
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let mark = serde_json::json!({
        "classes": args.classes,
        "per_class": args.per_class,
        "val_per_class": args.val_per_class,
        "size": args.size,
        "seed": args.seed,
        "files": written,
    });
    std::fs::write(out.join(SYNTH_MARK), format!("{mark}\n"))
        .with_context(|| format!("writing {}", out.join(SYNTH_MARK).display()))?;
    println!(
        "wrote {n} images ({} classes, {}x{}) to {} in {:.1} s",
        args.classes,
        args.size,
        args.size,
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Every file under `dir`, as paths relative to it (none when it does not exist).
fn files_under(dir: &std::path::Path) -> std::collections::BTreeSet<PathBuf> {
    let mut out = std::collections::BTreeSet::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(dir.join(&rel)) else {
            continue;
        };
        for e in entries.flatten() {
            let path = rel.join(e.file_name());
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(_) => {
                    out.insert(path);
                }
                Err(_) => {}
            }
        }
    }
    out
}

/// `--overwrite`: removes the files an earlier `data synth` wrote in `out` (its mark lists
/// them), then the folders that left empty; anything else there stays.
fn remove_synth(out: &std::path::Path) -> Result<()> {
    let mark = out.join(SYNTH_MARK);
    let text =
        std::fs::read_to_string(&mark).with_context(|| format!("reading {}", mark.display()))?;
    let files: Vec<PathBuf> = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v["files"].as_array().map(|a| {
                a.iter()
                    .filter_map(|f| f.as_str().map(PathBuf::from))
                    .collect()
            })
        })
        .with_context(|| {
            format!(
                "{} does not list the files it wrote (an older hearth wrote it): delete the \
                 set yourself, or give a new folder",
                mark.display()
            )
        })?;
    let mut dirs = std::collections::BTreeSet::new();
    for f in &files {
        // Only paths inside `out`, as the command wrote them.
        if f.is_absolute() || f.components().any(|c| c == std::path::Component::ParentDir) {
            anyhow::bail!(
                "{} lists {} outside the folder",
                mark.display(),
                f.display()
            );
        }
        match std::fs::remove_file(out.join(f)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", out.join(f).display()));
            }
            _ => {}
        }
        let mut parent = f.parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            dirs.insert(p.to_path_buf());
            parent = p.parent();
        }
    }
    std::fs::remove_file(&mark).with_context(|| format!("removing {}", mark.display()))?;
    // Deepest first; a folder that still holds something else is kept.
    let mut dirs: Vec<PathBuf> = dirs.into_iter().collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for d in dirs {
        let _ = std::fs::remove_dir(out.join(d));
    }
    Ok(())
}
