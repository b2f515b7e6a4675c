//! `hearth tune --rules-only` on `vulkan-cpu`: the bundle it writes, a fresh cache importing
//! it, and `--autotune full` taking the reductions' rules back out.

use std::path::Path;
use std::process::{Command, Output};

use super::common;

/// Runs `hearth` on `vulkan-cpu` with `args`, cubecl's cache in `dir/cache` (outside a Cargo
/// project cubecl keeps it under XDG_CACHE_HOME: a folder of its own is a machine that has seen
/// nothing), its decisions logged to `dir/log` and the variables `env` set; fails the test
/// past 900 s.
fn hearth_on_lavapipe(
    dir: &Path,
    cache: &str,
    log: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.args(["--device", "vulkan-cpu"])
        .args(args)
        .env_remove(hearth::gpu::REDUCE_RULES_ENV)
        .envs(env.iter().copied())
        .current_dir(dir)
        .env("XDG_CACHE_HOME", dir.join(cache))
        .env(hearth::gpu::AUTOTUNE_LOG_ENV, dir.join(log))
        .env_remove("HEARTH_AUTOTUNE")
        .env_remove("HEARTH_KERNEL_BUNDLE")
        .env_remove("CUBECL_AUTOTUNE_CACHE");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(cmd.output());
    });
    rx.recv_timeout(std::time::Duration::from_secs(900))
        .unwrap_or_else(|_| panic!("hearth {args:?} did not finish within 900 s"))
        .unwrap()
}

/// `hearth tune --rules-only` compiles the kernels chosen by rule and writes cubecl's cache to a
/// bundle without timing a convolution or a matrix product; a second machine (here: a fresh
/// cache folder) that imports the bundle with `--kernel-bundle` makes no autotune decision at
/// all for the same steps, since the bundle carried the first one's. `--from-cache` bundles the
/// same cache in the flat format without running anything. `--rules-only` beside
/// `--autotune full` is refused by name before anything starts.
#[test]
fn tune_rules_only_bundles_the_kernels_by_rule_and_a_fresh_cache_imports_it() {
    use hearth::gpu::DecisionKind;

    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("lavapipe.bundle");
    // ResNet-18 (the smallest torchvision network) at 32x32, batch 2: lavapipe compiles every
    // kernel it meets, so keep the steps small.
    let tune = |cache: &str, log: &str, extra: &[&str]| -> Output {
        let out = dir.path().join(format!("{cache}.bundle"));
        let out = out.to_string_lossy();
        let mut args = extra.to_vec();
        args.extend(["tune", "--rules-only", "--model", "resnet18"]);
        args.extend(["--batch-size", "2", "--size", "32", "--num-classes", "4"]);
        args.extend(["--out", &out]);
        hearth_on_lavapipe(dir.path(), cache, log, &args, &[])
    };
    let decisions = |log: &str| {
        let path = dir.path().join(log);
        if path.exists() {
            hearth::gpu::read_decisions(&path).unwrap()
        } else {
            Vec::new()
        }
    };

    let refused = tune("refused", "refused.jsonl", &["--autotune", "full"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "--rules-only with --autotune full ran: {err}"
    );
    assert!(
        err.contains("--rules-only compiles only the kernels chosen by rule"),
        "{err}"
    );
    assert!(!dir.path().join("refused.bundle").exists());

    let first = tune("first", "first.jsonl", &[]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&first.stdout),
        String::from_utf8_lossy(&first.stderr)
    );
    if !first.status.success() && text.contains("vulkan-cpu' is not available") {
        assert!(
            common::may_skip("vulkan"),
            "vulkan-cpu unavailable: install mesa-vulkan-drivers (as .ci/run does), or set \
             HEARTH_ALLOW_SKIP=vulkan to skip it: {text}"
        );
        eprintln!("SKIPPED: vulkan-cpu unavailable here; HEARTH_ALLOW_SKIP=vulkan");
        return;
    }
    assert!(
        first.status.success(),
        "hearth tune --rules-only failed: {text}"
    );
    eprintln!("{text}");
    assert!(
        !text.contains("--autotune full ("),
        "the full tune ran: {text}"
    );
    // Nothing tuned at all: Burn's reductions too (their rules were written into the fresh
    // cache before the first), and fusion's fused ones (launched by rule).
    let made = decisions("first.jsonl");
    assert!(made.is_empty(), "kernels were tuned: {made:#?}");
    assert!(
        text.contains("reductions by rule: ") && text.contains(" autotune decisions written"),
        "nothing said about the reductions' rules: {text}"
    );
    // The same cache bundled again without running anything, in cubecl's flat format (`.ccb`,
    // what Hearth embeds): it opens and holds the decisions.
    let flat = dir.path().join("first.ccb");
    let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["--device", "vulkan-cpu", "tune", "--from-cache", "--out"])
        .arg(&flat)
        .current_dir(dir.path())
        .env("XDG_CACHE_HOME", dir.path().join("first"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tune --from-cache failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reopened = cubecl::bundle::open(&flat).expect("the flat bundle does not open");
    let mut entries = 0usize;
    for namespace in reopened.namespaces() {
        reopened.scan(&namespace, &mut |_, _| entries += 1);
    }
    // At least the reductions' rules written into that cache.
    let rules: usize = text
        .split("reductions by rule: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of the rules written: {text}"));
    assert!(
        rules > 0 && entries >= rules,
        "{entries} entries in the flat bundle for {rules} rules written"
    );
    std::fs::rename(dir.path().join("first.bundle"), &bundle).unwrap();
    assert!(std::fs::metadata(&bundle).unwrap().len() > 0);
    assert!(text.contains("entries"), "no account of the bundle: {text}");

    // A machine that has seen nothing, with the bundle: the same steps decide nothing anew.
    let bundle_arg = bundle.to_string_lossy().into_owned();
    let second = tune("second", "second.jsonl", &["--kernel-bundle", &bundle_arg]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&second.stdout),
        String::from_utf8_lossy(&second.stderr)
    );
    assert!(
        second.status.success(),
        "tune with the bundle failed: {text}"
    );
    assert!(
        text.contains("entries imported"),
        "nothing said about the import: {text}"
    );
    // What the import brought: the reductions' rules (lavapipe keeps no compiled kernels), in
    // the cache before the device started, so none had to be written.
    assert!(
        !text.contains("reductions by rule: "),
        "the bundle's rules were not in the cache at the start: {text}"
    );
    let again = decisions("second.jsonl");
    assert!(
        again.is_empty(),
        "decided again despite the bundle: {again:#?}"
    );

    // `--autotune full` on the first machine: the reductions' rules leave its cache, and the
    // reductions are timed again (inference at batch 1: the smallest run that reduces).
    let full = hearth_on_lavapipe(
        dir.path(),
        "first",
        "full.jsonl",
        &[
            "--autotune",
            "full",
            "bench",
            "model",
            "--model",
            "resnet18",
            "--mode",
            "infer",
            "--size",
            "32",
            "--batch-size",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&full.stderr);
    assert!(full.status.success(), "--autotune full failed: {text}");
    assert!(
        text.contains("reduction decisions made by rule removed"),
        "the rules stayed under --autotune full: {text}"
    );
    let timed = decisions("full.jsonl");
    assert!(
        timed.iter().any(|d| d.kind == DecisionKind::Reduction),
        "no reduction was timed under --autotune full: {timed:#?}"
    );
}

/// The reductions' rules are written once per cache, and `HEARTH_REDUCE_RULES=0` writes none:
/// a first start with it says so and leaves the cache without them (the next start writes all
/// of them), and a start after that finds them and says nothing. `bench loader` starts the
/// device and runs no kernel of a model.
#[test]
fn the_reductions_rules_are_written_once_per_cache_and_not_with_the_variable_off() {
    if common::device_or_skip(
        hearth::device::DeviceChoice::VulkanCpu,
        "the_reductions_rules_are_written_once_per_cache_and_not_with_the_variable_off",
    )
    .is_none()
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = common::small_data(dir.path()).join("train");
    let data = data.to_string_lossy().into_owned();
    let start = |rules: Option<&str>| -> String {
        let args = [
            "bench",
            "loader",
            "--data",
            &data,
            "--batch-size",
            "2",
            "--size",
            "16",
            "--batches",
            "1",
            "--workers",
            "1",
        ];
        let env: Vec<(&str, &str)> = rules
            .map(|v| (hearth::gpu::REDUCE_RULES_ENV, v))
            .into_iter()
            .collect();
        let out = hearth_on_lavapipe(dir.path(), "cache", "log.jsonl", &args, &env);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let off = start(Some("0"));
    assert!(
        off.contains("HEARTH_REDUCE_RULES=0: Burn's reductions keep autotune")
            && !off.contains("reductions by rule"),
        "{off}"
    );
    let first = start(None);
    assert!(
        first.contains("reductions by rule: ") && first.contains("(0 already there)"),
        "the first start with the rules on did not write them all: {first}"
    );
    let again = start(None);
    assert!(
        !again.contains("reductions by rule"),
        "written twice: {again}"
    );
}
