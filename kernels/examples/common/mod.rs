//! What the kernel examples share (`mod common;` in each).

use std::time::Instant;

/// The fastest of `reps` timed calls of `f`, in seconds, after one untimed call.
pub fn time_min(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// `name` parsed as a count, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
