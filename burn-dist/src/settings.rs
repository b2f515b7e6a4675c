//! Settings read from the environment: the bottom layer, which every other module may use and
//! which uses none of them.
//!
//! A variable that is unset, empty, not a number or not positive counts as unset, so the
//! caller's default applies.

use std::str::FromStr;
use std::time::Duration;

/// A duration in seconds (fractions allowed), `None` when unset or not a positive number.
pub fn env_secs(key: &str) -> Option<Duration> {
    secs(&std::env::var(key).ok()?)
}

/// A size in MiB, as bytes; `None` when unset or not a positive whole number.
pub fn env_mb(key: &str) -> Option<usize> {
    mib(&std::env::var(key).ok()?)
}

/// Any value that parses from the variable's trimmed text; `None` when unset or unparsable.
pub fn env_parse<T: FromStr>(key: &str) -> Option<T> {
    std::env::var(key).ok()?.trim().parse().ok()
}

/// Whether a switch is off: the variable is set to `0` (unset means on).
pub fn env_off(key: &str) -> bool {
    std::env::var(key).is_ok_and(|v| v.trim() == "0")
}

fn secs(text: &str) -> Option<Duration> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
}

fn mib(text: &str) -> Option<usize> {
    text.trim()
        .parse::<usize>()
        .ok()
        .filter(|&mb| mb > 0)
        .map(|mb| mb << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_and_non_positive_values_fall_back() {
        assert_eq!(secs(" 2.5 "), Some(Duration::from_millis(2500)));
        for bad in ["-1", "0", "NaN", "inf", "ten", ""] {
            assert_eq!(secs(bad), None, "{bad:?}");
        }
        assert_eq!(mib("3"), Some(3 << 20));
        for bad in ["0", "1.5", "-2", "x"] {
            assert_eq!(mib(bad), None, "{bad:?}");
        }
        assert_eq!(env_secs("BURN_DIST_NEVER_SET_ANYWHERE"), None);
        assert!(!env_off("BURN_DIST_NEVER_SET_ANYWHERE"));
    }
}
