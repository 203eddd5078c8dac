//! `spindle verify-media`: every `MediaUploaded` fact's blob is on disk and hashes to
//! its name. Blobs are not journal records (SPEC §2 "Blobs"): the journal holds their
//! blake3 hash, so a blob that is missing or whose bytes changed is found by walking the
//! facts and re-hashing the files they name. Also run on a backup (`verify-backup`)
//! against its journal export, so a backup's journal never names a blob it lacks.

use std::path::Path;

use spindle_journal::{Fact, StoredRecord, blobs::BlobStore};

/// One blob a `MediaUploaded` fact names that is not right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBlob {
    /// Journal position of the fact.
    pub position: u64,
    /// The media id (`mxc://<server>/<media id>`).
    pub media_id: String,
    /// The blake3 hex the fact names.
    pub content_hash: String,
    /// `None`: the file is missing; `Some(h)`: it hashes to `h` instead.
    pub actual: Option<String>,
}

/// What [`check`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MediaReport {
    /// `MediaUploaded` facts seen.
    pub uploads: u64,
    /// Blob files read and hashed (one per distinct hash).
    pub blobs_checked: u64,
    /// Facts whose blob is missing.
    pub missing: Vec<BadBlob>,
    /// Facts whose blob does not hash to its name.
    pub corrupt: Vec<BadBlob>,
}

impl MediaReport {
    /// Whether every blob is present and intact.
    pub fn ok(&self) -> bool {
        self.missing.is_empty() && self.corrupt.is_empty()
    }
}

/// Checks the blobs in `media_dir` against the `MediaUploaded` facts in `records`
/// (position order). Each distinct blob is hashed once.
pub fn check<'a>(
    records: impl IntoIterator<Item = &'a StoredRecord>,
    media_dir: &Path,
) -> anyhow::Result<MediaReport> {
    let blobs = BlobStore::new(media_dir);
    let mut seen: std::collections::HashMap<String, Option<String>> = Default::default();
    let mut report = MediaReport::default();
    for rec in records {
        let Some(Fact::MediaUploaded {
            media_id,
            content_hash,
            ..
        }) = rec.fact()
        else {
            continue;
        };
        report.uploads += 1;
        let actual = match seen.get(&content_hash) {
            Some(a) => a.clone(),
            None => {
                let a = match blobs.path(&content_hash) {
                    None => None,
                    Some(path) => match std::fs::read(&path) {
                        Ok(bytes) => {
                            report.blobs_checked += 1;
                            Some(blake3::hash(&bytes).to_hex().to_string())
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                        Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", path.display())),
                    },
                };
                seen.insert(content_hash.clone(), a.clone());
                a
            }
        };
        let bad = BadBlob {
            position: rec.position(),
            media_id,
            content_hash: content_hash.clone(),
            actual: actual.clone(),
        };
        match actual {
            None => report.missing.push(bad),
            Some(h) if h != content_hash => report.corrupt.push(bad),
            Some(_) => {}
        }
    }
    Ok(report)
}
