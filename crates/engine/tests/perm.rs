//! Permission checks and ACL semantics of the embedding API against the kernel.
//!
//! - `access_matches_the_kernel`: a seeded random tree (directory and file modes,
//!   owners, groups, access ACLs with named users/groups and masks) is built through the
//!   API; for every path, several credentials and each of read/write/search, `Fs::access`
//!   must agree with the kernel's access(2) on a loop mount of the same image (run as that
//!   user with `setpriv ... test -r|-w|-x`).
//! - `default_acl_inheritance_matches_the_kernel`: files and directories created by the
//!   engine under a directory with a default ACL get the same mode and ACLs as ones the
//!   kernel creates next to them.
//! - `sticky_setattr_and_open_rules`: sticky-directory deletion, chmod/chown/utimes rules
//!   and `OpenOptions::creds` (table of Linux's answers).
//! - chmod rewrites an access ACL and setting one sets the mode (posix_acl_chmod and
//!   posix_acl_update_mode), checked against the kernel's view of the image.
//!
//! The kernel parts skip (printing why) without root, loop devices or setpriv.

mod common;

use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::process::Command;

use rext4::format::acl::{R, W, X};
use rext4::format::xattr::{
    acl_encode_vfs, AclEntry, ACL_GROUP, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER, ACL_UNDEFINED_ID,
    ACL_USER, ACL_USER_OBJ,
};
use rext4::{Creds, Error, Fs, OpenOptions, SetAttr, Timestamp, XattrFlags};
use rext4_testkit::crash::Rng;
use rext4_testkit::{e2fsck_fn, mkfs, skip, LoopMount, MkfsOptions};

use common::open_rw as rw;

const ACCESS: &str = "system.posix_acl_access";
const DEFAULT: &str = "system.posix_acl_default";

const EACCES: i32 = 13;

/// 0 for success, else the errno a frontend would report.
fn code<T>(r: rext4::Result<T>) -> i32 {
    r.map_or_else(|e| e.errno(), |_| 0)
}

fn e(tag: u16, perm: u16, id: u32) -> AclEntry {
    AclEntry { tag, perm, id }
}

fn set_acl(fs: &Fs, path: &str, name: &str, es: &[AclEntry]) {
    let ino = fs.resolve(path.as_bytes(), false).expect("resolve");
    fs.set_xattr_ino(
        ino,
        name.as_bytes(),
        &acl_encode_vfs(es),
        XattrFlags::default(),
    )
    .unwrap_or_else(|err| panic!("set {name} on {path}: {err}"));
}

fn chown(fs: &Fs, path: &str, uid: u32, gid: u32) {
    fs.lchown(path, Some(uid), Some(gid)).expect("chown");
}

/// Whether the kernel lets `c` access `path` for `w` (one of R, W, X).
fn kernel_access(path: &Path, c: &Creds, w: u16) -> bool {
    let flag = match w {
        R => "-r",
        W => "-w",
        _ => "-x",
    };
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={}", c.uid))
        .arg(format!("--regid={}", c.gid));
    if c.groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        let g: Vec<String> = c.groups.iter().map(u32::to_string).collect();
        cmd.arg(format!("--groups={}", g.join(",")));
    }
    let st = cmd
        .args(["--", "test", flag])
        .arg(path)
        .status()
        .expect("run setpriv");
    st.success()
}

fn have_setpriv() -> bool {
    Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

const MODES: [u32; 10] = [
    0o700, 0o710, 0o701, 0o750, 0o755, 0o711, 0o770, 0o777, 0o1777, 0o000,
];
const UIDS: [u32; 3] = [0, 1000, 1001];
const GIDS: [u32; 3] = [0, 100, 101];

fn random_acl(rng: &mut Rng, mode: u32) -> Vec<AclEntry> {
    let p = |rng: &mut Rng| (rng.next_u64() % 8) as u16;
    let mut es = vec![e(ACL_USER_OBJ, ((mode >> 6) & 7) as u16, ACL_UNDEFINED_ID)];
    if rng.next_u64().is_multiple_of(2) {
        es.push(e(ACL_USER, p(rng), 1001));
    }
    if rng.next_u64().is_multiple_of(3) {
        es.push(e(ACL_USER, p(rng), 1002));
    }
    es.push(e(ACL_GROUP_OBJ, p(rng), ACL_UNDEFINED_ID));
    if rng.next_u64().is_multiple_of(2) {
        es.push(e(ACL_GROUP, p(rng), 101));
    }
    es.push(e(ACL_MASK, p(rng), ACL_UNDEFINED_ID));
    es.push(e(ACL_OTHER, (mode & 7) as u16, ACL_UNDEFINED_ID));
    es
}

#[test]
fn access_matches_the_kernel() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let mut rng = Rng(0x5eed_acce55);
    let mut paths = vec!["/t".to_string()];
    fs.create_dir("/t").expect("mkdir");
    fs.set_permissions("/t", 0o755).expect("chmod");
    for d in 0..6 {
        let dir = format!("/t/d{d}");
        fs.create_dir(&dir).expect("mkdir");
        let mode = MODES[(rng.next_u64() % MODES.len() as u64) as usize];
        fs.set_permissions(&dir, mode).expect("chmod");
        chown(
            &fs,
            &dir,
            UIDS[(rng.next_u64() % 3) as usize],
            GIDS[(rng.next_u64() % 3) as usize],
        );
        if rng.next_u64().is_multiple_of(3) {
            set_acl(&fs, &dir, ACCESS, &random_acl(&mut rng, mode));
        }
        paths.push(dir.clone());
        for f in 0..6 {
            let file = format!("{dir}/f{f}");
            fs.write(&file, b"x").expect("create");
            let mode = (rng.next_u64() % 0o1000) as u32;
            fs.set_permissions(&file, mode).expect("chmod");
            chown(
                &fs,
                &file,
                UIDS[(rng.next_u64() % 3) as usize],
                GIDS[(rng.next_u64() % 3) as usize],
            );
            if rng.next_u64().is_multiple_of(3) {
                set_acl(&fs, &file, ACCESS, &random_acl(&mut rng, mode));
            }
            paths.push(file);
        }
    }
    let creds = [
        Creds::root(),
        Creds::new(1000, 100, vec![]),
        Creds::new(1001, 101, vec![100]),
        Creds::new(1002, 102, vec![101]),
        Creds::new(1003, 103, vec![]),
        Creds::new(1002, 100, vec![101, 0]),
    ];
    let mut ours = Vec::new();
    for p in &paths {
        for c in &creds {
            for w in [R, W, X] {
                let r = fs.access(p, c, w);
                assert!(
                    matches!(r, Ok(()) | Err(Error::PermissionDenied)),
                    "{p} {c:?} {w}: {r:?}"
                );
                ours.push((p.clone(), c.clone(), w, r.is_ok()));
            }
        }
    }
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
    if !have_setpriv() {
        return skip("setpriv (util-linux) is not installed");
    }
    let m = match LoopMount::new(img.path(), false, "") {
        Ok(m) => m,
        Err(e) => return skip(&e),
    };
    let mut diffs = Vec::new();
    for (p, c, w, ok) in &ours {
        let k = kernel_access(&m.path().join(&p[1..]), c, *w);
        if k != *ok {
            diffs.push(format!("{p} as {c:?} want {w}: kernel {k}, rext4 {ok}"));
        }
    }
    assert!(
        diffs.is_empty(),
        "{} of {} decisions differ:\n{}",
        diffs.len(),
        ours.len(),
        diffs.join("\n")
    );
}

fn acl_of(path: &Path, name: &str) -> Option<Vec<u8>> {
    let out = Command::new("getfattr")
        .args(["--absolute-names", "-e", "hex", "-n", name])
        .arg(path)
        .output()
        .expect("getfattr");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find_map(|l| l.split_once('=').map(|(_, v)| v.trim().as_bytes().to_vec()))
}

#[test]
fn default_acl_inheritance_matches_the_kernel() {
    let img = mkfs(&MkfsOptions::new(4096, 32 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let defaults: [Vec<AclEntry>; 3] = [
        // setfacl -d -m u:1000:rwx on a 0755 directory.
        vec![
            e(ACL_USER_OBJ, 7, ACL_UNDEFINED_ID),
            e(ACL_USER, 7, 1000),
            e(ACL_GROUP_OBJ, 5, ACL_UNDEFINED_ID),
            e(ACL_MASK, 7, ACL_UNDEFINED_ID),
            e(ACL_OTHER, 5, ACL_UNDEFINED_ID),
        ],
        // A minimal default ACL: works as a umask of 027.
        vec![
            e(ACL_USER_OBJ, 7, ACL_UNDEFINED_ID),
            e(ACL_GROUP_OBJ, 5, ACL_UNDEFINED_ID),
            e(ACL_OTHER, 0, ACL_UNDEFINED_ID),
        ],
        // Named group, restrictive mask.
        vec![
            e(ACL_USER_OBJ, 6, ACL_UNDEFINED_ID),
            e(ACL_GROUP_OBJ, 7, ACL_UNDEFINED_ID),
            e(ACL_GROUP, 6, 50),
            e(ACL_MASK, 4, ACL_UNDEFINED_ID),
            e(ACL_OTHER, 1, ACL_UNDEFINED_ID),
        ],
    ];
    let modes = [0o666u32, 0o777, 0o640, 0o2755];
    for (i, d) in defaults.iter().enumerate() {
        let dir = format!("/d{i}");
        fs.create_dir(&dir).expect("mkdir");
        set_acl(&fs, &dir, DEFAULT, d);
        for (j, mode) in modes.iter().enumerate() {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(*mode)
                .open(&fs, format!("{dir}/f{j}"))
                .expect("create");
            let parent = fs.resolve(dir.as_bytes(), true).expect("resolve");
            // mkdir(2) keeps only the permission and sticky bits of its mode argument.
            fs.mkdir_ino(parent, format!("s{j}").as_bytes(), *mode & 0o1777, 0, 0)
                .expect("mkdir");
        }
    }
    // Without a default ACL the mode is taken as given, and create_mode applies the
    // umask only there.
    fs.create_dir("/plain").expect("mkdir");
    let plain = fs.resolve(b"/plain", true).expect("resolve");
    assert_eq!(fs.create_mode(plain, 0o666, 0o022).expect("mode"), 0o644);
    let d0 = fs.resolve(b"/d0", true).expect("resolve");
    assert_eq!(fs.create_mode(d0, 0o666, 0o022).expect("mode"), 0o666);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);

    let m = match LoopMount::new(img.path(), false, "") {
        Ok(m) => m,
        Err(e) => return skip(&e),
    };
    for i in 0..defaults.len() {
        let dir = m.path().join(format!("d{i}"));
        for (j, mode) in modes.iter().enumerate() {
            let kf = dir.join(format!("kf{j}"));
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(*mode)
                .open(&kf)
                .expect("kernel create");
            let ks = dir.join(format!("ks{j}"));
            std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), *mode)
                .create(&ks)
                .expect("kernel mkdir");
            for (ours, theirs) in [
                (dir.join(format!("f{j}")), kf),
                (dir.join(format!("s{j}")), ks),
            ] {
                let a = std::fs::metadata(&ours).expect("stat").mode();
                let b = std::fs::metadata(&theirs).expect("stat").mode();
                assert_eq!(
                    a & 0o7777,
                    b & 0o7777,
                    "mode of {ours:?} vs kernel's {theirs:?} (default {i}, mode {mode:o})"
                );
                for name in [ACCESS, DEFAULT] {
                    assert_eq!(
                        acl_of(&ours, name),
                        acl_of(&theirs, name),
                        "{name} of {ours:?} vs kernel's {theirs:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn chmod_and_setting_an_acl_keep_mode_and_acl_together() {
    let img = mkfs(&MkfsOptions::new(1024, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    fs.write("/f", b"x").expect("create");
    set_acl(
        &fs,
        "/f",
        ACCESS,
        &[
            e(ACL_USER_OBJ, 6, ACL_UNDEFINED_ID),
            e(ACL_USER, 7, 1000),
            e(ACL_GROUP_OBJ, 4, ACL_UNDEFINED_ID),
            e(ACL_MASK, 5, ACL_UNDEFINED_ID),
            e(ACL_OTHER, 0, ACL_UNDEFINED_ID),
        ],
    );
    assert_eq!(fs.metadata("/f").expect("stat").permissions(), 0o650);
    fs.set_permissions("/f", 0o741).expect("chmod");
    let ino = fs.resolve(b"/f", true).expect("resolve");
    let v = fs
        .get_xattr_ino(ino, ACCESS.as_bytes())
        .expect("get")
        .expect("acl");
    let want = acl_encode_vfs(&[
        e(ACL_USER_OBJ, 7, ACL_UNDEFINED_ID),
        e(ACL_USER, 7, 1000),
        e(ACL_GROUP_OBJ, 4, ACL_UNDEFINED_ID),
        e(ACL_MASK, 4, ACL_UNDEFINED_ID),
        e(ACL_OTHER, 1, ACL_UNDEFINED_ID),
    ]);
    assert_eq!(v, want);
    // An ACL equivalent to a mode is not stored; it sets the mode.
    set_acl(
        &fs,
        "/f",
        ACCESS,
        &[
            e(ACL_USER_OBJ, 4, ACL_UNDEFINED_ID),
            e(ACL_GROUP_OBJ, 0, ACL_UNDEFINED_ID),
            e(ACL_OTHER, 4, ACL_UNDEFINED_ID),
        ],
    );
    assert_eq!(fs.metadata("/f").expect("stat").permissions(), 0o404);
    assert_eq!(fs.get_xattr_ino(ino, ACCESS.as_bytes()).expect("get"), None);
    // Removing an ACL that is not there is not an error (Linux), invalid ACLs are.
    fs.remove_xattr_ino(ino, ACCESS.as_bytes())
        .expect("remove absent ACL");
    let bad = acl_encode_vfs(&[
        e(ACL_GROUP_OBJ, 4, ACL_UNDEFINED_ID),
        e(ACL_USER_OBJ, 4, ACL_UNDEFINED_ID),
        e(ACL_OTHER, 4, ACL_UNDEFINED_ID),
    ]);
    assert!(matches!(
        fs.set_xattr_ino(ino, ACCESS.as_bytes(), &bad, XattrFlags::default()),
        Err(Error::InvalidInput(_))
    ));
    // A default ACL only on directories.
    assert!(matches!(
        fs.set_xattr_ino(ino, DEFAULT.as_bytes(), &want, XattrFlags::default()),
        Err(Error::PermissionDenied)
    ));
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}

#[test]
fn sticky_setattr_and_open_rules() {
    let img = mkfs(&MkfsOptions::new(4096, 16 << 20)).expect("mkfs");
    let fs = rw(img.path());
    let alice = Creds::new(1000, 100, vec![]);
    let bob = Creds::new(1001, 101, vec![200]);
    fs.create_dir("/tmp").expect("mkdir");
    fs.set_permissions("/tmp", 0o1777).expect("chmod");
    fs.write("/tmp/a", b"a").expect("create");
    chown(&fs, "/tmp/a", 1000, 100);
    let tmp = fs.resolve(b"/tmp", true).expect("resolve");
    let a = fs.resolve(b"/tmp/a", true).expect("resolve");
    assert_eq!(code(fs.may_delete_ino(tmp, a, &alice)), 0);
    assert!(matches!(
        fs.may_delete_ino(tmp, a, &bob),
        Err(Error::NotPermitted(_))
    ));
    assert_eq!(code(fs.may_delete_ino(tmp, a, &Creds::root())), 0);
    fs.set_permissions("/tmp", 0o777).expect("chmod");
    assert_eq!(code(fs.may_delete_ino(tmp, a, &bob)), 0);

    // chmod: owner only; outside the group the set-group-ID bit goes.
    let chmod = |mode| SetAttr {
        mode: Some(mode),
        ..SetAttr::default()
    };
    assert!(matches!(
        fs.check_setattr(a, &bob, &chmod(0o777), false),
        Err(Error::NotPermitted(_))
    ));
    let out = fs
        .check_setattr(a, &alice, &chmod(0o2755), false)
        .expect("owner");
    assert_eq!(out.mode, Some(0o2755));
    chown(&fs, "/tmp/a", 1000, 300);
    let out = fs
        .check_setattr(a, &alice, &chmod(0o2755), false)
        .expect("owner");
    assert_eq!(out.mode, Some(0o755));
    // chown: only root changes the owner; the owner may pick a group of theirs.
    let chown_to = |uid: Option<u32>, gid: Option<u32>| SetAttr {
        uid,
        gid,
        ..SetAttr::default()
    };
    assert!(fs
        .check_setattr(a, &alice, &chown_to(Some(1001), None), false)
        .is_err());
    assert!(fs
        .check_setattr(a, &alice, &chown_to(None, Some(100)), false)
        .is_ok());
    assert!(fs
        .check_setattr(a, &alice, &chown_to(None, Some(101)), false)
        .is_err());
    assert!(fs
        .check_setattr(a, &Creds::root(), &chown_to(Some(5), Some(5)), false)
        .is_ok());
    // utimes: explicit times by the owner; "now" also by a writer.
    let times = SetAttr {
        mtime: Some(Timestamp { sec: 1, nsec: 0 }),
        ..SetAttr::default()
    };
    fs.set_permissions("/tmp/a", 0o666).expect("chmod");
    assert!(fs.check_setattr(a, &bob, &times, false).is_err());
    assert!(fs.check_setattr(a, &bob, &times, true).is_ok());
    fs.set_permissions("/tmp/a", 0o644).expect("chmod");
    assert_eq!(code(fs.check_setattr(a, &bob, &times, true)), EACCES);

    // OpenOptions::creds: read/write by mode, create needs write on the parent, search
    // on the path, and the created file belongs to the caller.
    let open = |c: &Creds, path: &str, read: bool, write: bool, create: bool| {
        OpenOptions::new()
            .read(read)
            .write(write)
            .create(create)
            .creds(c.clone())
            .open(&fs, path)
            .map(drop)
    };
    assert_eq!(code(open(&bob, "/tmp/a", true, false, false)), 0);
    assert_eq!(code(open(&bob, "/tmp/a", false, true, false)), EACCES);
    fs.create_dir("/priv").expect("mkdir");
    fs.set_permissions("/priv", 0o700).expect("chmod");
    fs.write("/priv/x", b"x").expect("create");
    fs.set_permissions("/priv/x", 0o666).expect("chmod");
    assert_eq!(code(open(&bob, "/priv/x", true, false, false)), EACCES);
    assert_eq!(code(open(&bob, "/priv/new", false, true, true)), EACCES);
    assert_eq!(code(open(&bob, "/tmp/new", false, true, true)), 0);
    let m = fs.metadata("/tmp/new").expect("stat");
    assert_eq!((m.uid, m.gid), (1001, 101));
    // Root reads anything but executes only what someone may execute.
    assert_eq!(code(fs.access("/priv/x", &Creds::root(), R | W)), 0);
    assert_eq!(code(fs.access("/priv/x", &Creds::root(), X)), EACCES);
    fs.close().expect("close");
    let r = e2fsck_fn(img.path());
    assert!(r.clean, "{}", r.output);
}
