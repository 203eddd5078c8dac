//! Push delivery to a push gateway (spec: push gateway API `POST
//! /_matrix/push/v1/notify`, client-server "HTTP pushers"): a test gateway (a small HTTP
//! server in the test) records what the server sends.

mod common;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use common::{Client, TestServer, enc, txn};
use serde_json::{Value, json};

const APP: &str = "org.example.push";

/// A push gateway on loopback that records every notify body; it answers `rejected`
/// with the pushkeys in `reject`.
#[derive(Clone, Default)]
struct Gateway {
    seen: Arc<parking_lot::Mutex<Vec<Value>>>,
    reject: Arc<parking_lot::Mutex<Vec<String>>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Gateway {
    async fn serve_on(&self, listener: tokio::net::TcpListener) -> tokio::task::JoinHandle<()> {
        let g = self.clone();
        let app = axum::Router::new().route(
            "/_matrix/push/v1/notify",
            axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
                let g = g.clone();
                async move {
                    let keys: Vec<String> = body["notification"]["devices"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|d| d["pushkey"].as_str().map(str::to_owned))
                        .collect();
                    let rejected: Vec<String> = {
                        let r = g.reject.lock();
                        keys.into_iter().filter(|k| r.contains(k)).collect()
                    };
                    g.seen.lock().push(body);
                    g.notify.notify_waiters();
                    axum::Json(json!({ "rejected": rejected }))
                }
            }),
        );
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        })
    }

    async fn start() -> (Gateway, String) {
        let g = Gateway::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/_matrix/push/v1/notify",
            listener.local_addr().unwrap()
        );
        g.serve_on(listener).await;
        (g, url)
    }

    /// Waits (at most 10 s) for a notification matching `pred`, returns it.
    async fn wait_for(&self, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = self.seen.lock().iter().find(|v| pred(v)) {
                return v.clone();
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("no matching notification; seen: {:?}", self.seen.lock());
            }
        }
    }

    fn for_event(&self, event_id: &str) -> Vec<Value> {
        self.seen
            .lock()
            .iter()
            .filter(|v| v["notification"]["event_id"] == event_id)
            .cloned()
            .collect()
    }
}

fn pushkey_of(v: &Value) -> &str {
    v["notification"]["devices"][0]["pushkey"]
        .as_str()
        .unwrap_or_default()
}

async fn start_server() -> TestServer {
    TestServer::start_with(|c| {
        c.push.ip_range_allowlist = vec!["127.0.0.1/32".into()];
        c.push.retry_initial_ms = 50;
        c.push.retry_max_ms = 200;
    })
    .await
}

async fn set_pusher(c: &Client, url: &str, pushkey: &str, extra_data: Value) {
    let mut data = json!({ "url": url });
    if let Some(o) = extra_data.as_object() {
        for (k, v) in o {
            data[k] = v.clone();
        }
    }
    c.post(
        "/_matrix/client/v3/pushers/set",
        &json!({
            "kind": "http",
            "app_id": APP,
            "pushkey": pushkey,
            "app_display_name": "Example",
            "device_display_name": "Phone",
            "lang": "en",
            "data": data,
        }),
    )
    .await
    .ok();
}

async fn dm(alice: &Client, bob: &Client) -> String {
    let room = alice
        .create_room(
            json!({ "is_direct": true, "invite": [bob.user_id], "preset": "trusted_private_chat" }),
        )
        .await;
    bob.join(&room).await;
    room
}

async fn send(c: &Client, room: &str, content: Value) -> String {
    c.send_txn(room, "m.room.message", &txn(), &content)
        .await
        .ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dm_message_reaches_the_gateway_with_the_specs_fields() {
    let (gw, url) = Gateway::start().await;
    let ts = start_server().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let before_s = spindle_api::now_ms() / 1000;
    set_pusher(&bob, &url, "key-bob", json!({ "custom": "x" })).await;
    let after_s = spindle_api::now_ms() / 1000 + 1;
    let room = dm(&alice, &bob).await;
    let ev = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "hello" }),
    )
    .await;
    let got = gw.wait_for(|v| v["notification"]["event_id"] == ev).await;
    let ts_s = got["notification"]["devices"][0]["pushkey_ts"]
        .as_u64()
        .expect("pushkey_ts is an integer (seconds)");
    assert!((before_s..=after_s).contains(&ts_s), "{ts_s}");
    assert_eq!(
        got,
        json!({ "notification": {
            "event_id": ev,
            "room_id": room,
            "type": "m.room.message",
            "sender": alice.user_id,
            "sender_display_name": "alice",
            "content": { "msgtype": "m.text", "body": "hello" },
            "counts": { "unread": 1 },
            "prio": "high",
            "devices": [{
                "app_id": APP,
                "pushkey": "key-bob",
                "pushkey_ts": ts_s,
                "data": { "custom": "x" },
                "tweaks": { "sound": "default" },
            }],
        }})
    );
    assert_eq!(gw.for_event(&ev).len(), 1, "delivered once");

    // `format: event_id_only` sends no event details.
    set_pusher(&bob, &url, "key-bob", json!({ "format": "event_id_only" })).await;
    let ev2 = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "secret" }),
    )
    .await;
    let got = gw.wait_for(|v| v["notification"]["event_id"] == ev2).await;
    let n = &got["notification"];
    assert_eq!(n["room_id"], room);
    assert_eq!(n["counts"], json!({ "unread": 1 }));
    for absent in ["content", "sender", "type", "sender_display_name"] {
        assert!(n.get(absent).is_none(), "{absent} in {n}");
    }
    assert_eq!(
        n["devices"][0]["data"],
        json!({ "format": "event_id_only" })
    );

    // A read receipt clearing the room sends a badge-only update.
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
            enc(&room),
            enc(&ev2)
        ),
        &json!({}),
    )
    .await
    .ok();
    let badge = gw
        .wait_for(|v| v["notification"].get("event_id").is_none())
        .await;
    assert_eq!(badge["notification"]["counts"], json!({ "unread": 0 }));
    assert_eq!(pushkey_of(&badge), "key-bob");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mention_is_high_priority_plain_group_message_low() {
    let (gw, url) = Gateway::start().await;
    let ts = start_server().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    set_pusher(&bob, &url, "key-bob", json!({})).await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    carol.join(&room).await;
    let plain = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "hi all" }),
    )
    .await;
    let mention = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "bob: look", "m.mentions": { "user_ids": [bob.user_id] } }),
    )
    .await;
    let got = gw
        .wait_for(|v| v["notification"]["event_id"] == mention)
        .await;
    assert_eq!(got["notification"]["prio"], "high");
    assert_eq!(
        got["notification"]["devices"][0]["tweaks"],
        json!({ "sound": "default", "highlight": true })
    );
    assert_eq!(got["notification"]["counts"], json!({ "unread": 1 }));
    let got = gw
        .wait_for(|v| v["notification"]["event_id"] == plain)
        .await;
    assert_eq!(got["notification"]["prio"], "low");
    assert_eq!(got["notification"]["devices"][0]["tweaks"], json!({}));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn muted_room_and_deleted_or_logged_out_pushers_get_nothing() {
    let (gw, url) = Gateway::start().await;
    let ts = start_server().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    set_pusher(&bob, &url, "key-bob", json!({})).await;
    set_pusher(&carol, &url, "key-carol", json!({})).await;
    let muted = dm(&alice, &bob).await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    carol.join(&room).await;
    // Bob mutes the DM (a room rule with no actions).
    bob.put(
        &format!("/_matrix/client/v3/pushrules/global/room/{}", enc(&muted)),
        &json!({ "actions": [] }),
    )
    .await
    .ok();
    let quiet = send(
        &alice,
        &muted,
        json!({ "msgtype": "m.text", "body": "psst" }),
    )
    .await;
    // Later events reach the gateway; the worker goes in journal order, so once they
    // are there the muted one was decided.
    let sentinel = send(&alice, &room, json!({ "msgtype": "m.text", "body": "one" })).await;
    gw.wait_for(|v| v["notification"]["event_id"] == sentinel && pushkey_of(v) == "key-bob")
        .await;
    assert!(gw.for_event(&quiet).is_empty(), "muted room notified");

    // Bob deletes his pusher: carol still gets the next event, bob does not.
    bob.post(
        "/_matrix/client/v3/pushers/set",
        &json!({ "kind": null, "app_id": APP, "pushkey": "key-bob" }),
    )
    .await
    .ok();
    let ev = send(&alice, &room, json!({ "msgtype": "m.text", "body": "two" })).await;
    gw.wait_for(|v| v["notification"]["event_id"] == ev).await;
    let keys: Vec<String> = gw
        .for_event(&ev)
        .iter()
        .map(|v| pushkey_of(v).to_owned())
        .collect();
    assert_eq!(keys, ["key-carol"]);

    // A pusher set from a device goes with it: logging that device out removes it.
    let carol2 = ts.login("carol", Some("PHONE2")).await;
    set_pusher(&carol2, &url, "key-carol2", json!({})).await;
    assert_eq!(
        carol.get("/_matrix/client/v3/pushers").await.ok()["pushers"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    carol2
        .post("/_matrix/client/v3/logout", &json!({}))
        .await
        .ok();
    let left = carol.get("/_matrix/client/v3/pushers").await.ok();
    let keys: Vec<&str> = left["pushers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pushkey"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["key-carol"]);
    let ev = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "three" }),
    )
    .await;
    gw.wait_for(|v| v["notification"]["event_id"] == ev).await;
    let keys: Vec<String> = gw
        .for_event(&ev)
        .iter()
        .map(|v| pushkey_of(v).to_owned())
        .collect();
    assert_eq!(keys, ["key-carol"]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missed_notification_arrives_once_the_gateway_is_back() {
    // Reserve a port, then leave it closed: the gateway is down.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr: SocketAddr = probe.local_addr().unwrap();
    drop(probe);
    let url = format!("http://{addr}/_matrix/push/v1/notify");
    let ts = start_server().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    set_pusher(&bob, &url, "key-bob", json!({})).await;
    let room = dm(&alice, &bob).await;
    let ev = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "while down" }),
    )
    .await;
    let sender = ts.server.push_sender.clone().expect("push is on");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sender
        .stats
        .failures
        .load(std::sync::atomic::Ordering::Relaxed)
        < 2
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no attempt was made"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        sender
            .stats
            .delivered
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // The gateway comes back on the same address.
    let gw = Gateway::default();
    gw.serve_on(tokio::net::TcpListener::bind(addr).await.unwrap())
        .await;
    let got = gw.wait_for(|v| v["notification"]["event_id"] == ev).await;
    assert_eq!(got["notification"]["content"]["body"], "while down");
    let next = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "after" }),
    )
    .await;
    gw.wait_for(|v| v["notification"]["event_id"] == next).await;
    assert_eq!(gw.for_event(&ev).len(), 1, "delivered once");
    ts.stop().await;
}

/// A closed loopback address (the gateway is down) and its notify URL.
fn down_gateway() -> (SocketAddr, String) {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr: SocketAddr = probe.local_addr().unwrap();
    drop(probe);
    (addr, format!("http://{addr}/_matrix/push/v1/notify"))
}

/// Prunes until the push queue holds `rows` rows (the workers' positions move just
/// after their last send returns); returns how many prunes were journaled.
async fn prune_until(ts: &TestServer, rows: usize) -> usize {
    let sender = ts.server.push_sender.clone().expect("push is on");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut journaled = 0;
    loop {
        if sender.prune_queue().await.unwrap().is_some() {
            journaled += 1;
        }
        if ts.server.projections.push.queue_len() == rows {
            return journaled;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue still holds {} rows",
            ts.server.projections.push.queue_len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The push queue is pruned by the rule in src/push_gateway.rs: rows every reader is
/// past (delivered) go; rows a down gateway still has to deliver stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_rows_leave_the_push_queue_and_undelivered_ones_stay() {
    let (addr, url) = down_gateway();
    let ts = start_server().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    set_pusher(&bob, &url, "key-bob", json!({})).await;
    let room = dm(&alice, &bob).await;
    let one = send(&alice, &room, json!({ "msgtype": "m.text", "body": "1" })).await;
    let two = send(&alice, &room, json!({ "msgtype": "m.text", "body": "2" })).await;
    let sender = ts.server.push_sender.clone().expect("push is on");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sender
        .stats
        .failures
        .load(std::sync::atomic::Ordering::Relaxed)
        < 2
    {
        assert!(tokio::time::Instant::now() < deadline, "no attempt");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let push = &ts.server.projections.push;
    // Bob's rows: the invite and the two messages (his own join notifies nobody),
    // once the push projection applied the last message.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while push.queue_len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} rows",
            push.queue_len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(push.queue_len(), 3);
    // The gateway's worker is stuck before the invite: nothing is done, nothing pruned.
    assert_eq!(sender.prune_queue().await.unwrap(), None);
    assert_eq!(push.queue_len(), 3);
    // Back up: all three are delivered, then pruned.
    let gw = Gateway::default();
    gw.serve_on(tokio::net::TcpListener::bind(addr).await.unwrap())
        .await;
    // (Sent concurrently: either may arrive first.)
    gw.wait_for(|v| v["notification"]["event_id"] == one).await;
    gw.wait_for(|v| v["notification"]["event_id"] == two).await;
    assert!(prune_until(&ts, 0).await >= 1);
    // Nothing left to do: the next prune journals nothing.
    assert_eq!(sender.prune_queue().await.unwrap(), None);
    // A later notification adds one row, gone once delivered.
    let three = send(&alice, &room, json!({ "msgtype": "m.text", "body": "3" })).await;
    gw.wait_for(|v| v["notification"]["event_id"] == three)
        .await;
    assert!(push.queue_len() <= 1);
    prune_until(&ts, 0).await;
    assert_eq!(gw.for_event(&one).len(), 1);
    assert_eq!(gw.for_event(&three).len(), 1);
    ts.stop().await;
}

/// A notification dropped past `max_notification_age_ms` (its gateway never came back)
/// leaves the queue too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_leave_the_push_queue() {
    let (_addr, url) = down_gateway();
    let ts = TestServer::start_with(|c| {
        c.push.ip_range_allowlist = vec!["127.0.0.1/32".into()];
        c.push.retry_initial_ms = 50;
        c.push.retry_max_ms = 100;
        c.push.max_notification_age_ms = 500;
    })
    .await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    set_pusher(&bob, &url, "key-bob", json!({})).await;
    let room = dm(&alice, &bob).await;
    send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "lost" }),
    )
    .await;
    let sender = ts.server.push_sender.clone().expect("push is on");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sender
        .stats
        .dropped
        .load(std::sync::atomic::Ordering::Relaxed)
        < 2
    {
        assert!(tokio::time::Instant::now() < deadline, "never dropped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        sender
            .stats
            .delivered
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    prune_until(&ts, 0).await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_pushkey_removes_the_pusher() {
    let (gw, url) = Gateway::start().await;
    gw.reject.lock().push("key-dead".into());
    let ts = start_server().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    set_pusher(&bob, &url, "key-dead", json!({})).await;
    // The invite to the DM is the first notification; the gateway rejects the key.
    let _room = dm(&alice, &bob).await;
    let first = gw.wait_for(|v| pushkey_of(v) == "key-dead").await;
    assert_eq!(first["notification"]["type"], "m.room.member");
    assert_eq!(first["notification"]["user_is_target"], true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let p = bob.get("/_matrix/client/v3/pushers").await.ok();
        if p["pushers"] == json!([]) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pusher still there: {p}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_loopback_is_refused_unless_allowed() {
    let (gw, url) = Gateway::start().await;
    let ts = TestServer::start().await; // default denylist: loopback denied
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    set_pusher(&bob, &url, "key-bob", json!({})).await;
    let room = dm(&alice, &bob).await;
    send(&alice, &room, json!({ "msgtype": "m.text", "body": "x" })).await;
    let sender = ts.server.push_sender.clone().expect("push is on");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sender
        .stats
        .dropped
        .load(std::sync::atomic::Ordering::Relaxed)
        < 1
    {
        assert!(tokio::time::Instant::now() < deadline, "not refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gw.seen.lock().is_empty());
    ts.stop().await;
}

/// The "Measure": a ring (one message) in a room of N pushered members, time
/// from the sender's `PUT` returning to the first and the last phone's notification at
/// one gateway, p50/p99 over 20 rings. Not a test (no assertion on time); run with
/// `cargo test --test push_delivery ring_latency -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn ring_latency_by_room_size() {
    let (gw, url) = Gateway::start().await;
    let ts = TestServer::start_with(|c| {
        c.push.ip_range_allowlist = vec!["127.0.0.1/32".into()];
        c.password_hashing.m_cost_kib = 64;
        c.password_hashing.t_cost = 1;
    })
    .await;
    let alice = ts.register("alice").await;
    let mut members = 0;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    for n in [10usize, 100, 1000] {
        while members < n {
            let c = ts.register(&format!("m{members}")).await;
            set_pusher(&c, &url, &format!("key-{members}"), json!({})).await;
            c.join(&room).await;
            members += 1;
        }
        // Let the joins' notifications drain before timing.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut first = Vec::new();
        let mut last = Vec::new();
        for _ in 0..20 {
            let ev = send(
                &alice,
                &room,
                json!({ "msgtype": "m.text", "body": "ring" }),
            )
            .await;
            let t0 = std::time::Instant::now();
            let mut t_first = None;
            loop {
                let notified = gw.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let got = gw.for_event(&ev).len();
                if got > 0 && t_first.is_none() {
                    t_first = Some(t0.elapsed());
                }
                if got >= n {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_secs(30), notified).await;
            }
            first.push(t_first.unwrap().as_secs_f64() * 1000.0);
            last.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
        let pct = |v: &mut Vec<f64>, p: f64| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[((v.len() as f64 - 1.0) * p).round() as usize]
        };
        println!(
            "ring n={n}: first p50 {:.1} ms p99 {:.1} ms; last p50 {:.1} ms p99 {:.1} ms",
            pct(&mut first, 0.5),
            pct(&mut first, 0.99),
            pct(&mut last, 0.5),
            pct(&mut last, 0.99)
        );
    }
    ts.stop().await;
}
