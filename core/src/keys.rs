//! The server's ed25519 signing key (spec: server-server API, "Server discovery" and
//! "Signing JSON").
//!
//! The key is a PKCS#8 v2 document; `federation` persists it under the data directory
//! and the journal uses it to sign PDUs and command envelopes.

use base64::Engine as _;
use ruma::{
    CanonicalJsonObject,
    serde::Base64,
    signatures::{Ed25519KeyPair, KeyPair as _, PublicKeyMap, PublicKeySet},
};

/// Errors loading keys or checking signatures.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The stored key document could not be parsed.
    #[error("invalid signing key document: {0}")]
    InvalidKey(String),
    /// A signature did not verify, or the JSON was not signable.
    #[error("signature check failed: {0}")]
    BadSignature(String),
}

/// The homeserver's signing identity: its name, the key id (`ed25519:<version>`) and
/// the key pair.
pub struct ServerKey {
    server_name: String,
    version: String,
    pair: Ed25519KeyPair,
    pkcs8: Vec<u8>,
}

impl std::fmt::Debug for ServerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerKey")
            .field("server_name", &self.server_name)
            .field("key_id", &self.key_id())
            .finish_non_exhaustive()
    }
}

impl ServerKey {
    /// Generates a fresh key with a random 6-character version.
    pub fn generate(server_name: &str) -> Self {
        let doc = Ed25519KeyPair::generate();
        let version: String = {
            let h = blake3::hash(&doc);
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(&h.as_bytes()[..6])
                .replace(['-', '_'], "a")
        };
        Self::from_pkcs8(server_name, &version, &doc).expect("freshly generated key parses")
    }

    /// Loads a key from its PKCS#8 document and version.
    pub fn from_pkcs8(server_name: &str, version: &str, pkcs8: &[u8]) -> Result<Self, KeyError> {
        let pair = Ed25519KeyPair::from_der(pkcs8, version.to_owned())
            .map_err(|e| KeyError::InvalidKey(e.to_string()))?;
        Ok(Self {
            server_name: server_name.to_owned(),
            version: version.to_owned(),
            pair,
            pkcs8: pkcs8.to_vec(),
        })
    }

    /// The PKCS#8 document, for persisting.
    pub fn pkcs8(&self) -> &[u8] {
        &self.pkcs8
    }

    /// The server name this key signs for.
    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    /// The key version (the part after `ed25519:`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The key id, `ed25519:<version>`.
    pub fn key_id(&self) -> String {
        format!("ed25519:{}", self.version)
    }

    /// Unpadded standard base64 of the 32-byte public key, as `/key/v2/server` serves it.
    pub fn public_key_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(self.pair.public_key())
    }

    /// The ruma key pair, for `hash_and_sign_event`.
    pub fn pair(&self) -> &Ed25519KeyPair {
        &self.pair
    }

    /// Signs arbitrary JSON in place (adds `signatures.<server>.<key id>`), per
    /// spec appendix "Signing JSON".
    pub fn sign_json(&self, object: &mut CanonicalJsonObject) -> Result<(), KeyError> {
        ruma::signatures::sign_json(&self.server_name, &self.pair, object)
            .map_err(|e| KeyError::BadSignature(e.to_string()))
    }

    /// Signs raw bytes, returning unpadded base64 (used for command envelopes).
    pub fn sign_bytes(&self, bytes: &[u8]) -> String {
        let sig = self.pair.sign(bytes);
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(sig.as_bytes())
    }

    /// The public key map that verifies this server's signatures.
    pub fn public_key_map(&self) -> PublicKeyMap {
        let mut set = PublicKeySet::new();
        set.insert(self.key_id(), Base64::new(self.pair.public_key().to_vec()));
        let mut map = PublicKeyMap::new();
        map.insert(self.server_name.clone(), set);
        map
    }

    /// Verifies a signature made by [`ServerKey::sign_bytes`] on `bytes`.
    pub fn verify_bytes(&self, bytes: &[u8], signature_b64: &str) -> Result<(), KeyError> {
        let sig = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(signature_b64)
            .map_err(|e| KeyError::BadSignature(e.to_string()))?;
        ruma::signatures::verify_canonical_json_bytes(
            &ruma::SigningKeyAlgorithm::Ed25519,
            &self.pair.public_key(),
            &sig,
            bytes,
        )
        .map_err(|e| KeyError::BadSignature(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_verifies() {
        let key = ServerKey::generate("example.org");
        let again = ServerKey::from_pkcs8("example.org", key.version(), key.pkcs8()).unwrap();
        assert_eq!(key.public_key_base64(), again.public_key_base64());
        assert_eq!(key.public_key_base64().len(), 43);
        let sig = key.sign_bytes(b"hello");
        again.verify_bytes(b"hello", &sig).unwrap();
        assert!(again.verify_bytes(b"hellp", &sig).is_err());

        let mut obj = crate::canonical::to_object(serde_json::json!({"a": 1})).unwrap();
        key.sign_json(&mut obj).unwrap();
        ruma::signatures::verify_json(&again.public_key_map(), &obj).unwrap();
    }
}
