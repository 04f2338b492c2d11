//! Inline data (`-O inline_data`): files, directories and symlinks whose bytes live in
//! the inode — `i_block` and the in-inode xattr `system.data` (format side:
//! `rext4_format::inline`) — read, written in place, and converted to a block when they
//! outgrow the inode, as the kernel's `fs/ext4/inline.c` does.
//!
//! What it owns: reading inline bytes (files, symlinks), listing and looking up inline
//! directories, writing a file's bytes inline (an inline file, or an empty new file
//! whose first write fits: the kernel makes a new regular file inline at its first
//! write), the inline truncate, creating new directories inline, adding and removing
//! names in inline directories, and the conversions (`uninline_file_locked`,
//! `uninline_dir`).
//!
//! The page cache never holds an inline file's pages: inline files are read and
//! written synchronously under the file's exclusive I/O lock and the write lock
//! (reads under the shared I/O lock), in the running transaction with the inode
//! record. Buffered writes to them, and to an empty file whose first write may go
//! inline, take the write-through path (`cacheable` is false for them), which lands
//! in `write_locked`; anything that maps blocks — O_DIRECT, fallocate, a write past
//! the inline capacity — converts the file first. A conversion is one change of the
//! running transaction: the new block's data reaches the device before the record
//! that names it can commit (as a slow symlink's block), the record loses the flag
//! and `system.data` and gains the mapping together.
//!
//! Must hold after every change: an inode with INLINE_DATA_FL has `system.data` in
//! its in-inode area (never in the block or an EA inode), its size at most 60 plus the
//! value's length (a directory's exactly that), no EXTENTS_FL; the bytes past a
//! file's size inside the inline area are zero. An inline directory's two areas are
//! each covered by their records. Other xattrs are kept beside `system.data`.
//!
//! Locks: file changes under the file's exclusive I/O lock and `Fs::write_lock`;
//! directory changes under a handle and the directory's inode lock (whole), as every
//! other directory change. Callers: `file.rs` (reads), `dir.rs` (listing, lookup),
//! `ops.rs` (writes, truncate, the directory operations), `fs/pagecache` (routing).

use std::mem::MaybeUninit;

use rext4_format::dir::FileType as DirFt;
use rext4_format::inline as fi;
use rext4_format::inode::{flags, Inode};
use rext4_format::superblock::feature;
use rext4_format::xattr as fx;

use crate::dir::DirEntry;
use crate::dir_write;
use crate::error::{Error, Result};
use crate::file::FileType;
use crate::fs::inode_write::{map_new_blocks, FsDir};
use crate::fs::{Fs, Ino};

/// An inode's inline state: its record bytes, the other in-inode attributes, the
/// `system.data` value (empty when the inode has none yet) and the in-inode area's
/// length.
pub(crate) struct InlineState {
    raw: Vec<u8>,
    others: Vec<fx::Xattr>,
    value: Vec<u8>,
    region_len: usize,
}

impl InlineState {
    /// The most inline bytes this inode can hold (60 + the largest value), `None`
    /// when it cannot hold any.
    fn capacity(&self) -> Option<usize> {
        fi::max_value_len(self.region_len, &self.others).map(|v| fi::I_BLOCK_BYTES + v)
    }
}

/// Whether `inode` keeps its bytes inline.
pub(crate) fn is_inline(inode: &Inode) -> bool {
    inode.has_flag(flags::INLINE_DATA)
}

fn corrupt(ino: Ino, what: impl std::fmt::Display) -> Error {
    Error::corrupted(format!("inode {} inline data: {what}", ino.0), None)
}

impl Fs {
    /// Whether the filesystem has the inline_data feature.
    pub(crate) fn has_inline_feature(&self) -> bool {
        self.inner.sb.has_incompat(feature::INCOMPAT_INLINE_DATA)
    }

    /// `ino`'s inline state as stored; for an inline inode `system.data` must be
    /// there, in the inode area, its value there too.
    fn inline_state(&self, ino: Ino, inode: &Inode) -> Result<InlineState> {
        let (raw, blk) = self.inode_bytes(ino)?;
        let region = fx::inode_region(&raw).map_err(|e| Error::from(e.at_block(blk)))?;
        let region_len = region.len();
        let attrs = fx::decode_inode(region).map_err(|e| Error::from(e.at_block(blk)))?;
        let mut value = None;
        let mut others = Vec::with_capacity(attrs.len());
        for a in attrs {
            if fi::is_data_attr(&a) {
                if a.inode.is_some() {
                    return Err(corrupt(ino, "system.data names a value inode"));
                }
                value = Some(a.value);
            } else {
                others.push(a);
            }
        }
        if is_inline(inode) {
            if !self.has_inline_feature() {
                return Err(corrupt(
                    ino,
                    "INLINE_DATA_FL without the inline_data feature",
                ));
            }
            if inode.has_flag(flags::EXTENTS) {
                return Err(corrupt(ino, "both INLINE_DATA_FL and EXTENTS_FL"));
            }
        }
        let value = match value {
            Some(v) => v,
            None if is_inline(inode) => return Err(corrupt(ino, "no system.data attribute")),
            None => Vec::new(),
        };
        Ok(InlineState {
            raw,
            others,
            value,
            region_len,
        })
    }

    /// The inline bytes of inline inode `ino` (60 + the value's length), checked
    /// against its size.
    pub(crate) fn inline_bytes(&self, ino: Ino, inode: &Inode) -> Result<Vec<u8>> {
        let st = self.inline_state(ino, inode)?;
        let data = fi::join(&inode.block, &st.value);
        if !inode.is_dir() {
            fi::check_file_size(inode.size, data.len()).map_err(|e| corrupt(ino, e))?;
        }
        Ok(data)
    }

    /// Read inline inode `ino` (a file or symlink) at `offset` into `buf`; the count.
    pub(crate) fn read_inline(
        &self,
        ino: Ino,
        inode: &Inode,
        buf: &mut [MaybeUninit<u8>],
        offset: u64,
    ) -> Result<usize> {
        let data = self.inline_bytes(ino, inode)?;
        let size = inode.size.min(data.len() as u64);
        if offset >= size {
            return Ok(0);
        }
        let from = offset as usize;
        let n = buf.len().min(size as usize - from);
        for (d, s) in buf[..n].iter_mut().zip(&data[from..from + n]) {
            *d = MaybeUninit::new(*s);
        }
        Ok(n)
    }

    /// The live entries of inline directory `ino` (no "." or ".."), in on-disk order,
    /// and its parent.
    pub(crate) fn inline_dir_list(&self, ino: Ino, inode: &Inode) -> Result<(u32, Vec<DirEntry>)> {
        let st = self.inline_state(ino, inode)?;
        let parent = fi::dir_parent(&inode.block);
        if parent == 0 {
            return Err(corrupt(ino, "directory without a parent"));
        }
        let all = fi::dir_entries(&inode.block, &st.value).map_err(|e| corrupt(ino, e))?;
        let mut out = Vec::new();
        for (_, e) in all.into_iter().filter(|(_, e)| e.is_live()) {
            if e.name.is_empty() || e.name.contains(&b'/') || e.name.contains(&0) {
                return Err(corrupt(ino, format!("invalid name {:?}", e.name)));
            }
            if e.name == b"." || e.name == b".." {
                return Err(corrupt(ino, "a \".\" or \"..\" entry"));
            }
            out.push(DirEntry {
                name: e.name.to_vec(),
                ino: Ino(e.inode),
                file_type: FileType::from_dirent(e.file_type),
            });
        }
        Ok((parent, out))
    }

    /// Look `name` up in inline directory `ino` ("." and ".." included).
    pub(crate) fn inline_dir_lookup(
        &self,
        ino: Ino,
        inode: &Inode,
        name: &[u8],
    ) -> Result<Option<DirEntry>> {
        let (parent, list) = self.inline_dir_list(ino, inode)?;
        let dot = |n: u32| DirEntry {
            name: name.to_vec(),
            ino: Ino(n),
            file_type: FileType::Dir,
        };
        match name {
            b"." => return Ok(Some(dot(ino.0))),
            b".." => return Ok(Some(dot(parent))),
            _ => {}
        }
        Ok(list.into_iter().find(|e| e.name == name))
    }

    /// Whether an empty regular file may take its first bytes inline (the kernel's
    /// MAY_INLINE_DATA for a new file): the feature, no bytes, no blocks.
    pub(crate) fn may_inline(&self, inode: &Inode) -> bool {
        self.has_inline_feature()
            && !self.inner.dax
            && inode.is_reg()
            && !is_inline(inode)
            && inode.size == 0
            && inode.blocks_raw == 0
            && inode.extra_isize > 0
            && (inode.has_flag(flags::EXTENTS) || crate::fs::inode_write::uses_block_map(inode))
            && inode.block[12..].iter().all(|&b| b == 0)
    }

    /// A conservative bound on an inode's inline capacity (no other attribute), for
    /// routing writes before the record is read.
    pub(crate) fn inline_capacity_bound(&self) -> u64 {
        let isz = u64::from(self.inner.sb.inode_size);
        fi::I_BLOCK_BYTES as u64 + isz.saturating_sub(128)
    }

    /// Store `i_block` and the `system.data` value `value` for `ino` over `st`'s
    /// record, with INLINE_DATA_FL set and the other in-inode attributes kept.
    fn store_inline(
        &self,
        ino: Ino,
        inode: &mut Inode,
        st: &mut InlineState,
        i_block: [u8; fi::I_BLOCK_BYTES],
        value: &[u8],
    ) -> Result<()> {
        let mut attrs = st.others.clone();
        attrs.push(fi::data_attr(value));
        let region = fx::inode_region_mut(&mut st.raw).map_err(Error::from)?;
        fx::encode_inode_region(region, &attrs)
            .map_err(|e| Error::InvalidInput(format!("inline data: {e}")))?;
        inode.block = i_block;
        inode.flags |= flags::INLINE_DATA;
        inode.flags &= !flags::EXTENTS;
        self.write_inode_raw(ino, &st.raw, inode)?;
        st.value = value.to_vec();
        Ok(())
    }

    /// A write of `buf` at `offset` to regular file `ino` kept inline when it fits
    /// (an inline file, or an empty one taking its first bytes); `None` when the
    /// caller writes blocks instead — an inline file is converted first then. Caller
    /// holds the exclusive I/O lock and the write lock; `inode` is current and is
    /// updated.
    pub(crate) fn write_inline_locked(
        &self,
        ino: Ino,
        inode: &mut Inode,
        buf: &[u8],
        offset: u64,
        update_times: bool,
    ) -> Result<Option<usize>> {
        let inline = is_inline(inode);
        if !inline && !self.may_inline(inode) {
            return Ok(None);
        }
        let mut st = self.inline_state(ino, inode)?;
        let end = offset.saturating_add(buf.len() as u64);
        let fits = st.capacity().is_some_and(|c| end <= c as u64);
        if !fits {
            if inline {
                self.uninline_file_locked(ino)?;
                *inode = self.read_live_inode(ino)?;
            }
            return Ok(None);
        }
        let mut data = if inline {
            let d = fi::join(&inode.block, &st.value);
            fi::check_file_size(inode.size, d.len()).map_err(|e| corrupt(ino, e))?;
            d
        } else {
            vec![0u8; fi::I_BLOCK_BYTES]
        };
        // What lies past the old size reads as zeros (it should be zero already).
        let old = inode.size as usize;
        if old < data.len() {
            data[old..].fill(0);
        }
        let end = end as usize;
        if end > data.len() {
            data.resize(end, 0);
        }
        data[offset as usize..end].copy_from_slice(buf);
        let mut i_block = [0u8; fi::I_BLOCK_BYTES];
        i_block.copy_from_slice(&data[..fi::I_BLOCK_BYTES]);
        inode.size = inode.size.max(end as u64);
        if update_times {
            let t = self.now();
            inode.mtime = t;
            inode.ctime = t;
        }
        self.store_inline(ino, inode, &mut st, i_block, &data[fi::I_BLOCK_BYTES..])?;
        Ok(Some(buf.len()))
    }

    /// Truncate inline file `ino` to `size` in place when it stays within what the
    /// inode holds (the kernel's `ext4_inline_data_truncate`: the value is cut to
    /// `size - 60`, the bytes past `size` zeroed); else convert it (false: the caller
    /// truncates the blocks). Caller holds the exclusive I/O lock and the write lock.
    pub(crate) fn truncate_inline_locked(
        &self,
        ino: Ino,
        inode: &mut Inode,
        size: u64,
    ) -> Result<bool> {
        let mut st = self.inline_state(ino, inode)?;
        let data = fi::join(&inode.block, &st.value);
        fi::check_file_size(inode.size, data.len()).map_err(|e| corrupt(ino, e))?;
        let cap = st.capacity().unwrap_or(0) as u64;
        if size > cap {
            self.uninline_file_locked(ino)?;
            *inode = self.read_live_inode(ino)?;
            return Ok(false);
        }
        let size_u = size as usize;
        let mut data = data;
        let old = (inode.size as usize).min(data.len());
        data[old..].fill(0);
        // Shrinking cuts the value to what the new size needs; growing keeps it or
        // grows it with zeros.
        let keep = if size_u < data.len() {
            size_u.max(fi::I_BLOCK_BYTES)
        } else {
            size_u
        };
        data.resize(keep, 0);
        data[size_u.min(keep)..].fill(0);
        let mut i_block = [0u8; fi::I_BLOCK_BYTES];
        i_block.copy_from_slice(&data[..fi::I_BLOCK_BYTES]);
        inode.size = size;
        let t = self.now();
        inode.mtime = t;
        inode.ctime = t;
        self.store_inline(ino, inode, &mut st, i_block, &data[fi::I_BLOCK_BYTES..])?;
        Ok(true)
    }

    /// Convert inline file (or symlink) `ino` to a block, as the kernel's
    /// `ext4_convert_inline_data`: its bytes go to a new block (mapped by extents on
    /// an extent filesystem, else by the block map), written to the device before the
    /// record that names it; the record loses INLINE_DATA_FL and `system.data`. One
    /// change of the running transaction. Caller holds the exclusive I/O lock and the
    /// write lock. Nothing to do for a file that is not inline.
    pub(crate) fn uninline_file_locked(&self, ino: Ino) -> Result<()> {
        let mut inode = self.read_live_inode(ino)?;
        if !is_inline(&inode) {
            return Ok(());
        }
        if inode.is_dir() {
            return Err(Error::IsADirectory);
        }
        let mut st = self.inline_state(ino, &inode)?;
        let data = fi::join(&inode.block, &st.value);
        fi::check_file_size(inode.size, data.len()).map_err(|e| corrupt(ino, e))?;
        let size = inode.size as usize;
        let region = fx::inode_region_mut(&mut st.raw).map_err(Error::from)?;
        fx::encode_inode_region(region, &st.others)
            .map_err(|e| Error::InvalidInput(format!("inline data: {e}")))?;
        inode.flags &= !flags::INLINE_DATA;
        inode.block = [0u8; fi::I_BLOCK_BYTES];
        self.map_by_extents(&mut inode);
        if size > 0 {
            let bs = self.inner.block_size as usize;
            let mut alloc = |goal: u64, n: u32| self.alloc_blocks(goal, n);
            let (p, _) = map_new_blocks(self, ino, &mut inode, 0, 1, false, &mut alloc)?;
            let mut b = vec![0u8; bs];
            b[..size].copy_from_slice(&data[..size]);
            if let Err(e) = self.write_data(&b, p * bs as u64) {
                let _ = self.free_blocks(p, 1);
                return Err(e);
            }
        }
        self.write_inode_raw(ino, &st.raw, &inode)
    }

    /// Convert inline file `ino` to a block if it is inline, taking the exclusive I/O
    /// lock and the write lock (before O_DIRECT, fallocate, mappings).
    pub(crate) fn uninline_file(&self, ino: Ino) -> Result<()> {
        let inode = self.read_live_inode(ino)?;
        if !self.has_inline_feature() || !is_inline(&inode) || inode.is_dir() {
            return Ok(());
        }
        let _io = self.io_exclusive(ino);
        let _w = self.write_lock();
        self.check_writable()?;
        self.uninline_file_locked(ino)
    }

    /// Give new directory `d` (its record written, no blocks) its inline form under
    /// `parent`, as the kernel's `ext4_try_create_inline_dir`: false (nothing changed)
    /// when the inode cannot hold inline data, and the caller makes a block.
    pub(crate) fn create_inline_dir(&self, d: &mut FsDir<'_>, parent: Ino) -> Result<bool> {
        if !self.has_inline_feature() || d.inode.extra_isize == 0 {
            return Ok(false);
        }
        let mut st = self.inline_state(d.ino, &d.inode)?;
        if st.capacity().is_none() {
            return Ok(false);
        }
        let mut inode = d.inode.clone();
        inode.size = fi::I_BLOCK_BYTES as u64;
        self.store_inline(d.ino, &mut inode, &mut st, fi::new_dir(parent.0), &[])?;
        d.inode = inode;
        d.dirty = false;
        Ok(true)
    }

    /// Add `name -> ino` to inline directory `d` in place if it has room (first
    /// `i_block`'s area, then the value's, growing the value to the most the inode
    /// holds once, as the kernel's `ext4_try_add_inline_entry`); false when it has
    /// none (the caller converts it). `Exists` when the name is there. Caller holds
    /// the directory's lock in a handle.
    pub(crate) fn inline_add_entry(
        &self,
        d: &mut FsDir<'_>,
        name: &[u8],
        ino: Ino,
        ftype: DirFt,
    ) -> Result<bool> {
        let mut st = self.inline_state(d.ino, &d.inode)?;
        // Both areas are searched for the name before anything is added.
        let all = fi::dir_entries(&d.inode.block, &st.value).map_err(|e| corrupt(d.ino, e))?;
        if all.iter().any(|(_, e)| e.is_live() && e.name == name) {
            return Err(Error::Exists);
        }
        let mut i_block = d.inode.block;
        let added = |area: &mut [u8]| -> Result<bool> {
            Ok(
                rext4_format::dir::insert_entry(area, ino.0, name, ftype, false)
                    .map_err(|e| corrupt(d.ino, e))?
                    .is_some(),
            )
        };
        let mut value = st.value.clone();
        let done = if added(&mut i_block[fi::DOTDOT_BYTES..])? {
            true
        } else {
            if value.is_empty() {
                let max = st.capacity().unwrap_or(0).saturating_sub(fi::I_BLOCK_BYTES);
                if max > rext4_format::dir::rec_len_for(1) {
                    value = fi::empty_dir_area(max);
                }
            }
            !value.is_empty() && added(&mut value)?
        };
        if !done {
            return Ok(false);
        }
        let mut inode = d.inode.clone();
        inode.size = (fi::I_BLOCK_BYTES + value.len()) as u64;
        let t = self.now();
        inode.mtime = t;
        inode.ctime = t;
        self.store_inline(d.ino, &mut inode, &mut st, i_block, &value)?;
        d.inode = inode;
        Ok(true)
    }

    /// Remove `name` from inline directory `d` in place (merged into the record
    /// before it in its area, or its inode zeroed when first), as the kernel does;
    /// the (inode, file type) it named, `None` when absent. `expect`: only if it
    /// names that inode.
    pub(crate) fn inline_remove_entry(
        &self,
        d: &mut FsDir<'_>,
        name: &[u8],
        expect: Option<u32>,
    ) -> Result<Option<(u32, u8)>> {
        let mut st = self.inline_state(d.ino, &d.inode)?;
        let mut i_block = d.inode.block;
        let mut value = st.value.clone();
        let remove = |area: &mut [u8]| -> Result<Option<(u32, u8)>> {
            let r = match expect {
                Some(i) => rext4_format::dir::remove_entry_naming(area, name, i, false),
                None => rext4_format::dir::remove_entry_typed(area, name, false),
            };
            r.map_err(|e| corrupt(d.ino, e))
        };
        let mut gone = remove(&mut i_block[fi::DOTDOT_BYTES..])?;
        if gone.is_none() && !value.is_empty() {
            gone = remove(&mut value)?;
        }
        if gone.is_none() {
            return Ok(None);
        }
        let mut inode = d.inode.clone();
        let t = self.now();
        inode.mtime = t;
        inode.ctime = t;
        self.store_inline(d.ino, &mut inode, &mut st, i_block, &value)?;
        d.inode = inode;
        Ok(gone)
    }

    /// Point `name` of inline directory `d` at `new_ino` of type `ftype` in place (a
    /// rename over it); the inode it named, `None` when absent.
    pub(crate) fn inline_replace_entry(
        &self,
        d: &mut FsDir<'_>,
        name: &[u8],
        new_ino: Ino,
        ftype: DirFt,
    ) -> Result<Option<u32>> {
        let mut st = self.inline_state(d.ino, &d.inode)?;
        let mut i_block = d.inode.block;
        let mut value = st.value.clone();
        let found = fi::dir_entries(&d.inode.block, &st.value)
            .map_err(|e| corrupt(d.ino, e))?
            .into_iter()
            .find(|(_, e)| e.is_live() && e.name == name)
            .map(|(area, e)| (area, e.offset, e.inode));
        let Some((area, off, old)) = found else {
            return Ok(None);
        };
        let bytes: &mut [u8] = if area == 0 {
            &mut i_block[fi::DOTDOT_BYTES..]
        } else {
            &mut value
        };
        rext4_format::bytes::set_le32(bytes, off + rext4_format::dir::DIRENT_INODE, new_ino.0);
        rext4_format::bytes::set_u8(
            bytes,
            off + rext4_format::dir::DIRENT_FILE_TYPE,
            ftype as u8,
        );
        let mut inode = d.inode.clone();
        self.store_inline(d.ino, &mut inode, &mut st, i_block, &value)?;
        d.inode = inode;
        Ok(Some(old))
    }

    /// Point inline directory `d`'s ".." at `parent` (a move to another directory).
    pub(crate) fn inline_set_parent(&self, d: &mut FsDir<'_>, parent: u32) -> Result<()> {
        let mut st = self.inline_state(d.ino, &d.inode)?;
        let mut i_block = d.inode.block;
        i_block[..fi::DOTDOT_BYTES].copy_from_slice(&parent.to_le_bytes());
        let mut inode = d.inode.clone();
        let value = st.value.clone();
        self.store_inline(d.ino, &mut inode, &mut st, i_block, &value)?;
        d.inode = inode;
        Ok(())
    }

    /// Whether inline directory `inode` has no entries.
    pub(crate) fn inline_dir_is_empty(&self, ino: Ino, inode: &Inode) -> Result<bool> {
        Ok(self.inline_dir_list(ino, inode)?.1.is_empty())
    }

    /// Convert inline directory `d` to a one-block directory, as the kernel's
    /// `ext4_convert_inline_dir`: ".", "..", then its entries in their order in a
    /// new block (with the checksum tail under metadata_csum); the record loses
    /// INLINE_DATA_FL and `system.data` and gains the mapping. In the caller's handle,
    /// under the directory's lock; on failure the directory is left as it was.
    pub(crate) fn uninline_dir(&self, d: &mut FsDir<'_>) -> Result<()> {
        let orig = d.inode.clone();
        let mut st = self.inline_state(d.ino, &orig)?;
        let (parent, list) = self.inline_dir_list(d.ino, &orig)?;
        let mut entries = Vec::with_capacity(list.len());
        for e in &list {
            let ft = DirFt::from_u8(e.file_type.dirent_code())
                .ok_or_else(|| corrupt(d.ino, "entry of unknown type"))?;
            entries.push((e.name.clone(), e.ino.0, ft));
        }
        let region = fx::inode_region_mut(&mut st.raw).map_err(Error::from)?;
        fx::encode_inode_region(region, &st.others)
            .map_err(|e| Error::InvalidInput(format!("inline data: {e}")))?;
        let mut inode = orig.clone();
        inode.flags &= !flags::INLINE_DATA;
        inode.block = [0u8; fi::I_BLOCK_BYTES];
        inode.size = 0;
        self.map_by_extents(&mut inode);
        d.inode = inode;
        let dir_index = self.inner.sb.has_compat(feature::COMPAT_DIR_INDEX);
        let built = (|| {
            crate::store::DirStore::append_block(d)?;
            dir_write::init_dir(d, d.ino.0, parent)?;
            for (name, ino, ft) in &entries {
                dir_write::add_new_entry(d, name, *ino, *ft, dir_index)?;
            }
            Ok(())
        })();
        if let Err(e) = built {
            // Give back the block, if it was mapped; the record was not written.
            let _ = crate::fs::inode_write::unmap_range(
                self,
                d.ino,
                &mut d.inode,
                0,
                crate::fs::map::MAX_LOGICAL,
            );
            d.inode = orig;
            d.dirty = false;
            return Err(e);
        }
        self.write_inode_raw(d.ino, &st.raw, &d.inode)?;
        d.dirty = false;
        Ok(())
    }
}
