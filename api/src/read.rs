//! Room reads: `/event`, `/state`, `/messages`, `/context`, `/members`,
//! `/joined_members`, `/joined_rooms`. Every one checks [`crate::visibility`] first and
//! filters events one by one; a room the user may not read answers 403 (or 404 for a
//! single event), never its data.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};
use spindle_core::{pdu::ClientFormat, trie::Root};
use spindle_projections::timeline::EventRecord;

use crate::state_render::RenderedState;

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
    json_text::JsonOut,
    sync::EventFilter,
    visibility::{Access, can_see, room_access, visible_event},
};

/// Largest `limit` honoured by `/messages` and `/context`.
pub const MAX_PAGE: usize = 1000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/rooms/{room_id}/event/{event_id}",
            get(get_event),
        )
        .route("/_matrix/client/v3/rooms/{room_id}/state", get(get_state))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
            get(get_state_event_empty),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/",
            get(get_state_event_empty),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
            get(get_state_event),
        )
        .route("/_matrix/client/v3/rooms/{room_id}/messages", get(messages))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/context/{event_id}",
            get(context),
        )
        .route("/_matrix/client/v3/rooms/{room_id}/members", get(members))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/joined_members",
            get(joined_members),
        )
        .route("/_matrix/client/v3/joined_rooms", get(joined_rooms))
        .route(
            "/_matrix/client/v1/rooms/{room_id}/timestamp_to_event",
            get(timestamp_to_event),
        )
}

/// Parses a pagination or sync token to its position: `t<pos>` or `s<pos>_<n>`.
/// Malformed: 400 `M_INVALID_PARAM`.
pub fn parse_token(token: &str) -> ApiResult<u64> {
    let bad = || MatrixError::invalid_param(format!("Invalid token {token:?}"));
    let digits = if let Some(rest) = token.strip_prefix('t') {
        rest
    } else if let Some(rest) = token.strip_prefix('s') {
        rest.split('_').next().unwrap_or("")
    } else {
        return Err(bad());
    };
    digits.parse::<u64>().map_err(|_| bad())
}

/// A pagination token for "after position `pos`".
pub fn token(pos: u64) -> String {
    format!("t{pos}")
}

/// Renders an event for a client: redacted if a redaction applies, with `unsigned`
/// (`age`, `transaction_id` for the sending device, `org.matrix.msc4140.delay_id` for
/// the sender of a fired delayed event (MSC4140), `prev_content` for state, and the
/// bundled aggregations `m.relations`, see [`crate::relations::bundle`]).
pub fn render(s: &AppState, ev: &EventRecord, viewer: Option<(&str, &str)>) -> Value {
    let mut v = render_unbundled(s, ev, viewer);
    if let Some(b) = crate::relations::bundle(s, ev, viewer, 0)
        && let Some(u) = v.get_mut("unsigned").and_then(|u| u.as_object_mut())
    {
        u.insert("m.relations".into(), b);
    }
    v
}

/// An event in the federation format (spec: `Filter.event_format: federation`, "the
/// raw event as received over federation"): the signed PDU with its `room_id`,
/// `auth_events`, `prev_events`, `depth`, `hashes` and `signatures` (redacted when a
/// redaction applies), plus its `event_id` (v3+ PDUs carry none) and `unsigned.age`.
/// No client-only `unsigned` field (`transaction_id`, `membership`, `prev_content`,
/// bundled aggregations) is added: a PDU has none.
pub fn render_federation(s: &AppState, ev: &EventRecord) -> Value {
    let mut v = if s
        .projections
        .timeline
        .redacted_by(ev.pdu.event_id.as_str())
        .is_some()
    {
        ev.pdu.redacted_federation_json()
    } else {
        ev.pdu.federation_json()
    };
    if let Some(map) = v.as_object_mut() {
        map.insert("event_id".into(), json!(ev.pdu.event_id));
        let age = crate::now_ms().saturating_sub(u64::from(ev.pdu.origin_server_ts.0));
        match map.get_mut("unsigned").and_then(|u| u.as_object_mut()) {
            Some(u) => {
                u.insert("age".into(), json!(age));
            }
            None => {
                map.insert("unsigned".into(), json!({ "age": age }));
            }
        }
    }
    v
}

/// The users `user` ignores (spec: "Ignoring Users", the keys of
/// `m.ignored_user_list`'s `ignored_users`): one account-data read per request.
pub fn ignored_users(s: &AppState, user: &str) -> std::collections::HashSet<String> {
    s.projections
        .account_data
        .get(user, None, "m.ignored_user_list")
        .and_then(|c| {
            c.get("ignored_users")
                .and_then(|u| u.as_object())
                .map(|u| u.keys().cloned().collect())
        })
        .unwrap_or_default()
}

/// Whether `ev` is hidden from a user ignoring `ignored`: a non-state event of an
/// ignored sender. State events stay, so the room's state stays whole (Synapse's
/// `filter_events_for_client` does the same).
pub fn hidden_by_ignore(ignored: &std::collections::HashSet<String>, ev: &EventRecord) -> bool {
    !ignored.is_empty() && !ev.pdu.is_state() && ignored.contains(ev.pdu.sender.as_str())
}

/// How an answer writes its events: as clients get them, in one of the spec's two
/// client formats ([`ClientFormat`]: `/messages` and `/context` with `room_id`, `/sync`
/// and sliding sync without), or as the PDU (a sync filter's `event_format:
/// federation`, [`render_federation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventFormat {
    /// [`write_render`] in the given client format.
    Client(ClientFormat),
    /// [`render_federation`].
    Federation,
}

impl EventFormat {
    /// `ClientEvent` or the PDU, as a filter's `event_format` says (`/messages`,
    /// `/context`).
    pub fn with_room_id(federation: bool) -> EventFormat {
        if federation {
            EventFormat::Federation
        } else {
            EventFormat::Client(ClientFormat::Event)
        }
    }

    /// `ClientEventWithoutRoomID` or the PDU, as a filter's `event_format` says
    /// (`/sync`).
    pub fn without_room_id(federation: bool) -> EventFormat {
        if federation {
            EventFormat::Federation
        } else {
            EventFormat::Client(ClientFormat::WithoutRoomId)
        }
    }
}

/// [`render`] written as JSON text onto `out` (the same members, less `room_id` in
/// [`ClientFormat::WithoutRoomId`]): the event's `content` is copied as stored, not
/// parsed into a [`Value`] and serialized again. A redacted event takes [`render`]'s
/// path (rare, and its content is rewritten anyway).
pub fn write_render(
    s: &AppState,
    ev: &EventRecord,
    viewer: Option<(&str, &str)>,
    format: ClientFormat,
    out: &mut Vec<u8>,
) {
    if redaction_of(s, ev).is_some() {
        let mut v = render(s, ev, viewer);
        if format == ClientFormat::WithoutRoomId {
            without_room_id(&mut v);
        }
        let _ = serde_json::to_writer(&mut *out, &v);
        return;
    }
    let mut unsigned = client_unsigned(s, ev, viewer);
    if let Some(prev) = replaced_state(s, ev) {
        unsigned.insert("prev_content".into(), client_content(s, &prev));
    }
    if let Some(b) = crate::relations::bundle(s, ev, viewer, 0) {
        unsigned.insert("m.relations".into(), b);
    }
    ev.pdu.write_client_event(out, format, Some(&unsigned));
}

/// Removes `room_id` from a client event and from its `unsigned.redacted_because`
/// (spec `ClientEventWithoutRoomID`: the redaction is given in the same format).
pub fn without_room_id(v: &mut Value) {
    if let Some(map) = v.as_object_mut() {
        map.remove("room_id");
        if let Some(because) = map
            .get_mut("unsigned")
            .and_then(|u| u.get_mut("redacted_because"))
            .and_then(Value::as_object_mut)
        {
            because.remove("room_id");
        }
    }
}

/// An event written as JSON text onto `out` in `format`: [`write_render`], or the PDU
/// ([`render_federation`]).
pub fn write_render_as(
    s: &AppState,
    ev: &EventRecord,
    viewer: Option<(&str, &str)>,
    format: EventFormat,
    out: &mut Vec<u8>,
) {
    match format {
        EventFormat::Federation => {
            let _ = serde_json::to_writer(&mut *out, &render_federation(s, ev));
        }
        EventFormat::Client(f) => write_render(s, ev, viewer, f, out),
    }
}

/// `evs` rendered ([`write_render_as`]) into one JSON array, written as text.
pub fn events_json(
    s: &AppState,
    evs: &[EventRecord],
    viewer: Option<(&str, &str)>,
    format: EventFormat,
) -> JsonOut {
    crate::json_text::array(evs, |e, out| write_render_as(s, e, viewer, format, out))
}

/// The per-viewer members of an event's `unsigned` ([`render_unbundled`]'s first part):
/// `age`, then for the sender `org.matrix.msc4140.delay_id` (a fired delayed event) or
/// `transaction_id` (the sending device), and `membership` (the viewer's, at the event).
fn client_unsigned(
    s: &AppState,
    ev: &EventRecord,
    viewer: Option<(&str, &str)>,
) -> serde_json::Map<String, Value> {
    let mut unsigned = serde_json::Map::new();
    unsigned.insert(
        "age".into(),
        json!(crate::now_ms().saturating_sub(u64::from(ev.pdu.origin_server_ts.0))),
    );
    let delay_id = ev
        .txn_id
        .as_deref()
        .and_then(|t| t.strip_prefix(crate::delayed::DELAY_TXN_PREFIX));
    if let (Some((user, _)), Some(id)) = (viewer, delay_id)
        && user == ev.pdu.sender.as_str()
    {
        // MSC4140: the sender (any of its devices), and only the sender, sees the id.
        unsigned.insert("org.matrix.msc4140.delay_id".into(), json!(id));
    } else if let (Some((user, device)), Some(dev), Some(txn)) = (viewer, &ev.device_id, &ev.txn_id)
        && user == ev.pdu.sender.as_str()
        && device == dev
    {
        unsigned.insert(
            "transaction_id".into(),
            json!(txn.strip_prefix("redact/").unwrap_or(txn)),
        );
    }
    if let Some((user, _)) = viewer {
        unsigned.insert("membership".into(), json!(membership_at_event(s, ev, user)));
    }
    unsigned
}

/// [`render`] without bundled aggregations.
pub fn render_unbundled(s: &AppState, ev: &EventRecord, viewer: Option<(&str, &str)>) -> Value {
    let mut unsigned = client_unsigned(s, ev, viewer);
    if let Some(redaction) = redaction_of(s, ev) {
        let mut out = ev.pdu.to_redacted_client_event(&redaction.pdu);
        if let Some(u) = out.get_mut("unsigned").and_then(|u| u.as_object_mut()) {
            for (k, v) in unsigned {
                u.insert(k, v);
            }
        }
        return out;
    }
    if let Some(prev) = replaced_state(s, ev) {
        unsigned.insert("prev_content".into(), client_content(s, &prev));
    }
    ev.pdu.to_client_event(Some(Value::Object(unsigned)))
}

/// The redaction that applies to `ev`: the first redaction of it, if that redaction is
/// an event of the same room (a redaction naming another room's event redacts nothing,
/// spec "Redactions"; Synapse checks the same).
pub fn redaction_of(s: &AppState, ev: &EventRecord) -> Option<EventRecord> {
    s.projections
        .timeline
        .redacted_by(ev.pdu.event_id.as_str())
        .and_then(|id| s.projections.timeline.event(&id))
        .filter(|r| r.pdu.room_id == ev.pdu.room_id)
}

/// The state event `ev` replaced (the same type and state key in the state right
/// before it), if `ev` is a state event and had
/// one. Reads: the event's roots, one state point lookup, one event. A non-member
/// event is looked up in the non-member state (its depth does not grow with the
/// member count).
pub fn replaced_state(s: &AppState, ev: &EventRecord) -> Option<EventRecord> {
    let sk = ev.pdu.state_key.as_ref()?;
    let kind = ev.pdu.kind.to_string();
    let roots = s
        .projections
        .state
        .state_event_roots(ev.pdu.event_id.as_str())?;
    let before = if kind == "m.room.member" {
        roots.before
    } else {
        roots.others_before
    };
    let prev_id = s.projections.state.lookup(before, &kind, sk)?;
    s.projections.timeline.event(&prev_id)
}

/// `ev`'s content as clients see it: redacted when a redaction applies (so
/// `prev_content` never shows what a redaction removed; Synapse serves the pruned
/// content the same way).
pub fn client_content(s: &AppState, ev: &EventRecord) -> Value {
    if redaction_of(s, ev).is_some() {
        ev.pdu.redacted_content()
    } else {
        ev.pdu.content_value()
    }
}

/// The viewer's membership in the room at `ev` (spec v1.11 `unsigned.membership`,
/// MSC4115): the state after the event, so the viewer's own join says `join`; `leave`
/// when the viewer has no member event then (as Synapse). Element X uses it to
/// explain messages it cannot decrypt. Reads: the viewer's membership row, which
/// answers every event after the viewer's latest member event (the common case: a
/// member reading their rooms); for older events, the event's roots, one state point
/// lookup and one member event.
fn membership_at_event(s: &AppState, ev: &EventRecord, user: &str) -> String {
    if let Some(m) = s.projections.membership.get(ev.pdu.room_id.as_str(), user)
        && m.position <= ev.position
    {
        return m.membership;
    }
    let of = |content: Value| {
        content
            .get("membership")
            .and_then(|m| m.as_str())
            .map(str::to_owned)
    };
    if ev.pdu.kind.to_string() == "m.room.member"
        && ev.pdu.state_key.as_deref() == Some(user)
        && let Some(m) = of(ev.pdu.content_value())
    {
        return m;
    }
    s.projections
        .state
        .roots_at(ev)
        .and_then(|(_, after)| crate::visibility::membership_at(s, after, user))
        .unwrap_or_else(|| "leave".into())
}

/// The state root a user may read: current for members and world-readable peekers,
/// the state right after their leave for former members.
pub fn readable_root(s: &AppState, room_id: &str, access: &Access) -> Option<Root> {
    match &access.membership {
        Some(m) if m.membership == "leave" || m.membership == "ban" => s
            .projections
            .state
            .state_event_roots(&m.event_id)
            .map(|r| r.after),
        _ => s.projections.state.current_root(room_id),
    }
}

fn viewer(r: &Requester) -> Option<(&str, &str)> {
    Some((r.user_id.as_str(), r.device_id.as_str()))
}

async fn get_event(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let (_, ev) = visible_event(&s, &r.user_id, &room_id, &event_id)?;
    Ok(Json(render(&s, &ev, viewer(&r))))
}

async fn get_state(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<axum::response::Response> {
    let access = room_access(&s, &r.user_id, &room_id)?;
    if access
        .membership
        .as_ref()
        .is_some_and(|m| m.membership == "invite" || m.membership == "knock")
        && !crate::visibility::world_readable(&s, &room_id)
    {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    // The whole state includes every member: a partial-state room answers once it is
    // complete (MSC3902; Synapse waits the same way).
    s.wait_for_full_state(&room_id).await?;
    let root = readable_root(&s, &room_id, &access)
        .ok_or_else(|| MatrixError::forbidden("Room state unavailable"))?;
    // Rendered once per state root (and redaction generation): an unchanged room's
    // state is served from memory ([`crate::state_render`]). As Synapse's `/state`, no
    // bundled aggregations and no `unsigned.membership` (the spec lets a server omit it
    // where it is expensive; per event it would cost a state lookup here).
    let rendered = s.state_render.get(&s, &room_id, root);
    Ok(raw_json(RenderedState::json_array(
        rendered.events.iter(),
        &room_id,
        viewer(&r),
        crate::now_ms(),
        rendered.bytes(),
    )))
}

/// A `200` with a JSON body already written as text (a `String` or UTF-8 bytes).
pub fn raw_json(body: impl Into<axum::body::Body>) -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        [(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        body.into(),
    )
        .into_response()
}

async fn state_event(
    s: AppState,
    r: Requester,
    room_id: String,
    event_type: String,
    state_key: String,
    q: Query,
) -> ApiResult<Json<Value>> {
    let access = room_access(&s, &r.user_id, &room_id)?;
    if access
        .membership
        .as_ref()
        .is_some_and(|m| m.membership == "invite" || m.membership == "knock")
        && !crate::visibility::world_readable(&s, &room_id)
    {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    // A remote user's member event may be one the partial state left out (MSC3902):
    // wait for the full state. Every other slot is complete in partial state.
    if event_type == "m.room.member" && !s.is_local_user(&state_key) {
        s.wait_for_full_state(&room_id).await?;
    }
    let root = readable_root(&s, &room_id, &access)
        .ok_or_else(|| MatrixError::forbidden("Room state unavailable"))?;
    let id = s
        .projections
        .state
        .lookup(root, &event_type, &state_key)
        .ok_or_else(|| MatrixError::not_found("Event not found"))?;
    let ev = s
        .projections
        .timeline
        .event(&id)
        .ok_or_else(|| MatrixError::not_found("Event not found"))?;
    let rendered = render(&s, &ev, viewer(&r));
    if q.get("format") == Some("event") {
        return Ok(Json(rendered));
    }
    Ok(Json(rendered.get("content").cloned().unwrap_or(json!({}))))
}

async fn get_state_event_empty(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_type)): Path<(String, String)>,
    q: Query,
) -> ApiResult<Json<Value>> {
    state_event(s, r, room_id, event_type, String::new(), q).await
}

async fn get_state_event(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_type, state_key)): Path<(String, String, String)>,
    q: Query,
) -> ApiResult<Json<Value>> {
    state_event(s, r, room_id, event_type, state_key, q).await
}

fn parse_filter(q: &Query) -> ApiResult<EventFilter> {
    match q.get("filter") {
        None => Ok(EventFilter::default()),
        Some(f) => EventFilter::parse(&crate::sync::inline_filter_json(f)?),
    }
}

/// Member events of `senders` at `root` (lazy-loading members, spec: "Lazy-loading
/// room members"): one point lookup per distinct sender.
pub fn lazy_members(s: &AppState, root: Root, senders: &[String]) -> Vec<EventRecord> {
    let mut seen = std::collections::BTreeSet::new();
    senders
        .iter()
        .filter(|u| seen.insert(u.as_str()))
        .filter_map(|u| s.projections.state.lookup(root, "m.room.member", u))
        .filter_map(|id| s.projections.timeline.event(&id))
        .collect()
}

async fn messages(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    q: Query,
) -> ApiResult<axum::response::Response> {
    let access = room_access(&s, &r.user_id, &room_id)?;
    // `dir` is required (spec; Synapse answers 400 without it too).
    let dir = q
        .get("dir")
        .ok_or_else(|| MatrixError::missing_param("dir is required (b or f)"))?;
    if dir != "b" && dir != "f" {
        return Err(MatrixError::invalid_param("dir must be b or f"));
    }
    let limit = q.u64("limit")?.unwrap_or(10).min(MAX_PAGE as u64) as usize;
    let filter = parse_filter(&q)?;
    if limit == 0 {
        // The token is still checked: a malformed one is an error whatever the limit.
        if let Some(t) = q.get("from") {
            match t.strip_prefix('b') {
                Some(seq) => {
                    seq.parse::<u64>()
                        .map_err(|_| MatrixError::invalid_param("Invalid from token"))?;
                }
                None => {
                    if parse_token(t)? > s.journal.durable_head() {
                        return Err(MatrixError::invalid_param("from token is from the future"));
                    }
                }
            }
        }
        let start = q
            .get("from")
            .map(str::to_owned)
            .unwrap_or_else(|| token(access.cap.min(s.projections.runtime.applied())));
        return Ok(
            JsonOut::from(json!({ "start": start, "end": start, "chunk": [] })).into_response(),
        );
    }
    let applied = s.projections.runtime.applied();
    let cap = access.cap.min(applied);
    // A `b<seq>` token points into backfilled history (older than every live event).
    let from_backfill = match q.get("from").and_then(|t| t.strip_prefix('b')) {
        Some(seq) => Some(
            seq.parse::<u64>()
                .map_err(|_| MatrixError::invalid_param("Invalid from token"))?,
        ),
        None => None,
    };
    let from = match q.get("from") {
        Some(_) if from_backfill.is_some() => 0,
        Some(t) => {
            let pos = parse_token(t)?;
            if pos > s.journal.durable_head() {
                return Err(MatrixError::invalid_param("from token is from the future"));
            }
            pos
        }
        None if dir == "b" => cap,
        None => 0,
    };
    // `to`: a live position, or a `b<seq>` point in backfilled history.
    let to = match q.get("to") {
        None => None,
        Some(t) => Some(match t.strip_prefix('b') {
            Some(seq) => Bound::Backfill(
                seq.parse::<u64>()
                    .map_err(|_| MatrixError::invalid_param("Invalid to token"))?,
            ),
            None => Bound::Live(parse_token(t)?),
        }),
    };
    let to_live = match to {
        Some(Bound::Live(t)) => Some(t),
        _ => None,
    };
    // Paging backward stops at a `b<seq>` bound: sequences above it are older.
    let backfill_stop = match to {
        Some(Bound::Backfill(m)) => Some(m),
        _ => None,
    };
    let mut chunk = Vec::new();
    let mut end = None;
    let page = (limit * 2).max(20);
    let ignored = ignored_users(&s, &r.user_id);
    let keep = |ev: EventRecord, chunk: &mut Vec<EventRecord>| {
        if filter.matches(&ev.pdu)
            && !hidden_by_ignore(&ignored, &ev)
            && can_see(&s, &r.user_id, &access, &ev)
        {
            chunk.push(ev);
        }
    };
    if dir == "b" {
        let floor = to_live.map(|t| t.saturating_add(1)).unwrap_or(0);
        let mut live_done = from_backfill.is_some();
        let mut before = from.min(cap).saturating_add(1);
        while !live_done {
            let rows = s
                .projections
                .timeline
                .range_backward(&room_id, before, floor, page);
            let exhausted = rows.len() < page;
            for (pos, id) in &rows {
                before = *pos;
                if let Some(ev) = s.projections.timeline.event(id) {
                    keep(ev, &mut chunk);
                }
                if chunk.len() >= limit {
                    break;
                }
            }
            if chunk.len() >= limit {
                // Only hand out `end` if something older exists (spec: omitted at the start).
                let more = !s
                    .projections
                    .timeline
                    .range_backward(&room_id, before, floor, 1)
                    .is_empty();
                let older_history = match to {
                    None => backfill_may_continue(&s, &room_id, 0),
                    Some(Bound::Backfill(m)) => {
                        m >= 1
                            && !s
                                .projections
                                .timeline
                                .range_backfill_older(&room_id, 0, 1)
                                .is_empty()
                    }
                    Some(Bound::Live(_)) => false,
                };
                end = if more {
                    Some(token(before - 1))
                } else if older_history {
                    Some("b0".to_owned())
                } else {
                    None
                };
                return respond(&s, &r, &room_id, &access, &q, from, &filter, chunk, end);
            }
            if exhausted || rows.is_empty() {
                live_done = true;
            }
        }
        // Older than every live event: backfilled history, fetched over federation
        // when the index runs out (spec: server-server "Backfill").
        if to_live.is_none() {
            let mut seq = from_backfill.unwrap_or(0);
            let mut fetches = 0;
            'pages: loop {
                let rows = s
                    .projections
                    .timeline
                    .range_backfill_older(&room_id, seq, page);
                for (n, id) in &rows {
                    if backfill_stop.is_some_and(|m| *n > m) {
                        break 'pages;
                    }
                    seq = *n;
                    if let Some(ev) = s.projections.timeline.event(id) {
                        keep(ev, &mut chunk);
                    }
                    if chunk.len() >= limit {
                        break;
                    }
                }
                if chunk.len() >= limit {
                    let more = match backfill_stop {
                        Some(m) => seq < m,
                        None => backfill_may_continue(&s, &room_id, seq),
                    };
                    end = more.then(|| format!("b{seq}"));
                    break;
                }
                if rows.len() == page {
                    continue;
                }
                // Up to a `b<seq>` bound everything is here already (it was handed out).
                if backfill_stop.is_some()
                    || fetches >= 3
                    || !access.joined()
                    || !fetch_history(&s, &room_id, limit).await
                {
                    break;
                }
                fetches += 1;
            }
        }
    } else {
        let mut after = from;
        // A `b<seq>` bound ends the page inside backfilled history (and a bound older
        // than a live `from` leaves nothing to read).
        let mut bound_reached = backfill_stop.is_some() && from_backfill.is_none();
        if let Some(seq) = from_backfill {
            // Forward out of backfilled history, then into the live timeline. `b<N>` sits
            // between sequences N+1 (older) and N (newer): forward starts at N.
            let mut seq = seq.saturating_add(1);
            'pages: loop {
                let rows = s
                    .projections
                    .timeline
                    .range_backfill_newer(&room_id, seq, page);
                for (n, id) in &rows {
                    if backfill_stop.is_some_and(|m| *n <= m) {
                        bound_reached = true;
                        break 'pages;
                    }
                    seq = *n;
                    if let Some(ev) = s.projections.timeline.event(id) {
                        keep(ev, &mut chunk);
                    }
                    if chunk.len() >= limit {
                        break;
                    }
                }
                if chunk.len() >= limit {
                    end = Some(format!("b{}", seq - 1));
                    break;
                }
                if rows.len() < page {
                    bound_reached |= backfill_stop.is_some();
                    break;
                }
            }
        }
        if end.is_none() && !bound_reached {
            let upto = to_live.unwrap_or(u64::MAX).min(cap);
            loop {
                let rows = s
                    .projections
                    .timeline
                    .range_forward(&room_id, after, upto, page);
                let exhausted = rows.len() < page;
                for (pos, id) in &rows {
                    after = *pos;
                    if let Some(ev) = s.projections.timeline.event(id) {
                        keep(ev, &mut chunk);
                    }
                    if chunk.len() >= limit {
                        break;
                    }
                }
                if chunk.len() >= limit || exhausted || rows.is_empty() {
                    break;
                }
            }
            if !chunk.is_empty() {
                end = Some(token(after));
            }
        }
    }
    respond(&s, &r, &room_id, &access, &q, from, &filter, chunk, end)
}

/// The `to` of `/messages`: a live stream position, or `b<seq>`, a point in
/// backfilled history (between sequences `seq` (newer) and `seq + 1` (older)).
#[derive(Clone, Copy)]
enum Bound {
    Live(u64),
    Backfill(u64),
}

/// Whether paging back past backfill sequence `seq` may find more: older rows in the
/// index, or a federated room whose oldest event here is not its create event.
fn backfill_may_continue(s: &AppState, room_id: &str, seq: u64) -> bool {
    if !s
        .projections
        .timeline
        .range_backfill_older(room_id, seq, 1)
        .is_empty()
    {
        return true;
    }
    s.federation.is_some()
        && s.projections
            .timeline
            .oldest_event(room_id)
            .and_then(|id| s.projections.timeline.event(&id))
            .is_some_and(|ev| ev.pdu.kind.to_string() != "m.room.create")
}

/// Asks the room's other servers for older history (10 s at most); whether any
/// arrived.
async fn fetch_history(s: &AppState, room_id: &str, limit: usize) -> bool {
    let Some(fed) = &s.federation else {
        return false;
    };
    let want = limit.clamp(20, spindle_federation::backfill::MAX_BACKFILL);
    match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        spindle_federation::backfill::backfill(fed, room_id, want),
    )
    .await
    {
        Ok(Ok(n)) => n > 0,
        Ok(Err(e)) => {
            tracing::info!(room = room_id, error = ?e, "backfill over federation failed");
            false
        }
        Err(_) => {
            tracing::info!(room = room_id, "backfill over federation timed out");
            false
        }
    }
}

/// The `/messages` answer: `start`, `chunk`, `end` when there is more, and the
/// lazy-loaded members of the chunk's senders.
#[allow(clippy::too_many_arguments)]
fn respond(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    access: &Access,
    q: &Query,
    from: u64,
    filter: &EventFilter,
    chunk: Vec<EventRecord>,
    end: Option<String>,
) -> ApiResult<axum::response::Response> {
    let format = EventFormat::with_room_id(filter.federation_format);
    let mut state = Vec::new();
    if filter.lazy_load_members
        && let Some(root) = readable_root(s, room_id, access)
    {
        let senders: Vec<String> = chunk.iter().map(|e| e.pdu.sender.to_string()).collect();
        state = lazy_members(s, root, &senders);
    }
    let mut out = JsonOut::from(json!({
        "start": q.get("from").map(str::to_owned).unwrap_or_else(|| token(from)),
    }));
    out.set("chunk", events_json(s, &chunk, viewer(r), format));
    if let Some(e) = end {
        out.set("end", json!(e));
    }
    if !state.is_empty() {
        out.set("state", events_json(s, &state, viewer(r), format));
    }
    Ok(out.into_response())
}

async fn context(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id)): Path<(String, String)>,
    q: Query,
) -> ApiResult<axum::response::Response> {
    let (access, ev) = visible_event(&s, &r.user_id, &room_id, &event_id)?;
    let limit = q.u64("limit")?.unwrap_or(10).min(MAX_PAGE as u64) as usize;
    let filter = parse_filter(&q)?;
    let format = EventFormat::with_room_id(filter.federation_format);
    // Events of ignored users are left out around the event, as in Synapse's
    // `/context` (the event asked for is still answered).
    let ignored = ignored_users(&s, &r.user_id);
    let n_before = limit / 2;
    let n_after = limit - n_before;
    let cap = access.cap.min(s.projections.runtime.applied());
    let pick = |rows: Vec<(u64, String)>, n: usize| -> (Vec<EventRecord>, Option<u64>) {
        let mut out = Vec::new();
        let mut last = None;
        for (pos, id) in rows {
            if out.len() >= n {
                break;
            }
            last = Some(pos);
            if let Some(e) = s.projections.timeline.event(&id)
                && filter.matches(&e.pdu)
                && !hidden_by_ignore(&ignored, &e)
                && can_see(&s, &r.user_id, &access, &e)
            {
                out.push(e);
            }
        }
        (out, last)
    };
    let (before, first_pos) = pick(
        s.projections
            .timeline
            .range_backward(&room_id, ev.position, 0, n_before * 2 + 1),
        n_before,
    );
    let (after, last_pos) = pick(
        s.projections
            .timeline
            .range_forward(&room_id, ev.position, cap, n_after * 2 + 1),
        n_after,
    );
    let root = s
        .projections
        .state
        .roots_at(after.last().unwrap_or(&ev))
        .map(|(_, a)| a);
    let state: Vec<EventRecord> = match root {
        Some(root) if filter.lazy_load_members => {
            let senders: Vec<String> = before
                .iter()
                .chain(after.iter())
                .chain(std::iter::once(&ev))
                .map(|e| e.pdu.sender.to_string())
                .collect();
            lazy_members(&s, root, &senders)
        }
        Some(root) => s
            .projections
            .state
            .entries(root)
            .into_iter()
            .filter_map(|(_, _, id)| s.projections.timeline.event(&id))
            .collect(),
        None => vec![],
    };
    let viewer = viewer(&r);
    let mut out = JsonOut::from(json!({
        "start": token(first_pos.unwrap_or(ev.position).saturating_sub(1)),
        "end": token(last_pos.unwrap_or(ev.position)),
    }));
    let mut event = Vec::with_capacity(1024);
    write_render_as(&s, &ev, viewer, format, &mut event);
    out.set("event", JsonOut::Text(event));
    out.set("events_before", events_json(&s, &before, viewer, format));
    out.set("events_after", events_json(&s, &after, viewer, format));
    out.set("state", events_json(&s, &state, viewer, format));
    Ok(out.into_response())
}

async fn members(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    q: Query,
) -> ApiResult<axum::response::Response> {
    let access = room_access(&s, &r.user_id, &room_id)?;
    if access
        .membership
        .as_ref()
        .is_some_and(|m| m.membership == "invite" || m.membership == "knock")
        && !crate::visibility::world_readable(&s, &room_id)
    {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    // A partial-state room answers once its member list is complete (MSC3902).
    s.wait_for_full_state(&room_id).await?;
    let mut root = readable_root(&s, &room_id, &access)
        .ok_or_else(|| MatrixError::forbidden("Room state unavailable"))?;
    if let Some(at) = q.get("at") {
        let pos = parse_token(at)?.min(access.cap);
        if let Some((after, _)) = s.projections.state.roots_at_position(&room_id, pos) {
            root = after;
        }
    }
    let want = q.get("membership");
    let not = q.get("not_membership");
    for m in [want, not].into_iter().flatten() {
        if !["join", "invite", "leave", "ban", "knock"].contains(&m) {
            return Err(MatrixError::invalid_param(format!(
                "unknown membership {m:?}"
            )));
        }
    }
    // From the rendered state of the root (see `get_state`), filtered by membership.
    let rendered = s.state_render.get(&s, &room_id, root);
    let chunk = RenderedState::json_array(
        rendered.events.iter().filter(|e| {
            let m = e.membership.as_deref().unwrap_or("");
            e.event_type == "m.room.member"
                && want.is_none_or(|w| w == m)
                && not.is_none_or(|n| n != m)
        }),
        &room_id,
        viewer(&r),
        crate::now_ms(),
        rendered.bytes(),
    );
    let mut out = JsonOut::object();
    out.set("chunk", JsonOut::Text(chunk));
    Ok(out.into_response())
}

async fn joined_members(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    // Members, and anyone for a world-readable room (as `/state`; Synapse does the
    // same, and Element X's room preview depends on it).
    let access = room_access(&s, &r.user_id, &room_id)?;
    if !access.joined() && !crate::visibility::world_readable(&s, &room_id) {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    // The full member list, so a partial-state room answers once complete (MSC3902).
    s.wait_for_full_state(&room_id).await?;
    let mut joined = serde_json::Map::new();
    for (user, m) in s.projections.membership.members(&room_id) {
        if m.membership == "join" {
            // Spec (`RoomMember`): both fields are strings, omitted when not set.
            let mut member = serde_json::Map::new();
            if let Some(name) = m.displayname {
                member.insert("display_name".into(), Value::String(name));
            }
            if let Some(url) = m.avatar_url {
                member.insert("avatar_url".into(), Value::String(url));
            }
            joined.insert(user, Value::Object(member));
        }
    }
    Ok(Json(json!({ "joined": joined })))
}

async fn joined_rooms(State(s): State<AppState>, r: Requester) -> Json<Value> {
    let rooms: Vec<String> = s
        .projections
        .membership
        .rooms_of(&r.user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(r, _)| r)
        .collect();
    Json(json!({ "joined_rooms": rooms }))
}

/// Most index rows `/timestamp_to_event` reads looking for an event the requester may
/// see.
pub const TIMESTAMP_SCAN_MAX: usize = 1000;

/// `GET /_matrix/client/v1/rooms/{roomId}/timestamp_to_event?ts=&dir=f|b`: the closest
/// event the requester may see at or after (`f`) or at or before (`b`) `ts` (ms), by
/// `origin_server_ts`; one seek in the `event_times` index, then events in order until
/// one is visible (at most [`TIMESTAMP_SCAN_MAX`]), each found by its position in the
/// timeline. None: 404 `M_NOT_FOUND`.
async fn timestamp_to_event(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    let ts = q
        .u64("ts")?
        .ok_or_else(|| MatrixError::missing_param("ts is required"))?;
    let forward = match q.get("dir") {
        Some("f") => true,
        Some("b") => false,
        Some(_) => return Err(MatrixError::invalid_param("dir must be f or b")),
        None => return Err(MatrixError::missing_param("dir is required")),
    };
    let access = room_access(&s, &r.user_id, &room_id)?;
    let mut from = ts;
    let mut scanned = 0;
    // The nearest event is usually visible: read one row first, then double.
    let mut batch = 1;
    while scanned < TIMESTAMP_SCAN_MAX {
        let rows = s
            .projections
            .event_times
            .from(&room_id, from, forward, batch);
        if rows.is_empty() {
            break;
        }
        for (t, pos) in &rows {
            scanned += 1;
            if *pos > access.cap {
                continue;
            }
            if let Some(id) = s.projections.timeline.event_id_at(&room_id, *pos)
                && let Some(ev) = s.projections.timeline.event(&id)
                && can_see(&s, &r.user_id, &access, &ev)
            {
                return Ok(Json(json!({ "event_id": id, "origin_server_ts": t })));
            }
        }
        if rows.len() < batch {
            break;
        }
        batch = (batch * 2).min(64);
        // Continue past the last timestamp seen: events sharing that millisecond beyond
        // this batch are skipped (rare; the answer is then the next visible one).
        let last = rows.last().map(|(t, _)| *t).unwrap_or(from);
        from = if forward {
            last.saturating_add(1)
        } else if last == 0 {
            break;
        } else {
            last - 1
        };
    }
    Err(MatrixError::not_found(
        "No event the requester may see in that direction",
    ))
}
