//! `IMAGE:/path` arguments. IMAGE is an image spec (`rext4::image`): a file or block
//! device, `DISK?partition=N`, `DISK?offset=BYTES[&size=BYTES]`, an NBD URI; a text
//! that names an existing file is that file, '?' and all. An NBD URI holds ":/" itself
//! (`nbd://HOST/EXPORT:/path`): the split takes the first ":" whose left side is an
//! image that is there, and `nbd` alone is none.

use std::path::{Path, PathBuf};

use rext4::ImageSpec;

/// An image (spec text) and a path inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePath {
    /// The image spec as given (a path, or a path with `?FIELD=VALUE`s).
    pub image: PathBuf,
    pub path: Vec<u8>,
}

/// The spec an IMAGE operand names.
pub fn image_spec(image: &Path) -> Result<ImageSpec, String> {
    let Some(text) = image.to_str() else {
        // Not UTF-8: only a plain path can be that.
        return Ok(ImageSpec::file(image));
    };
    ImageSpec::from_arg(text).map_err(|e| crate::term::reason(&e))
}

/// The file (or device) an IMAGE operand reads: the spec's path.
pub fn image_file(image: &Path) -> PathBuf {
    image_spec(image)
        .map(|s| s.path().to_path_buf())
        .unwrap_or_else(|_| image.to_path_buf())
}

/// Whether `text` names an image that is there: an existing file or device, or a
/// spec over one, or a network spec (an NBD URI: whether its server answers is known
/// only when it is opened).
pub fn exists(text: &str) -> bool {
    ImageSpec::from_arg(text).is_ok_and(|s| match s.local_file() {
        Some(p) => p.exists() && !p.is_dir(),
        None => true,
    })
}

/// Split `IMAGE:/path` (or `IMAGE:` for the root). When the image name itself holds
/// ":/", the first split whose image part names an image that is there wins.
pub fn parse(arg: &str) -> Option<ImagePath> {
    // The ':' of a URI's scheme (`nbd://`) splits nothing.
    let scheme_end = ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"]
        .iter()
        .find(|s| arg.starts_with(**s))
        .map_or(0, |s| s.len());
    let candidates: Vec<usize> = arg
        .match_indices(':')
        .map(|(i, _)| i)
        .filter(|&i| i >= scheme_end)
        .collect();
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
        .find(|&&i| exists(&arg[..i]))
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
        assert_eq!(
            parse("d.img?partition=2:/etc/x").map(|p| (p.image, p.path)),
            Some((PathBuf::from("d.img?partition=2"), b"/etc/x".to_vec()))
        );
        // NBD URIs hold ':' and ":/" themselves.
        for (arg, image, path) in [
            ("nbd://h/e:/x/y", "nbd://h/e", "/x/y"),
            ("nbd://h:10809/e:/x", "nbd://h:10809/e", "/x"),
            ("nbd://h:10809/e:", "nbd://h:10809/e", "/"),
            ("nbd://h/:/", "nbd://h/", "/"),
            (
                "nbd+unix:///e?socket=/tmp/s.sock:/d/f",
                "nbd+unix:///e?socket=/tmp/s.sock",
                "/d/f",
            ),
            (
                "nbd+unix:///?socket=/tmp/s.sock&partition=2:/",
                "nbd+unix:///?socket=/tmp/s.sock&partition=2",
                "/",
            ),
        ] {
            assert_eq!(
                parse(arg).map(|p| (p.image, p.path)),
                Some((PathBuf::from(image), path.as_bytes().to_vec())),
                "{arg}"
            );
        }
    }
}
