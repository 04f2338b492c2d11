//! POSIX ACL semantics over decoded entries ([`AclEntry`], from the codecs in
//! `xattr.rs`): what Linux's posix_acl layer does for a local filesystem, so that the
//! engine can keep ACLs, permission bits and inheritance the way ext4 on the kernel does.
//!
//! Owns: validity (entry order and uniqueness as the kernel's posix_acl_valid demands),
//! the permission bits an access ACL implies (`equiv_mode`), the access ACL after chmod
//! (`chmod`), the ACL and mode of a new inode from its parent's default ACL
//! (`create_masq`), and the access decision for a caller (`permits`).
//! Must hold: pure functions, no panics on any entry list; an invalid list is refused by
//! [`valid`] and the others assume a valid one (they never index blindly).

use crate::xattr::{
    AclEntry, ACL_GROUP, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER, ACL_USER, ACL_USER_OBJ,
};

/// The full names of the two ACL attributes (VFS form on the xattr API).
pub const ACCESS: &[u8] = b"system.posix_acl_access";
pub const DEFAULT: &[u8] = b"system.posix_acl_default";

/// Read, write and execute/search bits of an entry or a request.
pub const R: u16 = 4;
pub const W: u16 = 2;
pub const X: u16 = 1;

fn rank(tag: u16) -> Option<u8> {
    Some(match tag {
        ACL_USER_OBJ => 0,
        ACL_USER => 1,
        ACL_GROUP_OBJ => 2,
        ACL_GROUP => 3,
        ACL_MASK => 4,
        ACL_OTHER => 5,
        _ => return None,
    })
}

/// Whether `es` is a well-formed ACL: tags in the canonical order (owner, named users by
/// id, owning group, named groups by id, mask, other), exactly one owner, owning group
/// and other, named ids unique, a mask present when named entries are, perms within rwx.
pub fn valid(es: &[AclEntry]) -> bool {
    let mut prev: Option<(u8, u32)> = None;
    let mut counts = [0usize; 6];
    for e in es {
        let Some(r) = rank(e.tag) else {
            return false;
        };
        if e.perm & !(R | W | X) != 0 {
            return false;
        }
        let named = e.tag == ACL_USER || e.tag == ACL_GROUP;
        let key = (r, if named { e.id } else { 0 });
        if let Some(p) = prev {
            // Strictly increasing: sorted and unique (non-named tags appear once).
            if key <= p {
                return false;
            }
        }
        prev = Some(key);
        counts[r as usize] += 1;
    }
    let named = counts[1] + counts[3];
    counts[0] == 1 && counts[2] == 1 && counts[5] == 1 && (named == 0 || counts[4] == 1)
}

fn perm_of(es: &[AclEntry], tag: u16) -> Option<u16> {
    es.iter().find(|e| e.tag == tag).map(|e| e.perm)
}

/// The rwx bits an access ACL implies (owner, mask-or-owning-group, other), and whether
/// the ACL says nothing beyond them (then it need not be stored).
pub fn equiv_mode(es: &[AclEntry]) -> (u32, bool) {
    let p = |t| u32::from(perm_of(es, t).unwrap_or(0));
    let group = if perm_of(es, ACL_MASK).is_some() {
        p(ACL_MASK)
    } else {
        p(ACL_GROUP_OBJ)
    };
    let minimal = es
        .iter()
        .all(|e| matches!(e.tag, ACL_USER_OBJ | ACL_GROUP_OBJ | ACL_OTHER));
    (
        (p(ACL_USER_OBJ) << 6) | (group << 3) | p(ACL_OTHER),
        minimal,
    )
}

/// chmod to `mode`: the owner, mask (or owning group when there is no mask) and other
/// entries take the new bits; named entries keep theirs.
pub fn chmod(es: &mut [AclEntry], mode: u32) {
    let has_mask = perm_of(es, ACL_MASK).is_some();
    for e in es.iter_mut() {
        let bits = match e.tag {
            ACL_USER_OBJ => mode >> 6,
            ACL_MASK => mode >> 3,
            ACL_GROUP_OBJ if !has_mask => mode >> 3,
            ACL_OTHER => mode,
            _ => continue,
        };
        e.perm = (bits & 7) as u16;
    }
}

/// A new inode under a directory with default ACL `es`: the entries are masked by the
/// requested `mode` and `mode`'s rwx bits by the entries (type and set-id bits stay).
/// Returns whether the result says more than the mode (then it is stored as the new
/// inode's access ACL).
pub fn create_masq(es: &mut [AclEntry], mode: &mut u32) -> bool {
    let mut extended = false;
    let mut group_bits = None;
    for e in es.iter_mut() {
        match e.tag {
            ACL_USER_OBJ => {
                e.perm &= ((*mode >> 6) & 7) as u16;
                *mode &= (u32::from(e.perm) << 6) | !0o700;
            }
            ACL_USER | ACL_GROUP => extended = true,
            ACL_OTHER => {
                e.perm &= (*mode & 7) as u16;
                *mode &= u32::from(e.perm) | !0o007;
            }
            _ => {}
        }
    }
    // The group class: the mask when there is one (and the owning group is then an
    // extended entry), else the owning group.
    let target = if perm_of(es, ACL_MASK).is_some() {
        extended = true;
        ACL_MASK
    } else {
        ACL_GROUP_OBJ
    };
    for e in es.iter_mut().filter(|e| e.tag == target) {
        e.perm &= ((*mode >> 3) & 7) as u16;
        group_bits = Some(e.perm);
    }
    if let Some(g) = group_bits {
        *mode &= (u32::from(g) << 3) | !0o070;
    }
    extended
}

/// Who is asking: effective uid, gid and supplementary groups.
pub trait Caller {
    fn uid(&self) -> u32;
    fn in_group(&self, gid: u32) -> bool;
}

/// The ACL access check (owner entry, then named user, then the group class, then other;
/// named and group entries are limited by the mask). `want` is a mix of [`R`], [`W`],
/// [`X`]. Privilege (root) is the caller's business.
pub fn permits(es: &[AclEntry], who: &dyn Caller, owner: u32, group: u32, want: u16) -> bool {
    let mask = perm_of(es, ACL_MASK).unwrap_or(R | W | X);
    let ok = |perm: u16| perm & want == want;
    if who.uid() == owner {
        return perm_of(es, ACL_USER_OBJ).is_some_and(ok);
    }
    if let Some(e) = es.iter().find(|e| e.tag == ACL_USER && e.id == who.uid()) {
        return ok(e.perm & mask);
    }
    // Group class: any matching group entry that grants all of `want` grants; matching
    // entries that do not deny.
    let mut matched = false;
    for e in es {
        let member = match e.tag {
            ACL_GROUP_OBJ => who.in_group(group),
            ACL_GROUP => who.in_group(e.id),
            _ => false,
        };
        if member {
            if ok(e.perm & mask) {
                return true;
            }
            matched = true;
        }
    }
    if matched {
        return false;
    }
    perm_of(es, ACL_OTHER).is_some_and(ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xattr::ACL_UNDEFINED_ID as NONE;

    fn acl(es: &[(u16, u16, u32)]) -> Vec<AclEntry> {
        es.iter()
            .map(|&(tag, perm, id)| AclEntry { tag, perm, id })
            .collect()
    }

    fn extended() -> Vec<AclEntry> {
        acl(&[
            (ACL_USER_OBJ, 6, NONE),
            (ACL_USER, 7, 1000),
            (ACL_GROUP_OBJ, 4, NONE),
            (ACL_GROUP, 2, 50),
            (ACL_MASK, 5, NONE),
            (ACL_OTHER, 0, NONE),
        ])
    }

    struct Who(u32, Vec<u32>);
    impl Caller for Who {
        fn uid(&self) -> u32 {
            self.0
        }
        fn in_group(&self, g: u32) -> bool {
            self.1.contains(&g)
        }
    }

    #[test]
    fn validity_follows_the_kernel_rules() {
        assert!(valid(&extended()));
        let minimal = acl(&[
            (ACL_USER_OBJ, 7, NONE),
            (ACL_GROUP_OBJ, 5, NONE),
            (ACL_OTHER, 4, NONE),
        ]);
        assert!(valid(&minimal));
        // Out of order, duplicate named ids, missing mask, bad perm, empty.
        let mut swapped = extended();
        swapped.swap(0, 1);
        assert!(!valid(&swapped));
        let mut dup = extended();
        dup.insert(
            2,
            AclEntry {
                tag: ACL_USER,
                perm: 1,
                id: 1000,
            },
        );
        assert!(!valid(&dup));
        let mut nomask = extended();
        nomask.retain(|e| e.tag != ACL_MASK);
        assert!(!valid(&nomask));
        let mut bad = minimal.clone();
        bad[0].perm = 8;
        assert!(!valid(&bad));
        assert!(!valid(&[]));
    }

    #[test]
    fn mode_and_chmod() {
        let mut es = extended();
        assert_eq!(equiv_mode(&es), (0o650, false));
        chmod(&mut es, 0o701);
        let perms: Vec<u16> = es.iter().map(|e| e.perm).collect();
        assert_eq!(perms, [7, 7, 4, 2, 0, 1]);
        let minimal = acl(&[
            (ACL_USER_OBJ, 7, NONE),
            (ACL_GROUP_OBJ, 5, NONE),
            (ACL_OTHER, 4, NONE),
        ]);
        assert_eq!(equiv_mode(&minimal), (0o754, true));
    }

    #[test]
    fn create_from_a_default_acl() {
        // setfacl -d -m u:1000:rwx on a 0755 dir: default user::rwx user:1000:rwx
        // group::r-x mask::rwx other::r-x; creat(0666) gives 0664 and keeps the entry.
        let mut es = acl(&[
            (ACL_USER_OBJ, 7, NONE),
            (ACL_USER, 7, 1000),
            (ACL_GROUP_OBJ, 5, NONE),
            (ACL_MASK, 7, NONE),
            (ACL_OTHER, 5, NONE),
        ]);
        let mut mode = 0o100_666;
        assert!(create_masq(&mut es, &mut mode));
        assert_eq!(mode, 0o100_664);
        let perms: Vec<u16> = es.iter().map(|e| e.perm).collect();
        assert_eq!(perms, [6, 7, 5, 6, 4]);
        // A minimal default ACL masks the mode like a umask and is not extended.
        let mut es = acl(&[
            (ACL_USER_OBJ, 7, NONE),
            (ACL_GROUP_OBJ, 5, NONE),
            (ACL_OTHER, 0, NONE),
        ]);
        let mut mode = 0o40_777 | 0o2000;
        assert!(!create_masq(&mut es, &mut mode));
        assert_eq!(mode, 0o40_750 | 0o2000);
    }

    #[test]
    fn permission_decisions() {
        let es = extended();
        // Owner: 6.
        assert!(permits(&es, &Who(7, vec![]), 7, 8, R | W));
        assert!(!permits(&es, &Who(7, vec![]), 7, 8, X));
        // Named user 1000: 7 & mask 5.
        assert!(permits(&es, &Who(1000, vec![]), 7, 8, R | X));
        assert!(!permits(&es, &Who(1000, vec![]), 7, 8, W));
        // Owning group 8: 4; group 50: 2 & mask 5 = 0; member of both: read via 8.
        assert!(permits(&es, &Who(9, vec![8]), 7, 8, R));
        assert!(!permits(&es, &Who(9, vec![50]), 7, 8, W));
        assert!(permits(&es, &Who(9, vec![50, 8]), 7, 8, R));
        // A matching group entry that does not grant denies (no fall through to other).
        let mut es2 = es.clone();
        es2.last_mut().expect("other").perm = 7;
        assert!(!permits(&es2, &Who(9, vec![50]), 7, 8, R));
        assert!(permits(&es2, &Who(9, vec![]), 7, 8, R | W | X));
    }

    #[test]
    fn arbitrary_entries_never_panic() {
        for seed in 0..500u32 {
            let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x
            };
            let n = next() % 8;
            let mut es: Vec<AclEntry> = (0..n)
                .map(|_| AclEntry {
                    tag: [1, 2, 4, 8, 0x10, 0x20, 0x40][(next() % 7) as usize],
                    perm: (next() % 16) as u16,
                    id: next() % 4,
                })
                .collect();
            let _ = valid(&es);
            let _ = equiv_mode(&es);
            let _ = permits(&es, &Who(next() % 4, vec![next() % 4]), 1, 2, 7);
            chmod(&mut es, next());
            let mut mode = next();
            let _ = create_masq(&mut es, &mut mode);
        }
    }
}
