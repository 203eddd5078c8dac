//! Server-admin endpoints (not part of the Matrix spec; under `/_spindle/admin/v1`).
//!
//! The audit trail, served from the `audit` projection (the API never reads the
//! journal): the same entries `spindle audit room|user` prints. Only server admins
//! (config `admins`, or promoted with `spindle admin promote`) may call them; anyone
//! else gets 403 `M_FORBIDDEN`, whatever the room.
//!
//! - `GET /_spindle/admin/v1/audit/rooms/{roomId}`: `{"room_id", "changes": [StateChange],
//!   "next_from"?}`. Query: `type`, `sender`, `since_ts`, `until_ts` (ms since the
//!   epoch, `since_ts <= origin_server_ts < until_ts`), `from` (a `next_from`),
//!   `limit` (default 100, clamped to 1..=1000).
//! - `GET /_spindle/admin/v1/audit/users/{userId}`: `{"user_id", "entries": [UserEntry],
//!   "next_from"?}`. Query: `from`, `limit` (as above).
//! - `GET /_spindle/admin/v1/projections`: `{"head", "applied", "projections": [{"name",
//!   "checkpoint", "lag", "ready", "generation", "rebuilding"}]}` (what `spindle replay
//!   status` prints offline); `rebuilding` is `null` or `{"generation", "checkpoint",
//!   "lag"}` while an online rebuild runs.
//! - `POST /_spindle/admin/v1/projections/{name}/rebuild`: starts rebuilding that
//!   projection online (beside the live tables, swapped in once caught up; SPEC §3
//!   "Online rebuild"). 202 `{"projection", "generation"}`; 404 `M_NOT_FOUND` for an
//!   unknown name; 409 `M_UNKNOWN` while it is backfilling or already being rebuilt.
//!
//! Also the spec's `GET /_matrix/client/v3/admin/whois/{userId}` (see [`whois`]).
//!
//! While the `audit` projection is backfilling (new in a release), the audit endpoints
//! answer 503 `M_UNKNOWN` with its progress instead of a half-built trail.

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::{get, post},
};
use serde_json::{Value, json};
use spindle_projections::audit::RoomFilter;

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
};

/// Default and largest page size.
const LIMIT_DEFAULT: u64 = 100;
const LIMIT_MAX: u64 = 1000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_spindle/admin/v1/audit/rooms/{room_id}", get(audit_room))
        .route("/_spindle/admin/v1/audit/users/{user_id}", get(audit_user))
        .route("/_spindle/admin/v1/projections", get(projections_status))
        .route("/_matrix/client/v3/admin/whois/{user_id}", get(whois))
        .route(
            "/_spindle/admin/v1/projections/{name}/rebuild",
            post(rebuild_projection),
        )
}

/// `POST /_spindle/admin/v1/projections/{name}/rebuild`: starts an online rebuild (see
/// the module doc). Answers once it has started; progress is in
/// `GET /_spindle/admin/v1/projections`.
async fn rebuild_projection(
    State(s): State<AppState>,
    r: Requester,
    Path(name): Path<String>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    require_admin(&s, &r)?;
    use spindle_projections::RebuildError;
    match s.projections.rebuild_online(&name) {
        Ok(generation) => Ok((
            StatusCode::ACCEPTED,
            Json(json!({"projection": name, "generation": generation})),
        )),
        Err(e @ RebuildError::Unknown(_)) => Err(MatrixError::not_found(e.to_string())),
        Err(
            e @ (RebuildError::Backfilling(_)
            | RebuildError::AlreadyRebuilding(..)
            | RebuildError::OfflineOnly(_)),
        ) => Err(MatrixError::new(
            StatusCode::CONFLICT,
            "M_UNKNOWN",
            e.to_string(),
        )),
        Err(e @ RebuildError::Store(_)) => Err(MatrixError::internal(e.to_string())),
    }
}

/// `GET /_matrix/client/v3/admin/whois/{userId}` (spec: "Server administration"): the
/// user's devices, each with one session whose one connection carries `last_seen` (ms),
/// `ip` and `user_agent` once the device has been seen (`ip` only while
/// `[devices] keep_client_addresses` is on; see `devices` for how they are kept). For server
/// admins and for the user themself; anyone else gets 403 `M_FORBIDDEN`, whether or not
/// the user exists; an admin asking about an unknown user gets 404 `M_NOT_FOUND`.
pub(crate) async fn whois(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
) -> ApiResult<Json<Value>> {
    if user_id != r.user_id {
        require_admin(&s, &r)?;
    }
    if s.projections.accounts.user(&user_id).is_none() {
        return Err(MatrixError::not_found("Unknown user"));
    }
    let devices: serde_json::Map<String, Value> = s
        .projections
        .accounts
        .devices(&user_id)
        .into_iter()
        .map(|(device_id, _)| {
            let mut connection = json!({});
            if let Some(seen) = crate::devices::last_seen_of(&s, &user_id, &device_id) {
                connection["last_seen"] = json!(seen.ts);
                if let Some(ip) = seen.ip {
                    connection["ip"] = json!(ip);
                }
                if let Some(ua) = seen.user_agent {
                    connection["user_agent"] = json!(ua);
                }
            }
            let session = json!({ "connections": [connection] });
            (device_id, json!({ "sessions": [session] }))
        })
        .collect();
    Ok(Json(json!({ "user_id": user_id, "devices": devices })))
}

/// 503 while the audit projection backfills (see the module doc).
fn require_audit_ready(s: &AppState) -> ApiResult<()> {
    if s.projections.runtime.is_ready("audit") {
        return Ok(());
    }
    let checkpoint = s
        .projections
        .runtime
        .status()
        .into_iter()
        .find(|p| p.name == "audit")
        .map(|p| p.checkpoint)
        .unwrap_or(0);
    Err(MatrixError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "M_UNKNOWN",
        format!(
            "the audit trail is still being built (position {checkpoint} of {}); try again shortly",
            s.journal.durable_head()
        ),
    ))
}

/// `GET /_spindle/admin/v1/projections`: each projection's checkpoint, lag and
/// readiness, the journal head and the applied position.
async fn projections_status(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let head = s.journal.durable_head();
    let projections: Vec<Value> = s
        .projections
        .runtime
        .status()
        .into_iter()
        .map(|p| {
            json!({
                "name": p.name,
                "checkpoint": p.checkpoint,
                "lag": head.saturating_sub(p.checkpoint),
                "ready": p.ready,
                "generation": p.generation,
                "rebuilding": p.rebuilding.map(|r| json!({
                    "generation": r.generation,
                    "checkpoint": r.checkpoint,
                    "lag": head.saturating_sub(r.checkpoint),
                })),
            })
        })
        .collect();
    Ok(Json(json!({
        "head": head,
        "applied": s.projections.runtime.applied(),
        "projections": projections,
    })))
}

/// Whether `user_id` is a server admin: listed in the config, or promoted by a
/// journal fact (`spindle admin promote`).
pub fn is_admin(s: &AppState, user_id: &str) -> bool {
    s.config.admins.iter().any(|a| a == user_id) || s.projections.audit.is_admin(user_id)
}

pub(crate) fn require_admin(s: &AppState, r: &Requester) -> ApiResult<()> {
    if is_admin(s, &r.user_id) {
        Ok(())
    } else {
        Err(MatrixError::forbidden("You are not a server admin"))
    }
}

fn page(q: &Query) -> ApiResult<(u64, usize)> {
    let from = q.u64("from")?.unwrap_or(0);
    let limit = q.u64("limit")?.unwrap_or(LIMIT_DEFAULT).clamp(1, LIMIT_MAX) as usize;
    Ok((from, limit))
}

/// `GET /_spindle/admin/v1/audit/rooms/{roomId}`: every state change of the room.
async fn audit_room(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    require_audit_ready(&s)?;
    let (from, limit) = page(&q)?;
    let filter = RoomFilter {
        event_type: q.get("type").map(str::to_owned),
        sender: q.get("sender").map(str::to_owned),
        since_ts: q.u64("since_ts")?,
        until_ts: q.u64("until_ts")?,
    };
    let (changes, next) = s
        .projections
        .audit
        .room_changes(&room_id, &filter, from, limit);
    let mut body = json!({ "room_id": room_id, "changes": changes });
    if let Some(n) = next {
        body["next_from"] = json!(n);
    }
    Ok(Json(body))
}

/// `GET /_spindle/admin/v1/audit/users/{userId}`: the account's journal facts and
/// membership changes (never a token or its hash, never a password hash).
async fn audit_user(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    require_audit_ready(&s)?;
    let (from, limit) = page(&q)?;
    let (entries, next) = s.projections.audit.user_entries(&user_id, from, limit);
    let mut body = json!({ "user_id": user_id, "entries": entries });
    if let Some(n) = next {
        body["next_from"] = json!(n);
    }
    Ok(Json(body))
}
