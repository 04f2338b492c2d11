//! Owners without root: `--owner UID:GID` and `--uid-map` / `--gid-map` ranges.
//!
//! A map is written as user namespaces write theirs (`/proc/PID/uid_map`): lines or
//! comma-separated entries `INSIDE:OUTSIDE:COUNT`, meaning ids OUTSIDE..OUTSIDE+COUNT
//! of the *source* (the host's files, an archive's numbers: the outside) become
//! INSIDE..INSIDE+COUNT in the *image* (what a container or the booted system sees:
//! the inside). So a tree a rootless build left owned by subordinate ids 100000+
//! becomes root's with `0:100000:65536`. As in a user namespace, an id no range
//! covers becomes the overflow id 65534 ("nobody"). `--owner` gives every file one
//! owner and takes precedence over the maps.
//!
//! Must hold: ranges may not overlap on either side (the kernel refuses that too), so
//! every id maps to at most one; parsing never panics on any text.

use rext4::{Error, Result};

/// The id an unmapped source id becomes (the kernel's overflowuid/overflowgid).
pub const OVERFLOW_ID: u32 = 65534;

/// One id map; empty maps nothing (ids are kept).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdMap {
    /// (inside, outside, count), sorted by outside.
    ranges: Vec<(u32, u32, u32)>,
}

impl IdMap {
    /// Parse `INSIDE:OUTSIDE:COUNT` entries separated by commas or newlines.
    pub fn parse(text: &str) -> Result<IdMap> {
        let mut m = IdMap::default();
        for entry in text
            .split([',', '\n'])
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            m.add_entry(entry)?;
        }
        Ok(m)
    }

    /// Add one `INSIDE:OUTSIDE:COUNT` entry (also space-separated, as uid_map files).
    pub fn add_entry(&mut self, entry: &str) -> Result<()> {
        let bad = |why: &str| Error::InvalidInput(format!("id map entry '{entry}': {why}"));
        let f: Vec<&str> = entry
            .split([':', ' ', '\t'])
            .filter(|f| !f.is_empty())
            .collect();
        let [i, o, c] = f.as_slice() else {
            return Err(bad("expected INSIDE:OUTSIDE:COUNT"));
        };
        let num = |s: &str| s.parse::<u32>().map_err(|_| bad("not a number"));
        let (inside, outside, count) = (num(i)?, num(o)?, num(c)?);
        if count == 0 {
            return Err(bad("COUNT is 0"));
        }
        let end = |start: u32| {
            start
                .checked_add(count - 1)
                .ok_or_else(|| bad("range past 2^32"))
        };
        let (ie, oe) = (end(inside)?, end(outside)?);
        for &(ri, ro, rc) in &self.ranges {
            if outside <= ro + (rc - 1) && ro <= oe {
                return Err(bad("overlaps another range's OUTSIDE ids"));
            }
            if inside <= ri + (rc - 1) && ri <= ie {
                return Err(bad("overlaps another range's INSIDE ids"));
            }
        }
        self.ranges.push((inside, outside, count));
        self.ranges.sort_by_key(|r| r.1);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The entries, as `INSIDE:OUTSIDE:COUNT` texts.
    pub fn entries(&self) -> Vec<String> {
        self.ranges
            .iter()
            .map(|(i, o, c)| format!("{i}:{o}:{c}"))
            .collect()
    }

    /// The image id of source id `id`: kept when the map is empty, the overflow id
    /// when no range covers it.
    pub fn map(&self, id: u32) -> u32 {
        if self.ranges.is_empty() {
            return id;
        }
        let i = self.ranges.partition_point(|r| r.1 <= id);
        match i.checked_sub(1).map(|k| self.ranges[k]) {
            Some((inside, outside, count)) if id - outside < count => inside + (id - outside),
            _ => OVERFLOW_ID,
        }
    }
}

/// How sources' owners become the image's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owners {
    /// Every file's owner (`--owner`), before the maps.
    pub owner: Option<(u32, u32)>,
    pub uid_map: IdMap,
    pub gid_map: IdMap,
}

impl Owners {
    /// Whether anything changes owners at all.
    pub fn is_identity(&self) -> bool {
        self.owner.is_none() && self.uid_map.is_empty() && self.gid_map.is_empty()
    }

    /// The image's (uid, gid) for a source's.
    pub fn map(&self, uid: u32, gid: u32) -> (u32, u32) {
        match self.owner {
            Some(o) => o,
            None => (self.uid_map.map(uid), self.gid_map.map(gid)),
        }
    }
}

/// Give every inode under directory `top` (itself included) the owner `owners` maps
/// its present one to — for a tree copied in by something that kept the sources' ids
/// (the Python binding's copy). lost+found (inode 11) is left as mkfs made it.
pub fn remap_tree(fs: &rext4::Fs, top: rext4::Ino, owners: &Owners) -> Result<u64> {
    if owners.is_identity() {
        return Ok(0);
    }
    let mut n = 0u64;
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![top];
    while let Some(ino) = stack.pop() {
        if !seen.insert(ino) || ino == rext4::Ino(11) {
            continue;
        }
        let md = fs.stat_ino(ino)?;
        let (u, g) = owners.map(md.uid, md.gid);
        fs.setattr_ino(
            ino,
            &rext4::SetAttr {
                uid: Some(u),
                gid: Some(g),
                atime: Some(md.atime),
                mtime: Some(md.mtime),
                ..rext4::SetAttr::default()
            },
        )?;
        n += 1;
        if md.is_dir() {
            for e in fs.read_dir_ino(ino)? {
                if e.name != b"." && e.name != b".." {
                    stack.push(e.ino);
                }
            }
        }
    }
    Ok(n)
}

/// Parse `UID:GID` (numbers).
pub fn parse_owner(s: &str) -> Result<(u32, u32)> {
    let bad = || Error::InvalidInput(format!("owner '{s}': expected UID:GID (numbers)"));
    let (u, g) = s.split_once(':').ok_or_else(bad)?;
    Ok((u.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_go_from_outside_to_inside() {
        let m = IdMap::parse("0:100000:65536, 65536:1000:1").expect("parse");
        assert_eq!(m.map(100000), 0);
        assert_eq!(m.map(100005), 5);
        assert_eq!(m.map(165535), 65535);
        assert_eq!(m.map(165536), OVERFLOW_ID);
        assert_eq!(m.map(1000), 65536);
        assert_eq!(m.map(0), OVERFLOW_ID);
        assert_eq!(IdMap::default().map(42), 42);
        let m = IdMap::parse("0 1000 1\n1 2000 10").expect("uid_map file form");
        assert_eq!((m.map(1000), m.map(2003)), (0, 4));
    }

    #[test]
    fn bad_maps_are_refused() {
        for bad in [
            "0:1",
            "a:1:1",
            "0:1:0",
            "0:4294967295:2",
            "0:10:10,5:15:1",
            "0:10:10,5:100:1",
            "1:2:3:4",
        ] {
            assert!(IdMap::parse(bad).is_err(), "{bad}");
        }
        assert!(IdMap::parse("").is_ok_and(|m| m.is_empty()));
    }

    #[test]
    fn owner_wins_over_maps() {
        let o = Owners {
            owner: Some((5, 6)),
            uid_map: IdMap::parse("0:1:1").expect("m"),
            gid_map: IdMap::default(),
        };
        assert_eq!(o.map(1, 1), (5, 6));
        assert_eq!(parse_owner("1:2").ok(), Some((1, 2)));
        assert!(parse_owner("root:2").is_err());
    }
}
