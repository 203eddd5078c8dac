//! Backfill, the asking side (spec: server-server API, "Backfilling and retrieving
//! missing events"): history from before this server's first event in a room, fetched
//! from another server in the room with `GET /_matrix/federation/v1/backfill`.
//!
//! `/messages` calls [`backfill`] when a user pages back past the oldest event held here
//! (the first time: past our own join). The answer goes through the journal
//! (`CommandBody::Backfill`: verified, authorized against its own auth events, appended
//! as `Backfilled` records) and lands in the timeline's `backfill` index, older than
//! everything else of the room; it changes no current state.

use std::collections::HashSet;

use spindle_core::pdu::event_id_of;
use spindle_journal::{CommandBody, remote::VerifyKeys};

use crate::{
    FedResult, FedState,
    error::FedError,
    transactions::{urlencode, verify_keys_for},
};

/// Most events asked for in one `/backfill` request.
pub const MAX_BACKFILL: usize = 100;

/// Most auth events fetched one by one (`/event`) for one batch.
const MAX_AUTH_FETCHES: usize = 50;

/// Fetches up to `limit` (clamped to [`MAX_BACKFILL`]) events older than the room's
/// oldest event here, from the other servers with users in the room (at most three
/// tried, in name order), and waits until the timeline has them. Returns how many
/// joined the timeline: 0 when the create event is already the oldest, when no other
/// server is in the room, or when the answer held nothing new.
///
/// Errors: the last server's failure when none answered.
pub async fn backfill(st: &FedState, room_id: &str, limit: usize) -> FedResult<usize> {
    let timeline = &st.projections.timeline;
    let Some(oldest) = timeline.oldest_event(room_id) else {
        return Ok(0);
    };
    match timeline.event(&oldest) {
        Some(ev) if ev.pdu.kind.to_string() == "m.room.create" => return Ok(0),
        Some(_) => {}
        None => return Ok(0),
    }
    let Some(version) = st.journal.room_version(room_id).await else {
        return Ok(0);
    };
    let servers: Vec<String> = st
        .journal
        .servers_in_room(room_id)
        .await
        .into_iter()
        .filter(|s| s != st.server_name())
        .collect();
    let limit = limit.clamp(1, MAX_BACKFILL);
    let mut last = None;
    for server in servers.iter().take(3) {
        let path = format!(
            "/_matrix/federation/v1/backfill/{}?v={}&limit={limit}",
            urlencode(room_id),
            urlencode(&oldest)
        );
        let answer = match st
            .client
            .request(reqwest::Method::GET, server, &path, None)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                tracing::info!(%server, room = room_id, error = %e, "backfill failed");
                last = Some(e);
                continue;
            }
        };
        let mut pdus: Vec<serde_json::Value> = answer
            .get("pdus")
            .and_then(|p| p.as_array())
            .cloned()
            .unwrap_or_default();
        pdus.truncate(MAX_BACKFILL * 2);
        // Newest first: the order the timeline appends backfilled history in.
        let key = |p: &serde_json::Value, f: &str| p.get(f).and_then(|d| d.as_u64()).unwrap_or(0);
        pdus.sort_by(|a, b| {
            key(b, "depth")
                .cmp(&key(a, "depth"))
                .then_with(|| key(b, "origin_server_ts").cmp(&key(a, "origin_server_ts")))
        });
        let ids: HashSet<String> = pdus
            .iter()
            .filter_map(|p| event_id_of(p, &version))
            .collect();
        // Auth events the batch names that are neither in it nor held here (old member
        // events, mostly): fetched one by one from the same server.
        let mut wanted: Vec<String> = Vec::new();
        for p in &pdus {
            for a in p
                .get("auth_events")
                .and_then(|a| a.as_array())
                .into_iter()
                .flatten()
            {
                if let Some(a) = a.as_str()
                    && !ids.contains(a)
                    && timeline.event(a).is_none()
                    && !wanted.iter().any(|w| w == a)
                {
                    wanted.push(a.to_owned());
                }
            }
        }
        let mut auth_events = Vec::new();
        for id in wanted.iter().take(MAX_AUTH_FETCHES) {
            let path = format!("/_matrix/federation/v1/event/{}", urlencode(id));
            match st
                .client
                .request(reqwest::Method::GET, server, &path, None)
                .await
            {
                Ok(a) => {
                    if let Some(p) = a
                        .get("pdus")
                        .and_then(|p| p.as_array())
                        .and_then(|p| p.first())
                    {
                        auth_events.push(p.clone());
                    }
                }
                Err(e) => {
                    tracing::info!(%server, event = %id, error = %e, "fetching an auth event failed")
                }
            }
        }
        let mut keys = VerifyKeys::new();
        for p in pdus.iter().chain(auth_events.iter()) {
            let missing = p
                .get("signatures")
                .and_then(|s| s.as_object())
                .is_some_and(|s| s.keys().any(|k| !keys.contains_key(k)));
            if missing {
                for (srv, k) in verify_keys_for(st, p).await {
                    keys.insert(srv, k);
                }
            }
        }
        let outcome = st
            .submit_journal(
                server,
                CommandBody::Backfill {
                    room_id: room_id.to_owned(),
                    pdus,
                    auth_events,
                    keys,
                },
            )
            .await
            .map_err(FedError::from)?;
        st.wait_for(outcome.position).await?;
        return Ok(outcome.event_ids.len());
    }
    match last {
        Some(e) => Err(crate::outbound::remote_error(e)),
        None => Ok(0),
    }
}
