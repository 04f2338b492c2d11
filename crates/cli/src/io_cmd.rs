//! `rext4 io [-f] [-r] -c CMD [-c CMD ...] IMAGE:/path`: an xfs_io-like command shell
//! over one file of an image, through the embedding API (inode-level calls).
//!
//! Commands, arguments and output follow xfs_io (checked against xfs_io 6.1 on a
//! kernel ext4 mount): `pwrite [-b bs] [-S seed] [-q] off len` (pattern 0xcd, 4096-byte
//! writes), `pread [-b bs] [-qv] off len` (xfs_io's hexdump with -v), `truncate off`,
//! `falloc [-k] off len`, `fpunch off len`, `fcollapse off len`, `finsert off len`,
//! `fzero [-k] off len`, `fsync`, `fdatasync`,
//! `stat [-v]`, `fiemap [-lv] [off [len]]` (512-byte units, holes as "hole", flags
//! 0x800 unwritten and 0x1 last in -v), `help`, `quit`, and the memory-mapping
//! commands over the engine's page cache (`File::map`: coherent with pread/pwrite,
//! written back like any dirty page): `mmap [N] | [-rwx] [off len]` (list, select or
//! create a mapping; addresses are made up, as there is no address space here),
//! `mread [-f|-v] [-r] [off len]`, `mwrite [-r] [-S seed] [off len]` (default seed
//! 'X'), `msync [-ais] [off len]`, `munmap`. Accessing a page wholly past the end of
//! the file is an error here where xfs_io dies of SIGBUS. Numbers take xfs_io's suffixes
//! (cvtnum): k/m/g/t/p/e (powers of 1024), s (512-byte sectors), b (the block size);
//! 0x and 0 prefixes select hex and octal.
//!
//! Errors print as xfs_io prints them ("pwrite: No space left on device"); commands
//! keep running in order after a failure and the exit status is 1 if any failed. Two
//! deliberate differences: xfs_io exits 0 after an unknown command, a wrong argument
//! count or a failed fzero; here those count as failures too. With -r the write
//! commands fail as they do on a read-only descriptor (EBADF; truncate EINVAL).
//! Times print in UTC, like the rest of this tool.
//!
//! On SIGINT/SIGTERM/SIGHUP (`interrupt`) the shell stops between requests of a
//! pwrite or pread (reporting what was done) and runs no further command; the image
//! is then closed as on success. A closed standard output or error stops nothing.

use std::io::Write;
use std::time::{Duration, Instant};

use rext4::format::inode::mode as imode;
use rext4::map::MAX_LOGICAL;
use rext4::{Error, FallocMode, FileType, Fs, FsOptions, Ino, Mapping};

use crate::spec;
use crate::timefmt;
use crate::write_cmds::{self, caller, Failure};

/// Arguments of `rext4 io`.
#[derive(clap::Args)]
pub struct IoArgs {
    /// Create the file if it does not exist (mode 0600).
    #[arg(short = 'f')]
    create: bool,
    /// Open read-only: write commands fail, the image is not modified.
    #[arg(short = 'r')]
    read_only: bool,
    /// A command to run (repeatable; run in order), e.g. -c "pwrite 0 64k".
    #[arg(short = 'c', required = true, allow_hyphen_values = true)]
    cmds: Vec<String>,
    /// The file: IMAGE:/path.
    spec: String,
}

impl IoArgs {
    /// Whether the command opens the image for writing.
    pub fn writes(&self) -> bool {
        !self.read_only || self.create
    }
}

use crate::term::strerror;

/// The POSIX reason for an engine error, as xfs_io would print it; for corruption,
/// device and unsupported-feature errors the engine's detail follows in parentheses
/// (strerror alone would hide what went wrong).
fn reason(e: &Error) -> String {
    let base = strerror(e.errno());
    match e {
        Error::Io(io) => crate::term::io_reason(io),
        Error::Corrupted { .. }
        | Error::BadImage(_)
        | Error::Unsupported(_)
        | Error::NotExt4(_)
        | Error::InUse(_) => {
            format!("{base} ({e})")
        }
        _ => base,
    }
}

/// xfs_io's number syntax: an integer (decimal, 0x hex, 0 octal) with an optional
/// suffix: b (block size), s (512), k, m, g, t, p, e (powers of 1024).
pub fn cvtnum(s: &str, block_size: u64) -> Option<u64> {
    let b = s.as_bytes();
    let (radix, start) = if b.len() > 2 && b[0] == b'0' && (b[1] == b'x' || b[1] == b'X') {
        (16, 2)
    } else if b.len() > 1 && b[0] == b'0' {
        (8, 1)
    } else {
        (10, 0)
    };
    let digits = b[start..]
        .iter()
        .take_while(|c| (**c as char).is_digit(radix))
        .count();
    if digits == 0 && radix != 8 {
        return None;
    }
    let n = if digits == 0 {
        0
    } else {
        u64::from_str_radix(&s[start..start + digits], radix).ok()?
    };
    let mult = match &s[start + digits..] {
        "" => 1,
        suf if suf.len() == 1 => match suf.as_bytes()[0].to_ascii_lowercase() {
            b'b' => block_size,
            b's' => 512,
            b'k' => 1 << 10,
            b'm' => 1 << 20,
            b'g' => 1 << 30,
            b't' => 1 << 40,
            b'p' => 1 << 50,
            b'e' => 1 << 60,
            _ => return None,
        },
        _ => return None,
    };
    n.checked_mul(mult)
}

/// strtoul(s, 0)-like, for the pattern seed.
fn parse_ulong(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() > 2 && b[0] == b'0' && (b[1] == b'x' || b[1] == b'X') {
        u64::from_str_radix(&s[2..], 16).ok()
    } else if b.len() > 1 && b[0] == b'0' {
        u64::from_str_radix(&s[1..], 8).ok()
    } else {
        s.parse().ok()
    }
}

/// xfs_io's human-readable sizes: "64 KiB", "2.035 GiB", "48.000000 bytes".
pub fn cvtstr(v: f64) -> String {
    const UNITS: [(f64, &str); 6] = [
        ((1u64 << 60) as f64, "EiB"),
        ((1u64 << 50) as f64, "PiB"),
        ((1u64 << 40) as f64, "TiB"),
        ((1u64 << 30) as f64, "GiB"),
        ((1u64 << 20) as f64, "MiB"),
        ((1u64 << 10) as f64, "KiB"),
    ];
    // xfs_io prints whole numbers (that fit an int) without decimals.
    let precise = v.fract() == 0.0 && v.abs() < 2_147_483_648.0;
    for (unit, name) in UNITS {
        if v >= unit {
            let x = v / unit;
            return if precise {
                format!("{} {name}", fmt_float(x, 0))
            } else {
                format!("{} {name}", fmt_float(x, 3))
            };
        }
    }
    format!("{} bytes", fmt_float(v, 6))
}

/// printf("%.*f") including glibc's spelling of NaN and infinity.
fn fmt_float(v: f64, prec: usize) -> String {
    if v.is_nan() {
        "-nan".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{v:.prec$}")
    }
}

/// xfs_io's elapsed time: "0.0000 sec" below a second, "H:MM:SS.cc" above.
pub fn timestr(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        format!("{:.4} sec", d.as_secs_f64())
    } else {
        format!(
            "{}:{:02}:{:02}.{:02}",
            s / 3600,
            s / 60 % 60,
            s % 60,
            d.subsec_millis() / 10
        )
    }
}

/// The two report lines of pwrite and pread.
pub fn report(verb: &str, done: u64, asked: u64, off: u64, ops: u64, d: Duration) -> String {
    let secs = d.as_secs_f64();
    let rate = done as f64 / secs;
    let ops_rate = ops as f64 / secs;
    format!(
        "{verb} {done}/{asked} bytes at offset {off}\n{}, {ops} ops; {} ({}/sec and {} ops/sec)\n",
        cvtstr(done as f64),
        timestr(d),
        cvtstr(rate),
        fmt_float(ops_rate, 4)
    )
}

/// xfs_io's `pread -v` dump: "%08x:  " + 16 "%02x " + " " + alphanumerics ('.' else).
pub fn hexdump(data: &[u8], base: u64) -> String {
    let mut out = String::new();
    for (i, line) in data.chunks(16).enumerate() {
        out.push_str(&format!("{:08x}:  ", base + 16 * i as u64));
        for b in line {
            out.push_str(&format!("{b:02x} "));
        }
        out.push(' ');
        for &b in line {
            out.push(if b.is_ascii_alphanumeric() {
                b as char
            } else {
                '.'
            });
        }
        out.push('\n');
    }
    out
}

/// Split a command line into words: whitespace separates, single and double quotes
/// group (without escapes), as xfs_io's line splitter does.
pub fn split_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => cur.push(c),
            None if c == '"' || c == '\'' => {
                quote = Some(c);
                in_word = true;
            }
            None if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            None => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return Err(format!("unterminated quote in {line:?}"));
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// One command of the table: name, argument synopsis, one-line help, option letters
/// (getopt syntax), argument count range.
struct CmdInfo {
    name: &'static str,
    args: &'static str,
    help: &'static str,
    opts: &'static str,
    min: usize,
    max: usize,
}

const CMDS: &[CmdInfo] = &[
    CmdInfo {
        name: "falloc",
        args: "[-k] off len",
        help: "allocates space associated with part of a file via fallocate",
        opts: "k",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "fcollapse",
        args: "off len",
        help: "de-allocates space and eliminates the hole by shifting extents",
        opts: "",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "fdatasync",
        args: "",
        help: "calls fdatasync(2) to flush the files in-core data to disk",
        opts: "",
        min: 0,
        max: 0,
    },
    CmdInfo {
        name: "fiemap",
        args: "[-lv] [offset [len]]",
        help: "print block mapping for a file",
        opts: "aln:v",
        min: 0,
        max: 2,
    },
    CmdInfo {
        name: "finsert",
        args: "off len",
        help: "creates new space for writing within file by shifting extents",
        opts: "",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "fpunch",
        args: "off len",
        help: "de-allocates space associated with part of a file via fallocate",
        opts: "",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "fsync",
        args: "",
        help: "calls fsync(2) to flush all in-core file state to disk",
        opts: "",
        min: 0,
        max: 0,
    },
    CmdInfo {
        name: "fzero",
        args: "[-k] off len",
        help: "zeroes space and eliminates holes by preallocating",
        opts: "k",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "help",
        args: "[command]",
        help: "help for one or all commands",
        opts: "",
        min: 0,
        max: 1,
    },
    CmdInfo {
        name: "mmap",
        args: "[N] | [-rwx] [off len]",
        help: "mmap a range in the current file, show mappings",
        opts: "rwxSs:",
        min: 0,
        max: 2,
    },
    CmdInfo {
        name: "mread",
        args: "[-r] [off len]",
        help: "reads data from a region in the current memory mapping",
        opts: "frv",
        min: 0,
        max: 2,
    },
    CmdInfo {
        name: "msync",
        args: "[-ais] [off len]",
        help: "flush a region in the current memory mapping",
        opts: "ais",
        min: 0,
        max: 2,
    },
    CmdInfo {
        name: "munmap",
        args: "",
        help: "unmaps the current memory mapping",
        opts: "",
        min: 0,
        max: 0,
    },
    CmdInfo {
        name: "mwrite",
        args: "[-r] [-S seed] [off len]",
        help: "writes data into a region in the current memory mapping",
        opts: "rS:",
        min: 0,
        max: 2,
    },
    CmdInfo {
        name: "pread",
        args: "[-b bs] [-qv] off len",
        help: "reads a number of bytes at a specified offset",
        opts: "b:qv",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "pwrite",
        args: "[-b bs] [-S seed] [-q] off len",
        help: "writes a number of bytes at a specified offset",
        opts: "b:qS:",
        min: 2,
        max: 2,
    },
    CmdInfo {
        name: "quit",
        args: "",
        help: "exit the program",
        opts: "",
        min: 0,
        max: 0,
    },
    CmdInfo {
        name: "stat",
        args: "[-v]",
        help: "statistics on the currently open file",
        opts: "v",
        min: 0,
        max: 0,
    },
    CmdInfo {
        name: "truncate",
        args: "off",
        help: "truncates the current file at the given offset",
        opts: "",
        min: 1,
        max: 1,
    },
];

fn usage_line(c: &CmdInfo) -> String {
    if c.args.is_empty() {
        format!("{} -- {}", c.name, c.help)
    } else {
        format!("{} {} -- {}", c.name, c.args, c.help)
    }
}

/// Parsed options (letter, argument) and the remaining operands.
type Parsed = (Vec<(char, Option<String>)>, Vec<String>);

/// POSIX getopt over `args` (without the command name) with `spec` ("b:qv").
fn getopt(name: &str, args: &[String], spec: &str) -> Result<Parsed, String> {
    let mut opts = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') || a == "-" {
            break;
        }
        let chars: Vec<char> = a.chars().skip(1).collect();
        let mut j = 0;
        while j < chars.len() {
            let c = chars[j];
            let pos = spec.find(c).filter(|_| c != ':');
            let Some(pos) = pos else {
                return Err(format!("{name}: invalid option -- '{c}'"));
            };
            let takes = spec[pos + c.len_utf8()..].starts_with(':');
            if takes {
                let rest: String = chars[j + 1..].iter().collect();
                let val = if !rest.is_empty() {
                    rest
                } else {
                    i += 1;
                    args.get(i)
                        .cloned()
                        .ok_or_else(|| format!("{name}: option requires an argument -- '{c}'"))?
                };
                opts.push((c, Some(val)));
                break;
            }
            opts.push((c, None));
            j += 1;
        }
        i += 1;
    }
    Ok((opts, args[i..].to_vec()))
}

/// The open file the commands work on.
struct Shell<'a> {
    fs: &'a Fs,
    ino: Ino,
    path: String,
    writable: bool,
    block_size: u64,
    out: Box<dyn Write + 'a>,
    failed: bool,
    /// Memory mappings (`mmap`), and which one the m* commands use.
    maps: Vec<Map>,
    cur_map: usize,
}

/// One `mmap`: the engine's mapping and the protection asked for.
struct Map {
    m: rext4::MappedRange,
    prot: String,
    /// The made-up address shown by `mmap` (no address space here).
    addr: u64,
}

/// Why a command did not complete.
enum CmdError {
    /// "cmd: strerror" (already formatted).
    Sys(String),
    /// A bad argument ("non-numeric offset argument -- 1x"), printed on stdout.
    Usage(String),
}

type CmdResult = Result<(), CmdError>;

fn sys(what: &str, e: &Error) -> CmdError {
    CmdError::Sys(format!("{what}: {}", reason(e)))
}

fn sys_errno(what: &str, errno: i32) -> CmdError {
    CmdError::Sys(format!("{what}: {}", strerror(errno)))
}

impl Shell<'_> {
    fn num(&self, s: &str, what: &str) -> Result<u64, CmdError> {
        cvtnum(s, self.block_size)
            .ok_or_else(|| CmdError::Usage(format!("non-numeric {what} -- {s}")))
    }

    fn print(&mut self, s: &str) {
        // A closed stdout (e.g. `| head`) must not abort the remaining commands.
        let _ = self.out.write_all(s.as_bytes());
    }

    /// Run one -c command line; returns false on `quit`.
    fn run_line(&mut self, line: &str) -> bool {
        let words = match split_words(line) {
            Ok(w) => w,
            Err(e) => {
                self.fail(&e);
                return true;
            }
        };
        let Some((name, args)) = words.split_first() else {
            return true;
        };
        let Some(info) = CMDS.iter().find(|c| c.name == name) else {
            self.fail(&format!("command \"{name}\" not found"));
            return true;
        };
        let (opts, operands) = match getopt(name, args, info.opts) {
            Ok(p) => p,
            Err(e) => {
                // As xfs_io: getopt's complaint on stderr, the usage line on stdout.
                self.fail(&e);
                let u = format!("{}\n", usage_line(info));
                self.print(&u);
                return true;
            }
        };
        if operands.len() < info.min || operands.len() > info.max {
            let expected = if info.min == info.max {
                format!("{}", info.min)
            } else {
                format!("between {} and {}", info.min, info.max)
            };
            self.fail(&format!(
                "bad argument count {} to {name}, expected {expected} arguments",
                operands.len()
            ));
            return true;
        }
        let has = |c: char| opts.iter().any(|(o, _)| *o == c);
        let val = |c: char| {
            opts.iter()
                .rev()
                .find(|(o, _)| *o == c)
                .and_then(|(_, v)| v.clone())
        };
        let r = match name.as_str() {
            "pwrite" => self.pwrite(val('S'), val('b'), has('q'), &operands),
            "pread" => self.pread(val('b'), has('q'), has('v'), &operands),
            "truncate" => self.truncate(&operands[0]),
            "falloc" => {
                let mode = if has('k') {
                    FallocMode::KeepSize
                } else {
                    FallocMode::Allocate
                };
                self.falloc(mode, &operands)
            }
            "fpunch" => self.falloc(FallocMode::PunchHole, &operands),
            "fcollapse" => self.falloc(FallocMode::CollapseRange, &operands),
            "finsert" => self.falloc(FallocMode::InsertRange, &operands),
            "fzero" => self.falloc(
                FallocMode::ZeroRange {
                    keep_size: has('k'),
                },
                &operands,
            ),
            "fsync" | "fdatasync" => self.fs.fsync_ino(self.ino).map_err(|e| sys(name, &e)),
            "stat" => self.stat(has('v')),
            "fiemap" => self.fiemap(has('v'), has('l'), &operands),
            "mmap" => self.mmap(&opts, &operands),
            "mread" => self.mread(has('f'), has('v'), has('r'), &operands),
            "mwrite" => self.mwrite(val('S'), has('r'), &operands),
            "msync" => self.msync(has('a'), has('i'), &operands),
            "munmap" => self.munmap(),
            "help" => {
                let mut text = String::new();
                for c in CMDS
                    .iter()
                    .filter(|c| operands.first().is_none_or(|o| o == c.name))
                {
                    text.push_str(&usage_line(c));
                    text.push('\n');
                }
                self.print(&text);
                Ok(())
            }
            "quit" => return false,
            _ => Ok(()),
        };
        match r {
            Ok(()) => {}
            Err(CmdError::Sys(m)) => self.fail(&m),
            // xfs_io prints its argument complaints ("non-numeric ...") on stdout.
            Err(CmdError::Usage(m)) => {
                self.print(&format!("{m}\n"));
                self.failed = true;
            }
        }
        true
    }

    fn fail(&mut self, msg: &str) {
        let _ = self.out.flush();
        // xfs_io's own words, without the "rext4 io: " prefix of the tool's messages.
        let _ = writeln!(std::io::stderr(), "{msg}");
        self.failed = true;
    }

    fn pwrite(
        &mut self,
        seed: Option<String>,
        bsize: Option<String>,
        quiet: bool,
        ops: &[String],
    ) -> CmdResult {
        let seed = match seed {
            Some(s) => parse_ulong(&s)
                .ok_or_else(|| CmdError::Usage(format!("non-numeric seed -- {s}")))?
                as u8,
            None => 0xcd,
        };
        let bs = match bsize {
            Some(b) => self.num(&b, "bsize").and_then(|v| {
                if v == 0 || v > 1 << 30 {
                    Err(CmdError::Usage(format!("non-numeric bsize -- {b}")))
                } else {
                    Ok(v)
                }
            })?,
            None => 4096,
        };
        let off = self.num(&ops[0], "offset argument")?;
        let len = self.num(&ops[1], "length argument")?;
        if !self.writable {
            return Err(sys_errno("pwrite", libc::EBADF));
        }
        let buf = vec![seed; bs.min(len.max(1)) as usize];
        let start = Instant::now();
        let mut done = 0u64;
        let mut n_ops = 0u64;
        while done < len && crate::interrupt::requested().is_none() {
            let n = (len - done).min(bs) as usize;
            let pos = off
                .checked_add(done)
                .ok_or_else(|| sys("pwrite", &Error::FileTooLarge))?;
            let w = self
                .fs
                .write_ino_at(self.ino, &buf[..n], pos)
                .map_err(|e| sys("pwrite", &e))?;
            done += w as u64;
            n_ops += 1;
            if w == 0 {
                break;
            }
        }
        if !quiet {
            let r = report("wrote", done, len, off, n_ops, start.elapsed());
            self.print(&r);
        }
        Ok(())
    }

    fn pread(
        &mut self,
        bsize: Option<String>,
        quiet: bool,
        verbose: bool,
        ops: &[String],
    ) -> CmdResult {
        let bs = match bsize {
            Some(b) => self.num(&b, "bsize").and_then(|v| {
                if v == 0 || v > 1 << 30 {
                    Err(CmdError::Usage(format!("non-numeric bsize -- {b}")))
                } else {
                    Ok(v)
                }
            })?,
            None => 4096,
        };
        let off = self.num(&ops[0], "offset argument")?;
        let len = self.num(&ops[1], "length argument")?;
        let f = self.fs.open_ino(self.ino).map_err(|e| sys("pread", &e))?;
        let mut buf = vec![0u8; bs.min(len.max(1)) as usize];
        let start = Instant::now();
        let mut done = 0u64;
        let mut n_ops = 0u64;
        while done < len && crate::interrupt::requested().is_none() {
            let want = (len - done).min(bs) as usize;
            let pos = off.saturating_add(done);
            let n = f
                .read_at(&mut buf[..want], pos)
                .map_err(|e| sys("pread", &e))?;
            if n == 0 {
                break;
            }
            n_ops += 1;
            if verbose {
                let d = hexdump(&buf[..n], pos);
                self.print(&d);
            }
            done += n as u64;
            if n < want {
                break;
            }
        }
        if !quiet {
            let r = report("read", done, len, off, n_ops, start.elapsed());
            self.print(&r);
        }
        Ok(())
    }

    /// The mapping list, as `mmap` prints it (also after selecting and unmapping).
    fn list_maps(&mut self) -> CmdResult {
        if self.maps.is_empty() {
            return Err(CmdError::Sys("no mapped regions, try 'help mmap'".into()));
        }
        let mut s = String::new();
        for (i, mp) in self.maps.iter().enumerate() {
            let (l, r) = if i == self.cur_map {
                ('[', ']')
            } else {
                (' ', ' ')
            };
            s.push_str(&format!(
                "{l}{i:03}{r} 0x{:x} - 0x{:x} {}  {:>14} ({} : {})\n",
                mp.addr,
                mp.addr + mp.m.len(),
                mp.prot,
                self.path,
                mp.m.offset(),
                mp.m.len()
            ));
        }
        self.print(&s);
        Ok(())
    }

    /// `mmap`: list the mappings (no operands), select one (`N`, then list), or map
    /// `len` bytes at `off` with the protection of -r/-w/-x (all three by default).
    fn mmap(&mut self, opts: &[(char, Option<String>)], ops: &[String]) -> CmdResult {
        match ops.len() {
            0 => self.list_maps(),
            1 => {
                let n = self.num(&ops[0], "mapping number")? as usize;
                if n >= self.maps.len() {
                    return Err(CmdError::Sys(format!("mapping {n} does not exist")));
                }
                self.cur_map = n;
                self.list_maps()
            }
            _ => {
                let off = self.num(&ops[0], "offset argument")?;
                let len = self.num(&ops[1], "length argument")?;
                let has = |c: char| opts.iter().any(|(o, _)| *o == c);
                if has('S') {
                    // MAP_SYNC needs a DAX device.
                    return Err(sys_errno("mmap", libc::EOPNOTSUPP));
                }
                let (r, w, x) = if has('r') || has('w') || has('x') {
                    (has('r'), has('w'), has('x'))
                } else {
                    (true, true, true)
                };
                if w && !self.writable {
                    return Err(sys_errno("mmap", libc::EACCES));
                }
                let f = self
                    .fs
                    .open_ino_with(self.ino, w)
                    .map_err(|e| sys("mmap", &e))?;
                let m = f.map(off, len).map_err(|e| sys("mmap", &e))?;
                let prot = format!(
                    "{}{}{}",
                    if r { 'r' } else { '-' },
                    if w { 'w' } else { '-' },
                    if x { 'x' } else { '-' }
                );
                // Made-up addresses, each mapping 4 GiB above the last.
                let addr = 0x7f00_0000_0000 + ((self.maps.len() as u64) << 32);
                self.maps.push(Map { m, prot, addr });
                self.cur_map = self.maps.len() - 1;
                Ok(())
            }
        }
    }

    /// The current mapping and the (offset, length) of the m* command's range
    /// (default: the whole mapping), checked against it.
    fn map_range(&self, name: &str, ops: &[String]) -> Result<(usize, u64, u64), CmdError> {
        let Some(mp) = self.maps.get(self.cur_map) else {
            return Err(CmdError::Sys("no mapped regions, try 'help mmap'".into()));
        };
        let (off, len) = match ops.len() {
            0 => (0, mp.m.len()),
            1 => {
                let off = self.num(&ops[0], "offset argument")?;
                (off, mp.m.len().saturating_sub(off))
            }
            _ => (
                self.num(&ops[0], "offset argument")?,
                self.num(&ops[1], "length argument")?,
            ),
        };
        if off > mp.m.len() {
            return Err(CmdError::Sys(format!(
                "offset ({off}) is beyond end of mapping ({})",
                mp.m.offset()
            )));
        }
        if off.saturating_add(len) > mp.m.len() {
            return Err(CmdError::Sys(format!(
                "{name}: length ({len}) is beyond end of mapping ({})",
                mp.m.len()
            )));
        }
        // Where a real mapping would fault: pages wholly past the end of the file.
        if name != "msync" && len > 0 {
            let size = self.fs.stat_ino(self.ino).map_err(|e| sys(name, &e))?.size;
            let page = rext4::pagecache::mapping::MMAP_PAGE.max(self.block_size);
            if mp.m.offset() + off + len > size.div_ceil(page) * page {
                return Err(CmdError::Sys(format!(
                    "{name}: Bus error (access past the last page of the file)"
                )));
            }
        }
        Ok((self.cur_map, off, len))
    }

    fn mread(&mut self, file_rel: bool, verbose: bool, reverse: bool, ops: &[String]) -> CmdResult {
        let (i, off, len) = self.map_range("mread", ops)?;
        let mut buf = vec![0u8; len as usize];
        let m = &self.maps[i].m;
        if reverse {
            // From the end backwards, a page at a time (the order of the accesses is
            // all -r changes).
            let mut end = len;
            while end > 0 {
                let start = end.saturating_sub(4096);
                m.read(off + start, &mut buf[start as usize..end as usize])
                    .map_err(|e| sys("mread", &e))?;
                end = start;
            }
        } else {
            m.read(off, &mut buf).map_err(|e| sys("mread", &e))?;
        }
        if file_rel || verbose {
            let base = if file_rel { m.offset() + off } else { off };
            let d = hexdump(&buf, base);
            self.print(&d);
        }
        Ok(())
    }

    fn mwrite(&mut self, seed: Option<String>, _reverse: bool, ops: &[String]) -> CmdResult {
        let seed = match seed {
            Some(s) => parse_ulong(&s)
                .ok_or_else(|| CmdError::Usage(format!("non-numeric seed -- {s}")))?
                as u8,
            None => b'X',
        };
        let (i, off, len) = self.map_range("mwrite", ops)?;
        let mp = &self.maps[i];
        if !mp.prot.contains('w') {
            // xfs_io dies of SIGSEGV here.
            return Err(sys_errno("mwrite", libc::EACCES));
        }
        mp.m.write(off, &vec![seed; len as usize])
            .map_err(|e| sys("mwrite", &e))
    }

    fn msync(&mut self, async_: bool, invalidate: bool, ops: &[String]) -> CmdResult {
        let (i, off, len) = self.map_range("msync", ops)?;
        let m = &self.maps[i].m;
        if invalidate {
            // MS_INVALIDATE: later accesses see the file (they always do here); drop
            // the clean pages so they are read back from the device.
            self.fs
                .drop_cache_ino(self.ino, m.offset() + off, len.max(1));
        }
        if !async_ {
            m.sync(off, len).map_err(|e| sys("msync", &e))?;
        }
        Ok(())
    }

    fn munmap(&mut self) -> CmdResult {
        if self.maps.is_empty() {
            return Err(CmdError::Sys("no mapped regions, try 'help mmap'".into()));
        }
        self.maps.remove(self.cur_map);
        self.cur_map = self.maps.len().saturating_sub(1);
        if self.maps.is_empty() {
            Ok(())
        } else {
            self.list_maps()
        }
    }

    fn truncate(&mut self, arg: &str) -> CmdResult {
        let size = self.num(arg, "truncate argument")?;
        if !self.writable {
            return Err(sys_errno("ftruncate", libc::EINVAL));
        }
        self.fs
            .truncate_ino(self.ino, size)
            .map_err(|e| sys("ftruncate", &e))
    }

    fn falloc(&mut self, mode: FallocMode, ops: &[String]) -> CmdResult {
        let off = self.num(&ops[0], "offset argument")?;
        let len = self.num(&ops[1], "length argument")?;
        if !self.writable {
            return Err(sys_errno("fallocate", libc::EBADF));
        }
        self.fs
            .fallocate_ino(self.ino, mode, off, len)
            .map_err(|e| sys("fallocate", &e))
    }

    fn stat(&mut self, verbose: bool) -> CmdResult {
        let m = self.fs.stat_ino(self.ino).map_err(|e| sys("fstat", &e))?;
        let kind = match m.file_type {
            FileType::File => "regular file",
            FileType::Dir => "directory",
            FileType::Symlink => "symbolic link",
            FileType::CharDevice => "char device",
            FileType::BlockDevice => "block device",
            FileType::Fifo => "fifo",
            FileType::Socket => "socket",
            FileType::Unknown => "unknown",
        };
        let mut s = format!(
            "fd.path = \"{}\"\nfd.flags = non-sync,non-direct,{}\nstat.ino = {}\nstat.type = {kind}\nstat.size = {}\nstat.blocks = {}\n",
            self.path,
            if self.writable { "read-write" } else { "read-only" },
            m.ino.0,
            m.size,
            m.blocks
        );
        if verbose {
            s.push_str(&format!(
                "stat.atime = {}\nstat.mtime = {}\nstat.ctime = {}\n",
                timefmt::ctime(m.atime.sec),
                timefmt::ctime(m.mtime.sec),
                timefmt::ctime(m.ctime.sec)
            ));
        }
        self.print(&s);
        Ok(())
    }

    fn fiemap(&mut self, verbose: bool, counts: bool, ops: &[String]) -> CmdResult {
        let start = match ops.first() {
            Some(s) => self.num(s, "offset argument")?,
            None => 0,
        };
        let len = match ops.get(1) {
            Some(s) => Some(self.num(s, "length argument")?),
            None => None,
        };
        // FIEMAP_FLAG_SYNC, as xfs_io: dirty data is written back first.
        let (inode, extents) = self
            .fs
            .fiemap_ino(self.ino, MAX_LOGICAL)
            .map_err(|e| sys("fiemap", &e))?;
        let size = inode.size;
        let bs = self.block_size;
        // Byte range whose extents are listed: to the end when no length is given
        // (extents past EOF included, as FIEMAP shows them).
        let range_end = match len {
            Some(l) => start.saturating_add(l),
            None => u64::MAX,
        };

        // (logical block, len, physical, unwritten) of the extents overlapping the
        // blocks of [start, range_end), clipped to them as the kernel's FIEMAP reports
        // them; block-mapped runs merged like the kernel maps them.
        let first_blk = start / bs;
        let end_blk = range_end.div_ceil(bs);
        let extent_mapped = inode.flags & rext4::format::inode::flags::EXTENTS != 0;
        let mut list: Vec<(u64, u64, u64, bool)> = Vec::new();
        for (l, m) in extents {
            let Mapping::Mapped {
                physical,
                len,
                unwritten,
            } = m
            else {
                continue;
            };
            let lo = l.max(first_blk);
            let hi = (l + len).min(end_blk);
            if lo >= hi {
                continue;
            }
            let (l, len, physical) = (lo, hi - lo, physical + (lo - l));
            if let Some(last) = list.last_mut() {
                if !extent_mapped
                    && last.0 + last.1 == l
                    && last.2 + last.1 == physical
                    && last.3 == unwritten
                {
                    last.1 += len;
                    continue;
                }
            }
            list.push((l, len, physical, unwritten));
        }
        let spb = bs / 512;
        // Lines: (file range in sectors, physical range or None for a hole, total, flags).
        struct Line {
            first: u64,
            last: u64,
            phys: Option<(u64, u64)>,
            flags: u32,
        }
        let mut lines = Vec::new();
        let mut cursor = start / 512;
        let n = list.len();
        for (i, &(l, len, p, unwritten)) in list.iter().enumerate() {
            let first = l * spb;
            if first > cursor {
                lines.push(Line {
                    first: cursor,
                    last: first - 1,
                    phys: None,
                    flags: 0,
                });
            }
            let mut flags = 0;
            if unwritten {
                flags |= 0x800;
            }
            if i + 1 == n {
                flags |= 0x1;
            }
            lines.push(Line {
                first,
                last: first + len * spb - 1,
                phys: Some((p * spb, (p + len) * spb - 1)),
                flags,
            });
            cursor = (l + len) * spb;
        }
        // A trailing hole up to EOF (or the range end), only after some extent.
        let hole_end = range_end.min(size) / 512;
        if n > 0 && hole_end > cursor {
            lines.push(Line {
                first: cursor,
                last: hole_end - 1,
                phys: None,
                flags: 0,
            });
        }
        let mut s = format!("{}:\n", self.path);
        if verbose {
            // Column widths from the extents (holes do not widen them), as xfs_io.
            let mut fw = 16;
            let mut bw = 16;
            let mut tw = 5;
            let mut flw = 5;
            for ln in lines.iter().filter(|l| l.phys.is_some()) {
                fw = fw.max(format!("[{}..{}]", ln.first, ln.last).len());
                if let Some((a, b)) = ln.phys {
                    bw = bw.max(format!("{a}..{b}").len());
                }
                tw = tw.max((ln.last - ln.first + 1).to_string().len());
                flw = flw.max(format!("{:#x}", ln.flags).len());
            }
            s.push_str(&format!(
                "{:>4}: {:<fw$} {:<bw$} {:>tw$} {:>flw$}\n",
                "EXT", "FILE-OFFSET", "BLOCK-RANGE", "TOTAL", "FLAGS"
            ));
            for (i, ln) in lines.iter().enumerate() {
                let foff = format!("[{}..{}]:", ln.first, ln.last);
                let total = ln.last - ln.first + 1;
                match ln.phys {
                    Some((a, b)) => s.push_str(&format!(
                        "{i:>4}: {foff:<fw$} {:<bw$} {total:>tw$} {:>flw$}\n",
                        format!("{a}..{b}"),
                        format!("{:#x}", ln.flags)
                    )),
                    None => s.push_str(&format!(
                        "{i:>4}: {foff:<fw$} {:<bw$} {total:>tw$}\n",
                        "hole"
                    )),
                }
            }
        } else {
            for (i, ln) in lines.iter().enumerate() {
                let what = match ln.phys {
                    Some((a, b)) => format!("{a}..{b}"),
                    None => "hole".into(),
                };
                s.push_str(&format!("\t{i}: [{}..{}]: {what}", ln.first, ln.last));
                if counts {
                    s.push_str(&format!(" {} blocks", ln.last - ln.first + 1));
                }
                s.push('\n');
            }
        }
        self.print(&s);
        Ok(())
    }
}

/// `rext4 io`: open the file, run every -c command in order, close.
pub fn run(args: IoArgs) -> Result<(), Failure> {
    let s = spec::parse(&args.spec)
        .ok_or_else(|| (2, format!("{}: expected IMAGE:/path", args.spec)))?;
    let need_rw = !args.read_only || args.create;
    let fs = if need_rw {
        write_cmds::open_rw(&s.image).map_err(|e| (1, e))?
    } else {
        let spec = crate::spec::image_spec(&s.image)
            .map_err(|e| (1, format!("{}: {e}", s.image.display())))?;
        let fs = Fs::open_spec(&spec, FsOptions::default()).map_err(|e| {
            (
                1,
                format!("{}: {}", s.image.display(), crate::term::reason(&e)),
            )
        })?;
        for w in fs.warnings() {
            crate::term::errln!("warning: {}: {w}", s.image.display());
        }
        fs
    };
    let r = run_open(&fs, &s.path, &args);
    if need_rw {
        write_cmds::close(&fs, &s.image, r)
    } else {
        r
    }
}

fn run_open(fs: &Fs, path: &[u8], args: &IoArgs) -> Result<(), Failure> {
    let shown = String::from_utf8_lossy(path).into_owned();
    let ino = match fs.resolve(path, true) {
        Ok(i) => i,
        Err(Error::NotFound) if args.create => {
            let (uid, gid) = caller();
            fs.parent_and_name(path)
                .and_then(|(p, n)| {
                    fs.mknod_ino(p, n, u32::from(imode::S_IFREG) | 0o600, uid, gid, (0, 0))
                })
                .map_err(|e| (1, format!("{shown}: {}", reason(&e))))?
        }
        Err(e) => return Err((1, format!("{shown}: {}", reason(&e)))),
    };
    let stdout = std::io::stdout();
    let mut sh = Shell {
        fs,
        ino,
        path: shown,
        writable: !args.read_only && !fs.is_read_only(),
        block_size: u64::from(fs.block_size()),
        out: Box::new(stdout.lock()),
        failed: false,
        maps: Vec::new(),
        cur_map: 0,
    };
    for c in &args.cmds {
        if crate::interrupt::requested().is_some() || !sh.run_line(c) {
            break;
        }
    }
    let _ = sh.out.flush();
    if sh.failed {
        Err((1, String::new()))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(cvtnum("64k", 4096), Some(65536));
        assert_eq!(cvtnum("1s", 4096), Some(512));
        assert_eq!(cvtnum("2b", 1024), Some(2048));
        assert_eq!(cvtnum("0x10", 4096), Some(16));
        assert_eq!(cvtnum("010", 4096), Some(8));
        assert_eq!(cvtnum("0", 4096), Some(0));
        assert_eq!(cvtnum("1M", 4096), Some(1 << 20));
        assert_eq!(cvtnum("3g", 4096), Some(3 << 30));
        assert_eq!(cvtnum("1x", 4096), None);
        assert_eq!(cvtnum("1kk", 4096), None);
        assert_eq!(cvtnum("", 4096), None);
        assert_eq!(cvtnum("k", 4096), None);
        assert_eq!(cvtnum("-1", 4096), None);
        assert_eq!(cvtnum("16e", 4096), None);
    }

    #[test]
    fn sizes_and_times_print_like_xfs_io() {
        assert_eq!(cvtstr(65536.0), "64 KiB");
        assert_eq!(cvtstr(100000.0), "98 KiB");
        assert_eq!(cvtstr(48.0), "48.000000 bytes");
        assert_eq!(cvtstr(2.035 * (1u64 << 30) as f64), "2.035 GiB");
        assert_eq!(cvtstr(f64::NAN), "-nan bytes");
        assert_eq!(timestr(Duration::from_micros(12)), "0.0000 sec");
        assert_eq!(timestr(Duration::from_millis(3590)), "0:00:03.59");
        let r = report("wrote", 0, 1, 7, 0, Duration::ZERO);
        assert_eq!(
            r,
            "wrote 0/1 bytes at offset 7\n0.000000 bytes, 0 ops; 0.0000 sec (-nan bytes/sec and -nan ops/sec)\n"
        );
    }

    #[test]
    fn dump_format() {
        let d = hexdump(b"Hello, world\x01\x7f\x80 abc", 0);
        assert_eq!(
            d,
            "00000000:  48 65 6c 6c 6f 2c 20 77 6f 72 6c 64 01 7f 80 20  Hello..world....\n\
             00000010:  61 62 63  abc\n"
        );
        assert_eq!(hexdump(&[0xcd; 2], 100), "00000064:  cd cd  ..\n");
    }

    #[test]
    fn words_and_options() {
        assert_eq!(
            split_words("pwrite  -S 0x41 'a b' \"c\"").ok(),
            Some(vec![
                "pwrite".into(),
                "-S".into(),
                "0x41".into(),
                "a b".into(),
                "c".into()
            ])
        );
        assert!(split_words("x 'y").is_err());
        let args: Vec<String> = ["-S0x41", "-qb", "8k", "0", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (o, rest) = getopt("pwrite", &args, "b:qS:").expect("parses");
        assert_eq!(
            o,
            vec![
                ('S', Some("0x41".into())),
                ('q', None),
                ('b', Some("8k".into()))
            ]
        );
        assert_eq!(rest, vec!["0".to_string(), "1".to_string()]);
        let bad: Vec<String> = vec!["-1".into(), "1".into()];
        assert_eq!(
            getopt("pwrite", &bad, "b:qS:").err().as_deref(),
            Some("pwrite: invalid option -- '1'")
        );
        let missing: Vec<String> = vec!["-b".into()];
        assert!(getopt("pread", &missing, "b:qv").is_err());
    }
}
