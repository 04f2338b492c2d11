#[allow(unused)]
use std::convert::TryInto;
#[allow(unused)]
use std::ffi::OsStr;
use std::io;

use crate::INodeNo;
use crate::channel::ChannelSender;
use crate::ll::Version;
use crate::ll::fuse_abi::FUSE_KERNEL_MINOR_VERSION;
use crate::ll::fuse_abi::FUSE_KERNEL_VERSION;
use crate::ll::fuse_abi::FUSE_NOTIFY_INC_EPOCH_VERSION;
use crate::ll::fuse_abi::fuse_notify_code as notify_code;
use crate::ll::notify::Notification;

/// A handle to a pending `poll()` request.
#[derive(Copy, Clone, Debug)]
pub struct PollHandle(pub u64);

/// A [handle](PollHandle) to a pending `poll()` request coupled with notifier reference.
/// Can be saved and used to notify the kernel when a poll is ready.
#[derive(Clone)]
pub struct PollNotifier {
    handle: PollHandle,
    notifier: Notifier,
}

impl PollNotifier {
    pub(crate) fn new(cs: ChannelSender, kh: PollHandle, kernel_abi: Option<Version>) -> Self {
        Self {
            handle: kh,
            notifier: Notifier::new(cs, kernel_abi),
        }
    }

    /// Handle associated with this poll notifier.
    pub fn handle(&self) -> PollHandle {
        self.handle
    }

    /// Notify the kernel that the associated file handle is ready to be polled.
    /// # Errors
    /// Returns an error if the kernel rejects the notification.
    pub fn notify(self) -> io::Result<()> {
        self.notifier.poll(self.handle)
    }
}

impl std::fmt::Debug for PollNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PollHandle").field(&self.handle).finish()
    }
}

/// A handle by which the application can send notifications to the server
#[derive(Debug, Clone)]
pub struct Notifier {
    sender: ChannelSender,
    /// The protocol version the kernel offered at INIT (`None` before it): a
    /// notification newer than the connection's version is refused here (rext4
    /// addition, as upstream fuser's main branch).
    kernel_abi: Option<Version>,
}

impl Notifier {
    pub(crate) fn new(cs: ChannelSender, kernel_abi: Option<Version>) -> Self {
        Self {
            sender: cs,
            kernel_abi,
        }
    }

    /// Make every cached directory entry stale at once, by incrementing the
    /// connection's epoch (FUSE_NOTIFY_INC_EPOCH; rext4 addition under upstream
    /// fuser's name and signature). A dentry looked up before fails its next
    /// revalidation and is looked up again; an inode that no dentry and no open file
    /// holds any more is then dropped, so its attributes are read afresh.
    /// # Errors
    /// `ENOTSUP` when the connection's protocol is older than 7.44 (the kernel would
    /// answer EINVAL); an error if the kernel rejects the notification.
    pub fn inc_epoch(&self) -> io::Result<()> {
        if self
            .negotiated_abi()
            .is_none_or(|v| v < FUSE_NOTIFY_INC_EPOCH_VERSION)
        {
            return Err(io::Error::from_raw_os_error(libc::ENOTSUP));
        }
        self.send(
            notify_code::FUSE_NOTIFY_INC_EPOCH,
            &Notification::new_inc_epoch(),
        )
    }

    /// The connection's protocol version: the lower of the kernel's and this crate's
    /// (the kernel takes the version of the INIT reply as the connection's).
    fn negotiated_abi(&self) -> Option<Version> {
        self.kernel_abi
            .map(|k| Version(FUSE_KERNEL_VERSION, FUSE_KERNEL_MINOR_VERSION).min(k))
    }

    /// Notify poll clients of I/O readiness
    /// # Errors
    /// Returns an error if the kernel rejects the notification.
    pub fn poll(&self, kh: PollHandle) -> io::Result<()> {
        let notif = Notification::new_poll(kh);
        self.send(notify_code::FUSE_POLL, &notif)
    }

    /// Invalidate the kernel cache for a given directory entry
    /// # Errors
    /// Returns an error if the notification data is too large.
    /// Returns an error if the kernel rejects the notification.
    pub fn inval_entry(&self, parent: INodeNo, name: &OsStr) -> io::Result<()> {
        let notif = Notification::new_inval_entry(parent, name).map_err(Self::too_big_err)?;
        self.send_inval(notify_code::FUSE_NOTIFY_INVAL_ENTRY, &notif)
    }

    /// Invalidate the kernel cache for a given inode (metadata and
    /// data in the given range)
    /// # Errors
    /// Returns an error if the kernel rejects the notification.
    pub fn inval_inode(&self, ino: INodeNo, offset: i64, len: i64) -> io::Result<()> {
        let notif = Notification::new_inval_inode(ino, offset, len);
        self.send_inval(notify_code::FUSE_NOTIFY_INVAL_INODE, &notif)
    }

    /// Update the kernel's cached copy of a given inode's data
    /// # Errors
    /// Returns an error if the notification data is too large.
    /// Returns an error if the kernel rejects the notification.
    pub fn store(&self, ino: INodeNo, offset: u64, data: &[u8]) -> io::Result<()> {
        let notif = Notification::new_store(ino, offset, data).map_err(Self::too_big_err)?;
        // Not strictly an invalidate, but the inode we're operating
        // on may have been evicted anyway, so treat is as such
        self.send_inval(notify_code::FUSE_NOTIFY_STORE, &notif)
    }

    /// Invalidate the kernel cache for a given directory entry and inform
    /// inotify watchers of a file deletion.
    /// # Errors
    /// Returns an error if the notification data is too large.
    /// Returns an error if the kernel rejects the notification.
    pub fn delete(&self, parent: INodeNo, child: INodeNo, name: &OsStr) -> io::Result<()> {
        let notif = Notification::new_delete(parent, child, name).map_err(Self::too_big_err)?;
        self.send_inval(notify_code::FUSE_NOTIFY_DELETE, &notif)
    }

    #[allow(unused)]
    fn send_inval(&self, code: notify_code, notification: &Notification<'_>) -> io::Result<()> {
        match self.send(code, notification) {
            // ENOENT is harmless for an invalidation (the
            // kernel may have already dropped the cached
            // entry on its own anyway), so ignore it.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            x => x,
        }
    }

    fn send(&self, code: notify_code, notification: &Notification<'_>) -> io::Result<()> {
        notification
            .with_iovec(code, |iov| self.sender.send(iov))
            .map_err(Self::too_big_err)?
    }

    /// Create an error for indicating when a notification message
    /// would exceed the capacity that its length descriptor field is
    /// capable of encoding.
    #[allow(
        clippy::io_other_error,
        reason = "upstream fuser's code as upstream has it (rext4 lints the copy with a newer clippy)"
    )]
    fn too_big_err(tfie: std::num::TryFromIntError) -> io::Error {
        io::Error::new(io::ErrorKind::Other, format!("Data too large: {tfie:?}"))
    }
}

#[cfg(test)]
mod test {
    use std::sync::Arc;

    use super::*;
    use crate::channel::Channel;
    use crate::dev_fuse::DevFuse;

    /// A notifier writing to a file in place of /dev/fuse, and the file.
    fn notifier(kernel_abi: Option<Version>) -> (Notifier, tempfile::NamedTempFile) {
        let f = tempfile::NamedTempFile::new().unwrap();
        let dev = Arc::new(DevFuse(f.reopen().unwrap()));
        (Notifier::new(Channel::new(dev).sender(), kernel_abi), f)
    }

    #[test]
    fn inc_epoch_is_refused_before_7_44() {
        for abi in [
            None,
            Some(Version(7, 6)),
            Some(Version(7, 40)),
            Some(Version(7, 43)),
        ] {
            let (n, f) = notifier(abi);
            let err = n.inc_epoch().unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::ENOTSUP), "{abi:?}");
            assert_eq!(
                std::fs::read(f.path()).unwrap(),
                b"",
                "{abi:?}: nothing sent"
            );
        }
    }

    #[test]
    fn inc_epoch_sends_a_bare_header_from_7_44() {
        for abi in [Version(7, 44), Version(7, 45)] {
            let (n, f) = notifier(Some(abi));
            n.inc_epoch().unwrap();
            let mut want = 16u32.to_ne_bytes().to_vec();
            want.extend(8i32.to_ne_bytes());
            want.extend(0u64.to_ne_bytes());
            assert_eq!(std::fs::read(f.path()).unwrap(), want, "{abi:?}");
        }
    }

    /// The connection speaks the lower of the two versions: a kernel offering more than
    /// this crate replies with does not make the rest part of it.
    #[test]
    fn negotiated_abi_is_the_lower_version() {
        let ours = Version(FUSE_KERNEL_VERSION, FUSE_KERNEL_MINOR_VERSION);
        assert_eq!(
            notifier(Some(Version(7, 99))).0.negotiated_abi(),
            Some(ours)
        );
        assert_eq!(
            notifier(Some(Version(7, 8))).0.negotiated_abi(),
            Some(Version(7, 8))
        );
        assert_eq!(notifier(None).0.negotiated_abi(), None);
    }
}
