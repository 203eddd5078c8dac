//! Queries (spec: server-server API, "Querying for information"): the server version,
//! room alias resolution and public profiles.

use axum::{
    Json,
    extract::{Query, State},
};
use serde::Deserialize;

use crate::{FedState, auth::Signed, error::FedError, error::FedResult, reads, server_of};

/// `GET /_matrix/federation/v1/version` (unauthenticated).
pub(crate) async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "server": { "name": "Spindle", "version": env!("CARGO_PKG_VERSION") }
    }))
}

#[derive(Deserialize)]
pub(crate) struct DirectoryQuery {
    room_alias: String,
}

/// `GET /_matrix/federation/v1/query/directory?room_alias=`: one of our aliases to its
/// room and the servers in it (ours first). 404 `M_NOT_FOUND` for an unknown alias or
/// one of another server.
pub(crate) async fn directory(
    State(st): State<FedState>,
    Query(q): Query<DirectoryQuery>,
    _signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    if server_of(&q.room_alias) != Some(st.server_name()) {
        return Err(FedError::not_found("that alias is not on this server"));
    }
    let target = st
        .projections
        .aliases
        .resolve(&q.room_alias)
        .ok_or_else(|| FedError::not_found("room alias not found"))?;
    let mut servers = reads::servers_in_room(&st, &target.room_id);
    if !servers.iter().any(|s| s == st.server_name()) {
        servers.insert(0, st.server_name().to_owned());
    }
    Ok(Json(serde_json::json!({
        "room_id": target.room_id,
        "servers": servers,
    })))
}

#[derive(Deserialize)]
pub(crate) struct ProfileQuery {
    user_id: String,
    #[serde(default)]
    field: Option<String>,
}

/// `GET /_matrix/federation/v1/query/profile?user_id=&field=`: a local user's profile
/// (`displayname`, `avatar_url`, extended fields), or one field of it. 404 for users
/// that do not exist here.
pub(crate) async fn profile(
    State(st): State<FedState>,
    Query(q): Query<ProfileQuery>,
    _signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    if server_of(&q.user_id) != Some(st.server_name()) {
        return Err(FedError::invalid_param("that user is not on this server"));
    }
    if st.projections.accounts.user(&q.user_id).is_none() {
        return Err(FedError::not_found("profile not found"));
    }
    let profile = st.projections.accounts.profile(&q.user_id);
    let all = serde_json::to_value(&profile).unwrap_or_default();
    Ok(Json(match q.field {
        None => all,
        Some(f) => {
            let mut out = serde_json::Map::new();
            if let Some(v) = all.get(&f) {
                out.insert(f, v.clone());
            }
            serde_json::Value::Object(out)
        }
    }))
}
