//! Authorization on every read (BRIEF §3.7; spec: "History visibility").
//!
//! [`room_access`] decides whether a user may read a room at all and up to which
//! position; [`can_see`] decides per event from the state at that event: the
//! `m.room.history_visibility` in force before it and the user's membership after it,
//! by the pure rule [`spindle_core::visibility::user_may_see`].
//! A user who is joined and was already joined at the event is decided without a
//! state lookup.

use spindle_core::visibility::{HistoryVisibility, user_may_see};
use spindle_projections::{membership::Membership, timeline::EventRecord};

use crate::{ApiResult, AppState, MatrixError};

/// What a user may read of a room.
#[derive(Debug, Clone)]
pub struct Access {
    /// The user's current membership row, if any.
    pub membership: Option<Membership>,
    /// Highest position the user may read (their leave/ban position if they left).
    pub cap: u64,
    /// For a former member: whether they were joined right before their latest
    /// leave/ban, i.e. joined at some point after every event up to `cap` that they
    /// were not joined for (the spec's rule for `shared`).
    pub was_joined: bool,
    /// For a former member: the position of their latest leave/ban.
    pub left_at: Option<u64>,
}

impl Access {
    /// Whether the user is joined now.
    pub fn joined(&self) -> bool {
        self.membership
            .as_ref()
            .is_some_and(|m| m.membership == "join")
    }
}

/// The content of a state event at `root`, if set.
pub fn state_content(
    s: &AppState,
    root: spindle_core::trie::Root,
    kind: &str,
    state_key: &str,
) -> Option<serde_json::Value> {
    let id = s.projections.state.lookup(root, kind, state_key)?;
    let ev = s.projections.timeline.event(&id)?;
    Some(ev.pdu.content_value())
}

/// The `membership` of `user_id`'s member event at `root`, if there is one.
pub fn membership_at(
    s: &AppState,
    root: spindle_core::trie::Root,
    user_id: &str,
) -> Option<String> {
    state_content(s, root, "m.room.member", user_id)?
        .get("membership")?
        .as_str()
        .map(str::to_owned)
}

fn history_visibility_at(s: &AppState, root: spindle_core::trie::Root) -> HistoryVisibility {
    HistoryVisibility::from_content(
        state_content(s, root, "m.room.history_visibility", "").as_ref(),
    )
}

/// Whether the room's current `m.room.history_visibility` is `world_readable` (two point
/// reads).
pub fn world_readable(s: &AppState, room_id: &str) -> bool {
    s.projections
        .state
        .current_root(room_id)
        .is_some_and(|root| history_visibility_at(s, root) == HistoryVisibility::WorldReadable)
}

/// May `user_id` read this room at all? Errors with 403 `M_FORBIDDEN` (also for rooms
/// that do not exist, so existence does not leak).
pub fn room_access(s: &AppState, user_id: &str, room_id: &str) -> ApiResult<Access> {
    let denied = || {
        MatrixError::forbidden(
            "You aren't a member of the room and weren't previously a member of the room.",
        )
    };
    if s.projections.state.room(room_id).is_none() {
        return Err(denied());
    }
    let membership = s.projections.membership.get(room_id, user_id);
    // Spec (`/forget`): a user who forgot a room can no longer retrieve its history.
    if membership.as_ref().is_some_and(|m| m.forgotten) {
        return Err(denied());
    }
    match membership.as_ref().map(|m| m.membership.as_str()) {
        Some("join") | Some("invite") | Some("knock") => Ok(Access {
            membership,
            cap: u64::MAX,
            was_joined: false,
            left_at: None,
        }),
        Some(_) => {
            let m = membership.as_ref().expect("matched Some");
            let was_joined = s
                .projections
                .state
                .state_event_roots(&m.event_id)
                .and_then(|r| membership_at(s, r.before, user_id))
                .is_some_and(|m| m == "join");
            // A world-readable room stays readable after leaving, like for anyone else.
            let world_readable = s
                .projections
                .state
                .current_root(room_id)
                .is_some_and(|root| {
                    history_visibility_at(s, root) == HistoryVisibility::WorldReadable
                });
            let cap = if world_readable { u64::MAX } else { m.position };
            Ok(Access {
                cap,
                left_at: Some(m.position),
                membership,
                was_joined,
            })
        }
        None => {
            let root = s
                .projections
                .state
                .current_root(room_id)
                .ok_or_else(denied)?;
            if history_visibility_at(s, root) == HistoryVisibility::WorldReadable {
                Ok(Access {
                    membership: None,
                    cap: u64::MAX,
                    was_joined: false,
                    left_at: None,
                })
            } else {
                Err(denied())
            }
        }
    }
}

/// One event of a room as `user_id` may see it, with the user's access to the room.
///
/// Errors: 404 `M_NOT_FOUND` ("Event not found") alike when the user may not read the
/// room, the event does not exist, belongs to another room, or is hidden from the user
/// by history visibility, so that the answer never tells which (spec: `GET
/// /rooms/{roomId}/event/{eventId}`). Reads: one point lookup of the event.
pub fn visible_event(
    s: &AppState,
    user_id: &str,
    room_id: &str,
    event_id: &str,
) -> ApiResult<(Access, EventRecord)> {
    let not_found = || MatrixError::not_found("Event not found");
    let access = room_access(s, user_id, room_id).map_err(|_| not_found())?;
    let ev = s
        .projections
        .timeline
        .event(event_id)
        .ok_or_else(not_found)?;
    if ev.pdu.room_id.as_str() != room_id || !can_see(s, user_id, &access, &ev) {
        return Err(not_found());
    }
    Ok((access, ev))
}

/// May the user see this event? (Spec: history visibility rules.)
pub fn can_see(s: &AppState, user_id: &str, access: &Access, ev: &EventRecord) -> bool {
    if ev.position > access.cap {
        return false;
    }
    if ev.backfill.is_some() {
        return backfilled_visible(s, user_id, access, ev);
    }
    // Fast path: joined now, and already joined when the event was sent.
    if let Some(m) = &access.membership
        && m.membership == "join"
        && m.position <= ev.position
    {
        return true;
    }
    // A user always sees their own leave, kick and ban (otherwise the room would just
    // vanish for them); their invite follows the ordinary rules.
    if ev.pdu.kind.to_string() == "m.room.member" && ev.pdu.state_key.as_deref() == Some(user_id) {
        let m = ev
            .pdu
            .content_value()
            .get("membership")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        if matches!(m.as_deref(), Some("leave") | Some("ban") | Some("join")) {
            return true;
        }
    }
    let Some((before, after)) = s.projections.state.roots_at(ev) else {
        return false;
    };
    let membership = membership_at(s, after, user_id);
    // `shared` asks whether the user joined at some point after the event: joined now,
    // or (a former member) joined right before leaving, and the event before the leave.
    let joined_since =
        access.joined() || (access.was_joined && access.left_at.is_some_and(|l| ev.position <= l));
    user_may_see(
        history_visibility_at(s, before),
        membership.as_deref(),
        joined_since,
    )
}

/// Visibility of backfilled history (older than this server's first event in the
/// room). The state at such an event is not held here (it is not fetched with the
/// events), so the room's *current* history visibility decides: `world_readable`
/// shows it to anyone, `shared` to members joined now or who were joined before they
/// left, `invited` and `joined` to nobody (it is before anyone here joined), except a
/// user's own membership events.
fn backfilled_visible(s: &AppState, user_id: &str, access: &Access, ev: &EventRecord) -> bool {
    if ev.pdu.kind.to_string() == "m.room.member" && ev.pdu.state_key.as_deref() == Some(user_id) {
        return true;
    }
    let Some(root) = s.projections.state.current_root(ev.pdu.room_id.as_str()) else {
        return false;
    };
    match history_visibility_at(s, root) {
        HistoryVisibility::WorldReadable => true,
        HistoryVisibility::Shared => access.joined() || access.was_joined,
        HistoryVisibility::Invited | HistoryVisibility::Joined => false,
    }
}

/// Whether one of this server's users is joined to the room now (else a join must go
/// through a server that is). Answered from the journal's write model: no store read,
/// whatever the room's size.
pub async fn server_is_joined(s: &AppState, room_id: &str) -> bool {
    s.journal
        .servers_in_room(room_id)
        .await
        .iter()
        .any(|srv| srv == s.server_name())
}
