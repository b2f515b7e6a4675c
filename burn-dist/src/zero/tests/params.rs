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
