//! `spindle journal migrate`: rewrites a format-1 journal (no hash chain) in the
//! current format. The old journal is kept beside the new one as `journal.format1`.
//!
//! Crash safety: the new journal is written to `journal.migrating` and swapped in with
//! two renames only once it is complete and verified; a crash before the swap leaves
//! the old journal in place (the next run starts over), and a crash between the two
//! renames is finished by the next run.

use std::path::{Path, PathBuf};

use crate::{
    chain::{self, ChainHead},
    record::{GENESIS_HASH, record_hash, v1},
    store::{EncodedRecord, FjallStore, JournalStore},
};

/// What a migration did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migration {
    /// Records rewritten.
    pub records: u64,
    /// Head of the new chain.
    pub head: ChainHead,
    /// Where the old journal was kept.
    pub kept: PathBuf,
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Migrates the format-1 journal in `dir` (e.g. `<data>/journal`) to the current
/// format. Errors if it is not format 1, or if `journal.format1` already exists.
pub fn migrate_format1(dir: &Path) -> Result<Migration, String> {
    let kept = sibling(dir, ".format1");
    let staging = sibling(dir, ".migrating");
    if !dir.exists() && kept.exists() && staging.exists() {
        // A previous run stopped between its two renames: finish it.
        std::fs::rename(&staging, dir).map_err(|e| e.to_string())?;
    }
    let old = FjallStore::open_any_format(dir)?;
    let format = old.stored_format()?;
    if format != 1 {
        return Err(format!(
            "{} is in record format {format}; nothing to migrate",
            dir.display()
        ));
    }
    if kept.exists() {
        return Err(format!(
            "{} exists; move it away before migrating again",
            kept.display()
        ));
    }
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| e.to_string())?;
    }
    let new = FjallStore::open_any_format(&staging)?;
    let mut head = ChainHead {
        position: 0,
        hash: GENESIS_HASH,
    };
    let mut records = 0;
    loop {
        let batch = old.read_raw_after(head.position, 4096)?;
        if batch.is_empty() {
            break;
        }
        let mut out = Vec::with_capacity(batch.len());
        for (pos, bytes) in batch {
            let mut rec = v1::decode(&bytes).map_err(|e| format!("record {pos}: {e}"))?;
            if rec.position != pos || pos != head.position + 1 {
                return Err(format!(
                    "record {pos}: position {} out of order after {}",
                    rec.position, head.position
                ));
            }
            rec.prev_hash = head.hash;
            let bytes = rec.encode();
            head = ChainHead {
                position: pos,
                hash: record_hash(&bytes),
            };
            out.push(EncodedRecord {
                position: pos,
                room_id: rec.room_id,
                bytes,
                txn_key: None,
            });
            records += 1;
        }
        new.append(&out)?;
    }
    let verified = chain::walk(&new, |_| Ok(())).map_err(|e| e.to_string())?;
    if verified != head {
        return Err("the migrated journal does not verify".into());
    }
    drop(new);
    drop(old);
    std::fs::rename(dir, &kept).map_err(|e| e.to_string())?;
    std::fs::rename(&staging, dir).map_err(|e| e.to_string())?;
    Ok(Migration {
        records,
        head,
        kept,
    })
}
