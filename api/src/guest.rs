//! Guest access (spec: client-server API, "Guest Access" module): which endpoints a
//! guest's access token may call, which rooms a guest may join, and the numeric user
//! ids guests are registered under.
//!
//! Guest accounts are off unless `[registration] allow_guest_access` (Synapse's
//! `allow_guest_access`, off by default too). A guest is an account whose
//! `AccountRegistered` fact says `guest: true`; its tokens carry the flag in the
//! accounts projection, so the [`crate::extract::Requester`] extractor knows it from the token
//! read it makes anyway, and refuses every route outside [`GUEST_ROUTES`] with 403
//! `M_GUEST_ACCESS_FORBIDDEN` there, in one place ([`check_route`]).
//!
//! Invariants: a guest joins only a room whose current `m.room.guest_access` is
//! `can_join` ([`check_join`], on every join path a guest may call); a guest stays
//! joined only while it is (the server's guest-kick reactor leaves them when it
//! changes); an upgrade keeps the user id (`GuestUpgraded`).

use axum::http::Method;

use crate::{ApiResult, AppState, MatrixError};

/// The routes a guest may call: `(method, route template)`. First the spec's list
/// ("Client behaviour"); then what Synapse 1.163 also lets a guest call (its
/// `allow_guest=True` servlets), because Element's guest mode calls them and fails
/// without: `POST /join/{roomIdOrAlias}` (the same `can_join` check applies),
/// `/capabilities`, `/joined_rooms`, `/publicRooms`, `/keys/changes`,
/// `/keys/signatures/upload`, `/relations`, `/hierarchy`, the room summary, sliding
/// sync and the legacy `/_matrix/media/v3` download and thumbnail paths beside the
/// listed v1 ones. As in Synapse, typing, receipts, read markers, filters and account
/// data stay closed to guests. `PUT /profile/{userId}/{field}` is allowed for
/// `displayname` only ([`check_route`]). A `HEAD` is judged as its `GET`.
pub const GUEST_ROUTES: &[(&str, &str)] = &[
    // Retrieving events and associated media.
    ("GET", "/_matrix/client/v3/rooms/{room_id}/state"),
    (
        "GET",
        "/_matrix/client/v3/rooms/{room_id}/context/{event_id}",
    ),
    ("GET", "/_matrix/client/v3/rooms/{room_id}/event/{event_id}"),
    (
        "GET",
        "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
    ),
    (
        "GET",
        "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/",
    ),
    (
        "GET",
        "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
    ),
    ("GET", "/_matrix/client/v3/rooms/{room_id}/messages"),
    ("GET", "/_matrix/client/v3/rooms/{room_id}/members"),
    ("GET", "/_matrix/client/v3/rooms/{room_id}/initialSync"),
    ("GET", "/_matrix/client/v3/sync"),
    ("GET", "/_matrix/client/v3/events"),
    (
        "GET",
        "/_matrix/client/v1/media/download/{server}/{media_id}",
    ),
    (
        "GET",
        "/_matrix/client/v1/media/download/{server}/{media_id}/{filename}",
    ),
    (
        "GET",
        "/_matrix/client/v1/media/thumbnail/{server}/{media_id}",
    ),
    ("GET", "/_matrix/media/v3/download/{server}/{media_id}"),
    (
        "GET",
        "/_matrix/media/v3/download/{server}/{media_id}/{filename}",
    ),
    ("GET", "/_matrix/media/v3/thumbnail/{server}/{media_id}"),
    // Sending events.
    ("POST", "/_matrix/client/v3/rooms/{room_id}/join"),
    ("POST", "/_matrix/client/v3/join/{room_id_or_alias}"),
    ("POST", "/_matrix/client/v3/rooms/{room_id}/leave"),
    (
        "PUT",
        "/_matrix/client/v3/rooms/{room_id}/send/{event_type}/{txn_id}",
    ),
    (
        "PUT",
        "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
    ),
    (
        "PUT",
        "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/",
    ),
    (
        "PUT",
        "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
    ),
    (
        "PUT",
        "/_matrix/client/v3/sendToDevice/{event_type}/{txn_id}",
    ),
    // Their own account.
    ("PUT", "/_matrix/client/v3/profile/{user_id}/{field}"),
    ("GET", "/_matrix/client/v3/devices"),
    ("GET", "/_matrix/client/v3/devices/{device_id}"),
    ("PUT", "/_matrix/client/v3/devices/{device_id}"),
    ("GET", "/_matrix/client/v3/account/whoami"),
    // End-to-end encryption.
    ("POST", "/_matrix/client/v3/keys/upload"),
    ("POST", "/_matrix/client/v3/keys/query"),
    ("POST", "/_matrix/client/v3/keys/claim"),
    // Beyond the spec's list, as Synapse.
    ("GET", "/_matrix/client/v3/capabilities"),
    ("GET", "/_matrix/client/v3/joined_rooms"),
    ("GET", "/_matrix/client/v3/publicRooms"),
    ("POST", "/_matrix/client/v3/publicRooms"),
    ("GET", "/_matrix/client/v3/keys/changes"),
    ("POST", "/_matrix/client/v3/keys/signatures/upload"),
    (
        "GET",
        "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}",
    ),
    (
        "GET",
        "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}/{rel_type}",
    ),
    (
        "GET",
        "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}/{rel_type}/{event_type}",
    ),
    ("GET", "/_matrix/client/v1/rooms/{room_id}/hierarchy"),
    ("GET", "/_matrix/client/v1/room_summary/{room_id_or_alias}"),
    (
        "POST",
        "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync",
    ),
];

/// Whether a guest may call `method` on the route `template` (the matched route),
/// whose actual path is `path`.
pub fn guest_may_call(method: &Method, template: &str, path: &str) -> bool {
    let method = if method == Method::HEAD {
        "GET"
    } else {
        method.as_str()
    };
    if !GUEST_ROUTES
        .iter()
        .any(|(m, t)| *m == method && *t == template)
    {
        return false;
    }
    // Of the profile fields, a guest sets only its display name.
    template != "/_matrix/client/v3/profile/{user_id}/{field}" || path.ends_with("/displayname")
}

/// 403 `M_GUEST_ACCESS_FORBIDDEN` unless a guest may call this route. `template` is
/// `None` for a request no route matched (it never reaches a handler).
pub(crate) fn check_route(
    method: &Method,
    template: Option<&str>,
    path: &str,
) -> Result<(), MatrixError> {
    match template {
        Some(t) if guest_may_call(method, t, path) => Ok(()),
        _ => Err(forbidden_endpoint()),
    }
}

/// 403 `M_GUEST_ACCESS_FORBIDDEN`, as Synapse answers a guest outside its endpoints.
pub(crate) fn forbidden_endpoint() -> MatrixError {
    MatrixError::new(
        axum::http::StatusCode::FORBIDDEN,
        "M_GUEST_ACCESS_FORBIDDEN",
        "Guest access not allowed",
    )
}

/// Whether the room's current state has `m.room.guest_access` with `guest_access:
/// can_join` (spec: "Server behaviour"). A room unknown here has no such state.
/// Reads: one state point lookup and one event.
pub fn room_allows_guests(s: &AppState, room_id: &str) -> bool {
    let Some(root) = s.projections.state.current_root(room_id) else {
        return false;
    };
    let Some(id) = s.projections.state.lookup(root, "m.room.guest_access", "") else {
        return false;
    };
    s.projections
        .timeline
        .event(&id)
        .is_some_and(|ev| ev.pdu.content_value()["guest_access"] == "can_join")
}

/// A guest's join: 403 `M_FORBIDDEN` unless the room allows guests to join (Synapse:
/// "Guest access not allowed"). Full accounts pass.
pub(crate) fn check_join(
    s: &AppState,
    r: &crate::extract::Requester,
    room_id: &str,
) -> ApiResult<()> {
    if r.is_guest && !room_allows_guests(s, room_id) {
        return Err(MatrixError::forbidden(
            "Guest access not allowed: this room's m.room.guest_access is not can_join",
        ));
    }
    Ok(())
}

/// The next numeric localpart for a guest, as Synapse generates them: one more than
/// the largest all-digit localpart registered on this server (1 on a server with
/// none). The largest is found once per process by a scan of the accounts (cost grows
/// with the number of accounts, paid by the first guest registration only) and then
/// counted in memory; a number taken meanwhile (the journal refuses it with
/// `M_USER_IN_USE`) makes the caller ask again.
pub(crate) fn next_localpart(s: &AppState) -> String {
    let mut next = s.guest_ids.lock();
    let n = next.get_or_insert_with(|| {
        let suffix = format!(":{}", s.server_name());
        s.projections
            .accounts
            .users()
            .iter()
            .filter_map(|(id, _)| {
                let local = id.strip_prefix('@')?.strip_suffix(&suffix)?;
                (!local.is_empty() && local.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| local.parse::<u64>().ok())
                    .flatten()
            })
            .max()
            .unwrap_or(0)
            + 1
    });
    let local = n.to_string();
    *n += 1;
    local
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_routes_are_the_spec_list() {
        let get = Method::GET;
        assert!(guest_may_call(&get, "/_matrix/client/v3/sync", "/x"));
        assert!(guest_may_call(
            &Method::HEAD,
            "/_matrix/client/v3/sync",
            "/x"
        ));
        assert!(!guest_may_call(
            &Method::POST,
            "/_matrix/client/v3/createRoom",
            "/_matrix/client/v3/createRoom"
        ));
        assert!(!guest_may_call(
            &Method::POST,
            "/_matrix/client/v3/sync",
            "/_matrix/client/v3/sync"
        ));
        let profile = "/_matrix/client/v3/profile/{user_id}/{field}";
        assert!(guest_may_call(
            &Method::PUT,
            profile,
            "/_matrix/client/v3/profile/@1:h/displayname"
        ));
        assert!(!guest_may_call(
            &Method::PUT,
            profile,
            "/_matrix/client/v3/profile/@1:h/avatar_url"
        ));
        assert!(!guest_may_call(&get, profile, "/x/displayname"));
        assert_eq!(
            check_route(&Method::GET, None, "/").unwrap_err().errcode,
            "M_GUEST_ACCESS_FORBIDDEN"
        );
    }
}
