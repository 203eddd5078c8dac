//! The journal on its own: command signatures are checked, the write model is restored
//! from the log on reopen, and the per-room linear index lists a room's positions.

use std::sync::{Arc, atomic::Ordering};

use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{
    CommandBody, CommandEnvelope, EventSpec, Fact, FjallStore, Journal, JournalError, JournalStore,
    SignedCommand,
};

const ALICE: &str = "@alice:example.org";

fn signed(key: &ServerKey, body: CommandBody) -> SignedCommand {
    let envelope = CommandEnvelope {
        principal: ALICE.into(),
        device_id: Some("DEV".into()),
        issued_at: 1_700_000_000_000,
        body,
    };
    SignedCommand::sign(key, envelope).unwrap()
}

fn state(kind: &str, key: &str, content: serde_json::Value) -> EventSpec {
    EventSpec {
        kind: kind.into(),
        state_key: Some(key.into()),
        content,
        redacts: None,
    }
}

fn create_room() -> CommandBody {
    CommandBody::CreateRoom {
        room_version: "11".into(),
        events: vec![
            state("m.room.create", "", json!({ "room_version": "11" })),
            state("m.room.member", ALICE, json!({ "membership": "join" })),
        ],
        alias: Some("#kept:example.org".into()),
    }
}

fn message(room: &str, txn: &str) -> CommandBody {
    CommandBody::SendEvent {
        room_id: room.into(),
        event: EventSpec {
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "msgtype": "m.text", "body": txn }),
            redacts: None,
        },
        txn_id: Some(txn.into()),
        precondition: None,
    }
}

#[tokio::test]
async fn a_tampered_command_is_refused_and_nothing_is_appended() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let journal =
        Journal::open(Arc::new(FjallStore::open(dir.path()).unwrap()), key.clone()).unwrap();
    let mut cmd = signed(
        &key,
        CommandBody::Fact {
            fact: Fact::AccountRegistered {
                user_id: ALICE.into(),
                password_hash: None,
                guest: false,
            },
        },
    );
    cmd.envelope.principal = "@mallory:example.org".into();
    assert!(matches!(
        journal.submit(cmd).await,
        Err(JournalError::BadSignature)
    ));
    // A signature from another key is refused too.
    let other = ServerKey::generate("example.org");
    let foreign = signed(&other, create_room());
    assert!(matches!(
        journal.submit(foreign).await,
        Err(JournalError::BadSignature)
    ));
    assert_eq!(journal.durable_head(), 0);
}

#[tokio::test]
async fn reopening_restores_heads_txns_users_and_aliases() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let register = || {
        signed(
            &key,
            CommandBody::Fact {
                fact: Fact::AccountRegistered {
                    user_id: ALICE.into(),
                    password_hash: None,
                    guest: false,
                },
            },
        )
    };
    let (room, first, head) = {
        let store = Arc::new(FjallStore::open(dir.path()).unwrap());
        let journal = Journal::open(store, key.clone()).unwrap();
        journal.submit(register()).await.unwrap();
        let created = journal.submit(signed(&key, create_room())).await.unwrap();
        let room = created.room_id.unwrap().to_string();
        let first = journal
            .submit(signed(&key, message(&room, "t1")))
            .await
            .unwrap();
        (room, first.event_ids[0].clone(), journal.durable_head())
    };
    // 1 registration + 2 room events + 1 alias + 1 message.
    assert_eq!(head, 5);

    let store = Arc::new(FjallStore::open(dir.path()).unwrap());
    let journal = Journal::open(store.clone(), key.clone()).unwrap();
    assert_eq!(journal.durable_head(), head);
    // The txn map survived: the same txn id answers the same event and appends nothing.
    let again = journal
        .submit(signed(&key, message(&room, "t1")))
        .await
        .unwrap();
    assert_eq!(again.event_ids, vec![first.clone()]);
    assert_eq!(journal.durable_head(), head);
    // Uniqueness sets survived.
    assert!(matches!(
        journal.submit(register()).await,
        Err(JournalError::UserInUse)
    ));
    let dup_alias = signed(
        &key,
        CommandBody::Fact {
            fact: Fact::AliasSet {
                alias: "#kept:example.org".into(),
                room_id: room.clone(),
                creator: ALICE.into(),
            },
        },
    );
    assert!(matches!(
        journal.submit(dup_alias).await,
        Err(JournalError::AliasInUse)
    ));
    // The room head survived: the next event's only prev_event is the last one before the restart.
    let next = journal
        .submit(signed(&key, message(&room, "t2")))
        .await
        .unwrap();
    let records = journal.read_after(head, 10).unwrap();
    assert_eq!(records.len(), 1);
    let pdu = records[0].pdu().unwrap();
    assert_eq!(pdu.event_id, next.event_ids[0]);
    assert_eq!(pdu.prev_events, vec![first]);
    assert_eq!(pdu.depth, 4);

    // The per-room linear index lists exactly the room's positions, in order.
    assert_eq!(
        store.room_positions(&room, 0, 100).unwrap(),
        vec![2, 3, 5, 6]
    );
    assert_eq!(store.room_positions(&room, 3, 1).unwrap(), vec![5]);
    assert_eq!(
        store.room_positions("!other:example.org", 0, 100).unwrap(),
        Vec::<u64>::new()
    );
}

/// `submit_batch`: a refused command in the middle of a run (an unknown room, a bad
/// signature, a taken alias) fails alone; the others are appended in the order given,
/// each checked as `submit` would check it (a repeated transaction id answers the same
/// event), and the whole run is covered by one fsync.
#[tokio::test]
async fn a_batch_with_refused_commands_in_the_middle_appends_the_rest_with_one_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let journal =
        Journal::open(Arc::new(FjallStore::open(dir.path()).unwrap()), key.clone()).unwrap();
    let created = journal.submit(signed(&key, create_room())).await.unwrap();
    let room = created.room_id.unwrap().to_string();
    let head = journal.durable_head();
    let fsyncs = || journal.stats().fsyncs.load(Ordering::Relaxed);
    let before = fsyncs();

    let mut tampered = signed(&key, message(&room, "forged"));
    tampered.envelope.principal = "@mallory:example.org".into();
    let taken_alias = CommandBody::Fact {
        fact: Fact::AliasSet {
            alias: "#kept:example.org".into(),
            room_id: room.clone(),
            creator: ALICE.into(),
        },
    };
    let results = journal
        .submit_batch(vec![
            signed(&key, message(&room, "t1")),
            signed(&key, message("!nowhere:example.org", "lost")),
            signed(&key, message(&room, "t2")),
            tampered,
            signed(&key, taken_alias),
            signed(&key, message(&room, "t2")),
            signed(&key, message(&room, "t3")),
        ])
        .await;
    assert_eq!(results.len(), 7);
    assert_eq!(fsyncs() - before, 1, "one durable write for the run");
    assert!(matches!(results[1], Err(JournalError::UnknownRoom(_))));
    assert!(matches!(results[3], Err(JournalError::BadSignature)));
    assert!(matches!(results[4], Err(JournalError::AliasInUse)));
    let ok = |i: usize| results[i].as_ref().unwrap();
    // Three records, in the order given; the repeated t2 is the same event.
    assert_eq!(
        [
            ok(0).position,
            ok(2).position,
            ok(5).position,
            ok(6).position
        ],
        [head + 1, head + 2, head + 2, head + 3]
    );
    assert_eq!(ok(5).event_ids, ok(2).event_ids);
    assert_eq!(journal.durable_head(), head + 3);
    let recs = journal.read_after(head, 10).unwrap();
    let got: Vec<(u64, String, String)> = recs
        .iter()
        .map(|r| {
            let pdu = r.pdu().unwrap();
            (
                r.position(),
                pdu.event_id.to_string(),
                pdu.content_value()["body"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let id = |i: usize| ok(i).event_ids[0].to_string();
    assert_eq!(
        got,
        [
            (head + 1, id(0), "t1".to_owned()),
            (head + 2, id(2), "t2".to_owned()),
            (head + 3, id(6), "t3".to_owned()),
        ]
    );
    // Still a chain: each event names the one before it.
    assert_eq!(recs[1].pdu().unwrap().prev_events, ok(0).event_ids);
    assert_eq!(recs[2].pdu().unwrap().prev_events, ok(2).event_ids);
    assert_eq!(
        journal.room_model(&room).await.unwrap().extremities,
        [id(6)]
    );

    // A run that appends nothing writes nothing; an empty one answers nothing.
    let before = fsyncs();
    let refused = journal
        .submit_batch(vec![signed(&key, message("!nowhere:example.org", "x"))])
        .await;
    assert!(matches!(refused[..], [Err(JournalError::UnknownRoom(_))]));
    assert!(journal.submit_batch(Vec::new()).await.is_empty());
    assert_eq!(fsyncs() - before, 0);
    // A plain submit after a run still works (the hold was released).
    let after = journal
        .submit(signed(&key, message(&room, "t4")))
        .await
        .unwrap();
    assert_eq!(after.position, head + 4);
}
