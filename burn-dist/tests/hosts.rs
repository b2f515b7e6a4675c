//! Two "hosts" of two ranks each: network namespaces joined by a veth pair, made by the test and
//! removed at its end. Ranks of one namespace share memory; the allreduce reduces within each
//! host in shared memory, runs the ring between the two host leaders over QUIC, and broadcasts
//! within each host. The sums are checked against values computed directly.
//!
//! Needs root and `ip` (as CI has); without them the test fails, unless
//! `HEARTH_ALLOW_SKIP=netns` (or `HEARTH_TEST_NO_NETNS`) lets it say SKIP and return (the same
//! algorithm runs with in-memory links in `burn-dist`'s unit tests). Every wait has a deadline.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use burn_dist::rendezvous::{RankInfo, connect};
use burn_dist::tls::Membership;
use burn_dist::{Communicator, ReduceOp, Transport};
use common::{SECRET, finish, options_shm};

const PORT: u16 = 29511;

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

/// Two namespaces joined by one veth pair, 10.78.<k>.1 and 10.78.<k>.2; removed on drop.
struct TwoHosts {
    ns: Vec<String>,
    ips: Vec<String>,
}

impl TwoHosts {
    fn new() -> Result<TwoHosts, String> {
        if std::env::var_os("HEARTH_TEST_NO_NETNS").is_some() {
            return Err("HEARTH_TEST_NO_NETNS is set".into());
        }
        let tag = std::process::id() % 100_000;
        let k = tag % 250 + 1;
        let mut hosts = TwoHosts {
            ns: Vec::new(),
            ips: Vec::new(),
        };
        for i in 0..2 {
            let ns = format!("hh{tag}{i}");
            sh(&["ip", "netns", "add", &ns])?;
            hosts.ns.push(ns);
        }
        let (a, b) = (&hosts.ns[0], &hosts.ns[1]);
        sh(&[
            "ip", "link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "eth0",
            "netns", b,
        ])?;
        for (i, ns) in hosts.ns.iter().enumerate() {
            let ip = format!("10.78.{k}.{}", i + 1);
            sh(&[
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "eth0",
            ])?;
            sh(&["ip", "-n", ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
            hosts.ips.push(ip);
        }
        Ok(hosts)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

fn value(rank: usize, i: usize) -> f32 {
    ((i * 31 + rank * 17) % 101) as f32
}

/// One rank (ignored: its parent runs it with HOSTS_CHILD set).
#[test]
#[ignore = "one rank of a multi-process test: its parent test starts it"]
fn child() {
    assert!(
        std::env::var_os("HOSTS_CHILD").is_some(),
        "started by its parent test"
    );
    let info = RankInfo::from_env().expect("rank from the environment");
    let t = connect(
        &info,
        &Membership::from_env().expect("secret"),
        &options_shm(Duration::from_secs(30)),
    )
    .expect("rendezvous");
    let leaders = t.topology().map(|t| t.leaders.clone());
    println!("rank {}: leaders {leaders:?}", info.rank);
    let (rank, world) = (info.rank, info.world);
    let comm = Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(60));
    // Several pieces of the default 1 MiB slot, and lengths that do not split evenly.
    for len in [0usize, 1, 5, 1000, 300_001, 1_000_003] {
        let mut v: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
        comm.allreduce(&mut v, ReduceOp::Sum).expect("allreduce");
        for (i, x) in v.iter().enumerate() {
            let want: f64 = (0..world).map(|r| f64::from(value(r, i))).sum();
            assert_eq!(f64::from(*x), want, "len {len} [{i}]");
        }
    }
    let mut m = vec![rank as f32; 4097];
    comm.allreduce(&mut m, ReduceOp::Mean).expect("mean");
    let mean = (0..world).sum::<usize>() as f32 / world as f32;
    assert!(m.iter().all(|&x| x == mean));
    comm.barrier().expect("barrier");
    println!("rank {rank}: hierarchical OK");
}

/// Whether `HEARTH_ALLOW_SKIP` lets this test skip without namespaces (`netns` or `all`);
/// otherwise their absence fails it, as in CI.
fn may_skip_netns() -> bool {
    std::env::var("HEARTH_ALLOW_SKIP").is_ok_and(|v| {
        v.split(',')
            .any(|s| s.trim() == "netns" || s.trim() == "all")
    })
}

#[test]
fn two_hosts_of_two_ranks_reduce_by_host_and_match_the_direct_sum() {
    let hosts = match TwoHosts::new() {
        Ok(h) => h,
        Err(e) if !may_skip_netns() && std::env::var_os("HEARTH_TEST_NO_NETNS").is_none() => {
            panic!(
                "two hosts could not be made: {e}; run as root with `ip` (as CI does), or set \
                 HEARTH_ALLOW_SKIP=netns to skip it"
            )
        }
        Err(e) => {
            eprintln!("SKIP (HEARTH_ALLOW_SKIP=netns): two hosts need `ip netns` as root ({e})");
            return;
        }
    };
    let exe = std::env::current_exe().unwrap();
    let coordinator = format!("{}:{PORT}", hosts.ips[0]);
    // Ranks 0 and 1 on the first host, 2 and 3 on the second.
    let children: Vec<Child> = (0..4)
        .map(|rank| {
            Command::new("ip")
                .args(["netns", "exec", &hosts.ns[rank / 2]])
                .arg(&exe)
                .args([
                    "--exact",
                    "child",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("HOSTS_CHILD", "1")
                .env("HEARTH_RANK", rank.to_string())
                .env("HEARTH_WORLD_SIZE", "4")
                .env("HEARTH_COORDINATOR", &coordinator)
                .env("HEARTH_JOB_SECRET", SECRET)
                .env_remove("HEARTH_SHM")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawning a rank")
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let (ok, out) = finish(c, Duration::from_secs(120));
        assert!(ok, "rank {r} failed:\n{out}");
        assert!(out.contains("hierarchical OK"), "rank {r}:\n{out}");
        assert!(
            out.contains("leaders Some([0, 0, 2, 2])"),
            "rank {r} should see two hosts of two:\n{out}"
        );
    }
}
