//! State projection: the content-addressed state trie after every event, each room's
//! current state root, and room metadata.
//!
//! Tables (layout [`LAYOUT`]):
//! - `nodes`: trie node hash -> encoded node (shared by every room and every version)
//! - `event_roots`: state event id -> state root before ++ after ++ non-member root
//!   before ++ non-member root after (4 × 32 bytes), for every event with a state key
//!   this server applied, outliers included; a resolved-state record writes none (the
//!   event keeps the roots of its own place in the log)
//! - `changes`: room id, 0x00, position BE u64 -> state root after ++ non-member root
//!   after (2 × 32 bytes), for every record that changed the room's roots (a state
//!   event, an outlier, resolved state). A message changes nothing, so it writes
//!   nothing here: its roots are those of the last change at or before its position
//!   ([`State::roots_of`], one short reverse scan). Issue 18 item 5: one row per
//!   message cost 94 bytes an event on disk and filled the table's memtable with
//!   keys every read of a state event searched through.
//! - `current`: room id -> current state root
//! - `current_others`: room id -> current root of the state without `m.room.member`
//!
//! The second trie ("others": every state entry except member events) lets a
//! lazy-loading sync list a room's state without walking its members: a room with
//! 10,000 members costs the same as one with 10 (BRIEF §4, lazy members).
//! - `rooms`: room id -> [`RoomMeta`] JSON
//! - `partial`: room id -> `p` while the room's state here is partial (a partial-state
//!   join, MSC3902; [`spindle_journal::Fact::RoomStatePartial`]), then the position BE
//!   u64 of the [`spindle_journal::Fact::RoomStateCompleted`] record
//!
//! Point lookups read one path of the trie (depth + 1 node reads); nothing here
//! materializes a whole room's state unless asked for all of it.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use serde::{Deserialize, Serialize};
use spindle_core::trie::{self, NodeHash, NodeStore, Root};
use spindle_journal::{Interest, StoredRecord};

use crate::{
    change_index::ChangeIndex,
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
    timeline::EventRecord,
};

/// The state roots recorded for one event: the full state and the non-member state,
/// before and after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRoots {
    /// Full state before the event.
    pub before: Root,
    /// Full state after the event.
    pub after: Root,
    /// State without `m.room.member` before the event.
    pub others_before: Root,
    /// State without `m.room.member` after the event.
    pub others_after: Root,
}

/// The version of this projection's row shapes ([`ProjectionDb::ensure_layout`]):
/// 2 since `event_roots` holds state events only and `changes` the room's roots by
/// position (tables written in layout 1 are rebuilt from the journal).
pub const LAYOUT: u32 = 2;

/// Per-room facts fixed at creation.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RoomMeta {
    /// Room version.
    pub room_version: String,
    /// The create event's id.
    pub create_event_id: String,
    /// The create event's sender.
    pub creator: String,
}

/// Default bytes of trie nodes kept in memory ([`NodeCache`], `[caches]
/// state_node_bytes`).
pub const NODE_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// Trie nodes read from the `nodes` table, checked against their hash, kept by hash.
///
/// Nodes are content-addressed: the bytes under a hash never change, so a hit is
/// always right and nothing is ever invalidated (not even by an online rebuild, whose
/// tables hold the same nodes under the same hashes). Every state read walks a path
/// from the root (sliding sync asks some ten keys in each of its rooms, a send checks
/// power levels, create and member events), and the nodes near the roots of active
/// rooms are the same each time: kept here they cost a hash-map lookup instead of a
/// store read and a blake3 check. Bounded in bytes (each node counted as its length
/// plus [`NodeCache::OVERHEAD`]); full, the oldest admitted are dropped first.
pub struct NodeCache {
    inner: parking_lot::RwLock<NodeCacheInner>,
    budget: usize,
    /// Reads answered from memory.
    pub hits: AtomicU64,
    /// Reads that went to the store.
    pub misses: AtomicU64,
}

#[derive(Default)]
struct NodeCacheInner {
    map: HashMap<NodeHash, Arc<[u8]>>,
    order: VecDeque<NodeHash>,
    bytes: usize,
}

impl NodeCache {
    /// Bytes counted per node beside its encoding: the key, the map's slot with its
    /// spare capacity, the queue's slot and the shared bytes' header (an estimate).
    pub const OVERHEAD: usize = 128;

    /// A cache of at most about `budget` bytes (0: none; every read goes to the store).
    pub fn new(budget: usize) -> NodeCache {
        NodeCache {
            inner: Default::default(),
            budget,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Bytes held now (as counted against the budget).
    pub fn bytes(&self) -> usize {
        self.inner.read().bytes
    }

    /// The budget in bytes.
    pub fn budget(&self) -> usize {
        self.budget
    }

    fn get(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        if self.budget == 0 {
            return None;
        }
        let hit = self.inner.read().map.get(hash).cloned();
        let counter = if hit.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Admits a node read from the store if its bytes match its hash (`false`: they
    /// do not, and it is not kept).
    fn admit(&self, hash: NodeHash, bytes: &Arc<[u8]>) -> bool {
        if blake3::hash(bytes).as_bytes() != &hash {
            return false;
        }
        let cost = bytes.len() + Self::OVERHEAD;
        if self.budget == 0 || cost > self.budget {
            return true;
        }
        let mut inner = self.inner.write();
        if inner.map.insert(hash, bytes.clone()).is_some() {
            return true;
        }
        inner.order.push_back(hash);
        inner.bytes += cost;
        while inner.bytes > self.budget {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some(b) = inner.map.remove(&old) {
                inner.bytes -= b.len() + Self::OVERHEAD;
            }
        }
        true
    }
}

/// The committed `nodes` table behind the [`NodeCache`]: what readers walk.
struct TableNodes<'a> {
    table: &'a Table,
    cache: &'a NodeCache,
}

impl NodeStore for TableNodes<'_> {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        if let Some(hit) = self.cache.get(hash) {
            return Some(hit);
        }
        let bytes: Arc<[u8]> = Arc::from(self.table.get(hash)?);
        // Bytes that do not match their hash are neither kept nor handed out (the
        // trie, told they are checked, would not look): the walk fails on a missing
        // node instead.
        self.cache.admit(*hash, &bytes).then_some(bytes)
    }
    fn put_node(&self, _hash: NodeHash, _bytes: Vec<u8>) {
        debug_assert!(false, "query-side node store is read-only");
    }
    fn verified(&self) -> bool {
        true
    }
}

/// The nodes as a batch sees them (its staged nodes, then the table), after the
/// queries' [`NodeCache`] (content-addressed: a node there is the node, staged or not).
struct CtxNodes<'a> {
    ctx: &'a ApplyCtx,
    table: &'a Table,
    cache: &'a NodeCache,
}

impl NodeStore for CtxNodes<'_> {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        if let Some(hit) = self.cache.get(hash) {
            return Some(hit);
        }
        self.ctx.get(self.table, hash).map(Arc::from)
    }
    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        self.ctx.put(self.table, hash.to_vec(), bytes);
    }
}

/// The state projection.
pub struct State {
    nodes: Table,
    event_roots: Table,
    changes: Table,
    current: Table,
    current_others: Table,
    rooms: Table,
    partial: Table,
    /// Trie nodes read by queries, by hash.
    node_cache: Arc<NodeCache>,
    /// Floor lookups of `changes` answered before ([`State::roots_at_position`]).
    floors: parking_lot::Mutex<HashMap<String, Floor>>,
    /// The checkpoint of the last committed batch ([`Projection::committed`]; at open,
    /// the stored one): every change at or below it is visible to readers.
    applied: AtomicU64,
    /// The journal whose heads tell how far the projection stands in effect
    /// ([`State::applied_in_effect`]): it is not woken by messages, so its checkpoint
    /// stays at the last state record while messages pass it.
    journal: Option<spindle_journal::Journal>,
    /// The highest position found applied in effect: never goes back (a fact or
    /// state record arriving after it does not make the positions before it pending
    /// again, though the heads alone then answer the checkpoint).
    in_effect: AtomicU64,
    /// Where [`Projection::reload`] reads the checkpoint again (an online rebuild's
    /// swap moves it without a batch of this instance).
    db: ProjectionDb,
    /// Bumped by [`Projection::reload`] (new tables): a floor found before it is not
    /// remembered after it.
    floors_epoch: AtomicU64,
    /// The `partial` table in memory (rooms ever joined with partial state are few):
    /// room id -> `None` while partial, `Some(position)` once complete. `/sync` asks
    /// for every joined room, so this is never a store read.
    partial_rooms: PartialRooms,
}

/// What the state projection reads ([`Projection::interest`]).
const STATE_INTEREST: Interest = Interest::FACTS.and(Interest::STATE_EVENTS);

/// Most rooms [`State::roots_at_position`] remembers a floor for (emptied when full).
pub const FLOOR_MEMO_ROOMS: usize = 4096;

/// A floor lookup's answer: the room's last change at or before `through` was at
/// `change`, leaving `roots`; so every position in `change..=through` has them.
#[derive(Clone, Copy)]
struct Floor {
    change: u64,
    through: u64,
    roots: (Root, Root),
}

/// See [`State::partial_rooms`] (shared with the commit hook that flips a room).
type PartialRooms = std::sync::Arc<parking_lot::RwLock<PartialRoomsInner>>;

/// Rooms ever joined with partial state: room id -> `None` while partial,
/// `Some(position)` once complete; and the completed ones by completion position, so
/// `/sync` finds the rooms completed since its token without asking each joined room.
#[derive(Default)]
struct PartialRoomsInner {
    rooms: std::collections::HashMap<String, Option<u64>>,
    completed: ChangeIndex,
}

impl PartialRoomsInner {
    fn set(&mut self, room: String, completed: Option<u64>) {
        if let Some(position) = completed {
            self.completed.bump(&room, position);
        }
        self.rooms.insert(room, completed);
    }
}

fn root_from(bytes: &[u8]) -> Option<Root> {
    Root::from_bytes(bytes)
}

impl State {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<State, String> {
        Self::open_with(db, NODE_CACHE_BYTES)
    }

    /// [`State::open`] with a node cache of `node_cache_bytes` ([`NodeCache`]; 0: none).
    pub fn open_with(db: &ProjectionDb, node_cache_bytes: usize) -> Result<State, String> {
        Ok(State {
            nodes: db.table("state", "nodes")?,
            event_roots: db.table("state", "event_roots")?,
            changes: db.table("state", "changes")?,
            current: db.table("state", "current")?,
            current_others: db.table("state", "current_others")?,
            rooms: db.table("state", "rooms")?,
            partial: db.table("state", "partial")?,
            node_cache: Arc::new(NodeCache::new(node_cache_bytes)),
            floors: Default::default(),
            applied: AtomicU64::new(db.checkpoint("state")),
            journal: None,
            in_effect: AtomicU64::new(0),
            db: db.clone(),
            floors_epoch: AtomicU64::new(0),
            partial_rooms: Default::default(),
        })
    }

    /// Reads positions against `journal`'s heads ([`State::applied_in_effect`]); without
    /// one (tests, tools that apply by hand) a position counts as applied only once the
    /// projection applied it itself.
    pub fn with_journal(mut self, journal: spindle_journal::Journal) -> State {
        self.journal = Some(journal);
        self
    }

    /// Every position at or below this is applied in effect: the checkpoint, or the
    /// journal's durable head when no record the projection reads (facts, state
    /// events: [`Projection::interest`]) is after its checkpoint ([`Heads::covered`]),
    /// and never less than it answered before (a position once covered stays so: the
    /// records of its classes at or below it were all applied). The checkpoint is read
    /// first, so a state record arriving meanwhile leaves the answer at the checkpoint.
    ///
    /// [`Heads::covered`]: spindle_journal::Heads::covered
    pub fn applied_in_effect(&self) -> u64 {
        let applied = self.applied.load(Ordering::Acquire);
        let now = match &self.journal {
            Some(j) => j.heads().covered(STATE_INTEREST, applied),
            None => applied,
        };
        self.in_effect.fetch_max(now, Ordering::AcqRel).max(now)
    }

    /// Whether `position` is applied in effect ([`State::applied_in_effect`]); the
    /// heads are asked only when the remembered answer is below it.
    fn is_applied(&self, position: u64) -> bool {
        position <= self.in_effect.load(Ordering::Acquire)
            || position <= self.applied.load(Ordering::Acquire)
            || position <= self.applied_in_effect()
    }

    /// The trie nodes as queries read them: the cache, then the table.
    fn reader(&self) -> TableNodes<'_> {
        TableNodes {
            table: &self.nodes,
            cache: &self.node_cache,
        }
    }

    /// The node cache (its counters and size).
    pub fn node_cache(&self) -> &NodeCache {
        &self.node_cache
    }

    /// Whether the room's state here is partial (MSC3902): joined with the members
    /// left out, the full state not imported yet.
    pub fn is_partial(&self, room_id: &str) -> bool {
        self.partial_rooms
            .read()
            .rooms
            .get(room_id)
            .is_some_and(|c| c.is_none())
    }

    /// The position at which a partial-state room's full state was imported, if it was
    /// ever partial and is complete now.
    pub fn completed_at(&self, room_id: &str) -> Option<u64> {
        *self.partial_rooms.read().rooms.get(room_id)?
    }

    /// Partial-state rooms whose full state was imported after `after`, at most
    /// `limit` (memory; `None`: more were, ask [`State::completed_at`] room by room).
    pub fn completed_after(&self, after: u64, limit: usize) -> Option<Vec<Arc<str>>> {
        self.partial_rooms
            .read()
            .completed
            .changed_after(after, limit)
    }

    /// The room's metadata, if the room exists.
    pub fn room(&self, room_id: &str) -> Option<RoomMeta> {
        serde_json::from_slice(&self.rooms.get(room_id.as_bytes())?).ok()
    }

    /// Every room, ordered by room id (the server-admin room list; cost grows with the
    /// number of rooms, which that list reports in full as `total_rooms`).
    pub fn rooms(&self) -> Vec<(String, RoomMeta)> {
        self.rooms
            .scan_prefix(&[], usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k).into_owned(),
                    serde_json::from_slice(&v).ok()?,
                ))
            })
            .collect()
    }

    /// The room's current state root.
    pub fn current_root(&self, room_id: &str) -> Option<Root> {
        root_from(&self.current.get(room_id.as_bytes())?)
    }

    /// The room's current root of the state without `m.room.member`.
    pub fn current_others_root(&self, room_id: &str) -> Option<Root> {
        root_from(&self.current_others.get(room_id.as_bytes())?)
    }

    /// Every state root recorded for an event with a state key, by id (one point
    /// read).
    /// `None` for an event without a state key: ask [`State::roots_of`], which knows
    /// where such an event sits.
    pub fn state_event_roots(&self, event_id: &str) -> Option<EventRoots> {
        let v = self.event_roots.get(event_id.as_bytes())?;
        if v.len() != 128 {
            return None;
        }
        Some(EventRoots {
            before: root_from(&v[..32])?,
            after: root_from(&v[32..64])?,
            others_before: root_from(&v[64..96])?,
            others_after: root_from(&v[96..])?,
        })
    }

    /// The room's roots (full, non-member) after every record at or before
    /// `position`: the last change at or before it (one reverse scan of at most one
    /// row). `None` before the room's first state here.
    ///
    /// The answer is remembered per room ([`FLOOR_MEMO_ROOMS`]) when `position` is
    /// applied here: no change can appear at or below an applied position later, so
    /// a position between the change found and `position` has the same roots without
    /// a scan (a page of messages read back through history asks one position after
    /// another, each event once for visibility and once for `unsigned.membership`).
    pub fn roots_at_position(&self, room_id: &str, position: u64) -> Option<(Root, Root)> {
        if let Some(f) = self.floors.lock().get(room_id)
            && (f.change..=f.through).contains(&position)
        {
            return Some(f.roots);
        }
        // Asked before the scan: when `position` is applied (in effect), every change at
        // or below it is visible to the scan, so what it finds cannot be overtaken by a
        // later commit.
        let (applied, epoch) = (
            self.is_applied(position),
            self.floors_epoch.load(Ordering::Acquire),
        );
        let start = key::prefix(&[room_id]);
        let end = key::with_pos(&[room_id], position.saturating_add(1));
        let (k, v) = self
            .changes
            .scan_range(&start, &end, true, 1)
            .into_iter()
            .next()?;
        if v.len() != 64 {
            return None;
        }
        let roots = (root_from(&v[..32])?, root_from(&v[32..])?);
        if applied {
            let mut floors = self.floors.lock();
            if self.floors_epoch.load(Ordering::Acquire) != epoch {
                return Some(roots);
            }
            if floors.len() >= FLOOR_MEMO_ROOMS {
                floors.clear();
            }
            let floor = Floor {
                change: key::trailing_pos(&k),
                through: position,
                roots,
            };
            floors.insert(room_id.to_owned(), floor);
        }
        Some(roots)
    }

    /// The state roots at a timeline event: a state event's own (before and after
    /// it, [`State::state_event_roots`]); for any other event the room's roots at its
    /// position, which it did not change (before = after). `None` for history
    /// backfilled from another server (no state is held at it), for an event this
    /// projection has not applied yet, and for an event with no state before it.
    pub fn roots_of(&self, ev: &EventRecord) -> Option<EventRoots> {
        if ev.pdu.state_key.is_some() {
            // Also a backfilled event held earlier as an outlier (its row is that).
            return self.state_event_roots(ev.pdu.event_id.as_str());
        }
        if ev.backfill.is_some() || !self.is_applied(ev.position) {
            return None;
        }
        let (full, others) = self.roots_at_position(ev.pdu.room_id.as_str(), ev.position)?;
        Some(EventRoots {
            before: full,
            after: full,
            others_before: others,
            others_after: others,
        })
    }

    /// State roots (before, after) a timeline event ([`State::roots_of`]).
    pub fn roots_at(&self, ev: &EventRecord) -> Option<(Root, Root)> {
        self.roots_of(ev).map(|r| (r.before, r.after))
    }

    /// Point lookup: the event id holding `(event_type, state_key)` at `root`.
    pub fn lookup(&self, root: Root, event_type: &str, state_key: &str) -> Option<String> {
        trie::lookup(&self.reader(), root, event_type, state_key)
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// Every (type, state key, event id) at `root`, ordered.
    pub fn entries(&self, root: Root) -> Vec<(String, String, String)> {
        trie::entries(&self.reader(), root)
            .unwrap_or_default()
            .into_iter()
            .map(|(t, k, v)| (t, k, String::from_utf8_lossy(&v).into_owned()))
            .collect()
    }

    /// Entries of one type at `root` (state key, event id).
    pub fn entries_of_type(&self, root: Root, event_type: &str) -> Vec<(String, String)> {
        trie::entries_of_type(&self.reader(), root, event_type)
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
            .collect()
    }

    /// Changes between two roots, cost proportional to the difference.
    pub fn diff(&self, from: Root, to: Root) -> Vec<trie::Change> {
        trie::diff(&self.reader(), from, to).unwrap_or_default()
    }
}

impl Projection for State {
    fn committed(&self, checkpoint: u64) {
        self.applied.store(checkpoint, Ordering::Release);
    }

    fn reload(&self) {
        // An online rebuild's swap moved the checkpoint without a batch here.
        self.applied
            .fetch_max(self.db.checkpoint("state"), Ordering::AcqRel);
        // New tables (a rebuild): nothing found in the old ones is remembered.
        let mut floors = self.floors.lock();
        self.floors_epoch.fetch_add(1, Ordering::AcqRel);
        floors.clear();
        drop(floors);
        let mut m = self.partial_rooms.write();
        *m = PartialRoomsInner::default();
        for (k, v) in self.partial.scan_prefix(&[], usize::MAX) {
            let done = <[u8; 8]>::try_from(v.as_slice())
                .ok()
                .map(u64::from_be_bytes);
            m.set(String::from_utf8_lossy(&k).into_owned(), done);
        }
    }

    fn name(&self) -> &'static str {
        "state"
    }

    /// Trie nodes are opaque hashes and bytes, so the rendering resolves them: each
    /// room's current state as `(type, state key) => event id`, and each event's
    /// effect on the state (the diff from its "before" root to its "after" root);
    /// `nodes` is summarized by its row count (its bytes are covered by the digest).
    fn render(&self) -> String {
        let mut out = String::new();
        crate::render::render_table_into(&mut out, &self.rooms);
        for (name, table) in [
            ("current", &self.current),
            ("current_others", &self.current_others),
        ] {
            let rows: Vec<(Vec<u8>, Vec<u8>)> = table.all().collect();
            out.push_str(&format!(
                "## state.{name} ({} rooms, resolved)\n",
                rows.len()
            ));
            for (room, root) in rows {
                let Some(root) = root_from(&root) else {
                    out.push_str(&format!(
                        "{} => unreadable root\n",
                        String::from_utf8_lossy(&room)
                    ));
                    continue;
                };
                let entries = self.entries(root);
                out.push_str(&format!(
                    "{} ({} entries)\n",
                    String::from_utf8_lossy(&room),
                    entries.len()
                ));
                for (t, k, id) in entries {
                    out.push_str(&format!("  ({t}, {k:?}) => {id}\n"));
                }
            }
            out.push('\n');
        }
        let rows: Vec<(Vec<u8>, Vec<u8>)> = self.changes.all().collect();
        out.push_str(&format!(
            "## state.changes ({} records that changed a room's roots)\n",
            rows.len()
        ));
        for (k, v) in rows {
            let room = String::from_utf8_lossy(&k[..k.len().saturating_sub(9)]).into_owned();
            let roots = (v.len() == 64)
                .then(|| Some((root_from(&v[..32])?, root_from(&v[32..])?)))
                .flatten();
            let Some((full, others)) = roots else {
                out.push_str(&format!(
                    "{room} @{} => unreadable roots\n",
                    key::trailing_pos(&k)
                ));
                continue;
            };
            out.push_str(&format!(
                "{room} @{} => {} entries, {} without members\n",
                key::trailing_pos(&k),
                self.entries(full).len(),
                self.entries(others).len()
            ));
        }
        out.push('\n');
        let rows: Vec<(Vec<u8>, Vec<u8>)> = self.event_roots.all().collect();
        out.push_str(&format!(
            "## state.event_roots ({} state events, as state changes)\n",
            rows.len()
        ));
        for (event_id, v) in rows {
            let id = String::from_utf8_lossy(&event_id);
            let roots = (v.len() == 128)
                .then(|| Some((root_from(&v[..32])?, root_from(&v[32..64])?)))
                .flatten();
            let Some((before, after)) = roots else {
                out.push_str(&format!("{id} => unreadable roots\n"));
                continue;
            };
            let changes: Vec<String> = self
                .diff(before, after)
                .into_iter()
                .map(|c| match c {
                    trie::Change::Added {
                        event_type,
                        state_key,
                        value,
                    } => format!(
                        "+({event_type}, {state_key:?})={}",
                        String::from_utf8_lossy(&value)
                    ),
                    trie::Change::Removed {
                        event_type,
                        state_key,
                        ..
                    } => {
                        format!("-({event_type}, {state_key:?})")
                    }
                    trie::Change::Changed {
                        event_type,
                        state_key,
                        new,
                        ..
                    } => format!(
                        "~({event_type}, {state_key:?})={}",
                        String::from_utf8_lossy(&new)
                    ),
                })
                .collect();
            let changes = if changes.is_empty() {
                "no change".to_owned()
            } else {
                changes.join(" ")
            };
            out.push_str(&format!("{id} => {changes}\n"));
        }
        out.push('\n');
        out.push_str(&format!(
            "## state.nodes ({} rows, content-addressed; see the digest)\n",
            self.nodes.all().count()
        ));
        out
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.nodes.clone(),
            self.event_roots.clone(),
            self.changes.clone(),
            self.current.clone(),
            self.current_others.clone(),
            self.rooms.clone(),
            self.partial.clone(),
        ]
    }

    /// Facts (partial state) and records with a state key: a message leaves the
    /// roots as they are and is not read (its roots are the last change before it).
    fn interest(&self) -> Interest {
        STATE_INTEREST
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        match record.fact() {
            // The memory copy changes with the staged write: a batch applied again
            // after a failed commit writes the same values.
            Some(spindle_journal::Fact::RoomStatePartial { room_id, .. }) => {
                self.partial_rooms.write().set(room_id.clone(), None);
                ctx.put(&self.partial, room_id.into_bytes(), b"p".to_vec());
                return Ok(());
            }
            Some(spindle_journal::Fact::RoomStateCompleted { room_id }) => {
                // Flipped in memory only once the batch is committed: a reader that
                // sees the room complete (`/members` waits for exactly that) must also
                // see the member slots the outliers before this record added.
                let (rooms, position) = (self.partial_rooms.clone(), record.position());
                let room = room_id.clone();
                ctx.after_commit(move || {
                    rooms.write().set(room, Some(position));
                });
                ctx.put(
                    &self.partial,
                    room_id.into_bytes(),
                    position.to_be_bytes().to_vec(),
                );
                return Ok(());
            }
            _ => {}
        }
        // Outliers (state imported on a remote join) and resolved state count too.
        if !record.applies_to_state() {
            return Ok(());
        }
        let pdu = record.room_pdu().ok_or("unreadable PDU")?;
        let room = pdu.room_id.to_string();
        let before = ctx
            .get(&self.current, room.as_bytes())
            .and_then(|v| root_from(&v))
            .unwrap_or_else(Root::empty);
        let others_before = ctx
            .get(&self.current_others, room.as_bytes())
            .and_then(|v| root_from(&v))
            .unwrap_or_else(Root::empty);
        let kind = pdu.kind.to_string();
        let (after, others_after) = match &pdu.state_key {
            Some(sk) => {
                let store = CtxNodes {
                    ctx,
                    table: &self.nodes,
                    cache: &self.node_cache,
                };
                let id = pdu.event_id.as_str().as_bytes();
                let after =
                    trie::insert(&store, before, &kind, sk, id).map_err(|e| e.to_string())?;
                let others_after = if kind == "m.room.member" {
                    others_before
                } else {
                    trie::insert(&store, others_before, &kind, sk, id).map_err(|e| e.to_string())?
                };
                (after, others_after)
            }
            None => (before, others_before),
        };
        if kind == "m.room.create" {
            let meta = RoomMeta {
                room_version: pdu.room_version.clone(),
                create_event_id: pdu.event_id.to_string(),
                creator: pdu.sender.to_string(),
            };
            ctx.put(
                &self.rooms,
                room.clone().into_bytes(),
                serde_json::to_vec(&meta).map_err(|e| e.to_string())?,
            );
        }
        // A state event (or outlier) keeps its own roots; resolved state puts an older
        // event back, which keeps the roots of its own place in the log.
        if pdu.state_key.is_some() && !record.is_state_resolved() {
            let mut roots = before.0.to_vec();
            roots.extend_from_slice(&after.0);
            roots.extend_from_slice(&others_before.0);
            roots.extend_from_slice(&others_after.0);
            ctx.put(
                &self.event_roots,
                pdu.event_id.to_string().into_bytes(),
                roots,
            );
        }
        if (after, others_after) == (before, others_before) {
            // A message (or a state event put back as it was): the room's roots stay,
            // nothing is written.
            return Ok(());
        }
        let mut now = after.0.to_vec();
        now.extend_from_slice(&others_after.0);
        ctx.put(
            &self.changes,
            key::with_pos(&[&room], record.position()),
            now,
        );
        ctx.put(
            &self.current_others,
            room.clone().into_bytes(),
            others_after.0.to_vec(),
        );
        ctx.put(&self.current, room.into_bytes(), after.0.to_vec());
        Ok(())
    }
}
