//! Parameter servers: some ranks hold the model's values, sharded ([`crate::flat::layout`]); the others
//! train and push to them and pull from them ([`client`]), synchronously or asynchronously by
//! one of the rules in [`rules`] (DOWNPOUR, ADAG, DynSGD, EASGD; sources there). burn-dist
//! stays free of model code: a server holds a slice of one flat `f32` vector made of named
//! tensors ([`crate::flat`]: the layout, the module glue and the optimizer, which the sharded
//! optimizer of [`crate::zero`] shares).
//!
//! ```
//! use std::sync::Arc;
//! use burn_dist::flat::layout::Layout;
//! use burn_dist::ps::{Mode, client::{Client, PsWorker}, server::{ServerConfig, serve}};
//! use burn_dist::transport::{Transport, memory::MemoryTransport};
//!
//! // Rank 0 serves the one shard of a 2-value model; ranks 1 and 2 train with ADAG.
//! let layout = Layout::new(&[("w".to_string(), 2)], 1).unwrap();
//! let mut ranks = MemoryTransport::mesh(3).into_iter();
//! let server = ranks.next().unwrap();
//! let mut cfg = ServerConfig::new(Mode::Adag);
//! cfg.window = 2;
//! let s = std::thread::spawn(move || serve(&server, &cfg, vec![0.0, 0.0], &[1, 2], &mut |_| {}));
//! let workers: Vec<_> = ranks.map(|t| {
//!     let layout = layout.clone();
//!     std::thread::spawn(move || {
//!         let client = Client::new(Arc::new(t) as Arc<dyn Transport>, layout, vec![0]).unwrap();
//!         let (mut w, mut params) = PsWorker::start(client, Mode::Adag, 2, 0.1, 0.0).unwrap();
//!         for _ in 0..20 {
//!             // The gradient of (p - 1)^2 / 2 for every value.
//!             let grad: Vec<f32> = params.iter().map(|p| p - 1.0).collect();
//!             w.step(&mut params, &grad, 1).unwrap();
//!         }
//!         w.finish().unwrap();
//!     })
//! }).collect();
//! for w in workers { w.join().unwrap(); }
//! let report = s.join().unwrap().unwrap();
//! assert!(report.values.iter().all(|v| (v - 1.0).abs() < 0.2), "{:?}", report.values);
//! ```

mod agreement;
pub mod client;
pub mod message;
pub mod rules;
pub mod server;

/// How workers and servers update the model (see [`rules`] for each rule and its source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every step waits for every worker; equals allreduce data parallel.
    Sync,
    /// Push the accumulated change every window, pull fresh values.
    Downpour,
    /// DOWNPOUR with the change divided by the window.
    Adag,
    /// DOWNPOUR with the change divided by its staleness + 1.
    DynSgd,
    /// Asynchronous elastic averaging.
    Easgd,
}

impl Mode {
    pub const ALL: [Mode; 5] = [
        Mode::Sync,
        Mode::Downpour,
        Mode::Adag,
        Mode::DynSgd,
        Mode::Easgd,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Downpour => "downpour",
            Mode::Adag => "adag",
            Mode::DynSgd => "dynsgd",
            Mode::Easgd => "easgd",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = crate::DistError;
    fn from_str(s: &str) -> crate::Result<Self> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                crate::DistError::Config(format!(
                    "unknown parameter-server mode {s:?} (sync, downpour, adag, dynsgd, easgd)"
                ))
            })
    }
}
