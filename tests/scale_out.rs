//! Several Spindle processes on one journal in NATS JetStream (issue 14, SPEC §6,
//! docs/scale-out.md): real `nats-server` processes on loopback (Debian's 2.9 package;
//! `scripts/test` installs it), Spindle servers in this process, each with its own
//! data directory and the shared signing key.

mod common;

use std::{
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use serde_json::json;

/// A `nats-server` with JetStream on loopback, killed when dropped.
struct Nats {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free port for a NATS node, below Linux's ephemeral range (32768 and up): the
/// servers of the tests running beside this one bind port 0 and so can never take it
/// between its choice and the node's bind, and no two calls return the same port.
fn nats_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let offset = (std::process::id() % 1_000) * 10;
    loop {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = (20_000 + (offset + n) % 12_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Starts one node; `cluster` is (this node's route port, every node's route port).
fn nats_node(name: &str, cluster: Option<(u16, &[u16])>, store: Option<&Path>) -> Nats {
    let dir = tempfile::tempdir().unwrap();
    let port = nats_port();
    let store_dir = store
        .map(Path::to_path_buf)
        .unwrap_or_else(|| dir.path().into());
    let mut cmd = Command::new("nats-server");
    cmd.args([
        "-js",
        "-a",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-n",
        name,
    ])
    .arg("-sd")
    .arg(&store_dir)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    if let Some((route, all)) = cluster {
        let routes: Vec<String> = all
            .iter()
            .filter(|p| **p != route)
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect();
        cmd.args([
            "--cluster_name",
            "spindle-test",
            "--cluster",
            &format!("nats://127.0.0.1:{route}"),
            "--routes",
            &routes.join(","),
        ]);
    }
    let child = cmd.spawn().unwrap_or_else(|e| {
        panic!("cannot run nats-server ({e}): install it with `apt-get install nats-server`")
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nats-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Nats {
        child,
        port,
        _dir: dir,
    }
}

/// Logs of the servers under test (`RUST_LOG`, default warnings) in the test's output.
fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
}

fn url(n: &Nats) -> String {
    format!("nats://127.0.0.1:{}", n.port)
}

/// The configuration of a process on the shared journal with its data under `root`.
fn nats_config(servers: Vec<String>, stream: &str, root: &Path) -> spindle::Config {
    let mut config = spindle::Config {
        bind: "127.0.0.1:0".parse().unwrap(),
        data_dir: root.join("data"),
        log: "warn".into(),
        rate_limits: spindle::config::RateLimits::lifted(),
        ..Default::default()
    };
    config.journal.backend = spindle::config::JournalBackend::Nats;
    config.journal.nats.servers = servers;
    config.journal.nats.stream = stream.to_owned();
    config.journal.nats.lease_ttl_ms = 6_000;
    config
}

/// A Spindle process on the shared journal, in a fresh data directory, signing
/// with `key` (every process of one deployment signs as the same server).
async fn process(servers: Vec<String>, stream: &str, key: Option<&[u8]>) -> TestServer {
    process_with(servers, stream, key, |_| {}).await
}

/// [`process`] with more configuration.
async fn process_with(
    servers: Vec<String>,
    stream: &str,
    key: Option<&[u8]>,
    f: impl FnOnce(&mut spindle::Config),
) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let mut config = nats_config(servers, stream, dir.path());
    f(&mut config);
    if let Some(key) = key {
        std::fs::create_dir_all(&config.data_dir).unwrap();
        std::fs::write(config.data_dir.join("signing.key"), key).unwrap();
    }
    let server = spindle::Server::start(config).await.expect("server starts");
    let base = format!("http://{}", server.addr);
    TestServer {
        server,
        dir,
        base,
        http: http(),
    }
}

fn key_of(s: &TestServer) -> Vec<u8> {
    std::fs::read(s.dir.path().join("data").join("signing.key")).unwrap()
}

async fn until(what: &str, f: impl AsyncFnMut() -> bool) {
    until_within(what, Duration::from_secs(30), f).await
}

/// [`until`] with its own deadline (a NATS cluster re-electing leaders on a loaded
/// machine takes longer than 30 s).
async fn until_within(what: &str, within: Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every event id of the room's timeline through `c`, oldest first.
async fn timeline(c: &Client, room: &str) -> Vec<String> {
    let v = c.messages(room, "dir=f&limit=1000").await;
    ids(&v["chunk"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_share_one_journal_in_one_order() {
    logs();
    let nats = nats_node("n1", None, None);
    let a = process(vec![url(&nats)], "s1", None).await;
    until("A becomes the writer", async || {
        a.server.journal.is_writer() == Some(true)
    })
    .await;
    let b = process(vec![url(&nats)], "s1", Some(&key_of(&a))).await;
    assert_eq!(b.server.journal.is_writer(), Some(false));
    // A process with a signing key of its own is refused before it serves: the writer
    // would refuse its every command, and as the writer it would append records the
    // others cannot verify.
    let stranger = tempfile::tempdir().unwrap();
    let err = spindle::Server::start(nats_config(vec![url(&nats)], "s1", stranger.path()))
        .await
        .err()
        .expect("a process with another signing key is refused");
    let err = format!("{err:#}");
    assert!(
        err.contains("is not the one the other processes of stream s1 sign with"),
        "{err}"
    );

    // Registration through B is forwarded to A, and B answers once it has the records.
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let room = alice.create_room(json!({"preset": "public_chat"})).await;
    alice.invite(&room, &uid("bob")).await;
    bob.join(&room).await;

    // Both send at once, each through its own process.
    let sends_a = async {
        let mut ids = Vec::new();
        for i in 0..15 {
            ids.push(alice.send_text(&room, &format!("a{i}")).await);
        }
        ids
    };
    let sends_b = async {
        let mut ids = Vec::new();
        for i in 0..15 {
            ids.push(bob.send_text(&room, &format!("b{i}")).await);
        }
        ids
    };
    let (ids_a, ids_b) = tokio::join!(sends_a, sends_b);

    // B answered each send after its own copy had it: its timeline already holds them.
    let on_b = timeline(&bob, &room).await;
    let bob_on_a = a.login("bob", None).await;
    let on_a = timeline(&bob_on_a, &room).await;
    assert_eq!(on_a, on_b, "one linear order through either process");
    let messages: Vec<&String> = on_a
        .iter()
        .filter(|id| ids_a.contains(id) || ids_b.contains(id))
        .collect();
    assert_eq!(messages.len(), 30, "every send exactly once");
    let mut seen = on_a.clone();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), on_a.len(), "no event twice");
    // Each sender's own messages keep their order.
    let pos = |id: &String| on_a.iter().position(|x| x == id).unwrap();
    assert!(ids_a.windows(2).all(|w| pos(&w[0]) < pos(&w[1])));
    assert!(ids_b.windows(2).all(|w| pos(&w[0]) < pos(&w[1])));

    // The follower's write models are the writer's, record for record.
    assert_eq!(
        a.server.journal.durable_head(),
        b.server.journal.durable_head()
    );
    assert_eq!(
        a.server.journal.write_model_digest().await,
        b.server.journal.write_model_digest().await
    );

    // Read-your-writes across processes: a sync token from A is honoured by B at once
    // (B waits until it holds what the token covers).
    let first = alice.sync("timeout=0").await;
    let since = first["next_batch"].as_str().unwrap().to_owned();
    let sent = alice.send_text(&room, "after the token").await;
    let after = alice.sync(&format!("since={since}&timeout=0")).await;
    let token = after["next_batch"].as_str().unwrap().to_owned();
    let alice_on_b = b.login("alice", None).await;
    let got = alice_on_b.sync(&format!("since={since}&timeout=0")).await;
    let tl = ids(&got["rooms"]["join"][&room]["timeline"]["events"]);
    assert_eq!(tl, vec![sent.clone()], "{got}");
    let next = alice_on_b.sync(&format!("since={token}&timeout=0")).await;
    assert!(next["rooms"]["join"].get(&room).is_none(), "{next}");

    // A uniqueness rule is decided once for the deployment: the same user name
    // registered through both processes at once succeeds exactly once.
    let body =
        json!({"username": "carol", "password": "pw-carol-123", "auth": {"type": "m.login.dummy"}});
    let (anon_a, anon_b) = (a.anon(), b.anon());
    let (ra, rb) = tokio::join!(
        anon_a.post("/_matrix/client/v3/register", &body),
        anon_b.post("/_matrix/client/v3/register", &body),
    );
    let mut statuses = vec![ra.status, rb.status];
    statuses.sort();
    assert_eq!(statuses, vec![200, 400], "{:?} {:?}", ra.body, rb.body);
    let loser = if ra.status == 400 { &ra } else { &rb };
    assert_eq!(loser.errcode(), Some("M_USER_IN_USE"));

    b.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn typing_and_presence_reach_clients_of_the_other_process() {
    logs();
    let nats = nats_node("n1", None, None);
    let a = process(vec![url(&nats)], "s6", None).await;
    until("A becomes the writer", async || {
        a.server.journal.is_writer() == Some(true)
    })
    .await;
    let b = process(vec![url(&nats)], "s6", Some(&key_of(&a))).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let room = alice.create_room(json!({"preset": "public_chat"})).await;
    bob.join(&room).await;
    let since = bob.sync("timeout=0").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();

    // Alice types through A; Bob's sync through B shows her typing.
    let r = alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/typing/{}",
                enc(&room),
                enc(&alice.user_id)
            ),
            &json!({"typing": true, "timeout": 30000}),
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let mut typists = Vec::new();
    until("Bob sees Alice typing through B", async || {
        let s = bob.sync(&format!("since={since}&timeout=1000")).await;
        typists = s["rooms"]["join"][&room]["ephemeral"]["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["type"] == "m.typing")
            .map(|e| e["content"]["user_ids"].clone())
            .collect();
        !typists.is_empty()
    })
    .await;
    assert_eq!(typists.last().unwrap(), &json!([alice.user_id]));

    // Alice's presence set through A is what B tells Bob.
    let r = alice
        .put(
            &format!("/_matrix/client/v3/presence/{}/status", enc(&alice.user_id)),
            &json!({"presence": "unavailable", "status_msg": "at lunch"}),
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    until("B serves Alice's presence", async || {
        let r = bob
            .get(&format!(
                "/_matrix/client/v3/presence/{}/status",
                enc(&alice.user_id)
            ))
            .await;
        r.status == 200 && r.body["presence"] == "unavailable" && r.body["status_msg"] == "at lunch"
    })
    .await;
    // Cleared through A (an explicit null), cleared on B too.
    let r = alice
        .put(
            &format!("/_matrix/client/v3/presence/{}/status", enc(&alice.user_id)),
            &json!({"presence": "online", "status_msg": null}),
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    until("B clears Alice's status message", async || {
        let r = bob
            .get(&format!(
                "/_matrix/client/v3/presence/{}/status",
                enc(&alice.user_id)
            ))
            .await;
        r.status == 200
            && r.body["presence"] == "online"
            && r.body.get("status_msg").is_none_or(|m| m.is_null())
    })
    .await;
    a.stop().await;
    b.stop().await;
}

/// Every notify body a push gateway on loopback received.
async fn push_gateway() -> (
    std::sync::Arc<parking_lot::Mutex<Vec<serde_json::Value>>>,
    String,
) {
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let s = seen.clone();
    let app = axum::Router::new().route(
        "/_matrix/push/v1/notify",
        axum::routing::post(move |axum::Json(body): axum::Json<serde_json::Value>| {
            let s = s.clone();
            async move {
                s.lock().push(body);
                axum::Json(json!({ "rejected": [] }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/_matrix/push/v1/notify",
        listener.local_addr().unwrap()
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (seen, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn push_delivery_moves_to_the_standby_with_the_writer_lease() {
    logs();
    let nats = nats_node("n1", None, None);
    let allow = |c: &mut spindle::Config| {
        c.push.ip_range_allowlist = vec!["127.0.0.1/32".into()];
        c.push.retry_initial_ms = 50;
        c.push.retry_max_ms = 200;
    };
    let a = process_with(vec![url(&nats)], "s7", None, allow).await;
    until("A becomes the writer", async || {
        a.server.journal.is_writer() == Some(true)
    })
    .await;
    let b = process_with(vec![url(&nats)], "s7", Some(&key_of(&a)), allow).await;
    let (seen, gateway) = push_gateway().await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let room = alice.create_room(json!({"preset": "public_chat"})).await;
    bob.join(&room).await;
    let r = bob
        .post(
            "/_matrix/client/v3/pushers/set",
            &json!({
                "kind": "http", "app_id": "org.example.push", "pushkey": "bob-phone",
                "app_display_name": "Example", "device_display_name": "Phone", "lang": "en",
                "data": { "url": gateway },
            }),
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let count = |id: &str| {
        seen.lock()
            .iter()
            .filter(|v| v["notification"]["event_id"] == id)
            .count()
    };

    // The writer (A) delivers.
    let first = alice.send_text(&room, "first").await;
    until("A pushes the first message", async || count(&first) == 1).await;

    // A stops; B takes the lease and the push consumer with its cursor: the next message
    // is pushed by B, the first is not pushed again.
    a.stop().await;
    until("B becomes the writer", async || {
        b.server.journal.is_writer() == Some(true)
    })
    .await;
    let alice_b = b.login("alice", None).await;
    let second = alice_b.send_text(&room, "second").await;
    until("B pushes the second message", async || count(&second) == 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&first),
        1,
        "a delivered notification is not delivered again"
    );
    assert_eq!(count(&second), 1);
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_takes_over_when_the_writer_stops_and_a_new_process_catches_up() {
    logs();
    let nats = nats_node("n1", None, None);
    let a = process(vec![url(&nats)], "s2", None).await;
    until("A becomes the writer", async || {
        a.server.journal.is_writer() == Some(true)
    })
    .await;
    let key = key_of(&a);
    let b = process(vec![url(&nats)], "s2", Some(&key)).await;
    let alice = a.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let before = alice.send_text(&room, "before").await;

    // A stops cleanly: it hands the lease over, B becomes the writer.
    a.stop().await;
    until("B becomes the writer", async || {
        b.server.journal.is_writer() == Some(true)
    })
    .await;
    let alice_b = b.login("alice", None).await;
    let after = alice_b.send_text(&room, "after").await;
    let tl = timeline(&alice_b, &room).await;
    let n = tl.len();
    assert_eq!(&tl[n - 2..], &[before.clone(), after.clone()]);

    // B stops; a new process (an empty data directory, only the key) copies the
    // stream into its mirror, takes the lease and serves the same timeline.
    b.stop().await;
    let c = process(vec![url(&nats)], "s2", Some(&key)).await;
    until("C becomes the writer", async || {
        c.server.journal.is_writer() == Some(true)
    })
    .await;
    let alice_c = c.login("alice", None).await;
    assert_eq!(timeline(&alice_c, &room).await, tl);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_node_cluster_loses_no_acknowledged_event_when_a_node_dies() {
    logs();
    let routes = [nats_port(), nats_port(), nats_port()];
    let mut nodes: Vec<Option<Nats>> = (0..3)
        .map(|i| {
            Some(nats_node(
                &format!("n{i}"),
                Some((routes[i], &routes)),
                None,
            ))
        })
        .collect();
    let urls: Vec<String> = nodes.iter().map(|n| url(n.as_ref().unwrap())).collect();
    // JetStream needs its meta leader elected before a stream can be created.
    let a = start_when_served(urls.clone(), "s3", None, |config| {
        config.journal.nats.replicas = 3;
        // A node's death re-elects the lease's leader: give it time.
        config.journal.nats.lease_ttl_ms = 15_000;
    })
    .await;
    until("A becomes the writer", async || {
        a.server.journal.is_writer() == Some(true)
    })
    .await;
    let alice = a.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let mut acked = Vec::new();
    for i in 0..10 {
        acked.push(alice.send_text(&room, &format!("m{i}")).await);
    }
    // SIGKILL one node (not necessarily the stream leader) mid-traffic; R3 keeps a
    // majority, so every later send is still acknowledged and nothing is lost.
    let mut victim = nodes[1].take().unwrap();
    let _ = victim.child.kill();
    let _ = victim.child.wait();
    for i in 10..20 {
        // Re-electing the stream's and the lease's leaders on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let r = alice
                .send_txn(
                    &room,
                    "m.room.message",
                    &format!("t{i}"),
                    &json!({"msgtype": "m.text", "body": format!("m{i}")}),
                )
                .await;
            if r.status == 200 {
                acked.push(r.body["event_id"].as_str().unwrap().to_owned());
                break;
            }
            assert!(
                Instant::now() < deadline,
                "send {i} never succeeded: {:?}",
                r.body
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let key = key_of(&a);
    a.stop().await;
    // A fresh process (an empty data directory, only the key) rebuilds everything from
    // the two surviving nodes.
    // Until the surviving nodes have re-elected the streams' leaders, JetStream requests
    // time out: a start that fails on that is tried again, as an operator would.
    let b = start_when_served(
        vec![urls[0].clone(), urls[2].clone()],
        "s3",
        Some(&key),
        |_| {},
    )
    .await;
    // The lease stream's leader is elected again among the two survivors and A's lease
    // (15 s) runs out before B may write; until then a request gets 503 "try again".
    until_within(
        "B becomes the writer",
        Duration::from_secs(120),
        async || b.server.journal.is_writer() == Some(true),
    )
    .await;
    let alice_b = b.login("alice", None).await;
    let tl = timeline(&alice_b, &room).await;
    for id in &acked {
        assert_eq!(
            tl.iter().filter(|x| *x == id).count(),
            1,
            "acknowledged {id} is there exactly once"
        );
    }
    b.stop().await;
}

/// A process on the shared journal (configured by `f` over [`nats_config`]), started
/// again in a fresh data directory until it starts or 120 s have passed: a NATS
/// cluster electing leaders times JetStream requests out for a while.
async fn start_when_served(
    servers: Vec<String>,
    stream: &str,
    key: Option<&[u8]>,
    f: impl Fn(&mut spindle::Config),
) -> TestServer {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let dir = tempfile::tempdir().unwrap();
        let mut config = nats_config(servers.clone(), stream, dir.path());
        f(&mut config);
        if let Some(key) = key {
            std::fs::create_dir_all(&config.data_dir).unwrap();
            std::fs::write(config.data_dir.join("signing.key"), key).unwrap();
        }
        match spindle::Server::start(config).await {
            Ok(server) => {
                let base = format!("http://{}", server.addr);
                return TestServer {
                    server,
                    dir,
                    base,
                    http: http(),
                };
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("NATS not serving yet: {e:#}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("NATS never served: {e:#}"),
        }
    }
}

/// A Spindle binary (its own process, so it can be SIGKILLed) on the shared journal.
struct Proc {
    config: std::path::PathBuf,
    data: std::path::PathBuf,
    base: String,
    child: Option<Child>,
}

impl Proc {
    fn new(root: &Path, name: &str, nats: &str, stream: &str) -> Proc {
        let port = free_port();
        let data = root.join(name);
        let config = root.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "server_name = \"localhost:8008\"\nbind = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n\n\
                 [rate_limits]\nenabled = false\n\n[journal]\nbackend = \"nats\"\n\n\
                 [journal.nats]\nservers = [\"{nats}\"]\nstream = \"{stream}\"\nlease_ttl_ms = 3000\n",
                data.display()
            ),
        )
        .unwrap();
        Proc {
            config,
            data,
            base: format!("http://127.0.0.1:{port}"),
            child: None,
        }
    }

    async fn start(&mut self) {
        self.child = Some(
            Command::new(env!("CARGO_BIN_EXE_spindle"))
                .arg("--config")
                .arg(&self.config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start spindle"),
        );
        let http = http();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(r) = http
                .get(format!("{}/_matrix/client/versions", self.base))
                .send()
                .await
                && r.status().is_success()
            {
                return;
            }
            assert!(Instant::now() < deadline, "spindle did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Switches the configuration's `[journal] backend` ("embedded" or "nats").
    fn backend(&self, backend: &str) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        let text = text
            .replace("backend = \"nats\"", &format!("backend = \"{backend}\""))
            .replace(
                "backend = \"embedded\"",
                &format!("backend = \"{backend}\""),
            );
        std::fs::write(&self.config, text).unwrap();
    }

    /// Runs `spindle --config <this> <args>`: (success, stdout, stderr).
    fn verb(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_spindle"))
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends with one transaction id until a send is acknowledged (a send in flight when
/// the writer died is retried with the same id, as a client does).
async fn send_until_acked(c: &Client, room: &str, txn: &str, body: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        // Not through `Client::request`: a 503 while no writer answers is expected here.
        let r = c
            .http
            .put(format!(
                "{}/_matrix/client/v3/rooms/{}/send/m.room.message/{txn}",
                c.base,
                enc(room)
            ))
            .bearer_auth(c.token.as_deref().unwrap())
            .json(&json!({"msgtype": "m.text", "body": body}))
            .send()
            .await;
        if let Ok(r) = r {
            let status = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            if status == 200 {
                return v["event_id"].as_str().unwrap().to_owned();
            }
            assert!(
                status == 503 || status == 502,
                "only 'no writer yet' may fail a send: {status} {v}"
            );
        }
        assert!(Instant::now() < deadline, "send {txn} never acknowledged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_of_the_writer_during_writes_loses_no_acknowledged_event() {
    logs();
    let nats = nats_node("n1", None, None);
    let root = tempfile::tempdir().unwrap();
    let mut a = Proc::new(root.path(), "a", &url(&nats), "s4");
    a.start().await;
    let mut b = Proc::new(root.path(), "b", &url(&nats), "s4");
    std::fs::create_dir_all(&b.data).unwrap();
    std::fs::copy(a.data.join("signing.key"), b.data.join("signing.key")).unwrap();
    b.start().await;

    let http = http();
    let alice = register(&a.base, &http, "alice").await;
    let room = alice.create_room(json!({})).await;
    let alice_b = login(&b.base, &http, "alice", None).await;
    // Writes through both; the writer (A, first to start) is killed half-way.
    let mut acked = Vec::new();
    for i in 0..10 {
        acked.push(send_until_acked(&alice, &room, &format!("a{i}"), &format!("a{i}")).await);
        acked.push(send_until_acked(&alice_b, &room, &format!("b{i}"), &format!("b{i}")).await);
    }
    let killer = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.kill();
    };
    let writes = async {
        let mut ids = Vec::new();
        for i in 10..40 {
            ids.push(send_until_acked(&alice_b, &room, &format!("b{i}"), &format!("b{i}")).await);
        }
        ids
    };
    let ((), more) = tokio::join!(killer, writes);
    acked.extend(more);

    // Every acknowledged event is in B's timeline exactly once, in the order acked.
    let tl = timeline(&alice_b, &room).await;
    let positions: Vec<usize> = acked
        .iter()
        .map(|id| {
            assert_eq!(tl.iter().filter(|x| *x == id).count(), 1, "{id} once");
            tl.iter().position(|x| x == id).unwrap()
        })
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "acked order kept"
    );

    // A restarts on its own data directory: it copies what it missed into its mirror,
    // follows B, and serves the same timeline.
    a.start().await;
    let alice_a = login(&a.base, &http, "alice", None).await;
    assert_eq!(timeline(&alice_a, &room).await, tl);
    let last = send_until_acked(&alice_a, &room, "after-restart", "after").await;
    // Acknowledged by the writer (B) for A's client: B's own projections follow the
    // stream on their own, so a read through B waits for them (bounded), as a client
    // of another process would poll (it failed once under a full test run's load).
    until("B serves the send made through A", async || {
        timeline(&alice_b, &room).await.last() == Some(&last)
    })
    .await;
    let tl_b = timeline(&alice_b, &room).await;
    assert_eq!(tl_b.last(), Some(&last));
    assert_eq!(tl_b[..tl_b.len() - 1], tl[..], "nothing else came between");

    // Killed outright, each process's mirror still holds the whole stream, chained.
    let stream_head = {
        let client = async_nats::connect(url(&nats)).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let s = js.get_stream("s4").await.unwrap();
        s.get_info().await.unwrap().state.last_sequence
    };
    a.kill();
    b.kill();
    for p in [&a, &b] {
        let out = Command::new(env!("CARGO_BIN_EXE_spindle"))
            .arg("--config")
            .arg(&p.config)
            .args(["journal", "check", "--chain-only"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.starts_with(&format!("ok\thead {stream_head}\t")),
            "{text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The last sequence of a stream (its head position).
async fn stream_head(nats: &Nats, stream: &str) -> u64 {
    let client = async_nats::connect(url(nats)).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let s = js.get_stream(stream).await.unwrap();
    s.get_info().await.unwrap().state.last_sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedded_journal_moves_into_jetstream_and_back() {
    logs();
    let nats = nats_node("n1", None, None);
    let root = tempfile::tempdir().unwrap();
    let http = http();

    // A single-box server on the embedded journal, with some history and a cursor.
    let mut a = Proc::new(root.path(), "a", &url(&nats), "s5");
    a.backend("embedded");
    a.start().await;
    let alice = register(&a.base, &http, "alice").await;
    let room = alice.create_room(json!({"name": "moving"})).await;
    for i in 0..5 {
        send_until_acked(&alice, &room, &format!("t{i}"), &format!("m{i}")).await;
    }
    let before = timeline(&alice, &room).await;
    a.kill();
    std::fs::write(
        a.data.join("consumers").join("test-consumer.json"),
        br#"{"x":7}"#,
    )
    .unwrap();
    let (ok, head_line, err) = a.verb(&["journal", "check", "--chain-only"]);
    assert!(ok, "{err}");
    let head: u64 = head_line.split('\t').nth(1).unwrap()["head ".len()..]
        .parse()
        .unwrap();

    // Into the stream: every record, the cursor files; a second run copies nothing.
    let (ok, out, err) = a.verb(&["journal", "copy-to-nats"]);
    assert!(ok, "{out} {err}");
    assert!(
        out.starts_with(&format!(
            "copied {head} records into stream s5; head {head}; cursors of "
        )),
        "{out}"
    );
    assert_eq!(stream_head(&nats, "s5").await, head);
    // A second run copies nothing, and keeps the stream's cursors (a process that ran
    // on the stream has newer ones than the files it left behind).
    std::fs::write(
        a.data.join("consumers").join("test-consumer.json"),
        br#"{"x":1}"#,
    )
    .unwrap();
    let (ok, out, err) = a.verb(&["journal", "copy-to-nats"]);
    assert!(ok, "{err}");
    assert!(
        out.starts_with(&format!(
            "copied 0 records into stream s5; head {head}; cursors of 0 consumers;"
        )),
        "{out}"
    );

    // Another server's journal is refused: the stream holds records it does not.
    let mut stranger = Proc::new(root.path(), "stranger", &url(&nats), "s5");
    stranger.backend("embedded");
    stranger.start().await;
    register(&stranger.base, &http, "mallory").await;
    stranger.kill();
    let (ok, _, err) = stranger.verb(&["journal", "copy-to-nats"]);
    assert!(!ok);
    assert!(
        err.contains("is not a copy of this journal") || err.contains("holds another journal"),
        "{err}"
    );
    assert_eq!(stream_head(&nats, "s5").await, head);

    // The same data directory serves on the stream; a new process catches up from it.
    a.backend("nats");
    a.start().await;
    let alice = login(&a.base, &http, "alice", None).await;
    assert_eq!(timeline(&alice, &room).await, before);
    let after = send_until_acked(&alice, &room, "after", "after the move").await;
    let mut b = Proc::new(root.path(), "b", &url(&nats), "s5");
    std::fs::create_dir_all(&b.data).unwrap();
    std::fs::copy(a.data.join("signing.key"), b.data.join("signing.key")).unwrap();
    b.start().await;
    let alice_b = login(&b.base, &http, "alice", None).await;
    let mut expected = before.clone();
    expected.push(after.clone());
    until("B has the whole room", async || {
        timeline(&alice_b, &room).await == expected
    })
    .await;
    let head = stream_head(&nats, "s5").await;
    a.kill();
    b.kill();

    // And back: a new data directory (with the deployment's key) copies the stream and
    // its cursors, and serves it on the embedded journal.
    // A stream that does not exist is not created by a copy from it.
    let missing = Proc::new(root.path(), "missing", &url(&nats), "s5-typo");
    std::fs::create_dir_all(&missing.data).unwrap();
    std::fs::copy(a.data.join("signing.key"), missing.data.join("signing.key")).unwrap();
    let (ok, _, err) = missing.verb(&["journal", "copy-from-nats"]);
    assert!(
        !ok && err.contains("stream s5-typo does not exist"),
        "{err}"
    );
    let mut c = Proc::new(root.path(), "c", &url(&nats), "s5");
    let (ok, _, err) = c.verb(&["journal", "copy-from-nats"]);
    assert!(!ok && err.contains("no signing.key"), "{err}");
    std::fs::create_dir_all(&c.data).unwrap();
    std::fs::copy(a.data.join("signing.key"), c.data.join("signing.key")).unwrap();
    let (ok, out, err) = c.verb(&["journal", "copy-from-nats"]);
    assert!(ok, "{out} {err}");
    assert!(
        out.starts_with(&format!(
            "copied {head} records from stream s5; head {head}; cursors of "
        )),
        "{out}"
    );
    assert_eq!(
        std::fs::read(c.data.join("consumers").join("test-consumer.json")).unwrap(),
        br#"{"x":7}"#
    );
    let (ok, out, err) = c.verb(&["journal", "check"]);
    assert!(
        ok && out.starts_with(&format!("ok\thead {head}\t")),
        "{out} {err}"
    );
    c.backend("embedded");
    c.start().await;
    let alice_c = login(&c.base, &http, "alice", None).await;
    assert_eq!(timeline(&alice_c, &room).await, expected);
    send_until_acked(&alice_c, &room, "embedded-again", "on one box again").await;
}
