//! Invites across servers (spec: server-server API, "Inviting to a room", and
//! "Leaving Rooms (Rejecting Invites)").
//!
//! Inbound (`PUT /_matrix/federation/v1|v2/invite/{roomId}/{eventId}`): an invite for
//! one of our users, signed by the inviting server. We check it, countersign it, and
//! keep it: as an ordinary remote PDU when this server is in the room, otherwise as an
//! outlier with the inviter's `invite_room_state`, so `/sync` lists it under
//! `rooms.invite`. Accepting is a remote join; rejecting is [`reject_remote`].
//!
//! Outbound ([`invite_remote`]): after the journal appended our user's invite of a
//! remote user, the invitee's server countersigns it through `/invite`.

use axum::{
    Json,
    extract::{Path, State},
};
use spindle_core::pdu::Pdu;
use spindle_journal::{CommandBody, remote::VerifyKeys};

use crate::{
    FedState,
    auth::Signed,
    error::{FedError, FedResult},
    outbound::remote_error,
    reads, server_of,
    transactions::{urlencode, verify_keys_for},
};

/// Checks, countersigns and keeps an invite; answers the countersigned event.
async fn receive_invite(
    st: &FedState,
    origin: &str,
    room_id: &str,
    event_id: &str,
    version: &str,
    event: serde_json::Value,
    invite_room_state: Option<serde_json::Value>,
) -> FedResult<serde_json::Value> {
    let rules = spindle_core::room_version::rules(version).ok_or_else(|| {
        FedError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "M_INCOMPATIBLE_ROOM_VERSION",
            format!("room version {version} is not supported here"),
        )
        .with_room_version(version)
    })?;
    let field = |k: &str| {
        event
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let target = field("state_key");
    if field("type") != "m.room.member"
        || event
            .get("content")
            .and_then(|c| c.get("membership"))
            .and_then(|m| m.as_str())
            != Some("invite")
    {
        return Err(FedError::bad_json(
            "the event must be an m.room.member invite",
        ));
    }
    if field("room_id") != room_id {
        return Err(FedError::bad_json("the event is for another room"));
    }
    if server_of(&field("sender")) != Some(origin) {
        return Err(FedError::forbidden(
            "the inviter must be a user of the asking server",
        ));
    }
    if server_of(&target) != Some(st.server_name()) {
        return Err(FedError::bad_json(
            "the invitee is not a user of this server",
        ));
    }
    if st.projections.accounts.user(&target).is_none() {
        return Err(FedError::not_found("no such user"));
    }
    // Countersign (spec: the invitee's server signs the invite too).
    let mut obj = spindle_core::canonical::to_object(event)
        .map_err(|e| FedError::bad_json(format!("the event is not canonical JSON: {e}")))?;
    obj.remove("unsigned");
    let id = spindle_core::pdu::event_id_of_object(&obj, &rules).map_err(FedError::bad_json)?;
    if id != event_id {
        return Err(FedError::bad_json(format!(
            "the event id {event_id} does not match the event ({id})"
        )));
    }
    ruma::signatures::hash_and_sign_event(
        st.server_name(),
        st.key.pair(),
        &mut obj,
        &rules.redaction,
    )
    .map_err(|e| FedError::bad_json(e.to_string()))?;
    let signed = serde_json::to_value(&obj).map_err(|e| FedError::bad_json(e.to_string()))?;
    let keys = verify_keys_for(st, &signed).await;
    let joined_here = reads::servers_in_room(st, room_id)
        .iter()
        .any(|s| s == st.server_name());
    let body = if joined_here {
        CommandBody::RemotePdu {
            room_id: room_id.to_owned(),
            pdu: signed.clone(),
            keys,
            event_id: Some(event_id.to_owned()),
            auth_events: Vec::new(),
        }
    } else {
        CommandBody::RemoteOutlier {
            room_id: room_id.to_owned(),
            room_version: version.to_owned(),
            pdu: signed.clone(),
            keys,
            invite_room_state,
        }
    };
    let outcome = st.submit(origin, body).await?;
    st.wait_for(outcome.position).await?;
    Ok(signed)
}

/// `PUT /_matrix/federation/v2/invite/{roomId}/{eventId}`: body `{room_version,
/// event, invite_room_state}`, answer `{event}`.
pub(crate) async fn invite_v2(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let body = signed.body.clone().unwrap_or_default();
    let version = body
        .get("room_version")
        .and_then(|v| v.as_str())
        .ok_or_else(|| FedError::bad_json("room_version is required"))?
        .to_owned();
    let event = body
        .get("event")
        .cloned()
        .ok_or_else(|| FedError::bad_json("event is required"))?;
    let state = body.get("invite_room_state").cloned();
    let out = receive_invite(
        &st,
        &signed.origin,
        &room_id,
        &event_id,
        &version,
        event,
        state,
    )
    .await?;
    Ok(Json(serde_json::json!({ "event": out })))
}

/// `PUT /_matrix/federation/v1/invite/{roomId}/{eventId}`: body is the event (room
/// version 1 or 2 only, which this server does not support), answer `[200, {event}]`.
pub(crate) async fn invite_v1(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let event = signed.body.clone().unwrap_or_default();
    let state = event
        .get("unsigned")
        .and_then(|u| u.get("invite_room_state"))
        .cloned();
    let out = receive_invite(&st, &signed.origin, &room_id, &event_id, "1", event, state).await?;
    Ok(Json(serde_json::json!([200, { "event": out }])))
}

/// Sends our user's invite of a remote user to the invitee's server for its
/// countersignature. `invite_room_state` is the stripped state shown to the invitee.
pub async fn invite_remote(
    st: &FedState,
    pdu: &Pdu,
    invite_room_state: Vec<serde_json::Value>,
) -> FedResult<()> {
    let target = pdu
        .state_key
        .as_deref()
        .and_then(server_of)
        .ok_or_else(|| FedError::bad_json("the invite has no target"))?;
    let path = format!(
        "/_matrix/federation/v2/invite/{}/{}",
        urlencode(pdu.room_id.as_str()),
        urlencode(pdu.event_id.as_str())
    );
    let body = serde_json::json!({
        "room_version": pdu.room_version,
        "event": pdu.federation_json(),
        "invite_room_state": invite_room_state,
    });
    st.client
        .request(reqwest::Method::PUT, target, &path, Some(&body))
        .await
        .map_err(remote_error)?;
    Ok(())
}

/// Rejects an invite to (or leaves) a room this server is not in: `make_leave` and
/// `send_leave` through one of `servers`, then the leave is kept as an outlier so
/// the membership is `leave` here too.
pub async fn reject_remote(
    st: &FedState,
    user_id: &str,
    room_id: &str,
    servers: &[String],
) -> FedResult<String> {
    let mut last = FedError::not_found("no server to leave the room through");
    for server in servers.iter().filter(|s| *s != st.server_name()).take(5) {
        let path = format!(
            "/_matrix/federation/v1/make_leave/{}/{}",
            urlencode(room_id),
            urlencode(user_id)
        );
        let made = match st
            .client
            .request(reqwest::Method::GET, server, &path, None)
            .await
        {
            Ok(m) => m,
            Err(e) => {
                last = remote_error(e);
                continue;
            }
        };
        let version = made
            .get("room_version")
            .and_then(|v| v.as_str())
            .unwrap_or("1")
            .to_owned();
        let template = made.get("event").cloned().unwrap_or_default();
        if template.get("state_key").and_then(|s| s.as_str()) != Some(user_id) {
            last = FedError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                format!("{server} answered a leave template for someone else"),
            );
            continue;
        }
        let pdu = Pdu::sign_template(template, &version, &st.key, crate::now_ms())
            .map_err(|e| FedError::bad_json(format!("the leave template is invalid: {e}")))?;
        let path = format!(
            "/_matrix/federation/v2/send_leave/{}/{}",
            urlencode(room_id),
            urlencode(pdu.event_id.as_str())
        );
        if let Err(e) = st
            .client
            .request(
                reqwest::Method::PUT,
                server,
                &path,
                Some(&pdu.federation_json()),
            )
            .await
        {
            last = remote_error(e);
            continue;
        }
        let mut keys = VerifyKeys::new();
        keys.insert(
            st.server_name().to_owned(),
            [(st.key.key_id(), st.key.public_key_base64())]
                .into_iter()
                .collect(),
        );
        let outcome = st
            .submit(
                user_id,
                CommandBody::RemoteOutlier {
                    room_id: room_id.to_owned(),
                    room_version: version,
                    pdu: pdu.federation_json(),
                    keys,
                    invite_room_state: None,
                },
            )
            .await?;
        st.wait_for(outcome.position).await?;
        return Ok(pdu.event_id.to_string());
    }
    Err(last)
}
