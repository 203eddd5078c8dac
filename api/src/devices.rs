//! Device management (spec: client-server API "Device Management") and the
//! user-interactive authentication that guards it, password changes and account
//! deactivation (spec: "Account management"), and
//! refresh tokens (spec: "Refreshing access tokens").
//!
//! Devices are the accounts projection's rows (`DeviceCreated` / `DeviceRenamed` /
//! `DeviceDeleted` facts); deleting a device revokes its access and refresh tokens in
//! the same apply.
//!
//! Last seen (`last_seen_ts`, `last_seen_ip`, and the user agent `/admin/whois`
//! reports): every authenticated request updates an in-memory [`LastSeen`] entry
//! (a read-locked lookup, a write at most once a minute), and a `DeviceSeen` fact is
//! journaled only when the address or user agent changed (at most once a minute per
//! device) or an hour has passed: the journal stays the truth (invariant 1) without a
//! write per read, and the accounts projection applies the fact's own timestamp
//! (invariant 2: no clock in apply). Answers show the newer of memory and the
//! projection, so a restart loses at most the last hour's timestamp. With
//! `[devices] keep_client_addresses = false` no address is kept anywhere, and
//! `last_seen_ip` is left out.

use std::{collections::HashMap, sync::Arc};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    account::{full_user_id, hash_password, random_string, verify_password},
    extract::{JsonObject, Requester, opt_str, token_hash},
};

/// The in-memory `last_seen_ts` is refreshed at most this often (ms): a request does
/// one read-locked map lookup, and takes the write lock only once per interval.
pub const LAST_SEEN_GRANULARITY_MS: u64 = 60_000;

/// With neither address nor user agent changing, a device's `DeviceSeen` is journaled
/// at most this often (ms).
pub const LAST_SEEN_JOURNAL_INTERVAL_MS: u64 = 3_600_000;

/// Longest user agent kept, bytes (longer ones are cut at a character boundary).
pub const MAX_USER_AGENT_BYTES: usize = 512;

/// A device's last use: when, from which address, with which client.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Seen {
    /// ms since the Unix epoch.
    pub ts: u64,
    /// Client address (`None` when addresses are not kept or unknown).
    pub ip: Option<String>,
    /// The `User-Agent` header.
    pub user_agent: Option<String>,
}

#[derive(Debug, Clone)]
struct Entry {
    seen: Seen,
    /// What was last journaled (or found in the projection) for this device.
    journaled: Seen,
}

/// Last use of each device (in memory; see the module docs for what is journaled).
#[derive(Clone)]
pub struct LastSeen {
    map: Arc<parking_lot::RwLock<HashMap<(String, String), Entry>>>,
    keep_client_addresses: bool,
    /// Devices kept at most (config `caches.device_last_seen`).
    max: usize,
}

impl Default for LastSeen {
    fn default() -> Self {
        LastSeen::new(true)
    }
}

/// Cuts a user agent to [`MAX_USER_AGENT_BYTES`] at a character boundary.
fn bounded_user_agent(ua: &str) -> String {
    let mut end = ua.len().min(MAX_USER_AGENT_BYTES);
    while !ua.is_char_boundary(end) {
        end -= 1;
    }
    ua[..end].to_owned()
}

impl LastSeen {
    /// An empty map; with `keep_client_addresses = false` no address is ever stored.
    pub fn new(keep_client_addresses: bool) -> LastSeen {
        LastSeen::with_limit(
            keep_client_addresses,
            crate::CacheLimits::default().device_last_seen,
        )
    }

    /// [`LastSeen::new`] keeping at most `max` devices (at least 10): at the bound the
    /// tenth least recently used are dropped (one pass per tenth of the bound). A
    /// dropped device's answers fall back to its last journaled `DeviceSeen`.
    pub fn with_limit(keep_client_addresses: bool, max: usize) -> LastSeen {
        LastSeen {
            map: Arc::default(),
            keep_client_addresses,
            max: max.max(10),
        }
    }

    /// Devices kept now.
    pub fn len(&self) -> usize {
        self.map.read().len()
    }

    /// Whether no device is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records a request by `(user, device)` at `now` from `ip` with `user_agent`.
    /// `journaled` gives what the projection holds (asked only for a device not in
    /// memory yet). Returns the `DeviceSeen` to journal when one is due (see the module
    /// docs); cheap when nothing changed recently.
    pub fn touch(
        &self,
        user_id: &str,
        device_id: &str,
        now: u64,
        ip: Option<std::net::IpAddr>,
        user_agent: Option<&str>,
        journaled: impl FnOnce() -> Option<Seen>,
    ) -> Option<Seen> {
        let ip = ip
            .filter(|_| self.keep_client_addresses)
            .map(|ip| match ip {
                std::net::IpAddr::V6(v6) => v6
                    .to_ipv4_mapped()
                    .map_or(ip.to_string(), |v4| v4.to_string()),
                v4 => v4.to_string(),
            });
        let user_agent = user_agent.map(bounded_user_agent);
        let key = (user_id.to_owned(), device_id.to_owned());
        if let Some(e) = self.map.read().get(&key)
            && e.seen.ip == ip
            && e.seen.user_agent == user_agent
            && now.saturating_sub(e.seen.ts) < LAST_SEEN_GRANULARITY_MS
        {
            return None;
        }
        // Read the projection (first use since start) before taking the write lock.
        let known = self.map.read().contains_key(&key);
        let fresh = (!known).then(|| journaled().unwrap_or_default());
        let mut map = self.map.write();
        if !map.contains_key(&key) && map.len() >= self.max {
            let mut by_age: Vec<(u64, (String, String))> =
                map.iter().map(|(k, e)| (e.seen.ts, k.clone())).collect();
            by_age.sort();
            for (_, k) in by_age.into_iter().take(self.max / 10) {
                map.remove(&k);
            }
        }
        let entry = map.entry(key).or_insert_with(|| {
            let journaled = fresh.unwrap_or_default();
            Entry {
                seen: journaled.clone(),
                journaled,
            }
        });
        entry.seen = Seen {
            ts: now,
            ip,
            user_agent,
        };
        let since = now.saturating_sub(entry.journaled.ts);
        let changed = entry.seen.ip != entry.journaled.ip
            || entry.seen.user_agent != entry.journaled.user_agent;
        let due = (changed && since >= LAST_SEEN_GRANULARITY_MS)
            || since >= LAST_SEEN_JOURNAL_INTERVAL_MS;
        if !due {
            return None;
        }
        entry.journaled = entry.seen.clone();
        Some(entry.seen.clone())
    }

    /// The device's last use as seen since the server started, if it was used.
    pub fn get(&self, user_id: &str, device_id: &str) -> Option<Seen> {
        self.map
            .read()
            .get(&(user_id.to_owned(), device_id.to_owned()))
            .map(|e| e.seen.clone())
    }
}

/// Records a request's use of a device; returns the `DeviceSeen` fact to journal when
/// one is due.
fn seen_fact(
    s: &AppState,
    user_id: &str,
    device_id: &str,
    ip: Option<std::net::IpAddr>,
    user_agent: Option<&str>,
) -> Option<Fact> {
    let now = crate::now_ms();
    let seen = s
        .last_seen
        .touch(user_id, device_id, now, ip, user_agent, || {
            s.projections
                .accounts
                .device_seen(user_id, device_id)
                .map(|d| Seen {
                    ts: d.ts,
                    ip: d.ip,
                    user_agent: d.user_agent,
                })
        })?;
    Some(Fact::DeviceSeen {
        user_id: user_id.to_owned(),
        device_id: device_id.to_owned(),
        ts: seen.ts,
        ip: seen.ip,
        user_agent: seen.user_agent,
    })
}

/// Records a request's use of a device and journals a `DeviceSeen` when one is due,
/// in the background: an ordinary request never waits for it.
pub fn record_seen(
    s: &AppState,
    user_id: &str,
    device_id: &str,
    ip: Option<std::net::IpAddr>,
    user_agent: Option<&str>,
) {
    let Some(fact) = seen_fact(s, user_id, device_id, ip, user_agent) else {
        return;
    };
    let s = s.clone();
    let (user_id, device_id) = (user_id.to_owned(), device_id.to_owned());
    tokio::spawn(async move {
        if let Err(e) = s
            .submit(&user_id, Some(&device_id), CommandBody::Fact { fact })
            .await
        {
            tracing::warn!(user = %user_id, device = %device_id, error = %e.error, "could not journal DeviceSeen");
        }
    });
}

/// [`record_seen`] for a session's first request (login, registration): the fact is
/// durable before the answer, so it precedes everything the new session does.
pub async fn record_seen_now(
    s: &AppState,
    user_id: &str,
    device_id: &str,
    ip: Option<std::net::IpAddr>,
    user_agent: Option<&str>,
) -> ApiResult<()> {
    if let Some(fact) = seen_fact(s, user_id, device_id, ip, user_agent) {
        s.submit(user_id, Some(device_id), CommandBody::Fact { fact })
            .await?;
    }
    Ok(())
}

/// The device's last use: the newer of memory and the projection.
pub fn last_seen_of(s: &AppState, user_id: &str, device_id: &str) -> Option<Seen> {
    let memory = s.last_seen.get(user_id, device_id);
    let journaled = s
        .projections
        .accounts
        .device_seen(user_id, device_id)
        .map(|d| Seen {
            ts: d.ts,
            ip: d.ip,
            user_agent: d.user_agent,
        });
    match (memory, journaled) {
        (Some(m), Some(j)) => Some(if j.ts > m.ts { j } else { m }),
        (m, j) => m.or(j),
    }
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_matrix/client/v3/devices", get(list_devices))
        .route(
            "/_matrix/client/v3/devices/{device_id}",
            get(get_device).put(rename_device).delete(delete_device),
        )
        .route("/_matrix/client/v3/delete_devices", post(delete_devices))
        .route("/_matrix/client/v3/account/password", post(change_password))
        .route("/_matrix/client/v3/account/deactivate", post(deactivate))
        .route("/_matrix/client/v3/refresh", post(refresh))
}

/// A device as `/devices` answers it: `last_seen_ts` and `last_seen_ip` once the
/// device has been seen (the address only while addresses are kept).
fn device_json(s: &AppState, user_id: &str, device_id: &str, name: Option<String>) -> Value {
    let mut d = json!({ "device_id": device_id });
    if let Some(n) = name {
        d["display_name"] = json!(n);
    }
    if let Some(seen) = last_seen_of(s, user_id, device_id) {
        d["last_seen_ts"] = json!(seen.ts);
        if let Some(ip) = seen.ip {
            d["last_seen_ip"] = json!(ip);
        }
    }
    d
}

/// `GET /devices`: the requester's devices, ordered by device id.
async fn list_devices(State(s): State<AppState>, r: Requester) -> Json<Value> {
    let devices: Vec<Value> = s
        .projections
        .accounts
        .devices(&r.user_id)
        .into_iter()
        .map(|(id, d)| device_json(&s, &r.user_id, &id, d.display_name))
        .collect();
    Json(json!({ "devices": devices }))
}

/// `GET /devices/{deviceId}`: 404 `M_NOT_FOUND` for a device the user does not have.
async fn get_device(
    State(s): State<AppState>,
    r: Requester,
    Path(device_id): Path<String>,
) -> ApiResult<Json<Value>> {
    let d = s
        .projections
        .accounts
        .device(&r.user_id, &device_id)
        .ok_or_else(|| MatrixError::not_found("Device not found"))?;
    Ok(Json(device_json(
        &s,
        &r.user_id,
        &device_id,
        d.display_name,
    )))
}

/// Longest device display name accepted, bytes.
pub const MAX_DEVICE_NAME_BYTES: usize = 255;

/// `PUT /devices/{deviceId}`: renames an existing device; an application service
/// (spec v1.17, MSC4190) creates a device its user does not have yet (201, a
/// `DeviceCreated` fact). Anyone else: 404 for an unknown device.
async fn rename_device(
    State(s): State<AppState>,
    r: Requester,
    Path(device_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let name = opt_str(&body, "display_name")?;
    if name
        .as_ref()
        .is_some_and(|n| n.len() > MAX_DEVICE_NAME_BYTES)
    {
        return Err(MatrixError::bad_json(format!(
            "display_name is longer than {MAX_DEVICE_NAME_BYTES} bytes"
        )));
    }
    let Some(current) = s.projections.accounts.device(&r.user_id, &device_id) else {
        if r.appservice.is_none() {
            return Err(MatrixError::not_found("Device not found"));
        }
        if device_id.is_empty() || device_id.len() > MAX_DEVICE_NAME_BYTES {
            return Err(MatrixError::invalid_param("Invalid device id"));
        }
        let fact = Fact::DeviceCreated {
            user_id: r.user_id.clone(),
            device_id,
            display_name: name,
        };
        s.submit_and_wait(&r.user_id, r.device(), CommandBody::Fact { fact })
            .await?;
        return Ok((StatusCode::CREATED, Json(json!({}))).into_response());
    };
    if !body.contains_key("display_name") {
        return Ok(Json(json!({})).into_response());
    }
    if name != current.display_name {
        let fact = Fact::DeviceRenamed {
            user_id: r.user_id.clone(),
            device_id,
            display_name: name,
        };
        s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
            .await?;
    }
    Ok(Json(json!({})).into_response())
}

/// User-interactive authentication for a signed-in user (spec: "User-Interactive
/// Authentication API"): the single stage `m.login.password` with the requester's own
/// password (`m.login.dummy` for an account that has no password). Returns `None`
/// when `body.auth` completes it, else the 401 answer to send: the flows, and
/// `M_FORBIDDEN` when a password was given but is wrong or names another user.
///
/// The session is bound to `action` and `params` (the parameters that choose what the
/// operation does) and to the requester ([`crate::uia`]): one opened for anything else
/// is refused with 403, an unknown one with 400. A session that completed its stage
/// authorizes its own operation again without a password until it expires (as
/// Synapse's completed stages do).
pub(crate) async fn user_interactive_auth(
    s: &AppState,
    r: &Requester,
    action: &'static str,
    params: Value,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Option<Response>> {
    let account = s
        .projections
        .accounts
        .user(&r.user_id)
        .ok_or_else(|| MatrixError::forbidden("Unknown account"))?;
    let stage = if account.password_hash.is_some() {
        "m.login.password"
    } else {
        "m.login.dummy"
    };
    let op = crate::uia::UiaOperation {
        user_id: Some(r.user_id.clone()),
        action,
        params,
    };
    let now = crate::now_ms();
    // `auth` is optional: an explicit `null` is no auth at all.
    let auth = body.get("auth").and_then(|a| a.as_object());
    let (session, completed) = match auth.and_then(|a| a.get("session")).and_then(|v| v.as_str()) {
        Some(sid) => (sid.to_owned(), s.uia.resume(sid, &op, now)?.completed),
        None => (s.uia.open(op, now), Vec::new()),
    };
    if completed.iter().any(|c| c == stage) {
        return Ok(None);
    }
    let challenge = |err: Option<MatrixError>| {
        let mut out = json!({
            "flows": [{ "stages": [stage] }],
            "params": {},
            "session": session,
            "completed": [],
        });
        if let Some(e) = err {
            out["errcode"] = json!(e.errcode);
            out["error"] = json!(e.error);
        }
        Some((StatusCode::UNAUTHORIZED, Json(out)).into_response())
    };
    let Some(auth) = auth else {
        return Ok(challenge(None));
    };
    let passed = match (auth.get("type").and_then(|v| v.as_str()), stage) {
        (Some("m.login.dummy"), "m.login.dummy") => true,
        (Some("m.login.password"), "m.login.password") => {
            let user = match auth.get("identifier") {
                Some(id) => {
                    if id.get("type").and_then(|v| v.as_str()) != Some("m.id.user") {
                        return Ok(challenge(Some(MatrixError::forbidden(
                            "Only m.id.user identifiers are supported",
                        ))));
                    }
                    id.get("user").and_then(|v| v.as_str())
                }
                None => auth.get("user").and_then(|v| v.as_str()),
            };
            if user.is_some_and(|u| full_user_id(s, u) != r.user_id) {
                return Ok(challenge(Some(MatrixError::forbidden(
                    "The identifier does not match the signed-in user",
                ))));
            }
            let password = auth
                .get("password")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned();
            let hash = account.password_hash.unwrap_or_default();
            if !verify_password(s, password, hash).await? {
                return Ok(challenge(Some(MatrixError::forbidden("Invalid password"))));
            }
            true
        }
        _ => false,
    };
    if !passed {
        return Ok(challenge(None));
    }
    s.uia.complete_stage(&session, stage);
    Ok(None)
}

/// Deletes devices (and, with them, their tokens), waiting until the last deletion is
/// applied so the answer holds when it leaves.
async fn delete_devices_of(s: &AppState, r: &Requester, device_ids: &[String]) -> ApiResult<()> {
    delete_devices_as(s, &r.user_id, device_ids, (&r.user_id, Some(&r.device_id))).await
}

/// Deletes `user_id`'s devices (with their tokens), asked for by `by` (principal,
/// device): the user themself, or a server admin.
pub(crate) async fn delete_devices_as(
    s: &AppState,
    user_id: &str,
    device_ids: &[String],
    by: (&str, Option<&str>),
) -> ApiResult<()> {
    let mut last = None;
    for device_id in device_ids {
        if s.projections.accounts.device(user_id, device_id).is_none() {
            continue;
        }
        let fact = Fact::DeviceDeleted {
            user_id: user_id.to_owned(),
            device_id: device_id.clone(),
        };
        let o = s.submit(by.0, by.1, CommandBody::Fact { fact }).await?;
        last = Some(o.position);
    }
    if let Some(p) = last {
        s.wait_for(p).await?;
    }
    Ok(())
}

/// `DELETE /devices/{deviceId}` (UIA, except for an application service, spec v1.17).
/// A device that does not exist (any more) answers 200 after authentication, as the
/// spec allows.
async fn delete_device(
    State(s): State<AppState>,
    r: Requester,
    Path(device_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    if r.appservice.is_none()
        && let Some(challenge) = user_interactive_auth(
            &s,
            &r,
            "DELETE /devices/{deviceId}",
            json!({ "device_id": device_id }),
            &body,
        )
        .await?
    {
        return Ok(challenge);
    }
    delete_devices_of(&s, &r, &[device_id]).await?;
    Ok(Json(json!({})).into_response())
}

/// Most device ids one `POST /delete_devices` accepts.
pub const MAX_DELETE_DEVICES: usize = 1000;

/// `POST /delete_devices` (UIA).
async fn delete_devices(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let devices: Vec<String> = match body.get("devices") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| MatrixError::bad_json("devices must be a list of strings"))
            })
            .collect::<ApiResult<_>>()?,
        None => return Err(MatrixError::missing_param("devices is required")),
        Some(_) => return Err(MatrixError::bad_json("devices must be a list of strings")),
    };
    if devices.len() > MAX_DELETE_DEVICES {
        return Err(MatrixError::invalid_param(format!(
            "at most {MAX_DELETE_DEVICES} devices per request"
        )));
    }
    if r.appservice.is_none()
        && let Some(challenge) = user_interactive_auth(
            &s,
            &r,
            "POST /delete_devices",
            json!({ "devices": devices }),
            &body,
        )
        .await?
    {
        return Ok(challenge);
    }
    delete_devices_of(&s, &r, &devices).await?;
    Ok(Json(json!({})).into_response())
}

/// Longest password accepted, bytes (argon2 hashes anything; this bounds the work).
pub const MAX_PASSWORD_BYTES: usize = 512;

/// `POST /account/password` (UIA): sets a new password; unless `logout_devices` is
/// `false`, every other device of the user is deleted (with its tokens). The
/// requesting device keeps its token.
async fn change_password(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let new_password = opt_str(&body, "new_password")?
        .ok_or_else(|| MatrixError::missing_param("new_password is required"))?;
    if new_password.is_empty() || new_password.len() > MAX_PASSWORD_BYTES {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_WEAK_PASSWORD",
            format!("Passwords are 1 to {MAX_PASSWORD_BYTES} bytes"),
        ));
    }
    let logout_devices = match body.get("logout_devices") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(MatrixError::bad_json("logout_devices must be a boolean")),
    };
    // Bound to the new password (its digest: no password is kept in memory). Not to
    // `logout_devices`: clients add it only to the request that completes the flow.
    let params = json!({
        "new_password": blake3::hash(new_password.as_bytes()).to_hex().to_string(),
    });
    if let Some(challenge) =
        user_interactive_auth(&s, &r, "POST /account/password", params, &body).await?
    {
        return Ok(challenge);
    }
    let fact = Fact::PasswordChanged {
        user_id: r.user_id.clone(),
        password_hash: hash_password(&s, new_password).await?,
    };
    s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    if logout_devices {
        let others: Vec<String> = s
            .projections
            .accounts
            .devices(&r.user_id)
            .into_iter()
            .map(|(id, _)| id)
            .filter(|id| *id != r.device_id)
            .collect();
        delete_devices_of(&s, &r, &others).await?;
    }
    Ok(Json(json!({})).into_response())
}

/// `POST /account/deactivate` (UIA): the account can no longer log in and its id is
/// never registered again (the journal refuses new devices and tokens for it); it
/// leaves every room it is joined to, invited to or knocking on; `erase: true` also
/// clears its profile. Every device (with its tokens) is deleted last, the
/// requester's included.
async fn deactivate(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let erase = match body.get("erase") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(MatrixError::bad_json("erase must be a boolean")),
    };
    if let Some(challenge) = user_interactive_auth(
        &s,
        &r,
        "POST /account/deactivate",
        json!({ "erase": erase }),
        &body,
    )
    .await?
    {
        return Ok(challenge);
    }
    let unbind = remove_threepids(&s, &r.user_id).await?;
    deactivate_account(&s, &r.user_id, erase, (&r.user_id, Some(&r.device_id))).await?;
    Ok(Json(json!({ "id_server_unbind_result": unbind })).into_response())
}

/// Unbinds every 3PID of `user_id` from the identity servers it was bound through and
/// removes the account's 3PIDs (spec: `POST /account/deactivate`,
/// `id_server_unbind_result`): `"success"` when there was something to unbind and
/// every unbind succeeded, else `"no-support"`.
pub(crate) async fn remove_threepids(s: &AppState, user_id: &str) -> ApiResult<&'static str> {
    let accounts = &s.projections.accounts;
    let mut all: Vec<(String, String)> = accounts
        .threepids(user_id)
        .into_iter()
        .map(|(m, a, _)| (m, a))
        .chain(accounts.bound_threepids(user_id))
        .collect();
    all.sort();
    all.dedup();
    let mut result = "no-support";
    let mut any_bound = false;
    let mut all_unbound = true;
    for (medium, address) in all {
        if !accounts
            .threepid_binds(user_id, &medium, &address)
            .is_empty()
        {
            any_bound = true;
            let r = crate::threepid::unbind_everywhere(s, user_id, &medium, &address, None).await?;
            all_unbound &= r == "success";
        }
        let fact = Fact::ThreepidRemoved {
            user_id: user_id.to_owned(),
            medium,
            address,
        };
        s.submit_and_wait(user_id, None, CommandBody::Fact { fact })
            .await?;
    }
    if any_bound && all_unbound {
        result = "success";
    }
    Ok(result)
}

/// Deactivates `user_id` as asked for by `by` (principal, device: the user themself
/// or a server admin): journals `AccountDeactivated`, makes the user leave every room
/// they are joined to, invited to or knocking on (a leave of their own, as Synapse
/// does), then deletes every device with its tokens.
pub(crate) async fn deactivate_account(
    s: &AppState,
    user_id: &str,
    erase: bool,
    by: (&str, Option<&str>),
) -> ApiResult<()> {
    let fact = Fact::AccountDeactivated {
        user_id: user_id.to_owned(),
        erase,
    };
    s.submit_and_wait(by.0, by.1, CommandBody::Fact { fact })
        .await?;
    for (room_id, m) in s.projections.membership.rooms_of(user_id) {
        if !matches!(m.membership.as_str(), "join" | "invite" | "knock") {
            continue;
        }
        if let Err(e) = leave_as(s, user_id, &room_id).await {
            tracing::warn!(room = %room_id, error = %e.error, "deactivation: leaving a room failed");
        }
    }
    let devices: Vec<String> = s
        .projections
        .accounts
        .devices(user_id)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    delete_devices_as(s, user_id, &devices, by).await
}

/// `user_id` leaves (or rejects an invite to, or withdraws a knock on) `room_id`: a
/// member event of their own, no device. Succeeds without an event if they already left.
pub(crate) async fn leave_as(s: &AppState, user_id: &str, room_id: &str) -> ApiResult<()> {
    let body = CommandBody::SendEvent {
        room_id: room_id.to_owned(),
        event: spindle_journal::EventSpec {
            kind: "m.room.member".into(),
            state_key: Some(user_id.to_owned()),
            content: json!({ "membership": "leave" }),
            redacts: None,
        },
        txn_id: None,
        precondition: Some(spindle_journal::MembershipPrecondition {
            allowed: ["join", "invite", "knock"].map(String::from).to_vec(),
            unchanged_ok: true,
        }),
    };
    s.submit(user_id, None, body).await.map(|_| ())
}

/// A fresh refresh token (`spr_` + 40 alphanumerics; only its hash is journaled).
pub(crate) fn new_refresh_token() -> String {
    format!("spr_{}", random_string(40))
}

/// `POST /refresh` (no access token needed): spends a refresh token for a new access
/// token (expiring after `sessions.refreshable_access_token_lifetime_ms`) and a new
/// refresh token; the old pair stops working at once. An unknown, revoked or already
/// spent refresh token is 401 `M_UNKNOWN_TOKEN` with `soft_logout: false` (the client
/// must log in again).
async fn refresh(
    State(s): State<AppState>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let old = opt_str(&body, "refresh_token")?
        .ok_or_else(|| MatrixError::missing_param("refresh_token is required"))?;
    let unknown = || {
        MatrixError::new(
            StatusCode::UNAUTHORIZED,
            "M_UNKNOWN_TOKEN",
            "Unknown or already used refresh token",
        )
        .with_extra(json!({ "soft_logout": false }))
    };
    s.wait_for_acknowledged().await?;
    let old_hash = token_hash(&old);
    let owner = s
        .projections
        .accounts
        .refresh_token(&old_hash)
        .ok_or_else(unknown)?;
    let access = format!("spt_{}", random_string(40));
    let refresh = new_refresh_token();
    let lifetime = s.config.refreshable_access_token_lifetime_ms;
    let fact = Fact::TokenRefreshed {
        user_id: owner.user_id.clone(),
        device_id: owner.device_id.clone(),
        old_refresh_token_hash: old_hash,
        token_hash: token_hash(&access),
        refresh_token_hash: token_hash(&refresh),
        expires_at: crate::now_ms().saturating_add(lifetime),
    };
    s.submit_and_wait(
        &owner.user_id,
        Some(&owner.device_id),
        CommandBody::Fact { fact },
    )
    .await
    .map_err(|e| {
        if e.errcode == "M_FORBIDDEN" {
            unknown()
        } else {
            e
        }
    })?;
    // The apply checks the refresh token is still live (its device may have been
    // deleted meanwhile); only then does the new pair exist.
    if s.projections.accounts.token(&token_hash(&access)).is_none() {
        return Err(unknown());
    }
    Ok(Json(json!({
        "access_token": access,
        "refresh_token": refresh,
        "expires_in_ms": lifetime,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_seen_is_bounded_least_recently_used_dropped_first() {
        let l = LastSeen::with_limit(true, 100);
        for i in 0..100u64 {
            l.touch("@u:x", &format!("D{i}"), 1_000 + i, None, None, || None);
        }
        assert_eq!(l.len(), 100);
        // D0 is used again: D1..D10 are the ten least recently used.
        l.touch(
            "@u:x",
            "D0",
            1_000 + LAST_SEEN_GRANULARITY_MS,
            None,
            None,
            || None,
        );
        l.touch(
            "@u:x",
            "Dnew",
            2_000 + LAST_SEEN_GRANULARITY_MS,
            None,
            None,
            || None,
        );
        assert_eq!(l.len(), 91);
        for i in 1..=10 {
            assert!(l.get("@u:x", &format!("D{i}")).is_none(), "D{i}");
        }
        assert!(l.get("@u:x", "D0").is_some());
        assert!(l.get("@u:x", "D11").is_some());
        assert!(l.get("@u:x", "Dnew").is_some());
    }
}
