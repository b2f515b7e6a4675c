//! `metrics.png`: train and validation loss and accuracy per epoch, and for elastic runs the
//! number of workers over time (plotters, bitmap backend).
//! Text uses DejaVu Sans from the system when present; without it the plot has no labels.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::{HearthError, Result};

mod confusion;

pub use confusion::plot_confusion;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> bool {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        for path in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

type Rows = BTreeMap<usize, BTreeMap<String, f64>>;

fn series(rows: &Rows, key: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|(e, r)| r.get(key).map(|v| (*e as f64, *v)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

/// An epoch axis label: the epoch at a whole number, nothing between epochs.
fn epoch_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{}", x.round() as i64)
    } else {
        String::new()
    }
}

/// Writes the plot; an error (no epochs, unwritable file) is returned, never a panic.
/// Extra series: any `<prefix>_accuracy` columns besides train/val (per-rank curves).
pub fn plot_metrics(rows: &Rows, out: &Path) -> Result<()> {
    plot_metrics_world(rows, &[], out)
}

/// Distributed runs: each rank's training curve of `metric` (`train_accuracy_rank{r}`), by rank.
fn rank_series(rows: &Rows, metric: &str) -> Vec<(usize, Vec<(f64, f64)>)> {
    let prefix = format!("train_{metric}_rank");
    let mut rank_columns: Vec<(usize, String)> = rows
        .values()
        .flat_map(|r| r.keys())
        .filter_map(|k| Some((k.strip_prefix(&prefix)?.parse::<usize>().ok()?, k.clone())))
        .collect();
    rank_columns.sort();
    rank_columns.dedup();
    rank_columns
        .iter()
        .map(|(r, k)| (*r, series(rows, k)))
        .collect()
}

/// The value axis for `points`: from 0 (or below, for negative values) to 5% above the
/// highest; 0..1 when there is none.
fn y_range<'a>(points: impl Iterator<Item = &'a (f64, f64)>) -> (f64, f64) {
    let (lo, hi) = points.fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if lo > hi {
        (0.0, 1.0)
    } else {
        (lo.min(0.0), hi * 1.05 + 1e-9)
    }
}

/// [`plot_metrics`] with a third panel, the number of workers over time (an elastic run's
/// `world` points: seconds, workers), when `world` is not empty.
pub fn plot_metrics_world(rows: &Rows, world: &[(f64, f64)], out: &Path) -> Result<()> {
    let err = |e: String| HearthError::Plot {
        path: out.to_path_buf(),
        reason: e,
    };
    if rows.is_empty() {
        return Err(err("no epochs to plot".into()));
    }
    let text = register_font();
    let width = if world.is_empty() { 1100 } else { 1650 };
    let root = BitMapBackend::new(out, (width, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (left, rest) = root.split_horizontally(550);
    let (right, third) = rest.split_horizontally(550);
    if !world.is_empty() {
        draw_worlds(&third, &[("workers", world)], text).map_err(err)?;
    }
    let max_epoch = rows.keys().copied().max().unwrap_or(1).max(2) as f64;
    for (area, metric, title) in [
        (&left, "loss", "loss"),
        (&right, "accuracy", "accuracy (%)"),
    ] {
        let train = series(rows, &format!("train_{metric}"));
        let val = series(rows, &format!("val_{metric}"));
        let per_rank = rank_series(rows, metric);
        let (lo, hi) = y_range(
            train
                .iter()
                .chain(&val)
                .chain(per_rank.iter().flat_map(|(_, s)| s)),
        );
        let mut builder = ChartBuilder::on(area);
        builder.margin(12);
        if text {
            builder
                .caption(title, ("sans-serif", 22))
                .x_label_area_size(35)
                .y_label_area_size(55);
        }
        let mut chart = builder
            .build_cartesian_2d(1f64..max_epoch, lo..hi)
            .map_err(|e| err(e.to_string()))?;
        if text {
            chart
                .configure_mesh()
                .x_desc("epoch")
                // One tick per epoch at most, labelled only where it falls on a whole epoch.
                .x_labels((max_epoch as usize).clamp(2, 12))
                .x_label_formatter(&epoch_label)
                .draw()
                .map_err(|e| err(e.to_string()))?;
        }
        for (points, colour, label) in [(train, BLUE, "train"), (val, RED, "validation")] {
            let s = chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?;
            if text {
                s.label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
            }
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 3, colour.filled())),
                )
                .map_err(|e| err(e.to_string()))?;
        }
        for (i, (rank, points)) in per_rank.into_iter().enumerate() {
            let colour = Palette99::pick(i + 2).to_rgba();
            let s = chart
                .draw_series(LineSeries::new(points, colour.stroke_width(1)))
                .map_err(|e| err(e.to_string()))?;
            if text {
                s.label(format!("train, rank {rank}"))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
            }
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(e.to_string()))?;
        }
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// `world.png` of an elastic run: the number of workers over time (one point per step, drawn
/// as steps: the size holds until the next point). Several runs can share one chart.
pub fn plot_world(points: &[(f64, f64)], out: &Path) -> Result<()> {
    plot_worlds(&[("workers", points)], out)
}

/// [`plot_world`] for several labelled runs (the elastic benchmark's fixed and churned runs).
pub fn plot_worlds(runs: &[(&str, &[(f64, f64)])], out: &Path) -> Result<()> {
    let err = |e: String| HearthError::Plot {
        path: out.to_path_buf(),
        reason: e,
    };
    let all = || runs.iter().flat_map(|(_, p)| p.iter());
    if all().next().is_none() {
        return Err(err("no steps to plot".into()));
    }
    let text = register_font();
    let root = BitMapBackend::new(out, (900, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    draw_worlds(&root, runs, text).map_err(err)?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// The workers-over-time chart on `area` (drawn as steps: a size holds until the next point).
fn draw_worlds<A: DrawingBackend>(
    area: &DrawingArea<A, plotters::coord::Shift>,
    runs: &[(&str, &[(f64, f64)])],
    text: bool,
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<A::ErrorType>| e.to_string();
    let all = || runs.iter().flat_map(|(_, p)| p.iter());
    let t_max = all().map(|p| p.0).fold(1.0f64, f64::max);
    let w_max = all().map(|p| p.1).fold(1.0f64, f64::max);
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder
            .caption("workers over time", ("sans-serif", 22))
            .x_label_area_size(35)
            .y_label_area_size(45);
    }
    let mut chart = builder
        .build_cartesian_2d(0f64..t_max * 1.02, 0f64..w_max + 1.0)
        .map_err(err)?;
    if text {
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc("workers")
            .draw()
            .map_err(err)?;
    }
    for (i, (label, points)) in runs.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let mut stepped = Vec::with_capacity(points.len() * 2);
        for (j, p) in points.iter().enumerate() {
            if j > 0 {
                stepped.push((p.0, points[j - 1].1));
            }
            stepped.push(*p);
        }
        let s = chart
            .draw_series(LineSeries::new(stepped, colour.stroke_width(2)))
            .map_err(err)?;
        if text {
            let label = label.to_string();
            s.label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
        }
    }
    if text && runs.len() > 1 {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

/// Labelled curves on one chart (x, y points each; benchmarks: validation accuracy against
/// time for several training modes).
pub fn plot_curves(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    runs: &[(String, Vec<(f64, f64)>)],
    out: &Path,
) -> Result<()> {
    let err = |e: String| HearthError::Plot {
        path: out.to_path_buf(),
        reason: e,
    };
    let all = || {
        runs.iter()
            .flat_map(|(_, p)| p.iter())
            .filter(|p| p.1.is_finite())
    };
    if all().next().is_none() {
        return Err(err("no points to plot".into()));
    }
    let x_max = all().map(|p| p.0).fold(1e-9f64, f64::max);
    let (y_lo, y_hi) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let text = register_font();
    let root = BitMapBackend::new(out, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(12);
    if text {
        builder
            .caption(title, ("sans-serif", 22))
            .x_label_area_size(35)
            .y_label_area_size(50);
    }
    let mut chart = builder
        .build_cartesian_2d(0f64..x_max * 1.02, y_lo.min(0.0)..y_hi * 1.05 + 1e-9)
        .map_err(|e| err(e.to_string()))?;
    if text {
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    for (i, (label, points)) in runs.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = points.iter().copied().filter(|p| p.1.is_finite()).collect();
        let s = chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?;
        if text {
            s.label(label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// One panel of the scaling plot: modelled curves (hosts, efficiency) and measured points.
pub struct ScalingPanel {
    pub title: String,
    /// Modelled curves: label, (hosts, efficiency) points. Curves whose labels start alike up
    /// to the first comma share a colour; a label ending in "overlap" is dashed, one naming
    /// "ranks/host" thin.
    pub curves: Vec<(String, Vec<(f64, f64)>)>,
    /// Measured points: label, (hosts, efficiency).
    pub measured: Vec<(String, Vec<(f64, f64)>)>,
    /// Reference points drawn as crosses (a published figure): label, (hosts, efficiency).
    pub references: Vec<(String, (f64, f64))>,
}

/// Scaling efficiency against hosts on a log axis, one panel per [`ScalingPanel`] side by
/// side (the scaling benchmark's plot).
pub fn plot_scaling(panels: &[ScalingPanel], out: &Path) -> Result<()> {
    let err = |e: String| HearthError::Plot {
        path: out.to_path_buf(),
        reason: e,
    };
    let points = || {
        panels.iter().flat_map(|p| {
            p.curves
                .iter()
                .chain(&p.measured)
                .flat_map(|(_, v)| v.iter().copied())
                .chain(p.references.iter().map(|r| r.1))
        })
    };
    if panels.is_empty() || points().next().is_none() {
        return Err(err("no points to plot".into()));
    }
    let x_max = points().map(|p| p.0).fold(2.0f64, f64::max);
    let text = register_font();
    let root = BitMapBackend::new(out, (700 * panels.len() as u32, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((1, panels.len()));
    for (panel, area) in panels.iter().zip(&areas) {
        draw_scaling(area, panel, x_max, text).map_err(err)?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

fn draw_scaling<A: DrawingBackend>(
    area: &DrawingArea<A, plotters::coord::Shift>,
    panel: &ScalingPanel,
    x_max: f64,
    text: bool,
) -> std::result::Result<(), String> {
    let err = |e: DrawingAreaErrorKind<A::ErrorType>| e.to_string();
    let mut builder = ChartBuilder::on(area);
    builder.margin(14);
    if text {
        builder
            .caption(&panel.title, ("sans-serif", 18))
            .x_label_area_size(35)
            .y_label_area_size(50);
    }
    let mut chart = builder
        .build_cartesian_2d((1f64..x_max * 1.2).log_scale(), 0f64..1.05)
        .map_err(err)?;
    if text {
        chart
            .configure_mesh()
            .x_desc("hosts")
            .y_desc("scaling efficiency")
            .x_label_formatter(&|x| format!("{}", x.round() as i64))
            .draw()
            .map_err(err)?;
    }
    let mut colour_of = std::collections::BTreeMap::<String, RGBAColor>::new();
    let mut colour = |label: &str| {
        // The curves and points of one link share its colour.
        let key = label.split(',').next().unwrap_or(label).to_string();
        let next = colour_of.len();
        *colour_of
            .entry(key)
            .or_insert_with(|| Palette99::pick(next).to_rgba())
    };
    for (label, pts) in &panel.curves {
        let c = colour(label);
        let pts: Vec<(f64, f64)> = pts.iter().copied().filter(|p| p.1.is_finite()).collect();
        let width = if label.contains("ranks/host") { 1 } else { 2 };
        let series = if label.ends_with("overlap") {
            chart.draw_series(DashedLineSeries::new(pts, 6, 4, c.stroke_width(width)))
        } else {
            chart.draw_series(LineSeries::new(pts, c.stroke_width(width)))
        }
        .map_err(err)?;
        if text {
            series.label(label.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(width))
            });
        }
    }
    for (label, pts) in &panel.measured {
        let c = colour(label);
        let s = chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 5, c.filled())))
            .map_err(err)?;
        if text {
            s.label(label.clone())
                .legend(move |(x, y)| Circle::new((x + 9, y), 5, c.filled()));
        }
    }
    for (label, p) in &panel.references {
        let s = chart
            .draw_series(std::iter::once(Cross::new(*p, 7, BLACK.stroke_width(2))))
            .map_err(err)?;
        if text {
            s.label(label.clone())
                .legend(move |(x, y)| Cross::new((x + 9, y), 5, BLACK.stroke_width(2)));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scaling_plot_draws_curves_points_and_references_and_refuses_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("scaling.png");
        let panel = ScalingPanel {
            title: "ResNet-101".into(),
            curves: vec![
                ("1 Gbit/s".into(), vec![(2.0, 0.9), (512.0, 0.5)]),
                ("1 Gbit/s, overlap".into(), vec![(2.0, 0.95), (512.0, 0.7)]),
            ],
            measured: vec![("1 Gbit/s".into(), vec![(2.0, 0.88)])],
            references: vec![("Horovod".into(), (512.0, 0.9))],
        };
        plot_scaling(std::slice::from_ref(&panel), &out).unwrap();
        let img = image::open(&out).unwrap();
        assert_eq!((img.width(), img.height()), (700, 520));
        // Something besides the white background was drawn.
        let rgb = img.to_rgb8();
        assert!(rgb.pixels().any(|p| p.0 != [255, 255, 255]));
        let empty = ScalingPanel {
            curves: vec![],
            measured: vec![],
            references: vec![],
            ..panel
        };
        assert!(plot_scaling(&[empty], &out).is_err());
        assert!(plot_scaling(&[], &out).is_err());
    }

    #[test]
    fn the_epoch_axis_names_whole_epochs_only() {
        assert_eq!(epoch_label(&2.0), "2");
        assert_eq!(epoch_label(&12.0), "12");
        assert_eq!(epoch_label(&1.5), "");
        assert_eq!(epoch_label(&2.2), "");
    }

    #[test]
    fn writes_a_png_and_refuses_empty_tables() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = Rows::new();
        for e in 1..=3 {
            let mut r = BTreeMap::new();
            r.insert("train_loss".into(), 2.0 / e as f64);
            r.insert("val_loss".into(), 2.2 / e as f64);
            r.insert("train_accuracy".into(), 30.0 * e as f64);
            r.insert("val_accuracy".into(), 28.0 * e as f64);
            r.insert("train_accuracy_rank0".into(), 29.0 * e as f64);
            r.insert("train_accuracy_rank1".into(), 31.0 * e as f64);
            rows.insert(e, r);
        }
        let out = dir.path().join("m.png");
        plot_metrics(&rows, &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(plot_metrics(&Rows::new(), &out).is_err());
        let world = [(0.0, 2.0), (3.5, 3.0), (9.0, 2.0)];
        plot_metrics_world(&rows, &world, &out).unwrap();
        let png = image::open(&out).unwrap();
        assert_eq!(png.width(), 1650, "a third panel for the world size");
        let cm = dir.path().join("c.png");
        plot_confusion(&[vec![3, 1], vec![0, 4]], &["cat", "dog"], &cm).unwrap();
        assert_eq!(&std::fs::read(&cm).unwrap()[1..4], b"PNG");
        assert!(plot_confusion(&[vec![1]], &["a", "b"], &cm).is_err());
    }
}
