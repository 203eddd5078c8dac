//! PDUs: building, hashing, signing and parsing (spec: server-server API "PDUs",
//! "Calculating the reference hash for an event", room versions 1 to 12).
//!
//! A [`Pdu`] is always backed by the exact canonical JSON bytes that were signed; the
//! parsed fields are a convenience view. From room version 3 the event id is not part
//! of the JSON: it is `$` + the unpadded base64 of the reference hash (standard
//! alphabet in v3, URL-safe from v4). In versions 1 and 2 the id is `$opaque:server`,
//! carried in the JSON as `event_id`, and `prev_events`/`auth_events` pair each id
//! with the referenced event's reference hash (`[["$id:server", {"sha256": "..."}]]`).

use std::sync::Arc;

use base64::Engine as _;
use ruma::{
    CanonicalJsonObject, CanonicalJsonValue, EventId, MilliSecondsSinceUnixEpoch, OwnedEventId,
    OwnedRoomId, OwnedUserId, RoomId, UInt, UserId, events::TimelineEventType,
    room_version_rules::RoomVersionRules,
};
use serde_json::value::RawValue;

use crate::{canonical, keys::ServerKey, room_version};

/// Largest PDU the spec allows, in bytes of canonical JSON (spec: "Size limits").
pub const MAX_PDU_BYTES: usize = 65_536;

/// Errors building or parsing a PDU.
#[derive(Debug, thiserror::Error)]
pub enum PduError {
    /// The room version is not one we serve.
    #[error("unsupported room version {0}")]
    UnsupportedRoomVersion(String),
    /// The PDU exceeds [`MAX_PDU_BYTES`].
    #[error("event is too large ({0} bytes, limit 65536)")]
    TooLarge(usize),
    /// The JSON is not a valid PDU (missing or mistyped field, not canonical).
    #[error("invalid PDU: {0}")]
    Invalid(String),
}

/// What a PDU is made from, before hashes, signatures and the event id exist.
#[derive(Debug, Clone)]
pub struct PduTemplate {
    /// Room version of the room (decides redaction, id format and auth rules).
    pub room_version: String,
    /// The room, or `None` for the create event of a v12 room (its id comes from it).
    pub room_id: Option<OwnedRoomId>,
    /// Sending user (local).
    pub sender: OwnedUserId,
    /// Event type, e.g. `m.room.message`.
    pub kind: String,
    /// State key for state events.
    pub state_key: Option<String>,
    /// The event content (a JSON object).
    pub content: serde_json::Value,
    /// The event this one redacts (`m.room.redaction` only).
    pub redacts: Option<OwnedEventId>,
    /// Exactly one entry (the room head) for every event but the create event.
    pub prev_events: Vec<OwnedEventId>,
    /// Selected by the room version's auth-event selection rules.
    pub auth_events: Vec<OwnedEventId>,
    /// Depth: one more than the prev event's.
    pub depth: u64,
    /// Sender's origin timestamp in milliseconds since the Unix epoch.
    pub origin_server_ts: u64,
}

static CONTENT_PARSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times [`Pdu::content_value`] (and so [`Pdu::to_client_event`]) parsed an
/// event's content into a [`serde_json::Value`] in this process: the counting tests'
/// witness that answers written as text ([`Pdu::write_client_event`]) parse none. One
/// relaxed atomic add per parse, next to the parse itself.
pub fn content_parses() -> u64 {
    CONTENT_PARSES.load(std::sync::atomic::Ordering::Relaxed)
}

/// The two shapes a client gets an event in (spec, client-server API "Room Event
/// Format"): `ClientEvent`, and `ClientEventWithoutRoomID` where the room is implied
/// by where the event sits in the answer (`/sync`'s rooms, sliding sync's rooms; what
/// Synapse calls `ClientV2WithoutRoomId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFormat {
    /// `ClientEvent`: with `room_id` (`/messages`, `/context`, `/event`, `/state`).
    Event,
    /// `ClientEventWithoutRoomID`: without `room_id` (`/sync`, sliding sync).
    WithoutRoomId,
}

/// A signed PDU, with its id, room id and a parsed view of its fields.
#[derive(Debug, Clone)]
pub struct Pdu {
    /// `$` + reference hash (v3+), or the `event_id` of the JSON (v1/v2).
    pub event_id: OwnedEventId,
    /// The room (for a v12 create event: derived from its own reference hash).
    pub room_id: OwnedRoomId,
    /// Sender.
    pub sender: OwnedUserId,
    /// Event type.
    pub kind: TimelineEventType,
    /// State key, for state events.
    pub state_key: Option<String>,
    /// Content, as raw JSON.
    pub content: Box<RawValue>,
    /// Origin server timestamp.
    pub origin_server_ts: MilliSecondsSinceUnixEpoch,
    /// Depth.
    pub depth: u64,
    /// Prev events (one for our own events).
    pub prev_events: Vec<OwnedEventId>,
    /// Auth events.
    pub auth_events: Vec<OwnedEventId>,
    /// The redacted event, for `m.room.redaction` (top-level in v10, in content in v11+).
    pub redacts: Option<OwnedEventId>,
    /// The room's version.
    pub room_version: String,
    /// Canonical JSON of the signed PDU (what the journal stores).
    pub json: Arc<[u8]>,
    room_id_in_json: bool,
}

/// The event id of a PDU as another server sent it (v3+: `$` + its reference hash,
/// computed without `unsigned`). `None` for an unsupported version or a PDU that is not
/// canonical JSON. Room versions 1 and 2 carry their id in the PDU (`event_id`).
pub fn event_id_of(pdu: &serde_json::Value, version: &str) -> Option<String> {
    let rules = room_version::rules(version)?;
    let mut obj = canonical::to_object(pdu.clone()).ok()?;
    obj.remove("unsigned");
    event_id_of_object(&obj, &rules).ok()
}

/// [`event_id_of`] for a PDU already in canonical form (without `unsigned`). Errors
/// (as text) when a v1/v2 PDU has no valid `$opaque:server` id, or the PDU cannot be
/// hashed (too large, not a PDU).
pub fn event_id_of_object(
    obj: &CanonicalJsonObject,
    rules: &RoomVersionRules,
) -> Result<String, String> {
    if room_version::event_id_in_json(rules) {
        let id = match obj.get("event_id") {
            Some(CanonicalJsonValue::String(id)) => id,
            _ => return Err("the PDU has no event_id (room versions 1 and 2 carry it)".into()),
        };
        let parsed = OwnedEventId::try_from(id.as_str())
            .map_err(|e| format!("invalid event id {id}: {e}"))?;
        if parsed.server_name().is_none() {
            return Err(format!("the event id {id} names no server"));
        }
        return Ok(id.clone());
    }
    ruma::signatures::reference_hash(obj, rules)
        .map(|h| format!("${h}"))
        .map_err(|e| format!("invalid PDU: {e}"))
}

/// Gives a v1/v2 event its id: `$` + 24 characters of URL-safe base64 of the blake3
/// hash of the event as it is before signing, `:` + the signing server's name; inserted
/// as `event_id` and returned.
fn insert_opaque_event_id(
    obj: &mut CanonicalJsonObject,
    server_name: &str,
) -> Result<OwnedEventId, PduError> {
    let digest = blake3::hash(&canonical::to_bytes(obj));
    let opaque = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest.as_bytes());
    let id = OwnedEventId::try_from(format!("${}:{}", &opaque[..24], server_name))
        .map_err(|e| PduError::Invalid(e.to_string()))?;
    obj.insert(
        "event_id".into(),
        CanonicalJsonValue::String(id.to_string()),
    );
    Ok(id)
}

fn rules(version: &str) -> Result<RoomVersionRules, PduError> {
    room_version::rules(version).ok_or_else(|| PduError::UnsupportedRoomVersion(version.to_owned()))
}

fn reference_id(
    object: &CanonicalJsonObject,
    rules: &RoomVersionRules,
) -> Result<String, PduError> {
    ruma::signatures::reference_hash(object, rules).map_err(|e| match e {
        ruma::signatures::JsonError::PduTooLarge => PduError::TooLarge(MAX_PDU_BYTES + 1),
        other => PduError::Invalid(other.to_string()),
    })
}

impl PduTemplate {
    /// Hashes, signs and ids the event (spec: "Signing events" and "Calculating the
    /// reference hash"). Errors if the version is unsupported, the content is not a
    /// canonical JSON object, or the result exceeds [`MAX_PDU_BYTES`]. For room
    /// versions 1 and 2, whose references carry hashes, use
    /// [`PduTemplate::build_with_references`]; this errors there if the event
    /// references any other event.
    pub fn build(self, key: &ServerKey) -> Result<Pdu, PduError> {
        self.build_with_references(key, &|_| None)
    }

    /// [`PduTemplate::build`], with `reference_hash` answering the reference hash
    /// ([`Pdu::reference_hash`]) of each event in `prev_events` and `auth_events`. Only
    /// room versions 1 and 2 ask (spec: room version 1 "Event format"); a missing
    /// answer there is [`PduError::Invalid`].
    ///
    /// A v1/v2 event id is `$` + 24 characters of URL-safe base64 of the blake3 hash of
    /// the event before signing, `:` + the signing server's name: unique (the event
    /// names its room, predecessor and timestamp) and deterministic, with no
    /// randomness in `core`.
    pub fn build_with_references(
        self,
        key: &ServerKey,
        reference_hash: &dyn Fn(&EventId) -> Option<String>,
    ) -> Result<Pdu, PduError> {
        let rules = rules(&self.room_version)?;
        let with_hashes = room_version::references_carry_hashes(&rules);
        let content = match canonical::to_object(self.content.clone()) {
            Ok(c) => c,
            Err(e) => return Err(PduError::Invalid(format!("content: {e}"))),
        };
        let mut obj = CanonicalJsonObject::new();
        let ids = |v: &[OwnedEventId]| -> Result<CanonicalJsonValue, PduError> {
            v.iter()
                .map(|e| {
                    let id = CanonicalJsonValue::String(e.to_string());
                    if !with_hashes {
                        return Ok(id);
                    }
                    let hash = reference_hash(e)
                        .ok_or_else(|| PduError::Invalid(format!("no reference hash for {e}")))?;
                    let mut h = CanonicalJsonObject::new();
                    h.insert("sha256".into(), CanonicalJsonValue::String(hash));
                    Ok(CanonicalJsonValue::Array(vec![
                        id,
                        CanonicalJsonValue::Object(h),
                    ]))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(CanonicalJsonValue::Array)
        };
        let mut content = content;
        if let Some(redacts) = &self.redacts {
            if rules.redaction.content_field_redacts {
                content.insert(
                    "redacts".into(),
                    CanonicalJsonValue::String(redacts.to_string()),
                );
            } else {
                obj.insert(
                    "redacts".into(),
                    CanonicalJsonValue::String(redacts.to_string()),
                );
            }
        }
        obj.insert("auth_events".into(), ids(&self.auth_events)?);
        obj.insert("content".into(), CanonicalJsonValue::Object(content));
        obj.insert(
            "depth".into(),
            CanonicalJsonValue::Integer(
                UInt::try_from(self.depth)
                    .map_err(|_| PduError::Invalid("depth".into()))?
                    .into(),
            ),
        );
        obj.insert(
            "origin_server_ts".into(),
            CanonicalJsonValue::Integer(
                UInt::try_from(self.origin_server_ts)
                    .map_err(|_| PduError::Invalid("ts".into()))?
                    .into(),
            ),
        );
        obj.insert("prev_events".into(), ids(&self.prev_events)?);
        if let Some(room_id) = &self.room_id {
            obj.insert(
                "room_id".into(),
                CanonicalJsonValue::String(room_id.to_string()),
            );
        }
        obj.insert(
            "sender".into(),
            CanonicalJsonValue::String(self.sender.to_string()),
        );
        if let Some(sk) = &self.state_key {
            obj.insert("state_key".into(), CanonicalJsonValue::String(sk.clone()));
        }
        obj.insert("type".into(), CanonicalJsonValue::String(self.kind.clone()));
        let json_event_id = if room_version::event_id_in_json(&rules) {
            Some(insert_opaque_event_id(&mut obj, key.server_name())?)
        } else {
            None
        };

        ruma::signatures::hash_and_sign_event(
            key.server_name(),
            key.pair(),
            &mut obj,
            &rules.redaction,
        )
        .map_err(|e| match e {
            ruma::signatures::JsonError::PduTooLarge => {
                PduError::TooLarge(canonical::to_bytes(&obj).len())
            }
            other => PduError::Invalid(other.to_string()),
        })?;
        let json = canonical::to_bytes(&obj);
        if json.len() > MAX_PDU_BYTES {
            return Err(PduError::TooLarge(json.len()));
        }
        let (event_id, room_id) = match (json_event_id, self.room_id) {
            (Some(id), Some(room)) => (id, room),
            (Some(_), None) => {
                return Err(PduError::Invalid(format!(
                    "room version {} needs a room id",
                    self.room_version
                )));
            }
            (None, room) => {
                let hash = reference_id(&obj, &rules)?;
                let event_id = OwnedEventId::try_from(format!("${hash}"))
                    .map_err(|e| PduError::Invalid(e.to_string()))?;
                let room_id = match room {
                    Some(r) => r,
                    None => OwnedRoomId::try_from(format!("!{hash}"))
                        .map_err(|e| PduError::Invalid(e.to_string()))?,
                };
                (event_id, room_id)
            }
        };
        // The event was just built from `obj`: its fields are read from there instead
        // of parsing the bytes back.
        Pdu::from_object(
            &obj,
            &json,
            &self.room_version,
            &rules,
            Some(event_id),
            Some(room_id),
        )
    }
}

fn field<'a>(obj: &'a CanonicalJsonObject, name: &str) -> Result<&'a CanonicalJsonValue, PduError> {
    obj.get(name)
        .ok_or_else(|| PduError::Invalid(format!("missing field `{name}`")))
}

fn string_field(obj: &CanonicalJsonObject, name: &str) -> Result<String, PduError> {
    field(obj, name)?
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| PduError::Invalid(format!("field `{name}` is not a string")))
}

/// The ids of `prev_events` or `auth_events`: plain ids (v3+), or `[id, {"sha256":
/// hash}]` pairs when `with_hashes` (v1/v2; the hashes are not checked here).
fn id_list(
    obj: &CanonicalJsonObject,
    name: &str,
    with_hashes: bool,
) -> Result<Vec<OwnedEventId>, PduError> {
    field(obj, name)?
        .as_array()
        .ok_or_else(|| PduError::Invalid(format!("field `{name}` is not an array")))?
        .iter()
        .map(|v| {
            let id = if with_hashes {
                match v.as_array() {
                    Some([id, CanonicalJsonValue::Object(_)]) => id.as_str(),
                    _ => None,
                }
            } else {
                v.as_str()
            };
            id.and_then(|s| OwnedEventId::try_from(s).ok())
                .ok_or_else(|| PduError::Invalid(format!("bad event reference in `{name}`")))
        })
        .collect()
}

impl Pdu {
    /// Parses canonical JSON of any supported room version (stored, or received over
    /// federation). The event id: in v1/v2 the JSON's `event_id` (required; a given
    /// `event_id` that differs is [`PduError::Invalid`]); from v3, `event_id` when given,
    /// else recomputed from the reference hash. `room_id` must be given for v12 create
    /// events (the JSON has none). Errors: [`PduError::UnsupportedRoomVersion`], or
    /// [`PduError::Invalid`] naming the missing or mistyped field.
    pub fn parse(
        json: &[u8],
        room_version: &str,
        event_id: Option<OwnedEventId>,
        room_id: Option<OwnedRoomId>,
    ) -> Result<Pdu, PduError> {
        let rules = rules(room_version)?;
        let obj = canonical::from_bytes(json).map_err(|e| PduError::Invalid(e.to_string()))?;
        Self::from_object(&obj, json, room_version, &rules, event_id, room_id)
    }

    /// [`Pdu::parse`] of `json` already parsed as `obj` (the two must be the same
    /// event: `json` is kept as the stored bytes, the fields are read from `obj`).
    fn from_object(
        obj: &CanonicalJsonObject,
        json: &[u8],
        room_version: &str,
        rules: &RoomVersionRules,
        event_id: Option<OwnedEventId>,
        room_id: Option<OwnedRoomId>,
    ) -> Result<Pdu, PduError> {
        let event_id = if room_version::event_id_in_json(rules) {
            let in_json = OwnedEventId::try_from(string_field(obj, "event_id")?)
                .map_err(|e| PduError::Invalid(format!("event_id: {e}")))?;
            if event_id.as_ref().is_some_and(|given| *given != in_json) {
                return Err(PduError::Invalid(format!(
                    "event_id {in_json} is not the expected {}",
                    event_id.expect("checked")
                )));
            }
            in_json
        } else {
            match event_id {
                Some(id) => id,
                None => OwnedEventId::try_from(format!("${}", reference_id(obj, rules)?))
                    .map_err(|e| PduError::Invalid(e.to_string()))?,
            }
        };
        let with_hashes = room_version::references_carry_hashes(rules);
        let room_id_in_json = obj.contains_key("room_id");
        let room_id = match obj.get("room_id").and_then(|v| v.as_str()) {
            Some(r) => OwnedRoomId::try_from(r).map_err(|e| PduError::Invalid(e.to_string()))?,
            None => match room_id {
                Some(r) => r,
                None => OwnedRoomId::try_from(format!("!{}", &event_id.as_str()[1..]))
                    .map_err(|e| PduError::Invalid(e.to_string()))?,
            },
        };
        let sender = OwnedUserId::try_from(string_field(obj, "sender")?)
            .map_err(|e| PduError::Invalid(e.to_string()))?;
        let kind = TimelineEventType::from(string_field(obj, "type")?);
        let state_key = match obj.get("state_key") {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or_else(|| PduError::Invalid("state_key".into()))?
                    .to_owned(),
            ),
        };
        let content_obj = field(obj, "content")?
            .as_object()
            .ok_or_else(|| PduError::Invalid("content is not an object".into()))?;
        let content = serde_json::value::to_raw_value(content_obj)
            .map_err(|e| PduError::Invalid(e.to_string()))?;
        let ts = field(obj, "origin_server_ts")?
            .as_integer()
            .and_then(|i| UInt::try_from(i64::from(i)).ok())
            .ok_or_else(|| PduError::Invalid("origin_server_ts".into()))?;
        let depth = field(obj, "depth")?
            .as_integer()
            .and_then(|i| u64::try_from(i64::from(i)).ok())
            .ok_or_else(|| PduError::Invalid("depth".into()))?;
        let redacts = obj
            .get("redacts")
            .or_else(|| content_obj.get("redacts"))
            .and_then(|v| v.as_str())
            .and_then(|s| OwnedEventId::try_from(s).ok());
        Ok(Pdu {
            event_id,
            room_id,
            sender,
            kind,
            state_key,
            content,
            origin_server_ts: MilliSecondsSinceUnixEpoch(ts),
            depth,
            prev_events: id_list(obj, "prev_events", with_hashes)?,
            auth_events: id_list(obj, "auth_events", with_hashes)?,
            redacts,
            room_version: room_version.to_owned(),
            json: json.into(),
            room_id_in_json,
        })
    }

    /// Hashes and signs an event another server templated for one of our users
    /// (spec: `make_join`/`make_leave` on the joining server's side): the template's
    /// `signatures`, `hashes`, `unsigned` and `event_id` are dropped, `origin_server_ts`
    /// is set to `ts`, then the event is hashed, signed with `key` and parsed. In room
    /// versions 1 and 2 the event gets an id of our own (`$opaque:our.server`, made as
    /// [`PduTemplate::build_with_references`] makes them; the template's references
    /// already carry their hashes), since the server that names an event id must sign
    /// the event. Errors like [`PduTemplate::build`].
    pub fn sign_template(
        template: serde_json::Value,
        room_version: &str,
        key: &ServerKey,
        ts: u64,
    ) -> Result<Pdu, PduError> {
        let rules = rules(room_version)?;
        let mut obj = canonical::to_object(template)
            .map_err(|e| PduError::Invalid(format!("template: {e}")))?;
        for k in ["signatures", "hashes", "unsigned", "event_id"] {
            obj.remove(k);
        }
        obj.insert(
            "origin_server_ts".into(),
            CanonicalJsonValue::Integer(
                UInt::try_from(ts)
                    .map_err(|_| PduError::Invalid("ts".into()))?
                    .into(),
            ),
        );
        let json_event_id = if room_version::event_id_in_json(&rules) {
            Some(insert_opaque_event_id(&mut obj, key.server_name())?)
        } else {
            None
        };
        ruma::signatures::hash_and_sign_event(
            key.server_name(),
            key.pair(),
            &mut obj,
            &rules.redaction,
        )
        .map_err(|e| PduError::Invalid(e.to_string()))?;
        let json = canonical::to_bytes(&obj);
        if json.len() > MAX_PDU_BYTES {
            return Err(PduError::TooLarge(json.len()));
        }
        let event_id = match json_event_id {
            Some(id) => id,
            None => OwnedEventId::try_from(format!("${}", reference_id(&obj, &rules)?))
                .map_err(|e| PduError::Invalid(e.to_string()))?,
        };
        Pdu::parse(&json, room_version, Some(event_id), None)
    }

    /// The reference hash of the event (spec: server-server API "Calculating the
    /// reference hash for an event"), unpadded base64 in the version's alphabet: the
    /// event id of v3+ events without its `$`, and what v1/v2 references pair with an
    /// event id. Errors only if the stored JSON is not a PDU of its version.
    pub fn reference_hash(&self) -> Result<String, PduError> {
        let rules = rules(&self.room_version)?;
        let obj =
            canonical::from_bytes(&self.json).map_err(|e| PduError::Invalid(e.to_string()))?;
        reference_id(&obj, &rules)
    }

    /// The content as a `serde_json::Value`.
    pub fn content_value(&self) -> serde_json::Value {
        CONTENT_PARSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        serde_json::from_str(self.content.get()).unwrap_or(serde_json::Value::Null)
    }

    /// Whether this is a state event.
    pub fn is_state(&self) -> bool {
        self.state_key.is_some()
    }

    /// The event in the client format (spec: client-server API "Room Event Format"),
    /// with the given `unsigned` object (omitted when `None`).
    pub fn to_client_event(&self, unsigned: Option<serde_json::Value>) -> serde_json::Value {
        self.render(self.content_value(), unsigned)
    }

    /// [`Pdu::to_client_event`] written as JSON text onto `out`: the same members in the
    /// same (sorted) order, with `content` copied as the PDU holds it instead of parsed
    /// and serialized again, and `unsigned` (an object, omitted when `None`) serialized
    /// in place; in [`ClientFormat::WithoutRoomId`] the `room_id` member is left out
    /// (`/sync`, sliding sync). What answers written as text use
    /// (`api/src/json_text.rs`).
    pub fn write_client_event(
        &self,
        out: &mut Vec<u8>,
        format: ClientFormat,
        unsigned: Option<&serde_json::Map<String, serde_json::Value>>,
    ) {
        use std::io::Write as _;
        let string = |out: &mut Vec<u8>, value: &str| {
            // Escaped as serde_json escapes; writing into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, value);
        };
        out.extend_from_slice(b"{\"content\":");
        out.extend_from_slice(self.content.get().as_bytes());
        out.extend_from_slice(b",\"event_id\":");
        string(out, self.event_id.as_str());
        let _ = write!(
            out,
            ",\"origin_server_ts\":{}",
            u64::from(self.origin_server_ts.0)
        );
        if let Some(r) = &self.redacts {
            out.extend_from_slice(b",\"redacts\":");
            string(out, r.as_str());
        }
        if format == ClientFormat::Event {
            out.extend_from_slice(b",\"room_id\":");
            string(out, self.room_id.as_str());
        }
        out.extend_from_slice(b",\"sender\":");
        string(out, self.sender.as_str());
        if let Some(sk) = &self.state_key {
            out.extend_from_slice(b",\"state_key\":");
            string(out, sk);
        }
        out.extend_from_slice(b",\"type\":");
        string(out, &self.kind.to_string());
        if let Some(u) = unsigned {
            out.extend_from_slice(b",\"unsigned\":");
            let _ = serde_json::to_writer(&mut *out, u);
        }
        out.push(b'}');
    }

    /// The event as a client sees it after redaction (content stripped per the room
    /// version's redaction algorithm), with `unsigned.redacted_because` set.
    pub fn to_redacted_client_event(&self, redaction: &Pdu) -> serde_json::Value {
        let content = self.redacted_content();
        let unsigned = serde_json::json!({ "redacted_because": redaction.to_client_event(None) });
        self.render(content, Some(unsigned))
    }

    /// Content kept by the redaction algorithm of this room version.
    pub fn redacted_content(&self) -> serde_json::Value {
        let Some(rules) = room_version::rules(&self.room_version) else {
            return serde_json::json!({});
        };
        let Ok(mut content) = canonical::to_object(self.content_value()) else {
            return serde_json::json!({});
        };
        ruma::canonical_json::redact_content_in_place(
            &mut content,
            &rules.redaction,
            self.kind.to_string(),
        );
        serde_json::to_value(content).unwrap_or_else(|_| serde_json::json!({}))
    }

    fn render(
        &self,
        content: serde_json::Value,
        unsigned: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let mut ev = serde_json::json!({
            "content": content,
            "event_id": self.event_id,
            "origin_server_ts": self.origin_server_ts,
            "room_id": self.room_id,
            "sender": self.sender,
            "type": self.kind.to_string(),
        });
        let map = ev.as_object_mut().expect("object");
        if let Some(sk) = &self.state_key {
            map.insert("state_key".into(), sk.clone().into());
        }
        if let Some(r) = &self.redacts {
            // v11 moved `redacts` into content; we keep the top-level copy for older clients.
            map.insert("redacts".into(), r.to_string().into());
        }
        if let Some(u) = unsigned {
            map.insert("unsigned".into(), u);
        }
        ev
    }

    /// The PDU as sent over federation: the signed JSON (with no event id from v3, with
    /// its `event_id` in v1/v2).
    pub fn federation_json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.json).unwrap_or(serde_json::Value::Null)
    }

    /// [`Pdu::federation_json`] after the room version's redaction algorithm (spec:
    /// client-server "Redactions"): what a server receives of an event that was
    /// redacted or that history visibility hides from it. Hashes and signatures stay,
    /// so the receiver can still check the event; `Null` only if the stored JSON is not
    /// an event of its version.
    pub fn redacted_federation_json(&self) -> serde_json::Value {
        let Ok(rules) = rules(&self.room_version) else {
            return serde_json::Value::Null;
        };
        canonical::from_bytes(&self.json)
            .ok()
            .and_then(|obj| ruma::canonical_json::redact(obj, &rules.redaction, None).ok())
            .and_then(|obj| serde_json::to_value(obj).ok())
            .unwrap_or(serde_json::Value::Null)
    }
}

/// Adds `key`'s signature to a PDU another server built and signed, leaving every
/// other field as it is: what a resident server does to a restricted join that names
/// one of its users in `join_authorised_via_users_server` (spec: server-server API
/// `send_join`, "Restricted rooms"). The signature covers the event's redacted form
/// like any event signature (spec: "Signing events"). `pdu` is the federation JSON
/// (v1/v2 with its `event_id`); the answer is the same object with one more signature.
///
/// Errors: [`PduError::UnsupportedRoomVersion`]; [`PduError::Invalid`] if `pdu` is not a
/// JSON object that canonical JSON and the version's redaction accept.
pub fn countersign(
    pdu: serde_json::Value,
    room_version: &str,
    key: &ServerKey,
) -> Result<serde_json::Value, PduError> {
    let rules = rules(room_version)?;
    let mut obj =
        canonical::to_object(pdu).map_err(|e| PduError::Invalid(format!("event: {e}")))?;
    let mut redacted = ruma::canonical_json::redact(obj.clone(), &rules.redaction, None)
        .map_err(|e| PduError::Invalid(e.to_string()))?;
    ruma::signatures::sign_json(key.server_name(), key.pair(), &mut redacted)
        .map_err(|e| PduError::Invalid(e.to_string()))?;
    let ours = match redacted.get("signatures") {
        Some(CanonicalJsonValue::Object(sigs)) => sigs.get(key.server_name()).cloned(),
        _ => None,
    }
    .ok_or_else(|| PduError::Invalid("signing added no signature".into()))?;
    match obj
        .entry("signatures".to_owned())
        .or_insert_with(|| CanonicalJsonValue::Object(CanonicalJsonObject::new()))
    {
        CanonicalJsonValue::Object(sigs) => {
            sigs.insert(key.server_name().to_owned(), ours);
        }
        _ => return Err(PduError::Invalid("signatures is not an object".into())),
    }
    serde_json::to_value(obj).map_err(|e| PduError::Invalid(e.to_string()))
}

impl ruma::state_res::Event for Pdu {
    type Id = OwnedEventId;

    fn event_id(&self) -> &Self::Id {
        &self.event_id
    }
    fn room_id(&self) -> Option<&RoomId> {
        if self.room_id_in_json {
            Some(&self.room_id)
        } else {
            None
        }
    }
    fn sender(&self) -> &UserId {
        &self.sender
    }
    fn origin_server_ts(&self) -> MilliSecondsSinceUnixEpoch {
        self.origin_server_ts
    }
    fn event_type(&self) -> &TimelineEventType {
        &self.kind
    }
    fn content(&self) -> &RawValue {
        &self.content
    }
    fn state_key(&self) -> Option<&str> {
        self.state_key.as_deref()
    }
    fn prev_events(&self) -> Box<dyn DoubleEndedIterator<Item = &Self::Id> + '_> {
        Box::new(self.prev_events.iter())
    }
    fn auth_events(&self) -> Box<dyn DoubleEndedIterator<Item = &Self::Id> + '_> {
        Box::new(self.auth_events.iter())
    }
    fn redacts(&self) -> Option<&Self::Id> {
        self.redacts.as_ref()
    }
    fn rejected(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(version: &str, room: Option<&str>) -> PduTemplate {
        PduTemplate {
            room_version: version.into(),
            room_id: room.map(|r| OwnedRoomId::try_from(r).unwrap()),
            sender: OwnedUserId::try_from("@alice:example.org").unwrap(),
            kind: "m.room.create".into(),
            state_key: Some(String::new()),
            content: serde_json::json!({"room_version": version}),
            redacts: None,
            prev_events: vec![],
            auth_events: vec![],
            depth: 1,
            origin_server_ts: 1_700_000_000_000,
        }
    }

    #[test]
    fn event_id_is_reference_hash_and_stable_across_parse() {
        let key = ServerKey::generate("example.org");
        let pdu = template("10", Some("!abc:example.org"))
            .build(&key)
            .unwrap();
        assert_eq!(pdu.event_id.as_str().len(), 44); // '$' + 43 chars of unpadded base64
        let reparsed = Pdu::parse(&pdu.json, "10", None, None).unwrap();
        assert_eq!(reparsed.event_id, pdu.event_id);
        assert_eq!(reparsed.room_id.as_str(), "!abc:example.org");
        // The signature and content hash verify with ruma.
        let obj = canonical::from_bytes(&pdu.json).unwrap();
        let verified = ruma::signatures::verify_event(
            &key.public_key_map(),
            &obj,
            &room_version::rules("10").unwrap(),
        )
        .unwrap();
        assert_eq!(verified, ruma::signatures::Verified::All);
    }

    /// A built PDU is read from the object it was built from, not parsed back from its
    /// bytes: every field must equal what parsing the bytes gives.
    #[test]
    fn a_built_pdu_equals_its_bytes_parsed_back() {
        let key = ServerKey::generate("example.org");
        for (version, room) in [
            ("1", Some("!abc:example.org")),
            ("10", Some("!abc:example.org")),
            ("11", Some("!abc:example.org")),
            ("12", None),
        ] {
            let create = template(version, room).build(&key).unwrap();
            let mut t = template(version, Some(create.room_id.as_str()));
            t.kind = "m.room.redaction".into();
            t.state_key = None;
            t.content = serde_json::json!({"reason": "quote \" and \u{1F600}"});
            t.redacts = Some(create.event_id.clone());
            t.prev_events = vec![create.event_id.clone()];
            t.auth_events = vec![create.event_id.clone()];
            t.depth = 2;
            let hash = create.reference_hash().unwrap();
            let built = t
                .build_with_references(&key, &|e| (e == create.event_id).then(|| hash.clone()))
                .unwrap();
            for pdu in [&create, &built] {
                let parsed = Pdu::parse(
                    &pdu.json,
                    version,
                    Some(pdu.event_id.clone()),
                    Some(pdu.room_id.clone()),
                )
                .unwrap();
                assert_eq!(
                    format!("{pdu:?}"),
                    format!("{parsed:?}"),
                    "room version {version}"
                );
            }
            assert_eq!(built.redacts.as_ref(), Some(&create.event_id), "{version}");
        }
    }

    #[test]
    fn v12_room_id_comes_from_create_event() {
        let key = ServerKey::generate("example.org");
        let pdu = template("12", None).build(&key).unwrap();
        assert_eq!(&pdu.room_id.as_str()[1..], &pdu.event_id.as_str()[1..]);
        assert!(!String::from_utf8_lossy(&pdu.json).contains("room_id"));
    }

    #[test]
    fn v1_and_v2_ids_name_the_server_and_references_carry_hashes() {
        let key = ServerKey::generate("example.org");
        for version in ["1", "2"] {
            let create = template(version, Some("!abc:example.org"))
                .build(&key)
                .unwrap();
            let id = create.event_id.as_str();
            assert!(id.starts_with('$') && id.ends_with(":example.org"), "{id}");
            assert_eq!(id.len(), 1 + 24 + ":example.org".len());
            let json = create.federation_json();
            assert_eq!(json["event_id"], id);
            // Parsing takes the id from the JSON; a different expected id is refused.
            let reparsed = Pdu::parse(&create.json, version, None, None).unwrap();
            assert_eq!(reparsed.event_id, create.event_id);
            let other = OwnedEventId::try_from("$other:example.org").unwrap();
            assert!(matches!(
                Pdu::parse(&create.json, version, Some(other), None),
                Err(PduError::Invalid(_))
            ));
            let mut t = template(version, Some("!abc:example.org"));
            t.kind = "m.room.member".into();
            t.state_key = Some("@alice:example.org".into());
            t.content = serde_json::json!({"membership": "join"});
            t.prev_events = vec![create.event_id.clone()];
            t.auth_events = vec![create.event_id.clone()];
            t.depth = 2;
            // Without the referenced event's hash the event cannot be written.
            assert!(matches!(t.clone().build(&key), Err(PduError::Invalid(_))));
            let create_hash = create.reference_hash().unwrap();
            let join = t
                .build_with_references(&key, &|e| {
                    (e == create.event_id).then(|| create_hash.clone())
                })
                .unwrap();
            let json = join.federation_json();
            assert_eq!(
                json["prev_events"],
                serde_json::json!([[id, {"sha256": create_hash}]])
            );
            assert_eq!(json["auth_events"], json["prev_events"]);
            let reparsed = Pdu::parse(&join.json, version, None, None).unwrap();
            assert_eq!(reparsed.prev_events, vec![create.event_id.clone()]);
            assert_eq!(reparsed.auth_events, vec![create.event_id.clone()]);
            let obj = canonical::from_bytes(&join.json).unwrap();
            let verified = ruma::signatures::verify_event(
                &key.public_key_map(),
                &obj,
                &room_version::rules(version).unwrap(),
            )
            .unwrap();
            assert_eq!(verified, ruma::signatures::Verified::All);
            // A join templated by another server (make_join) and signed here gets an
            // id of ours, keeps the template's hashed references, and verifies.
            let resident = ServerKey::generate("resident.org");
            let joiner = ServerKey::generate("joiner.org");
            let mut templated = json.clone();
            for k in ["signatures", "hashes"] {
                templated.as_object_mut().unwrap().remove(k);
            }
            templated["event_id"] = serde_json::json!("$fromtemplate:resident.org");
            templated["sender"] = serde_json::json!("@bob:joiner.org");
            templated["state_key"] = serde_json::json!("@bob:joiner.org");
            let signed =
                Pdu::sign_template(templated, version, &joiner, 1_700_000_000_001).unwrap();
            let id = signed.event_id.as_str();
            assert!(id.starts_with('$') && id.ends_with(":joiner.org"), "{id}");
            let signed_json = signed.federation_json();
            assert_eq!(signed_json["event_id"], id);
            assert_eq!(signed_json["prev_events"], json["prev_events"]);
            assert_eq!(signed.prev_events, vec![create.event_id.clone()]);
            let mut keys = joiner.public_key_map();
            keys.extend(resident.public_key_map());
            let obj = canonical::from_bytes(&signed.json).unwrap();
            let verified =
                ruma::signatures::verify_event(&keys, &obj, &room_version::rules(version).unwrap())
                    .unwrap();
            assert_eq!(verified, ruma::signatures::Verified::All);
        }
    }

    #[test]
    fn v3_ids_use_standard_base64_and_v4_url_safe() {
        let key = ServerKey::generate("example.org");
        for version in ["3", "4", "5", "6", "7", "8", "9", "10", "11"] {
            let pdu = template(version, Some("!abc:example.org"))
                .build(&key)
                .unwrap();
            let hash = pdu.reference_hash().unwrap();
            assert_eq!(pdu.event_id.as_str(), format!("${hash}"));
            assert_eq!(pdu.event_id.as_str().len(), 44);
            assert!(pdu.federation_json().get("event_id").is_none());
            // The same bytes hash to the same digest; only the alphabet differs.
            let std = base64::engine::general_purpose::STANDARD_NO_PAD;
            let url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            let raw = if version == "3" {
                std.decode(&hash).unwrap()
            } else {
                url.decode(&hash).unwrap()
            };
            assert_eq!(raw.len(), 32, "{version}");
            let reparsed = Pdu::parse(&pdu.json, version, None, None).unwrap();
            assert_eq!(reparsed.event_id, pdu.event_id);
        }
    }

    #[test]
    fn oversized_event_is_refused() {
        let key = ServerKey::generate("example.org");
        let mut t = template("11", Some("!abc:example.org"));
        t.kind = "m.room.message".into();
        t.state_key = None;
        t.content = serde_json::json!({"body": "x".repeat(70_000)});
        assert!(matches!(t.build(&key), Err(PduError::TooLarge(_))));
    }

    #[test]
    fn client_event_text_is_the_client_event_value() {
        let key = ServerKey::generate("example.org");
        let mut t = template("11", Some("!abc:example.org"));
        t.kind = "m.room.message".into();
        t.state_key = None;
        t.content = serde_json::json!({
            "msgtype": "m.text",
            "body": "quote \" backslash \\ newline \n tab \t nul \u{0} é 😀",
            "n": [1, -2, {"deep": null}],
        });
        let message = t.build(&key).unwrap();
        let mut t = template("10", Some("!abc:example.org"));
        t.kind = "m.room.redaction".into();
        t.state_key = None;
        t.redacts = Some(message.event_id.clone());
        t.content = serde_json::json!({});
        let redaction = t.build(&key).unwrap();
        let mut t = template("11", Some("!abc:example.org"));
        t.kind = "m.room.member".into();
        t.state_key = Some("@al\"ice:example.org".into());
        t.content = serde_json::json!({"membership": "join"});
        let member = t.build(&key).unwrap();
        let unsigned = serde_json::json!({"age": 5, "transaction_id": "t\"1"});
        for pdu in [&message, &redaction, &member] {
            for u in [None, unsigned.as_object()] {
                let mut out = Vec::new();
                pdu.write_client_event(&mut out, ClientFormat::Event, u);
                let text: serde_json::Value = serde_json::from_slice(&out).unwrap();
                let value = pdu.to_client_event(u.map(|u| serde_json::Value::Object(u.clone())));
                assert_eq!(text, value, "{}", String::from_utf8_lossy(&out));
                // Same members in the same order: the same bytes as the value's text.
                assert_eq!(out, serde_json::to_vec(&value).unwrap());
                // `ClientEventWithoutRoomID`: the same less `room_id`.
                let mut without = Vec::new();
                pdu.write_client_event(&mut without, ClientFormat::WithoutRoomId, u);
                let mut expected = value.clone();
                expected.as_object_mut().unwrap().remove("room_id");
                assert_eq!(without, serde_json::to_vec(&expected).unwrap());
            }
        }
    }

    #[test]
    fn redaction_keeps_only_allowed_keys() {
        let key = ServerKey::generate("example.org");
        let mut t = template("11", Some("!abc:example.org"));
        t.kind = "m.room.member".into();
        t.state_key = Some("@alice:example.org".into());
        t.content = serde_json::json!({"membership": "join", "displayname": "Alice"});
        let pdu = t.build(&key).unwrap();
        assert_eq!(
            pdu.redacted_content(),
            serde_json::json!({"membership": "join"})
        );
    }
}
