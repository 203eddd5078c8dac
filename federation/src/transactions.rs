//! Inbound transactions (spec: server-server API, "Transactions",
//! `PUT /_matrix/federation/v1/send/{txnId}`).
//!
//! Each PDU becomes a [`CommandBody::RemotePdu`] command, in the order sent; the answer
//! has one entry per PDU (`{}` accepted, `{"error": ...}` refused). A PDU whose
//! `prev_events` are unknown here makes us ask the origin for the gap
//! (`/get_missing_events`, at most [`MISSING_EVENTS_LIMIT`] events), ingest what comes
//! back oldest first, and try once more. The EDUs are acted on after the PDUs
//! ([`crate::edus::ingest`]).
//!
//! Limits: at most 50 PDUs and 100 EDUs per transaction (400 `M_BAD_JSON` otherwise);
//! the same (origin, txn id) answers the remembered result without reprocessing
//! (bounded cache, [`TXN_CACHE_MAX`] entries).

use std::collections::{HashMap, VecDeque};

use axum::{
    Json,
    extract::{Path, State},
};
use spindle_journal::{CommandBody, JournalError, remote::VerifyKeys};

use crate::{FedState, auth::Signed, error::FedError, error::FedResult, server_of};

/// Most PDUs in one transaction (spec).
pub const MAX_PDUS: usize = 50;
/// Most EDUs in one transaction (spec).
pub const MAX_EDUS: usize = 100;
/// Most remembered transaction results.
pub const TXN_CACHE_MAX: usize = 10_000;
/// Most events asked for when filling a gap before a PDU.
pub const MISSING_EVENTS_LIMIT: usize = 20;
/// Most servers whose keys are fetched for one PDU.
pub(crate) const MAX_SIGNERS: usize = 5;

/// Remembered `/send` results by (origin, txn id), oldest evicted first.
#[derive(Default)]
pub struct TxnCache {
    map: HashMap<(String, String), serde_json::Value>,
    order: VecDeque<(String, String)>,
}

impl TxnCache {
    fn get(&self, k: &(String, String)) -> Option<serde_json::Value> {
        self.map.get(k).cloned()
    }
    fn put(&mut self, k: (String, String), v: serde_json::Value) {
        if self.map.insert(k.clone(), v).is_none() {
            self.order.push_back(k);
        }
        while self.order.len() > TXN_CACHE_MAX {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

/// The verify keys of every server that signed `pdu` (at most five), fetched through
/// the key cache. Servers whose keys cannot be had are left out: the journal then
/// refuses the PDU for the missing signature, with that reason.
pub async fn verify_keys_for(st: &FedState, pdu: &serde_json::Value) -> VerifyKeys {
    let mut out = VerifyKeys::new();
    let mut servers: Vec<String> = pdu
        .get("signatures")
        .and_then(|s| s.as_object())
        .map(|s| s.keys().cloned().collect())
        .unwrap_or_default();
    if let Some(s) = pdu
        .get("sender")
        .and_then(|v| v.as_str())
        .and_then(server_of)
        && !servers.iter().any(|x| x == s)
    {
        servers.insert(0, s.to_owned());
    }
    for server in servers.into_iter().take(MAX_SIGNERS) {
        match st.keys.keys_of(&server).await {
            Ok(k) => {
                out.insert(server, k);
            }
            Err(e) => tracing::info!(server, error = %e.error, "no keys for a PDU signer"),
        }
    }
    out
}

use spindle_core::pdu::event_id_of;

/// Ingests one PDU from `origin`; fills a gap of missing `prev_events` once.
pub async fn ingest(
    st: &FedState,
    origin: &str,
    pdu: &serde_json::Value,
) -> Result<String, String> {
    let room_id = pdu
        .get("room_id")
        .and_then(|v| v.as_str())
        .ok_or("the PDU has no room_id")?
        .to_owned();
    let Some(version) = st.journal.room_version(&room_id).await else {
        return Err(format!("{room_id} is not a room on this server"));
    };
    crate::acl::check_room(st, &room_id, origin).map_err(|e| e.error)?;
    let event_id =
        event_id_of(pdu, &version).ok_or("the PDU is not valid JSON for its room version")?;
    let submit = |p: serde_json::Value| {
        let room_id = room_id.clone();
        let version = version.clone();
        async move {
            let mut keys = verify_keys_for(st, &p).await;
            // A partial-state room lacks most members: fetch the auth events it needs.
            let id = event_id_of(&p, &version).unwrap_or_default();
            let (auth_events, more) =
                crate::partial::fetch_auth_events(st, origin, &room_id, &id, &p).await;
            for (server, k) in more {
                keys.entry(server).or_insert(k);
            }
            st.submit_journal(
                origin,
                CommandBody::RemotePdu {
                    room_id,
                    pdu: p,
                    keys,
                    event_id: None,
                    auth_events,
                },
            )
            .await
        }
    };
    match submit(pdu.clone()).await {
        Ok(_) => return Ok(event_id),
        Err(JournalError::MissingPrevEvents(_)) => {}
        Err(e) => return Err(FedError::from(e).error),
    }
    // Fill the gap from the origin, oldest first, then try again.
    let earliest: Vec<String> = st
        .projections
        .timeline
        .range_backward(&room_id, u64::MAX, 0, 1)
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    let body = serde_json::json!({
        "earliest_events": earliest,
        "latest_events": [event_id],
        "limit": MISSING_EVENTS_LIMIT,
        "min_depth": 0,
    });
    let path = format!(
        "/_matrix/federation/v1/get_missing_events/{}",
        urlencode(&room_id)
    );
    let missing = st
        .client
        .request(reqwest::Method::POST, origin, &path, Some(&body))
        .await
        .map_err(|e| format!("prev events are missing and fetching them failed: {e}"))?;
    let mut events: Vec<serde_json::Value> = missing
        .get("events")
        .and_then(|v| v.as_array())
        .cloned()
        .unwrap_or_default();
    events.sort_by_key(|e| e.get("depth").and_then(|d| d.as_u64()).unwrap_or(0));
    for ev in events.into_iter().take(MISSING_EVENTS_LIMIT) {
        if let Err(e) = submit(ev).await {
            tracing::info!(error = %e, "a missing event was refused");
        }
    }
    submit(pdu.clone())
        .await
        .map(|_| event_id)
        .map_err(|e| FedError::from(e).error)
}

/// Percent-encodes a path segment.
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// `PUT /_matrix/federation/v1/send/{txnId}`.
pub(crate) async fn send(
    State(st): State<FedState>,
    Path(txn_id): Path<String>,
    signed: Signed,
) -> FedResult<Json<serde_json::Value>> {
    let key = (signed.origin.clone(), txn_id);
    if let Some(done) = st.txns.lock().get(&key) {
        return Ok(Json(done));
    }
    let body = signed
        .body
        .as_ref()
        .ok_or_else(|| FedError::bad_json("a transaction needs a body"))?;
    let pdus = body
        .get("pdus")
        .and_then(|v| v.as_array())
        .ok_or_else(|| FedError::bad_json("pdus must be an array"))?;
    // `edus` is optional (absent or null: none), but when given it is an array.
    let edus = match body.get("edus") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(
            v.as_array()
                .ok_or_else(|| FedError::bad_json("edus must be an array"))?,
        ),
    };
    if pdus.len() > MAX_PDUS || edus.is_some_and(|e| e.len() > MAX_EDUS) {
        return Err(FedError::bad_json(format!(
            "a transaction carries at most {MAX_PDUS} PDUs and {MAX_EDUS} EDUs"
        )));
    }
    let mut results = serde_json::Map::new();
    for pdu in pdus {
        let sender_ok = pdu
            .get("sender")
            .and_then(|v| v.as_str())
            .and_then(server_of)
            == Some(signed.origin.as_str());
        let version = match pdu.get("room_id").and_then(|v| v.as_str()) {
            Some(r) => st.journal.room_version(r).await,
            None => None,
        };
        let id = version
            .as_deref()
            .and_then(|v| event_id_of(pdu, v))
            .unwrap_or_default();
        let result = if !sender_ok {
            Err(format!(
                "the sender of a PDU must be a user of the origin {}",
                signed.origin
            ))
        } else {
            ingest(&st, &signed.origin, pdu).await
        };
        if id.is_empty() {
            if let Err(e) = &result {
                tracing::info!(origin = %signed.origin, error = %e, "PDU refused before it had an id");
            }
            continue;
        }
        results.insert(
            id,
            match result {
                Ok(_) => serde_json::json!({}),
                Err(e) => serde_json::json!({ "error": e }),
            },
        );
    }
    if let Some(edus) = edus {
        crate::edus::ingest(&st, &signed.origin, edus).await;
    }
    let answer = serde_json::json!({ "pdus": results });
    st.txns.lock().put(key, answer.clone());
    Ok(Json(answer))
}
