//! The additions of the in-segment collectives, compiled for the widest vectors this CPU has
//! (chosen once, at run time). A build for the baseline x86-64 adds four values at a time: with
//! 4 ranks on 2 cores, where the ranks' additions share the cores, a C model of the in-place
//! allreduce took 17 ms for 100 MB built that way and 13 ms with AVX-512 (BENCHMARKS.md).

#[inline(always)]
fn add_body(acc: &mut [f32], src: &[f32]) {
    acc.iter_mut().zip(src).for_each(|(a, s)| *a += s);
}

#[inline(always)]
fn add_both_body(acc: &mut [f32], other: &mut [f32]) {
    for (a, m) in acc.iter_mut().zip(other.iter_mut()) {
        let sum = *a + *m;
        *a = sum;
        *m = sum;
    }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    #[target_feature(enable = "avx512f")]
    pub(super) fn add_avx512(acc: &mut [f32], src: &[f32]) {
        super::add_body(acc, src)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn add_avx2(acc: &mut [f32], src: &[f32]) {
        super::add_body(acc, src)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn add_both_avx512(acc: &mut [f32], other: &mut [f32]) {
        super::add_both_body(acc, other)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn add_both_avx2(acc: &mut [f32], other: &mut [f32]) {
        super::add_both_body(acc, other)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Width {
    Avx512,
    Avx2,
    Base,
}

fn width() -> Width {
    static WIDTH: std::sync::OnceLock<Width> = std::sync::OnceLock::new();
    *WIDTH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Width::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Width::Avx2;
            }
        }
        Width::Base
    })
}

/// `acc += src`, value by value (over the shorter of the two).
pub(crate) fn add_assign(acc: &mut [f32], src: &[f32]) {
    match width() {
        // SAFETY: the CPU has the feature (checked by `width`).
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { wide::add_avx512(acc, src) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { wide::add_avx2(acc, src) },
        _ => add_body(acc, src),
    }
}

/// `acc += other`, and the sum into `other` as well.
pub(crate) fn add_both(acc: &mut [f32], other: &mut [f32]) {
    match width() {
        // SAFETY: the CPU has the feature (checked by `width`).
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { wide::add_both_avx512(acc, other) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { wide::add_both_avx2(acc, other) },
        _ => add_both_body(acc, other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_adds_the_same() {
        let a: Vec<f32> = (0..1037).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..1037).map(|i| (i as f32 * 1.91).cos()).collect();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let mut acc = a.clone();
        add_assign(&mut acc, &b);
        assert_eq!(acc, want, "{:?}", width());
        let (mut acc, mut other) = (a.clone(), b.clone());
        add_both(&mut acc, &mut other);
        assert_eq!((&acc, &other), (&want, &want));
        let mut base = a.clone();
        add_body(&mut base, &b);
        assert_eq!(base, want);
    }
}
