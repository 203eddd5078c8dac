//! Knocking (spec: server-server API, "Knocking upon a room", room versions 7 and
//! later): `make_knock`/`send_knock` served for our rooms, and [`knock_remote`], what
//! the Client-Server `/knock/{roomIdOrAlias}` does for a room hosted elsewhere.
//!
//! Inbound, `make_knock` hands out a template built by the journal (nothing is
//! written) and `send_knock` submits the signed knock as a
//! [`spindle_journal::CommandBody::RemotePdu`]: the journal checks it like any remote
//! PDU (signatures, event id, the knock auth rules) and appends it. The answer's
//! `knock_room_state` is the room's create, join rules, name, avatar, canonical alias,
//! encryption and topic events as PDUs (spec v1.16: formatted per room version).
//!
//! Outbound, the knock is signed by us, sent to a resident server, and kept here as
//! an outlier (a [`spindle_journal::CommandBody::RemoteOutlier`], as a remote invite
//! is) with the returned state stripped into `unsigned.invite_room_state`, so `/sync`
//! lists the room under `rooms.knock` with that `knock_state`.

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
    joins,
    outbound::remote_error,
    reads,
    transactions::urlencode,
};

/// The state types a knocker (or invitee) is shown.
pub const STRIPPED_STATE_TYPES: [&str; 7] = [
    "m.room.create",
    "m.room.join_rules",
    "m.room.name",
    "m.room.avatar",
    "m.room.canonical_alias",
    "m.room.encryption",
    "m.room.topic",
];

/// Most `knock_room_state` entries kept from a remote answer.
pub const MAX_KNOCK_STATE_EVENTS: usize = 64;

fn knocking_allowed(version: &str) -> bool {
    spindle_core::room_version::rules(version).is_some_and(|r| r.authorization.knocking)
}

/// `GET /_matrix/federation/v1/make_knock/{roomId}/{userId}?ver=`: a knock template.
/// 400 `M_INCOMPATIBLE_ROOM_VERSION` (with `room_version`) when the room's version is
/// not among `ver` or has no knocking (before 7); 403 when the user is not on the
/// asking server, is banned, already joined, or the join rule is not `knock` /
/// `knock_restricted`; 404 for a room we do not know.
pub(crate) async fn make_knock(
    State(st): State<FedState>,
    Path((room_id, user_id)): Path<(String, String)>,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let versions: Vec<String> = reads::form_pairs(raw.as_deref().unwrap_or(""))
        .into_iter()
        .filter(|(k, _)| k == "ver")
        .map(|(_, v)| v)
        .collect();
    let (version, event) = joins::template(
        &st,
        &signed.origin,
        &room_id,
        &user_id,
        serde_json::json!({ "membership": "knock" }),
    )
    .await?;
    if !knocking_allowed(&version) {
        return Err(FedError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "M_INCOMPATIBLE_ROOM_VERSION",
            format!("the room is version {version}, which has no knocking"),
        )
        .with_room_version(&version));
    }
    if !versions.contains(&version) {
        return Err(FedError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "M_INCOMPATIBLE_ROOM_VERSION",
            format!("the room is version {version}, which your server did not list"),
        )
        .with_room_version(&version));
    }
    match st
        .projections
        .membership
        .get(&room_id, &user_id)
        .map(|m| m.membership)
        .as_deref()
    {
        Some("ban") => return Err(FedError::forbidden("the user is banned from the room")),
        Some("join") => return Err(FedError::forbidden("the user is already in the room")),
        _ => {}
    }
    let join_rule = st
        .projections
        .directory
        .join_rule(&room_id)
        .unwrap_or_else(|| "invite".into());
    if join_rule != "knock" && join_rule != "knock_restricted" {
        return Err(FedError::forbidden(format!(
            "the room's join rule is {join_rule}: it does not take knocks"
        )));
    }
    Ok(Json(
        serde_json::json!({ "room_version": version, "event": event }),
    ))
}

/// `PUT /_matrix/federation/v1/send_knock/{roomId}/{eventId}`: appends the knock (the
/// journal checks it) and answers `{knock_room_state}`. A body that is not a knock
/// by a user of the asking server: 400 `M_BAD_JSON` / 403.
pub(crate) async fn send_knock(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    joins::submit_membership(&st, &signed, &room_id, &event_id, "knock").await?;
    Ok(Json(serde_json::json!({
        "knock_room_state": room_state_pdus(&st, &room_id),
    })))
}

/// The room's current [`STRIPPED_STATE_TYPES`] events, as PDUs.
fn room_state_pdus(st: &FedState, room_id: &str) -> Vec<serde_json::Value> {
    let Some(root) = st.projections.state.current_root(room_id) else {
        return vec![];
    };
    STRIPPED_STATE_TYPES
        .iter()
        .filter_map(|kind| st.projections.state.lookup(root, kind, ""))
        .filter_map(|id| reads::load(st, &id))
        .map(|p| p.federation_json())
        .collect()
}

/// A PDU (or an already stripped event) as a stripped state event
/// (`{type, state_key, content, sender}`); `None` when it lacks one of them.
fn stripped(ev: &serde_json::Value) -> Option<serde_json::Value> {
    let get = |k: &str| ev.get(k).filter(|v| !v.is_null()).cloned();
    Some(serde_json::json!({
        "type": get("type")?,
        "state_key": get("state_key")?,
        "content": get("content")?,
        "sender": get("sender")?,
    }))
}

/// Knocks `user_id` (ours) on a room hosted elsewhere, trying `servers` in order;
/// `reason` goes into the knock's content. Returns the knock's event id once it is
/// kept here. The remote's refusal is passed on (403, 404,
/// `M_INCOMPATIBLE_ROOM_VERSION`); unreachable servers: 502.
pub async fn knock_remote(
    st: &FedState,
    user_id: &str,
    room_id: &str,
    servers: &[String],
    reason: Option<String>,
) -> FedResult<String> {
    let mut last = FedError::not_found("no server to knock through");
    let vers: String = spindle_core::room_version::SUPPORTED
        .iter()
        .filter(|v| knocking_allowed(v))
        .map(|v| format!("ver={v}"))
        .collect::<Vec<_>>()
        .join("&");
    for server in servers.iter().filter(|s| *s != st.server_name()).take(5) {
        let path = format!(
            "/_matrix/federation/v1/make_knock/{}/{}?{vers}",
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
                tracing::info!(%server, error = %e, "make_knock failed");
                last = remote_error(e);
                continue;
            }
        };
        let version = made
            .get("room_version")
            .and_then(|v| v.as_str())
            .unwrap_or("1")
            .to_owned();
        if spindle_core::room_version::rules(&version).is_none() || !knocking_allowed(&version) {
            return Err(FedError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "M_UNSUPPORTED_ROOM_VERSION",
                format!("the room is version {version}, which this server cannot knock on"),
            ));
        }
        let mut template = made.get("event").cloned().unwrap_or_default();
        let field = |k: &str| template.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        let membership = template
            .get("content")
            .and_then(|c| c.get("membership"))
            .and_then(|m| m.as_str());
        // The spec's checks before signing a template.
        if field("room_id").as_deref() != Some(room_id)
            || field("sender").as_deref() != Some(user_id)
            || field("state_key").as_deref() != Some(user_id)
            || field("type").as_deref() != Some("m.room.member")
            || membership != Some("knock")
        {
            last = FedError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                format!("{server} answered a malformed knock template"),
            );
            continue;
        }
        if let Some(r) = &reason
            && let Some(c) = template.get_mut("content").and_then(|c| c.as_object_mut())
        {
            c.insert("reason".into(), r.clone().into());
        }
        let pdu = Pdu::sign_template(template, &version, &st.key, crate::now_ms())
            .map_err(|e| FedError::bad_json(format!("the knock template is invalid: {e}")))?;
        let path = format!(
            "/_matrix/federation/v1/send_knock/{}/{}",
            urlencode(room_id),
            urlencode(pdu.event_id.as_str())
        );
        let sent = match st
            .client
            .request(
                reqwest::Method::PUT,
                server,
                &path,
                Some(&pdu.federation_json()),
            )
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(%server, error = %e, "send_knock failed");
                last = remote_error(e);
                continue;
            }
        };
        let state: Vec<serde_json::Value> = sent
            .get("knock_room_state")
            .and_then(|s| s.as_array())
            .into_iter()
            .flatten()
            .filter_map(stripped)
            .take(MAX_KNOCK_STATE_EVENTS)
            .collect();
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
                    invite_room_state: Some(serde_json::Value::Array(state)),
                },
            )
            .await?;
        st.wait_for(outcome.position).await?;
        return Ok(pdu.event_id.to_string());
    }
    Err(last)
}
