//! Futexes on the words of the segment: a rank sleeps until a word changes, and wakes the ranks
//! sleeping on it, instead of spinning.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps until `word` is no longer `expected`, a wake, or `timeout` (spurious returns allowed).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    #[cfg(target_os = "linux")]
    {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a live 4-byte aligned atomic; FUTEX_WAIT only reads it. Not the
        // private variant: the word is shared between processes.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word as *const AtomicU32,
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        if word.load(Ordering::Acquire) == expected {
            std::thread::sleep(timeout.min(Duration::from_micros(200)));
        }
    }
}

/// Wakes every waiter on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    #[cfg(target_os = "linux")]
    // SAFETY: as in `futex_wait`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const AtomicU32,
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
    #[cfg(not(target_os = "linux"))]
    let _ = word;
}
