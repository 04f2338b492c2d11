//! Multi-mount protection (incompat feature mmp): taking part, as the kernel does, in
//! the protocol that keeps two hosts from writing one filesystem on shared storage.
//! Facts from the kernel's `fs/ext4/mmp.c` and e2fsprogs' `lib/ext2fs/mmp.c`; the
//! block's format is `rext4_format::mmp`.
//!
//! Owns: [`Session`], started by `Fs::open_device` before a read-write open writes
//! anything (journal replay included) and ended by `Fs::close` (or the last handle's
//! drop) after the last write; [`Fence`], the device under the filesystem, which
//! refuses every write once the session lost the block.
//!
//! The protocol ([`Session::start`]): read the MMP block. CLEAN: go on at once (the
//! kernel does not wait on a clean block). FSCK: refuse, e2fsprogs has it. Otherwise
//! wait the check interval twice plus a second (`rext4_format::mmp::wait_secs`) and
//! read again: a sequence that moved means a live holder, refused naming its node and
//! device. Then write a fresh random sequence with this node's name, wait again (not
//! after CLEAN) and check the block is still ours. While open, a thread rewrites the
//! sequence every `s_mmp_update_interval` seconds, reading the block first: another
//! node's write (sequence or node name not what it last wrote) means the filesystem is
//! mounted twice: the session closes the fence (no write of the filesystem reaches
//! the device any more, data and journal included) and calls its `on_lost` hook (the
//! filesystem latches a shutdown with that reason, as the kernel's error handling
//! makes it read-only). At the end the block gets CLEAN, unless it is no longer ours.
//!
//! Must hold: every MMP read and write goes through `BlockDevice::read_fresh` /
//! `write_through`, never the buffer cache: a cached copy would hide another host's
//! write. For an image file on this host a plain read is coherent already; a device
//! whose backend caches (a block device's page cache, a network filesystem, a network
//! block device with a client cache) must implement those two past its cache (the file
//! device uses O_DIRECT), and a wrapper must pass them on.
//!
//! Locks: the session's own mutex, never held across I/O or the hook; the hook (the
//! filesystem's abort) takes the journal's mutex, so [`Session::stop`] is never called
//! holding it.

use std::io;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rext4_format::mmp::{self, MmpBlock, SeqState};
use rext4_format::superblock::Superblock;

use crate::device::BlockDevice;
use crate::error::{Error, Result};

/// What a session lost its block to, told to the filesystem.
type LostHook = Box<dyn Fn(String) + Send + Sync>;

/// The device under an open filesystem: everything passes, until the MMP block is
/// lost to another node ([`Fence::close`]); from then on every write and flush
/// fails, so nothing the filesystem still had on its way (writeback, a commit, the
/// journal's error record) lands on blocks the other node now owns.
pub(crate) struct Fence {
    inner: Arc<dyn BlockDevice>,
    closed: AtomicBool,
}

impl Fence {
    pub(crate) fn new(inner: Arc<dyn BlockDevice>) -> Fence {
        Fence {
            inner,
            closed: AtomicBool::new(false),
        }
    }

    /// Refuse every write and flush from now on.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    fn check(&self) -> io::Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "multi-mount protection: another node has the image; nothing more is \
                 written",
            ));
        }
        Ok(())
    }
}

impl BlockDevice for Fence {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn read_at_uninit(&self, buf: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
        self.inner.read_at_uninit(buf, offset)
    }
    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        self.inner.read_many(reqs)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check()?;
        self.inner.write_at(buf, offset)
    }
    fn write_many(&self, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.check()?;
        self.inner.write_many(reqs)
    }
    fn flush(&self) -> io::Result<()> {
        self.check()?;
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check()?;
        self.inner.discard(offset, len)
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn dax(&self) -> Option<&crate::device::dax::DaxDevice> {
        self.inner.dax()
    }
    fn will_need(&self, offset: u64, len: u64) {
        self.inner.will_need(offset, len);
    }
    fn read_fresh(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_fresh(buf, offset)
    }
    fn write_through(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check()?;
        self.inner.write_through(buf, offset)
    }
}

/// A held MMP block: the updater thread and what it last wrote.
pub(crate) struct Session {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    dev: Arc<dyn BlockDevice>,
    block: u64,
    block_size: usize,
    csum_seed: Option<u32>,
    /// `s_mmp_update_interval`, at least a second.
    interval: Duration,
    nodename: Vec<u8>,
    bdevname: Vec<u8>,
    state: Mutex<State>,
    wake: Condvar,
    on_lost: OnceLock<LostHook>,
    /// The filesystem's device, closed when the block is lost.
    fence: Option<Arc<Fence>>,
}

struct State {
    /// The sequence this session last wrote.
    seq: u32,
    /// When it last wrote it.
    written: Instant,
    /// Why the block is no longer ours; nothing more is written then.
    lost: Option<String>,
    stop: bool,
}

/// Seconds since the epoch.
fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// This host's node name (`uname -n`), as the kernel and e2fsprogs record it.
pub(crate) fn nodename() -> Vec<u8> {
    // SAFETY: uname(2) fills the zeroed struct we own; its fields are NUL-terminated
    // char arrays within it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::uname(&mut u) } != 0 {
        return b"unknown host".to_vec();
    }
    u.nodename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect()
}

/// A random sequence up to `SEQ_MAX` (the kernel's `mmp_new_seq`).
fn new_seq() -> u32 {
    loop {
        let mut b = [0u8; 4];
        // SAFETY: getrandom(2) writes at most 4 bytes into `b`, which we own.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
        let v = if n == 4 {
            u32::from_le_bytes(b)
        } else {
            // No kernel randomness: the clock's nanoseconds and our pid.
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            t ^ std::process::id().rotate_left(16)
        };
        if v <= mmp::SEQ_MAX {
            return v;
        }
    }
}

/// The sequence after `seq` for the updater (1 after `SEQ_MAX`).
fn next_seq(seq: u32) -> u32 {
    if seq >= mmp::SEQ_MAX {
        1
    } else {
        seq + 1
    }
}

/// Who `m` says holds the filesystem, for messages.
fn holder(m: &MmpBlock) -> String {
    let age = now_secs().saturating_sub(m.time);
    let dev = m.bdevname_text();
    let dev = if dev.is_empty() {
        String::new()
    } else {
        format!(", device '{dev}'")
    };
    format!("node '{}'{dev}, last update {age} s ago", m.nodename_text())
}

impl Shared {
    fn read(&self) -> Result<MmpBlock> {
        let mut b = vec![0u8; self.block_size];
        self.dev
            .read_fresh(&mut b, self.block * self.block_size as u64)?;
        MmpBlock::decode(&b, self.csum_seed).map_err(|e| Error::from(e.at_block(self.block)))
    }

    /// Write sequence `seq` with this node's names.
    fn write(&self, seq: u32, check_interval: u16) -> Result<()> {
        let m = MmpBlock::new(
            seq,
            now_secs(),
            &self.nodename,
            &self.bdevname,
            check_interval,
        );
        let mut b = vec![0u8; self.block_size];
        m.encode_into(&mut b, self.csum_seed)?;
        self.dev
            .write_through(&b, self.block * self.block_size as u64)?;
        Ok(())
    }

    fn ours(&self, m: &MmpBlock, seq: u32) -> bool {
        m.seq == seq && m.nodename == mmp::name_field(&self.nodename)
    }

    /// The check interval the updater writes: twice the time its last update took, at
    /// least `MIN_CHECK_INTERVAL`, at most `MAX_CHECK_INTERVAL` (kmmpd's rule).
    fn check_interval_for(elapsed: Duration) -> u16 {
        let twice = elapsed.as_secs().saturating_mul(2);
        twice.clamp(
            u64::from(mmp::MIN_CHECK_INTERVAL),
            u64::from(mmp::MAX_CHECK_INTERVAL),
        ) as u16
    }

    fn lose(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.lost.is_some() {
            return;
        }
        st.lost = Some(why.clone());
        drop(st);
        if let Some(f) = &self.fence {
            f.close();
        }
        log::error!("rext4: {why}");
        if let Some(hook) = self.on_lost.get() {
            hook(why);
        }
    }

    /// The updater: every interval, check the block is still ours and write the next
    /// sequence.
    fn run(&self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let due = st.written + self.interval;
            let now = Instant::now();
            if st.stop || st.lost.is_some() {
                return;
            }
            if now < due {
                st = self
                    .wake
                    .wait_timeout(st, due - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
            let (seq, written) = (st.seq, st.written);
            drop(st);
            let outcome = match self.read() {
                Err(e) => Err(format!(
                    "multi-mount protection: the MMP block could not be read ({e}); \
                     the filesystem is shut down, since another node could take it"
                )),
                Ok(m) if !self.ours(&m, seq) => Err(format!(
                    "multi-mount protection: another node wrote the MMP block ({}); the \
                     filesystem seems to be mounted twice and is shut down",
                    holder(&m)
                )),
                Ok(_) => {
                    let next = next_seq(seq);
                    let ci = Self::check_interval_for(written.elapsed());
                    self.write(next, ci).map(|()| next).map_err(|e| {
                        format!(
                            "multi-mount protection: the MMP block could not be updated \
                             ({e}); the filesystem is shut down, since another node could \
                             take it"
                        )
                    })
                }
            };
            match outcome {
                Ok(next) => {
                    st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    st.seq = next;
                    st.written = Instant::now();
                }
                Err(why) => {
                    self.lose(why);
                    return;
                }
            }
        }
    }
}

impl Session {
    /// Take the MMP block of the filesystem whose superblock is `sb` on `dev` for a
    /// read-write open, waiting as the kernel does (see the module note); `bdevname`
    /// names the device in the block (the image's path as given); `fence` is the
    /// filesystem's device, closed if the block is lost. Refused with
    /// [`Error::InUse`] naming the holder, or `Corrupted` for a bad block.
    pub(crate) fn start(
        dev: Arc<dyn BlockDevice>,
        sb: &Superblock,
        bdevname: &[u8],
        fence: Arc<Fence>,
    ) -> Result<Session> {
        Self::start_waiting(dev, sb, bdevname, Some(fence), |secs| {
            std::thread::sleep(Duration::from_secs(secs))
        })
    }

    /// [`Session::start`] with the waits made by `wait(seconds)`.
    fn start_waiting(
        dev: Arc<dyn BlockDevice>,
        sb: &Superblock,
        bdevname: &[u8],
        fence: Option<Arc<Fence>>,
        wait: impl Fn(u64),
    ) -> Result<Session> {
        let block = sb.mmp_block;
        if block <= u64::from(sb.first_data_block) || block >= sb.blocks_count {
            return Err(Error::corrupted(
                format!("MMP block number {block} is outside the filesystem"),
                None,
            ));
        }
        let interval = u64::from(sb.mmp_interval.clamp(1, mmp::MAX_UPDATE_INTERVAL));
        let shared = Arc::new(Shared {
            dev,
            block,
            block_size: sb.block_size() as usize,
            csum_seed: sb.metadata_csum().then(|| sb.csum_seed()),
            interval: Duration::from_secs(interval),
            nodename: nodename(),
            bdevname: bdevname.to_vec(),
            state: Mutex::new(State {
                seq: 0,
                written: Instant::now(),
                lost: None,
                stop: false,
            }),
            wake: Condvar::new(),
            on_lost: OnceLock::new(),
            fence,
        });
        let first = shared.read()?;
        let ci = mmp::check_interval(sb.mmp_interval, &first);
        let mut wait_secs = 0;
        match first.state() {
            SeqState::Clean => {}
            SeqState::Fsck => {
                return Err(Error::InUse(format!(
                    "image is in use (multi-mount protection): e2fsck or another \
                     e2fsprogs tool has it ({}); if none runs any more on any node, \
                     `tune2fs -f -E clear_mmp` frees it",
                    holder(&first)
                )))
            }
            SeqState::Live(seq) => {
                wait_secs = mmp::wait_secs(ci);
                log::warn!(
                    "rext4: multi-mount protection: the MMP block is in use ({}); \
                     waiting {wait_secs} s to see whether its holder is alive",
                    holder(&first)
                );
                wait(wait_secs);
                let again = shared.read()?;
                if again.seq != seq {
                    return Err(Error::InUse(format!(
                        "image is in use on another node (multi-mount protection): {}",
                        holder(&again)
                    )));
                }
            }
        }
        let seq = new_seq();
        let start_ci = u16::try_from(interval.saturating_mul(2))
            .unwrap_or(mmp::MAX_CHECK_INTERVAL)
            .clamp(mmp::MIN_CHECK_INTERVAL, mmp::MAX_CHECK_INTERVAL);
        shared.write(seq, start_ci)?;
        if wait_secs > 0 {
            wait(wait_secs);
        }
        let check = shared.read()?;
        if !shared.ours(&check, seq) {
            return Err(Error::InUse(format!(
                "image is in use on another node (multi-mount protection): it took the \
                 MMP block while this open did ({})",
                holder(&check)
            )));
        }
        {
            let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.seq = seq;
            st.written = Instant::now();
        }
        let runner = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rext4-mmp".into())
            .spawn(move || runner.run())
            .map_err(Error::Io)?;
        Ok(Session {
            shared,
            thread: Some(thread),
        })
    }

    /// Call `hook` with the reason when the block is lost to another node (at once if
    /// it already was).
    pub(crate) fn on_lost(&self, hook: LostHook) {
        if self.shared.on_lost.set(hook).is_err() {
            return;
        }
        let lost = self.lost();
        if let (Some(why), Some(h)) = (lost, self.shared.on_lost.get()) {
            h(why);
        }
    }

    /// Why the block is no longer ours, if it is not.
    pub(crate) fn lost(&self) -> Option<String> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lost
            .clone()
    }

    /// Stop updating and mark the block CLEAN, unless another node has it now. Called
    /// after the filesystem's last write.
    pub(crate) fn stop(mut self) -> Result<()> {
        self.stop_thread();
        self.mark_clean()
    }

    fn stop_thread(&mut self) {
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.stop = true;
        }
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            // The updater itself may end the session (its hook's abort dropped the
            // last handle of the filesystem): it is on its way out already.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    fn mark_clean(&self) -> Result<()> {
        let seq = {
            let st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
            if st.lost.is_some() {
                return Ok(());
            }
            st.seq
        };
        let m = self.shared.read()?;
        if !self.shared.ours(&m, seq) {
            return Err(Error::InUse(format!(
                "multi-mount protection: another node wrote the MMP block ({}); it is \
                 left as that node wrote it",
                holder(&m)
            )));
        }
        self.shared.write(mmp::SEQ_CLEAN, m.check_interval)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop_thread();
            if let Err(e) = self.mark_clean() {
                log::warn!("rext4: multi-mount protection: marking the MMP block clean: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;
    use rext4_format::superblock::feature;

    /// A 1 KiB-block "filesystem" of 64 blocks whose block 20 is the MMP block.
    fn setup(seq: u32, node: &[u8]) -> (Arc<MemDevice>, Superblock) {
        let raw = {
            let d = crate::mkfs::mem_image(8 << 20);
            let mut b = vec![0u8; 1024];
            d.read_at(&mut b, 1024).expect("read sb");
            b
        };
        let mut sb = Superblock::decode_unchecked(&raw);
        sb.feature_incompat |= feature::INCOMPAT_MMP;
        sb.mmp_block = 20;
        sb.mmp_interval = 1;
        sb.blocks_count = 64;
        let seed = sb.metadata_csum().then(|| sb.csum_seed());
        let mut b = vec![0u8; sb.block_size() as usize];
        MmpBlock::new(seq, now_secs(), node, b"img", 5)
            .encode_into(&mut b, seed)
            .expect("encode");
        let bs = u64::from(sb.block_size());
        let dev64 = Arc::new(MemDevice::new(vec![0u8; (64 * bs) as usize]));
        dev64.write_at(&b, 20 * bs).expect("write");
        (dev64, sb)
    }

    fn read(dev: &MemDevice, sb: &Superblock) -> MmpBlock {
        let bs = u64::from(sb.block_size());
        let mut b = vec![0u8; bs as usize];
        dev.read_at(&mut b, 20 * bs).expect("read");
        MmpBlock::decode(&b, sb.metadata_csum().then(|| sb.csum_seed())).expect("decode")
    }

    #[test]
    fn clean_block_is_taken_without_waiting_and_left_clean() {
        let (dev, sb) = setup(mmp::SEQ_CLEAN, b"old");
        let waited = std::cell::Cell::new(0);
        let s = Session::start_waiting(dev.clone(), &sb, b"img", None, |n| waited.set(n))
            .expect("start");
        assert_eq!(waited.get(), 0);
        let m = read(&dev, &sb);
        assert!(matches!(m.state(), SeqState::Live(_)));
        assert_eq!(m.nodename_text().as_bytes(), &nodename()[..]);
        s.stop().expect("stop");
        assert_eq!(read(&dev, &sb).state(), SeqState::Clean);
    }

    #[test]
    fn fsck_sequence_is_refused_at_once() {
        let (dev, sb) = setup(mmp::SEQ_FSCK, b"fixer");
        let e = Session::start_waiting(dev.clone(), &sb, b"img", None, |_| panic!("waited"))
            .err()
            .expect("refused");
        assert!(matches!(&e, Error::InUse(m) if m.contains("e2fsck")), "{e}");
        assert_eq!(read(&dev, &sb).seq, mmp::SEQ_FSCK, "the block was changed");
    }

    #[test]
    fn a_stale_sequence_is_waited_out_then_taken() {
        let (dev, sb) = setup(42, b"crashed-node");
        let waits = std::cell::RefCell::new(Vec::new());
        let s = Session::start_waiting(dev.clone(), &sb, b"img", None, |n| {
            waits.borrow_mut().push(n)
        })
        .expect("start");
        // Twice 2 * 5 + 1 seconds: before reading again, and after the fresh write.
        assert_eq!(*waits.borrow(), vec![11, 11]);
        drop(s);
        assert_eq!(read(&dev, &sb).state(), SeqState::Clean);
    }

    #[test]
    fn a_live_holder_is_refused_by_name() {
        let (dev, sb) = setup(42, b"busy-node");
        let d2 = dev.clone();
        let sb2 = sb.clone();
        // The holder moves its sequence while we wait.
        let e = Session::start_waiting(dev.clone(), &sb, b"img", None, move |_| {
            let seed = sb2.metadata_csum().then(|| sb2.csum_seed());
            let mut b = vec![0u8; sb2.block_size() as usize];
            MmpBlock::new(43, now_secs(), b"busy-node", b"/dev/sdq", 5)
                .encode_into(&mut b, seed)
                .expect("encode");
            d2.write_at(&b, 20 * u64::from(sb2.block_size()))
                .expect("write");
        })
        .err()
        .expect("refused");
        let msg = e.to_string();
        assert!(
            matches!(e, Error::InUse(_)) && msg.contains("busy-node") && msg.contains("/dev/sdq"),
            "{msg}"
        );
        assert_eq!(read(&dev, &sb).seq, 43);
    }

    #[test]
    fn the_updater_moves_the_sequence_and_detects_another_writer() {
        let (dev, sb) = setup(mmp::SEQ_CLEAN, b"");
        let s = Session::start_waiting(dev.clone(), &sb, b"img", None, |_| {}).expect("start");
        let lost = Arc::new(Mutex::new(None::<String>));
        let l2 = lost.clone();
        s.on_lost(Box::new(move |why| *l2.lock().expect("lock") = Some(why)));
        let first = read(&dev, &sb).seq;
        // The interval is a second: within three the sequence has moved.
        let deadline = Instant::now() + Duration::from_secs(10);
        while read(&dev, &sb).seq == first {
            assert!(Instant::now() < deadline, "the sequence never moved");
            std::thread::sleep(Duration::from_millis(100));
        }
        // Another node writes the block: the next update notices and stops.
        let seed = sb.metadata_csum().then(|| sb.csum_seed());
        let mut b = vec![0u8; sb.block_size() as usize];
        MmpBlock::new(7, now_secs(), b"intruder", b"/dev/sdz", 5)
            .encode_into(&mut b, seed)
            .expect("encode");
        dev.write_at(&b, 20 * u64::from(sb.block_size()))
            .expect("write");
        while lost.lock().expect("lock").is_none() {
            assert!(Instant::now() < deadline, "the other writer went unnoticed");
            std::thread::sleep(Duration::from_millis(100));
        }
        let why = lost.lock().expect("lock").clone().unwrap_or_default();
        assert!(
            why.contains("intruder") && why.contains("mounted twice"),
            "{why}"
        );
        // Not ours any more: left as the other node wrote it.
        s.stop().expect("stop");
        assert_eq!(read(&dev, &sb).seq, 7);
    }

    #[test]
    fn a_bad_block_number_or_block_is_corruption() {
        let (dev, mut sb) = setup(mmp::SEQ_CLEAN, b"");
        let mut bad = sb.clone();
        bad.mmp_block = 64;
        assert!(matches!(
            Session::start_waiting(dev.clone(), &bad, b"img", None, |_| {}),
            Err(Error::Corrupted { .. })
        ));
        dev.write_at(&[0xAA; 16], 20 * u64::from(sb.block_size()))
            .expect("write");
        assert!(matches!(
            Session::start_waiting(dev.clone(), &sb, b"img", None, |_| {}),
            Err(Error::Corrupted { .. })
        ));
        sb.mmp_block = 0;
        assert!(Session::start_waiting(dev, &sb, b"img", None, |_| {}).is_err());
    }
}
