//! The table of what each accepted flag must show when it runs in a mode ([`Effect`]), apart
//! from the walk that runs them and the checks of each effect.

use super::*;

/// What running a flag must show.
#[derive(Debug)]
pub(super) enum Effect {
    /// The model differs from the run with `reference` (empty: the baseline).
    Changes {
        reference: Vec<String>,
        with: Vec<String>,
    },
    /// The model equals the baseline's within `tolerance` (relative), and `mechanism`
    /// (`FILE::TEST`) exists in a file that uses `uses`: what it changes is tested there.
    Same {
        with: Vec<String>,
        tolerance: f32,
        mechanism: &'static str,
        uses: &'static str,
    },
    /// A pipeline cut where the flag says: `pipeline_split.txt` holds `split`, and the model
    /// is the baseline's within `tolerance`.
    Splits {
        with: Vec<String>,
        split: &'static str,
        tolerance: f32,
    },
    /// Early stopping by validation accuracy: the run ends where the patience rule says on
    /// its own rows, which is before the last epoch in this setting.
    Stops {
        with: Vec<String>,
        patience: usize,
        min_delta: f64,
        epochs: usize,
    },
    /// The exported epoch is the best of `column` (a loss: lower is better), restored by it.
    Monitors {
        with: Vec<String>,
        column: &'static str,
    },
    /// `metrics.csv` has `rows` epochs.
    Rows { with: Vec<String>, rows: usize },
    /// A weight average beside the model: the model as `reference` trained it (the average
    /// only watches), `model_ema.bpk` other than `model.bpk` and than `reference`'s average
    /// where it has one, and `val_ema_accuracy` in every row.
    Averages {
        reference: Vec<String>,
        with: Vec<String>,
    },
    /// The summary prices the job's process-seconds (all ranks, not rank 0's clock).
    Priced,
    /// A second run into a used run directory is refused without the flag and replaces the
    /// first with it.
    Overwrites,
    /// Stopped after epoch 1 and resumed (`--resume RUN` alone), the run equals the straight
    /// one.
    Resumes,
    /// Nothing is written.
    DryRun,
    /// Used by every run here.
    Everywhere,
    /// Tested in `FILE::TEST` (the first), in a file that uses the second.
    Elsewhere(&'static str, &'static str),
}

pub(super) fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// What running `flag` in `mode` must show (flags the table accepts there).
pub(super) fn effect(flag: &str, mode: &str, s: &Setup) -> Effect {
    use Effect::*;
    let changes = |with: &[&str]| Changes {
        reference: vec![],
        with: args(with),
    };
    let fine_tune = [
        "--freeze-backbone",
        "--unfreeze-after",
        "1",
        "--epochs",
        "2",
    ];
    let with_fine_tune = |more: &[&str]| {
        let mut w = fine_tune.to_vec();
        w.extend(more);
        Changes {
            reference: args(&fine_tune),
            with: args(&w),
        }
    };
    match flag {
        "--data" => Changes {
            reference: vec![],
            with: vec!["--data".into(), s.other.to_str().unwrap().into()],
        },
        "--labels" => {
            let data = s.labelled.to_str().unwrap();
            Changes {
                reference: args(&["--data", data]),
                with: args(&["--data", data, "--labels", s.labels.to_str().unwrap()]),
            }
        }
        "--val-fraction" => changes(&["--val-fraction", "0.4"]),
        "--model" => changes(&["--model", "vgg-mini"]),
        "--weights" => changes(&["--weights", s.weights.to_str().unwrap()]),
        "--freeze-backbone" => changes(&["--freeze-backbone"]),
        "--unfreeze-after" => Changes {
            reference: args(&["--freeze-backbone", "--epochs", "2"]),
            with: args(&fine_tune),
        },
        "--finetune-lr" => with_fine_tune(&["--finetune-lr", "0.05"]),
        "--finetune-bn" => with_fine_tune(&["--finetune-bn", "batch"]),
        "--epochs" => changes(&["--epochs", "2"]),
        "--batch-size" => changes(&["--batch-size", "16"]),
        "--lr" => changes(&["--lr", "0.1"]),
        "--optimizer" => changes(&["--optimizer", "adam"]),
        // Neither the usual 0.9 nor ADAG's 0.5 from scratch (the walk's servers run ADAG).
        "--momentum" => changes(&["--momentum", "0.7"]),
        "--nesterov" => changes(&["--nesterov"]),
        "--weight-decay" => changes(&["--weight-decay", "0.05"]),
        // Warmup (1 epoch by default) is the same under both: the second epoch differs.
        "--schedule" => Changes {
            reference: args(&["--epochs", "2"]),
            with: args(&["--schedule", "constant", "--epochs", "2"]),
        },
        "--warmup-epochs" => changes(&["--warmup-epochs", "0"]),
        "--scale-lr" => changes(&["--scale-lr", "linear", "--base-batch", "16"]),
        "--base-batch" => Changes {
            reference: args(&["--scale-lr", "linear", "--base-batch", "16"]),
            with: args(&["--scale-lr", "linear", "--base-batch", "4"]),
        },
        "--label-smoothing" => changes(&["--label-smoothing", "0.2"]),
        // A bound far below the gradients' norm: every step is scaled down.
        "--clip-grad" => changes(&["--clip-grad", "0.01"]),
        "--model-ema" => Averages {
            reference: Vec::new(),
            with: args(&["--model-ema", "--model-ema-decay", "0.5"]),
        },
        "--model-ema-decay" => Averages {
            reference: args(&["--model-ema", "--model-ema-decay", "0.5"]),
            with: args(&["--model-ema", "--model-ema-decay", "0.9"]),
        },
        "--monitor" => Monitors {
            with: args(&["--monitor", "val_loss", "--epochs", "3", "--lr", "0.2"]),
            column: "val_loss",
        },
        "--patience" | "--min-delta" => Stops {
            with: args(&["--patience", "1", "--min-delta", "100", "--epochs", "3"]),
            patience: 1,
            min_delta: 100.0,
            epochs: 3,
        },
        "--size" => changes(&["--size", "48"]),
        "--augment" => changes(&["--augment", "none"]),
        "--crop-scale" => changes(&["--crop-scale", "0.4,1"]),
        "--flip" => Changes {
            reference: args(&["--augment", "none"]),
            with: args(&["--augment", "none", "--flip"]),
        },
        "--no-flip" => changes(&["--no-flip"]),
        "--rotate" => changes(&["--rotate", "20"]),
        "--shear" => changes(&["--shear", "20"]),
        "--color-jitter" => changes(&["--color-jitter", "0.4"]),
        "--random-erasing" => changes(&["--random-erasing", "1.0"]),
        "--auto-augment" => changes(&["--auto-augment", "rand-m15-n2"]),
        "--mixup" => changes(&["--mixup", "1.0"]),
        "--cutmix" => changes(&["--cutmix", "1.0"]),
        "--mixup-prob" => Changes {
            reference: args(&["--mixup", "1.0"]),
            with: args(&["--mixup", "1.0", "--mixup-prob", "0.5"]),
        },
        "--mixup-switch-prob" => Changes {
            reference: args(&["--mixup", "1.0", "--cutmix", "1.0"]),
            with: args(&[
                "--mixup",
                "1.0",
                "--cutmix",
                "1.0",
                "--mixup-switch-prob",
                "0.9",
            ]),
        },
        // Mixed in the first epoch alone: the second differs from a run mixing both.
        "--mixup-off-epoch" => Changes {
            reference: args(&["--mixup", "1.0", "--epochs", "2"]),
            with: args(&["--mixup", "1.0", "--epochs", "2", "--mixup-off-epoch", "1"]),
        },
        "--seed" => changes(&["--seed", "3"]),
        "--grad-accum" => changes(&["--grad-accum", "2"]),
        "--compression" => changes(&["--compression", "bf16"]),
        "--precision" => changes(&["--precision", "bf16"]),
        "--micro-batches" => changes(&["--micro-batches", "2"]),
        "--mode" => changes(&["--mode", "easgd"]),
        "--window" => changes(&["--window", "2"]),
        "--workers" => Same {
            with: args(&["--workers", "3"]),
            tolerance: 0.0,
            mechanism: "datasets/tests/datasets.rs::order_and_pixels_are_deterministic_per_seed_and_epoch",
            uses: "with_workers",
        },
        "--zero" => Same {
            with: args(&["--zero", "1"]),
            tolerance: 1e-5,
            mechanism: "cli/tests/zero.rs::zero_1_2_and_3_train_an_image_model_as_plain_data_parallel_does_and_resume_exactly",
            uses: "--zero",
        },
        "--recompute" => Same {
            with: args(&["--recompute"]),
            tolerance: 1e-5,
            mechanism: "cli/tests/recompute.rs::recompute_trains_exactly_as_without_it_in_every_mode",
            uses: "--recompute",
        },
        "--no-recompute" => Same {
            with: args(&["--recompute", "--no-recompute"]),
            tolerance: 1e-5,
            mechanism: "cli/tests/recompute.rs::a_run_resumed_without_recompute_goes_on_as_it_would_have",
            uses: "--no-recompute",
        },
        "--overlap" => Same {
            with: args(&["--overlap"]),
            tolerance: 1e-5,
            mechanism: "cli/tests/overlap.rs::overlap_trains_exactly_as_the_exchange_after_the_backward",
            uses: "--overlap",
        },
        // Small buckets: several allreduces a step, the same sums.
        "--bucket-mb" => Same {
            with: args(&["--bucket-mb", "0.01"]),
            tolerance: 1e-5,
            mechanism: "burn-dist/tests/ddp_learner.rs::ddp_strategy_through_burn_train_matches_one_process_with_the_whole_batch",
            uses: "with_bucket_bytes",
        },
        "--pipeline-schedule" => Same {
            with: args(&["--pipeline-schedule", "gpipe"]),
            tolerance: 1e-5,
            mechanism: "burn-dist/tests/pipeline.rs::a_split_cnn_trains_exactly_like_the_unsplit_one_with_gpipe_and_1f1b",
            uses: "GPipe",
        },
        "--pipeline-split" => Splits {
            with: args(&["--pipeline-split", "0:2,2:6"]),
            split: "0:2,2:6",
            tolerance: 1e-4,
        },
        "--pipeline-balance" => Same {
            with: args(&["--pipeline-balance", "time"]),
            tolerance: 1e-4,
            mechanism: "cli/tests/pipeline_train.rs::splits_balanced_by_measured_time_or_memory_are_printed_recorded_and_kept_on_resume",
            uses: "--pipeline-balance",
        },
        // One worker: the bound never binds, so the model is the same; the bound holding a
        // fast worker back is tested on the servers.
        "--staleness" => Same {
            with: args(&["--staleness", "1"]),
            tolerance: 0.0,
            mechanism: "burn-dist/tests/ps.rs::the_staleness_bound_holds_a_fast_worker_back",
            uses: "max_staleness",
        },
        // Flex, the default, said again; a process whose Burn default is another backend
        // still trains on the device asked for in tests/resume_any_build.rs.
        "--device" => Same {
            with: args(&["--device", "flex"]),
            tolerance: 0.0,
            mechanism: "cli/tests/resume_any_build.rs::one_process_data_parallel_servers_and_a_pipeline_resume_with_burns_default_unusable",
            uses: "--device",
        },
        "--stop-after-epoch" => Rows {
            with: args(&["--epochs", "3", "--stop-after-epoch", "1"]),
            rows: 1,
        },
        "--price-per-hour" => Priced,
        "--overwrite" => Overwrites,
        "--resume" => Resumes,
        "--run-dir" => Everywhere,
        "--log-every" => Elsewhere(
            "cli/tests/tensorboard.rs::step_scalars_are_the_jobs_in_every_mode_and_a_resume_keeps_them",
            "--log-every",
        ),
        "--min-workers" | "--rejoin-timeout" => Elsewhere(
            "cli/tests/elastic_train.rs::a_worker_cut_off_is_dropped_and_below_the_minimum_it_gives_up",
            "--rejoin-timeout",
        ),
        "--balance" => Elsewhere(
            "cli/tests/elastic_train.rs::uneven_shares_by_throughput_equal_one_process_on_the_global_batch",
            "--balance",
        ),
        "--hosts" | "--max-workers" => Elsewhere(
            "cli/tests/flag_effects.rs::a_joiner_finds_the_job_through_hosts_and_waits_while_max_workers_is_reached",
            "--hosts",
        ),
        other => panic!(
            "{other} has no effect row in tests/flag_effects.rs for {mode}: say what running it \
             shows"
        ),
    }
}
