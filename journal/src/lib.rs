//! The journal: Spindle's only writer (BRIEF §2).
//!
//! It accepts [`SignedCommand`]s, verifies their signature, authorizes room events
//! against each room's own write model (the aggregate: auth-relevant state and head),
//! builds the PDU (exactly one `prev_event`, the room head), and appends records
//! durably. Appends from all rooms go through one group-commit appender that batches
//! whatever is queued into one write and one fsync; no lock is held across an fsync.
//!
//! Positions: every record has a global position (1, 2, 3, ...). Positions are
//! allocated and enqueued under a short critical section so the appender always writes
//! them in order; [`Journal::durable_head`] is published (watch channel) only after the
//! fsync that covers it, and readers never see past it.

pub mod blobs;
pub mod chain;
mod cluster;
pub mod command;
pub mod consumer;
pub mod copy;
pub mod fork;
mod head;
pub mod migrate;
pub mod nats;
pub mod record;
pub mod remote;
pub mod snapshot;
pub mod store;
pub mod txn;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use ruma::{OwnedEventId, OwnedRoomId, OwnedUserId};
use spindle_core::{
    keys::ServerKey,
    pdu::{Pdu, PduError, PduTemplate},
    room_version,
};
use tokio::sync::watch;

pub use chain::{BreakKind, ChainBreak, ChainHead};
pub use cluster::{EPHEMERAL_QUEUE, EphemeralChannel};
pub use command::{
    CommandBody, CommandEnvelope, EventSpec, KeyClaimRequest, MembershipPrecondition, SignedCommand,
};
pub use head::{Heads, Interest};
pub use nats::{NatsOptions, NatsStore};
pub use record::{
    Fact, GENESIS_HASH, KeyClaim, RECORD_FORMAT, Record, RecordKind, RemoteDevice,
    RemoteDeviceUpdate, RemoteSigningKeys, SignatureAdded, StoredRecord, record_hash,
};
pub use store::{EncodedRecord, FjallStore, JournalStore, StorageMemory, StorageUse};

/// Why a command was refused. Each maps to one Matrix error in the API.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The auth rules (or a journal-level rule) forbid it: `M_FORBIDDEN`.
    #[error("{0}")]
    Forbidden(String),
    /// The target's membership does not allow the change (a precondition failed):
    /// 403 `M_BAD_STATE`.
    #[error("{0}")]
    BadState(String),
    /// The room does not exist here: `M_NOT_FOUND`.
    #[error("unknown room {0}")]
    UnknownRoom(String),
    /// The user id is taken: `M_USER_IN_USE`.
    #[error("user id already taken")]
    UserInUse,
    /// The room alias is taken: `M_ROOM_IN_USE` (createRoom) or 409 (directory).
    #[error("room alias already taken")]
    AliasInUse,
    /// The event exceeds 65536 bytes: `M_TOO_LARGE`.
    #[error("{0}")]
    TooLarge(String),
    /// Malformed content or ids: `M_BAD_JSON`.
    #[error("{0}")]
    BadJson(String),
    /// Unsupported room version: `M_UNSUPPORTED_ROOM_VERSION`.
    #[error("unsupported room version {0}")]
    UnsupportedRoomVersion(String),
    /// The command signature did not verify (a bug or tampering, never client input).
    #[error("command signature invalid")]
    BadSignature,
    /// Storage failure.
    #[error("storage: {0}")]
    Storage(String),
    /// A remote PDU names `prev_events` this server does not have yet (fetch them
    /// first with `/get_missing_events`).
    #[error("{0}")]
    MissingPrevEvents(String),
    /// The media id already has content: 409 `M_CANNOT_OVERWRITE_MEDIA`.
    #[error("media {0} has already been uploaded")]
    MediaExists(String),
    /// A shared journal's writer did not answer in time (an election under way, NATS
    /// unreachable; [`nats`]): 503, the client may retry (with its transaction id).
    #[error("{0}")]
    Unavailable(String),
}

impl From<PduError> for JournalError {
    fn from(e: PduError) -> Self {
        match e {
            PduError::TooLarge(_) => JournalError::TooLarge(e.to_string()),
            PduError::UnsupportedRoomVersion(v) => JournalError::UnsupportedRoomVersion(v),
            PduError::Invalid(m) => JournalError::BadJson(m),
        }
    }
}

/// What a successful command produced.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Outcome {
    /// Position of the last record written (wait for projections to reach it to read
    /// your own write).
    pub position: u64,
    /// Room of the events, if any.
    pub room_id: Option<OwnedRoomId>,
    /// Ids of the events built, in order.
    pub event_ids: Vec<OwnedEventId>,
    /// Keys handed out by [`CommandBody::ClaimOneTimeKeys`], with their content.
    pub claimed: Vec<ClaimedKey>,
}

/// A key handed out by a claim, with the key object as its device uploaded it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedKey {
    /// Which key.
    pub claim: KeyClaim,
    /// The signed key object.
    pub key: serde_json::Value,
}

/// The journal's write model of one device's claimable keys: key id -> position of
/// the record that uploaded it (the content stays in that record; claims read it back).
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct DeviceKeyModel {
    /// algorithm -> (`"<algorithm>:<id>"` -> upload position), unclaimed one-time keys.
    one_time: HashMap<String, std::collections::BTreeMap<String, u64>>,
    /// algorithm -> (`"<algorithm>:<id>"`, upload position) of the fallback key.
    fallback: HashMap<String, (String, u64)>,
}

/// Device key write models by (user, device).
type KeyModels = HashMap<(String, String), DeviceKeyModel>;

fn algorithm_of(key_id: &str) -> &str {
    key_id.split_once(':').map(|(a, _)| a).unwrap_or(key_id)
}

/// Applies a key-related fact to the write model (restore and append share it).
fn apply_key_fact(models: &mut KeyModels, fact: &Fact, position: u64) {
    match fact {
        Fact::OneTimeKeysUploaded {
            user_id,
            device_id,
            one_time_keys,
        } => {
            let m = models
                .entry((user_id.clone(), device_id.clone()))
                .or_default();
            for id in one_time_keys.keys() {
                m.one_time
                    .entry(algorithm_of(id).to_owned())
                    .or_default()
                    .entry(id.clone())
                    .or_insert(position);
            }
        }
        Fact::FallbackKeysUploaded {
            user_id,
            device_id,
            fallback_keys,
        } => {
            let m = models
                .entry((user_id.clone(), device_id.clone()))
                .or_default();
            for id in fallback_keys.keys() {
                m.fallback
                    .insert(algorithm_of(id).to_owned(), (id.clone(), position));
            }
        }
        Fact::OneTimeKeysClaimed { claims } => {
            for c in claims.iter().filter(|c| !c.fallback) {
                if let Some(m) = models.get_mut(&(c.user_id.clone(), c.device_id.clone()))
                    && let Some(keys) = m.one_time.get_mut(algorithm_of(&c.key_id))
                {
                    keys.remove(&c.key_id);
                }
            }
        }
        Fact::DeviceDeleted { user_id, device_id } => {
            models.remove(&(user_id.clone(), device_id.clone()));
        }
        _ => {}
    }
}

/// Event types the aggregate keeps: what the auth rules can look up.
const AUTH_TYPES: [&str; 5] = [
    "m.room.create",
    "m.room.power_levels",
    "m.room.join_rules",
    "m.room.member",
    "m.room.third_party_invite",
];

/// Most `prev_events` a local event names (spec: at most 20 in every room version;
/// Synapse uses 10). Only a room that federates with a DAG peer ever has more than one
/// forward extremity.
pub const MAX_PREV_EVENTS: usize = 10;

/// The journal's per-room write model: forward extremities, the current state and what
/// authorizing events needs. Restored at start-up from the last snapshot ([`snapshot`])
/// and the room's records after it. Snapshots store every field: a field added here
/// goes into [`snapshot`]'s room layout and bumps [`snapshot::SNAPSHOT_FORMAT`] (older
/// snapshots are then ignored, not misread).
struct RoomAggregate {
    version: String,
    /// Forward extremities (events no other event of the room names in `prev_events`),
    /// with their depth, oldest first. A room whose events all come through this server
    /// is a chain: exactly one extremity, the head (BRIEF §3.8).
    extremities: Vec<(OwnedEventId, u64)>,
    /// Highest depth seen in the room.
    max_depth: u64,
    /// Whether the version's references carry hashes (v1/v2).
    hashed_refs: bool,
    /// The reference hash of each forward extremity, kept only when `hashed_refs`
    /// (the next local event's `prev_events` pair each id with it); empty elsewhere.
    extremity_hashes: HashMap<OwnedEventId, String>,
    /// The current state, every slot: what auth rules read and what state resolution
    /// starts from. The resolution of the states after the forward extremities (one
    /// extremity: the state after it).
    state: fork::StateMap,
    /// Every auth-relevant state event the room ever had, by id: a remote PDU's
    /// `auth_events` may name a power levels or member event that is no longer current.
    auth_history: HashMap<OwnedEventId, Arc<Pdu>>,
    /// 64-bit digests of every event id in the room: remote duplicates are recognised
    /// and `prev_events` checked without reading the log (8 bytes per event).
    known: HashSet<u64>,
    /// Digests of the ids in [`RoomAggregate::known`] held only as outliers (imported
    /// state, not yet in the timeline): backfill may still bring them into it.
    outliers: HashSet<u64>,
    /// Server name -> number of its users joined now: whom the federation sender
    /// delivers the room's events to, without reading a member list.
    joined_servers: std::collections::BTreeMap<String, u32>,
    /// The fork window ([`fork`]): kept only while another server has a user joined
    /// (a local-only room is a chain and needs none).
    window: Option<fork::ForkWindow>,
    /// Size of [`RoomAggregate::window`] when one is opened.
    window_cap: usize,
    /// Set while the room's state here is partial ([`Fact::RoomStatePartial`] until
    /// [`Fact::RoomStateCompleted`]).
    partial: Option<PartialState>,
}

/// What the journal keeps of a partial-state room (MSC3902): our join and the servers
/// the resident named in its `send_join` answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PartialState {
    pub(crate) join_event_id: OwnedEventId,
    pub(crate) servers_in_room: Vec<String>,
}

/// The digest [`RoomAggregate::known`] keeps of an event id.
fn id_digest(event_id: &str) -> u64 {
    let h = blake3::hash(event_id.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

fn is_join(p: Option<&Arc<Pdu>>) -> bool {
    p.is_some_and(|p| {
        p.kind.to_string() == "m.room.member"
            && p.content_value().get("membership").and_then(|m| m.as_str()) == Some("join")
    })
}

impl RoomAggregate {
    fn new(version: &str, window_cap: usize) -> Self {
        Self {
            version: version.to_owned(),
            extremities: Vec::new(),
            max_depth: 0,
            hashed_refs: room_version::rules(version)
                .is_some_and(|r| room_version::references_carry_hashes(&r)),
            extremity_hashes: HashMap::new(),
            state: fork::StateMap::new(),
            auth_history: HashMap::new(),
            known: HashSet::new(),
            outliers: HashSet::new(),
            joined_servers: std::collections::BTreeMap::new(),
            window: None,
            window_cap,
            partial: None,
        }
    }

    /// The servers this room's events go to: those with a member joined here, and
    /// while the state is partial the servers the resident named as well.
    fn destinations(&self) -> Vec<String> {
        let mut out: Vec<String> = self.joined_servers.keys().cloned().collect();
        if let Some(p) = &self.partial {
            for s in &p.servers_in_room {
                if !self.joined_servers.contains_key(s) {
                    out.push(s.clone());
                }
            }
            out.sort();
        }
        out
    }

    /// Makes `pdu` the current value of its state slot, keeping
    /// [`RoomAggregate::joined_servers`] and the auth history right.
    fn set_state(&mut self, pdu: Arc<Pdu>) {
        let Some(sk) = pdu.state_key.clone() else {
            return;
        };
        let kind = pdu.kind.to_string();
        if kind == "m.room.member"
            && let Some((_, server)) = sk.split_once(':')
        {
            let slot = (kind.clone(), sk.clone());
            match (is_join(self.state.get(&slot)), is_join(Some(&pdu))) {
                (false, true) => *self.joined_servers.entry(server.to_owned()).or_insert(0) += 1,
                (true, false) => {
                    if let Some(n) = self.joined_servers.get_mut(server) {
                        *n -= 1;
                        if *n == 0 {
                            self.joined_servers.remove(server);
                        }
                    }
                }
                _ => {}
            }
        }
        if AUTH_TYPES.contains(&kind.as_str()) {
            self.auth_history.insert(pdu.event_id.clone(), pdu.clone());
        }
        self.state.insert((kind, sk), pdu);
    }

    fn knows(&self, event_id: &str) -> bool {
        self.known.contains(&id_digest(event_id))
    }

    /// Whether an event with these `prev_events` extends the room without forking it:
    /// it names exactly the forward extremities.
    fn extends_extremities(&self, prev_events: &[OwnedEventId]) -> bool {
        self.extremities.is_empty()
            || (prev_events.len() == self.extremities.len()
                && self
                    .extremities
                    .iter()
                    .all(|(id, _)| prev_events.contains(id)))
    }

    /// Every event resolution may need: the auth history plus the events of `states`.
    fn pool(&self, states: &[&fork::StateMap]) -> fork::Pool {
        let mut pool = self.auth_history.clone();
        for s in states {
            for p in s.values() {
                pool.entry(p.event_id.clone()).or_insert_with(|| p.clone());
            }
        }
        pool
    }

    /// The room state before an event with these `prev_events` ([`fork`] module docs):
    /// the current state unless the event forks the room.
    fn state_before(&self, prev_events: &[OwnedEventId], stats: &JournalStats) -> fork::StateMap {
        if self.extends_extremities(prev_events) {
            return self.state.clone();
        }
        let Some(window) = &self.window else {
            return self.state.clone();
        };
        let found: Vec<&fork::StateMap> = prev_events
            .iter()
            .filter_map(|p| window.state_after(p))
            .collect();
        if found.len() < prev_events.len() {
            stats.forks_beyond_window.fetch_add(1, Ordering::Relaxed);
        }
        if found.is_empty() {
            return self.state.clone();
        }
        self.resolve(&found, stats)
            .unwrap_or_else(|| found[0].clone())
    }

    fn resolve(&self, states: &[&fork::StateMap], stats: &JournalStats) -> Option<fork::StateMap> {
        let pool = self.pool(states);
        match fork::resolve(&self.version, states, self.window.as_ref(), &pool) {
            Ok((s, case)) => {
                let counter = match case {
                    fork::ForkCase::Linear => &stats.forks_linear,
                    fork::ForkCase::Merged => &stats.forks_merged,
                    fork::ForkCase::Resolved => &stats.forks_resolved,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Some(s)
            }
            Err(e) => {
                tracing::warn!(room_version = %self.version, error = %e, "state resolution failed; keeping the log order");
                stats.forks_failed.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Appends a room event to the write model with the state before it (from
    /// [`RoomAggregate::state_before`]). Returns the state events that resolution made
    /// current again after it (besides the event itself): each becomes a
    /// [`RecordKind::StateResolved`] record right after the event's, so the projections,
    /// which apply records in log order, end on the same current state.
    fn apply_with(
        &mut self,
        pdu: Arc<Pdu>,
        before: fork::StateMap,
        stats: &JournalStats,
    ) -> Vec<Arc<Pdu>> {
        let extends = self.extends_extremities(&pdu.prev_events);
        let digest = id_digest(pdu.event_id.as_str());
        self.known.insert(digest);
        self.outliers.remove(&digest);
        self.extremities
            .retain(|(id, _)| !pdu.prev_events.contains(id));
        self.extremities.push((pdu.event_id.clone(), pdu.depth));
        self.max_depth = self.max_depth.max(pdu.depth);
        if self.hashed_refs {
            self.extremity_hashes
                .retain(|id, _| !pdu.prev_events.contains(id));
            if let Ok(hash) = pdu.reference_hash() {
                self.extremity_hashes.insert(pdu.event_id.clone(), hash);
            }
        }
        if self.window.is_none() && self.joined_servers.len() > 1 {
            self.window = Some(fork::ForkWindow::new(self.window_cap));
        }
        let mut reasserted = Vec::new();
        match self.window.as_mut() {
            None => self.set_state(pdu),
            Some(window) => {
                window.push(&pdu, &before);
                if extends {
                    self.set_state(pdu);
                } else {
                    // The current state is the resolution of the states after the
                    // extremities; projections apply the event itself in log order, then
                    // whatever resolution put back.
                    let window = self.window.as_ref().expect("window");
                    let states: Vec<&fork::StateMap> = self
                        .extremities
                        .iter()
                        .filter_map(|(id, _)| window.state_after(id))
                        .collect();
                    let resolved = self.resolve(&states, stats);
                    self.set_state(pdu);
                    if let Some(resolved) = resolved {
                        let mut changes: Vec<Arc<Pdu>> = resolved
                            .iter()
                            .filter(|(slot, p)| {
                                self.state
                                    .get(*slot)
                                    .is_none_or(|c| c.event_id != p.event_id)
                            })
                            .map(|(_, p)| p.clone())
                            .collect();
                        changes.sort_by(|a, b| a.event_id.cmp(&b.event_id));
                        for p in changes {
                            self.set_state(p.clone());
                            reasserted.push(p);
                        }
                    }
                }
            }
        }
        if self.joined_servers.len() <= 1 {
            self.window = None;
        }
        reasserted
    }

    /// The state a forking remote event is soft-fail checked against (spec: "Soft
    /// failure"; as Synapse does it): the resolution of the room's current state with
    /// the state before the event. `None` when the event extends the forward
    /// extremities (the state before it is the current state) or resolution fails.
    fn soft_fail_state(
        &self,
        prev_events: &[OwnedEventId],
        before: &fork::StateMap,
    ) -> Option<fork::StateMap> {
        if self.extends_extremities(prev_events) {
            return None;
        }
        let states = [&self.state, before];
        let pool = self.pool(&states);
        fork::resolve(&self.version, &states, self.window.as_ref(), &pool)
            .ok()
            .map(|(s, _)| s)
    }

    /// A soft-failed remote event ([`RecordKind::SoftFailed`]): known (a retry is a
    /// duplicate, later events may name it) and in the fork window with the state
    /// before it, but no forward extremity and no change to the current state.
    fn apply_soft_failed(&mut self, pdu: Arc<Pdu>, before: &fork::StateMap) {
        self.known.insert(id_digest(pdu.event_id.as_str()));
        self.max_depth = self.max_depth.max(pdu.depth);
        if let Some(window) = self.window.as_mut() {
            window.push(&pdu, before);
        }
    }

    /// [`RoomAggregate::apply_with`] with the state before computed here: how records
    /// replay at start-up and how local events (which never fork) are applied.
    fn apply(&mut self, pdu: Arc<Pdu>, stats: &JournalStats) -> Vec<Arc<Pdu>> {
        let before = self.state_before(&pdu.prev_events, stats);
        self.apply_with(pdu, before, stats)
    }

    /// An outlier (imported state or auth event): known and, if a state event, part of
    /// the current state; never a forward extremity.
    fn apply_outlier(&mut self, pdu: Arc<Pdu>) {
        let digest = id_digest(pdu.event_id.as_str());
        if self.known.insert(digest) {
            self.outliers.insert(digest);
        }
        self.max_depth = self.max_depth.max(pdu.depth);
        self.set_state(pdu);
    }

    /// Whether the room's timeline holds the event (not only as an outlier).
    fn in_timeline(&self, event_id: &str) -> bool {
        let digest = id_digest(event_id);
        self.known.contains(&digest) && !self.outliers.contains(&digest)
    }

    /// Backfilled history: in the timeline from now on; no state, extremity or depth
    /// changes (it is older than everything here). Auth events join the auth history
    /// (older events may name them).
    fn apply_backfilled(&mut self, pdu: Arc<Pdu>) {
        let digest = id_digest(pdu.event_id.as_str());
        self.known.insert(digest);
        self.outliers.remove(&digest);
        if let Some(_sk) = &pdu.state_key
            && AUTH_TYPES.contains(&pdu.kind.to_string().as_str())
        {
            self.auth_history.insert(pdu.event_id.clone(), pdu);
        }
    }

    /// The `prev_events` and depth of the next local event: every forward extremity
    /// (at most [`MAX_PREV_EVENTS`], the deepest), depth one more than the deepest.
    fn next_prev_events(&self) -> (Vec<OwnedEventId>, u64) {
        if self.extremities.is_empty() {
            return (Vec::new(), 1);
        }
        let mut ext = self.extremities.clone();
        ext.sort_by_key(|e| std::cmp::Reverse(e.1));
        ext.truncate(MAX_PREV_EVENTS);
        let depth = ext.iter().map(|(_, d)| *d).max().unwrap_or(0) + 1;
        (ext.into_iter().map(|(id, _)| id).collect(), depth)
    }
}

/// Replays the records after `start` (up to `end` included, or to the last) into
/// `models`, verifying the chain from `start`: how [`Journal::open`] restores the write
/// models and how a background snapshot brings the last one up to date. Returns the
/// head of the verified chain or the first break (`models` then hold every record
/// before it).
pub(crate) fn replay_into(
    store: &dyn JournalStore,
    models: &mut snapshot::WriteModels,
    start: ChainHead,
    end: u64,
    cap: usize,
    stats: &JournalStats,
    progress: &mut snapshot::Progress,
) -> Result<ChainHead, ChainBreak> {
    chain::walk_from(store, start, end, |rec| {
        progress.tick();
        if rec.is_outlier() {
            let pdu = rec.room_pdu().ok_or("unreadable outlier PDU")?;
            models
                .rooms
                .entry(pdu.room_id.clone())
                .or_insert_with(|| RoomAggregate::new(&pdu.room_version, cap))
                .apply_outlier(pdu);
        } else if rec.is_backfilled() {
            let pdu = rec.any_pdu().ok_or("unreadable backfilled PDU")?;
            if let Some(agg) = models.rooms.get_mut(&pdu.room_id) {
                agg.apply_backfilled(pdu);
            }
        } else if rec.is_soft_failed() {
            let pdu = rec.any_pdu().ok_or("unreadable soft-failed PDU")?;
            if let Some(agg) = models.rooms.get_mut(&pdu.room_id) {
                let before = agg.state_before(&pdu.prev_events, stats);
                agg.apply_soft_failed(pdu, &before);
            }
        } else if rec.is_state_resolved() {
            // Replaying the event before it already resolved the same way; the
            // record is the truth if a resolver upgrade would now decide otherwise.
            let pdu = rec.room_pdu().ok_or("unreadable resolved state PDU")?;
            if let Some(agg) = models.rooms.get_mut(&pdu.room_id) {
                agg.set_state(pdu);
            }
        } else if rec.is_event() {
            let pdu = rec.pdu().ok_or("unreadable PDU")?;
            let agg = models
                .rooms
                .entry(pdu.room_id.clone())
                .or_insert_with(|| RoomAggregate::new(&pdu.room_version, cap));
            if models.index_txns
                && let (Some(txn), Some(dev)) = (rec.txn_id(), rec.device_id())
            {
                models.txn_index.push((
                    txn::event_key(pdu.room_id.as_str(), rec.principal(), dev, txn),
                    rec.position(),
                ));
            }
            agg.apply(pdu, stats);
        } else {
            match rec.fact() {
                Some(Fact::AccountRegistered { user_id, .. }) => {
                    models.users.insert(user_id);
                }
                Some(Fact::RoomStatePartial {
                    room_id,
                    join_event_id,
                    servers_in_room,
                }) => {
                    let room = OwnedRoomId::try_from(room_id).map_err(|_| "bad room id")?;
                    let join = OwnedEventId::try_from(join_event_id).map_err(|_| "bad event id")?;
                    if let Some(agg) = models.rooms.get_mut(&room) {
                        agg.partial = Some(PartialState {
                            join_event_id: join,
                            servers_in_room,
                        });
                    }
                }
                Some(Fact::RoomStateCompleted { room_id }) => {
                    let room = OwnedRoomId::try_from(room_id).map_err(|_| "bad room id")?;
                    if let Some(agg) = models.rooms.get_mut(&room) {
                        agg.partial = None;
                    }
                }
                Some(Fact::AliasSet { alias, room_id, .. }) => {
                    models.aliases.insert(alias, room_id);
                }
                Some(Fact::AliasDeleted { alias }) => {
                    models.aliases.remove(&alias);
                }
                Some(Fact::TokenRefreshed {
                    old_refresh_token_hash,
                    ..
                }) => {
                    models.spent_refresh_tokens.insert(old_refresh_token_hash);
                }
                Some(Fact::AccountDeactivated { user_id, .. }) => {
                    models.deactivated.insert(user_id);
                }
                // Only the transaction index needs to-device sends (journal::txn).
                Some(Fact::ToDeviceSent { .. }) if !models.index_txns => {}
                Some(Fact::ToDeviceSent {
                    sender,
                    sender_device,
                    txn_id,
                    ..
                }) => {
                    let key = txn::to_device_key(&sender, &sender_device, &txn_id);
                    models.txn_index.push((key, rec.position()));
                }
                Some(Fact::MediaCreated { media_id, uploader }) => {
                    models.media.insert(media_id, (uploader, false));
                }
                Some(Fact::MediaUploaded {
                    media_id, uploader, ..
                }) => {
                    models.media.insert(media_id, (uploader, true));
                }
                Some(fact) => apply_key_fact(&mut models.keys, &fact, rec.position()),
                None => {}
            }
        }
        if models.txn_index.len() >= TXN_INDEX_FLUSH {
            flush_txn_index(store, models);
        }
        Ok(())
    })
}

/// Transaction-index entries collected by a start-up replay before they are written.
const TXN_INDEX_FLUSH: usize = 8_192;

/// Writes the transaction-index entries a replay collected ([`txn`]). A failure is
/// logged, not fatal: the entries are written again by the next start-up's replay.
fn flush_txn_index(store: &dyn JournalStore, models: &mut snapshot::WriteModels) {
    if models.txn_index.is_empty() {
        return;
    }
    if let Err(e) = store.index_txns(&models.txn_index) {
        tracing::warn!(error = %e, "journal: writing transaction-index entries failed");
    }
    models.txn_index.clear();
}

struct Pending {
    records: Vec<Record>,
    /// The transaction key ([`txn`]) of the first record, indexed with it.
    txn_key: Option<Vec<u8>>,
}

/// What the appender thread receives, in position order (sent under the enqueue lock).
enum ToAppender {
    /// Positioned records to write.
    Records(Pending),
    /// A [`Journal::submit_batch`] run starts: write what came before, then collect
    /// without writing until the matching [`ToAppender::Release`].
    Hold,
    /// The run that sent the matching [`ToAppender::Hold`] is enqueued.
    Release,
    /// This process took the writer lease of a shared journal ([`nats`]): the next
    /// record follows this head (records other processes appended meanwhile).
    Rebase(ChainHead),
}

/// Records the appender writes with one fsync at most when no batch holds it (group
/// commit of concurrent writers).
const APPEND_GROUP_RECORDS: usize = 1024;

/// Commands in one [`Journal::submit_batch`] run (one durable write); longer batches
/// are split into runs of this many. Bounds how long a run holds the appender's write
/// open (and so how long concurrent writers wait for the run's checks).
pub const MAX_BATCH_COMMANDS: usize = 1024;

/// What [`Journal::stage`] leaves to do once a command's records are durable.
enum Staged {
    /// Accepted: answer the outcome once its position is durable.
    Done(Outcome),
    /// A key claim: read the claimed keys back once the claim is durable.
    Claimed(Outcome, Vec<(KeyClaim, u64)>),
    /// Refused, with the position of the record of the refusal (a rejected remote
    /// PDU), which is durable before the refusal is answered.
    Refused(JournalError, u64),
}

/// Holds the appender's write open while a [`Journal::submit_batch`] run is enqueued;
/// releases it when dropped (also when the run's future is dropped half-way, so the
/// appender never waits for a run that is gone).
struct AppenderHold<'a> {
    inner: &'a Inner,
}

impl<'a> AppenderHold<'a> {
    fn new(inner: &'a Inner) -> Self {
        send_to_appender(&inner.enqueue.lock().1, ToAppender::Hold);
        AppenderHold { inner }
    }
}

impl Drop for AppenderHold<'_> {
    fn drop(&mut self) {
        send_to_appender(&self.inner.enqueue.lock().1, ToAppender::Release);
    }
}

/// Sends to the appender thread; aborts if it is gone (nothing could be made durable).
fn send_to_appender(tx: &std::sync::mpsc::Sender<ToAppender>, msg: ToAppender) {
    if tx.send(msg).is_err() {
        tracing::error!("journal appender is gone; refusing to continue");
        std::process::abort();
    }
}

/// Counters for counting tests (BRIEF §3.9): fsyncs and records read.
#[derive(Debug, Default)]
pub struct JournalStats {
    /// fsyncs performed by the appender.
    pub fsyncs: AtomicU64,
    /// records appended.
    pub appended: AtomicU64,
    /// records read by tailers.
    pub records_read: AtomicU64,
    /// Records tailers read from the in-memory tail instead of the store
    /// ([`Journal::read_after_shared`]).
    pub recent_reads: AtomicU64,
    /// records handed to the appender (positioned, not yet necessarily durable).
    pub enqueued: AtomicU64,
    /// Commands whose envelope signature was checked with ed25519: those not signed
    /// by this process ([`SignedCommand::sign`] here, unchanged since, is a byte
    /// comparison), such as commands forwarded by another process.
    pub signature_checks: AtomicU64,
    /// Writes of consumers' cursors ([`consumer::Cursors`]): a file fsynced, or a
    /// message to the shared cursor stream.
    pub cursor_writes: AtomicU64,
    /// Fork-case counters ([`fork`]): resolutions whose states were equal after all,
    /// settled by the window merge, run through state resolution v2, and failed (the
    /// log order kept).
    pub forks_linear: AtomicU64,
    /// See [`JournalStats::forks_linear`].
    pub forks_merged: AtomicU64,
    /// See [`JournalStats::forks_linear`].
    pub forks_resolved: AtomicU64,
    /// See [`JournalStats::forks_linear`].
    pub forks_failed: AtomicU64,
    /// Remote events naming a `prev_event` older than the fork window (its state taken
    /// as the current state).
    pub forks_beyond_window: AtomicU64,
    /// Remote events soft-failed ([`RecordKind::SoftFailed`]): authorized by the state
    /// before them, not by the room's current state.
    pub forks_soft_failed: AtomicU64,
    /// Records replayed by [`Journal::open`] to restore the write models: those after
    /// the snapshot it started from (every record without one).
    pub restored: AtomicU64,
    /// Write-model snapshots saved (at start-up and in the background).
    pub snapshots_saved: AtomicU64,
    /// Transaction ids looked up in the store's index ([`txn`]): hot-set misses.
    pub txn_index_reads: AtomicU64,
    /// Retries answered from the store's index (the hot set had evicted the key).
    pub txn_index_hits: AtomicU64,
    /// Snapshots that failed to save.
    pub snapshots_failed: AtomicU64,
    /// Position of the newest snapshot: the one loaded at open, then each one saved
    /// (0: none).
    pub snapshot_position: AtomicU64,
    /// Size of the last snapshot saved, bytes.
    pub snapshot_bytes: AtomicU64,
    /// How long saving the last snapshot took (replay of the records since the one
    /// before, encoding, the durable write), ms.
    pub snapshot_duration_ms: AtomicU64,
    /// How long restoring the write models at open took (snapshot load + replay), ms.
    pub restore_duration_ms: AtomicU64,
    /// Remote joins since start that came back with the member events omitted: rooms
    /// that became partial-state ([`Fact::RoomStatePartial`], MSC3902).
    pub partial_state_joins: AtomicU64,
    /// Partial-state rooms whose full state was imported since start
    /// ([`Fact::RoomStateCompleted`]).
    pub partial_state_completed: AtomicU64,
    /// Events our users sent since start into a room whose state was partial.
    pub partial_state_sends: AtomicU64,
}

impl JournalStats {
    fn note_snapshot(&self, position: u64, bytes: usize, took: std::time::Duration) {
        self.snapshot_position.store(position, Ordering::Relaxed);
        self.snapshot_bytes.store(bytes as u64, Ordering::Relaxed);
        self.snapshot_duration_ms
            .store(took.as_millis() as u64, Ordering::Relaxed);
    }
}

/// The journal handle (cheap to clone).
#[derive(Clone)]
pub struct Journal {
    inner: Arc<Inner>,
}

struct Inner {
    key: Arc<ServerKey>,
    store: Arc<dyn JournalStore>,
    /// The last durable records, shared with tailers ([`Journal::read_after_shared`]).
    recent: Arc<RecentRecords>,
    rooms: parking_lot::Mutex<HashMap<OwnedRoomId, Arc<tokio::sync::Mutex<RoomAggregate>>>>,
    users: parking_lot::Mutex<HashSet<String>>,
    /// Alias -> room: aliases are unique, so the writer checks them (a read model
    /// check-then-write would race).
    aliases: parking_lot::Mutex<HashMap<String, String>>,
    /// Refresh tokens already spent (by hash): each may be spent once, decided here
    /// (two concurrent `/refresh` calls with one token must not both succeed).
    spent_refresh_tokens: parking_lot::Mutex<HashSet<String>>,
    /// Deactivated accounts: no new device or token is issued for them, decided here so
    /// a login racing a deactivation cannot leave a working token behind.
    deactivated: parking_lot::Mutex<HashSet<String>>,
    /// Claimable device keys: one-time keys are handed out exactly once, so the writer
    /// decides claims (a read model check-then-write would hand a key out twice).
    keys: parking_lot::Mutex<KeyModels>,
    /// The hot set of transaction ids ([`txn`]); the store's index has every one.
    txns: parking_lot::Mutex<txn::TxnCache>,
    /// Media id -> (uploader, uploaded): one upload per media id.
    media: parking_lot::Mutex<HashMap<String, (String, bool)>>,
    /// Serializes to-device sends (the check of a txn id and the enqueue of its
    /// record), as the room lock does for room events.
    to_device_send: parking_lot::Mutex<()>,
    /// Allocation of positions + enqueue happen together under this lock (held for
    /// nanoseconds; never across I/O) so the appender receives records in order.
    enqueue: parking_lot::Mutex<(u64, std::sync::mpsc::Sender<ToAppender>)>,
    durable: watch::Receiver<u64>,
    /// Publishes the durable head: the appender after each fsync, and a follower of a
    /// shared journal after each record it applied ([`nats`]).
    durable_tx: Arc<head::DurableHead>,
    /// Set when the journal lives in a JetStream stream shared with other processes.
    cluster: Option<cluster::Cluster>,
    stats: Arc<JournalStats>,
    /// Size of each federated room's fork window ([`JournalOptions::fork_window`]).
    fork_window: usize,
}

/// One room's write model as [`Journal::room_model`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomModelView {
    /// The current state: (event type, state key) -> event id.
    pub state: std::collections::BTreeMap<(String, String), String>,
    /// Forward extremities, oldest first.
    pub extremities: Vec<String>,
    /// The fork window's events oldest first; `None` while no other server is joined.
    pub window: Option<Vec<String>>,
    /// Events held only as outliers.
    pub outliers: usize,
    /// Servers with a user joined now.
    pub joined_servers: Vec<String>,
}

/// Options of [`Journal::open_with`].
#[derive(Debug, Clone)]
pub struct JournalOptions {
    /// Events of a federated room whose state the fork window remembers (config
    /// `federation.fork_window`; default [`fork::DEFAULT_FORK_WINDOW`]).
    pub fork_window: usize,
    /// Records between write-model snapshots ([`snapshot`]; config
    /// `journal.snapshot_every_records`, default
    /// [`snapshot::DEFAULT_SNAPSHOT_EVERY_RECORDS`]): a start-up that replayed at least
    /// this many saves one, and while serving one is taken in the background each time
    /// this many records were appended since the last. 0: no snapshot is ever saved
    /// (one already stored is still used).
    pub snapshot_every_records: u64,
    /// Transaction ids kept in memory ([`txn`]; config `journal.txn_ids_cached`,
    /// default [`txn::DEFAULT_TXN_IDS_CACHED`], at least [`txn::MIN_TXN_IDS_CACHED`]).
    pub txn_ids_cached: usize,
}

impl Default for JournalOptions {
    fn default() -> Self {
        JournalOptions {
            fork_window: fork::DEFAULT_FORK_WINDOW,
            snapshot_every_records: snapshot::DEFAULT_SNAPSHOT_EVERY_RECORDS,
            txn_ids_cached: txn::DEFAULT_TXN_IDS_CACHED,
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn random_id(len: usize) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rng();
    (0..len)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

impl Journal {
    /// Opens the journal on a store, restores every write model (room aggregates and
    /// the uniqueness sets) from the last snapshot plus the records after it, verifying
    /// the hash chain from the snapshot's checkpoint (from position 0 without one; see
    /// [`snapshot`]), and starts the group-commit appender thread.
    ///
    /// A torn tail (the last records unreadable, nothing readable after them) is
    /// truncated with a warning naming what was dropped; any other break (a bad record
    /// followed by good ones, a broken chain, a gap) refuses to open: that is
    /// corruption or tampering, not a crash, and only the operator can decide.
    pub fn open(
        store: Arc<dyn JournalStore>,
        key: Arc<ServerKey>,
    ) -> Result<Journal, JournalError> {
        Self::open_with(store, key, JournalOptions::default())
    }

    /// [`Journal::open`] with options (the fork window's size, how often snapshots are
    /// taken).
    pub fn open_with(
        store: Arc<dyn JournalStore>,
        key: Arc<ServerKey>,
        options: JournalOptions,
    ) -> Result<Journal, JournalError> {
        Self::open_inner(store, key, options, None)
    }

    /// Opens a journal kept in a JetStream stream shared with other Spindle processes
    /// ([`nats`]): restores the write models from the store's local mirror as
    /// [`Journal::open_with`] does, then follows the stream (applying what other
    /// processes append) and competes for the writer lease. Until this process holds
    /// the lease, [`Journal::submit`] forwards each command to the process that does.
    /// Must be called inside a tokio runtime (the lease and forwarding tasks run on it).
    pub fn open_shared(
        store: Arc<NatsStore>,
        key: Arc<ServerKey>,
        options: JournalOptions,
    ) -> Result<Journal, JournalError> {
        let journal = Self::open_inner(store.clone(), key, options, Some(store))?;
        journal.start_following().map_err(JournalError::Storage)?;
        Ok(journal)
    }

    fn open_inner(
        store: Arc<dyn JournalStore>,
        key: Arc<ServerKey>,
        options: JournalOptions,
        shared: Option<Arc<NatsStore>>,
    ) -> Result<Journal, JournalError> {
        let cap = options.fork_window;
        let stats = Arc::new(JournalStats::default());
        let opened = std::time::Instant::now();
        let (mut models, start) = snapshot::load(&*store, cap, true)
            .unwrap_or_else(|| (snapshot::WriteModels::default(), ChainHead::GENESIS));
        let total = store
            .last_position()
            .unwrap_or(0)
            .saturating_sub(start.position);
        let mut progress = snapshot::Progress::new("restoring write models", total, true);
        models.index_txns = true;
        let walked = replay_into(
            &*store,
            &mut models,
            start,
            u64::MAX,
            cap,
            &stats,
            &mut progress,
        );
        progress.finish();
        // Before the snapshot below: its durable persist covers these entries.
        flush_txn_index(&*store, &mut models);
        models.index_txns = false;
        let chain_head = match walked {
            Ok(h) => h,
            Err(brk) => recover_torn_tail(&*store, brk)?,
        };
        stats.restored.store(progress.done(), Ordering::Relaxed);
        stats
            .snapshot_position
            .store(start.position, Ordering::Relaxed);
        stats
            .restore_duration_ms
            .store(opened.elapsed().as_millis() as u64, Ordering::Relaxed);
        let every = options.snapshot_every_records;
        let mut last_snapshot = start.position;
        if every > 0 && progress.done() >= every {
            let saving = std::time::Instant::now();
            match snapshot::save(&*store, &models, chain_head, cap) {
                Ok(bytes) => {
                    stats.snapshots_saved.fetch_add(1, Ordering::Relaxed);
                    stats.note_snapshot(chain_head.position, bytes, saving.elapsed());
                    last_snapshot = chain_head.position;
                    tracing::info!(
                        position = chain_head.position,
                        bytes,
                        "journal: write-model snapshot saved"
                    );
                }
                Err(e) => {
                    stats.snapshots_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "journal: saving the write-model snapshot failed")
                }
            }
        }
        let snapshot::WriteModels {
            rooms,
            users,
            aliases,
            spent_refresh_tokens,
            deactivated,
            keys,
            media,
            ..
        } = models;
        let head = chain_head.position;
        let (durable_tx, durable_rx) = head::DurableHead::new(head);
        let durable_tx = Arc::new(durable_tx);
        let (tx, rx) = std::sync::mpsc::channel::<ToAppender>();
        let recent = Arc::new(RecentRecords::default());
        {
            let store = store.clone();
            let stats = stats.clone();
            let recent = recent.clone();
            let durable_tx = durable_tx.clone();
            let snapshots = snapshot::Background::new(every, last_snapshot, cap);
            std::thread::Builder::new()
                .name("journal-appender".into())
                .spawn(move || {
                    appender(store, rx, durable_tx, stats, chain_head, snapshots, recent)
                })
                .map_err(|e| JournalError::Storage(e.to_string()))?;
        }
        Ok(Journal {
            inner: Arc::new(Inner {
                key,
                store,
                recent,
                rooms: parking_lot::Mutex::new(
                    rooms
                        .into_iter()
                        .map(|(k, v)| (k, Arc::new(tokio::sync::Mutex::new(v))))
                        .collect(),
                ),
                users: parking_lot::Mutex::new(users),
                aliases: parking_lot::Mutex::new(aliases),
                spent_refresh_tokens: parking_lot::Mutex::new(spent_refresh_tokens),
                deactivated: parking_lot::Mutex::new(deactivated),
                keys: parking_lot::Mutex::new(keys),
                txns: parking_lot::Mutex::new(txn::TxnCache::new(options.txn_ids_cached)),
                media: parking_lot::Mutex::new(media),
                to_device_send: parking_lot::Mutex::new(()),
                enqueue: parking_lot::Mutex::new((head, tx)),
                durable: durable_rx,
                durable_tx,
                cluster: shared.map(|store| cluster::Cluster::new(store, chain_head)),
                stats,
                fork_window: cap,
            }),
        })
    }

    /// The server's signing key (the API signs command envelopes with it).
    pub fn key(&self) -> &Arc<ServerKey> {
        &self.inner.key
    }

    /// The highest position that is on disk.
    pub fn durable_head(&self) -> u64 {
        *self.inner.durable.borrow()
    }

    /// A watch on the durable head, for async tailers.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.durable.clone()
    }

    /// The durable head and where the last durable record of each kind is, read
    /// together ([`Heads::covered`]). Never behind [`Journal::durable_head`] read
    /// before it: the heads are published before the watch.
    pub fn heads(&self) -> Heads {
        self.inner.durable_tx.heads()
    }

    /// Blocks the calling thread (a projection's tailing thread, not an async task)
    /// until a record `interest` reads is durable after position `after`, at most
    /// `timeout`. Returns the heads then (also at the timeout, unchanged), or `None`
    /// once the journal's appender has stopped. Records of other kinds do not wake it.
    pub fn wait_for_records(
        &self,
        after: u64,
        interest: Interest,
        timeout: std::time::Duration,
    ) -> Option<Heads> {
        self.inner.durable_tx.wait(after, interest, timeout)
    }

    /// Counters for counting tests.
    pub fn stats(&self) -> &JournalStats {
        &self.inner.stats
    }

    /// What the journal's store holds in memory now (memtables, block cache), if the
    /// store reports it ([`JournalStore::memory_use`]).
    pub fn storage_use(&self) -> Option<StorageUse> {
        self.inner.store.memory_use()
    }

    /// Transaction ids in the hot set now, and its bound ([`txn`]).
    pub fn txn_cache_len(&self) -> (usize, usize) {
        let c = self.inner.txns.lock();
        (c.len(), c.max())
    }

    /// A digest of every in-memory write model ([`snapshot`]): equal digests mean equal
    /// models, fork windows included. Waits for each room's lock. What proves that a
    /// journal restored from a snapshot holds what a full replay builds.
    pub async fn write_model_digest(&self) -> String {
        let rooms: Vec<(OwnedRoomId, Arc<tokio::sync::Mutex<RoomAggregate>>)> = self
            .inner
            .rooms
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut guards = Vec::with_capacity(rooms.len());
        for (id, agg) in &rooms {
            guards.push((id, agg.lock().await));
        }
        let (users, aliases, spent, deactivated, keys, media) = (
            self.inner.users.lock(),
            self.inner.aliases.lock(),
            self.inner.spent_refresh_tokens.lock(),
            self.inner.deactivated.lock(),
            self.inner.keys.lock(),
            self.inner.media.lock(),
        );
        snapshot::digest(
            guards.iter().map(|(id, g)| (*id, &**g)).collect(),
            snapshot::Sets {
                users: &users,
                aliases: &aliases,
                spent_refresh_tokens: &spent,
                deactivated: &deactivated,
                keys: &keys,
                media: &media,
            },
        )
    }

    /// What the write model holds of one room (tests and diagnostics), or `None` for
    /// a room unknown here.
    pub async fn room_model(&self, room_id: &str) -> Option<RoomModelView> {
        let room = OwnedRoomId::try_from(room_id).ok()?;
        let agg = self.inner.rooms.lock().get(&room)?.clone();
        let agg = agg.lock().await;
        Some(RoomModelView {
            state: agg
                .state
                .iter()
                .map(|(slot, p)| (slot.clone(), p.event_id.to_string()))
                .collect(),
            extremities: agg
                .extremities
                .iter()
                .map(|(id, _)| id.to_string())
                .collect(),
            window: agg
                .window
                .as_ref()
                .map(|w| w.entries().map(|(id, _, _)| id.to_string()).collect()),
            outliers: agg.outliers.len(),
            joined_servers: agg.joined_servers.keys().cloned().collect(),
        })
    }

    /// Reads up to `limit` durable records after position `after`, in order.
    pub fn read_after(&self, after: u64, limit: usize) -> Result<Vec<StoredRecord>, JournalError> {
        let head = self.durable_head();
        if after >= head {
            return Ok(Vec::new());
        }
        let limit = limit.min((head - after) as usize);
        let recs = self
            .inner
            .store
            .read_after(after, limit)
            .map_err(JournalError::Storage)?;
        self.inner
            .stats
            .records_read
            .fetch_add(recs.len() as u64, Ordering::Relaxed);
        Ok(recs.into_iter().filter(|r| r.position() <= head).collect())
    }

    /// [`Journal::read_after`] for tailers that share what they read: the records come
    /// from the journal's in-memory tail of recent durable records when it still holds
    /// position `after + 1` (no store read, no copy, and a PDU parsed by one reader is
    /// parsed for all: [`StoredRecord::pdu`]), else from the store. The projections read
    /// through it, so a new record costs one decode and one parse, not one per
    /// projection.
    pub fn read_after_shared(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<StoredRecord>>, JournalError> {
        let head = self.durable_head();
        if after >= head {
            return Ok(Vec::new());
        }
        let limit = limit.min((head - after) as usize);
        if let Some(hit) = self.inner.recent.after(after, limit, head) {
            self.inner
                .stats
                .recent_reads
                .fetch_add(hit.len() as u64, Ordering::Relaxed);
            return Ok(hit);
        }
        Ok(self
            .read_after(after, limit)?
            .into_iter()
            .map(Arc::new)
            .collect())
    }

    /// Verifies, authorizes and durably appends a command. Returns once the records
    /// are fsynced.
    pub async fn submit(&self, cmd: SignedCommand) -> Result<Outcome, JournalError> {
        if self.forwards() {
            return self
                .forward(std::slice::from_ref(&cmd))
                .await?
                .pop()
                .unwrap_or_else(|| {
                    Err(JournalError::Storage("the writer answered nothing".into()))
                });
        }
        self.submit_here(cmd).await
    }

    /// [`Journal::submit`] on this process's own write models.
    pub(crate) async fn submit_here(&self, cmd: SignedCommand) -> Result<Outcome, JournalError> {
        let staged = self.stage(&cmd).await?;
        self.finish(staged).await
    }

    /// Verifies, authorizes and durably appends a run of commands with one durable
    /// write: each command is checked and appended exactly as [`Journal::submit`] would
    /// (in the order given, each against the write models as the commands before it
    /// left them), and the run waits once for the fsync that covers all of them.
    ///
    /// Returns one result per command, in the order given. A refused command (any
    /// [`JournalError`] `submit` returns) appends nothing, or only the record of its
    /// refusal (a rejected remote PDU), and does not affect the others. The run is not a
    /// transaction: each accepted command is appended as it is checked, and the records
    /// of concurrent writers may sit between the run's records (they share its fsync).
    /// While a run is being checked the appender holds its write open (the run's and
    /// concurrent writers' records wait for the end of the run, at most
    /// [`MAX_BATCH_COMMANDS`] commands); a longer run is split into runs of that many,
    /// each with its own durable write. A storage failure while waiting turns every
    /// accepted command's result into [`JournalError::Storage`]. With no accepted
    /// command nothing is written (no fsync).
    pub async fn submit_batch(
        &self,
        cmds: Vec<SignedCommand>,
    ) -> Vec<Result<Outcome, JournalError>> {
        if self.forwards() {
            let n = cmds.len();
            return match self.forward(&cmds).await {
                Ok(results) => results,
                Err(e) => (0..n)
                    .map(|_| Err(JournalError::Storage(e.to_string())))
                    .collect(),
            };
        }
        self.submit_batch_here(cmds).await
    }

    /// [`Journal::submit_batch`] on this process's own write models.
    pub(crate) async fn submit_batch_here(
        &self,
        cmds: Vec<SignedCommand>,
    ) -> Vec<Result<Outcome, JournalError>> {
        let mut results = Vec::with_capacity(cmds.len());
        for run in cmds.chunks(MAX_BATCH_COMMANDS) {
            let mut staged = Vec::with_capacity(run.len());
            {
                let _hold = AppenderHold::new(&self.inner);
                for cmd in run {
                    staged.push(self.stage(cmd).await);
                }
            }
            // The hold is released: the appender writes the whole run with one fsync.
            for s in staged {
                results.push(match s {
                    Ok(s) => self.finish(s).await,
                    Err(e) => Err(e),
                });
            }
        }
        results
    }

    /// Waits until a staged command's records are durable, then answers it.
    async fn finish(&self, staged: Staged) -> Result<Outcome, JournalError> {
        match staged {
            Staged::Done(outcome) => {
                self.wait_durable(outcome.position).await?;
                Ok(outcome)
            }
            Staged::Claimed(outcome, picked) => {
                self.wait_durable(outcome.position).await?;
                self.read_claimed(outcome, picked)
            }
            Staged::Refused(error, position) => {
                // The refusal is on disk before the caller hears of it.
                self.wait_durable(position).await?;
                Err(error)
            }
        }
    }

    /// Verifies, authorizes and enqueues a command's records; waits for nothing.
    async fn stage(&self, cmd: &SignedCommand) -> Result<Staged, JournalError> {
        let bytes = cmd
            .envelope
            .canonical_bytes()
            .map_err(JournalError::BadJson)?;
        if cmd
            .verify(&self.inner.key, &bytes)
            .map_err(|_| JournalError::BadSignature)?
        {
            self.inner
                .stats
                .signature_checks
                .fetch_add(1, Ordering::Relaxed);
        }
        let outcome = match &cmd.envelope.body {
            CommandBody::Fact {
                fact: fact @ Fact::RoomForgotten { room_id, user_id },
            } => self.forget_room(cmd, fact, room_id, user_id).await?,
            CommandBody::Fact { fact } => self.append_fact(cmd, fact)?,
            CommandBody::ClaimOneTimeKeys { requests } => {
                let (outcome, picked) = self.claim_keys(cmd, requests)?;
                return Ok(Staged::Claimed(outcome, picked));
            }
            CommandBody::SendEvent {
                room_id,
                event,
                txn_id,
                precondition,
            } => {
                self.send_event(
                    cmd,
                    room_id,
                    event,
                    txn_id.as_deref(),
                    precondition.as_ref(),
                )
                .await?
            }
            CommandBody::ImportRemoteRoom {
                room_id,
                room_version,
                auth_chain,
                state,
                join,
                keys,
                partial_state,
            } => {
                self.import_remote_room(
                    cmd,
                    room_id,
                    room_version,
                    auth_chain,
                    state,
                    join,
                    keys,
                    partial_state.as_deref(),
                )
                .await?
            }
            CommandBody::RemoteOutlier {
                room_id,
                room_version,
                pdu,
                keys,
                invite_room_state,
            } => {
                self.remote_outlier(
                    cmd,
                    room_id,
                    room_version,
                    pdu,
                    keys,
                    invite_room_state.as_ref(),
                )
                .await?
            }
            CommandBody::Backfill {
                room_id,
                pdus,
                auth_events,
                keys,
            } => self.backfill(cmd, room_id, pdus, auth_events, keys).await?,
            CommandBody::RemotePdu {
                room_id,
                pdu,
                keys,
                event_id,
                auth_events,
            } => {
                return self
                    .ingest_remote(cmd, room_id, pdu, keys, event_id.as_deref(), auth_events)
                    .await;
            }
            CommandBody::CompletePartialState {
                room_id,
                state,
                auth_chain,
                keys,
            } => {
                self.complete_partial_state(cmd, room_id, state, auth_chain, keys)
                    .await?
            }
            CommandBody::CreateRoom {
                room_version,
                events,
                alias,
            } => {
                self.create_room(cmd, room_version, events, alias.as_deref())
                    .await?
            }
        };
        Ok(Staged::Done(outcome))
    }

    async fn wait_durable(&self, position: u64) -> Result<(), JournalError> {
        let mut rx = self.inner.durable.clone();
        rx.wait_for(|h| *h >= position)
            .await
            .map_err(|_| JournalError::Storage("appender stopped".into()))?;
        Ok(())
    }

    fn base_record(&self, cmd: &SignedCommand, kind: RecordKind, payload: Vec<u8>) -> Record {
        Record {
            format: RECORD_FORMAT,
            position: 0,
            appended_at: now_ms(),
            prev_hash: GENESIS_HASH,
            kind,
            room_id: None,
            event_id: None,
            room_version: None,
            principal: cmd.envelope.principal.clone(),
            device_id: cmd.envelope.device_id.clone(),
            txn_id: None,
            command_signature: cmd.signature.clone(),
            payload,
        }
    }

    /// Allocates positions for `records` and hands them to the appender, in order.
    /// What a send with transaction key `key` produced, if one was sent: from the hot
    /// set, else from the store's index (reading the record for its event id when
    /// `event` is set). Callers hold the lock that serializes sends of that key.
    fn find_txn(&self, key: &[u8], event: bool) -> Result<Option<txn::TxnHit>, JournalError> {
        if let Some(hit) = self.inner.txns.lock().get(key) {
            return Ok(Some(hit.clone()));
        }
        self.inner
            .stats
            .txn_index_reads
            .fetch_add(1, Ordering::Relaxed);
        let Some(position) = self
            .inner
            .store
            .txn_position(key)
            .map_err(JournalError::Storage)?
        else {
            return Ok(None);
        };
        let event_id = if event {
            let rec = self
                .inner
                .store
                .read_after(position - 1, 1)
                .map_err(JournalError::Storage)?
                .into_iter()
                .next()
                .filter(|r| r.position() == position)
                .ok_or_else(|| {
                    JournalError::Storage(format!("txn index names missing record {position}"))
                })?;
            let id = rec.event_id().ok_or_else(|| {
                JournalError::Storage(format!("txn index names record {position}, not an event"))
            })?;
            Some(
                OwnedEventId::try_from(id)
                    .map_err(|e| JournalError::Storage(format!("record {position}: {e}")))?,
            )
        } else {
            None
        };
        let hit = txn::TxnHit { position, event_id };
        self.inner
            .stats
            .txn_index_hits
            .fetch_add(1, Ordering::Relaxed);
        self.inner.txns.lock().insert(key.to_vec(), hit.clone());
        Ok(Some(hit))
    }

    fn enqueue(&self, records: Vec<Record>) -> u64 {
        self.enqueue_keyed(records, None)
    }

    /// [`Journal::enqueue`] with the transaction key of the first record ([`txn`]).
    fn enqueue_keyed(&self, mut records: Vec<Record>, txn_key: Option<Vec<u8>>) -> u64 {
        let mut guard = self.inner.enqueue.lock();
        for r in &mut records {
            guard.0 += 1;
            r.position = guard.0;
        }
        let last = guard.0;
        let count = records.len() as u64;
        send_to_appender(&guard.1, ToAppender::Records(Pending { records, txn_key }));
        self.inner
            .stats
            .enqueued
            .fetch_add(count, Ordering::Relaxed);
        last
    }

    fn append_fact(&self, cmd: &SignedCommand, fact: &Fact) -> Result<Outcome, JournalError> {
        let payload = serde_json::to_vec(fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
        let rec = self.base_record(cmd, RecordKind::Fact, payload);
        let position = match fact {
            Fact::AccountRegistered { user_id, .. } => {
                let mut users = self.inner.users.lock();
                if !users.insert(user_id.clone()) {
                    return Err(JournalError::UserInUse);
                }
                self.enqueue(vec![rec])
            }
            Fact::AliasSet { alias, room_id, .. } => {
                let mut aliases = self.inner.aliases.lock();
                if aliases.contains_key(alias) {
                    return Err(JournalError::AliasInUse);
                }
                aliases.insert(alias.clone(), room_id.clone());
                self.enqueue(vec![rec])
            }
            Fact::AdminPromoted { user_id } => {
                // Held while enqueueing, so the account cannot be registered "after" it.
                let users = self.inner.users.lock();
                if !users.contains(user_id) {
                    return Err(JournalError::Forbidden(format!(
                        "no such account {user_id}"
                    )));
                }
                let position = self.enqueue(vec![rec]);
                drop(users);
                position
            }
            Fact::AliasDeleted { alias } => {
                let mut aliases = self.inner.aliases.lock();
                if aliases.remove(alias).is_none() {
                    return Err(JournalError::Forbidden(format!(
                        "alias {alias} does not exist"
                    )));
                }
                self.enqueue(vec![rec])
            }
            Fact::TokenRefreshed {
                user_id,
                old_refresh_token_hash,
                ..
            } => {
                let deactivated = self.inner.deactivated.lock();
                if deactivated.contains(user_id) {
                    return Err(JournalError::Forbidden(format!("{user_id} is deactivated")));
                }
                let mut spent = self.inner.spent_refresh_tokens.lock();
                if !spent.insert(old_refresh_token_hash.clone()) {
                    return Err(JournalError::Forbidden("refresh token already used".into()));
                }
                let position = self.enqueue(vec![rec]);
                drop((spent, deactivated));
                position
            }
            Fact::DeviceCreated { user_id, .. }
            | Fact::TokenIssued { user_id, .. }
            | Fact::RefreshableTokenIssued { user_id, .. } => {
                // Held across the enqueue so a deactivation cannot slip in between.
                let deactivated = self.inner.deactivated.lock();
                if deactivated.contains(user_id) {
                    return Err(JournalError::Forbidden(format!("{user_id} is deactivated")));
                }
                let position = self.enqueue(vec![rec]);
                drop(deactivated);
                position
            }
            Fact::AccountDeactivated { user_id, .. } => {
                let mut deactivated = self.inner.deactivated.lock();
                deactivated.insert(user_id.clone());
                self.enqueue(vec![rec])
            }
            Fact::OneTimeKeysUploaded {
                user_id,
                device_id,
                one_time_keys,
            } => {
                let mut models = self.inner.keys.lock();
                // Only ids the device does not already have unclaimed become claimable.
                let existing = models.get(&(user_id.clone(), device_id.clone()));
                let fresh: std::collections::BTreeMap<String, serde_json::Value> = one_time_keys
                    .iter()
                    .filter(|(id, _)| {
                        existing
                            .and_then(|m| m.one_time.get(algorithm_of(id)))
                            .is_none_or(|keys| !keys.contains_key(*id))
                    })
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                if fresh.is_empty() {
                    return Ok(Outcome {
                        position: self.durable_head(),
                        ..Outcome::default()
                    });
                }
                let fact = Fact::OneTimeKeysUploaded {
                    user_id: user_id.clone(),
                    device_id: device_id.clone(),
                    one_time_keys: fresh,
                };
                let payload =
                    serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
                let position = self.enqueue(vec![self.base_record(cmd, RecordKind::Fact, payload)]);
                apply_key_fact(&mut models, &fact, position);
                position
            }
            Fact::FallbackKeysUploaded { .. } | Fact::DeviceDeleted { .. } => {
                let mut models = self.inner.keys.lock();
                let position = self.enqueue(vec![rec]);
                apply_key_fact(&mut models, fact, position);
                position
            }
            Fact::MediaCreated { media_id, uploader } => {
                let mut media = self.inner.media.lock();
                if media.contains_key(media_id) {
                    return Err(JournalError::MediaExists(media_id.clone()));
                }
                let position = self.enqueue(vec![rec]);
                media.insert(media_id.clone(), (uploader.clone(), false));
                position
            }
            Fact::MediaUploaded {
                media_id, uploader, ..
            } => {
                let mut media = self.inner.media.lock();
                match media.get(media_id) {
                    Some((_, true)) => return Err(JournalError::MediaExists(media_id.clone())),
                    Some((owner, false)) if owner != uploader => {
                        return Err(JournalError::Forbidden(
                            "this media id belongs to someone else".into(),
                        ));
                    }
                    _ => {}
                }
                let position = self.enqueue(vec![rec]);
                media.insert(media_id.clone(), (uploader.clone(), true));
                position
            }
            Fact::OneTimeKeysClaimed { .. } => {
                return Err(JournalError::Forbidden(
                    "claims are decided by the journal (ClaimOneTimeKeys)".into(),
                ));
            }
            Fact::ToDeviceSent {
                sender,
                sender_device,
                txn_id,
                ..
            } => {
                // Under the to-device lock: two concurrent retries cannot both miss.
                let _serial = self.inner.to_device_send.lock();
                let k = txn::to_device_key(sender, sender_device, txn_id);
                if let Some(hit) = self.find_txn(&k, false)? {
                    return Ok(Outcome {
                        position: hit.position,
                        ..Outcome::default()
                    });
                }
                let position = self.enqueue_keyed(vec![rec], Some(k.clone()));
                self.inner.txns.lock().insert(
                    k,
                    txn::TxnHit {
                        position,
                        event_id: None,
                    },
                );
                position
            }
            _ => self.enqueue(vec![rec]),
        };
        Ok(Outcome {
            position,
            ..Outcome::default()
        })
    }

    /// Picks the keys of a claim under the key write-model lock and enqueues the claim
    /// record: a one-time key leaves the model in the same critical section that
    /// enqueues the record handing it out, so no two claims can get it.
    fn claim_keys(
        &self,
        cmd: &SignedCommand,
        requests: &[KeyClaimRequest],
    ) -> Result<(Outcome, Vec<(KeyClaim, u64)>), JournalError> {
        let mut models = self.inner.keys.lock();
        let mut picked: Vec<(KeyClaim, u64)> = Vec::new();
        for r in requests {
            let Some(m) = models.get(&(r.user_id.clone(), r.device_id.clone())) else {
                continue;
            };
            let one_time = m
                .one_time
                .get(&r.algorithm)
                .and_then(|keys| keys.iter().next())
                .map(|(id, pos)| (id.clone(), *pos));
            // A second request for the same device and algorithm in one claim takes the
            // next key (the first is still in the model until the fact applies below).
            let one_time = match one_time {
                Some((id, _))
                    if picked.iter().any(|(c, _)| {
                        c.key_id == id && c.user_id == r.user_id && c.device_id == r.device_id
                    }) =>
                {
                    None
                }
                other => other,
            };
            match one_time {
                Some((key_id, pos)) => picked.push((
                    KeyClaim {
                        user_id: r.user_id.clone(),
                        device_id: r.device_id.clone(),
                        key_id,
                        fallback: false,
                    },
                    pos,
                )),
                None => {
                    if let Some((key_id, pos)) = m.fallback.get(&r.algorithm) {
                        picked.push((
                            KeyClaim {
                                user_id: r.user_id.clone(),
                                device_id: r.device_id.clone(),
                                key_id: key_id.clone(),
                                fallback: true,
                            },
                            *pos,
                        ));
                    }
                }
            }
        }
        if picked.is_empty() {
            return Ok((
                Outcome {
                    position: self.durable_head(),
                    ..Outcome::default()
                },
                picked,
            ));
        }
        let fact = Fact::OneTimeKeysClaimed {
            claims: picked.iter().map(|(c, _)| c.clone()).collect(),
        };
        let payload =
            serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
        let position = self.enqueue(vec![self.base_record(cmd, RecordKind::Fact, payload)]);
        apply_key_fact(&mut models, &fact, position);
        Ok((
            Outcome {
                position,
                ..Outcome::default()
            },
            picked,
        ))
    }

    /// Reads the content of claimed keys back from the records that uploaded them
    /// (after the claim is durable; the uploads precede it in the log).
    fn read_claimed(
        &self,
        mut outcome: Outcome,
        picked: Vec<(KeyClaim, u64)>,
    ) -> Result<Outcome, JournalError> {
        for (claim, pos) in picked {
            let rec = self
                .inner
                .store
                .read_after(pos - 1, 1)
                .map_err(JournalError::Storage)?
                .into_iter()
                .next()
                .filter(|r| r.position() == pos)
                .ok_or_else(|| JournalError::Storage(format!("key upload {pos} not found")))?;
            let key = match rec.fact() {
                Some(Fact::OneTimeKeysUploaded { one_time_keys, .. }) => {
                    one_time_keys.get(&claim.key_id).cloned()
                }
                Some(Fact::FallbackKeysUploaded { fallback_keys, .. }) => {
                    fallback_keys.get(&claim.key_id).cloned()
                }
                _ => None,
            }
            .ok_or_else(|| {
                JournalError::Storage(format!("key upload {pos} has no {}", claim.key_id))
            })?;
            outcome.claimed.push(ClaimedKey { claim, key });
        }
        Ok(outcome)
    }

    /// Builds one event on top of the aggregate's head and authorizes it.
    fn build_event(
        &self,
        agg: &RoomAggregate,
        room_id: Option<&OwnedRoomId>,
        sender: &OwnedUserId,
        spec: &EventSpec,
        ts: u64,
    ) -> Result<Pdu, JournalError> {
        let rules = room_version::rules(&agg.version)
            .ok_or_else(|| JournalError::UnsupportedRoomVersion(agg.version.clone()))?;
        if !spec.content.is_object() {
            return Err(JournalError::BadJson(
                "content must be a JSON object".into(),
            ));
        }
        let content_raw = serde_json::value::to_raw_value(&spec.content)
            .map_err(|e| JournalError::BadJson(e.to_string()))?;
        let auth_types = spindle_core::auth::auth_types(
            &rules,
            &spec.kind,
            sender,
            spec.state_key.as_deref(),
            &content_raw,
        )
        .map_err(JournalError::BadJson)?;
        let mut auth_events = Vec::new();
        // v1/v2 references carry the referenced events' hashes (point lookups only).
        let mut auth_hashes = HashMap::new();
        for (t, k) in &auth_types {
            if let Some(p) = agg.state.get(&(t.clone(), k.clone()))
                && !auth_events.contains(&p.event_id)
            {
                auth_events.push(p.event_id.clone());
                if agg.hashed_refs {
                    auth_hashes.insert(p.event_id.clone(), p.reference_hash()?);
                }
            }
        }
        let (prev_events, depth) = agg.next_prev_events();
        let redacts = match &spec.redacts {
            Some(r) => Some(
                OwnedEventId::try_from(r.as_str())
                    .map_err(|e| JournalError::BadJson(e.to_string()))?,
            ),
            None => None,
        };
        let pdu = PduTemplate {
            room_version: agg.version.clone(),
            room_id: room_id.cloned(),
            sender: sender.clone(),
            kind: spec.kind.clone(),
            state_key: spec.state_key.clone(),
            content: spec.content.clone(),
            redacts,
            prev_events,
            auth_events,
            depth,
            origin_server_ts: ts,
        }
        .build_with_references(&self.inner.key, &|id| {
            // Only v1/v2 ask: a forward extremity, or an auth event.
            agg.extremity_hashes
                .get(id)
                .or_else(|| auth_hashes.get(id))
                .cloned()
        })?;
        // The auth events, plus the create event: from room version 12 it is not among
        // the auth events but the rules still fetch it (by the room id).
        let create = agg.state.get(&("m.room.create".to_owned(), String::new()));
        let auth_map: HashMap<OwnedEventId, &Pdu> = pdu
            .auth_events
            .iter()
            .filter_map(|id| agg.auth_history.get(id))
            .chain(create)
            .map(|p| (p.event_id.clone(), &**p))
            .collect();
        spindle_core::auth::authorize(&rules, &pdu, &auth_map, |t, k| {
            agg.state.get(&(t.to_owned(), k.to_owned())).map(|p| &**p)
        })
        .map_err(JournalError::Forbidden)?;
        Ok(pdu)
    }

    fn event_record(&self, cmd: &SignedCommand, pdu: &Pdu, txn_id: Option<&str>) -> Record {
        let mut rec = self.base_record(cmd, RecordKind::Event, pdu.json.to_vec());
        rec.room_id = Some(pdu.room_id.to_string());
        rec.event_id = Some(pdu.event_id.to_string());
        rec.room_version = Some(pdu.room_version.clone());
        rec.txn_id = txn_id.map(str::to_owned);
        rec
    }

    fn sender_of(cmd: &SignedCommand) -> Result<OwnedUserId, JournalError> {
        OwnedUserId::try_from(cmd.envelope.principal.as_str())
            .map_err(|e| JournalError::BadJson(e.to_string()))
    }

    /// `RoomForgotten` is only true of a user who is not in the room: checked under the
    /// room lock so a concurrent join cannot be followed by a forget.
    async fn forget_room(
        &self,
        cmd: &SignedCommand,
        fact: &Fact,
        room_id: &str,
        user_id: &str,
    ) -> Result<Outcome, JournalError> {
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = self
            .inner
            .rooms
            .lock()
            .get(&room)
            .cloned()
            .ok_or_else(|| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = agg.lock().await;
        let current = Self::membership_of(&agg, user_id);
        if matches!(current.as_str(), "join" | "invite" | "knock") {
            return Err(JournalError::BadState(format!(
                "{user_id} is still in the room ({current})"
            )));
        }
        let payload = serde_json::to_vec(fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
        let position = self.enqueue(vec![self.base_record(cmd, RecordKind::Fact, payload)]);
        Ok(Outcome {
            position,
            room_id: Some(room),
            ..Outcome::default()
        })
    }

    /// The target's current membership in the aggregate (`"none"` without a member event).
    fn membership_of(agg: &RoomAggregate, user_id: &str) -> String {
        agg.state
            .get(&("m.room.member".to_owned(), user_id.to_owned()))
            .and_then(|p| {
                p.content_value()
                    .get("membership")
                    .and_then(|m| m.as_str())
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| "none".into())
    }

    async fn send_event(
        &self,
        cmd: &SignedCommand,
        room_id: &str,
        spec: &EventSpec,
        txn_id: Option<&str>,
        precondition: Option<&MembershipPrecondition>,
    ) -> Result<Outcome, JournalError> {
        let sender = Self::sender_of(cmd)?;
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = self
            .inner
            .rooms
            .lock()
            .get(&room)
            .cloned()
            .ok_or_else(|| JournalError::UnknownRoom(room_id.to_owned()))?;
        let mut agg = agg.lock().await;
        let txn_key = match (txn_id, &cmd.envelope.device_id) {
            (Some(t), Some(d)) => {
                Some(txn::event_key(room.as_str(), &cmd.envelope.principal, d, t))
            }
            _ => None,
        };
        // Under the room lock: two concurrent retries cannot both miss.
        if let Some(k) = &txn_key
            && let Some(hit) = self.find_txn(k, true)?
            && let Some(event_id) = hit.event_id
        {
            return Ok(Outcome {
                position: hit.position,
                room_id: Some(room),
                event_ids: vec![event_id],
                ..Outcome::default()
            });
        }
        if let (Some(pre), Some(target)) = (precondition, spec.state_key.as_deref()) {
            let current = Self::membership_of(&agg, target);
            let wanted = spec
                .content
                .get("membership")
                .and_then(|m| m.as_str())
                .unwrap_or("");
            if pre.unchanged_ok && current == wanted {
                let existing = agg
                    .state
                    .get(&("m.room.member".to_owned(), target.to_owned()))
                    .map(|p| p.event_id.clone());
                return Ok(Outcome {
                    position: self.durable_head(),
                    room_id: Some(room),
                    event_ids: existing.into_iter().collect(),
                    ..Outcome::default()
                });
            }
            if !pre.allowed.contains(&current) {
                if target == sender.as_str() {
                    return Err(match current.as_str() {
                        "ban" => JournalError::BadState("You are banned from this room".into()),
                        _ => JournalError::Forbidden("You are not in this room".into()),
                    });
                }
                // Someone outside the room learns nothing about its members.
                if target != sender.as_str()
                    && !matches!(
                        Self::membership_of(&agg, sender.as_str()).as_str(),
                        "join" | "invite" | "knock"
                    )
                {
                    return Err(JournalError::Forbidden("You are not in this room".into()));
                }
                return Err(JournalError::BadState(format!(
                    "{target}'s membership is {current}; cannot change it to {wanted} here"
                )));
            }
        }
        let pdu = self.build_event(&agg, Some(&room), &sender, spec, cmd.envelope.issued_at)?;
        let rec = self.event_record(cmd, &pdu, txn_id);
        let position = self.enqueue_keyed(vec![rec], txn_key.clone());
        if let Some(k) = txn_key {
            self.inner.txns.lock().insert(
                k,
                txn::TxnHit {
                    position,
                    event_id: Some(pdu.event_id.clone()),
                },
            );
        }
        let event_id = pdu.event_id.clone();
        if agg.partial.is_some() {
            self.inner
                .stats
                .partial_state_sends
                .fetch_add(1, Ordering::Relaxed);
        }
        // A local event names every extremity: it never forks, nothing is resolved.
        agg.apply(Arc::new(pdu), &self.inner.stats);
        Ok(Outcome {
            position,
            room_id: Some(room),
            event_ids: vec![event_id],
            ..Outcome::default()
        })
    }

    async fn create_room(
        &self,
        cmd: &SignedCommand,
        version: &str,
        events: &[EventSpec],
        alias: Option<&str>,
    ) -> Result<Outcome, JournalError> {
        if room_version::rules(version).is_none() {
            return Err(JournalError::UnsupportedRoomVersion(version.to_owned()));
        }
        let sender = Self::sender_of(cmd)?;
        if events.first().map(|e| e.kind.as_str()) != Some("m.room.create") {
            return Err(JournalError::BadJson(
                "the first event of a room must be m.room.create".into(),
            ));
        }
        let mut agg = RoomAggregate::new(version, self.inner.fork_window);
        let server = self.inner.key.server_name().to_owned();
        let mut room_id = if room_version::room_id_from_create(version) {
            None
        } else {
            Some(
                OwnedRoomId::try_from(format!("!{}:{}", random_id(18), server))
                    .map_err(|e| JournalError::BadJson(e.to_string()))?,
            )
        };
        let mut pdus = Vec::with_capacity(events.len());
        for spec in events {
            let pdu = self.build_event(
                &agg,
                room_id.as_ref(),
                &sender,
                spec,
                cmd.envelope.issued_at,
            )?;
            if room_id.is_none() {
                room_id = Some(pdu.room_id.clone());
            }
            let pdu = Arc::new(pdu);
            agg.apply(pdu.clone(), &self.inner.stats);
            pdus.push(pdu);
        }
        let room_id = room_id.expect("create event gives the room id");
        let mut records: Vec<Record> = pdus
            .iter()
            .map(|p| self.event_record(cmd, p, None))
            .collect();
        let agg = Arc::new(tokio::sync::Mutex::new(agg));
        let _guard = agg.lock().await;
        // The alias is checked and taken in the same critical section that enqueues the
        // room, so two concurrent createRooms cannot both get it.
        let mut aliases = self.inner.aliases.lock();
        if let Some(a) = alias {
            if aliases.contains_key(a) {
                return Err(JournalError::AliasInUse);
            }
            let fact = Fact::AliasSet {
                alias: a.to_owned(),
                room_id: room_id.to_string(),
                creator: cmd.envelope.principal.clone(),
            };
            let payload =
                serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
            records.push(self.base_record(cmd, RecordKind::Fact, payload));
        }
        {
            let mut rooms = self.inner.rooms.lock();
            if rooms.contains_key(&room_id) {
                return Err(JournalError::Forbidden("room id collision".into()));
            }
            rooms.insert(room_id.clone(), agg.clone());
        }
        if let Some(a) = alias {
            aliases.insert(a.to_owned(), room_id.to_string());
        }
        let position = self.enqueue(records);
        drop(aliases);
        Ok(Outcome {
            position,
            room_id: Some(room_id),
            event_ids: pdus.iter().map(|p| p.event_id.clone()).collect(),
            ..Outcome::default()
        })
    }
}

/// The group-commit loop: take everything queued, write it in one batch, fsync once,
/// publish the new durable head. A storage failure aborts the process: the in-memory
/// aggregates are ahead of the disk and only a restart (replay) makes them true again.
///
/// The appender is also where the hash chain is made: it sees records in position
/// order, sets each one's `prev_hash` to the hash of the bytes it encoded for the one
/// before, and hands the store exactly those bytes.
fn appender(
    store: Arc<dyn JournalStore>,
    rx: std::sync::mpsc::Receiver<ToAppender>,
    durable: Arc<head::DurableHead>,
    stats: Arc<JournalStats>,
    mut chain: ChainHead,
    mut snapshots: snapshot::Background,
    recent: Arc<RecentRecords>,
) {
    fn take(records: &mut Vec<(Record, Option<Vec<u8>>)>, p: Pending) {
        let mut key = p.txn_key;
        for r in p.records {
            records.push((r, key.take()));
        }
    }
    // Runs of `submit_batch` whose `Hold` arrived and `Release` did not yet.
    let mut holds = 0usize;
    let mut records: Vec<(Record, Option<Vec<u8>>)> = Vec::new();
    loop {
        // Collect one group: block while there is nothing to write or a run holds the
        // write open; otherwise take what is already queued (group commit). Ends with
        // nothing collected only when every sender is gone.
        loop {
            let msg = if records.is_empty() || holds > 0 {
                rx.recv().ok()
            } else if records.len() < APPEND_GROUP_RECORDS {
                rx.try_recv().ok()
            } else {
                None
            };
            match msg {
                Some(ToAppender::Records(p)) => take(&mut records, p),
                Some(ToAppender::Hold) => {
                    holds += 1;
                    // What was queued before the run does not wait for it.
                    if holds == 1 && !records.is_empty() {
                        break;
                    }
                }
                Some(ToAppender::Rebase(head)) => {
                    if !records.is_empty() {
                        tracing::error!(
                            "journal appender: a rebase with records pending; aborting"
                        );
                        std::process::abort();
                    }
                    chain = head;
                }
                Some(ToAppender::Release) => {
                    if holds == 0 {
                        tracing::error!("journal appender: a release without a hold; aborting");
                        std::process::abort();
                    }
                    holds -= 1;
                }
                // Nothing more queued, the group is full, or every sender is gone.
                None => break,
            }
        }
        if records.is_empty() {
            durable.close();
            return;
        }
        let mut encoded = Vec::with_capacity(records.len());
        // Each record's class (Interest::class_of), kept on the tail's copy so no
        // reader scans its JSON again.
        let mut classes = Vec::with_capacity(records.len());
        for (mut r, txn_key) in records.drain(..) {
            classes.push(Interest::class_of(r.kind == RecordKind::Fact, &r.payload));
            if r.position != chain.position + 1 {
                tracing::error!(
                    expected = chain.position + 1,
                    got = r.position,
                    "journal positions out of order; aborting"
                );
                std::process::abort();
            }
            r.prev_hash = chain.hash;
            let bytes = r.encode();
            chain = ChainHead {
                position: r.position,
                hash: record_hash(&bytes),
            };
            encoded.push(EncodedRecord {
                position: r.position,
                room_id: r.room_id,
                bytes,
                txn_key,
            });
        }
        let last = chain.position;
        if let Err(e) = store.append(&encoded) {
            tracing::error!(error = %e, "journal append failed; aborting to protect acknowledged writes");
            std::process::abort();
        }
        stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        stats
            .appended
            .fetch_add(encoded.len() as u64, Ordering::Relaxed);
        // Before the head moves, so a tailer woken by it finds the records in memory.
        recent.push(&encoded, &classes);
        durable.publish(
            last,
            head::last_of_each_class(encoded.iter().map(|e| e.position).zip(classes)),
        );
        snapshots.after_append(&store, &stats, chain);
    }
}

/// Most records the in-memory tail keeps ([`Journal::read_after_shared`]): a few
/// batches of every projection (512 records each; 4,096 for the search index, which
/// gathers up to a second of records before it commits), so a projection that is not
/// far behind never reads the store.
const RECENT_RECORDS: usize = 8192;
/// Most bytes the in-memory tail keeps (records are at most 64 KiB each).
const RECENT_BYTES: usize = 12 * 1024 * 1024;

/// The last durable records, in position order, contiguous, bounded by
/// [`RECENT_RECORDS`] and [`RECENT_BYTES`]; the appender adds each group after its
/// fsync and before it publishes the new head.
#[derive(Default)]
struct RecentRecords {
    tail: parking_lot::Mutex<(std::collections::VecDeque<Arc<StoredRecord>>, usize)>,
}

impl RecentRecords {
    /// Adds the appender's records, each with the class it computed.
    fn push(&self, encoded: &[EncodedRecord], classes: &[Interest]) {
        let records: Vec<Arc<StoredRecord>> = encoded
            .iter()
            .zip(classes)
            .filter_map(|(e, c)| {
                let r = StoredRecord::from_bytes(&e.bytes).ok()?;
                Some(Arc::new(r.with_class(*c)))
            })
            .collect();
        self.push_records(records, encoded.len());
    }

    /// Adds records already decoded (a follower's); `expected` is how many there should
    /// be (fewer: one did not decode, and the tail starts over rather than keep a hole).
    fn push_records(&self, records: Vec<Arc<StoredRecord>>, expected: usize) {
        let mut tail = self.tail.lock();
        let (queue, bytes) = &mut *tail;
        if records.len() != expected
            || queue
                .back()
                .zip(records.first())
                .is_some_and(|(last, first)| first.position() != last.position() + 1)
        {
            // Never expected (the appender encoded and positioned them): start over
            // rather than keep a tail with a hole.
            queue.clear();
            *bytes = 0;
        }
        for r in records {
            *bytes += r.bytes().len();
            queue.push_back(r);
        }
        while queue.len() > RECENT_RECORDS || *bytes > RECENT_BYTES {
            match queue.pop_front() {
                Some(old) => *bytes -= old.bytes().len(),
                None => break,
            }
        }
    }

    /// Up to `limit` records after position `after`, none past `head`, if the tail
    /// holds position `after + 1`.
    fn after(&self, after: u64, limit: usize, head: u64) -> Option<Vec<Arc<StoredRecord>>> {
        let tail = self.tail.lock();
        let first = tail.0.front()?.position();
        if first > after + 1 {
            return None;
        }
        let skip = usize::try_from(after + 1 - first).ok()?;
        if skip >= tail.0.len() {
            return None;
        }
        Some(
            tail.0
                .iter()
                .skip(skip)
                .take(limit)
                .take_while(|r| r.position() <= head)
                .cloned()
                .collect(),
        )
    }
}

/// Decides what a chain break at start-up means. Only a torn tail is repaired: the
/// first bad record is unreadable and so is every record after it (a write that never
/// completed; nothing after it can have been acknowledged, since acknowledgement
/// follows the fsync of everything before). fjall itself already discards an
/// incomplete last batch on recovery, so with the fjall store this is defence in
/// depth for stores without atomic batches.
fn recover_torn_tail(store: &dyn JournalStore, brk: ChainBreak) -> Result<ChainHead, JournalError> {
    let refuse = |brk: &ChainBreak| {
        JournalError::Storage(format!(
            "{brk}; refusing to start. Run `spindle journal check` for details and restore \
             from a backup (records after a bad one cannot be trusted)"
        ))
    };
    if !matches!(brk.kind, BreakKind::Unreadable(_)) {
        return Err(refuse(&brk));
    }
    let tail = store
        .read_raw_after(brk.position - 1, usize::MAX)
        .map_err(JournalError::Storage)?;
    if tail
        .iter()
        .any(|(_, bytes)| StoredRecord::from_bytes(bytes).is_ok())
    {
        return Err(refuse(&brk));
    }
    let bytes: usize = tail.iter().map(|(_, b)| b.len()).sum();
    let last = tail.last().map(|(p, _)| *p).unwrap_or(brk.position);
    tracing::warn!(
        first = brk.position,
        last,
        records = tail.len(),
        bytes,
        kept_head = brk.good.position,
        "journal: dropping a torn tail of {} unreadable record(s) at positions {}..={} ({} bytes); \
         they were never acknowledged",
        tail.len(),
        brk.position,
        last,
        bytes
    );
    store
        .truncate_from(brk.position)
        .map_err(JournalError::Storage)?;
    Ok(brk.good)
}
