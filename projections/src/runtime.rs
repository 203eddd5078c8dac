//! The projection runtime: each projection tails the journal from its own checkpoint
//! on its own thread, applying runs of records and committing its tables and new
//! checkpoint in one atomic batch (BRIEF §2).
//!
//! Readers wait explicitly: [`Runtime::wait_for`] blocks (bounded) until every
//! projection has applied a position, and [`Runtime::applied`] is the highest position
//! every projection has applied, which is what sync tokens are built from (tokens never
//! run ahead, BRIEF §3.6).
//!
//! **Backfilling.** A projection new in a release (checkpoint 0 while the others have
//! applied records of a non-empty journal) starts *backfilling*: it replays from
//! position 0 on its own thread while the server serves, logging its progress, and is
//! left out of [`Runtime::applied`] (so reads and tokens do not wait for it) until its
//! checkpoint reaches the journal head; then it is *ready* and joins. Readers of a
//! backfilling projection ask [`Runtime::is_ready`] first and answer "not yet" rather
//! than serve a half-built read model.
//!
//! **Projections that do not gate reads.** A projection whose
//! [`Projection::gates_reads`] is `false` (the search index) is left out of
//! [`Runtime::applied`] too: requests do not wait for it and no token is built from it.
//! Its readers wait for it alone ([`Runtime::wait_for_projection`]).
//! **Online rebuild.** [`Runtime::rebuild_online`] rebuilds an existing projection
//! while it keeps serving: a second instance of it, opened on the next *generation* of
//! its keyspaces ([`crate::store`]), replays from position 0 on its own thread and
//! commits batches (writes + its own checkpoint row) like any projection. Once it has
//! caught up with the live instance's checkpoint, it takes the live slot's apply lock
//! (the live tail holds it around apply + commit, so the live tables stop moving),
//! applies whatever is left up to at least the live checkpoint, makes its generation
//! current with its checkpoint in one durable batch, points every live table handle
//! at the new keyspaces, reloads the live instance's caches from them and releases the
//! lock; then the old keyspaces are deleted. Readers read through the live handles
//! throughout: before the swap they see the old, complete tables; after it the new,
//! complete ones, at a checkpoint no lower than before. Never a half-built table.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use spindle_journal::{Heads, Interest, Journal, StoredRecord};
use tokio::sync::watch;

use crate::store::{ApplyCtx, ProjectionDb, Table};

/// Records applied per batch (one commit each).
const BATCH: usize = 512;

/// Records applied per batch by a projection that lets records gather
/// ([`Projection::gather_ms`]): its commits are the costly ones (a tantivy segment
/// each, which the merge threads rewrite later), so under load it waits for this many
/// rather than [`BATCH`] (the journal's in-memory tail keeps more than this).
const GATHER_BATCH: usize = 4096;

/// A read model built from the journal. `apply` must be deterministic: no clocks, no
/// randomness, only the record and the projection's own tables.
pub trait Projection: Send + Sync + 'static {
    /// Unique name; prefixes the projection's keyspaces and names its checkpoint.
    fn name(&self) -> &'static str;
    /// Every table the projection owns (for digests and rebuilds).
    fn tables(&self) -> Vec<Table>;
    /// Applies one record, staging writes in `ctx`.
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String>;
    /// Reloads in-memory caches from the tables (at start-up).
    fn reload(&self) {}
    /// Commits whatever the projection keeps outside the projections database, just
    /// before the batch's tables and `checkpoint` are committed (the search index). If
    /// it fails, the batch is not committed and is applied again; if the process dies
    /// after it but before the table commit, the batch is applied again too, so what
    /// this commits must tolerate re-applied records.
    fn prepare_commit(&self, _checkpoint: u64) -> Result<(), String> {
        Ok(())
    }
    /// Runs after the batch's tables and `checkpoint` are committed.
    fn committed(&self, _checkpoint: u64) {}
    /// How long, in ms, the tail gathers records before applying a batch that is not
    /// full (0: apply what is there at once). Only for a projection that does not gate
    /// reads and whose commits are costly: its batches grow, its commits thin out.
    fn gather_ms(&self) -> u64 {
        0
    }
    /// Whether reads and sync tokens wait for this projection ([`Runtime::applied`]).
    /// `false` for a projection whose commits are too slow to sit on every request's
    /// path (the search index: a tantivy commit costs milliseconds); its readers wait
    /// for it alone with [`Runtime::wait_for_projection`], and no token is built from it.
    fn gates_reads(&self) -> bool {
        true
    }
    /// Which records the projection reads: `apply` sees only those, and its thread is
    /// woken only when one of them is appended. A projection that reads facts only is
    /// not woken by a message, yet counts as having applied it once it has applied
    /// every fact before it ([`Heads::covered`]). The default reads everything; a
    /// projection may narrow it only if its `apply` ignores every other record.
    fn interest(&self) -> Interest {
        Interest::ALL
    }
    /// A deterministic, readable rendering of everything the projection holds, for
    /// snapshot tests from recorded journals (`tests/snapshots.rs`). The default
    /// renders every table row by row ([`crate::render`]); override it only when rows
    /// are opaque, and keep it a function of the tables alone.
    fn render(&self) -> String {
        crate::render::render_tables(self.tables())
    }
    /// What the projection keeps outside the projections database, as (key, value)
    /// rows in key order, for [`digest`] (the search index: one row per event it
    /// holds). A function of the records applied, like the tables; the default is
    /// none. Read only at rest (digests and snapshots), never on a request's path.
    fn outside_rows(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        Vec::new()
    }
}

struct Slot {
    projection: Arc<dyn Projection>,
    /// [`Projection::gates_reads`], read once.
    gates: bool,
    /// [`Projection::interest`], read once.
    interest: Interest,
    /// The last position applied (records the projection does not read included, up
    /// to where its tail last read: see [`Slot::covered`] for where it stands).
    checkpoint: AtomicU64,
    /// The checkpoint last written to the store (it lags `checkpoint` by batches that
    /// changed nothing: [`IDLE_CHECKPOINT_RECORDS`]).
    stored: AtomicU64,
    /// `false` while backfilling (see the module doc); never goes back to `false`.
    ready: std::sync::atomic::AtomicBool,
    /// Held by the tail thread around apply + commit; an online rebuild's swap holds it
    /// so the live tables and checkpoint do not move under it.
    apply_lock: parking_lot::Mutex<()>,
    /// The generation of the live tables.
    generation: std::sync::atomic::AtomicU32,
    /// The online rebuild under way, if any.
    rebuild: parking_lot::Mutex<Option<RebuildProgress>>,
    /// Batches of records the tail thread read and applied ([`Runtime::batches`]).
    batches: AtomicU64,
    /// The highest position [`Slot::covered`] has answered: what it reports never goes
    /// back when a record it reads arrives after a run it did not read.
    covered: AtomicU64,
    /// Set by a reader waiting for this projection: its tail stops gathering
    /// ([`Projection::gather_ms`]) and applies what is there.
    hurry: parking_lot::Mutex<bool>,
    hurried: parking_lot::Condvar,
}

impl Slot {
    /// Sleeps up to `gather` ms unless a reader hurries the projection meanwhile
    /// ([`Runtime::wait_for_projection`]); clears the request.
    fn gather(&self, gather: u64) {
        let deadline = Instant::now() + Duration::from_millis(gather);
        let mut hurry = self.hurry.lock();
        while !*hurry {
            if self.hurried.wait_until(&mut hurry, deadline).timed_out() {
                break;
            }
        }
        *hurry = false;
    }

    /// Ends the current (or the next) gathering at once.
    fn hurry(&self) {
        *self.hurry.lock() = true;
        self.hurried.notify_all();
    }

    /// Where the projection stands in effect: its checkpoint, or the head when no
    /// record it reads is after its checkpoint ([`Heads::covered`]).
    fn covered(&self, heads: &Heads) -> u64 {
        let now = heads.covered(self.interest, self.checkpoint.load(Ordering::Acquire));
        self.covered.fetch_max(now, Ordering::AcqRel).max(now)
    }
}

/// A projection held still by [`Runtime::hold`] until this is dropped.
pub struct ProjectionHold<'a> {
    _guard: parking_lot::MutexGuard<'a, ()>,
}

/// An online rebuild's progress (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebuildProgress {
    /// The generation being built.
    pub generation: u32,
    /// The last position the rebuild has applied.
    pub checkpoint: u64,
}

/// One projection's progress, for `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectionStatus {
    /// Name.
    pub name: &'static str,
    /// The position applied in effect ([`Runtime::checkpoint`]).
    pub checkpoint: u64,
    /// `false` while backfilling.
    pub ready: bool,
    /// The generation of the live tables (0 until the first online rebuild).
    pub generation: u32,
    /// An online rebuild under way.
    pub rebuilding: Option<RebuildProgress>,
}

/// Why [`Runtime::rebuild_online`] refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RebuildError {
    /// No projection has that name.
    #[error("no projection named {0:?}")]
    Unknown(String),
    /// The projection is still backfilling; it is being built already.
    #[error("projection {0:?} is still backfilling")]
    Backfilling(String),
    /// An online rebuild of it is under way.
    #[error("projection {0:?} is already being rebuilt (generation {1})")]
    AlreadyRebuilding(String, u32),
    /// Opening the new generation failed.
    #[error("opening the new generation: {0}")]
    Store(String),
    /// The projection is not kept in generations of tables (the search index has its
    /// own tantivy directory): it is rebuilt offline only.
    #[error("projection {0:?} is rebuilt offline only (spindle replay rebuild {0})")]
    OfflineOnly(String),
}

/// Commits between two "backfilling" progress log lines.
const PROGRESS_EVERY_BATCHES: u64 = 64;

/// A batch that changed nothing in a projection (no row, no hook) leaves its stored
/// checkpoint where it was, until the checkpoint is this many records or
/// [`IDLE_CHECKPOINT_INTERVAL`] behind: most projections ignore most events, and a
/// commit per batch per projection was a store write each for nothing. A restart
/// replays those records again, and they change nothing again.
const IDLE_CHECKPOINT_RECORDS: u64 = 10_000;

/// See [`IDLE_CHECKPOINT_RECORDS`].
const IDLE_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(10);

/// How often a projection asleep through records it does not read
/// ([`Projection::interest`]) moves its checkpoint past them without reading them: at
/// its next wake-up it reads at most this long's records (from the journal's
/// in-memory tail under any load this machine sustains).
const IDLE_SKIP_INTERVAL: Duration = Duration::from_secs(1);

/// Runs every projection and answers "has everything applied position P yet".
#[derive(Clone)]
pub struct Runtime {
    slots: Arc<Vec<Slot>>,
    applied_tx: Arc<watch::Sender<u64>>,
    /// Bumped after every commit of any projection ([`Runtime::wait_for_projection`]).
    commits_tx: Arc<watch::Sender<u64>>,
    db: ProjectionDb,
    journal: Journal,
}

impl Runtime {
    /// The journal the projections tail.
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Starts one tailing thread per projection. Each resumes from its checkpoint.
    pub fn start(
        journal: Journal,
        db: ProjectionDb,
        projections: Vec<Arc<dyn Projection>>,
    ) -> Runtime {
        let head = journal.durable_head();
        let started = projections.iter().any(|p| db.checkpoint(p.name()) > 0);
        let slots: Vec<Slot> = projections
            .into_iter()
            .map(|p| {
                p.reload();
                let checkpoint = db.checkpoint(p.name());
                // New beside projections that already ran: backfill while serving.
                let backfilling = started && checkpoint == 0 && head > 0;
                if backfilling {
                    tracing::info!(
                        projection = p.name(),
                        head,
                        "new projection: backfilling from position 0 while serving"
                    );
                }
                Slot {
                    gates: p.gates_reads(),
                    interest: p.interest(),
                    checkpoint: AtomicU64::new(checkpoint),
                    stored: AtomicU64::new(checkpoint),
                    ready: std::sync::atomic::AtomicBool::new(!backfilling),
                    apply_lock: parking_lot::Mutex::new(()),
                    generation: std::sync::atomic::AtomicU32::new(db.generation(p.name())),
                    rebuild: parking_lot::Mutex::new(None),
                    batches: AtomicU64::new(0),
                    covered: AtomicU64::new(checkpoint),
                    hurry: parking_lot::Mutex::new(false),
                    hurried: parking_lot::Condvar::new(),
                    projection: p,
                }
            })
            .collect();
        let min = Self::min_ready(&slots, &journal.heads());
        let (tx, _) = watch::channel(min);
        let rt = Runtime {
            slots: Arc::new(slots),
            applied_tx: Arc::new(tx),
            commits_tx: Arc::new(watch::channel(0).0),
            db,
            journal: journal.clone(),
        };
        for i in 0..rt.slots.len() {
            let rt2 = rt.clone();
            let journal = journal.clone();
            let name = rt.slots[i].projection.name();
            std::thread::Builder::new()
                .name(format!("proj-{name}"))
                .spawn(move || rt2.tail(i, journal))
                .expect("spawn projection thread");
        }
        rt
    }

    /// The lowest position covered ([`Slot::covered`]) among ready projections that
    /// gate reads (0 if none).
    fn min_ready(slots: &[Slot], heads: &Heads) -> u64 {
        slots
            .iter()
            .filter(|s| s.gates && s.ready.load(Ordering::Acquire))
            .map(|s| s.covered(heads))
            .min()
            .unwrap_or(0)
    }

    fn tail(&self, i: usize, journal: Journal) {
        let slot = &self.slots[i];
        let mut batches = 0u64;
        // When the checkpoint was last written to the store (IDLE_CHECKPOINT_RECORDS).
        let mut stored_at = Instant::now();
        loop {
            let cp = slot.checkpoint.load(Ordering::Acquire);
            let heads = journal.heads();
            if heads.head > cp && heads.last_of(slot.interest) <= cp {
                // Nothing this projection reads after its checkpoint: move it to the
                // head without reading (so the records it sleeps through never pile up
                // for its next wake-up, nor for a replay after a crash).
                if !self.skip_to(slot, cp, heads.head, &mut stored_at) {
                    return;
                }
                continue;
            }
            let gather = slot.projection.gather_ms();
            let limit = if gather > 0 && !slot.gates {
                GATHER_BATCH
            } else {
                BATCH
            };
            if gather > 0 && !slot.gates && journal.durable_head().saturating_sub(cp) < limit as u64
            {
                // Let records gather (see `Projection::gather_ms`), unless there is no
                // record it reads yet: then wait for one below first.
                if heads.last_of(slot.interest) > cp {
                    slot.gather(gather);
                }
            }
            let records = match journal.read_after_shared(cp, limit) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(projection = slot.projection.name(), error = %e, "journal read failed");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            if records.is_empty() {
                // Records this projection does not read do not wake it (Heads::covered
                // accounts for them); it looks every IDLE_SKIP_INTERVAL to move its
                // checkpoint past them. Until its first checkpoint is stored it wakes for
                // every record: one left at 0 would read as new after a crash.
                let interest = if slot.stored.load(Ordering::Acquire) == 0 {
                    Interest::ALL
                } else {
                    slot.interest
                };
                if journal
                    .wait_for_records(cp, interest, IDLE_SKIP_INTERVAL)
                    .is_none()
                {
                    return;
                }
                continue;
            }
            let guard = slot.apply_lock.lock();
            if slot.checkpoint.load(Ordering::Acquire) != cp {
                // An online rebuild swapped in new tables meanwhile: read again from
                // its checkpoint.
                continue;
            }
            slot.batches.fetch_add(1, Ordering::Relaxed);
            let mut ctx = ApplyCtx::new();
            let mut last = cp;
            for rec in records.iter().filter(|r| slot.interest.reads(r.class())) {
                if let Err(e) = slot.projection.apply(&mut ctx, rec) {
                    // A record a projection cannot apply is a bug in the projection; the
                    // record is skipped (logged) so one bad record cannot stall reads.
                    tracing::error!(projection = slot.projection.name(), position = rec.position(), error = %e, "apply failed");
                }
            }
            if let Some(r) = records.last() {
                last = r.position();
            }
            if let Err(e) = slot.projection.prepare_commit(last) {
                tracing::error!(projection = slot.projection.name(), error = %e, "projection commit failed");
                // What apply changed in memory for the batch (compiled rules, sets
                // extended as records were applied) is rebuilt from the committed
                // tables before the batch is applied again.
                slot.projection.reload();
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
            // Never before the first stored checkpoint: a projection at 0 reads as new
            // (backfilling) on the next start.
            let stored = slot.stored.load(Ordering::Acquire);
            let idle = ctx.is_empty()
                && stored > 0
                && last.saturating_sub(stored) < IDLE_CHECKPOINT_RECORDS
                && stored_at.elapsed() < IDLE_CHECKPOINT_INTERVAL;
            if !idle {
                if let Err(e) = ctx.commit(&self.db, slot.projection.name(), last) {
                    tracing::error!(projection = slot.projection.name(), error = %e, "projection commit failed");
                    // As above: in-memory state from the failed batch goes.
                    slot.projection.reload();
                    drop(guard);
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
                slot.stored.store(last, Ordering::Release);
                stored_at = Instant::now();
            }
            slot.projection.committed(last);
            slot.checkpoint.store(last, Ordering::Release);
            drop(guard);
            self.commits_tx.send_modify(|n| *n += 1);
            if !slot.ready.load(Ordering::Acquire) {
                batches += 1;
                let heads = journal.heads();
                let head = heads.head;
                // At the head, the projection is at least where every ready one is
                // (applied <= head), so joining cannot move `applied` backwards.
                if slot.covered(&heads) >= head {
                    slot.ready.store(true, Ordering::Release);
                    tracing::info!(
                        projection = slot.projection.name(),
                        checkpoint = last,
                        "backfill done; the projection is ready"
                    );
                } else if batches.is_multiple_of(PROGRESS_EVERY_BATCHES) {
                    tracing::info!(
                        projection = slot.projection.name(),
                        checkpoint = last,
                        head,
                        "backfilling"
                    );
                }
            }
            self.publish_applied();
        }
    }

    /// Moves a projection with nothing to read in `(cp, head]` to `head` without reading
    /// (under its apply lock; nothing if the checkpoint moved meanwhile), storing the
    /// checkpoint by the rules of a batch that changed nothing
    /// ([`IDLE_CHECKPOINT_RECORDS`]). Then waits for a record it reads, at most
    /// [`IDLE_SKIP_INTERVAL`]; `false` once the journal has stopped.
    fn skip_to(&self, slot: &Slot, cp: u64, head: u64, stored_at: &mut Instant) -> bool {
        {
            let _guard = slot.apply_lock.lock();
            if slot.checkpoint.load(Ordering::Acquire) == cp {
                let stored = slot.stored.load(Ordering::Acquire);
                let idle = stored > 0
                    && head.saturating_sub(stored) < IDLE_CHECKPOINT_RECORDS
                    && stored_at.elapsed() < IDLE_CHECKPOINT_INTERVAL;
                if !idle {
                    match ApplyCtx::new().commit(&self.db, slot.projection.name(), head) {
                        Ok(()) => {
                            slot.stored.store(head, Ordering::Release);
                            *stored_at = Instant::now();
                        }
                        Err(e) => {
                            tracing::warn!(projection = slot.projection.name(), error = %e, "checkpoint not stored");
                        }
                    }
                }
                slot.checkpoint.store(head, Ordering::Release);
                if !slot.ready.load(Ordering::Acquire) {
                    // At the head: see the backfill's end in `tail`.
                    slot.ready.store(true, Ordering::Release);
                    tracing::info!(
                        projection = slot.projection.name(),
                        checkpoint = head,
                        "backfill done; the projection is ready"
                    );
                }
            }
        }
        self.publish_applied();
        self.journal
            .wait_for_records(head, slot.interest, IDLE_SKIP_INTERVAL)
            .is_some()
    }

    /// Raises [`Runtime::applied`] to the lowest ready checkpoint (never lowers it).
    fn publish_applied(&self) {
        let min = Self::min_ready(&self.slots, &self.journal.heads());
        self.applied_tx.send_if_modified(|v| {
            if min > *v {
                *v = min;
                true
            } else {
                false
            }
        });
    }

    /// Starts rebuilding `name` online (see the module doc) into `shadow`: a fresh
    /// instance of the same projection opened with
    /// [`ProjectionDb::for_generation`]`(name, generation)`, where `generation` is the
    /// live one plus 1 ([`Runtime::next_generation`]). Returns at once; progress is in
    /// [`Runtime::status`] and the log. Refuses an unknown name, a backfilling
    /// projection and a second rebuild of the same one.
    pub fn rebuild_online(
        &self,
        name: &str,
        shadow: Arc<dyn Projection>,
        generation: u32,
    ) -> Result<(), RebuildError> {
        let i = self
            .slots
            .iter()
            .position(|s| s.projection.name() == name)
            .ok_or_else(|| RebuildError::Unknown(name.to_owned()))?;
        let slot = &self.slots[i];
        if !slot.ready.load(Ordering::Acquire) {
            return Err(RebuildError::Backfilling(name.to_owned()));
        }
        {
            let mut rebuild = slot.rebuild.lock();
            if let Some(r) = *rebuild {
                return Err(RebuildError::AlreadyRebuilding(
                    name.to_owned(),
                    r.generation,
                ));
            }
            *rebuild = Some(RebuildProgress {
                generation,
                checkpoint: 0,
            });
        }
        tracing::info!(
            projection = name,
            generation,
            head = self.journal.durable_head(),
            "online rebuild: replaying from position 0 beside the live tables"
        );
        let rt = self.clone();
        std::thread::Builder::new()
            .name(format!("rebuild-{name}"))
            .spawn(move || {
                if let Err(e) = rt.run_rebuild(i, shadow, generation) {
                    tracing::error!(projection = rt.slots[i].projection.name(), generation, error = %e, "online rebuild failed; the live tables keep serving");
                }
                *rt.slots[i].rebuild.lock() = None;
            })
            .map_err(|e| RebuildError::Store(e.to_string()))?;
        Ok(())
    }

    /// The generation a new online rebuild of `name` builds (0 for unknown names).
    pub fn next_generation(&self, name: &str) -> u32 {
        self.slots
            .iter()
            .find(|s| s.projection.name() == name)
            .map(|s| s.generation.load(Ordering::Acquire) + 1)
            .unwrap_or(0)
    }

    /// Applies one batch after `cp` into the rebuild; returns the new checkpoint.
    fn rebuild_batch(&self, shadow: &dyn Projection, key: &str, cp: u64) -> Result<u64, String> {
        let records = self
            .journal
            .read_after(cp, BATCH)
            .map_err(|e| e.to_string())?;
        let Some(last) = records.last().map(|r| r.position()) else {
            return Ok(cp);
        };
        let mut ctx = ApplyCtx::new();
        let interest = shadow.interest();
        for rec in records.iter().filter(|r| interest.reads(r.class())) {
            if let Err(e) = shadow.apply(&mut ctx, rec) {
                tracing::error!(projection = shadow.name(), position = rec.position(), error = %e, "apply failed");
            }
        }
        ctx.commit(&self.db, key, last)?;
        Ok(last)
    }

    fn run_rebuild(
        &self,
        i: usize,
        shadow: Arc<dyn Projection>,
        generation: u32,
    ) -> Result<(), String> {
        let slot = &self.slots[i];
        let name = slot.projection.name();
        let key = crate::store::rebuild_checkpoint_key(name, generation);
        let progress = |cp: u64| {
            if let Some(r) = slot.rebuild.lock().as_mut() {
                r.checkpoint = cp;
            }
        };
        // Catch up with the live instance without holding it up.
        let mut cp = 0u64;
        let mut batches = 0u64;
        while cp < slot.checkpoint.load(Ordering::Acquire) {
            cp = self.rebuild_batch(&*shadow, &key, cp)?;
            progress(cp);
            batches += 1;
            if batches.is_multiple_of(PROGRESS_EVERY_BATCHES) {
                tracing::info!(
                    projection = name,
                    generation,
                    checkpoint = cp,
                    head = self.journal.durable_head(),
                    "online rebuild"
                );
            }
        }
        // The swap: the live tables stand still while the last records are applied.
        let guard = slot.apply_lock.lock();
        while cp < slot.checkpoint.load(Ordering::Acquire) {
            cp = self.rebuild_batch(&*shadow, &key, cp)?;
        }
        progress(cp);
        let live_tables = slot.projection.tables();
        let new_tables = shadow.tables();
        let mut pairs = Vec::with_capacity(live_tables.len());
        for t in &live_tables {
            let n = new_tables
                .iter()
                .find(|n| n.name() == t.name())
                .ok_or_else(|| format!("the new generation has no table {}", t.name()))?;
            pairs.push((t, n));
        }
        self.db.commit_generation(name, generation, cp)?;
        let old: Vec<_> = pairs.into_iter().map(|(t, n)| t.swap_keyspace(n)).collect();
        slot.generation.store(generation, Ordering::Release);
        slot.checkpoint.store(cp, Ordering::Release);
        slot.stored.store(cp, Ordering::Release);
        slot.projection.reload();
        drop(guard);
        drop(shadow);
        self.publish_applied();
        self.db.delete_keyspaces(old)?;
        tracing::info!(
            projection = name,
            generation,
            checkpoint = cp,
            "online rebuild done; the new generation is live and the old one deleted"
        );
        Ok(())
    }

    /// The highest position every ready projection that gates reads has applied
    /// (see [`Projection::gates_reads`]).
    pub fn applied(&self) -> u64 {
        *self.applied_tx.borrow()
    }

    /// Holds projection `name` still: its tail thread applies nothing more until the
    /// returned guard is dropped (it waits for the lock it holds around apply and
    /// commit). For tests that show what does, and what does not, wait for a
    /// projection; `None` for an unknown name.
    pub fn hold(&self, name: &str) -> Option<ProjectionHold<'_>> {
        self.slots
            .iter()
            .find(|s| s.projection.name() == name)
            .map(|s| ProjectionHold {
                _guard: s.apply_lock.lock(),
            })
    }

    /// Writes every projection's checkpoint that batches which changed nothing left
    /// ahead of the stored one ([`IDLE_CHECKPOINT_RECORDS`]), so the next start does
    /// not apply those records again. The server calls it when it stops; safe at any
    /// time (each projection's apply lock is held while its row is written).
    pub fn store_checkpoints(&self) {
        for slot in self.slots.iter() {
            let _guard = slot.apply_lock.lock();
            // Records it does not read after its checkpoint are applied in effect.
            let cp = slot.covered(&self.journal.heads());
            if cp <= slot.stored.load(Ordering::Acquire) {
                continue;
            }
            match ApplyCtx::new().commit(&self.db, slot.projection.name(), cp) {
                Ok(()) => {
                    slot.stored.store(cp, Ordering::Release);
                    slot.checkpoint.fetch_max(cp, Ordering::AcqRel);
                }
                Err(e) => {
                    tracing::warn!(projection = slot.projection.name(), error = %e, "checkpoint not stored")
                }
            }
        }
    }

    /// The position projection `name` has applied in effect: its checkpoint, or the
    /// durable head when no record it reads ([`Projection::interest`]) is after it
    /// (`None` for an unknown name).
    pub fn checkpoint(&self, name: &str) -> Option<u64> {
        let heads = self.journal.heads();
        self.slots
            .iter()
            .find(|s| s.projection.name() == name)
            .map(|s| s.covered(&heads))
    }

    /// A watch on [`Runtime::applied`] (long-poll `/sync` wakes on it).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.applied_tx.subscribe()
    }

    /// Waits until every projection has applied `position`, at most `timeout`.
    /// Returns whether it got there.
    pub async fn wait_for(&self, position: u64, timeout: Duration) -> bool {
        let mut rx = self.applied_tx.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|p| *p >= position))
            .await
            .map(|r| r.is_ok())
            .unwrap_or(false)
    }

    /// Waits until the projection `name` has applied `position`, at most `timeout`
    /// (readers of a projection that does not gate reads, and requests that read one
    /// projection only, such as a message send's token check). Returns whether it got
    /// there; an unknown name never does.
    pub async fn wait_for_projection(&self, name: &str, position: u64, timeout: Duration) -> bool {
        let Some(slot) = self.slots.iter().find(|s| s.projection.name() == name) else {
            return false;
        };
        let mut rx = self.commits_tx.subscribe();
        // A record it does not read moves no checkpoint and bumps no commit: it is
        // covered as soon as it is durable (the heads are read again on each check).
        let reached = || slot.covered(&self.journal.heads()) >= position;
        if reached() {
            return true;
        }
        // A reader is waiting: a projection that lets records gather applies them now.
        slot.hurry();
        let wait = async {
            loop {
                if reached() {
                    return true;
                }
                if rx.changed().await.is_err() {
                    return reached();
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    /// Waits until every projection, backfilling ones included, has applied
    /// `position`, at most `timeout` (offline tools: rebuilds, verify). Polls.
    pub async fn wait_for_all(&self, position: u64, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let heads = self.journal.heads();
            if self.slots.iter().all(|s| s.covered(&heads) >= position) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether `name` is ready (not backfilling; see the module doc). Unknown names: `false`.
    pub fn is_ready(&self, name: &str) -> bool {
        self.slots
            .iter()
            .any(|s| s.projection.name() == name && s.ready.load(Ordering::Acquire))
    }

    /// Whether `name` gates reads and tokens ([`Projection::gates_reads`]). Unknown
    /// names: `false`.
    pub fn gates_reads(&self, name: &str) -> bool {
        self.slots
            .iter()
            .any(|s| s.projection.name() == name && s.gates)
    }

    /// How many batches of records projection `name`'s thread has read and applied
    /// since the start: each is a wake-up of its thread (`None` for an unknown name).
    /// For counting tests: a record a projection does not read
    /// ([`Projection::interest`]) adds none.
    pub fn batches(&self, name: &str) -> Option<u64> {
        self.slots
            .iter()
            .find(|s| s.projection.name() == name)
            .map(|s| s.batches.load(Ordering::Relaxed))
    }

    /// Every projection's checkpoint and readiness, in registration order.
    pub fn status(&self) -> Vec<ProjectionStatus> {
        let heads = self.journal.heads();
        self.slots
            .iter()
            .map(|s| ProjectionStatus {
                name: s.projection.name(),
                checkpoint: s.covered(&heads),
                ready: s.ready.load(Ordering::Acquire),
                generation: s.generation.load(Ordering::Acquire),
                rebuilding: *s.rebuild.lock(),
            })
            .collect()
    }

    /// Checkpoint of each projection, by name.
    pub fn checkpoints(&self) -> Vec<(&'static str, u64)> {
        let heads = self.journal.heads();
        self.slots
            .iter()
            .map(|s| (s.projection.name(), s.covered(&heads)))
            .collect()
    }

    /// Every registered projection's [`Projection::render`], by name, in registration order.
    pub fn renders(&self) -> Vec<(&'static str, String)> {
        self.slots
            .iter()
            .map(|s| (s.projection.name(), s.projection.render()))
            .collect()
    }

    /// blake3 digest of every table of every projection, by name (BRIEF §3.2: a
    /// rebuild from position 0 must reproduce these exactly).
    pub fn digests(&self) -> Vec<(&'static str, String)> {
        self.slots
            .iter()
            .map(|s| (s.projection.name(), digest(&*s.projection)))
            .collect()
    }
}

/// Digest of one projection's tables: table names and every (key, value), length-prefixed,
/// then its [`Projection::outside_rows`] (if any) the same way.
pub fn digest(p: &dyn Projection) -> String {
    fn rows(h: &mut blake3::Hasher, rows: impl IntoIterator<Item = (Vec<u8>, Vec<u8>)>) {
        for (k, v) in rows {
            h.update(&(k.len() as u64).to_le_bytes());
            h.update(&k);
            h.update(&(v.len() as u64).to_le_bytes());
            h.update(&v);
        }
    }
    let mut h = blake3::Hasher::new();
    let mut tables = p.tables();
    tables.sort_by(|a, b| a.name().cmp(b.name()));
    for t in tables {
        h.update(t.name().as_bytes());
        h.update(&[0]);
        rows(&mut h, t.all());
    }
    let outside = p.outside_rows();
    if !outside.is_empty() {
        h.update(b"(outside)\0");
        rows(&mut h, outside);
    }
    h.finalize().to_hex().to_string()
}

/// Where one table of a projection differs between two copies (`replay verify`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableDiff {
    /// The table (`<projection>.<table>`).
    pub table: String,
    /// Keys only in the first (live) copy.
    pub only_live: u64,
    /// Keys only in the second (rebuilt) copy.
    pub only_rebuilt: u64,
    /// Keys in both with different values.
    pub changed: u64,
    /// The smallest differing key.
    pub first_key: Vec<u8>,
    /// The largest differing key.
    pub last_key: Vec<u8>,
}

impl Runtime {
    /// The tables of projection `name` (empty for unknown names).
    pub fn tables(&self, name: &str) -> Vec<Table> {
        self.slots
            .iter()
            .find(|s| s.projection.name() == name)
            .map(|s| s.projection.tables())
            .unwrap_or_default()
    }

    /// Projection `name`'s [`Projection::outside_rows`] (empty for unknown names).
    pub fn outside_rows(&self, name: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.slots
            .iter()
            .find(|s| s.projection.name() == name)
            .map(|s| s.projection.outside_rows())
            .unwrap_or_default()
    }
}

/// Compares two copies of a projection's tables (paired by name) row by row, in key
/// order, and reports each table that differs with its differing key range. Reads
/// every row of both copies: an offline diagnostic, run only when digests differ.
pub fn diff_tables(live: &[Table], rebuilt: &[Table]) -> Vec<TableDiff> {
    let mut names: Vec<&str> = live.iter().chain(rebuilt).map(|t| t.name()).collect();
    names.sort_unstable();
    names.dedup();
    let mut out = Vec::new();
    for name in names {
        let rows = |ts: &[Table]| -> Vec<(Vec<u8>, Vec<u8>)> {
            ts.iter()
                .find(|t| t.name() == name)
                .map(|t| t.all().collect())
                .unwrap_or_default()
        };
        out.extend(diff_rows(name, &rows(live), &rows(rebuilt)));
    }
    out
}

/// Compares two copies of one projection's [`Projection::outside_rows`] the same way,
/// reported as the table `<projection>.(outside)` (the search index's event list).
pub fn diff_outside(
    projection: &str,
    live: &[(Vec<u8>, Vec<u8>)],
    rebuilt: &[(Vec<u8>, Vec<u8>)],
) -> Option<TableDiff> {
    diff_rows(&format!("{projection}.(outside)"), live, rebuilt)
}

/// Two copies of one table's rows, each in key order: what differs, if anything.
fn diff_rows(name: &str, a: &[(Vec<u8>, Vec<u8>)], b: &[(Vec<u8>, Vec<u8>)]) -> Option<TableDiff> {
    let mut d = TableDiff {
        table: name.to_owned(),
        only_live: 0,
        only_rebuilt: 0,
        changed: 0,
        first_key: Vec::new(),
        last_key: Vec::new(),
    };
    let note = |d: &mut TableDiff, k: &[u8]| {
        if d.only_live + d.only_rebuilt + d.changed == 1 {
            d.first_key = k.to_vec();
        }
        d.last_key = k.to_vec();
    };
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some((ka, va)), Some((kb, vb))) if ka == kb => {
                if va != vb {
                    d.changed += 1;
                    note(&mut d, ka);
                }
                i += 1;
                j += 1;
            }
            (Some((ka, _)), Some((kb, _))) if ka < kb => {
                d.only_live += 1;
                note(&mut d, ka);
                i += 1;
            }
            (Some((ka, _)), None) => {
                d.only_live += 1;
                note(&mut d, ka);
                i += 1;
            }
            (_, Some((kb, _))) => {
                d.only_rebuilt += 1;
                note(&mut d, kb);
                j += 1;
            }
            (None, None) => unreachable!("loop condition"),
        }
    }
    (d.only_live + d.only_rebuilt + d.changed > 0).then_some(d)
}

/// A key for people: printable ASCII as is, the 0x00 separator as `|`, 8-byte
/// big-endian positions after a separator as `#<n>`, any other byte as `\xNN`.
pub fn render_key(key: &[u8]) -> String {
    let mut s = String::new();
    let mut i = 0;
    while i < key.len() {
        let b = key[i];
        if b == 0 && key.len() - (i + 1) == 8 && key[i + 1..].iter().any(|&x| x < 0x20) {
            let pos = u64::from_be_bytes(key[i + 1..].try_into().expect("8 bytes"));
            s.push_str(&format!("|#{pos}"));
            break;
        }
        match b {
            0 => s.push('|'),
            0x20..=0x7e => s.push(b as char),
            _ => s.push_str(&format!("\\x{b:02x}")),
        }
        i += 1;
    }
    s
}

#[cfg(test)]
mod diff_tests {
    use super::*;

    fn row(k: &str, v: &str) -> (Vec<u8>, Vec<u8>) {
        (k.as_bytes().to_vec(), v.as_bytes().to_vec())
    }

    #[test]
    fn outside_rows_are_diffed_like_a_table() {
        let live = vec![row("$a", "r1"), row("$b", "r1"), row("$d", "r1")];
        let rebuilt = vec![row("$a", "r1"), row("$b", "r2"), row("$c", "r1")];
        assert_eq!(
            diff_outside("search", &live, &rebuilt),
            Some(TableDiff {
                table: "search.(outside)".into(),
                only_live: 1,
                only_rebuilt: 1,
                changed: 1,
                first_key: b"$b".to_vec(),
                last_key: b"$d".to_vec(),
            })
        );
        assert_eq!(diff_outside("search", &live, &live), None);
    }
}
