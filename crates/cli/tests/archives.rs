//! `rext4 mkfs -d ARCHIVE` and `--layer` (issue 39, item 2): a tar archive (GNU and
//! pax formats, sparse members, long names, hard links, devices, xattrs, owners), plain
//! and gzip/zstd/xz-compressed, from a file or standard input, gives the tree that
//! `tar -x --numeric-owner` as root gives (compared through the kernel's view of the
//! image); three container layers with whiteouts and an opaque directory, as tar files
//! and as an OCI image layout, give the tree applying them by hand gives (a damaged
//! blob is refused by its digest); bad archives
//! (`..` and absolute names, a member through a symlink, a hard link to nothing, a
//! truncated or corrupt archive) give a clear error or the documented handling.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rext4_testkit::{
    can_loop_mount, diff_trees, e2fsck_fn, fixture_bytes, skip, snapshot_dir, Compare, LoopMount,
    TempDir,
};

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn sh(cmd: &str, dir: &Path) {
    let st = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .status()
        .expect("sh");
    assert!(st.success(), "{cmd}");
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A source tree with what archives carry: long names, owners, modes, hard links,
/// symlinks, devices, a fifo, a sparse file, xattrs, old times.
fn make_source(root: &Path) {
    let long = "n".repeat(150);
    sh(
        &format!(
            "mkdir -p a/b/c d/{long} e && \
             printf hello > a/f && chmod 4755 a/f && \
             ln a/f a/b/hard && ln -s ../f a/b/sym && ln -s {t} e/longlink && \
             mkfifo e/fifo && mknod e/null c 1 3 && mknod e/blk b 7 200 && \
             truncate -s 3M e/sparse && printf end >> e/sparse && \
             printf x | dd of=e/sparse bs=1 seek=1000000 conv=notrunc 2>/dev/null && \
             touch d/{long}/file-{long} && \
             chown 1234:5678 a/f d && chown -h 42:43 a/b/sym && chmod 700 d && \
             setfattr -n user.k -v value a/f && setfattr -n user.dir -v d a/b && \
             chmod 1777 e",
            t = "t".repeat(120)
        ),
        root,
    );
    std::fs::write(root.join("a/b/c/data"), fixture_bytes(3, 200_000)).expect("data");
    std::fs::write(root.join("zeros"), vec![0u8; 50_000]).expect("zeros");
    sh(
        "find . -exec touch -h -d '2001-02-03 04:05:06.789' {} +",
        root,
    );
}

/// Extract `archive` as root would (numeric owners, xattrs, permissions) into `dir`.
fn tar_x(archive: &Path, dir: &Path) {
    let st = Command::new("tar")
        .args(["--numeric-owner", "--xattrs", "--xattrs-include=*", "-xpf"])
        .arg(archive)
        .arg("-C")
        .arg(dir)
        .status()
        .expect("tar -x");
    assert!(st.success());
}

fn mkfs_from(
    src: &std::ffi::OsStr,
    img: &Path,
    stdin: Option<&Path>,
    extra: &[&str],
) -> common::Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rext4"));
    c.args(["mkfs", "-q"]).args(extra);
    if !src.is_empty() {
        c.arg("-d").arg(src);
    }
    c.arg(img).arg("64M");
    match stdin {
        Some(p) => c.stdin(std::fs::File::open(p).expect("stdin file")),
        None => c.stdin(Stdio::null()),
    };
    let out = c.output().expect("rext4 mkfs");
    common::Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn compare_with_kernel(img: &Path, reference: &Path, what: &str) {
    let r = e2fsck_fn(img);
    assert!(r.clean, "{what}: {}", r.output);
    let m = LoopMount::new(img, true, "").expect("loop mount");
    let ours = snapshot_dir(m.path()).expect("snapshot image");
    let theirs = snapshot_dir(reference).expect("snapshot reference");
    let cmp = Compare {
        ignore_dir_size: true,
        ignore_paths: vec![b"lost+found".to_vec()],
        ..Compare::semantic()
    };
    let d = diff_trees(&theirs, &ours, &cmp);
    assert!(
        d.is_empty(),
        "{what}: differs from tar -x:\n{}",
        d.join("\n")
    );
}

#[test]
fn tar_archives_in_every_compression_give_what_tar_x_gives() {
    if !is_root() || !have("tar") || !have("setfattr") {
        return skip("needs root, tar and setfattr");
    }
    if let Err(e) = can_loop_mount() {
        return skip(&e);
    }
    let w = TempDir::new("archives").expect("tempdir");
    let src = w.join("src");
    std::fs::create_dir(&src).expect("src");
    make_source(&src);
    // GNU format (old-style sparse members), pax (sparse 1.0, xattrs, sub-second times).
    sh("tar -S --format=gnu -cf ../gnu.tar -C . .", &src);
    sh("tar --xattrs -S --format=pax -cf ../pax.tar -C . .", &src);
    let mut archives: Vec<PathBuf> = vec![w.join("gnu.tar"), w.join("pax.tar")];
    sh("gzip -c pax.tar > pax.tar.gz", w.path());
    archives.push(w.join("pax.tar.gz"));
    if have("zstd") {
        sh("zstd -q -c pax.tar > pax.tar.zst", w.path());
        archives.push(w.join("pax.tar.zst"));
    } else {
        skip("zstd not installed: the zstd case");
    }
    if have("xz") {
        sh("xz -c gnu.tar > gnu.tar.xz", w.path());
        archives.push(w.join("gnu.tar.xz"));
    } else {
        skip("xz not installed: the xz case");
    }
    for a in &archives {
        let name = a.file_name().expect("name").to_string_lossy().into_owned();
        let reference = w.join(format!("ref-{name}"));
        std::fs::create_dir(&reference).expect("ref");
        // mkfs's lost+found is in the image, not in the archive: the same (ignored)
        // directory in the reference keeps the root's link count comparable.
        std::fs::create_dir(reference.join("lost+found")).expect("lost+found");
        tar_x(a, &reference);
        let img = w.join(format!("{name}.img"));
        let r = mkfs_from(a.as_os_str(), &img, None, &[]);
        assert_eq!(r.code, 0, "{name}: {}", r.stderr);
        compare_with_kernel(&img, &reference, &name);
        // The sparse member keeps its holes: 3 MiB in a few blocks.
        let m = LoopMount::new(&img, true, "").expect("mount");
        let md = std::fs::metadata(m.path().join("e/sparse")).expect("sparse");
        use std::os::unix::fs::MetadataExt;
        assert!(
            md.blocks() < 64,
            "{name}: sparse member took {} sectors",
            md.blocks()
        );
    }
    // Standard input, compressed.
    let img = w.join("stdin.img");
    let r = mkfs_from(
        std::ffi::OsStr::new("-"),
        &img,
        Some(&w.join("pax.tar.gz")),
        &[],
    );
    assert_eq!(r.code, 0, "stdin: {}", r.stderr);
    compare_with_kernel(&img, &w.join("ref-pax.tar.gz"), "stdin");
}

/// A tar archive written by Python's tarfile, members given as (name, type, data or
/// link target); type is one of "f", "d", "l" (symlink), "h" (hard link).
fn python_tar(out: &Path, members: &[(&str, &str, &str)]) {
    let mut script = String::from(
        "import tarfile, io, sys\nt = tarfile.open(sys.argv[1], 'w', format=tarfile.GNU_FORMAT)\n",
    );
    for (name, kind, arg) in members {
        let ty = match *kind {
            "f" => "tarfile.REGTYPE",
            "d" => "tarfile.DIRTYPE",
            "l" => "tarfile.SYMTYPE",
            _ => "tarfile.LNKTYPE",
        };
        script.push_str(&format!(
            "i = tarfile.TarInfo({name:?}); i.type = {ty}; i.mode = 0o755; i.mtime = 1000000000\n"
        ));
        if *kind == "f" {
            script.push_str(&format!(
                "d = {arg:?}.encode(); i.size = len(d); t.addfile(i, io.BytesIO(d))\n"
            ));
        } else {
            if *kind == "l" || *kind == "h" {
                script.push_str(&format!("i.linkname = {arg:?}\n"));
            }
            script.push_str("t.addfile(i)\n");
        }
    }
    script.push_str("t.close()\n");
    let st = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .arg(out)
        .status()
        .expect("python3");
    assert!(st.success());
}

fn ls(img: &Path, path: &str) -> String {
    common::rext4(&[std::ffi::OsString::from("ls"), common::spec(img, path)]).stdout_str()
}

#[test]
fn bad_archives_are_refused_or_handled_as_documented() {
    if !have("python3") {
        return skip("needs python3 to write malicious archives");
    }
    let w = TempDir::new("bad-archives").expect("tempdir");
    // `..` members are refused (named), absolute ones placed under the root, a member
    // through a symlink refused (never followed out of the tree), a hard link to a
    // missing member refused; the rest is placed and the command fails.
    let evil = w.join("evil.tar");
    // A name of 2,100 components, past PATH_MAX: refused, not walked.
    let deep = format!("{}f", "d/".repeat(2100));
    python_tar(
        &evil,
        &[
            ("ok", "f", "fine"),
            ("../escape", "f", "x"),
            ("a/../../escape2", "f", "x"),
            ("/abs", "f", "absolute"),
            ("lnk", "l", "/etc"),
            ("lnk/passwd", "f", "owned"),
            ("dir", "d", ""),
            ("dirlink", "l", "dir"),
            ("dirlink/inside", "f", "x"),
            ("hl", "h", "missing"),
            ("hl2", "h", "../ok"),
            (&deep, "f", "too deep"),
        ],
    );
    let img = w.join("evil.img");
    let r = mkfs_from(evil.as_os_str(), &img, None, &[]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    for needle in [
        "../escape",
        "a/../../escape2",
        "lnk/passwd",
        "dirlink/inside",
        "hl: ",
        "hl2",
        "longer than 4096 bytes",
    ] {
        assert!(
            r.stderr.contains(needle),
            "no error names {needle}: {}",
            r.stderr
        );
    }
    assert!(r.stderr.contains("removing leading '/'"), "{}", r.stderr);
    assert!(!w.path().parent().expect("parent").join("escape").exists());
    let root = ls(&img, "/");
    for want in ["ok", "abs", "lnk", "dir", "dirlink"] {
        assert!(root.lines().any(|l| l == want), "{want} missing: {root}");
    }
    assert!(!root.contains("escape") && !root.lines().any(|l| l == "hl"));
    assert!(ls(&img, "/dir").trim().is_empty());
    let r = e2fsck_fn(&img);
    assert!(r.clean, "{}", r.output);

    // A truncated archive and one with a damaged header: an error naming the archive.
    let good = w.join("good.tar");
    let big = "y".repeat(100_000);
    python_tar(&good, &[("a", "f", "1"), ("b", "f", &big), ("c", "f", "3")]);
    let bytes = std::fs::read(&good).expect("tar");
    let cut = w.join("cut.tar");
    std::fs::write(&cut, &bytes[..50_000]).expect("cut");
    let r = mkfs_from(cut.as_os_str(), &w.join("cut.img"), None, &[]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("cut.tar"), "{}", r.stderr);
    let mut bad = bytes.clone();
    bad[512 + 512 + 148] ^= 0x55; // the second member's header checksum
    let badp = w.join("bad.tar");
    std::fs::write(&badp, &bad).expect("bad");
    let r = mkfs_from(badp.as_os_str(), &w.join("bad.img"), None, &[]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("bad.tar"), "{}", r.stderr);
    // A gzip stream cut short is an error too, not a shorter tree.
    let gz = w.join("good.tar.gz");
    sh("gzip -c good.tar > good.tar.gz", w.path());
    let gzb = std::fs::read(&gz).expect("gz");
    std::fs::write(&gz, &gzb[..gzb.len() / 2]).expect("cut gz");
    let r = mkfs_from(gz.as_os_str(), &w.join("gz.img"), None, &[]);
    assert_eq!(r.code, 1, "{}", r.stderr);
}

/// Three layers: whiteouts of a file, a directory and a missing path, an opaque
/// directory, a file replaced, a directory replaced by a file.
fn make_layers(w: &Path) -> Vec<PathBuf> {
    let t = "touch -h -d '2002-03-04 05:06:07'";
    sh(
        &format!(
            "mkdir -p L1/a L1/b L1/c L1/keepdir L2/a L2/b L2/d L3/a && \
             echo 1 > L1/a/f1 && echo 2 > L1/a/f2 && echo x > L1/b/x && echo k > L1/c/keep && \
             echo z > L1/keepdir/z && \
             : > L2/a/.wh.f1 && : > L2/b/.wh..wh..opq && echo y > L2/b/y && : > L2/.wh.missing && \
             echo n > L2/d/new && \
             echo two > L3/a/f2 && echo c3 > L3/c && : > L3/.wh.keepdir && \
             find L1 L2 L3 -exec {t} {{}} + && \
             tar -C L1 -czf L1.tar.gz . && tar -C L2 -cf L2.tar . && tar -C L3 -cf L3.tar ."
        ),
        w,
    );
    let mut layers = vec![w.join("L1.tar.gz"), w.join("L2.tar"), w.join("L3.tar")];
    if have("zstd") {
        sh("zstd -q --rm L2.tar -o L2.tar.zst", w);
        layers[1] = w.join("L2.tar.zst");
    }
    // What applying them by hand gives.
    sh(
        &format!(
            "mkdir -p ref/lost+found ref/a ref/b ref/d && echo two > ref/a/f2 && echo y > ref/b/y && \
             echo c3 > ref/c && echo n > ref/d/new && find ref -path ref/lost+found -prune -o -exec {t} {{}} +"
        ),
        w,
    );
    layers
}

/// An OCI image layout holding `layers` (bottom first).
fn make_oci(w: &Path, layers: &[PathBuf]) -> PathBuf {
    let oci = w.join("oci");
    std::fs::create_dir_all(oci.join("blobs/sha256")).expect("oci");
    let sha = |p: &Path| -> String {
        let out = Command::new("sha256sum")
            .arg(p)
            .output()
            .expect("sha256sum");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .expect("digest")
            .to_string()
    };
    let put = |p: &Path| -> (String, u64) {
        let d = sha(p);
        std::fs::copy(p, oci.join("blobs/sha256").join(&d)).expect("blob");
        (d, std::fs::metadata(p).expect("len").len())
    };
    let mut descs = Vec::new();
    for l in layers {
        let (d, n) = put(l);
        descs.push(format!(
            "{{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:{d}\",\"size\":{n}}}"
        ));
    }
    let config = w.join("config.json");
    std::fs::write(
        &config,
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#,
    )
    .expect("config");
    let (cd, cn) = put(&config);
    let manifest = w.join("manifest.json");
    std::fs::write(
        &manifest,
        format!(
            "{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
             \"config\":{{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\
             \"digest\":\"sha256:{cd}\",\"size\":{cn}}},\"layers\":[{}]}}",
            descs.join(",")
        ),
    )
    .expect("manifest");
    let (md, mn) = put(&manifest);
    std::fs::write(
        oci.join("index.json"),
        format!(
            "{{\"schemaVersion\":2,\"manifests\":[{{\"mediaType\":\
             \"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:{md}\",\"size\":{mn}}}]}}"
        ),
    )
    .expect("index");
    std::fs::write(oci.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).expect("layout");
    oci
}

#[test]
fn layers_and_an_oci_layout_apply_whiteouts_and_opaque_directories() {
    if !is_root() || !have("tar") || !have("sha256sum") {
        return skip("needs root, tar and sha256sum");
    }
    if let Err(e) = can_loop_mount() {
        return skip(&e);
    }
    let w = TempDir::new("layers").expect("tempdir");
    let layers = make_layers(w.path());
    let oci = make_oci(w.path(), &layers);
    let reference = w.join("ref");
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    for l in &layers {
        args.push("--layer".into());
        args.push(l.into());
    }
    for (name, extra) in [
        ("tars.img", args.clone()),
        ("oci.img", vec!["--layer".into(), oci.clone().into()]),
    ] {
        let img = w.join(name);
        let extra: Vec<&str> = extra.iter().map(|a| a.to_str().expect("utf-8")).collect();
        let r = mkfs_from(std::ffi::OsStr::new(""), &img, None, &extra);
        assert_eq!(r.code, 0, "{name}: {}", r.stderr);
        compare_with_kernel(&img, &reference, name);
    }
    // A damaged layer blob is refused before anything of it is applied.
    let blob = std::fs::read_dir(oci.join("blobs/sha256"))
        .expect("blobs")
        .map(|e| e.expect("e").path())
        .find(|p| std::fs::read(p).is_ok_and(|b| b.len() > 64 && b[..2] == [0x1f, 0x8b]))
        .expect("the gzip layer");
    let mut bytes = std::fs::read(&blob).expect("blob");
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    std::fs::write(&blob, &bytes).expect("damage");
    let r = mkfs_from(
        std::ffi::OsStr::new(""),
        &w.join("damaged.img"),
        None,
        &["--layer", oci.to_str().expect("utf-8")],
    );
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("does not match its digest"),
        "{}",
        r.stderr
    );
    // A layout whose index names a blob outside blobs/ is refused.
    std::fs::write(
        oci.join("index.json"),
        br#"{"schemaVersion":2,"manifests":[{"digest":"sha256:../../../etc/passwd"}]}"#,
    )
    .expect("index");
    let r = mkfs_from(
        std::ffi::OsStr::new(""),
        &w.join("bad.img"),
        None,
        &["--layer", oci.to_str().expect("utf-8")],
    );
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("malformed digest"), "{}", r.stderr);
}
