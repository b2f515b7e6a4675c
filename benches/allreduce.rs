//! Allreduce on one host: Hearth (`hearth bench allreduce`) with shared memory between the ranks
//! (the default) and without it (`HEARTH_SHM=0`: QUIC on loopback), against torch.distributed's
//! gloo backend, same ranks and sizes, same run; and a single-thread memcpy of the largest size
//! measured in this process, the bandwidth anchor:
//!
//!   cargo bench --bench allreduce
//!   HEARTH_BENCH_RANKS=2,4 HEARTH_BENCH_SIZES=1,10,100 HEARTH_BENCH_ITERS=5 cargo bench --bench allreduce
//!
//! Prints every tool's lines, then per size the busbw of each and the ratios: shared memory
//! against gloo (above 1: Hearth faster) and against memcpy.

mod common;

use std::collections::BTreeMap;
use std::process::Command;

/// `size_mb -> time_ms` from lines `size_mb=S time_ms=T ...`.
fn parse(out: &str) -> BTreeMap<String, f64> {
    out.lines()
        .filter_map(|l| {
            let l = l.trim();
            let size = l
                .strip_prefix("size_mb=")?
                .split_whitespace()
                .next()?
                .to_string();
            let time = l
                .split("time_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            Some((size, time))
        })
        .collect()
}

/// Best of five single-thread copies of `mb` megabytes, in GB/s (bytes copied per second).
fn memcpy_gbps(mb: f64) -> f64 {
    let len = ((mb * 1e6) / 4.0) as usize;
    let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let mut dst = vec![0f32; len];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&mut dst);
    }
    (len * 4) as f64 / best / 1e9
}

/// Runs `hearth bench allreduce` for `n` ranks, with shared memory or QUIC only.
fn hearth(n: &str, sizes: &[String], iters: &str, shm: bool) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args([
            "bench",
            "allreduce",
            "--ranks",
            n,
            "--iters",
            iters,
            "--size-mb",
        ])
        .args(sizes)
        .env("HEARTH_SHM", if shm { "1" } else { "0" })
        .output()
        .expect("running hearth bench allreduce");
    if !out.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        panic!("hearth bench allreduce failed");
    }
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn main() {
    let ranks = common::env_list("HEARTH_BENCH_RANKS", "2,4");
    let sizes = common::env_list("HEARTH_BENCH_SIZES", "1,10,100");
    let iters = common::env_usize("HEARTH_BENCH_ITERS", 5).to_string();
    let python = common::torch_python();
    if python.is_none() {
        eprintln!("PyTorch not found (bash scripts/setup_pytorch.sh): gloo columns skipped");
    }
    let largest = sizes
        .iter()
        .filter_map(|s| s.parse::<f64>().ok())
        .fold(1.0, f64::max);
    let memcpy = memcpy_gbps(largest);
    println!("# memcpy of {largest} MB, one thread: {memcpy:.2} GB/s");
    for n in &ranks {
        let shm_out = hearth(n, &sizes, &iters, true);
        println!("# Hearth, shared memory, {n} ranks");
        print!("{shm_out}");
        let quic_out = hearth(n, &sizes, &iters, false);
        println!("# Hearth, QUIC only (HEARTH_SHM=0), {n} ranks");
        print!("{quic_out}");
        let (shm, quic) = (parse(&shm_out), parse(&quic_out));
        let gloo = match &python {
            Some(py) => {
                let out = Command::new(py)
                    .arg(concat!(
                        env!("CARGO_MANIFEST_DIR"),
                        "/benches/peer/gloo_allreduce.py"
                    ))
                    .args(["--ranks", n, "--iters", &iters, "--size-mb"])
                    .args(&sizes)
                    .output()
                    .expect("running the gloo peer");
                let gloo_out = String::from_utf8_lossy(&out.stdout).to_string();
                println!("# torch.distributed gloo, {n} ranks");
                print!("{gloo_out}");
                parse(&gloo_out)
            }
            None => BTreeMap::new(),
        };
        let ranks_f: f64 = n.parse().unwrap_or(2.0);
        let busbw = |size: &str, ms: f64| {
            size.parse::<f64>().unwrap_or(0.0) * 1e6 / (ms / 1e3) / 1e9 * 2.0 * (ranks_f - 1.0)
                / ranks_f
        };
        for (size, s_ms) in &shm {
            let q = quic.get(size).copied().unwrap_or(f64::NAN);
            let g = gloo.get(size).copied().unwrap_or(f64::NAN);
            println!(
                "ranks={n} size_mb={size} shm_ms={s_ms:.2} shm_busbw={:.2} quic_ms={q:.2} \
                 gloo_ms={g:.2} gloo_busbw={:.2} shm_vs_gloo={:.2}x shm_vs_memcpy={:.2}x",
                busbw(size, *s_ms),
                busbw(size, g),
                g / s_ms,
                busbw(size, *s_ms) / memcpy
            );
        }
    }
}
