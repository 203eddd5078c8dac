//! Room discovery read rules shared by the Client-Server and the Server-Server APIs
//! (spec: client-server "Room discovery" and "Spaces"; server-server "Public Room
//! Directory" and "Spaces"): a room's summary chunk, one page of the public room
//! directory, and the `m.space.child` children of a space.
//!
//! These are queries over the projections, not projections: they keep no tables and
//! only read [`crate::state::State`], [`crate::timeline::Timeline`] and
//! [`crate::directory::Directory`]. They live here, below both `api` and `federation`,
//! so neither HTTP crate copies the other (issue 12: "rules both crates need move
//! below both of them"). A chunk costs a handful of state point lookups plus one count
//! read; a directory page reads state only for the rooms it returns (unless filtered).

use serde_json::{Value, json};

use crate::Projections;

/// Default page size of `/publicRooms` when the caller gives no `limit`.
pub const PUBLIC_ROOMS_DEFAULT_LIMIT: usize = 100;
/// Largest page of `/publicRooms`.
pub const PUBLIC_ROOMS_MAX_LIMIT: usize = 500;
/// Most published rooms one `/publicRooms` request considers.
pub const PUBLISHED_ROOMS_MAX: usize = 10_000;

/// The content of the state event `(kind, state_key)` in the room's current state.
pub fn current_state_content(
    p: &Projections,
    room_id: &str,
    kind: &str,
    state_key: &str,
) -> Option<Value> {
    let root = p.state.current_root(room_id)?;
    let id = p.state.lookup(root, kind, state_key)?;
    Some(p.timeline.event(&id)?.pdu.content_value())
}

/// A room's summary as the directory and the space hierarchy show it (spec:
/// `PublishedRoomsChunk` / `RoomSummary` fields: `room_id`, `num_joined_members`,
/// `world_readable`, `guest_can_join`, and when set `name`, `topic`, `avatar_url`,
/// `canonical_alias`, `join_rule`, `room_type`), from its current state. `None` for a
/// room this server has no state of.
pub fn room_chunk(p: &Projections, room_id: &str) -> Option<Value> {
    let root = p.state.current_root(room_id)?;
    let get = |kind: &str| {
        let id = p.state.lookup(root, kind, "")?;
        Some(p.timeline.event(&id)?.pdu.content_value())
    };
    let mut c = json!({
        "room_id": room_id,
        "num_joined_members": p.directory.joined_count(room_id),
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

/// One `/publicRooms` request, parsed.
#[derive(Debug, Clone, Default)]
pub struct PublicRoomsQuery {
    /// Page size (already clamped by [`clamp_limit`]).
    pub limit: usize,
    /// Rooms to skip (from a `since` token, see [`parse_since`]).
    pub offset: usize,
    /// `filter.generic_search_term`: case-insensitive substring of name, topic,
    /// canonical alias or room id.
    pub search: Option<String>,
    /// `filter.room_types`: `None` entries select rooms without a type.
    pub room_types: Option<Vec<Option<String>>>,
    /// `third_party_instance_id` (`<appservice id>|<network id>`): that network's
    /// list, which an application service keeps, instead of the main one.
    pub third_party_instance_id: Option<String>,
    /// `include_all_networks`: the main list plus every network's.
    pub include_all_networks: bool,
}

/// A `/publicRooms` pagination token: `p<offset>`. `Err` carries the bad token (the
/// caller answers 400 `M_INVALID_PARAM`).
pub fn parse_since(since: Option<&str>) -> Result<usize, String> {
    match since {
        None => Ok(0),
        Some(t) => t
            .strip_prefix('p')
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("Invalid since token {t:?}")),
    }
}

/// The page size for a requested `limit`: default [`PUBLIC_ROOMS_DEFAULT_LIMIT`],
/// at most [`PUBLIC_ROOMS_MAX_LIMIT`].
pub fn clamp_limit(limit: Option<u64>) -> usize {
    limit
        .map(|l| (l as usize).min(PUBLIC_ROOMS_MAX_LIMIT))
        .unwrap_or(PUBLIC_ROOMS_DEFAULT_LIMIT)
}

/// One page of the public room directory: `{chunk, total_room_count_estimate,
/// next_batch?, prev_batch?}`, largest rooms first, then by room id (a stable order
/// for pagination).
pub fn public_rooms(p: &Projections, q: &PublicRoomsQuery) -> Value {
    let published = match (&q.third_party_instance_id, q.include_all_networks) {
        (Some(instance), _) => p
            .directory
            .network_published(Some(instance), PUBLISHED_ROOMS_MAX),
        (None, true) => {
            let mut all = p.directory.published(PUBLISHED_ROOMS_MAX);
            all.extend(p.directory.network_published(None, PUBLISHED_ROOMS_MAX));
            all.sort();
            all.dedup();
            all.truncate(PUBLISHED_ROOMS_MAX);
            all
        }
        (None, false) => p.directory.published(PUBLISHED_ROOMS_MAX),
    };
    let total = published.len();
    let mut ordered: Vec<(u64, String)> = published
        .into_iter()
        .map(|r| (p.directory.joined_count(&r), r))
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
        let Some(c) = room_chunk(p, room) else {
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

/// Parses the `filter` object of `POST /publicRooms` into `q` (`generic_search_term`,
/// `room_types`). `Err` is a message for 400 `M_BAD_JSON`.
pub fn parse_filter(filter: Option<&Value>, q: &mut PublicRoomsQuery) -> Result<(), &'static str> {
    let filter = match filter {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(f)) => f,
        Some(_) => return Err("filter must be an object"),
    };
    q.search = match filter.get("generic_search_term") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t.clone()).filter(|t| !t.is_empty()),
        Some(_) => return Err("generic_search_term must be a string"),
    };
    q.room_types = match filter.get("room_types") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| match v {
                    Value::Null => Ok(None),
                    Value::String(t) => Ok(Some(t.clone())),
                    _ => Err("room_types must be a list of strings or nulls"),
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err("room_types must be a list of strings or nulls"),
    };
    Ok(())
}

/// A child's `order` if valid (spec: at most 50 printable ASCII characters).
fn child_order(content: &Value) -> Option<String> {
    content
        .get("order")
        .and_then(|o| o.as_str())
        .filter(|o| o.len() <= 50 && o.chars().all(|c| ('\x20'..='\x7e').contains(&c)))
        .map(str::to_owned)
}

/// The room's `m.space.child` events with a non-empty `via`, in the spec's order
/// (`order` first, lexicographically; then `origin_server_ts`; then room id), as
/// `(child room id, stripped event with origin_server_ts)`. With `suggested_only`,
/// only children whose content has `suggested: true`. One scan of the room's
/// `m.space.child` entries.
pub fn space_children(
    p: &Projections,
    room_id: &str,
    suggested_only: bool,
) -> Vec<(String, Value)> {
    let Some(root) = p.state.current_root(room_id) else {
        return vec![];
    };
    let mut out = Vec::new();
    for (child, id) in p.state.entries_of_type(root, "m.space.child") {
        let Some(ev) = p.timeline.event(&id) else {
            continue;
        };
        let content = ev.pdu.content_value();
        let via_ok = content
            .get("via")
            .and_then(|v| v.as_array())
            .is_some_and(|v| !v.is_empty());
        if !via_ok {
            continue;
        }
        if suggested_only && content.get("suggested") != Some(&json!(true)) {
            continue;
        }
        let ts = u64::from(ev.pdu.origin_server_ts.0);
        out.push((
            (child_order(&content), ts, child.clone()),
            json!({
                "type": "m.space.child",
                "state_key": child,
                "content": content,
                "sender": ev.pdu.sender,
                "origin_server_ts": ts,
            }),
        ));
    }
    // Rooms with an `order` come first (None sorts first in Option's order, so flip it).
    out.sort_by(|a, b| {
        let ka = (a.0.0.is_none(), &a.0.0, a.0.1, &a.0.2);
        let kb = (b.0.0.is_none(), &b.0.0, b.0.1, &b.0.2);
        ka.cmp(&kb)
    });
    out.into_iter().map(|((_, _, c), ev)| (c, ev)).collect()
}

/// Whether a room may be previewed (shown in a space hierarchy, summarised) by
/// someone outside it, from its current state: `world_readable` history, or a join
/// rule of `public`, `knock` or `knock_restricted`, or `restricted` /
/// `knock_restricted` with `in_allowed_room(room_id)` true for one of the rooms its
/// `allow` list names. Membership of the asker is the caller's part of the rule (a
/// user's own membership on the Client-Server side, a server's joined members on the
/// Server-Server side).
pub fn previewable(p: &Projections, room_id: &str, in_allowed_room: impl Fn(&str) -> bool) -> bool {
    if current_state_content(p, room_id, "m.room.history_visibility", "")
        .and_then(|c| c.get("history_visibility").cloned())
        == Some(json!("world_readable"))
    {
        return true;
    }
    let rules = current_state_content(p, room_id, "m.room.join_rules", "").unwrap_or(json!({}));
    match rules.get("join_rule").and_then(|v| v.as_str()) {
        Some("public" | "knock" | "knock_restricted") => true,
        Some("restricted") => rules
            .get("allow")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
            .filter_map(|a| a.get("room_id").and_then(|r| r.as_str()))
            .any(in_allowed_room),
        _ => false,
    }
}

/// The `room_version`, `encryption` and `allowed_room_ids` a hierarchy or summary
/// entry adds to [`room_chunk`] (spec v1.15 additions to `RoomSummary`).
pub fn add_summary_details(p: &Projections, room_id: &str, chunk: &mut Value) {
    if let Some(meta) = p.state.room(room_id) {
        chunk["room_version"] = json!(meta.room_version);
    }
    if let Some(alg) = current_state_content(p, room_id, "m.room.encryption", "")
        .and_then(|c| c.get("algorithm").cloned())
    {
        chunk["encryption"] = alg;
    }
    let allowed: Vec<Value> = current_state_content(p, room_id, "m.room.join_rules", "")
        .and_then(|c| c.get("allow").and_then(|a| a.as_array()).cloned())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|a| a.get("room_id").cloned())
        .collect();
    if !allowed.is_empty() {
        chunk["allowed_room_ids"] = Value::Array(allowed);
    }
}
