//! Wrappers around the real e2fsprogs tools: mkfs.ext4, debugfs, e2fsck, dumpe2fs.
//!
//! Owns: building images (`mkfs`), running debugfs scripts, the e2fsck oracle
//! (`e2fsck_fn`: exit code 0 is not enough, the output must hold nothing but the banner,
//! the five "Pass N" lines and the summary line), and parsing `dumpe2fs -h`.
//! Must hold: no tool ever reads a config or a script we did not choose
//! (`MKE2FS_CONFIG` is set explicitly for the upstream config); tool failures come back
//! as `io::Error` carrying the tool's stderr. Called by the testkit's fixtures and by the
//! engine's and CLI's integration tests.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::tmp::{Image, TempDir};

/// File name of the upstream (e2fsprogs 1.47.0 release) mke2fs profile in this crate's
/// `fixtures/`.
pub const UPSTREAM_CONF: &str = "mke2fs-upstream-1.47.0.conf";

/// The upstream mke2fs profile (`MKE2FS_CONFIG=`): it turns on metadata_csum_seed and
/// orphan_file for ext4, which Debian's packaged profile leaves off. It ships with this
/// crate, so a clone of the repository alone runs every test.
pub fn upstream_conf_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(UPSTREAM_CONF)
}

/// Options for `mkfs`.
#[derive(Clone, Debug)]
pub struct MkfsOptions {
    /// `-b`; 0 lets mke2fs choose.
    pub block_size: u32,
    /// Size of the sparse image file (and the fs size passed to mke2fs).
    pub size_bytes: u64,
    /// Use `MKE2FS_CONFIG=` [`upstream_conf_path`] instead of Debian's /etc/mke2fs.conf
    /// (upstream adds metadata_csum_seed and orphan_file).
    pub upstream_conf: bool,
    /// Extra arguments placed before the image path (e.g. `-O ^has_journal`, `-I 128`).
    pub extra_args: Vec<String>,
    /// `-U`.
    pub uuid: Option<String>,
    /// `-N` (inode count).
    pub inodes: Option<u32>,
}

impl Default for MkfsOptions {
    /// 4 KiB blocks, 256 MiB (mke2fs's "small" type: one inode per 4 KiB, 65,536 inodes),
    /// Debian's config.
    fn default() -> Self {
        MkfsOptions {
            block_size: 4096,
            size_bytes: 256 << 20,
            upstream_conf: false,
            extra_args: Vec::new(),
            uuid: None,
            inodes: None,
        }
    }
}

impl MkfsOptions {
    pub fn new(block_size: u32, size_bytes: u64) -> Self {
        MkfsOptions {
            block_size,
            size_bytes,
            ..Default::default()
        }
    }

    pub fn upstream(mut self, yes: bool) -> Self {
        self.upstream_conf = yes;
        self
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.extra_args.push(a.to_string());
        self
    }
}

fn tool_error(tool: &str, out: &Output) -> io::Error {
    io::Error::other(format!(
        "{tool} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// Runs `mkfs.ext4 -q -F [-b BS] [-U uuid] [-N inodes] EXTRA... IMG SIZEk` on a fresh
/// sparse image file and returns its guard.
pub fn mkfs(opts: &MkfsOptions) -> io::Result<Image> {
    let img = Image::create_sparse(opts.size_bytes)?;
    mkfs_at(img.path(), opts)?;
    Ok(img)
}

/// `mkfs` onto an existing file or device (the file is not resized).
pub fn mkfs_at(path: &Path, opts: &MkfsOptions) -> io::Result<()> {
    let mut cmd = Command::new("mkfs.ext4");
    if opts.upstream_conf {
        cmd.env("MKE2FS_CONFIG", upstream_conf_path());
    } else {
        cmd.env_remove("MKE2FS_CONFIG");
    }
    cmd.args(["-q", "-F"]);
    if opts.block_size != 0 {
        cmd.arg("-b").arg(opts.block_size.to_string());
    }
    if let Some(u) = &opts.uuid {
        cmd.arg("-U").arg(u);
    }
    if let Some(n) = opts.inodes {
        cmd.arg("-N").arg(n.to_string());
    }
    cmd.args(&opts.extra_args);
    cmd.arg(path);
    cmd.arg(format!("{}k", opts.size_bytes / 1024));
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(tool_error("mkfs.ext4", &out));
    }
    Ok(())
}

/// Raw result of one debugfs run.
#[derive(Clone, Debug)]
pub struct DebugfsOutput {
    pub stdout: Vec<u8>,
    /// stderr without the version banner line.
    pub stderr: String,
}

impl DebugfsOutput {
    /// stdout followed by stderr, lossily decoded.
    pub fn text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.stdout).into_owned();
        s.push_str(&self.stderr);
        s
    }
}

fn strip_banner(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !(l.starts_with("debugfs ") && l.ends_with(')')))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Runs `debugfs -w -f SCRIPT IMG` with `script` (raw bytes: names may be non-UTF-8).
pub fn debugfs_script(img: &Path, script: &[u8], write: bool) -> io::Result<DebugfsOutput> {
    let dir = TempDir::new("dbgfs")?;
    let sp = dir.join("script");
    std::fs::write(&sp, script)?;
    let mut cmd = Command::new("debugfs");
    if write {
        cmd.arg("-w");
    }
    let out = cmd.arg("-f").arg(&sp).arg(img).output()?;
    if !out.status.success() {
        return Err(tool_error("debugfs", &out));
    }
    Ok(DebugfsOutput {
        stdout: out.stdout,
        stderr: strip_banner(&out.stderr),
    })
}

/// Runs a debugfs script read-write and returns stdout + stderr (banner removed).
/// debugfs reports failed commands only as text; see `debugfs_w_checked`.
pub fn debugfs_w(img: &Path, script: impl AsRef<[u8]>) -> io::Result<String> {
    Ok(debugfs_script(img, script.as_ref(), true)?.text())
}

/// Like `debugfs_w`, but any stderr output (debugfs prints command errors there) is an
/// error carrying that text.
pub fn debugfs_w_checked(img: &Path, script: impl AsRef<[u8]>) -> io::Result<String> {
    let out = debugfs_script(img, script.as_ref(), true)?;
    if !out.stderr.is_empty() {
        return Err(io::Error::other(format!(
            "debugfs reported errors:\n{}",
            out.stderr
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `debugfs -R CMD IMG` (read-only); stdout + stderr without the banner.
pub fn debugfs_r(img: &Path, cmd: &str) -> io::Result<String> {
    let out = debugfs_r_raw(img, cmd)?;
    Ok(out.text())
}

/// `debugfs -R CMD IMG` (read-only) with stdout as raw bytes (for `cat`, `dump -`).
pub fn debugfs_r_raw(img: &Path, cmd: &str) -> io::Result<DebugfsOutput> {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(cmd)
        .arg(img)
        .output()?;
    if !out.status.success() {
        return Err(tool_error("debugfs", &out));
    }
    Ok(DebugfsOutput {
        stdout: out.stdout,
        stderr: strip_banner(&out.stderr),
    })
}

/// Depth of the extent tree of `path` inside `img` (0 = extents in the inode), from
/// `debugfs -R "ex PATH"`; `None` if the file has no extent entries at all.
pub fn extent_depth(img: &Path, path: &str) -> io::Result<Option<u32>> {
    let out = debugfs_r(img, &format!("ex {path}"))?;
    // Data lines start with "LEVEL/ MAX": " 0/ 2   1/  3     0 - 5999 ...".
    for line in out.lines() {
        let t = line.trim_start();
        let Some((lvl, rest)) = t.split_once('/') else {
            continue;
        };
        if lvl.trim().parse::<u32>().is_err() {
            continue;
        }
        let max = rest.split_whitespace().next().unwrap_or("");
        if let Ok(m) = max.parse::<u32>() {
            return Ok(Some(m));
        }
    }
    Ok(None)
}

/// "Indirect levels" of the htree of directory `path`, or `None` if it is not indexed.
pub fn htree_levels(img: &Path, path: &str) -> io::Result<Option<u32>> {
    let out = debugfs_r(img, &format!("htree_dump {path}"))?;
    for line in out.lines() {
        if let Some(v) = line.trim().strip_prefix("Indirect levels:") {
            return Ok(v.trim().parse().ok());
        }
    }
    Ok(None)
}

/// Result of one e2fsck run.
#[derive(Clone, Debug)]
pub struct FsckReport {
    /// Process exit code (-1 if killed by a signal).
    pub exit_code: i32,
    /// stdout followed by stderr.
    pub output: String,
    /// Exit code 0 and nothing in the output but the banner, "Pass N" lines and the
    /// summary line.
    pub clean: bool,
}

impl FsckReport {
    /// Clean but for e2fsck's extent-tree optimization notices ("Inode N extent tree
    /// (at level L) could be narrower/shorter.  Optimize? no"; exit code 0). They say
    /// a repack would use fewer tree blocks, not that anything is wrong: a tree whose
    /// nodes were half emptied by punches, truncates or merges gets them — the
    /// kernel's own trees for the same workloads do too, since neither it nor rext4
    /// repacks nodes.
    pub fn clean_but_repack_hints(&self) -> bool {
        let rest: String = self
            .output
            .lines()
            .filter(|l| {
                let l = l.trim();
                !(l.starts_with("Inode ")
                    && l.contains(" extent tree (at level ")
                    && (l.ends_with("could be narrower.  Optimize? no")
                        || l.ends_with("could be shorter.  Optimize? no")))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        self.exit_code == 0 && fsck_output_is_clean(&rest)
    }
}

/// True if `line` is e2fsck's final summary, e.g.
/// "fs.img: 11/65536 files (0.0% non-contiguous), 12345/262144 blocks".
fn is_summary_line(line: &str) -> bool {
    let Some((_, rest)) = line.rsplit_once(": ") else {
        return false;
    };
    let mut w = rest.split(' ');
    let frac = |s: Option<&str>| {
        s.and_then(|s| s.split_once('/'))
            .is_some_and(|(a, b)| a.parse::<u64>().is_ok() && b.parse::<u64>().is_ok())
    };
    frac(w.next())
        && w.next() == Some("files")
        && w.next()
            .is_some_and(|s| s.starts_with('(') && s.ends_with('%'))
        && w.next() == Some("non-contiguous),")
        && frac(w.next())
        && w.next() == Some("blocks")
        && w.next().is_none()
}

/// True if the e2fsck output holds only what a clean forced check prints.
pub fn fsck_output_is_clean(output: &str) -> bool {
    let mut summary = false;
    for line in output.lines() {
        let l = line.trim_end();
        if l.is_empty() {
            continue;
        }
        if l.starts_with("e2fsck ") && l.ends_with(')') {
            continue;
        }
        if l.starts_with("Pass ") && l.contains(": ") {
            continue;
        }
        if is_summary_line(l) {
            summary = true;
            continue;
        }
        return false;
    }
    summary
}

/// An e2fsck.conf that turns off only the superblock time checks: they compare the
/// image's mount/write times with this machine's clock, which can step backwards here
/// between a write and the check ("last write time is in the future"). No check of
/// the filesystem's structure depends on it.
fn e2fsck_conf() -> Option<std::path::PathBuf> {
    static CONF: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    CONF.get_or_init(|| {
        // One shared file (not one per test process): written under a private name
        // and renamed into place, so concurrent writers never expose a partial file.
        const TEXT: &str = "[options]\n\tbroken_system_clock = 1\n";
        let p = std::env::temp_dir().join("rext4-e2fsck-broken-clock.conf");
        if std::fs::read_to_string(&p).ok().as_deref() != Some(TEXT) {
            let tmp = p.with_extension(format!("{}.tmp", std::process::id()));
            std::fs::write(&tmp, TEXT).ok()?;
            std::fs::rename(&tmp, &p).ok()?;
        }
        Some(p)
    })
    .clone()
}

fn run_e2fsck(img: &Path, flags: &[&str]) -> FsckReport {
    let mut cmd = Command::new("e2fsck");
    if let Some(conf) = e2fsck_conf() {
        cmd.env("E2FSCK_CONFIG", conf);
    }
    let res = cmd.args(flags).arg(img).output();
    let (exit_code, output) = match res {
        Ok(out) => {
            let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
            s.push_str(&String::from_utf8_lossy(&out.stderr));
            (out.status.code().unwrap_or(-1), s)
        }
        Err(e) => (-1, format!("cannot run e2fsck: {e}")),
    };
    let clean = exit_code == 0 && fsck_output_is_clean(&output);
    FsckReport {
        exit_code,
        output,
        clean,
    }
}

/// `e2fsck -fn IMG`: the read-only oracle. Prints the whole output to stderr when the
/// result is not clean.
pub fn e2fsck_fn(img: &Path) -> FsckReport {
    let r = run_e2fsck(img, &["-fn"]);
    if !r.clean {
        eprintln!(
            "e2fsck -fn {} (exit {}) is not clean:\n{}",
            img.display(),
            r.exit_code,
            r.output
        );
    }
    r
}

/// `e2fsck -fy IMG` (repairs; exit code 1 means "fixed"). `clean` is computed as for
/// `e2fsck_fn`; nothing is printed.
pub fn e2fsck_fy(img: &Path) -> FsckReport {
    run_e2fsck(img, &["-fy"])
}

/// `e2fsck FLAGS... IMG`, e.g. `&["-fyD"]`.
pub fn e2fsck_with(img: &Path, flags: &[&str]) -> FsckReport {
    run_e2fsck(img, flags)
}

/// `dumpe2fs -h IMG` as "Key" -> "value" (first occurrence wins; values trimmed).
pub fn dumpe2fs_h(img: &Path) -> io::Result<BTreeMap<String, String>> {
    let out = Command::new("dumpe2fs").arg("-h").arg(img).output()?;
    if !out.status.success() {
        return Err(tool_error("dumpe2fs", &out));
    }
    Ok(parse_dumpe2fs(&String::from_utf8_lossy(&out.stdout)))
}

/// Parses "Key:   value" lines (keys never contain ':'; values may).
pub fn parse_dumpe2fs(text: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with(char::is_whitespace) {
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            let k = k.trim();
            if k.is_empty() {
                continue;
            }
            m.entry(k.to_string())
                .or_insert_with(|| v.trim().to_string());
        }
    }
    m
}

/// Block size of an image (from `dumpe2fs -h`).
pub fn image_block_size(img: &Path) -> io::Result<u32> {
    let h = dumpe2fs_h(img)?;
    h.get("Block size")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::other("dumpe2fs -h: no Block size"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_line_parser() {
        assert!(is_summary_line(
            "fs.img: 11/65536 files (0.0% non-contiguous), 12345/262144 blocks"
        ));
        assert!(!is_summary_line(
            "fs.img: 11/65536 files (0.0% non-contiguous), 12345/262144 blocks extra"
        ));
        assert!(!is_summary_line("Inode 12 has illegal block(s)."));
        let clean = "e2fsck 1.47.0 (5-Feb-2023)\nPass 1: Checking inodes, blocks, and sizes\n\
                     Pass 5: Checking group summary information\n\
                     x: 11/16 files (0.0% non-contiguous), 1/2 blocks\n";
        assert!(fsck_output_is_clean(clean));
        let dirty = format!("{clean}Free blocks count wrong (1, counted=2).\n");
        assert!(!fsck_output_is_clean(&dirty));
        assert!(!fsck_output_is_clean("e2fsck 1.47.0 (5-Feb-2023)\n"));
    }

    #[test]
    fn dumpe2fs_parser() {
        let m = parse_dumpe2fs(
            "Filesystem volume name:   <none>\nBlock size:               1024\n\
             Filesystem created:       Mon Jan  1 00:00:00 2024\n",
        );
        assert_eq!(m.get("Block size").map(String::as_str), Some("1024"));
        assert_eq!(
            m.get("Filesystem created").map(String::as_str),
            Some("Mon Jan  1 00:00:00 2024")
        );
    }

    #[test]
    fn mkfs_then_fsck_clean_and_dumpe2fs() {
        for upstream in [false, true] {
            let opts = MkfsOptions {
                block_size: 1024,
                size_bytes: 32 << 20,
                upstream_conf: upstream,
                uuid: Some("0b9e1f43-3b1a-4b41-a7a2-9f61f2f4f9a1".into()),
                inodes: Some(4096),
                ..Default::default()
            };
            let img = mkfs(&opts).expect("mkfs");
            let r = e2fsck_fn(img.path());
            assert!(r.clean, "{}", r.output);
            let h = dumpe2fs_h(img.path()).expect("dumpe2fs");
            assert_eq!(h.get("Block size").map(String::as_str), Some("1024"));
            assert_eq!(h.get("Inode count").map(String::as_str), Some("4096"));
            assert_eq!(
                h.get("Filesystem UUID").map(String::as_str),
                Some("0b9e1f43-3b1a-4b41-a7a2-9f61f2f4f9a1")
            );
            let feats = h.get("Filesystem features").cloned().unwrap_or_default();
            assert_eq!(feats.contains("orphan_file"), upstream, "{feats}");
            assert_eq!(feats.contains("metadata_csum_seed"), upstream, "{feats}");
        }
    }

    #[test]
    fn fsck_detects_damage() {
        let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
        // Claim a wrong link count on the root directory.
        debugfs_w(img.path(), "sif / links_count 7\n").expect("debugfs");
        let r = run_e2fsck(img.path(), &["-fn"]);
        assert!(!r.clean);
        assert_ne!(r.exit_code, 0);
        let r = e2fsck_fy(img.path());
        assert_eq!(r.exit_code, 1, "{}", r.output);
        assert!(e2fsck_fn(img.path()).clean);
    }
}
