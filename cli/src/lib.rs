//! The `hearth` command line's library part: the benches' helpers, which the binary's
//! `hearth bench` and `hearth tune` and the workspace's `cargo bench` share. A program that
//! embeds Hearth depends on the `hearth` crate and never on this one.

pub mod bench;
