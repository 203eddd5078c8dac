//! Simplified Sliding Sync (MSC4186): exact room order, ranges, required_state,
//! counts and extension payloads across incremental requests on one connection.

mod common;

use common::{Client, TestServer, device_keys, enc, txn};
use serde_json::{Value, json};

const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";

/// One request; `pos` in the query (as matrix-rust-sdk sends it). Panics unless 200.
async fn ss(c: &Client, pos: Option<&str>, body: Value) -> Value {
    let path = match pos {
        Some(p) => format!("{SS}?pos={}", enc(p)),
        None => SS.to_owned(),
    };
    c.post(&path, &body).await.ok()
}

/// Starts a request with `pos` and a 20 s `timeout`, and gives it time to start
/// waiting.
async fn long_poll(c: &Client, pos: &str, body: Value) -> tokio::task::JoinHandle<Value> {
    let (c, path) = (c.clone(), format!("{SS}?pos={}&timeout=20000", enc(pos)));
    let handle = tokio::spawn(async move { c.post(&path, &body).await.ok() });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    handle
}

/// The answer of a [`long_poll`], which must come before its timeout.
async fn answer(waiting: tokio::task::JoinHandle<Value>) -> Value {
    tokio::time::timeout(std::time::Duration::from_secs(15), waiting)
        .await
        .expect("the long-poll answered before its timeout")
        .unwrap()
}

fn pos(v: &Value) -> String {
    v["pos"].as_str().expect("pos").to_owned()
}

fn room_ids(v: &Value) -> Vec<String> {
    let mut ids: Vec<String> = v["rooms"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    ids.sort();
    ids
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

fn bodies(room: &Value) -> Vec<String> {
    room["timeline"]
        .as_array()
        .unwrap_or_else(|| panic!("no timeline in {room}"))
        .iter()
        .map(|e| e["content"]["body"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// (type, state_key) of each `required_state` event, sorted.
fn state_keys(room: &Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = room["required_state"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    (
                        e["type"].as_str().unwrap().to_owned(),
                        e["state_key"].as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn list(ranges: Value, timeline_limit: u64, required_state: Value) -> Value {
    json!({ "ranges": ranges, "timeline_limit": timeline_limit, "required_state": required_state })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_are_listed_by_recency_and_ranges_slice_the_list() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let a = alice.create_room(json!({ "name": "A" })).await;
    let b = alice.create_room(json!({ "name": "B" })).await;
    let c = alice.create_room(json!({ "name": "C" })).await;
    let d = alice.create_room(json!({ "name": "D" })).await;
    alice.send_text(&b, "b1").await;
    // Recency: b (message), d, c, a (creation order).
    let body = |ranges: Value| json!({ "lists": { "all": list(ranges, 1, json!([["m.room.name", ""]])) } });
    let first = ss(&alice, None, body(json!([[0, 1]]))).await;
    assert_eq!(first["lists"]["all"]["count"], 4);
    assert_eq!(room_ids(&first), sorted(vec![b.clone(), d.clone()]));
    let rb = &first["rooms"][&b];
    let rd = &first["rooms"][&d];
    assert_eq!(rb["initial"], true);
    assert_eq!(rb["name"], "B");
    assert_eq!(rb["membership"], "join");
    assert_eq!(bodies(rb), vec!["b1"]);
    assert_eq!(rb["limited"], true);
    assert_eq!(rb["num_live"], 0);
    assert_eq!(rb["joined_count"], 1);
    assert_eq!(rb["invited_count"], 0);
    assert_eq!(rb["notification_count"], 0);
    assert_eq!(
        state_keys(rb),
        vec![("m.room.name".to_owned(), String::new())]
    );
    assert_eq!(rb["required_state"][0]["content"]["name"], "B");
    assert!(rb.get("heroes").is_none(), "a named room has no heroes");
    assert!(rb["bump_stamp"].as_u64().unwrap() > rd["bump_stamp"].as_u64().unwrap());
    assert!(rb["prev_batch"].as_str().unwrap().starts_with('t'));

    // Widening the range sends only the rooms the connection does not have yet.
    let second = ss(&alice, Some(&pos(&first)), body(json!([[0, 3]]))).await;
    assert_eq!(second["lists"]["all"]["count"], 4);
    assert_eq!(room_ids(&second), sorted(vec![a.clone(), c.clone()]));
    assert!(
        second["rooms"][&a]["bump_stamp"].as_u64() < second["rooms"][&c]["bump_stamp"].as_u64()
    );

    // Nothing new: an immediate answer with no rooms.
    let third = ss(&alice, Some(&pos(&second)), body(json!([[0, 3]]))).await;
    assert_eq!(room_ids(&third), Vec::<String>::new());

    // A message in the oldest room sends that room alone, as a delta.
    alice.send_text(&a, "a1").await;
    let fourth = ss(&alice, Some(&pos(&third)), body(json!([[0, 3]]))).await;
    assert_eq!(room_ids(&fourth), vec![a.clone()]);
    let ra = &fourth["rooms"][&a];
    assert!(ra.get("initial").is_none(), "{ra}");
    assert!(
        ra.get("name").is_none(),
        "unchanged fields are not resent: {ra}"
    );
    assert!(ra.get("required_state").is_none(), "{ra}");
    assert_eq!(bodies(ra), vec!["a1"]);
    assert_eq!(ra["num_live"], 1);
    assert_eq!(ra["limited"], false);

    // It is now first: the top-1 range of a new connection is that room.
    let fresh = ss(
        &alice,
        None,
        json!({ "conn_id": "other", "lists": { "top": list(json!([[0, 0]]), 3, json!([])) } }),
    )
    .await;
    assert_eq!(room_ids(&fresh), vec![a.clone()]);
    // The newest three events: the room's last two state events, then the message.
    assert_eq!(bodies(&fresh["rooms"][&a]), vec!["", "", "a1"]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_state_lazy_members_me_and_wildcards() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "name": "R", "topic": "T" }))
        .await;
    bob.join(&room).await;
    carol.join(&room).await;
    alice.send_text(&room, "from alice").await;
    bob.send_text(&room, "from bob").await;
    let member = |u: &Client| ("m.room.member".to_owned(), u.user_id.clone());
    let name = ("m.room.name".to_owned(), String::new());

    // $LAZY: the members of the timeline's senders only; $ME: the requester.
    let body = json!({ "room_subscriptions": { (room.clone()): {
        "timeline_limit": 2,
        "required_state": [["m.room.name", ""], ["m.room.member", "$LAZY"]] } } });
    let first = ss(&alice, None, body.clone()).await;
    let r = &first["rooms"][&room];
    assert_eq!(bodies(r), vec!["from alice", "from bob"]);
    assert_eq!(
        state_keys(r),
        sorted_pairs(vec![name.clone(), member(&alice), member(&bob)])
    );
    assert_eq!(r["joined_count"], 3);

    // A new sender's member event follows in the next delta; known ones do not.
    carol.send_text(&room, "from carol").await;
    bob.send_text(&room, "bob again").await;
    let next = ss(&alice, Some(&pos(&first)), body.clone()).await;
    let r = &next["rooms"][&room];
    assert_eq!(bodies(r), vec!["from carol", "bob again"]);
    assert_eq!(r["num_live"], 2);
    assert_eq!(state_keys(r), vec![member(&carol)]);

    // $ME and a type wildcard on another connection.
    let me = ss(
        &bob,
        None,
        json!({ "room_subscriptions": { (room.clone()): {
            "timeline_limit": 0,
            "required_state": [["m.room.member", "$ME"], ["m.room.topic", "*"]] } } }),
    )
    .await;
    let r = &me["rooms"][&room];
    assert_eq!(
        state_keys(r),
        vec![member(&bob), ("m.room.topic".to_owned(), String::new())]
    );
    assert!(r.get("timeline").is_none() || bodies(r).is_empty());

    // Every member with ["m.room.member", "*"]; everything with ["*", "*"].
    let all = ss(
        &carol,
        None,
        json!({ "room_subscriptions": { (room.clone()): {
            "timeline_limit": 1, "required_state": [["m.room.member", "*"]] } } }),
    )
    .await;
    assert_eq!(
        state_keys(&all["rooms"][&room]),
        sorted_pairs(vec![member(&alice), member(&bob), member(&carol)])
    );
    let everything = ss(
        &carol,
        None,
        json!({ "conn_id": "x", "room_subscriptions": { (room.clone()): {
            "timeline_limit": 1, "required_state": [["*", "*"]] } } }),
    )
    .await;
    let keys = state_keys(&everything["rooms"][&room]);
    for want in [
        ("m.room.create".to_owned(), String::new()),
        ("m.room.power_levels".to_owned(), String::new()),
        ("m.room.join_rules".to_owned(), String::new()),
        ("m.room.topic".to_owned(), String::new()),
        name.clone(),
        member(&alice),
        member(&bob),
        member(&carol),
    ] {
        assert!(keys.contains(&want), "{want:?} missing from {keys:?}");
    }
    ts.stop().await;
}

fn sorted_pairs(mut v: Vec<(String, String)>) -> Vec<(String, String)> {
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_dm_encrypted_invite_and_room_types() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let plain = alice.create_room(json!({ "name": "plain" })).await;
    let _encrypted = alice
        .create_room(json!({ "name": "enc", "initial_state": [
            { "type": "m.room.encryption", "state_key": "", "content": { "algorithm": "m.megolm.v1.aes-sha2" } }
        ] }))
        .await;
    let space = alice
        .create_room(json!({ "name": "space", "creation_content": { "type": "m.space" } }))
        .await;
    let dm = alice.create_room(json!({ "is_direct": true })).await;
    alice
        .put(
            &format!(
                "/_matrix/client/v3/user/{}/account_data/m.direct",
                enc(&alice.user_id)
            ),
            &json!({ (bob.user_id.clone()): [dm.clone()] }),
        )
        .await
        .ok();
    alice
        .put(
            &format!(
                "/_matrix/client/v3/user/{}/rooms/{}/tags/m.favourite",
                enc(&alice.user_id),
                enc(&plain)
            ),
            &json!({ "order": 0.5 }),
        )
        .await
        .ok();
    let invite = bob.create_room(json!({ "name": "invite" })).await;
    bob.invite(&invite, &alice.user_id).await;
    alice
        .put_state(
            &space,
            "m.space.child",
            &plain,
            json!({ "via": ["localhost:8008"] }),
        )
        .await;

    let l = |filters: Value| json!({ "ranges": [[0, 20]], "timeline_limit": 0, "required_state": [], "filters": filters });
    let v = ss(
        &alice,
        None,
        json!({ "lists": {
            "dms": l(json!({ "is_dm": true })),
            "not_dms": l(json!({ "is_dm": false, "is_invite": false })),
            "encrypted": l(json!({ "is_encrypted": true })),
            "invites": l(json!({ "is_invite": true })),
            "spaces": l(json!({ "room_types": ["m.space"] })),
            "no_spaces": l(json!({ "not_room_types": ["m.space"], "is_invite": false })),
            "untyped": l(json!({ "room_types": [null] })),
            "in_space": l(json!({ "spaces": [space.clone()] })),
            "favourites": l(json!({ "tags": ["m.favourite"] })),
            "not_favourites": l(json!({ "not_tags": ["m.favourite"], "is_invite": false })),
        } }),
    )
    .await;
    let count = |name: &str| v["lists"][name]["count"].as_u64().unwrap();
    assert_eq!(count("dms"), 1);
    assert_eq!(count("not_dms"), 3);
    assert_eq!(count("encrypted"), 1);
    assert_eq!(count("invites"), 1);
    assert_eq!(count("spaces"), 1);
    assert_eq!(count("no_spaces"), 3);
    assert_eq!(count("untyped"), 4);
    assert_eq!(count("in_space"), 1);
    assert_eq!(count("favourites"), 1);
    assert_eq!(count("not_favourites"), 3);
    assert_eq!(v["rooms"][&dm]["is_dm"], true);
    assert!(v["rooms"][&plain].get("is_dm").is_none());
    // The invite: stripped state only, no timeline.
    let inv = &v["rooms"][&invite];
    assert_eq!(inv["membership"], "invite");
    assert!(inv.get("timeline").is_none());
    let stripped: Vec<&str> = inv["invite_state"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert!(stripped.contains(&"m.room.name"), "{stripped:?}");
    assert!(stripped.contains(&"m.room.member"), "{stripped:?}");
    // A DM without a name gets heroes.
    let heroes = v["rooms"][&dm]["heroes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        heroes.is_empty(),
        "alice is alone in the DM and is not her own hero: {heroes:?}"
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heroes_counts_and_unread_counts_follow_the_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    alice.invite(&room, &bob.user_id).await;
    bob.join(&room).await;
    alice.invite(&room, &carol.user_id).await;
    let body = json!({ "lists": { "all": list(json!([[0, 9]]), 1, json!([])) } });
    let first = ss(&bob, None, body.clone()).await;
    let r = &first["rooms"][&room];
    assert_eq!(r["joined_count"], 2);
    assert_eq!(r["invited_count"], 1);
    // Joined first, then invited; never the requester.
    let heroes: Vec<&str> = r["heroes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["user_id"].as_str().unwrap())
        .collect();
    assert_eq!(heroes, vec![alice.user_id.as_str(), carol.user_id.as_str()]);
    assert!(r.get("name").is_none());
    assert_eq!(r["notification_count"], 0);

    let m1 = alice.send_text(&room, "one").await;
    alice.send_text(&room, "two").await;
    let second = ss(&bob, Some(&pos(&first)), body.clone()).await;
    let r = &second["rooms"][&room];
    assert_eq!(r["notification_count"], 2);
    assert_eq!(bodies(r), vec!["two"]);
    assert_eq!(r["limited"], true);
    assert!(r.get("joined_count").is_none(), "counts unchanged: {r}");

    // A read receipt changes only the unread count: the room comes back with it.
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
            enc(&room),
            enc(&m1)
        ),
        &json!({}),
    )
    .await
    .ok();
    let third = ss(&bob, Some(&pos(&second)), body.clone()).await;
    let r = &third["rooms"][&room];
    assert_eq!(r["notification_count"], 1);
    assert!(r.get("timeline").is_none(), "{r}");

    // Carol joins: counts change and the room is sent with them.
    carol.join(&room).await;
    let fourth = ss(&bob, Some(&pos(&third)), body.clone()).await;
    let r = &fourth["rooms"][&room];
    assert_eq!(r["joined_count"], 3);
    assert_eq!(r["invited_count"], 0);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bigger_timeline_limit_expands_the_timeline() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "name": "x" })).await;
    for i in 0..6 {
        alice.send_text(&room, &format!("m{i}")).await;
    }
    let first = ss(
        &alice,
        None,
        json!({ "lists": { "all": list(json!([[0, 0]]), 1, json!([])) } }),
    )
    .await;
    assert_eq!(bodies(&first["rooms"][&room]), vec!["m5"]);
    let second = ss(
        &alice,
        Some(&pos(&first)),
        json!({ "lists": { "all": list(json!([[0, 0]]), 1, json!([])) },
                "room_subscriptions": { (room.clone()): { "timeline_limit": 4, "required_state": [] } } }),
    )
    .await;
    let r = &second["rooms"][&room];
    assert_eq!(r["unstable_expanded_timeline"], true);
    assert_eq!(bodies(r), vec!["m2", "m3", "m4", "m5"]);
    assert_eq!(r["num_live"], 0);
    assert!(r.get("initial").is_none());
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_pos_and_bad_requests_are_client_errors() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let r = alice.post(&format!("{SS}?pos=nope"), &json!({})).await;
    r.expect_err(400, "M_UNKNOWN_POS");
    let first = ss(&alice, None, json!({ "conn_id": "a" })).await;
    // A pos belongs to its connection.
    let r = alice
        .post(
            &format!("{SS}?pos={}", enc(&pos(&first))),
            &json!({ "conn_id": "b" }),
        )
        .await;
    r.expect_err(400, "M_UNKNOWN_POS");
    let r = alice
        .post(
            SS,
            &json!({ "lists": { "a": { "ranges": [[3, 1]], "timeline_limit": 1 } } }),
        )
        .await;
    r.expect_err(400, "M_INVALID_PARAM");
    let r = alice.post(SS, &json!({ "lists": "nope" })).await;
    r.expect_err(400, "M_BAD_JSON");
    let r = alice.post(&format!("{SS}?timeout=soon"), &json!({})).await;
    r.expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_wakes_on_a_message_in_one_of_its_rooms() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let body = json!({ "lists": { "all": list(json!([[0, 9]]), 5, json!([])) } });
    let first = ss(&bob, None, body.clone()).await;
    let waiting = long_poll(&bob, &pos(&first), body.clone()).await;
    alice.send_text(&room, "wake up").await;
    let v = answer(waiting).await;
    assert_eq!(room_ids(&v), vec![room.clone()]);
    assert_eq!(bodies(&v["rooms"][&room]), vec!["wake up"]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extensions_account_data_receipts_and_typing_follow_their_scope() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let old = alice.create_room(json!({ "preset": "public_chat" })).await;
    let top = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&old).await;
    bob.join(&top).await;
    let msg = alice.send_text(&top, "hi").await;
    let body = json!({
        "lists": { "top": list(json!([[0, 0]]), 1, json!([])) },
        "extensions": {
            "account_data": { "enabled": true },
            "receipts": { "enabled": true, "lists": ["top"] },
            "typing": { "enabled": true, "lists": ["top"] },
        }
    });
    bob.put(
        &format!(
            "/_matrix/client/v3/user/{}/account_data/org.example.global",
            enc(&bob.user_id)
        ),
        &json!({ "g": 2 }),
    )
    .await
    .ok();
    bob.put(
        &format!(
            "/_matrix/client/v3/user/{}/rooms/{}/account_data/org.example.room",
            enc(&bob.user_id),
            enc(&top)
        ),
        &json!({ "r": 1 }),
    )
    .await
    .ok();
    alice
        .post(
            &format!(
                "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
                enc(&top),
                enc(&msg)
            ),
            &json!({}),
        )
        .await
        .ok();
    let first = ss(&bob, None, body.clone()).await;
    assert_eq!(room_ids(&first), vec![top.clone()]);
    let ext = &first["extensions"];
    let global: Vec<&Value> = ext["account_data"]["global"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "org.example.global")
        .collect();
    assert_eq!(global.len(), 1);
    assert_eq!(global[0]["content"], json!({ "g": 2 }));
    // The push rules are global account data too (as in /sync, and as Element X reads
    // them): the whole ruleset when the extension starts.
    let rules: Vec<&Value> = ext["account_data"]["global"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.push_rules")
        .collect();
    assert_eq!(rules.len(), 1, "{ext}");
    assert_eq!(
        rules[0]["content"]["global"]["override"][0]["rule_id"],
        ".m.rule.master"
    );
    assert_eq!(
        ext["account_data"]["rooms"][&top],
        json!([{ "type": "org.example.room", "content": { "r": 1 } }])
    );
    assert_eq!(
        ext["receipts"]["rooms"][&top]["content"][&msg]["m.read"][&alice.user_id]["ts"]
            .as_u64()
            .map(|_| true),
        Some(true),
        "{ext}"
    );
    assert!(ext.get("typing").is_none(), "nobody types: {ext}");

    // Typing in the room of the list shows; typing in a room outside the range does not.
    for room in [&top, &old] {
        alice
            .put(
                &format!(
                    "/_matrix/client/v3/rooms/{}/typing/{}",
                    enc(room),
                    enc(&alice.user_id)
                ),
                &json!({ "typing": true, "timeout": 30000 }),
            )
            .await
            .ok();
    }
    let second = ss(&bob, Some(&pos(&first)), body.clone()).await;
    let ext = &second["extensions"];
    assert_eq!(
        ext["typing"]["rooms"],
        json!({ (top.clone()): { "type": "m.typing", "content": { "user_ids": [alice.user_id.clone()] } } })
    );
    assert!(ext.get("account_data").is_none(), "no change: {ext}");
    assert!(ext.get("receipts").is_none(), "no change: {ext}");

    // Incremental account data: only the change.
    bob.put(
        &format!(
            "/_matrix/client/v3/user/{}/account_data/org.example.other",
            enc(&bob.user_id)
        ),
        &json!({ "o": 1 }),
    )
    .await
    .ok();
    let third = ss(&bob, Some(&pos(&second)), body.clone()).await;
    assert_eq!(
        third["extensions"]["account_data"],
        json!({ "global": [{ "type": "org.example.other", "content": { "o": 1 } }] })
    );

    // A push rule change wakes a waiting request and carries the new ruleset.
    let waiting = long_poll(&bob, &pos(&third), body.clone()).await;
    bob.put(
        "/_matrix/client/v3/pushrules/global/content/cats",
        &json!({ "pattern": "cat*", "actions": ["notify"] }),
    )
    .await
    .ok();
    let fourth = answer(waiting).await;
    let global = &fourth["extensions"]["account_data"]["global"];
    assert_eq!(global.as_array().map(Vec::len), Some(1), "{global}");
    assert_eq!(global[0]["type"], "m.push_rules");
    let content_rules: Vec<&Value> = global[0]["content"]["global"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["rule_id"])
        .collect();
    assert_eq!(content_rules[0], &json!("cats"), "{global}");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_is_sent_as_a_delta_then_the_room_leaves_the_list() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let stays = alice
        .create_room(json!({ "preset": "public_chat", "name": "stays" }))
        .await;
    let left = alice
        .create_room(json!({ "preset": "public_chat", "name": "left" }))
        .await;
    let kicked = alice
        .create_room(json!({ "preset": "public_chat", "name": "kicked" }))
        .await;
    for r in [&stays, &left, &kicked] {
        bob.join(r).await;
    }
    let body =
        json!({ "lists": { "all": list(json!([[0, 9]]), 2, json!([["m.room.name", ""]])) } });
    let first = ss(&bob, None, body.clone()).await;
    assert_eq!(first["lists"]["all"]["count"], 3);
    bob.leave(&left).await;
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/kick", enc(&kicked)),
            &json!({ "user_id": bob.user_id }),
        )
        .await
        .ok();
    alice.send_text(&left, "after bob left").await;
    let second = ss(&bob, Some(&pos(&first)), body.clone()).await;
    assert_eq!(
        room_ids(&second),
        sorted(vec![left.clone(), kicked.clone()])
    );
    for room in [&left, &kicked] {
        let r = &second["rooms"][room];
        assert_eq!(r["membership"], "leave");
        assert!(r.get("initial").is_none(), "{r}");
        let last = r["timeline"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(last["type"], "m.room.member");
        assert_eq!(last["state_key"], bob.user_id);
        assert_eq!(last["content"]["membership"], "leave");
        // Nothing after the leave.
        assert!(!r.to_string().contains("after bob left"));
    }
    // Self-left rooms drop out of the list once the client knows; kicks stay.
    let third = ss(&bob, Some(&pos(&second)), body.clone()).await;
    assert_eq!(third["lists"]["all"]["count"], 2);
    assert_eq!(room_ids(&third), Vec::<String>::new());
    ts.stop().await;
}

/// `(notification_count, highlight_count)` of a room in a sliding sync answer.
fn unread(room: &Value) -> (u64, u64) {
    (
        room["notification_count"]
            .as_u64()
            .expect("notification_count"),
        room["highlight_count"].as_u64().expect("highlight_count"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mention_of_the_user_is_a_highlight() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let body = json!({ "lists": { "all": list(json!([[0, 9]]), 1, json!([])) } });
    let first = ss(&bob, None, body.clone()).await;
    assert_eq!(unread(&first["rooms"][&room]), (0, 0));
    alice.send_text(&room, "plain").await;
    let second = ss(&bob, Some(&pos(&first)), body.clone()).await;
    assert_eq!(unread(&second["rooms"][&room]), (1, 0));
    // The push projection's `.m.rule.is_user_mention`: notify and highlight.
    alice
        .send_txn(
            &room,
            "m.room.message",
            &txn(),
            &json!({ "msgtype": "m.text", "body": "hi bob", "m.mentions": { "user_ids": [bob.user_id] } }),
        )
        .await
        .ok();
    let third = ss(&bob, Some(&pos(&second)), body.clone()).await;
    assert_eq!(unread(&third["rooms"][&room]), (2, 1));
    // A new connection reads the same counts.
    let fresh = ss(
        &bob,
        None,
        json!({ "conn_id": "c2", "lists": { "all": list(json!([[0, 9]]), 1, json!([])) } }),
    )
    .await;
    assert_eq!(unread(&fresh["rooms"][&room]), (2, 1));
    ts.stop().await;
}

fn bump(v: &Value, room: &str) -> Option<u64> {
    v["rooms"][room]["bump_stamp"].as_u64()
}

/// Only "proper activity" (MSC4186, Synapse's default bump event types) moves a room
/// up the list and changes its `bump_stamp`: a reaction or a state change does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reactions_and_state_changes_do_not_bump_a_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let a = alice.create_room(json!({ "name": "A" })).await;
    let b = alice.create_room(json!({ "name": "B" })).await;
    let in_a = alice.send_text(&a, "a1").await;
    let b1 = alice.send_text(&b, "b1").await;
    let order_body = json!({ "lists": { "all": list(json!([[0, 0]]), 1, json!([])) } });
    let body = json!({ "lists": { "all": list(json!([[0, 1]]), 1, json!([])) } });
    let first = ss(&alice, None, body.clone()).await;
    assert_eq!(room_ids(&first), sorted(vec![a.clone(), b.clone()]));
    let (bump_a, bump_b) = (bump(&first, &a).unwrap(), bump(&first, &b).unwrap());
    assert!(bump_b > bump_a, "{first}");
    // The message positions are the bump stamps.
    let b1_pos = ts.server.projections.timeline.event(&b1).unwrap().position;
    let a1_pos = ts
        .server
        .projections
        .timeline
        .event(&in_a)
        .unwrap()
        .position;
    assert_eq!((bump_a, bump_b), (a1_pos, b1_pos));

    // A reaction and a topic change in A: A is sent (its timeline grew) without a new
    // bump stamp, and B stays first.
    alice.react(&a, &in_a, "👍").await;
    alice
        .put_state(&a, "m.room.topic", "", json!({ "topic": "quiet" }))
        .await;
    let second = ss(&alice, Some(&pos(&first)), body.clone()).await;
    assert_eq!(room_ids(&second), vec![a.clone()]);
    let ra = &second["rooms"][&a];
    assert!(ra.get("bump_stamp").is_none(), "{ra}");
    assert_eq!(ra["timeline"].as_array().unwrap().len(), 1);
    let top = ss(
        &alice,
        None,
        json!({ "conn_id": "top1", "lists": order_body["lists"] }),
    )
    .await;
    assert_eq!(room_ids(&top), vec![b.clone()]);
    assert_eq!(bump(&top, &b), Some(b1_pos));

    // A message in A bumps it to the top, with its position as the new stamp.
    let a2 = alice.send_text(&a, "a2").await;
    let third = ss(&alice, Some(&pos(&second)), body.clone()).await;
    // (The request waited for the projections: the event is applied.)
    let a2_pos = ts.server.projections.timeline.event(&a2).unwrap().position;
    assert_eq!(bump(&third, &a), Some(a2_pos));
    let top = ss(
        &alice,
        None,
        json!({ "conn_id": "top2", "lists": order_body["lists"] }),
    )
    .await;
    assert_eq!(room_ids(&top), vec![a.clone()]);
    ts.stop().await;
}

fn to_device_bodies(v: &Value) -> Vec<String> {
    v["extensions"]["to_device"]["events"]
        .as_array()
        .unwrap_or_else(|| panic!("no to_device events in {v}"))
        .iter()
        .map(|e| e["content"]["body"].as_str().unwrap().to_owned())
        .collect()
}

fn next_batch(v: &Value) -> String {
    v["extensions"]["to_device"]["next_batch"]
        .as_str()
        .expect("to_device next_batch")
        .to_owned()
}

async fn send_to_device(from: &Client, to: &Client, body: &str) {
    from.put(
        &format!("/_matrix/client/v3/sendToDevice/m.test/{}", txn()),
        &json!({ "messages": { (to.user_id.clone()): { (to.device_id.clone()): { "body": body } } } }),
    )
    .await
    .ok();
}

fn to_device_body(conn: &str, since: Option<&str>, limit: Option<u64>) -> Value {
    let mut td = json!({ "enabled": true });
    if let Some(s) = since {
        td["since"] = json!(s);
    }
    if let Some(l) = limit {
        td["limit"] = json!(l);
    }
    json!({ "conn_id": conn, "extensions": { "to_device": td } })
}

/// MSC3885 through sliding sync, with `/sync`'s semantics: each message is delivered
/// until the next request's `since` acknowledges it, then never again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn to_device_is_delivered_until_acknowledged_then_never_again() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    send_to_device(&bob, &alice, "one").await;
    send_to_device(&bob, &alice, "two").await;
    let first = ss(&alice, None, to_device_body("td", None, None)).await;
    assert_eq!(to_device_bodies(&first), vec!["one", "two"]);
    assert_eq!(
        first["extensions"]["to_device"]["events"][0],
        json!({ "sender": bob.user_id, "type": "m.test", "content": { "body": "one" } })
    );
    let nb1 = next_batch(&first);
    // Not acknowledged: a request without `since` (a retry, another connection) gets
    // them again.
    let retry = ss(&alice, None, to_device_body("other", None, None)).await;
    assert_eq!(to_device_bodies(&retry), vec!["one", "two"]);
    // `since` acknowledges them: gone for good, on every connection.
    let second = ss(
        &alice,
        Some(&pos(&first)),
        to_device_body("td", Some(&nb1), None),
    )
    .await;
    assert_eq!(to_device_bodies(&second), Vec::<String>::new());
    let again = ss(&alice, None, to_device_body("third", None, None)).await;
    assert_eq!(to_device_bodies(&again), Vec::<String>::new());

    // `limit` pages: two of three, then the third; the page's next_batch acknowledges
    // exactly what it carried.
    for b in ["p1", "p2", "p3"] {
        send_to_device(&bob, &alice, b).await;
    }
    let page1 = ss(
        &alice,
        Some(&pos(&second)),
        to_device_body("td", Some(&nb1), Some(2)),
    )
    .await;
    assert_eq!(to_device_bodies(&page1), vec!["p1", "p2"]);
    let page2 = ss(
        &alice,
        Some(&pos(&page1)),
        to_device_body("td", Some(&next_batch(&page1)), Some(2)),
    )
    .await;
    assert_eq!(to_device_bodies(&page2), vec!["p3"]);
    let page3 = ss(
        &alice,
        Some(&pos(&page2)),
        to_device_body("td", Some(&next_batch(&page2)), Some(2)),
    )
    .await;
    assert_eq!(to_device_bodies(&page3), Vec::<String>::new());

    // A `since` this server never gave is refused.
    alice
        .post(SS, &to_device_body("bad", Some("not-a-token"), None))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(SS, &to_device_body("bad", Some("999999999"), None))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_wakes_for_a_to_device_message() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let first = ss(&alice, None, to_device_body("td", None, None)).await;
    let body = to_device_body("td", Some(&next_batch(&first)), None);
    let waiting = long_poll(&alice, &pos(&first), body).await;
    send_to_device(&bob, &alice, "wake").await;
    let v = answer(waiting).await;
    assert_eq!(to_device_bodies(&v), vec!["wake"]);
    ts.stop().await;
}

async fn upload_device_keys(c: &Client) -> common::TestKey {
    let (keys, key) = device_keys(c);
    c.post(
        "/_matrix/client/v3/keys/upload",
        &json!({ "device_keys": keys }),
    )
    .await
    .ok();
    key
}

/// MSC3884 through sliding sync: device-list changes of users sharing a room (not of
/// strangers), leaves, and the device's own key counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2ee_extension_reports_room_mates_device_lists_and_key_counts() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let body = json!({ "extensions": { "e2ee": { "enabled": true } } });
    let first = ss(&alice, None, body.clone()).await;
    assert_eq!(
        first["extensions"]["e2ee"],
        json!({
            "device_lists": { "changed": [], "left": [] },
            "device_one_time_keys_count": { "signed_curve25519": 0 },
            "device_unused_fallback_key_types": [],
        })
    );

    // Bob (a room-mate) and carol (a stranger) upload device keys: alice hears of bob.
    upload_device_keys(&bob).await;
    upload_device_keys(&carol).await;
    let second = ss(&alice, Some(&pos(&first)), body.clone()).await;
    assert_eq!(
        second["extensions"]["e2ee"]["device_lists"],
        json!({ "changed": [bob.user_id], "left": [] })
    );

    // Alice's own one-time and fallback keys are counted.
    let key = upload_device_keys(&alice).await;
    let mut otks = serde_json::Map::new();
    for i in 0..3 {
        otks.insert(
            format!("signed_curve25519:K{i}"),
            key.sign(&alice.user_id, json!({ "key": format!("otk{i}") })),
        );
    }
    let fallback = key.sign(&alice.user_id, json!({ "key": "fb", "fallback": true }));
    alice
        .post(
            "/_matrix/client/v3/keys/upload",
            &json!({ "one_time_keys": otks, "fallback_keys": { "signed_curve25519:F1": fallback } }),
        )
        .await
        .ok();
    let third = ss(&alice, Some(&pos(&second)), body.clone()).await;
    let e = &third["extensions"]["e2ee"];
    assert_eq!(
        e["device_one_time_keys_count"],
        json!({ "signed_curve25519": 3 })
    );
    assert_eq!(
        e["device_unused_fallback_key_types"],
        json!(["signed_curve25519"])
    );
    assert_eq!(e["device_lists"]["changed"], json!([alice.user_id]));

    // Bob leaves: alice shares no room with him any more.
    bob.leave(&room).await;
    let fourth = ss(&alice, Some(&pos(&third)), body.clone()).await;
    assert_eq!(
        fourth["extensions"]["e2ee"]["device_lists"],
        json!({ "changed": [], "left": [bob.user_id] })
    );

    // A waiting request wakes for a room-mate's key upload, not a stranger's.
    carol.join(&room).await;
    let fifth = ss(&alice, Some(&pos(&fourth)), body.clone()).await;
    assert_eq!(
        fifth["extensions"]["e2ee"]["device_lists"]["changed"],
        json!([carol.user_id])
    );
    let waiting = long_poll(&alice, &pos(&fifth), body.clone()).await;
    let carol2 = ts.login("carol", Some("CAROL2")).await;
    upload_device_keys(&carol2).await;
    let v = answer(waiting).await;
    assert_eq!(
        v["extensions"]["e2ee"]["device_lists"],
        json!({ "changed": [carol.user_id], "left": [] })
    );
    ts.stop().await;
}

/// A waiting request whose `to_device` messages were acknowledged by another
/// connection of the same device waits (it does not wake again and again for messages
/// that are gone): its store reads stay those of a few builds, not of a busy loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_does_not_spin_on_messages_another_connection_acknowledged() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    send_to_device(&bob, &alice, "x").await;
    let a = ss(&alice, None, to_device_body("a", None, None)).await;
    assert_eq!(to_device_bodies(&a), vec!["x"]);
    let b = ss(&alice, None, to_device_body("b", None, None)).await;
    let b2 = ss(
        &alice,
        Some(&pos(&b)),
        to_device_body("b", Some(&next_batch(&b)), None),
    )
    .await;
    assert_eq!(to_device_bodies(&b2), Vec::<String>::new());
    let reads = || ts.server.projections.db.stats().total();
    let before = reads();
    let v = alice
        .post(
            &format!("{SS}?pos={}&timeout=1500", enc(&pos(&a))),
            &to_device_body("a", None, None),
        )
        .await
        .ok();
    let used = reads() - before;
    assert_eq!(to_device_bodies(&v), Vec::<String>::new());
    assert!(used < 200, "a 1.5 s wait cost {used} store reads");
    ts.stop().await;
}
