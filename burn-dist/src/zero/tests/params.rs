//! Stage 3: the parameters held as each rank's segments, updated in place and gathered by units.

use super::*;

#[test]
fn a_stage_3_state_resumes_on_another_world_and_equals_stage_2_s() {
    for update in [Update::adam(), updates()[4]] {
        let (v3, saved3) = run(update, Stage::Three, 3, 2, None, None);
        let (v2, saved2) = run(update, Stage::Two, 3, 2, None, None);
        close(
            &v3[0],
            &v2[0],
            &format!("{update:?}: stage 3 after 2 steps"),
        );
        let flat =
            |s: &WholeState| -> Vec<f32> { s.slots.iter().flat_map(|s| s.1.clone()).collect() };
        close(
            &flat(&saved3),
            &flat(&saved2),
            &format!("{update:?}: the state"),
        );
        // Resumed on 2 ranks from either state: stage 3 as stage 1 does.
        let (on_two, after) = run(update, Stage::Three, 2, 2, Some(saved3), None);
        let (want, _) = run(update, Stage::One, 2, 2, Some(saved2), None);
        for v in &on_two {
            close(v, &want[0], &format!("{update:?}: stage 3 resumed on 2"));
        }
        assert_eq!(after.updates, 4);
    }
}

#[test]
fn a_stage_3_step_not_finite_on_one_rank_is_skipped_on_every_rank() {
    let (got, state) = run(Update::adam(), Stage::Three, 3, 3, None, Some(1));
    assert_eq!(state.updates, 2, "the skipped step is not counted");
    for v in &got[1..] {
        assert_eq!(v, &got[0]);
    }
    assert!(got[0].iter().all(|x| x.is_finite()));
}

#[test]
fn units_cut_the_buckets_and_a_unit_gathers_its_own_alone() {
    let handles: Vec<_> = MemoryTransport::mesh(2)
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let comm = rank_comm(t);
                let o = optimizer(Update::adam());
                // Buckets of 10 values: [a.weight, a.bias], [b.weight], [b.bias] ...
                let z = ZeroOptimizer::new(Stage::Three, &tensors(), o.clone(), &comm, 40).unwrap();
                assert_eq!(z.buckets_of(0..2).unwrap(), 0..1);
                assert_eq!(z.buckets_of(2..4).unwrap(), 1..3);
                let e = z.buckets_of(1..4).unwrap_err().to_string();
                assert!(e.contains("1..4") && e.contains("whole buckets"), "{e}");
                // ... and cut at units of 1 and 3 tensors: [a.weight], [a.bias], ...
                let mut z = z.cut_at_units(&[1, 3]).unwrap();
                assert_eq!(z.buckets_of(1..4).unwrap(), 1..4);
                // Nothing held yet: gathering is an error, not zeros.
                let e = z
                    .gather_params(&comm, 0..1, &mut |_, _| Ok(()))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("holds none"), "{e}");
                let values = start_values();
                hold(&mut z, &values);
                // Each rank holds half of the 23 values, give or take half a value for each of
                // the 4 buckets (rank 1's segments are the longer ones: 4 + 1 + 6 + 2).
                let want = if comm.rank() == 0 { 10 } else { 13 };
                assert_eq!(z.params_len(), want);
                let mut got = Vec::new();
                z.gather_params(&comm, 1..4, &mut |tensors, parts| {
                    got.push((tensors, parts));
                    Ok(())
                })
                .unwrap();
                assert_eq!(got.len(), 3, "the unit's three buckets, one at a time");
                let flat: Vec<f32> = got.into_iter().flat_map(|(_, p)| p.concat()).collect();
                assert_eq!(flat, values[7..].to_vec());
                // Units that do not add up to the tensors, and a cut after a state exists.
                let fresh = ZeroOptimizer::new(Stage::Three, &tensors(), o.clone(), &comm, 40);
                let e = fresh
                    .unwrap()
                    .cut_at_units(&[1, 2])
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.contains("3 trainable tensors") && e.contains("of 4"),
                    "{e}"
                );
                let e = z.cut_at_units(&[2, 2]).unwrap_err().to_string();
                assert!(e.contains("before the optimizer holds"), "{e}");
                // Stage 2 keeps the whole parameters: holding a shard of them is refused.
                let mut two = ZeroOptimizer::new(Stage::Two, &tensors(), o, &comm, 40).unwrap();
                let mut source = FlatSource {
                    grad: &[],
                    values: &values,
                    offsets: vec![0, 7, 9, 20, 23],
                };
                let e = two.hold_params(&mut source).unwrap_err().to_string();
                assert!(e.contains("only stage 3"), "{e}");
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Stage 3 from the root's values: each rank's source holds other values, and every rank ends
/// up holding its segments of rank 0's, as a broadcast of rank 0's model and `hold_params`
/// would give; a root whose source is short fails every rank alike, naming it.
#[test]
fn stage_3_holds_its_segments_of_the_roots_values() {
    let handles: Vec<_> = MemoryTransport::mesh(3)
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let comm = rank_comm(t);
                let o = optimizer(Update::adam());
                let root_values = start_values();
                let mine: Vec<f32> = root_values.iter().map(|v| v + comm.rank() as f32).collect();
                let offsets = vec![0, 7, 9, 20, 23];
                let mut z = ZeroOptimizer::new(Stage::Three, &tensors(), o.clone(), &comm, 40)
                    .unwrap()
                    .cut_at_units(&[1, 3])
                    .unwrap();
                let mut source = FlatSource {
                    grad: &[],
                    values: &mine,
                    offsets: offsets.clone(),
                };
                z.hold_params_from(&comm, 0, &mut source).unwrap();
                assert_eq!(gather_all(&z, &comm), root_values, "rank {}", comm.rank());
                // The same from the root's own values with `hold_params`.
                let mut plain = ZeroOptimizer::new(Stage::Three, &tensors(), o.clone(), &comm, 40)
                    .unwrap()
                    .cut_at_units(&[1, 3])
                    .unwrap();
                hold(&mut plain, &root_values);
                assert_eq!(plain.params_len(), z.params_len());

                // The root's source is three values short: every rank fails, naming rank 0.
                let short = &mine[..20];
                let values = if comm.rank() == 0 { short } else { &mine[..] };
                let mut source = FlatSource {
                    grad: &[],
                    values,
                    offsets,
                };
                let mut z = ZeroOptimizer::new(Stage::Three, &tensors(), o, &comm, 40).unwrap();
                let e = z.hold_params_from(&comm, 0, &mut source).unwrap_err();
                let e = e.to_string();
                assert!(
                    e.contains("rank 0's parameters are not the 23 values"),
                    "{e}"
                );
                assert!(!z.holds_params());
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// What the root's source was asked, in order: values of a range, or tensors released.
#[derive(Debug, Clone, PartialEq)]
enum Asked {
    Values(std::ops::Range<usize>),
    Release(std::ops::Range<usize>),
}

/// A [`FlatSource`] that records what it is asked and knows its length.
struct Recording<'a> {
    flat: FlatSource<'a>,
    asked: Vec<Asked>,
}

impl StepSource for Recording<'_> {
    fn grads(&mut self, tensors: std::ops::Range<usize>) -> Vec<f32> {
        self.flat.grads(tensors)
    }
    fn values(&mut self, range: std::ops::Range<usize>) -> Vec<f32> {
        self.asked.push(Asked::Values(range.clone()));
        self.flat.values(range)
    }
    fn release(&mut self, tensors: std::ops::Range<usize>) {
        self.asked.push(Asked::Release(tensors));
    }
    fn value_count(&mut self) -> Option<usize> {
        self.flat.value_count()
    }
}

/// The root reads its source in the vector's order, once, and releases each tensor as soon as
/// its last bucket is out (a tensor cut into pieces of rows after its last piece), so that a
/// source whose values are made as they are first read (Burn's lazy parameters) makes them in
/// the model's order and holds one tensor of them at a time; the other ranks' sources are
/// asked nothing.
#[test]
fn stage_3_from_the_root_reads_it_in_order_and_releases_each_tensor_after_its_last_bucket() {
    let handles: Vec<_> = MemoryTransport::mesh(2)
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let comm = rank_comm(t);
                let values = start_values();
                // b.weight (11 values) in pieces of 2 rows of 1 value... and of 10 and 1.
                let mut z = ZeroOptimizer::new(
                    Stage::Three,
                    &tensors(),
                    optimizer(Update::adam()),
                    &comm,
                    40,
                )
                .unwrap()
                .cut_at_units(&[1, 3])
                .unwrap()
                .cut_rows(&[(2, 1)])
                .unwrap();
                let mut source = Recording {
                    flat: FlatSource {
                        grad: &[],
                        values: &values,
                        offsets: vec![0, 7, 9, 20, 23],
                    },
                    asked: Vec::new(),
                };
                z.hold_params_from(&comm, 0, &mut source).unwrap();
                assert_eq!(gather_all(&z, &comm), values);
                (comm.rank(), source.asked)
            })
        })
        .collect();
    for h in handles {
        let (rank, asked) = h.join().unwrap();
        if rank != 0 {
            assert!(asked.is_empty(), "rank {rank} was asked {asked:?}");
            continue;
        }
        use Asked::{Release, Values};
        assert_eq!(
            asked,
            [
                Values(0..7),
                Release(0..1),
                Values(7..9),
                Release(1..2),
                Values(9..19),
                Release(2..2),
                Values(19..20),
                Release(2..3),
                Values(20..23),
                Release(3..4),
            ]
        );
    }
}

/// A tensor cut into pieces of rows (b.weight, 11 values in rows of 2 and then of 1: pieces
/// of 10 and 1 values; rows of 3 do not divide it) steps, saves and resumes as the uncut one.
#[test]
fn a_tensor_cut_into_pieces_of_rows_steps_as_a_whole_one() {
    for update in [Update::adam(), updates()[4]] {
        let (cut, saved_cut) = run_cut(update, Stage::Three, 3, 2, None, None, &[(2, 1)]);
        let (whole, saved) = run(update, Stage::Three, 3, 2, None, None);
        for v in &cut {
            close(
                v,
                &whole[0],
                &format!("{update:?}: cut into pieces, after 2 steps"),
            );
        }
        assert_eq!(
            saved_cut.tensors, saved.tensors,
            "the state's layout is the same"
        );
        let flat =
            |s: &WholeState| -> Vec<f32> { s.slots.iter().flat_map(|s| s.1.clone()).collect() };
        close(
            &flat(&saved_cut),
            &flat(&saved),
            &format!("{update:?}: the state"),
        );
        // Resumed on 2 ranks, cut, from the uncut state.
        let (on_two, _) = run_cut(update, Stage::Three, 2, 1, Some(saved), None, &[(2, 1)]);
        let (want, _) = run(update, Stage::Three, 2, 1, Some(saved_cut), None);
        for v in &on_two {
            close(v, &want[0], &format!("{update:?}: resumed on 2"));
        }
    }
}

#[test]
fn pieces_are_gathered_one_at_a_time_and_refused_where_they_do_not_fit() {
    let handles: Vec<_> = MemoryTransport::mesh(2)
        .into_iter()
        .map(|t| {
            thread::spawn(move || {
                let comm = rank_comm(t);
                let o = optimizer(Update::adam());
                let z = ZeroOptimizer::new(Stage::Two, &tensors(), o.clone(), &comm, 40).unwrap();
                let e = z.cut_rows(&[(2, 1)]).unwrap_err().to_string();
                assert!(e.contains("stage 3"), "{e}");
                let z = ZeroOptimizer::new(Stage::Three, &tensors(), o, &comm, 16).unwrap();
                for (rows, what) in [(vec![(2, 3)], "rows of 3"), (vec![(4, 1)], "tensor 4")] {
                    let e = z.clone().cut_rows(&rows).unwrap_err().to_string();
                    assert!(e.contains(what), "{e}");
                }
                // Buckets of 4 values; b.weight (11) in rows of 1: pieces of 4, 4 and 3; a.weight
                // (7) not cut: a bucket of its own, larger than 4.
                let mut z = z
                    .cut_at_units(&[2, 2])
                    .unwrap()
                    .cut_rows(&[(2, 1)])
                    .unwrap();
                assert_eq!(z.pieces_of(2), Some(vec![0..4, 4..8, 8..11]));
                assert_eq!(z.pieces_of(0), None);
                assert_eq!(z.buckets_of(2..4).unwrap(), 2..6, "three pieces and b.bias");
                let values = start_values();
                hold(&mut z, &values);
                for (k, piece) in [0..4, 4..8, 8..11].into_iter().enumerate() {
                    let got = z.gather_piece(&comm, 2, k).unwrap();
                    assert_eq!(got, values[9 + piece.start..9 + piece.end].to_vec());
                }
                let e = z.gather_piece(&comm, 2, 3).unwrap_err().to_string();
                assert!(e.contains("has 3 pieces"), "{e}");
                let e = z.gather_params_bucket(&comm, 2).unwrap_err().to_string();
                assert!(
                    e.contains("b.weight") && e.contains("a piece at a time"),
                    "{e}"
                );
                // Gathered by units, the pieces come together as one tensor.
                let mut got = Vec::new();
                z.gather_params(&comm, 2..4, &mut |tensors, parts| {
                    got.push((tensors, parts));
                    Ok(())
                })
                .unwrap();
                assert_eq!(got.len(), 2);
                assert_eq!(got[0].0, 2..3);
                assert_eq!(got[0].1, vec![values[9..20].to_vec()]);
                assert_eq!(got[1].1, vec![values[20..23].to_vec()]);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}
