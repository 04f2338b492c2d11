//! The direct-I/O lock protocol under shuttle (SEEDS lesson A): sub-block O_DIRECT
//! writes into one block, a pure overwrite under the inode's I/O lock shared, anything
//! that allocates, converts or zeroes under it exclusively. Random and PCT schedules.
//!
//! The model file: one logical block of four 1 KiB sectors, its mapping (a hole, or
//! an unwritten or written physical block: four on the model device), the file's size,
//! the device's bytes, and the I/O lock (`Fs::io_shared` / `Fs::io_exclusive`, a
//! `RwLock<()>`). Writers are threads, each one direct write (`Fs::write_direct_ino`)
//! of 1 KiB or 2 KiB, with a byte pattern of its own, at its own sectors of the block:
//! - the fast path (`Fs::try_overwrite`): the lock shared; if the block is mapped
//!   written and the range ends within the size, the data is written in place, else
//!   "retry" (the lock released);
//! - the retry (`Fs::write_through` → `write_locked` → `write_blocks`): the lock
//!   exclusively, which waits for every shared holder: the drain of the direct writes
//!   in flight (the kernel's `inode_dio_wait`). A write that starts past the end first
//!   zeroes the old end's block from the old end to it (`zero_past_eof`); a written
//!   block is overwritten in place; an unwritten block, or one allocated for a hole
//!   (`alloc_blocks`), gets zeros around the data, then the data (`write_zero_padded`),
//!   and only then is mapped written (`mark_written`, the extent's insertion); the size
//!   is raised last (`write_inode`, the record read at the start).
//! - a zero range (`Fs::fallocate_ino`, ZERO_RANGE with KEEP_SIZE over the block),
//!   exclusive like the retry, in two forms: the block kept and marked unwritten (as
//!   ext4 converts the whole blocks of a zero range in place; rext4 without a journal
//!   may get the freed block straight back), or the block freed and another mapped
//!   unwritten (rext4's `punch` then `alloc_unwritten` with a journal: the freed block
//!   is busy until the next commit, which an overwrite in flight does not hold off,
//!   and anyone's after it).
//!
//! Every step is split by yields: each sector is a device write of its own, and zeros,
//! data, the mapping and the size are published one after the other, so half-done
//! states are visible to anyone not excluded. The scenarios start from a written block
//! (pure overwrites), an unwritten block (preallocated), a hole, the end of the file
//! inside a written block (extensions; the bytes past the end were left by a
//! shrinking truncate), an empty file, and a written block zeroed (each form) while
//! two writers overwrite it. Device bytes no write of the file put there read 0xEE
//! ("stale": another file's, or never written).
//!
//! What must hold. At every step: no stale byte is readable (inside the size, a
//! written block's bytes; an unwritten block or a hole reads as zeros; after a zero
//! range the old data is stale too), and no write lands in a block the file does not
//! own (freed by a zero range, it may be another file's by then). At the end of every
//! schedule: the size covers every completed write; no byte reads as anything but
//! zero, a write's pattern or (before any zero range) the old data; the file reads as
//! the operations give applied one at a time in some order that fits when they ran
//! (one that returned before another was called comes first): without a zero range,
//! every completed write's bytes are there exactly; the file owns its mapped block
//! and no other. The paths are counted: on the written block every write takes the
//! shared path, in the other scenarios at least the first to look at the block
//! retries exclusively.
//!
//! Writers alone do not need the drain: a retry maps its block written only after
//! zeroing it and writing its data, and raises the size last, so no overwrite is ever
//! in flight in bytes a retry zeroes. It is needed against changes that take a block
//! away from written (zero range, punch, truncate; all exclusive): hence the zeroed
//! scenarios.
//!
//! The broken variants (`Broken`) must each be caught: the retry under the lock
//! shared (the seed's bug: two zeroing writers wipe each other's data), the fast path
//! without its check (every write taken for a pure overwrite), and the exclusive path
//! on a mutex of its own (no drain: an overwrite in flight goes on into the block a
//! zero range freed; with the block kept, the conversion after the zero range zeroes
//! half of a 2 KiB overwrite in flight, which only about one random schedule in 700
//! shows).

#![cfg(test)]

use std::ops::RangeInclusive;
use std::sync::Arc;

use shuttle::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use shuttle::thread;

const SECTOR: usize = 1024;
const SECTORS: usize = 4;
const BLOCK: usize = SECTOR * SECTORS;
/// Physical blocks on the model device.
const BLOCKS: usize = 4;

/// Bytes on the device that no read may return: another file's, or never written.
const STALE: u8 = 0xEE;
/// The file's own data in its written block at the start.
const OLD: u8 = 0x0D;

/// Which part of the protocol the model leaves out (`None`: the protocol as is).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Broken {
    None,
    /// The retry takes the I/O lock shared: allocation, conversion and zeroing run
    /// beside other writers (the seed's bug).
    ConvertShared,
    /// The fast path does not check the mapping and the size: every write is taken
    /// for a pure overwrite and written in place.
    NoOverwriteCheck,
    /// The exclusive path (the retry, the zero range) takes a mutex of its own instead
    /// of the I/O lock's write side: it does not wait for shared writers in flight.
    NoDrain,
}

/// The logical block's mapping, with its physical block.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Map {
    Hole,
    Unwritten(usize),
    Written(usize),
}

/// What a zero range does with the block.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Zero {
    /// Kept, marked unwritten.
    InPlace,
    /// Freed (busy until a commit, which the model never makes), another block
    /// mapped unwritten.
    NewBlock,
}

/// One direct write: `len_bytes` of `pattern` at `offset_bytes` of the block.
#[derive(Clone, Copy, Debug)]
struct Write {
    name: &'static str,
    offset_bytes: usize,
    len_bytes: usize,
    pattern: u8,
}

impl Write {
    const fn new(name: &'static str, sector: usize, sectors: usize, pattern: u8) -> Write {
        Write {
            name,
            offset_bytes: sector * SECTOR,
            len_bytes: sectors * SECTOR,
            pattern,
        }
    }

    fn end(&self) -> usize {
        self.offset_bytes + self.len_bytes
    }

    fn covers(&self, sector: usize) -> bool {
        (self.offset_bytes..self.end()).contains(&(sector * SECTOR))
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Write(Write),
    ZeroRange,
}

/// The path a write took.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Shared,
    Retried,
}

/// A finished operation: what, the path a write took, and when it was called and
/// returned (the model's clock).
#[derive(Clone, Copy, Debug)]
struct Done {
    op: Op,
    path: Option<Path>,
    called: usize,
    returned: usize,
}

struct Scenario {
    name: &'static str,
    map: Map,
    size_bytes: usize,
    writes: &'static [Write],
    zero_range: Option<Zero>,
    /// How many writes may retry exclusively.
    retries: RangeInclusive<usize>,
}

const A: Write = Write::new("A", 0, 1, 0xA1);
const C: Write = Write::new("C", 1, 1, 0xC3);
const B: Write = Write::new("B", 2, 2, 0xB2);

static SCENARIOS: [Scenario; 7] = [
    Scenario {
        name: "written",
        map: Map::Written(0),
        size_bytes: BLOCK,
        writes: &[A, B, C],
        zero_range: None,
        retries: 0..=0,
    },
    Scenario {
        name: "unwritten",
        map: Map::Unwritten(0),
        size_bytes: BLOCK,
        writes: &[A, B, C],
        zero_range: None,
        retries: 1..=3,
    },
    Scenario {
        name: "hole",
        map: Map::Hole,
        size_bytes: BLOCK,
        writes: &[A, B, C],
        zero_range: None,
        retries: 1..=3,
    },
    // A is inside the size: always shared; the first of B and C extends the file.
    Scenario {
        name: "past EOF",
        map: Map::Written(0),
        size_bytes: SECTOR,
        writes: &[A, B, C],
        zero_range: None,
        retries: 1..=2,
    },
    Scenario {
        name: "empty",
        map: Map::Hole,
        size_bytes: 0,
        writes: &[A, B, C],
        zero_range: None,
        retries: 1..=3,
    },
    // Sector 1 is nobody's: the old data until the zero range, zeros after it.
    Scenario {
        name: "zeroed",
        map: Map::Written(0),
        size_bytes: BLOCK,
        writes: &[A, B],
        zero_range: Some(Zero::NewBlock),
        retries: 0..=2,
    },
    Scenario {
        name: "zeroed in place",
        map: Map::Written(0),
        size_bytes: BLOCK,
        writes: &[A, B],
        zero_range: Some(Zero::InPlace),
        retries: 0..=2,
    },
];

fn scenario(name: &str) -> &'static Scenario {
    SCENARIOS
        .iter()
        .find(|s| s.name == name)
        .expect("a scenario")
}

struct State {
    /// The physical blocks' bytes, one after the other.
    device: Vec<u8>,
    map: Map,
    /// The blocks allocated to the file (mapped, or about to be).
    owned: [bool; BLOCKS],
    /// Freed blocks not reused before the next commit.
    busy: [bool; BLOCKS],
    size_bytes: usize,
    /// A zero range made the old data stale.
    zeroed: bool,
    /// Ticks at each call and return of an operation.
    clock: usize,
    done: Vec<Done>,
    /// The first step that broke the invariant of every step: reported at the end,
    /// by the main task (a task that panicked, unwinding through shuttle's locks,
    /// could meet another's panic).
    failure: Option<String>,
}

impl State {
    /// What a read of `[0, size)` returns: the device's bytes where the block is
    /// written (None: zeros).
    fn readable(&self) -> Option<&[u8]> {
        match self.map {
            Map::Written(p) => Some(&self.device[p * BLOCK..][..self.size_bytes]),
            Map::Hole | Map::Unwritten(_) => None,
        }
    }

    /// The invariant of every step on what is readable (see the module note); the
    /// failure, if any.
    fn stale(&self, when: &str) -> Option<String> {
        let r = self.readable()?;
        let bad = |b: u8| b == STALE || (self.zeroed && b == OLD);
        let at = r.iter().position(|&b| bad(b))?;
        Some(format!(
            "stale byte {:#04x} readable at {at} {when} (size {}, {:?})",
            r[at], self.size_bytes, self.map
        ))
    }

    /// `alloc_blocks`: the first block neither the file's nor busy.
    fn alloc(&mut self) -> usize {
        let p = (0..BLOCKS)
            .find(|&p| !self.owned[p] && !self.busy[p])
            .expect("a free block");
        self.owned[p] = true;
        p
    }
}

struct Model {
    broken: Broken,
    /// The inode's I/O lock (`Fs::io_stripe`).
    io: RwLock<()>,
    /// `NoDrain`'s lock for the exclusive path.
    own: Mutex<()>,
    /// The model's bookkeeping: a std mutex, never held across a scheduling point, so
    /// that schedules interleave only the steps the module note names.
    state: std::sync::Mutex<State>,
}

/// The exclusive path's lock, whichever it is.
struct Exclusive<'a> {
    _write: Option<RwLockWriteGuard<'a, ()>>,
    _read: Option<RwLockReadGuard<'a, ()>>,
    _own: Option<MutexGuard<'a, ()>>,
}

impl Model {
    fn new(sc: &Scenario, broken: Broken) -> Model {
        let mut device = vec![STALE; BLOCKS * BLOCK];
        let mut owned = [false; BLOCKS];
        match sc.map {
            Map::Written(p) => {
                device[p * BLOCK..][..sc.size_bytes].fill(OLD);
                owned[p] = true;
            }
            Map::Unwritten(p) => owned[p] = true,
            Map::Hole => {}
        }
        Model {
            broken,
            io: RwLock::new(()),
            own: Mutex::new(()),
            state: std::sync::Mutex::new(State {
                device,
                map: sc.map,
                owned,
                busy: [false; BLOCKS],
                size_bytes: sc.size_bytes,
                zeroed: false,
                clock: 0,
                done: Vec::new(),
                failure: None,
            }),
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One change to the state, then the invariant of every step (the first failure
    /// is kept for the end).
    fn change(&self, what: &str, f: impl FnOnce(&mut State) -> Result<(), String>) {
        let mut st = self.st();
        let bad = f(&mut st).err().or_else(|| st.stale(what));
        if st.failure.is_none() {
            st.failure = bad;
        }
    }

    /// Device writes of `[from, to)` of physical block `p` with `byte`, one sector
    /// at a time, a yield before each (a multi-sector write is not atomic).
    fn device_write(&self, p: usize, from: usize, to: usize, byte: u8, what: &str) {
        let mut at = from;
        while at < to {
            let end = (at - at % SECTOR + SECTOR).min(to);
            thread::yield_now();
            self.change(what, |st| {
                if !st.owned[p] {
                    return Err(format!(
                        "a direct write landed in block {p}, which the file no longer \
                         owns ({what}; freed, it may be another file's)"
                    ));
                }
                st.device[p * BLOCK..][at..end].fill(byte);
                Ok(())
            });
            at = end;
        }
    }

    /// `Fs::io_exclusive`, or what the broken variant takes instead.
    fn exclusive(&self) -> Exclusive<'_> {
        let none = Exclusive {
            _write: None,
            _read: None,
            _own: None,
        };
        match self.broken {
            Broken::ConvertShared => Exclusive {
                _read: Some(self.io.read().unwrap_or_else(|p| p.into_inner())),
                ..none
            },
            Broken::NoDrain => Exclusive {
                _own: Some(self.own.lock().unwrap_or_else(|p| p.into_inner())),
                ..none
            },
            Broken::None | Broken::NoOverwriteCheck => Exclusive {
                _write: Some(self.io.write().unwrap_or_else(|p| p.into_inner())),
                ..none
            },
        }
    }

    fn tick(&self) -> usize {
        let mut st = self.st();
        st.clock += 1;
        st.clock
    }

    /// `op`, called at `called`, returns now.
    fn returns(&self, op: Op, path: Option<Path>, called: usize) {
        let returned = self.tick();
        self.st().done.push(Done {
            op,
            path,
            called,
            returned,
        });
    }

    /// `Fs::write_direct_ino`: the fast path, else the exclusive one.
    fn direct_write(&self, w: Write) {
        let called = self.tick();
        let path = if self.try_overwrite(w) {
            Path::Shared
        } else {
            self.write_through(w);
            Path::Retried
        };
        self.returns(Op::Write(w), Some(path), called);
    }

    /// `Fs::try_overwrite`: under the lock shared, written in place if the block is
    /// mapped written and the range ends within the size; false: retry exclusively.
    fn try_overwrite(&self, w: Write) -> bool {
        let _io = self.io.read().unwrap_or_else(|p| p.into_inner());
        let (map, size) = {
            let st = self.st();
            (st.map, st.size_bytes)
        };
        let p = match map {
            Map::Written(p) if w.end() <= size => p,
            _ if self.broken != Broken::NoOverwriteCheck => return false,
            Map::Written(p) | Map::Unwritten(p) => p,
            // No block to trust: the skipped check would take whatever was there.
            Map::Hole => 0,
        };
        let what = "during an overwrite";
        self.device_write(p, w.offset_bytes, w.end(), w.pattern, what);
        true
    }

    /// `Fs::write_through` → `write_locked` → `write_blocks`, under the lock
    /// exclusively.
    fn write_through(&self, w: Write) {
        let _io = self.exclusive();
        // `write_locked` reads the record once and writes it back at the end.
        let (map, size) = {
            let st = self.st();
            (st.map, st.size_bytes)
        };
        // `zero_past_eof`: the old end's block, if written, from the old end on.
        if let Map::Written(p) = map {
            if w.offset_bytes > size && size % BLOCK != 0 {
                let to = (size - size % BLOCK + BLOCK).min(w.offset_bytes);
                self.device_write(p, size, to, 0, "while zeroing past the end");
            }
        }
        match map {
            Map::Written(p) => {
                let what = "during an overwrite";
                self.device_write(p, w.offset_bytes, w.end(), w.pattern, what);
            }
            Map::Unwritten(_) | Map::Hole => {
                let p = match map {
                    Map::Unwritten(p) => p,
                    _ => self.st().alloc(),
                };
                // `write_zero_padded`: zeros around the data, the data; then
                // `mark_written` (unwritten) or the extent's insertion (a hole).
                for s in (0..SECTORS).filter(|&s| !w.covers(s)) {
                    let what = "while zeroing around a write";
                    self.device_write(p, s * SECTOR, (s + 1) * SECTOR, 0, what);
                }
                let what = "during a conversion's write";
                self.device_write(p, w.offset_bytes, w.end(), w.pattern, what);
                thread::yield_now();
                self.change("as the block is mapped written", |st| {
                    st.map = Map::Written(p);
                    Ok(())
                });
            }
        }
        thread::yield_now();
        // `write_inode`: the record read at the start, its size raised.
        self.change("as the size is raised", |st| {
            st.size_bytes = size.max(w.end());
            Ok(())
        });
    }

    /// `Fs::fallocate_ino` with ZERO_RANGE and KEEP_SIZE over the whole block.
    fn zero_range(&self, how: Zero) {
        let called = self.tick();
        {
            let _io = self.exclusive();
            thread::yield_now();
            match how {
                Zero::InPlace => self.change("after a zero range", |st| {
                    if let Map::Written(p) = st.map {
                        st.map = Map::Unwritten(p);
                    }
                    st.zeroed = true;
                    Ok(())
                }),
                Zero::NewBlock => {
                    // `punch`: the extent removed, its block freed (busy).
                    self.change("after a punch", |st| {
                        if let Map::Written(p) | Map::Unwritten(p) = st.map {
                            st.owned[p] = false;
                            st.busy[p] = true;
                        }
                        st.map = Map::Hole;
                        st.zeroed = true;
                        Ok(())
                    });
                    thread::yield_now();
                    // `alloc_unwritten`.
                    self.change("after a zero range", |st| {
                        st.map = Map::Unwritten(st.alloc());
                        Ok(())
                    });
                }
            }
        }
        self.returns(Op::ZeroRange, None, called);
    }

    /// The checks at the end of a schedule (see the module note).
    fn at_the_end(&self, sc: &Scenario) {
        let st = self.st();
        let size = st.size_bytes;
        let done = st.done.clone();
        let got = st.readable().map_or_else(|| vec![0; size], <[u8]>::to_vec);
        let (map, owned) = (st.map, st.owned);
        let (zeroed, stale) = (st.zeroed, st.failure.clone());
        drop(st);
        let sc_name = sc.name;
        if let Some(msg) = stale {
            panic!("{msg} ({sc_name})");
        }
        let writes: Vec<Write> = done
            .iter()
            .filter_map(|d| match d.op {
                Op::Write(w) => Some(w),
                Op::ZeroRange => None,
            })
            .collect();
        assert_eq!(writes.len(), sc.writes.len(), "a write did not finish");
        for w in &writes {
            assert!(
                w.end() <= size,
                "the size ({size}) does not cover a completed write: {} ends at {} \
                 ({sc_name})",
                w.name,
                w.end()
            );
        }
        let known = |b: u8| {
            b == 0
                || (b == OLD && matches!(sc.map, Map::Written(_)) && !zeroed)
                || writes.iter().any(|w| w.pattern == b)
        };
        if let Some(i) = got.iter().position(|&b| !known(b)) {
            panic!(
                "byte {i} reads {:#04x}: neither zero nor a write's ({sc_name})",
                got[i]
            );
        }
        // The operations one at a time in `order`, from the file at the start.
        let replay = |order: &[usize]| {
            let mut f = vec![0u8; BLOCK];
            if let Map::Written(_) = sc.map {
                f[..sc.size_bytes].fill(OLD);
            }
            for &k in order {
                match done[k].op {
                    Op::Write(w) => f[w.offset_bytes..w.end()].fill(w.pattern),
                    Op::ZeroRange => f.fill(0),
                }
            }
            f
        };
        // An order fits when no operation in it comes after one that was called
        // after it returned.
        let fits = |order: &[usize]| {
            order.iter().enumerate().all(|(i, &a)| {
                order[i + 1..]
                    .iter()
                    .all(|&b| done[b].returned > done[a].called)
            })
        };
        let orders = permutations(done.len());
        if !orders
            .iter()
            .any(|o| fits(o) && replay(o)[..size] == got[..])
        {
            if zeroed {
                let sectors: Vec<u8> = got.chunks(SECTOR).map(|c| c[0]).collect();
                let ops: Vec<String> = done
                    .iter()
                    .map(|d| match d.op {
                        Op::Write(w) => format!("{} {}..{}", w.name, d.called, d.returned),
                        Op::ZeroRange => format!("zero range {}..{}", d.called, d.returned),
                    })
                    .collect();
                panic!(
                    "no order of the operations that fits when they ran gives what the file \
                     reads: sectors {sectors:02x?}; called..returned: {ops:?} ({sc_name})"
                );
            }
            // Without a zero range the writes commute: one content is right.
            let want = replay(&orders[0]);
            let i = (0..size)
                .find(|&i| got[i] != want[i])
                .expect("a difference");
            match writes.iter().find(|w| w.pattern == want[i]) {
                Some(w) => panic!(
                    "a completed write's bytes lost: {} wrote {:#04x} at {i}, the file reads \
                     {:#04x} ({sc_name})",
                    w.name, want[i], got[i]
                ),
                None => panic!(
                    "byte {i} reads {:#04x}, the writes give {:#04x} ({sc_name})",
                    got[i], want[i]
                ),
            }
        }
        let count = |p| done.iter().filter(|d| d.path == Some(p)).count();
        let (shared, retried) = (count(Path::Shared), count(Path::Retried));
        assert_eq!(shared + retried, sc.writes.len(), "a write took no path");
        assert!(
            sc.retries.contains(&retried),
            "{retried} of {} writes retried exclusively, {shared} took the shared path; \
             expected {:?} retries ({sc_name})",
            sc.writes.len(),
            sc.retries
        );
        let mapped = match map {
            Map::Written(p) | Map::Unwritten(p) => Some(p),
            Map::Hole => None,
        };
        for (p, &o) in owned.iter().enumerate() {
            assert_eq!(
                o,
                mapped == Some(p),
                "block {p} owned {o}, mapped {map:?}: leaked or lost ({sc_name})"
            );
        }
    }
}

/// Every order of `0..n`.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut all = Vec::new();
    for p in permutations(n - 1) {
        for at in 0..=p.len() {
            let mut q = p.clone();
            q.insert(at, n - 1);
            all.push(q);
        }
    }
    all
}

/// One schedule of `sc`: its writers (and zero range) started on one model, joined,
/// then the checks at the end.
fn run(sc: &'static Scenario, broken: Broken) {
    let m = Arc::new(Model::new(sc, broken));
    let mut threads: Vec<_> = sc
        .writes
        .iter()
        .map(|&w| {
            let m = m.clone();
            thread::spawn(move || m.direct_write(w))
        })
        .collect();
    if let Some(how) = sc.zero_range {
        let m = m.clone();
        threads.push(thread::spawn(move || m.zero_range(how)));
    }
    for t in threads {
        t.join().expect("thread");
    }
    m.at_the_end(sc);
}

/// Schedules per scenario.
const RANDOM_SCHEDULES: usize = 10_000;
const PCT_SCHEDULES: usize = 10_000;

#[test]
fn dio_protocol_random() {
    for sc in &SCENARIOS {
        shuttle::check_random(move || run(sc, Broken::None), RANDOM_SCHEDULES);
    }
}

#[test]
fn dio_protocol_pct() {
    for sc in &SCENARIOS {
        shuttle::check_pct(move || run(sc, Broken::None), PCT_SCHEDULES, 3);
    }
}

/// Run the broken variant `b` on scenario `sc` over `n` random schedules: it must
/// fail, with a message containing `expect`.
fn caught(b: Broken, sc: &'static str, n: usize, expect: &str) {
    let sc = scenario(sc);
    super::model_check::expect_caught(&b, expect, || shuttle::check_random(move || run(sc, b), n));
}

/// Two writes into an unwritten block both convert it under the shared lock: each
/// zeroes the sectors the other writes.
#[test]
fn broken_convert_shared_is_caught() {
    caught(
        Broken::ConvertShared,
        "unwritten",
        3000,
        "a completed write's bytes lost",
    );
}

/// A write into an unwritten block taken for an overwrite: written in place, never
/// converted (it reads as zeros), or zeroed by the conversion of another write.
#[test]
fn broken_no_overwrite_check_is_caught() {
    caught(
        Broken::NoOverwriteCheck,
        "unwritten",
        3000,
        "a completed write's bytes lost",
    );
}

/// A zero range that does not wait for an overwrite in flight: the overwrite goes on
/// in the block the zero range freed.
#[test]
fn broken_no_drain_is_caught() {
    caught(
        Broken::NoDrain,
        "zeroed",
        3000,
        "which the file no longer owns",
    );
}

/// The same with the block kept: B's 2 KiB overwrite, checked before the zero range,
/// writes its first sector before A's conversion zeroes the block and its second
/// after: half of B is there, which no order of the three gives.
#[test]
fn broken_no_drain_in_place_is_caught() {
    caught(
        Broken::NoDrain,
        "zeroed in place",
        20_000,
        "no order of the operations",
    );
}
