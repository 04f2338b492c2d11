//! The commit protocol: group commit, with the transaction written outside the write
//! lock. Written once, generic over its steps ([`Steps`]), so the filesystem runs it
//! (`Fs::commit_concurrently`) and the unit tests run the same function under shuttle
//! with random and PCT schedules, on a model of transactions.
//!
//! The protocol, for a sync (`mine` = `None`) or an fsync (`mine` = the number of the
//! first sync to start after its changes, read before calling):
//! 1. take the write lock (`Fs::write_lock`); an fsync whose sync number has completed
//!    (`syncs done > mine`) returns — another thread's commit carried its changes;
//! 2. try the journal's mutex; when a commit holds it, give the write lock up, wait for
//!    the journal's mutex without it (so operations go on into the running
//!    transaction), and start again — the commit waited for may have been this one's;
//! 3. with both: close the running transaction (it gets the next sync number, its dirty
//!    blocks are taken), give the write lock up, and write it under the journal's
//!    mutex alone; once durable, `syncs done` passes its number.
//!
//! What must hold (and what the model checks): an fsync returns only once every
//! change made before it started is durable; a transaction is closed only with both
//! locks and written only with the journal's; the journal's mutex is never waited for
//! with the write lock held (the lock order: write lock, then journal), so no schedule
//! deadlocks.

/// The steps of a commit, as the filesystem (or a model) takes them.
pub(crate) trait Steps {
    /// The write lock, held.
    type Write;
    /// The journal's mutex, held.
    type Journal;
    /// A closed transaction.
    type Closed;
    type Error;

    fn lock_write(&self) -> Self::Write;
    /// Give the write lock up (without the checks a release after an operation makes).
    fn release_write(&self, w: Self::Write);
    /// The journal's mutex if no commit holds it.
    fn try_journal(&self) -> Option<Self::Journal>;
    /// Wait until the commit that holds the journal's mutex is done.
    fn wait_journal(&self);
    /// Syncs completed: a sync numbered `n` is durable once this passes `n`.
    fn syncs_done(&self) -> u64;
    /// With the write lock held: the error a commit must fail with (a shut-down
    /// filesystem), if any.
    fn refused(&self) -> Result<(), Self::Error>;
    /// Whether there is a log to write to (a filesystem without a journal syncs in
    /// place, under the write lock: `sync_in_place`).
    fn journaled(&self, j: &Self::Journal) -> bool;
    fn sync_in_place(&self, w: Self::Write, j: Self::Journal) -> Result<(), Self::Error>;
    /// Close the running transaction (both locks held); it takes the next sync number.
    fn close(
        &self,
        w: &mut Self::Write,
        j: &mut Self::Journal,
    ) -> Result<Self::Closed, Self::Error>;
    /// Write a closed transaction (the journal's mutex held, not the write lock); once
    /// it is durable the sync count passes its number.
    fn write(
        &self,
        j: Self::Journal,
        closed: Result<Self::Closed, Self::Error>,
    ) -> Result<(), Self::Error>;
}

/// Commit (`mine` = `None`), or make sure the sync numbered `mine` or a later one has
/// completed (an fsync). See the module note.
pub(crate) fn commit<S: Steps>(s: &S, mine: Option<u64>) -> Result<(), S::Error> {
    loop {
        let w = s.lock_write();
        let refused = s.refused();
        if refused.is_err() || mine.is_some_and(|m| s.syncs_done() > m) {
            s.release_write(w);
            return refused;
        }
        let Some(mut j) = s.try_journal() else {
            // A commit is being written: wait for it without the write lock (the
            // writers go on meanwhile), then look again — it may have been ours.
            s.release_write(w);
            s.wait_journal();
            continue;
        };
        if !s.journaled(&j) {
            return s.sync_in_place(w, j);
        }
        let mut w = w;
        let closed = s.close(&mut w, &mut j);
        s.release_write(w);
        return s.write(j, closed);
    }
}

#[cfg(test)]
mod tests {
    //! The protocol under shuttle: threads make changes (under the write lock) and
    //! fsync them, another syncs; every fsync must find its change in the log when it
    //! returns, in every schedule tried. A broken variant (an fsync that trusts the
    //! sync before its own) must be caught.

    use super::*;
    use shuttle::sync::atomic::{AtomicU64, Ordering::SeqCst};
    use shuttle::sync::{Mutex, MutexGuard};
    use std::sync::Arc;

    #[derive(Default)]
    struct Running {
        changes: Vec<u32>,
    }

    #[derive(Default)]
    struct Log {
        durable: Vec<u32>,
        /// Transactions written, by number, in the order they were written.
        written: Vec<u64>,
    }

    #[derive(Default)]
    struct Model {
        write: Mutex<Running>,
        journal: Mutex<Log>,
        started: AtomicU64,
        done: AtomicU64,
        /// The broken variant: syncs count as done one early.
        off_by_one: bool,
    }

    struct Txn {
        n: u64,
        changes: Vec<u32>,
    }

    impl<'a> Steps for &'a Model {
        type Write = MutexGuard<'a, Running>;
        type Journal = MutexGuard<'a, Log>;
        type Closed = Txn;
        type Error = ();

        fn lock_write(&self) -> Self::Write {
            self.write.lock().unwrap_or_else(|p| p.into_inner())
        }
        fn release_write(&self, w: Self::Write) {
            drop(w);
        }
        fn try_journal(&self) -> Option<Self::Journal> {
            self.journal.try_lock().ok()
        }
        fn wait_journal(&self) {
            drop(self.journal.lock().unwrap_or_else(|p| p.into_inner()));
        }
        fn syncs_done(&self) -> u64 {
            self.done.load(SeqCst) + u64::from(self.off_by_one)
        }
        fn refused(&self) -> Result<(), ()> {
            Ok(())
        }
        fn journaled(&self, _j: &Self::Journal) -> bool {
            true
        }
        fn sync_in_place(&self, _w: Self::Write, _j: Self::Journal) -> Result<(), ()> {
            unreachable!("the model always has a journal")
        }
        fn close(&self, w: &mut Self::Write, _j: &mut Self::Journal) -> Result<Txn, ()> {
            let n = self.started.fetch_add(1, SeqCst);
            Ok(Txn {
                n,
                changes: std::mem::take(&mut w.changes),
            })
        }
        fn write(&self, mut j: Self::Journal, closed: Result<Txn, ()>) -> Result<(), ()> {
            let t = closed?;
            assert!(
                j.written.last().is_none_or(|&last| last + 1 == t.n),
                "transactions written out of order: {:?} then {}",
                j.written,
                t.n
            );
            // The log writes take a while: others run meanwhile.
            shuttle::thread::yield_now();
            j.durable.extend(t.changes);
            j.written.push(t.n);
            self.done.fetch_max(t.n + 1, SeqCst);
            Ok(())
        }
    }

    /// Two threads change and fsync twice each, a third syncs: every fsync's change
    /// is durable when it returns.
    fn scenario(off_by_one: bool) {
        let m = Arc::new(Model {
            off_by_one,
            ..Model::default()
        });
        let mut threads = Vec::new();
        for t in 0..2u32 {
            let m = m.clone();
            threads.push(shuttle::thread::spawn(move || {
                for round in 0..2 {
                    let id = t * 10 + round;
                    m.write
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .changes
                        .push(id);
                    let mine = m.started.load(SeqCst);
                    commit(&&*m, Some(mine)).expect("fsync");
                    let log = m.journal.lock().unwrap_or_else(|p| p.into_inner());
                    assert!(
                        log.durable.contains(&id),
                        "fsync of change {id} returned before it was durable"
                    );
                }
            }));
        }
        let s = m.clone();
        threads.push(shuttle::thread::spawn(move || {
            commit(&&*s, None).expect("sync");
        }));
        for t in threads {
            t.join().expect("thread");
        }
    }

    #[test]
    fn group_commit_under_random_schedules() {
        shuttle::check_random(|| scenario(false), 3000);
    }

    #[test]
    fn group_commit_under_pct_schedules() {
        shuttle::check_pct(|| scenario(false), 3000, 3);
    }

    /// The model catches a broken protocol: an fsync satisfied by the sync before its
    /// own returns while its change is still in the running transaction.
    #[test]
    fn the_model_catches_an_off_by_one_fsync() {
        crate::fs::model_check::expect_caught(
            &"an fsync trusting the sync before its own",
            "returned before it was durable",
            || shuttle::check_random(|| scenario(true), 3000),
        );
    }
}
