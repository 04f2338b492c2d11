//! A fast hasher for integer keys: block and inode numbers, in the maps every
//! metadata operation touches (the buffer cache's shards, the inode cache, pins, inode
//! grace, the page cache's files).
//!
//! std's default (SipHash-1-3) costs tens of nanoseconds per key and was about 5% of
//! a create or unlink. An integer needs no byte-stream hashing: one multiply whose
//! 128-bit product is folded (high half XOR low half) mixes every input bit into both
//! the low bits hashbrown and papaya index by and the high bits they tag entries with.
//! The multiplier is a random odd number per process, so which numbers share a bucket
//! is not known in advance (an image chooses its block numbers, but not the seed).
//! Names (the dentry cache) keep std's keyed SipHash: a name is free-form input.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

/// Builds [`IntHasher`]s with this process's seed.
#[derive(Clone, Copy, Debug)]
pub struct IntHash {
    seed: u64,
}

impl Default for IntHash {
    fn default() -> IntHash {
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed = *SEED.get_or_init(|| {
            // std's RandomState is seeded from the OS; hash a constant with it.
            std::collections::hash_map::RandomState::new().hash_one(0x0072_6578_7434_u64) | 1
        });
        IntHash { seed }
    }
}

impl BuildHasher for IntHash {
    type Hasher = IntHasher;
    #[inline]
    fn build_hasher(&self) -> IntHasher {
        IntHasher {
            h: 0,
            seed: self.seed,
        }
    }
}

/// The 128-bit product of `a` and `b`, its halves folded together.
#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// The hasher: integers mix in with one folded multiply each; other input (not used
/// by the maps it serves, but allowed) eight bytes at a time.
#[derive(Clone, Copy, Debug)]
pub struct IntHasher {
    h: u64,
    seed: u64,
}

impl IntHasher {
    #[inline]
    fn mix(&mut self, x: u64) {
        self.h = fold_mul(
            self.h ^ x ^ self.seed,
            0x9E37_79B9_7F4A_7C15 ^ self.seed.rotate_left(17),
        );
    }
}

impl Hasher for IntHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.h
    }
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.mix(u64::from_le_bytes(w));
        }
        self.mix(bytes.len() as u64);
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.mix(u64::from(i));
    }
    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.mix(u64::from(i));
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.mix(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.mix(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.mix(i as u64);
    }
}

/// A std map keyed by integers, hashed with [`IntHash`].
pub type IntMap<K, V> = std::collections::HashMap<K, V, IntHash>;
/// A std set of integers, hashed with [`IntHash`].
pub type IntSet<K> = std::collections::HashSet<K, IntHash>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Consecutive numbers (how blocks and inodes come) spread over the low bits a
    /// table indexes by and the high seven bits it tags with: no bucket of 1,024 gets
    /// more than a few times its share, every tag value is used.
    #[test]
    fn consecutive_numbers_spread_over_low_and_high_bits() {
        let s = IntHash::default();
        for base in [0u64, 1 << 20, 0xFFFF_0000, 1 << 40] {
            let mut low = vec![0u32; 1024];
            let mut high = [0u32; 128];
            for i in 0..65_536u64 {
                let h = s.hash_one(base + i);
                low[(h & 1023) as usize] += 1;
                high[(h >> 57) as usize] += 1;
            }
            let max = *low.iter().max().expect("buckets");
            assert!(
                max < 64 * 3,
                "base {base:#x}: a low bucket got {max} of 65,536"
            );
            assert!(
                high.iter().all(|&n| n > 0),
                "base {base:#x}: a tag value unused"
            );
            // u32 keys (inode numbers) hash as their u64 values do not need to, but
            // must spread as well.
            let mut low32 = vec![0u32; 1024];
            for i in 0..65_536u32 {
                low32[(s.hash_one(base as u32 + i) & 1023) as usize] += 1;
            }
            assert!(*low32.iter().max().expect("buckets") < 64 * 3);
        }
    }

    /// Equal keys hash alike through every map entry point; the seed is per process.
    #[test]
    fn equal_keys_hash_alike() {
        let (a, b) = (IntHash::default(), IntHash::default());
        assert_eq!(a.hash_one(42u32), b.hash_one(42u32));
        assert_ne!(a.hash_one(42u32), a.hash_one(43u32));
        assert_eq!(
            a.hash_one(b"bytes".as_slice()),
            b.hash_one(b"bytes".as_slice())
        );
        let mut m: IntMap<u64, u32> = IntMap::default();
        for i in 0..10_000u64 {
            m.insert(i * 4096, i as u32);
        }
        assert!((0..10_000u64).all(|i| m.get(&(i * 4096)) == Some(&(i as u32))));
    }
}
