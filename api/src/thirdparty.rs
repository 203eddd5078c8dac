//! Third-party networks (spec: client-server API "Third-party Networks"): the
//! protocols bridges (application services) offer, and lookups of their users and
//! locations. Spindle runs no application services, so it knows no protocol:
//!
//! - `GET /thirdparty/protocols`: `{}` (Element Web asks at start-up);
//! - `GET /thirdparty/protocol/{protocol}`, `GET /thirdparty/location/{protocol}`,
//!   `GET /thirdparty/user/{protocol}`: 404 `M_NOT_FOUND` (the spec's "protocol is
//!   unknown" / "no portal rooms" / "not found" answers);
//! - `GET /thirdparty/location?alias=` and `GET /thirdparty/user?userid=`: `[]` for a
//!   room alias or user that exists here (nothing bridges it), 404 `M_NOT_FOUND` for
//!   one that does not (the spec's 404), 400 `M_MISSING_PARAM`/`M_INVALID_PARAM` for
//!   a missing or malformed one. Each is one point lookup.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
};

pub(crate) fn routes() -> Router<AppState> {
    const P: &str = "/_matrix/client/v3/thirdparty";
    Router::new()
        .route(&format!("{P}/protocols"), get(protocols))
        .route(&format!("{P}/protocol/{{protocol}}"), get(unknown_protocol))
        .route(&format!("{P}/location/{{protocol}}"), get(unknown_protocol))
        .route(&format!("{P}/user/{{protocol}}"), get(unknown_protocol))
        .route(&format!("{P}/location"), get(location_by_alias))
        .route(&format!("{P}/user"), get(user_by_id))
}

/// `GET /thirdparty/protocols`: no bridges, no protocols.
async fn protocols(_r: Requester) -> Json<Value> {
    Json(json!({}))
}

/// `GET /thirdparty/{protocol,location,user}/{protocol}`: every protocol is unknown.
async fn unknown_protocol(_r: Requester, Path(protocol): Path<String>) -> MatrixError {
    MatrixError::not_found(format!("Unknown third-party protocol {protocol:?}"))
}

fn required<'a>(q: &'a Query, name: &str) -> ApiResult<&'a str> {
    q.get(name)
        .ok_or_else(|| MatrixError::missing_param(format!("{name} is required")))
}

/// `GET /thirdparty/location?alias=`: the third-party locations of a room alias.
async fn location_by_alias(
    State(s): State<AppState>,
    _r: Requester,
    q: Query,
) -> ApiResult<Json<Value>> {
    let alias = required(&q, "alias")?;
    if ruma::RoomAliasId::parse(alias).is_err() {
        return Err(MatrixError::invalid_param("alias is not a room alias"));
    }
    if s.projections.aliases.resolve(alias).is_none() {
        return Err(MatrixError::not_found("The room alias was not found"));
    }
    Ok(Json(json!([])))
}

/// `GET /thirdparty/user?userid=`: the third-party users of a Matrix user id.
async fn user_by_id(State(s): State<AppState>, _r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let user_id = required(&q, "userid")?;
    if ruma::UserId::parse(user_id).is_err() {
        return Err(MatrixError::invalid_param("userid is not a user id"));
    }
    if s.projections.accounts.user(user_id).is_none() {
        return Err(MatrixError::not_found("The user was not found"));
    }
    Ok(Json(json!([])))
}
