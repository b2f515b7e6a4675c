//! The launchers in `deploy/` run for real on this machine:
//!
//! - `deploy/slurm.sbatch` submitted with 2 tasks to a one-machine Slurm cluster (slurmctld,
//!   slurmd and munge from Debian, started by the test in a temporary directory on free ports);
//! - `mpirun -np 2` from Debian's Open MPI, as `deploy/README.md` shows it;
//! - `deploy/kubernetes.yaml` validated strictly against the Kubernetes schemas
//!   (`kubernetes-validate`, offline), and its names and sizes checked against each other.
//!
//! Each test needs its tools (`.ci/run` installs them): without them it fails saying what to
//! install, unless `HEARTH_ALLOW_SKIP=launchers` lets it print why and skip.
//! Every wait is bounded: a hang fails the test instead of CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `tools` are all on PATH (or given as absolute paths); if not, skip with the reason,
/// or fail when the launchers are required.
fn have(test: &str, tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !on_path(t)).collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!("{test}: {missing:?} not installed");
    let install = "apt-get install slurmctld slurmd slurm-client munge openmpi-bin; pip install \
                   kubernetes-validate (as .ci/run does)";
    if !common::may_skip("launchers") {
        panic!("{why}: {install}, or set HEARTH_ALLOW_SKIP=launchers to skip it");
    }
    eprintln!("SKIP {why} (HEARTH_ALLOW_SKIP=launchers; {install})");
    false
}

fn on_path(tool: &str) -> bool {
    if tool.starts_with('/') {
        return Path::new(tool).is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(tool).is_file()))
}

/// PATH with the `hearth` under test first, so `srun hearth ...` and `mpirun hearth ...` run it.
fn path_with_hearth() -> std::ffi::OsString {
    let bin = Path::new(env!("CARGO_BIN_EXE_hearth"))
        .parent()
        .expect("the hearth binary's directory")
        .to_path_buf();
    let mut dirs = vec![bin];
    if let Some(p) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(dirs).expect("a PATH")
}

/// Runs `cmd` to the end within `limit`, its output in `log`; `None` past the limit.
fn run_logged(mut cmd: Command, log: &Path, limit: Duration) -> Option<std::process::ExitStatus> {
    let out = std::fs::File::create(log).expect("creating a log");
    let err = out.try_clone().expect("a second handle to the log");
    let mut child = cmd
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("starting the launcher");
    common::wait_bounded(&mut child, Instant::now() + limit)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| format!("<{} unreadable: {e}>", path.display()))
}

/// The small training every launcher runs: 2 epochs of a reduced VGG on 32-pixel images.
const TRAIN: &str = "--model vgg-mini-plain --size 32 --epochs 2 --batch-size 8 --lr 0.02 \
                     --workers 1 --augment none --warmup-epochs 0";

/// What every launcher's run must show: both ranks took part (rank 0 says where the ranks
/// came from) and the run directory holds both epochs and the exported model.
fn assert_trained(log: &str, source: &str, run: &Path) {
    assert!(
        log.contains(&format!("distributed: 2 ranks ({source})")),
        "rank 0 never said it formed a job of 2 from {source}:\n{log}"
    );
    assert!(
        log.contains("trained on 2 ranks, global batch 8 (4 per rank)"),
        "{log}"
    );
    let csv = read(&run.join("metrics.csv"));
    let epochs: Vec<&str> = csv.lines().skip(1).filter(|l| !l.is_empty()).collect();
    assert_eq!(epochs.len(), 2, "two epochs in metrics.csv:\n{csv}\n{log}");
    let header = csv.lines().next().unwrap_or("");
    assert!(
        header.contains("train_accuracy_rank1"),
        "rank 1's own curve is missing, so it did not train: {header}"
    );
    assert!(run.join("model.bpk").is_file(), "no exported model:\n{log}");
}

/// A one-machine Slurm cluster in a temporary directory: munged, slurmctld and slurmd on free
/// ports, stopped (and their spool removed) when dropped.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
}

impl Slurm {
    fn start() -> Slurm {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let d = dir.path();
        for sub in ["munge", "state", "spool", "log"] {
            std::fs::create_dir_all(d.join(sub)).expect("making the cluster's directories");
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(d.join("munge"), std::fs::Permissions::from_mode(0o700))
                .expect("munge's directory private");
        }
        // munge's key: random bytes, private to its owner (munged checks).
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(
            &mut std::fs::File::open("/dev/urandom").expect("opening /dev/urandom"),
            &mut key,
        )
        .expect("reading /dev/urandom");
        let key_path = d.join("munge/key");
        std::fs::write(&key_path, key).expect("writing munge's key");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))
                .expect("munge's key private");
        }
        let socket = d.join("munge/sock");
        let status = Command::new("munged")
            .arg("--force") // CI runs as root
            .arg(format!("--key-file={}", key_path.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--pid-file={}", d.join("munge/pid").display()))
            .arg(format!("--log-file={}", d.join("log/munge.log").display()))
            .arg(format!("--seed-file={}", d.join("munge/seed").display()))
            .status()
            .expect("starting munged");
        assert!(
            status.success(),
            "munged: {}",
            read(&d.join("log/munge.log"))
        );

        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        // The node is called `localhost`, so the coordinator the ranks derive from
        // SLURM_JOB_NODELIST resolves on any machine; slurmd runs under that name (-N).
        let conf = format!(
            "ClusterName=hearthtest\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             AuthType=auth/munge\n\
             AuthInfo=socket={sock}\n\
             CredType=cred/munge\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             SlurmctldPort={ctld}\n\
             SlurmdPort={slurmd}\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/ctld.pid\n\
             SlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/log/ctld.log\n\
             SlurmdLogFile={d}/log/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             SwitchType=switch/none\n\
             MpiDefault=none\n\
             SchedulerType=sched/builtin\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\n\
             ReturnToService=2\n\
             NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n\
             PartitionName=hearth Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n",
            sock = socket.display(),
            ctld = common::coordinator_port(),
            slurmd = common::coordinator_port(),
            d = d.display(),
        );
        let conf_path = d.join("slurm.conf");
        std::fs::write(&conf_path, conf).expect("writing slurm.conf");
        let slurm = Slurm {
            dir,
            conf: conf_path,
        };
        let status = Command::new("slurmctld")
            .arg("-f")
            .arg(&slurm.conf)
            .status()
            .expect("starting slurmctld");
        assert!(status.success(), "slurmctld: {}", slurm.logs());
        let status = Command::new("slurmd")
            .args(["-N", "localhost", "-f"])
            .arg(&slurm.conf)
            .status()
            .expect("starting slurmd");
        assert!(status.success(), "slurmd: {}", slurm.logs());
        slurm.wait_idle();
        slurm
    }

    fn client(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Until the node reports idle (slurmd registered), at most 60 s.
    fn wait_idle(&self) {
        let until = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        while Instant::now() < until {
            if let Ok(out) = self.client("sinfo").args(["-h", "-N", "-o", "%t"]).output() {
                last = String::from_utf8_lossy(&out.stdout).trim().to_string();
                if last == "idle" {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        panic!(
            "the Slurm node never became idle (last state {last:?}):\n{}",
            self.logs()
        );
    }

    fn logs(&self) -> String {
        ["ctld.log", "slurmd.log", "munge.log"]
            .iter()
            .map(|f| {
                let text = read(&self.dir.path().join("log").join(f));
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                format!(
                    "--- {f} (last lines)\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for pid_file in ["slurmd.pid", "ctld.pid", "munge/pid"] {
            let Ok(pid) = std::fs::read_to_string(self.dir.path().join(pid_file)) else {
                continue;
            };
            if let Ok(pid) = pid.trim().parse::<i32>() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
            }
        }
        // The daemons remove their sockets and pid files; give them a moment before the
        // directory goes.
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn slurm_runs_deploy_sbatch_with_two_tasks_and_the_run_trains() {
    if !have(
        "slurm",
        &["munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo"],
    ) {
        return;
    }
    let slurm = Slurm::start();
    let work = tempfile::tempdir().expect("a temporary directory");
    let data = common::small_data(work.path());
    let run = work.path().join("run");
    let sbatch = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("deploy/slurm.sbatch");
    let mut cmd = slurm.client("sbatch");
    // The file's own `--nodes=2 --ntasks-per-node=2 --cpus-per-task=8` ask for a real cluster;
    // this one has one node, so the command line (which wins over #SBATCH lines) asks for 2
    // tasks there.
    cmd.args([
        "--wait",
        "--nodes=1",
        "--ntasks=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--overcommit",
        "--time=10",
    ])
    .arg(format!(
        "--output={}",
        work.path().join("job.out").display()
    ))
    .arg(format!("--chdir={}", work.path().display()))
    .arg(&sbatch)
    .current_dir(work.path())
    .env("PATH", path_with_hearth())
    .env("HEARTH_PORT", common::coordinator_port().to_string())
    .env("HEARTH_DATA", &data)
    .env("HEARTH_RUN_DIR", &run)
    .env("HEARTH_TRAIN_ARGS", TRAIN)
    .env_remove("HEARTH_JOB_SECRET")
    .env_remove("HEARTH_RANK")
    .env_remove("HEARTH_WORLD_SIZE");
    let submit_log = work.path().join("sbatch.log");
    let status = run_logged(cmd, &submit_log, Duration::from_secs(420));
    let job = read(&work.path().join("job.out"));
    let all = format!(
        "{}\n--- job output\n{job}\n{}",
        read(&submit_log),
        slurm.logs()
    );
    match status {
        None => {
            let _ = slurm.client("scancel").arg("--user=root").status();
            panic!("the Slurm job did not finish within 7 minutes:\n{all}");
        }
        Some(s) => assert!(s.success(), "sbatch --wait: {s}\n{all}"),
    }
    assert_trained(&job, "Slurm", &run);
    // The script's job secret existed only while the job ran.
    let leftovers: Vec<_> = std::fs::read_dir(work.path())
        .expect("the submit directory")
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".hearth-secret")
        })
        .collect();
    assert!(
        leftovers.is_empty(),
        "the job secret was left behind: {leftovers:?}"
    );
}

#[test]
fn mpirun_starts_two_ranks_that_train_as_one_job() {
    if !have("mpirun", &["mpirun"]) {
        return;
    }
    let work = tempfile::tempdir().expect("a temporary directory");
    let data = common::small_data(work.path());
    let run = work.path().join("run");
    let secret = common::hearth_cli(&["secret"]);
    assert!(secret.status.success(), "hearth secret failed");
    let secret = String::from_utf8_lossy(&secret.stdout).trim().to_string();
    let mut cmd = Command::new("mpirun");
    // As deploy/README.md: -x forwards the secret and the coordinator to every rank.
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "-x",
        "HEARTH_JOB_SECRET",
    ])
    .arg("-x")
    .arg(format!(
        "HEARTH_COORDINATOR=127.0.0.1:{}",
        common::coordinator_port()
    ))
    .arg("-x")
    .arg("PATH")
    .arg("hearth")
    .arg("train")
    .arg("--data")
    .arg(&data)
    .args(TRAIN.split_whitespace())
    .arg("--run-dir")
    .arg(&run)
    .env("PATH", path_with_hearth())
    .env("HEARTH_JOB_SECRET", secret)
    .env_remove("HEARTH_RANK")
    .env_remove("HEARTH_WORLD_SIZE")
    .env_remove("RANK")
    .env_remove("WORLD_SIZE");
    let log_path = work.path().join("mpirun.log");
    let status = run_logged(cmd, &log_path, Duration::from_secs(300));
    let log = read(&log_path);
    let status = status.unwrap_or_else(|| panic!("mpirun did not finish in 5 minutes:\n{log}"));
    assert!(status.success(), "mpirun: {status}\n{log}");
    assert_trained(&log, "Open MPI", &run);
}

/// `key: value` of the first line of `text` whose key is `key`, quotes and comments taken off.
fn yaml_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let l = l.split('#').next()?.trim().trim_start_matches("- ");
        let v = l.strip_prefix(key)?.strip_prefix(':')?;
        Some(v.trim().trim_matches('"').to_string())
    })
}

/// The value of the container environment variable `name`.
fn env_value(text: &str, name: &str) -> Option<String> {
    let mut lines = text
        .lines()
        .skip_while(|l| !l.contains(&format!("name: {name}")));
    lines.next()?;
    yaml_value(lines.next()?, "value")
}

#[test]
fn the_kubernetes_manifest_passes_strict_schema_validation_and_agrees_with_itself() {
    // The package's module, so a pip install outside PATH is found too.
    let installed = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed && !have("kubernetes-validate", &["python3 -m kubernetes_validate"]) {
        return;
    }
    let manifest =
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("deploy/kubernetes.yaml");
    let validate = |path: &Path| {
        Command::new("python3")
            .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
            .arg(path)
            .output()
            .expect("running kubernetes-validate")
    };
    let out = validate(&manifest);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "deploy/kubernetes.yaml: {said}");

    // The validator is real and strict: the same manifest with a misspelt field fails.
    let text = read(&manifest);
    let work = tempfile::tempdir().expect("a temporary directory");
    let broken = work.path().join("broken.yaml");
    std::fs::write(&broken, text.replace("completionMode:", "completionMod:"))
        .expect("writing the broken copy");
    let out = validate(&broken);
    assert!(
        !out.status.success(),
        "kubernetes-validate accepted a misspelt field: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    // What no schema checks: the ranks, the world size and rank 0's DNS name agree.
    let completions = yaml_value(&text, "completions").expect("completions");
    let parallelism = yaml_value(&text, "parallelism").expect("parallelism");
    let world = env_value(&text, "HEARTH_WORLD_SIZE").expect("HEARTH_WORLD_SIZE");
    assert_eq!(completions, world, "one pod per rank");
    assert_eq!(
        parallelism, world,
        "every rank runs at once (the rendezvous waits for all)"
    );
    let coordinator = env_value(&text, "HEARTH_COORDINATOR").expect("HEARTH_COORDINATOR");
    let service = text
        .split("---")
        .find(|doc| doc.contains("kind: Service"))
        .and_then(|doc| yaml_value(doc, "name"))
        .expect("the Service's name");
    let job = text
        .split("---")
        .find(|doc| doc.contains("kind: Job"))
        .and_then(|doc| yaml_value(doc, "name"))
        .expect("the Job's name");
    let subdomain = yaml_value(&text, "subdomain").expect("subdomain");
    assert_eq!(
        subdomain, service,
        "pods get DNS names only under their Service"
    );
    let port = yaml_value(&text, "port").expect("the Service's port");
    assert_eq!(
        coordinator,
        format!("{job}-0.{service}:{port}"),
        "HEARTH_COORDINATOR must name rank 0's pod through the Service"
    );
    assert_eq!(
        yaml_value(&text, "job-name").as_deref(),
        Some(job.as_str()),
        "the Service selects the Job's pods"
    );
}
