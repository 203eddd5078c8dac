//! Delayed events (MSC4140, unstable prefix `org.matrix.msc4140`, served only when
//! `delayed_events.max_event_delay_duration_ms` > 0 and then advertised in
//! `/versions` `unstable_features`):
//!
//! - `PUT /rooms/{roomId}/send/{type}/{txnId}?org.matrix.msc4140.delay=MS` and `PUT
//!   /rooms/{roomId}/state/{type}/{stateKey}?org.matrix.msc4140.delay=MS` answer
//!   `{"delay_id"}` and send nothing yet ([`schedule`]);
//! - `GET /_matrix/client/unstable/org.matrix.msc4140/delayed_events`: the requester's
//!   scheduled delayed events, earliest deadline first;
//! - `GET .../delayed_events/{delay_id}`: one of them (scheduled or finalised);
//! - `POST .../delayed_events/{delay_id}` with `{"action": "restart"|"cancel"|"send"}`
//!   (authenticated: the owner only), and `POST .../delayed_events/{delay_id}/{action}`
//!   (the MSC's current per-action paths, unauthenticated: the unguessable `delay_id`
//!   is the capability, so a call's SFU can hold it).
//!
//! Scheduling, restarting, cancelling and sending are journal facts; the
//! `delayed_events` projection is the heap. [`run_worker`] fires what is due: it sleeps
//! until the earliest deadline (kept in memory by the projection, so an idle tick reads
//! nothing), then fires everything due (at most [`FIRE_BATCH`]) as two journal runs
//! ([`spindle_journal::Journal::submit_batch`], one fsync each): the events, each as
//! its owner with transaction id `delay/{delay_id}` (a retry after a crash between the
//! event and its `DelayedEventSent` fact returns the same event instead of sending
//! twice), then their outcomes. An error at the deadline finalises the delay with that
//! error (the MSC: not retried); an error on `send` answers the client and keeps the
//! delay scheduled.
//!
//! A delayed state event is cancelled when someone else sets the same (type, state key)
//! in the room before it fires (Synapse's rule, and the MSC's "delayed state events are
//! cancelled by a more recent state event"; the current MSC text moved it to the
//! alternatives, Synapse keeps it): the projection does it when it applies that event.
//! Firing a tick's due events as one run must not fire one that an earlier event of
//! the same run would have cancelled, so a run holds at most one delayed state event
//! per (room, type, state key): the earliest due (deadline, then delay id). The others
//! stay scheduled for the next tick, which runs as soon as this one's outcomes are
//! applied: by then the projection has cancelled those from another user, and those
//! from the same user fire in deadline order (the later deadline's content ends as the
//! current state), exactly as firing one at a time would.

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::{get, post},
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, EventSpec, Fact, Outcome};
use spindle_projections::delayed::{DelayStatus, DelayedEvent};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester},
};

/// Query parameter that turns a send into a delayed one.
pub const DELAY_PARAM: &str = "org.matrix.msc4140.delay";

/// Prefix of the transaction id a fired delayed event is sent with (`delay/{delay_id}`):
/// the retry after a crash finds the same event, and rendering reads the delay id back
/// from it for `unsigned.org.matrix.msc4140.delay_id` ([`crate::read::render`]).
pub const DELAY_TXN_PREFIX: &str = "delay/";

/// Due delayed events fired per tick at most (one journal run of events, one of their
/// outcomes).
pub const FIRE_BATCH: usize = 100;

const PREFIX: &str = "/_matrix/client/unstable/org.matrix.msc4140";

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(&format!("{PREFIX}/delayed_events"), get(list))
        .route(
            &format!("{PREFIX}/delayed_events/{{delay_id}}"),
            get(get_one).post(update),
        )
        .route(
            &format!("{PREFIX}/delayed_events/{{delay_id}}/{{action}}"),
            post(update_action),
        )
}

/// Whether delayed events are on.
pub fn enabled(s: &AppState) -> bool {
    s.config.max_event_delay_duration_ms > 0
}

/// Parses `org.matrix.msc4140.delay` (`None`: not a delayed send, or the feature is
/// off, in which case the parameter is ignored as Synapse does). Errors: not a
/// positive integer (400 `M_INVALID_PARAM`), above the maximum (400
/// `M_MAX_DELAY_EXCEEDED` with `max_delay`).
pub(crate) fn delay_of(s: &AppState, query: &crate::extract::Query) -> ApiResult<Option<u64>> {
    let Some(raw) = query.get(DELAY_PARAM) else {
        return Ok(None);
    };
    if !enabled(s) {
        return Ok(None);
    }
    let delay: u64 = raw.parse().ok().filter(|d| *d > 0).ok_or_else(|| {
        MatrixError::invalid_param(format!("{DELAY_PARAM} must be a positive integer (ms)"))
    })?;
    let max = s.config.max_event_delay_duration_ms;
    if delay > max {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_MAX_DELAY_EXCEEDED",
            "The requested delay exceeds the allowed maximum.",
        )
        .with_extra(json!({ "max_delay": max })));
    }
    Ok(Some(delay))
}

/// Schedules a delayed event (a `DelayedEventScheduled` fact) and answers its
/// `delay_id`. The room must exist and the requester be joined to it now; power levels
/// are checked when it is sent (MSC4140). 429 `M_LIMIT_EXCEEDED` past
/// `max_scheduled_delays_per_user`.
pub(crate) async fn schedule(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    event_type: String,
    state_key: Option<String>,
    content: Value,
    delay_ms: u64,
) -> ApiResult<Json<Value>> {
    crate::rooms::valid_room_id(room_id)?;
    // `PUT /send/...?delay=` skips the request's wait for the projections (a message
    // send reads none); scheduling reads two (memberships, the user's scheduled count).
    s.wait_for_acknowledged().await?;
    let joined = s
        .projections
        .membership
        .get(room_id, &r.user_id)
        .is_some_and(|m| m.membership == "join");
    if !joined {
        return Err(MatrixError::forbidden("Unknown room or not a member of it"));
    }
    let max = s.config.max_scheduled_delays_per_user;
    if s.projections.delayed.scheduled_count(&r.user_id, max) >= max {
        let next = s
            .projections
            .delayed
            .scheduled_of(&r.user_id, 1)
            .first()
            .map(|d| d.deadline().saturating_sub(crate::now_ms()))
            .unwrap_or(1_000);
        return Err(MatrixError::limit_exceeded(
            "The maximum number of delayed events has been reached.",
            next,
        ));
    }
    let delay_id = format!("syd_{}", crate::account::random_string(24));
    let fact = Fact::DelayedEventScheduled {
        delay_id: delay_id.clone(),
        user_id: r.user_id.clone(),
        device_id: Some(r.device_id.clone()),
        room_id: room_id.to_owned(),
        event_type,
        state_key,
        content,
        delay_ms,
        running_since: crate::now_ms(),
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({ "delay_id": delay_id })))
}

/// `GET .../delayed_events`: the requester's scheduled delayed events (at most
/// [`spindle_projections::delayed::LIST_MAX`]), earliest deadline first.
async fn list(State(s): State<AppState>, r: Requester) -> Json<Value> {
    let events: Vec<Value> = s
        .projections
        .delayed
        .scheduled_of(&r.user_id, spindle_projections::delayed::LIST_MAX)
        .iter()
        .map(DelayedEvent::to_json)
        .collect();
    Json(json!({ "delayed_events": events }))
}

/// `GET .../delayed_events/{delay_id}`: one of the requester's delayed events.
async fn get_one(
    State(s): State<AppState>,
    r: Requester,
    Path(delay_id): Path<String>,
) -> ApiResult<Json<Value>> {
    match s.projections.delayed.get(&delay_id) {
        Some(d) if d.user_id == r.user_id => Ok(Json(d.to_json())),
        _ => Err(MatrixError::not_found("No such delayed event")),
    }
}

/// `POST .../delayed_events/{delay_id}` with `{"action": ...}` (the owner only).
async fn update(
    State(s): State<AppState>,
    r: Requester,
    Path(delay_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let action = match body.get("action") {
        Some(Value::String(a)) => a.clone(),
        None | Some(Value::Null) => return Err(MatrixError::missing_param("action is required")),
        Some(_) => return Err(MatrixError::bad_json("action must be a string")),
    };
    match s.projections.delayed.get(&delay_id) {
        Some(d) if d.user_id == r.user_id => act(&s, d, &action).await,
        _ => Err(MatrixError::not_found("No such delayed event")),
    }
}

/// `POST .../delayed_events/{delay_id}/{action}` (unauthenticated: the id is the key).
async fn update_action(
    State(s): State<AppState>,
    Path((delay_id, action)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    s.wait_for_acknowledged().await?;
    match s.projections.delayed.get(&delay_id) {
        Some(d) => act(&s, d, &action).await,
        None => Err(MatrixError::not_found("No such delayed event")),
    }
}

async fn act(s: &AppState, d: DelayedEvent, action: &str) -> ApiResult<Json<Value>> {
    if !matches!(action, "restart" | "cancel" | "send") {
        return Err(MatrixError::invalid_param(
            "action must be restart, cancel or send",
        ));
    }
    let conflict = || {
        MatrixError::new(
            StatusCode::CONFLICT,
            "M_UNKNOWN",
            "The delayed event is already finalised",
        )
    };
    match (d.status, action) {
        (DelayStatus::Scheduled, _) => {}
        // A retry of what already happened succeeds (MSC4140).
        (DelayStatus::Sent, "send") | (DelayStatus::Cancelled | DelayStatus::Error, "cancel") => {
            return Ok(Json(json!({})));
        }
        _ => return Err(conflict()),
    }
    let fact = match action {
        "restart" => Fact::DelayedEventRestarted {
            delay_id: d.delay_id.clone(),
            running_since: crate::now_ms(),
        },
        "cancel" => Fact::DelayedEventCancelled {
            delay_id: d.delay_id.clone(),
            ts: crate::now_ms(),
        },
        _ => {
            fire(s, &d).await?;
            return Ok(Json(json!({})));
        }
    };
    let o = s
        .submit(
            &d.user_id,
            d.device_id.as_deref(),
            CommandBody::Fact { fact },
        )
        .await?;
    s.wait_for(o.position).await?;
    Ok(Json(json!({})))
}

/// The event a delayed event sends.
fn event_spec(d: &DelayedEvent) -> EventSpec {
    let redacts = (d.event_type == "m.room.redaction")
        .then(|| d.content["redacts"].as_str().map(str::to_owned))
        .flatten();
    EventSpec {
        kind: d.event_type.clone(),
        state_key: d.state_key.clone(),
        content: d.content.clone(),
        redacts,
    }
}

/// The `DelayedEventSent` fact recording how sending `d` went.
fn outcome_fact(d: &DelayedEvent, sent: ApiResult<Outcome>) -> Fact {
    let (event_id, error) = match sent {
        Ok(o) => (o.event_ids.first().map(|e| e.to_string()), None),
        Err(e) => {
            tracing::info!(delay_id = %d.delay_id, errcode = e.errcode, error = %e.error, "delayed event could not be sent");
            (
                None,
                Some(json!({ "errcode": e.errcode, "error": e.error })),
            )
        }
    };
    Fact::DelayedEventSent {
        delay_id: d.delay_id.clone(),
        event_id,
        error,
        ts: crate::now_ms(),
    }
}

/// The `send` action: sends a delayed event as its owner now and journals the
/// outcome. An error is answered and the delay stays scheduled.
async fn fire(s: &AppState, d: &DelayedEvent) -> ApiResult<()> {
    let r = Requester {
        user_id: d.user_id.clone(),
        device_id: d.device_id.clone().unwrap_or_default(),
        token_hash: String::new(),
        appservice: None,
        is_guest: s
            .projections
            .accounts
            .user(&d.user_id)
            .is_some_and(|a| a.guest),
    };
    let txn = format!("{DELAY_TXN_PREFIX}{}", d.delay_id);
    let o = crate::rooms::send_spec(s, &r, &d.room_id, event_spec(d), Some(txn)).await?;
    let fact = outcome_fact(d, Ok(o));
    let o = s
        .submit(
            &d.user_id,
            d.device_id.as_deref(),
            CommandBody::Fact { fact },
        )
        .await?;
    s.wait_for(o.position).await?;
    Ok(())
}

/// Which of a tick's due delays (earliest first) go into this tick's run: all but a
/// delayed state event whose (room, type, state key) an earlier one of the run already
/// sets (see the module docs: it waits for the next tick).
fn one_per_state_slot(due: Vec<DelayedEvent>) -> Vec<DelayedEvent> {
    let mut slots = std::collections::HashSet::new();
    due.into_iter()
        .filter(|d| match &d.state_key {
            Some(k) => slots.insert((d.room_id.clone(), d.event_type.clone(), k.clone())),
            None => true,
        })
        .collect()
}

/// Fires due delays as one run of events and one run of their outcomes (one fsync
/// each), then waits once for the projections to apply the outcomes. Returns how many
/// were finalised (sent, or failed and finalised with the error).
async fn fire_due(s: &AppState, due: Vec<DelayedEvent>) -> usize {
    let mut sent: Vec<Option<ApiResult<Outcome>>> = Vec::with_capacity(due.len());
    let mut commands = Vec::with_capacity(due.len());
    for d in &due {
        let txn = format!("{DELAY_TXN_PREFIX}{}", d.delay_id);
        match crate::rooms::send_command(&d.room_id, event_spec(d), Some(txn), None) {
            Ok(body) => {
                commands.push((
                    d.user_id.clone(),
                    Some(d.device_id.clone().unwrap_or_default()),
                    body,
                ));
                sent.push(None);
            }
            Err(e) => sent.push(Some(Err(e))),
        }
    }
    let mut appended = s.submit_batch(commands).await.into_iter();
    let facts = due
        .iter()
        .zip(sent)
        .map(|(d, sent)| {
            let sent = sent.unwrap_or_else(|| {
                appended
                    .next()
                    .expect("one result per command")
                    .map_err(crate::rooms::unknown_room_as_forbidden)
            });
            (
                d.user_id.clone(),
                d.device_id.clone(),
                CommandBody::Fact {
                    fact: outcome_fact(d, sent),
                },
            )
        })
        .collect();
    let mut fired = 0;
    let mut last = 0;
    for (d, journaled) in due.iter().zip(s.submit_batch(facts).await) {
        match journaled {
            Ok(o) => {
                fired += 1;
                last = last.max(o.position);
            }
            Err(e) => {
                tracing::warn!(delay_id = %d.delay_id, error = %e.error, "delayed event outcome not journaled; retrying")
            }
        }
    }
    if fired > 0
        && let Err(e) = s.wait_for(last).await
    {
        tracing::warn!(error = %e.error, "delayed events: projections behind after firing");
    }
    fired
}

/// One tick: fires the delayed events due at `now_ms` (at most [`FIRE_BATCH`], and at
/// most one delayed state event per (room, type, state key): see the module docs) as
/// one journal run of events and one of their outcomes, then refreshes the earliest
/// deadline (also when nothing turned out to be due: the earliest one was cancelled or
/// restarted). Returns how many were finalised. Reads no store row before the
/// earliest deadline.
pub async fn tick(s: &AppState, now_ms: u64) -> usize {
    let heap = &s.projections.delayed;
    if now_ms < heap.next_due() {
        return 0;
    }
    let due = one_per_state_slot(heap.due(now_ms, FIRE_BATCH));
    let fired = if due.is_empty() {
        0
    } else {
        fire_due(s, due).await
    };
    heap.refresh_next_due();
    fired
}

/// Fires delayed events at their deadlines until `shutdown` turns true: sleeps until
/// the earliest deadline (at most a second, or until a commit makes it earlier; 100
/// ms when a due one could not be finalised).
pub async fn run_worker(s: AppState, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let changed = s.projections.delayed.changed();
    loop {
        if *shutdown.borrow() {
            return;
        }
        // Registered before the tick reads the deadline, so a commit lowering it
        // meanwhile is not missed.
        let notified = changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = crate::now_ms();
        if tick(&s, now).await > 0 {
            continue;
        }
        let next = s.projections.delayed.next_due();
        let wait_ms = if next <= now {
            100
        } else {
            (next - now).min(1_000)
        };
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(wait_ms)) => {}
            _ = notified => {}
            _ = shutdown.wait_for(|v| *v) => return,
        }
    }
}
