//! `rext4 io`, the xfs_io-like shell, against xfs_io itself: the same command lists run
//! by xfs_io on a kernel loop mount of one image and by `rext4 io` on its twin must give
//! the same output (timings and physical block numbers masked: the report lines up to
//! "N ops;", hexdumps, stat fields, fiemap logical ranges, totals and flags), the same
//! error lines and exit codes, and the same file bytes, size and allocation as the
//! kernel reads them back; e2fsck must pass on the rext4 side. Without root or xfs_io
//! the outputs are checked against a transcript recorded from xfs_io 6.1 on Linux 6.18
//! ext4 (4 KiB blocks).

mod common;

use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::process::{Command, Stdio};

use common::{rext4, spec};
use rext4_testkit::tree::hash_file;
use rext4_testkit::{e2fsck_fn, mkfs, skip, Image, LoopMount, MkfsOptions};

/// Exit code, stdout, stderr.
type Out = (i32, String, String);

fn image() -> Image {
    mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs.ext4")
}

fn cmd_args(flags: &[&str], cmds: &[&str]) -> Vec<OsString> {
    let mut a: Vec<OsString> = flags.iter().map(OsString::from).collect();
    for c in cmds {
        a.push("-c".into());
        a.push(c.into());
    }
    a
}

fn run_rext4_io(img: &Path, path: &str, flags: &[&str], cmds: &[&str]) -> Out {
    let mut a = vec![OsString::from("io")];
    a.extend(cmd_args(flags, cmds));
    a.push(spec(img, path));
    let r = rext4(&a);
    (r.code, r.stdout_str(), r.stderr)
}

fn run_xfs_io(file: &Path, flags: &[&str], cmds: &[&str]) -> Out {
    let out = Command::new("xfs_io")
        .args(cmd_args(flags, cmds))
        .arg(file)
        .stdin(Stdio::null())
        .output()
        .expect("run xfs_io");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn have_xfs_io() -> bool {
    Command::new("xfs_io")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Output with what legitimately differs masked: timings and rates (the report line
/// keeps "SIZE, N ops;"), the file's path, inode number, and physical block ranges
/// (fiemap's BLOCK-RANGE column; its width follows the digits, so -v lines are
/// compared as whitespace-separated fields).
fn normalize(out: &str) -> Vec<String> {
    let mut v = Vec::new();
    for line in out.lines() {
        if let Some(m) = mmap_line(line) {
            v.push(m);
        } else if let Some((head, _)) = line.split_once(" ops; ") {
            v.push(format!("{head} ops; <time>"));
        } else if line.starts_with("fd.path = ") {
            v.push("fd.path = <path>".into());
        } else if line.starts_with("stat.ino = ") {
            v.push("stat.ino = <ino>".into());
        } else if line.ends_with(':') && !line.starts_with(' ') && !line.starts_with('\t') {
            v.push("<path>:".into());
        } else if line.starts_with('\t') || line.starts_with(' ') {
            // fiemap lines: mask the physical range after the file range.
            let mut f: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            if f.len() >= 3 && f[1].starts_with('[') && f[2] != "hole" {
                f[2] = "<phys>".into();
            }
            v.push(f.join(" "));
        } else {
            v.push(line.to_string());
        }
    }
    v
}

/// The command lists both tools run, in order: S1, S3 and S4 on file "f", S2 on a
/// fresh "f2" (after a shrinking truncate the kernel keeps an emptied extent tree
/// block that the engine folds back into the inode, so st_blocks would differ by one
/// block on a file whose tree once grew), S5 on "g".
const S1: &[&str] = &[
    "pwrite 0 64k",
    "pwrite -S 0x41 -b 8k 100k 20k",
    "pread -v 0 48",
    "pread -v 65530 20",
    "pread 0 1m",
    "truncate 1m",
    "falloc 2m 1m",
    "falloc -k 4m 64k",
    "fpunch 8k 8k",
    "fzero 200k 4k",
    "fzero -k 5m 4k",
    "fsync",
    "fdatasync",
    "stat",
    "fiemap",
    "fiemap -v",
    "fiemap -v 0 8k",
    "fiemap 20k",
    "fiemap 4k 12k",
    "fiemap 8k 16k",
    "pread -v 8188 16",
    "pwrite -S 0x5a 2101248 100",
    "fiemap -v",
    "pread -v 2101240 120",
];

const S2: &[&str] = &[
    "pwrite 1s 1b",
    "pwrite -S 300 0x3000 3",
    "truncate 10000",
    "fiemap",
    "fiemap -v",
    "fiemap -l",
    "stat",
    "pread -v 4600 16",
    "truncate 2",
    "pread -v 0 10",
    "fiemap",
];

/// Failures in the middle: the following commands still run; the exit code is 1.
const S3: &[&str] = &[
    "falloc 0 0",
    "pwrite 17t 1",
    "truncate 17t",
    "pwrite -S zz 0 1",
    "pwrite 0 1x",
    "pread -v 0 4",
];

/// With -r: writes fail as on a read-only descriptor, reads work.
const S4_RO: &[&str] = &[
    "pwrite 0 1",
    "falloc 0 4k",
    "fpunch 0 4k",
    "truncate 0",
    "pread -v 0 4",
    "fsync",
];

const S5_ENOSPC: &[&str] = &["pwrite 0 1g"];

/// Memory mappings over the page cache: mapped reads see pwrite's data and pwrite/pread
/// see mapped writes; past EOF inside the last page reads zeros; msync; the mapping
/// list, selecting and unmapping; refusals (a write through a read-only mapping would
/// kill xfs_io, so it is not in the list).
const S6_MMAP: &[&str] = &[
    "pwrite -q -S 0x41 0 10000",
    "mmap 0 12k",
    "mread -v 0 32",
    "mwrite -S 0x42 4096 100",
    "mread -v 4090 20",
    "mread -f 4090 20",
    "pread -v 4090 20",
    "pwrite -q -S 0x43 4200 8",
    "mread -v 4192 24",
    "mread -v 9990 20",
    "msync -s",
    "mmap",
    "mmap -r 0 4k",
    "mmap",
    "mread -v 4000 4",
    "mmap 0",
    "munmap",
    "mmap",
    "mread -v 0 4",
    "munmap",
    "mmap",
    "mread 0 4",
    "mmap 0 0",
    "mmap 1 4k",
    "pread -v 9990 20",
    "stat",
];

/// COLLAPSE_RANGE and INSERT_RANGE: data moves across pattern seams, the refusals
/// (reaching EOF, past EOF, unaligned, past the size limit), a write into an inserted
/// hole.
const S7_SHIFT: &[&str] = &[
    "pwrite -q -S 0x11 0 64k",
    "pwrite -q -S 0x22 64k 64k",
    "pwrite -q -S 0x33 128k 64k",
    "fcollapse 60k 8k",
    "stat",
    "pread -v 61436 8",
    "finsert 4k 12k",
    "pread -v 4092 8",
    "pread -v 16380 8",
    "fcollapse 0 4k",
    "fcollapse 100k 100k",
    "finsert 1m 4k",
    "fcollapse 1000 4096",
    "finsert 4k 17t",
    "pwrite -q -S 0x44 8k 100",
    "fsync",
    "pread -v 8190 8",
    "stat",
];

/// A line of `mmap`'s listing ("[000] 0xADDR - 0xADDR rwx  PATH (OFF : LEN)") with the
/// addresses and the path masked.
fn mmap_line(line: &str) -> Option<String> {
    let b = line.as_bytes();
    let tagged = b.len() > 6
        && (b[0] == b'[' || b[0] == b' ')
        && b[1..4].iter().all(u8::is_ascii_digit)
        && line[5..].starts_with(" 0x");
    if !tagged {
        return None;
    }
    let f: Vec<&str> = line[5..].split_whitespace().collect();
    // 0xADDR - 0xADDR PROT PATH (OFF : LEN)
    let tail = line.rsplit_once('(')?.1;
    Some(format!(
        "{} <addr> - <addr> {} <path> ({tail}",
        &line[..5],
        f.get(3)?
    ))
}

fn check_same(label: &str, kernel: &Out, ours: &Out) {
    assert_eq!(
        normalize(&ours.1),
        normalize(&kernel.1),
        "[{label}] stdout differs\n--- xfs_io:\n{}\n--- rext4 io:\n{}",
        kernel.1,
        ours.1
    );
    assert_eq!(
        ours.2.lines().collect::<Vec<_>>(),
        kernel.2.lines().collect::<Vec<_>>(),
        "[{label}] stderr differs"
    );
    assert_eq!(ours.0, kernel.0, "[{label}] exit code");
}

/// (size, content hash, st_blocks) of a file as the kernel reads it.
fn kernel_file(mnt: &Path, name: &str) -> (u64, u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let p = mnt.join(name);
    let md = std::fs::metadata(&p).expect("stat");
    (md.len(), hash_file(&p).expect("read"), md.blocks())
}

#[test]
fn io_matches_xfs_io_on_a_kernel_mount() {
    if !have_xfs_io() {
        skip("xfs_io is not installed (apt-get install xfsprogs)");
        return;
    }
    let a = image();
    let b = a.duplicate().expect("twin image");
    let kernel_outs: Vec<Out>;
    {
        let m = match LoopMount::new(a.path(), false, "") {
            Ok(m) => m,
            Err(why) => {
                skip(&why);
                return;
            }
        };
        let f = m.path().join("f");
        kernel_outs = vec![
            run_xfs_io(&f, &["-f"], S1),
            run_xfs_io(&m.path().join("f2"), &["-f"], S2),
            run_xfs_io(&f, &[], S3),
            run_xfs_io(&f, &["-r"], S4_RO),
            run_xfs_io(&m.path().join("f3"), &["-f"], S6_MMAP),
            run_xfs_io(&m.path().join("f4"), &["-f"], S7_SHIFT),
        ];
        m.unmount().expect("unmount");
    }
    let ours = [
        run_rext4_io(b.path(), "/f", &["-f"], S1),
        run_rext4_io(b.path(), "/f2", &["-f"], S2),
        run_rext4_io(b.path(), "/f", &[], S3),
        run_rext4_io(b.path(), "/f", &["-r"], S4_RO),
        run_rext4_io(b.path(), "/f3", &["-f"], S6_MMAP),
        run_rext4_io(b.path(), "/f4", &["-f"], S7_SHIFT),
    ];
    for (label, (k, o)) in ["S1", "S2", "S3", "S4", "S6", "S7"]
        .iter()
        .zip(kernel_outs.iter().zip(&ours))
    {
        check_same(label, k, o);
    }
    let f = e2fsck_fn(b.path());
    assert!(f.clean, "e2fsck after rext4 io:\n{}", f.output);
    // The kernel reads the same bytes, size and allocation from both images.
    let ka = LoopMount::new(a.path(), true, "noatime").expect("mount a");
    let kb = LoopMount::new(b.path(), true, "noatime").expect("mount b");
    for name in ["f", "f2", "f3", "f4"] {
        assert_eq!(
            kernel_file(kb.path(), name),
            kernel_file(ka.path(), name),
            "{name}"
        );
    }
    drop((ka, kb));

    // Filling the filesystem: ENOSPC reported the same way; the image stays consistent
    // and its space comes back after a remove.
    let k = {
        let m = LoopMount::new(a.path(), false, "").expect("mount a rw");
        run_xfs_io(&m.path().join("g"), &["-f"], S5_ENOSPC)
    };
    let o = run_rext4_io(b.path(), "/g", &["-f"], S5_ENOSPC);
    check_same("ENOSPC", &k, &o);
    let f = e2fsck_fn(b.path());
    assert!(f.clean, "e2fsck after ENOSPC:\n{}", f.output);
    let r = rext4(&[OsStr::new("rm"), &spec(b.path(), "/g")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let o = run_rext4_io(b.path(), "/h", &["-f"], &["pwrite -q 0 32m", "fsync"]);
    assert_eq!(o.0, 0, "space is usable again: {}", o.2);
    let f = e2fsck_fn(b.path());
    assert!(f.clean, "e2fsck after remove and rewrite:\n{}", f.output);
}

/// Recorded from `xfs_io -f -c ... f` (xfs_io 6.1, Linux 6.18 ext4, 4 KiB blocks),
/// normalized; the same commands as `S1` up to "fiemap -v".
const S1_GOLDEN: &str = "\
wrote 65536/65536 bytes at offset 0
64 KiB, 16 ops; <time>
wrote 20480/20480 bytes at offset 102400
20 KiB, 3 ops; <time>
00000000:  cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd  ................
00000010:  cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd  ................
00000020:  cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd cd  ................
read 48/48 bytes at offset 0
48.000000 bytes, 1 ops; <time>
0000fffa:  cd cd cd cd cd cd 00 00 00 00 00 00 00 00 00 00  ................
0001000a:  00 00 00 00  ....
read 20/20 bytes at offset 65530
20.000000 bytes, 1 ops; <time>
read 122880/1048576 bytes at offset 0
120 KiB, 30 ops; <time>
fd.path = <path>
fd.flags = non-sync,non-direct,read-write
stat.ino = <ino>
stat.type = regular file
stat.size = 3145728
stat.blocks = 2352
<path>:
0: [0..15]: <phys>
1: [16..31]: hole
2: [32..127]: <phys>
3: [128..199]: hole
4: [200..239]: <phys>
5: [240..399]: hole
6: [400..407]: <phys>
7: [408..4095]: hole
8: [4096..6143]: <phys>
9: [6144..8191]: hole
10: [8192..8319]: <phys>
11: [8320..10239]: hole
12: [10240..10247]: <phys>
<path>:
EXT: FILE-OFFSET BLOCK-RANGE TOTAL FLAGS
0: [0..15]: <phys> 16 0x0
1: [16..31]: hole 16
2: [32..127]: <phys> 96 0x0
3: [128..199]: hole 72
4: [200..239]: <phys> 40 0x0
5: [240..399]: hole 160
6: [400..407]: <phys> 8 0x800
7: [408..4095]: hole 3688
8: [4096..6143]: <phys> 2048 0x800
9: [6144..8191]: hole 2048
10: [8192..8319]: <phys> 128 0x800
11: [8320..10239]: hole 1920
12: [10240..10247]: <phys> 8 0x801";

#[test]
fn io_output_matches_recorded_xfs_io_transcript() {
    let img = image();
    let upto = S1.iter().position(|c| *c == "fiemap -v").expect("in S1") + 1;
    let (code, out, err) = run_rext4_io(img.path(), "/f", &["-f"], &S1[..upto]);
    assert_eq!((code, err.as_str()), (0, ""), "rext4 io failed");
    let want: Vec<String> = S1_GOLDEN.lines().map(str::to_string).collect();
    assert_eq!(normalize(&out), want, "rext4 io output:\n{out}");
    // The verbose fiemap keeps xfs_io's column layout.
    let header = out
        .lines()
        .find(|l| l.contains("FILE-OFFSET"))
        .expect("fiemap -v header");
    assert_eq!(
        header,
        " EXT: FILE-OFFSET      BLOCK-RANGE      TOTAL FLAGS"
    );
    let hole = out
        .lines()
        .find(|l| l.starts_with("   1: "))
        .expect("fiemap -v hole line");
    assert_eq!(hole, "   1: [16..31]:        hole                16");
    let f = e2fsck_fn(img.path());
    assert!(f.clean, "e2fsck:\n{}", f.output);
}

#[test]
fn io_errors_and_exit_codes() {
    let img = image();
    // A missing file without -f: exit 1, nothing created.
    let (code, out, err) = run_rext4_io(img.path(), "/nope", &[], &["pwrite 0 1"]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert!(err.contains("/nope: No such file or directory"), "{err}");
    // Failures keep the following commands running; exit 1 at the end.
    let (code, out, err) = run_rext4_io(
        img.path(),
        "/f",
        &["-f"],
        &[
            "pwrite 0 4",
            "bogus",
            "falloc 0 0",
            "fpunch 0",
            "pwrite -x 0 1",
            "truncate 1y",
            "pread -v 0 4",
        ],
    );
    assert_eq!(code, 1);
    let errs: Vec<&str> = err.lines().collect();
    assert_eq!(
        errs,
        [
            "command \"bogus\" not found",
            "fallocate: Invalid argument",
            "bad argument count 1 to fpunch, expected 2 arguments",
            "pwrite: invalid option -- 'x'",
        ]
    );
    // As xfs_io: the usage line and argument complaints go to stdout.
    assert!(
        out.contains("\npwrite [-b bs] [-S seed] [-q] off len -- writes a number of bytes at a specified offset\n"),
        "{out}"
    );
    assert!(
        out.contains("\nnon-numeric truncate argument -- 1y\n"),
        "{out}"
    );
    assert!(
        out.contains("00000000:  cd cd cd cd  ....\nread 4/4 bytes at offset 0\n"),
        "{out}"
    );
    // quit stops early and succeeds.
    let (code, out, _) = run_rext4_io(img.path(), "/f", &[], &["quit", "pwrite 0 1"]);
    assert_eq!((code, out.as_str()), (0, ""));
    // -r does not modify the image at all.
    let before = std::fs::read(img.path()).expect("read image");
    let (code, _, err) = run_rext4_io(img.path(), "/f", &["-r"], &["pwrite 0 1", "pread 0 1"]);
    assert_eq!(code, 1);
    assert_eq!(err.trim(), "pwrite: Bad file descriptor");
    assert!(
        std::fs::read(img.path()).expect("read image") == before,
        "-r wrote to the image"
    );
    // A directory can be inspected; data commands fail on it.
    let (code, out, err) = run_rext4_io(img.path(), "/", &["-r"], &["stat", "pread 0 1"]);
    assert_eq!(code, 1);
    assert!(out.contains("stat.type = directory\n"), "{out}");
    assert_eq!(err.trim(), "pread: Is a directory");
    let f = e2fsck_fn(img.path());
    assert!(f.clean, "e2fsck:\n{}", f.output);
}
