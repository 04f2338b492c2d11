//! The CLI at its edges (issue 12, items 5, 10-12): closed pipes, exit codes and the
//! words of messages, images that are not ext4, several operands, symbolic modes and
//! owner names, cp's destinations, mkfs's question and its root owner, and signals
//! during a writing command.

mod common;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};

use common::{read_superblock, rext4, spec, Run};
use rext4::Fs;
use rext4_testkit::{e2fsck_fn, skip, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_rext4");

fn s(x: &str) -> &OsStr {
    OsStr::new(x)
}

/// `rext4 mkfs -q IMG SIZE`, checked.
fn mkfs(img: &Path, size: &str) {
    let r = rext4(&[s("mkfs"), s("-q"), img.as_os_str(), s(size)]);
    assert_eq!(r.code, 0, "mkfs: {}", r.stderr);
}

fn run(parts: &[&OsStr], want: i32) -> Run {
    let r = rext4(parts);
    assert_eq!(r.code, want, "{parts:?}: stderr:\n{}", r.stderr);
    r
}

/// e2fsck -fn clean and the journal's needs_recovery flag clear: the image was closed.
fn assert_closed_clean(img: &Path, when: &str) {
    let sb = read_superblock(img);
    assert!(!sb.has_incompat(0x4), "{when}: needs_recovery is set");
    let r = e2fsck_fn(img);
    assert!(r.clean, "{when}: e2fsck -fn:\n{}", r.output);
}

/// A deterministic byte pattern for file `i`.
fn pattern(i: usize, len: usize) -> Vec<u8> {
    let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A host tree: `dirs` directories of `files` small files each, and one file of
/// `large` bytes per directory. Returns path (relative) → contents.
fn make_tree(root: &Path, dirs: usize, files: usize, large: usize) -> BTreeMap<String, Vec<u8>> {
    let mut all = BTreeMap::new();
    for d in 0..dirs {
        let dir = format!("d{d:02}");
        std::fs::create_dir_all(root.join(&dir)).expect("mkdir");
        for f in 0..files {
            let rel = format!("{dir}/f{f:04}");
            let data = pattern(d * 10_000 + f, 100 + f % 300);
            std::fs::write(root.join(&rel), &data).expect("write");
            all.insert(rel, data);
        }
        if large > 0 {
            let rel = format!("{dir}/large");
            let data = pattern(d, large);
            std::fs::write(root.join(&rel), &data).expect("write");
            all.insert(rel, data);
        }
    }
    all
}

/// Every entry below `dir` in the image: path relative to `dir` → file contents
/// (`None` for a directory).
fn image_tree(img: &Path, dir: &str) -> BTreeMap<String, Option<Vec<u8>>> {
    let fs = Fs::open(img).expect("open the image");
    let mut out = BTreeMap::new();
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let full = format!("{}/{rel}", dir.trim_end_matches('/'));
        for e in fs.read_dir(&full).expect("read_dir") {
            let name = String::from_utf8(e.name.clone()).expect("utf-8 name");
            if rel.is_empty() && name == "lost+found" {
                continue;
            }
            let child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let path = format!("{}/{child}", dir.trim_end_matches('/'));
            if fs.metadata(&path).expect("stat").is_dir() {
                out.insert(child.clone(), None);
                stack.push(child);
            } else {
                out.insert(child, Some(fs.read(&path).expect("read")));
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------
// Item 10: closed pipes

/// The write end of a pipe whose read end is already closed.
fn closed_pipe() -> Stdio {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 returns.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors are fresh and owned here; each is wrapped once.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    Stdio::from(write)
}

/// Run rext4 with stdout (and stderr when `close_err`) on a pipe nobody reads.
fn run_with_closed_output(args: &[&OsStr], close_err: bool) -> (ExitStatus, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(closed_pipe())
        .stderr(if close_err {
            closed_pipe()
        } else {
            Stdio::piped()
        })
        .spawn()
        .expect("spawn");
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err).expect("stderr");
    }
    (child.wait().expect("wait"), err)
}

/// `rext4 cat IMG:/f | head -c 10`, and ls, info, stat into a closed pipe: they end as
/// cat does (SIGPIPE), with no message and no panic.
#[test]
fn closed_stdout_ends_the_reading_commands_like_cat() {
    let d = TempDir::new("edges-pipe").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    let big = d.join("big");
    std::fs::write(&big, pattern(1, 3 << 20)).expect("write");
    run(&[s("cp"), big.as_os_str(), &spec(&img, "/big")], 0);

    // cat | head -c 10: the reader takes 10 bytes and goes away mid-stream.
    let mut child = Command::new(BIN)
        .args([s("cat"), &spec(&img, "/big")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut head = [0u8; 10];
    child
        .stdout
        .take()
        .expect("stdout")
        .read_exact(&mut head)
        .expect("10 bytes");
    assert_eq!(head[..], pattern(1, 10)[..]);
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    let st = child.wait().expect("wait");
    assert_eq!(st.signal(), Some(libc::SIGPIPE), "cat: {st:?} {err}");
    assert!(err.is_empty(), "cat printed: {err}");

    for args in [
        vec![s("ls"), s("-l"), &spec(&img, "/")],
        vec![s("info"), img.as_os_str()],
        vec![s("stat"), &spec(&img, "/big")],
        vec![s("cat"), &spec(&img, "/big"), &spec(&img, "/big")],
    ] {
        let (st, err) = run_with_closed_output(&args, false);
        assert_eq!(st.signal(), Some(libc::SIGPIPE), "{args:?}: {st:?} {err}");
        assert!(err.is_empty(), "{args:?} printed: {err}");
    }
}

/// A writing command whose stdout and stderr are closed (`... 2>&1 | head -1`) still
/// does all its work and closes the image clean.
#[test]
fn writers_finish_when_their_output_closes() {
    let d = TempDir::new("edges-wpipe").expect("tempdir");
    let src = d.join("src");
    let tree = make_tree(&src, 4, 40, 64 << 10);

    // mkfs -d, its summary on a closed stdout: exit 0, everything copied.
    let img = d.join("t.img");
    let (st, _) = run_with_closed_output(
        &[
            s("mkfs"),
            s("-d"),
            src.as_os_str(),
            img.as_os_str(),
            s("16M"),
        ],
        true,
    );
    assert_eq!(st.code(), Some(0), "mkfs -d: {st:?}");
    assert_closed_clean(&img, "mkfs -d with closed output");
    let got = image_tree(&img, "/");
    for (rel, data) in &tree {
        assert_eq!(got.get(rel), Some(&Some(data.clone())), "{rel}");
    }

    // mkfs -q -d into an image too small: errors go to a closed stderr; exit 1, not a
    // panic, and the image is closed clean.
    let small = d.join("small.img");
    let big = d.join("bigsrc");
    std::fs::create_dir(&big).expect("mkdir");
    for i in 0..4 {
        std::fs::write(big.join(format!("b{i}")), pattern(i, 2 << 20)).expect("write");
    }
    let (st, _) = run_with_closed_output(
        &[
            s("mkfs"),
            s("-q"),
            s("-d"),
            big.as_os_str(),
            small.as_os_str(),
            s("4M"),
        ],
        true,
    );
    assert_eq!(st.code(), Some(1), "mkfs -d into a small image: {st:?}");
    assert_closed_clean(&small, "mkfs -d out of space, closed stderr");

    // cp -v with a closed stdout: every file copied, exit 0.
    let img2 = d.join("t2.img");
    mkfs(&img2, "16M");
    let (st, _) = run_with_closed_output(
        &[
            s("cp"),
            s("-r"),
            s("-v"),
            src.as_os_str(),
            &spec(&img2, "/dir"),
        ],
        true,
    );
    assert_eq!(st.code(), Some(0), "cp -v: {st:?}");
    assert_closed_clean(&img2, "cp -v with closed output");
    assert_eq!(image_tree(&img2, "/dir").len(), tree.len() + 4);

    // The io shell: its reports and its error messages go nowhere; the writes are done.
    let (st, _) = run_with_closed_output(
        &[
            s("io"),
            s("-f"),
            s("-c"),
            s("pwrite -S 0x41 0 64k"),
            s("-c"),
            s("nosuchcommand"),
            s("-c"),
            s("pread -v 0 4k"),
            &spec(&img2, "/io"),
        ],
        true,
    );
    assert_eq!(st.code(), Some(1), "io (one unknown command): {st:?}");
    assert_closed_clean(&img2, "io with closed output");
    let fs = Fs::open(&img2).expect("open");
    assert_eq!(fs.read("/io").expect("read"), vec![0x41u8; 64 << 10]);
}

// ---------------------------------------------------------------------------------
// Item 11: exit codes and messages

/// Malformed options and operands are usage errors (exit 2), said with the
/// subcommand's prefix.
#[test]
fn usage_errors_exit_2() {
    let d = TempDir::new("edges-usage").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    let mnt = d.join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    let new = d.join("new.img");
    let (f, root) = (spec(&img, "/f"), spec(&img, "/"));
    let cases: Vec<(Vec<&OsStr>, &str, &str)> = vec![
        (
            vec![
                s("mount"),
                s("-o"),
                s("bogus"),
                img.as_os_str(),
                mnt.as_os_str(),
            ],
            "rext4 mount: ",
            "bogus",
        ),
        (
            vec![s("mkfs"), new.as_os_str(), s("16Q")],
            "rext4 mkfs: ",
            "invalid filesystem size",
        ),
        (
            vec![s("mkfs"), s("-O"), s("bogus"), new.as_os_str(), s("16M")],
            "rext4 mkfs: ",
            "bogus",
        ),
        (
            vec![
                s("mkfs"),
                s("-U"),
                s("not-a-uuid"),
                new.as_os_str(),
                s("16M"),
            ],
            "rext4 mkfs: ",
            "invalid UUID",
        ),
        (
            vec![s("mkfs"), s("-E"), s("stride=4"), new.as_os_str(), s("16M")],
            "rext4 mkfs: ",
            "bad extended option",
        ),
        (
            vec![
                s("mkfs"),
                s("-E"),
                s("root_owner=x"),
                new.as_os_str(),
                s("16M"),
            ],
            "rext4 mkfs: ",
            "invalid root_owner",
        ),
        (
            vec![s("truncate"), s("-s"), s("1Q"), &f],
            "rext4 truncate: ",
            "invalid size: '1Q'",
        ),
        (
            vec![s("chmod"), s("u+q"), &root],
            "rext4 chmod: ",
            "invalid mode",
        ),
        (
            vec![s("chown"), s("no-such-user-rext4"), &root],
            "rext4 chown: ",
            "invalid user",
        ),
        (vec![s("bench"), s("bogus"), img.as_os_str()], "", "bogus"),
    ];
    for (args, prefix, words) in cases {
        let r = run(&args, 2);
        assert!(
            r.stderr.starts_with(prefix) && r.stderr.contains(words),
            "{args:?}: {:?}",
            r.stderr
        );
    }
    assert!(!new.exists(), "a refused mkfs made the image");
    assert_closed_clean(&img, "after the usage errors");
}

/// Every message is "rext4 SUBCOMMAND: ..." and says what coreutils says, without
/// Rust's "(os error N)" or "I/O error:".
#[test]
fn messages_have_one_prefix_and_coreutils_words() {
    let d = TempDir::new("edges-msg").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    run(&[s("mkdir"), &spec(&img, "/d")], 0);
    let missing = d.join("missing.img");
    let cases: Vec<(Vec<OsString>, &str, String)> = vec![
        (
            vec!["ls".into(), spec(&missing, "/")],
            "ls",
            format!("{}: No such file or directory", missing.display()),
        ),
        (
            vec!["info".into(), missing.clone().into()],
            "info",
            format!("{}: No such file or directory", missing.display()),
        ),
        (
            vec!["cat".into(), spec(&img, "/nope")],
            "cat",
            format!(
                "{}: No such file or directory",
                spec(&img, "/nope").to_string_lossy()
            ),
        ),
        (
            vec!["mkdir".into(), spec(&missing, "/x")],
            "mkdir",
            format!("{}: No such file or directory", missing.display()),
        ),
        (
            vec!["rm".into(), spec(&img, "/d")],
            "rm",
            "Is a directory".into(),
        ),
        (
            vec!["mkdir".into(), spec(&img, "/d")],
            "mkdir",
            "File exists".into(),
        ),
        (
            vec!["cp".into(), d.join("no-such-file").into(), spec(&img, "/")],
            "cp",
            "no-such-file: No such file or directory".into(),
        ),
        (
            vec!["cp".into(), spec(&img, "/nope"), d.join("out").into()],
            "cp",
            "No such file or directory".into(),
        ),
        (
            vec![
                "mkfs".into(),
                "-d".into(),
                d.join("nodir").into(),
                d.join("n.img").into(),
                "8M".into(),
            ],
            "mkfs",
            "nodir: No such file or directory".into(),
        ),
        (
            vec![
                "io".into(),
                "-c".into(),
                "stat".into(),
                spec(&missing, "/f"),
            ],
            "io",
            format!("{}: No such file or directory", missing.display()),
        ),
        (
            vec!["bench".into(), "seqread".into(), missing.clone().into()],
            "bench",
            format!("{}: No such file or directory", missing.display()),
        ),
    ];
    for (args, sub, words) in cases {
        let r = rext4(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        let prefix = format!("rext4 {sub}: ");
        for line in r.stderr.lines() {
            assert!(line.starts_with(&prefix), "{args:?}: line {line:?}");
            assert!(
                !line.contains("os error") && !line.contains("I/O error"),
                "{args:?}: {line:?}"
            );
        }
        assert!(
            r.stderr.contains(&words),
            "{args:?}: {:?} lacks {words:?}",
            r.stderr
        );
    }
}

/// Not ext4 (zeros, random bytes, another filesystem's magic, a tiny file): "not an
/// ext4 filesystem"; a real ext4 image with a damaged superblock: "corrupted".
#[test]
fn images_that_are_not_ext4_say_so() {
    let d = TempDir::new("edges-notext4").expect("tempdir");
    let zero = d.join("zero.img");
    std::fs::write(&zero, vec![0u8; 4 << 20]).expect("write");
    let random = d.join("random.img");
    std::fs::write(&random, pattern(7, 4 << 20)).expect("write");
    let xfs = d.join("xfs.img");
    let mut x = vec![0u8; 4 << 20];
    x[..4].copy_from_slice(b"XFSB"); // an XFS superblock's magic at byte 0
    std::fs::write(&xfs, x).expect("write");
    let tiny = d.join("tiny.img");
    std::fs::write(&tiny, b"hello").expect("write");
    for img in [&zero, &random, &xfs, &tiny] {
        for args in [
            vec![s("info"), img.as_os_str()],
            vec![s("ls"), &spec(img, "/")],
        ] {
            let r = run(&args, 1);
            assert!(
                r.stderr.contains("not an ext4 filesystem") && !r.stderr.contains("corrupt"),
                "{args:?}: {}",
                r.stderr
            );
        }
        let r = run(&[s("mkdir"), &spec(img, "/x")], 1);
        assert!(r.stderr.contains("not an ext4 filesystem"), "{}", r.stderr);
    }
    // Real damage: one bit of the superblock's free-blocks count.
    let img = d.join("t.img");
    mkfs(&img, "16M");
    let mut b = std::fs::read(&img).expect("read");
    b[1024 + 0x0C] ^= 1;
    std::fs::write(&img, b).expect("write");
    let r = run(&[s("ls"), &spec(&img, "/")], 1);
    assert!(
        r.stderr.contains("corrupted") && r.stderr.contains("checksum"),
        "{}",
        r.stderr
    );
}

// ---------------------------------------------------------------------------------
// Item 12: behave like the tools users know

/// ls, cat and stat take several operands (one image or several); a missing one is
/// reported, the others printed, exit 1.
#[test]
fn ls_cat_stat_take_several_operands() {
    let d = TempDir::new("edges-multi").expect("tempdir");
    let a = d.join("a.img");
    let b = d.join("b.img");
    mkfs(&a, "16M");
    mkfs(&b, "16M");
    let host = d.join("h");
    std::fs::write(&host, b"one\n").expect("write");
    run(&[s("cp"), host.as_os_str(), &spec(&a, "/f1")], 0);
    std::fs::write(&host, b"two\n").expect("write");
    run(&[s("cp"), host.as_os_str(), &spec(&b, "/f2")], 0);
    run(&[s("mkdir"), &spec(&a, "/dir"), &spec(&a, "/dir/sub")], 0);

    let r = run(
        &[
            s("cat"),
            &spec(&a, "/f1"),
            &spec(&b, "/f2"),
            &spec(&a, "/f1"),
        ],
        0,
    );
    assert_eq!(r.stdout_str(), "one\ntwo\none\n");
    let r = run(
        &[
            s("cat"),
            &spec(&a, "/f1"),
            &spec(&a, "/nope"),
            &spec(&b, "/f2"),
        ],
        1,
    );
    assert_eq!(r.stdout_str(), "one\ntwo\n");
    assert!(r.stderr.contains("/nope: No such file"), "{}", r.stderr);

    // ls: the files named first, then each directory under a header, as ls does.
    let (da, fa, fb) = (spec(&a, "/dir"), spec(&a, "/f1"), spec(&b, "/f2"));
    let r = run(&[s("ls"), &da, &fb, &spec(&a, "/"), &fa], 0);
    let want = format!(
        "{f1}\n{f2}\n\n{a}:/:\ndir\nf1\nlost+found\n\n{d}:\nsub\n",
        f1 = fa.to_string_lossy(),
        f2 = fb.to_string_lossy(),
        a = a.display(),
        d = da.to_string_lossy()
    );
    assert_eq!(r.stdout_str(), want);
    let r = run(&[s("ls"), &spec(&a, "/nope"), &da], 1);
    assert_eq!(r.stdout_str(), format!("{}:\nsub\n", da.to_string_lossy()));
    assert!(r.stderr.contains("/nope: No such file"), "{}", r.stderr);

    let r = run(&[s("stat"), &fa, &fb], 0);
    let out = r.stdout_str();
    assert_eq!(out.matches("  File: ").count(), 2, "{out}");
    assert!(
        out.contains("  File: /f1\n") && out.contains("  File: /f2\n"),
        "{out}"
    );
    let r = run(&[s("stat"), &spec(&b, "/nope"), &fa], 1);
    assert!(r.stdout_str().contains("  File: /f1\n"));
}

/// chmod with symbolic modes gives what GNU chmod gives on the host, for files and
/// directories (set-ID bits of directories included), under the same umask.
#[test]
fn chmod_takes_symbolic_modes_like_coreutils() {
    if Command::new("chmod").arg("--version").output().is_err() {
        return skip("chmod not installed");
    }
    let d = TempDir::new("edges-chmod").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    let host = d.join("host");
    std::fs::create_dir(&host).expect("mkdir");
    let modes = [
        "u+x",
        "go-w",
        "a=r",
        "u=rwx,g=rx,o=",
        "+t",
        "g+s",
        "u+s",
        "a+X",
        "+X",
        "=",
        "=rw",
        "g=u",
        "o=g",
        "u-x,g+w",
        "-w",
        "+rwx",
        "a-rwx",
        "ug=rwX",
        "-6000",
        "=755",
        "755",
        "00755",
        "2755",
        "u=rwx",
        "g=rx",
        "go=",
        "a+rX,u+w",
    ];
    let starts = [
        (0o644, false),
        (0o755, false),
        (0o600, true),
        (0o2750, true),
        (0o4711, false),
    ];
    let mut i = 0;
    for mode in modes {
        for (start, dir) in starts {
            i += 1;
            let name = format!("n{i}");
            let h = host.join(&name);
            if dir {
                std::fs::create_dir(&h).expect("mkdir");
                run(&[s("mkdir"), &spec(&img, &format!("/{name}"))], 0);
            } else {
                std::fs::write(&h, b"").expect("write");
                run(
                    &[
                        s("truncate"),
                        s("-s"),
                        s("0"),
                        &spec(&img, &format!("/{name}")),
                    ],
                    0,
                );
            }
            std::fs::set_permissions(&h, std::fs::Permissions::from_mode(start)).expect("chmod");
            run(
                &[
                    s("chmod"),
                    &OsString::from(format!("{start:o}")),
                    &spec(&img, &format!("/{name}")),
                ],
                0,
            );
            // umask 022, set for both through the shell.
            let st = Command::new("sh")
                .arg("-c")
                .arg(format!("umask 022 && chmod -- '{mode}' '{}'", h.display()))
                .status()
                .expect("chmod");
            assert!(st.success(), "host chmod {mode}");
            let st = Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "umask 022 && '{BIN}' chmod -- '{mode}' '{}'",
                    spec(&img, &format!("/{name}")).to_string_lossy()
                ))
                .status()
                .expect("rext4 chmod");
            assert!(st.success(), "rext4 chmod {mode}");
            let want = std::fs::metadata(&h).expect("stat").permissions().mode() & 0o7777;
            let fs = Fs::open(&img).expect("open");
            let got = fs.metadata(format!("/{name}")).expect("stat").permissions();
            assert_eq!(
                got,
                want,
                "chmod {mode} on {start:o} ({}): rext4 {got:o}, coreutils {want:o}",
                if dir { "dir" } else { "file" }
            );
        }
    }
    assert_closed_clean(&img, "after chmod");
}

/// The uid and gid of a user known to the host (`id`), if any.
fn host_ids(user: &str) -> Option<(u32, u32)> {
    let id = |flag: &str| -> Option<u32> {
        let o = Command::new("id").args([flag, user]).output().ok()?;
        String::from_utf8(o.stdout).ok()?.trim().parse().ok()
    };
    Some((id("-u")?, id("-g")?))
}

/// chown takes user and group names from the host's databases, and numbers.
#[test]
fn chown_takes_names_from_the_host() {
    let d = TempDir::new("edges-chown").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    run(&[s("mkdir"), &spec(&img, "/a")], 0);
    let owner = |p: &str| {
        let m = Fs::open(&img).expect("open").metadata(p).expect("stat");
        (m.uid, m.gid)
    };
    run(&[s("chown"), s("1000:1001"), &spec(&img, "/a")], 0);
    assert_eq!(owner("/a"), (1000, 1001));
    run(&[s("chown"), s("root"), &spec(&img, "/a")], 0);
    assert_eq!(owner("/a"), (0, 1001));
    run(&[s("chown"), s(":root"), &spec(&img, "/a")], 0);
    assert_eq!(owner("/a"), (0, 0));
    // A second user of the host, with its login group ("nobody" on most systems).
    match ["nobody", "daemon", "bin"]
        .iter()
        .find_map(|u| host_ids(u).map(|i| (*u, i)))
    {
        Some((user, (uid, gid))) => {
            run(
                &[
                    s("chown"),
                    &OsString::from(format!("{user}:")),
                    &spec(&img, "/a"),
                ],
                0,
            );
            assert_eq!(owner("/a"), (uid, gid), "{user}:");
            run(&[s("chown"), s("0:0"), &spec(&img, "/a")], 0);
            run(&[s("chown"), &OsString::from(user), &spec(&img, "/a")], 0);
            assert_eq!(owner("/a"), (uid, 0), "{user}");
        }
        None => skip("no second user on the host"),
    }
    let r = run(
        &[s("chown"), s(":no-such-group-rext4"), &spec(&img, "/a")],
        2,
    );
    assert!(r.stderr.contains("invalid group"), "{}", r.stderr);
    assert_closed_clean(&img, "after chown");
}

/// cp out of an image onto an existing file overwrites it (as cp); a symlink there is
/// never written through: refused, or replaced with -f.
#[test]
fn cp_out_overwrites_like_cp() {
    let d = TempDir::new("edges-cpout").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    let host = d.join("h");
    std::fs::write(&host, b"new contents\n").expect("write");
    run(&[s("cp"), host.as_os_str(), &spec(&img, "/f")], 0);

    let dest = d.join("dest");
    std::fs::write(&dest, b"old, longer contents that must go\n").expect("write");
    run(&[s("cp"), &spec(&img, "/f"), dest.as_os_str()], 0);
    assert_eq!(std::fs::read(&dest).expect("read"), b"new contents\n");
    // Into a directory holding a file of that name: overwritten too.
    let dir = d.join("dir");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(dir.join("f"), b"old\n").expect("write");
    run(&[s("cp"), s("-v"), &spec(&img, "/f"), dir.as_os_str()], 0);
    assert_eq!(
        std::fs::read(dir.join("f")).expect("read"),
        b"new contents\n"
    );
    // A symlink at the destination: refused without -f, the target untouched...
    let victim = d.join("victim");
    std::fs::write(&victim, b"victim\n").expect("write");
    let link = d.join("link");
    std::os::unix::fs::symlink(&victim, &link).expect("symlink");
    let r = run(&[s("cp"), &spec(&img, "/f"), link.as_os_str()], 1);
    assert!(
        r.stderr
            .contains("exists and is not a regular file (cp -f replaces it)"),
        "{}",
        r.stderr
    );
    // ... and replaced by the file with -f, still without writing through it.
    run(&[s("cp"), s("-f"), &spec(&img, "/f"), link.as_os_str()], 0);
    assert_eq!(std::fs::read(&victim).expect("read"), b"victim\n");
    let md = std::fs::symlink_metadata(&link).expect("stat");
    assert!(md.is_file());
    assert_eq!(std::fs::read(&link).expect("read"), b"new contents\n");
}

/// `cp f IMG:/nodir/` fails like cp(1) (the trailing "/" names a directory) instead of
/// making a file "nodir"; into an existing directory and to a new name it works.
#[test]
fn cp_into_a_missing_directory_with_a_trailing_slash_fails() {
    let d = TempDir::new("edges-slash").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "16M");
    let f = d.join("f");
    std::fs::write(&f, b"f\n").expect("write");
    run(&[s("mkdir"), &spec(&img, "/dir")], 0);
    let r = run(&[s("cp"), f.as_os_str(), &spec(&img, "/nodir/")], 1);
    assert!(
        r.stderr.contains("cannot create regular file") && r.stderr.contains("Not a directory"),
        "{}",
        r.stderr
    );
    run(&[s("cp"), f.as_os_str(), &spec(&img, "/dir/")], 0);
    run(&[s("cp"), f.as_os_str(), &spec(&img, "/newname")], 0);
    // A directory source makes the missing directory, as cp -r does.
    let src = d.join("srcdir");
    std::fs::create_dir(&src).expect("mkdir");
    std::fs::write(src.join("x"), b"x\n").expect("write");
    run(
        &[s("cp"), s("-r"), src.as_os_str(), &spec(&img, "/newdir/")],
        0,
    );
    let t = image_tree(&img, "/");
    let names: Vec<&str> = t.keys().map(String::as_str).collect();
    assert_eq!(names, ["dir", "dir/f", "newdir", "newdir/x", "newname"]);
    assert_closed_clean(&img, "after cp");
}

/// Run `rext4 mkfs` on a terminal (through script(1)) with `answer` typed in.
fn mkfs_on_a_terminal(args: &str, answer: &str) -> Option<(i32, String)> {
    let mut child = Command::new("script")
        .args(["-qec", &format!("'{BIN}' mkfs {args}"), "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    // Typed once the question is up; script passes it to the terminal.
    std::thread::sleep(std::time::Duration::from_millis(300));
    // A mkfs that does not ask may be gone already: the answer then goes nowhere.
    let _ = stdin.write_all(answer.as_bytes());
    drop(stdin);
    let out = child.wait_with_output().ok()?;
    Some((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).replace('\r', ""),
    ))
}

/// On a terminal, mkfs names the filesystem already on the image and asks, as mke2fs
/// does: "n" keeps it, "y" replaces it; -F and a non-terminal do not ask.
#[test]
fn mkfs_asks_before_overwriting_a_filesystem_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        return skip("script(1) not installed");
    }
    let d = TempDir::new("edges-ask").expect("tempdir");
    let img = d.join("t.img");
    let r = rext4(&[
        s("mkfs"),
        s("-q"),
        s("-L"),
        s("mylabel"),
        img.as_os_str(),
        s("16M"),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let uuid = || read_superblock(&img).uuid;
    let first = uuid();
    let a = format!("'{}' 16M", img.display());

    let (code, out) = mkfs_on_a_terminal(&a, "n\n").expect("script");
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "{} contains a ext4 file system labelled 'mylabel'\n\tcreated on ",
            img.display()
        )) && out.contains("Proceed anyway? (y,N) "),
        "{out}"
    );
    assert_eq!(uuid(), first, "answered n, yet the image was formatted");

    let (code, out) = mkfs_on_a_terminal(&a, "y\n").expect("script");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("Proceed anyway? (y,N) ") && out.contains("Creating filesystem"));
    let second = uuid();
    assert_ne!(second, first, "answered y, yet the image was not formatted");

    let (code, out) = mkfs_on_a_terminal(&format!("-F {a}"), "").expect("script");
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("Proceed anyway"), "{out}");
    assert_ne!(uuid(), second);

    // Not on a terminal: no question, as mke2fs.
    let third = uuid();
    let r = run(&[s("mkfs"), img.as_os_str(), s("16M")], 0);
    assert!(!r.stdout_str().contains("Proceed"), "{}", r.stdout_str());
    assert_ne!(uuid(), third);
}

/// mkfs -d shows cp -r's progress bar on a terminal; -q hides it.
#[test]
fn mkfs_d_shows_a_progress_bar_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        return skip("script(1) not installed");
    }
    let d = TempDir::new("edges-bar").expect("tempdir");
    let src = d.join("src");
    make_tree(&src, 2, 50, 4 << 20);
    for (quiet, want_bar) in [("", true), ("-q", false)] {
        let img = d.join(format!("t{quiet}.img"));
        let (code, out) = mkfs_on_a_terminal(
            &format!("{quiet} -d '{}' '{}' 64M", src.display(), img.display()),
            "",
        )
        .expect("script");
        assert_eq!(code, 0, "{out}");
        // The bar's template: "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}".
        let bar = out.contains(" eta ") && out.contains("/8.") && out.contains("MiB");
        assert_eq!(bar, want_bar, "mkfs {quiet} -d:\n{out:?}");
        assert_closed_clean(&img, "mkfs -d on a terminal");
    }
}

/// The help texts and the README agree: one list of bench workloads, mkfs -d is not
/// "not yet supported", every option of a subcommand is described.
#[test]
fn help_texts_agree_with_the_readme() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README");
    let line = readme
        .lines()
        .find(|l| l.starts_with("rext4 bench "))
        .expect("README has a bench line");
    let listed: Vec<&str> = line["rext4 bench ".len()..]
        .split_whitespace()
        .next()
        .expect("workloads")
        .split('|')
        .collect();
    let help = run(&[s("bench"), s("--help")], 0).stdout_str();
    let from_help: Vec<&str> = help
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .filter_map(|l| l.split(':').next())
        .collect();
    assert_eq!(from_help, listed, "README and bench --help:\n{help}");
    let short = run(&[s("bench"), s("-h")], 0).stdout_str();
    assert!(
        short.contains(&format!("[possible values: {}]", listed.join(", "))),
        "{short}"
    );
    let top = run(&[s("--help")], 0).stdout_str();
    assert!(
        top.contains(&listed.join(", ")),
        "rext4 --help's bench line lacks {listed:?}:\n{top}"
    );
    for sub in [
        "info", "ls", "cat", "stat", "cp", "mkdir", "rm", "mv", "ln", "chmod", "chown", "truncate",
        "io", "mkfs", "mount", "umount", "bench",
    ] {
        let h = run(&[s(sub), s("--help")], 0).stdout_str();
        assert!(!h.contains("not yet supported"), "{sub} --help:\n{h}");
        // clap prints the doc of an option or argument after it on its line, or on
        // the next line, more indented; an undocumented one stands alone.
        let lines: Vec<&str> = h.lines().collect();
        for (k, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            let option = t.starts_with('-') && !t.starts_with("- ");
            if !(l.starts_with("  ") && (option || t.starts_with('<'))) {
                continue;
            }
            let indent = l.len() - t.len();
            let same_line = t.trim_end().contains("  ");
            let next_line = lines.get(k + 1).is_some_and(|n| {
                let nt = n.trim_start();
                !nt.is_empty() && n.len() - nt.len() > indent
            });
            assert!(
                same_line || next_line,
                "{sub} --help: undocumented {t:?}\n{h}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------
// Item 5: signals

/// `rext4` to be sent SIGINT, SIGTERM or SIGHUP, starting with their default actions:
/// a test run from a script's background job inherits SIGINT ignored (POSIX does that
/// to asynchronous commands without job control), and rext4 leaves an inherited
/// ignore alone (`interrupt::install`, as `nohup` expects), so the signal would never
/// arrive.
fn rext4_for_signals() -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(BIN);
    // SAFETY: signal(2) is async-signal-safe and touches no memory of the parent.
    unsafe {
        c.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    c
}

/// `cp -r -v` of a big tree, sent `sig` after `after` lines: the process ends by that
/// signal, every file it reported is on the image whole, nothing else is there (no
/// 0-byte leftovers), and the image is closed clean.
fn interrupt_cp(sig: i32, after: usize) {
    let d = TempDir::new("edges-sig").expect("tempdir");
    let src = d.join("src");
    let tree = make_tree(&src, 12, 250, 6 << 20);
    let img = d.join("t.img");
    mkfs(&img, "256M");
    let mut child = rext4_for_signals()
        .args([
            s("cp"),
            s("-r"),
            s("-v"),
            src.as_os_str(),
            &spec(&img, "/dst"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut reported = Vec::new();
    for l in lines.by_ref() {
        reported.push(l.expect("line"));
        if reported.len() == after {
            // SAFETY: kill(2) on our own child's pid.
            assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
            break;
        }
    }
    reported.extend(lines.map(|l| l.expect("line")));
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    let st = child.wait().expect("wait");
    assert_eq!(st.signal(), Some(sig), "exit: {st:?}\n{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(
        reported.len() < tree.len(),
        "the copy was not cut short ({} lines)",
        reported.len()
    );
    assert_closed_clean(&img, "interrupted cp");
    // Every reported entry is there, whole; nothing else is.
    let prefix = format!("'{}/", src.display());
    let dprefix = format!("'{}:/dst/", img.display());
    let mut want = BTreeMap::new();
    for l in &reported {
        let (from, to) = l.split_once(" -> ").expect("'SRC' -> 'DEST'");
        if from == format!("'{}'", src.display()) {
            continue; // the top directory itself
        }
        let rel = from
            .strip_prefix(&prefix)
            .and_then(|r| r.strip_suffix('\''))
            .expect("source path");
        assert_eq!(to, format!("{dprefix}{rel}'"));
        want.insert(rel.to_string(), tree.get(rel).cloned());
    }
    let got = image_tree(&img, "/dst");
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "entries on the image vs. entries reported"
    );
    for (rel, data) in &want {
        assert_eq!(&got[rel], data, "{rel}");
    }
}

#[test]
fn sigint_stops_cp_with_what_it_reported_on_the_image() {
    interrupt_cp(libc::SIGINT, 300);
}

#[test]
fn sigterm_stops_cp_with_what_it_reported_on_the_image() {
    // The top directory, d00 and its 250 small files: d00/large (6 MiB) comes next,
    // so the signal most likely lands in the middle of it (to be removed).
    interrupt_cp(libc::SIGTERM, 252);
}

/// A second SIGINT while cp finishes ends it at once; the image is still consistent:
/// after the journal's replay (a read-write open) e2fsck finds it clean.
#[test]
fn a_second_sigint_ends_cp_at_once_without_damage() {
    let d = TempDir::new("edges-sig2").expect("tempdir");
    let src = d.join("src");
    make_tree(&src, 8, 250, 6 << 20);
    let img = d.join("t.img");
    mkfs(&img, "256M");
    let mut child = rext4_for_signals()
        .args([
            s("cp"),
            s("-r"),
            s("-v"),
            src.as_os_str(),
            &spec(&img, "/dst"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    for _ in 0..100 {
        lines.next().expect("a line").expect("line");
    }
    for _ in 0..2 {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    }
    drop(lines);
    let st = child.wait().expect("wait");
    assert_eq!(st.signal(), Some(libc::SIGINT), "{st:?}");
    // Replay whatever the journal holds, then check.
    run(&[s("mkdir"), &spec(&img, "/after")], 0);
    assert_closed_clean(&img, "after a second SIGINT and replay");
}

/// mkfs -d stopped by SIGINT: ends by SIGINT, every file on the image is whole, the
/// image is closed clean.
#[test]
fn sigint_stops_mkfs_d_cleanly() {
    let d = TempDir::new("edges-sigmkfs").expect("tempdir");
    let src = d.join("src");
    let tree = make_tree(&src, 12, 250, 6 << 20);
    let img = d.join("t.img");
    let mut child = rext4_for_signals()
        .args([
            s("mkfs"),
            s("-d"),
            src.as_os_str(),
            img.as_os_str(),
            s("256M"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // The summary is printed once the filesystem is made, before the copy starts.
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    for l in lines.by_ref() {
        if l.expect("line").starts_with("Writing superblocks") {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let rest: Vec<String> = lines.map(|l| l.expect("line")).collect();
    let st = child.wait().expect("wait");
    assert_eq!(st.signal(), Some(libc::SIGINT), "{st:?}");
    assert!(!rest.iter().any(|l| l.contains("done")), "{rest:?}");
    assert_closed_clean(&img, "interrupted mkfs -d");
    let got = image_tree(&img, "/");
    assert!(got.len() < tree.len() + 12, "mkfs -d was not cut short");
    for (rel, data) in &got {
        if let Some(data) = data {
            assert_eq!(Some(data), tree.get(rel), "{rel} is not whole");
        }
    }
}

/// The io shell stopped by SIGTERM between its commands: ends by SIGTERM, every
/// write it reported is on the image, no later one, and the image is clean.
#[test]
fn sigterm_stops_the_io_shell_cleanly() {
    let d = TempDir::new("edges-sigio").expect("tempdir");
    let img = d.join("t.img");
    mkfs(&img, "128M");
    let n = 20_000u64;
    let mut args: Vec<OsString> = vec!["io".into(), "-f".into()];
    for i in 0..n {
        args.push("-c".into());
        args.push(format!("pwrite -S {} {} 4k", i % 251, i * 4096).into());
    }
    args.push(spec(&img, "/f"));
    let mut child = rext4_for_signals()
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // "wrote DONE/ASKED bytes at offset OFF": the bytes the shell says it wrote (a
    // pwrite the signal stopped before its first byte reports 0 of them).
    let wrote = |l: &str| -> Option<u64> {
        let rest = l.strip_prefix("wrote ")?;
        rest.split('/').next()?.parse().ok()
    };
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut reports = 0u64;
    let mut bytes = 0u64;
    for l in lines.by_ref() {
        if let Some(b) = wrote(&l.expect("line")) {
            reports += 1;
            bytes += b;
            if reports == 20 {
                // SAFETY: kill(2) on our own child's pid.
                assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
                break;
            }
        }
    }
    for l in lines {
        if let Some(b) = wrote(&l.expect("line")) {
            reports += 1;
            bytes += b;
        }
    }
    let st = child.wait().expect("wait");
    assert_eq!(st.signal(), Some(libc::SIGTERM), "{st:?}");
    assert!(reports < n, "the shell was not cut short");
    assert_closed_clean(&img, "interrupted io");
    let data = Fs::open(&img).expect("open").read("/f").expect("read");
    assert_eq!(
        data.len() as u64,
        bytes,
        "the bytes the shell reported writing"
    );
    for (i, block) in data.chunks(4096).enumerate() {
        assert!(
            block.iter().all(|&b| u64::from(b) == i as u64 % 251),
            "block {i}"
        );
    }
}

/// `rext4 bench dax` on an image in memory: every RESULT line of the run, the
/// scratch file gone, the image closed clean; a size that is not a multiple of the
/// request size is a usage error before anything is written.
#[test]
fn bench_dax_reports_and_leaves_the_image_clean() {
    let d = TempDir::new_in(&rext4_testkit::memory_dir(), "edges-dax").expect("tempdir");
    let img = d.join("dax.img");
    // 4 KiB blocks: mappings of file blocks need whole memory pages.
    run(
        &[
            s("mkfs"),
            s("-q"),
            s("-b"),
            s("4096"),
            img.as_os_str(),
            s("64M"),
        ],
        0,
    );
    let r = run(
        &[
            s("bench"),
            s("dax"),
            img.as_os_str(),
            s("-s"),
            s("4m"),
            s("--chunk"),
            s("256k"),
        ],
        0,
    );
    for metric in [
        "cached_GBps",
        "cached_clwb_GBps",
        "limit_nt_GBps",
        "memcpy_read_GBps",
        "first_write_GBps",
        "write_GBps",
        "read_GBps",
        "fsync_us_dirty_4k",
        "fsync_us_dirty_1024k",
        "fsync_us_size_1m",
    ] {
        assert!(
            r.stdout_str()
                .contains(&format!("RESULT|rext4-api|dax|{metric}|")),
            "{metric} missing:\n{}",
            r.stdout_str()
        );
    }
    let mut scratch = img.clone().into_os_string();
    scratch.push(".daxcopy");
    assert!(!Path::new(&scratch).exists(), "the scratch file is removed");
    assert_closed_clean(&img, "after bench dax");
    let r = rext4(&[
        s("bench"),
        s("dax"),
        img.as_os_str(),
        s("-s"),
        s("1000k"),
        s("--chunk"),
        s("1m"),
    ]);
    assert_ne!(r.code, 0, "a size below the request size");
    assert!(r.stderr.contains("--size"), "{}", r.stderr);
}

/// The value of a `RESULT|label|workload|metric|value|unit` line of `out`.
fn result_value(out: &str, label: &str, workload: &str, metric: &str) -> f64 {
    let key = format!("RESULT|{label}|{workload}|{metric}|");
    let line = out
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("{metric} missing:\n{out}"));
    line[key.len()..]
        .split('|')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metric}: {line}"))
}

/// `rext4 bench dio-overwrite`: direct overwrites of a prewritten file all take the
/// shared lock (none retries exclusively), with both backings and both orders; the
/// file is removed again and the image closed clean; a bad `--bs` is refused.
#[test]
fn bench_dio_overwrite_takes_the_shared_lock_and_leaves_the_image_as_it_was() {
    let d = TempDir::new("edges-dio").expect("tempdir");
    let img = d.join("dio.img");
    run(&[s("mkfs"), s("-q"), img.as_os_str(), s("128M")], 0);
    for (backing, rw, threads) in [("buffered", "write", "4"), ("direct", "randwrite", "2")] {
        let r = run(
            &[
                s("bench"),
                s("dio-overwrite"),
                img.as_os_str(),
                s("-s"),
                s("4m"),
                s("--secs"),
                s("1"),
                s("--threads"),
                s(threads),
                s("--backing"),
                s(backing),
                s("--rw"),
                s(rw),
                s("--label"),
                s("diotest"),
            ],
            0,
        );
        let out = r.stdout_str();
        let value = |metric: &str| result_value(&out, "diotest", "dio-overwrite", metric);
        let iops = value("iops");
        let shared = value("shared_lock");
        assert!(iops > 0.0 && shared > 0.0, "{backing}:\n{out}");
        assert_eq!(
            value("exclusive"),
            0.0,
            "{backing}: a prewritten file:\n{out}"
        );
        // The writes counted are the writes done (within the second's rounding).
        assert!(
            shared >= iops * 0.5,
            "{backing}: {shared} shared-lock writes at {iops} IOPS:\n{out}"
        );
        assert_closed_clean(&img, &format!("after bench dio-overwrite ({backing})"));
    }
    let ls = run(&[s("ls"), s(&format!("{}:/", img.display()))], 0);
    assert!(
        !ls.stdout_str().contains("dio-overwrite-"),
        "the bench's file stays:\n{}",
        ls.stdout_str()
    );
    let r = rext4(&[
        s("bench"),
        s("dio-overwrite"),
        img.as_os_str(),
        s("--bs"),
        s("1000"),
    ]);
    assert_ne!(r.code, 0, "a --bs that is not whole sectors");
    assert!(r.stderr.contains("--bs"), "{}", r.stderr);
}

/// `rext4 bench firstwrite` through a slow device: the RESULT lines of the run with
/// the read counts, the files it wrote removed again, the image closed clean; `rext4
/// info --stats` prints what its own open read.
#[test]
fn bench_firstwrite_counts_reads_and_leaves_the_image_as_it_was() {
    let d = TempDir::new("edges-firstwrite").expect("tempdir");
    let img = d.join("fw.img");
    // 4 KiB blocks as on any large image: the second file's inode shares the first's
    // inode table block.
    run(
        &[
            s("mkfs"),
            s("-q"),
            s("-b"),
            s("4096"),
            img.as_os_str(),
            s("256M"),
        ],
        0,
    );
    let r = run(
        &[
            s("bench"),
            s("firstwrite"),
            img.as_os_str(),
            s("--latency-ms"),
            s("2"),
            s("--label"),
            s("fwtest"),
        ],
        0,
    );
    let out = r.stdout_str();
    let value = |metric: &str| result_value(&out, "fwtest", "firstwrite", metric);
    let reads = value("reads_at_open");
    assert!(
        (1.0..=8.0).contains(&reads),
        "open read {reads} times:\n{out}"
    );
    assert!(value("read_kib_at_open") >= 4.0);
    // Two milliseconds a read: the run took at least that per read it counted.
    let total = value("open_first_4k_write_fsync_ms");
    let first_reads = value("reads_first_write");
    assert!(
        total >= 2.0 * (reads + first_reads) * 0.9,
        "{total} ms for {reads} + {first_reads} reads of 2 ms:\n{out}"
    );
    assert_eq!(value("first_write_extents"), 1.0);
    assert_eq!(value("reads_second_write"), 0.0, "{out}");
    let ls = run(&[s("ls"), s(&format!("{}:/", img.display()))], 0);
    assert!(
        !ls.stdout_str().contains("firstwrite-"),
        "the bench's files stay:\n{}",
        ls.stdout_str()
    );
    assert_closed_clean(&img, "after bench firstwrite");
    let info = run(&[s("info"), s("--stats"), img.as_os_str()], 0);
    assert!(
        info.stdout_str().contains("Reads at open:"),
        "{}",
        info.stdout_str()
    );
}
