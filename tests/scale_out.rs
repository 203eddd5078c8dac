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

/// Starts one node; `cluster` is (this node's route port, every node's route port).
fn nats_node(name: &str, cluster: Option<(u16, &[u16])>, store: Option<&Path>) -> Nats {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
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

/// A Spindle process on the shared journal, in `dir` (a fresh one if `None`), signing
/// with `key` (every process of one deployment signs as the same server).
async fn process_in(
    servers: Vec<String>,
    stream: &str,
    key: Option<&[u8]>,
    dir: Option<tempfile::TempDir>,
) -> TestServer {
    let dir = dir.unwrap_or_else(|| tempfile::tempdir().unwrap());
    let mut config = spindle::Config {
        bind: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().join("data"),
        log: "warn".into(),
        rate_limits: spindle::config::RateLimits::lifted(),
        ..Default::default()
    };
    config.journal.backend = spindle::config::JournalBackend::Nats;
    config.journal.nats.servers = servers;
    config.journal.nats.stream = stream.to_owned();
    config.journal.nats.lease_ttl_ms = 6_000;
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

async fn process(servers: Vec<String>, stream: &str, key: Option<&[u8]>) -> TestServer {
    process_in(servers, stream, key, None).await
}

fn key_of(s: &TestServer) -> Vec<u8> {
    std::fs::read(s.dir.path().join("data").join("signing.key")).unwrap()
}

async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
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
    let routes = [free_port(), free_port(), free_port()];
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
    let a = {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let urls = urls.clone();
            let attempt = tokio::spawn(async move {
                let dir = tempfile::tempdir().unwrap();
                let mut config = spindle::Config {
                    bind: "127.0.0.1:0".parse().unwrap(),
                    data_dir: dir.path().join("data"),
                    log: "warn".into(),
                    rate_limits: spindle::config::RateLimits::lifted(),
                    ..Default::default()
                };
                config.journal.backend = spindle::config::JournalBackend::Nats;
                config.journal.nats.servers = urls;
                config.journal.nats.stream = "s3".into();
                config.journal.nats.replicas = 3;
                // A node's death re-elects the lease bucket's leader: give it time.
                config.journal.nats.lease_ttl_ms = 15_000;
                spindle::Server::start(config).await.map(|s| (s, dir))
            })
            .await
            .unwrap();
            match attempt {
                Ok((server, dir)) => {
                    let base = format!("http://{}", server.addr);
                    break TestServer {
                        server,
                        dir,
                        base,
                        http: http(),
                    };
                }
                Err(e) if Instant::now() < deadline => {
                    eprintln!("cluster not ready yet: {e:#}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("cluster never became ready: {e:#}"),
            }
        }
    };
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
        let deadline = Instant::now() + Duration::from_secs(30);
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
    let b = process(vec![urls[0].clone(), urls[2].clone()], "s3", Some(&key)).await;
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
    let tl_b = timeline(&alice_b, &room).await;
    assert_eq!(tl_b.last(), Some(&last));
}
