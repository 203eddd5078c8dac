//! Canonical JSON (spec: appendices, "Canonical JSON").
//!
//! Everything signed or hashed goes through these helpers so there is exactly one
//! serializer in the process: ruma's.

use ruma::{CanonicalJsonObject, CanonicalJsonValue};

/// Errors converting JSON into canonical form.
#[derive(Debug, thiserror::Error)]
pub enum CanonicalError {
    /// The value is not a JSON object.
    #[error("expected a JSON object")]
    NotAnObject,
    /// Floats, out-of-range integers or duplicate keys (spec: canonical JSON rules).
    #[error("not canonical JSON: {0}")]
    Invalid(String),
}

/// Converts a `serde_json` object into ruma's canonical object (integers must fit in
/// the spec's `[-(2**53)+1, (2**53)-1]` range, floats are refused).
pub fn to_object(value: serde_json::Value) -> Result<CanonicalJsonObject, CanonicalError> {
    match CanonicalJsonValue::try_from(value).map_err(|e| CanonicalError::Invalid(e.to_string()))? {
        CanonicalJsonValue::Object(o) => Ok(o),
        _ => Err(CanonicalError::NotAnObject),
    }
}

/// Serializes a canonical object to its canonical byte form (sorted keys, no
/// insignificant whitespace, UTF-8).
pub fn to_bytes(object: &CanonicalJsonObject) -> Vec<u8> {
    // CanonicalJsonObject is a BTreeMap, so serde_json emits keys sorted and compact.
    serde_json::to_vec(object).expect("canonical JSON always serializes")
}

/// Parses canonical bytes (as stored in the journal) back into an object.
pub fn from_bytes(bytes: &[u8]) -> Result<CanonicalJsonObject, CanonicalError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| CanonicalError::Invalid(e.to_string()))?;
    to_object(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_keys_and_strips_whitespace() {
        let obj = to_object(serde_json::json!({"b": 1, "a": {"d": [1, 2], "c": "x"}})).unwrap();
        assert_eq!(to_bytes(&obj), br#"{"a":{"c":"x","d":[1,2]},"b":1}"#);
    }

    #[test]
    fn refuses_floats_and_big_integers() {
        assert!(to_object(serde_json::json!({"a": 1.5})).is_err());
        assert!(to_object(serde_json::json!({"a": 9007199254740993u64})).is_err());
        assert!(matches!(
            to_object(serde_json::json!([1])),
            Err(CanonicalError::NotAnObject)
        ));
    }
}
