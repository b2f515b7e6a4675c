use super::*;

#[test]
fn schedules_run_every_micro_batch_once_and_1f1b_holds_at_most_p_minus_s() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for (stages, m) in [(1, 1), (2, 4), (3, 2), (4, 8), (3, 1)] {
            for s in 0..stages {
                let ops = schedule.order(s, stages, m);
                let mut f: Vec<usize> = ops.iter().filter(|o| o.0).map(|o| o.1).collect();
                let mut b: Vec<usize> = ops.iter().filter(|o| !o.0).map(|o| o.1).collect();
                f.sort();
                b.sort();
                assert_eq!(f, (0..m).collect::<Vec<_>>());
                assert_eq!(b, (0..m).collect::<Vec<_>>());
                // No backward before its forward; count what is held at once.
                let (mut held, mut peak) = (0i64, 0i64);
                for (fwd, i) in &ops {
                    if *fwd {
                        held += 1;
                    } else {
                        assert!(
                            ops.iter().position(|o| *o == (true, *i))
                                < ops.iter().position(|o| *o == (false, *i))
                        );
                        held -= 1;
                    }
                    peak = peak.max(held);
                }
                let bound = if schedule == Schedule::GPipe {
                    m
                } else {
                    (stages - s).min(m)
                };
                assert_eq!(
                    peak as usize, bound,
                    "{schedule:?} stage {s} of {stages}, m {m}"
                );
            }
        }
    }
}

#[test]
fn messages_round_trip_and_garbage_is_an_error() {
    let data = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]);
    let back = decode(&encode(data.clone()).unwrap()).unwrap();
    assert_eq!(back, data);
    let four = TensorData::new(vec![0.5f32; 24], [1, 2, 3, 4]);
    assert_eq!(decode(&encode(four.clone()).unwrap()).unwrap(), four);
    let good = encode(data).unwrap();
    for bad in [
        &good[..2],
        &good[..10],
        &good[..good.len() - 1],
        &[3u8, 0, 0, 0][..],
    ] {
        assert!(decode(bad).is_err());
    }
    let mut huge = 2u32.to_le_bytes().to_vec();
    huge.extend(u64::MAX.to_le_bytes());
    huge.extend(2u64.to_le_bytes());
    assert!(decode(&huge).is_err());
}
