//! Journal storage behind a narrow trait (BRIEF §7): append a batch durably, read in
//! position order. [`FjallStore`] is the embedded default; a replicated log
//! (partitioned by room) could implement the same two calls.

use std::path::Path;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};

use crate::record::{Record, StoredRecord};

/// Durable, ordered record storage.
pub trait JournalStore: Send + Sync + 'static {
    /// Writes the records (already positioned, contiguous, ascending) atomically and
    /// returns only once they are on disk (fsync).
    fn append(&self, records: &[Record]) -> Result<(), String>;
    /// Up to `limit` records with position > `after`, ascending.
    fn read_after(&self, after: u64, limit: usize) -> Result<Vec<StoredRecord>, String>;
    /// Positions of a room's records after `after`, ascending (the per-room linear index).
    fn room_positions(&self, room_id: &str, after: u64, limit: usize) -> Result<Vec<u64>, String>;
}

/// The fjall-backed journal: keyspace `records` (position BE u64 -> rkyv record) and
/// keyspace `room_log` (room id, 0x00, position BE u64 -> empty), written in one batch.
pub struct FjallStore {
    db: Database,
    records: Keyspace,
    room_log: Keyspace,
}

impl FjallStore {
    /// Opens (or creates) the journal database in `dir`.
    pub fn open(dir: &Path) -> Result<FjallStore, String> {
        let db = Database::builder(dir)
            .manual_journal_persist(true)
            .open()
            .map_err(|e| e.to_string())?;
        let records = db
            .keyspace("records", KeyspaceCreateOptions::default)
            .map_err(|e| e.to_string())?;
        let room_log = db
            .keyspace("room_log", KeyspaceCreateOptions::default)
            .map_err(|e| e.to_string())?;
        Ok(FjallStore {
            db,
            records,
            room_log,
        })
    }
}

fn room_key(room_id: &str, position: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(room_id.len() + 9);
    k.extend_from_slice(room_id.as_bytes());
    k.push(0);
    k.extend_from_slice(&position.to_be_bytes());
    k
}

impl JournalStore for FjallStore {
    fn append(&self, records: &[Record]) -> Result<(), String> {
        let mut batch = self.db.batch();
        for r in records {
            batch.insert(&self.records, r.position.to_be_bytes(), r.encode());
            if let Some(room) = &r.room_id {
                batch.insert(&self.room_log, room_key(room, r.position), b"");
            }
        }
        batch.commit().map_err(|e| e.to_string())?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }

    fn read_after(&self, after: u64, limit: usize) -> Result<Vec<StoredRecord>, String> {
        let start = (after + 1).to_be_bytes();
        let mut out = Vec::new();
        for kv in self.records.range(start..) {
            if out.len() >= limit {
                break;
            }
            let (_, v) = kv.into_inner().map_err(|e| e.to_string())?;
            out.push(StoredRecord::from_bytes(&v)?);
        }
        Ok(out)
    }

    fn room_positions(&self, room_id: &str, after: u64, limit: usize) -> Result<Vec<u64>, String> {
        let start = room_key(room_id, after + 1);
        let end = room_key(room_id, u64::MAX);
        let mut out = Vec::new();
        for kv in self.room_log.range(start..=end) {
            if out.len() >= limit {
                break;
            }
            let k = kv.key().map_err(|e| e.to_string())?;
            let pos: [u8; 8] = k[k.len() - 8..]
                .try_into()
                .map_err(|_| "bad room_log key".to_string())?;
            out.push(u64::from_be_bytes(pos));
        }
        Ok(out)
    }
}
