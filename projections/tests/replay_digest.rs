//! BRIEF §3.2: deleting a projection and replaying from position 0 yields
//! byte-identical contents, whatever batch boundaries the live run happened to use.

mod common;

use std::{sync::Arc, time::Duration};

use common::cmd;
use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, EventSpec, Fact, FjallStore, Journal};
use spindle_projections::Projections;

fn ev(kind: &str, state_key: Option<&str>, content: serde_json::Value) -> EventSpec {
    EventSpec {
        kind: kind.into(),
        state_key: state_key.map(str::to_owned),
        content,
        redacts: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_and_replayed_projections_have_identical_digests() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = FjallStore::open(&dir.path().join("journal")).unwrap();
    let journal = Journal::open(Arc::new(store), key.clone()).unwrap();
    // The live projections tail while records arrive one command at a time.
    let live = Projections::start(&dir.path().join("live"), journal.clone()).unwrap();

    let alice = "@alice:example.org";
    let bob = "@bob:example.org";
    for user in [alice, bob] {
        journal
            .submit(cmd(
                &key,
                user,
                CommandBody::Fact {
                    fact: Fact::AccountRegistered {
                        user_id: user.into(),
                        password_hash: None,
                        guest: false,
                    },
                },
            ))
            .await
            .unwrap();
    }
    let created = journal
        .submit(cmd(
            &key,
            alice,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    ev("m.room.create", Some(""), json!({ "room_version": "11" })),
                    ev(
                        "m.room.member",
                        Some(alice),
                        json!({ "membership": "join" }),
                    ),
                    ev(
                        "m.room.power_levels",
                        Some(""),
                        json!({ "users": { alice: 100 } }),
                    ),
                    ev(
                        "m.room.join_rules",
                        Some(""),
                        json!({ "join_rule": "public" }),
                    ),
                ],
                alias: Some("#room:example.org".into()),
            },
        ))
        .await
        .unwrap();
    let room = created.room_id.unwrap().to_string();
    let send = |who: &str, spec: EventSpec, txn: Option<String>| {
        cmd(
            &key,
            who,
            CommandBody::SendEvent {
                room_id: room.clone(),
                event: spec,
                txn_id: txn,
                precondition: None,
            },
        )
    };
    journal
        .submit(send(
            bob,
            ev("m.room.member", Some(bob), json!({ "membership": "join" })),
            None,
        ))
        .await
        .unwrap();
    let mut last = String::new();
    for i in 0..60 {
        let who = if i % 2 == 0 { alice } else { bob };
        let out = journal
            .submit(send(
                who,
                ev(
                    "m.room.message",
                    None,
                    json!({ "msgtype": "m.text", "body": format!("m{i}") }),
                ),
                Some(format!("t{i}")),
            ))
            .await
            .unwrap();
        last = out.event_ids[0].to_string();
    }
    journal
        .submit(cmd(
            &key,
            bob,
            CommandBody::Fact {
                fact: Fact::ReceiptSet {
                    user_id: bob.into(),
                    room_id: room.clone(),
                    event_id: last.clone(),
                    receipt_type: "m.read".into(),
                    thread_id: None,
                    ts: 1,
                },
            },
        ))
        .await
        .unwrap();
    journal
        .submit(send(
            alice,
            ev("m.room.name", Some(""), json!({ "name": "renamed" })),
            None,
        ))
        .await
        .unwrap();
    let head = journal.durable_head();
    assert_eq!(head, 2 + 4 + 1 + 1 + 60 + 1 + 1);
    // wait_for_all: the search index does not gate reads, so `wait_for` skips it.
    assert!(
        live.runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );

    // A rebuild from position 0 sees the whole journal in large batches.
    let rebuilt = Projections::start(&dir.path().join("rebuilt"), journal.clone()).unwrap();
    assert!(
        rebuilt
            .runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );
    let a = live.runtime.digests();
    let b = rebuilt.runtime.digests();
    // Every projection: timeline, state, membership, accounts, filters, account_data,
    // receipts, aliases, room_summary, audit, directory, event_times, device_keys,
    // to_device, key_backup, media, push, pushers, relations, search, server_admin,
    // delayed_events.
    assert_eq!(a.len(), 22);
    assert_eq!(a, b);
    // The search index holds the 60 messages and the name in both, whatever the batch
    // sizes were.
    for p in [&live, &rebuilt] {
        assert_eq!(p.search.num_docs(), 61);
        assert_eq!(p.search.words("M7, m7!"), vec!["m7".to_owned()]);
    }
    // The room summary (member counts, heroes) agrees: alice and bob joined.
    for p in [&live, &rebuilt] {
        let counts = p.room_summary.counts(&room);
        assert_eq!((counts.joined, counts.invited), (2, 0));
        assert_eq!(p.room_summary.heroes(&room, alice, 5), vec![bob.to_owned()]);
    }

    // The answers agree too: unread count for alice after bob's receipt-less messages.
    let alice_join = live.membership.get(&room, alice).unwrap().position;
    // At the head, alice's own last event (the name change) marks everything read;
    // just before it, bob's 30 messages since her join are unread.
    let counts = |p: &Projections, upto: u64| {
        let c = p.push.unread(&room, alice, "", alice_join, upto);
        (c.notification_count, c.highlight_count)
    };
    for p in [&live, &rebuilt] {
        assert_eq!(counts(p, head), (0, 0));
        assert_eq!(counts(p, head - 1), (30, 0));
    }
    assert_eq!(
        live.receipts.read_position(&room, bob, None),
        rebuilt.receipts.read_position(&room, bob, None)
    );
    let root = rebuilt.state.current_root(&room).unwrap();
    let name_id = rebuilt.state.lookup(root, "m.room.name", "").unwrap();
    assert_eq!(
        rebuilt
            .timeline
            .event(&name_id)
            .unwrap()
            .pdu
            .content_value()["name"],
        "renamed"
    );
}
