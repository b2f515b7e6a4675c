//! The automatic augmentations' operations one by one, Hearth vs torchvision in the same run.
//!
//! Each of the 14 operations of RandAugment, TrivialAugmentWide and AugMix at RandAugment's
//! magnitude bin 9 (torchvision's default), positive sign, on a noisy 224 x 224 RGB image:
//! microseconds per call, one thread, Hearth's `Op::apply` (which takes the image, so a copy of
//! it is in each call: the Identity row) against torchvision's `_apply_op` on the PIL image its
//! `ImageFolder` yields (`benches/peer/torch_augment_ops.py`; `HEARTH_BENCH_PEER_BACKEND=tensor`
//! for a uint8 tensor). `HEARTH_BENCH_ROUNDS` rounds (default 3) of Hearth then the peer; the
//! figures are the medians of the rounds.
//!
//!   cargo bench -p hearth-cli --bench augment_ops
//!   HEARTH_BENCH_ROUNDS=5 HEARTH_BENCH_STEPS=400 cargo bench -p hearth-cli --bench augment_ops

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use common::{cpu, env_usize, median, peer_script, torch_python};

use hearth::datasets::AutoAugment;
use hearth::datasets::autoaugment::{OPS, Op};
use image::RgbImage;

fn main() {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let size = env_usize("HEARTH_BENCH_IMAGE", if smoke { 32 } else { 224 }) as u32;
    let iters = env_usize("HEARTH_BENCH_STEPS", if smoke { 3 } else { 200 }).max(1);
    let rounds = env_usize("HEARTH_BENCH_ROUNDS", if smoke { 1 } else { 3 }).max(1);
    let backend = std::env::var("HEARTH_BENCH_PEER_BACKEND").unwrap_or_else(|_| "pil".into());
    // A noisy image, the same every run.
    let mut state = 7u64;
    let raw = (0..size * size * 3)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect();
    let Some(img) = RgbImage::from_raw(size, size, raw) else {
        eprintln!("bench: no {size} x {size} image");
        std::process::exit(1);
    };
    // RandAugment's magnitude bin 9, positive.
    let policy = AutoAugment::RandAugment {
        ops: 2,
        magnitude: 9,
    };
    let ops: Vec<(&str, f64, Op)> = OPS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let (table, _) = policy.space(i, size, size);
            let m = table.get(9).copied().unwrap_or(0.0);
            (*name, m, Op::at(i, m))
        })
        .collect();
    let python = if smoke { None } else { torch_python() };
    println!(
        "augmentation operations on {}: {size} x {size}, {iters} calls per operation, {rounds} round(s), peer torchvision ({backend})",
        cpu()
    );
    let mut hearth: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut peer: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        for &(name, _, op) in &ops {
            let mut keep = 0u64;
            let started = Instant::now();
            for _ in 0..iters {
                keep += u64::from(op.apply(img.clone()).as_raw()[0]);
            }
            let us = started.elapsed().as_secs_f64() / iters as f64 * 1e6;
            std::hint::black_box(keep);
            hearth.entry(name).or_default().push(us);
        }
        if let Some(python) = &python {
            let list: Vec<String> = ops.iter().map(|(n, m, _)| format!("{n}:{m}")).collect();
            let out = Command::new(python)
                .arg(peer_script("torch_augment_ops.py"))
                .args(["--size", &size.to_string(), "--iters", &iters.to_string()])
                .args(["--backend", &backend, "--ops", &list.join(",")])
                .output();
            match out {
                Ok(o) if o.status.success() => {
                    for line in String::from_utf8_lossy(&o.stdout).lines() {
                        let mut name = None;
                        let mut us = None;
                        for w in line.split_whitespace() {
                            if let Some(n) = w.strip_prefix("op=") {
                                name = Some(n.to_string());
                            } else if let Some(v) = w.strip_prefix("us=") {
                                us = v.parse::<f64>().ok();
                            }
                        }
                        if let (Some(n), Some(us)) = (name, us) {
                            peer.entry(n).or_default().push(us);
                        }
                    }
                }
                Ok(o) => println!("peer failed: {}", String::from_utf8_lossy(&o.stderr).trim()),
                Err(e) => println!("peer failed to start: {e}"),
            }
        }
    }
    println!(
        "{:<14} {:>10} {:>12} {:>14} {:>8}",
        "operation", "magnitude", "hearth us", "torchvision us", "ratio"
    );
    let (mut sum_h, mut sum_p) = (0.0, 0.0);
    for &(name, m, _) in &ops {
        let h = median(hearth.get(name).into_iter().flatten().copied());
        let p = median(peer.get(name).into_iter().flatten().copied());
        sum_h += h;
        sum_p += p;
        let (p_text, ratio) = if p.is_finite() {
            (format!("{p:.1}"), format!("{:.2}x", p / h))
        } else {
            ("-".into(), "-".into())
        };
        println!("{name:<14} {m:>10.3} {h:>12.1} {p_text:>14} {ratio:>8}");
    }
    let n = ops.len() as f64;
    println!(
        "{:<14} {:>10} {:>12.1} {:>14} {:>8}",
        "mean",
        "",
        sum_h / n,
        if sum_p.is_finite() {
            format!("{:.1}", sum_p / n)
        } else {
            "-".into()
        },
        if sum_p.is_finite() {
            format!("{:.2}x", sum_p / sum_h)
        } else {
            "-".into()
        }
    );
    println!("(ratio: torchvision's time over Hearth's; above 1, Hearth is faster)");
}
