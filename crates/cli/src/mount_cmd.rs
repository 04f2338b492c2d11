//! `rext4 mount [-o OPTIONS] [-f] IMAGE MOUNTPOINT`: serve an ext4 image through FUSE
//! (see `rext4_fuse` for the options and the mount's lifetime). Without `-f` the
//! command returns once the mount is up and a daemon serves it; with `-f` it serves
//! until the mount point is unmounted (`fusermount3 -u`, `umount`) or it gets
//! SIGINT/SIGTERM, then commits and closes the image.

use std::path::PathBuf;

use clap::ArgAction;

#[derive(clap::Args, Debug, Clone)]
pub struct MountArgs {
    /// Mount options, comma-separated (ro, rw, errors=continue|remount-ro, commit=SECS,
    /// early_commit=MS (default 200: what the server got reaches the image file this
    /// soon, so a crash of the server alone loses only that; 0 off),
    /// cache_mb=MIB (the engine's page cache bound; default 1/16 of RAM, 64 MiB to 2 GiB),
    /// threads=N, mb_prefetch=N and mb_prefetch_limit=N (block bitmaps one allocation
    /// reads together and in all; the kernel's defaults), no_prefetch_block_bitmaps (no
    /// background bitmap prefetch after mount), bdi_max_ratio=PCT (dirty-page share, default 40; 0 keeps
    /// the kernel's 1% strict FUSE limit), log=FILE (append the server's messages to
    /// FILE; default: syslog for the daemon, standard error with -f), allow_other,
    /// default_permissions, nodefault_permissions, nowriteback_cache, debug, dev, suid,
    /// noexec, relatime (default), strictatime, noatime, nodiratime...).
    #[arg(short = 'o', value_name = "OPTIONS", action = ArgAction::Append)]
    pub options: Vec<String>,
    /// Stay in the foreground (do not fork a daemon); messages go to standard error.
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// Image file or block device holding the ext4 filesystem.
    pub image: PathBuf,
    /// Directory to mount it on.
    pub mountpoint: PathBuf,
}

pub fn run(args: MountArgs) -> Result<(), String> {
    let mut opts = rext4_fuse::MountOptions::default();
    for list in &args.options {
        rext4_fuse::apply_options(&mut opts, list)?;
    }
    if args.foreground {
        opts.foreground = true;
    }
    rext4_fuse::mount(&args.image, &args.mountpoint, &opts)
}

#[derive(clap::Args, Debug, Clone)]
pub struct UmountArgs {
    /// Longest wait for the server to close the image, in seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Where a `rext4 mount` is mounted.
    pub mountpoint: PathBuf,
}

/// Unmount, then wait for the server: unlike a bare `fusermount3 -u`, the image is
/// committed, marked clean and unlocked when this returns. A mount whose server died
/// is detached and its image recovered, with a warning, exit 0 (as umount(8) detaches
/// a dead FUSE mount without complaint).
pub fn umount(args: UmountArgs) -> Result<(), String> {
    rext4_fuse::umount_and_wait(
        &args.mountpoint,
        std::time::Duration::from_secs(args.timeout),
    )
    .map(drop)
}

#[derive(clap::Args, Debug, Clone)]
pub struct SyncArgs {
    /// Where rext4 mounts are mounted (or any file or directory in them).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

/// `rext4 sync MNT...`: syncfs(2) makes the kernel write its dirty pages of the mount
/// to the server and waits for them; then the server's sync ioctl writes everything
/// back, commits the journal and flushes the image before it answers.
pub fn sync(args: SyncArgs) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    for p in &args.paths {
        let f = std::fs::File::open(p)
            .map_err(|e| format!("{}: {}", p.display(), crate::term::io_reason(&e)))?;
        // SAFETY: syncfs on a descriptor we own.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!(
                "{}: syncfs: {}",
                p.display(),
                crate::term::io_reason(&e)
            ));
        }
        // SAFETY: an _IO ioctl (no argument) on a descriptor we own.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), rext4_fuse::REXT4_IOC_SYNC as _) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ENOTTY | libc::EINVAL | libc::ENOSYS) => {
                    format!("{}: not on a rext4 mount", p.display())
                }
                _ => format!("{}: {}", p.display(), crate::term::io_reason(&e)),
            });
        }
    }
    Ok(())
}
