//! Room reads for other servers (spec: server-server API, "Retrieving events",
//! "Backfilling and retrieving missing events", "Authentication" of events): `/event`,
//! `/state`, `/state_ids`, `/event_auth`, `/backfill`, `/get_missing_events`. All come
//! from the projections (timeline and state trie); none reads the journal.
//!
//! Access: the asking server must have a joined member in the room, either now or in
//! the state at the event asked about, or the room must be `world_readable` at that
//! event (spec: "the server must ... check that the requesting server is allowed to
//! see the event"). Otherwise 403 `M_FORBIDDEN`, whether or not the room exists here.

use std::{
    collections::{HashSet, VecDeque},
    sync::Arc,
};

use axum::{
    Json,
    extract::{Path, Query, State},
};
use serde::Deserialize;
use spindle_core::pdu::Pdu;

use crate::{FedState, auth::Signed, error::FedError, error::FedResult, now_ms, server_of};

/// Most events an auth chain or state answer carries (a bound on one response).
pub const MAX_CHAIN_EVENTS: usize = 100_000;

/// Most events one `/backfill` or `/get_missing_events` answer carries.
pub const MAX_PAGE_EVENTS: usize = 100;

/// An event of the timeline projection, parsed.
pub(crate) fn load(st: &FedState, event_id: &str) -> Option<Arc<Pdu>> {
    st.projections.timeline.event(event_id).map(|r| r.pdu)
}

/// Whether `server` has a joined member in `room_id` now.
pub(crate) fn server_in_room(st: &FedState, room_id: &str, server: &str) -> bool {
    st.projections
        .membership
        .members(room_id)
        .iter()
        .any(|(u, m)| m.membership == "join" && server_of(u) == Some(server))
}

/// Every server with a joined member in the room now (ours first if present).
pub fn servers_in_room(st: &FedState, room_id: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (u, m) in st.projections.membership.members(room_id) {
        if m.membership != "join" {
            continue;
        }
        if let Some(s) = server_of(&u)
            && !out.iter().any(|x| x == s)
        {
            out.push(s.to_owned());
        }
    }
    out.sort_by_key(|s| s != st.server_name());
    out
}

/// Whether `origin` may see `pdu` (see the module docs).
pub(crate) fn may_see(st: &FedState, origin: &str, pdu: &Pdu) -> bool {
    let room = pdu.room_id.as_str();
    if server_in_room(st, room, origin) {
        return true;
    }
    let Some(roots) = st.projections.state.event_roots(pdu.event_id.as_str()) else {
        return false;
    };
    let state = &st.projections.state;
    if let Some(hv) = state.lookup(roots.after, "m.room.history_visibility", "")
        && let Some(ev) = load(st, &hv)
        && ev
            .content_value()
            .get("history_visibility")
            .and_then(|v| v.as_str())
            == Some("world_readable")
    {
        return true;
    }
    state
        .entries_of_type(roots.after, "m.room.member")
        .iter()
        .filter(|(user, _)| server_of(user) == Some(origin))
        .any(|(_, id)| {
            load(st, id).is_some_and(|m| {
                m.content_value().get("membership").and_then(|v| v.as_str()) == Some("join")
            })
        })
}

/// The state before `event_id`: event ids of every state entry.
pub(crate) fn state_before(st: &FedState, event_id: &str) -> Option<Vec<String>> {
    let roots = st.projections.state.event_roots(event_id)?;
    Some(
        st.projections
            .state
            .entries(roots.before)
            .into_iter()
            .map(|(_, _, id)| id)
            .collect(),
    )
}

/// The auth chain of `events`: every event reachable through `auth_events`, not
/// including `events` themselves unless reached. Bounded by [`MAX_CHAIN_EVENTS`].
pub(crate) fn auth_chain(st: &FedState, events: &[Arc<Pdu>]) -> Vec<Arc<Pdu>> {
    let mut seen: HashSet<String> = HashSet::new();
    let mut queue: VecDeque<String> = events
        .iter()
        .flat_map(|e| e.auth_events.iter().map(|a| a.to_string()))
        .collect();
    let mut out = Vec::new();
    while let Some(id) = queue.pop_front() {
        if out.len() >= MAX_CHAIN_EVENTS || !seen.insert(id.clone()) {
            continue;
        }
        if let Some(ev) = load(st, &id) {
            queue.extend(ev.auth_events.iter().map(|a| a.to_string()));
            out.push(ev);
        }
    }
    out.sort_by_key(|e| e.depth);
    out
}

pub(crate) fn pdus_json(events: &[Arc<Pdu>]) -> Vec<serde_json::Value> {
    events.iter().map(|e| e.federation_json()).collect()
}

fn load_all(st: &FedState, ids: &[String]) -> Vec<Arc<Pdu>> {
    ids.iter().filter_map(|id| load(st, id)).collect()
}

/// `GET /_matrix/federation/v1/event/{eventId}`: one PDU.
pub(crate) async fn event(
    State(st): State<FedState>,
    Path(event_id): Path<String>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let pdu = load(&st, &event_id).ok_or_else(|| FedError::not_found("unknown event"))?;
    if !may_see(&st, &signed.origin, &pdu) {
        return Err(FedError::forbidden("you may not see this event"));
    }
    Ok(Json(serde_json::json!({
        "origin": st.server_name(),
        "origin_server_ts": now_ms(),
        "pdus": [pdu.federation_json()],
    })))
}

#[derive(Deserialize)]
pub(crate) struct AtEvent {
    event_id: String,
}

/// The event asked about, checked to be in `room_id` and visible to `origin`.
fn event_in_room(
    st: &FedState,
    origin: &str,
    room_id: &str,
    event_id: &str,
) -> FedResult<Arc<Pdu>> {
    let pdu = load(st, event_id)
        .filter(|p| p.room_id.as_str() == room_id)
        .ok_or_else(|| FedError::forbidden("you may not see this room"))?;
    if !may_see(st, origin, &pdu) {
        return Err(FedError::forbidden("you may not see this room"));
    }
    Ok(pdu)
}

/// `GET /_matrix/federation/v1/state/{roomId}?event_id=`: the state before the event
/// and its auth chain, as PDUs.
pub(crate) async fn state(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    Query(q): Query<AtEvent>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    event_in_room(&st, &signed.origin, &room_id, &q.event_id)?;
    let ids = state_before(&st, &q.event_id).unwrap_or_default();
    let pdus = load_all(&st, &ids);
    let chain = auth_chain(&st, &pdus);
    Ok(Json(serde_json::json!({
        "pdus": pdus_json(&pdus),
        "auth_chain": pdus_json(&chain),
    })))
}

/// `GET /_matrix/federation/v1/state_ids/{roomId}?event_id=`: the same, as ids.
pub(crate) async fn state_ids(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    Query(q): Query<AtEvent>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    event_in_room(&st, &signed.origin, &room_id, &q.event_id)?;
    let ids = state_before(&st, &q.event_id).unwrap_or_default();
    let pdus = load_all(&st, &ids);
    let chain: Vec<String> = auth_chain(&st, &pdus)
        .iter()
        .map(|e| e.event_id.to_string())
        .collect();
    Ok(Json(
        serde_json::json!({ "pdu_ids": ids, "auth_chain_ids": chain }),
    ))
}

/// `GET /_matrix/federation/v1/event_auth/{roomId}/{eventId}`: the event's auth chain.
pub(crate) async fn event_auth(
    State(st): State<FedState>,
    Path((room_id, event_id)): Path<(String, String)>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let pdu = event_in_room(&st, &signed.origin, &room_id, &event_id)?;
    let chain = auth_chain(&st, &[pdu]);
    Ok(Json(serde_json::json!({ "auth_chain": pdus_json(&chain) })))
}

/// `GET /_matrix/federation/v1/backfill/{roomId}?v=...&limit=`: up to `limit` events
/// ending at (and including) the newest of the `v` events, newest first.
pub(crate) async fn backfill(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let mut from = Vec::new();
    let mut limit = 10usize;
    for (k, v) in form_pairs(raw.as_deref().unwrap_or("")) {
        match k.as_str() {
            "v" => from.push(v),
            "limit" => {
                limit = v
                    .parse()
                    .map_err(|_| FedError::invalid_param("limit must be an integer"))?
            }
            _ => {}
        }
    }
    if from.is_empty() {
        return Err(FedError::invalid_param("v is required"));
    }
    let limit = limit.clamp(1, MAX_PAGE_EVENTS);
    let mut newest: Option<(u64, Arc<Pdu>)> = None;
    for id in &from {
        let pdu = event_in_room(&st, &signed.origin, &room_id, id)?;
        let pos = st
            .projections
            .timeline
            .event(id)
            .map(|r| r.position)
            .unwrap_or(0);
        if newest.as_ref().is_none_or(|(p, _)| pos > *p) {
            newest = Some((pos, pdu));
        }
    }
    let (pos, _) = newest.expect("at least one v");
    let ids = st
        .projections
        .timeline
        .range_backward(&room_id, pos + 1, 0, limit);
    let pdus: Vec<Arc<Pdu>> = ids
        .iter()
        .filter_map(|(_, id)| load(&st, id))
        .filter(|p| may_see(&st, &signed.origin, p))
        .collect();
    Ok(Json(serde_json::json!({
        "origin": st.server_name(),
        "origin_server_ts": now_ms(),
        "pdus": pdus_json(&pdus),
    })))
}

#[derive(Deserialize)]
pub(crate) struct MissingEvents {
    #[serde(default)]
    earliest_events: Vec<String>,
    latest_events: Vec<String>,
    #[serde(default = "ten")]
    limit: usize,
    #[serde(default)]
    min_depth: u64,
}

fn ten() -> usize {
    10
}

/// `POST /_matrix/federation/v1/get_missing_events/{roomId}`: walks `prev_events`
/// back from `latest_events` until `earliest_events`, `min_depth` or `limit`; answers
/// oldest first.
pub(crate) async fn get_missing_events(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let body: MissingEvents = serde_json::from_value(signed.body.clone().unwrap_or_default())
        .map_err(|e| FedError::bad_json(e.to_string()))?;
    let limit = body.limit.clamp(1, MAX_PAGE_EVENTS);
    let stop: HashSet<&str> = body.earliest_events.iter().map(String::as_str).collect();
    let mut seen: HashSet<String> = HashSet::new();
    let mut queue: VecDeque<String> = VecDeque::new();
    for id in &body.latest_events {
        let pdu = event_in_room(&st, &signed.origin, &room_id, id)?;
        queue.extend(pdu.prev_events.iter().map(|p| p.to_string()));
    }
    let mut out: Vec<Arc<Pdu>> = Vec::new();
    while let Some(id) = queue.pop_front() {
        if out.len() >= limit {
            break;
        }
        if stop.contains(id.as_str()) || !seen.insert(id.clone()) {
            continue;
        }
        let Some(pdu) = load(&st, &id) else { continue };
        if pdu.room_id.as_str() != room_id || pdu.depth < body.min_depth {
            continue;
        }
        if !may_see(&st, &signed.origin, &pdu) {
            continue;
        }
        queue.extend(pdu.prev_events.iter().map(|p| p.to_string()));
        out.push(pdu);
    }
    out.sort_by_key(|p| p.depth);
    Ok(Json(serde_json::json!({ "events": pdus_json(&out) })))
}

/// `application/x-www-form-urlencoded` pairs, percent-decoded (repeated keys kept).
pub(crate) fn form_pairs(raw: &str) -> Vec<(String, String)> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_pairs_decode_event_ids_and_repeat() {
        assert_eq!(
            form_pairs("v=%24abc%3Ad&v=%24x&limit=5&bad=%zz"),
            vec![
                ("v".to_owned(), "$abc:d".to_owned()),
                ("v".to_owned(), "$x".to_owned()),
                ("limit".to_owned(), "5".to_owned()),
                ("bad".to_owned(), "%zz".to_owned()),
            ]
        );
    }
}
