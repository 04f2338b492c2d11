//! `rext4 cp -r` of an image whose names include "..", "/"-like bytes and symlinks
//! pointing outside writes nothing outside the destination.
//!
//! Each test builds a "world" directory holding an empty canary directory `outside/`,
//! a file `victim` with known bytes, and the destinations. The image (made by mkfs.ext4
//! and debugfs, then patched in its raw directory blocks) holds symlinks to the canary
//! and the victim (absolute and relative), entries renamed to ".", "..", "a/b", "/etc",
//! "../../outside/pw" and a name with a NUL, entries that reuse the name of an earlier
//! symlink (so that following it would write into the canary or the victim), and
//! directory entries pointing back at an ancestor (cycles). After every run the world
//! outside the destinations must be unchanged (same paths, types, modes, owners, sizes,
//! contents, mtimes and ctimes), symlinks in the destination must be symlinks holding the
//! image's target bytes, and refused entries must make the exit code 1 with a message.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use common::{inode_of, rename_entry, retarget_entry, rext4, spec};
use rext4_testkit::{
    debugfs_w_checked, diff_trees, mkfs, snapshot_dir, Compare, Image, Kind, MkfsOptions, TempDir,
    Tree,
};

const VICTIM_BYTES: &[u8] = b"original victim bytes\n";
const PWNED: &[u8] = b"PWNED\n";

/// The host side: canary directory, victim file, destinations.
struct World {
    dir: TempDir,
}

impl World {
    fn new() -> World {
        let dir = TempDir::new("cpsafe").expect("tempdir");
        fs::create_dir(dir.join("outside")).expect("canary dir");
        fs::write(dir.join("victim"), VICTIM_BYTES).expect("victim");
        World { dir }
    }

    fn outside(&self) -> PathBuf {
        self.dir.join("outside")
    }

    fn victim(&self) -> PathBuf {
        self.dir.join("victim")
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

fn bytes(p: &Path) -> &[u8] {
    p.as_os_str().as_bytes()
}

/// Builds the hostile image. Every patched directory is linear (a handful of entries).
/// `fix_csum`: recompute the dirent-tail checksums after patching (the engine's name
/// checks are exercised) or leave them stale (the checksum verifier is).
fn build_image(world: &World, opts: &MkfsOptions, fix_csum: bool) -> Image {
    let img = mkfs(opts).expect("mkfs");
    let host = TempDir::new("cpsafe-host").expect("tempdir");
    let fine = host.join("fine");
    let pwned = host.join("pwned");
    fs::write(&fine, b"fine\n").expect("write");
    fs::write(&pwned, PWNED).expect("write");
    let fine = fine.to_str().expect("utf-8 temp path");
    let pwned = pwned.to_str().expect("utf-8 temp path");
    let outside = world.outside();
    let outside = outside.to_str().expect("utf-8 temp path");
    let victim = world.victim();
    let victim = victim.to_str().expect("utf-8 temp path");
    let created = world.dir.join("created");
    let created = created.to_str().expect("utf-8 temp path");

    let script = format!(
        "mkdir ok\n\
         cd /ok\n\
         write {fine} file\n\
         cd /\n\
         symlink abs {outside}\n\
         symlink absf {victim}\n\
         symlink rel ../outside\n\
         symlink deepdots ../../../../../../../../..\n\
         mkdir sub\n\
         cd /sub\n\
         symlink rel2 ../../outside\n\
         cd /\n\
         mkdir dup\n\
         cd /dup\n\
         symlink link {outside}\n\
         mkdir linl\n\
         cd /dup/linl\n\
         write {pwned} pwned\n\
         cd /dup\n\
         symlink vict {victim}\n\
         write {pwned} vicu\n\
         symlink hlnk {victim}\n\
         write {pwned} hlnl\n\
         ln hlnl hzzz\n\
         sif hlnl links_count 2\n\
         symlink mkd {created}\n\
         mkdir mke\n\
         cd /dup/mke\n\
         write {pwned} pwned\n\
         cd /dup\n\
         mkdir revz\n\
         cd /dup/revz\n\
         write {pwned} pwned\n\
         cd /dup\n\
         symlink revs {outside}\n\
         cd /\n\
         mkdir dots\n\
         cd /dots\n\
         write {pwned} xx\n\
         mkdir zz\n\
         cd /dots/zz\n\
         write {pwned} pwned\n\
         cd /dots\n\
         mkdir y\n\
         cd /\n\
         mkdir slash1\n\
         cd /slash1\n\
         write {fine} good\n\
         write {pwned} abc\n\
         cd /\n\
         mkdir slash2\n\
         cd /slash2\n\
         write {pwned} aetc\n\
         cd /\n\
         mkdir slash3\n\
         cd /slash3\n\
         write {pwned} aaaaaaaaaaaaaaaa\n\
         cd /\n\
         mkdir nul\n\
         cd /nul\n\
         write {pwned} nzx\n\
         cd /\n\
         mkdir cyc\n\
         mkdir cyc/a\n\
         cd /cyc/a\n\
         write {fine} back\n\
         write {fine} root\n\
         cd /\n"
    );
    debugfs_w_checked(img.path(), script).expect("debugfs populate");

    let p = img.path();
    // Names that collide with an earlier (or later) symlink of the same directory.
    rename_entry(p, "/dup", b"linl", b"link", fix_csum);
    rename_entry(p, "/dup", b"vicu", b"vict", fix_csum);
    rename_entry(p, "/dup", b"hlnl", b"hlnk", fix_csum);
    rename_entry(p, "/dup", b"mke", b"mkd", fix_csum);
    rename_entry(p, "/dup", b"revz", b"revs", fix_csum);
    // Extra "." and ".." entries (a file, a directory holding a file, a directory).
    rename_entry(p, "/dots", b"xx", b"..", fix_csum);
    rename_entry(p, "/dots", b"zz", b"..", fix_csum);
    rename_entry(p, "/dots", b"y", b".", fix_csum);
    // Names holding '/' or NUL.
    rename_entry(p, "/slash1", b"abc", b"a/b", fix_csum);
    rename_entry(p, "/slash2", b"aetc", b"/etc", fix_csum);
    rename_entry(
        p,
        "/slash3",
        b"aaaaaaaaaaaaaaaa",
        b"../../outside/pw",
        fix_csum,
    );
    rename_entry(p, "/nul", b"nzx", b"n\0x", fix_csum);
    // Cycles: /cyc/a/back -> /cyc, /cyc/a/root -> the root directory.
    let (cyc, _) = inode_of(p, "/cyc");
    retarget_entry(p, "/cyc/a", b"back", cyc, 2, fix_csum);
    retarget_entry(p, "/cyc/a", b"root", 2, 2, fix_csum);
    img
}

/// What lies in the world outside the given destinations.
fn outside_state(world: &World) -> Tree {
    snapshot_dir(world.path()).expect("snapshot world")
}

/// Asserts the world outside `dests` is as before: same paths (nothing created or
/// removed), and for each the same type, mode, owner, size, content, mtime and ctime.
/// atime is ignored: our own snapshot reads files, which moves their atime (relatime).
/// `dest_created`: rext4 created a destination directly in the world directory, which
/// changes the world directory's own mtime, ctime and link count; those three are then
/// not compared for the world directory itself (a new path still shows as "only in").
fn assert_outside_unchanged(world: &World, before: &Tree, dests: &[&str], dest_created: bool) {
    let mut before = before.clone();
    let mut after = outside_state(world);
    if dest_created {
        for t in [&mut before, &mut after] {
            if let Some(root) = t.get_mut(&Vec::new()) {
                root.mtime = (0, 0);
                root.ctime = (0, 0);
                root.nlink = 0;
            }
        }
    }
    let cmp = Compare {
        ignore_atime: true,
        ignore_paths: dests.iter().map(|d| d.as_bytes().to_vec()).collect(),
        ..Compare::exact()
    };
    let d = diff_trees(&before, &after, &cmp);
    assert!(
        d.is_empty(),
        "world changed outside {dests:?}:\n{}",
        d.join("\n")
    );
    // Spelled out as well: the canary stays empty and the victim intact.
    let canary: Vec<_> = fs::read_dir(world.outside())
        .expect("canary dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(canary.is_empty(), "canary dir got {canary:?}");
    assert_eq!(
        fs::read(world.victim()).expect("victim"),
        VICTIM_BYTES,
        "victim file changed"
    );
    assert!(
        !world.dir.join("created").exists(),
        "a path behind a symlink was created"
    );
}

/// Every symlink under `root` (not followed) with its target bytes, keyed by path.
fn symlinks_under(root: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    snapshot_dir(root)
        .expect("snapshot dest")
        .into_iter()
        .filter(|(_, n)| n.kind == Kind::Symlink)
        .map(|(p, n)| (p, n.symlink.expect("symlink target")))
        .collect()
}

fn assert_symlink(root: &Path, rel: &str, target: &[u8]) {
    let p = root.join(rel);
    let md = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert!(
        md.file_type().is_symlink(),
        "{} is not a symlink",
        p.display()
    );
    let t = fs::read_link(&p).expect("readlink");
    assert_eq!(
        bytes(&t),
        target,
        "{}: target {:?}",
        p.display(),
        t.display()
    );
}

fn assert_kind(root: &Path, rel: &str, kind: Kind) {
    let p = root.join(rel);
    let n = rext4_testkit::snapshot_node(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert_eq!(n.kind, kind, "{}", p.display());
}

/// Runs `rext4 cp -r -q IMG:src DEST` and checks the common expectations.
/// `want`: the expected exit code (1 when the source holds refused entries).
fn cp(
    world: &World,
    img: &Image,
    src: &str,
    dest: &str,
    dest_created: bool,
    want: i32,
) -> (PathBuf, String) {
    let before = outside_state(world);
    let dest_path = world.dir.join(dest);
    let r = rext4(&[
        OsStr::new("cp"),
        OsStr::new("-r"),
        OsStr::new("-q"),
        &spec(img.path(), src),
        dest_path.as_os_str(),
    ]);
    eprintln!("cp -r {src} {dest}: exit {}\n{}", r.code, r.stderr);
    assert_outside_unchanged(world, &before, &[dest], dest_created);
    assert_eq!(r.code, want, "cp -r {src}: exit code\n{}", r.stderr);
    if want == 1 {
        assert!(
            r.stderr.contains("error(s) while copying"),
            "no summary on stderr:\n{}",
            r.stderr
        );
    } else {
        assert!(r.stderr.is_empty(), "cp -r {src}: {}", r.stderr);
    }
    (dest_path, r.stderr)
}

/// The expectations for a copy of the whole image (with checksums fixed, so the
/// engine's name checks and the copier's collision and cycle handling decide).
fn check_root_copy(world: &World, root: &Path) {
    let outside = bytes(&world.outside()).to_vec();
    let victim = bytes(&world.victim()).to_vec();
    assert_eq!(fs::read(root.join("ok/file")).expect("ok/file"), b"fine\n");
    assert_symlink(root, "abs", &outside);
    assert_symlink(root, "absf", &victim);
    assert_symlink(root, "rel", b"../outside");
    assert_symlink(root, "deepdots", b"../../../../../../../../..");
    assert_symlink(root, "sub/rel2", b"../../outside");
    // First come, first served: the earlier entry of a duplicated name wins, the later
    // one is refused (it is never merged into, or written through, the first).
    assert_symlink(root, "dup/link", &outside);
    assert_symlink(root, "dup/vict", &victim);
    assert_symlink(root, "dup/hlnk", &victim);
    assert_symlink(root, "dup/mkd", bytes(&world.dir.join("created")));
    assert_kind(root, "dup/revs", Kind::Dir);
    assert_eq!(
        fs::read(root.join("dup/revs/pwned")).expect("revs/pwned"),
        PWNED
    );
    // Extra "." / ".." entries are never created as such (and cannot be); the
    // directory itself is copied.
    assert_kind(root, "dots", Kind::Dir);
    // Directories holding a '/' or NUL name are refused as corrupt; the directory
    // itself exists (it was created before its entries were read) but holds nothing.
    for d in ["slash1", "slash2", "slash3", "nul"] {
        assert_kind(root, d, Kind::Dir);
        let n = fs::read_dir(root.join(d)).expect("read_dir").count();
        assert_eq!(n, 0, "{d} should be empty");
    }
    // Every symlink in the copy holds exactly the bytes the image holds.
    let links = symlinks_under(root);
    for (p, t) in &links {
        let ok = t.as_slice() == outside.as_slice()
            || t.as_slice() == victim.as_slice()
            || t.as_slice() == bytes(&world.dir.join("created"))
            || t.as_slice() == b"../outside"
            || t.as_slice() == b"../../outside"
            || t.as_slice() == b"../../../../../../../../..";
        assert!(ok, "unexpected symlink {:?} -> {:?}", p.escape_ascii(), t);
    }
}

fn assert_mentions(stderr: &str, what: &[&str]) {
    for w in what {
        assert!(
            stderr.contains(w),
            "stderr does not mention {w:?}:\n{stderr}"
        );
    }
}

fn run_variant(opts: &MkfsOptions, label: &str) {
    let world = World::new();
    let img = build_image(&world, opts, true);

    // Whole image into an existing destination.
    fs::create_dir(world.dir.join("d1")).expect("mkdir");
    let (d1, stderr) = cp(&world, &img, "/", "d1", false, 1);
    check_root_copy(&world, &d1);
    // The refusals are named: invalid names, collisions, cycles.
    assert_mentions(&stderr, &["invalid name", "File exists", "appears twice"]);
    assert_eq!(
        stderr.matches("invalid name").count(),
        4,
        "[{label}] one refusal per directory holding a '/' or NUL name:\n{stderr}"
    );

    // Whole image into a destination rext4 creates.
    let (d2, _) = cp(&world, &img, "/", "d2", true, 1);
    check_root_copy(&world, &d2);

    // A subdirectory: the copy lands in DEST/<name>.
    fs::create_dir(world.dir.join("d3")).expect("mkdir");
    let (d3, _) = cp(&world, &img, "/dup", "d3", false, 1);
    assert_symlink(&d3.join("dup"), "link", bytes(&world.outside()));
    assert_kind(&d3.join("dup"), "revs", Kind::Dir);

    // A cycle below the source: /cyc/a/back -> /cyc is cut; /cyc/a/root -> / is copied
    // once (with everything in it) until it reaches /cyc again.
    fs::create_dir(world.dir.join("d4")).expect("mkdir");
    let (d4, _) = cp(&world, &img, "/cyc", "d4", false, 1);
    assert_kind(&d4, "cyc/a", Kind::Dir);
    assert!(
        fs::symlink_metadata(d4.join("cyc/a/back")).is_err(),
        "the cycle entry must not be copied"
    );
    check_root_copy(&world, &d4.join("cyc/a/root"));
    assert!(
        fs::symlink_metadata(d4.join("cyc/a/root/cyc")).is_err(),
        "the second visit of /cyc is refused"
    );

    // Copying a source that names ".." or "." as its last component stays inside DEST
    // (GNU cp copies the directory's contents into DEST then, and so must rext4).
    for (src, d, want) in [
        ("/ok/..", "d5", 1),
        ("/ok/.", "d6", 0),
        ("/sub/../ok/..", "d7", 1),
    ] {
        fs::create_dir(world.dir.join(d)).expect("mkdir");
        let (dp, _) = cp(&world, &img, src, d, false, want);
        assert!(
            fs::read_dir(&dp).expect("read_dir").next().is_some(),
            "{src}: nothing copied into {d}"
        );
    }
    assert_symlink(&world.dir.join("d5"), "abs", bytes(&world.outside()));
    assert_eq!(
        fs::read(world.dir.join("d6/file")).expect("d6/file"),
        b"fine\n"
    );
}

#[test]
fn hostile_names_and_symlinks_stay_inside_dest_1k_csum() {
    run_variant(&MkfsOptions::new(1024, 8 << 20), "1k metadata_csum");
}

#[test]
fn hostile_names_and_symlinks_stay_inside_dest_4k_no_csum() {
    run_variant(
        &MkfsOptions::new(4096, 16 << 20)
            .arg("-O")
            .arg("^metadata_csum"),
        "4k no metadata_csum",
    );
}

/// The same patches with stale checksums: every patched directory fails verification,
/// rext4 reports corruption, exits 1, and still writes nothing outside DEST.
#[test]
fn stale_dirent_checksums_are_reported_and_nothing_escapes() {
    let world = World::new();
    let img = build_image(&world, &MkfsOptions::new(4096, 16 << 20), false);
    fs::create_dir(world.dir.join("d1")).expect("mkdir");
    let (d1, stderr) = cp(&world, &img, "/", "d1", false, 1);
    assert_mentions(&stderr, &["corrupted", "checksum"]);
    let before = outside_state(&world);
    let r = rext4(&[OsStr::new("ls"), &spec(img.path(), "/dup")]);
    assert_outside_unchanged(&world, &before, &["d1"], false);
    assert_eq!(
        r.code, 1,
        "ls of a directory with a bad checksum: {}",
        r.stderr
    );
    assert!(r.stderr.contains("corrupted"), "{}", r.stderr);
    assert!(r.stderr.contains("checksum"), "{}", r.stderr);
    // Unpatched parts are copied; symlinks are copied as symlinks.
    assert_eq!(fs::read(d1.join("ok/file")).expect("ok/file"), b"fine\n");
    assert_symlink(&d1, "abs", bytes(&world.outside()));
    assert_symlink(&d1, "rel", b"../outside");
    assert_symlink(&d1, "sub/rel2", b"../../outside");
    // Every patched directory is empty in the copy.
    for d in ["dup", "dots", "slash1", "slash2", "slash3", "nul", "cyc/a"] {
        assert_kind(&d1, d, Kind::Dir);
        assert_eq!(
            fs::read_dir(d1.join(d)).expect("read_dir").count(),
            0,
            "{d} should be empty"
        );
    }
}

/// Sources that are symlinks are copied as symlinks (never followed), and a destination
/// that is a symlink (here to the canary) is refused rather than written through.
#[test]
fn symlink_sources_and_destinations() {
    let world = World::new();
    let img = build_image(&world, &MkfsOptions::new(4096, 16 << 20), true);
    let outside = bytes(&world.outside()).to_vec();

    // `cp IMG:/abs NEW`: NEW becomes the symlink itself.
    let (d, _) = cp(&world, &img, "/abs", "s1", true, 0);
    assert_symlink(world.path(), "s1", &outside);
    assert_eq!(d, world.dir.join("s1"));
    // `cp -r IMG:/dup/link DIR`: DIR/link is the symlink; nothing is copied through it.
    fs::create_dir(world.dir.join("s2")).expect("mkdir");
    cp(&world, &img, "/dup/link", "s2", false, 0);
    assert_symlink(&world.dir.join("s2"), "link", &outside);
    // `cp -r IMG:/rel DIR` with a relative target that would leave DIR.
    fs::create_dir(world.dir.join("s3")).expect("mkdir");
    cp(&world, &img, "/rel", "s3", false, 0);
    assert_symlink(&world.dir.join("s3"), "rel", b"../outside");
    // A plain file into an existing directory.
    fs::create_dir(world.dir.join("s4")).expect("mkdir");
    cp(&world, &img, "/ok/file", "s4", false, 0);
    assert_eq!(
        fs::read(world.dir.join("s4/file")).expect("s4/file"),
        b"fine\n"
    );

    // DEST is a symlink to the canary directory: refused, nothing written through it.
    std::os::unix::fs::symlink(world.outside(), world.dir.join("s5")).expect("symlink");
    let (_, stderr) = cp(&world, &img, "/ok", "s5", false, 1);
    assert!(stderr.contains("not a directory"), "{stderr}");
    assert_symlink(world.path(), "s5", &outside);
    // DEST is a symlink to the victim file: refused for a file source too.
    std::os::unix::fs::symlink(world.victim(), world.dir.join("s6")).expect("symlink");
    let before = outside_state(&world);
    let r = rext4(&[
        OsStr::new("cp"),
        &spec(img.path(), "/ok/file"),
        world.dir.join("s6").as_os_str(),
    ]);
    assert_outside_unchanged(&world, &before, &["s6"], false);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("exists and is not a regular file"),
        "{}",
        r.stderr
    );
    assert_symlink(world.path(), "s6", bytes(&world.victim()));
}
