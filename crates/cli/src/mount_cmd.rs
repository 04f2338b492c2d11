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
    /// cache_mb=MIB (the engine's page cache bound; default 1/16 of RAM, 64 MiB to 2 GiB),
    /// threads=N, bdi_max_ratio=PCT (dirty-page share, default 40; 0 keeps
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
