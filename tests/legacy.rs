//! The legacy endpoints (issue 15, item 3): `GET /events` (with `from`, `timeout` and
//! `room_id` peeking), `GET /initialSync`, `GET /rooms/{roomId}/initialSync` (also for
//! a departed room) and `GET /events/{eventId}`, with exact values.

mod common;

use std::time::Duration;

use common::{TestServer, enc, ids};
use serde_json::{Value, json};

const V3: &str = "/_matrix/client/v3";

fn world_readable() -> Value {
    json!({ "preset": "public_chat", "initial_state": [
        { "type": "m.room.history_visibility", "state_key": "", "content": { "history_visibility": "world_readable" } }
    ] })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_streams_joined_rooms_from_a_token_and_waits_for_new_ones() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let shared = alice.create_room(json!({ "preset": "public_chat" })).await;
    let other = alice.create_room(json!({})).await;
    bob.join(&shared).await;
    let init = bob.get(&format!("{V3}/initialSync?limit=1")).await.ok();
    let from = init["end"].as_str().unwrap().to_owned();
    let a = alice.send_text(&shared, "one").await;
    alice.send_text(&other, "not for bob").await;
    let b = alice.send_text(&shared, "two").await;
    let page = bob
        .get(&format!("{V3}/events?from={from}&timeout=0"))
        .await
        .ok();
    assert_eq!(page["start"], json!(from));
    assert_eq!(ids(&page["chunk"]), vec![a, b]);
    assert_eq!(page["chunk"][0]["content"]["body"], json!("one"));
    // Nothing new: an empty chunk after the timeout, `end` unchanged.
    let end = page["end"].as_str().unwrap().to_owned();
    let empty = bob
        .get(&format!("{V3}/events?from={end}&timeout=0"))
        .await
        .ok();
    assert_eq!(empty["chunk"], json!([]));
    assert_eq!(empty["end"], json!(end));
    // A waiting request wakes for the next event.
    let waiter = {
        let bob = bob.clone();
        let end = end.clone();
        tokio::spawn(async move {
            bob.get(&format!("{V3}/events?from={end}&timeout=20000"))
                .await
                .ok()
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = alice.send_text(&shared, "three").await;
    let woke = waiter.await.unwrap();
    assert_eq!(ids(&woke["chunk"]), vec![c]);
    // Errors.
    bob.get(&format!("{V3}/events?from=nonsense&timeout=0"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    bob.get(&format!("{V3}/events?from=t999999999&timeout=0"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_with_room_id_peeks_into_world_readable_rooms_only() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let eve = ts.register("eve").await;
    let open = alice.create_room(world_readable()).await;
    let closed = alice.create_room(json!({ "preset": "public_chat" })).await;
    let from = eve
        .get(&format!("{V3}/events?room_id={}&timeout=0", enc(&open)))
        .await
        .ok()["end"]
        .as_str()
        .unwrap()
        .to_owned();
    let m = alice.send_text(&open, "visible").await;
    let page = eve
        .get(&format!(
            "{V3}/events?room_id={}&from={from}&timeout=0",
            enc(&open)
        ))
        .await
        .ok();
    assert_eq!(ids(&page["chunk"]), vec![m]);
    eve.get(&format!("{V3}/events?room_id={}&timeout=0", enc(&closed)))
        .await
        .expect_err(403, "M_FORBIDDEN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_sync_lists_joined_invited_and_archived_rooms() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let joined = alice
        .create_room(json!({ "preset": "public_chat", "name": "Joined" }))
        .await;
    bob.join(&joined).await;
    let m1 = alice.send_text(&joined, "m1").await;
    let m2 = alice.send_text(&joined, "m2").await;
    let invited = alice.create_room(json!({})).await;
    alice.invite(&invited, &bob.user_id).await;
    let left = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&left).await;
    bob.leave(&left).await;
    alice.send_text(&left, "after bob left").await;
    bob.put(
        &format!("{V3}/user/{}/account_data/org.example.x", enc(&bob.user_id)),
        &json!({ "k": 1 }),
    )
    .await
    .ok();

    let init = bob.get(&format!("{V3}/initialSync?limit=2")).await.ok();
    assert_eq!(init["presence"], json!([]));
    assert_eq!(
        init["account_data"],
        json!([{ "type": "org.example.x", "content": { "k": 1 } }])
    );
    let rooms = init["rooms"].as_array().unwrap();
    let by_id = |id: &str| rooms.iter().find(|r| r["room_id"] == id).cloned();
    assert_eq!(rooms.len(), 2, "{init}");
    let j = by_id(&joined).unwrap();
    assert_eq!(j["membership"], json!("join"));
    assert_eq!(ids(&j["messages"]["chunk"]), vec![m1.clone(), m2.clone()]);
    assert_eq!(j["visibility"], json!("private"));
    let name = j["state"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.room.name")
        .unwrap();
    assert_eq!(name["content"], json!({ "name": "Joined" }));
    // `start` pages back to the event before the chunk.
    let start = j["messages"]["start"].as_str().unwrap();
    let back = bob
        .messages(&joined, &format!("dir=b&limit=1&from={start}"))
        .await;
    assert_eq!(back["chunk"][0]["type"], json!("m.room.member"));
    let i = by_id(&invited).unwrap();
    assert_eq!(i["membership"], json!("invite"));
    assert_eq!(i["invite"]["content"]["membership"], json!("invite"));
    assert!(by_id(&left).is_none());

    let archived = bob
        .get(&format!("{V3}/initialSync?limit=1&archived=true"))
        .await
        .ok();
    let l = archived["rooms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["room_id"] == json!(left))
        .cloned()
        .unwrap();
    assert_eq!(l["membership"], json!("leave"));
    // The messages stop at Bob's leave.
    let last = &l["messages"]["chunk"][0];
    assert_eq!(last["type"], json!("m.room.member"));
    assert_eq!(last["content"]["membership"], json!("leave"));
    bob.get(&format!("{V3}/initialSync?archived=maybe"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_initial_sync_serves_members_peekers_and_former_members() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let eve = ts.register("eve").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "topic": "t" }))
        .await;
    bob.join(&room).await;
    let before = alice.send_text(&room, "before leave").await;
    bob.leave(&room).await;
    let after = alice.send_text(&room, "after leave").await;
    let path = format!("{V3}/rooms/{}/initialSync", enc(&room));
    let a = alice.get(&path).await.ok();
    assert_eq!(a["room_id"], json!(room));
    assert_eq!(a["membership"], json!("join"));
    let chunk = ids(&a["messages"]["chunk"]);
    assert_eq!(chunk.last(), Some(&after));
    // Bob left: he sees the room as it was when he left.
    let b = bob.get(&path).await.ok();
    assert_eq!(b["membership"], json!("leave"));
    let chunk = ids(&b["messages"]["chunk"]);
    assert!(!chunk.contains(&after), "{chunk:?}");
    assert_eq!(chunk[chunk.len() - 2], before);
    let bob_member = b["state"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.room.member" && e["state_key"] == json!(bob.user_id))
        .unwrap();
    assert_eq!(bob_member["content"]["membership"], json!("leave"));
    // Eve was never in it: refused, like an unknown room.
    eve.get(&path).await.expect_err(403, "M_FORBIDDEN");
    eve.get(&format!(
        "{V3}/rooms/{}/initialSync",
        enc("!nope:localhost:8008")
    ))
    .await
    .expect_err(403, "M_FORBIDDEN");
    // A world-readable room can be peeked (no membership).
    let open = alice.create_room(world_readable()).await;
    let m = alice.send_text(&open, "peek").await;
    let p = eve
        .get(&format!("{V3}/rooms/{}/initialSync", enc(&open)))
        .await
        .ok();
    assert_eq!(p.get("membership"), None);
    assert_eq!(ids(&p["messages"]["chunk"]).last(), Some(&m));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_by_id_answers_only_what_the_user_may_see() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let eve = ts.register("eve").await;
    let room = alice.create_room(json!({})).await;
    let m = alice.send_text(&room, "secret").await;
    let ev = alice.get(&format!("{V3}/events/{}", enc(&m))).await.ok();
    assert_eq!(ev["event_id"], json!(m));
    assert_eq!(ev["room_id"], json!(room));
    assert_eq!(ev["content"]["body"], json!("secret"));
    eve.get(&format!("{V3}/events/{}", enc(&m)))
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .get(&format!("{V3}/events/{}", enc("$unknown")))
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}
