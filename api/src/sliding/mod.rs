//! `POST /_matrix/client/unstable/org.matrix.simplified_msc3575/sync`: Simplified
//! Sliding Sync (MSC4186), the sync Element X and matrix-rust-sdk's room list use.
//!
//! A request names *lists* (ranges into the user's rooms, filtered, ordered by
//! recency) and *room subscriptions*; the answer holds every selected room that the
//! connection has not been sent yet or that changed since, plus *extensions*
//! (account data, receipts, typing, to-device messages, device keys). What each
//! connection was sent lives in
//! [`conn::Connections`] (in memory; unknown `pos`: 400 `M_UNKNOWN_POS`).
//!
//! Costs (BRIEF §4): the list order comes from the in-memory recency the timeline
//! projection keeps (no event is read to sort); `required_state` with concrete keys is
//! point lookups (non-member types in the non-member trie, members through the
//! membership projection), only wildcards scan; `joined_count`/`invited_count` and
//! `heroes` come from the room summary projection (one read, one short scan); unread
//! counts are running-count seeks. A room the connection already has and that did not
//! change is skipped from memory (its last activity, its receipts' last change).
//! The `to_device` and `e2ee` extensions share `/sync`'s code: one range scan of the
//! device's inbox, the device-list change logs of the user's own rooms only (other
//! users' key uploads cost nothing), two key-count seeks.

mod conn;
pub mod request;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    time::Duration,
};

use axum::{Router, extract::State, routing::post};
use serde_json::{Value, json};
use spindle_core::{pdu::ClientFormat, trie::Root};
use spindle_projections::{membership::Membership, timeline::EventRecord};

pub use conn::{
    Connections, MAX_CONNECTIONS_PER_DEVICE, MAX_SNAPSHOTS_PER_CONNECTION, RoomFields, RoomSent,
    Snapshot,
};
use request::{ExtensionConfig, ListFilters, RequiredState, RoomConfig, SlidingRequest};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Query, Requester},
    json_text::{self, JsonOut},
    read::{token, write_render},
    state_render::RenderedState,
    visibility::{Access, can_see, room_access},
};

/// The unstable path (MSC4186 "Unstable prefix").
pub const PATH: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";
/// Most heroes per room (spec: `m.heroes`, "the first 5 members").
pub const MAX_HEROES: usize = 5;
/// Most receipt changes read for a room sent for the first time.
pub const INITIAL_RECEIPTS: usize = 100;
/// Most members remembered per room as already sent through `$LAZY`.
pub const MAX_LAZY_REMEMBERED: usize = 1000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route(PATH, post(sliding_sync))
}

fn unknown_pos() -> MatrixError {
    MatrixError::new(
        axum::http::StatusCode::BAD_REQUEST,
        "M_UNKNOWN_POS",
        "Unknown position: start a new connection",
    )
}

/// The handler: parses, resumes the connection, long-polls while nothing changed, and
/// records what was sent under a new `pos`.
async fn sliding_sync(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<axum::response::Response> {
    let req = SlidingRequest::parse(Value::Object(body))?;
    if let Some(p) = q.get("set_presence")
        && !["online", "offline", "unavailable"].contains(&p)
    {
        return Err(MatrixError::invalid_param(format!(
            "set_presence must be online, offline or unavailable, not {p:?}"
        )));
    }
    let pos = q.get("pos").map(str::to_owned).or(req.pos.clone());
    let timeout = q
        .u64("timeout")?
        .or(req.timeout)
        .unwrap_or(0)
        .min(s.config.max_sync_timeout_ms);
    let (user, device, conn_id) = (&r.user_id, &r.device_id, &req.conn_id);
    let base = match &pos {
        Some(p) => Some(
            s.sliding
                .resume(user, device, conn_id, p)
                .ok_or_else(unknown_pos)?,
        ),
        None => {
            s.sliding.reset(user, device, conn_id);
            None
        }
    };
    let to_device = &req.extensions.to_device;
    let to_device_since = match &to_device.since {
        Some(t) if to_device.on() => {
            let since: u64 = t.parse().map_err(|_| {
                MatrixError::invalid_param(format!(
                    "to_device since must be a next_batch this server gave, not {t:?}"
                ))
            })?;
            if since > s.journal.durable_head() {
                return Err(MatrixError::invalid_param(
                    "to_device since is from the future",
                ));
            }
            // The messages up to `since` were delivered to this device by the response
            // that gave it: acknowledging them (journaled) deletes them for good, as
            // `/sync`'s `since` does (MSC3885).
            crate::sync::acknowledge_to_device(&s, &r, since).await?;
            Some(since)
        }
        _ => None,
    };
    let mut wake = Wake {
        to_device_acked: to_device.on().then_some(to_device_since.unwrap_or(0)),
        device_lists: req.extensions.e2ee.on(),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout);
    let mut since = base.as_ref().map(|b| (b.upto, b.typing));
    loop {
        if let Some(since) = since
            && timeout > 0
        {
            wait_for_updates(&s, &r, since, wake, deadline).await;
        }
        let (snapshot, answer, changed) =
            Build::run(&s, &r, &req, base.as_deref(), to_device_since).await?;
        let done = changed
            || base.is_none()
            || timeout == 0
            || tokio::time::Instant::now() >= deadline
            || *s.shutdown.borrow();
        if done {
            let new_pos = s
                .sliding
                .record(user, device, conn_id, pos.as_deref(), snapshot);
            let mut answer = answer;
            answer.set("pos", json!(new_pos));
            if let Some(t) = &req.txn_id {
                answer.set("txn_id", json!(t));
            }
            return Ok(answer.into_response());
        }
        since = Some((snapshot.upto, snapshot.typing));
        // Nothing for this device up to `snapshot.upto` (e.g. another connection of the
        // device acknowledged past our `since`): wake only for newer messages, or the
        // wait would wake again at once for messages that are gone.
        wake.to_device_acked = wake.to_device_acked.map(|a| a.max(snapshot.upto));
    }
}

/// What besides rooms ends a long-poll: the enabled `to_device` and `e2ee` extensions.
#[derive(Clone, Copy)]
struct Wake {
    /// `to_device` on: a message after this (acknowledged) position wakes.
    to_device_acked: Option<u64>,
    /// `e2ee` on: a device-list change of a room-mate wakes.
    device_lists: bool,
}

/// Waits until something that may concern the user happened after `since`, the
/// deadline passed, or the server shuts down. Like `/sync`'s long-poll, the check runs
/// from memory (rooms' last activity, per-user and per-room last changes).
async fn wait_for_updates(
    s: &AppState,
    r: &Requester,
    since: (u64, u64),
    wake: Wake,
    deadline: tokio::time::Instant,
) {
    let user = r.user_id.as_str();
    let mut applied_rx = s.projections.runtime.subscribe();
    let mut typing_rx = s.typing.subscribe();
    let mut shutdown = s.shutdown.clone();
    let (_, joined) = s.projections.membership.joined_kept(user);
    loop {
        applied_rx.borrow_and_update();
        typing_rx.borrow_and_update();
        if *shutdown.borrow_and_update() {
            return;
        }
        if crate::sync::has_updates(s, user, &joined, since, s.projections.runtime.applied())
            || crate::sync::e2ee_has_updates(
                s,
                r,
                &joined,
                wake.device_lists.then_some(since.0),
                wake.to_device_acked,
            )
        {
            return;
        }
        tokio::select! {
            _ = applied_rx.changed() => {}
            _ = typing_rx.changed() => {}
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep_until(deadline) => return,
        }
    }
}

/// A room's type (`m.room.create` content `type`), cached: it never changes.
fn room_type(s: &AppState, room: &str) -> Option<String> {
    if let Some(t) = s.sliding.room_types.lock().get(room) {
        return t.clone();
    }
    let t = s
        .projections
        .state
        .room(room)
        .and_then(|meta| s.projections.timeline.event(&meta.create_event_id))
        .and_then(|ev| ev.pdu.content_value()["type"].as_str().map(str::to_owned));
    let mut cache = s.sliding.room_types.lock();
    if cache.len() >= s.sliding.room_types_max {
        cache.clear();
    }
    cache.insert(room.to_owned(), t.clone());
    t
}

/// Writes a state event loaded for `required_state` (a member event, a state delta)
/// onto `out`: like [`write_render`] but without `prev_content`, which would cost a
/// lookup in the full state (whose depth grows with the member count) and which
/// room-state consumers do not need. Non-member state of an initial room comes from
/// the rendered-state cache instead ([`StateItem::Rendered`]).
fn write_state(s: &AppState, ev: &EventRecord, out: &mut Vec<u8>) {
    let age = crate::now_ms().saturating_sub(u64::from(ev.pdu.origin_server_ts.0));
    // A redaction of the same room only, as everywhere else (`read::redaction_of`).
    if let Some(redaction) = crate::read::redaction_of(s, ev) {
        let mut v = ev.pdu.to_redacted_client_event(&redaction.pdu);
        v["unsigned"]["age"] = json!(age);
        crate::read::without_room_id(&mut v);
        let _ = serde_json::to_writer(&mut *out, &v);
        return;
    }
    let mut unsigned = serde_json::Map::new();
    unsigned.insert("age".into(), json!(age));
    ev.pdu
        .write_client_event(out, ClientFormat::WithoutRoomId, Some(&unsigned));
}

/// A `required_state` entry to write: one event of a cached rendered state
/// ([`crate::state_render`], with `prev_content`, as `/state`), or an event loaded for
/// this answer ([`write_state`]: members and state deltas).
enum StateItem {
    Rendered(std::sync::Arc<RenderedState>, usize),
    Event(EventRecord),
}

/// One room selected by the request: its merged config and the lists naming it.
struct Selected {
    membership: Membership,
    config: RoomConfig,
    lists: BTreeSet<String>,
    subscribed: bool,
    /// Recency sort key (also `bump_stamp`).
    recency: u64,
}

struct Build<'a> {
    s: &'a AppState,
    r: &'a Requester,
    user: &'a str,
    device: &'a str,
    req: &'a SlidingRequest,
    base: Option<&'a Snapshot>,
    upto: u64,
    /// Rooms named in the user's `m.direct`.
    dm_rooms: BTreeSet<String>,
    /// Per-request cache: room -> (is_encrypted, room type).
    room_facts: HashMap<String, (bool, Option<String>)>,
    /// The `to_device` extension's `since`: messages up to it are acknowledged.
    to_device_since: Option<u64>,
    /// The user's joined rooms (the `e2ee` extension's device-list changes).
    joined: spindle_projections::change_index::SortedKeys,
    /// The users the requester ignores (`m.ignored_user_list`, read once): their
    /// invites, non-state timeline events, typing and receipts are left out, as in
    /// `/sync`.
    ignored: std::collections::HashSet<String>,
}

impl<'a> Build<'a> {
    /// Builds one response: (the snapshot to record, the JSON, whether anything
    /// changed for the connection).
    async fn run(
        s: &'a AppState,
        r: &'a Requester,
        req: &'a SlidingRequest,
        base: Option<&'a Snapshot>,
        to_device_since: Option<u64>,
    ) -> ApiResult<(Snapshot, JsonOut, bool)> {
        let mut upto = s.projections.runtime.applied();
        // As in /sync: the membership projection may be ahead of the slowest one; let
        // everything reach the newest membership change so rooms classify consistently.
        let (rooms, joined) = loop {
            // Memory: the membership projection keeps every user's room list.
            let (rooms, joined) = s.projections.membership.joined_kept(&r.user_id);
            let newest = rooms.values().map(|m| m.position).max().unwrap_or(0);
            if newest <= upto {
                break (rooms, joined);
            }
            s.wait_for(newest).await?;
            upto = s.projections.runtime.applied();
        };
        let typing = s.typing.current();
        let dm_rooms = s
            .projections
            .account_data
            .get(&r.user_id, None, "m.direct")
            .and_then(|v| v.as_object().cloned())
            .map(|m| {
                m.values()
                    .filter_map(|v| v.as_array())
                    .flatten()
                    .filter_map(|r| r.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let mut b = Build {
            s,
            r,
            user: &r.user_id,
            device: &r.device_id,
            req,
            base,
            upto,
            dm_rooms,
            room_facts: HashMap::new(),
            to_device_since,
            joined,
            ignored: crate::read::ignored_users(s, &r.user_id),
        };
        b.respond(&rooms, typing)
    }

    fn respond(
        &mut self,
        rooms: &BTreeMap<String, Membership>,
        typing: u64,
    ) -> ApiResult<(Snapshot, JsonOut, bool)> {
        let s = self.s;
        // The user's room list, newest first (memory only: the timeline projection's
        // last activity per room, or the membership's own position when not joined).
        let listed: Vec<(&String, &Membership)> = rooms
            .iter()
            .filter(|(room, m)| self.in_room_list(room, m))
            .collect();
        let stamps = s
            .projections
            .timeline
            .recencies(listed.iter().map(|(room, _)| room.as_str()));
        let mut ordered: Vec<(u64, &String, &Membership)> = listed
            .into_iter()
            .zip(stamps)
            .map(|((room, m), stamp)| (self.recency_from(stamp, m), room, m))
            .collect();
        // Room ids are unique: an unstable sort orders them as a stable one would.
        ordered.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));

        let mut selected: BTreeMap<String, Selected> = BTreeMap::new();
        let mut lists_out = serde_json::Map::new();
        let mut list_counts = BTreeMap::new();
        let req = self.req;
        for (name, list) in &req.lists {
            let matching: Vec<&(u64, &String, &Membership)> = ordered
                .iter()
                .filter(|(_, room, m)| self.passes(&list.filters, room, m))
                .collect();
            let count = matching.len() as u64;
            list_counts.insert(name.clone(), count);
            lists_out.insert(name.clone(), json!({ "count": count }));
            let ranges = list.ranges.clone().unwrap_or_else(|| {
                if count == 0 {
                    vec![]
                } else {
                    vec![(0, count - 1)]
                }
            });
            for (start, end) in ranges {
                let end = end.min(start.saturating_add(request::MAX_RANGE_ROOMS - 1));
                for (recency, room, m) in matching
                    .iter()
                    .skip(start as usize)
                    .take((end - start + 1) as usize)
                {
                    let e = match selected.entry((*room).clone()) {
                        // A room in several lists: the union of their configs.
                        std::collections::btree_map::Entry::Occupied(o) => {
                            let e = o.into_mut();
                            e.config.merge(&list.config);
                            e
                        }
                        std::collections::btree_map::Entry::Vacant(v) => v.insert(Selected {
                            membership: (*m).clone(),
                            config: list.config.clone(),
                            lists: BTreeSet::new(),
                            subscribed: false,
                            recency: *recency,
                        }),
                    };
                    e.lists.insert(name.clone());
                }
            }
        }
        for (room, config) in &req.room_subscriptions {
            // Subscriptions to rooms the user has no visible membership in are ignored
            // (MSC4186: "should be ignored by the server").
            let Some(m) = s.projections.membership.get(room, self.user) else {
                continue;
            };
            if !self.may_subscribe(&m) {
                continue;
            }
            let recency = self.recency(room, &m);
            match selected.entry(room.clone()) {
                std::collections::btree_map::Entry::Occupied(o) => {
                    let e = o.into_mut();
                    e.config.merge(config);
                    e.subscribed = true;
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(Selected {
                        membership: m,
                        config: config.clone(),
                        lists: BTreeSet::new(),
                        subscribed: true,
                        recency,
                    });
                }
            }
        }

        let empty = Snapshot::default();
        let base = self.base.unwrap_or(&empty);
        let mut next = Snapshot {
            upto: self.upto,
            typing,
            rooms: base.rooms.clone(),
            extensions: BTreeSet::new(),
            lists: list_counts,
            dm_rooms: self.dm_rooms.clone(),
        };
        let mut rooms_out = Vec::new();
        let mut initial_rooms = BTreeSet::new();
        for (room, sel) in &selected {
            let sent = base.rooms.get(room);
            if let Some((value, now_sent, initial)) = self.room(room, sel, sent) {
                if initial {
                    initial_rooms.insert(room.clone());
                }
                if let Some(v) = value {
                    rooms_out.push((room.clone(), v));
                }
                next.rooms.insert(room.clone(), now_sent);
            }
        }

        let (extensions, news) =
            self.extensions(&selected, &initial_rooms, base, typing, &mut next);
        let changed =
            !rooms_out.is_empty() || news || self.base.is_none_or(|b| b.lists != next.lists);
        let mut answer = JsonOut::object();
        answer.set("lists", Value::Object(lists_out));
        answer.set("rooms", JsonOut::Object(rooms_out));
        answer.set("extensions", extensions);
        Ok((next, answer, changed))
    }

    /// Whether a membership puts the room in the user's room list (MSC4186 "Lists"):
    /// joined, invited, knocked; kicked or banned after having been in the room; left
    /// by themselves only while the connection still has to learn of it.
    fn in_room_list(&self, room: &str, m: &Membership) -> bool {
        if m.forgotten || m.position > self.upto {
            return false;
        }
        match m.membership.as_str() {
            "invite" => !self.ignored.contains(&m.sender),
            "join" | "knock" => true,
            "leave" if m.sender == self.user => self.base.is_some_and(|b| {
                b.rooms
                    .get(room)
                    .is_some_and(|sent| sent.membership != "leave")
            }),
            "leave" | "ban" => self.was_in_room(m),
            _ => false,
        }
    }

    /// Whether a room subscription may show the room: any current membership but a
    /// forgotten one, and for a leave or ban only after having been in the room.
    fn may_subscribe(&self, m: &Membership) -> bool {
        if m.forgotten || m.position > self.upto {
            return false;
        }
        match m.membership.as_str() {
            "join" | "invite" | "knock" => true,
            "leave" | "ban" => self.was_in_room(m),
            _ => false,
        }
    }

    /// Whether the user was joined, invited or knocking right before their leave or
    /// ban (a ban of someone who was never in the room is not theirs to see).
    fn was_in_room(&self, m: &Membership) -> bool {
        self.s
            .projections
            .state
            .state_event_roots(&m.event_id)
            .and_then(|r| crate::visibility::membership_at(self.s, r.before, self.user))
            .is_some_and(|prev| prev == "join" || prev == "invite" || prev == "knock")
    }

    /// The recency sort key and `bump_stamp` (MSC4186): while joined, the position of
    /// the room's last event of a bump type ([`BUMP_EVENT_TYPES`]: a reaction, a state
    /// change or the user's own profile change does not move the room); otherwise the
    /// membership's own position (later activity is not theirs to see). Memory only.
    /// A room whose bumps are unknown (data from before the timeline projection kept
    /// them) falls back to its last activity.
    ///
    /// [`BUMP_EVENT_TYPES`]: spindle_projections::timeline::BUMP_EVENT_TYPES
    fn recency(&self, room: &str, m: &Membership) -> u64 {
        let stamp = (m.membership == "join")
            .then(|| self.s.projections.timeline.recencies([room])[0])
            .flatten();
        self.recency_from(stamp, m)
    }

    /// [`Build::recency`] from the room's stamp as [`Timeline::recencies`] gives it
    /// (asked for every room of the list at once).
    ///
    /// [`Timeline::recencies`]: spindle_projections::timeline::Timeline::recencies
    fn recency_from(&self, stamp: Option<u64>, m: &Membership) -> u64 {
        if m.membership == "join" {
            stamp.unwrap_or(m.position).min(self.upto)
        } else {
            m.position
        }
    }

    /// Whether a room passes a list's filters.
    fn passes(&mut self, f: &ListFilters, room: &str, m: &Membership) -> bool {
        let invited = m.membership == "invite";
        if let Some(want) = f.is_invite
            && want != invited
        {
            return false;
        }
        if let Some(want) = f.is_dm
            && want != self.is_dm(room, m)
        {
            return false;
        }
        let needs_facts =
            f.is_encrypted.is_some() || f.room_types.is_some() || !f.not_room_types.is_empty();
        if needs_facts {
            let (encrypted, room_type) = self.facts(room, m);
            if let Some(want) = f.is_encrypted
                && want != encrypted
            {
                return false;
            }
            if f.not_room_types.contains(&room_type) {
                return false;
            }
            if let Some(types) = &f.room_types
                && !types.contains(&room_type)
            {
                return false;
            }
        }
        if let Some(spaces) = &f.spaces
            && !spaces.iter().any(|space| self.space_has_child(space, room))
        {
            return false;
        }
        if f.tags.is_some() || !f.not_tags.is_empty() {
            // One point read: the room's `m.tag` account data.
            let tags: Vec<String> = self
                .s
                .projections
                .account_data
                .get(self.user, Some(room), "m.tag")
                .and_then(|c| c["tags"].as_object().map(|t| t.keys().cloned().collect()))
                .unwrap_or_default();
            if tags.iter().any(|t| f.not_tags.contains(t)) {
                return false;
            }
            if let Some(want) = &f.tags
                && !tags.iter().any(|t| want.contains(t))
            {
                return false;
            }
        }
        true
    }

    /// `is_dm`: in the user's `m.direct`, or an invite marked `is_direct`.
    fn is_dm(&self, room: &str, m: &Membership) -> bool {
        self.dm_rooms.contains(room)
            || (m.membership == "invite"
                && self
                    .s
                    .projections
                    .timeline
                    .event(&m.event_id)
                    .is_some_and(|ev| ev.pdu.content_value()["is_direct"] == json!(true)))
    }

    /// (is encrypted, room type) of a room, as the user may see it: the current state
    /// when joined, the state at their membership event otherwise. Point lookups.
    fn facts(&mut self, room: &str, m: &Membership) -> (bool, Option<String>) {
        if let Some(f) = self.room_facts.get(room) {
            return f.clone();
        }
        let s = self.s;
        let root = if m.membership == "join" {
            s.projections.state.current_root(room)
        } else {
            s.projections
                .state
                .state_event_roots(&m.event_id)
                .map(|r| r.others_after)
        };
        let encrypted = root
            .and_then(|root| s.projections.state.lookup(root, "m.room.encryption", ""))
            .is_some();
        let room_type = room_type(s, room);
        let f = (encrypted, room_type);
        self.room_facts.insert(room.to_owned(), f.clone());
        f
    }

    /// Whether `room` is an `m.space.child` of `space` (a space the user is joined to;
    /// MSC4186: unknown or unjoined spaces are ignored, subspaces are not followed).
    fn space_has_child(&self, space: &str, room: &str) -> bool {
        let s = self.s;
        if s.projections
            .membership
            .get(space, self.user)
            .is_none_or(|m| m.membership != "join")
        {
            return false;
        }
        let Some(root) = s.projections.state.current_root(space) else {
            return false;
        };
        s.projections
            .state
            .lookup(root, "m.space.child", room)
            .and_then(|id| s.projections.timeline.event(&id))
            .is_some_and(|ev| {
                ev.pdu.content_value()["via"]
                    .as_array()
                    .is_some_and(|v| !v.is_empty())
            })
    }

    /// One room's result: `None` to leave the connection's record unchanged; else the
    /// JSON to send (`None` when nothing changed), the new record, and whether it is
    /// sent in full (`initial`).
    fn room(
        &self,
        room: &str,
        sel: &Selected,
        sent: Option<&RoomSent>,
    ) -> Option<(Option<JsonOut>, RoomSent, bool)> {
        let m = &sel.membership;
        match m.membership.as_str() {
            "invite" | "knock" => self.stripped_room(room, sel, sent),
            _ => self.full_room(room, sel, sent),
        }
    }

    /// An invite or knock: the stripped state of the membership event, once.
    fn stripped_room(
        &self,
        room: &str,
        sel: &Selected,
        sent: Option<&RoomSent>,
    ) -> Option<(Option<JsonOut>, RoomSent, bool)> {
        let m = &sel.membership;
        if sent.is_some_and(|x| x.membership == m.membership && x.upto >= m.position) {
            return None;
        }
        let events = crate::sync::invite_state(self.s, m)?;
        let is_dm = self.is_dm(room, m);
        let mut v = json!({
            "initial": true,
            "membership": m.membership,
            "invite_state": events,
            "bump_stamp": sel.recency,
        });
        if is_dm {
            v["is_dm"] = json!(true);
        }
        let v = JsonOut::from(v);
        let now = RoomSent {
            upto: m.position,
            membership: m.membership.clone(),
            fields: RoomFields {
                bump_stamp: sel.recency,
                is_dm,
                ..Default::default()
            },
            ..Default::default()
        };
        Some((Some(v), now, true))
    }

    /// A room the user is or was joined to.
    fn full_room(
        &self,
        room: &str,
        sel: &Selected,
        sent: Option<&RoomSent>,
    ) -> Option<(Option<JsonOut>, RoomSent, bool)> {
        let s = self.s;
        let m = &sel.membership;
        let config = &sel.config;
        let joined = m.membership == "join";
        let access = if joined {
            Access {
                membership: Some(m.clone()),
                cap: u64::MAX,
                was_joined: false,
                left_at: None,
            }
        } else {
            room_access(s, self.user, room).ok()?
        };
        let end = self.upto.min(access.cap);
        // A room first sent as an invite or knock (stripped state only) is sent in full
        // once joined; a join that became a leave is a delta up to the leave.
        let initial = sent.is_none_or(|x| matches!(x.membership.as_str(), "invite" | "knock"));
        let expanded = !initial && sent.is_some_and(|x| config.timeline_limit > x.timeline_limit);
        let state_expanded =
            !initial && sent.is_some_and(|x| !x.required_state.covers(&config.required_state));
        let is_dm = self.is_dm(room, m);
        let base_upto = self.base.map(|b| b.upto).unwrap_or(0);
        if let Some(x) = sent
            && !initial
            && !expanded
            && !state_expanded
            && x.fields.is_dm == is_dm
            && x.fields.bump_stamp == sel.recency
            && s.projections
                .timeline
                .last_activity(room)
                .unwrap_or(0)
                .min(end)
                <= x.upto
            && s.projections.receipts.last_change(room) <= base_upto
        {
            // Nothing new for this room: answered from memory.
            return None;
        }

        // Timeline: the newest `timeline_limit` visible events after what was sent
        // (everything, for an initial or expanded room).
        let after = match sent {
            Some(x) if !initial && !expanded => x.upto,
            _ => 0,
        };
        let (timeline, limited) =
            crate::sync::newest_events(s, room, after, end, config.timeline_limit, |ev| {
                !crate::read::hidden_by_ignore(&self.ignored, ev)
                    && can_see(s, self.user, &access, ev)
            });
        let live_after = match sent {
            Some(x) if !initial => Some(x.upto),
            _ => self.base.map(|b| b.upto),
        };
        let num_live = live_after
            .map(|p| timeline.iter().filter(|e| e.position > p).count())
            .unwrap_or(0);

        // The state at `end`: roots after the room's last event at or before it.
        let (full_root, others_root) = self.roots_at(room, end);
        let mut lazy_sent = sent.map(|x| x.lazy_sent.clone()).unwrap_or_default();
        if initial {
            lazy_sent.clear();
        }
        let current = joined && end == self.upto;
        let required_state = if initial || state_expanded {
            self.full_state(
                room,
                &config.required_state,
                full_root,
                others_root,
                &timeline,
                &mut lazy_sent,
                current,
            )
        } else {
            let x = sent.expect("not initial");
            let (from_full, _) = self.roots_at(room, x.upto);
            self.state_delta(
                room,
                &config.required_state,
                from_full,
                full_root,
                &timeline,
                &mut lazy_sent,
                current,
            )
            .into_iter()
            .map(StateItem::Event)
            .collect()
        };
        if lazy_sent.len() > MAX_LAZY_REMEMBERED {
            lazy_sent.clear();
        }

        let fields = self.fields(room, m, others_root, sel.recency, is_dm, joined, end);
        let old = sent.map(|x| x.fields.clone()).unwrap_or_default();
        let changed = initial
            || expanded
            || !timeline.is_empty()
            || !required_state.is_empty()
            || fields != old;
        let mut now = RoomSent {
            upto: end,
            membership: m.membership.clone(),
            timeline_limit: config.timeline_limit,
            required_state: config.required_state.clone(),
            lazy_sent,
            fields: fields.clone(),
        };
        if let Some(x) = sent
            && !initial
        {
            now.timeline_limit = now.timeline_limit.max(x.timeline_limit);
            now.required_state.merge(&x.required_state);
        }
        if !changed {
            return Some((None, now, false));
        }

        let viewer = Some((self.user, self.device));
        let mut v = json!({ "membership": m.membership });
        if initial {
            v["initial"] = json!(true);
        }
        if expanded {
            v["unstable_expanded_timeline"] = json!(true);
        }
        if (initial || fields.name != old.name)
            && let Some(n) = &fields.name
        {
            v["name"] = json!(n);
        }
        if initial || fields.avatar != old.avatar {
            match &fields.avatar {
                Some(a) => v["avatar"] = json!(a),
                None if !initial => v["avatar"] = Value::Null,
                None => {}
            }
        }
        if (initial || fields.heroes != old.heroes) && !fields.heroes.is_empty() {
            v["heroes"] = Value::Array(
                fields
                    .heroes
                    .iter()
                    .map(|u| {
                        let mut h = json!({ "user_id": u });
                        if let Some(mm) = s.projections.membership.get(room, u) {
                            if let Some(d) = mm.displayname {
                                h["displayname"] = json!(d);
                            }
                            if let Some(a) = mm.avatar_url {
                                h["avatar_url"] = json!(a);
                            }
                        }
                        h
                    })
                    .collect(),
            );
        }
        if (initial && fields.is_dm) || (!initial && fields.is_dm != old.is_dm) {
            v["is_dm"] = json!(fields.is_dm);
        }
        if initial || fields.counts != old.counts {
            v["joined_count"] = json!(fields.counts.0);
            v["invited_count"] = json!(fields.counts.1);
        }
        if joined && (initial || fields.unread != old.unread) {
            v["notification_count"] = json!(fields.unread.0);
            v["highlight_count"] = json!(fields.unread.1);
        }
        if initial || fields.bump_stamp != old.bump_stamp {
            v["bump_stamp"] = json!(fields.bump_stamp);
        }
        let mut timeline_json = None;
        if !timeline.is_empty() || initial || expanded {
            timeline_json = Some(json_text::array(&timeline, |e, out| {
                write_render(s, e, viewer, ClientFormat::WithoutRoomId, out)
            }));
            v["limited"] = json!(limited);
            v["num_live"] = json!(num_live);
            v["prev_batch"] = json!(
                timeline
                    .first()
                    .map(|e| token(e.position - 1))
                    .unwrap_or_else(|| token(end))
            );
        }
        let mut room_out = JsonOut::from(v);
        if let Some(t) = timeline_json {
            room_out.set("timeline", t);
        }
        if !required_state.is_empty() || initial {
            room_out.set(
                "required_state",
                json_text::array(&required_state, |e, out| match e {
                    StateItem::Rendered(r, i) => {
                        r.events[*i].write_to(out, None, viewer, crate::now_ms())
                    }
                    StateItem::Event(ev) => write_state(s, ev, out),
                }),
            );
        }
        Some((Some(room_out), now, initial))
    }

    /// (full, non-member) state roots after every record of the room at or before
    /// `pos`.
    fn roots_at(&self, room: &str, pos: u64) -> (Root, Root) {
        self.s
            .projections
            .state
            .roots_at_position(room, pos)
            .unwrap_or_else(|| (Root::empty(), Root::empty()))
    }

    /// A member event by point lookup: through the membership projection when the
    /// state wanted is the current one (one read, whatever the member count), else in
    /// the trie at `root`.
    fn member_event(&self, room: &str, user: &str, root: Root, current: bool) -> Option<String> {
        if current {
            self.s
                .projections
                .membership
                .get(room, user)
                .map(|m| m.event_id)
        } else {
            self.s.projections.state.lookup(root, "m.room.member", user)
        }
    }

    /// The users `$LAZY` asks for: the timeline's senders and the targets of its
    /// member events (MSC4186 "Lazy loaded memberships").
    fn lazy_users(&self, timeline: &[EventRecord]) -> Vec<String> {
        let mut users = Vec::new();
        for e in timeline {
            let sender = e.pdu.sender.to_string();
            if !users.contains(&sender) {
                users.push(sender);
            }
            if e.pdu.kind.to_string() == "m.room.member"
                && let Some(target) = &e.pdu.state_key
                && !users.contains(target)
            {
                users.push(target.clone());
            }
        }
        users
    }

    /// Every state entry `required_state` asks for at the roots. The non-member entries
    /// come from the rendered state of the non-member root (`crate::state_render`: keyed
    /// by the root, so a room whose state did not change since any earlier request reads
    /// and renders none of them, and the entries asked for are picked from a handful of
    /// rendered events); members by point lookup (`$ME`, the lazy members of the
    /// timeline) or by scanning the full root when asked for all of them. A wildcard
    /// state key across every type (rare) walks the full state.
    #[allow(clippy::too_many_arguments)]
    fn full_state(
        &self,
        room: &str,
        rs: &RequiredState,
        full: Root,
        others: Root,
        timeline: &[EventRecord],
        lazy_sent: &mut BTreeSet<String>,
        current: bool,
    ) -> Vec<StateItem> {
        let s = self.s;
        let state = &s.projections.state;
        let mut items: Vec<StateItem> = Vec::new();
        // The ids to write, in order, each once (a set beside: every member may be in).
        let mut ids: Vec<String> = Vec::new();
        let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
        let mut push_id = |ids: &mut Vec<String>, id: String| {
            if seen.insert(id.clone()) {
                ids.push(id);
            }
        };
        // Non-member state: every rendered event of `others` that is asked for.
        let wants_others = rs
            .include
            .iter()
            .any(|(t, k)| t != "m.room.member" && !(t == "*" && k != "*"));
        if wants_others {
            let rendered = s.state_render.get(s, room, others);
            for (i, e) in rendered.events.iter().enumerate() {
                if rs.matches(&e.event_type, &e.state_key, self.user) {
                    push_id(&mut ids, e.event_id.clone());
                    items.push(StateItem::Rendered(rendered.clone(), i));
                }
            }
        }
        // Every member (`["m.room.member", "*"]` or `["*", "*"]`): one scan.
        if rs.all_members() {
            for (k2, id) in state.entries_of_type(full, "m.room.member") {
                if rs.matches("m.room.member", &k2, self.user) {
                    push_id(&mut ids, id);
                }
            }
        }
        for (t, k) in &rs.include {
            match (t.as_str(), k.as_str()) {
                ("*", "*") | ("m.room.member", "*") => {}
                ("*", key) => {
                    // Rare: one state key across every type needs the whole state.
                    let key = if key == "$ME" { self.user } else { key };
                    for (t2, k2, id) in state.entries(full) {
                        if k2 == key && rs.matches(&t2, &k2, self.user) {
                            push_id(&mut ids, id);
                        }
                    }
                }
                ("m.room.member", key) => {
                    let key = if key == "$ME" { self.user } else { key };
                    // The entry is one of `include`'s: only `exclude` can drop it.
                    if rs.excluded("m.room.member", key, self.user) {
                        continue;
                    }
                    if let Some(id) = self.member_event(room, key, full, current) {
                        push_id(&mut ids, id);
                    }
                }
                // Non-member entries: from the rendered state above.
                _ => {}
            }
        }
        if rs.lazy {
            for u in self.lazy_users(timeline) {
                if let Some(id) = self.member_event(room, &u, full, current) {
                    push_id(&mut ids, id);
                }
                lazy_sent.insert(u);
            }
        }
        let rendered = items.len();
        items.extend(
            ids[rendered..]
                .iter()
                .filter_map(|id| s.projections.timeline.event(id))
                .map(StateItem::Event),
        );
        items
    }

    /// The state that changed between `from` and `to` and that `required_state` asks
    /// for (cost: the size of the change), plus lazy members of new senders.
    #[allow(clippy::too_many_arguments)]
    fn state_delta(
        &self,
        room: &str,
        rs: &RequiredState,
        from: Root,
        to: Root,
        timeline: &[EventRecord],
        lazy_sent: &mut BTreeSet<String>,
        current: bool,
    ) -> Vec<EventRecord> {
        let s = self.s;
        let mut ids: Vec<String> = Vec::new();
        if from != to {
            for change in s.projections.state.diff(from, to) {
                let Some(id) = change
                    .new_value()
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                else {
                    continue;
                };
                let Some(ev) = s.projections.timeline.event(&id) else {
                    continue;
                };
                let kind = ev.pdu.kind.to_string();
                let key = ev.pdu.state_key.clone().unwrap_or_default();
                let lazy_known = rs.lazy && kind == "m.room.member" && lazy_sent.contains(&key);
                if (rs.matches(&kind, &key, self.user) || lazy_known) && !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        if rs.lazy {
            for u in self.lazy_users(timeline) {
                if lazy_sent.contains(&u) {
                    continue;
                }
                if let Some(id) = self.member_event(room, &u, to, current)
                    && !ids.contains(&id)
                {
                    ids.push(id);
                }
                lazy_sent.insert(u);
            }
        }
        ids.iter()
            .filter_map(|id| s.projections.timeline.event(id))
            .collect()
    }

    /// The compared room fields: name (the spec's room-name algorithm: `m.room.name`,
    /// else the canonical alias; clients name the rest from the heroes), avatar,
    /// heroes (only for rooms without a name), counts, unread counts.
    #[allow(clippy::too_many_arguments)]
    fn fields(
        &self,
        room: &str,
        m: &Membership,
        others: Root,
        recency: u64,
        is_dm: bool,
        joined: bool,
        end: u64,
    ) -> RoomFields {
        let s = self.s;
        // The rendered non-member state when the cache holds it (`full_state` rendered
        // it for an initial room) names the events without a trie lookup; else three
        // point lookups (a render of the whole non-member state would cost more). The
        // content is the redacted one when a redaction applies.
        let rendered = s.state_render.peek(s, room, others);
        let content = |kind: &str| match &rendered {
            Some(r) => r
                .events
                .iter()
                .find(|e| e.event_type == kind && e.state_key.is_empty())
                .and_then(|e| {
                    if e.redacted {
                        Some(e.content())
                    } else {
                        s.projections
                            .timeline
                            .event(&e.event_id)
                            .map(|ev| ev.pdu.content_value())
                    }
                }),
            None => s
                .projections
                .state
                .lookup(others, kind, "")
                .and_then(|id| s.projections.timeline.event(&id))
                .map(|ev| crate::read::client_content(s, &ev)),
        };
        let non_empty = |v: &Value| v.as_str().filter(|x| !x.is_empty()).map(str::to_owned);
        let explicit_name = content("m.room.name").and_then(|c| non_empty(&c["name"]));
        let name = explicit_name
            .clone()
            .or_else(|| content("m.room.canonical_alias").and_then(|c| non_empty(&c["alias"])));
        let avatar = content("m.room.avatar").and_then(|c| non_empty(&c["url"]));
        let heroes = if explicit_name.is_none() {
            s.projections
                .room_summary
                .heroes(room, self.user, MAX_HEROES)
        } else {
            vec![]
        };
        let counts = s.projections.room_summary.counts(room);
        let unread = if joined {
            let from = s
                .projections
                .receipts
                .read_position(room, self.user, None)
                .unwrap_or(m.position);
            let c = s.projections.unread(room, self.user, "", from, end);
            (c.notification_count, c.highlight_count)
        } else {
            (0, 0)
        };
        RoomFields {
            name,
            avatar,
            heroes,
            counts: (counts.joined, counts.invited),
            unread,
            bump_stamp: recency,
            is_dm,
        }
    }

    /// The rooms an extension covers: those of the named lists (absent or `*`: every
    /// list) and the named subscriptions (absent or `*`: every subscription).
    fn scope<'s>(
        &self,
        ext: &ExtensionConfig,
        selected: &'s BTreeMap<String, Selected>,
    ) -> Vec<&'s String> {
        let all_lists = ext
            .lists
            .as_ref()
            .is_none_or(|l| l.iter().any(|x| x == "*"));
        let all_subs = ext
            .rooms
            .as_ref()
            .is_none_or(|l| l.iter().any(|x| x == "*"));
        selected
            .iter()
            .filter(|(room, sel)| {
                let by_list = if all_lists {
                    !sel.lists.is_empty()
                } else {
                    ext.lists
                        .as_ref()
                        .is_some_and(|l| l.iter().any(|x| sel.lists.contains(x)))
                };
                let by_room = if all_subs {
                    sel.subscribed
                } else {
                    ext.rooms
                        .as_ref()
                        .is_some_and(|l| l.iter().any(|x| x == *room))
                };
                by_list || by_room
            })
            .map(|(room, _)| room)
            .collect()
    }

    /// The `extensions` of the response (only those that have something to say, and
    /// `to_device`/`e2ee` whenever they are on: their `next_batch` and key counts are
    /// always wanted), and whether any of it is news (ends a long-poll).
    fn extensions(
        &self,
        selected: &BTreeMap<String, Selected>,
        initial_rooms: &BTreeSet<String>,
        base: &Snapshot,
        typing: u64,
        next: &mut Snapshot,
    ) -> (Value, bool) {
        let s = self.s;
        let exts = &self.req.extensions;
        let mut out = serde_json::Map::new();
        let fresh = |name: &str| self.base.is_none() || !base.extensions.contains(name);

        if exts.account_data.on() {
            next.extensions.insert("account_data");
            let all = fresh("account_data");
            let ad = &s.projections.account_data;
            let changes = if !all && ad.last_change(self.user) > base.upto {
                ad.changes(self.user, base.upto, self.upto)
            } else {
                vec![]
            };
            let mut global: Vec<(String, Value)> = if all {
                ad.all(self.user, None)
            } else {
                changes
                    .iter()
                    .filter(|(r, _)| r.is_empty())
                    .filter_map(|(_, t)| Some((t.clone(), ad.get(self.user, None, t)?)))
                    .collect()
            };
            // `m.push_rules` is global account data to clients (as in `/sync`), kept by
            // the push projection: sent when the extension starts and after each
            // change, which also ends a long-poll.
            let rules_changed = all || {
                let last = s.projections.push.rules_last_change(self.user);
                last > base.upto && last <= self.upto
            };
            if rules_changed && let Some(set) = s.projections.push.ruleset(self.user) {
                global.push((
                    "m.push_rules".to_owned(),
                    json!({ "global": crate::push::ruleset_json(&set) }),
                ));
            }
            let global: Vec<Value> = global
                .into_iter()
                .map(|(t, c)| json!({ "type": t, "content": c }))
                .collect();
            let mut rooms = serde_json::Map::new();
            for room in self.scope(&exts.account_data, selected) {
                let entries: Vec<(String, Value)> = if all || initial_rooms.contains(room) {
                    ad.all(self.user, Some(room))
                } else {
                    changes
                        .iter()
                        .filter(|(r, _)| r == room)
                        .filter_map(|(_, t)| Some((t.clone(), ad.get(self.user, Some(room), t)?)))
                        .collect()
                };
                if !entries.is_empty() {
                    rooms.insert(
                        room.clone(),
                        Value::Array(
                            entries
                                .into_iter()
                                .map(|(t, c)| json!({ "type": t, "content": c }))
                                .collect(),
                        ),
                    );
                }
            }
            if !global.is_empty() || !rooms.is_empty() {
                let mut v = serde_json::Map::new();
                if !global.is_empty() {
                    v.insert("global".into(), Value::Array(global));
                }
                if !rooms.is_empty() {
                    v.insert("rooms".into(), Value::Object(rooms));
                }
                out.insert("account_data".into(), Value::Object(v));
            }
        }

        if exts.receipts.on() {
            next.extensions.insert("receipts");
            let all = fresh("receipts");
            let rc = &s.projections.receipts;
            let mut rooms = serde_json::Map::new();
            for room in self.scope(&exts.receipts, selected) {
                if selected[room].membership.membership != "join" {
                    continue;
                }
                let mut pairs: Vec<(String, String, String)> =
                    if all || initial_rooms.contains(room) {
                        let mut p = rc.recent(room, self.upto, INITIAL_RECEIPTS);
                        for t in ["m.read", "m.read.private"] {
                            p.push((self.user.to_owned(), t.to_owned(), String::new()));
                        }
                        p
                    } else if rc.last_change(room) > base.upto {
                        rc.changes(room, base.upto, self.upto)
                    } else {
                        continue;
                    };
                pairs.sort();
                pairs.dedup();
                let mut content = serde_json::Map::new();
                for (user, kind, thread) in pairs {
                    // Private receipts are only ever the requester's own; ignored
                    // users' are left out.
                    if (kind == "m.read.private" && user != self.user)
                        || self.ignored.contains(&user)
                    {
                        continue;
                    }
                    let Some(rec) = rc.get(room, &user, &kind, &thread) else {
                        continue;
                    };
                    let mut entry = json!({ "ts": rec.ts });
                    if let Some(t) = &rec.thread_id {
                        entry["thread_id"] = json!(t);
                    }
                    let by_event = content
                        .entry(rec.event_id.clone())
                        .or_insert_with(|| json!({}));
                    by_event[&kind][&user] = entry;
                }
                if !content.is_empty() {
                    rooms.insert(
                        room.clone(),
                        json!({ "type": "m.receipt", "content": content }),
                    );
                }
            }
            if !rooms.is_empty() {
                out.insert("receipts".into(), json!({ "rooms": rooms }));
            }
        }

        if exts.typing.on() {
            next.extensions.insert("typing");
            let all = fresh("typing");
            let mut rooms = serde_json::Map::new();
            for room in self.scope(&exts.typing, selected) {
                if selected[room].membership.membership != "join" {
                    continue;
                }
                let first = all || initial_rooms.contains(room);
                let changed = s.typing.room_serial(room) > base.typing && typing > base.typing;
                if !first && !changed {
                    continue;
                }
                let mut users = s.typing.users(room);
                users.retain(|u| !self.ignored.contains(u));
                if first && users.is_empty() {
                    continue;
                }
                rooms.insert(
                    room.clone(),
                    json!({ "type": "m.typing", "content": { "user_ids": users } }),
                );
            }
            if !rooms.is_empty() {
                out.insert("typing".into(), json!({ "rooms": rooms }));
            }
        }
        // An extension turned on for an existing connection answers at once (the
        // client waits for its first `next_batch` and key counts).
        let mut news = !out.is_empty()
            || (self.base.is_some()
                && [(exts.to_device.on(), "to_device"), (exts.e2ee.on(), "e2ee")]
                    .iter()
                    .any(|(on, name)| *on && fresh(name)));

        if exts.to_device.on() {
            // MSC3885: every message after `since` (all pending ones without it), at
            // most `limit`; `next_batch` is what the next request's `since` acknowledges.
            next.extensions.insert("to_device");
            let limit = exts
                .to_device
                .limit
                .map_or(crate::to_device::MAX_TO_DEVICE_PER_SYNC, |l| {
                    l.clamp(1, crate::to_device::MAX_TO_DEVICE_PER_SYNC as u64) as usize
                });
            let after = self.to_device_since.unwrap_or(0);
            let pending =
                s.projections
                    .to_device
                    .pending(self.user, self.device, after, self.upto, limit);
            let next_batch = match (pending.truncated, pending.last_position) {
                (true, Some(p)) => p,
                _ => self.upto.max(after),
            };
            news |= !pending.events.is_empty();
            out.insert(
                "to_device".into(),
                json!({ "next_batch": next_batch.to_string(), "events": pending.events }),
            );
        }

        if exts.e2ee.on() {
            // MSC3884: device-list changes since this connection's last `e2ee`
            // answer (none in its first), the device's key counts.
            next.extensions.insert("e2ee");
            let since = (!fresh("e2ee")).then_some(base.upto);
            let d = crate::sync::device_sections(s, self.r, &self.joined, since, self.upto);
            news |= !d.device_lists.changed.is_empty() || !d.device_lists.left.is_empty();
            out.insert(
                "e2ee".into(),
                json!({
                    "device_lists": { "changed": d.device_lists.changed, "left": d.device_lists.left },
                    "device_one_time_keys_count": d.one_time_key_counts,
                    "device_unused_fallback_key_types": d.unused_fallback_key_types,
                }),
            );
        }
        (Value::Object(out), news)
    }
}
