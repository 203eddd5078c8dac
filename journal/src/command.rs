//! Commands: what the API (and later federation) asks the journal to do.
//!
//! Every command travels in a [`SignedCommand`]: the envelope (principal, device,
//! time, body) signed with the server key. The journal verifies the signature before
//! it authorizes anything and keeps it in the record, so the audit trail shows who
//! asked for each change.

use serde::{Deserialize, Serialize};
use spindle_core::keys::ServerKey;

use crate::record::Fact;

/// One event to build in a room.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct EventSpec {
    /// Event type.
    #[serde(rename = "type")]
    pub kind: String,
    /// State key (state events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_key: Option<String>,
    /// Content object.
    pub content: serde_json::Value,
    /// For `m.room.redaction`: the event to redact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redacts: Option<String>,
}

/// What the command asks for.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
#[allow(missing_docs)] // Fields carry the spec's names; each variant says what it asks for.
pub enum CommandBody {
    /// Create a room: the first event must be `m.room.create`; the rest (creator's
    /// join, power levels, preset state, initial state, name, topic, invites) follow in
    /// order, all sent by the principal.
    CreateRoom {
        room_version: String,
        events: Vec<EventSpec>,
        /// A local alias to create for the room (`room_alias_name`), reserved
        /// atomically with the room's creation.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        alias: Option<String>,
    },
    /// Send one event into an existing room as the principal.
    SendEvent {
        room_id: String,
        event: EventSpec,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        txn_id: Option<String>,
        /// For member events: a condition on the target's current membership, checked
        /// under the room lock (so two unbans or a kick racing a join cannot both act).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        precondition: Option<MembershipPrecondition>,
    },
    /// Record a non-room fact.
    Fact { fact: Fact },
    /// Claim one-time keys (spec: `POST /keys/claim`): for each (user, device,
    /// algorithm), the journal picks an unclaimed one-time key, or the fallback key when
    /// none is left, and appends one [`Fact::OneTimeKeysClaimed`]. Requests for devices
    /// with no key of the algorithm get nothing.
    ClaimOneTimeKeys { requests: Vec<KeyClaimRequest> },
    /// Join a room another server hosts (spec: server-server API, "Joining Rooms",
    /// joining server side): `join` is our user's join event, already signed and
    /// accepted by the resident server through `send_join`; `state` and `auth_chain`
    /// are what it answered. The journal verifies every PDU (signatures with `keys`,
    /// content hash, room, auth rules against its own auth events), appends the auth
    /// chain and state as outlier records (state and memberships, not timeline), then
    /// the join as the room's first timeline event here. A room already known here
    /// gets only the events it lacks.
    ///
    /// `partial_state` (MSC3902) is set when the resident omitted the member events
    /// (`members_omitted: true`) and holds its `servers_in_room`: the join is then
    /// followed by a [`crate::Fact::RoomStatePartial`] record, and the room's full state
    /// comes later with [`CommandBody::CompletePartialState`].
    ImportRemoteRoom {
        room_id: String,
        room_version: String,
        auth_chain: Vec<serde_json::Value>,
        state: Vec<serde_json::Value>,
        join: serde_json::Value,
        keys: crate::remote::VerifyKeys,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        partial_state: Option<Vec<String>>,
    },
    /// Complete a partial-state room (MSC3902): `state` and `auth_chain` are a
    /// resident's answer to `/state?event_id=` at our join. Each PDU is verified and
    /// authorized against its own auth events; the state events whose slot the room
    /// has no value for yet become outlier records, or [`crate::RecordKind::StateResolved`]
    /// records when the room already holds the event (backfilled history) (a slot
    /// already set was set by the partial state or by an event after the join, which is
    /// newer); the auth chain is used for authorization only. Then a [`crate::Fact::RoomStateCompleted`]. A room
    /// that is not partial gets nothing.
    CompletePartialState {
        room_id: String,
        state: Vec<serde_json::Value>,
        auth_chain: Vec<serde_json::Value>,
        keys: crate::remote::VerifyKeys,
    },
    /// Keep a membership event of a room this server is not in as an outlier (spec:
    /// server-server API, "Inviting to a room" and "Leaving Rooms (Rejecting
    /// Invites)"): an invite for one of our users (countersigned by us, with the
    /// inviter's `invite_room_state` kept in `unsigned`), or our user's leave that
    /// rejected one. Its signatures are verified with `keys`; auth rules cannot be
    /// checked without the room's state, which the remote server answers for.
    RemoteOutlier {
        room_id: String,
        room_version: String,
        pdu: serde_json::Value,
        keys: crate::remote::VerifyKeys,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        invite_room_state: Option<serde_json::Value>,
    },
    /// Append a PDU another server built and signed (spec: server-server API, "Checks
    /// performed on receipt of a PDU"). The principal is the origin server; `keys` are
    /// the verify keys (server -> key id -> unpadded base64) the federation layer
    /// fetched for the servers that must have signed it; `event_id`, when the request
    /// named one (`send_join`), must match the PDU's reference hash.
    ///
    /// `auth_events` matter only while the room's state is partial (MSC3902): the
    /// PDU's auth events the room does not hold (a member we have not heard of yet),
    /// fetched with `/event_auth`. They are verified and authorized by their own auth
    /// events, then used to authorize the PDU, which is checked against its auth events
    /// alone (the partial state cannot judge it); they are not appended.
    RemotePdu {
        room_id: String,
        pdu: serde_json::Value,
        keys: crate::remote::VerifyKeys,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        auth_events: Vec<serde_json::Value>,
    },
    /// History from before this server's first event in a room, fetched with
    /// `/backfill` (spec: server-server API, "Backfilling and retrieving missing
    /// events"), newest first. Each PDU is verified (event id, signatures, content
    /// hash, room) and authorized against its own `auth_events`; one the room already
    /// has in its timeline is skipped, one it holds only as an outlier (state imported
    /// on join) joins the timeline now. Accepted PDUs become [`crate::RecordKind::Backfilled`]
    /// records in the order given; refused ones a `RemotePduRejected` fact each.
    ///
    /// `auth_events` are auth events the PDUs name that the room does not hold (old
    /// member events, typically), fetched by the federation layer: verified and used to
    /// authorize the batch, not appended.
    Backfill {
        room_id: String,
        pdus: Vec<serde_json::Value>,
        #[serde(default)]
        auth_events: Vec<serde_json::Value>,
        keys: crate::remote::VerifyKeys,
    },
}

/// One (user, device, algorithm) asked for by a claim.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct KeyClaimRequest {
    /// Owner of the device.
    pub user_id: String,
    /// Device.
    pub device_id: String,
    /// Key algorithm, e.g. `signed_curve25519`.
    pub algorithm: String,
}

/// A condition on the target's membership at commit time.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct MembershipPrecondition {
    /// Memberships the target may currently have; `"none"` means no member event yet.
    pub allowed: Vec<String>,
    /// If the target already has the membership being sent, succeed without a new event
    /// (an invite to someone already invited, a ban of someone already banned).
    pub unchanged_ok: bool,
}

/// The signed part of a command.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CommandEnvelope {
    /// The user (or server name) asking.
    pub principal: String,
    /// The device the request came from.
    pub device_id: Option<String>,
    /// When the request arrived, ms since the Unix epoch; becomes `origin_server_ts`.
    pub issued_at: u64,
    /// What to do.
    pub body: CommandBody,
}

/// A command with the server key's signature over its canonical JSON. Serializable:
/// a process of a shared journal forwards it to the writer as it is ([`crate::nats`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SignedCommand {
    /// The signed envelope.
    pub envelope: CommandEnvelope,
    /// Unpadded base64 ed25519 signature of [`CommandEnvelope::canonical_bytes`].
    pub signature: String,
    /// What [`SignedCommand::sign`] signed in this process: a command whose envelope
    /// still has exactly these bytes, signature and key is verified by comparing
    /// bytes instead of checking the ed25519 signature again (the journal's check of
    /// a command it just watched being signed). Never serialized: a forwarded or
    /// stored command is verified in full.
    #[serde(skip)]
    signed_here: Option<std::sync::Arc<SignedHere>>,
}

/// See [`SignedCommand`]'s `signed_here`.
#[derive(Debug)]
struct SignedHere {
    bytes: Vec<u8>,
    signature: String,
    public_key: String,
}

impl CommandEnvelope {
    /// The bytes that are signed: the envelope as JSON with object keys sorted (the
    /// `serde_json::Value` map is ordered). Not canonical JSON in the spec's sense:
    /// account data may carry floats, which canonical JSON forbids; room event content
    /// is still held to canonical JSON when its PDU is built.
    pub fn canonical_bytes(&self) -> Result<Vec<u8>, String> {
        let value = serde_json::to_value(self).map_err(|e| e.to_string())?;
        serde_json::to_vec(&value).map_err(|e| e.to_string())
    }
}

impl SignedCommand {
    /// Signs an envelope with the server key.
    pub fn sign(key: &ServerKey, envelope: CommandEnvelope) -> Result<SignedCommand, String> {
        let bytes = envelope.canonical_bytes()?;
        let signature = key.sign_bytes(&bytes);
        Ok(SignedCommand {
            signature: signature.clone(),
            envelope,
            signed_here: Some(std::sync::Arc::new(SignedHere {
                bytes,
                signature,
                public_key: key.public_key_base64(),
            })),
        })
    }

    /// Checks the signature with `key`: `bytes` are the envelope's canonical bytes
    /// now. Signed by this process with `key` and unchanged since: a comparison;
    /// otherwise an ed25519 verification. Returns whether the ed25519 check ran;
    /// errors when the signature does not match.
    pub(crate) fn verify(&self, key: &ServerKey, bytes: &[u8]) -> Result<bool, String> {
        if let Some(here) = &self.signed_here
            && here.bytes == bytes
            && here.signature == self.signature
            && here.public_key == key.public_key_base64()
        {
            return Ok(false);
        }
        key.verify_bytes(bytes, &self.signature)
            .map(|()| true)
            .map_err(|e| e.to_string())
    }
}
