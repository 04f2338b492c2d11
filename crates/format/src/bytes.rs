//! Bounds-checked little-endian field access.
//!
//! Decoders call [`need`] once with the structure's size and then read fixed offsets
//! with the `le*`/`set_le*` helpers, which index only inside the checked length and
//! therefore cannot panic. Offsets are the format notes' byte offsets.

use crate::{FormatError, Result};

/// Check that `buf` holds at least `len` bytes of structure `what`.
#[inline]
pub fn need(buf: &[u8], len: usize, what: &'static str) -> Result<()> {
    if buf.len() < len {
        Err(FormatError::Truncated {
            what,
            need: len,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

/// Read `N` bytes at `off`, or zeros when the buffer is too short. Decoders check the
/// length first with [`need`], so the zero fallback is never observed by valid callers;
/// it exists so that a wrong offset degrades to garbage-in-garbage-out, not a panic.
#[inline]
pub fn arr<const N: usize>(buf: &[u8], off: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(s) = buf.get(off..off.saturating_add(N)) {
        out.copy_from_slice(s);
    }
    out
}

#[inline]
pub fn u8_at(buf: &[u8], off: usize) -> u8 {
    buf.get(off).copied().unwrap_or(0)
}
#[inline]
pub fn le16(buf: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(arr(buf, off))
}
#[inline]
pub fn le32(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(arr(buf, off))
}
#[inline]
pub fn le64(buf: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(arr(buf, off))
}

/// Write `src` at `off`; bytes that would fall outside `buf` are dropped.
#[inline]
pub fn put(buf: &mut [u8], off: usize, src: &[u8]) {
    if let Some(d) = buf.get_mut(off..off.saturating_add(src.len())) {
        d.copy_from_slice(src);
    }
}
#[inline]
pub fn set_u8(buf: &mut [u8], off: usize, v: u8) {
    put(buf, off, &[v]);
}
#[inline]
pub fn set_le16(buf: &mut [u8], off: usize, v: u16) {
    put(buf, off, &v.to_le_bytes());
}
#[inline]
pub fn set_le32(buf: &mut [u8], off: usize, v: u32) {
    put(buf, off, &v.to_le_bytes());
}
#[inline]
pub fn set_le64(buf: &mut [u8], off: usize, v: u64) {
    put(buf, off, &v.to_le_bytes());
}

/// Combine a lo32 and a hi32 half into a u64.
#[inline]
pub fn lohi(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// The bytes of `buf` in `off..off+len`, or `None` if that range is out of bounds.
#[inline]
pub fn slice(buf: &[u8], off: usize, len: usize) -> Option<&[u8]> {
    buf.get(off..off.checked_add(len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_reads_are_zero_not_panics() {
        let b = [1u8, 2, 3];
        assert_eq!(le32(&b, 0), 0);
        assert_eq!(le16(&b, 1), 0x0302);
        assert_eq!(le64(&b, usize::MAX), 0);
        assert!(slice(&b, usize::MAX, 2).is_none());
        let mut m = [0u8; 2];
        set_le32(&mut m, 0, 7);
        assert_eq!(m, [0, 0]);
    }
}
