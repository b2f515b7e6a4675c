//! `HEARTH_AUTOTUNE_LOG` on a cubecl device (Vulkan on the CPU; CI installs lavapipe): a
//! convolution of a new shape is tuned, the decision lands in the log, and `hearth
//! autotune-report` prints it as a table. A file of its own: cubecl's configuration is one per
//! process and is read when the first cubecl device starts, so the variables must be set before
//! any other test could start one.

mod common;

#[cfg(feature = "wgpu")]
#[test]
fn a_tuned_convolution_is_logged_and_reported() {
    use std::process::Command;
    use std::time::{Duration, Instant};

    use burn::nn::PaddingConfig2d;
    use burn::nn::conv::Conv2dConfig;
    use burn::prelude::*;
    use hearth::device::DeviceChoice;

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("autotune.jsonl");
    // SAFETY: the only test of this process, before any device (or other thread) starts.
    unsafe {
        std::env::set_var(hearth::gpu::AUTOTUNE_LOG_ENV, &log);
        // Every decision taken now, none read back from an earlier run's disk cache.
        std::env::set_var("CUBECL_AUTOTUNE_CACHE", "0");
    }
    let Some(device) = common::device_or_skip(
        DeviceChoice::VulkanCpu,
        "a_tuned_convolution_is_logged_and_reported",
    ) else {
        return;
    };
    // A second configure() is a no-op: the log stays set, no warning.
    assert_eq!(hearth::gpu::configure(), None);

    let conv = Conv2dConfig::new([3, 5], [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init(&device);
    let x = Tensor::<4>::ones([2, 3, 9, 9], &device);
    let y = conv.forward(x);
    assert_eq!(y.dims(), [2, 5, 9, 9]);
    let _ = y.sum().into_scalar::<f32>();

    let decisions = hearth::gpu::read_decisions(&log).unwrap();
    // Autotune keys round channels, sizes and the batch up to powers of two ("anchors"), so the
    // 3->5 convolution on 9x9 is tuned as 4->8 on 16x16: one decision covers such a range.
    let conv_decision = decisions
        .iter()
        .find(|d| {
            d.what
                .contains("4->8 ch, kernel 3x3, stride 1x1, input 16x16, batch 2")
        })
        .unwrap_or_else(|| panic!("no decision for the 3->5 3x3 convolution: {decisions:#?}"));
    assert!(!conv_decision.chosen.is_empty());
    assert!(conv_decision.seconds > 0.0, "{conv_decision:?}");

    // Hearth's own convolution (`hearth_kernels::conv2d`): chosen by rule by default, with no
    // decision; handed to autotune under `--autotune full`, with one.
    {
        use hearth::gpu::DecisionKind;
        use hearth::kernels::select::{Selection, set_selection};
        let convolutions = || {
            hearth::gpu::read_decisions(&log)
                .unwrap()
                .iter()
                .filter(|d| d.kind == DecisionKind::Convolution)
                .count()
        };
        let before = convolutions();
        let run = |co: usize| {
            let conv = Conv2dConfig::new([3, co], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(&device);
            let y = hearth::kernels::conv2d(&conv, Tensor::<4>::ones([2, 3, 9, 9], &device));
            let _ = y.sum().into_scalar::<f32>();
        };
        set_selection(Selection::Rules);
        run(20);
        assert_eq!(
            convolutions(),
            before,
            "a convolution chosen by rule was tuned"
        );
        set_selection(Selection::Autotune);
        run(40);
        assert!(
            convolutions() > before,
            "--autotune full tuned no convolution"
        );
        set_selection(Selection::Rules);
    }

    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .arg("autotune-report")
        .arg(&log)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("hearth autotune-report did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    let logged = hearth::gpu::read_decisions(&log).unwrap().len();
    assert!(logged > decisions.len(), "{table}");
    assert!(
        table.contains(&format!("{logged} autotune decisions")),
        "{table}"
    );
    assert!(table.contains("4->8 ch, kernel 3x3"), "{table}");
    assert!(table.contains(&conv_decision.chosen), "{table}");
}
