//! Image folders, bad files, the streaming loader, sharding and the cache, on generated data.

use std::collections::BTreeSet;
use std::path::Path;

use burn::prelude::*;
use hearth_datasets::synth::{SynthConfig, class_names, generate};
use hearth_datasets::{
    DataError, DiskCache, ImageSet, Loader, LoaderConfig, Pipeline, ProblemKind, Target, Transform,
    train_val,
};

fn synth(dir: &Path, classes: usize, per_class: usize, size: u32) {
    generate(
        dir,
        &SynthConfig::new(classes, per_class, size).with_seed(1),
    )
    .unwrap();
}

fn loader(set: ImageSet, batch: usize, cfg: impl FnOnce(LoaderConfig) -> LoaderConfig) -> Loader {
    Loader::new(
        set,
        Pipeline::train(16),
        cfg(LoaderConfig::new(batch).with_seed(3)),
    )
    .unwrap()
}

#[test]
fn folder_classes_are_sorted_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 3, 4, 24);
    let set = ImageSet::from_folder(dir.path()).unwrap();
    assert_eq!(set.classes, class_names(3));
    let mut sorted = set.classes.clone();
    sorted.sort();
    assert_eq!(set.classes, sorted);
    assert_eq!(set.class_counts(), vec![4, 4, 4]);
    assert!(set.problems.is_empty());
}

#[test]
fn every_kind_of_bad_file_is_counted_with_its_path_and_strict_mode_refuses() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 3, 16);
    let c0 = dir.path().join(&class_names(2)[0]);
    std::fs::write(c0.join("zero.png"), b"").unwrap();
    std::fs::write(c0.join("notes.txt"), b"hello").unwrap();
    std::fs::write(c0.join("garbage.jpg"), b"definitely not a jpeg").unwrap();
    let good = std::fs::read(c0.join("00000.png")).unwrap();
    std::fs::write(c0.join("truncated_header.png"), &good[..20]).unwrap();
    std::os::unix::fs::symlink("/nonexistent/target.png", c0.join("dangling.png")).unwrap();
    std::fs::create_dir(dir.path().join("zz_empty_class")).unwrap();

    let set = ImageSet::from_folder(dir.path()).unwrap();
    assert_eq!(set.len(), 6, "only the good images remain");
    let find = |name: &str| {
        set.problems
            .0
            .iter()
            .find(|p| p.path.ends_with(name))
            .unwrap_or_else(|| panic!("{name} not reported: {:?}", set.problems))
            .kind
            .clone()
    };
    assert_eq!(find("zero.png"), ProblemKind::EmptyFile);
    assert_eq!(find("notes.txt"), ProblemKind::NotAnImage);
    assert!(matches!(find("garbage.jpg"), ProblemKind::Corrupt(_)));
    assert!(matches!(
        find("truncated_header.png"),
        ProblemKind::Corrupt(_)
    ));
    assert!(matches!(find("dangling.png"), ProblemKind::Unreadable(_)));
    assert_eq!(find("zz_empty_class"), ProblemKind::EmptyClass);
    let summary = set.problems.summary().unwrap();
    assert!(summary.contains("skipped 6 bad file(s)"), "{summary}");

    let err = set.strict().unwrap_err().to_string();
    assert!(
        err.contains("garbage.jpg") && err.contains("zero.png"),
        "{err}"
    );
}

#[test]
fn unreadable_permissions_are_reported_unless_running_as_root() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 16);
    let f = dir.path().join(&class_names(2)[1]).join("00000.png");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o000)).unwrap();
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let root_can_read = std::fs::File::open(&f).is_ok();
    let reported = set
        .problems
        .0
        .iter()
        .any(|p| p.path == f && matches!(p.kind, ProblemKind::Unreadable(_)));
    assert_eq!(reported, !root_can_read, "{:?}", set.problems);
}

#[test]
fn missing_root_and_empty_sets_are_clear_errors() {
    let err = ImageSet::from_folder(Path::new("/nonexistent/data")).unwrap_err();
    assert!(matches!(err, DataError::MissingRoot { .. }));
    assert!(err.to_string().contains("/nonexistent/data"));
    let dir = tempfile::tempdir().unwrap();
    let err = ImageSet::from_folder(dir.path()).unwrap_err().to_string();
    assert!(err.contains("no class sub-folders"), "{err}");
    std::fs::create_dir(dir.path().join("only")).unwrap();
    std::fs::write(dir.path().join("only/x.png"), b"").unwrap();
    let err = ImageSet::from_folder(dir.path()).unwrap_err().to_string();
    assert!(err.contains("no readable image"), "{err}");
}

#[test]
fn one_class_is_refused_for_classification() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 16);
    std::fs::remove_dir_all(dir.path().join(&class_names(2)[1])).unwrap();
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let err = set.require_classes(2).unwrap_err().to_string();
    assert!(err.contains("1 class(es)"), "{err}");
}

#[test]
fn stratified_split_is_seeded_disjoint_and_covers_every_class() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 3, 10, 16);
    let (t, v) = train_val(dir.path(), 0.2, 5).unwrap();
    assert_eq!(t.len() + v.len(), 30);
    assert_eq!(v.class_counts(), vec![2, 2, 2]);
    let tp: BTreeSet<_> = t.samples.iter().map(|s| s.path.clone()).collect();
    assert!(v.samples.iter().all(|s| !tp.contains(&s.path)));
    let (_, v2) = train_val(dir.path(), 0.2, 5).unwrap();
    assert_eq!(v.samples, v2.samples);
    let (_, v3) = train_val(dir.path(), 0.2, 6).unwrap();
    assert_ne!(v.samples, v3.samples);
    // train/ + val/ folders are used as they are.
    let tv = tempfile::tempdir().unwrap();
    generate(tv.path(), &SynthConfig::new(2, 3, 16).with_val(2)).unwrap();
    let (t, v) = train_val(tv.path(), 0.5, 0).unwrap();
    assert_eq!((t.len(), v.len()), (6, 4));
}

#[test]
fn multi_label_csv_with_header_and_no_finding() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 16);
    let n = class_names(2);
    let csv = dir.path().join("labels.csv");
    std::fs::write(
        &csv,
        format!(
            "Image Index,Finding Labels\n{a}/00000.png,Effusion|Mass\n{a}/00001.png,No Finding\n{b}/00001.png,Mass\n{b}/missing.png,Mass\n",
            a = n[0],
            b = n[1]
        ),
    )
    .unwrap();
    let set = ImageSet::from_csv(&csv, None).unwrap();
    assert!(set.multi_label);
    assert_eq!(set.classes, vec!["Effusion", "Mass"]);
    assert_eq!(set.samples[0].target, Target::Multi(vec![0, 1]));
    assert_eq!(set.samples[1].target, Target::Multi(vec![]));
    assert_eq!(set.problems.0[0].kind, ProblemKind::MissingFile);
    let l = Loader::new(
        set,
        Pipeline::eval(16),
        LoaderConfig::new(4).with_shuffle(false),
    )
    .unwrap();
    let batch = l.epoch(0, &Device::flex()).next().unwrap().unwrap();
    let hot: Vec<f32> = batch
        .multi_hot
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(hot, vec![1.0, 1.0, 0.0, 0.0, 0.0, 1.0]);
}

#[test]
fn multi_label_csv_reads_quoted_fields_and_names_the_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 16);
    let n = class_names(2);
    // A file name with a comma and a quote, quoted as RFC 4180 says.
    let odd = dir.path().join(&n[0]).join("scan, \"left\".png");
    std::fs::copy(dir.path().join(&n[0]).join("00000.png"), &odd).unwrap();
    let csv = dir.path().join("labels.csv");
    std::fs::write(
        &csv,
        format!(
            "path,labels\n\"{a}/scan, \"\"left\"\".png\",\"Mass|Nodule\"\n{b}/00001.png,Mass\n",
            a = n[0],
            b = n[1]
        ),
    )
    .unwrap();
    let set = ImageSet::from_csv(&csv, None).unwrap();
    assert_eq!(set.samples.len(), 2, "{:?}", set.problems);
    assert_eq!(set.samples[0].path, odd);
    assert_eq!(set.classes, vec!["Mass", "Nodule"]);
    assert_eq!(set.samples[0].target, Target::Multi(vec![0, 1]));
    // An unterminated quote is an error naming the file.
    std::fs::write(
        &csv,
        format!("{a}/00000.png,Mass\n\"{a}/00001.png,Mass\n", a = n[0]),
    )
    .unwrap();
    match ImageSet::from_csv(&csv, None) {
        Err(e) => assert!(e.to_string().contains("labels.csv"), "{e}"),
        Ok(s) => assert_eq!(s.samples.len(), 1, "the broken row must not pass as a path"),
    }
}

fn epoch_indices(l: &Loader, epoch: u64) -> Vec<Vec<usize>> {
    l.epoch(epoch, &Device::flex())
        .map(|b| b.unwrap().indices)
        .collect()
}

#[test]
fn order_and_pixels_are_deterministic_per_seed_and_epoch() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 6, 24);
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let a = loader(set.clone(), 4, |c| c.with_workers(2));
    let b = loader(set.clone(), 4, |c| c.with_workers(1).with_prefetch(1));
    assert_eq!(epoch_indices(&a, 0), epoch_indices(&b, 0));
    assert_ne!(epoch_indices(&a, 0), epoch_indices(&a, 1));
    let pa: Vec<f32> = a
        .epoch(2, &Device::flex())
        .next()
        .unwrap()
        .unwrap()
        .images
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let pb: Vec<f32> = b
        .epoch(2, &Device::flex())
        .next()
        .unwrap()
        .unwrap()
        .images
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(pa, pb, "augmentation depends only on (seed, epoch, index)");
    let batch = a.epoch(0, &Device::flex()).next().unwrap().unwrap();
    assert_eq!(batch.images.dims(), [4, 3, 16, 16]);
    assert_eq!(batch.classes.unwrap().dims(), [4]);
}

#[test]
fn shards_are_disjoint_cover_the_epoch_and_have_equal_batch_counts() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 5, 16); // 10 samples
    let set = ImageSet::from_folder(dir.path()).unwrap();
    for world in 1..=4 {
        let shards: Vec<Vec<Vec<usize>>> = (0..world)
            .map(|r| epoch_indices(&loader(set.clone(), 2, |c| c.with_shard(r, world)), 1))
            .collect();
        let counts: Vec<usize> = shards.iter().map(Vec::len).collect();
        assert!(
            counts.iter().all(|&c| c == counts[0]),
            "world {world}: batch counts {counts:?}"
        );
        let all: Vec<usize> = shards.iter().flatten().flatten().copied().collect();
        let unique: BTreeSet<usize> = all.iter().copied().collect();
        assert_eq!(unique.len(), 10, "world {world} covers the epoch");
        // Padding repeats at most world - 1 samples.
        assert!(
            all.len() - 10 < world,
            "world {world}: {} samples",
            all.len()
        );
    }
    // drop_last: whole batches on every rank, no repeats.
    let shards: Vec<Vec<Vec<usize>>> = (0..3)
        .map(|r| {
            epoch_indices(
                &loader(set.clone(), 2, |c| c.with_shard(r, 3).with_drop_last(true)),
                0,
            )
        })
        .collect();
    assert!(shards.iter().all(|s| s.len() == 1 && s[0].len() == 2));
    let all: Vec<usize> = shards.iter().flatten().flatten().copied().collect();
    assert_eq!(all.iter().collect::<BTreeSet<_>>().len(), 6);
}

#[test]
fn resharding_mid_epoch_neither_repeats_nor_skips() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 12, 16); // 24 samples
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let l = loader(set, 2, |c| c);
    // Two ranks run 3 steps (2 x 2 x 3 = 12 samples), then the world grows to 3.
    let mut seen: Vec<usize> = Vec::new();
    for r in 0..2 {
        let it = l.epoch_from(0, 0, r, 2, &Device::flex());
        for b in it.take(3) {
            seen.extend(b.unwrap().indices);
        }
    }
    for r in 0..3 {
        for b in l.epoch_from(0, 12, r, 3, &Device::flex()) {
            seen.extend(b.unwrap().indices);
        }
    }
    seen.sort();
    assert_eq!(seen, (0..24).collect::<Vec<_>>());
}

#[test]
fn elastic_steps_see_every_sample_once_across_membership_changes() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 25, 16); // 50 samples
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let l = loader(set, 4, |c| c);
    let global = 8;
    // Membership per stretch of steps: (steps, shares). Shares tile the global batch: even,
    // uneven (throughput balanced), a worker leaving, two joining.
    let plan: [(usize, &[usize]); 4] =
        [(2, &[4, 4]), (1, &[5, 2, 1]), (1, &[8]), (9, &[2, 2, 2, 2])];
    let mut seen: Vec<usize> = Vec::new();
    let mut position = 0;
    for (steps, shares) in plan {
        let mut offset = 0;
        let mut taken = 0;
        for &share in shares {
            let slices = l.step_slices(0, position, global, offset, share);
            for step in slices.iter().take(steps) {
                seen.extend(step);
            }
            taken = taken.max(slices.len().min(steps));
            offset += share;
        }
        // Every worker stepped the same number of times; the position moves by whole steps.
        position = (position + taken * global).min(50);
    }
    assert_eq!(position, 50, "the plan runs to the end of the epoch");
    seen.sort();
    assert_eq!(
        seen,
        (0..50).collect::<Vec<_>>(),
        "each sample exactly once"
    );

    // The last, partial step (2 samples left of 8) is divided in proportion: 1 and 1.
    let last: Vec<usize> = (0..2)
        .map(|w| l.step_slices(0, 48, global, 4 * w, 4)[0].len())
        .collect();
    assert_eq!(last, vec![1, 1]);
    // And a stream yields the same batches as the slices, for any worker.
    let stream: Vec<Vec<usize>> = l
        .epoch_steps(0, 8, global, 5, 3, &Device::flex())
        .map(|b| b.unwrap().indices)
        .collect();
    let slices: Vec<Vec<usize>> = l
        .step_slices(0, 8, global, 5, 3)
        .into_iter()
        .filter(|b| !b.is_empty())
        .collect();
    assert_eq!(stream, slices);
}

#[test]
fn streaming_decodes_only_what_is_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 20, 16); // 40 samples, 20 batches of 2
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let l = loader(set, 2, |c| c.with_workers(2).with_prefetch(2));
    let mut stream = l.epoch(0, &Device::flex());
    stream.next().unwrap().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // One yielded + at most `prefetch` in flight, 2 samples each.
    assert!(
        l.decoded_samples() <= 2 * (1 + 2),
        "decoded {}",
        l.decoded_samples()
    );
    drop(stream);
    assert_eq!(l.epoch(0, &Device::flex()).count(), 20);
}

#[test]
fn files_that_fail_mid_stream_are_replaced_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 4, 32);
    let set = ImageSet::from_folder(dir.path()).unwrap();
    // Truncate one image after the scan accepted its header.
    let victim = set.samples[2].path.clone();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let l = loader(set.clone(), 3, |c| c.with_shuffle(false));
    let batches = epoch_indices(&l, 0);
    assert_eq!(
        batches.iter().map(Vec::len).sum::<usize>(),
        8,
        "batch sizes unchanged"
    );
    assert!(
        l.decode_problems().iter().any(|p| p.path == victim),
        "{:?}",
        l.decode_problems()
    );
    let strict = loader(set, 3, |c| c.with_shuffle(false).with_strict(true));
    let err = strict
        .epoch(0, &Device::flex())
        .find_map(|b| b.err())
        .expect("strict mode errors");
    assert!(
        err.to_string().contains(&victim.display().to_string()),
        "{err}"
    );
}

#[test]
fn disk_cache_hits_and_rebuilds_when_the_source_changes() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 32);
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(cache_dir.path(), 1 << 20, 20).unwrap();
    let src = dir.path().join(&class_names(2)[0]).join("00000.png");
    let a = cache.load(&src).unwrap();
    let b = cache.load(&src).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.height().min(a.width()), 20);
    assert_eq!(cache.hits.load(std::sync::atomic::Ordering::Relaxed), 1);
    // Replace the file (new content and size): the entry is rebuilt.
    let other = hearth_datasets::synth::render(1, 9, 40, 2);
    std::thread::sleep(std::time::Duration::from_millis(20));
    other.save(&src).unwrap();
    let c = cache.load(&src).unwrap();
    assert_eq!(c.dimensions(), (20, 20));
    assert_ne!(c, a);
    assert_eq!(cache.misses.load(std::sync::atomic::Ordering::Relaxed), 2);
    // A full cache stops writing but still serves images.
    let tiny = DiskCache::open(tempfile::tempdir().unwrap().path(), 10, 20).unwrap();
    assert!(tiny.load(&src).is_ok());
    assert_eq!(tiny.used_bytes(), 0);
    // Cached loading through the loader.
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let l = Loader::new(set, Pipeline::eval(16), LoaderConfig::new(2))
        .unwrap()
        .with_cache(DiskCache::open(cache_dir.path(), 1 << 20, 20).unwrap());
    assert_eq!(l.epoch(0, &Device::flex()).count(), 2);
}

#[test]
fn augmentations_compose_in_a_loader() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 40);
    let set = ImageSet::from_folder(dir.path()).unwrap();
    let p = Pipeline::train(24)
        .with(Transform::Rotation(20.0))
        .unwrap()
        .with(Transform::Shear(10.0))
        .unwrap()
        .with(Transform::ColorJitter {
            brightness: 0.3,
            contrast: 0.3,
            saturation: 0.3,
        })
        .unwrap();
    let l = Loader::new(set, p, LoaderConfig::new(4)).unwrap();
    let b = l.epoch(0, &Device::flex()).next().unwrap().unwrap();
    assert_eq!(b.images.dims(), [4, 3, 24, 24]);
}

#[test]
fn damaged_cache_entries_are_misses_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path(), 2, 2, 32);
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(cache_dir.path(), 1 << 20, 20).unwrap();
    let src = dir.path().join(&class_names(2)[0]).join("00000.png");
    let good = cache.load(&src).unwrap();
    let entries: Vec<_> = std::fs::read_dir(cache_dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(entries.len(), 1);
    let magic = std::fs::read(&entries[0]).unwrap()[..4].to_vec();
    let entry = |w: u32, h: u32, pixels: usize| {
        let mut b = magic.clone();
        b.extend(w.to_le_bytes());
        b.extend(h.to_le_bytes());
        b.extend(vec![7u8; pixels]);
        b
    };
    // A zero-sized image (what a corrupted disk leaves), a truncated one, one of another size.
    for bad in [entry(0, 0, 0), entry(20, 20, 100), entry(10, 10, 300)] {
        std::fs::write(&entries[0], bad).unwrap();
        let img = cache.load(&src).unwrap();
        assert_eq!(img, good, "a damaged entry must be rebuilt from the source");
        // Through the loader too: a full epoch, no panic.
        let set = ImageSet::from_folder(dir.path()).unwrap();
        let l = Loader::new(set, Pipeline::eval(16), LoaderConfig::new(2))
            .unwrap()
            .with_cache(DiskCache::open(cache_dir.path(), 1 << 20, 20).unwrap());
        assert!(l.epoch(0, &Device::flex()).all(|b| b.is_ok()));
    }
}
