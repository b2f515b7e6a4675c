//! `hearth launch --elastic -n N --min M --max X [--churn ...] [--hosts FILE] -- hearth train
//! --elastic ...`: local worker processes of an elastic job, added and removed while it trains.
//!
//! Worker slot `i` is named `w<i>` (`HEARTH_ELASTIC_ID`, also its host for the blacklist) and
//! listens for joiners on its own 127.0.0.1 port (`HEARTH_ELASTIC_ADDR`). The first N slots
//! start the job (`HEARTH_RANK`, `HEARTH_WORLD_SIZE`, `HEARTH_COORDINATOR` as `hearth launch`
//! gives them); later slots are joiners (`HEARTH_ELASTIC_PEERS`: every slot's join address so
//! far). All share one job secret. Nothing stops the others when a worker dies: that is the
//! point. The launch succeeds when a worker finishes the training (exit 0 without having been
//! asked to leave), and fails when every worker is gone without one finishing.
//!
//! Membership changes come from `--churn` (a schedule, to simulate spot instances) and from
//! `--hosts FILE` (re-read when it changes, as MXNet's dynamic training does): its lines
//! `HOST [slots=K]` say how many workers to run; only local hosts (127.x, localhost) can be
//! started here, as there is no SSH launch. Workers started elsewhere join by themselves with
//! `HEARTH_ELASTIC_PEERS` (see docs/elastic.md).

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant, SystemTime};

use super::{child_command, free_port, kill_group, pump};
use anyhow::{Result, anyhow};

/// One change of the `--churn` schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct ChurnEvent {
    /// Seconds after the launch.
    pub at: Duration,
    pub action: ChurnAction,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChurnAction {
    /// Start this many joiners.
    Add(usize),
    /// Stop this many workers, the newest first: SIGTERM (graceful) or SIGKILL (abrupt).
    Remove { count: usize, abrupt: bool },
    /// Stop the named worker (`w0`, ...).
    Stop { id: String, abrupt: bool },
}

/// Parses `t=30s:-1,t=60s:+2,t=90s:-1!,t=100s:kill=w0,t=2m:term=w1` (`!`: SIGKILL).
pub fn parse_churn(text: &str) -> Result<Vec<ChurnEvent>> {
    let bad = |part: &str, why: &str| {
        anyhow!(
            "--churn {part:?}: {why} (expected e.g. t=30s:-1,t=60s:+2; -1! kills, kill=w0 or \
             term=w0 name a worker)"
        )
    };
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (time, action) = part
            .strip_prefix("t=")
            .and_then(|r| r.split_once(':'))
            .ok_or_else(|| bad(part, "no t=TIME:"))?;
        let (number, unit) = match time.trim_end_matches(|c: char| c.is_ascii_alphabetic()) {
            n if n.len() < time.len() => (n, &time[n.len()..]),
            n => (n, "s"),
        };
        let value: f64 = number.parse().map_err(|_| bad(part, "bad time"))?;
        let secs = match unit {
            "ms" => value / 1000.0,
            "s" => value,
            "m" => value * 60.0,
            _ => return Err(bad(part, "time unit must be ms, s or m")),
        };
        if !(secs.is_finite() && secs >= 0.0) {
            return Err(bad(part, "time must be 0 or more"));
        }
        let action = if let Some(id) = action.strip_prefix("kill=") {
            ChurnAction::Stop {
                id: id.into(),
                abrupt: true,
            }
        } else if let Some(id) = action.strip_prefix("term=") {
            ChurnAction::Stop {
                id: id.into(),
                abrupt: false,
            }
        } else if let Some(n) = action.strip_prefix('+') {
            ChurnAction::Add(n.parse().map_err(|_| bad(part, "bad count"))?)
        } else if let Some(n) = action.strip_prefix('-') {
            let (n, abrupt) = match n.strip_suffix('!') {
                Some(n) => (n, true),
                None => (n, false),
            };
            ChurnAction::Remove {
                count: n.parse().map_err(|_| bad(part, "bad count"))?,
                abrupt,
            }
        } else {
            return Err(bad(
                part,
                "the change must be +N, -N, -N!, kill=ID or term=ID",
            ));
        };
        out.push(ChurnEvent {
            at: Duration::from_secs_f64(secs),
            action,
        });
    }
    out.sort_by_key(|e| e.at);
    Ok(out)
}

/// Workers a host file asks for: the sum of `slots=K` (default 1) over its local hosts.
pub fn parse_hosts(text: &str) -> Result<usize> {
    let mut total = 0;
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let host = words.next().unwrap_or("");
        let host_only = host.rsplit_once(':').map_or(host, |(h, _)| h);
        if !(host_only == "localhost" || host_only.starts_with("127.")) {
            return Err(anyhow!(
                "--hosts: {host} is not this machine; hearth launch starts local workers only \
                 (start workers elsewhere with HEARTH_ELASTIC_PEERS, see docs/elastic.md)"
            ));
        }
        let mut slots = 1;
        for w in words {
            match w.strip_prefix("slots=").map(str::parse::<usize>) {
                Some(Ok(k)) => slots = k,
                _ => {
                    return Err(anyhow!("--hosts: {line:?}: expected HOST [slots=K]"));
                }
            }
        }
        total += slots;
    }
    Ok(total)
}

#[derive(Debug, Clone)]
pub struct ElasticLaunchConfig {
    /// Workers that start the job.
    pub nproc: usize,
    pub max: usize,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub churn: Vec<ChurnEvent>,
    pub hosts: Option<PathBuf>,
}

/// A private directory removed when the launch ends.
struct DoneDir(PathBuf);

impl DoneDir {
    fn new() -> Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("hearth-elastic-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| anyhow!("launch: creating {}: {e}", dir.display()))?;
        Ok(Self(dir))
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for DoneDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Slot {
    id: String,
    child: Option<Child>,
    /// Asked to leave (SIGTERM) or killed by the launcher.
    stopped: bool,
}

/// What an elastic launch ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ElasticOutcome {
    /// A worker finished the training.
    Finished { by: String },
    /// Every worker is gone and none finished; the last failure's exit code.
    Failed { code: Option<i32> },
}

struct Launcher<'a> {
    cfg: &'a ElasticLaunchConfig,
    secret: String,
    /// `HEARTH_JOB_ID`: every worker's, joiners' too (it salts the secret's key).
    job: String,
    coordinator: String,
    join_addrs: Vec<String>,
    slots: Vec<Slot>,
    pumps: Vec<std::thread::JoinHandle<()>>,
    /// Where workers that finish the training say so (a graceful leave also exits 0).
    done: DoneDir,
}

impl Launcher<'_> {
    fn live(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.child.is_some() && !s.stopped)
            .count()
    }

    fn spawn(&mut self, initial: Option<usize>) -> Result<()> {
        let slot = self.slots.len();
        let id = format!("w{slot}");
        let join = format!("127.0.0.1:{}", free_port()?);
        self.join_addrs.push(join.clone());
        let mut command = child_command(&self.cfg.program);
        command
            .args(&self.cfg.args)
            .env("HEARTH_JOB_SECRET", &self.secret)
            .env("HEARTH_JOB_ID", &self.job)
            .env("HEARTH_ELASTIC_ID", &id)
            .env("HEARTH_ELASTIC_ADDR", &join)
            .env("HEARTH_ELASTIC_PEERS", self.join_addrs.join(","))
            .env("HEARTH_ELASTIC_DONE_DIR", self.done.path())
            .env_remove("HEARTH_RANK")
            .env_remove("HEARTH_WORLD_SIZE")
            .env_remove("HEARTH_COORDINATOR")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(rank) = initial {
            command
                .env("HEARTH_RANK", rank.to_string())
                .env("HEARTH_WORLD_SIZE", self.cfg.nproc.to_string())
                .env("HEARTH_COORDINATOR", &self.coordinator);
        } else {
            eprintln!("hearth launch: starting joiner {id}");
        }
        let mut child = command.spawn().map_err(|e| {
            anyhow!(
                "launch: starting {id} ({}): {e}",
                self.cfg.program.display()
            )
        })?;
        if let Some(out) = child.stdout.take() {
            self.pumps
                .push(pump(id.clone(), slot == 0, out, false, true));
        }
        if let Some(err) = child.stderr.take() {
            self.pumps
                .push(pump(id.clone(), slot == 0, err, true, true));
        }
        self.slots.push(Slot {
            id,
            child: Some(child),
            stopped: false,
        });
        Ok(())
    }

    fn stop(&mut self, index: usize, abrupt: bool) {
        let slot = &mut self.slots[index];
        let Some(child) = slot.child.as_mut() else {
            return;
        };
        slot.stopped = true;
        eprintln!(
            "hearth launch: {} {}",
            if abrupt {
                "killing"
            } else {
                "stopping (SIGTERM)"
            },
            slot.id
        );
        if abrupt {
            kill_group(child);
        } else if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }

    /// The newest running workers, not already stopping.
    fn newest(&self, count: usize) -> Vec<usize> {
        (0..self.slots.len())
            .rev()
            .filter(|&i| self.slots[i].child.is_some() && !self.slots[i].stopped)
            .take(count)
            .collect()
    }

    fn apply(&mut self, action: &ChurnAction) -> Result<()> {
        match action {
            ChurnAction::Add(n) => {
                for _ in 0..*n {
                    if self.live() >= self.cfg.max {
                        eprintln!(
                            "hearth launch: --max {} workers running, no joiner added",
                            self.cfg.max
                        );
                        break;
                    }
                    self.spawn(None)?;
                }
            }
            ChurnAction::Remove { count, abrupt } => {
                for i in self.newest(*count) {
                    self.stop(i, *abrupt);
                }
            }
            ChurnAction::Stop { id, abrupt } => match self.slots.iter().position(|s| &s.id == id) {
                Some(i) => self.stop(i, *abrupt),
                None => eprintln!("hearth launch: --churn names {id}, which was never started"),
            },
        }
        Ok(())
    }
}

impl Launcher<'_> {
    /// Collects the workers that ended since the last look: `finished` takes the first that
    /// finished the job, `last_failure` the exit code of the last that failed. Returns how many
    /// still run.
    fn reap(
        &mut self,
        finished: &mut Option<String>,
        last_failure: &mut Option<Option<i32>>,
    ) -> Result<usize> {
        let done = self.done.path().to_path_buf();
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            let Some(child) = slot.child.as_mut() else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(status)) => {
                    slot.child = None;
                    if status.success() && done.join(&slot.id).is_file() {
                        finished.get_or_insert(slot.id.clone());
                    } else if status.success() {
                        eprintln!("hearth launch: {} left", slot.id);
                    } else if !status.success() && !slot.stopped {
                        eprintln!(
                            "hearth launch: {} ended ({status}); the others go on",
                            slot.id
                        );
                        *last_failure = Some(status.code());
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(anyhow!("launch: waiting for {}: {e}", slot.id));
                }
            }
        }
        Ok(self.slots.iter().filter(|s| s.child.is_some()).count())
    }

    /// `--hosts`: when the file changed, starts or stops workers to the number it asks for (a
    /// file that does not read is said and ignored).
    fn follow_hosts(&mut self, hosts_seen: &mut Option<SystemTime>) -> Result<()> {
        let cfg = self.cfg;
        if let Some(path) = &cfg.hosts
            && let Ok(modified) = std::fs::metadata(path).and_then(|m| m.modified())
            && *hosts_seen != Some(modified)
        {
            *hosts_seen = Some(modified);
            match std::fs::read_to_string(path)
                .map_err(|e| anyhow!("launch: --hosts {}: {e}", path.display()))
                .and_then(|t| parse_hosts(&t))
            {
                Ok(want) => {
                    let want = want.min(cfg.max);
                    let live = self.live();
                    if want > live {
                        self.apply(&ChurnAction::Add(want - live))?;
                    } else if want < live {
                        self.apply(&ChurnAction::Remove {
                            count: live - want,
                            abrupt: false,
                        })?;
                    }
                }
                Err(e) => eprintln!("hearth launch: ignoring the host file: {e}"),
            }
        }
        Ok(())
    }
}

/// Runs the elastic job (see the module docs).
pub fn launch_elastic(cfg: &ElasticLaunchConfig) -> Result<ElasticOutcome> {
    if cfg.nproc == 0 || cfg.nproc > cfg.max {
        return Err(anyhow!(
            "-n {} must be between 1 and --max {}",
            cfg.nproc,
            cfg.max
        ));
    }
    let secret = match std::env::var("HEARTH_JOB_SECRET") {
        Ok(s) if !s.is_empty() => s,
        _ => burn_dist::tls::random_secret()?,
    };
    let mut l = Launcher {
        cfg,
        secret,
        job: super::job_id()?,
        coordinator: format!("127.0.0.1:{}", free_port()?),
        join_addrs: Vec::new(),
        slots: Vec::new(),
        pumps: Vec::new(),
        done: DoneDir::new()?,
    };
    for rank in 0..cfg.nproc {
        l.spawn(Some(rank))?;
    }
    let started = Instant::now();
    let mut churn = cfg.churn.iter().peekable();
    let mut hosts_seen: Option<SystemTime> = None;
    let mut finished: Option<String> = None;
    let mut finished_at: Option<Instant> = None;
    let mut last_failure: Option<Option<i32>> = None;
    loop {
        let running = l.reap(&mut finished, &mut last_failure)?;
        if running == 0 {
            break;
        }
        if let Some(by) = &finished {
            // The others finish within seconds; a joiner still waiting, or a worker cut off
            // (stopped), would wait for nothing.
            let at = *finished_at.get_or_insert_with(Instant::now);
            if at.elapsed() > Duration::from_secs(10) {
                eprintln!("hearth launch: {by} finished; stopping the workers still running");
                for slot in l.slots.iter_mut().filter(|s| s.child.is_some()) {
                    slot.stopped = true;
                    if let Some(c) = slot.child.as_mut() {
                        kill_group(c);
                    }
                }
            }
        } else {
            let now = started.elapsed();
            while let Some(e) = churn.next_if(|e| e.at <= now) {
                l.apply(&e.action)?;
            }
            l.follow_hosts(&mut hosts_seen)?;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let until = Instant::now() + Duration::from_secs(2);
    for p in l.pumps {
        while !p.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        if p.is_finished() {
            let _ = p.join();
        }
    }
    Ok(match finished {
        Some(by) => ElasticOutcome::Finished { by },
        None => ElasticOutcome::Failed {
            code: last_failure.flatten(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn churn_schedules_parse_and_bad_ones_say_why() {
        let e = parse_churn("t=30s:-1, t=1m:+2,t=500ms:-1!,t=90:kill=w0,t=2s:term=w3").unwrap();
        assert_eq!(e.len(), 5);
        assert_eq!(e[0].at, Duration::from_millis(500));
        assert_eq!(
            e[0].action,
            ChurnAction::Remove {
                count: 1,
                abrupt: true
            }
        );
        assert_eq!(
            e[1].action,
            ChurnAction::Stop {
                id: "w3".into(),
                abrupt: false
            }
        );
        assert_eq!(
            e[2].action,
            ChurnAction::Remove {
                count: 1,
                abrupt: false
            }
        );
        assert_eq!(e[3].at, Duration::from_secs(60));
        assert_eq!(e[3].action, ChurnAction::Add(2));
        assert_eq!(
            e[4].action,
            ChurnAction::Stop {
                id: "w0".into(),
                abrupt: true
            }
        );
        for bad in [
            "30s:-1", "t=x:-1", "t=3h:-1", "t=3s:*2", "t=3s:+x", "t=-1s:+1",
        ] {
            let msg = parse_churn(bad).unwrap_err().to_string();
            assert!(msg.contains("--churn"), "{bad}: {msg}");
        }
    }

    #[test]
    fn host_files_count_local_slots_and_refuse_remote_hosts() {
        assert_eq!(
            parse_hosts("127.0.0.1 slots=2\n# spot\nlocalhost\n\n").unwrap(),
            3
        );
        assert_eq!(parse_hosts("").unwrap(), 0);
        assert!(
            parse_hosts("10.0.0.5 slots=2")
                .unwrap_err()
                .to_string()
                .contains("not this machine")
        );
        assert!(parse_hosts("127.0.0.1 cores=2").is_err());
    }
}
