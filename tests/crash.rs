//! BRIEF §3.4: durable before acknowledged. The real binary is killed with SIGKILL in
//! the middle of concurrent sends; after a restart every acknowledged event is there,
//! in the same order, and the journal reads back cleanly (no torn record).

use std::{
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::{Value, json};

/// One server binary on a free port with its own data directory (kept across restarts).
struct Node {
    _dir: tempfile::TempDir,
    config: std::path::PathBuf,
    base: String,
    http: reqwest::Client,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("spindle.toml");
        std::fs::write(
            &config,
            format!(
                "server_name = \"localhost:{port}\"\nbind = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n\n[rate_limits]\nenabled = false\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        Node {
            _dir: dir,
            config,
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
        }
    }

    /// Starts the binary and waits until it answers `/versions`.
    async fn start(&self) -> Child {
        let child = Command::new(env!("CARGO_BIN_EXE_spindle"))
            .arg("--config")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start spindle");
        wait_ready(&self.http, &self.base).await;
        child
    }

    /// Registers a user (UIA dummy flow) and returns the access token.
    async fn register(&self, username: &str) -> String {
        let reg = post(
            &self.http,
            format!("{}/_matrix/client/v3/register", self.base),
            None,
            json!({ "username": username, "password": "pw", "auth": { "type": "m.login.dummy" } }),
        )
        .await;
        reg["access_token"].as_str().unwrap().to_owned()
    }
}

/// Waits up to 60 s for the server to answer: a debug build on a loaded 2-core machine
/// (CI, or a build running beside the tests) has been seen to need more than 10 s.
async fn wait_ready(http: &reqwest::Client, base: &str) {
    for _ in 0..1200 {
        if let Ok(r) = http
            .get(format!("{base}/_matrix/client/versions"))
            .send()
            .await
            && r.status().is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("spindle did not become ready");
}

async fn post(http: &reqwest::Client, url: String, token: Option<&str>, body: Value) -> Value {
    let mut req = http.post(url).json(&body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.unwrap().json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_concurrent_sends_loses_nothing_acknowledged() {
    let node = Node::new();
    let (http, base) = (node.http.clone(), node.base.clone());
    let mut child = node.start().await;
    let token = node.register("crash").await;
    let mut rooms = Vec::new();
    for _ in 0..4 {
        let r = post(
            &http,
            format!("{base}/_matrix/client/v3/createRoom"),
            Some(&token),
            json!({}),
        )
        .await;
        rooms.push(r["room_id"].as_str().unwrap().to_owned());
    }

    // Four writers, one per room, sending as fast as they can; each records what was acknowledged.
    let acked: Arc<Mutex<Vec<(usize, u32, String)>>> = Arc::default();
    let mut tasks = Vec::new();
    for (w, room) in rooms.iter().enumerate() {
        let (http, base, token, room, acked) = (
            http.clone(),
            base.clone(),
            token.clone(),
            room.clone(),
            acked.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for i in 0u32.. {
                let url =
                    format!("{base}/_matrix/client/v3/rooms/{room}/send/m.room.message/w{w}-{i}");
                let resp = http
                    .put(url)
                    .bearer_auth(&token)
                    .json(&json!({ "msgtype": "m.text", "body": format!("w{w}-{i}") }))
                    .send()
                    .await;
                let Ok(resp) = resp else { break };
                let Ok(v) = resp.json::<Value>().await else {
                    break;
                };
                match v["event_id"].as_str() {
                    Some(id) => acked.lock().unwrap().push((w, i, id.to_owned())),
                    None => break,
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    child.kill().unwrap(); // SIGKILL: no shutdown path runs.
    child.wait().unwrap();
    for t in tasks {
        let _ = t.await;
    }
    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() >= 20,
        "too few sends acknowledged before the kill: {}",
        acked.len()
    );

    let mut child = node.start().await;
    for (w, room) in rooms.iter().enumerate() {
        let want: Vec<&str> = acked
            .iter()
            .filter(|(x, _, _)| *x == w)
            .map(|(_, _, id)| id.as_str())
            .collect();
        let url = format!("{base}/_matrix/client/v3/rooms/{room}/messages?dir=f&limit=1000");
        let v: Value = http
            .get(url)
            .bearer_auth(&token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let got: Vec<String> = v["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"] == "m.room.message")
            .map(|e| e["event_id"].as_str().unwrap().to_owned())
            .collect();
        // Every acknowledged event is present, in acknowledgement order; at most one
        // unacknowledged send (in flight at the kill) may follow.
        assert!(
            got.len() >= want.len() && got.len() <= want.len() + 1,
            "room {w}: {} acked, {} stored",
            want.len(),
            got.len()
        );
        assert_eq!(
            &got[..want.len()],
            &want[..],
            "room {w}: acknowledged events missing or reordered"
        );
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// SIGTERM with a long-poll waiting: the poll is answered at once and the process exits
/// cleanly well before the poll's timeout (it used to wait for every open poll).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_waiting_long_polls_and_exits() {
    let node = Node::new();
    let (http, base) = (node.http.clone(), node.base.clone());
    let mut child = node.start().await;
    let token = node.register("poller").await;
    let first: Value = http
        .get(format!("{base}/_matrix/client/v3/sync"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let since = first["next_batch"].as_str().unwrap().to_owned();
    let poll = {
        let (http, base, token) = (http.clone(), base.clone(), token.clone());
        tokio::spawn(async move {
            http.get(format!(
                "{base}/_matrix/client/v3/sync?since={since}&timeout=60000"
            ))
            .bearer_auth(token)
            .send()
            .await
            .map(|r| r.status().as_u16())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    // Liveness bound, not a performance assertion: the poll's own timeout is 60 s.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        started.elapsed()
    );
    assert!(exit.success(), "exit status {exit:?}");
    assert_eq!(poll.await.unwrap().unwrap(), 200);
}

/// Runs `spindle <args> --config FILE` to completion; returns (success, stdout, stderr).
fn spindle_verb(config: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_spindle"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env_remove("RUST_LOG")
        .output()
        .expect("run spindle");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Per writer: acknowledged (seq, event id).
type Acked = Arc<Mutex<Vec<Vec<(u32, String)>>>>;

/// A small deterministic PRNG (xorshift64*), so a failing run can be repeated with
/// its seed (`SPINDLE_CRASH_SEED`).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// BRIEF §3.4 under repeated crashes: a writer process is SIGKILLed at random moments
/// under concurrent load (four rooms, one writer each, plus logins appending facts),
/// `ROUNDS` times. After each restart every writer re-sends the send it had in flight
/// with the same transaction id (it may or may not have landed). At the end: every
/// acknowledged event is present exactly once, in acknowledgement order, every body
/// exactly once; the journal's hash chain and every record verify (`journal check`:
/// no partial record is readable); and every projection rebuilds from position 0 to the
/// live digest (`replay verify`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_events_survive_repeated_sigkill() {
    const ROUNDS: usize = 16;
    const WRITERS: usize = 4;
    let seed = std::env::var("SPINDLE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_1234_ABCD_u64);
    eprintln!("crash test seed {seed} (SPINDLE_CRASH_SEED)");
    let mut rng = Rng(seed | 1);
    let node = Node::new();
    let (http, base) = (node.http.clone(), node.base.clone());
    let mut child = node.start().await;
    let token = node.register("crash").await;
    let mut rooms = Vec::new();
    for _ in 0..WRITERS {
        let r = post(
            &http,
            format!("{base}/_matrix/client/v3/createRoom"),
            Some(&token),
            json!({}),
        )
        .await;
        rooms.push(r["room_id"].as_str().unwrap().to_owned());
    }
    // Per writer: acknowledged (seq, event id), and the send in flight at the kill.
    let acked: Acked = Arc::new(Mutex::new(vec![Vec::new(); WRITERS]));
    let pending: Arc<Mutex<Vec<Option<u32>>>> = Arc::new(Mutex::new(vec![None; WRITERS]));
    let mut next_seq = [0u32; WRITERS];
    let send = |http: reqwest::Client,
                base: String,
                token: String,
                room: String,
                w: usize,
                i: u32| async move {
        let url = format!("{base}/_matrix/client/v3/rooms/{room}/send/m.room.message/w{w}-{i}");
        let resp = http
            .put(url)
            .bearer_auth(&token)
            .json(&json!({ "msgtype": "m.text", "body": format!("w{w}-{i}") }))
            .send()
            .await
            .ok()?;
        let v: Value = resp.json().await.ok()?;
        v["event_id"].as_str().map(str::to_owned)
    };
    for round in 0..ROUNDS {
        // Re-send what was in flight at the last kill, with the same txn id.
        for (w, room) in rooms.iter().enumerate() {
            let p = pending.lock().unwrap()[w].take();
            if let Some(i) = p {
                let id = send(
                    http.clone(),
                    base.clone(),
                    token.clone(),
                    room.clone(),
                    w,
                    i,
                )
                .await
                .expect("a retried send is acknowledged");
                acked.lock().unwrap()[w].push((i, id));
            }
        }
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let (http, base, token, room) =
                (http.clone(), base.clone(), token.clone(), rooms[w].clone());
            let (acked, pending) = (acked.clone(), pending.clone());
            let start = next_seq[w];
            tasks.push(tokio::spawn(async move {
                let mut i = start;
                loop {
                    pending.lock().unwrap()[w] = Some(i);
                    match send(
                        http.clone(),
                        base.clone(),
                        token.clone(),
                        room.clone(),
                        w,
                        i,
                    )
                    .await
                    {
                        Some(id) => {
                            acked.lock().unwrap()[w].push((i, id));
                            pending.lock().unwrap()[w] = None;
                            i += 1;
                        }
                        None => return i,
                    }
                }
            }));
        }
        // Logins append device and token facts concurrently with the sends.
        let logins = {
            let (http, base) = (http.clone(), base.clone());
            tokio::spawn(async move {
                for _ in 0..1000 {
                    let ok = http
                        .post(format!("{base}/_matrix/client/v3/login"))
                        .json(&json!({ "type": "m.login.password", "identifier": { "type": "m.id.user", "user": "crash" }, "password": "pw" }))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    if !ok {
                        break;
                    }
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(150 + rng.below(900))).await;
        child.kill().unwrap(); // SIGKILL at a random moment.
        child.wait().unwrap();
        for (w, t) in tasks.into_iter().enumerate() {
            next_seq[w] = t.await.unwrap() + 1;
        }
        let _ = logins.await;
        eprintln!(
            "round {round}: {} sends acknowledged so far",
            acked.lock().unwrap().iter().map(Vec::len).sum::<usize>()
        );
        child = node.start().await;
    }
    for (w, room) in rooms.iter().enumerate() {
        let p = pending.lock().unwrap()[w].take();
        if let Some(i) = p {
            let id = send(
                http.clone(),
                base.clone(),
                token.clone(),
                room.clone(),
                w,
                i,
            )
            .await
            .expect("a retried send is acknowledged");
            acked.lock().unwrap()[w].push((i, id));
        }
    }
    let acked = acked.lock().unwrap().clone();
    for (w, room) in rooms.iter().enumerate() {
        let want: Vec<&str> = acked[w].iter().map(|(_, id)| id.as_str()).collect();
        assert!(
            want.len() >= ROUNDS,
            "writer {w}: only {} acknowledged",
            want.len()
        );
        let mut chunk: Vec<Value> = Vec::new();
        let mut from = String::new();
        loop {
            let url =
                format!("{base}/_matrix/client/v3/rooms/{room}/messages?dir=f&limit=500{from}");
            let v: Value = http
                .get(url)
                .bearer_auth(&token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let page = v["chunk"].as_array().unwrap();
            if page.is_empty() {
                break;
            }
            chunk.extend(page.iter().cloned());
            match v["end"].as_str() {
                Some(end) => from = format!("&from={end}"),
                None => break,
            }
        }
        let events: Vec<&Value> = chunk
            .iter()
            .filter(|e| e["type"] == "m.room.message")
            .collect();
        let got: Vec<&str> = events
            .iter()
            .map(|e| e["event_id"].as_str().unwrap())
            .collect();
        let mut bodies: Vec<&str> = events
            .iter()
            .map(|e| e["content"]["body"].as_str().unwrap())
            .collect();
        // Exactly once: the stored messages are the acknowledged ones, in order; sends
        // cut off by a kill were retried with their txn id and never duplicated.
        assert_eq!(got, want, "room {w}");
        let n = bodies.len();
        bodies.sort();
        bodies.dedup();
        assert_eq!(bodies.len(), n, "room {w}: a body appears twice");
    }
    // Stop cleanly, then check the journal and the projections offline.
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    child.wait().unwrap();
    let (ok, out, err) = spindle_verb(&node.config, &["journal", "check"]);
    assert!(ok, "journal check after {ROUNDS} kills: {out}{err}");
    assert!(out.starts_with("ok\thead "), "{out}");
    let (ok, out, err) = spindle_verb(&node.config, &["replay", "verify"]);
    assert!(ok, "replay verify after {ROUNDS} kills: {out}{err}");
    assert!(
        out.lines().count() >= 10 && out.lines().all(|l| l.contains("\tok\t")),
        "{out}"
    );
}
