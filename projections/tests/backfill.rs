//! A projection new in a release backfills from position 0 while the others serve:
//! `applied()` (what reads and sync tokens wait for) does not wait for it, it reports
//! not ready until it reaches the head, and then it joins.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

mod common;

use common::journal_with;
use spindle_journal::StoredRecord;
use spindle_projections::{
    Projection, ProjectionDb, Runtime,
    store::{ApplyCtx, Table},
};

/// Keeps one row per record; while `gate` (when set) is closed (`true`), apply waits,
/// so a test stops the projection mid-backfill.
struct Rows {
    name: &'static str,
    rows: Table,
    gate: Option<Arc<AtomicBool>>,
}

impl Projection for Rows {
    fn name(&self) -> &'static str {
        self.name
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.rows.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        while self
            .gate
            .as_ref()
            .is_some_and(|g| g.load(Ordering::Acquire))
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        ctx.put(&self.rows, record.position().to_be_bytes().to_vec(), vec![]);
        Ok(())
    }
}

fn rows(
    db: &ProjectionDb,
    name: &'static str,
    gate: Option<Arc<AtomicBool>>,
) -> Arc<dyn Projection> {
    Arc::new(Rows {
        name,
        rows: db.table(name, "rows").unwrap(),
        gate,
    })
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_projection_backfills_while_the_others_serve() {
    let dir = tempfile::tempdir().unwrap();
    let journal = journal_with(40, &dir.path().join("journal")).await;
    let db = ProjectionDb::open(&dir.path().join("projections")).unwrap();
    // First release: only "old".
    let first = Runtime::start(journal.clone(), db.clone(), vec![rows(&db, "old", None)]);
    assert!(first.wait_for(40, Duration::from_secs(20)).await);

    // Next release adds "new"; it is held mid-backfill.
    let gate = Arc::new(AtomicBool::new(true));
    let second = Runtime::start(
        journal.clone(),
        db.clone(),
        vec![rows(&db, "old", None), rows(&db, "new", Some(gate.clone()))],
    );
    // Reads do not wait for the backfill: applied is the head at once.
    assert_eq!(second.applied(), 40);
    assert!(second.wait_for(40, Duration::from_secs(1)).await);
    assert!(second.is_ready("old"));
    assert!(!second.is_ready("new"));
    let status = second.status();
    assert_eq!(status[1].name, "new");
    assert_eq!((status[1].checkpoint, status[1].ready), (0, false));

    gate.store(false, Ordering::Release);
    until("the backfill", || second.is_ready("new")).await;
    assert_eq!(second.status()[1].checkpoint, 40);
    assert_eq!(second.applied(), 40);
    assert_eq!(second.digests()[0].1.len(), 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_projections_directory_is_not_backfilled_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let journal = journal_with(5, &dir.path().join("journal")).await;
    let db = ProjectionDb::open(&dir.path().join("projections")).unwrap();
    let gate = Arc::new(AtomicBool::new(true));
    // Nothing ran yet (a deleted projections/): every projection is part of `applied`,
    // and the server waits for all of them before listening.
    let rt = Runtime::start(
        journal.clone(),
        db.clone(),
        vec![rows(&db, "a", None), rows(&db, "b", Some(gate.clone()))],
    );
    assert!(rt.is_ready("b"));
    assert!(!rt.wait_for(5, Duration::from_millis(300)).await);
    assert_eq!(rt.applied(), 0);
    gate.store(false, Ordering::Release);
    assert!(rt.wait_for(5, Duration::from_secs(20)).await);
}
