//! Counting guards for the directories, presence and timestamp lookups (BRIEF §3.9):
//! their store reads follow the answer, not room sizes or strangers' traffic. Counts
//! come from the projection store's counters, never from clocks.

mod common;

use std::sync::atomic::Ordering;

use common::{TestServer, enc};
use serde_json::json;

fn reads(ts: &TestServer) -> u64 {
    let stats = ts.server.projections.db.stats();
    stats.reads.load(Ordering::Relaxed) + stats.rows_scanned.load(Ordering::Relaxed)
}

/// A `/publicRooms` entry's `num_joined_members` is one read of a running count, so
/// listing a room with 20 members costs about what listing it with 1 member costs: the
/// only growth allowed is one more trie level for each of the 8 state point lookups
/// (counting the members would add 20 rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_rooms_reads_do_not_grow_with_members() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice
        .create_room(json!({ "visibility": "public", "name": "Room" }))
        .await;
    let anon = ts.anon();
    anon.get("/_matrix/client/v3/publicRooms").await.ok();
    let before = reads(&ts);
    let one = anon.get("/_matrix/client/v3/publicRooms").await.ok();
    let cost_one = reads(&ts) - before;
    assert_eq!(one["chunk"][0]["num_joined_members"], json!(1));
    for i in 0..19 {
        ts.register(&format!("member{i}")).await.join(&room).await;
    }
    anon.get("/_matrix/client/v3/publicRooms").await.ok();
    let before = reads(&ts);
    let many = anon.get("/_matrix/client/v3/publicRooms").await.ok();
    let cost_many = reads(&ts) - before;
    assert_eq!(many["chunk"][0]["num_joined_members"], json!(20));
    assert!(
        cost_many <= cost_one + 8,
        "publicRooms reads grew with the member count: {cost_one} -> {cost_many}"
    );
    ts.stop().await;
}

/// Strangers' presence changes cost a syncing user nothing: presence is asked per own
/// room in memory, and only changed room-mates are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_sync_does_not_pay_for_strangers_presence() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let first = alice.sync("set_presence=offline").await;
    let since = first["next_batch"].as_str().unwrap().to_owned();
    // Baseline: an incremental sync with nothing new.
    alice
        .sync(&format!("since={since}&set_presence=offline"))
        .await;
    let before = reads(&ts);
    alice
        .sync(&format!("since={since}&set_presence=offline"))
        .await;
    let quiet = reads(&ts) - before;
    // Ten strangers in their own room come online (and change their status).
    let elsewhere = bob.create_room(json!({ "preset": "public_chat" })).await;
    for i in 0..10 {
        let s = ts.register(&format!("stranger{i}")).await;
        s.join(&elsewhere).await;
        s.put(
            &format!("/_matrix/client/v3/presence/{}/status", enc(&s.user_id)),
            &json!({ "presence": "online", "status_msg": "hi" }),
        )
        .await
        .ok();
    }
    let before = reads(&ts);
    let after = alice
        .sync(&format!("since={since}&set_presence=offline"))
        .await;
    assert_eq!(after["presence"]["events"], json!([]));
    assert_eq!(reads(&ts) - before, quiet, "sync read strangers' presence");
    ts.stop().await;
}

/// `/timestamp_to_event` is one index seek plus the event it returns, whatever the
/// room's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamp_to_event_reads_do_not_grow_with_the_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let small = alice.create_room(json!({})).await;
    let big = alice.create_room(json!({})).await;
    alice.send_text(&small, "only").await;
    for i in 0..40 {
        alice.send_text(&big, &format!("m{i}")).await;
    }
    let cost = |room: String| {
        let alice = alice.clone();
        let ts = &ts;
        async move {
            let path = format!(
                "/_matrix/client/v1/rooms/{}/timestamp_to_event?ts={}&dir=b",
                enc(&room),
                u64::MAX / 2
            );
            alice.get(&path).await.ok();
            let before = reads(ts);
            alice.get(&path).await.ok();
            reads(ts) - before
        }
    };
    let (c_small, c_big) = (cost(small).await, cost(big).await);
    assert_eq!(
        c_small, c_big,
        "timestamp_to_event reads grew with the room"
    );
    ts.stop().await;
}
