//! What a collective and a training step cost, as a model: the alpha-beta cost of the ring and
//! hierarchical allreduce, fitted to measured times, and a data-parallel step built from its
//! measured compute and its gradient exchange, with or without the exchange overlapped with the
//! backward pass. `cargo bench --bench scaling` fits it to runs over shaped links and predicts
//! images/s and scaling efficiency for hosts it cannot run.
//!
//! The ring allreduce of `S` bytes over `n` ranks takes `2(n-1)` steps; in each, every rank
//! sends and receives `S/n` bytes. With `alpha` seconds per step (latency and per-message work)
//! and `bandwidth` bytes per second per link, it takes `2(n-1) (alpha + S / (n bandwidth))`.
//! That is the textbook model (Thakur, Rabenseifner and Gropp, 2005) that Horovod's and NCCL's
//! analyses use.

/// Cost of one message step on a link: a fixed part and a part per byte.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkCost {
    /// Seconds per step whatever its size (latency, framing, scheduling).
    pub alpha_s: f64,
    /// Bytes per second one rank moves each way.
    pub bandwidth_bps: f64,
}

impl LinkCost {
    /// Seconds of a ring allreduce of `bytes` over `n` ranks.
    pub fn ring_allreduce(&self, n: usize, bytes: f64) -> f64 {
        // A core per rank, and cores never the limit.
        self.ring_allreduce_on_cores(n, bytes, n, f64::INFINITY)
    }

    /// Seconds of a ring allreduce of `bytes` over `n` ranks that share `cores` cores, each
    /// core's transport moving `core_bps` bytes per second (what a machine running several
    /// "hosts" in network namespaces measures): a step moves a share at the slower of the link
    /// and the share of a core each rank gets.
    pub fn ring_allreduce_on_cores(
        &self,
        n: usize,
        bytes: f64,
        cores: usize,
        core_bps: f64,
    ) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let sharing = (n as f64 / cores.max(1) as f64).max(1.0);
        let per_byte = (1.0 / self.bandwidth_bps).max(sharing / core_bps);
        2.0 * (n as f64 - 1.0) * (self.alpha_s + bytes / n as f64 * per_byte)
    }

    /// Least-squares fit of `alpha_s` and `bandwidth_bps` to measured ring allreduces
    /// `(ranks, bytes, seconds)`: time is linear in `2(n-1)` and `2(n-1)/n * bytes`. `None`
    /// with fewer than two points, or when the fit has no positive bandwidth (the times do not
    /// grow with the bytes). Where alpha would be negative, or the points cannot separate the
    /// two terms, alpha is zero and the bandwidth fitted through the origin.
    pub fn fit(samples: &[(usize, f64, f64)]) -> Option<LinkCost> {
        let rows: Vec<(f64, f64, f64)> = samples
            .iter()
            .filter(|s| s.0 >= 2 && s.1 > 0.0 && s.2 > 0.0)
            .map(|&(n, bytes, secs)| {
                let steps = 2.0 * (n as f64 - 1.0);
                (steps, steps * bytes / n as f64, secs)
            })
            .collect();
        if rows.len() < 2 {
            return None;
        }
        // secs = alpha * x1 + inv_bw * x2, by the normal equations, with x2 scaled to the
        // order of x1 so that the 2x2 system stays well conditioned.
        let scale = rows.iter().map(|r| r.1).fold(0.0, f64::max);
        let (mut a11, mut a12, mut a22, mut b1, mut b2) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(x1, x2, y) in &rows {
            let x2 = x2 / scale;
            a11 += x1 * x1;
            a12 += x1 * x2;
            a22 += x2 * x2;
            b1 += x1 * y;
            b2 += x2 * y;
        }
        let det = a11 * a22 - a12 * a12;
        let solved = (det > 1e-12 * a11 * a22)
            .then(|| ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det));
        // One distinct point, or a negative alpha: a line through the origin.
        let (alpha, inv_bw) = match solved {
            Some((alpha, inv_bw)) if alpha >= 0.0 => (alpha, inv_bw),
            _ => (0.0, b2 / a22),
        };
        let inv_bw = inv_bw / scale;
        (inv_bw > 0.0 && inv_bw.is_finite()).then(|| LinkCost {
            alpha_s: alpha,
            bandwidth_bps: 1.0 / inv_bw,
        })
    }
}

/// A hierarchical allreduce: the ranks of each host reduce to their leader through memory,
/// the leaders run a ring between hosts, the leaders broadcast back through memory (what
/// burn-dist does when a job has several ranks on several hosts).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hierarchy {
    /// Ranks per host.
    pub per_host: usize,
    /// Bytes per second of the in-host reduction and of the broadcast, each.
    pub local_bps: f64,
    /// The links between hosts.
    pub between: LinkCost,
}

impl Hierarchy {
    /// Seconds of an allreduce of `bytes` over `hosts` hosts of `per_host` ranks.
    pub fn allreduce(&self, hosts: usize, bytes: f64) -> f64 {
        let local = if self.per_host > 1 {
            2.0 * bytes / self.local_bps
        } else {
            0.0
        };
        local + self.between.ring_allreduce(hosts, bytes)
    }
}

/// One data-parallel training step: measured compute, and gradients exchanged in buckets.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCost {
    /// Seconds of the forward pass (and the loss).
    pub forward_s: f64,
    /// Seconds of the backward pass.
    pub backward_s: f64,
    /// Seconds after the exchange: the optimizer update.
    pub update_s: f64,
    /// Bytes of each fusion bucket, in the order the backward pass produces them.
    pub buckets: Vec<f64>,
}

impl StepCost {
    /// A step whose `grad_bytes` of gradients go in `buckets` equal buckets.
    pub fn even(
        forward_s: f64,
        backward_s: f64,
        update_s: f64,
        grad_bytes: f64,
        buckets: usize,
    ) -> Self {
        let k = buckets.max(1);
        StepCost {
            forward_s,
            backward_s,
            update_s,
            buckets: vec![grad_bytes / k as f64; k],
        }
    }

    /// Seconds of the step without any exchange (one rank alone).
    pub fn compute_s(&self) -> f64 {
        self.forward_s + self.backward_s + self.update_s
    }

    /// Seconds of the step when each bucket's exchange takes `exchange(bytes)` seconds.
    ///
    /// Without overlap, every bucket goes after the whole backward pass. With it, bucket `i`
    /// can start once the backward pass has produced it (the buckets' bytes spread evenly over
    /// the backward pass) and once bucket `i-1` is done: one exchange at a time, as one
    /// communicator runs them.
    pub fn step_s(&self, overlap: bool, exchange: impl Fn(f64) -> f64) -> f64 {
        let total: f64 = self.buckets.iter().sum();
        let mut produced = 0.0;
        let mut done = 0.0f64;
        for &b in &self.buckets {
            produced += b;
            let ready = if overlap && total > 0.0 {
                self.backward_s * produced / total
            } else {
                self.backward_s
            };
            done = done.max(ready) + exchange(b);
        }
        self.forward_s + done.max(self.backward_s) + self.update_s
    }

    /// `compute_s / step_s`: the share of the step that is the one-rank step (1.0 is perfect
    /// scaling).
    pub fn efficiency(&self, overlap: bool, exchange: impl Fn(f64) -> f64) -> f64 {
        self.compute_s() / self.step_s(overlap, exchange)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_costs_two_n_minus_one_steps_of_a_share_each() {
        let link = LinkCost {
            alpha_s: 1e-3,
            bandwidth_bps: 1e9,
        };
        assert_eq!(link.ring_allreduce(1, 1e9), 0.0);
        // 2 ranks, 1 GB: 2 steps of 0.5 GB at 1 GB/s plus 2 ms.
        assert!((link.ring_allreduce(2, 1e9) - 1.002).abs() < 1e-12);
        // The bandwidth term tends to 2 S / B, the latency term grows with n.
        let big = link.ring_allreduce(512, 1e9);
        assert!((big - (2.0 * 511.0 / 512.0 + 2.0 * 511.0 * 1e-3)).abs() < 1e-9);
    }

    #[test]
    fn ranks_sharing_cores_go_at_their_share_of_a_core_where_the_link_is_faster() {
        let link = LinkCost {
            alpha_s: 0.0,
            bandwidth_bps: 1e9,
        };
        // As many cores as ranks and cores faster than the link: the plain ring.
        assert_eq!(
            link.ring_allreduce_on_cores(2, 1e9, 2, 5e9),
            link.ring_allreduce(2, 1e9)
        );
        // 8 ranks on 2 cores of 1 GB/s: each rank gets a quarter of a core, 0.25 GB/s.
        let t = link.ring_allreduce_on_cores(8, 1e9, 2, 1e9);
        assert!((t - 14.0 * (1e9 / 8.0) / 0.25e9).abs() < 1e-9, "{t}");
        assert_eq!(link.ring_allreduce_on_cores(1, 1e9, 1, 1.0), 0.0);
    }

    #[test]
    fn the_fit_recovers_the_cost_it_was_made_from() {
        let truth = LinkCost {
            alpha_s: 2.5e-4,
            bandwidth_bps: 3.0e8,
        };
        let samples: Vec<_> = [2usize, 4, 8]
            .iter()
            .flat_map(|&n| [1e7, 1e8].map(|b| (n, b, truth.ring_allreduce(n, b))))
            .collect();
        let fit = LinkCost::fit(&samples).unwrap();
        assert!((fit.alpha_s - truth.alpha_s).abs() < 1e-9, "{fit:?}");
        assert!(
            (fit.bandwidth_bps / truth.bandwidth_bps - 1.0).abs() < 1e-9,
            "{fit:?}"
        );
        // Too little to fit, or nothing that grows with the bytes.
        assert_eq!(LinkCost::fit(&samples[..1]), None);
        assert_eq!(LinkCost::fit(&[(2, 1e6, 0.0), (4, 1e7, 0.0)]), None);
        // Times that would need a negative alpha: clamped to zero, the bandwidth through the
        // origin.
        let odd = LinkCost::fit(&[(2, 1e6, 0.001), (2, 1e8, 0.2)]).unwrap();
        assert_eq!(odd.alpha_s, 0.0);
        assert!(odd.bandwidth_bps > 0.0, "{odd:?}");
        // Times that fall as the bytes grow: no bandwidth to fit.
        assert_eq!(LinkCost::fit(&[(2, 1e6, 0.2), (2, 1e8, 0.001)]), None);
    }

    #[test]
    fn a_hierarchy_adds_the_in_host_passes_to_the_ring_between_hosts() {
        let between = LinkCost {
            alpha_s: 0.0,
            bandwidth_bps: 1e9,
        };
        let h = Hierarchy {
            per_host: 4,
            local_bps: 1e10,
            between,
        };
        assert!((h.allreduce(2, 1e9) - (0.2 + 1.0)).abs() < 1e-12);
        let flat = Hierarchy { per_host: 1, ..h };
        assert_eq!(flat.allreduce(2, 1e9), between.ring_allreduce(2, 1e9));
    }

    #[test]
    fn overlap_hides_the_exchange_behind_the_backward_pass() {
        // 4 buckets of 25 bytes, 1 s each to exchange at 25 B/s; backward 4 s.
        let step = StepCost::even(1.0, 4.0, 0.5, 100.0, 4);
        let xchg = |b: f64| b / 25.0;
        assert_eq!(step.compute_s(), 5.5);
        // Without overlap: all 4 s of exchange after the backward pass.
        assert_eq!(step.step_s(false, xchg), 9.5);
        // With it: each bucket is exchanged while the next is computed; only the last is left.
        assert_eq!(step.step_s(true, xchg), 1.0 + 4.0 + 1.0 + 0.5);
        // An exchange slower than the backward pass shows through: 4 buckets of 2 s after the
        // first is produced at 1 s.
        assert_eq!(step.step_s(true, |b| b / 12.5), 1.0 + 1.0 + 8.0 + 0.5);
        assert!(step.efficiency(true, xchg) > step.efficiency(false, xchg));
        // No exchange: the one-rank step.
        assert_eq!(step.efficiency(false, |_| 0.0), 1.0);
    }
}
