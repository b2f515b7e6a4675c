//! Helpers shared by the integration tests (included with `mod common;`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::prelude::*;
use hearth::device::DeviceChoice;
use hearth::models::{BlockKind, DenseNetConfig, ModelConfig, ResNetConfig, VggConfig, VggLayer};

// The ranks of one `hearth train` job as child processes (`Job`), in a file of its own.
#[path = "common/job.rs"]
mod job;
#[allow(unused_imports)] // not every test starts a job
pub use job::{Job, USUAL};

/// The parity fixture `name`: in the checkout the test was built in, or, for a test binary
/// carried to another machine (`scripts/gpu_check.sh`), in the checkout it runs from.
pub fn fixture(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parity");
    let dir = if built.is_dir() {
        built
    } else {
        PathBuf::from("cli/tests/fixtures/parity")
    };
    dir.join(name)
}

/// The configurations of the fixtures written by scripts/make_parity_fixtures.py.
pub fn fixture_config(name: &str) -> ModelConfig {
    use VggLayer::{Conv, Pool};
    match name {
        "resnet_basic" => ModelConfig::ResNet(
            ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], 10)
                .with_stem_width(16)
                .with_stage_widths([16, 32, 64, 128]),
        ),
        "resnet_bottleneck" => ModelConfig::ResNet(
            ResNetConfig::new(BlockKind::Bottleneck, [2, 1, 1, 1], 7)
                .with_stem_width(16)
                .with_stage_widths([8, 16, 32, 64]),
        ),
        "densenet" => ModelConfig::DenseNet(DenseNetConfig::new(8, vec![2, 2, 2, 2], 16, 5)),
        "vgg_bn" => ModelConfig::Vgg(
            VggConfig::new(
                vec![Conv(8), Pool, Conv(16), Pool, Conv(32), Conv(32), Pool],
                true,
                6,
            )
            .with_hidden(16),
        ),
        "vgg" => ModelConfig::Vgg(
            VggConfig::new(
                vec![
                    Conv(8),
                    Pool,
                    Conv(16),
                    Pool,
                    Conv(16),
                    Pool,
                    Conv(32),
                    Pool,
                    Conv(32),
                    Pool,
                ],
                false,
                4,
            )
            .with_hidden(16),
        ),
        other => panic!("no fixture {other}"),
    }
}

/// Whether a test may skip for want of `what` (`vulkan`, `launchers`, `netns`): only where
/// `HEARTH_ALLOW_SKIP` names it (comma-separated, or `all`). Otherwise a missing prerequisite
/// fails the test, as it fails in CI (which installs them all), so that a suite that passes
/// here passes there.
pub fn may_skip(what: &str) -> bool {
    std::env::var("HEARTH_ALLOW_SKIP")
        .is_ok_and(|v| v.split(',').any(|s| s.trim() == what || s.trim() == "all"))
}

/// The device, or `None` with a visible note when this machine lacks it and
/// `HEARTH_ALLOW_SKIP=vulkan` allows that; a failure otherwise (`.ci/run` installs lavapipe).
pub fn device_or_skip(choice: DeviceChoice, test: &str) -> Option<Device> {
    match choice.device() {
        Ok(d) => Some(d),
        Err(e) => {
            if !may_skip("vulkan") {
                panic!(
                    "{test}: device {choice} unavailable: {e}; install mesa-vulkan-drivers (as \
                     .ci/run does), or set HEARTH_ALLOW_SKIP=vulkan to skip it"
                );
            }
            eprintln!(
                "SKIPPED {test}: device {choice} unavailable here ({e}); HEARTH_ALLOW_SKIP=vulkan"
            );
            None
        }
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A port on 127.0.0.1 for a job's coordinator, free for UDP and TCP when chosen. Below the
/// kernel's ephemeral range (32768-60999 here), so no socket bound to port 0 (every QUIC
/// endpoint of the jobs running beside this one) can take it between this choice and rank 0's
/// bind: a port asked of the kernel and released was once handed to another test's endpoint in
/// between ("Address already in use", the whole job lost). Each test process starts at its own
/// offset and walks a counter; the bind check skips ports another process holds.
pub fn coordinator_port() -> u16 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let base = 20_000 + (std::process::id() as usize * 61) % 12_000;
    for _ in 0..12_000 {
        let port = (20_000 + (base - 20_000 + NEXT.fetch_add(1, Ordering::SeqCst)) % 12_000) as u16;
        let udp = std::net::UdpSocket::bind(("127.0.0.1", port));
        let tcp = std::net::TcpListener::bind(("127.0.0.1", port));
        if udp.is_ok() && tcp.is_ok() {
            return port;
        }
    }
    panic!("no free port in 20000-31999 on 127.0.0.1")
}

/// The largest difference between the logits two Hearth model files give over a folder's
/// images (two runs that should have exported the same model).
pub fn exported_logit_gap(
    a: &std::path::Path,
    b: &std::path::Path,
    folder: &std::path::Path,
    size: u32,
) -> f32 {
    max_abs_diff(
        &folder_logits(a, folder, size),
        &folder_logits(b, folder, size),
    )
}

/// Each batch of a Hearth model file's logits over an image folder (in the folder's order, with
/// the evaluation preprocessing at `size` pixels) and the batch's true classes.
fn folder_batches(
    model: &std::path::Path,
    folder: &std::path::Path,
    size: u32,
) -> Vec<(Tensor<2>, Vec<i64>)> {
    use hearth::datasets::{ImageSet, Loader, LoaderConfig, Pipeline};
    let saved = hearth::models::load_model(model, &Device::flex()).unwrap();
    let set = ImageSet::from_folder(folder).unwrap();
    let loader = Loader::new(
        set,
        Pipeline::eval(size),
        LoaderConfig::new(5).with_shuffle(false),
    )
    .unwrap();
    let model = burn::module::Module::valid(&saved.model);
    loader
        .epoch(0, &Device::flex())
        .map(|batch| {
            let batch = batch.unwrap();
            let truth = batch.classes.unwrap().into_data().iter::<i64>().collect();
            (model.forward(batch.images), truth)
        })
        .collect()
}

/// Accuracy (%) of a Hearth model file on an image folder, with the evaluation preprocessing at
/// `size` pixels: an independent check of what a training run reported.
pub fn folder_accuracy(model: &std::path::Path, folder: &std::path::Path, size: u32) -> f64 {
    let (mut right, mut total) = (0usize, 0usize);
    for (logits, truth) in folder_batches(model, folder, size) {
        let pred: Vec<i64> = logits
            .argmax(1)
            .flatten::<1>(0, 1)
            .into_data()
            .iter::<i64>()
            .collect();
        right += pred.iter().zip(&truth).filter(|(a, b)| a == b).count();
        total += truth.len();
    }
    100.0 * right as f64 / total as f64
}

/// Every logit of a saved model over a folder's images, in the folder's order.
pub fn folder_logits(model: &std::path::Path, folder: &std::path::Path, size: u32) -> Vec<f32> {
    folder_batches(model, folder, size)
        .into_iter()
        .flat_map(|(logits, _)| logits.into_data().iter::<f32>().collect::<Vec<_>>())
        .collect()
}

/// The elastic tests' data: 4 classes, 60 training and 10 validation images each, 32 pixels
/// (10 steps of 24 an epoch).
pub fn elastic_data(dir: &std::path::Path) -> PathBuf {
    let d = dir.join("data");
    hearth::datasets::synth::generate(
        &d,
        &hearth::datasets::synth::SynthConfig::new(4, 60, 32)
            .with_seed(7)
            .with_val(10),
    )
    .unwrap();
    d
}

/// Waits for `child` until `until`; past it the child is killed and reaped and `None`
/// returned (a hang fails the test instead of CI).
pub fn wait_bounded(
    child: &mut std::process::Child,
    until: std::time::Instant,
) -> Option<std::process::ExitStatus> {
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// An elastic worker's `<id>: final weights <fingerprint> at step N (rank r of w)` line as
/// (id, fingerprint, w); the id is the word before the colon (a launcher's `[w0] ` prefix
/// stays out of it).
pub fn final_weights(line: &str) -> Option<(String, String, usize)> {
    let (head, rest) = line.split_once(": final weights ")?;
    let id = head.rsplit([' ', ']']).next()?.to_string();
    let fp = rest.split_whitespace().next()?.to_string();
    let size = rest
        .rsplit(" of ")
        .next()?
        .trim_end_matches(')')
        .parse()
        .ok()?;
    Some((id, fp, size))
}

/// `hearth train --elastic` options the elastic tests share (after `--data` and `--run-dir`):
/// global batch 24, no warmup, no batch norm or dropout, so weights compare exactly.
pub const ELASTIC_TRAIN: &[&str] = &[
    "--batch-size",
    "24",
    "--lr",
    "0.02",
    "--warmup-epochs",
    "0",
    "--workers",
    "1",
    "--size",
    "32",
    "--augment",
    "none",
    "--model",
    "vgg-mini-plain",
];

/// The small generated image folder the training tests use: 3 classes, 16 training and 6
/// validation images each, 36 pixels.
pub fn small_data(dir: &std::path::Path) -> PathBuf {
    let d = dir.join("data");
    hearth::datasets::synth::generate(
        &d,
        &hearth::datasets::synth::SynthConfig::new(3, 16, 36)
            .with_seed(4)
            .with_val(6),
    )
    .unwrap();
    d
}

/// A quick run on `data` into `run`: 2 epochs, batch 8, no warmup, one decoding thread.
pub fn small_config(data: &std::path::Path, run: PathBuf) -> hearth::train::TrainConfig {
    let mut cfg = hearth::train::TrainConfig::new(run);
    cfg.data.folder = Some(data.to_path_buf());
    cfg.epochs = 2;
    cfg.batch_size = 8;
    cfg.optim.lr = 0.05;
    cfg.optim.warmup_epochs = 0;
    cfg.data.workers = 1;
    cfg
}

/// The largest absolute difference of each tensor of two burnpack files, by name; panics
/// when the two do not hold the same tensors.
pub fn tensor_gaps(a: &std::path::Path, b: &std::path::Path) -> Vec<(String, f32)> {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.len(), b.len(), "tensor sets");
    a.into_iter()
        .zip(b)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            let gap = va
                .iter()
                .zip(&vb)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            (na, gap)
        })
        .collect()
}

/// Every tensor of a burnpack file (checkpoint or model file) as f32 values, by name.
pub fn tensors(path: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let reader = burn::store::burn_pack::Reader::from_file(path).unwrap();
    let mut names: Vec<String> = reader
        .tensor_names()
        .into_iter()
        .map(String::from)
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let bytes = reader.tensor_data(&n).unwrap();
            let v = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (n, v)
        })
        .collect()
}

/// Trains `cfg` until epoch `stop` (as a time limit would end it), then resumes it to the end;
/// the resumed launch's report.
pub fn stop_then_resume(
    cfg: &hearth::train::TrainConfig,
    stop: usize,
) -> hearth::train::TrainReport {
    pin_flex();
    let train = |c: &hearth::train::TrainConfig| {
        hearth::train::train(c, &Device::flex(), &mut |l| eprintln!("{l}")).unwrap()
    };
    let mut first = cfg.clone();
    first.checkpoint.stop_after_epoch = Some(stop);
    train(&first);
    let mut second = cfg.clone();
    second.checkpoint.resume = true;
    train(&second)
}

/// Burn's default device on Flex for this test process, as a program embedding the library sets
/// it (`hearth::device::pin_burn_default`): in-process runs that load optimizer state need it.
pub fn pin_flex() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: the test threads touch the environment only through std, which serializes its
    // reads and writes; none reads it from C while a test runs in process.
    ONCE.call_once(|| unsafe { hearth::device::pin_burn_default(DeviceChoice::Flex) });
}

/// A multi-label CSV (`labels.csv` in `data`) over a generated folder's images: labels a, b, c
/// derived from the class, several per image.
pub fn multi_label_csv(data: &std::path::Path) -> PathBuf {
    let mut names: Vec<String> = std::fs::read_dir(data.join("train"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // class 0 -> a, class 1 -> a|b, class 2 -> c (and b for every other image).
    let mut csv = String::from("path,labels\n");
    for split in ["train", "val"] {
        for (c, name) in names.iter().enumerate() {
            let mut files: Vec<_> = std::fs::read_dir(data.join(split).join(name))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            files.sort();
            for (i, f) in files.iter().enumerate() {
                let labels = match c {
                    0 => "a".to_string(),
                    1 => "a|b".to_string(),
                    _ if i % 2 == 0 => "b|c".to_string(),
                    _ => "c".to_string(),
                };
                csv.push_str(&format!("{split}/{name}/{f},{labels}\n"));
            }
        }
    }
    let path = data.join("labels.csv");
    std::fs::write(&path, csv).unwrap();
    path
}

/// The mean of a run's `auroc.csv` (the exported model's per-class AUROCs over the whole
/// validation set, computed on rank 0 alone), in percent.
pub fn auroc_csv_mean(run: &std::path::Path) -> f64 {
    let text = std::fs::read_to_string(run.join("auroc.csv")).unwrap();
    let values: Vec<f64> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(1)?.parse().ok())
        .collect();
    assert!(!values.is_empty(), "auroc.csv: {text}");
    100.0 * values.iter().sum::<f64>() / values.len() as f64
}

/// `hearth ARGS` outside any job (no launcher variables from the test's environment), its
/// output captured.
pub fn hearth_cli(args: &[&str]) -> std::process::Output {
    hearth_cli_env(args, &[])
}

/// [`hearth_cli`] with environment variables set (`Some`) or removed (`None`).
pub fn hearth_cli_env(args: &[&str], env: &[(&str, Option<&str>)]) -> std::process::Output {
    use std::io::Read;
    use std::process::Stdio;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.args(args)
        .env_remove("HEARTH_RANK")
        .env_remove("HEARTH_WORLD_SIZE")
        .env_remove("HEARTH_COORDINATOR");
    for (name, value) in env {
        match value {
            Some(v) => cmd.env(name, v),
            None => cmd.env_remove(name),
        };
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both pipes drained as the process writes (a full pipe would stall it), and a bound on
    // the whole: a hang fails the test instead of CI.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let limit = std::time::Duration::from_secs(900);
    let started = std::time::Instant::now();
    let status = wait_bounded(&mut child, started + limit)
        .unwrap_or_else(|| panic!("hearth {args:?} ran past {limit:?} and was killed"));
    // Shown with `--nocapture` and beside a failure: where a test's time goes.
    eprintln!(
        "hearth_cli: {:.1} s: hearth {}",
        started.elapsed().as_secs_f64(),
        args.join(" ")
    );
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// `RUN/metrics.csv` as epoch -> column -> value.
pub fn metrics(run: &Path) -> BTreeMap<usize, BTreeMap<String, f64>> {
    let text = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|l| {
            let v: Vec<&str> = l.split(',').collect();
            let epoch = v[0].parse().unwrap();
            let row = header[1..]
                .iter()
                .zip(&v[1..])
                .filter_map(|(k, x)| Some((k.to_string(), x.parse().ok()?)))
                .collect();
            (epoch, row)
        })
        .collect()
}

/// Every tensor of two model files within `tolerance`.
/// The columns of an epoch table that say how a run trained.
pub const CURVES: [&str; 4] = ["train_loss", "train_accuracy", "val_loss", "val_accuracy"];

/// The columns of the epoch tables `a` and `b` (each with its name for the message) agree
/// within `tolerance`, relative to `1 + |b|`, at every epoch.
pub fn same_curves(
    (a_name, a): (&str, &BTreeMap<usize, BTreeMap<String, f64>>),
    (b_name, b): (&str, &BTreeMap<usize, BTreeMap<String, f64>>),
    columns: &[&str],
    tolerance: f64,
) {
    assert_eq!(a.len(), b.len(), "{a_name}: {a:?}\n{b_name}: {b:?}");
    for (epoch, row) in a {
        for &c in columns {
            let (x, y) = (row[c], b[epoch][c]);
            assert!(
                (x - y).abs() <= tolerance * (1.0 + y.abs()),
                "epoch {epoch} {c}: {a_name} {x}, {b_name} {y}"
            );
        }
    }
}

pub fn same_weights(a: &Path, b: &Path, tolerance: f32) {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.len(), tb.len());
    for ((na, va), (nb, vb)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        let gap = va
            .iter()
            .zip(vb)
            .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
            .fold(0.0f32, f32::max);
        assert!(
            gap <= tolerance,
            "{na}: {} vs {}: {gap}",
            a.display(),
            b.display()
        );
    }
}

/// The epoch the run exported, from its summary.
pub fn best_epoch(log: &str) -> Option<usize> {
    log.lines()
        .find_map(|l| l.split("best epoch: ").nth(1))
        .and_then(|t| {
            t.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .ok()
        })
}

/// The epoch early stopping with `patience` and `min_delta` ends a run of `epochs` on `rows`'
/// validation accuracy: the first after `patience` epochs without a new best.
pub fn patience_end(
    rows: &BTreeMap<usize, BTreeMap<String, f64>>,
    patience: usize,
    min_delta: f64,
    epochs: usize,
) -> usize {
    let mut best = f64::MIN;
    let mut since = 0;
    for (&e, r) in rows {
        if r["val_accuracy"] > best + min_delta {
            best = r["val_accuracy"];
            since = 0;
        } else {
            since += 1;
        }
        if since >= patience && e < epochs {
            return e;
        }
    }
    epochs
}
