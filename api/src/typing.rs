//! Typing notifications (spec: "Typing Notifications"). Ephemeral: kept in memory,
//! never journaled (BRIEF §3.1 allows this). A separate counter orders typing changes
//! for sync tokens.
//!
//! The counter is not stored, yet it must not go backwards across a restart: a client
//! holding a token from before would otherwise see no typing or presence until the
//! counter passed its old value again, and `next_batch` would decrease. It starts at the
//! wall clock in microseconds ([`counter_seed`]), which exceeds every value a previous
//! run handed out as long as that run averaged fewer than 1,000 changes per
//! millisecond and the clock did not step back by more than the run's lead.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Json,
    extract::{Path, State},
};
use serde_json::{Value, json};
use spindle_projections::change_index::ChangeIndex;
use tokio::sync::watch;

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester},
};

/// Longest typing timeout honoured, ms.
pub const MAX_TYPING_TIMEOUT_MS: u64 = 120_000;

/// Counter changes per millisecond of wall clock the seed leaves room for.
pub const COUNTER_CHANGES_PER_MS: u64 = 1_000;

/// The counter's start value: the wall clock in ms times [`COUNTER_CHANGES_PER_MS`], so
/// a restart starts above any value an earlier run reached (see the module docs).
/// Below 2^63 until the year 294,000.
pub fn counter_seed() -> u64 {
    crate::now_ms().saturating_mul(COUNTER_CHANGES_PER_MS)
}

#[derive(Default)]
struct RoomTyping {
    users: HashMap<String, Instant>,
}

/// The rooms with typing state, and each one's last change by counter value (a
/// [`ChangeIndex`]: `/sync` finds the rooms whose typing changed since its token
/// without asking each joined room).
#[derive(Default)]
struct TypingRooms {
    by_id: HashMap<String, RoomTyping>,
    changed: ChangeIndex,
}

/// An ephemeral change relayed to the other processes of a deployment on a shared
/// journal (SPEC §6 "Ephemeral data"): typing and presence live in each process's
/// memory, so each change made here is published and applied by the others.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Relayed {
    /// [`Typing::set`]: `user_id` typing (for `timeout_ms`) or not in `room_id`.
    Typing {
        /// The room.
        room_id: String,
        /// Who started or stopped typing.
        user_id: String,
        /// Typing now, or not any more.
        typing: bool,
        /// How long the typing lasts without a refresh, ms.
        timeout_ms: u64,
    },
    /// [`crate::presence::Presence::set`]; the receiver records it under the user's
    /// joined rooms as it knows them. `status_msg`: `None` keeps the previous one.
    Presence {
        /// Whose presence.
        user_id: String,
        /// `online`, `unavailable` or `offline`.
        presence: String,
        /// The status message: `None` (absent) keeps the previous one, `Some(None)`
        /// (`null`) clears it.
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            deserialize_with = "present"
        )]
        status_msg: Option<Option<String>>,
        /// When the user was last active, ms since the epoch; a receiver ignores a
        /// change older than what it has.
        active_ms: u64,
    },
}

/// A field that is present (even as `null`) is `Some`; an absent one is `None` through
/// `#[serde(default)]`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    <Option<String> as serde::Deserialize>::deserialize(d).map(Some)
}

/// In-memory typing state: at most `max_rooms` rooms (config `caches.typing_rooms`).
#[derive(Clone)]
pub struct Typing {
    rooms: Arc<parking_lot::Mutex<TypingRooms>>,
    counter: Arc<watch::Sender<u64>>,
    max_rooms: usize,
    /// Where changes made here go for the other processes (shared journal only).
    relay: Arc<std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<Relayed>>>,
}

impl Default for Typing {
    fn default() -> Self {
        Typing::with_limit(crate::CacheLimits::default().typing_rooms)
    }
}

impl Typing {
    /// No typing yet; typing state of at most `max_rooms` rooms (at least 1); the
    /// counter starts at [`counter_seed`].
    pub fn with_limit(max_rooms: usize) -> Typing {
        Typing {
            rooms: Arc::default(),
            counter: Arc::new(watch::channel(counter_seed()).0),
            max_rooms: max_rooms.max(1),
            relay: Arc::default(),
        }
    }

    /// From now on, typing and presence changes made through [`Typing::set`] and
    /// [`crate::presence::Presence::set`] are also sent to `tx` (the process's relay to
    /// the others). Once per process; later calls are ignored.
    pub fn relay_to(&self, tx: tokio::sync::mpsc::UnboundedSender<Relayed>) {
        let _ = self.relay.set(tx);
    }

    /// Sends a change to the relay, if there is one.
    pub(crate) fn relay(&self, change: Relayed) {
        if let Some(tx) = self.relay.get() {
            let _ = tx.send(change);
        }
    }

    /// Applies a change another process relayed (not relayed again).
    pub fn apply_relayed_typing(
        &self,
        room_id: &str,
        user_id: &str,
        typing: bool,
        timeout: Duration,
    ) {
        self.change(room_id, user_id, typing, timeout);
    }

    /// Rooms with typing state kept now.
    pub fn rooms_len(&self) -> usize {
        self.rooms.lock().by_id.len()
    }

    fn bump(&self, rooms: &mut TypingRooms, room_id: &str) {
        let mut next = 0;
        self.counter.send_modify(|c| {
            *c += 1;
            next = *c;
        });
        rooms.changed.bump(room_id, next);
    }

    /// Marks `user_id` typing (for `timeout`) or not typing in a room, and relays the
    /// change to the deployment's other processes (if any).
    pub fn set(&self, room_id: &str, user_id: &str, typing: bool, timeout: Duration) {
        self.change(room_id, user_id, typing, timeout);
        self.relay(Relayed::Typing {
            room_id: room_id.to_owned(),
            user_id: user_id.to_owned(),
            typing,
            timeout_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        });
    }

    fn change(&self, room_id: &str, user_id: &str, typing: bool, timeout: Duration) {
        let mut rooms = self.rooms.lock();
        if !rooms.by_id.contains_key(room_id) {
            if !typing {
                // Nothing to stop: no state to keep.
                return;
            }
            if rooms.by_id.len() >= self.max_rooms {
                // Rooms where nobody types any more go first (their last change was
                // "nobody": a sync that has not seen it yet shows a stale typist until
                // the client's own timeout).
                let now = Instant::now();
                let TypingRooms { by_id, changed } = &mut *rooms;
                by_id.retain(|id, r| {
                    let keep = r.users.values().any(|t| *t > now);
                    if !keep {
                        changed.remove(id);
                    }
                    keep
                });
                if rooms.by_id.len() >= self.max_rooms {
                    tracing::debug!(
                        room_id,
                        "typing: every kept room has a typist; notice dropped"
                    );
                    return;
                }
            }
        }
        let room = rooms.by_id.entry(room_id.to_owned()).or_default();
        let changed = if typing {
            room.users
                .insert(user_id.to_owned(), Instant::now() + timeout)
                .is_none()
        } else {
            room.users.remove(user_id).is_some()
        };
        if changed {
            self.bump(&mut rooms, room_id);
        }
        drop(rooms);
        if typing {
            let this = self.clone();
            let (room_id, user_id) = (room_id.to_owned(), user_id.to_owned());
            tokio::spawn(async move {
                tokio::time::sleep(timeout + Duration::from_millis(10)).await;
                let mut rooms = this.rooms.lock();
                if let Some(room) = rooms.by_id.get_mut(&room_id)
                    && room
                        .users
                        .get(&user_id)
                        .is_some_and(|t| *t <= Instant::now())
                {
                    room.users.remove(&user_id);
                    this.bump(&mut rooms, &room_id);
                }
            });
        }
    }

    /// Users typing in a room now, sorted.
    pub fn users(&self, room_id: &str) -> Vec<String> {
        let now = Instant::now();
        let rooms = self.rooms.lock();
        let mut users: Vec<String> = rooms
            .by_id
            .get(room_id)
            .map(|r| {
                r.users
                    .iter()
                    .filter(|(_, t)| **t > now)
                    .map(|(u, _)| u.clone())
                    .collect()
            })
            .unwrap_or_default();
        users.sort();
        users
    }

    /// Rooms whose typing state changed after counter value `after`, with the counter
    /// value of their last change, oldest first (the application-service pusher's
    /// feed; walks only the rooms that changed).
    pub fn rooms_changed_after(&self, after: u64) -> Vec<(String, u64)> {
        let rooms = self.rooms.lock();
        rooms
            .changed
            .changed_after(after, usize::MAX)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|id| Some((id.to_string(), rooms.changed.get(&id)?)))
            .collect()
    }

    /// Rooms whose typing state changed after counter value `after`, at most `limit`
    /// (`None`: more did; ask [`Typing::room_serial`] room by room).
    pub fn rooms_changed_within(&self, after: u64, limit: usize) -> Option<Vec<Arc<str>>> {
        self.rooms.lock().changed.changed_after(after, limit)
    }

    /// The counter value of the room's last typing change.
    pub fn room_serial(&self, room_id: &str) -> u64 {
        self.rooms.lock().changed.get(room_id).unwrap_or(0)
    }

    /// Takes the next counter value for another ephemeral change (presence shares the
    /// counter, so one sync token component orders both) and wakes waiting long-polls.
    pub fn next_serial(&self) -> u64 {
        let mut next = 0;
        self.counter.send_modify(|c| {
            *c += 1;
            next = *c;
        });
        next
    }

    /// The current counter.
    pub fn current(&self) -> u64 {
        *self.counter.borrow()
    }

    /// Watch on the counter (long-poll sync wakes on it).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.counter.subscribe()
    }
}

/// `PUT /rooms/{roomId}/typing/{userId}`.
pub(crate) async fn set_typing(
    State(s): State<AppState>,
    r: Requester,
    Path((room_id, user_id)): Path<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    if user_id != r.user_id {
        return Err(MatrixError::forbidden(
            "Cannot set another user's typing state",
        ));
    }
    let typing = body
        .get("typing")
        .and_then(|v| v.as_bool())
        .ok_or_else(|| MatrixError::bad_json("typing (boolean) is required"))?;
    if s.projections
        .membership
        .get(&room_id, &r.user_id)
        .map(|m| m.membership)
        != Some("join".into())
    {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    let timeout = match body.get("timeout") {
        None | Some(Value::Null) => 30_000,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| MatrixError::bad_json("timeout must be a non-negative integer (ms)"))?,
    }
    .min(MAX_TYPING_TIMEOUT_MS);
    s.typing
        .set(&room_id, &r.user_id, typing, Duration::from_millis(timeout));
    Ok(Json(json!({})))
}

pub(crate) fn routes() -> axum::Router<AppState> {
    axum::Router::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn typing_rooms_are_bounded_rooms_without_typists_dropped_first() {
        let t = Typing::with_limit(3);
        let long = Duration::from_secs(60);
        for r in ["!r0:x", "!r1:x", "!r2:x"] {
            t.set(r, "@u:x", true, long);
        }
        // Full, every room has a typist: the new room's notice is not kept.
        t.set("!r3:x", "@u:x", true, long);
        assert_eq!(t.rooms_len(), 3);
        assert!(t.users("!r3:x").is_empty());
        // Nobody types in r1 any more: it makes room for r3.
        t.set("!r1:x", "@u:x", false, long);
        t.set("!r3:x", "@u:x", true, long);
        assert_eq!(t.rooms_len(), 3);
        assert_eq!(t.users("!r3:x"), vec!["@u:x".to_owned()]);
        // r1 was dropped: no state, serial 0 (below any counter value).
        assert_eq!(t.room_serial("!r1:x"), 0);
        assert_eq!(t.users("!r0:x"), vec!["@u:x".to_owned()]);
        // Stopping in a room with no state keeps none.
        t.set("!r9:x", "@u:x", false, long);
        assert_eq!(t.rooms_len(), 3);
    }

    #[tokio::test]
    async fn a_new_counter_starts_above_every_value_an_earlier_one_handed_out() {
        let before = crate::now_ms() * COUNTER_CHANGES_PER_MS;
        let first = Typing::default();
        assert!(first.current() >= before, "seeded from the clock");
        // An earlier run that made fewer changes than 1,000 per ms of its life.
        for _ in 0..500 {
            first.next_serial();
        }
        let reached = first.current();
        std::thread::sleep(Duration::from_millis(2));
        let second = Typing::default();
        assert!(
            second.current() > reached,
            "restart counter {} must exceed {reached}",
            second.current()
        );
        assert_eq!(second.next_serial(), second.current());
    }
}
