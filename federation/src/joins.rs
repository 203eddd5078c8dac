//! Joining and leaving our rooms from another server (spec: server-server API,
//! "Joining Rooms", "Leaving Rooms (Rejecting Invites)"): `make_join`/`send_join` (v1
//! and v2) and `make_leave`/`send_leave` (v1 and v2).
//!
//! `make_*` hands out a template built on the room's forward extremities by the journal
//! (nothing is written). `send_*` submits the signed event as a remote PDU: the journal
//! checks it like any other (signatures, event id, auth rules) and appends it.

use axum::{
    Json,
    extract::{Path, State},
};
use spindle_journal::CommandBody;
use spindle_projections::joins::{RestrictedJoin, restricted_join};

use crate::{
    FedState,
    auth::Signed,
    error::{FedError, FedResult},
    reads, server_of, transactions,
};

/// `GET /_matrix/federation/v1/make_join/{roomId}/{userId}?ver=`: a join template.
/// 400 `M_INCOMPATIBLE_ROOM_VERSION` if the room's version is not among `ver`; 403 if
/// the user is not on the asking server, is banned, or the room is not open to them.
/// In a restricted room (v8+) a user joined to an allowed room gets a template whose
/// content names a local authoriser in `join_authorised_via_users_server`; the other
/// answers are [`refusal`]'s.
pub(crate) async fn make_join(
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
    if server_of(&user_id) != Some(signed.origin.as_str()) {
        return Err(FedError::forbidden(format!(
            "{user_id} is not a user of {}",
            signed.origin
        )));
    }
    let membership = st.projections.membership.get(&room_id, &user_id);
    let current = membership.as_ref().map(|m| m.membership.as_str());
    if current == Some("ban") {
        return Err(FedError::forbidden("the user is banned from the room"));
    }
    let mut content = serde_json::json!({ "membership": "join" });
    let mut allowed = matches!(current, Some("invite") | Some("join"));
    if !allowed {
        match restricted_join(
            &st.projections,
            &st.journal,
            st.server_name(),
            &room_id,
            &user_id,
        )
        .await
        {
            RestrictedJoin::NotRestricted => {}
            RestrictedJoin::Authorised(via) => {
                content["join_authorised_via_users_server"] = via.into();
                allowed = true;
            }
            refused => return Err(refusal(refused)),
        }
    }
    let (version, event) = template(&st, &signed.origin, &room_id, &user_id, content).await?;
    // Without `ver` the asking server supports only version 1 (spec).
    if !versions.contains(&version) || spindle_core::room_version::rules(&version).is_none() {
        return Err(FedError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "M_INCOMPATIBLE_ROOM_VERSION",
            format!("the room is version {version}, which your server did not list"),
        )
        .with_room_version(&version));
    }
    let join_rule = st
        .projections
        .directory
        .join_rule(&room_id)
        .unwrap_or_else(|| "invite".into());
    if join_rule != "public" && !allowed {
        return Err(FedError::forbidden(format!(
            "the room's join rule is {join_rule} and the user is not invited"
        )));
    }
    Ok(Json(
        serde_json::json!({ "room_version": version, "event": event }),
    ))
}

/// The answer to a restricted join this server will not vouch for (spec: `make_join`
/// responses): 403 `M_FORBIDDEN` when the user is in none of the allowed rooms, 400
/// `M_UNABLE_TO_AUTHORISE_JOIN` when this server cannot tell, 400
/// `M_UNABLE_TO_GRANT_JOIN` when no local user may invite (the joining server should
/// try another resident).
fn refusal(judged: RestrictedJoin) -> FedError {
    match judged {
        RestrictedJoin::CannotJudge => FedError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "M_UNABLE_TO_AUTHORISE_JOIN",
            "this server is in none of the rooms the join rule allows; ask another",
        ),
        RestrictedJoin::NoAuthoriser => FedError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "M_UNABLE_TO_GRANT_JOIN",
            "no user of this server in the room may invite; ask another server",
        ),
        _ => FedError::forbidden("the user is not joined to any room this room's join rule allows"),
    }
}

/// A join whose `join_authorised_via_users_server` names a user of this server gets
/// this server's signature (spec: `send_join`, "Restricted rooms"), after the join is
/// judged again against the room's current join rule (it may have changed since
/// `make_join`). Any other join is returned as it came; the auth rules still check
/// that the named user may invite and, through the signatures, that their server
/// agreed.
async fn countersign_restricted_join(
    st: &FedState,
    room_id: &str,
    pdu: serde_json::Value,
) -> FedResult<serde_json::Value> {
    let via = pdu
        .get("content")
        .and_then(|c| c.get("join_authorised_via_users_server"))
        .and_then(|v| v.as_str());
    if via.and_then(server_of) != Some(st.server_name()) {
        return Ok(pdu);
    }
    let sender = pdu
        .get("sender")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let already = st
        .projections
        .membership
        .get(room_id, sender)
        .is_some_and(|m| m.membership == "invite" || m.membership == "join");
    if !already {
        match restricted_join(
            &st.projections,
            &st.journal,
            st.server_name(),
            room_id,
            sender,
        )
        .await
        {
            RestrictedJoin::NotRestricted | RestrictedJoin::Authorised(_) => {}
            refused => return Err(refusal(refused)),
        }
    }
    let version = st
        .journal
        .room_version(room_id)
        .await
        .ok_or_else(|| FedError::not_found("unknown room"))?;
    spindle_core::pdu::countersign(pdu, &version, &st.key)
        .map_err(|e| FedError::bad_json(format!("the join cannot be signed: {e}")))
}

/// `GET /_matrix/federation/v1/make_leave/{roomId}/{userId}`: a leave template.
pub(crate) async fn make_leave(
    State(st): State<FedState>,
    Path((room_id, user_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let (version, event) = template(
        &st,
        &signed.origin,
        &room_id,
        &user_id,
        serde_json::json!({ "membership": "leave" }),
    )
    .await?;
    Ok(Json(
        serde_json::json!({ "room_version": version, "event": event }),
    ))
}

pub(crate) async fn template(
    st: &FedState,
    origin: &str,
    room_id: &str,
    user_id: &str,
    content: serde_json::Value,
) -> FedResult<(String, serde_json::Value)> {
    if server_of(user_id) != Some(origin) {
        return Err(FedError::forbidden(format!(
            "{user_id} is not a user of {origin}"
        )));
    }
    if st.journal.room_version(room_id).await.is_none() {
        return Err(FedError::not_found("unknown room"));
    }
    reads::refuse_partial(st, room_id).await?;
    Ok(st
        .journal
        .membership_template(room_id, user_id, content, crate::now_ms())
        .await?)
}

/// Submits a membership PDU from a `send_*` request; checks it is the membership the
/// endpoint is for and that its sender belongs to the origin.
pub(crate) async fn submit_membership(
    st: &FedState,
    signed: &Signed,
    room_id: &str,
    event_id: &str,
    membership: &str,
) -> FedResult<(serde_json::Value, Vec<String>)> {
    let pdu = signed
        .body
        .clone()
        .ok_or_else(|| FedError::bad_json("the body must be the signed event"))?;
    let field = |k: &str| pdu.get(k).and_then(|v| v.as_str()).unwrap_or_default();
    if field("type") != "m.room.member"
        || pdu
            .get("content")
            .and_then(|c| c.get("membership"))
            .and_then(|m| m.as_str())
            != Some(membership)
    {
        return Err(FedError::bad_json(format!(
            "the event must be an m.room.member event with membership {membership}"
        )));
    }
    if field("state_key") != field("sender") || server_of(field("sender")) != Some(&signed.origin) {
        return Err(FedError::forbidden(
            "the event's sender must be the member, a user of the asking server",
        ));
    }
    if field("room_id") != room_id {
        return Err(FedError::bad_json("the event is for another room"));
    }
    reads::refuse_partial(st, room_id).await?;
    let pdu = if membership == "join" {
        countersign_restricted_join(st, room_id, pdu).await?
    } else {
        pdu
    };
    let keys = transactions::verify_keys_for(st, &pdu).await;
    let outcome = st
        .submit(
            &signed.origin,
            CommandBody::RemotePdu {
                room_id: room_id.to_owned(),
                pdu: pdu.clone(),
                keys,
                event_id: Some(event_id.to_owned()),
                auth_events: Vec::new(),
            },
        )
        .await?;
    st.wait_for(outcome.position).await?;
    let ids = reads::state_before(st, event_id).unwrap_or_default();
    Ok((pdu, ids))
}

/// Heroes whose member events a reduced `send_join` answer keeps (spec: `send_join`
/// `omit_members`, as `m.heroes` counts them).
const OMIT_MEMBERS_HEROES: usize = 5;

async fn send_join(
    st: &FedState,
    signed: &Signed,
    room_id: &str,
    event_id: &str,
    omit_members: bool,
) -> FedResult<serde_json::Value> {
    let (event, _) = submit_membership(st, signed, room_id, event_id, "join").await?;
    let entries = reads::state_entries_before(st, event_id).unwrap_or_default();
    let ids: Vec<&str> = if omit_members {
        // MSC3706: the state without member events, except the heroes' when the room
        // has neither a name nor a canonical alias (the joiner names the room from
        // them); nothing here grows with the member count.
        let named = entries
            .iter()
            .any(|(t, _, _)| t == "m.room.name" || t == "m.room.canonical_alias");
        let joiner = event
            .get("state_key")
            .and_then(|k| k.as_str())
            .unwrap_or("");
        let heroes: Vec<String> = if named {
            Vec::new()
        } else {
            st.projections
                .room_summary
                .heroes(room_id, joiner, OMIT_MEMBERS_HEROES)
        };
        entries
            .iter()
            .filter(|(t, k, _)| t != "m.room.member" || heroes.contains(k))
            .map(|(_, _, id)| id.as_str())
            .collect()
    } else {
        entries.iter().map(|(_, _, id)| id.as_str()).collect()
    };
    let state: Vec<_> = ids.iter().filter_map(|id| reads::load(st, id)).collect();
    // The chain covers the join too: the joiner authorizes its own join with it.
    let mut roots = state.clone();
    roots.extend(reads::load(st, event_id));
    let chain = reads::auth_chain(st, &roots);
    Ok(serde_json::json!({
        "origin": st.server_name(),
        "event": event,
        "state": reads::pdus_json(&state),
        "auth_chain": reads::pdus_json(&chain),
        "members_omitted": omit_members,
        "servers_in_room": reads::servers_in_room(st, room_id),
    }))
}

/// The query of `send_join` v2 (spec: `omit_members`, MSC3706).
#[derive(serde::Deserialize, Default)]
pub(crate) struct SendJoinQuery {
    #[serde(default)]
    omit_members: Option<String>,
}

/// `PUT /_matrix/federation/v2/send_join/{roomId}/{eventId}`: appends the join and
/// answers the state before it with its auth chain; with `omit_members=true` the
/// member events are left out (`members_omitted: true`, MSC3706) but for the heroes'.
pub(crate) async fn send_join_v2(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    axum::extract::Query(q): axum::extract::Query<SendJoinQuery>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let omit = q.omit_members.as_deref() == Some("true");
    Ok(Json(
        send_join(&st, &signed, &room_id, &event_id, omit).await?,
    ))
}

/// `PUT /_matrix/federation/v1/send_join/{roomId}/{eventId}`: the same, in the v1
/// `[200, {...}]` shape.
pub(crate) async fn send_join_v1(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let body = send_join(&st, &signed, &room_id, &event_id, false).await?;
    Ok(Json(serde_json::json!([200, body])))
}

/// `PUT /_matrix/federation/v2/send_leave/{roomId}/{eventId}`: appends the leave.
pub(crate) async fn send_leave_v2(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    submit_membership(&st, &signed, &room_id, &event_id, "leave").await?;
    Ok(Json(serde_json::json!({})))
}

/// `PUT /_matrix/federation/v1/send_leave/{roomId}/{eventId}`: v1 shape `[200, {}]`.
pub(crate) async fn send_leave_v1(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    submit_membership(&st, &signed, &room_id, &event_id, "leave").await?;
    Ok(Json(serde_json::json!([200, {}])))
}
