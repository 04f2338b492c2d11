//! qcow2 images read as their guest disk (`rext4::device::qcow2`): a tree the kernel
//! wrote, converted by `qemu-img` to qcow2 v2, v3, compressed, and as an overlay over
//! a backing file (named relatively), reads identically through rext4, also under
//! `?partition=N`. A backing-file loop, an L2 pointer past the end of the file and
//! mutated headers and tables are errors, never a panic or a hang. Writing is refused
//! by name.

mod common;

use std::path::Path;
use std::process::Command;

use rext4::{Error, Fs, FsOptions, ImageSpec};
use rext4_testkit::{
    diff_trees, populate_kernel, skip, snapshot_dir, Compare, Fixture, LoopMount, MkfsOptions,
    TempDir,
};

fn qemu_img(args: &[&str]) -> bool {
    match Command::new("qemu-img").args(args).output() {
        Ok(o) if o.status.success() => true,
        Ok(o) => panic!("qemu-img {args:?}: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            skip(&format!("qemu-img: {e}"));
            false
        }
    }
}

fn open(spec: &str) -> rext4::Result<Fs> {
    Fs::open_spec(&ImageSpec::parse(spec)?, FsOptions::default())
}

#[test]
fn kernel_tree_reads_identically_through_qcow2() {
    let dir = TempDir::new("qcow2").expect("tmp");
    let raw = dir.join("base.img");
    rext4_testkit::mkfs_at(&raw, &MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
    let m = match LoopMount::new(&raw, false, "") {
        Ok(m) => m,
        Err(e) => return skip(&format!("kernel loop mount: {e}")),
    };
    populate_kernel(m.path(), &Fixture::quick()).expect("populate");
    m.unmount().expect("unmount");
    let m = LoopMount::new(&raw, true, "noatime").expect("mount ro");
    let kernel = snapshot_dir(m.path()).expect("snapshot");
    m.unmount().expect("unmount");
    let d = |n: &str| dir.join(n).display().to_string();
    let raw_s = raw.display().to_string();
    if !qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        "-o",
        "compat=0.10",
        &raw_s,
        &d("v2.qcow2"),
    ]) {
        return;
    }
    qemu_img(&["convert", "-O", "qcow2", &raw_s, &d("v3.qcow2")]);
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4096",
        &raw_s,
        &d("c.qcow2"),
    ]);
    // An overlay over a backing file named relatively, with a change of its own.
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "v3.qcow2",
        "-F",
        "qcow2",
        &d("over.qcow2"),
    ]);
    for name in ["v2.qcow2", "v3.qcow2", "c.qcow2", "over.qcow2"] {
        let fs = open(&d(name)).expect(name);
        let ours = common::snapshot(&fs).expect("walk");
        let diff = diff_trees(&kernel, &ours, &Compare::exact());
        assert!(
            diff.is_empty(),
            "[{name}]\n{}",
            diff[..diff.len().min(30)].join("\n")
        );
    }
    // Writing is refused by name, the file untouched.
    let before = std::fs::read(d("v3.qcow2")).expect("read");
    let e = Fs::open_spec(
        &ImageSpec::file(d("v3.qcow2")),
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .map(|_| ())
    .expect_err("rw");
    assert!(
        matches!(&e, Error::Unsupported(m) if m.contains("writing qcow2")),
        "{e}"
    );
    assert!(std::fs::read(d("v3.qcow2")).expect("read") == before);
}

/// Offsets of a qcow2 header's fields.
const L1_OFFSET: usize = 40;

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8"))
}

#[test]
fn bad_qcow2_images_are_named() {
    let dir = TempDir::new("qcow2bad").expect("tmp");
    let raw = dir.join("base.img");
    rext4_testkit::mkfs_at(&raw, &MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let q = dir.join("q.qcow2");
    if !qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        &raw.display().to_string(),
        &q.display().to_string(),
    ]) {
        return;
    }
    let good = std::fs::read(&q).expect("read");
    let with = |bytes: &[u8]| {
        let p = dir.join("m.qcow2");
        std::fs::write(&p, bytes).expect("write");
        p
    };
    let read_all = |p: &Path| -> rext4::Result<()> {
        let fs = Fs::open(p)?;
        common::snapshot(&fs).map(|_| ())
    };

    // An L2 pointer (the L1 entry) past the end of the file.
    let mut b = good.clone();
    let l1 = be64(&b, L1_OFFSET) as usize;
    b[l1..l1 + 8].copy_from_slice(&(0x8000_0000_0000_0000u64 | (1u64 << 40)).to_be_bytes());
    let e = read_all(&with(&b)).expect_err("L2 past end").to_string();
    assert!(e.contains("not a cluster inside"), "{e}");

    // A backing-file chain that loops: the image names itself.
    let mut b = good.clone();
    let name = b"m.qcow2";
    let at = 0x1000usize.min(b.len() - 16);
    let at = if at < 104 + 16 { 512 } else { at };
    b[at..at + name.len()].copy_from_slice(name);
    b[8..16].copy_from_slice(&(at as u64).to_be_bytes());
    b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
    let e = Fs::open(with(&b))
        .map(|_| ())
        .expect_err("loop")
        .to_string();
    assert!(e.contains("backing-file chain loops"), "{e}");

    // Bad header fields, named.
    let mut b = good.clone();
    b[20..24].copy_from_slice(&30u32.to_be_bytes());
    let e = Fs::open(with(&b))
        .map(|_| ())
        .expect_err("bits")
        .to_string();
    assert!(e.contains("cluster_bits 30"), "{e}");
    let mut b = good.clone();
    b[36..40].copy_from_slice(&0u32.to_be_bytes());
    let e = Fs::open(with(&b)).map(|_| ()).expect_err("l1").to_string();
    assert!(e.contains("does not cover"), "{e}");

    // Random mutations of the header, the L1 table and the first L2 table: errors or
    // values, no panic, no hang.
    let l2 = be64(&good, l1) & 0x00ff_ffff_ffff_fe00;
    let ranges = [(0u64, 112u64), (l1 as u64, 64), (l2, 4096)];
    let mut rng = rext4_testkit::crash::Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..200 {
        let mut b = good.clone();
        for (k, p) in common::mutations(&mut rng, &good, &ranges, 6) {
            if let Some(x) = b.get_mut(k as usize) {
                *x = p;
            }
        }
        let _ = read_all(&with(&b));
    }
}
