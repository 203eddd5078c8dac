//! Remote PDUs through the journal (issue 12, item 7): each bad PDU gets the spec's
//! answer, a refusal is recorded, nothing refused reaches the room, and a local room
//! stays a chain until a remote event forks it.

use std::{collections::BTreeMap, sync::Arc};

use serde_json::json;
use spindle_core::{keys::ServerKey, pdu::PduTemplate};
use spindle_journal::{
    CommandBody, EventSpec, Fact, FjallStore, Journal, JournalError, SignedCommand,
    remote::VerifyKeys,
};

mod common;

use common::{ALICE, state};

/// `body` as `principal`'s command, from no device.
fn signed(key: &ServerKey, principal: &str, body: CommandBody) -> SignedCommand {
    common::signed_by(key, principal, None, body)
}

const BOB: &str = "@bob:remote.org";

struct World {
    journal: Journal,
    key: Arc<ServerKey>,
    remote: ServerKey,
    room: String,
    create: String,
    power: String,
    join_rules: String,
    store: Arc<FjallStore>,
    _dir: tempfile::TempDir,
}

/// The `prev_events` of an event in `journal`, sorted.
fn prev_events_of(journal: &Journal, event_id: &str) -> Vec<String> {
    let rec = journal
        .read_after(0, 1000)
        .unwrap()
        .into_iter()
        .find(|r| r.event_id() == Some(event_id))
        .unwrap();
    let mut prevs: Vec<String> = rec
        .pdu()
        .unwrap()
        .prev_events
        .iter()
        .map(|p| p.to_string())
        .collect();
    prevs.sort();
    prevs
}

fn keys_of(k: &ServerKey) -> VerifyKeys {
    BTreeMap::from([(
        k.server_name().to_owned(),
        BTreeMap::from([(k.key_id(), k.public_key_base64())]),
    )])
}

/// A public v11 room created by alice on example.org.
async fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = Arc::new(FjallStore::open(dir.path()).unwrap());
    let journal = Journal::open(store.clone(), key.clone()).unwrap();
    let created = journal
        .submit(signed(
            &key,
            ALICE,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    state("m.room.create", "", json!({ "room_version": "11" })),
                    state("m.room.member", ALICE, json!({ "membership": "join" })),
                    state(
                        "m.room.power_levels",
                        "",
                        json!({ "users": { ALICE: 100 }, "events_default": 0, "state_default": 50 }),
                    ),
                    state("m.room.join_rules", "", json!({ "join_rule": "public" })),
                ],
                alias: None,
            },
        ))
        .await
        .unwrap();
    let ids: Vec<String> = created.event_ids.iter().map(|e| e.to_string()).collect();
    World {
        journal,
        key,
        remote: ServerKey::generate("remote.org"),
        room: created.room_id.unwrap().to_string(),
        create: ids[0].clone(),
        power: ids[2].clone(),
        join_rules: ids[3].clone(),
        store,
        _dir: dir,
    }
}

impl World {
    /// A PDU built and signed by remote.org.
    #[allow(clippy::too_many_arguments)]
    fn remote_pdu(
        &self,
        sender: &str,
        kind: &str,
        state_key: Option<&str>,
        content: serde_json::Value,
        prev: &str,
        auth: Vec<&str>,
        depth: u64,
    ) -> serde_json::Value {
        self.remote_pdu_at(
            sender,
            kind,
            state_key,
            content,
            prev,
            auth,
            depth,
            1_700_000_000_500,
        )
    }

    /// [`World::remote_pdu`] with its `origin_server_ts`.
    #[allow(clippy::too_many_arguments)]
    fn remote_pdu_at(
        &self,
        sender: &str,
        kind: &str,
        state_key: Option<&str>,
        content: serde_json::Value,
        prev: &str,
        auth: Vec<&str>,
        depth: u64,
        origin_server_ts: u64,
    ) -> serde_json::Value {
        PduTemplate {
            room_version: "11".into(),
            room_id: Some(self.room.as_str().try_into().unwrap()),
            sender: sender.try_into().unwrap(),
            kind: kind.into(),
            state_key: state_key.map(str::to_owned),
            content,
            redacts: None,
            prev_events: vec![prev.try_into().unwrap()],
            auth_events: auth.into_iter().map(|a| a.try_into().unwrap()).collect(),
            depth,
            origin_server_ts,
        }
        .build(&self.remote)
        .unwrap()
        .federation_json()
    }

    async fn ingest(
        &self,
        pdu: serde_json::Value,
        keys: VerifyKeys,
    ) -> Result<String, JournalError> {
        let out = self
            .journal
            .submit(signed(
                &self.key,
                "remote.org",
                CommandBody::RemotePdu {
                    room_id: self.room.clone(),
                    pdu,
                    keys,
                    event_id: None,
                    auth_events: Vec::new(),
                },
            ))
            .await?;
        Ok(out.event_ids[0].to_string())
    }

    async fn head_event(&self) -> String {
        let recs = self.journal.read_after(0, 1000).unwrap();
        recs.iter()
            .rev()
            .find(|r| r.is_event())
            .and_then(|r| r.event_id().map(str::to_owned))
            .unwrap()
    }

    fn rejections(&self) -> Vec<(String, String)> {
        self.journal
            .read_after(0, 1000)
            .unwrap()
            .iter()
            .filter_map(|r| match r.fact() {
                Some(Fact::RemotePduRejected { origin, reason, .. }) => Some((origin, reason)),
                _ => None,
            })
            .collect()
    }

    async fn bob_join(&self) -> String {
        let head = self.head_event().await;
        let join = self.remote_pdu(
            BOB,
            "m.room.member",
            Some(BOB),
            json!({ "membership": "join" }),
            &head,
            vec![&self.create, &self.power, &self.join_rules],
            5,
        );
        self.ingest(join, keys_of(&self.remote)).await.unwrap()
    }
}

#[tokio::test]
async fn a_valid_remote_join_and_message_are_appended_and_a_retry_adds_nothing() {
    let w = world().await;
    let join = w.bob_join().await;
    let head_before = w.journal.durable_head();
    let msg = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "msgtype": "m.text", "body": "hi" }),
        &join,
        vec![&w.create, &w.power, &join],
        6,
    );
    let id = w.ingest(msg.clone(), keys_of(&w.remote)).await.unwrap();
    assert_eq!(w.journal.durable_head(), head_before + 1);
    // The same PDU again (a retried transaction): accepted, nothing appended.
    assert_eq!(w.ingest(msg, keys_of(&w.remote)).await.unwrap(), id);
    assert_eq!(w.journal.durable_head(), head_before + 1);
    assert_eq!(w.head_event().await, id);
    assert!(w.rejections().is_empty());
}

#[tokio::test]
async fn bad_signatures_wrong_ids_unknown_prevs_and_failed_auth_are_refused_and_recorded() {
    let w = world().await;
    let head = w.head_event().await;
    let join = w.remote_pdu(
        BOB,
        "m.room.member",
        Some(BOB),
        json!({ "membership": "join" }),
        &head,
        vec![&w.create, &w.power, &w.join_rules],
        5,
    );
    // Verified with another key of remote.org: refused, recorded.
    let impostor = ServerKey::generate("remote.org");
    let err = w
        .ingest(join.clone(), keys_of(&impostor))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, JournalError::Forbidden(m) if m.contains("signature")),
        "{err}"
    );
    // No key for the signer at all.
    let err = w.ingest(join.clone(), VerifyKeys::new()).await.unwrap_err();
    assert!(
        matches!(&err, JournalError::Forbidden(m) if m.contains("signature")),
        "{err}"
    );
    // A send_join naming another event id.
    let err = w
        .journal
        .submit(signed(
            &w.key,
            "remote.org",
            CommandBody::RemotePdu {
                room_id: w.room.clone(),
                pdu: join.clone(),
                keys: keys_of(&w.remote),
                event_id: Some("$notthisone".into()),
                auth_events: Vec::new(),
            },
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, JournalError::BadJson(m) if m.contains("does not match")),
        "{err}"
    );
    // Unknown prev event: refused as missing (the federation layer fetches the gap).
    let orphan = w.remote_pdu(
        BOB,
        "m.room.member",
        Some(BOB),
        json!({ "membership": "join" }),
        "$unknownprevevent00000000000000000000000000",
        vec![&w.create, &w.power, &w.join_rules],
        5,
    );
    let err = w.ingest(orphan, keys_of(&w.remote)).await.unwrap_err();
    assert!(matches!(err, JournalError::MissingPrevEvents(_)), "{err}");
    // A message from bob before he joined fails the auth rules.
    let early = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "body": "not a member" }),
        &head,
        vec![&w.create, &w.power],
        5,
    );
    let err = w.ingest(early, keys_of(&w.remote)).await.unwrap_err();
    assert!(
        matches!(&err, JournalError::Forbidden(m) if m.contains("auth rules")),
        "{err}"
    );
    // An oversized PDU.
    let big = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "body": "x".repeat(60_000) }),
        &head,
        vec![&w.create, &w.power],
        5,
    );
    let mut big = big;
    big["content"]["padding"] = json!("y".repeat(10_000));
    let err = w.ingest(big, keys_of(&w.remote)).await.unwrap_err();
    assert!(matches!(err, JournalError::TooLarge(_)), "{err}");
    // Another room's event.
    let mut elsewhere = join.clone();
    elsewhere["room_id"] = json!("!other:example.org");
    let err = w.ingest(elsewhere, keys_of(&w.remote)).await.unwrap_err();
    assert!(
        matches!(&err, JournalError::Forbidden(m) if m.contains("not an event of")),
        "{err}"
    );
    // Nothing refused is in the room: the head is still alice's last event.
    assert_eq!(w.head_event().await, head);
    let reasons = w.rejections();
    assert_eq!(reasons.len(), 7, "{reasons:?}");
    assert!(reasons.iter().all(|(origin, _)| origin == "remote.org"));
    // A room that does not exist here.
    let err = w
        .journal
        .submit(signed(
            &w.key,
            "remote.org",
            CommandBody::RemotePdu {
                room_id: "!nope:example.org".into(),
                pdu: join,
                keys: keys_of(&w.remote),
                event_id: None,
                auth_events: Vec::new(),
            },
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, JournalError::UnknownRoom(_)), "{err}");
}

#[tokio::test]
async fn a_pdu_whose_content_hash_fails_is_kept_redacted() {
    let w = world().await;
    let join = w.bob_join().await;
    let mut msg = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "msgtype": "m.text", "body": "original" }),
        &join,
        vec![&w.create, &w.power, &join],
        6,
    );
    // Content changed after signing: signatures (over the redacted form) still hold,
    // the content hash does not.
    msg["content"]["body"] = json!("tampered");
    let id = w.ingest(msg, keys_of(&w.remote)).await.unwrap();
    let rec = w
        .journal
        .read_after(0, 1000)
        .unwrap()
        .into_iter()
        .find(|r| r.event_id() == Some(id.as_str()))
        .unwrap();
    let pdu = rec.pdu().unwrap();
    assert_eq!(pdu.content_value(), json!({}));
}

#[tokio::test]
async fn a_local_room_is_a_chain_until_a_remote_event_forks_it() {
    let w = world().await;
    let join = w.bob_join().await;
    // Bob's message names the join; alice's message (sent meanwhile) too: a fork.
    let alice_msg = w
        .journal
        .submit(signed(
            &w.key,
            ALICE,
            CommandBody::SendEvent {
                room_id: w.room.clone(),
                event: EventSpec {
                    kind: "m.room.message".into(),
                    state_key: None,
                    content: json!({ "body": "from alice" }),
                    redacts: None,
                },
                txn_id: None,
                precondition: None,
            },
        ))
        .await
        .unwrap()
        .event_ids[0]
        .to_string();
    let bob_msg = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "body": "from bob" }),
        &join,
        vec![&w.create, &w.power, &join],
        6,
    );
    let bob_id = w.ingest(bob_msg, keys_of(&w.remote)).await.unwrap();
    // Alice's next event merges both forward extremities.
    let next = w
        .journal
        .submit(signed(
            &w.key,
            ALICE,
            CommandBody::SendEvent {
                room_id: w.room.clone(),
                event: EventSpec {
                    kind: "m.room.message".into(),
                    state_key: None,
                    content: json!({ "body": "merge" }),
                    redacts: None,
                },
                txn_id: None,
                precondition: None,
            },
        ))
        .await
        .unwrap();
    let rec = w
        .journal
        .read_after(0, 1000)
        .unwrap()
        .into_iter()
        .find(|r| r.event_id() == Some(next.event_ids[0].as_str()))
        .unwrap();
    let pdu = rec.pdu().unwrap();
    let mut prevs: Vec<String> = pdu.prev_events.iter().map(|p| p.to_string()).collect();
    prevs.sort();
    let mut want = vec![alice_msg.clone(), bob_id];
    want.sort();
    assert_eq!(prevs, want);
    assert_eq!(pdu.depth, 7);
    // Every event before the fork named exactly one prev event.
    for r in w.journal.read_after(0, 1000).unwrap() {
        if let Some(p) = r.pdu()
            && p.sender.as_str() == ALICE
            && p.event_id != pdu.event_id
        {
            assert!(
                p.prev_events.len() <= 1,
                "{} has {:?}",
                p.event_id,
                p.prev_events
            );
        }
    }
}

impl World {
    /// Alice (local) sends a state event; returns its id.
    async fn alice_state(&self, kind: &str, key: &str, content: serde_json::Value) -> String {
        self.journal
            .submit(signed(
                &self.key,
                ALICE,
                CommandBody::SendEvent {
                    room_id: self.room.clone(),
                    event: state(kind, key, content),
                    txn_id: None,
                    precondition: None,
                },
            ))
            .await
            .unwrap()
            .event_ids[0]
            .to_string()
    }

    /// (kind, event id) of every record after `after`.
    fn records_after(&self, after: u64) -> Vec<(&'static str, String)> {
        self.journal
            .read_after(after, 1000)
            .unwrap()
            .iter()
            .filter_map(|r| {
                let kind = if r.is_state_resolved() {
                    "resolved"
                } else if r.is_event() {
                    "event"
                } else {
                    return None;
                };
                Some((kind, r.event_id()?.to_owned()))
            })
            .collect()
    }
}

/// Alice (here) and bob (remote.org) set the topic at once, both after the same power
/// levels event: state resolution v2 orders the two by timestamp, so the later one is
/// the topic on both servers whatever order they arrived in. `winner_is_local`: alice's
/// is later, so bob's, appended after it, must not stay current.
async fn concurrent_topics(winner_is_local: bool) {
    let w = world().await;
    let join = w.bob_join().await;
    let power = w
        .alice_state(
            "m.room.power_levels",
            "",
            json!({ "users": { ALICE: 100, BOB: 50 }, "events_default": 0, "state_default": 50 }),
        )
        .await;
    let alice_topic = w
        .alice_state("m.room.topic", "", json!({ "topic": "alice's" }))
        .await;
    let at = w.journal.durable_head();
    // Alice's events carry the command's `issued_at`, 1_700_000_000_000.
    let bob_ts = if winner_is_local {
        1_699_999_999_000
    } else {
        1_700_000_001_000
    };
    let bob_topic = w.remote_pdu_at(
        BOB,
        "m.room.topic",
        Some(""),
        json!({ "topic": "bob's" }),
        &power,
        vec![&w.create, &power, &join],
        7,
        bob_ts,
    );
    let bob_topic = w.ingest(bob_topic, keys_of(&w.remote)).await.unwrap();
    let stats = w.journal.stats();
    assert_eq!(
        stats
            .forks_resolved
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let mut want = vec![("event", bob_topic.clone())];
    if winner_is_local {
        want.push(("resolved", alice_topic.clone()));
    }
    assert_eq!(w.records_after(at), want);
    // The next local event names both extremities and the room is one again.
    let name = w
        .alice_state("m.room.name", "", json!({ "name": "merged" }))
        .await;
    let prevs = prev_events_of(&w.journal, &name);
    let mut both = vec![alice_topic, bob_topic];
    both.sort();
    assert_eq!(prevs, both);
}

#[tokio::test]
async fn concurrent_topics_resolve_to_the_later_one_when_it_arrived_first() {
    concurrent_topics(true).await;
}

#[tokio::test]
async fn concurrent_topics_resolve_to_the_later_one_when_it_arrived_last() {
    concurrent_topics(false).await;
}

#[tokio::test]
async fn backfill_appends_verified_history_once_and_records_what_it_refused() {
    let w = world().await;
    let join = w.bob_join().await;
    let old = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "body": "older" }),
        &join,
        vec![&w.create, &w.power, &join],
        3,
    );
    let old_id = spindle_core::pdu::event_id_of(&old, "11").unwrap();
    // Signed by a key nobody vouches for: refused.
    let forged = PduTemplate {
        room_version: "11".into(),
        room_id: Some(w.room.as_str().try_into().unwrap()),
        sender: BOB.try_into().unwrap(),
        kind: "m.room.message".into(),
        state_key: None,
        content: json!({ "body": "forged" }),
        redacts: None,
        prev_events: vec![join.as_str().try_into().unwrap()],
        auth_events: vec![w.create.as_str().try_into().unwrap()],
        depth: 2,
        origin_server_ts: 1,
    }
    .build(&ServerKey::generate("remote.org"))
    .unwrap()
    .federation_json();
    let create = w
        .journal
        .read_after(0, 1)
        .unwrap()
        .remove(0)
        .pdu()
        .unwrap()
        .federation_json();
    let backfill = |pdus: Vec<serde_json::Value>| {
        signed(
            &w.key,
            "remote.org",
            CommandBody::Backfill {
                room_id: w.room.clone(),
                pdus,
                auth_events: vec![],
                keys: keys_of(&w.remote),
            },
        )
    };
    let at = w.journal.durable_head();
    let out = w
        .journal
        .submit(backfill(vec![old.clone(), forged, create.clone()]))
        .await
        .unwrap();
    assert_eq!(
        out.event_ids
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>(),
        vec![old_id.clone()]
    );
    let recs = w.journal.read_after(at, 10).unwrap();
    assert_eq!(recs.len(), 2, "one backfilled event and one refusal");
    assert!(recs[0].is_backfilled());
    assert_eq!(recs[0].event_id(), Some(old_id.as_str()));
    assert!(
        matches!(recs[1].fact(), Some(Fact::RemotePduRejected { ref reason, .. }) if reason.starts_with("backfill:"))
    );
    // Backfill changes neither the head nor the forward extremities.
    assert_eq!(w.head_event().await, join);
    // Asked again: nothing new.
    let again = w.journal.submit(backfill(vec![old, create])).await.unwrap();
    assert!(again.event_ids.is_empty());
    assert_eq!(w.journal.read_after(at, 10).unwrap().len(), 2);
}

impl World {
    /// Alice (local) sends a message; returns its `prev_events`, sorted.
    async fn alice_message_prevs(&self, journal: &Journal) -> Vec<String> {
        let out = journal
            .submit(signed(
                &self.key,
                ALICE,
                CommandBody::SendEvent {
                    room_id: self.room.clone(),
                    event: EventSpec {
                        kind: "m.room.message".into(),
                        state_key: None,
                        content: json!({ "body": "next" }),
                        redacts: None,
                    },
                    txn_id: None,
                    precondition: None,
                },
            ))
            .await
            .unwrap();
        prev_events_of(journal, out.event_ids[0].as_str())
    }
}

/// Spec, "Soft failure": bob's server had not seen alice ban bob and sends a message
/// after carol's join; the state before it lets bob speak, the current state does not.
/// It is kept as a soft-failed record (the origin hears success), is no forward
/// extremity and no timeline event, while carol's message on the same branch is an
/// ordinary event; a restart rebuilds the same write model from the records.
#[tokio::test]
async fn a_message_from_a_user_banned_on_another_branch_is_soft_failed() {
    const CAROL: &str = "@carol:remote.org";
    let w = world().await;
    let bob_join = w.bob_join().await;
    let carol_join = w.remote_pdu(
        CAROL,
        "m.room.member",
        Some(CAROL),
        json!({ "membership": "join" }),
        &bob_join,
        vec![&w.create, &w.power, &w.join_rules],
        6,
    );
    let carol_join = w.ingest(carol_join, keys_of(&w.remote)).await.unwrap();
    let ban = w
        .alice_state("m.room.member", BOB, json!({ "membership": "ban" }))
        .await;
    let at = w.journal.durable_head();
    let bob_msg = w.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "body": "I did not see the ban" }),
        &carol_join,
        vec![&w.create, &w.power, &bob_join],
        7,
    );
    let bob_id = w.ingest(bob_msg.clone(), keys_of(&w.remote)).await.unwrap();
    let carol_msg = w.remote_pdu(
        CAROL,
        "m.room.message",
        None,
        json!({ "body": "neither did I" }),
        &carol_join,
        vec![&w.create, &w.power, &carol_join],
        7,
    );
    let carol_id = w.ingest(carol_msg, keys_of(&w.remote)).await.unwrap();
    let kinds: Vec<(String, &str)> = w
        .journal
        .read_after(at, 100)
        .unwrap()
        .iter()
        .filter_map(|r| {
            let kind = if r.is_soft_failed() {
                "soft_failed"
            } else if r.is_event() {
                "event"
            } else {
                return None;
            };
            Some((r.event_id()?.to_owned(), kind))
        })
        .collect();
    assert_eq!(
        kinds,
        vec![(bob_id.clone(), "soft_failed"), (carol_id.clone(), "event")]
    );
    let soft = w
        .journal
        .read_after(at, 100)
        .unwrap()
        .into_iter()
        .find(|r| r.is_soft_failed())
        .unwrap();
    assert!(soft.pdu().is_none() && soft.room_pdu().is_none());
    assert!(soft.carries_pdu());
    assert_eq!(
        w.journal
            .stats()
            .forks_soft_failed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert!(w.rejections().is_empty());
    // A retried transaction adds nothing.
    let head = w.journal.durable_head();
    assert_eq!(
        w.ingest(bob_msg.clone(), keys_of(&w.remote)).await.unwrap(),
        bob_id
    );
    assert_eq!(w.journal.durable_head(), head);
    // Alice's next event names the ban and carol's message, not bob's.
    let mut want = vec![ban.clone(), carol_id.clone()];
    want.sort();
    assert_eq!(w.alice_message_prevs(&w.journal).await, want);
    // After a restart the write model is the same: the soft-failed event is known
    // (a retry is a duplicate) and still no extremity.
    let reopened = Journal::open(w.store.clone(), w.key.clone()).unwrap();
    let last = w.head_event().await;
    assert_eq!(w.alice_message_prevs(&reopened).await, vec![last]);
    let out = reopened
        .submit(signed(
            &w.key,
            "remote.org",
            CommandBody::RemotePdu {
                room_id: w.room.clone(),
                pdu: bob_msg,
                keys: keys_of(&w.remote),
                event_id: None,
                auth_events: Vec::new(),
            },
        ))
        .await
        .unwrap();
    assert_eq!(out.event_ids[0].to_string(), bob_id);
    assert_eq!(
        reopened
            .stats()
            .forks_soft_failed
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
