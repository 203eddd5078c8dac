//! End-to-end encryption transport (issue 4): device keys (`/keys/upload`, `query`,
//! `claim`, `changes`), their `/sync` sections, and to-device messaging. Every answer
//! is checked with exact values.

mod common;

use std::collections::BTreeSet;

use common::{Client, TestServer, device_keys, enc, sync_pos, txn, uid};
use serde_json::{Value, json};

const V3: &str = "/_matrix/client/v3";

/// Uploads `n` signed curve25519 one-time keys named `<prefix>NNN`.
async fn upload_otks(c: &Client, key: &common::TestKey, prefix: &str, n: usize) -> Value {
    let mut otks = serde_json::Map::new();
    for i in 0..n {
        let k = key.sign(&c.user_id, json!({ "key": format!("otk-{prefix}{i:03}") }));
        otks.insert(format!("signed_curve25519:{prefix}{i:03}"), k);
    }
    c.post(
        &format!("{V3}/keys/upload"),
        &json!({ "one_time_keys": otks }),
    )
    .await
    .ok()
}

async fn claim_one(c: &Client, user: &str, device: &str) -> Value {
    c.post(
        &format!("{V3}/keys/claim"),
        &json!({ "one_time_keys": { user: { device: "signed_curve25519" } } }),
    )
    .await
    .ok()
}

fn claimed_id(v: &Value, user: &str, device: &str) -> Option<String> {
    v["one_time_keys"][user][device]
        .as_object()
        .and_then(|m| m.keys().next().cloned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_upload_query_claim_and_fallback_have_exact_values() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let (keys, key) = device_keys(&alice);
    let fallback = key.sign(
        &alice.user_id,
        json!({ "key": "fallback-1", "fallback": true }),
    );
    let up = alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys, "fallback_keys": { "signed_curve25519:FB1": fallback } }),
        )
        .await
        .ok();
    assert_eq!(
        up,
        json!({ "one_time_key_counts": { "signed_curve25519": 0 } })
    );
    let up = upload_otks(&alice, &key, "K", 3).await;
    assert_eq!(
        up,
        json!({ "one_time_key_counts": { "signed_curve25519": 3 } })
    );
    // Re-uploading an id the device already has changes nothing.
    let up = upload_otks(&alice, &key, "K", 1).await;
    assert_eq!(up["one_time_key_counts"]["signed_curve25519"], 3);

    // Query: every device, with the display name under `unsigned`; other servers fail.
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [], "@x:elsewhere.example": [], uid("nobody"): [] } }),
        )
        .await
        .ok();
    let got = &q["device_keys"][&alice.user_id][&alice.device_id];
    assert_eq!(got["keys"], keys["keys"]);
    assert_eq!(got["signatures"], keys["signatures"]);
    assert_eq!(q["device_keys"][uid("nobody")], json!({}));
    assert_eq!(
        q["failures"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        vec!["elsewhere.example"]
    );
    // Naming a device that has no keys gives nothing for it.
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): ["NOPE"] } }),
        )
        .await
        .ok();
    assert_eq!(q["device_keys"][&alice.user_id], json!({}));

    // Alice's sync shows her counts and her unused fallback key.
    let s = alice.sync("").await;
    assert_eq!(
        s["device_one_time_keys_count"],
        json!({ "signed_curve25519": 3 })
    );
    assert_eq!(
        s["device_unused_fallback_key_types"],
        json!(["signed_curve25519"])
    );

    // Claims hand out K000, K001, K002 in order, then the fallback key (twice: it stays).
    let mut ids = Vec::new();
    for _ in 0..5 {
        let c = claim_one(&bob, &alice.user_id, &alice.device_id).await;
        assert_eq!(c["failures"], json!({}));
        ids.push(claimed_id(&c, &alice.user_id, &alice.device_id).unwrap());
    }
    assert_eq!(
        ids,
        vec![
            "signed_curve25519:K000",
            "signed_curve25519:K001",
            "signed_curve25519:K002",
            "signed_curve25519:FB1",
            "signed_curve25519:FB1"
        ]
    );
    let c = claim_one(&bob, &alice.user_id, &alice.device_id).await;
    assert_eq!(
        c["one_time_keys"][&alice.user_id][&alice.device_id]["signed_curve25519:FB1"]["key"],
        "fallback-1"
    );
    let s = alice.sync("").await;
    assert_eq!(
        s["device_one_time_keys_count"],
        json!({ "signed_curve25519": 0 })
    );
    assert_eq!(s["device_unused_fallback_key_types"], json!([]));
    // A device with no keys of that algorithm gives nothing.
    let c = bob
        .post(
            &format!("{V3}/keys/claim"),
            &json!({ "one_time_keys": { alice.user_id.clone(): { "NOPE": "signed_curve25519" } } }),
        )
        .await
        .ok();
    assert_eq!(c, json!({ "one_time_keys": {}, "failures": {} }));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_device_keys_are_refused() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    // A signature the server cannot check is the client's to judge (issue 15 item 6,
    // as Synapse): stored and served as uploaded.
    let (mut keys, _) = device_keys(&alice);
    keys["keys"][format!("curve25519:{}", alice.device_id)] = json!("tampered");
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys }),
        )
        .await
        .ok();
    let q = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(
        q["device_keys"][&alice.user_id][&alice.device_id]["keys"]
            [format!("curve25519:{}", alice.device_id)],
        "tampered"
    );
    let (mut keys, _) = device_keys(&alice);
    keys["signatures"] = json!("none");
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    let (mut keys, _) = device_keys(&alice);
    keys["device_id"] = json!("OTHER");
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "one_time_keys": { "no-colon": {} } }),
        )
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .post(&format!("{V3}/keys/query"), &json!({}))
        .await
        .expect_err(400, "M_BAD_JSON");
    alice
        .get(&format!("{V3}/keys/changes?from=s0_0"))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    srv.stop().await;
}

/// N concurrent claims against one device with fewer one-time keys than claims: every
/// one-time key is handed out exactly once, the rest get the fallback key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_never_hand_out_a_key_twice() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let (keys, key) = device_keys(&alice);
    let fallback = key.sign(&alice.user_id, json!({ "key": "fb", "fallback": true }));
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys, "fallback_keys": { "signed_curve25519:FB": fallback } }),
        )
        .await
        .ok();
    upload_otks(&alice, &key, "R", 40).await;
    let mut claimers = Vec::new();
    for i in 0..4 {
        claimers.push(srv.register(&format!("claimer{i}")).await);
    }
    let mut tasks = Vec::new();
    for i in 0..48 {
        let c = claimers[i % claimers.len()].clone();
        let (user, device) = (alice.user_id.clone(), alice.device_id.clone());
        tasks.push(tokio::spawn(async move {
            claimed_id(&claim_one(&c, &user, &device).await, &user, &device).unwrap()
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    let one_time: Vec<&String> = got.iter().filter(|k| !k.ends_with(":FB")).collect();
    let distinct: BTreeSet<&String> = one_time.iter().copied().collect();
    assert_eq!(one_time.len(), 40, "every one-time key handed out: {got:?}");
    assert_eq!(
        distinct.len(),
        40,
        "no one-time key handed out twice: {got:?}"
    );
    assert_eq!(
        got.len() - one_time.len(),
        8,
        "the rest got the fallback key"
    );
    let s = alice.sync("").await;
    assert_eq!(
        s["device_one_time_keys_count"],
        json!({ "signed_curve25519": 0 })
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_list_changes_reach_only_users_who_share_a_room() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let carol = srv.register("carol").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let a0 = alice.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    let c0 = carol.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();

    let (keys, _) = device_keys(&bob);
    bob.post(
        &format!("{V3}/keys/upload"),
        &json!({ "device_keys": keys }),
    )
    .await
    .ok();
    let a1 = alice.sync(&format!("since={a0}")).await;
    assert_eq!(
        a1["device_lists"],
        json!({ "changed": [bob.user_id], "left": [] })
    );
    let c1 = carol.sync(&format!("since={c0}")).await;
    assert_eq!(c1["device_lists"], json!({ "changed": [], "left": [] }));
    let a1_token = a1["next_batch"].as_str().unwrap().to_owned();
    let ch = alice
        .get(&format!("{V3}/keys/changes?from={a0}&to={a1_token}"))
        .await
        .ok();
    assert_eq!(ch, json!({ "changed": [bob.user_id], "left": [] }));
    // Bob's own device sees his own change.
    let own = bob.sync(&format!("since={a0}")).await;
    assert_eq!(own["device_lists"]["changed"], json!([bob.user_id]));

    // Carol joins: Alice hears of her (she now shares a room), Carol hears of both.
    carol.join(&room).await;
    let a2 = alice.sync(&format!("since={a1_token}")).await;
    assert_eq!(a2["device_lists"]["changed"], json!([carol.user_id]));
    let c2 = carol.sync(&format!("since={c0}")).await;
    let mut both = vec![alice.user_id.clone(), bob.user_id.clone()];
    both.sort();
    assert_eq!(c2["device_lists"], json!({ "changed": both, "left": [] }));

    // Bob leaves: he no longer shares a room with Alice.
    let a2_token = a2["next_batch"].as_str().unwrap().to_owned();
    bob.leave(&room).await;
    let a3 = alice.sync(&format!("since={a2_token}")).await;
    assert_eq!(
        a3["device_lists"],
        json!({ "changed": [], "left": [bob.user_id] })
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_device_deletes_its_keys_and_changes_the_device_list() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let bob2 = srv.login("bob", Some("BOB2")).await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    for c in [&bob, &bob2] {
        let (keys, key) = device_keys(c);
        c.post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys }),
        )
        .await
        .ok();
        upload_otks(c, &key, "D", 2).await;
    }
    let a0 = alice.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    bob2.post(&format!("{V3}/logout"), &json!({})).await.ok();
    let q = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { bob.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(
        q["device_keys"][&bob.user_id]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        vec![&bob.device_id]
    );
    let a1 = alice.sync(&format!("since={a0}")).await;
    assert_eq!(a1["device_lists"]["changed"], json!([bob.user_id]));
    let c = claim_one(&alice, &bob.user_id, "BOB2").await;
    assert_eq!(c["one_time_keys"], json!({}));
    srv.stop().await;
}

async fn send_to_device(c: &Client, txn_id: &str, messages: Value) -> common::Resp {
    c.put(
        &format!("{V3}/sendToDevice/m.test/{}", enc(txn_id)),
        &json!({ "messages": messages }),
    )
    .await
}

fn to_device_bodies(sync: &Value) -> Vec<String> {
    sync["to_device"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["content"]["body"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn to_device_is_delivered_until_acknowledged_then_never_again() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let bob2 = srv.login("bob", Some("BOB2")).await;
    let t = txn();
    send_to_device(
        &alice,
        &t,
        json!({ bob.user_id.clone(): { bob.device_id.clone(): { "body": "one" } } }),
    )
    .await
    .ok();
    // The same txn again is the same send.
    send_to_device(
        &alice,
        &t,
        json!({ bob.user_id.clone(): { bob.device_id.clone(): { "body": "one" } } }),
    )
    .await
    .ok();
    send_to_device(
        &alice,
        &txn(),
        json!({ bob.user_id.clone(): { "*": { "body": "all" } }, "@x:elsewhere.example": { "D": { "body": "remote" } } }),
    )
    .await
    .ok();
    let s1 = bob.sync("").await;
    assert_eq!(to_device_bodies(&s1), vec!["one", "all"]);
    assert_eq!(
        s1["to_device"]["events"][0],
        json!({ "sender": alice.user_id, "type": "m.test", "content": { "body": "one" } })
    );
    assert_eq!(to_device_bodies(&bob2.sync("").await), vec!["all"]);
    // Not acknowledged yet: an initial sync delivers them again.
    assert_eq!(to_device_bodies(&bob.sync("").await), vec!["one", "all"]);
    // Syncing with the token acknowledges them: never again.
    let token = s1["next_batch"].as_str().unwrap();
    let s2 = bob.sync(&format!("since={token}")).await;
    assert_eq!(to_device_bodies(&s2), Vec::<String>::new());
    assert_eq!(to_device_bodies(&bob.sync("").await), Vec::<String>::new());
    // Bob's other device still has its copy.
    assert_eq!(to_device_bodies(&bob2.sync("").await), vec!["all"]);
    // Bad bodies.
    send_to_device(&alice, &txn(), json!({ "not-a-user": {} }))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .put(&format!("{V3}/sendToDevice/m.test/{}", txn()), &json!({}))
        .await
        .expect_err(400, "M_BAD_JSON");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_page_of_to_device_messages_continues_in_the_next_sync() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let before = bob.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    for i in 0..130 {
        send_to_device(
            &alice,
            &txn(),
            json!({ bob.user_id.clone(): { bob.device_id.clone(): { "body": format!("m{i}") } } }),
        )
        .await
        .ok();
    }
    let s1 = bob.sync(&format!("since={before}")).await;
    let first = to_device_bodies(&s1);
    assert_eq!(first.len(), 100);
    assert_eq!(first[0], "m0");
    assert_eq!(first[99], "m99");
    let t1 = s1["next_batch"].as_str().unwrap().to_owned();
    assert_eq!(
        t1.split('_').count(),
        3,
        "token carries the to-device position: {t1}"
    );
    let s2 = bob.sync(&format!("since={t1}&timeout=10000")).await;
    let second = to_device_bodies(&s2);
    assert_eq!(second.len(), 30);
    assert_eq!(second[0], "m100");
    let t2 = s2["next_batch"].as_str().unwrap().to_owned();
    assert_eq!(t2.split('_').count(), 2);
    assert!(sync_pos(&t2) >= sync_pos(&t1));
    let s3 = bob.sync(&format!("since={t2}")).await;
    assert_eq!(to_device_bodies(&s3), Vec::<String>::new());
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_sync_wakes_for_a_to_device_message() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let token = bob.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    let waiter = {
        let bob = bob.clone();
        tokio::spawn(async move { bob.sync(&format!("since={token}&timeout=30000")).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    send_to_device(
        &alice,
        &txn(),
        json!({ bob.user_id.clone(): { bob.device_id.clone(): { "body": "wake" } } }),
    )
    .await
    .ok();
    let s = tokio::time::timeout(std::time::Duration::from_secs(20), waiter)
        .await
        .expect("the long-poll answered before its timeout")
        .unwrap();
    assert_eq!(to_device_bodies(&s), vec!["wake"]);
    srv.stop().await;
}

/// BRIEF §3.9: device key changes of users who share no room with the syncing user
/// cost its incremental sync nothing (the change logs are per room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_key_uploads_cost_an_incremental_sync_nothing() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let dave = srv.register("dave").await;
    let room = alice.create_room(json!({})).await;
    dave.create_room(json!({})).await;
    let reads = || {
        let st = srv.server.projections.db.stats();
        st.total()
    };
    let mut measured = Vec::new();
    for (round, uploads) in [(0, 0usize), (1, 12)] {
        let since = alice.sync("").await["next_batch"]
            .as_str()
            .unwrap()
            .to_owned();
        for i in 0..uploads {
            let d = srv.login("dave", Some(&format!("D{round}{i}"))).await;
            let (keys, _) = device_keys(&d);
            d.post(
                &format!("{V3}/keys/upload"),
                &json!({ "device_keys": keys }),
            )
            .await
            .ok();
        }
        alice.send_text(&room, &format!("round {round}")).await;
        // Settle: a request waits for the projections to catch up.
        alice.get(&format!("{V3}/account/whoami")).await.ok();
        let before = reads();
        let v = alice.sync(&format!("since={since}")).await;
        measured.push(reads() - before);
        assert_eq!(v["device_lists"], json!({ "changed": [], "left": [] }));
        assert_eq!(sync_timeline_len(&v, &room), 1);
    }
    assert_eq!(
        measured[0], measured[1],
        "strangers' key uploads changed an incremental sync's store reads: {measured:?}"
    );
    srv.stop().await;
}

fn sync_timeline_len(v: &Value, room: &str) -> usize {
    v["rooms"]["join"][room]["timeline"]["events"]
        .as_array()
        .map(|a| a.len())
        .unwrap_or(0)
}

/// A cross-signing key object of `usage` for `user`, signed by `signers`.
fn cs_key(user: &str, usage: &str, key: &common::TestKey, signers: &[&common::TestKey]) -> Value {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_signing_keys_and_signatures_are_checked_and_served() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let (keys, _) = device_keys(&alice);
    alice
        .post(
            &format!("{V3}/keys/upload"),
            &json!({ "device_keys": keys }),
        )
        .await
        .ok();
    let (master, ssk, usk) = (
        common::TestKey::new(None),
        common::TestKey::new(None),
        common::TestKey::new(None),
    );
    let master_obj = cs_key(&alice.user_id, "master", &master, &[]);
    let ssk_obj = cs_key(&alice.user_id, "self_signing", &ssk, &[&master]);
    let usk_obj = cs_key(&alice.user_id, "user_signing", &usk, &[&master]);
    // A self-signing key not signed by the master key is refused.
    let unsigned_ssk = cs_key(&alice.user_id, "self_signing", &ssk, &[]);
    alice
        .post(
            &format!("{V3}/keys/device_signing/upload"),
            &json!({ "master_key": master_obj, "self_signing_key": unsigned_ssk }),
        )
        .await
        .expect_err(400, "M_INVALID_SIGNATURE");
    // The first upload needs no password (spec v1.11).
    alice
        .post(
            &format!("{V3}/keys/device_signing/upload"),
            &json!({ "master_key": master_obj, "self_signing_key": ssk_obj, "user_signing_key": usk_obj }),
        )
        .await
        .ok();
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(q["master_keys"][&alice.user_id], master_obj);
    assert_eq!(q["self_signing_keys"][&alice.user_id], ssk_obj);
    assert_eq!(
        q["user_signing_keys"],
        json!({}),
        "only the owner sees the user-signing key"
    );
    let own = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(own["user_signing_keys"][&alice.user_id], usk_obj);

    // Replacing the master key needs the password (UIA).
    let master2 = common::TestKey::new(None);
    let body = json!({ "master_key": cs_key(&alice.user_id, "master", &master2, &[]) });
    let challenge = alice
        .post(&format!("{V3}/keys/device_signing/upload"), &body)
        .await;
    assert_eq!(challenge.status, 401);
    assert_eq!(
        challenge.body["flows"],
        json!([{ "stages": ["m.login.password"] }])
    );
    let session = challenge.body["session"].as_str().unwrap().to_owned();
    let mut wrong = body.clone();
    wrong["auth"] = json!({ "type": "m.login.password", "session": session, "identifier": { "type": "m.id.user", "user": alice.user_id }, "password": "nope" });
    let r = alice
        .post(&format!("{V3}/keys/device_signing/upload"), &wrong)
        .await;
    assert_eq!((r.status, r.errcode()), (401, Some("M_FORBIDDEN")));

    // Alice signs her device with her self-signing key: served with the device keys.
    let device_sig = ssk.sign(&alice.user_id, keys.clone());
    let up = alice
        .post(
            &format!("{V3}/keys/signatures/upload"),
            &json!({ alice.user_id.clone(): { alice.device_id.clone(): device_sig } }),
        )
        .await
        .ok();
    assert_eq!(up, json!({ "failures": {} }));
    let q = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    let sigs = &q["device_keys"][&alice.user_id][&alice.device_id]["signatures"][&alice.user_id];
    assert_eq!(
        sigs.as_object().unwrap().len(),
        2,
        "self-signature and self-signing key: {sigs}"
    );
    assert!(sigs.get(format!("ed25519:{}", ssk.public)).is_some());

    // A signature by the wrong key is refused with M_INVALID_SIGNATURE.
    let forged = usk.sign(&alice.user_id, keys.clone());
    let forged = {
        let mut f = forged;
        let s = f["signatures"][&alice.user_id][format!("ed25519:{}", usk.public)].clone();
        f["signatures"][&alice.user_id] = json!({ format!("ed25519:{}", ssk.public): s });
        f
    };
    let up = alice
        .post(
            &format!("{V3}/keys/signatures/upload"),
            &json!({ alice.user_id.clone(): { alice.device_id.clone(): forged } }),
        )
        .await
        .ok();
    assert_eq!(
        up["failures"][&alice.user_id][&alice.device_id]["errcode"],
        "M_INVALID_SIGNATURE"
    );

    // Bob signs Alice's master key with his user-signing key: only Bob sees it.
    let (bm, busk) = (common::TestKey::new(None), common::TestKey::new(None));
    bob.post(
        &format!("{V3}/keys/device_signing/upload"),
        &json!({
            "master_key": cs_key(&bob.user_id, "master", &bm, &[]),
            "user_signing_key": cs_key(&bob.user_id, "user_signing", &busk, &[&bm]),
        }),
    )
    .await
    .ok();
    let b0 = bob.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    let a0 = alice.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    let signed_master = busk.sign(&bob.user_id, master_obj.clone());
    let up = bob
        .post(
            &format!("{V3}/keys/signatures/upload"),
            &json!({ alice.user_id.clone(): { master.public.clone(): signed_master } }),
        )
        .await
        .ok();
    assert_eq!(up, json!({ "failures": {} }));
    let by_bob = bob
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert!(by_bob["master_keys"][&alice.user_id]["signatures"][&bob.user_id].is_object());
    // The signer hears that the *signed* user's keys changed (Element X waits for it
    // to finish a verification); the signed user, who cannot see the signature, does
    // not, and they share no room.
    let b1 = bob.sync(&format!("since={b0}")).await;
    assert_eq!(
        b1["device_lists"],
        json!({ "changed": [alice.user_id], "left": [] })
    );
    let a1 = alice.sync(&format!("since={a0}")).await;
    assert_eq!(a1["device_lists"], json!({ "changed": [], "left": [] }));
    let by_alice = alice
        .post(
            &format!("{V3}/keys/query"),
            &json!({ "device_keys": { alice.user_id.clone(): [] } }),
        )
        .await
        .ok();
    assert_eq!(by_alice["master_keys"][&alice.user_id], master_obj);
    srv.stop().await;
}

fn backup_session(
    first_message_index: u64,
    forwarded_count: u64,
    verified: bool,
    tag: &str,
) -> Value {
    json!({
        "first_message_index": first_message_index,
        "forwarded_count": forwarded_count,
        "is_verified": verified,
        "session_data": { "ciphertext": tag, "ephemeral": "e", "mac": "m" },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_backup_versions_and_the_better_session_rule() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    alice
        .get(&format!("{V3}/room_keys/version"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    let alg = "m.megolm_backup.v1.curve25519-aes-sha2";
    let v1 = alice
        .post(
            &format!("{V3}/room_keys/version"),
            &json!({ "algorithm": alg, "auth_data": { "public_key": "pk1" } }),
        )
        .await
        .ok()["version"]
        .as_str()
        .unwrap()
        .to_owned();
    let got = alice.get(&format!("{V3}/room_keys/version")).await.ok();
    assert_eq!(
        got,
        json!({ "algorithm": alg, "auth_data": { "public_key": "pk1" }, "count": 0, "etag": "0", "version": v1 })
    );
    // Another user's backup is not Alice's.
    bob.get(&format!("{V3}/room_keys/version"))
        .await
        .expect_err(404, "M_NOT_FOUND");

    let keys = |v: &str| format!("{V3}/room_keys/keys?version={v}");
    let room = "!room:localhost:8008";
    let put = alice
        .put(
            &keys(&v1),
            &json!({ "rooms": { room: { "sessions": {
                "s1": backup_session(5, 1, false, "a"),
                "s2": backup_session(0, 0, true, "b"),
            } } } }),
        )
        .await
        .ok();
    assert_eq!(put, json!({ "etag": "1", "count": 2 }));
    let one = |sid: &str| format!("{V3}/room_keys/keys/{}/{sid}?version={v1}", enc(room));
    // Worse (higher first_message_index): kept out, etag unchanged.
    let put = alice
        .put(&one("s1"), &backup_session(9, 0, false, "worse"))
        .await
        .ok();
    assert_eq!(put, json!({ "etag": "1", "count": 2 }));
    // Better (lower first_message_index): replaces.
    let put = alice
        .put(&one("s1"), &backup_session(2, 3, false, "better"))
        .await
        .ok();
    assert_eq!(put, json!({ "etag": "2", "count": 2 }));
    // Same index, fewer forwards: replaces; verified beats unverified whatever the index.
    alice
        .put(&one("s1"), &backup_session(2, 1, false, "fewer-forwards"))
        .await
        .ok();
    assert_eq!(
        alice.get(&one("s1")).await.ok()["session_data"]["ciphertext"],
        "fewer-forwards"
    );
    alice
        .put(&one("s1"), &backup_session(7, 7, true, "verified"))
        .await
        .ok();
    assert_eq!(
        alice.get(&one("s1")).await.ok()["session_data"]["ciphertext"],
        "verified"
    );
    alice
        .put(&one("s2"), &backup_session(0, 0, false, "unverified"))
        .await
        .ok();
    assert_eq!(
        alice.get(&one("s2")).await.ok()["session_data"]["ciphertext"],
        "b"
    );

    let all = alice.get(&keys(&v1)).await.ok();
    assert_eq!(
        all["rooms"][room]["sessions"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        vec!["s1", "s2"]
    );
    let room_keys = alice
        .get(&format!(
            "{V3}/room_keys/keys/{}?version={v1}",
            enc("!other:localhost:8008")
        ))
        .await
        .ok();
    assert_eq!(room_keys, json!({ "sessions": {} }));
    alice.get(&one("nope")).await.expect_err(404, "M_NOT_FOUND");

    // A new version becomes current; writing to the old one is refused.
    let v2 = alice
        .post(
            &format!("{V3}/room_keys/version"),
            &json!({ "algorithm": alg, "auth_data": { "public_key": "pk2" } }),
        )
        .await
        .ok()["version"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = alice
        .put(&one("s3"), &backup_session(0, 0, false, "x"))
        .await;
    r.expect_err(403, "M_WRONG_ROOM_KEYS_VERSION");
    assert_eq!(r.body["current_version"], json!(v2));
    // Update and delete.
    alice
        .put(
            &format!("{V3}/room_keys/version/{v2}"),
            &json!({ "algorithm": alg, "auth_data": { "public_key": "pk2b" }, "version": v2 }),
        )
        .await
        .ok();
    assert_eq!(
        alice
            .get(&format!("{V3}/room_keys/version/{v2}"))
            .await
            .ok()["auth_data"],
        json!({ "public_key": "pk2b" })
    );
    alice
        .put(
            &format!("{V3}/room_keys/version/{v2}"),
            &json!({ "algorithm": "other", "auth_data": {} }),
        )
        .await
        .expect_err(400, "M_INVALID_PARAM");
    let del = alice
        .request(
            reqwest::Method::DELETE,
            &format!("{V3}/room_keys/keys/{}/s1?version={v1}", enc(room)),
            None,
        )
        .await
        .ok();
    assert_eq!(del, json!({ "etag": "5", "count": 1 }));
    alice
        .request(
            reqwest::Method::DELETE,
            &format!("{V3}/room_keys/version/{v2}"),
            None,
        )
        .await
        .ok();
    assert_eq!(
        alice.get(&format!("{V3}/room_keys/version")).await.ok()["version"],
        json!(v1)
    );
    alice
        .get(&format!("{V3}/room_keys/version/{v2}"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    srv.stop().await;
}
