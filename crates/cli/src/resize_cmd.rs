//! `rext4 resize IMAGE SIZE|min`: grow or shrink an unmounted image offline, as
//! resize2fs does, crash-safe (see `rext4::resize`); `-P` prints the smallest size the
//! contents fit in without changing anything.
//!
//! SIZE is a number of filesystem blocks, or a size with a suffix as mkfs takes it
//! (`s` 512-byte sectors, `K`, `M`, `G`, `T`); `min` is the smallest size. Exit codes:
//! 0 done, 1 refused or failed (the image is as it was, or resized: never between),
//! 2 bad usage (a malformed size).

use std::path::PathBuf;

use rext4::resize::Target;

use crate::term;

#[derive(clap::Args)]
pub struct ResizeArgs {
    /// Print the estimated minimum size (in blocks) and change nothing, as resize2fs -P.
    #[arg(short = 'P', long = "print-min")]
    print_min: bool,
    /// Print what was done.
    #[arg(short = 'v', long)]
    verbose: bool,
    /// Commit the shrink's moves every N (tests: every move a state a kill can leave).
    #[arg(long, hide = true, default_value_t = 0)]
    commit_every: u32,
    /// The image file (or block device).
    image: PathBuf,
    /// New size: blocks, or with a unit (s, K, M, G, T), or `min`.
    size: Option<String>,
}

pub fn run(a: ResizeArgs) -> Result<(), (u8, String)> {
    let name = a.image.display().to_string();
    let fail = |e: rext4::Error| (1u8, format!("{name}: {}", term::reason(&e)));
    if a.print_min {
        let n = rext4::resize::min_size(&a.image).map_err(fail)?;
        term::out(&format!("Estimated minimum size of the filesystem: {n}\n"));
        return Ok(());
    }
    let Some(size) = a.size.as_deref() else {
        return Err((
            2,
            "missing SIZE (a size, a number of blocks, or min)".into(),
        ));
    };
    let target = if size.eq_ignore_ascii_case("min") {
        Target::Min
    } else {
        let bs = rext4::resize::block_size(&a.image).map_err(fail)?;
        let bytes = rext4::mkfs::parse_size(size, Some(bs))
            .ok_or_else(|| (2u8, format!("invalid size '{size}'")))?;
        Target::Blocks(bytes / u64::from(bs))
    };
    let opts = rext4::resize::ResizeOptions {
        commit_every: a.commit_every,
    };
    let r = rext4::resize::resize_with(&a.image, target, &opts).map_err(fail)?;
    for w in &r.warnings {
        crate::term::errln!("{name}: {w}");
    }
    if a.verbose || r.old_blocks != r.new_blocks {
        term::out(&format!(
            "{name}: {} blocks of {} bytes, was {}{}{}\n",
            r.new_blocks,
            r.block_size,
            r.old_blocks,
            if r.moved_blocks + r.moved_inodes > 0 {
                format!(
                    "; moved {} blocks and {} inodes",
                    r.moved_blocks, r.moved_inodes
                )
            } else {
                String::new()
            },
            if r.journal_moved {
                " and the journal"
            } else {
                ""
            }
        ));
    } else {
        term::out(&format!(
            "{name}: already {} blocks; nothing to do\n",
            r.new_blocks
        ));
    }
    Ok(())
}
