//! burn-dist's modules depend one way (DESIGN.md; the list in `src/lib.rs`): the environment
//! read only at the edge (`env.rs`), the transports side by side over the `Transport` trait, the routing transport above
//! QUIC and shared memory, the rendezvous above that, the collectives over the trait alone, the
//! flat-vector layer on nothing, the sharded optimizer over it and the collectives.
//! This reads every source file (test modules aside) and fails on any `crate::` path that goes
//! against that order, naming the file, the line and the layer it reached.

use std::path::{Path, PathBuf};

/// Module (path under `src/`, longest match wins) and the crate modules it may name.
const LAYERS: &[(&str, &[&str])] = &[
    // The crate root declares the modules and names none of them by path.
    ("lib.rs", &[]),
    ("fuzz.rs", &[]),
    ("bucket.rs", &[]),
    ("split.rs", &[]),
    // A budget of bytes between two threads: nothing.
    ("room.rs", &[]),
    ("error.rs", &["wire"]),
    ("wire.rs", &[]),
    ("secret.rs", &[]),
    ("tls.rs", &["secret"]),
    ("transport/", &["transport", "wire"]),
    ("transport/quic/", &["tls", "transport", "wire"]),
    ("shm/", &["split", "transport", "wire"]),
    ("routed.rs", &["shm", "transport", "wire"]),
    (
        "rendezvous/",
        &["routed", "shm", "tls", "transport", "wire"],
    ),
    ("collective/", &["split", "transport", "wire"]),
    // A model as a flat vector (layout, module glue, optimizers): nothing but itself; the
    // sharded optimizer over it and the collectives; DDP over both.
    ("flat/", &["flat"]),
    (
        "zero/",
        &["bucket", "collective", "flat", "room", "split", "zero"],
    ),
    // A module's gradients in buckets; the exchange overlapped with the backward over them
    // (into the sharded optimizer's buckets too, found by the flat layer's tensor order).
    ("grads.rs", &["bucket", "collective"]),
    (
        "overlap/",
        &["bucket", "collective", "flat", "grads", "overlap", "zero"],
    ),
    (
        "ddp/",
        &["bucket", "collective", "flat", "grads", "overlap", "zero"],
    ),
    // Beside DDP: elastic membership over the collectives and the rendezvous' TLS, parameter
    // servers over the flat layer, pipelines over the transports.
    ("elastic/", &["collective", "tls", "transport", "wire"]),
    ("ps/", &["flat", "transport", "wire"]),
    ("pipeline/", &["transport", "wire"]),
    // The edge: the environment read into every layer's options; nothing names it.
    (
        "env.rs",
        &["collective", "rendezvous", "shm", "tls", "transport"],
    ),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading src/") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The crate modules a line names (`crate::shm::...` gives `shm`), comments aside.
fn named_modules(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or("");
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        // `crate::{shm::Pipes, transport}`: every item of the group.
        let items: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => group.split('}').next().unwrap_or("").split(',').collect(),
            None => vec![rest],
        };
        for item in items {
            let name: String = item
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            // `crate::Result`, `crate::DistError`: the crate root, below everything.
            if !name.is_empty() {
                found.push(name);
            }
        }
    }
    found
}

#[test]
fn every_module_names_only_the_layers_below_it() {
    // The run's own manifest directory first: a test binary reused from a build cache filled by
    // a checkout elsewhere carries that checkout's compile-time path.
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let src = root.join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .expect("under src/")
            .to_string_lossy()
            .replace('\\', "/");
        // Test modules may use anything (a transport's tests run collectives over it): a
        // `tests.rs`, or every file of a `tests/` folder.
        if rel.ends_with("tests.rs") || rel.contains("tests/") {
            continue;
        }
        let Some((layer, allowed)) = LAYERS
            .iter()
            .filter(|(prefix, _)| rel == *prefix || rel.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.len())
        else {
            // A module nobody placed is no pass: it could name anything.
            wrong.push(format!(
                "src/{rel} is in no layer of LAYERS: add a row saying what it may name"
            ));
            continue;
        };
        checked += 1;
        let text = std::fs::read_to_string(file).expect("reading a source file");
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("#[cfg(test)]") {
                // What follows is a test module: the rest of the file is tests.
                if text
                    .lines()
                    .nth(n + 1)
                    .is_some_and(|l| l.contains("mod tests"))
                {
                    break;
                }
            }
            for module in named_modules(line) {
                if !allowed.contains(&module.as_str()) {
                    wrong.push(format!(
                        "src/{rel}:{}: names crate::{module}, which is not below {layer} \
                         (allowed: {allowed:?})",
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        checked >= 30,
        "only {checked} files matched a layer: did src/ move?"
    );
    assert!(wrong.is_empty(), "layers crossed:\n{}", wrong.join("\n"));
}

/// Whether a line reads an environment variable (comments aside).
fn reads_environment(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    ["env::var(", "env::var_os(", "env::vars("]
        .iter()
        .any(|call| code.contains(call))
}

#[test]
fn only_the_edge_reads_the_environment() {
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let src = root.join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut readers = Vec::new();
    let mut edge_reads = 0;
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .expect("under src/")
            .to_string_lossy()
            .replace('\\', "/");
        if rel.ends_with("tests.rs") || rel.contains("tests/") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("reading a source file");
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("#[cfg(test)]")
                && text
                    .lines()
                    .nth(n + 1)
                    .is_some_and(|l| l.contains("mod tests"))
            {
                break;
            }
            if reads_environment(line) {
                if rel == "env.rs" {
                    edge_reads += 1;
                } else {
                    readers.push(format!("src/{rel}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        edge_reads > 0,
        "env.rs reads no variable: did the edge move?"
    );
    assert!(
        readers.is_empty(),
        "the environment is read outside src/env.rs (take an option instead):\n{}",
        readers.join("\n")
    );
}

#[test]
fn the_checker_sees_a_crossing() {
    assert!(reads_environment("let x = std::env::var(\"HEARTH_X\");"));
    assert!(!reads_environment(
        "let dir = std::env::temp_dir(); // env::var( in a comment"
    ));
    assert_eq!(named_modules("use crate::shm::Topology;"), vec!["shm"]);
    assert_eq!(
        named_modules("x = crate::env::collective_timeout(); // crate::rendezvous"),
        vec!["env"]
    );
    assert!(named_modules("use crate::{DistError, Result};").is_empty());
    assert_eq!(
        named_modules("use crate::{Result, shm::Pipes, transport};"),
        vec!["shm", "transport"]
    );
}
