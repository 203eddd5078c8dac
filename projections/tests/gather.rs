//! A projection that lets records gather (`Projection::gather_ms`) applies them at once
//! when a reader waits for it, and a projection of one class of records is not woken by
//! the others yet counts as having applied them, and moves its checkpoint past them
//! without reading them (`Projection::interest`).

use std::{sync::Arc, time::Duration};

use spindle_core::keys::ServerKey;
use spindle_journal::{
    CommandBody, CommandEnvelope, Fact, FjallStore, Interest, Journal, SignedCommand, StoredRecord,
};
use spindle_projections::{
    Projection, ProjectionDb, Runtime,
    store::{ApplyCtx, Table},
};

/// One row per record it reads; gathers for a minute; does not gate reads.
struct Slow {
    rows: Table,
}

impl Projection for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.rows.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        ctx.put(&self.rows, record.position().to_be_bytes().to_vec(), vec![]);
        Ok(())
    }
    fn gather_ms(&self) -> u64 {
        60_000
    }
    fn gates_reads(&self) -> bool {
        false
    }
}

/// One row per record it reads; reads room records only.
struct RoomOnly {
    rows: Table,
}

impl Projection for RoomOnly {
    fn name(&self) -> &'static str {
        "room_only"
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.rows.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        ctx.put(&self.rows, record.position().to_be_bytes().to_vec(), vec![]);
        Ok(())
    }
    fn interest(&self) -> Interest {
        Interest::ROOM
    }
}

async fn revoke(journal: &Journal, key: &Arc<ServerKey>, i: usize) {
    let cmd = SignedCommand::sign(
        key,
        CommandEnvelope {
            principal: "@a:example.org".into(),
            device_id: None,
            issued_at: 1,
            body: CommandBody::Fact {
                fact: Fact::TokenRevoked {
                    token_hash: format!("h{i}"),
                },
            },
        },
    )
    .unwrap();
    journal.submit(cmd).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_reader_cuts_the_gathering_short() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = Arc::new(FjallStore::open(&dir.path().join("journal")).unwrap());
    let journal = Journal::open(store, key.clone()).unwrap();
    let db = ProjectionDb::open(&dir.path().join("projections")).unwrap();
    let slow = Arc::new(Slow {
        rows: db.table("slow", "rows").unwrap(),
    });
    let room_only = Arc::new(RoomOnly {
        rows: db.table("room_only", "rows").unwrap(),
    });
    let runtime = Runtime::start(
        journal.clone(),
        db.clone(),
        vec![slow.clone(), room_only.clone()],
    );
    for i in 0..3 {
        revoke(&journal, &key, i).await;
    }
    // Without the hurry the slow projection would sit in its minute of gathering.
    assert!(
        runtime
            .wait_for_projection("slow", 3, Duration::from_secs(20))
            .await
    );
    assert_eq!(slow.rows.scan_prefix(b"", 100).len(), 3);
    // Facts did not wake the room-record projection into a batch, and it covers them
    // anyway; its checkpoint moved past them without reading them, and a first one was
    // stored (one left at 0 reads as new after a crash; later ones by the idle rules).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while db.checkpoint("room_only") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "checkpoint never stored"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(runtime.batches("room_only"), Some(0));
    assert_eq!(runtime.checkpoint("room_only"), Some(3));
    assert!(room_only.rows.scan_prefix(b"", 100).is_empty());
    assert!(
        runtime
            .wait_for_projection("room_only", 3, Duration::from_secs(1))
            .await
    );
}
