//! Counting guards (BRIEF §3.9, §4): the store reads of a request follow the size of
//! its answer, not the size of the room or other users' traffic. Counts come from the
//! projection store's counters (`ProjectionDb::stats`), never from wall clocks.

use std::sync::atomic::Ordering;

use serde_json::{Value, json};

struct Harness {
    server: spindle::Server,
    http: reqwest::Client,
    base: String,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let config = spindle::Config {
            bind: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().to_path_buf(),
            ..Default::default()
        };
        let server = spindle::Server::start(config).await.unwrap();
        let base = format!("http://{}", server.addr);
        Harness {
            server,
            http: reqwest::Client::new(),
            base,
            _dir: dir,
        }
    }

    async fn call(
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

    async fn register(&self, name: &str) -> (String, String) {
        let body =
            json!({ "username": name, "password": "pw", "auth": { "type": "m.login.dummy" } });
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                "/_matrix/client/v3/register",
                None,
                Some(body),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        (
            v["user_id"].as_str().unwrap().to_owned(),
            v["access_token"].as_str().unwrap().to_owned(),
        )
    }

    async fn create_room(&self, token: &str, body: Value) -> String {
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                "/_matrix/client/v3/createRoom",
                Some(token),
                Some(body),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["room_id"].as_str().unwrap().to_owned()
    }

    async fn send(&self, token: &str, room: &str, txn: &str, body: &str) -> String {
        let path = format!("/_matrix/client/v3/rooms/{room}/send/m.room.message/{txn}");
        let (status, v) = self
            .call(
                reqwest::Method::PUT,
                &path,
                Some(token),
                Some(json!({ "msgtype": "m.text", "body": body })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["event_id"].as_str().unwrap().to_owned()
    }

    async fn join(&self, token: &str, room: &str) {
        let (status, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/_matrix/client/v3/rooms/{room}/join"),
                Some(token),
                Some(json!({})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }

    fn reads(&self) -> u64 {
        let stats = self.server.projections.db.stats();
        stats.reads.load(Ordering::Relaxed) + stats.rows_scanned.load(Ordering::Relaxed)
    }

    async fn quiesce(&self) {
        let head = self.server.journal.durable_head();
        assert!(
            self.server
                .projections
                .runtime
                .wait_for(head, std::time::Duration::from_secs(10))
                .await
        );
    }
}

/// Unread counts are a handful of seeks whatever the number of unread events
/// (the seed project walked every event after the receipt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_count_reads_do_not_grow_with_unread_events() {
    let h = Harness::start().await;
    let (_alice, at) = h.register("alice").await;
    let (bob, bt) = h.register("bob").await;
    let small = h.create_room(&at, json!({ "preset": "public_chat" })).await;
    let big = h.create_room(&at, json!({ "preset": "public_chat" })).await;
    h.join(&bt, &small).await;
    h.join(&bt, &big).await;
    for i in 0..5 {
        h.send(&at, &small, &format!("s{i}"), "hello").await;
    }
    for i in 0..200 {
        h.send(&at, &big, &format!("b{i}"), "hello").await;
    }
    h.send(&bt, &big, "own", "bob's own message does not count")
        .await;
    h.quiesce().await;
    let upto = h.server.projections.runtime.applied();
    let receipts = &h.server.projections.receipts;
    let join_pos = |room: &str| {
        h.server
            .projections
            .membership
            .get(room, &bob)
            .unwrap()
            .position
    };

    let before = h.reads();
    assert_eq!(receipts.unread(&small, &bob, join_pos(&small), upto), 5);
    let small_reads = h.reads() - before;
    let before = h.reads();
    assert_eq!(receipts.unread(&big, &bob, join_pos(&big), upto), 200);
    let big_reads = h.reads() - before;
    // Four seeks, each returning at most one row, whatever the number of unread events
    // (5 vs 200 here; the seed's walk would have read 5 vs 200 rows).
    assert!(
        small_reads <= 4,
        "unread count took {small_reads} store reads"
    );
    assert!(big_reads <= 4, "unread count took {big_reads} store reads");
}

/// A user's incremental sync does not pay for traffic in rooms they are not in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_sync_reads_do_not_grow_with_strangers_traffic() {
    let h = Harness::start().await;
    let (_carol, ct) = h.register("carol").await;
    let (_dave, dt) = h.register("dave").await;
    let mine = h.create_room(&ct, json!({})).await;
    h.send(&ct, &mine, "c0", "mine").await;
    let strangers: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(h.create_room(&dt, json!({})).await);
        }
        v
    };
    let mut measure = Vec::new();
    for (round, traffic) in [(0, 0usize), (1, 150)].into_iter() {
        h.quiesce().await;
        let (_, first) = h
            .call(
                reqwest::Method::GET,
                "/_matrix/client/v3/sync",
                Some(&ct),
                None,
            )
            .await;
        let since = first["next_batch"].as_str().unwrap().to_owned();
        for i in 0..traffic {
            h.send(&dt, &strangers[i % 3], &format!("r{round}-{i}"), "noise")
                .await;
        }
        h.send(&ct, &mine, &format!("c{round}-new"), "one new message")
            .await;
        h.quiesce().await;
        let before = h.reads();
        let (status, v) = h
            .call(
                reqwest::Method::GET,
                &format!("/_matrix/client/v3/sync?since={since}&timeout=0"),
                Some(&ct),
                None,
            )
            .await;
        assert_eq!(status, 200);
        let reads = h.reads() - before;
        let events = v["rooms"]["join"][&mine]["timeline"]["events"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(events.len(), 1, "{v}");
        assert_eq!(events[0]["content"]["body"], "one new message");
        assert_eq!(
            v["rooms"]["join"].as_object().unwrap().len(),
            1,
            "strangers' rooms never appear"
        );
        measure.push(reads);
    }
    assert_eq!(
        measure[0], measure[1],
        "incremental sync store reads changed with strangers' traffic: {measure:?}"
    );
}

/// A single state lookup reads one trie path, not the room's whole state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_point_lookup_reads_one_path() {
    let h = Harness::start().await;
    let (_erin, et) = h.register("erin").await;
    let small = h.create_room(&et, json!({ "name": "small" })).await;
    let big = h.create_room(&et, json!({ "name": "big" })).await;
    for i in 0..400 {
        let path = format!("/_matrix/client/v3/rooms/{big}/state/org.example.filler/key{i}");
        let (status, _) = h
            .call(
                reqwest::Method::PUT,
                &path,
                Some(&et),
                Some(json!({ "i": i })),
            )
            .await;
        assert_eq!(status, 200);
    }
    h.quiesce().await;
    let state = &h.server.projections.state;
    let mut reads = Vec::new();
    for (room, name) in [(&small, "small"), (&big, "big")] {
        let root = state.current_root(room).unwrap();
        let before = h.reads();
        let id = state.lookup(root, "m.room.name", "").unwrap();
        reads.push(h.reads() - before);
        let ev = h.server.projections.timeline.event(&id).unwrap();
        assert_eq!(ev.pdu.content_value()["name"], name);
    }
    // One node per trie level: ~log32(state size) + 1. Never the whole state.
    assert!(reads[0] <= 3, "small room lookup read {} nodes", reads[0]);
    assert!(
        reads[1] <= 5,
        "big room (400+ state entries) lookup read {} nodes",
        reads[1]
    );
}

/// A waiting long-poll does not pay store reads for other users' traffic: the wake-up
/// check answers from memory (BRIEF §4: "a user paid for strangers' traffic").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_does_not_read_the_store_for_strangers_traffic() {
    let h = Harness::start().await;
    let (_frank, ft) = h.register("frank").await;
    let (_gina, gt) = h.register("gina").await;
    let mut franks = Vec::new();
    for _ in 0..5 {
        franks.push(h.create_room(&ft, json!({})).await);
    }
    let stranger_room = h.create_room(&gt, json!({})).await;

    // Baseline: the strangers' sends alone.
    h.quiesce().await;
    let before = h.reads();
    for i in 0..40 {
        h.send(&gt, &stranger_room, &format!("a{i}"), "noise").await;
    }
    h.quiesce().await;
    let alone = h.reads() - before;

    // The same sends while frank long-polls.
    let (_, first) = h
        .call(
            reqwest::Method::GET,
            "/_matrix/client/v3/sync",
            Some(&ft),
            None,
        )
        .await;
    let since = first["next_batch"].as_str().unwrap().to_owned();
    h.quiesce().await;
    let poll = {
        let (http, base, ft) = (h.http.clone(), h.base.clone(), ft.clone());
        tokio::spawn(async move {
            http.get(format!(
                "{base}/_matrix/client/v3/sync?since={since}&timeout=30000"
            ))
            .bearer_auth(ft)
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await; // the poll is waiting
    let before = h.reads();
    for i in 0..40 {
        h.send(&gt, &stranger_room, &format!("b{i}"), "noise").await;
    }
    h.quiesce().await;
    let with_poll = h.reads() - before;
    assert!(
        with_poll <= alone + 2,
        "a waiting long-poll read the store for strangers' traffic: {alone} reads without it, {with_poll} with it"
    );
    // Frank's own message ends the wait and is delivered.
    h.send(&ft, &franks[2], "mine", "for frank").await;
    let v = poll.await.unwrap();
    let events = v["rooms"]["join"][&franks[2]]["timeline"]["events"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["content"]["body"], "for frank");
    assert_eq!(v["rooms"]["join"].as_object().unwrap().len(), 1);
}

/// An idle room costs an incremental sync one row (the user's room list) and nothing
/// else: no receipt, account data or timeline reads for rooms with nothing new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_rooms_cost_one_row_each_in_incremental_sync() {
    let h = Harness::start().await;
    let (_hal, ht) = h.register("hal").await;
    let active = h.create_room(&ht, json!({})).await;
    let mut measure = Vec::new();
    for (round, idle) in [(0, 3usize), (1, 23)] {
        let existing = if round == 0 { 0 } else { 3 };
        for _ in existing..idle {
            h.create_room(&ht, json!({})).await;
        }
        h.quiesce().await;
        let (_, first) = h
            .call(
                reqwest::Method::GET,
                "/_matrix/client/v3/sync",
                Some(&ht),
                None,
            )
            .await;
        let since = first["next_batch"].as_str().unwrap().to_owned();
        h.send(&ht, &active, &format!("n{round}"), "news").await;
        h.quiesce().await;
        let before = h.reads();
        let (_, v) = h
            .call(
                reqwest::Method::GET,
                &format!("/_matrix/client/v3/sync?since={since}"),
                Some(&ht),
                None,
            )
            .await;
        measure.push(h.reads() - before);
        assert_eq!(
            v["rooms"]["join"].as_object().unwrap().len(),
            1,
            "only the active room: {v}"
        );
    }
    assert_eq!(
        measure[1] - measure[0],
        20,
        "20 more idle rooms must cost exactly 20 more rows: {measure:?}"
    );
}

/// A lazy-loading initial sync of a room does not grow with its member count: the
/// non-member state has its own trie, and members are point lookups by sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_initial_sync_does_not_grow_with_members() {
    let h = Harness::start().await;
    let (_ivy, it) = h.register("ivy").await;
    let small = h.create_room(&it, json!({ "name": "small" })).await;
    let big = h.create_room(&it, json!({ "name": "big" })).await;
    // 300 extra member entries (bans need no account) in the big room only.
    for i in 0..300 {
        let path = format!("/_matrix/client/v3/rooms/{big}/ban");
        let (status, v) = h
            .call(
                reqwest::Method::POST,
                &path,
                Some(&it),
                Some(json!({ "user_id": format!("@ghost{i}:elsewhere.example") })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    for room in [&small, &big] {
        for i in 0..10 {
            h.send(&it, room, &format!("{room}-{i}"), "message").await;
        }
    }
    h.quiesce().await;
    let mut measure = Vec::new();
    for room in [&small, &big] {
        let filter = json!({ "room": { "rooms": [room], "state": { "lazy_load_members": true }, "timeline": { "limit": 5 } } });
        let path = format!(
            "/_matrix/client/v3/sync?filter={}",
            urlencode(&filter.to_string())
        );
        // The first call warms the room-summary cache (keyed by state root).
        h.call(reqwest::Method::GET, &path, Some(&it), None).await;
        let before = h.reads();
        let (status, v) = h.call(reqwest::Method::GET, &path, Some(&it), None).await;
        assert_eq!(status, 200);
        measure.push(h.reads() - before);
        let joined = &v["rooms"]["join"][room.as_str()];
        let state = joined["state"]["events"].as_array().unwrap();
        let members: Vec<&str> = state
            .iter()
            .filter(|e| e["type"] == "m.room.member")
            .map(|e| e["state_key"].as_str().unwrap())
            .collect();
        assert_eq!(
            members.len(),
            1,
            "only ivy's own member event is lazily loaded: {members:?}"
        );
        assert!(state.iter().any(|e| e["type"] == "m.room.name"));
        assert_eq!(joined["timeline"]["events"].as_array().unwrap().len(), 5);
    }
    assert_eq!(
        measure[0], measure[1],
        "lazy initial sync store reads grew with member count: {measure:?}"
    );
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
