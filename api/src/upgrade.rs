//! Room upgrades (spec: client-server API "Room Upgrades"): `POST
//! /rooms/{roomId}/upgrade`.
//!
//! The server: checks the requester may send `m.room.tombstone` in the old room;
//! creates the replacement room (one `CreateRoom` command) whose `m.room.create`
//! names the old room as `predecessor`, with the transferable state copied (server
//! ACL, encryption, name, avatar, topic, guest access, history visibility, join rules,
//! power levels, canonical alias) and the old room's bans; moves the old room's local
//! aliases and its directory listing; sends the tombstone; and restricts the old room
//! (`events_default` and `invite` raised to at least 50) so nobody keeps talking
//! there by mistake. Memberships are not copied: members follow the tombstone.
//!
//! The steps after the new room's creation are separate commands: if one fails (the
//! old room's power levels forbid it), the upgrade still answers with the new room and
//! the failure is logged. Moving an alias is a delete then a set: another user could
//! take the alias in between (it then stays with them).

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::post,
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, EventSpec, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester, opt_str},
    rooms::{send_spec, user_power},
    visibility::state_content,
};

/// State copied to the replacement room, in the order it is sent (spec list, plus the
/// canonical alias, whose aliases move with the room).
pub const TRANSFERABLE_STATE: [&str; 9] = [
    "m.room.join_rules",
    "m.room.history_visibility",
    "m.room.guest_access",
    "m.room.server_acl",
    "m.room.encryption",
    "m.room.name",
    "m.room.topic",
    "m.room.avatar",
    "m.room.canonical_alias",
];

/// Largest power level a room version before 12 accepts (a canonical-JSON integer).
const MAX_POWER: i64 = (1 << 53) - 1;

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/_matrix/client/v3/rooms/{room_id}/upgrade", post(upgrade))
}

fn level_of(pl: &Value, field: &str, default: i64) -> i64 {
    pl.get(field).and_then(|v| v.as_i64()).unwrap_or(default)
}

/// The highest level any action in these power levels requires.
fn highest_requirement(pl: &Value) -> i64 {
    let mut top = 100;
    for f in [
        "ban",
        "kick",
        "redact",
        "invite",
        "state_default",
        "events_default",
    ] {
        top = top.max(level_of(pl, f, 0));
    }
    if let Some(events) = pl.get("events").and_then(|e| e.as_object()) {
        for v in events.values() {
            top = top.max(v.as_i64().unwrap_or(0));
        }
    }
    top.min(MAX_POWER)
}

async fn upgrade(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let new_version = opt_str(&body, "new_version")?
        .ok_or_else(|| MatrixError::missing_param("new_version is required"))?;
    if spindle_core::room_version::rules(&new_version).is_none() {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_UNSUPPORTED_ROOM_VERSION",
            format!("Room version {new_version} is not supported"),
        ));
    }
    let access = crate::visibility::room_access(&s, &r.user_id, &room_id)?;
    if !access.joined() {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    let (level, pl) = user_power(&s, &room_id, &r.user_id);
    let tombstone_level = pl
        .get("events")
        .and_then(|e| e.get("m.room.tombstone"))
        .and_then(|v| v.as_i64())
        .unwrap_or_else(|| level_of(&pl, "state_default", 50));
    if level < tombstone_level {
        return Err(MatrixError::forbidden(
            "You need the power to send m.room.tombstone to upgrade this room",
        ));
    }
    let root = s
        .projections
        .state
        .current_root(&room_id)
        .ok_or_else(|| MatrixError::forbidden("Room state unavailable"))?;
    let old_create = state_content(&s, root, "m.room.create", "").unwrap_or(json!({}));
    let last_event = s
        .projections
        .timeline
        .range_backward(&room_id, u64::MAX, 0, 1)
        .into_iter()
        .next()
        .map(|(_, id)| id);

    let ev = |kind: &str, state_key: &str, content: Value| EventSpec {
        kind: kind.into(),
        state_key: Some(state_key.into()),
        content,
        redacts: None,
    };
    let mut create = json!({ "room_version": new_version });
    let mut predecessor = json!({ "room_id": room_id });
    if let Some(e) = &last_event {
        predecessor["event_id"] = json!(e);
    }
    create["predecessor"] = predecessor;
    for field in ["type", "m.federate"] {
        if let Some(v) = old_create.get(field) {
            create[field] = v.clone();
        }
    }
    let v12 = spindle_core::room_version::room_id_from_create(&new_version);
    if spindle_core::room_version::create_has_creator_field(&new_version) {
        create["creator"] = json!(r.user_id);
    }
    let mut events = vec![ev("m.room.create", "", create)];
    let profile = s.projections.accounts.profile(&r.user_id);
    let mut join = json!({ "membership": "join" });
    if let Some(d) = profile.displayname {
        join["displayname"] = json!(d);
    }
    if let Some(a) = profile.avatar_url {
        join["avatar_url"] = json!(a);
    }
    events.push(ev("m.room.member", &r.user_id, join));

    // Power levels: the old room's. The upgrader keeps their level (a v12 creator's
    // unbounded power becomes the highest level the room uses); in a v12 room the
    // creator must not be listed. If their level would not let them send the copied
    // state, they are raised for the copy and the real levels are sent last.
    let mut final_pl = if pl.as_object().is_some_and(|o| !o.is_empty()) {
        pl.clone()
    } else {
        json!({ "users": { r.user_id.clone(): 100 } })
    };
    if !final_pl.get("users").is_some_and(|u| u.is_object()) {
        final_pl["users"] = json!({});
    }
    let needed = highest_requirement(&final_pl);
    let mut elevated = None;
    if v12 {
        if let Some(users) = final_pl["users"].as_object_mut() {
            users.remove(&r.user_id);
        }
    } else {
        let own = if level == i64::MAX {
            needed
        } else {
            level.min(MAX_POWER)
        };
        final_pl["users"][&r.user_id] = json!(own);
        if own < needed {
            let mut raised = final_pl.clone();
            raised["users"][&r.user_id] = json!(needed);
            elevated = Some(raised);
        }
    }
    events.push(ev(
        "m.room.power_levels",
        "",
        elevated.clone().unwrap_or_else(|| final_pl.clone()),
    ));
    let mut had_alias = false;
    for kind in TRANSFERABLE_STATE {
        if let Some(c) = state_content(&s, root, kind, "") {
            if kind == "m.room.canonical_alias" {
                had_alias = c.get("alias").is_some() || c.get("alt_aliases").is_some();
            }
            events.push(ev(kind, "", c));
        }
    }
    for (user, id) in s.projections.state.entries_of_type(root, "m.room.member") {
        let Some(m) = s.projections.timeline.event(&id) else {
            continue;
        };
        let c = m.pdu.content_value();
        if c.get("membership").and_then(|v| v.as_str()) == Some("ban") {
            let mut ban = json!({ "membership": "ban" });
            if let Some(reason) = c.get("reason") {
                ban["reason"] = reason.clone();
            }
            events.push(ev("m.room.member", &user, ban));
        }
    }
    if elevated.is_some() {
        events.push(ev("m.room.power_levels", "", final_pl));
    }
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::CreateRoom {
                room_version: new_version,
                events,
                alias: None,
            },
        )
        .await?;
    let new_room = outcome
        .room_id
        .ok_or_else(|| MatrixError::internal("upgrade produced no room"))?
        .to_string();

    // Aliases and the directory listing move to the new room.
    for alias in s.projections.aliases.of_room(&room_id) {
        let moved = async {
            s.submit(
                &r.user_id,
                Some(&r.device_id),
                CommandBody::Fact {
                    fact: Fact::AliasDeleted {
                        alias: alias.clone(),
                    },
                },
            )
            .await?;
            s.submit(
                &r.user_id,
                Some(&r.device_id),
                CommandBody::Fact {
                    fact: Fact::AliasSet {
                        alias: alias.clone(),
                        room_id: new_room.clone(),
                        creator: r.user_id.clone(),
                    },
                },
            )
            .await
        };
        if let Err(e) = moved.await {
            tracing::warn!(%alias, error = %e.error, "upgrade: moving an alias failed");
        }
    }
    if s.projections.directory.is_published(&room_id) {
        crate::directory::publish(&s, &r, &new_room, true).await?;
        crate::directory::publish(&s, &r, &room_id, false).await?;
    }
    // The tombstone, then the old room loses its alias and is restricted.
    send_spec(
        &s,
        &r,
        &room_id,
        ev(
            "m.room.tombstone",
            "",
            json!({ "body": "This room has been replaced", "replacement_room": new_room }),
        ),
        None,
    )
    .await?;
    if had_alias
        && let Err(e) = send_spec(
            &s,
            &r,
            &room_id,
            ev("m.room.canonical_alias", "", json!({})),
            None,
        )
        .await
    {
        tracing::warn!(room = %room_id, error = %e.error, "upgrade: clearing the old alias failed");
    }
    if pl.as_object().is_some_and(|o| !o.is_empty()) {
        let restricted = 50.max(level_of(&pl, "users_default", 0) + 1);
        let mut old_pl = pl.clone();
        old_pl["events_default"] = json!(level_of(&pl, "events_default", 0).max(restricted));
        old_pl["invite"] = json!(level_of(&pl, "invite", 0).max(restricted));
        if old_pl != pl
            && let Err(e) = send_spec(
                &s,
                &r,
                &room_id,
                ev("m.room.power_levels", "", old_pl),
                None,
            )
            .await
        {
            tracing::warn!(room = %room_id, error = %e.error, "upgrade: restricting the old room failed");
        }
    }
    Ok(Json(json!({ "replacement_room": new_room })))
}
