//! Dependencies point one way in every crate of the workspace (DESIGN.md, issue 56): no module
//! reaches, directly or round a circle, a module that reaches it back.
//!
//! The test reads the sources, not a table: from each crate root (`src/lib.rs`, `cli/src/main.rs`,
//! `models/src/lib.rs`, ...) it follows the `mod` declarations to every module, and fails on a
//! `.rs` file under a crate's `src/` that no declaration reaches (a module it does not know
//! is no pass). In each module it reads every path that names another module of the crate:
//! `crate::`, `super::` and `self::` paths, and paths that start with a child module's name.
//! A path to an item resolves to the module that defines the item, through `pub use`
//! re-exports (a re-export is a facade, not a dependency, unless the module itself uses the
//! name it re-exports: then it depends on where the name goes). Test modules
//! (`#[cfg(test)]` items) are left out. Any strongly connected set of modules is a circle, and
//! the failure lists its edges with the line that makes each.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[path = "module_graph/fixtures.rs"]
mod fixtures;
#[path = "module_graph/tokens.rs"]
mod tokens;

use tokens::{Tok, ident, tokens, use_tree, without_test_items};

/// Circles not broken yet, each as the crate root and its modules: the test fails on any
/// other circle, and on one of these once it is gone (so the list only shrinks). Empty: every
/// circle found when the test was written (issue 56) is broken.
const KNOWN: &[(&str, &[&str])] = &[];

/// The workspace's crate roots, relative to the workspace root.
const ROOTS: &[&str] = &[
    "src/lib.rs",
    "cli/src/lib.rs",
    "cli/src/main.rs",
    "models/src/lib.rs",
    "datasets/src/lib.rs",
    "kernels/src/lib.rs",
    "burn-dist/src/lib.rs",
];

/// One module: its file, its child modules, what it defines, what it re-exports.
struct Module {
    file: PathBuf,
    toks: Vec<(Tok, usize)>,
    children: BTreeSet<String>,
    defs: BTreeSet<String>,
    /// Re-exported name -> the path it names (segments, as written).
    reexports: BTreeMap<String, Vec<String>>,
}

fn load(path: &Path) -> Vec<(Tok, usize)> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    tokens(&text)
}

/// The modules a file's tokens declare at their top level, as paths from the file's module:
/// `mod a;` gives `([a], true)` (a file of its own), `mod b { mod c; }` gives `([b], false)`
/// (inline) and `([b, c], true)`.
fn declared(toks: &[(Tok, usize)]) -> Vec<(Vec<String>, bool)> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut k = 0;
    while k < toks.len() {
        match &toks[k].0 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth -= 1,
            Tok::Ident(kw) if kw == "mod" && depth == 0 => {
                if let Some(child) = ident(toks.get(k + 1)) {
                    match toks.get(k + 2).map(|x| &x.0) {
                        Some(Tok::Punct(';')) => out.push((vec![child.to_string()], true)),
                        Some(Tok::Punct('{')) => {
                            // The inline module's body, up to its closing brace.
                            let (start, mut d, mut j) = (k + 3, 1, k + 3);
                            while j < toks.len() && d > 0 {
                                match toks[j].0 {
                                    Tok::Punct('{') => d += 1,
                                    Tok::Punct('}') => d -= 1,
                                    _ => {}
                                }
                                j += 1;
                            }
                            out.push((vec![child.to_string()], false));
                            for (mut path, file) in declared(&toks[start..j.saturating_sub(1)]) {
                                path.insert(0, child.to_string());
                                out.push((path, file));
                            }
                            k = j;
                            continue;
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        k += 1;
    }
    out
}

/// The file of module `path` (under inline modules) declared in a module whose own children
/// live in `dir`.
fn child_file(dir: &Path, path: &[String], parent: &Path) -> PathBuf {
    let (last, inline) = path.split_last().expect("a module path");
    let dir = inline.iter().fold(dir.to_path_buf(), |d, m| d.join(m));
    let a = dir.join(format!("{last}.rs"));
    let b = dir.join(last).join("mod.rs");
    let found = if a.is_file() { a } else { b };
    assert!(
        found.is_file(),
        "{}: mod {} has no file",
        parent.display(),
        path.join("::")
    );
    found
}

/// Where the children of the module in `file` live.
fn children_dir(file: &Path, is_root: bool) -> PathBuf {
    if is_root || file.ends_with("mod.rs") {
        file.parent().expect("a parent").to_path_buf()
    } else {
        file.with_extension("")
    }
}

fn child_name(parent: &str, path: &[String]) -> String {
    if parent.is_empty() {
        path.join("::")
    } else {
        format!("{parent}::{}", path.join("::"))
    }
}

/// Test modules in files of their own (`#[cfg(test)] mod tests;`) and their children: known
/// files, left out of the graph.
fn test_files(
    decls: &[(Vec<String>, bool)],
    dir: &Path,
    file: &Path,
    files: &mut BTreeSet<PathBuf>,
) {
    for (path, is_file) in decls {
        if *is_file {
            let f = child_file(dir, path, file);
            let sub = children_dir(&f, false);
            let toks = load(&f);
            files.insert(f.clone());
            test_files(&declared(&toks), &sub, &f, files);
        }
    }
}

/// Every module of the crate whose root file is `root`, by name (`""` for the root).
fn crate_modules(root: &Path, files: &mut BTreeSet<PathBuf>) -> BTreeMap<String, Module> {
    let mut mods = BTreeMap::new();
    let mut inline: Vec<(String, BTreeSet<String>, PathBuf)> = Vec::new();
    let mut todo = vec![(String::new(), root.to_path_buf())];
    while let Some((name, file)) = todo.pop() {
        files.insert(file.clone());
        let raw = load(&file);
        let toks = without_test_items(raw.clone());
        let dir = children_dir(&file, name.is_empty());
        let decls = declared(&toks);
        let children: BTreeSet<String> = decls.iter().map(|(p, _)| p[0].clone()).collect();
        for (path, is_file) in &decls {
            if *is_file {
                todo.push((child_name(&name, path), child_file(&dir, path, &file)));
            } else {
                // An inline module: its body is in this file's tokens; its children by name.
                let inner = decls
                    .iter()
                    .filter(|(p, _)| p.len() == path.len() + 1 && p.starts_with(path))
                    .map(|(p, _)| p[path.len()].clone())
                    .collect();
                inline.push((child_name(&name, path), inner, file.clone()));
            }
        }
        let tests: Vec<(Vec<String>, bool)> = declared(&raw)
            .into_iter()
            .filter(|d| !decls.contains(d))
            .collect();
        test_files(&tests, &dir, &file, files);
        let (mut defs, mut reexports) = (BTreeSet::new(), BTreeMap::new());
        for (k, (tok, _)) in toks.iter().enumerate() {
            if let Tok::Ident(kw) = tok {
                let item = ident(toks.get(k + 1));
                let declares = matches!(
                    kw.as_str(),
                    "fn" | "struct"
                        | "enum"
                        | "trait"
                        | "type"
                        | "const"
                        | "static"
                        | "union"
                        | "mod"
                );
                if let Some(item) = item
                    && declares
                {
                    defs.insert(item.to_string());
                }
                if kw == "macro_rules"
                    && let Some(item) = ident(toks.get(k + 2))
                {
                    defs.insert(item.to_string());
                }
                // `pub use ...;` and `pub(crate) use ...;`: re-exports.
                if kw == "use" {
                    let public = k > 0
                        && (ident(toks.get(k - 1)) == Some("pub")
                            || toks.get(k - 1).map(|x| &x.0) == Some(&Tok::Punct(')')));
                    if public {
                        let mut i = k + 1;
                        let mut found = Vec::new();
                        use_tree(&toks, &mut i, &[], &mut found);
                        for (path, bound) in found {
                            reexports.insert(bound, path);
                        }
                    }
                }
            }
        }
        mods.insert(
            name,
            Module {
                file,
                toks,
                children,
                defs,
                reexports,
            },
        );
    }
    for (name, children, file) in inline {
        mods.entry(name).or_insert(Module {
            file,
            toks: Vec::new(),
            children,
            defs: BTreeSet::new(),
            reexports: BTreeMap::new(),
        });
    }
    mods
}

fn join(base: &[String]) -> String {
    base.join("::")
}

/// The module `path` (written in module `cur`) lands in, following re-exports.
fn resolve(
    mods: &BTreeMap<String, Module>,
    cur: &str,
    path: &[String],
    hops: usize,
) -> Option<String> {
    let mut base: Vec<String> = if cur.is_empty() {
        Vec::new()
    } else {
        cur.split("::").map(str::to_string).collect()
    };
    let mut segs = path;
    match segs.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            segs = &segs[1..];
        }
        Some("super") => {
            while segs.first().map(String::as_str) == Some("super") {
                base.pop()?;
                segs = &segs[1..];
            }
        }
        Some("self") => segs = &segs[1..],
        Some(first) if mods.get(cur).is_some_and(|m| m.children.contains(first)) => {}
        _ => return None,
    }
    let full: Vec<String> = base.iter().chain(segs).cloned().collect();
    for k in (0..=full.len()).rev() {
        let name = join(&full[..k]);
        let Some(m) = mods.get(&name) else { continue };
        if let Some(item) = full.get(k)
            && !m.defs.contains(item)
            && let Some(target) = m.reexports.get(item)
            && hops < 8
        {
            let mut rest = target.clone();
            rest.extend(full[k + 1..].iter().cloned());
            if let Some(r) = resolve(mods, &name, &rest, hops + 1) {
                return Some(r);
            }
        }
        return Some(name);
    }
    None
}

/// Module -> (module it names -> the first line that names it).
fn edges(mods: &BTreeMap<String, Module>) -> BTreeMap<String, BTreeMap<String, usize>> {
    let mut out: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for (name, m) in mods {
        let t = &m.toks;
        let mut add = |path: &[String], line: usize| {
            if let Some(r) = resolve(mods, name, path, 0)
                && r != *name
            {
                out.entry(name.clone())
                    .or_default()
                    .entry(r)
                    .or_insert(line);
            }
        };
        let mut i = 0;
        while i < t.len() {
            let line = t[i].1;
            let after_path = i > 0 && matches!(t[i - 1].0, Tok::Path | Tok::Punct('$'));
            match &t[i].0 {
                Tok::Ident(kw) if kw == "use" => {
                    let public = i > 0
                        && (ident(t.get(i - 1)) == Some("pub")
                            || t.get(i - 1).map(|x| &x.0) == Some(&Tok::Punct(')')));
                    let mut j = i + 1;
                    let mut found = Vec::new();
                    use_tree(t, &mut j, &[], &mut found);
                    for (path, bound) in found {
                        // A re-export is a facade, unless the module itself uses the name it
                        // binds (outside the `use`): then it depends on where the name goes.
                        let used_here = || {
                            t.iter().enumerate().any(|(k, (tok, _))| {
                                !(i..j).contains(&k)
                                    && matches!(tok, Tok::Ident(s) if *s == bound)
                                    && !(k > 0 && matches!(t[k - 1].0, Tok::Path))
                            })
                        };
                        if !public || (bound != "*" && used_here()) {
                            add(&path, line);
                        }
                    }
                    i = j.max(i + 1);
                }
                Tok::Ident(first)
                    if !after_path
                        && t.get(i + 1).map(|x| &x.0) == Some(&Tok::Path)
                        && (matches!(first.as_str(), "crate" | "super" | "self")
                            || m.children.contains(first)) =>
                {
                    let mut path = vec![first.clone()];
                    let mut j = i + 1;
                    while t.get(j).map(|x| &x.0) == Some(&Tok::Path) {
                        match t.get(j + 1) {
                            Some((Tok::Ident(s), _)) => {
                                path.push(s.clone());
                                j += 2;
                            }
                            Some((Tok::Punct('{'), _)) => {
                                j += 1;
                                let mut found = Vec::new();
                                use_tree(t, &mut j, &path, &mut found);
                                for (p, _) in found {
                                    add(&p, line);
                                }
                                path.clear();
                                break;
                            }
                            _ => break,
                        }
                    }
                    if !path.is_empty() {
                        add(&path, line);
                    }
                    i = j.max(i + 1);
                }
                _ => i += 1,
            }
        }
    }
    out
}

/// The strongly connected sets of more than one module (Tarjan).
fn circles(
    edges: &BTreeMap<String, BTreeMap<String, usize>>,
    nodes: &[String],
) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, usize>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(s: &mut State, v: &str) {
        s.index.insert(v.into(), s.next);
        s.low.insert(v.into(), s.next);
        s.next += 1;
        s.stack.push(v.into());
        s.on.insert(v.into());
        let targets: Vec<String> = s
            .edges
            .get(v)
            .map(|e| e.keys().cloned().collect())
            .unwrap_or_default();
        for w in targets {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let lw = s.low[&w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(&w) {
                let iw = s.index[&w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut set = Vec::new();
            loop {
                let w = s.stack.pop().expect("on the stack");
                s.on.remove(&w);
                let done = w == v;
                set.push(w);
                if done {
                    break;
                }
            }
            if set.len() > 1 {
                set.sort();
                s.out.push(set);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading a source folder") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn workspace() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

#[test]
fn no_module_of_any_crate_is_in_a_circle() {
    let ws = workspace();
    let mut reached = BTreeSet::new();
    let mut problems = Vec::new();
    let mut counted = 0;
    let mut known: Vec<(&str, &[&str])> = KNOWN.to_vec();
    for root in ROOTS {
        let mods = crate_modules(&ws.join(root), &mut reached);
        counted += mods.len();
        let nodes: Vec<String> = mods.keys().cloned().collect();
        let graph = edges(&mods);
        for set in circles(&graph, &nodes) {
            if let Some(k) = known.iter().position(|(r, m)| {
                r == root && m.iter().copied().eq(set.iter().map(String::as_str))
            }) {
                known.remove(k);
                continue;
            }
            let mut lines = vec![format!("{root}: a circle of {} modules:", set.len())];
            for a in &set {
                for (b, line) in graph.get(a).into_iter().flatten() {
                    if set.contains(b) {
                        let file = mods[a].file.strip_prefix(&ws).unwrap_or(&mods[a].file);
                        lines.push(format!(
                            "  {} -> {} ({}:{line})",
                            if a.is_empty() { "<root>" } else { a },
                            if b.is_empty() { "<root>" } else { b },
                            file.display()
                        ));
                    }
                }
            }
            problems.push(lines.join("\n"));
        }
    }
    for (root, set) in known {
        problems.push(format!(
            "{root}: the known circle {set:?} is gone (or changed): take it out of KNOWN"
        ));
    }
    // Every source file is a module some crate declares.
    for root in ROOTS {
        let dir = ws.join(root).parent().expect("src/").to_path_buf();
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        for f in files {
            if !reached.contains(&f) {
                problems.push(format!(
                    "{} is declared by no `mod` of any crate root this test knows (ROOTS)",
                    f.strip_prefix(&ws).unwrap_or(&f).display()
                ));
            }
        }
    }
    assert!(
        counted > 100,
        "only {counted} modules found: the walk is broken"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
