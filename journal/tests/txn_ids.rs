//! Client transaction ids (`journal::txn`): memory holds a bounded hot set, the store's
//! index holds every id, so a retry gets its first answer after eviction, after a
//! restart, and on a journal written before the index existed.

use std::sync::{Arc, atomic::Ordering};

use spindle_core::keys::ServerKey;
use spindle_journal::{
    CommandBody, EncodedRecord, Fact, FjallStore, Journal, JournalOptions, JournalStore,
    txn::MIN_TXN_IDS_CACHED,
};

mod common;

use common::{ALICE, create_room, signed};

/// A message whose body and transaction id are both `txn`.
fn message(room: &str, txn: &str) -> CommandBody {
    common::message(room, txn, Some(txn))
}

fn to_device(txn: &str) -> CommandBody {
    CommandBody::Fact {
        fact: Fact::ToDeviceSent {
            sender: ALICE.into(),
            sender_device: "DEV".into(),
            event_type: "m.test".into(),
            txn_id: txn.into(),
            messages: Default::default(),
        },
    }
}

fn options() -> JournalOptions {
    JournalOptions {
        txn_ids_cached: MIN_TXN_IDS_CACHED,
        snapshot_every_records: 0,
        ..JournalOptions::default()
    }
}

/// A store that drops every transaction key: a journal written before the index.
struct Unindexed(FjallStore);

impl JournalStore for Unindexed {
    fn append(&self, records: &[EncodedRecord]) -> Result<(), String> {
        let stripped: Vec<EncodedRecord> = records
            .iter()
            .cloned()
            .map(|mut r| {
                r.txn_key = None;
                r
            })
            .collect();
        self.0.append(&stripped)
    }
    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String> {
        self.0.read_raw_after(after, limit)
    }
    fn room_positions(&self, room: &str, after: u64, limit: usize) -> Result<Vec<u64>, String> {
        self.0.room_positions(room, after, limit)
    }
    fn truncate_from(&self, position: u64) -> Result<(), String> {
        self.0.truncate_from(position)
    }
}

/// Sends `n` messages with txn ids `t0..` into a new room, concurrently (group commit
/// keeps this to a few fsyncs). Returns the room and each txn's event id.
async fn fill(journal: &Journal, key: &ServerKey, n: usize) -> (String, Vec<String>) {
    let room = journal
        .submit(signed(key, create_room(None)))
        .await
        .unwrap()
        .room_id
        .unwrap()
        .to_string();
    let sends: Vec<_> = (0..n)
        .map(|i| {
            let (j, cmd) = (
                journal.clone(),
                signed(key, message(&room, &format!("t{i}"))),
            );
            tokio::spawn(async move { j.submit(cmd).await })
        })
        .collect();
    let mut ids = Vec::with_capacity(n);
    for s in sends {
        ids.push(s.await.unwrap().unwrap().event_ids[0].to_string());
    }
    (room, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_txn_id_evicted_from_memory_still_answers_its_first_event() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = Arc::new(FjallStore::open(dir.path()).unwrap());
    let journal = Journal::open_with(store, key.clone(), options()).unwrap();
    let n = MIN_TXN_IDS_CACHED + 16;
    let (room, ids) = fill(&journal, &key, n).await;
    let head = journal.durable_head();
    assert_eq!(head, 2 + n as u64);
    let stats = journal.stats();
    let reads = stats.txn_index_reads.load(Ordering::Relaxed);
    // Every new txn id was a hot-set miss: one index read each, none found.
    assert_eq!(reads, n as u64);
    assert_eq!(stats.txn_index_hits.load(Ordering::Relaxed), 0);
    // The hot set holds the most recent MIN_TXN_IDS_CACHED: the retry of the last is
    // answered from memory (no index read).
    let last = journal
        .submit(signed(&key, message(&room, &format!("t{}", n - 1))))
        .await
        .unwrap();
    assert_eq!(last.event_ids[0].as_str(), ids[n - 1]);
    assert_eq!(stats.txn_index_reads.load(Ordering::Relaxed), reads);
    // Which ones were evicted depends on the order the concurrent sends took the room
    // lock; the sequential sends below give an exact order: 16 more evict the oldest
    // 16 of the hot set, so with n - MIN + 16 = 32 gone in all, at least t0's first
    // answer comes from the index now.
    for i in 0..16 {
        journal
            .submit(signed(&key, message(&room, &format!("s{i}"))))
            .await
            .unwrap();
    }
    let head = journal.durable_head();
    let before = stats.txn_index_reads.load(Ordering::Relaxed);
    let mut from_index = 0;
    for (i, id) in ids.iter().enumerate() {
        let again = journal
            .submit(signed(&key, message(&room, &format!("t{i}"))))
            .await
            .unwrap();
        assert_eq!(again.event_ids[0].as_str(), id, "t{i}");
        from_index = stats.txn_index_hits.load(Ordering::Relaxed);
    }
    // Nothing was sent twice.
    assert_eq!(journal.durable_head(), head);
    // Exactly the 32 evicted keys were read back from the index (and put back in the
    // hot set, which evicted others in turn: those are index hits too). At least 32.
    assert!(from_index >= 32, "{from_index}");
    assert_eq!(
        stats.txn_index_reads.load(Ordering::Relaxed) - before,
        from_index
    );
    // The same txn id in another room is another send.
    let (other, _) = fill(&journal, &key, 0).await;
    let elsewhere = journal
        .submit(signed(&key, message(&other, "t0")))
        .await
        .unwrap();
    assert_ne!(elsewhere.event_ids[0].as_str(), ids[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txn_ids_survive_a_restart_without_being_held_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let (room, ids, device_pos, head) = {
        let store = Arc::new(FjallStore::open(dir.path()).unwrap());
        // Snapshots on: the restart loads one (it holds no txn ids) and replays nothing.
        let j = Journal::open_with(
            store,
            key.clone(),
            JournalOptions {
                snapshot_every_records: 1,
                ..options()
            },
        )
        .unwrap();
        let (room, ids) = fill(&j, &key, 3).await;
        let d = j.submit(signed(&key, to_device("d1"))).await.unwrap();
        (room, ids, d.position, j.durable_head())
    };
    let store = Arc::new(FjallStore::open(dir.path()).unwrap());
    let j = Journal::open_with(store, key.clone(), options()).unwrap();
    let stats = j.stats();
    for (i, id) in ids.iter().enumerate() {
        let again = j
            .submit(signed(&key, message(&room, &format!("t{i}"))))
            .await
            .unwrap();
        assert_eq!(again.event_ids[0].as_str(), id);
    }
    let again = j.submit(signed(&key, to_device("d1"))).await.unwrap();
    assert_eq!(again.position, device_pos);
    assert_eq!(j.durable_head(), head);
    assert_eq!(stats.txn_index_hits.load(Ordering::Relaxed), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_replay_indexes_a_journal_written_before_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let (room, ids, device_pos, head) = {
        let store = Arc::new(Unindexed(FjallStore::open(dir.path()).unwrap()));
        let j = Journal::open_with(store, key.clone(), options()).unwrap();
        let (room, ids) = fill(&j, &key, 2).await;
        let d = j.submit(signed(&key, to_device("d1"))).await.unwrap();
        (room, ids, d.position, j.durable_head())
    };
    let store = FjallStore::open(dir.path()).unwrap();
    // Nothing indexed by the old appender.
    let k = spindle_journal::txn::event_key(&room, ALICE, "DEV", "t0");
    assert_eq!(store.txn_position(&k).unwrap(), None);
    let store = Arc::new(store);
    let j = Journal::open_with(store.clone(), key.clone(), options()).unwrap();
    // Replay indexed it at t0's position: 3 or 4, as `fill` sends t0 and t1 at once.
    let indexed = store.txn_position(&k).unwrap();
    for (i, id) in ids.iter().enumerate() {
        let again = j
            .submit(signed(&key, message(&room, &format!("t{i}"))))
            .await
            .unwrap();
        assert_eq!(again.event_ids[0].as_str(), id);
        if i == 0 {
            assert_eq!(indexed, Some(again.position));
            assert!(matches!(again.position, 3 | 4), "{}", again.position);
        }
    }
    let again = j.submit(signed(&key, to_device("d1"))).await.unwrap();
    assert_eq!(again.position, device_pos);
    assert_eq!(j.durable_head(), head);
}
