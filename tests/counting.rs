//! Counting guards (BRIEF §3.9, §4): the store reads of a request follow the size of
//! its answer, not the size of the room or other users' traffic. Counts come from the
//! projection store's counters (`ProjectionDb::stats`), never from wall clocks.

mod common;

use std::sync::{Arc, atomic::Ordering};

use serde_json::{Value, json};

struct Harness {
    server: spindle::Server,
    http: reqwest::Client,
    base: String,
    _dir: tempfile::TempDir,
}

impl Harness {
    /// A server whose timeline event and state node caches are off: the guards here
    /// count what a request reads from the store, which a warm cache would hide.
    async fn start() -> Harness {
        Self::start_with(|c| {
            c.caches.timeline_event_bytes = 0;
            c.caches.state_node_bytes = 0;
        })
        .await
    }

    async fn start_with(f: impl FnOnce(&mut spindle::Config)) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let mut config = spindle::Config {
            bind: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().to_path_buf(),
            rate_limits: spindle::config::RateLimits::lifted(),
            ..Default::default()
        };
        f(&mut config);
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

    /// Puts a state event (asserting 200); returns its event id.
    async fn put_state(
        &self,
        token: &str,
        room: &str,
        event_type: &str,
        state_key: &str,
        content: Value,
    ) -> String {
        let (status, v) = self
            .call(
                reqwest::Method::PUT,
                &format!("/_matrix/client/v3/rooms/{room}/state/{event_type}/{state_key}"),
                Some(token),
                Some(content),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["event_id"].as_str().unwrap().to_owned()
    }

    /// Puts `n` state events `org.example.filler` (state keys `key0`..) with content
    /// `{"i": i}` into a room: a state that grows without members.
    async fn put_fillers(&self, token: &str, room: &str, n: usize) {
        for i in 0..n {
            let key = format!("key{i}");
            self.put_state(token, room, "org.example.filler", &key, json!({ "i": i }))
                .await;
        }
    }

    fn reads(&self) -> u64 {
        self.point_reads() + self.rows_scanned()
    }

    /// Point reads of the projection store so far.
    fn point_reads(&self) -> u64 {
        self.server
            .projections
            .db
            .stats()
            .reads
            .load(Ordering::Relaxed)
    }

    /// Rows returned by the projection store's range scans so far.
    fn rows_scanned(&self) -> u64 {
        self.server
            .projections
            .db
            .stats()
            .rows_scanned
            .load(Ordering::Relaxed)
    }

    /// Alice's two public rooms with Bob joined to both (the unread-count and history
    /// tests' reader): (alice's token, bob's id, bob's token, the two rooms).
    async fn reader_in_two_rooms(&self) -> (String, String, String, [String; 2]) {
        let (_alice, at) = self.register("alice").await;
        let (bob, bt) = self.register("bob").await;
        let a = self
            .create_room(&at, json!({ "preset": "public_chat" }))
            .await;
        let b = self
            .create_room(&at, json!({ "preset": "public_chat" }))
            .await;
        self.join(&bt, &a).await;
        self.join(&bt, &b).await;
        (at, bob, bt, [a, b])
    }

    /// Waits until every projection (the gating ones and the others: search, push
    /// delivery's tables) has applied the journal's head; returns the head.
    async fn settle(&self) -> u64 {
        let head = self.server.journal.durable_head();
        assert!(
            self.server
                .projections
                .runtime
                .wait_for_all(head, std::time::Duration::from_secs(10))
                .await
        );
        head
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
    let (at, bob, bt, [small, big]) = h.reader_in_two_rooms().await;
    // Bob's own message does not count, and marks what came before it read.
    h.send(&at, &big, "early", "read by bob's own message")
        .await;
    h.send(&bt, &big, "own", "bob's own message").await;
    for i in 0..5 {
        h.send(&at, &small, &format!("s{i}"), "hello").await;
    }
    for i in 0..200 {
        h.send(&at, &big, &format!("b{i}"), "hello").await;
    }
    h.quiesce().await;
    let upto = h.server.projections.runtime.applied();
    let push = &h.server.projections.push;
    let join_pos = |room: &str| {
        h.server
            .projections
            .membership
            .get(room, &bob)
            .unwrap()
            .position
    };

    let before = h.reads();
    let small_counts = push.unread(&small, &bob, "", join_pos(&small), upto);
    let small_reads = h.reads() - before;
    let before = h.reads();
    let big_counts = push.unread(&big, &bob, "", join_pos(&big), upto);
    let big_reads = h.reads() - before;
    assert_eq!(
        (
            small_counts.notification_count,
            small_counts.highlight_count
        ),
        (5, 0)
    );
    assert_eq!(
        (big_counts.notification_count, big_counts.highlight_count),
        (200, 0)
    );
    // Two point reads (the user's join, the user's last own event) and four seeks
    // returning at most one row each (the room's default counts and the user's own
    // adjustments, at both ends), whatever the number of unread events (5 vs 200
    // here; the bound leaves room for one stray read by a projection thread).
    assert!(
        small_reads <= 7,
        "unread count took {small_reads} store reads"
    );
    assert!(big_reads <= 7, "unread count took {big_reads} store reads");
}

/// A room's newest timeline rows come from memory once the room was read: the tail is
/// filled by one scan, then kept current by each committed event, and answers what
/// the store would (checked against the store's own scan at every step).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_tail_is_read_from_memory_and_follows_appends() {
    let h = Harness::start().await;
    let (_, at) = h.register("tia").await;
    let room = h.create_room(&at, json!({})).await;
    for i in 0..30 {
        h.send(&at, &room, &format!("t{i}"), "hello").await;
    }
    h.quiesce().await;
    let tl = &h.server.projections.timeline;
    let head = tl.last_activity(&room).unwrap();
    let before = h.rows_scanned();
    let first = tl.range_backward(&room, u64::MAX, 1, 4);
    let filled = h.rows_scanned() - before;
    assert_eq!(first.len(), 4);
    assert_eq!(first[0].0, head);
    assert_eq!(
        filled,
        spindle_projections::timeline::TAIL_ROWS as u64,
        "the fill"
    );
    // Again, and with other spans inside the tail: no row read.
    let before = h.rows_scanned();
    assert_eq!(tl.range_backward(&room, u64::MAX, 1, 4), first);
    let inside = tl.range_backward(&room, first[1].0, first[3].0, 10);
    assert_eq!(h.rows_scanned() - before, 0);
    assert_eq!(inside, first[2..4].to_vec());
    // New events join the tail after their commit.
    for i in 0..3 {
        h.send(&at, &room, &format!("n{i}"), "news").await;
    }
    h.quiesce().await;
    let before = h.rows_scanned();
    let now = tl.range_backward(&room, u64::MAX, 1, 4);
    assert_eq!(h.rows_scanned() - before, 0);
    assert_eq!(now[0].0, tl.last_activity(&room).unwrap());
    assert_eq!(now[3], first[0]);
    // A span reaching below the tail reads the store, and every answer is the store's.
    let deep = tl.range_backward(&room, u64::MAX, 1, 30);
    assert_eq!(deep.len(), 30);
    assert_eq!(deep[..4], now[..]);
    assert!(tl.tails_kept() >= 1);
}

/// A local user's membership is answered from the kept room list: every event rendered
/// for a viewer asks it (`unsigned.membership`, MSC4115), so a page of N events read N
/// `user_rooms` rows before. A remote user's (never kept) is one point read, and the
/// kept answer is the row's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_membership_is_read_from_memory() {
    let h = Harness::start().await;
    let (alice, at) = h.register("alice").await;
    let room = h.create_room(&at, json!({ "preset": "public_chat" })).await;
    h.ban_ghosts(&at, &room, 1).await;
    h.quiesce().await;
    let p = &h.server.projections;
    let counted = |user: &str| {
        let before = h.reads();
        let m = p.membership.get(&room, user);
        (m.map(|m| m.membership), h.reads() - before)
    };
    assert_eq!(counted(&alice), (Some("join".to_owned()), 0));
    assert_eq!(
        counted("@ghost0:elsewhere.example"),
        (Some("ban".to_owned()), 1)
    );
    // A local user without a membership: no row either, and none read.
    assert_eq!(
        counted(&format!("@nobody:{}", alice.split_once(':').unwrap().1)),
        (None, 0)
    );
    // The kept answer is the stored row's.
    let stored = p
        .membership
        .rooms_of(&alice)
        .into_iter()
        .find(|(r, _)| *r == room)
        .map(|(_, m)| m);
    assert_eq!(p.membership.get(&room, &alice), stored);
}

/// A room read up to its last event (here: the reader wrote it) costs its unread count
/// the two point reads and no count-row seek: `Projections::unread` bounds the span by
/// the room's last event (in memory), and nothing after it can count, however far the
/// stream went on in other rooms. A room with unread events still takes the seeks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_room_costs_its_unread_count_no_seek() {
    let h = Harness::start().await;
    let (at, bob, bt, [read, unread]) = h.reader_in_two_rooms().await;
    for i in 0..3 {
        h.send(&at, &read, &format!("r{i}"), "hello").await;
        h.send(&at, &unread, &format!("u{i}"), "hello").await;
    }
    // Bob answers last in `read`; the stream then moves on elsewhere.
    h.send(&bt, &read, "answer", "read it all").await;
    let elsewhere = h.create_room(&at, json!({})).await;
    for i in 0..5 {
        h.send(&at, &elsewhere, &format!("e{i}"), "elsewhere").await;
    }
    h.quiesce().await;
    let upto = h.server.projections.runtime.applied();
    let p = &h.server.projections;
    let join_pos = |room: &str| p.membership.get(room, &bob).unwrap().position;
    let seeks = |room: &str| {
        let from = join_pos(room);
        let (reads, rows) = (h.point_reads(), h.rows_scanned());
        let c = p.unread(room, &bob, "", from, upto);
        (
            (c.notification_count, c.highlight_count),
            h.point_reads() - reads,
            h.rows_scanned() - rows,
        )
    };
    let (counts, reads, rows) = seeks(&read);
    assert_eq!(counts, (0, 0));
    assert_eq!((reads, rows), (2, 0), "the read room scanned count rows");
    let (counts, _, rows) = seeks(&unread);
    assert_eq!(counts, (3, 0));
    assert!(
        rows >= 1,
        "the unread room's counts come from its count rows"
    );
    // Without the bound the read room takes the seeks too (the push projection's own
    // answer at the stream's head).
    let before = h.rows_scanned();
    let c = p.push.unread(&read, &bob, "", join_pos(&read), upto);
    assert_eq!((c.notification_count, c.highlight_count), (0, 0));
    assert!(h.rows_scanned() > before);
}

/// A user's read position in a room (where every unread count starts) is read from
/// the store once and then kept while the room's receipts do not change: a second ask
/// costs no point read; another user's receipt in the room makes the next ask read
/// again (and find the reader's position unchanged), the reader's own new receipt is
/// answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_position_is_read_once_until_the_rooms_receipts_change() {
    let h = Harness::start().await;
    let (at, bob, bt, [room, _]) = h.reader_in_two_rooms().await;
    let first = h.send(&at, &room, "m1", "one").await;
    let second = h.send(&at, &room, "m2", "two").await;
    let receipt = |token: &str, event: &str| {
        let (token, event) = (token.to_owned(), event.to_owned());
        let room = room.clone();
        let h = &h;
        async move {
            let (status, v) = h
                .call(
                    reqwest::Method::POST,
                    &format!("/_matrix/client/v3/rooms/{room}/receipt/m.read/{event}"),
                    Some(&token),
                    Some(json!({})),
                )
                .await;
            assert_eq!(status, 200, "{v}");
            h.quiesce().await;
        }
    };
    receipt(&bt, &first).await;
    let p = &h.server.projections;
    let at_event = |id: &str| p.timeline.event(id).unwrap().position;
    let ask = || {
        let reads = h.point_reads();
        let position = p.receipts.read_position(&room, &bob, None);
        (position, h.point_reads() - reads)
    };
    let (position, reads) = ask();
    assert_eq!(position, Some(at_event(&first)));
    assert_eq!(reads, 4, "the first ask reads the four receipt rows");
    assert_eq!(ask(), (Some(at_event(&first)), 0), "kept");
    // Alice's receipt changes the room's receipts, not Bob's position.
    receipt(&at, &second).await;
    let (position, reads) = ask();
    assert_eq!(position, Some(at_event(&first)));
    assert_eq!(reads, 4, "read again after the room's receipts changed");
    assert_eq!(ask(), (Some(at_event(&first)), 0));
    // Bob's own receipt moves his position at once.
    receipt(&bt, &second).await;
    assert_eq!(ask().0, Some(at_event(&second)));
    assert_eq!(ask(), (Some(at_event(&second)), 0));
}

/// A room's unread counts in `/sync` cost the same in a room of 2 members and in a
/// room of 40: counts are running rows written at append time (the room's default
/// recipient's, and a member's own where its outcome differs), never a walk over the
/// members or the events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_count_reads_do_not_grow_with_room_size() {
    let h = Harness::start().await;
    let (at, bob, _bt, [small, big]) = h.reader_in_two_rooms().await;
    for i in 0..38 {
        let (_, t) = h.register(&format!("member{i}")).await;
        h.join(&t, &big).await;
    }
    for i in 0..3 {
        h.send(&at, &small, &format!("s{i}"), "hello").await;
        h.send(&at, &big, &format!("b{i}"), "hello").await;
    }
    h.quiesce().await;
    let upto = h.server.projections.runtime.applied();
    let push = &h.server.projections.push;
    let mut reads = Vec::new();
    for room in [&small, &big] {
        let before = h.reads();
        let c = push.unread(room, &bob, "", 0, upto);
        reads.push(h.reads() - before);
        assert_eq!((c.notification_count, c.highlight_count), (3, 0));
    }
    assert_eq!(reads[0], reads[1], "reads per room: {reads:?}");
    assert!(reads[1] <= 7, "{reads:?}");
}

/// Push rules compile each glob once: a user's wildcard content rule evaluated against
/// many events compiles its pattern once (the seed recompiled per evaluation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_rule_globs_are_compiled_once_not_per_event() {
    let h = Harness::start().await;
    let (_alice, at) = h.register("alice").await;
    let (bob, bt) = h.register("bob").await;
    let room = h.create_room(&at, json!({ "preset": "public_chat" })).await;
    h.join(&bt, &room).await;
    let (status, v) = h
        .call(
            reqwest::Method::PUT,
            "/_matrix/client/v3/pushrules/global/content/cakes",
            Some(&bt),
            Some(
                json!({ "pattern": "cake*", "actions": ["notify", { "set_tweak": "highlight" }] }),
            ),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    h.send(&at, &room, "warm", "cakes are warm").await;
    h.quiesce().await;
    let push = &h.server.projections.push;
    let compiled = push.glob_compiles();
    for i in 0..60 {
        h.send(&at, &room, &format!("c{i}"), &format!("cakes {i}"))
            .await;
    }
    h.quiesce().await;
    assert_eq!(push.glob_compiles(), compiled, "no glob compiled per event");
    let upto = h.server.projections.runtime.applied();
    let c = push.unread(&room, &bob, "", 0, upto);
    assert_eq!((c.notification_count, c.highlight_count), (61, 61));
}

/// A message in a room of 40 members with the server-default rules is evaluated once,
/// for the room's default recipient, and writes no row per member: only members it
/// names (a mention) or who changed their rules (a muted room) are evaluated and get
/// rows of their own. The counts and `/notifications` are what per-member evaluation
/// gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_in_a_big_room_is_evaluated_once_not_per_member() {
    use std::sync::atomic::Ordering::Relaxed;
    let h = Harness::start_with(|c| c.push.enabled = false).await;
    let (alice, at) = h.register("alice").await;
    let (bob, bt) = h.register("bob").await;
    let room = h.create_room(&at, json!({ "preset": "public_chat" })).await;
    h.join(&bt, &room).await;
    let mut members = Vec::new();
    for i in 0..38 {
        let (id, t) = h.register(&format!("member{i}")).await;
        h.join(&t, &room).await;
        members.push((id, t));
    }
    // member9 sets a pusher after joining: its notifications are queued (delivery is
    // off in this test, so the queue keeps them).
    let (status, v) = h
        .call(
            reqwest::Method::POST,
            "/_matrix/client/v3/pushers/set",
            Some(&members[9].1),
            Some(json!({
                "kind": "http", "app_id": "a", "pushkey": "k", "app_display_name": "A",
                "device_display_name": "D", "lang": "en",
                "data": { "url": "https://push.example.org/_matrix/push/v1/notify" },
            })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    // Bob mutes the room (a room rule without actions).
    let (status, v) = h
        .call(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/pushrules/global/room/{room}"),
            Some(&bt),
            Some(json!({ "actions": [] })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    h.settle().await;
    let push = &h.server.projections.push;
    let (evals, excepts) = (
        push.stats().evaluations.load(Relaxed),
        push.stats().exceptions.load(Relaxed),
    );
    for i in 0..10 {
        h.send(&at, &room, &format!("m{i}"), "hello everyone").await;
    }
    let mention = &members[7].0;
    let (status, v) = h
        .call(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/rooms/{room}/send/m.room.message/mention"),
            Some(&at),
            Some(json!({
                "msgtype": "m.text",
                "body": "member7: look",
                "m.mentions": { "user_ids": [mention] },
            })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    h.settle().await;
    // member9's eleven notifications are queued for its gateway, nobody else's.
    assert_eq!(push.queue_len(), 11);
    // 11 messages: bob (custom rules) is evaluated for each, member7 for the mention.
    assert_eq!(push.stats().evaluations.load(Relaxed) - evals, 12);
    // Bob's 11 suppressions and member7's highlight; nobody else has a row of their own.
    assert_eq!(push.stats().exceptions.load(Relaxed) - excepts, 12);

    let upto = h.server.projections.runtime.applied();
    let counts = |user: &str| {
        let c = push.unread(&room, user, "", 0, upto);
        (c.notification_count, c.highlight_count)
    };
    assert_eq!(counts(&bob), (0, 0), "bob muted the room");
    assert_eq!(counts(mention), (11, 1), "member7 was mentioned once");
    assert_eq!(counts(&members[8].0), (11, 0));
    assert_eq!(counts(&alice), (0, 0), "alice sent them all");
    // The last member joined just before the mute: its count starts at its join.
    assert_eq!(counts(&members[37].0), (11, 0));

    let hr = &h;
    let listed = |token: &str, only: &str| {
        let h = hr;
        let path = format!("/_matrix/client/v3/notifications?limit=50{only}");
        let token = token.to_owned();
        async move {
            let (status, v) = h
                .call(reqwest::Method::GET, &path, Some(&token), None)
                .await;
            assert_eq!(status, 200, "{v}");
            v["notifications"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n["event"]["content"]["body"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert!(listed(&bt, "").await.is_empty(), "bob muted the room");
    assert!(listed(&at, "").await.is_empty(), "alice's own messages");
    let mut expected: Vec<String> = vec!["member7: look".into()];
    expected.extend((0..10).rev().map(|_| "hello everyone".to_owned()));
    assert_eq!(listed(&members[7].1, "").await, expected);
    assert_eq!(
        listed(&members[7].1, "&only=highlight").await,
        vec!["member7: look".to_owned()]
    );
    assert_eq!(listed(&members[8].1, "").await.len(), 10 + 1);
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
    h.put_fillers(&et, &big, 400).await;
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

/// Trie nodes are kept by hash: a state lookup walked once reads its path from memory
/// the next time (no store read, one cache hit per node of the path), and the first
/// walk read from the store exactly the nodes it missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_path_is_read_from_the_store_once() {
    let h = Harness::start_with(|c| c.caches.timeline_event_bytes = 0).await;
    let (_erin, et) = h.register("erin").await;
    let room = h.create_room(&et, json!({ "name": "cached" })).await;
    h.put_fillers(&et, &room, 100).await;
    h.quiesce().await;
    let state = &h.server.projections.state;
    let cache = state.node_cache();
    let root = state.current_root(&room).unwrap();
    let counts = || {
        (
            h.reads(),
            cache.hits.load(Ordering::Relaxed),
            cache.misses.load(Ordering::Relaxed),
        )
    };
    let mut walks = Vec::new();
    for _ in 0..2 {
        let before = counts();
        let id = state.lookup(root, "org.example.filler", "key7").unwrap();
        let after = counts();
        walks.push((after.0 - before.0, after.1 - before.1, after.2 - before.2));
        let ev = h.server.projections.timeline.event(&id).unwrap();
        assert_eq!(ev.pdu.content_value()["i"], 7);
    }
    let ((reads1, hits1, misses1), (reads2, hits2, misses2)) = (walks[0], walks[1]);
    assert_eq!(reads1, misses1, "each miss is one store read: {walks:?}");
    let path = hits1 + misses1;
    assert!(
        path >= 2,
        "a 100-entry trie is deeper than its root: {walks:?}"
    );
    assert_eq!((reads2, hits2, misses2), (0, path, 0), "{walks:?}");
}

/// Messages write no row of the state projection (issue 18 item 5: one per message
/// was 94 bytes an event on disk), and the roots read for one are those of the last
/// state change before it: the same roots, from one row of `changes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_writes_no_state_row() {
    let h = Harness::start().await;
    let (_erin, et) = h.register("erin").await;
    let room = h.create_room(&et, json!({ "name": "quiet state" })).await;
    let topic = h
        .put_state(&et, &room, "m.room.topic", "", json!({ "topic": "t" }))
        .await;
    h.quiesce().await;
    let runtime = &h.server.projections.runtime;
    let rows = || -> Vec<(String, usize)> {
        runtime
            .tables("state")
            .iter()
            .map(|t| (t.name().to_owned(), t.scan_prefix(&[], usize::MAX).len()))
            .collect()
    };
    let before = rows();
    let mut sent = Vec::new();
    for i in 0..20 {
        sent.push(h.send(&et, &room, &format!("m{i}"), "no state here").await);
    }
    h.quiesce().await;
    assert_eq!(rows(), before, "20 messages wrote state rows");
    let state = &h.server.projections.state;
    let timeline = &h.server.projections.timeline;
    let topic_roots = state.state_event_roots(&topic).unwrap();
    assert_ne!(topic_roots.before, topic_roots.after);
    // Newest first, as a page of `/messages` asks: the first reads one row of
    // `changes` (the topic's), the others are answered by what it found.
    let mut reads = Vec::new();
    for id in sent.iter().rev() {
        let ev = timeline.event(id).unwrap();
        assert_eq!(state.state_event_roots(id), None, "{id} has a row by id");
        let before = h.reads();
        let roots = state.roots_of(&ev).unwrap();
        reads.push(h.reads() - before);
        assert_eq!(
            (
                roots.before,
                roots.after,
                roots.others_before,
                roots.others_after
            ),
            (
                topic_roots.after,
                topic_roots.after,
                topic_roots.others_after,
                topic_roots.others_after
            ),
            "{id}"
        );
    }
    let mut expected = vec![0; sent.len()];
    expected[0] = 1;
    assert_eq!(reads, expected);
    // A later change is found, and the earlier messages keep their roots.
    let topic2 = h
        .put_state(&et, &room, "m.room.topic", "", json!({ "topic": "t2" }))
        .await;
    let last = h.send(&et, &room, "m-last", "after the second topic").await;
    h.quiesce().await;
    let topic2_after = state.state_event_roots(&topic2).unwrap().after;
    assert_ne!(topic2_after, topic_roots.after);
    let roots_of = |id: &str| state.roots_of(&timeline.event(id).unwrap()).unwrap().after;
    assert_eq!(roots_of(&last), topic2_after);
    assert_eq!(roots_of(&sent[5]), topic_roots.after);
    assert_eq!(roots_of(&last), topic2_after);
    // The room's roots at a position are the current ones after the last change.
    let head = h.server.journal.durable_head();
    assert_eq!(
        state.roots_at_position(&room, head),
        Some((
            state.current_root(&room).unwrap(),
            state.current_others_root(&room).unwrap()
        ))
    );
}

/// Issue 18 item 5: a message costs the search projection no row of its own (the index
/// is the record of what it holds), the event-time index a key and no value, and the
/// relations projection one compact row (its
/// room and type as 16- and 8-byte digests, the sender spelled out), not the JSON with every id
/// spelled out that both used to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_costs_search_no_row_and_relations_one_small_row() {
    let h = Harness::start().await;
    let (erin, et) = h.register("erin").await;
    let room = h.create_room(&et, json!({ "name": "quiet" })).await;
    let runtime = &h.server.projections.runtime;
    let head = h.server.journal.durable_head();
    assert!(
        runtime
            .wait_for_all(head, std::time::Duration::from_secs(10))
            .await
    );
    // (table name, its rows)
    type Tables = Vec<(String, Vec<(Vec<u8>, Vec<u8>)>)>;
    let rows = |projection: &str| -> Tables {
        runtime
            .tables(projection)
            .iter()
            .map(|t| (t.name().to_owned(), t.scan_prefix(&[], usize::MAX)))
            .collect()
    };
    let counts = |tables: &Tables| -> Vec<(String, usize)> {
        tables.iter().map(|(n, r)| (n.clone(), r.len())).collect()
    };
    let (search_before, relations_before) = (counts(&rows("search")), rows("relations"));
    let times_before = rows("event_times");
    let mut sent = Vec::new();
    for i in 0..20 {
        sent.push(
            h.send(&et, &room, &format!("m{i}"), &format!("word{i}"))
                .await,
        );
    }
    let head = h.server.journal.durable_head();
    assert!(
        runtime
            .wait_for_all(head, std::time::Duration::from_secs(10))
            .await
    );
    assert_eq!(
        counts(&rows("search")),
        search_before,
        "messages wrote search rows"
    );
    let times = rows("event_times");
    assert_eq!(times[0].1.len(), times_before[0].1.len() + 20);
    assert!(
        times[0].1.iter().all(|(_, v)| v.is_empty()),
        "event_times values"
    );
    let mut indexed: Vec<String> = h
        .server
        .projections
        .search
        .indexed()
        .unwrap()
        .into_iter()
        .map(|d| d.event_id)
        .filter(|id| sent.contains(id))
        .collect();
    indexed.sort();
    let mut want = sent.clone();
    want.sort();
    assert_eq!(indexed, want);
    let relations = rows("relations");
    for ((name, after), (_, before)) in relations.iter().zip(&relations_before) {
        if name != "relations.meta" {
            assert_eq!(after.len(), before.len(), "{name}");
            continue;
        }
        assert_eq!(after.len(), before.len() + 20);
        for id in &sent {
            let (_, row) = after.iter().find(|(k, _)| k == id.as_bytes()).unwrap();
            // flags, the room and type digests, the sender with its 2-byte length
            assert_eq!(row.len(), 1 + 16 + 8 + 2 + erin.len(), "{id}");
        }
    }
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

/// An idle room costs an incremental sync no store read: the user's room list is kept in
/// memory by the membership projection (it was one row each until issue 18 item 6), and
/// there are no receipt, account data or timeline reads for rooms with nothing new.
/// Nor an in-memory check each: the rooms with news come from the change indexes
/// (timeline, receipts, typing, completed partial state), so 20 more idle rooms cost
/// the same number of `last_activity` lookups (one: the active room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_rooms_cost_no_row_in_incremental_sync() {
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
        let lookups = h.server.projections.timeline.activity_lookups();
        let (_, v) = h
            .call(
                reqwest::Method::GET,
                &format!("/_matrix/client/v3/sync?since={since}"),
                Some(&ht),
                None,
            )
            .await;
        measure.push((
            h.reads() - before,
            h.server.projections.timeline.activity_lookups() - lookups,
        ));
        assert_eq!(
            v["rooms"]["join"].as_object().unwrap().len(),
            1,
            "only the active room: {v}"
        );
    }
    assert_eq!(
        measure[1], measure[0],
        "20 more idle rooms must cost no more rows nor per-room checks: {measure:?}"
    );
    // The active room alone is looked at (twice: its news, then the bound of its
    // unread count, `Projections::unread`): the idle ones are skipped by the change
    // indexes, not asked one by one.
    assert_eq!(measure[0].1, 2, "{measure:?}");
}

/// A sliding window orders every room of the user by recency, from memory: the
/// timeline is asked once for all their stamps (`Timeline::recencies`, one read lock
/// per map), not once per room, so 20 more rooms cost the window no more lookups.
/// The rooms' order is checked too: newest first, by the last message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_asks_room_recency_once_for_all_rooms() {
    const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";
    let h = Harness::start().await;
    let (_ivy, it) = h.register("ivy").await;
    let mut rooms = Vec::new();
    let mut measure = Vec::new();
    for (round, count) in [(0u32, 3usize), (1, 23)] {
        while rooms.len() < count {
            rooms.push(h.create_room(&it, json!({})).await);
        }
        // The oldest room gets the newest message: it must lead the list.
        h.send(&it, &rooms[0], &format!("r{round}"), "bump").await;
        h.quiesce().await;
        let body = json!({
            "conn_id": format!("c{round}"),
            "lists": { "all": { "ranges": [[0, 1]], "timeline_limit": 1 } }
        });
        let lookups = h.server.projections.timeline.activity_lookups();
        let (status, v) = h
            .call(reqwest::Method::POST, SS, Some(&it), Some(body))
            .await;
        measure.push(h.server.projections.timeline.activity_lookups() - lookups);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["lists"]["all"]["count"], count);
        let ops = v["rooms"].as_object().unwrap();
        assert_eq!(ops.len(), 2, "{v}");
        let newest = &v["rooms"][&rooms[0]];
        let second = &v["rooms"][&rooms[count - 1]];
        assert!(
            newest["bump_stamp"].as_u64().unwrap() > second["bump_stamp"].as_u64().unwrap(),
            "{v}"
        );
    }
    assert_eq!(
        measure[1], measure[0],
        "20 more rooms must not cost the window per-room recency lookups: {measure:?}"
    );
    // One batch for the order, then one `last_activity` per room in the window (the
    // bound of its unread count, `Projections::unread`).
    assert_eq!(measure[0], 3, "{measure:?}");
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

// ---------------------------------------------------------------------------------
// Issue 7: one guard per cost trap of BRIEF §4 that is on main, each beside the check
// that the same path still returns everything it must. Traps whose feature is not on
// main yet (required_state in sliding sync, the delayed-event tick, push-rule globs and
// gateway queues) are guarded by the issues that bring them.
// ---------------------------------------------------------------------------------

impl Harness {
    async fn get(&self, path: &str, token: &str) -> Value {
        let (status, v) = self
            .call(reqwest::Method::GET, path, Some(token), None)
            .await;
        assert_eq!(status, 200, "{path}: {v}");
        v
    }

    /// Store reads of one GET (the projections are quiet before it).
    async fn counted_get(&self, path: &str, token: &str) -> (u64, Value) {
        self.quiesce().await;
        let before = self.reads();
        let v = self.get(path, token).await;
        (self.reads() - before, v)
    }

    async fn ban_ghosts(&self, token: &str, room: &str, n: usize) {
        for i in 0..n {
            let (status, v) = self
                .call(
                    reqwest::Method::POST,
                    &format!("/_matrix/client/v3/rooms/{room}/ban"),
                    Some(token),
                    Some(json!({ "user_id": format!("@ghost{i}:elsewhere.example") })),
                )
                .await;
            assert_eq!(status, 200, "{v}");
        }
    }
}

/// Two public rooms with the same state, one with 30 messages and one with 200, and a
/// reader (`bob`, no read receipt) joined to both before the messages. (Both hold more
/// than the 20 rows a `/messages` page reads ahead, so a page reads as much in both.)
struct History {
    h: Harness,
    bob: String,
    small: String,
    big: String,
    first: [String; 2],
}

async fn history_rooms() -> History {
    let h = Harness::start().await;
    let (alice, _bob, bob, [small, big]) = h.reader_in_two_rooms().await;
    let mut first = Vec::new();
    for (room, n) in [(&small, 30), (&big, 200)] {
        for i in 0..n {
            let id = h
                .send(
                    &alice,
                    room,
                    &format!("{room}-{i}"),
                    &format!("message {i}"),
                )
                .await;
            if i == 0 {
                first.push(id);
            }
        }
    }
    h.quiesce().await;
    History {
        h,
        bob,
        small,
        big,
        first: [first[0].clone(), first[1].clone()],
    }
}

/// Trap: unread counts walked every event after the read receipt (O(room) per room
/// per sync for every user without a receipt). An initial sync of one room costs the
/// same with 30 or 200 unread messages, and still counts all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_sync_reads_do_not_grow_with_unread_history() {
    let x = history_rooms().await;
    let mut measure = Vec::new();
    for (room, unread) in [(&x.small, 30), (&x.big, 200)] {
        let filter = json!({ "room": { "rooms": [room], "timeline": { "limit": 3 } } });
        let path = format!(
            "/_matrix/client/v3/sync?filter={}",
            urlencode(&filter.to_string())
        );
        x.h.get(&path, &x.bob).await; // warms the room summary (cached by state root)
        let (reads, v) = x.h.counted_get(&path, &x.bob).await;
        measure.push(reads);
        let joined = &v["rooms"]["join"][room.as_str()];
        assert_eq!(
            joined["unread_notifications"]["notification_count"], unread,
            "{joined}"
        );
        let bodies: Vec<&str> = joined["timeline"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["content"]["body"].as_str().unwrap())
            .collect();
        let want: Vec<String> = (unread - 3..unread)
            .map(|i| format!("message {i}"))
            .collect();
        assert_eq!(bodies, want);
        assert_eq!(joined["timeline"]["limited"], true);
    }
    assert_eq!(
        measure[0], measure[1],
        "initial sync store reads grew with the room's history (30 vs 200 unread): {measure:?}"
    );
}

/// Cost follows the answer on the read paths a client pages with: a page of
/// `/messages`, a deep `/context` (around the oldest message), `/state` and
/// `/members` cost the same in a room of 30 or 200 messages (index by (room, position);
/// state from the trie, not from history).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_reads_do_not_grow_with_room_history() {
    let x = history_rooms().await;
    let mut measure: Vec<Vec<u64>> = Vec::new();
    for (k, (room, n)) in [(&x.small, 30), (&x.big, 200)].into_iter().enumerate() {
        let mut reads = Vec::new();
        let (r, v) =
            x.h.counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=4"),
                &x.bob,
            )
            .await;
        reads.push(r);
        let bodies: Vec<&str> = v["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["content"]["body"].as_str().unwrap())
            .collect();
        let want: Vec<String> = (n - 4..n).rev().map(|i| format!("message {i}")).collect();
        assert_eq!(bodies, want);

        let first = &x.first[k];
        let (r, v) =
            x.h.counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/context/{first}?limit=4"),
                &x.bob,
            )
            .await;
        reads.push(r);
        assert_eq!(v["event"]["event_id"], first.as_str());
        assert_eq!(v["events_after"].as_array().unwrap().len(), 2);
        assert_eq!(v["events_after"][0]["content"]["body"], "message 1");

        let (r, v) =
            x.h.counted_get(&format!("/_matrix/client/v3/rooms/{room}/state"), &x.bob)
                .await;
        reads.push(r);
        let types: std::collections::BTreeSet<&str> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].as_str().unwrap())
            .collect();
        assert!(types.contains("m.room.create") && types.contains("m.room.join_rules"));
        assert_eq!(
            v.as_array()
                .unwrap()
                .iter()
                .filter(|e| e["type"] == "m.room.member")
                .count(),
            2
        );

        let (r, v) =
            x.h.counted_get(&format!("/_matrix/client/v3/rooms/{room}/members"), &x.bob)
                .await;
        reads.push(r);
        assert_eq!(v["chunk"].as_array().unwrap().len(), 2);
        measure.push(reads);
    }
    assert_eq!(
        measure[0], measure[1],
        "[messages, context, state, members] reads grew with history (30 vs 200): {measure:?}"
    );
}

/// A user who joins late pages back through events sent before their join: each
/// event is decided from the state at it (history visibility, membership), which is a
/// fixed number of point lookups per event, not a walk of the room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_joiner_pagination_reads_do_not_grow_with_room_history() {
    let x = history_rooms().await;
    let (_cat, cat) = x.h.register("cat").await;
    x.h.join(&cat, &x.small).await;
    x.h.join(&cat, &x.big).await;
    let mut measure = Vec::new();
    for (room, n) in [(&x.small, 30), (&x.big, 200)] {
        // The page starts below cat's own join, so every event goes through can_see.
        let (_, top) =
            x.h.counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=1"),
                &cat,
            )
            .await;
        let from = top["end"].as_str().unwrap();
        let (r, v) =
            x.h.counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=4&from={from}"),
                &cat,
            )
            .await;
        measure.push(r);
        let bodies: Vec<&str> = v["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["content"]["body"].as_str().unwrap())
            .collect();
        let want: Vec<String> = (n - 4..n).rev().map(|i| format!("message {i}")).collect();
        assert_eq!(bodies, want, "shared history is visible to a late joiner");
    }
    assert_eq!(
        measure[0], measure[1],
        "late joiner's page reads grew with history (30 vs 200): {measure:?}"
    );
}

/// Trap: room-list recency read each room's head event body to get one integer. The
/// last activity of a room is in memory (no store read) and the append that changes
/// it refreshes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_recency_is_answered_from_memory_and_follows_appends() {
    let h = Harness::start().await;
    let (_ann, at) = h.register("ann").await;
    let rooms = [
        h.create_room(&at, json!({})).await,
        h.create_room(&at, json!({})).await,
        h.create_room(&at, json!({})).await,
    ];
    let timeline = &h.server.projections.timeline;
    for (i, room) in rooms.iter().enumerate() {
        let id = h.send(&at, room, &format!("n{i}"), "news").await;
        h.quiesce().await;
        let position = timeline.event(&id).unwrap().position;
        let before = h.reads();
        let order: Vec<Option<u64>> = rooms.iter().map(|r| timeline.last_activity(r)).collect();
        assert_eq!(h.reads() - before, 0, "recency read the store");
        assert_eq!(order[i], Some(position), "the append refreshed recency");
        // The most recently active room sorts first.
        let newest = (0..3).max_by_key(|&k| order[k]).unwrap();
        assert_eq!(newest, i);
    }
}

/// Trap: joined-member counts parsed every member event per request. The room summary
/// is cached by state root: a hit reads no member row, the counts are exact, and a
/// state change (a new root) is seen at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_summary_is_cached_by_state_root() {
    let h = Harness::start().await;
    let (_ivy, it) = h.register("ivy").await;
    let (_jon, jt) = h.register("jon").await;
    let (kim, _kt) = h.register("kim").await;
    let (_lee, lt) = h.register("lee").await;
    let room = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    h.join(&jt, &room).await;
    let (status, v) = h
        .call(
            reqwest::Method::POST,
            &format!("/_matrix/client/v3/rooms/{room}/invite"),
            Some(&it),
            Some(json!({ "user_id": kim })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    h.ban_ghosts(&it, &room, 300).await;
    let filter = json!({ "room": { "rooms": [room], "state": { "lazy_load_members": true }, "timeline": { "limit": 1 } } });
    let path = format!(
        "/_matrix/client/v3/sync?filter={}",
        urlencode(&filter.to_string())
    );
    let (miss, v) = h.counted_get(&path, &it).await;
    let summary = &v["rooms"]["join"][&room]["summary"];
    assert_eq!(summary["m.joined_member_count"], 2, "{summary}");
    assert_eq!(summary["m.invited_member_count"], 1, "{summary}");
    let (hit, v) = h.counted_get(&path, &it).await;
    assert_eq!(v["rooms"]["join"][&room]["summary"], *summary);
    // The miss scanned the 303 member rows; the hit reads none of them.
    assert!(
        miss >= hit + 303,
        "summary cache hit still read the members: {miss} reads on a miss, {hit} on a hit"
    );
    // A new join is a new state root: the next sync counts it.
    h.join(&lt, &room).await;
    let (_, v) = h.counted_get(&path, &it).await;
    assert_eq!(
        v["rooms"]["join"][&room]["summary"]["m.joined_member_count"],
        3
    );
}

/// Trap: single state-key lookups walked the whole state. `GET /state/{type}/{key}`
/// reads one trie path: a room with 400 more state entries costs at most a level or
/// two more, never the entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_event_endpoint_reads_one_path() {
    let h = Harness::start().await;
    let (_erin, et) = h.register("erin").await;
    let small = h.create_room(&et, json!({ "name": "small" })).await;
    let big = h.create_room(&et, json!({ "name": "big" })).await;
    h.put_fillers(&et, &big, 400).await;
    let mut reads = Vec::new();
    for (room, name) in [(&small, "small"), (&big, "big")] {
        let (r, v) = h
            .counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/state/m.room.name/"),
                &et,
            )
            .await;
        assert_eq!(v, json!({ "name": name }));
        reads.push(r);
    }
    let (_, v) = h
        .counted_get(
            &format!("/_matrix/client/v3/rooms/{big}/state/org.example.filler/key399"),
            &et,
        )
        .await;
    assert_eq!(v, json!({ "i": 399 }));
    assert!(
        reads[1] <= reads[0] + 2,
        "state event lookup grew with the state (8 vs 400+ entries): {reads:?}"
    );
}

/// Trap: lazy member loading fetched every member and discarded most. A lazy page of
/// `/messages` fetches only the senders' member events: with 3 or 303 member entries
/// the reads differ by a trie level at most, and `state` holds exactly the senders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_messages_page_does_not_grow_with_members() {
    let h = Harness::start().await;
    let (ivy, it) = h.register("ivy").await;
    let (jon, jt) = h.register("jon").await;
    let small = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    let big = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    h.ban_ghosts(&it, &big, 300).await;
    for room in [&small, &big] {
        h.join(&jt, room).await;
        for i in 0..24 {
            let (who, tok) = if i % 2 == 0 { ("i", &it) } else { ("j", &jt) };
            h.send(tok, room, &format!("{room}-{i}"), &format!("{who} {i}"))
                .await;
        }
    }
    let filter = urlencode(&json!({ "lazy_load_members": true }).to_string());
    let mut measure = Vec::new();
    for room in [&small, &big] {
        let (r, v) = h
            .counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=4&filter={filter}"),
                &it,
            )
            .await;
        measure.push(r);
        assert_eq!(v["chunk"].as_array().unwrap().len(), 4);
        let mut members: Vec<&str> = v["state"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["state_key"].as_str().unwrap())
            .collect();
        members.sort();
        assert_eq!(members, vec![ivy.as_str(), jon.as_str()]);
    }
    // Two member lookups (ivy, jon), each at most one trie level deeper in the room
    // with 300 more members; fetching the roster would add 300 reads.
    assert!(
        measure[1] <= measure[0] + 2,
        "lazy /messages reads grew with member count (3 vs 303 members): {measure:?}"
    );
}

/// Joining and sending do not read the member list: the same store reads (including
/// what the projections read to apply them) with 3 or 303 member entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_and_send_reads_do_not_grow_with_members() {
    let h = Harness::start().await;
    let (_ivy, it) = h.register("ivy").await;
    let small = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    let big = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    h.ban_ghosts(&it, &big, 300).await;
    let mut measure = Vec::new();
    for (k, room) in [&small, &big].into_iter().enumerate() {
        let (pat, pt) = h.register(&format!("pat{k}")).await;
        h.quiesce().await;
        let before = h.reads();
        h.join(&pt, room).await;
        let id = h.send(&pt, room, &format!("p{k}"), "hello").await;
        h.quiesce().await;
        measure.push(h.reads() - before);
        let ev = h.server.projections.timeline.event(&id).unwrap();
        assert_eq!(ev.pdu.sender.as_str(), pat);
        assert_eq!(
            h.server
                .projections
                .membership
                .get(room, &pat)
                .unwrap()
                .membership,
            "join"
        );
    }
    assert_eq!(
        measure[0], measure[1],
        "join + send reads grew with member count: {measure:?}"
    );
}

/// A join is not evaluated against every joined member's push rules either: the same
/// store reads (what every projection reads to apply it included) for a join into a
/// room of 2 joined members and of 30 (push rules of the server default match a join
/// for nobody; only an invite names a member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_reads_the_same_whatever_the_joined_members() {
    let h = Harness::start().await;
    let (_ivy, it) = h.register("ivy").await;
    let small = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    let big = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    for i in 0..29 {
        let (_, t) = h.register(&format!("m{i}")).await;
        h.join(&t, &big).await;
    }
    let (_, t) = h.register("small1").await;
    h.join(&t, &small).await;
    let mut measure = Vec::new();
    for (k, room) in [&small, &big].into_iter().enumerate() {
        let (pat, pt) = h.register(&format!("pat{k}")).await;
        h.settle().await;
        let before = h.reads();
        h.join(&pt, room).await;
        h.settle().await;
        measure.push(h.reads() - before);
        assert_eq!(
            h.server
                .projections
                .membership
                .get(room, &pat)
                .unwrap()
                .membership,
            "join"
        );
    }
    assert_eq!(
        measure[0], measure[1],
        "join reads grew with joined members (2 vs 30): {measure:?}"
    );
}

/// A journal store whose next append, once armed, blocks until released: it holds an
/// fsync "in progress" for as long as a test needs. Records every batch size.
struct GatedStore {
    inner: spindle_journal::FjallStore,
    gate: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    blocked: std::sync::atomic::AtomicBool,
    batches: std::sync::Mutex<Vec<usize>>,
}

impl spindle_journal::JournalStore for GatedStore {
    fn append(&self, records: &[spindle_journal::EncodedRecord]) -> Result<(), String> {
        let gate = self.gate.lock().unwrap().take();
        if let Some(rx) = gate {
            self.blocked.store(true, Ordering::SeqCst);
            rx.recv().ok();
        }
        self.batches.lock().unwrap().push(records.len());
        self.inner.append(records)
    }
    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String> {
        self.inner.read_raw_after(after, limit)
    }
    fn room_positions(&self, room_id: &str, after: u64, limit: usize) -> Result<Vec<u64>, String> {
        self.inner.room_positions(room_id, after, limit)
    }
    fn truncate_from(&self, position: u64) -> Result<(), String> {
        self.inner.truncate_from(position)
    }
    fn txn_position(&self, key: &[u8]) -> Result<Option<u64>, String> {
        self.inner.txn_position(key)
    }
}

/// Trap: one process-wide mutex held across append + fsync serialized every room. While
/// one append's fsync is in progress, writers to 8 other rooms and a second writer to
/// the same room all get their records positioned and queued (no lock, not even the
/// room's, is held across the fsync), and the next fsync covers all 9 of them (group
/// commit). With a lock across the fsync this would be 9 more fsyncs, one per write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_queue_during_an_fsync_and_share_the_next_one() {
    use spindle_journal::{CommandBody, CommandEnvelope, EventSpec, Journal, SignedCommand};
    const ME: &str = "@writer:example.org";
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(spindle_core::keys::ServerKey::generate("example.org"));
    let store = Arc::new(GatedStore {
        inner: spindle_journal::FjallStore::open(dir.path()).unwrap(),
        gate: std::sync::Mutex::new(None),
        blocked: std::sync::atomic::AtomicBool::new(false),
        batches: std::sync::Mutex::new(Vec::new()),
    });
    let journal = Journal::open(store.clone(), key.clone()).unwrap();
    let sign = |body: CommandBody| {
        SignedCommand::sign(
            &key,
            CommandEnvelope {
                principal: ME.into(),
                device_id: Some("DEV".into()),
                issued_at: 1_700_000_000_000,
                body,
            },
        )
        .unwrap()
    };
    let state = |kind: &str, sk: &str, content: Value| EventSpec {
        kind: kind.into(),
        state_key: Some(sk.into()),
        content,
        redacts: None,
    };
    let message = |room: &str, body: &str| CommandBody::SendEvent {
        room_id: room.into(),
        event: EventSpec {
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "msgtype": "m.text", "body": body }),
            redacts: None,
        },
        txn_id: None,
        precondition: None,
    };
    let mut rooms = Vec::new();
    for _ in 0..9 {
        let created = journal
            .submit(sign(CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    state("m.room.create", "", json!({ "room_version": "11" })),
                    state("m.room.member", ME, json!({ "membership": "join" })),
                ],
                alias: None,
            }))
            .await
            .unwrap();
        rooms.push(created.room_id.unwrap().to_string());
    }
    let stats = journal.stats();
    let fsyncs_before = stats.fsyncs.load(Ordering::SeqCst);
    let enqueued_before = stats.enqueued.load(Ordering::SeqCst);
    let (release, gate) = std::sync::mpsc::channel();
    *store.gate.lock().unwrap() = Some(gate);
    store.batches.lock().unwrap().clear();

    // The first write's append blocks: its fsync is "in progress".
    let first = {
        let (journal, cmd) = (journal.clone(), sign(message(&rooms[0], "first")));
        tokio::spawn(async move { journal.submit(cmd).await.unwrap() })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !store.blocked.load(Ordering::SeqCst) {
        assert!(std::time::Instant::now() < deadline, "append never started");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Nine more writes: rooms 1..8 and room 0 again.
    let mut tasks = Vec::new();
    for (i, room) in rooms.iter().enumerate().skip(1).chain([(0, &rooms[0])]) {
        let (journal, cmd) = (journal.clone(), sign(message(room, &format!("w{i}"))));
        tasks.push(tokio::spawn(
            async move { journal.submit(cmd).await.unwrap() },
        ));
    }
    while stats.enqueued.load(Ordering::SeqCst) < enqueued_before + 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "writers could not queue while an fsync was in progress: {} of 10 queued",
            stats.enqueued.load(Ordering::SeqCst) - enqueued_before
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Every position is handed out, and none of the ten is durable (acknowledged) yet.
    assert_eq!(
        journal.durable_head(),
        stats.enqueued.load(Ordering::SeqCst) - 10
    );
    release.send(()).unwrap();
    let first = first.await.unwrap();
    let mut positions = vec![first.position];
    for t in tasks {
        positions.push(t.await.unwrap().position);
    }
    positions.sort();
    assert_eq!(
        positions,
        (first.position..first.position + 10).collect::<Vec<u64>>()
    );
    assert_eq!(
        *store.batches.lock().unwrap(),
        vec![1, 9],
        "one fsync for the nine queued writes"
    );
    assert_eq!(stats.fsyncs.load(Ordering::SeqCst) - fsyncs_before, 2);
}

/// The Element X room-list window (11 rooms, `required_state` `m.room.name` plus lazy
/// members, `timeline_limit` 3): a sliding sync request's store reads do not grow with
/// room size (200 → 3200 events) nor member count (50 → 800 member entries), neither
/// for a new connection nor for an incremental request (BRIEF §4: recency from memory,
/// point lookups for concrete `required_state`, counts from the room summary). The
/// rendered-state cache is off, so every window renders each room's non-member state
/// again: the reads measured are those of a cache miss, the most a window costs (a
/// hit reads fewer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_sync_reads_do_not_grow_with_room_size_nor_members() {
    let h: &'static Harness = Box::leak(Box::new(
        Harness::start_with(|c| c.caches.rendered_state_bytes = 0).await,
    ));
    let (_eli, et) = h.register("eli").await;
    let mut rooms = Vec::new();
    for i in 0..11 {
        rooms.push(
            h.create_room(
                &et,
                json!({ "preset": "public_chat", "name": format!("room {i}") }),
            )
            .await,
        );
    }
    let subject = rooms[0].clone();
    // ~50 member entries (bans need no account), then ~200 events in all.
    ban_ghosts(h, &et, &subject, 0..49).await;
    send_fillers(h, &et, &subject, 0, 140).await;
    let small = measure_sliding(h, &et, &subject, 1).await;
    // 200 → 3200 events.
    send_fillers(h, &et, &subject, 1000, 3000).await;
    let big_room = measure_sliding(h, &et, &subject, 2).await;
    // 50 → 800 member entries.
    ban_ghosts(h, &et, &subject, 49..799).await;
    let many_members = measure_sliding(h, &et, &subject, 3).await;
    assert_eq!(
        small, big_room,
        "sliding sync store reads (initial, incremental) grew with room size"
    );
    assert_eq!(
        small, many_members,
        "sliding sync store reads (initial, incremental) grew with member count"
    );
}

async fn ban_ghosts(h: &Harness, token: &str, room: &str, range: std::ops::Range<usize>) {
    for i in range {
        let (status, v) = h
            .call(
                reqwest::Method::POST,
                &format!("/_matrix/client/v3/rooms/{room}/ban"),
                Some(token),
                Some(json!({ "user_id": format!("@ghost{i}:elsewhere.example") })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
}

/// `n` messages, four at a time (concurrent sends share fsyncs).
async fn send_fillers(h: &Harness, token: &str, room: &str, from: usize, n: usize) {
    let mut i = from;
    while i < from + n {
        let t: Vec<String> = (0..4).map(|k| format!("fill{}", i + k)).collect();
        tokio::join!(
            h.send(token, room, &t[0], "filler"),
            h.send(token, room, &t[1], "filler"),
            h.send(token, room, &t[2], "filler"),
            h.send(token, room, &t[3], "filler"),
        );
        i += 4;
    }
}

/// Store reads of (a new connection's first request, an incremental request after
/// one new message) for the Element X window shape.
async fn measure_sliding(h: &Harness, token: &str, subject: &str, round: u32) -> (u64, u64) {
    const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";
    // The subject room ends with three messages, so every round's answer has the
    // same shape.
    for i in 0..3 {
        h.send(token, subject, &format!("tail{round}-{i}"), "latest")
            .await;
    }
    h.quiesce().await;
    let body = json!({
        "conn_id": format!("c{round}"),
        "lists": { "all_rooms": {
            "ranges": [[0, 10]],
            "timeline_limit": 3,
            "required_state": [["m.room.name", ""], ["m.room.member", "$LAZY"]],
        } }
    });
    // A first window on another connection warms the in-memory caches (events, trie
    // nodes: the prev_content lookups of the rendered state); the measured one reads
    // what a window reads with them warm.
    let mut warm = body.clone();
    warm["conn_id"] = json!(format!("w{round}"));
    let (status, _) = h
        .call(reqwest::Method::POST, SS, Some(token), Some(warm))
        .await;
    assert_eq!(status, 200);
    let before = h.reads();
    let (status, first) = h
        .call(reqwest::Method::POST, SS, Some(token), Some(body.clone()))
        .await;
    let initial_reads = h.reads() - before;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["lists"]["all_rooms"]["count"], 11);
    assert_eq!(first["rooms"].as_object().unwrap().len(), 11);
    let r = &first["rooms"][subject];
    assert_eq!(r["timeline"].as_array().unwrap().len(), 3);
    assert_eq!(r["required_state"].as_array().unwrap().len(), 2, "{r}");
    // The first delta warms the per-room "last receipt change" caches; the second is
    // measured.
    let mut pos = first["pos"].as_str().unwrap().to_owned();
    let mut incremental_reads = 0;
    for step in 0..2 {
        h.send(token, subject, &format!("inc{round}-{step}"), "incremental")
            .await;
        h.quiesce().await;
        let before = h.reads();
        let (status, next) = h
            .call(
                reqwest::Method::POST,
                &format!("{SS}?pos={pos}"),
                Some(token),
                Some(body.clone()),
            )
            .await;
        incremental_reads = h.reads() - before;
        assert_eq!(status, 200, "{next}");
        assert_eq!(next["rooms"].as_object().unwrap().len(), 1, "{next}");
        assert_eq!(
            next["rooms"][subject]["timeline"].as_array().unwrap().len(),
            1
        );
        pos = next["pos"].as_str().unwrap().to_owned();
    }
    (initial_reads, incremental_reads)
}

/// A late joiner's page of events sent before their join: each event is decided from
/// the state at it (history visibility, the reader's membership). Those lookups are
/// trie paths, so 300 more member entries in the room cost at most a trie level per
/// lookup, never a walk of the members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_joiner_pagination_reads_do_not_grow_with_members() {
    let h = Harness::start().await;
    let (_ivy, it) = h.register("ivy").await;
    let (_cat, ct) = h.register("cat").await;
    let small = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    let big = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    h.ban_ghosts(&it, &big, 300).await;
    for room in [&small, &big] {
        for i in 0..24 {
            h.send(&it, room, &format!("{room}-{i}"), &format!("message {i}"))
                .await;
        }
        h.join(&ct, room).await;
    }
    let mut measure = Vec::new();
    for room in [&small, &big] {
        let (_, top) = h
            .counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=1"),
                &ct,
            )
            .await;
        let from = top["end"].as_str().unwrap();
        let (r, v) = h
            .counted_get(
                &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=4&from={from}"),
                &ct,
            )
            .await;
        measure.push(r);
        let bodies: Vec<&str> = v["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["content"]["body"].as_str().unwrap())
            .collect();
        assert_eq!(
            bodies,
            ["message 23", "message 22", "message 21", "message 20"]
        );
    }
    // Four events, three lookups each (history visibility before, membership after,
    // and the viewer's membership for `unsigned.membership`: the late joiner's events
    // predate their member row): at most one trie level deeper per lookup.
    assert!(
        measure[1] <= measure[0] + 12,
        "late joiner's page reads grew with member count (3 vs 303 entries): {measure:?}"
    );
}

/// The sliding sync `to_device` and `e2ee` extensions (what the SDK's encryption sync
/// asks for on every request) cost the same whatever strangers do: twelve key uploads
/// and to-device messages between users who share no room with the requester leave its
/// incremental request's store reads unchanged (the device-list change logs are per
/// room, the inbox per device).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_sync_e2ee_extensions_do_not_pay_for_strangers_key_uploads() {
    const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";
    let srv = common::TestServer::start().await;
    let alice = srv.register("alice").await;
    srv.register("dave").await;
    let erin = srv.register("erin").await;
    let room = alice.create_room(json!({})).await;
    let reads = || srv.server.projections.db.stats().total();
    let body = |conn: &str, since: Option<&str>| {
        let mut to_device = json!({ "enabled": true });
        if let Some(s) = since {
            to_device["since"] = json!(s);
        }
        json!({
            "conn_id": conn,
            "lists": { "all": { "ranges": [[0, 9]], "timeline_limit": 1, "required_state": [] } },
            "extensions": { "to_device": to_device, "e2ee": { "enabled": true } },
        })
    };
    let mut measured = Vec::new();
    for (round, strangers) in [(0, 0usize), (1, 12)] {
        let conn = format!("c{round}");
        let first = alice.post(SS, &body(&conn, None)).await.ok();
        let next_batch = first["extensions"]["to_device"]["next_batch"]
            .as_str()
            .unwrap()
            .to_owned();
        for i in 0..strangers {
            let d = srv.login("dave", Some(&format!("D{round}{i}"))).await;
            let (keys, _) = common::device_keys(&d);
            d.post(
                "/_matrix/client/v3/keys/upload",
                &json!({ "device_keys": keys }),
            )
            .await
            .ok();
            d.put(
                &format!("/_matrix/client/v3/sendToDevice/m.test/{}", common::txn()),
                &json!({ "messages": { (erin.user_id.clone()): { "*": { "body": "not for alice" } } } }),
            )
            .await
            .ok();
        }
        alice.send_text(&room, &format!("round {round}")).await;
        // Settle: a request waits for the projections to catch up.
        alice.get("/_matrix/client/v3/account/whoami").await.ok();
        let pos = first["pos"].as_str().unwrap();
        let before = reads();
        let v = alice
            .post(
                &format!("{SS}?pos={}", common::enc(pos)),
                &body(&conn, Some(&next_batch)),
            )
            .await
            .ok();
        measured.push(reads() - before);
        assert_eq!(
            v["extensions"]["e2ee"]["device_lists"],
            json!({ "changed": [], "left": [] })
        );
        assert_eq!(v["extensions"]["to_device"]["events"], json!([]));
        assert_eq!(v["rooms"][&room]["timeline"].as_array().unwrap().len(), 1);
    }
    assert_eq!(
        measured[0], measured[1],
        "strangers' key uploads and to-device messages changed a sliding sync request's store reads: {measured:?}"
    );
    srv.stop().await;
}

/// `/search` as a late joiner under `joined` history visibility: matches sent before
/// the join are hidden, and each costs a visibility lookup; at most `2 * limit + 20`
/// are checked per request (bounded overscan), so the reads do not grow with the hidden
/// history (40 vs 200 hidden matches), and the page still names the visible ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_reads_do_not_grow_with_hidden_history() {
    let h = Harness::start().await;
    let (_alice, at) = h.register("alice").await;
    let (_carol, ct) = h.register("carol").await;
    let joined_only = json!({ "preset": "public_chat", "initial_state": [
        { "type": "m.room.history_visibility", "state_key": "", "content": { "history_visibility": "joined" } }
    ]});
    let small = h.create_room(&at, joined_only.clone()).await;
    let big = h.create_room(&at, joined_only).await;
    for i in 0..40 {
        h.send(&at, &small, &format!("s{i}"), "kiwi hidden").await;
    }
    for i in 0..200 {
        h.send(&at, &big, &format!("b{i}"), "kiwi hidden").await;
    }
    h.join(&ct, &small).await;
    h.join(&ct, &big).await;
    let mut visible = std::collections::HashMap::new();
    for room in [&small, &big] {
        let mut ids = Vec::new();
        for i in 0..2 {
            ids.push(
                h.send(&at, room, &format!("v{i}{}", room.len()), "kiwi seen")
                    .await,
            );
        }
        ids.reverse();
        visible.insert(room.clone(), ids);
    }
    h.quiesce().await;
    let mut reads = Vec::new();
    for room in [&small, &big] {
        let body = json!({"search_categories": {"room_events": {
            "search_term": "kiwi", "order_by": "recent", "filter": {"rooms": [room], "limit": 5}
        }}});
        // Settle the search projection first (the request waits for it anyway).
        h.call(
            reqwest::Method::POST,
            "/_matrix/client/v3/search",
            Some(&ct),
            Some(body.clone()),
        )
        .await;
        let before = h.reads();
        let (status, v) = h
            .call(
                reqwest::Method::POST,
                "/_matrix/client/v3/search",
                Some(&ct),
                Some(body),
            )
            .await;
        reads.push(h.reads() - before);
        assert_eq!(status, 200, "{v}");
        let found: Vec<String> = v["search_categories"]["room_events"]["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["result"]["event_id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(found, visible[room.as_str()]);
        // The overscan stopped before the end of the hidden history: a next page exists.
        assert!(
            v["search_categories"]["room_events"]["next_batch"].is_string(),
            "{v}"
        );
        assert_eq!(v["search_categories"]["room_events"]["count"], 2);
    }
    assert_eq!(
        reads[0], reads[1],
        "search reads grew with hidden history: {reads:?}"
    );
    // 2 results rendered plus at most 30 visibility checks of a few point lookups each.
    assert!(
        reads[1] <= 30 * 16 + 40,
        "search took {} store reads",
        reads[1]
    );
}

/// Trap: `/state` rendered every event of the room on every request (BRIEF §4: "the
/// `/state` response can be cached keyed by the state root"). The second `/state` of
/// an unchanged room, and `/members` of the same state, render nothing and read no
/// event; a state change (a new root) or a redaction (same root, new redaction
/// generation) renders again and shows the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_of_an_unchanged_room_is_rendered_once() {
    let h = Harness::start().await;
    let (_amy, at) = h.register("amy").await;
    let (bob, bt) = h.register("bob").await;
    let room = h
        .create_room(&at, json!({ "preset": "public_chat", "name": "Lobby" }))
        .await;
    h.join(&bt, &room).await;
    h.ban_ghosts(&at, &room, 200).await;
    let renders = || h.server.state.state_render.renders();
    let state_path = format!("/_matrix/client/v3/rooms/{room}/state");
    let members_path = format!("/_matrix/client/v3/rooms/{room}/members");

    let before = renders();
    let (miss, first) = h.counted_get(&state_path, &bt).await;
    let first = first.as_array().unwrap().clone();
    // create, amy's and bob's members, power levels, join rules, history visibility,
    // guest access, name, and 200 bans.
    assert_eq!(first.len(), 208);
    assert_eq!(renders() - before, 208);

    let (hit, second) = h.counted_get(&state_path, &bt).await;
    assert_eq!(renders() - before, 208, "the second /state rendered again");
    let second = second.as_array().unwrap().clone();
    let ids = |v: &[Value]| -> Vec<String> {
        v.iter()
            .map(|e| e["event_id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(ids(&first), ids(&second));
    // The miss read every one of the 208 events; the hit reads none of them.
    assert!(
        miss >= hit + 208,
        "a cache hit still read the events: {miss} reads on a miss, {hit} on a hit"
    );

    let (members_reads, members) = h.counted_get(&members_path, &bt).await;
    assert_eq!(
        renders() - before,
        208,
        "/members of the same state rendered"
    );
    assert!(members_reads <= hit, "{members_reads} reads against {hit}");
    let chunk = members["chunk"].as_array().unwrap();
    assert_eq!(chunk.len(), 202);
    let (_, joined) = h
        .counted_get(&format!("{members_path}?membership=join"), &bt)
        .await;
    let joined: Vec<&str> = joined["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state_key"].as_str().unwrap())
        .collect();
    assert_eq!(joined.len(), 2);
    assert!(joined.contains(&bob.as_str()));

    // A new name is a new root: rendered again, with the name it replaced.
    let renamed = h
        .put_state(&at, &room, "m.room.name", "", json!({ "name": "Hall" }))
        .await;
    let (_, third) = h.counted_get(&state_path, &bt).await;
    assert_eq!(renders() - before, 208 + 208);
    let name = third
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.room.name")
        .unwrap()
        .clone();
    assert_eq!(name["event_id"], renamed.as_str());
    assert_eq!(name["content"]["name"], "Hall");
    assert_eq!(name["unsigned"]["prev_content"]["name"], "Lobby");
    assert!(name["unsigned"].get("replaces_state").is_none());
    // The sender's own device sees its transaction id; bob does not.
    assert!(name["unsigned"].get("transaction_id").is_none());

    // Redacting the name keeps the root but changes the rendering.
    let (status, v) = h
        .call(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/rooms/{room}/redact/{renamed}/r1"),
            Some(&at),
            Some(json!({ "reason": "typo" })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let redaction = v["event_id"].as_str().unwrap().to_owned();
    let (_, fourth) = h.counted_get(&state_path, &bt).await;
    let fourth = fourth.as_array().unwrap();
    assert_eq!(fourth.len(), 208);
    let name = fourth.iter().find(|e| e["type"] == "m.room.name").unwrap();
    assert_eq!(name["content"], json!({}));
    assert_eq!(
        name["unsigned"]["redacted_because"]["event_id"],
        redaction.as_str()
    );
    assert!(name["unsigned"].get("prev_content").is_none(), "{name}");
    assert_eq!(renders() - before, 3 * 208);
}

/// A message send reads nothing but its access token, so it does not wait for the
/// projections to apply what was acknowledged before it (BRIEF §2: the writer never
/// waits on a reader): five sends complete while the timeline projection is held
/// still, and it has applied none of them. Reads still wait (read-your-writes): once
/// released, `/messages` returns all five, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_do_not_wait_for_the_projections() {
    let h = Harness::start().await;
    let (_amy, at) = h.register("amy").await;
    let room = h
        .create_room(&at, json!({ "preset": "private_chat" }))
        .await;
    h.quiesce().await;
    let runtime = &h.server.projections.runtime;
    let before = runtime.checkpoint("timeline").unwrap();
    let hold = runtime.hold("timeline").unwrap();
    let mut sent = Vec::new();
    for i in 0..5 {
        let (txn, body) = (format!("held{i}"), format!("held {i}"));
        let id = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            h.send(&at, &room, &txn, &body),
        )
        .await
        .expect("a send waited for the held timeline projection");
        sent.push(id);
    }
    assert_eq!(runtime.checkpoint("timeline"), Some(before));
    assert!(h.server.journal.durable_head() >= before + 5);
    drop(hold);
    let v = h
        .get(
            &format!("/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=5"),
            &at,
        )
        .await;
    let mut got: Vec<String> = v["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect();
    got.reverse();
    assert_eq!(got, sent);
}

/// A projection's thread is woken only by records it reads
/// (`Projection::interest`): five messages wake the six projections that read
/// messages and none of the sixteen that read facts, state events or redactions only
/// (accounts, media, membership, room summaries, state, audit…), yet every projection
/// counts as having applied them (`Runtime::checkpoint` is the head for all), so a
/// request's wait for the accounts projection (the token check of every send) never
/// waits on a message. A redaction wakes the audit trail too, not the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_wakes_only_the_projections_that_read_messages() {
    let h = Harness::start().await;
    let (amy, at) = h.register("amy").await;
    let room = h
        .create_room(&at, json!({ "preset": "private_chat" }))
        .await;
    let runtime = &h.server.projections.runtime;
    let wait = std::time::Duration::from_secs(10);
    let start = h.server.journal.durable_head();
    assert!(runtime.wait_for_all(start, wait).await);
    let batches = || {
        runtime
            .checkpoints()
            .into_iter()
            .map(|(name, _)| (name, runtime.batches(name).unwrap()))
            .collect::<Vec<_>>()
    };
    // The projections that applied a batch since `before`, by name.
    let woken_since = |before: &[(&'static str, u64)]| {
        let mut woken: Vec<&str> = batches()
            .into_iter()
            .zip(before)
            .filter(|((_, after), (_, before))| after > before)
            .map(|((name, _), _)| name)
            .collect();
        woken.sort_unstable();
        woken
    };
    let before = batches();
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.push(
            h.send(&at, &room, &format!("w{i}"), &format!("message {i}"))
                .await,
        );
    }
    let head = h.server.journal.durable_head();
    assert_eq!(head, start + 5, "the five messages and nothing else");
    assert!(runtime.wait_for_all(head, wait).await);
    assert_eq!(
        woken_since(&before),
        [
            "event_times",
            "push",
            "receipts",
            "relations",
            "search",
            "timeline"
        ]
    );
    assert_eq!(before.len(), 22);
    for (name, checkpoint) in runtime.checkpoints() {
        assert_eq!(checkpoint, head, "{name} covers the messages");
    }
    // The state projection, asleep, still answers the roots at the newest message
    // (it stands at the head in effect).
    let state = &h.server.projections.state;
    assert_eq!(state.applied_in_effect(), head);
    // A fact it reads, durable while it is held: the messages stay applied in effect
    // (the heads alone now answer its checkpoint, before the messages).
    {
        let _held = runtime.hold("state").unwrap();
        let (status, v) = h
            .call(
                reqwest::Method::PUT,
                &format!("/_matrix/client/v3/user/{amy}/account_data/org.example.held"),
                Some(&at),
                Some(json!({ "x": 1 })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(h.server.journal.durable_head(), head + 1);
        assert_eq!(state.applied_in_effect(), head);
    }
    let head = h.server.journal.durable_head();
    assert!(runtime.wait_for_all(head, wait).await);
    // A redaction wakes the audit trail (it may redact a state event) and not the state.
    let before = batches();
    let (status, v) = h
        .call(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/rooms/{room}/redact/{}/r1", sent[0]),
            Some(&at),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let head = h.server.journal.durable_head();
    assert!(runtime.wait_for_all(head, wait).await);
    assert_eq!(
        woken_since(&before),
        [
            "audit",
            "event_times",
            "push",
            "receipts",
            "relations",
            "search",
            "timeline"
        ]
    );
    // A fact read by one of the sleepers wakes it, and no projection of room records.
    let before = batches();
    let (status, v) = h
        .call(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/user/{amy}/account_data/org.example.w"),
            Some(&at),
            Some(json!({ "x": 1 })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let head = h.server.journal.durable_head();
    assert!(runtime.wait_for_all(head, wait).await);
    let after = batches();
    let grew = |name: &str| {
        let i = after.iter().position(|(n, _)| *n == name).unwrap();
        after[i].1 - before[i].1
    };
    assert_eq!(grew("account_data"), 1);
    for room_only in [
        "timeline",
        "relations",
        "search",
        "event_times",
        "room_summary",
    ] {
        assert_eq!(grew(room_only), 0, "{room_only} woken by a fact");
    }
}

/// The state projection can be a batch ahead of the timeline's (each tails the journal
/// on its own thread). A rendering of a root whose newest event the timeline has not
/// applied yet lacks that event, and must not be cached: the root would not change
/// again until the next state event, so the gap would be served until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_rendered_ahead_of_the_timeline_is_not_kept() {
    let h = Harness::start().await;
    let (_amy, at) = h.register("amy").await;
    let room = h.create_room(&at, json!({ "preset": "public_chat" })).await;
    h.quiesce().await;
    let runtime = &h.server.projections.runtime;
    let hold = runtime.hold("timeline").unwrap();
    let topic = h
        .put_state(&at, &room, "m.room.topic", "", json!({ "topic": "fresh" }))
        .await;
    let head = h.server.journal.durable_head();
    while runtime.checkpoint("state").unwrap() < head {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let root = h.server.projections.state.current_root(&room).unwrap();
    let cache = &h.server.state.state_render;
    let early = cache.get(&h.server.state, &room, root);
    assert!(early.events.iter().all(|e| e.event_id != topic));
    drop(hold);
    h.quiesce().await;
    let late = cache.get(&h.server.state, &room, root);
    assert!(late.events.iter().any(|e| e.event_id == topic));
    assert_eq!(late.events.len(), early.events.len() + 1);
}

/// Single sends share search-index commits and the projections read new records from
/// the journal's in-memory tail (issue 18 item 1). A tantivy commit per message made
/// indexing and merging 40% of a run of single sends' CPU, so the index gathers
/// records for `gather_ms` (1 s) before it commits; and each of the ~25 projections
/// reading every record from the store was a decode and a parse per projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_sends_share_search_commits_and_projections_read_the_in_memory_tail() {
    let h = Harness::start().await;
    let (_, token) = h.register("alice").await;
    let room = h.create_room(&token, json!({})).await;
    h.quiesce().await;
    let search = h.server.projections.search.stats().clone();
    let journal = h.server.journal.stats();
    let commits = search.commits.load(Ordering::Relaxed);
    let recent = journal.recent_reads.load(Ordering::Relaxed);
    let store = journal.records_read.load(Ordering::Relaxed);
    const SENDS: u64 = 100;
    for i in 0..SENDS {
        h.send(
            &token,
            &room,
            &format!("t{i}"),
            &format!("needle{i} haystack"),
        )
        .await;
    }
    h.quiesce().await;
    // The last message becomes searchable (the index commits on its own schedule).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, v) = h
            .call(
                reqwest::Method::POST,
                "/_matrix/client/v3/search",
                Some(&token),
                Some(json!({"search_categories": {"room_events": {"search_term": format!("needle{}", SENDS - 1)}}})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        if v["search_categories"]["room_events"]["count"] == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the last send was never indexed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let commits = search.commits.load(Ordering::Relaxed) - commits;
    let recent = journal.recent_reads.load(Ordering::Relaxed) - recent;
    let store = journal.records_read.load(Ordering::Relaxed) - store;
    eprintln!("{SENDS} sends: {commits} index commits, {recent} tail reads, {store} store reads");
    assert!(
        (1..=SENDS / 5).contains(&commits),
        "{commits} search index commits for {SENDS} single sends"
    );
    // Every projection that reads messages (eight:
    // a_message_wakes_only_the_projections_that_read_messages) and every outbound
    // consumer (federation sender, push delivery, application services) reads each new
    // record from the tail; none from the store (the consumers read 3 per send there
    // before `Journal::next_after` shared the tail).
    assert!(recent >= SENDS * 8, "{recent} tail reads");
    assert_eq!(store, 0, "{store} store reads against {recent} tail reads");
}

/// A message changes the tables of a few projections; the others (accounts, media,
/// filters, key backup, ...) apply it and write nothing, not even their checkpoint
/// (issue 18 item 1: ~25 store writes per send were checkpoints alone). The outbound
/// consumers likewise move their cursors past records they had nothing to do for in
/// memory (the guest kicker fsynced its cursor file per batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_commit_only_the_projections_they_change_and_write_no_cursor() {
    let h = Harness::start().await;
    let (_, token) = h.register("alice").await;
    let room = h.create_room(&token, json!({})).await;
    h.settle().await;
    let store = h.server.projections.db.stats().clone();
    let journal = h.server.journal.stats();
    let commits = store.commits.load(Ordering::Relaxed);
    let cursor_writes = journal.cursor_writes.load(Ordering::Relaxed);
    let signature_checks = journal.signature_checks.load(Ordering::Relaxed);
    const SENDS: u64 = 100;
    for i in 0..SENDS {
        h.send(&token, &room, &format!("t{i}"), &format!("message {i}"))
            .await;
    }
    h.settle().await;
    let commits = store.commits.load(Ordering::Relaxed) - commits;
    let cursor_writes = journal.cursor_writes.load(Ordering::Relaxed) - cursor_writes;
    let signature_checks = journal.signature_checks.load(Ordering::Relaxed) - signature_checks;
    let projections = h.server.projections.runtime.checkpoints().len() as u64;
    eprintln!(
        "{SENDS} sends: {commits} projection commits ({projections} projections), \
         {cursor_writes} cursor writes, {signature_checks} signature checks"
    );
    // Per send, the six projections whose tables a message changes commit (601 for
    // 100 sends when measured; every one of the 22 did before); the rest do not, bar
    // one checkpoint each if the run takes longer than IDLE_CHECKPOINT_INTERVAL.
    assert!(projections >= 20, "{projections} projections");
    assert!(
        commits <= SENDS * 6 + projections + 1,
        "{commits} projection commits for {SENDS} sends ({projections} projections)"
    );
    // Each consumer writes its cursors at most once per IDLE_SAVE_INTERVAL (10 s).
    assert!(cursor_writes <= 5, "{cursor_writes} cursor writes");
    // The journal compares the envelope with what this process signed instead of an
    // ed25519 verification per command (a tampered envelope still fails: see
    // journal/tests/journal.rs).
    assert_eq!(signature_checks, 0);
}

/// The Element X room-list window asked again on a new connection (a restarted app,
/// a second device) parses no event: the timeline's event cache holds the rooms'
/// state events and newest messages (issue 18 item 3: each event read was a store
/// read, a decode and a PDU parse, ~190 per window of 11 rooms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_sliding_window_parses_no_event_again() {
    let h = Harness::start_with(|_| {}).await;
    let (_, token) = h.register("eve").await;
    for i in 0..11 {
        let room = h
            .create_room(
                &token,
                json!({ "preset": "public_chat", "name": format!("room {i}"), "topic": "t" }),
            )
            .await;
        for k in 0..3 {
            h.send(&token, &room, &format!("m{i}-{k}"), "hello").await;
        }
    }
    h.quiesce().await;
    const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";
    let body = |conn: &str| {
        json!({
            "conn_id": conn,
            "lists": { "all": {
                "ranges": [[0, 10]],
                "timeline_limit": 3,
                "required_state": [
                    ["m.room.name", ""], ["m.room.avatar", ""], ["m.room.topic", ""],
                    ["m.room.canonical_alias", ""], ["m.room.encryption", ""],
                    ["m.room.join_rules", ""], ["m.room.power_levels", ""],
                    ["m.room.create", ""], ["m.room.history_visibility", ""],
                    ["m.room.member", "$ME"], ["m.room.member", "$LAZY"]
                ],
            } }
        })
    };
    let cache = h.server.projections.timeline.cache();
    let (status, first) = h
        .call(reqwest::Method::POST, SS, Some(&token), Some(body("a")))
        .await;
    assert_eq!(status, 200, "{first}");
    let misses = cache.misses.load(Ordering::Relaxed);
    let hits = cache.hits.load(Ordering::Relaxed);
    let renders = h.server.state.state_render.renders();
    let (status, second) = h
        .call(reqwest::Method::POST, SS, Some(&token), Some(body("b")))
        .await;
    assert_eq!(status, 200, "{second}");
    let misses = cache.misses.load(Ordering::Relaxed) - misses;
    let hits = cache.hits.load(Ordering::Relaxed) - hits;
    eprintln!("second window: {hits} cached event reads, {misses} parsed");
    assert_eq!(misses, 0, "the second window parsed {misses} events");
    // Per room: the newest messages (3, plus one to tell `limited`), the name's event
    // (the room's `name` field) and the user's member event (`$ME`, `$LAZY`); the
    // other asked state comes from the rendered-state cache, rendered by the first
    // window and not again.
    assert_eq!(hits, 11 * 6, "{hits} cached event reads");
    assert_eq!(h.server.state.state_render.renders(), renders);
    // Cached or parsed, the same answer (bar `unsigned.age`, which moves with the clock).
    let (mut first, mut second) = (first["rooms"].clone(), second["rooms"].clone());
    common::strip_ages(&mut first);
    common::strip_ages(&mut second);
    assert_eq!(first, second);
}

/// A projection that ignores messages keeps its stored checkpoint in place while they
/// arrive (no store write per batch), and the server writes it when it stops, so the
/// next start applies nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_checkpoints_are_stored_when_the_server_stops() {
    let h = Harness::start().await;
    let (_, token) = h.register("ida").await;
    let room = h.create_room(&token, json!({})).await;
    for i in 0..20 {
        h.send(&token, &room, &format!("t{i}"), "idle for most projections")
            .await;
    }
    let head = h.settle().await;
    let db = h.server.projections.db.clone();
    let runtime_cp = h.server.projections.runtime.checkpoint("filters");
    eprintln!(
        "filters: checkpoint {runtime_cp:?} in memory, {} stored, head {head}",
        db.checkpoint("filters")
    );
    assert_eq!(runtime_cp, Some(head));
    let Harness { server, _dir, .. } = h;
    server.stop().await;
    for name in ["filters", "media", "timeline"] {
        assert_eq!(db.checkpoint(name), head, "{name}'s stored checkpoint");
    }
}

/// Issue 18 item 6: a user's incremental sync and empty poll cost the same store reads
/// whether the user is in 12 rooms or 60: the user's room list is kept in memory by the
/// membership projection and the rooms with nothing new since the token are skipped
/// from memory, never read one by one. The answers stay exact: the one new event in the
/// one room, then nothing. The sliding window (11 rooms) reads the same too, and the
/// kept list stays the table's rows through later leaves, forgets and invites.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_sync_and_poll_reads_do_not_grow_with_the_rooms_a_user_is_in() {
    const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";
    let h = Harness::start().await;
    let (ivy, it) = h.register("ivy").await;
    let (_wes, wt) = h.register("wes").await;
    let active = h.create_room(&it, json!({ "preset": "public_chat" })).await;
    h.join(&wt, &active).await;
    let mut created = 1;
    let mut measure = Vec::new();
    for (round, rooms) in [(0u32, 12usize), (1, 60)] {
        while created < rooms {
            let room = h
                .create_room(
                    &it,
                    json!({ "preset": "public_chat", "name": format!("room {created}") }),
                )
                .await;
            h.send(&it, &room, &format!("f{created}"), "filler").await;
            created += 1;
        }
        h.settle().await;
        let (_, first) = h
            .call(
                reqwest::Method::GET,
                "/_matrix/client/v3/sync",
                Some(&it),
                None,
            )
            .await;
        assert_eq!(first["rooms"]["join"].as_object().unwrap().len(), rooms);
        let mut since = first["next_batch"].as_str().unwrap().to_owned();
        // Two rounds each, the first warming what a long-running server keeps in memory;
        // the second is measured.
        let mut counts = (0, 0, 0);
        for step in 0..2 {
            let event_id = h
                .send(&wt, &active, &format!("w{round}-{step}"), "one new message")
                .await;
            h.settle().await;
            let before = h.reads();
            let (status, v) = h
                .call(
                    reqwest::Method::GET,
                    &format!("/_matrix/client/v3/sync?since={since}&timeout=0"),
                    Some(&it),
                    None,
                )
                .await;
            let incremental = h.reads() - before;
            assert_eq!(status, 200, "{v}");
            let join = v["rooms"]["join"].as_object().unwrap();
            assert_eq!(join.len(), 1, "only the active room: {v}");
            let events = join[&active]["timeline"]["events"].as_array().unwrap();
            assert_eq!(events.len(), 1, "{v}");
            assert_eq!(events[0]["event_id"], event_id.as_str());
            since = v["next_batch"].as_str().unwrap().to_owned();
            h.settle().await;
            let before = h.reads();
            let (status, v) = h
                .call(
                    reqwest::Method::GET,
                    &format!("/_matrix/client/v3/sync?since={since}&timeout=0"),
                    Some(&it),
                    None,
                )
                .await;
            let poll = h.reads() - before;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["rooms"]["join"].as_object().unwrap().len(), 0, "{v}");
            since = v["next_batch"].as_str().unwrap().to_owned();
            let body = json!({
                "conn_id": format!("c{round}-{step}"),
                "lists": { "all": {
                    "ranges": [[0, 10]],
                    "timeline_limit": 3,
                    "required_state": [["m.room.name", ""], ["m.room.member", "$LAZY"]],
                } }
            });
            let before = h.reads();
            let (status, v) = h
                .call(reqwest::Method::POST, SS, Some(&it), Some(body))
                .await;
            let window = h.reads() - before;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["lists"]["all"]["count"], rooms);
            assert_eq!(v["rooms"].as_object().unwrap().len(), 11.min(rooms));
            assert!(
                v["rooms"].get(&active).is_some(),
                "the active room leads: {v}"
            );
            counts = (incremental, poll, window);
        }
        eprintln!("{rooms} rooms: incremental, poll, sliding window reads {counts:?}");
        measure.push(counts);
    }
    assert_eq!(
        measure[0].0, measure[1].0,
        "incremental sync store reads grew with the user's rooms: {measure:?}"
    );
    assert_eq!(
        measure[0].1, measure[1].1,
        "empty poll store reads grew with the user's rooms: {measure:?}"
    );
    // The same 11-room window; which rooms it holds (their names, their state tries)
    // may move a read or two, 48 more rooms must not.
    assert!(
        measure[1].2 <= measure[0].2 + 4,
        "sliding window store reads grew with the user's rooms: {measure:?}"
    );
    // The kept list is the table's rows, through a leave, a forget and an invite that
    // came after it was first read.
    let (status, v) = h
        .call(
            reqwest::Method::POST,
            &format!("/_matrix/client/v3/rooms/{active}/leave"),
            Some(&it),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = h
        .call(
            reqwest::Method::POST,
            &format!("/_matrix/client/v3/rooms/{active}/forget"),
            Some(&it),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let invited = h
        .create_room(&wt, json!({ "invite": [ivy.as_str()] }))
        .await;
    h.settle().await;
    let membership = &h.server.projections.membership;
    let kept = membership.rooms_kept(&ivy);
    let table: std::collections::BTreeMap<_, _> = membership.rooms_of(&ivy).into_iter().collect();
    assert_eq!(*kept, table);
    assert!(kept[&active].forgotten && kept[&active].membership == "leave");
    assert_eq!(kept[&invited].membership, "invite");
}
