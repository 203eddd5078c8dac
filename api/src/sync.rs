//! `GET /sync` (spec: client-server API "Syncing"), filters, and long-polling.
//!
//! Tokens are `s<position>_<typing>`: the highest journal position every projection
//! has applied when the response was built (never ahead, BRIEF §3.6) and the typing
//! counter. Incremental syncs scan only the user's own rooms from the token, through
//! the (room, position) index; the room list is the membership projection's in-memory
//! copy, so a room with no activity since the token costs in-memory comparisons and no
//! store read (BRIEF §4, "incremental /sync"; issue 18: the same cost in 5 rooms or 500).

use std::{
    cell::{Cell, RefCell},
    collections::{BTreeSet, HashSet},
    sync::Arc,
    time::Duration,
};

use axum::{Router, extract::State, routing::get};
use serde_json::{Value, json};
use spindle_core::{pdu::Pdu, trie::Root};
use spindle_journal::{CommandBody, Fact};
use spindle_projections::{
    change_index::SortedKeys, membership::Membership, timeline::EventRecord, user_data::Receipt,
};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
    json_text::{self, JsonOut},
    lazy_members::DeviceSent,
    read::{EventFormat, events_json, hidden_by_ignore, lazy_members, token, write_render_as},
    state_render::{RenderedState, RenderedStateEvent},
    visibility::{Access, can_see},
};

/// Threads whose unread counts one room's sync entry computes at most.
pub const THREADS_COUNTED_MAX: usize = 100;

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/_matrix/client/v3/sync", get(sync))
}

fn string_list(v: &Value, name: &str) -> ApiResult<Option<Vec<String>>> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(str::to_owned).ok_or_else(|| {
                    MatrixError::bad_json(format!("{name} must be a list of strings"))
                })
            })
            .collect::<ApiResult<Vec<_>>>()
            .map(Some),
        Some(_) => Err(MatrixError::bad_json(format!(
            "{name} must be a list of strings"
        ))),
    }
}

/// `name` as a list of strings each passing `valid` (a user id for `senders`, a room
/// id for `rooms`, as Synapse's filter schema checks); anything else is 400
/// `M_BAD_JSON`.
fn id_list(
    v: &Value,
    name: &str,
    what: &str,
    valid: fn(&str) -> bool,
) -> ApiResult<Option<Vec<String>>> {
    let list = string_list(v, name)?;
    if let Some(bad) = list.iter().flatten().find(|x| !valid(x)) {
        return Err(MatrixError::bad_json(format!(
            "{name} must list {what}s, not {bad:?}"
        )));
    }
    Ok(list)
}

fn is_user_id(s: &str) -> bool {
    s.starts_with('@') && s.contains(':')
}

fn is_room_id(s: &str) -> bool {
    s.starts_with('!')
}

/// An optional boolean field; anything but a boolean or null is 400 `M_BAD_JSON`.
fn opt_bool(v: &Value, name: &str) -> ApiResult<Option<bool>> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(MatrixError::bad_json(format!("{name} must be a boolean"))),
    }
}

/// Parses the `filter` query parameter's inline JSON: not JSON is 400 `M_NOT_JSON`
/// (as Synapse's `/sync` and `/messages`); the shape is checked by the caller.
pub(crate) fn inline_filter_json(raw: &str) -> ApiResult<Value> {
    serde_json::from_str(raw).map_err(|e| MatrixError::not_json(format!("filter is not JSON: {e}")))
}

/// `event_format`: whether it is `federation` (default `client`); anything else is
/// 400 `M_BAD_JSON`.
fn event_format(v: &Value) -> ApiResult<bool> {
    match v.get("event_format") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::String(f)) if f == "client" => Ok(false),
        Some(Value::String(f)) if f == "federation" => Ok(true),
        Some(_) => Err(MatrixError::bad_json(
            "event_format must be \"client\" or \"federation\"",
        )),
    }
}

fn glob(pattern: &str, value: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => value.starts_with(prefix),
        None => pattern == value,
    }
}

/// A `RoomEventFilter` / `EventFilter` (spec: "Filtering").
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// Maximum events to return.
    pub limit: Option<usize>,
    /// Types to include (`*` suffix wildcard).
    pub types: Option<Vec<String>>,
    /// Types to exclude.
    pub not_types: Vec<String>,
    /// Senders to include.
    pub senders: Option<Vec<String>>,
    /// Senders to exclude.
    pub not_senders: Vec<String>,
    /// Rooms to include.
    pub rooms: Option<Vec<String>>,
    /// Rooms to exclude.
    pub not_rooms: Vec<String>,
    /// Lazy-load room members.
    pub lazy_load_members: bool,
    /// With lazy-loading, send a timeline sender's member event even when this device
    /// was sent it already (spec: `include_redundant_members`).
    pub include_redundant_members: bool,
    /// Only events with (true) or without (false) a `url` in their content.
    pub contains_url: Option<bool>,
    /// Per-thread unread counts (spec: `unread_thread_notifications`, on the timeline
    /// filter).
    pub unread_thread_notifications: bool,
    /// `event_format: federation` in this object: honoured by `/messages` and
    /// `/context` (as Synapse); `/sync` reads it from the top-level [`Filter`].
    pub federation_format: bool,
}

impl EventFilter {
    /// Parses a filter object; a non-object or mistyped field is 400 `M_BAD_JSON`.
    pub fn parse(v: &Value) -> ApiResult<EventFilter> {
        if v.is_null() {
            return Ok(EventFilter::default());
        }
        if !v.is_object() {
            return Err(MatrixError::bad_json("filter must be an object"));
        }
        let limit = match v.get("limit") {
            None | Some(Value::Null) => None,
            Some(l) => Some(
                l.as_u64()
                    .ok_or_else(|| MatrixError::bad_json("limit must be a non-negative integer"))?
                    as usize,
            ),
        };
        Ok(EventFilter {
            limit,
            types: string_list(v, "types")?,
            not_types: string_list(v, "not_types")?.unwrap_or_default(),
            senders: id_list(v, "senders", "user id", is_user_id)?,
            not_senders: id_list(v, "not_senders", "user id", is_user_id)?.unwrap_or_default(),
            rooms: id_list(v, "rooms", "room id", is_room_id)?,
            not_rooms: id_list(v, "not_rooms", "room id", is_room_id)?.unwrap_or_default(),
            lazy_load_members: opt_bool(v, "lazy_load_members")?.unwrap_or(false),
            include_redundant_members: opt_bool(v, "include_redundant_members")?.unwrap_or(false),
            contains_url: opt_bool(v, "contains_url")?,
            unread_thread_notifications: opt_bool(v, "unread_thread_notifications")?
                .unwrap_or(false),
            federation_format: event_format(v)?,
        })
    }

    /// Whether an event passes the type and sender clauses.
    pub fn matches(&self, pdu: &Pdu) -> bool {
        let has_url = || {
            pdu.content_value()
                .get("url")
                .is_some_and(|u| u.is_string())
        };
        self.matches_with(&pdu.kind.to_string(), pdu.sender.as_str(), has_url)
    }

    /// [`EventFilter::matches`] on an event's type, sender and whether its
    /// `content.url` is a string.
    pub fn matches_parts(&self, kind: &str, sender: &str, has_url: bool) -> bool {
        self.matches_with(kind, sender, || has_url)
    }

    fn matches_with(&self, kind: &str, sender: &str, has_url: impl FnOnce() -> bool) -> bool {
        if self.not_types.iter().any(|t| glob(t, kind)) {
            return false;
        }
        if let Some(types) = &self.types
            && !types.iter().any(|t| glob(t, kind))
        {
            return false;
        }
        if self.not_senders.iter().any(|s| s == sender) {
            return false;
        }
        if let Some(senders) = &self.senders
            && !senders.iter().any(|s| s == sender)
        {
            return false;
        }
        if let Some(want) = self.contains_url
            && has_url() != want
        {
            return false;
        }
        true
    }

    /// Whether a data type passes (for account data filters).
    pub fn matches_type(&self, kind: &str) -> bool {
        !self.not_types.iter().any(|t| glob(t, kind))
            && self
                .types
                .as_ref()
                .is_none_or(|ts| ts.iter().any(|t| glob(t, kind)))
    }

    fn allows_room(&self, room: &str) -> bool {
        !self.not_rooms.iter().any(|r| r == room)
            && self
                .rooms
                .as_ref()
                .is_none_or(|rs| rs.iter().any(|r| r == room))
    }
}

/// A sync filter (spec: `Filter`).
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// `room.timeline`.
    pub timeline: EventFilter,
    /// `room.state`.
    pub state: EventFilter,
    /// `room.ephemeral`.
    pub ephemeral: EventFilter,
    /// `room.account_data`.
    pub room_account_data: EventFilter,
    /// Top-level `account_data`.
    pub account_data: EventFilter,
    /// `room.include_leave`.
    pub include_leave: bool,
    /// `room.rooms` / `room.not_rooms`.
    pub rooms: EventFilter,
    /// Top-level `presence` (types / senders of `m.presence` events).
    pub presence: EventFilter,
    /// `event_format: federation`: events go out as PDUs ([`crate::read::render_federation`]).
    pub federation_format: bool,
}

impl Filter {
    /// Parses a filter definition; malformed: 400 `M_BAD_JSON`.
    pub fn parse(v: &Value) -> ApiResult<Filter> {
        if !v.is_object() {
            return Err(MatrixError::bad_json("filter must be an object"));
        }
        let room = v.get("room").cloned().unwrap_or(Value::Null);
        if !room.is_null() && !room.is_object() {
            return Err(MatrixError::bad_json("room filter must be an object"));
        }
        let sub = |name: &str| EventFilter::parse(room.get(name).unwrap_or(&Value::Null));
        let federation_format = event_format(v)?;
        // Checked, not applied: "A server may include more fields than were
        // requested" (spec: `Filter.event_fields`).
        string_list(v, "event_fields")?;
        Ok(Filter {
            federation_format,
            timeline: sub("timeline")?,
            state: sub("state")?,
            ephemeral: sub("ephemeral")?,
            room_account_data: sub("account_data")?,
            account_data: EventFilter::parse(v.get("account_data").unwrap_or(&Value::Null))?,
            presence: EventFilter::parse(v.get("presence").unwrap_or(&Value::Null))?,
            include_leave: opt_bool(&room, "include_leave")?.unwrap_or(false),
            rooms: EventFilter {
                rooms: id_list(&room, "rooms", "room id", is_room_id)?,
                not_rooms: id_list(&room, "not_rooms", "room id", is_room_id)?.unwrap_or_default(),
                ..Default::default()
            },
        })
    }
}

/// Default timeline limit when a filter gives none.
pub const DEFAULT_TIMELINE_LIMIT: usize = 10;

/// Parses a sync token `s<position>_<typing>[_<to-device>]` into (position, typing).
/// Malformed: 400 `M_INVALID_PARAM`.
pub(crate) fn parse_since(token: &str) -> ApiResult<(u64, u64)> {
    parse_token(token).map(|(p, t, _)| (p, t))
}

/// Parses a sync token into (position, typing counter, to-device position). The third
/// part is present only when the response that made the token left to-device messages
/// out (a full page): the device has then received to-device messages only up to it.
fn parse_token(token: &str) -> ApiResult<(u64, u64, Option<u64>)> {
    let bad = || MatrixError::invalid_param(format!("Invalid since token {token:?}"));
    let rest = token.strip_prefix('s').ok_or_else(bad)?;
    let mut parts = rest.split('_');
    let pos = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let typ = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let to_device = match parts.next() {
        None => None,
        Some(td) => Some(td.parse::<u64>().map_err(|_| bad())?),
    };
    if parts.next().is_some() || to_device.is_some_and(|td| td > pos) {
        return Err(bad());
    }
    Ok((pos, typ, to_device))
}

struct Ctx<'a> {
    s: &'a AppState,
    r: &'a Requester,
    filter: Filter,
    since: Option<(u64, u64)>,
    upto: u64,
    typing: u64,
    full_state: bool,
    /// Account data changes in `(since, upto]`, read once per request (empty when the
    /// user's latest change is not newer than the token).
    account_data_changes: Vec<(String, String)>,
    /// The users the requester ignores (`m.ignored_user_list`), read once.
    ignored: HashSet<String>,
    /// The member events this device was sent ([`crate::lazy_members`]), when the
    /// state filter lazy-loads members without `include_redundant_members`.
    sent: Option<RefCell<DeviceSent>>,
}

/// What the requester's own member events between a sync token and their current
/// membership say ([`Ctx::own_history`]).
struct OwnHistory {
    /// Joined at the token.
    joined_at_since: bool,
    /// A `join` among their member events after the token.
    join_in_window: bool,
    /// A membership other than `join` among their member events after the token.
    non_join_in_window: bool,
}

/// Most of the requester's own member events [`Ctx::own_history`] walks back.
const OWN_HISTORY_MAX: usize = 32;

/// A state event going out in a sync response's `state`: loaded from the timeline
/// projection (a state delta, a lazy-loaded member), or one event of a room state
/// rendered once per state root ([`crate::state_render`]: an initial sync's full state
/// of an unchanged room reads and renders no event).
enum StateOut {
    Loaded(EventRecord),
    Cached(Arc<RenderedState>, usize),
}

impl StateOut {
    fn cached(&self) -> Option<&RenderedStateEvent> {
        match self {
            StateOut::Loaded(_) => None,
            StateOut::Cached(r, i) => r.events.get(*i),
        }
    }

    fn kind(&self) -> String {
        match (self, self.cached()) {
            (StateOut::Loaded(e), _) => e.pdu.kind.to_string(),
            (_, Some(c)) => c.event_type.clone(),
            _ => String::new(),
        }
    }

    fn state_key(&self) -> Option<&str> {
        match (self, self.cached()) {
            (StateOut::Loaded(e), _) => e.pdu.state_key.as_deref(),
            (_, Some(c)) => Some(c.state_key.as_str()),
            _ => None,
        }
    }

    /// `content` (redacted when a redaction applies to a cached event).
    fn content(&self) -> Value {
        match (self, self.cached()) {
            (StateOut::Loaded(e), _) => e.pdu.content_value(),
            (_, Some(c)) => c.content(),
            _ => Value::Null,
        }
    }

    fn is_member(&self) -> bool {
        self.kind() == "m.room.member"
    }
}

impl Ctx<'_> {
    fn viewer(&self) -> Option<(&str, &str)> {
        Some((self.r.user_id.as_str(), self.r.device_id.as_str()))
    }

    /// The timeline's events as a JSON array written as text
    /// ([`crate::read::write_render`], spec `ClientEventWithoutRoomID`), or as PDUs with
    /// `event_format: federation`.
    fn render_all(&self, evs: &[EventRecord]) -> JsonOut {
        events_json(
            self.s,
            evs,
            self.viewer(),
            EventFormat::without_room_id(self.filter.federation_format),
        )
    }

    /// The `state` section: every state event rendered the way `/state` renders it
    /// (as Synapse's sync: no bundled aggregations, no `unsigned.membership`), or as
    /// PDUs with `event_format: federation`; a JSON array written as text (a cached
    /// rendering is copied, not parsed).
    fn render_state(&self, evs: &[StateOut]) -> JsonOut {
        let now = crate::now_ms();
        json_text::array(evs, |e, out| match (e, e.cached()) {
            (StateOut::Loaded(ev), _) if self.filter.federation_format => {
                write_render_as(self.s, ev, None, EventFormat::Federation, out)
            }
            (StateOut::Loaded(ev), _) => {
                RenderedStateEvent::render(self.s, ev).write_to(out, None, self.viewer(), now)
            }
            (_, Some(c)) => c.write_to(out, None, self.viewer(), now),
            _ => out.extend_from_slice(b"null"),
        })
    }

    /// Sets a room's `timeline` (its events, `limited`, and `prev_batch`: before the
    /// first event, else at `empty_at`) and `state` sections in `out`.
    fn set_timeline_and_state(
        &self,
        out: &mut JsonOut,
        timeline: &[EventRecord],
        limited: bool,
        empty_at: u64,
        state: &[StateOut],
    ) {
        let prev_batch = timeline
            .first()
            .map(|e| token(e.position - 1))
            .unwrap_or_else(|| token(empty_at));
        out.set(
            "timeline",
            json!({ "limited": limited, "prev_batch": prev_batch }),
        )
        .set("events", self.render_all(timeline));
        out.set("state", JsonOut::object())
            .set("events", self.render_state(state));
    }

    /// The requester's own member events in `room` after `since`, newest first from
    /// `m` (their current one), walked back through each event's prior state (a
    /// point lookup and an event read each) until one at or before `since`. Runs only
    /// for a room whose own membership changed since the token (rare), at most
    /// [`OWN_HISTORY_MAX`] steps (then read as "not joined at the token": the room
    /// is sent whole, which is always safe).
    fn own_history(&self, m: &Membership, since: u64) -> OwnHistory {
        let mut h = OwnHistory {
            joined_at_since: false,
            join_in_window: false,
            non_join_in_window: false,
        };
        let state = &self.s.projections.state;
        let tl = &self.s.projections.timeline;
        let mut id = m.event_id.clone();
        for _ in 0..OWN_HISTORY_MAX {
            let Some(ev) = tl.event(&id) else {
                return h;
            };
            let membership = ev
                .pdu
                .content_value()
                .get("membership")
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_owned();
            if ev.position <= since {
                h.joined_at_since = membership == "join";
                return h;
            }
            if membership == "join" {
                h.join_in_window = true;
            } else {
                h.non_join_in_window = true;
            }
            let Some(prev) = state
                .state_event_roots(&id)
                .and_then(|r| state.lookup(r.before, "m.room.member", &self.r.user_id))
            else {
                return h;
            };
            id = prev;
        }
        h
    }

    /// The state delta of an incremental sync after a gap (Synapse's
    /// `_calculate_state`): what differs from the state at `after` at the start or
    /// the end of the timeline, less the timeline's own events. The end matters when
    /// a state event inside the window was left out (a filter): its change still
    /// reaches the client. Member changes are always included, lazy-loading or not.
    fn state_delta(
        &self,
        room: &str,
        after: u64,
        timeline: &[EventRecord],
        end: u64,
    ) -> Vec<EventRecord> {
        let state = &self.s.projections.state;
        let from = self.root_at(room, after);
        let start = timeline
            .first()
            .and_then(|f| state.roots_at(f))
            .map(|(b, _)| b)
            .unwrap_or_else(|| self.root_at(room, end));
        let end = self.root_at(room, end);
        let in_timeline: HashSet<&str> = timeline.iter().map(|e| e.pdu.event_id.as_str()).collect();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let mut changes = state.diff(from, start);
        if end != start {
            changes.extend(state.diff(from, end));
        }
        for c in changes {
            let Some(id) = c
                .new_value()
                .map(|v| String::from_utf8_lossy(v).into_owned())
            else {
                continue;
            };
            if in_timeline.contains(id.as_str()) || !seen.insert(id.clone()) {
                continue;
            }
            if let Some(ev) = self.s.projections.timeline.event(&id)
                && self.filter.state.matches(&ev.pdu)
            {
                out.push(ev);
            }
        }
        out
    }

    /// Lazy-loading in an incremental sync: the member events, as of the timeline's
    /// start, of the timeline's senders the client needs and may not hold: not set by
    /// an earlier timeline event, not already in `state`, and (without
    /// `include_redundant_members`) not sent to this device at or before the token
    /// ([`crate::lazy_members`]). A sender this device holds costs no read; another
    /// costs one point lookup and one event read.
    fn lazy_senders(
        &self,
        timeline: &[EventRecord],
        state: &[StateOut],
        room: &str,
        since: u64,
    ) -> Vec<EventRecord> {
        let Some(first) = timeline.first() else {
            return vec![];
        };
        let mut known: HashSet<&str> = state
            .iter()
            .filter(|e| e.is_member())
            .filter_map(|e| e.state_key())
            .collect();
        let mut want: Vec<String> = Vec::new();
        for ev in timeline {
            if ev.pdu.kind.to_string() == "m.room.member"
                && let Some(sk) = ev.pdu.state_key.as_deref()
                && sk == ev.pdu.sender.as_str()
            {
                // Their own member event: the timeline tells the client.
                known.insert(sk);
            }
            let sender = ev.pdu.sender.as_str();
            if known.insert(sender) {
                let held = self
                    .sent
                    .as_ref()
                    .is_some_and(|s| s.borrow().was_sent(room, sender, since));
                if !held {
                    want.push(sender.to_owned());
                }
            }
            if ev.pdu.kind.to_string() == "m.room.member"
                && let Some(sk) = ev.pdu.state_key.as_deref()
            {
                known.insert(sk);
            }
        }
        if want.is_empty() {
            return vec![];
        }
        let Some(before) = self.s.projections.state.roots_at(first).map(|(b, _)| b) else {
            return vec![];
        };
        lazy_members(self.s, before, &want)
            .into_iter()
            .filter(|e| self.filter.state.matches(&e.pdu))
            .collect()
    }

    /// Lazy-loading: the current member events of the summary's `m.heroes` the client
    /// may not hold (not in `state` or the timeline, and in an incremental sync not
    /// sent to this device before), so it can name the room (as Synapse). Only for a
    /// room without a name or canonical alias: a named room needs no heroes to be
    /// named, and Synapse sends none. At most seven point lookups, only when a summary
    /// goes out.
    fn hero_members(
        &self,
        room: &str,
        root: Root,
        summary: &Value,
        state: &[StateOut],
        timeline: &[EventRecord],
        full: bool,
    ) -> Vec<EventRecord> {
        let known: HashSet<&str> = state
            .iter()
            .filter(|e| e.is_member())
            .filter_map(|e| e.state_key())
            .chain(
                timeline
                    .iter()
                    .filter(|e| e.pdu.kind.to_string() == "m.room.member")
                    .filter_map(|e| e.pdu.state_key.as_deref()),
            )
            .collect();
        let since = self.since.map(|s| s.0).unwrap_or(0);
        let heroes: Vec<String> = summary["m.heroes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| h.as_str())
            .filter(|h| !known.contains(h))
            .filter(|h| {
                full || !self
                    .sent
                    .as_ref()
                    .is_some_and(|s| s.borrow().was_sent(room, h, since))
            })
            .map(str::to_owned)
            .collect();
        if heroes.is_empty() {
            return vec![];
        }
        // Named? From the `state` going out when it has the event (an initial sync:
        // no read), else one lookup per event type.
        let name_of = |c: &Value, field: &str| c[field].as_str().is_some_and(|v| !v.is_empty());
        let named = |kind: &str, field: &str| match state
            .iter()
            .find(|e| e.kind() == kind && e.state_key() == Some(""))
        {
            Some(e) => name_of(&e.content(), field),
            None => crate::visibility::state_content(self.s, root, kind, "")
                .is_some_and(|c| name_of(&c, field)),
        };
        if named("m.room.name", "name") || named("m.room.canonical_alias", "alias") {
            return vec![];
        }
        lazy_members(self.s, root, &heroes)
            .into_iter()
            .filter(|e| self.filter.state.matches(&e.pdu))
            .collect()
    }

    /// Records the member events of `state` and `timeline` as sent to this device in
    /// the response ending at `upto` (lazy-loading only).
    fn mark_members_sent(&self, room: &str, state: &[StateOut], timeline: &[EventRecord]) {
        let Some(sent) = &self.sent else {
            return;
        };
        let mut sent = sent.borrow_mut();
        for ev in state {
            if ev.is_member()
                && let Some(sk) = ev.state_key()
            {
                sent.mark_sent(room, sk, self.upto);
            }
        }
        for ev in timeline {
            if ev.pdu.kind.to_string() == "m.room.member"
                && let Some(sk) = ev.pdu.state_key.as_deref()
            {
                sent.mark_sent(room, sk, self.upto);
            }
        }
    }

    /// The room's state root after every record at or before `pos`.
    fn root_at(&self, room: &str, pos: u64) -> Root {
        self.s
            .projections
            .state
            .roots_at_position(room, pos)
            .map(|(full, _)| full)
            .unwrap_or_else(Root::empty)
    }

    /// Up to `limit` visible, filter-passing events in `(after, upto]` (less the
    /// non-state events of ignored users), newest last, and whether the timeline is
    /// `limited`: older events passing the filter were left out, or a state event of
    /// the window was (the filter refused it), so the `state` section carries its
    /// change as a delta.
    fn timeline(
        &self,
        room: &str,
        access: &Access,
        after: u64,
        upto: u64,
    ) -> (Vec<EventRecord>, bool) {
        // Clamped like `/messages` (a filter may ask for anything, even u64::MAX).
        let limit = self
            .filter
            .timeline
            .limit
            .unwrap_or(DEFAULT_TIMELINE_LIMIT)
            .min(crate::read::MAX_PAGE);
        let state_dropped = Cell::new(false);
        let (events, limited) = newest_events(self.s, room, after, upto, limit, |ev| {
            if !can_see(self.s, &self.r.user_id, access, ev) {
                return false;
            }
            if !self.filter.timeline.matches(&ev.pdu) {
                state_dropped.set(state_dropped.get() || ev.pdu.is_state());
                return false;
            }
            !hidden_by_ignore(&self.ignored, ev)
        });
        (events, limited || state_dropped.get())
    }

    /// The (full, non-member) state roots before the timeline's first event, or after
    /// every record of the room at or before `pos` when the timeline is empty.
    fn roots_before(&self, room: &str, timeline: &[EventRecord], pos: u64) -> (Root, Root) {
        let state = &self.s.projections.state;
        let roots = match timeline.first() {
            Some(first) => state.roots_of(first).map(|r| (r.before, r.others_before)),
            None => state.roots_at_position(room, pos),
        };
        roots.unwrap_or((Root::empty(), Root::empty()))
    }

    /// The state section for a full room: every state event, or with lazy-loading the
    /// non-member state (its own trie: member count does not matter) plus the member
    /// events of the timeline's senders and the requester (point lookups). Then, as
    /// Synapse's `_calculate_state`, what changed between the timeline's start and
    /// `end` (the state after the room's last event in the response) that the
    /// timeline does not carry itself: a state event the requester could not see or
    /// the filter left out (with lazy-loading, other users' member events stay out).
    /// A timeline without such a gap costs nothing more (same roots, no diff).
    fn state_events(
        &self,
        room: &str,
        (full, others): (Root, Root),
        end: Root,
        timeline: &[EventRecord],
        lazy: bool,
    ) -> Vec<StateOut> {
        let in_timeline: std::collections::HashSet<&str> =
            timeline.iter().map(|e| e.pdu.event_id.as_str()).collect();
        let mut out = Vec::new();
        let root = if lazy { others } else { full };
        if self.filter.federation_format {
            // PDUs are rendered from the records, not from the client rendering.
            for (_kind, _sk, id) in self.s.projections.state.entries(root) {
                if in_timeline.contains(id.as_str()) {
                    continue;
                }
                if let Some(ev) = self.s.projections.timeline.event(&id)
                    && self.filter.state.matches(&ev.pdu)
                {
                    out.push(StateOut::Loaded(ev));
                }
            }
        } else {
            let rendered = self.s.state_render.get(self.s, room, root);
            for (i, e) in rendered.events.iter().enumerate() {
                if !in_timeline.contains(e.event_id.as_str())
                    && self
                        .filter
                        .state
                        .matches_parts(&e.event_type, &e.sender, e.has_url)
                {
                    out.push(StateOut::Cached(rendered.clone(), i));
                }
            }
        }
        let mut senders: Vec<String> = Vec::new();
        if lazy {
            senders = timeline.iter().map(|e| e.pdu.sender.to_string()).collect();
            senders.push(self.r.user_id.clone());
            for ev in lazy_members(self.s, full, &senders) {
                if !in_timeline.contains(ev.pdu.event_id.as_str())
                    && self.filter.state.matches(&ev.pdu)
                {
                    out.push(StateOut::Loaded(ev));
                }
            }
        }
        if end != full {
            for c in self.s.projections.state.diff(full, end) {
                let Some(id) = c
                    .new_value()
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                else {
                    continue;
                };
                if in_timeline.contains(id.as_str())
                    || (lazy
                        && c.event_type() == "m.room.member"
                        && !senders.iter().any(|u| u.as_str() == c.state_key()))
                {
                    continue;
                }
                if let Some(ev) = self.s.projections.timeline.event(&id)
                    && self.filter.state.matches(&ev.pdu)
                {
                    out.push(StateOut::Loaded(ev));
                }
            }
        }
        out
    }

    fn ephemeral(&self, room: &str, initial: bool) -> Vec<Value> {
        let mut events = Vec::new();
        let typing_changed = match self.since {
            None => true,
            Some((_, t)) => self.s.typing.room_serial(room) > t,
        };
        if typing_changed && self.filter.ephemeral.matches_type("m.typing") {
            let mut users = self.s.typing.users(room);
            users.retain(|u| !self.ignored.contains(u));
            if !users.is_empty() || self.since.is_some() {
                events.push(json!({ "type": "m.typing", "content": { "user_ids": users } }));
            }
        }
        if self.filter.ephemeral.matches_type("m.receipt") {
            // Private receipts are only ever the requester's own.
            // Ignored users' receipts are left out too (spec: "Ignoring Users").
            let visible = |user: &str, kind: &str| {
                (kind != "m.read.private" || user == self.r.user_id) && !self.ignored.contains(user)
            };
            let receipts: Vec<(String, String, Receipt)> = if initial {
                self.s.projections.receipts.all(room)
            } else {
                let since = self.since.map(|s| s.0).unwrap_or(0);
                // In memory first: most rooms have no new receipt.
                let mut changed = if self.s.projections.receipts.last_change(room) > since {
                    self.s.projections.receipts.changes(room, since, self.upto)
                } else {
                    Vec::new()
                };
                changed.sort();
                changed.dedup();
                changed
                    .into_iter()
                    .filter(|(user, kind, _)| visible(user, kind))
                    .filter_map(|(user, kind, thread)| {
                        let rec = self
                            .s
                            .projections
                            .receipts
                            .get(room, &user, &kind, &thread)?;
                        Some((user, kind, rec))
                    })
                    .collect()
            };
            let mut content = serde_json::Map::new();
            for (user, kind, rec) in receipts {
                if !visible(&user, &kind) {
                    continue;
                }
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
                events.push(json!({ "type": "m.receipt", "content": content }));
            }
        }
        events
    }

    fn room_account_data(&self, room: &str, initial: bool) -> Vec<Value> {
        let user = &self.r.user_id;
        let entries: Vec<(String, Value)> = if initial {
            self.s.projections.account_data.all(user, Some(room))
        } else {
            self.account_data_changes
                .iter()
                .filter(|(r, _)| r == room)
                .cloned()
                .filter_map(|(_, t)| {
                    Some((
                        t.clone(),
                        self.s.projections.account_data.get(user, Some(room), &t)?,
                    ))
                })
                .collect()
        };
        entries
            .into_iter()
            .filter(|(t, _)| self.filter.room_account_data.matches_type(t))
            .map(|(t, c)| json!({ "type": t, "content": c }))
            .collect()
    }

    /// Room summary (spec: `RoomSummary`). The counts and the first members are cached
    /// by state root (a hit is provably current); the requester is removed from the
    /// heroes after the cache, since the cache is shared by every user.
    fn summary(&self, room: &str, root: Root) -> Value {
        let cached = self.s.summaries.lock().get(&root.0).cloned();
        let base = match cached {
            Some(v) => v,
            None => {
                let members = self.s.projections.membership.members(room);
                let joined = members
                    .iter()
                    .filter(|(_, m)| m.membership == "join")
                    .count();
                let invited = members
                    .iter()
                    .filter(|(_, m)| m.membership == "invite")
                    .count();
                let candidates: Vec<&String> = members
                    .iter()
                    .filter(|(_, m)| m.membership == "join" || m.membership == "invite")
                    .map(|(u, _)| u)
                    .take(6)
                    .collect();
                let v = json!({ "m.joined_member_count": joined, "m.invited_member_count": invited, "candidates": candidates });
                let mut cache = self.s.summaries.lock();
                if cache.len() >= self.s.config.caches.sync_room_summaries {
                    cache.clear();
                }
                cache.insert(root.0, v.clone());
                v
            }
        };
        let heroes: Vec<&str> = base["candidates"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|u| u.as_str())
                    .filter(|u| *u != self.r.user_id)
                    .take(5)
                    .collect()
            })
            .unwrap_or_default();
        json!({
            "m.joined_member_count": base["m.joined_member_count"],
            "m.invited_member_count": base["m.invited_member_count"],
            "m.heroes": heroes,
        })
    }

    /// `unread_notifications` for the room, or for the main timeline when the filter
    /// asks for per-thread counts (spec: "Receiving notifications").
    fn unread(&self, room: &str, m: &Membership) -> Value {
        let user = &self.r.user_id;
        let threaded = self.filter.timeline.unread_thread_notifications;
        let thread = threaded.then_some("main");
        let from = self
            .s
            .projections
            .receipts
            .read_position(room, user, thread)
            .unwrap_or(m.position);
        let c = self
            .s
            .projections
            .unread(room, user, thread.unwrap_or(""), from, self.upto);
        json!({
            "notification_count": c.notification_count,
            "highlight_count": c.highlight_count,
        })
    }

    /// `unread_thread_notifications`: counts per thread with unread notifications. The
    /// candidates are the threads notified since the user's unthreaded read position
    /// (newest first, at most [`THREADS_COUNTED_MAX`]); each costs a handful of seeks.
    fn thread_unread(&self, room: &str, m: &Membership) -> Value {
        let user = &self.r.user_id;
        let p = &self.s.projections;
        let floor = ["m.read", "m.read.private"]
            .iter()
            .filter_map(|t| p.receipts.get(room, user, t, ""))
            .map(|r| r.event_position)
            .max()
            .unwrap_or(0)
            .max(p.push.last_sent(room, user, ""));
        let mut out = serde_json::Map::new();
        for root in p
            .push
            .threads_notified(room, user, floor, self.upto, THREADS_COUNTED_MAX)
        {
            let from = p
                .receipts
                .read_position(room, user, Some(&root))
                .unwrap_or(m.position);
            let c = p.unread(room, user, &root, from, self.upto);
            if c.notification_count > 0 {
                out.insert(
                    root,
                    json!({ "notification_count": c.notification_count, "highlight_count": c.highlight_count }),
                );
            }
        }
        Value::Object(out)
    }

    fn joined_room(&self, room: &str, m: &Membership) -> Option<JsonOut> {
        let since = self.since.map(|s| s.0);
        // Newly joined = not joined at the token, or left and joined again since (as
        // Synapse: the client may have dropped the room, and what changed while the
        // user was away is not in a timeline they may see). A later member event of a
        // user who stayed joined (a profile change) is not a new join.
        let newly_joined = since.is_some_and(|sp| {
            m.position > sp && {
                let h = self.own_history(m, sp);
                !h.joined_at_since || h.non_join_in_window
            }
        });
        // A partial-state room whose full state arrived since the token (MSC3902) sends
        // its whole state again: the member list the client could not have yet.
        let completed = since.is_some_and(|sp| {
            self.s
                .projections
                .state
                .completed_at(room)
                .is_some_and(|c| c > sp && c <= self.upto)
        });
        let full = since.is_none() || self.full_state || newly_joined || completed;
        // `full_state` resends the state but the timeline still starts at `since`
        // (spec: "The timeline will still be limited by the since parameter").
        let after = if since.is_none() || newly_joined {
            0
        } else {
            since.unwrap_or(0)
        };
        if !full
            && self
                .s
                .projections
                .timeline
                .last_activity(room)
                .is_none_or(|p| p <= after)
        {
            // Nothing new in the timeline: only ephemeral or account data can matter.
            let ephemeral = self.ephemeral(room, false);
            let account_data = self.room_account_data(room, false);
            if ephemeral.is_empty() && account_data.is_empty() {
                return None;
            }
            let mut out = json!({
                "timeline": { "events": [], "limited": false, "prev_batch": token(after) },
                "state": { "events": [] },
                "ephemeral": { "events": ephemeral },
                "account_data": { "events": account_data },
                "unread_notifications": self.unread(room, m),
            });
            if self.filter.timeline.unread_thread_notifications {
                out["unread_thread_notifications"] = self.thread_unread(room, m);
            }
            return Some(out.into());
        }
        let access = Access {
            membership: Some(m.clone()),
            cap: u64::MAX,
            was_joined: false,
            left_at: None,
        };
        let (timeline, limited) = self.timeline(room, &access, after, self.upto);
        // A newly joined room is always `limited` (as Synapse): the client pages back
        // from `prev_batch` for history rather than take the timeline as all there is.
        let limited = limited || newly_joined;
        let lazy = self.filter.state.lazy_load_members;
        let state = if full {
            let mut roots = self.roots_before(room, &timeline, self.upto);
            let mut end = self.root_at(room, self.upto);
            if completed {
                // The member events the resync added come after the room's last event
                // (outlier records): the state at an event does not hold them, the
                // current state does.
                let state = &self.s.projections.state;
                if let (Some(all), Some(others)) =
                    (state.current_root(room), state.current_others_root(room))
                {
                    roots = (all, others);
                    end = all;
                }
            }
            self.state_events(room, roots, end, &timeline, lazy)
        } else {
            let mut state: Vec<StateOut> = if limited {
                self.state_delta(room, after, &timeline, self.upto)
                    .into_iter()
                    .map(StateOut::Loaded)
                    .collect()
            } else {
                vec![]
            };
            if lazy {
                let more = self.lazy_senders(&timeline, &state, room, after);
                state.extend(more.into_iter().map(StateOut::Loaded));
            }
            state
        };
        let mut state = state;
        let membership_changed = timeline
            .iter()
            .any(|e| e.pdu.kind.to_string() == "m.room.member")
            || state.iter().any(StateOut::is_member);
        let summary = (full || membership_changed).then(|| {
            let root = self.root_at(room, self.upto);
            (root, self.summary(room, root))
        });
        if lazy && let Some((root, summary)) = &summary {
            let heroes = self.hero_members(room, *root, summary, &state, &timeline, full);
            state.extend(heroes.into_iter().map(StateOut::Loaded));
        }
        if lazy {
            self.mark_members_sent(room, &state, &timeline);
        }
        let ephemeral = self.ephemeral(room, full);
        let account_data = self.room_account_data(room, full);
        if !full
            && timeline.is_empty()
            && state.is_empty()
            && ephemeral.is_empty()
            && account_data.is_empty()
        {
            return None;
        }
        let mut out = JsonOut::from(json!({
            "ephemeral": { "events": ephemeral },
            "account_data": { "events": account_data },
            "unread_notifications": self.unread(room, m),
        }));
        self.set_timeline_and_state(&mut out, &timeline, limited, self.upto, &state);
        if self.filter.timeline.unread_thread_notifications {
            out.set("unread_thread_notifications", self.thread_unread(room, m));
        }
        if let Some((_, summary)) = summary {
            out.set("summary", summary);
        }
        Some(out)
    }

    /// A room the user knocked on (spec: `KnockedRoom`): the stripped state a knocker
    /// may see (the same as an invitee's) and their own knock.
    fn knocked_room(&self, m: &Membership) -> Option<Value> {
        let own = self.s.projections.timeline.event(&m.event_id)?;
        // A knock on a room on another server carries the state its server answered
        // (kept in `unsigned` of our outlier copy, as a remote invite's).
        if let Some(remote) = own
            .pdu
            .federation_json()
            .get("unsigned")
            .and_then(|u| u.get("invite_room_state"))
            .and_then(|v| v.as_array())
        {
            let mut events: Vec<Value> = remote
                .iter()
                .filter(|e| e.get("type").is_some() && e.get("state_key").is_some())
                .take(64)
                .cloned()
                .collect();
            events.push(stripped(&own.pdu));
            return Some(json!({ "knock_state": { "events": events } }));
        }
        let root = self
            .s
            .projections
            .state
            .state_event_roots(&m.event_id)?
            .after;
        let mut events = self.stripped_room_state(root);
        events.push(stripped(&own.pdu));
        Some(json!({ "knock_state": { "events": events } }))
    }

    /// The stripped state events an invitee or knocker sees (spec: "Stripped state").
    fn stripped_room_state(&self, root: Root) -> Vec<Value> {
        let mut events = Vec::new();
        for kind in [
            "m.room.create",
            "m.room.join_rules",
            "m.room.name",
            "m.room.avatar",
            "m.room.canonical_alias",
            "m.room.encryption",
            "m.room.topic",
        ] {
            if let Some(id) = self.s.projections.state.lookup(root, kind, "")
                && let Some(ev) = self.s.projections.timeline.event(&id)
            {
                events.push(stripped(&ev.pdu));
            }
        }
        events
    }

    fn invited_room(&self, m: &Membership) -> Option<Value> {
        Some(json!({ "invite_state": { "events": invite_state(self.s, m)? } }))
    }

    fn left_room(&self, room: &str, m: &Membership) -> Option<JsonOut> {
        let access =
            crate::visibility::room_access(self.s, &self.r.user_id, room).unwrap_or(Access {
                membership: Some(m.clone()),
                cap: m.position,
                was_joined: false,
                left_at: Some(m.position),
            });
        // Joined and left since the token (and not joined at it): the client never
        // had this room, so it goes whole, like a newly joined room (as Synapse's
        // "archived" entry with `newly_joined`): the timeline up to the leave, the
        // state at its start, `limited`.
        let newly_joined = self.since.is_some_and(|(sp, _)| {
            m.position > sp && {
                let h = self.own_history(m, sp);
                !h.joined_at_since && h.join_in_window
            }
        });
        let after = match self.since {
            Some((sp, _)) if !newly_joined => sp,
            _ => 0,
        };
        let (timeline, limited) = self.timeline(room, &access, after, m.position.min(self.upto));
        let limited = limited || newly_joined;
        let lazy = self.filter.state.lazy_load_members;
        let state = if self.since.is_none() || newly_joined {
            let roots = self.roots_before(room, &timeline, m.position);
            let end = self.root_at(room, m.position.min(self.upto));
            self.state_events(room, roots, end, &timeline, lazy)
        } else if limited {
            let mut state: Vec<StateOut> = self
                .state_delta(room, after, &timeline, m.position.min(self.upto))
                .into_iter()
                .map(StateOut::Loaded)
                .collect();
            if lazy {
                let more = self.lazy_senders(&timeline, &state, room, after);
                state.extend(more.into_iter().map(StateOut::Loaded));
            }
            state
        } else if lazy {
            self.lazy_senders(&timeline, &[], room, after)
                .into_iter()
                .map(StateOut::Loaded)
                .collect()
        } else {
            vec![]
        };
        if lazy {
            self.mark_members_sent(room, &state, &timeline);
        }
        let mut out = JsonOut::from(json!({ "account_data": { "events": [] } }));
        self.set_timeline_and_state(&mut out, &timeline, limited, after, &state);
        Some(out)
    }
}

/// The stripped state shown to an invitee (spec: `invite_state`): the room's
/// create, join rules, name, avatar, canonical alias, encryption and topic as of the
/// invite, the inviter's member event and the invite itself. Point lookups only.
pub(crate) fn invite_state(s: &AppState, m: &Membership) -> Option<Vec<Value>> {
    invite_state_of(&s.projections, &m.event_id)
}

/// [`invite_state`] of the invite `event_id`, from the projections alone (the
/// application-service consumer puts it, less the invite itself, in the invite's
/// `unsigned.invite_room_state`, as Synapse does).
pub fn invite_state_of(p: &spindle_projections::Projections, event_id: &str) -> Option<Vec<Value>> {
    let root = p.state.state_event_roots(event_id)?.after;
    // An invite to a room on another server carries the inviter's stripped state.
    if let Some(invite) = p.timeline.event(event_id)
        && let Some(remote) = invite
            .pdu
            .federation_json()
            .get("unsigned")
            .and_then(|u| u.get("invite_room_state"))
            .and_then(|v| v.as_array())
    {
        // The invite itself goes last, once: a server that listed it too (Spindle
        // before 2026-12) would otherwise show the invitee's member event twice.
        let own = invite.pdu.state_key.as_deref();
        let mut events: Vec<Value> = remote
            .iter()
            .filter(|e| e.get("type").is_some() && e.get("state_key").is_some())
            .filter(|e| !(e["type"] == "m.room.member" && own.is_some_and(|k| e["state_key"] == k)))
            .take(64)
            .cloned()
            .collect();
        events.push(stripped(&invite.pdu));
        return Some(events);
    }
    let mut events = Vec::new();
    for kind in [
        "m.room.create",
        "m.room.join_rules",
        "m.room.name",
        "m.room.avatar",
        "m.room.canonical_alias",
        "m.room.encryption",
        "m.room.topic",
    ] {
        if let Some(id) = p.state.lookup(root, kind, "")
            && let Some(ev) = p.timeline.event(&id)
        {
            events.push(stripped(&ev.pdu));
        }
    }
    let invite = p.timeline.event(event_id)?;
    if let Some(id) = p
        .state
        .lookup(root, "m.room.member", invite.pdu.sender.as_str())
        && let Some(ev) = p.timeline.event(&id)
    {
        events.push(stripped(&ev.pdu));
    }
    events.push(stripped(&invite.pdu));
    Some(events)
}

fn stripped(pdu: &Pdu) -> Value {
    json!({ "type": pdu.kind.to_string(), "state_key": pdu.state_key, "content": pdu.content_value(), "sender": pdu.sender })
}

/// The newest `limit` events of `room` in `(after, upto]` that pass `keep`, oldest
/// first, and whether older ones in that window were left out (a sync timeline's
/// `limited`). Shared by `/sync` (filter and visibility) and sliding sync
/// (visibility). Reads pages of `limit + 1` index rows backwards, so a window whose
/// events all pass costs one page; only events `keep` refuses cost more.
pub(crate) fn newest_events(
    s: &AppState,
    room: &str,
    after: u64,
    upto: u64,
    limit: usize,
    keep: impl Fn(&EventRecord) -> bool,
) -> (Vec<EventRecord>, bool) {
    let tl = &s.projections.timeline;
    if limit == 0 {
        let more = !tl
            .range_backward(room, upto.saturating_add(1), after + 1, 1)
            .is_empty();
        return (vec![], more);
    }
    let mut out = Vec::new();
    let mut before = upto.saturating_add(1);
    let mut limited = false;
    'scan: loop {
        let rows = tl.range_backward(room, before, after + 1, limit + 1);
        if rows.is_empty() {
            break;
        }
        for (pos, id) in &rows {
            before = *pos;
            if let Some(ev) = tl.event(id)
                && keep(&ev)
            {
                if out.len() == limit {
                    limited = true;
                    break 'scan;
                }
                out.push(ev);
            }
        }
        if rows.len() < limit + 1 {
            break;
        }
    }
    out.reverse();
    (out, limited)
}

/// Whether anything for this user changed in `(since, upto]` (or typing since the
/// token's typing counter). Runs on every commit anywhere while a long-poll waits, so
/// it answers from memory: per-user and per-room "latest change" positions, and the
/// rooms' last activity. Only a room that did change costs a store read (to check the
/// change is within `upto`).
pub(crate) fn has_updates(
    s: &AppState,
    user: &str,
    joined: &SortedKeys,
    since: (u64, u64),
    upto: u64,
) -> bool {
    let p = &s.projections;
    if p.membership.last_change(user) > since.0
        || p.account_data.last_change(user) > since.0
        || p.push.rules_last_change(user) > since.0
    {
        return true;
    }
    let rooms = match rooms_with_news(s, joined, since) {
        Some(rooms) => rooms.into_iter().collect(),
        None => joined.iter().map(String::as_str).collect::<Vec<_>>(),
    };
    for room in rooms {
        if p.timeline
            .last_activity(room)
            .is_some_and(|pos| pos > since.0)
            && !p.timeline.range_forward(room, since.0, upto, 1).is_empty()
        {
            return true;
        }
        if s.typing.room_serial(room) > since.1 || p.receipts.last_change(room) > since.0 {
            return true;
        }
        // A partial-state room that became complete: its whole state goes out (MSC3902).
        if p.state
            .completed_at(room)
            .is_some_and(|c| c > since.0 && c <= upto)
        {
            return true;
        }
    }
    s.config.presence_enabled && s.presence.changed_since(joined, since.1)
}

/// Of `joined` (sorted, as read from the membership projection's room list), the rooms
/// where something a `/sync` room entry shows may have changed after `since`
/// ((position, ephemeral counter)): a new event, a typing or receipt change, a
/// partial-state room completed. Found from the in-memory change indexes, so the cost
/// follows the rooms that changed rather than the rooms joined (a user in 500 rooms
/// polling for one message). A superset: each room is still checked. `None` when an
/// index cannot tell (a token older than the process knows, more rooms changed than
/// joined): check every joined room.
///
/// Room account data and the user's own membership changes are not here: `/sync`
/// reads those from the user's own logs.
pub(crate) fn rooms_with_news<'a>(
    s: &AppState,
    joined: &'a SortedKeys,
    since: (u64, u64),
) -> Option<BTreeSet<&'a str>> {
    use spindle_projections::change_index::changed_among;
    let p = &s.projections;
    let limit = joined.len();
    let mut out = BTreeSet::new();
    for changed in [
        p.timeline.rooms_active_after(since.0, limit),
        p.receipts.rooms_changed_after(since.0, limit),
        s.typing.rooms_changed_within(since.1, limit),
        p.state.completed_after(since.0, limit),
    ] {
        out.extend(changed_among(changed, joined)?);
    }
    Some(out)
}

/// Whether the end-to-end encryption sections have news for this device: a to-device
/// message after `to_device_acked`, or a device-list change in the user's own log or
/// a joined room's after `device_lists_since` (`None`: that section is not asked
/// for). Memory only (`LastChange` caches), like [`has_updates`]; shared by `/sync`
/// and sliding sync's `to_device` and `e2ee` extensions.
pub(crate) fn e2ee_has_updates(
    s: &AppState,
    r: &Requester,
    joined: &SortedKeys,
    device_lists_since: Option<u64>,
    to_device_acked: Option<u64>,
) -> bool {
    to_device_acked.is_some_and(|acked| {
        s.projections
            .to_device
            .last_change(&r.user_id, &r.device_id)
            > acked
    }) || device_lists_since.is_some_and(|since| {
        s.projections
            .device_keys
            .any_change_after(&r.user_id, joined, since)
    })
}

async fn sync(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
) -> ApiResult<axum::response::Response> {
    let filter = match q.get("filter") {
        None => Filter::default(),
        // Inline JSON (Synapse: what starts with `{`); not JSON: 400 `M_NOT_JSON`.
        Some(f) if f.trim_start().starts_with('{') => Filter::parse(&inline_filter_json(f)?)?,
        Some(id) => {
            let v = s
                .projections
                .filters
                .get(&r.user_id, id)
                // Synapse: 400 `M_INVALID_PARAM` "No such filter".
                .ok_or_else(|| MatrixError::invalid_param("No such filter"))?;
            Filter::parse(&v)?
        }
    };
    let token = q.get("since").map(parse_token).transpose()?;
    let since = token.map(|(p, t, _)| (p, t));
    // To-device messages up to this position were delivered to this device in the
    // response that made the token: using it acknowledges them (spec: "Send-to-Device
    // messaging"), which is itself journaled, so they are never delivered again.
    let to_device_acked = token.map(|(p, _, td)| td.unwrap_or(p)).unwrap_or(0);
    if token.is_some() && to_device_acked <= s.journal.durable_head() {
        acknowledge_to_device(&s, &r, to_device_acked).await?;
    }
    let full_state = match q.get("full_state") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(MatrixError::invalid_param(format!(
                "full_state must be true or false, not {other:?}"
            )));
        }
    };
    if let Some(p) = q.get("set_presence")
        && !["online", "offline", "unavailable"].contains(&p)
    {
        return Err(MatrixError::invalid_param(format!(
            "set_presence must be online, offline or unavailable, not {p:?}"
        )));
    }
    let timeout = q
        .u64("timeout")?
        .unwrap_or(0)
        .min(s.config.max_sync_timeout_ms);
    if let Some(since) = since {
        // With a shared journal the token may come from another process that is a few
        // records ahead of this one: wait for them (read-your-writes across processes).
        if since.0 > s.journal.durable_head()
            && !s
                .journal
                .wait_for_head(since.0, crate::SHARED_JOURNAL_TOKEN_WAIT)
                .await
        {
            return Err(MatrixError::invalid_param("since token is from the future"));
        }
        if timeout > 0 && !full_state {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout);
            let _waiting = crate::metrics::LongPollGuard::new(&s);
            let mut applied_rx = s.projections.runtime.subscribe();
            let mut typing_rx = s.typing.subscribe();
            // The joined rooms are read once; a membership change ends the wait anyway.
            let (_, joined) = s.projections.membership.joined_kept(&r.user_id);
            let mut shutdown = s.shutdown.clone();
            loop {
                applied_rx.borrow_and_update();
                typing_rx.borrow_and_update();
                if *shutdown.borrow_and_update() {
                    break;
                }
                if has_updates(
                    &s,
                    &r.user_id,
                    &joined,
                    since,
                    s.projections.runtime.applied(),
                ) || e2ee_has_updates(&s, &r, &joined, Some(since.0), Some(to_device_acked))
                {
                    break;
                }
                tokio::select! {
                    _ = applied_rx.changed() => {}
                    _ = typing_rx.changed() => {}
                    _ = shutdown.changed() => break,
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
        }
    }
    let mut upto = s.projections.runtime.applied();
    // The membership projection may be ahead of the slowest projection; let everything
    // reach the newest membership change so each room is classified consistently.
    // The user's room list is kept in memory by the membership projection: a room with
    // nothing new since the token costs in-memory comparisons, no store read.
    let (rooms, joined_rooms) = loop {
        let (rooms, joined) = s.projections.membership.joined_kept(&r.user_id);
        let newest = rooms.values().map(|m| m.position).max().unwrap_or(0);
        if newest <= upto {
            break (rooms, joined);
        }
        s.wait_for(newest).await?;
        upto = s.projections.runtime.applied();
    };
    crate::presence::on_sync(&s, &r.user_id, q.get("set_presence"), &joined_rooms);
    let typing = s.typing.current();
    let account_data_changes = match since {
        Some((sp, _)) if s.projections.account_data.last_change(&r.user_id) > sp => {
            s.projections.account_data.changes(&r.user_id, sp, upto)
        }
        _ => Vec::new(),
    };
    let lazy_dedupe = filter.state.lazy_load_members && !filter.state.include_redundant_members;
    let sent = lazy_dedupe.then(|| {
        RefCell::new(
            s.lazy_members
                .start(&r.user_id, &r.device_id, since.map(|(p, _)| p)),
        )
    });
    let ctx = Ctx {
        s: &s,
        r: &r,
        filter,
        since,
        upto,
        typing,
        full_state,
        account_data_changes,
        ignored: crate::read::ignored_users(&s, &r.user_id),
        sent,
    };
    let mut join = Vec::new();
    let mut invite = serde_json::Map::new();
    let mut leave = Vec::new();
    let mut knock = serde_json::Map::new();
    // On an incremental sync, the joined rooms that can have an entry: the rest cost
    // a comparison each, not a look at the timeline, receipts and typing of each.
    let news = since
        .filter(|_| !full_state)
        .and_then(|since| rooms_with_news(&s, &joined_rooms, since));
    for (room, m) in rooms.iter() {
        if !ctx.filter.rooms.allows_room(room) {
            continue;
        }
        let changed_in_window = since.is_none_or(|(sp, _)| m.position > sp);
        match m.membership.as_str() {
            "join"
                if !changed_in_window
                    && news.as_ref().is_some_and(|n| !n.contains(room.as_str()))
                    && !ctx.account_data_changes.iter().any(|(r, _)| r == room) => {}
            "join" => {
                if let Some(v) = ctx.joined_room(room, m) {
                    join.push((room.clone(), v));
                }
            }
            // An invite from an ignored user is not shown (spec: "Ignoring Users").
            "invite" if changed_in_window && !ctx.ignored.contains(&m.sender) => {
                if let Some(v) = ctx.invited_room(m) {
                    invite.insert(room.clone(), v);
                }
            }
            "knock" if changed_in_window => {
                if let Some(v) = ctx.knocked_room(m) {
                    knock.insert(room.clone(), v);
                }
            }
            "leave" | "ban" if !m.forgotten => {
                let include = match since {
                    None => ctx.filter.include_leave,
                    Some(_) => changed_in_window,
                };
                if include && let Some(v) = ctx.left_room(room, m) {
                    leave.push((room.clone(), v));
                }
            }
            _ => {}
        }
    }
    // `m.push_rules` is account data to clients (spec: "Push Rules: Events"), kept by
    // the push projection: sent on an initial sync and after each change.
    let push_rules_changed = since.is_none_or(|(sp, _)| {
        let last = s.projections.push.rules_last_change(&r.user_id);
        last > sp && last <= upto
    });
    let push_rules = push_rules_changed
        .then(|| s.projections.push.ruleset(&r.user_id))
        .flatten()
        .map(|set| {
            (
                "m.push_rules".to_owned(),
                json!({ "global": crate::push::ruleset_json(&set) }),
            )
        });
    let account_data: Vec<Value> = match since {
        None => s.projections.account_data.all(&r.user_id, None),
        Some(_) => ctx
            .account_data_changes
            .iter()
            .filter(|(room, _)| room.is_empty())
            .cloned()
            .filter_map(|(_, t)| {
                Some((
                    t.clone(),
                    s.projections.account_data.get(&r.user_id, None, &t)?,
                ))
            })
            .collect(),
    }
    .into_iter()
    .chain(push_rules)
    .filter(|(t, _)| ctx.filter.account_data.matches_type(t))
    .map(|(t, c)| json!({ "type": t, "content": c }))
    .collect();
    let presence: Vec<Value> =
        crate::presence::sync_events(&s, &r.user_id, &joined_rooms, since, upto)
            .into_iter()
            .filter(|e| {
                ctx.filter.presence.matches_type("m.presence")
                    && e["sender"].as_str().is_some_and(|u| {
                        !ctx.filter.presence.not_senders.iter().any(|x| x == u)
                            && ctx
                                .filter
                                .presence
                                .senders
                                .as_ref()
                                .is_none_or(|ss| ss.iter().any(|x| x == u))
                    })
            })
            .collect();
    if let Some(sent) = ctx.sent {
        s.lazy_members
            .finish(&r.user_id, &r.device_id, sent.into_inner());
    }
    let e2ee = e2ee_sections(&s, &r, &joined_rooms, since, to_device_acked, upto);
    let next_batch = match e2ee.to_device_upto {
        Some(td) => format!("s{}_{}_{}", upto, ctx.typing, td),
        None => format!("s{}_{}", upto, ctx.typing),
    };
    let mut answer = JsonOut::from(json!({
        "next_batch": next_batch,
        "account_data": { "events": account_data },
        "presence": { "events": presence },
        "to_device": { "events": e2ee.to_device },
        "device_lists": { "changed": e2ee.device.device_lists.changed, "left": e2ee.device.device_lists.left },
        "device_one_time_keys_count": e2ee.device.one_time_key_counts,
        "device_unused_fallback_key_types": e2ee.device.unused_fallback_key_types,
    }));
    let rooms = answer.set("rooms", JsonOut::object());
    rooms.set("join", JsonOut::Object(join));
    rooms.set("invite", Value::Object(invite));
    rooms.set("knock", Value::Object(knock));
    rooms.set("leave", JsonOut::Object(leave));
    Ok(answer.into_response())
}

/// Journals that this device acknowledged every to-device message up to `upto`, when
/// its inbox still holds one (one seek; most syncs journal nothing). Shared by `/sync`
/// (its `since` token) and sliding sync's `to_device` extension (its `since`).
pub(crate) async fn acknowledge_to_device(s: &AppState, r: &Requester, upto: u64) -> ApiResult<()> {
    if s.projections
        .to_device
        .oldest(&r.user_id, &r.device_id)
        .is_some_and(|oldest| oldest <= upto)
    {
        s.submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::ToDeviceAcknowledged {
                    user_id: r.user_id.clone(),
                    device_id: r.device_id.clone(),
                    upto,
                },
            },
        )
        .await?;
    }
    Ok(())
}

/// The end-to-end encryption parts of a sync response for the requesting device.
pub(crate) struct E2eeSections {
    /// To-device events after the acknowledged position, oldest first.
    pub(crate) to_device: Vec<Value>,
    /// Set when the page of to-device events was full: the position delivered up to.
    pub(crate) to_device_upto: Option<u64>,
    /// The device's key sections.
    pub(crate) device: DeviceSections,
}

/// The device-key parts of a sync response (`/sync` top level, sliding sync's `e2ee`
/// extension).
pub(crate) struct DeviceSections {
    /// `device_lists` (empty when there is no `since`).
    pub(crate) device_lists: spindle_projections::device_keys::DeviceListChanges,
    /// `device_one_time_keys_count`.
    pub(crate) one_time_key_counts: Value,
    /// `device_unused_fallback_key_types`.
    pub(crate) unused_fallback_key_types: Vec<String>,
}

/// Builds the end-to-end encryption sections of `/sync` for `(since, upto]`: to-device
/// messages after `to_device_acked` (at most
/// [`crate::to_device::MAX_TO_DEVICE_PER_SYNC`]) and [`device_sections`].
fn e2ee_sections(
    s: &AppState,
    r: &Requester,
    joined_rooms: &SortedKeys,
    since: Option<(u64, u64)>,
    to_device_acked: u64,
    upto: u64,
) -> E2eeSections {
    let pending = s.projections.to_device.pending(
        &r.user_id,
        &r.device_id,
        to_device_acked,
        upto,
        crate::to_device::MAX_TO_DEVICE_PER_SYNC,
    );
    E2eeSections {
        to_device_upto: pending.truncated.then_some(pending.last_position).flatten(),
        to_device: pending.events,
        device: device_sections(s, r, joined_rooms, since.map(|(p, _)| p), upto),
    }
}

/// Device list changes in `(since, upto]` for users sharing a room with the requester
/// (`joined_rooms`: the requester's joined rooms; none without a `since`), and the
/// requesting device's one-time key counts and unused fallback key types. Reads: the
/// change logs of rooms that changed (memory check first), two key-count seeks.
pub(crate) fn device_sections(
    s: &AppState,
    r: &Requester,
    joined_rooms: &SortedKeys,
    since: Option<u64>,
    upto: u64,
) -> DeviceSections {
    let device_lists = match since {
        Some(sp) => s
            .projections
            .device_keys
            .changes(&r.user_id, joined_rooms, sp, upto),
        None => Default::default(),
    };
    DeviceSections {
        device_lists,
        one_time_key_counts: crate::keys::one_time_key_counts(s, &r.user_id, &r.device_id),
        unused_fallback_key_types: s
            .projections
            .device_keys
            .unused_fallback_key_types(&r.user_id, &r.device_id),
    }
}
