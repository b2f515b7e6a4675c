//! This process's place in the job, from the variables of whichever launcher started it
//! (the table in the [module docs](super)).

use std::net::{SocketAddr, ToSocketAddrs};

use crate::{DistError, Result};

/// Default coordinator port when only a host is known (Slurm).
pub const DEFAULT_PORT: u16 = 29400;

/// Where this process stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
    /// Rank within its machine, when the launcher says (`LOCAL_RANK`, `SLURM_LOCALID`, ...).
    pub local_rank: Option<usize>,
    /// `host:port` of rank 0.
    pub coordinator: String,
    /// Which variables it came from.
    pub source: &'static str,
}

/// First host of a Slurm node list: `node[03-05,9],gpu1` -> `node03`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let first_end = {
        let mut depth = 0;
        let mut end = list.len();
        for (i, ch) in list.char_indices() {
            match ch {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        end
    };
    let first = &list[..first_end];
    match first.find('[') {
        None => Some(first.to_string()),
        Some(open) => {
            let prefix = &first[..open];
            let inner = first[open + 1..].trim_end_matches(']');
            let range = inner.split(',').next()?;
            let start = range.split('-').next()?;
            Some(format!("{prefix}{start}"))
        }
    }
}

/// The (rank, world size) variable pairs of the launchers [`RankInfo`] reads.
const RANK_PAIRS: [(&str, &str); 4] = [
    ("HEARTH_RANK", "HEARTH_WORLD_SIZE"),
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
];

impl RankInfo {
    /// As [`RankInfo::detect`], from any variable lookup.
    pub fn detect_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let mut any = false;
        for (r, w) in RANK_PAIRS {
            match (get(r), get(w)) {
                (Some(v), None) => {
                    return Err(DistError::Config(format!(
                        "{r}={v:?} is set but {w} is not: set both (and the coordinator) to \
                         join a job, or neither to train as one process"
                    )));
                }
                (None, Some(v)) => {
                    return Err(DistError::Config(format!(
                        "{w}={v:?} is set but {r} is not: set both (and the coordinator) to \
                         join a job, or neither to train as one process"
                    )));
                }
                (Some(_), Some(_)) => any = true,
                (None, None) => {}
            }
        }
        if !any {
            return Ok(None);
        }
        Self::from_lookup(get).map(Some)
    }

    /// As [`RankInfo::from_env`], from any variable lookup (tests pass a map).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |k: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                    DistError::Config(format!("{k}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let master = || -> Option<String> {
            Some(format!("{}:{}", get("MASTER_ADDR")?, get("MASTER_PORT")?))
        };
        let local = num("LOCAL_RANK")?;
        let (rank, world, coordinator, source, local_rank) = if let (Some(r), Some(w)) =
            (num("HEARTH_RANK")?, num("HEARTH_WORLD_SIZE")?)
        {
            let c = get("HEARTH_COORDINATOR").ok_or_else(|| {
                DistError::Config(
                    "HEARTH_RANK is set but HEARTH_COORDINATOR (host:port) is not".into(),
                )
            })?;
            (r, w, c, "HEARTH_*", local)
        } else if let (Some(r), Some(w)) = (num("RANK")?, num("WORLD_SIZE")?) {
            let c = master().ok_or_else(|| {
                DistError::Config(
                    "RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not".into(),
                )
            })?;
            (r, w, c, "torchrun", local)
        } else if let (Some(r), Some(w)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
            let host = get("SLURM_JOB_NODELIST")
                    .and_then(|l| first_slurm_host(&l))
                    .or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"))
                    .ok_or_else(|| {
                        DistError::Config(
                            "Slurm rank found but neither SLURM_JOB_NODELIST nor SLURM_LAUNCH_NODE_IPADDR".into(),
                        )
                    })?;
            let port = match get("HEARTH_PORT") {
                Some(p) => p
                    .parse::<u16>()
                    .map_err(|_| DistError::Config(format!("HEARTH_PORT={p:?} is not a port")))?,
                None => DEFAULT_PORT,
            };
            let c = get("HEARTH_COORDINATOR").unwrap_or(format!("{host}:{port}"));
            (r, w, c, "Slurm", num("SLURM_LOCALID")?)
        } else if let (Some(r), Some(w)) =
            (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
        {
            let c = get("HEARTH_COORDINATOR").or_else(master).ok_or_else(|| {
                DistError::Config(
                    "Open MPI rank found; set HEARTH_COORDINATOR=host:port (rank 0's address)"
                        .into(),
                )
            })?;
            (r, w, c, "Open MPI", num("OMPI_COMM_WORLD_LOCAL_RANK")?)
        } else {
            return Err(DistError::Config(
                "no rank in the environment: set HEARTH_RANK, HEARTH_WORLD_SIZE and \
                     HEARTH_COORDINATOR (or run under torchrun, Slurm or mpirun)"
                    .into(),
            ));
        };
        if world == 0 || rank >= world {
            return Err(DistError::Config(format!(
                "rank {rank} is outside a world of {world} ({source})"
            )));
        }
        Ok(Self {
            rank,
            world,
            local_rank,
            coordinator,
            source,
        })
    }

    pub(super) fn coordinator_addr(&self) -> Result<SocketAddr> {
        self.coordinator
            .to_socket_addrs()
            .map_err(|source| DistError::Io {
                context: format!("resolving the coordinator {}", self.coordinator),
                source,
            })?
            .next()
            .ok_or_else(|| {
                DistError::Config(format!("coordinator {} has no address", self.coordinator))
            })
    }
}
