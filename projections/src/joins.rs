//! Restricted joins (spec: client-server API "Restricted rooms", server-server API
//! "Restricted rooms"; room versions 8+): whether a user may join a room whose join rule
//! is `restricted` or `knock_restricted`, and which of this server's users vouches for
//! the join by being named in `join_authorised_via_users_server`.
//!
//! One rule set serves both doors: the client-server join of a local user and the
//! federation `make_join`/`send_join` of a remote one. It reads the projections (join
//! rules, memberships, power levels at the room's current state) and the journal's
//! write model (which servers are joined to a room), and writes nothing.

use spindle_journal::Journal;

use crate::Projections;

/// What the join rule says about one user's join, as [`restricted_join`] judges it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestrictedJoin {
    /// The join rule is not `restricted`/`knock_restricted` (or the room is unknown):
    /// the ordinary rules apply and no authoriser is named.
    NotRestricted,
    /// The user is joined to an allowed room; this local user has the power to invite
    /// and is joined, so it goes in `join_authorised_via_users_server`.
    Authorised(String),
    /// This server is in at least one allowed room and the user is joined to none of
    /// them: 403 `M_FORBIDDEN` (for `knock_restricted`, they may knock instead).
    NotAllowed,
    /// This server is in none of the allowed rooms, so it cannot tell: federation
    /// answers 400 `M_UNABLE_TO_AUTHORISE_JOIN`.
    CannotJudge,
    /// The user is allowed, but no local user both is joined and may invite: federation
    /// answers 400 `M_UNABLE_TO_GRANT_JOIN` (try another resident server); a local
    /// user's join goes through another server of the room.
    NoAuthoriser,
}

/// The state content of `(kind, state_key)` at the room's current state.
fn current_state(
    p: &Projections,
    room_id: &str,
    kind: &str,
    state_key: &str,
) -> Option<serde_json::Value> {
    let root = p.state.current_root(room_id)?;
    let id = p.state.lookup(root, kind, state_key)?;
    Some(p.timeline.event(&id)?.pdu.content_value())
}

/// The room ids a `restricted`/`knock_restricted` join rule allows through membership
/// (`allow` entries of type `m.room_membership`), or `None` when the room's current
/// join rule is another one or one the room's version does not have. Cost: one point
/// read for rooms that are not restricted.
pub fn allowed_rooms(p: &Projections, room_id: &str) -> Option<Vec<String>> {
    if !matches!(
        p.directory.join_rule(room_id).as_deref(),
        Some("restricted" | "knock_restricted")
    ) {
        return None;
    }
    let rules = current_state(p, room_id, "m.room.join_rules", "")?;
    // Versions before 8 (10 for `knock_restricted`) do not know the rule: their auth
    // rules read it as neither public nor knock, so joining takes an invite.
    let version = spindle_core::room_version::rules(&p.state.room(room_id)?.room_version)?;
    let known = match rules.get("join_rule").and_then(|v| v.as_str()) {
        Some("restricted") => version.authorization.restricted_join_rule,
        Some("knock_restricted") => version.authorization.knock_restricted_join_rule,
        _ => false,
    };
    if !known {
        return None;
    }
    Some(
        rules
            .get("allow")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
            .filter(|a| a.get("type").and_then(|t| t.as_str()) == Some("m.room_membership"))
            .filter_map(|a| a.get("room_id").and_then(|r| r.as_str()).map(str::to_owned))
            .collect(),
    )
}

/// Judges `user_id`'s join of `room_id` against its restricted join rule.
///
/// The user must be joined, by this server's view, to one of the allowed rooms this
/// server is joined to (a room this server is not in says nothing: its membership
/// list here may be stale). The authoriser is a local user joined to `room_id` whose
/// power level reaches `invite` (spec auth rules, `join_authorised_via_users_server`):
/// a room creator of a v12 room first, then the highest level, ties broken by user id,
/// so the choice is deterministic. A user already joined or invited needs no
/// authoriser: callers check that before asking.
pub async fn restricted_join(
    p: &Projections,
    journal: &Journal,
    server_name: &str,
    room_id: &str,
    user_id: &str,
) -> RestrictedJoin {
    let Some(allowed) = allowed_rooms(p, room_id) else {
        return RestrictedJoin::NotRestricted;
    };
    let mut judged = false;
    let mut member = false;
    for room in &allowed {
        if !journal
            .servers_in_room(room)
            .await
            .iter()
            .any(|s| s == server_name)
        {
            continue;
        }
        judged = true;
        if p.membership
            .get(room, user_id)
            .is_some_and(|m| m.membership == "join")
        {
            member = true;
            break;
        }
    }
    if !member {
        return if judged {
            RestrictedJoin::NotAllowed
        } else {
            RestrictedJoin::CannotJudge
        };
    }
    match authoriser(p, server_name, room_id) {
        Some(u) => RestrictedJoin::Authorised(u),
        None => RestrictedJoin::NoAuthoriser,
    }
}

/// A local user joined to `room_id` with the power to invite, chosen deterministically
/// (see [`restricted_join`]); `None` if there is none.
pub fn authoriser(p: &Projections, server_name: &str, room_id: &str) -> Option<String> {
    let local = format!(":{server_name}");
    let joined = |u: &str| {
        u.ends_with(&local)
            && p.membership
                .get(room_id, u)
                .is_some_and(|m| m.membership == "join")
    };
    let meta = p.state.room(room_id)?;
    let create = current_state(p, room_id, "m.room.create", "").unwrap_or_default();
    let pl = current_state(p, room_id, "m.room.power_levels", "")
        .map(|pl| spindle_core::room_version::integer_power_levels(&pl));
    let mut candidates: Vec<(i64, String)> = Vec::new();
    if meta.room_version == "12" {
        // Room version 12: creators have infinite power and are never in `users`.
        candidates.push((i64::MAX, meta.creator.clone()));
        for u in create
            .get("additional_creators")
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten()
            .filter_map(|u| u.as_str())
        {
            candidates.push((i64::MAX, u.to_owned()));
        }
    }
    let Some(pl) = pl else {
        // No power levels event: the creator has 100 and invite needs 0.
        candidates.push((100, meta.creator.clone()));
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        return candidates.into_iter().map(|(_, u)| u).find(|u| joined(u));
    };
    let level = |k: &str| pl.get(k).and_then(|v| v.as_i64());
    let invite_level = level("invite").unwrap_or(0);
    let users_default = level("users_default").unwrap_or(0);
    if let Some(users) = pl.get("users").and_then(|u| u.as_object()) {
        for (u, l) in users {
            candidates.push((l.as_i64().unwrap_or(users_default), u.clone()));
        }
    }
    candidates.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    if let Some(u) = candidates
        .iter()
        .find(|(l, u)| *l >= invite_level && joined(u))
        .map(|(_, u)| u.clone())
    {
        return Some(u);
    }
    if users_default < invite_level {
        return None;
    }
    // Everyone at the default level may invite: the first joined local member not
    // listed in `users` (a listed one below the level was passed over above).
    let listed = |u: &str| pl.get("users").and_then(|m| m.get(u)).is_some();
    let mut locals: Vec<String> = p
        .membership
        .members(room_id)
        .into_iter()
        .filter(|(u, m)| m.membership == "join" && u.ends_with(&local) && !listed(u))
        .map(|(u, _)| u)
        .collect();
    locals.sort();
    locals.into_iter().next()
}
