use super::*;

#[test]
fn augmentation_presets_build_their_pipelines_and_refuse_bad_values() {
    let light = Augmentation::light().pipeline(32).unwrap();
    assert!(matches!(
        light.steps[0],
        Transform::RandomResizedCrop {
            scale: (0.7, 1.0),
            ..
        }
    ));
    assert!(light.steps.contains(&Transform::HorizontalFlip(0.5)));
    assert_eq!(
        Augmentation::none().pipeline(32).unwrap(),
        Pipeline::eval(32)
    );
    let custom = Augmentation {
        flip: false,
        rotate: 10.0,
        shear: 5.0,
        color_jitter: 0.2,
        ..Augmentation::imagenet()
    };
    let p = custom.pipeline(32).unwrap();
    assert!(
        !p.steps
            .iter()
            .any(|s| matches!(s, Transform::HorizontalFlip(_)))
    );
    assert!(p.steps.contains(&Transform::Rotation(10.0)));
    assert!(p.steps.contains(&Transform::Shear(5.0)));
    assert_eq!(
        custom.to_string(),
        "random crop 0.08-1, rotate 10, shear 5, color jitter 0.2"
    );
    let bad = Augmentation {
        crop_scale: Some((0.9, 0.5)),
        ..Augmentation::none()
    };
    assert!(bad.pipeline(32).is_err());
    let bad = Augmentation {
        rotate: 400.0,
        ..Augmentation::none()
    };
    assert!(bad.pipeline(32).is_err());
}

/// Random erasing against torchvision's rule, by its statistics: about `p` of the images
/// get one zeroed box (every channel), of 2-33% of the area, placed anywhere; the others
/// are untouched; the same (seed, epoch, index) erase the same box.
#[test]
fn random_erasing_zeroes_one_box_of_torchvisions_sizes_in_about_p_of_the_images() {
    let aug = Augmentation {
        random_erasing: 0.5,
        ..Augmentation::none()
    };
    assert_eq!(aug.to_string(), "resize + center crop, random erasing 0.5");
    let p = aug.pipeline(32).unwrap();
    let plain = Augmentation::none().pipeline(32).unwrap();
    let img = gradient(40, 36);
    let (mut erased, n) = (0, 2000);
    let mut fractions = Vec::new();
    for index in 0..n {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        p.apply(img.clone(), 7, 1, index, &mut a);
        plain.apply(img.clone(), 7, 1, index, &mut b);
        let changed: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
        if changed.is_empty() {
            continue;
        }
        erased += 1;
        assert!(
            changed.iter().all(|&i| a[i] == 0.0),
            "erased to the mean (0)"
        );
        // The same pixels of each of the 3 channels.
        let plane = 32 * 32;
        let per: Vec<usize> = changed.iter().filter(|&&i| i < plane).copied().collect();
        for c in 1..3 {
            for &i in &per {
                assert_eq!(a[c * plane + i], 0.0);
            }
        }
        fractions.push(per.len() as f64 / plane as f64);
        let mut again = Vec::new();
        p.apply(img.clone(), 7, 1, index, &mut again);
        assert_eq!(again, a);
    }
    let rate = erased as f64 / n as f64;
    assert!((0.45..0.55).contains(&rate), "{rate}");
    // A pixel may keep its value inside the box where it was 0 already: at most the box.
    assert!(fractions.iter().all(|&f| f <= 0.34), "{fractions:?}");
    let mean = fractions.iter().sum::<f64>() / fractions.len() as f64;
    assert!((0.12..0.2).contains(&mean), "mean area {mean}");
    assert!(
        Augmentation {
            random_erasing: 1.5,
            ..Augmentation::none()
        }
        .pipeline(32)
        .is_err()
    );
}

fn gradient(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        Rgb([(x * 7 % 256) as u8, (y * 5 % 256) as u8, 128])
    })
}

#[test]
fn same_seed_epoch_index_same_output_and_others_differ() {
    let p = Pipeline::train(32)
        .with(Transform::Rotation(15.0))
        .unwrap()
        .with(Transform::Shear(10.0))
        .unwrap()
        .with(Transform::ColorJitter {
            brightness: 0.2,
            contrast: 0.2,
            saturation: 0.2,
        })
        .unwrap();
    let img = gradient(64, 48);
    let a = p.apply_image(img.clone(), 1, 0, 3);
    assert_eq!(a, p.apply_image(img.clone(), 1, 0, 3));
    assert_ne!(a, p.apply_image(img.clone(), 1, 1, 3));
    assert_ne!(a, p.apply_image(img.clone(), 1, 0, 4));
    assert_eq!(a.dimensions(), (32, 32));
}

#[test]
fn random_resized_crop_box_stays_inside_and_respects_scale() {
    let mut rng = SplitMix64::new(3);
    for _ in 0..500 {
        let (x, y, w, h) =
            random_resized_crop_box(100, 60, (0.08, 1.0), (0.75, 4.0 / 3.0), &mut rng);
        assert!(w >= 1 && h >= 1 && x + w <= 100 && y + h <= 60);
    }
    // Impossible aspect ratios fall back to a centred crop with the ratio clamped.
    let (x, y, w, h) = random_resized_crop_box(100, 10, (0.99, 1.0), (1.0, 1.0), &mut rng);
    assert_eq!((w, h), (10, 10));
    assert_eq!((x, y), (45, 0));
}

#[test]
fn flip_mirrors_and_zero_rotation_is_identity() {
    let img = gradient(8, 4);
    let flipped = Transform::HorizontalFlip(1.0).apply(img.clone(), &mut SplitMix64::new(0));
    assert_eq!(flipped.get_pixel(0, 0), img.get_pixel(7, 0));
    let same = affine(&img, 0.0, 0.0);
    assert_eq!(same, img);
}

#[test]
fn rotation_by_90_degrees_moves_corners() {
    let mut img = RgbImage::new(9, 9);
    img.put_pixel(8, 4, Rgb([255, 255, 255])); // right middle
    let r = affine(&img, std::f64::consts::FRAC_PI_2, 0.0);
    // A +90 degree rotation (y down) takes the right middle pixel to the bottom middle.
    assert_eq!(r.get_pixel(4, 8), &Rgb([255, 255, 255]));
}

#[test]
fn invalid_parameters_are_errors() {
    assert!(Pipeline::new(vec![Transform::HorizontalFlip(1.5)], 8).is_err());
    assert!(Pipeline::new(vec![Transform::Rotation(270.0)], 8).is_err());
    assert!(Pipeline::new(vec![Transform::CenterCrop(0)], 8).is_err());
    // A side past the largest is refused by name, not left to fail an allocation.
    assert!(Pipeline::new(vec![], crate::MAX_IMAGE_SIZE).is_ok());
    let err = Pipeline::new(vec![], crate::MAX_IMAGE_SIZE + 1).unwrap_err();
    assert!(
        err.to_string().contains("above the largest image side"),
        "{err}"
    );
    assert!(
        Pipeline::new(
            vec![Transform::RandomResizedCrop {
                size: 8,
                scale: (0.5, 0.1),
                ratio: (1.0, 1.0)
            }],
            8
        )
        .is_err()
    );
}

/// `auto_augment` adds the policy after the image steps: the pixels of an image change for
/// most samples (TrivialAugmentWide draws Identity one time in 14), the same sample gets the
/// same operation, and a policy outside torchvision's ranges is refused.
#[test]
fn an_auto_augment_policy_runs_after_the_flip_and_repeats_for_the_same_sample() {
    use crate::autoaugment::Policy;
    for policy in [
        Policy::TrivialAugmentWide,
        Policy::RandAugment {
            ops: 2,
            magnitude: 9,
        },
    ] {
        let aug = Augmentation {
            auto_augment: Some(policy),
            ..Augmentation::light()
        };
        assert_eq!(
            aug.to_string(),
            format!("random crop 0.7-1, flip, auto augment {policy}")
        );
        let p = aug.pipeline(32).unwrap();
        assert_eq!(p.steps.last(), Some(&Transform::AutoAugment(policy)));
        let plain = Augmentation::light().pipeline(32).unwrap();
        let img = gradient(40, 36);
        let n = 200;
        let changed = (0..n)
            .filter(|&i| {
                let a = p.apply_image(img.clone(), 5, 2, i);
                assert_eq!(a, p.apply_image(img.clone(), 5, 2, i));
                a != plain.apply_image(img.clone(), 5, 2, i)
            })
            .count();
        assert!(
            changed > n as usize * 3 / 4,
            "{policy}: {changed} of {n} changed"
        );
    }
    for bad in [
        Policy::RandAugment {
            ops: 0,
            magnitude: 9,
        },
        Policy::RandAugment {
            ops: 2,
            magnitude: 31,
        },
    ] {
        let aug = Augmentation {
            auto_augment: Some(bad),
            ..Augmentation::none()
        };
        assert!(aug.pipeline(32).is_err(), "{bad:?}");
    }
}
