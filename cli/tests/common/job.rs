//! [`Job`]: the ranks of one `hearth train` job as child processes, each writing to its own log
//! (a module of `common.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{coordinator_port, wait_bounded};

/// The usual settings of [`Job::start`]: constant rate 0.05, SGD's default momentum 0.9 (not
/// given: adam refuses `--momentum`), no augmentation.
pub const USUAL: [&str; 10] = [
    "--batch-size",
    "24",
    "--lr",
    "0.05",
    "--schedule",
    "constant",
    "--warmup-epochs",
    "0",
    "--augment",
    "none",
];

/// The ranks of one job, each writing to its own log.
pub struct Job {
    pub children: Vec<Child>,
    pub logs: Vec<PathBuf>,
}

impl Job {
    /// Starts `world` ranks of `hearth train --data DATA ARGS --run-dir RUN` with `env`, after
    /// this file's usual settings (constant rate 0.05, momentum 0.9, no augmentation).
    pub fn start(
        dir: &Path,
        data: &Path,
        run: &Path,
        world: usize,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn(dir, data, run, world, &USUAL, args, env)
    }

    /// [`Job::start`] with `base` instead of the usual settings (one loader thread and 32x32
    /// images always).
    pub fn spawn(
        dir: &Path,
        data: &Path,
        run: &Path,
        world: usize,
        base: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let port = coordinator_port();
        static JOBS: AtomicUsize = AtomicUsize::new(0);
        let job = JOBS.fetch_add(1, Ordering::SeqCst);
        let logs: Vec<PathBuf> = (0..world)
            .map(|r| dir.join(format!("job{job}-rank{r}.txt")))
            .collect();
        // `--resume DIR` names the run directory itself.
        let resume = args.contains(&"--resume");
        let children = (0..world)
            .map(|r| {
                let file = std::fs::File::create(&logs[r]).unwrap();
                let mut c = Command::new(env!("CARGO_BIN_EXE_hearth"));
                c.args(["train", "--data"])
                    .arg(data)
                    .args(["--workers", "1", "--size", "32"])
                    .args(base)
                    .args(args.iter().filter(|a| **a != "--resume"))
                    .arg(if resume { "--resume" } else { "--run-dir" })
                    .arg(run)
                    .env("HEARTH_RANK", r.to_string())
                    .env("HEARTH_WORLD_SIZE", world.to_string())
                    .env("HEARTH_COORDINATOR", format!("127.0.0.1:{port}"))
                    .env("HEARTH_JOB_SECRET", "a26c9576eb252322226a17c9c4a359b4")
                    // Rank 0 writes checkpoints while the others wait in a collective: on
                    // this loaded 2-core machine, late in the suite, such a write has stalled
                    // 70-120 s (the process in disk sleep), and 60 s split the job.
                    .env("HEARTH_COLLECTIVE_TIMEOUT", "300")
                    .stdout(Stdio::from(file.try_clone().unwrap()))
                    .stderr(Stdio::from(file));
                for (k, v) in env {
                    c.env(k, v);
                }
                c.spawn().unwrap()
            })
            .collect();
        Self { children, logs }
    }

    /// [`Job::spawn`], waited for (at most 300 s): every rank must succeed. Their logs.
    pub fn spawn_ok(
        dir: &Path,
        data: &Path,
        run: &Path,
        world: usize,
        base: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
    ) -> String {
        let mut job = Self::spawn(dir, data, run, world, base, args, env);
        let ok = job.wait(300);
        let logs = job.all_logs();
        assert!(
            ok.iter().all(|o| *o),
            "{args:?} on {world} ranks failed ({}):\n{logs}",
            run.display()
        );
        logs
    }

    pub fn log(&self, r: usize) -> String {
        std::fs::read_to_string(&self.logs[r]).unwrap_or_default()
    }

    /// Waits for every rank (at most `secs` in all); each one's success.
    pub fn wait(&mut self, secs: u64) -> Vec<bool> {
        let until = Instant::now() + Duration::from_secs(secs);
        let out: Vec<bool> = self
            .children
            .iter_mut()
            .map(|c| wait_bounded(c, until).is_some_and(|s| s.success()))
            .collect();
        out
    }

    pub fn all_logs(&self) -> String {
        (0..self.logs.len())
            .map(|r| format!("--- rank {r}\n{}", self.log(r)))
            .collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
