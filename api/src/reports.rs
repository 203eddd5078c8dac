//! Reporting content (spec: client-server API "Reporting content"): `POST
//! /rooms/{roomId}/report/{eventId}`, `POST /rooms/{roomId}/report` and `POST
//! /users/{userId}/report`. Each report is a `ContentReported` or `UserReported` fact
//! in the journal, for the server admin; the audit trail (`/_spindle/admin/v1/audit`)
//! lists them, nothing else reads them yet.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::post,
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester, opt_str},
    visibility::visible_event,
};

/// Longest report `reason` kept, bytes (longer: 400 `M_BAD_JSON`).
pub const MAX_REASON_BYTES: usize = 4096;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/rooms/{room_id}/report/{event_id}",
            post(report_event),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/report",
            post(report_room),
        )
        .route(
            "/_matrix/client/v3/users/{user_id}/report",
            post(report_user),
        )
}

fn reason(body: &serde_json::Map<String, Value>) -> ApiResult<Option<String>> {
    let reason = opt_str(body, "reason")?;
    if reason.as_ref().is_some_and(|r| r.len() > MAX_REASON_BYTES) {
        return Err(MatrixError::bad_json(format!(
            "reason is longer than {MAX_REASON_BYTES} bytes"
        )));
    }
    Ok(reason)
}

async fn record(s: &AppState, r: &Requester, fact: Fact) -> ApiResult<()> {
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await
        .map(|_| ())
}

/// `POST /rooms/{roomId}/report/{eventId}`: the reporter must be able to see the event
/// (else 404 `M_NOT_FOUND`, the same as for an event that does not exist). `score` is
/// kept if given (the spec removed it; old clients still send it).
async fn report_event(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id)): Path<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    visible_event(&s, &r.user_id, &room_id, &event_id)?;
    let score = body.get("score").and_then(|v| v.as_i64());
    let fact = Fact::ContentReported {
        reporter: r.user_id.clone(),
        room_id,
        event_id: Some(event_id),
        reason: reason(&body)?,
        score,
    };
    record(&s, &r, fact).await?;
    Ok(Json(json!({})))
}

/// `POST /rooms/{roomId}/report`: anyone may report a room (the spec does not require
/// membership). To keep room ids from being enumerated, an unknown room answers 200
/// like a known one (the spec allows this) and records nothing.
async fn report_room(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let reason = reason(&body)?;
    if ruma::RoomId::parse(&room_id).is_err() {
        return Err(MatrixError::invalid_param("Invalid room id"));
    }
    if s.projections.state.room(&room_id).is_some() {
        let fact = Fact::ContentReported {
            reporter: r.user_id.clone(),
            room_id,
            event_id: None,
            reason,
            score: None,
        };
        record(&s, &r, fact).await?;
    }
    Ok(Json(json!({})))
}

/// `POST /users/{userId}/report` (`reason` required, may be blank): 200 `{}` for any
/// well-formed user id. The spec lets a server hide whether the user exists; here the
/// report is journaled either way (`UserReported`), so the answer and its timing (one
/// durable append) are the same for an account that exists, one that does not, and a
/// user of another server.
async fn report_user(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    if ruma::UserId::parse(&user_id).is_err() {
        return Err(MatrixError::invalid_param("Invalid user id"));
    }
    let reason = match body.get("reason") {
        None => return Err(MatrixError::missing_param("reason is required")),
        Some(_) => reason(&body)?.unwrap_or_default(),
    };
    let fact = Fact::UserReported {
        reporter: r.user_id.clone(),
        user_id,
        reason,
    };
    record(&s, &r, fact).await?;
    Ok(Json(json!({})))
}
