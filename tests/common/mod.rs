#![allow(missing_docs, unreachable_pub)] // Shared test helpers, not a public API.
//! Shared helpers for the integration tests: an in-process server on a temporary data
//! directory with an ephemeral port, and a tiny Client-Server API client over reqwest.
//!
//! Every request made through [`Client`] panics on a 5xx answer: no test may observe a
//! server error (`M_UNKNOWN` 500 is reserved for server-side failures).

#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use reqwest::{Method, header::HeaderMap};
use serde_json::{Value, json};

/// The server name every test server uses.
pub const SERVER_NAME: &str = "localhost:8008";

/// A user id on the test server.
pub fn uid(localpart: &str) -> String {
    format!("@{localpart}:{SERVER_NAME}")
}

/// Percent-encodes one path segment or query value (everything but RFC 3986 unreserved).
pub fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An HTTP client that never uses a proxy (tests talk to loopback only).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("reqwest client")
}

/// An in-process server on a fresh temporary data directory.
pub struct TestServer {
    pub server: spindle::Server,
    pub dir: tempfile::TempDir,
    pub base: String,
    pub http: reqwest::Client,
}

impl TestServer {
    /// Starts a server with the default configuration on `127.0.0.1:0`.
    pub async fn start() -> TestServer {
        Self::start_with(|_| {}).await
    }

    /// Starts a server after `f` adjusted the configuration.
    pub async fn start_with(f: impl FnOnce(&mut spindle::Config)) -> TestServer {
        let clock = std::sync::Arc::new(spindle_api::ratelimit::SystemClock::default());
        Self::start_with_clock(clock, f).await
    }

    /// [`TestServer::start_with`] with the rate limiters on `clock`.
    pub async fn start_with_clock(
        clock: std::sync::Arc<dyn spindle_api::ratelimit::Clock>,
        f: impl FnOnce(&mut spindle::Config),
    ) -> TestServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = spindle::Config {
            bind: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().join("data"),
            log: "warn".into(),
            // Tests send bursts no public server should accept; the rate-limit tests
            // turn the limits they test back on.
            rate_limits: spindle::config::RateLimits::lifted(),
            ..Default::default()
        };
        f(&mut config);
        let server = spindle::Server::start_with_clock(config, clock)
            .await
            .expect("server starts");
        let base = format!("http://{}", server.addr);
        TestServer {
            server,
            dir,
            base,
            http: http(),
        }
    }

    /// A client with no access token.
    pub fn anon(&self) -> Client {
        Client::anon(&self.base, self.http.clone())
    }

    /// Registers `localpart` (password `"password-<localpart>"`) and returns its client.
    pub async fn register(&self, localpart: &str) -> Client {
        register(&self.base, &self.http, localpart).await
    }

    /// Logs `localpart` in again on a new device.
    pub async fn login(&self, localpart: &str, device_id: Option<&str>) -> Client {
        login(&self.base, &self.http, localpart, device_id).await
    }

    pub async fn stop(self) {
        self.server.stop().await;
    }
}

/// A response: status, parsed JSON body (or `Null`), raw text and headers.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub body: Value,
    pub text: String,
    pub headers: HeaderMap,
}

impl Resp {
    /// The `errcode` field, if any.
    pub fn errcode(&self) -> Option<&str> {
        self.body.get("errcode").and_then(|v| v.as_str())
    }

    /// Panics unless the status is 200; returns the body.
    pub fn ok(self) -> Value {
        assert_eq!(
            self.status, 200,
            "expected 200, got {}: {}",
            self.status, self.text
        );
        self.body
    }

    /// Panics unless status and errcode are as given.
    pub fn expect_err(&self, status: u16, errcode: &str) {
        assert_eq!(
            (self.status, self.errcode()),
            (status, Some(errcode)),
            "expected {status} {errcode}, got {}: {}",
            self.status,
            self.text
        );
        assert!(
            self.body.get("error").is_some_and(|e| e.is_string()),
            "an error needs an `error` string: {}",
            self.text
        );
    }
}

static TXN: AtomicU64 = AtomicU64::new(1);

/// A fresh transaction id (unique in this test process).
pub fn txn() -> String {
    format!("txn{}", TXN.fetch_add(1, Ordering::Relaxed))
}

/// A Client-Server API client for one user and device.
#[derive(Clone)]
pub struct Client {
    pub http: reqwest::Client,
    pub base: String,
    pub token: Option<String>,
    pub user_id: String,
    pub device_id: String,
}

impl Client {
    /// A client with no access token.
    pub fn anon(base: &str, http: reqwest::Client) -> Client {
        Client {
            http,
            base: base.to_owned(),
            token: None,
            user_id: String::new(),
            device_id: String::new(),
        }
    }

    /// The same user and device with another token (or none).
    pub fn with_token(&self, token: Option<&str>) -> Client {
        Client {
            token: token.map(str::to_owned),
            ..self.clone()
        }
    }

    /// Sends raw bytes; `path` starts with `/`.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{}", self.base, path));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b);
        }
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp
            .text()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: reading body: {e}"));
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        if let Err(e) = no_duplicate_keys(&text) {
            panic!("{method} {path}: the answer is not strict JSON ({e}): {text}");
        }
        assert!(
            status < 500,
            "{method} {path} answered {status} (no test may observe a 5xx): {text}"
        );
        Resp {
            status,
            body,
            text,
            headers,
        }
    }

    /// Sends a JSON body (or none).
    pub async fn request(&self, method: Method, path: &str, body: Option<&Value>) -> Resp {
        self.raw(
            method,
            path,
            body.map(|b| serde_json::to_vec(b).unwrap()),
            &[],
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.request(Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Resp {
        self.request(Method::POST, path, Some(body)).await
    }

    pub async fn put(&self, path: &str, body: &Value) -> Resp {
        self.request(Method::PUT, path, Some(body)).await
    }

    /// `POST /createRoom`; returns the room id.
    pub async fn create_room(&self, body: Value) -> String {
        let v = self.post("/_matrix/client/v3/createRoom", &body).await.ok();
        v["room_id"].as_str().expect("room_id").to_owned()
    }

    /// `PUT /send/{type}/{txn}` (raw response).
    pub async fn send_txn(&self, room: &str, kind: &str, txn_id: &str, content: &Value) -> Resp {
        self.put(
            &format!(
                "/_matrix/client/v3/rooms/{}/send/{}/{}",
                enc(room),
                enc(kind),
                enc(txn_id)
            ),
            content,
        )
        .await
    }

    /// Sends an `m.room.message` text; returns its event id.
    pub async fn send_text(&self, room: &str, body: &str) -> String {
        let v = self
            .send_txn(
                room,
                "m.room.message",
                &txn(),
                &json!({ "msgtype": "m.text", "body": body }),
            )
            .await
            .ok();
        v["event_id"].as_str().expect("event_id").to_owned()
    }

    /// Sends an `m.reaction` (`m.annotation` of `event_id` with `key`); returns its id.
    pub async fn react(&self, room: &str, event_id: &str, key: &str) -> String {
        let v = self
            .send_txn(
                room,
                "m.reaction",
                &txn(),
                &json!({ "m.relates_to": { "rel_type": "m.annotation", "event_id": event_id, "key": key } }),
            )
            .await
            .ok();
        v["event_id"].as_str().expect("event_id").to_owned()
    }

    /// Redacts `event_id` (`PUT /redact/{eventId}/{txnId}`, no reason); returns the
    /// redaction's id.
    pub async fn redact(&self, room: &str, event_id: &str) -> String {
        let v = self
            .put(
                &format!(
                    "/_matrix/client/v3/rooms/{}/redact/{}/{}",
                    enc(room),
                    enc(event_id),
                    txn()
                ),
                &json!({}),
            )
            .await
            .ok();
        v["event_id"].as_str().expect("event_id").to_owned()
    }

    /// `PUT /state/{type}/{key}`; returns the event id.
    pub async fn put_state(
        &self,
        room: &str,
        kind: &str,
        state_key: &str,
        content: Value,
    ) -> String {
        // An empty state key goes without the trailing slash (see the ignored
        // `empty_state_key_with_trailing_slash_*` test in invariants.rs).
        let path = if state_key.is_empty() {
            format!("/_matrix/client/v3/rooms/{}/state/{}", enc(room), enc(kind))
        } else {
            format!(
                "/_matrix/client/v3/rooms/{}/state/{}/{}",
                enc(room),
                enc(kind),
                enc(state_key)
            )
        };
        let v = self.put(&path, &content).await.ok();
        v["event_id"].as_str().expect("event_id").to_owned()
    }

    pub async fn invite(&self, room: &str, user: &str) {
        self.post(
            &format!("/_matrix/client/v3/rooms/{}/invite", enc(room)),
            &json!({ "user_id": user }),
        )
        .await
        .ok();
    }

    pub async fn join(&self, room: &str) {
        self.post(
            &format!("/_matrix/client/v3/rooms/{}/join", enc(room)),
            &json!({}),
        )
        .await
        .ok();
    }

    pub async fn leave(&self, room: &str) {
        self.post(
            &format!("/_matrix/client/v3/rooms/{}/leave", enc(room)),
            &json!({}),
        )
        .await
        .ok();
    }

    /// `GET /sync?<query>` (query already encoded, may be empty); 200 body.
    pub async fn sync(&self, query: &str) -> Value {
        self.get(&format!("/_matrix/client/v3/sync?{query}"))
            .await
            .ok()
    }

    /// `GET /rooms/{id}/messages?<query>` (raw response).
    pub async fn messages_resp(&self, room: &str, query: &str) -> Resp {
        self.get(&format!(
            "/_matrix/client/v3/rooms/{}/messages?{query}",
            enc(room)
        ))
        .await
    }

    /// `GET /rooms/{id}/messages?<query>`; 200 body.
    pub async fn messages(&self, room: &str, query: &str) -> Value {
        self.messages_resp(room, query).await.ok()
    }

    /// `GET /rooms/{id}/event/{eid}` (raw response).
    pub async fn event(&self, room: &str, event_id: &str) -> Resp {
        self.get(&format!(
            "/_matrix/client/v3/rooms/{}/event/{}",
            enc(room),
            enc(event_id)
        ))
        .await
    }

    /// `GET /rooms/{id}/context/{eid}?limit=<limit>` (raw response).
    pub async fn context(&self, room: &str, event_id: &str, limit: u32) -> Resp {
        self.get(&format!(
            "/_matrix/client/v3/rooms/{}/context/{}?limit={limit}",
            enc(room),
            enc(event_id)
        ))
        .await
    }

    /// Every event id of a room, oldest first, as this user sees it through `/messages`.
    pub async fn all_event_ids(&self, room: &str) -> Vec<String> {
        ids(&self.messages(room, "dir=f&limit=1000").await["chunk"])
    }
}

/// Event ids of a JSON array of events.
pub fn ids(events: &Value) -> Vec<String> {
    events
        .as_array()
        .unwrap_or_else(|| panic!("expected an array of events, got {events}"))
        .iter()
        .map(|e| e["event_id"].as_str().expect("event_id").to_owned())
        .collect()
}

/// Registers through user-interactive auth: the first POST answers 401 with a
/// session, the second completes `m.login.dummy` with it.
pub async fn register(base: &str, http: &reqwest::Client, localpart: &str) -> Client {
    let anon = Client::anon(base, http.clone());
    let password = format!("password-{localpart}");
    let first = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": localpart, "password": password }),
        )
        .await;
    assert_eq!(first.status, 401, "UIA challenge: {}", first.text);
    let session = first.body["session"]
        .as_str()
        .expect("UIA session")
        .to_owned();
    assert!(
        first.body["flows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["stages"] == json!(["m.login.dummy"])),
        "m.login.dummy flow offered: {}",
        first.text
    );
    let done = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({
                "username": localpart,
                "password": password,
                "auth": { "type": "m.login.dummy", "session": session },
            }),
        )
        .await
        .ok();
    assert_eq!(done["user_id"], json!(uid(localpart)));
    Client {
        http: http.clone(),
        base: base.to_owned(),
        token: Some(done["access_token"].as_str().unwrap().to_owned()),
        user_id: done["user_id"].as_str().unwrap().to_owned(),
        device_id: done["device_id"].as_str().unwrap().to_owned(),
    }
}

/// Logs in with the password [`register`] set.
pub async fn login(
    base: &str,
    http: &reqwest::Client,
    localpart: &str,
    device_id: Option<&str>,
) -> Client {
    let anon = Client::anon(base, http.clone());
    let mut body = json!({
        "type": "m.login.password",
        "identifier": { "type": "m.id.user", "user": localpart },
        "password": format!("password-{localpart}"),
    });
    if let Some(d) = device_id {
        body["device_id"] = json!(d);
    }
    let v = anon.post("/_matrix/client/v3/login", &body).await.ok();
    Client {
        http: http.clone(),
        base: base.to_owned(),
        token: Some(v["access_token"].as_str().unwrap().to_owned()),
        user_id: v["user_id"].as_str().unwrap().to_owned(),
        device_id: v["device_id"].as_str().unwrap().to_owned(),
    }
}

/// The position of a sync token `s<pos>_<typing>`.
pub fn sync_pos(next_batch: &str) -> u64 {
    next_batch
        .strip_prefix('s')
        .and_then(|r| r.split('_').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("not a sync token: {next_batch}"))
}

/// Removes every `unsigned.age` and every presence `last_active_ago` (they depend on
/// the clock) from a JSON document.
pub fn strip_age(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(Value::Object(u)) = map.get_mut("unsigned") {
                u.remove("age");
            }
            if map.get("type").and_then(|t| t.as_str()) == Some("m.presence")
                && let Some(Value::Object(c)) = map.get_mut("content")
            {
                c.remove("last_active_ago");
            }
            for (_, x) in map.iter_mut() {
                strip_age(x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(strip_age),
        _ => {}
    }
}

/// Timeline event ids of a room in a sync response (empty if the room is absent).
pub fn sync_timeline_ids(sync: &Value, section: &str, room: &str) -> Vec<String> {
    match sync["rooms"][section].get(room) {
        Some(r) => ids(&r["timeline"]["events"]),
        None => vec![],
    }
}

/// An ed25519 key pair for a device or a cross-signing key in tests, with its unpadded
/// base64 public key.
pub struct TestKey {
    pub pair: ruma::signatures::Ed25519KeyPair,
    pub public: String,
}

impl TestKey {
    /// A fresh key whose key id version is `version` (a device id, or the public key
    /// for cross-signing keys when `version` is `None`).
    pub fn new(version: Option<&str>) -> TestKey {
        use base64::Engine as _;
        let doc = ruma::signatures::Ed25519KeyPair::generate();
        let probe = ruma::signatures::Ed25519KeyPair::from_der(&doc, "x".into()).unwrap();
        let public = base64::engine::general_purpose::STANDARD_NO_PAD.encode(probe.public_key());
        let version = version.map(str::to_owned).unwrap_or_else(|| public.clone());
        TestKey {
            pair: ruma::signatures::Ed25519KeyPair::from_der(&doc, version).unwrap(),
            public,
        }
    }

    /// Signs `object` as `signer` (adds to its `signatures`).
    pub fn sign(&self, signer: &str, object: Value) -> Value {
        let mut canonical = match ruma::CanonicalJsonValue::try_from(object.clone()).unwrap() {
            ruma::CanonicalJsonValue::Object(o) => o,
            _ => panic!("not an object"),
        };
        ruma::signatures::sign_json(signer, &self.pair, &mut canonical).unwrap();
        let mut out = object;
        out["signatures"] = serde_json::to_value(&canonical["signatures"]).unwrap();
        out
    }
}

/// The signed `DeviceKeys` object of `client`'s device, with its ed25519 key.
pub fn device_keys(client: &Client) -> (Value, TestKey) {
    let key = TestKey::new(Some(&client.device_id));
    let keys = json!({
        "user_id": client.user_id,
        "device_id": client.device_id,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {
            format!("curve25519:{}", client.device_id): format!("curve-{}", client.device_id),
            format!("ed25519:{}", client.device_id): key.public,
        },
    });
    (key.sign(&client.user_id, keys), key)
}

/// Removes `age` from every `unsigned` object in `v` (it differs between two requests
/// for the same event).
pub fn strip_ages(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(Value::Object(u)) = map.get_mut("unsigned") {
                u.remove("age");
            }
            map.values_mut().for_each(strip_ages);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_ages),
        _ => {}
    }
}

/// Checks that JSON text has no object with the same key twice (`serde_json` keeps the
/// last one silently, so a duplicate would pass every other assertion). Text that is not
/// JSON at all passes (non-JSON answers are checked by their own tests). Answers
/// assembled from text pieces (`api/src/json_text.rs`) rely on this being checked.
pub fn no_duplicate_keys(text: &str) -> Result<(), String> {
    use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

    struct Strict;
    impl<'de> Deserialize<'de> for Strict {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Strict, D::Error> {
            d.deserialize_any(StrictVisitor)
        }
    }
    struct StrictVisitor;
    impl<'de> Visitor<'de> for StrictVisitor {
        type Value = Strict;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<Strict, E> {
            Ok(Strict)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Strict, E> {
            Ok(Strict)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Strict, E> {
            Ok(Strict)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Strict, E> {
            Ok(Strict)
        }
        fn visit_str<E>(self, _: &str) -> Result<Strict, E> {
            Ok(Strict)
        }
        fn visit_unit<E>(self) -> Result<Strict, E> {
            Ok(Strict)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
            while seq.next_element::<Strict>()?.is_some() {}
            Ok(Strict)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
            let mut keys = std::collections::HashSet::new();
            while let Some(k) = map.next_key::<String>()? {
                map.next_value::<Strict>()?;
                if !keys.insert(k.clone()) {
                    return Err(A::Error::custom(format!("duplicate key {k:?}")));
                }
            }
            Ok(Strict)
        }
    }
    if serde_json::from_str::<serde::de::IgnoredAny>(text).is_err() {
        return Ok(());
    }
    serde_json::from_str::<Strict>(text)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
