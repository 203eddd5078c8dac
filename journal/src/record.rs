//! The journal record: the one durable unit of truth (BRIEF §3.1).
//!
//! A record is an rkyv-encoded envelope. Room events carry the PDU's canonical JSON
//! bytes; every other fact carries a small JSON document ([`Fact`]). The envelope
//! format is versioned ([`RECORD_FORMAT`]) so a later release can read old journals
//! (format 1 is read by [`v1`] for `spindle journal migrate`).
//!
//! Tamper evidence: every record carries `prev_hash`, the blake3 hash of the previous
//! record's stored bytes ([`record_hash`]); the first record's is all zeros
//! ([`GENESIS_HASH`]). Changing, removing or reordering any record breaks the chain at
//! the next one; see `chain.rs`.

use rkyv::{Archive, Deserialize, Serialize};

/// Version of the record envelope. Bump on any layout change and keep a reader for
/// every older version. Format 2 added `prev_hash` (the hash chain).
pub const RECORD_FORMAT: u16 = 2;

/// `prev_hash` of the record at position 1.
pub const GENESIS_HASH: [u8; 32] = [0; 32];

/// The hash of a record: blake3 of its stored bytes (exactly what the store keeps
/// under its position). The next record's `prev_hash` must equal it.
pub fn record_hash(stored_bytes: &[u8]) -> [u8; 32] {
    *blake3::hash(stored_bytes).as_bytes()
}

/// What a record holds.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum RecordKind {
    /// A room event; `payload` is the signed PDU's canonical JSON.
    Event,
    /// A non-room fact; `payload` is a JSON [`Fact`].
    Fact,
    /// A room event known only as state or as an auth event: part of the state and
    /// auth chain a resident server handed over when we joined its room (spec:
    /// server-server API, "outliers"). It counts for the room's state and
    /// memberships, but is not in the room's timeline. `payload` is the signed PDU.
    Outlier,
    /// A state event of the room, already appended, that state resolution made current
    /// again after a fork ([`crate::fork`]): the projections of room state apply it as
    /// the slot's value; it is not a new event and not in the timeline. `payload` is
    /// the signed PDU (as its first record has it).
    StateResolved,
    /// A room event from before this server's first event in the room, fetched with
    /// `/backfill`: timeline history older than everything else of the room here. It
    /// changes no current state (state projections ignore it). `payload` is the signed
    /// PDU.
    Backfilled,
    /// A remote PDU that passed the auth rules against the state before it but not
    /// against the room's current state (spec: server-server API, "Soft failure"; for
    /// example a message from a user banned meanwhile on a branch its server had not
    /// seen). Kept so the room's DAG stays whole (later events may name it), but it is
    /// no forward extremity, changes no state, and no projection serves it to clients.
    /// `payload` is the signed PDU.
    SoftFailed,
}

/// One journal record, exactly as stored (key: the global position, big-endian u64).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Record {
    /// [`RECORD_FORMAT`] at the time of writing.
    pub format: u16,
    /// Global stream position (1-based, contiguous).
    pub position: u64,
    /// [`record_hash`] of the record at `position - 1` ([`GENESIS_HASH`] at position 1).
    /// Set by the appender, which sees records in position order.
    pub prev_hash: [u8; 32],
    /// Server wall clock at append, ms since the Unix epoch (for audit only; projections
    /// never read the clock, they read this).
    pub appended_at: u64,
    /// Event or fact.
    pub kind: RecordKind,
    /// Room of an event record.
    pub room_id: Option<String>,
    /// Event id of an event record.
    pub event_id: Option<String>,
    /// Room version of an event record.
    pub room_version: Option<String>,
    /// Who asked: a local user id (or the server name for server-originated facts).
    pub principal: String,
    /// The device that asked, when a client did.
    pub device_id: Option<String>,
    /// Client transaction id, for idempotent sends.
    pub txn_id: Option<String>,
    /// Command envelope signature (unpadded base64, server key) kept for the audit trail.
    pub command_signature: String,
    /// Canonical JSON of the PDU, or JSON of the [`Fact`].
    pub payload: Vec<u8>,
}

impl Record {
    /// Encodes the record with rkyv.
    pub fn encode(&self) -> Vec<u8> {
        rkyv::to_bytes::<rkyv::rancor::Error>(self)
            .expect("record encodes")
            .into_vec()
    }
}

/// A record as read back from storage: its rkyv bytes, validated once, read in place
/// through the archived layout (no deserialization; the PDU's canonical JSON is a
/// borrowed slice of the stored bytes).
pub struct StoredRecord {
    bytes: rkyv::util::AlignedVec<16>,
    /// The PDU, parsed on first use and shared by every reader of this record (the
    /// projections read one `Arc<StoredRecord>` from the journal's recent tail, so a
    /// PDU is parsed once, not once per projection).
    parsed: std::sync::OnceLock<Option<std::sync::Arc<spindle_core::pdu::Pdu>>>,
    /// [`StoredRecord::class`], computed on first use.
    class: std::sync::OnceLock<crate::Interest>,
}

impl std::fmt::Debug for StoredRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredRecord")
            .field("position", &self.position())
            .field("event", &self.is_event())
            .finish()
    }
}

impl StoredRecord {
    /// Copies stored bytes into an aligned buffer and validates the layout (bytecheck).
    /// Errors on torn or foreign bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<StoredRecord, String> {
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        rkyv::access::<ArchivedRecord, rkyv::rancor::Error>(&aligned).map_err(|e| e.to_string())?;
        Ok(StoredRecord {
            bytes: aligned,
            parsed: std::sync::OnceLock::new(),
            class: std::sync::OnceLock::new(),
        })
    }

    /// The archived record, in place.
    #[allow(unsafe_code)] // Zero-copy access to bytes validated in `from_bytes`.
    pub fn view(&self) -> &ArchivedRecord {
        // SAFETY: `from_bytes` is the only constructor; it validated these exact bytes as
        // an `ArchivedRecord` with bytecheck, and the buffer is private and never mutated.
        unsafe { rkyv::access_unchecked::<ArchivedRecord>(&self.bytes) }
    }

    /// Global position.
    pub fn position(&self) -> u64 {
        self.view().position.to_native()
    }

    /// Envelope format the record was written in.
    pub fn format(&self) -> u16 {
        self.view().format.to_native()
    }

    /// The previous record's hash, as this record carries it.
    pub fn prev_hash(&self) -> [u8; 32] {
        self.view().prev_hash
    }

    /// This record's hash ([`record_hash`] of its stored bytes).
    pub fn hash(&self) -> [u8; 32] {
        record_hash(&self.bytes)
    }

    /// The stored bytes (what [`record_hash`] covers; what exports carry).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Server wall clock at append (ms since the Unix epoch).
    pub fn appended_at(&self) -> u64 {
        self.view().appended_at.to_native()
    }

    /// Whether this is a room event of the timeline (else a fact or an outlier).
    pub fn is_event(&self) -> bool {
        matches!(self.view().kind, ArchivedRecordKind::Event)
    }

    /// Whether this is a fact ([`RecordKind::Fact`]): not a room record.
    pub fn is_fact(&self) -> bool {
        matches!(self.view().kind, ArchivedRecordKind::Fact)
    }

    /// The record with its class already known (the appender computed it from the
    /// same payload), so [`StoredRecord::class`] does not scan the JSON again.
    pub(crate) fn with_class(self, class: crate::Interest) -> StoredRecord {
        let _ = self.class.set(class);
        self
    }

    /// The record's class ([`crate::Interest::class_of`]): what the appender woke
    /// tailers by, and what a projection's [`crate::Interest`] filters on.
    pub fn class(&self) -> crate::Interest {
        *self
            .class
            .get_or_init(|| crate::Interest::class_of(self.is_fact(), self.payload()))
    }

    /// Whether this is an outlier: a room event imported as state or auth chain.
    pub fn is_outlier(&self) -> bool {
        matches!(self.view().kind, ArchivedRecordKind::Outlier)
    }

    /// Whether this re-asserts a state event after state resolution
    /// ([`RecordKind::StateResolved`]).
    pub fn is_state_resolved(&self) -> bool {
        matches!(self.view().kind, ArchivedRecordKind::StateResolved)
    }

    /// Whether this is backfilled history ([`RecordKind::Backfilled`]).
    pub fn is_backfilled(&self) -> bool {
        matches!(self.view().kind, ArchivedRecordKind::Backfilled)
    }

    /// Whether this is a soft-failed remote PDU ([`RecordKind::SoftFailed`]).
    pub fn is_soft_failed(&self) -> bool {
        matches!(self.view().kind, ArchivedRecordKind::SoftFailed)
    }

    /// Whether the payload is a PDU (every kind but a fact).
    pub fn carries_pdu(&self) -> bool {
        self.applies_to_state() || self.is_backfilled() || self.is_soft_failed()
    }

    /// The PDU of any record that carries one ([`StoredRecord::carries_pdu`]).
    pub fn any_pdu(&self) -> Option<std::sync::Arc<spindle_core::pdu::Pdu>> {
        if !self.carries_pdu() {
            return None;
        }
        self.parse_pdu()
    }

    /// Whether projections of room state (current state, memberships, directory,
    /// summaries) apply this record: an event, an outlier, or resolved state.
    pub fn applies_to_state(&self) -> bool {
        self.is_event() || self.is_outlier() || self.is_state_resolved()
    }

    /// The PDU of an event, outlier or resolved-state record (projections of room state
    /// use it; timeline-only projections keep to [`StoredRecord::pdu`]).
    pub fn room_pdu(&self) -> Option<std::sync::Arc<spindle_core::pdu::Pdu>> {
        if !self.applies_to_state() {
            return None;
        }
        self.parse_pdu()
    }

    /// Room id of an event record.
    pub fn room_id(&self) -> Option<&str> {
        self.view().room_id.as_ref().map(|s| s.as_str())
    }

    /// Event id of an event record.
    pub fn event_id(&self) -> Option<&str> {
        self.view().event_id.as_ref().map(|s| s.as_str())
    }

    /// Room version of an event record.
    pub fn room_version(&self) -> Option<&str> {
        self.view().room_version.as_ref().map(|s| s.as_str())
    }

    /// Who asked.
    pub fn principal(&self) -> &str {
        self.view().principal.as_str()
    }

    /// The device that asked.
    pub fn device_id(&self) -> Option<&str> {
        self.view().device_id.as_ref().map(|s| s.as_str())
    }

    /// Client transaction id.
    pub fn txn_id(&self) -> Option<&str> {
        self.view().txn_id.as_ref().map(|s| s.as_str())
    }

    /// The command signature kept for the audit trail.
    pub fn command_signature(&self) -> &str {
        self.view().command_signature.as_str()
    }

    /// The payload bytes (PDU canonical JSON or fact JSON), borrowed.
    pub fn payload(&self) -> &[u8] {
        self.view().payload.as_slice()
    }

    /// Parses the payload of a fact record.
    pub fn fact(&self) -> Option<Fact> {
        if !matches!(self.view().kind, ArchivedRecordKind::Fact) {
            return None;
        }
        serde_json::from_slice(self.payload()).ok()
    }

    /// Parses the PDU of an event record.
    pub fn pdu(&self) -> Option<std::sync::Arc<spindle_core::pdu::Pdu>> {
        if !self.is_event() {
            return None;
        }
        self.parse_pdu()
    }

    /// Parses the payload as a PDU once; later calls (by any holder of this record)
    /// share the result.
    fn parse_pdu(&self) -> Option<std::sync::Arc<spindle_core::pdu::Pdu>> {
        self.parsed
            .get_or_init(|| {
                let event_id = self
                    .event_id()
                    .and_then(|e| ruma::OwnedEventId::try_from(e).ok());
                let room_id = self
                    .room_id()
                    .and_then(|r| ruma::OwnedRoomId::try_from(r).ok());
                spindle_core::pdu::Pdu::parse(
                    self.payload(),
                    self.room_version()?,
                    event_id,
                    room_id,
                )
                .ok()
                .map(std::sync::Arc::new)
            })
            .clone()
    }

    /// Deserializes into an owned [`Record`] (exports, tests).
    pub fn to_record(&self) -> Record {
        rkyv::deserialize::<Record, rkyv::rancor::Error>(self.view())
            .expect("validated record deserializes")
    }
}

/// Non-room facts (BRIEF §3.1). Serialized as JSON with a `type` tag; unknown fields
/// are kept out on purpose so a fact's meaning never depends on a later reading.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(missing_docs)] // Fields carry the spec's names (user_id, device_id, ...); each variant says what it means.
pub enum Fact {
    /// Another server's PDU was refused (bad signature, failed auth, unknown room, ...):
    /// kept so the audit trail shows what arrived and why it is not in the room.
    RemotePduRejected {
        origin: String,
        room_id: String,
        event_id: String,
        reason: String,
    },
    /// A local account was created. `password_hash` is an argon2 PHC string. `guest`
    /// marks a guest account (spec: "Guest Access", `POST /register?kind=guest`): it
    /// may call only the guest endpoints and join only rooms whose
    /// `m.room.guest_access` is `can_join`. Left out when false, so records of full
    /// accounts read as they always did.
    AccountRegistered {
        user_id: String,
        password_hash: Option<String>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        guest: bool,
    },
    /// A guest account became a full account (spec: "Guest Access": the guest
    /// registered with its `guest_access_token`), keeping its user id, memberships and
    /// devices; `password_hash` (argon2 PHC) when the registration gave a password.
    GuestUpgraded {
        user_id: String,
        password_hash: Option<String>,
    },
    /// A device was created (or logged in again with the same id).
    DeviceCreated {
        user_id: String,
        device_id: String,
        display_name: Option<String>,
    },
    /// A device's display name changed.
    DeviceRenamed {
        user_id: String,
        device_id: String,
        display_name: Option<String>,
    },
    /// A device was deleted; its tokens are revoked with it.
    DeviceDeleted { user_id: String, device_id: String },
    /// Another server said a user of its own changed their device list or
    /// cross-signing keys (`m.device_list_update` or `m.signing_key_update` EDU, spec:
    /// server-server API "Device Management"): everyone here who shares a room with
    /// the user hears of it in `device_lists.changed` and asks for the keys again.
    /// `stream_id` is the origin's, as sent (0 for a cross-signing update).
    ///
    /// `device` carries an `m.device_list_update`'s change and `signing_keys` an
    /// `m.signing_key_update`'s keys; the device keys projection applies them to its
    /// copy of the user's device list when they chain (`prev_id`), and marks the copy
    /// stale when they do not (records written before the copy existed carry
    /// neither: stale too).
    RemoteDeviceListChanged {
        user_id: String,
        stream_id: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<RemoteDeviceUpdate>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signing_keys: Option<RemoteSigningKeys>,
    },
    /// The whole device list of another server's user, as its server answered
    /// `GET /_matrix/federation/v1/user/devices/{userId}` (spec: server-server API
    /// "Device Management"): fetched when an update did not chain onto our copy, or
    /// when a key query met a user we share a room with but hold no copy of. Replaces
    /// the copy; `stream_id` is the origin's, as of the answer.
    RemoteDeviceListResynced {
        user_id: String,
        stream_id: u64,
        devices: Vec<RemoteDevice>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        master_key: Option<serde_json::Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        self_signing_key: Option<serde_json::Value>,
    },
    /// Our user joined a room another server hosts and the resident answered
    /// `send_join` without the room's member events (MSC3706/MSC3902, spec:
    /// server-server API `send_join` `omit_members`): from this record on the room's
    /// state here is *partial*. Events are authorized against their own auth events,
    /// our events go to `servers_in_room` as well as to the servers of members we know,
    /// and the full state is fetched in the background. Appended right after the join.
    RoomStatePartial {
        room_id: String,
        join_event_id: String,
        servers_in_room: Vec<String>,
    },
    /// The full state of a partial-state room ([`Fact::RoomStatePartial`]) has been
    /// imported: the member events it lacked were appended as outlier records just
    /// before this one. From here on the room is like any other.
    RoomStateCompleted { room_id: String },
    /// A device was used at `ts` (ms since the Unix epoch, the server's clock when the
    /// API saw the request) from `ip` with `user_agent`. Journaled when the address or
    /// the user agent changes (at most once a minute per device) and otherwise at most
    /// once an hour, never per request. `ip` is `None` when the server keeps no client
    /// addresses (`[devices] keep_client_addresses = false`).
    DeviceSeen {
        user_id: String,
        device_id: String,
        ts: u64,
        ip: Option<String>,
        user_agent: Option<String>,
    },
    /// An access token was issued. Only the blake3 hash of the token is stored.
    TokenIssued {
        user_id: String,
        device_id: String,
        token_hash: String,
    },
    /// An access token was revoked (logout).
    TokenRevoked { token_hash: String },
    /// A filter was stored (spec: `POST /user/{userId}/filter`).
    FilterCreated {
        user_id: String,
        filter_id: String,
        filter: serde_json::Value,
    },
    /// Global (`room_id: None`) or per-room account data was set.
    AccountDataSet {
        user_id: String,
        room_id: Option<String>,
        data_type: String,
        content: serde_json::Value,
    },
    /// A receipt (`m.read`, `m.read.private`) was set; `ts` is the server's time.
    ReceiptSet {
        user_id: String,
        room_id: String,
        event_id: String,
        receipt_type: String,
        thread_id: Option<String>,
        ts: u64,
    },
    /// Profile fields changed. `None` leaves a field as it was; `Some(None)` clears it.
    ProfileSet {
        user_id: String,
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            deserialize_with = "present"
        )]
        displayname: Option<Option<String>>,
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            deserialize_with = "present"
        )]
        avatar_url: Option<Option<String>>,
    },
    /// A room alias was created.
    AliasSet {
        alias: String,
        room_id: String,
        creator: String,
    },
    /// A room alias was deleted.
    AliasDeleted { alias: String },
    /// A user forgot a room they left.
    RoomForgotten { user_id: String, room_id: String },
    /// An account was made a server admin (`spindle admin promote`; principal: the
    /// server). Admins may use the admin API (`/_spindle/admin/v1`).
    AdminPromoted { user_id: String },
    /// A server admin took admin rights away from an account (Synapse admin API `PUT
    /// /_synapse/admin/v1/users/{userId}/admin` with `admin: false`). Only rights
    /// given by [`Fact::AdminPromoted`] can be taken away: config `admins` stay.
    AdminRevoked { user_id: String },
    /// A server admin quarantined a media id of this server (Synapse admin API): it is
    /// no longer served (404), its metadata stays.
    MediaQuarantined {
        media_id: String,
        quarantined_by: String,
    },
    /// A server admin deleted a media id of this server (Synapse admin API): it is no
    /// longer served or listed; the id is never reused. The blob is shared by content
    /// hash, so its bytes stay until no media names them (`spindle verify-media`).
    MediaDeleted { media_id: String },
    /// A server admin deleted an event report; `report_id` is the position of its
    /// [`Fact::ContentReported`] record.
    ContentReportDeleted { report_id: u64 },
    /// A server admin shut a room down (Synapse admin API `DELETE
    /// /_synapse/admin/v2/rooms/{roomId}`), journaled once every local member had been
    /// made to leave: what was done, for the delete status and the audit trail.
    /// `delete_id` names the operation; `block` asked that local users never join again.
    RoomShutDown {
        room_id: String,
        delete_id: String,
        requester: String,
        kicked_users: Vec<String>,
        failed_to_kick_users: Vec<String>,
        local_aliases: Vec<String>,
        new_room_id: Option<String>,
        block: bool,
        purge: bool,
    },
    /// The account's password changed (`POST /account/password`); `password_hash` is
    /// an argon2 PHC string.
    PasswordChanged {
        user_id: String,
        password_hash: String,
    },
    /// The account was deactivated (`POST /account/deactivate`): it can no longer log
    /// in, and its id is never registered again. `erase` asks for the profile to be
    /// hidden. Its devices, tokens and memberships end through their own records.
    AccountDeactivated { user_id: String, erase: bool },
    /// A refreshable access token and its refresh token were issued (login or register
    /// with `refresh_token: true`). Hashes only; the access token stops working at
    /// `expires_at` (ms since the Unix epoch, checked by the API against its clock).
    RefreshableTokenIssued {
        user_id: String,
        device_id: String,
        token_hash: String,
        refresh_token_hash: String,
        expires_at: u64,
    },
    /// `POST /refresh`: the refresh token `old_refresh_token_hash` was spent for a new
    /// access/refresh pair; the old pair is revoked. The journal lets each refresh
    /// token be spent once.
    TokenRefreshed {
        user_id: String,
        device_id: String,
        old_refresh_token_hash: String,
        token_hash: String,
        refresh_token_hash: String,
        expires_at: u64,
    },
    /// A room's visibility in the public room directory (`public` or `private`).
    RoomVisibilitySet { room_id: String, visibility: String },
    /// An application service listed (`public`) or unlisted (`private`) a room in its
    /// published room directory for one third-party network (`PUT
    /// /directory/list/appservice/{networkId}/{roomId}`).
    AppserviceRoomListed {
        appservice_id: String,
        network_id: String,
        room_id: String,
        visibility: String,
    },
    /// A user reported an event (`event_id`) or a whole room (`event_id: None`).
    ContentReported {
        reporter: String,
        room_id: String,
        event_id: Option<String>,
        reason: Option<String>,
        score: Option<i64>,
    },
    /// A device published its identity keys (spec: `POST /keys/upload`, `device_keys`):
    /// the signed `DeviceKeys` object as uploaded. Replaces earlier keys of the device.
    DeviceKeysUploaded {
        user_id: String,
        device_id: String,
        device_keys: serde_json::Value,
    },
    /// A device published one-time keys, `"<algorithm>:<key id>" -> key`. The journal
    /// keeps only ids the device does not already have unclaimed (first upload wins), so
    /// the record holds exactly the keys that became claimable.
    OneTimeKeysUploaded {
        user_id: String,
        device_id: String,
        one_time_keys: std::collections::BTreeMap<String, serde_json::Value>,
    },
    /// A device published fallback keys, `"<algorithm>:<key id>" -> key`; each replaces
    /// the device's fallback key of that algorithm and starts unused.
    FallbackKeysUploaded {
        user_id: String,
        device_id: String,
        fallback_keys: std::collections::BTreeMap<String, serde_json::Value>,
    },
    /// One-time keys handed out by `POST /keys/claim`, decided by the journal at append
    /// time: each one-time key appears in at most one claim ever. A `fallback` claim hands
    /// out the device's fallback key (kept, marked used) because no one-time key was left.
    OneTimeKeysClaimed { claims: Vec<KeyClaim> },
    /// A to-device message send (spec: `PUT /sendToDevice/{eventType}/{txnId}`), as the
    /// client asked: `messages` maps user id -> device id (or `*`, every device the user
    /// has at this position) -> content. Unique per (sender, sender device, txn id).
    ToDeviceSent {
        sender: String,
        sender_device: String,
        event_type: String,
        txn_id: String,
        messages: std::collections::BTreeMap<
            String,
            std::collections::BTreeMap<String, serde_json::Value>,
        >,
    },
    /// A device acknowledged (by syncing with a later `since`) every to-device message
    /// up to and including position `upto`; they are deleted from its inbox.
    ToDeviceAcknowledged {
        user_id: String,
        device_id: String,
        upto: u64,
    },
    /// A user's cross-signing keys (spec: `POST /keys/device_signing/upload`), each
    /// checked before it was journaled; `None` leaves that key as it was.
    CrossSigningKeysUploaded {
        user_id: String,
        master_key: Option<serde_json::Value>,
        self_signing_key: Option<serde_json::Value>,
        user_signing_key: Option<serde_json::Value>,
    },
    /// Signatures checked and accepted by `POST /keys/signatures/upload`.
    SignaturesUploaded { signatures: Vec<SignatureAdded> },
    /// A key backup version was created (spec: `POST /room_keys/version`); its version
    /// id is this record's position.
    BackupVersionCreated {
        user_id: String,
        algorithm: String,
        auth_data: serde_json::Value,
    },
    /// A key backup version's `auth_data` changed.
    BackupVersionUpdated {
        user_id: String,
        version: u64,
        auth_data: serde_json::Value,
    },
    /// A key backup version and its keys were deleted.
    BackupVersionDeleted { user_id: String, version: u64 },
    /// Room keys were backed up: room id -> session id -> `KeyBackupData`. Each
    /// replaces a stored session only if it is better (see the `key_backup` projection).
    RoomKeysUploaded {
        user_id: String,
        version: u64,
        rooms: std::collections::BTreeMap<
            String,
            std::collections::BTreeMap<String, serde_json::Value>,
        >,
    },
    /// Backed-up room keys were deleted: all of a version, one room's, or one session.
    RoomKeysDeleted {
        user_id: String,
        version: u64,
        room_id: Option<String>,
        session_id: Option<String>,
    },
    /// A media id was reserved for an asynchronous upload (spec: `POST
    /// /_matrix/media/v1/create`).
    MediaCreated { media_id: String, uploader: String },
    /// Media bytes were stored (as a blob named by `content_hash`, blake3 hex, written
    /// durably before this record) under a media id. Unique per media id: the journal
    /// refuses a second upload to the same id.
    MediaUploaded {
        media_id: String,
        uploader: String,
        content_hash: String,
        content_type: Option<String>,
        filename: Option<String>,
        size: u64,
    },
    /// A push rule was created or replaced (spec: `PUT /pushrules/global/{kind}/{ruleId}`).
    /// `rule` holds the request body (`actions`, and `conditions` or `pattern` by kind);
    /// `before`/`after` place a new rule relative to another user-defined rule.
    PushRuleSet {
        user_id: String,
        kind: String,
        rule_id: String,
        rule: serde_json::Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        before: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
    },
    /// A user-defined push rule was deleted.
    PushRuleDeleted {
        user_id: String,
        kind: String,
        rule_id: String,
    },
    /// A push rule was enabled or disabled (`PUT .../enabled`).
    PushRuleEnabledSet {
        user_id: String,
        kind: String,
        rule_id: String,
        enabled: bool,
    },
    /// A push rule's actions were replaced (`PUT .../actions`).
    PushRuleActionsSet {
        user_id: String,
        kind: String,
        rule_id: String,
        actions: serde_json::Value,
    },
    /// A pusher was created or replaced (spec: `POST /pushers/set` with a `kind`).
    /// `pusher` is the spec's `Pusher` object; unless `append`, pushers of other users
    /// with the same `app_id` and `pushkey` are removed.
    PusherSet {
        user_id: String,
        pusher: serde_json::Value,
        append: bool,
    },
    /// A pusher was deleted (`POST /pushers/set` with `kind: null`).
    PusherDeleted {
        user_id: String,
        app_id: String,
        pushkey: String,
    },
    /// The push-gateway consumer is past every push-queue row at or before `upto` (a
    /// journal position): each of them was delivered, refused by its gateway, or dropped
    /// past `push.max_notification_age_ms`, so the `push` projection deletes them.
    /// `upto` is the lowest durable cursor of the consumer's readers (its dispatcher and
    /// every per-gateway worker), so no reader can ask for a deleted row again.
    PushQueuePruned { upto: u64 },
    /// A delayed event was scheduled (MSC4140: `?org.matrix.msc4140.delay=MS` on
    /// `/send` or `/state`): it is sent as `user_id` (from `device_id`) at
    /// `running_since + delay_ms` (ms since the epoch, the API's clock) unless
    /// restarted, cancelled or sent first. `delay_id` is random and unique.
    DelayedEventScheduled {
        delay_id: String,
        user_id: String,
        device_id: Option<String>,
        room_id: String,
        event_type: String,
        state_key: Option<String>,
        content: serde_json::Value,
        delay_ms: u64,
        running_since: u64,
    },
    /// A scheduled delayed event's timer restarted at `running_since` (`restart`).
    DelayedEventRestarted {
        delay_id: String,
        running_since: u64,
    },
    /// A scheduled delayed event was cancelled (`cancel`); it is never sent.
    DelayedEventCancelled { delay_id: String, ts: u64 },
    /// A delayed event was finalised by sending (at its deadline, or by `send`):
    /// `event_id` of the event, or `error` (a standard error object) when sending it at
    /// its deadline failed (MSC4140: not retried).
    DelayedEventSent {
        delay_id: String,
        event_id: Option<String>,
        error: Option<serde_json::Value>,
        ts: u64,
    },
    /// A user reported another user (spec: `POST /users/{userId}/report`), kept for
    /// the server admin. Recorded whether or not `user_id` has an account here, so
    /// neither the answer nor its timing tells the reporter.
    UserReported {
        reporter: String,
        user_id: String,
        reason: String,
    },
    /// An OpenID token was issued (spec: `POST /user/{userId}/openid/request_token`);
    /// only its blake3 hash is kept. Other servers trade it for the user id at `GET
    /// /_matrix/federation/v1/openid/userinfo` until `expires_at` (ms since the epoch,
    /// compared with the clock by the API, never in apply).
    OpenIdTokenIssued {
        user_id: String,
        token_hash: String,
        expires_at: u64,
    },
    /// A validated third-party identifier was added to a local account (spec: `POST
    /// /account/3pid/add`, or registration with a validated email). `validated_at` is
    /// when its owner proved it (the validation session's time), `added_at` when it
    /// was added, both ms since the epoch and set by the API (apply reads no clock).
    /// `address` is canonical (an email in lower case). The `accounts` projection
    /// refuses an address another account already has.
    ThreepidAdded {
        user_id: String,
        medium: String,
        address: String,
        validated_at: u64,
        added_at: u64,
    },
    /// A third-party identifier was removed from a local account (spec: `POST
    /// /account/3pid/delete`, or account deactivation). Its identity-server binds are
    /// forgotten with it.
    ThreepidRemoved {
        user_id: String,
        medium: String,
        address: String,
    },
    /// A local user bound a third-party identifier to their user id on the identity
    /// server `id_server` (spec: `POST /account/3pid/bind`), kept so a later delete or
    /// unbind knows which identity server to ask.
    ThreepidBound {
        user_id: String,
        medium: String,
        address: String,
        id_server: String,
    },
    /// The bind of a third-party identifier on `id_server` was removed (spec: `POST
    /// /account/3pid/unbind`, or the unbind of a delete).
    ThreepidUnbound {
        user_id: String,
        medium: String,
        address: String,
        id_server: String,
    },
    /// A profile field other than `displayname` and `avatar_url` (`m.tz`, or a
    /// namespaced custom key) was set (spec v1.16: `PUT /profile/{userId}/{keyName}`)
    /// or, with `value: None`, deleted (`DELETE`). The `accounts` projection refuses a
    /// change that would take the profile to 64 KiB or more (the API checks it first).
    ProfileFieldSet {
        user_id: String,
        key: String,
        value: Option<serde_json::Value>,
    },
}

/// A field that is present reads as `Some`, even when it is `null` (`Some(None)`:
/// "clear it"); serde's default would read `null` as absent (`None`: "leave it").
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    <Option<T> as serde::Deserialize>::deserialize(d).map(Some)
}

/// One signature on a device key or master key (see [`Fact::SignaturesUploaded`]).
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SignatureAdded {
    /// Owner of the signed key.
    pub user_id: String,
    /// The signed key: a device id, or a cross-signing key's public key.
    pub key_id: String,
    /// Who signed.
    pub signer: String,
    /// `ed25519:<device id or public key>` of the signing key.
    pub signer_key_id: String,
    /// Unpadded base64 signature.
    pub signature: String,
}

/// One device's change in an `m.device_list_update` EDU (see
/// [`Fact::RemoteDeviceListChanged`]).
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct RemoteDeviceUpdate {
    /// The device.
    pub device_id: String,
    /// The origin's `stream_id`s of the updates this one follows (empty: unknown,
    /// which never chains).
    #[serde(default)]
    pub prev_id: Vec<u64>,
    /// The device was deleted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
    /// The device's signed `DeviceKeys`, when sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<serde_json::Value>,
    /// `device_display_name`, when sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
}

/// The keys of an `m.signing_key_update` EDU (see [`Fact::RemoteDeviceListChanged`]).
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq, Default)]
pub struct RemoteSigningKeys {
    /// The user's new master key, when sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_key: Option<serde_json::Value>,
    /// The user's new self-signing key, when sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_signing_key: Option<serde_json::Value>,
}

/// One device of a remote user's list (see [`Fact::RemoteDeviceListResynced`]).
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct RemoteDevice {
    /// The device.
    pub device_id: String,
    /// Its signed `DeviceKeys`, if it has uploaded any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<serde_json::Value>,
    /// `device_display_name`, when the origin shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
}

/// One key handed out by a claim (see [`Fact::OneTimeKeysClaimed`]).
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct KeyClaim {
    /// Owner of the key.
    pub user_id: String,
    /// Device of the key.
    pub device_id: String,
    /// `"<algorithm>:<key id>"`.
    pub key_id: String,
    /// Whether this is the device's fallback key (no one-time key was left).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fallback: bool,
}

/// Format 1 (before the hash chain), kept so `spindle journal migrate` can read it.
pub mod v1 {
    use rkyv::{Archive, Deserialize, Serialize};

    use super::{GENESIS_HASH, RECORD_FORMAT, Record, RecordKind};

    /// The format-1 envelope, field for field (no `prev_hash`).
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
    #[allow(missing_docs)] // Same fields as [`Record`], which documents them.
    pub struct RecordV1 {
        pub format: u16,
        pub position: u64,
        pub appended_at: u64,
        pub kind: RecordKind,
        pub room_id: Option<String>,
        pub event_id: Option<String>,
        pub room_version: Option<String>,
        pub principal: String,
        pub device_id: Option<String>,
        pub txn_id: Option<String>,
        pub command_signature: String,
        pub payload: Vec<u8>,
    }

    /// Decodes a format-1 record into a current [`Record`] with `prev_hash` unset
    /// ([`GENESIS_HASH`]; the migration chains it).
    pub fn decode(bytes: &[u8]) -> Result<Record, String> {
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        let old = rkyv::from_bytes::<RecordV1, rkyv::rancor::Error>(&aligned)
            .map_err(|e| e.to_string())?;
        if old.format != 1 {
            return Err(format!("record says format {}, expected 1", old.format));
        }
        Ok(Record {
            format: RECORD_FORMAT,
            position: old.position,
            prev_hash: GENESIS_HASH,
            appended_at: old.appended_at,
            kind: old.kind,
            room_id: old.room_id,
            event_id: old.event_id,
            room_version: old.room_version,
            principal: old.principal,
            device_id: old.device_id,
            txn_id: old.txn_id,
            command_signature: old.command_signature,
            payload: old.payload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_torn_bytes() {
        let rec = Record {
            format: RECORD_FORMAT,
            position: 42,
            prev_hash: [7; 32],
            appended_at: 1,
            kind: RecordKind::Fact,
            room_id: None,
            event_id: None,
            room_version: None,
            principal: "@a:x".into(),
            device_id: Some("D".into()),
            txn_id: None,
            command_signature: "sig".into(),
            payload: serde_json::to_vec(&Fact::TokenRevoked {
                token_hash: "h".into(),
            })
            .unwrap(),
        };
        let bytes = rec.encode();
        let stored = StoredRecord::from_bytes(&bytes).unwrap();
        assert_eq!(stored.position(), 42);
        assert!(!stored.is_event());
        assert_eq!(stored.device_id(), Some("D"));
        assert_eq!(
            stored.fact(),
            Some(Fact::TokenRevoked {
                token_hash: "h".into()
            })
        );
        assert_eq!(stored.to_record(), rec);
        assert_eq!(stored.prev_hash(), [7; 32]);
        assert_eq!(stored.hash(), record_hash(&bytes));
        assert!(StoredRecord::from_bytes(&bytes[..bytes.len() - 3]).is_err());
    }

    #[test]
    fn a_cleared_profile_field_round_trips_as_cleared() {
        let clear = Fact::ProfileSet {
            user_id: "@a:x".into(),
            displayname: Some(None),
            avatar_url: None,
        };
        let bytes = serde_json::to_vec(&clear).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            r#"{"type":"profile_set","user_id":"@a:x","displayname":null}"#
        );
        assert_eq!(serde_json::from_slice::<Fact>(&bytes).unwrap(), clear);
    }

    #[test]
    fn format_1_records_are_read_by_the_v1_reader() {
        let old = v1::RecordV1 {
            format: 1,
            position: 3,
            appended_at: 5,
            kind: RecordKind::Event,
            room_id: Some("!r:x".into()),
            event_id: Some("$e".into()),
            room_version: Some("10".into()),
            principal: "@a:x".into(),
            device_id: None,
            txn_id: Some("t".into()),
            command_signature: "sig".into(),
            payload: b"{}".to_vec(),
        };
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&old).unwrap();
        let rec = v1::decode(&bytes).unwrap();
        assert_eq!(rec.format, RECORD_FORMAT);
        assert_eq!(rec.position, 3);
        assert_eq!(rec.prev_hash, GENESIS_HASH);
        assert_eq!(rec.txn_id.as_deref(), Some("t"));
        assert_eq!(rec.payload, b"{}");
    }
}
