//! Room writes: createRoom, membership (join, invite, leave, kick, ban, unban,
//! forget), sending events and state, redaction, aliases, receipts and read markers.

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::{get, post, put},
};
use futures_util::StreamExt;
use ruma::room_version_rules::RoomVersionRules;
use serde_json::{Value, json};
use spindle_journal::{CommandBody, EventSpec, Fact, MembershipPrecondition, Outcome};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester, opt_str},
    ratelimit::{check_user, exempt},
};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_matrix/client/v3/createRoom", post(create_room))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/join",
            post(join_room_id),
        )
        .route(
            "/_matrix/client/v3/join/{room_id_or_alias}",
            post(join_by_id_or_alias),
        )
        .route("/_matrix/client/v3/knock/{room_id_or_alias}", post(knock))
        .route("/_matrix/client/v3/rooms/{room_id}/invite", post(invite))
        .route("/_matrix/client/v3/rooms/{room_id}/leave", post(leave))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/kick",
            post(act_on_member::<KICK>),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/ban",
            post(act_on_member::<BAN>),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/unban",
            post(act_on_member::<UNBAN>),
        )
        .route("/_matrix/client/v3/rooms/{room_id}/forget", post(forget))
        .route(
            "/_matrix/client/v3/rooms/{room_id}/send/{event_type}/{txn_id}",
            put(send),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
            put(put_state_empty_key),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/",
            put(put_state_empty_key),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
            put(put_state),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/redact/{event_id}/{txn_id}",
            put(redact),
        )
        .route(
            "/_matrix/client/v3/directory/room/{alias}",
            put(set_alias).get(resolve_alias).delete(delete_alias),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/aliases",
            get(room_aliases),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/receipt/{receipt_type}/{event_id}",
            post(receipt),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/read_markers",
            post(read_markers),
        )
        .route(
            "/_matrix/client/v3/rooms/{room_id}/typing/{user_id}",
            put(crate::typing::set_typing),
        )
}

pub(crate) fn valid_room_id(room_id: &str) -> ApiResult<()> {
    ruma::RoomId::parse(room_id)
        .map(|_| ())
        .map_err(|_| MatrixError::invalid_param(format!("Invalid room id {room_id}")))
}

fn valid_user_id(user_id: &str) -> ApiResult<()> {
    ruma::UserId::parse(user_id)
        .map(|_| ())
        .map_err(|_| MatrixError::invalid_param(format!("Invalid user id {user_id}")))
}

/// Sends one event into a room as the requester.
pub(crate) async fn send_spec(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    event: EventSpec,
    txn_id: Option<String>,
) -> ApiResult<Outcome> {
    send_checked(s, r, room_id, event, txn_id, None).await
}

async fn send_checked(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    event: EventSpec,
    txn_id: Option<String>,
    precondition: Option<MembershipPrecondition>,
) -> ApiResult<Outcome> {
    // A guest's own join, by whichever endpoint (join, `PUT /state/m.room.member`, a
    // delayed state event): only into rooms that allow guests.
    if r.is_guest
        && event.kind == "m.room.member"
        && event.state_key.as_deref() == Some(r.user_id.as_str())
        && event.content["membership"] == "join"
    {
        crate::guest::check_join(s, r, room_id)?;
    }
    let body = send_command(room_id, event, txn_id, precondition)?;
    s.submit(&r.user_id, Some(&r.device_id), body)
        .await
        .map_err(unknown_room_as_forbidden)
}

/// The command that sends one event, after the checks the journal does not make (a
/// valid room id, a state key of at most 255 bytes: 400 `M_INVALID_PARAM` / 413
/// `M_TOO_LARGE`).
pub(crate) fn send_command(
    room_id: &str,
    event: EventSpec,
    txn_id: Option<String>,
    precondition: Option<MembershipPrecondition>,
) -> ApiResult<CommandBody> {
    valid_room_id(room_id)?;
    if event.state_key.as_ref().is_some_and(|k| k.len() > 255) {
        return Err(MatrixError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "M_TOO_LARGE",
            "state_key is longer than 255 bytes",
        ));
    }
    Ok(CommandBody::SendEvent {
        room_id: room_id.to_owned(),
        event,
        txn_id,
        precondition,
    })
}

/// An unknown room answers like a room the user is not in, so existence does not leak.
pub(crate) fn unknown_room_as_forbidden(e: MatrixError) -> MatrixError {
    if e.errcode == "M_NOT_FOUND" {
        MatrixError::forbidden("Unknown room or not a member of it")
    } else {
        e
    }
}

/// The membership transitions the endpoints allow (spec: kick needs the target in the
/// room; unban needs a ban; a repeated invite or ban is a no-op), checked atomically by
/// the journal.
fn precondition(membership: &str, target_is_self: bool) -> Option<MembershipPrecondition> {
    let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    Some(match (membership, target_is_self) {
        ("join", true) => MembershipPrecondition {
            allowed: list(&["none", "invite", "leave", "knock", "join"]),
            unchanged_ok: true,
        },
        ("leave", true) => MembershipPrecondition {
            allowed: list(&["join", "invite", "knock"]),
            unchanged_ok: true,
        },
        ("invite", _) => MembershipPrecondition {
            allowed: list(&["none", "leave", "knock"]),
            unchanged_ok: true,
        },
        ("kick", _) => MembershipPrecondition {
            allowed: list(&["join", "invite", "knock"]),
            unchanged_ok: false,
        },
        ("knock", true) => MembershipPrecondition {
            allowed: list(&["none", "leave"]),
            unchanged_ok: true,
        },
        ("ban", _) => MembershipPrecondition {
            allowed: list(&["none", "join", "invite", "leave", "knock"]),
            unchanged_ok: true,
        },
        ("unban", _) => MembershipPrecondition {
            allowed: list(&["ban"]),
            unchanged_ok: false,
        },
        _ => return None,
    })
}

fn int_field(
    c: &serde_json::Map<String, Value>,
    name: &str,
    rules: &RoomVersionRules,
) -> ApiResult<()> {
    match c.get(name) {
        None => Ok(()),
        Some(v) if spindle_core::room_version::power_level(v, rules).is_some() => Ok(()),
        Some(_) => Err(MatrixError::bad_json(format!(
            "power levels: `{name}` must be an integer"
        ))),
    }
}

fn int_map(
    c: &serde_json::Map<String, Value>,
    name: &str,
    rules: &RoomVersionRules,
) -> ApiResult<()> {
    match c.get(name) {
        None => Ok(()),
        Some(Value::Object(m))
            if m.values()
                .all(|v| spindle_core::room_version::power_level(v, rules).is_some()) =>
        {
            Ok(())
        }
        Some(_) => Err(MatrixError::bad_json(format!(
            "power levels: `{name}` must map to integers"
        ))),
    }
}

/// Checks the content of the state events whose shape the auth rules or clients
/// depend on, so a malformed one is refused with 400 `M_BAD_JSON` instead of being
/// stored (or failing later with an auth-rule message). `room_version` decides what
/// a power level may be (before v10 a string holding an integer is one).
pub(crate) fn validate_state_content(
    s: &AppState,
    room_id: Option<&str>,
    room_version: &str,
    kind: &str,
    content: &Value,
) -> ApiResult<()> {
    let Some(c) = content.as_object() else {
        return Err(MatrixError::bad_json("content must be an object"));
    };
    let rules = spindle_core::room_version::rules(room_version).unwrap_or(RoomVersionRules::V10);
    let string = |name: &str, required: bool| -> ApiResult<Option<&str>> {
        match c.get(name) {
            None if !required => Ok(None),
            Some(Value::String(v)) => Ok(Some(v.as_str())),
            _ => Err(MatrixError::bad_json(format!(
                "{kind}: `{name}` must be a string"
            ))),
        }
    };
    match kind {
        "m.room.power_levels" => {
            for f in [
                "ban",
                "events_default",
                "invite",
                "kick",
                "redact",
                "state_default",
                "users_default",
            ] {
                int_field(c, f, &rules)?;
            }
            int_map(c, "events", &rules)?;
            int_map(c, "users", &rules)?;
            int_map(c, "notifications", &rules)?;
            if let Some(Value::Object(users)) = c.get("users") {
                for u in users.keys() {
                    valid_user_id(u)?;
                }
            }
        }
        "m.room.join_rules" => {
            let rule = string("join_rule", true)?.unwrap_or_default();
            if ![
                "public",
                "invite",
                "knock",
                "restricted",
                "knock_restricted",
                "private",
            ]
            .contains(&rule)
            {
                return Err(MatrixError::bad_json(format!("unknown join_rule {rule:?}")));
            }
        }
        "m.room.history_visibility" => {
            let v = string("history_visibility", true)?.unwrap_or_default();
            if !["world_readable", "shared", "invited", "joined"].contains(&v) {
                return Err(MatrixError::bad_json(format!(
                    "unknown history_visibility {v:?}"
                )));
            }
        }
        "m.room.guest_access" => {
            string("guest_access", true)?;
        }
        "m.room.name" if string("name", false)?.is_some_and(|n| n.len() > 255) => {
            return Err(MatrixError::bad_json(
                "m.room.name: name is longer than 255 bytes",
            ));
        }
        "m.room.topic" => {
            string("topic", false)?;
        }
        "m.room.member" => {
            let m = string("membership", true)?.unwrap_or_default();
            if !["join", "invite", "leave", "ban", "knock"].contains(&m) {
                return Err(MatrixError::bad_json(format!("unknown membership {m:?}")));
            }
        }
        "m.room.canonical_alias" => {
            // Spec: the server SHOULD check the aliases exist and point to this room.
            let mut aliases: Vec<&str> = string("alias", false)?.into_iter().collect();
            match c.get("alt_aliases") {
                None => {}
                Some(Value::Array(a)) => {
                    for v in a {
                        aliases.push(v.as_str().ok_or_else(|| {
                            MatrixError::bad_json("alt_aliases must be a list of strings")
                        })?);
                    }
                }
                Some(_) => {
                    return Err(MatrixError::bad_json(
                        "alt_aliases must be a list of strings",
                    ));
                }
            }
            for a in aliases {
                if ruma::RoomAliasId::parse(a).is_err() {
                    return Err(MatrixError::new(
                        StatusCode::BAD_REQUEST,
                        "M_INVALID_PARAM",
                        format!("{a:?} is not a room alias"),
                    ));
                }
                if !a.ends_with(&format!(":{}", s.server_name())) {
                    // Another server's alias cannot be checked without federation.
                    return Err(MatrixError::new(
                        StatusCode::BAD_REQUEST,
                        "M_BAD_ALIAS",
                        format!("{a} is on another server and cannot be checked"),
                    ));
                }
                let target = s.projections.aliases.resolve(a).map(|t| t.room_id);
                if room_id.is_some() && target.as_deref() != room_id {
                    return Err(MatrixError::new(
                        StatusCode::BAD_REQUEST,
                        "M_BAD_ALIAS",
                        format!("{a} does not point to this room"),
                    ));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn member_content(s: &AppState, user_id: &str, membership: &str, reason: Option<String>) -> Value {
    let mut c = json!({ "membership": membership });
    if membership == "join" || membership == "invite" || membership == "knock" {
        let p = s.projections.accounts.profile(user_id);
        if let Some(d) = p.displayname {
            c["displayname"] = json!(d);
        }
        if let Some(a) = p.avatar_url {
            c["avatar_url"] = json!(a);
        }
    }
    if let Some(r) = reason {
        c["reason"] = json!(r);
    }
    c
}

/// Sends a member event for an endpoint `action` (join, leave, invite, kick, ban, unban).
async fn membership(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    target: &str,
    action: &str,
    reason: Option<String>,
) -> ApiResult<Outcome> {
    let membership = match action {
        "kick" | "unban" => "leave",
        other => other,
    };
    let content = member_content(s, target, membership, reason);
    membership_event(s, r, room_id, target, action, content).await
}

/// [`membership`] with the member event's content given.
async fn membership_event(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    target: &str,
    action: &str,
    content: Value,
) -> ApiResult<Outcome> {
    valid_user_id(target)?;
    // A remote target's current membership may be one the partial state left out
    // (MSC3902): a kick, ban, unban or invite of them waits for the full state, as
    // Synapse's membership changes do, rather than failing its auth check.
    if target != r.user_id && !s.is_local_user(target) {
        s.wait_for_full_state(room_id).await?;
    }
    send_checked(
        s,
        r,
        room_id,
        EventSpec {
            kind: "m.room.member".into(),
            state_key: Some(target.to_owned()),
            content,
            redacts: None,
        },
        None,
        precondition(action, target == r.user_id),
    )
    .await
}

fn event_id_json(o: &Outcome) -> Json<Value> {
    Json(json!({ "event_id": o.event_ids.last().map(|e| e.to_string()) }))
}

pub(crate) async fn create_room(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let version = opt_str(&body, "room_version")?
        .unwrap_or_else(|| spindle_core::room_version::DEFAULT_ROOM_VERSION.into());
    if spindle_core::room_version::rules(&version).is_none() {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_UNSUPPORTED_ROOM_VERSION",
            format!("Room version {version} is not supported"),
        ));
    }
    let visibility = opt_str(&body, "visibility")?.unwrap_or_else(|| "private".into());
    if visibility != "public" && visibility != "private" {
        return Err(MatrixError::bad_json(
            "visibility must be public or private",
        ));
    }
    let invites_3pid: Vec<crate::threepid::Invite3pid> = match body.get("invite_3pid") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::Object(o) => crate::threepid::Invite3pid::parse(o),
                _ => Err(MatrixError::bad_json(
                    "invite_3pid must be a list of objects",
                )),
            })
            .collect::<ApiResult<_>>()?,
        Some(_) => return Err(MatrixError::bad_json("invite_3pid must be a list")),
    };
    // Creating a room counts as one event against `rate_limits.message`, as Synapse does.
    check_user(&s, &s.rate_limits.message, &r.user_id)?;
    let preset = opt_str(&body, "preset")?.unwrap_or_else(|| {
        if visibility == "public" {
            "public_chat".into()
        } else {
            "private_chat".into()
        }
    });
    if !["private_chat", "public_chat", "trusted_private_chat"].contains(&preset.as_str()) {
        return Err(MatrixError::bad_json(format!("Unknown preset {preset}")));
    }
    let invites: Vec<String> = match body.get("invite") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| MatrixError::bad_json("invite must be a list of user ids"))
            })
            .collect::<ApiResult<_>>()?,
        Some(_) => return Err(MatrixError::bad_json("invite must be a list of user ids")),
    };
    // Users of this server are invited in the creating command; users of other
    // servers right after it, through their servers (`/invite`).
    let local_suffix = format!(":{}", s.server_name());
    let (invites, remote_invites): (Vec<String>, Vec<String>) = invites
        .into_iter()
        .partition(|u| u.ends_with(&local_suffix));
    for u in &invites {
        valid_user_id(u)?;
        if !crate::appservice::local_user_exists(&s, u).await? {
            return Err(MatrixError::not_found(format!("Unknown user {u}")));
        }
    }
    for u in &remote_invites {
        valid_user_id(u)?;
    }
    let fed = match (&s.federation, remote_invites.is_empty()) {
        (_, true) => None,
        (Some(fed), false) => Some(fed.clone()),
        (None, false) => {
            return Err(MatrixError::forbidden(
                "Inviting users on other servers needs federation, which is disabled here",
            ));
        }
    };
    let is_direct = body
        .get("is_direct")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let alias = match opt_str(&body, "room_alias_name")? {
        Some(local) => {
            let alias = format!("#{local}:{}", s.server_name());
            if !valid_alias_localpart(&local)
                || alias.len() > 255
                || ruma::RoomAliasId::parse(&alias).is_err()
            {
                return Err(MatrixError::invalid_param("Invalid room_alias_name"));
            }
            crate::appservice::check_alias_allowed(&s, &r, &alias)?;
            if s.projections.aliases.resolve(&alias).is_some() {
                return Err(MatrixError::new(
                    StatusCode::BAD_REQUEST,
                    "M_ROOM_IN_USE",
                    "Room alias already taken",
                ));
            }
            Some(alias)
        }
        None => None,
    };
    let v12 = spindle_core::room_version::room_id_from_create(&version);
    let uses_creator_field = spindle_core::room_version::create_has_creator_field(&version);

    let mut create_content = match body.get("creation_content") {
        None | Some(Value::Null) => json!({}),
        Some(Value::Object(o)) => Value::Object(o.clone()),
        Some(_) => return Err(MatrixError::bad_json("creation_content must be an object")),
    };
    if create_content.get("type").is_some_and(|t| !t.is_string()) {
        return Err(MatrixError::bad_json(
            "creation_content.type must be a string",
        ));
    }
    if create_content
        .get("m.federate")
        .is_some_and(|t| !t.is_boolean())
    {
        return Err(MatrixError::bad_json(
            "creation_content.m.federate must be a boolean",
        ));
    }
    create_content["room_version"] = json!(version);
    if uses_creator_field {
        create_content["creator"] = json!(r.user_id);
    }
    let ev = |kind: &str, state_key: &str, content: Value| EventSpec {
        kind: kind.into(),
        state_key: Some(state_key.into()),
        content,
        redacts: None,
    };
    let mut events = vec![ev("m.room.create", "", create_content)];
    events.push(ev(
        "m.room.member",
        &r.user_id,
        member_content(&s, &r.user_id, "join", None),
    ));

    // Power levels: Synapse's defaults, then the override merged on top.
    let mut users = serde_json::Map::new();
    if !v12 {
        users.insert(r.user_id.clone(), json!(100));
    }
    if preset == "trusted_private_chat" {
        for u in invites.iter().chain(&remote_invites) {
            users.insert(u.clone(), json!(100));
        }
    }
    let mut pl = json!({
        "users": users,
        "users_default": 0,
        "events": {
            "m.room.name": 50, "m.room.power_levels": 100, "m.room.history_visibility": 100,
            "m.room.canonical_alias": 50, "m.room.avatar": 50, "m.room.tombstone": 100,
            "m.room.server_acl": 100, "m.room.encryption": 100,
        },
        "events_default": 0, "state_default": 50, "ban": 50, "kick": 50, "redact": 50, "invite": 0,
        "notifications": { "room": 50 },
    });
    match body.get("power_level_content_override") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                pl[k] = v.clone();
            }
            validate_state_content(&s, None, &version, "m.room.power_levels", &pl)?;
        }
        Some(_) => {
            return Err(MatrixError::bad_json(
                "power_level_content_override must be an object",
            ));
        }
    }
    events.push(ev("m.room.power_levels", "", pl));
    if let Some(a) = &alias {
        events.push(ev("m.room.canonical_alias", "", json!({ "alias": a })));
    }
    let (join_rule, guest) = match preset.as_str() {
        "public_chat" => ("public", "forbidden"),
        _ => ("invite", "can_join"),
    };
    events.push(ev(
        "m.room.join_rules",
        "",
        json!({ "join_rule": join_rule }),
    ));
    events.push(ev(
        "m.room.history_visibility",
        "",
        json!({ "history_visibility": "shared" }),
    ));
    events.push(ev(
        "m.room.guest_access",
        "",
        json!({ "guest_access": guest }),
    ));
    if let Some(initial) = body.get("initial_state") {
        let Value::Array(list) = initial else {
            return Err(MatrixError::bad_json("initial_state must be a list"));
        };
        for item in list {
            let kind = item
                .get("type")
                .and_then(|v| v.as_str())
                .ok_or_else(|| MatrixError::bad_json("initial_state event needs a type"))?;
            let sk = item.get("state_key").and_then(|v| v.as_str()).unwrap_or("");
            let content = item.get("content").cloned().unwrap_or(json!({}));
            if !content.is_object() {
                return Err(MatrixError::bad_json(
                    "initial_state content must be an object",
                ));
            }
            if kind == "m.room.create" || kind == "m.room.member" || kind == "m.room.power_levels" {
                return Err(MatrixError::bad_json(format!(
                    "{kind} cannot be set through initial_state"
                )));
            }
            validate_state_content(&s, None, &version, kind, &content)?;
            if kind == "m.room.canonical_alias" {
                // The room does not exist yet: the only alias that can point to it is the
                // one created with it (`room_alias_name`).
                let named = content
                    .get("alias")
                    .into_iter()
                    .chain(
                        content
                            .get("alt_aliases")
                            .and_then(|a| a.as_array())
                            .into_iter()
                            .flatten(),
                    )
                    .filter_map(|v| v.as_str());
                for a in named {
                    if alias.as_deref() != Some(a) {
                        return Err(MatrixError::new(
                            StatusCode::BAD_REQUEST,
                            "M_BAD_ALIAS",
                            format!("{a} does not point to this room"),
                        ));
                    }
                }
            }
            events.push(ev(kind, sk, content));
        }
    }
    if let Some(name) = opt_str(&body, "name")? {
        events.push(ev("m.room.name", "", json!({ "name": name })));
    }
    if let Some(topic) = opt_str(&body, "topic")? {
        events.push(ev("m.room.topic", "", json!({ "topic": topic })));
    }
    for u in &invites {
        let mut c = member_content(&s, u, "invite", None);
        if is_direct {
            c["is_direct"] = json!(true);
        }
        events.push(ev("m.room.member", u, c));
    }
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::CreateRoom {
                room_version: version,
                events,
                alias,
            },
        )
        .await?;
    let room_id = outcome
        .room_id
        .clone()
        .ok_or_else(|| MatrixError::internal("createRoom produced no room"))?
        .to_string();
    if visibility == "public" {
        // Spec: `visibility: public` publishes the room in the room directory.
        crate::directory::publish(&s, &r, &room_id, true).await?;
    }
    if let Some(fed) = fed {
        // The room exists now whatever the invitees' servers say: an invite they
        // refuse or cannot take is withdrawn (`invite_remote`) and logged, and the room
        // is still answered (Synapse fails the request instead, leaving the client a
        // room it was not told about).
        //
        // The invites are appended in the request's order, their servers asked at
        // most [`REMOTE_INVITES_IN_FLIGHT`] at a time (an unreachable server costs up
        // to the connect timeout; one after another, n of them cost n times that), and
        // the refused ones withdrawn in the request's order again: the room's log does
        // not depend on which server answered first.
        let mut appended = Vec::new();
        for u in &remote_invites {
            match append_remote_invite(&s, &r, &room_id, u, None, is_direct).await {
                Ok(Some(invite)) => appended.push((u, invite)),
                Ok(None) => {}
                Err(e) => {
                    tracing::info!(room_id, invitee = %u, errcode = e.errcode, error = %e.error, "createRoom: a remote invite failed");
                }
            }
        }
        // Owned futures (no closure over borrows in the stream's type: the handler's
        // future must stay `Send` for every lifetime axum asks about).
        let sends: Vec<_> = appended
            .iter()
            .map(|(_, (pdu, stripped))| {
                let (fed, pdu, stripped) = (fed.clone(), pdu.clone(), stripped.clone());
                async move { spindle_federation::invites::invite_remote(&fed, &pdu, stripped).await }
            })
            .collect();
        let answers: Vec<_> = futures_util::stream::iter(sends)
            .buffered(REMOTE_INVITES_IN_FLIGHT)
            .collect()
            .await;
        for ((u, _), answer) in appended.iter().zip(answers) {
            if let Err(e) = settle_remote_invite(&s, &r, &room_id, u, answer).await {
                tracing::info!(room_id, invitee = %u, errcode = e.errcode, error = %e.error, "createRoom: a remote invite failed");
            }
        }
    }
    // Third-party invites last, each on its own (as Synapse: after the room exists, a
    // failing identity server fails the request).
    for invite in &invites_3pid {
        crate::threepid::invite_3pid(&s, &r, &room_id, invite).await?;
    }
    Ok(Json(json!({ "room_id": room_id })))
}

/// Most invitees' servers `createRoom` asks at once.
pub const REMOTE_INVITES_IN_FLIGHT: usize = 8;

/// Whether this server has the room's state. With a shared journal a room this
/// process does not know yet may have just been created through another one: it first
/// waits (at most [`crate::SHARED_JOURNAL_TOKEN_WAIT`]) for its projections to reach
/// the stream's head, instead of treating the room as remote.
async fn room_known(s: &AppState, room_id: &str) -> bool {
    if s.projections.state.room(room_id).is_some() {
        return true;
    }
    let deadline = tokio::time::Instant::now() + crate::SHARED_JOURNAL_TOKEN_WAIT;
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    let Some(head) = s.journal.shared_head(left()).await else {
        return false;
    };
    s.journal.wait_for_head(head, left()).await
        && s.projections.runtime.wait_for(head, left()).await
        && s.projections.state.room(room_id).is_some()
}

/// Joins `room_id` as the requester, through `via` when this server is not in the
/// room; rate limited per user (`rate_limits.joins`; a join of a room already joined
/// is free).
async fn join(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    via: &[String],
) -> ApiResult<Json<Value>> {
    valid_room_id(room_id)?;
    let current = s.projections.membership.get(room_id, &r.user_id);
    if current.as_ref().is_some_and(|m| m.membership == "join") {
        return Ok(Json(json!({ "room_id": room_id })));
    }
    // Before any federation: a room this server does not know has no state that
    // lets guests in (as Synapse, which judges on the state it holds).
    crate::guest::check_join(s, r, room_id)?;
    if s.projections.server_admin.is_blocked(room_id) {
        return Err(MatrixError::forbidden(
            "This room has been blocked on this server",
        ));
    }
    check_user(s, &s.rate_limits.joins, &r.user_id)?;
    let invited = current.as_ref().is_some_and(|m| m.membership == "invite");
    // A room this server is not in (or no longer in: nobody here is joined) is joined
    // through a server that is (spec: server-server API, "Joining Rooms"). So is a
    // restricted room none of whose local members may vouch for the join (spec:
    // "Restricted rooms": the join must be authorised by a server that can).
    let known = room_known(s, room_id).await;
    let here = known && crate::visibility::server_is_joined(s, room_id).await;
    let mut content = member_content(s, &r.user_id, "join", None);
    let mut no_authoriser = false;
    if here && !invited {
        use spindle_projections::joins::{RestrictedJoin, restricted_join};
        match restricted_join(
            &s.projections,
            &s.journal,
            s.server_name(),
            room_id,
            &r.user_id,
        )
        .await
        {
            RestrictedJoin::NotRestricted => {}
            RestrictedJoin::Authorised(via) => {
                content["join_authorised_via_users_server"] = json!(via);
            }
            RestrictedJoin::NotAllowed | RestrictedJoin::CannotJudge => {
                return Err(MatrixError::forbidden(
                    "You are not a member of any room this room's join rule allows",
                ));
            }
            RestrictedJoin::NoAuthoriser => no_authoriser = true,
        }
    }
    if !here || no_authoriser {
        let mut servers: Vec<String> = via.to_vec();
        // An invite names a server that is in the room: the inviter's.
        if let Some(m) = current.as_ref().filter(|m| m.membership == "invite")
            && let Some((_, srv)) = m.sender.split_once(':')
            && !servers.iter().any(|x| x == srv)
        {
            servers.push(srv.to_owned());
        }
        if let Some(origin) = room_id.split_once(':').map(|(_, srv)| srv.to_owned())
            && !servers.contains(&origin)
        {
            servers.push(origin);
        }
        servers.retain(|srv| srv != s.server_name());
        match (&s.federation, servers.is_empty()) {
            (Some(fed), false) => {
                let extra = content.as_object().cloned().unwrap_or_default();
                spindle_federation::outbound::join_remote(
                    fed, &r.user_id, room_id, &servers, extra,
                )
                .await
                .map_err(crate::error::from_federation)?;
                return Ok(Json(json!({ "room_id": room_id })));
            }
            _ if !known => {
                return Err(MatrixError::not_found("No known servers for this room"));
            }
            _ if no_authoriser => {
                return Err(MatrixError::forbidden(
                    "No user of this server who may invite is in the room, and no other \
                     server of the room was named to authorise the join",
                ));
            }
            _ => {}
        }
    }
    send_checked(
        s,
        r,
        room_id,
        EventSpec {
            kind: "m.room.member".into(),
            state_key: Some(r.user_id.clone()),
            content,
            redacts: None,
        },
        None,
        precondition("join", true),
    )
    .await?;
    Ok(Json(json!({ "room_id": room_id })))
}

/// `POST /knock/{roomIdOrAlias}?via=&server_name=` (spec: "Knocking on rooms"): asks
/// to join a room whose join rule is `knock` or `knock_restricted`. Answers
/// `{room_id}`. A room this server is not in is knocked on over federation through
/// `via`, the alias's servers or the room id's server (`make_knock`/`send_knock`);
/// unknown with no server to ask: 404. A join rule that does not allow knocking is
/// 403; knocking while joined or invited is 403.
async fn knock(
    State(s): State<AppState>,
    r: Requester,
    Path(target): Path<String>,
    q: crate::extract::Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let mut via: Vec<String> = q
        .all("via")
        .into_iter()
        .chain(q.all("server_name"))
        .map(str::to_owned)
        .collect();
    let local_suffix = format!(":{}", s.server_name());
    let room_id = if target.starts_with('#') {
        ruma::RoomAliasId::parse(&target)
            .map_err(|_| MatrixError::invalid_param("Invalid room alias"))?;
        match &s.federation {
            Some(fed) if !target.ends_with(&local_suffix) => {
                let (room_id, servers) = spindle_federation::outbound::resolve_alias(fed, &target)
                    .await
                    .map_err(crate::error::from_federation)?;
                via.extend(servers);
                room_id
            }
            _ => crate::appservice::resolve_local_alias(&s, &target)
                .await?
                .ok_or_else(|| MatrixError::not_found("Room alias not found"))?,
        }
    } else {
        valid_room_id(&target)?;
        target
    };
    let reason = opt_str(&body, "reason")?;
    let known = room_known(&s, &room_id).await;
    if !known || !crate::visibility::server_is_joined(&s, &room_id).await {
        if let Some((_, origin)) = room_id.split_once(':')
            && !via.iter().any(|v| v == origin)
        {
            via.push(origin.to_owned());
        }
        via.retain(|srv| srv != s.server_name());
        match (&s.federation, via.is_empty()) {
            (Some(fed), false) => {
                if let Some(m) = s.projections.membership.get(&room_id, &r.user_id)
                    && (m.membership == "join" || m.membership == "invite")
                {
                    return Err(MatrixError::forbidden(format!(
                        "You are already {} in this room",
                        if m.membership == "join" {
                            "joined"
                        } else {
                            "invited"
                        }
                    )));
                }
                spindle_federation::knocks::knock_remote(fed, &r.user_id, &room_id, &via, reason)
                    .await
                    .map_err(crate::error::from_federation)?;
                return Ok(Json(json!({ "room_id": room_id })));
            }
            _ if !known => {
                return Err(MatrixError::not_found("No known servers for this room"));
            }
            _ => {}
        }
    }
    if let Some(m) = s.projections.membership.get(&room_id, &r.user_id)
        && (m.membership == "join" || m.membership == "invite")
    {
        return Err(MatrixError::forbidden(format!(
            "You are already {} in this room",
            if m.membership == "join" {
                "joined"
            } else {
                "invited"
            }
        )));
    }
    membership(&s, &r, &room_id, &r.user_id.clone(), "knock", reason).await?;
    Ok(Json(json!({ "room_id": room_id })))
}

async fn join_room_id(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    join(&s, &r, &room_id, &[]).await
}

/// `POST /join/{roomIdOrAlias}?via=&server_name=`: a remote alias is resolved on its
/// server; `via` (and the deprecated `server_name`) name servers to join through.
async fn join_by_id_or_alias(
    State(s): State<AppState>,
    r: Requester,
    Path(target): Path<String>,
    q: crate::extract::Query,
) -> ApiResult<Json<Value>> {
    let mut via: Vec<String> = q
        .all("via")
        .into_iter()
        .chain(q.all("server_name"))
        .map(str::to_owned)
        .collect();
    if target.starts_with('#') {
        ruma::RoomAliasId::parse(&target)
            .map_err(|_| MatrixError::invalid_param("Invalid room alias"))?;
        let local = target.ends_with(&format!(":{}", s.server_name()));
        let room_id = match (&s.federation, local) {
            (Some(fed), false) => {
                let (room_id, servers) = spindle_federation::outbound::resolve_alias(fed, &target)
                    .await
                    .map_err(crate::error::from_federation)?;
                via.extend(servers);
                room_id
            }
            _ => {
                s.projections
                    .aliases
                    .resolve(&target)
                    .ok_or_else(|| MatrixError::not_found("Room alias not found"))?
                    .room_id
            }
        };
        join(&s, &r, &room_id, &via).await
    } else {
        join(&s, &r, &target, &via).await
    }
}

fn target_and_reason(body: &serde_json::Map<String, Value>) -> ApiResult<(String, Option<String>)> {
    let user = opt_str(body, "user_id")?
        .ok_or_else(|| MatrixError::missing_param("user_id is required"))?;
    valid_user_id(&user)?;
    Ok((user, opt_str(body, "reason")?))
}

/// `POST /rooms/{roomId}/invite` (spec: "Inviting", and "Third-party invites" when the
/// body names `id_server`, `id_access_token`, `medium` and `address` instead of
/// `user_id`).
async fn invite(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    if !body.contains_key("user_id") && body.contains_key("id_server") {
        let invite = crate::threepid::Invite3pid::parse(&body)?;
        valid_room_id(&room_id)?;
        if !exempt(&s, &r.user_id) {
            let rl = &s.rate_limits;
            rl.invites_per_issuer.peek(&r.user_id)?;
            rl.invites_per_room.peek(&room_id)?;
            rl.invites_per_issuer.record(&r.user_id);
            rl.invites_per_room.record(&room_id);
        }
        crate::threepid::invite_3pid(&s, &r, &room_id, &invite).await?;
        return Ok(Json(json!({})));
    }
    let (target, reason) = target_and_reason(&body)?;
    invite_user(&s, &r, &room_id, &target, reason).await
}

/// Invites `target` (a local or remote user id) to `room_id` as the requester.
pub(crate) async fn invite_user(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    target: &str,
    reason: Option<String>,
) -> ApiResult<Json<Value>> {
    let local_suffix = format!(":{}", s.server_name());
    if target.ends_with(&local_suffix) && !crate::appservice::local_user_exists(s, target).await? {
        return Err(MatrixError::not_found("Unknown user"));
    }
    // Synapse's rc_invites: per sender, per room and per invitee; all three must have
    // room before any counts.
    if !exempt(s, &r.user_id) {
        let rl = &s.rate_limits;
        rl.invites_per_issuer.peek(&r.user_id)?;
        rl.invites_per_room.peek(room_id)?;
        rl.invites_per_user.peek(target)?;
        rl.invites_per_issuer.record(&r.user_id);
        rl.invites_per_room.record(room_id);
        rl.invites_per_user.record(target);
    }
    if !target.ends_with(&local_suffix) {
        let Some(fed) = s.federation.clone() else {
            return Err(MatrixError::forbidden(
                "Inviting users on other servers needs federation, which is disabled here",
            ));
        };
        return invite_remote(s, &fed, r, room_id, target, reason, false).await;
    }
    membership(s, r, room_id, target, "invite", reason).await?;
    Ok(Json(json!({})))
}

/// Invites a user of another server: the invite is appended here, then the invitee's
/// server countersigns it (`/invite`). If that server refuses or cannot be reached,
/// the invite is withdrawn again (when the inviter may) and its answer passed on.
/// `is_direct`: the invite's `is_direct` flag (a direct chat made by `createRoom`).
async fn invite_remote(
    s: &AppState,
    fed: &spindle_federation::FedState,
    r: &Requester,
    room_id: &str,
    target: &str,
    reason: Option<String>,
    is_direct: bool,
) -> ApiResult<Json<Value>> {
    let Some((pdu, stripped)) =
        append_remote_invite(s, r, room_id, target, reason, is_direct).await?
    else {
        return Ok(Json(json!({})));
    };
    let answer = spindle_federation::invites::invite_remote(fed, &pdu, stripped).await;
    settle_remote_invite(s, r, room_id, target, answer).await
}

/// The first half of [`invite_remote`]: appends the invite and returns it with the
/// stripped state for the invitee's server (`None`: nothing was appended, the invite
/// was already there). The stripped state leaves the invite itself out: the
/// receiving server adds it (Synapse does, and so do we), so it would appear twice.
async fn append_remote_invite(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    target: &str,
    reason: Option<String>,
    is_direct: bool,
) -> ApiResult<Option<(std::sync::Arc<spindle_core::pdu::Pdu>, Vec<Value>)>> {
    let mut content = member_content(s, target, "invite", reason);
    if is_direct {
        content["is_direct"] = json!(true);
    }
    let outcome = membership_event(s, r, room_id, target, "invite", content).await?;
    let Some(event_id) = outcome.event_ids.last() else {
        return Ok(None);
    };
    s.wait_for(outcome.position).await?;
    let invite = s
        .projections
        .timeline
        .event(event_id.as_str())
        .ok_or_else(|| MatrixError::internal("the invite was not applied"))?;
    let mut stripped =
        crate::sync::invite_state_of(&s.projections, event_id.as_str()).unwrap_or_default();
    stripped.retain(|e| !(e["type"] == "m.room.member" && e["state_key"] == target));
    Ok(Some((invite.pdu, stripped)))
}

/// The second half of [`invite_remote`]: on the invitee's server's refusal (or
/// silence), withdraws the invite and passes the refusal on.
async fn settle_remote_invite(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    target: &str,
    answer: spindle_federation::FedResult<()>,
) -> ApiResult<Json<Value>> {
    match answer {
        Ok(()) => Ok(Json(json!({}))),
        Err(e) => {
            let withdrawn = membership(s, r, room_id, target, "kick", None).await;
            if let Err(w) = withdrawn {
                tracing::info!(error = %w.error, "the refused invite could not be withdrawn");
            }
            Err(crate::error::from_federation(e))
        }
    }
}

async fn leave(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let reason = opt_str(&body, "reason")?;
    // Rejecting an invite to a room this server is not in goes through the inviter's
    // server (spec: "Leaving Rooms (Rejecting Invites)").
    if let Some(fed) = &s.federation
        && let Some(m) = s.projections.membership.get(&room_id, &r.user_id)
        && m.membership == "invite"
        && !crate::visibility::server_is_joined(&s, &room_id).await
    {
        let mut servers: Vec<String> = Vec::new();
        for id in [m.sender.as_str(), room_id.as_str()] {
            if let Some((_, srv)) = id.split_once(':')
                && !servers.iter().any(|x| x == srv)
            {
                servers.push(srv.to_owned());
            }
        }
        spindle_federation::invites::reject_remote(fed, &r.user_id, &room_id, &servers)
            .await
            .map_err(crate::error::from_federation)?;
        return Ok(Json(json!({})));
    }
    membership(&s, &r, &room_id, &r.user_id.clone(), "leave", reason).await?;
    Ok(Json(json!({})))
}

/// The member actions that share one request shape (`user_id`, `reason`).
const KICK: u8 = 0;
const BAN: u8 = 1;
const UNBAN: u8 = 2;

/// `POST /rooms/{roomId}/kick|ban|unban`: one handler, the action chosen by the route.
async fn act_on_member<const ACTION: u8>(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let (target, reason) = target_and_reason(&body)?;
    let action = match ACTION {
        KICK => "kick",
        BAN => "ban",
        _ => "unban",
    };
    membership(&s, &r, &room_id, &target, action, reason).await?;
    Ok(Json(json!({})))
}

async fn forget(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    valid_room_id(&room_id)?;
    match s.projections.membership.get(&room_id, &r.user_id) {
        Some(m)
            if m.membership == "join" || m.membership == "invite" || m.membership == "knock" =>
        {
            Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_UNKNOWN",
                "User is still in the room",
            ))
        }
        Some(_) => {
            // The journal checks again under the room lock (a join may race the forget).
            let fact = Fact::RoomForgotten {
                user_id: r.user_id.clone(),
                room_id,
            };
            match s
                .submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
                .await
            {
                Err(e) if e.errcode == "M_BAD_STATE" => Err(MatrixError::new(
                    StatusCode::BAD_REQUEST,
                    "M_UNKNOWN",
                    "User is still in the room",
                )),
                other => other.map(|_| Json(json!({}))),
            }
        }
        None => Err(MatrixError::not_found("You were never in this room")),
    }
}

fn validate_txn(txn_id: &str) -> ApiResult<()> {
    if txn_id.is_empty() || txn_id.len() > 255 {
        return Err(MatrixError::invalid_param("Invalid transaction id"));
    }
    Ok(())
}

async fn send(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_type, txn_id)): Path<(String, String, String)>,
    query: crate::extract::Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    validate_txn(&txn_id)?;
    if event_type.is_empty() || event_type.len() > 255 {
        return Err(MatrixError::invalid_param("Invalid event type"));
    }
    check_user(&s, &s.rate_limits.message, &r.user_id)?;
    if let Some(delay) = crate::delayed::delay_of(&s, &query)? {
        return crate::delayed::schedule(
            &s,
            &r,
            &room_id,
            event_type,
            None,
            Value::Object(body),
            delay,
        )
        .await;
    }
    let mut redacts = None;
    if event_type == "m.room.redaction" {
        redacts = opt_str(&body, "redacts")?;
        // A redaction sent as an event gets the checks of `/redact` (which reads the
        // projections: this route skipped the request's wait for them).
        let Some(target) = redacts.as_deref() else {
            return Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_MISSING_PARAM",
                "m.room.redaction needs redacts",
            ));
        };
        if ruma::EventId::parse(target).is_err() {
            return Err(MatrixError::invalid_param("Invalid event id in redacts"));
        }
        s.wait_for_acknowledged().await?;
        check_redaction(&s, &r, &room_id, target)?;
    }
    let o = send_spec(
        &s,
        &r,
        &room_id,
        EventSpec {
            kind: event_type,
            state_key: None,
            content: Value::Object(body),
            redacts,
        },
        Some(txn_id),
    )
    .await?;
    Ok(event_id_json(&o))
}

async fn put_state_inner(
    s: AppState,
    r: Requester,
    room_id: String,
    event_type: String,
    state_key: String,
    query: crate::extract::Query,
    body: serde_json::Map<String, Value>,
) -> ApiResult<Json<Value>> {
    if event_type == "m.room.create" {
        return Err(MatrixError::forbidden("m.room.create cannot be sent"));
    }
    check_user(&s, &s.rate_limits.message, &r.user_id)?;
    if let Some(delay) = crate::delayed::delay_of(&s, &query)? {
        if event_type == "m.room.member" {
            valid_user_id(&state_key)?;
        }
        return crate::delayed::schedule(
            &s,
            &r,
            &room_id,
            event_type,
            Some(state_key),
            Value::Object(body),
            delay,
        )
        .await;
    }
    if event_type == "m.room.member" {
        valid_user_id(&state_key)?;
    }
    let room_version = s
        .projections
        .state
        .room(&room_id)
        .map(|m| m.room_version)
        .unwrap_or_else(|| spindle_core::room_version::DEFAULT_ROOM_VERSION.into());
    validate_state_content(
        &s,
        Some(&room_id),
        &room_version,
        &event_type,
        &Value::Object(body.clone()),
    )?;
    if let Some(existing) = unchanged_state(&s, &r, &room_id, &event_type, &state_key, &body) {
        return Ok(Json(json!({ "event_id": existing })));
    }
    let o = send_spec(
        &s,
        &r,
        &room_id,
        EventSpec {
            kind: event_type,
            state_key: Some(state_key),
            content: Value::Object(body),
            redacts: None,
        },
        None,
    )
    .await?;
    Ok(event_id_json(&o))
}

/// The current state event at `(kind, state_key)` when sending `content` would repeat
/// it: same sender (a joined member) and same content. Synapse answers such a send
/// with the existing event id and appends nothing; so do we, since clients (and test
/// suites) resend state they already set and expect no new timeline event. Reads: one
/// membership row, one state point lookup, one event.
fn unchanged_state(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    kind: &str,
    state_key: &str,
    content: &serde_json::Map<String, Value>,
) -> Option<String> {
    let joined = s
        .projections
        .membership
        .get(room_id, &r.user_id)
        .is_some_and(|m| m.membership == "join");
    if !joined {
        return None;
    }
    let root = s.projections.state.current_root(room_id)?;
    let id = s.projections.state.lookup(root, kind, state_key)?;
    let ev = s.projections.timeline.event(&id)?;
    let same = ev.pdu.sender.as_str() == r.user_id
        && ev.pdu.content_value().as_object() == Some(content)
        && s.projections.timeline.redacted_by(&id).is_none();
    same.then_some(id)
}

async fn put_state_empty_key(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_type)): Path<(String, String)>,
    query: crate::extract::Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    put_state_inner(s, r, room_id, event_type, String::new(), query, body).await
}

async fn put_state(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_type, state_key)): Path<(String, String, String)>,
    query: crate::extract::Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    put_state_inner(s, r, room_id, event_type, state_key, query, body).await
}

/// The power level of `user_id` in the room's current state (spec: `m.room.power_levels`),
/// and the power-level content with string levels (rooms before v10) read as integers.
pub(crate) fn user_power(s: &AppState, room_id: &str, user_id: &str) -> (i64, Value) {
    let meta = s.projections.state.room(room_id);
    let root = s.projections.state.current_root(room_id);
    let pl =
        root.and_then(|root| crate::visibility::state_content(s, root, "m.room.power_levels", ""));
    let Some(pl) = pl else {
        let creator = meta.map(|m| m.creator == user_id).unwrap_or(false);
        return (if creator { 100 } else { 0 }, json!({}));
    };
    // Rooms before v10 may hold string levels ("50"); the journal's auth rules read
    // them as ruma does, and so does every caller from here on.
    let pl = spindle_core::room_version::integer_power_levels(&pl);
    if meta
        .as_ref()
        .is_some_and(|m| m.room_version == "12" && m.creator == user_id)
    {
        return (i64::MAX, pl);
    }
    let level = pl
        .get("users")
        .and_then(|u| u.get(user_id))
        .and_then(|v| v.as_i64())
        .or_else(|| pl.get("users_default").and_then(|v| v.as_i64()))
        .unwrap_or(0);
    (level, pl)
}

/// Whether `r` may redact `event_id` in `room_id`: the event is in that room and
/// visible to them, and they sent it or hold the room's `redact` power level (spec:
/// "Redactions"; from room version 3 the auth rules leave this check to the server
/// that applies the redaction, so every path that sends one makes it here).
/// 404 `M_NOT_FOUND` / 403 `M_FORBIDDEN`.
fn check_redaction(s: &AppState, r: &Requester, room_id: &str, event_id: &str) -> ApiResult<()> {
    let access = crate::visibility::room_access(s, &r.user_id, room_id)?;
    let target = s
        .projections
        .timeline
        .event(event_id)
        .filter(|e| {
            e.pdu.room_id.as_str() == room_id
                && crate::visibility::can_see(s, &r.user_id, &access, e)
        })
        .ok_or_else(|| MatrixError::not_found("Event not found"))?;
    // Spec: the sender may redact their own events, others need the `redact` level.
    if target.pdu.sender.as_str() != r.user_id {
        let (level, pl) = user_power(s, room_id, &r.user_id);
        let needed = pl.get("redact").and_then(|v| v.as_i64()).unwrap_or(50);
        if level < needed {
            return Err(MatrixError::forbidden(
                "You don't have permission to redact this event",
            ));
        }
    }
    Ok(())
}

async fn redact(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, event_id, txn_id)): Path<(String, String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    validate_txn(&txn_id)?;
    valid_room_id(&room_id)?;
    if ruma::EventId::parse(&event_id).is_err() {
        return Err(MatrixError::invalid_param("Invalid event id"));
    }
    check_user(&s, &s.rate_limits.message, &r.user_id)?;
    check_redaction(&s, &r, &room_id, &event_id)?;
    let mut content = serde_json::Map::new();
    if let Some(reason) = opt_str(&body, "reason")? {
        content.insert("reason".into(), json!(reason));
    }
    let o = send_spec(
        &s,
        &r,
        &room_id,
        EventSpec {
            kind: "m.room.redaction".into(),
            state_key: None,
            content: Value::Object(content),
            redacts: Some(event_id),
        },
        Some(format!("redact/{txn_id}")),
    )
    .await?;
    Ok(event_id_json(&o))
}

/// An alias localpart: non-empty, no whitespace or control characters, no `:` or `#`
/// (Synapse's rules; the spec's grammar leaves them open).
fn valid_alias_localpart(local: &str) -> bool {
    !local.is_empty()
        && !local
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == ':' || c == '#')
}

fn valid_local_alias(s: &AppState, alias: &str) -> ApiResult<()> {
    ruma::RoomAliasId::parse(alias)
        .map_err(|_| MatrixError::invalid_param("Invalid room alias"))?;
    let Some(local) = alias
        .strip_prefix('#')
        .and_then(|a| a.strip_suffix(&format!(":{}", s.server_name())))
    else {
        return Err(MatrixError::invalid_param(
            "Room alias must be on this server",
        ));
    };
    if !valid_alias_localpart(local) || alias.len() > 255 {
        return Err(MatrixError::invalid_param("Invalid room alias localpart"));
    }
    Ok(())
}

async fn set_alias(
    State(s): State<AppState>,
    r: Requester,
    Path(alias): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    valid_local_alias(&s, &alias)?;
    crate::appservice::check_alias_allowed(&s, &r, &alias)?;
    let room_id = opt_str(&body, "room_id")?
        .ok_or_else(|| MatrixError::missing_param("room_id is required"))?;
    valid_room_id(&room_id)?;
    if s.projections
        .membership
        .get(&room_id, &r.user_id)
        .map(|m| m.membership)
        != Some("join".into())
    {
        return Err(MatrixError::forbidden(
            "You must be joined to the room to add an alias",
        ));
    }
    if s.projections.aliases.resolve(&alias).is_some() {
        return Err(MatrixError::new(
            StatusCode::CONFLICT,
            "M_UNKNOWN",
            "Room alias already exists",
        ));
    }
    let fact = Fact::AliasSet {
        alias,
        room_id,
        creator: r.user_id.clone(),
    };
    match s
        .submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await
    {
        Err(e) if e.errcode == "M_ROOM_IN_USE" => Err(MatrixError::new(
            StatusCode::CONFLICT,
            "M_UNKNOWN",
            "Room alias already exists",
        )),
        other => other.map(|_| Json(json!({}))),
    }
}

async fn resolve_alias(
    State(s): State<AppState>,
    Path(alias): Path<String>,
) -> ApiResult<Json<Value>> {
    ruma::RoomAliasId::parse(&alias)
        .map_err(|_| MatrixError::invalid_param("Invalid room alias"))?;
    // No access token here, so no Requester to wait for acknowledged writes: wait
    // explicitly (read-your-writes holds for unauthenticated reads too).
    s.wait_for_acknowledged().await?;
    let local = alias.ends_with(&format!(":{}", s.server_name()));
    let room_id = if local {
        crate::appservice::resolve_local_alias(&s, &alias).await?
    } else {
        s.projections.aliases.resolve(&alias).map(|t| t.room_id)
    }
    .ok_or_else(|| MatrixError::not_found("Room alias not found"))?;
    Ok(Json(
        json!({ "room_id": room_id, "servers": [s.server_name()] }),
    ))
}

async fn delete_alias(
    State(s): State<AppState>,
    r: Requester,
    Path(alias): Path<String>,
) -> ApiResult<Json<Value>> {
    valid_local_alias(&s, &alias)?;
    crate::appservice::check_alias_allowed(&s, &r, &alias)?;
    let t = s
        .projections
        .aliases
        .resolve(&alias)
        .ok_or_else(|| MatrixError::not_found("Room alias not found"))?;
    if t.creator != r.user_id {
        let (level, pl) = user_power(&s, &t.room_id, &r.user_id);
        let needed = pl
            .get("state_default")
            .and_then(|v| v.as_i64())
            .unwrap_or(50);
        if level < needed {
            return Err(MatrixError::forbidden("You may not delete this alias"));
        }
    }
    s.submit(
        &r.user_id,
        Some(&r.device_id),
        CommandBody::Fact {
            fact: Fact::AliasDeleted {
                alias: alias.clone(),
            },
        },
    )
    .await
    .map_err(|e| {
        if e.errcode == "M_FORBIDDEN" {
            MatrixError::not_found("Room alias not found")
        } else {
            e
        }
    })?;
    drop_from_canonical_alias(&s, &r, &t.room_id, &alias).await;
    Ok(Json(json!({})))
}

/// After `alias` was deleted: when the room's `m.room.canonical_alias` names it (as
/// `alias` or among `alt_aliases`), a new one without it, sent by the deleting user
/// (Synapse's `_update_canonical_alias`; the spec: "servers ... SHOULD" keep the event
/// honest). Best effort, as Synapse: a user whose power level does not allow the
/// state event still deletes the alias, and the event keeps naming it.
async fn drop_from_canonical_alias(s: &AppState, r: &Requester, room_id: &str, alias: &str) {
    let Some(root) = s.projections.state.current_root(room_id) else {
        return;
    };
    let Some(Value::Object(mut content)) =
        crate::visibility::state_content(s, root, "m.room.canonical_alias", "")
    else {
        return;
    };
    let mut changed = false;
    if content.get("alias").and_then(Value::as_str) == Some(alias) {
        content.remove("alias");
        changed = true;
    }
    if let Some(Value::Array(alts)) = content.get_mut("alt_aliases") {
        let before = alts.len();
        alts.retain(|a| a.as_str() != Some(alias));
        if alts.len() != before {
            changed = true;
            if alts.is_empty() {
                content.remove("alt_aliases");
            }
        }
    }
    if !changed {
        return;
    }
    let sent = send_spec(
        s,
        r,
        room_id,
        EventSpec {
            kind: "m.room.canonical_alias".into(),
            state_key: Some(String::new()),
            content: Value::Object(content),
            redacts: None,
        },
        None,
    )
    .await;
    if let Err(e) = sent {
        tracing::info!(
            room_id,
            alias,
            errcode = e.errcode,
            "canonical alias kept the deleted alias"
        );
    }
}

async fn room_aliases(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    let access = crate::visibility::room_access(&s, &r.user_id, &room_id)?;
    if !access.joined() {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    Ok(Json(
        json!({ "aliases": s.projections.aliases.of_room(&room_id) }),
    ))
}

async fn set_receipt(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    receipt_type: &str,
    event_id: &str,
    thread_id: Option<String>,
) -> ApiResult<()> {
    let access = crate::visibility::room_access(s, &r.user_id, room_id)?;
    let ev = s
        .projections
        .timeline
        .event(event_id)
        .filter(|e| {
            e.pdu.room_id.as_str() == room_id
                && crate::visibility::can_see(s, &r.user_id, &access, e)
        })
        .ok_or_else(|| MatrixError::not_found("Event not found"))?;
    let _ = ev;
    let fact = match receipt_type {
        "m.read" | "m.read.private" => Fact::ReceiptSet {
            user_id: r.user_id.clone(),
            room_id: room_id.to_owned(),
            event_id: event_id.to_owned(),
            receipt_type: receipt_type.to_owned(),
            thread_id,
            ts: crate::now_ms(),
        },
        "m.fully_read" => Fact::AccountDataSet {
            user_id: r.user_id.clone(),
            room_id: Some(room_id.to_owned()),
            data_type: "m.fully_read".into(),
            content: json!({ "event_id": event_id }),
        },
        other => {
            return Err(MatrixError::invalid_param(format!(
                "Unknown receipt type {other}"
            )));
        }
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(())
}

async fn receipt(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, receipt_type, event_id)): Path<(String, String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let thread_id = opt_str(&body, "thread_id")?;
    set_receipt(&s, &r, &room_id, &receipt_type, &event_id, thread_id).await?;
    Ok(Json(json!({})))
}

async fn read_markers(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    for kind in ["m.fully_read", "m.read", "m.read.private"] {
        if let Some(event_id) = opt_str(&body, kind)? {
            set_receipt(&s, &r, &room_id, kind, &event_id, None).await?;
        }
    }
    Ok(Json(json!({})))
}
