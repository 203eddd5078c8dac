//! Write-model snapshots: start-up in time proportional to the records since the last
//! snapshot, not to the journal's length (issue 17 item 3).
//!
//! [`crate::Journal::open`] restores every in-memory write model the journal keeps
//! (room aggregates with their current state, outlier set and fork window; registered
//! users, aliases, spent refresh tokens, deactivated accounts, claimable device keys,
//! to-device transaction ids, media ids) and finds the chain head. With a snapshot it
//! loads the models as they were at the snapshot's position and replays only the
//! records after it; the hash chain is verified from the snapshot's checkpoint
//! (position + hash of the record there, checked against the stored record) instead of
//! from position 0. `spindle journal check` still walks and verifies everything.
//!
//! **A snapshot is a cache.** Deleting it gives the same write models by replaying the
//! whole journal (`journal/tests/snapshot.rs` compares [`crate::Journal::write_model_digest`]
//! both ways, fork windows included). So a snapshot that cannot be used is ignored and
//! everything replayed: one of another [`SNAPSHOT_FORMAT`] (another release, or the old
//! layout without the magic prefix), bytes that do not decode or do not validate, a
//! checkpoint that does not match the journal (a restored backup, a truncated torn
//! tail), or one taken with another fork-window size (a full replay would build
//! windows of the configured size, so the snapshot's would differ).
//!
//! **When.** A start-up that replayed at least `snapshot_every_records` records saves
//! one (the models are then exactly those of the durable head, with no writer
//! running). While serving, the appender starts a background snapshot each time that
//! many records were appended since the last: on its own thread it loads the last
//! snapshot, replays the records after it up to the durable head the appender just
//! published (the same [`crate::replay_into`] as start-up, so the result is what a
//! restart would build), and saves it. Writers never wait for it and it takes no lock
//! of theirs; it costs a second copy of the write models while it runs.
//!
//! **Layout.** `SNAPSHOT_MAGIC`, the format (u32 BE), then one CBOR value (`ciborium`)
//! in the store's snapshot slot ([`crate::JournalStore::save_snapshot`]), written
//! durably. Each room stores its PDUs once (event id and canonical JSON, parsed back on
//! load) and refers to them by index: the current state, the auth history and the fork
//! window's states (each as its difference from the previous window event's state, so
//! 512 window states of a 10,000-member room cost a few entries each, and loading
//! rebuilds them with the same structural sharing they had in memory). Event-id digests
//! are packed 8 bytes each. Transaction ids are not in it: they live in the store's
//! index ([`crate::txn`]).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use ruma::{OwnedEventId, OwnedRoomId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use spindle_core::pdu::Pdu;

use crate::{
    ChainHead, JournalStats, KeyModels, RoomAggregate,
    fork::{ForkWindow, Slot, StateMap},
    store::JournalStore,
};

/// Version of the snapshot layout. Bump it when a snapshotted model changes shape (a
/// field added to [`RoomAggregate`], ...): older snapshots are then ignored. Format 1
/// (before the fork window, without the magic prefix) is never read.
/// Format 2 held every transaction id (memory and start-up time grew with history);
/// format 3 holds none ([`crate::txn`]); format 4 adds each room's partial-state
/// marker (MSC3902).
pub const SNAPSHOT_FORMAT: u32 = 4;

/// The first bytes of every snapshot (followed by [`SNAPSHOT_FORMAT`], u32 BE).
const SNAPSHOT_MAGIC: &[u8; 8] = b"spndlsnp";

/// Default of [`crate::JournalOptions::snapshot_every_records`].
pub const DEFAULT_SNAPSHOT_EVERY_RECORDS: u64 = 100_000;

/// Every write model [`crate::Journal`] restores at open.
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct WriteModels {
    #[serde(with = "rooms")]
    pub(crate) rooms: HashMap<OwnedRoomId, RoomAggregate>,
    pub(crate) users: HashSet<String>,
    pub(crate) aliases: HashMap<String, String>,
    pub(crate) spent_refresh_tokens: HashSet<String>,
    pub(crate) deactivated: HashSet<String>,
    pub(crate) keys: KeyModels,
    pub(crate) media: HashMap<String, (String, bool)>,
    /// Transaction-index entries ([`crate::txn`]) of the records replayed, not yet
    /// written to the store; collected only when `index_txns` is set (start-up).
    #[serde(skip)]
    pub(crate) txn_index: Vec<(Vec<u8>, u64)>,
    /// Whether replay collects `txn_index`.
    #[serde(skip)]
    pub(crate) index_txns: bool,
}

#[derive(Deserialize)]
struct Snapshot {
    /// The checkpoint: the last record the models include, and its hash.
    position: u64,
    hash: [u8; 32],
    /// The fork-window size the rooms were restored with.
    fork_window: usize,
    models: WriteModels,
}

/// Borrowed form of [`Snapshot`] for writing without copying the models.
#[derive(Serialize)]
struct SnapshotRef<'a> {
    position: u64,
    hash: [u8; 32],
    fork_window: usize,
    models: &'a WriteModels,
}

/// Logs at info (start-up) or debug (background snapshots).
macro_rules! note {
    ($loud:expr, $($arg:tt)*) => {
        if $loud { tracing::info!($($arg)*) } else { tracing::debug!($($arg)*) }
    };
}

/// Warns (start-up) or logs at debug (background snapshots).
macro_rules! caution {
    ($loud:expr, $($arg:tt)*) => {
        if $loud { tracing::warn!($($arg)*) } else { tracing::debug!($($arg)*) }
    };
}

/// The models and checkpoint of the stored snapshot, if there is one this release can
/// use with a fork window of `fork_window` (see the module doc); `None` means "replay
/// from position 0". `loud`: log what happened at info/warn (start-up).
pub(crate) fn load(
    store: &dyn JournalStore,
    fork_window: usize,
    loud: bool,
) -> Option<(WriteModels, ChainHead)> {
    let read_started = std::time::Instant::now();
    let bytes = match store.load_snapshot() {
        Ok(Some(b)) => b,
        Ok(None) => return None,
        Err(e) => {
            caution!(loud, error = %e, "journal: cannot read the write-model snapshot; replaying the whole journal");
            return None;
        }
    };
    let started = std::time::Instant::now();
    let Some(body) = bytes.strip_prefix(SNAPSHOT_MAGIC.as_slice()) else {
        caution!(
            loud,
            "journal: ignoring a write-model snapshot of an older format; replaying the whole journal"
        );
        return None;
    };
    let format = body
        .get(..4)
        .map(|f| u32::from_be_bytes(f.try_into().expect("4 bytes")));
    if format != Some(SNAPSHOT_FORMAT) {
        caution!(
            loud,
            found = ?format,
            expected = SNAPSHOT_FORMAT,
            "journal: ignoring a write-model snapshot of another format; replaying the whole journal"
        );
        return None;
    }
    let snap: Snapshot = match ciborium::from_reader(&body[4..]) {
        Ok(s) => s,
        Err(e) => {
            caution!(loud, error = %e, "journal: the write-model snapshot does not decode; replaying the whole journal");
            return None;
        }
    };
    if snap.fork_window != fork_window {
        caution!(
            loud,
            snapshot = snap.fork_window,
            configured = fork_window,
            "journal: the write-model snapshot has another fork-window size; replaying the whole journal"
        );
        return None;
    }
    // The checkpoint must name a record this journal has, with that hash.
    let at = match store.read_raw_after(snap.position.saturating_sub(1), 1) {
        Ok(v) => v.into_iter().next(),
        Err(_) => None,
    };
    let matches = snap.position > 0
        && at.is_some_and(|(p, b)| p == snap.position && crate::record_hash(&b) == snap.hash);
    if !matches {
        caution!(
            loud,
            position = snap.position,
            "journal: the write-model snapshot does not match the journal (restored or truncated?); replaying the whole journal"
        );
        return None;
    }
    note!(
        loud,
        position = snap.position,
        rooms = snap.models.rooms.len(),
        bytes = bytes.len(),
        read_ms = started.duration_since(read_started).as_millis() as u64,
        decode_ms = started.elapsed().as_millis() as u64,
        "journal: write models restored from the snapshot"
    );
    Some((
        snap.models,
        ChainHead {
            position: snap.position,
            hash: snap.hash,
        },
    ))
}

/// Writes a snapshot of `models` as of `head` (durably, replacing the previous one).
/// Returns its size in bytes.
pub(crate) fn save(
    store: &dyn JournalStore,
    models: &WriteModels,
    head: ChainHead,
    fork_window: usize,
) -> Result<usize, String> {
    let mut bytes = Vec::with_capacity(1 << 16);
    bytes.extend_from_slice(SNAPSHOT_MAGIC);
    bytes.extend_from_slice(&SNAPSHOT_FORMAT.to_be_bytes());
    ciborium::into_writer(
        &SnapshotRef {
            position: head.position,
            hash: head.hash,
            fork_window,
            models,
        },
        &mut bytes,
    )
    .map_err(|e| e.to_string())?;
    store.save_snapshot(&bytes)?;
    Ok(bytes.len())
}

/// Brings the stored snapshot up to `target` (a durable head): loads it, replays the
/// records after it up to `target` and saves the result. Returns the records replayed
/// and the snapshot's size, or `None` when the stored one is already at `target`.
pub(crate) fn refresh(
    store: &dyn JournalStore,
    fork_window: usize,
    target: ChainHead,
) -> Result<Option<(u64, usize)>, String> {
    let (mut models, start) = load(store, fork_window, false)
        .unwrap_or_else(|| (WriteModels::default(), ChainHead::GENESIS));
    if start.position >= target.position {
        return Ok(None);
    }
    // Fork counters of this replay were already counted when the records were appended.
    let stats = JournalStats::default();
    let mut progress = Progress::new("snapshot", target.position - start.position, false);
    let head = crate::replay_into(
        store,
        &mut models,
        start,
        target.position,
        fork_window,
        &stats,
        &mut progress,
    )
    .map_err(|b| b.to_string())?;
    if head != target {
        return Err(format!(
            "replay ended at {} instead of the durable head {}",
            head.position, target.position
        ));
    }
    let bytes = save(store, &models, head, fork_window)?;
    Ok(Some((progress.done(), bytes)))
}

/// The appender's side of background snapshots (module doc, "When").
pub(crate) struct Background {
    every: u64,
    /// Position of the last snapshot taken or started.
    last: u64,
    fork_window: usize,
    running: Arc<AtomicBool>,
}

impl Background {
    /// `every` records between snapshots (0: never); `last`: the stored snapshot's
    /// position.
    pub(crate) fn new(every: u64, last: u64, fork_window: usize) -> Background {
        Background {
            every,
            last,
            fork_window,
            running: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Called by the appender after each durable batch ending at `head`: starts a
    /// background snapshot when one is due and none is running.
    pub(crate) fn after_append(
        &mut self,
        store: &Arc<dyn JournalStore>,
        stats: &Arc<JournalStats>,
        head: ChainHead,
    ) {
        if self.every == 0
            || head.position < self.last.saturating_add(self.every)
            || self.running.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.last = head.position;
        let (store, stats, running, cap) = (
            store.clone(),
            stats.clone(),
            self.running.clone(),
            self.fork_window,
        );
        let spawned = std::thread::Builder::new()
            .name("journal-snapshot".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                match refresh(&*store, cap, head) {
                    Ok(Some((replayed, bytes))) => {
                        stats.snapshots_saved.fetch_add(1, Ordering::Relaxed);
                        stats.note_snapshot(head.position, bytes, started.elapsed());
                        tracing::info!(
                            position = head.position,
                            replayed,
                            bytes,
                            ms = started.elapsed().as_millis() as u64,
                            "journal: write-model snapshot saved"
                        );
                    }
                    Ok(None) => {}
                    Err(e) => {
                        stats.snapshots_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %e, "journal: background write-model snapshot failed")
                    }
                }
                running.store(false, Ordering::Release);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "journal: cannot start the snapshot thread");
            self.running.store(false, Ordering::Release);
        }
    }
}

/// A byte string (CBOR major type 2) rather than an array of integers.
struct BytesRef<'a>(&'a [u8]);

impl Serialize for BytesRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

/// The owned form of [`BytesRef`].
struct Bytes(Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes(v.to_vec()))
            }
            fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}

/// A set of 64-bit digests packed little-endian, 8 bytes each.
fn pack(set: &HashSet<u64>) -> Bytes {
    let mut out = Vec::with_capacity(set.len() * 8);
    for d in set {
        out.extend_from_slice(&d.to_le_bytes());
    }
    Bytes(out)
}

fn unpack(b: &Bytes) -> Result<HashSet<u64>, String> {
    if !b.0.len().is_multiple_of(8) {
        return Err("digest set length is not a multiple of 8".into());
    }
    let mut set = HashSet::with_capacity(b.0.len() / 8);
    set.extend(
        b.0.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
    );
    Ok(set)
}

/// One window event: its id, the event its slot held before it, and its state after
/// as the difference from the previous window event's (the first: from empty).
#[derive(Serialize)]
struct WindowEventOut<'a> {
    event_id: &'a OwnedEventId,
    replaced: Option<&'a OwnedEventId>,
    set: Vec<u32>,
    removed: Vec<Slot>,
}

#[derive(Deserialize)]
struct WindowEventIn {
    event_id: OwnedEventId,
    replaced: Option<OwnedEventId>,
    set: Vec<u32>,
    removed: Vec<Slot>,
}

/// A room aggregate as written (see the module doc, "Layout").
#[derive(Serialize)]
struct RoomOut<'a> {
    version: &'a str,
    extremities: &'a [(OwnedEventId, u64)],
    max_depth: u64,
    hashed_refs: bool,
    extremity_hashes: Vec<(&'a OwnedEventId, &'a String)>,
    /// Every PDU below, once: (event id, canonical JSON).
    pdus: Vec<(&'a str, BytesRef<'a>)>,
    /// The current state, as indices into `pdus` (each PDU's slot is its own type and
    /// state key).
    state: Vec<u32>,
    auth_history: Vec<u32>,
    known: Bytes,
    outliers: Bytes,
    joined_servers: &'a BTreeMap<String, u32>,
    window: Option<(usize, Vec<WindowEventOut<'a>>)>,
    window_cap: usize,
    partial: Option<&'a crate::PartialState>,
}

#[derive(Deserialize)]
struct RoomIn {
    version: String,
    extremities: Vec<(OwnedEventId, u64)>,
    max_depth: u64,
    hashed_refs: bool,
    extremity_hashes: Vec<(OwnedEventId, String)>,
    pdus: Vec<(String, Bytes)>,
    state: Vec<u32>,
    auth_history: Vec<u32>,
    known: Bytes,
    outliers: Bytes,
    joined_servers: BTreeMap<String, u32>,
    window: Option<(usize, Vec<WindowEventIn>)>,
    window_cap: usize,
    partial: Option<crate::PartialState>,
}

/// Indexes PDUs for [`RoomOut::pdus`].
#[derive(Default)]
struct PduTable<'a> {
    index: HashMap<&'a str, u32>,
    pdus: Vec<(&'a str, BytesRef<'a>)>,
}

impl<'a> PduTable<'a> {
    fn of(&mut self, p: &'a Arc<Pdu>) -> u32 {
        let id = p.event_id.as_str();
        if let Some(i) = self.index.get(id) {
            return *i;
        }
        let i = u32::try_from(self.pdus.len()).expect("fewer than 2^32 PDUs in a room");
        self.pdus.push((id, BytesRef(&p.json)));
        self.index.insert(id, i);
        i
    }
}

fn room_out(agg: &RoomAggregate) -> RoomOut<'_> {
    let mut table = PduTable::default();
    let state = agg.state.values().map(|p| table.of(p)).collect();
    let auth_history = agg.auth_history.values().map(|p| table.of(p)).collect();
    let window = agg.window.as_ref().map(|w| {
        let empty = StateMap::new();
        let mut prev = &empty;
        let mut events = Vec::with_capacity(w.len());
        for (id, after, replaced) in w.entries() {
            let mut set = Vec::new();
            let mut removed = Vec::new();
            if !after.ptr_eq(prev) {
                for (slot, p) in after.iter() {
                    if prev.get(slot).is_none_or(|q| q.event_id != p.event_id) {
                        set.push(table.of(p));
                    }
                }
                removed.extend(
                    prev.keys()
                        .filter(|slot| !after.contains_key(*slot))
                        .cloned(),
                );
            }
            events.push(WindowEventOut {
                event_id: id,
                replaced,
                set,
                removed,
            });
            prev = after;
        }
        (w.cap(), events)
    });
    RoomOut {
        version: &agg.version,
        extremities: &agg.extremities,
        max_depth: agg.max_depth,
        hashed_refs: agg.hashed_refs,
        extremity_hashes: agg.extremity_hashes.iter().collect(),
        pdus: table.pdus,
        state,
        auth_history,
        known: pack(&agg.known),
        outliers: pack(&agg.outliers),
        joined_servers: &agg.joined_servers,
        window,
        window_cap: agg.window_cap,
        partial: agg.partial.as_ref(),
    }
}

fn room_in(room_id: &OwnedRoomId, r: RoomIn) -> Result<RoomAggregate, String> {
    let pdus: Vec<Arc<Pdu>> = r
        .pdus
        .into_iter()
        .map(|(id, json)| {
            let id = OwnedEventId::try_from(id).map_err(|e| e.to_string())?;
            let p = Pdu::parse(&json.0, &r.version, Some(id), Some(room_id.clone()))
                .map_err(|e| e.to_string())?;
            if p.room_id != *room_id {
                return Err(format!("{} is not an event of {room_id}", p.event_id));
            }
            Ok(Arc::new(p))
        })
        .collect::<Result<_, String>>()?;
    let pdu = |i: &u32| {
        pdus.get(*i as usize)
            .ok_or_else(|| format!("PDU index {i} out of range"))
    };
    let slot_of = |p: &Arc<Pdu>| {
        p.state_key
            .clone()
            .map(|k| (p.kind.to_string(), k))
            .ok_or_else(|| format!("{} in a state map is not a state event", p.event_id))
    };
    let mut state = StateMap::new();
    for i in &r.state {
        let p = pdu(i)?;
        state.insert(slot_of(p)?, p.clone());
    }
    let mut auth_history = HashMap::with_capacity(r.auth_history.len());
    for i in &r.auth_history {
        let p = pdu(i)?;
        auth_history.insert(p.event_id.clone(), p.clone());
    }
    let window = match r.window {
        None => None,
        Some((cap, events)) => {
            let mut prev = StateMap::new();
            let mut entries = Vec::with_capacity(events.len());
            for e in events {
                let mut after = prev.clone();
                for slot in &e.removed {
                    after.remove(slot);
                }
                for i in &e.set {
                    let p = pdu(i)?;
                    after.insert(slot_of(p)?, p.clone());
                }
                entries.push((e.event_id, after.clone(), e.replaced));
                prev = after;
            }
            Some(ForkWindow::from_entries(cap, entries)?)
        }
    };
    Ok(RoomAggregate {
        version: r.version,
        extremities: r.extremities,
        max_depth: r.max_depth,
        hashed_refs: r.hashed_refs,
        extremity_hashes: r.extremity_hashes.into_iter().collect(),
        state,
        auth_history,
        known: unpack(&r.known)?,
        outliers: unpack(&r.outliers)?,
        joined_servers: r.joined_servers,
        window,
        window_cap: r.window_cap,
        partial: r.partial,
    })
}

/// Serde for [`WriteModels::rooms`]: a sequence of (room id, [`RoomOut`]).
mod rooms {
    use super::*;

    pub(super) fn serialize<S: Serializer>(
        rooms: &HashMap<OwnedRoomId, RoomAggregate>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(rooms.iter().map(|(id, agg)| (id, room_out(agg))))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<HashMap<OwnedRoomId, RoomAggregate>, D::Error> {
        let rooms: Vec<(OwnedRoomId, RoomIn)> = Vec::deserialize(d)?;
        rooms
            .into_iter()
            .map(|(id, r)| {
                let agg = room_in(&id, r)
                    .map_err(|e| serde::de::Error::custom(format!("room {id}: {e}")))?;
                Ok((id, agg))
            })
            .collect()
    }
}

/// The uniqueness sets of the write models, borrowed (for [`digest`]).
pub(crate) struct Sets<'a> {
    pub(crate) users: &'a HashSet<String>,
    pub(crate) aliases: &'a HashMap<String, String>,
    pub(crate) spent_refresh_tokens: &'a HashSet<String>,
    pub(crate) deactivated: &'a HashSet<String>,
    pub(crate) keys: &'a KeyModels,
    pub(crate) media: &'a HashMap<String, (String, bool)>,
}

/// A digest of every write model, independent of map order: equal digests mean equal
/// models (rooms with their state, auth history, event-id and outlier digests,
/// joined servers and fork window, each window event's state
/// included; then the uniqueness sets). What tests compare between a journal restored
/// from a snapshot and one replayed from position 0.
pub(crate) fn digest(mut rooms: Vec<(&OwnedRoomId, &RoomAggregate)>, sets: Sets<'_>) -> String {
    fn state_lines(s: &StateMap) -> Vec<String> {
        let mut v: Vec<String> = s
            .iter()
            .map(|((t, k), p)| format!("{t}\u{0}{k}\u{0}{}", p.event_id))
            .collect();
        v.sort();
        v
    }
    fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
        v.sort();
        v
    }
    let mut h = blake3::Hasher::new();
    let mut put = |s: &str| {
        h.update(&(s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    };
    rooms.sort_by(|a, b| a.0.cmp(b.0));
    for (id, a) in rooms {
        put(&format!(
            "room {id} {} {:?} {} {} {:?} cap {}",
            a.version,
            a.extremities,
            a.max_depth,
            a.hashed_refs,
            {
                let mut h: Vec<_> = a.extremity_hashes.iter().collect();
                h.sort();
                h
            },
            a.window_cap
        ));
        for l in state_lines(&a.state) {
            put(&l);
        }
        put(&format!(
            "auth {:?}",
            sorted(a.auth_history.keys().collect())
        ));
        put(&format!("known {:?}", sorted(a.known.iter().collect())));
        put(&format!(
            "outliers {:?}",
            sorted(a.outliers.iter().collect())
        ));
        put(&format!("servers {:?}", a.joined_servers));
        if let Some(p) = &a.partial {
            put(&format!(
                "partial {} {:?}",
                p.join_event_id, p.servers_in_room
            ));
        }
        if let Some(w) = &a.window {
            put(&format!("window {} {}", w.cap(), w.len()));
            for (id, after, replaced) in w.entries() {
                put(&format!("{id} {replaced:?}"));
                for l in state_lines(after) {
                    put(&l);
                }
            }
        }
    }
    put(&format!("users {:?}", sorted(sets.users.iter().collect())));
    put(&format!(
        "aliases {:?}",
        sorted(sets.aliases.iter().collect())
    ));
    put(&format!(
        "spent {:?}",
        sorted(sets.spent_refresh_tokens.iter().collect())
    ));
    put(&format!(
        "deactivated {:?}",
        sorted(sets.deactivated.iter().collect())
    ));
    let mut keys: Vec<_> = sets.keys.iter().collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (dev, m) in keys {
        put(&format!(
            "keys {dev:?} {:?} {:?}",
            sorted(m.one_time.iter().collect()),
            sorted(m.fallback.iter().collect())
        ));
    }
    put(&format!("media {:?}", sorted(sets.media.iter().collect())));
    h.finalize().to_hex().to_string()
}

/// Logs restore progress at most once a second once it has run longer than a second:
/// records done / total, and the rate.
pub(crate) struct Progress {
    what: &'static str,
    total: u64,
    done: u64,
    loud: bool,
    started: std::time::Instant,
    last_log: std::time::Instant,
}

impl Progress {
    /// `loud`: progress at info (start-up); otherwise at debug.
    pub(crate) fn new(what: &'static str, total: u64, loud: bool) -> Progress {
        let now = std::time::Instant::now();
        Progress {
            what,
            total,
            done: 0,
            loud,
            started: now,
            last_log: now,
        }
    }

    /// One more record done.
    pub(crate) fn tick(&mut self) {
        self.done += 1;
        if !self.done.is_multiple_of(1024) {
            return;
        }
        let now = std::time::Instant::now();
        if now.duration_since(self.last_log).as_secs() >= 1 {
            self.last_log = now;
            let secs = now.duration_since(self.started).as_secs_f64().max(1e-9);
            note!(
                self.loud,
                done = self.done,
                total = self.total,
                records_per_s = (self.done as f64 / secs) as u64,
                "journal: {}: {} / {} records ({:.0} records/s)",
                self.what,
                self.done,
                self.total,
                self.done as f64 / secs
            );
        }
    }

    /// Records done.
    pub(crate) fn done(&self) -> u64 {
        self.done
    }

    /// Logs the total once, if the step took longer than a second.
    pub(crate) fn finish(&self) {
        let secs = self.started.elapsed().as_secs_f64();
        if secs >= 1.0 {
            note!(
                self.loud,
                done = self.done,
                ms = (secs * 1000.0) as u64,
                "journal: {}: done, {} records in {:.1} s",
                self.what,
                self.done,
                secs
            );
        }
    }
}
