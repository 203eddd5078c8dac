//! `spindle backup` / `spindle restore`: a consistent copy of what cannot be rebuilt.
//!
//! A backup directory holds:
//! - `journal.jsonl`: a journal export ([`crate::export`]) up to a head position `H`;
//! - `signing.key`, `server_name` and `verify_keys` (when present) from the data directory;
//! - `media/`: every media blob file (content-addressed: `media/<aa>/<blake3 hex>`);
//! - `MANIFEST.json`: the export header (head, head hash) and every file with its size
//!   and blake3 hash, written last (a directory without it is an unfinished backup).
//!
//! Projections are not copied: they are rebuilt from the journal at the first start.
//!
//! Consistency while the server runs: the journal is append-only, so an export of every
//! record up to the durable head `H` is a consistent prefix; blobs are written (and
//! fsynced) before the journal fact naming them is appended and are never changed, so
//! copying `media/` after the export includes every blob a fact up to `H` names (later
//! blobs may come along; they are harmless). The running server makes the export
//! itself (`POST /_spindle/admin/v1/backup`), since only it may open the journal.

use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use serde::{Deserialize, Serialize};
use spindle_journal::StoredRecord;

use crate::export::{self, ExportHeader};

/// Files copied from the data directory when present.
const DATA_FILES: [&str; 3] = ["signing.key", "server_name", crate::VERIFY_KEYS_FILE];

/// One file of a backup.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    /// Path relative to the backup directory (`/`-separated).
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// blake3 hex of the contents.
    pub blake3: String,
}

/// `MANIFEST.json`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Backup layout version (1).
    pub spindle_backup: u32,
    /// The journal export's header (server name, head, head hash).
    pub journal: ExportHeader,
    /// Every file but the manifest, sorted by path.
    pub files: Vec<FileEntry>,
}

fn hash_file(path: &Path) -> anyhow::Result<(u64, String)> {
    let mut h = blake3::Hasher::new();
    let mut f = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let bytes = std::io::copy(&mut f, &mut h)?;
    Ok((bytes, h.finalize().to_hex().to_string()))
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            files_under(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

fn rel(base: &Path, p: &Path) -> String {
    p.strip_prefix(base)
        .unwrap_or(p)
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Checks a content-addressed media file: its name is the blake3 hex of its bytes.
fn check_blob(path: &str, hash: &str) -> anyhow::Result<()> {
    if let Some(name) = path.rsplit('/').next()
        && path.starts_with("media/")
        && name.len() == 64
        && name != hash
    {
        bail!("media file {path} does not hash to its name (got {hash})");
    }
    Ok(())
}

/// Writes a backup of `data_dir` into `out` (which must not exist or be empty),
/// exporting the journal with `read` (offline: the store; online: the running
/// journal, up to its durable head).
pub fn backup_with(
    read: impl FnMut(u64, usize) -> anyhow::Result<Vec<StoredRecord>>,
    data_dir: &Path,
    server_name: &str,
    signing_key: export::SigningKey,
    out: &Path,
) -> anyhow::Result<Manifest> {
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!("{} exists and is not empty", out.display());
    }
    std::fs::create_dir_all(out)?;
    let journal_file = out.join("journal.jsonl");
    let mut w = std::io::BufWriter::new(std::fs::File::create(&journal_file)?);
    let header = export::export(read, server_name, signing_key, &mut w)?;
    w.into_inner()
        .map_err(|e| anyhow!(e.to_string()))?
        .sync_all()?;
    for name in DATA_FILES {
        let src = data_dir.join(name);
        if src.exists() {
            std::fs::copy(&src, out.join(name)).with_context(|| format!("copying {name}"))?;
        }
    }
    // Media after the export: every blob a fact up to the head names is already there.
    let mut blobs = Vec::new();
    files_under(&data_dir.join("media"), &mut blobs)?;
    for src in blobs {
        let dst = out.join(rel(data_dir, &src));
        std::fs::create_dir_all(dst.parent().expect("under out"))?;
        std::fs::copy(&src, &dst).with_context(|| format!("copying {}", src.display()))?;
    }
    let mut files = Vec::new();
    let mut all = Vec::new();
    files_under(out, &mut all)?;
    for p in all {
        let (bytes, blake3) = hash_file(&p)?;
        files.push(FileEntry {
            path: rel(out, &p),
            bytes,
            blake3,
        });
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    for f in &files {
        check_blob(&f.path, &f.blake3)?;
    }
    // Consistent: the copied journal names no blob the copy lacks.
    let input = std::io::BufReader::new(std::fs::File::open(&journal_file)?);
    check_media(&export::read_export(input)?.1, out)?;
    let manifest = Manifest {
        spindle_backup: 1,
        journal: header,
        files,
    };
    let tmp = out.join("MANIFEST.json.partial");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&manifest)?)?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, out.join("MANIFEST.json"))?;
    Ok(manifest)
}

/// Checks a backup directory: the manifest is there, every file listed has its size
/// and hash (media files also hash to their names), and the journal export reads back
/// with an intact chain ending at the manifest's head hash.
pub fn verify(dir: &Path) -> anyhow::Result<Manifest> {
    let text = std::fs::read(dir.join("MANIFEST.json")).with_context(|| {
        format!(
            "{} has no MANIFEST.json (unfinished backup?)",
            dir.display()
        )
    })?;
    let manifest: Manifest = serde_json::from_slice(&text).context("MANIFEST.json")?;
    if manifest.spindle_backup != 1 {
        bail!(
            "backup layout {} (this release reads 1)",
            manifest.spindle_backup
        );
    }
    for f in &manifest.files {
        let (bytes, hash) = hash_file(&dir.join(&f.path))?;
        if bytes != f.bytes || hash != f.blake3 {
            bail!(
                "{} changed since the backup (size or blake3 differs)",
                f.path
            );
        }
        check_blob(&f.path, &hash)?;
    }
    let input = std::io::BufReader::new(std::fs::File::open(dir.join("journal.jsonl"))?);
    let (header, records) = export::read_export(input)?;
    if header != manifest.journal {
        bail!("journal.jsonl's header differs from the manifest");
    }
    check_media(&records, dir)?;
    Ok(manifest)
}

/// Every `MediaUploaded` fact in `records` has its blob under `dir/media`, intact.
fn check_media(records: &[spindle_journal::EncodedRecord], dir: &Path) -> anyhow::Result<()> {
    let stored = records
        .iter()
        .map(|r| spindle_journal::StoredRecord::from_bytes(&r.bytes).map_err(|e| anyhow!(e)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let report = crate::media::check(&stored, &dir.join("media"))?;
    if let Some(b) = report.missing.first().or(report.corrupt.first()) {
        bail!(
            "{} of {} media uploads in the journal have no intact blob in {}/media (first: {} at position {}, blake3 {}); run `spindle verify-media` on the source",
            report.missing.len() + report.corrupt.len(),
            report.uploads,
            dir.display(),
            b.media_id,
            b.position,
            b.content_hash
        );
    }
    Ok(())
}

/// Restores a verified backup into `data_dir`, which must have no journal: imports the
/// journal, copies the key files and media. Projections rebuild at the first start.
pub fn restore(backup: &Path, data_dir: &Path) -> anyhow::Result<Manifest> {
    let manifest = verify(backup)?;
    if data_dir.join("journal").exists() {
        bail!(
            "{} already has a journal; restore only into a fresh data directory",
            data_dir.display()
        );
    }
    std::fs::create_dir_all(data_dir)?;
    for name in DATA_FILES {
        let src = backup.join(name);
        if src.exists() {
            std::fs::copy(&src, data_dir.join(name))?;
        }
    }
    for f in manifest
        .files
        .iter()
        .filter(|f| f.path.starts_with("media/"))
    {
        let dst = data_dir.join(&f.path);
        std::fs::create_dir_all(dst.parent().expect("under data"))?;
        std::fs::copy(backup.join(&f.path), &dst)?;
    }
    // The key files are in place; import writes the journal (and would refuse a
    // server_name mismatch).
    let verify_keys = std::fs::read(data_dir.join(crate::VERIFY_KEYS_FILE)).ok();
    export::import(&backup.join("journal.jsonl"), data_dir)?;
    if let Some(keys) = verify_keys {
        // The backup's own list wins over the exporter key import just wrote (the
        // backed-up key signed those events and is restored as signing.key).
        std::fs::write(data_dir.join(crate::VERIFY_KEYS_FILE), keys)?;
    } else {
        let _ = std::fs::remove_file(data_dir.join(crate::VERIFY_KEYS_FILE));
    }
    Ok(manifest)
}
