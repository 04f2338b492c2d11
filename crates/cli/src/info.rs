//! `rext4 info IMAGE`: the superblock in dumpe2fs -h's words and layout, so the two can
//! be compared line by line.

use std::fmt::Write;

use rext4::format::jbd2;
use rext4::format::superblock::{feature, Superblock};
use rext4::Fs;

use crate::timefmt::ctime;

fn uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn features(sb: &Superblock) -> String {
    // dumpe2fs order: compat, incompat, ro_compat, each by bit.
    let mut v = feature::names(sb.feature_compat, feature::COMPAT_NAMES, "C");
    v.extend(feature::names(
        sb.feature_incompat,
        feature::INCOMPAT_NAMES,
        "I",
    ));
    v.extend(feature::names(
        sb.feature_ro_compat,
        feature::RO_COMPAT_NAMES,
        "R",
    ));
    v.join(" ")
}

fn hash_name(v: u8) -> &'static str {
    match v {
        0 => "legacy",
        1 => "half_md4",
        2 => "tea",
        _ => "unknown",
    }
}

fn time_or_na(t: i64) -> String {
    if t == 0 {
        "n/a".into()
    } else {
        ctime(t)
    }
}

pub fn render(fs: &Fs) -> String {
    let sb = &fs.superblock();
    let mut o = String::new();
    let mut line = |k: &str, v: String| {
        let _ = writeln!(o, "{:<26}{v}", format!("{k}:"));
    };
    let name = cstr(&sb.volume_name);
    line(
        "Filesystem volume name",
        if name.is_empty() {
            "<none>".into()
        } else {
            name
        },
    );
    let lm = cstr(&sb.last_mounted);
    line(
        "Last mounted on",
        if lm.is_empty() {
            "<not available>".into()
        } else {
            lm
        },
    );
    line("Filesystem UUID", uuid(&sb.uuid));
    line("Filesystem magic number", "0xEF53".into());
    line(
        "Filesystem revision #",
        format!(
            "{} ({})",
            sb.rev_level,
            if sb.rev_level == 0 {
                "original"
            } else {
                "dynamic"
            }
        ),
    );
    line("Filesystem features", features(sb));
    let mut flags = String::new();
    if sb.flags & 1 != 0 {
        flags.push_str("signed_directory_hash ");
    }
    if sb.flags & 2 != 0 {
        flags.push_str("unsigned_directory_hash ");
    }
    if sb.flags & 4 != 0 {
        flags.push_str("test_filesystem ");
    }
    line("Filesystem flags", flags);
    let mut mo = Vec::new();
    for (bit, n) in [(0x4, "user_xattr"), (0x8, "acl"), (0x400, "nobarrier")] {
        if sb.default_mount_opts & bit != 0 {
            mo.push(n);
        }
    }
    line(
        "Default mount options",
        if mo.is_empty() {
            "(none)".into()
        } else {
            mo.join(" ")
        },
    );
    let state = match (sb.state & 1 != 0, sb.state & 2 != 0) {
        (true, false) => "clean",
        (true, true) => "clean with errors",
        (false, false) => "not clean",
        (false, true) => "not clean with errors",
    };
    line("Filesystem state", state.into());
    let errors = match sb.errors {
        1 => "Continue",
        2 => "Remount read-only",
        3 => "Panic",
        _ => "Unknown (continue)",
    };
    line("Errors behavior", errors.into());
    let os = ["Linux", "Hurd", "Masix", "FreeBSD", "Lites"];
    line(
        "Filesystem OS type",
        os.get(sb.creator_os as usize)
            .unwrap_or(&"(unknown os)")
            .to_string(),
    );
    line("Inode count", sb.inodes_count.to_string());
    line("Block count", sb.blocks_count.to_string());
    line("Reserved block count", sb.r_blocks_count.to_string());
    if sb.overhead_clusters != 0 {
        line("Overhead clusters", sb.overhead_clusters.to_string());
    }
    line("Free blocks", sb.free_blocks_count.to_string());
    line("Free inodes", sb.free_inodes_count.to_string());
    line("First block", sb.first_data_block.to_string());
    line("Block size", sb.block_size().to_string());
    // dumpe2fs names the unit a cluster with bigalloc, a fragment without.
    let bigalloc = sb.has_ro_compat(feature::RO_COMPAT_BIGALLOC);
    line(
        if bigalloc {
            "Cluster size"
        } else {
            "Fragment size"
        },
        (1024u64 << sb.log_cluster_size.min(20)).to_string(),
    );
    if sb.has_incompat(feature::INCOMPAT_64BIT) {
        line("Group descriptor size", sb.desc_size.to_string());
    }
    if sb.reserved_gdt_blocks != 0 {
        line("Reserved GDT blocks", sb.reserved_gdt_blocks.to_string());
    }
    line("Blocks per group", sb.blocks_per_group.to_string());
    line(
        if bigalloc {
            "Clusters per group"
        } else {
            "Fragments per group"
        },
        sb.clusters_per_group.to_string(),
    );
    line("Inodes per group", sb.inodes_per_group.to_string());
    let ipb = u64::from(sb.block_size()) / u64::from(sb.inode_size.max(1));
    line(
        "Inode blocks per group",
        (u64::from(sb.inodes_per_group) / ipb.max(1)).to_string(),
    );
    if sb.has_incompat(feature::INCOMPAT_FLEX_BG) {
        line(
            "Flex block group size",
            (1u64 << sb.log_groups_per_flex.min(31)).to_string(),
        );
    }
    line("Filesystem created", time_or_na(sb.mkfs_time));
    line("Last mount time", time_or_na(sb.mtime));
    line("Last write time", time_or_na(sb.wtime));
    line("Mount count", sb.mnt_count.to_string());
    line("Maximum mount count", sb.max_mnt_count.to_string());
    line("Last checked", time_or_na(sb.lastcheck));
    line(
        "Check interval",
        if sb.checkinterval == 0 {
            "0 (<none>)".into()
        } else {
            sb.checkinterval.to_string()
        },
    );
    if sb.kbytes_written != 0 {
        let kb = sb.kbytes_written;
        let s = if kb < 8192 {
            format!("{kb} kB")
        } else if kb < 8192 * 1024 {
            format!("{} MB", kb.div_ceil(1024))
        } else {
            format!("{} GB", kb.div_ceil(1024 * 1024))
        };
        line("Lifetime writes", s);
    }
    let user = if sb.def_resuid == 0 {
        " (user root)".to_string()
    } else {
        String::new()
    };
    line("Reserved blocks uid", format!("{}{user}", sb.def_resuid));
    let group = if sb.def_resgid == 0 {
        " (group root)".to_string()
    } else {
        String::new()
    };
    line("Reserved blocks gid", format!("{}{group}", sb.def_resgid));
    line("First inode", sb.first_ino.to_string());
    // dumpe2fs prints a tab here; keep the same bytes for easy diffing.
    let _ = writeln!(o, "Inode size:\t          {}", sb.inode_size);
    let mut line = |k: &str, v: String| {
        let _ = writeln!(o, "{:<26}{v}", format!("{k}:"));
    };
    if sb.min_extra_isize != 0 || sb.want_extra_isize != 0 {
        line("Required extra isize", sb.min_extra_isize.to_string());
        line("Desired extra isize", sb.want_extra_isize.to_string());
    }
    if sb.journal_inum != 0 {
        line("Journal inode", sb.journal_inum.to_string());
    }
    line(
        "Default directory hash",
        hash_name(sb.def_hash_version).into(),
    );
    let mut seed = [0u8; 16];
    for (i, w) in sb.hash_seed.iter().enumerate() {
        seed[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
    }
    line("Directory Hash Seed", uuid(&seed));
    if sb.jnl_backup_type == 1 {
        line("Journal backup", "inode blocks".into());
    }
    if sb.has_incompat(feature::INCOMPAT_MMP) {
        line("MMP block number", sb.mmp_block.to_string());
        line("MMP update interval", sb.mmp_interval.to_string());
    }
    if sb.metadata_csum() {
        line(
            "Checksum type",
            if sb.checksum_type == 1 {
                "crc32c".into()
            } else {
                "unknown".into()
            },
        );
        line("Checksum", format!("{:#010x}", sb.checksum));
    }
    if sb.has_incompat(feature::INCOMPAT_CSUM_SEED) {
        line("Checksum seed", format!("{:#010x}", sb.checksum_seed));
    }
    if sb.has_incompat(feature::INCOMPAT_CASEFOLD) {
        use rext4::format::casefold::{encoding_name, ENCODING_FLAG_STRICT};
        let name = encoding_name(sb.encoding)
            .map_or_else(|| format!("ENCODING_{}", sb.encoding), str::to_string);
        line("Character encoding", name);
        // dumpe2fs -h prints no flags; e2fsprogs names the one flag "strict".
        if sb.encoding_flags & ENCODING_FLAG_STRICT != 0 {
            line("Character encoding flags", "strict".into());
        }
    }
    if sb.has_compat(feature::COMPAT_ORPHAN_FILE) {
        line("Orphan file inode", sb.orphan_file_inum.to_string());
    }
    if sb.journal_inum != 0 {
        match journal(fs, sb.journal_inum) {
            Ok(j) => o.push_str(&j),
            Err(e) => {
                let _ = writeln!(o, "Journal superblock unreadable: {e}");
            }
        }
    }
    match fs.mmp_block() {
        Ok(Some(m)) => o.push_str(&mmp_block(&m)),
        Ok(None) => {}
        Err(e) => {
            let _ = writeln!(o, "MMP block unreadable: {e}");
        }
    }
    // dumpe2fs -h ends with an empty line.
    o.push('\n');
    o
}

/// C's `%#08x`: "0x" and zero padding within eight characters; 0 has no prefix.
fn hash_x08(v: u32) -> String {
    if v == 0 {
        "00000000".into()
    } else {
        format!("{v:#08x}")
    }
}

/// dumpe2fs's MMP_block section.
fn mmp_block(m: &rext4::format::mmp::MmpBlock) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "MMP_block:");
    let _ = writeln!(o, "    mmp_magic: {:#x}", rext4::format::mmp::MAGIC);
    let _ = writeln!(o, "    mmp_check_interval: {}", m.check_interval);
    let _ = writeln!(o, "    mmp_sequence: {}", hash_x08(m.seq));
    let _ = writeln!(o, "    mmp_update_date: {}", ctime(m.time as i64));
    let _ = writeln!(o, "    mmp_update_time: {}", m.time);
    let _ = writeln!(o, "    mmp_node_name: {}", m.nodename_text());
    let _ = writeln!(o, "    mmp_device_name: {}", m.bdevname_text());
    o
}

/// e2fsprogs' names for jbd2 feature bits.
fn journal_feature_names(j: &jbd2::JournalSuperblock) -> Vec<String> {
    let mut v = Vec::new();
    let table: [(u32, u32, &str); 7] = [
        (0, jbd2::COMPAT_CHECKSUM, "journal_checksum"),
        (1, jbd2::INCOMPAT_REVOKE, "journal_incompat_revoke"),
        (1, jbd2::INCOMPAT_64BIT, "journal_64bit"),
        (1, jbd2::INCOMPAT_ASYNC_COMMIT, "journal_async_commit"),
        (1, jbd2::INCOMPAT_CSUM_V2, "journal_checksum_v2"),
        (1, jbd2::INCOMPAT_CSUM_V3, "journal_checksum_v3"),
        (1, jbd2::INCOMPAT_FAST_COMMIT, "journal_fast_commit"),
    ];
    for (word, bit, name) in table {
        let w = if word == 0 {
            j.feature_compat
        } else {
            j.feature_incompat
        };
        if w & bit != 0 {
            v.push(name.to_string());
        }
    }
    let known_c = jbd2::COMPAT_CHECKSUM;
    let known_i = table.iter().filter(|t| t.0 == 1).fold(0, |a, t| a | t.1);
    for i in 0..32 {
        if j.feature_compat & !known_c & (1 << i) != 0 {
            v.push(format!("FEATURE_C{i}"));
        }
    }
    for i in 0..32 {
        if j.feature_incompat & !known_i & (1 << i) != 0 {
            v.push(format!("FEATURE_I{i}"));
        }
    }
    for i in 0..32 {
        if j.feature_ro_compat & (1 << i) != 0 {
            v.push(format!("FEATURE_R{i}"));
        }
    }
    v
}

/// The journal section of dumpe2fs -h (internal journals).
fn journal(fs: &Fs, ino: u32) -> rext4::Result<String> {
    let f = fs.open_ino(rext4::Ino(ino))?;
    let mut b = vec![0u8; jbd2::SB_SIZE];
    f.read_exact_at(&mut b, 0)?;
    let j = jbd2::JournalSuperblock::decode(&b)?;
    let mut o = String::new();
    let mut line = |k: &str, v: String| {
        let _ = writeln!(o, "{:<26}{v}", format!("{k}:"));
    };
    let names = journal_feature_names(&j);
    line(
        "Journal features",
        if names.is_empty() {
            "(none)".into()
        } else {
            names.join(" ")
        },
    );
    let kb = u64::from(j.blocksize) * u64::from(j.maxlen) / 1024;
    line(
        "Total journal size",
        if kb < 8192 {
            format!("{kb}k")
        } else {
            format!("{}M", kb >> 10)
        },
    );
    line("Total journal blocks", j.maxlen.to_string());
    let fc = j.num_fc_blocks();
    line(
        "Max transaction length",
        j.maxlen.saturating_sub(fc).to_string(),
    );
    line("Fast commit length", fc.to_string());
    if j.first != 1 {
        line("Journal first block", j.first.to_string());
    }
    line("Journal sequence", format!("{:#010x}", j.sequence));
    line("Journal start", j.start.to_string());
    if j.nr_users != 1 {
        line("Journal number of users", j.nr_users.to_string());
    }
    let f = j.features();
    if f.csum_v2or3() {
        let t = if j.checksum_type == jbd2::CHECKSUM_TYPE_CRC32C {
            "crc32c"
        } else {
            "unknown"
        };
        line("Journal checksum type", t.into());
        line("Journal checksum", format!("{:#010x}", j.checksum));
    }
    if j.errno != 0 {
        line("Journal errno", j.errno.to_string());
    }
    Ok(o)
}

/// `rext4 info --stats`: what the open cost on the device (and, for a filesystem that
/// has been used, what its allocations read).
pub fn render_stats(fs: &Fs) -> String {
    let st = fs.io_stats();
    let mut s = String::new();
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "Reads at open:            {} ({} KiB)",
        st.at_open.reads,
        st.at_open.read_bytes / 1024
    );
    let _ = writeln!(
        s,
        "Writes at open:           {} ({} KiB), {} flushes",
        st.at_open.writes,
        st.at_open.write_bytes / 1024,
        st.at_open.flushes
    );
    let _ = writeln!(s, "Block allocations:        {}", st.allocations);
    let _ = writeln!(s, "Bitmaps read singly:      {}", st.bitmaps_read);
    let _ = writeln!(
        s,
        "Bitmaps prefetched:       {} in {} requests",
        st.bitmaps_prefetched, st.prefetch_requests
    );
    s
}

/// `rext4 info DISK` of a disk that holds no ext4 at offset 0 but has a partition
/// table: its partitions (number, start, size, type, name) and which hold ext4.
pub fn render_disk(shown: &str, disk: &rext4::image::DiskInfo) -> Option<String> {
    let table = disk.table.as_ref()?;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "Disk: {shown} ({}, {} bytes)",
        disk.format,
        disk.disk.size_bytes()
    );
    let kind = match table.kind {
        rext4::device::parttable::TableKind::Mbr => "MBR (dos)",
        rext4::device::parttable::TableKind::Gpt => "GPT",
    };
    let _ = writeln!(
        o,
        "Partition table: {kind}, {}-byte sectors",
        table.sector_bytes
    );
    let _ = writeln!(
        o,
        "{:<7}{:>14}{:>14}  {:<22}{:<14}Filesystem",
        "Number", "Start", "Size", "Type", "Name"
    );
    let base = spec_base(shown);
    for p in &table.partitions {
        let fs = partition_fs(&*disk.disk, p.start_bytes, p.size_bytes);
        let _ = writeln!(
            o,
            "{:<7}{:>14}{:>14}  {:<22}{:<14}{}",
            p.number,
            p.start_bytes,
            p.size_bytes,
            p.kind,
            if p.name.is_empty() { "-" } else { &p.name },
            fs.map(|f| format!("{f}: {base}?partition={}", p.number))
                .unwrap_or_else(|| "-".into())
        );
    }
    Some(o)
}

/// The spec text without its fields (what `?partition=N` goes after).
fn spec_base(shown: &str) -> &str {
    match rext4::ImageSpec::parse(shown) {
        Ok(s) if !s.is_plain() => shown.rsplit_once('?').map_or(shown, |(b, _)| b),
        _ => shown,
    }
}

/// "ext4" (with its label) when the partition holds an ext4 superblock.
fn partition_fs(disk: &dyn rext4::device::BlockDevice, start: u64, size: u64) -> Option<String> {
    if size < 2048 {
        return None;
    }
    let mut raw = vec![0u8; 1024];
    disk.read_at(&mut raw, start.checked_add(1024)?).ok()?;
    let sb = Superblock::decode(&raw).ok()?;
    let label = cstr(&sb.volume_name);
    let recover = if sb.has_incompat(feature::INCOMPAT_RECOVER) {
        ", journal needs recovery"
    } else {
        ""
    };
    Some(if label.is_empty() {
        format!(
            "ext4 ({} blocks of {}{recover})",
            sb.blocks_count,
            sb.block_size()
        )
    } else {
        format!(
            "ext4 \"{label}\" ({} blocks of {}{recover})",
            sb.blocks_count,
            sb.block_size()
        )
    })
}
