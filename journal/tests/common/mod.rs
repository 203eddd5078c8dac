//! Fixtures the journal's integration tests share: signed commands and the event
//! specs they carry. Each test binary uses a part of them.
#![allow(dead_code, unreachable_pub)]

use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, CommandEnvelope, EventSpec, SignedCommand};

/// The local user most tests act as.
pub const ALICE: &str = "@alice:example.org";

/// `body` as a command of `principal` (from `device_id`, if any), issued at a fixed
/// time (1,700,000,000,000 ms) and signed by `key`.
pub fn signed_by(
    key: &ServerKey,
    principal: &str,
    device_id: Option<&str>,
    body: CommandBody,
) -> SignedCommand {
    let envelope = CommandEnvelope {
        principal: principal.into(),
        device_id: device_id.map(Into::into),
        issued_at: 1_700_000_000_000,
        body,
    };
    SignedCommand::sign(key, envelope).unwrap()
}

/// `body` as a command of [`ALICE`] from device `DEV`.
pub fn signed(key: &ServerKey, body: CommandBody) -> SignedCommand {
    signed_by(key, ALICE, Some("DEV"), body)
}

/// A state event spec.
pub fn state(kind: &str, state_key: &str, content: serde_json::Value) -> EventSpec {
    EventSpec {
        kind: kind.into(),
        state_key: Some(state_key.into()),
        content,
        redacts: None,
    }
}

/// A v11 room of [`ALICE`]'s (create and join), with `alias` if given.
pub fn create_room(alias: Option<&str>) -> CommandBody {
    CommandBody::CreateRoom {
        room_version: "11".into(),
        events: vec![
            state("m.room.create", "", json!({ "room_version": "11" })),
            state("m.room.member", ALICE, json!({ "membership": "join" })),
        ],
        alias: alias.map(Into::into),
    }
}

/// An `m.text` message whose body is `body`, with client transaction id `txn_id`.
pub fn message(room: &str, body: &str, txn_id: Option<&str>) -> CommandBody {
    CommandBody::SendEvent {
        room_id: room.into(),
        event: EventSpec {
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "msgtype": "m.text", "body": body }),
            redacts: None,
        },
        txn_id: txn_id.map(Into::into),
        precondition: None,
    }
}
