//! Feature sets for mkfs: the two 1.47.0 default sets (Debian's and upstream's
//! mke2fs.conf for ext4) and `-O` edits parsed the way mke2fs parses them
//! (`e2p_edit_feature2`: a comma/space separated list, `^name` or `-name` clears,
//! `+name` or `name` sets, `none`/`clear` clears everything, later words win).
//!
//! Must hold: [`FeatureSet::apply`] yields exactly what mke2fs would compute from the
//! same defaults and edits; which of the results mkfs can build is judged by
//! [`Features::check_buildable`], never silently dropped.

use rext4_format::superblock::feature::*;

/// Concrete feature bits of a filesystem.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Features {
    pub compat: u32,
    pub incompat: u32,
    pub ro_compat: u32,
}

/// Debian's mke2fs.conf for ext4 (base_features + ext4 features).
const DEBIAN: Features = Features {
    compat: COMPAT_HAS_JOURNAL | COMPAT_EXT_ATTR | COMPAT_RESIZE_INODE | COMPAT_DIR_INDEX,
    incompat: INCOMPAT_FILETYPE | INCOMPAT_EXTENTS | INCOMPAT_64BIT | INCOMPAT_FLEX_BG,
    ro_compat: RO_COMPAT_SPARSE_SUPER
        | RO_COMPAT_LARGE_FILE
        | RO_COMPAT_HUGE_FILE
        | RO_COMPAT_DIR_NLINK
        | RO_COMPAT_EXTRA_ISIZE
        | RO_COMPAT_METADATA_CSUM,
};
const _: () = assert!(DEBIAN.compat == 0x3c && DEBIAN.incompat == 0x2c2);
const _: () = assert!(DEBIAN.ro_compat == 0x46b);

/// mke2fs.conf's base_features (both Debian's and the release's): what `-t ext2`
/// makes; `-t ext3` adds has_journal.
const BASE: Features = Features {
    compat: COMPAT_EXT_ATTR | COMPAT_RESIZE_INODE | COMPAT_DIR_INDEX,
    incompat: INCOMPAT_FILETYPE,
    ro_compat: RO_COMPAT_SPARSE_SUPER | RO_COMPAT_LARGE_FILE,
};
const _: () = assert!(BASE.compat == 0x38 && BASE.incompat == 0x2 && BASE.ro_compat == 0x3);

/// mke2fs's `-t`: which of mke2fs.conf's fs_types the defaults come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FsType {
    Ext2,
    Ext3,
    #[default]
    Ext4,
}

impl FsType {
    /// `ext2`, `ext3` or `ext4`.
    pub fn parse(name: &str) -> Option<FsType> {
        match name {
            "ext2" => Some(FsType::Ext2),
            "ext3" => Some(FsType::Ext3),
            "ext4" => Some(FsType::Ext4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FsType::Ext2 => "ext2",
            FsType::Ext3 => "ext3",
            FsType::Ext4 => "ext4",
        }
    }
}

/// What rext4's mkfs knows how to lay out (ea_inode is a bit in the superblock alone,
/// as mke2fs sets it; inline_data too, but for lost+found's one block fewer).
const BUILDABLE: Features = Features {
    compat: DEBIAN.compat | COMPAT_ORPHAN_FILE,
    incompat: DEBIAN.incompat
        | INCOMPAT_CSUM_SEED
        | INCOMPAT_MMP
        | INCOMPAT_EA_INODE
        | INCOMPAT_CASEFOLD
        | INCOMPAT_INLINE_DATA,
    ro_compat: DEBIAN.ro_compat | RO_COMPAT_GDT_CSUM,
};

impl Features {
    /// The defaults of mke2fs 1.47.0 for `-t ty`: ext2 and ext3 are the base features
    /// (ext3 with a journal) in both configurations; ext4 as [`Features::defaults`].
    pub fn defaults_for(ty: FsType, upstream: bool) -> Features {
        match ty {
            FsType::Ext2 => BASE,
            FsType::Ext3 => Features {
                compat: BASE.compat | COMPAT_HAS_JOURNAL,
                ..BASE
            },
            FsType::Ext4 => Features::defaults(upstream),
        }
    }

    /// The ext4 defaults of mke2fs 1.47.0: Debian's configuration, or with `upstream`
    /// the release's own, which adds orphan_file and metadata_csum_seed.
    pub fn defaults(upstream: bool) -> Features {
        if upstream {
            Features {
                compat: DEBIAN.compat | COMPAT_ORPHAN_FILE,
                incompat: DEBIAN.incompat | INCOMPAT_CSUM_SEED,
                ro_compat: DEBIAN.ro_compat,
            }
        } else {
            DEBIAN
        }
    }

    pub fn has_compat(&self, f: u32) -> bool {
        self.compat & f != 0
    }
    pub fn has_incompat(&self, f: u32) -> bool {
        self.incompat & f != 0
    }
    pub fn has_ro_compat(&self, f: u32) -> bool {
        self.ro_compat & f != 0
    }

    /// Names in dumpe2fs order (compat, incompat, ro_compat; each by bit).
    pub fn names(&self) -> Vec<String> {
        let mut v = names(self.compat, COMPAT_NAMES, "C");
        v.extend(names(self.incompat, INCOMPAT_NAMES, "I"));
        v.extend(names(self.ro_compat, RO_COMPAT_NAMES, "R"));
        v
    }

    /// Normalize like mke2fs: metadata_csum supersedes uninit_bg, and
    /// metadata_csum_seed is dropped without metadata_csum.
    pub(crate) fn normalized(mut self) -> Features {
        if self.has_ro_compat(RO_COMPAT_METADATA_CSUM) {
            self.ro_compat &= !RO_COMPAT_GDT_CSUM;
        } else {
            self.incompat &= !INCOMPAT_CSUM_SEED;
        }
        self
    }

    /// Refuse feature sets rext4's mkfs cannot build, or that mke2fs refuses.
    pub(crate) fn check_buildable(&self) -> Result<(), String> {
        let extra = Features {
            compat: self.compat & !BUILDABLE.compat,
            incompat: self.incompat & !BUILDABLE.incompat,
            ro_compat: self.ro_compat & !BUILDABLE.ro_compat,
        };
        if extra != Features::default() {
            return Err(format!(
                "rext4 mkfs cannot create these features: {}",
                extra.names().join(", ")
            ));
        }
        if !self.has_incompat(INCOMPAT_FILETYPE) {
            return Err("rext4 mkfs always needs the filetype feature".into());
        }
        if !self.has_incompat(INCOMPAT_EXTENTS) {
            // mke2fs's own refusal.
            if self.has_incompat(INCOMPAT_64BIT) {
                return Err("extents must be enabled for a 64-bit filesystem".into());
            }
            if self.has_compat(COMPAT_ORPHAN_FILE) {
                return Err("rext4 mkfs makes the orphan file only with the extent feature".into());
            }
        }
        if self.has_compat(COMPAT_RESIZE_INODE) && !self.has_ro_compat(RO_COMPAT_SPARSE_SUPER) {
            return Err("reserved online resize blocks (resize_inode) need sparse_super".into());
        }
        Ok(())
    }
}

fn names(bits: u32, table: &[(u32, &str)], prefix: &str) -> Vec<String> {
    rext4_format::superblock::feature::names(bits, table, prefix)
}

/// `-O` edits to apply on top of the defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeatureSet {
    /// `none` or `clear` was given: start from no features at all.
    pub clear_all: bool,
    /// Features to set (disjoint from `remove`).
    pub add: Features,
    /// Features to clear.
    pub remove: Features,
}

/// Which word a feature lives in.
#[derive(Clone, Copy)]
enum Word {
    Compat,
    Incompat,
    RoCompat,
}

fn lookup(name: &str) -> Option<(Word, u32)> {
    let name = name.to_ascii_lowercase();
    let name = match name.as_str() {
        "extents" => "extent",
        "uninit_groups" => "uninit_bg",
        other => other,
    };
    let tables = [
        (Word::Compat, COMPAT_NAMES),
        (Word::Incompat, INCOMPAT_NAMES),
        (Word::RoCompat, RO_COMPAT_NAMES),
    ];
    tables.iter().find_map(|(w, t)| {
        t.iter()
            .find(|(_, n)| *n == name)
            .map(|(bit, _)| (*w, *bit))
    })
}

fn word(f: &mut Features, w: Word) -> &mut u32 {
    match w {
        Word::Compat => &mut f.compat,
        Word::Incompat => &mut f.incompat,
        Word::RoCompat => &mut f.ro_compat,
    }
}

impl FeatureSet {
    /// Parse one `-O` argument.
    pub fn parse(spec: &str) -> Result<FeatureSet, String> {
        let mut s = FeatureSet::default();
        s.edit(spec)?;
        Ok(s)
    }

    /// Apply one more `-O` argument on top of this one (mke2fs accepts several).
    pub fn edit(&mut self, spec: &str) -> Result<(), String> {
        for w in spec.split([',', ' ', '\t']).filter(|w| !w.is_empty()) {
            if w.eq_ignore_ascii_case("none") || w.eq_ignore_ascii_case("clear") {
                *self = FeatureSet {
                    clear_all: true,
                    ..FeatureSet::default()
                };
                continue;
            }
            let (clear, name) = match w.as_bytes().first() {
                Some(b'^') | Some(b'-') => (true, &w[1..]),
                Some(b'+') => (false, &w[1..]),
                _ => (false, w),
            };
            let (wd, bit) =
                lookup(name).ok_or_else(|| format!("invalid filesystem option set: {spec}"))?;
            if clear {
                *word(&mut self.add, wd) &= !bit;
                *word(&mut self.remove, wd) |= bit;
            } else {
                *word(&mut self.remove, wd) &= !bit;
                *word(&mut self.add, wd) |= bit;
            }
        }
        Ok(())
    }

    /// The resulting features on top of `base`.
    pub fn apply(&self, base: Features) -> Features {
        let base = if self.clear_all {
            Features::default()
        } else {
            base
        };
        Features {
            compat: (base.compat | self.add.compat) & !self.remove.compat,
            incompat: (base.incompat | self.add.incompat) & !self.remove.incompat,
            ro_compat: (base.ro_compat | self.add.ro_compat) & !self.remove.ro_compat,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_apply_in_order() {
        let mut s = FeatureSet::parse("^has_journal,orphan_file").expect("parse");
        s.edit("has_journal ^orphan_file,Extents").expect("parse");
        let f = s.apply(Features::defaults(false));
        assert!(f.has_compat(COMPAT_HAS_JOURNAL));
        assert!(!f.has_compat(COMPAT_ORPHAN_FILE));
        assert!(f.has_incompat(INCOMPAT_EXTENTS));
        let none = FeatureSet::parse("none,extent").expect("parse");
        assert_eq!(
            none.apply(Features::defaults(true)),
            Features {
                incompat: INCOMPAT_EXTENTS,
                ..Features::default()
            }
        );
        assert!(FeatureSet::parse("bogus").is_err());
    }

    #[test]
    fn defaults_match_the_format_notes() {
        let u = Features::defaults(true);
        assert_eq!((u.compat, u.incompat, u.ro_compat), (0x103c, 0x22c2, 0x46b));
        assert!(u.check_buildable().is_ok());
        let no_csum = FeatureSet::parse("^metadata_csum").expect("parse");
        let f = no_csum.apply(u).normalized();
        assert!(!f.has_incompat(INCOMPAT_CSUM_SEED));
        // Without extents: not with 64bit (as mke2fs refuses); ext2 and ext3 are the
        // base features.
        let no_extents = FeatureSet::parse("^extent").expect("parse");
        assert!(no_extents.apply(u).check_buildable().is_err());
        let ext3 = Features::defaults_for(FsType::Ext3, true);
        assert_eq!(
            (ext3.compat, ext3.incompat, ext3.ro_compat),
            (0x3c, 0x2, 0x3)
        );
        assert!(ext3.check_buildable().is_ok());
        assert!(Features::defaults_for(FsType::Ext2, false)
            .check_buildable()
            .is_ok());
    }
}
