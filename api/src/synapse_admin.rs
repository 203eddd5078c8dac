//! The Synapse-compatible admin API (`/_synapse/admin/...`): the subset that
//! synapse-admin and operators' scripts call, with Synapse's paths, parameters and
//! response field names (Synapse's `docs/admin_api/`). docs/admin-api.md lists every
//! route with its status.
//!
//! Every route is for server admins only ([`crate::admin::is_admin`]: config `admins`
//! or an `AdminPromoted` fact): anyone else gets 403 `M_FORBIDDEN`, before anything
//! about the target is looked up. The two exceptions are Synapse's own:
//! `GET /_synapse/admin/v1/server_version` (public) and shared-secret registration
//! (`/_synapse/admin/v1/register`, authenticated by an HMAC of the request instead).
//!
//! Every change is a journal command (facts such as `AccountRegistered`,
//! `PasswordChanged`, `AdminPromoted`/`AdminRevoked`, `MediaQuarantined`,
//! `MediaDeleted`, `ContentReportDeleted`, `RoomShutDown`, and member events); the
//! principal is the admin who asked, except member events, which are the member's
//! own (a shutdown makes each local member leave, as Synapse does). Reads come from
//! projections (`accounts`, `membership`, `state`, `media`, `server_admin`, ...).
//!
//! Lists (`/v2/users`, `/v1/rooms`, event reports, media per user) are built from the
//! whole table they list, then sorted and paged: their cost grows with the number of
//! accounts, rooms, reports or the user's media, because each answer reports that
//! number (`total`). Pages hold at most [`LIMIT_MAX`] entries (default 100).

use std::{
    collections::HashMap,
    sync::LazyLock,
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{delete, get, post},
};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, EventSpec, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    admin::{is_admin, require_admin},
    extract::{ClientAddr, JsonObject, Query, Requester, opt_str},
};

/// Largest page of any list, entries (a larger `limit` is clamped).
pub const LIMIT_MAX: u64 = 1000;
/// Page size when `limit` is absent.
pub const LIMIT_DEFAULT: u64 = 100;
/// How long a shared-secret registration nonce stays valid (Synapse: 60 s).
pub const NONCE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most nonces outstanding at once; the oldest is dropped beyond it.
pub const NONCES_MAX: usize = 10_000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_synapse/admin/v1/server_version", get(server_version))
        .route(
            "/_synapse/admin/v1/register",
            get(register_nonce).post(register),
        )
        .route("/_synapse/admin/v2/users", get(list_users))
        .route(
            "/_synapse/admin/v2/users/{user_id}",
            get(get_user).put(put_user),
        )
        .route(
            "/_synapse/admin/v1/deactivate/{user_id}",
            post(deactivate_user),
        )
        .route(
            "/_synapse/admin/v1/reset_password/{user_id}",
            post(reset_password),
        )
        .route(
            "/_synapse/admin/v1/users/{user_id}/joined_rooms",
            get(joined_rooms),
        )
        .route(
            "/_synapse/admin/v1/whois/{user_id}",
            get(crate::admin::whois),
        )
        .route("/_synapse/admin/v1/users/{user_id}/login", post(login_as))
        .route(
            "/_synapse/admin/v1/users/{user_id}/admin",
            get(get_user_admin).put(put_user_admin),
        )
        .route("/_synapse/admin/v1/users/{user_id}/media", get(user_media))
        .route("/_synapse/admin/v1/rooms", get(list_rooms))
        .route("/_synapse/admin/v1/rooms/{room_id}", get(room_details))
        .route(
            "/_synapse/admin/v1/rooms/{room_id}/members",
            get(room_members),
        )
        .route("/_synapse/admin/v1/rooms/{room_id}/state", get(room_state))
        .route("/_synapse/admin/v2/rooms/{room_id}", delete(delete_room))
        .route(
            "/_synapse/admin/v2/rooms/{room_id}/delete_status",
            get(delete_status_of_room),
        )
        .route(
            "/_synapse/admin/v2/rooms/delete_status/{delete_id}",
            get(delete_status),
        )
        .route("/_synapse/admin/v1/event_reports", get(list_reports))
        .route(
            "/_synapse/admin/v1/event_reports/{report_id}",
            get(get_report).delete(delete_report),
        )
        .route(
            "/_synapse/admin/v1/media/quarantine/{server_name}/{media_id}",
            post(quarantine_media),
        )
        .route(
            "/_synapse/admin/v1/media/{server_name}/{media_id}",
            delete(delete_media),
        )
}

// ---------------------------------------------------------------------------------
// Helpers

/// `from`/`limit` (Synapse: integers, default 0 and 100); malformed: 400
/// `M_INVALID_PARAM`.
fn paging(q: &Query) -> ApiResult<(usize, usize)> {
    let from = q.u64("from")?.unwrap_or(0) as usize;
    let limit = q.u64("limit")?.unwrap_or(LIMIT_DEFAULT).min(LIMIT_MAX) as usize;
    Ok((from, limit))
}

/// A boolean query parameter (`true`/`false`, as Synapse's `parse_boolean`).
fn qbool(q: &Query, name: &str) -> ApiResult<Option<bool>> {
    match q.get(name) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(v) => Err(MatrixError::invalid_param(format!(
            "{name} must be true or false, not {v:?}"
        ))),
    }
}

/// `dir`: `f` (default `default`) or `b`.
fn backwards(q: &Query, default_backwards: bool) -> ApiResult<bool> {
    match q.get("dir") {
        None => Ok(default_backwards),
        Some("f") => Ok(false),
        Some("b") => Ok(true),
        Some(v) => Err(MatrixError::invalid_param(format!(
            "dir must be f or b, not {v:?}"
        ))),
    }
}

/// A body boolean that may be absent (`default`); another type: 400 `M_BAD_JSON`.
fn body_bool(body: &serde_json::Map<String, Value>, name: &str, default: bool) -> ApiResult<bool> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(MatrixError::bad_json(format!("{name} must be a boolean"))),
    }
}

/// A local user id (400 `M_INVALID_PARAM` otherwise, as Synapse: "Can only ... local
/// users").
fn local_user(s: &AppState, user_id: &str) -> ApiResult<()> {
    let parsed = ruma::UserId::parse(user_id)
        .map_err(|_| MatrixError::invalid_param(format!("Invalid user id {user_id}")))?;
    if parsed.server_name().as_str() != s.server_name() {
        return Err(MatrixError::invalid_param(
            "This endpoint can only be used with local users",
        ));
    }
    Ok(())
}

/// The account must exist: 404 `M_NOT_FOUND` otherwise.
fn existing_user(s: &AppState, user_id: &str) -> ApiResult<spindle_projections::accounts::Account> {
    local_user(s, user_id)?;
    s.projections
        .accounts
        .user(user_id)
        .ok_or_else(|| MatrixError::not_found("User not found"))
}

async fn fact(s: &AppState, r: &Requester, fact: Fact) -> ApiResult<u64> {
    Ok(
        s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
            .await?
            .position,
    )
}

/// The user's most recent `last_seen` over their devices, ms.
fn last_seen_ts(s: &AppState, user_id: &str) -> Option<u64> {
    s.projections
        .accounts
        .devices(user_id)
        .into_iter()
        .filter_map(|(d, _)| crate::devices::last_seen_of(s, user_id, &d).map(|x| x.ts))
        .max()
}

/// Whether `user_id` is an admin by a journal fact only (config admins cannot be
/// demoted through the API).
fn configured_admin(s: &AppState, user_id: &str) -> bool {
    s.config.admins.iter().any(|a| a == user_id)
}

// ---------------------------------------------------------------------------------
// Server version and shared-secret registration

/// `GET /_synapse/admin/v1/server_version` (public, as in Synapse):
/// `{"server_version": "Spindle <version>"}`.
async fn server_version() -> Json<Value> {
    Json(json!({ "server_version": concat!("Spindle ", env!("CARGO_PKG_VERSION")) }))
}

/// Outstanding registration nonces and when each was handed out (in memory, like
/// Synapse's; a restart forgets them, which only makes a client fetch a new one).
static NONCES: LazyLock<parking_lot::Mutex<HashMap<String, Instant>>> =
    LazyLock::new(Default::default);

fn clear_old_nonces(nonces: &mut HashMap<String, Instant>) {
    nonces.retain(|_, t| t.elapsed() <= NONCE_TIMEOUT);
    while nonces.len() >= NONCES_MAX {
        let Some(oldest) = nonces
            .iter()
            .min_by_key(|(_, t)| **t)
            .map(|(k, _)| k.clone())
        else {
            break;
        };
        nonces.remove(&oldest);
    }
}

/// `GET /_synapse/admin/v1/register`: `{"nonce"}`, valid once for
/// [`NONCE_TIMEOUT`].
async fn register_nonce(State(s): State<AppState>) -> ApiResult<Json<Value>> {
    if s.config.registration_shared_secret.is_empty() {
        return Err(shared_secret_off());
    }
    use rand::Rng;
    let bytes: [u8; 32] = rand::rng().random();
    let nonce: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let mut nonces = NONCES.lock();
    clear_old_nonces(&mut nonces);
    nonces.insert(nonce.clone(), Instant::now());
    Ok(Json(json!({ "nonce": nonce })))
}

fn shared_secret_off() -> MatrixError {
    MatrixError::new(
        StatusCode::BAD_REQUEST,
        "M_UNKNOWN",
        "Shared secret registration is not enabled",
    )
}

/// The MAC Synapse defines for shared-secret registration: hex HMAC-SHA1 keyed by the
/// shared secret over `nonce NUL username NUL password NUL ("admin"|"notadmin")`,
/// then `NUL user_type` when a user type is given.
pub fn registration_mac(
    secret: &str,
    nonce: &str,
    username: &str,
    password: &str,
    admin: bool,
    user_type: Option<&str>,
) -> String {
    let mut mac = Hmac::<sha1::Sha1>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(nonce.as_bytes());
    mac.update(b"\0");
    mac.update(username.as_bytes());
    mac.update(b"\0");
    mac.update(password.as_bytes());
    mac.update(b"\0");
    mac.update(if admin { b"admin" } else { b"notadmin" });
    if let Some(t) = user_type {
        mac.update(b"\0");
        mac.update(t.as_bytes());
    }
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `POST /_synapse/admin/v1/register`: `{nonce, username, password, admin?,
/// displayname?, user_type?, mac}` -> `{access_token, user_id, home_server,
/// device_id}`. The nonce is spent even when the request fails (as Synapse). Errors:
/// 400 when the secret is not configured, the nonce unknown or expired, a field
/// missing (`M_BAD_JSON`) or invalid; 403 `M_FORBIDDEN` "HMAC incorrect"; 400
/// `M_USER_IN_USE`; `user_type` other than absent/null: 400 (Spindle has no user types).
async fn register(
    State(s): State<AppState>,
    addr: ClientAddr,
    headers: axum::http::HeaderMap,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    if s.config.registration_shared_secret.is_empty() {
        return Err(shared_secret_off());
    }
    let nonce =
        opt_str(&body, "nonce")?.ok_or_else(|| MatrixError::bad_json("nonce must be specified"))?;
    {
        let mut nonces = NONCES.lock();
        clear_old_nonces(&mut nonces);
        if nonces.remove(&nonce).is_none() {
            return Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_UNKNOWN",
                "unrecognised nonce",
            ));
        }
    }
    let username = opt_str(&body, "username")?
        .ok_or_else(|| MatrixError::bad_json("username must be specified"))?;
    let password = opt_str(&body, "password")?
        .ok_or_else(|| MatrixError::bad_json("password must be specified"))?;
    if username.len() > 512 || username.contains('\0') {
        return Err(MatrixError::invalid_param("Invalid username"));
    }
    if password.len() > crate::devices::MAX_PASSWORD_BYTES || password.contains('\0') {
        return Err(MatrixError::invalid_param("Invalid password"));
    }
    let admin = body_bool(&body, "admin", false)?;
    let user_type = opt_str(&body, "user_type")?;
    if user_type.is_some() {
        return Err(MatrixError::invalid_param("Invalid user type"));
    }
    let got =
        opt_str(&body, "mac")?.ok_or_else(|| MatrixError::bad_json("mac must be specified"))?;
    let want = registration_mac(
        &s.config.registration_shared_secret,
        &nonce,
        &username,
        &password,
        admin,
        None,
    );
    // Constant time, as Synapse's `hmac.compare_digest`.
    let same = got.len() == want.len()
        && got
            .bytes()
            .zip(want.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if !same {
        return Err(MatrixError::forbidden("HMAC incorrect"));
    }
    let localpart = username.to_lowercase();
    crate::account::check_localpart(&s, &localpart)?;
    let user_id = crate::account::full_user_id(&s, &localpart);
    let displayname = opt_str(&body, "displayname")?.unwrap_or_else(|| localpart.clone());
    let server = s.server_name().to_owned();
    create_account(
        &s,
        (&server, None),
        &user_id,
        Some(password),
        &displayname,
        admin,
    )
    .await?;
    let session = crate::account::start_session(
        &s,
        &user_id,
        None,
        None,
        false,
        (addr, crate::extract::user_agent(&headers)),
    )
    .await?;
    Ok(Json(json!({
        "access_token": session.access_token,
        "user_id": user_id,
        "home_server": s.server_name(),
        "device_id": session.device_id,
    })))
}

/// Registers `user_id` (asked for by `by`), with a display name, made an admin if
/// `admin`. 400 `M_USER_IN_USE` if taken (or ever deactivated).
async fn create_account(
    s: &AppState,
    by: (&str, Option<&str>),
    user_id: &str,
    password: Option<String>,
    displayname: &str,
    admin: bool,
) -> ApiResult<()> {
    let password_hash = match password {
        Some(p) => Some(crate::account::hash_password(s, p).await?),
        None => None,
    };
    let facts = [
        Some(Fact::AccountRegistered {
            user_id: user_id.to_owned(),
            password_hash,
            guest: false,
        }),
        Some(Fact::ProfileSet {
            user_id: user_id.to_owned(),
            displayname: Some(Some(displayname.to_owned())),
            avatar_url: None,
        }),
        admin.then(|| Fact::AdminPromoted {
            user_id: user_id.to_owned(),
        }),
    ];
    for fact in facts.into_iter().flatten() {
        s.submit_and_wait(by.0, by.1, CommandBody::Fact { fact })
            .await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Users

/// One entry of `GET /v2/users` (Synapse's `UserPaginateResponse`).
fn user_list_entry(s: &AppState, user_id: &str, deactivated: bool, guest: bool) -> Value {
    let profile = s.projections.accounts.profile(user_id);
    let meta = s.projections.server_admin.user(user_id);
    json!({
        "name": user_id,
        "user_type": null,
        "is_guest": guest,
        "admin": is_admin(s, user_id),
        "deactivated": deactivated,
        "shadow_banned": false,
        "displayname": profile.displayname,
        "avatar_url": profile.avatar_url,
        "creation_ts": meta.creation_ts,
        "erased": meta.erased,
        "last_seen_ts": last_seen_ts(s, user_id),
        "locked": false,
    })
}

/// `GET /_synapse/admin/v2/users`: `{"users": [...], "total", "next_token"?}`. Query:
/// `from`, `limit`, `user_id` (substring of the id), `name` (substring of the
/// localpart or display name, case-insensitive; wins over `user_id`), `guests`
/// (`false`: guest accounts left out; default `true`), `deactivated` (`true`: include deactivated
/// accounts; they are left out otherwise), `admins` (`true`: only admins, `false`:
/// no admins), `order_by` (`name` (default), `displayname`, `is_guest`, `admin`,
/// `deactivated`, `user_type`, `avatar_url`, `shadow_banned`, `creation_ts`,
/// `last_seen_ts`, `locked`), `dir` (`f`/`b`); ties ordered by `name` ascending.
async fn list_users(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let (from, limit) = paging(&q)?;
    let include_deactivated = qbool(&q, "deactivated")?.unwrap_or(false);
    let admins = qbool(&q, "admins")?;
    let include_guests = qbool(&q, "guests")?.unwrap_or(true);
    let order_by = q.get("order_by").unwrap_or("name").to_owned();
    const ORDERS: [&str; 11] = [
        "name",
        "displayname",
        "is_guest",
        "admin",
        "deactivated",
        "user_type",
        "avatar_url",
        "shadow_banned",
        "creation_ts",
        "last_seen_ts",
        "locked",
    ];
    if !ORDERS.contains(&order_by.as_str()) {
        return Err(MatrixError::invalid_param(format!(
            "Unknown value for order_by: {order_by}"
        )));
    }
    let back = backwards(&q, false)?;
    let name = q.get("name").map(str::to_lowercase);
    let id_filter = q.get("user_id").map(str::to_lowercase);
    let mut users: Vec<Value> = s
        .projections
        .accounts
        .users()
        .into_iter()
        .filter(|(_, a)| include_deactivated || !a.deactivated)
        .filter(|(_, a)| include_guests || !a.guest)
        .filter(|(id, _)| admins.is_none_or(|want| is_admin(&s, id) == want))
        .map(|(id, a)| user_list_entry(&s, &id, a.deactivated, a.guest))
        .filter(|u| {
            let id = u["name"].as_str().unwrap_or_default();
            if let Some(n) = &name {
                let local = id.trim_start_matches('@').split(':').next().unwrap_or("");
                let display = u["displayname"].as_str().unwrap_or("").to_lowercase();
                local.contains(n.as_str()) || display.contains(n.as_str())
            } else if let Some(f) = &id_filter {
                id.contains(f.as_str())
            } else {
                true
            }
        })
        .collect();
    sort_by_field(&mut users, &order_by, "name", back);
    let total = users.len();
    let page: Vec<Value> = users.into_iter().skip(from).take(limit).collect();
    let mut out = json!({ "users": page, "total": total });
    if from + limit < total {
        out["next_token"] = json!((from + limit).to_string());
    }
    Ok(Json(out))
}

/// Orders JSON objects by `field` (nulls first, as SQL's ascending order puts them
/// in SQLite), ties by `tie` ascending; `back` reverses the main order.
fn sort_by_field(items: &mut [Value], field: &str, tie: &str, back: bool) {
    fn key(v: &Value) -> (u8, f64, String) {
        match v {
            Value::Null => (0, 0.0, String::new()),
            Value::Bool(b) => (1, f64::from(u8::from(*b)), String::new()),
            Value::Number(n) => (1, n.as_f64().unwrap_or(0.0), String::new()),
            Value::String(s) => (2, 0.0, s.clone()),
            other => (3, 0.0, other.to_string()),
        }
    }
    items.sort_by(|a, b| {
        let (ka, kb) = (key(&a[field]), key(&b[field]));
        let main =
            ka.0.cmp(&kb.0)
                .then(ka.1.total_cmp(&kb.1))
                .then(ka.2.cmp(&kb.2));
        let main = if back { main.reverse() } else { main };
        main.then_with(|| key(&a[tie]).2.cmp(&key(&b[tie]).2))
    });
}

/// The body of `GET /_synapse/admin/v2/users/{userId}` (Synapse's field names).
fn user_details(
    s: &AppState,
    user_id: &str,
    account: &spindle_projections::accounts::Account,
) -> Value {
    let profile = s.projections.accounts.profile(user_id);
    let meta = s.projections.server_admin.user(user_id);
    json!({
        "name": user_id,
        "displayname": profile.displayname,
        "avatar_url": profile.avatar_url,
        "threepids": [],
        "external_ids": [],
        "admin": is_admin(s, user_id),
        "deactivated": account.deactivated,
        "erased": meta.erased,
        "locked": false,
        "suspended": false,
        "shadow_banned": false,
        "is_guest": account.guest,
        "creation_ts": meta.creation_ts,
        "appservice_id": null,
        "consent_server_notice_sent": null,
        "consent_version": null,
        "consent_ts": null,
        "user_type": null,
        "last_seen_ts": last_seen_ts(s, user_id),
    })
}

/// `GET /_synapse/admin/v2/users/{userId}`: the account; 404 `M_NOT_FOUND` if unknown.
async fn get_user(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let account = existing_user(&s, &user_id)?;
    Ok(Json(user_details(&s, &user_id, &account)))
}

/// `PUT /_synapse/admin/v2/users/{userId}`: creates the account (201) or changes it
/// (200); answers with the account as `GET` shows it. Body fields: `password`
/// (string, at most 512 bytes), `logout_devices` (default `true`: a new password
/// logs every device out), `displayname`, `avatar_url` (`mxc://`), `admin` (bool),
/// `deactivated` (`true` deactivates; `false` on a deactivated account is 400: Spindle
/// never reactivates an account). `threepids`, `external_ids`, `user_type`, `locked`
/// are refused when non-empty/true (400 `M_INVALID_PARAM`, not supported). A changed
/// display name or avatar is sent to the user's joined rooms as a member event of
/// theirs, as `PUT /profile` does.
async fn put_user(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    require_admin(&s, &r)?;
    local_user(&s, &user_id)?;
    for unsupported in ["threepids", "external_ids"] {
        match body.get(unsupported) {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(_) => {
                return Err(MatrixError::invalid_param(format!(
                    "{unsupported} are not supported by this server"
                )));
            }
        }
    }
    if !matches!(body.get("user_type"), None | Some(Value::Null)) {
        return Err(MatrixError::invalid_param("Invalid user type"));
    }
    if body_bool(&body, "locked", false)? {
        return Err(MatrixError::invalid_param(
            "Locking accounts is not supported",
        ));
    }
    let password = opt_str(&body, "password")?;
    if password
        .as_ref()
        .is_some_and(|p| p.is_empty() || p.len() > crate::devices::MAX_PASSWORD_BYTES)
    {
        return Err(MatrixError::invalid_param("Invalid password"));
    }
    let logout_devices = body_bool(&body, "logout_devices", true)?;
    let admin = match body.get("admin") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(MatrixError::bad_json(
                "Param 'admin' must be a boolean, if given",
            ));
        }
    };
    let deactivated = match body.get("deactivated") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(MatrixError::bad_json(
                "'deactivated' parameter is not of type boolean",
            ));
        }
    };
    let displayname = opt_str(&body, "displayname")?;
    if displayname.as_ref().is_some_and(|d| d.len() > 256) {
        return Err(MatrixError::bad_json("displayname is too long (max 256)"));
    }
    let avatar_url = opt_str(&body, "avatar_url")?;
    if avatar_url
        .as_ref()
        .is_some_and(|a| !a.is_empty() && !a.starts_with("mxc://"))
    {
        return Err(MatrixError::bad_json("avatar_url must be an mxc:// URI"));
    }
    let by = (r.user_id.as_str(), Some(r.device_id.as_str()));
    let status = match s.projections.accounts.user(&user_id) {
        None => {
            let localpart = user_id
                .trim_start_matches('@')
                .split(':')
                .next()
                .unwrap_or_default()
                .to_owned();
            crate::account::check_localpart(&s, &localpart)?;
            let name = displayname.clone().unwrap_or(localpart);
            create_account(&s, by, &user_id, password, &name, admin == Some(true)).await?;
            if let Some(a) = avatar_url.filter(|a| !a.is_empty()) {
                set_profile(&s, &r, &user_id, None, Some(Some(a))).await?;
            }
            if deactivated == Some(true) {
                crate::devices::deactivate_account(&s, &user_id, false, by).await?;
            }
            StatusCode::CREATED
        }
        Some(account) => {
            if account.deactivated && deactivated == Some(false) {
                return Err(MatrixError::invalid_param(
                    "Reactivating an account is not supported by this server",
                ));
            }
            if let Some(p) = password {
                let password_hash = crate::account::hash_password(&s, p).await?;
                fact(
                    &s,
                    &r,
                    Fact::PasswordChanged {
                        user_id: user_id.clone(),
                        password_hash,
                    },
                )
                .await?;
                if logout_devices {
                    let devices: Vec<String> = s
                        .projections
                        .accounts
                        .devices(&user_id)
                        .into_iter()
                        .map(|(d, _)| d)
                        .collect();
                    crate::devices::delete_devices_as(&s, &user_id, &devices, by).await?;
                }
            }
            let d = displayname.map(|d| Some(d).filter(|d| !d.is_empty()));
            let a = avatar_url.map(|a| Some(a).filter(|a| !a.is_empty()));
            if d.is_some() || a.is_some() {
                set_profile(&s, &r, &user_id, d, a).await?;
            }
            if let Some(want) = admin {
                set_admin(&s, &r, &user_id, want).await?;
            }
            if deactivated == Some(true) && !account.deactivated {
                crate::devices::deactivate_account(&s, &user_id, false, by).await?;
            }
            StatusCode::OK
        }
    };
    let account = existing_user(&s, &user_id)?;
    Ok((status, Json(user_details(&s, &user_id, &account))).into_response())
}

/// Sets profile fields of `user_id` (asked for by an admin) and sends the new profile
/// to every room the user is joined to, as a member event of theirs.
async fn set_profile(
    s: &AppState,
    r: &Requester,
    user_id: &str,
    displayname: Option<Option<String>>,
    avatar_url: Option<Option<String>>,
) -> ApiResult<()> {
    fact(
        s,
        r,
        Fact::ProfileSet {
            user_id: user_id.to_owned(),
            displayname,
            avatar_url,
        },
    )
    .await?;
    let profile = s.projections.accounts.profile(user_id);
    for (room_id, m) in s.projections.membership.rooms_of(user_id) {
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
            event: EventSpec {
                kind: "m.room.member".into(),
                state_key: Some(user_id.to_owned()),
                content,
                redacts: None,
            },
            txn_id: None,
            precondition: None,
        };
        if let Err(e) = s.submit(user_id, None, body).await {
            tracing::warn!(room = %room_id, error = %e.error, "admin profile propagation failed");
        }
    }
    Ok(())
}

/// Gives or takes admin rights by a journal fact. A config admin cannot be demoted
/// (400): their rights come from the config file.
async fn set_admin(s: &AppState, r: &Requester, user_id: &str, admin: bool) -> ApiResult<()> {
    if admin == is_admin(s, user_id) {
        return Ok(());
    }
    if !admin && configured_admin(s, user_id) {
        return Err(MatrixError::invalid_param(
            "This user is an admin by the server's configuration (`admins`); change it there",
        ));
    }
    let f = if admin {
        Fact::AdminPromoted {
            user_id: user_id.to_owned(),
        }
    } else {
        Fact::AdminRevoked {
            user_id: user_id.to_owned(),
        }
    };
    fact(s, r, f).await.map(|_| ())
}

/// `POST /_synapse/admin/v1/deactivate/{userId}` `{erase?}`: deactivates the account
/// (as `POST /account/deactivate`: it leaves its rooms, loses its devices and tokens,
/// and is never registered again); `erase: true` also clears its profile. Answers
/// `{"id_server_unbind_result": "success"}`; 404 for an unknown account.
async fn deactivate_user(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let erase = body_bool(&body, "erase", false)?;
    existing_user(&s, &user_id)?;
    crate::devices::deactivate_account(&s, &user_id, erase, (&r.user_id, Some(&r.device_id)))
        .await?;
    Ok(Json(json!({ "id_server_unbind_result": "success" })))
}

/// `POST /_synapse/admin/v1/reset_password/{userId}` `{new_password, logout_devices?}`:
/// sets the password; unless `logout_devices` is `false`, every device is logged out.
/// Answers `{}`; 404 for an unknown account.
async fn reset_password(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let new_password = opt_str(&body, "new_password")?
        .ok_or_else(|| MatrixError::missing_param("new_password is required"))?;
    if new_password.is_empty() || new_password.len() > crate::devices::MAX_PASSWORD_BYTES {
        return Err(MatrixError::invalid_param("Invalid password"));
    }
    let logout_devices = body_bool(&body, "logout_devices", true)?;
    let account = existing_user(&s, &user_id)?;
    if account.deactivated {
        return Err(MatrixError::invalid_param("The account is deactivated"));
    }
    let password_hash = crate::account::hash_password(&s, new_password).await?;
    fact(
        &s,
        &r,
        Fact::PasswordChanged {
            user_id: user_id.clone(),
            password_hash,
        },
    )
    .await?;
    if logout_devices {
        let devices: Vec<String> = s
            .projections
            .accounts
            .devices(&user_id)
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        crate::devices::delete_devices_as(&s, &user_id, &devices, (&r.user_id, Some(&r.device_id)))
            .await?;
    }
    Ok(Json(json!({})))
}

/// `GET /_synapse/admin/v1/users/{userId}/joined_rooms`: `{"joined_rooms", "total"}`,
/// ordered by room id.
async fn joined_rooms(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let rooms: Vec<String> = s
        .projections
        .membership
        .rooms_of(&user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(room, _)| room)
        .collect();
    Ok(Json(json!({ "total": rooms.len(), "joined_rooms": rooms })))
}

/// `POST /_synapse/admin/v1/users/{userId}/login` `{valid_until_ms?}`: an access token
/// for the user, `{"access_token"}`. Unlike Synapse (whose admin tokens have no
/// device), Spindle's tokens belong to a device: a new device named "Admin login"
/// is created for it, which the user sees in their device list. With
/// `valid_until_ms` the token stops working then. 400 for the admin's own account or
/// a deactivated one (as Synapse); 404 for an unknown account.
async fn login_as(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let valid_until_ms = match body.get("valid_until_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            MatrixError::invalid_param("valid_until_ms must be a positive integer")
        })?),
    };
    if user_id == r.user_id {
        return Err(MatrixError::invalid_param(
            "Cannot use admin API to login as self",
        ));
    }
    let account = existing_user(&s, &user_id)?;
    if account.deactivated {
        return Err(MatrixError::invalid_param("The account is deactivated"));
    }
    if valid_until_ms.is_some_and(|v| v <= crate::now_ms()) {
        return Err(MatrixError::invalid_param(
            "valid_until_ms must be in the future",
        ));
    }
    let device_id = crate::account::random_string(10);
    fact(
        &s,
        &r,
        Fact::DeviceCreated {
            user_id: user_id.clone(),
            device_id: device_id.clone(),
            display_name: Some("Admin login".into()),
        },
    )
    .await?;
    let token = format!("spt_{}", crate::account::random_string(40));
    let token_hash = crate::extract::token_hash(&token);
    let f = match valid_until_ms {
        // A refreshable token is the one kind that expires; its refresh token is
        // never handed out, so it cannot be renewed.
        Some(expires_at) => Fact::RefreshableTokenIssued {
            user_id: user_id.clone(),
            device_id,
            token_hash,
            refresh_token_hash: crate::extract::token_hash(&crate::devices::new_refresh_token()),
            expires_at,
        },
        None => Fact::TokenIssued {
            user_id: user_id.clone(),
            device_id,
            token_hash,
        },
    };
    fact(&s, &r, f).await?;
    Ok(Json(json!({ "access_token": token })))
}

/// `GET /_synapse/admin/v1/users/{userId}/admin`: `{"admin": bool}`.
async fn get_user_admin(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    existing_user(&s, &user_id)?;
    Ok(Json(json!({ "admin": is_admin(&s, &user_id) })))
}

/// `PUT /_synapse/admin/v1/users/{userId}/admin` `{"admin": bool}`: `{}`. An admin
/// cannot demote themself (400, as Synapse), nor a config admin (400).
async fn put_user_admin(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let admin = match body.get("admin") {
        Some(Value::Bool(b)) => *b,
        None => return Err(MatrixError::missing_param("Missing 'admin' parameter")),
        Some(_) => return Err(MatrixError::bad_json("'admin' must be a boolean")),
    };
    existing_user(&s, &user_id)?;
    if user_id == r.user_id && !admin {
        return Err(MatrixError::invalid_param("You may not demote yourself."));
    }
    set_admin(&s, &r, &user_id, admin).await?;
    Ok(Json(json!({})))
}

/// `GET /_synapse/admin/v1/users/{userId}/media`: `{"media": [...], "total",
/// "next_token"?}`, each `{media_id, media_type, media_length, upload_name,
/// created_ts, last_access_ts, quarantined_by, safe_from_quarantine}`
/// (`last_access_ts` is `null`: access is not recorded). Query: `from`, `limit`,
/// `order_by` (`created_ts` (default), `media_id`, `upload_name`, `media_length`,
/// `media_type`, `quarantined_by`, `last_access_ts`, `safe_from_quarantine`), `dir`.
async fn user_media(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let (from, limit) = paging(&q)?;
    let order_by = q.get("order_by").unwrap_or("created_ts").to_owned();
    const ORDERS: [&str; 8] = [
        "media_id",
        "upload_name",
        "created_ts",
        "last_access_ts",
        "media_length",
        "media_type",
        "quarantined_by",
        "safe_from_quarantine",
    ];
    if !ORDERS.contains(&order_by.as_str()) {
        return Err(MatrixError::invalid_param(format!(
            "Unknown value for order_by: {order_by}"
        )));
    }
    let back = backwards(&q, false)?;
    existing_user(&s, &user_id)?;
    let mut media: Vec<Value> = s
        .projections
        .server_admin
        .media_of(&user_id)
        .into_iter()
        .filter_map(|id| {
            let m = s.projections.media.get(&id)?;
            Some(json!({
                "media_id": id,
                "media_type": m.content_type,
                "media_length": m.size,
                "upload_name": m.filename,
                "created_ts": m.created_at,
                "last_access_ts": null,
                "quarantined_by": m.quarantined_by,
                "safe_from_quarantine": false,
            }))
        })
        .collect();
    sort_by_field(&mut media, &order_by, "media_id", back);
    let total = media.len();
    let page: Vec<Value> = media.into_iter().skip(from).take(limit).collect();
    let mut out = json!({ "media": page, "total": total });
    if from + limit < total {
        out["next_token"] = json!(from + limit);
    }
    Ok(Json(out))
}

/// Only this server's media can be quarantined or deleted (400 otherwise: remote
/// media is not stored here); 404 for an unknown media id.
fn local_media(
    s: &AppState,
    server_name: &str,
    media_id: &str,
) -> ApiResult<spindle_projections::media::MediaRecord> {
    if server_name != s.server_name() {
        return Err(MatrixError::invalid_param(
            "Only media of this server is stored here",
        ));
    }
    s.projections
        .media
        .get(media_id)
        .ok_or_else(|| MatrixError::not_found("Unknown media"))
}

/// `POST /_synapse/admin/v1/media/quarantine/{serverName}/{mediaId}`: `{}`; the media is
/// no longer served (404), as in Synapse.
async fn quarantine_media(
    State(s): State<AppState>,
    r: Requester,
    Path((server_name, media_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let m = local_media(&s, &server_name, &media_id)?;
    if m.quarantined_by.is_none() {
        fact(
            &s,
            &r,
            Fact::MediaQuarantined {
                media_id,
                quarantined_by: r.user_id.clone(),
            },
        )
        .await?;
    }
    Ok(Json(json!({})))
}

/// `DELETE /_synapse/admin/v1/media/{serverName}/{mediaId}`: `{"deleted_media":
/// [mediaId], "total": 1}`. The id stops being served and listed; the blob stays while
/// other media may share it (content-addressed).
async fn delete_media(
    State(s): State<AppState>,
    r: Requester,
    Path((server_name, media_id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    local_media(&s, &server_name, &media_id)?;
    fact(
        &s,
        &r,
        Fact::MediaDeleted {
            media_id: media_id.clone(),
        },
    )
    .await?;
    Ok(Json(json!({ "deleted_media": [media_id], "total": 1 })))
}

// ---------------------------------------------------------------------------------
// Rooms

/// A string field of a current state event's content.
fn state_str(s: &AppState, root: spindle_core::trie::Root, kind: &str, field: &str) -> Value {
    crate::visibility::state_content(s, root, kind, "")
        .and_then(|c| c.get(field).cloned())
        .filter(|v| v.is_string())
        .unwrap_or(Value::Null)
}

/// Local members joined now.
fn joined_local(s: &AppState, room_id: &str) -> Vec<String> {
    let suffix = format!(":{}", s.server_name());
    s.projections
        .membership
        .members(room_id)
        .into_iter()
        .filter(|(u, m)| m.membership == "join" && u.ends_with(&suffix))
        .map(|(u, _)| u)
        .collect()
}

/// A room as `GET /v1/rooms` lists it (Synapse's fields); `state_events` only when
/// `with_state_count` (it walks the room's current state).
fn room_entry(
    s: &AppState,
    room_id: &str,
    meta: &spindle_projections::state::RoomMeta,
    with_state_count: bool,
) -> Value {
    let Some(root) = s.projections.state.current_root(room_id) else {
        return json!({ "room_id": room_id });
    };
    let federatable = crate::visibility::state_content(s, root, "m.room.create", "")
        .and_then(|c| c.get("m.federate").and_then(|v| v.as_bool()))
        .unwrap_or(true);
    let room_type = crate::visibility::state_content(s, root, "m.room.create", "")
        .and_then(|c| c.get("type").cloned())
        .unwrap_or(Value::Null);
    let mut v = json!({
        "room_id": room_id,
        "name": state_str(s, root, "m.room.name", "name"),
        "canonical_alias": state_str(s, root, "m.room.canonical_alias", "alias"),
        "joined_members": s.projections.room_summary.counts(room_id).joined,
        "joined_local_members": joined_local(s, room_id).len(),
        "version": meta.room_version,
        "creator": meta.creator,
        "encryption": state_str(s, root, "m.room.encryption", "algorithm"),
        "federatable": federatable,
        "public": s.projections.directory.is_published(room_id),
        "join_rules": state_str(s, root, "m.room.join_rules", "join_rule"),
        "guest_access": state_str(s, root, "m.room.guest_access", "guest_access"),
        "history_visibility": state_str(s, root, "m.room.history_visibility", "history_visibility"),
        "room_type": room_type,
    });
    if with_state_count {
        v["state_events"] = json!(s.projections.state.entries(root).len());
    }
    v
}

/// `GET /_synapse/admin/v1/rooms`: `{"rooms": [...], "offset", "total_rooms",
/// "next_batch"?, "prev_batch"?}`. Query: `from`, `limit`, `order_by` (`name`
/// (default), `alphabetical`, `size`, `canonical_alias`, `joined_members`,
/// `joined_local_members`, `version`, `creator`, `encryption`, `federatable`,
/// `public`, `join_rules`, `guest_access`, `history_visibility`, `state_events`),
/// `dir`, `search_term` (case-insensitive substring of the name or canonical alias,
/// or the exact room id). Orders follow Synapse: counts and `version` largest first,
/// everything else ascending; `dir=b` reverses; ties by room id.
async fn list_rooms(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let (from, limit) = paging(&q)?;
    let order_by = q.get("order_by").unwrap_or("name").to_owned();
    let (field, descending) = match order_by.as_str() {
        "name" | "alphabetical" => ("name", false),
        "size" | "joined_members" => ("joined_members", true),
        "joined_local_members" => ("joined_local_members", true),
        "version" => ("version", true),
        "state_events" => ("state_events", true),
        f @ ("canonical_alias" | "creator" | "encryption" | "federatable" | "public"
        | "join_rules" | "guest_access" | "history_visibility") => (f, false),
        other => {
            return Err(MatrixError::invalid_param(format!(
                "Unknown value for order_by: {other}"
            )));
        }
    };
    let back = backwards(&q, false)?;
    let term = q.get("search_term").map(str::to_lowercase);
    let mut rooms: Vec<Value> = s
        .projections
        .state
        .rooms()
        .into_iter()
        .map(|(id, meta)| room_entry(&s, &id, &meta, field == "state_events"))
        .filter(|v| {
            let Some(t) = &term else { return true };
            let has = |f: &str| {
                v[f].as_str()
                    .is_some_and(|x| x.to_lowercase().contains(t.as_str()))
            };
            has("name") || has("canonical_alias") || v["room_id"].as_str() == q.get("search_term")
        })
        .collect();
    sort_by_field(&mut rooms, field, "room_id", descending != back);
    let total = rooms.len();
    let mut page: Vec<Value> = rooms.into_iter().skip(from).take(limit).collect();
    if field != "state_events" {
        for v in &mut page {
            if let Some(root) = v["room_id"]
                .as_str()
                .and_then(|id| s.projections.state.current_root(id))
            {
                v["state_events"] = json!(s.projections.state.entries(root).len());
            }
        }
    }
    let mut out = json!({ "rooms": page, "offset": from, "total_rooms": total });
    if from + limit < total {
        out["next_batch"] = json!(from + limit);
    }
    if from > 0 {
        out["prev_batch"] = json!(from.saturating_sub(limit));
    }
    Ok(Json(out))
}

fn known_room(s: &AppState, room_id: &str) -> ApiResult<spindle_projections::state::RoomMeta> {
    s.projections
        .state
        .room(room_id)
        .ok_or_else(|| MatrixError::not_found("Room not found"))
}

/// `GET /_synapse/admin/v1/rooms/{roomId}`: the list entry plus `avatar`, `topic`,
/// `joined_local_devices` and `forgotten` (every local user who had a membership
/// forgot the room); 404 `M_NOT_FOUND` for an unknown room.
async fn room_details(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let meta = known_room(&s, &room_id)?;
    let mut v = room_entry(&s, &room_id, &meta, true);
    if let Some(root) = s.projections.state.current_root(&room_id) {
        v["avatar"] = state_str(&s, root, "m.room.avatar", "url");
        v["topic"] = state_str(&s, root, "m.room.topic", "topic");
    }
    let local = joined_local(&s, &room_id);
    v["joined_local_devices"] = json!(
        local
            .iter()
            .map(|u| s.projections.accounts.devices(u).len())
            .sum::<usize>()
    );
    let suffix = format!(":{}", s.server_name());
    let locals: Vec<_> = s
        .projections
        .membership
        .members(&room_id)
        .into_iter()
        .filter(|(u, _)| u.ends_with(&suffix))
        .collect();
    v["forgotten"] = json!(!locals.is_empty() && locals.iter().all(|(_, m)| m.forgotten));
    Ok(Json(v))
}

/// `GET /_synapse/admin/v1/rooms/{roomId}/members`: `{"members": [joined user ids],
/// "total"}`, ordered by user id.
async fn room_members(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    known_room(&s, &room_id)?;
    let members: Vec<String> = s
        .projections
        .membership
        .members(&room_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(u, _)| u)
        .collect();
    Ok(Json(json!({ "total": members.len(), "members": members })))
}

/// `GET /_synapse/admin/v1/rooms/{roomId}/state`: `{"state": [events]}`, the current
/// state events as clients see them, ordered by (type, state key).
async fn room_state(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    known_room(&s, &room_id)?;
    let root = s
        .projections
        .state
        .current_root(&room_id)
        .ok_or_else(|| MatrixError::not_found("Room not found"))?;
    let state: Vec<Value> = s
        .projections
        .state
        .entries(root)
        .into_iter()
        .filter_map(|(_, _, id)| s.projections.timeline.event(&id))
        .map(|ev| crate::read::render_unbundled(&s, &ev, None))
        .collect();
    Ok(Json(json!({ "state": state })))
}

/// Default name and message of the room a shutdown moves users to (Synapse's).
const SHUTDOWN_ROOM_NAME: &str = "Content Violation Notification";
const SHUTDOWN_MESSAGE: &str = "Sharing illegal content on this server is not permitted and rooms in violation will be blocked.";

/// `DELETE /_synapse/admin/v2/rooms/{roomId}` `{new_room_user_id?, room_name?,
/// message?, block?, purge?, force_purge?}`: shuts the room down. Every local user
/// joined, invited or knocking leaves (a leave of their own); its local aliases are
/// deleted and it leaves the room directory; with `new_room_user_id` (a local
/// account) a new public room named `room_name` is created by that user, `message` is
/// sent there, and every removed user is joined to it; `block: true` refuses local
/// joins from then on. Unlike Synapse, the work is done before the answer (it is a few
/// commands per member), so the status is `complete` at once. `purge` cannot remove
/// history: the journal is append-only and the truth (SPEC §1); the room's events
/// stay readable to whoever could read them before (nobody local is left in it).
/// Answers `{"delete_id"}`; 404 for an unknown room; 400 for a `new_room_user_id` that
/// is not a local account.
async fn delete_room(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let block = body_bool(&body, "block", false)?;
    let purge = body_bool(&body, "purge", true)?;
    body_bool(&body, "force_purge", false)?;
    let new_room_user = opt_str(&body, "new_room_user_id")?;
    let room_name = opt_str(&body, "room_name")?.unwrap_or_else(|| SHUTDOWN_ROOM_NAME.into());
    let message = opt_str(&body, "message")?.unwrap_or_else(|| SHUTDOWN_MESSAGE.into());
    known_room(&s, &room_id)?;
    if let Some(u) = &new_room_user {
        local_user(&s, u)?;
        if s.projections.accounts.user(u).is_none_or(|a| a.deactivated) {
            return Err(MatrixError::invalid_param(format!(
                "User {u} is not a local account"
            )));
        }
    }
    let new_room_id = match &new_room_user {
        Some(u) => Some(create_notice_room(&s, u, &room_name, &message).await?),
        None => None,
    };
    let suffix = format!(":{}", s.server_name());
    let mut kicked = Vec::new();
    let mut failed = Vec::new();
    for (user, m) in s.projections.membership.members(&room_id) {
        if !user.ends_with(&suffix) || !matches!(m.membership.as_str(), "join" | "invite" | "knock")
        {
            continue;
        }
        match crate::devices::leave_as(&s, &user, &room_id).await {
            Ok(()) => {
                if let Some(new) = &new_room_id
                    && Some(&user) != new_room_user.as_ref()
                    && let Err(e) = join_as(&s, &user, new).await
                {
                    tracing::warn!(user = %user, error = %e.error, "shutdown: joining the new room failed");
                }
                kicked.push(user);
            }
            Err(e) => {
                tracing::warn!(user = %user, error = %e.error, "shutdown: leave failed");
                failed.push(user);
            }
        }
    }
    let aliases = s.projections.aliases.of_room(&room_id);
    for alias in &aliases {
        fact(
            &s,
            &r,
            Fact::AliasDeleted {
                alias: alias.clone(),
            },
        )
        .await?;
    }
    if s.projections.directory.is_published(&room_id) {
        fact(
            &s,
            &r,
            Fact::RoomVisibilitySet {
                room_id: room_id.clone(),
                visibility: "private".into(),
            },
        )
        .await?;
    }
    let delete_id = crate::account::random_string(16);
    fact(
        &s,
        &r,
        Fact::RoomShutDown {
            room_id,
            delete_id: delete_id.clone(),
            requester: r.user_id.clone(),
            kicked_users: kicked,
            failed_to_kick_users: failed,
            local_aliases: aliases,
            new_room_id,
            block,
            purge,
        },
    )
    .await?;
    Ok(Json(json!({ "delete_id": delete_id })))
}

/// Creates the public room a shutdown moves users to, as `creator`, and sends `message`.
async fn create_notice_room(
    s: &AppState,
    creator: &str,
    name: &str,
    message: &str,
) -> ApiResult<String> {
    let as_creator = Requester {
        user_id: creator.to_owned(),
        device_id: String::new(),
        token_hash: String::new(),
        appservice: None,
        is_guest: false,
    };
    let body = json!({
        "preset": "public_chat",
        "name": name,
        "power_level_content_override": { "users_default": -10 },
    });
    let Json(created) = crate::rooms::create_room(
        State(s.clone()),
        as_creator,
        JsonObject(body.as_object().cloned().unwrap_or_default()),
    )
    .await?;
    let new_room = created["room_id"]
        .as_str()
        .ok_or_else(|| MatrixError::internal("createRoom answered no room id"))?
        .to_owned();
    let send = CommandBody::SendEvent {
        room_id: new_room.clone(),
        event: EventSpec {
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "msgtype": "m.text", "body": message }),
            redacts: None,
        },
        txn_id: None,
        precondition: None,
    };
    s.submit(creator, None, send).await?;
    Ok(new_room)
}

/// `user_id` joins a local public room (their own member event).
async fn join_as(s: &AppState, user_id: &str, room_id: &str) -> ApiResult<()> {
    let profile = s.projections.accounts.profile(user_id);
    let mut content = json!({ "membership": "join" });
    if let Some(d) = &profile.displayname {
        content["displayname"] = json!(d);
    }
    if let Some(a) = &profile.avatar_url {
        content["avatar_url"] = json!(a);
    }
    let body = CommandBody::SendEvent {
        room_id: room_id.to_owned(),
        event: EventSpec {
            kind: "m.room.member".into(),
            state_key: Some(user_id.to_owned()),
            content,
            redacts: None,
        },
        txn_id: None,
        precondition: None,
    };
    s.submit(user_id, None, body).await.map(|_| ())
}

fn shutdown_json(sd: &spindle_projections::server_admin::Shutdown) -> Value {
    json!({
        "kicked_users": sd.kicked_users,
        "failed_to_kick_users": sd.failed_to_kick_users,
        "local_aliases": sd.local_aliases,
        "new_room_id": sd.new_room_id,
    })
}

/// `GET /_synapse/admin/v2/rooms/{roomId}/delete_status`: `{"results": [{delete_id,
/// status, shutdown_room}]}`; 404 if the room was never shut down.
async fn delete_status_of_room(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let results: Vec<Value> = s
        .projections
        .server_admin
        .shutdowns_of(&room_id)
        .iter()
        .map(|sd| {
            json!({
                "delete_id": sd.delete_id,
                "status": "complete",
                "shutdown_room": shutdown_json(sd),
            })
        })
        .collect();
    if results.is_empty() {
        return Err(MatrixError::not_found("No delete task for room"));
    }
    Ok(Json(json!({ "results": results })))
}

/// `GET /_synapse/admin/v2/rooms/delete_status/{deleteId}`: `{status, shutdown_room}`.
async fn delete_status(
    State(s): State<AppState>,
    r: Requester,
    Path(delete_id): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let sd = s
        .projections
        .server_admin
        .shutdown(&delete_id)
        .ok_or_else(|| MatrixError::not_found("delete id not found"))?;
    Ok(Json(
        json!({ "status": "complete", "shutdown_room": shutdown_json(&sd) }),
    ))
}

// ---------------------------------------------------------------------------------
// Event reports

fn report_json(s: &AppState, rep: &spindle_projections::server_admin::EventReport) -> Value {
    let root = s.projections.state.current_root(&rep.room_id);
    let sender = s
        .projections
        .timeline
        .event(&rep.event_id)
        .map(|ev| json!(ev.pdu.sender.as_str()))
        .unwrap_or(Value::Null);
    json!({
        "id": rep.id,
        "received_ts": rep.received_ts,
        "room_id": rep.room_id,
        "name": root.map(|r| state_str(s, r, "m.room.name", "name")).unwrap_or(Value::Null),
        "canonical_alias": root
            .map(|r| state_str(s, r, "m.room.canonical_alias", "alias"))
            .unwrap_or(Value::Null),
        "event_id": rep.event_id,
        "user_id": rep.user_id,
        "reason": rep.reason,
        "score": rep.score,
        "sender": sender,
    })
}

/// `GET /_synapse/admin/v1/event_reports`: `{"event_reports": [...], "total",
/// "next_token"?}`, newest first unless `dir=f`. Query: `from`, `limit`, `dir`,
/// `user_id` / `room_id` (substring filters, as Synapse), `event_sender_user_id`
/// (exact sender of the reported event).
async fn list_reports(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let (from, limit) = paging(&q)?;
    let back = backwards(&q, true)?;
    let mut reports: Vec<Value> = s
        .projections
        .server_admin
        .reports()
        .iter()
        .map(|rep| report_json(&s, rep))
        .filter(|v| {
            q.get("user_id")
                .is_none_or(|u| v["user_id"].as_str().is_some_and(|x| x.contains(u)))
                && q.get("room_id")
                    .is_none_or(|u| v["room_id"].as_str().is_some_and(|x| x.contains(u)))
                && q.get("event_sender_user_id")
                    .is_none_or(|u| v["sender"].as_str() == Some(u))
        })
        .collect();
    if back {
        reports.reverse();
    }
    let total = reports.len();
    let page: Vec<Value> = reports.into_iter().skip(from).take(limit).collect();
    let mut out = json!({ "event_reports": page, "total": total });
    if from + limit < total {
        out["next_token"] = json!(from + limit);
    }
    Ok(Json(out))
}

fn report_id(raw: &str) -> ApiResult<u64> {
    raw.parse().map_err(|_| {
        MatrixError::invalid_param(
            "The report_id parameter must be a string representing a positive integer.",
        )
    })
}

/// `GET /_synapse/admin/v1/event_reports/{reportId}`: the list entry plus
/// `event_json` (the reported event as clients see it, `null` if it is not here).
async fn get_report(
    State(s): State<AppState>,
    r: Requester,
    Path(raw): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let rep = s
        .projections
        .server_admin
        .report(report_id(&raw)?)
        .ok_or_else(|| MatrixError::not_found("Event report not found"))?;
    let mut v = report_json(&s, &rep);
    v["event_json"] = s
        .projections
        .timeline
        .event(&rep.event_id)
        .map(|ev| crate::read::render_unbundled(&s, &ev, None))
        .unwrap_or(Value::Null);
    Ok(Json(v))
}

/// `DELETE /_synapse/admin/v1/event_reports/{reportId}`: `{}`; 404 if unknown.
async fn delete_report(
    State(s): State<AppState>,
    r: Requester,
    Path(raw): Path<String>,
) -> ApiResult<Json<Value>> {
    require_admin(&s, &r)?;
    let id = report_id(&raw)?;
    if s.projections.server_admin.report(id).is_none() {
        return Err(MatrixError::not_found("Event report not found"));
    }
    fact(&s, &r, Fact::ContentReportDeleted { report_id: id }).await?;
    Ok(Json(json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MAC Synapse's documented Python generator computes (hmac.new(secret,
    /// digestmod=sha1) over the NUL-joined fields).
    #[test]
    fn registration_mac_is_synapses_hmac_sha1() {
        let mac = registration_mac("s3cret", "abc", "alice", "pw", true, None);
        assert_eq!(mac, "fff9f57189c2d1a494c19759e16d592b0f64ce32");
        assert_ne!(
            mac,
            registration_mac("s3cret", "abc", "alice", "pw", false, None)
        );
        assert_ne!(
            mac,
            registration_mac("s3cret", "abc", "alice", "pw", true, Some("bot"))
        );
    }
}
