//! `hearth data check`: what training would do with a folder of images, before a run is spent
//! finding out. The same reading of the folder as `hearth train` (train/ and val/, or one
//! folder split by `--val-fraction`, or a multi-label CSV), then every image decoded in full,
//! the classes counted per part, byte-identical files across train and val found, and the
//! image sizes summarised.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use hearth::datasets::{ImageSet, Target, has_train_val, train_val};

use hearth::Result;

/// What a check found.
#[derive(Debug, Clone)]
pub struct DataCheck {
    /// How the folder was read (its layout).
    pub layout: String,
    pub multi_label: bool,
    /// Each class (or label) with its training and validation counts.
    pub classes: Vec<(String, usize, usize)>,
    pub train: usize,
    pub val: usize,
    /// Images that fail to decode, with the reason (training skips them).
    pub undecodable: Vec<(PathBuf, String)>,
    /// Byte-identical files in both parts (a validation image the model also trains on).
    pub duplicates: Vec<(PathBuf, PathBuf)>,
    /// Smallest, median and largest image by area, as (width, height).
    pub sizes: Option<[(u32, u32); 3]>,
    /// The folder scan's own findings (non-images, empty files, empty class folders).
    pub scan: Option<String>,
}

impl DataCheck {
    /// Whether training would skip or mislead: undecodable images or train/val duplicates.
    pub fn has_problems(&self) -> bool {
        !self.undecodable.is_empty() || !self.duplicates.is_empty()
    }

    /// The report, a few lines a person reads.
    pub fn report(&self) -> String {
        let mut out = format!("layout: {}\n", self.layout);
        out.push_str(&format!(
            "{} {}, {} training and {} validation images\n",
            self.classes.len(),
            if self.multi_label {
                "labels (multi-label)"
            } else {
                "classes"
            },
            self.train,
            self.val
        ));
        let width = self
            .classes
            .iter()
            .map(|c| c.0.chars().count())
            .max()
            .unwrap_or(5)
            .max(5);
        out.push_str(&format!(
            "  {:<width$}  {:>7}  {:>7}\n",
            "class", "train", "val"
        ));
        for (name, t, v) in &self.classes {
            out.push_str(&format!("  {name:<width$}  {t:>7}  {v:>7}\n"));
        }
        if let Some([min, median, max]) = self.sizes {
            out.push_str(&format!(
                "sizes: smallest {}x{}, median {}x{}, largest {}x{}\n",
                min.0, min.1, median.0, median.1, max.0, max.1
            ));
        }
        if let Some(scan) = &self.scan {
            out.push_str(&format!("scan: {scan}\n"));
        }
        if self.undecodable.is_empty() {
            out.push_str("every image decodes\n");
        } else {
            out.push_str(&format!(
                "{} image(s) fail to decode (training skips them):\n",
                self.undecodable.len()
            ));
            for (p, why) in &self.undecodable {
                out.push_str(&format!("  {}: {why}\n", p.display()));
            }
        }
        if self.duplicates.is_empty() {
            out.push_str("no image is in both train and val\n");
        } else {
            out.push_str(&format!(
                "{} image(s) in both train and val (validation would score images the model \
                 trains on):\n",
                self.duplicates.len()
            ));
            for (a, b) in &self.duplicates {
                out.push_str(&format!("  {} == {}\n", a.display(), b.display()));
            }
        }
        out
    }
}

/// Byte-identical files across the parts, training then validation (the hash groups them;
/// the bytes confirm), sorted.
fn across_parts(by_hash: &HashMap<u64, Vec<(PathBuf, bool)>>) -> Vec<(PathBuf, PathBuf)> {
    let mut duplicates = Vec::new();
    for group in by_hash.values().filter(|g| g.len() > 1) {
        for (a, _) in group.iter().filter(|g| !g.1) {
            for (b, _) in group.iter().filter(|g| g.1) {
                if std::fs::read(a).ok() == std::fs::read(b).ok() {
                    duplicates.push((a.clone(), b.clone()));
                }
            }
        }
    }
    duplicates.sort();
    duplicates
}

/// Checks `data` (with `labels`, a multi-label CSV, as `hearth train --labels` reads it);
/// `progress(done, total)` is called as images are decoded.
pub fn check(
    data: &Path,
    labels: Option<&Path>,
    val_fraction: f64,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DataCheck> {
    let (layout, (train, val)) = match labels {
        Some(csv) => (
            format!(
                "{} over {}, split by --val-fraction {val_fraction} (seed {seed})",
                csv.display(),
                data.display()
            ),
            ImageSet::from_csv(csv, Some(data))?.split(val_fraction, seed)?,
        ),
        None if has_train_val(data) => (
            format!("{}: train/ and val/ class folders", data.display()),
            train_val(data, val_fraction, seed)?,
        ),
        None => (
            format!(
                "{}: class folders, split by --val-fraction {val_fraction} (seed {seed})",
                data.display()
            ),
            train_val(data, val_fraction, seed)?,
        ),
    };
    let count = |set: &ImageSet| {
        let mut c = vec![0usize; set.classes.len()];
        for s in &set.samples {
            match &s.target {
                Target::Class(k) => c[*k] += 1,
                Target::Multi(ls) => ls.iter().for_each(|l| c[*l] += 1),
            }
        }
        c
    };
    let (ct, cv) = (count(&train), count(&val));
    let classes = train
        .classes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.clone(), ct[i], cv.get(i).copied().unwrap_or(0)))
        .collect();
    let scan = {
        let mut all = train.problems.clone();
        all.0.extend(val.problems.0.iter().cloned());
        all.summary()
    };
    let total = train.len() + val.len();
    let mut undecodable = Vec::new();
    let mut sizes = Vec::new();
    let mut by_hash: HashMap<u64, Vec<(PathBuf, bool)>> = HashMap::new();
    let mut done = 0;
    for (set, is_val) in [(&train, false), (&val, true)] {
        for s in &set.samples {
            let bytes = match std::fs::read(&s.path) {
                Ok(b) => b,
                Err(e) => {
                    undecodable.push((s.path.clone(), e.to_string()));
                    continue;
                }
            };
            match hearth::datasets::preprocess::decode_rgb(&bytes, &s.path) {
                Ok(img) => sizes.push((img.width(), img.height())),
                Err(e) => undecodable.push((s.path.clone(), e.to_string())),
            }
            let mut h = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut h);
            by_hash
                .entry(h.finish())
                .or_default()
                .push((s.path.clone(), is_val));
            done += 1;
            progress(done, total);
        }
    }
    let duplicates = across_parts(&by_hash);
    sizes.sort_by_key(|(w, h)| u64::from(*w) * u64::from(*h));
    let sizes =
        (!sizes.is_empty()).then(|| [sizes[0], sizes[sizes.len() / 2], sizes[sizes.len() - 1]]);
    Ok(DataCheck {
        layout,
        multi_label: train.multi_label,
        classes,
        train: train.len(),
        val: val.len(),
        undecodable,
        duplicates,
        sizes,
        scan,
    })
}
