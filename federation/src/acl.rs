//! Server ACLs on inbound federation (spec: server-server API, "Server Access Control
//! Lists"): a server denied by a room's `m.room.server_acl` gets 403 `M_FORBIDDEN`
//! from every room-scoped endpoint (`make_join`, `send_join`, `make_leave`,
//! `send_leave`, `invite`, `make_knock`, `send_knock`, `state`, `state_ids`,
//! `backfill`, `event_auth`, `get_missing_events`, `event`, `hierarchy`), and each PDU
//! it sends in a `/send` transaction is refused with a per-PDU error. The rule itself
//! is pure and lives in [`spindle_core::acl`]; the ACL content is read from the room's
//! current state (one point lookup).
//!
//! The route guard ([`guard`]) runs before the signature is checked and uses the
//! origin the `X-Matrix` header claims: a refusal on a false claim is harmless (the
//! request would have failed authentication), and a request that gets past the guard
//! is still authenticated as that same origin by [`crate::auth::Signed`].

use axum::{extract::State, response::IntoResponse};

use crate::{FedState, auth::parse_x_matrix, error::FedError, error::FedResult};

/// Whether `server` may take part in `room_id` under the room's current ACL (no ACL
/// event, or a room we do not know: yes).
pub fn allowed(st: &FedState, room_id: &str, server: &str) -> bool {
    let acl = spindle_projections::discovery::current_state_content(
        &st.projections,
        room_id,
        "m.room.server_acl",
        "",
    );
    spindle_core::acl::server_allowed(acl.as_ref(), server)
}

/// 403 `M_FORBIDDEN` when `server` is denied by `room_id`'s ACL.
pub fn check_room(st: &FedState, room_id: &str, server: &str) -> FedResult<()> {
    if allowed(st, room_id, server) {
        Ok(())
    } else {
        Err(FedError::forbidden(format!(
            "{server} is denied by the server ACL of {room_id}"
        )))
    }
}

/// Endpoints whose path segment after the name is a room id.
const ROOM_SCOPED: &[&str] = &[
    "make_join",
    "send_join",
    "make_leave",
    "send_leave",
    "invite",
    "make_knock",
    "send_knock",
    "state",
    "state_ids",
    "backfill",
    "event_auth",
    "get_missing_events",
    "hierarchy",
];

/// The room a federation request path is about, if it is room-scoped
/// (`/_matrix/federation/v{1,2}/{name}/{roomId}...`, or `/event/{eventId}`'s room).
fn room_of_path(st: &FedState, path: &str) -> Option<String> {
    let rest = path
        .strip_prefix("/_matrix/federation/v1/")
        .or_else(|| path.strip_prefix("/_matrix/federation/v2/"))?;
    let mut parts = rest.split('/');
    let name = parts.next()?;
    let arg = percent_decode(parts.next()?)?;
    if name == "event" {
        return st
            .projections
            .timeline
            .event(&arg)
            .map(|e| e.pdu.room_id.to_string());
    }
    ROOM_SCOPED.contains(&name).then_some(arg)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Route layer refusing room-scoped requests from servers the room's ACL denies (see
/// the module docs).
pub(crate) async fn guard(
    State(st): State<FedState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let origin = req
        .headers()
        .get_all(axum::http::header::AUTHORIZATION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(parse_x_matrix)
        .map(|x| x.origin);
    if let Some(origin) = origin
        && let Some(room) = room_of_path(&st, req.uri().path())
        && let Err(e) = check_room(&st, &room, &origin)
    {
        return e.into_response();
    }
    next.run(req).await
}
