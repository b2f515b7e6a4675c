use super::*;

fn device() -> Device {
    Device::flex()
}

fn mixing(mixup: f64, cutmix: f64) -> Mixing {
    Mixing {
        mixup,
        cutmix,
        ..Mixing::default()
    }
}

/// A batch whose every value says where it is: `1000 n + 100 c + 10 y + x` (small sides).
fn batch(n: usize, c: usize, h: usize, w: usize) -> (Vec<f32>, Tensor<4>) {
    let mut v = Vec::with_capacity(n * c * h * w);
    for i in 0..n {
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    v.push((1000 * i + 100 * ch + 10 * y + x) as f32);
                }
            }
        }
    }
    let t = Tensor::<1>::from_floats(v.as_slice(), &device()).reshape([n, c, h, w]);
    (v, t)
}

fn values(t: Tensor<4>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 values")
}

#[test]
fn roll_is_torch_roll_by_one() {
    let t = Tensor::<1, Int>::from_ints([0, 1, 2, 3], &device());
    let r = roll(t)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("ints");
    assert_eq!(r, vec![3, 0, 1, 2]);
}

#[test]
fn beta_draws_have_betas_mean_and_variance() {
    // Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)); 20,000 draws put the sample mean
    // within 0.01 and the variance within 10% (several standard errors).
    for alpha in [0.2, 1.0, 2.0] {
        let mut rng = SplitMix64::new(11);
        let draws: Vec<f64> = (0..20_000).map(|_| beta(&mut rng, alpha)).collect();
        assert!(
            draws.iter().all(|l| (0.0..=1.0).contains(l)),
            "alpha {alpha}"
        );
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let var = draws.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / draws.len() as f64;
        let want = 1.0 / (4.0 * (2.0 * alpha + 1.0));
        assert!((mean - 0.5).abs() < 0.01, "alpha {alpha}: mean {mean}");
        assert!(
            (var / want - 1.0).abs() < 0.1,
            "alpha {alpha}: variance {var}, want {want}"
        );
    }
}

#[test]
fn mixup_blends_each_image_with_the_one_before_it() {
    let (n, c, h, w) = (3, 2, 2, 3);
    let (v, t) = batch(n, c, h, w);
    let lam = 0.3;
    let got = values(Mix::Blend { lam }.images(t));
    let per = c * h * w;
    for i in 0..n {
        let before = (i + n - 1) % n;
        for k in 0..per {
            let want = lam as f32 * v[i * per + k] + (1.0 - lam as f32) * v[before * per + k];
            assert!(
                (got[i * per + k] - want).abs() < 1e-3,
                "sample {i} value {k}"
            );
        }
    }
}

#[test]
fn cutmix_pastes_the_box_of_the_image_before_and_the_rest_stays() {
    let (n, c, h, w) = (3, 2, 6, 5);
    let (v, t) = batch(n, c, h, w);
    let mix = Mix::Paste {
        lam: 1.0 - 6.0 / 30.0,
        rows: 1..4,
        cols: 2..4,
    };
    let got = values(mix.images(t));
    for i in 0..n {
        let before = (i + n - 1) % n;
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    let at = |s: usize| ((s * c + ch) * h + y) * w + x;
                    let inside = (1..4).contains(&y) && (2..4).contains(&x);
                    let want = if inside { v[at(before)] } else { v[at(i)] };
                    assert_eq!(got[at(i)], want, "sample {i} channel {ch} at ({y}, {x})");
                }
            }
        }
    }
    // An empty box leaves the batch as it was.
    let (v, t) = batch(2, 1, 3, 3);
    let empty = Mix::Paste {
        lam: 1.0,
        rows: 1..1,
        cols: 0..3,
    };
    assert_eq!(values(empty.images(t)), v);
}

#[test]
fn cutmix_boxes_follow_torchvisions_rule_and_lam_is_the_share_left() {
    let m = mixing(0.0, 1.0);
    let (h, w) = (32, 24);
    let mut lams = Vec::new();
    for b in 0..2000usize {
        let Some(Mix::Paste { lam, rows, cols }) = m.draw(5, 0, &[b, b + 1], h, w) else {
            panic!("cutmix alone always pastes");
        };
        assert!(rows.end <= h && cols.end <= w && rows.start <= rows.end);
        // Half-sides int(r * side) about a centre: a box not cut by a border has even sides,
        // and its sides keep the image's proportions (r is the same for both).
        if rows.start > 0 && rows.end < h && cols.start > 0 && cols.end < w {
            assert_eq!(rows.len() % 2, 0);
            assert_eq!(cols.len() % 2, 0);
            let (rh, rw) = (
                rows.len() as f64 / 2.0 / h as f64,
                cols.len() as f64 / 2.0 / w as f64,
            );
            assert!(
                (rh - rw).abs() <= 1.0 / w as f64 + 1.0 / h as f64,
                "{rows:?} {cols:?}"
            );
        }
        let area = (rows.len() * cols.len()) as f64 / (h * w) as f64;
        assert!((lam - (1.0 - area)).abs() < 1e-12);
        lams.push(lam);
    }
    // Beta(1, 1) gives 1 - lam uniform; borders cut the box and int() rounds it down, so the
    // mean share left is above one half: torchvision's rule simulated over 200,000 draws (in
    // Python, at 32 x 24) gives 0.704; 2,000 draws have a standard error near 0.005.
    let mean = lams.iter().sum::<f64>() / lams.len() as f64;
    assert!((0.68..0.73).contains(&mean), "mean lam {mean}");
}

#[test]
fn draws_depend_on_seed_epoch_and_batch_alone_and_obey_the_switches() {
    let m = mixing(0.2, 1.0);
    let a = m.draw(1, 3, &[4, 9, 2], 8, 8);
    assert_eq!(a, m.draw(1, 3, &[4, 9, 2], 8, 8));
    let others = [
        m.draw(2, 3, &[4, 9, 2], 8, 8),
        m.draw(1, 4, &[4, 9, 2], 8, 8),
        m.draw(1, 3, &[4, 9, 3], 8, 8),
    ];
    assert!(others.iter().all(|o| *o != a), "{a:?} {others:?}");
    let count = |m: &Mixing, pick: fn(&Option<Mix>) -> bool| {
        (0..1000usize)
            .filter(|b| pick(&m.draw(1, 0, &[*b], 8, 8)))
            .count()
    };
    let pasted = |d: &Option<Mix>| matches!(d, Some(Mix::Paste { .. }));
    let mixed = |d: &Option<Mix>| d.is_some();
    // Both on: cutmix about switch_prob of the time.
    let half = count(&m, pasted);
    assert!((400..600).contains(&half), "{half} of 1000 pasted");
    let always = Mixing {
        switch_prob: 1.0,
        ..m.clone()
    };
    assert_eq!(count(&always, pasted), 1000);
    let never = Mixing {
        switch_prob: 0.0,
        ..m.clone()
    };
    assert_eq!(count(&never, pasted), 0);
    // prob: the share of batches mixed at all.
    let some = Mixing {
        prob: 0.3,
        ..m.clone()
    };
    let n = count(&some, mixed);
    assert!((230..370).contains(&n), "{n} of 1000 mixed");
    // off_epoch 2: epochs 0 and 1 (the first two) mix, epoch 2 on does not.
    let off = Mixing {
        off_epoch: 2,
        ..m.clone()
    };
    assert!(off.draw(1, 1, &[0], 8, 8).is_some());
    assert!(off.draw(1, 2, &[0], 8, 8).is_none());
    assert!(mixing(0.0, 0.0).draw(1, 0, &[0], 8, 8).is_none());
}

#[test]
fn bad_settings_are_named() {
    assert!(Mixing::default().check().is_none());
    let (name, e) = mixing(-1.0, 0.0).check().expect("refused");
    assert_eq!(name, "mixup", "{e}");
    assert!(e.contains("-1"), "{e}");
    let e = Mixing {
        switch_prob: 1.5,
        ..mixing(0.2, 0.0)
    }
    .check()
    .expect("refused");
    assert_eq!(e.0, "mixup_switch_prob", "{e:?}");
    let (name, _) = mixing(0.0, f64::NAN).check().expect("refused");
    assert_eq!(name, "cutmix");
    // Switches that would change nothing are refused by name.
    let idle = |m: Mixing| m.check().map(|(name, _)| name);
    let prob = Mixing {
        prob: 0.5,
        ..Mixing::default()
    };
    assert_eq!(idle(prob), Some("mixup_prob"));
    let off = Mixing {
        off_epoch: 3,
        ..Mixing::default()
    };
    assert_eq!(idle(off), Some("mixup_off_epoch"));
    let switch = Mixing {
        switch_prob: 0.3,
        ..mixing(0.2, 0.0)
    };
    assert_eq!(idle(switch), Some("mixup_switch_prob"));
    let both = Mixing {
        switch_prob: 0.3,
        ..mixing(0.2, 1.0)
    };
    assert_eq!(idle(both), None);
}
