//! Reporting content (spec: client-server API "Reporting content"): `POST
//! /rooms/{roomId}/report/{eventId}` and `POST /rooms/{roomId}/report`. Each report is
//! a `ContentReported` fact in the journal, for the server admin; nothing else reads
//! it yet (an admin listing is future work).

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
