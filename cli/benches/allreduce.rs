//! Allreduce on one host: Hearth (`hearth bench allreduce`) with shared memory between the ranks
//! (the default), on each rank's own vector and on buffers from `Communicator::reduce_buffer`
//! (`--buffer shared`: mapped by every rank, summed in place), and without shared memory
//! (`HEARTH_SHM=0`: QUIC on loopback), against torch.distributed's
//! gloo backend, same ranks and sizes, same run; a single-thread memcpy of the largest size
//! measured in this process, the bandwidth anchor; and the memory floor of that size: as many
//! threads as ranks, each reading and writing its own buffer once, all at once (the bytes any
//! allreduce must move on this host: every rank's values in, the sum out):
//!
//!   cargo bench --bench allreduce
//!   HEARTH_BENCH_RANKS=2,4 HEARTH_BENCH_SIZES=1,10,100 HEARTH_BENCH_ITERS=5 cargo bench --bench allreduce
//!
//! `HEARTH_BENCH_ROUNDS` (default 3) rounds, each running memcpy, Hearth and gloo one after the
//! other, so a machine whose speed drifts shows it in every column; `HEARTH_BENCH_QUIC=0` skips
//! the QUIC-only run (it runs in the first round). Prints every tool's lines, then per size
//! the busbw of each and the ratios per round, as their median and range, a line per buffer
//! (`buffer=own`, `buffer=shared`): shared memory against gloo (above 1: Hearth faster), against memcpy, and for the largest size the floor's
//! time against Hearth's (1: at the floor) and the most any allreduce could reach against
//! memcpy (`ceiling_vs_memcpy`, the floor's busbw over memcpy's).

mod common;

use std::collections::BTreeMap;
use std::process::Command;

/// Runs `hearth bench allreduce` for `n` ranks, with shared memory or QUIC only, on each rank's
/// own vector or on shared buffers.
fn hearth(n: &str, sizes: &[String], iters: &str, shm: bool, shared: bool) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args([
            "bench",
            "allreduce",
            "--ranks",
            n,
            "--iters",
            iters,
            "--buffer",
            if shared { "shared" } else { "own" },
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

/// One round's measures of one size.
struct Round {
    /// Hearth's time on each rank's own vector, then on shared buffers.
    shm_ms: [f64; 2],
    gloo_ms: f64,
    memcpy_gbps: f64,
    /// The memory floor of the largest size.
    floor_ms: f64,
}

/// Median and range of `v` (empty: NaN).
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let finite = || v.iter().copied().filter(|x| x.is_finite());
    (
        common::median(finite()),
        finite().reduce(f64::min).unwrap_or(f64::NAN),
        finite().reduce(f64::max).unwrap_or(f64::NAN),
    )
}

fn main() {
    let ranks = common::env_list("HEARTH_BENCH_RANKS", "2,4");
    let sizes = common::env_list("HEARTH_BENCH_SIZES", "1,10,100");
    let iters = common::env_usize("HEARTH_BENCH_ITERS", 5).to_string();
    let rounds = common::env_usize("HEARTH_BENCH_ROUNDS", 3).max(1);
    let quic_too = std::env::var("HEARTH_BENCH_QUIC").map_or(true, |v| v != "0");
    let python = common::torch_python();
    if python.is_none() {
        eprintln!("PyTorch not found (bash scripts/setup_pytorch.sh): gloo columns skipped");
    }
    let largest = sizes
        .iter()
        .filter_map(|s| s.parse::<f64>().ok())
        .fold(1.0, f64::max);
    println!(
        "# {rounds} rounds, each: memcpy of {largest} MB (one thread), Hearth shared memory \
         (own vectors, then shared buffers), {}gloo; ratios per round, then their median and range",
        if quic_too {
            "Hearth QUIC only (first round), "
        } else {
            ""
        }
    );
    for n in &ranks {
        let ranks_f: f64 = n.parse().unwrap_or(2.0);
        let busbw = |size: &str, ms: f64| {
            size.parse::<f64>().unwrap_or(0.0) * 1e6 / (ms / 1e3) / 1e9 * 2.0 * (ranks_f - 1.0)
                / ranks_f
        };
        let mut per_size: BTreeMap<String, Vec<Round>> = BTreeMap::new();
        let mut quic = BTreeMap::new();
        for round in 0..rounds {
            let memcpy = hearth_cli::bench::dist::memcpy_gbps(largest);
            let floor = hearth_cli::bench::dist::floor_ms(n.parse().unwrap_or(2), largest);
            println!(
                "# round {}: memcpy {memcpy:.2} GB/s; floor of {largest} MB over {n} ranks \
                 {floor:.2} ms",
                round + 1
            );
            let shm_out = hearth(n, &sizes, &iters, true, false);
            println!("# Hearth, shared memory, own vectors, {n} ranks");
            print!("{shm_out}");
            let shared_out = hearth(n, &sizes, &iters, true, true);
            println!("# Hearth, shared memory, shared buffers (--buffer shared), {n} ranks");
            print!("{shared_out}");
            let shared_times = common::parse_times(&shared_out);
            if quic_too && round == 0 {
                let quic_out = hearth(n, &sizes, &iters, false, false);
                println!("# Hearth, QUIC only (HEARTH_SHM=0), {n} ranks");
                print!("{quic_out}");
                quic = common::parse_times(&quic_out);
            }
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
                    common::parse_times(&gloo_out)
                }
                None => BTreeMap::new(),
            };
            for (size, s_ms) in common::parse_times(&shm_out) {
                let g = gloo.get(&size).copied().unwrap_or(f64::NAN);
                let sh = shared_times.get(&size).copied().unwrap_or(f64::NAN);
                per_size.entry(size).or_default().push(Round {
                    shm_ms: [s_ms, sh],
                    gloo_ms: g,
                    memcpy_gbps: memcpy,
                    floor_ms: floor,
                });
            }
        }
        for (size, runs) in &per_size {
            for (which, buffer) in ["own", "shared"].iter().enumerate() {
                let shm_ms: Vec<f64> = runs.iter().map(|r| r.shm_ms[which]).collect();
                let gloo_ms: Vec<f64> = runs.iter().map(|r| r.gloo_ms).collect();
                let vs_gloo: Vec<f64> = runs.iter().map(|r| r.gloo_ms / r.shm_ms[which]).collect();
                let vs_memcpy: Vec<f64> = runs
                    .iter()
                    .map(|r| busbw(size, r.shm_ms[which]) / r.memcpy_gbps)
                    .collect();
                let (s, _, _) = spread(&shm_ms);
                let (g, _, _) = spread(&gloo_ms);
                let (vg, vg_lo, vg_hi) = spread(&vs_gloo);
                let (vm, vm_lo, vm_hi) = spread(&vs_memcpy);
                let q = quic.get(size).copied().unwrap_or(f64::NAN);
                let floor = if size.parse::<f64>().ok() == Some(largest) {
                    let vs_floor: Vec<f64> =
                        runs.iter().map(|r| r.floor_ms / r.shm_ms[which]).collect();
                    let ceiling: Vec<f64> = runs
                        .iter()
                        .map(|r| busbw(size, r.floor_ms) / r.memcpy_gbps)
                        .collect();
                    let (f, _, _) = spread(&runs.iter().map(|r| r.floor_ms).collect::<Vec<_>>());
                    let (vf, vf_lo, vf_hi) = spread(&vs_floor);
                    let (c, c_lo, c_hi) = spread(&ceiling);
                    format!(
                        " floor_ms={f:.2} shm_vs_floor={vf:.2}x ({vf_lo:.2}-{vf_hi:.2}) \
                         ceiling_vs_memcpy={c:.2}x ({c_lo:.2}-{c_hi:.2})"
                    )
                } else {
                    String::new()
                };
                println!(
                    "ranks={n} size_mb={size} buffer={buffer} shm_ms={s:.2} shm_busbw={:.2} \
                     quic_ms={q:.2} gloo_ms={g:.2} gloo_busbw={:.2} shm_vs_gloo={vg:.2}x \
                     ({vg_lo:.2}-{vg_hi:.2}) shm_vs_memcpy={vm:.2}x ({vm_lo:.2}-{vm_hi:.2}){floor}",
                    busbw(size, s),
                    busbw(size, g),
                );
            }
        }
    }
}
