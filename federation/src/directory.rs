//! The public room directory over federation (spec: server-server API, "Public Room
//! Directory"): `GET` and `POST /_matrix/federation/v1/publicRooms`, served from the
//! same rule as the Client-Server `/publicRooms`
//! ([`spindle_projections::discovery::public_rooms`]), and the outbound side the
//! Client-Server `/publicRooms?server=` uses.
//!
//! Limits: the page size is clamped to
//! [`spindle_projections::discovery::PUBLIC_ROOMS_MAX_LIMIT`] (default
//! [`spindle_projections::discovery::PUBLIC_ROOMS_DEFAULT_LIMIT`]). Spindle has no
//! third-party networks: a `third_party_instance_id` selects none of our rooms (an
//! empty page), `include_all_networks` changes nothing.

use axum::{
    Json,
    extract::{Query, State},
};
use serde::Deserialize;
use serde_json::Value;
use spindle_projections::discovery;

use crate::{
    FedState,
    auth::Signed,
    error::{FedError, FedResult},
    outbound::remote_error,
    transactions::urlencode,
};

#[derive(Deserialize)]
pub(crate) struct PublicRoomsParams {
    #[serde(default)]
    limit: Option<String>,
    #[serde(default)]
    since: Option<String>,
    #[serde(default)]
    third_party_instance_id: Option<String>,
}

fn empty_page() -> Value {
    serde_json::json!({ "chunk": [], "total_room_count_estimate": 0 })
}

/// `GET /_matrix/federation/v1/publicRooms?limit=&since=`: one page of our public room
/// directory. A `limit` that is not a non-negative integer or a malformed `since`:
/// 400 `M_INVALID_PARAM`.
pub(crate) async fn public_rooms_get(
    State(st): State<FedState>,
    Query(q): Query<PublicRoomsParams>,
    _signed: Signed,
) -> FedResult<Json<Value>> {
    let limit = match q.limit.as_deref() {
        None | Some("") => None,
        Some(l) => Some(
            l.parse::<u64>()
                .map_err(|_| FedError::invalid_param("limit must be a non-negative integer"))?,
        ),
    };
    let query = discovery::PublicRoomsQuery {
        limit: discovery::clamp_limit(limit),
        offset: discovery::parse_since(q.since.as_deref()).map_err(FedError::invalid_param)?,
        ..Default::default()
    };
    if q.third_party_instance_id.is_some() {
        return Ok(Json(empty_page()));
    }
    Ok(Json(discovery::public_rooms(&st.projections, &query)))
}

/// `POST /_matrix/federation/v1/publicRooms` with `{limit, since, filter:
/// {generic_search_term, room_types}, include_all_networks, third_party_instance_id}`.
/// A malformed body: 400 `M_BAD_JSON`; a malformed `since`: 400 `M_INVALID_PARAM`.
pub(crate) async fn public_rooms_post(
    State(st): State<FedState>,
    signed: Signed,
) -> FedResult<Json<Value>> {
    let body = match signed.body {
        None => serde_json::Map::new(),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(FedError::bad_json("the body must be an object")),
    };
    let limit = match body.get("limit") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| FedError::bad_json("limit must be a non-negative integer"))?,
        ),
    };
    let since = match body.get("since") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(FedError::bad_json("since must be a string")),
    };
    let mut query = discovery::PublicRoomsQuery {
        limit: discovery::clamp_limit(limit),
        offset: discovery::parse_since(since).map_err(FedError::invalid_param)?,
        ..Default::default()
    };
    discovery::parse_filter(body.get("filter"), &mut query).map_err(FedError::bad_json)?;
    if body
        .get("third_party_instance_id")
        .is_some_and(|v| !v.is_null())
    {
        return Ok(Json(empty_page()));
    }
    Ok(Json(discovery::public_rooms(&st.projections, &query)))
}

/// Asks `server` for its public room directory (what the Client-Server
/// `/publicRooms?server=` answers): `POST` with `body` when there is one (a filter),
/// else `GET` with `limit` and `since`. The remote's 4xx is passed on; anything else
/// is 502 (see [`remote_error`]).
pub async fn remote_public_rooms(
    st: &FedState,
    server: &str,
    body: Option<Value>,
    limit: Option<u64>,
    since: Option<String>,
) -> FedResult<Value> {
    let path = "/_matrix/federation/v1/publicRooms";
    let out = match body {
        Some(b) => {
            st.client
                .request(reqwest::Method::POST, server, path, Some(&b))
                .await
        }
        None => {
            let mut params = Vec::new();
            if let Some(l) = limit {
                params.push(format!("limit={l}"));
            }
            if let Some(s) = since {
                params.push(format!("since={}", urlencode(&s)));
            }
            let full = if params.is_empty() {
                path.to_owned()
            } else {
                format!("{path}?{}", params.join("&"))
            };
            st.client
                .request(reqwest::Method::GET, server, &full, None)
                .await
        }
    }
    .map_err(remote_error)?;
    if !out.get("chunk").is_some_and(|c| c.is_array()) {
        return Err(FedError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "M_UNKNOWN",
            format!("{server} answered a directory without a chunk"),
        ));
    }
    Ok(out)
}
