//! A model over a folder of images, streamed in batches through the loader (never the whole
//! folder in memory): `hearth eval` (accuracy, per-class precision and recall, confusion matrix)
//! on class folders, and `hearth predict --data` (top-k per image) on any folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use hearth_datasets::folder::{IMAGE_EXTENSIONS, check_file};
use hearth_datasets::{
    ImageSet, Loader, LoaderConfig, Pipeline, Problems, Sample, Target, Transform,
};
use hearth_models::{Classifier, Preprocessing};

use crate::{HearthError, Result};

/// The loader's transform for `preprocessing` (resize the shorter side, center crop). The
/// loader normalises with ImageNet's mean and std, which is what every Hearth model file
/// records; another normalisation is refused rather than silently ignored.
fn pipeline(p: &Preprocessing) -> Result<Pipeline> {
    let imagenet = Preprocessing::eval(p.crop);
    if p.mean != imagenet.mean || p.std != imagenet.std {
        return Err(HearthError::InvalidArgument(format!(
            "the model was trained with mean {:?} / std {:?}; folder evaluation supports \
             ImageNet's normalisation only",
            p.mean, p.std
        )));
    }
    Ok(Pipeline::new(
        vec![Transform::Resize(p.resize), Transform::CenterCrop(p.crop)],
        p.crop,
    )?)
}

fn loader(set: ImageSet, p: &Preprocessing, batch: usize, workers: usize) -> Result<Loader> {
    if batch == 0 || workers == 0 {
        return Err(HearthError::InvalidArgument(format!(
            "{}: must be at least 1",
            if batch == 0 {
                "`batch_size` 0"
            } else {
                "0 decoding workers"
            }
        )));
    }
    Ok(Loader::new(
        set,
        pipeline(p)?,
        LoaderConfig::new(batch)
            .with_workers(workers)
            .with_shuffle(false)
            .with_pad(false),
    )?)
}

/// Row-major `[n, k]` values of a tensor.
fn rows(t: Tensor<2>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| HearthError::Training(format!("reading outputs: {e:?}")))
}

/// Precision, recall and support of one class.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassStats {
    pub name: String,
    /// `None` when nothing was predicted as this class.
    pub precision: Option<f64>,
    /// `None` when the folder has no image of this class.
    pub recall: Option<f64>,
    pub support: usize,
}

/// What `hearth eval` measures.
#[derive(Debug, Clone)]
pub struct EvalReport {
    pub images: usize,
    /// Percent correct.
    pub accuracy: f64,
    pub classes: Vec<ClassStats>,
    /// `confusion[true][predicted]` counts, in the model's class order.
    pub confusion: Vec<Vec<usize>>,
    /// Files left out (unreadable, corrupt), with their paths.
    pub problems: Problems,
}

/// Evaluates `model` on class folders under `data`. Folder names are matched to the model's
/// `class_names`; without names, the sorted folders must be as many as the model's classes.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &Classifier,
    class_names: Option<&[String]>,
    data: &Path,
    preprocessing: &Preprocessing,
    batch: usize,
    workers: usize,
    device: &Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EvalReport> {
    let set = ImageSet::from_folder(data)?;
    let k = model.num_classes();
    let names: Vec<String> = match class_names {
        Some(n) => n.to_vec(),
        None if set.classes.len() == k => set.classes.clone(),
        None => {
            return Err(HearthError::InvalidArgument(format!(
                "{} has {} class folders but the model has {k} outputs and no class names",
                data.display(),
                set.classes.len()
            )));
        }
    };
    // Folder class index -> model output index, by name.
    let mut to_model = Vec::with_capacity(set.classes.len());
    for c in &set.classes {
        let i = names.iter().position(|n| n == c).ok_or_else(|| {
            HearthError::InvalidArgument(format!(
                "class folder '{c}' in {} is not one of the model's classes ({})",
                data.display(),
                names.join(", ")
            ))
        })?;
        to_model.push(i);
    }
    let problems = set.problems.clone();
    let total = set.len();
    let truth: Vec<usize> = set
        .samples
        .iter()
        .map(|s| match s.target {
            Target::Class(c) => to_model[c],
            Target::Multi(_) => 0,
        })
        .collect();
    let loader = loader(set, preprocessing, batch, workers)?;
    let mut confusion = vec![vec![0usize; k]; k];
    let mut seen = vec![false; total];
    let mut done = 0;
    for b in loader.epoch(0, device) {
        let b = b?;
        let n = b.indices.len();
        let logits = rows(model.forward(b.images))?;
        for (row, &index) in b.indices.iter().enumerate() {
            // A file that failed to decode mid-stream was replaced by the next one: count each
            // image once.
            if std::mem::replace(&mut seen[index], true) {
                continue;
            }
            let scores = &logits[row * k..(row + 1) * k];
            let predicted = argmax(scores);
            confusion[truth[index]][predicted] += 1;
        }
        done += n;
        progress(done.min(total), total);
    }
    let mut problems = problems;
    problems.0.extend(loader.decode_problems());
    let counted: usize = confusion.iter().flatten().sum();
    if counted == 0 {
        return Err(HearthError::InvalidArgument(format!(
            "no image of {} could be evaluated",
            data.display()
        )));
    }
    let correct: usize = (0..k).map(|i| confusion[i][i]).sum();
    let classes = (0..k)
        .map(|c| {
            let support: usize = confusion[c].iter().sum();
            let predicted: usize = confusion.iter().map(|r| r[c]).sum();
            let tp = confusion[c][c] as f64;
            ClassStats {
                name: names[c].clone(),
                precision: (predicted > 0).then(|| tp / predicted as f64),
                recall: (support > 0).then(|| tp / support as f64),
                support,
            }
        })
        .collect();
    Ok(EvalReport {
        images: counted,
        accuracy: 100.0 * correct as f64 / counted as f64,
        classes,
        confusion,
        problems,
    })
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    crate::train::run_dir::write_atomic(path, text)
}

/// Writes `per_class.csv`, `confusion.csv` and (with the `plots` feature) `confusion.png`
/// into `out`; returns the paths written.
pub fn write_report(report: &EvalReport, out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(|source| HearthError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    let opt = |v: Option<f64>| v.map(|x| format!("{x:.6}")).unwrap_or_default();
    let mut per_class = String::from("class,precision,recall,support\n");
    for c in &report.classes {
        per_class.push_str(&format!(
            "{},{},{},{}\n",
            csv_field(&c.name),
            opt(c.precision),
            opt(c.recall),
            c.support
        ));
    }
    let mut confusion = String::from("true\\predicted");
    for c in &report.classes {
        confusion.push(',');
        confusion.push_str(&csv_field(&c.name));
    }
    confusion.push('\n');
    for (c, row) in report.classes.iter().zip(&report.confusion) {
        confusion.push_str(&csv_field(&c.name));
        for n in row {
            confusion.push_str(&format!(",{n}"));
        }
        confusion.push('\n');
    }
    let csvs = [out.join("per_class.csv"), out.join("confusion.csv")];
    write_text(&csvs[0], &per_class)?;
    write_text(&csvs[1], &confusion)?;
    #[cfg(feature = "plots")]
    let png = {
        let png = out.join("confusion.png");
        let names: Vec<&str> = report.classes.iter().map(|c| c.name.as_str()).collect();
        crate::plot::plot_confusion(&report.confusion, &names, &png)?;
        Some(png)
    };
    #[cfg(not(feature = "plots"))]
    let png = None;
    Ok(csvs.into_iter().chain(png).collect())
}

/// A CSV field, quoted when it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Every image file under `dir` (recursively, sorted); unreadable or non-image files are
/// counted in `problems`.
fn image_files(dir: &Path) -> Result<(Vec<PathBuf>, Problems)> {
    let mut files = Vec::new();
    let mut problems = Problems::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|source| HearthError::Read {
            path: d.clone(),
            source,
        })?;
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let image = p
                .extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| IMAGE_EXTENSIONS.contains(&x.to_ascii_lowercase().as_str()));
            if !image {
                continue;
            }
            match check_file(&p) {
                Ok(()) => files.push(p),
                Err(kind) => problems.push(p, kind),
            }
        }
    }
    files.sort();
    Ok((files, problems))
}

/// What [`predict_folder`] did: the images written, the files left out, and with a low
/// precision its comparison with f32.
#[derive(Debug)]
pub struct FolderPredictions {
    pub written: usize,
    pub problems: Problems,
    pub gap: Option<crate::predict::PrecisionGap>,
}

/// `files` under `data` as a set with one placeholder class (predictions need no labels).
fn unlabelled(data: &Path, files: &[std::path::PathBuf]) -> ImageSet {
    ImageSet {
        root: data.to_path_buf(),
        classes: vec!["?".into()],
        samples: files
            .iter()
            .map(|p| Sample {
                path: p.clone(),
                target: Target::Class(0),
            })
            .collect(),
        problems: Problems::default(),
        multi_label: false,
    }
}

/// Streams every image under `data` through `model` in batches and writes `out` as CSV:
/// `path,top1,p1,...` up to `top` classes per image. With `dtype` bf16 or f16 the model
/// computes in it (`hearth predict --precision`; f32 weights), the CSV holds those
/// predictions, and every batch also runs in f32 for the comparison the result carries.
#[allow(clippy::too_many_arguments)]
pub fn predict_folder(
    model: &Classifier,
    class_names: Option<&[String]>,
    data: &Path,
    preprocessing: &Preprocessing,
    top: usize,
    batch: usize,
    workers: usize,
    device: &Device,
    dtype: burn::tensor::FloatDType,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<FolderPredictions> {
    let low = dtype != burn::tensor::FloatDType::F32;
    let mut gap = low.then(|| crate::predict::PrecisionGap::new(dtype));
    let (files, mut problems) = image_files(data)?;
    if files.is_empty() {
        return Err(HearthError::InvalidArgument(format!(
            "no readable image under {}",
            data.display()
        )));
    }
    let total = files.len();
    let loader = loader(unlabelled(data, &files), preprocessing, batch, workers)?;
    let k = model.num_classes();
    let top = top.clamp(1, k);
    let name = |i: usize| {
        class_names
            .and_then(|n| n.get(i).cloned())
            .unwrap_or_else(|| i.to_string())
    };
    let tmp = out.with_extension("csv.tmp");
    let file = std::fs::File::create(&tmp).map_err(|source| HearthError::Write {
        path: tmp.clone(),
        source,
    })?;
    let mut w = std::io::BufWriter::new(file);
    let werr = |source| HearthError::Write {
        path: out.to_path_buf(),
        source,
    };
    let mut header = String::from("path");
    for r in 1..=top {
        header.push_str(&format!(",class{r},prob{r}"));
    }
    writeln!(w, "{header}").map_err(werr)?;
    let mut seen = vec![false; total];
    let mut written = 0;
    let mut done = 0;
    for b in loader.epoch(0, device) {
        let b = b?;
        let probs = match &mut gap {
            None => rows(model.predict(b.images))?,
            Some(gap) => {
                let t = std::time::Instant::now();
                let reference = rows(model.forward(b.images.clone()))?;
                gap.f32_secs += t.elapsed().as_secs_f64();
                let t = std::time::Instant::now();
                let logits = model.forward_in(b.images, dtype);
                let values = rows(logits.clone())?;
                gap.low_secs += t.elapsed().as_secs_f64();
                gap.add(&values, &reference, k);
                rows(model.head_activation().probabilities(logits))?
            }
        };
        for (row, &index) in b.indices.iter().enumerate() {
            if std::mem::replace(&mut seen[index], true) {
                continue;
            }
            let ranked = crate::predict::top_k(&probs[row * k..(row + 1) * k], k, top);
            let mut line = csv_field(&files[index].display().to_string());
            for (c, p) in &ranked[0] {
                line.push_str(&format!(",{},{p:.6}", csv_field(&name(*c))));
            }
            writeln!(w, "{line}").map_err(werr)?;
            written += 1;
        }
        done += b.indices.len();
        progress(done.min(total), total);
    }
    w.flush().map_err(werr)?;
    drop(w);
    std::fs::rename(&tmp, out).map_err(werr)?;
    problems.0.extend(loader.decode_problems());
    Ok(FolderPredictions {
        written,
        problems,
        gap,
    })
}
