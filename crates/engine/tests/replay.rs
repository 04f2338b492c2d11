//! Replay of kernel-written journals: images written by the kernel and copied while
//! still mounted (the log holds committed transactions, revoke records after deletes,
//! an open-but-unlinked file on the orphan list). rext4's replay of one copy and
//! `e2fsck -fy` of another give the same tree and the same `dumpe2fs` output, but for
//! fields listed below with the reason they differ.

mod common;

use std::process::Command;

use rext4::{Fs, FsOptions};
use rext4_testkit::{
    diff_trees, e2fsck_fn, e2fsck_fy, mkfs, skip, Compare, LoopMount, MkfsOptions,
};

/// dumpe2fs lines that legitimately differ after the two recoveries.
fn comparable(line: &str) -> bool {
    ![
        // rext4's read-write open counts as a mount, e2fsck does not.
        "Last mount time:",
        "Mount count:",
        // Both write the superblock, at different times.
        "Last write time:",
        // e2fsck records its check.
        "Last checked:",
        // Next transaction ID after replay: the kernel (and rext4) use last+1, e2fsck
        // last+2 (format notes §2.13).
        "Journal sequence:",
        // Covers the fields above.
        "Checksum:",
        "Journal checksum:",
        // Bytes written over the filesystem's life: each tool counts its own I/O.
        "Lifetime writes:",
    ]
    .iter()
    .any(|p| line.starts_with(p))
}

/// Group lines without what e2fsck recomputes and the kernel (and rext4) only lower:
/// itable_unused ("unused inodes") and the INODE_UNINIT flag of groups left without
/// inodes (format notes §2.2), and the descriptor checksum that covers them.
fn normalise_group_line(l: &str) -> String {
    let mut l = l.to_string();
    if l.starts_with("Group ") {
        if let Some(i) = l.find(" csum 0x") {
            l.replace_range(i..i + 14, "");
        }
        l = l.replace("INODE_UNINIT, ", "");
    }
    if let Some(i) = l.find(" unused inodes") {
        let start = l[..i].rfind(", ").unwrap_or(i);
        l.replace_range(start..i + " unused inodes".len(), "");
    }
    l
}

fn dumpe2fs(p: &std::path::Path) -> Vec<String> {
    let out = Command::new("dumpe2fs")
        .arg(p)
        .env("TZ", "UTC")
        .output()
        .expect("dumpe2fs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| comparable(l))
        .map(normalise_group_line)
        .collect()
}

fn case(bs: u32, upstream: bool) {
    let label = format!("{bs} upstream={upstream}");
    let img = mkfs(&MkfsOptions::new(bs, 64 << 20).upstream(upstream)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "commit=60") {
        Ok(m) => m,
        Err(e) => return skip(&format!("needs a kernel mount: {e}")),
    };
    let root = m.path();
    std::fs::create_dir_all(root.join("a/b/c")).expect("mkdir");
    for i in 0..200 {
        std::fs::write(root.join(format!("a/f{i}")), vec![i as u8; 1000 + i * 37]).expect("write");
    }
    std::fs::create_dir(root.join("gone")).expect("mkdir");
    for i in 0..100 {
        std::fs::write(root.join(format!("gone/g{i}")), vec![1u8; 4096]).expect("write");
    }
    let sync = |p: &std::path::Path| {
        std::fs::File::open(p)
            .and_then(|f| f.sync_all())
            .expect("fsync")
    };
    sync(&root.join("a/f0"));
    std::fs::remove_dir_all(root.join("gone")).expect("rm -r");
    std::fs::write(root.join("a/b/c/deep"), b"deep").expect("write");
    let open = std::fs::File::create(root.join("open-unlinked")).expect("create");
    std::io::Write::write_all(&mut &open, &[9u8; 20_000]).expect("write");
    std::fs::remove_file(root.join("open-unlinked")).expect("unlink while open");
    sync(&root.join("a/b/c/deep"));
    let copy_a = img.path().with_extension("a");
    let copy_b = img.path().with_extension("b");
    std::fs::copy(img.path(), &copy_a).expect("copy while mounted");
    std::fs::copy(img.path(), &copy_b).expect("copy while mounted");
    drop(open);
    m.unmount().expect("unmount");
    let h = rext4_testkit::dumpe2fs_h(&copy_a).expect("dumpe2fs");
    assert!(
        h["Filesystem features"].contains("needs_recovery"),
        "[{label}] the copy needs no recovery"
    );

    let r = e2fsck_fy(&copy_a);
    assert!(r.exit_code <= 1, "[{label}] e2fsck -fy: {}", r.output);
    let fs = Fs::open_with(
        &copy_b,
        FsOptions {
            read_only: false,
            ..FsOptions::default()
        },
    )
    .expect("rext4 replay");
    assert!(
        fs.warnings()
            .iter()
            .any(|w| w.starts_with("journal replayed:")),
        "{:?}",
        fs.warnings()
    );
    fs.close().expect("close");
    let r = e2fsck_fn(&copy_b);
    assert!(
        r.clean,
        "[{label}] e2fsck after rext4's replay: {}",
        r.output
    );

    let ta = common::snapshot(&Fs::open(&copy_a).expect("open a")).expect("walk a");
    let tb = common::snapshot(&Fs::open(&copy_b).expect("open b")).expect("walk b");
    let d = diff_trees(&ta, &tb, &Compare::exact());
    assert!(d.is_empty(), "[{label}] trees differ:\n{}", d.join("\n"));
    assert!(ta.contains_key(&b"a/b/c/deep"[..]) && !ta.contains_key(&b"gone"[..]));
    let (da, db) = (dumpe2fs(&copy_a), dumpe2fs(&copy_b));
    let diff: Vec<String> = da
        .iter()
        .zip(&db)
        .filter(|(x, y)| x != y)
        .map(|(x, y)| format!("e2fsck: {x}\nrext4:  {y}"))
        .collect();
    assert!(
        diff.is_empty() && da.len() == db.len(),
        "[{label}] dumpe2fs differs:\n{}",
        diff.join("\n")
    );
    let _ = std::fs::remove_file(copy_a);
    let _ = std::fs::remove_file(copy_b);
}

#[test]
fn kernel_journal_1k_debian() {
    case(1024, false);
}

#[test]
fn kernel_journal_4k_upstream() {
    case(4096, true);
}

#[test]
fn kernel_journal_4k_debian() {
    case(4096, false);
}
