//! Presence, the user directory and the published room directory, asserted with
//! exact values.

mod common;

use common::{TestServer, enc, uid};
use serde_json::{Value, json};

fn presence_of(sync: &Value) -> Vec<(String, String, Option<String>)> {
    let mut out: Vec<(String, String, Option<String>)> = sync["presence"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert_eq!(e["type"], json!("m.presence"));
            (
                e["sender"].as_str().unwrap().to_owned(),
                e["content"]["presence"].as_str().unwrap().to_owned(),
                e["content"]["status_msg"].as_str().map(str::to_owned),
            )
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_is_shared_with_room_mates_only() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;

    // Bob sets a status; alice (room-mate) reads it, carol (stranger) may not.
    bob.put(
        &format!("/_matrix/client/v3/presence/{}/status", enc(&bob.user_id)),
        &json!({ "presence": "unavailable", "status_msg": "lunch" }),
    )
    .await
    .ok();
    let status = alice
        .get(&format!(
            "/_matrix/client/v3/presence/{}/status",
            enc(&bob.user_id)
        ))
        .await
        .ok();
    assert_eq!(status["presence"], json!("unavailable"));
    assert_eq!(status["status_msg"], json!("lunch"));
    assert_eq!(status["currently_active"], json!(false));
    assert!(status["last_active_ago"].as_u64().is_some());
    carol
        .get(&format!(
            "/_matrix/client/v3/presence/{}/status",
            enc(&bob.user_id)
        ))
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .get(&format!(
            "/_matrix/client/v3/presence/{}/status",
            enc(&uid("nobody"))
        ))
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .put(
            &format!("/_matrix/client/v3/presence/{}/status", enc(&bob.user_id)),
            &json!({ "presence": "online" }),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .put(
            &format!("/_matrix/client/v3/presence/{}/status", enc(&alice.user_id)),
            &json!({ "presence": "away" }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");

    // Alice's initial sync (set_presence=offline: she does not mark herself online)
    // shows bob only; carol's shows nobody.
    let first = alice.sync("set_presence=offline").await;
    assert_eq!(
        presence_of(&first),
        vec![(
            bob.user_id.clone(),
            "unavailable".into(),
            Some("lunch".into())
        )]
    );
    let carol_sync = carol.sync("").await;
    // Carol shares no room with anyone: no presence at all (not even her own).
    assert_eq!(presence_of(&carol_sync), vec![]);

    // An incremental sync carries only changes: bob goes online through his own sync.
    let since = first["next_batch"].as_str().unwrap().to_owned();
    let quiet = alice
        .sync(&format!("since={since}&set_presence=offline"))
        .await;
    assert_eq!(presence_of(&quiet), vec![]);
    bob.sync("").await;
    let next = alice
        .sync(&format!("since={since}&set_presence=offline&timeout=5000"))
        .await;
    assert_eq!(
        presence_of(&next),
        vec![(bob.user_id.clone(), "online".into(), Some("lunch".into()))]
    );
    // A filter that excludes presence events.
    let filtered = alice
        .sync(&format!(
            "since={since}&set_presence=offline&filter={}",
            enc(r#"{"presence":{"not_types":["*"]}}"#)
        ))
        .await;
    assert_eq!(presence_of(&filtered), vec![]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_reaches_users_who_newly_share_a_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    let status = |c: &common::Client, presence: &str, msg: &str| {
        let c = c.clone();
        let body = json!({ "presence": presence, "status_msg": msg });
        async move {
            c.put(
                &format!("/_matrix/client/v3/presence/{}/status", enc(&c.user_id)),
                &body,
            )
            .await
            .ok();
        }
    };
    status(&alice, "unavailable", "at work").await;
    status(&bob, "online", "coding").await;
    // Both sync (without touching their presence) while they share no room.
    let quiet = "set_presence=offline";
    let a = alice.sync(quiet).await;
    let b = bob.sync(quiet).await;
    assert_eq!(
        presence_of(&a),
        vec![(
            alice.user_id.clone(),
            "unavailable".into(),
            Some("at work".into())
        )]
    );
    assert_eq!(presence_of(&b), vec![]);
    let a_since = a["next_batch"].as_str().unwrap().to_owned();
    let b_since = b["next_batch"].as_str().unwrap().to_owned();
    // Bob joins: neither presence changed, yet each one's next sync carries the other's.
    bob.join(&room).await;
    let a2 = alice.sync(&format!("since={a_since}&{quiet}")).await;
    assert_eq!(
        presence_of(&a2),
        vec![(bob.user_id.clone(), "online".into(), Some("coding".into()))]
    );
    let b2 = bob.sync(&format!("since={b_since}&{quiet}")).await;
    assert_eq!(
        presence_of(&b2),
        vec![(
            alice.user_id.clone(),
            "unavailable".into(),
            Some("at work".into())
        )]
    );
    // Once sent, it is not repeated.
    let a3 = alice
        .sync(&format!(
            "since={}&{quiet}",
            a2["next_batch"].as_str().unwrap()
        ))
        .await;
    assert_eq!(presence_of(&a3), vec![]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_can_be_turned_off() {
    let ts = TestServer::start_with(|c| c.presence.enabled = false).await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    bob.put(
        &format!("/_matrix/client/v3/presence/{}/status", enc(&bob.user_id)),
        &json!({ "presence": "online", "status_msg": "here" }),
    )
    .await
    .ok();
    let status = alice
        .get(&format!(
            "/_matrix/client/v3/presence/{}/status",
            enc(&bob.user_id)
        ))
        .await
        .ok();
    assert_eq!(status, json!({ "presence": "offline" }));
    assert_eq!(presence_of(&alice.sync("").await), vec![]);
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_directory_finds_room_mates_and_public_room_members() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await; // shares a private room with alice
    let carol = ts.register("carol").await; // in a public room alice is not in
    let dave = ts.register("dave").await; // in a private room alice is not in
    let _erin = ts.register("erin").await; // in no room at all
    for (c, name) in [
        (&bob, "Bobby Tables"),
        (&carol, "Carol Bobbitt"),
        (&dave, "Bob Dave"),
    ] {
        c.put(
            &format!("/_matrix/client/v3/profile/{}/displayname", enc(&c.user_id)),
            &json!({ "displayname": name }),
        )
        .await
        .ok();
    }
    let private = alice.create_room(json!({ "invite": [bob.user_id] })).await;
    bob.join(&private).await;
    carol.create_room(json!({ "preset": "public_chat" })).await;
    dave.create_room(json!({ "preset": "private_chat" })).await;

    let search = |term: &str, limit: u64| {
        let alice = alice.clone();
        let term = term.to_owned();
        async move {
            alice
                .post(
                    "/_matrix/client/v3/user_directory/search",
                    &json!({ "search_term": term, "limit": limit }),
                )
                .await
                .ok()
        }
    };
    let found = search("bob", 10).await;
    assert_eq!(
        found,
        json!({
            "results": [
                { "user_id": uid("bob"), "display_name": "Bobby Tables" },
                { "user_id": uid("carol"), "display_name": "Carol Bobbitt" },
            ],
            "limited": false,
        })
    );
    let one = search("bob", 1).await;
    assert_eq!(one["results"].as_array().unwrap().len(), 1);
    assert_eq!(one["results"][0]["user_id"], json!(uid("bob")));
    assert_eq!(one["limited"], json!(true));
    // Every word must match.
    let both = search("carol bobb", 10).await;
    assert_eq!(both["results"][0]["user_id"], json!(uid("carol")));
    assert_eq!(both["results"].as_array().unwrap().len(), 1);
    assert_eq!(search("erin", 10).await["results"], json!([]));
    assert_eq!(search("dave", 10).await["results"], json!([]));
    // The searcher is never among the results, even where a room-mate matches too
    // (and even sitting in a public room).
    alice
        .put(
            &format!(
                "/_matrix/client/v3/profile/{}/displayname",
                enc(&alice.user_id)
            ),
            &json!({ "displayname": "Alice Bobson" }),
        )
        .await
        .ok();
    let public = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&public).await;
    assert_eq!(search("alice", 10).await["results"], json!([]));
    assert_eq!(
        search("bobs", 10).await,
        json!({ "results": [], "limited": false })
    );
    assert_eq!(
        bob.post(
            "/_matrix/client/v3/user_directory/search",
            &json!({ "search_term": "bob" }),
        )
        .await
        .ok(),
        json!({
            "results": [
                { "user_id": uid("alice"), "display_name": "Alice Bobson" },
                { "user_id": uid("carol"), "display_name": "Carol Bobbitt" },
            ],
            "limited": false,
        })
    );
    alice
        .post("/_matrix/client/v3/user_directory/search", &json!({}))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_room_directory_publishes_lists_filters_and_paginates() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    // Three published rooms: "big" has 2 members, the others 1; one is a space.
    let big = alice
        .create_room(json!({ "visibility": "public", "name": "Big Room", "topic": "lots of people", "room_alias_name": "big" }))
        .await;
    bob.join(&big).await;
    let small = alice
        .create_room(json!({ "visibility": "public", "name": "Small Room" }))
        .await;
    let space = alice
        .create_room(json!({ "visibility": "public", "name": "A Space", "creation_content": { "type": "m.space" } }))
        .await;
    // Public join rule but not published: not listed.
    let unlisted = alice.create_room(json!({ "preset": "public_chat" })).await;

    let vis = |room: &str| format!("/_matrix/client/v3/directory/list/room/{}", enc(room));
    assert_eq!(
        ts.anon().get(&vis(&big)).await.ok(),
        json!({ "visibility": "public" })
    );
    assert_eq!(
        ts.anon().get(&vis(&unlisted)).await.ok(),
        json!({ "visibility": "private" })
    );

    let all = ts.anon().get("/_matrix/client/v3/publicRooms").await.ok();
    assert_eq!(all["total_room_count_estimate"], json!(3));
    let mut rest = [small.clone(), space.clone()];
    rest.sort();
    let order: Vec<&str> = all["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["room_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        vec![big.as_str(), rest[0].as_str(), rest[1].as_str()]
    );
    assert_eq!(
        all["chunk"][0],
        json!({
            "room_id": big,
            "num_joined_members": 2,
            "world_readable": false,
            "guest_can_join": false,
            "name": "Big Room",
            "topic": "lots of people",
            "canonical_alias": format!("#big:{}", common::SERVER_NAME),
            "join_rule": "public",
        })
    );
    assert!(all.get("next_batch").is_none() && all.get("prev_batch").is_none());

    // Pages of one.
    let p1 = ts
        .anon()
        .get("/_matrix/client/v3/publicRooms?limit=1")
        .await
        .ok();
    assert_eq!(p1["chunk"][0]["room_id"], json!(big));
    assert_eq!(p1["next_batch"], json!("p1"));
    let p2 = ts
        .anon()
        .get("/_matrix/client/v3/publicRooms?limit=1&since=p1")
        .await
        .ok();
    assert_eq!(p2["chunk"][0]["room_id"], json!(rest[0]));
    assert_eq!(
        (p2["next_batch"].clone(), p2["prev_batch"].clone()),
        (json!("p2"), json!("p0"))
    );
    let p3 = ts
        .anon()
        .get("/_matrix/client/v3/publicRooms?limit=1&since=p2")
        .await
        .ok();
    assert_eq!(p3["chunk"][0]["room_id"], json!(rest[1]));
    assert!(p3.get("next_batch").is_none());
    ts.anon()
        .get("/_matrix/client/v3/publicRooms?since=garbage")
        .await
        .expect_err(400, "M_INVALID_PARAM");

    // Filters (POST): search term and room types.
    let found = alice
        .post(
            "/_matrix/client/v3/publicRooms",
            &json!({ "filter": { "generic_search_term": "SMALL" } }),
        )
        .await
        .ok();
    assert_eq!(found["chunk"].as_array().unwrap().len(), 1);
    assert_eq!(found["chunk"][0]["room_id"], json!(small));
    let spaces = alice
        .post(
            "/_matrix/client/v3/publicRooms",
            &json!({ "filter": { "room_types": ["m.space"] } }),
        )
        .await
        .ok();
    assert_eq!(spaces["chunk"].as_array().unwrap().len(), 1);
    assert_eq!(spaces["chunk"][0]["room_type"], json!("m.space"));
    let untyped = alice
        .post(
            "/_matrix/client/v3/publicRooms",
            &json!({ "filter": { "room_types": [null] } }),
        )
        .await
        .ok();
    assert_eq!(untyped["chunk"].as_array().unwrap().len(), 2);

    // Unpublish needs power in the room: bob (joined, level 0) may not, alice may.
    bob.put(&vis(&small), &json!({ "visibility": "private" }))
        .await
        .expect_err(403, "M_FORBIDDEN");
    bob.put(&vis(&big), &json!({ "visibility": "private" }))
        .await
        .expect_err(403, "M_FORBIDDEN");
    alice
        .put(&vis(&small), &json!({ "visibility": "private" }))
        .await
        .ok();
    alice
        .put(&vis(&unlisted), &json!({ "visibility": "public" }))
        .await
        .ok();
    let after = ts.anon().get("/_matrix/client/v3/publicRooms").await.ok();
    let listed: std::collections::BTreeSet<&str> = after["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["room_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        [big.as_str(), space.as_str(), unlisted.as_str()]
            .into_iter()
            .collect()
    );
    alice
        .put(
            &vis("!nope:localhost:8008"),
            &json!({ "visibility": "public" }),
        )
        .await
        .expect_err(404, "M_NOT_FOUND");
    alice
        .put(&vis(&big), &json!({ "visibility": "secret" }))
        .await
        .expect_err(400, "M_BAD_JSON");
    // `server=` another server is asked over federation: tests/federation_features.rs.
    ts.stop().await;
}
