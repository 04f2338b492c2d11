//! Partition tables (MBR with extended/logical partitions, GPT): which byte range of a
//! disk each partition is, numbered as Linux numbers them (primary MBR partitions 1-4,
//! logical ones from 5 in chain order; GPT by entry slot, 1-based).
//!
//! Owns: [`read_table`], the decoding of a table through a read function, and the
//! pure decoders under it. Used by `crate::image` (the `?partition=N` spec and
//! `rext4 info DISK`).
//!
//! Must hold: bad bytes never panic or loop — every offset read is checked against
//! the disk size, the extended-partition chain is bounded and a sector met twice is
//! refused, GPT header and entry checksums (CRC-32) are checked and the backup header
//! (last sector) is tried when the primary fails. Sector size: 512, or 4096 when the
//! GPT header is found there (a 4Kn disk).

use std::io;

/// Which kind of table a disk has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    Mbr,
    Gpt,
}

/// One partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// As Linux numbers it (sda1, sda5...).
    pub number: u32,
    pub start_bytes: u64,
    pub size_bytes: u64,
    /// Type: "Linux filesystem" (known GPT GUIDs and MBR ids), else the GUID or
    /// "0xNN".
    pub kind: String,
    /// GPT partition name (empty for MBR).
    pub name: String,
}

/// A disk's partition table.
#[derive(Debug, Clone)]
pub struct Table {
    pub kind: TableKind,
    pub sector_bytes: u64,
    pub partitions: Vec<Partition>,
}

impl Table {
    /// Partition `n`, or an error that says what the table has.
    pub fn get(&self, n: u32) -> Result<&Partition, String> {
        if let Some(p) = self.partitions.iter().find(|p| p.number == n) {
            return Ok(p);
        }
        let kind = match self.kind {
            TableKind::Mbr => "MBR",
            TableKind::Gpt => "GPT",
        };
        let have: Vec<String> = self
            .partitions
            .iter()
            .map(|p| p.number.to_string())
            .collect();
        Err(if have.is_empty() {
            format!("partition {n} does not exist (the {kind} has no partitions)")
        } else {
            format!(
                "partition {n} does not exist (the {kind} has {}: {})",
                have.len(),
                have.join(", ")
            )
        })
    }
}

/// Read the partition table of a disk of `disk_bytes` through `read(offset, buf)`.
/// `Ok(None)`: no table (no MBR signature). `Err` with `InvalidData`: a table that is
/// damaged, saying how.
pub fn read_table(
    disk_bytes: u64,
    read: &dyn Fn(u64, &mut [u8]) -> io::Result<()>,
) -> io::Result<Option<Table>> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    if disk_bytes < 512 {
        return Ok(None);
    }
    let mut mbr = [0u8; 512];
    read(0, &mut mbr)?;
    // A GPT header at LBA 1 (512-byte sectors) or at 4096 (4Kn), with or without a
    // protective MBR in front (some tools leave only the GPT).
    let entries = mbr_entries(&mbr);
    let protective = entries.iter().any(|e| e.kind == 0xEE);
    for sector in [512u64, 4096] {
        if disk_bytes < sector * 2 {
            continue;
        }
        let mut hdr = vec![0u8; 512];
        read(sector, &mut hdr)?;
        if &hdr[0..8] == b"EFI PART" {
            return read_gpt(disk_bytes, sector, read).map(Some).map_err(bad);
        }
    }
    if protective {
        // The primary header is gone: the backup may still be there.
        return read_gpt(disk_bytes, 512, read).map(Some).map_err(bad);
    }
    if mbr[510..512] != [0x55, 0xAA] {
        return Ok(None);
    }
    read_mbr(disk_bytes, &entries, read).map(Some)
}

/// An MBR (or EBR) partition entry.
#[derive(Debug, Clone, Copy)]
struct MbrEntry {
    kind: u8,
    start: u64,
    sectors: u64,
}

fn mbr_entries(sector: &[u8]) -> [MbrEntry; 4] {
    std::array::from_fn(|i| {
        let e = &sector[446 + 16 * i..446 + 16 * (i + 1)];
        MbrEntry {
            kind: e[4],
            start: u64::from(le32(&e[8..12])),
            sectors: u64::from(le32(&e[12..16])),
        }
    })
}

fn is_extended(kind: u8) -> bool {
    matches!(kind, 0x05 | 0x0F | 0x85)
}

/// The longest chain of logical partitions followed (Linux stops much earlier).
const MAX_LOGICAL: usize = 256;

fn read_mbr(
    disk_bytes: u64,
    entries: &[MbrEntry; 4],
    read: &dyn Fn(u64, &mut [u8]) -> io::Result<()>,
) -> io::Result<Table> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    let disk_sectors = disk_bytes / 512;
    let mut parts = Vec::new();
    let mut extended = None;
    for (i, e) in entries.iter().enumerate() {
        if e.kind == 0 || e.sectors == 0 {
            continue;
        }
        if is_extended(e.kind) {
            extended.get_or_insert(*e);
        }
        parts.push(Partition {
            number: i as u32 + 1,
            start_bytes: e.start * 512,
            size_bytes: e.sectors * 512,
            kind: mbr_type_name(e.kind),
            name: String::new(),
        });
    }
    if let Some(ext) = extended {
        // Each EBR: entry 0 a logical partition (start relative to this EBR), entry 1
        // the next EBR (start relative to the extended partition).
        let mut seen = std::collections::HashSet::new();
        let mut ebr = ext.start;
        let mut number = 5;
        for _ in 0..MAX_LOGICAL {
            if ebr >= disk_sectors {
                return Err(bad(format!(
                    "corrupt MBR: extended partition table at sector {ebr} is past the end \
                     of the disk ({disk_sectors} sectors)"
                )));
            }
            if !seen.insert(ebr) {
                return Err(bad(format!(
                    "corrupt MBR: the chain of logical partitions loops (sector {ebr} met \
                     twice)"
                )));
            }
            let mut s = [0u8; 512];
            read(ebr * 512, &mut s)?;
            if s[510..512] != [0x55, 0xAA] {
                return Err(bad(format!(
                    "corrupt MBR: extended partition table at sector {ebr} has no 55AA \
                     signature"
                )));
            }
            let e = mbr_entries(&s);
            if e[0].kind != 0 && e[0].sectors != 0 && !is_extended(e[0].kind) {
                parts.push(Partition {
                    number,
                    start_bytes: (ebr + e[0].start) * 512,
                    size_bytes: e[0].sectors * 512,
                    kind: mbr_type_name(e[0].kind),
                    name: String::new(),
                });
                number += 1;
            }
            if !is_extended(e[1].kind) || e[1].sectors == 0 {
                break;
            }
            ebr = ext.start + e[1].start;
        }
    }
    Ok(Table {
        kind: TableKind::Mbr,
        sector_bytes: 512,
        partitions: parts,
    })
}

fn read_gpt(
    disk_bytes: u64,
    sector: u64,
    read: &dyn Fn(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Table, String> {
    let io = |e: io::Error| format!("reading the GPT: {e}");
    let last_lba = disk_bytes / sector - 1;
    let mut primary = vec![0u8; sector as usize];
    read(sector, &mut primary).map_err(io)?;
    let primary_err = match gpt_from_header(&primary, disk_bytes, sector, read) {
        Ok(t) => return Ok(t),
        Err(e) => e,
    };
    // The backup header, in the last sector.
    let mut backup = vec![0u8; sector as usize];
    read(last_lba * sector, &mut backup).map_err(io)?;
    match gpt_from_header(&backup, disk_bytes, sector, read) {
        Ok(t) => Ok(t),
        Err(_) => Err(format!(
            "corrupt GPT: {primary_err} (and no valid backup GPT in the last sector)"
        )),
    }
}

/// Bounds on what a GPT header may ask for (the spec's minimum is 128 entries of 128
/// bytes; tools make exactly that).
const MAX_GPT_ENTRIES: u32 = 16384;

fn gpt_from_header(
    h: &[u8],
    disk_bytes: u64,
    sector: u64,
    read: &dyn Fn(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Table, String> {
    if &h[0..8] != b"EFI PART" {
        return Err("no GPT header signature".into());
    }
    let hsize = le32(&h[12..16]) as usize;
    if !(92..=h.len()).contains(&hsize) {
        return Err(format!("GPT header size {hsize} is invalid"));
    }
    let mut copy = h[..hsize].to_vec();
    copy[16..20].fill(0);
    if crc32(&copy) != le32(&h[16..20]) {
        return Err("GPT header checksum mismatch".into());
    }
    let entries_lba = le64(&h[72..80]);
    let count = le32(&h[80..84]);
    let esize = le32(&h[84..88]);
    if count > MAX_GPT_ENTRIES || !(128..=4096).contains(&esize) || !esize.is_multiple_of(8) {
        return Err(format!(
            "GPT header asks for {count} entries of {esize} bytes"
        ));
    }
    let total = u64::from(count) * u64::from(esize);
    let start = entries_lba
        .checked_mul(sector)
        .filter(|s| s.checked_add(total).is_some_and(|e| e <= disk_bytes))
        .ok_or_else(|| {
            format!("GPT entries at sector {entries_lba} are past the end of the disk")
        })?;
    let mut ent = vec![0u8; total as usize];
    read(start, &mut ent).map_err(|e| format!("reading the GPT entries: {e}"))?;
    if crc32(&ent) != le32(&h[88..92]) {
        return Err("GPT partition entries checksum mismatch".into());
    }
    let mut parts = Vec::new();
    for i in 0..count as usize {
        let e = &ent[i * esize as usize..(i + 1) * esize as usize];
        let guid: [u8; 16] = e[0..16].try_into().unwrap_or([0; 16]);
        if guid == [0; 16] {
            continue;
        }
        let first = le64(&e[32..40]);
        let last = le64(&e[40..48]);
        if last < first {
            return Err(format!(
                "GPT partition {} ends (sector {last}) before it starts (sector {first})",
                i + 1
            ));
        }
        let name: Vec<u16> = e[56..128]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .take_while(|&c| c != 0)
            .collect();
        parts.push(Partition {
            number: i as u32 + 1,
            start_bytes: first.saturating_mul(sector),
            size_bytes: (last - first + 1).saturating_mul(sector),
            kind: gpt_type_name(&guid),
            name: String::from_utf16_lossy(&name),
        });
    }
    Ok(Table {
        kind: TableKind::Gpt,
        sector_bytes: sector,
        partitions: parts,
    })
}

/// A GUID as text (the first three fields are little-endian on disk).
pub fn guid_text(g: &[u8; 16]) -> String {
    format!(
        "{:08X}-{:04X}-{:04X}-{:02X}{:02X}-{}",
        u32::from_le_bytes([g[0], g[1], g[2], g[3]]),
        u16::from_le_bytes([g[4], g[5]]),
        u16::from_le_bytes([g[6], g[7]]),
        g[8],
        g[9],
        g[10..16]
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect::<String>()
    )
}

fn gpt_type_name(g: &[u8; 16]) -> String {
    let t = guid_text(g);
    let name = match t.as_str() {
        "0FC63DAF-8483-4772-8E79-3D69D8477DE4" => "Linux filesystem",
        "C12A7328-F81F-11D2-BA4B-00A0C93EC93B" => "EFI System",
        "21686148-6449-6E6F-744E-656564454649" => "BIOS boot",
        "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F" => "Linux swap",
        "E6D6D379-F507-44C2-A23C-238F2A3DF928" => "Linux LVM",
        "A19D880F-05FC-4D3B-A006-743F0F84911E" => "Linux RAID",
        "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709" => "Linux root (x86-64)",
        "933AC7E1-2EB4-4F13-B844-0E14E2AEF915" => "Linux home",
        "BC13C2FF-59E6-4262-A352-B275FD6F7172" => "Linux extended boot",
        "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7" => "Microsoft basic data",
        _ => return t,
    };
    name.to_string()
}

fn mbr_type_name(t: u8) -> String {
    match t {
        0x83 => "Linux".into(),
        0x82 => "Linux swap".into(),
        0x8E => "Linux LVM".into(),
        0xFD => "Linux raid autodetect".into(),
        0x05 | 0x0F | 0x85 => "Extended".into(),
        0x07 => "HPFS/NTFS/exFAT".into(),
        0x0B | 0x0C => "W95 FAT32".into(),
        0xEF => "EFI (FAT-12/16/32)".into(),
        0xEE => "GPT (protective)".into(),
        _ => format!("0x{t:02x}"),
    }
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// CRC-32 (IEEE 802.3, reflected), as GPT checksums its header and entries.
pub fn crc32(data: &[u8]) -> u32 {
    const fn table() -> [u32; 256] {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    }
    const T: [u32; 256] = table();
    let mut c = !0u32;
    for &b in data {
        c = T[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    fn reader(disk: &[u8]) -> impl Fn(u64, &mut [u8]) -> io::Result<()> + '_ {
        move |off, buf| {
            let o = off as usize;
            match disk.get(o..o + buf.len()) {
                Some(s) => {
                    buf.copy_from_slice(s);
                    Ok(())
                }
                None => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "past end")),
            }
        }
    }

    fn put_mbr(s: &mut [u8], i: usize, kind: u8, start: u32, sectors: u32) {
        let e = &mut s[446 + 16 * i..446 + 16 * (i + 1)];
        e[4] = kind;
        e[8..12].copy_from_slice(&start.to_le_bytes());
        e[12..16].copy_from_slice(&sectors.to_le_bytes());
        s[510] = 0x55;
        s[511] = 0xAA;
    }

    #[test]
    fn mbr_logical_numbered_from_five_and_loops_refused() {
        let mut d = vec![0u8; 512 * 200];
        put_mbr(&mut d[..512], 0, 0x83, 1, 10);
        put_mbr(&mut d[..512], 1, 0x05, 20, 100);
        // EBR at 20: logical at 20+1, next EBR at 20+50.
        put_mbr(&mut d[20 * 512..21 * 512], 0, 0x83, 1, 9);
        put_mbr(&mut d[20 * 512..21 * 512], 1, 0x05, 50, 20);
        put_mbr(&mut d[70 * 512..71 * 512], 0, 0x82, 2, 8);
        let t = read_table(d.len() as u64, &reader(&d))
            .expect("ok")
            .expect("table");
        let n: Vec<(u32, u64)> = t
            .partitions
            .iter()
            .map(|p| (p.number, p.start_bytes / 512))
            .collect();
        assert_eq!(n, vec![(1, 1), (2, 20), (5, 21), (6, 72)]);
        assert!(t.get(7).expect_err("no 7").contains("does not exist"));
        // The second EBR points back at the first: a loop.
        put_mbr(&mut d[70 * 512..71 * 512], 1, 0x05, 0, 20);
        let e = read_table(d.len() as u64, &reader(&d)).expect_err("loop");
        assert!(e.to_string().contains("loops"), "{e}");
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 7u64;
        for _ in 0..300 {
            let mut d = vec![0u8; 512 * 40];
            for b in d.iter_mut().take(512 * 3) {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *b = (seed >> 56) as u8;
            }
            if seed.is_multiple_of(2) {
                d[512..520].copy_from_slice(b"EFI PART");
            }
            d[510] = 0x55;
            d[511] = 0xAA;
            let _ = read_table(d.len() as u64, &reader(&d));
        }
    }
}
