//! Helpers shared by the bench binaries.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

pub fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A number from the variable `key`, else `default`.
pub fn env_f64(key: &str, default: f64) -> f64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `size_mb -> time_ms` from the lines `size_mb=S time_ms=T ...` that `hearth bench allreduce`,
/// `scripts/netns_allreduce.sh` and the gloo peer print.
pub fn parse_times(out: &str) -> std::collections::BTreeMap<String, f64> {
    out.lines()
        .filter_map(|l| {
            let l = l.trim();
            let size = l.strip_prefix("size_mb=")?.split_whitespace().next()?;
            let time = l.split("time_ms=").nth(1)?.split_whitespace().next()?;
            Some((size.to_string(), time.parse().ok()?))
        })
        .collect()
}

/// The median of the finite values of `v` (NaN when there are none).
pub fn median(v: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A comma-separated list from the variable `key` (blank items dropped), else from `default`.
pub fn env_list(key: &str, default: &str) -> Vec<String> {
    std::env::var(key)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The Python with PyTorch and torchvision for the peer: `$HEARTH_TORCH_PYTHON`, else the
/// environment made by scripts/setup_pytorch.sh. `None` when neither imports torch.
pub fn torch_python() -> Option<PathBuf> {
    let candidate = std::env::var_os("HEARTH_TORCH_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/hearth/venv-torch/bin/python"))
        })?;
    Command::new(&candidate)
        .args(["-c", "import torch, torchvision"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
        .then_some(candidate)
}

/// A peer script in benches/peer.
pub fn peer_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("benches/peer")
        .join(name)
}

/// The CPU as a figure should name it: its model, its widest vector extension, its cores.
pub fn cpu() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let name = text
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("?")
        .trim()
        .to_string();
    let flags = text.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    let isa = if flags.contains("avx512f") {
        "AVX-512"
    } else if flags.contains("avx2") {
        "AVX2"
    } else {
        "no AVX2"
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{name}, {isa}, {cores} cores")
}

/// The `hearth` binary's policy for freed memory in this bench's process too (kept for reuse
/// unless `HEARTH_MALLOC=system`; `hearth::alloc::keep_freed_memory`), printed; a bad value
/// ends the bench.
pub fn freed_memory_policy() {
    match hearth::alloc::apply_freed_memory_policy() {
        Ok(p) => println!("freed memory: {p:?} (HEARTH_MALLOC=keep|system)"),
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
    }
}
