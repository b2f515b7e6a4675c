//! Image folders and multi-label CSVs to a list of samples, with every bad file accounted for.
//!
//! Layout: `root/<class>/*.{jpg,jpeg,png,bmp,gif,webp,tiff,tif}`; classes are the sub-folders
//! sorted by name. Multi-label: a CSV of `path,label1|label2|...` (paths relative to the CSV's
//! folder or to a given image folder), labels sorted by name; an empty label field or
//! `No Finding` means no label (the ChestX-ray14 convention).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::rng::SplitMix64;
use crate::{DataError, Result};

/// File extensions read as images (case-insensitive).
pub const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "bmp", "gif", "webp", "tiff", "tif"];

/// What a sample is labelled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Single-label classification: the class index.
    Class(usize),
    /// Multi-label: the indices of the labels present (possibly none).
    Multi(Vec<usize>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub path: PathBuf,
    pub target: Target,
}

/// Why a file or folder was left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProblemKind {
    /// A file whose extension is not an image's.
    NotAnImage,
    /// Zero bytes.
    EmptyFile,
    /// Cannot be opened (permissions, vanished).
    Unreadable(String),
    /// Its header does not decode as an image, or its pixels do not (found while loading).
    Corrupt(String),
    /// A class folder without a single usable image.
    EmptyClass,
    /// A CSV row naming a file that does not exist.
    MissingFile,
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProblemKind::NotAnImage => write!(f, "not an image file"),
            ProblemKind::EmptyFile => write!(f, "empty file (0 bytes)"),
            ProblemKind::Unreadable(e) => write!(f, "unreadable: {e}"),
            ProblemKind::Corrupt(e) => write!(f, "corrupt image: {e}"),
            ProblemKind::EmptyClass => write!(f, "class folder has no usable images"),
            ProblemKind::MissingFile => write!(f, "listed in the CSV but missing"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: PathBuf,
    pub kind: ProblemKind,
}

/// Bad files found while scanning (and, later, while decoding).
#[derive(Debug, Clone, Default)]
pub struct Problems(pub Vec<Problem>);

impl Problems {
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn push(&mut self, path: PathBuf, kind: ProblemKind) {
        self.0.push(Problem { path, kind });
    }
    /// One line per problem: `path: what`.
    pub fn report(&self) -> String {
        self.0
            .iter()
            .map(|p| format!("  {}: {}", p.path.display(), p.kind))
            .collect::<Vec<_>>()
            .join("\n")
    }
    /// The one-line warning printed when bad files are skipped.
    pub fn summary(&self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
        for p in &self.0 {
            let key = match p.kind {
                ProblemKind::NotAnImage => "non-image",
                ProblemKind::EmptyFile => "empty",
                ProblemKind::Unreadable(_) => "unreadable",
                ProblemKind::Corrupt(_) => "corrupt",
                ProblemKind::EmptyClass => "empty class folder",
                ProblemKind::MissingFile => "missing",
            };
            *counts.entry(key).or_default() += 1;
        }
        let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
        Some(format!(
            "warning: skipped {} bad file(s) ({}); first: {}: {}",
            self.0.len(),
            parts.join(", "),
            self.0[0].path.display(),
            self.0[0].kind
        ))
    }
}

/// Samples, class names and the problems met on the way.
#[derive(Debug, Clone)]
pub struct ImageSet {
    pub root: PathBuf,
    pub classes: Vec<String>,
    pub samples: Vec<Sample>,
    pub problems: Problems,
    pub multi_label: bool,
}

fn is_image_name(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// Cheap checks that catch most bad files before training: size, permissions, image header.
/// Pixel data is only checked when decoded (the loader counts those failures too).
pub fn check_file(path: &Path) -> std::result::Result<(), ProblemKind> {
    let meta = std::fs::metadata(path).map_err(|e| ProblemKind::Unreadable(e.to_string()))?;
    if meta.len() == 0 {
        return Err(ProblemKind::EmptyFile);
    }
    let file = std::fs::File::open(path).map_err(|e| ProblemKind::Unreadable(e.to_string()))?;
    let reader = image::ImageReader::new(std::io::BufReader::new(file))
        .with_guessed_format()
        .map_err(|e| ProblemKind::Unreadable(e.to_string()))?;
    if reader.format().is_none() {
        return Err(ProblemKind::Corrupt("not a known image format".into()));
    }
    match reader.into_dimensions() {
        Ok((w, h)) if w > 0 && h > 0 => Ok(()),
        Ok(_) => Err(ProblemKind::Corrupt("image has no pixels".into())),
        Err(e) => Err(ProblemKind::Corrupt(e.to_string())),
    }
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| DataError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        paths.push(entry.path());
    }
    paths.sort();
    Ok(paths)
}

impl ImageSet {
    /// Scans `root/<class>/<image>`. Bad files are recorded in `problems` and left out.
    pub fn from_folder(root: &Path) -> Result<Self> {
        if !root.is_dir() {
            return Err(DataError::MissingRoot {
                path: root.to_path_buf(),
            });
        }
        let mut classes = Vec::new();
        let mut samples = Vec::new();
        let mut problems = Problems::default();
        for entry in read_dir_sorted(root)? {
            if !entry.is_dir() {
                continue;
            }
            let name = entry
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if name.starts_with('.') {
                continue;
            }
            let class = classes.len();
            classes.push(name);
            let files = match read_dir_sorted(&entry) {
                Ok(f) => f,
                Err(DataError::Io { source, .. }) => {
                    problems.push(entry.clone(), ProblemKind::Unreadable(source.to_string()));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let before = samples.len();
            for file in files {
                if file.is_dir() {
                    continue;
                }
                if !is_image_name(&file) {
                    problems.push(file, ProblemKind::NotAnImage);
                    continue;
                }
                match check_file(&file) {
                    Ok(()) => samples.push(Sample {
                        path: file,
                        target: Target::Class(class),
                    }),
                    Err(kind) => problems.push(file, kind),
                }
            }
            if samples.len() == before {
                problems.push(entry.clone(), ProblemKind::EmptyClass);
            }
        }
        if classes.is_empty() {
            return Err(DataError::Empty {
                path: root.to_path_buf(),
                reason: "no class sub-folders (expected root/<class>/<image>)".into(),
            });
        }
        if samples.is_empty() {
            // Class folders that hold folders of images: a layout one level deeper than this
            // call reads (train/ and val/ of a training set, or only train/).
            let split = |name: &str| classes.iter().any(|c| c == name);
            let reason = if split("train") && split("val") {
                format!(
                    "it holds train/ and val/, each with class folders: give {} (or {}) to \
                     read one part; training takes the folder itself",
                    root.join("val").display(),
                    root.join("train").display()
                )
            } else if split("train") || split("val") {
                let part = if split("train") { "train" } else { "val" };
                format!(
                    "it holds only {part}/ with class folders: train on {} (its validation \
                     images split off by a fraction), or add the other part beside it",
                    root.join(part).display()
                )
            } else {
                format!("{} class folder(s) but no readable image", classes.len())
            };
            return Err(DataError::Empty {
                path: root.to_path_buf(),
                reason,
            });
        }
        Ok(Self {
            root: root.to_path_buf(),
            classes,
            samples,
            problems,
            multi_label: false,
        })
    }

    /// Reads a multi-label CSV `path,label1|label2|...`. A first row whose path is not a file
    /// is taken as a header. Paths are relative to `images` (default: the CSV's folder).
    pub fn from_csv(csv: &Path, images: Option<&Path>) -> Result<Self> {
        let text = std::fs::read_to_string(csv).map_err(|source| DataError::Io {
            path: csv.to_path_buf(),
            source,
        })?;
        let base = images
            .map(Path::to_path_buf)
            .or_else(|| csv.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        let mut rows = Vec::new();
        let mut labels = BTreeSet::new();
        let mut problems = Problems::default();
        // RFC 4180 fields (quoted paths with commas, doubled quotes); rows may have any number
        // of fields, the first two are used.
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .trim(csv::Trim::All)
            .from_reader(text.as_bytes());
        for (i, record) in reader.records().enumerate() {
            let record = record.map_err(|e| DataError::Labels {
                path: csv.to_path_buf(),
                line: e.position().map_or(i + 1, |p| p.line() as usize),
                reason: e.to_string(),
            })?;
            if record.iter().all(str::is_empty) {
                continue;
            }
            let file = record.get(0).unwrap_or("");
            let label_field = record.get(1).unwrap_or("");
            let line = record.position().map_or(i + 1, |p| p.line() as usize);
            let path = base.join(file);
            if i == 0 && !path.is_file() {
                continue; // header row
            }
            if file.is_empty() {
                return Err(DataError::Labels {
                    path: csv.to_path_buf(),
                    line,
                    reason: "empty path".into(),
                });
            }
            let row_labels: Vec<String> = label_field
                .split('|')
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.eq_ignore_ascii_case("No Finding"))
                .map(str::to_string)
                .collect();
            if !path.exists() {
                problems.push(path, ProblemKind::MissingFile);
                continue;
            }
            if let Err(kind) = check_file(&path) {
                problems.push(path, kind);
                continue;
            }
            labels.extend(row_labels.iter().cloned());
            rows.push((path, row_labels));
        }
        let classes: Vec<String> = labels.into_iter().collect();
        let index: BTreeMap<&str, usize> = classes
            .iter()
            .enumerate()
            .map(|(i, c)| (c.as_str(), i))
            .collect();
        let samples: Vec<Sample> = rows
            .into_iter()
            .map(|(path, ls)| {
                let mut idx: Vec<usize> = ls
                    .iter()
                    .filter_map(|l| index.get(l.as_str()).copied())
                    .collect();
                idx.sort_unstable();
                idx.dedup();
                Sample {
                    path,
                    target: Target::Multi(idx),
                }
            })
            .collect();
        if samples.is_empty() {
            return Err(DataError::Empty {
                path: csv.to_path_buf(),
                reason: "no row names a readable image".into(),
            });
        }
        Ok(Self {
            root: base,
            classes,
            samples,
            problems,
            multi_label: true,
        })
    }

    /// Fails in strict mode when any bad file was found.
    pub fn strict(self) -> Result<Self> {
        if self.problems.is_empty() {
            Ok(self)
        } else {
            Err(DataError::BadFiles {
                count: self.problems.len(),
                report: self.problems.report(),
            })
        }
    }

    /// Fails unless there are at least two classes (single-label training needs them).
    pub fn require_classes(&self, min: usize) -> Result<()> {
        if self.classes.len() < min {
            return Err(DataError::TooFewClasses {
                path: self.root.clone(),
                count: self.classes.len(),
                names: self.classes.join(", "),
            });
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Samples per class (multi-label: per label).
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes.len()];
        for s in &self.samples {
            match &s.target {
                Target::Class(c) => counts[*c] += 1,
                Target::Multi(ls) => ls.iter().for_each(|l| counts[*l] += 1),
            }
        }
        counts
    }

    /// A seeded split stratified by class: `fraction` of each class (at least one image of
    /// every class with two or more) goes to the second set. Multi-label sets are split by
    /// their first label (no label counts as its own stratum).
    pub fn split(self, fraction: f64, seed: u64) -> Result<(Self, Self)> {
        if !(0.0..1.0).contains(&fraction) || fraction == 0.0 {
            return Err(DataError::InvalidArgument(format!(
                "validation fraction {fraction} must be in (0, 1)"
            )));
        }
        let mut strata: BTreeMap<Option<usize>, Vec<Sample>> = BTreeMap::new();
        for s in self.samples {
            let key = match &s.target {
                Target::Class(c) => Some(*c),
                Target::Multi(ls) => ls.first().copied(),
            };
            strata.entry(key).or_default().push(s);
        }
        let mut rng = SplitMix64::new(seed ^ 0x5EED_5711);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for (_, mut group) in strata {
            rng.shuffle(&mut group);
            let n = group.len();
            let mut take = (n as f64 * fraction).round() as usize;
            if n >= 2 {
                take = take.clamp(1, n - 1);
            } else {
                take = 0;
            }
            let rest = group.split_off(take);
            b.extend(group);
            a.extend(rest);
        }
        a.sort_by(|x, y| x.path.cmp(&y.path));
        b.sort_by(|x, y| x.path.cmp(&y.path));
        let make = |samples| Self {
            root: self.root.clone(),
            classes: self.classes.clone(),
            samples,
            problems: Problems::default(),
            multi_label: self.multi_label,
        };
        let mut first = make(a);
        first.problems = self.problems;
        Ok((first, make(b)))
    }
}

/// Whether `root` holds `train/` and `val/` folders: its validation set is then `val/`, and
/// [`train_val`] splits nothing.
pub fn has_train_val(root: &Path) -> bool {
    root.join("train").is_dir() && root.join("val").is_dir()
}

/// Training and validation sets from `root`: `root/train` + `root/val` when both exist
/// ([`has_train_val`]), otherwise one folder split by `val_fraction` (stratified, seeded).
pub fn train_val(root: &Path, val_fraction: f64, seed: u64) -> Result<(ImageSet, ImageSet)> {
    let (train, val) = (root.join("train"), root.join("val"));
    if has_train_val(root) {
        let t = ImageSet::from_folder(&train)?;
        let v = ImageSet::from_folder(&val)?;
        if t.classes != v.classes {
            return Err(DataError::InvalidArgument(format!(
                "train/ and val/ have different classes: [{}] vs [{}]",
                t.classes.join(", "),
                v.classes.join(", ")
            )));
        }
        Ok((t, v))
    } else {
        ImageSet::from_folder(root)?.split(val_fraction, seed)
    }
}
