//! The analysis on small crates written for the purpose.

use super::*;

/// The analysis sees a circle where there is one: a parent that calls its child while the
/// child uses an item the parent defines, through a re-export and through `super::`.
#[test]
fn a_circle_through_a_parent_and_a_reexport_is_found() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let src = dir.path();
    std::fs::create_dir_all(src.join("train")).expect("mkdir");
    std::fs::write(
        src.join("lib.rs"),
        "pub mod train;\nmod error;\npub use error::Error;\n",
    )
    .expect("write");
    std::fs::write(src.join("error.rs"), "pub struct Error;\n").expect("write");
    std::fs::write(
        src.join("train/mod.rs"),
        "mod ps;\nmod config;\npub use config::Config;\n\
         pub struct Report;\npub fn run() { ps::go() }\n\
         #[cfg(test)]\nmod tests { use super::ps::*; }\n",
    )
    .expect("write");
    std::fs::write(
        src.join("train/config.rs"),
        "// use super::ps::go; (a comment)\npub struct Config { s: &'static str }\n\
         const S: &str = \"super::ps::go\";\n",
    )
    .expect("write");
    std::fs::write(
        src.join("train/ps.rs"),
        "use super::{Config, Report};\nuse crate::Error;\npub fn go() {}\n",
    )
    .expect("write");
    let mut reached = BTreeSet::new();
    let mods = crate_modules(&src.join("lib.rs"), &mut reached);
    // The root, error, train, train::config and train::ps.
    assert_eq!(mods.len(), 5, "{:?}", mods.keys().collect::<Vec<_>>());
    let graph = edges(&mods);
    let names = |m: &str| -> Vec<String> {
        graph
            .get(m)
            .map(|e| e.keys().cloned().collect())
            .unwrap_or_default()
    };
    // `super::Config` lands in config (through the re-export), `super::Report` in train,
    // `crate::Error` in error; the comment, the string and the test module name nothing.
    assert_eq!(names("train::ps"), ["error", "train", "train::config"]);
    assert_eq!(names("train"), ["train::ps"]);
    assert!(
        names("train::config").is_empty(),
        "{:?}",
        names("train::config")
    );
    let nodes: Vec<String> = mods.keys().cloned().collect();
    assert_eq!(
        circles(&graph, &nodes),
        vec![vec!["train".to_string(), "train::ps".to_string()]]
    );
    // Moving `Report` below both breaks it.
    std::fs::write(
        src.join("train/mod.rs"),
        "mod ps;\nmod config;\nmod report;\npub use config::Config;\npub use report::Report;\n\
         pub fn run() { ps::go() }\n",
    )
    .expect("write");
    std::fs::write(src.join("train/report.rs"), "pub struct Report;\n").expect("write");
    let mods = crate_modules(&src.join("lib.rs"), &mut reached);
    let graph = edges(&mods);
    let nodes: Vec<String> = mods.keys().cloned().collect();
    assert!(circles(&graph, &nodes).is_empty());
}

/// A re-export the module itself uses is a dependency (the circle it closes is found); one it
/// only passes on is a facade (no circle).
#[test]
fn a_reexport_the_module_uses_is_a_dependency() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let src = dir.path();
    std::fs::write(
        src.join("lib.rs"),
        "mod stream;\npub use stream::Stream;\npub struct Loader;\n\
         impl Loader { pub fn epoch(&self) -> Stream { Stream } }\n",
    )
    .expect("write");
    std::fs::write(
        src.join("stream.rs"),
        "use super::Loader;\npub struct Stream;\nfn f(_: Loader) {}\n",
    )
    .expect("write");
    let mut reached = BTreeSet::new();
    let mods = crate_modules(&src.join("lib.rs"), &mut reached);
    let nodes: Vec<String> = mods.keys().cloned().collect();
    assert_eq!(
        circles(&edges(&mods), &nodes),
        vec![vec![String::new(), "stream".to_string()]]
    );
    // The stream's constructor beside the stream: the root only passes the name on.
    std::fs::write(
        src.join("lib.rs"),
        "mod stream;\npub use stream::Stream;\npub struct Loader;\n",
    )
    .expect("write");
    std::fs::write(
        src.join("stream.rs"),
        "use super::Loader;\npub struct Stream;\n\
         impl Loader { pub fn epoch(&self) -> Stream { Stream } }\n",
    )
    .expect("write");
    let mods = crate_modules(&src.join("lib.rs"), &mut reached);
    let nodes: Vec<String> = mods.keys().cloned().collect();
    assert!(circles(&edges(&mods), &nodes).is_empty());
}
