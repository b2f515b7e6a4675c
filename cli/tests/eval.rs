//! `hearth eval` and `hearth predict --data` on a generated folder: the confusion matrix and the
//! per-image predictions equal an independent per-image computation; bad files are reported.

mod common;

use std::path::Path;

use burn::module::Module;
use burn::prelude::*;
use hearth::datasets::synth::{SynthConfig, class_names, generate};
use hearth::eval::{evaluate, predict_folder, write_report};
use hearth::models::{Preprocessing, save_model_with};

/// A random small ResNet saved with class names and 32-pixel preprocessing.
fn model_file(path: &Path, classes: &[String]) {
    let model = hearth::train::mini_resnet(classes.len())
        .init(&Device::flex())
        .unwrap();
    let config = hearth::train::mini_resnet(classes.len());
    save_model_with(
        &model,
        &config,
        Some(classes),
        Some(&Preprocessing::eval(32)),
        path,
    )
    .unwrap();
}

/// An image of the first class of the synthetic set at `data`.
fn first_image(data: &Path) -> std::path::PathBuf {
    let mut class = std::fs::read_dir(data.join(&class_names(2)[0])).unwrap();
    class.next().unwrap().unwrap().path()
}

/// The class each image gets when predicted alone, through `hearth predict`'s image path.
fn alone(model: &hearth::models::Classifier, p: &Preprocessing, image: &Path) -> usize {
    let x = hearth::predict::images_to_tensor(&[image.to_path_buf()], p, &Device::flex()).unwrap();
    let v: Vec<f32> = model.forward(x).into_data().iter::<f32>().collect();
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

#[test]
fn eval_and_folder_prediction_match_per_image_predictions() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("val");
    generate(&data, &SynthConfig::new(3, 4, 40).with_seed(2)).unwrap();
    let names = class_names(3);
    let file = dir.path().join("model.bpk");
    model_file(&file, &names);
    let saved = hearth::models::load_model(&file, &Device::flex()).unwrap();
    let p = saved
        .preprocessing
        .clone()
        .expect("the file records its preprocessing");
    assert_eq!(p, Preprocessing::eval(32));
    let model = saved.model.valid();

    let mut calls = 0;
    let report = evaluate(
        &model,
        saved.class_names.as_deref(),
        &data,
        &p,
        5,
        2,
        &Device::flex(),
        &mut |_, _| calls += 1,
    )
    .unwrap();
    assert!(calls >= 3, "progress is reported per batch");
    let mut expected = vec![vec![0usize; 3]; 3];
    for (t, name) in names.iter().enumerate() {
        for e in std::fs::read_dir(data.join(name)).unwrap() {
            expected[t][alone(&model, &p, &e.unwrap().path())] += 1;
        }
    }
    assert_eq!(report.confusion, expected);
    assert_eq!(report.images, 12);
    let correct: usize = (0..3).map(|i| expected[i][i]).sum();
    assert!((report.accuracy - 100.0 * correct as f64 / 12.0).abs() < 1e-9);
    for (c, stats) in report.classes.iter().enumerate() {
        let predicted: usize = expected.iter().map(|r| r[c]).sum();
        assert_eq!(stats.support, 4);
        assert_eq!(
            stats.precision,
            (predicted > 0).then(|| expected[c][c] as f64 / predicted as f64)
        );
        assert_eq!(stats.recall, Some(expected[c][c] as f64 / 4.0));
    }
    let out = dir.path().join("eval");
    write_report(&report, &out).unwrap();
    let csv = std::fs::read_to_string(out.join("confusion.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4, "{csv}");
    assert!(out.join("confusion.png").is_file() && out.join("per_class.csv").is_file());

    // Folder predictions: one row per readable image, each the image's own prediction; a
    // corrupt file is reported, not given another image's answer.
    std::fs::write(data.join(&names[1]).join("broken.png"), b"not a png at all").unwrap();
    let csv_path = dir.path().join("predictions.csv");
    let done = predict_folder(
        &model,
        saved.class_names.as_deref(),
        &data,
        &p,
        2,
        5,
        2,
        &Device::flex(),
        burn::tensor::FloatDType::F32,
        &csv_path,
        &mut |_, _| {},
    )
    .unwrap();
    let (n, problems) = (done.written, done.problems);
    assert!(done.gap.is_none(), "an f32 pass compares with nothing");
    assert_eq!(n, 12);
    assert!(
        problems.0.iter().any(|p| p.path.ends_with("broken.png")),
        "{problems:?}"
    );
    let text = std::fs::read_to_string(&csv_path).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("path,class1,prob1,class2,prob2"));
    let mut rows = 0;
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        let top1 = names.iter().position(|n| n == cells[1]).unwrap();
        assert_eq!(top1, alone(&model, &p, Path::new(cells[0])), "{line}");
        rows += 1;
    }
    assert_eq!(rows, 12);

    // Folders that are not the model's classes are refused by name.
    let other = dir.path().join("other");
    generate(&other, &SynthConfig::new(4, 1, 40)).unwrap();
    let e = evaluate(
        &model,
        saved.class_names.as_deref(),
        &other,
        &p,
        5,
        1,
        &Device::flex(),
        &mut |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(&class_names(4)[3]), "{e}");
}

#[test]
fn the_eval_command_prints_accuracy_and_writes_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("val");
    generate(&data, &SynthConfig::new(2, 3, 40)).unwrap();
    let file = dir.path().join("model.bpk");
    model_file(&file, &class_names(2));
    let out = dir.path().join("report");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["eval", "--weights"])
        .arg(&file)
        .arg("--data")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("accuracy: ") && text.contains("on 6 images"),
        "{text}"
    );
    assert!(out.join("confusion.png").is_file());
}

/// `hearth predict`'s flags act on the input they are for or are refused by name, before
/// anything is written: `--out` and `--batch-size` with `--data` only, `--logits-out` without
/// it; a Hearth model file's architecture and class count are its own (`--model` and
/// `--num-classes` that say otherwise are refused, the same ones pass); `--top`, `--batch-size`
/// and `eval --workers` of 0 are refused rather than taken as 1 (the library refuses 0 too).
#[test]
fn predict_and_eval_flags_act_or_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("val");
    generate(&data, &SynthConfig::new(2, 2, 40)).unwrap();
    let file = dir.path().join("model.bpk");
    model_file(&file, &class_names(2));
    let image = first_image(&data);
    let (csv, npy) = (dir.path().join("p.csv"), dir.path().join("l.npy"));
    let run = |args: &[&std::ffi::OsStr]| {
        let out = common::hearth_cli(&args.iter().map(|a| a.to_str().unwrap()).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        (out.status.success(), err)
    };
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let predict = [os("predict"), os("--weights"), file.as_os_str()];
    let refusals: Vec<(Vec<&std::ffi::OsStr>, &str)> = vec![
        (
            vec![
                os("--image"),
                image.as_os_str(),
                os("--out"),
                csv.as_os_str(),
            ],
            "error: --out: only with --data",
        ),
        (
            vec![
                os("--image"),
                image.as_os_str(),
                os("--batch-size"),
                os("4"),
            ],
            "error: --batch-size: only with --data",
        ),
        (
            vec![
                os("--data"),
                data.as_os_str(),
                os("--out"),
                csv.as_os_str(),
                os("--logits-out"),
                npy.as_os_str(),
            ],
            "error: --logits-out: not with --data",
        ),
        (
            vec![
                os("--image"),
                image.as_os_str(),
                os("--num-classes"),
                os("7"),
            ],
            "--num-classes 7: the model file",
        ),
        (
            vec![os("--image"), image.as_os_str(), os("--model"), os("vgg16")],
            "--model vgg16: the model file",
        ),
        (
            vec![os("--image"), image.as_os_str(), os("--top"), os("0")],
            "--top",
        ),
        (
            vec![
                os("--data"),
                data.as_os_str(),
                os("--out"),
                csv.as_os_str(),
                os("--batch-size"),
                os("0"),
            ],
            "--batch-size",
        ),
    ];
    for (extra, said) in refusals {
        let args: Vec<&std::ffi::OsStr> = predict.iter().copied().chain(extra).collect();
        let (ok, err) = run(&args);
        assert!(!ok && err.contains(said), "{args:?}: {err}");
        assert!(!csv.exists() && !npy.exists(), "{args:?} wrote a file");
    }
    // What agrees with the model file passes, and --logits-out writes with --image.
    let agreeing = [
        os("--image"),
        image.as_os_str(),
        os("--num-classes"),
        os("2"),
        os("--model"),
        os("resnet-mini"),
        os("--logits-out"),
        npy.as_os_str(),
    ];
    let args: Vec<&std::ffi::OsStr> = predict.iter().copied().chain(agreeing).collect();
    let (ok, err) = run(&args);
    assert!(ok, "{args:?}: {err}");
    assert!(npy.is_file());
    // The default --top (5) on 2 classes lists both without remark; a --top asked for past
    // the class count says so.
    assert!(!err.contains("--top"), "{err}");
    let asked = [os("--image"), image.as_os_str(), os("--top"), os("10")];
    let args: Vec<&std::ffi::OsStr> = predict.iter().copied().chain(asked).collect();
    let (ok, err) = run(&args);
    assert!(ok, "{args:?}: {err}");
    assert!(
        err.contains("--top 10: the model has 2 classes; all 2 are listed"),
        "{err}"
    );
    for (extra, said) in [
        (["--model", "vgg16"], "--model vgg16: the model file"),
        (["--workers", "0"], "--workers"),
        (["--batch-size", "0"], "--batch-size"),
    ] {
        let mut args = vec![os("eval"), os("--weights"), file.as_os_str(), os("--data")];
        args.push(data.as_os_str());
        args.extend(extra.map(os));
        let (ok, err) = run(&args);
        assert!(!ok && err.contains(said), "{args:?}: {err}");
    }
    let saved = hearth::models::load_model(&file, &Device::flex()).unwrap();
    let p = saved.preprocessing.clone().unwrap();
    for (batch, workers) in [(0, 2), (4, 0)] {
        let err = evaluate(
            &saved.model.valid(),
            None,
            &data,
            &p,
            batch,
            workers,
            &Device::flex(),
            &mut |_, _| {},
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            err.contains("must be at least 1"),
            "batch {batch}, workers {workers}: {err}"
        );
    }
}

/// A model file whose recorded preprocessing asks for images past the largest side (damaged,
/// or not Hearth's): `predict` and `eval` refuse it by name instead of aborting on a
/// gigabytes-large allocation, and so does the library's `images_to_tensor`.
#[test]
fn a_model_files_oversized_preprocessing_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("val");
    generate(&data, &SynthConfig::new(2, 1, 40)).unwrap();
    let image = first_image(&data);
    let file = dir.path().join("model.bpk");
    let config = hearth::train::mini_resnet(2);
    let model = config.init(&Device::flex()).unwrap();
    let huge = Preprocessing::eval(100_000);
    save_model_with(&model, &config, None, Some(&huge), &file).unwrap();
    let csv = dir.path().join("p.csv");
    let (f, d, i, c) = (
        file.to_str().unwrap(),
        data.to_str().unwrap(),
        image.to_str().unwrap(),
        csv.to_str().unwrap(),
    );
    for args in [
        &["predict", "--weights", f, "--image", i][..],
        &["predict", "--weights", f, "--data", d, "--out", c][..],
        &["eval", "--weights", f, "--data", d][..],
    ] {
        let out = common::hearth_cli(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran");
        assert!(
            err.contains("model.bpk records images resized to 114286 and cropped to 100000")
                && err.contains("(4096)"),
            "{args:?}: {err}"
        );
        assert!(
            !err.contains("panicked") && !err.contains("memory allocation"),
            "{err}"
        );
        assert!(!csv.exists(), "{args:?} wrote {}", csv.display());
    }
    let err = hearth::predict::images_to_tensor(&[image], &huge, &Device::flex())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("cropped to 100000"), "{err}");
}
