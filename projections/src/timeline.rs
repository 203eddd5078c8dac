//! Timeline projection: every event by id, the room stream index keyed by
//! (room, position), redactions, each room's last activity, and each room's last
//! *bump* (room-list recency: MSC4186 `bump_stamp`).
//!
//! Tables:
//! - `events`: event id -> where the event is: its journal position, sending device
//!   and txn id, backfill sequence ([`EventRow`], a few bytes). The PDU itself is read
//!   from the journal record at that position (the journal holds it already; a second
//!   copy here was 822 B of the 2,159 B each event cost on disk). Rows written before
//!   that (JSON [`StoredEvent`], PDU included) are still read as they are, until an
//!   online rebuild of the timeline rewrites them.
//! - `room_events`: room id, 0x00, position BE -> event id
//! - `redactions`: redacted event id -> redaction event id (first redaction wins)
//! - `rooms`: room id -> last position (also kept in memory: "did anything happen")
//! - `bumps`: room id -> position of the last event whose type is one of
//!   [`BUMP_EVENT_TYPES`] (also kept in memory: the room-list sort and `bump_stamp`)
//! - `backfill`: room id, 0x00, backfill sequence BE -> event id: history fetched with
//!   `/backfill`, older than the room's first event in `room_events`. Sequence 1 is
//!   the newest backfilled event, each one after it older (the order the journal's
//!   `Backfilled` records came in, newest first).
//! - `backfill_seq`: room id -> the last backfill sequence used
//!
//! Events read by id are kept parsed in a cache bounded in bytes ([`EventCache`]):
//! room lists, `/sync` and sliding sync read the same state events (name, avatar,
//! power levels, the user's membership) and the newest messages over and over, and a
//! read from the store is a decode and a PDU parse each time.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use spindle_core::pdu::Pdu;
use spindle_journal::{Interest, StoredRecord};

use crate::{
    change_index::ChangeIndex,
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// The event types that bump a room in the room list (MSC4186 `bump_stamp`: "proper
/// activity"; the set is Synapse's default, which Element X expects): a reaction, an
/// edit of the room state or a membership change does not move the room.
pub const BUMP_EVENT_TYPES: [&str; 7] = [
    "m.room.create",
    "m.room.message",
    "m.room.encrypted",
    "m.sticker",
    "m.call.invite",
    "m.poll.start",
    "m.beacon_info",
];

/// An `events` row as the timeline wrote it before the PDU was read from the journal
/// (JSON; still read, and still written by a timeline opened without a journal).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct StoredEvent {
    /// Journal position.
    pub position: u64,
    /// Room version.
    pub room_version: String,
    /// Room id (needed for v12 create events, whose JSON has none).
    pub room_id: String,
    /// Canonical PDU JSON.
    pub pdu: String,
    /// Device that sent it (local sends).
    pub device_id: Option<String>,
    /// Client transaction id (local sends).
    pub txn_id: Option<String>,
    /// For backfilled history: its place in the `backfill` index (1: newest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backfill: Option<u64>,
}

impl StoredEvent {
    /// Parses the PDU.
    pub fn parse(&self, event_id: &str) -> Option<Pdu> {
        Pdu::parse(
            self.pdu.as_bytes(),
            &self.room_version,
            ruma::OwnedEventId::try_from(event_id).ok(),
            ruma::OwnedRoomId::try_from(self.room_id.as_str()).ok(),
        )
        .ok()
    }
}

/// An `events` row: where an event is, its PDU being in the journal record at
/// `position`. Encoded as [`EventRow::FORMAT`], then the position (u64 BE), then a
/// flags byte (bit 0: device, bit 1: txn id, bit 2: backfill), then the backfill
/// sequence (u64 BE) and the device and txn id (u32 BE length, UTF-8) that are set.
/// The first byte tells it from a JSON [`StoredEvent`] row (`{`).
#[derive(Debug, Clone, PartialEq)]
pub struct EventRow {
    /// Journal position of the record holding the PDU.
    pub position: u64,
    /// Device that sent it (local sends).
    pub device_id: Option<String>,
    /// Client transaction id (local sends).
    pub txn_id: Option<String>,
    /// For backfilled history: its place in the `backfill` index (1: newest).
    pub backfill: Option<u64>,
}

impl EventRow {
    /// The first byte of an encoded row.
    pub const FORMAT: u8 = 1;

    /// The row's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(24);
        v.push(Self::FORMAT);
        v.extend_from_slice(&self.position.to_be_bytes());
        let flags = u8::from(self.device_id.is_some())
            | (u8::from(self.txn_id.is_some()) << 1)
            | (u8::from(self.backfill.is_some()) << 2);
        v.push(flags);
        if let Some(seq) = self.backfill {
            v.extend_from_slice(&seq.to_be_bytes());
        }
        for s in [&self.device_id, &self.txn_id].into_iter().flatten() {
            v.extend_from_slice(&(s.len() as u32).to_be_bytes());
            v.extend_from_slice(s.as_bytes());
        }
        v
    }

    /// Decodes [`EventRow::encode`]'s bytes; `None` for anything else.
    pub fn decode(v: &[u8]) -> Option<EventRow> {
        if v.first() != Some(&Self::FORMAT) {
            return None;
        }
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(v.get(at..at + 8)?.try_into().ok()?))
        };
        let position = u64_at(1)?;
        let flags = *v.get(9)?;
        let mut at = 10;
        let backfill = if flags & 4 != 0 {
            at += 8;
            Some(u64_at(at - 8)?)
        } else {
            None
        };
        let mut text = |present: bool| -> Option<Option<String>> {
            if !present {
                return Some(None);
            }
            let len = u32::from_be_bytes(v.get(at..at + 4)?.try_into().ok()?) as usize;
            let s = std::str::from_utf8(v.get(at + 4..at + 4 + len)?).ok()?;
            at += 4 + len;
            Some(Some(s.to_owned()))
        };
        let device_id = text(flags & 1 != 0)?;
        let txn_id = text(flags & 2 != 0)?;
        Some(EventRow {
            position,
            device_id,
            txn_id,
            backfill,
        })
    }
}

/// A loaded event: the PDU plus where it sits.
#[derive(Debug, Clone)]
pub struct EventRecord {
    /// Journal position.
    pub position: u64,
    /// The PDU.
    pub pdu: Arc<Pdu>,
    /// Sending device.
    pub device_id: Option<String>,
    /// Client txn id.
    pub txn_id: Option<String>,
    /// For backfilled history (older than the room's first live event here): its
    /// backfill sequence, 1 the newest. Its `position` is when it was fetched, not
    /// where it sits in the room's order.
    pub backfill: Option<u64>,
}

/// The timeline projection.
pub struct Timeline {
    events: Table,
    room_events: Table,
    redactions: Table,
    rooms: Table,
    bumps: Table,
    backfill: Table,
    backfill_seq: Table,
    recency: Arc<RwLock<ChangeIndex>>,
    /// Calls of [`Timeline::last_activity`] and [`Timeline::recencies`] (a counting
    /// test's measure: an incremental sync must not ask once per joined room, nor a
    /// sliding window once per room of the user).
    activity_lookups: AtomicU64,
    bumped: Arc<RwLock<HashMap<String, u64>>>,
    redaction_generations: Arc<RedactionGenerations>,
    cache: Arc<EventCache>,
    tails: Arc<RwLock<Tails>>,
    /// Where PDUs are read from (`None`: the PDU is kept in the row, as before).
    journal: Option<spindle_journal::Journal>,
}

/// Events by id, parsed, bounded in bytes (the PDU JSON's length plus a fixed
/// [`EventCache::OVERHEAD`] per event; past the budget the oldest entries go first).
///
/// A stored event can be rewritten (an outlier that later arrives in the timeline, a
/// backfilled copy): every write of an id removes it after its batch commits, and
/// bumps `writes` first, so a reader that read the old row before the commit does not
/// put it back (it inserts only if `writes` did not move since before its read).
pub struct EventCache {
    inner: Mutex<CacheInner>,
    writes: AtomicU64,
    budget: usize,
    /// Reads answered from the cache.
    pub hits: AtomicU64,
    /// Reads that went to the store (and parsed what they read).
    pub misses: AtomicU64,
}

#[derive(Default)]
struct CacheInner {
    map: HashMap<String, (EventRecord, usize)>,
    order: VecDeque<String>,
    bytes: usize,
}

impl EventCache {
    /// Bytes counted per event beside its PDU JSON (the parsed fields, the key, the
    /// record's other fields): an estimate, so the budget is approximate.
    pub const OVERHEAD: usize = 512;

    fn new(budget: usize) -> EventCache {
        EventCache {
            inner: Mutex::default(),
            writes: AtomicU64::new(0),
            budget,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn get(&self, event_id: &str) -> Option<EventRecord> {
        let hit = self.inner.lock().map.get(event_id).map(|(e, _)| e.clone());
        let counter = if hit.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Keeps `ev`, read from the store after `writes` was `seen`.
    fn put(&self, event_id: &str, ev: &EventRecord, seen: u64) {
        let size = ev.pdu.json.len() + Self::OVERHEAD;
        if self.budget == 0 || size > self.budget / 8 {
            return;
        }
        let mut inner = self.inner.lock();
        if self.writes.load(Ordering::Acquire) != seen || inner.map.contains_key(event_id) {
            return;
        }
        // Forgotten ids leave their `order` entries behind: drop them now and then.
        if inner.order.len() > 2 * inner.map.len() + 64 {
            let CacheInner { map, order, .. } = &mut *inner;
            order.retain(|id| map.contains_key(id));
        }
        while inner.bytes + size > self.budget {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some((_, n)) = inner.map.remove(&old) {
                inner.bytes -= n;
            }
        }
        inner.order.push_back(event_id.to_owned());
        inner.map.insert(event_id.to_owned(), (ev.clone(), size));
        inner.bytes += size;
    }

    /// Forgets `ids` (written again by a committed batch).
    fn forget(&self, ids: &[String]) {
        self.writes.fetch_add(1, Ordering::AcqRel);
        let mut inner = self.inner.lock();
        for id in ids {
            if let Some((_, n)) = inner.map.remove(id) {
                inner.bytes -= n;
                // Its `order` entry stays until it reaches the front (then it is skipped).
            }
        }
    }

    /// Forgets every event (the tables were swapped: an online rebuild); a read that
    /// raced the swap is not put back.
    fn clear(&self) {
        self.writes.fetch_add(1, Ordering::AcqRel);
        let mut inner = self.inner.lock();
        *inner = CacheInner::default();
    }

    /// The budget in bytes (0: the cache is off).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Events and bytes held now.
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (inner.map.len(), inner.bytes)
    }
}

/// How many redactions each room has had applied since the process started, plus an
/// epoch that moves whenever the timeline's tables are reloaded (an online rebuild):
/// a rendering of a room's events taken at one [`RedactionGeneration`] is still
/// current while the room's generation is unchanged. In memory only; bumped after
/// the batch that applied the redaction commits, so a reader that sees the new
/// generation also sees the redaction.
#[derive(Default)]
struct RedactionGenerations {
    epoch: std::sync::atomic::AtomicU64,
    rooms: RwLock<HashMap<String, u64>>,
}

/// A room's redaction generation ([`Timeline::redaction_generation`]): equal values
/// mean no redaction was applied in the room between the two reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RedactionGeneration {
    /// Moves when the timeline's tables are reloaded.
    pub epoch: u64,
    /// Redactions applied in the room since the process started.
    pub count: u64,
}

/// Rows of a room's live timeline kept in memory: the newest [`TAIL_ROWS`].
pub const TAIL_ROWS: usize = 21;
/// Rooms whose newest rows are kept in memory; past it the kept tails are dropped
/// (every room reads its tail from the store once more).
pub const TAIL_ROOMS: usize = 4096;

/// The newest `room_events` rows of rooms read lately, in memory: what `/sync`,
/// sliding sync and a `/messages` page from the live end ask first
/// ([`Timeline::range_backward`]). A tail is filled from the store when a room is first
/// read, then kept current by each committed event of the room (after the commit that
/// wrote the row, as the room's recency), so it is exact: the newest rows the table
/// holds. A fill inserts only if the room's recency still names the newest row it read
/// (an event committed meanwhile makes it drop the fill).
#[derive(Default)]
struct Tails {
    rooms: HashMap<String, Tail>,
}

struct Tail {
    /// Newest first, at most [`TAIL_ROWS`].
    rows: std::collections::VecDeque<(u64, Arc<str>)>,
    /// Whether `rows` is every row of the room (fewer than [`TAIL_ROWS`] events).
    complete: bool,
}

impl Tail {
    /// Rows in `[from, before)`, newest first, at most `limit`, if the tail answers for
    /// the whole span.
    fn range(&self, before: u64, from: u64, limit: usize) -> Option<Vec<(u64, String)>> {
        let mut out = Vec::new();
        for (pos, id) in &self.rows {
            if *pos >= before {
                continue;
            }
            if *pos < from || out.len() == limit {
                return Some(out);
            }
            out.push((*pos, id.to_string()));
        }
        // The tail ran out: it answers if nothing older exists.
        (self.complete || out.len() == limit).then_some(out)
    }
}

/// The default of [`Timeline::open_with`]'s event cache budget (16 MiB; the
/// `[caches] timeline_event_bytes` setting).
pub const EVENT_CACHE_BYTES: usize = 16 * 1024 * 1024;

impl Timeline {
    /// Opens the tables, with an event cache of [`EVENT_CACHE_BYTES`].
    pub fn open(db: &ProjectionDb) -> Result<Timeline, String> {
        Self::open_with(db, EVENT_CACHE_BYTES)
    }

    /// Opens the tables, with an event cache of `cache_bytes` (0: none).
    pub fn open_with(db: &ProjectionDb, cache_bytes: usize) -> Result<Timeline, String> {
        Self::open_on(db, cache_bytes, None)
    }

    /// Opens the tables; with `journal`, events are stored as [`EventRow`]s and their
    /// PDUs read from the journal (how the server runs), else as [`StoredEvent`]s.
    pub fn open_on(
        db: &ProjectionDb,
        cache_bytes: usize,
        journal: Option<spindle_journal::Journal>,
    ) -> Result<Timeline, String> {
        Ok(Timeline {
            events: db.table("timeline", "events")?,
            room_events: db.table("timeline", "room_events")?,
            redactions: db.table("timeline", "redactions")?,
            rooms: db.table("timeline", "rooms")?,
            bumps: db.table("timeline", "bumps")?,
            backfill: db.table("timeline", "backfill")?,
            backfill_seq: db.table("timeline", "backfill_seq")?,
            recency: Arc::default(),
            activity_lookups: AtomicU64::new(0),
            bumped: Arc::default(),
            redaction_generations: Arc::default(),
            cache: Arc::new(EventCache::new(cache_bytes)),
            tails: Arc::default(),
            journal,
        })
    }

    /// The event cache (its counters and size).
    pub fn cache(&self) -> &EventCache {
        &self.cache
    }

    /// The room's [`RedactionGeneration`] (in memory; no store read). Read it before
    /// reading what a cached rendering is built from, so a redaction applied meanwhile
    /// makes the rendering stale rather than wrongly current.
    pub fn redaction_generation(&self, room_id: &str) -> RedactionGeneration {
        let g = &self.redaction_generations;
        RedactionGeneration {
            epoch: g.epoch.load(std::sync::atomic::Ordering::Acquire),
            count: g.rooms.read().get(room_id).copied().unwrap_or(0),
        }
    }

    /// The id of the room's event at `position` in its live timeline (one point read
    /// of `room_events`); `None` if there is none there (another room's position, an
    /// outlier, a backfilled event).
    pub fn event_id_at(&self, room_id: &str, position: u64) -> Option<String> {
        self.room_events
            .get(&key::with_pos(&[room_id], position))
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// Loads an event by id: from the event cache, else one point read and a parse.
    pub fn event(&self, event_id: &str) -> Option<EventRecord> {
        if let Some(ev) = self.cache.get(event_id) {
            return Some(ev);
        }
        let seen = self.cache.writes.load(Ordering::Acquire);
        let raw = self.events.get(event_id.as_bytes())?;
        let ev = match EventRow::decode(&raw) {
            Some(row) => {
                let pdu = self.journal_pdu(row.position, event_id)?;
                EventRecord {
                    position: row.position,
                    pdu,
                    device_id: row.device_id,
                    txn_id: row.txn_id,
                    backfill: row.backfill,
                }
            }
            None => {
                let stored: StoredEvent = serde_json::from_slice(&raw).ok()?;
                let pdu = stored.parse(event_id)?;
                EventRecord {
                    position: stored.position,
                    pdu: Arc::new(pdu),
                    device_id: stored.device_id,
                    txn_id: stored.txn_id,
                    backfill: stored.backfill,
                }
            }
        };
        self.cache.put(event_id, &ev, seen);
        Some(ev)
    }

    /// The PDU of the journal record at `position`, which must be `event_id`'s (a
    /// mismatch is logged and read as absent: the row and the journal disagree).
    fn journal_pdu(&self, position: u64, event_id: &str) -> Option<Arc<Pdu>> {
        let journal = self.journal.as_ref()?;
        let record = match journal.read_after_shared(position.checked_sub(1)?, 1) {
            Ok(mut recs) => recs.pop().filter(|r| r.position() == position)?,
            Err(e) => {
                tracing::error!(position, event_id, error = %e, "journal read for a timeline event failed");
                return None;
            }
        };
        let pdu = record.any_pdu()?;
        if pdu.event_id.as_str() != event_id {
            tracing::error!(
                position,
                event_id,
                found = %pdu.event_id,
                "the journal record at a timeline row's position holds another event"
            );
            return None;
        }
        Some(pdu)
    }

    /// Stages an `events` row (an [`EventRow`] when PDUs are read from the journal)
    /// and forgets the id's cached copy once the batch commits.
    /// The PDU is copied into the row only when there is no journal to read it from.
    fn put_event(
        &self,
        ctx: &mut ApplyCtx,
        event_id: &str,
        row: EventRow,
        pdu: &Pdu,
    ) -> Result<(), String> {
        let row = match self.journal {
            Some(_) => row.encode(),
            None => serde_json::to_vec(&StoredEvent {
                position: row.position,
                room_version: pdu.room_version.clone(),
                room_id: pdu.room_id.to_string(),
                pdu: String::from_utf8_lossy(&pdu.json).into_owned(),
                device_id: row.device_id,
                txn_id: row.txn_id,
                backfill: row.backfill,
            })
            .map_err(|e| e.to_string())?,
        };
        ctx.put(&self.events, event_id.as_bytes().to_vec(), row);
        let cache = self.cache.clone();
        let id = vec![event_id.to_owned()];
        ctx.after_commit(move || cache.forget(&id));
        Ok(())
    }

    /// Event ids of a room with positions in `(after, upto]`, ascending, at most `limit`.
    pub fn range_forward(
        &self,
        room_id: &str,
        after: u64,
        upto: u64,
        limit: usize,
    ) -> Vec<(u64, String)> {
        if upto <= after {
            return vec![];
        }
        let start = key::with_pos(&[room_id], after + 1);
        let end = key::with_pos(&[room_id], upto.saturating_add(1));
        self.decode(self.room_events.scan_range(&start, &end, false, limit))
    }

    /// Event ids of a room with positions in `[from, before)`, descending, at most `limit`.
    pub fn range_backward(
        &self,
        room_id: &str,
        before: u64,
        from: u64,
        limit: usize,
    ) -> Vec<(u64, String)> {
        if before <= from {
            return vec![];
        }
        if let Some(rows) = self.tail_range(room_id, before, from, limit) {
            return rows;
        }
        let start = key::with_pos(&[room_id], from);
        let end = key::with_pos(&[room_id], before);
        self.decode(self.room_events.scan_range(&start, &end, true, limit))
    }

    /// [`Timeline::range_backward`] from the room's tail in memory ([`Tails`]), filling
    /// the tail first (one scan of [`TAIL_ROWS`] rows) when the room has none. `None`
    /// when the span reaches below the tail.
    fn tail_range(
        &self,
        room_id: &str,
        before: u64,
        from: u64,
        limit: usize,
    ) -> Option<Vec<(u64, String)>> {
        if let Some(t) = self.tails.read().rooms.get(room_id) {
            return t.range(before, from, limit);
        }
        // The newest row the room's recency names: the fill is kept only if it is
        // still the newest when the fill is inserted.
        let head = self.recency.read().get(room_id)?;
        let start = key::with_pos(&[room_id], 0);
        let end = key::with_pos(&[room_id], u64::MAX);
        let rows = self.decode(self.room_events.scan_range(&start, &end, true, TAIL_ROWS));
        if rows.first().map(|(pos, _)| *pos) != Some(head) {
            return None;
        }
        let tail = Tail {
            complete: rows.len() < TAIL_ROWS,
            rows: rows
                .into_iter()
                .map(|(pos, id)| (pos, Arc::from(id)))
                .collect(),
        };
        let answer = tail.range(before, from, limit);
        let mut tails = self.tails.write();
        if self.recency.read().get(room_id) == Some(head) {
            if tails.rooms.len() >= TAIL_ROOMS {
                tails.rooms.clear();
            }
            tails.rooms.insert(room_id.to_owned(), tail);
        }
        answer
    }

    /// Rooms whose tail is kept in memory now (at most [`TAIL_ROOMS`]).
    pub fn tails_kept(&self) -> usize {
        self.tails.read().rooms.len()
    }

    /// Backfilled event ids of a room with sequence after `after_seq`, going back in
    /// time (ascending sequence), at most `limit`.
    pub fn range_backfill_older(
        &self,
        room_id: &str,
        after_seq: u64,
        limit: usize,
    ) -> Vec<(u64, String)> {
        let start = key::with_pos(&[room_id], after_seq.saturating_add(1));
        let end = key::with_pos(&[room_id], u64::MAX);
        self.decode(self.backfill.scan_range(&start, &end, false, limit))
    }

    /// Backfilled event ids of a room with sequence below `before_seq`, going forward
    /// in time (descending sequence), at most `limit`.
    pub fn range_backfill_newer(
        &self,
        room_id: &str,
        before_seq: u64,
        limit: usize,
    ) -> Vec<(u64, String)> {
        if before_seq <= 1 {
            return vec![];
        }
        let start = key::with_pos(&[room_id], 1);
        let end = key::with_pos(&[room_id], before_seq);
        self.decode(self.backfill.scan_range(&start, &end, true, limit))
    }

    /// The oldest event of the room's timeline here: the last backfilled one, else the
    /// first live one (where `/backfill` continues from). Two point reads at most.
    pub fn oldest_event(&self, room_id: &str) -> Option<String> {
        let start = key::with_pos(&[room_id], 1);
        let end = key::with_pos(&[room_id], u64::MAX);
        if let Some((_, id)) = self
            .decode(self.backfill.scan_range(&start, &end, true, 1))
            .pop()
        {
            return Some(id);
        }
        self.range_forward(room_id, 0, u64::MAX, 1)
            .pop()
            .map(|(_, id)| id)
    }

    fn decode(&self, rows: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<(u64, String)> {
        rows.into_iter()
            .map(|(k, v)| {
                (
                    key::trailing_pos(&k),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect()
    }

    /// The redaction that redacted `event_id`, if any.
    pub fn redacted_by(&self, event_id: &str) -> Option<String> {
        self.redactions
            .get(event_id.as_bytes())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// Position of the room's latest event (in memory; no store read).
    pub fn last_activity(&self, room_id: &str) -> Option<u64> {
        self.activity_lookups.fetch_add(1, Ordering::Relaxed);
        self.recency.read().get(room_id)
    }

    /// How many times [`Timeline::last_activity`] was asked (for counting tests).
    pub fn activity_lookups(&self) -> u64 {
        self.activity_lookups.load(Ordering::Relaxed)
    }

    /// Rooms whose latest event is after `after`, at most `limit` (in memory; walks
    /// only those rooms). `None` when more than `limit` rooms did: ask
    /// [`Timeline::last_activity`] room by room.
    pub fn rooms_active_after(&self, after: u64, limit: usize) -> Option<Vec<Arc<str>>> {
        self.recency.read().changed_after(after, limit)
    }

    /// The room-list recency of each room, in the order given: the position of its
    /// latest event of a [`BUMP_EVENT_TYPES`] type, else (a room with none, or whose
    /// bumps were not recorded: a data directory from before the `bumps` table,
    /// which `spindle replay rebuild timeline` fills) its [`Timeline::last_activity`],
    /// else `None`. One read lock per map for the whole list
    /// (a sliding window orders all of a user's rooms: 500 rooms took 500 lock pairs),
    /// counted once in [`Timeline::activity_lookups`]. Memory only.
    pub fn recencies<'r>(&self, rooms: impl IntoIterator<Item = &'r str>) -> Vec<Option<u64>> {
        self.activity_lookups.fetch_add(1, Ordering::Relaxed);
        let bumped = self.bumped.read();
        let mut recency = None;
        rooms
            .into_iter()
            .map(|room| {
                bumped
                    .get(room)
                    .copied()
                    .or_else(|| recency.get_or_insert_with(|| self.recency.read()).get(room))
            })
            .collect()
    }
}

/// Each (room, position) row of a room -> position table (`rooms`, `bumps`).
fn each_position(table: &Table, mut f: impl FnMut(String, u64)) {
    for (k, v) in table.all() {
        if v.len() == 8 {
            f(
                String::from_utf8_lossy(&k).into_owned(),
                u64::from_be_bytes(v[..8].try_into().expect("8")),
            );
        }
    }
}

impl Projection for Timeline {
    fn name(&self) -> &'static str {
        "timeline"
    }

    /// Room records only: a fact (a receipt, a login) does not wake it.
    fn interest(&self) -> Interest {
        Interest::ROOM
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.events.clone(),
            self.room_events.clone(),
            self.redactions.clone(),
            self.rooms.clone(),
            self.bumps.clone(),
            self.backfill.clone(),
            self.backfill_seq.clone(),
        ]
    }

    fn reload(&self) {
        let mut recency = self.recency.write();
        recency.clear(0);
        each_position(&self.rooms, |room, pos| {
            recency.bump(&room, pos);
        });
        drop(recency);
        let mut bumped = self.bumped.write();
        bumped.clear();
        each_position(&self.bumps, |room, pos| {
            bumped.insert(room, pos);
        });
        // New tables (an online rebuild) may hold redactions the counts never saw,
        // and rows the cached events were not read from.
        self.redaction_generations
            .epoch
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.cache.clear();
        // After the recency is rebuilt: a fill that read the old one is checked
        // against the new one, and whatever was filled before is gone.
        self.tails.write().rooms.clear();
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if record.is_backfilled() {
            return self.apply_backfilled(ctx, record);
        }
        if !record.is_event() && !record.is_outlier() {
            return Ok(());
        }
        let pdu = record.room_pdu().ok_or("unreadable PDU")?;
        let room = pdu.room_id.to_string();
        let event_id = pdu.event_id.to_string();
        let row = EventRow {
            position: record.position(),
            device_id: record.device_id().map(str::to_owned),
            txn_id: record.txn_id().map(str::to_owned),
            backfill: None,
        };
        self.put_event(ctx, &event_id, row, &pdu)?;
        // An outlier is fetchable by id (state, auth chains) but not in the timeline.
        if record.is_outlier() {
            return Ok(());
        }
        let tail_id: Arc<str> = Arc::from(event_id.as_str());
        ctx.put(
            &self.room_events,
            key::with_pos(&[&room], record.position()),
            event_id.into_bytes(),
        );
        ctx.put(
            &self.rooms,
            room.clone().into_bytes(),
            record.position().to_be_bytes().to_vec(),
        );
        let kind = pdu.kind.to_string();
        let bumps = BUMP_EVENT_TYPES.contains(&kind.as_str());
        if bumps {
            ctx.put(
                &self.bumps,
                room.clone().into_bytes(),
                record.position().to_be_bytes().to_vec(),
            );
        }
        let mut redacts = false;
        if kind == "m.room.redaction"
            && let Some(target) = &pdu.redacts
        {
            let k = target.to_string().into_bytes();
            if ctx.get(&self.redactions, &k).is_none() {
                ctx.put(&self.redactions, k, pdu.event_id.to_string().into_bytes());
                redacts = true;
            }
        }
        let (recency, bumped) = (self.recency.clone(), self.bumped.clone());
        let generations = self.redaction_generations.clone();
        let tails = self.tails.clone();
        let pos = record.position();
        ctx.after_commit(move || {
            if bumps {
                bumped.write().insert(room.clone(), pos);
            }
            if redacts {
                *generations.rooms.write().entry(room.clone()).or_insert(0) += 1;
            }
            recency.write().bump(&room, pos);
            // After the recency: a fill that read the older head sees the move and
            // drops itself; one inserted before this point gets the row here.
            if let Some(t) = tails.write().rooms.get_mut(&room)
                && t.rows.front().is_none_or(|(newest, _)| *newest < pos)
            {
                t.rows.push_front((pos, tail_id));
                if t.rows.len() > TAIL_ROWS {
                    t.rows.pop_back();
                    t.complete = false;
                }
            }
        });
        Ok(())
    }
}

impl Timeline {
    /// A backfilled event: stored by id and put after the room's oldest backfilled one
    /// in the `backfill` index; the live index, recency and bumps stay as they are.
    fn apply_backfilled(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let pdu = record.any_pdu().ok_or("unreadable backfilled PDU")?;
        let room = pdu.room_id.to_string();
        let seq = ctx
            .get(&self.backfill_seq, room.as_bytes())
            .filter(|v| v.len() == 8)
            .map(|v| u64::from_be_bytes(v[..8].try_into().expect("8")))
            .unwrap_or(0)
            + 1;
        let event_id = pdu.event_id.to_string();
        let row = EventRow {
            position: record.position(),
            device_id: None,
            txn_id: None,
            backfill: Some(seq),
        };
        self.put_event(ctx, &event_id, row, &pdu)?;
        ctx.put(
            &self.backfill,
            key::with_pos(&[&room], seq),
            event_id.into_bytes(),
        );
        ctx.put(
            &self.backfill_seq,
            room.clone().into_bytes(),
            seq.to_be_bytes().to_vec(),
        );
        if pdu.kind.to_string() == "m.room.redaction"
            && let Some(target) = &pdu.redacts
        {
            let k = target.to_string().into_bytes();
            if ctx.get(&self.redactions, &k).is_none() {
                ctx.put(&self.redactions, k, pdu.event_id.to_string().into_bytes());
                let generations = self.redaction_generations.clone();
                ctx.after_commit(move || {
                    *generations.rooms.write().entry(room).or_insert(0) += 1;
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(positions: &[u64], complete: bool) -> Tail {
        Tail {
            rows: positions
                .iter()
                .map(|p| (*p, Arc::from(format!("$e{p}"))))
                .collect(),
            complete,
        }
    }

    fn positions(rows: Option<Vec<(u64, String)>>) -> Option<Vec<u64>> {
        rows.map(|r| r.into_iter().map(|(p, _)| p).collect())
    }

    #[test]
    fn a_tail_answers_only_spans_it_covers() {
        // Newest first; the room has older rows than these.
        let t = tail(&[50, 40, 30, 20], false);
        // From the head: the newest three.
        assert_eq!(positions(t.range(u64::MAX, 1, 3)), Some(vec![50, 40, 30]));
        // Below a position, down to a floor inside the tail.
        assert_eq!(positions(t.range(45, 25, 10)), Some(vec![40, 30]));
        // The span goes below the tail's oldest row: the store answers.
        assert_eq!(positions(t.range(u64::MAX, 1, 10)), None);
        assert_eq!(positions(t.range(20, 1, 2)), None);
        // Exactly the tail.
        assert_eq!(
            positions(t.range(u64::MAX, 1, 4)),
            Some(vec![50, 40, 30, 20])
        );
        // Nothing after the floor.
        assert_eq!(positions(t.range(u64::MAX, 60, 5)), Some(vec![]));
        // A complete tail is the whole room: any span is answered.
        let all = tail(&[7, 5, 2], true);
        assert_eq!(positions(all.range(u64::MAX, 1, 10)), Some(vec![7, 5, 2]));
        assert_eq!(positions(all.range(5, 1, 10)), Some(vec![2]));
        assert_eq!(positions(all.range(2, 1, 10)), Some(vec![]));
    }

    fn record(position: u64) -> EventRecord {
        let json = br#"{"auth_events":[],"content":{"body":"hi","msgtype":"m.text"},"depth":2,"hashes":{"sha256":"aaaa"},"origin_server_ts":1,"prev_events":[],"room_id":"!r:x","sender":"@a:x","signatures":{},"type":"m.room.message"}"#;
        let pdu = Pdu::parse(json, "10", Some("$e".try_into().unwrap()), None).unwrap();
        EventRecord {
            position,
            pdu: Arc::new(pdu),
            device_id: None,
            txn_id: None,
            backfill: None,
        }
    }

    #[test]
    fn a_read_that_raced_a_rewrite_is_not_cached_and_the_budget_holds() {
        let cache = EventCache::new(64 * 1024);
        // A reader saw `writes` at 0, read the old row; the rewrite committed and
        // forgot the id meanwhile: the old row must not be put back.
        let seen = cache.writes.load(Ordering::Acquire);
        cache.forget(&["$e".to_owned()]);
        cache.put("$e", &record(1), seen);
        assert!(cache.get("$e").is_none());
        // Read after the rewrite: kept, and served.
        cache.put("$e", &record(2), cache.writes.load(Ordering::Acquire));
        assert_eq!(cache.get("$e").map(|e| e.position), Some(2));
        // Forgotten when written again.
        cache.forget(&["$e".to_owned()]);
        assert!(cache.get("$e").is_none());
        // Past the budget the oldest go first; bytes never exceed it.
        let size = record(0).pdu.json.len() + EventCache::OVERHEAD;
        let fits = 64 * 1024 / size;
        for i in 0..fits + 10 {
            cache.put(
                &format!("$e{i}"),
                &record(i as u64),
                cache.writes.load(Ordering::Acquire),
            );
        }
        let (n, bytes) = cache.usage();
        assert_eq!(n, fits);
        assert!(bytes <= 64 * 1024);
        assert!(cache.get("$e0").is_none());
        assert_eq!(
            cache.get(&format!("$e{}", fits + 9)).map(|e| e.position),
            Some(fits as u64 + 9)
        );
        // Swapped tables (an online rebuild): everything goes, and a read that raced
        // the swap is not put back.
        let seen = cache.writes.load(Ordering::Acquire);
        cache.clear();
        assert_eq!(cache.usage(), (0, 0));
        cache.put("$x", &record(5), seen);
        assert!(cache.get("$x").is_none());
    }

    #[test]
    fn event_rows_round_trip_and_are_told_from_json_rows() {
        let rows = [
            EventRow {
                position: 7,
                device_id: None,
                txn_id: None,
                backfill: None,
            },
            EventRow {
                position: u64::MAX - 1,
                device_id: Some("DEVICEÉ".into()),
                txn_id: Some("m1.2".into()),
                backfill: None,
            },
            EventRow {
                position: 300,
                device_id: None,
                txn_id: Some(String::new()),
                backfill: Some(12),
            },
        ];
        let sizes: Vec<usize> = rows.iter().map(|r| r.encode().len()).collect();
        // Tag + position + flags, the backfill sequence, then length-prefixed strings.
        assert_eq!(sizes, vec![10, 10 + 4 + 8 + 4 + 4, 10 + 8 + 4]);
        for row in &rows {
            assert_eq!(EventRow::decode(&row.encode()).as_ref(), Some(row));
        }
        // A truncated row, and a row written as JSON before, are not EventRows.
        let mut cut = rows[1].encode();
        cut.pop();
        assert_eq!(EventRow::decode(&cut), None);
        let json = serde_json::to_vec(&StoredEvent {
            position: 1,
            room_version: "10".into(),
            room_id: "!r:x".into(),
            pdu: "{}".into(),
            device_id: None,
            txn_id: None,
            backfill: None,
        })
        .unwrap();
        assert_eq!(EventRow::decode(&json), None);
    }
}
