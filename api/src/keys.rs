//! Device keys (spec: client-server API "End-to-End Encryption", "Key management API"):
//! `POST /keys/upload`, `POST /keys/query`, `POST /keys/claim`, `GET /keys/changes`.
//!
//! Uploads become journal facts; claims are decided by the journal at append time
//! (each one-time key is handed out at most once, whatever the concurrency); reads come
//! from the `device_keys` projection. A user of another server whose device list we
//! hold a fresh copy of (kept from their server's `m.device_list_update`s, see
//! `spindle_federation::devices`) is answered from it; other remote users are asked
//! of their server over federation (spec: "/keys/query" and "/keys/claim" with
//! remote users), and a copy of those who share a room with us is fetched meanwhile:
//! one
//! request per server, all at once, bounded by the request's `timeout`; a server that
//! fails, is too slow, or cannot be asked (federation off) is listed under `failures`,
//! and an answer is kept only for that server's own users.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use axum::{
    Json, Router,
    extract::State,
    routing::{get, post},
};
use serde_json::{Map, Value, json};
use spindle_journal::{CommandBody, Fact, KeyClaimRequest};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Query, Requester},
};

/// Most users one `/keys/query` or `/keys/claim` may name (more: 400 `M_LIMIT_EXCEEDED`
/// would be wrong, the spec has no code for it, so `M_INVALID_PARAM`).
pub const MAX_USERS_PER_REQUEST: usize = 1000;
/// Most (device, key) entries one `/keys/claim` or `/keys/upload` may carry.
pub const MAX_KEYS_PER_REQUEST: usize = 1000;
/// How long `/keys/query` and `/keys/claim` wait for other servers when the request
/// names no `timeout`, ms (the spec's recommended default).
pub const REMOTE_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// The longest `timeout` a request may ask for, ms (longer ones are clamped).
pub const REMOTE_TIMEOUT_MS_MAX: u64 = 60_000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_matrix/client/v3/keys/upload", post(upload))
        .route("/_matrix/client/v3/keys/query", post(query))
        .route("/_matrix/client/v3/keys/claim", post(claim))
        .route("/_matrix/client/v3/keys/changes", get(changes))
}

fn object<'a>(v: &'a Value, what: &str) -> ApiResult<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| MatrixError::bad_json(format!("{what} must be an object")))
}

/// The server part of a user id (`None` if it is not a user id).
fn server_of(user_id: &str) -> Option<&str> {
    user_id
        .strip_prefix('@')
        .and_then(|u| u.split_once(':'))
        .map(|(_, s)| s)
}

/// A map of `"<algorithm>:<key id>" -> key` (one-time or fallback keys). Keys are
/// objects (signed keys) or strings (unsigned `curve25519`).
fn key_map(v: Option<&Value>, what: &str) -> ApiResult<BTreeMap<String, Value>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(BTreeMap::new());
    };
    let map = object(v, what)?;
    if map.len() > MAX_KEYS_PER_REQUEST {
        return Err(MatrixError::invalid_param(format!(
            "at most {MAX_KEYS_PER_REQUEST} {what} per request"
        )));
    }
    let mut out = BTreeMap::new();
    for (id, key) in map {
        let Some((alg, name)) = id.split_once(':') else {
            return Err(MatrixError::bad_json(format!(
                "{what} ids must be <algorithm>:<key id>, not {id:?}"
            )));
        };
        if alg.is_empty() || name.is_empty() || id.contains('\0') {
            return Err(MatrixError::bad_json(format!("invalid key id {id:?}")));
        }
        if !(key.is_object() || key.is_string()) {
            return Err(MatrixError::bad_json(format!(
                "{what} {id:?} must be an object or a string"
            )));
        }
        out.insert(id.clone(), key.clone());
    }
    Ok(out)
}

/// Checks an uploaded `DeviceKeys` object: it is the requester's own device (else 400
/// `M_BAD_JSON`) and has the shape the spec gives (`algorithms` a list, `keys` and
/// `signatures`, when present, objects). Signatures are not checked here: clients
/// verify them (spec: "Clients ... must verify the signature"), a device may sign
/// with algorithms the server does not know, and Synapse stores what it is given;
/// refusing would lock such a device out of encryption. `unsigned` is dropped.
fn check_device_keys(r: &Requester, v: &Value) -> ApiResult<Value> {
    let o = object(v, "device_keys")?;
    if o.get("user_id").and_then(|u| u.as_str()) != Some(r.user_id.as_str())
        || o.get("device_id").and_then(|d| d.as_str()) != Some(r.device_id.as_str())
    {
        return Err(MatrixError::bad_json(
            "device_keys.user_id and device_id must be the requesting user and device",
        ));
    }
    if !o.get("algorithms").is_some_and(|a| a.is_array()) {
        return Err(MatrixError::bad_json(
            "device_keys.algorithms must be a list",
        ));
    }
    if !o.get("keys").is_some_and(|k| k.is_object()) {
        return Err(MatrixError::bad_json("device_keys.keys must be an object"));
    }
    if o.get("signatures").is_some_and(|k| !k.is_object()) {
        return Err(MatrixError::bad_json(
            "device_keys.signatures must be an object",
        ));
    }
    let mut stored = v.clone();
    if let Some(m) = stored.as_object_mut() {
        m.remove("unsigned");
    }
    Ok(stored)
}

/// 400 `M_INVALID_SIGNATURE`.
pub fn invalid_signature(msg: impl Into<String>) -> MatrixError {
    MatrixError::new(
        axum::http::StatusCode::BAD_REQUEST,
        "M_INVALID_SIGNATURE",
        msg,
    )
}

/// `{algorithm: count}` of a device's unclaimed one-time keys, with
/// `signed_curve25519` always present (clients read it to decide to upload more).
pub fn one_time_key_counts(s: &AppState, user_id: &str, device_id: &str) -> Value {
    let mut counts = s
        .projections
        .device_keys
        .one_time_key_counts(user_id, device_id);
    counts.entry("signed_curve25519".into()).or_insert(0);
    json!(counts)
}

/// `POST /_matrix/client/v3/keys/upload` (spec: "Key management API"): device keys,
/// one-time keys and fallback keys of the requesting device. Answers the device's
/// unclaimed one-time key counts after the upload.
async fn upload(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let device_keys = match body.get("device_keys") {
        None | Some(Value::Null) => None,
        Some(v) => Some(check_device_keys(&r, v)?),
    };
    let one_time_keys = key_map(body.get("one_time_keys"), "one_time_keys")?;
    let fallback_keys = key_map(body.get("fallback_keys"), "fallback_keys")?;
    let mut facts = Vec::new();
    if let Some(device_keys) = device_keys {
        facts.push(Fact::DeviceKeysUploaded {
            user_id: r.user_id.clone(),
            device_id: r.device_id.clone(),
            device_keys,
        });
    }
    if !one_time_keys.is_empty() {
        facts.push(Fact::OneTimeKeysUploaded {
            user_id: r.user_id.clone(),
            device_id: r.device_id.clone(),
            one_time_keys,
        });
    }
    if !fallback_keys.is_empty() {
        facts.push(Fact::FallbackKeysUploaded {
            user_id: r.user_id.clone(),
            device_id: r.device_id.clone(),
            fallback_keys,
        });
    }
    let mut position = 0;
    for fact in facts {
        position = s
            .submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
            .await?
            .position
            .max(position);
    }
    // The counts are read back, so they must include this upload.
    s.wait_for(position).await?;
    Ok(Json(json!({
        "one_time_key_counts": one_time_key_counts(&s, &r.user_id, &r.device_id),
    })))
}

/// The request's `timeout` (ms, default [`REMOTE_TIMEOUT_MS_DEFAULT`], at most
/// [`REMOTE_TIMEOUT_MS_MAX`]). Not a non-negative integer: 400 `M_INVALID_PARAM`.
fn remote_timeout(body: &Map<String, Value>) -> ApiResult<Duration> {
    let ms = match body.get("timeout") {
        None | Some(Value::Null) => REMOTE_TIMEOUT_MS_DEFAULT,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| MatrixError::invalid_param("timeout must be a non-negative integer"))?,
    };
    Ok(Duration::from_millis(ms.min(REMOTE_TIMEOUT_MS_MAX)))
}

/// A `failures` entry (Synapse's shape: `{"status", "message"}`).
fn failure(status: u16, message: impl Into<String>) -> Value {
    json!({ "status": status, "message": message.into() })
}

/// Asks every server in `by_server` (server -> the request's map of that server's
/// users) with `ask`, all at once, and waits at most `timeout` for all of them. Returns
/// the answers by server; every server that failed, did not answer in time or could
/// not be asked gets a `failures` entry instead (federation off: all of them).
async fn ask_servers<T, F, Fut>(
    s: &AppState,
    by_server: BTreeMap<String, Map<String, Value>>,
    timeout: Duration,
    failures: &mut Map<String, Value>,
    ask: F,
) -> Vec<(String, T)>
where
    T: Send + 'static,
    F: Fn(spindle_federation::FedState, String, Map<String, Value>) -> Fut,
    Fut: Future<Output = Result<T, spindle_federation::client::ClientError>> + Send + 'static,
{
    let mut answers = Vec::new();
    if by_server.is_empty() {
        return answers;
    }
    let Some(fed) = &s.federation else {
        for server in by_server.into_keys() {
            failures.insert(
                server,
                failure(503, "federation is disabled on this server"),
            );
        }
        return answers;
    };
    let mut pending = BTreeSet::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (server, users) in by_server {
        if ruma::ServerName::parse(&server).is_err() {
            failures.insert(server, failure(400, "not a valid server name"));
            continue;
        }
        pending.insert(server.clone());
        let call = ask(fed.clone(), server.clone(), users);
        tasks.spawn(async move { (server, call.await) });
    }
    let deadline = tokio::time::Instant::now() + timeout;
    while !pending.is_empty() {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(Some(Ok((server, result)))) => {
                pending.remove(&server);
                match result {
                    Ok(answer) => answers.push((server, answer)),
                    Err(e) => {
                        tracing::debug!(%server, error = %e, "remote key request failed");
                        failures.insert(server, spindle_federation::e2ee::failure(&e));
                    }
                }
            }
            // A task that panicked: its server is still pending and listed below.
            Ok(Some(Err(_))) => continue,
            Ok(None) | Err(_) => break,
        }
    }
    // Dropping the set cancels the requests still running.
    for server in pending {
        let message = format!("no answer within {} ms", timeout.as_millis());
        failures.insert(server, failure(503, message));
    }
    answers
}

/// A key object with the uploaded signatures `viewer` may see merged in
/// ([`spindle_projections::device_keys::DeviceKeys::with_signatures`]).
fn with_signatures(s: &AppState, user_id: &str, key_id: &str, viewer: &str, v: Value) -> Value {
    s.projections
        .device_keys
        .with_signatures(user_id, key_id, Some(viewer), v)
}

/// The device keys of one local user as `/keys/query` shows them to `viewer`: each
/// device's signed keys (with uploaded signatures merged in) plus
/// `unsigned.device_display_name`. `devices` empty means all.
pub fn query_user_devices(
    s: &AppState,
    viewer: &str,
    user_id: &str,
    devices: &[String],
) -> Map<String, Value> {
    let all = if devices.is_empty() {
        s.projections.device_keys.device_keys(user_id)
    } else {
        devices
            .iter()
            .filter_map(|d| Some((d.clone(), s.projections.device_keys.device_key(user_id, d)?)))
            .collect()
    };
    all.into_iter()
        .map(|(device_id, mut keys)| {
            let name = s
                .projections
                .accounts
                .device(user_id, &device_id)
                .and_then(|d| d.display_name);
            if let (Some(name), Some(m)) = (name, keys.as_object_mut()) {
                m.insert("unsigned".into(), json!({ "device_display_name": name }));
            }
            let keys = with_signatures(s, user_id, &device_id, viewer, keys);
            (device_id, keys)
        })
        .collect()
}

/// `POST /_matrix/client/v3/keys/query`: the device keys of the named users (all
/// devices when the list is empty), their master and self-signing keys, and the
/// requester's own user-signing key. Users of other servers are asked of their server
/// (`user/keys/query`, see the module doc); a server that cannot answer within
/// `timeout` ms (default 10,000) is under `failures`. An unknown local user gets an
/// empty device map.
async fn query(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let wanted = object(
        body.get("device_keys")
            .ok_or_else(|| MatrixError::bad_json("device_keys is required"))?,
        "device_keys",
    )?;
    if wanted.len() > MAX_USERS_PER_REQUEST {
        return Err(MatrixError::invalid_param(format!(
            "at most {MAX_USERS_PER_REQUEST} users per query"
        )));
    }
    let timeout = remote_timeout(&body)?;
    let mut device_keys = Map::new();
    let mut failures = Map::new();
    let (mut master_keys, mut self_signing_keys, mut user_signing_keys) =
        (Map::new(), Map::new(), Map::new());
    let mut remote: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    let mut untracked: Vec<String> = Vec::new();
    for (user_id, devices) in wanted {
        let devices: Vec<String> = match devices {
            Value::Array(a) => a
                .iter()
                .map(|d| {
                    d.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| MatrixError::bad_json("device ids must be strings"))
                })
                .collect::<ApiResult<_>>()?,
            Value::Null => vec![],
            _ => return Err(MatrixError::bad_json("device_keys values must be lists")),
        };
        let Some(server) = server_of(user_id) else {
            return Err(MatrixError::invalid_param(format!(
                "{user_id:?} is not a user id"
            )));
        };
        if server != s.server_name() {
            // Our copy of their device list when it is fresh; else their server.
            if let Some(list) = s.projections.device_keys.remote_device_list(user_id) {
                let mut theirs = Map::new();
                for d in list.devices {
                    let Some(mut keys) = d.keys else { continue };
                    if !devices.is_empty() && !devices.contains(&d.device_id) {
                        continue;
                    }
                    if let (Some(name), Some(obj)) = (d.display_name, keys.as_object_mut()) {
                        let unsigned = obj.entry("unsigned").or_insert_with(|| json!({}));
                        if let Some(u) = unsigned.as_object_mut() {
                            u.insert("device_display_name".into(), Value::String(name));
                        }
                    }
                    theirs.insert(d.device_id, keys);
                }
                device_keys.insert(user_id.clone(), Value::Object(theirs));
                if let Some(master) = list.master_key {
                    // With the asker's own signature on it, if they uploaded one here
                    // (their user-signing key verifying this remote user).
                    let public = spindle_core::e2ee::cross_signing_public_key(&master)
                        .map(|(_, p)| p)
                        .unwrap_or_default();
                    master_keys.insert(
                        user_id.clone(),
                        with_signatures(&s, user_id, &public, &r.user_id, master),
                    );
                }
                if let Some(ssk) = list.self_signing_key {
                    self_signing_keys.insert(user_id.clone(), ssk);
                }
                continue;
            }
            untracked.push(user_id.clone());
            remote
                .entry(server.to_owned())
                .or_default()
                .insert(user_id.clone(), json!(devices));
            continue;
        }
        device_keys.insert(
            user_id.clone(),
            Value::Object(query_user_devices(&s, &r.user_id, user_id, &devices)),
        );
        let cs = s.projections.device_keys.cross_signing_keys(user_id);
        if let Some(master) = cs.master {
            let public = spindle_core::e2ee::cross_signing_public_key(&master)
                .map(|(_, p)| p)
                .unwrap_or_default();
            master_keys.insert(
                user_id.clone(),
                with_signatures(&s, user_id, &public, &r.user_id, master),
            );
        }
        if let Some(ssk) = cs.self_signing {
            self_signing_keys.insert(user_id.clone(), ssk);
        }
        // The user-signing key is only ever shown to its owner.
        if let Some(usk) = cs.user_signing.filter(|_| *user_id == r.user_id) {
            user_signing_keys.insert(user_id.clone(), usk);
        }
    }
    // Users we share a room with but hold no fresh copy of: fetch their lists in the
    // background, so the next query is answered here.
    if let Some(fed) = &s.federation {
        spindle_federation::devices::refresh_untracked(fed, &untracked);
    }
    let answers = ask_servers(
        &s,
        remote,
        timeout,
        &mut failures,
        |fed, server, users| async move {
            spindle_federation::e2ee::query_remote(&fed, &server, users).await
        },
    )
    .await;
    for (_, answer) in answers {
        device_keys.extend(answer.device_keys);
        // With the asker's own signatures on them (kept here, as Synapse does).
        master_keys.extend(answer.master_keys.into_iter().map(|(user, master)| {
            let public = spindle_core::e2ee::cross_signing_public_key(&master)
                .map(|(_, p)| p)
                .unwrap_or_default();
            let merged = with_signatures(&s, &user, &public, &r.user_id, master);
            (user, merged)
        }));
        self_signing_keys.extend(answer.self_signing_keys);
    }
    Ok(Json(json!({
        "device_keys": device_keys,
        "failures": failures,
        "master_keys": master_keys,
        "self_signing_keys": self_signing_keys,
        "user_signing_keys": user_signing_keys,
    })))
}

/// `POST /_matrix/client/v3/keys/claim`: one key per (user, device, algorithm): an
/// unclaimed one-time key, or the device's fallback key when none is left. The journal
/// picks the keys when it appends the claim, so concurrent claims never share a key.
/// Keys of other servers' users are claimed from their server (`user/keys/claim`),
/// at the same time; a server that cannot answer within `timeout` ms (default 10,000)
/// is under `failures`.
async fn claim(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let wanted = object(
        body.get("one_time_keys")
            .ok_or_else(|| MatrixError::bad_json("one_time_keys is required"))?,
        "one_time_keys",
    )?;
    let timeout = remote_timeout(&body)?;
    let mut requests = Vec::new();
    let mut failures = Map::new();
    let mut remote: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    let mut remote_devices = 0;
    for (user_id, devices) in wanted {
        let devices = object(devices, "one_time_keys values")?;
        let Some(server) = server_of(user_id) else {
            return Err(MatrixError::invalid_param(format!(
                "{user_id:?} is not a user id"
            )));
        };
        if devices.values().any(|a| !a.is_string()) {
            return Err(MatrixError::bad_json("algorithms must be strings"));
        }
        if server != s.server_name() {
            remote_devices += devices.len();
            remote
                .entry(server.to_owned())
                .or_default()
                .insert(user_id.clone(), Value::Object(devices.clone()));
            continue;
        }
        for (device_id, algorithm) in devices {
            let algorithm = algorithm.as_str().unwrap_or_default();
            requests.push(KeyClaimRequest {
                user_id: user_id.clone(),
                device_id: device_id.clone(),
                algorithm: algorithm.to_owned(),
            });
        }
    }
    if requests.len() + remote_devices > MAX_KEYS_PER_REQUEST {
        return Err(MatrixError::invalid_param(format!(
            "at most {MAX_KEYS_PER_REQUEST} devices per claim"
        )));
    }
    let mut one_time_keys: BTreeMap<String, BTreeMap<String, Map<String, Value>>> = BTreeMap::new();
    // Remote servers are asked while the journal decides the local claim.
    let remote_claims = ask_servers(
        &s,
        remote,
        timeout,
        &mut failures,
        |fed, server, users| async move {
            spindle_federation::e2ee::claim_remote(&fed, &server, users).await
        },
    );
    let local_claim = async {
        if requests.is_empty() {
            return Ok(None);
        }
        s.submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::ClaimOneTimeKeys { requests },
        )
        .await
        .map(Some)
    };
    let (answers, outcome) = tokio::join!(remote_claims, local_claim);
    if let Some(outcome) = outcome? {
        for c in outcome.claimed {
            one_time_keys
                .entry(c.claim.user_id)
                .or_default()
                .entry(c.claim.device_id)
                .or_default()
                .insert(c.claim.key_id, c.key);
        }
    }
    for (_, claimed) in answers {
        for (user_id, devices) in claimed {
            let Value::Object(devices) = devices else {
                continue;
            };
            let mine = one_time_keys.entry(user_id).or_default();
            for (device_id, keys) in devices {
                if let Value::Object(keys) = keys {
                    mine.insert(device_id, keys);
                }
            }
        }
    }
    Ok(Json(
        json!({ "one_time_keys": one_time_keys, "failures": failures }),
    ))
}

/// The joined rooms of a user (from the membership projection).
pub fn joined_rooms(s: &AppState, user_id: &str) -> Vec<String> {
    s.projections
        .membership
        .rooms_of(user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(room, _)| room)
        .collect()
}

/// `GET /_matrix/client/v3/keys/changes?from=&to=`: users whose device lists changed
/// between two sync tokens, among those who share a room with the requester, and
/// those who no longer share one.
async fn changes(State(s): State<AppState>, r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let from = q
        .get("from")
        .ok_or_else(|| MatrixError::missing_param("from is required"))?;
    let to = q
        .get("to")
        .ok_or_else(|| MatrixError::missing_param("to is required"))?;
    let from = crate::sync::parse_since(from)?.0;
    let to = crate::sync::parse_since(to)?
        .0
        .min(s.projections.runtime.applied());
    let rooms = spindle_projections::change_index::SortedKeys::new(joined_rooms(&s, &r.user_id));
    let c = s
        .projections
        .device_keys
        .changes(&r.user_id, &rooms, from, to);
    Ok(Json(json!({ "changed": c.changed, "left": c.left })))
}
