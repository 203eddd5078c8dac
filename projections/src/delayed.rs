//! The delayed-event heap (MSC4140): every delayed event scheduled, restarted,
//! cancelled or sent is a journal fact; this projection keeps them, with the scheduled
//! ones indexed by deadline so that finding what is due reads only what is due.
//!
//! Tables:
//! - `delays`: delay id -> [`DelayedEvent`] (scheduled and finalised; finalised rows
//!   stay so a repeated `send`/`cancel` answers as the MSC asks)
//! - `by_deadline`: deadline (ms, BE), delay id -> empty (scheduled only: the heap)
//! - `by_user`: user, 0x00, delay id -> empty (scheduled only)
//! - `by_state`: room, 0x00, type, 0x00, state key, 0x00, delay id -> empty (scheduled
//!   delayed *state* events: a state event from someone else at the same (type, state
//!   key) cancels them, as Synapse does)
//!
//! The earliest deadline is also kept in memory ([`DelayedEvents::next_due`], refreshed
//! after each commit), so an idle tick reads no row at all; a due tick scans
//! `by_deadline` from the start up to now (the rows it returns are exactly the due
//! ones) plus one row to learn the next deadline. A restart deletes one heap row and
//! writes one: unrelated rows are never rewritten.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// Status of a delayed event.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DelayStatus {
    /// Waiting for its deadline.
    Scheduled,
    /// Sent (at its deadline or by `send`).
    Sent,
    /// Cancelled by `cancel`, or because someone else set the same state first.
    Cancelled,
    /// Sending at its deadline failed.
    Error,
}

/// One delayed event (MSC4140's delayed-event object plus what sending needs).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DelayedEvent {
    /// The opaque id handed to the client.
    pub delay_id: String,
    /// Who scheduled it (the event's sender).
    pub user_id: String,
    /// The device that scheduled it.
    pub device_id: Option<String>,
    /// Room to send into.
    pub room_id: String,
    /// Event type.
    pub event_type: String,
    /// State key for a state event.
    pub state_key: Option<String>,
    /// Event content as the client gave it.
    pub content: serde_json::Value,
    /// The delay, ms.
    pub delay_ms: u64,
    /// When it was scheduled or last restarted (ms since the epoch).
    pub running_since: u64,
    /// Where it stands.
    pub status: DelayStatus,
    /// The sent event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The error that stopped it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<serde_json::Value>,
    /// When it was finalised (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalised_at: Option<u64>,
}

impl DelayedEvent {
    /// `running_since + delay_ms`.
    pub fn deadline(&self) -> u64 {
        self.running_since.saturating_add(self.delay_ms)
    }

    /// MSC4140's JSON for `GET .../delayed_events`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "delay_id": self.delay_id,
            "room_id": self.room_id,
            "type": self.event_type,
            "delay": self.delay_ms,
            "running_since": self.running_since,
            "content": self.content,
        });
        if let Some(k) = &self.state_key {
            v["state_key"] = k.clone().into();
        }
        if let Some(e) = &self.event_id {
            v["event_id"] = e.clone().into();
        }
        if let Some(e) = &self.error {
            v["error"] = e.clone();
        }
        if let Some(t) = self.finalised_at {
            v["origin_server_ts"] = t.into();
        }
        v
    }
}

/// Scheduled delayed events listed per user at most.
pub const LIST_MAX: usize = 1000;

/// The delayed-event heap.
pub struct DelayedEvents {
    delays: Table,
    by_deadline: Table,
    by_user: Table,
    by_state: Table,
    /// Earliest scheduled deadline known (`u64::MAX`: none). Never later than the true
    /// earliest: commits lower it, only [`DelayedEvents::refresh_next_due`] raises it.
    next_due: Arc<AtomicU64>,
    /// Orders a refresh (read, then store) against commits lowering the value.
    next_lock: Arc<parking_lot::Mutex<()>>,
    /// Woken when `next_due` is lowered.
    changed: Arc<tokio::sync::Notify>,
}

fn heap_key(deadline: u64, delay_id: &str) -> Vec<u8> {
    let mut k = deadline.to_be_bytes().to_vec();
    k.extend_from_slice(delay_id.as_bytes());
    k
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("rows serialize")
}

impl DelayedEvents {
    /// Opens the tables and reads the earliest deadline (one row).
    pub fn open(db: &ProjectionDb) -> Result<DelayedEvents, String> {
        let t = |name: &str| db.table("delayed_events", name);
        let d = DelayedEvents {
            delays: t("delays")?,
            by_deadline: t("by_deadline")?,
            by_user: t("by_user")?,
            by_state: t("by_state")?,
            next_due: Arc::new(AtomicU64::new(u64::MAX)),
            next_lock: Arc::default(),
            changed: Arc::default(),
        };
        d.refresh_next_due();
        Ok(d)
    }

    /// One delayed event by id.
    pub fn get(&self, delay_id: &str) -> Option<DelayedEvent> {
        self.delays
            .get(delay_id.as_bytes())
            .and_then(|v| serde_json::from_slice(&v).ok())
    }

    /// A user's scheduled delayed events, earliest deadline first, at most `limit`.
    pub fn scheduled_of(&self, user_id: &str, limit: usize) -> Vec<DelayedEvent> {
        let prefix = key::prefix(&[user_id]);
        let mut out: Vec<DelayedEvent> = self
            .by_user
            .scan_prefix(&prefix, limit)
            .into_iter()
            .filter_map(|(k, _)| self.get(std::str::from_utf8(&k[prefix.len()..]).ok()?))
            .collect();
        out.sort_by(|a, b| (a.deadline(), &a.delay_id).cmp(&(b.deadline(), &b.delay_id)));
        out
    }

    /// How many delayed events the user has scheduled, counting at most `limit + 1`.
    pub fn scheduled_count(&self, user_id: &str, limit: usize) -> usize {
        self.by_user
            .scan_prefix(&key::prefix(&[user_id]), limit.saturating_add(1))
            .len()
    }

    /// The earliest scheduled deadline (ms), `u64::MAX` for none; from memory.
    pub fn next_due(&self) -> u64 {
        self.next_due.load(Ordering::Acquire)
    }

    /// Resolves when the earliest deadline may have moved earlier.
    pub fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.changed.clone()
    }

    /// The delayed events due at `now_ms` (deadline ≤ now), earliest first, at most
    /// `limit`. Reads nothing when nothing is due (the earliest deadline is in memory);
    /// otherwise the rows returned plus their `delays` rows.
    pub fn due(&self, now_ms: u64, limit: usize) -> Vec<DelayedEvent> {
        if now_ms < self.next_due() {
            return Vec::new();
        }
        self.by_deadline
            .scan_range(&[], &heap_key(now_ms.saturating_add(1), ""), false, limit)
            .into_iter()
            .filter_map(|(k, _)| self.get(std::str::from_utf8(&k[8..]).ok()?))
            .collect()
    }

    /// Re-reads the earliest deadline (one row). Called once the delays a tick
    /// finalised are applied.
    pub fn refresh_next_due(&self) {
        let _g = self.next_lock.lock();
        let first = self
            .by_deadline
            .scan_prefix(&[], 1)
            .first()
            .map(|(k, _)| u64::from_be_bytes(k[..8].try_into().expect("8 bytes")))
            .unwrap_or(u64::MAX);
        self.next_due.store(first, Ordering::Release);
    }

    fn lower_after_commit(&self, ctx: &mut ApplyCtx, deadline: u64) {
        let (next, lock, changed) = (
            self.next_due.clone(),
            self.next_lock.clone(),
            self.changed.clone(),
        );
        ctx.after_commit(move || {
            let _g = lock.lock();
            if next.fetch_min(deadline, Ordering::AcqRel) > deadline {
                changed.notify_waiters();
            }
        });
    }

    fn load(&self, ctx: &ApplyCtx, delay_id: &str) -> Option<DelayedEvent> {
        ctx.get(&self.delays, delay_id.as_bytes())
            .and_then(|v| serde_json::from_slice(&v).ok())
    }

    /// Takes a scheduled delay off the indexes and stores its final row.
    fn finalise(&self, ctx: &ApplyCtx, mut d: DelayedEvent) {
        ctx.delete(&self.by_deadline, heap_key(d.deadline(), &d.delay_id));
        ctx.delete(&self.by_user, key::join(&[&d.user_id, &d.delay_id]));
        if let Some(k) = &d.state_key {
            ctx.delete(
                &self.by_state,
                key::join(&[&d.room_id, &d.event_type, k, &d.delay_id]),
            );
        }
        let id = d.delay_id.clone();
        d.content = if d.status == DelayStatus::Sent {
            // The event itself holds the content now.
            serde_json::Value::Object(Default::default())
        } else {
            d.content
        };
        ctx.put(&self.delays, id.into_bytes(), json(&d));
    }
}

impl Projection for DelayedEvents {
    fn name(&self) -> &'static str {
        "delayed_events"
    }

    /// Facts and state events (which cancel delayed state): a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS.and(Interest::STATE_EVENTS)
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.delays.clone(),
            self.by_deadline.clone(),
            self.by_user.clone(),
            self.by_state.clone(),
        ]
    }

    fn reload(&self) {
        self.refresh_next_due();
        self.changed.notify_waiters();
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if record.is_event() {
            // Someone else setting the same state cancels a delayed state event.
            let Some(pdu) = record.pdu() else {
                return Ok(());
            };
            let Some(state_key) = pdu.state_key.as_deref() else {
                return Ok(());
            };
            let kind = pdu.kind.to_string();
            let prefix = key::prefix(&[pdu.room_id.as_str(), &kind, state_key]);
            for (k, _) in ctx.scan_prefix(&self.by_state, &prefix) {
                let id = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                if let Some(mut d) = self.load(ctx, &id)
                    && d.user_id != pdu.sender.as_str()
                    && d.status == DelayStatus::Scheduled
                {
                    d.status = DelayStatus::Cancelled;
                    d.finalised_at = Some(u64::from(pdu.origin_server_ts.0));
                    self.finalise(ctx, d);
                }
            }
            return Ok(());
        }
        match record.fact() {
            Some(Fact::DelayedEventScheduled {
                delay_id,
                user_id,
                device_id,
                room_id,
                event_type,
                state_key,
                content,
                delay_ms,
                running_since,
            }) => {
                if ctx.get(&self.delays, delay_id.as_bytes()).is_some() {
                    return Ok(()); // ids are unique; a repeat changes nothing
                }
                let d = DelayedEvent {
                    delay_id,
                    user_id,
                    device_id,
                    room_id,
                    event_type,
                    state_key,
                    content,
                    delay_ms,
                    running_since,
                    status: DelayStatus::Scheduled,
                    event_id: None,
                    error: None,
                    finalised_at: None,
                };
                ctx.put(
                    &self.by_deadline,
                    heap_key(d.deadline(), &d.delay_id),
                    Vec::new(),
                );
                ctx.put(
                    &self.by_user,
                    key::join(&[&d.user_id, &d.delay_id]),
                    Vec::new(),
                );
                if let Some(k) = &d.state_key {
                    ctx.put(
                        &self.by_state,
                        key::join(&[&d.room_id, &d.event_type, k, &d.delay_id]),
                        Vec::new(),
                    );
                }
                self.lower_after_commit(ctx, d.deadline());
                ctx.put(&self.delays, d.delay_id.clone().into_bytes(), json(&d));
            }
            Some(Fact::DelayedEventRestarted {
                delay_id,
                running_since,
            }) => {
                if let Some(mut d) = self.load(ctx, &delay_id)
                    && d.status == DelayStatus::Scheduled
                {
                    ctx.delete(&self.by_deadline, heap_key(d.deadline(), &delay_id));
                    d.running_since = running_since;
                    ctx.put(
                        &self.by_deadline,
                        heap_key(d.deadline(), &delay_id),
                        Vec::new(),
                    );
                    self.lower_after_commit(ctx, d.deadline());
                    ctx.put(&self.delays, delay_id.into_bytes(), json(&d));
                }
            }
            Some(Fact::DelayedEventCancelled { delay_id, ts }) => {
                if let Some(mut d) = self.load(ctx, &delay_id)
                    && d.status == DelayStatus::Scheduled
                {
                    d.status = DelayStatus::Cancelled;
                    d.finalised_at = Some(ts);
                    self.finalise(ctx, d);
                }
            }
            Some(Fact::DelayedEventSent {
                delay_id,
                event_id,
                error,
                ts,
            }) => {
                if let Some(mut d) = self.load(ctx, &delay_id)
                    && d.status == DelayStatus::Scheduled
                {
                    d.status = if event_id.is_some() {
                        DelayStatus::Sent
                    } else {
                        DelayStatus::Error
                    };
                    d.event_id = event_id;
                    d.error = error;
                    d.finalised_at = Some(ts);
                    self.finalise(ctx, d);
                }
            }
            _ => {}
        }
        Ok(())
    }
}
