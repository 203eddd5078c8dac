//! Relations, bundled aggregations, threads and per-thread unread counts (spec:
//! "Relationships between events", "Threading"), with exact ids and orders.

mod common;

use common::{Client, TestServer, enc, txn};
use serde_json::{Value, json};

async fn send(c: &Client, room: &str, kind: &str, content: Value) -> String {
    c.send_txn(room, kind, &txn(), &content).await.ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn text(body: &str) -> Value {
    json!({ "msgtype": "m.text", "body": body })
}

fn reply_in_thread(root: &str, body: &str) -> Value {
    json!({ "msgtype": "m.text", "body": body, "m.relates_to": { "rel_type": "m.thread", "event_id": root } })
}

fn ids(v: &Value) -> Vec<String> {
    common::ids(&v["chunk"])
}

async fn relations(c: &Client, room: &str, suffix: &str) -> common::Resp {
    c.get(&format!(
        "/_matrix/client/v1/rooms/{}/relations/{suffix}",
        enc(room)
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relations_pagination_and_bundled_aggregations() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let eve = ts.register("eve").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let root = send(&alice, &room, "m.room.message", text("root")).await;
    let react = send(
        &bob,
        &room,
        "m.reaction",
        json!({ "m.relates_to": { "rel_type": "m.annotation", "event_id": root, "key": "👍" } }),
    )
    .await;
    let edit1 = send(
        &alice,
        &room,
        "m.room.message",
        json!({ "msgtype": "m.text", "body": "* root v2", "m.new_content": text("root v2"), "m.relates_to": { "rel_type": "m.replace", "event_id": root } }),
    )
    .await;
    // An edit by someone else is not a valid replacement: never bundled.
    let bad_edit = send(
        &bob,
        &room,
        "m.room.message",
        json!({ "msgtype": "m.text", "body": "* hijack", "m.new_content": text("hijack"), "m.relates_to": { "rel_type": "m.replace", "event_id": root } }),
    )
    .await;
    let t1 = send(&bob, &room, "m.room.message", reply_in_thread(&root, "t1")).await;
    let reference = send(
        &bob,
        &room,
        "m.room.message",
        json!({ "msgtype": "m.text", "body": "see", "m.relates_to": { "rel_type": "m.reference", "event_id": root } }),
    )
    .await;
    let t2 = send(
        &alice,
        &room,
        "m.room.message",
        reply_in_thread(&root, "t2"),
    )
    .await;
    let edit2 = send(
        &alice,
        &room,
        "m.room.message",
        json!({ "msgtype": "m.text", "body": "* root v3", "m.new_content": text("root v3"), "m.relates_to": { "rel_type": "m.replace", "event_id": root } }),
    )
    .await;

    // All children, newest first.
    let all = relations(&bob, &room, &enc(&root)).await.ok();
    assert_eq!(
        ids(&all),
        [
            edit2.as_str(),
            t2.as_str(),
            reference.as_str(),
            t1.as_str(),
            bad_edit.as_str(),
            edit1.as_str(),
            react.as_str()
        ]
    );
    assert!(all.get("next_batch").is_none());
    assert!(all.get("recursion_depth").is_none());
    // Pages of 3, backwards then forwards.
    let p1 = relations(&bob, &room, &format!("{}?limit=3", enc(&root)))
        .await
        .ok();
    assert_eq!(ids(&p1), [edit2.as_str(), t2.as_str(), reference.as_str()]);
    let next = p1["next_batch"].as_str().unwrap();
    let p2 = relations(
        &bob,
        &room,
        &format!("{}?limit=3&from={}", enc(&root), enc(next)),
    )
    .await
    .ok();
    assert_eq!(ids(&p2), [t1.as_str(), bad_edit.as_str(), edit1.as_str()]);
    let f = relations(&bob, &room, &format!("{}?dir=f&limit=4", enc(&root)))
        .await
        .ok();
    assert_eq!(
        ids(&f),
        [
            react.as_str(),
            edit1.as_str(),
            bad_edit.as_str(),
            t1.as_str()
        ]
    );
    let f2 = relations(
        &bob,
        &room,
        &format!(
            "{}?dir=f&limit=4&from={}",
            enc(&root),
            enc(f["next_batch"].as_str().unwrap())
        ),
    )
    .await
    .ok();
    assert_eq!(ids(&f2), [reference.as_str(), t2.as_str(), edit2.as_str()]);
    // By relation type, and by relation and event type.
    let threads = relations(&bob, &room, &format!("{}/m.thread", enc(&root)))
        .await
        .ok();
    assert_eq!(ids(&threads), [t2.as_str(), t1.as_str()]);
    let reactions = relations(
        &bob,
        &room,
        &format!("{}/m.annotation/m.reaction", enc(&root)),
    )
    .await
    .ok();
    assert_eq!(ids(&reactions), [react.as_str()]);
    let none = relations(
        &bob,
        &room,
        &format!("{}/m.annotation/m.room.message", enc(&root)),
    )
    .await
    .ok();
    assert_eq!(ids(&none), Vec::<String>::new());

    // Bundled aggregations on the root, wherever it is served.
    let check = |ev: &Value, viewer_participated: bool| {
        let rel = &ev["unsigned"]["m.relations"];
        assert_eq!(rel["m.replace"]["event_id"], json!(edit2), "{ev}");
        assert_eq!(rel["m.thread"]["count"], json!(2));
        assert_eq!(rel["m.thread"]["latest_event"]["event_id"], json!(t2));
        assert_eq!(
            rel["m.thread"]["current_user_participated"],
            json!(viewer_participated)
        );
        assert_eq!(
            rel["m.reference"],
            json!({ "chunk": [{ "event_id": reference }] })
        );
        assert!(rel.get("m.annotation").is_none());
        // The original content is left intact.
        assert_eq!(ev["content"]["body"], json!("root"));
    };
    check(&bob.event(&room, &root).await.ok(), true);
    let msgs = alice.messages(&room, "dir=b&limit=50").await;
    let in_messages = msgs["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event_id"] == json!(root))
        .unwrap()
        .clone();
    check(&in_messages, true);
    let ctx = alice.context(&room, &root, 2).await.ok();
    check(&ctx["event"], true);
    let synced = bob.sync("").await;
    let in_sync = synced["rooms"]["join"][&room]["timeline"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event_id"] == json!(root))
        .cloned();
    if let Some(e) = in_sync {
        check(&e, true);
    }
    // A member who never took part in the thread.
    let carol = ts.register("carol").await;
    carol.join(&room).await;
    check(&carol.event(&room, &root).await.ok(), false);

    // Recursion follows relations of relations.
    let edit_of_t1 = send(
        &bob,
        &room,
        "m.room.message",
        json!({ "msgtype": "m.text", "body": "* t1!", "m.new_content": text("t1!"), "m.relates_to": { "rel_type": "m.replace", "event_id": t1 } }),
    )
    .await;
    let flat = relations(&bob, &room, &format!("{}/m.replace", enc(&root)))
        .await
        .ok();
    assert_eq!(
        ids(&flat),
        [edit2.as_str(), bad_edit.as_str(), edit1.as_str()]
    );
    let deep = relations(
        &bob,
        &room,
        &format!("{}/m.replace?recurse=true", enc(&root)),
    )
    .await
    .ok();
    assert_eq!(
        ids(&deep),
        [
            edit_of_t1.as_str(),
            edit2.as_str(),
            bad_edit.as_str(),
            edit1.as_str()
        ]
    );
    assert_eq!(deep["recursion_depth"], json!(3));

    // Errors and authorization.
    relations(&bob, &room, &format!("{}?dir=x", enc(&root)))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    relations(&bob, &room, &format!("{}?from=zz", enc(&root)))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    relations(&bob, &room, &format!("{}?recurse=yes", enc(&root)))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    relations(&bob, &room, &enc("$nosuchevent"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    let private = alice.create_room(json!({ "preset": "private_chat" })).await;
    let secret = send(&alice, &private, "m.room.message", text("secret")).await;
    relations(&eve, &private, &enc(&secret))
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thread_list_and_per_thread_unread_counts() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let a = send(&alice, &room, "m.room.message", text("thread a")).await;
    let b = send(&bob, &room, "m.room.message", text("thread b")).await;
    let c = send(&alice, &room, "m.room.message", text("thread c")).await;
    send(&alice, &room, "m.room.message", reply_in_thread(&a, "a1")).await;
    send(&alice, &room, "m.room.message", reply_in_thread(&b, "b1")).await;
    send(&alice, &room, "m.room.message", reply_in_thread(&c, "c1")).await;
    let a2 = send(&alice, &room, "m.room.message", reply_in_thread(&a, "a2")).await;
    // A reaction to a thread reply belongs to that thread (notifies no one).
    send(
        &alice,
        &room,
        "m.reaction",
        json!({ "m.relates_to": { "rel_type": "m.annotation", "event_id": a2, "key": "x" } }),
    )
    .await;
    let main = send(&alice, &room, "m.room.message", text("main")).await;

    let list = |q: &str| {
        let bob = bob.clone();
        let room = room.clone();
        let q = q.to_owned();
        async move {
            bob.get(&format!(
                "/_matrix/client/v1/rooms/{}/threads?{q}",
                enc(&room)
            ))
            .await
        }
    };
    // Ordered by latest activity: a (a2), c (c1), b (b1).
    assert_eq!(
        ids(&list("").await.ok()),
        [a.as_str(), c.as_str(), b.as_str()]
    );
    let p1 = list("limit=2").await.ok();
    assert_eq!(ids(&p1), [a.as_str(), c.as_str()]);
    let p2 = list(&format!(
        "limit=2&from={}",
        enc(p1["next_batch"].as_str().unwrap())
    ))
    .await
    .ok();
    assert_eq!(ids(&p2), [b.as_str()]);
    assert!(p2.get("next_batch").is_none());
    // Bob sent only the root of b.
    assert_eq!(ids(&list("include=participated").await.ok()), [b.as_str()]);
    let first = &list("").await.ok()["chunk"][0];
    assert_eq!(
        first["unsigned"]["m.relations"]["m.thread"]["count"],
        json!(2)
    );
    list("include=mine")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    list("from=nope").await.expect_err(400, "M_INVALID_PARAM");

    // Per-thread unread counts when the filter asks for them.
    let filter = enc(
        &json!({ "room": { "timeline": { "unread_thread_notifications": true } } }).to_string(),
    );
    let s = bob.sync(&format!("filter={filter}")).await;
    let joined = &s["rooms"]["join"][&room];
    // Main timeline: bob's own root b marks a read; c and "main" are unread.
    assert_eq!(
        joined["unread_notifications"],
        json!({ "notification_count": 2, "highlight_count": 0 })
    );
    assert_eq!(
        joined["unread_thread_notifications"],
        json!({
            a.clone(): { "notification_count": 2, "highlight_count": 0 },
            b.clone(): { "notification_count": 1, "highlight_count": 0 },
            c.clone(): { "notification_count": 1, "highlight_count": 0 },
        })
    );
    // Without the filter: the whole room after bob's own b (c, a1, b1, c1, a2, main;
    // the reaction notifies no one).
    let s = bob.sync("").await;
    assert_eq!(
        s["rooms"]["join"][&room]["unread_notifications"],
        json!({ "notification_count": 6, "highlight_count": 0 })
    );
    assert!(
        s["rooms"]["join"][&room]
            .get("unread_thread_notifications")
            .is_none()
    );
    // A threaded receipt clears one thread only.
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
            enc(&room),
            enc(&a2)
        ),
        &json!({ "thread_id": a }),
    )
    .await
    .ok();
    let s = bob.sync(&format!("filter={filter}")).await;
    let joined = &s["rooms"]["join"][&room];
    assert_eq!(
        joined["unread_thread_notifications"],
        json!({
            b.clone(): { "notification_count": 1, "highlight_count": 0 },
            c.clone(): { "notification_count": 1, "highlight_count": 0 },
        })
    );
    assert_eq!(
        joined["unread_notifications"],
        json!({ "notification_count": 2, "highlight_count": 0 })
    );
    // A main-timeline receipt on the last event clears the main timeline only.
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
            enc(&room),
            enc(&main)
        ),
        &json!({ "thread_id": "main" }),
    )
    .await
    .ok();
    let s = bob.sync(&format!("filter={filter}")).await;
    let joined = &s["rooms"]["join"][&room];
    assert_eq!(
        joined["unread_notifications"],
        json!({ "notification_count": 0, "highlight_count": 0 })
    );
    assert_eq!(
        joined["unread_thread_notifications"]
            .as_object()
            .unwrap()
            .len(),
        2
    );
    // Both receipts show in the ephemeral receipts, each with its thread.
    let receipts = s["rooms"]["join"][&room]["ephemeral"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.receipt")
        .cloned()
        .unwrap();
    assert_eq!(
        receipts["content"][&a2]["m.read"][&bob.user_id]["thread_id"],
        json!(a)
    );
    assert_eq!(
        receipts["content"][&main]["m.read"][&bob.user_id]["thread_id"],
        json!("main")
    );
    ts.stop().await;
}

/// A redacted child stops counting (issue 15 item 5; Synapse drops its relation row):
/// it leaves `/relations`, a redacted latest edit gives way to the edit before it, a
/// thread's count and latest event move back (and a thread left empty leaves
/// `/threads`), and a redacted reference leaves the bundled chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redacted_relations_leave_relations_and_bundles() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let root = send(&alice, &room, "m.room.message", text("root")).await;
    let edit = |n: &str| json!({ "msgtype": "m.text", "body": format!("* v{n}"), "m.new_content": text(&format!("v{n}")), "m.relates_to": { "rel_type": "m.replace", "event_id": root } });
    let edit1 = send(&alice, &room, "m.room.message", edit("1")).await;
    let edit2 = send(&alice, &room, "m.room.message", edit("2")).await;
    let react = send(
        &bob,
        &room,
        "m.reaction",
        json!({ "m.relates_to": { "rel_type": "m.annotation", "event_id": root, "key": "👍" } }),
    )
    .await;
    let thread1 = send(&bob, &room, "m.room.message", reply_in_thread(&root, "t1")).await;
    let thread2 = send(&bob, &room, "m.room.message", reply_in_thread(&root, "t2")).await;
    let reference = send(
        &bob,
        &room,
        "m.room.message",
        json!({ "msgtype": "m.text", "body": "see", "m.relates_to": { "rel_type": "m.reference", "event_id": root } }),
    )
    .await;
    let all = relations(&alice, &room, &enc(&root)).await.ok();
    assert_eq!(
        ids(&all),
        vec![
            reference.clone(),
            thread2.clone(),
            thread1.clone(),
            react.clone(),
            edit2.clone(),
            edit1.clone()
        ]
    );

    // Redact the latest edit, the reaction, the latest thread reply and the reference.
    alice.redact(&room, &edit2).await;
    bob.redact(&room, &react).await;
    bob.redact(&room, &thread2).await;
    bob.redact(&room, &reference).await;
    let all = relations(&alice, &room, &enc(&root)).await.ok();
    assert_eq!(ids(&all), vec![thread1.clone(), edit1.clone()]);
    let annotations = relations(&alice, &room, &format!("{}/m.annotation", enc(&root)))
        .await
        .ok();
    assert_eq!(ids(&annotations), Vec::<String>::new());
    let ev = alice.event(&room, &root).await.ok();
    let bundle = &ev["unsigned"]["m.relations"];
    assert_eq!(bundle["m.replace"]["event_id"], json!(edit1));
    assert_eq!(bundle["m.thread"]["count"], json!(1));
    assert_eq!(
        bundle["m.thread"]["latest_event"]["event_id"],
        json!(thread1)
    );
    assert_eq!(bundle.get("m.reference"), None, "{bundle}");

    // The last thread reply and the last edit go: no thread, no replacement.
    bob.redact(&room, &thread1).await;
    alice.redact(&room, &edit1).await;
    let ev = alice.event(&room, &root).await.ok();
    assert_eq!(ev["unsigned"].get("m.relations"), None, "{ev}");
    let threads = alice
        .get(&format!("/_matrix/client/v1/rooms/{}/threads", enc(&room)))
        .await
        .ok();
    assert_eq!(threads["chunk"], json!([]));
    assert_eq!(
        ids(&relations(&alice, &room, &enc(&root)).await.ok()),
        Vec::<String>::new()
    );
    ts.stop().await;
}
