//! `POST /_matrix/client/v3/search` (spec v1.19, "Server Side Search"): full-text search
//! of room events, answered from the `search` projection (a tantivy index) and filtered
//! per event by history visibility.
//!
//! **Which events.** Rooms the requester is joined to now (as Synapse does), narrowed by
//! the filter's `rooms`/`not_rooms`; within them only events the requester may see
//! ([`crate::visibility::can_see`]): a user who joined later under `joined` visibility
//! does not find what was said before. Redacted events are not in the index.
//!
//! **Cost.** One index query per request returns at most [`WINDOW`] candidates in
//! result order (the words' postings intersected with the room/sender/type terms; room
//! size does not enter). Candidates are then checked in order: an event sent while the
//! requester was already joined is visible without a store read; any other costs a few
//! point lookups, and at most `2 * limit + 20` such checks are made per request (a
//! bounded overscan). The page ends at `limit` visible results.
//!
//! **Pagination.** `next_batch` is `<order><a>_<b>_<n>`: the sort key of the last
//! result or skipped candidate (`(score bits, position)` for `rank`, `(position, score
//! bits)` for `recent`) and the number of results returned before. The next page
//! continues strictly below that key, so pages never overlap. A token that does not
//! parse or belongs to the other order is 400 `M_INVALID_PARAM`.
//!
//! **`count`** is the number of results before this page plus the visible candidates
//! this request examined: exact when the request examined every match (fewer than
//! [`WINDOW`] after the page start and the overscan was not exhausted), a lower bound
//! otherwise (the spec calls it approximate). Events hidden by history visibility are
//! never counted.

use std::collections::{BTreeMap, HashMap};

use axum::{Json, Router, extract::State, routing::post};
use serde_json::{Map, Value, json};
use spindle_projections::{
    search::{SearchHit, SearchKeys, SearchOrder, SearchQuery, SortKey},
    timeline::EventRecord,
};

use crate::{
    ApiResult, AppState, MatrixError, READ_YOUR_WRITES_TIMEOUT,
    extract::{JsonObject, Query, Requester},
    read::{readable_root, render, token},
    sync::EventFilter,
    visibility::{Access, can_see, state_content},
};

/// Longest `search_term`, bytes (longer: 400 `M_INVALID_PARAM`): each word is a
/// query clause, so an unbounded term is unbounded work for one request.
const MAX_TERM_BYTES: usize = 1000;
/// Most words in a `search_term` (more: 400 `M_INVALID_PARAM`).
const MAX_TERM_WORDS: usize = 32;
/// Results per page when the filter gives no `limit`.
pub const DEFAULT_LIMIT: usize = 10;
/// Largest `filter.limit` honoured (larger values are clamped).
pub const MAX_LIMIT: usize = 100;
/// Candidates one request takes from the index (results, skipped and counted).
pub const WINDOW: usize = 500;
/// Default and largest `event_context.before_limit` / `after_limit`.
pub const DEFAULT_CONTEXT: usize = 5;
/// Largest `event_context.before_limit` / `after_limit` honoured.
pub const MAX_CONTEXT: usize = 50;

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/_matrix/client/v3/search", post(search))
}

/// The parsed `room_events` criteria.
struct Criteria {
    words: Vec<String>,
    keys: SearchKeys,
    filter: EventFilter,
    order: SearchOrder,
    before_limit: usize,
    after_limit: usize,
    include_profile: bool,
    context: bool,
    include_state: bool,
    group_by: Vec<String>,
}

fn order_char(order: SearchOrder) -> char {
    match order {
        SearchOrder::Rank => 'k',
        SearchOrder::Recent => 'r',
    }
}

/// Encodes a `next_batch` token (module doc).
fn next_token(order: SearchOrder, key: SortKey, returned: u64) -> String {
    format!("{}{}_{}_{}", order_char(order), key.0, key.1, returned)
}

/// Parses a `next_batch` token for `order`: (key to continue below, results before).
fn parse_next(token: &str, order: SearchOrder) -> ApiResult<(SortKey, u64)> {
    let bad = || MatrixError::invalid_param(format!("Invalid next_batch token {token:?}"));
    let rest = token.strip_prefix(order_char(order)).ok_or_else(bad)?;
    let mut parts = rest.split('_');
    let mut num = || -> ApiResult<u64> {
        let p = parts.next().ok_or_else(bad)?;
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        p.parse::<u64>().map_err(|_| bad())
    };
    let (a, b, n) = (num()?, num()?, num()?);
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok((SortKey(a, b), n))
}

fn field_u64(obj: &Value, name: &str, default: usize, max: usize) -> ApiResult<usize> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|n| (n as usize).min(max))
            .ok_or_else(|| MatrixError::bad_json(format!("{name} must be a non-negative integer"))),
    }
}

fn parse_criteria(s: &AppState, c: &Value) -> ApiResult<Criteria> {
    if !c.is_object() {
        return Err(MatrixError::bad_json("room_events must be an object"));
    }
    let term = c
        .get("search_term")
        .and_then(|t| t.as_str())
        .ok_or_else(|| MatrixError::bad_json("room_events.search_term (a string) is required"))?;
    if term.len() > MAX_TERM_BYTES || term.split_whitespace().count() > MAX_TERM_WORDS {
        return Err(MatrixError::invalid_param(format!(
            "search_term is limited to {MAX_TERM_WORDS} words and {MAX_TERM_BYTES} bytes"
        )));
    }
    let keys = match c.get("keys") {
        None | Some(Value::Null) => SearchKeys::default(),
        Some(Value::Array(list)) => {
            let mut keys = SearchKeys {
                body: false,
                name: false,
                topic: false,
            };
            for k in list {
                match k.as_str() {
                    Some("content.body") => keys.body = true,
                    Some("content.name") => keys.name = true,
                    Some("content.topic") => keys.topic = true,
                    _ => {
                        return Err(MatrixError::invalid_param(format!(
                            "Unknown search key {k}: use content.body, content.name or content.topic"
                        )));
                    }
                }
            }
            keys
        }
        Some(_) => return Err(MatrixError::bad_json("keys must be an array")),
    };
    let order = match c.get("order_by") {
        None | Some(Value::Null) => SearchOrder::Rank,
        Some(v) => match v.as_str() {
            Some("rank") => SearchOrder::Rank,
            Some("recent") => SearchOrder::Recent,
            _ => {
                return Err(MatrixError::invalid_param(
                    "order_by must be \"rank\" or \"recent\"",
                ));
            }
        },
    };
    let filter = EventFilter::parse(c.get("filter").unwrap_or(&Value::Null))?;
    let ctx = c.get("event_context").unwrap_or(&Value::Null);
    if !(ctx.is_null() || ctx.is_object()) {
        return Err(MatrixError::bad_json("event_context must be an object"));
    }
    let include_profile = match ctx.get("include_profile") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(MatrixError::bad_json("include_profile must be a boolean")),
    };
    let include_state = match c.get("include_state") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(MatrixError::bad_json("include_state must be a boolean")),
    };
    let mut group_by = Vec::new();
    match c.get("groupings").and_then(|g| g.get("group_by")) {
        None | Some(Value::Null) => {}
        Some(Value::Array(groups)) => {
            for g in groups {
                match g.get("key").and_then(|k| k.as_str()) {
                    Some(k @ ("room_id" | "sender")) => {
                        if !group_by.iter().any(|x| x == k) {
                            group_by.push(k.to_owned());
                        }
                    }
                    _ => {
                        return Err(MatrixError::invalid_param(
                            "groupings.group_by keys must be \"room_id\" or \"sender\"",
                        ));
                    }
                }
            }
        }
        Some(_) => return Err(MatrixError::bad_json("groupings.group_by must be an array")),
    }
    Ok(Criteria {
        words: s.projections.search.words(term),
        keys,
        filter,
        order,
        before_limit: field_u64(ctx, "before_limit", DEFAULT_CONTEXT, MAX_CONTEXT)?,
        after_limit: field_u64(ctx, "after_limit", DEFAULT_CONTEXT, MAX_CONTEXT)?,
        include_profile,
        context: ctx.is_object(),
        include_state,
        group_by,
    })
}

/// `POST /_matrix/client/v3/search` (spec: "Server Side Search"). Query parameter
/// `next_batch` continues a previous answer. Errors: 400 `M_BAD_JSON` (no
/// `search_categories`, no `search_term`, mistyped fields), 400 `M_INVALID_PARAM` (bad
/// `next_batch`, unknown `keys`/`order_by`/group key), 503 while the search index is
/// first built.
async fn search(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let categories = body
        .get("search_categories")
        .ok_or_else(|| MatrixError::bad_json("search_categories is required"))?;
    if !categories.is_object() {
        return Err(MatrixError::bad_json("search_categories must be an object"));
    }
    let Some(room_events) = categories.get("room_events").filter(|v| !v.is_null()) else {
        return Ok(Json(json!({"search_categories": {}})));
    };
    let criteria = parse_criteria(&s, room_events)?;
    let page = match q.get("next_batch") {
        Some(t) => Some(parse_next(t, criteria.order)?),
        None => None,
    };
    ready(&s).await?;
    let out = room_events_search(&s, &r, &criteria, page)?;
    Ok(Json(json!({"search_categories": {"room_events": out}})))
}

/// Waits (bounded) until the search index has applied every acknowledged write (it
/// does not gate other reads, see `Projection::gates_reads`); 503 while it is first built.
async fn ready(s: &AppState) -> ApiResult<()> {
    let runtime = &s.projections.runtime;
    if !runtime.is_ready("search") {
        return Err(MatrixError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "M_UNKNOWN",
            "The search index is being built; try again later",
        ));
    }
    let head = s.journal.durable_head();
    if runtime
        .wait_for_projection("search", head, READ_YOUR_WRITES_TIMEOUT)
        .await
    {
        Ok(())
    } else {
        Err(MatrixError::internal(
            "search index did not catch up in time",
        ))
    }
}

/// Joined now and already joined at `position`: visible without a lookup.
fn visible_fast(access: &Access, position: u64) -> bool {
    access
        .membership
        .as_ref()
        .is_some_and(|m| m.membership == "join" && m.position <= position)
}

fn room_events_search(
    s: &AppState,
    r: &Requester,
    c: &Criteria,
    page: Option<(SortKey, u64)>,
) -> ApiResult<Value> {
    let limit = c.filter.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
    // The rooms searched: joined now, narrowed by the filter. One scan of the user's
    // own memberships; each gives the access the visibility checks need.
    let mut access: HashMap<String, Access> = HashMap::new();
    for (room, m) in s.projections.membership.rooms_of(&r.user_id) {
        if m.membership != "join" {
            continue;
        }
        if c.filter.not_rooms.contains(&room)
            || c.filter
                .rooms
                .as_ref()
                .is_some_and(|rs| !rs.contains(&room))
        {
            continue;
        }
        access.insert(
            room,
            Access {
                membership: Some(m),
                cap: u64::MAX,
                was_joined: false,
                left_at: None,
            },
        );
    }
    let mut rooms: Vec<String> = access.keys().cloned().collect();
    rooms.sort();
    let (below, returned_before) = match page {
        Some((k, n)) => (Some(k), n),
        None => (None, 0),
    };
    let query = SearchQuery {
        words: c.words.clone(),
        keys: c.keys,
        rooms,
        senders: c.filter.senders.clone(),
        // Ignored users' events are left out, as from timelines (Synapse's
        // `filter_events_for_client`); in the index query, so counts stay exact.
        not_senders: {
            let mut not = c.filter.not_senders.clone();
            let mut ignored: Vec<String> = crate::read::ignored_users(s, &r.user_id)
                .into_iter()
                .collect();
            ignored.sort();
            not.extend(ignored);
            not
        },
        types: c.filter.types.clone(),
        not_types: c.filter.not_types.clone(),
        contains_url: c.filter.contains_url,
        order: c.order,
        below,
        limit: WINDOW,
    };
    let hits = s
        .projections
        .search
        .search(&query)
        .map_err(MatrixError::internal)?;
    let mut complete = hits.len() < WINDOW;
    let slow_max = 2 * limit + 20;
    let mut slow = 0usize;
    let mut results: Vec<(SearchHit, EventRecord)> = Vec::new();
    let mut visible_count = 0u64;
    let mut more_after_page = false;
    // The key of the last candidate decided (for a page that ends short of `limit`).
    let mut last_decided: Option<SortKey> = None;
    for hit in hits {
        let Some(a) = access.get(&hit.room_id) else {
            continue;
        };
        let fast = visible_fast(a, hit.position);
        let full = results.len() >= limit;
        if !fast && slow >= slow_max {
            complete = false;
            break;
        }
        let visible = if fast && full {
            true
        } else {
            if !fast {
                slow += 1;
            }
            match s.projections.timeline.event(&hit.event_id) {
                Some(ev) if fast || can_see(s, &r.user_id, a, &ev) => {
                    if !full {
                        results.push((hit.clone(), ev));
                    }
                    true
                }
                _ => false,
            }
        };
        if visible {
            visible_count += 1;
            if full {
                more_after_page = true;
            }
        }
        if !full {
            last_decided = Some(hit.key);
        }
    }
    let returned = returned_before + results.len() as u64;
    let next_batch = if results.len() >= limit && (more_after_page || !complete) {
        results
            .last()
            .map(|(h, _)| next_token(c.order, h.key, returned))
    } else if results.len() < limit && !complete {
        last_decided
            .or(below)
            .map(|k| next_token(c.order, k, returned))
    } else {
        None
    };
    let viewer = Some((r.user_id.as_str(), r.device_id.as_str()));
    let mut out_results = Vec::with_capacity(results.len());
    for (hit, ev) in &results {
        let mut item = json!({
            "rank": hit.score,
            "result": render(s, ev, viewer),
        });
        if c.context {
            let a = &access[&hit.room_id];
            item["context"] = context(s, r, c, a, ev);
        }
        out_results.push(item);
    }
    let mut out = json!({
        "count": returned_before + visible_count,
        "highlights": c.words,
        "results": out_results,
    });
    if let Some(t) = next_batch {
        out["next_batch"] = json!(t);
    }
    if !c.group_by.is_empty() {
        let mut groups = Map::new();
        for key in &c.group_by {
            let mut by: BTreeMap<String, (usize, Vec<String>)> = BTreeMap::new();
            for (i, (hit, ev)) in results.iter().enumerate() {
                let value = if key == "room_id" {
                    hit.room_id.clone()
                } else {
                    ev.pdu.sender.to_string()
                };
                by.entry(value)
                    .or_insert_with(|| (i + 1, Vec::new()))
                    .1
                    .push(hit.event_id.clone());
            }
            let group: Map<String, Value> = by
                .into_iter()
                .map(|(v, (order, ids))| (v, json!({"order": order, "results": ids})))
                .collect();
            groups.insert(key.clone(), Value::Object(group));
        }
        out["groups"] = Value::Object(groups);
    }
    if c.include_state {
        let mut state = Map::new();
        for (hit, _) in &results {
            if state.contains_key(&hit.room_id) {
                continue;
            }
            let a = &access[&hit.room_id];
            let events: Vec<Value> = readable_root(s, &hit.room_id, a)
                .map(|root| {
                    s.projections
                        .state
                        .entries(root)
                        .into_iter()
                        .filter_map(|(_, _, id)| s.projections.timeline.event(&id))
                        .map(|e| render(s, &e, viewer))
                        .collect()
                })
                .unwrap_or_default();
            state.insert(hit.room_id.clone(), Value::Array(events));
        }
        out["state"] = Value::Object(state);
    }
    Ok(out)
}

/// The context of one result (spec: `event_context`): up to `before_limit` visible
/// events before it and `after_limit` after it, tokens in `/messages` form, and with
/// `include_profile` each sender's display name and avatar as of the result.
fn context(s: &AppState, r: &Requester, c: &Criteria, a: &Access, ev: &EventRecord) -> Value {
    let room = ev.pdu.room_id.as_str();
    let cap = a.cap.min(s.projections.runtime.applied());
    let viewer = Some((r.user_id.as_str(), r.device_id.as_str()));
    let pick = |rows: Vec<(u64, String)>, n: usize| -> (Vec<EventRecord>, Option<u64>) {
        let mut out = Vec::new();
        let mut last = None;
        for (pos, id) in rows {
            if out.len() >= n {
                break;
            }
            last = Some(pos);
            if let Some(e) = s.projections.timeline.event(&id)
                && can_see(s, &r.user_id, a, &e)
            {
                out.push(e);
            }
        }
        (out, last)
    };
    let (before, first_pos) = pick(
        s.projections
            .timeline
            .range_backward(room, ev.position, 0, c.before_limit * 2 + 1),
        c.before_limit,
    );
    let (after, last_pos) = pick(
        s.projections
            .timeline
            .range_forward(room, ev.position, cap, c.after_limit * 2 + 1),
        c.after_limit,
    );
    let mut out = json!({
        "start": token(first_pos.unwrap_or(ev.position).saturating_sub(1)),
        "end": token(last_pos.unwrap_or(ev.position)),
        "events_before": before.iter().map(|e| render(s, e, viewer)).collect::<Vec<_>>(),
        "events_after": after.iter().map(|e| render(s, e, viewer)).collect::<Vec<_>>(),
    });
    if c.include_profile {
        let mut profiles = Map::new();
        if let Some((root, _)) = s.projections.state.roots_at(ev) {
            for e in before.iter().chain(after.iter()).chain(std::iter::once(ev)) {
                let sender = e.pdu.sender.to_string();
                if profiles.contains_key(&sender) {
                    continue;
                }
                let mut p = Map::new();
                if let Some(content) = state_content(s, root, "m.room.member", &sender) {
                    for k in ["displayname", "avatar_url"] {
                        if let Some(v) = content.get(k).filter(|v| v.is_string()) {
                            p.insert(k.into(), v.clone());
                        }
                    }
                }
                profiles.insert(sender, Value::Object(p));
            }
        }
        out["profile_info"] = Value::Object(profiles);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_batch_tokens_round_trip_and_reject_garbage() {
        let t = next_token(SearchOrder::Recent, SortKey(42, 7), 10);
        assert_eq!(t, "r42_7_10");
        assert_eq!(
            parse_next(&t, SearchOrder::Recent).unwrap(),
            (SortKey(42, 7), 10)
        );
        // A token of the other order, or anything malformed, is refused.
        for bad in [
            "k42_7_10",
            "r42_7",
            "r42_7_10_1",
            "r_7_10",
            "r-1_7_10",
            "rx_7_10",
            "",
            "r",
            "r99999999999999999999_1_1",
            "r4 2_7_10",
        ] {
            let e = parse_next(bad, SearchOrder::Recent).unwrap_err();
            assert_eq!(e.errcode, "M_INVALID_PARAM", "{bad}");
        }
    }
}
