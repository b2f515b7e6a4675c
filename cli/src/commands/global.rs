//! The flags every command line accepts before or after its command (`--device`, `--autotune`,
//! `--kernel-bundle`): which commands they act on, and how `launch` hands them to its ranks.
//!
//! A command that runs nothing on a device (`models`, `data synth`, `secret`, ...) refuses them
//! by name where the command line gives them; set in the environment (`HEARTH_DEVICE`, ...)
//! they are the shell's standing choice and pass unremarked. `launch` gives them to each rank
//! through that environment, and refuses a flag its ranks' command gives too.

use anyhow::{Result, bail};

/// The global flags, as the command line writes them, with clap's ids and the environment
/// variable each one reads.
pub(crate) const FLAGS: [(&str, &str, &str); 3] = [
    ("--device", "device", "HEARTH_DEVICE"),
    ("--autotune", "autotune", "HEARTH_AUTOTUNE"),
    ("--kernel-bundle", "kernel_bundle", "HEARTH_KERNEL_BUNDLE"),
];

/// What a command does with the global flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Use {
    /// It runs on the device they choose (`train`, `predict`, ...).
    Device,
    /// It starts ranks, which get them (`launch`).
    Ranks,
    /// Nothing: no device runs its work.
    Nothing,
}

/// Ok where `command` (its words, `data synth`) acts on every flag in `given` (the global
/// flags its command line wrote, as `--device`); else the error names the first it would
/// ignore. `rank_args` is the command `launch` starts, after `--`.
pub(crate) fn check(command: &str, uses: Use, given: &[&str], rank_args: &[String]) -> Result<()> {
    match uses {
        Use::Device => Ok(()),
        Use::Nothing => match given.first() {
            Some(flag) => bail!(
                "{flag}: `hearth {command}` runs nothing on a device, so the flag would do \
                 nothing (it belongs to train, predict, eval, export, tune and bench model|loader, \
                 or to `launch`, which gives it to every rank)"
            ),
            None => Ok(()),
        },
        Use::Ranks => {
            for flag in given {
                let twice = rank_args
                    .iter()
                    .any(|a| a == flag || a.starts_with(&format!("{flag}=")));
                if twice {
                    bail!(
                        "{flag}: given to `hearth launch` and to the ranks' command after `--`: \
                         give it once (launch passes its own to every rank)"
                    );
                }
            }
            Ok(())
        }
    }
}

/// The environment variable through which `launch` gives its ranks `flag`.
pub(crate) fn env_of(flag: &str) -> Option<&'static str> {
    FLAGS
        .iter()
        .find(|(f, _, _)| *f == flag)
        .map(|(_, _, env)| *env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_without_a_device_refuses_each_flag_by_name() {
        for flag in ["--device", "--autotune", "--kernel-bundle"] {
            let err = check("data synth", Use::Nothing, &[flag], &[]).unwrap_err();
            let text = err.to_string();
            assert!(
                text.starts_with(&format!("{flag}: `hearth data synth`")),
                "{text}"
            );
        }
        assert!(check("models", Use::Nothing, &[], &[]).is_ok());
        assert!(check("train", Use::Device, &["--device", "--autotune"], &[]).is_ok());
    }

    #[test]
    fn launch_refuses_a_flag_its_ranks_are_given_too() {
        let ranks = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let train = ranks(&["train", "--device=vulkan-cpu", "--epochs", "1"]);
        let err = check("launch", Use::Ranks, &["--device"], &train).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--device: given to `hearth launch`")
        );
        assert!(check("launch", Use::Ranks, &["--autotune"], &train).is_ok());
        let spaced = ranks(&["train", "--kernel-bundle", "b.ccb"]);
        assert!(check("launch", Use::Ranks, &["--kernel-bundle"], &spaced).is_err());
        assert_eq!(env_of("--device"), Some("HEARTH_DEVICE"));
        assert_eq!(env_of("--kernel-bundle"), Some("HEARTH_KERNEL_BUNDLE"));
    }
}
