//! Third-party networks (spec: client-server API "Third-party Networks"): the
//! protocols bridges (application services) offer, and lookups of their users and
//! locations, proxied to the application services whose registration lists the
//! protocol in `protocols` (as Synapse does):
//!
//! - `GET /thirdparty/protocols`: each declared protocol's metadata from `GET
//!   /_matrix/app/v1/thirdparty/protocol/{protocol}` of every application service
//!   declaring it, merged as Synapse merges them: the first answer's fields, the
//!   `instances` of all answers concatenated, each instance with a `network_id` given
//!   `instance_id` = `<appservice id>|<network_id>`. An application service that fails
//!   or answers something that is not an object with an `instances` list is left out
//!   (logged); a protocol nobody answered for is left out. `{}` without bridges.
//! - `GET /thirdparty/protocol/{protocol}`: that protocol's merged metadata; 404
//!   `M_NOT_FOUND` when no application service answered for it.
//! - `GET /thirdparty/location/{protocol}` and `GET /thirdparty/user/{protocol}`: the
//!   query parameters (but `access_token`) passed on to `GET
//!   /_matrix/app/v1/thirdparty/{location,user}/{protocol}` of each application
//!   service declaring the protocol, the answers concatenated (entries without a
//!   string `alias`/`userid` and `protocol` and an object `fields` are dropped, as
//!   Synapse drops them); 404 `M_NOT_FOUND` for a protocol no registration declares.
//! - `GET /thirdparty/location?alias=` and `GET /thirdparty/user?userid=`: the same
//!   reverse lookups (`/_matrix/app/v1/thirdparty/location?alias=`, `user?userid=`)
//!   asked of every application service that declares a protocol; when none answers
//!   an entry: `[]` for a room alias or user that exists here, 404 `M_NOT_FOUND` for
//!   one that does not (the spec's 404), 400 `M_MISSING_PARAM`/`M_INVALID_PARAM` for
//!   a missing or malformed one.
//!
//! Each application service is asked in turn, within `[appservices]
//! request_timeout_ms` each; nothing is cached.

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::get,
};
use serde_json::{Value, json};

use crate::{
    ApiResult, AppState, MatrixError,
    appservice::{APP_SERVICE_PREFIX, AppService, urlencode},
    extract::{Query, Requester},
};

pub(crate) fn routes() -> Router<AppState> {
    const P: &str = "/_matrix/client/v3/thirdparty";
    Router::new()
        .route(&format!("{P}/protocols"), get(protocols))
        .route(&format!("{P}/protocol/{{protocol}}"), get(protocol))
        .route(
            &format!("{P}/location/{{protocol}}"),
            get(location_by_protocol),
        )
        .route(&format!("{P}/user/{{protocol}}"), get(user_by_protocol))
        .route(&format!("{P}/location"), get(location_by_alias))
        .route(&format!("{P}/user"), get(user_by_id))
}

/// The metadata one application service gives for `protocol`, its instances given
/// `instance_id`s; `None` when the request fails or the answer is not an object with
/// an `instances` list.
async fn protocol_of(s: &AppState, a: &AppService, protocol: &str) -> Option<Value> {
    let path = format!(
        "{APP_SERVICE_PREFIX}/thirdparty/protocol/{}",
        urlencode(protocol)
    );
    let mut info = match s
        .appservices
        .request(a, reqwest::Method::GET, &path, None)
        .await
    {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(appservice = %a.id, protocol, error = %e, "thirdparty: protocol query failed");
            return None;
        }
    };
    let Some(instances) = info.get_mut("instances").and_then(|i| i.as_array_mut()) else {
        tracing::warn!(appservice = %a.id, protocol, "thirdparty: protocol metadata without an instances list");
        return None;
    };
    for inst in instances.iter_mut() {
        if let Some(network) = inst.get("network_id").and_then(|n| n.as_str()) {
            let id = format!("{}|{network}", a.id);
            inst["instance_id"] = json!(id);
        }
    }
    Some(info)
}

/// Every declared protocol (or only `only`) with its merged metadata.
async fn merged_protocols(s: &AppState, only: Option<&str>) -> serde_json::Map<String, Value> {
    let mut answers: std::collections::BTreeMap<String, Vec<Value>> = Default::default();
    for a in s.appservices.all() {
        if a.url.is_none() {
            continue;
        }
        for p in &a.protocols {
            if only.is_some_and(|o| o != p) {
                continue;
            }
            let list = answers.entry(p.clone()).or_default();
            if let Some(info) = protocol_of(s, a, p).await {
                list.push(info);
            }
        }
    }
    let mut out = serde_json::Map::new();
    for (p, infos) in answers {
        let mut it = infos.into_iter();
        let Some(mut first) = it.next() else { continue };
        for more in it {
            if let (Some(all), Some(extra)) = (
                first["instances"].as_array_mut(),
                more["instances"].as_array(),
            ) {
                all.extend(extra.iter().cloned());
            }
        }
        out.insert(p, first);
    }
    out
}

/// `GET /thirdparty/protocols`.
async fn protocols(State(s): State<AppState>, _r: Requester) -> Json<Value> {
    Json(Value::Object(merged_protocols(&s, None).await))
}

/// `GET /thirdparty/protocol/{protocol}`.
async fn protocol(
    State(s): State<AppState>,
    _r: Requester,
    Path(protocol): Path<String>,
) -> ApiResult<Json<Value>> {
    merged_protocols(&s, Some(&protocol))
        .await
        .remove(&protocol)
        .map(Json)
        .ok_or_else(|| MatrixError::not_found(format!("Unknown third-party protocol {protocol:?}")))
}

/// Whether `r` is a valid third-party lookup result carrying `field` (Synapse's
/// `_is_valid_3pe_result`).
fn valid_result(r: &Value, field: &str) -> bool {
    r.get(field).is_some_and(|v| v.is_string())
        && r.get("protocol").is_some_and(|v| v.is_string())
        && r.get("fields").is_some_and(|v| v.is_object())
}

/// Asks `services` `GET {path}?{query}` and concatenates the valid entries.
async fn lookup(
    s: &AppState,
    services: &[&AppService],
    path: &str,
    query: &[(String, String)],
    field: &str,
) -> Vec<Value> {
    let mut qs = reqwest::Url::parse("http://query/").expect("static url");
    {
        let mut pairs = qs.query_pairs_mut();
        for (k, v) in query.iter().filter(|(k, _)| k != "access_token") {
            pairs.append_pair(k, v);
        }
    }
    let path = match qs.query() {
        Some(q) if !q.is_empty() => format!("{path}?{q}"),
        _ => path.to_owned(),
    };
    let mut out = Vec::new();
    for a in services {
        match s
            .appservices
            .request(a, reqwest::Method::GET, &path, None)
            .await
        {
            Ok(Value::Array(list)) => {
                out.extend(list.into_iter().filter(|r| valid_result(r, field)));
            }
            Ok(_) => {
                tracing::warn!(appservice = %a.id, path, "thirdparty: lookup answer is not a list")
            }
            Err(e) => {
                tracing::warn!(appservice = %a.id, path, error = %e, "thirdparty: lookup failed")
            }
        }
    }
    out
}

/// The application services (with a `url`) declaring `protocol`, or declaring any
/// protocol when `None`.
fn declaring<'a>(s: &'a AppState, protocol: Option<&str>) -> Vec<&'a AppService> {
    s.appservices
        .all()
        .iter()
        .filter(|a| a.url.is_some())
        .filter(|a| match protocol {
            Some(p) => a.protocols.iter().any(|q| q == p),
            None => !a.protocols.is_empty(),
        })
        .map(|a| a.as_ref())
        .collect()
}

/// `GET /thirdparty/location/{protocol}` (`field` `alias`) and `GET
/// /thirdparty/user/{protocol}` (`userid`).
async fn by_protocol(
    s: &AppState,
    kind: &str,
    field: &str,
    protocol: &str,
    q: &Query,
) -> ApiResult<Json<Value>> {
    let services = declaring(s, Some(protocol));
    if services.is_empty() {
        return Err(MatrixError::not_found(format!(
            "Unknown third-party protocol {protocol:?}"
        )));
    }
    let path = format!(
        "{APP_SERVICE_PREFIX}/thirdparty/{kind}/{}",
        urlencode(protocol)
    );
    Ok(Json(Value::Array(
        lookup(s, &services, &path, &q.0, field).await,
    )))
}

async fn location_by_protocol(
    State(s): State<AppState>,
    _r: Requester,
    Path(protocol): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    by_protocol(&s, "location", "alias", &protocol, &q).await
}

async fn user_by_protocol(
    State(s): State<AppState>,
    _r: Requester,
    Path(protocol): Path<String>,
    q: Query,
) -> ApiResult<Json<Value>> {
    by_protocol(&s, "user", "userid", &protocol, &q).await
}

fn required<'a>(q: &'a Query, name: &str) -> ApiResult<&'a str> {
    q.get(name)
        .ok_or_else(|| MatrixError::missing_param(format!("{name} is required")))
}

/// `GET /thirdparty/location?alias=`: the third-party locations of a room alias.
async fn location_by_alias(
    State(s): State<AppState>,
    _r: Requester,
    q: Query,
) -> ApiResult<Json<Value>> {
    let alias = required(&q, "alias")?;
    if ruma::RoomAliasId::parse(alias).is_err() {
        return Err(MatrixError::invalid_param("alias is not a room alias"));
    }
    let services = declaring(&s, None);
    let path = format!("{APP_SERVICE_PREFIX}/thirdparty/location");
    let found = lookup(
        &s,
        &services,
        &path,
        &[("alias".into(), alias.to_owned())],
        "alias",
    )
    .await;
    if !found.is_empty() {
        return Ok(Json(Value::Array(found)));
    }
    if s.projections.aliases.resolve(alias).is_none() {
        return Err(MatrixError::not_found("The room alias was not found"));
    }
    Ok(Json(json!([])))
}

/// `GET /thirdparty/user?userid=`: the third-party users of a Matrix user id.
async fn user_by_id(State(s): State<AppState>, _r: Requester, q: Query) -> ApiResult<Json<Value>> {
    let user_id = required(&q, "userid")?;
    if ruma::UserId::parse(user_id).is_err() {
        return Err(MatrixError::invalid_param("userid is not a user id"));
    }
    let services = declaring(&s, None);
    let path = format!("{APP_SERVICE_PREFIX}/thirdparty/user");
    let found = lookup(
        &s,
        &services,
        &path,
        &[("userid".into(), user_id.to_owned())],
        "userid",
    )
    .await;
    if !found.is_empty() {
        return Ok(Json(Value::Array(found)));
    }
    if s.projections.accounts.user(user_id).is_none() {
        return Err(MatrixError::not_found("The user was not found"));
    }
    Ok(Json(json!([])))
}
