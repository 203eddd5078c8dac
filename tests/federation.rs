//! The Server-Server API of an in-process server, driven by a fake remote server
//! (`remote.test`, whose key the server is told through `KeyCache::pin`): request
//! authentication, the read-endpoint route walk for a server with no member in the
//! room, bad transactions, a join through make_join/send_join, and counting guards
//! (an inbound transaction's and a join's store reads follow what they carry and
//! return, not the room's length).

use std::sync::atomic::Ordering;

use serde_json::{Value, json};
use spindle_core::{keys::ServerKey, pdu::Pdu};

const REMOTE: &str = "remote.test";

struct Harness {
    server: spindle::Server,
    http: reqwest::Client,
    base: String,
    remote: ServerKey,
    _dir: tempfile::TempDir,
}

fn enc(s: &str) -> String {
    spindle_federation::transactions::urlencode(s)
}

impl Harness {
    async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let config = spindle::Config {
            bind: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().to_path_buf(),
            rate_limits: spindle::config::RateLimits::lifted(),
            ..Default::default()
        };
        let server = spindle::Server::start(config).await.unwrap();
        let base = format!("http://{}", server.addr);
        let remote = ServerKey::generate(REMOTE);
        server.federation.keys.pin(
            REMOTE,
            [(remote.key_id(), remote.public_key_base64())]
                .into_iter()
                .collect(),
            3_600_000,
        );
        Harness {
            server,
            http: reqwest::Client::new(),
            base,
            remote,
            _dir: dir,
        }
    }

    async fn client(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self.http.request(method, format!("{}{}", self.base, path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// A request signed by `remote.test` (or with `auth` as the Authorization header).
    async fn fed(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        auth: Option<String>,
    ) -> (u16, Value) {
        let ours = "localhost:8008";
        let auth = auth
            .unwrap_or_else(|| x_matrix(&self.remote, method.as_str(), path, ours, body.as_ref()));
        let mut req = self
            .http
            .request(method, format!("{}{}", self.base, path))
            .header("Authorization", auth);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn register(&self, name: &str) -> String {
        let (status, v) = self
            .client(
                reqwest::Method::POST,
                "/_matrix/client/v3/register",
                None,
                Some(json!({ "username": name, "password": "pw", "auth": { "type": "m.login.dummy" } })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["access_token"].as_str().unwrap().to_owned()
    }

    async fn public_room(&self, token: &str, messages: usize) -> (String, String) {
        let room = self
            .create_room(token, json!({ "preset": "public_chat" }))
            .await;
        let mut last = String::new();
        for i in 0..messages {
            let (status, v) = self
                .client(
                    reqwest::Method::PUT,
                    &format!(
                        "/_matrix/client/v3/rooms/{}/send/m.room.message/t{i}",
                        enc(&room)
                    ),
                    Some(token),
                    Some(json!({ "msgtype": "m.text", "body": format!("m{i}") })),
                )
                .await;
            assert_eq!(status, 200, "{v}");
            last = v["event_id"].as_str().unwrap().to_owned();
        }
        (room, last)
    }

    /// Waits until every projection (search too) has applied the journal head, so a
    /// measurement holds only what its request caused.
    async fn quiesce(&self) {
        let head = self.server.journal.durable_head();
        assert!(
            self.server
                .projections
                .runtime
                .wait_for_all(head, std::time::Duration::from_secs(10))
                .await
        );
    }

    fn reads(&self) -> u64 {
        self.server.projections.db.stats().total()
    }

    /// `remote.test`'s user joins `room` through make_join and send_join; returns the
    /// send_join answer.
    async fn remote_join(&self, room: &str, user: &str) -> Value {
        let (status, made) = self.make_join(room, user).await;
        assert_eq!(status, 200, "{made}");
        let version = made["room_version"].as_str().unwrap();
        let (_, status, joined) = self.send_join(room, version, made["event"].clone()).await;
        assert_eq!(status, 200, "{joined}");
        joined
    }

    /// `GET make_join` for `user` of `remote.test` (versions 10 and 11): the status and
    /// the answer.
    async fn make_join(&self, room: &str, user: &str) -> (u16, Value) {
        self.fed(
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/make_join/{}/{}?ver=10&ver=11",
                enc(room),
                enc(user)
            ),
            None,
            None,
        )
        .await
    }

    /// Signs `template` as `remote.test` and sends it to `send_join` (v2): the signed
    /// join, the status and the answer.
    async fn send_join(&self, room: &str, version: &str, template: Value) -> (Pdu, u16, Value) {
        self.send_join_with(room, version, template, "").await
    }

    /// [`Harness::send_join`] with a query string (`"?omit_members=true"`).
    async fn send_join_with(
        &self,
        room: &str,
        version: &str,
        template: Value,
        query: &str,
    ) -> (Pdu, u16, Value) {
        let pdu = Pdu::sign_template(template, version, &self.remote, 1_700_000_000_000).unwrap();
        let (status, v) = self
            .fed(
                reqwest::Method::PUT,
                &format!(
                    "/_matrix/federation/v2/send_join/{}/{}{query}",
                    enc(room),
                    enc(pdu.event_id.as_str())
                ),
                Some(pdu.federation_json()),
                None,
            )
            .await;
        (pdu, status, v)
    }
}

fn x_matrix(
    key: &ServerKey,
    method: &str,
    uri: &str,
    destination: &str,
    content: Option<&Value>,
) -> String {
    let mut req = json!({ "method": method, "uri": uri, "origin": key.server_name(), "destination": destination });
    if let Some(c) = content {
        req["content"] = c.clone();
    }
    let obj = spindle_core::canonical::to_object(req).unwrap();
    let sig = key.sign_bytes(&spindle_core::canonical::to_bytes(&obj));
    format!(
        "X-Matrix origin=\"{}\",destination=\"{destination}\",key=\"{}\",sig=\"{sig}\"",
        key.server_name(),
        key.key_id()
    )
}

#[tokio::test]
async fn requests_must_be_signed_by_their_origin_for_this_server() {
    let h = Harness::start().await;
    let path = "/_matrix/federation/v1/query/profile?user_id=%40a%3Alocalhost%3A8008";
    // No header, a wrong destination, a tampered signature, an unknown key id.
    let (status, v) = h
        .fed(reqwest::Method::GET, path, None, Some("Bearer nope".into()))
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (401, Some("M_UNAUTHORIZED"))
    );
    let wrong_dest = x_matrix(&h.remote, "GET", path, "elsewhere.test", None);
    let (status, v) = h
        .fed(reqwest::Method::GET, path, None, Some(wrong_dest))
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (401, Some("M_UNAUTHORIZED"))
    );
    let other_path = x_matrix(
        &h.remote,
        "GET",
        "/_matrix/federation/v1/version",
        "localhost:8008",
        None,
    );
    let (status, v) = h
        .fed(reqwest::Method::GET, path, None, Some(other_path))
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (401, Some("M_UNAUTHORIZED"))
    );
    let impostor = ServerKey::generate(REMOTE);
    let forged = x_matrix(&impostor, "GET", path, "localhost:8008", None);
    let (status, v) = h.fed(reqwest::Method::GET, path, None, Some(forged)).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (401, Some("M_UNAUTHORIZED"))
    );
    // Properly signed: answered (the user does not exist: 404).
    let (status, v) = h.fed(reqwest::Method::GET, path, None, None).await;
    assert_eq!((status, v["errcode"].as_str()), (404, Some("M_NOT_FOUND")));
}

#[tokio::test]
async fn a_server_with_no_member_in_the_room_reads_nothing() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let (room, last) = h.public_room(&token, 3).await;
    let r = enc(&room);
    let e = enc(&last);
    let reads = [
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/event/{e}"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/state/{r}?event_id={e}"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/state_ids/{r}?event_id={e}"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/event_auth/{r}/{e}"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/backfill/{r}?v={e}&limit=10"),
            None,
        ),
        (
            reqwest::Method::POST,
            format!("/_matrix/federation/v1/get_missing_events/{r}"),
            Some(json!({ "earliest_events": [], "latest_events": [last], "limit": 10 })),
        ),
    ];
    for (method, path, body) in &reads {
        let (status, v) = h.fed(method.clone(), path, body.clone(), None).await;
        assert_eq!(
            (status, v["errcode"].as_str()),
            (403, Some("M_FORBIDDEN")),
            "{method} {path}: {v}"
        );
    }
    // Once remote.test has a member in the room, the same reads answer.
    h.remote_join(&room, "@bob:remote.test").await;
    for (method, path, body) in &reads {
        let (status, v) = h.fed(method.clone(), path, body.clone(), None).await;
        assert_eq!(status, 200, "{method} {path}: {v}");
    }
    let (_, v) = h
        .fed(
            reqwest::Method::GET,
            &format!("/_matrix/federation/v1/event/{e}"),
            None,
            None,
        )
        .await;
    assert_eq!(v["pdus"].as_array().unwrap().len(), 1);
    // The backfill answer ends at the event asked for, newest first.
    let (_, v) = h
        .fed(
            reqwest::Method::GET,
            &format!("/_matrix/federation/v1/backfill/{r}?v={e}&limit=2"),
            None,
            None,
        )
        .await;
    assert_eq!(v["pdus"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn bad_transactions_get_matrix_errors_and_nothing_is_accepted() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let (room, _) = h.public_room(&token, 1).await;
    let joined = h.remote_join(&room, "@bob:remote.test").await;
    let bob_join = joined["event"].clone();
    let head = h.server.journal.durable_head();
    // More than 50 PDUs: 400.
    let body =
        json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": vec![bob_join.clone(); 51] });
    let (status, v) = h
        .fed(
            reqwest::Method::PUT,
            "/_matrix/federation/v1/send/t1",
            Some(body),
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (400, Some("M_BAD_JSON")));
    // Not JSON at all / pdus missing: 400, never 500.
    let (status, v) = h
        .fed(
            reqwest::Method::PUT,
            "/_matrix/federation/v1/send/t2",
            Some(json!({ "origin": REMOTE })),
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (400, Some("M_BAD_JSON")));
    // `pdus` or `edus` that is not an array: 400, and nothing of the transaction is kept.
    for (txn, body, error) in [
        (
            "t2a",
            json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": "nope" }),
            "pdus must be an array",
        ),
        (
            "t2b",
            json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": [bob_join.clone()], "edus": "nope" }),
            "edus must be an array",
        ),
        (
            "t2c",
            json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": [], "edus": { "edu_type": "m.typing" } }),
            "edus must be an array",
        ),
    ] {
        let (status, v) = h
            .fed(
                reqwest::Method::PUT,
                &format!("/_matrix/federation/v1/send/{txn}"),
                Some(body),
                None,
            )
            .await;
        assert_eq!(
            (status, v["errcode"].as_str(), v["error"].as_str()),
            (400, Some("M_BAD_JSON"), Some(error)),
            "{txn}"
        );
    }
    assert_eq!(h.server.journal.durable_head(), head);
    // A PDU whose sender is not a user of the origin, one of an unknown room, one
    // that fails auth (a stranger's message): each refused in the per-PDU results.
    let mut foreign = bob_join.clone();
    foreign["sender"] = json!("@mallory:elsewhere.test");
    let mut unknown = bob_join.clone();
    unknown["room_id"] = json!("!nowhere:localhost:8008");
    let stranger = spindle_core::pdu::PduTemplate {
        room_version: "10".into(),
        room_id: Some(room.as_str().try_into().unwrap()),
        sender: "@carol:remote.test".try_into().unwrap(),
        kind: "m.room.message".into(),
        state_key: None,
        content: json!({ "body": "not joined" }),
        redacts: None,
        prev_events: vec![bob_join_id(&bob_join).as_str().try_into().unwrap()],
        auth_events: vec![],
        depth: 10,
        origin_server_ts: 1_700_000_000_000,
    }
    .build(&h.remote)
    .unwrap();
    let body = json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": [foreign, unknown, stranger.federation_json()] });
    let (status, v) = h
        .fed(
            reqwest::Method::PUT,
            "/_matrix/federation/v1/send/t3",
            Some(body),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let results = v["pdus"].as_object().unwrap();
    assert_eq!(results.len(), 2, "{v}"); // the unknown room's PDU has no id to answer under
    assert!(results.values().all(|r| r["error"].is_string()), "{v}");
    assert!(
        results[stranger.event_id.as_str()]["error"]
            .as_str()
            .unwrap()
            .contains("auth")
    );
    // Only the rejection of the stranger's message was recorded; the room is unchanged.
    assert_eq!(h.server.journal.durable_head(), head + 1);
    let (_, msgs) = h
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{}/messages?dir=b&limit=50",
                enc(&room)
            ),
            Some(&token),
            None,
        )
        .await;
    assert!(!msgs.to_string().contains("not joined"));
}

fn bob_join_id(join: &Value) -> String {
    let rules = spindle_core::room_version::rules("10").unwrap();
    let mut obj = spindle_core::canonical::to_object(join.clone()).unwrap();
    obj.remove("unsigned");
    format!(
        "${}",
        ruma::signatures::reference_hash(&obj, &rules).unwrap()
    )
}

#[tokio::test]
async fn an_inbound_transaction_and_a_join_cost_what_they_carry_not_the_room_length() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let mut costs = Vec::new();
    for messages in [5usize, 300] {
        let (room, _) = h.public_room(&token, messages).await;
        let user = format!("@bob{messages}:remote.test");
        h.quiesce().await;
        let before = h.reads();
        let joined = h.remote_join(&room, &user).await;
        h.quiesce().await;
        let join_reads = h.reads() - before;
        let state_len = joined["state"].as_array().unwrap().len();
        let join_id = bob_join_id(&joined["event"]);
        let msg = spindle_core::pdu::PduTemplate {
            room_version: "10".into(),
            room_id: Some(room.as_str().try_into().unwrap()),
            sender: user.as_str().try_into().unwrap(),
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "body": "hello" }),
            redacts: None,
            prev_events: vec![join_id.as_str().try_into().unwrap()],
            auth_events: ["m.room.create", "m.room.power_levels"]
                .iter()
                .map(|t| {
                    let ev = joined["state"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|s| s["type"] == *t)
                        .unwrap();
                    bob_join_id(ev).as_str().try_into().unwrap()
                })
                .chain(std::iter::once(join_id.as_str().try_into().unwrap()))
                .collect(),
            depth: 1000,
            origin_server_ts: 1_700_000_000_000,
        }
        .build(&h.remote)
        .unwrap();
        let before = h.reads();
        let body =
            json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": [msg.federation_json()] });
        let (status, v) = h
            .fed(
                reqwest::Method::PUT,
                &format!("/_matrix/federation/v1/send/c{messages}"),
                Some(body),
                None,
            )
            .await;
        assert_eq!(status, 200);
        assert_eq!(v["pdus"][msg.event_id.as_str()], json!({}), "{v}");
        h.quiesce().await;
        let txn_reads = h.reads() - before;
        costs.push((state_len, join_reads, txn_reads));
    }
    let stats = &h.server.federation.keys.fetches;
    assert_eq!(
        stats.load(Ordering::Relaxed),
        0,
        "pinned keys are not fetched"
    );
    // Same state, same cost: (state events, join reads, transaction reads).
    assert_eq!(costs[0], costs[1], "5 vs 300 messages: {costs:?}");
    assert!(costs[0].0 >= 4, "{costs:?}");
}

impl Harness {
    /// A C-S request that must answer 200; returns the `event_id` it names, if any.
    async fn ok(&self, method: reqwest::Method, path: &str, token: &str, body: Value) -> String {
        let (status, v) = self.client(method, path, Some(token), Some(body)).await;
        assert_eq!(status, 200, "{path}: {v}");
        v["event_id"].as_str().unwrap_or_default().to_owned()
    }

    async fn say(&self, token: &str, room: &str, txn: &str, body: &str) -> String {
        self.ok(
            reqwest::Method::PUT,
            &format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/{txn}",
                enc(room)
            ),
            token,
            json!({ "msgtype": "m.text", "body": body }),
        )
        .await
    }

    /// `GET /event/{id}` as `remote.test`: the status and the one PDU served.
    async fn fed_event(&self, id: &str) -> (u16, Value) {
        let (status, v) = self
            .fed(
                reqwest::Method::GET,
                &format!("/_matrix/federation/v1/event/{}", enc(id)),
                None,
                None,
            )
            .await;
        (status, v["pdus"][0].clone())
    }
}

#[tokio::test]
async fn history_visibility_decides_what_a_server_sees_and_a_kicked_server_sees_its_kick() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let (room, _) = h.public_room(&token, 0).await;
    let r = enc(&room);
    h.ok(
        reqwest::Method::PUT,
        &format!("/_matrix/client/v3/rooms/{r}/state/m.room.history_visibility/"),
        &token,
        json!({ "history_visibility": "joined" }),
    )
    .await;
    let before = h.say(&token, &room, "t1", "before bob").await;
    let joined = h.remote_join(&room, "@bob:remote.test").await;
    let join_id = bob_join_id(&joined["event"]);
    let during = h.say(&token, &room, "t2", "while bob is here").await;
    h.quiesce().await;

    // `joined` history from before remote.test's user joined: served redacted, with
    // its hashes and signatures, so remote.test can still check it.
    let (status, pdu) = h.fed_event(&before).await;
    assert_eq!(status, 200);
    assert_eq!(pdu["content"], json!({}), "{pdu}");
    assert_eq!(pdu["type"], "m.room.message");
    assert!(pdu["hashes"]["sha256"].is_string(), "{pdu}");
    assert!(pdu["signatures"]["localhost:8008"].is_object(), "{pdu}");
    let (status, pdu) = h.fed_event(&during).await;
    assert_eq!(
        (status, pdu["content"]["body"].as_str()),
        (200, Some("while bob is here"))
    );

    h.ok(
        reqwest::Method::POST,
        &format!("/_matrix/client/v3/rooms/{r}/kick"),
        &token,
        json!({ "user_id": "@bob:remote.test", "reason": "bye" }),
    )
    .await;
    let (_, v) = h
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{r}/state/m.room.member/%40bob%3Aremote.test?format=event"
            ),
            Some(&token),
            None,
        )
        .await;
    let kick = v["event_id"].as_str().unwrap().to_owned();
    let after = h.say(&token, &room, "t3", "after bob").await;
    h.quiesce().await;

    // remote.test has no member now. It still gets its own user's kick (whole, reason
    // included), and what it saw while joined; nothing sent after.
    let (status, pdu) = h.fed_event(&kick).await;
    assert_eq!(status, 200);
    assert_eq!(
        (
            pdu["content"]["membership"].as_str(),
            pdu["content"]["reason"].as_str()
        ),
        (Some("leave"), Some("bye"))
    );
    let (status, pdu) = h.fed_event(&during).await;
    assert_eq!(
        (status, pdu["content"]["body"].as_str()),
        (200, Some("while bob is here"))
    );
    let (status, _) = h.fed_event(&after).await;
    assert_eq!(status, 403);
    let (status, v) = h
        .fed(
            reqwest::Method::POST,
            &format!("/_matrix/federation/v1/get_missing_events/{r}"),
            Some(json!({ "earliest_events": [], "latest_events": [after], "limit": 10 })),
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (403, Some("M_FORBIDDEN")));

    // A backfill from the kick: newest first, ending at the join (what came before it,
    // remote.test had no member for, and has none now).
    let (status, v) = h
        .fed(
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/backfill/{r}?v={}&limit=4",
                enc(&kick)
            ),
            None,
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let pdus = v["pdus"].as_array().unwrap();
    let ids: Vec<String> = pdus.iter().map(bob_join_id).collect();
    assert_eq!(ids, vec![kick.clone(), during.clone(), join_id]);
    assert_eq!(pdus[1]["content"]["body"], "while bob is here");

    // An event redacted since is served redacted, to a server that could see it.
    h.ok(
        reqwest::Method::PUT,
        &format!("/_matrix/client/v3/rooms/{r}/redact/{}/x1", enc(&during)),
        &token,
        json!({}),
    )
    .await;
    h.quiesce().await;
    let (status, pdu) = h.fed_event(&during).await;
    assert_eq!((status, &pdu["content"]), (200, &json!({})));
}

#[tokio::test]
async fn shared_history_from_before_a_server_joined_is_served_whole() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let (room, first) = h.public_room(&token, 1).await;
    h.remote_join(&room, "@bob:remote.test").await;
    h.quiesce().await;
    let (status, pdu) = h.fed_event(&first).await;
    assert_eq!((status, pdu["content"]["body"].as_str()), (200, Some("m0")));
}

impl Harness {
    /// A v10 room of `token`'s user whose join rule is `restricted` to `allow`.
    async fn restricted_room(&self, token: &str, allow: &[&str], extra: Value) -> String {
        let allow: Vec<Value> = allow
            .iter()
            .map(|r| json!({ "type": "m.room_membership", "room_id": r }))
            .collect();
        let mut body = json!({
            "room_version": "10",
            "initial_state": [{
                "type": "m.room.join_rules", "state_key": "",
                "content": { "join_rule": "restricted", "allow": allow },
            }],
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        self.create_room(token, body).await
    }

    /// `POST /createRoom` with `body`, which must answer 200: the room id.
    async fn create_room(&self, token: &str, body: Value) -> String {
        let (status, v) = self
            .client(
                reqwest::Method::POST,
                "/_matrix/client/v3/createRoom",
                Some(token),
                Some(body),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["room_id"].as_str().unwrap().to_owned()
    }
}

/// Spec: server-server "Restricted rooms", `make_join`/`send_join` responses, and the
/// v8+ auth rules for `join_authorised_via_users_server`.
#[tokio::test]
async fn a_restricted_room_vouches_for_members_of_its_allowed_rooms_and_countersigns() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let alice = "@alice:localhost:8008";
    let (space, _) = h.public_room(&token, 0).await;
    let room = h.restricted_room(&token, &[&space], json!({})).await;
    let bob = "@bob:remote.test";
    // Not in the allowed room yet: 403.
    let (status, v) = h.make_join(&room, bob).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (403, Some("M_FORBIDDEN")),
        "{v}"
    );
    // In the allowed room: a template naming alice, with her membership as an auth event.
    h.remote_join(&space, bob).await;
    let (status, made) = h.make_join(&room, bob).await;
    assert_eq!(status, 200, "{made}");
    let template = made["event"].clone();
    assert_eq!(
        template["content"],
        json!({ "membership": "join", "join_authorised_via_users_server": alice })
    );
    let (_, state) = h
        .client(
            reqwest::Method::GET,
            &format!("/_matrix/client/v3/rooms/{}/state", enc(&room)),
            Some(&token),
            None,
        )
        .await;
    let alice_member = state
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.room.member" && e["state_key"] == alice)
        .unwrap()["event_id"]
        .clone();
    assert!(
        template["auth_events"]
            .as_array()
            .unwrap()
            .contains(&alice_member),
        "{template}"
    );
    // Someone else's join through the same template is judged again at send_join.
    let mut forged = template.clone();
    forged["sender"] = json!("@carol:remote.test");
    forged["state_key"] = json!("@carol:remote.test");
    let (_, status, v) = h.send_join(&room, "10", forged).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (403, Some("M_FORBIDDEN")),
        "{v}"
    );
    // Bob's join is countersigned by this server and appended.
    let (pdu, status, joined) = h.send_join(&room, "10", template).await;
    assert_eq!(status, 200, "{joined}");
    let mut signers: Vec<&str> = joined["event"]["signatures"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    signers.sort();
    assert_eq!(signers, ["localhost:8008", "remote.test"]);
    assert_eq!(bob_join_id(&joined["event"]), pdu.event_id.as_str());
    let (status, member) = h
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
                enc(&room),
                enc(bob)
            ),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 200, "{member}");
    assert_eq!(member["join_authorised_via_users_server"], json!(alice));
    // The join as served over federation carries both signatures.
    let (status, served) = h.fed_event(pdu.event_id.as_str()).await;
    assert_eq!(status, 200);
    assert!(
        served["signatures"]["localhost:8008"].is_object(),
        "{served}"
    );

    // Restricted to a room this server is not in: it cannot tell.
    let elsewhere = h
        .restricted_room(&token, &["!unknown:elsewhere.test"], json!({}))
        .await;
    let (status, v) = h.make_join(&elsewhere, bob).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (400, Some("M_UNABLE_TO_AUTHORISE_JOIN")),
        "{v}"
    );
    // Nobody here may invite (alice stepped down below `invite`): try another server.
    let no_inviter = h
        .restricted_room(
            &token,
            &[&space],
            json!({ "power_level_content_override": { "invite": 100 } }),
        )
        .await;
    h.ok(
        reqwest::Method::PUT,
        &format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.power_levels/",
            enc(&no_inviter)
        ),
        &token,
        json!({ "users": { alice: 50 }, "invite": 100 }),
    )
    .await;
    let (status, v) = h.make_join(&no_inviter, bob).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (400, Some("M_UNABLE_TO_GRANT_JOIN")),
        "{v}"
    );
}

impl Harness {
    /// The `/sync` answer for `token` (`since` from an earlier one, or a full sync).
    async fn sync(&self, token: &str, since: Option<&str>) -> Value {
        let path = match since {
            Some(s) => format!("/_matrix/client/v3/sync?timeout=0&since={}", enc(s)),
            None => "/_matrix/client/v3/sync?timeout=0".to_owned(),
        };
        let (status, v) = self
            .client(reqwest::Method::GET, &path, Some(token), None)
            .await;
        assert_eq!(status, 200, "{v}");
        v
    }

    /// A `/send` transaction from `remote.test` carrying only `edus`.
    async fn send_edus(&self, txn: &str, edus: Value) {
        let body = json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": [], "edus": edus });
        let (status, v) = self
            .fed(
                reqwest::Method::PUT,
                &format!("/_matrix/federation/v1/send/{txn}"),
                Some(body),
                None,
            )
            .await;
        assert_eq!((status, &v), (200, &json!({ "pdus": {} })));
    }
}

#[tokio::test]
async fn inbound_edus_reach_our_users_and_their_journal_records_take_one_fsync() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let (_, who) = h
        .client(
            reqwest::Method::GET,
            "/_matrix/client/v3/account/whoami",
            Some(&token),
            None,
        )
        .await;
    let device = who["device_id"].as_str().unwrap().to_owned();
    let (room, last) = h.public_room(&token, 2).await;
    let bob = "@bob:remote.test";
    h.remote_join(&room, bob).await;
    h.quiesce().await;
    let since = h.sync(&token, None).await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    let alice = "@alice:localhost:8008";
    let fsyncs = &h.server.journal.stats().fsyncs;
    let before = fsyncs.load(Ordering::SeqCst);
    h.send_edus(
        "e1",
        json!([
            { "edu_type": "m.typing", "content": { "room_id": room, "user_id": bob, "typing": true } },
            // Not the origin's user, and a user not in the room: both dropped.
            { "edu_type": "m.typing", "content": { "room_id": room, "user_id": "@eve:elsewhere.test", "typing": true } },
            { "edu_type": "m.typing", "content": { "room_id": room, "user_id": "@carol:remote.test", "typing": true } },
            { "edu_type": "m.receipt", "content": { &room: {
                "m.read": {
                    bob: { "event_ids": [last], "data": { "ts": 1_700_000_000_123u64 } },
                    "@carol:remote.test": { "event_ids": [last], "data": { "ts": 1 } },
                },
                "m.read.private": { bob: { "event_ids": [last], "data": { "ts": 2 } } },
            }}},
            { "edu_type": "m.direct_to_device", "content": {
                "sender": bob, "type": "m.test", "message_id": "m1",
                "messages": {
                    alice: { &device: { "n": 1 } },
                    "@zed:elsewhere.test": { "D": { "n": 2 } },
                },
            }},
            { "edu_type": "m.presence", "content": { "push": [
                { "user_id": bob, "presence": "online", "status_msg": "on a train",
                  "last_active_ago": 1000, "currently_active": true },
                { "user_id": "@eve:elsewhere.test", "presence": "online", "last_active_ago": 0 },
            ]}},
            { "edu_type": "m.device_list_update", "content": {
                "user_id": bob, "device_id": "PHONE", "stream_id": 7, "prev_id": [6],
            }},
            // Nobody here shares a room with carol: dropped.
            { "edu_type": "m.signing_key_update", "content": { "user_id": "@carol:remote.test" } },
            { "edu_type": "org.example.unknown", "content": {} },
        ]),
    )
    .await;
    // One receipt, one to-device message and one device list change journaled: one
    // run, one fsync.
    assert_eq!(fsyncs.load(Ordering::SeqCst) - before, 1);
    // The same message id again, in a retry under a new transaction id: not delivered
    // twice (and nothing new is written).
    h.send_edus(
        "e2",
        json!([{ "edu_type": "m.direct_to_device", "content": {
            "sender": bob, "type": "m.test", "message_id": "m1",
            "messages": { alice: { &device: { "n": 1 } } },
        }}]),
    )
    .await;
    assert_eq!(fsyncs.load(Ordering::SeqCst) - before, 1);
    h.quiesce().await;
    let v = h.sync(&token, Some(&since)).await;
    let joined = &v["rooms"]["join"][&room];
    let ephemeral = joined["ephemeral"]["events"].as_array().unwrap();
    let typing = ephemeral.iter().find(|e| e["type"] == "m.typing").unwrap();
    assert_eq!(typing["content"]["user_ids"], json!([bob]));
    let receipt = ephemeral.iter().find(|e| e["type"] == "m.receipt").unwrap();
    assert_eq!(
        receipt["content"],
        json!({ &last: { "m.read": { bob: { "ts": 1_700_000_000_123u64 } } } })
    );
    let to_device = v["to_device"]["events"].as_array().unwrap();
    assert_eq!(
        to_device,
        &vec![json!({ "sender": bob, "type": "m.test", "content": { "n": 1 } })]
    );
    assert_eq!(v["device_lists"]["changed"], json!([bob]), "{v}");
    let presence = v["presence"]["events"].as_array().unwrap();
    assert_eq!(presence.len(), 1, "{presence:?}");
    assert_eq!(presence[0]["sender"], bob);
    assert_eq!(presence[0]["content"]["presence"], "online");
    assert_eq!(presence[0]["content"]["status_msg"], "on a train");
    // Typing stops when the origin says so.
    let since = v["next_batch"].as_str().unwrap().to_owned();
    h.send_edus(
        "e3",
        json!([{ "edu_type": "m.typing", "content": { "room_id": room, "user_id": bob, "typing": false } }]),
    )
    .await;
    let v = h.sync(&token, Some(&since)).await;
    let ephemeral = v["rooms"]["join"][&room]["ephemeral"]["events"]
        .as_array()
        .unwrap();
    let typing = ephemeral.iter().find(|e| e["type"] == "m.typing").unwrap();
    assert_eq!(typing["content"]["user_ids"], json!([]));
}

/// The (type, state key) pairs of a `send_join` answer's `state`, sorted.
/// Inbound `m.presence` keeps a `status_msg` of up to 1,024 bytes (the cap the
/// Client-Server API applies) whole and cuts a longer one at a character boundary.
#[tokio::test]
async fn inbound_presence_status_msg_is_capped_at_1024_bytes_on_a_char_boundary() {
    let h = Harness::start().await;
    let token = h.register("alice").await;
    let (room, _) = h.public_room(&token, 1).await;
    let bob = "@bob:remote.test";
    h.remote_join(&room, bob).await;
    h.quiesce().await;
    let at_cap = "é".repeat(512);
    assert_eq!(at_cap.len(), 1024);
    let over = format!("a{at_cap}");
    assert_eq!(over.len(), 1025);
    let kept_of_over = format!("a{}", "é".repeat(511));
    for (txn, sent, kept) in [("p1", &at_cap, &at_cap), ("p2", &over, &kept_of_over)] {
        h.send_edus(
            txn,
            json!([{ "edu_type": "m.presence", "content": { "push": [
                { "user_id": bob, "presence": "unavailable", "status_msg": sent, "last_active_ago": 5 },
            ]}}]),
        )
        .await;
        let (status, v) = h
            .client(
                reqwest::Method::GET,
                &format!("/_matrix/client/v3/presence/{}/status", enc(bob)),
                Some(&token),
                None,
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["presence"], "unavailable", "{txn}");
        assert_eq!(v["status_msg"].as_str(), Some(kept.as_str()), "{txn}");
    }
    assert_eq!(kept_of_over.len(), 1023);
}

fn slots(joined: &Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = joined["state"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_owned(),
                e["state_key"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Spec: `send_join` v2 `omit_members` (MSC3706), the resident side of partial-state
/// joins. The counting guard: a reduced answer holds the same number of state events
/// and auth events whatever the member count, and no member events but the heroes'
/// when the room has no name (then exactly `min(5, others)` of them).
#[tokio::test]
async fn send_join_with_omit_members_answers_a_state_that_does_not_grow_with_the_members() {
    let h = Harness::start().await;
    let owner = h.register("owner").await;
    let mut tokens = Vec::new();
    for i in 0..11 {
        tokens.push(h.register(&format!("member{i}")).await);
    }
    // Two named rooms (2 and 12 members) and two unnamed ones (2 and 12 members).
    let mut answers = Vec::new();
    for (named, members) in [(true, 1usize), (true, 11), (false, 1), (false, 11)] {
        let body = if named {
            json!({ "preset": "public_chat", "name": "Big" })
        } else {
            json!({ "preset": "public_chat" })
        };
        let room = h.create_room(&owner, body).await;
        for t in tokens.iter().take(members) {
            let (status, v) = h
                .client(
                    reqwest::Method::POST,
                    &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
                    Some(t),
                    Some(json!({})),
                )
                .await;
            assert_eq!(status, 200, "{v}");
        }
        let user = format!("@joiner{}:{REMOTE}", answers.len());
        let (status, made) = h.make_join(&room, &user).await;
        assert_eq!(status, 200, "{made}");
        let version = made["room_version"].as_str().unwrap().to_owned();
        let (_, status, joined) = h
            .send_join_with(&room, &version, made["event"].clone(), "?omit_members=true")
            .await;
        assert_eq!(status, 200, "{joined}");
        assert_eq!(joined["members_omitted"], json!(true));
        assert_eq!(joined["servers_in_room"], json!(["localhost:8008", REMOTE]));
        answers.push(joined);
    }
    let count = |v: &Value, k: &str| v[k].as_array().unwrap().len();
    let members = |v: &Value| {
        slots(v)
            .into_iter()
            .filter(|(t, _)| t == "m.room.member")
            .count()
    };
    // Named rooms: no member events at all, and the same answer size for 2 and 12.
    assert_eq!(members(&answers[0]), 0);
    assert_eq!(members(&answers[1]), 0);
    assert_eq!(slots(&answers[0]), slots(&answers[1]));
    assert_eq!(
        count(&answers[0], "auth_chain"),
        count(&answers[1], "auth_chain")
    );
    // Unnamed rooms: the heroes' member events, at most 5 (the owner and one member;
    // then five of the twelve).
    assert_eq!(members(&answers[2]), 2);
    assert_eq!(members(&answers[3]), 5);
    assert_eq!(
        count(&answers[2], "state"),
        slots(&answers[0]).len() - 1 + 2
    );
    assert_eq!(
        count(&answers[3], "state"),
        slots(&answers[0]).len() - 1 + 5
    );
    // Without the flag the whole member list comes: 12 members, none omitted.
    let room = h
        .create_room(&owner, json!({ "preset": "public_chat", "name": "Full" }))
        .await;
    for t in &tokens {
        h.client(
            reqwest::Method::POST,
            &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
            Some(t),
            Some(json!({})),
        )
        .await;
    }
    let full = h.remote_join(&room, "@full:remote.test").await;
    assert_eq!(full["members_omitted"], json!(false));
    assert_eq!(members(&full), 12);
}
