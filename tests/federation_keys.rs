//! End-to-end encryption keys over federation (issue 13, part 2): the Server-Server
//! `user/keys/query`, `user/keys/claim` and `user/devices/{userId}`, and the
//! Client-Server `/keys/query` and `/keys/claim` asking other servers for their users.
//!
//! Two in-process Spindle servers on loopback, each named `localhost:PORT` with a TLS
//! federation listener on that port and a self-signed certificate made with the
//! `openssl` command (as in `tests/federation_features.rs`). Every answer is checked
//! with exact values.

mod common;

use common::{Client, TestKey, TestServer, enc};
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
        spindle_projections::device_keys::DeviceKeys::open(&a.srv.server.projections.db, &a.name)
            .unwrap();
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

/// Appends `fact` on `node` as its federation layer would and waits until the
/// projections have it.
async fn journal_fact(node: &Node, fact: spindle_journal::Fact) {
    let out = node
        .srv
        .server
        .federation
        .submit_journal("remote.test", spindle_journal::CommandBody::Fact { fact })
        .await
        .unwrap();
    assert!(
        node.srv
            .server
            .projections
            .runtime
            .wait_for(out.position, std::time::Duration::from_secs(10))
            .await
    );
}

fn remote_update(
    stream_id: u64,
    device_id: &str,
    prev_id: &[u64],
    deleted: bool,
) -> spindle_journal::Fact {
    spindle_journal::Fact::RemoteDeviceListChanged {
        user_id: "@u:remote.test".into(),
        stream_id,
        device: Some(spindle_journal::RemoteDeviceUpdate {
            device_id: device_id.into(),
            prev_id: prev_id.to_vec(),
            deleted,
            keys: (!deleted)
                .then(|| json!({ "user_id": "@u:remote.test", "device_id": device_id })),
            display_name: None,
        }),
        signing_keys: None,
    }
}

fn remote_device(device_id: &str) -> spindle_journal::RemoteDevice {
    spindle_journal::RemoteDevice {
        device_id: device_id.into(),
        keys: Some(json!({ "user_id": "@u:remote.test", "device_id": device_id })),
        display_name: None,
    }
}

/// The device ids and stream id of the fresh copy of `@u:remote.test`, if fresh.
fn copy_of(node: &Node) -> Option<(u64, Vec<String>)> {
    node.srv
        .server
        .projections
        .device_keys
        .remote_device_list("@u:remote.test")
        .map(|l| {
            (
                l.stream_id,
                l.devices.into_iter().map(|d| d.device_id).collect(),
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_device_list_copy_follows_prev_id_chains_and_goes_stale_on_a_gap() {
    let a = Node::start().await;
    let resync =
        |stream_id: u64, devices: &[&str]| spindle_journal::Fact::RemoteDeviceListResynced {
            user_id: "@u:remote.test".into(),
            stream_id,
            devices: devices.iter().map(|d| remote_device(d)).collect(),
            master_key: Some(json!({ "user_id": "@u:remote.test", "usage": ["master"], "n": 1 })),
            self_signing_key: None,
        };
    // No copy: an update alone makes none.
    journal_fact(&a, remote_update(5, "X", &[4], false)).await;
    assert_eq!(copy_of(&a), None);
    journal_fact(&a, resync(10, &["A"])).await;
    assert_eq!(copy_of(&a), Some((10, vec!["A".into()])));
    // Chains (prev_id at or below the copy's stream id): applied.
    journal_fact(&a, remote_update(12, "B", &[10], false)).await;
    assert_eq!(copy_of(&a), Some((12, vec!["A".into(), "B".into()])));
    // Already held (stream id at or below the copy's): ignored.
    journal_fact(&a, remote_update(11, "C", &[9], false)).await;
    assert_eq!(copy_of(&a), Some((12, vec!["A".into(), "B".into()])));
    // A deletion that chains.
    journal_fact(&a, remote_update(15, "A", &[12], true)).await;
    assert_eq!(copy_of(&a), Some((15, vec!["B".into()])));
    // A signing key update replaces the master key of a fresh copy.
    journal_fact(
        &a,
        spindle_journal::Fact::RemoteDeviceListChanged {
            user_id: "@u:remote.test".into(),
            stream_id: 0,
            device: None,
            signing_keys: Some(spindle_journal::RemoteSigningKeys {
                master_key: Some(
                    json!({ "user_id": "@u:remote.test", "usage": ["master"], "n": 2 }),
                ),
                self_signing_key: None,
            }),
        },
    )
    .await;
    let list = a
        .srv
        .server
        .projections
        .device_keys
        .remote_device_list("@u:remote.test")
        .unwrap();
    assert_eq!(list.master_key.unwrap()["n"], 2);
    // A gap (prev_id 18 was never seen): stale, not served.
    journal_fact(&a, remote_update(20, "D", &[18], false)).await;
    assert_eq!(copy_of(&a), None);
    let meta = |a: &Node| {
        a.srv
            .server
            .projections
            .device_keys
            .remote_list_meta("@u:remote.test")
            .unwrap()
    };
    assert_eq!(
        meta(&a),
        spindle_projections::device_keys::RemoteListMeta {
            stream_id: 15,
            stale: true,
            seen: 20,
            devices: 1,
        }
    );
    // A resync answered before update 20 (stream 19) leaves the copy stale.
    journal_fact(&a, resync(19, &["B"])).await;
    assert_eq!(copy_of(&a), None);
    assert_eq!(meta(&a).stream_id, 19);
    // One at or after it is served.
    journal_fact(&a, resync(21, &["B", "D"])).await;
    assert_eq!(copy_of(&a), Some((21, vec!["B".into(), "D".into()])));
    // An update without prev_id never chains.
    journal_fact(&a, remote_update(22, "E", &[], false)).await;
    assert_eq!(copy_of(&a), None);
    // A record from before the copies existed (no change carried): stale as well.
    journal_fact(&a, resync(23, &["B"])).await;
    assert_eq!(copy_of(&a), Some((23, vec!["B".into()])));
    let old: spindle_journal::Fact = serde_json::from_value(json!({
        "type": "remote_device_list_changed", "user_id": "@u:remote.test", "stream_id": 24,
    }))
    .unwrap();
    journal_fact(&a, old).await;
    assert_eq!(copy_of(&a), None);
    // The device cap: a fetch keeps the first 1,000; a chained update adding one more
    // device makes the copy stale (it could not hold it), one changing a held device
    // applies.
    let many: Vec<String> = (0..1_001).map(|i| format!("D{i:04}")).collect();
    let names: Vec<&str> = many.iter().map(String::as_str).collect();
    journal_fact(&a, resync(30, &names)).await;
    let (stream, held) = copy_of(&a).unwrap();
    assert_eq!((stream, held.len()), (30, 1_000));
    assert_eq!(held.last().map(String::as_str), Some("D0999"));
    journal_fact(&a, remote_update(31, "D0005", &[30], false)).await;
    assert_eq!(copy_of(&a).map(|(s, d)| (s, d.len())), Some((31, 1_000)));
    journal_fact(&a, remote_update(32, "NEW", &[31], false)).await;
    assert_eq!(copy_of(&a), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_users_keys_are_answered_from_the_copy_even_with_their_server_down() {
    let (a, b) = (Node::start().await, Node::start().await);
    let alice = a.register("alice", "ALICEPHONE").await;
    let bob = b.register("bob", "BOBLAPTOP").await;
    let (alice_keys, _) = upload_keys(&alice, &[]).await;
    let (alice_master, ..) = cross_sign(&alice, &alice_keys).await;
    let room = alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "preset": "public_chat" }),
        )
        .await
        .ok()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    bob.post(
        &format!("{V3}/join/{}?server_name={}", enc(&room), enc(&a.name)),
        &json!({}),
    )
    .await
    .ok();
    let query = || async {
        bob.post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok()
    };
    // No copy yet: B asks A, and fetches alice's device list meanwhile.
    let first = query().await;
    assert_eq!(
        first["device_keys"][&alice.user_id]["ALICEPHONE"]["keys"],
        alice_keys["keys"]
    );
    let fresh = |want: &'static [&'static str]| {
        let b = &b;
        let user = alice.user_id.clone();
        async move {
            for _ in 0..100 {
                if let Some(l) = b
                    .srv
                    .server
                    .projections
                    .device_keys
                    .remote_device_list(&user)
                {
                    let ids: Vec<&str> = l.devices.iter().map(|d| d.device_id.as_str()).collect();
                    if ids == want && l.devices.iter().all(|d| d.keys.is_some()) {
                        return l;
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            panic!("B never held a fresh copy with keys of {want:?}");
        }
    };
    let copy = fresh(&["ALICEPHONE"]).await;
    assert_eq!(
        copy.devices[0].keys.as_ref().unwrap()["keys"],
        alice_keys["keys"]
    );
    assert_eq!(copy.master_key.as_ref(), Some(&alice_master));
    // Bob verifies alice: his user-signing key signs her master key from the copy; the
    // signature is kept on B and shown in his key queries.
    let (bm, bs, bu) = (TestKey::new(None), TestKey::new(None), TestKey::new(None));
    bob.post(
        &format!("{V3}/keys/device_signing/upload"),
        &json!({
            "master_key": cs_key(&bob.user_id, "master", &bm, &[]),
            "self_signing_key": cs_key(&bob.user_id, "self_signing", &bs, &[&bm]),
            "user_signing_key": cs_key(&bob.user_id, "user_signing", &bu, &[&bm]),
        }),
    )
    .await
    .ok();
    let alice_master_public = alice_master["keys"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .as_str()
        .unwrap()
        .to_owned();
    let signed = bu.sign(&bob.user_id, alice_master.clone());
    let up = bob
        .post(
            &format!("{V3}/keys/signatures/upload"),
            &json!({ alice.user_id.clone(): { alice_master_public: signed } }),
        )
        .await
        .ok();
    assert_eq!(up, json!({ "failures": {} }));
    assert_eq!(query().await["master_keys"][&alice.user_id], signed);
    // Alice adds a device: A's updates (the new device, then its keys) reach B, each
    // naming the previous change as `prev_id`, so B applies them to its copy without
    // fetching the list again: the one fetch is still the first.
    let tablet = a.login("alice", "ALICETABLET").await;
    let (tablet_keys, _) = upload_keys(&tablet, &[]).await;
    let copy = fresh(&["ALICEPHONE", "ALICETABLET"]).await;
    assert_eq!(
        copy.devices[1].keys.as_ref().unwrap()["keys"],
        tablet_keys["keys"]
    );
    assert_eq!(
        copy.stream_id,
        a.srv
            .server
            .projections
            .device_keys
            .device_list_stream_id(&alice.user_id)
    );
    let records = b.srv.server.journal.next_after(0, 100_000).await.unwrap();
    let kinds = |kind: &str| {
        records
            .iter()
            .filter_map(|r| r.fact())
            .filter(|f| serde_json::to_value(f).unwrap()["type"] == kind)
            .count()
    };
    assert_eq!(kinds("remote_device_list_resynced"), 1);
    assert_eq!(kinds("remote_device_list_changed"), 2);
    // With A down, B answers from its copy: no failure, both devices.
    let alice_id = alice.user_id.clone();
    a.srv.stop().await;
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(q["failures"], json!({}));
    assert_eq!(q["master_keys"][&alice_id], signed);
    let mut ids: Vec<&String> = q["device_keys"][&alice_id]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    ids.sort();
    assert_eq!(ids, ["ALICEPHONE", "ALICETABLET"]);
    assert_eq!(
        q["device_keys"][&alice_id]["ALICETABLET"]["keys"],
        tablet_keys["keys"]
    );
}

/// Bob on B and alice on A share a room; B holds a fresh copy of alice's list. Returns
/// (a, b, alice, bob, alice's device keys).
async fn two_nodes_with_a_copy() -> (Node, Node, Client, Client, Value) {
    // Names allowed over federation, so the copies' display names are checked too.
    let (a, b) = (
        Node::start_with_names(true).await,
        Node::start_with_names(true).await,
    );
    let alice = a.register("alice", "ALICEPHONE").await;
    let bob = b.register("bob", "BOBLAPTOP").await;
    let (alice_keys, _) = upload_keys(&alice, &[]).await;
    let room = alice
        .post(
            &format!("{V3}/createRoom"),
            &json!({ "preset": "public_chat" }),
        )
        .await
        .ok()["room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    bob.post(
        &format!("{V3}/join/{}?server_name={}", enc(&room), enc(&a.name)),
        &json!({}),
    )
    .await
    .ok();
    bob.post(
        &format!("{V3}/keys/query"),
        &json!({ "device_keys": { alice.user_id.clone(): [] } }),
    )
    .await
    .ok();
    for _ in 0..100 {
        if b.srv
            .server
            .projections
            .device_keys
            .remote_device_list(&alice.user_id)
            .is_some()
        {
            return (a, b, alice, bob, alice_keys);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("no copy");
}

/// Polls bob's key query for alice until `ok` holds (10 s), returning the last answer.
async fn query_until(bob: &Client, alice: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..100 {
        last = bob
            .post(
                &format!("{V3}/keys/query"),
                &json!({ "device_keys": { alice: [] } }),
            )
            .await
            .ok();
        if ok(&last) {
            return last;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_keeps_the_devices_keys_in_the_remote_copy() {
    let (_a, b, alice, bob, alice_keys) = two_nodes_with_a_copy().await;
    rename_device(&alice, "Alice's phone").await;
    let q = query_until(&bob, &alice.user_id, |q| {
        q["device_keys"][&alice.user_id]["ALICEPHONE"]["unsigned"]["device_display_name"]
            == "Alice's phone"
    })
    .await;
    assert_eq!(
        q["device_keys"][&alice.user_id]["ALICEPHONE"],
        with_display_name(alice_keys, "Alice's phone"),
        "B's copy after alice renamed her device: {:?}",
        b.srv
            .server
            .projections
            .device_keys
            .remote_device_list(&alice.user_id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signature_reaches_the_remote_copy() {
    let (_a, _b, alice, bob, alice_keys) = two_nodes_with_a_copy().await;
    let (_, _, _, signed) = cross_sign(&alice, &alice_keys).await;
    let q = query_until(&bob, &alice.user_id, |q| {
        q["device_keys"][&alice.user_id]["ALICEPHONE"] == signed
    })
    .await;
    assert_eq!(q["device_keys"][&alice.user_id]["ALICEPHONE"], signed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_device_renamed_after_its_key_upload_keeps_its_keys_in_the_remote_copy() {
    let (a, _b, alice, bob, _) = two_nodes_with_a_copy().await;
    // Alice's tablet: created, keys uploaded, then renamed; each update chains onto
    // the last, so B applies them to its copy without fetching the list.
    let tablet = a.login("alice", "ALICETABLET").await;
    let (tablet_keys, _) = upload_keys(&tablet, &[]).await;
    rename_device(&tablet, "Tablet").await;
    let q = query_until(&bob, &alice.user_id, |q| {
        q["device_keys"][&alice.user_id]["ALICETABLET"]["unsigned"]["device_display_name"]
            == "Tablet"
    })
    .await;
    assert_eq!(
        q["device_keys"][&alice.user_id]["ALICETABLET"],
        with_display_name(tablet_keys, "Tablet")
    );
}

/// Review finding: once no user of ours shares a room with alice, her server stops
/// sending us her changes, so the copy must not be served (also after bob rejoins or
/// starts a new room with her): the room losing its last local member makes the copies
/// of its remote members stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_we_leave_the_last_shared_room_the_copy_is_not_served() {
    let (a, b, alice, bob, _) = two_nodes_with_a_copy().await;
    let rooms = bob.get(&format!("{V3}/joined_rooms")).await.ok();
    let room = rooms["joined_rooms"][0].as_str().unwrap().to_owned();
    bob.post(&format!("{V3}/rooms/{}/leave", enc(&room)), &json!({}))
        .await
        .ok();
    // A no longer sends B alice's changes (no shared room): her new device.
    let tablet = a.login("alice", "ALICETABLET").await;
    upload_keys(&tablet, &[]).await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    let mut ids: Vec<&String> = q["device_keys"][&alice.user_id]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    ids.sort();
    assert!(
        b.srv
            .server
            .projections
            .device_keys
            .remote_device_list(&alice.user_id)
            .is_none()
    );
    assert_eq!(
        ids,
        ["ALICEPHONE", "ALICETABLET"],
        "copy on B: {:?}",
        b.srv
            .server
            .projections
            .device_keys
            .remote_device_list(&alice.user_id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_device_list_updates_neither_fail_nor_poison_the_copy() {
    // Here B (bob's server) sends A malformed and hostile EDUs about bob (and about
    // users not his server's); A holds a copy of bob's list.
    let (b, a, bob, alice, bob_keys) = two_nodes_with_a_copy().await;
    let before = a
        .srv
        .server
        .projections
        .device_keys
        .remote_device_list(&bob.user_id)
        .unwrap();
    let s = before.stream_id;
    let upd = |c: Value| json!({ "edu_type": "m.device_list_update", "content": c });
    let u = bob.user_id.clone();
    let edus = vec![
        upd(json!({ "user_id": u, "device_id": "X", "stream_id": s + 1, "prev_id": "nope" })),
        upd(json!({ "user_id": u, "device_id": 5, "stream_id": "7", "prev_id": [s] })),
        upd(
            json!({ "user_id": u, "device_id": "Y", "stream_id": -3, "prev_id": [9007199254740991_u64, -1, "x"] }),
        ),
        upd(
            json!({ "user_id": u, "device_id": "Z", "stream_id": s + 2, "prev_id": [s],
            "keys": { "user_id": alice.user_id, "device_id": "Z" } }),
        ),
        upd(
            json!({ "user_id": u, "device_id": "NOPE", "stream_id": s + 3, "prev_id": [s + 2], "deleted": true }),
        ),
        upd(
            json!({ "user_id": alice.user_id, "device_id": "EVIL", "stream_id": 1, "prev_id": [] }),
        ),
        upd(json!({ "user_id": "@nobody:elsewhere.test", "device_id": "EVIL", "stream_id": 1 })),
        upd(json!("not an object")),
        json!({ "edu_type": "m.signing_key_update", "content": { "user_id": u, "master_key": "str" } }),
        json!({ "edu_type": "m.signing_key_update", "content": { "user_id": u,
            "master_key": { "user_id": alice.user_id, "usage": ["master"], "keys": {} } } }),
    ];
    let (status, v) = b
        .ask(
            &a,
            reqwest::Method::PUT,
            "/_matrix/federation/v1/send/hostile1",
            Some(&json!({ "origin": b.name, "origin_server_ts": 1, "pdus": [], "edus": edus })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let q = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { bob.user_id.clone(): [], alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    // The first update did not chain: the copy is stale, and stays so (the origin's
    // list is older than updates it claimed), so the query asked the origin, which
    // answered the real keys; nothing was kept for our own user (who has none).
    assert_eq!(
        a.srv
            .server
            .projections
            .device_keys
            .remote_device_list(&bob.user_id),
        None
    );
    assert_eq!(
        q["device_keys"],
        json!({ bob.user_id.clone(): { "ALICEPHONE": bob_keys }, alice.user_id.clone(): {} }),
    );
    assert_eq!(q["failures"], json!({}));
    assert_eq!(q["master_keys"], json!({}));
}
