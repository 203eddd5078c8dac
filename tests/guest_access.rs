//! Guest access (spec: client-server API, "Guest Access"; issue 15 item 2): the
//! config switch, guest registration with numeric ids, the routes a guest may call,
//! `m.room.guest_access` on a guest's join, the kick when a room stops allowing
//! guests, and the upgrade to a full account keeping the user id.

mod common;

use common::{Client, TestServer, enc, uid};
use serde_json::{Value, json};

async fn guest_server() -> TestServer {
    TestServer::start_with(|c| c.registration.allow_guest_access = true).await
}

/// `POST /register?kind=guest` with `body`; the guest's client.
async fn register_guest(t: &TestServer, body: Value) -> Client {
    let v = t
        .anon()
        .post("/_matrix/client/v3/register?kind=guest", &body)
        .await
        .ok();
    Client {
        http: t.http.clone(),
        base: t.base.clone(),
        token: Some(v["access_token"].as_str().expect("access_token").to_owned()),
        user_id: v["user_id"].as_str().expect("user_id").to_owned(),
        device_id: v["device_id"].as_str().expect("device_id").to_owned(),
    }
}

/// The membership of `user` in `room` as `viewer` reads it from the room state.
async fn membership_of(viewer: &Client, room: &str, user: &str) -> (String, String) {
    let ev = viewer
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.member/{}?format=event",
            enc(room),
            enc(user)
        ))
        .await
        .ok();
    (
        ev["content"]["membership"].as_str().unwrap().to_owned(),
        ev["sender"].as_str().unwrap().to_owned(),
    )
}

fn join_path(room: &str) -> String {
    format!("/_matrix/client/v3/rooms/{}/join", enc(room))
}

#[tokio::test]
async fn guest_registration_is_refused_while_the_switch_is_off() {
    let t = TestServer::start().await;
    let r = t
        .anon()
        .post("/_matrix/client/v3/register?kind=guest", &json!({}))
        .await;
    r.expect_err(403, "M_FORBIDDEN");
    assert_eq!(r.body["error"], "Guest access is disabled");
    t.stop().await;
}

#[tokio::test]
async fn guests_get_numeric_ids_after_the_largest_numeric_localpart() {
    let t = guest_server().await;
    let first = register_guest(&t, json!({})).await;
    assert_eq!(first.user_id, uid("1"));
    // A full account with a number for a name moves the sequence past it, as Synapse's
    // generated ids do (once per process: the number is then counted in memory, and a
    // taken one is skipped).
    let _seven = t.register("7").await;
    let second = register_guest(
        &t,
        json!({ "device_id": "GUESTDEV", "initial_device_display_name": "Guest phone" }),
    )
    .await;
    assert_eq!(second.user_id, uid("2"));
    assert_eq!(second.device_id, "GUESTDEV");
    let third = register_guest(&t, json!({})).await;
    assert_eq!(third.user_id, uid("3"));
    let whoami = second.get("/_matrix/client/v3/account/whoami").await.ok();
    assert_eq!(
        whoami,
        json!({ "user_id": uid("2"), "device_id": "GUESTDEV", "is_guest": true })
    );
    // The display name starts as the localpart, as for every account.
    let profile = t
        .anon()
        .get(&format!("/_matrix/client/v3/profile/{}", enc(&uid("2"))))
        .await
        .ok();
    assert_eq!(profile, json!({ "displayname": "2" }));
    let devices = second.get("/_matrix/client/v3/devices").await.ok();
    assert_eq!(devices["devices"][0]["device_id"], "GUESTDEV");
    assert_eq!(devices["devices"][0]["display_name"], "Guest phone");
    t.stop().await;

    // On a fresh server the largest numeric localpart is found from the accounts.
    let t = guest_server().await;
    let _twelve = t.register("12").await;
    let _word = t.register("alice").await;
    assert_eq!(register_guest(&t, json!({})).await.user_id, uid("13"));
    t.stop().await;
}

#[tokio::test]
async fn a_guest_may_call_only_the_guest_endpoints() {
    let t = guest_server().await;
    let guest = register_guest(&t, json!({})).await;
    let sync = guest.get("/_matrix/client/v3/sync?timeout=0").await.ok();
    assert!(sync["next_batch"].is_string());
    let r = guest
        .post("/_matrix/client/v3/createRoom", &json!({}))
        .await;
    r.expect_err(403, "M_GUEST_ACCESS_FORBIDDEN");
    // Closed to guests in Synapse too: push rules, typing, account data.
    guest
        .get("/_matrix/client/v3/pushrules/")
        .await
        .expect_err(403, "M_GUEST_ACCESS_FORBIDDEN");
    guest
        .get(&format!(
            "/_matrix/client/v3/user/{}/account_data/m.direct",
            enc(&guest.user_id)
        ))
        .await
        .expect_err(403, "M_GUEST_ACCESS_FORBIDDEN");
    // Beyond the spec's list, what Synapse lets a guest call and Element's guest mode
    // needs.
    assert_eq!(
        guest.get("/_matrix/client/v3/joined_rooms").await.ok(),
        json!({ "joined_rooms": [] })
    );
    let caps = guest.get("/_matrix/client/v3/capabilities").await.ok();
    assert_eq!(caps["capabilities"]["m.room_versions"]["default"], "10");
    guest.get("/_matrix/client/v3/publicRooms").await.ok();
    guest
        .post(
            &format!("/_matrix/client/v3/user/{}/filter", enc(&guest.user_id)),
            &json!({}),
        )
        .await
        .expect_err(403, "M_GUEST_ACCESS_FORBIDDEN");
    // Of the profile, only the display name.
    guest
        .put(
            &format!(
                "/_matrix/client/v3/profile/{}/displayname",
                enc(&guest.user_id)
            ),
            &json!({ "displayname": "Visitor" }),
        )
        .await
        .ok();
    guest
        .put(
            &format!(
                "/_matrix/client/v3/profile/{}/avatar_url",
                enc(&guest.user_id)
            ),
            &json!({ "avatar_url": "mxc://localhost:8008/abc" }),
        )
        .await
        .expect_err(403, "M_GUEST_ACCESS_FORBIDDEN");
    // Account maintenance and keys the spec lists.
    guest
        .put(
            &format!("/_matrix/client/v3/devices/{}", guest.device_id),
            &json!({ "display_name": "renamed" }),
        )
        .await
        .ok();
    guest
        .post(
            "/_matrix/client/v3/keys/query",
            &json!({ "device_keys": { guest.user_id.clone(): [] } }),
        )
        .await
        .ok();
    guest
        .post("/_matrix/client/v3/logout", &json!({}))
        .await
        .expect_err(403, "M_GUEST_ACCESS_FORBIDDEN");
    // A full account's token is not restricted.
    let alice = t.register("alice").await;
    alice.get("/_matrix/client/v3/joined_rooms").await.ok();
    t.stop().await;
}

#[tokio::test]
async fn a_guest_joins_only_rooms_whose_guest_access_is_can_join() {
    let t = guest_server().await;
    let alice = t.register("alice").await;
    let guest = register_guest(&t, json!({})).await;
    // public_chat: guest_access forbidden.
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    guest
        .post(&join_path(&room), &json!({}))
        .await
        .expect_err(403, "M_FORBIDDEN");
    guest
        .post(
            &format!("/_matrix/client/v3/join/{}", enc(&room)),
            &json!({}),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    guest
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
                enc(&room),
                enc(&guest.user_id)
            ),
            &json!({ "membership": "join" }),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    // An unknown room has no state that lets guests in.
    guest
        .post(&join_path("!nowhere:localhost:8008"), &json!({}))
        .await
        .expect_err(403, "M_FORBIDDEN");
    // A full account joins the same room.
    let bob = t.register("bob").await;
    bob.join(&room).await;

    alice
        .put_state(
            &room,
            "m.room.guest_access",
            "",
            json!({ "guest_access": "can_join" }),
        )
        .await;
    let v = guest.post(&join_path(&room), &json!({})).await.ok();
    assert_eq!(v, json!({ "room_id": room }));
    assert_eq!(
        membership_of(&alice, &room, &guest.user_id).await,
        ("join".to_owned(), guest.user_id.clone())
    );
    // Joined, the guest reads and sends as the spec lists.
    let event_id = guest.send_text(&room, "hello from a guest").await;
    let m = guest.messages(&room, "dir=b&limit=1").await;
    assert_eq!(m["chunk"][0]["event_id"], json!(event_id));
    // By alias too (`POST /join/{roomIdOrAlias}`, as Synapse lets guests).
    let room2 = alice
        .create_room(json!({ "preset": "public_chat", "room_alias_name": "lobby" }))
        .await;
    alice
        .put_state(
            &room2,
            "m.room.guest_access",
            "",
            json!({ "guest_access": "can_join" }),
        )
        .await;
    let v = guest
        .post(
            &format!("/_matrix/client/v3/join/{}", enc("#lobby:localhost:8008")),
            &json!({}),
        )
        .await
        .ok();
    assert_eq!(v, json!({ "room_id": room2 }));
    t.stop().await;
}

#[tokio::test]
async fn guests_are_made_to_leave_when_a_room_stops_allowing_guests() {
    let t = guest_server().await;
    let alice = t.register("alice").await;
    let bob = t.register("bob").await;
    let guest = register_guest(&t, json!({})).await;
    let other_guest = register_guest(&t, json!({})).await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    alice
        .put_state(
            &room,
            "m.room.guest_access",
            "",
            json!({ "guest_access": "can_join" }),
        )
        .await;
    bob.join(&room).await;
    guest.join(&room).await;
    other_guest.join(&room).await;
    // A change that keeps can_join (a new event, other content) leaves them in.
    alice
        .put_state(
            &room,
            "m.room.guest_access",
            "",
            json!({ "guest_access": "can_join", "note": "still open" }),
        )
        .await;
    let turned_off = alice
        .put_state(
            &room,
            "m.room.guest_access",
            "",
            json!({ "guest_access": "forbidden" }),
        )
        .await;
    // The reactor acts once the projections have applied the change.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let a = membership_of(&alice, &room, &guest.user_id).await;
        let b = membership_of(&alice, &room, &other_guest.user_id).await;
        if a.0 == "leave" && b.0 == "leave" {
            // Each guest's own leave, as Synapse's kick_guest_users sends it.
            assert_eq!(a, ("leave".to_owned(), guest.user_id.clone()));
            assert_eq!(b, ("leave".to_owned(), other_guest.user_id.clone()));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "guests still in the room: {a:?} {b:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The full accounts stay.
    assert_eq!(membership_of(&alice, &room, &bob.user_id).await.0, "join");
    // The leaves come right after the change, once each, and nothing else follows.
    let timeline = alice.messages(&room, "dir=b&limit=3").await;
    let chunk = timeline["chunk"].as_array().unwrap();
    let mut leavers: Vec<&str> = chunk[..2]
        .iter()
        .map(|e| {
            assert_eq!(e["type"], "m.room.member");
            assert_eq!(e["content"]["membership"], "leave");
            e["state_key"].as_str().unwrap()
        })
        .collect();
    leavers.sort();
    let mut want = vec![guest.user_id.as_str(), other_guest.user_id.as_str()];
    want.sort();
    assert_eq!(leavers, want);
    assert_eq!(chunk[2]["event_id"], json!(turned_off));
    // And they cannot come back.
    guest
        .post(&join_path(&room), &json!({}))
        .await
        .expect_err(403, "M_FORBIDDEN");
    t.stop().await;
}

#[tokio::test]
async fn a_guest_upgrades_to_a_full_account_keeping_its_user_id() {
    let t = guest_server().await;
    let alice = t.register("alice").await;
    let guest = register_guest(&t, json!({})).await;
    assert_eq!(guest.user_id, uid("1"));
    let room = alice.create_room(json!({})).await; // private_chat: can_join
    alice.invite(&room, &guest.user_id).await;
    guest.join(&room).await;
    let token = guest.token.clone().unwrap();
    let anon = t.anon();

    // Another user's localpart, or a full account's token: refused.
    let r = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "someone", "password": "pw-guest-1",
                     "guest_access_token": token,
                     "auth": { "type": "m.login.dummy" } }),
        )
        .await;
    r.expect_err(403, "M_FORBIDDEN");
    let r = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "alice", "password": "pw",
                     "guest_access_token": alice.token.clone().unwrap(),
                     "auth": { "type": "m.login.dummy" } }),
        )
        .await;
    r.expect_err(403, "M_FORBIDDEN");
    let r = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "1", "guest_access_token": "nope",
                     "auth": { "type": "m.login.dummy" } }),
        )
        .await;
    r.expect_err(401, "M_UNKNOWN_TOKEN");

    // Spec form: the ordinary flow (UIA) with `guest_access_token` and the guest's
    // localpart as `username`.
    let first = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "1", "password": "pw-guest-1", "guest_access_token": token }),
        )
        .await;
    assert_eq!(first.status, 401, "{}", first.text);
    let session = first.body["session"].as_str().unwrap().to_owned();
    let done = anon
        .post(
            "/_matrix/client/v3/register",
            &json!({ "username": "1", "password": "pw-guest-1", "guest_access_token": token,
                     "auth": { "type": "m.login.dummy", "session": session } }),
        )
        .await
        .ok();
    assert_eq!(done["user_id"], json!(uid("1")));
    let upgraded = guest.with_token(done["access_token"].as_str());
    assert_eq!(
        upgraded.get("/_matrix/client/v3/account/whoami").await.ok()["is_guest"],
        json!(false)
    );
    // The old guest token is a full account's now too.
    let old = guest.get("/_matrix/client/v3/account/whoami").await.ok();
    assert_eq!(
        old,
        json!({ "user_id": uid("1"), "device_id": guest.device_id, "is_guest": false })
    );
    guest
        .post("/_matrix/client/v3/createRoom", &json!({}))
        .await
        .ok();
    // Still in the room, same user id; the password logs in.
    assert_eq!(membership_of(&alice, &room, &uid("1")).await.0, "join");
    let login = anon
        .post(
            "/_matrix/client/v3/login",
            &json!({ "type": "m.login.password",
                     "identifier": { "type": "m.id.user", "user": "1" },
                     "password": "pw-guest-1" }),
        )
        .await
        .ok();
    assert_eq!(login["user_id"], json!(uid("1")));
    // A second upgrade: the account is no guest any more.
    anon.post(
        "/_matrix/client/v3/register",
        &json!({ "username": "1", "guest_access_token": token,
                 "auth": { "type": "m.login.dummy" } }),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");
    t.stop().await;
}

#[tokio::test]
async fn a_guest_upgrades_with_its_token_as_authorization_too() {
    let t = guest_server().await;
    let guest = register_guest(&t, json!({})).await;
    // Without `username` (taken as the guest's localpart) and without
    // `guest_access_token`: the request's own guest token names the guest.
    let done = guest
        .post(
            "/_matrix/client/v3/register",
            &json!({ "password": "pw-guest", "auth": { "type": "m.login.dummy" },
                     "device_id": "FULLDEV" }),
        )
        .await
        .ok();
    assert_eq!(done["user_id"], json!(guest.user_id));
    assert_eq!(done["device_id"], "FULLDEV");
    let whoami = guest
        .with_token(done["access_token"].as_str())
        .get("/_matrix/client/v3/account/whoami")
        .await
        .ok();
    assert_eq!(
        whoami,
        json!({ "user_id": guest.user_id, "device_id": "FULLDEV", "is_guest": false })
    );
    // Both devices are the account's.
    let devices = guest.get("/_matrix/client/v3/devices").await.ok();
    let mut ids: Vec<&str> = devices["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["device_id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut want = vec!["FULLDEV", guest.device_id.as_str()];
    want.sort();
    assert_eq!(ids, want);
    t.stop().await;
}

#[tokio::test]
async fn the_server_admin_api_shows_guests() {
    let t = TestServer::start_with(|c| {
        c.registration.allow_guest_access = true;
        c.admins = vec![uid("admin")];
    })
    .await;
    let admin = t.register("admin").await;
    let guest = register_guest(&t, json!({})).await;
    let list = admin.get("/_synapse/admin/v2/users").await.ok();
    let flags: Vec<(String, bool)> = list["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| {
            (
                u["name"].as_str().unwrap().to_owned(),
                u["is_guest"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        flags,
        vec![(guest.user_id.clone(), true), (uid("admin"), false)]
    );
    let list = admin
        .get("/_synapse/admin/v2/users?guests=false")
        .await
        .ok();
    assert_eq!(list["total"], 1);
    assert_eq!(list["users"][0]["name"], json!(uid("admin")));
    let one = admin
        .get(&format!("/_synapse/admin/v2/users/{}", enc(&guest.user_id)))
        .await
        .ok();
    assert_eq!(one["is_guest"], true);
    t.stop().await;
}

/// Every route template a guest may call is a route the router serves (a typo in
/// `GUEST_ROUTES` would otherwise close an endpoint to guests without a sound): each
/// is called with the guest's token and its placeholders filled, and must answer
/// anything but 404/405 `M_UNRECOGNIZED` and 403 `M_GUEST_ACCESS_FORBIDDEN`.
#[tokio::test]
async fn every_guest_route_is_served_and_open_to_guests() {
    let t = guest_server().await;
    let guest = register_guest(&t, json!({})).await;
    for (method, template) in spindle_api::guest::GUEST_ROUTES {
        let path = template
            .replace("{room_id}", &enc("!nowhere:localhost:8008"))
            .replace("{room_id_or_alias}", &enc("#nowhere:localhost:8008"))
            .replace("{event_id}", &enc("$none"))
            .replace("{event_type}", "m.room.message")
            .replace("{state_key}", "k")
            .replace("{rel_type}", "m.annotation")
            .replace("{txn_id}", "t1")
            .replace("{server}", "localhost:8008")
            .replace("{media_id}", "none")
            .replace("{filename}", "f.png")
            .replace("{user_id}", &enc(&guest.user_id))
            .replace("{field}", "displayname")
            .replace("{device_id}", &guest.device_id);
        let path = if path.ends_with("/keys/changes") {
            format!("{path}?from=s0&to=s1")
        } else if path.ends_with("/messages") {
            format!("{path}?dir=b")
        } else if path.contains("/thumbnail/") {
            format!("{path}?width=32&height=32")
        } else {
            path
        };
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let body = (method != reqwest::Method::GET).then(|| json!({}));
        let r = guest.request(method.clone(), &path, body.as_ref()).await;
        assert!(
            !matches!(
                (r.status, r.errcode()),
                (404 | 405, Some("M_UNRECOGNIZED")) | (403, Some("M_GUEST_ACCESS_FORBIDDEN"))
            ),
            "{method} {path}: {} {}",
            r.status,
            r.body
        );
    }
    t.stop().await;
}

/// An application service whose exclusive namespace holds every numeric id keeps
/// guests out with a clear 403 (not a 500): no id outside the namespace can be found.
/// One reserving only `@1` makes the first guest `@2`.
#[tokio::test]
async fn numeric_ids_in_an_exclusive_appservice_namespace_are_skipped_or_refused() {
    let regs = tempfile::tempdir().unwrap();
    let registration = |regex: &str| {
        format!(
            "id: numbers\nurl: null\nas_token: as-numbers\nhs_token: hs-numbers\n\
             sender_localpart: numbersbot\nnamespaces:\n  users:\n    - exclusive: true\n      \
             regex: '{regex}'\n  aliases: []\n  rooms: []\n"
        )
    };
    let path = regs.path().join("numbers.yaml");
    std::fs::write(&path, registration("@[0-9]+:localhost:8008")).unwrap();
    let t = TestServer::start_with(|c| {
        c.registration.allow_guest_access = true;
        c.appservices.registration_files = vec![path.clone()];
    })
    .await;
    let r = t
        .anon()
        .post("/_matrix/client/v3/register?kind=guest", &json!({}))
        .await;
    r.expect_err(403, "M_FORBIDDEN");
    assert!(
        r.body["error"]
            .as_str()
            .unwrap()
            .contains("exclusive namespace"),
        "{}",
        r.body
    );
    t.stop().await;

    std::fs::write(&path, registration("@1:localhost:8008")).unwrap();
    let t = TestServer::start_with(|c| {
        c.registration.allow_guest_access = true;
        c.appservices.registration_files = vec![path.clone()];
    })
    .await;
    assert_eq!(register_guest(&t, json!({})).await.user_id, uid("2"));
    t.stop().await;
}
