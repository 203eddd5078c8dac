//! Running in public (issue 17): the bounded password-hashing pool and the rate limits.
//! Every limit is shown to fire (429 `M_LIMIT_EXCEEDED`, `retry_after_ms`,
//! `Retry-After`) and to reset, on a manual clock: no test sleeps.

mod common;

use std::sync::Arc;

use common::{TestServer, enc, uid};
use serde_json::{Value, json};
use spindle::config::Rate;
use spindle_api::ratelimit::ManualClock;

const LOGIN: &str = "/_matrix/client/v3/login";

fn login_body(user: &str, password: &str) -> Value {
    json!({
        "type": "m.login.password",
        "identifier": { "type": "m.id.user", "user": user },
        "password": password,
    })
}

/// A cheap argon2 cost so hundreds of hashes fit in a test (the pool's bound is what
/// is tested, not argon2).
fn cheap_hashing(c: &mut spindle::Config, pool_size: usize, queue_len: usize) {
    c.password_hashing.pool_size = pool_size;
    c.password_hashing.queue_len = queue_len;
    c.password_hashing.m_cost_kib = 1024;
    c.password_hashing.t_cost = 1;
}

/// Every limit on with its default but `registration` (tests register several users
/// from one address); `f` adjusts.
async fn limited(
    f: impl FnOnce(&mut spindle::config::RateLimits),
) -> (TestServer, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::default());
    let server = TestServer::start_with_clock(clock.clone(), |c| {
        cheap_hashing(c, 2, 256);
        c.rate_limits = spindle::config::RateLimits {
            registration: Rate::OFF,
            ..spindle::config::RateLimits::default()
        };
        f(&mut c.rate_limits);
    })
    .await;
    (server, clock)
}

/// Asserts a 429 `M_LIMIT_EXCEEDED` with exactly this `retry_after_ms` and the
/// matching `Retry-After` (whole seconds, rounded up).
fn assert_limited(resp: &common::Resp, retry_after_ms: u64) {
    resp.expect_err(429, "M_LIMIT_EXCEEDED");
    assert_eq!(
        resp.body["retry_after_ms"],
        json!(retry_after_ms),
        "{}",
        resp.text
    );
    assert_eq!(
        resp.headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some(retry_after_ms.div_ceil(1000).to_string().as_str()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_concurrent_logins_never_run_more_hashes_than_the_pool() {
    let ts = TestServer::start_with(|c| cheap_hashing(c, 2, 1000)).await;
    ts.register("alice").await;
    let before = ts.server.state.hashing.completed();
    assert_eq!(before, 1, "the registration's hash");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..500 {
        let anon = ts.anon();
        tasks.spawn(async move {
            let password = if i % 2 == 0 {
                "password-alice"
            } else {
                "wrong"
            };
            anon.post(LOGIN, &login_body("alice", password))
                .await
                .status
        });
    }
    let statuses = tasks.join_all().await;
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 250);
    assert_eq!(statuses.iter().filter(|s| **s == 403).count(), 250);
    let pool = &ts.server.state.hashing;
    assert_eq!(pool.size(), 2);
    assert_eq!(pool.max_running(), 2, "never more than the pool at once");
    assert_eq!(pool.completed(), 501);
    assert_eq!(pool.refused(), 0);
    assert_eq!(pool.queue_depth(), 0);
    // Memory: one reused 1 MiB argon2 buffer per worker, whatever the load.
    assert_eq!(pool.buffer_bytes(), 2 * 1024 * 1024);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_hashing_queue_answers_429_without_hashing() {
    // One thread, one waiting place, the default 19 MiB cost: of 60 logins at once
    // most find the queue full.
    let ts = TestServer::start_with(|c| {
        c.password_hashing.pool_size = 1;
        c.password_hashing.queue_len = 1;
    })
    .await;
    ts.register("bob").await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..60 {
        let anon = ts.anon();
        tasks.spawn(async move { anon.post(LOGIN, &login_body("bob", "wrong")).await });
    }
    let answers = tasks.join_all().await;
    let refused: Vec<_> = answers.iter().filter(|r| r.status == 429).collect();
    let checked = answers.iter().filter(|r| r.status == 403).count();
    assert_eq!(refused.len() + checked, 60);
    assert!(checked >= 1 && !refused.is_empty(), "{checked} checked");
    for r in &refused {
        assert_limited(r, 1000);
    }
    let pool = &ts.server.state.hashing;
    assert_eq!(pool.refused(), refused.len());
    assert_eq!(
        pool.completed(),
        1 + checked,
        "a refused login costs no hash"
    );
    assert_eq!(pool.max_running(), 1);
    ts.stop().await;
}

#[tokio::test]
async fn messages_are_limited_per_user_and_admins_are_exempt() {
    let (ts, clock) = limited(|_| {}).await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await; // counts 1 against rc_message
    for i in 0..9 {
        alice
            .send_txn(
                &room,
                "m.room.message",
                &format!("m{i}"),
                &json!({"body": "hi"}),
            )
            .await
            .ok();
    }
    let r = alice
        .send_txn(&room, "m.room.message", "m9", &json!({"body": "hi"}))
        .await;
    assert_limited(&r, 5000);
    // State events and redactions count too.
    let r = alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.topic/",
                enc(&room)
            ),
            &json!({"topic": "t"}),
        )
        .await;
    assert_limited(&r, 5000);
    clock.advance(4_999);
    let r = alice
        .send_txn(&room, "m.room.message", "m10", &json!({"body": "hi"}))
        .await;
    assert_limited(&r, 1);
    clock.advance(1);
    alice
        .send_txn(&room, "m.room.message", "m11", &json!({"body": "hi"}))
        .await
        .ok();
    // Another user has a bucket of their own.
    let bob = ts.register("bob").await;
    bob.create_room(json!({})).await;
    ts.stop().await;

    // An admin (by config) is exempt.
    let clock = Arc::new(ManualClock::default());
    let ts = TestServer::start_with_clock(clock, |c| {
        cheap_hashing(c, 2, 256);
        c.rate_limits = spindle::config::RateLimits::default();
        c.admins = vec![uid("root")];
    })
    .await;
    let root = ts.register("root").await;
    let room = root.create_room(json!({})).await;
    for i in 0..30 {
        root.send_txn(
            &room,
            "m.room.message",
            &format!("a{i}"),
            &json!({"body": "x"}),
        )
        .await
        .ok();
    }
    ts.stop().await;
}

#[tokio::test]
async fn login_attempts_are_limited_per_address() {
    let (ts, clock) = limited(|l| l.login_failed_attempts = Rate::OFF).await;
    ts.register("carol").await;
    let anon = ts.anon();
    for _ in 0..5 {
        anon.post(LOGIN, &login_body("nobody", "x"))
            .await
            .expect_err(403, "M_FORBIDDEN");
    }
    // The sixth attempt from 127.0.0.1 is refused before any password check, even for
    // another account with the right password: one per 1/0.003 s = 333.3 s.
    let r = anon
        .post(LOGIN, &login_body("carol", "password-carol"))
        .await;
    assert_limited(&r, 333_334);
    clock.advance(333_334);
    anon.post(LOGIN, &login_body("carol", "password-carol"))
        .await
        .ok();
    assert_limited(&anon.post(LOGIN, &login_body("carol", "x")).await, 333_333);
    ts.stop().await;
}

#[tokio::test]
async fn failed_logins_are_limited_per_account_and_then_refuse_the_right_password() {
    let (ts, clock) = limited(|l| l.login_address = Rate::OFF).await;
    ts.register("dave").await;
    let anon = ts.anon();
    for _ in 0..3 {
        anon.post(LOGIN, &login_body("dave", "guess"))
            .await
            .expect_err(403, "M_FORBIDDEN");
    }
    let before = ts.server.state.hashing.completed();
    // Full: the right password is refused too, and costs no hash (1/0.17 s = 5883 ms).
    assert_limited(
        &anon.post(LOGIN, &login_body("dave", "password-dave")).await,
        5883,
    );
    assert_eq!(ts.server.state.hashing.completed(), before);
    // Another account is not affected.
    ts.register("erin").await;
    anon.post(LOGIN, &login_body("erin", "password-erin"))
        .await
        .ok();
    clock.advance(5883);
    anon.post(LOGIN, &login_body("dave", "password-dave"))
        .await
        .ok();
    ts.stop().await;
}

#[tokio::test]
async fn successful_logins_are_limited_per_account() {
    let (ts, clock) = limited(|l| l.login_address = Rate::OFF).await;
    ts.register("frank").await;
    let anon = ts.anon();
    for _ in 0..5 {
        anon.post(LOGIN, &login_body("frank", "password-frank"))
            .await
            .ok();
    }
    let r = anon
        .post(LOGIN, &login_body("frank", "password-frank"))
        .await;
    assert_limited(&r, 333_334);
    // A full account bucket refuses before the password check: a wrong one too.
    assert_limited(&anon.post(LOGIN, &login_body("frank", "x")).await, 333_334);
    clock.advance(333_334);
    anon.post(LOGIN, &login_body("frank", "password-frank"))
        .await
        .ok();
    ts.stop().await;
}

#[tokio::test]
async fn registrations_are_limited_per_address_and_only_accounts_count() {
    let (ts, clock) =
        limited(|l| l.registration = spindle::config::RateLimits::default().registration).await;
    // The UIA challenge (first call) does not count: three full registrations fit.
    ts.register("u1").await;
    ts.register("u2").await;
    ts.register("u3").await;
    let r = ts
        .anon()
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "u4", "password": "p", "auth": { "type": "m.login.dummy" } }),
        )
        .await;
    assert_limited(&r, 5883);
    clock.advance(5883);
    ts.register("u4").await;
    ts.stop().await;
}

#[tokio::test]
async fn registration_token_validity_checks_are_limited_per_address() {
    let (ts, clock) = limited(|_| {}).await;
    let path = "/_matrix/client/v1/register/m.login.registration_token/validity?token=guess";
    let anon = ts.anon();
    for _ in 0..5 {
        assert_eq!(anon.get(path).await.ok(), json!({ "valid": false }));
    }
    assert_limited(&anon.get(path).await, 10_000);
    clock.advance(10_000);
    anon.get(path).await.ok();
    ts.stop().await;
}

#[tokio::test]
async fn joins_are_limited_per_user() {
    let (ts, clock) = limited(|l| {
        l.message = Rate::OFF;
        l.joins = Rate {
            per_second: 0.1,
            burst_count: 2,
        };
    })
    .await;
    let owner = ts.register("owner").await;
    let joiner = ts.register("joiner").await;
    let mut rooms = Vec::new();
    for _ in 0..4 {
        rooms.push(owner.create_room(json!({ "preset": "public_chat" })).await);
    }
    joiner.join(&rooms[0]).await;
    joiner.join(&rooms[1]).await;
    // Joining a room already joined is free.
    joiner.join(&rooms[1]).await;
    let path = |room: &str| format!("/_matrix/client/v3/rooms/{}/join", enc(room));
    assert_limited(&joiner.post(&path(&rooms[2]), &json!({})).await, 10_000);
    clock.advance(10_000);
    joiner.post(&path(&rooms[2]), &json!({})).await.ok();
    assert_limited(&joiner.post(&path(&rooms[3]), &json!({})).await, 10_000);
    ts.stop().await;
}

#[tokio::test]
async fn invites_are_limited_per_issuer_per_room_and_per_invitee() {
    let (ts, clock) = limited(|l| {
        l.message = Rate::OFF;
        l.invites_per_issuer = Rate {
            per_second: 0.5,
            burst_count: 3,
        };
        l.invites_per_user = Rate {
            per_second: 0.25,
            burst_count: 1,
        };
    })
    .await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    for name in ["v1", "v2", "v3", "v4"] {
        ts.register(name).await;
    }
    let room = alice.create_room(json!({})).await;
    let invite = |c: &common::Client, room: &str, who: &str| {
        let c = c.clone();
        let path = format!("/_matrix/client/v3/rooms/{}/invite", enc(room));
        let body = json!({ "user_id": uid(who) });
        async move { c.post(&path, &body).await }
    };
    invite(&alice, &room, "v1").await.ok();
    invite(&alice, &room, "v2").await.ok();
    // v2 has had its one invite: refused per invitee (1/0.25 s = 4 s), and the refusal
    // counts nothing against alice.
    let bob_room = bob.create_room(json!({})).await;
    assert_limited(&invite(&bob, &bob_room, "v2").await, 4000);
    invite(&alice, &room, "v3").await.ok();
    // alice's fourth invite: refused per issuer (1/0.5 s = 2 s).
    assert_limited(&invite(&alice, &room, "v4").await, 2000);
    clock.advance(2000);
    invite(&alice, &room, "v4").await.ok();
    clock.advance(2000);
    invite(&bob, &bob_room, "v2").await.ok();
    ts.stop().await;
}

#[tokio::test]
async fn media_uploads_and_creates_are_limited_per_user() {
    let (ts, clock) = limited(|l| {
        l.media_upload = Rate {
            per_second: 0.2,
            burst_count: 2,
        };
        l.media_create = Rate {
            per_second: 1.0,
            burst_count: 1,
        };
    })
    .await;
    let alice = ts.register("alice").await;
    let upload = || {
        alice.raw(
            reqwest::Method::POST,
            "/_matrix/media/v3/upload?filename=a.txt",
            Some(b"hello".to_vec()),
            &[("content-type", "text/plain")],
        )
    };
    upload().await.ok();
    upload().await.ok();
    assert_limited(&upload().await, 5000);
    clock.advance(5000);
    upload().await.ok();
    let create = "/_matrix/media/v1/create";
    alice.post(create, &json!({})).await.ok();
    assert_limited(&alice.post(create, &json!({})).await, 1000);
    clock.advance(1000);
    alice.post(create, &json!({})).await.ok();
    ts.stop().await;
}

#[tokio::test]
async fn the_federation_origin_hook_counts_per_origin() {
    let (ts, clock) = limited(|l| {
        l.federation_origin = Rate {
            per_second: 1.0,
            burst_count: 2,
        }
    })
    .await;
    let rl = &ts.server.state.rate_limits;
    rl.check_federation_origin("a.example").unwrap();
    rl.check_federation_origin("a.example").unwrap();
    let refused = rl.check_federation_origin("a.example").unwrap_err();
    assert_eq!(refused.retry_after_ms, 1000);
    assert_eq!(refused.limit, "federation_origin");
    rl.check_federation_origin("b.example").unwrap();
    clock.advance(1000);
    rl.check_federation_origin("a.example").unwrap();
    ts.stop().await;
}
