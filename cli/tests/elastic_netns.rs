//! The elastic scenarios across separate hosts: every worker runs in a network namespace of
//! its own, the namespaces joined by veth pairs on a bridge in a switch namespace, all made by
//! the test and removed at its end (also when it fails). A worker is cut off by dropping every
//! packet in its namespace's firewall (iptables), or by downing its veth where iptables is
//! missing. Where namespaces are not permitted (not root, no `ip`) the test fails, as it would
//! in CI, unless `HEARTH_ALLOW_SKIP=netns` (or `HEARTH_TEST_NO_NETNS`) lets the same scenarios
//! run on 127.0.0.1 with a visible SKIP note, a cut-off worker then being a stopped process.
//!
//! Workers are started as a multi-host job is: `hearth train --elastic` per host with the
//! launcher's variables (`HEARTH_RANK`, `HEARTH_COORDINATOR`, `HEARTH_ELASTIC_ADDR`,
//! `HEARTH_ELASTIC_PEERS`, ...), joiners without `HEARTH_RANK`. Every run is bounded in time.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Ports every worker uses inside its own namespace (free ports on loopback instead).
const COORDINATOR_PORT: u16 = 29400;
const JOIN_PORT: u16 = 29401;

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Hosts for one test: namespaces with their own addresses, or 127.0.0.1 as a fallback.
struct Hosts {
    /// Namespace of each host (empty on loopback), and the switch namespace.
    ns: Vec<String>,
    switch: Option<String>,
    /// (IP, coordinator port, join port) of each host.
    addrs: Vec<(String, u16, u16)>,
    firewall: bool,
    children: Vec<(String, Child)>,
    /// Workers stopped by `cut` on loopback: they never exit by themselves.
    stopped: Vec<String>,
}

impl Hosts {
    fn new(n: usize) -> Hosts {
        static TEST: AtomicUsize = AtomicUsize::new(0);
        let tag = format!(
            "{}{}",
            std::process::id() % 100_000,
            (b'a' + TEST.fetch_add(1, Ordering::SeqCst) as u8) as char
        );
        let mut hosts = Hosts {
            ns: Vec::new(),
            switch: None,
            addrs: Vec::new(),
            firewall: false,
            children: Vec::new(),
            stopped: Vec::new(),
        };
        match hosts.make_namespaces(&tag, n) {
            Ok(()) => {
                hosts.firewall = Command::new("ip")
                    .args(["netns", "exec", &hosts.ns[0], "iptables", "-L", "-n"])
                    .output()
                    .is_ok_and(|o| o.status.success());
                if !hosts.firewall {
                    eprintln!("NOTE: no iptables: a cut-off worker's veth is downed instead");
                }
            }
            Err(e)
                if !common::may_skip("netns")
                    && std::env::var_os("HEARTH_TEST_NO_NETNS").is_none() =>
            {
                hosts.remove_namespaces();
                panic!(
                    "the namespaces could not be made: {e}; run as root with `ip` (as CI does), \
                     or set HEARTH_ALLOW_SKIP=netns to run on 127.0.0.1 instead"
                );
            }
            Err(e) => {
                eprintln!(
                    "SKIP (namespaces, HEARTH_ALLOW_SKIP=netns): separate hosts need `ip netns` \
                     as root ({e}); running on 127.0.0.1, a cut-off worker being a stopped process"
                );
                hosts.remove_namespaces();
                hosts.addrs = (0..n)
                    .map(|_| {
                        (
                            "127.0.0.1".to_string(),
                            common::coordinator_port(),
                            common::coordinator_port(),
                        )
                    })
                    .collect();
            }
        }
        hosts
    }

    fn make_namespaces(&mut self, tag: &str, n: usize) -> Result<(), String> {
        if std::env::var_os("HEARTH_TEST_NO_NETNS").is_some() {
            return Err("HEARTH_TEST_NO_NETNS is set".into());
        }
        let switch = format!("hs{tag}");
        sh(&["ip", "netns", "add", &switch])?;
        self.switch = Some(switch.clone());
        sh(&["ip", "-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = format!("h{tag}{i}");
            sh(&["ip", "netns", "add", &ns])?;
            self.ns.push(ns.clone());
            let port = format!("p{i}");
            sh(&[
                "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &switch,
            ])?;
            let ip = format!("10.77.0.{}", i + 1);
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "eth0",
            ])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            sh(&["ip", "-n", &switch, "link", "set", &port, "master", "br0"])?;
            sh(&["ip", "-n", &switch, "link", "set", &port, "up"])?;
            self.addrs.push((ip, COORDINATOR_PORT, JOIN_PORT));
        }
        Ok(())
    }

    fn remove_namespaces(&mut self) {
        for ns in self.ns.drain(..).chain(self.switch.take()) {
            let _ = sh(&["ip", "netns", "del", &ns]);
        }
    }

    fn separate(&self) -> bool {
        !self.ns.is_empty()
    }

    fn join_addr(&self, host: usize) -> String {
        format!("{}:{}", self.addrs[host].0, self.addrs[host].2)
    }

    /// Starts `hearth train --elastic` on `host` as worker `w<host>`: rank `rank` of `world`
    /// in the first membership epoch, or a joiner (`None`).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        host: usize,
        rank: Option<(usize, usize)>,
        data: &Path,
        run: &Path,
        train: &[&str],
        env: &[(&str, &str)],
        secret: &str,
    ) {
        let bin = env!("CARGO_BIN_EXE_hearth");
        let mut command = if self.separate() {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.ns[host], bin]);
            c
        } else {
            Command::new(bin)
        };
        let id = format!("w{host}");
        let log = std::fs::File::create(run.with_file_name(format!("{id}.log"))).unwrap();
        let peers: Vec<String> = (0..self.addrs.len()).map(|h| self.join_addr(h)).collect();
        command
            .args(["train", "--elastic", "--data"])
            .arg(data)
            .args(["--run-dir", run.to_str().unwrap()])
            .args(common::ELASTIC_TRAIN)
            .args(train)
            .envs(env.iter().copied())
            .env("HEARTH_JOB_SECRET", secret)
            // The joiner has no coordinator address: the job's id salts the secret's key.
            .env("HEARTH_JOB_ID", format!("netns-{secret}"))
            .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
            .env("HEARTH_ELASTIC_ID", &id)
            .env("HEARTH_ELASTIC_ADDR", self.join_addr(host))
            .env("HEARTH_ELASTIC_PEERS", peers.join(","))
            .env_remove("HEARTH_RANK")
            .env_remove("HEARTH_WORLD_SIZE")
            .env_remove("HEARTH_COORDINATOR")
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log));
        if let Some((rank, world)) = rank {
            let (ip, port, _) = &self.addrs[0];
            command
                .env("HEARTH_RANK", rank.to_string())
                .env("HEARTH_WORLD_SIZE", world.to_string())
                .env("HEARTH_COORDINATOR", format!("{ip}:{port}"));
        }
        self.children.push((id, command.spawn().unwrap()));
    }

    /// Cuts `host` off: every packet in or out of its namespace dropped (a stopped process on
    /// loopback).
    fn cut(&mut self, host: usize) {
        let id = format!("w{host}");
        if !self.separate() {
            let pid = self.children.iter().find(|c| c.0 == id).unwrap().1.id();
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
            self.stopped.push(id);
            return;
        }
        let ns = self.ns[host].clone();
        if self.firewall {
            for chain in ["INPUT", "OUTPUT"] {
                sh(&[
                    "ip", "netns", "exec", &ns, "iptables", "-A", chain, "-j", "DROP",
                ])
                .unwrap();
            }
        } else {
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "down"]).unwrap();
        }
    }

    /// Waits for every worker, up to `limit` in all; those still running then are killed, as
    /// are stopped ones once the others are done. Returns (id, exit code or None when killed,
    /// log), in start order.
    fn wait(&mut self, run: &Path, limit: Duration) -> Vec<(String, Option<i32>, String)> {
        let until = Instant::now() + limit;
        let mut out = Vec::new();
        let stopped = std::mem::take(&mut self.stopped);
        self.children.sort_by_key(|(id, _)| stopped.contains(id));
        for (id, child) in &mut self.children {
            if stopped.contains(id) {
                let _ = child.kill();
            }
            let code = common::wait_bounded(child, until).and_then(|s| s.code());
            let log = std::fs::read_to_string(run.with_file_name(format!("{id}.log")))
                .unwrap_or_default();
            out.push((id.clone(), code, log));
        }
        self.children.clear();
        out.sort_by_key(|(id, _, _)| id[1..].parse::<usize>().unwrap_or(usize::MAX));
        out
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.remove_namespaces();
    }
}

/// Waits (up to 120 s) until w0 has logged the run's second epoch.
fn wait_for_second_epoch(run: &Path) {
    let w0_log = run.with_file_name("w0.log");
    let until = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(&w0_log)
        .unwrap_or_default()
        .contains("epoch 2/")
    {
        assert!(Instant::now() < until, "no second epoch in 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A worker's `final weights` line: (fingerprint, world size).
fn final_weights(log: &str) -> Option<(String, usize)> {
    let (_, fp, size) = log.lines().find_map(common::final_weights)?;
    Some((fp, size))
}

/// Every survivor in `expect` exited 0 holding the same weights in a world of their number;
/// the run exported its model and logged every step once.
fn check_survivors(
    results: &[(String, Option<i32>, String)],
    expect: &[&str],
    run: &Path,
    steps: usize,
) {
    let all_logs = || {
        results
            .iter()
            .map(|(id, code, log)| format!("==== {id} (exit {code:?})\n{log}"))
            .collect::<String>()
    };
    let mut finals = Vec::new();
    for id in expect {
        let (_, code, log) = results.iter().find(|r| r.0 == *id).unwrap();
        assert_eq!(*code, Some(0), "{id} finished\n{}", all_logs());
        finals.push(final_weights(log).unwrap_or_else(|| panic!("{id}: final\n{}", all_logs())));
    }
    for f in &finals {
        assert_eq!(
            f, &finals[0],
            "identical weights on every survivor: {finals:?}"
        );
        assert_eq!(f.1, expect.len(), "world size at the end");
    }
    assert!(run.join("model.bpk").is_file(), "exported model");
    let (width, _) = image::image_dimensions(run.join("metrics.png")).unwrap();
    assert_eq!(width, 1650, "metrics.png has the world-size panel");
    let worlds = std::fs::read_to_string(run.join("world.csv")).unwrap();
    assert_eq!(worlds.lines().skip(1).count(), steps, "every step once");
}

#[test]
fn kill_in_an_allreduce_a_joiner_and_a_graceful_leave_across_hosts() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let run = tmp.path().join("run");
    let mut hosts = Hosts::new(4);
    let train = ["--epochs", "8", "--min-workers", "2", "--max-workers", "4"];
    let env = [
        // w2 SIGKILLs itself between the control and the gradient allreduce of step 12.
        ("HEARTH_ELASTIC_DIE_AT_STEP", "w2:12"),
        // w1 leaves as SIGTERM makes it: after step 50, announced, exit 0.
        ("HEARTH_ELASTIC_LEAVE_AT_STEP", "w1:50"),
        ("HEARTH_ELASTIC_THROTTLE", "w0:15,w1:15,w2:15,w3:15"),
    ];
    let secret = "8f8007227b2bf585c8140bd468e40575";
    for h in 0..3 {
        hosts.start(h, Some((h, 3)), &d, &run, &train, &env, secret);
    }
    hosts.start(3, None, &d, &run, &train, &env, secret);
    let results = hosts.wait(&run, Duration::from_secs(240));
    check_survivors(&results, &["w0", "w3"], &run, 80);
    let log = |id: &str| &results.iter().find(|r| r.0 == id).unwrap().2;
    assert!(
        log("w1").contains("w1 left the job after step"),
        "{}",
        log("w1")
    );
    assert_eq!(results[1].1, Some(0), "a graceful leave exits 0");
    assert!(log("w0").contains("lost w2"), "{}", log("w0"));
    assert_eq!(results[2].1, None, "w2 died by its signal");
}

#[test]
fn a_worker_cut_off_by_its_firewall_with_default_flags_cannot_fork_the_job() {
    // Default --min-workers (1): only the quorum rule stops the cut-off worker from training
    // on alone into the same run directory.
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let run = tmp.path().join("run");
    let mut hosts = Hosts::new(3);
    let train = ["--epochs", "5"];
    let env = [("HEARTH_ELASTIC_THROTTLE", "w0:15,w1:15,w2:15")];
    for h in 0..3 {
        hosts.start(
            h,
            Some((h, 3)),
            &d,
            &run,
            &train,
            &env,
            "50259282cc55d6d9fc0f3e4f8e146428",
        );
    }
    wait_for_second_epoch(&run);
    hosts.cut(2);
    let separate = hosts.separate();
    let results = hosts.wait(&run, Duration::from_secs(240));
    check_survivors(&results, &["w0", "w1"], &run, 50);
    let (_, code, log) = &results[2];
    if separate {
        assert!(matches!(code, Some(c) if *c != 0), "{code:?}\n{log}");
        assert!(
            log.contains("cut off from the elastic job: w2 reached 1 of the 3 members"),
            "the cut-off worker says why it stops:\n{log}"
        );
        assert!(!log.contains("membership epoch 1"), "{log}");
        assert!(!log.contains("final weights"), "{log}");
    }
    let fence = std::fs::read_to_string(run.join("checkpoint").join("elastic.fence")).unwrap();
    assert!(
        fence.contains("\"epoch\":1") && fence.contains("\"by\":\"w0\""),
        "{fence}"
    );
    assert!(results[0].2.contains("lost w2"), "{}", results[0].2);
}

#[test]
fn a_worker_cut_off_and_rank_0_killed_across_hosts() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let run = tmp.path().join("run");
    let mut hosts = Hosts::new(4);
    let train = [
        "--epochs",
        "6",
        "--min-workers",
        "2",
        "--max-workers",
        "4",
        "--rejoin-timeout",
        "10",
    ];
    let env = [
        ("HEARTH_ELASTIC_DIE_AT_STEP", "w0:40"),
        ("HEARTH_ELASTIC_THROTTLE", "w0:15,w1:15,w2:15,w3:15"),
    ];
    let secret = "2d61d4f5bdc1a6558b268738d935cfc2";
    for h in 0..4 {
        hosts.start(h, Some((h, 4)), &d, &run, &train, &env, secret);
    }
    // w3 is cut off once the second epoch is logged.
    wait_for_second_epoch(&run);
    hosts.cut(3);
    let separate = hosts.separate();
    let results = hosts.wait(&run, Duration::from_secs(240));
    check_survivors(&results, &["w1", "w2"], &run, 60);
    let (_, code, log) = &results[3];
    if separate {
        // Alone in its namespace, w3 holds no quorum (1 of 4): it stops saying so, and
        // leaves the job's newer state alone.
        assert!(
            log.contains("cut off from the elastic job: w3 reached 1 of the 4 members"),
            "the cut-off worker says why it stops:\n{log}"
        );
        assert!(matches!(code, Some(c) if *c != 0), "{code:?}");
    }
    let w1 = &results[1].2;
    assert!(w1.contains("lost w3"), "{w1}");
    assert!(w1.contains("lost w0"), "{w1}");
}
