//! Answers assembled from JSON values and pieces already written as JSON text.
//!
//! Events are most of a sync answer's bytes, and each is stored as JSON: building a
//! [`Value`] for one parses its content and allocates a node per member, only for the
//! tree to be serialized and dropped again (a third of a sliding-sync window's CPU
//! before this). [`JsonOut`] lets a handler keep the small, computed parts of an answer
//! as values and splice the event arrays in as text, written once by
//! [`spindle_core::pdu::Pdu::write_client_event`] or copied from the rendered-state
//! cache.
//!
//! The text pieces are trusted: each is written by this crate's JSON writers (or by
//! `serde_json`), never taken from a client.

use serde_json::Value;

/// A JSON answer under construction: a value, a piece of JSON text, or an object
/// whose members are either (in insertion order).
#[derive(Debug)]
pub enum JsonOut {
    /// A value, serialized when the answer is written.
    Value(Value),
    /// One JSON value already written as text (valid JSON by construction).
    Text(Vec<u8>),
    /// An object: members in the order they were set, keys unique.
    Object(Vec<(String, JsonOut)>),
}

impl JsonOut {
    /// An empty object.
    pub fn object() -> JsonOut {
        JsonOut::Object(Vec::new())
    }

    /// Sets `key` of an object (replacing its earlier value, else appended). A value
    /// that is a JSON object becomes an [`JsonOut::Object`] first, so members can be
    /// set into it later. Panics if `self` is not an object (a programming error).
    pub fn set(&mut self, key: &str, value: impl Into<JsonOut>) -> &mut JsonOut {
        let value = value.into();
        let JsonOut::Object(members) = self else {
            panic!("JsonOut::set on a non-object");
        };
        let i = match members.iter().position(|(k, _)| k == key) {
            Some(i) => {
                members[i].1 = value;
                i
            }
            None => {
                members.push((key.to_owned(), value));
                members.len() - 1
            }
        };
        &mut members[i].1
    }

    /// The whole answer as JSON text.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.text_len() + 1024);
        self.write(&mut out);
        out
    }

    /// Writes the JSON text onto `out`.
    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            // Writing into a Vec cannot fail.
            JsonOut::Value(v) => {
                let _ = serde_json::to_writer(&mut *out, v);
            }
            JsonOut::Text(t) => out.extend_from_slice(t),
            JsonOut::Object(members) => {
                out.push(b'{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    let _ = serde_json::to_writer(&mut *out, k);
                    out.push(b':');
                    v.write(out);
                }
                out.push(b'}');
            }
        }
    }

    /// A `200` answer with this as its JSON body.
    pub fn into_response(self) -> axum::response::Response {
        crate::read::raw_json(self.to_json())
    }

    /// Bytes of the text pieces (the answer's size, less its values).
    fn text_len(&self) -> usize {
        match self {
            JsonOut::Value(_) => 0,
            JsonOut::Text(t) => t.len(),
            JsonOut::Object(members) => members.iter().map(|(_, v)| v.text_len()).sum(),
        }
    }
}

impl From<Value> for JsonOut {
    /// An object value becomes an [`JsonOut::Object`] (so members can be set into
    /// it); anything else stays a value.
    fn from(v: Value) -> JsonOut {
        match v {
            Value::Object(map) => JsonOut::Object(
                map.into_iter()
                    .map(|(k, v)| (k, JsonOut::Value(v)))
                    .collect(),
            ),
            v => JsonOut::Value(v),
        }
    }
}

/// A JSON array of `items`, each written onto the text by `write`.
pub fn array<T>(items: &[T], mut write: impl FnMut(&T, &mut Vec<u8>)) -> JsonOut {
    let mut out = Vec::with_capacity(items.len() * 512 + 2);
    out.push(b'[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(item, &mut out);
    }
    out.push(b']');
    JsonOut::Text(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn values_text_and_objects_write_one_json_document() {
        let mut answer = JsonOut::from(json!({ "b": 1, "a": { "x": "y\"z" } }));
        answer.set(
            "events",
            array(&["one", "tw\"o"], |s, out| {
                let _ = serde_json::to_writer(&mut *out, &json!({ "body": s }));
            }),
        );
        answer
            .set("a", JsonOut::object())
            .set("inner", json!([1, 2]));
        answer.set("empty", array::<u8>(&[], |_, _| {}));
        let v: Value = serde_json::from_slice(&answer.to_json()).unwrap();
        assert_eq!(
            v,
            json!({
                "b": 1,
                "a": { "inner": [1, 2] },
                "events": [{ "body": "one" }, { "body": "tw\"o" }],
                "empty": [],
            })
        );
    }
}
