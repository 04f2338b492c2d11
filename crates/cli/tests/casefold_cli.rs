//! Casefold through the CLI and the mount: `rext4 mkfs -O casefold [-E
//! encoding_flags=strict]` makes what mke2fs makes (features, s_encoding and
//! s_encoding_flags, dumpe2fs's "Character encoding" line), `rext4 info` shows the
//! encoding, `rext4 chattr +F/-F` needs an empty directory, and through a FUSE mount
//! (chattr +F by the ioctl, which e2fsprogs' chattr sends): a case variant stats the
//! file, creating one opens the existing file (EEXIST with O_EXCL), a name unlinked or
//! renamed through one variant is gone for every other (no stale kernel dentry), a
//! non-UTF-8 name is EINVAL in a strict casefolded directory, `rext4 ls` shows the names
//! as created, and `e2fsck -fn` is clean after.

mod common;
mod fuse_mount;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use rext4_testkit::{dumpe2fs_h, e2fsck_fn, mkfs, skip, Image, MkfsOptions};

use common::{read_superblock, rext4, spec};
use fuse_mount::{cannot_mount, Mounted};

fn rext4_mkfs(args: &[&str]) -> Image {
    let img = Image::create_sparse(64 << 20).expect("image");
    let mut a: Vec<&OsStr> = vec!["mkfs".as_ref(), "-q".as_ref(), "-F".as_ref()];
    a.extend(args.iter().map(|s| OsStr::new(*s)));
    a.push(img.path().as_os_str());
    let r = rext4(&a);
    assert_eq!(r.code, 0, "rext4 mkfs {args:?}: {}", r.stderr);
    img
}

#[test]
fn mkfs_and_info_as_mke2fs() {
    for (ours, theirs) in [
        (vec!["-O", "casefold"], vec!["-O", "casefold"]),
        (
            vec!["-O", "casefold", "-E", "encoding_flags=strict"],
            vec!["-O", "casefold", "-E", "encoding_flags=strict"],
        ),
        (vec!["-E", "encoding=utf8"], vec!["-E", "encoding=utf8"]),
    ] {
        let a = rext4_mkfs(&ours);
        let mut o = MkfsOptions::new(0, 64 << 20);
        for t in &theirs {
            o = o.arg(t);
        }
        let b = mkfs(&o).expect("mke2fs");
        let (sa, sb) = (read_superblock(a.path()), read_superblock(b.path()));
        assert_eq!(sa.feature_incompat, sb.feature_incompat, "{ours:?}");
        assert_eq!(
            (sa.encoding, sa.encoding_flags),
            (sb.encoding, sb.encoding_flags),
            "{ours:?}"
        );
        let (da, db) = (
            dumpe2fs_h(a.path()).expect("dumpe2fs"),
            dumpe2fs_h(b.path()).expect("dumpe2fs"),
        );
        for k in ["Filesystem features", "Character encoding"] {
            assert_eq!(da.get(k), db.get(k), "{k} for {ours:?}");
        }
        let info = rext4(&["info".as_ref(), a.path().as_os_str()]);
        assert_eq!(info.code, 0, "{}", info.stderr);
        let text = info.stdout_str();
        assert!(
            text.contains("Character encoding:       utf8-12.1\n"),
            "{text}"
        );
        assert_eq!(
            text.contains("Character encoding flags: strict\n"),
            sa.encoding_flags == 1,
            "{text}"
        );
        let r = e2fsck_fn(a.path());
        assert!(r.clean, "{}", r.output);
    }
    // Flags without casefold: a usage error, nothing made.
    let img = Image::create_sparse(64 << 20).expect("image");
    let r = rext4(&[
        "mkfs".as_ref(),
        "-q".as_ref(),
        "-E".as_ref(),
        "encoding_flags=strict".as_ref(),
        img.path().as_os_str(),
    ]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("casefold"), "{}", r.stderr);
}

#[test]
fn chattr_f_needs_an_empty_directory() {
    let img = rext4_mkfs(&["-O", "casefold"]);
    let s = |p: &str| spec(img.path(), p);
    assert_eq!(rext4(&["mkdir".as_ref(), s("/d").as_os_str()]).code, 0);
    let r = rext4(&["chattr".as_ref(), "+F".as_ref(), s("/d").as_os_str()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // Names as created, found through any case.
    let src = tempfile_with(b"hello");
    for name in ["Straße", "ΟΔΟΣ", "Ünïcödé"] {
        let r = rext4(&[
            "cp".as_ref(),
            src.as_os_str(),
            s(&format!("/d/{name}")).as_os_str(),
        ]);
        assert_eq!(r.code, 0, "cp {name}: {}", r.stderr);
    }
    let cat = rext4(&["cat".as_ref(), s("/d/STRASSE").as_os_str()]);
    assert_eq!(
        (cat.code, cat.stdout),
        (0, b"hello".to_vec()),
        "{}",
        cat.stderr
    );
    let ls = rext4(&["ls".as_ref(), s("/d").as_os_str()]);
    assert_eq!(ls.code, 0, "{}", ls.stderr);
    let mut names: Vec<String> = ls.stdout_str().lines().map(str::to_string).collect();
    names.sort();
    assert_eq!(names, ["Straße", "Ünïcödé", "ΟΔΟΣ"]);
    let r = rext4(&["chattr".as_ref(), "-F".as_ref(), s("/d").as_os_str()]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("not empty"), "{}", r.stderr);
    let r = rext4(&["chattr".as_ref(), "+F".as_ref(), s("/d/ΟΔΟΣ").as_os_str()]);
    assert_ne!(r.code, 0, "+F on a file");
    let _ = std::fs::remove_file(&src);
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

fn tempfile_with(data: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("rext4-cf-{}", std::process::id()));
    std::fs::write(&p, data).expect("temp file");
    p
}

fn errno(r: std::io::Result<impl Sized>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

#[test]
fn mount_lookups_ignore_case() {
    if let Some(why) = cannot_mount() {
        skip(&why);
        return;
    }
    for strict in [false, true] {
        let img = if strict {
            rext4_mkfs(&["-O", "casefold", "-E", "encoding_flags=strict"])
        } else {
            rext4_mkfs(&["-O", "casefold"])
        };
        {
            let mut m = Mounted::new(img.path(), &[]);
            let d = m.join("cf");
            std::fs::create_dir(&d).expect("mkdir");
            let st = Command::new("chattr").arg("+F").arg(&d).status();
            match st {
                Ok(s) if s.success() => {}
                other => panic!("chattr +F through the mount: {other:?}"),
            }
            for i in 0..500 {
                std::fs::write(d.join(format!("Größe-{i}")), i.to_string()).expect("create");
            }
            for i in 0..500 {
                let a = std::fs::metadata(d.join(format!("GRÖSSE-{i}"))).expect("variant");
                let b = std::fs::metadata(d.join(format!("größe-{i}"))).expect("variant");
                assert_eq!(a.ino(), b.ino());
            }
            // O_EXCL on a variant: EEXIST; without it, the existing file.
            let v = d.join("GRÖSSE-7");
            assert_eq!(
                errno(
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&v)
                ),
                Some(libc::EEXIST)
            );
            let ino = std::fs::metadata(d.join("Größe-7")).expect("orig").ino();
            let f = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(d.join("grösse-7"))
                .expect("open existing");
            assert_eq!(f.metadata().expect("meta").ino(), ino);
            drop(f);
            // Unlink through one variant: every variant is gone (no stale dentry).
            std::fs::remove_file(d.join("GRÖSSE-8")).expect("unlink by variant");
            assert_eq!(
                errno(std::fs::metadata(d.join("größe-8"))),
                Some(libc::ENOENT)
            );
            assert_eq!(
                errno(std::fs::metadata(d.join("Größe-8"))),
                Some(libc::ENOENT)
            );
            // Rename through a variant.
            std::fs::rename(d.join("GRÖSSE-9"), d.join("Moved")).expect("rename");
            assert_eq!(
                errno(std::fs::metadata(d.join("größe-9"))),
                Some(libc::ENOENT)
            );
            assert!(std::fs::metadata(d.join("MOVED")).is_ok());
            // A name that is not UTF-8.
            let bad = d.join(OsStr::from_bytes(b"bad\xffname"));
            let r = std::fs::write(&bad, b"x");
            if strict {
                assert_eq!(errno(r), Some(libc::EINVAL), "strict");
            } else {
                r.expect("default mode keeps the bytes");
            }
            // Subdirectories inherit.
            std::fs::create_dir(d.join("Sub")).expect("mkdir sub");
            std::fs::write(d.join("SUB/Inner"), b"i").expect("inner");
            assert_eq!(std::fs::read(d.join("sub/INNER")).expect("inner"), b"i");
            // -F on a non-empty directory: ENOTEMPTY from the ioctl.
            let out = Command::new("chattr")
                .arg("-F")
                .arg(&d)
                .output()
                .expect("chattr");
            assert!(!out.status.success());
            m.unmount();
        }
        if !strict {
            // e2fsprogs 1.47 cannot hash a non-UTF-8 name in a casefolded htree (its
            // casefold fails): take the name out before asking e2fsck.
            // (`rext4 rm` takes UTF-8 arguments only: the API removes it.)
            let fs = rext4::Fs::open_with(
                img.path(),
                rext4::FsOptions {
                    read_only: false,
                    ..rext4::FsOptions::default()
                },
            )
            .expect("open");
            fs.remove_file(Path::new(OsStr::from_bytes(b"/cf/bad\xffname")))
                .expect("rm the opaque name");
            fs.close().expect("close");
        }
        let r = e2fsck_fn(img.path());
        assert!(r.clean, "strict {strict}: {}", r.output);
        let ls = rext4(&["ls".as_ref(), spec(img.path(), "/cf").as_os_str()]);
        assert!(
            ls.stdout_str().lines().any(|l| l == "Größe-0"),
            "{}",
            ls.stdout_str()
        );
        assert!(ls.stdout_str().lines().any(|l| l == "Moved"));
    }
}
