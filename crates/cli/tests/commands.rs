//! `rext4 info`, `ls`, `cat`, `stat` against e2fsprogs' view of the same images, and
//! the exit codes of the error paths (1: operational error, 2: usage).

mod common;

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use common::{inode_of, read_superblock, rext4, spec};
use rext4_format::superblock::Superblock;
use rext4_testkit::fixture::expected_files;
use rext4_testkit::{
    debugfs_r, debugfs_r_raw, debugfs_w_checked, mkfs, populate_debugfs, ContentHasher, Fixture,
    Image, MkfsOptions,
};

/// `dumpe2fs -h IMG` lines, in UTC as rext4 prints times.
fn dumpe2fs_lines(img: &Path) -> Vec<String> {
    let out = Command::new("dumpe2fs")
        .arg("-h")
        .arg(img)
        .env("TZ", "UTC")
        .output()
        .expect("run dumpe2fs");
    assert!(out.status.success(), "dumpe2fs failed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    trim_trailing_blank(text.lines().map(str::to_string).collect())
}

fn trim_trailing_blank(mut v: Vec<String>) -> Vec<String> {
    while v.last().is_some_and(|l| l.trim().is_empty()) {
        v.pop();
    }
    v
}

/// Lines of dumpe2fs' journal section (read from the journal inode, which rext4 may not
/// print yet).
fn is_journal_line(l: &str) -> bool {
    let key = l.split(':').next().unwrap_or("");
    l.trim().is_empty()
        || key.starts_with("Journal ")
        || matches!(
            key,
            "Total journal size"
                | "Total journal blocks"
                | "Max transaction length"
                | "Fast commit length"
                | "Journal checksum type"
                | "Journal checksum"
                | "Journal errno"
        )
}

fn check_info(img: &Path, label: &str) {
    let r = rext4(&[OsStr::new("info"), img.as_os_str()]);
    assert_eq!(r.code, 0, "[{label}] rext4 info: {}", r.stderr);
    let ours = trim_trailing_blank(r.stdout_str().lines().map(str::to_string).collect());
    let theirs = dumpe2fs_lines(img);
    assert!(ours.len() >= 40, "[{label}] only {} lines", ours.len());
    assert!(ours.len() <= theirs.len(), "[{label}] rext4 prints more");
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "[{label}] line {} differs", i + 1);
    }
    // What rext4 leaves out is the journal section only.
    for l in &theirs[ours.len()..] {
        assert!(is_journal_line(l), "[{label}] rext4 info lacks {l:?}");
    }
    for key in ["Filesystem features:", "Block size:", "Inode count:"] {
        assert!(
            ours.iter().any(|l| l.starts_with(key)),
            "[{label}] no {key}"
        );
    }
}

#[test]
fn info_matches_dumpe2fs() {
    let cases = [
        ("debian 4k", MkfsOptions::new(4096, 32 << 20)),
        ("debian 1k", MkfsOptions::new(1024, 32 << 20)),
        (
            "debian 4k no journal",
            MkfsOptions::new(4096, 32 << 20)
                .arg("-O")
                .arg("^has_journal"),
        ),
        (
            "upstream 1k",
            MkfsOptions::new(1024, 32 << 20).upstream(true),
        ),
        (
            "upstream 4k",
            MkfsOptions::new(4096, 64 << 20).upstream(true),
        ),
        (
            "debian 4k ea_inode",
            MkfsOptions::new(4096, 32 << 20).arg("-O").arg("ea_inode"),
        ),
        // "Cluster size" and "Clusters per group" in place of the fragment lines.
        (
            "debian 4k bigalloc 64k",
            MkfsOptions::new(4096, 64 << 20)
                .arg("-O")
                .arg("bigalloc")
                .arg("-C")
                .arg("65536"),
        ),
        (
            "debian 1k bigalloc 16k",
            MkfsOptions::new(1024, 32 << 20)
                .arg("-O")
                .arg("bigalloc")
                .arg("-C")
                .arg("16384"),
        ),
    ];
    for (label, opts) in cases {
        let img = mkfs(&opts).expect("mkfs");
        check_info(img.path(), label);
        // After writes (free counts, times, a label) the header still agrees.
        debugfs_w_checked(
            img.path(),
            "mkdir a\nmkdir a/b\nwrite /etc/hostname a/h\nset_super_value volume_name rext4-test\n",
        )
        .expect("debugfs");
        check_info(img.path(), &format!("{label} after writes"));
    }
}

/// An image with multi-mount protection: the superblock's MMP fields and the MMP
/// block section, as dumpe2fs -h prints them.
#[test]
fn info_matches_dumpe2fs_with_mmp() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20).arg("-O").arg("mmp")).expect("mkfs");
    check_info(img.path(), "debian 4k mmp");
    let r = rext4(&[OsStr::new("info"), img.path().as_os_str()]);
    let text = r.stdout_str();
    assert!(
        text.contains("MMP block number:") && text.contains("    mmp_sequence: 0xff4d4d50"),
        "{text}"
    );
}

fn fixture_image(bs: u32) -> Image {
    let img = mkfs(&MkfsOptions::new(bs, 48 << 20)).expect("mkfs");
    populate_debugfs(img.path(), &Fixture::quick()).expect("populate");
    img
}

/// One entry of `debugfs -R "ls -p DIR"`: /ino/mode/uid/gid/name/size/.
struct DebugfsEntry {
    ino: u32,
    mode: u32,
    uid: u32,
    gid: u32,
    name: Vec<u8>,
    size: Option<u64>,
}

fn debugfs_ls(img: &Path, dir: &str) -> Vec<DebugfsEntry> {
    let out = debugfs_r_raw(img, &format!("ls -p {dir}")).expect("debugfs ls");
    let mut v = Vec::new();
    for line in out.stdout.split(|&b| b == b'\n') {
        let Some(body) = line.strip_prefix(b"/").and_then(|l| l.strip_suffix(b"/")) else {
            continue;
        };
        let mut head = body.splitn(5, |&b| b == b'/');
        let num = |s: Option<&[u8]>, radix: u32| {
            u32::from_str_radix(
                std::str::from_utf8(s.expect("field")).expect("ascii"),
                radix,
            )
            .expect("number")
        };
        let ino = num(head.next(), 10);
        let mode = num(head.next(), 8);
        let uid = num(head.next(), 10);
        let gid = num(head.next(), 10);
        let rest = head.next().expect("name/size");
        let cut = rest.iter().rposition(|&b| b == b'/').expect("size field");
        let name = rest[..cut].to_vec();
        let size = std::str::from_utf8(&rest[cut + 1..])
            .ok()
            .and_then(|s| s.parse().ok());
        // debugfs also prints empty slots (inode 0, no name) of htree leaf blocks.
        if name.is_empty() || ino == 0 || name == b"." || name == b".." {
            continue;
        }
        v.push(DebugfsEntry {
            ino,
            mode,
            uid,
            gid,
            name,
            size,
        });
    }
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// `ls -l`'s mode column for a full st_mode (test oracle).
fn mode_string(mode: u32) -> String {
    let t = match mode & 0o170000 {
        0o040000 => 'd',
        0o120000 => 'l',
        0o020000 => 'c',
        0o060000 => 'b',
        0o010000 => 'p',
        0o140000 => 's',
        _ => '-',
    };
    let rwx = |shift: u32, special: u32, set: char, unset: char| {
        let r = if mode >> shift & 4 != 0 { 'r' } else { '-' };
        let w = if mode >> shift & 2 != 0 { 'w' } else { '-' };
        let x = match (mode & special != 0, mode >> shift & 1 != 0) {
            (true, true) => set,
            (true, false) => unset,
            (false, true) => 'x',
            (false, false) => '-',
        };
        format!("{r}{w}{x}")
    };
    format!(
        "{t}{}{}{}",
        rwx(6, 0o4000, 's', 'S'),
        rwx(3, 0o2000, 's', 'S'),
        rwx(0, 0o1000, 't', 'T')
    )
}

/// `rext4 ls -l IMG:DIR` agrees with debugfs on names, types, modes, owners and sizes.
fn check_ls_l(img: &Path, dir: &str) {
    let r = rext4(&[OsStr::new("ls"), OsStr::new("-l"), &spec(img, dir)]);
    assert_eq!(r.code, 0, "ls -l {dir}: {}", r.stderr);
    let out = r.stdout_str();
    let lines: Vec<&str> = out.lines().collect();
    let want = debugfs_ls(img, dir);
    assert_eq!(
        lines.len(),
        want.len(),
        "ls -l {dir}: {} lines, debugfs lists {}:\n{out}",
        lines.len(),
        want.len()
    );
    for (line, e) in lines.iter().zip(&want) {
        let name = std::str::from_utf8(&e.name).expect("fixture names are ASCII here");
        let tok: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(tok[0], mode_string(e.mode), "{dir}/{name}: {line}");
        assert_eq!(tok[2], e.uid.to_string(), "{dir}/{name} uid: {line}");
        assert_eq!(tok[3], e.gid.to_string(), "{dir}/{name} gid: {line}");
        let is_dev = matches!(e.mode & 0o170000, 0o020000 | 0o060000);
        if let (Some(size), false) = (e.size, is_dev) {
            assert_eq!(tok[4], size.to_string(), "{dir}/{name} size: {line}");
        }
        let named = if e.mode & 0o170000 == 0o120000 {
            line.contains(&format!(" {name} -> "))
        } else {
            line.ends_with(&format!(" {name}"))
        };
        assert!(named, "{dir}: expected {name:?} in {line:?}");
        assert!(e.ino > 0);
    }
}

#[test]
fn ls_cat_stat_agree_with_debugfs() {
    let bs = 1024;
    let img = fixture_image(bs);
    let p = img.path();

    for dir in [
        "/", "/small", "/dev", "/xattr", "/modes", "/times", "/dir", "/deep",
    ] {
        check_ls_l(p, dir);
    }
    // The symlink column shows the target.
    let r = rext4(&[OsStr::new("ls"), OsStr::new("-l"), &spec(p, "/")]);
    assert!(r.stdout_str().contains(" fastlink -> small/one\n"));
    assert!(r.stdout_str().contains(" danglink -> does/not/exist\n"));

    // The indexed directory: every name debugfs lists (names that are not printable
    // ASCII are shown escaped or lossily by rext4, so those are only counted).
    let r = rext4(&[OsStr::new("ls"), &spec(p, "/big")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let ours: Vec<String> = r.stdout_str().lines().map(str::to_string).collect();
    let want = debugfs_ls(p, "/big");
    assert_eq!(ours.len(), want.len());
    assert_eq!(want.len(), 600);
    let ascii = |n: &[u8]| n.iter().all(|b| (0x21..0x7f).contains(b));
    let want_ascii: Vec<String> = want
        .iter()
        .filter(|e| ascii(&e.name))
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .collect();
    let ours_ascii: Vec<String> = ours
        .iter()
        .filter(|n| ascii(n.as_bytes()))
        .cloned()
        .collect();
    assert_eq!(ours_ascii, want_ascii);
    assert!(want_ascii.len() > 500);

    // cat: every file with known bytes, hashed; two also byte-for-byte against debugfs.
    for (path, size, hash) in expected_files(&Fixture::quick(), bs) {
        let r = rext4(&[OsStr::new("cat"), &spec(p, &format!("/{path}"))]);
        assert_eq!(r.code, 0, "cat {path}: {}", r.stderr);
        assert_eq!(r.stdout.len() as u64, size, "cat {path}: length");
        assert_eq!(ContentHasher::hash(&r.stdout), hash, "cat {path}: bytes");
    }
    for path in ["/small/b4097", "/xattr/share1"] {
        let r = rext4(&[OsStr::new("cat"), &spec(p, path)]);
        let d = debugfs_r_raw(p, &format!("cat {path}")).expect("debugfs cat");
        assert_eq!(r.stdout, d.stdout, "cat {path}");
    }
    // cat follows symlinks (in the image).
    let r = rext4(&[OsStr::new("cat"), &spec(p, "/fastlink")]);
    let one = rext4(&[OsStr::new("cat"), &spec(p, "/small/one")]);
    assert_eq!(r.code, 0);
    assert_eq!(r.stdout, one.stdout);
    assert_eq!(r.stdout.len(), 1);

    // stat: inode number and size as debugfs reports them.
    for (path, size) in [
        ("/small/b4097", "4097"),
        ("/small/m1p3", "1048579"),
        ("/fastlink", "9"),
        ("/hl1", "21"),
        ("/dir/hl2", "21"),
    ] {
        let (ino, _) = inode_of(p, path);
        let r = rext4(&[OsStr::new("stat"), &spec(p, path)]);
        assert_eq!(r.code, 0, "stat {path}: {}", r.stderr);
        let out = r.stdout_str();
        assert!(
            out.contains(&format!("Inode: {ino} ")),
            "stat {path}: no inode {ino}:\n{out}"
        );
        assert!(
            out.contains(&format!("Size: {size} ")),
            "stat {path}: no size {size}:\n{out}"
        );
    }
    let r = rext4(&[OsStr::new("stat"), &spec(p, "/hl1")]);
    assert!(r.stdout_str().contains("Links: 2 "), "{}", r.stdout_str());
    let r = rext4(&[OsStr::new("stat"), &spec(p, "/fastlink")]);
    assert!(
        r.stdout_str().contains("symbolic link") && r.stdout_str().contains("-> small/one"),
        "{}",
        r.stdout_str()
    );
    let dbg = debugfs_r(p, "stat /dev/bigdev").expect("debugfs stat");
    assert!(dbg.contains("Type: character special"), "{dbg}");
    let r = rext4(&[OsStr::new("stat"), &spec(p, "/dev/bigdev")]);
    assert!(
        r.stdout_str().contains("Device type: 300,70000"),
        "{}",
        r.stdout_str()
    );
}

#[test]
fn errors_and_exit_codes() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let p = img.path();
    debugfs_w_checked(p, "mkdir d\nwrite /etc/hostname f\n").expect("debugfs");

    // A missing path: exit 1, "no such file".
    for cmd in ["ls", "cat", "stat"] {
        let r = rext4(&[OsStr::new(cmd), &spec(p, "/nope")]);
        assert_eq!(r.code, 1, "{cmd}: {}", r.stderr);
        assert!(
            r.stderr.contains("No such file or directory"),
            "{cmd}: {}",
            r.stderr
        );
        assert!(r.stdout.is_empty());
    }
    let dest = rext4_testkit::TempDir::new("cli-err").expect("tempdir");
    let r = rext4(&[
        OsStr::new("cp"),
        OsStr::new("-r"),
        &spec(p, "/nope"),
        dest.join("x").as_os_str(),
    ]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("No such file or directory"),
        "{}",
        r.stderr
    );
    assert!(!dest.join("x").exists());
    // A directory without -r.
    let r = rext4(&[OsStr::new("cp"), &spec(p, "/d"), dest.join("x").as_os_str()]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("Is a directory"), "{}", r.stderr);
    assert!(!dest.join("x").exists());
    // cat of a directory, ls below a file.
    let r = rext4(&[OsStr::new("cat"), &spec(p, "/d")]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("Is a directory"), "{}", r.stderr);
    let r = rext4(&[OsStr::new("ls"), &spec(p, "/f/x")]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("Not a directory"), "{}", r.stderr);
    // A missing image file.
    let r = rext4(&[OsStr::new("info"), dest.join("none.img").as_os_str()]);
    assert_eq!(r.code, 1, "{}", r.stderr);

    // Usage errors: exit 2.
    let no_colon = p.as_os_str();
    for args in [
        vec![OsStr::new("ls"), no_colon],
        vec![OsStr::new("cat"), no_colon],
        vec![OsStr::new("stat"), OsStr::new("img:relative")],
        vec![
            OsStr::new("cp"),
            OsStr::new("-r"),
            no_colon,
            OsStr::new("x"),
        ],
        vec![OsStr::new("frobnicate")],
        vec![OsStr::new("ls"), OsStr::new("-Z"), &spec(p, "/")],
        vec![OsStr::new("info")],
        vec![],
    ] {
        let r = rext4(&args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(!r.stderr.is_empty(), "{args:?}: no message");
    }
    // The good image still works (the checks above did not hinge on it being bad).
    let r = rext4(&[OsStr::new("ls"), &spec(p, "/")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout_str(), "d\nf\nlost+found\n");
}

/// Reads, edits and writes back the primary superblock; `fix_csum` recomputes its
/// checksum afterwards.
fn patch_superblock(img: &Path, fix_csum: bool, edit: impl FnOnce(&mut [u8])) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .expect("open");
    let mut sb = vec![0u8; 1024];
    f.read_exact_at(&mut sb, 1024).expect("read");
    edit(&mut sb);
    if fix_csum {
        let c = Superblock::compute_csum(&sb);
        sb[0x3FC..0x400].copy_from_slice(&c.to_le_bytes());
    }
    f.write_all_at(&sb, 1024).expect("write");
}

#[test]
fn damaged_superblocks_are_refused() {
    let base = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    assert!(read_superblock(base.path()).metadata_csum());
    let cmds = |p: &Path| {
        vec![
            vec![
                OsStr::new("info").to_os_string(),
                p.as_os_str().to_os_string(),
            ],
            vec![OsStr::new("ls").to_os_string(), spec(p, "/")],
            vec![OsStr::new("cat").to_os_string(), spec(p, "/x")],
        ]
    };

    // One flipped byte (the free blocks count): the checksum no longer matches.
    let img = base.duplicate().expect("dup");
    patch_superblock(img.path(), false, |sb| sb[0x0C] ^= 0x01);
    for args in cmds(img.path()) {
        let r = rext4(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("corrupted"), "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("checksum"), "{args:?}: {}", r.stderr);
        assert!(r.stdout.is_empty(), "{args:?} printed something");
    }
    // A magic number one bit off: a damaged ext4 superblock.
    let img = base.duplicate().expect("dup");
    patch_superblock(img.path(), false, |sb| sb[0x38] ^= 0x10);
    for args in cmds(img.path()) {
        let r = rext4(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("corrupted"), "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("magic"), "{args:?}: {}", r.stderr);
    }
    // No ext4 magic number at all (8 bits off): not an ext4 filesystem.
    let img = base.duplicate().expect("dup");
    patch_superblock(img.path(), false, |sb| sb[0x38] ^= 0xFF);
    for args in cmds(img.path()) {
        let r = rext4(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        assert!(
            r.stderr.contains("not an ext4 filesystem") && r.stderr.contains("magic"),
            "{args:?}: {}",
            r.stderr
        );
    }
    // An unknown incompat feature (bit 31) with a valid checksum: refused, named.
    let img = base.duplicate().expect("dup");
    patch_superblock(img.path(), true, |sb| sb[0x60 + 3] |= 0x80);
    let sb = read_superblock(img.path());
    assert!(
        sb.has_incompat(0x8000_0000),
        "patch took effect, checksum valid"
    );
    for args in cmds(img.path()) {
        let r = rext4(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("FEATURE_I31"), "{args:?}: {}", r.stderr);
    }
    // The untouched image opens (so the refusals above come from the patches).
    let r = rext4(&[OsStr::new("info"), base.path().as_os_str()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}
