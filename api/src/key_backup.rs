//! Server-side key backups (spec: client-server API "Server-side key backups"):
//! `/room_keys/version` (create, read, update, delete) and `/room_keys/keys` (all,
//! one room, one session; put, get, delete).
//!
//! Versions and keys are journal facts; the `key_backup` projection applies the
//! spec's "better session" rule and keeps each version's `count` and `etag`. A version
//! id is the journal position of the record that created it.

use std::collections::BTreeMap;

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::{get, post},
};
use serde_json::{Map, Value, json};
use spindle_journal::{CommandBody, Fact};
use spindle_projections::key_backup::BackupVersion;

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Query, Requester},
};

/// Most sessions one `PUT /room_keys/keys` may carry.
pub const MAX_SESSIONS_PER_REQUEST: usize = 10_000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/room_keys/version",
            post(create_version).get(latest_version),
        )
        .route(
            "/_matrix/client/v3/room_keys/version/{version}",
            get(get_version).put(update_version).delete(delete_version),
        )
        .route(
            "/_matrix/client/v3/room_keys/keys",
            get(get_keys).put(put_keys).delete(delete_keys),
        )
        .route(
            "/_matrix/client/v3/room_keys/keys/{room_id}",
            get(get_room_keys)
                .put(put_room_keys)
                .delete(delete_room_keys),
        )
        .route(
            "/_matrix/client/v3/room_keys/keys/{room_id}/{session_id}",
            get(get_session).put(put_session).delete(delete_session),
        )
}

fn not_found() -> MatrixError {
    MatrixError::not_found("Unknown backup version")
}

fn version_json(v: &BackupVersion) -> Value {
    json!({
        "algorithm": v.algorithm,
        "auth_data": v.auth_data,
        "count": v.count,
        "etag": v.etag.to_string(),
        "version": v.version.to_string(),
    })
}

fn parse_version(v: &str) -> ApiResult<u64> {
    v.parse().map_err(|_| not_found())
}

fn algorithm_and_auth_data(body: &Map<String, Value>) -> ApiResult<(String, Value)> {
    let algorithm = body
        .get("algorithm")
        .and_then(|a| a.as_str())
        .ok_or_else(|| MatrixError::bad_json("algorithm must be a string"))?;
    let auth_data = body
        .get("auth_data")
        .filter(|a| a.is_object())
        .ok_or_else(|| MatrixError::bad_json("auth_data must be an object"))?;
    Ok((algorithm.to_owned(), auth_data.clone()))
}

/// `POST /room_keys/version`: a new backup version; it becomes the current one.
async fn create_version(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let (algorithm, auth_data) = algorithm_and_auth_data(&body)?;
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::BackupVersionCreated {
                    user_id: r.user_id.clone(),
                    algorithm,
                    auth_data,
                },
            },
        )
        .await?;
    Ok(Json(json!({ "version": outcome.position.to_string() })))
}

/// `GET /room_keys/version`: the current (latest) version; none: 404 `M_NOT_FOUND`.
async fn latest_version(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    let v = s
        .projections
        .key_backup
        .version(&r.user_id, None)
        .ok_or_else(|| MatrixError::not_found("No current backup version"))?;
    Ok(Json(version_json(&v)))
}

/// `GET /room_keys/version/{version}`.
async fn get_version(
    State(s): State<AppState>,
    r: Requester,
    Path(version): Path<String>,
) -> ApiResult<Json<Value>> {
    let v = s
        .projections
        .key_backup
        .version(&r.user_id, Some(parse_version(&version)?))
        .ok_or_else(not_found)?;
    Ok(Json(version_json(&v)))
}

/// `PUT /room_keys/version/{version}`: new `auth_data`; the algorithm cannot change
/// and a `version` in the body must match the path (else 400 `M_INVALID_PARAM`).
async fn update_version(
    State(s): State<AppState>,
    r: Requester,
    Path(version): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let number = parse_version(&version)?;
    let (algorithm, auth_data) = algorithm_and_auth_data(&body)?;
    let current = s
        .projections
        .key_backup
        .version(&r.user_id, Some(number))
        .ok_or_else(not_found)?;
    if body
        .get("version")
        .is_some_and(|v| v.as_str() != Some(version.as_str()))
    {
        return Err(MatrixError::invalid_param(
            "version does not match the path",
        ));
    }
    if algorithm != current.algorithm {
        return Err(MatrixError::invalid_param("the algorithm cannot change"));
    }
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::BackupVersionUpdated {
                    user_id: r.user_id.clone(),
                    version: number,
                    auth_data,
                },
            },
        )
        .await?;
    s.wait_for(outcome.position).await?;
    Ok(Json(json!({})))
}

/// `DELETE /room_keys/version/{version}`: the version and every key in it.
async fn delete_version(
    State(s): State<AppState>,
    r: Requester,
    Path(version): Path<String>,
) -> ApiResult<Json<Value>> {
    let number = parse_version(&version)?;
    s.projections
        .key_backup
        .version(&r.user_id, Some(number))
        .ok_or_else(not_found)?;
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::BackupVersionDeleted {
                    user_id: r.user_id.clone(),
                    version: number,
                },
            },
        )
        .await?;
    s.wait_for(outcome.position).await?;
    Ok(Json(json!({})))
}

/// The `version` query parameter, which must name an existing version.
fn query_version(s: &AppState, r: &Requester, q: &Query) -> ApiResult<BackupVersion> {
    let v = q
        .get("version")
        .ok_or_else(|| MatrixError::missing_param("version is required"))?;
    s.projections
        .key_backup
        .version(&r.user_id, Some(parse_version(v)?))
        .ok_or_else(not_found)
}

type Rooms = BTreeMap<String, BTreeMap<String, Value>>;

fn check_session(data: &Value) -> ApiResult<()> {
    let ok = data.is_object()
        && data.get("first_message_index").is_some_and(|v| v.is_u64())
        && data.get("forwarded_count").is_some_and(|v| v.is_u64())
        && data.get("is_verified").is_some_and(|v| v.is_boolean())
        && data.get("session_data").is_some_and(|v| v.is_object());
    if ok {
        Ok(())
    } else {
        Err(MatrixError::bad_json(
            "a KeyBackupData needs first_message_index, forwarded_count, is_verified and session_data",
        ))
    }
}

fn sessions_of(v: Option<&Value>) -> ApiResult<BTreeMap<String, Value>> {
    let sessions = v
        .and_then(|s| s.as_object())
        .ok_or_else(|| MatrixError::bad_json("sessions must be an object"))?;
    let mut out = BTreeMap::new();
    for (id, data) in sessions {
        check_session(data)?;
        out.insert(id.clone(), data.clone());
    }
    Ok(out)
}

/// Stores sessions in the current version. A version that is not the current one is
/// refused with 403 `M_WRONG_ROOM_KEYS_VERSION` and `current_version` (spec).
async fn store(s: &AppState, r: &Requester, q: &Query, rooms: Rooms) -> ApiResult<Json<Value>> {
    let v = query_version(s, r, q)?;
    let current = s.projections.key_backup.version(&r.user_id, None);
    if current.as_ref().map(|c| c.version) != Some(v.version) {
        return Err(MatrixError::new(
            StatusCode::FORBIDDEN,
            "M_WRONG_ROOM_KEYS_VERSION",
            "Not the current backup version",
        )
        .with_extra(json!({ "current_version": current.map(|c| c.version.to_string()) })));
    }
    let n: usize = rooms.values().map(|s| s.len()).sum();
    if n > MAX_SESSIONS_PER_REQUEST {
        return Err(MatrixError::invalid_param(format!(
            "at most {MAX_SESSIONS_PER_REQUEST} sessions per request"
        )));
    }
    let position = if n > 0 {
        s.submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::RoomKeysUploaded {
                    user_id: r.user_id.clone(),
                    version: v.version,
                    rooms,
                },
            },
        )
        .await?
        .position
    } else {
        0
    };
    s.wait_for(position).await?;
    counts(s, r, v.version)
}

fn counts(s: &AppState, r: &Requester, version: u64) -> ApiResult<Json<Value>> {
    let v = s
        .projections
        .key_backup
        .version(&r.user_id, Some(version))
        .ok_or_else(not_found)?;
    Ok(Json(
        json!({ "etag": v.etag.to_string(), "count": v.count }),
    ))
}

async fn remove(
    s: &AppState,
    r: &Requester,
    q: &Query,
    room_id: Option<String>,
    session_id: Option<String>,
) -> ApiResult<Json<Value>> {
    let v = query_version(s, r, q)?;
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::RoomKeysDeleted {
                    user_id: r.user_id.clone(),
                    version: v.version,
                    room_id,
                    session_id,
                },
            },
        )
        .await?;
    s.wait_for(outcome.position).await?;
    counts(s, r, v.version)
}

/// `PUT /room_keys/keys?version=`: `{rooms: {room: {sessions: {id: KeyBackupData}}}}`.
async fn put_keys(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let rooms_in = body
        .get("rooms")
        .and_then(|v| v.as_object())
        .ok_or_else(|| MatrixError::bad_json("rooms must be an object"))?;
    let mut rooms = Rooms::new();
    for (room, v) in rooms_in {
        rooms.insert(room.clone(), sessions_of(v.get("sessions"))?);
    }
    store(&s, &r, &q, rooms).await
}

/// `PUT /room_keys/keys/{roomId}?version=`: `{sessions: {id: KeyBackupData}}`.
async fn put_room_keys(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let rooms = Rooms::from([(room_id, sessions_of(body.get("sessions"))?)]);
    store(&s, &r, &q, rooms).await
}

/// `PUT /room_keys/keys/{roomId}/{sessionId}?version=`: one `KeyBackupData`.
async fn put_session(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path((room_id, session_id)): Path<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let data = Value::Object(body);
    check_session(&data)?;
    let rooms = Rooms::from([(room_id, BTreeMap::from([(session_id, data)]))]);
    store(&s, &r, &q, rooms).await
}

/// `GET /room_keys/keys?version=`: every stored session.
async fn get_keys(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let v = query_version(&s, &r, &q)?;
    let rooms: Map<String, Value> = s
        .projections
        .key_backup
        .sessions(&r.user_id, v.version, None, None)
        .into_iter()
        .map(|(room, sessions)| (room, json!({ "sessions": sessions })))
        .collect();
    Ok(Json(json!({ "rooms": rooms })))
}

/// `GET /room_keys/keys/{roomId}?version=`: the room's sessions (`{sessions: {}}` when
/// none, as the spec asks).
async fn get_room_keys(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    let v = query_version(&s, &r, &q)?;
    let sessions = s
        .projections
        .key_backup
        .sessions(&r.user_id, v.version, Some(&room_id), None)
        .remove(&room_id)
        .unwrap_or_default();
    Ok(Json(json!({ "sessions": sessions })))
}

/// `GET /room_keys/keys/{roomId}/{sessionId}?version=`: one session; missing: 404.
async fn get_session(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path((room_id, session_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let v = query_version(&s, &r, &q)?;
    s.projections
        .key_backup
        .sessions(&r.user_id, v.version, Some(&room_id), Some(&session_id))
        .remove(&room_id)
        .and_then(|mut m| m.remove(&session_id))
        .map(Json)
        .ok_or_else(|| MatrixError::not_found("No such session in the backup"))
}

/// `DELETE /room_keys/keys?version=`.
async fn delete_keys(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    remove(&s, &r, &q, None, None).await
}

/// `DELETE /room_keys/keys/{roomId}?version=`.
async fn delete_room_keys(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    remove(&s, &r, &q, Some(room_id), None).await
}

/// `DELETE /room_keys/keys/{roomId}/{sessionId}?version=`.
async fn delete_session(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path((room_id, session_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    remove(&s, &r, &q, Some(room_id), Some(session_id)).await
}
