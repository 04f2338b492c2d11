//! `chown`'s OWNER[:GROUP] operand, as coreutils reads it: user and group names are
//! looked up in the host's databases (getpwnam_r/getgrnam_r: /etc/passwd, NSS), a
//! name that is not found but is a number is taken as that number, and `+N` is
//! always numeric. `USER:` also sets the group to USER's login group.

use std::ffi::CString;

/// A failed lookup or a malformed operand (a usage error).
pub type Bad = String;

/// Parse "USER", "USER:GROUP", "USER:", ":GROUP" (names or numbers) → (uid, gid).
pub fn parse_owner(s: &str) -> Result<(Option<u32>, Option<u32>), Bad> {
    let (user, group) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    if user.is_empty() && group.is_none_or(str::is_empty) {
        return Err(format!("invalid spec: '{s}'"));
    }
    let mut uid = None;
    let mut login_gid = None;
    if !user.is_empty() {
        let (u, g) = lookup_user(user).ok_or_else(|| format!("invalid user: '{s}'"))?;
        uid = Some(u);
        login_gid = g;
    }
    let gid = match group {
        Some("") if !user.is_empty() => {
            Some(login_gid.ok_or_else(|| format!("invalid user: '{s}' (no login group)"))?)
        }
        Some("") | None => None,
        Some(g) => Some(lookup_group(g).ok_or_else(|| format!("invalid group: '{s}'"))?),
    };
    Ok((uid, gid))
}

/// A number as chown takes one: decimal, `+` forcing it to be read as a number.
fn number(s: &str) -> Option<u32> {
    let digits = s.strip_prefix('+').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The uid of user `name` (and their login gid when known by name).
fn lookup_user(name: &str) -> Option<(u32, Option<u32>)> {
    if !name.starts_with('+') {
        if let Some(found) = getpwnam(name) {
            return Some((found.0, Some(found.1)));
        }
    }
    number(name).map(|u| (u, getpwuid_gid(u)))
}

fn lookup_group(name: &str) -> Option<u32> {
    if !name.starts_with('+') {
        if let Some(g) = getgrnam(name) {
            return Some(g);
        }
    }
    number(name)
}

/// Call a reentrant getpw*/getgr* function, growing the buffer on ERANGE.
fn with_buffer(mut call: impl FnMut(&mut [u8]) -> libc::c_int) -> bool {
    let mut len = 1024usize;
    loop {
        let mut buf = vec![0u8; len];
        match call(&mut buf) {
            0 => return true,
            libc::ERANGE if len < 1 << 20 => len *= 4,
            _ => return false,
        }
    }
}

fn getpwnam(name: &str) -> Option<(u32, u32)> {
    let c = CString::new(name).ok()?;
    // SAFETY: an all-zero passwd is a valid value to be overwritten.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    let ok = with_buffer(|buf| {
        // SAFETY: `c` is NUL-terminated; `pw`, `buf` (with its length) and `result` are
        // valid for writing for the duration of the call.
        unsafe {
            libc::getpwnam_r(
                c.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut result,
            )
        }
    });
    (ok && !result.is_null()).then_some((pw.pw_uid, pw.pw_gid))
}

fn getpwuid_gid(uid: u32) -> Option<u32> {
    // SAFETY: as in `getpwnam`.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    let ok = with_buffer(|buf| {
        // SAFETY: `pw`, `buf` (with its length) and `result` are valid for writing.
        unsafe {
            libc::getpwuid_r(
                uid,
                &mut pw,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut result,
            )
        }
    });
    (ok && !result.is_null()).then_some(pw.pw_gid)
}

fn getgrnam(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: an all-zero group is a valid value to be overwritten.
    let mut gr: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    let ok = with_buffer(|buf| {
        // SAFETY: `c` is NUL-terminated; `gr`, `buf` (with its length) and `result` are
        // valid for writing for the duration of the call.
        unsafe {
            libc::getgrnam_r(
                c.as_ptr(),
                &mut gr,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut result,
            )
        }
    });
    (ok && !result.is_null()).then_some(gr.gr_gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_names() {
        assert_eq!(parse_owner("1000"), Ok((Some(1000), None)));
        assert_eq!(parse_owner("1:2"), Ok((Some(1), Some(2))));
        assert_eq!(parse_owner(":2"), Ok((None, Some(2))));
        assert_eq!(parse_owner("+0:+0"), Ok((Some(0), Some(0))));
        // root is user 0 and group 0 on every Linux host.
        assert_eq!(parse_owner("root"), Ok((Some(0), None)));
        assert_eq!(parse_owner("root:root"), Ok((Some(0), Some(0))));
        assert_eq!(parse_owner("root:"), Ok((Some(0), Some(0))));
        assert!(parse_owner(":").is_err());
        assert!(parse_owner("").is_err());
        assert!(parse_owner("no-such-user-rext4").is_err());
        assert!(parse_owner(":no-such-group-rext4").is_err());
        assert!(parse_owner("-1").is_err());
    }
}
