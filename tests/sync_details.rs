//! `/sync` details clients and test suites trip on (issue 15, item 4): lazy-loaded
//! members in incremental syncs, the state a rejoin brings, joining and leaving within
//! one batch, `limited`, `event_format: federation`, ignored users, and invalid filters.
//! SPEC.md ("Sync") describes each behaviour.

mod common;

use common::{Client, TestServer, enc, ids};
use serde_json::{Value, json};

const V3: &str = "/_matrix/client/v3";
/// Simplified Sliding Sync (MSC4186), on its unstable path.
const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";

fn next_batch(v: &Value) -> String {
    v["next_batch"].as_str().unwrap().to_owned()
}

/// `filter` percent-encoded for a query string.
fn inline(filter: &Value) -> String {
    enc(&filter.to_string())
}

/// The id of `user`'s current member event in `room`.
async fn member_event_id(c: &Client, room: &str, user: &str) -> String {
    state_event_id(c, room, "m.room.member", user).await
}

/// The id of the current state event `(kind, key)` in `room`.
async fn state_event_id(c: &Client, room: &str, kind: &str, key: &str) -> String {
    let path = if key.is_empty() {
        format!("{V3}/rooms/{}/state/{}?format=event", enc(room), enc(kind))
    } else {
        format!(
            "{V3}/rooms/{}/state/{}/{}?format=event",
            enc(room),
            enc(kind),
            enc(key)
        )
    };
    c.get(&path).await.ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Posts a filter; returns its id.
async fn filter_id(c: &Client, filter: &Value) -> String {
    c.post(&format!("{V3}/user/{}/filter", enc(&c.user_id)), filter)
        .await
        .ok()["filter_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Event ids of a room's `state` section (sorted; the spec orders nothing there).
fn state_ids(sync: &Value, section: &str, room: &str) -> Vec<String> {
    let mut v = ids(&sync["rooms"][section][room]["state"]["events"]);
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_loading_sends_each_timeline_senders_membership_once() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    // Senders named after the heroes (members sort by user id; the summary's
    // `m.heroes` are the first five, and their member events are lazily loaded too).
    let bob = ts.register("yan").await;
    let carol = ts.register("zed").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    let mut hero_joins = Vec::new();
    for i in 1..=5 {
        let hero = ts.register(&format!("hero{i}")).await;
        hero.join(&room).await;
        hero_joins.push(member_event_id(&alice, &room, &hero.user_id).await);
    }
    bob.join(&room).await;
    carol.join(&room).await;
    alice.send_text(&room, "one").await;
    alice.send_text(&room, "two").await;
    let alice_join = member_event_id(&alice, &room, &alice.user_id).await;
    let bob_join = member_event_id(&alice, &room, &bob.user_id).await;
    let carol_join = member_event_id(&alice, &room, &carol.user_id).await;
    let lazy = filter_id(
        &alice,
        &json!({ "room": { "state": { "lazy_load_members": true }, "timeline": { "limit": 2 } } }),
    )
    .await;
    let first = alice.sync(&format!("filter={lazy}")).await;
    // Only alice sent in the initial timeline: her member event is loaded, and the
    // heroes' (to name the room).
    let mut members: Vec<String> = first["rooms"]["join"][&room]["state"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.member")
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect();
    members.sort();
    let mut want = hero_joins.clone();
    want.push(alice_join.clone());
    want.sort();
    assert_eq!(members, want);
    assert_eq!(
        first["rooms"]["join"][&room]["summary"]["m.heroes"]
            .as_array()
            .unwrap()
            .len(),
        5
    );

    // A plain incremental sync: bob's first message brings his membership.
    let hello = bob.send_text(&room, "hello").await;
    let second = alice
        .sync(&format!("filter={lazy}&since={}", next_batch(&first)))
        .await;
    let r = &second["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![hello.clone()]);
    assert_eq!(r["timeline"]["limited"], json!(false));
    assert_eq!(state_ids(&second, "join", &room), vec![bob_join.clone()]);

    // Bob again: this device holds his membership, it is not sent again.
    let again = bob.send_text(&room, "again").await;
    let third = alice
        .sync(&format!("filter={lazy}&since={}", next_batch(&second)))
        .await;
    let r = &third["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![again.clone()]);
    assert_eq!(state_ids(&third, "join", &room), Vec::<String>::new());

    // A retry from an older token (the response that carried bob's membership was
    // lost): it is sent again.
    let retry = alice
        .sync(&format!("filter={lazy}&since={}", next_batch(&first)))
        .await;
    assert_eq!(state_ids(&retry, "join", &room), vec![bob_join.clone()]);
    // `include_redundant_members`: always sent.
    let redundant = json!({ "room": { "state": { "lazy_load_members": true, "include_redundant_members": true }, "timeline": { "limit": 2 } } });
    let r2 = alice
        .sync(&format!(
            "filter={}&since={}",
            inline(&redundant),
            next_batch(&second)
        ))
        .await;
    // (The summary goes with a member event, and with it the heroes' members.)
    let mut want = hero_joins.clone();
    want.push(bob_join.clone());
    want.sort();
    assert_eq!(state_ids(&r2, "join", &room), want);

    // After a gap (limited): carol's messages overflow the limit; her membership
    // (unchanged in the gap) comes with them.
    let mut sent = Vec::new();
    for i in 0..4 {
        sent.push(carol.send_text(&room, &format!("c{i}")).await);
    }
    let fourth = alice
        .sync(&format!("filter={lazy}&since={}", next_batch(&third)))
        .await;
    let r = &fourth["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), sent[2..].to_vec());
    assert_eq!(r["timeline"]["limited"], json!(true));
    assert_eq!(state_ids(&fourth, "join", &room), vec![carol_join.clone()]);
    // And a sender whose own join is in the timeline needs no state entry.
    let dave = ts.register("zz").await;
    dave.join(&room).await;
    let dave_hi = dave.send_text(&room, "hi").await;
    let dave_join = member_event_id(&alice, &room, &dave.user_id).await;
    let fifth = alice
        .sync(&format!("filter={lazy}&since={}", next_batch(&fourth)))
        .await;
    let r = &fifth["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![dave_join, dave_hi]);
    assert_eq!(state_ids(&fifth, "join", &room), Vec::<String>::new());
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejoin_sync_carries_the_state_changed_while_away() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "initial_state": [
            { "type": "m.room.history_visibility", "state_key": "", "content": { "history_visibility": "joined" } }
        ] }))
        .await;
    bob.join(&room).await;
    let first = bob.sync("").await;
    assert!(first["rooms"]["join"].get(&room).is_some());
    bob.leave(&room).await;
    let leave = member_event_id(&alice, &room, &bob.user_id).await;
    let topic = alice
        .put_state(
            &room,
            "m.room.topic",
            "",
            json!({ "topic": "changed while away" }),
        )
        .await;
    let away = alice.send_text(&room, "while bob was away").await;
    bob.join(&room).await;
    let rejoin = member_event_id(&alice, &room, &bob.user_id).await;
    let next = bob.sync(&format!("since={}", next_batch(&first))).await;
    let r = &next["rooms"]["join"][&room];
    let timeline = ids(&r["timeline"]["events"]);
    // Bob's leave, the topic and the message are hidden from him (history
    // "joined"); the timeline ends with his rejoin.
    // The room goes whole (newly joined): its whole history fits in the timeline,
    // from the create event to the rejoin, less what bob may not see.
    assert_eq!(timeline[timeline.len() - 2..], [leave, rejoin]);
    assert!(!timeline.contains(&topic) && !timeline.contains(&away));
    assert_eq!(r["timeline"]["limited"], json!(true));
    // The state the timeline does not show: the topic set while he was away.
    assert_eq!(state_ids(&next, "join", &room), vec![topic]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_and_leaving_within_one_batch_gives_the_whole_leave_entry() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "name": "Short visit" }))
        .await;
    let first = bob.sync("").await;
    assert!(first["rooms"]["join"].get(&room).is_none());
    bob.join(&room).await;
    let join = member_event_id(&alice, &room, &bob.user_id).await;
    let msg = alice.send_text(&room, "hello and goodbye").await;
    bob.leave(&room).await;
    let leave = member_event_id(&alice, &room, &bob.user_id).await;
    let create = state_event_id(&alice, &room, "m.room.create", "").await;
    let name = state_event_id(&alice, &room, "m.room.name", "").await;
    let power = state_event_id(&alice, &room, "m.room.power_levels", "").await;
    let alice_join = member_event_id(&alice, &room, &alice.user_id).await;
    let filter = json!({ "room": { "timeline": { "limit": 3 } } });
    let next = bob
        .sync(&format!(
            "filter={}&since={}",
            inline(&filter),
            next_batch(&first)
        ))
        .await;
    assert!(next["rooms"]["join"].get(&room).is_none());
    let r = &next["rooms"]["leave"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![join, msg, leave]);
    assert_eq!(r["timeline"]["limited"], json!(true));
    let state = state_ids(&next, "leave", &room);
    for id in [&create, &name, &power, &alice_join] {
        assert!(
            state.contains(id),
            "{id} in the leave entry's state: {state:?}"
        );
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_is_true_whenever_events_were_left_out() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    let filter = json!({ "room": { "timeline": { "limit": 2, "not_types": ["m.room.topic"] } } });
    let f = inline(&filter);
    let s0 = alice.sync(&format!("filter={f}")).await;
    // Within the limit, nothing left out: not limited.
    let m1 = alice.send_text(&room, "m1").await;
    let s1 = alice
        .sync(&format!("filter={f}&since={}", next_batch(&s0)))
        .await;
    let r = &s1["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![m1]);
    assert_eq!(r["timeline"]["limited"], json!(false));
    assert_eq!(state_ids(&s1, "join", &room), Vec::<String>::new());
    // Over the limit: limited.
    let mut m = Vec::new();
    for i in 0..3 {
        m.push(alice.send_text(&room, &format!("over {i}")).await);
    }
    let s2 = alice
        .sync(&format!("filter={f}&since={}", next_batch(&s1)))
        .await;
    let r = &s2["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), m[1..].to_vec());
    assert_eq!(r["timeline"]["limited"], json!(true));
    // A state event the filter drops: limited, and its change is in `state`.
    let topic = alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "filtered" }))
        .await;
    let after = alice.send_text(&room, "after the topic").await;
    let s3 = alice
        .sync(&format!("filter={f}&since={}", next_batch(&s2)))
        .await;
    let r = &s3["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![after]);
    assert_eq!(r["timeline"]["limited"], json!(true));
    assert_eq!(state_ids(&s3, "join", &room), vec![topic]);
    // A newly joined room is limited even when its whole history fits.
    let b0 = bob.sync("").await;
    bob.join(&room).await;
    let b1 = bob.sync(&format!("since={}", next_batch(&b0))).await;
    assert_eq!(
        b1["rooms"]["join"][&room]["timeline"]["limited"],
        json!(true)
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_format_federation_returns_pdus() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let s0 = alice.sync("").await;
    let txn = common::txn();
    let sent = alice
        .send_txn(
            &room,
            "m.room.message",
            &txn,
            &json!({ "msgtype": "m.text", "body": "pdu" }),
        )
        .await
        .ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let check = |ev: &Value| {
        assert_eq!(ev["event_id"], json!(sent), "{ev}");
        assert_eq!(ev["room_id"], json!(room), "{ev}");
        for field in ["auth_events", "prev_events", "hashes", "signatures"] {
            assert!(ev.get(field).is_some(), "{field} in {ev}");
        }
        assert!(ev["depth"].is_u64(), "{ev}");
        assert_eq!(ev["content"]["body"], "pdu");
        let unsigned = ev["unsigned"].as_object().unwrap();
        assert!(!unsigned.contains_key("transaction_id"), "{ev}");
        assert!(!unsigned.contains_key("membership"), "{ev}");
    };
    let fed = json!({ "event_format": "federation" });
    let s1 = alice
        .sync(&format!(
            "filter={}&since={}",
            inline(&fed),
            next_batch(&s0)
        ))
        .await;
    let events = s1["rooms"]["join"][&room]["timeline"]["events"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(events.len(), 1);
    check(&events[0]);
    // The client format of the same event carries the transaction id.
    let plain = alice.sync(&format!("since={}", next_batch(&s0))).await;
    let ev = &plain["rooms"]["join"][&room]["timeline"]["events"][0];
    assert_eq!(ev["unsigned"]["transaction_id"], json!(txn));
    assert!(ev.get("hashes").is_none());
    // `/messages` honours it too (as Synapse).
    let page = alice
        .messages(&room, &format!("dir=b&limit=1&filter={}", inline(&fed)))
        .await;
    check(&page["chunk"][0]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_users_are_left_out_of_timelines_invites_and_ephemeral_data() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    carol.join(&room).await;
    let ignore = |users: Value| {
        let alice = alice.clone();
        async move {
            alice
                .put(
                    &format!(
                        "{V3}/user/{}/account_data/m.ignored_user_list",
                        enc(&alice.user_id)
                    ),
                    &json!({ "ignored_users": users }),
                )
                .await
                .ok();
        }
    };
    ignore(json!({ bob.user_id.clone(): {} })).await;
    let s0 = alice.sync("").await;
    bob.send_text(&room, "from bob").await;
    let from_carol = carol.send_text(&room, "from carol").await;
    for who in [&bob, &carol] {
        who.put(
            &format!("{V3}/rooms/{}/typing/{}", enc(&room), enc(&who.user_id)),
            &json!({ "typing": true, "timeout": 30_000 }),
        )
        .await
        .ok();
        who.post(
            &format!(
                "{V3}/rooms/{}/receipt/m.read/{}",
                enc(&room),
                enc(&from_carol)
            ),
            &json!({}),
        )
        .await
        .ok();
    }
    let other = bob.create_room(json!({})).await;
    bob.invite(&other, &alice.user_id).await;
    let s1 = alice.sync(&format!("since={}", next_batch(&s0))).await;
    let r = &s1["rooms"]["join"][&room];
    assert_eq!(ids(&r["timeline"]["events"]), vec![from_carol.clone()]);
    let ephemeral = r["ephemeral"]["events"].as_array().unwrap();
    let typing = ephemeral.iter().find(|e| e["type"] == "m.typing").unwrap();
    assert_eq!(typing["content"]["user_ids"], json!([carol.user_id]));
    let receipt = ephemeral.iter().find(|e| e["type"] == "m.receipt").unwrap();
    let readers: Vec<&String> = receipt["content"][&from_carol]["m.read"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(readers, vec![&carol.user_id]);
    assert!(s1["rooms"]["invite"].get(&other).is_none(), "{s1}");
    // `/messages` and `/context` leave bob's message out too.
    let carol_join = member_event_id(&alice, &room, &carol.user_id).await;
    let page = alice.messages(&room, "dir=b&limit=2").await;
    assert_eq!(
        ids(&page["chunk"]),
        vec![from_carol.clone(), carol_join.clone()]
    );
    let ctx = alice.context(&room, &from_carol, 2).await.ok();
    assert_eq!(ids(&ctx["events_before"]), vec![carol_join.clone()]);
    // Bob's state events still count: his membership is in the room's state.
    let bob_join = member_event_id(&alice, &room, &bob.user_id).await;
    let full = alice.sync("").await;
    assert!(
        state_ids(&full, "join", &room).contains(&bob_join)
            || ids(&full["rooms"]["join"][&room]["timeline"]["events"]).contains(&bob_join)
    );

    // Unignoring changes nothing already sent; what bob sends next comes through.
    ignore(json!({})).await;
    let later = bob.send_text(&room, "bob again").await;
    let s2 = alice.sync(&format!("since={}", next_batch(&s1))).await;
    assert_eq!(sync_timeline(&s2, &room), vec![later], "{s2}");
    ts.stop().await;
}

fn sync_timeline(sync: &Value, room: &str) -> Vec<String> {
    common::sync_timeline_ids(sync, "join", room)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_filters_are_refused_with_400() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let path = format!("{V3}/user/{}/filter", enc(&alice.user_id));
    // Not JSON.
    alice
        .raw(
            reqwest::Method::POST,
            &path,
            Some(b"{not json".to_vec()),
            &[],
        )
        .await
        .expect_err(400, "M_NOT_JSON");
    // Bad shapes.
    for bad in [
        json!({ "room": { "timeline": { "limit": "x" } } }),
        json!({ "room": { "timeline": { "not_types": 5 } } }),
        json!({ "room": { "state": { "lazy_load_members": "yes" } } }),
        json!({ "room": { "rooms": ["not-a-room"] } }),
        json!({ "room": "everything" }),
        json!({ "presence": { "senders": ["bob"] } }),
        json!({ "event_format": "xml" }),
        json!({ "event_fields": "content.body" }),
    ] {
        alice.post(&path, &bad).await.expect_err(400, "M_BAD_JSON");
        alice
            .get(&format!("{V3}/sync?filter={}", inline(&bad)))
            .await
            .expect_err(400, "M_BAD_JSON");
    }
    alice
        .get(&format!("{V3}/sync?filter={}", enc("{not json")))
        .await
        .expect_err(400, "M_NOT_JSON");
    alice
        .get(&format!("{V3}/sync?filter=12345"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .messages_resp(&room, &format!("dir=b&filter={}", enc("{not json")))
        .await
        .expect_err(400, "M_NOT_JSON");
    alice
        .messages_resp(
            &room,
            &format!("dir=b&filter={}", inline(&json!({ "not_types": 5 }))),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .messages_resp(
            &room,
            &format!("dir=b&filter={}", inline(&json!({ "limit": "x" }))),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    // A good one still works, by id and inline.
    let good = json!({ "room": { "timeline": { "limit": 1 } } });
    let id = filter_id(&alice, &good).await;
    let v = alice.sync(&format!("filter={id}")).await;
    assert_eq!(common::sync_timeline_ids(&v, "join", &room).len(), 1);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_sync_leaves_ignored_users_out_too() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    carol.join(&room).await;
    alice
        .put(
            &format!(
                "{V3}/user/{}/account_data/m.ignored_user_list",
                enc(&alice.user_id)
            ),
            &json!({ "ignored_users": { bob.user_id.clone(): {} } }),
        )
        .await
        .ok();
    let from_carol = carol.send_text(&room, "carol").await;
    bob.send_text(&room, "bob").await;
    let other = bob.create_room(json!({})).await;
    bob.invite(&other, &alice.user_id).await;
    let body = json!({ "lists": { "all": { "ranges": [[0, 10]], "timeline_limit": 1, "required_state": [] } } });
    let v = alice.post(SS, &body).await.ok();
    assert_eq!(ids(&v["rooms"][&room]["timeline"]), vec![from_carol]);
    assert!(v["rooms"].get(&other).is_none(), "{v}");
    assert_eq!(v["lists"]["all"]["count"], json!(1));
    ts.stop().await;
}

/// A named room needs no heroes to be named: lazy loading sends the members of the
/// timeline's senders only, not the summary's heroes (as Synapse, which sends no
/// heroes for a room with a name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_room_lazy_loads_no_hero_members() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "name": "named" }))
        .await;
    let mut others = Vec::new();
    for name in ["bob", "carol", "dave"] {
        let c = ts.register(name).await;
        c.join(&room).await;
        others.push(c);
    }
    others[0].send_text(&room, "hello").await;
    let bob_join = member_event_id(&alice, &room, &others[0].user_id).await;
    let alice_join = member_event_id(&alice, &room, &alice.user_id).await;
    let lazy =
        json!({ "room": { "timeline": { "limit": 1 }, "state": { "lazy_load_members": true } } });
    let first = alice.sync(&format!("filter={}", inline(&lazy))).await;
    let mut members: Vec<String> = first["rooms"]["join"][&room]["state"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.member")
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect();
    members.sort();
    // The timeline's sender, and the syncing user's own membership (as Synapse).
    let mut want = vec![bob_join, alice_join];
    want.sort();
    assert_eq!(members, want);
    ts.stop().await;
}

/// An incremental sync looks only at the rooms the change indexes list, so each kind of
/// news must put its room there: of four rooms, one gets a receipt only, one a typing
/// notice only, one room account data only, and one nothing; the answer holds exactly
/// the first three, each with its own news.
#[tokio::test]
async fn each_kind_of_room_news_alone_brings_its_room_into_an_incremental_sync() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let mut rooms = Vec::new();
    for _ in 0..4 {
        let room = alice.create_room(json!({ "preset": "public_chat" })).await;
        bob.join(&room).await;
        rooms.push(room);
    }
    let read = alice.send_text(&rooms[0], "read me").await;
    let s0 = alice.sync("").await;
    bob.post(
        &format!(
            "{V3}/rooms/{}/receipt/m.read/{}",
            enc(&rooms[0]),
            enc(&read)
        ),
        &json!({}),
    )
    .await
    .ok();
    bob.put(
        &format!("{V3}/rooms/{}/typing/{}", enc(&rooms[1]), enc(&bob.user_id)),
        &json!({ "typing": true, "timeout": 30_000 }),
    )
    .await
    .ok();
    alice
        .put(
            &format!(
                "{V3}/user/{}/rooms/{}/account_data/org.example.note",
                enc(&alice.user_id),
                enc(&rooms[2])
            ),
            &json!({ "n": 1 }),
        )
        .await
        .ok();
    let s1 = alice.sync(&format!("since={}", next_batch(&s0))).await;
    let join = s1["rooms"]["join"].as_object().unwrap();
    let mut got: Vec<&String> = join.keys().collect();
    got.sort();
    let mut want: Vec<&String> = rooms[..3].iter().collect();
    want.sort();
    assert_eq!(got, want, "{s1}");
    let types = |room: &str, section: &str| -> Vec<String> {
        join[room][section]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(types(&rooms[0], "ephemeral"), ["m.receipt"]);
    let receipt = &join[&rooms[0]]["ephemeral"]["events"][0]["content"];
    assert!(
        receipt[&read]["m.read"][&bob.user_id]["ts"].is_u64(),
        "{receipt}"
    );
    assert_eq!(types(&rooms[1], "ephemeral"), ["m.typing"]);
    assert_eq!(
        join[&rooms[1]]["ephemeral"]["events"][0]["content"]["user_ids"],
        json!([bob.user_id])
    );
    assert_eq!(types(&rooms[2], "account_data"), ["org.example.note"]);
    for room in &rooms[..3] {
        assert_eq!(join[room]["timeline"]["events"], json!([]), "{room}: {s1}");
    }
}

/// `/sync` and sliding sync give events as the spec's `ClientEventWithoutRoomID` (the
/// room is the key they sit under; Synapse's `ClientV2WithoutRoomId` alike), in the
/// timeline and in the state, redacted or not; `/messages`, `/context` and `/state`
/// give `ClientEvent`s, with `room_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_events_carry_no_room_id_and_room_endpoints_do() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice
        .create_room(json!({ "name": "formats", "topic": "t" }))
        .await;
    let kept = alice.send_text(&room, "kept").await;
    let gone = alice.send_text(&room, "gone").await;
    alice.redact(&room, &gone).await;
    // The topic is redacted too: a redacted state event in `state` / `required_state`.
    let topic = state_event_id(&alice, &room, "m.room.topic", "").await;
    alice.redact(&room, &topic).await;
    // The redaction inside a redacted event comes in the same format (the spec's
    // `redacted_because` of a `ClientEventWithoutRoomID` is one too).
    let redactions = std::cell::Cell::new(0);
    let without = |evs: &Value, what: &str| -> Vec<String> {
        let evs = evs.as_array().unwrap_or_else(|| panic!("{what}: {evs}"));
        assert!(!evs.is_empty(), "{what}");
        for ev in evs {
            assert!(ev.get("room_id").is_none(), "{what}: {ev}");
            if let Some(because) = ev["unsigned"].get("redacted_because") {
                assert!(because.get("room_id").is_none(), "{what}: {ev}");
                assert_eq!(because["type"], json!("m.room.redaction"), "{what}: {ev}");
                redactions.set(redactions.get() + 1);
            }
        }
        ids(&Value::Array(evs.clone()))
    };
    let with = |evs: &Value, what: &str| {
        let evs = evs.as_array().unwrap_or_else(|| panic!("{what}: {evs}"));
        assert!(!evs.is_empty(), "{what}");
        for ev in evs {
            assert_eq!(ev["room_id"], json!(room), "{what}: {ev}");
            if let Some(because) = ev["unsigned"].get("redacted_because") {
                assert_eq!(because["room_id"], json!(room), "{what}: {ev}");
                redactions.set(redactions.get() + 1);
            }
        }
    };

    // /sync: a full state (cached rendering) and a timeline holding the redactions.
    let filter = json!({ "room": { "timeline": { "limit": 10 } } });
    let s = alice.sync(&format!("filter={}", inline(&filter))).await;
    let joined = &s["rooms"]["join"][&room];
    let timeline = without(&joined["timeline"]["events"], "sync timeline");
    assert!(
        timeline.contains(&kept) && timeline.contains(&gone),
        "{timeline:?}"
    );
    let redacted = joined["timeline"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event_id"] == json!(gone))
        .unwrap();
    assert_eq!(redacted["content"], json!({}), "{redacted}");
    // Lazy loading takes the other path (state loaded, not the cached full state).
    let lazy =
        json!({ "room": { "timeline": { "limit": 1 }, "state": { "lazy_load_members": true } } });
    let l = alice.sync(&format!("filter={}", inline(&lazy))).await;
    without(
        &l["rooms"]["join"][&room]["state"]["events"],
        "lazy sync state",
    );
    let s_full = alice
        .sync(&format!(
            "filter={}",
            inline(&json!({ "room": { "timeline": { "limit": 1 } } }))
        ))
        .await;
    let state = without(
        &s_full["rooms"]["join"][&room]["state"]["events"],
        "sync state",
    );
    assert!(state.contains(&topic), "{state:?}");

    // Sliding sync: timeline and required_state (with the redacted topic).
    let body = json!({ "lists": { "all": {
        "ranges": [[0, 0]],
        "timeline_limit": 5,
        "required_state": [["m.room.topic", ""], ["m.room.name", ""], ["m.room.member", "$ME"]],
    } } });
    let v = alice.post(SS, &body).await.ok();
    let r = &v["rooms"][&room];
    without(&r["timeline"], "sliding timeline");
    let rs = without(&r["required_state"], "sliding required_state");
    assert!(rs.contains(&topic), "{rs:?}");

    // Redacted: the message and the topic in the sync timeline (limit 10), the topic in
    // the lazy and the full state sections, the message and the topic in the sliding
    // timeline (limit 5), the topic in required_state.
    assert_eq!(redactions.get(), 7);
    // Room endpoints: ClientEvent.
    with(
        &alice.messages(&room, "dir=b&limit=10").await["chunk"],
        "messages",
    );
    let ctx = alice.context(&room, &kept, 2).await.ok();
    assert_eq!(ctx["event"]["room_id"], json!(room));
    with(&ctx["events_after"], "context after");
    let st = alice
        .get(&format!("{V3}/rooms/{}/state", enc(&room)))
        .await
        .ok();
    with(&st, "state");
    // /messages' message and topic, the message after `kept` in /context, /state's
    // topic.
    assert_eq!(redactions.get(), 11);
    ts.stop().await;
}

/// A redacted `m.room.name` names no room in sliding sync (its content is gone, as for
/// Synapse): both when the room's rendered state is cached (the window asks for the
/// name) and when it is not (a window asking for no state).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redacted_room_name_names_no_room_in_sliding_sync() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "name": "secret plans" })).await;
    let window = |required_state: Value| {
        json!({ "lists": { "all": {
            "ranges": [[0, 0]], "timeline_limit": 1, "required_state": required_state,
        } } })
    };
    let named = alice.post(SS, &window(json!([]))).await.ok();
    assert_eq!(named["rooms"][&room]["name"], json!("secret plans"));
    let name = state_event_id(&alice, &room, "m.room.name", "").await;
    alice.redact(&room, &name).await;
    // No cached rendering of the state after the redaction: point lookups.
    let v = alice.post(SS, &window(json!([]))).await.ok();
    assert!(v["rooms"][&room].get("name").is_none(), "{v}");
    // The window asks for the name: from the rendered state (redacted).
    let v = alice
        .post(SS, &window(json!([["m.room.name", ""]])))
        .await
        .ok();
    assert!(v["rooms"][&room].get("name").is_none(), "{v}");
    assert_eq!(v["rooms"][&room]["required_state"][0]["content"], json!({}));
    ts.stop().await;
}
