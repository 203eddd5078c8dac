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

/// Canonical JSON bytes of any JSON value, as other servers compute them for request
/// signatures (spec: appendices, "Canonical JSON": object keys sorted, no insignificant
/// whitespace, UTF-8 unescaped), without the range rules that [`to_object`] enforces.
/// For the `X-Matrix` signature of a request whose body carries PDUs of room versions
/// 1 to 5, where integers beyond ±(2^53-1) and floats are legal: the request must still
/// verify, so each PDU can be judged on its own. Numbers are written as serde_json
/// writes them (integers as digits; floats in shortest form), strings as it escapes
/// them. Equal to [`to_bytes`] for every value [`to_object`] accepts.
pub fn lenient_bytes(value: &serde_json::Value) -> Vec<u8> {
    fn write(v: &serde_json::Value, out: &mut Vec<u8>) {
        match v {
            serde_json::Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push(b'{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.extend(serde_json::to_vec(k).expect("a string serializes"));
                    out.push(b':');
                    write(&map[k], out);
                }
                out.push(b'}');
            }
            serde_json::Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write(item, out);
                }
                out.push(b']');
            }
            scalar => out.extend(serde_json::to_vec(scalar).expect("a scalar serializes")),
        }
    }
    let mut out = Vec::new();
    write(value, &mut out);
    out
}

#[cfg(test)]
mod lenient_tests {
    use super::*;

    #[test]
    fn lenient_bytes_equal_canonical_bytes_and_keep_out_of_range_numbers() {
        let v = serde_json::json!({ "b": [1, "é", { "z": null, "a": true }], "a": "x\ny" });
        assert_eq!(lenient_bytes(&v), to_bytes(&to_object(v.clone()).unwrap()));
        assert_eq!(
            String::from_utf8(lenient_bytes(&v)).unwrap(),
            r#"{"a":"x\ny","b":[1,"é",{"a":true,"z":null}]}"#
        );
        let big = serde_json::json!({ "n": 1u64 << 60, "f": 1.5 });
        assert!(to_object(big.clone()).is_err());
        assert_eq!(
            String::from_utf8(lenient_bytes(&big)).unwrap(),
            r#"{"f":1.5,"n":1152921504606846976}"#
        );
    }
}
