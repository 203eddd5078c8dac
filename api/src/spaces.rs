//! Spaces (spec: client-server API "Spaces"): `GET /rooms/{roomId}/hierarchy`, and
//! the room summary (`GET /room_summary/{roomIdOrAlias}`) that shares its visibility
//! rule.
//!
//! A breadth-first walk over `m.space.child` state events (a child counts when its
//! content has a non-empty `via` list), from the requested room. A room appears only
//! when the requester may see or join it: joined or invited, world-readable history,
//! or a join rule of `public`, `knock`, `knock_restricted`, or `restricted` with
//! membership in an allowed room. Rooms this server does not know (they would need
//! federation) are left out. Each visited room costs a few state point lookups plus
//! one scan of its `m.space.child` entries; the walk is bounded by
//! [`HIERARCHY_MAX_ROOMS`].

use std::collections::{HashSet, VecDeque};

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};

use spindle_projections::discovery;

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
};

/// Default `limit` (rooms per page).
pub const HIERARCHY_DEFAULT_LIMIT: usize = 50;
/// Largest `limit`.
pub const HIERARCHY_MAX_LIMIT: usize = 100;
/// Default and largest `max_depth`.
pub const HIERARCHY_MAX_DEPTH: u64 = 10;
/// Most rooms one walk visits (pages included).
pub const HIERARCHY_MAX_ROOMS: usize = 1_000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v1/rooms/{room_id}/hierarchy",
            get(hierarchy),
        )
        .route(
            "/_matrix/client/v1/room_summary/{room_id_or_alias}",
            get(room_summary),
        )
}

/// Whether `user_id` may see `room_id` in a hierarchy (see the module docs; the
/// membership-free part is [`discovery::previewable`], shared with federation).
fn may_see(s: &AppState, user_id: &str, room_id: &str) -> bool {
    if s.projections.state.current_root(room_id).is_none() {
        return false;
    }
    match s.projections.membership.get(room_id, user_id) {
        Some(m) if m.membership == "join" || m.membership == "invite" => return true,
        Some(m) if m.membership == "ban" => return false,
        _ => {}
    }
    discovery::previewable(&s.projections, room_id, |allowed| {
        s.projections
            .membership
            .get(allowed, user_id)
            .is_some_and(|m| m.membership == "join")
    })
}

fn children(s: &AppState, room_id: &str, suggested_only: bool) -> Vec<(String, Value)> {
    discovery::space_children(&s.projections, room_id, suggested_only)
}

/// `GET /_matrix/client/v1/rooms/{roomId}/hierarchy`: `suggested_only`, `limit`
/// (default 50, ≤ 100), `max_depth` (≤ 10), `from` (a `next_batch`, `h<rooms
/// already returned>`; malformed: 400 `M_INVALID_PARAM`). The requested room itself
/// must be visible to the requester (else 403).
async fn hierarchy(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    let suggested_only = match q.get("suggested_only") {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(MatrixError::invalid_param(
                "suggested_only must be true or false",
            ));
        }
    };
    let limit = q
        .u64("limit")?
        .map(|l| (l as usize).clamp(1, HIERARCHY_MAX_LIMIT))
        .unwrap_or(HIERARCHY_DEFAULT_LIMIT);
    let max_depth = q
        .u64("max_depth")?
        .unwrap_or(HIERARCHY_MAX_DEPTH)
        .min(HIERARCHY_MAX_DEPTH);
    let skip = match q.get("from") {
        None => 0,
        Some(t) => t
            .strip_prefix('h')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| MatrixError::invalid_param(format!("Invalid from token {t:?}")))?,
    };
    if !may_see(&s, &r.user_id, &room_id) {
        return Err(MatrixError::forbidden(
            "You may not see this room's hierarchy",
        ));
    }
    let mut rooms = Vec::new();
    let mut returned = 0usize;
    let mut more = false;
    let mut seen: HashSet<String> = HashSet::from([room_id.clone()]);
    let mut queue: VecDeque<(String, u64)> = VecDeque::from([(room_id, 0)]);
    while let Some((room, depth)) = queue.pop_front() {
        if !may_see(&s, &r.user_id, &room) {
            continue;
        }
        let Some(mut chunk) = crate::directory::room_chunk(&s, &room) else {
            continue;
        };
        let kids = children(&s, &room, suggested_only);
        if depth < max_depth {
            for (child, _) in &kids {
                if seen.len() < HIERARCHY_MAX_ROOMS && seen.insert(child.clone()) {
                    queue.push_back((child.clone(), depth + 1));
                }
            }
        }
        if returned < skip {
            returned += 1;
            continue;
        }
        if rooms.len() == limit {
            more = true;
            break;
        }
        chunk["children_state"] = Value::Array(kids.into_iter().map(|(_, ev)| ev).collect());
        rooms.push(chunk);
        returned += 1;
    }
    let mut out = json!({ "rooms": rooms });
    if more {
        out["next_batch"] = json!(format!("h{returned}"));
    }
    Ok(Json(out))
}

/// `GET /_matrix/client/v1/room_summary/{roomIdOrAlias}` (spec: "Room summary"; the
/// access token is optional). Answers the room's summary when the requester may see
/// or join it (the same rule as the hierarchy; without a token only world-readable,
/// public or knockable rooms), with the requester's `membership` when signed in. Any
/// other room, and rooms on other servers, are 404, so existence does not leak.
async fn room_summary(
    State(s): State<AppState>,
    Path(target): Path<String>,
    headers: axum::http::HeaderMap,
    q: Query,
) -> ApiResult<Json<Value>> {
    s.wait_for_acknowledged().await?;
    let not_found = || MatrixError::not_found("Room not found");
    // A token is optional; a bad one is an error like everywhere else.
    let token = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim().to_owned())
        .or_else(|| q.get("access_token").map(str::to_owned));
    let user = match token {
        None => None,
        Some(t) => Some(
            s.projections
                .accounts
                .token(&crate::extract::token_hash(&t))
                .filter(|o| o.expires_at.is_none_or(|e| crate::now_ms() < e))
                .ok_or_else(|| {
                    MatrixError::new(
                        axum::http::StatusCode::UNAUTHORIZED,
                        "M_UNKNOWN_TOKEN",
                        "Unknown access token",
                    )
                    .with_extra(json!({ "soft_logout": false }))
                })?
                .user_id,
        ),
    };
    let room_id = if target.starts_with('#') {
        s.projections
            .aliases
            .resolve(&target)
            .ok_or_else(not_found)?
            .room_id
    } else {
        target
    };
    let membership = user
        .as_deref()
        .and_then(|u| s.projections.membership.get(&room_id, u))
        .map(|m| m.membership);
    let visible = match &user {
        Some(u) => may_see(&s, u, &room_id),
        None => may_see(&s, "", &room_id),
    } || membership.as_deref() == Some("knock");
    if !visible {
        return Err(not_found());
    }
    let mut summary = crate::directory::room_chunk(&s, &room_id).ok_or_else(not_found)?;
    discovery::add_summary_details(&s.projections, &room_id, &mut summary);
    if user.is_some() {
        summary["membership"] = json!(membership.unwrap_or_else(|| "leave".into()));
    }
    Ok(Json(summary))
}
