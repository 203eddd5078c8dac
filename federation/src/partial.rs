//! Partial-state joins, joining server side (MSC3902; the resident side, MSC3706, is
//! `send_join`'s `omit_members` in [`crate::joins`]).
//!
//! A remote join asks `send_join` with `omit_members=true`. When the resident answers
//! `members_omitted: true`, the journal imports the room with the member events it
//! got (few: the heroes' and those the auth chain needs) and a
//! [`spindle_journal::Fact::RoomStatePartial`] record; the join returns to the client at
//! once and the user can read and send. Then, in the background, [`resync`] asks
//! `/state?event_id=<our join>` of the servers in the room, one after another, and
//! hands the answer to the journal as one
//! [`CommandBody::CompletePartialState`] command, which appends the missing member
//! events and a [`spindle_journal::Fact::RoomStateCompleted`]. A failed attempt is
//! retried with a doubling delay (1 s up to 5 min); a restart resumes every room still
//! partial ([`resume`]).
//!
//! While the state is partial: remote PDUs are authorized against their own auth
//! events (those the room lacks are fetched with `/event_auth`, [`fetch_auth_events`]);
//! our events go to the servers the resident named as well as to the servers of members
//! we know; this server does not let other servers join, leave or knock through it, and
//! does not answer `/state` or `/state_ids` for the room (404, as Synapse: its copy
//! cannot vouch for the state).

use std::time::Duration;

use spindle_journal::{CommandBody, remote::VerifyKeys};

use crate::{FedState, transactions::urlencode};

/// First delay between resync attempts; it doubles up to [`RETRY_MAX`].
const RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest delay between resync attempts.
const RETRY_MAX: Duration = Duration::from_secs(300);

/// Starts the background resync of every room still partial (at start-up).
pub async fn resume(st: &FedState) {
    for room in st.journal.partial_state_rooms().await {
        spawn_resync(
            st.clone(),
            room.room_id,
            room.join_event_id,
            room.servers_in_room,
            None,
        );
    }
}

/// Spawns [`resync`] for one room, after `[federation] partial_state_resync_delay_ms`.
/// `first` is the server to ask first (the resident that answered `send_join`).
pub fn spawn_resync(
    st: FedState,
    room_id: String,
    join_event_id: String,
    servers: Vec<String>,
    first: Option<String>,
) {
    tokio::spawn(async move {
        let delay = Duration::from_millis(st.config.partial_state_resync_delay_ms);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        resync(&st, &room_id, &join_event_id, servers, first).await;
    });
}

/// Fetches the room's full state at our join until one server answers and the journal
/// has imported it (see the module docs). Returns when the room is no longer partial.
pub async fn resync(
    st: &FedState,
    room_id: &str,
    join_event_id: &str,
    servers: Vec<String>,
    first: Option<String>,
) {
    let mut order: Vec<String> = Vec::new();
    if let Some(f) = first {
        order.push(f);
    }
    for s in servers {
        if s != st.server_name() && !order.contains(&s) {
            order.push(s);
        }
    }
    let mut wait = RETRY_INITIAL;
    loop {
        if !st.journal.is_partial_state(room_id).await {
            return;
        }
        for server in &order {
            match attempt(st, server, room_id, join_event_id).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::info!(room = %room_id, %server, error = %e, "fetching the full state failed")
                }
            }
        }
        if order.is_empty() {
            tracing::warn!(room = %room_id, "a partial-state room names no server to fetch its state from");
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RETRY_MAX);
    }
}

/// One `/state` request and the journal command with its answer.
async fn attempt(
    st: &FedState,
    server: &str,
    room_id: &str,
    join_event_id: &str,
) -> Result<(), String> {
    let path = format!(
        "/_matrix/federation/v1/state/{}?event_id={}",
        urlencode(room_id),
        urlencode(join_event_id)
    );
    let answer = st
        .client
        .request(reqwest::Method::GET, server, &path, None)
        .await
        .map_err(|e| e.to_string())?;
    let list = |k: &str| -> Vec<serde_json::Value> {
        answer
            .get(k)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default()
    };
    let (state, auth_chain) = (list("pdus"), list("auth_chain"));
    if state.is_empty() {
        return Err("the answer holds no state".into());
    }
    let keys = keys_for_all(st, state.iter().chain(auth_chain.iter())).await;
    let outcome = st
        .submit_journal(
            st.server_name(),
            CommandBody::CompletePartialState {
                room_id: room_id.to_owned(),
                state,
                auth_chain,
                keys,
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    st.wait_for(outcome.position)
        .await
        .map_err(|e| e.error.clone())?;
    Ok(())
}

/// The verify keys of every server that signed one of `pdus` (each server's keys
/// fetched once).
pub(crate) async fn keys_for_all<'a>(
    st: &FedState,
    pdus: impl Iterator<Item = &'a serde_json::Value>,
) -> VerifyKeys {
    let mut servers: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    for p in pdus {
        if let Some(sigs) = p.get("signatures").and_then(|s| s.as_object()) {
            servers.extend(sigs.keys().take(crate::transactions::MAX_SIGNERS).cloned());
        }
        if let Some(s) = p
            .get("sender")
            .and_then(|v| v.as_str())
            .and_then(crate::server_of)
        {
            servers.insert(s.to_owned());
        }
        if servers.len() > 1000 {
            break;
        }
    }
    let mut out = VerifyKeys::new();
    for server in servers {
        match st.keys.keys_of(&server).await {
            Ok(k) => {
                out.insert(server, k);
            }
            Err(e) => tracing::info!(%server, error = %e.error, "no keys for a state signer"),
        }
    }
    out
}

/// For a PDU of a partial-state room: the auth events it names that the room does
/// not hold, fetched from `origin` with `/event_auth` (the PDU's whole auth chain; the
/// journal keeps what it needs), with their signers' keys. Empty when none is missing
/// or the room is not partial.
pub(crate) async fn fetch_auth_events(
    st: &FedState,
    origin: &str,
    room_id: &str,
    event_id: &str,
    pdu: &serde_json::Value,
) -> (Vec<serde_json::Value>, VerifyKeys) {
    if !st.journal.is_partial_state(room_id).await {
        return Default::default();
    }
    let named: Vec<String> = pdu
        .get("auth_events")
        .and_then(|a| a.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|e| {
                    // v1/v2 references are [id, {hashes}].
                    e.as_str()
                        .or_else(|| e.get(0).and_then(|i| i.as_str()))
                        .map(str::to_owned)
                })
                .take(10)
                .collect()
        })
        .unwrap_or_default();
    if st
        .journal
        .unknown_auth_events(room_id, &named)
        .await
        .is_empty()
    {
        return Default::default();
    }
    let path = format!(
        "/_matrix/federation/v1/event_auth/{}/{}",
        urlencode(room_id),
        urlencode(event_id)
    );
    let chain: Vec<serde_json::Value> = match st
        .client
        .request(reqwest::Method::GET, origin, &path, None)
        .await
    {
        Ok(a) => a
            .get("auth_chain")
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default(),
        Err(e) => {
            tracing::info!(%origin, room = %room_id, error = %e, "fetching a PDU's auth events failed");
            return Default::default();
        }
    };
    // Only what the room lacks goes to the journal.
    let Some(version) = st.journal.room_version(room_id).await else {
        return Default::default();
    };
    let ids: Vec<String> = chain
        .iter()
        .map(|v| spindle_core::pdu::event_id_of(v, &version).unwrap_or_default())
        .collect();
    let unknown: std::collections::HashSet<String> = st
        .journal
        .unknown_auth_events(room_id, &ids)
        .await
        .into_iter()
        .collect();
    let chain: Vec<serde_json::Value> = chain
        .into_iter()
        .zip(ids)
        .filter(|(_, id)| !id.is_empty() && unknown.contains(id))
        .map(|(v, _)| v)
        .take(spindle_journal::remote::MAX_FETCHED_AUTH_EVENTS)
        .collect();
    let keys = keys_for_all(st, chain.iter()).await;
    (chain, keys)
}
