//! Projection storage: one fjall database (`<data>/projections`) shared by every
//! projection, each owning its own keyspaces (`<projection>.<table>`) plus its row in
//! the `checkpoints` keyspace. A projection's writes for a run of records and its new
//! checkpoint are committed in one atomic batch.
//!
//! Reads during apply go through [`ApplyCtx`], which overlays the batch's pending
//! writes on the committed data, so a record can read what an earlier record of the
//! same batch wrote.
//!
//! **Generations.** A projection's tables live in generation `g` of its keyspaces:
//! `<projection>.<table>` for generation 0, `<projection>#g<g>.<table>` after online
//! rebuilds (the keyspace `generations` holds the current one per projection). An
//! online rebuild fills generation `g + 1` beside the live one, then swaps every
//! [`Table`] handle of the live projection to it at once (the handles share their
//! keyspace slot, so every clone follows) and deletes the old keyspaces. At open, the
//! keyspaces of any other generation (a rebuild interrupted by a restart) are deleted.
//! Table *names* (digests, renders, staging) are always the logical
//! `<projection>.<table>`, whatever the generation.
//!
//! **Layouts.** A projection whose row shapes change between releases declares a new
//! layout version; [`ProjectionDb::ensure_layout`] (called before its tables open)
//! deletes tables written in another layout so they are rebuilt from the journal.
//! The version is kept in `generations` under `<projection>#layout` (absent: 1).

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use fjall::{Database, Keyspace, KeyspaceCreateOptions};
use spindle_journal::{StorageMemory, StorageUse};

use crate::change_index::ChangeIndex;

/// Store counters for counting tests (BRIEF §3.9): point reads and rows scanned.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Point reads (`get`).
    pub reads: AtomicU64,
    /// Rows returned by range scans.
    pub rows_scanned: AtomicU64,
    /// Batches committed by projections ([`ApplyCtx::commit`]): staged rows and the
    /// checkpoint, one write to the store each.
    pub commits: AtomicU64,
}

impl StoreStats {
    /// Total store reads so far (point reads + rows scanned).
    pub fn total(&self) -> u64 {
        self.reads.load(Ordering::Relaxed) + self.rows_scanned.load(Ordering::Relaxed)
    }
}

/// The projections database.
#[derive(Clone)]
pub struct ProjectionDb {
    pub(crate) db: Database,
    pub(crate) checkpoints: Keyspace,
    /// Current generation per projection (u32 BE); absent is generation 0.
    pub(crate) generations: Keyspace,
    pub(crate) stats: Arc<StoreStats>,
    /// Tables of this projection are opened in this generation instead of the current
    /// one (a rebuild's handle, [`ProjectionDb::for_generation`]).
    shadow: Option<(Arc<str>, u32)>,
    /// Settings new tables are created with.
    memory: StorageMemory,
}

/// The keyspace name prefix of `projection`'s tables in `generation`.
fn keyspace_prefix(projection: &str, generation: u32) -> String {
    if generation == 0 {
        format!("{projection}.")
    } else {
        format!("{projection}#g{generation}.")
    }
}

/// The checkpoint key of an online rebuild of `projection` into `generation`.
pub(crate) fn rebuild_checkpoint_key(projection: &str, generation: u32) -> String {
    format!("{projection}#g{generation}")
}

/// The key of `projection`'s layout version in the `generations` keyspace.
fn layout_key(projection: &str) -> String {
    format!("{projection}#layout")
}

/// (projection, generation) of a table keyspace name; `None` for other keyspaces.
fn parse_keyspace(name: &str) -> Option<(&str, u32)> {
    let (head, _) = name.split_once('.')?;
    match head.split_once("#g") {
        Some((p, g)) => Some((p, g.parse().ok()?)),
        None => Some((head, 0)),
    }
}

impl ProjectionDb {
    /// Opens (or creates) the projections database in `dir`. Commits are not fsynced
    /// individually: projections are rebuildable and each batch is atomic, so a crash
    /// only rewinds a checkpoint.
    pub fn open(dir: &Path) -> Result<ProjectionDb, String> {
        Self::open_with(dir, StorageMemory::default())
    }

    /// [`ProjectionDb::open`] with the given memory settings (`[storage]`).
    pub fn open_with(dir: &Path, memory: StorageMemory) -> Result<ProjectionDb, String> {
        let db = memory.builder(dir).open().map_err(|e| e.to_string())?;
        let checkpoints = db
            .keyspace("checkpoints", || memory.keyspace())
            .map_err(|e| e.to_string())?;
        let generations = db
            .keyspace("generations", || memory.keyspace())
            .map_err(|e| e.to_string())?;
        let pdb = ProjectionDb {
            db,
            checkpoints,
            generations,
            stats: Arc::new(StoreStats::default()),
            shadow: None,
            memory,
        };
        pdb.drop_stale_generations()?;
        Ok(pdb)
    }

    /// Deletes the keyspaces and checkpoints of generations that are not current (an
    /// online rebuild cut short by a restart, or old ones whose deletion was).
    fn drop_stale_generations(&self) -> Result<(), String> {
        let mut dropped = 0usize;
        for name in self.db.list_keyspace_names() {
            let Some((projection, generation)) = parse_keyspace(&name) else {
                continue;
            };
            if generation != self.generation(projection) {
                let ks = self
                    .db
                    .keyspace(&name, KeyspaceCreateOptions::default)
                    .map_err(|e| e.to_string())?;
                self.db.delete_keyspace(ks).map_err(|e| e.to_string())?;
                dropped += 1;
            }
        }
        let stale: Vec<Vec<u8>> = self
            .checkpoints
            .iter()
            .filter_map(|kv| kv.into_inner().ok())
            .map(|(k, _)| k.to_vec())
            .filter(|k| k.windows(2).any(|w| w == b"#g"))
            .collect();
        for k in &stale {
            self.checkpoints
                .remove(k.clone())
                .map_err(|e| e.to_string())?;
        }
        if dropped > 0 || !stale.is_empty() {
            tracing::info!(
                keyspaces = dropped,
                checkpoints = stale.len(),
                "deleted the tables of an unfinished or replaced projection generation"
            );
        }
        Ok(())
    }

    /// Every keyspace name in the database (tests and diagnostics).
    pub fn keyspace_names(&self) -> Vec<String> {
        self.db
            .list_keyspace_names()
            .into_iter()
            .map(|n| n.to_string())
            .collect()
    }

    /// The current generation of `projection`'s tables (0 until an online rebuild).
    pub fn generation(&self, projection: &str) -> u32 {
        match self.generations.get(projection) {
            Ok(Some(v)) if v.len() == 4 => u32::from_be_bytes(v[..4].try_into().expect("4 bytes")),
            _ => 0,
        }
    }

    /// A handle on the same database that opens `projection`'s tables in `generation`
    /// (for building a projection beside the live one; see the module doc).
    pub fn for_generation(&self, projection: &str, generation: u32) -> ProjectionDb {
        ProjectionDb {
            shadow: Some((Arc::from(projection), generation)),
            ..self.clone()
        }
    }

    /// Every keyspace's size on disk, largest first (table keyspaces are named
    /// `<projection>.<table>`, `#g<n>` after the projection in a rebuilt generation).
    pub fn disk_use(&self) -> Result<Vec<spindle_journal::store::KeyspaceDisk>, String> {
        spindle_journal::store::disk_use(&self.db)
    }

    /// What this database holds in memory now (memtables, block cache).
    pub fn storage_use(&self) -> StorageUse {
        spindle_journal::store::storage_use(&self.db)
    }

    /// Opens one table of a projection (in its current generation).
    pub fn table(&self, projection: &str, name: &str) -> Result<Table, String> {
        let generation = match &self.shadow {
            Some((p, g)) if &**p == projection => *g,
            _ => self.generation(projection),
        };
        let ks = self
            .db
            .keyspace(
                &format!("{}{name}", keyspace_prefix(projection, generation)),
                || self.memory.keyspace(),
            )
            .map_err(|e| e.to_string())?;
        Ok(Table {
            ks: Arc::new(parking_lot::RwLock::new(ks)),
            stats: self.stats.clone(),
            id: Arc::from(format!("{projection}.{name}")),
        })
    }

    /// Makes `generation` the current generation of `projection` with `checkpoint`, and
    /// drops the rebuild's own checkpoint row, in one durable batch (the swap point of
    /// an online rebuild: a restart after it opens the new generation).
    pub(crate) fn commit_generation(
        &self,
        projection: &str,
        generation: u32,
        checkpoint: u64,
    ) -> Result<(), String> {
        let mut batch = self.db.batch();
        batch.insert(&self.generations, projection, generation.to_be_bytes());
        batch.insert(&self.checkpoints, projection, checkpoint.to_be_bytes());
        batch.remove(
            &self.checkpoints,
            rebuild_checkpoint_key(projection, generation),
        );
        batch.commit().map_err(|e| e.to_string())?;
        self.db
            .persist(fjall::PersistMode::SyncAll)
            .map_err(|e| e.to_string())
    }

    /// Deletes keyspaces (the old generation after a swap). Readers still holding a
    /// handle keep reading it; fjall removes the files when the last handle goes.
    pub(crate) fn delete_keyspaces(&self, old: Vec<Keyspace>) -> Result<(), String> {
        for ks in old {
            self.db.delete_keyspace(ks).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The checkpoint (last applied position) of a projection; 0 if it never ran.
    pub fn checkpoint(&self, projection: &str) -> u64 {
        match self.checkpoints.get(projection) {
            Ok(Some(v)) if v.len() == 8 => u64::from_be_bytes(v[..8].try_into().expect("8 bytes")),
            _ => 0,
        }
    }

    /// Deletes every table of `projection` (the keyspaces `<projection>.*`) and its
    /// checkpoint, durably, so the next start rebuilds it from position 0. Offline only
    /// (no runtime may be tailing this database). Returns how many tables were deleted;
    /// 0 and no checkpoint means no such projection.
    pub fn reset_projection(&self, projection: &str) -> Result<(usize, bool), String> {
        let mut deleted = 0;
        for name in self.db.list_keyspace_names() {
            if parse_keyspace(&name).is_some_and(|(p, _)| p == projection) {
                let ks = self
                    .db
                    .keyspace(&name, KeyspaceCreateOptions::default)
                    .map_err(|e| e.to_string())?;
                self.db.delete_keyspace(ks).map_err(|e| e.to_string())?;
                deleted += 1;
            }
        }
        let had_checkpoint = self
            .checkpoints
            .get(projection)
            .map_err(|e| e.to_string())?
            .is_some();
        self.checkpoints
            .remove(projection)
            .map_err(|e| e.to_string())?;
        self.generations
            .remove(projection)
            .map_err(|e| e.to_string())?;
        self.db
            .persist(fjall::PersistMode::SyncAll)
            .map_err(|e| e.to_string())?;
        Ok((deleted, had_checkpoint))
    }

    /// The layout version `projection`'s tables are written in (see
    /// [`ProjectionDb::ensure_layout`]); 1 when none was recorded (every projection
    /// before layouts were versioned).
    pub fn layout(&self, projection: &str) -> u32 {
        match self.generations.get(layout_key(projection)) {
            Ok(Some(v)) if v.len() == 4 => u32::from_be_bytes(v[..4].try_into().expect("4 bytes")),
            _ => 1,
        }
    }

    /// Makes sure `projection`'s tables are in `layout`, the version of the row shapes
    /// the running code reads and writes. Tables written in another layout are deleted
    /// with the checkpoint (as [`ProjectionDb::reset_projection`] does), so the runtime
    /// starting next replays the projection from position 0 while the server serves
    /// (see [`crate::runtime`], "Backfilling"); then `layout` is recorded, durably.
    /// Call before the projection's tables are opened. Returns whether tables were
    /// reset (`false` for a database that had none of them).
    pub fn ensure_layout(&self, projection: &str, layout: u32) -> Result<bool, String> {
        let found = self.layout(projection);
        if found == layout {
            return Ok(false);
        }
        let (tables, had_checkpoint) = self.reset_projection(projection)?;
        let reset = tables > 0 || had_checkpoint;
        if reset {
            tracing::warn!(
                projection,
                from = found,
                to = layout,
                tables,
                "projection layout changed: its tables are rebuilt from the journal (served meanwhile from what is rebuilt so far)"
            );
        }
        self.generations
            .insert(layout_key(projection), layout.to_be_bytes())
            .map_err(|e| e.to_string())?;
        self.db
            .persist(fjall::PersistMode::SyncAll)
            .map_err(|e| e.to_string())?;
        Ok(reset)
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<StoreStats> {
        &self.stats
    }
}

/// One keyspace of a projection, with counted reads. Clones share the keyspace slot,
/// so an online rebuild's swap ([`Table::swap_keyspace`]) moves every clone at once.
#[derive(Clone)]
pub struct Table {
    ks: Arc<parking_lot::RwLock<Keyspace>>,
    stats: Arc<StoreStats>,
    id: Arc<str>,
}

impl Table {
    /// The keyspace this table reads and writes now.
    fn ks(&self) -> Keyspace {
        self.ks.read().clone()
    }

    /// Points this table (and every clone) at `other`'s keyspace; returns the old one.
    pub(crate) fn swap_keyspace(&self, other: &Table) -> Keyspace {
        let new = other.ks();
        std::mem::replace(&mut *self.ks.write(), new)
    }

    /// Point read.
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.ks.read().get(key).ok().flatten().map(|v| v.to_vec())
    }

    /// Point read that is not counted (the apply path; counters measure queries).
    pub(crate) fn get_uncounted(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.ks.read().get(key).ok().flatten().map(|v| v.to_vec())
    }

    /// Ascending scan of keys starting with `prefix`, at most `limit` rows.
    pub fn scan_prefix(&self, prefix: &[u8], limit: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        for kv in self.ks().prefix(prefix) {
            if out.len() >= limit {
                break;
            }
            if let Ok((k, v)) = kv.into_inner() {
                out.push((k.to_vec(), v.to_vec()));
            }
        }
        self.stats
            .rows_scanned
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    /// Scan of `[start, end)` ascending (or descending when `reverse`), at most `limit` rows.
    pub fn scan_range(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Vec<(Vec<u8>, Vec<u8>)> {
        let iter = self.ks().range(start.to_vec()..end.to_vec());
        let rows: Box<dyn Iterator<Item = fjall::Guard>> = if reverse {
            Box::new(iter.rev())
        } else {
            Box::new(iter)
        };
        let out: Vec<(Vec<u8>, Vec<u8>)> = rows
            .filter_map(|kv| kv.into_inner().ok())
            .take(limit)
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        self.stats
            .rows_scanned
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    /// The table's full name (`<projection>.<table>`).
    pub fn name(&self) -> &str {
        &self.id
    }

    /// Every row, for digests and snapshots.
    pub(crate) fn all(&self) -> impl Iterator<Item = (Vec<u8>, Vec<u8>)> + '_ {
        self.ks()
            .iter()
            .filter_map(|kv| kv.into_inner().ok())
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
    }
}

/// The latest position in a per-key log (`key`, 0x00, position BE), kept in memory
/// once asked for: long-polling `/sync` asks "did anything change for this user or
/// room since P?" on every commit anywhere, and must not pay a store read for it.
///
/// Kept in a [`ChangeIndex`]: built with [`LastChange::known_after`] (the projection's
/// checkpoint when it was opened; every later change is bumped in), it also answers
/// "which keys changed after P" without asking key by key
/// ([`LastChange::changed_after`]).
#[derive(Clone)]
pub struct LastChange {
    index: Arc<parking_lot::RwLock<ChangeIndex>>,
}

impl Default for LastChange {
    /// Answers [`LastChange::get`] only: [`LastChange::changed_after`] answers `None`
    /// for every real position.
    fn default() -> Self {
        LastChange::known_after(u64::MAX)
    }
}

impl LastChange {
    /// An empty cache that knows every change after `checkpoint` once the projection
    /// bumps each change it commits ([`LastChange::bump`]).
    pub fn known_after(checkpoint: u64) -> LastChange {
        LastChange {
            index: Arc::new(parking_lot::RwLock::new(ChangeIndex::new(checkpoint))),
        }
    }

    /// The latest position logged under `k` (0 if none): memory, or one reverse seek
    /// the first time.
    pub fn get(&self, k: &str, table: &Table) -> u64 {
        self.get_or_find(k, || {
            let start = key::prefix(&[k]);
            let mut end = start.clone();
            *end.last_mut().expect("non-empty") = 1;
            table
                .scan_range(&start, &end, true, 1)
                .first()
                .map(|(k, _)| key::trailing_pos(k))
                .unwrap_or(0)
        })
    }

    /// The position remembered under `k`, or `find()` (a read of the committed
    /// tables, 0 if nothing) the first time. For logs where not every row counts.
    pub fn get_or_find(&self, k: &str, find: impl FnOnce() -> u64) -> u64 {
        if let Some(v) = self.index.read().get(k) {
            return v;
        }
        let found = find();
        self.index.write().bump(k, found)
    }

    /// Records a new position (called after the commit that wrote it).
    pub fn bump(&self, k: String, position: u64) {
        self.index.write().bump(&k, position);
    }

    /// Forgets every position and knows every change after `checkpoint` from now on:
    /// for a projection's `reload` (the tables may have been replaced by an online
    /// rebuild, whose rows need not match what was bumped; `checkpoint` is the one
    /// the tables now hold). `get` reads each key again.
    pub fn reset(&self, checkpoint: u64) {
        *self.index.write() = ChangeIndex::new(checkpoint);
    }

    /// Keys changed after `after`, at most `limit` (see [`ChangeIndex::changed_after`];
    /// `None`: ask key by key).
    pub fn changed_after(&self, after: u64, limit: usize) -> Option<Vec<Arc<str>>> {
        self.index.read().changed_after(after, limit)
    }
}

type Hook = Box<dyn FnOnce() + Send>;

/// Staged writes: (table id, key) -> (table, new value or `None` for a delete).
type Overlay = BTreeMap<(Arc<str>, Vec<u8>), (Table, Option<Vec<u8>>)>;

/// The write context of one batch: staged writes (readable back), the checkpoint,
/// and hooks that run after the commit (to refresh in-memory caches so they never run
/// ahead of the committed checkpoint).
pub struct ApplyCtx {
    overlay: parking_lot::Mutex<Overlay>,
    hooks: Vec<Hook>,
}

impl Default for ApplyCtx {
    fn default() -> Self {
        Self::new()
    }
}

impl ApplyCtx {
    /// An empty context.
    pub fn new() -> Self {
        ApplyCtx {
            overlay: parking_lot::Mutex::new(BTreeMap::new()),
            hooks: Vec::new(),
        }
    }

    /// Reads a key, seeing this batch's staged writes first.
    pub fn get(&self, table: &Table, key: &[u8]) -> Option<Vec<u8>> {
        if let Some((_, v)) = self.overlay.lock().get(&(table.id.clone(), key.to_vec())) {
            return v.clone();
        }
        table.get_uncounted(key)
    }

    /// Rows with keys starting with `prefix`: committed rows merged with this batch's
    /// staged writes and deletes, ascending. Keeps apply independent of batch boundaries.
    pub fn scan_prefix(&self, table: &Table, prefix: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut rows: BTreeMap<Vec<u8>, Vec<u8>> =
            table.scan_prefix(prefix, usize::MAX).into_iter().collect();
        for (k, v) in self.staged_range(table, prefix) {
            match v {
                Some(v) => rows.insert(k, v),
                None => rows.remove(&k),
            };
        }
        rows.into_iter().collect()
    }

    /// Keys of `table` in `[start, end)`: committed rows merged with this batch's staged
    /// writes and deletes, ascending, at most `limit` committed rows read.
    pub fn scan_keys_range(
        &self,
        table: &Table,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Vec<Vec<u8>> {
        let mut keys: std::collections::BTreeSet<Vec<u8>> = table
            .scan_range(start, end, false, limit)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let overlay = self.overlay.lock();
        for ((_, k), (_, v)) in
            overlay.range((table.id.clone(), start.to_vec())..(table.id.clone(), end.to_vec()))
        {
            match v {
                Some(_) => keys.insert(k.clone()),
                None => keys.remove(k),
            };
        }
        keys.into_iter().collect()
    }

    /// Staged writes (and deletes, as `None`) of `table` under `prefix`, ascending; a
    /// range over the overlay, not a walk of the whole batch.
    fn staged_range(&self, table: &Table, prefix: &[u8]) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let overlay = self.overlay.lock();
        overlay
            .range((table.id.clone(), prefix.to_vec())..)
            .take_while(|((id, k), _)| **id == *table.id && k.starts_with(prefix))
            .map(|((_, k), (_, v))| (k.clone(), v.clone()))
            .collect()
    }

    /// The staged value with the greatest key under `prefix` that sorts before `below`
    /// (a deleted row counts as absent): one reverse step in the overlay, so running
    /// counts cost O(log batch) per record, not O(rows of the prefix in the batch).
    pub fn staged_last_below(&self, table: &Table, prefix: &[u8], below: &[u8]) -> Option<Vec<u8>> {
        let overlay = self.overlay.lock();
        let start = (table.id.clone(), prefix.to_vec());
        let end = (table.id.clone(), below.to_vec());
        overlay
            .range(start..end)
            .rev()
            .find_map(|(_, (_, v))| v.clone())
    }

    /// Stages a write.
    pub fn put(&self, table: &Table, key: Vec<u8>, value: Vec<u8>) {
        self.overlay
            .lock()
            .insert((table.id.clone(), key), (table.clone(), Some(value)));
    }

    /// Stages a delete.
    pub fn delete(&self, table: &Table, key: Vec<u8>) {
        self.overlay
            .lock()
            .insert((table.id.clone(), key), (table.clone(), None));
    }

    /// Runs `f` after the batch is committed.
    pub fn after_commit(&mut self, f: impl FnOnce() + Send + 'static) {
        self.hooks.push(Box::new(f));
    }

    /// Whether nothing was staged: no row written or deleted and no hook to run.
    pub fn is_empty(&self) -> bool {
        self.hooks.is_empty() && self.overlay.lock().is_empty()
    }

    /// Commits staged writes and the checkpoint atomically, then runs the hooks.
    pub fn commit(
        self,
        db: &ProjectionDb,
        projection: &str,
        checkpoint: u64,
    ) -> Result<(), String> {
        let mut batch = db.db.batch();
        for ((_, key), (table, value)) in self.overlay.into_inner() {
            match value {
                Some(v) => batch.insert(&table.ks(), key, v),
                None => batch.remove(&table.ks(), key),
            }
        }
        batch.insert(&db.checkpoints, projection, checkpoint.to_be_bytes());
        batch.commit().map_err(|e| e.to_string())?;
        db.stats.commits.fetch_add(1, Ordering::Relaxed);
        for hook in self.hooks {
            hook();
        }
        Ok(())
    }
}

/// Key helpers: components joined by 0x00 (ids never contain NUL), positions as
/// big-endian u64 so byte order is numeric order.
pub mod key {
    /// Joins string parts with 0x00.
    pub fn join(parts: &[&str]) -> Vec<u8> {
        let mut k = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                k.push(0);
            }
            k.extend_from_slice(p.as_bytes());
        }
        k
    }

    /// `parts` joined, then 0x00, then the position.
    pub fn with_pos(parts: &[&str], pos: u64) -> Vec<u8> {
        let mut k = join(parts);
        k.push(0);
        k.extend_from_slice(&pos.to_be_bytes());
        k
    }

    /// `parts` joined plus a trailing 0x00 (a prefix for scans).
    pub fn prefix(parts: &[&str]) -> Vec<u8> {
        let mut k = join(parts);
        k.push(0);
        k
    }

    /// The trailing big-endian position of a key.
    pub fn trailing_pos(k: &[u8]) -> u64 {
        if k.len() < 8 {
            return 0;
        }
        u64::from_be_bytes(k[k.len() - 8..].try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (at most 30 s) until the memtables of `db` hold at most `bound` bytes and
    /// returns what they hold then. Flushes run on fjall's workers, hence the wait.
    fn memtables_settle(db: &ProjectionDb, bound: u64) -> u64 {
        for _ in 0..300 {
            let held = db.storage_use().write_buffer_bytes;
            if held <= bound {
                return held;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        db.storage_use().write_buffer_bytes
    }

    #[test]
    fn tables_are_created_with_the_configured_memtable_bound() {
        let dir = tempfile::tempdir().unwrap();
        let memory = StorageMemory {
            memtable_bytes: 1024 * 1024,
            ..StorageMemory::default()
        };
        let db = ProjectionDb::open_with(dir.path(), memory).unwrap();
        let table = db.table("p", "rows").unwrap();
        // 24 MiB of rows: with fjall's own default (64 MiB memtables) every byte of it
        // would still be in memory.
        let value = vec![7u8; 4096];
        for batch in 0..24u32 {
            let ctx = ApplyCtx::new();
            for i in 0..256u32 {
                ctx.put(
                    &table,
                    format!("{batch:04}-{i:04}").into_bytes(),
                    value.clone(),
                );
            }
            ctx.commit(&db, "p", u64::from(batch) + 1).unwrap();
        }
        let held = memtables_settle(&db, 3 * 1024 * 1024);
        assert!(
            held <= 3 * 1024 * 1024,
            "memtables hold {held} bytes after 24 MiB of writes with 1 MiB memtables"
        );
        // Nothing was lost to the flushes.
        assert_eq!(table.get(b"0000-0000"), Some(value.clone()));
        assert_eq!(table.get(b"0023-0255"), Some(value));
    }

    #[test]
    fn staged_writes_read_back_within_the_batch_and_commit_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let db = ProjectionDb::open(dir.path()).unwrap();
        let a = db.table("p", "a").unwrap();
        let b = db.table("p", "b").unwrap();
        let ctx = ApplyCtx::new();
        ctx.put(&a, b"room1\0x".to_vec(), b"1".to_vec());
        ctx.commit(&db, "p", 1).unwrap();

        let ctx = ApplyCtx::new();
        ctx.put(&a, b"room1\0y".to_vec(), b"2".to_vec());
        ctx.put(&b, b"room1\0z".to_vec(), b"other table".to_vec());
        ctx.delete(&a, b"room1\0x".to_vec());
        ctx.put(&a, b"room2\0q".to_vec(), b"3".to_vec());
        // Reads see the batch: the delete hides the committed row, the new row shows.
        assert_eq!(ctx.get(&a, b"room1\0x"), None);
        assert_eq!(ctx.get(&a, b"room1\0y"), Some(b"2".to_vec()));
        assert_eq!(
            ctx.scan_prefix(&a, b"room1\0"),
            vec![(b"room1\0y".to_vec(), b"2".to_vec())]
        );
        assert_eq!(
            ctx.staged_last_below(&a, b"room1\0", b"room1\0z"),
            Some(b"2".to_vec())
        );
        assert_eq!(ctx.staged_last_below(&a, b"room1\0", b"room1\0y"), None);
        assert_eq!(
            ctx.staged_last_below(&a, b"room2\0", b"room2\0\xff"),
            Some(b"3".to_vec())
        );
        // Nothing is visible outside the batch before the commit.
        assert_eq!(a.get(b"room1\0y"), None);
        assert_eq!(db.checkpoint("p"), 1);
        ctx.commit(&db, "p", 2).unwrap();
        assert_eq!(a.get(b"room1\0y"), Some(b"2".to_vec()));
        assert_eq!(a.get(b"room1\0x"), None);
        assert_eq!(b.get(b"room1\0z"), Some(b"other table".to_vec()));
        assert_eq!(db.checkpoint("p"), 2);
    }
}
