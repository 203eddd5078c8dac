//! Knocking, restricted joins, room upgrades, space hierarchies, timestamp lookups and
//! reports, asserted with exact values.

mod common;

use common::{TestServer, enc};
use serde_json::{Value, json};

fn member_path(room: &str, user: &str) -> String {
    format!(
        "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
        enc(room),
        enc(user)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn knocks_show_in_sync_and_are_accepted_by_invite() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({ "name": "Knock knock", "room_alias_name": "door" }))
        .await;
    // Invite-only: knocking is refused by the auth rules.
    bob.post(
        &format!("/_matrix/client/v3/knock/{}", enc(&room)),
        &json!({}),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");
    alice
        .put_state(
            &room,
            "m.room.join_rules",
            "",
            json!({ "join_rule": "knock" }),
        )
        .await;
    // Knock by alias, with a reason.
    let alias = format!("#door:{}", common::SERVER_NAME);
    let knocked = bob
        .post(
            &format!("/_matrix/client/v3/knock/{}", enc(&alias)),
            &json!({ "reason": "let me in" }),
        )
        .await
        .ok();
    assert_eq!(knocked, json!({ "room_id": room }));
    // Bob's sync: the room under rooms.knock with the stripped state and his knock.
    let sync = bob.sync("").await;
    let knock = &sync["rooms"]["knock"][&room]["knock_state"]["events"];
    let types: Vec<(&str, &str)> = knock
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap(),
                e["state_key"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        types,
        vec![
            ("m.room.create", ""),
            ("m.room.join_rules", ""),
            ("m.room.name", ""),
            ("m.room.canonical_alias", ""),
            ("m.room.member", bob.user_id.as_str()),
        ]
    );
    let own = knock.as_array().unwrap().last().unwrap();
    assert_eq!(own["content"]["membership"], json!("knock"));
    assert_eq!(own["content"]["reason"], json!("let me in"));
    assert!(sync["rooms"]["join"].get(&room).is_none());
    // Knocking again is a no-op; joining directly is refused (knock needs an invite).
    bob.post(
        &format!("/_matrix/client/v3/knock/{}", enc(&room)),
        &json!({}),
    )
    .await
    .ok();
    bob.post(
        &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
        &json!({}),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");
    // Alice sees the knock in her timeline and accepts it with an invite.
    let m = alice.get(&member_path(&room, &bob.user_id)).await.ok();
    assert_eq!(m["membership"], json!("knock"));
    let since = sync["next_batch"].as_str().unwrap().to_owned();
    alice.invite(&room, &bob.user_id).await;
    let next = bob.sync(&format!("since={since}")).await;
    assert!(next["rooms"]["invite"].get(&room).is_some(), "{next}");
    bob.join(&room).await;
    // Knocking while joined is refused; unknown rooms are 404.
    bob.post(
        &format!("/_matrix/client/v3/knock/{}", enc(&room)),
        &json!({}),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");
    bob.post(
        &format!("/_matrix/client/v3/knock/{}", enc("!nope:localhost:8008")),
        &json!({}),
    )
    .await
    .expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_rooms_admit_members_of_the_allowed_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let space = alice.create_room(json!({ "invite": [bob.user_id] })).await;
    bob.join(&space).await;
    let room = alice
        .create_room(json!({
            "initial_state": [{
                "type": "m.room.join_rules",
                "content": { "join_rule": "restricted", "allow": [{ "type": "m.room_membership", "room_id": space }] },
            }],
        }))
        .await;
    // Bob is in the allowed room: he joins, authorised by alice.
    bob.join(&room).await;
    let m = alice.get(&member_path(&room, &bob.user_id)).await.ok();
    assert_eq!(m["membership"], json!("join"));
    assert_eq!(m["join_authorised_via_users_server"], json!(alice.user_id));
    // Carol is not: refused.
    carol
        .post(
            &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
            &json!({}),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    // An invite still works without the allowed room, and needs no authoriser.
    alice.invite(&room, &carol.user_id).await;
    carol.join(&room).await;
    let m = alice.get(&member_path(&room, &carol.user_id)).await.ok();
    assert_eq!(m, json!({ "membership": "join", "displayname": "carol" }));
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrading_a_room_tombstones_it_and_moves_state_aliases_and_listing() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let old = alice
        .create_room(json!({
            "visibility": "public",
            "name": "Old name",
            "topic": "Old topic",
            "room_alias_name": "upgrade-me",
        }))
        .await;
    bob.join(&old).await;
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/ban", enc(&old)),
            &json!({ "user_id": carol.user_id, "reason": "spam" }),
        )
        .await
        .ok();
    // Bob (level 0) may not upgrade; unknown versions are refused.
    let up = format!("/_matrix/client/v3/rooms/{}/upgrade", enc(&old));
    bob.post(&up, &json!({ "new_version": "11" }))
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .post(&up, &json!({ "new_version": "99" }))
        .await
        .expect_err(400, "M_UNSUPPORTED_ROOM_VERSION");
    alice
        .post(&up, &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");

    let last_before = alice.all_event_ids(&old).await.last().cloned().unwrap();
    let new = alice.post(&up, &json!({ "new_version": "11" })).await.ok()["replacement_room"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(new, old);
    let state = |room: &str, kind: &str, key: &str| {
        let alice = alice.clone();
        let path = if key.is_empty() {
            format!("/_matrix/client/v3/rooms/{}/state/{}", enc(room), kind)
        } else {
            format!(
                "/_matrix/client/v3/rooms/{}/state/{}/{}",
                enc(room),
                kind,
                enc(key)
            )
        };
        async move { alice.get(&path).await.ok() }
    };
    let alias = format!("#upgrade-me:{}", common::SERVER_NAME);
    // The new room: predecessor, copied state, bans, canonical alias.
    let create = state(&new, "m.room.create", "").await;
    assert_eq!(
        create["predecessor"],
        json!({ "room_id": old, "event_id": last_before })
    );
    assert_eq!(create["room_version"], json!("11"));
    assert_eq!(
        state(&new, "m.room.name", "").await,
        json!({ "name": "Old name" })
    );
    assert_eq!(
        state(&new, "m.room.topic", "").await,
        json!({ "topic": "Old topic" })
    );
    assert_eq!(
        state(&new, "m.room.join_rules", "").await,
        json!({ "join_rule": "public" })
    );
    assert_eq!(
        state(&new, "m.room.canonical_alias", "").await,
        json!({ "alias": alias })
    );
    assert_eq!(
        state(&new, "m.room.member", &carol.user_id).await,
        json!({ "membership": "ban", "reason": "spam" })
    );
    let new_pl = state(&new, "m.room.power_levels", "").await;
    assert_eq!(new_pl["users"][&alice.user_id], json!(100));
    // Only alice is in the new room.
    let members = alice
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/joined_members",
            enc(&new)
        ))
        .await
        .ok();
    assert_eq!(members["joined"].as_object().unwrap().len(), 1);
    // The old room: tombstone, no alias, restricted.
    assert_eq!(
        state(&old, "m.room.tombstone", "").await,
        json!({ "body": "This room has been replaced", "replacement_room": new })
    );
    assert_eq!(state(&old, "m.room.canonical_alias", "").await, json!({}));
    let old_pl = state(&old, "m.room.power_levels", "").await;
    assert_eq!(
        (old_pl["events_default"].clone(), old_pl["invite"].clone()),
        (json!(50), json!(50))
    );
    bob.send_txn(
        &old,
        "m.room.message",
        &common::txn(),
        &json!({ "msgtype": "m.text", "body": "hi" }),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");
    // The alias and the directory listing moved.
    let resolved = ts
        .anon()
        .get(&format!(
            "/_matrix/client/v3/directory/room/{}",
            enc(&alias)
        ))
        .await
        .ok();
    assert_eq!(resolved["room_id"], json!(new));
    let listed = ts.anon().get("/_matrix/client/v3/publicRooms").await.ok();
    let ids: Vec<&str> = listed["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["room_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![new.as_str()]);
    // Bob follows the tombstone.
    bob.join(&new).await;
    // Upgrading to v12: the upgrader becomes the creator and is not listed in users.
    let newer = alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/upgrade", enc(&new)),
            &json!({ "new_version": "12" }),
        )
        .await
        .ok()["replacement_room"]
        .as_str()
        .unwrap()
        .to_owned();
    let pl12 = state(&newer, "m.room.power_levels", "").await;
    assert!(pl12["users"].get(&alice.user_id).is_none(), "{pl12}");
    assert_eq!(
        state(&newer, "m.room.create", "").await["predecessor"]["room_id"],
        json!(new)
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn space_hierarchy_walks_visible_children_in_order_with_pagination() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let space = alice
        .create_room(json!({ "preset": "public_chat", "name": "Space", "creation_content": { "type": "m.space" } }))
        .await;
    let public = alice
        .create_room(json!({ "preset": "public_chat", "name": "Public" }))
        .await;
    let private = alice
        .create_room(json!({ "preset": "private_chat", "name": "Private" }))
        .await;
    let sub = alice
        .create_room(json!({ "preset": "public_chat", "name": "Sub", "creation_content": { "type": "m.space" } }))
        .await;
    let deep = alice
        .create_room(json!({ "preset": "public_chat", "name": "Deep" }))
        .await;
    let via = json!([common::SERVER_NAME]);
    // Order: "a" (sub) before "b" (public); private has no order; a child without via
    // does not count.
    alice
        .put_state(
            &space,
            "m.space.child",
            &public,
            json!({ "via": via, "order": "b", "suggested": true }),
        )
        .await;
    alice
        .put_state(
            &space,
            "m.space.child",
            &sub,
            json!({ "via": via, "order": "a" }),
        )
        .await;
    alice
        .put_state(&space, "m.space.child", &private, json!({ "via": via }))
        .await;
    alice
        .put_state(&space, "m.space.child", &deep, json!({}))
        .await;
    alice
        .put_state(&sub, "m.space.child", &deep, json!({ "via": via }))
        .await;

    let h = |user: &common::Client, query: &str| {
        let user = user.clone();
        let path = format!("/_matrix/client/v1/rooms/{}/hierarchy?{query}", enc(&space));
        async move { user.get(&path).await }
    };
    let names = |v: &serde_json::Value| -> Vec<String> {
        v["rooms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect()
    };
    // Alice sees everything, breadth-first.
    let all = h(&alice, "").await.ok();
    assert_eq!(
        names(&all),
        vec!["Space", "Sub", "Public", "Private", "Deep"]
    );
    let children: Vec<&str> = all["rooms"][0]["children_state"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["state_key"].as_str().unwrap())
        .collect();
    assert_eq!(
        children,
        vec![sub.as_str(), public.as_str(), private.as_str()]
    );
    assert!(all["rooms"][0]["children_state"][0]["origin_server_ts"].is_u64());
    assert_eq!(all["rooms"][0]["room_type"], json!("m.space"));
    assert_eq!(all["rooms"][2]["children_state"], json!([]));
    // Bob (not in the private room) does not see it.
    assert_eq!(
        names(&h(&bob, "").await.ok()),
        vec!["Space", "Sub", "Public", "Deep"]
    );
    // max_depth, suggested_only, pagination.
    assert_eq!(names(&h(&alice, "max_depth=0").await.ok()), vec!["Space"]);
    assert_eq!(
        names(&h(&alice, "max_depth=1").await.ok()),
        vec!["Space", "Sub", "Public", "Private"]
    );
    assert_eq!(
        names(&h(&alice, "suggested_only=true").await.ok()),
        vec!["Space", "Public"]
    );
    let p1 = h(&alice, "limit=2").await.ok();
    assert_eq!(names(&p1), vec!["Space", "Sub"]);
    assert_eq!(p1["next_batch"], json!("h2"));
    let p2 = h(&alice, "limit=2&from=h2").await.ok();
    assert_eq!(names(&p2), vec!["Public", "Private"]);
    let p3 = h(&alice, "limit=2&from=h4").await.ok();
    assert_eq!(names(&p3), vec!["Deep"]);
    assert!(p3.get("next_batch").is_none());
    h(&alice, "from=nope")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    // A private space is 403 for a stranger.
    let hidden = alice.create_room(json!({ "preset": "private_chat" })).await;
    bob.get(&format!(
        "/_matrix/client/v1/rooms/{}/hierarchy",
        enc(&hidden)
    ))
    .await
    .expect_err(403, "M_FORBIDDEN");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamp_to_event_finds_the_nearest_visible_event() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({})).await;
    let m1 = alice.send_text(&room, "one").await;
    let m2 = alice.send_text(&room, "two").await;
    let ts_of = |id: &str| {
        let alice = alice.clone();
        let path = format!("/_matrix/client/v3/rooms/{}/event/{}", enc(&room), enc(id));
        async move {
            alice.get(&path).await.ok()["origin_server_ts"]
                .as_u64()
                .unwrap()
        }
    };
    let (t1, t2) = (ts_of(&m1).await, ts_of(&m2).await);
    let q = |t: u64, dir: &str| {
        let alice = alice.clone();
        let path = format!(
            "/_matrix/client/v1/rooms/{}/timestamp_to_event?ts={t}&dir={dir}",
            enc(&room)
        );
        async move { alice.get(&path).await }
    };
    let after_last = q(t2 + 1, "b").await.ok();
    assert_eq!(
        after_last,
        json!({ "event_id": m2, "origin_server_ts": t2 })
    );
    // Forward from m1's time: m1 (or an event at the same ms before it, none here).
    let fwd = q(t1, "f").await.ok();
    assert_eq!(fwd["origin_server_ts"], json!(t1));
    assert_eq!(q(t2 + 1, "f").await.status, 404);
    q(t2, "x").await.expect_err(400, "M_INVALID_PARAM");
    alice
        .get(&format!(
            "/_matrix/client/v1/rooms/{}/timestamp_to_event?dir=f",
            enc(&room)
        ))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    // Before the room existed: nothing backwards.
    q(1, "b").await.expect_err(404, "M_NOT_FOUND");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_need_a_visible_event_and_rooms_do_not_leak() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let ev = alice.send_text(&room, "bad words").await;
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/report/{}",
            enc(&room),
            enc(&ev)
        ),
        &json!({ "reason": "rude", "score": -100 }),
    )
    .await
    .ok();
    let eve = ts.register("eve").await;
    let private = alice.create_room(json!({})).await;
    let secret = alice.send_text(&private, "secret").await;
    eve.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/report/{}",
            enc(&private),
            enc(&secret)
        ),
        &json!({ "reason": "?" }),
    )
    .await
    .expect_err(404, "M_NOT_FOUND");
    // A room report answers the same for a real and an unknown room.
    let real = eve
        .post(
            &format!("/_matrix/client/v3/rooms/{}/report", enc(&private)),
            &json!({ "reason": "x" }),
        )
        .await
        .ok();
    let ghost = eve
        .post(
            &format!(
                "/_matrix/client/v3/rooms/{}/report",
                enc("!ghost:localhost:8008")
            ),
            &json!({ "reason": "x" }),
        )
        .await
        .ok();
    assert_eq!((real, ghost), (json!({}), json!({})));
    // The journal holds exactly the two accepted reports, in order.
    let reports: Vec<spindle_journal::Fact> = ts
        .server
        .journal
        .read_after(0, 10_000)
        .unwrap()
        .iter()
        .filter_map(|r| r.fact())
        .filter(|f| matches!(f, spindle_journal::Fact::ContentReported { .. }))
        .collect();
    assert_eq!(
        reports,
        vec![
            spindle_journal::Fact::ContentReported {
                reporter: bob.user_id.clone(),
                room_id: room.clone(),
                event_id: Some(ev.clone()),
                reason: Some("rude".into()),
                score: Some(-100),
            },
            spindle_journal::Fact::ContentReported {
                reporter: eve.user_id.clone(),
                room_id: private.clone(),
                event_id: None,
                reason: Some("x".into()),
                score: None,
            },
        ]
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canonical_alias_and_alt_aliases_must_point_to_the_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice
        .create_room(json!({ "room_alias_name": "here" }))
        .await;
    let other = alice
        .create_room(json!({ "room_alias_name": "there" }))
        .await;
    let here = format!("#here:{}", common::SERVER_NAME);
    let there = format!("#there:{}", common::SERVER_NAME);
    let second = format!("#second:{}", common::SERVER_NAME);
    alice
        .put(
            &format!("/_matrix/client/v3/directory/room/{}", enc(&second)),
            &json!({ "room_id": room }),
        )
        .await
        .ok();
    let put = |content: serde_json::Value| {
        let alice = alice.clone();
        let path = format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.canonical_alias",
            enc(&room)
        );
        async move { alice.put(&path, &content).await }
    };
    // Both aliases point here: accepted and stored as sent.
    put(json!({ "alias": here, "alt_aliases": [second] }))
        .await
        .ok();
    let stored = alice
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.canonical_alias",
            enc(&room)
        ))
        .await
        .ok();
    assert_eq!(stored, json!({ "alias": here, "alt_aliases": [second] }));
    // An alt alias of another room, an unknown alias, another server's alias: M_BAD_ALIAS.
    for bad in [
        json!({ "alias": here, "alt_aliases": [there] }),
        json!({ "alias": format!("#missing:{}", common::SERVER_NAME) }),
        json!({ "alt_aliases": ["#elsewhere:remote.example"] }),
    ] {
        put(bad).await.expect_err(400, "M_BAD_ALIAS");
    }
    // Bad syntax: M_INVALID_PARAM; a non-list: M_BAD_JSON.
    put(json!({ "alt_aliases": ["not-an-alias"] }))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    put(json!({ "alt_aliases": "x" }))
        .await
        .expect_err(400, "M_BAD_JSON");
    // createRoom: initial_state may only name the alias created with the room.
    alice
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "initial_state": [{ "type": "m.room.canonical_alias", "content": { "alias": there } }] }),
        )
        .await
        .expect_err(400, "M_BAD_ALIAS");
    let _ = other;

    // Deleting an alias takes it out of the canonical alias event (issue 15 item 5,
    // as Synapse): first an alt alias, then the main one.
    let canonical = || {
        let alice = alice.clone();
        let path = format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.canonical_alias",
            enc(&room)
        );
        async move { alice.get(&path).await.ok() }
    };
    let delete = |alias: String| {
        let alice = alice.clone();
        async move {
            alice
                .request(
                    reqwest::Method::DELETE,
                    &format!("/_matrix/client/v3/directory/room/{}", enc(&alias)),
                    None,
                )
                .await
                .ok()
        }
    };
    delete(second.clone()).await;
    assert_eq!(canonical().await, json!({ "alias": here }));
    delete(here.clone()).await;
    assert_eq!(canonical().await, json!({}));
    let state = alice
        .get(&format!("/_matrix/client/v3/rooms/{}/state", enc(&room)))
        .await
        .ok();
    let senders: Vec<&Value> = state
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.canonical_alias")
        .map(|e| &e["sender"])
        .collect();
    assert_eq!(senders, vec![&json!(alice.user_id)]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_summary_shows_only_rooms_one_may_see_or_join() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let public = alice
        .create_room(json!({ "preset": "public_chat", "name": "Open", "room_alias_name": "open" }))
        .await;
    let private = alice.create_room(json!({ "name": "Hidden" })).await;
    let summary = |c: &common::Client, target: &str| {
        let c = c.clone();
        let path = format!("/_matrix/client/v1/room_summary/{}", enc(target));
        async move { c.get(&path).await }
    };
    // Without a token: the public room (by alias), no membership field.
    let anon = summary(&ts.anon(), &format!("#open:{}", common::SERVER_NAME))
        .await
        .ok();
    assert_eq!(
        anon,
        json!({
            "room_id": public,
            "num_joined_members": 1,
            "world_readable": false,
            "guest_can_join": false,
            "name": "Open",
            "canonical_alias": format!("#open:{}", common::SERVER_NAME),
            "join_rule": "public",
            "room_version": "10",
        })
    );
    summary(&ts.anon(), &private)
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Bob: the public room with his membership ("leave": none yet); the private one 404.
    assert_eq!(
        summary(&bob, &public).await.ok()["membership"],
        json!("leave")
    );
    summary(&bob, &private).await.expect_err(404, "M_NOT_FOUND");
    summary(&bob, "!nope:localhost:8008")
        .await
        .expect_err(404, "M_NOT_FOUND");
    // Invited: visible, membership invite.
    alice.invite(&private, &bob.user_id).await;
    let invited = summary(&bob, &private).await.ok();
    assert_eq!(
        (invited["name"].clone(), invited["membership"].clone()),
        (json!("Hidden"), json!("invite"))
    );
    // A bad token is an error, not an anonymous read.
    ts.anon()
        .with_token(Some("spt_nope"))
        .get(&format!("/_matrix/client/v1/room_summary/{}", enc(&public)))
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    ts.stop().await;
}
