//! `rext4 resize` killed with SIGKILL at random points (issue 39, item 5 for resize):
//! every killed run leaves an image that, once recovered by rext4's open (its journal
//! replayed), is e2fsck -fn clean, holds the same tree, and has the old size or the
//! new one; running the same resize again then finishes it (clean, the new size).
//! Kills are spread over one uninterrupted run's duration, a grow 4x and a shrink to
//! the size `min` reaches in turn. `REXT4_RESIZE_KILLS` sets the count (default 8; the long run 200).
//! The crash device's cut points (lost and torn writes) are in the engine's
//! tests/resize.rs; this is the process-level check on a real file.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rext4::{FileType, Fs, FsOptions, Ino};
use rext4_testkit::crash::Rng;
use rext4_testkit::{e2fsck_fn, fixture_bytes, TempDir};

type Tree = BTreeMap<Vec<u8>, (u32, u64, Vec<u8>)>;

/// Every path with its mode, size and contents (a symlink's target; nothing for a
/// directory), as rext4 reads it.
fn tree(img: &Path) -> Tree {
    let fs = Fs::open(img).expect("open ro");
    let mut out = Tree::new();
    let mut stack = vec![(b"/".to_vec(), Ino::ROOT)];
    while let Some((path, ino)) = stack.pop() {
        for e in fs.read_dir_ino(ino).expect("read_dir") {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let mut p = path.clone();
            if p.len() > 1 {
                p.push(b'/');
            }
            p.extend_from_slice(&e.name);
            let m = fs.stat_ino(e.ino).expect("stat");
            let body = match m.file_type {
                FileType::Dir => {
                    stack.push((p.clone(), e.ino));
                    Vec::new()
                }
                FileType::Symlink => fs.read_link_ino(e.ino).expect("readlink"),
                FileType::File => fs.read(OsStr::from_bytes(&p)).expect("read"),
                _ => Vec::new(),
            };
            out.insert(p, (m.mode, m.size, body));
        }
    }
    out
}

fn blocks(img: &Path) -> u64 {
    Fs::open(img).expect("open").superblock().blocks_count
}

fn populate(img: &Path, tag: &str) {
    let fs = Fs::open_with(
        img,
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .expect("open rw");
    for d in 0..8u64 {
        let dir = format!("/{tag}{d}");
        fs.create_dir(&dir).expect("mkdir");
        for f in 0..25u64 {
            let n = [0usize, 100, 3000, 20_000, 90_000][(f % 5) as usize];
            fs.write(format!("{dir}/f{f}"), fixture_bytes(d * 1000 + f, n))
                .expect("write");
        }
        fs.symlink(format!("/{tag}{d}/f1"), format!("{dir}/link"))
            .expect("symlink");
    }
    fs.close().expect("close");
}

/// Open read-write and close: the journal replayed, as any read-write user does.
fn recover(img: &Path) {
    let fs = Fs::open_with(
        img,
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("open after kill: {e}"));
    fs.close().expect("close after kill");
}

fn resize_cmd(img: &Path, size: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rext4"));
    // Every move committed: each is a state a kill can leave.
    c.args(["resize", "--commit-every", "1"]).arg(img).arg(size);
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// One uninterrupted run: its duration, and the size it reaches.
fn timed(img: &Path, size: &str) -> (Duration, u64) {
    let t = Instant::now();
    let out = resize_cmd(img, size).output().expect("rext4 resize");
    assert!(
        out.status.success(),
        "rext4 resize {size}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (t.elapsed(), blocks(img))
}

#[test]
fn resize_killed_at_random_points_leaves_the_old_or_the_new_filesystem() {
    let dir = TempDir::new("rext4-resize-kill").expect("tmp");
    let small: PathBuf = dir.path().join("small.img");
    let run = common::rext4(&[
        OsStr::new("mkfs"),
        OsStr::new("-b"),
        OsStr::new("1024"),
        small.as_os_str(),
        OsStr::new("16M"),
    ]);
    assert_eq!(run.code, 0, "mkfs: {}", run.stderr);
    populate(&small, "a");
    // The grown image (more files, some in the new groups) is the shrink's base.
    let big = dir.path().join("big.img");
    std::fs::copy(&small, &big).expect("copy");
    let (grow_time, grow_to) = timed(&big, "64M");
    populate(&big, "b");
    let trees = [tree(&small), tree(&big)];
    let bases = [&small, &big];
    let old = [blocks(&small), blocks(&big)];
    let probe = dir.path().join("probe.img");
    std::fs::copy(&big, &probe).expect("copy");
    let (shrink_time, shrink_to) = timed(&probe, "min");
    std::fs::remove_file(&probe).expect("rm");
    // The shrink goes to the size `min` reached, given in blocks: a `min` rerun after
    // a kill starts from a half-evacuated image and may find another minimum.
    let shrink_arg = shrink_to.to_string();
    let sizes = ["64M", shrink_arg.as_str()];
    let times = [grow_time, shrink_time];
    let new = [grow_to, shrink_to];

    let kills: u64 = std::env::var("REXT4_RESIZE_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let mut rng = Rng(0x6b11 ^ kills);
    let img = dir.path().join("victim.img");
    let (mut killed, mut finished, mut at_new) = (0u64, 0u64, 0u64);
    // Where kills land: within one uninterrupted run's time, shortened whenever a run
    // finishes first (the first run was timed on a cold or busy machine).
    let mut span = [times[0].as_micros() as u64, times[1].as_micros() as u64];
    let mut delay = Duration::ZERO;
    for k in 0..kills {
        let w = (k % 2) as usize;
        for attempt in 0..4 {
            std::fs::copy(bases[w], &img).expect("copy");
            delay = Duration::from_micros(rng.below(span[w].max(1)));
            let mut child = resize_cmd(&img, sizes[w]).spawn().expect("spawn");
            std::thread::sleep(delay);
            // SAFETY: kill(2) on our own child's pid; no memory is involved.
            let _ = unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let status = child.wait().expect("wait");
            if status.signal() == Some(libc::SIGKILL) {
                killed += 1;
                break;
            }
            assert!(status.success(), "kill {k}: rext4 resize failed: {status}");
            finished += 1;
            span[w] = span[w] * 3 / 4;
            if attempt == 3 {
                break;
            }
        }
        let what = format!("kill {k} ({} after {delay:?})", sizes[w]);
        recover(&img);
        let r = e2fsck_fn(&img);
        assert!(r.clean, "{what}: e2fsck -fn not clean:\n{}", r.output);
        let b = blocks(&img);
        assert!(
            b == old[w] || b == new[w],
            "{what}: {b} blocks, neither {} nor {}",
            old[w],
            new[w]
        );
        at_new += u64::from(b == new[w]);
        assert!(tree(&img) == trees[w], "{what}: the tree changed");
        // The same resize again finishes the job.
        let out = resize_cmd(&img, sizes[w]).output().expect("rerun");
        assert!(
            out.status.success(),
            "{what}: rerun: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r = e2fsck_fn(&img);
        assert!(
            r.clean,
            "{what}: after the rerun, e2fsck -fn:\n{}",
            r.output
        );
        assert_eq!(blocks(&img), new[w], "{what}: rerun size");
        let len = std::fs::metadata(&img).expect("stat").len();
        assert_eq!(len, new[w] * 1024, "{what}: file length after the rerun");
        assert!(
            tree(&img) == trees[w],
            "{what}: the tree changed in the rerun"
        );
    }
    eprintln!(
        "{kills} runs: {killed} killed, {finished} tries finished first (retried); {at_new} \
         at the new size after the kill (grow {grow_time:?}, shrink {shrink_time:?} uninterrupted)"
    );
    assert!(
        killed * 2 >= kills,
        "too few runs were killed: {killed} of {kills}"
    );
}
