//! Mutual rooms (spec v1.19: `GET /_matrix/client/v1/mutual_rooms?user_id=`): the
//! rooms both the requester and `user_id` are joined to.
//!
//! Cost: one scan of the requester's own memberships (the `membership` projection's
//! `user_rooms`, keyed by user) and one point lookup of `user_id`'s membership per room
//! the requester is joined to; never a scan of the other user's rooms or of any room's
//! members. Rooms come in room-id order, [`PAGE_SIZE`] per page; `next_batch` is the
//! first room id of the next page (a `from` that is not a room id is 400
//! `M_INVALID_PARAM`). `count` is the total.

use axum::{Json, Router, extract::State, routing::get};
use serde_json::{Value, json};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
};

/// Rooms per page.
pub const PAGE_SIZE: usize = 100;

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/_matrix/client/v1/mutual_rooms", get(mutual_rooms))
}

/// `GET /mutual_rooms`: `{joined, count, next_batch?}`. `user_id` missing, malformed
/// or the requester's own: 400 `M_INVALID_PARAM` (the spec's 400); a user that does
/// not exist shares no room (empty list).
async fn mutual_rooms(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let other = q
        .get("user_id")
        .ok_or_else(|| MatrixError::invalid_param("user_id is required"))?;
    if ruma::UserId::parse(other).is_err() {
        return Err(MatrixError::invalid_param("user_id is not a valid user id"));
    }
    if other == r.user_id {
        return Err(MatrixError::invalid_param(
            "user_id must be another user than the requester",
        ));
    }
    let from = q.get("from");
    if from.is_some_and(|f| ruma::RoomId::parse(f).is_err()) {
        return Err(MatrixError::invalid_param("Invalid from token"));
    }
    let mutual: Vec<String> = s
        .projections
        .membership
        .rooms_of(&r.user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .filter(|(room, _)| {
            s.projections
                .membership
                .get(room, other)
                .is_some_and(|m| m.membership == "join")
        })
        .map(|(room, _)| room)
        .collect();
    let start = from.map_or(0, |f| mutual.partition_point(|room| room.as_str() < f));
    let page: Vec<&String> = mutual[start..].iter().take(PAGE_SIZE).collect();
    let mut body = json!({ "joined": page, "count": mutual.len() });
    if let Some(next) = mutual.get(start + PAGE_SIZE) {
        body["next_batch"] = json!(next);
    }
    Ok(Json(body))
}
