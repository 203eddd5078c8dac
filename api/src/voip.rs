//! Voice over IP (spec: client-server API "Voice over IP", `GET
//! /_matrix/client/v3/voip/turnServer`): the TURN server credentials a client uses
//! to relay call media.
//!
//! With a shared secret the credentials follow the TURN REST API (the
//! `draft-uberti-behave-turn-rest` scheme coturn and eturnal implement): username
//! `<expiry, seconds since the epoch>:<user id>`, password the standard base64 of
//! HMAC-SHA1(secret, username), valid for `ttl` seconds. Without one, the static
//! username and password are handed out.
//!
//! No TURN server configured: 404 `M_NOT_FOUND`. The spec says a homeserver MAY
//! provide a TURN server and its 200 schema requires `username`, `password`, `uris`
//! and `ttl`, so the `{}` Synapse answers is not a valid 200; an error is what the
//! spec leaves, and clients (matrix-js-sdk, matrix-rust-sdk) treat a failed lookup as
//! "no TURN server" and try again later.

use axum::{Json, Router, extract::State, routing::get};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};

use crate::{ApiResult, AppState, MatrixError, extract::Requester};

/// TURN settings (`[voip]` in the config).
#[derive(Debug, Clone, Default)]
pub struct VoipConfig {
    /// `turn:`/`turns:` URIs; empty: no TURN server.
    pub turn_uris: Vec<String>,
    /// Shared secret of the TURN REST API; empty: use the static credentials.
    pub turn_shared_secret: String,
    /// Static username.
    pub turn_username: String,
    /// Static password.
    pub turn_password: String,
    /// Lifetime of the credentials, seconds.
    pub turn_ttl_s: u64,
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/_matrix/client/v3/voip/turnServer", get(turn_server))
}

/// TURN REST API credentials for `user_id`, valid until `expiry_s` (seconds since
/// the epoch): `(username, password)`.
pub fn turn_rest_credentials(secret: &str, user_id: &str, expiry_s: u64) -> (String, String) {
    let username = format!("{expiry_s}:{user_id}");
    let mut mac =
        Hmac::<sha1::Sha1>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(username.as_bytes());
    let password = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    (username, password)
}

/// `GET /voip/turnServer`: `{username, password, uris, ttl}`.
async fn turn_server(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    let v = &s.config.voip;
    if v.turn_uris.is_empty() {
        return Err(MatrixError::not_found(
            "This homeserver does not provide a TURN server",
        ));
    }
    let (username, password) = if v.turn_shared_secret.is_empty() {
        (v.turn_username.clone(), v.turn_password.clone())
    } else {
        let expiry_s = crate::now_ms() / 1000 + v.turn_ttl_s;
        turn_rest_credentials(&v.turn_shared_secret, &r.user_id, expiry_s)
    };
    Ok(Json(json!({
        "username": username,
        "password": password,
        "uris": v.turn_uris,
        "ttl": v.turn_ttl_s,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_rest_password_is_base64_hmac_sha1_of_the_username() {
        // Reference value: `printf '1443779631:@user:example.com' | openssl dgst -sha1
        // -hmac 'n0t-a-secret' -binary | base64`.
        let (user, pass) = turn_rest_credentials("n0t-a-secret", "@user:example.com", 1443779631);
        assert_eq!(user, "1443779631:@user:example.com");
        assert_eq!(pass, "eZCZxonqG0OFnZtUxMmkMk8xLgo=");
    }
}
