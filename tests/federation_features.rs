//! Server-Server features beyond joins and transactions: the public room directory and
//! space hierarchy over federation, server ACLs, the per-origin rate limit, remote
//! media and knocking.
//!
//! Inbound endpoints are driven by a fake remote server (`remote.test`, whose key the
//! server is told through `KeyCache::pin`), as in `tests/federation.rs`. Outbound
//! paths (`/publicRooms?server=`, remote media, remote knocks) run between two
//! in-process Spindle servers on loopback, each named `localhost:PORT` with a TLS
//! federation listener on that port and a self-signed certificate made with the
//! `openssl` command.

use serde_json::{Value, json};
use spindle_core::{keys::ServerKey, pdu::Pdu};

const REMOTE: &str = "remote.test";
const OURS: &str = "localhost:8008";

fn enc(s: &str) -> String {
    spindle_federation::transactions::urlencode(s)
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

struct Node {
    server: spindle::Server,
    http: reqwest::Client,
    base: String,
    name: String,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn make_cert(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let status = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .args(["-subj", "/CN=localhost"])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("the openssl command makes the test certificate");
    assert!(status.success());
    (cert, key)
}

impl Node {
    /// A server named `localhost:8008` without a TLS listener (inbound tests).
    async fn plain(tweak: impl FnOnce(&mut spindle::Config)) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let mut config = spindle::Config {
            bind: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().to_path_buf(),
            rate_limits: spindle::config::RateLimits::lifted(),
            ..Default::default()
        };
        tweak(&mut config);
        Node::start(config, dir, OURS.into()).await
    }

    /// A server named `localhost:PORT` with a TLS federation listener on that port,
    /// trusting loopback peers (outbound tests).
    async fn federating(tweak: impl FnOnce(&mut spindle::Config)) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = make_cert(dir.path());
        let port = free_port();
        let name = format!("localhost:{port}");
        let mut config = spindle::Config {
            server_name: name.clone(),
            bind: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().to_path_buf(),
            rate_limits: spindle::config::RateLimits::lifted(),
            ..Default::default()
        };
        config.federation.tls_bind = format!("127.0.0.1:{port}");
        config.federation.tls_certificate_path = cert;
        config.federation.tls_private_key_path = key;
        config.federation.dangerous_skip_tls_verification_for_tests = true;
        config.federation.ip_range_allowlist = vec!["127.0.0.0/8".into()];
        config.federation.retry_initial_ms = 100;
        config.federation.retry_max_ms = 1_000;
        tweak(&mut config);
        Node::start(config, dir, name).await
    }

    async fn start(config: spindle::Config, dir: tempfile::TempDir, name: String) -> Node {
        let server = spindle::Server::start(config).await.unwrap();
        let base = format!("http://{}", server.addr);
        Node {
            server,
            http: reqwest::Client::new(),
            base,
            name,
            _dir: dir,
        }
    }

    /// Tells this server the key of `remote` (no key fetch over the network).
    fn pin(&self, remote: &ServerKey) {
        self.server.federation.keys.pin(
            remote.server_name(),
            [(remote.key_id(), remote.public_key_base64())]
                .into_iter()
                .collect(),
            3_600_000,
        );
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
        let v = resp.json().await.unwrap_or(Value::Null);
        assert!(status < 500 || status == 502, "{path}: {status} {v}");
        (status, v)
    }

    /// A request signed by `key`'s server.
    async fn fed(
        &self,
        key: &ServerKey,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let auth = x_matrix(key, method.as_str(), path, &self.name, body.as_ref());
        let mut req = self
            .http
            .request(method, format!("{}{}", self.base, path))
            .header("Authorization", auth);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let v = resp.json().await.unwrap_or(Value::Null);
        assert!(status < 500, "{path}: {status} {v}");
        (status, v)
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

    async fn put_state(&self, token: &str, room: &str, kind: &str, key: &str, content: Value) {
        let (status, v) = self
            .client(
                reqwest::Method::PUT,
                &format!(
                    "/_matrix/client/v3/rooms/{}/state/{kind}/{}",
                    enc(room),
                    enc(key)
                ),
                Some(token),
                Some(content),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }

    async fn publish(&self, token: &str, room: &str) {
        let (status, v) = self
            .client(
                reqwest::Method::PUT,
                &format!("/_matrix/client/v3/directory/list/room/{}", enc(room)),
                Some(token),
                Some(json!({ "visibility": "public" })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
}

fn room_ids(chunk: &Value) -> Vec<String> {
    chunk
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["room_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn public_rooms_are_served_over_federation_with_filters_and_pages() {
    let n = Node::plain(|_| {}).await;
    let remote = ServerKey::generate(REMOTE);
    n.pin(&remote);
    let alice = n.register("alice").await;
    let general = n
        .create_room(
            &alice,
            json!({ "preset": "public_chat", "name": "General chat" }),
        )
        .await;
    let rust = n
        .create_room(
            &alice,
            json!({ "preset": "public_chat", "name": "Rust corner", "topic": "crabs" }),
        )
        .await;
    let hidden = n
        .create_room(
            &alice,
            json!({ "preset": "public_chat", "name": "Unlisted" }),
        )
        .await;
    n.publish(&alice, &general).await;
    n.publish(&alice, &rust).await;
    let mut listed = vec![general.clone(), rust.clone()];
    listed.sort();
    // GET: both published rooms (same size: by room id), not the unlisted one.
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            "/_matrix/federation/v1/publicRooms",
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(room_ids(&v["chunk"]), listed);
    assert!(!room_ids(&v["chunk"]).contains(&hidden));
    assert_eq!(v["total_room_count_estimate"], 2);
    let rust_chunk = v["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["room_id"] == rust.as_str())
        .unwrap()
        .clone();
    assert_eq!(rust_chunk["name"], "Rust corner");
    assert_eq!(rust_chunk["topic"], "crabs");
    assert_eq!(rust_chunk["num_joined_members"], 1);
    assert_eq!(rust_chunk["join_rule"], "public");
    // Pages of one.
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            "/_matrix/federation/v1/publicRooms?limit=1",
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(room_ids(&v["chunk"]), vec![listed[0].clone()]);
    assert_eq!(v["next_batch"], "p1");
    let (_, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            "/_matrix/federation/v1/publicRooms?limit=1&since=p1",
            None,
        )
        .await;
    assert_eq!(room_ids(&v["chunk"]), vec![listed[1].clone()]);
    assert_eq!(v["prev_batch"], "p0");
    assert!(v.get("next_batch").is_none());
    // POST with a search term.
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::POST,
            "/_matrix/federation/v1/publicRooms",
            Some(json!({ "limit": 10, "filter": { "generic_search_term": "CRAB" } })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(room_ids(&v["chunk"]), vec![rust.clone()]);
    // Bad input: Matrix errors, never a 500.
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            "/_matrix/federation/v1/publicRooms?since=zz",
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (400, Some("M_INVALID_PARAM"))
    );
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::POST,
            "/_matrix/federation/v1/publicRooms",
            Some(json!({ "filter": "nope" })),
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (400, Some("M_BAD_JSON")));
    // Unsigned: 401.
    let (status, v) = n
        .client(
            reqwest::Method::GET,
            "/_matrix/federation/v1/publicRooms",
            None,
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (401, Some("M_UNAUTHORIZED"))
    );
}

#[tokio::test]
async fn the_hierarchy_shows_a_server_only_the_rooms_it_may_preview() {
    let n = Node::plain(|_| {}).await;
    let remote = ServerKey::generate(REMOTE);
    n.pin(&remote);
    let alice = n.register("alice").await;
    let space = n
        .create_room(
            &alice,
            json!({ "preset": "public_chat", "name": "The space", "creation_content": { "type": "m.space" } }),
        )
        .await;
    let lobby = n
        .create_room(&alice, json!({ "preset": "public_chat", "name": "Lobby" }))
        .await;
    let secret = n
        .create_room(
            &alice,
            json!({ "preset": "private_chat", "name": "Secret" }),
        )
        .await;
    let private_space = n
        .create_room(&alice, json!({ "preset": "private_chat" }))
        .await;
    n.put_state(
        &alice,
        &space,
        "m.space.child",
        &lobby,
        json!({ "via": [OURS], "suggested": true }),
    )
    .await;
    n.put_state(
        &alice,
        &space,
        "m.space.child",
        &secret,
        json!({ "via": [OURS] }),
    )
    .await;
    // A child this server knows nothing of is left out; a child without via does not count.
    n.put_state(
        &alice,
        &space,
        "m.space.child",
        "!elsewhere:other.test",
        json!({ "via": ["other.test"] }),
    )
    .await;
    n.put_state(&alice, &space, "m.space.child", &private_space, json!({}))
        .await;
    let path = format!("/_matrix/federation/v1/hierarchy/{}", enc(&space));
    let (status, v) = n.fed(&remote, reqwest::Method::GET, &path, None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["room"]["room_id"], space.as_str());
    assert_eq!(v["room"]["room_type"], "m.space");
    assert_eq!(v["room"]["name"], "The space");
    let mut state_keys: Vec<&str> = v["room"]["children_state"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state_key"].as_str().unwrap())
        .collect();
    state_keys.sort();
    let mut want = vec![lobby.as_str(), secret.as_str(), "!elsewhere:other.test"];
    want.sort();
    assert_eq!(state_keys, want);
    assert_eq!(room_ids(&v["children"]), vec![lobby.clone()]);
    assert_eq!(v["children"][0]["name"], "Lobby");
    assert!(v["children"][0]["room_version"].as_str().is_some());
    assert_eq!(v["inaccessible_children"], json!([secret]));
    // suggested_only: only the lobby's child event.
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &format!("{path}?suggested_only=true"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["room"]["children_state"].as_array().unwrap().len(), 1);
    assert_eq!(v["room"]["children_state"][0]["state_key"], lobby.as_str());
    assert_eq!(room_ids(&v["children"]), vec![lobby.clone()]);
    assert_eq!(v["inaccessible_children"], json!([]));
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &format!("{path}?suggested_only=maybe"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (400, Some("M_INVALID_PARAM"))
    );
    // A private room, and one that does not exist: 404 alike.
    for room in [secret.as_str(), "!nope:localhost:8008"] {
        let (status, v) = n
            .fed(
                &remote,
                reqwest::Method::GET,
                &format!("/_matrix/federation/v1/hierarchy/{}", enc(room)),
                None,
            )
            .await;
        assert_eq!(
            (status, v["errcode"].as_str()),
            (404, Some("M_NOT_FOUND")),
            "{room}"
        );
    }
}

#[tokio::test]
async fn a_server_denied_by_the_room_acl_is_refused_reads_and_pdus() {
    let n = Node::plain(|_| {}).await;
    let remote = ServerKey::generate(REMOTE);
    n.pin(&remote);
    let alice = n.register("alice").await;
    let room = n
        .create_room(&alice, json!({ "preset": "public_chat" }))
        .await;
    let r = enc(&room);
    let make_join = format!(
        "/_matrix/federation/v1/make_join/{r}/{}?ver=10&ver=11",
        enc("@bob:remote.test")
    );
    let hierarchy = format!("/_matrix/federation/v1/hierarchy/{r}");
    // Allowed before the ACL.
    let (status, v) = n.fed(&remote, reqwest::Method::GET, &make_join, None).await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = n.fed(&remote, reqwest::Method::GET, &hierarchy, None).await;
    assert_eq!(status, 200);
    n.put_state(
        &alice,
        &room,
        "m.room.server_acl",
        "",
        json!({ "allow": ["*"], "deny": ["*.test"], "allow_ip_literals": false }),
    )
    .await;
    let last = {
        let (_, v) = n
            .client(
                reqwest::Method::PUT,
                &format!("/_matrix/client/v3/rooms/{r}/send/m.room.message/t1"),
                Some(&alice),
                Some(json!({ "msgtype": "m.text", "body": "hi" })),
            )
            .await;
        v["event_id"].as_str().unwrap().to_owned()
    };
    let e = enc(&last);
    for (method, path, body) in [
        (reqwest::Method::GET, make_join.clone(), None),
        (reqwest::Method::GET, hierarchy.clone(), None),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/event/{e}"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/state_ids/{r}?event_id={e}"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("/_matrix/federation/v1/backfill/{r}?v={e}&limit=5"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!(
                "/_matrix/federation/v1/make_leave/{r}/{}",
                enc("@bob:remote.test")
            ),
            None,
        ),
        (
            reqwest::Method::POST,
            format!("/_matrix/federation/v1/get_missing_events/{r}"),
            Some(json!({ "earliest_events": [], "latest_events": [last], "limit": 5 })),
        ),
    ] {
        let (status, v) = n.fed(&remote, method.clone(), &path, body).await;
        assert_eq!(
            (status, v["errcode"].as_str()),
            (403, Some("M_FORBIDDEN")),
            "{method} {path}: {v}"
        );
    }
    // A PDU in a transaction: refused per PDU, the transaction itself answered.
    let pdu = json!({
        "room_id": room, "sender": "@bob:remote.test", "type": "m.room.message",
        "content": { "body": "let me in" }, "depth": 10, "origin_server_ts": 1,
        "prev_events": [last], "auth_events": [], "hashes": { "sha256": "x" },
        "signatures": {},
    });
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::PUT,
            "/_matrix/federation/v1/send/acl1",
            Some(json!({ "origin": REMOTE, "origin_server_ts": 1, "pdus": [pdu], "edus": [] })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let results = v["pdus"].as_object().unwrap();
    assert_eq!(results.len(), 1);
    let err = results.values().next().unwrap()["error"].as_str().unwrap();
    assert!(err.contains("server ACL"), "{err}");
    // Another server the ACL allows still reads.
    let friend = ServerKey::generate("friend.example");
    n.pin(&friend);
    let (status, v) = n
        .fed(
            &friend,
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/make_join/{r}/{}?ver=10&ver=11",
                enc("@carol:friend.example")
            ),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn inbound_requests_are_rate_limited_per_authenticated_origin() {
    let n = Node::plain(|c| {
        c.rate_limits = spindle::config::RateLimits::default();
        c.rate_limits.federation_origin.per_second = 0.001;
        c.rate_limits.federation_origin.burst_count = 3;
    })
    .await;
    let remote = ServerKey::generate(REMOTE);
    n.pin(&remote);
    let other = ServerKey::generate("other.test");
    n.pin(&other);
    let path = "/_matrix/federation/v1/publicRooms";
    for _ in 0..3 {
        let (status, v) = n.fed(&remote, reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "{v}");
    }
    let (status, v) = n.fed(&remote, reqwest::Method::GET, path, None).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (429, Some("M_LIMIT_EXCEEDED")),
        "{v}"
    );
    assert!(v["retry_after_ms"].as_u64().unwrap() > 0);
    // Requests that fail authentication, even naming the same origin, are not counted
    // against another origin; a second origin has its own allowance.
    let (status, _) = n.fed(&other, reqwest::Method::GET, path, None).await;
    assert_eq!(status, 200);
    let forged = ServerKey::generate("other.test");
    for _ in 0..5 {
        let (status, _) = n.fed(&forged, reqwest::Method::GET, path, None).await;
        assert_eq!(status, 401);
    }
    let (status, _) = n.fed(&other, reqwest::Method::GET, path, None).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn public_rooms_of_another_server_are_asked_of_it() {
    let a = Node::federating(|_| {}).await;
    let b = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let room = b
        .create_room(
            &bob,
            json!({ "preset": "public_chat", "name": "Bob's lounge", "topic": "tea" }),
        )
        .await;
    b.publish(&bob, &room).await;
    let other = b
        .create_room(&bob, json!({ "preset": "public_chat", "name": "Second" }))
        .await;
    b.publish(&bob, &other).await;
    let server = enc(&b.name);
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            &format!("/_matrix/client/v3/publicRooms?server={server}&limit=5"),
            None,
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let mut want = vec![room.clone(), other.clone()];
    want.sort();
    assert_eq!(room_ids(&v["chunk"]), want);
    assert_eq!(v["total_room_count_estimate"], 2);
    let (status, v) = a
        .client(
            reqwest::Method::POST,
            &format!("/_matrix/client/v3/publicRooms?server={server}"),
            Some(&alice),
            Some(json!({ "limit": 5, "filter": { "generic_search_term": "tea" } })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(room_ids(&v["chunk"]), vec![room.clone()]);
    assert_eq!(v["chunk"][0]["name"], "Bob's lounge");
    // A server that does not answer: 502, a Matrix error.
    let dead = format!("localhost:{}", free_port());
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            &format!("/_matrix/client/v3/publicRooms?server={}", enc(&dead)),
            None,
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (502, Some("M_UNKNOWN")),
        "{v}"
    );
}

fn png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(64, 48, |x, y| {
        image::Rgb([(x * 4) as u8, (y * 5) as u8, 128])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

impl Node {
    async fn upload(&self, token: &str, bytes: Vec<u8>, content_type: &str, name: &str) -> String {
        let resp = self
            .http
            .post(format!(
                "{}/_matrix/media/v3/upload?filename={}",
                self.base,
                enc(name)
            ))
            .bearer_auth(token)
            .header("content-type", content_type)
            .body(bytes)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        let uri = v["content_uri"].as_str().unwrap();
        uri.rsplit('/').next().unwrap().to_owned()
    }

    /// A raw GET with a token: (status, headers, body bytes).
    async fn get_raw(&self, path: &str, token: &str) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
        let resp = self
            .http
            .get(format!("{}{}", self.base, path))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        (status, headers, resp.bytes().await.unwrap().to_vec())
    }
}

#[tokio::test]
async fn remote_media_is_fetched_over_federation_as_multipart_and_cached() {
    let a = Node::federating(|c| c.media.max_upload_bytes = 200_000).await;
    let b = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let text = b"hello from the other server".to_vec();
    let doc = b
        .upload(&bob, text.clone(), "text/plain", "note ü.txt")
        .await;
    let picture = b.upload(&bob, png(), "image/png", "pic.png").await;
    // Served to another server as multipart/mixed: a JSON part, then the media.
    let remote = ServerKey::generate(REMOTE);
    b.pin(&remote);
    let path = format!("/_matrix/federation/v1/media/download/{doc}");
    let auth = x_matrix(&remote, "GET", &path, &b.name, None);
    let resp = b
        .http
        .get(format!("{}{path}", b.base))
        .header("Authorization", auth)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ct = resp.headers()["content-type"].to_str().unwrap().to_owned();
    let body = resp.bytes().await.unwrap();
    let parts = spindle_federation::media::parse_multipart(&ct, &body).unwrap();
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].1, b"{}");
    assert_eq!(parts[1].1, text);
    // Unsigned, and unknown media: Matrix errors.
    let (status, v) = b.client(reqwest::Method::GET, &path, None, None).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (401, Some("M_UNAUTHORIZED"))
    );
    let (status, v) = b
        .fed(
            &remote,
            reqwest::Method::GET,
            "/_matrix/federation/v1/media/download/nope",
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (404, Some("M_NOT_FOUND")));
    // A user of A downloads B's media through A: same bytes, B's file name.
    let url = format!("/_matrix/client/v1/media/download/{}/{doc}", enc(&b.name));
    let (status, headers, got) = a.get_raw(&url, &alice).await;
    assert_eq!(status, 200);
    assert_eq!(got, text);
    assert_eq!(headers["content-type"], "text/plain");
    assert_eq!(
        headers["content-disposition"],
        "inline; filename=\"note _.txt\"; filename*=utf-8''note%20%C3%BC.txt"
    );
    assert_eq!(a.server.state.remote_media.len(), 1);
    // The second download is served from A's cache: B is not asked (it is gone).
    let (status, _, again) = {
        let b_name = b.name.clone();
        drop(b);
        let r = a.get_raw(&url, &alice).await;
        // Thumbnails and other files of the stopped server are no longer reachable.
        let (status, _, _) = a
            .get_raw(
                &format!(
                    "/_matrix/client/v1/media/download/{}/{picture}",
                    enc(&b_name)
                ),
                &alice,
            )
            .await;
        assert_eq!(status, 502);
        r
    };
    assert_eq!((status, again), (200, text));
}

#[tokio::test]
async fn remote_thumbnails_and_the_spec_errors_for_remote_media() {
    let a = Node::federating(|c| c.media.max_upload_bytes = 200_000).await;
    let b = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let picture = b.upload(&bob, png(), "image/png", "pic.png").await;
    let big = b
        .upload(
            &bob,
            vec![7u8; 300_000],
            "application/octet-stream",
            "big.bin",
        )
        .await;
    let server = enc(&b.name);
    let (status, headers, thumb) = a
        .get_raw(
            &format!("/_matrix/client/v1/media/thumbnail/{server}/{picture}?width=16&height=16&method=scale"),
            &alice,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "image/png");
    let img = image::load_from_memory(&thumb).unwrap();
    assert_eq!((img.width(), img.height()), (16, 12));
    // Larger than A's limit: 502 M_TOO_LARGE; unknown on B: 404 M_NOT_FOUND.
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            &format!("/_matrix/client/v1/media/download/{server}/{big}"),
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (502, Some("M_TOO_LARGE")),
        "{v}"
    );
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            &format!("/_matrix/client/v1/media/download/{server}/doesNotExist"),
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (404, Some("M_NOT_FOUND")),
        "{v}"
    );
    // The legacy endpoint with allow_remote=false never asks another server.
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            &format!("/_matrix/media/v3/download/{server}/{picture}?allow_remote=false"),
            None,
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (404, Some("M_NOT_FOUND")),
        "{v}"
    );
    // The thumbnail and nothing else is cached (the failures are not).
    assert_eq!(a.server.state.remote_media.len(), 1);
}

#[tokio::test]
async fn knocks_go_through_make_knock_and_send_knock_both_ways() {
    let a = Node::federating(|_| {}).await;
    let b = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let room = b
        .create_room(
            &bob,
            json!({ "preset": "private_chat", "name": "Knock here" }),
        )
        .await;
    b.put_state(
        &bob,
        &room,
        "m.room.join_rules",
        "",
        json!({ "join_rule": "knock" }),
    )
    .await;
    let alice_id = format!("@alice:{}", a.name);
    let (status, v) = a
        .client(
            reqwest::Method::POST,
            &format!(
                "/_matrix/client/v3/knock/{}?via={}",
                enc(&room),
                enc(&b.name)
            ),
            Some(&alice),
            Some(json!({ "reason": "let me in" })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["room_id"], room.as_str());
    // The resident server appended the knock through its journal.
    let head = b.server.journal.durable_head();
    assert!(
        b.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );
    let m = b
        .server
        .projections
        .membership
        .get(&room, &alice_id)
        .unwrap();
    assert_eq!(m.membership, "knock");
    let knock = b.server.projections.timeline.event(&m.event_id).unwrap();
    assert_eq!(knock.pdu.content_value()["reason"], "let me in");
    // The knocker's server lists the room under rooms.knock with the remote state.
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            "/_matrix/client/v3/sync",
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let events = v["rooms"]["knock"][&room]["knock_state"]["events"]
        .as_array()
        .unwrap_or_else(|| panic!("no knock in {v}"));
    let name = events.iter().find(|e| e["type"] == "m.room.name").unwrap();
    assert_eq!(name["content"]["name"], "Knock here");
    assert!(events.iter().any(|e| e["type"] == "m.room.create"));
    let own = events.last().unwrap();
    assert_eq!(
        (own["type"].as_str(), own["state_key"].as_str()),
        (Some("m.room.member"), Some(alice_id.as_str()))
    );
    assert_eq!(own["content"]["membership"], "knock");
    // Knocking on a room whose join rule does not take knocks: the remote's 403.
    let open = b
        .create_room(&bob, json!({ "preset": "public_chat" }))
        .await;
    let (status, v) = a
        .client(
            reqwest::Method::POST,
            &format!(
                "/_matrix/client/v3/knock/{}?via={}",
                enc(&open),
                enc(&b.name)
            ),
            Some(&alice),
            Some(json!({})),
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (403, Some("M_FORBIDDEN")),
        "{v}"
    );
}

#[tokio::test]
async fn make_knock_and_send_knock_refuse_what_the_spec_refuses() {
    let n = Node::plain(|_| {}).await;
    let remote = ServerKey::generate(REMOTE);
    n.pin(&remote);
    let alice = n.register("alice").await;
    let knockable = n
        .create_room(&alice, json!({ "preset": "private_chat" }))
        .await;
    n.put_state(
        &alice,
        &knockable,
        "m.room.join_rules",
        "",
        json!({ "join_rule": "knock" }),
    )
    .await;
    let public = n
        .create_room(&alice, json!({ "preset": "public_chat" }))
        .await;
    let old = n
        .create_room(
            &alice,
            json!({ "preset": "private_chat", "room_version": "6" }),
        )
        .await;
    let bob = "@bob:remote.test";
    let mk = |room: &str, vers: &str| {
        format!(
            "/_matrix/federation/v1/make_knock/{}/{}?{vers}",
            enc(room),
            enc(bob)
        )
    };
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &mk(&knockable, "ver=10&ver=11"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["room_version"], "10");
    assert_eq!(v["event"]["content"]["membership"], "knock");
    assert_eq!(v["event"]["state_key"], bob);
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &mk(&knockable, "ver=11"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str(), v["room_version"].as_str()),
        (400, Some("M_INCOMPATIBLE_ROOM_VERSION"), Some("10"))
    );
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &mk(&old, "ver=6&ver=10"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str(), v["room_version"].as_str()),
        (400, Some("M_INCOMPATIBLE_ROOM_VERSION"), Some("6"))
    );
    let (status, v) = n
        .fed(&remote, reqwest::Method::GET, &mk(&public, "ver=10"), None)
        .await;
    assert_eq!((status, v["errcode"].as_str()), (403, Some("M_FORBIDDEN")));
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &mk("!nope:localhost:8008", "ver=10"),
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (404, Some("M_NOT_FOUND")));
    // Someone else's user: 403.
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/make_knock/{}/{}?ver=10",
                enc(&knockable),
                enc("@x:elsewhere.test")
            ),
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (403, Some("M_FORBIDDEN")));
    // send_knock: a signed knock is appended and answered with the room's state.
    let (_, made) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &mk(&knockable, "ver=10"),
            None,
        )
        .await;
    let pdu = Pdu::sign_template(made["event"].clone(), "10", &remote, 1_700_000_000_000).unwrap();
    let path = format!(
        "/_matrix/federation/v1/send_knock/{}/{}",
        enc(&knockable),
        enc(pdu.event_id.as_str())
    );
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::PUT,
            &path,
            Some(pdu.federation_json()),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let types: Vec<&str> = v["knock_room_state"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, vec!["m.room.create", "m.room.join_rules"]);
    assert!(v["knock_room_state"][0]["signatures"].is_object());
    assert_eq!(
        n.server
            .projections
            .membership
            .get(&knockable, bob)
            .unwrap()
            .membership,
        "knock"
    );
    // A join sent to send_knock is not a knock.
    let (_, made) = n
        .fed(
            &remote,
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/make_join/{}/{}?ver=10",
                enc(&public),
                enc("@carol:remote.test")
            ),
            None,
        )
        .await;
    let join = Pdu::sign_template(made["event"].clone(), "10", &remote, 1_700_000_000_000).unwrap();
    let (status, v) = n
        .fed(
            &remote,
            reqwest::Method::PUT,
            &format!(
                "/_matrix/federation/v1/send_knock/{}/{}",
                enc(&public),
                enc(join.event_id.as_str())
            ),
            Some(join.federation_json()),
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (400, Some("M_BAD_JSON")),
        "{v}"
    );
}

struct OneSrv(String, u16);

impl spindle_federation::client::SrvResolver for OneSrv {
    fn lookup(
        &self,
        name: String,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Vec<spindle_federation::client::SrvRecord>>
                + Send
                + '_,
        >,
    > {
        let hit = name == format!("_matrix-fed._tcp.{}", self.0);
        let port = self.1;
        Box::pin(async move {
            if hit {
                vec![spindle_federation::client::SrvRecord {
                    target: "localhost".into(),
                    port,
                    priority: 0,
                    weight: 0,
                }]
            } else {
                vec![]
            }
        })
    }
}

#[tokio::test]
async fn a_server_name_without_a_port_is_reached_through_its_srv_record() {
    // B is named `srv-b.test` (no port, no DNS) and listens for federation on port P;
    // only the SRV record `_matrix-fed._tcp.srv-b.test -> localhost:P` says where.
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(dir.path());
    let mut config = spindle::Config {
        server_name: "srv-b.test".into(),
        bind: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().to_path_buf(),
        rate_limits: spindle::config::RateLimits::lifted(),
        ..Default::default()
    };
    config.federation.tls_bind = format!("127.0.0.1:{port}");
    config.federation.tls_certificate_path = cert;
    config.federation.tls_private_key_path = key;
    let b = Node::start(config, dir, "srv-b.test".into()).await;
    let bob = b.register("bob").await;
    let room = b
        .create_room(
            &bob,
            json!({ "preset": "public_chat", "name": "Found by SRV" }),
        )
        .await;
    b.publish(&bob, &room).await;
    let ours = std::sync::Arc::new(ServerKey::generate("srv-a.test"));
    b.pin(&ours);
    let fed_config = spindle_federation::FederationConfig {
        dangerous_skip_tls_verification_for_tests: true,
        ip_range_allowlist: vec!["127.0.0.0/8".into()],
        ..Default::default()
    };
    let client = spindle_federation::FederationClient::with_srv_resolver(
        ours,
        &fed_config,
        std::sync::Arc::new(OneSrv("srv-b.test".into(), port)),
    )
    .unwrap();
    let resolved = client.resolve("srv-b.test").await.unwrap();
    assert_eq!(resolved.base_url, format!("https://srv-b.test:{port}"));
    assert_eq!(resolved.srv_target, Some(format!("localhost:{port}")));
    // A signed request for `srv-b.test` reaches B through the SRV target.
    let out = client
        .request(
            reqwest::Method::GET,
            "srv-b.test",
            "/_matrix/federation/v1/publicRooms",
            None,
        )
        .await
        .unwrap();
    assert_eq!(room_ids(&out["chunk"]), vec![room]);
    assert_eq!(out["chunk"][0]["name"], "Found by SRV");
}

/// A `/.well-known/matrix/server` host on loopback TLS whose answer `mode` selects: 0
/// redirects twice to a delegation, 1 redirects to itself forever, 2 redirects to a
/// plain `http` URL.
async fn well_known_host(mode: u8) -> (u16, tempfile::TempDir) {
    use axum::{response::Redirect, routing::get};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(dir.path());
    let port = free_port();
    let app = axum::Router::new()
        .route(
            "/.well-known/matrix/server",
            get(move || async move {
                match mode {
                    0 => Redirect::temporary("/hop"),
                    1 => Redirect::temporary("/.well-known/matrix/server"),
                    _ => Redirect::temporary(&format!("http://localhost:{port}/real")),
                }
            }),
        )
        .route("/hop", get(|| async { Redirect::permanent("/real") }))
        .route(
            "/real",
            get(|| async {
                (
                    [("cache-control", "public, max-age=600")],
                    axum::Json(json!({ "m.server": "delegated.test:4321" })),
                )
            }),
        );
    let tls = axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
        .await
        .unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    tokio::spawn(axum_server::bind_rustls(addr, tls).serve(app.into_make_service()));
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    (port, dir)
}

#[tokio::test]
async fn well_known_follows_redirects_on_https_and_stops_at_a_loop() {
    let mut resolved = Vec::new();
    for mode in [0u8, 1, 2] {
        let (port, _dir) = well_known_host(mode).await;
        let fed_config = spindle_federation::FederationConfig {
            dangerous_skip_tls_verification_for_tests: true,
            ip_range_allowlist: vec!["127.0.0.0/8".into(), "::1/128".into()],
            ..Default::default()
        };
        let client = spindle_federation::FederationClient::with_srv_resolver(
            std::sync::Arc::new(ServerKey::generate("wk-a.test")),
            &fed_config,
            std::sync::Arc::new(OneSrv("nothing.test".into(), 1)),
        )
        .unwrap()
        .with_well_known_port(port);
        resolved.push(client.resolve("localhost").await.unwrap().base_url);
    }
    assert_eq!(
        resolved,
        vec![
            // Two redirects, then the delegation (with a port: used as is).
            "https://delegated.test:4321".to_owned(),
            // A redirect loop, and a redirect off https: no delegation, port 8448.
            "https://localhost:8448".to_owned(),
            "https://localhost:8448".to_owned(),
        ]
    );
}

impl Node {
    /// The device id of `token`.
    async fn device_of(&self, token: &str) -> String {
        let (_, v) = self
            .client(
                reqwest::Method::GET,
                "/_matrix/client/v3/account/whoami",
                Some(token),
                None,
            )
            .await;
        v["device_id"].as_str().unwrap().to_owned()
    }

    /// Incremental syncs from `since` until `found` picks something out of one (10 s at
    /// most); returns it and the next `since`.
    async fn sync_until(
        &self,
        token: &str,
        since: &str,
        found: impl Fn(&Value) -> Option<Value>,
    ) -> (Value, String) {
        let mut since = since.to_owned();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let (status, v) = self
                .client(
                    reqwest::Method::GET,
                    &format!("/_matrix/client/v3/sync?timeout=500&since={}", enc(&since)),
                    Some(token),
                    None,
                )
                .await;
            assert_eq!(status, 200, "{v}");
            since = v["next_batch"].as_str().unwrap().to_owned();
            if let Some(hit) = found(&v) {
                return (hit, since);
            }
            assert!(std::time::Instant::now() < deadline, "not seen in 10 s");
        }
    }

    async fn typing(&self, token: &str, room: &str, who: &str, on: bool) {
        let (status, v) = self
            .client(
                reqwest::Method::PUT,
                &format!("/_matrix/client/v3/rooms/{}/typing/{}", enc(room), enc(who)),
                Some(token),
                Some(json!({ "typing": on, "timeout": 30000 })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }

    async fn since(&self, token: &str) -> String {
        let (_, v) = self
            .client(
                reqwest::Method::GET,
                "/_matrix/client/v3/sync?timeout=0",
                Some(token),
                None,
            )
            .await;
        v["next_batch"].as_str().unwrap().to_owned()
    }
}

/// The content of the room's ephemeral event of `kind` in a sync answer, if any.
fn ephemeral(v: &Value, room: &str, kind: &str) -> Option<Value> {
    v["rooms"]["join"][room]["ephemeral"]["events"]
        .as_array()?
        .iter()
        .find(|e| e["type"] == kind)
        .map(|e| e["content"].clone())
}

#[tokio::test]
async fn typing_receipts_presence_and_to_device_cross_between_servers_both_ways() {
    let a = Node::federating(|_| {}).await;
    let b = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let (alice_id, bob_id) = (format!("@alice:{}", a.name), format!("@bob:{}", b.name));
    let bob_device = b.device_of(&bob).await;
    let room = a
        .create_room(&alice, json!({ "preset": "public_chat" }))
        .await;
    let (status, v) = b
        .client(
            reqwest::Method::POST,
            &format!(
                "/_matrix/client/v3/join/{}?server_name={}",
                enc(&room),
                enc(&a.name)
            ),
            Some(&bob),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let mut msgs = Vec::new();
    for i in 0..2 {
        let (status, v) = a
            .client(
                reqwest::Method::PUT,
                &format!(
                    "/_matrix/client/v3/rooms/{}/send/m.room.message/m{i}",
                    enc(&room)
                ),
                Some(&alice),
                Some(json!({ "msgtype": "m.text", "body": format!("m{i}") })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        msgs.push(v["event_id"].as_str().unwrap().to_owned());
    }
    let a_since = a.since(&alice).await;
    // Bob's server has both messages before anything is asserted about them.
    let b_since = b.since(&bob).await;
    let (_, b_since) = b
        .sync_until(&bob, &b_since, |v| {
            b.server
                .projections
                .timeline
                .event(&msgs[1])
                .map(|_| v.clone())
        })
        .await;

    // Typing, A -> B, then B -> A.
    a.typing(&alice, &room, &alice_id, true).await;
    let (seen, b_since) = b
        .sync_until(&bob, &b_since, |v| ephemeral(v, &room, "m.typing"))
        .await;
    assert_eq!(seen["user_ids"], json!([alice_id]));
    a.typing(&alice, &room, &alice_id, false).await;
    let (seen, b_since) = b
        .sync_until(&bob, &b_since, |v| ephemeral(v, &room, "m.typing"))
        .await;
    assert_eq!(seen["user_ids"], json!([]));
    b.typing(&bob, &room, &bob_id, true).await;
    let (seen, a_since) = a
        .sync_until(&alice, &a_since, |v| {
            ephemeral(v, &room, "m.typing").filter(|c| c["user_ids"] != json!([]))
        })
        .await;
    assert_eq!(seen["user_ids"], json!([bob_id]));

    // Receipts, B -> A: the private one stays home, the public one crosses.
    for (kind, event) in [("m.read.private", &msgs[0]), ("m.read", &msgs[1])] {
        let (status, v) = b
            .client(
                reqwest::Method::POST,
                &format!(
                    "/_matrix/client/v3/rooms/{}/receipt/{kind}/{}",
                    enc(&room),
                    enc(event)
                ),
                Some(&bob),
                Some(json!({})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    let (seen, a_since) = a
        .sync_until(&alice, &a_since, |v| ephemeral(v, &room, "m.receipt"))
        .await;
    let receipts = seen.as_object().unwrap();
    assert_eq!(
        receipts.keys().collect::<Vec<_>>(),
        vec![&msgs[1]],
        "{seen}"
    );
    let ts = &seen[&msgs[1]]["m.read"][&bob_id]["ts"];
    assert!(ts.as_u64().is_some(), "{seen}");

    // To-device, A -> B's device.
    let (status, v) = a
        .client(
            reqwest::Method::PUT,
            "/_matrix/client/v3/sendToDevice/m.test/t1",
            Some(&alice),
            Some(json!({ "messages": { &bob_id: { &bob_device: { "secret": 42 } } } })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let (seen, b_since) = b
        .sync_until(&bob, &b_since, |v| {
            v["to_device"]["events"]
                .as_array()
                .filter(|e| !e.is_empty())
                .map(|e| json!(e))
        })
        .await;
    assert_eq!(
        seen,
        json!([{ "sender": alice_id, "type": "m.test", "content": { "secret": 42 } }])
    );

    // Bob renaming his device reaches alice's server as a device list update.
    let (status, v) = b
        .client(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/devices/{}", enc(&bob_device)),
            Some(&bob),
            Some(json!({ "display_name": "Bob's phone" })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let (changed, _) = a
        .sync_until(&alice, &a_since, |v| {
            v["device_lists"]["changed"]
                .as_array()
                .filter(|c| !c.is_empty())
                .map(|c| json!(c))
        })
        .await;
    assert_eq!(changed, json!([bob_id]));
    // And the other way: alice was in the room before bob's server joined (her
    // membership came to it as imported state), and her rename still reaches bob.
    let alice_device = a.device_of(&alice).await;
    let (status, v) = a
        .client(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/devices/{}", enc(&alice_device)),
            Some(&alice),
            Some(json!({ "display_name": "Alice's laptop" })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    // Bob's own rename since his last sync is listed too (spec: one's own devices);
    // it may come in an earlier response than alice's, so the set is gathered over
    // the polls until alice is in it.
    let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
    b.sync_until(&bob, &b_since, |v| {
        let mut seen = seen.lock().unwrap();
        for u in v["device_lists"]["changed"]
            .as_array()
            .into_iter()
            .flatten()
        {
            seen.insert(u.as_str().unwrap().to_owned());
        }
        seen.contains(&alice_id).then_some(Value::Null)
    })
    .await;
    let changed: Vec<String> = seen.into_inner().unwrap().into_iter().collect();
    assert_eq!(changed, [alice_id.clone(), bob_id.clone()]);

    // Presence, A -> B.
    let (status, v) = a
        .client(
            reqwest::Method::PUT,
            &format!("/_matrix/client/v3/presence/{}/status", enc(&alice_id)),
            Some(&alice),
            Some(json!({ "presence": "online", "status_msg": "lunch" })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = b
        .client(
            reqwest::Method::GET,
            "/_matrix/client/v3/sync?timeout=0",
            Some(&bob),
            None,
        )
        .await;
    assert_eq!(status, 200);
    let since = v["next_batch"].as_str().unwrap().to_owned();
    let found = |v: &Value| {
        v["presence"]["events"]
            .as_array()?
            .iter()
            .find(|e| e["sender"] == alice_id.as_str() && e["content"]["status_msg"] == "lunch")
            .cloned()
    };
    let seen = match found(&v) {
        Some(s) => s,
        None => b.sync_until(&bob, &since, found).await.0,
    };
    assert_eq!(seen["content"]["presence"], "online");
    let sender = &a.server.federation_sender.as_ref().unwrap().stats;
    assert!(sender.edus.load(std::sync::atomic::Ordering::Relaxed) >= 4);
}

#[tokio::test]
async fn create_room_invites_users_of_other_servers_through_their_servers() {
    let a = Node::federating(|_| {}).await;
    let b = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    let bob = b.register("bob").await;
    let bob_id = format!("@bob:{}", b.name);
    let b_since = b.since(&bob).await;
    let room = a
        .create_room(
            &alice,
            json!({ "preset": "trusted_private_chat", "is_direct": true, "invite": [bob_id] }),
        )
        .await;
    // Bob's server has the invite, flagged direct.
    let (invite, _) = b
        .sync_until(&bob, &b_since, |v| v["rooms"]["invite"].get(&room).cloned())
        .await;
    let own = invite["invite_state"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "m.room.member" && e["state_key"] == bob_id.as_str())
        .cloned()
        .unwrap();
    assert_eq!(own["content"]["membership"], "invite");
    assert_eq!(own["content"]["is_direct"], true);
    // The stripped state lists bob's own member event once, last (A leaves it out of
    // `invite_room_state`; B adds it, as Synapse does).
    let listed: Vec<(String, String)> = invite["invite_state"]["events"]
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
    let alice_id = format!("@alice:{}", a.name);
    assert_eq!(
        listed,
        vec![
            ("m.room.create".to_owned(), String::new()),
            ("m.room.join_rules".to_owned(), String::new()),
            ("m.room.member".to_owned(), alice_id),
            ("m.room.member".to_owned(), bob_id.clone()),
        ]
    );
    let head = a.server.journal.durable_head();
    assert!(
        a.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );
    let members = |user: &str| {
        a.server
            .projections
            .membership
            .get(&room, user)
            .map(|m| m.membership)
    };
    assert_eq!(members(&bob_id).as_deref(), Some("invite"));

    // Trusted private chat: the invitee gets the creator's power.
    let (_, pl) = a
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.power_levels/",
                enc(&room)
            ),
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(pl["users"][&bob_id], 100, "{pl}");
    // An invitee whose server cannot be reached: the invite is withdrawn and the room
    // still made.
    let nobody = "@nobody:localhost:1";
    let other = a
        .create_room(
            &alice,
            json!({ "preset": "private_chat", "invite": [nobody] }),
        )
        .await;
    let head = a.server.journal.durable_head();
    assert!(
        a.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );
    let m = a.server.projections.membership.get(&other, nobody).unwrap();
    assert_eq!(
        (m.membership.as_str(), m.sender.as_str()),
        ("leave", format!("@alice:{}", a.name).as_str())
    );
}

/// `createRoom` asks its remote invitees' servers at once (at most 8 at a time), not
/// one after another: three servers that accept the connection and never answer see
/// all three connections open together. Each is then cut; the invites are withdrawn in
/// the order they were asked for.
#[tokio::test]
async fn create_room_asks_the_invitees_servers_at_once() {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };
    let a = Node::federating(|_| {}).await;
    let alice = a.register("alice").await;
    // Three silent servers: each holds its connections until all three servers hold
    // one (or 5 s pass), then drops them. `most`: the most servers holding a
    // connection at once (servers, not connections: a client may retry on a server).
    // `first`: how the first release came, 1 all three holding, 2 a server's 5 s ran
    // out (asked one after another, the first server waits alone).
    let open = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let first = Arc::new(AtomicUsize::new(0));
    let (release, released) = tokio::sync::watch::channel(false);
    let release = Arc::new(release);
    let mut invitees = Vec::new();
    for i in 0..3 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        invitees.push(format!("@silent{i}:localhost:{port}"));
        let (open, most, release) = (open.clone(), most.clone(), release.clone());
        let first = first.clone();
        let mut released = released.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((conn, _)) = accepted else { return };
                        held.push(conn);
                        if held.len() == 1 {
                            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            if now >= 3 {
                                let _ = first.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst);
                                release.send_replace(true);
                            }
                        }
                    }
                    _ = released.wait_for(|all| *all), if !held.is_empty() => {
                        open.fetch_sub(1, Ordering::SeqCst);
                        held.clear();
                    }
                    _ = tokio::time::sleep(std::time::Duration::from_secs(5)), if !held.is_empty() => {
                        let _ = first.compare_exchange(0, 2, Ordering::SeqCst, Ordering::SeqCst);
                        open.fetch_sub(1, Ordering::SeqCst);
                        held.clear();
                    }
                }
            }
        });
    }
    let room = a
        .create_room(
            &alice,
            json!({ "preset": "private_chat", "invite": invitees.clone() }),
        )
        .await;
    assert_eq!(
        (first.load(Ordering::SeqCst), most.load(Ordering::SeqCst)),
        (1, 3)
    );
    let head = a.server.journal.durable_head();
    assert!(
        a.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );
    // Appended in the request's order, withdrawn in the request's order.
    let (status, v) = a
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{}/messages?dir=b&limit=50",
                enc(&room)
            ),
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let mut changes: Vec<(String, String)> = v["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["type"] == "m.room.member" && e["state_key"] != json!(format!("@alice:{}", a.name))
        })
        .map(|e| {
            (
                e["state_key"].as_str().unwrap().to_owned(),
                e["content"]["membership"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    changes.reverse();
    let want: Vec<(String, String)> = ["invite", "leave"]
        .iter()
        .flat_map(|m| invitees.iter().map(move |u| (u.clone(), m.to_string())))
        .collect();
    assert_eq!(changes, want);
}

impl Node {
    /// `POST /join/{room}?server_name=` as `token`: the status and the answer.
    async fn join_via(&self, token: &str, room: &str, via: &str) -> (u16, Value) {
        self.client(
            reqwest::Method::POST,
            &format!(
                "/_matrix/client/v3/join/{}?server_name={}",
                enc(room),
                enc(via)
            ),
            Some(token),
            Some(json!({})),
        )
        .await
    }

    /// Sends a text message; returns its event id.
    async fn say(&self, token: &str, room: &str, txn: &str, body: &str) -> String {
        let (status, v) = self
            .client(
                reqwest::Method::PUT,
                &format!(
                    "/_matrix/client/v3/rooms/{}/send/m.room.message/{txn}",
                    enc(room)
                ),
                Some(token),
                Some(json!({ "msgtype": "m.text", "body": body })),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["event_id"].as_str().unwrap().to_owned()
    }

    /// The sorted user ids of `/joined_members` (answers from partial state).
    async fn joined_ids(&self, token: &str, room: &str) -> Vec<String> {
        let (status, v) = self
            .client(
                reqwest::Method::GET,
                &format!("/_matrix/client/v3/rooms/{}/joined_members", enc(room)),
                Some(token),
                None,
            )
            .await;
        assert_eq!(status, 200, "{v}");
        let mut ids: Vec<String> = v["joined"].as_object().unwrap().keys().cloned().collect();
        ids.sort();
        ids
    }

    fn partial_stats(&self) -> (u64, u64, u64) {
        let s = self.server.journal.stats();
        let l = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        (
            l(&s.partial_state_joins),
            l(&s.partial_state_completed),
            l(&s.partial_state_sends),
        )
    }
}

/// MSC3902 (joining server) against MSC3706 (resident), both Spindle: bob on B joins
/// alice's six-member room on A with partial state. The resync is held back (delay of
/// an hour) so the partial state can be looked at, then run by hand.
#[tokio::test]
async fn a_partial_state_join_sends_at_once_accepts_unknown_members_and_completes() {
    let a = Node::federating(|_| {}).await;
    let b = Node::federating(|c| c.federation.partial_state_resync_delay_ms = 3_600_000).await;
    let alice = a.register("alice").await;
    // Bob (on B) may kick: a moderator who does not know the room's members yet.
    let room = a
        .create_room(
            &alice,
            json!({
                "preset": "public_chat", "name": "Partial",
                "power_level_content_override": { "users": {
                    format!("@alice:{}", a.name): 100, format!("@bob:{}", b.name): 50,
                } },
            }),
        )
        .await;
    let mut members = vec![format!("@alice:{}", a.name)];
    let mut tokens = Vec::new();
    for i in 0..5 {
        let t = a.register(&format!("m{i}")).await;
        let (status, v) = a.join_via(&t, &room, &a.name).await;
        assert_eq!(status, 200, "{v}");
        members.push(format!("@m{i}:{}", a.name));
        tokens.push(t);
    }
    let bob = b.register("bob").await;
    let bob_id = format!("@bob:{}", b.name);
    let (status, v) = b.join_via(&bob, &room, &a.name).await;
    assert_eq!(status, 200, "{v}");
    assert!(b.server.journal.is_partial_state(&room).await);
    assert!(b.server.projections.state.is_partial(&room));
    assert_eq!(b.partial_stats(), (1, 0, 0));
    // Partial: the creator (its join is in the power levels' auth chain) and bob.
    let mut partial = vec![format!("@alice:{}", a.name), bob_id.clone()];
    partial.sort();
    let mut held: Vec<String> = b
        .server
        .projections
        .membership
        .members(&room)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(u, _)| u)
        .collect();
    held.sort();
    assert_eq!(held, partial);
    // Bob sends at once; the event reaches A although B knows few of its members.
    let sent = b.say(&bob, &room, "p1", "hello while partial").await;
    assert_eq!(b.partial_stats(), (1, 0, 1));
    // m3, unknown to B, speaks: B fetches m3's join through /event_auth and accepts it.
    let m3_said = a.say(&tokens[3], &room, "m3", "hi bob").await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let ids = |v: &Value| -> Vec<String> {
        v["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap().to_owned())
            .collect()
    };
    loop {
        let (_, v) = b
            .client(
                reqwest::Method::GET,
                &format!(
                    "/_matrix/client/v3/rooms/{}/messages?dir=b&limit=5",
                    enc(&room)
                ),
                Some(&bob),
                None,
            )
            .await;
        if ids(&v).contains(&m3_said) {
            assert_eq!(ids(&v)[..2], [m3_said.clone(), sent.clone()]);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "m3's message did not reach B: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (_, v) = a
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{}/event/{}",
                enc(&room),
                enc(&sent)
            ),
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(v["content"]["body"], "hello while partial", "{v}");
    // While partial, B lets no other server join through it.
    let stranger = ServerKey::generate(REMOTE);
    b.pin(&stranger);
    let path = format!(
        "/_matrix/federation/v1/make_join/{}/{}?ver=10",
        enc(&room),
        enc("@x:remote.test")
    );
    let (status, v) = b.fed(&stranger, reqwest::Method::GET, &path, None).await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (404, Some("M_NOT_FOUND")),
        "{v}"
    );
    let since = b.since(&bob).await;
    // The resync, by hand: A's /state at bob's join. A `/joined_members` and a
    // long-polling `/sync` asked while the room is partial answer once it completes:
    // the first with every member, the second woken by the completion (a liveness
    // bound of 20 s against the poll's 60 s, not a speed check).
    let join_id = b.server.journal.partial_state_rooms().await[0]
        .join_event_id
        .clone();
    let joined_path = format!("/_matrix/client/v3/rooms/{}/joined_members", enc(&room));
    let long_poll = async {
        let mut since = since.clone();
        loop {
            let (status, v) = b
                .client(
                    reqwest::Method::GET,
                    &format!(
                        "/_matrix/client/v3/sync?timeout=60000&since={}",
                        enc(&since)
                    ),
                    Some(&bob),
                    None,
                )
                .await;
            assert_eq!(status, 200, "{v}");
            since = v["next_batch"].as_str().unwrap().to_owned();
            if v["rooms"]["join"][&room]["state"]["events"]
                .as_array()
                .is_some_and(|e| !e.is_empty())
            {
                return v;
            }
        }
    };
    // Bob kicks m4, whom the partial state does not know: the kick waits for the full
    // state instead of failing its "is the target in the room" check.
    let m4 = format!("@m4:{}", a.name);
    let kick_path = format!("/_matrix/client/v3/rooms/{}/kick", enc(&room));
    let kick_body = json!({ "user_id": m4 });
    let ((waited_status, waited), polled, (kick_status, kicked), ()) =
        tokio::time::timeout(std::time::Duration::from_secs(20), async {
            tokio::join!(
                b.client(reqwest::Method::GET, &joined_path, Some(&bob), None),
                long_poll,
                b.client(
                    reqwest::Method::POST,
                    &kick_path,
                    Some(&bob),
                    Some(kick_body)
                ),
                async {
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    spindle_federation::partial::resync(
                        &b.server.federation,
                        &room,
                        &join_id,
                        vec![a.name.clone()],
                        None,
                    )
                    .await;
                }
            )
        })
        .await
        .expect("/joined_members or the long-poll did not answer after the completion");
    assert!(!b.server.journal.is_partial_state(&room).await);
    assert_eq!(b.partial_stats(), (1, 1, 1));
    assert_eq!((kick_status, &kicked), (200, &json!({})));
    // Everyone but m4, who was kicked; whether m4 is in the answers the kick raced
    // with (`/joined_members` and the long-poll woke at the same completion) is left
    // out of their checks.
    let mut all = members.clone();
    all.push(bob_id.clone());
    all.retain(|u| *u != m4);
    all.sort();
    let (status, v) = b
        .client(
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v3/rooms/{}/members?membership=join",
                enc(&room)
            ),
            Some(&bob),
            None,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let mut listed: Vec<String> = v["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state_key"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, all);
    assert_eq!(b.joined_ids(&bob, &room).await, all);
    assert_eq!(waited_status, 200, "{waited}");
    let mut waited: Vec<String> = waited["joined"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    waited.retain(|u| *u != m4);
    waited.sort();
    assert_eq!(waited, all);
    // The sync after the completion resends the room's whole state: the members B did
    // not have.
    let mut state: Vec<String> = polled["rooms"]["join"][&room]["state"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.member")
        .map(|e| e["state_key"].as_str().unwrap().to_owned())
        .filter(|u| *u != m4)
        .collect();
    state.sort();
    assert_eq!(state, all);
}
