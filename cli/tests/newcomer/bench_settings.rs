//! Image sides past the largest, and `hearth bench` settings that would measure nothing, are
//! refused by name before anything is written or run.

use super::hearth;

/// `hearth bench loader` refuses a batch size, worker count or prefetch depth of 0 by name
/// before it says what it will run, and before it reads the folder.
#[test]
fn the_loader_bench_refuses_empty_settings_before_describing_its_run() {
    let tmp = tempfile::tempdir().unwrap();
    let set = tmp.path().join("missing");
    let set = set.to_str().unwrap();
    for (flag, said) in [
        ("--batch-size", "batch size must be at least 1"),
        ("--workers", "workers and prefetch must be at least 1"),
        ("--prefetch", "workers and prefetch must be at least 1"),
        ("--batches", "the loader bench needs at least 1 batch"),
    ] {
        let out = hearth(&["bench", "loader", "--data", set, flag, "0"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(said),
            "{flag} 0: {err}"
        );
        assert!(
            !err.contains("bench loader "),
            "{flag} 0 described its run: {err}"
        );
        assert!(!err.contains("panicked"), "{flag} 0: {err}");
    }
}

/// An image side past the largest Hearth prepares (4096) is refused by name before anything is
/// allocated or written (a 100000-pixel side ended the process in a 30 GB allocation).
#[test]
fn an_image_side_past_the_largest_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let set = tmp.path().join("set");
    let set = set.to_str().unwrap();
    for (args, said) in [
        (
            &["data", "synth", "--out", set, "--size", "100000"][..],
            "a size of 8..=4096",
        ),
        (
            &["bench", "model", "--model", "resnet18", "--size", "100000"][..],
            "the input size 100000 is above the maximum of 4096",
        ),
        (
            &["bench", "loader", "--data", set, "--size", "100000"][..],
            "output size 100000 is above the largest image side, 4096",
        ),
    ] {
        let out = hearth(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(said),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            !std::path::Path::new(set).exists(),
            "{args:?} wrote the set"
        );
    }
}
