//! A persistence simulator for byte-addressable memory (the ADR model).
//!
//! The engine's DAX device reports every store, cache-line write-back and fence (an
//! adapter in the engine's tests forwards them here, since this crate does not
//! depend on the engine). Per 64-byte line the simulator knows:
//! - the **durable** contents: what a power failure leaves;
//! - **pending** contents: stored non-temporally, or written back (clwb), but not yet
//!   fenced — in the memory controller's write queue or a write-combining buffer,
//!   not guaranteed;
//! - **dirty** contents: stored through the cache and not written back.
//!
//! A fence makes every pending line durable. At a simulated power failure
//! ([`PmemSim::crash`]) every pending and dirty line is dropped — or, in the
//! adversarial mode, each one independently kept or dropped (a cache may evict a
//! line, and a write queue drain a store, at any moment before the fence: an
//! unflushed store is never promised lost, only not promised kept). Lines are the
//! unit: the hardware writes a line whole.
//!
//! One assumption, as in [`crate::crash`]: in the adversarial mode the lines of a
//! superblock change together or not at all — the primary superblock (the 1,024
//! bytes at byte 1,024) and the regions named with [`PmemSim::atomic`] (the journal
//! superblock). Both are updated in place under a checksum over all their lines; a
//! disk writes the changing fields in one sector, which it writes whole, but memory
//! has no such unit (pmem gets one only through the kernel's BTT), so without the
//! assumption a torn superblock is a possible outcome on real hardware too.

use std::collections::BTreeMap;

use crate::crash::Rng;

/// The cache line.
pub const LINE: usize = 64;

/// Counts of what the simulator saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PmemStats {
    pub nt_lines: u64,
    pub cached_lines: u64,
    pub written_back_lines: u64,
    pub fences: u64,
}

/// The simulator (see the module note).
#[derive(Clone)]
pub struct PmemSim {
    /// Line ranges `[first, end)` that survive a failure whole or not at all.
    atomic: Vec<(u64, u64)>,
    durable: Vec<u8>,
    pending: BTreeMap<u64, [u8; LINE]>,
    dirty: BTreeMap<u64, [u8; LINE]>,
    stats: PmemStats,
}

fn line_of(lines: &[u8], k: usize) -> [u8; LINE] {
    let mut l = [0u8; LINE];
    let src = &lines[k * LINE..];
    let n = src.len().min(LINE);
    l[..n].copy_from_slice(&src[..n]);
    l
}

impl PmemSim {
    /// Start from `image`, all of it durable.
    pub fn new(image: Vec<u8>) -> Self {
        PmemSim {
            atomic: vec![(1024 / LINE as u64, 2048 / LINE as u64)],
            durable: image,
            pending: BTreeMap::new(),
            dirty: BTreeMap::new(),
            stats: PmemStats::default(),
        }
    }

    /// Treat `[offset, offset+len)` as one unit at adversarial failures (see the
    /// module note).
    pub fn atomic(&mut self, offset: u64, len: u64) {
        let first = offset / LINE as u64;
        let end = (offset + len).div_ceil(LINE as u64);
        self.atomic.push((first, end));
    }

    pub fn stats(&self) -> PmemStats {
        self.stats
    }

    /// Lines not yet durable (pending or dirty).
    pub fn volatile_lines(&self) -> usize {
        self.pending.len() + self.dirty.len()
    }

    /// A store into the lines from `first_line` (their whole contents now in
    /// `lines`): non-temporal ones are pending, cached ones dirty.
    pub fn store(&mut self, first_line: u64, lines: &[u8], non_temporal: bool) {
        for k in 0..lines.len().div_ceil(LINE) {
            let l = first_line + k as u64;
            let c = line_of(lines, k);
            if non_temporal {
                self.dirty.remove(&l);
                self.pending.insert(l, c);
                self.stats.nt_lines += 1;
            } else {
                self.dirty.insert(l, c);
                self.stats.cached_lines += 1;
            }
        }
    }

    /// clwb of the lines from `first_line` (contents as written back). A line that
    /// was not dirty may still be written back (its contents are what memory holds).
    pub fn write_back(&mut self, first_line: u64, lines: &[u8]) {
        for k in 0..lines.len().div_ceil(LINE) {
            let l = first_line + k as u64;
            self.dirty.remove(&l);
            self.pending.insert(l, line_of(lines, k));
            self.stats.written_back_lines += 1;
        }
    }

    /// sfence: pending lines become durable.
    pub fn fence(&mut self) {
        self.stats.fences += 1;
        let pending = std::mem::take(&mut self.pending);
        for (l, c) in pending {
            self.put(l, &c);
        }
    }

    fn put(&mut self, line: u64, c: &[u8; LINE]) {
        let o = line as usize * LINE;
        if o >= self.durable.len() {
            return;
        }
        let n = (self.durable.len() - o).min(LINE);
        self.durable[o..o + n].copy_from_slice(&c[..n]);
    }

    /// The durable image.
    pub fn durable(&self) -> &[u8] {
        &self.durable
    }

    /// The image a power failure now leaves: the durable lines, plus — when
    /// `adversarial` — a random subset of the pending and dirty ones (the newest
    /// contents of each, a dirty line over a pending one). Without `adversarial`
    /// everything not fenced is lost.
    pub fn crash(&self, rng: &mut Rng, adversarial: bool) -> Vec<u8> {
        let mut img = self.durable.clone();
        if adversarial {
            for (l, c) in self.survivors(rng) {
                let o = l as usize * LINE;
                if o < img.len() {
                    let n = (img.len() - o).min(LINE);
                    img[o..o + n].copy_from_slice(&c[..n]);
                }
            }
        }
        img
    }

    /// The volatile lines that survive one adversarial failure.
    pub fn survivors(&self, rng: &mut Rng) -> Vec<(u64, [u8; LINE])> {
        let keep_unit: Vec<bool> = self.atomic.iter().map(|_| rng.below(2) == 0).collect();
        let mut newest: BTreeMap<u64, [u8; LINE]> = self.pending.clone();
        for (l, c) in &self.dirty {
            newest.insert(*l, *c);
        }
        newest
            .into_iter()
            .filter(
                |(l, _)| match self.atomic.iter().position(|&(a, e)| a <= *l && *l < e) {
                    Some(u) => keep_unit[u],
                    None => rng.below(2) == 0,
                },
            )
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_fenced_stores_survive_a_plain_failure() {
        let mut s = PmemSim::new(vec![0u8; 4 * LINE]);
        s.store(0, &[1u8; LINE], true);
        s.store(1, &[2u8; LINE], false);
        let mut rng = Rng(7);
        assert_eq!(s.crash(&mut rng, false), vec![0u8; 4 * LINE]);
        s.fence();
        let img = s.crash(&mut rng, false);
        assert_eq!(&img[..LINE], &[1u8; LINE][..], "nt + fence is durable");
        assert_eq!(
            &img[LINE..2 * LINE],
            &[0u8; LINE][..],
            "cached store is not"
        );
        s.write_back(1, &[2u8; LINE]);
        assert_eq!(&s.crash(&mut rng, false)[LINE..2 * LINE], &[0u8; LINE][..]);
        s.fence();
        assert_eq!(&s.crash(&mut rng, false)[LINE..2 * LINE], &[2u8; LINE][..]);
        assert_eq!(s.volatile_lines(), 0);
    }

    #[test]
    fn adversarial_failures_keep_subsets_of_whole_lines() {
        let mut s = PmemSim::new(vec![0u8; 8 * LINE]);
        let mut data = vec![0u8; 8 * LINE];
        for (k, b) in data.iter_mut().enumerate() {
            *b = 1 + (k / LINE) as u8;
        }
        s.store(0, &data, true);
        let mut rng = Rng(3);
        let mut seen_some = false;
        let mut seen_lost = false;
        for _ in 0..64 {
            let img = s.crash(&mut rng, true);
            for l in 0..8 {
                let line = &img[l * LINE..(l + 1) * LINE];
                assert!(
                    line.iter().all(|&b| b == 0) || line.iter().all(|&b| b == 1 + l as u8),
                    "a line is whole or absent"
                );
            }
            seen_some |= img.iter().any(|&b| b != 0);
            seen_lost |= img.contains(&0);
        }
        assert!(
            seen_some && seen_lost,
            "unfenced lines are sometimes kept, sometimes lost"
        );
        s.fence();
        assert_eq!(
            s.crash(&mut rng, true),
            data,
            "fenced lines are always kept"
        );
    }
}
