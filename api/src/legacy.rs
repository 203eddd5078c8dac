//! The legacy endpoints bots and older clients still call (spec: client-server API,
//! deprecated since r0 except for peeking): `GET /events` (also `room_id` peeking into
//! a world-readable room), `GET /initialSync`, `GET /rooms/{roomId}/initialSync` and
//! `GET /events/{eventId}`.
//!
//! They are thin views over the same projections and the same per-event
//! authorization as `/sync` and `/messages` ([`crate::visibility`]): nothing here
//! reads anything the newer endpoints do not. What they leave out, deliberately:
//! presence, typing and receipts in `/events` (the ephemeral stream is `/sync`'s), and
//! invites and leaves in `/events` (`/initialSync` lists them).

use std::time::Duration;

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};
use spindle_projections::timeline::EventRecord;

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
    read::{parse_token, readable_root, render, token},
    visibility::{Access, can_see, room_access, visible_event, world_readable},
};

/// Most events one `GET /events` answer carries (the rest follow from its `end`).
pub const EVENTS_PAGE_MAX: usize = 100;

/// `GET /events` waits this long without `timeout` (as Synapse), bounded by
/// `max_sync_timeout_ms`.
pub const EVENTS_TIMEOUT_MS_DEFAULT: u64 = 30_000;

/// Messages per room in the initial syncs without `limit` (and their cap).
const INITIAL_SYNC_LIMIT_DEFAULT: usize = 10;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_matrix/client/v3/events", get(events))
        .route("/_matrix/client/v3/events/{event_id}", get(event_by_id))
        .route("/_matrix/client/v3/initialSync", get(initial_sync))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/initialSync",
            get(room_initial_sync),
        )
}

fn viewer(r: &Requester) -> Option<(&str, &str)> {
    Some((r.user_id.as_str(), r.device_id.as_str()))
}

/// Timeline positions of `rooms` in `(after, upto]`, merged in position order, at most
/// `limit` of them. Reads: one index range per room that had activity after `after`
/// (memory check first), never another room's.
fn stream_rows(
    s: &AppState,
    rooms: &[String],
    after: u64,
    upto: u64,
    limit: usize,
) -> Vec<(u64, String)> {
    let mut rows: Vec<(u64, String)> = Vec::new();
    for room in rooms {
        if s.projections
            .timeline
            .last_activity(room)
            .is_none_or(|p| p <= after)
        {
            continue;
        }
        rows.extend(
            s.projections
                .timeline
                .range_forward(room, after, upto, limit),
        );
    }
    rows.sort();
    rows.truncate(limit);
    rows
}

/// `GET /_matrix/client/v3/events` (spec: "Listen on the event stream", deprecated;
/// with `room_id`: "Listen on the event stream of a particular room", for peeking).
///
/// Timeline events after `from` (default: now) in the user's joined rooms, or in
/// `room_id` when the user is joined to it or it is world-readable, oldest first, at
/// most [`EVENTS_PAGE_MAX`]; waits up to `timeout` ms (default
/// [`EVENTS_TIMEOUT_MS_DEFAULT`]) when there are none. `start` is `from`, `end` the
/// token to pass next. Errors: 400 `M_INVALID_PARAM` for a malformed or future `from`
/// or a bad `room_id`; 403 `M_FORBIDDEN` for a `room_id` the user may not read.
async fn events(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let head = s.journal.durable_head();
    let from = match q.get("from") {
        Some(t) => parse_token(t)?,
        None => s.projections.runtime.applied(),
    };
    if from > head {
        return Err(MatrixError::invalid_param("from token is from the future"));
    }
    let timeout = q
        .u64("timeout")?
        .unwrap_or(EVENTS_TIMEOUT_MS_DEFAULT)
        .min(s.config.max_sync_timeout_ms);
    let (rooms, access): (Vec<String>, Vec<(String, Access)>) = match q.get("room_id") {
        Some(room) => {
            if ruma::RoomId::parse(room).is_err() {
                return Err(MatrixError::invalid_param(format!(
                    "{room:?} is not a room id"
                )));
            }
            let access = room_access(&s, &r.user_id, room)?;
            if !access.joined() && !world_readable(&s, room) {
                return Err(MatrixError::forbidden(
                    "You are not joined to this room and it is not world-readable",
                ));
            }
            (vec![room.to_owned()], vec![(room.to_owned(), access)])
        }
        None => {
            let joined: Vec<String> = s
                .projections
                .membership
                .rooms_of(&r.user_id)
                .into_iter()
                .filter(|(_, m)| m.membership == "join")
                .map(|(room, _)| room)
                .collect();
            let access = joined
                .iter()
                .filter_map(|room| Some((room.clone(), room_access(&s, &r.user_id, room).ok()?)))
                .collect();
            (joined, access)
        }
    };
    let has_news = |upto: u64| !stream_rows(&s, &rooms, from, upto, 1).is_empty();
    if timeout > 0 && !has_news(s.projections.runtime.applied()) {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout);
        let mut applied_rx = s.projections.runtime.subscribe();
        let mut shutdown = s.shutdown.clone();
        loop {
            applied_rx.borrow_and_update();
            if *shutdown.borrow_and_update() || has_news(s.projections.runtime.applied()) {
                break;
            }
            tokio::select! {
                _ = applied_rx.changed() => {}
                _ = shutdown.changed() => break,
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
    }
    let upto = s.projections.runtime.applied().max(from);
    let rows = stream_rows(&s, &rooms, from, upto, EVENTS_PAGE_MAX + 1);
    let full = rows.len() > EVENTS_PAGE_MAX;
    let rows = &rows[..rows.len().min(EVENTS_PAGE_MAX)];
    let end = if full {
        rows.last().map(|(p, _)| *p).unwrap_or(upto)
    } else {
        upto
    };
    let chunk: Vec<Value> = rows
        .iter()
        .filter_map(|(_, id)| s.projections.timeline.event(id))
        .filter(|ev| {
            access
                .iter()
                .find(|(room, _)| room == ev.pdu.room_id.as_str())
                .is_some_and(|(_, a)| can_see(&s, &r.user_id, a, ev))
        })
        .map(|ev| render(&s, &ev, viewer(&r)))
        .collect();
    Ok(Json(json!({
        "start": token(from),
        "end": token(end),
        "chunk": chunk,
    })))
}

/// `GET /_matrix/client/v3/events/{eventId}` (spec: "Get a single event by event ID",
/// deprecated): the event, if the user may see it. Errors: 404 `M_NOT_FOUND` alike
/// for an unknown event and one the user may not see.
async fn event_by_id(
    State(s): State<AppState>,
    r: Requester,
    Path(event_id): Path<String>,
) -> ApiResult<Json<Value>> {
    let not_found = || MatrixError::not_found("Event not found");
    let ev = s
        .projections
        .timeline
        .event(&event_id)
        .ok_or_else(not_found)?;
    let (_, ev) = visible_event(&s, &r.user_id, ev.pdu.room_id.as_str(), &event_id)?;
    Ok(Json(render(&s, &ev, viewer(&r))))
}

/// The newest `limit` events of a room the user may see, up to the user's cap,
/// as a `PaginationChunk` (oldest first; `start` pages back with `/messages`).
fn messages_chunk(s: &AppState, r: &Requester, room: &str, access: &Access, limit: usize) -> Value {
    let upto = access.cap.min(s.projections.runtime.applied());
    let (events, _) = crate::sync::newest_events(s, room, 0, upto, limit, |ev: &EventRecord| {
        can_see(s, &r.user_id, access, ev)
    });
    let start = events
        .first()
        .map(|e| e.position.saturating_sub(1))
        .unwrap_or(upto);
    json!({
        "start": token(start),
        "end": token(upto),
        "chunk": events.iter().map(|e| render(s, e, viewer(r))).collect::<Vec<_>>(),
    })
}

/// The room's state as the user may read it (current, or when they left).
fn state_events(s: &AppState, r: &Requester, room: &str, access: &Access) -> Vec<Value> {
    let Some(root) = readable_root(s, room, access) else {
        return vec![];
    };
    s.projections
        .state
        .entries(root)
        .into_iter()
        .filter_map(|(_, _, id)| s.projections.timeline.event(&id))
        .map(|ev| render(s, &ev, viewer(r)))
        .collect()
}

fn room_account_data(s: &AppState, user: &str, room: &str) -> Vec<Value> {
    s.projections
        .account_data
        .all(user, Some(room))
        .into_iter()
        .map(|(t, c)| json!({ "type": t, "content": c }))
        .collect()
}

/// One `RoomInfo` (spec: `/initialSync` and `/rooms/{roomId}/initialSync`).
fn room_info(s: &AppState, r: &Requester, room: &str, access: &Access, limit: usize) -> Value {
    let mut info = json!({
        "room_id": room,
        "messages": messages_chunk(s, r, room, access, limit),
        "state": state_events(s, r, room, access),
        "visibility": if s.projections.directory.is_published(room) { "public" } else { "private" },
        "account_data": room_account_data(s, &r.user_id, room),
    });
    if let Some(m) = &access.membership {
        info["membership"] = json!(m.membership);
    }
    info
}

/// `GET /_matrix/client/v3/rooms/{roomId}/initialSync` (spec: "Snapshot the current
/// state of a room and its most recent messages"): for members, peekers of a
/// world-readable room, and former members (the state and messages up to their
/// leave, as the spec allows). Errors: 403 `M_FORBIDDEN` for a room the user may not
/// read (also for an unknown room, so existence does not leak).
async fn room_initial_sync(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    let access = room_access(&s, &r.user_id, &room_id)?;
    if access
        .membership
        .as_ref()
        .is_some_and(|m| m.membership == "invite" || m.membership == "knock")
        && !world_readable(&s, &room_id)
    {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    let mut info = room_info(&s, &r, &room_id, &access, INITIAL_SYNC_LIMIT_DEFAULT);
    // Synapse answers with the members' presence here; presence is `/sync`'s.
    info["presence"] = json!([]);
    Ok(Json(info))
}

/// `GET /_matrix/client/v3/initialSync` (spec: "Get the user's current state",
/// deprecated): every joined and invited room (and left ones with `archived=true`),
/// each with its newest `limit` messages (default 10, at most
/// [`crate::read::MAX_PAGE`]) and state, plus global account data; `end` is the token
/// for `GET /events`. Invites carry the invite event instead of messages and state.
/// Errors: 400 `M_INVALID_PARAM` for a bad `limit` or `archived`.
async fn initial_sync(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let limit = q
        .u64("limit")?
        .map(|l| l.min(crate::read::MAX_PAGE as u64) as usize)
        .unwrap_or(INITIAL_SYNC_LIMIT_DEFAULT);
    let archived = match q.get("archived") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(MatrixError::invalid_param(format!(
                "archived must be true or false, not {other:?}"
            )));
        }
    };
    let end = s.projections.runtime.applied();
    let mut rooms = Vec::new();
    for (room, m) in s.projections.membership.rooms_of(&r.user_id) {
        if m.forgotten {
            continue;
        }
        match m.membership.as_str() {
            "join" => {}
            "leave" | "ban" if archived => {}
            "invite" => {
                let invite = s
                    .projections
                    .timeline
                    .event(&m.event_id)
                    .map(|ev| render(&s, &ev, viewer(&r)));
                rooms.push(json!({
                    "room_id": room,
                    "membership": "invite",
                    "invite": invite,
                }));
                continue;
            }
            _ => continue,
        }
        let Ok(access) = room_access(&s, &r.user_id, &room) else {
            continue;
        };
        rooms.push(room_info(&s, &r, &room, &access, limit));
    }
    let account_data: Vec<Value> = s
        .projections
        .account_data
        .all(&r.user_id, None)
        .into_iter()
        .map(|(t, c)| json!({ "type": t, "content": c }))
        .collect();
    Ok(Json(json!({
        "end": token(end),
        "presence": [],
        "rooms": rooms,
        "account_data": account_data,
    })))
}
