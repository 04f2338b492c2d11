//! Permission modes as chmod(1) takes them: octal (`755`, `04755`) or symbolic
//! (`u+x`, `go-w`, `a=r`, `u=rwx,g=rx,o=`, `+t`, `g+s`, `a+X`, `g=u`, `-6000`), with
//! GNU coreutils' rules:
//! - without `u`/`g`/`o`/`a`, a clause acts for all three classes, except on bits set
//!   in the umask;
//! - `X` is execute only for a directory or a file with some execute bit already set;
//!   `s` is set-user-ID with `u`, set-group-ID with `g`; `t` is the sticky bit (with
//!   `o`, `a` or no class); `u`, `g`, `o` after the operator copy that class's bits;
//! - a directory keeps its set-user-ID and set-group-ID bits unless the mode names
//!   them: by `s` in a symbolic clause for their class (`g-s`, `u=rwxs`), by an octal
//!   mode setting them or of five digits or more (`00755`), or by an operator before an
//!   octal mode (`=755`, `-6000`).

/// A parsed mode, applied to each file by [`ModeSpec::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModeSpec {
    clauses: Vec<Clause>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Perm {
    /// Fixed bits (already limited to what `r w x s t` or the octal number give).
    Bits(u32),
    /// `X`: execute where it makes sense, plus fixed bits.
    CondExec(u32),
    /// `u`, `g` or `o` after the operator: copy that class's rwx bits (shift amount).
    Copy(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Clause {
    /// The bits the clause may change: set by the classes given (0: none given).
    who: u32,
    op: u8,
    perm: Perm,
    /// The bits a directory's set-ID bits count as named by.
    named: u32,
}

const S_ISUID: u32 = 0o4000;
const S_ISGID: u32 = 0o2000;
const S_ISVTX: u32 = 0o1000;
const ALL: u32 = 0o7777;
const EXEC: u32 = 0o111;

fn class_bits(c: char) -> u32 {
    match c {
        'u' => S_ISUID | 0o700,
        'g' => S_ISGID | 0o070,
        'o' => S_ISVTX | 0o007,
        _ => ALL,
    }
}

impl ModeSpec {
    /// Parse an octal or symbolic mode; `None` if it is neither.
    pub fn parse(s: &str) -> Option<ModeSpec> {
        if !s.is_empty() && s.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            let v = u32::from_str_radix(s, 8).ok().filter(|v| *v <= ALL)?;
            // Fewer than five digits leave a directory's set-ID bits alone unless set.
            let named = if s.len() > 4 {
                ALL
            } else {
                (v & (S_ISUID | S_ISGID)) | S_ISVTX | 0o777
            };
            return Some(ModeSpec {
                clauses: vec![Clause {
                    who: ALL,
                    op: b'=',
                    perm: Perm::Bits(v),
                    named,
                }],
            });
        }
        let mut clauses = Vec::new();
        for part in s.split(',') {
            let mut chars = part.chars().peekable();
            let mut who = 0u32;
            while let Some(&c) = chars.peek() {
                if !"ugoa".contains(c) {
                    break;
                }
                who |= class_bits(c);
                chars.next();
            }
            // At least one operation per clause.
            chars.peek().filter(|c| "+-=".contains(**c))?;
            while let Some(op) = chars.next_if(|c| "+-=".contains(*c)) {
                let rest: String = chars.clone().take_while(|c| !"+-=".contains(*c)).collect();
                for _ in 0..rest.chars().count() {
                    chars.next();
                }
                let perm = parse_perm(&rest, who)?;
                let octal = rest.bytes().next().is_some_and(|b| b.is_ascii_digit());
                // A clause names the bits it could set within its classes; an octal
                // number after an operator acts on, and names, every bit.
                let (who, named) = if octal {
                    (ALL, ALL)
                } else {
                    let could_set = match perm {
                        Perm::Bits(v) => v,
                        Perm::CondExec(v) => v | EXEC,
                        Perm::Copy(_) => 0o777,
                    };
                    (who, if who == 0 { ALL } else { who } & could_set)
                };
                clauses.push(Clause {
                    who,
                    op: op as u8,
                    perm,
                    named,
                });
            }
            if chars.next().is_some() {
                return None;
            }
        }
        Some(ModeSpec { clauses })
    }

    /// The new permission bits (07777) of a file whose are `old`, for a directory when
    /// `is_dir`, with the process umask `umask` (used by clauses naming no class).
    pub fn apply(&self, old: u32, is_dir: bool, umask: u32) -> u32 {
        let mut mode = old & ALL;
        for c in &self.clauses {
            // A directory's set-ID bits stay as they are unless the clause names them.
            let keep = if is_dir {
                (S_ISUID | S_ISGID) & !c.named
            } else {
                0
            };
            let mut value = match c.perm {
                Perm::Bits(v) => v,
                Perm::CondExec(v) => {
                    if is_dir || mode & EXEC != 0 {
                        v | EXEC
                    } else {
                        v
                    }
                }
                Perm::Copy(shift) => {
                    let rwx = (mode >> shift) & 0o7;
                    rwx * 0o111
                }
            };
            let scope = if c.who == 0 { ALL & !umask } else { c.who };
            value &= scope & !keep;
            mode = match c.op {
                b'+' => mode | value,
                b'-' => mode & !value,
                _ => {
                    // '=': the named classes' bits become exactly `value`; without a
                    // class, every bit does (umask bits then end up clear).
                    let cleared = if c.who == 0 { ALL } else { c.who };
                    (mode & !(cleared & !keep)) | value
                }
            };
        }
        mode
    }
}

/// The permission part after an operator: `[rwxXst]*`, one of `u g o`, or an octal
/// number (no classes before it).
fn parse_perm(s: &str, who: u32) -> Option<Perm> {
    if s.bytes().next().is_some_and(|b| b.is_ascii_digit()) {
        if who != 0 || !s.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            return None;
        }
        let v = u32::from_str_radix(s, 8).ok().filter(|v| *v <= ALL)?;
        return Some(Perm::Bits(v));
    }
    match s {
        "u" => return Some(Perm::Copy(6)),
        "g" => return Some(Perm::Copy(3)),
        "o" => return Some(Perm::Copy(0)),
        _ => {}
    }
    let mut bits = 0u32;
    let mut cond_x = false;
    for c in s.chars() {
        bits |= match c {
            'r' => 0o444,
            'w' => 0o222,
            'x' => EXEC,
            'X' => {
                cond_x = true;
                0
            }
            's' => S_ISUID | S_ISGID,
            't' => S_ISVTX,
            _ => return None,
        };
    }
    Some(if cond_x {
        Perm::CondExec(bits)
    } else {
        Perm::Bits(bits)
    })
}

/// The process umask (read without changing it for long: set and restored at once).
pub fn umask() -> u32 {
    // SAFETY: umask(2) cannot fail; the old mask is put back immediately.
    unsafe {
        let m = libc::umask(0o022);
        libc::umask(m);
        m as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(spec: &str, old: u32, dir: bool) -> u32 {
        ModeSpec::parse(spec)
            .unwrap_or_else(|| panic!("{spec} parses"))
            .apply(old, dir, 0o022)
    }

    /// Expected values checked against GNU chmod 9.x with umask 022.
    #[test]
    fn symbolic_modes_like_coreutils() {
        assert_eq!(ch("u+x", 0o644, false), 0o744);
        assert_eq!(ch("go-w", 0o666, false), 0o644);
        assert_eq!(ch("a=r", 0o755, false), 0o444);
        assert_eq!(ch("u=rwx,g=rx,o=", 0o600, false), 0o750);
        assert_eq!(ch("+t", 0o755, true), 0o1755);
        assert_eq!(ch("g+s", 0o755, false), 0o2755);
        assert_eq!(ch("u+s", 0o755, false), 0o4755);
        assert_eq!(ch("o+s", 0o755, false), 0o755);
        assert_eq!(ch("a+X", 0o644, false), 0o644);
        assert_eq!(ch("a+X", 0o744, false), 0o755);
        assert_eq!(ch("a+X", 0o600, true), 0o711);
        assert_eq!(ch("+w", 0o444, false), 0o644); // umask 022 keeps g/o write off
        assert_eq!(ch("=", 0o777, false), 0o000);
        assert_eq!(ch("=rw", 0o777, false), 0o644);
        assert_eq!(ch("g=u", 0o740, false), 0o770);
        assert_eq!(ch("u+r-w", 0o200, false), 0o400);
        assert_eq!(ch("a-x,u+x", 0o755, false), 0o744);
        assert_eq!(ch("-6000", 0o6755, true), 0o755);
        assert_eq!(ch("=755", 0o2700, true), 0o755);
        assert_eq!(ch("ug+rw", 0o600, false), 0o660);
    }

    #[test]
    fn octal_modes_and_directory_set_id_bits() {
        assert_eq!(ch("755", 0o600, false), 0o755);
        assert_eq!(ch("0644", 0o4755, false), 0o644);
        assert_eq!(ch("755", 0o2700, true), 0o2755);
        assert_eq!(ch("00755", 0o2700, true), 0o755);
        assert_eq!(ch("2755", 0o700, true), 0o2755);
        assert_eq!(ch("u=rwx", 0o2700, true), 0o2700);
        assert_eq!(ch("g=rx", 0o2700, true), 0o2750);
        assert_eq!(ch("a=rx", 0o6700, true), 0o6555);
        assert_eq!(ch("g-s", 0o2700, true), 0o700);
        assert_eq!(ch("a=r", 0o2750, true), 0o2444);
    }

    #[test]
    fn bad_modes_are_refused() {
        for bad in [
            "", "9", "17777", "u", "u+q", "x+r", "u+5", "+8", "a=rw,", ",", "u+x,g",
        ] {
            assert!(ModeSpec::parse(bad).is_none(), "{bad:?} parsed");
        }
    }
}
