//! EDUs over federation (spec: server-server API, "Typing Notifications", "Receipts",
//! "Presence", "Send-to-device messaging"), both ways.
//!
//! **Inbound** (`edus` of `PUT /send/{txnId}`, [`ingest`]): each EDU is checked
//! against the origin (its user or sender must be a user of the origin; a room-scoped
//! one needs that user joined to the room here and the origin allowed by the room's
//! server ACL) and then:
//! - `m.typing`: handed to the [`EphemeralSink`] (in memory, never journaled, like
//!   local typing), expiring after [`REMOTE_TYPING_TIMEOUT_MS`] unless the origin
//!   refreshes or stops it first;
//! - `m.presence`: each entry of `push` handed to the sink, when `[federation]
//!   presence` is on (a `status_msg` over [`MAX_STATUS_MSG_BYTES`] is cut at a
//!   character boundary);
//! - `m.receipt`: public (`m.read`) receipts become [`Fact::ReceiptSet`] records
//!   (any other receipt type is dropped: private receipts never cross servers);
//! - `m.direct_to_device`: the messages for our users become a [`Fact::ToDeviceSent`]
//!   record keyed by (sender, `message_id`), so a repeat is dropped by the journal's
//!   transaction index;
//! - `m.device_list_update` and `m.signing_key_update` for a user of the origin who
//!   shares a room with us become a [`Fact::RemoteDeviceListChanged`] record carrying
//!   the change: our users hear of it in `device_lists.changed` and query the keys
//!   again, answered from our copy of the user's device list when it is fresh. An
//!   update whose `prev_id` does not chain onto the copy (or with no copy yet) makes
//!   us fetch the whole list (`/user/devices`, [`crate::devices`]).
//!
//! The journal records of one transaction's EDUs go in one
//! [`spindle_journal::Journal::submit_batch`] run (one fsync). A bad EDU is dropped
//! and logged; it never fails the transaction (the spec gives EDUs no per-item
//! result).
//!
//! **Outbound**: receipts, to-device messages and device list changes are journal
//! facts, so the federation sender reads them from the journal like PDUs
//! ([`outbound_of`]): durable, retried, delivered after a restart. A device list
//! change of one of our users goes to every server sharing a room with the user as
//! `m.device_list_update` (`stream_id`: the record's position; `prev_id`: the
//! position of the user's previous change, filled in by the sender once the device
//! keys projection has it, else empty, which makes the receiver fetch `/user/devices`
//! again), and new master or self-signing keys as `m.signing_key_update`. Typing and presence are in memory; the binary feeds them
//! to [`crate::sender::FederationSender::queue_edu`].

use std::collections::BTreeMap;

use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact, StoredRecord};

use crate::{FedState, server_of};

/// How long a remote user's typing notice lasts without a refresh, ms (Synapse's
/// federation typing timeout: the origin sends `typing: false` when its user stops).
pub const REMOTE_TYPING_TIMEOUT_MS: u64 = 60_000;

/// Longest presence `status_msg` kept, in bytes of UTF-8: the one cap shared by the
/// Client-Server API (`PUT /presence/{userId}/status` refuses a longer one with 400) and
/// inbound `m.presence` EDUs (a longer one is cut at the last character boundary at or
/// below the cap: the presence itself is still worth having, and another server may cap
/// differently).
pub const MAX_STATUS_MSG_BYTES: usize = 1024;

/// `msg` cut to at most [`MAX_STATUS_MSG_BYTES`] bytes, at a character boundary.
pub fn truncate_status_msg(msg: &str) -> &str {
    if msg.len() <= MAX_STATUS_MSG_BYTES {
        return msg;
    }
    let mut end = MAX_STATUS_MSG_BYTES;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    &msg[..end]
}

/// Prefix of the transaction id under which a remote to-device message is journaled:
/// `fed/{message_id}`, unique per sender with an empty sender device.
pub const TO_DEVICE_TXN_PREFIX: &str = "fed/";

/// Where in-memory EDUs from other servers go (implemented by the binary over the api
/// crate's typing and presence state).
pub trait EphemeralSink: Send + Sync {
    /// A remote user started (`typing`) or stopped typing in a room; `timeout_ms`
    /// bounds how long the notice lasts without a refresh.
    fn typing(&self, room_id: &str, user_id: &str, typing: bool, timeout_ms: u64);
    /// A remote user's presence: `presence` is `online`, `unavailable` or `offline`;
    /// `last_active_ago` in ms; `status_msg` replaces the user's status message.
    fn presence(
        &self,
        user_id: &str,
        presence: &str,
        status_msg: Option<String>,
        last_active_ago: u64,
    );
}

/// Whether `user_id` is a user of `origin` joined to `room_id` here, and `origin` may
/// take part in the room under its server ACL.
fn joined_from(st: &FedState, origin: &str, room_id: &str, user_id: &str) -> bool {
    server_of(user_id) == Some(origin)
        && crate::acl::allowed(st, room_id, origin)
        && st
            .projections
            .membership
            .get(room_id, user_id)
            .is_some_and(|m| m.membership == "join")
}

/// Acts on the EDUs of one transaction from `origin` (see the module docs). Never
/// fails: a bad EDU is logged and dropped.
pub async fn ingest(st: &FedState, origin: &str, edus: &[Value]) {
    let mut facts = Vec::new();
    for edu in edus {
        let kind = edu.get("edu_type").and_then(|v| v.as_str()).unwrap_or("");
        let content = edu.get("content").unwrap_or(&Value::Null);
        match kind {
            "m.typing" => typing(st, origin, content),
            "m.presence" => presence(st, origin, content),
            "m.receipt" => facts.extend(receipts(st, origin, content)),
            "m.direct_to_device" => facts.extend(to_device(st, origin, content)),
            "m.device_list_update" | "m.signing_key_update" => {
                facts.extend(device_list(st, origin, kind, content))
            }
            // Anything unknown: ignored.
            _ => tracing::debug!(origin, edu_type = kind, "EDU ignored"),
        }
    }
    if facts.is_empty() {
        return;
    }
    let resyncs = crate::devices::gaps(st, &facts);
    let bodies = facts
        .into_iter()
        .map(|fact| CommandBody::Fact { fact })
        .collect();
    for r in st.submit_journal_batch(origin, bodies).await {
        if let Err(e) = r {
            tracing::info!(origin, error = %e, "an EDU was not journaled");
        }
    }
    // Updates that do not chain onto our copy of a device list: fetch the whole list
    // (after the updates are journaled, so the answer lands after them).
    for user_id in resyncs {
        crate::devices::spawn_resync(st.clone(), user_id);
    }
}

fn typing(st: &FedState, origin: &str, c: &Value) {
    let (Some(room_id), Some(user_id), Some(on)) = (
        c.get("room_id").and_then(|v| v.as_str()),
        c.get("user_id").and_then(|v| v.as_str()),
        c.get("typing").and_then(|v| v.as_bool()),
    ) else {
        tracing::debug!(origin, "m.typing EDU without room_id, user_id or typing");
        return;
    };
    if !joined_from(st, origin, room_id, user_id) {
        tracing::debug!(
            origin,
            room_id,
            user_id,
            "m.typing for a user not joined from the origin"
        );
        return;
    }
    if let Some(sink) = &st.ephemeral {
        sink.typing(room_id, user_id, on, REMOTE_TYPING_TIMEOUT_MS);
    }
}

fn presence(st: &FedState, origin: &str, c: &Value) {
    if !st.config.presence {
        return;
    }
    let Some(sink) = &st.ephemeral else {
        return;
    };
    let entries = c.get("push").and_then(|v| v.as_array());
    for p in entries.into_iter().flatten() {
        let (Some(user_id), Some(state)) = (
            p.get("user_id").and_then(|v| v.as_str()),
            p.get("presence").and_then(|v| v.as_str()),
        ) else {
            continue;
        };
        if server_of(user_id) != Some(origin)
            || !matches!(state, "online" | "unavailable" | "offline")
        {
            continue;
        }
        let status_msg = p
            .get("status_msg")
            .and_then(|v| v.as_str())
            .map(|m| truncate_status_msg(m).to_owned());
        let ago = p
            .get("last_active_ago")
            .and_then(|v| v.as_u64())
            .unwrap_or(0);
        sink.presence(user_id, state, status_msg, ago);
    }
}

/// `m.receipt` content: room id -> receipt type -> user id -> `{event_ids, data}`.
fn receipts(st: &FedState, origin: &str, c: &Value) -> Vec<Fact> {
    let mut out = Vec::new();
    let Some(rooms) = c.as_object() else {
        return out;
    };
    for (room_id, by_type) in rooms {
        // Only public read receipts cross servers; `m.read.private` never should.
        let Some(users) = by_type.get("m.read").and_then(|v| v.as_object()) else {
            continue;
        };
        for (user_id, r) in users {
            if !joined_from(st, origin, room_id, user_id) {
                continue;
            }
            let Some(event_id) = r
                .get("event_ids")
                .and_then(|v| v.as_array())
                .and_then(|ids| ids.iter().rev().find_map(|e| e.as_str()))
            else {
                continue;
            };
            let data = r.get("data");
            out.push(Fact::ReceiptSet {
                user_id: user_id.clone(),
                room_id: room_id.clone(),
                event_id: event_id.to_owned(),
                receipt_type: "m.read".into(),
                thread_id: data
                    .and_then(|d| d.get("thread_id"))
                    .and_then(|v| v.as_str())
                    .map(str::to_owned),
                ts: data
                    .and_then(|d| d.get("ts"))
                    .and_then(|v| v.as_u64())
                    .unwrap_or_else(crate::now_ms),
            });
        }
    }
    out
}

/// `m.direct_to_device` content: `{sender, type, message_id, messages}`.
fn to_device(st: &FedState, origin: &str, c: &Value) -> Option<Fact> {
    let sender = c.get("sender").and_then(|v| v.as_str())?;
    let event_type = c.get("type").and_then(|v| v.as_str())?;
    let message_id = c.get("message_id").and_then(|v| v.as_str())?;
    if server_of(sender) != Some(origin) || event_type.is_empty() || message_id.is_empty() {
        tracing::debug!(origin, "m.direct_to_device EDU refused");
        return None;
    }
    let ours = st.server_name();
    let mut messages = BTreeMap::new();
    for (user, devices) in c.get("messages").and_then(|v| v.as_object())? {
        if server_of(user) != Some(ours) {
            continue;
        }
        let Some(devices) = devices.as_object() else {
            continue;
        };
        let devices: BTreeMap<String, Value> = devices
            .iter()
            .filter(|(_, content)| content.is_object())
            .map(|(d, content)| (d.clone(), content.clone()))
            .collect();
        if !devices.is_empty() {
            messages.insert(user.clone(), devices);
        }
    }
    if messages.is_empty() {
        return None;
    }
    Some(Fact::ToDeviceSent {
        sender: sender.to_owned(),
        sender_device: String::new(),
        event_type: event_type.to_owned(),
        txn_id: format!("{TO_DEVICE_TXN_PREFIX}{message_id}"),
        messages,
    })
}

/// `m.device_list_update` / `m.signing_key_update` content: `user_id` (and
/// `stream_id` for the first).
fn device_list(st: &FedState, origin: &str, kind: &str, c: &Value) -> Option<Fact> {
    let user_id = c.get("user_id").and_then(|v| v.as_str())?;
    let shares = st
        .projections
        .membership
        .rooms_of(user_id)
        .iter()
        .any(|(_, m)| m.membership == "join");
    if server_of(user_id) != Some(origin) || !shares {
        tracing::debug!(
            origin,
            user_id,
            edu_type = kind,
            "device list update refused"
        );
        return None;
    }
    let stream_id = c.get("stream_id").and_then(|v| v.as_u64()).unwrap_or(0);
    let (device, signing_keys) = if kind == "m.device_list_update" {
        (device_update(user_id, c), None)
    } else {
        // Only keys that name the user (a fetch drops others the same way).
        let key = |name: &str| {
            c.get(name)
                .filter(|v| v.get("user_id").and_then(|u| u.as_str()) == Some(user_id))
                .cloned()
        };
        (
            None,
            Some(spindle_journal::RemoteSigningKeys {
                master_key: key("master_key"),
                self_signing_key: key("self_signing_key"),
            }),
        )
    };
    Some(Fact::RemoteDeviceListChanged {
        user_id: user_id.to_owned(),
        stream_id,
        device,
        signing_keys,
    })
}

/// The change an `m.device_list_update` carries, if it names a device: `keys` kept
/// only when they are an object naming this user and device (the client checks the
/// signatures, as for keys the origin answers a query with).
fn device_update(user_id: &str, c: &Value) -> Option<spindle_journal::RemoteDeviceUpdate> {
    let device_id = c.get("device_id").and_then(|v| v.as_str())?;
    let keys = c
        .get("keys")
        .filter(|k| crate::devices::keys_name(k, user_id, device_id))
        .cloned();
    Some(spindle_journal::RemoteDeviceUpdate {
        device_id: device_id.to_owned(),
        prev_id: c
            .get("prev_id")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|p| p.as_u64()).collect())
            .unwrap_or_default(),
        deleted: c.get("deleted").and_then(|v| v.as_bool()).unwrap_or(false),
        keys,
        display_name: c
            .get("device_display_name")
            .and_then(|v| v.as_str())
            .map(str::to_owned),
    })
}

/// What a journal record sends over federation, if anything: our users' PDUs, public
/// receipts and to-device messages to remote users. The sender asks per record.
pub enum Outbound {
    /// A PDU of one of our users, to every other server in the room (and to the
    /// server of a member it removes).
    Pdu(std::sync::Arc<spindle_core::pdu::Pdu>),
    /// A public read receipt of one of our users, to every other server in the room.
    Receipt {
        /// The room.
        room_id: String,
        /// The EDU, the same for every destination.
        edu: Value,
    },
    /// A to-device message from one of our users: per destination server, the EDU
    /// carrying only that server's recipients.
    ToDevice(Vec<(String, Value)>),
    /// A device list or cross-signing change of one of our users, to every server
    /// sharing a room with the user.
    User {
        /// The user.
        user_id: String,
        /// The EDUs, the same for every destination.
        edus: Vec<Value>,
    },
}

/// An `m.device_list_update` EDU for one of our devices (see the module docs).
fn device_list_update(user_id: &str, device_id: &str, stream_id: u64, extra: Value) -> Value {
    let mut content = json!({
        "user_id": user_id,
        "device_id": device_id,
        "stream_id": stream_id,
        "prev_id": [],
    });
    if let (Some(c), Some(extra)) = (content.as_object_mut(), extra.as_object()) {
        c.extend(extra.clone());
    }
    json!({ "edu_type": "m.device_list_update", "content": content })
}

/// The federation side of a record (see [`Outbound`]); `None` for records that send
/// nothing. `device_names`: whether an `m.device_list_update` carries the device's
/// display name (`[federation] allow_device_name_lookup_over_federation`). Reads
/// nothing from the store.
pub fn outbound_of(rec: &StoredRecord, ours: &str, device_names: bool) -> Option<Outbound> {
    if let Some(pdu) = rec.pdu() {
        return (server_of(pdu.sender.as_str()) == Some(ours)).then_some(Outbound::Pdu(pdu));
    }
    match rec.fact()? {
        Fact::ReceiptSet {
            user_id,
            room_id,
            event_id,
            receipt_type,
            thread_id,
            ts,
        } if receipt_type == "m.read" && server_of(&user_id) == Some(ours) => {
            let mut data = json!({ "ts": ts });
            if let Some(t) = thread_id {
                data["thread_id"] = json!(t);
            }
            let edu = json!({
                "edu_type": "m.receipt",
                "content": { &room_id: { "m.read": { &user_id: {
                    "event_ids": [event_id],
                    "data": data,
                }}}},
            });
            Some(Outbound::Receipt { room_id, edu })
        }
        Fact::ToDeviceSent {
            sender,
            event_type,
            messages,
            ..
        } if server_of(&sender) == Some(ours) => {
            let mut by_server: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
            for (user, devices) in messages {
                match server_of(&user) {
                    Some(s) if s != ours => {
                        by_server
                            .entry(s.to_owned())
                            .or_default()
                            .insert(user, json!(devices));
                    }
                    _ => {}
                }
            }
            if by_server.is_empty() {
                return None;
            }
            // Unique per origin and stable across retries: the record's position.
            let message_id = rec.position().to_string();
            Some(Outbound::ToDevice(
                by_server
                    .into_iter()
                    .map(|(server, messages)| {
                        let edu = json!({
                            "edu_type": "m.direct_to_device",
                            "content": {
                                "sender": sender,
                                "type": event_type,
                                "message_id": message_id,
                                "messages": messages,
                            },
                        });
                        (server, edu)
                    })
                    .collect(),
            ))
        }
        Fact::DeviceKeysUploaded {
            user_id,
            device_id,
            device_keys,
        } if server_of(&user_id) == Some(ours) => {
            let edu = device_list_update(
                &user_id,
                &device_id,
                rec.position(),
                json!({ "keys": device_keys }),
            );
            Some(Outbound::User {
                user_id,
                edus: vec![edu],
            })
        }
        Fact::DeviceCreated {
            user_id,
            device_id,
            display_name,
        }
        | Fact::DeviceRenamed {
            user_id,
            device_id,
            display_name,
        } if server_of(&user_id) == Some(ours) => {
            // Hidden names still send the update: the device is new, or the receiver
            // re-fetches `/user/devices` and finds nothing changed (cheap, and it keeps
            // `stream_id` the same whatever the setting).
            let extra = match display_name {
                Some(n) if device_names => json!({ "device_display_name": n }),
                _ => json!({}),
            };
            let edu = device_list_update(&user_id, &device_id, rec.position(), extra);
            Some(Outbound::User {
                user_id,
                edus: vec![edu],
            })
        }
        Fact::DeviceDeleted { user_id, device_id } if server_of(&user_id) == Some(ours) => {
            let edu = device_list_update(
                &user_id,
                &device_id,
                rec.position(),
                json!({ "deleted": true }),
            );
            Some(Outbound::User {
                user_id,
                edus: vec![edu],
            })
        }
        Fact::CrossSigningKeysUploaded {
            user_id,
            master_key,
            self_signing_key,
            ..
        } if server_of(&user_id) == Some(ours) => {
            // The user-signing key is private to the user: never sent.
            let mut content = json!({ "user_id": user_id });
            if let Some(k) = master_key {
                content["master_key"] = k;
            }
            if let Some(k) = self_signing_key {
                content["self_signing_key"] = k;
            }
            if content.as_object().is_some_and(|c| c.len() == 1) {
                return None;
            }
            Some(Outbound::User {
                user_id,
                edus: vec![json!({ "edu_type": "m.signing_key_update", "content": content })],
            })
        }
        Fact::SignaturesUploaded { signatures } => {
            // A user's signature on one of their own devices (self-signing) changes that
            // device's keys as others see them; the receiver fetches them again.
            let mut own: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
            for sig in signatures {
                if sig.user_id == sig.signer && server_of(&sig.user_id) == Some(ours) {
                    own.entry(sig.user_id).or_default().insert(sig.key_id);
                }
            }
            // One record signs for one user in practice (the uploader); the first is kept.
            let (user_id, keys) = own.into_iter().next()?;
            let edus = keys
                .iter()
                .map(|k| device_list_update(&user_id, k, rec.position(), json!({})))
                .collect();
            Some(Outbound::User { user_id, edus })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_msg_is_cut_at_a_char_boundary_at_or_below_the_byte_cap() {
        let at_cap = "é".repeat(512);
        assert_eq!(at_cap.len(), 1024);
        assert_eq!(truncate_status_msg(&at_cap), at_cap);
        // 1,025 bytes: byte 1,024 is inside the last "é", so the cut keeps 1,023.
        let over = format!("a{at_cap}");
        assert_eq!(truncate_status_msg(&over), format!("a{}", "é".repeat(511)));
        assert_eq!(truncate_status_msg(&over).len(), 1023);
        assert_eq!(truncate_status_msg(&"x".repeat(1025)), "x".repeat(1024));
    }

    fn fact_record(position: u64, fact: &Fact) -> StoredRecord {
        use spindle_journal::record::{RECORD_FORMAT, Record, RecordKind};
        let rec = Record {
            format: RECORD_FORMAT,
            position,
            prev_hash: [0; 32],
            appended_at: 1,
            kind: RecordKind::Fact,
            room_id: None,
            event_id: None,
            room_version: None,
            principal: "@alice:ours.test".into(),
            device_id: None,
            txn_id: None,
            command_signature: String::new(),
            payload: serde_json::to_vec(fact).unwrap(),
        };
        StoredRecord::from_bytes(&rec.encode()).unwrap()
    }

    fn device_list_edus(out: Option<Outbound>) -> Vec<Value> {
        match out {
            Some(Outbound::User { user_id, edus }) => {
                assert_eq!(user_id, "@alice:ours.test");
                edus
            }
            _ => panic!("not a device list change"),
        }
    }

    #[test]
    fn device_list_updates_carry_the_display_name_only_when_allowed() {
        let created = fact_record(
            7,
            &Fact::DeviceCreated {
                user_id: "@alice:ours.test".into(),
                device_id: "PHONE".into(),
                display_name: Some("Alice's phone".into()),
            },
        );
        let renamed = fact_record(
            8,
            &Fact::DeviceRenamed {
                user_id: "@alice:ours.test".into(),
                device_id: "PHONE".into(),
                display_name: Some("Work phone".into()),
            },
        );
        let edu = |stream_id: u64, name: Option<&str>| {
            let mut content = json!({
                "user_id": "@alice:ours.test",
                "device_id": "PHONE",
                "stream_id": stream_id,
                "prev_id": [],
            });
            if let Some(n) = name {
                content["device_display_name"] = json!(n);
            }
            json!({ "edu_type": "m.device_list_update", "content": content })
        };
        assert_eq!(
            device_list_edus(outbound_of(&created, "ours.test", false)),
            vec![edu(7, None)]
        );
        assert_eq!(
            device_list_edus(outbound_of(&renamed, "ours.test", false)),
            vec![edu(8, None)]
        );
        assert_eq!(
            device_list_edus(outbound_of(&created, "ours.test", true)),
            vec![edu(7, Some("Alice's phone"))]
        );
        assert_eq!(
            device_list_edus(outbound_of(&renamed, "ours.test", true)),
            vec![edu(8, Some("Work phone"))]
        );
    }
}
