//! Distributed runs through the `hearth` binary: `train --nproc 2`, and `launch` stopping a job
//! when a rank fails or dies mid-collective. Every child has a deadline.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn hearth() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hearth"));
    c.env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_JOB_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Runs `cmd`, killing it after `limit`.
fn run(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let mut child = cmd.spawn().expect("spawn hearth");
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            _ if started.elapsed() > limit => {
                let _ = child.kill();
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    let out = child.wait_with_output().expect("output");
    (out, started.elapsed())
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `hearth train --data DATA --run-dir RUN --batch-size 8 --workers 1 ARGS`, which must
/// succeed within 300 s; its output.
fn train(data: &Path, run_dir: &Path, args: &[&str]) -> String {
    let mut cmd = hearth();
    cmd.args(["train", "--batch-size", "8", "--workers", "1"])
        .args(args)
        .arg("--data")
        .arg(data)
        .arg("--run-dir")
        .arg(run_dir);
    let (out, _) = run(cmd, Duration::from_secs(300));
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    log
}

#[test]
fn train_nproc_2_averages_metrics_and_keeps_per_rank_curves() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    hearth_datasets_synth(&data);
    let run_dir = dir.path().join("run");
    let log = train(
        &data,
        &run_dir,
        &[
            "--nproc",
            "2",
            "--epochs",
            "2",
            // Accumulation with warmup over epoch 1: the schedule must count optimizer steps.
            "--grad-accum",
            "2",
            "--schedule",
            "constant",
            "--warmup-epochs",
            "1",
        ],
    );
    assert!(log.contains("[rank 1] rank 1 of 2: device flex"), "{log}");
    assert!(
        log.contains("[rank 0] trained on 2 ranks, global batch 8 (4 per rank)"),
        "{log}"
    );
    assert!(log.contains("validation accuracy"), "{log}");
    let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    for col in [
        "train_accuracy",
        "train_accuracy_rank0",
        "train_accuracy_rank1",
        "val_accuracy",
    ] {
        assert!(header.contains(&col), "{col} missing: {header:?}");
    }
    // The averaged training accuracy is the mean of the two ranks' values.
    let row = csv_row(&csv, 1);
    let col = |name: &str| row[header.iter().position(|c| *c == name).unwrap()];
    let mean = (col("train_accuracy_rank0") + col("train_accuracy_rank1")) / 2.0;
    assert!((col("train_accuracy") - mean).abs() < 1e-3, "{csv}");
    // Epoch 2 trains at the base rate: warmup ended with epoch 1's last optimizer step.
    let row2 = csv_row(&csv, 2);
    let lr2 = row2[header.iter().position(|c| *c == "train_lr").unwrap()];
    assert!((lr2 - 0.05).abs() < 1e-6, "epoch 2 lr {lr2}:\n{csv}");
    assert!(run_dir.join("checkpoint/model-2.bpk").is_file());
    // Each rank validated its part of the 15 validation images (8 and 7: no padding); the
    // sample-weighted accuracy the run reports is the exported model's on the whole set.
    let best: usize = log
        .lines()
        .find_map(|l| {
            l.split("best epoch: ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .expect("a best epoch line");
    let best_row = csv_row(&csv, best);
    let reported = best_row[header.iter().position(|c| *c == "val_accuracy").unwrap()];
    let recomputed = common::folder_accuracy(&run_dir.join("model.bpk"), &data.join("val"), 32);
    assert!(
        (reported - recomputed).abs() < 1e-3,
        "reported {reported}% vs recomputed {recomputed}%"
    );
}

#[test]
fn half_a_launcher_environment_is_an_error_naming_the_variables() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = hearth();
    cmd.env("RANK", "1")
        .env_remove("WORLD_SIZE")
        .args(["train", "--epochs", "1", "--run-dir"])
        .arg(dir.path().join("run"));
    let (out, _) = run(cmd, Duration::from_secs(60));
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("RANK") && log.contains("WORLD_SIZE"), "{log}");
    assert!(
        !dir.path().join("run/metrics.csv").exists(),
        "it trained anyway"
    );
}

/// Row `n` (1: the first epoch) of a metrics.csv text, as numbers.
#[test]
fn more_ranks_than_validation_images_leave_the_empty_shard_out_of_the_average() {
    // 3 validation images over 4 ranks: rank 3 validates none. Its empty epoch must weigh
    // nothing (it used to turn the job's validation metrics into NaN and fail the run).
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    hearth::datasets::synth::generate(
        &data,
        &hearth::datasets::synth::SynthConfig::new(3, 8, 32)
            .with_seed(2)
            .with_val(1),
    )
    .unwrap();
    let run_dir = dir.path().join("run");
    train(&data, &run_dir, &["--nproc", "4", "--epochs", "1"]);
    let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let row = csv_row(&csv, 1);
    let col = |name: &str| row[header.iter().position(|c| *c == name).unwrap()];
    assert!(col("val_loss").is_finite(), "{csv}");
    // Each of the 3 images counted once: the exported model's accuracy on the folder.
    let recomputed = common::folder_accuracy(&run_dir.join("model.bpk"), &data.join("val"), 32);
    assert!(
        (col("val_accuracy") - recomputed).abs() < 1e-3,
        "reported {}% vs recomputed {recomputed}%",
        col("val_accuracy")
    );
}

fn csv_row(csv: &str, n: usize) -> Vec<f64> {
    csv.lines()
        .nth(n)
        .unwrap()
        .split(',')
        .map(|c| c.parse().unwrap_or(f64::NAN))
        .collect()
}

fn hearth_datasets_synth(dir: &Path) {
    hearth::datasets::synth::generate(
        dir,
        &hearth::datasets::synth::SynthConfig::new(3, 16, 32)
            .with_seed(1)
            .with_val(5),
    )
    .unwrap();
}

#[test]
fn launch_stops_every_rank_and_fails_when_one_rank_fails() {
    let mut cmd = hearth();
    cmd.args(["launch", "-n", "3", "--", "sh", "-c"])
        .arg("echo hello from $HEARTH_RANK of $HEARTH_WORLD_SIZE; if [ \"$HEARTH_RANK\" = 1 ]; then sleep 1; exit 7; fi; sleep 60");
    let (out, took) = run(cmd, Duration::from_secs(60));
    let log = text(&out);
    assert_eq!(out.status.code(), Some(7), "{log}");
    assert!(
        took < Duration::from_secs(30),
        "the other ranks were not stopped ({took:?})"
    );
    assert!(log.contains("[rank 2] hello from 2 of 3"), "{log}");
    assert!(log.contains("rank 1 failed"), "{log}");
}

#[test]
fn a_rank_killed_mid_collective_fails_the_job_naming_it() {
    // Rank 1 is killed (SIGKILL) two seconds into a long series of allreduces; the launcher sees
    // it die and stops rank 0 (burn-dist's own tests cover the survivors noticing by themselves).
    let script = format!(
        "if [ \"$HEARTH_RANK\" = 1 ]; then (sleep 2; kill -9 $$) & fi; exec {} bench allreduce-rank --size-mb 4 --iters 100000 --warmup 0",
        env!("CARGO_BIN_EXE_hearth")
    );
    let mut cmd = hearth();
    cmd.args(["launch", "-n", "2", "--", "sh", "-c", &script]);
    let (out, took) = run(cmd, Duration::from_secs(90));
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    // The launcher's own verdict, not the `[rank 1]` prefix of any line rank 1 printed.
    assert!(
        log.contains("error: rank 1 was killed by a signal"),
        "{log}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{log}");
}

#[test]
fn bench_allreduce_prints_every_size_and_the_hosts_memory_ceiling() {
    let mut cmd = hearth();
    cmd.args([
        "bench",
        "allreduce",
        "--ranks",
        "2",
        "--size-mb",
        "1",
        "4",
        "--iters",
        "3",
        "--warmup",
        "1",
    ]);
    let (out, _) = run(cmd, Duration::from_secs(90));
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    // A field's value on the line of `size_mb=S` that has it.
    let field = |size: &str, key: &str| -> f64 {
        log.lines()
            .filter(|l| l.contains(&format!("size_mb={size} ")))
            .find_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{key}=")))
            })
            .and_then(|v| v.trim_end_matches('x').parse().ok())
            .unwrap_or_else(|| panic!("no {key} for size {size}:\n{log}"))
    };
    assert!(log.contains("this host's memory: memcpy_GBps="), "{log}");
    for size in ["1", "4"] {
        let (busbw, floor, ceiling) = (
            field(size, "busbw_GBps"),
            field(size, "floor_ms"),
            field(size, "ceiling_busbw_GBps"),
        );
        assert!(busbw > 0.0 && floor > 0.0 && ceiling > 0.0, "{log}");
        // The ceiling is the floor's time as busbw: 2(n-1)/n * bytes / time, n = 2.
        let mb: f64 = size.parse().unwrap();
        // Both printed to 4 decimals: the floor's rounding moves `want` by up to 0.00005/floor.
        let want = mb * 1e6 / (floor / 1e3) / 1e9;
        assert!(
            (ceiling - want).abs() <= want * (0.0001 / floor + 1e-6) + 0.0001,
            "{size}: {ceiling} vs {want}\n{log}"
        );
    }
}

#[test]
fn bench_allreduce_on_shared_buffers_sums_in_place_checks_the_sum_and_leaves_no_file() {
    // Files of shared buffers in /dev/shm: only this test of this binary makes any.
    let buffers = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("hearth-") && n.contains("-buffer"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = buffers();
    let mut cmd = hearth();
    cmd.args([
        "bench",
        "allreduce",
        "--ranks",
        "3",
        "--size-mb",
        "1",
        "--iters",
        "3",
        "--buffer",
        "shared",
    ]);
    let (out, _) = run(cmd, Duration::from_secs(90));
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("summed in place"), "{log}");
    assert!(
        log.lines()
            .any(|l| l.starts_with("size_mb=1 ") && l.contains("busbw_GBps=")),
        "{log}"
    );
    let left: Vec<String> = buffers()
        .into_iter()
        .filter(|f| !before.contains(f))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn killing_the_launcher_kills_its_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let mut cmd = hearth();
    cmd.args(["launch", "-n", "2", "--", "sh", "-c"])
        .arg(format!("echo $$ >> {}; exec sleep 60", pids.display()));
    let mut launcher = cmd.spawn().unwrap();
    let started = Instant::now();
    let ranks: Vec<i32> = loop {
        let text = std::fs::read_to_string(&pids).unwrap_or_default();
        let v: Vec<i32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if v.len() == 2 {
            break v;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    launcher.kill().unwrap();
    let _ = launcher.wait();
    let gone = |pid: i32| {
        !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z "))
    };
    let until = Instant::now() + Duration::from_secs(10);
    while !ranks.iter().all(|&p| gone(p)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        ranks.iter().all(|&p| gone(p)),
        "ranks {ranks:?} outlived their launcher"
    );
}

/// Data-parallel gradients on a cubecl device (Vulkan on the CPU; CI installs lavapipe): each
/// bucket is packed and scaled on the device, read as one buffer, and split there again. Two
/// ranks as threads over the in-memory transport must end with the mean of their gradients,
/// computed here on the CPU, for one bucket per tensor, several tensors per bucket, and one
/// bucket for all. On a machine whose Mesa shader cache is empty, lavapipe first compiles every
/// autotune candidate through LLVM (about 3 minutes here): hence the long deadlines.
#[cfg(feature = "wgpu")]
#[test]
fn gradient_buckets_pack_on_a_cubecl_device() {
    use std::sync::Arc;

    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::prelude::*;
    use hearth::device::DeviceChoice;
    use hearth::dist::ddp::{allreduce_grads, module_values, with_module_values};
    use hearth::dist::transport::memory::MemoryTransport;
    use hearth::dist::{Communicator, Transport};

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }
    fn net(device: &Device, values: Vec<Vec<f32>>) -> Net {
        let n = Net {
            a: LinearConfig::new(5, 7).init(device),
            b: LinearConfig::new(7, 3).init(device),
        };
        with_module_values(n, values).unwrap()
    }
    // Each rank's gradients for its own batch, as flat vectors in the module's order.
    fn grads_of(device: &Device, values: &[Vec<f32>], rank: usize) -> (Net, GradientsParams) {
        let model = net(device, values.to_vec());
        let x: Vec<f32> = (0..4 * 5)
            .map(|i| ((i * 7 + rank * 13) % 11) as f32 / 5.0 - 1.0)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [4, 5]), device);
        let loss = model.b.forward(model.a.forward(x)).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (model, grads)
    }
    fn flat(model: &Net, grads: &GradientsParams) -> Vec<f32> {
        let data = |d: Option<TensorData>| {
            d.expect("a gradient for every parameter")
                .try_to_vec::<f32>()
                .unwrap()
        };
        let mut out = Vec::new();
        for layer in [&model.a, &model.b] {
            out.extend(data(grads.get::<2>(layer.weight.id).map(|t| t.into_data())));
            let bias = layer.bias.as_ref().expect("a bias").id;
            out.extend(data(grads.get::<1>(bias).map(|t| t.into_data())));
        }
        out
    }

    let Some(gpu) = common::device_or_skip(
        DeviceChoice::VulkanCpu,
        "gradient_buckets_pack_on_a_cubecl_device",
    ) else {
        return;
    };
    let cpu = Device::flex().autodiff();
    let values = module_values(&Net {
        a: LinearConfig::new(5, 7).init(&Device::flex()),
        b: LinearConfig::new(7, 3).init(&Device::flex()),
    });
    let expected: Vec<f32> = {
        let (m0, g0) = grads_of(&cpu, &values, 0);
        let (m1, g1) = grads_of(&cpu, &values, 1);
        flat(&m0, &g0)
            .iter()
            .zip(flat(&m1, &g1))
            .map(|(a, b)| (a + b) / 2.0)
            .collect()
    };
    // 16 bytes: a bucket per tensor; 160: the biases share with their neighbours; 1 MiB: one.
    for bucket_bytes in [16usize, 160, 1 << 20] {
        let (tx, rx) = std::sync::mpsc::channel();
        for t in MemoryTransport::mesh(2) {
            let (tx, gpu, values) = (tx.clone(), gpu.clone().autodiff(), values.clone());
            std::thread::spawn(move || {
                let rank = t.rank();
                let comm = Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(600));
                let (model, mut grads) = grads_of(&gpu, &values, rank);
                let result = allreduce_grads(&model, &mut grads, &comm, bucket_bytes)
                    .map(|()| flat(&model, &grads));
                let _ = tx.send((rank, result));
            });
        }
        for _ in 0..2 {
            let (rank, got) = rx
                .recv_timeout(Duration::from_secs(900))
                .expect("both ranks finish within 900 s");
            let got = got.unwrap_or_else(|e| panic!("rank {rank}, {bucket_bytes} B buckets: {e}"));
            assert_eq!(got.len(), expected.len());
            let diff = common::max_abs_diff(&got, &expected);
            assert!(
                diff < 1e-5,
                "rank {rank}, {bucket_bytes} B buckets: max |diff| {diff:e} against the CPU mean"
            );
        }
    }
}
