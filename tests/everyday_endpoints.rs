//! The smaller Client-Server endpoints everyday clients call (issue 3): TURN
//! credentials, third-party protocol lookups, OpenID tokens, registration-token
//! validity, support contacts, user reports, extended profiles and mutual rooms,
//! asserted with exact values.

mod common;

use common::{TestServer, enc, uid};
use reqwest::Method;
use serde_json::{Value, json};

const C3: &str = "/_matrix/client/v3";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_server_hands_out_turn_rest_credentials() {
    let ts = TestServer::start_with(|c| {
        c.voip.turn_uris = vec![
            "turn:turn.example.org:3478?transport=udp".into(),
            "turns:turn.example.org:5349?transport=tcp".into(),
        ];
        c.voip.turn_shared_secret = "n0t-a-secret".into();
        c.voip.turn_ttl_s = 600;
    })
    .await;
    let alice = ts.register("alice").await;
    let before_s = spindle_api::now_ms() / 1000;
    let turn = alice.get(&format!("{C3}/voip/turnServer")).await.ok();
    let after_s = spindle_api::now_ms() / 1000;
    let username = turn["username"].as_str().unwrap();
    let (expiry, user) = username.split_once(':').unwrap();
    let expiry: u64 = expiry.parse().unwrap();
    assert_eq!(user, "@alice:localhost:8008");
    assert!(
        (before_s + 600..=after_s + 600).contains(&expiry),
        "expiry {expiry} is not ttl after the request"
    );
    let (_, password) =
        spindle_api::voip::turn_rest_credentials("n0t-a-secret", "@alice:localhost:8008", expiry);
    assert_eq!(
        turn,
        json!({
            "username": username,
            "password": password,
            "uris": [
                "turn:turn.example.org:3478?transport=udp",
                "turns:turn.example.org:5349?transport=tcp",
            ],
            "ttl": 600,
        })
    );
    ts.anon()
        .get(&format!("{C3}/voip/turnServer"))
        .await
        .expect_err(401, "M_MISSING_TOKEN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_server_static_credentials_and_none_configured() {
    let ts = TestServer::start_with(|c| {
        c.voip.turn_uris = vec!["turn:10.20.30.40:3478".into()];
        c.voip.turn_username = "calls".into();
        c.voip.turn_password = "hunter2".into();
    })
    .await;
    let alice = ts.register("alice").await;
    assert_eq!(
        alice.get(&format!("{C3}/voip/turnServer")).await.ok(),
        json!({
            "username": "calls",
            "password": "hunter2",
            "uris": ["turn:10.20.30.40:3478"],
            "ttl": 86400,
        })
    );
    ts.stop().await;

    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    alice
        .get(&format!("{C3}/voip/turnServer"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}

#[test]
fn voip_config_is_checked_at_start() {
    let err = spindle::Config::from_toml("[voip]\nturn_uris = [\"stun:x.org\"]\n").unwrap_err();
    assert!(err.contains("turn: or turns:"), "{err}");
    let err = spindle::Config::from_toml("[voip]\nturn_uris = [\"turn:x.org\"]\n").unwrap_err();
    assert!(err.contains("turn_shared_secret"), "{err}");
    let err =
        spindle::Config::from_toml("[[support.contacts]]\nrole = \"m.role.admin\"\n").unwrap_err();
    assert!(err.contains("matrix_id or an email_address"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn third_party_lookups_know_no_protocol() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice
        .create_room(json!({ "room_alias_name": "lobby" }))
        .await;
    assert!(room.starts_with('!'));
    let tp = format!("{C3}/thirdparty");
    assert_eq!(alice.get(&format!("{tp}/protocols")).await.ok(), json!({}));
    for path in ["protocol/irc", "location/irc", "user/irc"] {
        alice
            .get(&format!("{tp}/{path}"))
            .await
            .expect_err(404, "M_NOT_FOUND");
    }
    let lobby = enc("#lobby:localhost:8008");
    assert_eq!(
        alice
            .get(&format!("{tp}/location?alias={lobby}"))
            .await
            .ok(),
        json!([])
    );
    alice
        .get(&format!(
            "{tp}/location?alias={}",
            enc("#nowhere:localhost:8008")
        ))
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .get(&format!("{tp}/location?alias=lobby"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&format!("{tp}/location"))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    assert_eq!(
        alice
            .get(&format!("{tp}/user?userid={}", enc(&alice.user_id)))
            .await
            .ok(),
        json!([])
    );
    alice
        .get(&format!("{tp}/user?userid={}", enc(&uid("nobody"))))
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.anon()
        .get(&format!("{tp}/protocols"))
        .await
        .expect_err(401, "M_MISSING_TOKEN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openid_tokens_identify_their_user_until_deactivation() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let got = alice
        .post(
            &format!("{C3}/user/{}/openid/request_token", enc(&alice.user_id)),
            &json!({}),
        )
        .await
        .ok();
    let token = got["access_token"].as_str().unwrap().to_owned();
    assert!(token.starts_with("spo_") && token.len() == 44, "{token}");
    assert_eq!(
        got,
        json!({
            "access_token": token,
            "token_type": "Bearer",
            "matrix_server_name": "localhost:8008",
            "expires_in": 3600,
        })
    );
    let userinfo = |t: &str| format!("/_matrix/federation/v1/openid/userinfo?access_token={t}");
    let anon = ts.anon();
    assert_eq!(
        anon.get(&userinfo(&token)).await.ok(),
        json!({ "sub": "@alice:localhost:8008" })
    );
    // Not an access token: it opens no Client-Server endpoint.
    alice
        .with_token(Some(&token))
        .get(&format!("{C3}/account/whoami"))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    anon.get(&userinfo("spo_nonsense"))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    // No token: 401 `M_MISSING_TOKEN` (as Synapse), an empty one is unknown.
    anon.get("/_matrix/federation/v1/openid/userinfo")
        .await
        .expect_err(401, "M_MISSING_TOKEN");
    anon.get(&userinfo(""))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    bob.post(
        &format!("{C3}/user/{}/openid/request_token", enc(&alice.user_id)),
        &json!({}),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");

    // A deactivated account's tokens identify nobody.
    let auth = json!({
        "type": "m.login.password",
        "identifier": { "type": "m.id.user", "user": "alice" },
        "password": "password-alice",
    });
    alice
        .post(
            &format!("{C3}/account/deactivate"),
            &json!({ "auth": auth }),
        )
        .await
        .ok();
    anon.get(&userinfo(&token))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");

    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_token_validity_follows_the_configured_tokens() {
    let path = "/_matrix/client/v1/register/m.login.registration_token/validity";
    let ts = TestServer::start_with(|c| {
        c.registration.mode = "closed".into();
        c.registration.tokens = vec!["s3cret".into(), "other".into()];
    })
    .await;
    let anon = ts.anon();
    assert_eq!(
        anon.get(&format!("{path}?token=s3cret")).await.ok(),
        json!({ "valid": true })
    );
    assert_eq!(
        anon.get(&format!("{path}?token=other")).await.ok(),
        json!({ "valid": true })
    );
    assert_eq!(
        anon.get(&format!("{path}?token=s3cre")).await.ok(),
        json!({ "valid": false })
    );
    anon.get(path).await.expect_err(400, "M_MISSING_PARAM");
    ts.stop().await;

    // Closed to everyone: every token is invalid, said with 403 as the spec does.
    let ts = TestServer::start_with(|c| c.registration.mode = "closed".into()).await;
    ts.anon()
        .get(&format!("{path}?token=s3cret"))
        .await
        .expect_err(403, "M_FORBIDDEN");
    ts.stop().await;

    // Open registration without tokens: no token is valid.
    let ts = TestServer::start().await;
    assert_eq!(
        ts.anon().get(&format!("{path}?token=s3cret")).await.ok(),
        json!({ "valid": false })
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn support_well_known_serves_configured_contacts_else_404() {
    let ts = TestServer::start().await;
    ts.anon()
        .get("/.well-known/matrix/support")
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;

    let ts = TestServer::start_with(|c| {
        c.support.contacts = vec![
            spindle::config::SupportContact {
                role: "m.role.admin".into(),
                matrix_id: "@admin:localhost:8008".into(),
                email_address: "admin@example.org".into(),
            },
            spindle::config::SupportContact {
                role: "m.role.security".into(),
                matrix_id: String::new(),
                email_address: "security@example.org".into(),
            },
        ];
        c.support.support_page = "https://example.org/help".into();
    })
    .await;
    assert_eq!(
        ts.anon().get("/.well-known/matrix/support").await.ok(),
        json!({
            "contacts": [
                { "role": "m.role.admin", "matrix_id": "@admin:localhost:8008", "email_address": "admin@example.org" },
                { "role": "m.role.security", "email_address": "security@example.org" },
            ],
            "support_page": "https://example.org/help",
        })
    );
    ts.stop().await;

    let ts = TestServer::start_with(|c| c.support.support_page = "https://example.org/help".into())
        .await;
    assert_eq!(
        ts.anon().get("/.well-known/matrix/support").await.ok(),
        json!({ "support_page": "https://example.org/help" })
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_reports_are_journaled_and_do_not_reveal_the_account() {
    let ts = TestServer::start_with(|c| c.admins = vec![uid("admin")]).await;
    let admin = ts.register("admin").await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let report = |who: &str| format!("{C3}/users/{}/report", enc(who));
    let existing = alice
        .post(&report(&bob.user_id), &json!({ "reason": "spam" }))
        .await;
    let missing = alice
        .post(&report(&uid("nobody")), &json!({ "reason": "spam" }))
        .await;
    assert_eq!((existing.status, &existing.body), (200, &json!({})));
    assert_eq!((missing.status, &missing.body), (200, &json!({})));
    alice
        .post(&report(&bob.user_id), &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    alice
        .post(&report("bob"), &json!({ "reason": "x" }))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(
            &report(&bob.user_id),
            &json!({ "reason": "x".repeat(4097) }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");

    let trail = admin
        .get(&format!(
            "/_spindle/admin/v1/audit/users/{}",
            enc(&bob.user_id)
        ))
        .await
        .ok();
    let reports: Vec<&Value> = trail["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == json!("user_reported"))
        .collect();
    assert_eq!(reports.len(), 1, "{trail}");
    assert_eq!(
        reports[0]["details"],
        json!({ "reporter": "@alice:localhost:8008", "user_id": "@bob:localhost:8008", "reason": "spam" })
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_profile_fields_set_read_delete_and_limits() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let me = enc(&alice.user_id);
    let field = |k: &str| format!("{C3}/profile/{me}/{k}");
    alice
        .put(&field("displayname"), &json!({ "displayname": "Alice" }))
        .await
        .ok();
    alice
        .put(&field("m.tz"), &json!({ "m.tz": "Europe/London" }))
        .await
        .ok();
    alice
        .put(
            &field("org.example.pronouns"),
            &json!({ "org.example.pronouns": { "en": ["she", "her"] } }),
        )
        .await
        .ok();
    let anon = ts.anon();
    assert_eq!(
        anon.get(&format!("{C3}/profile/{me}")).await.ok(),
        json!({
            "displayname": "Alice",
            "m.tz": "Europe/London",
            "org.example.pronouns": { "en": ["she", "her"] },
        })
    );
    assert_eq!(
        anon.get(&field("m.tz")).await.ok(),
        json!({ "m.tz": "Europe/London" })
    );
    anon.get(&field("org.example.missing"))
        .await
        .expect_err(404, "M_NOT_FOUND");

    // Deleting: a custom field, and displayname (which also updates member events).
    for k in [
        "org.example.pronouns",
        "org.example.pronouns",
        "displayname",
    ] {
        let gone = alice.request(Method::DELETE, &field(k), None).await;
        assert_eq!(gone.ok(), json!({}));
    }
    assert_eq!(
        anon.get(&format!("{C3}/profile/{me}")).await.ok(),
        json!({ "m.tz": "Europe/London" })
    );

    // Keys: namespaced or one of the three; at most 255 bytes.
    for bad in ["tz", "m.custom", "Org.example.x", "org..x", "org.example-x"] {
        alice
            .put(&field(bad), &json!({ bad: 1 }))
            .await
            .expect_err(400, "M_INVALID_PARAM");
    }
    let long = format!("org.{}", "a".repeat(252));
    alice
        .put(&field(&long), &json!({ &long: 1 }))
        .await
        .expect_err(400, "M_KEY_TOO_LARGE");
    alice
        .put(&field("m.tz"), &json!({ "m.tz": 5 }))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .put(&field("org.example.x"), &json!({ "other": 1 }))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    bob.put(&field("m.tz"), &json!({ "m.tz": "UTC" }))
        .await
        .expect_err(403, "M_FORBIDDEN");
    bob.request(Method::DELETE, &field("m.tz"), None)
        .await
        .expect_err(403, "M_FORBIDDEN");

    // Total size under 64 KiB (65536 bytes of JSON): 62 bytes of keys and m.tz plus
    // two 32700-byte values is 65462 and fits; a third value, or a 200-byte
    // displayname (65679), does not.
    let blob = "x".repeat(32_700);
    for k in ["org.example.a", "org.example.b"] {
        alice.put(&field(k), &json!({ k: blob })).await.ok();
    }
    alice
        .put(&field("org.example.c"), &json!({ "org.example.c": blob }))
        .await
        .expect_err(400, "M_PROFILE_TOO_LARGE");
    alice
        .put(
            &field("displayname"),
            &json!({ "displayname": "x".repeat(200) }),
        )
        .await
        .expect_err(400, "M_PROFILE_TOO_LARGE");
    let profile = anon.get(&format!("{C3}/profile/{me}")).await.ok();
    assert_eq!(
        profile.as_object().unwrap().keys().collect::<Vec<_>>(),
        vec!["m.tz", "org.example.a", "org.example.b"]
    );
    // Replacing a field counts its new size only.
    alice
        .put(
            &field("org.example.a"),
            &json!({ "org.example.a": "small" }),
        )
        .await
        .ok();
    alice
        .put(&field("org.example.c"), &json!({ "org.example.c": blob }))
        .await
        .ok();

    let caps = alice.get(&format!("{C3}/capabilities")).await.ok();
    assert_eq!(
        caps["capabilities"]["m.profile_fields"],
        json!({ "enabled": true })
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_rooms_lists_rooms_both_users_joined_in_pages() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let path = |q: &str| format!("/_matrix/client/v1/mutual_rooms?{q}");
    let with = |u: &str| format!("user_id={}", enc(u));
    // Clients look for MSC2666's stable flag before calling the v1 endpoint.
    let versions = alice.get("/_matrix/client/versions").await.ok();
    assert_eq!(
        versions["unstable_features"]["uk.half-shot.msc2666.query_mutual_rooms.stable"],
        json!(true)
    );

    // 102 rooms both joined, one only alice is in, one bob was invited to, one bob left.
    let mut shared = Vec::new();
    for _ in 0..102 {
        let room = alice.create_room(json!({ "preset": "public_chat" })).await;
        bob.join(&room).await;
        shared.push(room);
    }
    shared.sort();
    let _alone = alice.create_room(json!({})).await;
    let invited = alice.create_room(json!({ "invite": [bob.user_id] })).await;
    let left = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&left).await;
    bob.leave(&left).await;
    assert!(!shared.contains(&invited) && !shared.contains(&left));

    let first = alice.get(&path(&with(&bob.user_id))).await.ok();
    assert_eq!(first["count"], json!(102));
    assert_eq!(first["joined"], json!(shared[..100]));
    assert_eq!(first["next_batch"], json!(shared[100]));
    let next = format!(
        "{}&from={}",
        with(&bob.user_id),
        enc(first["next_batch"].as_str().unwrap())
    );
    assert_eq!(
        bob.get(&path(
            &next.replace(&enc(&bob.user_id), &enc(&alice.user_id))
        ))
        .await
        .ok(),
        json!({ "joined": shared[100..], "count": 102 })
    );
    assert_eq!(
        alice.get(&path(&with(&carol.user_id))).await.ok(),
        json!({ "joined": [], "count": 0 })
    );
    // A third user learns nothing of the rooms the other two share.
    assert_eq!(
        carol.get(&path(&with(&bob.user_id))).await.ok(),
        json!({ "joined": [], "count": 0 })
    );
    assert_eq!(
        alice.get(&path(&with(&uid("nobody")))).await.ok(),
        json!({ "joined": [], "count": 0 })
    );
    alice
        .get(&path(&with(&alice.user_id)))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&path("user_id=bob"))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&path(""))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&path(&format!("{}&from=junk", with(&bob.user_id))))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whois_lists_devices_for_admins_and_oneself() {
    let ts = TestServer::start_with(|c| c.admins = vec![uid("admin")]).await;
    let admin = ts.register("admin").await;
    let alice = ts.register("alice").await;
    let phone = ts.login("alice", Some("PHONE")).await;
    let bob = ts.register("bob").await;
    let path = |u: &str| format!("{C3}/admin/whois/{}", enc(u));
    let own = alice.get(&path(&alice.user_id)).await.ok();
    assert_eq!(own["user_id"], json!("@alice:localhost:8008"));
    let mut ids: Vec<&String> = own["devices"].as_object().unwrap().keys().collect();
    ids.sort();
    let mut want = vec![&alice.device_id, &phone.device_id];
    want.sort();
    assert_eq!(ids, want);
    // Alice's first device was used (this request): its connection has last_seen and
    // the address; reqwest sends no user agent, so there is none to report.
    let conn = &own["devices"][&alice.device_id]["sessions"][0]["connections"][0];
    assert!(conn["last_seen"].as_u64().is_some(), "{own}");
    assert_eq!(conn["ip"], "127.0.0.1", "{own}");
    assert_eq!(conn.as_object().unwrap().len(), 2, "{own}");
    let by_admin = admin.get(&path(&alice.user_id)).await.ok();
    assert_eq!(by_admin["user_id"], own["user_id"]);
    assert_eq!(by_admin["devices"].as_object().unwrap().len(), 2);
    bob.get(&path(&alice.user_id))
        .await
        .expect_err(403, "M_FORBIDDEN");
    bob.get(&path(&uid("nobody")))
        .await
        .expect_err(403, "M_FORBIDDEN");
    admin
        .get(&path(&uid("nobody")))
        .await
        .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}
