//! The casefolded htree hash against e2fsprogs: `debugfs dx_hash -c -e utf8` (e2fsprogs'
//! own utf8-12.1 tables) hashes names built around code points; rext4's
//! `dx_hash_casefold` must give the same (major, minor) for each. A name is "A" + the
//! code point + "z", so a code point folded wrongly, or counted valid or invalid wrongly
//! (an invalid name hashes its raw bytes, "A" unfolded), changes the hash. By default
//! every code point below U+3400 and a spread sample above are checked, plus random
//! strings of combining marks, ignorables and Hangul (canonical ordering);
//! REXT4_CASEFOLD_ORACLE_ALL=1 checks all 1,114,112 code points.
use rext4_format::hash::{dx_hash_casefold, HashVersion};
use rext4_testkit::{debugfs_script, mkfs, MkfsOptions};

fn name_ok_for_debugfs(name: &[u8]) -> bool {
    // debugfs splits its command lines on blanks and reads quotes and backslashes.
    !name
        .iter()
        .any(|&b| b <= b' ' || b == b'"' || b == b'\\' || b == b'\'' || b == 0x7f)
}

fn check(names: &[Vec<u8>]) {
    let img = mkfs(&MkfsOptions::new(4096, 8 << 20).arg("-O").arg("casefold")).expect("mkfs");
    for chunk in names.chunks(50_000) {
        let mut script = Vec::new();
        for n in chunk {
            script.extend_from_slice(b"dx_hash -c -e utf8 -h half_md4 ");
            script.extend_from_slice(n);
            script.push(b'\n');
        }
        let out = debugfs_script(img.path(), &script, false).expect("debugfs");
        let text = String::from_utf8_lossy(&out.stdout);
        let got: Vec<(u32, u32)> = text
            .lines()
            .filter(|l| l.starts_with("Hash of "))
            .map(|l| {
                let hex: Vec<u32> = l
                    .split([' ', '(', ')'])
                    .filter_map(|w| w.strip_prefix("0x"))
                    .filter_map(|h| u32::from_str_radix(h, 16).ok())
                    .collect();
                assert!(hex.len() >= 2, "unparsed line {l:?}");
                (hex[hex.len() - 2], hex[hex.len() - 1])
            })
            .collect();
        assert_eq!(
            got.len(),
            chunk.len(),
            "debugfs answered {} of {} names: {}",
            got.len(),
            chunk.len(),
            out.stderr
        );
        let mut bad = Vec::new();
        for (n, g) in chunk.iter().zip(&got) {
            let ours = dx_hash_casefold(n, HashVersion::HalfMd4, &[0; 4]);
            if ours != *g {
                bad.push(format!(
                    "{:02x?} ours {:08x?} e2fsprogs {:08x?}",
                    n, ours, g
                ));
            }
        }
        assert!(
            bad.is_empty(),
            "{} mismatches, first: {:#?}",
            bad.len(),
            &bad[..bad.len().min(20)]
        );
    }
}

fn around(cp: u32) -> Option<Vec<u8>> {
    let c = char::from_u32(cp)?;
    let n = format!("A{c}z").into_bytes();
    name_ok_for_debugfs(&n).then_some(n)
}

#[test]
fn every_code_point_folds_as_e2fsprogs() {
    let all = std::env::var_os("REXT4_CASEFOLD_ORACLE_ALL").is_some();
    let names: Vec<Vec<u8>> = (0u32..0x11_0000)
        .filter(|&cp| {
            all || cp < 0x3400
                || cp % 61 == 0
                || (0x1_0400..0x1_0500).contains(&cp)
                || (0x1_E900..0x1_E960).contains(&cp)
        })
        .filter_map(around)
        .collect();
    check(&names);
}

#[test]
fn invalid_sequences_hash_their_bytes() {
    // The kernel (ext4fs_dirhash) hashes the raw bytes of a name that does not fold.
    // e2fsprogs 1.47 does so only when the first byte is a continuation byte; for a bad
    // sequence further in, its casefold returns -ENAMETOOLONG and dx_hash fails, so
    // only those names are compared with debugfs and the rest with the raw hash.
    let inner: Vec<&[u8]> = vec![
        b"A\xff",
        b"A\xc3",
        b"A\xc3z",
        b"A\xc0\xafz",
        b"A\xe0\x80\xafz",
        b"A\xed\xa0\x80z",
        b"A\xf4\x90\x80\x80z",
        b"A\xf8\x88\x80\x80\x80z",
        b"A\xe2\x80",
    ];
    for n in inner {
        assert_eq!(
            dx_hash_casefold(n, HashVersion::HalfMd4, &[0; 4]),
            rext4_format::hash::dx_hash(n, HashVersion::HalfMd4, &[0; 4]),
            "{n:02x?}"
        );
    }
    check(&[b"\x80Az".to_vec(), b"\xbfA\xc3\xa9".to_vec()]);
}

#[test]
fn mark_orderings_fold_as_e2fsprogs() {
    // A small deterministic generator; the pool mixes base letters, marks of several
    // combining classes, ignorables (which end a run of marks) and Hangul.
    let pool: &[char] = &[
        'a', 'E', 'ß', 'ẞ', 'Σ', 'ς', 'İ', 'ı', 'Ж', '\u{301}', '\u{300}', '\u{323}', '\u{327}',
        '\u{345}', '\u{308}', '\u{31b}', '\u{5b0}', '\u{1dce}', '\u{200b}', '\u{ad}', '\u{34f}',
        '\u{fe0f}', '\u{e9}', '\u{1e69}', '\u{1f82}', '\u{390}', '\u{fb01}', '\u{d55c}',
        '\u{ac00}', '\u{1100}', '\u{1161}', '\u{11a8}', '\u{212b}', '\u{2126}', '\u{1f88}',
        '\u{6d4}', '\u{e01}',
    ];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut names = Vec::new();
    for _ in 0..4000 {
        let mut s = String::from("A");
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 1 + (x % 9) as usize;
        for _ in 0..len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push(pool[(x % pool.len() as u64) as usize]);
        }
        names.push(s.into_bytes());
    }
    check(&names);
}
