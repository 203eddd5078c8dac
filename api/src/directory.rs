//! Room and user discovery (spec: client-server API "Room discovery" and "User
//! directory"): the published room directory (`/directory/list/room/{roomId}`,
//! `GET/POST /publicRooms`) and `POST /user_directory/search`.
//!
//! Publication is a `RoomVisibilitySet` fact; the `directory` projection lists
//! published rooms and keeps each room's joined count, so a directory entry costs a
//! handful of state point lookups plus one count read.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::{get, post},
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Query, Requester, opt_str},
};

use spindle_projections::discovery;
pub use spindle_projections::discovery::{
    PUBLIC_ROOMS_DEFAULT_LIMIT, PUBLIC_ROOMS_MAX_LIMIT, PUBLISHED_ROOMS_MAX,
};
/// Default and largest `limit` of `/user_directory/search`.
pub const USER_SEARCH_DEFAULT_LIMIT: usize = 10;
/// Largest `limit` of `/user_directory/search`.
pub const USER_SEARCH_MAX_LIMIT: usize = 100;
/// Most public-join rooms whose members `/user_directory/search` considers.
pub const USER_SEARCH_PUBLIC_ROOMS_MAX: usize = 1_000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/directory/list/room/{room_id}",
            get(get_visibility).put(set_visibility),
        )
        .route(
            "/_matrix/client/v3/publicRooms",
            get(public_rooms_get).post(public_rooms_post),
        )
        .route(
            "/_matrix/client/v3/user_directory/search",
            post(search_users),
        )
}

/// `GET /directory/list/room/{roomId}` (no token needed): `public` or `private`.
async fn get_visibility(
    State(s): State<AppState>,
    Path(room_id): Path<String>,
) -> ApiResult<Json<Value>> {
    // No token, so no extractor waited: read-your-writes for a just-created room.
    s.wait_for_acknowledged().await?;
    if s.projections.state.room(&room_id).is_none() {
        return Err(MatrixError::not_found("Room not found"));
    }
    let v = if s.projections.directory.is_published(&room_id) {
        "public"
    } else {
        "private"
    };
    Ok(Json(json!({ "visibility": v })))
}

/// Whether `user_id` may publish or unpublish the room: joined, with the power level
/// needed to send `m.room.canonical_alias` (what Synapse requires).
pub(crate) fn may_edit_listing(s: &AppState, room_id: &str, user_id: &str) -> bool {
    let joined = s
        .projections
        .membership
        .get(room_id, user_id)
        .is_some_and(|m| m.membership == "join");
    if !joined {
        return false;
    }
    let (level, pl) = crate::rooms::user_power(s, room_id, user_id);
    let needed = pl
        .get("events")
        .and_then(|e| e.get("m.room.canonical_alias"))
        .and_then(|v| v.as_i64())
        .or_else(|| pl.get("state_default").and_then(|v| v.as_i64()))
        .unwrap_or(50);
    level >= needed
}

/// Publishes or unpublishes a room (no permission check: callers check).
pub(crate) async fn publish(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    public: bool,
) -> ApiResult<u64> {
    let fact = Fact::RoomVisibilitySet {
        room_id: room_id.to_owned(),
        visibility: if public { "public" } else { "private" }.into(),
    };
    Ok(
        s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
            .await?
            .position,
    )
}

/// `PUT /directory/list/room/{roomId}`: 404 for an unknown room, 403 without the power
/// to change the room's listing.
async fn set_visibility(
    State(s): State<AppState>,
    r: Requester,
    Path(room_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let visibility = opt_str(&body, "visibility")?.unwrap_or_else(|| "public".into());
    if visibility != "public" && visibility != "private" {
        return Err(MatrixError::bad_json(
            "visibility must be public or private",
        ));
    }
    if s.projections.state.room(&room_id).is_none() {
        return Err(MatrixError::not_found("Room not found"));
    }
    if !may_edit_listing(&s, &room_id, &r.user_id) {
        return Err(MatrixError::forbidden(
            "You may not change this room's directory listing",
        ));
    }
    let public = visibility == "public";
    if s.projections.directory.is_published(&room_id) != public {
        publish(&s, &r, &room_id, public).await?;
    }
    Ok(Json(json!({})))
}

/// A room's summary as the directory and the space hierarchy show it (the rule is
/// shared with federation: [`spindle_projections::discovery::room_chunk`]).
pub(crate) fn room_chunk(s: &AppState, room_id: &str) -> Option<Value> {
    discovery::room_chunk(&s.projections, room_id)
}

fn parse_since(since: Option<&str>) -> ApiResult<usize> {
    discovery::parse_since(since).map_err(MatrixError::invalid_param)
}

/// The other server a `/publicRooms?server=` asks about, `None` for ours.
fn remote_server<'a>(s: &AppState, server: Option<&'a str>) -> Option<&'a str> {
    server.filter(|other| *other != s.server_name())
}

/// Asks `server` for its public room directory over federation (spec: server-server
/// "Public Room Directory"); with federation off, 404 `M_NOT_FOUND`. The remote's
/// refusal is passed on; an unreachable server is 502.
async fn remote_public_rooms(
    s: &AppState,
    server: &str,
    body: Option<Value>,
    limit: Option<u64>,
    since: Option<String>,
) -> ApiResult<Json<Value>> {
    let Some(fed) = &s.federation else {
        return Err(MatrixError::not_found(
            "Other servers' directories need federation, which is disabled here",
        ));
    };
    spindle_federation::directory::remote_public_rooms(fed, server, body, limit, since)
        .await
        .map(Json)
        .map_err(crate::error::from_federation)
}

/// `GET /publicRooms` (no token needed): `limit`, `since`, `server` (another server's
/// directory is asked of that server over federation), `third_party_instance_id` (an
/// application service's network list, `<appservice id>|<network id>`) and
/// `include_all_networks`.
async fn public_rooms_get(State(s): State<AppState>, q: Query) -> ApiResult<Json<Value>> {
    let limit = q.u64("limit")?;
    if let Some(server) = remote_server(&s, q.get("server")) {
        let since = q.get("since").map(str::to_owned);
        return remote_public_rooms(&s, server, None, limit, since).await;
    }
    s.wait_for_acknowledged().await?;
    let query = discovery::PublicRoomsQuery {
        limit: discovery::clamp_limit(limit),
        offset: parse_since(q.get("since"))?,
        third_party_instance_id: q.get("third_party_instance_id").map(str::to_owned),
        include_all_networks: q.get("include_all_networks") == Some("true"),
        ..Default::default()
    };
    Ok(Json(discovery::public_rooms(&s.projections, &query)))
}

/// `POST /publicRooms`: adds `filter.generic_search_term` (case-insensitive substring
/// of name, topic, canonical alias or room id) and `filter.room_types`; `server` as
/// for GET (the body is passed on to that server).
async fn public_rooms_post(
    State(s): State<AppState>,
    _r: Requester,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let limit = match body.get("limit") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| MatrixError::bad_json("limit must be a non-negative integer"))?,
        ),
    };
    let mut query = discovery::PublicRoomsQuery {
        limit: discovery::clamp_limit(limit),
        offset: parse_since(opt_str(&body, "since")?.as_deref())?,
        ..Default::default()
    };
    discovery::parse_filter(body.get("filter"), &mut query).map_err(MatrixError::bad_json)?;
    query.third_party_instance_id = opt_str(&body, "third_party_instance_id")?;
    query.include_all_networks = match body.get("include_all_networks") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(MatrixError::bad_json(
                "include_all_networks must be a boolean",
            ));
        }
    };
    if let Some(server) = remote_server(&s, q.get("server")) {
        return remote_public_rooms(&s, server, Some(Value::Object(body)), limit, None).await;
    }
    Ok(Json(discovery::public_rooms(&s.projections, &query)))
}

/// `POST /user_directory/search`: users who share a joined room with the searcher,
/// or are joined to a room whose join rule is `public`; deactivated users and the
/// searcher themselves never. A
/// user matches when every word of `search_term` occurs (case-insensitive) in their
/// user id or a display name of theirs. Results are ordered by user id; `limited`
/// says more matched than `limit`. Remote users who share a room (or sit in a public
/// one) are found too; their `display_name` and `avatar_url` are those of their
/// member event, as Synapse shows them (issue 13, item 4).
///
/// Cost: the members of the searcher's joined rooms and of up to
/// [`USER_SEARCH_PUBLIC_ROOMS_MAX`] public-join rooms are read (membership rows carry
/// display names), then one account and one profile read per returned user. A
/// full-text user index is future work.
async fn search_users(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let term = opt_str(&body, "search_term")?
        .ok_or_else(|| MatrixError::missing_param("search_term is required"))?;
    let limit = match body.get("limit") {
        None | Some(Value::Null) => USER_SEARCH_DEFAULT_LIMIT,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| MatrixError::bad_json("limit must be a non-negative integer"))?
            .min(USER_SEARCH_MAX_LIMIT as u64) as usize,
    };
    let words: Vec<String> = term
        .to_lowercase()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let mut rooms: Vec<String> = s
        .projections
        .membership
        .rooms_of(&r.user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(room, _)| room)
        .collect();
    rooms.extend(
        s.projections
            .directory
            .public_join_rooms(USER_SEARCH_PUBLIC_ROOMS_MAX),
    );
    rooms.sort();
    rooms.dedup();
    // Matched users, each with the display name and avatar of the first member event
    // that matched (what a remote user's entry shows: we keep no global profile of
    // theirs).
    let mut matched = std::collections::BTreeMap::new();
    for room in &rooms {
        for (user, m) in s.projections.membership.members(room) {
            // The searcher is never a result of their own search (Synapse leaves them
            // out too, except when they sit in a public room).
            if m.membership != "join" || user == r.user_id || matched.contains_key(&user) {
                continue;
            }
            let hay = format!(
                "{} {}",
                user.to_lowercase(),
                m.displayname.as_deref().unwrap_or("").to_lowercase()
            );
            if words.iter().all(|w| hay.contains(w.as_str())) {
                matched.insert(user, (m.displayname, m.avatar_url));
            }
        }
    }
    let mut results = Vec::new();
    let mut limited = false;
    for (user, (member_name, member_avatar)) in matched {
        let local = s.is_local_user(&user);
        if local
            && s.projections
                .accounts
                .user(&user)
                .is_some_and(|a| a.deactivated)
        {
            continue;
        }
        if results.len() == limit {
            limited = true;
            break;
        }
        // A local user's global profile; a remote user's as their member event says.
        let (displayname, avatar_url) = if local {
            let p = s.projections.accounts.profile(&user);
            (p.displayname, p.avatar_url)
        } else {
            (member_name, member_avatar)
        };
        let mut entry = json!({ "user_id": user });
        if let Some(d) = displayname {
            entry["display_name"] = json!(d);
        }
        if let Some(a) = avatar_url {
            entry["avatar_url"] = json!(a);
        }
        results.push(entry);
    }
    Ok(Json(json!({ "results": results, "limited": limited })))
}
