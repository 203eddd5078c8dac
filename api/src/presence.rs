//! Presence (spec: client-server API "Presence"): `PUT/GET /presence/{userId}/status`
//! and the `presence` section of `/sync`.
//!
//! Presence is **ephemeral**, like typing: kept in memory, never journaled (decision
//! and reasons in SPEC.md §4). Every change takes a value from the same counter as
//! typing (the second half of a sync token), so a sync token orders both and a
//! waiting long-poll wakes on either.
//!
//! Cost: a change is recorded under each room the user is joined to (the writer pays
//! for its own rooms); `/sync` asks each of the requester's joined rooms "any change
//! since counter N?" in memory and reads only the users who did change, one
//! membership point read each (so a user who left the room is not shown). Users who
//! newly share a room with the requester (it joined their room, or they joined its)
//! come from the device-list join log, which `device_lists` reads anyway; only a room
//! the requester just joined has its members walked. Nothing else walks a room's
//! members or other users' rooms.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
};

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};
use spindle_projections::change_index::{ChangeIndex, SortedKeys, changed_or_all};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester, opt_str},
};

/// A user counts as `currently_active` this long after their last action, ms.
pub const CURRENTLY_ACTIVE_MS: u64 = 5 * 60_000;

/// How far `last_active` must move on before an unchanged presence is relayed to the
/// deployment's other processes again, ms (shared journal only).
pub const RELAY_REFRESH_MS: u64 = 60_000;

/// Longest `status_msg` accepted, bytes (the cap inbound federation applies too).
pub use spindle_federation::edus::MAX_STATUS_MSG_BYTES;

#[derive(Debug, Clone)]
struct UserPresence {
    presence: String,
    status_msg: Option<String>,
    last_active_ms: u64,
    /// How many joined rooms the latest change was recorded under: a sync that sees
    /// another count records the user again (they joined or left a room since).
    rooms_recorded: usize,
    /// `last_active_ms` as last relayed to the deployment's other processes.
    relayed_ms: u64,
}

#[derive(Default)]
struct RoomPresence {
    /// Users of the room with a presence, and the counter value of their latest change.
    users: BTreeMap<String, u64>,
}

#[derive(Default)]
struct Inner {
    users: HashMap<String, UserPresence>,
    rooms: HashMap<String, RoomPresence>,
    /// Each room's latest presence change by counter value: `/sync` walks the rooms
    /// that changed since its token, not every joined room.
    changed: ChangeIndex,
}

/// In-memory presence state: at most `max_users` users (config
/// `caches.presence_users`).
#[derive(Clone)]
pub struct Presence {
    inner: Arc<parking_lot::Mutex<Inner>>,
    max_users: usize,
}

impl Default for Presence {
    fn default() -> Self {
        Presence::with_limit(crate::CacheLimits::default().presence_users)
    }
}

impl Presence {
    /// No presence yet; at most `max_users` users (at least 10).
    pub fn with_limit(max_users: usize) -> Presence {
        Presence {
            inner: Arc::default(),
            max_users: max_users.max(10),
        }
    }

    /// Users with a presence kept now.
    pub fn len(&self) -> usize {
        self.inner.lock().users.len()
    }

    /// Whether no user has a presence.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the tenth least recently active users and their room entries: one pass
    /// over the users and the rooms per tenth of the bound, so a new user costs O(1)
    /// amortized.
    fn evict(inner: &mut Inner, max: usize) {
        let mut by_age: Vec<(u64, String)> = inner
            .users
            .iter()
            .map(|(u, p)| (p.last_active_ms, u.clone()))
            .collect();
        by_age.sort();
        let gone: HashSet<String> = by_age
            .into_iter()
            .take((max / 10).max(1))
            .map(|(_, u)| u)
            .collect();
        inner.users.retain(|u, _| !gone.contains(u));
        let Inner { rooms, changed, .. } = inner;
        rooms.retain(|id, r| {
            r.users.retain(|u, _| !gone.contains(u));
            if r.users.is_empty() {
                changed.remove(id);
            }
            !r.users.is_empty()
        });
    }

    /// Sets a user's presence (and optionally status message) at `now`. When the
    /// visible state changes, the change takes a counter value from `typing` and is
    /// recorded under each of `joined_rooms`; a repeat of the same state only
    /// refreshes `last_active`.
    ///
    /// The change goes to the deployment's other processes through `typing`'s relay
    /// (shared journal only) when the visible state changed or `last_active` moved on by
    /// [`RELAY_REFRESH_MS`] since the last relayed value.
    pub fn set(
        &self,
        typing: &crate::typing::Typing,
        user_id: &str,
        presence: &str,
        status_msg: Option<Option<String>>,
        joined_rooms: &[String],
        now: u64,
    ) {
        let relay = self.change(
            typing,
            user_id,
            presence,
            status_msg.clone(),
            joined_rooms,
            now,
            false,
        );
        if relay {
            typing.relay(crate::typing::Relayed::Presence {
                user_id: user_id.to_owned(),
                presence: presence.to_owned(),
                status_msg,
                active_ms: now,
            });
        }
    }

    /// Applies a change another process relayed (see [`Presence::set`]; not relayed
    /// again). A change older than the user's presence here (`now` before its
    /// `last_active`: the two crossed in flight) is ignored, so every process ends on
    /// the latest.
    pub fn apply_relayed(
        &self,
        typing: &crate::typing::Typing,
        user_id: &str,
        presence: &str,
        status_msg: Option<Option<String>>,
        joined_rooms: &[String],
        now: u64,
    ) {
        self.change(
            typing,
            user_id,
            presence,
            status_msg,
            joined_rooms,
            now,
            true,
        );
    }

    /// [`Presence::set`] without the relay; whether to relay it. `relayed`: from another
    /// process (ignored when older than what is kept).
    #[allow(clippy::too_many_arguments)]
    fn change(
        &self,
        typing: &crate::typing::Typing,
        user_id: &str,
        presence: &str,
        status_msg: Option<Option<String>>,
        joined_rooms: &[String],
        now: u64,
        relayed: bool,
    ) -> bool {
        let mut inner = self.inner.lock();
        let prev = inner.users.get(user_id).cloned();
        if relayed && prev.as_ref().is_some_and(|p| p.last_active_ms > now) {
            return false;
        }
        if prev.is_none() && inner.users.len() >= self.max_users {
            Self::evict(&mut inner, self.max_users);
        }
        let mut next = UserPresence {
            presence: presence.to_owned(),
            status_msg: match status_msg {
                Some(m) => m,
                None => prev.as_ref().and_then(|p| p.status_msg.clone()),
            },
            last_active_ms: now,
            rooms_recorded: joined_rooms.len(),
            relayed_ms: prev.as_ref().map_or(0, |p| p.relayed_ms),
        };
        let changed = prev.as_ref().is_none_or(|p| {
            p.presence != next.presence
                || p.status_msg != next.status_msg
                || p.rooms_recorded != next.rooms_recorded
        });
        let relay = changed
            || prev
                .as_ref()
                .is_none_or(|p| now >= p.relayed_ms.saturating_add(RELAY_REFRESH_MS));
        if relay {
            next.relayed_ms = now;
        }
        inner.users.insert(user_id.to_owned(), next);
        if !changed {
            return relay;
        }
        let serial = typing.next_serial();
        for room in joined_rooms {
            let r = inner.rooms.entry(room.clone()).or_default();
            r.users.insert(user_id.to_owned(), serial);
            inner.changed.bump(room, serial);
        }
        true
    }

    /// (user, room) pairs whose presence changed after counter value `after`, one per
    /// user (the first room found), sorted, and the highest counter value among those
    /// changes (`after` when none): the application-service pusher's feed (walks the
    /// rooms with a presence change after `after`).
    pub fn changed_after(&self, after: u64) -> (Vec<(String, String)>, u64) {
        let inner = self.inner.lock();
        let rooms = inner
            .changed
            .changed_after(after, usize::MAX)
            .unwrap_or_default();
        let upto = rooms
            .last()
            .and_then(|r| inner.changed.get(r))
            .unwrap_or(after);
        let users = Self::users_in(&inner, rooms.iter().map(|r| &**r), Some(after));
        (users, upto)
    }

    /// Users whose presence changed after counter value `after`, each with every room
    /// the change was recorded under (the user's joined rooms at the change), sorted,
    /// and the highest counter value among those changes (`after` when none): the
    /// federation feed's input. Memory only: walks the rooms with a change after
    /// `after`.
    pub fn changed_after_with_rooms(&self, after: u64) -> (Vec<(String, Vec<String>)>, u64) {
        let inner = self.inner.lock();
        let mut upto = after;
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for room in inner
            .changed
            .changed_after(after, usize::MAX)
            .unwrap_or_default()
        {
            upto = upto.max(inner.changed.get(&room).unwrap_or(0));
            let Some(r) = inner.rooms.get(&*room) else {
                continue;
            };
            for (user, serial) in &r.users {
                if *serial > after {
                    out.entry(user.clone()).or_default().push(room.to_string());
                }
            }
        }
        let mut out: Vec<(String, Vec<String>)> = out.into_iter().collect();
        for (_, rooms) in &mut out {
            rooms.sort();
        }
        (out, upto)
    }

    /// The content of a user's `m.presence` event (or `/status` answer), if known.
    pub fn content(&self, user_id: &str, now: u64) -> Option<Value> {
        let inner = self.inner.lock();
        let p = inner.users.get(user_id)?;
        let ago = now.saturating_sub(p.last_active_ms);
        let mut c = json!({
            "presence": p.presence,
            "last_active_ago": ago,
            "currently_active": p.presence == "online" && ago < CURRENTLY_ACTIVE_MS,
        });
        if let Some(m) = &p.status_msg {
            c["status_msg"] = json!(m);
        }
        Some(c)
    }

    /// Whether any of `rooms` saw a presence change after counter value `since`.
    /// With `rooms` sorted, walks the rooms that changed, not `rooms`.
    pub fn changed_since(&self, rooms: &SortedKeys, since: u64) -> bool {
        let inner = self.inner.lock();
        changed_or_all(inner.changed.changed_after(since, rooms.len()), rooms)
            .into_iter()
            .any(|r| inner.changed.get(r).is_some_and(|p| p > since))
    }

    /// Users of `rooms` whose presence changed after counter value `since` (all users
    /// with a presence when `since` is `None`), deduplicated, sorted. With `rooms`
    /// sorted and a `since`, walks the rooms that changed, not `rooms`.
    fn changed_users(&self, rooms: &SortedKeys, since: Option<u64>) -> Vec<(String, String)> {
        let inner = self.inner.lock();
        match since {
            Some(s) => {
                let rooms = changed_or_all(inner.changed.changed_after(s, rooms.len()), rooms);
                Self::users_in(&inner, rooms.into_iter(), since)
            }
            None => Self::users_in(&inner, rooms.iter().map(String::as_str), since),
        }
    }

    /// [`Presence::changed_users`] over the given rooms.
    fn users_in<'a>(
        inner: &Inner,
        rooms: impl Iterator<Item = &'a str>,
        since: Option<u64>,
    ) -> Vec<(String, String)> {
        let mut out = BTreeSet::new();
        for room in rooms {
            let Some(p) = inner.rooms.get(room) else {
                continue;
            };
            if since.is_some_and(|s| inner.changed.get(room).is_none_or(|c| c <= s)) {
                continue;
            }
            for (user, serial) in &p.users {
                if since.is_none_or(|s| *serial > s) {
                    out.insert((user.clone(), room.to_owned()));
                }
            }
        }
        // One (user, room) per user: the first room found is enough to check membership.
        let mut seen = BTreeSet::new();
        out.into_iter()
            .filter(|(u, _)| seen.insert(u.clone()))
            .collect()
    }
}

/// The `presence.events` of a `/sync` answer: `m.presence` events of users who share
/// one of `joined_rooms` with the requester and changed after the token's counter
/// value (all of them on an initial sync), plus, on an incremental sync, the current
/// presence of every user who came to share a room with the requester since the
/// token's position (`since`: (position, counter)), changed or not, as Synapse sends
/// it for newly joined rooms and newly joined members. Empty when presence is off.
pub(crate) fn sync_events(
    s: &AppState,
    user_id: &str,
    joined_rooms: &SortedKeys,
    since: Option<(u64, u64)>,
    upto: u64,
) -> Vec<Value> {
    if !s.config.presence_enabled {
        return Vec::new();
    }
    let now = crate::now_ms();
    let mut users: BTreeSet<String> = s
        .presence
        .changed_users(joined_rooms, since.map(|(_, t)| t))
        .into_iter()
        .filter(|(user, room)| {
            s.projections
                .membership
                .get(room, user)
                .is_some_and(|m| m.membership == "join")
        })
        .map(|(user, _)| user)
        .collect();
    if let Some((position, _)) = since {
        users.extend(
            s.projections
                .device_keys
                .newly_shared(user_id, joined_rooms, position, upto),
        );
    }
    users
        .into_iter()
        .filter_map(|user| {
            let content = s.presence.content(&user, now)?;
            Some(json!({ "type": "m.presence", "sender": user, "content": content }))
        })
        .collect()
}

/// Applies `/sync`'s `set_presence` (default `online`; `offline` leaves the state
/// alone, as the spec says). `joined_rooms` is the list the sync already read.
///
/// A default sync turns an `unavailable` set through `PUT /presence` back to `online`:
/// the spec says a client that omits `set_presence` "is automatically marked as online
/// when it uses this API", and Synapse (1.163, `handlers/presence.py` `set_state` with
/// `is_sync`) does the same per device (only `busy`, not in the spec, survives a
/// sync). A client that wants to stay idle syncs with `set_presence=unavailable`.
pub(crate) fn on_sync(s: &AppState, user_id: &str, set_presence: Option<&str>, joined: &[String]) {
    if !s.config.presence_enabled {
        return;
    }
    if let p @ ("online" | "unavailable") = set_presence.unwrap_or("online") {
        s.presence
            .set(&s.typing, user_id, p, None, joined, crate::now_ms());
    }
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route(
        "/_matrix/client/v3/presence/{user_id}/status",
        get(get_status).put(put_status),
    )
}

fn joined_rooms(s: &AppState, user_id: &str) -> Vec<String> {
    s.projections
        .membership
        .rooms_of(user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(r, _)| r)
        .collect()
}

/// `PUT /presence/{userId}/status`: only one's own.
async fn put_status(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    if user_id != r.user_id {
        return Err(MatrixError::forbidden("Cannot set another user's presence"));
    }
    let presence = opt_str(&body, "presence")?
        .ok_or_else(|| MatrixError::missing_param("presence is required"))?;
    if !["online", "offline", "unavailable"].contains(&presence.as_str()) {
        return Err(MatrixError::bad_json(
            "presence must be online, offline or unavailable",
        ));
    }
    let status_msg = opt_str(&body, "status_msg")?;
    if status_msg
        .as_ref()
        .is_some_and(|m| m.len() > MAX_STATUS_MSG_BYTES)
    {
        return Err(MatrixError::bad_json(format!(
            "status_msg is longer than {MAX_STATUS_MSG_BYTES} bytes"
        )));
    }
    if s.config.presence_enabled {
        let rooms = joined_rooms(&s, &r.user_id);
        s.presence.set(
            &s.typing,
            &r.user_id,
            &presence,
            Some(status_msg),
            &rooms,
            crate::now_ms(),
        );
    }
    Ok(Json(json!({})))
}

/// `GET /presence/{userId}/status`: one's own, or that of a user sharing a joined room
/// (else 403), local or remote (remote presence arrives as `m.presence` EDUs); an
/// unknown local user is 404; a user whose presence is unknown is `offline`.
async fn get_status(
    State(s): State<AppState>,
    r: Requester,
    Path(user_id): Path<String>,
) -> ApiResult<Json<Value>> {
    if ruma::UserId::parse(&user_id).is_err() {
        return Err(MatrixError::invalid_param("Invalid user id"));
    }
    // A remote user is known through the rooms we share (their presence arrives
    // over federation); only a local name can be checked against the accounts.
    if s.is_local_user(&user_id) && s.projections.accounts.user(&user_id).is_none() {
        return Err(MatrixError::not_found("Unknown user"));
    }
    if user_id != r.user_id {
        let shares = joined_rooms(&s, &user_id).iter().any(|room| {
            s.projections
                .membership
                .get(room, &r.user_id)
                .is_some_and(|m| m.membership == "join")
        });
        if !shares {
            return Err(MatrixError::forbidden(
                "You are not allowed to see their presence",
            ));
        }
    }
    if !s.config.presence_enabled {
        return Ok(Json(json!({ "presence": "offline" })));
    }
    Ok(Json(
        s.presence
            .content(&user_id, crate::now_ms())
            .unwrap_or_else(|| json!({ "presence": "offline" })),
    ))
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    #[test]
    fn presence_users_are_bounded_least_recently_active_forgotten_first() {
        let typing = crate::typing::Typing::default();
        let p = Presence::with_limit(100);
        let rooms = vec!["!r:x".to_owned()];
        for i in 0..100u64 {
            p.set(
                &typing,
                &format!("@u{i}:x"),
                "online",
                None,
                &rooms,
                1_000 + i,
            );
        }
        assert_eq!(p.len(), 100);
        // @u0 is active again: @u1..@u10 are now the ten least recently active.
        p.set(&typing, "@u0:x", "online", None, &rooms, 5_000);
        p.set(&typing, "@new:x", "online", None, &rooms, 5_001);
        assert_eq!(p.len(), 91);
        for i in 1..=10 {
            assert!(p.content(&format!("@u{i}:x"), 6_000).is_none(), "@u{i}");
        }
        assert!(p.content("@u0:x", 6_000).is_some());
        assert!(p.content("@u11:x", 6_000).is_some());
        assert!(p.content("@new:x", 6_000).is_some());
        // Their room entries went with them.
        let inner = p.inner.lock();
        assert_eq!(inner.rooms["!r:x"].users.len(), 91);
        assert!(!inner.rooms["!r:x"].users.contains_key("@u1:x"));
    }
}
