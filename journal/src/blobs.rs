//! Content-addressed blob storage for media (spec: client-server API "Content
//! repository"). A blob is a file named by the blake3 hash of its bytes under
//! `<data>/media/<first two hex digits>/<hash>`; it is written to a temporary file,
//! fsynced and renamed into place (then the directory is fsynced) *before* the journal
//! fact that names it is appended, so an acknowledged upload never names a missing or
//! torn file. Equal content is stored once. Blobs are immutable; the journal holds the
//! metadata (who uploaded what under which media id).

use std::{
    io::Write,
    path::{Path, PathBuf},
};

/// The blob directory.
#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
}

/// Hex blake3 hashes only (no path tricks).
fn valid_hash(hash: &str) -> bool {
    hash.len() == 64
        && hash
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

impl BlobStore {
    /// The store in `dir` (created on the first write).
    pub fn new(dir: &Path) -> BlobStore {
        BlobStore {
            dir: dir.to_path_buf(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where a blob lives (whether or not it exists). `None` for a malformed hash.
    pub fn path(&self, hash: &str) -> Option<PathBuf> {
        valid_hash(hash).then(|| self.dir.join(&hash[..2]).join(hash))
    }

    /// Stores `bytes` durably; returns their blake3 hex hash. Blocking I/O: call it
    /// from a blocking thread.
    pub fn put(&self, bytes: &[u8]) -> std::io::Result<String> {
        let hash = blake3::hash(bytes).to_hex().to_string();
        let path = self.path(&hash).expect("blake3 hex is valid");
        if path.exists() {
            return Ok(hash);
        }
        let parent = path.parent().expect("has a parent");
        std::fs::create_dir_all(parent)?;
        let tmp = parent.join(format!(".{hash}.{}.tmp", std::process::id()));
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(parent)?.sync_all()?;
        Ok(hash)
    }

    /// Reads a blob. Blocking I/O.
    pub fn get(&self, hash: &str) -> std::io::Result<Vec<u8>> {
        let path = self
            .path(hash)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad hash"))?;
        std::fs::read(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_content_is_stored_once_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::new(&dir.path().join("media"));
        let a = store.put(b"hello").unwrap();
        assert_eq!(a, blake3::hash(b"hello").to_hex().to_string());
        assert_eq!(store.put(b"hello").unwrap(), a);
        assert_eq!(store.get(&a).unwrap(), b"hello");
        assert!(store.path("../../etc/passwd").is_none());
        assert!(store.get(&"0".repeat(64)).is_err());
    }
}
