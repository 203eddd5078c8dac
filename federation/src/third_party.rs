//! Third-party invites, the homeserver side (spec: server-server API "Third-party
//! invites"): an identity server tells us, through `PUT /_matrix/federation/v1/3pid/onbind`,
//! that one of our users bound a 3PID that had pending invites; each becomes an
//! `m.room.member` invite carrying `third_party_invite: {display_name, signed}`. When
//! the inviter is ours the invite is appended here; else the inviter's server is asked
//! to make it (`PUT /_matrix/federation/v1/exchange_third_party_invite/{roomId}`),
//! which we also serve for invites our users made.
//!
//! The `signed` block is checked here against the public keys of the room's
//! `m.room.third_party_invite` event (state key: the token) before anything is
//! appended, so a bad block is a clear 403 rather than a journal refusal; the journal's
//! authorization (ruma's auth rules) checks it again.

use axum::{
    Json,
    extract::{Path, State},
};
use base64::Engine as _;
use serde_json::{Value, json};
use spindle_journal::{CommandBody, EventSpec};

use crate::{FedError, FedResult, FedState, auth::Signed, server_of, transactions::urlencode};

/// Most invites one `onbind` call may carry.
pub const ONBIND_INVITES_MAX: usize = 100;

/// Decodes a public key as identity servers write them: unpadded base64, standard or
/// URL-safe (padding tolerated).
fn decode_key(s: &str) -> Option<Vec<u8>> {
    let trimmed = s.trim_end_matches('=');
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(trimmed)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(trimmed))
        .ok()
}

/// The room's `m.room.third_party_invite` for `token`: (sender, content).
fn pending_invite(st: &FedState, room_id: &str, token: &str) -> Option<(String, Value)> {
    let root = st.projections.state.current_root(room_id)?;
    let id = st
        .projections
        .state
        .lookup(root, "m.room.third_party_invite", token)?;
    let ev = st.projections.timeline.event(&id)?;
    Some((ev.pdu.sender.to_string(), ev.pdu.content_value()))
}

/// Whether one signature of `signed` verifies with one of the invite's public keys
/// (spec: auth rules, "any signature in signed matches any public key").
pub fn signed_by_invite_key(signed: &Value, invite_content: &Value) -> bool {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    if let Some(k) = invite_content.get("public_key").and_then(Value::as_str) {
        keys.extend(decode_key(k));
    }
    for k in invite_content
        .get("public_keys")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(k) = k.get("public_key").and_then(Value::as_str) {
            keys.extend(decode_key(k));
        }
    }
    let Some(obj) = signed.as_object() else {
        return false;
    };
    let mut unsigned = obj.clone();
    let Some(Value::Object(signatures)) = unsigned.remove("signatures") else {
        return false;
    };
    let Ok(canonical) = spindle_core::canonical::to_object(Value::Object(unsigned)) else {
        return false;
    };
    let bytes = spindle_core::canonical::to_bytes(&canonical);
    signatures
        .values()
        .filter_map(Value::as_object)
        .flat_map(|by_key| by_key.iter())
        .filter(|(key_id, _)| key_id.starts_with("ed25519:"))
        .filter_map(|(_, sig)| sig.as_str().and_then(decode_key))
        .any(|sig| {
            keys.iter().any(|key| {
                ruma::signatures::verify_canonical_json_bytes(
                    &ruma::SigningKeyAlgorithm::Ed25519,
                    key,
                    &sig,
                    &bytes,
                )
                .is_ok()
            })
        })
}

/// Appends the invite of `target` by `sender` (ours) with `signed`, after checking it
/// against the room's pending third-party invite. Returns the appended event's id.
async fn append_invite(
    st: &FedState,
    room_id: &str,
    sender: &str,
    target: &str,
    signed: &Value,
) -> FedResult<Option<String>> {
    let token = signed
        .get("token")
        .and_then(Value::as_str)
        .ok_or_else(|| FedError::bad_json("signed.token is required"))?;
    if signed.get("mxid").and_then(Value::as_str) != Some(target) {
        return Err(FedError::forbidden("signed.mxid is not the invitee"));
    }
    let (invite_sender, content) = pending_invite(st, room_id, token)
        .ok_or_else(|| FedError::not_found("No third-party invite with this token in the room"))?;
    if invite_sender != sender {
        return Err(FedError::forbidden(
            "The third-party invite was sent by another user",
        ));
    }
    if !signed_by_invite_key(signed, &content) {
        return Err(FedError::forbidden(
            "The signed block does not verify with the invite's public keys",
        ));
    }
    let display_name = content
        .get("display_name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let outcome = st
        .submit(
            sender,
            CommandBody::SendEvent {
                room_id: room_id.to_owned(),
                event: EventSpec {
                    kind: "m.room.member".into(),
                    state_key: Some(target.to_owned()),
                    content: json!({
                        "membership": "invite",
                        "third_party_invite": { "display_name": display_name, "signed": signed },
                    }),
                    redacts: None,
                },
                txn_id: None,
                precondition: None,
            },
        )
        .await?;
    Ok(outcome.event_ids.last().map(|e| e.to_string()))
}

/// `PUT /_matrix/federation/v1/3pid/onbind` (spec: server-server "Third-party invites";
/// called by an identity server, so not X-Matrix signed): each invite of `invites` for
/// our user `mxid` becomes an invite in its room, made here when the inviter is ours,
/// else by the inviter's server (`exchange_third_party_invite`). An invite that fails
/// is logged and the others go on (the identity server cannot act on a partial
/// failure); a body that is not about one of our users is 400.
pub async fn on_bind(
    State(st): State<FedState>,
    Json(body): Json<Value>,
) -> FedResult<Json<Value>> {
    let mxid = body
        .get("mxid")
        .and_then(Value::as_str)
        .ok_or_else(|| FedError::bad_json("mxid is required"))?;
    if server_of(mxid) != Some(st.server_name()) || ruma::UserId::parse(mxid).is_err() {
        return Err(FedError::invalid_param("mxid is not a user of this server"));
    }
    let invites = match body.get("invites") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(FedError::bad_json("invites must be a list")),
    };
    if invites.len() > ONBIND_INVITES_MAX {
        return Err(FedError::invalid_param(format!(
            "at most {ONBIND_INVITES_MAX} invites per call"
        )));
    }
    for invite in &invites {
        let (Some(room_id), Some(sender), Some(signed)) = (
            invite.get("room_id").and_then(Value::as_str),
            invite.get("sender").and_then(Value::as_str),
            invite.get("signed").filter(|s| s.is_object()),
        ) else {
            tracing::info!(
                mxid,
                "3pid onbind: an invite without room_id, sender or signed"
            );
            continue;
        };
        if invite
            .get("mxid")
            .and_then(Value::as_str)
            .is_some_and(|m| m != mxid)
        {
            tracing::info!(mxid, room_id, "3pid onbind: an invite for another user id");
            continue;
        }
        let result = if server_of(sender) == Some(st.server_name()) {
            append_invite(&st, room_id, sender, mxid, signed)
                .await
                .map(|_| ())
        } else {
            exchange_remote(&st, room_id, sender, mxid, invite, signed).await
        };
        if let Err(e) = result {
            tracing::info!(mxid, room_id, error = %e.error, "3pid onbind: the invite was not made");
        }
    }
    Ok(Json(json!({})))
}

/// Asks the inviter's server to make the invite (spec: `PUT
/// /_matrix/federation/v1/exchange_third_party_invite/{roomId}`).
async fn exchange_remote(
    st: &FedState,
    room_id: &str,
    sender: &str,
    mxid: &str,
    invite: &Value,
    signed: &Value,
) -> FedResult<()> {
    let destination =
        server_of(sender).ok_or_else(|| FedError::bad_json("sender is not a user id"))?;
    let display_name = invite
        .get("display_name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let body = json!({
        "type": "m.room.member",
        "room_id": room_id,
        "sender": sender,
        "state_key": mxid,
        "content": {
            "membership": "invite",
            "third_party_invite": { "display_name": display_name, "signed": signed },
        },
    });
    let path = format!(
        "/_matrix/federation/v1/exchange_third_party_invite/{}",
        urlencode(room_id)
    );
    st.client
        .request(reqwest::Method::PUT, destination, &path, Some(&body))
        .await
        .map_err(|e| {
            FedError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                e.to_string(),
            )
        })?;
    Ok(())
}

/// `PUT /_matrix/federation/v1/exchange_third_party_invite/{roomId}` (spec:
/// server-server "Third-party invites"): the invitee's server asks us, the inviter's,
/// to make the invite. The requesting server must be the invitee's, the sender ours,
/// and `signed` must verify with the room's pending invite's keys; the invite is
/// appended as the sender and, the invitee being on the requesting server, sent there
/// (`/invite`) like any invite of a remote user.
pub async fn exchange(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    signed_req: Signed,
) -> FedResult<Json<Value>> {
    let body = signed_req
        .body
        .ok_or_else(|| FedError::bad_json("a member event is required"))?;
    if body.get("room_id").and_then(Value::as_str) != Some(room_id.as_str()) {
        return Err(FedError::bad_json("room_id does not match the path"));
    }
    if body.get("type").and_then(Value::as_str) != Some("m.room.member") {
        return Err(FedError::bad_json("type must be m.room.member"));
    }
    let sender = body
        .get("sender")
        .and_then(Value::as_str)
        .ok_or_else(|| FedError::bad_json("sender is required"))?;
    let target = body
        .get("state_key")
        .and_then(Value::as_str)
        .ok_or_else(|| FedError::bad_json("state_key is required"))?;
    if server_of(sender) != Some(st.server_name()) {
        return Err(FedError::forbidden(
            "The inviter is not a user of this server",
        ));
    }
    if server_of(target) != Some(signed_req.origin.as_str()) {
        return Err(FedError::forbidden(
            "Only the invitee's server may exchange a third-party invite",
        ));
    }
    let content = body.get("content").cloned().unwrap_or(Value::Null);
    if content.get("membership").and_then(Value::as_str) != Some("invite") {
        return Err(FedError::bad_json("content.membership must be invite"));
    }
    let signed = content
        .get("third_party_invite")
        .and_then(|t| t.get("signed"))
        .filter(|s| s.is_object())
        .ok_or_else(|| FedError::bad_json("content.third_party_invite.signed is required"))?;
    let Some(event_id) = append_invite(&st, &room_id, sender, target, signed).await? else {
        return Ok(Json(json!({})));
    };
    st.wait_for(st.journal.durable_head()).await?;
    if let Some(ev) = st.projections.timeline.event(&event_id) {
        let st2 = st.clone();
        // Delivered like any invite of a remote user; the exchange itself is answered
        // now (the requesting server is waiting on this answer).
        tokio::spawn(async move {
            if let Err(e) = crate::invites::invite_remote(&st2, &ev.pdu, Vec::new()).await {
                tracing::info!(error = %e.error, "3pid exchange: the invitee's server refused the invite");
            }
        });
    }
    Ok(Json(json!({})))
}
