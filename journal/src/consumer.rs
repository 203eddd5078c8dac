//! Journal consumers: readers that act on the world (federation transactions; push
//! gateways and application services use the same shape), as opposed to projections,
//! which only build read models (BRIEF §2, "Consumers act on the world").
//!
//! A consumer keeps one or more named cursors (a destination server, a push gateway,
//! an application service), each the journal position up to which its work is done.
//! Cursors live in one small JSON file per consumer under `<data>/consumers/`, written
//! atomically (temporary file, fsync, rename) after each delivery, so a restart resumes
//! from the last acknowledged delivery: at least once, never lost. A cursor that only
//! moves past records the consumer had nothing to do for is saved now and then
//! ([`Cursors::advance`], at most every [`IDLE_SAVE_INTERVAL`]): a restart rescans
//! those few records and again finds nothing to do. Cursors are not
//! facts about the server's state (like a projection's checkpoint, they only say how
//! far a reader got), which is why they are not journal records.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::{Path, PathBuf},
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use crate::{Journal, JournalError, StoredRecord};

/// How often, at most, [`Cursors::advance`] writes: the longest stretch of idle
/// records a restart may rescan (10 s of traffic).
pub const IDLE_SAVE_INTERVAL: Duration = Duration::from_secs(10);

/// The durable cursors of one consumer: name -> journal position done.
pub struct Cursors {
    backing: Backing,
    map: BTreeMap<String, u64>,
    /// When the cursors were last written.
    saved: Instant,
    /// The journal whose [`crate::JournalStats::cursor_writes`] counts the writes.
    journal: Option<Journal>,
}

/// Where a consumer's cursors are kept.
enum Backing {
    /// `<dir>/<consumer>.json`.
    File(PathBuf),
    /// The consumer's subject of the shared journal's cursor stream ([`crate::nats`]):
    /// the process that takes the writer lease over resumes where the last one stopped.
    Shared(std::sync::Arc<crate::NatsStore>, String),
}

impl Cursors {
    /// Loads `<dir>/<consumer>.json` (empty if it does not exist). Errors on an
    /// unreadable or malformed file: guessing a position would lose or repeat work.
    pub fn open(dir: &Path, consumer: &str) -> Result<Cursors, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("{consumer}.json"));
        let map = match std::fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        Ok(Cursors {
            backing: Backing::File(path),
            map,
            saved: Instant::now(),
            journal: None,
        })
    }

    /// Loads a consumer's cursors from a shared journal's cursor stream.
    fn open_shared(
        store: std::sync::Arc<crate::NatsStore>,
        consumer: &str,
    ) -> Result<Cursors, String> {
        let map = match store.cursor_get(consumer)? {
            Some(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("cursors of {consumer} in the shared cursor stream: {e}"))?,
            None => BTreeMap::new(),
        };
        Ok(Cursors {
            backing: Backing::Shared(store, consumer.to_owned()),
            map,
            saved: Instant::now(),
            journal: None,
        })
    }

    /// Every cursor.
    pub fn all(&self) -> &BTreeMap<String, u64> {
        &self.map
    }

    /// One cursor.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.map.get(name).copied()
    }

    /// Sets a cursor and writes it durably before returning (the file, fsynced; or the
    /// shared cursor stream, acknowledged).
    pub fn set(&mut self, name: &str, position: u64) -> Result<(), String> {
        self.map.insert(name.to_owned(), position);
        self.write()
    }

    /// Moves a cursor past records the consumer had nothing to do for: kept in memory,
    /// and written (with every other cursor of this consumer) only when the last write
    /// is [`IDLE_SAVE_INTERVAL`] old. Returns whether it wrote. A restart resumes from
    /// the last write and rescans the records in between, which is safe exactly when
    /// they needed no work (at least once, never lost).
    pub fn advance(&mut self, name: &str, position: u64) -> Result<bool, String> {
        self.map.insert(name.to_owned(), position);
        if self.saved.elapsed() < IDLE_SAVE_INTERVAL {
            return Ok(false);
        }
        self.write().map(|()| true)
    }

    fn write(&mut self) -> Result<(), String> {
        let bytes = serde_json::to_vec(&self.map).map_err(|e| e.to_string())?;
        if let Some(j) = &self.journal {
            j.stats().cursor_writes.fetch_add(1, Ordering::Relaxed);
        }
        match &self.backing {
            Backing::File(path) => write_file(path, &bytes),
            Backing::Shared(store, consumer) => store.cursor_put(consumer, bytes),
        }?;
        // Only a write that succeeded starts the next interval (a failed one is tried
        // again with the next advance).
        self.saved = Instant::now();
        Ok(())
    }
}

/// Writes a cursor file atomically: a temporary file, fsynced, renamed over `path`.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every consumer's cursor file in `dir` as (consumer, JSON bytes), checked to parse;
/// none if `dir` does not exist.
pub(crate) fn read_cursor_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let Some(consumer) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_slice::<BTreeMap<String, u64>>(&bytes)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        files.push((consumer.to_owned(), bytes));
    }
    files.sort();
    Ok(files)
}

/// Writes one consumer's cursors as `<dir>/<consumer>.json` (checked to parse).
pub(crate) fn write_cursor_file(dir: &Path, consumer: &str, bytes: &[u8]) -> Result<(), String> {
    serde_json::from_slice::<BTreeMap<String, u64>>(bytes)
        .map_err(|e| format!("cursors of {consumer}: {e}"))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    write_file(&dir.join(format!("{consumer}.json")), bytes)
}

impl Journal {
    /// With a shared journal, makes sure the cursor stream exists (a NATS cluster still
    /// electing leaders times its creation out: callers retry this, then start their
    /// consumers once). Nothing with the embedded journal.
    pub fn prepare_cursors(&self) -> Result<(), String> {
        match self.shared_store() {
            Some(store) => store.cursor_get("~probe").map(|_| ()),
            None => Ok(()),
        }
    }

    /// A consumer's cursors: `<dir>/<consumer>.json` with the embedded journal; with a
    /// shared one ([`crate::nats`]) the stream `<stream>_cursors`, so whichever process
    /// runs the consumer resumes where the last one stopped.
    pub fn cursors(&self, dir: &Path, consumer: &str) -> Result<Cursors, String> {
        let mut c = match self.shared_store() {
            Some(store) => Cursors::open_shared(store, consumer),
            None => Cursors::open(dir, consumer),
        }?;
        c.journal = Some(self.clone());
        Ok(c)
    }

    /// Waits until the durable head passes `after`, then reads up to `limit` records
    /// after it: from the in-memory tail of recent records when they are still there
    /// ([`Journal::read_after_shared`], shared with the projections, PDU parsed once),
    /// else from the store. Returns an empty batch only when the journal stops.
    pub async fn next_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<std::sync::Arc<StoredRecord>>, JournalError> {
        let mut rx = self.subscribe();
        if rx.wait_for(|h| *h > after).await.is_err() {
            return Ok(Vec::new());
        }
        self.read_after_shared(after, limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_survive_reopen_and_refuse_a_corrupt_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Cursors::open(dir.path(), "federation-sender").unwrap();
        assert_eq!(c.get("a.org"), None);
        c.set("a.org", 41).unwrap();
        c.set("b.org", 7).unwrap();
        c.set("a.org", 42).unwrap();
        let c = Cursors::open(dir.path(), "federation-sender").unwrap();
        assert_eq!(
            c.all()
                .iter()
                .map(|(k, v)| (k.as_str(), *v))
                .collect::<Vec<_>>(),
            vec![("a.org", 42), ("b.org", 7)]
        );
        // An idle advance stays in memory until the interval has passed.
        let mut c = Cursors::open(dir.path(), "federation-sender").unwrap();
        assert!(!c.advance("a.org", 50).unwrap());
        assert_eq!(c.get("a.org"), Some(50));
        let reopened = Cursors::open(dir.path(), "federation-sender").unwrap();
        assert_eq!(reopened.get("a.org"), Some(42));
        c.saved -= IDLE_SAVE_INTERVAL;
        assert!(c.advance("b.org", 9).unwrap());
        let reopened = Cursors::open(dir.path(), "federation-sender").unwrap();
        assert_eq!(
            (reopened.get("a.org"), reopened.get("b.org")),
            (Some(50), Some(9))
        );
        std::fs::write(dir.path().join("federation-sender.json"), b"{not json").unwrap();
        assert!(Cursors::open(dir.path(), "federation-sender").is_err());
    }
}
