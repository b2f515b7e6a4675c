//! Reading autotune's decision log (`HEARTH_AUTOTUNE_LOG`) back: each decision's kind, shapes,
//! winner and runner-up, and `hearth autotune-report`'s table of them.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use crate::{HearthError, Result};

/// What an autotune decision chose a kernel for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionKind {
    /// A convolution pass (forward, input or weight gradient, transposed).
    Convolution,
    /// A matrix product (Burn's, or one fused with element-wise work).
    MatrixProduct,
    /// One of Burn's reductions along an axis (`sum_dim`, `mean_dim`, `argmax`, ...) or of a
    /// whole tensor (`sum`): decided by rule unless `--autotune full`
    /// (`hearth_kernels::reduce_rules`).
    Reduction,
    /// Anything else: fusion's fused reductions (launched by rule unless `--autotune full`,
    /// `hearth_kernels::fused_reduce`).
    Other,
}

/// One autotune decision, as [`autotune_report`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// What kind of operation was tuned.
    pub kind: DecisionKind,
    /// What was tuned: the operation and its shapes, in words.
    pub what: String,
    /// The kernel autotune kept (cubecl's `fastest_index`).
    pub chosen: String,
    /// Its median time in seconds.
    pub seconds: f64,
    /// The fastest other candidate by median and its median time, if another ran: it can be
    /// faster than the chosen one, since cubecl ranks by its own estimate.
    pub runner_up: Option<(String, f64)>,
    /// Candidates that failed or could not run this shape.
    pub failed: usize,
}

/// Every decision in a `HEARTH_AUTOTUNE_LOG` file, in order. A line that is not a decision
/// (blank, or cubecl's own error object) is skipped; a line that is not JSON at all is an error
/// naming it.
pub fn read_decisions(path: &Path) -> Result<Vec<Decision>> {
    let text = std::fs::read_to_string(path).map_err(|e| HearthError::Read {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line).map_err(|e| HearthError::AutotuneLog {
            path: path.to_path_buf(),
            line: i + 1,
            reason: e.to_string(),
        })?;
        if let Some(d) = decision(&value) {
            out.push(d);
        }
    }
    Ok(out)
}

fn decision(v: &Value) -> Option<Decision> {
    let key = v.get("key")?;
    // (candidate index, short name, median seconds) of each candidate that ran.
    let mut measured: Vec<(Option<u64>, String, f64)> = Vec::new();
    let mut failed = 0;
    for r in v.get("results")?.as_array()? {
        match r.get("outcome").and_then(|o| o.get("Ok")) {
            Some(ok) => {
                let name = ok.get("name").and_then(Value::as_str).unwrap_or("?");
                let t = ok
                    .get("computation")
                    .and_then(|c| c.get("median"))
                    .and_then(duration)
                    .unwrap_or(f64::NAN);
                let index = ok.get("index").and_then(Value::as_u64);
                measured.push((index, short_name(name), t));
            }
            None => failed += 1,
        }
    }
    // The kernel cubecl keeps is `fastest_index`, by its own ranking (the adaptive scheduler
    // drops candidates after a few samples), which is not always the lowest median: on an H200
    // 14 of 98 decisions kept a kernel whose median was over 10% behind another's. Without an
    // index, the first candidate listed (cubecl lists its ranking in order).
    let pick = v
        .get("fastest_index")
        .and_then(Value::as_u64)
        .and_then(|i| measured.iter().position(|m| m.0 == Some(i)))
        .unwrap_or(0);
    if measured.is_empty() {
        return None;
    }
    let (_, chosen, median) = measured.remove(pick);
    measured.sort_by(|a, b| a.2.total_cmp(&b.2));
    let kind = if find_with(key, "kernel_size").is_some() {
        DecisionKind::Convolution
    } else if find_with(key, "matmul_key").is_some()
        || find_with(key, "definition").is_some_and(|d| {
            d.get("definition")
                .is_some_and(|m| m.get("m").is_some() && m.get("k").is_some())
        })
    {
        DecisionKind::MatrixProduct
    } else if key.get("accumulator_len").is_some() || key.get("Sum").is_some() {
        DecisionKind::Reduction
    } else {
        DecisionKind::Other
    };
    Some(Decision {
        kind,
        what: describe_key(key),
        chosen,
        seconds: if median.is_nan() {
            v.get("fastest_time").and_then(duration).unwrap_or(median)
        } else {
            median
        },
        runner_up: measured.into_iter().next().map(|(_, n, t)| (n, t)),
        failed,
    })
}

/// Seconds of a serialized `Duration` (`{"secs": s, "nanos": n}`).
fn duration(v: &Value) -> Option<f64> {
    let secs = v.get("secs")?.as_f64()?;
    let nanos = v.get("nanos")?.as_f64()?;
    Some(secs + nanos * 1e-9)
}

/// A kernel's name without module paths: `a::b::Conv<x::F32>` reads `Conv<F32>`.
fn short_name(name: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    for c in name.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
        } else {
            out.push_str(word.rsplit("::").next().unwrap_or(&word));
            word.clear();
            out.push(c);
        }
    }
    out.push_str(word.rsplit("::").next().unwrap_or(&word));
    out
}

/// The first object inside `v` (itself included) that has `field`.
fn find_with<'a>(v: &'a Value, field: &str) -> Option<&'a Value> {
    match v {
        Value::Object(m) if m.contains_key(field) => Some(v),
        Value::Object(m) => m.values().find_map(|x| find_with(x, field)),
        Value::Array(a) => a.iter().find_map(|x| find_with(x, field)),
        _ => None,
    }
}

fn list(v: Option<&Value>) -> String {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x {
                Value::Array(_) => list(Some(x)),
                _ => x.to_string(),
            })
            .collect::<Vec<_>>()
            .join("x"),
        Some(x) => x.to_string(),
        None => "?".into(),
    }
}

/// A key in words: convolutions by their geometry, anything else as compact JSON (what the
/// enum variant names the operation).
fn describe_key(key: &Value) -> String {
    if let Some(conv) = find_with(key, "kernel_size")
        && conv.get("in_channels").is_some()
    {
        let op = match key {
            Value::Object(m) if m.len() == 1 && !m.contains_key("kernel_size") => {
                m.keys().next().cloned().unwrap_or_default()
            }
            _ => "conv".into(),
        };
        return format!(
            "{op} {}->{} ch, kernel {}, stride {}, input {}, batch {}, {}",
            conv.get("in_channels")
                .map(Value::to_string)
                .unwrap_or_default(),
            conv.get("out_channels")
                .map(Value::to_string)
                .unwrap_or_default(),
            list(conv.get("kernel_size")),
            list(conv.get("stride")),
            list(conv.get("shape")),
            conv.get("batch_size")
                .map(Value::to_string)
                .unwrap_or_default(),
            conv.get("dtype")
                .map(|d| d.to_string().trim_matches('"').to_string())
                .unwrap_or_default(),
        );
    }
    let mut s = key.to_string();
    if s.len() > 160 {
        let cut = (0..=157)
            .rev()
            .find(|&i| s.is_char_boundary(i))
            .unwrap_or(0);
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// The decisions of `path` as a Markdown table: what was tuned, the kernel chosen, its median
/// time, and the runner-up with how many times slower it was.
pub fn autotune_report(path: &Path) -> Result<String> {
    let decisions = read_decisions(path)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} autotune decisions in {}\n",
        decisions.len(),
        path.display()
    );
    if decisions.is_empty() {
        let _ = writeln!(
            out,
            "(none: nothing was tuned, or every key came from the disk cache; rerun with CUBECL_AUTOTUNE_CACHE=0)"
        );
        return Ok(out);
    }
    let _ = writeln!(
        out,
        "| what | chosen kernel | median ms | runner-up | its ms (x) | failed |"
    );
    let _ = writeln!(out, "| --- | --- | ---: | --- | ---: | ---: |");
    for d in &decisions {
        let (ru, ru_t) = match &d.runner_up {
            Some((name, t)) => (
                name.clone(),
                format!("{:.3} ({:.2}x)", t * 1e3, t / d.seconds.max(1e-12)),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.3} | {ru} | {ru_t} | {} |",
            d.what,
            d.chosen,
            d.seconds * 1e3,
            d.failed
        );
    }
    // Where another candidate's median beat the kept kernel's by over 10%: the choice may be
    // noise, or a kernel left on the table.
    let behind: Vec<f64> = decisions
        .iter()
        .filter_map(|d| d.runner_up.as_ref().map(|(_, t)| d.seconds / t.max(1e-12)))
        .filter(|&x| x > 1.1)
        .collect();
    if !behind.is_empty() {
        let worst = behind.iter().copied().fold(1.0, f64::max);
        let _ = writeln!(
            out,
            "\n{} of {} decisions kept a kernel whose median was more than 10% behind the \
             runner-up's (x below 0.91; up to {worst:.2}x slower)",
            behind.len(),
            decisions.len()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decision as cubecl 0.11.3 serializes it (`AutotuneDecision`), two candidates measured
    /// and one failed.
    const LINE: &str = r#"{"key":{"Conv":{"kernel_size":[3,3],"stride":[1,1],"padding":[[1,1],[1,1]],"dilation":[1,1],"groups":1,"in_channels":64,"out_channels":64,"shape":[56,56],"batch_size":32,"has_bias":false,"dtype":"F32"}},"fastest_index":1,"fastest_time":{"secs":0,"nanos":250000},"results":[{"outcome":{"Ok":{"name":"burn_cubecl::kernel::conv::ImplicitGemm<cubek::Tf32>","index":1,"computation":{"median":{"secs":0,"nanos":250000}}}}},{"outcome":{"Ok":{"name":"burn_cubecl::kernel::conv::Direct","index":0,"computation":{"median":{"secs":0,"nanos":1000000}}}}},{"outcome":{"Err":"Skip"}}],"log_context":null,"checks":null}"#;

    #[test]
    fn a_decision_names_the_shape_the_winner_and_the_runner_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        std::fs::write(&path, format!("{LINE}\n\n{{\"error\":\"x\"}}\n")).unwrap();
        let d = read_decisions(&path).unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].chosen, "ImplicitGemm<Tf32>");
        assert!((d[0].seconds - 250e-6).abs() < 1e-12);
        assert_eq!(d[0].runner_up.as_ref().unwrap().0, "Direct");
        assert_eq!(d[0].failed, 1);
        assert_eq!(d[0].kind, DecisionKind::Convolution);
        assert_eq!(
            d[0].what,
            "Conv 64->64 ch, kernel 3x3, stride 1x1, input 56x56, batch 32, F32"
        );
        let table = autotune_report(&path).unwrap();
        assert!(table.contains("| Conv 64->64 ch"), "{table}");
        assert!(table.contains("1.000 (4.00x)"), "{table}");
    }

    #[test]
    fn the_chosen_kernel_is_cubecls_pick_even_where_another_median_was_lower() {
        // cubecl kept index 2 (listed first) although index 0's median was lower.
        let line = r#"{"key":{"Sum":{"dtype":"F32","length":2}},"fastest_index":2,"fastest_time":{"secs":0,"nanos":300000},"results":[{"outcome":{"Ok":{"name":"kept","index":2,"computation":{"median":{"secs":0,"nanos":300000}}}}},{"outcome":{"Ok":{"name":"faster","index":0,"computation":{"median":{"secs":0,"nanos":200000}}}}},{"outcome":{"Ok":{"name":"slowest","index":1,"computation":{"median":{"secs":0,"nanos":900000}}}}}]}"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        std::fs::write(&path, format!("{line}\n{LINE}\n")).unwrap();
        let d = read_decisions(&path).unwrap();
        assert_eq!(d[0].kind, DecisionKind::Reduction);
        assert_eq!(d[0].chosen, "kept");
        assert!((d[0].seconds - 300e-6).abs() < 1e-12);
        let (ru, t) = d[0].runner_up.clone().unwrap();
        assert_eq!(ru, "faster");
        assert!((t - 200e-6).abs() < 1e-12);
        let table = autotune_report(&path).unwrap();
        assert!(
            table.contains("| kept | 0.300 | faster | 0.200 (0.67x)"),
            "{table}"
        );
        assert!(
            table.contains("1 of 2 decisions kept a kernel whose median was more than 10% behind"),
            "{table}"
        );
        assert!(table.contains("up to 1.50x slower"), "{table}");
    }

    #[test]
    fn matrix_products_and_reductions_are_told_from_other_decisions() {
        // cubek's matmul key (as the H200 logged it) and the fused one around it.
        let plain = r#"{"key":{"definition":{"m":40,"n":1526,"k":3815,"lhs_pow2_factor":0},"analysis":{"scale_global":"Small"}},"fastest_index":0,"results":[{"outcome":{"Ok":{"name":"matmul_simple","index":0,"computation":{"median":{"secs":0,"nanos":9000}}}}}]}"#;
        let fused = r#"{"key":{"matmul_key":{"definition":{"m":8,"n":8,"k":8}},"num_out_buffers":1,"num_ops":2},"fastest_index":0,"results":[{"outcome":{"Ok":{"name":"fused","index":0,"computation":{"median":{"secs":0,"nanos":9000}}}}}]}"#;
        let reduce = r#"{"key":{"reduce_key":{"axis_is_contiguous":true},"definition":"not a product"},"fastest_index":0,"results":[{"outcome":{"Ok":{"name":"plane","index":0,"computation":{"median":{"secs":0,"nanos":9000}}}}}]}"#;
        let reduce_dim = r#"{"key":{"accumulator_len":1,"reduce":{"axis_is_contiguous":true,"vector_size":16,"vector_count":64}},"fastest_index":0,"results":[{"outcome":{"Ok":{"name":"plane","index":4,"computation":{"median":{"secs":0,"nanos":9000}}}}}]}"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        std::fs::write(&path, format!("{plain}\n{fused}\n{reduce}\n{reduce_dim}\n")).unwrap();
        let kinds: Vec<_> = read_decisions(&path)
            .unwrap()
            .iter()
            .map(|d| d.kind)
            .collect();
        assert_eq!(
            kinds,
            [
                DecisionKind::MatrixProduct,
                DecisionKind::MatrixProduct,
                DecisionKind::Other,
                DecisionKind::Reduction
            ]
        );
    }

    #[test]
    fn a_line_that_is_not_json_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        std::fs::write(&path, format!("{LINE}\nnot json\n")).unwrap();
        let e = read_decisions(&path).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        let missing = read_decisions(&dir.path().join("none"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("none"), "{missing}");
    }
}
