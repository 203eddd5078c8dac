//! Relations and threads (spec: client-server API "Relationships between events",
//! "Threading"): `GET /rooms/{roomId}/relations/{eventId}[/{relType}[/{eventType}]]`,
//! `GET /rooms/{roomId}/threads`, and the aggregations bundled into
//! `unsigned.m.relations` of every event served ([`bundle`]).
//!
//! Every read checks the room ([`room_access`]) and each event ([`can_see`]); a parent
//! the user may not see answers 404, like one that does not exist.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};
use spindle_projections::{relations::Aggregation, timeline::EventRecord};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
    read::{parse_token, render, token},
    visibility::{Access, can_see, room_access},
};

/// Default `limit` of `/relations` and `/threads`.
pub const DEFAULT_LIMIT: usize = 20;
/// Largest `limit` of `/relations` and `/threads`.
pub const MAX_LIMIT: usize = 100;
/// Levels followed by `recurse=true` (the spec asks for at least 3).
pub const RECURSION_DEPTH: usize = 3;
/// Children read per level when recursing.
const RECURSE_FANOUT_MAX: usize = 1000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}",
            get(relations_all),
        )
        .route(
            "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}/{rel_type}",
            get(relations_rel),
        )
        .route(
            "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}/{rel_type}/{event_type}",
            get(relations_rel_type),
        )
        .route("/_matrix/client/v1/rooms/{room_id}/threads", get(threads))
}

/// The aggregations bundled into an event's `unsigned.m.relations` for `user_id`
/// (spec: "Aggregations of child events"): the latest valid edit (`m.replace`, not for
/// a redacted original), the thread summary (`m.thread`: `latest_event` with its own
/// bundle, `count`, `current_user_participated`), and the `m.reference` chunk. One
/// point read for an event without relations; bundled events are checked for
/// visibility like any other.
pub fn bundle(
    s: &AppState,
    ev: &EventRecord,
    viewer: Option<(&str, &str)>,
    depth: u8,
) -> Option<Value> {
    let event_id = ev.pdu.event_id.as_str();
    let aggr: Aggregation = s.projections.relations.aggregation(event_id)?;
    let user = viewer.map(|v| v.0);
    let room = ev.pdu.room_id.as_str();
    let access = match user {
        Some(u) => room_access(s, u, room).ok(),
        None => None,
    };
    let visible = |e: &EventRecord| match (user, &access) {
        (Some(u), Some(a)) => can_see(s, u, a, e),
        _ => false,
    };
    let mut out = serde_json::Map::new();
    if let Some((edit_id, _)) = &aggr.edit
        && s.projections.timeline.redacted_by(event_id).is_none()
        && s.projections.timeline.redacted_by(edit_id).is_none()
        && let Some(edit) = s.projections.timeline.event(edit_id)
        && visible(&edit)
    {
        out.insert("m.replace".into(), render_plain(s, &edit, viewer));
    }
    if let Some(thread) = &aggr.thread
        && let Some(latest) = s.projections.timeline.event(&thread.latest_event_id)
        && visible(&latest)
    {
        let latest_json = if depth == 0 {
            render_with(s, &latest, viewer, depth + 1)
        } else {
            render_plain(s, &latest, viewer)
        };
        out.insert(
            "m.thread".into(),
            json!({
                "latest_event": latest_json,
                "count": thread.count,
                "current_user_participated": user.is_some_and(|u| s.projections.relations.participated(event_id, u)),
            }),
        );
    }
    if aggr.references > 0 {
        let chunk: Vec<Value> = s
            .projections
            .relations
            .children(event_id, Some("m.reference"), 0, u64::MAX, false, MAX_LIMIT)
            .into_iter()
            .filter_map(|(_, c)| s.projections.timeline.event(&c.event_id))
            .filter(|e| visible(e))
            .map(|e| json!({ "event_id": e.pdu.event_id }))
            .collect();
        if !chunk.is_empty() {
            out.insert("m.reference".into(), json!({ "chunk": chunk }));
        }
    }
    (!out.is_empty()).then_some(Value::Object(out))
}

/// Renders without bundled aggregations (inside a bundle).
fn render_plain(s: &AppState, ev: &EventRecord, viewer: Option<(&str, &str)>) -> Value {
    crate::read::render_unbundled(s, ev, viewer)
}

fn render_with(s: &AppState, ev: &EventRecord, viewer: Option<(&str, &str)>, depth: u8) -> Value {
    let mut v = crate::read::render_unbundled(s, ev, viewer);
    if let Some(b) = bundle(s, ev, viewer, depth)
        && let Some(u) = v.get_mut("unsigned").and_then(|u| u.as_object_mut())
    {
        u.insert("m.relations".into(), b);
    }
    v
}

fn limit_of(q: &Query) -> ApiResult<usize> {
    Ok(q.u64("limit")?
        .map(|l| l as usize)
        .unwrap_or(DEFAULT_LIMIT)
        .min(MAX_LIMIT))
}

fn bool_param(q: &Query, name: &str) -> ApiResult<Option<bool>> {
    match q.get(name) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(other) => Err(MatrixError::invalid_param(format!(
            "{name} must be true or false, not {other:?}"
        ))),
    }
}

/// The parent event, if the user may see it (else 404, like a missing one).
fn parent(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    event_id: &str,
) -> ApiResult<(Access, EventRecord)> {
    let not_found = || MatrixError::not_found("Event not found");
    let access = room_access(s, &r.user_id, room_id).map_err(|_| not_found())?;
    let ev = s
        .projections
        .timeline
        .event(event_id)
        .ok_or_else(not_found)?;
    if ev.pdu.room_id.as_str() != room_id || !can_see(s, &r.user_id, &access, &ev) {
        return Err(not_found());
    }
    Ok((access, ev))
}

async fn relations_all(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id)): Path<(String, String)>,
    q: Query,
) -> ApiResult<Json<Value>> {
    relations(s, r, room_id, event_id, None, None, q)
}

async fn relations_rel(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id, rel_type)): Path<(String, String, String)>,
    q: Query,
) -> ApiResult<Json<Value>> {
    relations(s, r, room_id, event_id, Some(rel_type), None, q)
}

async fn relations_rel_type(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id, rel_type, event_type)): Path<(String, String, String, String)>,
    q: Query,
) -> ApiResult<Json<Value>> {
    relations(s, r, room_id, event_id, Some(rel_type), Some(event_type), q)
}

/// `GET /rooms/{roomId}/relations/{eventId}[/{relType}[/{eventType}]]` (spec:
/// `getRelatingEvents*`). Tokens are positions (`t<pos>`, the same as `/messages`):
/// `dir=b` (default) pages newest first from `from` down to `to`, `dir=f` oldest
/// first. `recurse=true` follows relations of relations [`RECURSION_DEPTH`] levels.
fn relations(
    s: AppState,
    r: Requester,
    room_id: String,
    event_id: String,
    rel_type: Option<String>,
    event_type: Option<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    let backward = match q.get("dir").unwrap_or("b") {
        "b" => true,
        "f" => false,
        _ => return Err(MatrixError::invalid_param("dir must be b or f")),
    };
    let limit = limit_of(&q)?;
    let recurse = bool_param(&q, "recurse")?;
    let from = q.get("from").map(parse_token).transpose()?;
    let to = q.get("to").map(parse_token).transpose()?;
    let (access, _) = parent(&s, &r, &room_id, &event_id)?;
    let cap = access.cap.min(s.projections.runtime.applied());
    // Positions allowed: dir=b: (to, from]; dir=f: (from, to].
    let (lo, hi) = if backward {
        (
            to.map_or(0, |t| t.saturating_add(1)),
            from.unwrap_or(cap).min(cap),
        )
    } else {
        (
            from.map_or(0, |f| f.saturating_add(1)),
            to.unwrap_or(cap).min(cap),
        )
    };
    let matches = |c: &spindle_projections::relations::Child| {
        event_type.as_deref().is_none_or(|t| c.kind == t)
    };
    let depth = if recurse == Some(true) {
        RECURSION_DEPTH
    } else {
        1
    };
    // Candidates: direct children, and with recursion their children, merged by
    // position (each level bounded).
    let mut candidates: Vec<(u64, spindle_projections::relations::Child)> = Vec::new();
    let mut chunk = Vec::new();
    let mut next = None;
    if depth == 1 {
        // Page directly through the index, filtering by type and visibility.
        let (mut lo, mut hi) = (lo, hi);
        loop {
            let page = limit.max(1) * 2;
            let rows = s.projections.relations.children(
                &event_id,
                rel_type.as_deref(),
                lo,
                hi,
                backward,
                page,
            );
            let exhausted = rows.len() < page;
            for (pos, c) in rows {
                if backward {
                    hi = pos.saturating_sub(1);
                } else {
                    lo = pos + 1;
                }
                if chunk.len() >= limit {
                    next = Some(if backward { pos } else { pos - 1 });
                    break;
                }
                if matches(&c)
                    && let Some(e) = s.projections.timeline.event(&c.event_id)
                    && can_see(&s, &r.user_id, &access, &e)
                {
                    chunk.push((pos, e));
                }
            }
            if next.is_some() || exhausted || lo > hi || (backward && hi == 0) {
                break;
            }
        }
    } else {
        let mut frontier = vec![event_id.clone()];
        for _ in 0..depth {
            let mut found = Vec::new();
            for p in &frontier {
                let rows =
                    s.projections
                        .relations
                        .children(p, None, lo, hi, backward, RECURSE_FANOUT_MAX);
                found.extend(rows);
            }
            frontier = found.iter().map(|(_, c)| c.event_id.clone()).collect();
            candidates.extend(found);
            if frontier.is_empty() {
                break;
            }
        }
        candidates
            .retain(|(_, c)| rel_type.as_deref().is_none_or(|t| c.rel_type == t) && matches(c));
        candidates.sort_by_key(|(p, _)| *p);
        if backward {
            candidates.reverse();
        }
        for (pos, c) in candidates {
            if chunk.len() >= limit {
                next = Some(if backward { pos } else { pos - 1 });
                break;
            }
            if let Some(e) = s.projections.timeline.event(&c.event_id)
                && can_see(&s, &r.user_id, &access, &e)
            {
                chunk.push((pos, e));
            }
        }
    }
    let viewer = Some((r.user_id.as_str(), r.device_id.as_str()));
    let mut out = json!({
        "chunk": chunk.iter().map(|(_, e)| render(&s, e, viewer)).collect::<Vec<_>>(),
    });
    if let Some(n) = next {
        out["next_batch"] = json!(token(n));
    }
    if let Some(f) = q.get("from") {
        out["prev_batch"] = json!(f);
    }
    if recurse.is_some() {
        out["recursion_depth"] = json!(depth);
    }
    Ok(Json(out))
}

/// `GET /rooms/{roomId}/threads` (spec: `getThreadRoots`): thread roots ordered by
/// their latest event, newest first; `include=participated` keeps threads the user
/// sent the root of or replied in; `from` is the previous `next_batch`.
async fn threads(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    let access = room_access(&s, &r.user_id, &room_id)?;
    let participated = match q.get("include").unwrap_or("all") {
        "all" => false,
        "participated" => true,
        other => {
            return Err(MatrixError::invalid_param(format!(
                "include must be all or participated, not {other:?}"
            )));
        }
    };
    let limit = limit_of(&q)?;
    let cap = access.cap.min(s.projections.runtime.applied());
    let mut before = match q.get("from") {
        Some(t) => parse_token(t)?.min(cap),
        None => cap,
    };
    let viewer = Some((r.user_id.as_str(), r.device_id.as_str()));
    let mut chunk = Vec::new();
    let mut next = None;
    'outer: loop {
        let page = limit.max(1) * 2;
        let rows = s.projections.relations.threads(&room_id, before, page);
        let exhausted = rows.len() < page;
        for (pos, root) in rows {
            if chunk.len() >= limit {
                next = Some(pos);
                break 'outer;
            }
            before = pos.saturating_sub(1);
            if participated && !s.projections.relations.participated(&root, &r.user_id) {
                continue;
            }
            if let Some(e) = s.projections.timeline.event(&root)
                && can_see(&s, &r.user_id, &access, &e)
            {
                chunk.push(render(&s, &e, viewer));
            }
        }
        if exhausted || before == 0 {
            break;
        }
    }
    let mut out = json!({ "chunk": chunk });
    if let Some(n) = next {
        out["next_batch"] = json!(token(n));
    }
    Ok(Json(out))
}
