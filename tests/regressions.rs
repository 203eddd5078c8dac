//! Regression tests for defects found by breaking the server from the outside
//! (fresh-eyes review and the matrix-js-sdk smoke run). Each test names the defect.

mod common;

use common::{TestServer, enc};
use reqwest::Method;
use serde_json::json;

/// Concurrent alias creation: exactly one wins, the others get 409, and the loser rooms
/// never list the alias (the uniqueness check lives in the journal, not a read model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_alias_creation_has_exactly_one_winner() {
    let server = TestServer::start().await;
    let alice = server.register("alias_racer").await;
    let mut rooms = Vec::new();
    for _ in 0..6 {
        rooms.push(alice.create_room(json!({})).await);
    }
    let server_name = alice.user_id.split_once(':').unwrap().1.to_owned();
    let alias = format!("#race:{server_name}");
    let mut tasks = Vec::new();
    for room in &rooms {
        let (c, room, alias) = (alice.clone(), room.clone(), alias.clone());
        tasks.push(tokio::spawn(async move {
            c.put(
                &format!("/_matrix/client/v3/directory/room/{}", enc(&alias)),
                &json!({ "room_id": room }),
            )
            .await
            .status
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses.sort();
    assert_eq!(statuses, vec![200, 409, 409, 409, 409, 409]);
    let resolved = alice
        .get(&format!(
            "/_matrix/client/v3/directory/room/{}",
            enc(&alias)
        ))
        .await
        .ok();
    let owner = resolved["room_id"].as_str().unwrap().to_owned();
    for room in &rooms {
        let listed = alice
            .get(&format!("/_matrix/client/v3/rooms/{}/aliases", enc(room)))
            .await
            .ok();
        let expected: Vec<String> = if *room == owner {
            vec![alias.clone()]
        } else {
            vec![]
        };
        assert_eq!(listed["aliases"], json!(expected), "room {room}");
    }

    // Concurrent createRoom with the same room_alias_name: one room gets it.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let c = alice.clone();
        tasks.push(tokio::spawn(async move {
            c.post(
                "/_matrix/client/v3/createRoom",
                &json!({ "room_alias_name": "samename" }),
            )
            .await
            .status
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses.sort();
    assert_eq!(statuses, vec![200, 400, 400, 400]);
}

/// `/forget` ends access to the history (spec: the user can no longer retrieve it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgotten_room_history_is_no_longer_readable() {
    let server = TestServer::start().await;
    let alice = server.register("forget_a").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    alice.send_text(&room, "before forgetting").await;
    alice.leave(&room).await;
    assert_eq!(alice.messages_resp(&room, "dir=b").await.status, 200);
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/forget", enc(&room)),
            &json!({}),
        )
        .await
        .ok();
    alice
        .messages_resp(&room, "dir=b")
        .await
        .expect_err(403, "M_FORBIDDEN");
    let sync = alice
        .sync("filter=%7B%22room%22%3A%7B%22include_leave%22%3Atrue%7D%7D")
        .await;
    assert!(
        sync["rooms"]["leave"].get(&room).is_none(),
        "forgotten room still in sync: {sync}"
    );
}

/// Room summaries are cached per state but heroes are per user: each side of a DM
/// sees the other, never themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dm_heroes_are_the_other_user_on_both_sides() {
    let server = TestServer::start().await;
    let alice = server.register("hero_a").await;
    let bob = server.register("hero_b").await;
    let room = alice
        .create_room(
            json!({ "preset": "trusted_private_chat", "invite": [bob.user_id], "is_direct": true }),
        )
        .await;
    bob.join(&room).await;
    let a = alice.sync("").await;
    let b = bob.sync("").await;
    assert_eq!(
        a["rooms"]["join"][&room]["summary"]["m.heroes"],
        json!([bob.user_id])
    );
    assert_eq!(
        b["rooms"]["join"][&room]["summary"]["m.heroes"],
        json!([alice.user_id])
    );
    assert_eq!(
        b["rooms"]["join"][&room]["summary"]["m.joined_member_count"],
        2
    );
}

/// A profile change of an already-joined user is not a new join: the next incremental
/// sync carries just the member event, not a limited full-state resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_change_is_not_a_fresh_join_in_sync() {
    let server = TestServer::start().await;
    let bob = server.register("profile_b").await;
    let room = bob.create_room(json!({})).await;
    for i in 0..12 {
        bob.send_text(&room, &format!("filler {i}")).await;
    }
    let since = bob.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    bob.put(
        &format!(
            "/_matrix/client/v3/profile/{}/displayname",
            enc(&bob.user_id)
        ),
        &json!({ "displayname": "Bob B" }),
    )
    .await
    .ok();
    let next = bob.sync(&format!("since={since}")).await;
    let joined = &next["rooms"]["join"][&room];
    assert_eq!(joined["timeline"]["limited"], false, "{next}");
    let events = joined["timeline"]["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{next}");
    assert_eq!(events[0]["type"], "m.room.member");
    assert_eq!(events[0]["content"]["displayname"], "Bob B");
    assert_eq!(joined["state"]["events"], json!([]));
}

/// Malformed well-known state content is refused with 400 M_BAD_JSON instead of being
/// stored (a numeric join_rule used to make every later join fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_state_content_is_refused() {
    let server = TestServer::start().await;
    let alice = server.register("state_a").await;
    let room = alice.create_room(json!({})).await;
    let put = |kind: &'static str, content: serde_json::Value| {
        let (alice, room) = (alice.clone(), room.clone());
        async move {
            alice
                .put(
                    &format!("/_matrix/client/v3/rooms/{}/state/{kind}", enc(&room)),
                    &content,
                )
                .await
        }
    };
    put("m.room.join_rules", json!({ "join_rule": 1 }))
        .await
        .expect_err(400, "M_BAD_JSON");
    put("m.room.power_levels", json!({ "users_default": "abc" }))
        .await
        .expect_err(400, "M_BAD_JSON");
    put(
        "m.room.history_visibility",
        json!({ "history_visibility": "everyone" }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    put("m.room.canonical_alias", json!({ "alias": "bad" }))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    put("m.room.canonical_alias", json!({ "alias": format!("#nonexistent:{}", alice.user_id.split(':').skip(1).collect::<Vec<_>>().join(":")) }))
        .await
        .expect_err(400, "M_BAD_ALIAS");
    alice
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "power_level_content_override": { "users_default": "abc" } }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "visibility": "bogus" }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "room_alias_name": "" }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    // An empty PUT body is not JSON.
    let r = alice
        .raw(
            Method::PUT,
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/empty1",
                enc(&room)
            ),
            Some(vec![]),
            &[],
        )
        .await;
    r.expect_err(400, "M_NOT_JSON");
    // A path that is not UTF-8 still answers a Matrix error.
    let r = alice
        .raw(
            Method::GET,
            "/_matrix/client/v3/rooms/%FF%FE/state",
            None,
            &[],
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.errcode(), Some("M_INVALID_PARAM"));
}

/// limit=0 returns no events (it is a maximum).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_zero_returns_nothing() {
    let server = TestServer::start().await;
    let alice = server.register("limit_a").await;
    let room = alice.create_room(json!({})).await;
    alice.send_text(&room, "one").await;
    let m = alice.messages(&room, "dir=b&limit=0").await;
    assert_eq!(m["chunk"], json!([]));
    let s = alice
        .sync("filter=%7B%22room%22%3A%7B%22timeline%22%3A%7B%22limit%22%3A0%7D%7D%7D")
        .await;
    assert_eq!(s["rooms"]["join"][&room]["timeline"]["events"], json!([]));
    assert_eq!(s["rooms"]["join"][&room]["timeline"]["limited"], true);
}

/// Membership transitions are checked by the journal under the room lock: concurrent
/// unbans act once, a kick needs the target in the room, repeated invites and bans add
/// no events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_transitions_are_checked_atomically() {
    let server = TestServer::start().await;
    let mod_ = server.register("trans_mod").await;
    let vic = server.register("trans_vic").await;
    let room = mod_.create_room(json!({ "preset": "public_chat" })).await;
    let path = |action: &str| format!("/_matrix/client/v3/rooms/{}/{action}", enc(&room));
    // Kicking someone who never joined: 403 M_BAD_STATE, no event.
    let before = mod_.all_event_ids(&room).await.len();
    mod_.post(&path("kick"), &json!({ "user_id": vic.user_id }))
        .await
        .expect_err(403, "M_BAD_STATE");
    assert_eq!(mod_.all_event_ids(&room).await.len(), before);
    // Ban twice: one event.
    mod_.post(&path("ban"), &json!({ "user_id": vic.user_id }))
        .await
        .ok();
    mod_.post(&path("ban"), &json!({ "user_id": vic.user_id }))
        .await
        .ok();
    assert_eq!(mod_.all_event_ids(&room).await.len(), before + 1);
    // Kicking a banned user does not unban them.
    mod_.post(&path("kick"), &json!({ "user_id": vic.user_id }))
        .await
        .expect_err(403, "M_BAD_STATE");
    // Six concurrent unbans: exactly one acts.
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (c, p, v) = (mod_.clone(), path("unban"), vic.user_id.clone());
        tasks.push(tokio::spawn(async move {
            c.post(&p, &json!({ "user_id": v })).await.status
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses.sort();
    assert_eq!(statuses, vec![200, 403, 403, 403, 403, 403]);
    assert_eq!(mod_.all_event_ids(&room).await.len(), before + 2);
    // Invite twice: one event; then the invitee joins.
    mod_.post(&path("invite"), &json!({ "user_id": vic.user_id }))
        .await
        .ok();
    mod_.post(&path("invite"), &json!({ "user_id": vic.user_id }))
        .await
        .ok();
    assert_eq!(mod_.all_event_ids(&room).await.len(), before + 3);
    vic.join(&room).await;
    // Leaving twice is a no-op the second time; forgetting needs to have left.
    vic.post(
        &format!("/_matrix/client/v3/rooms/{}/forget", enc(&room)),
        &json!({}),
    )
    .await
    .expect_err(400, "M_UNKNOWN");
    vic.leave(&room).await;
    vic.leave(&room).await;
    assert_eq!(mod_.all_event_ids(&room).await.len(), before + 5);
}

/// Input the first pass let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_pass_input_checks() {
    let server = TestServer::start().await;
    let a = server.register("checks_a").await;
    let room = a.create_room(json!({})).await;
    let long_key = "k".repeat(300);
    a.put(
        &format!(
            "/_matrix/client/v3/rooms/{}/state/org.example/{long_key}",
            enc(&room)
        ),
        &json!({}),
    )
    .await
    .expect_err(413, "M_TOO_LARGE");
    a.put(
        &format!("/_matrix/client/v3/profile/{}/displayname", enc(&a.user_id)),
        &json!({}),
    )
    .await
    .expect_err(400, "M_MISSING_PARAM");
    a.messages_resp(&room, "dir=b&from=t99999999")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    a.get("/_matrix/client/v3/sync?set_presence=bogus")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    a.get("/_matrix/client/v3/sync?full_state=yes")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    // contains_url filters.
    a.send_txn(
        &room,
        "m.room.message",
        "img",
        &json!({ "msgtype": "m.image", "body": "pic", "url": "mxc://x/y" }),
    )
    .await
    .ok();
    a.send_text(&room, "plain").await;
    let with = a
        .messages(&room, "dir=b&filter=%7B%22contains_url%22%3Atrue%7D")
        .await;
    let bodies: Vec<&str> = with["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["content"]["body"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(bodies, vec!["pic"]);
}

/// `full_state=true` on an incremental sync resends state but keeps the timeline from
/// `since` (spec: "The timeline will still be limited by the since parameter").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_state_keeps_the_timeline_from_since() {
    let server = TestServer::start().await;
    let a = server.register("fullstate_a").await;
    let room = a.create_room(json!({ "name": "fs" })).await;
    for i in 0..5 {
        a.send_text(&room, &format!("old {i}")).await;
    }
    let since = a.sync("").await["next_batch"].as_str().unwrap().to_owned();
    let new = a.send_text(&room, "new").await;
    let v = a.sync(&format!("since={since}&full_state=true")).await;
    let joined = &v["rooms"]["join"][&room];
    assert_eq!(common::ids(&joined["timeline"]["events"]), vec![new]);
    assert_eq!(joined["timeline"]["limited"], false);
    let state_types: Vec<&str> = joined["state"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert!(
        state_types.contains(&"m.room.create") && state_types.contains(&"m.room.name"),
        "{state_types:?}"
    );
}

/// Room tags (Element's favourites) are a view over `m.tag` room account data; the
/// `order` is a float, which account data may carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_tags_round_trip_through_account_data() {
    let server = TestServer::start().await;
    let a = server.register("tags_a").await;
    let room = a.create_room(json!({})).await;
    let base = format!(
        "/_matrix/client/v3/user/{}/rooms/{}/tags",
        enc(&a.user_id),
        enc(&room)
    );
    a.put(&format!("{base}/m.favourite"), &json!({ "order": 0.25 }))
        .await
        .ok();
    a.put(&format!("{base}/u.work"), &json!({})).await.ok();
    assert_eq!(
        a.get(&base).await.ok(),
        json!({ "tags": { "m.favourite": { "order": 0.25 }, "u.work": {} } })
    );
    let sync = a.sync("").await;
    let ad = &sync["rooms"]["join"][&room]["account_data"]["events"];
    assert_eq!(
        ad,
        &json!([{ "type": "m.tag", "content": { "tags": { "m.favourite": { "order": 0.25 }, "u.work": {} } } }])
    );
    a.request(reqwest::Method::DELETE, &format!("{base}/u.work"), None)
        .await
        .ok();
    assert_eq!(
        a.get(&base).await.ok(),
        json!({ "tags": { "m.favourite": { "order": 0.25 } } })
    );
    let other = server.register("tags_b").await;
    other.get(&base).await.expect_err(403, "M_FORBIDDEN");
}

/// Third pass: alias localparts, banned joins, oversized bodies, m.federate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn third_pass_input_checks() {
    let server = TestServer::start().await;
    let a = server.register("third_a").await;
    let b = server.register("third_b").await;
    for bad in ["a b", "#x", "x:y", "tab\there"] {
        a.post(
            "/_matrix/client/v3/createRoom",
            &json!({ "room_alias_name": bad }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    }
    let room = a
        .create_room(json!({ "preset": "public_chat", "room_alias_name": "ünïcode-ok" }))
        .await;
    let server_name = a.user_id.split_once(':').unwrap().1.to_owned();
    a.put(
        &format!(
            "/_matrix/client/v3/directory/room/{}",
            enc(&format!("#sp ace:{server_name}"))
        ),
        &json!({ "room_id": room }),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    a.put(
        &format!(
            "/_matrix/client/v3/directory/room/{}",
            enc(&format!("#:{server_name}"))
        ),
        &json!({ "room_id": room }),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    a.post(
        "/_matrix/client/v3/createRoom",
        &json!({ "creation_content": { "m.federate": "no" } }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    // A banned user's join says so.
    a.post(
        &format!("/_matrix/client/v3/rooms/{}/ban", enc(&room)),
        &json!({ "user_id": b.user_id }),
    )
    .await
    .ok();
    b.post(
        &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
        &json!({}),
    )
    .await
    .expect_err(403, "M_BAD_STATE");
    let resp = reqwest::Client::new()
        .put(format!(
            "{}/_matrix/client/v3/rooms/{}/send/m.room.message/cl2",
            a.base,
            enc(&room)
        ))
        .bearer_auth(a.token.as_ref().unwrap())
        .header("content-type", "application/json")
        .body(vec![b' '; 2 * 1024 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 413);
}

/// A client that declares more body than it sends is answered 408 once the body stalls
/// (`limits.request_body_idle_timeout_ms`), instead of holding the connection forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_request_body_times_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TestServer::start_with(|c| c.limits.request_body_idle_timeout_ms = 300).await;
    let a = server.register("stall_a").await;
    let room = a.create_room(json!({})).await;
    let host = a.base.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&host).await.unwrap();
    let req = format!(
        "PUT /_matrix/client/v3/rooms/{}/send/m.room.message/stall1 HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{}}",
        enc(&room),
        a.token.as_ref().unwrap()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 2048];
    // Liveness bound only: the configured idle timeout is 0.3 s.
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), sock.read(&mut buf))
        .await
        .expect("answered")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"errcode\""), "{text}");
    // Nothing was sent into the room.
    assert!(!a.all_event_ids(&room).await.is_empty());
    let m = a.messages(&room, "dir=b&limit=1").await;
    assert_ne!(m["chunk"][0]["type"], "m.room.message");
}

/// Receipts in sync: initial syncs carry every receipt of the room, incremental ones only
/// the changed ones, and a private receipt reaches no one but its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_in_sync_respect_privacy_and_tokens() {
    let server = TestServer::start().await;
    let alice = server.register("rcpt_a").await;
    let bob = server.register("rcpt_b").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let m1 = alice.send_text(&room, "one").await;
    let m2 = alice.send_text(&room, "two").await;
    let receipt = |who: &common::Client, kind: &str, event: &str| {
        let (who, path) = (
            who.clone(),
            format!(
                "/_matrix/client/v3/rooms/{}/receipt/{kind}/{}",
                enc(&room),
                enc(event)
            ),
        );
        async move { who.post(&path, &json!({})).await.ok() }
    };
    receipt(&bob, "m.read", &m1).await;
    receipt(&bob, "m.read.private", &m2).await;
    let receipts_of = |sync: &serde_json::Value| -> serde_json::Value {
        sync["rooms"]["join"][&room]["ephemeral"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["type"] == "m.receipt")
            .map(|e| e["content"].clone())
            .unwrap_or(json!({}))
    };
    let strip_ts = |mut v: serde_json::Value| {
        for (_, by_type) in v.as_object_mut().unwrap().iter_mut() {
            for (_, by_user) in by_type.as_object_mut().unwrap().iter_mut() {
                for (_, entry) in by_user.as_object_mut().unwrap().iter_mut() {
                    entry.as_object_mut().unwrap().remove("ts");
                }
            }
        }
        v
    };
    let a = alice.sync("").await;
    assert_eq!(
        strip_ts(receipts_of(&a)),
        json!({ m1.clone(): { "m.read": { bob.user_id.clone(): {} } } })
    );
    let b = bob.sync("").await;
    assert_eq!(
        strip_ts(receipts_of(&b)),
        json!({
            m1.clone(): { "m.read": { bob.user_id.clone(): {} } },
            m2.clone(): { "m.read.private": { bob.user_id.clone(): {} } },
        })
    );
    // Incremental: only what changed since the token.
    let since = a["next_batch"].as_str().unwrap().to_owned();
    receipt(&bob, "m.read", &m2).await;
    let next = alice.sync(&format!("since={since}")).await;
    assert_eq!(
        strip_ts(receipts_of(&next)),
        json!({ m2.clone(): { "m.read": { bob.user_id.clone(): {} } } })
    );
}

/// Limits audit (issue 3): every `limit` is clamped and every pagination token is
/// validated. Before: a sync filter with `timeline.limit: u64::MAX` overflowed
/// (`limit + 1`) and `/messages?to=t<u64::MAX>` overflowed (`to + 1`): a panic, not an
/// answer. Now huge values are clamped and bad tokens answer 400 `M_INVALID_PARAM`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_limits_are_clamped_and_bad_tokens_are_400() {
    let server = TestServer::start().await;
    let alice = server.register("limits").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    let root = alice.send_text(&room, "root").await;
    for i in 0..3 {
        alice.send_text(&room, &format!("m{i}")).await;
    }
    let all = alice.all_event_ids(&room).await;
    let r = enc(&room);
    let max = u64::MAX;

    let filter = enc(&json!({ "room": { "timeline": { "limit": max } } }).to_string());
    let s = alice.sync(&format!("filter={filter}")).await;
    assert_eq!(common::sync_timeline_ids(&s, "join", &room), all);
    let m = alice
        .messages(&room, &format!("dir=b&limit={max}&to=t{max}"))
        .await;
    assert_eq!(m["chunk"], json!([]));
    let m = alice.messages(&room, "dir=f&limit=99999999999999").await;
    assert_eq!(common::ids(&m["chunk"]), all);
    let rel = |q: String| {
        let alice = alice.clone();
        let path = format!("/_matrix/client/v1/rooms/{r}/relations/{}?{q}", enc(&root));
        async move { alice.get(&path).await }
    };
    assert_eq!(rel(format!("to=t{max}")).await.ok()["chunk"], json!([]));
    assert_eq!(
        rel(format!("dir=f&from=t{max}&limit={max}")).await.ok()["chunk"],
        json!([])
    );
    assert_eq!(
        alice
            .get(&format!(
                "/_matrix/client/v1/rooms/{r}/threads?limit={max}&from=t{max}"
            ))
            .await
            .ok()["chunk"],
        json!([])
    );
    assert_eq!(
        alice
            .get(&format!(
                "/_matrix/client/v3/notifications?limit={max}&from={max}"
            ))
            .await
            .ok()["notifications"],
        json!([])
    );

    for path in [
        format!("/_matrix/client/v3/rooms/{r}/messages?dir=b&from=x1"),
        format!("/_matrix/client/v3/rooms/{r}/messages?dir=b&to=t-1"),
        format!("/_matrix/client/v3/rooms/{r}/messages?dir=b&limit=-5"),
        format!(
            "/_matrix/client/v3/rooms/{r}/context/{}?limit=ten",
            enc(&root)
        ),
        format!("/_matrix/client/v3/rooms/{r}/members?at=yesterday"),
        "/_matrix/client/v3/sync?since=s1".to_owned(),
        "/_matrix/client/v3/sync?since=t5".to_owned(),
        "/_matrix/client/v3/sync?timeout=soon".to_owned(),
        format!(
            "/_matrix/client/v1/rooms/{r}/relations/{}?from=%00",
            enc(&root)
        ),
        format!(
            "/_matrix/client/v1/rooms/{r}/relations/{}?limit=1.5",
            enc(&root)
        ),
        format!("/_matrix/client/v1/rooms/{r}/threads?from=next"),
        format!("/_matrix/client/v1/rooms/{r}/threads?limit=many"),
        "/_matrix/client/v3/notifications?from=t5".to_owned(),
        "/_matrix/client/v3/notifications?limit=x".to_owned(),
    ] {
        alice.get(&path).await.expect_err(400, "M_INVALID_PARAM");
    }
    server.stop().await;
}

/// A redaction sent as an event (`PUT /send/m.room.redaction/{txn}`) skipped the checks
/// of `/redact`: a member at power level 0 could redact anyone's message (from room
/// version 3 the auth rules leave that check to the server applying the redaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redaction_sent_as_an_event_needs_the_redact_power() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let mallory = ts.register("mallory").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    mallory.join(&room).await;
    let target = alice.send_text(&room, "mine").await;
    let own = mallory.send_text(&room, "mallory's").await;
    mallory
        .send_txn(
            &room,
            "m.room.redaction",
            "r1",
            &json!({ "redacts": target, "reason": "no" }),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    mallory
        .send_txn(&room, "m.room.redaction", "r2", &json!({ "reason": "no" }))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    // Unredacted, for everyone.
    let ev = alice.event(&room, &target).await.ok();
    assert_eq!(ev["content"]["body"], "mine");
    // Their own message, and alice (power 100) on anyone's: allowed.
    mallory
        .send_txn(&room, "m.room.redaction", "r3", &json!({ "redacts": own }))
        .await
        .ok();
    alice
        .send_txn(
            &room,
            "m.room.redaction",
            "r4",
            &json!({ "redacts": target }),
        )
        .await
        .ok();
    assert_eq!(alice.event(&room, &own).await.ok()["content"], json!({}));
    assert_eq!(alice.event(&room, &target).await.ok()["content"], json!({}));
    ts.stop().await;
}
