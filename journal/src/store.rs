//! Journal storage behind a narrow trait (BRIEF §7): append a batch durably, read in
//! position order. [`FjallStore`] is the embedded default; a replicated log
//! (partitioned by room) could implement the same calls.
//!
//! The store keeps bytes, not meaning: records arrive encoded (the appender hashes
//! the exact bytes it hands over, so the hash chain covers what is on disk) and come
//! back as raw bytes or validated [`StoredRecord`]s.

use std::path::Path;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};

use crate::record::{RECORD_FORMAT, StoredRecord};

/// Memory settings of one embedded fjall database (the journal's, the projections'),
/// `[storage]` in the config (docs/operations.md, "Memory"). Bytes throughout.
///
/// fjall keeps every keyspace's recent writes in an in-memory memtable until it is
/// flushed to a table on disk. Its defaults (64 MiB per memtable, flushes forced only
/// once 512 MiB of its write-ahead log is unflushed) let a database of ~30 keyspaces
/// hold hundreds of MiB of memtables that only a restart gives back. Each database
/// takes these separately, so the engine holds at most about
/// `2 * (write_ahead_bytes + block_cache_bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageMemory {
    /// Largest memtable of a keyspace before it is flushed. Recorded per keyspace when
    /// the keyspace is created (fjall persists it): changing it applies to keyspaces
    /// created afterwards (a new data directory, a projection rebuild), while
    /// [`StorageMemory::write_ahead_bytes`] bounds the older ones too.
    pub memtable_bytes: u64,
    /// Unflushed write-ahead log a database may keep before the memtables holding its
    /// oldest part are flushed; this bounds the memtables of all keyspaces together.
    /// At least 64 MiB (fjall's minimum).
    pub write_ahead_bytes: u64,
    /// Block cache of the database (recently read table blocks).
    pub block_cache_bytes: u64,
}

impl StorageMemory {
    /// fjall's minimum for [`StorageMemory::write_ahead_bytes`].
    pub const WRITE_AHEAD_MIN: u64 = 64 * 1024 * 1024;
    /// The smallest [`StorageMemory::memtable_bytes`] accepted (1 MiB).
    pub const MEMTABLE_MIN: u64 = 1024 * 1024;

    /// A `fjall` database builder for `dir` with these settings.
    pub fn builder(&self, dir: &Path) -> fjall::DatabaseBuilder<Database> {
        Database::builder(dir)
            .max_journaling_size(self.write_ahead_bytes.max(Self::WRITE_AHEAD_MIN))
            .cache_size(self.block_cache_bytes)
    }

    /// Options for a new keyspace with these settings.
    pub fn keyspace(&self) -> KeyspaceCreateOptions {
        KeyspaceCreateOptions::default().max_memtable_size(self.memtable_bytes)
    }
}

impl Default for StorageMemory {
    /// 8 MiB memtables, 64 MiB of write-ahead log, 32 MiB block cache.
    fn default() -> Self {
        StorageMemory {
            memtable_bytes: 8 * 1024 * 1024,
            write_ahead_bytes: Self::WRITE_AHEAD_MIN,
            block_cache_bytes: 32 * 1024 * 1024,
        }
    }
}

/// Memory the storage engine holds now, bytes (the `spindle_storage_*` metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageUse {
    /// Memtables of every keyspace, active and sealed, not yet flushed.
    pub write_buffer_bytes: u64,
    /// Block cache in use.
    pub block_cache_bytes: u64,
}

/// What `db` holds in memory now. Reads fjall's unstable accessors (fjall 3.1).
pub fn storage_use(db: &Database) -> StorageUse {
    StorageUse {
        write_buffer_bytes: db.write_buffer_size(),
        block_cache_bytes: db.cache_size(),
    }
}

/// One keyspace's size on disk: what `spindle storage` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyspaceDisk {
    /// The keyspace's name.
    pub name: String,
    /// Bytes its tables (SST files and blob files) take on disk, compressed; the
    /// memtable and the database's write-ahead journal are not counted.
    pub bytes: u64,
    /// Its approximate number of items (tombstones and versions not yet compacted
    /// away count too).
    pub items: usize,
}

/// Every keyspace of `db` with its size on disk, largest first.
pub fn disk_use(db: &Database) -> Result<Vec<KeyspaceDisk>, String> {
    let mut out = Vec::new();
    for name in db.list_keyspace_names() {
        let ks = db
            .keyspace(&name, KeyspaceCreateOptions::default)
            .map_err(|e| e.to_string())?;
        out.push(KeyspaceDisk {
            name: name.to_string(),
            bytes: ks.disk_space(),
            items: ks.approximate_len(),
        });
    }
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    Ok(out)
}

/// One record ready to be written: its position, its room (for the per-room index)
/// and its encoded envelope.
#[derive(Debug, Clone)]
pub struct EncodedRecord {
    /// Global position.
    pub position: u64,
    /// Room of an event record.
    pub room_id: Option<String>,
    /// The rkyv bytes ([`crate::Record::encode`]), exactly what is stored and hashed.
    pub bytes: Vec<u8>,
    /// The record's transaction key ([`crate::txn`]), indexed in the same batch.
    pub txn_key: Option<Vec<u8>>,
}

/// Durable, ordered record storage.
pub trait JournalStore: Send + Sync + 'static {
    /// Writes the records (already positioned, contiguous, ascending) atomically and
    /// returns only once they are on disk (fsync).
    fn append(&self, records: &[EncodedRecord]) -> Result<(), String>;
    /// Up to `limit` stored values with position > `after`, ascending, unvalidated:
    /// `(position key, bytes)`. The chain check reads these to name a bad position.
    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String>;
    /// Up to `limit` records with position > `after`, ascending, validated.
    fn read_after(&self, after: u64, limit: usize) -> Result<Vec<StoredRecord>, String> {
        self.read_raw_after(after, limit)?
            .into_iter()
            .map(|(pos, bytes)| {
                StoredRecord::from_bytes(&bytes).map_err(|e| format!("record {pos}: {e}"))
            })
            .collect()
    }
    /// Positions of a room's records after `after`, ascending (the per-room linear index).
    fn room_positions(&self, room_id: &str, after: u64, limit: usize) -> Result<Vec<u64>, String>;
    /// Durably removes every record at `position` or later and its index entries.
    /// Only start-up recovery calls this, for a torn tail.
    fn truncate_from(&self, position: u64) -> Result<(), String>;
    /// Position of the last stored record (0: none); progress logs only.
    fn last_position(&self) -> Result<u64, String> {
        Ok(0)
    }
    /// Position of the record a transaction key ([`crate::txn`]) was appended with, if
    /// any. A store without the index answers `None` (idempotency then holds only
    /// while the key is in the journal's hot set).
    fn txn_position(&self, _key: &[u8]) -> Result<Option<u64>, String> {
        Ok(None)
    }
    /// Writes transaction-index entries for records already stored (start-up replay
    /// rebuilds the index of a journal written before it existed). Not synced: a lost
    /// entry is written again by the next start-up's replay.
    fn index_txns(&self, _entries: &[(Vec<u8>, u64)]) -> Result<(), String> {
        Ok(())
    }
    /// The write-model snapshot ([`crate::snapshot`]), if one was saved.
    fn load_snapshot(&self) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }
    /// Durably replaces the write-model snapshot. A store without a snapshot slot
    /// keeps none (every start replays the whole journal).
    fn save_snapshot(&self, _bytes: &[u8]) -> Result<(), String> {
        Ok(())
    }
    /// Durably removes the write-model snapshot (the next start replays everything).
    fn delete_snapshot(&self) -> Result<(), String> {
        Ok(())
    }
    /// What the store holds in memory now, if it knows (metrics only).
    fn memory_use(&self) -> Option<StorageUse> {
        None
    }
}

/// The fjall-backed journal: keyspace `records` (position BE u64 -> rkyv record),
/// keyspace `room_log` (room id, 0x00, position BE u64 -> empty) and keyspace `txn_ids`
/// (transaction key, [`crate::txn`] -> position BE u64), written in one batch,
/// and keyspace `meta` (`record_format` -> u16 BE: the envelope format of every record).
pub struct FjallStore {
    db: Database,
    records: Keyspace,
    room_log: Keyspace,
    txn_ids: Keyspace,
    meta: Keyspace,
}

const FORMAT_KEY: &str = "record_format";
/// The `meta` key of the write-model snapshot (see [`crate::snapshot`]).
const SNAPSHOT_KEY: &str = "write_model_snapshot";

impl FjallStore {
    /// Opens (or creates) the journal database in `dir`. Refuses a journal written in
    /// another record format with a message naming the way forward (format 1:
    /// `spindle journal migrate`).
    pub fn open(dir: &Path) -> Result<FjallStore, String> {
        Self::open_with(dir, StorageMemory::default())
    }

    /// [`FjallStore::open`] with the given memory settings.
    pub fn open_with(dir: &Path, memory: StorageMemory) -> Result<FjallStore, String> {
        let store = Self::open_any_format_with(dir, memory)?;
        match store.stored_format()? {
            f if f == RECORD_FORMAT => Ok(store),
            1 => Err(format!(
                "the journal in {} is in record format 1 (before the hash chain); this release \
                 reads and writes format {RECORD_FORMAT}. Stop the server and run \
                 `spindle journal migrate` (it keeps the old journal as journal.format1)",
                dir.display()
            )),
            f => Err(format!(
                "the journal in {} is in record format {f}, newer than this release's \
                 {RECORD_FORMAT}; run a newer spindle",
                dir.display()
            )),
        }
    }

    /// Opens the journal database without checking its format (for `journal migrate`
    /// and `journal check`). A new, empty journal is marked with [`RECORD_FORMAT`].
    pub fn open_any_format(dir: &Path) -> Result<FjallStore, String> {
        Self::open_any_format_with(dir, StorageMemory::default())
    }

    fn open_any_format_with(dir: &Path, memory: StorageMemory) -> Result<FjallStore, String> {
        let db = memory
            .builder(dir)
            .manual_journal_persist(true)
            .open()
            .map_err(|e| e.to_string())?;
        let records = db
            .keyspace("records", || memory.keyspace())
            .map_err(|e| e.to_string())?;
        let room_log = db
            .keyspace("room_log", || memory.keyspace())
            .map_err(|e| e.to_string())?;
        let txn_ids = db
            .keyspace("txn_ids", || memory.keyspace())
            .map_err(|e| e.to_string())?;
        let meta = db
            .keyspace("meta", || memory.keyspace())
            .map_err(|e| e.to_string())?;
        let store = FjallStore {
            db,
            records,
            room_log,
            txn_ids,
            meta,
        };
        let marked = store.meta.get(FORMAT_KEY).map_err(|e| e.to_string())?;
        let empty = store.records.first_key_value().is_none();
        if marked.is_none() && empty {
            store.set_format(RECORD_FORMAT)?;
        }
        Ok(store)
    }

    /// The record format of this journal: the `meta` marker, or 1 for a non-empty
    /// journal without one (format 1 had no marker).
    pub fn stored_format(&self) -> Result<u16, String> {
        match self.meta.get(FORMAT_KEY).map_err(|e| e.to_string())? {
            Some(v) if v.len() == 2 => Ok(u16::from_be_bytes([v[0], v[1]])),
            Some(_) => Err("unreadable record_format marker".into()),
            None => Ok(1),
        }
    }

    /// The transaction keys ([`crate::txn`]) of records after `after`, by position (a
    /// full pass over the index: for copying a journal, not for serving).
    pub fn txn_keys_after(
        &self,
        after: u64,
    ) -> Result<std::collections::HashMap<u64, Vec<u8>>, String> {
        let mut keys = std::collections::HashMap::new();
        for kv in self.txn_ids.iter() {
            let (k, v) = kv.into_inner().map_err(|e| e.to_string())?;
            let position = position_of(&v)?;
            if position > after {
                keys.insert(position, k.to_vec());
            }
        }
        Ok(keys)
    }

    /// Every keyspace's size on disk ([`disk_use`]).
    pub fn disk_use(&self) -> Result<Vec<KeyspaceDisk>, String> {
        disk_use(&self.db)
    }

    /// Fsyncs everything written so far (after unsynced [`FjallStore::append_with`]).
    pub fn sync(&self) -> Result<(), String> {
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }

    /// Writes records as [`JournalStore::append`] does; with `sync` false the write is
    /// handed to the OS but not fsynced (the JetStream backend's local mirror, whose
    /// authority is the stream: a machine crash loses at most a tail it copies again).
    pub fn append_with(&self, records: &[EncodedRecord], sync: bool) -> Result<(), String> {
        let mut batch = self.db.batch();
        for r in records {
            batch.insert(&self.records, r.position.to_be_bytes(), r.bytes.as_slice());
            if let Some(room) = &r.room_id {
                batch.insert(&self.room_log, room_key(room, r.position), b"");
            }
            if let Some(k) = &r.txn_key {
                batch.insert(&self.txn_ids, k.as_slice(), r.position.to_be_bytes());
            }
        }
        batch.commit().map_err(|e| e.to_string())?;
        // Unsynced writes still reach the OS, so a process that stops keeps them.
        self.db
            .persist(if sync {
                PersistMode::SyncAll
            } else {
                PersistMode::Buffer
            })
            .map_err(|e| e.to_string())
    }

    /// Writes the format marker durably (migration writes it last).
    pub fn set_format(&self, format: u16) -> Result<(), String> {
        self.meta
            .insert(FORMAT_KEY, format.to_be_bytes())
            .map_err(|e| e.to_string())?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }
}

fn room_key(room_id: &str, position: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(room_id.len() + 9);
    k.extend_from_slice(room_id.as_bytes());
    k.push(0);
    k.extend_from_slice(&position.to_be_bytes());
    k
}

fn position_of(key: &[u8]) -> Result<u64, String> {
    let pos: [u8; 8] = key
        .get(key.len().saturating_sub(8)..)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| "bad journal key".to_string())?;
    Ok(u64::from_be_bytes(pos))
}

impl JournalStore for FjallStore {
    fn memory_use(&self) -> Option<StorageUse> {
        Some(storage_use(&self.db))
    }

    fn append(&self, records: &[EncodedRecord]) -> Result<(), String> {
        self.append_with(records, true)
    }

    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String> {
        let Some(start) = after.checked_add(1) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for kv in self.records.range(start.to_be_bytes()..) {
            if out.len() >= limit {
                break;
            }
            let (k, v) = kv.into_inner().map_err(|e| e.to_string())?;
            out.push((position_of(&k)?, v.to_vec()));
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
            out.push(position_of(&k)?);
        }
        Ok(out)
    }

    fn last_position(&self) -> Result<u64, String> {
        match self.records.last_key_value() {
            Some(kv) => position_of(&kv.key().map_err(|e| e.to_string())?),
            None => Ok(0),
        }
    }

    fn txn_position(&self, key: &[u8]) -> Result<Option<u64>, String> {
        match self.txn_ids.get(key).map_err(|e| e.to_string())? {
            Some(v) => position_of(&v).map(Some),
            None => Ok(None),
        }
    }

    fn index_txns(&self, entries: &[(Vec<u8>, u64)]) -> Result<(), String> {
        let mut batch = self.db.batch();
        for (k, position) in entries {
            batch.insert(&self.txn_ids, k.as_slice(), position.to_be_bytes());
        }
        batch.commit().map_err(|e| e.to_string())
    }

    fn load_snapshot(&self) -> Result<Option<Vec<u8>>, String> {
        Ok(self
            .meta
            .get(SNAPSHOT_KEY)
            .map_err(|e| e.to_string())?
            .map(|v| v.to_vec()))
    }

    fn save_snapshot(&self, bytes: &[u8]) -> Result<(), String> {
        self.meta
            .insert(SNAPSHOT_KEY, bytes)
            .map_err(|e| e.to_string())?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }

    fn delete_snapshot(&self) -> Result<(), String> {
        self.meta.remove(SNAPSHOT_KEY).map_err(|e| e.to_string())?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }

    fn truncate_from(&self, position: u64) -> Result<(), String> {
        let mut batch = self.db.batch();
        for kv in self.records.range(position.to_be_bytes()..) {
            let k = kv.key().map_err(|e| e.to_string())?;
            batch.remove(&self.records, k.to_vec());
        }
        // The room index has no position-first order; a full pass is fine on this
        // recovery-only path.
        for kv in self.room_log.iter() {
            let k = kv.key().map_err(|e| e.to_string())?;
            if position_of(&k)? >= position {
                batch.remove(&self.room_log, k.to_vec());
            }
        }
        for kv in self.txn_ids.iter() {
            let (k, v) = kv.into_inner().map_err(|e| e.to_string())?;
            if position_of(&v)? >= position {
                batch.remove(&self.txn_ids, k.to_vec());
            }
        }
        batch.commit().map_err(|e| e.to_string())?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }
}
