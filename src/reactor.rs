//! What the reactors (push delivery, application services, the guest kick) share: journal consumers
//! with side effects that decide from projections (memberships, pushers, aliases), so
//! they take a batch of records only once the projections have applied it.

use std::time::Duration;

use spindle_journal::{Journal, StoredRecord};
use spindle_projections::Projections;

/// The next records after `after` (at most `batch`), returned once the projections have
/// applied the last of them; `None` when there is nothing after `after` yet. A journal
/// read error is logged and retried after a second; projections more than ten seconds
/// behind are logged (`reactor` names the consumer) and waited for.
pub(crate) async fn read_applied(
    journal: &Journal,
    projections: &Projections,
    after: u64,
    batch: usize,
    reactor: &'static str,
) -> Option<Vec<std::sync::Arc<StoredRecord>>> {
    loop {
        match journal.next_after(after, batch).await {
            Ok(b) if b.is_empty() => return None,
            Ok(b) => {
                let last = b.last().map(|r| r.position()).unwrap_or(after);
                while !projections
                    .runtime
                    .wait_for(last, Duration::from_secs(10))
                    .await
                {
                    tracing::warn!(reactor, position = last, "projections are behind");
                }
                return Some(b);
            }
            Err(e) => {
                tracing::error!(reactor, error = %e, "journal read failed");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
