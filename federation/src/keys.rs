//! Server keys (spec: server-server API, "Retrieving server keys"): our persistent
//! ed25519 key, `GET /_matrix/key/v2/server`, the notary endpoints
//! (`/_matrix/key/v2/query`, GET and POST), and the cache of other servers' keys.
//!
//! A remote server's keys are fetched from the server itself first, then from the
//! configured notaries (`federation.trusted_key_servers`); a response counts only if it
//! is signed by the keys it lists (and, through a notary, by the notary too). Keys are
//! cached until their `valid_until_ts` (at most 7 days; at least 5 minutes), in a map
//! bounded by [`KEY_CACHE_MAX`].

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::Arc,
};

use axum::{
    Json,
    extract::{Path as UrlPath, State},
};
use base64::Engine as _;
use spindle_core::keys::ServerKey;

use crate::{FedState, client::FederationClient, error::FedError, now_ms};

/// How long other servers may cache our key response: 7 days, in milliseconds.
pub const KEY_VALIDITY_MS: u64 = 7 * 24 * 3600 * 1000;

/// Most remote servers whose keys are kept in memory.
pub const KEY_CACHE_MAX: usize = 10_000;

/// Loads the signing key from `<data>/signing.key`, creating it on first start.
///
/// File format (one line): `ed25519 <version> <unpadded base64 of the PKCS#8 document>`,
/// the same shape Synapse uses. Errors if the file exists but cannot be parsed.
pub fn load_or_create_key(data_dir: &Path, server_name: &str) -> Result<ServerKey, String> {
    let path = data_dir.join("signing.key");
    if path.exists() {
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut parts = text.split_whitespace();
        let (Some("ed25519"), Some(version), Some(b64)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!(
                "{}: expected `ed25519 <version> <base64>`",
                path.display()
            ));
        };
        let doc = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(b64.trim_end_matches('='))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        return ServerKey::from_pkcs8(server_name, version, &doc).map_err(|e| e.to_string());
    }
    std::fs::create_dir_all(data_dir).map_err(|e| e.to_string())?;
    let key = ServerKey::generate(server_name);
    let line = format!(
        "ed25519 {} {}\n",
        key.version(),
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(key.pkcs8())
    );
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, line).map_err(|e| e.to_string())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600));
    }
    std::fs::rename(&tmp, &path).map_err(|e| e.to_string())?;
    Ok(key)
}

/// The signed key response (spec: `ServerKeys` schema): `server_name`, `verify_keys`,
/// `old_verify_keys`, `valid_until_ts`, `signatures`.
pub fn server_keys_response(key: &ServerKey) -> serde_json::Value {
    let body = serde_json::json!({
        "server_name": key.server_name(),
        "verify_keys": { key.key_id(): { "key": key.public_key_base64() } },
        "old_verify_keys": {},
        "valid_until_ts": now_ms() + KEY_VALIDITY_MS,
    });
    let mut obj = spindle_core::canonical::to_object(body).expect("key response is canonical");
    key.sign_json(&mut obj).expect("key response signs");
    serde_json::to_value(obj).expect("object")
}

/// `GET /_matrix/key/v2/server` (and the deprecated `/{keyId}` form).
pub(crate) async fn keys(State(st): State<FedState>) -> Json<serde_json::Value> {
    Json(server_keys_response(&st.key))
}

/// One server's cached keys.
#[derive(Debug, Clone)]
struct Cached {
    /// key id -> unpadded base64 public key (current and old keys).
    keys: BTreeMap<String, String>,
    /// The signed response as received (served again as a notary).
    response: serde_json::Value,
    /// When to fetch again, ms since the Unix epoch.
    valid_until_ts: u64,
}

/// Remote server keys, fetched on demand and cached.
#[derive(Clone)]
pub struct KeyCache {
    own: Arc<ServerKey>,
    client: FederationClient,
    notaries: Arc<Vec<String>>,
    cache: Arc<parking_lot::Mutex<HashMap<String, Cached>>>,
    /// Fetches served from the network (counting tests).
    pub fetches: Arc<std::sync::atomic::AtomicU64>,
}

/// Checks a key response: it is about `server`, signed by a key it lists, and the
/// keys are well-formed. Returns its keys and validity.
fn check_key_response(server: &str, resp: &serde_json::Value) -> Result<Cached, String> {
    if resp.get("server_name").and_then(|v| v.as_str()) != Some(server) {
        return Err(format!("key response is not about {server}"));
    }
    let mut keys = BTreeMap::new();
    for field in ["verify_keys", "old_verify_keys"] {
        if let Some(map) = resp.get(field).and_then(|v| v.as_object()) {
            for (id, v) in map {
                if let Some(k) = v.get("key").and_then(|k| k.as_str()) {
                    keys.insert(id.clone(), k.to_owned());
                }
            }
        }
    }
    let mut current = ruma::signatures::PublicKeySet::new();
    for (id, v) in resp
        .get("verify_keys")
        .and_then(|v| v.as_object())
        .into_iter()
        .flatten()
    {
        if let Some(k) = v.get("key").and_then(|k| k.as_str())
            && let Ok(b) = ruma::serde::Base64::parse(k)
        {
            current.insert(id.clone(), b);
        }
    }
    if current.is_empty() {
        return Err(format!("{server} lists no verify key"));
    }
    let mut map = ruma::signatures::PublicKeyMap::new();
    map.insert(server.to_owned(), current);
    let obj = spindle_core::canonical::to_object(resp.clone()).map_err(|e| e.to_string())?;
    ruma::signatures::verify_json(&map, &obj)
        .map_err(|e| format!("{server}'s key response is not self-signed: {e}"))?;
    let valid_until_ts = resp
        .get("valid_until_ts")
        .and_then(|v| v.as_u64())
        .unwrap_or(0)
        .clamp(now_ms() + 5 * 60 * 1000, now_ms() + KEY_VALIDITY_MS);
    Ok(Cached {
        keys,
        response: resp.clone(),
        valid_until_ts,
    })
}

impl KeyCache {
    /// A cache that fetches through `client`, falling back to `notaries`.
    pub fn new(own: Arc<ServerKey>, client: FederationClient, notaries: Vec<String>) -> KeyCache {
        KeyCache {
            own,
            client,
            notaries: Arc::new(notaries),
            cache: Arc::default(),
            fetches: Arc::default(),
        }
    }

    /// The keys of `server` (key id -> unpadded base64), fetched if not cached or
    /// expired. Our own server answers from our key without a request.
    pub async fn keys_of(&self, server: &str) -> Result<BTreeMap<String, String>, FedError> {
        if server == self.own.server_name() {
            return Ok(BTreeMap::from([(
                self.own.key_id(),
                self.own.public_key_base64(),
            )]));
        }
        if let Some(c) = self.cache.lock().get(server)
            && c.valid_until_ts > now_ms()
        {
            return Ok(c.keys.clone());
        }
        let cached = self.fetch(server).await?;
        let keys = cached.keys.clone();
        let mut cache = self.cache.lock();
        if cache.len() >= KEY_CACHE_MAX {
            let now = now_ms();
            cache.retain(|_, c| c.valid_until_ts > now);
            if cache.len() >= KEY_CACHE_MAX {
                cache.clear();
            }
        }
        cache.insert(server.to_owned(), cached);
        Ok(keys)
    }

    /// Remembers `server`'s keys (key id -> unpadded base64) without fetching them, for
    /// `valid_for_ms`: keys known out of band (tests federating with in-process
    /// servers; a peer an operator pins).
    pub fn pin(&self, server: &str, keys: BTreeMap<String, String>, valid_for_ms: u64) {
        self.cache.lock().insert(
            server.to_owned(),
            Cached {
                keys,
                response: serde_json::Value::Null,
                valid_until_ts: now_ms() + valid_for_ms,
            },
        );
    }

    /// The signed key response of `server` as a notary serves it (cached or fetched).
    pub async fn response_of(&self, server: &str) -> Option<serde_json::Value> {
        if server == self.own.server_name() {
            return Some(server_keys_response(&self.own));
        }
        self.keys_of(server).await.ok()?;
        self.cache
            .lock()
            .get(server)
            .map(|c| c.response.clone())
            .filter(|r| !r.is_null())
    }

    async fn fetch(&self, server: &str) -> Result<Cached, FedError> {
        self.fetches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let direct = match self
            .client
            .get_unsigned(server, "/_matrix/key/v2/server")
            .await
        {
            Ok(resp) => check_key_response(server, &resp),
            Err(e) => Err(e.to_string()),
        };
        let direct_err = match direct {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        for notary in self.notaries.iter() {
            let path = format!("/_matrix/key/v2/query/{server}");
            let Ok(resp) = self.client.get_unsigned(notary, &path).await else {
                continue;
            };
            let notary_keys = match Box::pin(self.keys_of(notary)).await {
                Ok(k) => k,
                Err(_) => continue,
            };
            for r in resp
                .get("server_keys")
                .and_then(|v| v.as_array())
                .into_iter()
                .flatten()
            {
                let Ok(c) = check_key_response(server, r) else {
                    continue;
                };
                // The notary must have signed what it serves.
                let mut map = ruma::signatures::PublicKeyMap::new();
                map.insert(
                    notary.clone(),
                    notary_keys
                        .iter()
                        .filter_map(|(id, k)| {
                            ruma::serde::Base64::parse(k).ok().map(|b| (id.clone(), b))
                        })
                        .collect(),
                );
                let Ok(obj) = spindle_core::canonical::to_object(r.clone()) else {
                    continue;
                };
                let signed_by_notary = obj
                    .get("signatures")
                    .and_then(|s| s.as_object())
                    .is_some_and(|s| s.contains_key(notary.as_str()));
                if signed_by_notary && verify_entity(&map, &obj, notary) {
                    return Ok(c);
                }
            }
        }
        Err(FedError::unauthorized(format!(
            "could not get the signing keys of {server}: {direct_err}"
        )))
    }
}

/// Verifies only `entity`'s signature on `obj` (other signatures are not checked).
fn verify_entity(
    map: &ruma::signatures::PublicKeyMap,
    obj: &ruma::CanonicalJsonObject,
    entity: &str,
) -> bool {
    let mut only = obj.clone();
    if let Some(ruma::CanonicalJsonValue::Object(sigs)) = only.get_mut("signatures") {
        sigs.retain(|k, _| k == entity);
    }
    ruma::signatures::verify_json(map, &only).is_ok()
}

/// `GET /_matrix/key/v2/query/{serverName}`: a server's keys, signed by us as notary.
pub(crate) async fn query_one(
    State(st): State<FedState>,
    UrlPath(server): UrlPath<String>,
) -> Json<serde_json::Value> {
    let keys: Vec<serde_json::Value> = match st.keys.response_of(&server).await {
        Some(r) => vec![notarize(&st.key, r)],
        None => vec![],
    };
    Json(serde_json::json!({ "server_keys": keys }))
}

/// `POST /_matrix/key/v2/query`: keys of several servers (`server_keys: {server:
/// {key_id: criteria}}`), signed by us as notary. At most 100 servers per request.
pub(crate) async fn query_many(
    State(st): State<FedState>,
    Json(body): Json<serde_json::Value>,
) -> Result<Json<serde_json::Value>, FedError> {
    let Some(servers) = body.get("server_keys").and_then(|v| v.as_object()) else {
        return Err(FedError::bad_json("server_keys must be an object"));
    };
    if servers.len() > 100 {
        return Err(FedError::bad_json("at most 100 servers per request"));
    }
    let mut out = Vec::new();
    for server in servers.keys() {
        if let Some(r) = st.keys.response_of(server).await {
            out.push(notarize(&st.key, r));
        }
    }
    Ok(Json(serde_json::json!({ "server_keys": out })))
}

/// Adds our signature to a key response we serve as notary.
fn notarize(key: &ServerKey, resp: serde_json::Value) -> serde_json::Value {
    let Ok(mut obj) = spindle_core::canonical::to_object(resp.clone()) else {
        return resp;
    };
    if key.sign_json(&mut obj).is_err() {
        return resp;
    }
    serde_json::to_value(obj).unwrap_or(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_persists_and_response_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create_key(dir.path(), "example.org").unwrap();
        let b = load_or_create_key(dir.path(), "example.org").unwrap();
        assert_eq!(a.public_key_base64(), b.public_key_base64());
        assert_eq!(a.key_id(), b.key_id());
        let resp = server_keys_response(&b);
        assert_eq!(resp["server_name"], "example.org");
        assert_eq!(
            resp["verify_keys"][a.key_id()]["key"],
            a.public_key_base64()
        );
        let cached = check_key_response("example.org", &resp).unwrap();
        assert_eq!(
            cached.keys.get(&a.key_id()).unwrap(),
            &a.public_key_base64()
        );
        // Another server's response, or a tampered one, does not count.
        assert!(check_key_response("other.org", &resp).is_err());
        let mut tampered = resp.clone();
        tampered["valid_until_ts"] = serde_json::json!(1);
        assert!(check_key_response("example.org", &tampered).is_err());
    }
}
