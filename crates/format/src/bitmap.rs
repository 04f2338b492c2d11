//! Block and inode bitmaps (format notes §2.3).
//!
//! A bitmap occupies one block; bit i set means block/inode i of the group is in use.
//! Checksums cover only the first N/8 bytes (N = clusters or inodes per group) and do
//! not include the group number: raw(csum_seed, bitmap[0..N/8]); the low 16 bits are
//! stored in the descriptor's `*_bitmap_csum_lo`, the high 16 with 64-byte descriptors.
//! Padding bits past the group's end must be set.

use crate::csum;
use crate::{ensure, Result};

pub fn test(b: &[u8], i: u64) -> bool {
    usize::try_from(i / 8)
        .ok()
        .and_then(|ix| b.get(ix))
        .is_some_and(|byte| byte & (1 << (i % 8)) != 0)
}

pub fn set(b: &mut [u8], i: u64, on: bool) {
    if let Some(byte) = usize::try_from(i / 8).ok().and_then(|ix| b.get_mut(ix)) {
        if on {
            *byte |= 1 << (i % 8);
        } else {
            *byte &= !(1 << (i % 8));
        }
    }
}

/// Number of set bits among the first `n` bits.
pub fn count_set(b: &[u8], n: u64) -> u64 {
    let full = usize::try_from(n / 8).unwrap_or(usize::MAX).min(b.len());
    let mut c: u64 = b[..full].iter().map(|x| u64::from(x.count_ones())).sum();
    for i in (full as u64 * 8)..n {
        c += u64::from(test(b, i));
    }
    c
}

/// Checksum over the first `nbits / 8` bytes.
pub fn compute_csum(b: &[u8], nbits: u32, csum_seed: u32) -> u32 {
    let len = (nbits / 8) as usize;
    csum::raw(csum_seed, b.get(..len).unwrap_or(b))
}

/// Verify a bitmap checksum. `desc_csum` is as stored (hi half 0 with 32-byte
/// descriptors, in which case only the low 16 bits are compared).
pub fn verify_csum(b: &[u8], nbits: u32, csum_seed: u32, desc_csum: u32, wide: bool) -> Result<()> {
    let want = compute_csum(b, nbits, csum_seed);
    let want = if wide { want } else { want & 0xFFFF };
    ensure(want == desc_csum, || {
        format!("bitmap checksum {desc_csum:#x}, computed {want:#x}")
    })
}

/// Check that bits `valid..total` are all set (padding).
pub fn verify_padding(b: &[u8], valid: u64, total: u64) -> Result<()> {
    for i in valid..total {
        ensure(test(b, i), || format!("bitmap padding bit {i} is not set"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_and_counts() {
        let mut b = vec![0u8; 16];
        set(&mut b, 3, true);
        set(&mut b, 9, true);
        set(&mut b, 1000, true);
        assert!(test(&b, 3) && test(&b, 9) && !test(&b, 4) && !test(&b, 1000));
        assert_eq!(count_set(&b, 10), 2);
        assert_eq!(count_set(&b, 9), 1);
        set(&mut b, 3, false);
        assert_eq!(count_set(&b, 128), 1);
        assert!(verify_padding(&[0xF0], 4, 8).is_ok());
        assert!(verify_padding(&[0x70], 4, 8).is_err());
    }
}
