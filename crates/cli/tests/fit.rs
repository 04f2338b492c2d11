//! `rext4 mkfs -d SRC IMAGE` without a SIZE (issue 39, item 4): the image is made as
//! small as the contents need — at most 1.2x the size `resize2fs -M` reaches for the
//! same tree built by mke2fs — e2fsck clean, holding the tree (through the kernel's
//! view); `--extra` leaves that much free; a tar on standard input fits too; with
//! SOURCE_DATE_EPOCH and a seed two fitted builds are byte-identical.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use rext4_testkit::{
    can_loop_mount, diff_trees, dumpe2fs_h, e2fsck_fn, fixture_bytes, skip, snapshot_dir, Compare,
    LoopMount, TempDir,
};

fn make_tree(root: &Path) {
    for d in 0..12 {
        let dir = root.join(format!("d{d:02}/sub"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..40u64 {
            let n = [0usize, 10, 700, 5000, 30_000, 150_000][(f % 6) as usize];
            std::fs::write(dir.join(format!("f{f:03}")), fixture_bytes(d * 100 + f, n)).expect("w");
        }
    }
}

fn walk_files(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

fn rext4(args: &[&std::ffi::OsStr], stdin: Option<&Path>, epoch: bool) -> common::Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rext4"));
    c.args(args);
    match stdin {
        Some(p) => c.stdin(std::fs::File::open(p).expect("stdin")),
        None => c.stdin(Stdio::null()),
    };
    if epoch {
        c.env("SOURCE_DATE_EPOCH", "1700000000");
    } else {
        c.env_remove("SOURCE_DATE_EPOCH");
    }
    let out = c.output().expect("rext4");
    common::Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

fn field(img: &Path, name: &str) -> u64 {
    dumpe2fs_h(img).expect("dumpe2fs")[name]
        .trim()
        .parse()
        .expect(name)
}

fn bytes_of(img: &Path) -> u64 {
    field(img, "Block count") * field(img, "Block size")
}

#[test]
fn images_sized_to_fit() {
    if Command::new("resize2fs").arg("-V").output().is_err() {
        return skip("resize2fs not installed");
    }
    let w = TempDir::new("fit").expect("tempdir");
    let src = w.join("src");
    make_tree(&src);
    let img = w.join("fit.img");
    let r = rext4(
        &[
            os("mkfs"),
            os("-q"),
            os("-d"),
            src.as_os_str(),
            img.as_os_str(),
        ],
        None,
        false,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let fsck = e2fsck_fn(&img);
    assert!(fsck.clean, "{}", fsck.output);
    // mke2fs -d of the same tree, shrunk by resize2fs -M.
    let theirs = w.join("theirs.img");
    std::fs::File::create(&theirs)
        .and_then(|f| f.set_len(1 << 30))
        .expect("image");
    let st = Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-d"])
        .arg(&src)
        .arg(&theirs)
        .status()
        .expect("mke2fs");
    assert!(st.success());
    let st = Command::new("resize2fs")
        .arg("-M")
        .arg(&theirs)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("resize2fs");
    assert!(st.success());
    let (ours, min) = (bytes_of(&img), bytes_of(&theirs));
    assert!(
        ours * 10 <= min * 12,
        "fitted image is {ours} bytes, resize2fs -M reached {min}"
    );
    assert_eq!(std::fs::metadata(&img).expect("len").len(), ours);

    // --extra 50% leaves at least half the contents' size free.
    let roomy = w.join("roomy.img");
    let r = rext4(
        &[
            os("mkfs"),
            os("-q"),
            os("--extra"),
            os("50%"),
            os("-d"),
            src.as_os_str(),
            roomy.as_os_str(),
        ],
        None,
        false,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let bs = field(&roomy, "Block size");
    let content: u64 = walk_files(&src)
        .iter()
        .map(|p| std::fs::metadata(p).expect("len").len().div_ceil(bs))
        .sum();
    let free = field(&roomy, "Free blocks");
    assert!(
        free >= content / 2,
        "--extra 50%: {free} blocks free for {content} of contents"
    );
    assert!(e2fsck_fn(&roomy).clean);

    // A tar on standard input, fitted.
    let tar = w.join("src.tar");
    let st = Command::new("tar")
        .arg("-cf")
        .arg(&tar)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .expect("tar");
    assert!(st.success());
    let piped = w.join("piped.img");
    let r = rext4(
        &[os("mkfs"), os("-q"), os("-d"), os("-"), piped.as_os_str()],
        Some(&tar),
        false,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(e2fsck_fn(&piped).clean);
    assert!(
        !std::fs::read_dir(w.path()).expect("ls").any(|e| e
            .expect("e")
            .file_name()
            .to_string_lossy()
            .starts_with('.')),
        "a scratch file was left behind"
    );

    // Reproducible: two fitted builds with the epoch and a seed are identical.
    let (a, b) = (w.join("a.img"), w.join("b.img"));
    for img in [&a, &b] {
        let r = rext4(
            &[
                os("mkfs"),
                os("-q"),
                os("--seed"),
                os("fit"),
                os("-d"),
                src.as_os_str(),
                img.as_os_str(),
            ],
            None,
            true,
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    assert!(
        std::fs::read(&a).expect("a") == std::fs::read(&b).expect("b"),
        "fitted builds differ"
    );

    // The tree is all there (the kernel's view).
    if let Err(e) = can_loop_mount() {
        return skip(&e);
    }
    let m = LoopMount::new(&img, true, "").expect("mount");
    let mut ours = snapshot_dir(m.path()).expect("snapshot");
    ours.remove(&b"lost+found"[..]);
    let theirs = snapshot_dir(&src).expect("snapshot src");
    let cmp = Compare {
        ignore_dir_size: true,
        ..Compare::semantic()
    };
    let mut theirs_no_root = theirs.clone();
    theirs_no_root.remove(&Vec::new());
    ours.remove(&Vec::new());
    let d = diff_trees(&theirs_no_root, &ours, &cmp);
    assert!(d.is_empty(), "{}", d.join("\n"));
}
