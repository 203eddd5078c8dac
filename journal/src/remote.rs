//! Remote PDUs: events built and signed by another server enter the room's log through
//! the journal, like a client's (BRIEF §2, "Remote events enter through the journal").
//!
//! The federation layer fetches the signing keys of the servers that must have signed
//! the PDU and hands them over in the command ([`CommandBody::RemotePdu`]); the journal
//! then checks, under the room lock and without any I/O:
//!
//! 1. size (65536 bytes), shape, and the room version's event id (the reference hash);
//! 2. signatures (every server the spec requires for this event) and the content hash:
//!    a PDU whose hash does not match is redacted and kept in its redacted form (spec:
//!    "Checks performed on receipt of a PDU", step 3);
//! 3. that its `prev_events` are known (a PDU with unknown predecessors is refused; the
//!    federation layer fetches the gap first with `/get_missing_events`);
//! 4. the auth rules against its `auth_events` (state-independent) and against the
//!    room's current state (state-dependent).
//!
//! An accepted PDU is appended as an event record whose principal is the origin server;
//! a refused one appends a [`Fact::RemotePduRejected`] with the reason, so the audit
//! trail shows what another server tried. A PDU the room already has is accepted again
//! without a new record (transactions are retried).

use std::{collections::HashMap, sync::Arc};

use ruma::{CanonicalJsonValue, OwnedEventId, OwnedRoomId};
use spindle_core::{canonical, pdu::Pdu, room_version};

use crate::{
    Fact, Journal, JournalError, Outcome, PartialState, RecordKind, RoomAggregate, SignedCommand,
    Staged,
};

/// The keys a remote PDU is verified with: server name -> key id -> unpadded base64
/// ed25519 public key.
pub type VerifyKeys =
    std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>;

/// Why a remote PDU was refused (the reason recorded and answered per PDU in `/send`).
fn reject(reason: impl Into<String>) -> JournalError {
    JournalError::Forbidden(reason.into())
}

/// A backfilled PDU that was refused: its event id when it had one, and why.
type RefusedPdu = (Option<String>, String);

impl Journal {
    /// Checks a remote PDU and appends it (see the module docs). `expect_event_id` is
    /// the id the request named (`send_join`, `invite`): a PDU hashing to another id is
    /// refused. Waits for nothing: a refusal is [`Staged::Refused`] with the position of
    /// its [`Fact::RemotePduRejected`], which the caller waits for before answering.
    pub(crate) async fn ingest_remote(
        &self,
        cmd: &SignedCommand,
        room_id: &str,
        pdu: &serde_json::Value,
        keys: &VerifyKeys,
        expect_event_id: Option<&str>,
        auth_events: &[serde_json::Value],
    ) -> Result<Staged, JournalError> {
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = self
            .inner
            .rooms
            .lock()
            .get(&room)
            .cloned()
            .ok_or_else(|| JournalError::UnknownRoom(room_id.to_owned()))?;
        let mut agg = agg.lock().await;
        let checked = check_remote(
            &agg,
            &room,
            pdu,
            keys,
            expect_event_id,
            auth_events,
            &self.inner.stats,
        );
        match checked {
            Ok(Checked::Known(event_id)) => Ok(Staged::Done(Outcome {
                position: self.durable_head(),
                room_id: Some(room),
                event_ids: vec![event_id],
                ..Outcome::default()
            })),
            Ok(Checked::Accept(pdu, before)) => {
                let pdu = Arc::new(pdu);
                let event_id = pdu.event_id.clone();
                let reasserted = agg.apply_with(pdu.clone(), before, &self.inner.stats);
                let mut records = vec![self.event_record(cmd, &pdu, None)];
                for p in &reasserted {
                    let mut rec = self.event_record(cmd, p, None);
                    rec.kind = RecordKind::StateResolved;
                    records.push(rec);
                }
                if !reasserted.is_empty() {
                    tracing::info!(
                        room = %room, event = %event_id,
                        resolved = ?reasserted.iter().map(|p| p.event_id.as_str()).collect::<Vec<_>>(),
                        "a fork resolved to state other than the log order's"
                    );
                }
                let position = self.enqueue(records);
                Ok(Staged::Done(Outcome {
                    position,
                    room_id: Some(room),
                    event_ids: vec![event_id],
                    ..Outcome::default()
                }))
            }
            Ok(Checked::SoftFail(pdu, before)) => {
                let pdu = Arc::new(pdu);
                let event_id = pdu.event_id.clone();
                agg.apply_soft_failed(pdu.clone(), &before);
                self.inner
                    .stats
                    .forks_soft_failed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut rec = self.event_record(cmd, &pdu, None);
                rec.kind = RecordKind::SoftFailed;
                let position = self.enqueue(vec![rec]);
                // Accepted as far as the origin is concerned (spec: soft-failed events
                // are not rejected).
                Ok(Staged::Done(Outcome {
                    position,
                    room_id: Some(room),
                    event_ids: vec![event_id],
                    ..Outcome::default()
                }))
            }
            Err((event_id, err)) => {
                let fact = Fact::RemotePduRejected {
                    origin: cmd.envelope.principal.clone(),
                    room_id: room_id.to_owned(),
                    event_id: event_id.unwrap_or_default(),
                    reason: err.to_string(),
                };
                let payload =
                    serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
                let position = self.enqueue(vec![self.base_record(cmd, RecordKind::Fact, payload)]);
                // The rejection is on disk before the origin hears of it (the caller
                // waits for `position`).
                Ok(Staged::Refused(err, position))
            }
        }
    }
}

enum Checked {
    /// The room already has it.
    Known(OwnedEventId),
    /// Passed every check: append it. With the room state before it.
    Accept(Pdu, crate::fork::StateMap),
    /// Authorized by the state before it, not by the current state: keep it as a
    /// [`RecordKind::SoftFailed`] record. With the room state before it.
    SoftFail(Pdu, crate::fork::StateMap),
}

type CheckError = (Option<String>, JournalError);

fn check_remote(
    agg: &RoomAggregate,
    room: &OwnedRoomId,
    pdu: &serde_json::Value,
    keys: &VerifyKeys,
    expect_event_id: Option<&str>,
    fetched_auth: &[serde_json::Value],
    stats: &crate::JournalStats,
) -> Result<Checked, CheckError> {
    let rules = room_version::rules(&agg.version).ok_or_else(|| {
        (
            None,
            JournalError::UnsupportedRoomVersion(agg.version.clone()),
        )
    })?;
    let mut obj = canonical::to_object(pdu.clone()).map_err(|e| {
        (
            None,
            JournalError::BadJson(format!("PDU is not canonical JSON: {e}")),
        )
    })?;
    // `unsigned` is not covered by hashes or signatures; what another server put there
    // is not ours to keep.
    obj.remove("unsigned");
    let size = canonical::to_bytes(&obj).len();
    if size > spindle_core::pdu::MAX_PDU_BYTES {
        return Err((
            None,
            JournalError::TooLarge(format!("PDU is {size} bytes (limit 65536)")),
        ));
    }
    let event_id = spindle_core::pdu::event_id_of_object(&obj, &rules)
        .map_err(|e| (None, JournalError::BadJson(e)))?;
    if let Some(expected) = expect_event_id
        && expected != event_id
    {
        return Err((
            Some(event_id.clone()),
            JournalError::BadJson(format!(
                "the event id {expected} does not match the PDU's ({event_id})"
            )),
        ));
    }
    let fail = |e: JournalError| (Some(event_id.clone()), e);
    match obj.get("room_id") {
        Some(CanonicalJsonValue::String(r)) if r == room.as_str() => {}
        _ => return Err(fail(reject(format!("the PDU is not an event of {room}")))),
    }
    if agg.knows(&event_id) {
        return Ok(Checked::Known(
            OwnedEventId::try_from(event_id.as_str())
                .map_err(|e| fail(JournalError::BadJson(e.to_string())))?,
        ));
    }
    let parsed = verify_pdu(pdu, &agg.version, room, keys).map_err(|e| fail(reject(e)))?;
    if parsed.prev_events.is_empty() || parsed.prev_events.len() > 20 {
        return Err(fail(reject("prev_events must name 1 to 20 events")));
    }
    if parsed.auth_events.len() > 10 {
        return Err(fail(reject("auth_events must name at most 10 events")));
    }
    if let Some(missing) = parsed.prev_events.iter().find(|p| !agg.knows(p.as_str())) {
        return Err(fail(JournalError::MissingPrevEvents(format!(
            "prev event {missing} is not known here"
        ))));
    }
    if agg.partial.is_some() {
        return check_partial(agg, room, parsed, fetched_auth, keys).map_err(fail);
    }
    // Auth rules: state-independent against the named auth events, state-dependent
    // against the room state before the event (the current state unless it forks the
    // room: then the resolution of the states after its `prev_events`, see `fork`).
    let before = agg.state_before(&parsed.prev_events, stats);
    let mut auth_map: HashMap<OwnedEventId, &Pdu> = HashMap::new();
    for id in &parsed.auth_events {
        match agg.auth_history.get(id) {
            Some(p) => {
                auth_map.insert(id.clone(), &**p);
            }
            None => {
                return Err(fail(reject(format!(
                    "auth event {id} is not an auth event of this room"
                ))));
            }
        }
    }
    if let Some(create) = before.get(&("m.room.create".to_owned(), String::new())) {
        auth_map.insert(create.event_id.clone(), &**create);
    }
    spindle_core::auth::authorize(&rules, &parsed, &auth_map, |t, k| {
        before.get(&(t.to_owned(), k.to_owned())).map(|p| &**p)
    })
    .map_err(|e| fail(reject(format!("auth rules: {e}"))))?;
    // Soft failure: a forking event must also pass against the current state (resolved
    // with the state before it); if it does not, it is kept but not served.
    if let Some(current) = agg.soft_fail_state(&parsed.prev_events, &before) {
        let passes = spindle_core::auth::authorize_against_state(&rules, &parsed, |t, k| {
            current.get(&(t.to_owned(), k.to_owned())).map(|p| &**p)
        });
        if let Err(e) = passes {
            tracing::info!(
                room = %room, event = %event_id, reason = %e,
                "soft-failed a remote event: authorized by the state before it, not by the current state"
            );
            return Ok(Checked::SoftFail(parsed, before));
        }
    }
    Ok(Checked::Accept(parsed, before))
}

/// A remote PDU in a partial-state room (MSC3902): the partial state lacks most
/// members, so it cannot judge the event; the event is authorized against its own auth
/// events (from the room's auth history, or fetched: `fetched_auth`, each verified and
/// authorized by its own auth events first), and there is no soft-fail check. The full
/// state arrives with [`crate::CommandBody::CompletePartialState`].
fn check_partial(
    agg: &RoomAggregate,
    room: &OwnedRoomId,
    parsed: Pdu,
    fetched_auth: &[serde_json::Value],
    keys: &VerifyKeys,
) -> Result<Checked, JournalError> {
    if fetched_auth.len() > MAX_FETCHED_AUTH_EVENTS {
        return Err(JournalError::TooLarge(format!(
            "at most {MAX_FETCHED_AUTH_EVENTS} fetched auth events"
        )));
    }
    let create = agg
        .state
        .get(&("m.room.create".to_owned(), String::new()))
        .cloned();
    let mut fetched: Vec<Arc<Pdu>> = fetched_auth
        .iter()
        .filter_map(|v| verify_pdu(v, &agg.version, room, keys).ok())
        .filter(|p| !agg.auth_history.contains_key(&p.event_id))
        .map(Arc::new)
        .collect();
    fetched.sort_by(|a, b| {
        a.depth
            .cmp(&b.depth)
            .then_with(|| a.event_id.cmp(&b.event_id))
    });
    let mut accepted: HashMap<OwnedEventId, Arc<Pdu>> = HashMap::new();
    for p in fetched {
        let ok = authorize_by_lookup(
            &agg.version,
            &p,
            |id| agg.auth_history.get(id).or_else(|| accepted.get(id)),
            create.as_ref(),
        );
        match ok {
            Ok(()) => {
                accepted.insert(p.event_id.clone(), p);
            }
            Err(e) => tracing::info!(%room, error = %e, "a fetched auth event was refused"),
        }
    }
    authorize_by_lookup(
        &agg.version,
        &parsed,
        |id| agg.auth_history.get(id).or_else(|| accepted.get(id)),
        create.as_ref(),
    )
    .map_err(|e| reject(format!("auth rules (partial state): {e}")))?;
    Ok(Checked::Accept(parsed, agg.state.clone()))
}

/// Most auth events a [`crate::CommandBody::RemotePdu`] may bring for a partial-state
/// room (an event's auth chain through a member we do not know is a handful).
pub const MAX_FETCHED_AUTH_EVENTS: usize = 100;

/// A partial-state room as [`Journal::partial_state_rooms`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialStateRoom {
    /// The room.
    pub room_id: String,
    /// Our user's join, the event the full state is asked for at.
    pub join_event_id: String,
    /// The servers the resident named in its `send_join` answer.
    pub servers_in_room: Vec<String>,
}

impl Journal {
    /// Rooms whose state here is partial (MSC3902), in room id order: what the
    /// background resync works through after a start-up.
    pub async fn partial_state_rooms(&self) -> Vec<PartialStateRoom> {
        let rooms: Vec<(OwnedRoomId, Arc<tokio::sync::Mutex<RoomAggregate>>)> = self
            .inner
            .rooms
            .lock()
            .iter()
            .map(|(id, a)| (id.clone(), a.clone()))
            .collect();
        let mut out = Vec::new();
        for (id, agg) in rooms {
            if let Some(p) = &agg.lock().await.partial {
                out.push(PartialStateRoom {
                    room_id: id.to_string(),
                    join_event_id: p.join_event_id.to_string(),
                    servers_in_room: p.servers_in_room.clone(),
                });
            }
        }
        out.sort_by(|a, b| a.room_id.cmp(&b.room_id));
        out
    }

    /// Whether the room's state here is partial (MSC3902); `false` for an unknown room.
    pub async fn is_partial_state(&self, room_id: &str) -> bool {
        let Ok(room) = OwnedRoomId::try_from(room_id) else {
            return false;
        };
        let Some(agg) = self.inner.rooms.lock().get(&room).cloned() else {
            return false;
        };
        agg.lock().await.partial.is_some()
    }

    /// Of `event_ids`, those the room's auth history does not hold (what a remote PDU
    /// in a partial-state room needs fetched); all of them for an unknown room.
    pub async fn unknown_auth_events(&self, room_id: &str, event_ids: &[String]) -> Vec<String> {
        let agg = OwnedRoomId::try_from(room_id)
            .ok()
            .and_then(|room| self.inner.rooms.lock().get(&room).cloned());
        let Some(agg) = agg else {
            return event_ids.to_vec();
        };
        let agg = agg.lock().await;
        event_ids
            .iter()
            .filter(|id| {
                OwnedEventId::try_from(id.as_str())
                    .map_or(true, |id| !agg.auth_history.contains_key(&id))
            })
            .cloned()
            .collect()
    }
}

impl Journal {
    /// The servers with a user joined to the room now (from the write model: no store
    /// read), in name order; empty for an unknown room. While the room's state is
    /// partial, the servers the resident named in `send_join` are included (MSC3902:
    /// our events must reach members we do not know yet).
    pub async fn servers_in_room(&self, room_id: &str) -> Vec<String> {
        let Ok(room) = OwnedRoomId::try_from(room_id) else {
            return Vec::new();
        };
        let Some(agg) = self.inner.rooms.lock().get(&room).cloned() else {
            return Vec::new();
        };
        agg.lock().await.destinations()
    }

    /// The room's version, if the room exists here.
    pub async fn room_version(&self, room_id: &str) -> Option<String> {
        let room = OwnedRoomId::try_from(room_id).ok()?;
        let agg = self.inner.rooms.lock().get(&room).cloned()?;
        let version = agg.lock().await.version.clone();
        Some(version)
    }

    /// A template for a remote user's membership event in a room here (spec:
    /// `make_join`, `make_leave`, `make_knock`): `prev_events` are the room's forward
    /// extremities, `auth_events` what the auth rules select for it from the current
    /// state, `depth` one more than the deepest extremity. Nothing is appended.
    /// `content` is the event's content, an object with at least `membership`; a
    /// restricted join's `join_authorised_via_users_server` brings that user's member
    /// event into `auth_events`.
    ///
    /// Errors: [`JournalError::UnknownRoom`]; [`JournalError::BadJson`] for a
    /// malformed user id or content.
    pub async fn membership_template(
        &self,
        room_id: &str,
        user_id: &str,
        content: serde_json::Value,
        origin_server_ts: u64,
    ) -> Result<(String, serde_json::Value), JournalError> {
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = self
            .inner
            .rooms
            .lock()
            .get(&room)
            .cloned()
            .ok_or_else(|| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = agg.lock().await;
        let rules = room_version::rules(&agg.version)
            .ok_or_else(|| JournalError::UnsupportedRoomVersion(agg.version.clone()))?;
        let sender = ruma::OwnedUserId::try_from(user_id)
            .map_err(|e| JournalError::BadJson(e.to_string()))?;
        if content.get("membership").and_then(|m| m.as_str()).is_none() {
            return Err(JournalError::BadJson(
                "a membership template needs content.membership".into(),
            ));
        }
        let raw = serde_json::value::to_raw_value(&content)
            .map_err(|e| JournalError::BadJson(e.to_string()))?;
        let types =
            spindle_core::auth::auth_types(&rules, "m.room.member", &sender, Some(user_id), &raw)
                .map_err(JournalError::BadJson)?;
        // v1/v2 references pair each id with the event's reference hash.
        let reference = |id: &OwnedEventId, hash: Option<String>| -> serde_json::Value {
            match (agg.hashed_refs, hash) {
                (true, Some(h)) => serde_json::json!([id, { "sha256": h }]),
                _ => serde_json::json!(id),
            }
        };
        let mut auth_ids: Vec<&OwnedEventId> = Vec::new();
        let mut auth_events: Vec<serde_json::Value> = Vec::new();
        for (t, k) in &types {
            if let Some(p) = agg.state.get(&(t.clone(), k.clone()))
                && !auth_ids.contains(&&p.event_id)
            {
                auth_ids.push(&p.event_id);
                let hash = if agg.hashed_refs {
                    Some(p.reference_hash()?)
                } else {
                    None
                };
                auth_events.push(reference(&p.event_id, hash));
            }
        }
        let (prev_ids, depth) = agg.next_prev_events();
        let prev_events: Vec<serde_json::Value> = prev_ids
            .iter()
            .map(|id| reference(id, agg.extremity_hashes.get(id).cloned()))
            .collect();
        let event = serde_json::json!({
            "auth_events": auth_events,
            "content": content,
            "depth": depth,
            "origin": sender.server_name().as_str(),
            "origin_server_ts": origin_server_ts,
            "prev_events": prev_events,
            "room_id": room_id,
            "sender": user_id,
            "state_key": user_id,
            "type": "m.room.member",
        });
        Ok((agg.version.clone(), event))
    }
}

/// Verifies one PDU of a room of `version`: size, reference hash (its event id), the
/// signatures of every server the spec requires, the content hash (a PDU that fails
/// it is redacted), and that it belongs to `room`. Returns the PDU as it is kept.
fn verify_pdu(
    pdu: &serde_json::Value,
    version: &str,
    room: &OwnedRoomId,
    keys: &VerifyKeys,
) -> Result<Pdu, String> {
    let rules =
        room_version::rules(version).ok_or(format!("unsupported room version {version}"))?;
    let mut obj =
        canonical::to_object(pdu.clone()).map_err(|e| format!("PDU is not canonical JSON: {e}"))?;
    obj.remove("unsigned");
    let size = canonical::to_bytes(&obj).len();
    if size > spindle_core::pdu::MAX_PDU_BYTES {
        return Err(format!("PDU is {size} bytes (limit 65536)"));
    }
    let event_id = spindle_core::pdu::event_id_of_object(&obj, &rules)?;
    let is_create = obj.get("type").and_then(|t| t.as_str()) == Some("m.room.create");
    match obj.get("room_id") {
        Some(CanonicalJsonValue::String(r)) if r == room.as_str() => {}
        None if is_create && room_version::room_id_from_create(version) => {
            if room.as_str()[1..] != event_id[1..] {
                return Err(format!("{event_id} is not the create event of {room}"));
            }
        }
        _ => return Err(format!("{event_id} is not an event of {room}")),
    }
    let verified = ruma::signatures::verify_event(&key_map(keys), &obj, &rules)
        .map_err(|e| format!("{event_id}: signature check failed: {e}"))?;
    if verified == ruma::signatures::Verified::Signatures {
        obj =
            ruma::canonical_json::redact(obj, &rules.redaction, None).map_err(|e| e.to_string())?;
    }
    let json = canonical::to_bytes(&obj);
    Pdu::parse(
        &json,
        version,
        Some(OwnedEventId::try_from(event_id.as_str()).map_err(|e| e.to_string())?),
        Some(room.clone()),
    )
    .map_err(|e| e.to_string())
}

fn key_map(keys: &VerifyKeys) -> ruma::signatures::PublicKeyMap {
    let mut key_map = ruma::signatures::PublicKeyMap::new();
    for (server, set) in keys {
        let mut s = ruma::signatures::PublicKeySet::new();
        for (id, key) in set {
            if let Ok(k) = ruma::serde::Base64::parse(key) {
                s.insert(id.clone(), k);
            }
        }
        key_map.insert(server.clone(), s);
    }
    key_map
}

/// Checks `pdu` against the auth rules using only its own `auth_events` (looked up in
/// `known`) as the state: how an outlier is authorized (spec: "Checks performed on
/// receipt of a PDU", step 4, for events whose state we do not have).
fn authorize_by_auth_events(
    version: &str,
    pdu: &Pdu,
    known: &HashMap<OwnedEventId, Arc<Pdu>>,
    create: Option<&Arc<Pdu>>,
) -> Result<(), String> {
    authorize_by_lookup(version, pdu, |id| known.get(id), create)
}

/// [`authorize_by_auth_events`] with the auth events found by `lookup`.
fn authorize_by_lookup<'a>(
    version: &str,
    pdu: &Pdu,
    lookup: impl Fn(&OwnedEventId) -> Option<&'a Arc<Pdu>>,
    create: Option<&'a Arc<Pdu>>,
) -> Result<(), String> {
    let rules = room_version::rules(version).ok_or("unsupported room version")?;
    let mut auth_map: HashMap<OwnedEventId, &Pdu> = HashMap::new();
    for id in &pdu.auth_events {
        let ev =
            lookup(id).ok_or_else(|| format!("auth event {id} of {} is missing", pdu.event_id))?;
        auth_map.insert(id.clone(), &**ev);
    }
    if let Some(c) = create {
        auth_map.insert(c.event_id.clone(), &**c);
    }
    let by_key: HashMap<(String, String), &Pdu> = auth_map
        .values()
        .filter_map(|p| Some(((p.kind.to_string(), p.state_key.clone()?), *p)))
        .collect();
    spindle_core::auth::authorize(&rules, pdu, &auth_map, |t, k| {
        by_key.get(&(t.to_owned(), k.to_owned())).copied()
    })
    .map_err(|e| format!("{} fails the auth rules: {e}", pdu.event_id))
}

impl Journal {
    /// [`crate::CommandBody::ImportRemoteRoom`]: see its docs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn import_remote_room(
        &self,
        cmd: &SignedCommand,
        room_id: &str,
        version: &str,
        auth_chain: &[serde_json::Value],
        state: &[serde_json::Value],
        join: &serde_json::Value,
        keys: &VerifyKeys,
        partial_state: Option<&[String]>,
    ) -> Result<Outcome, JournalError> {
        if room_version::rules(version).is_none() {
            return Err(JournalError::UnsupportedRoomVersion(version.to_owned()));
        }
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::BadJson(format!("bad room id {room_id}")))?;
        if auth_chain.len() + state.len() > 200_000 {
            return Err(JournalError::TooLarge(
                "the room's state is too large to import".into(),
            ));
        }
        // Verify every PDU first (no lock held: pure computation).
        let mut verified: HashMap<OwnedEventId, Arc<Pdu>> = HashMap::new();
        let mut state_ids: Vec<OwnedEventId> = Vec::new();
        for (in_state, list) in [(false, auth_chain), (true, state)] {
            for v in list {
                match verify_pdu(v, version, &room, keys) {
                    Ok(p) => {
                        if in_state {
                            state_ids.push(p.event_id.clone());
                        }
                        verified.insert(p.event_id.clone(), Arc::new(p));
                    }
                    Err(e) => {
                        tracing::info!(%room, error = %e, "an imported PDU failed verification")
                    }
                }
            }
        }
        let join = verify_pdu(join, version, &room, keys).map_err(JournalError::Forbidden)?;
        if join.sender.as_str() != cmd.envelope.principal
            || join.state_key.as_deref() != Some(join.sender.as_str())
            || join.kind.to_string() != "m.room.member"
        {
            return Err(JournalError::Forbidden(
                "the join must be the principal's own membership event".into(),
            ));
        }
        let create = verified
            .values()
            .find(|p| p.kind.to_string() == "m.room.create" && p.state_key.as_deref() == Some(""))
            .cloned();
        let agg_arc = {
            let mut rooms = self.inner.rooms.lock();
            rooms
                .entry(room.clone())
                .or_insert_with(|| {
                    Arc::new(tokio::sync::Mutex::new(RoomAggregate::new(
                        version,
                        self.inner.fork_window,
                    )))
                })
                .clone()
        };
        let mut agg = agg_arc.lock().await;
        if agg.version != version {
            return Err(JournalError::BadState(format!(
                "{room} is version {} here, not {version}",
                agg.version
            )));
        }
        let create = create.or_else(|| {
            agg.state
                .get(&("m.room.create".to_owned(), String::new()))
                .cloned()
        });
        if create.is_none() {
            return Err(JournalError::Forbidden(
                "the state has no create event".into(),
            ));
        }
        // Authorize in depth order; an event that fails is dropped (and so is anything
        // that needs it as an auth event).
        let mut order: Vec<Arc<Pdu>> = verified.values().cloned().collect();
        order.sort_by(|a, b| {
            a.depth
                .cmp(&b.depth)
                .then_with(|| a.event_id.cmp(&b.event_id))
        });
        let mut accepted: HashMap<OwnedEventId, Arc<Pdu>> = agg.auth_history.clone();
        let mut new_events: Vec<Arc<Pdu>> = Vec::new();
        for p in order {
            if agg.knows(p.event_id.as_str()) {
                accepted.insert(p.event_id.clone(), p);
                continue;
            }
            match authorize_by_auth_events(version, &p, &accepted, create.as_ref()) {
                Ok(()) => {
                    accepted.insert(p.event_id.clone(), p.clone());
                    new_events.push(p);
                }
                Err(e) => tracing::info!(%room, error = %e, "an imported PDU was rejected"),
            }
        }
        authorize_by_auth_events(version, &join, &accepted, create.as_ref())
            .map_err(JournalError::Forbidden)?;
        // Auth-chain-only events first, then the state, each in depth order: applying
        // them in that order leaves exactly the resident server's state current.
        let in_state: std::collections::HashSet<&OwnedEventId> = state_ids.iter().collect();
        new_events.sort_by_key(|p| (in_state.contains(&p.event_id), p.depth));
        let mut records = Vec::with_capacity(new_events.len() + 1);
        for p in &new_events {
            let mut rec = self.event_record(cmd, p, None);
            rec.kind = RecordKind::Outlier;
            records.push(rec);
        }
        records.push(self.event_record(cmd, &join, None));
        // A partial-state join (MSC3902); a room already known here was joined with its
        // full state before and stays complete.
        let partial = match partial_state {
            Some(servers) if agg.partial.is_none() && agg.extremities.is_empty() => {
                let mut servers: Vec<String> = servers.iter().take(10_000).cloned().collect();
                servers.sort();
                servers.dedup();
                let fact = Fact::RoomStatePartial {
                    room_id: room_id.to_owned(),
                    join_event_id: join.event_id.to_string(),
                    servers_in_room: servers.clone(),
                };
                let payload =
                    serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
                records.push(self.base_record(cmd, RecordKind::Fact, payload));
                Some(PartialState {
                    join_event_id: join.event_id.clone(),
                    servers_in_room: servers,
                })
            }
            _ => None,
        };
        for p in new_events {
            agg.apply_outlier(p);
        }
        let position = self.enqueue(records);
        let event_id = join.event_id.clone();
        agg.apply(Arc::new(join), &self.inner.stats);
        if partial.is_some() {
            agg.partial = partial;
            self.inner
                .stats
                .partial_state_joins
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(Outcome {
            position,
            room_id: Some(room),
            event_ids: vec![event_id],
            ..Outcome::default()
        })
    }
}

impl Journal {
    /// [`crate::CommandBody::CompletePartialState`]: see its docs. Verification runs
    /// before the room lock is taken (a 5,000-member state is thousands of signature
    /// checks; sends to the room go on meanwhile).
    pub(crate) async fn complete_partial_state(
        &self,
        cmd: &SignedCommand,
        room_id: &str,
        state: &[serde_json::Value],
        auth_chain: &[serde_json::Value],
        keys: &VerifyKeys,
    ) -> Result<Outcome, JournalError> {
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::UnknownRoom(room_id.to_owned()))?;
        if auth_chain.len() + state.len() > 200_000 {
            return Err(JournalError::TooLarge(
                "the room's state is too large to import".into(),
            ));
        }
        let agg_arc = self
            .inner
            .rooms
            .lock()
            .get(&room)
            .cloned()
            .ok_or_else(|| JournalError::UnknownRoom(room_id.to_owned()))?;
        let version = agg_arc.lock().await.version.clone();
        let mut verified: HashMap<OwnedEventId, Arc<Pdu>> = HashMap::new();
        let mut state_ids: std::collections::HashSet<OwnedEventId> =
            std::collections::HashSet::new();
        for (in_state, list) in [(false, auth_chain), (true, state)] {
            for v in list {
                match verify_pdu(v, &version, &room, keys) {
                    Ok(p) => {
                        if in_state {
                            state_ids.insert(p.event_id.clone());
                        }
                        verified.insert(p.event_id.clone(), Arc::new(p));
                    }
                    Err(e) => {
                        tracing::info!(%room, error = %e, "a resynced PDU failed verification")
                    }
                }
            }
        }
        let mut agg = agg_arc.lock().await;
        if agg.partial.is_none() {
            return Ok(Outcome {
                position: self.durable_head(),
                room_id: Some(room),
                ..Outcome::default()
            });
        }
        let create = agg
            .state
            .get(&("m.room.create".to_owned(), String::new()))
            .cloned();
        let mut order: Vec<Arc<Pdu>> = verified.into_values().collect();
        order.sort_by(|a, b| {
            a.depth
                .cmp(&b.depth)
                .then_with(|| a.event_id.cmp(&b.event_id))
        });
        // Authorize in depth order against what is already accepted (the room's auth
        // history, then the batch itself).
        let mut accepted: HashMap<OwnedEventId, Arc<Pdu>> = HashMap::new();
        // (event, already known here): a known one (backfilled history, an outlier) is
        // made current with a `StateResolved` record, a new one is an outlier.
        let mut fill: Vec<(Arc<Pdu>, bool)> = Vec::new();
        let mut refused = 0usize;
        for p in order {
            let known_auth = agg.auth_history.contains_key(&p.event_id);
            if !known_auth {
                let ok = authorize_by_lookup(
                    &version,
                    &p,
                    |id| agg.auth_history.get(id).or_else(|| accepted.get(id)),
                    create.as_ref(),
                );
                if let Err(e) = ok {
                    refused += 1;
                    tracing::debug!(%room, error = %e, "a resynced PDU was refused");
                    continue;
                }
            }
            if state_ids.contains(&p.event_id)
                && let Some(sk) = &p.state_key
                && !agg.state.contains_key(&(p.kind.to_string(), sk.clone()))
            {
                fill.push((p.clone(), agg.knows(p.event_id.as_str())));
            }
            if !known_auth {
                accepted.insert(p.event_id.clone(), p);
            }
        }
        let mut records = Vec::with_capacity(fill.len() + 1);
        for (p, known) in &fill {
            let mut rec = self.event_record(cmd, p, None);
            rec.kind = if *known {
                RecordKind::StateResolved
            } else {
                RecordKind::Outlier
            };
            records.push(rec);
        }
        let fact = Fact::RoomStateCompleted {
            room_id: room_id.to_owned(),
        };
        let payload =
            serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
        records.push(self.base_record(cmd, RecordKind::Fact, payload));
        tracing::info!(
            %room, added = fill.len(), refused,
            "the room's full state is imported; it is no longer partial"
        );
        let position = self.enqueue(records);
        for (p, known) in fill {
            if known {
                agg.set_state(p);
            } else {
                agg.apply_outlier(p);
            }
        }
        agg.partial = None;
        self.inner
            .stats
            .partial_state_completed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Outcome {
            position,
            room_id: Some(room),
            ..Outcome::default()
        })
    }
}

impl Journal {
    /// [`crate::CommandBody::RemoteOutlier`]: see its docs. Only `m.room.member`
    /// events whose target is a user of this server are kept this way.
    pub(crate) async fn remote_outlier(
        &self,
        cmd: &SignedCommand,
        room_id: &str,
        version: &str,
        pdu: &serde_json::Value,
        keys: &VerifyKeys,
        invite_room_state: Option<&serde_json::Value>,
    ) -> Result<Outcome, JournalError> {
        if room_version::rules(version).is_none() {
            return Err(JournalError::UnsupportedRoomVersion(version.to_owned()));
        }
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::BadJson(format!("bad room id {room_id}")))?;
        let mut parsed = verify_pdu(pdu, version, &room, keys).map_err(JournalError::Forbidden)?;
        let ours = format!(":{}", self.inner.key.server_name());
        if parsed.kind.to_string() != "m.room.member"
            || !parsed
                .state_key
                .as_deref()
                .is_some_and(|k| k.ends_with(&ours))
        {
            return Err(JournalError::Forbidden(
                "only membership events of this server's users are kept as outliers".into(),
            ));
        }
        if let Some(state) = invite_room_state {
            // Kept beside the signed fields (not covered by hashes or signatures).
            let mut obj = canonical::from_bytes(&parsed.json)
                .map_err(|e| JournalError::BadJson(e.to_string()))?;
            let stripped = canonical::to_object(serde_json::json!({ "invite_room_state": state }))
                .map_err(|e| JournalError::BadJson(format!("invite_room_state: {e}")))?;
            obj.insert("unsigned".into(), CanonicalJsonValue::Object(stripped));
            let json = canonical::to_bytes(&obj);
            if json.len() > 4 * spindle_core::pdu::MAX_PDU_BYTES {
                return Err(JournalError::TooLarge(
                    "invite_room_state is too large".into(),
                ));
            }
            parsed = Pdu::parse(
                &json,
                version,
                Some(parsed.event_id.clone()),
                Some(room.clone()),
            )?;
        }
        let agg_arc = {
            let mut rooms = self.inner.rooms.lock();
            rooms
                .entry(room.clone())
                .or_insert_with(|| {
                    Arc::new(tokio::sync::Mutex::new(RoomAggregate::new(
                        version,
                        self.inner.fork_window,
                    )))
                })
                .clone()
        };
        let mut agg = agg_arc.lock().await;
        if agg.knows(parsed.event_id.as_str()) {
            return Ok(Outcome {
                position: self.durable_head(),
                room_id: Some(room),
                event_ids: vec![parsed.event_id],
                ..Outcome::default()
            });
        }
        let mut rec = self.event_record(cmd, &parsed, None);
        rec.kind = RecordKind::Outlier;
        let position = self.enqueue(vec![rec]);
        let event_id = parsed.event_id.clone();
        agg.apply_outlier(Arc::new(parsed));
        Ok(Outcome {
            position,
            room_id: Some(room),
            event_ids: vec![event_id],
            ..Outcome::default()
        })
    }
}

impl Journal {
    /// [`crate::CommandBody::Backfill`]: see its docs. Returns the ids appended, in
    /// the order given (newest first).
    pub(crate) async fn backfill(
        &self,
        cmd: &SignedCommand,
        room_id: &str,
        pdus: &[serde_json::Value],
        auth_events: &[serde_json::Value],
        keys: &VerifyKeys,
    ) -> Result<Outcome, JournalError> {
        if pdus.len() > 1000 || auth_events.len() > 1000 {
            return Err(JournalError::TooLarge(
                "a backfill batch holds at most 1000 PDUs and 1000 auth events".into(),
            ));
        }
        let room = OwnedRoomId::try_from(room_id)
            .map_err(|_| JournalError::UnknownRoom(room_id.to_owned()))?;
        let agg = self
            .inner
            .rooms
            .lock()
            .get(&room)
            .cloned()
            .ok_or_else(|| JournalError::UnknownRoom(room_id.to_owned()))?;
        let mut agg = agg.lock().await;
        let version = agg.version.clone();
        let create = agg
            .state
            .get(&("m.room.create".to_owned(), String::new()))
            .cloned();
        // Everything the batch may cite as an auth event: the room's auth history, the
        // fetched auth events and the batch itself (older events of it authorize newer).
        let mut pool: HashMap<OwnedEventId, Arc<Pdu>> = agg.auth_history.clone();
        for v in auth_events {
            match verify_pdu(v, &version, &room, keys) {
                Ok(p) => {
                    pool.entry(p.event_id.clone())
                        .or_insert_with(|| Arc::new(p));
                }
                Err(e) => {
                    tracing::info!(%room, error = %e, "a fetched auth event failed verification")
                }
            }
        }
        let mut batch: Vec<Result<Arc<Pdu>, RefusedPdu>> = Vec::with_capacity(pdus.len());
        for v in pdus {
            // Already in the timeline (a retry, or the event the request started from):
            // nothing to verify.
            if spindle_core::pdu::event_id_of(v, &version).is_some_and(|id| agg.in_timeline(&id)) {
                continue;
            }
            match verify_pdu(v, &version, &room, keys) {
                Ok(p) => {
                    let p = Arc::new(p);
                    pool.entry(p.event_id.clone()).or_insert_with(|| p.clone());
                    batch.push(Ok(p));
                }
                Err(e) => batch.push(Err((
                    v.get("event_id")
                        .and_then(|i| i.as_str())
                        .map(str::to_owned),
                    e,
                ))),
            }
        }
        let mut records = Vec::new();
        let mut appended: Vec<Arc<Pdu>> = Vec::new();
        let mut seen: std::collections::HashSet<OwnedEventId> = std::collections::HashSet::new();
        for item in batch {
            let (event_id, reason) = match item {
                Ok(p) => {
                    if agg.in_timeline(p.event_id.as_str()) || !seen.insert(p.event_id.clone()) {
                        continue;
                    }
                    match authorize_by_auth_events(&version, &p, &pool, create.as_ref()) {
                        Ok(()) => {
                            let mut rec = self.event_record(cmd, &p, None);
                            rec.kind = RecordKind::Backfilled;
                            records.push(rec);
                            appended.push(p);
                            continue;
                        }
                        Err(e) => (Some(p.event_id.to_string()), e),
                    }
                }
                Err(e) => e,
            };
            let fact = Fact::RemotePduRejected {
                origin: cmd.envelope.principal.clone(),
                room_id: room_id.to_owned(),
                event_id: event_id.unwrap_or_default(),
                reason: format!("backfill: {reason}"),
            };
            let payload =
                serde_json::to_vec(&fact).map_err(|e| JournalError::BadJson(e.to_string()))?;
            records.push(self.base_record(cmd, RecordKind::Fact, payload));
        }
        if records.is_empty() {
            return Ok(Outcome {
                position: self.durable_head(),
                room_id: Some(room),
                ..Outcome::default()
            });
        }
        let position = self.enqueue(records);
        let event_ids = appended.iter().map(|p| p.event_id.clone()).collect();
        for p in appended {
            agg.apply_backfilled(p);
        }
        Ok(Outcome {
            position,
            room_id: Some(room),
            event_ids,
            ..Outcome::default()
        })
    }
}
