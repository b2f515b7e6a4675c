//! Kernel selection on the cubecl devices (wgpu, Vulkan, CUDA), and a way to see it.
//!
//! By default Hearth's convolutions and linear layers take the kernels `hearth_kernels::select`
//! picks by rule for each operation, geometry and device (tensor cores, TMA), without timing
//! anything: a new GPU compiles only the kernels it runs, instead of compiling and timing
//! every candidate (on a fresh H200, ResNet-50 training had not reached its first step after 12
//! minutes of that; the time by rule is not yet measured on a GPU). The choice never depends
//! on the batch size. `--autotune full` (`HEARTH_AUTOTUNE=full`) hands them back to Burn's
//! `autotune`, which times every candidate kernel (direct, im2col and implicit-GEMM
//! convolutions, the tiled and tensor-core matmuls) on each new shape and keeps the fastest, in
//! memory and in cubecl's on-disk cache (`target/environment` inside a Cargo project, else
//! `~/.cache/cubecl`), so a second run does not tune again. `CUBECL_AUTOTUNE_CACHE=0` turns
//! that disk cache off, `CUBECL_AUTOTUNE_LEVEL` (`minimal`, `balanced`, `extensive`, `full`)
//! sets how many candidates are tried. Burn's own reductions (`reduce_dim`, the whole-tensor
//! `sum`) are decided by rule as well: their decisions written into that cache before the
//! first reduction (`reductions_at_start`, [`hearth_kernels::reduce_rules`];
//! `HEARTH_REDUCE_RULES=0` writes none), and removed again under `--autotune full`. So are
//! fusion's fused reductions (`fused_reductions_at_start`, [`hearth_kernels::fused_reduce`]:
//! their routine launched by rule; fusion's own tuners under `--autotune full` or
//! `HEARTH_REDUCE_RULES=0`).
//!
//! cubecl's compiled-kernel cache is on (CUDA and HIP keep each compiled kernel under the GPU's
//! fingerprint, so a second run compiles nothing); `HEARTH_KERNEL_CACHE=0` turns it off.
//!
//! `HEARTH_AUTOTUNE_LOG=FILE` appends every decision autotune takes to FILE, one JSON object a
//! line (cubecl's own `AutotuneDecision`: the key with the shapes, each candidate's timing;
//! `{rank}` in FILE becomes the process's rank, so each rank of a job writes its own), and
//! `hearth autotune-report FILE` prints them as a table: which kernel won for each shape, how long
//! it took, and how far the runner-up was behind. Keys round channels, sizes and the batch up to
//! powers of two (cubecl's anchors: a 3->5 convolution on 9x9 is tuned as 4->8 on 16x16), so one
//! decision covers a range of shapes. A decision found in the disk cache is not
//! taken again, so it is not logged: delete the cache or set `CUBECL_AUTOTUNE_CACHE=0` to see
//! every decision of a run.
//!
//! TF32: on NVIDIA GPUs from sm_80, cubecl runs f32 matrix products and convolutions on tensor
//! cores as TF32 whenever the device supports it, and Burn 0.22.1 / cubecl 0.11.3 offer no switch
//! to turn that off. Results then differ from f32 by about 1e-3 relative; the parity test checks
//! CUDA against [`TF32_RELATIVE_TOLERANCE`] instead of the f32 tolerance.

use std::path::Path;

use crate::{HearthError, Result};

mod report;
pub use report::{Decision, DecisionKind, autotune_report, read_decisions};

/// The variable that names the autotune decision log.
pub const AUTOTUNE_LOG_ENV: &str = "HEARTH_AUTOTUNE_LOG";

/// The variable naming a kernel bundle (what `hearth tune` writes) to import into cubecl's
/// cache before the first GPU device starts.
pub const KERNEL_BUNDLE_ENV: &str = "HEARTH_KERNEL_BUNDLE";

/// Largest |difference| over the largest |expected value| accepted where f32 products run as
/// TF32 (10-bit mantissa: about 5e-4 per product, more after long sums).
pub const TF32_RELATIVE_TOLERANCE: f32 = 5e-3;

/// The variable that turns cubecl's compiled-kernel cache off (`0`).
pub const KERNEL_CACHE_ENV: &str = "HEARTH_KERNEL_CACHE";

/// Applies Hearth's cubecl settings before the first cubecl device starts: the compiled-kernel
/// cache (on unless [`KERNEL_CACHE_ENV`] is `0`) and the decision log of [`AUTOTUNE_LOG_ENV`].
/// Called by [`crate::device`] before it builds a device; calling it again does nothing.
/// Returns a warning when cubecl's configuration had already been read (a program that used a
/// cubecl device before calling this), so neither setting took.
pub fn configure() -> Option<String> {
    #[cfg(feature = "gpu-kernels")]
    {
        static WARNING: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        WARNING.get_or_init(apply_config).clone()
    }
    #[cfg(not(feature = "gpu-kernels"))]
    {
        std::env::var_os(AUTOTUNE_LOG_ENV).map(|_| {
            format!("{AUTOTUNE_LOG_ENV} is set, but this build has no cubecl device (wgpu, cuda)")
        })
    }
}

#[cfg(feature = "gpu-kernels")]
fn apply_config() -> Option<String> {
    use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

    let log = std::env::var_os(AUTOTUNE_LOG_ENV).map(|v| log_path(&v));
    let cache = std::env::var(KERNEL_CACHE_ENV)
        .map_or(true, |v| !matches!(v.trim(), "0" | "false" | "off"));
    // cubecl's own sources first (cubecl.toml or burn.toml, CUBECL_* variables), then ours.
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache = cache;
    if let Some(path) = &log {
        config.autotune.decisions.file = Some(path.clone());
        config.autotune.decisions.append = true;
    }
    if CubeClRuntimeConfig::try_set(config) {
        return None;
    }
    Some(match &log {
        Some(path) => format!(
            "{AUTOTUNE_LOG_ENV}={}: cubecl's configuration was already in use, so no decision is logged",
            path.display()
        ),
        None => "cubecl's configuration was already in use, so its compiled-kernel cache keeps \
                 cubecl's own setting"
            .into(),
    })
}

/// A line for the start of a run on a cubecl device, or `None` when autotune has earlier
/// decisions to reuse: where its decisions are kept and that, with none there yet, the first
/// steps time the candidate kernels of each new shape (minutes on a fresh GPU: about 7 for
/// ResNet-50's inference on an H200, each candidate compiled by NVRTC), so that a long first
/// step does not look like a hang. Call it before the device starts: starting it creates the
/// database.
pub fn autotune_notice(device: &str) -> Option<String> {
    #[cfg(feature = "gpu-kernels")]
    {
        use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
        // Kernels chosen by rule: nothing long to announce.
        if hearth_kernels::select::selection() == hearth_kernels::select::Selection::Rules {
            return None;
        }
        if CubeClRuntimeConfig::get().autotune.disable_cache {
            return Some(format!(
                "autotune on {device}: its disk cache is off (CUBECL_AUTOTUNE_CACHE=0), so the \
                 first steps of every run time the candidate kernels of each new shape"
            ));
        }
        let db = cubecl::environment::path();
        let empty = std::fs::metadata(&db).map_or(true, |m| m.len() == 0);
        empty.then(|| {
            format!(
                "autotune on {device}: no earlier decisions in {}; the first steps time the \
                 candidate kernels of each new convolution and matrix shape, which can take \
                 minutes on a GPU it has not seen (later runs reuse the decisions)",
                db.display()
            )
        })
    }
    #[cfg(not(feature = "gpu-kernels"))]
    {
        let _ = device;
        None
    }
}

/// The variable that keeps Burn's reductions under autotune where kernels are chosen by rule
/// (`0`): no rule is written into cubecl's cache (rules written by earlier runs stay, until
/// `--autotune full` removes them), and fusion's fused reductions keep their tuners. For timing
/// the rules against autotune on a fresh cache.
pub const REDUCE_RULES_ENV: &str = "HEARTH_REDUCE_RULES";

fn reduce_rules_off() -> bool {
    std::env::var(REDUCE_RULES_ENV).is_ok_and(|v| matches!(v.trim(), "0" | "false" | "off"))
}

/// Fusion's fused reductions by rule ([`hearth_kernels::fused_reduce`]): where kernels are
/// chosen by rule, replaces fusion's reduction optimizations, for the whole process, by one
/// that launches its routine by rule instead of timing three. Called by [`crate::device`]
/// before a cubecl device starts (fusion's optimizations are fixed at the first tensor on any
/// cubecl device); says on stderr (`note`) why a process keeps fusion's tuners.
pub(crate) fn fused_reductions_at_start(note: bool) {
    #[cfg(feature = "gpu-kernels")]
    {
        use hearth_kernels::fused_reduce::install;
        use hearth_kernels::select::{Selection, selection};
        if selection() == Selection::Rules
            && !reduce_rules_off()
            && let Err(why) = install()
            && note
        {
            eprintln!("note: fusion's fused reductions keep autotune: {why}");
        }
    }
    #[cfg(not(feature = "gpu-kernels"))]
    let _ = note;
}

/// Burn's own reductions by rule ([`hearth_kernels::reduce_rules`]): where kernels are chosen
/// by rule, writes the rules' autotune decisions for `device` into cubecl's cache, once, so
/// its reductions compile one kernel each instead of timing every candidate; under
/// `--autotune full`, removes those decisions again so that the reductions are timed. Says on
/// stderr what it wrote or removed, and why a cubecl device keeps autotune for them. Called by
/// [`crate::device`] once the device works, before its first reduction.
pub(crate) fn reductions_at_start(device: &burn::prelude::Device) {
    #[cfg(feature = "gpu-kernels")]
    {
        use hearth_kernels::reduce_rules::{NotSeeded, forget, seed};
        use hearth_kernels::select::{Selection, selection};
        let off = reduce_rules_off();
        match selection() {
            Selection::Rules if off => {
                eprintln!("note: {REDUCE_RULES_ENV}=0: Burn's reductions keep autotune")
            }
            Selection::Rules => match seed(device) {
                Ok(s) if s.written > 0 => eprintln!(
                    "reductions by rule: {} autotune decisions written into cubecl's cache for \
                     this device, once ({} already there)",
                    s.written, s.kept
                ),
                Ok(_) | Err(NotSeeded::NotCubecl) => {}
                Err(why) => eprintln!("note: reductions keep autotune: {why}"),
            },
            Selection::Autotune => {
                if let Ok(n) = forget(device)
                    && n > 0
                {
                    eprintln!(
                        "--autotune full: {n} reduction decisions made by rule removed from \
                         cubecl's cache, so the reductions are timed"
                    );
                }
            }
        }
    }
    #[cfg(not(feature = "gpu-kernels"))]
    let _ = device;
}

/// The variable that turns off the kernel bundles Hearth ships (`0`): a CUDA device on a GPU
/// they were made for then compiles every kernel itself, as on a GPU with none shipped.
pub const SHIPPED_KERNELS_ENV: &str = "HEARTH_SHIPPED_KERNELS";

/// A kernel bundle compiled into the binary: cubecl's flat format, gzip-compressed.
#[cfg(feature = "cuda")]
struct Shipped {
    name: &'static str,
    /// Parts of the GPU model names (as the NVIDIA driver reports them) of its architecture.
    models: &'static [&'static str],
    gz: &'static [u8],
}

/// The bundles Hearth ships: for each GPU architecture measured with `scripts/gpu_check.sh`,
/// the kernels its runs compiled (NVRTC) and the reductions' autotune decisions, written by
/// `hearth tune --from-cache` (bundles/README.md says how to make one again).
#[cfg(feature = "cuda")]
const SHIPPED: &[Shipped] = &[Shipped {
    name: "cuda-sm90",
    models: &["H100", "H200", "H800", "H20"],
    gz: include_bytes!("../../bundles/cuda-sm90.ccb.gz"),
}];

/// Imports the kernel bundles Hearth ships for this machine's NVIDIA GPUs into cubecl's cache,
/// once per cache (a marker file beside cubecl's database names the bundle and its checksum),
/// and not where [`SHIPPED_KERNELS_ENV`] is `0`. Returns a line for each bundle imported.
/// Entries are keyed by cubecl's version, the GPU architecture and each kernel's source, so
/// entries of another GPU, or of a kernel changed since the bundle was made, are never looked
/// up: a stale bundle costs its import and nothing else. Builds without the `cuda` feature
/// ship none.
pub fn import_shipped_bundles() -> Result<Vec<String>> {
    #[cfg(feature = "cuda")]
    {
        let off = std::env::var(SHIPPED_KERNELS_ENV)
            .is_ok_and(|v| matches!(v.trim(), "0" | "false" | "off"));
        if off {
            return Ok(Vec::new());
        }
        let models = nvidia_models();
        let db = cubecl::environment::path();
        let dir = db.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut lines = Vec::new();
        for bundle in SHIPPED {
            // Without the driver's list (no /proc/driver/nvidia here) the bundle is imported
            // anyway: entries for another architecture are never looked up.
            let fits = models.is_empty()
                || models
                    .iter()
                    .any(|m| bundle.models.iter().any(|part| m.contains(part)));
            if !fits {
                continue;
            }
            let marker = dir.join(format!(
                "hearth-{}-{:016x}.imported",
                bundle.name,
                fnv1a(bundle.gz)
            ));
            if marker.exists() {
                continue;
            }
            lines.push(import_gz_bundle(bundle.name, bundle.gz, &dir, &marker)?);
        }
        Ok(lines)
    }
    #[cfg(not(feature = "cuda"))]
    Ok(Vec::new())
}

/// The GPU model names the NVIDIA driver lists (`/proc/driver/nvidia/gpus/*/information`).
#[cfg(feature = "cuda")]
fn nvidia_models() -> Vec<String> {
    let Ok(gpus) = std::fs::read_dir("/proc/driver/nvidia/gpus") else {
        return Vec::new();
    };
    gpus.flatten()
        .filter_map(|gpu| std::fs::read_to_string(gpu.path().join("information")).ok())
        .filter_map(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("Model:").map(|m| m.trim().to_string()))
        })
        .collect()
}

/// FNV-1a over `bytes`: names a shipped bundle's version in its import marker.
#[cfg(feature = "cuda")]
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Unpacks a gzip-compressed bundle into `dir`, imports it, and leaves `marker` behind.
#[cfg(feature = "cuda")]
fn import_gz_bundle(name: &str, gz: &[u8], dir: &Path, marker: &Path) -> Result<String> {
    use std::io::Read;
    let unpacked = dir.join(format!("hearth-{name}.ccb.tmp"));
    let failed = |reason: String| HearthError::KernelBundle {
        path: unpacked.clone(),
        reason,
    };
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .map_err(|e| failed(format!("the shipped bundle {name} does not unpack: {e}")))?;
    std::fs::create_dir_all(dir)
        .map_err(|e| failed(format!("cannot create {}: {e}", dir.display())))?;
    std::fs::write(&unpacked, &raw).map_err(|e| failed(format!("cannot write it: {e}")))?;
    let imported = import_bundle(&unpacked);
    let _ = std::fs::remove_file(&unpacked);
    let line = imported?;
    std::fs::write(marker, line.as_bytes())
        .map_err(|e| failed(format!("cannot write {}: {e}", marker.display())))?;
    // `line` names the unpacked file, gone now: keep what was imported where.
    let what = line
        .split_once(": ")
        .map_or(line.as_str(), |(_, rest)| rest);
    Ok(format!("{name} (kernels shipped with Hearth): {what}"))
}

/// Imports the kernel bundle [`KERNEL_BUNDLE_ENV`] names, once per process, before the first
/// GPU device starts (its entries must be in cubecl's cache before a tuner opens it); without
/// one, where `ships` (a CUDA device), the bundles Hearth ships for its GPU
/// ([`import_shipped_bundles`]). Called by [`crate::device`] before it builds a cubecl device.
pub(crate) fn import_bundles_at_start(ships: bool) -> Result<()> {
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    let given = std::env::var_os(KERNEL_BUNDLE_ENV).map(std::path::PathBuf::from);
    if given.is_none() && !ships {
        return Ok(());
    }
    let outcome = DONE.get_or_init(|| {
        let lines = match &given {
            Some(path) => import_bundle(path).map(|line| vec![line]),
            None => import_shipped_bundles(),
        };
        match lines {
            Ok(lines) => {
                for line in lines {
                    eprintln!("{line}");
                }
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    });
    outcome.clone().map_err(HearthError::InvalidArgument)
}

/// Copies the kernel bundle at `path` (autotune decisions and compiled kernels, written by
/// [`export_bundle`]) into cubecl's cache, once per process: entries the cache already holds
/// keep their value. Returns a line saying what was imported. A missing, unreadable or corrupt
/// file is an error naming it; a bundle from another cubecl version or GPU imports entries no
/// lookup here will ask for, and costs nothing else (cubecl keys them by version and device).
pub fn import_bundle(path: &Path) -> Result<String> {
    let bundle_error = |reason: String| HearthError::KernelBundle {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_file() {
        return Err(bundle_error("no such file".into()));
    }
    #[cfg(feature = "gpu-kernels")]
    {
        use cubecl::bundle::{import, open};
        let bundle = open(path).map_err(|e| bundle_error(format!("{e}")))?;
        let report = import(bundle.as_ref());
        Ok(format!(
            "kernel bundle {}: {} entries imported into {} ({} already there{})",
            path.display(),
            report.imported,
            cubecl::environment::path().display(),
            report.skipped,
            if report.failed > 0 {
                format!(", {} could not be written", report.failed)
            } else {
                String::new()
            }
        ))
    }
    #[cfg(not(feature = "gpu-kernels"))]
    Err(bundle_error(
        "this build has no GPU device (build with the wgpu or cuda feature)".into(),
    ))
}

/// Writes what cubecl's cache holds now (autotune decisions and, on CUDA, compiled kernels)
/// to `out` as a bundle named `name`, for [`import_bundle`] on other machines. The account of
/// how the cache was built (cubecl's `records`) is left out. Returns a line saying what was
/// written.
pub fn export_bundle(out: &Path, name: &str) -> Result<String> {
    let bundle_error = |reason: String| HearthError::KernelBundle {
        path: out.to_path_buf(),
        reason,
    };
    #[cfg(feature = "gpu-kernels")]
    {
        use cubecl::bundle::{BundleFormat, ExportOptions, export};
        let options = ExportOptions {
            name: name.to_string(),
            excluded_namespaces: vec!["records".into()],
            // A `.ccb` name gets cubecl's flat format (what Hearth embeds); anything else SQLite.
            format: if out.extension().is_some_and(|e| e == "ccb") {
                BundleFormat::Flat
            } else {
                BundleFormat::Sqlite
            },
            ..Default::default()
        };
        let source = cubecl::environment::path();
        if !source.is_file() {
            return Err(bundle_error(format!(
                "cubecl's cache {} holds nothing to export",
                source.display()
            )));
        }
        let manifest =
            export(&[&source], out, &options).map_err(|e| bundle_error(format!("{e}")))?;
        let bundle = cubecl::bundle::open(out).map_err(|e| bundle_error(format!("{e}")))?;
        let mut entries = 0usize;
        let mut namespaces = Vec::new();
        for namespace in bundle.namespaces() {
            let mut n = 0usize;
            bundle.scan(&namespace, &mut |_, _| n += 1);
            entries += n;
            namespaces.push(format!("{namespace}: {n}"));
        }
        Ok(format!(
            "kernel bundle {} ({:?}, cubecl {}): {entries} entries\n  {}",
            out.display(),
            manifest.name,
            manifest.cubecl_version,
            namespaces.join("\n  ")
        ))
    }
    #[cfg(not(feature = "gpu-kernels"))]
    {
        let _ = name;
        Err(bundle_error(
            "this build has no GPU device (build with the wgpu or cuda feature)".into(),
        ))
    }
}

/// The log file a process writes: `{rank}` in the variable's value becomes this process's rank
/// (`HEARTH_RANK`, else torchrun's `RANK`, else 0), so the ranks of a job write a file each.
#[cfg_attr(not(feature = "gpu-kernels"), allow(dead_code))]
fn log_path(value: &std::ffi::OsStr) -> std::path::PathBuf {
    let rank = std::env::var("HEARTH_RANK")
        .or_else(|_| std::env::var("RANK"))
        .unwrap_or_else(|_| "0".into());
    log_path_for(value, rank.trim())
}

fn log_path_for(value: &std::ffi::OsStr, rank: &str) -> std::path::PathBuf {
    let text = value.to_string_lossy();
    if text.contains("{rank}") {
        text.replace("{rank}", rank).into()
    } else {
        value.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_in_the_log_name_becomes_this_process_rank() {
        use std::ffi::OsStr;
        use std::path::PathBuf;
        assert_eq!(
            log_path_for(OsStr::new("/tmp/a.jsonl"), "3"),
            PathBuf::from("/tmp/a.jsonl")
        );
        assert_eq!(
            log_path_for(OsStr::new("/tmp/a-{rank}.jsonl"), "3"),
            PathBuf::from("/tmp/a-3.jsonl")
        );
    }
}
