//! `hearth launch --elastic` and `hearth train --elastic` as real process trees on 127.0.0.1:
//! a worker killed inside a step, a joiner, a graceful leave, rank 0 killed, a worker cut off
//! (stopped: not a packet in or out), equivalence with a fixed world, uneven shares by
//! throughput, and a soak of 50 membership events. Every run is bounded in time: a hang fails.
//!
//! These run on loopback, where "cut off" is a stopped process; `elastic_netns.rs` runs the
//! membership scenarios across network namespaces, with a link whose packets are dropped.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::tensors;

struct Run {
    ok: bool,
    log: String,
    dir: PathBuf,
}

impl Run {
    /// Each worker's `final weights` fingerprint line: (worker, fingerprint, world size).
    fn finals(&self) -> Vec<(String, String, usize)> {
        self.log.lines().filter_map(common::final_weights).collect()
    }

    /// World size per step from world.csv.
    fn worlds(&self) -> Vec<usize> {
        std::fs::read_to_string(self.dir.join("world.csv"))
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter_map(|l| l.rsplit(',').next()?.parse().ok())
            .collect()
    }

    /// Asserts the run finished, with `world` survivors holding identical weights.
    fn check(&self, world: usize) {
        assert!(self.ok, "the elastic run failed:\n{}", self.log);
        let finals = self.finals();
        assert_eq!(finals.len(), world, "survivors: {finals:?}\n{}", self.log);
        assert!(
            finals.iter().all(|f| f.1 == finals[0].1 && f.2 == world),
            "every survivor holds the same weights: {finals:?}"
        );
        assert!(self.dir.join("model.bpk").is_file(), "exported model");
        let (width, _) = image::image_dimensions(self.dir.join("metrics.png")).unwrap();
        assert_eq!(width, 1650, "metrics.png has the world-size panel");
    }
}

/// `hearth launch --elastic LAUNCH -- hearth train --elastic ...TRAIN` with `env`.
fn elastic(data: &Path, run: &Path, launch: &[&str], train: &[&str], env: &[(&str, &str)]) -> Run {
    elastic_in(data, run, "--run-dir", launch, train, env)
}

/// [`elastic`] resuming `run` (`--resume`).
fn elastic_resume(data: &Path, run: &Path, launch: &[&str], train: &[&str]) -> Run {
    elastic_in(data, run, "--resume", launch, train, &[])
}

fn elastic_in(
    data: &Path,
    run: &Path,
    how: &str,
    launch: &[&str],
    train: &[&str],
    env: &[(&str, &str)],
) -> Run {
    let log = run.with_extension(if how == "--resume" {
        "resumed.log"
    } else {
        "log"
    });
    let file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["launch", "--elastic"])
        .args(launch)
        .args(["--", "hearth", "train", "--elastic", "--data"])
        .arg(data)
        .args([how, run.to_str().unwrap()])
        .args(common::ELASTIC_TRAIN)
        .args(train)
        .envs(env.iter().copied())
        .env("HEARTH_COLLECTIVE_TIMEOUT", "60")
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap();
    let status = common::wait_bounded(&mut child, Instant::now() + Duration::from_secs(240));
    Run {
        ok: status.is_some_and(|s| s.success()),
        log: std::fs::read_to_string(&log).unwrap_or_default(),
        dir: run.to_path_buf(),
    }
}

/// The reference the membership changes are compared with: 2 workers throughout, 4 epochs.
fn fixed_world(data: &Path, run: &Path) -> Run {
    let fixed = elastic(
        data,
        run,
        &["-n", "2", "--min", "1", "--max", "2"],
        &["--epochs", "4"],
        &[("HEARTH_ELASTIC_THROTTLE", "w0:40,w1:40")],
    );
    fixed.check(2);
    fixed
}

/// The last epoch's checkpoint as name -> values.
fn last_checkpoint(run: &Path, epoch: usize) -> BTreeMap<String, Vec<f32>> {
    tensors(&run.join("checkpoint").join(format!("model-{epoch}.bpk")))
        .into_iter()
        .collect()
}

fn assert_close(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>, what: &str) {
    assert_within(a, b, what, 1e-5);
}

fn assert_within(
    a: &BTreeMap<String, Vec<f32>>,
    b: &BTreeMap<String, Vec<f32>>,
    what: &str,
    bound: f32,
) {
    assert_eq!(a.len(), b.len(), "{what}: tensor sets");
    let mut worst = 0f32;
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.len(), y.len(), "{what}: {name}");
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
        }
    }
    assert!(worst <= bound, "{what}: max difference {worst}");
}

/// 3 workers, a joiner at once, w2 killed inside step `die` and w1 leaving gracefully after
/// step `leave`, over `epochs` epochs with `extra` flags: the survivors w0 and w3 finish with
/// identical weights, having run every step once. Returns the run for further checks.
fn kill_join_leave(epochs: usize, die: usize, leave: usize, extra: &[&str]) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let (epochs, die, leave) = (
        epochs.to_string(),
        format!("w2:{die}"),
        format!("w1:{leave}"),
    );
    let mut train = vec!["--epochs", epochs.as_str()];
    train.extend_from_slice(extra);
    let run = elastic(
        &d,
        &tmp.path().join("run"),
        &["-n", "3", "--min", "2", "--max", "4", "--churn", "t=0s:+1"],
        &train,
        &[
            ("HEARTH_ELASTIC_DIE_AT_STEP", die.as_str()),
            ("HEARTH_ELASTIC_LEAVE_AT_STEP", leave.as_str()),
            ("HEARTH_ELASTIC_THROTTLE", "w0:15,w1:15,w2:15,w3:15"),
        ],
    );
    run.check(2);
    let finals = run.finals();
    let ids: Vec<&str> = finals.iter().map(|f| f.0.as_str()).collect();
    assert!(ids.contains(&"w0") && ids.contains(&"w3"), "{ids:?}");
    assert!(
        run.log.contains("w1 left the job after step"),
        "{}",
        run.log
    );
    assert!(
        run.log.contains("lost w2"),
        "the loss was seen:\n{}",
        run.log
    );
    let worlds = run.worlds();
    let steps = epochs.parse::<usize>().unwrap() * 10;
    assert_eq!(worlds.len(), steps, "every step of every epoch once");
    assert_eq!(worlds.last(), Some(&2));
    assert!(worlds.contains(&3), "{worlds:?}");
    run
}

#[test]
fn a_worker_killed_mid_step_a_joiner_and_a_graceful_leave_keep_training() {
    kill_join_leave(12, 12, 60, &[]);
}

#[test]
fn rank_0_killed_hands_coordination_to_the_lowest_survivor() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let t = Instant::now();
    let run = elastic(
        &d,
        &tmp.path().join("run"),
        &["-n", "3", "--min", "2", "--max", "3"],
        &["--epochs", "4"],
        &[("HEARTH_ELASTIC_DIE_AT_STEP", "w0:15")],
    );
    run.check(2);
    let ids: Vec<String> = run.finals().into_iter().map(|f| f.0).collect();
    assert_eq!(ids.len(), 2);
    assert!(!ids.contains(&"w0".to_string()), "{ids:?}");
    assert!(
        run.log
            .contains("[w1] membership epoch 1: 2 workers [w1, w2]"),
        "{}",
        run.log
    );
    assert!(t.elapsed() < Duration::from_secs(120));
}

#[test]
fn a_worker_cut_off_is_dropped_and_below_the_minimum_it_gives_up() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let run = elastic(
        &d,
        &tmp.path().join("run"),
        &["-n", "3", "--min", "2", "--max", "3"],
        &["--epochs", "4"],
        &[("HEARTH_ELASTIC_FREEZE_AT_STEP", "w1:15")],
    );
    run.check(2);
    assert!(run.log.contains("lost w1"), "{}", run.log);

    // Two workers, minimum two: one dies, nobody joins within the rejoin timeout.
    let run = elastic(
        &d,
        &tmp.path().join("short"),
        &["-n", "2", "--min", "2", "--max", "2"],
        &["--epochs", "4", "--rejoin-timeout", "3"],
        &[("HEARTH_ELASTIC_DIE_AT_STEP", "w1:15")],
    );
    assert!(!run.ok, "{}", run.log);
    assert!(run.log.contains("--min-workers 2"), "{}", run.log);
    let state = tmp
        .path()
        .join("short")
        .join("checkpoint")
        .join("elastic.state");
    assert!(state.is_file(), "the state is saved for --resume");
}

/// `stopped` (SIGSTOP) inside step 15 of a world of 3 with default flags, continued 10 s later:
/// the two others (`survivors`, the first their rank 0) lose it and train on as membership
/// epoch 1; the stopped one, back, reaches nobody and holds no quorum (1 of 3): it ends with an
/// error saying so and writes nothing (the fence names the survivors' rank 0, metrics.csv holds
/// every epoch once), and the launcher reports the job finished.
fn stopped_then_continued(stopped: &str, survivors: [&str; 2]) {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let (freeze, secs) = (format!("{stopped}:15"), format!("{stopped}:10"));
    let run = elastic(
        &d,
        &tmp.path().join("run"),
        &["-n", "3"],
        &["--epochs", "12"],
        &[
            ("HEARTH_ELASTIC_FREEZE_AT_STEP", freeze.as_str()),
            ("HEARTH_ELASTIC_FREEZE_SECS", secs.as_str()),
            ("HEARTH_ELASTIC_THROTTLE", "w0:50,w1:50,w2:50"),
        ],
    );
    run.check(2);
    let ids: Vec<String> = run.finals().into_iter().map(|f| f.0).collect();
    for s in survivors {
        assert!(ids.contains(&s.to_string()), "{ids:?}");
    }
    let formed = format!(
        "[{}] membership epoch 1: 2 workers [{}, {}]",
        survivors[0], survivors[0], survivors[1]
    );
    assert!(run.log.contains(&formed), "{}", run.log);
    let cut = run
        .log
        .lines()
        .find(|l| {
            l.starts_with(&format!("[{stopped}]")) && l.contains("cut off from the elastic job")
        })
        .unwrap_or_else(|| panic!("{stopped} says it was cut off:\n{}", run.log));
    let reached = format!("{stopped} reached 1 of the 3 members of membership epoch 0");
    assert!(
        cut.contains(&reached) && cut.contains("needs 2 of them"),
        "{cut}"
    );
    // It formed no later epoch (rank 0 says epoch 0's line itself).
    assert!(
        !run.log.contains(&format!("[{stopped}] membership epoch 1")),
        "{}",
        run.log
    );
    assert!(
        !run.log.contains(&format!("[{stopped}] exported")),
        "{}",
        run.log
    );
    let fence = std::fs::read_to_string(run.dir.join("checkpoint").join("elastic.fence")).unwrap();
    assert!(
        fence.contains("\"epoch\":1") && fence.contains(&format!("\"by\":\"{}\"", survivors[0])),
        "{fence}"
    );
    let rows = common::metrics(&run.dir);
    assert_eq!(
        rows.keys().copied().collect::<Vec<_>>(),
        (1..=12).collect::<Vec<_>>(),
        "metrics.csv holds every epoch, none rolled back"
    );
    assert_eq!(
        run.worlds().len(),
        12 * 10,
        "every step of every epoch once"
    );
}

#[test]
fn a_worker_stopped_then_continued_with_default_flags_is_cut_off_and_the_majority_trains_on() {
    // Issue 27's reproduction.
    stopped_then_continued("w2", ["w0", "w1"]);
}

#[test]
fn rank_0_stopped_then_continued_is_cut_off_and_writes_nothing() {
    // Issue 55: "writes nothing" was asserted only of workers that never write; here rank 0
    // itself stops, and w1 becomes rank 0 and the fence's holder.
    stopped_then_continued("w0", ["w1", "w2"]);
}

#[test]
fn one_leave_and_one_join_equal_a_fixed_world_fed_the_same_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let slow = ("HEARTH_ELASTIC_THROTTLE", "w0:40,w1:40,w2:40");
    let fixed = fixed_world(&d, &tmp.path().join("fixed"));
    let churned = elastic(
        &d,
        &tmp.path().join("churned"),
        &["-n", "2", "--min", "1", "--max", "3", "--churn", "t=0s:+1"],
        &["--epochs", "4"],
        // The joiner starts at once and is in by step 30 (it needs about a second), when w1
        // leaves: 2 -> 3 -> 2 workers.
        &[slow, ("HEARTH_ELASTIC_LEAVE_AT_STEP", "w1:30")],
    );
    churned.check(2);
    let worlds = churned.worlds();
    assert!(
        worlds.contains(&3) && worlds.last() == Some(&2),
        "{worlds:?}\n{}",
        churned.log
    );
    assert_close(
        &last_checkpoint(&fixed.dir, 4),
        &last_checkpoint(&churned.dir, 4),
        "leave and join vs fixed world",
    );
}

/// 3 workers; w1 leaves after step 5, and `dies` dies after membership epoch 1's announcement,
/// before its rendezvous: the survivors settle that epoch over the old links and form epoch 2
/// without it. The rendezvous keeps its default timeout (120 s): it ends as soon as the old
/// links find the worker dead, and a rendezvous that waited its timeout out fails the log
/// checks below.
fn a_death_while_forming(
    data: &Path,
    run: &Path,
    workers: usize,
    dies: &str,
    extra: &[&str],
) -> Run {
    let die = format!("{dies}:1");
    let mut train = vec!["--epochs", "4"];
    train.extend_from_slice(extra);
    let n = workers.to_string();
    let throttle = (0..workers)
        .map(|w| format!("w{w}:40"))
        .collect::<Vec<_>>()
        .join(",");
    elastic(
        data,
        run,
        &["-n", &n, "--min", "1", "--max", &n],
        &train,
        &[
            ("HEARTH_ELASTIC_THROTTLE", throttle.as_str()),
            ("HEARTH_ELASTIC_LEAVE_AT_STEP", "w1:5"),
            ("HEARTH_ELASTIC_DIE_IN_CHANGE", die.as_str()),
        ],
    )
}

#[test]
fn a_worker_lost_while_the_next_world_forms_is_dropped_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    // The global batch stays fixed through it: the same weights as 2 workers throughout.
    let fixed = fixed_world(&d, &tmp.path().join("fixed"));
    // w1 leaves; as the next epoch forms a member dies (the announcer w0 finds it by its
    // missing report), or the announcer itself (the lowest survivor hears nothing from it and
    // announces the next epoch). Each rendezvous ends on the loss, not on its timeout. The
    // leaver counts toward neither side of the quorum: of 3 workers, w0 and w2 stayed, and w0
    // alone keeps the tie; of 4, w2 and w3 are 2 of the 3 that stayed.
    let cases = [
        (
            3,
            "w2",
            &["w0"][..],
            &[
                "w0: forming membership epoch 1 failed here: rank 2 failed: w2 was lost",
                "w0: membership epoch 1 did not form (lost w2 while it formed); forming epoch 2",
                "membership epoch 2: 1 workers [w0]",
            ][..],
        ),
        (
            4,
            "w0",
            &["w2", "w3"][..],
            &[
                "w2: forming membership epoch 1 failed here: rank 0 failed: w0 was lost",
                "w2: no word from w0 on membership epoch 1",
                "membership epoch 2: 2 workers [w2, w3]",
            ][..],
        ),
    ];
    for (workers, dies, survivors, said) in cases {
        let run = a_death_while_forming(
            &d,
            &tmp.path().join(format!("{dies}-of-{workers}")),
            workers,
            dies,
            &[],
        );
        run.check(survivors.len());
        let ids: Vec<String> = run.finals().into_iter().map(|f| f.0).collect();
        for s in survivors {
            assert!(ids.contains(&s.to_string()), "{ids:?}\n{}", run.log);
        }
        for line in said {
            assert!(
                run.log.contains(line),
                "{dies} dies: no {line:?} in\n{}",
                run.log
            );
        }
        let worlds = run.worlds();
        assert_eq!(worlds.len(), 4 * 10, "every step once: {worlds:?}");
        assert_eq!(
            (worlds[0], worlds.last()),
            (workers, Some(&survivors.len())),
            "{worlds:?}"
        );
        assert_close(
            &last_checkpoint(&fixed.dir, 4),
            &last_checkpoint(&run.dir, 4),
            &format!("{dies} of {workers} lost while forming vs fixed world"),
        );
    }
}

#[test]
fn after_a_graceful_leave_the_lone_survivor_of_a_lost_rank_0_stops_and_writes_nothing() {
    // Issue 55: the leaver used to count as present, so w2, alone after w1 left and w0 died
    // while the next epoch formed, held "2 of 3" and trained on; had w0 been cut off instead
    // of dead, it would have trained on too. Over the world after the leave (w0 and w2) w2 has
    // half without the tie-breaker: it stops, naming why, and writes nothing.
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let run = a_death_while_forming(&d, &tmp.path().join("run"), 3, "w0", &[]);
    assert!(!run.ok, "w2 alone must not train on:\n{}", run.log);
    assert!(
        run.log.contains(
            "w2 reached 1 of the 2 members of membership epoch 0 that did not leave (w2; lost w0)"
        ),
        "{}",
        run.log
    );
    assert!(!run.log.contains("membership epoch 2"), "{}", run.log);
    assert!(!run.dir.join("model.bpk").exists(), "nothing exported");
}

/// A joiner admitted to an epoch that a member's death keeps from forming asks again and is
/// admitted to a later one; with `--zero 1` too, the lost worker's optimizer shard coming from
/// the replica its neighbour keeps.
#[test]
fn a_joiner_in_an_epoch_that_did_not_form_asks_again() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let fixed = fixed_world(&d, &tmp.path().join("fixed"));
    for (name, extra) in [("plain", &[][..]), ("zero", &["--zero", "1"][..])] {
        let mut train = vec!["--epochs", "4"];
        train.extend_from_slice(extra);
        // Epoch 1 is the joiner's (w3); w2 dies after its announcement. The joiner finds the
        // epoch failed when its link to w0 closes or idles out (5 s); 300 ms steps leave it
        // time to join again.
        let run = elastic(
            &d,
            &tmp.path().join(name),
            &["-n", "3", "--min", "1", "--max", "4", "--churn", "t=0s:+1"],
            &train,
            &[
                ("HEARTH_ELASTIC_THROTTLE", "w0:300,w1:300,w2:300,w3:300"),
                ("HEARTH_ELASTIC_DIE_IN_CHANGE", "w2:1"),
            ],
        );
        run.check(3);
        let mut ids: Vec<String> = run.finals().into_iter().map(|f| f.0).collect();
        ids.sort();
        assert_eq!(ids, ["w0", "w1", "w3"], "{name}");
        for said in [
            "w0: membership epoch 1 did not form (lost w2 while it formed)",
            "w3: membership epoch 1 did not form here",
        ] {
            assert!(
                run.log.contains(said),
                "{name}: no {said:?} in\n{}",
                run.log
            );
        }
        assert_close(
            &last_checkpoint(&fixed.dir, 4),
            &last_checkpoint(&run.dir, 4),
            &format!("{name}: a joiner's epoch formed again vs fixed world"),
        );
    }
}

#[test]
fn uneven_shares_by_throughput_equal_one_process_on_the_global_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let one = elastic(
        &d,
        &tmp.path().join("one"),
        &["-n", "1", "--max", "1"],
        &["--epochs", "2"],
        &[],
    );
    one.check(1);
    let mixed = elastic(
        &d,
        &tmp.path().join("mixed"),
        &["-n", "2", "--max", "2"],
        &["--epochs", "2", "--balance", "throughput"],
        &[("HEARTH_ELASTIC_THROTTLE", "w1:60")],
    );
    mixed.check(2);
    assert!(
        mixed
            .log
            .contains("shares of the global batch by throughput"),
        "the slow worker got a smaller share:\n{}",
        mixed.log
    );
    assert_close(
        &last_checkpoint(&one.dir, 2),
        &last_checkpoint(&mixed.dir, 2),
        "uneven shares vs one process",
    );
}

#[test]
fn a_soak_of_fifty_joins_and_leaves_ends_with_identical_survivors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    // 25 joiners and 25 graceful leaves of the newest worker, alternating.
    let churn: Vec<String> = (0..25)
        .flat_map(|i| {
            let t = 1.0 + 1.2 * i as f64;
            [format!("t={t:.1}s:+1"), format!("t={:.1}s:-1", t + 0.6)]
        })
        .collect();
    // 50 ms of sleep per step on every worker: the ~740 steps of 60 epochs take at least 37 s
    // wherever this runs, so the job outlives the last event (30.4 s) and all 50 of them fire.
    let throttle: Vec<String> = (0..40).map(|i| format!("w{i}:50")).collect();
    let run = elastic(
        &d,
        &tmp.path().join("run"),
        &[
            "-n",
            "2",
            "--min",
            "1",
            "--max",
            "4",
            "--churn",
            &churn.join(","),
        ],
        &["--epochs", "60"],
        &[("HEARTH_ELASTIC_THROTTLE", &throttle.join(","))],
    );
    assert!(run.ok, "{}", run.log);
    let finals = run.finals();
    assert!(!finals.is_empty(), "{}", run.log);
    // Seen once in CI (2026-11-23): both survivors ended as worlds of 1 with different
    // weights (a split); the log's end says how they parted.
    let tail: Vec<&str> = run.log.lines().rev().take(80).collect();
    assert!(
        finals.iter().all(|f| f.1 == finals[0].1),
        "{finals:?}\nlast lines of the log:\n{}",
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    // Every one of the 50 events is accounted for: 25 joiners started and 25 stops sent; a
    // joiner stopped before it was admitted never trained, every admitted one left gracefully
    // or is a survivor at the end, and every admission and graceful leave changed the
    // membership (a join and a leave at the same step boundary share one change).
    let joiners: Vec<&str> = run
        .log
        .lines()
        .filter_map(|l| l.strip_prefix("hearth launch: starting joiner "))
        .collect();
    assert_eq!(
        joiners.len(),
        25,
        "only {} of 25 joiners were started before the job ended:\n{}",
        joiners.len(),
        run.log
    );
    let stopped = run
        .log
        .matches("hearth launch: stopping (SIGTERM) w")
        .count();
    assert_eq!(stopped, 25, "{}", run.log);
    let lists: Vec<&str> = run
        .log
        .lines()
        .filter(|l| l.contains("] membership epoch "))
        .filter_map(|l| l.rsplit_once('[').map(|(_, m)| m))
        .collect();
    let named = |j: &str, list: &str| {
        list.trim_end_matches(|c| c != ']')
            .trim_end_matches(']')
            .split(", ")
            .any(|m| m == j)
    };
    let admitted: Vec<&str> = joiners
        .iter()
        .copied()
        .filter(|j| lists.iter().any(|l| named(j, l)))
        .collect();
    let survivors: Vec<String> = finals.iter().map(|f| f.0.clone()).collect();
    let mut leaves = 0;
    for j in &joiners {
        let left = run.log.contains(&format!("{j} left the job after step"));
        let trained = admitted.contains(j);
        if trained {
            assert!(
                left || survivors.iter().any(|s| s == j),
                "{j} was admitted, and neither left nor finished:\n{}",
                run.log
            );
        } else {
            assert!(!left, "{j} left a job it never joined:\n{}", run.log);
        }
        leaves += usize::from(left);
    }
    // A joiner stopped while it waited can still have asked for the change that would have
    // admitted it (the members saw it waiting at a step's end, then it was gone when the next
    // world formed): at most one change per event, never more.
    let changes = lists.len() - 1;
    let unadmitted = joiners.len() - admitted.len();
    assert!(
        changes <= admitted.len() + leaves + unadmitted && changes >= 1,
        "{changes} membership changes for {} admissions, {leaves} leaves and {unadmitted} \
         joiners stopped before admission:\n{}",
        admitted.len(),
        run.log
    );
    assert!(
        !admitted.is_empty(),
        "no joiner was ever admitted:\n{}",
        run.log
    );
    eprintln!(
        "soak: {} of 25 joiners admitted, {leaves} left gracefully, {changes} membership changes",
        admitted.len()
    );
}

#[test]
fn multi_label_accumulation_and_fine_tuning_on_two_workers_equal_one() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let labels = common::multi_label_csv(&d);
    let recipe = [
        "--labels",
        labels.to_str().unwrap(),
        "--monitor",
        "val_auroc",
        "--grad-accum",
        "2",
        "--freeze-backbone",
        "--unfreeze-after",
        "1",
        "--finetune-lr",
        "0.005",
        "--epochs",
        "2",
    ];
    let one = elastic(
        &d,
        &tmp.path().join("one"),
        &["-n", "1", "--max", "1"],
        &recipe,
        &[],
    );
    one.check(1);
    let two = elastic(
        &d,
        &tmp.path().join("two"),
        &["-n", "2", "--max", "2"],
        &recipe,
        &[],
    );
    two.check(2);
    assert!(
        two.log.contains("unfreezing the backbone after epoch 1"),
        "{}",
        two.log
    );
    // Two global batches per optimizer step, each worker's share of each, the head alone in
    // epoch 1: the same weights as one worker.
    assert_close(
        &last_checkpoint(&one.dir, 2),
        &last_checkpoint(&two.dir, 2),
        "two workers vs one, accumulating and fine-tuning",
    );
    let csv = std::fs::read_to_string(two.dir.join("metrics.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<f64>> = csv
        .lines()
        .skip(1)
        .map(|l| {
            l.split(',')
                .map(|c| c.parse().unwrap_or(f64::NAN))
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), 2, "{csv}");
    // Epoch 2 runs at the fine-tuning rate; 5 optimizer steps an epoch (10 batches, K = 2).
    assert!(rows[1][col("train_lr")] <= 0.005 + 1e-9, "{csv}");
    let world = std::fs::read_to_string(two.dir.join("world.csv")).unwrap();
    assert_eq!(world.lines().count(), 1 + 10, "{world}");
    // The epochs' AUROC, gathered from both workers, is what rank 0 scores alone over the
    // whole validation set with the exported model.
    let best = rows
        .iter()
        .map(|r| r[col("val_auroc")])
        .fold(f64::MIN, f64::max);
    let mean = common::auroc_csv_mean(&two.dir);
    assert!(
        (mean - best).abs() < 1e-2,
        "auroc.csv {mean} vs {best}\n{csv}"
    );
    let saved =
        hearth::models::load_model(&two.dir.join("model.bpk"), &burn::prelude::Device::flex())
            .unwrap();
    assert_eq!(
        saved.model.head_activation(),
        hearth::models::HeadActivation::Sigmoid
    );
}

/// `--zero`: each worker holds its shard of the momentum and a replica of the next worker's.
/// A worker killed inside a step (its shard comes back from the replica), a joiner and a
/// graceful leave (the state re-sharded each time), and a run stopped on 3 workers and resumed
/// on 2 (the saved state re-sharded) all train as the fixed world without --zero on the same
/// batches; a lost momentum would be seen (it is a tenth of each update's size here).
#[test]
fn zero_across_a_kill_a_join_a_leave_and_a_resume_equals_the_fixed_world() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let slow = ("HEARTH_ELASTIC_THROTTLE", "w0:40,w1:40,w2:40,w3:40");
    let fixed = fixed_world(&d, &tmp.path().join("fixed"));
    let churned = elastic(
        &d,
        &tmp.path().join("churned"),
        &["-n", "3", "--min", "2", "--max", "4", "--churn", "t=0s:+1"],
        &["--epochs", "4", "--zero", "2"],
        &[
            slow,
            ("HEARTH_ELASTIC_DIE_AT_STEP", "w2:14"),
            ("HEARTH_ELASTIC_LEAVE_AT_STEP", "w1:28"),
        ],
    );
    churned.check(2);
    assert!(
        churned.log.contains("--zero 2: worker 0 updates") && churned.log.contains("replica"),
        "sharded with replicas:\n{}",
        churned.log
    );
    assert!(churned.log.contains("lost w2"), "{}", churned.log);
    let worlds = churned.worlds();
    assert!(
        worlds.contains(&3) && worlds.last() == Some(&2),
        "{worlds:?}"
    );
    assert_close(
        &last_checkpoint(&fixed.dir, 4),
        &last_checkpoint(&churned.dir, 4),
        "--zero 2 through a kill, a join and a leave vs the fixed world",
    );
    assert!(
        tmp.path()
            .join("churned/checkpoint/elastic-zero")
            .read_dir()
            .unwrap()
            .count()
            == 1,
        "one sharded state file kept"
    );

    // 3 workers for 2 epochs, then 2 for the rest.
    let stopped = elastic(
        &d,
        &tmp.path().join("stopped"),
        &["-n", "3", "--min", "1", "--max", "3"],
        &["--epochs", "4", "--zero", "1", "--stop-after-epoch", "2"],
        &[],
    );
    assert!(stopped.ok, "{}", stopped.log);
    let resumed = elastic_resume(
        &d,
        &tmp.path().join("stopped"),
        &["-n", "2", "--min", "1", "--max", "2"],
        &["--epochs", "4", "--zero", "1"],
    );
    resumed.check(2);
    assert!(
        resumed.log.contains("optimizer state of step 20"),
        "{}",
        resumed.log
    );
    assert_close(
        &last_checkpoint(&fixed.dir, 4),
        &last_checkpoint(&resumed.dir, 4),
        "--zero 1 stopped on 3 workers, resumed on 2, vs the fixed world",
    );
    // Without --zero, the sharded state is refused by name.
    let plain = elastic_in(
        &d,
        &tmp.path().join("stopped"),
        "--resume",
        &["-n", "2", "--min", "1", "--max", "2"],
        &["--epochs", "5", "--zero", "0"],
        &[],
    );
    assert!(
        !plain.ok && plain.log.contains("written with --zero"),
        "{}",
        plain.log
    );
}

/// Two neighbours killed in one step take a shard and its only replica with them: the
/// survivors stop with an error naming the lost state, and the last saved state stands.
#[test]
fn zero_with_two_neighbours_lost_together_stops_naming_the_lost_state() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let run = elastic(
        &d,
        &tmp.path().join("run"),
        &["-n", "4", "--min", "2", "--max", "4"],
        &["--epochs", "3", "--zero", "1"],
        &[
            ("HEARTH_ELASTIC_DIE_AT_STEP", "w1:14,w2:14"),
            ("HEARTH_ELASTIC_THROTTLE", "w0:20,w1:20,w2:20,w3:20"),
        ],
    );
    assert!(!run.ok, "{}", run.log);
    assert!(
        run.log
            .contains("the optimizer state of old rank(s) [2] of 4 is lost"),
        "{}",
        run.log
    );
    assert!(
        run.log
            .contains("--resume continues from the last state saved"),
        "{}",
        run.log
    );
    // Epoch 1's state (step 10) is what a resume starts from.
    assert!(
        run.dir
            .join("checkpoint/elastic-zero/optim-zero-10.safetensors")
            .is_file()
    );
}

/// `--zero` in fp16: worker w1's gradients overflow at step 5 (forced); the sharded step takes
/// the job's one verdict, every worker skips that step and halves the scale, and the run ends
/// as the one without `--zero`.
#[test]
fn zero_in_fp16_skips_an_overflowed_step_as_without_it() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let hook = [("HEARTH_FP16_OVERFLOW_AT_STEP", "w1:5")];
    let launch = ["-n", "3", "--min", "1", "--max", "3"];
    let mut runs = Vec::new();
    for (name, zero) in [("plain", "0"), ("zero", "2")] {
        let run = elastic(
            &d,
            &tmp.path().join(name),
            &launch,
            &["--epochs", "2", "--precision", "fp16", "--zero", zero],
            &hook,
        );
        run.check(3);
        let metrics = std::fs::read_to_string(run.dir.join("metrics.csv")).unwrap();
        let mut lines = metrics.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let col = header
            .iter()
            .position(|h| *h == "train_skipped_steps")
            .expect("fp16 counts skipped steps");
        let skipped: Vec<String> = lines
            .map(|l| l.split(',').nth(col).unwrap_or("").to_string())
            .collect();
        assert_eq!(
            skipped
                .iter()
                .map(|s| s.parse::<f64>().unwrap())
                .collect::<Vec<_>>(),
            vec![1.0, 0.0],
            "{name}: epoch 1 skips the overflowed step:\n{metrics}"
        );
        runs.push(run);
    }
    // The gradients are summed in another order (reduce-scatter against allreduce); in fp16
    // a last-bit difference of a weight can move an activation's rounding, so the bound is
    // fp16's (measured: 1.2e-5). A step skipped on one worker only would split the workers
    // (check) and a verdict not taken would count no skipped step.
    assert_within(
        &last_checkpoint(&runs[0].dir, 2),
        &last_checkpoint(&runs[1].dir, 2),
        "fp16 with --zero 2 vs without",
        1e-4,
    );
}

/// `--overlap` in an elastic job: the gradients are summed while the backward runs, unit by
/// unit, and the result is the unoverlapped run's (to 1e-6: the buckets are cut in another
/// order), in f32 and in fp16 with an overflowed step (one worker's gradients infinite: both
/// workers skip it, the handed-over gradients having left unscaled).
#[test]
fn overlap_equals_the_unoverlapped_elastic_run() {
    let tmp = tempfile::tempdir().unwrap();
    let d = common::elastic_data(tmp.path());
    let launch = ["-n", "2", "--min", "1", "--max", "2"];
    for precision in ["fp32", "fp16"] {
        let hook = [("HEARTH_FP16_OVERFLOW_AT_STEP", "w1:5")];
        let env: &[(&str, &str)] = if precision == "fp16" { &hook } else { &[] };
        let train = |overlap: bool, name: &str| {
            let mut args = vec!["--epochs", "2", "--precision", precision];
            if overlap {
                args.push("--overlap");
            }
            let run = elastic(&d, &tmp.path().join(name), &launch, &args, env);
            run.check(2);
            run
        };
        let plain = train(false, &format!("{precision}-plain"));
        let overlapped = train(true, &format!("{precision}-overlapped"));
        // Every worker's first step says what went during its backward: every tensor (the
        // model is its units and nothing else).
        let said: Vec<&str> = overlapped
            .log
            .lines()
            .filter(|l| l.contains("were exchanged during the backward pass"))
            .collect();
        assert_eq!(said.len(), 2, "{}", overlapped.log);
        // Both workers share this host (shared memory): each says the overlap is not expected
        // to pay here, as data parallel does; the run without --overlap says nothing of it.
        let one_host = |log: &str| {
            log.lines()
                .filter(|l| l.contains("--overlap: every rank is on this host"))
                .count()
        };
        assert_eq!(one_host(&overlapped.log), 2, "{}", overlapped.log);
        assert_eq!(one_host(&plain.log), 0, "{}", plain.log);
        for line in said {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "--overlap:").unwrap();
            let (handed, all) = (words[at + 1], words[at + 5]);
            assert!(handed == all && handed != "0", "{line}");
        }
        // Rank 0 reports the exchange's share of each epoch's steps, as data parallel does
        // (with --overlap, only the wait after the backward).
        for (run, overlap) in [(&plain, false), (&overlapped, true)] {
            let reports: Vec<&str> = run
                .log
                .lines()
                .filter(|l| l.contains("gradient exchange") && l.contains("s in training steps"))
                .collect();
            assert_eq!(reports.len(), 2, "one per epoch:\n{}", run.log);
            for (e, line) in reports.iter().enumerate() {
                assert!(line.contains(&format!("epoch {}: ", e + 1)), "{line}");
                assert!(line.contains("rank 0)"), "{line}");
                assert_eq!(
                    line.contains("(overlapped with the backward) waited"),
                    overlap,
                    "{line}"
                );
            }
        }
        if precision == "fp16" {
            for run in [&plain, &overlapped] {
                let metrics = std::fs::read_to_string(run.dir.join("metrics.csv")).unwrap();
                let header: Vec<&str> = metrics.lines().next().unwrap().split(',').collect();
                let col = header
                    .iter()
                    .position(|h| *h == "train_skipped_steps")
                    .expect("fp16 counts skipped steps");
                let skipped: Vec<f64> = metrics
                    .lines()
                    .skip(1)
                    .map(|l| l.split(',').nth(col).unwrap_or("").parse().unwrap())
                    .collect();
                assert_eq!(skipped, [1.0, 0.0], "epoch 1 skips a step:\n{metrics}");
            }
        }
        assert_within(
            &last_checkpoint(&plain.dir, 2),
            &last_checkpoint(&overlapped.dir, 2),
            &format!("{precision}: overlapped vs unoverlapped"),
            1e-6,
        );
    }
}

/// `--overlap` through membership changes: a worker killed (its peers' next exchange, under
/// way during their backward, fails and the world re-forms), a joiner and a graceful leave.
#[test]
fn overlap_survives_a_kill_a_join_and_a_leave() {
    kill_join_leave(5, 8, 35, &["--overlap"]);
}

/// `--overlap` with a worker killed in the step another leaves gracefully after: the gradient
/// exchange ends before the step's control allreduce, so no collective of that step sees the
/// loss, and the planned change (w1's leave) must find it before its rendezvous rather than
/// wait there for the dead worker (it did, until the rendezvous timed out and the job ended).
#[test]
fn overlap_a_kill_in_the_step_of_a_leave_is_found_before_the_change() {
    let run = kill_join_leave(4, 20, 20, &["--overlap"]);
    assert!(
        run.log
            .contains("lost w2 (no answer before the planned change after step 20)"),
        "the survivors found the loss before the change:\n{}",
        run.log
    );
    assert!(!run.log.contains("never arrived"), "{}", run.log);
}
