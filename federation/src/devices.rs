//! Our copies of other servers' users' device lists (spec: server-server API "Device
//! Management"): when an `m.device_list_update` does not chain onto the copy (see
//! [`spindle_projections::device_keys::remote_chain`]), or a key query meets a user
//! we share a room with but hold no fresh copy of, the whole list is fetched with
//! `GET /_matrix/federation/v1/user/devices/{userId}` and journaled as a
//! [`Fact::RemoteDeviceListResynced`] record, which the device keys projection turns
//! into the copy `/keys/query` answers from.
//!
//! One fetch per user at a time: a request for a user whose fetch is under way is
//! remembered and run once more when it ends, so an update that arrived during the
//! fetch is never left out of the copy (the projection also refuses an answer older
//! than an update it has seen).

use std::collections::{HashMap, HashSet};

use serde_json::Value;
use spindle_journal::{CommandBody, Fact, RemoteDevice};
use spindle_projections::device_keys::{RemoteChain, RemoteListMeta, remote_chain};

use crate::{FedState, server_of};

pub use spindle_projections::device_keys::MAX_REMOTE_DEVICES;

/// How long a key query waits before it asks for a user's list again
/// ([`refresh_untracked`]): a copy that cannot become fresh (its server answers below
/// an update it sent) costs at most one fetch per user per this long, not one per
/// query.
pub const QUERY_REFETCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Users [`refresh_untracked`] remembers it fetched recently (the map is emptied when
/// it grows past this).
const MAX_RECENT_REFETCHES: usize = 10_000;

/// Whether `keys` is a `DeviceKeys` object naming `user_id` and `device_id` (anything
/// else from the origin is not kept).
pub fn keys_name(keys: &Value, user_id: &str, device_id: &str) -> bool {
    keys.get("user_id").and_then(|v| v.as_str()) == Some(user_id)
        && keys.get("device_id").and_then(|v| v.as_str()) == Some(device_id)
}

/// The users among `facts` (about to be journaled, in order) whose device list
/// updates do not chain onto our copy, judged as the projection will judge them:
/// against its copy, carried forward through the earlier updates of the same run.
pub fn gaps(st: &FedState, facts: &[Fact]) -> Vec<String> {
    let mut metas: HashMap<&str, Option<RemoteListMeta>> = HashMap::new();
    let mut out: Vec<String> = Vec::new();
    for fact in facts {
        let Fact::RemoteDeviceListChanged {
            user_id,
            stream_id,
            device: Some(d),
            ..
        } = fact
        else {
            continue;
        };
        let meta = metas
            .entry(user_id.as_str())
            .or_insert_with(|| st.projections.device_keys.remote_list_meta(user_id));
        match remote_chain(meta.as_ref(), *stream_id, &d.prev_id) {
            RemoteChain::Applies => {
                if let Some(m) = meta {
                    m.stream_id = *stream_id;
                }
            }
            RemoteChain::Held => {}
            RemoteChain::Gap => {
                // What the projection does too: stale until the resync.
                *meta = Some(RemoteListMeta {
                    stream_id: 0,
                    stale: true,
                    seen: *stream_id,
                    devices: 0,
                });
                if !out.contains(user_id) {
                    out.push(user_id.clone());
                }
            }
        }
    }
    out
}

/// Starts [`resync`] for `user_id` in the background, unless one is under way (then
/// it runs once more after it; see the module docs).
pub fn spawn_resync(st: FedState, user_id: String) {
    {
        let mut in_flight = st.device_resyncs.lock();
        if let Some(again) = in_flight.get_mut(&user_id) {
            *again = true;
            return;
        }
        in_flight.insert(user_id.clone(), false);
    }
    tokio::spawn(async move {
        loop {
            if let Err(e) = resync(&st, &user_id).await {
                tracing::info!(user = %user_id, error = %e, "fetching a remote device list failed");
            }
            let mut in_flight = st.device_resyncs.lock();
            if in_flight.get(&user_id) == Some(&true) {
                in_flight.insert(user_id.clone(), false);
                continue;
            }
            in_flight.remove(&user_id);
            return;
        }
    });
}

/// Starts [`spawn_resync`] for each of `users` that has no fresh copy here and shares
/// a room with us (a key query's remote users; the query itself asks the origin), at
/// most once per user per [`QUERY_REFETCH_INTERVAL`].
pub fn refresh_untracked(st: &FedState, users: &[String]) {
    let mut seen = HashSet::new();
    for user in users {
        if !seen.insert(user) || server_of(user) == Some(st.server_name()) {
            continue;
        }
        if st
            .projections
            .device_keys
            .remote_list_meta(user)
            .is_some_and(|m| !m.stale)
        {
            continue;
        }
        if !shares_a_room(st, user) {
            continue;
        }
        {
            let now = std::time::Instant::now();
            let mut recent = st.device_refetched.lock();
            if recent
                .get(user.as_str())
                .is_some_and(|t| now.duration_since(*t) < QUERY_REFETCH_INTERVAL)
            {
                continue;
            }
            if recent.len() >= MAX_RECENT_REFETCHES {
                recent.clear();
            }
            recent.insert(user.clone(), now);
        }
        spawn_resync(st.clone(), user.clone());
    }
}

fn shares_a_room(st: &FedState, user_id: &str) -> bool {
    st.projections
        .membership
        .rooms_of(user_id)
        .iter()
        .any(|(_, m)| m.membership == "join")
}

/// Fetches `user_id`'s device list from their server and journals it. Errors: the
/// request failed, the answer is malformed or names another user, or the journal
/// refused the record. A user we share no room with is not fetched (`Ok`).
pub async fn resync(st: &FedState, user_id: &str) -> Result<(), String> {
    let server = server_of(user_id).ok_or("not a user id")?.to_owned();
    if server == st.server_name() || !shares_a_room(st, user_id) {
        return Ok(());
    }
    let path = format!(
        "/_matrix/federation/v1/user/devices/{}",
        crate::transactions::urlencode(user_id)
    );
    let answer = st
        .client
        .request(reqwest::Method::GET, &server, &path, None)
        .await
        .map_err(|e| e.to_string())?;
    let fact = resynced(user_id, &answer)?;
    st.submit_journal(&server, CommandBody::Fact { fact })
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The journal record of a `/user/devices` answer (spec: `stream_id`, `devices` with
/// `device_id`, `keys` and `device_display_name`, `master_key`, `self_signing_key`).
fn resynced(user_id: &str, answer: &Value) -> Result<Fact, String> {
    if answer.get("user_id").and_then(|v| v.as_str()) != Some(user_id) {
        return Err("the answer names another user".into());
    }
    let stream_id = answer
        .get("stream_id")
        .and_then(|v| v.as_u64())
        .ok_or("the answer has no stream_id")?;
    let listed = answer
        .get("devices")
        .and_then(|v| v.as_array())
        .ok_or("the answer has no devices list")?;
    if listed.len() > MAX_REMOTE_DEVICES {
        tracing::warn!(user = %user_id, devices = listed.len(), "a remote user lists too many devices; keeping the first {MAX_REMOTE_DEVICES}");
    }
    let mut devices = Vec::new();
    for d in listed.iter().take(MAX_REMOTE_DEVICES) {
        let Some(device_id) = d.get("device_id").and_then(|v| v.as_str()) else {
            continue;
        };
        devices.push(RemoteDevice {
            device_id: device_id.to_owned(),
            keys: d
                .get("keys")
                .filter(|k| keys_name(k, user_id, device_id))
                .cloned(),
            display_name: d
                .get("device_display_name")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
        });
    }
    let key = |name: &str| {
        answer
            .get(name)
            .filter(|k| k.get("user_id").and_then(|v| v.as_str()) == Some(user_id))
            .cloned()
    };
    Ok(Fact::RemoteDeviceListResynced {
        user_id: user_id.to_owned(),
        stream_id,
        devices,
        master_key: key("master_key"),
        self_signing_key: key("self_signing_key"),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_user_devices_answer_keeps_only_keys_that_name_their_user_and_device() {
        let answer = json!({
            "user_id": "@u:remote", "stream_id": 7,
            "devices": [
                { "device_id": "A", "keys": { "user_id": "@u:remote", "device_id": "A" }, "device_display_name": "phone" },
                { "device_id": "B", "keys": { "user_id": "@other:remote", "device_id": "B" } },
                { "keys": {} },
            ],
            "master_key": { "user_id": "@u:remote", "usage": ["master"] },
            "self_signing_key": { "user_id": "@x:remote", "usage": ["self_signing"] },
        });
        let Fact::RemoteDeviceListResynced {
            stream_id,
            devices,
            master_key,
            self_signing_key,
            ..
        } = resynced("@u:remote", &answer).unwrap()
        else {
            panic!("wrong fact");
        };
        assert_eq!(stream_id, 7);
        assert_eq!(
            devices,
            vec![
                RemoteDevice {
                    device_id: "A".into(),
                    keys: Some(json!({ "user_id": "@u:remote", "device_id": "A" })),
                    display_name: Some("phone".into()),
                },
                RemoteDevice {
                    device_id: "B".into(),
                    keys: None,
                    display_name: None,
                },
            ]
        );
        assert_eq!(
            master_key,
            Some(json!({ "user_id": "@u:remote", "usage": ["master"] }))
        );
        assert_eq!(self_signing_key, None);
        assert_eq!(
            resynced("@v:remote", &answer).unwrap_err(),
            "the answer names another user"
        );
    }
}
