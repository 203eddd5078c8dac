//! Request extractors: the authenticated requester and JSON bodies with Matrix errors.

use axum::{
    body::Bytes,
    extract::{FromRequest, FromRequestParts, Request},
    http::{StatusCode, request::Parts},
};

use crate::{AppState, MatrixError};

/// The user and device behind an access token (spec: "Using access tokens": the
/// `Authorization: Bearer` header, or the deprecated `access_token` query parameter).
#[derive(Debug, Clone)]
pub struct Requester {
    /// Full user id.
    pub user_id: String,
    /// Device id.
    pub device_id: String,
    /// blake3 hex of the token (what the journal stores).
    pub token_hash: String,
    /// The application service whose `as_token` authenticated the request (spec:
    /// Application Service API, "Identity assertion"); `None` for a user's token.
    pub appservice: Option<std::sync::Arc<crate::appservice::AppService>>,
    /// The token is a guest account's (spec: "Guest Access"): the extractor has
    /// already refused every route a guest may not call.
    pub is_guest: bool,
}

impl Requester {
    /// The device, unless the request is an application service's without one
    /// (`device_id` masquerading not used): `device_id` is then empty.
    pub fn device(&self) -> Option<&str> {
        Some(self.device_id.as_str()).filter(|d| !d.is_empty())
    }
}

/// The requester behind an application service's `as_token`: `user_id` (query) or
/// the sender; `device_id` (query; also MSC3202's `org.matrix.msc3202.device_id`) or
/// none. 403 `M_FORBIDDEN` for a user outside its namespaces or not registered yet;
/// 400 `M_UNKNOWN_DEVICE` for a device the user does not have.
fn appservice_requester(
    parts: &Parts,
    state: &AppState,
    a: &std::sync::Arc<crate::appservice::AppService>,
    hash: String,
) -> Result<Requester, MatrixError> {
    let query = parts.uri.query().map(url_query).unwrap_or_default();
    let param = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let user_id = param("user_id").unwrap_or_else(|| a.sender.clone());
    if user_id != a.sender {
        if !a.is_interested_in_user(&user_id) {
            return Err(MatrixError::forbidden(format!(
                "Application service cannot masquerade as this user ({user_id})"
            )));
        }
        if state.projections.accounts.user(&user_id).is_none() {
            return Err(MatrixError::forbidden(format!(
                "Application service has not registered this user ({user_id})"
            )));
        }
    }
    let device_id = param("device_id")
        .or_else(|| param("org.matrix.msc3202.device_id"))
        .unwrap_or_default();
    if !device_id.is_empty()
        && state
            .projections
            .accounts
            .device(&user_id, &device_id)
            .is_none()
    {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_UNKNOWN_DEVICE",
            "Application service has not registered this device",
        ));
    }
    if let Some(slot) = parts.extensions.get::<crate::access_log::RequestUser>() {
        slot.set(&user_id);
    }
    Ok(Requester {
        user_id,
        device_id,
        token_hash: hash,
        appservice: Some(a.clone()),
        is_guest: false,
    })
}

/// The `as_token` of a request, if it carries an application service's token.
pub fn appservice_of(
    parts: &Parts,
    state: &AppState,
) -> Option<std::sync::Arc<crate::appservice::AppService>> {
    let token = token_from(parts)?;
    state.appservices.by_token(&token).cloned()
}

/// blake3 hex of an access token. Tokens themselves are never stored.
pub fn token_hash(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

fn token_from(parts: &Parts) -> Option<String> {
    if let Some(h) = parts.headers.get(axum::http::header::AUTHORIZATION) {
        let v = h.to_str().ok()?;
        let (scheme, token) = v.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| token.trim().to_owned());
    }
    let q = parts.uri.query()?;
    url_query(q)
        .into_iter()
        .find(|(k, _)| k == "access_token")
        .map(|(_, v)| v)
}

/// Percent-decoded query pairs.
pub fn url_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|s| !s.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl FromRequestParts<AppState> for Requester {
    type Rejection = MatrixError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = token_from(parts).ok_or_else(|| {
            MatrixError::new(
                StatusCode::UNAUTHORIZED,
                "M_MISSING_TOKEN",
                "Missing access token",
            )
        })?;
        let hash = token_hash(&token);
        // Read-your-writes: everything acknowledged before this request is visible to it
        // (including a token issued or revoked just before); for a route that reads
        // nothing but its token, everything the accounts projection holds.
        let route = parts
            .extensions
            .get::<axum::extract::MatchedPath>()
            .map(|m| m.as_str());
        if crate::reads_only_its_token(&parts.method, route) {
            state.wait_for_tokens().await?;
        } else {
            state.wait_for_acknowledged().await?;
        }
        if let Some(a) = state.appservices.by_token(&token) {
            return appservice_requester(parts, state, a, hash);
        }
        let owner = state.projections.accounts.token(&hash).ok_or_else(|| {
            MatrixError::new(
                StatusCode::UNAUTHORIZED,
                "M_UNKNOWN_TOKEN",
                "Unknown access token",
            )
            .with_extra(serde_json::json!({"soft_logout": false}))
        })?;
        let now = crate::now_ms();
        // Spec ("Refreshing access tokens"): an expired token is a soft logout, so the
        // client refreshes it instead of dropping the session.
        if owner.expires_at.is_some_and(|t| now >= t) {
            return Err(MatrixError::new(
                StatusCode::UNAUTHORIZED,
                "M_UNKNOWN_TOKEN",
                "Access token has expired",
            )
            .with_extra(serde_json::json!({"soft_logout": true})));
        }
        crate::devices::record_seen(
            state,
            &owner.user_id,
            &owner.device_id,
            ClientAddr::of(parts, state.config.trust_x_forwarded_for).0,
            user_agent(&parts.headers),
        );
        if let Some(slot) = parts.extensions.get::<crate::access_log::RequestUser>() {
            slot.set(&owner.user_id);
        }
        // Guest restrictions (spec: "Guest Access"), by route, for every handler.
        if owner.guest {
            crate::guest::check_route(
                &parts.method,
                parts
                    .extensions
                    .get::<axum::extract::MatchedPath>()
                    .map(|m| m.as_str()),
                parts.uri.path(),
            )?;
        }
        Ok(Requester {
            user_id: owner.user_id,
            device_id: owner.device_id,
            token_hash: hash,
            appservice: None,
            is_guest: owner.guest,
        })
    }
}

/// The `User-Agent` header, if it is text.
pub fn user_agent(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
}

/// The client's address: the TCP peer, or (with `trust_x_forwarded_for`, behind a
/// reverse proxy) the last `X-Forwarded-For` entry, the one our proxy appended.
/// `None` when neither is known (a router driven without a socket, in tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub Option<std::net::IpAddr>);

impl ClientAddr {
    /// The address from a request's parts.
    pub fn of(parts: &Parts, trust_x_forwarded_for: bool) -> ClientAddr {
        if trust_x_forwarded_for
            && let Some(ip) = parts
                .headers
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .filter_map(|s| s.trim().parse::<std::net::IpAddr>().ok())
                .next_back()
        {
            return ClientAddr(Some(ip));
        }
        ClientAddr(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        )
    }

    /// The key per-address rate limits count under: the IPv4 address, or the /64
    /// prefix of an IPv6 one (one host's whole allocation; addresses inside it are
    /// free to pick); `"unknown"` without an address.
    pub fn rate_key(&self) -> String {
        match self.0 {
            Some(std::net::IpAddr::V4(v4)) => v4.to_string(),
            Some(std::net::IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                Some(v4) => v4.to_string(),
                None => {
                    let s = v6.segments();
                    format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
                }
            },
            None => "unknown".into(),
        }
    }
}

impl FromRequestParts<AppState> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        Ok(ClientAddr::of(parts, state.config.trust_x_forwarded_for))
    }
}

/// A JSON object body. Not JSON: 400 `M_NOT_JSON`; JSON but not an object: 400
/// `M_BAD_JSON`; over the body limit: 413 `M_TOO_LARGE`. An empty body reads as `{}`.
pub struct JsonObject(pub serde_json::Map<String, serde_json::Value>);

impl FromRequest<AppState> for JsonObject {
    type Rejection = MatrixError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let is_put = req.method() == axum::http::Method::PUT;
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                MatrixError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "M_TOO_LARGE",
                    "Request body too large",
                )
            } else if is_body_timeout(&e) {
                MatrixError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "M_UNKNOWN",
                    "Request body not received in time",
                )
            } else {
                MatrixError::not_json(e.body_text())
            }
        })?;
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            // POST endpoints with optional bodies (join, leave, receipts, ...) take an
            // empty body as `{}`; a PUT's body is the content and must be JSON.
            if is_put {
                return Err(MatrixError::not_json(
                    "Request body is empty; expected a JSON object",
                ));
            }
            return Ok(JsonObject(serde_json::Map::new()));
        }
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| MatrixError::not_json(format!("Content not JSON: {e}")))?;
        match value {
            serde_json::Value::Object(map) => Ok(JsonObject(map)),
            _ => Err(MatrixError::bad_json("Body must be a JSON object")),
        }
    }
}

/// Whether a body rejection came from the request-body idle timeout.
fn is_body_timeout(e: &axum::extract::rejection::BytesRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// Query parameters as a list (repeated keys allowed, values percent-decoded).
pub struct Query(pub Vec<(String, String)>);

impl Query {
    /// First value of a parameter.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    /// Every value of a parameter.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
    /// An unsigned integer parameter; malformed: 400 `M_INVALID_PARAM`.
    pub fn u64(&self, name: &str) -> Result<Option<u64>, MatrixError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                MatrixError::invalid_param(format!("{name} must be a non-negative integer"))
            }),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Query {
    type Rejection = MatrixError;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Query(parts.uri.query().map(url_query).unwrap_or_default()))
    }
}

/// String field helper: `Some(string)` or a 400 when present with another type.
pub fn opt_str(
    map: &serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Result<Option<String>, MatrixError> {
    match map.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(MatrixError::bad_json(format!("{name} must be a string"))),
    }
}
