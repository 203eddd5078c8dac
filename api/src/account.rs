//! Accounts and sessions: versions, well-known, capabilities, registration (UIA),
//! login, logout, whoami, profile, account data and filters.

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::{get, post},
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{ClientAddr, JsonObject, Query, Requester, opt_str, token_hash},
};

/// Spec versions advertised by `/versions`.
pub const SPEC_VERSIONS: [&str; 12] = [
    "v1.1", "v1.2", "v1.3", "v1.4", "v1.5", "v1.6", "v1.7", "v1.8", "v1.9", "v1.10", "v1.11",
    "v1.12",
];

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_matrix/client/versions", get(versions))
        .route("/.well-known/matrix/client", get(well_known))
        .route("/.well-known/matrix/support", get(support))
        .route(
            "/_matrix/client/v1/register/m.login.registration_token/validity",
            get(registration_token_validity),
        )
        .route("/_matrix/client/v3/capabilities", get(capabilities))
        .route("/_matrix/client/v3/register", post(register))
        .route(
            "/_matrix/client/v3/register/available",
            get(register_available),
        )
        .route("/_matrix/client/v3/login", get(login_flows).post(login))
        .route("/_matrix/client/v3/logout", post(logout))
        .route("/_matrix/client/v3/logout/all", post(logout_all))
        .route("/_matrix/client/v3/account/whoami", get(whoami))
        .route("/_matrix/client/v3/profile/{user_id}", get(profile))
        .route(
            "/_matrix/client/v3/profile/{user_id}/{field}",
            get(profile_field)
                .put(set_profile_field)
                .delete(delete_profile_field),
        )
        .route(
            "/_matrix/client/v3/user/{user_id}/account_data/{data_type}",
            get(get_account_data).put(put_account_data),
        )
        .route(
            "/_matrix/client/v3/user/{user_id}/rooms/{room_id}/account_data/{data_type}",
            get(get_room_account_data).put(put_room_account_data),
        )
        .route(
            "/_matrix/client/v3/user/{user_id}/rooms/{room_id}/tags",
            get(get_tags),
        )
        .route(
            "/_matrix/client/v3/user/{user_id}/rooms/{room_id}/tags/{tag}",
            axum::routing::put(put_tag).delete(delete_tag),
        )
        .route(
            "/_matrix/client/v3/user/{user_id}/filter",
            post(create_filter),
        )
        .route(
            "/_matrix/client/v3/user/{user_id}/filter/{filter_id}",
            get(get_filter),
        )
}

async fn versions(State(s): State<AppState>) -> Json<Value> {
    // MSC4186 (Simplified Sliding Sync) is served on its unstable path. MSC2666's
    // `.stable` flag tells clients (matrix-js-sdk) that `GET /v1/mutual_rooms` is served.
    // `org.matrix.e2e_cross_signing` (MSC1756): Element Web reads it to decide whether
    // the server supports cross-signing at all (without it every message carries a
    // red "not verified by its owner" shield); the unstable upload path it probes is
    // served beside the v3 one (`cross_signing.rs`). `org.matrix.msc4140`: delayed
    // events, when `delayed_events.max_event_delay_duration_ms` turns them on.
    Json(json!({
        "versions": SPEC_VERSIONS,
        "unstable_features": {
            "org.matrix.e2e_cross_signing": true,
            "org.matrix.simplified_msc3575": true,
            "uk.half-shot.msc2666.query_mutual_rooms.stable": true,
            "org.matrix.msc4140": crate::delayed::enabled(&s),
        },
    }))
}

async fn well_known(State(s): State<AppState>) -> Json<Value> {
    Json(json!({ "m.homeserver": { "base_url": s.config.public_base_url } }))
}

/// `GET /.well-known/matrix/support` (spec: "Getting the support information for a
/// server"): the configured contacts and support page; 404 `M_NOT_FOUND` when neither
/// is configured.
async fn support(State(s): State<AppState>) -> ApiResult<Json<Value>> {
    match &s.config.support {
        Some(body) => Ok(Json(body.clone())),
        None => Err(MatrixError::not_found(
            "No support information is configured for this server",
        )),
    }
}

/// `GET /_matrix/client/v1/register/m.login.registration_token/validity?token=`:
/// `{"valid"}`, whether `token` is one of the configured registration tokens (tokens
/// never expire or run out here, so a configured token stays valid). A server whose
/// registration is closed to everyone (not open, no tokens) answers 403
/// `M_FORBIDDEN`, as the spec says. Rate limited per client address against guessing
/// (`[rate_limits.registration_token_validity]`, 429 `M_LIMIT_EXCEEDED`). Comparison
/// is by blake3 digest (constant-time equality), so timing reveals nothing of a token.
async fn registration_token_validity(
    State(s): State<AppState>,
    addr: ClientAddr,
    q: Query,
) -> ApiResult<Json<Value>> {
    s.rate_limits
        .registration_token_validity
        .check(&addr.rate_key())?;
    let token = q
        .get("token")
        .ok_or_else(|| MatrixError::missing_param("token is required"))?;
    if !s.config.registration_open && s.config.registration_tokens.is_empty() {
        return Err(MatrixError::forbidden(
            "Registration is not enabled on this homeserver",
        ));
    }
    let asked = blake3::hash(token.as_bytes());
    let valid = s.config.registration_tokens.iter().fold(false, |found, t| {
        found | (blake3::hash(t.as_bytes()) == asked)
    });
    Ok(Json(json!({ "valid": valid })))
}

async fn capabilities(State(s): State<AppState>, _r: Requester) -> Json<Value> {
    let available: serde_json::Map<String, Value> = spindle_core::room_version::SUPPORTED
        .iter()
        .filter_map(|v| {
            Some((
                v.to_string(),
                json!(spindle_core::room_version::stability(v)?),
            ))
        })
        .collect();
    Json(json!({
        "capabilities": {
            "m.change_password": { "enabled": true },
            "m.room_versions": { "default": spindle_core::room_version::DEFAULT_ROOM_VERSION, "available": available },
            "m.set_displayname": { "enabled": true },
            "m.set_avatar_url": { "enabled": true },
            "m.profile_fields": { "enabled": true },
            "m.3pid_changes": { "enabled": s.threepids.email_enabled() },
            "m.get_login_token": { "enabled": false },
        }
    }))
}

/// Localpart rules (spec: "User Identifiers": `a-z 0-9 . _ = - / +`).
fn valid_localpart(l: &str) -> bool {
    !l.is_empty()
        && l.bytes().all(
            |b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'=' | b'-' | b'/' | b'+'),
        )
}

/// Checks a requested localpart: characters, and the spec's 255-byte limit on the
/// whole user id. Errors are 400 `M_INVALID_USERNAME`.
pub(crate) fn check_localpart(s: &AppState, local: &str) -> ApiResult<()> {
    if !valid_localpart(local) {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_INVALID_USERNAME",
            "Username contains invalid characters",
        ));
    }
    if full_user_id(s, local).len() > 255 {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_INVALID_USERNAME",
            "Username is too long (user ids are at most 255 bytes)",
        ));
    }
    Ok(())
}

pub(crate) fn random_string(len: usize) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..len)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

pub(crate) fn full_user_id(s: &AppState, localpart_or_id: &str) -> String {
    if localpart_or_id.starts_with('@') {
        localpart_or_id.to_owned()
    } else {
        format!("@{}:{}", localpart_or_id.to_lowercase(), s.server_name())
    }
}

fn uia_flows(s: &AppState) -> Vec<Value> {
    let mut flows = Vec::new();
    if s.config.registration_open {
        flows.push(json!({ "stages": ["m.login.dummy"] }));
    }
    if !s.config.registration_tokens.is_empty() {
        flows.push(json!({ "stages": ["m.login.registration_token"] }));
    }
    // With email on, an open registration may also prove an address (`requestToken`
    // of `/register/email`), which the new account then has as a 3PID.
    if s.config.registration_open && s.threepids.email_enabled() {
        flows.push(json!({ "stages": ["m.login.email.identity"] }));
    }
    flows
}

/// Hashes a new password on the bounded hashing pool ([`crate::hashing`]); a full
/// queue is 429 `M_LIMIT_EXCEEDED`.
pub(crate) async fn hash_password(s: &AppState, password: String) -> ApiResult<String> {
    s.hashing.hash(password).await
}

/// Checks a password against an argon2 PHC hash on the bounded hashing pool. A
/// password longer than any we accept when setting one cannot match and costs no
/// hashing; a full queue is 429 `M_LIMIT_EXCEEDED`.
pub(crate) async fn verify_password(
    s: &AppState,
    password: String,
    hash: String,
) -> ApiResult<bool> {
    if password.len() > crate::devices::MAX_PASSWORD_BYTES {
        return Ok(false);
    }
    s.hashing.verify(password, hash).await
}

/// A new session's credentials.
pub(crate) struct Session {
    pub(crate) device_id: String,
    pub(crate) access_token: String,
    /// With `refresh_token: true`: the refresh token and the access token's lifetime.
    refresh: Option<(String, u64)>,
}

impl Session {
    /// Adds the session's fields to a login or register answer.
    fn write_into(self, out: &mut Value) {
        out["access_token"] = json!(self.access_token);
        out["device_id"] = json!(self.device_id);
        if let Some((refresh, lifetime)) = self.refresh {
            out["refresh_token"] = json!(refresh);
            out["expires_in_ms"] = json!(lifetime);
        }
    }
}

/// Whether the client asked for a refresh token (`refresh_token: true`).
fn wants_refresh(body: &serde_json::Map<String, Value>) -> ApiResult<bool> {
    match body.get("refresh_token") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(MatrixError::bad_json("refresh_token must be a boolean")),
    }
}

/// Issues a device (if new) and an access token (refreshable, with a refresh token,
/// when asked for).
/// The device is seen at once, from the login's own address and user agent.
pub(crate) async fn start_session(
    s: &AppState,
    user_id: &str,
    device_id: Option<String>,
    display_name: Option<String>,
    refreshable: bool,
    client: (ClientAddr, Option<&str>),
) -> ApiResult<Session> {
    let device_id = device_id.unwrap_or_else(|| random_string(10));
    if s.projections.accounts.device(user_id, &device_id).is_none() {
        s.submit_and_wait(
            user_id,
            Some(&device_id),
            CommandBody::Fact {
                fact: Fact::DeviceCreated {
                    user_id: user_id.into(),
                    device_id: device_id.clone(),
                    display_name,
                },
            },
        )
        .await?;
    }
    let token = format!("spt_{}", random_string(40));
    let mut refresh = None;
    let fact = if refreshable {
        let refresh_token = crate::devices::new_refresh_token();
        let lifetime = s.config.refreshable_access_token_lifetime_ms;
        let fact = Fact::RefreshableTokenIssued {
            user_id: user_id.into(),
            device_id: device_id.clone(),
            token_hash: token_hash(&token),
            refresh_token_hash: token_hash(&refresh_token),
            expires_at: crate::now_ms().saturating_add(lifetime),
        };
        refresh = Some((refresh_token, lifetime));
        fact
    } else {
        Fact::TokenIssued {
            user_id: user_id.into(),
            device_id: device_id.clone(),
            token_hash: token_hash(&token),
        }
    };
    s.submit_and_wait(user_id, Some(&device_id), CommandBody::Fact { fact })
        .await?;
    crate::devices::record_seen_now(s, user_id, &device_id, client.0.0, client.1).await?;
    Ok(Session {
        device_id,
        access_token: token,
        refresh,
    })
}

/// What a registration session is opened for: no user, no bound parameters (they are
/// remembered instead, [`REGISTRATION_REMEMBERED`]).
fn register_operation() -> crate::uia::UiaOperation {
    crate::uia::UiaOperation {
        user_id: None,
        action: "POST /register",
        params: Value::Null,
    }
}

/// The parameters a registration session remembers from its requests (spec:
/// "Registration"; the password is remembered as its hash).
const REGISTRATION_REMEMBERED: [&str; 5] = [
    "username",
    "device_id",
    "initial_device_display_name",
    "inhibit_login",
    "refresh_token",
];

/// `POST /register` (spec: "Account registration"). Rate limited per client address
/// (`[rate_limits.registration]`: every call is refused while the address's bucket is
/// full, only a created account counts). `kind=guest` registers a guest
/// ([`register_guest`]); `guest_access_token` upgrades one ([`guest_to_upgrade`]).
async fn register(
    State(s): State<AppState>,
    addr: ClientAddr,
    appservice: AsToken,
    headers: axum::http::HeaderMap,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<axum::response::Response> {
    use axum::response::IntoResponse;
    match q.get("kind") {
        None | Some("user") => {}
        Some("guest") => {
            return register_guest(&s, addr, &headers, &body)
                .await
                .map(IntoResponse::into_response);
        }
        Some(other) => {
            return Err(MatrixError::invalid_param(format!(
                "Unknown kind {other:?}"
            )));
        }
    }
    let auth_type = body
        .get("auth")
        .and_then(|a| a.get("type"))
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    let auth_type = auth_type.as_deref();
    if auth_type == Some("m.login.application_service")
        || body.get("type").and_then(|v| v.as_str()) == Some("m.login.application_service")
    {
        return register_appservice_user(
            &s,
            appservice,
            &body,
            (addr, crate::extract::user_agent(&headers)),
        )
        .await;
    }
    let flows = uia_flows(&s);
    if flows.is_empty() {
        return Err(MatrixError::forbidden("Registration is disabled"));
    }
    let addr_key = addr.rate_key();
    s.rate_limits.registration.peek(&addr_key)?;
    // A later request of a registration session that leaves a parameter out uses the
    // one its first request gave (spec: "Registration"; crate::uia).
    let now = crate::now_ms();
    let sid = body
        .get("auth")
        .and_then(|a| a.get("session"))
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    let remembered = sid
        .as_deref()
        .and_then(|sid| s.uia.get(sid, now))
        .filter(|x| x.op == register_operation())
        .map(|x| x.remembered)
        .unwrap_or_default();
    let mut body = body;
    for key in REGISTRATION_REMEMBERED {
        if body.get(key).is_none_or(Value::is_null)
            && let Some(v) = remembered.get(key)
        {
            body.insert(key.to_owned(), v.clone());
        }
    }
    // A session that already registered its account registers nothing more: it logs
    // that account in again (registration is idempotent, as Synapse's session
    // `registered_user_id`).
    let registered = remembered
        .get("registered_user_id")
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    let upgrading = guest_to_upgrade(&s, &headers, &body)?;
    let mut username = opt_str(&body, "username")?;
    if let Some(guest) = &upgrading {
        // Spec ("Guest Access"): `username` must be the guest's own localpart; left
        // out, it is taken to be.
        let local = guest_localpart(&s, guest);
        match &username {
            Some(u) if u.to_lowercase() != local => {
                return Err(MatrixError::forbidden(
                    "Cannot register taken user ID without valid guest credentials for that user.",
                ));
            }
            _ => username = Some(local.to_owned()),
        }
    }
    if let Some(u) = &username {
        let local = u.to_lowercase();
        check_localpart(&s, &local)?;
        crate::appservice::check_user_not_exclusive(&s, &full_user_id(&s, &local), None)?;
        if upgrading.is_none()
            && registered.is_none()
            && s.projections
                .accounts
                .user(&full_user_id(&s, &local))
                .is_some()
        {
            return Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_USER_IN_USE",
                "User ID already taken.",
            ));
        }
    }
    let password = opt_str(&body, "password")?;
    if password.as_ref().is_some_and(|p| p.len() > 512) {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_WEAK_PASSWORD",
            "Password too long",
        ));
    }
    // User-interactive auth (spec: "User-Interactive Authentication API"): a session
    // of this endpoint, opened now or by an earlier request (400 if unknown, 403 if
    // opened for another operation).
    let (session, completed) = match sid {
        Some(sid) => {
            let completed = s.uia.resume(&sid, &register_operation(), now)?.completed;
            (sid, completed)
        }
        None => (s.uia.open(register_operation(), now), Vec::new()),
    };
    // The password is remembered as its hash (and a digest, to know a repeat of it).
    let password_digest = password
        .as_ref()
        .map(|p| blake3::hash(p.as_bytes()).to_hex().to_string());
    let remembered_hash = match (&password_digest, remembered.get("password_digest")) {
        (None, _) => remembered.get("password_hash"),
        (Some(d), Some(r)) if r == d => remembered.get("password_hash"),
        _ => None,
    }
    .and_then(|h| h.as_str())
    .map(str::to_owned);
    let challenge = |err: Option<MatrixError>| {
        let mut body = json!({ "flows": flows, "params": {}, "session": session, "completed": [] });
        if let Some(e) = err {
            body["errcode"] = json!(e.errcode);
            body["error"] = json!(e.error);
        }
        (StatusCode::UNAUTHORIZED, Json(body))
    };
    // The address an `m.login.email.identity` stage of this request proved.
    let mut proven_email: Option<(String, String, u64)> = None;
    let passed = match auth_type {
        Some("m.login.dummy") if s.config.registration_open => true,
        Some("m.login.email.identity")
            if s.config.registration_open && s.threepids.email_enabled() =>
        {
            match crate::threepid::registration_email(&s, body.get("auth"), now) {
                Ok(found) => {
                    proven_email = Some(found);
                    true
                }
                Err(e) => return Ok(challenge(Some(e)).into_response()),
            }
        }
        Some("m.login.registration_token") if !s.config.registration_tokens.is_empty() => {
            let token = body
                .get("auth")
                .and_then(|a| a.get("token"))
                .and_then(|v| v.as_str())
                .unwrap_or("");
            if !s.config.registration_tokens.iter().any(|t| t == token) {
                return Ok(
                    challenge(Some(MatrixError::forbidden("Invalid registration token")))
                        .into_response(),
                );
            }
            true
        }
        // A stage this session completed before (a replayed registration).
        _ => !completed.is_empty(),
    };
    if passed && let Some(stage) = auth_type {
        s.uia.complete_stage(&session, stage);
    }
    if !passed {
        let mut keep = serde_json::Map::new();
        for key in REGISTRATION_REMEMBERED {
            if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
                keep.insert(key.to_owned(), v.clone());
            }
        }
        if let (Some(p), Some(d), None) = (&password, &password_digest, &remembered_hash) {
            keep.insert(
                "password_hash".into(),
                json!(hash_password(&s, p.clone()).await?),
            );
            keep.insert("password_digest".into(), json!(d));
        }
        s.uia.remember(&session, keep);
        return Ok(challenge(None).into_response());
    }
    let localpart = match (&registered, username) {
        (Some(id), _) => id
            .strip_prefix('@')
            .and_then(|l| l.split(':').next())
            .unwrap_or_default()
            .to_owned(),
        (None, Some(u)) => u.to_lowercase(),
        (None, None) => random_string(12).to_lowercase(),
    };
    let user_id = full_user_id(&s, &localpart);
    let password_hash = match (password, remembered_hash) {
        _ if registered.is_some() => None,
        (_, Some(h)) => Some(h),
        (Some(p), None) => Some(hash_password(&s, p).await?),
        (None, None) => None,
    };
    if registered.is_some() {
        // Registered by an earlier request of this session: log in again below.
    } else if upgrading.is_some() {
        // The guest keeps its id, devices, memberships and display name.
        s.submit_and_wait(
            &user_id,
            None,
            CommandBody::Fact {
                fact: Fact::GuestUpgraded {
                    user_id: user_id.clone(),
                    password_hash,
                },
            },
        )
        .await?;
    } else {
        // The display name starts as the localpart, as Synapse sets it: clients show
        // "The user has no displayname" errors otherwise. A fact of its own, so the
        // audit trail says who set it (the server, at registration).
        register_account(&s, &user_id, &localpart, password_hash).await?;
        if let Some((sid, address, validated_at)) = proven_email {
            let fact = Fact::ThreepidAdded {
                user_id: user_id.clone(),
                medium: "email".into(),
                address,
                validated_at,
                added_at: now,
            };
            s.submit_and_wait(&user_id, None, CommandBody::Fact { fact })
                .await?;
            s.threepids.sessions.remove(&sid);
        }
    }
    if registered.is_none() {
        s.rate_limits.registration.record(&addr_key);
        let mut keep = serde_json::Map::new();
        keep.insert("registered_user_id".into(), json!(user_id));
        s.uia.remember(&session, keep);
    }
    if body.get("inhibit_login").and_then(|v| v.as_bool()) == Some(true) {
        return Ok(
            Json(json!({ "user_id": user_id, "home_server": s.server_name() })).into_response(),
        );
    }
    let session = start_session(
        &s,
        &user_id,
        opt_str(&body, "device_id")?,
        opt_str(&body, "initial_device_display_name")?,
        wants_refresh(&body)?,
        (addr, crate::extract::user_agent(&headers)),
    )
    .await?;
    let mut out = json!({ "user_id": user_id, "home_server": s.server_name() });
    session.write_into(&mut out);
    Ok(Json(out).into_response())
}

/// `POST /register?kind=guest` (spec: "Guest Access"): a guest account, with
/// `[registration] allow_guest_access` only (else 403 `M_FORBIDDEN`, as Synapse), and
/// whatever the registration mode (as Synapse: guests need no UIA). The user id is
/// numeric ([`crate::guest::next_localpart`]); the display name starts as the
/// localpart, as for every account. `device_id`, `initial_device_display_name` and
/// `refresh_token` as for a full registration. Rate limited with registrations.
async fn register_guest(
    s: &AppState,
    addr: ClientAddr,
    headers: &axum::http::HeaderMap,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Json<Value>> {
    if !s.config.allow_guest_access {
        return Err(MatrixError::forbidden("Guest access is disabled"));
    }
    let addr_key = addr.rate_key();
    s.rate_limits.registration.peek(&addr_key)?;
    let device_id = opt_str(body, "device_id")?;
    let display_name = opt_str(body, "initial_device_display_name")?;
    let refresh = wants_refresh(body)?;
    // A number some account took meanwhile (an application service's user, a
    // concurrent guest the journal ordered first) is skipped.
    let mut registered = None;
    let mut reserved = 0;
    for _ in 0..GUEST_ID_ATTEMPTS {
        let localpart = crate::guest::next_localpart(s);
        let user_id = full_user_id(s, &localpart);
        if s.projections.accounts.user(&user_id).is_some() {
            continue;
        }
        if crate::appservice::check_user_not_exclusive(s, &user_id, None).is_err() {
            reserved += 1;
            continue;
        }
        match register_account_as(s, &user_id, &localpart, None, true).await {
            Ok(()) => {
                registered = Some(user_id);
                break;
            }
            Err(e) if e.errcode == "M_USER_IN_USE" => continue,
            Err(e) => return Err(e),
        }
    }
    let user_id = registered.ok_or_else(|| guest_ids_exhausted(reserved))?;
    s.rate_limits.registration.record(&addr_key);
    let session = start_session(
        s,
        &user_id,
        device_id,
        display_name,
        refresh,
        (addr, crate::extract::user_agent(headers)),
    )
    .await?;
    let mut out = json!({ "user_id": user_id, "home_server": s.server_name() });
    session.write_into(&mut out);
    Ok(Json(out))
}

/// The answer when [`GUEST_ID_ATTEMPTS`] numeric ids were all taken: 403
/// `M_FORBIDDEN` when an application service's exclusive namespace reserved any of
/// them (a configuration that keeps guests out until it changes: Synapse hands such
/// ids out regardless), else 503 `M_UNKNOWN` (accounts created meanwhile took every
/// one; a retry moves on to new numbers).
fn guest_ids_exhausted(reserved: usize) -> MatrixError {
    if reserved > 0 {
        MatrixError::forbidden(
            "Guest registration is unavailable: the next numeric user ids are in an \
             application service's exclusive namespace",
        )
    } else {
        MatrixError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "M_UNKNOWN",
            "No free guest user id found; try again",
        )
    }
}

/// Numeric ids a guest registration tries before giving up (each taken one is
/// skipped; only a burst of concurrent registrations or a namespace full of numbers
/// takes more than one).
const GUEST_ID_ATTEMPTS: usize = 100;

/// The guest a registration upgrades (spec: "Guest Access": the guest's token in
/// `guest_access_token`; the `Authorization` header's token is taken too when it is a
/// guest's), or `None` for a new account. An unknown `guest_access_token`: 401
/// `M_UNKNOWN_TOKEN`; a full account's: 403 `M_FORBIDDEN`. Returns the user id.
fn guest_to_upgrade(
    s: &AppState,
    headers: &axum::http::HeaderMap,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Option<String>> {
    if let Some(token) = opt_str(body, "guest_access_token")? {
        let owner = s
            .projections
            .accounts
            .token(&token_hash(&token))
            .ok_or_else(|| {
                MatrixError::new(
                    StatusCode::UNAUTHORIZED,
                    "M_UNKNOWN_TOKEN",
                    "Unknown guest_access_token",
                )
            })?;
        if !owner.guest {
            return Err(MatrixError::forbidden(
                "guest_access_token is not a guest's access token",
            ));
        }
        return Ok(Some(owner.user_id));
    }
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    Ok(bearer
        .and_then(|t| s.projections.accounts.token(&token_hash(t)))
        .filter(|o| o.guest)
        .map(|o| o.user_id))
}

/// The localpart of one of our users' ids.
fn guest_localpart<'a>(s: &AppState, user_id: &'a str) -> &'a str {
    user_id
        .strip_prefix('@')
        .and_then(|u| u.strip_suffix(&format!(":{}", s.server_name())))
        .unwrap_or(user_id)
}

async fn register_available(State(s): State<AppState>, q: Query) -> ApiResult<Json<Value>> {
    let username = q
        .get("username")
        .ok_or_else(|| MatrixError::missing_param("username is required"))?
        .to_lowercase();
    check_localpart(&s, &username)?;
    crate::appservice::check_user_not_exclusive(&s, &full_user_id(&s, &username), None)?;
    if s.projections
        .accounts
        .user(&full_user_id(&s, &username))
        .is_some()
    {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_USER_IN_USE",
            "User ID already taken.",
        ));
    }
    Ok(Json(json!({ "available": true })))
}

/// `GET /login`: `m.login.password`, and `m.login.application_service` when
/// application services are registered.
async fn login_flows(State(s): State<AppState>) -> Json<Value> {
    let mut flows = vec![json!({ "type": "m.login.password" })];
    if !s.appservices.is_empty() {
        flows.push(json!({ "type": "m.login.application_service" }));
    }
    Json(json!({ "flows": flows }))
}

/// The application service behind a request's `as_token`, if it has one (for the
/// unauthenticated endpoints an application service also calls: `/register`,
/// `/login`).
pub(crate) struct AsToken(Option<std::sync::Arc<crate::appservice::AppService>>);

impl axum::extract::FromRequestParts<AppState> for AsToken {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        Ok(AsToken(crate::extract::appservice_of(parts, state)))
    }
}

fn appservice_required(a: AsToken) -> ApiResult<std::sync::Arc<crate::appservice::AppService>> {
    a.0.ok_or_else(|| {
        MatrixError::new(
            StatusCode::UNAUTHORIZED,
            "M_MISSING_TOKEN",
            "m.login.application_service needs the application service's as_token",
        )
    })
}

/// `POST /register` with `type: m.login.application_service` (spec: Application
/// Service API, "Server admin style permissions"): the `as_token` registers
/// `username` in one of its user namespaces (or its sender), whatever the server's
/// registration policy and without rate limits. 401 `M_MISSING_TOKEN` without an
/// `as_token`; 400 `M_EXCLUSIVE` outside its namespaces or in another application
/// service's exclusive namespace; 400 `M_USER_IN_USE` for a taken id. With
/// `inhibit_login` (or `io.element.msc4190` in its registration) no device or token.
async fn register_appservice_user(
    s: &AppState,
    appservice: AsToken,
    body: &serde_json::Map<String, Value>,
    client: (ClientAddr, Option<&str>),
) -> ApiResult<axum::response::Response> {
    use axum::response::IntoResponse;
    let a = appservice_required(appservice)?;
    let username = opt_str(body, "username")?
        .ok_or_else(|| MatrixError::missing_param("username is required"))?;
    let user_id = if username.starts_with('@') {
        username.clone()
    } else {
        let local = username.to_lowercase();
        check_localpart(s, &local)?;
        full_user_id(s, &local)
    };
    let localpart = user_id
        .strip_prefix('@')
        .and_then(|u| u.strip_suffix(&format!(":{}", s.server_name())))
        .ok_or_else(|| {
            MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_INVALID_USERNAME",
                "User ID must be on this server",
            )
        })?
        .to_owned();
    check_localpart(s, &localpart)?;
    if !a.is_interested_in_user(&user_id) {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_EXCLUSIVE",
            "Invalid user localpart for this application service.",
        ));
    }
    crate::appservice::check_user_not_exclusive(s, &user_id, Some(&a))?;
    if s.projections.accounts.user(&user_id).is_some() {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_USER_IN_USE",
            "User ID already taken.",
        ));
    }
    register_account(s, &user_id, &localpart, None).await?;
    let inhibit = body.get("inhibit_login").and_then(|v| v.as_bool()) == Some(true);
    if inhibit || a.msc4190 {
        return Ok(
            Json(json!({ "user_id": user_id, "home_server": s.server_name() })).into_response(),
        );
    }
    let session = start_session(
        s,
        &user_id,
        opt_str(body, "device_id")?,
        opt_str(body, "initial_device_display_name")?,
        wants_refresh(body)?,
        client,
    )
    .await?;
    let mut out = json!({ "user_id": user_id, "home_server": s.server_name() });
    session.write_into(&mut out);
    Ok(Json(out).into_response())
}

/// Registers an account (an `AccountRegistered` fact) and gives it the localpart as
/// display name (a `ProfileSet` fact, as Synapse does at registration).
pub(crate) async fn register_account(
    s: &AppState,
    user_id: &str,
    localpart: &str,
    password_hash: Option<String>,
) -> ApiResult<()> {
    register_account_as(s, user_id, localpart, password_hash, false).await
}

/// [`register_account`], of a guest account when `guest`.
async fn register_account_as(
    s: &AppState,
    user_id: &str,
    localpart: &str,
    password_hash: Option<String>,
    guest: bool,
) -> ApiResult<()> {
    s.submit_and_wait(
        user_id,
        None,
        CommandBody::Fact {
            fact: Fact::AccountRegistered {
                user_id: user_id.to_owned(),
                password_hash,
                guest,
            },
        },
    )
    .await?;
    s.submit_and_wait(
        user_id,
        None,
        CommandBody::Fact {
            fact: Fact::ProfileSet {
                user_id: user_id.to_owned(),
                displayname: Some(Some(localpart.to_owned())),
                avatar_url: None,
            },
        },
    )
    .await?;
    Ok(())
}

/// `POST /login` (spec: "Login"), `m.login.password`. Rate limited (429
/// `M_LIMIT_EXCEEDED`): every attempt per client address (`login_address`), and per
/// account both successful logins (`login_account`) and failed ones
/// (`login_failed_attempts`); a full failed-attempts bucket refuses even the right
/// password, so guessing gains nothing. Password checks run on the bounded hashing
/// pool.
async fn login(
    State(s): State<AppState>,
    addr: ClientAddr,
    appservice: AsToken,
    headers: axum::http::HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let kind = opt_str(&body, "type")?.ok_or_else(|| MatrixError::bad_json("type is required"))?;
    if kind == "m.login.application_service" {
        return login_appservice(
            &s,
            appservice,
            &body,
            (addr, crate::extract::user_agent(&headers)),
        )
        .await;
    }
    s.rate_limits.login_address.check(&addr.rate_key())?;
    if kind != "m.login.password" {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_UNKNOWN",
            format!("Unknown login type {kind}"),
        ));
    }
    // A third-party identifier (spec: "Identifier types", `m.id.thirdparty`) names the
    // account that added it; an address no account has fails like a wrong password.
    let by_threepid = |medium: Option<&str>, address: Option<&str>| -> ApiResult<String> {
        let (Some(medium), Some(address)) = (medium, address) else {
            return Err(MatrixError::bad_json(
                "identifier.medium and identifier.address are required",
            ));
        };
        let address = if medium == "email" {
            address.trim().to_lowercase()
        } else {
            address.to_owned()
        };
        s.projections
            .accounts
            .threepid_owner(medium, &address)
            .ok_or_else(|| MatrixError::forbidden("Invalid username or password"))
    };
    let user = match body.get("identifier") {
        Some(id) => match id.get("type").and_then(|v| v.as_str()) {
            Some("m.id.user") => id.get("user").and_then(|v| v.as_str()).map(str::to_owned),
            Some("m.id.thirdparty") => Some(by_threepid(
                id.get("medium").and_then(Value::as_str),
                id.get("address").and_then(Value::as_str),
            )?),
            _ => {
                return Err(MatrixError::new(
                    StatusCode::BAD_REQUEST,
                    "M_UNKNOWN",
                    "Only m.id.user and m.id.thirdparty identifiers are supported",
                ));
            }
        },
        None => opt_str(&body, "user")?,
    }
    .ok_or_else(|| MatrixError::bad_json("identifier.user is required"))?;
    let password =
        opt_str(&body, "password")?.ok_or_else(|| MatrixError::bad_json("password is required"))?;
    let user_id = full_user_id(&s, &user);
    let account_key = user_id.to_lowercase();
    s.rate_limits.login_account.peek(&account_key)?;
    s.rate_limits.login_failed_attempts.peek(&account_key)?;
    let denied = || {
        s.rate_limits.login_failed_attempts.record(&account_key);
        MatrixError::forbidden("Invalid username or password")
    };
    let account = s.projections.accounts.user(&user_id).ok_or_else(denied)?;
    if account.deactivated {
        return Err(MatrixError::new(
            StatusCode::FORBIDDEN,
            "M_USER_DEACTIVATED",
            "This account has been deactivated",
        ));
    }
    let hash = account.password_hash.ok_or_else(denied)?;
    if !verify_password(&s, password, hash).await? {
        return Err(denied());
    }
    s.rate_limits.login_account.record(&account_key);
    let refreshable = wants_refresh(&body)?;
    let session = start_session(
        &s,
        &user_id,
        opt_str(&body, "device_id")?,
        opt_str(&body, "initial_device_display_name")?,
        refreshable,
        (addr, crate::extract::user_agent(&headers)),
    )
    .await?;
    let mut out = json!({
        "user_id": user_id,
        "home_server": s.server_name(),
        "well_known": { "m.homeserver": { "base_url": s.config.public_base_url } },
    });
    session.write_into(&mut out);
    Ok(Json(out))
}

/// `POST /login` with `type: m.login.application_service` (spec: "Appservice
/// Login"): the `as_token` logs in as a user it is interested in (its sender or in a
/// user namespace), which must exist. 401 `M_MISSING_TOKEN` without an `as_token`; 403
/// `M_FORBIDDEN` for a user outside its namespaces or not registered.
async fn login_appservice(
    s: &AppState,
    appservice: AsToken,
    body: &serde_json::Map<String, Value>,
    client: (ClientAddr, Option<&str>),
) -> ApiResult<Json<Value>> {
    let a = appservice_required(appservice)?;
    let user = match body.get("identifier") {
        Some(id) => id.get("user").and_then(|v| v.as_str()).map(str::to_owned),
        None => opt_str(body, "user")?,
    }
    .ok_or_else(|| MatrixError::bad_json("identifier.user is required"))?;
    let user_id = full_user_id(s, &user);
    if !a.is_interested_in_user(&user_id) {
        return Err(MatrixError::forbidden(
            "An application service may only log in as users that it is interested in",
        ));
    }
    let account = s
        .projections
        .accounts
        .user(&user_id)
        .ok_or_else(|| MatrixError::forbidden("Invalid username"))?;
    if account.deactivated {
        return Err(MatrixError::new(
            StatusCode::FORBIDDEN,
            "M_USER_DEACTIVATED",
            "This account has been deactivated",
        ));
    }
    let session = start_session(
        s,
        &user_id,
        opt_str(body, "device_id")?,
        opt_str(body, "initial_device_display_name")?,
        wants_refresh(body)?,
        client,
    )
    .await?;
    let mut out = json!({
        "user_id": user_id,
        "home_server": s.server_name(),
        "well_known": { "m.homeserver": { "base_url": s.config.public_base_url } },
    });
    session.write_into(&mut out);
    Ok(Json(out))
}

async fn logout(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    // Spec: logout invalidates the token and deletes the device (at once: wait).
    s.submit_and_wait(
        &r.user_id,
        Some(&r.device_id),
        CommandBody::Fact {
            fact: Fact::DeviceDeleted {
                user_id: r.user_id.clone(),
                device_id: r.device_id.clone(),
            },
        },
    )
    .await?;
    Ok(Json(json!({})))
}

async fn logout_all(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    for (device_id, _) in s.projections.accounts.devices(&r.user_id) {
        s.submit_and_wait(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::DeviceDeleted {
                    user_id: r.user_id.clone(),
                    device_id,
                },
            },
        )
        .await?;
    }
    Ok(Json(json!({})))
}

async fn whoami(r: Requester) -> Json<Value> {
    Json(json!({ "user_id": r.user_id, "device_id": r.device_id, "is_guest": r.is_guest }))
}

fn profile_json(s: &AppState, user_id: &str) -> ApiResult<Value> {
    if s.projections.accounts.user(user_id).is_none() {
        return Err(MatrixError::not_found("Profile was not found"));
    }
    Ok(Value::Object(
        s.projections.accounts.profile(user_id).to_json(),
    ))
}

/// Longest profile key name, bytes (spec: 400 `M_KEY_TOO_LARGE` beyond).
pub const MAX_PROFILE_KEY_BYTES: usize = 255;

/// Checks a profile `keyName` (spec v1.16): `displayname`, `avatar_url`, `m.tz`, or a
/// namespaced custom key (`[a-z][a-z0-9_]*` segments joined by dots, at least two,
/// not in the reserved `m.` namespace); at most 255 bytes (else 400
/// `M_KEY_TOO_LARGE`); anything else is 400 `M_INVALID_PARAM`.
fn check_profile_key(key: &str) -> ApiResult<()> {
    if key.len() > MAX_PROFILE_KEY_BYTES {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_KEY_TOO_LARGE",
            format!("Profile keys are at most {MAX_PROFILE_KEY_BYTES} bytes"),
        ));
    }
    if matches!(key, "displayname" | "avatar_url" | "m.tz") {
        return Ok(());
    }
    let segment_ok = |seg: &str| {
        let mut chars = seg.chars();
        chars.next().is_some_and(|c| c.is_ascii_lowercase())
            && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let namespaced = key.split('.').count() >= 2 && key.split('.').all(segment_ok);
    if !namespaced || key.starts_with("m.") {
        return Err(MatrixError::invalid_param(format!(
            "Invalid profile key {key:?}: use displayname, avatar_url, m.tz or a namespaced key such as org.example.field"
        )));
    }
    Ok(())
}

async fn profile(State(s): State<AppState>, Path(user_id): Path<String>) -> ApiResult<Json<Value>> {
    // Unauthenticated: wait for acknowledged writes here (no Requester does it).
    s.wait_for_acknowledged().await?;
    if let Some(remote) = remote_profile(&s, &user_id, None).await? {
        return Ok(Json(remote));
    }
    if user_id.ends_with(&format!(":{}", s.server_name())) {
        // An unknown user in an application service's namespace: ask it first.
        crate::appservice::local_user_exists(&s, &user_id).await?;
    }
    Ok(Json(profile_json(&s, &user_id)?))
}

/// A profile of a user on another server, asked of that server (`/query/profile`);
/// `None` for our own users or with federation off.
async fn remote_profile(
    s: &AppState,
    user_id: &str,
    field: Option<&str>,
) -> ApiResult<Option<Value>> {
    let Some(fed) = &s.federation else {
        return Ok(None);
    };
    if user_id.ends_with(&format!(":{}", s.server_name())) || !user_id.starts_with('@') {
        return Ok(None);
    }
    ruma::UserId::parse(user_id).map_err(|_| MatrixError::invalid_param("Invalid user id"))?;
    spindle_federation::outbound::query_profile(fed, user_id, field)
        .await
        .map(Some)
        .map_err(crate::error::from_federation)
}

/// `GET /profile/{userId}/{keyName}`: `{keyName: value}`; 404 when the user or the
/// field does not exist.
async fn profile_field(
    State(s): State<AppState>,
    Path((user_id, field)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    check_profile_key(&field)?;
    s.wait_for_acknowledged().await?;
    let p = match remote_profile(&s, &user_id, Some(&field)).await? {
        Some(remote) => remote,
        None => profile_json(&s, &user_id)?,
    };
    match p.get(&field) {
        Some(v) => Ok(Json(json!({ field: v }))),
        None => Err(MatrixError::not_found(format!("The user has no {field}"))),
    }
}

/// `DELETE /profile/{userId}/{keyName}`: removes the field (200 whether or not it
/// existed). `displayname`/`avatar_url` are cleared like a `PUT` of `""`, with the
/// member events that carry them.
async fn delete_profile_field(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, field)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    check_profile_key(&field)?;
    if user_id != r.user_id {
        return Err(MatrixError::forbidden(
            "Cannot change another user's profile",
        ));
    }
    match field.as_str() {
        "displayname" | "avatar_url" => {
            let mut body = serde_json::Map::new();
            body.insert(field.clone(), json!(""));
            set_builtin_field(&s, &r, &user_id, &field, &body).await?;
        }
        _ => {
            let fact = Fact::ProfileFieldSet {
                user_id: user_id.clone(),
                key: field,
                value: None,
            };
            s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
                .await?;
        }
    }
    Ok(Json(json!({})))
}

/// `PUT /profile/{userId}/{keyName}` with `{keyName: value}`: `displayname` (string,
/// ≤ 256 bytes, `""` clears), `avatar_url` (`mxc://` or `""`), `m.tz` (string), custom
/// keys (any JSON, `null` stored as `null` as the spec advises). The whole profile
/// must stay under 64 KiB (else 400 `M_PROFILE_TOO_LARGE`).
async fn set_profile_field(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, field)): Path<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    check_profile_key(&field)?;
    if user_id != r.user_id {
        return Err(MatrixError::forbidden("Cannot set another user's profile"));
    }
    if field == "displayname" || field == "avatar_url" {
        set_builtin_field(&s, &r, &user_id, &field, &body).await?;
        return Ok(Json(json!({})));
    }
    let Some(value) = body.get(&field) else {
        return Err(MatrixError::missing_param(format!("{field} is required")));
    };
    if field == "m.tz" && !value.is_string() {
        return Err(MatrixError::bad_json("m.tz must be a string"));
    }
    let mut after = s.projections.accounts.profile(&user_id);
    after.fields.insert(field.clone(), value.clone());
    if after.size_bytes() >= spindle_projections::accounts::MAX_PROFILE_BYTES {
        return Err(profile_too_large());
    }
    let fact = Fact::ProfileFieldSet {
        user_id: user_id.clone(),
        key: field,
        value: Some(value.clone()),
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({})))
}

fn profile_too_large() -> MatrixError {
    MatrixError::new(
        StatusCode::BAD_REQUEST,
        "M_PROFILE_TOO_LARGE",
        "The profile would be 64 KiB or larger",
    )
}

/// Sets `displayname` or `avatar_url` and propagates the change to every joined room
/// as a member event.
async fn set_builtin_field(
    s: &AppState,
    r: &Requester,
    user_id: &str,
    field: &str,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<()> {
    let user_id = user_id.to_owned();
    // The field must be present (spec: 400 M_MISSING_PARAM); an empty string clears it.
    if !body.contains_key(field) || body[field].is_null() {
        return Err(MatrixError::missing_param(format!(
            "{field} is required (use \"\" to clear it)"
        )));
    }
    let value = opt_str(body, field)?.filter(|v| !v.is_empty());
    if field == "avatar_url" && value.as_ref().is_some_and(|v| !v.starts_with("mxc://")) {
        return Err(MatrixError::bad_json("avatar_url must be an mxc:// URI"));
    }
    if value
        .as_ref()
        .is_some_and(|v| v.len() > 256 && field == "displayname")
    {
        return Err(MatrixError::bad_json("displayname is too long (max 256)"));
    }
    let mut after = s.projections.accounts.profile(&user_id);
    match field {
        "displayname" => after.displayname = value.clone(),
        _ => after.avatar_url = value.clone(),
    }
    if after.size_bytes() >= spindle_projections::accounts::MAX_PROFILE_BYTES {
        return Err(profile_too_large());
    }
    let fact = match field {
        "displayname" => Fact::ProfileSet {
            user_id: user_id.clone(),
            displayname: Some(value.clone()),
            avatar_url: None,
        },
        "avatar_url" => Fact::ProfileSet {
            user_id: user_id.clone(),
            displayname: None,
            avatar_url: Some(value.clone()),
        },
        _ => return Err(MatrixError::unrecognized()),
    };
    s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    // Propagate to every joined room as a new member event (what Synapse does).
    let profile = s.projections.accounts.profile(&user_id);
    for (room_id, m) in s.projections.membership.rooms_of(&user_id) {
        if m.membership != "join" {
            continue;
        }
        let mut content = json!({ "membership": "join" });
        if let Some(d) = &profile.displayname {
            content["displayname"] = json!(d);
        }
        if let Some(a) = &profile.avatar_url {
            content["avatar_url"] = json!(a);
        }
        let body = CommandBody::SendEvent {
            room_id: room_id.clone(),
            event: spindle_journal::EventSpec {
                kind: "m.room.member".into(),
                state_key: Some(user_id.clone()),
                content,
                redacts: None,
            },
            txn_id: None,
            precondition: None,
        };
        if let Err(e) = s.submit(&r.user_id, Some(&r.device_id), body).await {
            tracing::warn!(room = %room_id, error = %e.error, "profile propagation failed");
        }
    }
    Ok(())
}

fn own(r: &Requester, user_id: &str) -> ApiResult<()> {
    if r.user_id != user_id {
        return Err(MatrixError::forbidden("Cannot access another user's data"));
    }
    Ok(())
}

fn check_data_type(data_type: &str) -> ApiResult<()> {
    if data_type == "m.fully_read" || data_type == "m.push_rules" {
        return Err(MatrixError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "M_BAD_JSON",
            format!("Cannot set {data_type} through this API"),
        ));
    }
    Ok(())
}

async fn get_account_data(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, data_type)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    // `m.push_rules` reads back as the ruleset `/sync` sends under that type (spec:
    // "Push Rules: Events"; Synapse serves it the same way); it is written through
    // `/pushrules` only ([`check_data_type`]).
    if data_type == "m.push_rules" {
        return s
            .projections
            .push
            .ruleset(&user_id)
            .map(|set| Json(json!({ "global": crate::push::ruleset_json(&set) })))
            .ok_or_else(|| MatrixError::not_found("Account data not found"));
    }
    s.projections
        .account_data
        .get(&user_id, None, &data_type)
        .map(Json)
        .ok_or_else(|| MatrixError::not_found("Account data not found"))
}

async fn put_account_data(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, data_type)): Path<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    check_data_type(&data_type)?;
    let fact = Fact::AccountDataSet {
        user_id,
        room_id: None,
        data_type,
        content: Value::Object(body),
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({})))
}

async fn get_room_account_data(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, room_id, data_type)): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    s.projections
        .account_data
        .get(&user_id, Some(&room_id), &data_type)
        .map(Json)
        .ok_or_else(|| MatrixError::not_found("Account data not found"))
}

async fn put_room_account_data(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, room_id, data_type)): Path<(String, String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    check_data_type(&data_type)?;
    if ruma::RoomId::parse(&room_id).is_err() {
        return Err(MatrixError::invalid_param("Invalid room id"));
    }
    let fact = Fact::AccountDataSet {
        user_id,
        room_id: Some(room_id),
        data_type,
        content: Value::Object(body),
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({})))
}

async fn create_filter(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    crate::sync::Filter::parse(&Value::Object(body.clone()))?;
    let filter_id = random_string(12);
    let fact = Fact::FilterCreated {
        user_id,
        filter_id: filter_id.clone(),
        filter: Value::Object(body),
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({ "filter_id": filter_id })))
}

async fn get_filter(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, filter_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    s.projections
        .filters
        .get(&user_id, &filter_id)
        .map(Json)
        .ok_or_else(|| MatrixError::not_found("Filter not found"))
}

/// Room tags (spec: "Room Tagging"): a view over the room's `m.tag` account data.
fn tags_of(s: &AppState, user_id: &str, room_id: &str) -> serde_json::Map<String, Value> {
    s.projections
        .account_data
        .get(user_id, Some(room_id), "m.tag")
        .and_then(|v| v.get("tags").and_then(|t| t.as_object()).cloned())
        .unwrap_or_default()
}

async fn save_tags(
    s: &AppState,
    r: &Requester,
    room_id: String,
    tags: serde_json::Map<String, Value>,
) -> ApiResult<()> {
    let fact = Fact::AccountDataSet {
        user_id: r.user_id.clone(),
        room_id: Some(room_id),
        data_type: "m.tag".into(),
        content: json!({ "tags": tags }),
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await
        .map(|_| ())
}

async fn get_tags(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, room_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    Ok(Json(json!({ "tags": tags_of(&s, &user_id, &room_id) })))
}

async fn put_tag(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, room_id, tag)): Path<(String, String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    if ruma::RoomId::parse(&room_id).is_err() {
        return Err(MatrixError::invalid_param("Invalid room id"));
    }
    if tag.is_empty() || tag.len() > 255 {
        return Err(MatrixError::invalid_param("Tag names are 1 to 255 bytes"));
    }
    if let Some(order) = body.get("order")
        && !order.is_number()
    {
        return Err(MatrixError::bad_json("order must be a number"));
    }
    let mut tags = tags_of(&s, &user_id, &room_id);
    tags.insert(tag, Value::Object(body));
    save_tags(&s, &r, room_id, tags).await?;
    Ok(Json(json!({})))
}

async fn delete_tag(
    State(s): State<AppState>,
    r: Requester,
    Path((user_id, room_id, tag)): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    own(&r, &user_id)?;
    let mut tags = tags_of(&s, &user_id, &room_id);
    if tags.remove(&tag).is_some() {
        save_tags(&s, &r, room_id, tags).await?;
    }
    Ok(Json(json!({})))
}
