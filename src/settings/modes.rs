//! How a run's processes share the training ([`TrainingMode`]) and each distributed mode's own
//! options: pipeline stages, parameter servers, elastic membership. What the modes do with
//! them lives in `crate::train`'s mode modules.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use burn_dist::ps::Mode;

use super::PipelineBalance;
use crate::{HearthError, Result};

/// How a run's processes share the training: exactly one mode, carrying its own options.
///
/// The ranks themselves (`TrainConfig::dist`) come from the launcher, not from this choice:
/// [`TrainingMode::DataParallel`] is one process on a run of one rank and data parallel on
/// more, the other modes split their ranks as their options say.
#[derive(Debug, Clone, Default)]
pub enum TrainingMode {
    /// Every rank holds the whole model and the gradients are averaged by allreduce each
    /// step (one process when the run has one rank).
    #[default]
    DataParallel,
    /// Data parallel whose workers may die, leave and join while it trains (`--elastic`).
    Elastic(ElasticOptions),
    /// Workers exchange with parameter servers that hold the weights (`--ps`).
    ParameterServers(PsOptions),
    /// The model split into stages over the ranks, in pipelines that train data parallel
    /// (`--pipeline-stages`).
    Pipeline(PipelineOptions),
}

impl TrainingMode {
    /// The elastic options, when the mode is elastic.
    pub fn elastic(&self) -> Option<&ElasticOptions> {
        match self {
            Self::Elastic(e) => Some(e),
            _ => None,
        }
    }

    /// The parameter-server options, when the mode is parameter servers.
    pub fn ps(&self) -> Option<&PsOptions> {
        match self {
            Self::ParameterServers(p) => Some(p),
            _ => None,
        }
    }

    /// The pipeline options, when the mode is a pipeline.
    pub fn pipeline(&self) -> Option<&PipelineOptions> {
        match self {
            Self::Pipeline(p) => Some(p),
            _ => None,
        }
    }
}

/// Pipeline model parallelism (`--pipeline-stages`): the model's units split into `stages`
/// consecutive stages, one per rank of each pipeline; `world / stages` pipelines train data
/// parallel (2D).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineOptions {
    pub stages: usize,
    /// Micro-batches per step (each replica's batch is cut into this many).
    pub micro_batches: usize,
    pub schedule: burn_dist::pipeline::Schedule,
    /// Explicit unit ranges, one per stage (`--pipeline-split 0:2,2:5`).
    pub split: Option<Vec<std::ops::Range<usize>>>,
    pub balance: PipelineBalance,
}

impl PipelineOptions {
    /// `0:2,2:5` as ranges; each `a:b` with a < b, each starting where the previous ended, the
    /// first at 0.
    pub fn parse_split(text: &str) -> Result<Vec<std::ops::Range<usize>>> {
        let bad = |m: String| {
            HearthError::InvalidArgument(format!("`PipelineOptions.split` {text}: {m}"))
        };
        let mut out: Vec<std::ops::Range<usize>> = Vec::new();
        for part in text.split(',').map(str::trim) {
            let (a, b) = part
                .split_once(':')
                .ok_or_else(|| bad(format!("'{part}' is not START:END")))?;
            let parse = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(format!("'{v}' is not a unit index")))
            };
            let (a, b) = (parse(a)?, parse(b)?);
            if a >= b {
                return Err(bad(format!("{a}:{b} is empty")));
            }
            let expected = out.last().map_or(0, |r| r.end);
            if a != expected {
                return Err(bad(format!(
                    "{a}:{b} must start at unit {expected}, where the previous stage ends"
                )));
            }
            out.push(a..b);
        }
        Ok(out)
    }
}

/// Where the parameter servers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PsServers {
    /// This many of the job's ranks serve; the others train.
    Dedicated(usize),
    /// Every rank trains and also serves one shard (a thread of its own).
    Colocated,
}

impl std::str::FromStr for PsServers {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        if s == "colocated" {
            return Ok(Self::Colocated);
        }
        match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Self::Dedicated(n)),
            _ => Err(HearthError::InvalidArgument(format!(
                "`TrainingMode::ParameterServers` {s:?}: give a number of server ranks (at least 1) \
                 or `colocated`"
            ))),
        }
    }
}

/// EASGD's elastic force α at the schedule's peak rate unless `--rho` is given: a worker and
/// the centre meet halfway at each exchange. ρ = 5 with `--lr 0.05` (α = 0.25) learned 3 to
/// 14 points under sync with the other flags at their defaults; α = 0.5 came within about 3
/// (BENCHMARKS.md, issue 55).
pub const EASGD_PEAK_ALPHA: f64 = 0.5;

/// Parameter-server settings (`hearth train --ps`).
#[derive(Debug, Clone)]
pub struct PsOptions {
    pub servers: PsServers,
    pub mode: Mode,
    /// Steps between a worker's exchanges with the servers (asynchronous modes); `None`: the
    /// mode's default ([`PsOptions::window`]).
    pub window: Option<usize>,
    /// EASGD's ρ: the elastic force is α = lr · ρ (the scheduled rate). `None`: ρ =
    /// [`EASGD_PEAK_ALPHA`] / the phase's base rate, so that α is 0.5 at the schedule's peak
    /// whatever `--lr` is.
    pub rho: Option<f64>,
    /// Most steps a worker may run ahead of the slowest (`--staleness`, SSP).
    pub staleness: Option<u64>,
}

impl Default for PsOptions {
    fn default() -> Self {
        Self {
            servers: PsServers::Dedicated(1),
            mode: Mode::Adag,
            window: None,
            rho: None,
            staleness: None,
        }
    }
}

impl PsOptions {
    /// Steps between a worker's exchanges: `window` where set, else 2 for `downpour` and
    /// `easgd` and 5 for `adag` and `dynsgd` (1 for `sync`, which exchanges every step).
    /// Chosen by measurement with every other flag at its default (BENCHMARKS.md, issue 55):
    /// EASGD's centre, moved only by the elastic pulls, learned 12 points under sync with a
    /// window of 5 and came level with one of 2; DOWNPOUR gained 2 to 3 points; ADAG, whose
    /// servers divide each change by the window, lost 7 with 2.
    pub fn window(&self) -> usize {
        self.window.unwrap_or(match self.mode {
            Mode::Sync => 1,
            Mode::Downpour | Mode::Easgd => 2,
            Mode::Adag | Mode::DynSgd => 5,
        })
    }

    /// EASGD's ρ in a phase whose base (peak) rate is `lr`: `rho` where set, else
    /// [`EASGD_PEAK_ALPHA`] / `lr`.
    pub fn rho_at(&self, lr: f64) -> f64 {
        self.rho.unwrap_or(EASGD_PEAK_ALPHA / lr)
    }
}

/// How the global batch is shared between the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Balance {
    /// global / world each, the remainder to the first workers.
    #[default]
    Even,
    /// In proportion to each worker's measured samples per second (re-measured as it trains),
    /// so a slow worker and a fast one finish their steps together.
    Throughput,
}

crate::names::named_settings!(Balance { Even => "even", Throughput => "throughput" });

/// Elastic membership settings (`hearth train --elastic`).
#[derive(Debug, Clone)]
pub struct ElasticOptions {
    pub min_workers: usize,
    pub max_workers: usize,
    /// How long a world below `min_workers` waits for joiners before giving up.
    pub rejoin_timeout: Duration,
    pub balance: Balance,
    /// This worker's name in the job (`HEARTH_ELASTIC_ID`; initial workers default to `w<rank>`,
    /// joiners to `<host>:<pid>`).
    pub id: Option<String>,
    /// The host its failures count against for the blacklist: by default the machine as the
    /// kernel names it (boot id and network namespace, as the shared-memory path tells hosts
    /// apart), so a process restarted on a failing machine is still refused;
    /// `HEARTH_ELASTIC_HOST` overrides it.
    pub host: Option<String>,
    /// Where this worker listens for joiners (`HEARTH_ELASTIC_ADDR`; default 127.0.0.1 or
    /// 0.0.0.0, any port).
    pub join_addr: Option<SocketAddr>,
    /// Join a running job through these join addresses instead of starting one
    /// (`HEARTH_ELASTIC_PEERS`, comma-separated).
    pub peers: Vec<String>,
    /// A file of join addresses, one `host:port` per line, re-read while joining
    /// (`--hosts` / `HEARTH_ELASTIC_HOSTS`).
    pub hosts_file: Option<PathBuf>,
    /// This process joins a running job (no `HEARTH_RANK`).
    pub joiner: bool,
}

impl Default for ElasticOptions {
    fn default() -> Self {
        Self {
            min_workers: 1,
            max_workers: 64,
            rejoin_timeout: Duration::from_secs(300),
            balance: Balance::Even,
            id: None,
            host: None,
            join_addr: None,
            peers: Vec::new(),
            hosts_file: None,
            joiner: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_splits_parse_and_bad_ones_say_why() {
        assert_eq!(
            PipelineOptions::parse_split("0:2, 2:5").unwrap(),
            vec![0..2, 2..5]
        );
        for (text, why) in [
            ("1:3", "must start at unit 0"),
            ("0:2,3:5", "must start at unit 2"),
            ("0:0", "empty"),
            ("0-2", "START:END"),
            ("0:x", "not a unit index"),
        ] {
            let e = PipelineOptions::parse_split(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
