//! Every failure is a Matrix error: the right HTTP status, an `errcode` and an `error`
//! string (spec: "Standard error response"). No request here may observe a 5xx (the
//! client helper panics on one).

mod common;

use common::{Client, TestServer, enc, ids};
use reqwest::Method;
use serde_json::json;

const V3: &str = "/_matrix/client/v3";

async fn alice_and_room(ts: &TestServer) -> (Client, String) {
    let alice = ts.register("alice").await;
    let room = alice
        .create_room(json!({ "preset": "private_chat", "name": "errors" }))
        .await;
    (alice, room)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_endpoints_and_methods() {
    let ts = TestServer::start().await;
    let (alice, _) = alice_and_room(&ts).await;
    let anon = ts.anon();
    for path in [
        "/_matrix/client/v3/no_such_endpoint",
        "/_matrix/client/r0/sync",
        "/_matrix/client/v3/rooms",
        "/nothing/here",
    ] {
        anon.get(path).await.expect_err(404, "M_UNRECOGNIZED");
        alice.get(path).await.expect_err(404, "M_UNRECOGNIZED");
        alice
            .post(path, &json!({}))
            .await
            .expect_err(404, "M_UNRECOGNIZED");
    }
    // Known paths, wrong method: 405 M_UNRECOGNIZED.
    for (method, path) in [
        (Method::GET, format!("{V3}/createRoom")),
        (Method::DELETE, format!("{V3}/createRoom")),
        (Method::POST, format!("{V3}/sync")),
        (Method::PUT, format!("{V3}/account/whoami")),
        (Method::GET, format!("{V3}/register")),
        (Method::DELETE, format!("{V3}/login")),
    ] {
        alice
            .request(method.clone(), &path, None)
            .await
            .expect_err(405, "M_UNRECOGNIZED");
    }
    // A profile key that is neither a spec field nor namespaced (spec v1.16: any
    // namespaced key is a valid field, so this is a bad parameter, not an unknown path).
    alice
        .get(&format!(
            "{V3}/profile/{}/no_such_field",
            enc(&alice.user_id)
        ))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_are_not_json_objects() {
    let ts = TestServer::start().await;
    let (alice, room) = alice_and_room(&ts).await;
    let send = format!(
        "{V3}/rooms/{}/send/m.room.message/{}",
        enc(&room),
        common::txn()
    );
    for (method, path) in [
        (Method::POST, format!("{V3}/createRoom")),
        (Method::PUT, send.clone()),
        (
            Method::PUT,
            format!("{V3}/rooms/{}/state/m.room.topic", enc(&room)),
        ),
        (
            Method::POST,
            format!("{V3}/user/{}/filter", enc(&alice.user_id)),
        ),
    ] {
        for body in [
            &b"{not json"[..],
            b"{\"a\": 1",
            b"\xff\xfe",
            b"{\"a\": 1} trailing",
        ] {
            let r = alice
                .raw(method.clone(), &path, Some(body.to_vec()), &[])
                .await;
            r.expect_err(400, "M_NOT_JSON");
        }
        for body in [&b"[1, 2, 3]"[..], b"\"a string\"", b"42", b"null", b"true"] {
            let r = alice
                .raw(method.clone(), &path, Some(body.to_vec()), &[])
                .await;
            r.expect_err(400, "M_BAD_JSON");
        }
    }
    // Unauthenticated endpoints parse bodies the same way.
    let anon = ts.anon();
    anon.raw(
        Method::POST,
        &format!("{V3}/login"),
        Some(b"{oops".to_vec()),
        &[],
    )
    .await
    .expect_err(400, "M_NOT_JSON");
    anon.raw(
        Method::POST,
        &format!("{V3}/register"),
        Some(b"[]".to_vec()),
        &[],
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    // Nothing reached the room.
    let page = alice.messages(&room, "dir=b&limit=100").await;
    assert!(
        page["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["type"] != "m.room.message")
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floats_are_refused_in_event_content() {
    // Canonical JSON (the form events are hashed and signed in) has no floats.
    let ts = TestServer::start().await;
    let (alice, room) = alice_and_room(&ts).await;
    let before = alice.all_event_ids(&room).await;
    alice
        .send_txn(
            &room,
            "m.room.message",
            &common::txn(),
            &json!({ "msgtype": "m.text", "body": "pi", "value": 1.5 }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .send_txn(
            &room,
            "org.example.nested",
            &common::txn(),
            &json!({ "deep": { "list": [1, 2.5] } }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .put(
            &format!("{V3}/rooms/{}/state/org.example.state/key", enc(&room)),
            &json!({ "x": 1.0 }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    // Integers outside the canonical range [-(2^53)+1, 2^53-1] too.
    alice
        .send_txn(
            &room,
            "m.room.message",
            &common::txn(),
            &json!({ "msgtype": "m.text", "body": "big", "n": 9007199254740992u64 }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "creation_content": { "org.example.f": 0.5 } }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    assert_eq!(alice.all_event_ids(&room).await, before);
    // The largest canonical integer is fine.
    alice
        .send_txn(
            &room,
            "m.room.message",
            &common::txn(),
            &json!({ "msgtype": "m.text", "body": "max", "n": 9007199254740991u64 }),
        )
        .await
        .ok();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_events_and_bodies() {
    let ts = TestServer::start().await;
    let (alice, room) = alice_and_room(&ts).await;
    let before_ids = alice.all_event_ids(&room).await;
    let mut before_state = alice
        .get(&format!("{V3}/rooms/{}/state", enc(&room)))
        .await
        .ok();
    common::strip_age(&mut before_state);
    let head = ts.server.journal.durable_head();

    // An event over 65536 bytes (the body is well under the request limit).
    let big = "x".repeat(70_000);
    alice
        .send_txn(
            &room,
            "m.room.message",
            &common::txn(),
            &json!({ "msgtype": "m.text", "body": big }),
        )
        .await
        .expect_err(413, "M_TOO_LARGE");
    alice
        .put(
            &format!("{V3}/rooms/{}/state/org.example.big/k", enc(&room)),
            &json!({ "blob": big }),
        )
        .await
        .expect_err(413, "M_TOO_LARGE");
    // A 60 000-byte body fits, PDU envelope included.
    alice
        .send_txn(
            &room,
            "m.room.message",
            &common::txn(),
            &json!({ "msgtype": "m.text", "body": "y".repeat(60_000) }),
        )
        .await
        .ok();
    let after_ok = alice.all_event_ids(&room).await;
    assert_eq!(after_ok.len(), before_ids.len() + 1);
    assert_eq!(&after_ok[..before_ids.len()], &before_ids[..]);
    // Only the accepted event was journaled: exactly one record more.
    assert_eq!(ts.server.journal.durable_head(), head + 1);

    // A body over limits.max_request_bytes (default 1 MiB).
    let huge = json!({ "msgtype": "m.text", "body": "z".repeat(1_100_000) });
    alice
        .send_txn(&room, "m.room.message", &common::txn(), &huge)
        .await
        .expect_err(413, "M_TOO_LARGE");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "name": "z".repeat(1_100_000) }),
        )
        .await
        .expect_err(413, "M_TOO_LARGE");

    // The room is unchanged by the refused requests.
    assert_eq!(alice.all_event_ids(&room).await, after_ok);
    let mut after_state = alice
        .get(&format!("{V3}/rooms/{}/state", enc(&room)))
        .await
        .ok();
    common::strip_age(&mut after_state);
    assert_eq!(after_state, before_state);
    assert_eq!(ts.server.journal.durable_head(), head + 1);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_request_limit_applies() {
    let ts = TestServer::start_with(|c| c.limits.max_request_bytes = 100_000).await;
    let (alice, room) = alice_and_room(&ts).await;
    let head = ts.server.journal.durable_head();
    // 120 000 bytes: over the configured limit (and over the event limit).
    let body = json!({ "msgtype": "m.text", "body": "q".repeat(120_000) });
    alice
        .send_txn(&room, "m.room.message", &common::txn(), &body)
        .await
        .expect_err(413, "M_TOO_LARGE");
    let r = alice
        .put(
            &format!(
                "{V3}/user/{}/account_data/org.example.big",
                enc(&alice.user_id)
            ),
            &json!({ "b": "q".repeat(120_000) }),
        )
        .await;
    r.expect_err(413, "M_TOO_LARGE");
    // 90 000 bytes of account data: under the configured limit, accepted (not an event).
    alice
        .put(
            &format!(
                "{V3}/user/{}/account_data/org.example.big",
                enc(&alice.user_id)
            ),
            &json!({ "b": "q".repeat(90_000) }),
        )
        .await
        .ok();
    assert_eq!(ts.server.journal.durable_head(), head + 1);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_tokens() {
    let ts = TestServer::start().await;
    let (alice, room) = alice_and_room(&ts).await;
    let anon = ts.anon();
    let routes = [
        (Method::GET, format!("{V3}/account/whoami")),
        (Method::GET, format!("{V3}/sync")),
        (Method::GET, format!("{V3}/joined_rooms")),
        (Method::GET, format!("{V3}/rooms/{}/messages", enc(&room))),
        (Method::POST, format!("{V3}/createRoom")),
        (
            Method::PUT,
            format!("{V3}/rooms/{}/send/m.room.message/t1", enc(&room)),
        ),
        (Method::POST, format!("{V3}/logout")),
    ];
    for (method, path) in &routes {
        let body = (method != Method::GET).then(|| json!({}));
        anon.request(method.clone(), path, body.as_ref())
            .await
            .expect_err(401, "M_MISSING_TOKEN");
        let bad = alice.with_token(Some("spt_not_a_real_token"));
        let r = bad.request(method.clone(), path, body.as_ref()).await;
        r.expect_err(401, "M_UNKNOWN_TOKEN");
        assert_eq!(r.body["soft_logout"], json!(false));
    }
    // The token in the (deprecated) query parameter works; a bad one there too is refused.
    let token = alice.token.clone().unwrap();
    let who = anon
        .get(&format!("{V3}/account/whoami?access_token={}", enc(&token)))
        .await
        .ok();
    assert_eq!(who["user_id"], json!(alice.user_id));
    anon.get(&format!("{V3}/account/whoami?access_token=nope"))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    // A non-Bearer Authorization header is not a token.
    anon.raw(
        Method::GET,
        &format!("{V3}/account/whoami"),
        None,
        &[("authorization", &format!("Basic {token}"))],
    )
    .await
    .expect_err(401, "M_MISSING_TOKEN");
    // After logout the token is unknown.
    alice.post(&format!("{V3}/logout"), &json!({})).await.ok();
    alice
        .get(&format!("{V3}/account/whoami"))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pagination_and_sync_tokens() {
    let ts = TestServer::start().await;
    let (alice, room) = alice_and_room(&ts).await;
    for from in [
        "garbage",
        "t",
        "tabc",
        "s",
        "x12",
        "t-1",
        "t99999999999999999999999",
    ] {
        alice
            .messages_resp(&room, &format!("dir=b&from={}", enc(from)))
            .await
            .expect_err(400, "M_INVALID_PARAM");
    }
    alice
        .messages_resp(&room, "dir=b&to=nope")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .messages_resp(&room, "dir=sideways")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .messages_resp(&room, "dir=b&limit=lots")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .messages_resp(&room, "dir=b&filter=%7Bnot%20json")
        .await
        .expect_err(400, "M_NOT_JSON");
    for since in ["garbage", "s", "s1", "s_1", "s1_x", "t5", "sx_0"] {
        let r = alice.get(&format!("{V3}/sync?since={}", enc(since))).await;
        r.expect_err(400, "M_INVALID_PARAM");
    }
    // A token from the future.
    let head = ts.server.journal.durable_head();
    alice
        .get(&format!("{V3}/sync?since=s{}_0", head + 1000))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&format!("{V3}/sync?timeout=soon"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&format!("{V3}/sync?filter=nosuchfilter"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&format!("{V3}/sync?filter=%7Bbroken"))
        .await
        .expect_err(400, "M_NOT_JSON");
    // A valid token still works.
    let next = alice.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    alice.sync(&format!("since={next}")).await;
    let page = alice.messages(&room, "dir=b&limit=2").await;
    let end = page["end"].as_str().unwrap();
    assert_eq!(
        ids(&alice
            .messages(&room, &format!("dir=b&limit=100&from={end}"))
            .await["chunk"])
        .len(),
        7 - 2
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_creation_errors() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    for version in ["13", "0", "org.matrix.msc2870", "banana"] {
        alice
            .post(
                &format!("{V3}/createRoom"),
                &json!({ "room_version": version }),
            )
            .await
            .expect_err(400, "M_UNSUPPORTED_ROOM_VERSION");
    }
    alice
        .post(&format!("{V3}/createRoom"), &json!({ "room_version": 10 }))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "preset": "no_such_preset" }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "invite": "@bob:localhost:8008" }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "invite": ["not a user id"] }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "room_alias_name": "taken" }),
        )
        .await
        .ok();
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "room_alias_name": "taken" }),
        )
        .await
        .expect_err(400, "M_ROOM_IN_USE");
    alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "room_alias_name": "bad:name" }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_and_login_errors() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let anon = ts.anon();
    // Taken: answered before the UIA challenge, and with it.
    anon.post(
        &format!("{V3}/register"),
        &json!({ "username": "alice", "password": "x" }),
    )
    .await
    .expect_err(400, "M_USER_IN_USE");
    anon.post(
        &format!("{V3}/register"),
        &json!({ "username": "ALICE", "password": "x" }),
    )
    .await
    .expect_err(400, "M_USER_IN_USE");
    anon.post(
        &format!("{V3}/register"),
        &json!({ "username": "alice", "password": "x", "auth": { "type": "m.login.dummy", "session": "s" } }),
    )
    .await
    .expect_err(400, "M_USER_IN_USE");
    anon.get(&format!("{V3}/register/available?username=alice"))
        .await
        .expect_err(400, "M_USER_IN_USE");
    for bad in ["al ice", "al!ce", "al:ice", "@alice", "", "é"] {
        anon.post(
            &format!("{V3}/register"),
            &json!({ "username": bad, "password": "x" }),
        )
        .await
        .expect_err(400, "M_INVALID_USERNAME");
    }
    anon.get(&format!(
        "{V3}/register/available?username={}",
        enc("al!ce")
    ))
    .await
    .expect_err(400, "M_INVALID_USERNAME");
    // Login.
    let login = |user: &str, password: &str| json!({ "type": "m.login.password", "identifier": { "type": "m.id.user", "user": user }, "password": password });
    anon.post(&format!("{V3}/login"), &login("alice", "wrong"))
        .await
        .expect_err(403, "M_FORBIDDEN");
    anon.post(&format!("{V3}/login"), &login("nobody", "wrong"))
        .await
        .expect_err(403, "M_FORBIDDEN");
    anon.post(
        &format!("{V3}/login"),
        &login(&alice.user_id, "password-alice"),
    )
    .await
    .ok();
    anon.post(
        &format!("{V3}/login"),
        &json!({ "type": "m.login.token", "token": "x" }),
    )
    .await
    .expect_err(400, "M_UNKNOWN");
    anon.post(
        &format!("{V3}/login"),
        &json!({ "identifier": { "type": "m.id.user", "user": "alice" } }),
    )
    .await
    .expect_err(400, "M_BAD_JSON");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflight_and_headers() {
    let ts = TestServer::start().await;
    let anon = ts.anon();
    let r = anon
        .raw(
            Method::OPTIONS,
            &format!("{V3}/createRoom"),
            None,
            &[
                ("origin", "https://app.example.org"),
                ("access-control-request-method", "POST"),
                (
                    "access-control-request-headers",
                    "authorization, content-type",
                ),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.headers
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok()),
        Some("*")
    );
    let methods = r
        .headers
        .get("access-control-allow-methods")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    for m in ["GET", "POST", "PUT", "DELETE", "OPTIONS"] {
        assert!(methods.contains(m), "allow-methods lacks {m}: {methods}");
    }
    let headers = r
        .headers
        .get("access-control-allow-headers")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_lowercase();
    for h in ["authorization", "content-type", "x-requested-with"] {
        assert!(headers.contains(h), "allow-headers lacks {h}: {headers}");
    }
    // Ordinary and error responses carry the origin header and JSON content type too.
    for path in [
        "/_matrix/client/versions",
        "/_matrix/client/v3/no_such_endpoint",
    ] {
        let r = anon
            .raw(
                Method::GET,
                path,
                None,
                &[("origin", "https://app.example.org")],
            )
            .await;
        assert_eq!(
            r.headers
                .get("access-control-allow-origin")
                .and_then(|v| v.to_str().ok()),
            Some("*"),
            "{path}"
        );
        assert_eq!(
            r.headers.get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/json"),
            "{path}"
        );
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_request_errors() {
    let ts = TestServer::start().await;
    let (alice, room) = alice_and_room(&ts).await;
    let bob = ts.register("bob").await;
    let r = enc(&room);
    // Invalid ids.
    alice
        .post(
            &format!("{V3}/rooms/{r}/invite"),
            &json!({ "user_id": "bob" }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(&format!("{V3}/rooms/{r}/invite"), &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    alice
        .post(
            &format!("{V3}/rooms/{r}/invite"),
            &json!({ "user_id": "@nobody:localhost:8008" }),
        )
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .post(
            &format!("{V3}/rooms/{}/join", enc("not-a-room")),
            &json!({}),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(
            &format!("{V3}/join/{}", enc("#nowhere:localhost:8008")),
            &json!({}),
        )
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .post(
            &format!("{V3}/rooms/{}/join", enc("!nosuchroom:localhost:8008")),
            &json!({}),
        )
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Redacting something that is not there.
    alice
        .put(
            &format!(
                "{V3}/rooms/{r}/redact/{}/{}",
                enc("$nosuchevent"),
                common::txn()
            ),
            &json!({}),
        )
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .put(
            &format!("{V3}/rooms/{r}/redact/notanid/{}", common::txn()),
            &json!({}),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    // Unknown event, unknown state.
    alice
        .event(&room, "$nosuchevent")
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .get(&format!("{V3}/rooms/{r}/state/m.room.avatar"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Another user's typing, another user's account data and filters.
    alice
        .put(
            &format!("{V3}/rooms/{r}/typing/{}", enc(&bob.user_id)),
            &json!({ "typing": true }),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .get(&format!(
            "{V3}/user/{}/account_data/m.direct",
            enc(&bob.user_id)
        ))
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .post(
            &format!("{V3}/user/{}/filter", enc(&bob.user_id)),
            &json!({}),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .get(&format!("{V3}/user/{}/filter/nope", enc(&alice.user_id)))
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Unknown receipt type; m.room.create cannot be sent.
    let ev = alice.send_text(&room, "hello").await;
    alice
        .post(
            &format!("{V3}/rooms/{r}/receipt/m.nonsense/{}", enc(&ev)),
            &json!({}),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .put(&format!("{V3}/rooms/{r}/state/m.room.create"), &json!({}))
        .await
        .expect_err(403, "M_FORBIDDEN");
    // Forgetting a room you are in.
    alice
        .post(&format!("{V3}/rooms/{r}/forget"), &json!({}))
        .await
        .expect_err(400, "M_UNKNOWN");
    ts.stop().await;
}
