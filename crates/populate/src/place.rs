//! Placing entries in an image by relative path: the writer shared by tar members,
//! layers and device tables.
//!
//! Owns: path cleaning (no `..`, nothing past PATH_MAX; a leading `/` is dropped as
//! tar drops it), the walk from the destination directory down to an entry's parent —
//! which never follows a symlink (a component that is not a directory is an error, so
//! nothing lands outside the tree the path names), one cached lookup per component —
//! implicit parents (made 0755, owned by the image root or `--owner`), replacing what
//! a path held before, directory times set last, and the set of paths a layer made
//! (whiteouts spare them).
//!
//! Must hold: every inode it makes is under `root`; a directory is replaced by a
//! non-directory only after its whole subtree is removed; nothing is followed.

use std::collections::{BTreeMap, HashMap, HashSet};

use rext4::{Error, Fs, Ino, Result, SetAttr, Timestamp};

use crate::ids::Owners;

/// A cleaned relative path: its components, none empty, "." or "..".
pub(crate) type Comps = Vec<Vec<u8>>;

/// Clean a member name: components split on '/', empty and "." ones dropped, a
/// leading '/' dropped (the flag says there was one); ".." refused.
pub(crate) fn clean(path: &[u8]) -> std::result::Result<(Comps, bool), String> {
    // Longer than Linux's PATH_MAX: no program could name it (and a name of a million
    // components must not cost a walk per component of every prefix).
    if path.len() > 4096 {
        return Err(format!(
            "{}...: name longer than 4096 bytes",
            show(&path[..64])
        ));
    }
    let absolute = path.first() == Some(&b'/');
    let mut out = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                return Err(format!(
                    "{}: name contains '..' (refused: it could name a file outside the tree)",
                    show(path)
                ))
            }
            c => {
                if c.len() > 255 {
                    return Err(format!("{}: a name is longer than 255 bytes", show(path)));
                }
                out.push(c.to_vec());
            }
        }
    }
    Ok((out, absolute))
}

pub(crate) fn show(p: &[u8]) -> String {
    String::from_utf8_lossy(p).into_owned()
}

pub(crate) fn join(c: &[Vec<u8>]) -> Vec<u8> {
    c.join(&b'/')
}

/// The tree writer.
pub(crate) struct Placer<'a> {
    pub(crate) fs: &'a Fs,
    pub(crate) root: Ino,
    pub(crate) owners: &'a Owners,
    /// Directories known, by (parent directory, name): a walk costs one lookup per
    /// component, whatever the depth.
    dirs: HashMap<(Ino, Vec<u8>), Ino>,
    /// Paths made by the layer being applied (whiteouts spare them).
    pub(crate) made: HashSet<Vec<u8>>,
    /// Directory times, set once everything below them is in place.
    dir_times: BTreeMap<Ino, (Timestamp, Timestamp)>,
    /// The time of implicit parents: now (the engine clamps it to the epoch in
    /// reproducible mode).
    default_time: Timestamp,
}

impl<'a> Placer<'a> {
    pub(crate) fn new(fs: &'a Fs, root: Ino, owners: &'a Owners) -> Placer<'a> {
        let dirs = HashMap::new();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Placer {
            fs,
            root,
            owners,
            dirs,
            made: HashSet::new(),
            dir_times: BTreeMap::new(),
            default_time: Timestamp {
                sec: now.as_secs() as i64,
                nsec: 0,
            },
        }
    }

    /// The directory at `comps`, made (0755, root's or the owner's) where missing when
    /// `create`; `Ok(None)` when missing and not `create`.
    pub(crate) fn dir(&mut self, comps: &[Vec<u8>], create: bool) -> Result<Option<Ino>> {
        let mut cur = self.root;
        for (i, c) in comps.iter().enumerate() {
            if let Some(&ino) = self.dirs.get(&(cur, c.clone())) {
                cur = ino;
                continue;
            }
            let parent = cur;
            cur = match self.fs.lookup(cur, c)? {
                Some(e) => {
                    if !self.fs.stat_ino(e.ino)?.is_dir() {
                        return Err(Error::InvalidInput(format!(
                            "{}: not a directory in the image (a symlink or file on the way \
                             is never followed)",
                            show(&join(&comps[..=i]))
                        )));
                    }
                    e.ino
                }
                None if create => {
                    // Not from the source: the image's root owns it (or --owner).
                    let (u, g) = self.owners.owner.unwrap_or((0, 0));
                    let ino = self.fs.mkdir_ino(cur, c, 0o755, u, g)?;
                    self.made.insert(join(&comps[..=i]));
                    let t = self.default_time;
                    self.dir_times.insert(ino, (t, t));
                    ino
                }
                None => return Ok(None),
            };
            self.dirs.insert((parent, c.clone()), cur);
        }
        Ok(Some(cur))
    }

    /// Forget directory `ino` (about to be removed) and every directory under it:
    /// the walk cache is emptied (it refills by lookups), their pending times dropped
    /// (an inode number freed may be reused by something else).
    fn forget(&mut self, ino: Ino) -> Result<()> {
        let mut stack = vec![ino];
        while let Some(d) = stack.pop() {
            self.dir_times.remove(&d);
            for e in self.fs.read_dir_ino(d)? {
                if e.name != b"." && e.name != b".." && self.fs.stat_ino(e.ino)?.is_dir() {
                    stack.push(e.ino);
                }
            }
        }
        self.dirs.clear();
        Ok(())
    }

    /// Remove `name` (and everything under it) from directory `parent`.
    pub(crate) fn remove(&mut self, parent: Ino, name: &[u8]) -> Result<()> {
        let Some(e) = self.fs.lookup(parent, name)? else {
            return Ok(());
        };
        if self.fs.stat_ino(e.ino)?.is_dir() {
            self.forget(e.ino)?;
            self.fs.empty_dir_ino(e.ino, &|| false)?;
            self.fs.rmdir_ino(parent, name)?;
        } else {
            self.fs.unlink_ino(parent, name)?;
        }
        Ok(())
    }

    /// Make room for a new entry `name` in `parent`: what is there is
    /// removed, unless it is a directory and `keep_dir` (a directory over a directory
    /// merges into it). Returns the directory kept, if any.
    fn prepare(&mut self, parent: Ino, name: &[u8], keep_dir: bool) -> Result<Option<Ino>> {
        if let Some(e) = self.fs.lookup(parent, name)? {
            if keep_dir && self.fs.stat_ino(e.ino)?.is_dir() {
                return Ok(Some(e.ino));
            }
            self.remove(parent, name)?;
        }
        Ok(None)
    }

    /// A directory: made, or merged into the one there; mode and owner set, its
    /// times kept for the end.
    pub(crate) fn mkdir(
        &mut self,
        comps: &[Vec<u8>],
        perm: u32,
        owner: (u32, u32),
        times: (Timestamp, Timestamp),
    ) -> Result<Ino> {
        let path = join(comps);
        let (u, g) = self.owners.map(owner.0, owner.1);
        let attrs = SetAttr {
            mode: Some(perm),
            uid: Some(u),
            gid: Some(g),
            ..SetAttr::default()
        };
        let ino = match comps.split_last() {
            None => {
                self.fs.setattr_ino(self.root, &attrs)?;
                self.root
            }
            Some((name, up)) => {
                let parent = self.dir(up, true)?.ok_or(Error::NotFound)?;
                match self.prepare(parent, name, true)? {
                    Some(ino) => {
                        self.fs.setattr_ino(ino, &attrs)?;
                        ino
                    }
                    None => self.fs.mkdir_ino(parent, name, perm, u, g)?,
                }
            }
        };
        if let Some((name, up)) = comps.split_last() {
            if let Some(parent) = self.dir(up, false)? {
                self.dirs.insert((parent, name.clone()), ino);
            }
        }
        self.made.insert(path);
        self.dir_times.insert(ino, times);
        Ok(ino)
    }

    /// A non-directory: whatever the path held is removed, then `make(fs, parent,
    /// name, uid, gid)` makes it.
    pub(crate) fn node(
        &mut self,
        comps: &[Vec<u8>],
        owner: (u32, u32),
        make: impl FnOnce(&Fs, Ino, &[u8], u32, u32) -> Result<Ino>,
    ) -> Result<Ino> {
        let path = join(comps);
        let Some((name, up)) = comps.split_last() else {
            return Err(Error::InvalidInput(
                "a non-directory names the destination directory itself".into(),
            ));
        };
        let parent = self.dir(up, true)?.ok_or(Error::NotFound)?;
        self.prepare(parent, name, false)?;
        let (u, g) = self.owners.map(owner.0, owner.1);
        let ino = make(self.fs, parent, name, u, g)?;
        self.made.insert(path);
        Ok(ino)
    }

    /// The inode at `comps`, following nothing, if it exists.
    pub(crate) fn find(&mut self, comps: &[Vec<u8>]) -> Result<Option<Ino>> {
        let Some((name, up)) = comps.split_last() else {
            return Ok(Some(self.root));
        };
        let Some(parent) = self.dir(up, false)? else {
            return Ok(None);
        };
        Ok(self.fs.lookup(parent, name)?.map(|e| e.ino))
    }

    /// Set every directory's times (nothing changes a directory after this).
    pub(crate) fn finish_dirs(&mut self) -> Result<()> {
        for (&ino, &(atime, mtime)) in &self.dir_times {
            self.fs.setattr_ino(
                ino,
                &SetAttr {
                    atime: Some(atime),
                    mtime: Some(mtime),
                    ..SetAttr::default()
                },
            )?;
        }
        self.dir_times.clear();
        Ok(())
    }
}

/// Write the blocks of `data` (at file offset `pos`) that are not all zeros: a zero
/// block stays a hole, as mke2fs -d leaves it, so the image follows the bytes alone.
pub fn write_nonzero(fs: &Fs, ino: Ino, data: &[u8], pos: u64) -> Result<()> {
    let bs = u64::from(fs.block_size());
    let mut at = 0usize;
    let mut run: Option<usize> = None;
    while at < data.len() {
        let abs = pos + at as u64;
        let end = ((abs / bs + 1) * bs - pos).min(data.len() as u64) as usize;
        let zero = data[at..end].iter().all(|&b| b == 0);
        match (zero, run) {
            (false, None) => run = Some(at),
            (true, Some(start)) => {
                write_all(fs, ino, &data[start..at], pos + start as u64)?;
                run = None;
            }
            _ => {}
        }
        at = end;
    }
    if let Some(start) = run {
        write_all(fs, ino, &data[start..], pos + start as u64)?;
    }
    Ok(())
}

/// Write `data` at `pos` whole (a short write goes on where it stopped).
pub fn write_all(fs: &Fs, ino: Ino, data: &[u8], pos: u64) -> Result<()> {
    let mut done = 0;
    while done < data.len() {
        let w = fs.write_ino_at(ino, &data[done..], pos + done as u64)?;
        if w == 0 {
            return Err(Error::NoSpace);
        }
        done += w;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_cleaned_and_dotdot_refused() {
        let c = |p: &[u8]| clean(p).map(|(c, a)| (join(&c), a));
        assert_eq!(c(b"./a//b/./c").ok(), Some((b"a/b/c".to_vec(), false)));
        assert_eq!(c(b"/etc/passwd").ok(), Some((b"etc/passwd".to_vec(), true)));
        assert_eq!(c(b"./").ok(), Some((Vec::new(), false)));
        assert!(c(b"a/../../b").is_err());
        assert!(c(b"..").is_err());
        assert!(c("a/".repeat(3000).as_bytes()).is_err());
        assert!(c(&[b'x'; 256]).is_err());
    }
}
