//! Crash images from a recorded run.
//!
//! A recording device (an adapter in the engine's tests, since this crate does not
//! depend on the engine) logs every write and flush of a workload as [`Event`]s. From
//! the log and the image the run started from, this module builds the image as it
//! would be after a power cut:
//! - at a flush point: every write issued before that flush is durable;
//! - between two flushes: everything before the earlier flush, plus any subset of the
//!   writes issued since, some of them torn at 512-byte sector granularity (a write
//!   that was in flight when the power went).
//!
//! Writes before a flush are durable; writes after it may be lost, reordered or torn —
//! the guarantees a disk gives, and the ones the journal's ordering relies on. A write
//! past the end of the image extends it (a growing image file, such as a qcow2 file);
//! lost, it leaves the file shorter.
//!
//! One assumption: a write of the primary superblock (the 1,024 bytes at byte 1,024)
//! is lost or made whole, never torn. Its checksum spans both of its sectors, so any
//! torn update is unreadable; the kernel writes it the same way (outside the journal,
//! at mount and unmount) and relies on the same atomicity.

/// One device operation of a recorded run.
#[derive(Clone, Debug)]
pub enum Event {
    Write { offset: u64, data: Vec<u8> },
    Flush,
}

/// Sector size for torn writes.
pub const SECTOR: usize = 512;

/// Indexes of the flush events.
pub fn flush_points(events: &[Event]) -> Vec<usize> {
    events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Event::Flush))
        .map(|(i, _)| i)
        .collect()
}

/// A write past the end extends the image (zeros between): an image file that grows,
/// such as a qcow2 file recorded under its qcow2 layer.
fn apply(img: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let o = offset as usize;
    if img.len() < o + data.len() {
        img.resize(o + data.len(), 0);
    }
    img[o..o + data.len()].copy_from_slice(data);
}

/// The image with every write before event index `upto` applied.
pub fn image_at(base: &[u8], events: &[Event], upto: usize) -> Vec<u8> {
    let mut img = base.to_vec();
    for e in &events[..upto.min(events.len())] {
        if let Event::Write { offset, data } = e {
            apply(&mut img, *offset, data);
        }
    }
    img
}

/// A small deterministic PRNG (xorshift64*).
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The image after a crash between the flush at event index `durable` and the next
/// flush (or the end): writes before `durable` are all there; each later write up to
/// the next flush is lost, kept, or torn (a random subset of its sectors kept).
pub fn image_with_lost_writes(
    base: &[u8],
    events: &[Event],
    durable: usize,
    rng: &mut Rng,
) -> Vec<u8> {
    image_with_lost_writes_keeping(base, events, durable, rng, &touches_superblock)
}

/// [`image_with_lost_writes`] where `whole(offset, len)` names the writes that are
/// lost or kept whole, never torn (the primary superblock's, wherever a layer under
/// the filesystem puts it).
pub fn image_with_lost_writes_keeping(
    base: &[u8],
    events: &[Event],
    durable: usize,
    rng: &mut Rng,
    whole: &dyn Fn(u64, usize) -> bool,
) -> Vec<u8> {
    let mut img = image_at(base, events, durable);
    for e in &events[durable.min(events.len())..] {
        match e {
            Event::Flush => break,
            Event::Write { offset, data } => match rng.below(4) {
                0 => {} // lost
                1 if !whole(*offset, data.len()) => {
                    // torn: some sectors made it
                    for (i, sector) in data.chunks(SECTOR).enumerate() {
                        if rng.below(2) == 0 {
                            apply(&mut img, offset + (i * SECTOR) as u64, sector);
                        }
                    }
                }
                _ => apply(&mut img, *offset, data),
            },
        }
    }
    img
}

/// Whether a write overlaps the primary superblock (bytes 1024..2048).
pub fn touches_superblock(offset: u64, len: usize) -> bool {
    offset < 2048 && offset + len as u64 > 1024
}

/// How many writes lie between the flush at `durable` and the next flush.
pub fn writes_after(events: &[Event], durable: usize) -> usize {
    events[durable.min(events.len())..]
        .iter()
        .take_while(|e| !matches!(e, Event::Flush))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durable_prefix_and_lost_suffix() {
        let base = vec![0u8; 4096];
        let ev = vec![
            Event::Write {
                offset: 0,
                data: vec![1; 1024],
            },
            Event::Flush,
            Event::Write {
                offset: 2048,
                data: vec![2; 1024],
            },
            Event::Write {
                offset: 1024,
                data: vec![3; 1024],
            },
            Event::Flush,
        ];
        assert_eq!(flush_points(&ev), vec![1, 4]);
        let a = image_at(&base, &ev, 1);
        assert!(a[..1024].iter().all(|&b| b == 1) && a[1024..].iter().all(|&b| b == 0));
        assert_eq!(writes_after(&ev, 2), 2);
        let mut seen_torn = false;
        let mut rng = Rng(9);
        for _ in 0..64 {
            let img = image_with_lost_writes(&base, &ev, 2, &mut rng);
            assert!(img[..1024].iter().all(|&b| b == 1), "durable write lost");
            seen_torn |= (img[2048] == 2) != (img[2560] == 2);
            // The superblock's 1 KiB is never torn.
            assert_eq!(img[1024], img[1536], "superblock write torn");
        }
        assert!(seen_torn, "torn writes never generated");
    }
}
