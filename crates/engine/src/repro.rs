//! Reproducible images: `SOURCE_DATE_EPOCH` and values derived from a seed.
//!
//! Owns: reading `SOURCE_DATE_EPOCH` (reproducible-builds.org's variable: whole
//! seconds since the epoch), the stable hash every derived value comes from
//! ([`derive`]: a UUID or hash seed from `mkfs --seed`), and [`Repro`], the state of
//! an [`crate::Fs`] opened with [`crate::FsOptions::source_date_epoch`] (its clock
//! and its inode generation numbers).
//!
//! Must hold: what this module derives depends only on its inputs, never on the host,
//! the time, the process or the Rust version (std's hashers promise no stable
//! output, so the hash here is written out: FNV-1a folded through splitmix64's
//! finalizer). Changing it changes every image a seed makes, so it does not change.
//!
//! What reproducible mode means for an open filesystem (the engine's side; callers:
//! `Fs::open_*`, the allocator, `new_inode`, setattr): every time a change stamps is
//! the epoch (nanoseconds 0), times a caller sets are clamped to it (newer ones become
//! it, older ones stay, as reproducible-builds.org specifies), the superblock's and the
//! journal's times are the epoch, generation numbers follow from the image's UUID and
//! hash seed and its mount count, and nothing that runs on a timer (the periodic and
//! early commits, the writeback thread, the bitmap prefetcher) or depends on what the
//! caches hold (the allocator's preference for bitmaps already in memory) decides
//! where anything goes. So the same changes made to the same image give the same bytes.
//! No lock: `Repro` is a counter and constants.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// The environment variable (reproducible-builds.org).
pub const SOURCE_DATE_EPOCH: &str = "SOURCE_DATE_EPOCH";

/// `SOURCE_DATE_EPOCH` from the environment: `None` when unset or empty, an error
/// when it is not a whole number of seconds (the specification asks tools to fail
/// then rather than go on unreproducibly).
pub fn source_date_epoch() -> Result<Option<i64>> {
    match std::env::var_os(SOURCE_DATE_EPOCH) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => parse_epoch(&v.to_string_lossy()).map(Some),
    }
}

/// Parse a `SOURCE_DATE_EPOCH` value: ASCII digits only (no sign, no spaces), as the
/// specification defines it, within the range ext4's times can hold.
pub fn parse_epoch(v: &str) -> Result<i64> {
    let bad = || {
        Error::InvalidInput(format!(
            "{SOURCE_DATE_EPOCH} is not a number of seconds since 1970: '{v}'"
        ))
    };
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let t: i64 = v.parse().map_err(|_| bad())?;
    // ext4's extra epoch bits reach the year 2446.
    if t > (1i64 << 34) - 1 {
        return Err(bad());
    }
    Ok(t)
}

/// splitmix64's finalizer: a bijection of u64 that mixes every bit into every bit.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of `parts` (each length-prefixed, so ("ab","c") and
/// ("a","bc") differ).
pub fn hash64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    };
    for p in parts {
        for b in (p.len() as u64).to_le_bytes() {
            eat(b);
        }
        for &b in *p {
            eat(b);
        }
    }
    mix64(h)
}

/// 16 bytes derived from `seed` for the purpose `what` ("uuid", "hash_seed"...),
/// shaped as a random (version 4) UUID, as a random one would be.
pub fn derive(seed: &[u8], what: &str) -> [u8; 16] {
    let a = hash64(&[b"rext4 seed", what.as_bytes(), seed]);
    let b = mix64(a ^ hash64(&[seed, what.as_bytes(), b"second half"]));
    let mut u = [0u8; 16];
    u[..8].copy_from_slice(&a.to_le_bytes());
    u[8..].copy_from_slice(&b.to_le_bytes());
    u[6] = (u[6] & 0x0F) | 0x40;
    u[8] = (u[8] & 0x3F) | 0x80;
    u
}

/// The reproducible state of an open filesystem (see the module note).
#[derive(Debug)]
pub struct Repro {
    /// `SOURCE_DATE_EPOCH`: the time of every change, the bound of every time set.
    pub epoch: i64,
    /// Where this open's generation numbers start: from the image's identity and its
    /// mount count, so each session's differ but every run's are the same.
    gen_seed: u64,
    gen_next: AtomicU64,
}

impl Repro {
    /// The state for an image with this UUID, hash seed and mount count (as opened).
    pub fn new(epoch: i64, uuid: &[u8; 16], hash_seed: &[u8], mnt_count: u16) -> Repro {
        Repro {
            epoch,
            gen_seed: hash64(&[b"generation", uuid, hash_seed, &mnt_count.to_le_bytes()]),
            gen_next: AtomicU64::new(0),
        }
    }

    /// The next inode generation number: the order of creates decides it, nothing
    /// else.
    pub fn next_generation(&self) -> u32 {
        let n = self.gen_next.fetch_add(1, Ordering::Relaxed);
        mix64(self.gen_seed ^ n) as u32
    }

    /// The time of a change: the epoch.
    pub fn now(&self) -> rext4_format::inode::Timestamp {
        rext4_format::inode::Timestamp {
            sec: self.epoch,
            nsec: 0,
        }
    }

    /// `t`, or the epoch when `t` is later (a time set by a caller).
    pub fn clamp(&self, t: rext4_format::inode::Timestamp) -> rext4_format::inode::Timestamp {
        if t.sec >= self.epoch {
            self.now()
        } else {
            t
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_parse_as_the_specification_says() {
        assert_eq!(parse_epoch("0").ok(), Some(0));
        assert_eq!(parse_epoch("1700000000").ok(), Some(1_700_000_000));
        for bad in ["", "-1", " 1", "1.5", "0x10", "12a", "99999999999999999999"] {
            assert!(parse_epoch(bad).is_err(), "{bad:?}");
        }
    }

    /// The derivation is fixed: these values are what every rext4 gives (a change
    /// here changes every image built with --seed).
    #[test]
    fn derived_values_are_stable() {
        let u = derive(b"abc", "uuid");
        assert_eq!(u, derive(b"abc", "uuid"));
        assert_ne!(u, derive(b"abd", "uuid"));
        assert_ne!(u, derive(b"abc", "hash_seed"));
        assert_eq!(u[6] >> 4, 4);
        assert_eq!(u[8] >> 6, 2);
        assert_ne!(hash64(&[b"ab", b"c"]), hash64(&[b"a", b"bc"]));
        assert_eq!(hash64(&[b"rext4"]), 0x9B41_8B6B_C2EC_6005);
    }

    #[test]
    fn times_clamp_to_the_epoch_and_generations_follow_the_seed() {
        let r = Repro::new(1000, &[1; 16], &[2; 16], 3);
        let t = |sec, nsec| rext4_format::inode::Timestamp { sec, nsec };
        assert_eq!(r.clamp(t(999, 5)), t(999, 5));
        assert_eq!(r.clamp(t(1000, 5)), t(1000, 0));
        assert_eq!(r.clamp(t(5000, 0)), t(1000, 0));
        let a: Vec<u32> = (0..4).map(|_| r.next_generation()).collect();
        let r2 = Repro::new(1000, &[1; 16], &[2; 16], 3);
        let b: Vec<u32> = (0..4).map(|_| r2.next_generation()).collect();
        assert_eq!(a, b);
        let r3 = Repro::new(1000, &[1; 16], &[2; 16], 4);
        assert_ne!(a[0], r3.next_generation());
    }
}
