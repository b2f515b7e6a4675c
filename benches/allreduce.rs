//! Ring allreduce over QUIC (Hearth, `hearth bench allreduce`) against torch.distributed's gloo
//! backend, same ranks and sizes, same run, on loopback:
//!
//!   cargo bench --bench allreduce
//!   HEARTH_BENCH_RANKS=2,4 HEARTH_BENCH_SIZES=1,10,100 HEARTH_BENCH_ITERS=5 cargo bench --bench allreduce
//!
//! Prints both tools' lines and the time ratio gloo/Hearth per size (above 1: Hearth faster).

mod common;

use std::collections::BTreeMap;
use std::process::Command;

fn list(key: &str, default: &str) -> Vec<String> {
    std::env::var(key)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

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

fn main() {
    let ranks = list("HEARTH_BENCH_RANKS", "2,4");
    let sizes = list("HEARTH_BENCH_SIZES", "1,10,100");
    let iters = common::env_usize("HEARTH_BENCH_ITERS", 5).to_string();
    let python = common::torch_python();
    if python.is_none() {
        eprintln!("PyTorch not found (bash scripts/setup_pytorch.sh): gloo columns skipped");
    }
    for n in &ranks {
        let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args([
                "bench",
                "allreduce",
                "--ranks",
                n,
                "--iters",
                &iters,
                "--size-mb",
            ])
            .args(&sizes)
            .output()
            .expect("running hearth bench allreduce");
        let hearth_out = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&out.stderr));
            panic!("hearth bench allreduce failed");
        }
        println!("# Hearth (QUIC, TLS), {n} ranks");
        print!("{hearth_out}");
        let hearth = parse(&hearth_out);
        let Some(py) = &python else { continue };
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
        let gloo = parse(&gloo_out);
        for (size, h) in &hearth {
            // gloo prints integers without a decimal point, Hearth too: same keys.
            if let Some(g) = gloo.get(size) {
                println!(
                    "ranks={n} size_mb={size} hearth_ms={h:.2} gloo_ms={g:.2} speedup_vs_gloo={:.2}x",
                    g / h
                );
            }
        }
    }
}
