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
    visibility::state_content,
};

/// Default page size of `/publicRooms` when the client gives no `limit`.
pub const PUBLIC_ROOMS_DEFAULT_LIMIT: usize = 100;
/// Largest page of `/publicRooms`.
pub const PUBLIC_ROOMS_MAX_LIMIT: usize = 500;
/// Most published rooms one `/publicRooms` request considers.
pub const PUBLISHED_ROOMS_MAX: usize = 10_000;
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

/// A room's summary as the directory and the space hierarchy show it (spec:
/// `PublishedRoomsChunk` / `RoomSummary` fields), from its current state: point
/// lookups only.
pub(crate) fn room_chunk(s: &AppState, room_id: &str) -> Option<Value> {
    let root = s.projections.state.current_root(room_id)?;
    let get = |kind: &str| state_content(s, root, kind, "");
    let mut c = json!({
        "room_id": room_id,
        "num_joined_members": s.projections.directory.joined_count(room_id),
        "world_readable": get("m.room.history_visibility")
            .and_then(|v| v.get("history_visibility").cloned())
            == Some(json!("world_readable")),
        "guest_can_join": get("m.room.guest_access")
            .and_then(|v| v.get("guest_access").cloned())
            == Some(json!("can_join")),
    });
    let text = |v: Option<Value>, field: &str| {
        v.and_then(|v| v.get(field).and_then(|x| x.as_str()).map(str::to_owned))
            .filter(|x| !x.is_empty())
    };
    if let Some(n) = text(get("m.room.name"), "name") {
        c["name"] = json!(n);
    }
    if let Some(t) = text(get("m.room.topic"), "topic") {
        c["topic"] = json!(t);
    }
    if let Some(a) = text(get("m.room.avatar"), "url") {
        c["avatar_url"] = json!(a);
    }
    if let Some(a) = text(get("m.room.canonical_alias"), "alias") {
        c["canonical_alias"] = json!(a);
    }
    if let Some(j) = text(get("m.room.join_rules"), "join_rule") {
        c["join_rule"] = json!(j);
    }
    if let Some(t) = text(get("m.room.create"), "type") {
        c["room_type"] = json!(t);
    }
    Some(c)
}

/// A `/publicRooms` pagination token: `p<offset>`. Malformed: 400 `M_INVALID_PARAM`.
fn parse_since(since: Option<&str>) -> ApiResult<usize> {
    match since {
        None => Ok(0),
        Some(t) => t
            .strip_prefix('p')
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| MatrixError::invalid_param(format!("Invalid since token {t:?}"))),
    }
}

struct DirectoryQuery {
    limit: usize,
    offset: usize,
    search: Option<String>,
    /// `filter.room_types`: `None` entries select rooms without a type.
    room_types: Option<Vec<Option<String>>>,
}

fn public_rooms(s: &AppState, q: DirectoryQuery) -> Value {
    let published = s.projections.directory.published(PUBLISHED_ROOMS_MAX);
    let total = published.len();
    // Largest rooms first, then by room id: a stable order for pagination.
    let mut ordered: Vec<(u64, String)> = published
        .into_iter()
        .map(|r| (s.projections.directory.joined_count(&r), r))
        .collect();
    ordered.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let filtering = q.search.is_some() || q.room_types.is_some();
    let needle = q.search.as_ref().map(|t| t.to_lowercase());
    let matches = |c: &Value| {
        let type_ok = q.room_types.as_ref().is_none_or(|types| {
            let t = c.get("room_type").and_then(|v| v.as_str());
            types.iter().any(|want| want.as_deref() == t)
        });
        let text_ok = needle.as_ref().is_none_or(|n| {
            ["name", "topic", "canonical_alias", "room_id"]
                .iter()
                .any(|f| {
                    c.get(*f)
                        .and_then(|v| v.as_str())
                        .is_some_and(|v| v.to_lowercase().contains(n.as_str()))
                })
        });
        type_ok && text_ok
    };
    let mut chunk = Vec::new();
    let mut seen = 0usize;
    let mut more = false;
    for (_, room) in &ordered {
        // Without a filter the page is sliced before any state is read.
        if !filtering && seen < q.offset {
            seen += 1;
            continue;
        }
        let Some(c) = room_chunk(s, room) else {
            continue;
        };
        if !matches(&c) {
            continue;
        }
        if seen < q.offset {
            seen += 1;
            continue;
        }
        if chunk.len() == q.limit {
            more = true;
            break;
        }
        seen += 1;
        chunk.push(c);
    }
    let mut out = json!({ "chunk": chunk, "total_room_count_estimate": total });
    if more {
        out["next_batch"] = json!(format!("p{}", q.offset + q.limit));
    }
    if q.offset > 0 {
        out["prev_batch"] = json!(format!("p{}", q.offset.saturating_sub(q.limit)));
    }
    out
}

fn check_server(s: &AppState, server: Option<&str>) -> ApiResult<()> {
    match server {
        Some(other) if other != s.server_name() => Err(MatrixError::not_found(
            "Other servers' directories need federation, which is not served yet",
        )),
        _ => Ok(()),
    }
}

fn clamp_limit(limit: Option<u64>) -> usize {
    limit
        .map(|l| (l as usize).min(PUBLIC_ROOMS_MAX_LIMIT))
        .unwrap_or(PUBLIC_ROOMS_DEFAULT_LIMIT)
}

/// `GET /publicRooms` (no token needed): `limit`, `since`, `server`.
async fn public_rooms_get(State(s): State<AppState>, q: Query) -> ApiResult<Json<Value>> {
    check_server(&s, q.get("server"))?;
    s.wait_for_acknowledged().await?;
    let query = DirectoryQuery {
        limit: clamp_limit(q.u64("limit")?),
        offset: parse_since(q.get("since"))?,
        search: None,
        room_types: None,
    };
    Ok(Json(public_rooms(&s, query)))
}

/// `POST /publicRooms`: adds `filter.generic_search_term` (case-insensitive substring
/// of name, topic, canonical alias or room id) and `filter.room_types`.
async fn public_rooms_post(
    State(s): State<AppState>,
    _r: Requester,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    check_server(&s, q.get("server"))?;
    let limit = match body.get("limit") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| MatrixError::bad_json("limit must be a non-negative integer"))?,
        ),
    };
    let filter = match body.get("filter") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(f)) => f.clone(),
        Some(_) => return Err(MatrixError::bad_json("filter must be an object")),
    };
    let search = opt_str(&filter, "generic_search_term")?.filter(|t| !t.is_empty());
    let room_types = match filter.get("room_types") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| match v {
                    Value::Null => Ok(None),
                    Value::String(t) => Ok(Some(t.clone())),
                    _ => Err(MatrixError::bad_json(
                        "room_types must be a list of strings or nulls",
                    )),
                })
                .collect::<ApiResult<Vec<_>>>()?,
        ),
        Some(_) => {
            return Err(MatrixError::bad_json(
                "room_types must be a list of strings or nulls",
            ));
        }
    };
    let query = DirectoryQuery {
        limit: clamp_limit(limit),
        offset: parse_since(opt_str(&body, "since")?.as_deref())?,
        search,
        room_types,
    };
    Ok(Json(public_rooms(&s, query)))
}

/// `POST /user_directory/search`: users who share a joined room with the searcher,
/// or are joined to a room whose join rule is `public`; deactivated users never. A
/// user matches when every word of `search_term` occurs (case-insensitive) in their
/// user id or a display name of theirs. Results are ordered by user id; `limited`
/// says more matched than `limit`.
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
    let mut matched = std::collections::BTreeSet::new();
    for room in &rooms {
        for (user, m) in s.projections.membership.members(room) {
            if m.membership != "join" || matched.contains(&user) {
                continue;
            }
            let hay = format!(
                "{} {}",
                user.to_lowercase(),
                m.displayname.as_deref().unwrap_or("").to_lowercase()
            );
            if words.iter().all(|w| hay.contains(w.as_str())) {
                matched.insert(user);
            }
        }
    }
    let mut results = Vec::new();
    let mut limited = false;
    for user in matched {
        if s.projections
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
        let p = s.projections.accounts.profile(&user);
        let mut entry = json!({ "user_id": user });
        if let Some(d) = p.displayname {
            entry["display_name"] = json!(d);
        }
        if let Some(a) = p.avatar_url {
            entry["avatar_url"] = json!(a);
        }
        results.push(entry);
    }
    Ok(Json(json!({ "results": results, "limited": limited })))
}
