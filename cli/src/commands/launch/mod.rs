//! `hearth launch -n N -- COMMAND...`: N local ranks of one job.
//!
//! Each rank gets `HEARTH_RANK`, `HEARTH_WORLD_SIZE`, `HEARTH_COORDINATOR` (127.0.0.1 and a free
//! port), `LOCAL_RANK`, `HEARTH_JOB_SECRET` (the caller's, or a fresh random one) and
//! `HEARTH_JOB_ID` (the caller's, or a fresh one: it salts the secret's key). Output
//! lines are prefixed with `[rank R]`. When a rank fails, the others are stopped and the launch
//! fails with that rank's exit status. When the launcher itself ends (Ctrl-C, a kill), the kernel
//! kills the ranks (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Result, anyhow};

pub mod elastic;

/// How to start the ranks.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    pub nproc: usize,
    pub program: std::path::PathBuf,
    pub args: Vec<String>,
    /// Coordinator port (0: a free one).
    pub port: u16,
    /// Prefix output lines with `[rank R]`; without it only rank 0's output is shown.
    pub prefix: bool,
}

/// What a launch ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchOutcome {
    Success,
    /// The first rank that failed, and its exit code (None: killed by a signal).
    Failed {
        rank: usize,
        code: Option<i32>,
    },
}

pub(super) fn free_port() -> Result<u16> {
    // Below the kernel's ephemeral range: a port handed out now and bound later by a rank must
    // not be taken meanwhile by an endpoint bound to port 0 (every elastic membership change
    // binds new ones; seen once in CI as "Address already in use" for a joiner).
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    if low > FIRST + 1000 {
        use std::hash::{BuildHasher, RandomState};
        let span = u64::from(low - FIRST);
        let reservations = std::env::temp_dir().join("hearth-ports");
        let start = RandomState::new().hash_one(std::process::id()) % span;
        for i in 0..span.min(2000) {
            let port = FIRST + ((start + i * 7919) % span) as u16;
            if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
                && reserve(&reservations, port)
            {
                return Ok(port);
            }
        }
    }
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .map_err(|e| anyhow!("launch: no free UDP port on 127.0.0.1: {e}"))
}

/// How long a port handed out stays reserved: its rank binds it within seconds.
const RESERVED_FOR: Duration = Duration::from_secs(60);

/// Claims `port` for this launcher among all launchers of the machine: a file in `dir` for each
/// port handed out in the last [`RESERVED_FOR`]. A port probed free is bound by its rank only
/// once the rank has started, and another launcher's probe in between found it free too (two
/// tests' jobs at once, seen in CI as "Address already in use"). Where no file can be written
/// (another user's directory), the probe alone decides, as before.
fn reserve(dir: &std::path::Path, port: u16) -> bool {
    use std::io::ErrorKind;
    let path = dir.join(port.to_string());
    let claim = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
    };
    if std::fs::create_dir_all(dir).is_err() {
        return true;
    }
    match claim() {
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let stale = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > RESERVED_FOR);
            // Of two launchers finding the same stale claim, only the one that removes it
            // takes the port.
            stale && std::fs::remove_file(&path).is_ok() && claim().is_ok()
        }
        Err(_) => true,
    }
}

/// Copies `input`'s lines to our stdout or stderr, each prefixed with `[label]` when `prefix`;
/// without it only `first`'s lines are shown, bare.
pub(super) fn pump(
    label: String,
    first: bool,
    input: impl std::io::Read + Send + 'static,
    err: bool,
    prefix: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(input);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let text = String::from_utf8_lossy(&line);
            if !prefix && !first {
                continue;
            }
            let shown = if prefix {
                format!("[{label}] {text}\n")
            } else {
                format!("{text}\n")
            };
            if err {
                let _ = std::io::stderr().lock().write_all(shown.as_bytes());
            } else {
                let _ = std::io::stdout().lock().write_all(shown.as_bytes());
            }
        }
    })
}

/// A command for a rank or worker: in its own process group, so stopping it stops whatever it
/// started too; out of the terminal's process group Ctrl-C no longer reaches it, so the kernel
/// kills it when the launcher dies, however it dies.
pub(super) fn child_command(program: &std::path::Path) -> Command {
    let mut command = Command::new(program);
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
}

/// This job's id (`HEARTH_JOB_ID`, which salts the job secret's key): the caller's, or a fresh
/// random one, so that no two launches share it.
pub(super) fn job_id() -> Result<String> {
    match std::env::var("HEARTH_JOB_ID") {
        Ok(id) if !id.is_empty() => Ok(id),
        _ => Ok(format!(
            "launch-{}",
            &burn_dist::tls::random_secret()?[..16]
        )),
    }
}

/// Starts the ranks and waits for them (see the module docs).
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchOutcome> {
    if cfg.nproc == 0 {
        return Err(anyhow!("-n must be at least 1"));
    }
    let port = if cfg.port == 0 {
        free_port()?
    } else {
        cfg.port
    };
    let secret = match std::env::var("HEARTH_JOB_SECRET") {
        Ok(s) if !s.is_empty() => s,
        _ => burn_dist::tls::random_secret()?,
    };
    let job = job_id()?;
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    for rank in 0..cfg.nproc {
        let mut command = child_command(&cfg.program);
        let mut child = command
            .args(&cfg.args)
            .env("HEARTH_RANK", rank.to_string())
            .env("HEARTH_WORLD_SIZE", cfg.nproc.to_string())
            .env("HEARTH_COORDINATOR", format!("127.0.0.1:{port}"))
            .env("LOCAL_RANK", rank.to_string())
            .env("HEARTH_JOB_SECRET", &secret)
            .env("HEARTH_JOB_ID", &job)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                anyhow!(
                    "launch: starting rank {rank} ({}): {e}",
                    cfg.program.display()
                )
            })?;
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(
                format!("rank {rank}"),
                rank == 0,
                out,
                false,
                cfg.prefix,
            ));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(
                format!("rank {rank}"),
                rank == 0,
                err,
                true,
                cfg.prefix,
            ));
        }
        children.push(Some(child));
    }
    let outcome = wait_for_ranks(&mut children)?;
    // Output readers end when the last writer closes; do not wait on stray grandchildren.
    let until = std::time::Instant::now() + Duration::from_secs(2);
    for p in pumps {
        while !p.is_finished() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        if p.is_finished() {
            let _ = p.join();
        }
    }
    Ok(outcome)
}

/// Waits for every rank; the first to fail is the outcome, and the others are killed then.
fn wait_for_ranks(children: &mut [Option<Child>]) -> Result<LaunchOutcome> {
    let mut outcome = LaunchOutcome::Success;
    let mut running = children.len();
    while running > 0 {
        // The ranks that ended since the last look. When several failed in the same interval,
        // one killed by a signal is the cause and the others' errors its consequence (they
        // lost a peer), so it is the one named.
        let mut failed = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    running -= 1;
                    if !status.success() {
                        failed.push((rank, status));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(anyhow!("launch: waiting for rank {rank}: {e}"));
                }
            }
        }
        let first = failed
            .iter()
            .find(|(_, s)| s.code().is_none())
            .or(failed.first());
        if let Some((rank, status)) = first
            && outcome == LaunchOutcome::Success
        {
            outcome = LaunchOutcome::Failed {
                rank: *rank,
                code: status.code(),
            };
            eprintln!("hearth launch: rank {rank} failed ({status}); stopping the other ranks");
            for other in children.iter_mut().flatten() {
                kill_group(other);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(outcome)
}

/// SIGKILL to the rank's whole process group (it leads one: see `process_group(0)`).
pub(super) fn kill_group(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is shared.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_goes_to_one_launcher_until_its_claim_is_stale() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ports");
        assert!(reserve(&dir, 20_001), "a fresh port is claimed");
        assert!(
            !reserve(&dir, 20_001),
            "a claimed port is not handed out again"
        );
        assert!(reserve(&dir, 20_002), "another port is free");
        let old = std::time::SystemTime::now() - RESERVED_FOR - Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(dir.join("20001"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(reserve(&dir, 20_001), "a stale claim is taken over");
        assert!(!reserve(&dir, 20_001), "and claimed afresh");
    }
}
