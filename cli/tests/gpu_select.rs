//! Kernels chosen by rule on a cubecl device (Vulkan on the CPU: Mesa lavapipe, which CI
//! installs): Hearth's convolutions and linear layers train with no autotune decision for a
//! convolution or a matrix product, whatever the batch, and give what Flex gives. A file of its
//! own: cubecl's configuration (the decision log) is read once per process, when the first
//! cubecl device starts.

mod common;
#[cfg(feature = "wgpu")]
#[path = "gpu_select/rules_bundle.rs"]
mod rules_bundle;

/// Relative gap of `a` to `b`: the largest difference over the largest |b|.
#[cfg(feature = "wgpu")]
fn relative_gap(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    common::max_abs_diff(a, b) / scale
}

/// One training step of `config`'s model on `device` from the weights in `record`: the logits
/// before the step, the input's gradient, and the logits after an SGD step.
#[cfg(feature = "wgpu")]
fn train_step(
    record: &hearth::models::Classifier,
    device: &burn::prelude::Device,
    x: &burn::tensor::TensorData,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    use burn::module::Module;
    use burn::optim::{GradientsParams, SgdConfig};
    use burn::prelude::*;

    let device = device.clone().autodiff();
    // `fork`: a new leaf on `device` whose parameters are tracked there.
    let model = record.clone().fork(&device);
    let x = Tensor::<4>::from_data(x.clone(), &device).require_grad();
    let logits = model.forward(x.clone());
    let classes = logits.dims()[1];
    // A loss that weighs each logit differently, so every output's gradient differs.
    let ramp: Vec<f32> = (1..=classes).map(|c| c as f32).collect();
    let weights =
        Tensor::<2>::from_data(burn::tensor::TensorData::new(ramp, [1, classes]), &device);
    let loss = (logits.clone() * weights).sum();
    let grads = loss.backward();
    let x_grad = x.grad(&grads).expect("the input has a gradient");
    let params = GradientsParams::from_grads(grads, &model);
    assert!(!params.is_empty(), "no parameter has a gradient");
    let mut sgd = SgdConfig::new().init();
    let stepped = sgd.step(0.05, model, params);
    let after = stepped.forward(x.detach());
    let values = |t: Tensor<2>| t.into_data().iter::<f32>().collect::<Vec<_>>();
    (
        values(logits),
        x_grad.into_data().iter::<f32>().collect(),
        values(after),
    )
}

#[cfg(feature = "wgpu")]
#[test]
fn selected_kernels_train_as_flex_does_and_tune_no_convolution_or_product() {
    use burn::prelude::*;
    use hearth::device::DeviceChoice;
    use hearth::gpu::DecisionKind;
    use hearth::models::{BlockKind, ModelConfig, ResNetConfig};

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("autotune.jsonl");
    // SAFETY: the only test of this process, before any device (or other thread) starts.
    unsafe {
        std::env::set_var(hearth::gpu::AUTOTUNE_LOG_ENV, &log);
        // Every decision taken now, none read back from an earlier run's disk cache.
        std::env::set_var("CUBECL_AUTOTUNE_CACHE", "0");
        std::env::remove_var("HEARTH_AUTOTUNE");
        std::env::remove_var("HEARTH_FAST_KERNELS");
    }
    let Some(gpu) = common::device_or_skip(
        DeviceChoice::VulkanCpu,
        "selected_kernels_train_as_flex_does_and_tune_no_convolution_or_product",
    ) else {
        return;
    };
    assert_eq!(
        hearth::kernels::select::selection(),
        hearth::kernels::select::Selection::Rules
    );
    let flex = Device::flex();
    // A bottleneck ResNet: the strided 7x7 stem, 3x3 with stride 1 and 2, 1x1 with stride 1
    // (the pointwise products) and 2 (the shortcuts), and a linear head. Small: lavapipe
    // compiles every kernel it meets.
    let config = ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Bottleneck, [1, 1, 1, 1], 5)
            .with_stem_width(8)
            .with_stage_widths([4, 8, 8, 8]),
    );
    // Seeded: the weights and the input are the same in every run. The last stage sees 1x1
    // feature maps of 2 images, so its batch norm divides by the spread of two values; where a
    // draw made two nearly equal, that division magnified the sums' last-digit differences
    // (about 1e-6) past the bound below (3.8e-3 in one unseeded run of about ten).
    flex.seed(5);
    // Initialised on an autodiff device, so that its parameters are tracked wherever it moves.
    let record = config.init(&flex.clone().autodiff()).unwrap();
    let input = |batch: usize| {
        Tensor::<4>::random(
            [batch, 3, 32, 32],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &flex,
        )
        .into_data()
    };
    let x = input(2);
    let started = std::time::Instant::now();
    let on_flex = train_step(&record, &flex, &x);
    let on_gpu = train_step(&record, &gpu, &x);
    eprintln!(
        "batch 2 on Flex and lavapipe: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // f32 in both, summed in other orders: the logits agree to about 1e-4 of their largest;
    // gradients through batch norm (which subtracts the batch's mean) lose more digits. A wrong
    // kernel (a transposed weight, a shifted window) is off by the values' own size.
    for (what, g, f, bound) in [
        ("logits", &on_gpu.0, &on_flex.0, 1e-3),
        ("input gradient", &on_gpu.1, &on_flex.1, 2e-2),
        ("logits after an SGD step", &on_gpu.2, &on_flex.2, 2e-2),
    ] {
        let gap = relative_gap(g, f);
        eprintln!("{what}: {gap:.2e} of the largest value (bound {bound:e})");
        assert!(gap < bound, "{what} differs by {gap:.2e}");
    }
    // Another batch size: no decision either (the choice does not depend on the batch).
    let started = std::time::Instant::now();
    let _ = train_step(&record, &gpu, &input(3));
    eprintln!(
        "batch 3 on lavapipe: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Weight gradients over 28x28 output positions or more run as one product per image,
    // summed (`per_image.rs`): equal to Flex's for a 3x3, a strided 3x3 (its columns cut with
    // a step) and a 1x1, with each set of columns as large as the budget allows and with one
    // kernel offset per set.
    for budget in [hearth::kernels::cube_base::COLUMNS_BUDGET, 1] {
        hearth::kernels::cube_base::set_columns_budget(budget);
        for (ci, co, k, stride, pad, side) in [
            (4, 6, 3, 1, 1, 28),
            (4, 6, 3, 2, 1, 56),
            (6, 4, 1, 1, 0, 28),
        ] {
            use burn::module::Module;
            use burn::nn::PaddingConfig2d;
            use burn::nn::conv::Conv2dConfig;
            let record = Conv2dConfig::new([ci, co], [k, k])
                .with_stride([stride, stride])
                .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
                .with_bias(false)
                .init(&flex.clone().autodiff());
            let x = Tensor::<4>::random(
                [3, ci, side, side],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &flex,
            )
            .into_data();
            // The weight's gradient and the input's.
            let gradients = |device: &Device| -> [Vec<f32>; 2] {
                let device = device.clone().autodiff();
                let conv = record.clone().fork(&device);
                let x = Tensor::<4>::from_data(x.clone(), &device).require_grad();
                let y = hearth::kernels::conv2d(&conv, x.clone());
                // Squared: each output's gradient is its own value.
                let grads = (y.clone() * y).sum().backward();
                let dw = conv.weight.grad(&grads).expect("the weight has a gradient");
                let dx = x.grad(&grads).expect("the input has a gradient");
                [dw, dx].map(|t| t.into_data().iter::<f32>().collect())
            };
            let (on_gpu, on_flex) = (gradients(&gpu), gradients(&flex));
            let what = format!("{ci}->{co} {k}x{k} stride {stride} pad {pad} on {side}x{side}");
            for (pass, g, f) in [
                ("weight gradient", &on_gpu[0], &on_flex[0]),
                ("input gradient", &on_gpu[1], &on_flex[1]),
            ] {
                let gap = relative_gap(g, f);
                eprintln!("{pass} {what}, budget {budget}: {gap:.2e} of the largest value");
                assert!(gap < 1e-4, "{pass} {what} differs by {gap:.2e}");
            }
            let chosen = hearth::kernels::cube::chosen();
            let ran = |pass: &str, kernel: &str| {
                let described = format!("{pass} {what}");
                chosen
                    .iter()
                    .any(|(what, k)| what.starts_with(&described) && k == kernel)
            };
            assert!(
                ran("weight gradient", "per_image_products"),
                "{what}: weight gradient not run as products per image: {chosen:?}"
            );
            // A strided input gradient: col2im.
            assert_eq!(
                ran("input gradient", "col2im"),
                stride > 1,
                "{what}: {chosen:?}"
            );
        }
    }
    hearth::kernels::cube_base::set_columns_budget(hearth::kernels::cube_base::COLUMNS_BUDGET);
    // In fp16 (`--precision fp16` on a GPU: the products in the low type, their sum over the
    // images in f32), within fp16's rounding of Flex's f32.
    {
        use burn::module::Module;
        use burn::nn::PaddingConfig2d;
        use burn::nn::conv::Conv2dConfig;
        use burn::tensor::FloatDType;
        let record = Conv2dConfig::new([4, 6], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .with_bias(false)
            .init(&flex.clone().autodiff());
        let x = Tensor::<4>::random(
            [3, 4, 28, 28],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &flex,
        )
        .into_data();
        let weight_grad = |device: &Device, low: Option<FloatDType>| -> Vec<f32> {
            let device = device.clone().autodiff();
            let conv = record.clone().fork(&device);
            let mut x = Tensor::<4>::from_data(x.clone(), &device);
            if let Some(dtype) = low {
                x = x.cast(dtype);
            }
            let y = hearth::kernels::conv2d(&conv, x).cast(FloatDType::F32);
            let grads = (y.clone() * y).sum().backward();
            let dw = conv.weight.grad(&grads).expect("the weight has a gradient");
            dw.cast(FloatDType::F32).into_data().iter::<f32>().collect()
        };
        let on_gpu = weight_grad(&gpu, Some(FloatDType::F16));
        let gap = relative_gap(&on_gpu, &weight_grad(&flex, None));
        eprintln!("weight gradient in fp16: {gap:.2e} of the largest value (bound 2e-2)");
        assert!(gap < 2e-2, "the fp16 weight gradient differs by {gap:.2e}");
        assert!(
            hearth::kernels::cube::chosen()
                .iter()
                .any(|(what, kernel)| what
                    == "weight gradient 4->6 3x3 stride 1 pad 1 on 28x28 F16"
                    && kernel == "per_image_products"),
            "{:?}",
            hearth::kernels::cube::chosen()
        );
    }

    // The step changed the weights: the parameters' gradients were there (and so computed by
    // the weight-gradient kernels checked below).
    assert!(
        relative_gap(&on_gpu.2, &on_gpu.0) > 1e-4,
        "the SGD step changed nothing"
    );

    // The selection ran, for every pass and the linear layers.
    let chosen = hearth::kernels::cube::chosen();
    for (what, kernel) in &chosen {
        eprintln!("chosen: {what}: {kernel}");
    }
    for pass in ["forward", "input gradient", "weight gradient", "matmul"] {
        assert!(
            chosen.iter().any(|(what, _)| what.starts_with(pass)),
            "no {pass} chosen by rule: {chosen:?}"
        );
    }
    assert!(
        chosen
            .iter()
            .any(|(_, kernel)| kernel == "pointwise_matmul"),
        "the bottleneck's 1x1 convolutions took no matrix product: {chosen:?}"
    );
    // Strided input gradients (the stem's, the shortcuts', a stride-2 3x3's) as col2im: the
    // input's gradient compared above went through them.
    for strided in [
        "input gradient 3->8 7x7 stride 2",
        "input gradient 16->32 1x1 stride 2",
        "input gradient 8->8 3x3 stride 2",
    ] {
        assert!(
            chosen
                .iter()
                .any(|(what, kernel)| what.starts_with(strided) && kernel == "col2im"),
            "{strided}: not col2im: {chosen:?}"
        );
    }
    // lavapipe has no tensor cores: everything else is Burn's direct kernel.
    assert!(
        chosen.iter().all(|(_, kernel)| [
            "pointwise_matmul",
            "per_image_products",
            "col2im",
            "direct",
            "matmul_cube"
        ]
        .contains(&kernel.as_str())),
        "{chosen:?}"
    );

    let decisions = if log.exists() {
        hearth::gpu::read_decisions(&log).unwrap()
    } else {
        Vec::new()
    };
    // With the disk cache off, the reductions' rules (decisions in that cache) cannot apply:
    // Burn's reductions tune here, and only they. Fusion's fused reductions go by rule without
    // any cache (`hearth_kernels::fused_reduce`); this small network makes none that tune even
    // without the rule (17 decisions, all Burn's reductions, with `HEARTH_REDUCE_RULES=0`):
    // `rules_bundle`'s ResNet-18 does.
    let tuned: Vec<_> = decisions
        .iter()
        .filter(|d| d.kind != DecisionKind::Reduction)
        .collect();
    eprintln!(
        "{} autotune decisions, {} of them Burn's reductions",
        decisions.len(),
        decisions.len() - tuned.len()
    );
    assert!(
        tuned.is_empty(),
        "convolutions, products or fused reductions were autotuned: {tuned:#?}"
    );
    assert!(
        hearth::kernels::fused_reduce::installed(),
        "fusion's fused reductions were not put under the rule"
    );
}

/// `--autotune` takes off or full, and full is refused by name on a device that has no
/// autotune (a CPU backend), before anything runs; so is `--kernel-bundle` there, and a bundle
/// that does not exist.
#[test]
fn autotune_full_on_a_cpu_device_and_an_unknown_value_are_refused_by_name() {
    for (args, expected) in [
        (
            &[
                "--device",
                "flex",
                "--autotune",
                "full",
                "train",
                "--epochs",
                "1",
            ][..],
            "--autotune full: flex has no GPU kernels to tune",
        ),
        (
            &["--autotune", "sometimes", "train", "--epochs", "1"][..],
            "--autotune sometimes: expected off",
        ),
        (
            &[
                "--kernel-bundle",
                "/nonexistent/h200.bundle",
                "launch",
                "-n",
                "1",
                "--",
                "true",
            ][..],
            "--kernel-bundle /nonexistent/h200.bundle: no such file",
        ),
        (
            &["--device", "flex", "--kernel-bundle", "/dev/null", "train"][..],
            "--kernel-bundle: flex has no GPU kernels",
        ),
        (
            &["--device", "flex", "tune", "--out", "flex.bundle"][..],
            "tune: flex has no GPU kernels to tune",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args(args)
            .current_dir(dir.path())
            .env_remove("HEARTH_AUTOTUNE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
        // Nothing was started: no run folder, no data set.
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "{args:?}"
        );
    }
}

/// The kernel bundle CUDA builds embed (`bundles/cuda-sm90.ccb.gz`) unpacks and opens as a
/// bundle of the cubecl version Hearth pins, holding compiled sm_90 kernels: a cubecl upgrade
/// (whose lookups would never match it) or a file cut short fails here, not silently on a
/// user's first GPU run.
#[cfg(feature = "wgpu")]
#[test]
fn the_shipped_sm90_kernel_bundle_opens_and_holds_compiled_kernels() {
    use std::io::Read;

    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bundles/cuda-sm90.ccb.gz"
    ))
    .unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut raw)
        .expect("the shipped bundle does not unpack");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cuda-sm90.ccb");
    std::fs::write(&path, &raw).unwrap();
    let bundle = cubecl::bundle::open(&path).expect("the shipped bundle does not open");
    // Cargo.toml pins cubecl at this version; the bundle's namespaces carry the version they
    // were made with, and only those of the running version are ever looked up.
    let version = "0.11.3";
    let mut kernels = 0usize;
    let namespaces = bundle.namespaces();
    for namespace in &namespaces {
        if namespace.starts_with(&format!("cuda/{version}/ptx_sm90")) {
            bundle.scan(namespace, &mut |_, _| kernels += 1);
        }
    }
    assert!(
        kernels >= 100,
        "{kernels} sm_90 kernels for cubecl {version} in {namespaces:?}"
    );
}
