//! History visibility (spec: client-server "Room History Visibility", event
//! `m.room.history_visibility`): the pure rules deciding who may see an event, for a
//! user (the `api` crate) and for another server (the `federation` crate). Both crates
//! feed them from the state projection; neither copies the other.
//!
//! "At the event" means: the `history_visibility` in force *before* the event (a
//! change of visibility applies from the next event on), and the memberships *after*
//! it (a user sees their own join).

use serde_json::Value;

/// The four `history_visibility` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryVisibility {
    /// Anyone may read, member or not.
    WorldReadable,
    /// Members may read everything, also what was sent before they joined.
    Shared,
    /// Members may read from the point they were invited on.
    Invited,
    /// Members may read from the point they joined on.
    Joined,
}

impl HistoryVisibility {
    /// Reads an `m.room.history_visibility` content. No event, no `history_visibility`
    /// key or a value this server does not know all mean `shared` (the spec's default).
    pub fn from_content(content: Option<&Value>) -> HistoryVisibility {
        match content
            .and_then(|c| c.get("history_visibility"))
            .and_then(Value::as_str)
        {
            Some("world_readable") => HistoryVisibility::WorldReadable,
            Some("invited") => HistoryVisibility::Invited,
            Some("joined") => HistoryVisibility::Joined,
            _ => HistoryVisibility::Shared,
        }
    }
}

/// May a user see an event?
///
/// - `visibility`: the history visibility before the event;
/// - `membership`: the user's membership after the event (`None`: never a member);
/// - `joined_since`: whether the user is joined now, or was joined at some point after
///   the event (a former member who was joined right before leaving, for an event
///   before the leave). That is what `shared` asks.
///
/// The rules in the spec's order: `world_readable` shows to anyone; a user joined at
/// the event sees it; under `shared`, a user joined since sees it; under `invited`, a
/// user invited at the event sees it; otherwise not.
pub fn user_may_see(
    visibility: HistoryVisibility,
    membership: Option<&str>,
    joined_since: bool,
) -> bool {
    match (visibility, membership) {
        (HistoryVisibility::WorldReadable, _) => true,
        (_, Some("join")) => true,
        (HistoryVisibility::Shared, _) => joined_since,
        (HistoryVisibility::Invited, Some("invite")) => true,
        _ => false,
    }
}

/// What another server receives of an event it may ask about (spec: server-server
/// "Retrieving events": the server "must check that the requesting server is allowed
/// to see the event"; what it may not see is served redacted, as Synapse does, so the
/// room's graph stays whole for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerView {
    /// The event as signed.
    Full,
    /// The event after the room version's redaction algorithm (signatures and hashes
    /// kept, content stripped).
    Redacted,
}

/// How a server sees an event, from the history visibility before it and the
/// memberships after it of that server's users (`memberships`; empty when none of them
/// was ever in the room).
///
/// `world_readable` and `shared` history is visible to every server that may ask about
/// the room at all (their users could read it once joined); `invited` to a server with
/// a user invited or joined at the event; `joined` to a server with a user joined at
/// it. Anything else is [`ServerView::Redacted`].
pub fn server_view<'a>(
    visibility: HistoryVisibility,
    memberships: impl IntoIterator<Item = &'a str>,
) -> ServerView {
    let visible = match visibility {
        HistoryVisibility::WorldReadable | HistoryVisibility::Shared => true,
        HistoryVisibility::Invited => memberships
            .into_iter()
            .any(|m| m == "join" || m == "invite"),
        HistoryVisibility::Joined => memberships.into_iter().any(|m| m == "join"),
    };
    if visible {
        ServerView::Full
    } else {
        ServerView::Redacted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HistoryVisibility::*;
    use serde_json::json;

    #[test]
    fn unknown_or_missing_visibility_is_shared() {
        assert_eq!(HistoryVisibility::from_content(None), Shared);
        assert_eq!(
            HistoryVisibility::from_content(Some(&json!({"history_visibility": "everyone"}))),
            Shared
        );
        assert_eq!(
            HistoryVisibility::from_content(Some(&json!({"history_visibility": 3}))),
            Shared
        );
        assert_eq!(
            HistoryVisibility::from_content(Some(&json!({"history_visibility": "joined"}))),
            Joined
        );
        assert_eq!(
            HistoryVisibility::from_content(Some(&json!({"history_visibility": "world_readable"}))),
            WorldReadable
        );
    }

    #[test]
    fn a_user_sees_by_the_spec_table() {
        // (visibility, membership after the event, joined since) -> visible
        let table = [
            (WorldReadable, None, false, true),
            (Shared, None, false, false),
            (Shared, None, true, true),
            (Shared, Some("leave"), true, true),
            (Shared, Some("invite"), false, false),
            (Invited, Some("invite"), false, true),
            (Invited, None, true, false),
            (Joined, Some("invite"), true, false),
            (Joined, Some("join"), false, true),
            (Joined, Some("ban"), true, false),
        ];
        for (v, m, since, want) in table {
            assert_eq!(user_may_see(v, m, since), want, "{v:?} {m:?} {since}");
        }
    }

    #[test]
    fn a_server_sees_by_its_users_memberships() {
        assert_eq!(server_view(Shared, []), ServerView::Full);
        assert_eq!(server_view(WorldReadable, []), ServerView::Full);
        assert_eq!(server_view(Joined, ["leave", "join"]), ServerView::Full);
        assert_eq!(server_view(Joined, ["invite"]), ServerView::Redacted);
        assert_eq!(server_view(Invited, ["invite"]), ServerView::Full);
        assert_eq!(server_view(Invited, ["leave", "ban"]), ServerView::Redacted);
        assert_eq!(server_view(Joined, []), ServerView::Redacted);
    }
}
