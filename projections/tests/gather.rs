//! A projection that lets records gather (`Projection::gather_ms`) applies them at once
//! when a reader waits for it, and a projection of one class of records is not woken by
//! the others yet counts as having applied them, and moves its checkpoint past them
//! without reading them (`Projection::interest`).

mod common;

use std::{sync::Arc, time::Duration};

use common::{append_facts, journal_with};
use spindle_journal::{Interest, StoredRecord};
use spindle_projections::{
    Projection, ProjectionDb, Runtime,
    store::{ApplyCtx, Table},
};

/// One row per record it reads, with the reading habits under test.
struct Rows {
    name: &'static str,
    rows: Table,
    gather_ms: u64,
    interest: Interest,
}

impl Projection for Rows {
    fn name(&self) -> &'static str {
        self.name
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.rows.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        ctx.put(&self.rows, record.position().to_be_bytes().to_vec(), vec![]);
        Ok(())
    }
    fn gather_ms(&self) -> u64 {
        self.gather_ms
    }
    /// Only a projection that does not gate reads may gather.
    fn gates_reads(&self) -> bool {
        self.gather_ms == 0
    }
    fn interest(&self) -> Interest {
        self.interest
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_reader_cuts_the_gathering_short() {
    let dir = tempfile::tempdir().unwrap();
    let journal = journal_with(0, &dir.path().join("journal")).await;
    let db = ProjectionDb::open(&dir.path().join("projections")).unwrap();
    let rows = |name, gather_ms, interest| {
        Arc::new(Rows {
            name,
            rows: db.table(name, "rows").unwrap(),
            gather_ms,
            interest,
        })
    };
    // Gathers for a minute; reads room records only.
    let slow = rows("slow", 60_000, Interest::ALL);
    let room_only = rows("room_only", 0, Interest::ROOM);
    let runtime = Runtime::start(
        journal.clone(),
        db.clone(),
        vec![slow.clone(), room_only.clone()],
    );
    append_facts(&journal, 0..3).await;
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
