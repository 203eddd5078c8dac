//! End-to-end encryption over federation (spec: server-server API, "End-to-End
//! Encryption" and "Device Management"): the three endpoints other servers ask about
//! our users' keys, and the calls that ask another server about its users'.
//!
//! Served, from the `device_keys` and `accounts` projections only:
//! - `POST /_matrix/federation/v1/user/keys/query`: device keys (with their owner's
//!   uploaded signatures and, when `[federation] allow_device_name_lookup_over_federation`
//!   is on, `unsigned.device_display_name`), master and self-signing
//!   keys. Never user-signing keys: they are their owner's alone.
//! - `POST /_matrix/federation/v1/user/keys/claim`: one key per (user, device,
//!   algorithm), through the journal exactly as the Client-Server claim
//!   ([`CommandBody::ClaimOneTimeKeys`], principal: the asking server): the journal
//!   picks the keys when it appends the claim, so a key is handed out at most once
//!   whoever asks, and a device without one-time keys left hands out its fallback key.
//! - `GET /_matrix/federation/v1/user/devices/{userId}`: the user's devices with keys,
//!   their cross-signing keys, and `stream_id`, the journal position of the user's
//!   latest device change
//!   ([`spindle_projections::device_keys::DeviceKeys::device_list_stream_id`]), the
//!   number an `m.device_list_update` EDU for that change carries.
//!
//! Users of other servers in a request are ignored (each server answers for its own).
//! Asked of others ([`query_remote`], [`claim_remote`]): one signed request per server,
//! and an answer keeps only that server's own users.

use axum::{
    Json,
    extract::{Path, State},
};
use serde_json::{Map, Value, json};
use spindle_journal::{CommandBody, KeyClaimRequest};

use crate::{FedState, auth::Signed, client::ClientError, error::FedError, error::FedResult};

/// Most users one inbound `user/keys/query`, and most devices one inbound
/// `user/keys/claim`, may name (more: 400 `M_INVALID_PARAM`). Above the Client-Server
/// limit of 1000, because a server asks for all its clients' users of ours at once.
pub const MAX_FEDERATION_KEY_ENTRIES: usize = 10_000;

/// Whether `user_id` is a user id of `server` (`@localpart:server`).
fn is_user_of(user_id: &str, server: &str) -> bool {
    user_id
        .strip_prefix('@')
        .and_then(|u| u.split_once(':'))
        .is_some_and(|(local, s)| !local.is_empty() && s == server)
}

fn required_object<'a>(body: &'a Option<Value>, field: &str) -> FedResult<&'a Map<String, Value>> {
    body.as_ref()
        .and_then(|b| b.get(field))
        .and_then(|v| v.as_object())
        .ok_or_else(|| FedError::bad_json(format!("{field} must be an object")))
}

/// One local device's keys as other servers see them: the signed `DeviceKeys` with
/// the owner's uploaded signatures merged in, and the display name (if any, and only
/// with `[federation] allow_device_name_lookup_over_federation`) under
/// `unsigned.device_display_name`.
fn device_view(st: &FedState, user_id: &str, device_id: &str, keys: Value) -> Value {
    let mut keys = st
        .projections
        .device_keys
        .with_signatures(user_id, device_id, None, keys);
    if !st.config.allow_device_name_lookup_over_federation {
        return keys;
    }
    let name = st
        .projections
        .accounts
        .device(user_id, device_id)
        .and_then(|d| d.display_name);
    if let (Some(name), Some(m)) = (name, keys.as_object_mut()) {
        m.insert("unsigned".into(), json!({ "device_display_name": name }));
    }
    keys
}

/// A local user's master key (with the owner's signatures on it) and self-signing key.
fn cross_signing(st: &FedState, user_id: &str) -> (Option<Value>, Option<Value>) {
    let cs = st.projections.device_keys.cross_signing_keys(user_id);
    let master = cs.master.map(|m| {
        let public = spindle_core::e2ee::cross_signing_public_key(&m)
            .map(|(_, p)| p)
            .unwrap_or_default();
        st.projections
            .device_keys
            .with_signatures(user_id, &public, None, m)
    });
    (master, cs.self_signing)
}

/// `POST /_matrix/federation/v1/user/keys/query`: `{device_keys: {user: [device]}}`
/// (an empty list: every device) answered with `device_keys`, `master_keys` and
/// `self_signing_keys` of our users. Other servers' users are left out; an unknown
/// local user gets an empty device map. 400 `M_BAD_JSON` for a malformed body,
/// `M_INVALID_PARAM` beyond [`MAX_FEDERATION_KEY_ENTRIES`] users.
pub(crate) async fn query_keys(
    State(st): State<FedState>,
    signed: Signed,
) -> FedResult<Json<Value>> {
    let wanted = required_object(&signed.body, "device_keys")?;
    if wanted.len() > MAX_FEDERATION_KEY_ENTRIES {
        return Err(FedError::invalid_param(format!(
            "at most {MAX_FEDERATION_KEY_ENTRIES} users per query"
        )));
    }
    let (mut device_keys, mut master_keys, mut self_signing_keys) =
        (Map::new(), Map::new(), Map::new());
    for (user_id, devices) in wanted {
        let devices: Vec<&str> = match devices {
            Value::Array(a) => a
                .iter()
                .map(|d| {
                    d.as_str()
                        .ok_or_else(|| FedError::bad_json("device ids must be strings"))
                })
                .collect::<FedResult<_>>()?,
            Value::Null => Vec::new(),
            _ => return Err(FedError::bad_json("device_keys values must be lists")),
        };
        if !is_user_of(user_id, st.server_name()) {
            continue;
        }
        let dk = &st.projections.device_keys;
        let found: Vec<(String, Value)> = if devices.is_empty() {
            dk.device_keys(user_id)
        } else {
            devices
                .iter()
                .filter_map(|d| Some((d.to_string(), dk.device_key(user_id, d)?)))
                .collect()
        };
        let mine: Map<String, Value> = found
            .into_iter()
            .map(|(d, keys)| {
                let v = device_view(&st, user_id, &d, keys);
                (d, v)
            })
            .collect();
        device_keys.insert(user_id.clone(), Value::Object(mine));
        let (master, ssk) = cross_signing(&st, user_id);
        if let Some(m) = master {
            master_keys.insert(user_id.clone(), m);
        }
        if let Some(s) = ssk {
            self_signing_keys.insert(user_id.clone(), s);
        }
    }
    Ok(Json(json!({
        "device_keys": device_keys,
        "master_keys": master_keys,
        "self_signing_keys": self_signing_keys,
    })))
}

/// `POST /_matrix/federation/v1/user/keys/claim`: `{one_time_keys: {user: {device:
/// algorithm}}}` answered with `{one_time_keys: {user: {device: {"<alg>:<id>": key}}}}`
/// for our users' devices that have a key of that algorithm (a one-time key, else the
/// fallback key). The journal decides the claim (see the module doc); the answer is
/// sent once the claim is durable. 400 `M_BAD_JSON` for a malformed body,
/// `M_INVALID_PARAM` beyond [`MAX_FEDERATION_KEY_ENTRIES`] devices.
pub(crate) async fn claim_keys(
    State(st): State<FedState>,
    signed: Signed,
) -> FedResult<Json<Value>> {
    let wanted = required_object(&signed.body, "one_time_keys")?;
    let mut requests = Vec::new();
    for (user_id, devices) in wanted {
        let devices = devices
            .as_object()
            .ok_or_else(|| FedError::bad_json("one_time_keys values must be objects"))?;
        for (device_id, algorithm) in devices {
            let algorithm = algorithm
                .as_str()
                .ok_or_else(|| FedError::bad_json("algorithms must be strings"))?;
            if is_user_of(user_id, st.server_name()) {
                requests.push(KeyClaimRequest {
                    user_id: user_id.clone(),
                    device_id: device_id.clone(),
                    algorithm: algorithm.to_owned(),
                });
            }
        }
        if requests.len() > MAX_FEDERATION_KEY_ENTRIES {
            return Err(FedError::invalid_param(format!(
                "at most {MAX_FEDERATION_KEY_ENTRIES} devices per claim"
            )));
        }
    }
    let mut one_time_keys: Map<String, Value> = Map::new();
    if !requests.is_empty() {
        let outcome = st
            .submit(&signed.origin, CommandBody::ClaimOneTimeKeys { requests })
            .await?;
        for c in outcome.claimed {
            let by_user = one_time_keys
                .entry(c.claim.user_id)
                .or_insert_with(|| json!({}));
            if let Some(by_device) = by_user
                .as_object_mut()
                .map(|u| u.entry(c.claim.device_id).or_insert_with(|| json!({})))
                && let Some(keys) = by_device.as_object_mut()
            {
                keys.insert(c.claim.key_id, c.key);
            }
        }
    }
    Ok(Json(json!({ "one_time_keys": one_time_keys })))
}

/// `GET /_matrix/federation/v1/user/devices/{userId}`: `{user_id, stream_id, devices:
/// [{device_id, keys, device_display_name?}], master_key?, self_signing_key?}` for one
/// of our users. Devices that never uploaded keys are not listed (`keys` is required).
/// 400 `M_INVALID_PARAM` for a user of another server (or not a user id), 404
/// `M_NOT_FOUND` for a local user that does not exist.
pub(crate) async fn user_devices(
    State(st): State<FedState>,
    Path(user_id): Path<String>,
    _signed: Signed,
) -> FedResult<Json<Value>> {
    if !is_user_of(&user_id, st.server_name()) {
        return Err(FedError::invalid_param("that user is not on this server"));
    }
    if st.projections.accounts.user(&user_id).is_none() {
        return Err(FedError::not_found("no such user"));
    }
    let stream_id = st.projections.device_keys.device_list_stream_id(&user_id);
    let devices: Vec<Value> = st
        .projections
        .device_keys
        .device_keys(&user_id)
        .into_iter()
        .map(|(device_id, keys)| {
            let mut keys = device_view(&st, &user_id, &device_id, keys);
            let name = keys
                .as_object_mut()
                .and_then(|m| m.remove("unsigned"))
                .and_then(|u| u.get("device_display_name").cloned());
            let mut d = json!({ "device_id": device_id, "keys": keys });
            if let Some(name) = name {
                d["device_display_name"] = name;
            }
            d
        })
        .collect();
    let mut out = json!({ "user_id": user_id, "stream_id": stream_id, "devices": devices });
    let (master, ssk) = cross_signing(&st, &user_id);
    if let Some(m) = master {
        out["master_key"] = m;
    }
    if let Some(s) = ssk {
        out["self_signing_key"] = s;
    }
    Ok(Json(out))
}

/// Keeps, in each of `fields` of a remote answer, only the entries for users of
/// `server` whose value is an object: a server answers for its own users only.
/// Returns the kept maps, by field, in `fields`' order.
fn own_users(answer: &Value, server: &str, fields: &[&str]) -> Vec<Map<String, Value>> {
    fields
        .iter()
        .map(|f| {
            answer
                .get(*f)
                .and_then(|v| v.as_object())
                .map(|m| {
                    m.iter()
                        .filter(|(u, v)| is_user_of(u, server) && v.is_object())
                        .map(|(u, v)| (u.clone(), v.clone()))
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect()
}

/// What [`query_remote`] brought back: each map keyed by user id, all of them users of
/// the server asked.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RemoteKeys {
    /// User id -> device id -> `DeviceKeys`.
    pub device_keys: Map<String, Value>,
    /// User id -> master key.
    pub master_keys: Map<String, Value>,
    /// User id -> self-signing key.
    pub self_signing_keys: Map<String, Value>,
}

/// Asks `server` for its users' device keys (`POST user/keys/query`; `device_keys` is
/// `{user: [device]}`, users of `server`). Entries the answer holds for users of other
/// servers are dropped.
pub async fn query_remote(
    st: &FedState,
    server: &str,
    device_keys: Map<String, Value>,
) -> Result<RemoteKeys, ClientError> {
    let answer = st
        .client
        .request(
            reqwest::Method::POST,
            server,
            "/_matrix/federation/v1/user/keys/query",
            Some(&json!({ "device_keys": device_keys })),
        )
        .await?;
    let mut kept = own_users(
        &answer,
        server,
        &["device_keys", "master_keys", "self_signing_keys"],
    )
    .into_iter();
    Ok(RemoteKeys {
        device_keys: kept.next().unwrap_or_default(),
        master_keys: kept.next().unwrap_or_default(),
        self_signing_keys: kept.next().unwrap_or_default(),
    })
}

/// Claims keys of `server`'s users (`POST user/keys/claim`; `one_time_keys` is
/// `{user: {device: algorithm}}`): user id -> device id -> `{"<alg>:<id>": key}`, only
/// for users of `server`.
pub async fn claim_remote(
    st: &FedState,
    server: &str,
    one_time_keys: Map<String, Value>,
) -> Result<Map<String, Value>, ClientError> {
    let answer = st
        .client
        .request(
            reqwest::Method::POST,
            server,
            "/_matrix/federation/v1/user/keys/claim",
            Some(&json!({ "one_time_keys": one_time_keys })),
        )
        .await?;
    Ok(own_users(&answer, server, &["one_time_keys"])
        .pop()
        .unwrap_or_default())
}

/// The `failures` entry of the Client-Server `/keys/query` and `/keys/claim` for a
/// server that could not be asked (Synapse's shape): `{"status": <HTTP status>,
/// "message": ...}`, with the remote's own status when it answered an error, 403 when
/// our outbound policy denies it, 503 otherwise.
pub fn failure(e: &ClientError) -> Value {
    let status = match e {
        ClientError::Status { status, .. } => *status,
        ClientError::Denied(..) => 403,
        _ => 503,
    };
    json!({ "status": status, "message": e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_answer_keeps_only_that_servers_users() {
        let answer = json!({
            "device_keys": {
                "@a:b.org": { "D": { "keys": {} } },
                "@evil:c.org": { "D": { "keys": {} } },
                "@bad:b.org": "not an object",
                "b.org": {},
            },
            "master_keys": { "@a:b.org": { "usage": ["master"] }, "@x:b.org.evil": {} },
        });
        let kept = own_users(&answer, "b.org", &["device_keys", "master_keys", "absent"]);
        assert_eq!(
            kept[0].keys().collect::<Vec<_>>(),
            vec!["@a:b.org"],
            "{kept:?}"
        );
        assert_eq!(kept[1].keys().collect::<Vec<_>>(), vec!["@a:b.org"]);
        assert!(kept[2].is_empty());
        assert!(is_user_of("@a:localhost:8008", "localhost:8008"));
        assert!(!is_user_of("@:b.org", "b.org"));
        assert!(!is_user_of("a:b.org", "b.org"));
    }

    #[test]
    fn failures_carry_the_remote_status_or_503() {
        let e = ClientError::Status {
            server: "b.org".into(),
            status: 404,
            body: "{}".into(),
        };
        assert_eq!(failure(&e)["status"], 404);
        let e = ClientError::Transport("b.org".into(), "connection refused".into());
        assert_eq!(
            failure(&e),
            json!({ "status": 503, "message": "request to b.org failed: connection refused" })
        );
        assert_eq!(
            failure(&ClientError::Denied("b.org".into(), "x".into()))["status"],
            403
        );
    }
}
