//! Delayed events (MSC4140): scheduling with `?org.matrix.msc4140.delay`, the list,
//! `restart`/`cancel`/`send` (body `action` and the per-action paths), firing at the
//! deadline (never before: asserted on the server's own timestamps, not on wall-clock
//! speed), cancellation by someone else's state, the idle-tick counting guard, and a
//! pending delay surviving a real restart of the binary.

mod common;

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use common::{Client, TestServer, enc, txn};
use serde_json::{Value, json};

const DE: &str = "/_matrix/client/unstable/org.matrix.msc4140/delayed_events";

async fn start() -> TestServer {
    TestServer::start_with(|c| {
        c.delayed_events.max_event_delay_duration_ms = 600_000;
        c.delayed_events.max_scheduled_per_user = 1_000;
    })
    .await
}

async fn schedule_message(c: &Client, room: &str, body: &str, delay_ms: u64) -> String {
    let v = c
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/{}?org.matrix.msc4140.delay={delay_ms}",
                enc(room),
                txn()
            ),
            &json!({ "msgtype": "m.text", "body": body }),
        )
        .await
        .ok();
    assert!(v.get("event_id").is_none(), "{v}");
    v["delay_id"].as_str().expect("delay_id").to_owned()
}

async fn schedule_state(
    c: &Client,
    room: &str,
    kind: &str,
    content: Value,
    delay_ms: u64,
) -> String {
    let v = c
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/state/{}/?org.matrix.msc4140.delay={delay_ms}",
                enc(room),
                enc(kind)
            ),
            &content,
        )
        .await
        .ok();
    v["delay_id"].as_str().expect("delay_id").to_owned()
}

async fn list(c: &Client) -> Vec<Value> {
    c.get(DE).await.ok()["delayed_events"]
        .as_array()
        .unwrap()
        .clone()
}

/// The room's messages with `body`, oldest first.
async fn with_body(c: &Client, room: &str, body: &str) -> Vec<Value> {
    let page = c.messages(room, "dir=b&limit=100").await;
    let mut out: Vec<Value> = page["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["content"]["body"] == body)
        .cloned()
        .collect();
    out.reverse();
    out
}

/// Waits (at most 20 s) until a message with `body` is in the room.
async fn wait_for_body(c: &Client, room: &str, body: &str) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(e) = with_body(c, room, body).await.into_iter().next() {
            return e;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{body:?} was never sent"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (at most 20 s) until the delay is finalised (its `DelayedEventSent` fact is
/// appended just after the event), returns `GET .../{delay_id}`.
async fn wait_finalised(c: &Client, id: &str) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let d = c.get(&format!("{DE}/{id}")).await.ok();
        if d.get("origin_server_ts").is_some() {
            return d;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} never finalised: {d}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fires_at_its_deadline_and_not_before() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let id = schedule_message(&alice, &room, "bye", 1_500).await;
    let pending = list(&alice).await;
    assert_eq!(pending.len(), 1);
    let since = pending[0]["running_since"].as_u64().unwrap();
    assert_eq!(
        pending[0],
        json!({
            "delay_id": id,
            "room_id": room,
            "type": "m.room.message",
            "delay": 1500,
            "running_since": since,
            "content": { "msgtype": "m.text", "body": "bye" },
        })
    );
    assert!(
        with_body(&alice, &room, "bye").await.is_empty(),
        "sent early"
    );
    let ev = wait_for_body(&alice, &room, "bye").await;
    let sent_at = ev["origin_server_ts"].as_u64().unwrap();
    assert!(
        sent_at >= since + 1_500,
        "sent at {sent_at}, due {}",
        since + 1_500
    );
    assert_eq!(ev["sender"], alice.user_id);
    let one = wait_finalised(&alice, &id).await;
    assert_eq!(one["event_id"], ev["event_id"]);
    assert!(list(&alice).await.is_empty());
    assert!(one["origin_server_ts"].as_u64().unwrap() >= sent_at);
    // Exactly one event, and `send` on a sent delay is a successful no-op.
    alice
        .post(&format!("{DE}/{id}/send"), &json!({}))
        .await
        .ok();
    assert_eq!(with_body(&alice, &room, "bye").await.len(), 1);
    alice
        .post(&format!("{DE}/{id}/cancel"), &json!({}))
        .await
        .expect_err(409, "M_UNKNOWN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_pushes_the_deadline_back() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let id = schedule_message(&alice, &room, "later", 1_000).await;
    let first = list(&alice).await[0]["running_since"].as_u64().unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The per-action path needs no access token: the delay id is the capability.
    ts.anon()
        .post(&format!("{DE}/{id}/restart"), &json!({}))
        .await
        .ok();
    let restarted = list(&alice).await[0]["running_since"].as_u64().unwrap();
    assert!(restarted >= first + 400, "{first} -> {restarted}");
    let ev = wait_for_body(&alice, &room, "later").await;
    let sent_at = ev["origin_server_ts"].as_u64().unwrap();
    assert!(
        sent_at >= restarted + 1_000,
        "sent at {sent_at}, restarted at {restarted}"
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_prevents_it() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({})).await;
    let id = schedule_message(&alice, &room, "never", 300).await;
    // Another user cannot act on it through the authenticated form.
    bob.post(&format!("{DE}/{id}"), &json!({ "action": "cancel" }))
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .post(&format!("{DE}/{id}"), &json!({ "action": "cancel" }))
        .await
        .ok();
    assert!(list(&alice).await.is_empty());
    // A later delay fires: by then the cancelled one would have.
    schedule_message(&alice, &room, "sentinel", 600).await;
    wait_for_body(&alice, &room, "sentinel").await;
    assert!(with_body(&alice, &room, "never").await.is_empty());
    // Cancelling again succeeds; sending or restarting a cancelled delay conflicts.
    alice
        .post(&format!("{DE}/{id}/cancel"), &json!({}))
        .await
        .ok();
    for action in ["send", "restart"] {
        alice
            .post(&format!("{DE}/{id}/{action}"), &json!({}))
            .await
            .expect_err(409, "M_UNKNOWN");
    }
    alice
        .post(&format!("{DE}/{id}/explode"), &json!({}))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(&format!("{DE}/nope/send"), &json!({}))
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_fires_it_now() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let id = schedule_state(
        &alice,
        &room,
        "org.example.status",
        json!({ "v": "gone" }),
        600_000,
    )
    .await;
    let path = format!(
        "/_matrix/client/v3/rooms/{}/state/org.example.status",
        enc(&room)
    );
    alice.get(&path).await.expect_err(404, "M_NOT_FOUND");
    alice
        .post(&format!("{DE}/{id}"), &json!({ "action": "send" }))
        .await
        .ok();
    assert_eq!(alice.get(&path).await.ok(), json!({ "v": "gone" }));
    assert!(list(&alice).await.is_empty());
    let one = alice.get(&format!("{DE}/{id}")).await.ok();
    assert_eq!(one["state_key"], "");
    assert!(one["event_id"].as_str().unwrap().starts_with('$'));
    ts.stop().await;
}

/// MSC4140 "`delay_id` in `unsigned` event data": the sender, on any of its devices,
/// sees `unsigned.org.matrix.msc4140.delay_id` on the fired event (and no
/// `transaction_id`: the client never chose one for it); another member sees neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fired_event_carries_its_delay_id_for_the_sender_only() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let id = schedule_message(&alice, &room, "fired", 600_000).await;
    alice
        .post(&format!("{DE}/{id}/send"), &json!({}))
        .await
        .ok();
    let ev = wait_for_body(&alice, &room, "fired").await;
    assert_eq!(ev["unsigned"]["org.matrix.msc4140.delay_id"], json!(id));
    assert!(ev["unsigned"].get("transaction_id").is_none(), "{ev}");
    let event_id = ev["event_id"].as_str().unwrap().to_owned();
    // The same through /event and /sync, and on the sender's other device.
    let one = alice.event(&room, &event_id).await.ok();
    assert_eq!(one["unsigned"]["org.matrix.msc4140.delay_id"], json!(id));
    let other = ts.login("alice", Some("OTHER")).await;
    let sync = other.sync("").await;
    let synced: Vec<&Value> = sync["rooms"]["join"][&room]["timeline"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event_id"] == json!(event_id))
        .collect();
    assert_eq!(synced.len(), 1);
    assert_eq!(
        synced[0]["unsigned"]["org.matrix.msc4140.delay_id"],
        json!(id)
    );
    // Not for anyone else.
    let seen = wait_for_body(&bob, &room, "fired").await;
    assert_eq!(seen["event_id"], json!(event_id));
    assert!(
        seen["unsigned"]
            .get("org.matrix.msc4140.delay_id")
            .is_none(),
        "{seen}"
    );
    let theirs = bob.event(&room, &event_id).await.ok();
    assert!(
        theirs["unsigned"]
            .get("org.matrix.msc4140.delay_id")
            .is_none()
    );
    // An ordinary message keeps its transaction id and has no delay id.
    let plain = alice.send_text(&room, "plain").await;
    let mine = alice.event(&room, &plain).await.ok();
    assert!(mine["unsigned"]["transaction_id"].is_string(), "{mine}");
    assert!(
        mine["unsigned"]
            .get("org.matrix.msc4140.delay_id")
            .is_none()
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn someone_else_setting_the_state_first_cancels_it() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({
            "preset": "public_chat",
            "power_level_content_override": { "users": { alice.user_id.clone(): 100, bob.user_id.clone(): 100 } },
        }))
        .await;
    bob.join(&room).await;
    let id = schedule_state(
        &alice,
        &room,
        "org.example.status",
        json!({ "v": "alice" }),
        800,
    )
    .await;
    let keep = schedule_state(
        &alice,
        &room,
        "org.example.other",
        json!({ "v": "kept" }),
        600_000,
    )
    .await;
    bob.put_state(&room, "org.example.status", "", json!({ "v": "bob" }))
        .await;
    let pending: Vec<String> = list(&alice)
        .await
        .iter()
        .map(|d| d["delay_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(pending, [keep]);
    schedule_message(&alice, &room, "sentinel", 1_200).await;
    wait_for_body(&alice, &room, "sentinel").await;
    let path = format!(
        "/_matrix/client/v3/rooms/{}/state/org.example.status",
        enc(&room)
    );
    assert_eq!(alice.get(&path).await.ok(), json!({ "v": "bob" }));
    alice
        .post(&format!("{DE}/{id}/send"), &json!({}))
        .await
        .expect_err(409, "M_UNKNOWN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_the_unstable_feature_flag() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let v = ts.anon().get("/_matrix/client/versions").await.ok();
    assert_eq!(v["unstable_features"]["org.matrix.msc4140"], true);
    let r = alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/{}?org.matrix.msc4140.delay=600001",
                enc(&room),
                txn()
            ),
            &json!({ "body": "x" }),
        )
        .await;
    r.expect_err(400, "M_MAX_DELAY_EXCEEDED");
    assert_eq!(r.body["max_delay"], 600_000);
    alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/{}?org.matrix.msc4140.delay=soon",
                enc(&room),
                txn()
            ),
            &json!({ "body": "x" }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;

    // Off by default: not advertised, and the parameter is ignored (as Synapse).
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let v = ts.anon().get("/_matrix/client/versions").await.ok();
    assert_eq!(v["unstable_features"]["org.matrix.msc4140"], false);
    let sent = alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/{}?org.matrix.msc4140.delay=1000",
                enc(&room),
                txn()
            ),
            &json!({ "body": "now" }),
        )
        .await
        .ok();
    assert!(sent["event_id"].as_str().unwrap().starts_with('$'));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tick_with_200_pending_delays_reads_no_row() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    for i in 0..200 {
        schedule_message(&alice, &room, &format!("m{i}"), 300_000 + i).await;
    }
    assert_eq!(list(&alice).await.len(), 200);
    let stats = ts.server.projections.db.stats().clone();
    let now = spindle_api::now_ms();
    let before = stats.total();
    for k in 0..10 {
        assert_eq!(
            spindle_api::delayed::tick(&ts.server.state, now + k * 1_000).await,
            0
        );
    }
    assert_eq!(stats.total() - before, 0, "an idle tick read store rows");
    // When the first is due, a tick reads that one (its heap row, its record) and
    // one row to learn the next deadline, not the 199 others.
    let d = &ts.server.projections.delayed;
    let before = stats.total();
    let due = d.due(d.next_due(), 1_000);
    assert_eq!(due.len(), 1);
    assert_eq!(stats.total() - before, 2, "one heap row + one delay row");
    ts.stop().await;
}

/// The id of the event a finalised delay sent.
async fn event_of(c: &Client, id: &str) -> String {
    c.get(&format!("{DE}/{id}")).await.ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The deadlines of the user's scheduled delays, by delay id.
async fn deadlines(c: &Client) -> std::collections::HashMap<String, u64> {
    list(c)
        .await
        .iter()
        .map(|d| {
            (
                d["delay_id"].as_str().unwrap().to_owned(),
                d["running_since"].as_u64().unwrap() + d["delay"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn fsyncs(ts: &TestServer) -> u64 {
    ts.server
        .journal
        .stats()
        .fsyncs
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// The loss in docs/benchmarks.md (1,000 delays due within 2 s fired up to 9.5 s late):
/// the worker appended each due event and its `DelayedEventSent` fact as separate
/// commands, each waiting for its own fsync (80 fsyncs for 40 due delays). One tick now
/// fires everything due as one journal run of events and one of their outcomes: two
/// fsyncs, whatever the number due (up to the per-tick bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_delays_due_at_once_fire_in_one_tick_with_two_fsyncs() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    // Far off, so the worker never fires them: the test's tick does, at their deadline.
    let mut ids = Vec::new();
    for i in 0..40u64 {
        ids.push(schedule_message(&alice, &room, &format!("m{i}"), 500_000 + i).await);
    }
    let due = deadlines(&alice).await;
    let last = ids.iter().map(|id| due[id]).max().unwrap();
    // Scheduled in this order, each a millisecond later: due in this order.
    let mut by_deadline = ids.clone();
    by_deadline.sort_by_key(|id| (due[id], id.clone()));
    assert_eq!(by_deadline, ids);

    let before = fsyncs(&ts);
    assert_eq!(spindle_api::delayed::tick(&ts.server.state, last).await, 40);
    assert_eq!(
        fsyncs(&ts) - before,
        2,
        "one run of events, one of outcomes"
    );
    assert!(list(&alice).await.is_empty());

    // In the room, in deadline order, each the event its delay names, as alice.
    let page = alice.messages(&room, "dir=b&limit=100").await;
    let mut fired: Vec<Value> = page["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.message")
        .cloned()
        .collect();
    fired.reverse();
    let bodies: Vec<&str> = fired
        .iter()
        .map(|e| e["content"]["body"].as_str().unwrap())
        .collect();
    let expected: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
    assert_eq!(bodies, expected);
    for (ev, id) in fired.iter().zip(&ids) {
        let d = alice.get(&format!("{DE}/{id}")).await.ok();
        assert_eq!(d["event_id"], ev["event_id"], "{id}");
        assert_eq!(ev["sender"], alice.user_id);
        assert_eq!(ev["unsigned"]["org.matrix.msc4140.delay_id"], json!(id));
        assert_eq!(
            ev["content"],
            json!({ "msgtype": "m.text", "body": ev["content"]["body"] })
        );
    }
    // Nothing left to fire, and nothing written for it.
    let before = fsyncs(&ts);
    assert_eq!(spindle_api::delayed::tick(&ts.server.state, last).await, 0);
    assert_eq!(fsyncs(&ts) - before, 0);
    ts.stop().await;
}

/// Delayed state events for one (room, type, state key) due in the same tick: a run
/// holds one of them, the earliest; the next tick sees what it did. Bob's, due after
/// alice's first, is cancelled by it (someone else set the state first) and never
/// sent; alice's second, same sender, fires after her first and ends as the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_state_events_for_one_slot_due_in_one_tick_fire_as_if_one_at_a_time() {
    let ts = start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({
            "preset": "public_chat",
            "power_level_content_override": { "users": { alice.user_id.clone(): 100, bob.user_id.clone(): 100 } },
        }))
        .await;
    bob.join(&room).await;
    let status = "org.example.status";
    let first = schedule_state(&alice, &room, status, json!({ "v": "alice" }), 500_000).await;
    let other = schedule_state(
        &alice,
        &room,
        "org.example.other",
        json!({ "v": "o" }),
        500_001,
    )
    .await;
    let bobs = schedule_state(&bob, &room, status, json!({ "v": "bob" }), 500_002).await;
    let second = schedule_state(&alice, &room, status, json!({ "v": "alice2" }), 500_003).await;
    let mut due = deadlines(&alice).await;
    due.extend(deadlines(&bob).await);
    let now = *due.values().max().unwrap();
    assert!(due[&first] < due[&other] && due[&other] < due[&bobs] && due[&bobs] < due[&second]);

    let before = fsyncs(&ts);
    // alice's first status and her other slot; bob's and alice's second wait.
    assert_eq!(spindle_api::delayed::tick(&ts.server.state, now).await, 2);
    assert_eq!(fsyncs(&ts) - before, 2);
    let pending: Vec<Value> = list(&alice).await;
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0]["delay_id"], json!(second));
    // Bob's was cancelled when alice's first was applied: finalised, no event.
    let b = bob.get(&format!("{DE}/{bobs}")).await.ok();
    assert!(b.get("origin_server_ts").is_some(), "{b}");
    assert!(b.get("event_id").is_none(), "{b}");
    bob.post(&format!("{DE}/{bobs}/send"), &json!({}))
        .await
        .expect_err(409, "M_UNKNOWN");

    let before = fsyncs(&ts);
    assert_eq!(spindle_api::delayed::tick(&ts.server.state, now).await, 1);
    assert_eq!(fsyncs(&ts) - before, 2);
    assert_eq!(spindle_api::delayed::tick(&ts.server.state, now).await, 0);
    assert!(list(&alice).await.is_empty());

    // The room saw alice's two status events in order, the other slot, never bob's.
    let page = alice.messages(&room, "dir=b&limit=100").await;
    let mut fired: Vec<(String, String, Value)> = page["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == status || e["type"] == "org.example.other")
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_owned(),
                e["event_id"].as_str().unwrap().to_owned(),
                e["content"].clone(),
            )
        })
        .collect();
    fired.reverse();
    assert_eq!(
        fired,
        [
            (
                status.to_owned(),
                event_of(&alice, &first).await,
                json!({ "v": "alice" })
            ),
            (
                "org.example.other".to_owned(),
                event_of(&alice, &other).await,
                json!({ "v": "o" })
            ),
            (
                status.to_owned(),
                event_of(&alice, &second).await,
                json!({ "v": "alice2" })
            ),
        ]
    );
    let path = format!("/_matrix/client/v3/rooms/{}/state/{status}", enc(&room));
    assert_eq!(alice.get(&path).await.ok(), json!({ "v": "alice2" }));
    ts.stop().await;
}

/// A running `spindle --config FILE` (a real process, so a restart is a restart).
struct Proc {
    child: Child,
    base: String,
}

impl Proc {
    fn start(config: &std::path::Path) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_spindle"))
            .arg("--config")
            .arg(config)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn spindle");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("spindle: serving on ") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("spindle reports its address");
        Proc { child, base }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_delay_survives_a_restart_and_fires_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("spindle.toml");
    std::fs::write(
        &config,
        format!(
            "server_name = \"{}\"\nbind = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nlog = \"warn\"\nrate_limits = {{ enabled = false }}\n[delayed_events]\nmax_event_delay_duration_ms = 60000\n",
            common::SERVER_NAME,
            dir.path().join("data").display()
        ),
    )
    .unwrap();
    let http = common::http();
    let p = Proc::start(&config);
    let alice = common::register(&p.base, &http, "alice").await;
    let room = alice.create_room(json!({})).await;
    let id = schedule_message(&alice, &room, "after restart", 3_000).await;
    let since = list(&alice).await[0]["running_since"].as_u64().unwrap();
    p.kill(); // SIGKILL: nothing but the journal survives
    let p = Proc::start(&config);
    let alice = Client {
        base: p.base.clone(),
        ..alice
    };
    let ev = wait_for_body(&alice, &room, "after restart").await;
    assert!(ev["origin_server_ts"].as_u64().unwrap() >= since + 3_000);
    assert_eq!(
        wait_finalised(&alice, &id).await["event_id"],
        ev["event_id"]
    );
    assert!(list(&alice).await.is_empty());
    p.kill();
}

/// The "Measure" for delayed events: firing lateness (the sent event's
/// `origin_server_ts` minus its deadline) p50/p99/max with 10, 100 and 1,000 delays
/// due within the same two seconds; the time of one `restart` with that many live
/// delays; store rows an idle tick reads with 100, 1,000 and 10,000 pending. Not a
/// test; `cargo test --test delayed_events measure -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn measure_lateness_restart_and_idle_tick() {
    let ts = TestServer::start_with(|c| {
        c.delayed_events.max_event_delay_duration_ms = 86_400_000;
        c.delayed_events.max_scheduled_per_user = 20_000;
    })
    .await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let pct = |v: &mut Vec<u64>, p: f64| {
        v.sort();
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    for n in [10u64, 100, 1000] {
        // n delays due over 2 s, scheduled ahead of time so scheduling does not overlap.
        let lead = 5_000 + n * 5;
        let mut ids = Vec::new();
        let t0 = spindle_api::now_ms();
        for i in 0..n {
            let due_in = lead + i * 2_000 / n;
            let elapsed = spindle_api::now_ms() - t0;
            ids.push(
                schedule_message(
                    &alice,
                    &room,
                    &format!("n{n}-{i}"),
                    due_in.saturating_sub(elapsed).max(1),
                )
                .await,
            );
        }
        // One restart with n live delays.
        let t = std::time::Instant::now();
        alice
            .post(&format!("{DE}/{}/restart", ids[0]), &json!({}))
            .await
            .ok();
        let restart_ms = t.elapsed().as_secs_f64() * 1000.0;
        let mut late = Vec::new();
        for id in &ids {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                let d = alice.get(&format!("{DE}/{id}")).await.ok();
                if let Some(ev) = d["event_id"].as_str() {
                    let due = d["running_since"].as_u64().unwrap() + d["delay"].as_u64().unwrap();
                    let room_ev = alice.event(&room, ev).await.ok();
                    late.push(room_ev["origin_server_ts"].as_u64().unwrap() - due);
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let max = *late.iter().max().unwrap();
        println!(
            "delays n={n}: lateness p50 {} ms p99 {} ms max {max} ms; restart with {n} live: {restart_ms:.1} ms",
            pct(&mut late, 0.5),
            pct(&mut late, 0.99),
        );
    }
    let stats = ts.server.projections.db.stats().clone();
    let mut pending = 0;
    for n in [100, 1000, 10_000] {
        while pending < n {
            schedule_message(&alice, &room, "far", 80_000_000).await;
            pending += 1;
        }
        let before = stats.total();
        let t = std::time::Instant::now();
        for k in 0..1000 {
            spindle_api::delayed::tick(&ts.server.state, spindle_api::now_ms() + k).await;
        }
        println!(
            "idle tick with {n} pending: {} store rows read over 1000 ticks, {:.2} µs per tick",
            stats.total() - before,
            t.elapsed().as_secs_f64() * 1e6 / 1000.0
        );
    }
    ts.stop().await;
}
