//! Spaces over federation (spec: server-server API, "Spaces"):
//! `GET /_matrix/federation/v1/hierarchy/{roomId}?suggested_only=`.
//!
//! Unlike the Client-Server endpoint it does not paginate or recurse: it answers the
//! room and its direct `m.space.child` children (a child counts when its content has a
//! non-empty `via`; with `suggested_only`, only `suggested: true` ones). A room is
//! visible to the asking server when the server has a joined member in it, or it is
//! previewable ([`spindle_projections::discovery::previewable`]: `world_readable`, a
//! join rule of `public`/`knock`/`knock_restricted`, or `restricted` with the server
//! joined to an allowed room). The requested room not visible (or unknown): 404
//! `M_NOT_FOUND`. A child we know but the server may not see is listed in
//! `inaccessible_children`; a child we know nothing of is left out. Bounded by
//! [`HIERARCHY_MAX_CHILDREN`].

use axum::{
    Json,
    extract::{Path, Query, State},
};
use serde::Deserialize;
use serde_json::{Value, json};
use spindle_projections::discovery;

use crate::{
    FedState,
    auth::Signed,
    error::{FedError, FedResult},
    reads::server_in_room,
};

/// Most children one answer describes (the rest are left out).
pub const HIERARCHY_MAX_CHILDREN: usize = 1_000;

/// Whether `server` may see `room_id` in a hierarchy (see the module docs).
pub(crate) fn server_may_preview(st: &FedState, room_id: &str, server: &str) -> bool {
    if st.projections.state.current_root(room_id).is_none() {
        return false;
    }
    server_in_room(st, room_id, server)
        || discovery::previewable(&st.projections, room_id, |allowed| {
            server_in_room(st, allowed, server)
        })
}

#[derive(Deserialize)]
pub(crate) struct HierarchyParams {
    #[serde(default)]
    suggested_only: Option<String>,
}

/// `GET /_matrix/federation/v1/hierarchy/{roomId}`: `{room, children,
/// inaccessible_children}`. `suggested_only` other than `true`/`false`: 400
/// `M_INVALID_PARAM`.
pub(crate) async fn hierarchy(
    State(st): State<FedState>,
    Path(room_id): Path<String>,
    Query(q): Query<HierarchyParams>,
    signed: Signed,
) -> FedResult<Json<Value>> {
    let suggested_only = match q.suggested_only.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(FedError::invalid_param(
                "suggested_only must be true or false",
            ));
        }
    };
    if !server_may_preview(&st, &room_id, &signed.origin) {
        return Err(FedError::not_found(
            "the room is not known here or you may not preview it",
        ));
    }
    let p = &st.projections;
    let mut room = discovery::room_chunk(p, &room_id)
        .ok_or_else(|| FedError::not_found("the room is not known here"))?;
    discovery::add_summary_details(p, &room_id, &mut room);
    let kids = discovery::space_children(p, &room_id, suggested_only);
    let mut children = Vec::new();
    let mut inaccessible = Vec::new();
    for (child, _) in kids.iter().take(HIERARCHY_MAX_CHILDREN) {
        if p.state.current_root(child).is_none() {
            continue;
        }
        if !server_may_preview(&st, child, &signed.origin) {
            inaccessible.push(json!(child));
            continue;
        }
        if let Some(mut c) = discovery::room_chunk(p, child) {
            discovery::add_summary_details(p, child, &mut c);
            children.push(c);
        }
    }
    room["children_state"] = Value::Array(kids.into_iter().map(|(_, ev)| ev).collect());
    Ok(Json(json!({
        "room": room,
        "children": children,
        "inaccessible_children": inaccessible,
    })))
}
