//! Devices, user-interactive auth, password changes, deactivation, 3PIDs and refresh
//! tokens (spec: "Device Management", "Account management", "Refreshing access
//! tokens"), asserted with exact values.

mod common;

use common::{TestServer, enc, uid};
use serde_json::{Value, json};

fn password_auth(localpart: &str, password: &str, session: &str) -> Value {
    json!({
        "type": "m.login.password",
        "identifier": { "type": "m.id.user", "user": localpart },
        "password": password,
        "session": session,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_are_listed_renamed_and_deleted_with_password_uia() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let phone = ts.login("alice", Some("PHONE")).await;
    let laptop = ts.login("alice", Some("LAPTOP")).await;

    let list = alice.get("/_matrix/client/v3/devices").await.ok();
    let ids: Vec<&str> = list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["device_id"].as_str().unwrap())
        .collect();
    let mut want = vec![alice.device_id.as_str(), "LAPTOP", "PHONE"];
    want.sort();
    assert_eq!(ids, want);
    // Each device was used (by its login's follow-up reads or not at all): last_seen_ts
    // is present exactly for the devices that made an authenticated request.
    let me = list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device_id"] == json!(alice.device_id))
        .unwrap();
    assert!(me["last_seen_ts"].as_u64().is_some_and(|t| t > 0));
    assert!(me.get("display_name").is_none());

    // Rename, read back; a device of someone else or unknown is 404.
    alice
        .put(
            "/_matrix/client/v3/devices/PHONE",
            &json!({ "display_name": "Alice's phone" }),
        )
        .await
        .ok();
    let phone_dev = alice.get("/_matrix/client/v3/devices/PHONE").await.ok();
    assert_eq!(phone_dev["device_id"], json!("PHONE"));
    assert_eq!(phone_dev["display_name"], json!("Alice's phone"));
    alice
        .get("/_matrix/client/v3/devices/NOPE")
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .put(
            "/_matrix/client/v3/devices/NOPE",
            &json!({ "display_name": "x" }),
        )
        .await
        .expect_err(404, "M_NOT_FOUND");
    let bob = ts.register("bob").await;
    bob.get("/_matrix/client/v3/devices/PHONE")
        .await
        .expect_err(404, "M_NOT_FOUND");

    // DELETE without auth: 401 with the password flow and a session.
    let del = alice
        .request(
            reqwest::Method::DELETE,
            "/_matrix/client/v3/devices/PHONE",
            Some(&json!({})),
        )
        .await;
    assert_eq!(del.status, 401, "{}", del.text);
    assert_eq!(
        del.body["flows"],
        json!([{ "stages": ["m.login.password"] }])
    );
    assert_eq!(del.body["completed"], json!([]));
    let session = del.body["session"].as_str().unwrap().to_owned();
    // Wrong password: 401 again with M_FORBIDDEN; the device survives.
    let wrong = alice
        .request(
            reqwest::Method::DELETE,
            "/_matrix/client/v3/devices/PHONE",
            Some(&json!({ "auth": password_auth("alice", "nope", &session) })),
        )
        .await;
    assert_eq!((wrong.status, wrong.errcode()), (401, Some("M_FORBIDDEN")));
    assert_eq!(wrong.body["session"], json!(session));
    phone.get("/_matrix/client/v3/account/whoami").await.ok();
    // Bob's password for alice's request: the identifier names another user.
    let other = alice
        .request(
            reqwest::Method::DELETE,
            "/_matrix/client/v3/devices/PHONE",
            Some(&json!({ "auth": password_auth("bob", "password-bob", &session) })),
        )
        .await;
    assert_eq!((other.status, other.errcode()), (401, Some("M_FORBIDDEN")));
    // Right password: deleted, and its token is dead at once.
    alice
        .request(
            reqwest::Method::DELETE,
            "/_matrix/client/v3/devices/PHONE",
            Some(&json!({ "auth": password_auth("alice", "password-alice", &session) })),
        )
        .await
        .ok();
    phone
        .get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    alice
        .get("/_matrix/client/v3/devices/PHONE")
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Deleting it again is 200 (spec: "or had been removed previously").
    alice
        .request(
            reqwest::Method::DELETE,
            "/_matrix/client/v3/devices/PHONE",
            Some(&json!({ "auth": password_auth("alice", "password-alice", &session) })),
        )
        .await
        .ok();

    // Bulk delete: unknown ids are skipped; the listed ones go.
    let bulk = json!({ "devices": ["LAPTOP", "GHOST"] });
    let first = alice.post("/_matrix/client/v3/delete_devices", &bulk).await;
    assert_eq!(first.status, 401);
    let mut with_auth = bulk.clone();
    with_auth["auth"] = password_auth(
        &alice.user_id,
        "password-alice",
        first.body["session"].as_str().unwrap(),
    );
    alice
        .post("/_matrix/client/v3/delete_devices", &with_auth)
        .await
        .ok();
    laptop
        .get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    let list = alice.get("/_matrix/client/v3/devices").await.ok();
    assert_eq!(list["devices"].as_array().unwrap().len(), 1);
    assert_eq!(list["devices"][0]["device_id"], json!(alice.device_id));
    alice
        .post(
            "/_matrix/client/v3/delete_devices",
            &json!({ "devices": "LAPTOP" }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post("/_matrix/client/v3/delete_devices", &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_change_logs_out_other_devices_unless_asked_not_to() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let other = ts.login("alice", Some("OTHER")).await;

    let caps = alice.get("/_matrix/client/v3/capabilities").await.ok();
    assert_eq!(
        caps["capabilities"]["m.change_password"],
        json!({ "enabled": true })
    );

    let challenge = alice
        .post(
            "/_matrix/client/v3/account/password",
            &json!({ "new_password": "second" }),
        )
        .await;
    assert_eq!(challenge.status, 401);
    let session = challenge.body["session"].as_str().unwrap().to_owned();
    // logout_devices: false keeps the other device.
    alice
        .post(
            "/_matrix/client/v3/account/password",
            &json!({
                "new_password": "second",
                "logout_devices": false,
                "auth": password_auth("alice", "password-alice", &session),
            }),
        )
        .await
        .ok();
    other.get("/_matrix/client/v3/account/whoami").await.ok();
    // The old password no longer logs in; the new one does.
    let old_login = ts
        .anon()
        .post(
            "/_matrix/client/v3/login",
            &json!({ "type": "m.login.password", "identifier": { "type": "m.id.user", "user": "alice" }, "password": "password-alice" }),
        )
        .await;
    old_login.expect_err(403, "M_FORBIDDEN");
    // Default: every other device is logged out, the requester's token survives. A
    // new operation needs a session of its own (tests/uia.rs).
    let challenge = alice
        .post(
            "/_matrix/client/v3/account/password",
            &json!({ "new_password": "third" }),
        )
        .await;
    let session = challenge.body["session"].as_str().unwrap().to_owned();
    alice
        .post(
            "/_matrix/client/v3/account/password",
            &json!({
                "new_password": "third",
                "auth": password_auth("alice", "second", &session),
            }),
        )
        .await
        .ok();
    other
        .get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    let who = alice.get("/_matrix/client/v3/account/whoami").await.ok();
    assert_eq!(who["device_id"], json!(alice.device_id));
    let devices = alice.get("/_matrix/client/v3/devices").await.ok();
    assert_eq!(devices["devices"].as_array().unwrap().len(), 1);
    ts.anon()
        .post(
            "/_matrix/client/v3/login",
            &json!({ "type": "m.login.password", "identifier": { "type": "m.id.user", "user": "alice" }, "password": "third" }),
        )
        .await
        .ok();
    alice
        .post("/_matrix/client/v3/account/password", &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    alice
        .post(
            "/_matrix/client/v3/account/password",
            &json!({ "new_password": "" }),
        )
        .await
        .expect_err(400, "M_WEAK_PASSWORD");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deactivation_leaves_rooms_revokes_tokens_erases_and_blocks_the_id() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let second = ts.login("bob", Some("SECOND")).await;
    bob.put(
        &format!(
            "/_matrix/client/v3/profile/{}/displayname",
            enc(&bob.user_id)
        ),
        &json!({ "displayname": "Bobby" }),
    )
    .await
    .ok();
    let joined = alice.create_room(json!({ "preset": "public_chat" })).await;
    let invited = alice.create_room(json!({ "invite": [bob.user_id] })).await;
    bob.join(&joined).await;

    let threepids = bob.get("/_matrix/client/v3/account/3pid").await.ok();
    assert_eq!(threepids, json!({ "threepids": [] }));

    let challenge = bob
        .post(
            "/_matrix/client/v3/account/deactivate",
            &json!({ "erase": true }),
        )
        .await;
    assert_eq!(challenge.status, 401);
    let done = bob
        .post(
            "/_matrix/client/v3/account/deactivate",
            &json!({
                "erase": true,
                "auth": password_auth("bob", "password-bob", challenge.body["session"].as_str().unwrap()),
            }),
        )
        .await
        .ok();
    assert_eq!(done, json!({ "id_server_unbind_result": "no-support" }));

    // Every token is dead.
    for c in [&bob, &second] {
        c.get("/_matrix/client/v3/account/whoami")
            .await
            .expect_err(401, "M_UNKNOWN_TOKEN");
    }
    // Bob left both rooms (the joined one and the invite, which is rejected).
    for room in [&joined, &invited] {
        let m = alice
            .get(&format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
                enc(room),
                enc(&uid("bob"))
            ))
            .await
            .ok();
        assert_eq!(m, json!({ "membership": "leave" }));
    }
    // Erased: the profile is empty.
    let profile = ts
        .anon()
        .get(&format!("/_matrix/client/v3/profile/{}", enc(&uid("bob"))))
        .await
        .ok();
    assert_eq!(profile, json!({}));
    // No login, no re-registration of the id.
    let login = ts
        .anon()
        .post(
            "/_matrix/client/v3/login",
            &json!({ "type": "m.login.password", "identifier": { "type": "m.id.user", "user": "bob" }, "password": "password-bob" }),
        )
        .await;
    login.expect_err(403, "M_USER_DEACTIVATED");
    let again = ts
        .anon()
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "bob", "password": "x", "auth": { "type": "m.login.dummy" } }),
        )
        .await;
    again.expect_err(400, "M_USER_IN_USE");
    ts.stop().await;
}

async fn login_refreshable(anon: &common::Client, device: &str) -> Value {
    anon.post(
        "/_matrix/client/v3/login",
        &json!({
            "type": "m.login.password",
            "identifier": { "type": "m.id.user", "user": "alice" },
            "password": "password-alice",
            "refresh_token": true,
            "device_id": device,
        }),
    )
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refresh_tokens_rotate_and_die_with_their_device() {
    let ts = TestServer::start().await;
    ts.register("alice").await;
    let anon = ts.anon();
    let login = login_refreshable(&anon, "REFRESHER").await;
    // The default lifetime (sessions.refreshable_access_token_lifetime_ms).
    assert_eq!(login["expires_in_ms"], json!(300_000));
    let access = login["access_token"].as_str().unwrap().to_owned();
    let refresh = login["refresh_token"].as_str().unwrap().to_owned();
    let client = anon.with_token(Some(&access));
    client.get("/_matrix/client/v3/account/whoami").await.ok();

    // Spend the refresh token: a new pair; the old access and refresh tokens are dead.
    let next = anon
        .post(
            "/_matrix/client/v3/refresh",
            &json!({ "refresh_token": refresh }),
        )
        .await
        .ok();
    assert_eq!(next["expires_in_ms"], json!(300_000));
    let access2 = next["access_token"].as_str().unwrap().to_owned();
    let refresh2 = next["refresh_token"].as_str().unwrap().to_owned();
    assert_ne!(access2, access);
    assert_ne!(refresh2, refresh);
    client
        .get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    let reused = anon
        .post(
            "/_matrix/client/v3/refresh",
            &json!({ "refresh_token": refresh }),
        )
        .await;
    reused.expect_err(401, "M_UNKNOWN_TOKEN");
    assert_eq!(reused.body["soft_logout"], json!(false));
    let who = anon
        .with_token(Some(&access2))
        .get("/_matrix/client/v3/account/whoami")
        .await
        .ok();
    assert_eq!(who["device_id"], json!("REFRESHER"));

    // Deleting the device (logout) revokes its refresh token too.
    anon.with_token(Some(&access2))
        .post("/_matrix/client/v3/logout", &json!({}))
        .await
        .ok();
    anon.post(
        "/_matrix/client/v3/refresh",
        &json!({ "refresh_token": refresh2 }),
    )
    .await
    .expect_err(401, "M_UNKNOWN_TOKEN");
    // A login without refresh_token gets neither field.
    let plain = anon
        .post(
            "/_matrix/client/v3/login",
            &json!({ "type": "m.login.password", "identifier": { "type": "m.id.user", "user": "alice" }, "password": "password-alice" }),
        )
        .await
        .ok();
    assert!(plain.get("refresh_token").is_none() && plain.get("expires_in_ms").is_none());
    anon.post("/_matrix/client/v3/refresh", &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    let flows = anon.get("/_matrix/client/v3/login").await.ok();
    assert_eq!(flows, json!({ "flows": [{ "type": "m.login.password" }] }));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_access_token_is_a_soft_logout_and_refreshes() {
    let ts =
        TestServer::start_with(|c| c.sessions.refreshable_access_token_lifetime_ms = 1_000).await;
    ts.register("alice").await;
    let anon = ts.anon();
    let login = login_refreshable(&anon, "SHORT").await;
    assert_eq!(login["expires_in_ms"], json!(1_000));
    // Waiting past the lifetime is what makes the token expire (not a timing assertion).
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    let expired = anon
        .with_token(Some(login["access_token"].as_str().unwrap()))
        .get("/_matrix/client/v3/account/whoami")
        .await;
    expired.expect_err(401, "M_UNKNOWN_TOKEN");
    assert_eq!(expired.body["soft_logout"], json!(true));
    let next = anon
        .post(
            "/_matrix/client/v3/refresh",
            &json!({ "refresh_token": login["refresh_token"] }),
        )
        .await
        .ok();
    assert!(
        next["access_token"]
            .as_str()
            .is_some_and(|t| t.starts_with("spt_"))
    );
    ts.stop().await;
}
