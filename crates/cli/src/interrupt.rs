//! SIGINT, SIGTERM and SIGHUP for the writing commands.
//!
//! Killing a writer mid-way would leave the image as the last commit left it: files
//! created but not yet written (0 bytes), and work done since never committed. So the
//! writing commands catch these signals ([`install`]): the handler only records the
//! signal; the commands poll [`requested`] between files, between directory entries
//! and between chunks of a large file, stop starting new work, finish or roll back the
//! file in progress, then commit and close the image as on success. Last, [`finish`]
//! re-raises the signal with its default action, so the process ends as killed by it
//! (status 130, 143 or 129 in a shell), and a shell loop running the command stops too.
//!
//! A second signal while finishing ends the process at once; the image then holds
//! what the journal committed, which is consistent (replayed at the next open).

use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal caught (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

extern "C" fn on_signal(sig: libc::c_int) {
    if SIGNAL
        .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        // A second signal: the default action, once this handler returns (the signal
        // is blocked while it runs). signal(2) and raise(3) are async-signal-safe.
        // SAFETY: no memory is touched; both calls are allowed in a signal handler.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

/// Catch SIGINT, SIGTERM and SIGHUP for the rest of the process (see the module note).
/// A signal ignored by the parent (`nohup`, a background job) stays ignored.
pub fn install() {
    for sig in SIGNALS {
        // SAFETY: `sa` is fully initialized (zeroed, then the handler and flags set)
        // before sigaction reads it; `old` is a valid place for the old action.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// The signal that asked the command to stop, if any.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::Relaxed) {
        0 => None,
        s => Some(s),
    }
}

/// The signal's name, for messages.
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// After the image is closed: if a signal asked the command to stop, end the process
/// by that signal (default action), else return.
pub fn finish() {
    let Some(sig) = requested() else { return };
    // SAFETY: restoring the default action and raising a signal touch no memory.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
    std::process::exit(128 + sig)
}
