//! `confusion.png`: a confusion matrix as a heat map, labelled where the system has a font.

use std::path::Path;

use plotters::prelude::*;

use super::register_font;
use crate::{HearthError, Result};

/// `confusion.png`: the confusion matrix as a heat map (rows: true class, columns: predicted),
/// each cell shaded by its share of the row and labelled with its count when text is available.
pub fn plot_confusion(confusion: &[Vec<usize>], names: &[&str], out: &Path) -> Result<()> {
    let err = |e: String| HearthError::Plot {
        path: out.to_path_buf(),
        reason: e,
    };
    let k = confusion.len();
    if k == 0 || confusion.iter().any(|r| r.len() != k) || names.len() != k {
        return Err(err(format!("a {k}x{k} matrix with {} names", names.len())));
    }
    let text = register_font();
    let size = confusion_size(names);
    let root = BitMapBackend::new(out, size).into_drawing_area();
    draw_confusion(&root, confusion, names, text).map_err(err)
}

/// The picture's size: cells wide enough for the longest class name under its column.
fn confusion_size(names: &[&str]) -> (u32, u32) {
    let k = names.len() as u32;
    let longest = names.iter().map(|n| n.chars().count()).max().unwrap_or(1) as u32;
    let side = (120 + (7 * longest).clamp(48, 160) * k).clamp(300, 4000);
    (side + 60, side)
}

/// The confusion matrix on `root` (any plotters backend: the PNG, or SVG in the tests, whose
/// text can be read back): row t is the true class t from the top, column p the predicted
/// class p from the left, each labelled with its class name, each cell with its count.
fn draw_confusion<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    confusion: &[Vec<usize>],
    names: &[&str],
    text: bool,
) -> std::result::Result<(), String> {
    let err = |e: String| e;
    let k = confusion.len();
    let longest = names.iter().map(|n| n.chars().count()).max().unwrap_or(1) as u32;
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut builder = ChartBuilder::on(root);
    builder.margin(12);
    if text {
        builder
            .caption(
                "confusion (rows: true, columns: predicted)",
                ("sans-serif", 18),
            )
            .x_label_area_size(60)
            .y_label_area_size((7 * longest + 20).clamp(60, 240));
    }
    // Segmented axes: each class is a cell, labelled at its centre (a plain 0..k axis labels
    // the k + 1 cell edges).
    let mut chart = builder
        .build_cartesian_2d((0..k - 1).into_segmented(), (0..k - 1).into_segmented())
        .map_err(|e| err(e.to_string()))?;
    if text {
        let label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) => names.get(*i).map(|n| n.to_string()).unwrap_or_default(),
            _ => String::new(),
        };
        // Row t is drawn at y = k - 1 - t, so the first class is the top row.
        let row_label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) if *i < k => label(&SegmentValue::CenterOf(k - 1 - i)),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(k)
            .y_labels(k)
            .x_label_formatter(&label)
            .y_label_formatter(&row_label)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    let centred =
        ("sans-serif", 14)
            .into_text_style(root)
            .pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Center,
            ));
    for (t, row) in confusion.iter().enumerate() {
        let total = row.iter().sum::<usize>().max(1) as f64;
        for (p, &n) in row.iter().enumerate() {
            let share = n as f64 / total;
            let shade = (255.0 * (1.0 - share)) as u8;
            let y = k - 1 - t;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [
                        (SegmentValue::Exact(p), SegmentValue::Exact(y)),
                        (SegmentValue::Exact(p + 1), SegmentValue::Exact(y + 1)),
                    ],
                    RGBColor(shade, shade, 255).filled(),
                )))
                .map_err(|e| err(e.to_string()))?;
            if text {
                // Dark cells get white counts.
                let colour = if share > 0.5 { WHITE } else { BLACK };
                chart
                    .draw_series(std::iter::once(Text::new(
                        n.to_string(),
                        (SegmentValue::CenterOf(p), SegmentValue::CenterOf(y)),
                        centred.clone().color(&colour),
                    )))
                    .map_err(|e| err(e.to_string()))?;
            }
        }
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// [`plot_confusion`]'s picture as SVG text (tests read its labels back).
#[cfg(test)]
fn confusion_svg(confusion: &[Vec<usize>], names: &[&str]) -> std::result::Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, confusion_size(names)).into_drawing_area();
        draw_confusion(&root, confusion, names, register_font())?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::super::FONT_PATHS;
    use super::*;

    #[test]
    fn confusion_labels_name_true_rows_from_the_top_and_predicted_columns_from_the_left() {
        assert!(
            register_font(),
            "no DejaVu Sans in {FONT_PATHS:?}: the plots would have no labels (apt install \
             fonts-dejavu-core)"
        );
        let names = ["cat", "dog", "fox"];
        // Row t (true class), column p (predicted): counts 10*t + p + 1, all distinct.
        let m: Vec<Vec<usize>> = (0..3)
            .map(|t| (0..3).map(|p| 10 * t + p + 1).collect())
            .collect();
        let svg = confusion_svg(&m, &names).unwrap();
        // Each <text x=.. y=..>content</text>, as plotters writes them.
        let texts: Vec<(f64, f64, String)> = svg
            .split("<text")
            .skip(1)
            .filter_map(|t| {
                let attr = |name: &str| -> Option<f64> {
                    let at = t.find(&format!(" {name}=\""))? + name.len() + 3;
                    t[at..].split('"').next()?.parse().ok()
                };
                let body = t.split('>').nth(1)?.split('<').next()?.trim().to_string();
                Some((attr("x")?, attr("y")?, body))
            })
            .collect();
        let find = |s: &str| -> Vec<(f64, f64)> {
            texts
                .iter()
                .filter(|t| t.2 == s)
                .map(|t| (t.0, t.1))
                .collect()
        };
        // Every name appears twice: under its column and beside its row.
        for n in names {
            assert_eq!(find(n).len(), 2, "{n}: {texts:?}");
        }
        // The column labels (the lower of each pair) run left to right in class order, the
        // row labels (the leftmost) top to bottom.
        let column = |n: &str| {
            find(n)
                .into_iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap()
        };
        let row = |n: &str| {
            find(n)
                .into_iter()
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .unwrap()
        };
        assert!(column("cat").0 < column("dog").0 && column("dog").0 < column("fox").0);
        assert!(row("cat").1 < row("dog").1 && row("dog").1 < row("fox").1);
        // Each count sits in its row's and column's cell: under the column label's x, level
        // with the row label's y.
        for (t, tn) in names.iter().enumerate() {
            for (p, pn) in names.iter().enumerate() {
                let at = find(&(10 * t + p + 1).to_string());
                assert_eq!(at.len(), 1, "count of ({tn}, {pn})");
                let (x, y) = at[0];
                assert!((x - column(pn).0).abs() < 2.0, "({tn}, {pn}) at x {x}");
                assert!((y - row(tn).1).abs() < 2.0, "({tn}, {pn}) at y {y}");
            }
        }
    }

    #[test]
    fn confusion_maps_of_one_to_many_classes_are_drawn() {
        let dir = tempfile::tempdir().unwrap();
        for k in 1..=5usize {
            let m: Vec<Vec<usize>> = (0..k)
                .map(|t| (0..k).map(|p| usize::from(t == p) * 3 + p).collect())
                .collect();
            let names: Vec<String> = (0..k).map(|i| format!("class_{i}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let out = dir.path().join(format!("c{k}.png"));
            plot_confusion(&m, &names, &out).unwrap();
            assert!(out.is_file());
        }
        // A matrix and names that do not fit: an error, not a panic.
        assert!(plot_confusion(&[vec![1, 2]], &["a"], &dir.path().join("bad.png")).is_err());
    }
}
