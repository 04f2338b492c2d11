//! qcow2 images (placeholder until the reader lands): refused by name.

use std::path::Path;

use crate::error::{Error, Result};

pub struct Qcow2;

impl Qcow2 {
    pub fn open(path: &Path, _read_only: bool) -> Result<std::sync::Arc<dyn super::BlockDevice>> {
        Err(Error::Unsupported(format!(
            "{}: qcow2 images are not supported yet",
            path.display()
        )))
    }
}
