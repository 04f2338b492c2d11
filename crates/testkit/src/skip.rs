//! Skipping a test the machine cannot run, and refusing to where every test must run.
//!
//! Owns: `skip` (the one way a test of this project skips), `require_all`, the skip log.
//! Must hold: with `REXT4_REQUIRE_ALL` set (CI: root, /dev/fuse, loop devices, the
//! tools scripts/test.sh installs, FUSE-over-io_uring turned on) a skip is a failure:
//! `skip` panics with the reason, so a test cannot pass without having checked. Without
//! it, `skip` prints "SKIP: reason" and appends one line to the file `REXT4_SKIP_LOG`
//! names (scripts/test.sh counts them: cargo test shows no output of a passing test).

use std::io::Write;
use std::path::Path;

/// Set (to anything but "" or "0") to make every skip a failure.
pub const REQUIRE_ALL_ENV: &str = "REXT4_REQUIRE_ALL";
/// A file each skip appends "test<TAB>reason" to.
pub const SKIP_LOG_ENV: &str = "REXT4_SKIP_LOG";

/// Whether skips are failures here (`REXT4_REQUIRE_ALL`).
pub fn require_all() -> bool {
    std::env::var_os(REQUIRE_ALL_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The test cannot run here for `reason` (not root, no /dev/fuse, a tool missing...):
/// call it, then return from the test (or leave out the part that cannot run).
///
/// # Panics
/// With `REXT4_REQUIRE_ALL` set: the test fails with the reason.
pub fn skip(reason: &str) {
    let log = std::env::var_os(SKIP_LOG_ENV);
    skip_with(
        reason,
        require_all(),
        log.as_deref()
            .map(Path::new)
            .filter(|p| !p.as_os_str().is_empty()),
    );
}

/// Linux capability numbers [`skip_without_capability`] knows.
pub const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process has capability `cap` in its effective set.
pub fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|eff| eff & (1 << cap) != 0)
}

/// The part of a test that needs capability `cap` cannot run: a container may withhold
/// it even from root, and then CI's machine (one like this) cannot run that part
/// either, so it is skipped and logged even under `REXT4_REQUIRE_ALL`. Only where the
/// capability really is missing: with it, this is an ordinary [`skip`] (a failure
/// under `REXT4_REQUIRE_ALL`).
pub fn skip_without_capability(cap: u32, reason: &str) {
    let log = std::env::var_os(SKIP_LOG_ENV);
    skip_with(
        &format!("{reason} (capability {cap} is withheld here)"),
        require_all() && has_capability(cap),
        log.as_deref()
            .map(Path::new)
            .filter(|p| !p.as_os_str().is_empty()),
    );
}

/// `skip`, with the switch and the log given rather than read from the environment.
fn skip_with(reason: &str, require_all: bool, log: Option<&Path>) {
    let test = test_name();
    if require_all {
        panic!("{test} cannot run here: {reason} (and {REQUIRE_ALL_ENV} forbids skipping)");
    }
    eprintln!("SKIP: {reason}");
    if let Some(log) = log {
        // One write of one line to a file opened for appending: lines of tests running
        // at the same time do not interleave.
        let line = format!("{test}\t{}\n", reason.replace(['\n', '\t'], " "));
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            eprintln!(
                "rext4-testkit: cannot record the skip in {}: {e}",
                log.display()
            );
        }
    }
}

/// "binary::test" of the running test: the test harness names each test's thread after
/// the test; the binary's name loses cargo's `-<hash>` suffix.
fn test_name() -> String {
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "?".into());
    let binary = match exe.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => exe,
    };
    let thread = std::thread::current();
    match thread.name() {
        Some(t) if t != "main" => format!("{binary}::{t}"),
        _ => binary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_logged_with_the_test_and_its_reason() {
        let dir = crate::TempDir::new("skip").expect("temp dir");
        let log = dir.join("skips");
        skip_with("no /dev/fuse", false, Some(&log));
        skip_with("two\nlines", false, Some(&log));
        let text = std::fs::read_to_string(&log).expect("log");
        let lines: Vec<&str> = text.lines().collect();
        let me = "rext4_testkit::skip::tests::a_skip_is_logged_with_the_test_and_its_reason";
        assert_eq!(
            lines,
            [
                format!("{me}\tno /dev/fuse").as_str(),
                format!("{me}\ttwo lines").as_str()
            ]
        );
    }

    #[test]
    fn a_skip_is_a_failure_when_every_test_must_run() {
        let dir = crate::TempDir::new("skip").expect("temp dir");
        let log = dir.join("skips");
        let r = std::panic::catch_unwind(|| skip_with("not root", true, Some(&log)));
        let msg = r.expect_err("skip must panic under REXT4_REQUIRE_ALL");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("not root") && msg.contains(REQUIRE_ALL_ENV),
            "{msg}"
        );
        assert!(!log.exists(), "a failure is not a skip");
    }

    #[test]
    fn without_a_log_a_skip_only_prints() {
        skip_with("tool missing", false, None);
    }
}
