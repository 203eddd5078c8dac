//! User-interactive authentication sessions (spec: "User-Interactive Authentication
//! API"): a session authorizes only the operation that opened it (a security
//! property: these tests reuse sessions the way an attacker or a confused client
//! would), and a registration session remembers its first request's parameters.

mod common;

use common::{Client, Resp, TestServer, uid};
use reqwest::Method;
use serde_json::{Value, json};

const C3: &str = "/_matrix/client/v3";

fn password_auth(localpart: &str, password: &str, session: &str) -> Value {
    json!({
        "type": "m.login.password",
        "identifier": { "type": "m.id.user", "user": localpart },
        "password": password,
        "session": session,
    })
}

async fn delete_device(c: &Client, device: &str, body: Value) -> Resp {
    c.request(
        Method::DELETE,
        &format!("{C3}/devices/{device}"),
        Some(&body),
    )
    .await
}

fn session_of(r: &Resp) -> String {
    assert_eq!(r.status, 401, "{}", r.text);
    r.body["session"].as_str().unwrap().to_owned()
}

/// The answer Synapse 1.163 gives (`check_ui_auth`): 403, errcode `M_UNKNOWN`.
fn assert_operation_changed(r: &Resp) {
    assert_eq!(
        (r.status, r.errcode(), r.body["error"].as_str()),
        (
            403,
            Some("M_UNKNOWN"),
            Some("Requested operation has changed during the UI authentication session.")
        ),
        "{}",
        r.text
    );
}

async fn login_status(ts: &TestServer, user: &str, password: &str) -> u16 {
    ts.anon()
        .post(
            &format!("{C3}/login"),
            &json!({
                "type": "m.login.password",
                "identifier": { "type": "m.id.user", "user": user },
                "password": password,
            }),
        )
        .await
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_completed_for_one_operation_authorizes_no_other() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let _phone = ts.login("alice", Some("PHONE")).await;
    let tablet = ts.login("alice", Some("TABLET")).await;
    let pw = "password-alice";

    // A session opened and completed for deleting PHONE.
    let s = session_of(&delete_device(&alice, "PHONE", json!({})).await);
    delete_device(
        &alice,
        "PHONE",
        json!({ "auth": password_auth("alice", pw, &s) }),
    )
    .await
    .ok();
    // It cannot delete TABLET, with or without the password again.
    assert_operation_changed(
        &delete_device(
            &alice,
            "TABLET",
            json!({ "auth": password_auth("alice", pw, &s) }),
        )
        .await,
    );
    assert_operation_changed(
        &delete_device(&alice, "TABLET", json!({ "auth": { "session": s } })).await,
    );
    // Nor delete it in bulk, change the password, deactivate the account.
    assert_operation_changed(
        &alice
            .post(
                &format!("{C3}/delete_devices"),
                &json!({ "devices": ["TABLET"], "auth": password_auth("alice", pw, &s) }),
            )
            .await,
    );
    assert_operation_changed(
        &alice
            .post(
                &format!("{C3}/account/password"),
                &json!({ "new_password": "stolen", "auth": password_auth("alice", pw, &s) }),
            )
            .await,
    );
    assert_operation_changed(
        &alice
            .post(
                &format!("{C3}/account/deactivate"),
                &json!({ "auth": password_auth("alice", pw, &s) }),
            )
            .await,
    );
    // Nor serve another user, nor a registration.
    assert_operation_changed(
        &delete_device(
            &bob,
            &bob.device_id,
            json!({ "auth": password_auth("bob", "password-bob", &s) }),
        )
        .await,
    );
    assert_operation_changed(
        &ts.anon()
            .post(
                &format!("{C3}/register"),
                &json!({ "username": "mallory", "password": "x", "auth": { "type": "m.login.dummy", "session": s } }),
            )
            .await,
    );
    // Nothing of that happened.
    tablet.get(&format!("{C3}/account/whoami")).await.ok();
    bob.get(&format!("{C3}/account/whoami")).await.ok();
    assert_eq!(login_status(&ts, "alice", pw).await, 200);
    assert_eq!(login_status(&ts, "alice", "stolen").await, 403);
    assert_eq!(login_status(&ts, "mallory", "x").await, 403);
    // Its own operation again is fine (completed stages stay completed, as Synapse).
    delete_device(&alice, "PHONE", json!({ "auth": { "session": s } }))
        .await
        .ok();
    // An unknown session is 400 `M_UNKNOWN` (Synapse: "Unknown session ID").
    delete_device(
        &alice,
        "TABLET",
        json!({ "auth": password_auth("alice", pw, "no-such-session") }),
    )
    .await
    .expect_err(400, "M_UNKNOWN");
    tablet.get(&format!("{C3}/account/whoami")).await.ok();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_bound_to_the_parameters_that_choose_the_operation() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let phone = ts.login("alice", Some("PHONE")).await;
    let tablet = ts.login("alice", Some("TABLET")).await;
    let pw = "password-alice";

    // Bulk deletion: opened for [PHONE], it cannot delete [PHONE, TABLET].
    let first = alice
        .post(
            &format!("{C3}/delete_devices"),
            &json!({ "devices": ["PHONE"] }),
        )
        .await;
    let s = session_of(&first);
    assert_operation_changed(
        &alice
            .post(
                &format!("{C3}/delete_devices"),
                &json!({ "devices": ["PHONE", "TABLET"], "auth": password_auth("alice", pw, &s) }),
            )
            .await,
    );
    phone.get(&format!("{C3}/account/whoami")).await.ok();
    alice
        .post(
            &format!("{C3}/delete_devices"),
            &json!({ "devices": ["PHONE"], "auth": password_auth("alice", pw, &s) }),
        )
        .await
        .ok();
    phone
        .get(&format!("{C3}/account/whoami"))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");

    // Password change: opened for one new password, it cannot set another
    // (`logout_devices` may be added by the request that completes the flow).
    let s = session_of(
        &alice
            .post(
                &format!("{C3}/account/password"),
                &json!({ "new_password": "chosen" }),
            )
            .await,
    );
    assert_operation_changed(
        &alice
            .post(
                &format!("{C3}/account/password"),
                &json!({ "new_password": "other", "auth": password_auth("alice", pw, &s) }),
            )
            .await,
    );
    assert_eq!(login_status(&ts, "alice", pw).await, 200);
    alice
        .post(
            &format!("{C3}/account/password"),
            &json!({ "new_password": "chosen", "logout_devices": true, "auth": password_auth("alice", pw, &s) }),
        )
        .await
        .ok();
    assert_eq!(login_status(&ts, "alice", "chosen").await, 200);
    assert_eq!(login_status(&ts, "alice", pw).await, 403);
    tablet
        .get(&format!("{C3}/account/whoami"))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");

    // Deactivation: opened without `erase`, it cannot erase.
    let s = session_of(
        &alice
            .post(&format!("{C3}/account/deactivate"), &json!({}))
            .await,
    );
    assert_operation_changed(
        &alice
            .post(
                &format!("{C3}/account/deactivate"),
                &json!({ "erase": true, "auth": password_auth("alice", "chosen", &s) }),
            )
            .await,
    );
    alice.get(&format!("{C3}/account/whoami")).await.ok();
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_session_remembers_its_first_requests_parameters() {
    let ts = TestServer::start().await;
    let anon = ts.anon();
    let register = |body: Value| {
        let anon = anon.clone();
        async move { anon.post(&format!("{C3}/register"), &body).await }
    };
    let s = session_of(
        &register(json!({
            "username": "carol",
            "password": "pw-carol",
            "device_id": "CAROLDEV",
            "initial_device_display_name": "Carol's phone",
        }))
        .await,
    );
    let done = register(json!({ "auth": { "type": "m.login.dummy", "session": s } }))
        .await
        .ok();
    assert_eq!(done["user_id"], json!(uid("carol")));
    assert_eq!(done["device_id"], json!("CAROLDEV"));
    let carol = anon.with_token(done["access_token"].as_str());
    assert_eq!(
        carol.get(&format!("{C3}/devices/CAROLDEV")).await.ok()["display_name"],
        json!("Carol's phone")
    );
    assert_eq!(login_status(&ts, "carol", "pw-carol").await, 200);

    // `inhibit_login` is remembered too.
    let s = session_of(
        &register(json!({ "username": "dan", "password": "pw-dan", "inhibit_login": true })).await,
    );
    let done = register(json!({ "auth": { "type": "m.login.dummy", "session": s } }))
        .await
        .ok();
    assert_eq!(
        done,
        json!({ "user_id": uid("dan"), "home_server": "localhost:8008" })
    );
    assert_eq!(login_status(&ts, "dan", "pw-dan").await, 200);

    // A parameter given again replaces the remembered one.
    let s = session_of(&register(json!({ "username": "erin", "password": "first" })).await);
    let done = register(json!({
        "password": "second",
        "auth": { "type": "m.login.dummy", "session": s },
    }))
    .await
    .ok();
    assert_eq!(done["user_id"], json!(uid("erin")));
    assert_eq!(login_status(&ts, "erin", "second").await, 200);
    assert_eq!(login_status(&ts, "erin", "first").await, 403);

    // Registration is idempotent: the session that registered erin logs erin in again
    // (a new device), whatever it is sent, and creates no second account.
    for again in [
        json!({ "password": "second", "auth": { "type": "m.login.dummy", "session": s } }),
        json!({ "auth": { "session": s } }),
        json!({ "username": "erin2", "auth": { "type": "m.login.dummy", "session": s } }),
    ] {
        let replay = register(again).await.ok();
        assert_eq!(replay["user_id"], json!(uid("erin")));
        assert_ne!(replay["device_id"], done["device_id"]);
        assert!(replay["access_token"].is_string());
    }
    assert_eq!(login_status(&ts, "erin2", "second").await, 403);
    // Without a username: the generated one is kept for the session too.
    let s = session_of(&register(json!({ "password": "anon-pw" })).await);
    let first = register(json!({ "auth": { "type": "m.login.dummy", "session": s } }))
        .await
        .ok();
    let replay = register(json!({ "auth": { "type": "m.login.dummy", "session": s } }))
        .await
        .ok();
    assert_eq!(replay["user_id"], first["user_id"]);

    // A registration session cannot authorize a signed-in operation.
    let s = session_of(&register(json!({ "username": "frank", "password": "pw" })).await);
    assert_operation_changed(
        &delete_device(
            &carol,
            "CAROLDEV",
            json!({ "auth": password_auth("carol", "pw-carol", &s) }),
        )
        .await,
    );
    carol.get(&format!("{C3}/account/whoami")).await.ok();
    ts.stop().await;
}
