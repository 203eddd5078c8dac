//! Room reads for other servers (spec: server-server API, "Retrieving events",
//! "Backfilling and retrieving missing events", "Authentication" of events): `/event`,
//! `/state`, `/state_ids`, `/event_auth`, `/backfill`, `/get_missing_events`. All come
//! from the projections (timeline and state trie); none reads the journal.
//!
//! Access ([`Reader`]): the asking server must have a joined member in the room now, or
//! (a server that left) have had one right before or after the event asked about, or
//! ask about its own user's membership event, or the history must be `world_readable`
//! at the event. Otherwise 403 `M_FORBIDDEN`, whether or not the room exists here.
//! What it then receives of each event follows history visibility
//! ([`spindle_core::visibility::server_view`]): events it may not see, and events
//! redacted since, are served redacted (spec: "the server must ... check that the
//! requesting server is allowed to see the event"; Synapse redacts likewise, so the
//! asking server's graph stays whole). State and auth chains are served whole: they
//! are needed to authorize events.

use std::{
    collections::{HashSet, VecDeque},
    sync::Arc,
};

use axum::{
    Json,
    extract::{Path, Query, State},
};
use serde::Deserialize;
use spindle_core::{
    pdu::Pdu,
    visibility::{HistoryVisibility, ServerView, server_view},
};
use spindle_projections::state::EventRoots;

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

/// What one server may read of one room, worked out once per request (one scan of
/// the room's membership projection, whatever the number of events asked about): that
/// server's users who have a membership in the room, and whether one is joined now.
pub(crate) struct Reader<'a> {
    st: &'a FedState,
    room_id: &'a str,
    users: Vec<String>,
    joined_now: bool,
}

impl<'a> Reader<'a> {
    /// The reader for `origin` in `room_id`.
    pub(crate) fn new(st: &'a FedState, origin: &str, room_id: &'a str) -> Reader<'a> {
        let mut users = Vec::new();
        let mut joined_now = false;
        for (user, m) in st.projections.membership.members(room_id) {
            if server_of(&user) == Some(origin) {
                joined_now |= m.membership == "join";
                users.push(user);
            }
        }
        Reader {
            st,
            room_id,
            users,
            joined_now,
        }
    }

    fn membership_at(&self, root: spindle_core::trie::Root, user: &str) -> Option<String> {
        let id = self
            .st
            .projections
            .state
            .lookup(root, "m.room.member", user)?;
        load(self.st, &id)?
            .content_value()
            .get("membership")?
            .as_str()
            .map(str::to_owned)
    }

    /// How the server sees `pdu`, or `None` when it may not ask about it at all
    /// (answered 403 `M_FORBIDDEN`, or left out of a page).
    ///
    /// It may ask when one of its users is joined now (as Synapse's "host in room"
    /// check), and a server that left may still ask about an event when one of its
    /// users was joined right before or after it, when the event is one of its users'
    /// own membership events (a kick or ban it missed), or when the history was
    /// `world_readable` at it. What it then sees follows
    /// [`spindle_core::visibility::server_view`]; an event redacted since is served
    /// redacted to everyone.
    pub(crate) fn view(&self, pdu: &Pdu) -> Option<ServerView> {
        if pdu.room_id.as_str() != self.room_id {
            return None;
        }
        let timeline = &self.st.projections.timeline;
        let redacted = timeline.redacted_by(pdu.event_id.as_str()).is_some();
        let seen = |view: ServerView| {
            if redacted { ServerView::Redacted } else { view }
        };
        let own_member = pdu.kind.to_string() == "m.room.member"
            && pdu
                .state_key
                .as_deref()
                .is_some_and(|k| self.users.iter().any(|u| u == k));
        let Some(roots) = event_roots(self.st, pdu.event_id.as_str()) else {
            // No state held at the event (history backfilled from another server):
            // judged open, as Synapse judges events it holds no state for.
            return (self.joined_now || own_member).then(|| seen(ServerView::Full));
        };
        let visibility = HistoryVisibility::from_content(
            self.st
                .projections
                .state
                .lookup(roots.before, "m.room.history_visibility", "")
                .and_then(|id| load(self.st, &id))
                .map(|ev| ev.content_value())
                .as_ref(),
        );
        let after: Vec<String> = self
            .users
            .iter()
            .filter_map(|u| self.membership_at(roots.after, u))
            .collect();
        if !self.joined_now
            && !own_member
            && visibility != HistoryVisibility::WorldReadable
            && !after.iter().any(|m| m == "join")
            && !self
                .users
                .iter()
                .any(|u| self.membership_at(roots.before, u).as_deref() == Some("join"))
        {
            return None;
        }
        if own_member {
            return Some(seen(ServerView::Full));
        }
        Some(seen(server_view(
            visibility,
            after.iter().map(String::as_str),
        )))
    }

    /// `pdu` as this server receives it, or `None` when it may not ask about it.
    pub(crate) fn render(&self, pdu: &Pdu) -> Option<serde_json::Value> {
        Some(match self.view(pdu)? {
            ServerView::Full => pdu.federation_json(),
            ServerView::Redacted => pdu.redacted_federation_json(),
        })
    }
}

/// The state roots at `event_id`: a state event's own (outliers too), else those of its
/// place in the room's log ([`spindle_projections::state::State::roots_of`]). `None`
/// for an event not held here or backfilled history (no state is held at it).
fn event_roots(st: &FedState, event_id: &str) -> Option<EventRoots> {
    let state = &st.projections.state;
    state
        .state_event_roots(event_id)
        .or_else(|| state.roots_of(&st.projections.timeline.event(event_id)?))
}

/// The state before `event_id`: event ids of every state entry.
pub(crate) fn state_before(st: &FedState, event_id: &str) -> Option<Vec<String>> {
    let roots = event_roots(st, event_id)?;
    Some(
        st.projections
            .state
            .entries(roots.before)
            .into_iter()
            .map(|(_, _, id)| id)
            .collect(),
    )
}

/// The state before `event_id` as (event type, state key, event id), in key order.
pub(crate) fn state_entries_before(
    st: &FedState,
    event_id: &str,
) -> Option<Vec<(String, String, String)>> {
    let roots = event_roots(st, event_id)?;
    Some(st.projections.state.entries(roots.before))
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
    let json = Reader::new(&st, &signed.origin, pdu.room_id.as_str())
        .render(&pdu)
        .ok_or_else(|| FedError::forbidden("you may not see this event"))?;
    Ok(Json(serde_json::json!({
        "origin": st.server_name(),
        "origin_server_ts": now_ms(),
        "pdus": [json],
    })))
}

#[derive(Deserialize)]
pub(crate) struct AtEvent {
    event_id: String,
}

/// The event asked about, checked to be in the reader's room and one its server may
/// ask about (403 `M_FORBIDDEN` otherwise, also for an unknown event, so that a
/// server outside the room learns nothing).
fn event_in_room(reader: &Reader<'_>, event_id: &str) -> FedResult<Arc<Pdu>> {
    load(reader.st, event_id)
        .filter(|p| reader.view(p).is_some())
        .ok_or_else(|| FedError::forbidden("you may not see this room"))
}

/// 404 for a room whose state here is partial (MSC3902): this server cannot vouch for
/// its state yet (Synapse answers the same).
pub(crate) async fn refuse_partial(st: &FedState, room_id: &str) -> FedResult<()> {
    if st.journal.is_partial_state(room_id).await {
        return Err(FedError::not_found(
            "this server is still fetching the room's state (partial-state join); ask another",
        ));
    }
    Ok(())
}

/// `GET /_matrix/federation/v1/state/{roomId}?event_id=`: the state before the event
/// and its auth chain, as PDUs. 404 while the room's state is partial here.
pub(crate) async fn state(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    Query(q): Query<AtEvent>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    refuse_partial(&st, &room_id).await?;
    event_in_room(&Reader::new(&st, &signed.origin, &room_id), &q.event_id)?;
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
    refuse_partial(&st, &room_id).await?;
    event_in_room(&Reader::new(&st, &signed.origin, &room_id), &q.event_id)?;
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
    let pdu = event_in_room(&Reader::new(&st, &signed.origin, &room_id), &event_id)?;
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
    let reader = Reader::new(&st, &signed.origin, &room_id);
    let mut newest: Option<(u64, Arc<Pdu>)> = None;
    for id in &from {
        let pdu = event_in_room(&reader, id)?;
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
    let pdus: Vec<serde_json::Value> = ids
        .iter()
        .filter_map(|(_, id)| load(&st, id))
        .filter_map(|p| reader.render(&p))
        .collect();
    Ok(Json(serde_json::json!({
        "origin": st.server_name(),
        "origin_server_ts": now_ms(),
        "pdus": pdus,
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
    let reader = Reader::new(&st, &signed.origin, &room_id);
    for id in &body.latest_events {
        let pdu = event_in_room(&reader, id)?;
        queue.extend(pdu.prev_events.iter().map(|p| p.to_string()));
    }
    let mut out: Vec<(u64, serde_json::Value)> = Vec::new();
    while let Some(id) = queue.pop_front() {
        if out.len() >= limit {
            break;
        }
        if stop.contains(id.as_str()) || !seen.insert(id.clone()) {
            continue;
        }
        let Some(pdu) = load(&st, &id) else { continue };
        if pdu.depth < body.min_depth {
            continue;
        }
        let Some(json) = reader.render(&pdu) else {
            continue;
        };
        queue.extend(pdu.prev_events.iter().map(|p| p.to_string()));
        out.push((pdu.depth, json));
    }
    out.sort_by_key(|(depth, _)| *depth);
    let events: Vec<serde_json::Value> = out.into_iter().map(|(_, json)| json).collect();
    Ok(Json(serde_json::json!({ "events": events })))
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
