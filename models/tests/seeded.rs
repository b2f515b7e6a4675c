//! Loading torchvision weights into a new model draws nothing from Burn's random generator.
//!
//! Why it matters: Burn keeps one generator per process and makes a parameter's random values
//! lazily, on its first use. Hearth's trainings seed it and make their parameters under one
//! lock, so that concurrent trainings in a process (tests, an embedding program) each start
//! from their seed; a load that made a lazy head to read its shape (`num_classes`) took draws
//! from whichever seeded initialisation ran beside it. In CI a resumed run then started from
//! other weights than the uninterrupted one it was compared with (`cli/tests/train.rs`,
//! `resuming_after_an_epoch_ends_with_the_same_weights`: bn1.beta 0.085 apart).
//!
//! One test in this binary: nothing else draws from the generator between its seed and its
//! draws.

use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_models::{
    BlockKind, LoadOptions, ModelConfig, ResNetConfig, export_torchvision, export_torchvision_pth,
    load_torchvision,
};

fn draws(device: &Device) -> Vec<f32> {
    Tensor::<1>::random([16], Distribution::Default, device)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 draws")
}

#[test]
fn loading_torchvision_weights_draws_nothing_from_the_random_generator() {
    let device = Device::flex();
    let config = ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], 5)
            .with_stem_width(16)
            .with_stage_widths([16, 32, 64, 128]),
    );
    let dir = std::env::temp_dir().join(format!("hearth-seeded-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = config.init(&device).unwrap();
    let files = [dir.join("w.pth"), dir.join("w.safetensors")];
    export_torchvision_pth(&source, &files[0]).unwrap();
    export_torchvision(&source, &files[1]).unwrap();

    device.seed(11);
    let want = draws(&device);
    for path in &files {
        device.seed(11);
        let mut model = config.init(&device).unwrap();
        assert_eq!((model.num_classes(), model.head_inputs()), (5, 128));
        load_torchvision(&mut model, path, &LoadOptions::default()).unwrap();
        assert_eq!(
            draws(&device),
            want,
            "{}: reading the head's shape or loading the file drew from the generator",
            path.display()
        );
        // The values are the file's, not draws: written back, the same bytes.
        let back = dir.join("back.safetensors");
        export_torchvision(&model, &back).unwrap();
        assert!(
            std::fs::read(&back).unwrap() == std::fs::read(&files[1]).unwrap(),
            "{}: the loaded model is not the file's",
            path.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
