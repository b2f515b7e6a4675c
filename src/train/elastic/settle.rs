//! Settling a membership change: whether the announced world formed on every survivor, agreed
//! over the old world's links, which outlive the new world's rendezvous.
//!
//! A member can die after the announcement and before the new world is whole (in the
//! rendezvous, or before rank 0's state reached it). Then the rendezvous fails on everyone
//! after its timeout, or the state's broadcast fails on some members and not on others. So
//! every survivor of the old world reports to the announcer (the lowest survivor) whether the
//! new world formed for it, and the announcer answers every reporter with one verdict:
//! formed (everyone goes on in the new world), or again without the members that did not
//! report (everyone drops the new world, if it has one, and forms the next epoch number). A
//! member that gets no verdict counts the announcer lost and forms the next epoch number with
//! the next survivor as announcer, which is what the others do when the announcer dies.
//!
//! Not settled: a joiner for which the epoch formed while it failed for another member has no
//! old link to be told on. Not tested: it should end with an error when that world's first step
//! fails (its peers have dropped it), and can be started again. A joiner for which the epoch
//! did not form asks to join again (`join_world`).

use super::*;

/// How many membership epochs one change tries to form before it gives up.
pub(super) const FORMING_ATTEMPTS: u32 = 4;

/// A survivor's report: the announced world formed for it.
const FORMED: u8 = 1;
/// A survivor's report: it did not.
const FAILED: u8 = 0;

/// What the survivors agreed on.
pub(super) enum Settled<M: Net> {
    /// The announced world formed on every survivor: this worker's world and commit.
    Formed(Box<(World, Commit<M>)>),
    /// It did not: form the next epoch number without these old ranks (lost meanwhile).
    Again(Vec<usize>),
}

/// Tags of the reports and of the verdict on membership epoch `epoch`, on the old world.
fn report_tag(epoch: u32) -> u64 {
    0xE1A7_0000_0000_0000 | u64::from(epoch)
}

fn verdict_tag(epoch: u32) -> u64 {
    0xE1A8_0000_0000_0000 | u64::from(epoch)
}

/// The verdict "again without `lost`" as bytes: [`FAILED`], then each old rank as a u64.
fn encode_again(lost: &[usize]) -> Vec<u8> {
    let mut v = vec![FAILED];
    for &r in lost {
        v.extend_from_slice(&(r as u64).to_le_bytes());
    }
    v
}

/// A verdict's lost ranks (`None`: formed); garbage is an error naming it.
fn decode_verdict(bytes: &[u8], world: usize) -> Result<Option<Vec<usize>>> {
    match bytes.split_first() {
        Some((&FORMED, [])) => Ok(None),
        Some((&FAILED, rest)) if rest.len() % 8 == 0 => rest
            .chunks_exact(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w.copy_from_slice(c);
                let r = u64::from_le_bytes(w) as usize;
                (r < world).then_some(r).ok_or_else(|| {
                    HearthError::Training(format!(
                        "a membership verdict names rank {r} of a world of {world}"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        _ => Err(HearthError::Training(format!(
            "a membership verdict of {} bytes is malformed",
            bytes.len()
        ))),
    }
}

impl<T: Trainee> ElasticRun<'_, T> {
    /// Settles `announcement` (made by old rank `lowest`) given how forming it went here
    /// (`formed`), over `world`'s links (see the module docs).
    pub(super) fn settle(
        &self,
        world: &World,
        lowest: usize,
        announcement: &Announcement,
        formed: Result<(World, Commit<T::Model>)>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Settled<T::Model>> {
        let t = world.transport.as_ref();
        t.accept_losses();
        let next = announcement.epoch;
        if let Err(e) = &formed {
            log(&format!(
                "{}: forming membership epoch {next} failed here: {e}",
                self.me.id
            ));
        }
        // A member reports once its rendezvous and the state's broadcast ended, either way.
        let wait =
            RendezvousOptions::from_env().timeout + collective_timeout() + Duration::from_secs(30);
        let me = world.rank();
        if me != lowest {
            let report = vec![if formed.is_ok() { FORMED } else { FAILED }];
            let _ = t.send(lowest, Kind::Control, report_tag(next), report);
            let verdict = t.recv(
                lowest,
                Kind::Control,
                verdict_tag(next),
                Instant::now() + wait * 2,
            );
            return match verdict {
                Ok(bytes) => match (decode_verdict(&bytes, world.size())?, formed) {
                    (None, Ok(formed)) => Ok(Settled::Formed(Box::new(formed))),
                    (None, Err(e)) => Err(HearthError::Training(format!(
                        "membership epoch {next} formed on every member but this one, which \
                         reported that it did not: {e}"
                    ))),
                    (Some(lost), formed) => {
                        drop_world(formed);
                        Ok(Settled::Again(lost))
                    }
                },
                Err(e) => {
                    log(&format!(
                        "{}: no word from {} on membership epoch {next}: {e}",
                        self.me.id, world.members[lowest].id
                    ));
                    drop_world(formed);
                    Ok(Settled::Again(vec![lowest]))
                }
            };
        }
        let others: Vec<usize> = announcement
            .members
            .iter()
            .flatten()
            .copied()
            .filter(|&r| r != me)
            .collect();
        let deadline = Instant::now() + wait;
        let mut everyone = formed.is_ok();
        let mut lost = Vec::new();
        for &r in &others {
            match t
                .recv(r, Kind::Control, report_tag(next), deadline)
                .as_deref()
            {
                Ok([FORMED]) => {}
                Ok(_) => everyone = false,
                Err(_) => {
                    everyone = false;
                    lost.push(r);
                }
            }
        }
        let verdict = if everyone {
            vec![FORMED]
        } else {
            encode_again(&lost)
        };
        for &r in others.iter().filter(|r| !lost.contains(r)) {
            // A reporter lost after its report is found in the next world's first step.
            let _ = t.send(r, Kind::Control, verdict_tag(next), verdict.clone());
        }
        match formed {
            Ok(formed) if everyone => Ok(Settled::Formed(Box::new(formed))),
            formed => {
                drop_world(formed);
                Ok(Settled::Again(lost))
            }
        }
    }
}

/// A world formed for nothing: its links closed at once.
fn drop_world<M: Net>(formed: Result<(World, Commit<M>)>) {
    if let Ok((w, _)) = formed {
        w.transport.shutdown(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_round_trip_and_garbage_is_an_error() {
        assert_eq!(decode_verdict(&[FORMED], 3).unwrap(), None);
        assert_eq!(
            decode_verdict(&encode_again(&[2, 0]), 3).unwrap(),
            Some(vec![2, 0])
        );
        assert_eq!(decode_verdict(&encode_again(&[]), 3).unwrap(), Some(vec![]));
        assert!(
            decode_verdict(&encode_again(&[3]), 3).is_err(),
            "outside the world"
        );
        assert!(decode_verdict(&[], 3).is_err());
        assert!(decode_verdict(&[FORMED, 0], 3).is_err());
        assert!(decode_verdict(&[FAILED, 1, 2], 3).is_err(), "a cut rank");
        assert!(decode_verdict(&[7], 3).is_err());
    }
}
