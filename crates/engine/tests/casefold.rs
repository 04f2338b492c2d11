//! Casefolded directories (`mke2fs -O casefold`, utf8-12.1), written through the API:
//! a directory made casefolded by debugfs and one by rext4's own chattr +F take 10,000
//! names with case variants and non-ASCII letters (ß/ẞ, final sigma, Turkish dotted and
//! dotless i, Cyrillic, composed and decomposed é, the ﬁ ligature, U+200B and U+00AD
//! inside names, Hangul); a case variant finds the entry, creating one is EEXIST with
//! O_EXCL and opens the existing file without it, rename/link/unlink work through any
//! variant, readdir shows the names as created, and `e2fsck -fn` (which checks every
//! casefolded htree hash and the index order) is clean after every workload and after
//! `e2fsck -fD` rebuilt the directories, which rext4 then reads. Strict mode refuses
//! names that are not UTF-8 there (EINVAL); the default keeps them as bytes. chattr +F
//! / -F only on empty directories; subdirectories inherit the flag; bad encoding fields
//! are clear refusals at open.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rext4::format::inode::flags;
use rext4::format::superblock::SB_OFFSET;
use rext4::{Error, Fs, FsOptions, OpenOptions};
use rext4_testkit::{debugfs_w_checked, e2fsck_fn, e2fsck_with, mkfs, Image, MkfsOptions};

/// (as created, a variant that must name the same entry)
const PAIRS: &[(&str, &str)] = &[
    ("straße", "STRASSE"),
    ("Straße", "STRAẞE"),
    ("οδος", "ΟΔΟΣ"),
    ("ΟΔΟΣ", "οδοσ"),
    ("İstanbul", "i\u{307}STANBUL"),
    ("ıspanak", "ıSPANAK"),
    ("Привет", "пРИВЕТ"),
    ("caf\u{e9}", "CAFE\u{301}"),
    ("\u{fb01}le", "FILE"),
    ("zero\u{200b}width", "ZEROWIDTH"),
    ("soft\u{ad}hyphen", "SOFT\u{ad}HYPHEN\u{200b}"),
    ("\u{1fa}ngstr\u{f6}m", "\u{1fb}NGSTR\u{d6}M"),
    (
        "\u{d55c}\u{ae00}",
        "\u{1112}\u{1161}\u{11ab}\u{1100}\u{1173}\u{11af}",
    ),
    ("Kelvin", "\u{212a}ELVIN"),
];

/// Names that look alike but are different names (not folded together).
const DISTINCT: &[(&str, &str)] = &[
    ("ıx", "ix"),
    ("\u{b2}", "2"),
    ("e\u{301}x", "ex"),
    ("\u{131}", "I"),
];

fn rw() -> FsOptions {
    FsOptions {
        read_only: false,
        ..FsOptions::default()
    }
}

fn image(strict: bool) -> Image {
    let mut o = MkfsOptions::new(4096, 96 << 20)
        .arg("-O")
        .arg("casefold")
        .arg("-N")
        .arg("40000");
    if strict {
        o = o.arg("-E").arg("encoding_flags=strict");
    }
    mkfs(&o).expect("mkfs -O casefold")
}

fn p(dir: &str, name: &str) -> PathBuf {
    Path::new("/").join(dir).join(name)
}

fn name_at(i: usize, variant: bool) -> String {
    let (a, b) = PAIRS[i % PAIRS.len()];
    format!("{}-{i}", if variant { b } else { a })
}

fn assert_clean(img: &Path, when: &str) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "e2fsck -fn after {when}:\n{}", r.output);
}

/// A directory casefolded by debugfs (what e2fsprogs tools can do here; the kernel on
/// this machine has no CONFIG_UNICODE) and one by rext4's set_flags.
fn casefolded_dirs(img: &Path) {
    debugfs_w_checked(img, "mkdir dbg\nset_inode_field dbg flags 0x40080000\n").expect("debugfs");
    let fs = Fs::open_with(img, rw()).expect("open casefold image read-write");
    fs.create_dir("/api").expect("mkdir");
    let ino = fs.resolve(b"/api", true).expect("api");
    let f = fs.flags_ino(ino).expect("flags");
    fs.set_flags_ino(ino, f | flags::CASEFOLD)
        .expect("chattr +F on an empty dir");
    assert_ne!(fs.flags_ino(ino).expect("flags") & flags::CASEFOLD, 0);
    fs.close().expect("close");
}

fn populate_and_check(img: &Path, dir: &str, count: usize) {
    let fs = Fs::open_with(img, rw()).expect("open");
    for i in 0..count {
        fs.write(p(dir, &name_at(i, false)), i.to_le_bytes())
            .unwrap_or_else(|e| panic!("create {}: {e}", name_at(i, false)));
    }
    for (a, b) in DISTINCT {
        fs.write(p(dir, a), b"a").expect("distinct a");
        fs.write(p(dir, b), b"b").expect("distinct b");
    }
    for i in 0..count {
        let (cre, var) = (p(dir, &name_at(i, false)), p(dir, &name_at(i, true)));
        let want = fs.metadata(&cre).expect("created").ino;
        assert_eq!(
            fs.metadata(&var).map(|m| m.ino).ok(),
            Some(want),
            "variant {var:?} of {cre:?}"
        );
        if i % 97 == 0 {
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&fs, &var)
            {
                Err(Error::Exists) => {}
                other => panic!("O_EXCL create of {var:?}: {:?}", other.map(|_| ())),
            }
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .open(&fs, &var)
                .expect("open existing through a variant");
            assert_eq!(f.ino(), want);
        }
    }
    for (a, b) in DISTINCT {
        assert_eq!(fs.read(p(dir, a)).expect("a"), b"a", "{a:?} vs {b:?}");
        assert_eq!(fs.read(p(dir, b)).expect("b"), b"b", "{b:?} vs {a:?}");
    }
    // readdir shows the names as created.
    let mut listed: Vec<Vec<u8>> = fs
        .read_dir(Path::new("/").join(dir))
        .expect("readdir")
        .into_iter()
        .map(|e| e.name)
        .collect();
    listed.sort();
    let mut want: Vec<Vec<u8>> = (0..count).map(|i| name_at(i, false).into_bytes()).collect();
    want.extend(
        DISTINCT
            .iter()
            .flat_map(|(a, b)| [a.as_bytes().to_vec(), b.as_bytes().to_vec()]),
    );
    want.sort();
    assert_eq!(listed.len(), want.len());
    assert!(listed == want, "readdir differs from the names created");
    fs.close().expect("close");
}

fn rename_link_unlink(img: &Path, dir: &str, count: usize) {
    let fs = Fs::open_with(img, rw()).expect("open");
    for i in (0..count).step_by(7) {
        let var = p(dir, &name_at(i, true));
        match i % 3 {
            0 => fs.remove_file(&var).expect("unlink by variant"),
            1 => {
                let to = p(dir, &format!("Renamed-{i}"));
                fs.rename(&var, &to).expect("rename by variant");
                assert!(fs.metadata(p(dir, &format!("RENAMED-{i}"))).is_ok());
            }
            _ => {
                let l = p(dir, &format!("LINK-{i}"));
                fs.hard_link(&var, &l).expect("link by variant");
                assert_eq!(
                    fs.metadata(p(dir, &format!("link-{i}"))).expect("link").ino,
                    fs.metadata(&var).expect("orig").ino
                );
                // A case variant as the new name is the same name: EEXIST.
                match fs.hard_link(&var, p(dir, &format!("lInK-{i}"))) {
                    Err(Error::Exists) => {}
                    other => panic!("link onto a variant: {other:?}"),
                }
            }
        }
    }
    // Renaming onto a case variant of itself changes nothing (the same inode).
    let i = 4;
    fs.rename(p(dir, &name_at(i, false)), p(dir, &name_at(i, true)))
        .expect("rename to own variant");
    assert!(fs.metadata(p(dir, &name_at(i, false))).is_ok());
    for i in (0..count).step_by(7) {
        let gone = i % 3 == 0 || i % 3 == 1;
        assert_eq!(
            fs.metadata(p(dir, &name_at(i, false))).is_ok(),
            !gone,
            "{}",
            name_at(i, false)
        );
    }
    fs.close().expect("close");
}

#[test]
fn ten_thousand_names_in_casefolded_dirs() {
    let img = image(false);
    casefolded_dirs(img.path());
    populate_and_check(img.path(), "dbg", 9_000);
    assert_clean(img.path(), "10,000 creates (debugfs dir)");
    populate_and_check(img.path(), "api", 1_000);
    assert_clean(img.path(), "creates (rext4 chattr +F dir)");
    rename_link_unlink(img.path(), "dbg", 9_000);
    rename_link_unlink(img.path(), "api", 1_000);
    assert_clean(img.path(), "renames, links, unlinks by case variants");

    // e2fsck -fD rebuilds (re-hashes, re-sorts) every directory: rext4 reads it.
    let r = e2fsck_with(img.path(), &["-fyD"]);
    assert!(
        r.exit_code == 0 || r.exit_code == 1,
        "e2fsck -fyD:\n{}",
        r.output
    );
    assert_clean(img.path(), "e2fsck -fD");
    let fs = Fs::open_with(img.path(), rw()).expect("open after -fD");
    for i in (0..9_000).filter(|i| i % 7 != 0 || i % 3 == 2) {
        assert!(
            fs.metadata(p("dbg", &name_at(i, true))).is_ok(),
            "after -fD: {}",
            name_at(i, true)
        );
    }
    fs.write("/dbg/NEW-after-rebuild", b"x")
        .expect("create after -fD");
    assert!(fs.metadata("/dbg/new-AFTER-rebuild").is_ok());
    fs.close().expect("close");
    assert_clean(img.path(), "creates after -fD");
}

#[test]
fn subdirectories_inherit_and_chattr_needs_an_empty_dir() {
    let img = image(false);
    casefolded_dirs(img.path());
    let fs = Fs::open_with(img.path(), rw()).expect("open");
    fs.create_dir("/api/Sub").expect("mkdir");
    let sub = fs.resolve(b"/api/SUB", true).expect("variant of a dir");
    assert_ne!(
        fs.flags_ino(sub).expect("flags") & flags::CASEFOLD,
        0,
        "inherited"
    );
    fs.write("/api/Sub/Deep", b"d").expect("file");
    assert_eq!(
        fs.read("/API/sub/DEEP").ok(),
        None,
        "the root is not casefolded"
    );
    assert_eq!(fs.read("/api/sUB/dEEP").expect("deep"), b"d");
    // A file created in a casefolded dir does not get the flag.
    let file = fs.resolve(b"/api/Sub/Deep", true).expect("deep");
    assert_eq!(fs.flags_ino(file).expect("flags") & flags::CASEFOLD, 0);
    // -F on a non-empty dir: ENOTEMPTY; +F on a file: ENOTDIR.
    let f = fs.flags_ino(sub).expect("flags");
    assert!(matches!(
        fs.set_flags_ino(sub, f & !flags::CASEFOLD),
        Err(Error::NotEmpty)
    ));
    assert!(matches!(
        fs.set_flags_ino(file, flags::CASEFOLD),
        Err(Error::NotADirectory)
    ));
    fs.remove_file("/api/Sub/DEEP").expect("unlink");
    fs.set_flags_ino(sub, f & !flags::CASEFOLD)
        .expect("chattr -F on the emptied dir");
    fs.write("/api/Sub/x", b"1").expect("x");
    fs.write("/api/Sub/X", b"2").expect("X is another name now");
    assert_eq!(fs.read("/api/Sub/x").expect("x"), b"1");
    fs.close().expect("close");
    assert_clean(img.path(), "chattr -F and two names differing in case");
}

#[test]
fn strict_refuses_names_that_are_not_utf8() {
    let img = image(true);
    casefolded_dirs(img.path());
    let fs = Fs::open_with(img.path(), rw()).expect("open strict image");
    let bad = Path::new(OsStr::from_bytes(b"/dbg/bad\xffname"));
    match fs.write(bad, b"x") {
        Err(Error::InvalidInput(_)) => {}
        other => panic!("strict: non-UTF-8 name in a casefolded dir: {other:?}"),
    }
    // A plain directory takes any bytes.
    fs.write(Path::new(OsStr::from_bytes(b"/bad\xffname")), b"x")
        .expect("non-casefolded dir");
    // Renaming or linking such a name into a casefolded dir: EINVAL too.
    match fs.rename(Path::new(OsStr::from_bytes(b"/bad\xffname")), bad) {
        Err(Error::InvalidInput(_)) => {}
        other => panic!("strict rename: {other:?}"),
    }
    fs.write("/dbg/Good-Ü", b"g").expect("valid name");
    assert_eq!(fs.read("/dbg/good-ü").expect("variant"), b"g");
    fs.close().expect("close");
    assert_clean(img.path(), "strict workload");
}

#[test]
fn default_encoding_keeps_invalid_names_as_bytes() {
    let img = image(false);
    casefolded_dirs(img.path());
    let fs = Fs::open_with(img.path(), rw()).expect("open");
    let bad = Path::new(OsStr::from_bytes(b"/api/Bad\xffName"));
    fs.write(bad, b"x").expect("an opaque name");
    assert_eq!(fs.read(bad).expect("exact bytes"), b"x");
    // Not valid UTF-8: compared byte for byte, no case folding.
    assert!(fs
        .metadata(Path::new(OsStr::from_bytes(b"/api/bad\xffname")))
        .is_err());
    fs.write(Path::new(OsStr::from_bytes(b"/api/bad\xffname")), b"y")
        .expect("a different opaque name");
    assert_eq!(fs.read(bad).expect("first"), b"x");
    fs.close().expect("close");
    // (e2fsck is not asked here: e2fsprogs 1.47's casefold hash fails on such names.)
}

#[test]
fn bad_encoding_fields_are_refused_at_open() {
    for (off, val, what) in [
        (0x27C, 7u16, "unknown filename encoding 7"),
        (0x27E, 0x8000u16, "unknown encoding flags"),
    ] {
        let img = image(false);
        let mut raw = std::fs::read(img.path()).expect("read");
        let sb = SB_OFFSET as usize;
        raw[sb + off..sb + off + 2].copy_from_slice(&val.to_le_bytes());
        // Keep the superblock checksum right so the field itself is what is judged.
        let c = rext4::format::superblock::Superblock::compute_csum(&raw[sb..sb + 1024]);
        raw[sb + 0x3FC..sb + 0x400].copy_from_slice(&c.to_le_bytes());
        std::fs::write(img.path(), &raw).expect("write");
        for read_only in [true, false] {
            let opts = FsOptions {
                read_only,
                ..FsOptions::default()
            };
            match Fs::open_with(img.path(), opts) {
                Err(Error::Unsupported(m)) => assert!(m.contains(what), "{m}"),
                Err(e) => panic!("{what}: unexpected error {e}"),
                Ok(_) => panic!("{what}: opened"),
            }
        }
    }
}

/// Benchmark (not a check; run by hand, best in release):
/// `cargo test --release -p rext4 --test casefold -- --ignored --nocapture bench`.
/// Stats 100,000 names in a plain and in a casefolded htree directory of the same
/// image, in-process: a first pass after opening (directory blocks read, dentry cache
/// empty) and a second (dentry cache warm); the casefolded pass looks names up through
/// a case variant. Prints each rate and the casefolded/plain ratio.
#[test]
#[ignore]
fn bench_casefold_lookups() {
    let n: usize = std::env::var("REXT4_CF_BENCH_NAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let img = mkfs(
        &MkfsOptions::new(4096, 1 << 30)
            .arg("-O")
            .arg("casefold")
            .arg("-N")
            .arg(&(2 * n + 1000).to_string()),
    )
    .expect("mkfs");
    {
        let fs = Fs::open_with(img.path(), rw()).expect("open");
        fs.create_dir("/plain").expect("mkdir");
        fs.create_dir("/cf").expect("mkdir");
        let ino = fs.resolve(b"/cf", true).expect("cf");
        let f = fs.flags_ino(ino).expect("flags");
        fs.set_flags_ino(ino, f | flags::CASEFOLD).expect("+F");
        for i in 0..n {
            fs.write(format!("/plain/File-Name-{i:06}.dat"), b"")
                .expect("plain");
            fs.write(format!("/cf/File-Name-{i:06}.dat"), b"")
                .expect("cf");
        }
        fs.close().expect("close");
    }
    // Best of three rounds, each on a fresh open (cold directory blocks and dentry
    // cache), the order of the two directories alternating: the machine is shared.
    let (mut best_cold, mut best_warm) = ([0f64; 2], [0f64; 2]);
    for round in 0..3 {
        let fs = Fs::open(img.path()).expect("open");
        let pass = |cf: bool| {
            let t = std::time::Instant::now();
            for i in 0..n {
                let name = if cf {
                    format!("/cf/FILE-name-{i:06}.DAT")
                } else {
                    format!("/plain/File-Name-{i:06}.dat")
                };
                fs.metadata(&name).expect("stat");
            }
            n as f64 / t.elapsed().as_secs_f64()
        };
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for cf in order {
            let s0 = fs.cache_stats().1;
            let cold = pass(cf);
            let s1 = fs.cache_stats().1;
            let warm = pass(cf);
            let s2 = fs.cache_stats().1;
            println!(
                "round {round} {}: cold {cold:.0}/s dentry hits/misses {:?}, warm {warm:.0}/s {:?}",
                if cf { "casefolded" } else { "plain" },
                (s1.0 - s0.0, s1.1 - s0.1),
                (s2.0 - s1.0, s2.1 - s1.1)
            );
            let k = usize::from(cf);
            best_cold[k] = best_cold[k].max(cold);
            best_warm[k] = best_warm[k].max(warm);
        }
        fs.close().expect("close");
    }
    println!(
        "cold (after open): plain {:.0}/s, casefolded {:.0}/s, ratio {:.2}",
        best_cold[0],
        best_cold[1],
        best_cold[1] / best_cold[0]
    );
    println!(
        "warm (dentry cache): plain {:.0}/s, casefolded {:.0}/s, ratio {:.2}",
        best_warm[0],
        best_warm[1],
        best_warm[1] / best_warm[0]
    );
}
