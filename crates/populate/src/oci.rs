//! OCI image layouts (image-spec's `oci-layout`, `index.json`, `blobs/ALG/HEX`): the
//! layer blobs of one image, bottom first.
//!
//! `index.json` names manifests (or nested indexes); with several, the one for
//! linux on this machine's architecture is taken. Its manifest lists the layers.
//! Digests are checked for form (`ALG:HEX`, lowercase hex), so a blob path can never
//! leave `blobs/`, and every blob read (index, manifest, layer) is hashed and compared
//! with its digest before it is used (sha256 and sha512, the algorithms the image
//! spec registers; another is refused). Callers: the CLI (`--layer DIR`), embedders.

use std::path::{Path, PathBuf};

use rext4::{Error, Result};
use serde_json::Value;

fn bad(dir: &Path, what: impl std::fmt::Display) -> Error {
    Error::InvalidInput(format!("{}: OCI image layout: {what}", dir.display()))
}

/// Whether `dir` looks like an OCI image layout (it has `oci-layout` and `index.json`).
pub fn is_layout(dir: &Path) -> bool {
    dir.join("oci-layout").is_file() && dir.join("index.json").is_file()
}

fn read_json(dir: &Path, p: &Path, digest: Option<&str>) -> Result<Value> {
    let text = std::fs::read(p).map_err(|e| bad(dir, format!("{}: {e}", p.display())))?;
    if let Some(d) = digest {
        check_digest(dir, d, &mut &text[..])?;
    }
    serde_json::from_slice(&text).map_err(|e| bad(dir, format!("{}: {e}", p.display())))
}

/// Hash what `r` holds with the algorithm `digest` names and compare.
pub fn check_digest(dir: &Path, digest: &str, r: &mut dyn std::io::Read) -> Result<()> {
    use sha2::Digest;
    fn hex_of(r: &mut dyn std::io::Read, mut h: impl sha2::Digest) -> std::io::Result<String> {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }
    let (alg, want) = digest
        .split_once(':')
        .ok_or_else(|| bad(dir, format!("malformed digest '{digest}'")))?;
    let got = match alg {
        "sha256" => hex_of(r, sha2::Sha256::new()),
        "sha512" => hex_of(r, sha2::Sha512::new()),
        other => {
            return Err(bad(
                dir,
                format!("digest algorithm '{other}' is not checked"),
            ))
        }
    }
    .map_err(|e| bad(dir, format!("{digest}: {e}")))?;
    if got != want {
        return Err(bad(
            dir,
            format!("blob {digest} does not match its digest (it hashes to {got})"),
        ));
    }
    Ok(())
}

/// Check the blob `digest` names against its digest.
pub fn verify_blob(dir: &Path, digest: &str) -> Result<()> {
    let p = blob_path(dir, digest)?;
    let mut f = std::fs::File::open(&p).map_err(|e| bad(dir, format!("{}: {e}", p.display())))?;
    check_digest(dir, digest, &mut f)
}

/// The path of the blob `digest` names, after checking its form.
pub fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf> {
    let (alg, hex) = digest
        .split_once(':')
        .ok_or_else(|| bad(dir, format!("malformed digest '{digest}'")))?;
    let alg_ok = !alg.is_empty()
        && alg
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b));
    let hex_ok = !hex.is_empty()
        && hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    if !alg_ok || !hex_ok {
        return Err(bad(dir, format!("malformed digest '{digest}'")));
    }
    Ok(dir.join("blobs").join(alg).join(hex))
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The manifest descriptor to follow among an index's.
fn pick<'a>(dir: &Path, manifests: &'a [Value]) -> Result<&'a Value> {
    match manifests {
        [] => Err(bad(dir, "the index lists no manifest")),
        [one] => Ok(one),
        many => many
            .iter()
            .find(|m| {
                m["platform"]["os"] == "linux" && m["platform"]["architecture"] == host_arch()
            })
            .ok_or_else(|| {
                bad(
                    dir,
                    format!(
                        "the index lists {} manifests and none for linux/{}",
                        many.len(),
                        host_arch()
                    ),
                )
            }),
    }
}

/// The layer blobs of the image in the layout `dir`, bottom layer first.
pub fn layers(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut doc = read_json(dir, &dir.join("index.json"), None)?;
    // Nested indexes: a bounded number of hops.
    for _ in 0..8 {
        let Some(manifests) = doc["manifests"].as_array() else {
            return Err(bad(dir, "an index without \"manifests\""));
        };
        let m = pick(dir, manifests)?;
        let digest = m["digest"]
            .as_str()
            .ok_or_else(|| bad(dir, "a manifest descriptor without a digest"))?;
        let next = read_json(dir, &blob_path(dir, digest)?, Some(digest))?;
        let media = m["mediaType"].as_str().or(next["mediaType"].as_str());
        if media == Some(INDEX) || media == Some(DOCKER_LIST) {
            doc = next;
            continue;
        }
        let Some(layers) = next["layers"].as_array() else {
            return Err(bad(dir, format!("manifest {digest} lists no layers")));
        };
        return layers
            .iter()
            .map(|l| {
                let d = l["digest"]
                    .as_str()
                    .ok_or_else(|| bad(dir, "a layer descriptor without a digest"))?;
                blob_path(dir, d)?;
                verify_blob(dir, d)?;
                blob_path(dir, d)
            })
            .collect();
    }
    Err(bad(dir, "indexes nested too deep"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_checked() {
        let d = Path::new("/x");
        // sha256("abc"), as FIPS 180-2 gives it.
        let abc = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(check_digest(d, abc, &mut &b"abc"[..]).is_ok());
        assert!(check_digest(d, abc, &mut &b"abd"[..]).is_err());
        assert!(check_digest(d, "md5:900150983cd24fb0d6963f7d28e17f72", &mut &b"abc"[..]).is_err());
    }

    #[test]
    fn digests_never_leave_blobs() {
        let d = Path::new("/x");
        assert_eq!(
            blob_path(d, "sha256:abc123").ok(),
            Some(PathBuf::from("/x/blobs/sha256/abc123"))
        );
        for bad in [
            "sha256:../etc",
            "sha256/../..:ab",
            "sha256:",
            ":ab",
            "sha256:ABC",
            "x",
        ] {
            assert!(blob_path(d, bad).is_err(), "{bad}");
        }
    }
}
