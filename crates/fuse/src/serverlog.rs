//! Where the mount's messages go: one `log` logger for the transport (fuser), the
//! adapter and the engine (writeback failures, open warnings).
//!
//! Sinks: standard error (`rext4 mount -f`, and every other rext4 command), syslog
//! (the daemon, by default: ident `rext4`, facility daemon, so journald shows them
//! under `journalctl -t rext4`), or a file (`-o log=FILE`, appended to, one line per
//! record with time, pid and mount point). While a daemon starts, warnings also go to
//! the standard error of the `rext4 mount` that started it, which the user sees.
//!
//! Levels: warnings and errors always; what the mount does (started, stopped) at info
//! to syslog and files only; everything with `-o debug`. fuser's own info lines
//! ("Mounting ...") stay below the line unless `-o debug`.
//!
//! syslog goes through libc's openlog/syslog: without a /dev/log (no syslog daemon,
//! a container) records are dropped silently, never an error.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use log::{Level, LevelFilter, Log, Metadata, Record};

/// Where records go.
pub(crate) enum Sink {
    Stderr,
    Syslog,
    File(File),
}

struct ServerLog {
    sink: RwLock<Sink>,
    /// The mount point, named in syslog and file records.
    label: RwLock<String>,
    /// Also print warnings on standard error (a daemon still starting up).
    mirror: AtomicBool,
    debug: AtomicBool,
}

static LOGGER: ServerLog = ServerLog {
    sink: RwLock::new(Sink::Stderr),
    label: RwLock::new(String::new()),
    mirror: AtomicBool::new(false),
    debug: AtomicBool::new(false),
};

/// Install the logger, writing to standard error (warnings and errors). A logger an
/// embedding program set already stays, and then gets the records instead.
pub fn init_stderr_log() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Warn);
    }
}

/// Send the records from now on to `sink`, naming `label` (the mount point); with
/// `debug`, every record. `mirror`: warnings also to standard error until
/// [`stop_mirror`].
pub(crate) fn configure(sink: Sink, label: &Path, debug: bool, mirror: bool) {
    init_stderr_log();
    if matches!(sink, Sink::Syslog) {
        // SAFETY: the ident is a static C string, as openlog keeps the pointer.
        unsafe { libc::openlog(c"rext4".as_ptr(), libc::LOG_PID, libc::LOG_DAEMON) };
    }
    let to_stderr = matches!(sink, Sink::Stderr);
    *LOGGER.sink.write().unwrap_or_else(|p| p.into_inner()) = sink;
    *LOGGER.label.write().unwrap_or_else(|p| p.into_inner()) = label.display().to_string();
    LOGGER.mirror.store(mirror && !to_stderr, Ordering::SeqCst);
    LOGGER.debug.store(debug, Ordering::SeqCst);
    log::set_max_level(if debug {
        LevelFilter::Debug
    } else if to_stderr {
        LevelFilter::Warn
    } else {
        LevelFilter::Info
    });
}

/// The daemon's standard error is gone: stop printing warnings there.
pub(crate) fn stop_mirror() {
    LOGGER.mirror.store(false, Ordering::SeqCst);
}

fn is_ours(target: &str) -> bool {
    target.starts_with("rext4")
}

impl Log for ServerLog {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        if self.debug.load(Ordering::Relaxed) {
            return m.level() <= Level::Debug;
        }
        m.level() <= Level::Warn || (m.level() <= Level::Info && is_ours(m.target()))
    }

    fn log(&self, r: &Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let prefix = if is_ours(r.target()) {
            "rext4"
        } else {
            "rext4-fuse"
        };
        let sink = self.sink.read().unwrap_or_else(|p| p.into_inner());
        let label = self.label.read().unwrap_or_else(|p| p.into_inner());
        let stderr_line = || format!("{prefix}: {}: {}\n", r.level(), r.args());
        match &*sink {
            Sink::Stderr => {
                // Standard error may be closed or a broken pipe: nothing to do then.
                let _ = std::io::stderr().write_all(stderr_line().as_bytes());
                return;
            }
            Sink::Syslog => {
                let prio = match r.level() {
                    Level::Error => libc::LOG_ERR,
                    Level::Warn => libc::LOG_WARNING,
                    Level::Info => libc::LOG_INFO,
                    Level::Debug | Level::Trace => libc::LOG_DEBUG,
                };
                let text = format!("{label}: {}", r.args()).replace('\0', "\\0");
                if let Ok(c) = CString::new(text) {
                    // SAFETY: a constant "%s" format with one valid C string argument.
                    unsafe { libc::syslog(prio, c"%s".as_ptr(), c.as_ptr()) };
                }
            }
            Sink::File(f) => {
                let line = format!(
                    "{} rext4[{}] {label}: {}: {}\n",
                    local_time(),
                    std::process::id(),
                    r.level(),
                    r.args()
                );
                // One write per record; the file is opened for appending, so lines of
                // several threads or mounts do not interleave.
                let mut f: &File = f;
                let _ = f.write_all(line.as_bytes());
            }
        }
        if self.mirror.load(Ordering::Relaxed) && r.level() <= Level::Warn {
            let _ = std::io::stderr().write_all(stderr_line().as_bytes());
        }
    }

    fn flush(&self) {}
}

/// "YYYY-MM-DD HH:MM:SS" in local time.
fn local_time() -> String {
    // SAFETY: time(NULL) has no preconditions; localtime_r writes into the zeroed tm
    // we own and reads the time_t we pass.
    unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&t, &mut tm).is_null() {
            return t.to_string();
        }
        format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
            tm.tm_year + 1900,
            tm.tm_mon + 1,
            tm.tm_mday,
            tm.tm_hour,
            tm.tm_min,
            tm.tm_sec
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test drives the process-wide logger through its sinks in turn.
    #[test]
    fn records_reach_the_configured_sink() {
        let dir = rext4_testkit::TempDir::new("serverlog").expect("tempdir");
        let p = dir.join("log");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .expect("log file");
        configure(Sink::File(f), Path::new("/mnt/x"), false, false);
        log::info!("started");
        log::debug!("not shown without debug");
        log::warn!(target: "fuser::session", "transport warning");
        log::info!(target: "fuser::session", "transport chatter");
        let text = std::fs::read_to_string(&p).expect("read log");
        assert!(text.contains("/mnt/x: INFO: started"), "{text}");
        assert!(text.contains("/mnt/x: WARN: transport warning"), "{text}");
        assert!(
            !text.contains("not shown") && !text.contains("chatter"),
            "{text}"
        );
        assert!(
            text.contains(&format!("rext4[{}]", std::process::id())),
            "{text}"
        );
        // syslog without a /dev/log (or with one) neither fails nor panics.
        configure(Sink::Syslog, Path::new("/mnt/x"), false, false);
        log::warn!("to syslog");
        configure(Sink::Stderr, Path::new("/mnt/x"), false, false);
        assert!(!log::log_enabled!(Level::Info));
    }
}
