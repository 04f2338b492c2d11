//! POSIX access ACLs and the permission bits (what the kernel's posix_acl_update_mode
//! and posix_acl_chmod do for a local filesystem; a FUSE server must do it itself).
//!
//! Owns: parsing and re-encoding the VFS xattr form of an ACL
//! (`system.posix_acl_access`: a u32 version 2, then 8-byte entries tag u16, perm u16,
//! id u32, all little-endian), `mode_from_acl` (the permission bits an ACL implies and
//! whether it says nothing beyond them) and `chmod_acl` (an ACL after chmod).
//! Must hold: any byte string is handled without panicking; invalid ACLs are `None`
//! (EINVAL at the edge).

pub(crate) const ACCESS: &[u8] = b"system.posix_acl_access";
pub(crate) const DEFAULT: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

fn parse(v: &[u8]) -> Option<Vec<Entry>> {
    let (hdr, rest) = v.split_at_checked(4)?;
    if u32::from_le_bytes(hdr.try_into().ok()?) != VERSION || rest.len() % 8 != 0 {
        return None;
    }
    let entries: Vec<Entry> = rest
        .chunks_exact(8)
        .map(|c| Entry {
            tag: u16::from_le_bytes([c[0], c[1]]),
            perm: u16::from_le_bytes([c[2], c[3]]),
            id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect();
    let count = |t: u16| entries.iter().filter(|e| e.tag == t).count();
    let named = count(USER) + count(GROUP);
    let valid = count(USER_OBJ) == 1
        && count(GROUP_OBJ) == 1
        && count(OTHER) == 1
        && count(MASK) <= 1
        && (named == 0 || count(MASK) == 1)
        && entries.iter().all(|e| {
            e.perm & !7 == 0 && [USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER].contains(&e.tag)
        });
    valid.then_some(entries)
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut v = VERSION.to_le_bytes().to_vec();
    for e in entries {
        v.extend_from_slice(&e.tag.to_le_bytes());
        v.extend_from_slice(&e.perm.to_le_bytes());
        v.extend_from_slice(&e.id.to_le_bytes());
    }
    v
}

/// The rwx bits an access ACL implies (owner, mask-or-group, other), and whether the
/// ACL is equivalent to them (then it need not be stored). `None`: not a valid ACL.
pub(crate) fn mode_from_acl(v: &[u8]) -> Option<(u32, bool)> {
    let entries = parse(v)?;
    let perm = |t: u16| {
        entries
            .iter()
            .find(|e| e.tag == t)
            .map_or(0, |e| u32::from(e.perm))
    };
    let group = if entries.iter().any(|e| e.tag == MASK) {
        perm(MASK)
    } else {
        perm(GROUP_OBJ)
    };
    let bits = (perm(USER_OBJ) << 6) | (group << 3) | perm(OTHER);
    Some((bits, entries.len() == 3))
}

/// The access ACL after chmod to `mode`: owner, mask (or group) and other entries take
/// the new bits. `None` when `v` is not a valid ACL.
pub(crate) fn chmod_acl(v: &[u8], mode: u32) -> Option<Vec<u8>> {
    let mut entries = parse(v)?;
    let has_mask = entries.iter().any(|e| e.tag == MASK);
    for e in &mut entries {
        let bits = match e.tag {
            USER_OBJ => (mode >> 6) & 7,
            MASK => (mode >> 3) & 7,
            GROUP_OBJ if !has_mask => (mode >> 3) & 7,
            OTHER => mode & 7,
            _ => continue,
        };
        e.perm = bits as u16;
    }
    Some(encode(&entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(es: &[(u16, u16, u32)]) -> Vec<u8> {
        encode(
            &es.iter()
                .map(|&(tag, perm, id)| Entry { tag, perm, id })
                .collect::<Vec<_>>(),
        )
    }

    const NONE: u32 = u32::MAX;

    #[test]
    fn minimal_acl_is_equivalent_to_the_mode() {
        let v = acl(&[(USER_OBJ, 7, NONE), (GROUP_OBJ, 5, NONE), (OTHER, 4, NONE)]);
        assert_eq!(mode_from_acl(&v), Some((0o754, true)));
    }

    #[test]
    fn extended_acl_takes_group_bits_from_the_mask() {
        let v = acl(&[
            (USER_OBJ, 6, NONE),
            (USER, 7, 1000),
            (GROUP_OBJ, 4, NONE),
            (MASK, 5, NONE),
            (OTHER, 0, NONE),
        ]);
        assert_eq!(mode_from_acl(&v), Some((0o650, false)));
        let c = chmod_acl(&v, 0o701).expect("valid");
        let back = parse(&c).expect("valid");
        assert_eq!(back[0].perm, 7); // owner
        assert_eq!(back[1].perm, 7); // named user unchanged
        assert_eq!(back[2].perm, 4); // group_obj unchanged (mask present)
        assert_eq!(back[3].perm, 0); // mask
        assert_eq!(back[4].perm, 1); // other
    }

    #[test]
    fn invalid_acls_are_refused() {
        assert_eq!(mode_from_acl(b""), None);
        assert_eq!(mode_from_acl(&[2, 0, 0, 0, 1]), None);
        // No mask although a named user is present.
        let v = acl(&[
            (USER_OBJ, 6, NONE),
            (USER, 7, 1000),
            (GROUP_OBJ, 4, NONE),
            (OTHER, 0, NONE),
        ]);
        assert_eq!(mode_from_acl(&v), None);
        // Bad version.
        let mut v = acl(&[(USER_OBJ, 7, NONE), (GROUP_OBJ, 5, NONE), (OTHER, 4, NONE)]);
        v[0] = 1;
        assert_eq!(mode_from_acl(&v), None);
        // Any byte string: no panic.
        for n in 0..40u8 {
            let b: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
            let _ = mode_from_acl(&b);
            let _ = chmod_acl(&b, 0o777);
        }
    }
}
