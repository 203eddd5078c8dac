//! Behaviours stock clients depend on (issue 15, items 5 and 6): the display name set at
//! registration, `unsigned.membership` (MSC4115), resending unchanged state, `/messages`
//! without `dir`, member lists of world-readable rooms, cross-signing discovery, and
//! device-list changes for device additions, renames and deletions.

mod common;

use common::{TestServer, enc, ids};
use serde_json::{Value, json};

const V3: &str = "/_matrix/client/v3";

fn next_batch(v: &Value) -> String {
    v["next_batch"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_sets_the_displayname_to_the_localpart() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let p = ts
        .anon()
        .get(&format!("{V3}/profile/{}", enc(&alice.user_id)))
        .await
        .ok();
    assert_eq!(p, json!({ "displayname": "alice" }));
    // And member events carry it.
    let room = alice.create_room(json!({})).await;
    let me = alice
        .get(&format!(
            "{V3}/rooms/{}/state/m.room.member/{}",
            enc(&room),
            enc(&alice.user_id)
        ))
        .await
        .ok();
    assert_eq!(me, json!({ "membership": "join", "displayname": "alice" }));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_carry_the_viewers_membership_at_the_event() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "initial_state": [
            { "type": "m.room.history_visibility", "state_key": "", "content": { "history_visibility": "world_readable" } }
        ] }))
        .await;
    let before = alice.send_text(&room, "before bob").await;
    bob.join(&room).await;
    let after = alice.send_text(&room, "after bob").await;
    let chunk = bob.messages(&room, "dir=f&limit=100").await["chunk"].clone();
    let membership_of = |chunk: &Value, id: &str| {
        chunk
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["event_id"] == id)
            .map(|e| e["unsigned"]["membership"].clone())
            .unwrap()
    };
    assert_eq!(membership_of(&chunk, &before), json!("leave"));
    assert_eq!(membership_of(&chunk, &after), json!("join"));
    let bob_join = chunk
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.room.member" && e["state_key"] == json!(bob.user_id))
        .unwrap();
    assert_eq!(bob_join["unsigned"]["membership"], json!("join"));
    // Alice was joined for all of it.
    let alice_chunk = alice.messages(&room, "dir=f&limit=100").await["chunk"].clone();
    assert_eq!(membership_of(&alice_chunk, &before), json!("join"));
    // /event and /sync carry it too.
    let ev = bob.event(&room, &before).await.ok();
    assert_eq!(ev["unsigned"]["membership"], json!("leave"));
    let sync = bob.sync("").await;
    let timeline = &sync["rooms"]["join"][&room]["timeline"]["events"];
    let last = timeline.as_array().unwrap().last().unwrap();
    assert_eq!(last["event_id"], json!(after));
    assert_eq!(last["unsigned"]["membership"], json!("join"));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resending_unchanged_state_returns_the_existing_event() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let first = alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "t" }))
        .await;
    let count = alice.all_event_ids(&room).await.len();
    let again = alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "t" }))
        .await;
    assert_eq!(again, first);
    assert_eq!(alice.all_event_ids(&room).await.len(), count);
    // Other content, or another sender, makes a new event.
    let changed = alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "u" }))
        .await;
    assert_ne!(changed, first);
    let pl = alice
        .get(&format!(
            "{V3}/rooms/{}/state/m.room.power_levels",
            enc(&room)
        ))
        .await
        .ok();
    let mut pl2 = pl.clone();
    pl2["events"]["m.room.topic"] = json!(0);
    alice.put_state(&room, "m.room.power_levels", "", pl2).await;
    let by_bob = bob
        .put_state(&room, "m.room.topic", "", json!({ "topic": "u" }))
        .await;
    assert_ne!(by_bob, changed);
    assert_eq!(
        ids(&alice.messages(&room, "dir=b&limit=1").await["chunk"]),
        vec![by_bob]
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_without_dir_is_400() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    alice
        .messages_resp(&room, "limit=5")
        .await
        .expect_err(400, "M_MISSING_PARAM");
    alice
        .messages_resp(&room, "dir=x")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice.messages(&room, "dir=b").await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_lists_of_world_readable_rooms_are_readable_by_anyone() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let eve = ts.register("eve").await;
    let open = alice
        .create_room(json!({ "preset": "public_chat", "initial_state": [
            { "type": "m.room.history_visibility", "state_key": "", "content": { "history_visibility": "world_readable" } }
        ] }))
        .await;
    let closed = alice.create_room(json!({ "preset": "public_chat" })).await;
    let joined = eve
        .get(&format!("{V3}/rooms/{}/joined_members", enc(&open)))
        .await
        .ok();
    assert_eq!(
        joined,
        json!({ "joined": { alice.user_id.clone(): { "display_name": "alice" } } })
    );
    let members = eve
        .get(&format!("{V3}/rooms/{}/members", enc(&open)))
        .await
        .ok();
    let keys: Vec<&str> = members["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state_key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec![alice.user_id.as_str()]);
    for path in ["joined_members", "members"] {
        eve.get(&format!("{V3}/rooms/{}/{path}", enc(&closed)))
            .await
            .expect_err(403, "M_FORBIDDEN");
    }
    // An invitee of a world-readable room may read its members as well.
    alice.invite(&open, &eve.user_id).await;
    eve.get(&format!("{V3}/rooms/{}/members", enc(&open)))
        .await
        .ok();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_signing_is_advertised_and_served_on_the_unstable_path() {
    let ts = TestServer::start().await;
    let v = ts.anon().get("/_matrix/client/versions").await.ok();
    assert_eq!(
        v["unstable_features"]["org.matrix.e2e_cross_signing"],
        json!(true)
    );
    let alice = ts.register("alice").await;
    let master = common::TestKey::new(None);
    let master_obj = json!({
        "user_id": alice.user_id,
        "usage": ["master"],
        "keys": { format!("ed25519:{}", master.public): master.public },
    });
    alice
        .post(
            "/_matrix/client/unstable/keys/device_signing/upload",
            &json!({ "master_key": master_obj }),
        )
        .await
        .ok();
    let q = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(q["master_keys"][&alice.user_id], master_obj);
    ts.stop().await;
}

/// A device added, renamed or removed changes the user's device list for everyone who
/// shares a room, whether or not the device uploaded keys (Synapse does the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_added_renamed_or_removed_changes_the_device_list() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let mut a = next_batch(&alice.sync("").await);
    let c = next_batch(&carol.sync("").await);
    let expect_bob_changed = |sync: &Value| {
        assert_eq!(
            sync["device_lists"],
            json!({ "changed": [bob.user_id.clone()], "left": [] }),
            "{sync}"
        );
    };
    // Added.
    let bob2 = ts.login("bob", Some("BOB2")).await;
    let s = alice.sync(&format!("since={a}")).await;
    expect_bob_changed(&s);
    a = next_batch(&s);
    // Renamed.
    bob.put(
        &format!("{V3}/devices/BOB2"),
        &json!({ "display_name": "phone" }),
    )
    .await
    .ok();
    let s = alice.sync(&format!("since={a}")).await;
    expect_bob_changed(&s);
    a = next_batch(&s);
    // Removed.
    bob2.post(&format!("{V3}/logout"), &json!({})).await.ok();
    let s = alice.sync(&format!("since={a}")).await;
    expect_bob_changed(&s);
    // Carol shares no room with Bob: nothing.
    let s = carol.sync(&format!("since={c}")).await;
    assert_eq!(s["device_lists"], json!({ "changed": [], "left": [] }));
    ts.stop().await;
}

/// `GET /user/{userId}/account_data/m.push_rules` reads back the ruleset `/sync` sends
/// under that type (issue 15 item 5, as Synapse); writing it stays refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_rules_account_data_reads_back_as_the_ruleset() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    alice
        .put(
            "/_matrix/client/v3/pushrules/global/content/cats",
            &json!({ "pattern": "cat*", "actions": ["notify"] }),
        )
        .await
        .ok();
    let path = format!(
        "/_matrix/client/v3/user/{}/account_data/m.push_rules",
        enc(&alice.user_id)
    );
    let read = alice.get(&path).await.ok();
    let served = alice.get("/_matrix/client/v3/pushrules/").await.ok();
    assert_eq!(read, served);
    assert_eq!(read["global"]["content"][0]["rule_id"], "cats");
    alice
        .put(&path, &json!({ "global": {} }))
        .await
        .expect_err(405, "M_BAD_JSON");
    ts.stop().await;
}

/// Events written as JSON text (`/messages`, `/context`, `/sync`, sliding sync) are the
/// events `/event/{id}` renders as values, member for member: a message with its
/// transaction id, a bundled thread summary and characters that need escaping, a state event
/// with `prev_content`, a redacted message and the redaction. Only `unsigned.age`
/// (also of the events inside) differs between two requests, so it is left out of the
/// comparison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_written_as_text_are_the_rendered_events() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({ "preset": "public_chat", "name": "text" }))
        .await;
    bob.join(&room).await;
    alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "first" }))
        .await;
    alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "second" }))
        .await;
    let m1 = alice
        .send_text(
            &room,
            "quote \" backslash \\ newline \n tab \t nul \u{0} é 😀",
        )
        .await;
    bob.react(&room, &m1, "👍").await;
    bob.send_txn(
        &room,
        "m.room.message",
        "thread-reply",
        &json!({
            "msgtype": "m.text",
            "body": "in a thread",
            "m.relates_to": { "rel_type": "m.thread", "event_id": m1 },
        }),
    )
    .await
    .ok();
    let m2 = alice.send_text(&room, "to be redacted").await;
    alice
        .put(
            &format!("{V3}/rooms/{}/redact/{}/r1", enc(&room), enc(&m2)),
            &json!({ "reason": "oops" }),
        )
        .await
        .ok();
    let without_age = |mut e: Value| {
        common::strip_ages(&mut e);
        e
    };
    let single = |id: String| {
        let alice = &alice;
        let room = &room;
        async move {
            alice
                .get(&format!("{V3}/rooms/{}/event/{}", enc(room), enc(&id)))
                .await
                .ok()
        }
    };
    let page = alice
        .get(&format!(
            "{V3}/rooms/{}/messages?dir=b&limit=50",
            enc(&room)
        ))
        .await
        .ok();
    let chunk = page["chunk"].as_array().unwrap().clone();
    assert_eq!(chunk.len(), 15, "{page}");
    for e in &chunk {
        let id = e["event_id"].as_str().unwrap().to_owned();
        assert_eq!(without_age(e.clone()), without_age(single(id).await));
    }
    // The cases named above are among them.
    let find = |id: &str| chunk.iter().find(|e| e["event_id"] == id).unwrap().clone();
    let first = find(&m1);
    assert_eq!(
        first["content"]["body"],
        "quote \" backslash \\ newline \n tab \t nul \u{0} é 😀"
    );
    assert!(first["unsigned"]["transaction_id"].is_string(), "{first}");
    assert_eq!(
        first["unsigned"]["m.relations"]["m.thread"]["count"], 1,
        "{first}"
    );
    assert_eq!(find(&m2)["content"], json!({}));
    assert!(find(&m2)["unsigned"]["redacted_because"].is_object());
    let topic = chunk
        .iter()
        .find(|e| e["type"] == "m.room.topic" && e["content"]["topic"] == "second")
        .unwrap();
    assert_eq!(
        topic["unsigned"]["prev_content"],
        json!({ "topic": "first" })
    );
    // `/context` and `/sync` write the same events.
    let ctx = alice
        .get(&format!(
            "{V3}/rooms/{}/context/{}?limit=4",
            enc(&room),
            enc(&m1)
        ))
        .await
        .ok();
    assert_eq!(without_age(ctx["event"].clone()), without_age(find(&m1)));
    for e in ctx["events_before"]
        .as_array()
        .unwrap()
        .iter()
        .chain(ctx["events_after"].as_array().unwrap())
        .chain(ctx["state"].as_array().unwrap())
    {
        let id = e["event_id"].as_str().unwrap().to_owned();
        assert_eq!(without_age(e.clone()), without_age(single(id).await));
    }
    // `/sync` and sliding sync write `ClientEventWithoutRoomID`: the same less `room_id`.
    let without_room_id = |mut e: Value| {
        assert_eq!(
            e.as_object_mut().unwrap().remove("room_id"),
            Some(json!(room))
        );
        // A redaction inside is given in the same format.
        if let Some(because) = e["unsigned"]
            .get_mut("redacted_because")
            .and_then(Value::as_object_mut)
        {
            assert_eq!(because.remove("room_id"), Some(json!(room)));
        }
        e
    };
    let filter = enc(r#"{"room":{"timeline":{"limit":50}}}"#);
    let sync = alice.sync(&format!("filter={filter}")).await;
    let timeline = sync["rooms"]["join"][&room]["timeline"]["events"]
        .as_array()
        .unwrap();
    assert_eq!(timeline.len(), 15);
    for e in timeline {
        let id = e["event_id"].as_str().unwrap().to_owned();
        assert_eq!(
            without_age(e.clone()),
            without_room_id(without_age(single(id).await))
        );
    }
    // Sliding sync's timeline too.
    let window = alice
        .post(
            "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync",
            &json!({ "lists": { "all": {
                "ranges": [[0, 0]],
                "timeline_limit": 15,
                "required_state": [["m.room.topic", ""]],
            } } }),
        )
        .await
        .ok();
    let timeline = window["rooms"][&room]["timeline"].as_array().unwrap();
    assert_eq!(timeline.len(), 15, "{window}");
    for e in timeline {
        let id = e["event_id"].as_str().unwrap().to_owned();
        assert_eq!(
            without_age(e.clone()),
            without_room_id(without_age(single(id).await))
        );
    }
    assert_eq!(
        window["rooms"][&room]["required_state"][0]["content"],
        json!({ "topic": "second" })
    );
    // Non-member state comes from the rendered-state cache, as `/state` renders it:
    // with `prev_content` (Synapse's required_state has it too).
    assert_eq!(
        window["rooms"][&room]["required_state"][0]["unsigned"]["prev_content"],
        json!({ "topic": "first" })
    );
    // Every answer above went through the test client's duplicate-key check; it
    // does refuse one.
    assert!(common::no_duplicate_keys(r#"{"a":{"b":1,"b":2}}"#).is_err());
    assert!(common::no_duplicate_keys(r#"[{"a":1},{"a":1}]"#).is_ok());
}
