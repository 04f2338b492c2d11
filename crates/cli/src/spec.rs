//! `IMAGE:/path` arguments.

use std::path::{Path, PathBuf};

/// An image file and a path inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePath {
    pub image: PathBuf,
    pub path: Vec<u8>,
}

/// Split `IMAGE:/path` (or `IMAGE:` for the root). When the image name itself holds
/// ":/", the first split whose image part is an existing file wins.
pub fn parse(arg: &str) -> Option<ImagePath> {
    let candidates: Vec<usize> = arg.match_indices(':').map(|(i, _)| i).collect();
    let mk = |i: usize| {
        let rest = &arg[i + 1..];
        let path = if rest.is_empty() {
            "/".to_string()
        } else {
            rest.to_string()
        };
        ImagePath {
            image: PathBuf::from(&arg[..i]),
            path: path.into_bytes(),
        }
    };
    let ok = |i: &usize| {
        let rest = &arg[*i + 1..];
        *i > 0 && (rest.is_empty() || rest.starts_with('/'))
    };
    candidates
        .iter()
        .filter(|i| ok(i))
        .find(|&&i| Path::new(&arg[..i]).is_file())
        .or_else(|| candidates.iter().find(|i| ok(i)))
        .map(|&i| mk(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits() {
        assert_eq!(parse("a.img:/x/y").map(|p| p.path), Some(b"/x/y".to_vec()));
        assert_eq!(parse("a.img:").map(|p| p.path), Some(b"/".to_vec()));
        assert_eq!(parse("a.img"), None);
        assert_eq!(
            parse("a:b.img:/d").map(|p| p.image),
            Some(PathBuf::from("a:b.img"))
        );
    }
}
