//! `POST /_matrix/client/v3/search` (spec v1.19 "Server Side Search"), answered from
//! the `search` projection (tantivy): exact ids, orders, pages and counts; filters;
//! history visibility per event; redactions; errors.

mod common;

use common::{Client, TestServer, enc, txn};
use serde_json::{Value, json};

/// One `room_events` search; returns the 200 body's `room_events`.
async fn search(c: &Client, criteria: Value) -> Value {
    search_page(c, criteria, None).await
}

async fn search_page(c: &Client, criteria: Value, next_batch: Option<&str>) -> Value {
    let path = match next_batch {
        Some(t) => format!("/_matrix/client/v3/search?next_batch={}", enc(t)),
        None => "/_matrix/client/v3/search".to_owned(),
    };
    let body = c
        .post(
            &path,
            &json!({"search_categories": {"room_events": criteria}}),
        )
        .await
        .ok();
    body["search_categories"]["room_events"].clone()
}

/// The result event ids, in order.
fn result_ids(v: &Value) -> Vec<String> {
    v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["result"]["event_id"].as_str().unwrap().to_owned())
        .collect()
}

async fn redact(c: &Client, room: &str, event_id: &str) -> String {
    let v = c
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/redact/{}/{}",
                enc(room),
                enc(event_id),
                txn()
            ),
            &json!({"reason": "test"}),
        )
        .await
        .ok();
    v["event_id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn words_are_found_in_the_right_rooms_newest_first() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let bob = server.register("bob").await;
    let a = alice.create_room(json!({"name": "Room A"})).await;
    let b = alice.create_room(json!({})).await;
    let a1 = alice.send_text(&a, "I like Apples and pears").await;
    let _a2 = alice.send_text(&a, "nothing to see here").await;
    let b1 = alice.send_text(&b, "apples again, APPLES").await;
    let a3 = alice.send_text(&a, "one more apples story").await;

    let v = search(
        &alice,
        json!({"search_term": "apples", "order_by": "recent"}),
    )
    .await;
    assert_eq!(result_ids(&v), vec![a3.clone(), b1.clone(), a1.clone()]);
    assert_eq!(v["count"], 3);
    assert_eq!(v["highlights"], json!(["apples"]));
    assert!(v.get("next_batch").is_none(), "{v}");
    let first = &v["results"][0]["result"];
    assert_eq!(first["room_id"], a.as_str());
    assert_eq!(first["sender"], alice.user_id.as_str());
    assert_eq!(first["content"]["body"], "one more apples story");
    assert!(v["results"][0]["rank"].as_f64().unwrap() > 0.0);

    // Every word must match: "apples pears" is only a1.
    let v = search(
        &alice,
        json!({"search_term": "Apples, PEARS!", "order_by": "recent"}),
    )
    .await;
    assert_eq!(result_ids(&v), vec![a1.clone()]);
    assert_eq!(v["highlights"], json!(["apples", "pears"]));

    // Words that occur nowhere, or a term with no words at all.
    let v = search(&alice, json!({"search_term": "kiwi"})).await;
    assert_eq!((result_ids(&v).len(), v["count"].clone()), (0, json!(0)));
    let v = search(&alice, json!({"search_term": "?!  "})).await;
    assert_eq!((result_ids(&v).len(), v["count"].clone()), (0, json!(0)));

    // Bob is in neither room: nothing, and no count either.
    let v = search(&bob, json!({"search_term": "apples", "order_by": "recent"})).await;
    assert_eq!(result_ids(&v), Vec::<String>::new());
    assert_eq!(v["count"], 0);

    // The room name is found under content.name only.
    let v = search(
        &alice,
        json!({"search_term": "room", "keys": ["content.name"]}),
    )
    .await;
    assert_eq!(v["results"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["results"][0]["result"]["type"], "m.room.name");
    assert_eq!(v["results"][0]["result"]["room_id"], a.as_str());
    let v = search(
        &alice,
        json!({"search_term": "room", "keys": ["content.body"]}),
    )
    .await;
    assert_eq!(result_ids(&v), Vec::<String>::new());
    let topic = alice
        .put_state(
            &b,
            "m.room.topic",
            "",
            json!({"topic": "Orchards of apples"}),
        )
        .await;
    let v = search(
        &alice,
        json!({"search_term": "orchards", "keys": ["content.topic"]}),
    )
    .await;
    assert_eq!(result_ids(&v), vec![topic.clone()]);
    // Default keys are all three.
    let v = search(
        &alice,
        json!({"search_term": "apples", "order_by": "recent"}),
    )
    .await;
    assert_eq!(result_ids(&v), vec![topic, a3, b1, a1]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_orders_by_relevance_and_recent_by_time() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let room = alice.create_room(json!({})).await;
    // Sent first, but the best match: the word three times in a short body.
    let strong = alice.send_text(&room, "banana banana banana").await;
    let weak = alice
        .send_text(
            &room,
            "a banana mentioned once among many other unrelated words in a long sentence",
        )
        .await;
    let v = search(&alice, json!({"search_term": "banana", "order_by": "rank"})).await;
    assert_eq!(result_ids(&v), vec![strong.clone(), weak.clone()]);
    let ranks: Vec<f64> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_f64().unwrap())
        .collect();
    assert!(ranks[0] > ranks[1], "{ranks:?}");
    // Rank is the default order.
    let v = search(&alice, json!({"search_term": "banana"})).await;
    assert_eq!(result_ids(&v), vec![strong.clone(), weak.clone()]);
    let v = search(
        &alice,
        json!({"search_term": "banana", "order_by": "recent"}),
    )
    .await;
    assert_eq!(result_ids(&v), vec![weak, strong]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_batch_pages_do_not_overlap_and_counts_are_exact() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let mut sent = Vec::new();
    for i in 0..25 {
        // Equal-length bodies: equal scores, so rank ties fall back to newest first.
        sent.push(alice.send_text(&room, &format!("cherry {i:02}")).await);
    }
    let newest_first: Vec<String> = sent.iter().rev().cloned().collect();
    for order in ["recent", "rank"] {
        let criteria = json!({"search_term": "cherry", "order_by": order, "filter": {"limit": 10}});
        let p1 = search(&alice, criteria.clone()).await;
        assert_eq!(result_ids(&p1), newest_first[0..10].to_vec(), "{order}");
        assert_eq!(p1["count"], 25);
        let t1 = p1["next_batch"].as_str().expect("next_batch").to_owned();
        let p2 = search_page(&alice, criteria.clone(), Some(&t1)).await;
        assert_eq!(result_ids(&p2), newest_first[10..20].to_vec(), "{order}");
        assert_eq!(p2["count"], 25);
        let t2 = p2["next_batch"].as_str().expect("next_batch").to_owned();
        let p3 = search_page(&alice, criteria.clone(), Some(&t2)).await;
        assert_eq!(result_ids(&p3), newest_first[20..25].to_vec(), "{order}");
        assert_eq!(p3["count"], 25);
        assert!(p3.get("next_batch").is_none(), "{p3}");
        // A token of the other order is refused.
        let other = if order == "recent" { "rank" } else { "recent" };
        alice
            .post(
                &format!("/_matrix/client/v3/search?next_batch={}", enc(&t1)),
                &json!({"search_categories": {"room_events": {"search_term": "cherry", "order_by": other}}}),
            )
            .await
            .expect_err(400, "M_INVALID_PARAM");
    }
    // Exactly `limit` results in all: no next_batch.
    let v = search(
        &alice,
        json!({"search_term": "cherry", "filter": {"limit": 25}}),
    )
    .await;
    assert_eq!(result_ids(&v).len(), 25);
    assert!(v.get("next_batch").is_none(), "{v}");
    // limit is clamped: 0 gives one result, 1000 gives all (at most 100).
    let v = search(
        &alice,
        json!({"search_term": "cherry", "filter": {"limit": 0}}),
    )
    .await;
    assert_eq!(result_ids(&v), newest_first[0..1].to_vec());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_by_room_sender_and_type() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let bob = server.register("bob").await;
    let a = alice.create_room(json!({"preset": "public_chat"})).await;
    let b = alice.create_room(json!({"preset": "public_chat"})).await;
    bob.join(&a).await;
    bob.join(&b).await;
    let a_alice = alice.send_text(&a, "melon from alice").await;
    let a_bob = bob.send_text(&a, "melon from bob").await;
    let b_alice = alice.send_text(&b, "melon in b").await;
    let note = alice
        .send_txn(
            &b,
            "org.example.note",
            &txn(),
            &json!({"body": "melon note", "url": "mxc://x/y"}),
        )
        .await
        .ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let q = |filter: Value| json!({"search_term": "melon", "order_by": "recent", "filter": filter});
    let all = vec![
        note.clone(),
        b_alice.clone(),
        a_bob.clone(),
        a_alice.clone(),
    ];
    assert_eq!(result_ids(&search(&bob, q(json!({}))).await), all);
    assert_eq!(
        result_ids(&search(&bob, q(json!({"rooms": [a]}))).await),
        vec![a_bob.clone(), a_alice.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"not_rooms": [a]}))).await),
        vec![note.clone(), b_alice.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"senders": [bob.user_id]}))).await),
        vec![a_bob.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"not_senders": [bob.user_id]}))).await),
        vec![note.clone(), b_alice.clone(), a_alice.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"types": ["org.example.note"]}))).await),
        vec![note.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"types": ["org.example.*"]}))).await),
        vec![note.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"not_types": ["org.*"]}))).await),
        vec![b_alice.clone(), a_bob.clone(), a_alice.clone()]
    );
    assert_eq!(
        result_ids(&search(&bob, q(json!({"contains_url": true}))).await),
        vec![note.clone()]
    );
    assert_eq!(
        result_ids(
            &search(
                &bob,
                q(json!({"rooms": [b], "senders": [alice.user_id], "types": ["m.room.message"]}))
            )
            .await
        ),
        vec![b_alice.clone()]
    );
    // A room the searcher is not in stays out even when the filter names it.
    let c = alice.create_room(json!({})).await;
    alice.send_text(&c, "melon secret").await;
    assert_eq!(
        result_ids(&search(&bob, q(json!({"rooms": [c]}))).await),
        Vec::<String>::new()
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_visibility_hides_what_was_said_before_joining() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let carol = server.register("carol").await;
    let dave = server.register("dave").await;
    // `joined`: carol, joining later, must not find the earlier message.
    let joined = alice
        .create_room(json!({"preset": "public_chat", "initial_state": [
            {"type": "m.room.history_visibility", "state_key": "", "content": {"history_visibility": "joined"}}
        ]}))
        .await;
    let before = alice.send_text(&joined, "grape before carol").await;
    carol.join(&joined).await;
    let after = alice.send_text(&joined, "grape after carol").await;
    // `shared`: dave, joining later, finds the earlier message too.
    let shared = alice.create_room(json!({"preset": "public_chat"})).await;
    let shared_before = alice.send_text(&shared, "grape shared before dave").await;
    dave.join(&shared).await;
    let shared_after = alice.send_text(&shared, "grape shared after dave").await;

    let q = json!({"search_term": "grape", "order_by": "recent"});
    let v = search(&carol, q.clone()).await;
    assert_eq!(result_ids(&v), vec![after.clone()]);
    assert_eq!(v["count"], 1);
    let v = search(&dave, q.clone()).await;
    assert_eq!(
        result_ids(&v),
        vec![shared_after.clone(), shared_before.clone()]
    );
    assert_eq!(v["count"], 2);
    let v = search(&alice, q.clone()).await;
    assert_eq!(
        result_ids(&v),
        vec![shared_after, shared_before, after.clone(), before]
    );
    // Pages for carol: the hidden event neither shows nor counts.
    let v = search(
        &carol,
        json!({"search_term": "grape", "order_by": "recent", "filter": {"limit": 1}}),
    )
    .await;
    assert_eq!(result_ids(&v), vec![after]);
    assert_eq!(v["count"], 1);
    assert!(v.get("next_batch").is_none(), "{v}");
    // After leaving, carol searches nothing there (joined rooms only).
    carol.leave(&joined).await;
    let v = search(&carol, q).await;
    assert_eq!(result_ids(&v), Vec::<String>::new());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redacted_event_is_no_longer_found() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let keep = alice.send_text(&room, "lemon stays").await;
    let gone = alice.send_text(&room, "lemon goes").await;
    let q = json!({"search_term": "lemon", "order_by": "recent"});
    assert_eq!(
        result_ids(&search(&alice, q.clone()).await),
        vec![gone.clone(), keep.clone()]
    );
    redact(&alice, &room, &gone).await;
    let v = search(&alice, q.clone()).await;
    assert_eq!(result_ids(&v), vec![keep.clone()]);
    assert_eq!(v["count"], 1);
    assert_eq!(
        result_ids(&search(&alice, json!({"search_term": "goes"})).await),
        Vec::<String>::new()
    );
    // Encrypted events have no body: never found.
    alice
        .send_txn(
            &room,
            "m.room.encrypted",
            &txn(),
            &json!({"algorithm": "m.megolm.v1.aes-sha2", "ciphertext": "lemon"}),
        )
        .await
        .ok();
    assert_eq!(result_ids(&search(&alice, q).await), vec![keep]);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_profiles_groups_and_state() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let bob = server.register("bob").await;
    let room = alice
        .create_room(json!({"preset": "public_chat", "name": "Fruit"}))
        .await;
    bob.join(&room).await;
    bob.put(
        &format!(
            "/_matrix/client/v3/profile/{}/displayname",
            enc(&bob.user_id)
        ),
        &json!({"displayname": "Bobby"}),
    )
    .await
    .ok();
    let e1 = alice.send_text(&room, "one").await;
    let e2 = bob.send_text(&room, "plum two").await;
    let e3 = alice.send_text(&room, "three").await;
    let e4 = alice.send_text(&room, "plum four").await;
    let v = search(
        &alice,
        json!({
            "search_term": "plum", "order_by": "recent",
            "event_context": {"before_limit": 1, "after_limit": 1, "include_profile": true},
            "groupings": {"group_by": [{"key": "room_id"}, {"key": "sender"}]},
            "include_state": true,
        }),
    )
    .await;
    assert_eq!(result_ids(&v), vec![e4.clone(), e2.clone()]);
    let ctx4 = &v["results"][0]["context"];
    assert_eq!(common::ids(&ctx4["events_before"]), vec![e3.clone()]);
    assert_eq!(common::ids(&ctx4["events_after"]), Vec::<String>::new());
    let ctx2 = &v["results"][1]["context"];
    assert_eq!(common::ids(&ctx2["events_before"]), vec![e1.clone()]);
    assert_eq!(common::ids(&ctx2["events_after"]), vec![e3.clone()]);
    assert_eq!(ctx2["profile_info"][&bob.user_id]["displayname"], "Bobby");
    // Alice never changed her display name: it is the localpart set at registration.
    assert_eq!(
        ctx2["profile_info"][&alice.user_id],
        json!({ "displayname": "alice" })
    );
    assert!(ctx2["start"].is_string() && ctx2["end"].is_string());
    assert_eq!(
        v["groups"]["room_id"][&room],
        json!({"order": 1, "results": [e4, e2]})
    );
    assert_eq!(
        v["groups"]["sender"][&alice.user_id]["results"],
        json!([v["results"][0]["result"]["event_id"]])
    );
    assert_eq!(v["groups"]["sender"][&bob.user_id]["order"], 2);
    let state = v["state"][&room].as_array().expect("state of the room");
    assert!(
        state
            .iter()
            .any(|e| e["type"] == "m.room.name" && e["content"]["name"] == "Fruit")
    );
    assert!(
        state
            .iter()
            .any(|e| e["type"] == "m.room.member" && e["state_key"] == bob.user_id.as_str())
    );
    // Without event_context: no context.
    let v = search(&alice, json!({"search_term": "plum"})).await;
    assert!(v["results"][0].get("context").is_none(), "{v}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_matrix_errors() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let path = "/_matrix/client/v3/search";
    alice
        .post(path, &json!({}))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(path, &json!({"search_categories": []}))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(path, &json!({"search_categories": {"room_events": {}}}))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            path,
            &json!({"search_categories": {"room_events": {"search_term": 5}}}),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    // A term of many words is many query clauses: capped (32 words, 1000 bytes).
    let long_term: Vec<String> = (0..33).map(|i| format!("w{i}")).collect();
    alice
        .post(
            path,
            &json!({"search_categories": {"room_events": {"search_term": long_term.join(" ")}}}),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(
            path,
            &json!({"search_categories": {"room_events": {"search_term": "x".repeat(1001)}}}),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(path, &json!({"search_categories": {"room_events": {"search_term": long_term[..32].join(" ")}}}))
        .await
        .ok();
    alice
        .post(path, &json!({"search_categories": {"room_events": {"search_term": "x", "order_by": "best"}}}))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(path, &json!({"search_categories": {"room_events": {"search_term": "x", "keys": ["content.url"]}}}))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(path, &json!({"search_categories": {"room_events": {"search_term": "x", "filter": {"limit": "ten"}}}}))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(path, &json!({"search_categories": {"room_events": {"search_term": "x", "groupings": {"group_by": [{"key": "type"}]}}}}))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    for bad in [
        "garbage",
        "k1_2",
        "r1_2_3_4",
        "r-1_0_0",
        "r99999999999999999999999_1_1",
        "",
    ] {
        alice
            .post(
                &format!("{path}?next_batch={}", enc(bad)),
                &json!({"search_categories": {"room_events": {"search_term": "x", "order_by": "recent"}}}),
            )
            .await
            .expect_err(400, "M_INVALID_PARAM");
    }
    // No room_events category: an empty answer.
    let v = alice
        .post(path, &json!({"search_categories": {}}))
        .await
        .ok();
    assert_eq!(v, json!({"search_categories": {}}));
    // No token: 401.
    server
        .anon()
        .post(path, &json!({"search_categories": {}}))
        .await
        .expect_err(401, "M_MISSING_TOKEN");
    server.stop().await;
}

/// Ignored users' events are not found (as they leave timelines; Synapse filters
/// search results the same way), and the count leaves them out too; unignoring brings
/// them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_users_events_are_not_found() {
    let server = TestServer::start().await;
    let alice = server.register("alice").await;
    let bob = server.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let mine = alice.send_text(&room, "quince from alice").await;
    let theirs = bob.send_text(&room, "quince from bob").await;
    let q = json!({"search_term": "quince", "order_by": "recent"});
    assert_eq!(
        result_ids(&search(&alice, q.clone()).await),
        vec![theirs.clone(), mine.clone()]
    );
    let ignore = |users: Value| {
        let alice = alice.clone();
        async move {
            alice
                .put(
                    &format!(
                        "/_matrix/client/v3/user/{}/account_data/m.ignored_user_list",
                        enc(&alice.user_id)
                    ),
                    &json!({ "ignored_users": users }),
                )
                .await
                .ok();
        }
    };
    ignore(json!({ bob.user_id.clone(): {} })).await;
    let v = search(&alice, q.clone()).await;
    assert_eq!(result_ids(&v), vec![mine.clone()]);
    assert_eq!(v["count"], 1);
    ignore(json!({})).await;
    assert_eq!(result_ids(&search(&alice, q).await), vec![theirs, mine]);
    server.stop().await;
}
