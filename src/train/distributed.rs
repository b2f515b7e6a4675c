//! Distributed setup of a run: joining the job, and every rank reading the same data.

use std::sync::Arc;

use hearth_datasets::ImageSet;

use super::{TrainConfig, sets};
use crate::{HearthError, Result};

/// Joins the distributed job (QUIC, TLS from the job secret or CA in the environment).
pub fn connect(
    info: &burn_dist::rendezvous::RankInfo,
    log: &mut dyn FnMut(&str),
) -> Result<burn_dist::Communicator> {
    let membership = burn_dist::tls::Membership::from_env()?;
    if info.rank == 0 {
        log(&format!(
            "distributed: {} ranks ({}), coordinator {}",
            info.world, info.source, info.coordinator
        ));
    }
    let transport = burn_dist::rendezvous::connect(
        info,
        &membership,
        &burn_dist::rendezvous::RendezvousOptions::from_env(),
    )?;
    Ok(burn_dist::Communicator::from_env(Arc::new(transport)))
}

/// Every rank reads the data set itself: scanning a large folder takes as long as it takes and
/// is bounded by no collective timeout. Only the generated synthetic set is written by rank 0
/// while the others wait in a barrier (a few seconds of work; the barrier's bound is the
/// collective timeout, `HEARTH_COLLECTIVE_TIMEOUT`). Afterwards the ranks compare what they
/// read, so a rank that sees another folder fails the job instead of training on other data.
pub fn load_data(
    cfg: &TrainConfig,
    comm: &burn_dist::Communicator,
    log: &mut dyn FnMut(&str),
) -> Result<(ImageSet, ImageSet)> {
    let generated = cfg.data.folder.is_none() && cfg.data.labels.is_none();
    let sets = if generated {
        if comm.rank() == 0 {
            let sets = sets::load(cfg, log);
            comm.barrier()?;
            sets?
        } else {
            comm.barrier()?;
            sets::load(cfg, &mut |_| {})?
        }
    } else {
        sets::load(cfg, log)?
    };
    agree(comm, &sets.0, &sets.1)?;
    Ok(sets)
}

/// A fingerprint of a split: sample count, class count, and a stable hash of the paths,
/// targets and class names.
fn fingerprint(set: &ImageSet) -> [f32; 3] {
    let mut h = hearth_datasets::rng::Fnv64::new();
    for c in &set.classes {
        h.write(c.as_bytes());
    }
    for s in &set.samples {
        h.write(s.path.to_string_lossy().as_bytes());
        h.write(format!("{:?}", s.target).as_bytes());
    }
    // 24 bits of the hash survive the f32 exchange exactly.
    [
        set.len() as f32,
        set.classes.len() as f32,
        (h.finish() & 0xFF_FFFF) as f32,
    ]
}

fn agree(comm: &burn_dist::Communicator, train: &ImageSet, val: &ImageSet) -> Result<()> {
    let mut local = fingerprint(train).to_vec();
    local.extend(fingerprint(val));
    let all = comm.all_gather(&local)?;
    for (r, theirs) in all.chunks(local.len()).enumerate() {
        if theirs != local.as_slice() {
            return Err(HearthError::InvalidArgument(format!(
                "rank {r} read other data than rank {}: {} training / {} validation images \
                 and {} classes there, {} / {} and {} here (every rank needs the same files at \
                 the same paths)",
                comm.rank(),
                theirs[0],
                theirs[3],
                theirs[1],
                local[0],
                local[3],
                local[1]
            )));
        }
    }
    Ok(())
}

/// Every rank checks, before the first step, that all were started with the same `settings`
/// (name, value): each rank sends a 24-bit hash of each, and a difference is an error on every
/// rank naming the setting, the ranks that differ and this rank's value (so the logs of the
/// ranks together show both values).
pub fn agree_settings(comm: &burn_dist::Communicator, settings: &[(&str, String)]) -> Result<()> {
    let hash = |name: &str, value: &str| {
        let mut h = hearth_datasets::rng::Fnv64::new();
        h.write(name.as_bytes());
        h.write(&[0]);
        h.write(value.as_bytes());
        // 24 bits survive the f32 exchange exactly.
        (h.finish() & 0xFF_FFFF) as f32
    };
    let mut local = vec![settings.len() as f32];
    local.extend(settings.iter().map(|(k, v)| hash(k, v)));
    let all = comm.all_gather(&local)?;
    let me = comm.rank();
    let mut differences = Vec::new();
    for (i, (name, value)) in settings.iter().enumerate() {
        let others: Vec<usize> = all
            .chunks(local.len())
            .enumerate()
            .filter(|(_, theirs)| theirs[0] != local[0] || theirs[i + 1] != local[i + 1])
            .map(|(r, _)| r)
            .collect();
        if !others.is_empty() {
            differences.push(format!(
                "{name} (rank {me} has {value:?}; rank(s) {others:?} another)"
            ));
        }
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(HearthError::InvalidArgument(format!(
        "the ranks were started with different settings: {}; every rank of a job must run \
         the same model, split and flags",
        differences.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_dist::transport::memory::MemoryTransport;
    use hearth_datasets::{Problems, Sample, Target};

    fn set(n: usize) -> ImageSet {
        ImageSet {
            root: "/data".into(),
            classes: vec!["a".into(), "b".into()],
            samples: (0..n)
                .map(|i| Sample {
                    path: format!("/data/{i}.png").into(),
                    target: Target::Class(i % 2),
                })
                .collect(),
            problems: Problems::default(),
            multi_label: false,
        }
    }

    /// What each rank's `agree` says when rank r read `sizes[r]` training images.
    fn outcomes(sizes: &[usize]) -> Vec<std::result::Result<(), String>> {
        let handles: Vec<_> = MemoryTransport::mesh(sizes.len())
            .into_iter()
            .zip(sizes.to_vec())
            .map(|(t, n)| {
                std::thread::spawn(move || {
                    let comm = burn_dist::Communicator::from_env(Arc::new(t))
                        .with_timeout(std::time::Duration::from_secs(20));
                    agree(&comm, &set(n), &set(4)).map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ranks_started_with_other_settings_fail_naming_the_setting_and_the_ranks() {
        let run = |values: &[&'static str]| -> Vec<std::result::Result<(), String>> {
            let handles: Vec<_> = MemoryTransport::mesh(values.len())
                .into_iter()
                .zip(values.to_vec())
                .map(|(t, v)| {
                    std::thread::spawn(move || {
                        let comm = burn_dist::Communicator::from_env(Arc::new(t))
                            .with_timeout(std::time::Duration::from_secs(20));
                        let settings = [("model", "resnet18".to_string()), ("split", v.into())];
                        agree_settings(&comm, &settings).map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        };
        assert!(run(&["0:3,3:6"; 3]).iter().all(|o| o.is_ok()));
        let out = run(&["0:3,3:6", "0:3,3:6", "0:2,2:6"]);
        let e = out[0].as_ref().unwrap_err();
        assert!(
            e.contains("split (rank 0 has \"0:3,3:6\"; rank(s) [2] another)")
                && !e.contains("model ("),
            "{e}"
        );
        let e = out[2].as_ref().unwrap_err();
        assert!(
            e.contains("rank 2 has \"0:2,2:6\"; rank(s) [0, 1] another"),
            "{e}"
        );
    }

    #[test]
    fn ranks_that_read_other_data_fail_naming_the_difference() {
        assert!(outcomes(&[10, 10, 10]).iter().all(|o| o.is_ok()));
        let out = outcomes(&[10, 9]);
        let e = out[0].as_ref().unwrap_err();
        assert!(
            e.contains("rank 1 read other data") && e.contains("9 training"),
            "{e}"
        );
        assert!(out[1].is_err());
    }
}
