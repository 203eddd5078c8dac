//! End-to-end encryption key checks (spec: client-server API "End-to-End Encryption"
//! and appendix "Signing JSON"): verifying the ed25519 signatures on device keys,
//! cross-signing keys and signed one-time keys. Pure: the caller supplies the keys.

use base64::Engine;
use ruma::signatures::{to_canonical_json_string_for_signing, verify_canonical_json_bytes};

/// Why a signature check failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    /// The object carries no signature by `signer` with `key_id`.
    #[error("no signature by {0} with {1}")]
    Missing(String, String),
    /// The object, key or signature is malformed (not canonical JSON, bad base64).
    #[error("{0}")]
    Malformed(String),
    /// The signature does not verify.
    #[error("signature by {0} with {1} does not verify")]
    Invalid(String, String),
}

fn unpadded(s: &str) -> Result<Vec<u8>, SignatureError> {
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(s.trim_end_matches('='))
        .map_err(|e| SignatureError::Malformed(format!("bad base64: {e}")))
}

/// Checks that `object` (a JSON object with `signatures`) carries a valid ed25519
/// signature by `signer` (a user id) under `key_id` (`ed25519:<device id or public
/// key>`), made with `public_key` (unpadded base64). `signatures` and `unsigned` are
/// left out of the signed bytes, as the spec says.
pub fn verify_signature(
    object: &serde_json::Value,
    signer: &str,
    key_id: &str,
    public_key: &str,
) -> Result<(), SignatureError> {
    let signature = object
        .get("signatures")
        .and_then(|s| s.get(signer))
        .and_then(|s| s.get(key_id))
        .and_then(|s| s.as_str())
        .ok_or_else(|| SignatureError::Missing(signer.to_owned(), key_id.to_owned()))?;
    let canonical = crate::canonical::to_object(object.clone())
        .map_err(|e| SignatureError::Malformed(e.to_string()))?;
    let bytes = to_canonical_json_string_for_signing(&canonical)
        .map_err(|e| SignatureError::Malformed(e.to_string()))?;
    let algorithm = ruma::SigningKeyAlgorithm::from(key_id.split(':').next().unwrap_or(""));
    verify_canonical_json_bytes(
        &algorithm,
        &unpadded(public_key)?,
        &unpadded(signature)?,
        bytes.as_bytes(),
    )
    .map_err(|_| SignatureError::Invalid(signer.to_owned(), key_id.to_owned()))
}

/// The single public key of a cross-signing key object (`keys` holds exactly one
/// `ed25519:<public key>` entry): (key id, public key).
pub fn cross_signing_public_key(object: &serde_json::Value) -> Option<(String, String)> {
    let keys = object.get("keys")?.as_object()?;
    if keys.len() != 1 {
        return None;
    }
    let (id, key) = keys.iter().next()?;
    Some((id.clone(), key.as_str()?.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ruma::signatures::Ed25519KeyPair;

    fn signed(pair: &Ed25519KeyPair, user: &str, mut v: serde_json::Value) -> serde_json::Value {
        let mut obj = crate::canonical::to_object(v.clone()).unwrap();
        ruma::signatures::sign_json(user, pair, &mut obj).unwrap();
        v["signatures"] = serde_json::to_value(&obj["signatures"]).unwrap();
        v
    }

    #[test]
    fn accepts_a_good_signature_and_refuses_a_tampered_object() {
        let doc = Ed25519KeyPair::generate();
        let pair = Ed25519KeyPair::from_der(&doc, "DEV".into()).unwrap();
        let public = base64::engine::general_purpose::STANDARD_NO_PAD.encode(pair.public_key());
        let v = signed(
            &pair,
            "@a:x",
            serde_json::json!({"user_id": "@a:x", "device_id": "DEV", "keys": {"ed25519:DEV": public}}),
        );
        assert_eq!(verify_signature(&v, "@a:x", "ed25519:DEV", &public), Ok(()));
        // `unsigned` is not signed.
        let mut with_unsigned = v.clone();
        with_unsigned["unsigned"] = serde_json::json!({"device_display_name": "x"});
        assert_eq!(
            verify_signature(&with_unsigned, "@a:x", "ed25519:DEV", &public),
            Ok(())
        );
        let mut tampered = v.clone();
        tampered["device_id"] = "OTHER".into();
        assert_eq!(
            verify_signature(&tampered, "@a:x", "ed25519:DEV", &public),
            Err(SignatureError::Invalid("@a:x".into(), "ed25519:DEV".into()))
        );
        assert_eq!(
            verify_signature(&v, "@b:x", "ed25519:DEV", &public),
            Err(SignatureError::Missing("@b:x".into(), "ed25519:DEV".into()))
        );
    }
}
