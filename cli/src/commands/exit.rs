//! How a launcher's outcome ends the `hearth` process: a failed rank's exit status passed on.

use anyhow::Result;

/// `Ok` when every rank succeeded; otherwise says which rank failed and exits with its status.
pub(crate) fn exit_with(outcome: crate::commands::launch::LaunchOutcome) -> Result<()> {
    match outcome {
        crate::commands::launch::LaunchOutcome::Success => Ok(()),
        crate::commands::launch::LaunchOutcome::Failed { rank, code } => {
            match code {
                Some(c) => eprintln!("error: rank {rank} failed (exit status {c})"),
                None => eprintln!("error: rank {rank} was killed by a signal"),
            }
            std::process::exit(code.filter(|c| *c != 0).unwrap_or(1));
        }
    }
}
