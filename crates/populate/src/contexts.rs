//! SELinux file_contexts: the `security.selinux` label of every path, matched as
//! libselinux's label_file backend (setfiles, restorecon) matches it.
//!
//! Each line: `REGEX [TYPE] CONTEXT`; `#` comments. The regex is anchored at both
//! ends (it must match the whole path). TYPE restricts a line to one file type (`--`
//! regular file, `-d` directory, `-l` symlink, `-c` / `-b` character / block device,
//! `-p` fifo, `-s` socket); a line without one matches every type. CONTEXT
//! `<<none>>` means the path is left unlabelled. Precedence, as label_file sorts its
//! specifications: lines whose regex has no meta character (`.^$?*+|[({`, a
//! backslash escaping the next character) are exact paths and come after every
//! regular expression, each group keeping the file's order, and the *last* line that
//! matches a path and its type wins. The label is stored as libselinux's
//! lsetfilecon stores it: the context and a terminating NUL.
//!
//! Must hold: a regex the matcher cannot take (back-references, look-around) is an
//! error naming its line at load, never a silent mismatch.

use rext4::format::inode::mode as imode;
use rext4::{Error, Fs, Ino, Result, XattrFlags};

/// One line.
#[derive(Debug)]
struct Spec {
    regex: regex::bytes::Regex,
    /// S_IF* type bits this line is restricted to.
    kind: Option<u16>,
    /// `None`: `<<none>>`.
    context: Option<Vec<u8>>,
}

/// A parsed file_contexts file, in match order (last wins).
#[derive(Debug, Default)]
pub struct FileContexts {
    specs: Vec<Spec>,
}

/// Whether a spec's regex has a meta character (label_file's `spec_hasMetaChars`).
fn has_meta(re: &str) -> bool {
    let b = re.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'.' | b'^' | b'$' | b'?' | b'*' | b'+' | b'|' | b'[' | b'(' | b'{' => return true,
            b'\\' => i += 1,
            _ => {}
        }
        i += 1;
    }
    false
}

impl FileContexts {
    pub fn parse(text: &str) -> Result<FileContexts> {
        let mut regexes = Vec::new();
        let mut exact = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let bad = |why: String| {
                Error::InvalidInput(format!("file_contexts line {line}: {why}: {raw}"))
            };
            let f: Vec<&str> = l.split_whitespace().collect();
            let (re, kind, ctx) = match f.as_slice() {
                [re, ctx] => (*re, None, *ctx),
                [re, t, ctx] => {
                    let k = match *t {
                        "--" => imode::S_IFREG,
                        "-d" => imode::S_IFDIR,
                        "-l" => imode::S_IFLNK,
                        "-c" => imode::S_IFCHR,
                        "-b" => imode::S_IFBLK,
                        "-p" => imode::S_IFIFO,
                        "-s" => imode::S_IFSOCK,
                        other => return Err(bad(format!("unknown file type '{other}'"))),
                    };
                    (*re, Some(k), *ctx)
                }
                _ => return Err(bad("expected REGEX [TYPE] CONTEXT".into())),
            };
            let regex = regex::bytes::Regex::new(&format!("^(?:{re})$"))
                .map_err(|e| bad(format!("regex: {e}")))?;
            let spec = Spec {
                regex,
                kind,
                context: (ctx != "<<none>>").then(|| ctx.as_bytes().to_vec()),
            };
            if has_meta(re) {
                regexes.push(spec);
            } else {
                exact.push(spec);
            }
        }
        regexes.extend(exact);
        Ok(FileContexts { specs: regexes })
    }

    /// The label of absolute path `path` of type `kind` (S_IF* bits): `None` when no
    /// line matches or the matching one says `<<none>>`.
    pub fn lookup(&self, path: &[u8], kind: u16) -> Option<&[u8]> {
        self.specs
            .iter()
            .rev()
            .find(|s| s.kind.is_none_or(|k| k == kind) && s.regex.is_match(path))
            .and_then(|s| s.context.as_deref())
    }
}

/// Label every inode under directory `top` (whose absolute path in the labelled
/// namespace is `top_path`, "/" for the root) with what `fc` says for its path.
/// Returns how many paths got a label.
pub fn label_tree(fs: &Fs, top: Ino, top_path: &[u8], fc: &FileContexts) -> Result<u64> {
    let mut n = 0u64;
    let mut stack: Vec<(Ino, Vec<u8>)> = vec![(top, top_path.to_vec())];
    let label = |ino: Ino, path: &[u8], kind: u16, n: &mut u64| -> Result<()> {
        if let Some(ctx) = fc.lookup(path, kind) {
            let mut v = ctx.to_vec();
            v.push(0);
            fs.set_xattr_ino(ino, b"security.selinux", &v, XattrFlags::default())?;
            *n += 1;
        }
        Ok(())
    };
    label(top, top_path, imode::S_IFDIR, &mut n)?;
    while let Some((dir, path)) = stack.pop() {
        let mut entries = fs.read_dir_ino(dir)?;
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        for e in entries {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let mut p = path.clone();
            if p.last() != Some(&b'/') {
                p.push(b'/');
            }
            p.extend_from_slice(&e.name);
            let md = fs.stat_ino(e.ino)?;
            let kind = (md.mode & 0o170000) as u16;
            label(e.ino, &p, kind, &mut n)?;
            if md.is_dir() {
                stack.push((e.ino, p));
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FC: &str = r#"
# comment
/.*                     system_u:object_r:default_t:s0
/usr(/.*)?              system_u:object_r:usr_t:s0
/usr/bin(/.*)?          system_u:object_r:bin_t:s0
/usr/bin/special        system_u:object_r:special_t:s0
/usr/bin/.*     -d      system_u:object_r:bindir_t:s0
/usr/bin/ignored        <<none>>
/dev/null       -c      system_u:object_r:null_device_t:s0
/usr/bin/s.*            system_u:object_r:s_t:s0
"#;

    #[test]
    fn matching_follows_label_file_precedence() {
        let fc = FileContexts::parse(FC).expect("parse");
        let l = |p: &str, k: u16| {
            fc.lookup(p.as_bytes(), k)
                .map(|c| String::from_utf8_lossy(c).into_owned())
        };
        let reg = imode::S_IFREG;
        assert_eq!(
            l("/etc/x", reg).as_deref(),
            Some("system_u:object_r:default_t:s0")
        );
        assert_eq!(
            l("/usr", imode::S_IFDIR).as_deref(),
            Some("system_u:object_r:usr_t:s0")
        );
        assert_eq!(
            l("/usr/bin/ls", reg).as_deref(),
            Some("system_u:object_r:bin_t:s0")
        );
        // The last matching regex wins; the type field restricts.
        assert_eq!(
            l("/usr/bin/sh", reg).as_deref(),
            Some("system_u:object_r:s_t:s0")
        );
        assert_eq!(
            l("/usr/bin/sub", imode::S_IFDIR).as_deref(),
            Some("system_u:object_r:s_t:s0")
        );
        assert_eq!(
            l("/usr/bin/dir", imode::S_IFDIR).as_deref(),
            Some("system_u:object_r:bindir_t:s0")
        );
        // An exact path beats a later regex that also matches.
        assert_eq!(
            l("/usr/bin/special", reg).as_deref(),
            Some("system_u:object_r:special_t:s0")
        );
        assert_eq!(l("/usr/bin/ignored", reg), None);
        assert_eq!(
            l("/dev/null", imode::S_IFCHR).as_deref(),
            Some("system_u:object_r:null_device_t:s0")
        );
        assert_eq!(
            l("/dev/null", reg).as_deref(),
            Some("system_u:object_r:default_t:s0")
        );
        // Anchored: a regex must match the whole path.
        assert_eq!(
            l("/usrx", reg).as_deref(),
            Some("system_u:object_r:default_t:s0")
        );
    }

    #[test]
    fn bad_lines_are_refused() {
        for bad in ["/x -q ctx", "/x(", "/x a b c", r"/(a)\1 ctx"] {
            assert!(FileContexts::parse(bad).is_err(), "{bad}");
        }
        assert!(has_meta("/a.b") && !has_meta(r"/a\.b") && !has_meta("/usr/bin"));
    }
}
