//! `hearth tune`: tuning as a deliberate act. A few steps of a model under Burn's autotune (and
//! one with the kernels chosen by rule, so that their compiled form is kept too), then cubecl's
//! cache written to a bundle file that `--kernel-bundle` imports on other machines.
//! `--rules-only` skips autotune: the bundle then holds the compiled kernels that runs with the
//! default selection use (and whatever else the cache held), made in seconds. `--from-cache`
//! runs nothing and bundles the cache as it is (how `bundles/` is made from a GPU run's cache).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use hearth::kernels::select::{Selection, set_selection};
use hearth::models::Architecture;
use hearth_cli::bench::{BenchMode, ModelBench};

#[derive(Args)]
pub(crate) struct TuneArgs {
    /// A torchvision name (resnet50, densenet121, vgg16, ...).
    #[arg(long, default_value = "resnet50")]
    model: String,
    /// train (forward, backward, SGD step: the shapes training runs) or infer.
    #[arg(long, value_enum, default_value_t = BenchMode::Train)]
    mode: BenchMode,
    /// Images per step: tune the batch size you train with (autotune's keys round it up to a
    /// power of two, so a last partial batch of another size tunes again).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Input side in pixels.
    #[arg(long, default_value_t = 224)]
    size: usize,
    /// Classes of the head.
    #[arg(long, default_value_t = 1000)]
    num_classes: usize,
    /// The type steps compute in, as `hearth train --precision`.
    #[arg(long, value_enum, default_value_t = hearth::train::Precision::Fp32)]
    precision: hearth::train::Precision,
    /// Where to write the bundle (an SQLite file, or cubecl's flat format for a name ending in
    /// `.ccb`, the one Hearth embeds; an earlier bundle there is replaced).
    #[arg(long)]
    out: PathBuf,
    /// The bundle's name (default: the model, batch and device).
    #[arg(long)]
    name: Option<String>,
    /// Only the steps with the kernels chosen by rule (the default `--autotune off`): the bundle
    /// holds their compiled kernels and no autotune decision. Seconds where a full tune takes
    /// minutes; enough for runs that keep the default selection.
    #[arg(long)]
    rules_only: bool,
    /// Run nothing: write what cubecl's cache holds now (the kernels earlier runs on this
    /// machine compiled, their decisions) to the bundle. Starts no device.
    #[arg(long, conflicts_with = "rules_only")]
    from_cache: bool,
}

pub(crate) fn tune(device_name: &str, args: TuneArgs) -> Result<()> {
    if hearth::train::MINI_MODELS.contains(&args.model.as_str()) {
        bail!(
            "tune takes a torchvision name (resnet50, densenet121, vgg16, ...): {} is a \
             test-size network",
            args.model
        );
    }
    let spec: hearth::device::DeviceSpec = device_name.parse()?;
    if !spec.choice.is_cubecl() {
        bail!(
            "tune: {} has no GPU kernels to tune; give a GPU device (--device cuda, vulkan, \
             wgpu or vulkan-cpu, as this build has them)",
            spec.choice
        );
    }
    if args.out.is_dir() {
        bail!(
            "--out {}: is a folder; give a file name",
            args.out.display()
        );
    }
    if args.rules_only && hearth::kernels::select::selection() == Selection::Autotune {
        bail!(
            "--rules-only compiles only the kernels chosen by rule, but --autotune full (or \
             HEARTH_AUTOTUNE=full) asks for autotune: drop one of them"
        );
    }
    let arch = Architecture::from_name(&args.model)?;
    let name = args.name.clone().unwrap_or_else(|| {
        format!(
            "{arch} {:?} batch {} {}px {} on {device_name}",
            args.mode, args.batch_size, args.size, args.precision
        )
    });
    if args.from_cache {
        println!("{}", hearth::gpu::export_bundle(&args.out, &name)?);
        return Ok(());
    }
    let device = hearth::device::select(device_name)?;
    let run = |selection: Selection, what: &str| -> Result<()> {
        set_selection(selection);
        eprintln!(
            "tune: {arch} {:?} batch {} at {}x{} on {device_name}, {what}",
            args.mode, args.batch_size, args.size, args.size
        );
        let started = std::time::Instant::now();
        ModelBench {
            arch,
            mode: args.mode,
            batch_size: args.batch_size,
            size: args.size,
            warmup: 1,
            steps: 1,
            num_classes: args.num_classes,
            precision: args.precision,
        }
        .run(&device, |i, total, dt, _| {
            eprintln!("  step {i}/{total}: {:.1} s", dt);
        })?;
        eprintln!("  {:.1} s", started.elapsed().as_secs_f64());
        Ok(())
    };
    run(
        Selection::Rules,
        "kernels chosen by rule (compiled and kept)",
    )?;
    if !args.rules_only {
        run(
            Selection::Autotune,
            "--autotune full (every candidate kernel of each new shape compiled and timed)",
        )?;
    }
    println!("{}", hearth::gpu::export_bundle(&args.out, &name)?);
    println!(
        "use it with: hearth --device {device_name} --kernel-bundle {}{} train ...",
        args.out.display(),
        if args.rules_only {
            ""
        } else {
            " [--autotune full]"
        }
    );
    Ok(())
}
