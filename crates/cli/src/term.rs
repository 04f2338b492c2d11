//! Standard output and error for every command, and the words of its messages.
//!
//! Every message goes to standard error as "rext4 SUBCOMMAND: ..." ([`errln!`]). No
//! output failure panics: Rust programs ignore SIGPIPE, so a closed pipe comes back as
//! an EPIPE error, which `print!`/`eprintln!` would turn into a panic (exit 101, and
//! an image left open). What a closed standard output does:
//! - the reading commands (info, ls, cat, stat) end as cat does, killed by SIGPIPE
//!   (status 141 in a shell): [`reader_output_error`];
//! - the writing commands finish their work, commit and close the image, and exit
//!   with that work's status; what they would have printed is dropped ([`out`]).
//!
//! Any other output error (a full disk under a redirect) is reported once and fails the
//! command with exit 1, after its work. Errors on standard error are ignored: there is
//! nowhere left to report them.
//!
//! Reasons are worded as strerror(3) words them, as coreutils prints them ("No such
//! file or directory"), without Rust's " (os error N)" ([`io_reason`], [`reason`]).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use rext4::Error;

static PROG: OnceLock<String> = OnceLock::new();
/// Standard output failed; nothing more is written to it.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// Standard output failed with something else than a closed pipe.
static OUTPUT_FAILED: AtomicBool = AtomicBool::new(false);

/// Name the running subcommand for every message ("rext4 cp: ...").
pub fn set_subcommand(name: &str) {
    let _ = PROG.set(format!("rext4 {name}"));
}

/// "rext4 SUBCOMMAND" (or "rext4" before the command line is parsed).
pub fn prog() -> &'static str {
    PROG.get().map_or("rext4", String::as_str)
}

/// Write "rext4 SUBCOMMAND: MSG" to standard error; errors are ignored.
pub fn stderr_line(msg: &str) {
    let mut e = std::io::stderr().lock();
    let _ = writeln!(e, "{}: {}", prog(), tidy(msg));
}

/// Drop Rust's " (os error N)" from a message made elsewhere (the mount crate's
/// errors carry `std::io::Error`'s Display).
fn tidy(msg: &str) -> String {
    let mut s = msg.to_string();
    while let Some(i) = s.find(" (os error ") {
        let Some(len) = s[i..].find(')') else { break };
        s.replace_range(i..=i + len, "");
    }
    s
}

/// `errln!("{x}: ...")`: one message line on standard error, prefixed with
/// "rext4 SUBCOMMAND: "; never panics.
macro_rules! errln {
    ($($t:tt)*) => {
        $crate::term::stderr_line(&format!($($t)*))
    };
}
pub(crate) use errln;

/// Write `s` to standard output for a writing command: a closed pipe drops this and
/// all later output silently; another error is reported once and fails the command
/// at its end ([`output_failed`]).
pub fn out(s: &str) {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_all(s.as_bytes()).and_then(|()| o.flush()) {
        STDOUT_GONE.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            OUTPUT_FAILED.store(true, Ordering::Relaxed);
            errln!("write error: {}", io_reason(&e));
        }
    }
}

/// Whether [`out`] lost output to an error other than a closed pipe.
pub fn output_failed() -> bool {
    OUTPUT_FAILED.load(Ordering::Relaxed)
}

/// A reading command's failed write to standard output: a closed pipe ends the
/// process as it ends cat (SIGPIPE); anything else is an error (exit 1).
pub fn reader_output_error(e: &std::io::Error) -> (u8, String) {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        die_of_sigpipe();
    }
    (1, format!("write error: {}", io_reason(e)))
}

/// End the process by SIGPIPE, as a program that does not ignore it would end.
pub fn die_of_sigpipe() -> ! {
    // SAFETY: signal(2) and raise(3) have no memory preconditions; with the default
    // action restored, raise does not return.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE)
}

/// strerror(errno), as C programs print it.
pub fn strerror(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.rfind(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// A host I/O error in strerror's words.
pub fn io_reason(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => strerror(n),
        None => e.to_string(),
    }
}

/// An engine error as the CLI words it: strerror's words for what has an errno, the
/// engine's own text where it says more (corruption, unsupported features, not ext4),
/// and the detail of an invalid argument or refused operation in parentheses.
pub fn reason(e: &Error) -> String {
    match e {
        Error::Io(io) => io_reason(io),
        Error::Corrupted { .. }
        | Error::BadImage(_)
        | Error::Unsupported(_)
        | Error::ShutDown(_)
        | Error::NotExt4(_)
        | Error::InUse(_) => e.to_string(),
        Error::InvalidInput(d) | Error::NotPermitted(d) if !d.is_empty() => {
            format!("{} ({d})", strerror(e.errno()))
        }
        _ => strerror(e.errno()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_read_like_coreutils() {
        assert_eq!(reason(&Error::NotFound), "No such file or directory");
        let missing = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(reason(&Error::Io(missing)), "No such file or directory");
        assert_eq!(
            reason(&Error::InvalidInput("x".into())),
            "Invalid argument (x)"
        );
        assert!(reason(&Error::NotExt4("no magic".into())).starts_with("not an ext4 filesystem"));
        assert!(reason(&Error::corrupted("bad", Some(3))).contains("corrupted"));
        assert!(!strerror(libc::EEXIST).contains("os error"));
        assert_eq!(tidy("x: File exists (os error 17)"), "x: File exists");
    }
}
