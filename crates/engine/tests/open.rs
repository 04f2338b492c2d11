//! Opening images: the feature gate (unknown incompat refused by name, unknown
//! ro_compat read-only), and an image whose journal needs recovery (kernel "crash"
//! copy taken while mounted) is replayed: in memory for a read-only open (the image is
//! left as it is), on disk for a read-write one.

mod common;

use std::sync::Arc;

use rext4::format::superblock::{Superblock, SB_OFFSET};
use rext4::{Error, Fs, FsOptions};
use rext4_testkit::{mkfs, skip, LoopMount, MkfsOptions};

fn with_features(img: &[u8], incompat_or: u32, ro_or: u32) -> Arc<Vec<u8>> {
    let mut b = img.to_vec();
    let o = SB_OFFSET as usize;
    let sb = &mut b[o..o + 1024];
    let inc = u32::from_le_bytes(sb[0x60..0x64].try_into().expect("4 bytes")) | incompat_or;
    sb[0x60..0x64].copy_from_slice(&inc.to_le_bytes());
    let ro = u32::from_le_bytes(sb[0x64..0x68].try_into().expect("4 bytes")) | ro_or;
    sb[0x64..0x68].copy_from_slice(&ro.to_le_bytes());
    let c = Superblock::compute_csum(sb);
    sb[0x3FC..0x400].copy_from_slice(&c.to_le_bytes());
    Arc::new(b)
}

#[test]
fn unknown_incompat_is_refused_by_name() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let raw = std::fs::read(img.path()).expect("read");
    let b = with_features(&raw, 0x10000 | 0x8000_0000, 0);
    match common::open_patched(&b, vec![]) {
        Err(Error::Unsupported(msg)) => {
            assert!(
                msg.contains("encrypt") && msg.contains("FEATURE_I31"),
                "{msg}"
            )
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("opened an image with unknown incompat features"),
    }
}

/// A device without ext4's magic number (zeros, random bytes, another filesystem, a
/// file too small for a superblock) is "not ext4", not a corrupted ext4 filesystem;
/// an ext4 superblock with a damaged magic number or checksum stays corrupted.
#[test]
fn non_ext4_devices_are_told_from_damaged_ext4() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let raw = std::fs::read(img.path()).expect("read");
    let o = SB_OFFSET as usize;
    let mut random = vec![0u8; raw.len()];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in random.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut xfs = vec![0u8; raw.len()];
    xfs[..4].copy_from_slice(b"XFSB");
    for (label, bytes) in [
        ("zeros", vec![0u8; raw.len()]),
        ("random", random),
        ("xfs", xfs),
        ("tiny", vec![0u8; 1500]),
    ] {
        match common::open_patched(&Arc::new(bytes), vec![]) {
            Err(Error::NotExt4(why)) => assert!(why.contains("ext4"), "{label}: {why}"),
            Err(e) => panic!("{label}: wrong error {e}"),
            Ok(_) => panic!("{label}: opened"),
        }
    }
    // One flipped bit of the magic, or of the free blocks count: damage.
    for at in [o + 0x38, o + 0x0C] {
        let flipped = raw[at] ^ 0x04;
        match common::open_patched(&Arc::new(raw.clone()), vec![(at as u64, flipped)]) {
            Err(Error::Corrupted { what, .. }) => {
                assert!(
                    what.contains("magic") || what.contains("checksum"),
                    "{what}"
                )
            }
            Err(e) => panic!("byte {at}: wrong error {e}"),
            Ok(_) => panic!("byte {at}: opened"),
        }
    }
}

#[test]
fn unknown_ro_compat_opens_read_only_with_a_reason() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let raw = std::fs::read(img.path()).expect("read");
    let b = with_features(&raw, 0, 0x4000_0000);
    let dev = common::OverlayDevice {
        base: b,
        patches: vec![],
    };
    let opts = FsOptions {
        read_only: false,
        ..FsOptions::default()
    };
    let fs = Fs::open_device(Arc::new(dev), opts).expect("opens");
    assert!(fs.is_read_only());
    assert!(
        fs.warnings().iter().any(|w| w.contains("FEATURE_R30")),
        "{:?}",
        fs.warnings()
    );
    fs.metadata("/lost+found").expect("still readable");
}

#[test]
fn journal_needing_recovery_opens_read_only_with_a_warning() {
    let img = mkfs(&MkfsOptions::new(4096, 64 << 20)).expect("mkfs");
    let m = match LoopMount::new(img.path(), false, "commit=60") {
        Ok(m) => m,
        Err(e) => return skip(&format!("needs a kernel mount: {e}")),
    };
    for i in 0..20 {
        let p = m.path().join(format!("f{i}"));
        std::fs::write(&p, vec![i as u8; 5000]).expect("write");
        std::fs::File::open(&p)
            .and_then(|f| f.sync_all())
            .expect("fsync");
    }
    // A copy taken while mounted: the log holds committed transactions, RECOVER is set.
    let crash = img.path().with_extension("crash");
    std::fs::copy(img.path(), &crash).expect("copy while mounted");
    m.unmount().expect("unmount");
    let before = std::fs::read(&crash).expect("read");
    let fs = Fs::open(&crash).expect("opens");
    assert!(fs.is_read_only());
    let w = fs.warnings().join("\n");
    assert!(
        w.contains("journal replayed in memory only") && w.contains("unchanged"),
        "{w}"
    );
    // The replayed tree is visible: every fsynced file, with its content.
    for i in 0..20 {
        assert_eq!(
            fs.read(format!("/f{i}")).expect("fsynced file"),
            vec![i as u8; 5000]
        );
    }
    drop(fs);
    assert!(
        std::fs::read(&crash).expect("read") == before,
        "a read-only open changed the image"
    );
    // A read-write open replays on disk; e2fsck then finds nothing to do.
    let fs = Fs::open_with(
        &crash,
        rext4::FsOptions {
            read_only: false,
            ..rext4::FsOptions::default()
        },
    )
    .expect("rw open");
    assert!(
        fs.warnings()
            .iter()
            .any(|w| w.starts_with("journal replayed:")),
        "{:?}",
        fs.warnings()
    );
    fs.close().expect("close");
    let r = rext4_testkit::e2fsck_fn(&crash);
    let _ = std::fs::remove_file(&crash);
    assert!(r.clean, "{}", r.output);
}
