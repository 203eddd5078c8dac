//! What the Client-Server API asks of other servers: joining a room another server
//! hosts (spec: server-server API, "Joining Rooms", joining server side), resolving a
//! remote alias and a remote profile (a remote server's public room list is
//! [`crate::directory::remote_public_rooms`]).
//!
//! A remote join: `make_join` on each candidate server until one answers, sign the
//! template with our key, `send_join` it, verify what comes back and hand it to the
//! journal as one [`CommandBody::ImportRemoteRoom`] command (the auth chain and state
//! become outlier records, the join the room's first timeline event here).

use spindle_core::pdu::Pdu;
use spindle_journal::CommandBody;

use crate::{
    FedState,
    client::ClientError,
    error::{FedError, FedResult},
    server_of,
    transactions::urlencode,
};

/// Maps an outbound failure to the error the local client gets: the remote's own
/// refusal (403/404) is passed on, anything else is 502 (the remote is unreachable
/// or misbehaved; never a 500 of ours).
pub(crate) fn remote_error(e: ClientError) -> FedError {
    match &e {
        ClientError::Status { status, body, .. } if (400..500).contains(status) => {
            let parsed: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            let errcode = match parsed.get("errcode").and_then(|c| c.as_str()) {
                Some("M_FORBIDDEN") => "M_FORBIDDEN",
                Some("M_NOT_FOUND") => "M_NOT_FOUND",
                Some("M_INCOMPATIBLE_ROOM_VERSION") => "M_INCOMPATIBLE_ROOM_VERSION",
                Some("M_UNSUPPORTED_ROOM_VERSION") => "M_UNSUPPORTED_ROOM_VERSION",
                _ => "M_UNKNOWN",
            };
            let status = axum::http::StatusCode::from_u16(*status)
                .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
            let msg = parsed
                .get("error")
                .and_then(|m| m.as_str())
                .unwrap_or("the remote server refused")
                .to_owned();
            FedError::new(status, errcode, msg)
        }
        _ => FedError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "M_UNKNOWN",
            e.to_string(),
        ),
    }
}

/// Resolves a room alias on its own server (`/query/directory`): the room id and the
/// servers in the room.
pub async fn resolve_alias(st: &FedState, alias: &str) -> FedResult<(String, Vec<String>)> {
    let server = server_of(alias).ok_or_else(|| FedError::invalid_param("bad alias"))?;
    let path = format!(
        "/_matrix/federation/v1/query/directory?room_alias={}",
        urlencode(alias)
    );
    let out = st
        .client
        .request(reqwest::Method::GET, server, &path, None)
        .await
        .map_err(remote_error)?;
    let room_id = out
        .get("room_id")
        .and_then(|r| r.as_str())
        .ok_or_else(|| {
            FedError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                "bad directory answer",
            )
        })?
        .to_owned();
    let mut servers: Vec<String> = out
        .get("servers")
        .and_then(|s| s.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if !servers.iter().any(|s| s == server) {
        servers.insert(0, server.to_owned());
    }
    Ok((room_id, servers))
}

/// A remote user's profile (`/query/profile`), or one field of it.
pub async fn query_profile(
    st: &FedState,
    user_id: &str,
    field: Option<&str>,
) -> FedResult<serde_json::Value> {
    let server = server_of(user_id).ok_or_else(|| FedError::invalid_param("bad user id"))?;
    let mut path = format!(
        "/_matrix/federation/v1/query/profile?user_id={}",
        urlencode(user_id)
    );
    if let Some(f) = field {
        path.push_str(&format!("&field={}", urlencode(f)));
    }
    st.client
        .request(reqwest::Method::GET, server, &path, None)
        .await
        .map_err(remote_error)
}

/// Joins `user_id` to a room hosted elsewhere, trying `servers` in order. `content`
/// is merged into the join's content (display name and avatar). Returns the join's
/// event id once the journal has imported the room and the projections applied it.
pub async fn join_remote(
    st: &FedState,
    user_id: &str,
    room_id: &str,
    servers: &[String],
    content: serde_json::Map<String, serde_json::Value>,
) -> FedResult<String> {
    let mut last = FedError::not_found("no server to join the room through");
    let vers: String = spindle_core::room_version::SUPPORTED
        .iter()
        .map(|v| format!("ver={v}"))
        .collect::<Vec<_>>()
        .join("&");
    for server in servers.iter().filter(|s| *s != st.server_name()).take(5) {
        let path = format!(
            "/_matrix/federation/v1/make_join/{}/{}?{vers}",
            urlencode(room_id),
            urlencode(user_id)
        );
        let made = match st
            .client
            .request(reqwest::Method::GET, server, &path, None)
            .await
        {
            Ok(m) => m,
            Err(e) => {
                tracing::info!(%server, error = %e, "make_join failed");
                last = remote_error(e);
                continue;
            }
        };
        let version = made
            .get("room_version")
            .and_then(|v| v.as_str())
            .unwrap_or("1")
            .to_owned();
        if spindle_core::room_version::rules(&version).is_none() {
            return Err(FedError::new(
                axum::http::StatusCode::BAD_REQUEST,
                "M_UNSUPPORTED_ROOM_VERSION",
                format!("the room is version {version}, which this server does not support"),
            ));
        }
        let mut template = made.get("event").cloned().unwrap_or_default();
        if let Some(c) = template.get_mut("content").and_then(|c| c.as_object_mut()) {
            for (k, v) in &content {
                c.insert(k.clone(), v.clone());
            }
        }
        if template.get("sender").and_then(|s| s.as_str()) != Some(user_id)
            || template.get("room_id").and_then(|s| s.as_str()) != Some(room_id)
        {
            last = FedError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                format!("{server} answered a template for another user or room"),
            );
            continue;
        }
        let pdu = Pdu::sign_template(template, &version, &st.key, crate::now_ms())
            .map_err(|e| FedError::bad_json(format!("the join template is invalid: {e}")))?;
        // A room new here is joined with partial state (MSC3902): the resident may
        // leave the members out, and they are fetched in the background ([`partial`]).
        // A room known here (joined before) is joined with its full state.
        let omit = st.journal.room_version(room_id).await.is_none();
        let path = format!(
            "/_matrix/federation/v2/send_join/{}/{}{}",
            urlencode(room_id),
            urlencode(pdu.event_id.as_str()),
            if omit { "?omit_members=true" } else { "" }
        );
        let body = pdu.federation_json();
        let joined = match st
            .client
            .request(reqwest::Method::PUT, server, &path, Some(&body))
            .await
        {
            Ok(j) => j,
            Err(e) => {
                tracing::info!(%server, error = %e, "send_join failed");
                last = remote_error(e);
                continue;
            }
        };
        let list = |k: &str| -> Vec<serde_json::Value> {
            joined
                .get(k)
                .and_then(|v| v.as_array())
                .cloned()
                .unwrap_or_default()
        };
        let (state, auth_chain) = (list("state"), list("auth_chain"));
        let partial_state = (omit
            && joined.get("members_omitted").and_then(|m| m.as_bool()) == Some(true))
        .then(|| {
            let mut servers: Vec<String> = list("servers_in_room")
                .iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect();
            if !servers.iter().any(|s| s == server) {
                servers.push(server.clone());
            }
            servers
        });
        // The resident may countersign the join (restricted rooms); keep its copy then.
        let join = joined
            .get("event")
            .filter(|e| e.is_object())
            .cloned()
            .unwrap_or(body);
        let keys = crate::partial::keys_for_all(
            st,
            state
                .iter()
                .chain(auth_chain.iter())
                .chain(std::iter::once(&join)),
        )
        .await;
        let outcome = st
            .submit_journal(
                user_id,
                CommandBody::ImportRemoteRoom {
                    room_id: room_id.to_owned(),
                    room_version: version.clone(),
                    auth_chain,
                    state,
                    join,
                    keys,
                    partial_state: partial_state.clone(),
                },
            )
            .await
            .map_err(FedError::from)?;
        st.wait_for(outcome.position).await?;
        if let Some(servers) = partial_state {
            tracing::info!(room = %room_id, via = %server, servers = servers.len(), "joined with partial state; fetching the members in the background");
            crate::partial::spawn_resync(
                st.clone(),
                room_id.to_owned(),
                pdu.event_id.to_string(),
                servers,
                Some(server.clone()),
            );
        }
        return Ok(pdu.event_id.to_string());
    }
    Err(last)
}
