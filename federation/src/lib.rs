//! Server-Server API. What is real so far: the server's persistent ed25519 signing
//! key and the key server endpoint `GET /_matrix/key/v2/server` (spec: server-server
//! API, "Publishing Keys").

use std::{path::Path, sync::Arc};

use axum::{Json, Router, extract::State, routing::get};
use base64::Engine as _;
use spindle_core::keys::ServerKey;

/// How long other servers may cache our key response: 7 days, in milliseconds.
pub const KEY_VALIDITY_MS: u64 = 7 * 24 * 3600 * 1000;

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

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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

/// Routes of the federation surface served so far.
pub fn router(key: Arc<ServerKey>) -> Router {
    Router::new()
        .route("/_matrix/key/v2/server", get(keys))
        .route("/_matrix/key/v2/server/{key_id}", get(keys_by_id))
        .with_state(key)
}

async fn keys(State(key): State<Arc<ServerKey>>) -> Json<serde_json::Value> {
    Json(server_keys_response(&key))
}

async fn keys_by_id(State(key): State<Arc<ServerKey>>) -> Json<serde_json::Value> {
    // The key id path segment is deprecated; the response is the same.
    Json(server_keys_response(&key))
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
        let obj = spindle_core::canonical::to_object(resp).unwrap();
        ruma::signatures::verify_json(&a.public_key_map(), &obj).unwrap();
    }
}
