//! Damaged images in a newcomer's folder: a truncated image is skipped and named, a folder of
//! them stops the run, and every rank's skips reach the summary in every distributed mode, with
//! every training rank's memory (its start's peak within its whole peak).

use super::*;

#[test]
fn truncated_images_are_skipped_by_path_and_a_folder_of_them_stops_the_run() {
    use burn::prelude::Device;
    let tmp = tempfile::tempdir().unwrap();
    let data = jpeg_set(tmp.path());
    let files = images(&data);
    let cut: Vec<_> = [&files[1], &files[20]].into_iter().cloned().collect();
    for f in &cut {
        truncate(f);
    }
    let cfg = small_run(&data, tmp.path().join("run"));
    let report = hearth::train::train(&cfg, &Device::flex(), &mut |l| eprintln!("{l}")).unwrap();
    for f in &cut {
        let name = f.display().to_string();
        assert!(
            report.skipped.iter().any(|s| s.starts_with(&name)),
            "{name} not reported: {:?}",
            report.skipped
        );
    }
    assert!(
        report.skipped.iter().all(|s| s.contains("truncated")),
        "{:?}",
        report.skipped
    );
    assert!(report.best_val_loss.is_some_and(f64::is_finite));
    // Counted in the epoch's row (and so its console line).
    let csv = std::fs::read_to_string(tmp.path().join("run/metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let row: Vec<&str> = csv.lines().nth(1).unwrap().split(',').collect();
    let col = |name: &str| -> f64 {
        let i = header.iter().position(|h| *h == name).unwrap();
        row[i].parse().unwrap()
    };
    assert_eq!(
        col("train_skipped_images") + col("val_skipped_images"),
        2.0,
        "{csv}"
    );

    // The same count in a pipeline run (the shared epoch loop of the custom modes).
    let piped = tmp.path().join("piped");
    let out = hearth(&[
        "train",
        "--data",
        data.to_str().unwrap(),
        "--pipeline-stages",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--workers",
        "1",
        "--run-dir",
        piped.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("skipped 2 unreadable image(s)"), "{err}");
    // And the summary lists them (the launcher passes the ranks' output on).
    let all = format!("{err}{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        all.contains("skipped 2 image(s) that failed to decode"),
        "{all}"
    );

    // Every image cut: the run stops naming the files, not a NaN loss blamed on --lr.
    for f in &files {
        truncate(f);
    }
    let cfg = small_run(&data, tmp.path().join("run2"));
    let e = hearth::train::train(&cfg, &Device::flex(), &mut |_| {})
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("fail to decode"), "{e}");
    assert!(e.contains(".jpg"), "{e}");
    assert!(!e.contains("NaN"), "{e}");
}

/// Issue 55: in data parallel, elastic and parameter-server runs the summary listed rank 0's
/// skipped images only; each rank decodes its own shard. Six training images spread over the
/// shards are cut: every mode's summary counts all six.
#[test]
fn every_ranks_skipped_images_reach_the_summary_in_every_distributed_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let data = jpeg_set(tmp.path());
    let train: Vec<_> = images(&data)
        .into_iter()
        .filter(|f| !f.components().any(|c| c.as_os_str() == "val"))
        .collect();
    let cut: Vec<_> = train
        .iter()
        .step_by(train.len() / 6)
        .take(6)
        .cloned()
        .collect();
    assert_eq!(cut.len(), 6);
    for f in &cut {
        truncate(f);
    }
    let common_args = [
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "1",
        "--batch-size",
        "12",
        "--workers",
        "1",
        "--size",
        "32",
    ];
    let said = "skipped 6 image(s) that failed to decode";
    let check = |mode: &str, out: std::process::Output| {
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{mode}:\n{all}");
        assert!(all.contains(said), "{mode}: no {said:?} in\n{all}");
        for f in &cut {
            let name = f.display().to_string();
            assert!(all.contains(&name), "{mode}: {name} not listed:\n{all}");
        }
        // Every training rank's summary: its heap's peak and, within it, the start's (the model
        // built, loaded and handed out before the first epoch; a parameter server has none).
        let mb_after = |line: &str, label: &str| -> f64 {
            let rest = line
                .split(label)
                .nth(1)
                .unwrap_or_else(|| panic!("{label}: {line}"));
            rest.split(" MB").next().unwrap().trim().parse().unwrap()
        };
        let summaries: Vec<&str> = all
            .lines()
            .filter(|l| l.contains("peak memory of rank") && l.contains("by the end of the start"))
            .collect();
        assert!(summaries.len() >= 2, "{mode}:\n{all}");
        for line in summaries {
            let (heap, start) = (mb_after(line, "heap at most "), mb_after(line, "live ("));
            assert!(start > 0.0 && start <= heap, "{mode}: {line}");
        }
    };
    for (mode, extra) in [
        ("data parallel", &["--nproc", "2"][..]),
        (
            "parameter servers",
            &["--nproc", "3", "--ps", "1", "--mode", "sync"][..],
        ),
    ] {
        let run = tmp.path().join(mode.replace(' ', "-"));
        let mut args = vec!["train", "--run-dir", run.to_str().unwrap()];
        args.extend(common_args);
        args.extend(extra);
        check(mode, hearth(&args));
    }
    let run = tmp.path().join("elastic");
    let mut args = vec![
        "launch",
        "--elastic",
        "-n",
        "2",
        "--",
        "hearth",
        "train",
        "--elastic",
        "--run-dir",
        run.to_str().unwrap(),
    ];
    args.extend(common_args);
    check("elastic", hearth(&args));
}
