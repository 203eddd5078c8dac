//! OpenID (spec: client-server API "OpenID", server-server API "OpenID"): a user asks
//! for a short-lived token (`POST /_matrix/client/v3/user/{userId}/openid/request_token`)
//! and hands it to a third party (an integration manager, a widget, Element Call's
//! focus), which trades it at our `GET /_matrix/federation/v1/openid/userinfo` for
//! the user id. Proof of identity, nothing more: the token opens no Client-Server
//! endpoint.
//!
//! The token (`spo_` + 40 alphanumerics) is issued as an `OpenIdTokenIssued` journal
//! fact holding only its blake3 hash and its expiry ([`OPENID_TOKEN_LIFETIME_S`]); the
//! `accounts` projection keeps hash -> (user, expiry). `userinfo` is one point read;
//! an unknown or expired token, or one of a deactivated account, is 401
//! `M_UNKNOWN_TOKEN`; no token at all is 401 `M_MISSING_TOKEN` (as Synapse). `userinfo` is served by this crate, not `federation`, because it
//! reads a projection.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::{get, post},
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Query, Requester, token_hash},
};

/// How long an OpenID token works, seconds (`expires_in`).
pub const OPENID_TOKEN_LIFETIME_S: u64 = 3600;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/user/{user_id}/openid/request_token",
            post(request_token),
        )
        .route("/_matrix/federation/v1/openid/userinfo", get(userinfo))
}

/// `POST /user/{userId}/openid/request_token` (body `{}`): `{access_token, token_type:
/// "Bearer", matrix_server_name, expires_in}`. Only for oneself (else 403).
async fn request_token(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(_body): JsonObject,
) -> ApiResult<Json<Value>> {
    if user_id != r.user_id {
        return Err(MatrixError::forbidden(
            "Cannot request an OpenID token for another user",
        ));
    }
    let token = format!("spo_{}", crate::account::random_string(40));
    let fact = Fact::OpenIdTokenIssued {
        user_id: r.user_id.clone(),
        token_hash: token_hash(&token),
        expires_at: crate::now_ms() + OPENID_TOKEN_LIFETIME_S * 1000,
    };
    // The third party may ask `userinfo` as soon as it has the token.
    s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({
        "access_token": token,
        "token_type": "Bearer",
        "matrix_server_name": s.server_name(),
        "expires_in": OPENID_TOKEN_LIFETIME_S,
    })))
}

/// `GET /_matrix/federation/v1/openid/userinfo?access_token=`: `{"sub": user id}`;
/// 401 `M_UNKNOWN_TOKEN` for an unknown or expired token, 401 `M_MISSING_TOKEN`
/// without one.
async fn userinfo(State(s): State<AppState>, q: Query) -> ApiResult<Json<Value>> {
    let unknown = || {
        MatrixError::new(
            axum::http::StatusCode::UNAUTHORIZED,
            "M_UNKNOWN_TOKEN",
            "OpenID token unknown or expired",
        )
    };
    // No token at all is 401 `M_MISSING_TOKEN`, as Synapse answers (the spec lists
    // only the 401 of an unknown token).
    let token = q.get("access_token").ok_or_else(|| {
        MatrixError::new(
            axum::http::StatusCode::UNAUTHORIZED,
            "M_MISSING_TOKEN",
            "Access token required",
        )
    })?;
    let owner = s
        .projections
        .accounts
        .openid_token(&token_hash(token))
        .filter(|o| o.expires_at > crate::now_ms())
        .ok_or_else(unknown)?;
    let active = s
        .projections
        .accounts
        .user(&owner.user_id)
        .is_some_and(|a| !a.deactivated);
    if !active {
        return Err(unknown());
    }
    Ok(Json(json!({ "sub": owner.user_id })))
}
