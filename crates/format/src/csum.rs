//! crc32c in the form ext4 and jbd2 use it, and the seeds derived from the superblock.
//!
//! ext4 uses the *raw* Castagnoli CRC: reflected polynomial 0x82F63B78, no final
//! inversion, chained as `c = raw(c, bytes)`. The conventional crc32c of a buffer is
//! `raw(!0, x) ^ !0`; the `crc32c` crate computes the conventional one, so [`raw`]
//! undoes its pre- and post-inversion.

/// Raw (un-inverted) crc32c of `data` continuing from `crc`.
#[inline]
pub fn raw(crc: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!crc, data)
}

/// `raw` over several pieces in order.
pub fn raw_chain(mut crc: u32, parts: &[&[u8]]) -> u32 {
    for p in parts {
        crc = raw(crc, p);
    }
    crc
}

/// Checksum seed of the filesystem: `s_checksum_seed` when the feature
/// metadata_csum_seed is on, else `raw(!0, uuid)`.
pub fn fs_seed(uuid: &[u8; 16], checksum_seed: Option<u32>) -> u32 {
    checksum_seed.unwrap_or_else(|| raw(!0, uuid))
}

/// Per-inode seed: raw(raw(fs_seed, le32 ino), le32 generation).
pub fn inode_seed(fs_seed: u32, ino: u32, generation: u32) -> u32 {
    raw(raw(fs_seed, &ino.to_le_bytes()), &generation.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_matches_the_standard_check_value() {
        // The standard crc32c check value of "123456789" is 0xE3069283.
        assert_eq!(raw(!0, b"123456789") ^ !0, 0xE306_9283);
        assert_eq!(raw_chain(!0, &[b"1234", b"56789"]), raw(!0, b"123456789"));
    }
}
