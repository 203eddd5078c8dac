//! `PUT /_matrix/client/v3/sendToDevice/{eventType}/{txnId}` (spec: client-server API
//! "Send-to-Device messaging").
//!
//! The send is one journal fact, idempotent per (sender, sender device, txn id): the
//! journal answers a repeated txn with the first send's position and appends nothing.
//! Delivery is `/sync`'s job (see [`crate::sync`]): each device receives each message
//! until it acknowledges it by syncing with a later `since`.

use std::collections::BTreeMap;

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::put,
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester},
};

/// Most to-device events one `/sync` response carries (the rest follow in the next).
pub const MAX_TO_DEVICE_PER_SYNC: usize = 100;

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route(
        "/_matrix/client/v3/sendToDevice/{event_type}/{txn_id}",
        put(send_to_device),
    )
}

type Messages = BTreeMap<String, BTreeMap<String, Value>>;

fn parse_messages(body: &serde_json::Map<String, Value>) -> ApiResult<Messages> {
    let messages = body
        .get("messages")
        .and_then(|m| m.as_object())
        .ok_or_else(|| MatrixError::bad_json("messages must be an object"))?;
    let mut out = Messages::new();
    for (user_id, devices) in messages {
        if !user_id.starts_with('@') || !user_id.contains(':') || user_id.contains('\0') {
            return Err(MatrixError::invalid_param(format!(
                "{user_id:?} is not a user id"
            )));
        }
        let devices = devices
            .as_object()
            .ok_or_else(|| MatrixError::bad_json("messages values must be objects"))?;
        let mut per_device = BTreeMap::new();
        for (device_id, content) in devices {
            if !content.is_object() {
                return Err(MatrixError::bad_json("message contents must be objects"));
            }
            if device_id.contains('\0') {
                return Err(MatrixError::invalid_param("invalid device id"));
            }
            per_device.insert(device_id.clone(), content.clone());
        }
        out.insert(user_id.clone(), per_device);
    }
    Ok(out)
}

/// `PUT /_matrix/client/v3/sendToDevice/{eventType}/{txnId}`: journals the send and
/// answers `{}` once durable. `*` as a device id means every device of that user.
/// Messages to users of other servers are dropped (no federation yet).
async fn send_to_device(
    State(s): State<AppState>,
    r: Requester,
    Path((event_type, txn_id)): Path<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let messages = parse_messages(&body)?;
    s.submit(
        &r.user_id,
        Some(&r.device_id),
        CommandBody::Fact {
            fact: Fact::ToDeviceSent {
                sender: r.user_id.clone(),
                sender_device: r.device_id.clone(),
                event_type,
                txn_id,
                messages,
            },
        },
    )
    .await?;
    Ok(Json(json!({})))
}
