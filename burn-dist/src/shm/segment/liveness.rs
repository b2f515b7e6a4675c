//! Whether the processes of a segment are alive: a process as the kernel names it (so a
//! recycled pid is never taken for the same process) and what `/proc` says of it.

/// A process as the kernel names it: pid, pid namespace, start time (ticks since boot), so a
/// recycled pid is never taken for the same process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessId {
    pub pid: u32,
    pub pid_ns: u64,
    pub start_time: u64,
}

impl ProcessId {
    pub fn current() -> ProcessId {
        let pid = std::process::id();
        ProcessId {
            pid,
            pid_ns: namespace_inode("pid").unwrap_or(0),
            start_time: proc_stat(pid).map_or(0, |(_, t)| t),
        }
    }
}

/// The inode of this process's namespace of `kind` (`net`, `pid`, ...), if Linux says.
pub(crate) fn namespace_inode(kind: &str) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/self/ns/{kind}")).ok()?;
    let s = link.to_string_lossy();
    s.split('[').nth(1)?.trim_end_matches(']').parse().ok()
}

/// (state, start time) of `pid` from `/proc/<pid>/stat`.
pub(crate) fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 22 of the whole line is the 20th after the name.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// What this process can see of another.
pub(super) enum Seen {
    Running,
    /// Stopped (SIGSTOP, a debugger): alive, but it can make no progress; its heartbeat tells
    /// how long.
    Stopped,
    /// Why it is not running.
    Gone(String),
    /// In another pid namespace (or without `/proc`): only its heartbeat tells.
    Hidden,
}

pub(super) fn process_seen(id: ProcessId) -> Seen {
    if id.pid_ns != namespace_inode("pid").unwrap_or(0) || id.pid == 0 {
        return Seen::Hidden;
    }
    match proc_stat(id.pid) {
        None => Seen::Gone(format!("its process {} is gone", id.pid)),
        Some((_, start)) if start != id.start_time => {
            Seen::Gone(format!("its process {} is gone", id.pid))
        }
        Some(('Z' | 'X', _)) => Seen::Gone(format!("its process {} exited", id.pid)),
        Some(('T' | 't', _)) => Seen::Stopped,
        Some(_) => Seen::Running,
    }
}
