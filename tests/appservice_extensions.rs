//! Application-service extensions beyond the spec's transactions (issue 16 item 3):
//! the `/thirdparty/*` endpoints proxied to the application services that declare the
//! protocol, `unsigned.invite_room_state` on invites pushed to an application service,
//! MSC3202 device lists / one-time key counts / unused fallback key types, and
//! presence in MSC2409 ephemeral data. The application services are small HTTP
//! servers in the test.

mod common;

use std::{sync::Arc, time::Duration};

use common::{Client, TestServer, enc, uid};
use serde_json::{Value, json};

/// A test application service: records transactions and third-party queries, and
/// answers third-party requests from fixed data tagged with its `network`.
#[derive(Clone)]
struct Service {
    network: &'static str,
    /// Every transaction body, in arrival order.
    txns: Arc<parking_lot::Mutex<Vec<Value>>>,
    /// Every third-party request: (path, query string).
    queries: Arc<parking_lot::Mutex<Vec<(String, String)>>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Service {
    async fn start(network: &'static str) -> (Service, String) {
        let s = Service {
            network,
            txns: Arc::default(),
            queries: Arc::default(),
            notify: Arc::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (t, q) = (s.clone(), s.clone());
        let app = axum::Router::new()
            .route(
                "/_matrix/app/v1/transactions/{txn}",
                axum::routing::put(move |axum::Json(body): axum::Json<Value>| {
                    let s = t.clone();
                    async move {
                        s.txns.lock().push(body);
                        s.notify.notify_waiters();
                        axum::Json(json!({}))
                    }
                }),
            )
            .fallback(move |uri: axum::http::Uri| {
                let s = q.clone();
                async move {
                    let path = uri.path().to_owned();
                    let query = uri.query().unwrap_or("").to_owned();
                    s.queries.lock().push((path.clone(), query));
                    match s.answer(&path) {
                        Some(v) => (axum::http::StatusCode::OK, axum::Json(v)),
                        None => (
                            axum::http::StatusCode::NOT_FOUND,
                            axum::Json(json!({ "errcode": "M_NOT_FOUND", "error": "no" })),
                        ),
                    }
                }
            });
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        (s, url)
    }

    fn answer(&self, path: &str) -> Option<Value> {
        let n = self.network;
        let p = "/_matrix/app/v1/thirdparty";
        if path == format!("{p}/protocol/chat") {
            return Some(json!({
                "user_fields": ["name"],
                "location_fields": ["room"],
                "icon": "mxc://example.org/chat",
                "field_types": {
                    "name": { "regexp": ".*", "placeholder": "nick" },
                    "room": { "regexp": "#.*", "placeholder": "#room" },
                },
                "instances": [{
                    "desc": format!("Network {n}"),
                    "fields": { "network": n },
                    "network_id": n,
                }],
            }));
        }
        if path == format!("{p}/location/chat") || path == format!("{p}/location") {
            return Some(json!([
                { "alias": format!("#chat_{n}:localhost:8008"), "protocol": "chat", "fields": { "network": n } },
                // No `fields`: dropped.
                { "alias": "#broken:localhost:8008", "protocol": "chat" },
            ]));
        }
        if path == format!("{p}/user/chat") || path == format!("{p}/user") {
            return Some(json!([
                { "userid": format!("@chat_{n}:localhost:8008"), "protocol": "chat", "fields": { "network": n } },
                // `userid` not a string: dropped.
                { "userid": 7, "protocol": "chat", "fields": {} },
            ]));
        }
        None
    }

    /// Waits (at most 10 s) for a transaction matching `pred`; returns it.
    async fn wait_txn(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(t) = self.txns.lock().iter().find(|t| pred(t)) {
                return t.clone();
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("{what}: transactions {:?}", self.txns.lock());
            }
        }
    }
}

fn registration(id: &str, url: &str, token: &str, extra: &str) -> String {
    format!(
        r#"id: {id}
url: "{url}"
as_token: "as-{token}"
hs_token: "hs-{token}"
sender_localpart: {id}bot
rate_limited: false
{extra}
namespaces:
  users:
    - exclusive: true
      regex: '@{id}_.*:localhost:8008'
  aliases: []
  rooms: []
"#
    )
}

async fn start(regs: &[String]) -> (TestServer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (i, r) in regs.iter().enumerate() {
        let path = dir.path().join(format!("reg{i}.yaml"));
        std::fs::write(&path, r).unwrap();
        files.push(path);
    }
    let server = TestServer::start_with(|c| {
        c.appservices.registration_files = files;
        c.appservices.ip_range_allowlist = vec!["127.0.0.1/32".into()];
        c.appservices.retry_initial_ms = 50;
        c.appservices.retry_max_ms = 200;
    })
    .await;
    (server, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirdparty_endpoints_are_proxied_to_the_declaring_application_services() {
    let (one, url_one) = Service::start("one").await;
    let (two, url_two) = Service::start("two").await;
    let (_other, url_other) = Service::start("other").await;
    let (ts, _dir) = start(&[
        registration("alpha", &url_one, "a", "protocols: [chat]"),
        registration("beta", &url_two, "b", "protocols: [chat]"),
        // Declares no protocol: never asked.
        registration("gamma", &url_other, "c", ""),
    ])
    .await;
    let alice = ts.register("alice").await;
    let tp = "/_matrix/client/v3/thirdparty";
    let protocol = json!({
        "user_fields": ["name"],
        "location_fields": ["room"],
        "icon": "mxc://example.org/chat",
        "field_types": {
            "name": { "regexp": ".*", "placeholder": "nick" },
            "room": { "regexp": "#.*", "placeholder": "#room" },
        },
        "instances": [
            { "desc": "Network one", "fields": { "network": "one" }, "network_id": "one", "instance_id": "alpha|one" },
            { "desc": "Network two", "fields": { "network": "two" }, "network_id": "two", "instance_id": "beta|two" },
        ],
    });
    assert_eq!(
        alice.get(&format!("{tp}/protocols")).await.ok(),
        json!({ "chat": protocol })
    );
    assert_eq!(
        alice.get(&format!("{tp}/protocol/chat")).await.ok(),
        protocol
    );
    alice
        .get(&format!("{tp}/protocol/other"))
        .await
        .expect_err(404, "M_NOT_FOUND");

    // Lookups by protocol: both services asked with the client's fields, the valid
    // entries concatenated in registration order.
    let locations = alice
        .get(&format!("{tp}/location/chat?room=%23lobby&server=x"))
        .await
        .ok();
    assert_eq!(
        locations,
        json!([
            { "alias": "#chat_one:localhost:8008", "protocol": "chat", "fields": { "network": "one" } },
            { "alias": "#chat_two:localhost:8008", "protocol": "chat", "fields": { "network": "two" } },
        ])
    );
    let users = alice.get(&format!("{tp}/user/chat?name=bob")).await.ok();
    assert_eq!(
        users,
        json!([
            { "userid": "@chat_one:localhost:8008", "protocol": "chat", "fields": { "network": "one" } },
            { "userid": "@chat_two:localhost:8008", "protocol": "chat", "fields": { "network": "two" } },
        ])
    );
    alice
        .get(&format!("{tp}/location/other?room=x"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Reverse lookups.
    let by_alias = alice
        .get(&format!(
            "{tp}/location?alias={}",
            enc("#chat_one:localhost:8008")
        ))
        .await
        .ok();
    assert_eq!(by_alias.as_array().unwrap().len(), 2);
    assert_eq!(by_alias[0]["alias"], "#chat_one:localhost:8008");
    let by_user = alice
        .get(&format!(
            "{tp}/user?userid={}",
            enc("@chat_two:localhost:8008")
        ))
        .await
        .ok();
    assert_eq!(by_user[1]["userid"], "@chat_two:localhost:8008");

    let seen = one.queries.lock().clone();
    assert_eq!(
        seen,
        vec![
            (
                "/_matrix/app/v1/thirdparty/protocol/chat".to_owned(),
                String::new()
            ),
            (
                "/_matrix/app/v1/thirdparty/protocol/chat".to_owned(),
                String::new()
            ),
            (
                "/_matrix/app/v1/thirdparty/location/chat".to_owned(),
                "room=%23lobby&server=x".to_owned()
            ),
            (
                "/_matrix/app/v1/thirdparty/user/chat".to_owned(),
                "name=bob".to_owned()
            ),
            (
                "/_matrix/app/v1/thirdparty/location".to_owned(),
                "alias=%23chat_one%3Alocalhost%3A8008".to_owned()
            ),
            (
                "/_matrix/app/v1/thirdparty/user".to_owned(),
                "userid=%40chat_two%3Alocalhost%3A8008".to_owned()
            ),
        ]
    );
    assert_eq!(two.queries.lock().len(), 6);
    assert!(_other.queries.lock().is_empty());
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invites_carry_invite_room_state_and_msc3202_and_presence_reach_the_service() {
    let (svc, url) = Service::start("n").await;
    let (ts, _dir) = start(&[registration(
        "br",
        &url,
        "br",
        "receive_ephemeral: true\norg.matrix.msc3202: true",
    )])
    .await;
    let alice = ts.register("alice").await;
    // The application service registers its user (with a device and token).
    let reg = ts
        .anon()
        .with_token(Some("as-br"))
        .post(
            "/_matrix/client/v3/register",
            &json!({ "type": "m.login.application_service", "username": "br_bob" }),
        )
        .await
        .ok();
    let bob = Client {
        token: reg["access_token"].as_str().map(str::to_owned),
        user_id: reg["user_id"].as_str().unwrap().to_owned(),
        device_id: reg["device_id"].as_str().unwrap().to_owned(),
        ..ts.anon()
    };
    assert_eq!(bob.user_id, uid("br_bob"));
    let room = alice
        .create_room(json!({ "name": "Bridged", "preset": "private_chat" }))
        .await;
    alice.invite(&room, &bob.user_id).await;

    // The invite, with the stripped state the invitee sees.
    let txn = svc
        .wait_txn("invite", |t| {
            t["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["type"] == "m.room.member" && e["content"]["membership"] == "invite")
        })
        .await;
    let invite = txn["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["content"]["membership"] == "invite")
        .unwrap()
        .clone();
    assert_eq!(invite["state_key"], json!(bob.user_id));
    let state = invite["unsigned"]["invite_room_state"].as_array().unwrap();
    let kinds: Vec<(String, String)> = state
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_owned(),
                e["state_key"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("m.room.create".to_owned(), String::new()),
            ("m.room.join_rules".to_owned(), String::new()),
            ("m.room.name".to_owned(), String::new()),
            ("m.room.member".to_owned(), alice.user_id.clone()),
        ]
    );
    assert_eq!(state[2]["content"], json!({ "name": "Bridged" }));
    assert_eq!(state[2]["sender"], json!(alice.user_id));
    assert_eq!(state[3]["content"]["membership"], "join");

    bob.join(&room).await;
    // Bob joining a room of interest: he newly shares it (`changed`).
    // (The transaction with his join event: an earlier one may name him already, and
    // waiting for that one let alice's key upload below share his join's transaction.)
    svc.wait_txn("bob's join", |t| {
        let joined = t["events"].as_array().is_some_and(|evs| {
            evs.iter().any(|e| {
                e["state_key"] == json!(bob.user_id) && e["content"]["membership"] == "join"
            })
        });
        joined
            && t["org.matrix.msc3202.device_lists"]["changed"]
                .as_array()
                .is_some_and(|c| c.contains(&json!(bob.user_id)))
    })
    .await;

    // Alice's device keys change: `changed` names her (she shares the room).
    let (keys, _) = common::device_keys(&alice);
    alice
        .post(
            "/_matrix/client/v3/keys/upload",
            &json!({ "device_keys": keys }),
        )
        .await
        .ok();
    let txn = svc
        .wait_txn("alice's keys", |t| {
            t["org.matrix.msc3202.device_lists"]["changed"] == json!([alice.user_id])
        })
        .await;
    assert_eq!(txn["org.matrix.msc3202.device_lists"]["left"], json!([]));

    // Bob's device gets two one-time keys and a fallback key; the next transaction
    // (alice's message) carries the counts and the unused fallback type.
    let (_, bob_key) = common::device_keys(&bob);
    let otks: serde_json::Map<String, Value> = (0..2)
        .map(|i| {
            (
                format!("signed_curve25519:B{i}"),
                bob_key.sign(&bob.user_id, json!({ "key": format!("otk-{i}") })),
            )
        })
        .collect();
    let fallback = bob_key.sign(&bob.user_id, json!({ "key": "fb", "fallback": true }));
    bob.post(
        "/_matrix/client/v3/keys/upload",
        &json!({ "one_time_keys": otks, "fallback_keys": { "signed_curve25519:F": fallback } }),
    )
    .await
    .ok();
    let msg = alice.send_text(&room, "hello bridge").await;
    let txn = svc
        .wait_txn("the message", |t| {
            t["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["event_id"] == json!(msg))
        })
        .await;
    let counts = &txn["org.matrix.msc3202.device_one_time_keys_count"];
    assert_eq!(
        counts[&bob.user_id],
        json!({ bob.device_id.clone(): { "signed_curve25519": 2 } })
    );
    assert_eq!(
        txn["org.matrix.msc3202.device_one_time_key_counts"],
        *counts
    );
    assert_eq!(
        txn["org.matrix.msc3202.device_unused_fallback_key_types"][&bob.user_id],
        json!({ bob.device_id.clone(): ["signed_curve25519"] })
    );
    // Alice is not the application service's: her counts are not sent.
    assert!(counts.get(&alice.user_id).is_none(), "{counts}");

    // Presence of a user sharing a room with the service's users, as MSC2409 data.
    alice
        .put(
            &format!("/_matrix/client/v3/presence/{}/status", enc(&alice.user_id)),
            &json!({ "presence": "online", "status_msg": "bridging" }),
        )
        .await
        .ok();
    let txn = svc
        .wait_txn("presence", |t| {
            t["ephemeral"]
                .as_array()
                .is_some_and(|e| e.iter().any(|e| e["type"] == "m.presence"))
        })
        .await;
    let p: Vec<&Value> = txn["ephemeral"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.presence")
        .collect();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0]["sender"], json!(alice.user_id));
    assert_eq!(p[0]["content"]["presence"], "online");
    assert_eq!(p[0]["content"]["status_msg"], "bridging");
    assert_eq!(p[0]["content"]["currently_active"], true);

    // Alice leaves: she shares no room with the service's users any more (`left`).
    alice.leave(&room).await;
    let txn = svc
        .wait_txn("alice leaving", |t| {
            t["org.matrix.msc3202.device_lists"]["left"] == json!([alice.user_id])
        })
        .await;
    assert_eq!(txn["org.matrix.msc3202.device_lists"]["changed"], json!([]));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_msc3202_no_device_data_is_sent() {
    let (svc, url) = Service::start("n").await;
    let (ts, _dir) = start(&[registration("pl", &url, "pl", "")]).await;
    let alice = ts.register("alice").await;
    ts.anon()
        .with_token(Some("as-pl"))
        .post(
            "/_matrix/client/v3/register",
            &json!({ "type": "m.login.application_service", "username": "pl_bob" }),
        )
        .await
        .ok();
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    alice.invite(&room, &uid("pl_bob")).await;
    let (keys, _) = common::device_keys(&alice);
    alice
        .post(
            "/_matrix/client/v3/keys/upload",
            &json!({ "device_keys": keys }),
        )
        .await
        .ok();
    let msg = alice.send_text(&room, "x").await;
    // The message is not the service's (pl_bob is only invited): the invite is.
    let txn = svc
        .wait_txn("invite", |t| {
            t["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["content"]["membership"] == "invite")
        })
        .await;
    let _ = msg;
    for t in svc.txns.lock().iter().chain(std::iter::once(&txn)) {
        let keys: Vec<&String> = t.as_object().unwrap().keys().collect();
        assert!(
            keys.iter().all(|k| !k.starts_with("org.matrix.msc3202")),
            "{t}"
        );
    }
    ts.stop().await;
}
