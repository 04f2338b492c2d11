//! Shared helpers for the CLI's integration tests: running the `rext4` binary, and
//! crafting corrupt-but-plausible images by patching raw directory blocks of images
//! that mkfs.ext4 and debugfs built.
//!
//! Directory patches keep every record well formed (name_len and rec_len unchanged) and,
//! unless told otherwise, recompute the dirent-tail checksum, so that the block passes
//! verification and what the test exercises is the engine's and the CLI's handling of
//! the names and inode numbers themselves.

#![allow(dead_code)]

use std::ffi::{OsStr, OsString};
use std::fs::OpenOptions;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

use rext4_format::csum;
use rext4_format::dir;
use rext4_format::superblock::Superblock;
use rext4_testkit::debugfs_r;

/// Result of one run of the binary.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Run {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Runs `rext4 ARGS...` with stdin closed and returns its exit code and output.
pub fn rext4<S: AsRef<OsStr>>(args: &[S]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_rext4"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run the rext4 binary");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `IMAGE:PATH` as one argument.
pub fn spec(img: &Path, path: &str) -> OsString {
    let mut s = img.as_os_str().to_os_string();
    s.push(":");
    s.push(path);
    s
}

/// The primary superblock of an image file, verified.
pub fn read_superblock(img: &Path) -> Superblock {
    let f = std::fs::File::open(img).expect("open image");
    let mut buf = vec![0u8; 1024];
    f.read_exact_at(&mut buf, 1024).expect("read superblock");
    Superblock::decode(&buf).expect("superblock decodes")
}

/// Finds "KEY: <number>" in debugfs output.
fn field(text: &str, key: &str) -> Option<u64> {
    let at = text.find(key)?;
    text[at + key.len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Inode number and generation of `path` (from `debugfs -R "stat PATH"`).
pub fn inode_of(img: &Path, path: &str) -> (u32, u32) {
    let out = debugfs_r(img, &format!("stat {path}")).expect("debugfs stat");
    let ino = field(&out, "Inode:").unwrap_or_else(|| panic!("no inode in:\n{out}"));
    let generation = field(&out, "Generation:").unwrap_or_else(|| panic!("no gen in:\n{out}"));
    (ino as u32, generation as u32)
}

/// Physical blocks of `path` (from `debugfs -R "blocks PATH"`).
pub fn blocks_of(img: &Path, path: &str) -> Vec<u64> {
    let out = debugfs_r(img, &format!("blocks {path}")).expect("debugfs blocks");
    let blocks: Vec<u64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(!blocks.is_empty(), "no blocks for {path}: {out}");
    blocks
}

/// Applies `edit(block, entry_offset)` to the live entry called `name` in the (linear)
/// directory `dir` of `img`, then, on a metadata_csum image and if `fix_csum`, stores
/// the block's new dirent-tail checksum. Panics if the entry is not found.
pub fn edit_entry(
    img: &Path,
    dir_path: &str,
    name: &[u8],
    fix_csum: bool,
    edit: impl FnOnce(&mut [u8], usize),
) {
    let sb = read_superblock(img);
    let bs = u64::from(sb.block_size());
    let has_csum = sb.metadata_csum();
    let (ino, generation) = inode_of(img, dir_path);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .expect("open image rw");
    for phys in blocks_of(img, dir_path) {
        let mut block = vec![0u8; bs as usize];
        f.read_exact_at(&mut block, phys * bs)
            .expect("read dir block");
        let found = dir::entries(&block, has_csum)
            .map(|e| e.expect("directory block parses before the patch"))
            .find(|e| e.is_live() && e.name == name)
            .map(|e| e.offset);
        let Some(off) = found else { continue };
        edit(&mut block, off);
        if has_csum && fix_csum {
            let seed = csum::inode_seed(sb.csum_seed(), ino, generation);
            dir::set_leaf_csum(&mut block, seed).expect("dirent tail present");
        }
        f.write_all_at(&block, phys * bs).expect("write dir block");
        return;
    }
    panic!(
        "entry {:?} not found in {dir_path}",
        OsStr::from_bytes(name)
    );
}

/// Renames entry `old` of `dir_path` to `new` in place (same length, so name_len and
/// rec_len stay valid).
pub fn rename_entry(img: &Path, dir_path: &str, old: &[u8], new: &[u8], fix_csum: bool) {
    assert_eq!(old.len(), new.len(), "in-place rename keeps the length");
    edit_entry(img, dir_path, old, fix_csum, |b, off| {
        b[off + 8..off + 8 + new.len()].copy_from_slice(new);
    });
}

/// Points entry `name` of `dir_path` at inode `ino` with dirent file type `ft`.
pub fn retarget_entry(img: &Path, dir_path: &str, name: &[u8], ino: u32, ft: u8, fix_csum: bool) {
    edit_entry(img, dir_path, name, fix_csum, |b, off| {
        b[off..off + 4].copy_from_slice(&ino.to_le_bytes());
        b[off + 7] = ft;
    });
}
