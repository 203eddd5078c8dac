//! End-to-end encryption keys over federation (issue 13, part 2): the Server-Server
//! `user/keys/query`, `user/keys/claim` and `user/devices/{userId}`, and the
//! Client-Server `/keys/query` and `/keys/claim` asking other servers for their users.
//!
//! Two in-process Spindle servers on loopback, each named `localhost:PORT` with a TLS
//! federation listener on that port and a self-signed certificate made with the
//! `openssl` command (as in `tests/federation_features.rs`). Every answer is checked
//! with exact values.

mod common;

use common::{Client, TestKey, TestServer};
use serde_json::{Value, json};

const V3: &str = "/_matrix/client/v3";

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

/// One federating server and its name.
struct Node {
    srv: TestServer,
    name: String,
    _certs: tempfile::TempDir,
}

impl Node {
    /// A node with the default configuration (device names hidden from other servers).
    async fn start() -> Node {
        Node::start_with_names(false).await
    }

    /// A node that shows (`allow_names`) or hides its users' device display names over
    /// federation (`[federation] allow_device_name_lookup_over_federation`).
    async fn start_with_names(allow_names: bool) -> Node {
        let certs = tempfile::tempdir().unwrap();
        let (cert, key) = make_cert(certs.path());
        let port = free_port();
        let name = format!("localhost:{port}");
        let srv = TestServer::start_with(|c| {
            c.server_name = name.clone();
            c.federation.tls_bind = format!("127.0.0.1:{port}");
            c.federation.tls_certificate_path = cert;
            c.federation.tls_private_key_path = key;
            c.federation.dangerous_skip_tls_verification_for_tests = true;
            c.federation.ip_range_allowlist = vec!["127.0.0.0/8".into()];
            c.federation.allow_device_name_lookup_over_federation = allow_names;
        })
        .await;
        Node {
            srv,
            name,
            _certs: certs,
        }
    }

    fn uid(&self, localpart: &str) -> String {
        format!("@{localpart}:{}", self.name)
    }

    /// Registers `localpart` with a device named `device_id`.
    async fn register(&self, localpart: &str, device_id: &str) -> Client {
        let anon = self.srv.anon();
        let v = anon
            .post(
                &format!("{V3}/register"),
                &json!({
                    "username": localpart,
                    "password": "pw",
                    "device_id": device_id,
                    "auth": { "type": "m.login.dummy" },
                }),
            )
            .await
            .ok();
        assert_eq!(v["user_id"], json!(self.uid(localpart)));
        Client {
            token: Some(v["access_token"].as_str().unwrap().to_owned()),
            user_id: v["user_id"].as_str().unwrap().to_owned(),
            device_id: v["device_id"].as_str().unwrap().to_owned(),
            ..anon
        }
    }

    /// Logs `localpart` in on a new device `device_id`.
    async fn login(&self, localpart: &str, device_id: &str) -> Client {
        let anon = self.srv.anon();
        let v = anon
            .post(
                &format!("{V3}/login"),
                &json!({
                    "type": "m.login.password",
                    "identifier": { "type": "m.id.user", "user": localpart },
                    "password": "pw",
                    "device_id": device_id,
                }),
            )
            .await
            .ok();
        Client {
            token: Some(v["access_token"].as_str().unwrap().to_owned()),
            user_id: v["user_id"].as_str().unwrap().to_owned(),
            device_id: v["device_id"].as_str().unwrap().to_owned(),
            ..anon
        }
    }

    /// A request signed by this server to `destination`'s Server-Server API: the
    /// status and the answer (an error status is returned, not panicked on).
    async fn ask(
        &self,
        destination: &Node,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        match self
            .srv
            .server
            .federation
            .client
            .request(method, &destination.name, path, body)
            .await
        {
            Ok(v) => (200, v),
            Err(spindle_federation::client::ClientError::Status { status, body, .. }) => {
                (status, serde_json::from_str(&body).unwrap())
            }
            Err(e) => panic!("{path}: {e}"),
        }
    }
}

/// Uploads `client`'s signed device keys, `otks` one-time keys `signed_curve25519:<id>`
/// and a fallback key `signed_curve25519:FB1`; returns the device keys and the device key.
async fn upload_keys(client: &Client, otks: &[&str]) -> (Value, TestKey) {
    let (keys, key) = common::device_keys(client);
    let mut one_time = serde_json::Map::new();
    for id in otks {
        let k = key.sign(&client.user_id, json!({ "key": format!("otk-{id}") }));
        one_time.insert(format!("signed_curve25519:{id}"), k);
    }
    let fallback = key.sign(
        &client.user_id,
        json!({ "key": "fallback-1", "fallback": true }),
    );
    let up = client
        .post(
            &format!("{V3}/keys/upload"),
            &json!({
                "device_keys": keys,
                "one_time_keys": one_time,
                "fallback_keys": { "signed_curve25519:FB1": fallback },
            }),
        )
        .await
        .ok();
    assert_eq!(
        up,
        json!({ "one_time_key_counts": { "signed_curve25519": otks.len() } })
    );
    (keys, key)
}

/// A cross-signing key object of `usage` for `user`, signed by `signers`.
fn cs_key(user: &str, usage: &str, key: &TestKey, signers: &[&TestKey]) -> Value {
    let mut v = json!({
        "user_id": user,
        "usage": [usage],
        "keys": { format!("ed25519:{}", key.public): key.public },
    });
    for s in signers {
        v = s.sign(user, v);
    }
    v
}

/// Uploads master, self-signing and user-signing keys for `client` and signs its
/// device (`keys`) with the self-signing key. Returns the three key objects and the
/// device's keys as served (with the self-signing signature merged in).
async fn cross_sign(client: &Client, keys: &Value) -> (Value, Value, Value, Value) {
    let (master, ssk, usk) = (TestKey::new(None), TestKey::new(None), TestKey::new(None));
    let master_obj = cs_key(&client.user_id, "master", &master, &[]);
    let ssk_obj = cs_key(&client.user_id, "self_signing", &ssk, &[&master]);
    let usk_obj = cs_key(&client.user_id, "user_signing", &usk, &[&master]);
    client
        .post(
            &format!("{V3}/keys/device_signing/upload"),
            &json!({ "master_key": master_obj, "self_signing_key": ssk_obj, "user_signing_key": usk_obj }),
        )
        .await
        .ok();
    let signed_device = ssk.sign(&client.user_id, keys.clone());
    let up = client
        .post(
            &format!("{V3}/keys/signatures/upload"),
            &json!({ client.user_id.clone(): { client.device_id.clone(): signed_device } }),
        )
        .await
        .ok();
    assert_eq!(up, json!({ "failures": {} }));
    (master_obj, ssk_obj, usk_obj, signed_device)
}

async fn rename_device(client: &Client, name: &str) {
    client
        .put(
            &format!("{V3}/devices/{}", client.device_id),
            &json!({ "display_name": name }),
        )
        .await
        .ok();
}

fn with_display_name(mut keys: Value, name: &str) -> Value {
    keys["unsigned"] = json!({ "device_display_name": name });
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_a_remote_user_are_queried_from_their_server_with_exact_values() {
    // A shows device names to other servers (off by default; see the test after).
    let (a, b) = (Node::start_with_names(true).await, Node::start().await);
    let alice = a.register("alice", "ALICEPHONE").await;
    let bob = b.register("bob", "BOBLAPTOP").await;
    let (alice_keys, _) = upload_keys(&alice, &[]).await;
    let (master, ssk, _usk, alice_signed) = cross_sign(&alice, &alice_keys).await;
    rename_device(&alice, "Alice's phone").await;
    let (bob_keys, _) = upload_keys(&bob, &[]).await;

    // Bob (on B) asks for Alice (on A): B asks A; the user-signing key stays Alice's.
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(
        q,
        json!({
            "device_keys": { alice.user_id.clone(): {
                "ALICEPHONE": with_display_name(alice_signed.clone(), "Alice's phone"),
            } },
            "master_keys": { alice.user_id.clone(): master },
            "self_signing_keys": { alice.user_id.clone(): ssk },
            "user_signing_keys": {},
            "failures": {},
        })
    );
    // Naming devices: only those; an unknown device is left out.
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): ["NOPE"] } }),
        )
        .await
        .ok();
    assert_eq!(q["device_keys"], json!({ alice.user_id.clone(): {} }));

    // And the other way round, with a local user in the same request.
    let carol = a.register("carol", "CAROLDESK").await;
    let (carol_keys, _) = upload_keys(&carol, &[]).await;
    let q = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { bob.user_id.clone(): [], carol.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(
        q["device_keys"],
        json!({
            bob.user_id.clone(): { "BOBLAPTOP": bob_keys },
            carol.user_id.clone(): { "CAROLDESK": carol_keys },
        })
    );
    assert_eq!(q["failures"], json!({}));

    // Served as the spec says to a server asking directly: our users only (another
    // server's user is ignored), never a user-signing key.
    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::POST,
            "/_matrix/federation/v1/user/keys/query",
            Some(&json!({ "device_keys": {
                alice.user_id.clone(): ["ALICEPHONE"],
                bob.user_id.clone(): [],
                "@nobody:elsewhere.example": [],
            } })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v,
        json!({
            "device_keys": { alice.user_id.clone(): {
                "ALICEPHONE": with_display_name(alice_signed, "Alice's phone"),
            } },
            "master_keys": { alice.user_id.clone(): master },
            "self_signing_keys": { alice.user_id.clone(): ssk },
        })
    );
    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::POST,
            "/_matrix/federation/v1/user/keys/query",
            Some(&json!({ "device_keys": "nope" })),
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (400, Some("M_BAD_JSON")));
}

/// By default (`allow_device_name_lookup_over_federation = false`, as in Synapse) no
/// device display name leaves the server: not in `user/keys/query`, not in
/// `user/devices`, so not in a remote client's `/keys/query` either. The owner still
/// sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_display_names_stay_home_by_default() {
    let (a, b) = (Node::start().await, Node::start().await);
    let alice = a.register("alice", "ALICEPHONE").await;
    let bob = b.register("bob", "BOBLAPTOP").await;
    let (alice_keys, _) = upload_keys(&alice, &[]).await;
    rename_device(&alice, "Alice's phone").await;

    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::POST,
            "/_matrix/federation/v1/user/keys/query",
            Some(&json!({ "device_keys": { alice.user_id.clone(): [] } })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v,
        json!({
            "device_keys": { alice.user_id.clone(): { "ALICEPHONE": alice_keys.clone() } },
            "master_keys": {},
            "self_signing_keys": {},
        })
    );
    let path = format!(
        "/_matrix/federation/v1/user/devices/{}",
        common::enc(&alice.user_id)
    );
    let (status, v) = b.ask(&a, reqwest::Method::GET, &path, None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["devices"],
        json!([{ "device_id": "ALICEPHONE", "keys": alice_keys.clone() }])
    );
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(
        q["device_keys"],
        json!({ alice.user_id.clone(): { "ALICEPHONE": alice_keys } })
    );
    let own = alice.get(&format!("{V3}/devices/ALICEPHONE")).await.ok();
    assert_eq!(own["display_name"], "Alice's phone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_claim_hands_out_each_one_time_key_once_then_the_fallback_key() {
    let (a, b) = (Node::start().await, Node::start().await);
    let alice = a.register("alice", "ALICEPHONE").await;
    let bob = b.register("bob", "BOBLAPTOP").await;
    let (_, key) = upload_keys(&alice, &["K000", "K001"]).await;
    let claim = json!({ "one_time_keys": { alice.user_id.clone(): { "ALICEPHONE": "signed_curve25519" } } });
    let mut got = Vec::new();
    for _ in 0..4 {
        let c = bob.post(&format!("{V3}/keys/claim"), &claim).await.ok();
        assert_eq!(c["failures"], json!({}), "{c}");
        got.push(c["one_time_keys"].clone());
    }
    let one = |id: &str, body: Value| {
        json!({ alice.user_id.clone(): { "ALICEPHONE": {
            format!("signed_curve25519:{id}"): key.sign(&alice.user_id, body),
        } } })
    };
    assert_eq!(
        got,
        vec![
            one("K000", json!({ "key": "otk-K000" })),
            one("K001", json!({ "key": "otk-K001" })),
            one("FB1", json!({ "key": "fallback-1", "fallback": true })),
            one("FB1", json!({ "key": "fallback-1", "fallback": true })),
        ]
    );
    // The claims went through A's journal: Alice's count is down to zero and her
    // fallback key is used.
    let s = alice.sync("").await;
    assert_eq!(
        s["device_one_time_keys_count"],
        json!({ "signed_curve25519": 0 })
    );
    assert_eq!(s["device_unused_fallback_key_types"], json!([]));

    // Asked directly: another server's users are ignored, an unknown device gets
    // nothing, and the answer holds only what was claimed.
    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::POST,
            "/_matrix/federation/v1/user/keys/claim",
            Some(&json!({ "one_time_keys": {
                alice.user_id.clone(): { "NOPE": "signed_curve25519" },
                bob.user_id.clone(): { "BOBLAPTOP": "signed_curve25519" },
            } })),
        )
        .await;
    assert_eq!((status, v), (200, json!({ "one_time_keys": {} })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_devices_lists_keys_and_a_stream_id_that_grows_with_each_device_change() {
    let (a, b) = (Node::start_with_names(true).await, Node::start().await);
    let alice = a.register("alice", "ALICEPHONE").await;
    let (alice_keys, _) = upload_keys(&alice, &[]).await;
    let (master, ssk, _usk, alice_signed) = cross_sign(&alice, &alice_keys).await;
    rename_device(&alice, "Alice's phone").await;
    let path = format!(
        "/_matrix/federation/v1/user/devices/{}",
        common::enc(&alice.user_id)
    );
    let (status, v) = b.ask(&a, reqwest::Method::GET, &path, None).await;
    assert_eq!(status, 200, "{v}");
    let first = v["stream_id"].as_u64().unwrap();
    assert!(first > 0, "{v}");
    assert_eq!(
        v,
        json!({
            "user_id": alice.user_id,
            "stream_id": first,
            "devices": [{
                "device_id": "ALICEPHONE",
                "keys": alice_signed,
                "device_display_name": "Alice's phone",
            }],
            "master_key": master,
            "self_signing_key": ssk,
        })
    );
    // The version is the position of the latest device change, so it is in the past
    // of the journal.
    assert!(first <= a.srv.server.journal.durable_head());

    // Changes that are not device changes leave it: one-time keys, a room joined.
    let otk = TestKey::new(Some("ALICEPHONE")).sign(&alice.user_id, json!({ "key": "k" }));
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "one_time_keys": { "signed_curve25519:X": otk } }),
        )
        .await
        .ok();
    alice.create_room(json!({})).await;
    let (_, v) = b.ask(&a, reqwest::Method::GET, &path, None).await;
    assert_eq!(v["stream_id"].as_u64(), Some(first));

    // A new device with keys: listed, and the version grows.
    let tablet = a.login("alice", "ALICETABLET").await;
    let (tablet_keys, _) = upload_keys(&tablet, &[]).await;
    let (_, v) = b.ask(&a, reqwest::Method::GET, &path, None).await;
    let second = v["stream_id"].as_u64().unwrap();
    assert!(second > first, "{first} then {second}");
    let ids: Vec<&str> = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["device_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["ALICEPHONE", "ALICETABLET"]);
    assert_eq!(v["devices"][1]["keys"], tablet_keys);
    // Renaming a device is a change too (its name is part of what is served).
    rename_device(&tablet, "Tablet").await;
    let (_, v) = b.ask(&a, reqwest::Method::GET, &path, None).await;
    let third = v["stream_id"].as_u64().unwrap();
    assert!(third > second, "{second} then {third}");
    assert_eq!(v["devices"][1]["device_display_name"], "Tablet");
    // More joins since than one page of the user's log: a cold reader (a fresh
    // projection handle over the same tables, nothing in memory) finds the same
    // version, reading back past them.
    for _ in 0..70 {
        tablet.create_room(json!({})).await;
    }
    let (_, v) = b.ask(&a, reqwest::Method::GET, &path, None).await;
    assert_eq!(v["stream_id"].as_u64(), Some(third));
    let cold =
        spindle_projections::device_keys::DeviceKeys::open(&a.srv.server.projections.db).unwrap();
    assert_eq!(cold.device_list_stream_id(&alice.user_id), third);
    assert_eq!(cold.device_list_stream_id(&a.uid("nobody")), 0);

    // Not ours: 400; ours but unknown: 404.
    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/user/devices/{}",
                common::enc(&b.uid("bob"))
            ),
            None,
        )
        .await;
    assert_eq!(
        (status, v["errcode"].as_str()),
        (400, Some("M_INVALID_PARAM"))
    );
    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::GET,
            &format!(
                "/_matrix/federation/v1/user/devices/{}",
                common::enc(&a.uid("nobody"))
            ),
            None,
        )
        .await;
    assert_eq!((status, v["errcode"].as_str()), (404, Some("M_NOT_FOUND")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_or_silent_server_is_listed_in_failures_and_the_others_answered() {
    let (a, b) = (Node::start().await, Node::start().await);
    let alice = a.register("alice", "ALICEPHONE").await;
    let bob = b.register("bob", "BOBLAPTOP").await;
    let (alice_keys, _) = upload_keys(&alice, &["K000"]).await;
    // Nothing listens on `dead`; `silent` accepts connections and never answers.
    let dead = format!("localhost:{}", free_port());
    let silent_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = format!("localhost:{}", silent_listener.local_addr().unwrap().port());
    let (ghost, mute) = (format!("@ghost:{dead}"), format!("@mute:{silent}"));

    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({
                "device_keys": { alice.user_id.clone(): [], ghost.clone(): [], mute.clone(): [] },
                "timeout": 1500,
            }),
        )
        .await
        .ok();
    assert_eq!(
        q["device_keys"],
        json!({ alice.user_id.clone(): { "ALICEPHONE": alice_keys } })
    );
    let mut both = vec![&dead, &silent];
    both.sort();
    let failures = q["failures"].as_object().unwrap();
    assert_eq!(failures.keys().collect::<Vec<_>>(), both, "{q}");
    assert_eq!(failures[&dead]["status"], 503);
    assert_eq!(
        failures[&silent],
        json!({ "status": 503, "message": "no answer within 1500 ms" })
    );

    let c = bob
        .post(
            &format!("{V3}/keys/claim"),
            &json!({
                "one_time_keys": {
                    alice.user_id.clone(): { "ALICEPHONE": "signed_curve25519" },
                    ghost.clone(): { "D": "signed_curve25519" },
                    mute.clone(): { "D": "signed_curve25519" },
                },
                "timeout": 1500,
            }),
        )
        .await
        .ok();
    assert_eq!(
        c["one_time_keys"][&alice.user_id]["ALICEPHONE"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        vec!["signed_curve25519:K000"]
    );
    assert_eq!(
        c["failures"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        both
    );
    drop(silent_listener);

    // A bad timeout is a Matrix error.
    bob.post(
        &format!("{V3}/keys/query"),
        &json!({ "device_keys": { ghost: [] }, "timeout": "soon" }),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_federation_off_remote_users_are_failures() {
    let srv = TestServer::start_with(|c| c.federation.enabled = false).await;
    let alice = srv.register("alice").await;
    let body = json!({ "device_keys": { "@bob:elsewhere.example": [] } });
    let q = alice.post(&format!("{V3}/keys/query"), &body).await.ok();
    assert_eq!(
        q["failures"],
        json!({ "elsewhere.example": { "status": 503, "message": "federation is disabled on this server" } })
    );
    assert_eq!(q["device_keys"], json!({}));
    let c = alice
        .post(
            &format!("{V3}/keys/claim"),
            &json!({ "one_time_keys": { "@bob:elsewhere.example": { "D": "signed_curve25519" } } }),
        )
        .await
        .ok();
    assert_eq!(
        c,
        json!({
            "one_time_keys": {},
            "failures": { "elsewhere.example": { "status": 503, "message": "federation is disabled on this server" } },
        })
    );
}
