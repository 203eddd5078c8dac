//! Authorization of events against room state (spec: room versions, "Authorization
//! rules"), delegated to ruma-state-res.
//!
//! The journal calls [`auth_types`] to choose an event's `auth_events` (spec:
//! server-server API "Auth events selection") and [`authorize`] with point lookups
//! into the room's head state to accept or reject it. Neither walks the whole state.

use std::collections::HashMap;

use ruma::{
    OwnedEventId, UserId,
    events::{StateEventType, TimelineEventType},
    room_version_rules::RoomVersionRules,
};
use serde_json::value::RawValue;

use crate::pdu::Pdu;

/// The (event type, state key) pairs whose current values become the `auth_events`
/// of an event with these fields. Errors when the content is malformed for its type
/// (for example an `m.room.member` without `membership`).
pub fn auth_types(
    rules: &RoomVersionRules,
    kind: &str,
    sender: &UserId,
    state_key: Option<&str>,
    content: &RawValue,
) -> Result<Vec<(String, String)>, String> {
    let kind = TimelineEventType::from(kind);
    let types = ruma::state_res::auth_types_for_event(
        &kind,
        sender,
        state_key,
        content,
        &rules.authorization,
    )?;
    Ok(types.into_iter().map(|(t, k)| (t.to_string(), k)).collect())
}

/// Checks `event` against the authorization rules of its room version.
///
/// `auth_events` are the events named by `event.auth_events` (by id); `state` answers
/// point lookups in the room state before the event. Returns the rule that rejected
/// the event as text.
pub fn authorize<'a>(
    rules: &RoomVersionRules,
    event: &Pdu,
    auth_events: &HashMap<OwnedEventId, &'a Pdu>,
    state: impl Fn(&str, &str) -> Option<&'a Pdu>,
) -> Result<(), String> {
    ruma::state_res::check_state_independent_auth_rules(&rules.authorization, event, |id| {
        auth_events.get(id).copied()
    })?;
    ruma::state_res::check_state_dependent_auth_rules(
        &rules.authorization,
        event,
        |t: &StateEventType, k: &str| state(&t.to_string(), k),
    )
}

/// The state-dependent half of [`authorize`] alone: checks `event` against some room
/// state (`state` answers point lookups) without its named auth events. The soft-fail
/// check of a remote event against the current state (spec: server-server API, "Soft
/// failure") uses it. Returns the rule that rejected the event as text.
pub fn authorize_against_state<'a>(
    rules: &RoomVersionRules,
    event: &Pdu,
    state: impl Fn(&str, &str) -> Option<&'a Pdu>,
) -> Result<(), String> {
    ruma::state_res::check_state_dependent_auth_rules(
        &rules.authorization,
        event,
        |t: &StateEventType, k: &str| state(&t.to_string(), k),
    )
}
