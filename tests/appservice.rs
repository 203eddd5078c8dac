//! Application services (spec v1.19: Application Service API): `as_token`
//! authentication and masquerading, `m.login.application_service` registration and
//! login, exclusive namespaces, `/ping`, and the transaction consumer's checkpoint,
//! retries and restart. The application service is a small HTTP server in the test.

mod common;

use std::{sync::Arc, time::Duration};

use common::{Client, SERVER_NAME, TestServer, enc, uid};
use serde_json::{Value, json};

const AS_TOKEN: &str = "as-token-bridge";
const HS_TOKEN: &str = "hs-token-bridge";

/// What the test application service saw.
#[derive(Clone, Default)]
struct Bridge {
    /// Every transaction attempt: (txn id, body, answered ok).
    attempts: Arc<parking_lot::Mutex<Vec<(String, Value, bool)>>>,
    /// Answer 503 to transactions while set.
    failing: Arc<std::sync::atomic::AtomicBool>,
    /// Authorization headers seen.
    auth: Arc<parking_lot::Mutex<Vec<String>>>,
    pings: Arc<parking_lot::Mutex<Vec<Value>>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Bridge {
    async fn start() -> (Bridge, String) {
        let b = Bridge::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (t, p) = (b.clone(), b.clone());
        let app = axum::Router::new()
            .route(
                "/_matrix/app/v1/transactions/{txn}",
                axum::routing::put(
                    move |axum::extract::Path(txn): axum::extract::Path<String>,
                          headers: axum::http::HeaderMap,
                          axum::Json(body): axum::Json<Value>| {
                        let b = t.clone();
                        async move {
                            let auth = headers
                                .get("authorization")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_owned();
                            b.auth.lock().push(auth);
                            let ok = !b.failing.load(std::sync::atomic::Ordering::SeqCst);
                            b.attempts.lock().push((txn, body, ok));
                            b.notify.notify_waiters();
                            if ok {
                                (axum::http::StatusCode::OK, axum::Json(json!({})))
                            } else {
                                (
                                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                                    axum::Json(json!({})),
                                )
                            }
                        }
                    },
                ),
            )
            .route(
                "/_matrix/app/v1/ping",
                axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
                    let b = p.clone();
                    async move {
                        b.pings.lock().push(body);
                        axum::Json(json!({}))
                    }
                }),
            );
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        (b, url)
    }

    /// The event ids of acknowledged transactions, in delivery order.
    fn delivered_events(&self) -> Vec<String> {
        self.attempts
            .lock()
            .iter()
            .filter(|(_, _, ok)| *ok)
            .flat_map(|(_, body, _)| body["events"].as_array().cloned().unwrap_or_default())
            .filter_map(|e| e["event_id"].as_str().map(str::to_owned))
            .collect()
    }

    async fn wait_until(&self, what: &str, pred: impl Fn(&Bridge) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if pred(self) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() && !pred(self) {
                panic!("{what}: attempts {:?}", self.attempts.lock());
            }
        }
    }
}

fn registration(url: &str) -> String {
    format!(
        r#"id: bridge
url: "{url}"
as_token: "{AS_TOKEN}"
hs_token: "{HS_TOKEN}"
sender_localpart: bridgebot
rate_limited: false
receive_ephemeral: true
namespaces:
  users:
    - exclusive: true
      regex: '@bridge_.*:localhost:8008'
  aliases:
    - exclusive: true
      regex: '#bridge_.*:localhost:8008'
  rooms: []
"#
    )
}

fn configure(c: &mut spindle::Config, reg_path: &std::path::Path) {
    c.appservices.registration_files = vec![reg_path.to_owned()];
    c.appservices.ip_range_allowlist = vec!["127.0.0.1/32".into()];
    c.appservices.retry_initial_ms = 50;
    c.appservices.retry_max_ms = 200;
}

async fn start(url: &str) -> (TestServer, tempfile::TempDir) {
    let regs = tempfile::tempdir().unwrap();
    let path = regs.path().join("bridge.yaml");
    std::fs::write(&path, registration(url)).unwrap();
    let server = TestServer::start_with(|c| configure(c, &path)).await;
    (server, regs)
}

/// The application service acting as `user` (its sender when `None`).
fn as_client(s: &TestServer) -> Client {
    s.anon().with_token(Some(AS_TOKEN))
}

fn masq(path: &str, user: &str) -> String {
    let sep = if path.contains('?') { '&' } else { '?' };
    format!("{path}{sep}user_id={}", enc(user))
}

async fn as_register(s: &TestServer, localpart: &str) -> Value {
    as_client(s)
        .post(
            "/_matrix/client/v3/register",
            &json!({ "type": "m.login.application_service", "username": localpart }),
        )
        .await
        .ok()
}

#[tokio::test]
async fn as_token_masquerades_registers_namespaced_users_and_holds_exclusive_names() {
    let (bridge, url) = Bridge::start().await;
    let (s, _regs) = start(&url).await;
    let asc = as_client(&s);
    let whoami = "/_matrix/client/v3/account/whoami";

    // The sender was registered at start; the as_token acts as it by default, in the
    // header or as the access_token query parameter.
    assert_eq!(asc.get(whoami).await.ok()["user_id"], uid("bridgebot"));
    let q = s
        .anon()
        .get(&format!("{whoami}?access_token={AS_TOKEN}"))
        .await
        .ok();
    assert_eq!(q["user_id"], uid("bridgebot"));

    // Masquerading: only registered users of its namespaces.
    asc.get(&masq(whoami, &uid("bridge_alice")))
        .await
        .expect_err(403, "M_FORBIDDEN");
    let reg = as_register(&s, "bridge_alice").await;
    assert_eq!(reg["user_id"], uid("bridge_alice"));
    assert!(reg["access_token"].as_str().is_some());
    assert_eq!(
        asc.get(&masq(whoami, &uid("bridge_alice"))).await.ok()["user_id"],
        uid("bridge_alice")
    );
    let alice = s.register("alice").await;
    asc.get(&masq(whoami, &alice.user_id))
        .await
        .expect_err(403, "M_FORBIDDEN");
    // inhibit_login: the account only.
    let r = asc
        .post(
            "/_matrix/client/v3/register",
            &json!({ "type": "m.login.application_service", "username": "bridge_bob", "inhibit_login": true }),
        )
        .await
        .ok();
    assert_eq!(
        r,
        json!({ "user_id": uid("bridge_bob"), "home_server": SERVER_NAME })
    );
    // Outside its namespaces, taken, or without the as_token.
    asc.post(
        "/_matrix/client/v3/register",
        &json!({ "type": "m.login.application_service", "username": "carol" }),
    )
    .await
    .expect_err(400, "M_EXCLUSIVE");
    asc.post(
        "/_matrix/client/v3/register",
        &json!({ "type": "m.login.application_service", "username": "bridge_alice" }),
    )
    .await
    .expect_err(400, "M_USER_IN_USE");
    s.anon()
        .post(
            "/_matrix/client/v3/register",
            &json!({ "type": "m.login.application_service", "username": "bridge_x" }),
        )
        .await
        .expect_err(401, "M_MISSING_TOKEN");

    // Ordinary clients cannot take names in the exclusive namespace (or the sender's).
    for name in ["bridge_mallory", "bridgebot"] {
        s.anon()
            .post(
                "/_matrix/client/v3/register",
                &json!({ "username": name, "password": "pw-123456", "auth": { "type": "m.login.dummy" } }),
            )
            .await
            .expect_err(400, "M_EXCLUSIVE");
        s.anon()
            .get(&format!(
                "/_matrix/client/v3/register/available?username={name}"
            ))
            .await
            .expect_err(400, "M_EXCLUSIVE");
    }
    // Nor aliases in its exclusive alias namespace; the application service can.
    let room = alice.create_room(json!({})).await;
    alice
        .put(
            &format!(
                "/_matrix/client/v3/directory/room/{}",
                enc("#bridge_tg:localhost:8008")
            ),
            &json!({ "room_id": room }),
        )
        .await
        .expect_err(400, "M_EXCLUSIVE");
    alice
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "room_alias_name": "bridge_chat" }),
        )
        .await
        .expect_err(400, "M_EXCLUSIVE");
    let as_room = asc
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "room_alias_name": "bridge_chat" }),
        )
        .await
        .ok()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        s.anon()
            .get(&format!(
                "/_matrix/client/v3/directory/room/{}",
                enc("#bridge_chat:localhost:8008")
            ))
            .await
            .ok()["room_id"],
        as_room
    );

    // m.login.application_service login, then device masquerading with that device.
    let login = asc
        .post(
            "/_matrix/client/v3/login",
            &json!({
                "type": "m.login.application_service",
                "identifier": { "type": "m.id.user", "user": "bridge_bob" },
                "device_id": "BRIDGEDEV",
            }),
        )
        .await
        .ok();
    assert_eq!(login["user_id"], uid("bridge_bob"));
    assert_eq!(login["device_id"], "BRIDGEDEV");
    let me = asc
        .get(&format!(
            "{}&device_id=BRIDGEDEV",
            masq(whoami, &uid("bridge_bob"))
        ))
        .await
        .ok();
    assert_eq!(me["device_id"], "BRIDGEDEV");
    asc.get(&format!(
        "{}&device_id=NOPE",
        masq(whoami, &uid("bridge_bob"))
    ))
    .await
    .expect_err(400, "M_UNKNOWN_DEVICE");
    alice
        .post(
            "/_matrix/client/v3/login",
            &json!({ "type": "m.login.application_service", "identifier": { "type": "m.id.user", "user": "bridge_bob" } }),
        )
        .await
        .expect_err(401, "M_MISSING_TOKEN");
    asc.post(
        "/_matrix/client/v3/login",
        &json!({ "type": "m.login.application_service", "identifier": { "type": "m.id.user", "user": "alice" } }),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");

    // Devices: the application service creates one for its user (201), renames it
    // (200) and deletes it without user-interactive auth; a user cannot create one.
    let dev = format!(
        "{}?user_id={}",
        "/_matrix/client/v3/devices/NEWDEV",
        enc(&uid("bridge_bob"))
    );
    let created = asc
        .put(&dev, &json!({ "display_name": "bridged phone" }))
        .await;
    assert_eq!(created.status, 201, "{}", created.text);
    assert_eq!(
        asc.put(&dev, &json!({ "display_name": "renamed" }))
            .await
            .ok(),
        json!({})
    );
    let me = asc
        .get(&format!(
            "{}&device_id=NEWDEV",
            masq(whoami, &uid("bridge_bob"))
        ))
        .await
        .ok();
    assert_eq!(me["device_id"], "NEWDEV");
    assert_eq!(asc.get(&dev).await.ok()["display_name"], "renamed");
    asc.request(reqwest::Method::DELETE, &dev, Some(&json!({})))
        .await
        .ok();
    asc.get(&dev).await.expect_err(404, "M_NOT_FOUND");
    alice
        .put("/_matrix/client/v3/devices/NOTMINE", &json!({}))
        .await
        .expect_err(404, "M_NOT_FOUND");

    // Ping: this application service's token only.
    let pong = asc
        .post(
            "/_matrix/client/v1/appservice/bridge/ping",
            &json!({ "transaction_id": "ping-1" }),
        )
        .await
        .ok();
    assert!(pong["duration_ms"].as_u64().is_some());
    assert_eq!(
        *bridge.pings.lock(),
        vec![json!({ "transaction_id": "ping-1" })]
    );
    asc.post("/_matrix/client/v1/appservice/other/ping", &json!({}))
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .post("/_matrix/client/v1/appservice/bridge/ping", &json!({}))
        .await
        .expect_err(403, "M_FORBIDDEN");

    // The network directory: listed under its instance id, not in the main list.
    asc.put(
        &format!(
            "/_matrix/client/v3/directory/list/appservice/telegram/{}",
            enc(&as_room)
        ),
        &json!({ "visibility": "public" }),
    )
    .await
    .ok();
    let listed = |v: &Value| -> Vec<String> {
        v["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["room_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let main = s.anon().get("/_matrix/client/v3/publicRooms").await.ok();
    assert!(listed(&main).is_empty());
    let net = s
        .anon()
        .get(&format!(
            "/_matrix/client/v3/publicRooms?third_party_instance_id={}",
            enc("bridge|telegram")
        ))
        .await
        .ok();
    assert_eq!(listed(&net), vec![as_room.clone()]);
    alice
        .put(
            &format!(
                "/_matrix/client/v3/directory/list/appservice/telegram/{}",
                enc(&as_room)
            ),
            &json!({ "visibility": "public" }),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    s.stop().await;
}

#[tokio::test]
async fn transactions_carry_the_rooms_events_and_a_retry_keeps_its_id_and_body() {
    let (bridge, url) = Bridge::start().await;
    let regs = tempfile::tempdir().unwrap();
    let reg_path = regs.path().join("bridge.yaml");
    std::fs::write(&reg_path, registration(&url)).unwrap();
    let s = TestServer::start_with(|c| configure(c, &reg_path)).await;
    let asc = as_client(&s);
    as_register(&s, "bridge_alice").await;
    let alice = s.register("alice").await;

    // A room the application service is not in: nothing of it is sent.
    let other = alice.create_room(json!({})).await;
    let hidden = alice.send_text(&other, "not for the bridge").await;

    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    let before = alice.send_text(&room, "before the bridge").await;
    let invite = alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/invite", enc(&room)),
            &json!({ "user_id": uid("bridge_alice") }),
        )
        .await
        .ok();
    assert_eq!(invite, json!({}));
    asc.post(
        &masq(
            &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
            &uid("bridge_alice"),
        ),
        &json!({}),
    )
    .await
    .ok();
    let m1 = alice.send_text(&room, "hello bridge").await;
    let state = |c: &Client, room: &str| {
        let c = c.clone();
        let room = room.to_owned();
        async move {
            c.get(&format!("/_matrix/client/v3/rooms/{}/state", enc(&room)))
                .await
                .ok()
        }
    };
    let members: Vec<String> = state(&alice, &room)
        .await
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.member" && e["state_key"] == uid("bridge_alice"))
        .map(|e| e["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(members.len(), 1, "one current member event of bridge_alice");
    bridge
        .wait_until("the message reaches the bridge", |b| {
            b.delivered_events().contains(&m1)
        })
        .await;
    let delivered = bridge.delivered_events();
    // Exactly: the invite, the join and the message, in that order; nothing from
    // before the bridge's user was there, nothing from the other room.
    assert_eq!(delivered.len(), 3, "{delivered:?}");
    assert_eq!(delivered[1], members[0], "the join");
    assert_eq!(delivered[2], m1);
    assert!(!delivered.contains(&before) && !delivered.contains(&hidden));
    assert!(
        bridge
            .auth
            .lock()
            .iter()
            .all(|a| a == &format!("Bearer {HS_TOKEN}"))
    );

    // A read receipt in the room reaches it as ephemeral data (receive_ephemeral).
    alice
        .post(
            &format!(
                "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
                enc(&room),
                enc(&m1)
            ),
            &json!({}),
        )
        .await
        .ok();
    bridge
        .wait_until("the receipt reaches the bridge", |b| {
            b.attempts.lock().iter().any(|(_, body, ok)| {
                *ok && body["ephemeral"].as_array().is_some_and(|e| {
                    e.iter().any(|r| {
                        r["type"] == "m.receipt"
                            && r["room_id"] == room.as_str()
                            && r["content"][&m1]["m.read"][&alice.user_id]["ts"].is_u64()
                    })
                })
            })
        })
        .await;

    // Typing in the room reaches it too (in memory, its own transaction).
    alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/typing/{}",
                enc(&room),
                enc(&alice.user_id)
            ),
            &json!({ "typing": true, "timeout": 30000 }),
        )
        .await
        .ok();
    bridge
        .wait_until("typing reaches the bridge", |b| {
            b.attempts.lock().iter().any(|(txn, body, ok)| {
                *ok && txn.starts_with('t')
                    && body["ephemeral"].as_array().is_some_and(|e| {
                        e.contains(&json!({
                            "type": "m.typing",
                            "room_id": room,
                            "content": { "user_ids": [alice.user_id] },
                        }))
                    })
            })
        })
        .await;
    let typing_txns = bridge.attempts.lock().len();

    // The bridge goes down: the transaction is retried with the same id and body,
    // and nothing after it overtakes it.
    bridge
        .failing
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let m2 = alice.send_text(&room, "while down 1").await;
    bridge
        .wait_until("two failed attempts", |b| {
            b.attempts.lock().iter().filter(|(_, _, ok)| !ok).count() >= 2
        })
        .await;
    let m3 = alice.send_text(&room, "while down 2").await;
    bridge
        .failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    bridge
        .wait_until("m3 delivered", |b| b.delivered_events().contains(&m3))
        .await;
    {
        let attempts = bridge.attempts.lock();
        // Typing transactions (`t...`) are best effort and not retried: leave them out.
        let failed: Vec<&(String, Value, bool)> = attempts
            .iter()
            .filter(|a| !a.2 && !a.0.starts_with('t'))
            .collect();
        let first_failed = failed[0];
        assert!(
            failed
                .iter()
                .all(|a| a.0 == first_failed.0 && a.1 == first_failed.1),
            "every retry carries the same id and body"
        );
        let retried_ok = attempts
            .iter()
            .find(|a| a.2 && a.0 == first_failed.0)
            .expect("the failed transaction was delivered under its id");
        assert_eq!(retried_ok.1, first_failed.1);
        assert_eq!(retried_ok.1["events"][0]["event_id"], m2.as_str());
    }
    let delivered = bridge.delivered_events();
    assert_eq!(&delivered[3..], &[m2.clone(), m3.clone()]);
    let sender = s.server.appservice_sender.clone().expect("running");
    let head = s.server.journal.durable_head();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sender.cursor("bridge") != Some(head) {
        assert!(tokio::time::Instant::now() < deadline, "cursor saved");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    assert!(bridge.attempts.lock().len() > typing_txns);
    s.stop().await;
}

#[tokio::test]
async fn the_sender_and_unlimited_namespaces_skip_rate_limits_and_others_do_not() {
    let (_bridge, url) = Bridge::start().await;
    let regs = tempfile::tempdir().unwrap();
    let path = regs.path().join("bridge.yaml");
    std::fs::write(&path, registration(&url)).unwrap();
    let s = TestServer::start_with(|c| {
        configure(c, &path);
        // Synapse's defaults: rc_message 0.2/s, burst 10.
        c.rate_limits = spindle::config::RateLimits::default();
    })
    .await;
    let asc = as_client(&s);
    as_register(&s, "bridge_alice").await;
    let room = asc.create_room(json!({ "preset": "public_chat" })).await;
    asc.post(
        &masq(
            &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
            &uid("bridge_alice"),
        ),
        &json!({}),
    )
    .await
    .ok();
    let send = |c: &Client, user: Option<String>, i: usize| {
        let c = c.clone();
        let room = room.clone();
        async move {
            let path = format!(
                "/_matrix/client/v3/rooms/{}/send/m.room.message/rl{i}",
                enc(&room)
            );
            let path = match user {
                Some(u) => masq(&path, &u),
                None => path,
            };
            c.put(&path, &json!({ "msgtype": "m.text", "body": "x" }))
                .await
                .status
        }
    };
    for i in 0..15 {
        assert_eq!(
            send(&asc, None, i).await,
            200,
            "the sender is never limited"
        );
        assert_eq!(
            send(&asc, Some(uid("bridge_alice")), i).await,
            200,
            "rate_limited: false exempts its users"
        );
    }
    let mut alice = s.anon();
    alice = {
        let r = alice
            .post(
                "/_matrix/client/v3/register",
                &json!({ "username": "alice", "password": "pw-alice-123", "auth": { "type": "m.login.dummy" } }),
            )
            .await
            .ok();
        alice.with_token(r["access_token"].as_str())
    };
    alice.join(&room).await;
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for i in 0..15 {
            out.push(send(&alice, None, i).await);
        }
        out
    };
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        10,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        5,
        "{statuses:?}"
    );
    s.stop().await;
}

/// A running `spindle --config FILE` (a real process, so a restart is a restart).
struct Proc {
    child: std::process::Child,
    base: String,
}

impl Proc {
    fn start(config: &std::path::Path) -> Proc {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_spindle"))
            .arg("--config")
            .arg(config)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn spindle");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.strip_prefix("spindle: serving on ") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("spindle reports its address");
        Proc { child, base }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undelivered_transaction_survives_a_restart_and_nothing_delivered_repeats() {
    let (bridge, url) = Bridge::start().await;
    let dir = tempfile::tempdir().unwrap();
    let reg_path = dir.path().join("bridge.yaml");
    std::fs::write(&reg_path, registration(&url)).unwrap();
    let config = dir.path().join("spindle.toml");
    std::fs::write(
        &config,
        format!(
            "server_name = \"{SERVER_NAME}\"\nbind = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nlog = \"warn\"\nrate_limits = {{ enabled = false }}\n[appservices]\nregistration_files = [\"{}\"]\nip_range_allowlist = [\"127.0.0.1/32\"]\nretry_initial_ms = 50\nretry_max_ms = 200\n",
            dir.path().join("data").display(),
            reg_path.display()
        ),
    )
    .unwrap();
    let http = common::http();
    let p = Proc::start(&config);
    let alice = common::register(&p.base, &http, "alice").await;
    let asc = Client::anon(&p.base, http.clone()).with_token(Some(AS_TOKEN));
    asc.post(
        "/_matrix/client/v3/register",
        &json!({ "type": "m.login.application_service", "username": "bridge_alice", "inhibit_login": true }),
    )
    .await
    .ok();
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    asc.post(
        &masq(
            &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
            &uid("bridge_alice"),
        ),
        &json!({}),
    )
    .await
    .ok();
    let m1 = alice.send_text(&room, "delivered before").await;
    bridge
        .wait_until("m1 delivered", |b| b.delivered_events().contains(&m1))
        .await;
    bridge
        .failing
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let m2 = alice.send_text(&room, "across a restart").await;
    bridge
        .wait_until("a failed attempt for m2", |b| {
            b.attempts
                .lock()
                .iter()
                .any(|(_, body, ok)| !*ok && body["events"][0]["event_id"] == m2.as_str())
        })
        .await;
    p.kill(); // SIGKILL: the journal and the consumer cursors survive
    bridge
        .failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let p = Proc::start(&config);
    bridge
        .wait_until("m2 delivered after the restart", |b| {
            b.delivered_events().contains(&m2)
        })
        .await;
    let delivered = bridge.delivered_events();
    // The join, m1, then m2 once: the restart repeated nothing acknowledged.
    assert_eq!(delivered.len(), 3, "{delivered:?}");
    assert_eq!(&delivered[1..], &[m1, m2]);
    p.kill();
}

#[tokio::test]
async fn a_bad_registration_file_stops_the_server_with_the_file_and_field_named() {
    let regs = tempfile::tempdir().unwrap();
    let path = regs.path().join("broken.yaml");
    std::fs::write(
        &path,
        "id: x\nurl: null\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces:\n  users:\n    - regex: '@x_.*'\n",
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = spindle::Config {
        bind: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().join("data"),
        log: "warn".into(),
        ..Default::default()
    };
    config.appservices.registration_files = vec![path.clone()];
    let err = spindle::Server::start(config.clone())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("broken.yaml"), "{err}");
    assert!(err.contains("namespaces.users[0].exclusive"), "{err}");
    // A url on loopback needs the allowlist, and the error says so.
    std::fs::write(
        &path,
        "id: x\nurl: http://127.0.0.1:9\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces: {}\n",
    )
    .unwrap();
    let err = spindle::Server::start(config)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("ip_range_allowlist"), "{err}");
}
