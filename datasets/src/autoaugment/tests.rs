use super::*;

/// The fixture torchvision wrote (`scripts/make_autoaugment_fixtures.py`).
struct Fixture {
    image: RgbImage,
    /// (policy, op, signed, values)
    spaces: Vec<(String, String, bool, Vec<f64>)>,
    /// (policy, op, bin, magnitude, torchvision's output)
    ops: Vec<(String, String, usize, f64, RgbImage)>,
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("fixture hex"))
        .collect()
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/autoaugment.txt"
    );
    let text = std::fs::read_to_string(path).expect("the autoaugment fixture");
    let (mut w, mut h) = (0, 0);
    let mut f = Fixture {
        image: RgbImage::new(1, 1),
        spaces: Vec::new(),
        ops: Vec::new(),
    };
    let picture = |w, h, hex: &str| RgbImage::from_raw(w, h, unhex(hex)).expect("W x H x 3 bytes");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let p: Vec<&str> = line.split(' ').collect();
        match p[0] {
            "image" => {
                (w, h) = (p[1].parse().unwrap(), p[2].parse().unwrap());
                f.image = picture(w, h, p[3]);
            }
            "space" => f.spaces.push((
                p[1].into(),
                p[2].into(),
                p[3] == "1",
                p[4..]
                    .iter()
                    .filter(|v| !v.is_empty())
                    .map(|v| v.parse().unwrap())
                    .collect(),
            )),
            "op" => f.ops.push((
                p[1].into(),
                p[2].into(),
                p[3].parse().unwrap(),
                p[5].parse().unwrap(),
                picture(w, h, p[6]),
            )),
            other => panic!("unknown fixture line {other:?}"),
        }
    }
    f
}

fn op_index(name: &str) -> usize {
    OPS.iter()
        .position(|o| *o == name)
        .expect("an operation of OPS")
}

fn policy(name: &str) -> Policy {
    match name {
        "rand" => Policy::RandAugment {
            ops: 2,
            magnitude: 9,
        },
        _ => Policy::TrivialAugmentWide,
    }
}

#[test]
fn the_magnitude_tables_are_torchvisions() {
    let f = fixture();
    assert_eq!(f.spaces.len(), 2 * OPS.len());
    for (p, op, signed, values) in &f.spaces {
        let (ours, our_sign) = policy(p).space(op_index(op), 16, 12);
        assert_eq!(&ours, values, "{p} {op}");
        assert_eq!(our_sign, *signed, "{p} {op}");
    }
}

/// Every operation at two magnitudes and both signs against torchvision's `_apply_op`, to the
/// bit (the geometric ones sample their grid in f32 as torch does, so even ties agree).
#[test]
fn every_operation_gives_torchvisions_pixels() {
    let f = fixture();
    assert!(
        f.ops.len() > 40,
        "{} operations in the fixture",
        f.ops.len()
    );
    let mut changed = 0;
    let mut failures = Vec::new();
    for (p, name, bin, m, want) in &f.ops {
        let got = make_op(op_index(name), *m).apply(f.image.clone());
        let differ: Vec<_> = got
            .pixels()
            .zip(want.pixels())
            .filter(|(a, b)| a != b)
            .map(|(a, b)| (a.0, b.0))
            .collect();
        if !differ.is_empty() {
            failures.push(format!(
                "{p} {name} bin {bin} magnitude {m}: {} of {} pixels differ (ours, torchvision's: {:?})",
                differ.len(),
                got.len() / 3,
                &differ[..differ.len().min(3)]
            ));
        }
        if *want != f.image {
            changed += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The image was chosen so that the operations change it (a fixture of no-ops proves nothing).
    assert!(
        changed >= f.ops.len() - 4,
        "only {changed} operations changed the image"
    );
}

#[test]
fn each_policy_draws_every_operation_alike_and_the_same_stream_draws_the_same() {
    for p in [
        Policy::RandAugment {
            ops: 2,
            magnitude: 9,
        },
        Policy::TrivialAugmentWide,
    ] {
        let mut counts = [0usize; OPS.len()];
        let mut negative = 0;
        let mut rng = SplitMix64::new(3);
        let draws = 14_000;
        for _ in 0..draws {
            let ops = p.draw(32, 32, &mut rng);
            let want = if let Policy::RandAugment { ops, .. } = p {
                ops as usize
            } else {
                1
            };
            assert_eq!(ops.len(), want);
            for op in ops {
                let (i, m) = match op {
                    Op::Identity => (0, 0.0),
                    Op::ShearX(m) => (1, m),
                    Op::ShearY(m) => (2, m),
                    Op::TranslateX(m) => (3, m),
                    Op::TranslateY(m) => (4, m),
                    Op::Rotate(m) => (5, m),
                    Op::Brightness(m) => (6, m),
                    Op::Color(m) => (7, m),
                    Op::Contrast(m) => (8, m),
                    Op::Sharpness(m) => (9, m),
                    Op::Posterize(b) => (10, f64::from(b)),
                    Op::Solarize(t) => (11, t),
                    Op::AutoContrast => (12, 0.0),
                    Op::Equalize => (13, 0.0),
                };
                counts[i] += 1;
                if m < 0.0 {
                    negative += 1;
                }
                let (table, signed) = p.space(i, 32, 32);
                if let Policy::RandAugment { magnitude, .. } = p
                    && !table.is_empty()
                {
                    assert_eq!(m.abs(), table[magnitude as usize], "{}", OPS[i]);
                } else if !table.is_empty() {
                    assert!(table.contains(&m.abs()), "{} at {m}", OPS[i]);
                }
                assert!(signed || m >= 0.0);
            }
        }
        let total: usize = counts.iter().sum();
        let each = total as f64 / OPS.len() as f64;
        for (i, c) in counts.iter().enumerate() {
            assert!(
                (*c as f64 - each).abs() < 0.15 * each,
                "{p}: {} drawn {c} times of {total}",
                OPS[i]
            );
        }
        // Nine of the 14 operations carry a sign, drawn half the time.
        let signed = 9.0 / 14.0 * total as f64 / 2.0;
        assert!(
            (negative as f64 - signed).abs() < 0.1 * signed,
            "{p}: {negative} negative"
        );
        let a = p.draw(32, 32, &mut SplitMix64::for_sample(1, 2, 3));
        assert_eq!(a, p.draw(32, 32, &mut SplitMix64::for_sample(1, 2, 3)));
    }
}

#[test]
fn policies_read_timms_and_torchvisions_names_and_refuse_what_is_not_built() {
    let read = |s: &str| s.parse::<Policy>();
    assert_eq!(
        read("rand").unwrap(),
        Policy::RandAugment {
            ops: 2,
            magnitude: 9
        }
    );
    assert_eq!(
        read("rand-m15-n3").unwrap(),
        Policy::RandAugment {
            ops: 3,
            magnitude: 15
        }
    );
    assert_eq!(
        read("rand-n1").unwrap(),
        Policy::RandAugment {
            ops: 1,
            magnitude: 9
        }
    );
    assert_eq!(read("ta_wide").unwrap(), Policy::TrivialAugmentWide);
    assert_eq!(read("trivialaugment").unwrap(), Policy::TrivialAugmentWide);
    for p in [
        Policy::RandAugment {
            ops: 4,
            magnitude: 0,
        },
        Policy::TrivialAugmentWide,
    ] {
        assert_eq!(read(&p.to_string()).unwrap(), p);
    }
    for (bad, says) in [
        ("rand-m9-mstd0.5", "mstd"),
        ("rand-m9-inc1", "inc"),
        ("rand-m31", "above 30"),
        ("rand-n0", "at least 1"),
        ("rand-m", "whole number"),
        ("rand-mx", "unknown part"),
        ("rand-q3", "unknown part"),
        ("autoaugment", "trivialaugment"),
    ] {
        let e = read(bad).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains(bad), "{bad}: {e}");
    }
}

/// Images too small for a 3 x 3 smoothing keep their pixels in Sharpness; a flat image keeps
/// its value through AutoContrast and Equalize (nothing to stretch); no operation panics on a
/// one-pixel image.
#[test]
fn degenerate_images_pass_through_every_operation() {
    let flat = RgbImage::from_pixel(5, 4, image::Rgb([100, 100, 100]));
    assert_eq!(Op::AutoContrast.apply(flat.clone()), flat);
    assert_eq!(Op::Equalize.apply(flat.clone()), flat);
    let tiny = RgbImage::from_pixel(2, 2, image::Rgb([10, 200, 30]));
    assert_eq!(Op::Sharpness(0.9).apply(tiny.clone()), tiny);
    let one = RgbImage::from_pixel(1, 1, image::Rgb([1, 2, 3]));
    for (i, name) in OPS.iter().enumerate() {
        let out = make_op(i, 0.5).apply(one.clone());
        assert_eq!(out.dimensions(), (1, 1), "{name}");
    }
}

/// The vectorised loops (`pixels.rs`) against the operations written pixel by pixel
/// (`reference.rs`), bit for bit: every operation at every bin of both policies' tables with
/// both signs, on images of odd sizes (a last partial vector in every row), a noisy one, one
/// with a flat channel and one of large flat areas (ties in Sharpness' rounding, Equalize's
/// runs), and one a pixel too narrow for Sharpness' interior.
#[test]
fn the_vectorised_operations_equal_the_pixel_by_pixel_ones() {
    let mut rng = SplitMix64::new(7);
    let noisy = |w: u32, h: u32, rng: &mut SplitMix64| {
        let raw = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
        RgbImage::from_raw(w, h, raw).expect("w x h x 3 bytes")
    };
    let mut images = vec![noisy(37, 23, &mut rng), noisy(3, 29, &mut rng)];
    let mut flat_red = noisy(19, 17, &mut rng);
    flat_red.pixels_mut().for_each(|p| p.0[0] = 90);
    images.push(flat_red);
    images.push(RgbImage::from_fn(41, 13, |x, y| {
        image::Rgb([
            (x / 7 * 40) as u8,
            (y / 5 * 60) as u8,
            ((x + y) % 3 * 120) as u8,
        ])
    }));
    let mut checked = 0;
    for img in &images {
        let (w, h) = img.dimensions();
        for policy in [policy("rand"), policy("wide")] {
            for op in 0..OPS.len() {
                let (table, signed) = policy.space(op, w, h);
                let magnitudes: Vec<f64> = if table.is_empty() {
                    vec![0.0]
                } else {
                    table.clone()
                };
                for m in magnitudes {
                    for m in if signed { vec![m, -m] } else { vec![m] } {
                        let op = make_op(op, m);
                        let (got, want) =
                            (op.apply(img.clone()), reference::apply(&op, img.clone()));
                        assert!(got == want, "{op:?} on a {w} x {h} image differs");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 1000, "{checked} operations compared");
}
