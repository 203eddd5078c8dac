//! The federation sender: a journal consumer that delivers our users' events to every
//! other server in the room (spec: server-server API, "Transactions").
//!
//! Shape: one worker per destination server, each with its own durable cursor (a
//! journal position, in `<data>/consumers/federation-sender.json`). A worker reads the
//! journal after its cursor, keeps what it must deliver ([`crate::edus::outbound_of`]:
//! events sent by one of our users in a room where the destination has a joined
//! member, or a membership event naming one of the destination's users; our users'
//! public receipts in such rooms; to-device messages to the destination's users), and
//! sends them in transactions of at most 50 PDUs and 100 EDUs. Typing and presence,
//! which live in memory, are queued per destination ([`FederationSender::queue_edu`],
//! at most [`MAX_QUEUED_EDUS`], oldest dropped first) and ride in the next transaction,
//! which is sent at once when nothing else is pending.
//! The cursor moves only after the destination acknowledged the transaction, so
//! nothing is lost across a restart of either side; a retried transaction keeps its
//! transaction id and body, so the receiver can drop a duplicate. A failing destination is retried with exponential backoff from
//! `retry_initial_ms` up to `retry_max_ms`, then caught up from its cursor. Memory per
//! destination is one batch; the journal is the queue.
//!
//! A dispatcher tails the journal from the head it found at start-up and starts a
//! worker the first time an event must reach a server with no worker yet (its cursor
//! starts just before that event).

use std::{
    collections::{HashMap, VecDeque},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use serde_json::Value;
use spindle_journal::consumer::Cursors;

use crate::{FedState, edus::Outbound, server_of, transactions::urlencode};

/// Most PDUs per transaction (spec).
pub const MAX_TXN_PDUS: usize = 50;

/// Most EDUs per transaction (spec).
pub const MAX_TXN_EDUS: usize = 100;

/// Most in-memory EDUs (typing, presence) waiting for one destination; when full, the
/// oldest is dropped (they are best effort, and a destination that is down for long
/// would only get stale ones).
pub const MAX_QUEUED_EDUS: usize = 100;

/// Records read from the journal per step.
const READ_BATCH: usize = 256;

/// Counters for tests: transactions sent and acknowledged, PDUs delivered.
#[derive(Debug, Default)]
pub struct SenderStats {
    /// Transactions the destination acknowledged.
    pub transactions: std::sync::atomic::AtomicU64,
    /// PDUs in acknowledged transactions.
    pub pdus: std::sync::atomic::AtomicU64,
    /// EDUs in acknowledged transactions.
    pub edus: std::sync::atomic::AtomicU64,
    /// In-memory EDUs dropped because their destination's queue was full.
    pub edus_dropped: std::sync::atomic::AtomicU64,
    /// Failed attempts.
    pub failures: std::sync::atomic::AtomicU64,
}

/// How a destination's worker is woken.
struct Worker {
    /// Cuts a failing destination's backoff short.
    wake: tokio::sync::watch::Sender<()>,
    /// An in-memory EDU was queued (does not cut a backoff short).
    queued: Arc<tokio::sync::Notify>,
}

fn is_device_list_update(edu: &Value) -> bool {
    edu.get("edu_type").and_then(|t| t.as_str()) == Some("m.device_list_update")
}

/// The running sender.
#[derive(Clone)]
pub struct FederationSender {
    st: FedState,
    cursors: Arc<parking_lot::Mutex<Cursors>>,
    workers: Arc<parking_lot::Mutex<HashMap<String, Worker>>>,
    /// In-memory EDUs waiting per destination.
    queued: Arc<parking_lot::Mutex<HashMap<String, VecDeque<Value>>>>,
    /// Where the dispatcher's next read starts: a worker started for an in-memory EDU
    /// starts here, so it still sees every record the dispatcher has not looked at.
    dispatched: Arc<AtomicU64>,
    /// Makes transaction ids unique across transactions that cover the same journal
    /// range (EDU-only ones) and across restarts: starts at the start-up time in ms.
    txn_seq: Arc<AtomicU64>,
    /// A record from another server (a PDU or EDU it sent us) has gone by: this server
    /// federates even if it never had to send anything yet (see [`Self::federates`]).
    met_remote: Arc<std::sync::atomic::AtomicBool>,
    /// Counters.
    pub stats: Arc<SenderStats>,
}

impl FederationSender {
    /// Starts the sender: a worker per destination with a stored cursor, and the
    /// dispatcher. Errors if the cursor file cannot be read.
    pub fn start(st: FedState, consumers_dir: &Path) -> Result<FederationSender, String> {
        let cursors = st.journal.cursors(consumers_dir, "federation-sender")?;
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
            queued: Arc::default(),
            dispatched: Arc::new(AtomicU64::new(start)),
            txn_seq: Arc::new(AtomicU64::new(crate::now_ms())),
            met_remote: Arc::default(),
            stats: Arc::default(),
        };
        for (dest, cursor) in stored {
            sender.spawn_worker(dest, cursor);
        }
        let s = sender.clone();
        tokio::spawn(async move { s.dispatch(start).await });
        Ok(sender)
    }

    /// What a record sends and to which servers (see [`crate::edus::outbound_of`]).
    async fn outbound(
        &self,
        rec: &spindle_journal::StoredRecord,
    ) -> Option<(Outbound, Vec<String>)> {
        let ours = self.st.server_name();
        // Records another server caused are journaled under its name as principal.
        let principal = rec.principal();
        if !principal.starts_with('@') && principal != ours && !principal.is_empty() {
            self.met_remote
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let names = self.st.config.allow_device_name_lookup_over_federation;
        let out = crate::edus::outbound_of(rec, ours, names)?;
        let dests = match &out {
            Outbound::Pdu(pdu) => {
                let mut dests = self.other_servers(pdu.room_id.as_str()).await;
                if pdu.kind.to_string() == "m.room.member"
                    && let Some(target) = pdu.state_key.as_deref().and_then(server_of)
                    && target != ours
                    && !dests.iter().any(|s| s == target)
                {
                    // Invites go through `/invite`; a kick, ban or leave still reaches
                    // the server of the member it removes.
                    let membership = pdu
                        .content_value()
                        .get("membership")
                        .and_then(|m| m.as_str())
                        .map(str::to_owned);
                    if membership.as_deref() != Some("invite") {
                        dests.push(target.to_owned());
                    }
                }
                dests
            }
            Outbound::Receipt { room_id, .. } => self.other_servers(room_id).await,
            Outbound::ToDevice(per_server) => per_server.iter().map(|(s, _)| s.clone()).collect(),
            // Only once this server federates with anyone: finding the user's rooms is
            // a store read, and a server that never federated has no one to tell (a
            // server that meets the user later asks for the devices itself).
            Outbound::User { .. } if !self.federates() => Vec::new(),
            Outbound::User { user_id, .. } => {
                let mut dests = std::collections::BTreeSet::new();
                for (room, m) in self.st.projections.membership.rooms_of(user_id) {
                    if m.membership == "join" {
                        dests.extend(self.other_servers(&room).await);
                    }
                }
                dests.into_iter().collect()
            }
        };
        (!dests.is_empty()).then_some((out, dests))
    }

    /// Whether any destination has a worker (this server has sent, or has had to
    /// send, something to another server since its cursors were first written), or
    /// another server's record has gone by since start-up (a remote user joined one of
    /// our rooms, and we have not sent them anything yet). Memory only.
    pub fn federates(&self) -> bool {
        self.met_remote.load(std::sync::atomic::Ordering::Relaxed)
            || !self.workers.lock().is_empty()
    }

    /// The servers other than ours with a user joined to the room.
    pub async fn other_servers(&self, room_id: &str) -> Vec<String> {
        let ours = self.st.server_name();
        let mut servers = self.st.journal.servers_in_room(room_id).await;
        servers.retain(|s| s != ours);
        servers
    }

    /// Queues an in-memory EDU (typing, presence) for `dest` and wakes its worker
    /// (starting one if there is none). At most [`MAX_QUEUED_EDUS`] wait per
    /// destination: the oldest goes first.
    pub fn queue_edu(&self, dest: &str, edu: Value) {
        if dest == self.st.server_name() {
            return;
        }
        {
            let mut queued = self.queued.lock();
            let q = queued.entry(dest.to_owned()).or_default();
            if q.len() >= MAX_QUEUED_EDUS {
                q.pop_front();
                self.stats.edus_dropped.fetch_add(1, Ordering::Relaxed);
            }
            q.push_back(edu);
        }
        let notify = self.workers.lock().get(dest).map(|w| w.queued.clone());
        if let Some(n) = notify {
            n.notify_one();
        } else {
            self.spawn_worker(dest.to_owned(), self.dispatched.load(Ordering::Acquire));
        }
    }

    /// [`FederationSender::queue_edu`] to every other server with a member in the room.
    pub async fn queue_room_edu(&self, room_id: &str, edu: Value) {
        for dest in self.other_servers(room_id).await {
            self.queue_edu(&dest, edu.clone());
        }
    }

    /// Takes up to `room` queued EDUs for `dest`.
    fn take_queued(&self, dest: &str, into: &mut Vec<Value>) {
        let mut queued = self.queued.lock();
        if let Some(q) = queued.get_mut(dest) {
            while into.len() < MAX_TXN_EDUS {
                match q.pop_front() {
                    Some(e) => into.push(e),
                    None => break,
                }
            }
        }
    }

    async fn dispatch(self, mut after: u64) {
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
                for dest in self.outbound(rec).await.map(|o| o.1).unwrap_or_default() {
                    let known = self.workers.lock().contains_key(&dest);
                    if !known {
                        self.spawn_worker(dest, rec.position() - 1);
                    }
                }
            }
            after = last;
            self.dispatched.store(after, Ordering::Release);
            // Only where to look for new destinations: saved now and then (a restart
            // from an older position finds the same destinations again).
            if let Err(e) = self.cursors.lock().advance("", after) {
                tracing::warn!(error = %e, "federation sender: cursor not saved");
            }
        }
    }

    fn spawn_worker(&self, dest: String, cursor: u64) {
        let (tx, rx) = tokio::sync::watch::channel(());
        let queued = Arc::new(tokio::sync::Notify::new());
        {
            let mut workers = self.workers.lock();
            if workers.contains_key(&dest) {
                return;
            }
            workers.insert(
                dest.clone(),
                Worker {
                    wake: tx,
                    queued: queued.clone(),
                },
            );
        }
        if let Err(e) = self.cursors.lock().set(&dest, cursor) {
            tracing::warn!(error = %e, "federation sender: cursor not saved");
        }
        let s = self.clone();
        tokio::spawn(async move { s.run_worker(dest, cursor, rx, queued).await });
    }

    /// Wakes a destination's worker now (its backoff is cut short).
    pub fn wake(&self, dest: &str) {
        if let Some(w) = self.workers.lock().get(dest) {
            let _ = w.wake.send(());
        }
    }

    /// Appends what `rec` sends to `dest` to the transaction being collected.
    async fn collect(
        &self,
        rec: &spindle_journal::StoredRecord,
        dest: &str,
        pdus: &mut Vec<Value>,
        edus: &mut Vec<Value>,
    ) {
        let Some((out, dests)) = self.outbound(rec).await else {
            return;
        };
        if !dests.iter().any(|d| d == dest) {
            return;
        }
        match out {
            Outbound::Pdu(p) => pdus.push(p.federation_json()),
            Outbound::Receipt { edu, .. } => edus.push(edu),
            Outbound::ToDevice(per_server) => edus.extend(
                per_server
                    .into_iter()
                    .filter(|(s, _)| s == dest)
                    .map(|(_, e)| e),
            ),
            Outbound::User {
                user_id,
                edus: mut more,
            } => {
                if more.iter().any(is_device_list_update)
                    && let Some(prev) = self.device_list_prev(&user_id, rec.position()).await
                {
                    for edu in more.iter_mut().filter(|e| is_device_list_update(e)) {
                        edu["content"]["prev_id"] = serde_json::json!([prev]);
                        self.fill_device_state(&user_id, &mut edu["content"]);
                    }
                }
                edus.extend(more)
            }
        }
    }

    /// The `prev_id` of the device list update made at `position`: the user's previous
    /// change, once the device keys projection has applied everything before it
    /// (bounded wait; `None` then, and for a user's first change: the receiver
    /// fetches the whole list, which is always correct).
    async fn device_list_prev(&self, user_id: &str, position: u64) -> Option<u64> {
        let runtime = &self.st.projections.runtime;
        // The accounts projection too: [`Self::fill_device_state`] reads device names.
        for projection in ["device_keys", "accounts"] {
            if !runtime
                .wait_for_projection(projection, position, Duration::from_secs(5))
                .await
            {
                return None;
            }
        }
        Some(
            self.st
                .projections
                .device_keys
                .device_list_stream_id_before(user_id, position),
        )
        .filter(|p| *p > 0)
    }

    /// Puts the device's current `keys` (with the owner's signatures merged in) and
    /// `device_display_name` into an `m.device_list_update` that names a `prev_id`:
    /// the receiver then applies it to its copy as the device's whole state (spec:
    /// an absent `keys` means the device has none, an absent name that it has
    /// none), so an update made by a rename or a signature upload, which carries
    /// neither, must not strip them. A deletion is left as it is. Two point reads.
    fn fill_device_state(&self, user_id: &str, content: &mut Value) {
        if content.get("deleted").and_then(Value::as_bool) == Some(true) {
            return;
        }
        let Some(device_id) = content
            .get("device_id")
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            return;
        };
        let Some(c) = content.as_object_mut() else {
            return;
        };
        let projections = &self.st.projections;
        match projections.device_keys.device_key(user_id, &device_id) {
            Some(keys) => {
                let keys = projections
                    .device_keys
                    .with_signatures(user_id, &device_id, None, keys);
                c.insert("keys".into(), keys);
            }
            None => {
                c.remove("keys");
            }
        }
        // The name only where `[federation] allow_device_name_lookup_over_federation`
        // lets names leave the server.
        match projections
            .accounts
            .device(user_id, &device_id)
            .and_then(|d| d.display_name)
            .filter(|_| self.st.config.allow_device_name_lookup_over_federation)
        {
            Some(name) => {
                c.insert("device_display_name".into(), Value::String(name));
            }
            None => {
                c.remove("device_display_name");
            }
        }
    }

    async fn run_worker(
        self,
        dest: String,
        mut cursor: u64,
        mut wake: tokio::sync::watch::Receiver<()>,
        queued: Arc<tokio::sync::Notify>,
    ) {
        let cfg = self.st.config.clone();
        let mut backoff_ms = cfg.retry_initial_ms;
        loop {
            // Collect up to 50 PDUs and 100 EDUs for this destination: what the journal
            // holds after the cursor, then the queued in-memory EDUs. Waits while there
            // is nothing.
            let mut pdus = Vec::new();
            let mut edus = Vec::new();
            let mut covered = cursor;
            loop {
                let ready = self.st.journal.durable_head() > covered;
                let batch = if ready {
                    self.st.journal.next_after(covered, READ_BATCH).await
                } else {
                    self.take_queued(&dest, &mut edus);
                    if !edus.is_empty() {
                        break;
                    }
                    tokio::select! {
                        b = self.st.journal.next_after(covered, READ_BATCH) => b,
                        // An in-memory EDU was queued: collect again.
                        _ = queued.notified() => continue,
                    }
                };
                let batch = match batch {
                    Ok(b) if b.is_empty() => return,
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!(error = %e, "federation sender: journal read failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                for rec in &batch {
                    if pdus.len() >= MAX_TXN_PDUS || edus.len() >= MAX_TXN_EDUS {
                        break;
                    }
                    self.collect(rec, &dest, &mut pdus, &mut edus).await;
                    covered = rec.position();
                }
                if !pdus.is_empty() || !edus.is_empty() {
                    self.take_queued(&dest, &mut edus);
                    break;
                }
                // Nothing for this destination in the batch: move on without sending,
                // saving the cursor now and then (not per record: that would be an
                // fsync per local event; a restart just rescans a little).
                cursor = covered;
                if let Err(e) = self.cursors.lock().advance(&dest, cursor) {
                    tracing::warn!(error = %e, "federation sender: cursor not saved");
                }
            }
            let seq = self.txn_seq.fetch_add(1, Ordering::Relaxed);
            let txn_id = format!("{}-{}.{seq}", cursor + 1, covered);
            let body = serde_json::json!({
                "origin": self.st.server_name(),
                "origin_server_ts": crate::now_ms(),
                "pdus": pdus,
                "edus": edus,
            });
            let path = format!("/_matrix/federation/v1/send/{}", urlencode(&txn_id));
            // The same transaction (id and body) until the destination acknowledges it.
            loop {
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
                        self.stats.transactions.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .pdus
                            .fetch_add(pdus.len() as u64, Ordering::Relaxed);
                        self.stats
                            .edus
                            .fetch_add(edus.len() as u64, Ordering::Relaxed);
                        cursor = covered;
                        if let Err(e) = self.cursors.lock().set(&dest, cursor) {
                            tracing::warn!(error = %e, "federation sender: cursor not saved");
                        }
                        backoff_ms = cfg.retry_initial_ms;
                        break;
                    }
                    Err(e) => {
                        self.stats.failures.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(destination = %dest, error = %e, retry_in_ms = backoff_ms, "federation transaction failed");
                        let _ =
                            tokio::time::timeout(Duration::from_millis(backoff_ms), wake.changed())
                                .await;
                        backoff_ms = (backoff_ms.saturating_mul(2)).min(cfg.retry_max_ms.max(1));
                    }
                }
            }
        }
    }
}
