//! Push rules, unread/highlight counts, `/notifications` and pushers (spec: "Push
//! Notifications"), end to end over HTTP with exact values.

mod common;

use common::{Client, TestServer, enc, txn};
use serde_json::{Value, json};

const RULES: &str = "/_matrix/client/v3/pushrules/global";

fn rule_ids(set: &Value, kind: &str) -> Vec<String> {
    set[kind]
        .as_array()
        .unwrap_or_else(|| panic!("{kind} is a list: {set}"))
        .iter()
        .map(|r| r["rule_id"].as_str().unwrap().to_owned())
        .collect()
}

async fn counts(c: &Client, room: &str) -> (u64, u64) {
    let s = c.sync("").await;
    let u = &s["rooms"]["join"][room]["unread_notifications"];
    (
        u["notification_count"].as_u64().unwrap(),
        u["highlight_count"].as_u64().unwrap(),
    )
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
async fn default_ruleset_is_the_specs_v1_19_list() {
    let ts = TestServer::start().await;
    let bob = ts.register("bob").await;
    let all = bob.get("/_matrix/client/v3/pushrules/").await.ok();
    let global = bob.get(&format!("{RULES}/")).await.ok();
    assert_eq!(all["global"], global);
    assert_eq!(
        rule_ids(&global, "override"),
        [
            ".m.rule.master",
            ".m.rule.suppress_notices",
            ".m.rule.invite_for_me",
            ".m.rule.member_event",
            ".m.rule.is_user_mention",
            ".m.rule.is_room_mention",
            ".m.rule.tombstone",
            ".m.rule.reaction",
            ".m.rule.room.server_acl",
            ".m.rule.suppress_edits",
        ]
    );
    assert_eq!(
        rule_ids(&global, "underride"),
        [
            ".m.rule.call",
            ".m.rule.encrypted_room_one_to_one",
            ".m.rule.room_one_to_one",
            ".m.rule.message",
            ".m.rule.encrypted",
        ]
    );
    for kind in ["content", "room", "sender"] {
        assert_eq!(global[kind], json!([]), "{kind}");
    }
    let mention = bob
        .get(&format!("{RULES}/override/.m.rule.is_user_mention"))
        .await
        .ok();
    assert_eq!(
        mention,
        json!({
            "rule_id": ".m.rule.is_user_mention",
            "default": true,
            "enabled": true,
            "conditions": [{
                "kind": "event_property_contains",
                "key": "content.m\\.mentions.user_ids",
                "value": bob.user_id,
            }],
            "actions": ["notify", { "set_tweak": "sound", "value": "default" }, { "set_tweak": "highlight" }],
        })
    );
    let master = bob
        .get(&format!("{RULES}/override/.m.rule.master/enabled"))
        .await
        .ok();
    assert_eq!(master, json!({ "enabled": false }));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_rule_crud_and_errors() {
    let ts = TestServer::start().await;
    let bob = ts.register("bob").await;
    let put = |path: String, body: Value| {
        let bob = bob.clone();
        async move { bob.put(&path, &body).await }
    };
    put(
        format!("{RULES}/content/cake"),
        json!({ "pattern": "cake*", "actions": ["notify", "dont_notify"] }),
    )
    .await
    .ok();
    put(
        format!("{RULES}/content/tea?before=cake"),
        json!({ "pattern": "tea", "actions": [] }),
    )
    .await
    .ok();
    put(
        format!("{RULES}/content/pie?after=cake"),
        json!({ "pattern": "pie", "actions": ["notify"] }),
    )
    .await
    .ok();
    let set = bob.get(&format!("{RULES}/")).await.ok();
    assert_eq!(rule_ids(&set, "content"), ["tea", "cake", "pie"]);
    // The historical `dont_notify` is kept as sent (as Synapse does; a no-op when
    // evaluating, spec: "Historical Actions").
    assert_eq!(
        bob.get(&format!("{RULES}/content/cake")).await.ok(),
        json!({ "rule_id": "cake", "default": false, "enabled": true, "pattern": "cake*", "actions": ["notify", "dont_notify"] })
    );
    put(
        format!("{RULES}/content/cake/enabled"),
        json!({ "enabled": false }),
    )
    .await
    .ok();
    put(
        format!("{RULES}/content/cake/actions"),
        json!({ "actions": ["notify", { "set_tweak": "highlight" }] }),
    )
    .await
    .ok();
    assert_eq!(
        bob.get(&format!("{RULES}/content/cake/enabled")).await.ok(),
        json!({ "enabled": false })
    );
    assert_eq!(
        bob.get(&format!("{RULES}/content/cake/actions")).await.ok(),
        json!({ "actions": ["notify", { "set_tweak": "highlight" }] })
    );
    // Server-default rules can be disabled and their actions changed.
    put(
        format!("{RULES}/underride/.m.rule.message/enabled"),
        json!({ "enabled": false }),
    )
    .await
    .ok();
    assert_eq!(
        bob.get(&format!("{RULES}/underride/.m.rule.message/enabled"))
            .await
            .ok(),
        json!({ "enabled": false })
    );
    let room_rule = format!("{RULES}/room/{}", enc("!abc:localhost:8008"));
    put(room_rule.clone(), json!({ "actions": [] })).await.ok();
    assert_eq!(
        bob.get(&room_rule).await.ok(),
        json!({ "rule_id": "!abc:localhost:8008", "default": false, "enabled": true, "actions": [] })
    );
    let sender_rule = format!("{RULES}/override/spam");
    put(
        sender_rule.clone(),
        json!({ "conditions": [{ "kind": "event_match", "key": "sender", "pattern": "@spam*" }], "actions": [] }),
    )
    .await
    .ok();
    let set = bob.get(&format!("{RULES}/")).await.ok();
    assert_eq!(rule_ids(&set, "override")[..2], [".m.rule.master", "spam"]);
    bob.request(
        reqwest::Method::DELETE,
        &format!("{RULES}/content/tea"),
        None,
    )
    .await
    .ok();
    let set = bob.get(&format!("{RULES}/")).await.ok();
    assert_eq!(rule_ids(&set, "content"), ["cake", "pie"]);

    // Errors.
    put(
        format!("{RULES}/content/.mine"),
        json!({ "pattern": "x", "actions": [] }),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    put(format!("{RULES}/nosuchkind/x"), json!({ "actions": [] }))
        .await
        .expect_err(400, "M_UNRECOGNIZED");
    put(format!("{RULES}/content/x"), json!({ "actions": [] }))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    put(format!("{RULES}/content/x"), json!({ "pattern": "x" }))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    put(
        format!("{RULES}/content/x"),
        json!({ "pattern": "x", "actions": "notify" }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    put(
        format!("{RULES}/content/x?before=nosuch"),
        json!({ "pattern": "x", "actions": [] }),
    )
    .await
    .expect_err(400, "M_UNKNOWN");
    put(format!("{RULES}/room/not-a-room"), json!({ "actions": [] }))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    bob.get(&format!("{RULES}/content/nosuch"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    bob.get(&format!("{RULES}/content/nosuch/enabled"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    put(
        format!("{RULES}/content/nosuch/actions"),
        json!({ "actions": [] }),
    )
    .await
    .expect_err(404, "M_NOT_FOUND");
    bob.request(
        reqwest::Method::DELETE,
        &format!("{RULES}/content/nosuch"),
        None,
    )
    .await
    .expect_err(404, "M_NOT_FOUND");
    bob.request(
        reqwest::Method::DELETE,
        &format!("{RULES}/override/.m.rule.master"),
        None,
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    put(
        format!("{RULES}/content/cake/enabled"),
        json!({ "enabled": "yes" }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_rule_kinds_list_and_legacy_actions_read_back_as_sent() {
    let ts = TestServer::start().await;
    let bob = ts.register("bob").await;
    // `GET /pushrules/global/{kind}/`: that kind's rules, an array (as Synapse).
    let all = bob.get(&format!("{RULES}/")).await.ok();
    for kind in ["override", "content", "room", "sender", "underride"] {
        assert_eq!(
            bob.get(&format!("{RULES}/{kind}/")).await.ok(),
            all[kind],
            "{kind}"
        );
    }
    assert_eq!(bob.get(&format!("{RULES}/content/")).await.ok(), json!([]));
    bob.put(
        &format!("{RULES}/override/legacy"),
        &json!({
            "conditions": [{ "kind": "event_match", "key": "content.body", "pattern": "legacy" }],
            "actions": ["dont_notify"],
        }),
    )
    .await
    .ok();
    bob.put(
        &format!("{RULES}/content/old?after=nothing-else"),
        &json!({ "pattern": "old", "actions": ["coalesce"] }),
    )
    .await
    .expect_err(400, "M_UNKNOWN");
    bob.put(
        &format!("{RULES}/content/old"),
        &json!({ "pattern": "old", "actions": ["notify", "coalesce", { "set_tweak": "sound", "value": "ping" }] }),
    )
    .await
    .ok();
    assert_eq!(
        bob.get(&format!("{RULES}/override/legacy")).await.ok(),
        json!({
            "rule_id": "legacy",
            "default": false,
            "enabled": true,
            "conditions": [{ "kind": "event_match", "key": "content.body", "pattern": "legacy" }],
            "actions": ["dont_notify"],
        })
    );
    assert_eq!(
        bob.get(&format!("{RULES}/content/")).await.ok(),
        json!([{
            "rule_id": "old",
            "default": false,
            "enabled": true,
            "pattern": "old",
            "actions": ["notify", "coalesce", { "set_tweak": "sound", "value": "ping" }],
        }])
    );
    bob.put(
        &format!("{RULES}/underride/.m.rule.message/actions"),
        &json!({ "actions": ["dont_notify"] }),
    )
    .await
    .ok();
    assert_eq!(
        bob.get(&format!("{RULES}/underride/.m.rule.message/actions"))
            .await
            .ok(),
        json!({ "actions": ["dont_notify"] })
    );
    // The ruleset in /sync says the same.
    let sync = bob.sync("").await;
    let rules = sync["account_data"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.push_rules")
        .unwrap()["content"]["global"]
        .clone();
    assert_eq!(rules, bob.get(&format!("{RULES}/")).await.ok());
    assert_eq!(
        rules["override"][1]["actions"],
        json!(["dont_notify"]),
        "{}",
        rules["override"]
    );
    // An action Synapse does not know is refused.
    bob.put(
        &format!("{RULES}/content/bad"),
        &json!({ "pattern": "x", "actions": ["shout"] }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    bob.put(
        &format!("{RULES}/content/old/actions"),
        &json!({ "actions": [{ "value": "ping" }] }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_push_rule_paths_are_400_m_unrecognized() {
    let ts = TestServer::start().await;
    let bob = ts.register("bob").await;
    bob.put(
        &format!("{RULES}/content/cake"),
        &json!({ "pattern": "cake", "actions": ["notify"] }),
    )
    .await
    .ok();
    let v3 = "/_matrix/client/v3";
    for path in [
        format!("{v3}/pushrules"),
        format!("{v3}/pushrules/global"),
        format!("{v3}/pushrules/device/"),
        format!("{v3}/pushrules/device/content/cake"),
        format!("{RULES}/content"),
        format!("{RULES}/nosuchkind/"),
        format!("{RULES}/nosuchkind/cake"),
        format!("{RULES}/content/cake/"),
        format!("{RULES}/content/cake/unknown_attr"),
        format!("{RULES}/content/cake/enabled/more"),
        format!("{RULES}/content//enabled"),
    ] {
        bob.get(&path).await.expect_err(400, "M_UNRECOGNIZED");
    }
    let put = |path: String, body: Value| {
        let bob = bob.clone();
        async move { bob.put(&path, &body).await }
    };
    for path in [
        format!("{v3}/pushrules/device/content/cake"),
        format!("{RULES}/content/"),
        format!("{RULES}/content"),
        format!("{RULES}/"),
        format!("{RULES}/nosuchkind/cake"),
        format!("{RULES}/override/x/unknown_attr"),
        format!("{RULES}/content/cake/unknown_attr"),
        format!("{RULES}/content/cake/enabled/more"),
    ] {
        put(path, json!({ "enabled": true, "actions": [] }))
            .await
            .expect_err(400, "M_UNRECOGNIZED");
    }
    for path in [
        format!("{v3}/pushrules/device/content/cake"),
        format!("{RULES}/content/"),
        format!("{RULES}/nosuchkind/cake"),
        format!("{RULES}/content/cake/enabled"),
        format!("{RULES}/content/cake/unknown_attr"),
    ] {
        bob.request(reqwest::Method::DELETE, &path, None)
            .await
            .expect_err(400, "M_UNRECOGNIZED");
    }
    // None of those touched the rule; a missing rule is still 404 `M_NOT_FOUND`.
    assert_eq!(
        bob.get(&format!("{RULES}/content/cake")).await.ok(),
        json!({ "rule_id": "cake", "default": false, "enabled": true, "pattern": "cake", "actions": ["notify"] })
    );
    bob.get(&format!("{RULES}/content/nosuch/actions"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    // A method the API has no use for stays 405 `M_UNRECOGNIZED`.
    bob.post(&format!("{RULES}/content/cake"), &json!({}))
        .await
        .expect_err(405, "M_UNRECOGNIZED");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_counts_follow_the_push_rules() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    carol.join(&room).await;

    // Push rules arrive as account data on the initial sync.
    let first = bob.sync("").await;
    let rules_event = first["account_data"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.push_rules")
        .cloned()
        .expect("m.push_rules in the initial sync");
    assert_eq!(
        rules_event["content"]["global"],
        bob.get(&format!("{RULES}/")).await.ok()
    );
    let since = first["next_batch"].as_str().unwrap().to_owned();

    assert_eq!(counts(&bob, &room).await, (0, 0));
    send(&alice, &room, json!({ "msgtype": "m.text", "body": "one" })).await;
    send(
        &alice,
        &room,
        json!({ "msgtype": "m.notice", "body": "a notice" }),
    )
    .await;
    let mention = send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "hi bob", "m.mentions": { "user_ids": [bob.user_id] } }),
    )
    .await;
    // The creator (power 100) may notify the room.
    send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "@room", "m.mentions": { "room": true } }),
    )
    .await;
    // Carol (power 0) may not: an ordinary message.
    let carol_room = send(
        &carol,
        &room,
        json!({ "msgtype": "m.text", "body": "@room", "m.mentions": { "room": true } }),
    )
    .await;
    // A reaction and an edit notify no one.
    alice.react(&room, &mention, "👍").await;
    send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "* edit", "m.new_content": { "msgtype": "m.text", "body": "edit" }, "m.relates_to": { "rel_type": "m.replace", "event_id": mention } }),
    )
    .await;
    // one, mention, @room (alice), carol's: 4 notifications, 2 highlighted.
    assert_eq!(counts(&bob, &room).await, (4, 2));
    // Alice's own events never count for her, and her reaction and edit, sent after
    // carol's message, mark it read.
    assert_eq!(counts(&alice, &room).await, (0, 0));

    // A read receipt on the mention clears it and what came before.
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
            enc(&room),
            enc(&mention)
        ),
        &json!({}),
    )
    .await
    .ok();
    assert_eq!(counts(&bob, &room).await, (2, 1));
    // Sending a message marks everything before it read.
    send(&bob, &room, json!({ "msgtype": "m.text", "body": "read" })).await;
    assert_eq!(counts(&bob, &room).await, (0, 0));

    // A user rule: mute carol.
    bob.put(
        &format!("{RULES}/sender/{}", enc(&carol.user_id)),
        &json!({ "actions": [] }),
    )
    .await
    .ok();
    send(
        &carol,
        &room,
        json!({ "msgtype": "m.text", "body": "muted" }),
    )
    .await;
    send(
        &alice,
        &room,
        json!({ "msgtype": "m.text", "body": "counted" }),
    )
    .await;
    assert_eq!(counts(&bob, &room).await, (1, 0));
    // The change shows up in an incremental sync's account data.
    let inc = bob.sync(&format!("since={}", enc(&since))).await;
    let pushed = inc["account_data"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.push_rules")
        .cloned()
        .expect("m.push_rules after a change");
    assert_eq!(
        rule_ids(&pushed["content"]["global"], "sender"),
        [carol.user_id.as_str()]
    );
    let next = inc["next_batch"].as_str().unwrap().to_owned();
    let quiet = bob.sync(&format!("since={}", enc(&next))).await;
    assert!(
        quiet["account_data"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["type"] != "m.push_rules"),
        "no change, no m.push_rules: {quiet}"
    );

    // /notifications: newest first, exact events, `read` from the receipt.
    let n = bob.get("/_matrix/client/v3/notifications").await.ok();
    let listed: Vec<(&str, bool)> = n["notifications"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["event"]["content"]["body"].as_str().unwrap(),
                x["read"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("counted", false),
            ("@room", true),
            ("@room", true),
            ("hi bob", true),
            ("one", true),
        ]
    );
    assert!(n.get("next_token").is_none());
    let first = &n["notifications"][1];
    assert_eq!(first["event"]["event_id"], json!(carol_room));
    assert_eq!(first["room_id"], json!(room));
    assert!(first["event"].get("room_id").is_none());
    assert_eq!(first["actions"], json!(["notify"]));
    let page = bob
        .get("/_matrix/client/v3/notifications?limit=2")
        .await
        .ok();
    assert_eq!(page["notifications"].as_array().unwrap().len(), 2);
    let token = page["next_token"].as_str().unwrap().to_owned();
    let rest = bob
        .get(&format!(
            "/_matrix/client/v3/notifications?limit=10&from={}",
            enc(&token)
        ))
        .await
        .ok();
    let rest_bodies: Vec<&str> = rest["notifications"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["event"]["content"]["body"].as_str().unwrap())
        .collect();
    assert_eq!(rest_bodies, ["@room", "hi bob", "one"]);
    let highlights = bob
        .get("/_matrix/client/v3/notifications?only=highlight")
        .await
        .ok();
    let h: Vec<&str> = highlights["notifications"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["event"]["content"]["body"].as_str().unwrap())
        .collect();
    assert_eq!(h, ["@room", "hi bob"]);
    bob.get("/_matrix/client/v3/notifications?from=garbage")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    bob.get("/_matrix/client/v3/notifications?only=all")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    bob.get("/_matrix/client/v3/notifications?limit=-1")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invites_and_one_to_one_rooms_notify() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    alice.invite(&room, &bob.user_id).await;
    let n = bob.get("/_matrix/client/v3/notifications").await.ok();
    assert_eq!(n["notifications"][0]["room_id"], json!(room));
    assert_eq!(
        n["notifications"][0]["event"]["type"],
        json!("m.room.member")
    );
    assert_eq!(
        n["notifications"][0]["actions"],
        json!(["notify", { "set_tweak": "sound", "value": "default" }])
    );
    bob.join(&room).await;
    send(&alice, &room, json!({ "msgtype": "m.text", "body": "dm" })).await;
    let n = bob
        .get("/_matrix/client/v3/notifications?limit=1")
        .await
        .ok();
    // Two members: `.m.rule.room_one_to_one` (with sound), not `.m.rule.message`.
    assert_eq!(
        n["notifications"][0]["actions"],
        json!(["notify", { "set_tweak": "sound", "value": "default" }])
    );
    assert_eq!(counts(&bob, &room).await, (1, 0));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushers_are_stored_replaced_and_deleted() {
    let ts = TestServer::start().await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let pusher = |lang: &str| {
        json!({
            "pushkey": "key-1",
            "kind": "http",
            "app_id": "org.example.app",
            "app_display_name": "App",
            "device_display_name": "Phone",
            "lang": lang,
            "data": { "url": "https://push.example.org/_matrix/push/v1/notify", "format": "event_id_only" },
        })
    };
    assert_eq!(
        bob.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [] })
    );
    bob.post("/_matrix/client/v3/pushers/set", &pusher("en"))
        .await
        .ok();
    bob.post("/_matrix/client/v3/pushers/set", &pusher("fr"))
        .await
        .ok();
    assert_eq!(
        bob.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [pusher("fr")] })
    );
    // Carol takes the same app id and pushkey: without `append`, bob's pusher goes.
    carol
        .post("/_matrix/client/v3/pushers/set", &pusher("de"))
        .await
        .ok();
    assert_eq!(
        bob.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [] })
    );
    let mut appended = pusher("en");
    appended["append"] = json!(true);
    bob.post("/_matrix/client/v3/pushers/set", &appended)
        .await
        .ok();
    assert_eq!(
        carol.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [pusher("de")] })
    );
    assert_eq!(
        bob.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [pusher("en")] })
    );
    bob.post(
        "/_matrix/client/v3/pushers/set",
        &json!({ "pushkey": "key-1", "app_id": "org.example.app", "kind": null }),
    )
    .await
    .ok();
    assert_eq!(
        bob.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [] })
    );
    let mut no_url = pusher("en");
    no_url["data"] = json!({});
    bob.post("/_matrix/client/v3/pushers/set", &no_url)
        .await
        .expect_err(400, "M_MISSING_PARAM");
    let mut email = pusher("en");
    email["kind"] = json!("email");
    bob.post("/_matrix/client/v3/pushers/set", &email)
        .await
        .expect_err(400, "M_INVALID_PARAM");
    bob.post(
        "/_matrix/client/v3/pushers/set",
        &json!({ "pushkey": "k", "app_id": "a" }),
    )
    .await
    .expect_err(400, "M_MISSING_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_change_removes_the_pushers_of_other_access_tokens() {
    let ts = TestServer::start().await;
    let bob = ts.register("bob").await;
    let phone = ts.login("bob", Some("PHONE")).await;
    let tablet = ts.login("bob", Some("TABLET")).await;
    let pusher = |key: &str| {
        json!({
            "pushkey": key,
            "kind": "http",
            "app_id": "org.example.app",
            "app_display_name": "App",
            "device_display_name": key,
            "lang": "en",
            "data": { "url": "https://push.example.org/_matrix/push/v1/notify" },
        })
    };
    for (c, key) in [
        (&bob, "key-bob"),
        (&phone, "key-phone"),
        (&tablet, "key-tablet"),
    ] {
        c.post("/_matrix/client/v3/pushers/set", &pusher(key))
            .await
            .ok();
    }
    let keys = |v: Value| -> Vec<String> {
        v["pushers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pushkey"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        keys(bob.get("/_matrix/client/v3/pushers").await.ok()),
        ["key-bob", "key-phone", "key-tablet"]
    );
    // `logout_devices: false`: every pusher stays.
    let change = |body: Value| {
        let phone = phone.clone();
        async move {
            let first = phone
                .post("/_matrix/client/v3/account/password", &body)
                .await;
            assert_eq!(first.status, 401, "{}", first.text);
            let mut body = body.clone();
            body["auth"] = json!({
                "type": "m.login.password",
                "identifier": { "type": "m.id.user", "user": "bob" },
                "password": "password-bob",
                "session": first.body["session"],
            });
            phone
                .post("/_matrix/client/v3/account/password", &body)
                .await
                .ok();
        }
    };
    change(json!({ "new_password": "password-bob", "logout_devices": false })).await;
    assert_eq!(
        keys(phone.get("/_matrix/client/v3/pushers").await.ok()),
        ["key-bob", "key-phone", "key-tablet"]
    );
    // `logout_devices` left out (default true), asked from the phone: the pushers of
    // every other access token go, the phone's stays.
    change(json!({ "new_password": "password-bob" })).await;
    assert_eq!(
        phone.get("/_matrix/client/v3/pushers").await.ok(),
        json!({ "pushers": [pusher("key-phone")] })
    );
    bob.get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    ts.stop().await;
}
