//! The federation sender: a journal consumer that delivers our users' events to every
//! other server in the room (spec: server-server API, "Transactions").
//!
//! Shape: one worker per destination server, each with its own durable cursor (a
//! journal position, in `<data>/consumers/federation-sender.json`). A worker reads the
//! journal after its cursor, keeps the events it must deliver (sent by one of our users,
//! in a room where the destination has a joined member, or a membership event naming
//! one of the destination's users), and sends them in transactions of at most 50 PDUs.
//! The cursor moves only after the destination acknowledged the transaction, so
//! nothing is lost across a restart of either side; a retried transaction keeps its
//! transaction id (derived from the positions it covers), so the receiver can drop a
//! duplicate. A failing destination is retried with exponential backoff from
//! `retry_initial_ms` up to `retry_max_ms`, then caught up from its cursor. Memory per
//! destination is one batch; the journal is the queue.
//!
//! A dispatcher tails the journal from the head it found at start-up and starts a
//! worker the first time an event must reach a server with no worker yet (its cursor
//! starts just before that event).

use std::{collections::HashMap, path::Path, sync::Arc, time::Duration};

use spindle_journal::consumer::Cursors;

use crate::{FedState, server_of, transactions::urlencode};

/// Most PDUs per transaction (spec).
pub const MAX_TXN_PDUS: usize = 50;

/// Records read from the journal per step.
const READ_BATCH: usize = 256;

/// How often a cursor that moved without a delivery is saved.
const IDLE_SAVE_INTERVAL: Duration = Duration::from_secs(10);

/// Counters for tests: transactions sent and acknowledged, PDUs delivered.
#[derive(Debug, Default)]
pub struct SenderStats {
    /// Transactions the destination acknowledged.
    pub transactions: std::sync::atomic::AtomicU64,
    /// PDUs in acknowledged transactions.
    pub pdus: std::sync::atomic::AtomicU64,
    /// Failed attempts.
    pub failures: std::sync::atomic::AtomicU64,
}

/// The running sender.
#[derive(Clone)]
pub struct FederationSender {
    st: FedState,
    cursors: Arc<parking_lot::Mutex<Cursors>>,
    workers: Arc<parking_lot::Mutex<HashMap<String, tokio::sync::watch::Sender<()>>>>,
    /// Counters.
    pub stats: Arc<SenderStats>,
}

impl FederationSender {
    /// Starts the sender: a worker per destination with a stored cursor, and the
    /// dispatcher. Errors if the cursor file cannot be read.
    pub fn start(st: FedState, consumers_dir: &Path) -> Result<FederationSender, String> {
        let cursors = Cursors::open(consumers_dir, "federation-sender")?;
        let start = cursors.get("").unwrap_or_else(|| st.journal.durable_head());
        let stored: Vec<(String, u64)> = cursors
            .all()
            .iter()
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let sender = FederationSender {
            st,
            cursors: Arc::new(parking_lot::Mutex::new(cursors)),
            workers: Arc::default(),
            stats: Arc::default(),
        };
        for (dest, cursor) in stored {
            sender.spawn_worker(dest, cursor);
        }
        let s = sender.clone();
        tokio::spawn(async move { s.dispatch(start).await });
        Ok(sender)
    }

    /// The destinations of one record, if it is one of our events.
    async fn destinations(&self, rec: &spindle_journal::StoredRecord) -> Vec<String> {
        let Some(pdu) = rec.pdu() else {
            return Vec::new();
        };
        let ours = self.st.server_name();
        if server_of(pdu.sender.as_str()) != Some(ours) {
            return Vec::new();
        }
        let mut out: Vec<String> = self
            .st
            .journal
            .servers_in_room(pdu.room_id.as_str())
            .await
            .into_iter()
            .filter(|s| s != ours)
            .collect();
        if pdu.kind.to_string() == "m.room.member"
            && let Some(target) = pdu.state_key.as_deref().and_then(server_of)
            && target != ours
            && !out.iter().any(|s| s == target)
        {
            // Invites go through `/invite`; a kick, ban or leave still reaches the
            // server of the member it removes.
            let membership = pdu
                .content_value()
                .get("membership")
                .and_then(|m| m.as_str())
                .map(str::to_owned);
            if membership.as_deref() != Some("invite") {
                out.push(target.to_owned());
            }
        }
        out
    }

    async fn dispatch(self, mut after: u64) {
        let mut last_saved = std::time::Instant::now();
        loop {
            let batch = match self.st.journal.next_after(after, READ_BATCH).await {
                Ok(b) if b.is_empty() => return,
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "federation sender: journal read failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            let last = batch.last().map(|r| r.position()).unwrap_or(after);
            for rec in &batch {
                for dest in self.destinations(rec).await {
                    let known = self.workers.lock().contains_key(&dest);
                    if !known {
                        self.spawn_worker(dest, rec.position() - 1);
                    }
                }
            }
            after = last;
            // Only where to look for new destinations: saved now and then (a restart
            // from an older position finds the same destinations again).
            if last_saved.elapsed() >= IDLE_SAVE_INTERVAL {
                last_saved = std::time::Instant::now();
                if let Err(e) = self.cursors.lock().set("", after) {
                    tracing::warn!(error = %e, "federation sender: cursor not saved");
                }
            }
        }
    }

    fn spawn_worker(&self, dest: String, cursor: u64) {
        let (tx, rx) = tokio::sync::watch::channel(());
        self.workers.lock().insert(dest.clone(), tx);
        if let Err(e) = self.cursors.lock().set(&dest, cursor) {
            tracing::warn!(error = %e, "federation sender: cursor not saved");
        }
        let s = self.clone();
        tokio::spawn(async move { s.run_worker(dest, cursor, rx).await });
    }

    /// Wakes a destination's worker now (its backoff is cut short).
    pub fn wake(&self, dest: &str) {
        if let Some(tx) = self.workers.lock().get(dest) {
            let _ = tx.send(());
        }
    }

    async fn run_worker(
        self,
        dest: String,
        mut cursor: u64,
        mut wake: tokio::sync::watch::Receiver<()>,
    ) {
        let cfg = self.st.config.clone();
        let mut backoff_ms = cfg.retry_initial_ms;
        let mut idle_saved = std::time::Instant::now();
        loop {
            // Collect up to 50 PDUs for this destination after the cursor.
            let mut pdus = Vec::new();
            let mut covered = cursor;
            loop {
                let batch = match self.st.journal.next_after(covered, READ_BATCH).await {
                    Ok(b) if b.is_empty() => return,
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!(error = %e, "federation sender: journal read failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                for rec in &batch {
                    if pdus.len() >= MAX_TXN_PDUS {
                        break;
                    }
                    if self.destinations(rec).await.iter().any(|d| *d == dest)
                        && let Some(p) = rec.pdu()
                    {
                        pdus.push(p.federation_json());
                    }
                    covered = rec.position();
                }
                if !pdus.is_empty() {
                    break;
                }
                // Nothing for this destination in the batch: move on without sending,
                // saving the cursor now and then (not per record: that would be an
                // fsync per local event; a restart just rescans a little).
                cursor = covered;
                if idle_saved.elapsed() >= IDLE_SAVE_INTERVAL {
                    idle_saved = std::time::Instant::now();
                    if let Err(e) = self.cursors.lock().set(&dest, cursor) {
                        tracing::warn!(error = %e, "federation sender: cursor not saved");
                    }
                }
            }
            let txn_id = format!("{}-{}", cursor + 1, covered);
            let body = serde_json::json!({
                "origin": self.st.server_name(),
                "origin_server_ts": crate::now_ms(),
                "pdus": pdus,
                "edus": [],
            });
            let path = format!("/_matrix/federation/v1/send/{}", urlencode(&txn_id));
            match self
                .st
                .client
                .request(reqwest::Method::PUT, &dest, &path, Some(&body))
                .await
            {
                Ok(answer) => {
                    if let Some(results) = answer.get("pdus").and_then(|p| p.as_object()) {
                        for (id, r) in results {
                            if let Some(err) = r.get("error") {
                                tracing::info!(destination = %dest, event_id = %id, error = %err, "destination refused a PDU");
                            }
                        }
                    }
                    self.stats
                        .transactions
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.stats
                        .pdus
                        .fetch_add(pdus.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    cursor = covered;
                    if let Err(e) = self.cursors.lock().set(&dest, cursor) {
                        tracing::warn!(error = %e, "federation sender: cursor not saved");
                    }
                    backoff_ms = cfg.retry_initial_ms;
                }
                Err(e) => {
                    self.stats
                        .failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::info!(destination = %dest, error = %e, retry_in_ms = backoff_ms, "federation transaction failed");
                    let _ = tokio::time::timeout(Duration::from_millis(backoff_ms), wake.changed())
                        .await;
                    backoff_ms = (backoff_ms.saturating_mul(2)).min(cfg.retry_max_ms.max(1));
                }
            }
        }
    }
}
