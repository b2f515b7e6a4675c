//! `--zero 3` alone: validation shares of different lengths, units let go after their forward
//! and gathered again (or kept) for their backward, and a bucket per weight, each against plain
//! data parallel.

use super::*;

/// Adam at the rate the tests of stage 3 alone train with.
const ADAM: [&str; 4] = ["--optimizer", "adam", "--lr", "0.003"];

/// Stage 3 validates with one unit's parameters gathered at a time, the gathers collective:
/// on 4 ranks, 18 validation images in batches of 4 per rank give ranks 0 and 1 two batches
/// and ranks 2 and 3 one, so ranks 2 and 3 gather a second time without computing. No rank
/// waits on another (each job is bounded), and the curve is plain data parallel's.
#[test]
fn stage_3_validates_shares_of_different_lengths_as_plain_data_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let mut base = BASE;
    base[1] = "16";
    let run = |zero: &str| dir.path().join(format!("uneven-zero{zero}"));
    for zero in ["0", "3"] {
        let args = [&["--epochs", "2", "--zero", zero][..], &ADAM].concat();
        Job::spawn_ok(dir.path(), &data, &run(zero), 4, &base, &args, &[]);
    }
    let (plain, three) = (metrics(&run("0")), metrics(&run("3")));
    same_curves(("plain", &plain), ("zero 3", &three), &COLUMNS, 1e-5);
    assert_eq!(three.len(), 2, "{three:?}");
}

/// Stage 3 without `--recompute` lets each unit's convolution and linear weights go after its
/// forward and gathers the unit again for its backward, the graph keeping the weights' ids
/// (`hearth_kernels::keyed`), but for the last units that fit in two buckets, which keep their
/// parameters from their forward to their backward: a VGG (its classifier unit's linear
/// layers, rank-2 weights) and a DenseNet (its blocks' joined convolutions; its units' tensors
/// stand in another order in the model than in the forward, all dense layers before the
/// transitions, where stage 3 cuts its buckets and writes its checkpoints) train as plain data
/// parallel does: curves and weights. With 50 KiB buckets the VGG's first classifier weight
/// (256 rows of 64, 64 KiB) and its largest convolution weight are cut into pieces of rows
/// (of output channels), gathered and multiplied a piece at a time and never held whole (so
/// not counted in what is kept): the VGG keeps all 4 of its units (their biases), the DenseNet
/// its last 11 of 13, so both kinds of unit run.
#[test]
fn stage_3_regathers_vgg_and_densenet_units_as_plain_data_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for (model, kept, pieces) in [
        (
            "vgg-mini-plain",
            "4 of its 4",
            "cuts 2 weights larger than a bucket into 4 pieces",
        ),
        ("densenet-mini", "11 of its 13", ""),
    ] {
        let run = |zero: &str| dir.path().join(format!("{model}-zero{zero}"));
        for zero in ["0", "3"] {
            let mut args = vec!["--model", model, "--epochs", "1", "--zero", zero];
            if zero == "3" {
                args.extend(["--bucket-mb", "0.05"]);
            }
            args.extend(ADAM);
            let logs = Job::spawn_ok(dir.path(), &data, &run(zero), 2, &BASE, &args, &[]);
            if zero == "3" {
                assert!(
                    logs.contains(&format!("keeps the last {kept} units"))
                        && logs.contains(pieces)
                        && (!pieces.is_empty() || !logs.contains("pieces of rows")),
                    "{logs}"
                );
            }
        }
        let (plain, three) = (metrics(&run("0")), metrics(&run("3")));
        same_curves(
            (&format!("{model} plain"), &plain),
            (&format!("{model} zero 3"), &three),
            &COLUMNS,
            1e-5,
        );
        same_weights(
            &run("0").join("model.bpk"),
            &run("3").join("model.bpk"),
            1e-5,
        );
    }
}

/// Stage 3 with a bucket per weight (`--bucket-mb 0.001`, 1 KiB: every convolution and linear
/// weight of the mini models alone in its bucket, each linear weight cut into pieces of
/// rows): each unit's backward gathers a weight's
/// bucket when the weight's op first needs it, and hands the weight's gradient over as soon as
/// it is whole, its bucket reduce-scattered then rather than at the unit's end (the ranks call
/// those collectives in their backward's order). Without and with `--overlap` (the
/// reductions on a thread of their own beside the gathers; a thread gathers the forward's
/// units and their pieces ahead, and from the second step one gathers each unit's buckets and
/// pieces ahead of its ops, in the last step's order), a ResNet and a VGG train as plain data
/// parallel does.
#[test]
fn stage_3_with_a_bucket_per_weight_gathers_and_reduces_weight_by_weight_as_plain_data_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    for model in ["resnet-mini", "vgg-mini-plain"] {
        let run = |label: &str| dir.path().join(format!("{model}-{label}"));
        // "0": plain data parallel; "3f": stage 3 with 1 KiB buckets; "3fo": and --overlap.
        let stages = ["0", "3f", "3fo"];
        let mut curves = Vec::new();
        for label in stages {
            let mut args = vec!["--model", model, "--epochs", "1", "--zero", &label[..1]];
            if label != "0" {
                args.extend(["--bucket-mb", "0.001"]);
            }
            if label.ends_with('o') {
                args.push("--overlap");
            }
            args.extend(ADAM);
            let logs = Job::spawn_ok(dir.path(), &data, &run(label), 2, &BASE, &args, &[]);
            if label != "0" {
                assert!(
                    logs.contains("weights' gradients handed over one by one as each was whole")
                        && logs.contains("buckets of 1.0 KiB"),
                    "{logs}"
                );
                // The linear weights are larger than 1 KiB: cut into pieces of rows, also with
                // `--overlap`, whose threads gather the pieces in turn.
                let said = "pieces of rows in all, each gathered, multiplied and reduced alone";
                assert!(logs.contains(said), "{label}: {logs}");
            }
            if label == "3fo" {
                // "epoch 1: `exchange.zero` 3's backward fetched F buckets, A of them gathered
                // ahead": the epoch's second step took its buckets from the thread.
                let line = logs
                    .lines()
                    .find(|l| l.contains("of them gathered ahead by a thread"))
                    .unwrap_or_else(|| panic!("no gathered-ahead line:\n{logs}"));
                let number_before = |word: &str| -> u64 {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    let at = words.iter().position(|w| *w == word).expect(word);
                    words[at - 1].trim_end_matches(',').parse().expect(line)
                };
                let (fetched, ahead) = (number_before("buckets,"), number_before("of"));
                assert!(ahead > 0 && ahead < fetched, "{line}");
            }
            curves.push(metrics(&run(label)));
        }
        stages_equal_plain(model, &stages, &curves, &run);
    }
}

/// Stage 3 from a torchvision `.pth` (a 5-class ResNet's, written as `torch.save` writes a
/// state_dict) and from the same weights as `.safetensors`, under a new 3-class head: rank 0
/// checks the file at its start and reads each tensor once as it hands its buckets out
/// (`hearth_models::load_torchvision_deferred`, `hearth::train::zero`); rank 1 never reads it.
/// It trains as plain data parallel from the same file does, curves and weights.
#[test]
fn stage_3_from_a_torchvision_pth_trains_as_plain_data_parallel() {
    use burn::prelude::Device;
    let dir = tempfile::tempdir().unwrap();
    let data = small_data(dir.path());
    let config = hearth::train::model_config("resnet-mini", 5).unwrap();
    let pretrained = config.init(&Device::flex()).unwrap();
    for ext in ["pth", "safetensors"] {
        let file = dir.path().join(format!("pretrained.{ext}"));
        match ext {
            "pth" => hearth::models::export_torchvision_pth(&pretrained, &file),
            _ => hearth::models::export_torchvision(&pretrained, &file),
        }
        .unwrap();
        let run = |zero: &str| dir.path().join(format!("{ext}-zero{zero}"));
        for zero in ["0", "3"] {
            let args = [
                &[
                    "--epochs",
                    "1",
                    "--zero",
                    zero,
                    "--weights",
                    file.to_str().unwrap(),
                ][..],
                &ADAM,
            ]
            .concat();
            let logs = Job::spawn_ok(dir.path(), &data, &run(zero), 2, &BASE, &args, &[]);
            assert!(
                logs.contains("tensors from") && logs.contains("new 3-class head"),
                "{logs}"
            );
            // Rank 0 hands the file's tensors out from the file, each read once.
            assert_eq!(
                logs.contains("reads") && logs.contains("a tensor at a time as it hands"),
                zero == "3",
                "{logs}"
            );
        }
        let (plain, three) = (metrics(&run("0")), metrics(&run("3")));
        same_curves(("plain", &plain), ("zero 3", &three), &COLUMNS, 1e-5);
        same_weights(
            &run("0").join("model.bpk"),
            &run("3").join("model.bpk"),
            1e-5,
        );
    }
}
