//! The JetStream journal backend (SPEC §6 "Beyond one machine", issue 14): the journal
//! in a NATS JetStream stream, shared by several Spindle processes.
//!
//! **Shape.** One stream (`[journal.nats] stream`, default `spindle`) holds every
//! record, one message per record, on subject `<stream>.room.<room id, base64url>` for
//! a room's records and `<stream>.fact` for the rest (a consumer can follow one room).
//! The stream sequence *is* the record's position: positions stay global, contiguous
//! and ascending, so sync tokens and `prev_hash` keep their meaning unchanged.
//!
//! **One writer, fenced.** Every process serves the whole API, but only the process
//! holding the writer lease (a key in the KV bucket `<stream>_leases`, refreshed every
//! third of `lease_ttl_ms`) runs the journal's write models and appends; the others
//! forward each signed command to it over NATS request/reply (`<stream>.commands`) and
//! answer their client once their own copy of the journal has the result. Each append
//! carries `Nats-Expected-Last-Sequence: position - 1`, so the stream itself refuses a
//! record from a process whose view is stale (a deposed writer that has not noticed):
//! two processes can never both append at one position, in one room or across rooms.
//! A writer whose append is refused, or whose lease is lost, stops the process (the
//! same fail-stop rule as a failed fsync on the embedded store: its in-memory models
//! are ahead of the log); a supervisor restarts it as a follower. `Nats-Msg-Id`
//! (position and record hash) makes the writer's own retry of an append idempotent.
//!
//! **Durability** is JetStream's acknowledgement: the record is stored on the stream's
//! replicas (`replicas`, R3 in a three-node cluster) before the command is answered.
//!
//! **The local mirror.** Each process keeps the records it has seen in an embedded
//! [`FjallStore`] (`<data_dir>/journal`, written without fsync: the stream is the
//! authority, and opening the store fetches whatever the mirror lacks). Every read
//! path (projections, the transaction index, snapshots) reads the mirror exactly as
//! with the embedded backend. Followers receive new records through an ordered
//! consumer of the stream ([`NatsStore::follow`]) and apply them to their write models,
//! so a follower that takes the lease over is already warm.

use std::{future::Future, path::Path, sync::Mutex, time::Duration};

use async_nats::{
    HeaderMap,
    jetstream::{self, consumer, message::PublishMessage, stream},
};
use base64::Engine;
use futures_util::StreamExt;

use crate::{
    record::{StoredRecord, record_hash},
    store::{EncodedRecord, FjallStore, JournalStore, StorageMemory, StorageUse},
};

/// Header carrying a record's transaction key ([`crate::txn`]), base64url, so every
/// process's mirror indexes it as the writer's does.
const TXN_HEADER: &str = "Spindle-Txn-Key";

/// Records copied into the local mirror per store batch while catching up.
const CATCH_UP_BATCH: usize = 512;

/// `[journal.nats]`: where the stream is and how this process takes part.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsOptions {
    /// NATS server URLs (`nats://host:port`); the client reconnects to any of them.
    pub servers: Vec<String>,
    /// The JetStream stream (created if missing); also the prefix of every subject and
    /// of the lease bucket. Letters, digits, `-` and `_` only.
    pub stream: String,
    /// Replicas of the stream and of the lease bucket when they are created (1, 3 or
    /// 5; at most the cluster's size). An existing stream keeps its own.
    pub replicas: usize,
    /// How long the writer lease lives without a refresh, ms (the holder refreshes it
    /// every third of this). A standby takes over at most this long after the writer
    /// dies; a writer that cannot refresh within it stops.
    pub lease_ttl_ms: u64,
    /// How long a forwarded command waits for the writer (including a writer
    /// election), ms.
    pub request_timeout_ms: u64,
    /// Whether this process may hold the writer lease. A process with `false` only
    /// ever forwards its commands.
    pub writer: bool,
}

impl Default for NatsOptions {
    /// `nats://127.0.0.1:4222`, stream `spindle`, R1, 10 s lease, 30 s requests.
    fn default() -> Self {
        NatsOptions {
            servers: vec!["nats://127.0.0.1:4222".into()],
            stream: "spindle".into(),
            replicas: 1,
            lease_ttl_ms: 10_000,
            request_timeout_ms: 30_000,
            writer: true,
        }
    }
}

impl NatsOptions {
    /// Checks the settings; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.servers.is_empty() {
            return Err("journal.nats.servers: at least one server URL".into());
        }
        if self.stream.is_empty()
            || !self
                .stream
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!(
                "journal.nats.stream: {:?} must be letters, digits, '-' and '_'",
                self.stream
            ));
        }
        if self.stream.ends_with("_cursors") || self.stream.ends_with("_leases") {
            return Err(format!(
                "journal.nats.stream: {:?} ends in _cursors or _leases, the names of the \
                 journal's own side streams",
                self.stream
            ));
        }
        if !matches!(self.replicas, 1 | 3 | 5) {
            return Err("journal.nats.replicas: 1, 3 or 5".into());
        }
        if self.lease_ttl_ms < 1_000 {
            return Err("journal.nats.lease_ttl_ms: at least 1000".into());
        }
        if self.request_timeout_ms < 1_000 {
            return Err("journal.nats.request_timeout_ms: at least 1000".into());
        }
        Ok(())
    }

    /// The subject a record goes to.
    fn subject(&self, room_id: Option<&str>) -> String {
        match room_id {
            Some(room) => format!(
                "{}.room.{}",
                self.stream,
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(room)
            ),
            None => format!("{}.fact", self.stream),
        }
    }

    /// The subject forwarded commands go to.
    pub(crate) fn commands_subject(&self) -> String {
        format!("{}.commands", self.stream)
    }
}

/// One record received from the stream by a follower.
pub(crate) struct Followed {
    /// Its stream sequence (= position).
    pub(crate) sequence: u64,
    /// The record's bytes.
    pub(crate) bytes: Vec<u8>,
    /// Its transaction key, if the writer indexed one.
    pub(crate) txn_key: Option<Vec<u8>>,
}

/// The JetStream-backed [`JournalStore`]: appends go to the stream (fenced, see the
/// module docs), reads come from the local mirror.
pub struct NatsStore {
    local: FjallStore,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    handle: tokio::runtime::Handle,
    client: async_nats::Client,
    js: jetstream::Context,
    options: NatsOptions,
    /// The consumers' cursor stream, opened on first use.
    cursors: std::sync::OnceLock<stream::Stream>,
}

impl Drop for NatsStore {
    fn drop(&mut self) {
        // Dropping a runtime blocks; this may run inside another runtime's task.
        if let Some(rt) = self.runtime.lock().ok().and_then(|mut r| r.take()) {
            rt.shutdown_background();
        }
    }
}

/// Runs `fut` on `handle` and blocks the calling thread until it finishes (callable
/// from plain threads and from inside another runtime's tasks alike).
fn run_on<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    fut: impl Future<Output = T> + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    let wait = || {
        rx.recv()
            .map_err(|_| "the NATS client runtime stopped".to_string())
    };
    // On a worker of a multi-threaded runtime (a consumer saving its cursors), let the
    // runtime move its other tasks to another worker while this one waits for NATS.
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
    }
}

impl NatsStore {
    /// Connects to NATS, creates the stream if it is missing, opens the local mirror in
    /// `dir` and copies into it every record of the stream it lacks. Refuses a mirror
    /// whose records are not the stream's (another stream, a stream that lost records).
    pub fn open(
        dir: &Path,
        memory: StorageMemory,
        options: NatsOptions,
    ) -> Result<NatsStore, String> {
        let store = NatsStore::connect(dir, memory, options)?;
        store.catch_up()?;
        Ok(store)
    }

    /// Connects to NATS, creates the stream if it is missing and opens the local store
    /// in `dir`, without comparing or copying anything.
    pub(crate) fn connect(
        dir: &Path,
        memory: StorageMemory,
        options: NatsOptions,
    ) -> Result<NatsStore, String> {
        let store = NatsStore::connect_only(dir, memory, options)?;
        store.ensure_stream()?;
        Ok(store)
    }

    /// [`NatsStore::connect`] to a stream that must exist already (an error naming it
    /// otherwise; nothing is created on NATS).
    pub(crate) fn connect_existing(
        dir: &Path,
        memory: StorageMemory,
        options: NatsOptions,
    ) -> Result<NatsStore, String> {
        let store = NatsStore::connect_only(dir, memory, options)?;
        let js = store.js.clone();
        let name = store.options.stream.clone();
        store.run(async move {
            js.get_stream(&name).await.map(|_| ()).map_err(|e| {
                format!("stream {name} does not exist or is unreachable ({e}): check journal.nats.stream")
            })
        })??;
        Ok(store)
    }

    fn connect_only(
        dir: &Path,
        memory: StorageMemory,
        options: NatsOptions,
    ) -> Result<NatsStore, String> {
        options.validate()?;
        let local = FjallStore::open_with(dir, memory)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("journal-nats")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let handle = runtime.handle().clone();
        let servers = options.servers.clone();
        let timeout = Duration::from_millis(options.request_timeout_ms);
        let client = run_on(&handle, async move {
            let addrs: Vec<async_nats::ServerAddr> = servers
                .iter()
                .map(|s| {
                    s.parse()
                        .map_err(|e| format!("journal.nats.servers {s:?}: {e}"))
                })
                .collect::<Result<_, String>>()?;
            async_nats::ConnectOptions::new()
                .name("spindle")
                .request_timeout(Some(timeout))
                .connection_timeout(Duration::from_secs(5))
                .connect(addrs)
                .await
                .map_err(|e| format!("connecting to NATS: {e}"))
        })??;
        let js = jetstream::new(client.clone());
        let store = NatsStore {
            local,
            runtime: Mutex::new(Some(runtime)),
            handle,
            client,
            js,
            options,
            cursors: std::sync::OnceLock::new(),
        };
        Ok(store)
    }

    /// The options this store was opened with.
    pub fn options(&self) -> &NatsOptions {
        &self.options
    }

    /// Runs `fut` on the store's NATS runtime, blocking the caller.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        fut: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, String> {
        run_on(&self.handle, fut)
    }

    /// Runs `fut` on the NATS client's runtime in the background.
    pub(crate) fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) {
        self.handle.spawn(fut);
    }

    /// The NATS client.
    pub(crate) fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context.
    pub(crate) fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    fn ensure_stream(&self) -> Result<(), String> {
        let js = self.js.clone();
        let o = self.options.clone();
        self.run(async move {
            let config = stream::Config {
                name: o.stream.clone(),
                subjects: vec![format!("{}.room.*", o.stream), format!("{}.fact", o.stream)],
                storage: stream::StorageType::File,
                num_replicas: o.replicas,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            };
            // A cluster still electing leaders (starting, or a node just died) times
            // requests out for a few seconds: retried until `request_timeout_ms`.
            let deadline = std::time::Instant::now() + Duration::from_millis(o.request_timeout_ms);
            let mut s = loop {
                match js.get_or_create_stream(config.clone()).await {
                    Ok(s) => break s,
                    Err(e) if std::time::Instant::now() < deadline => {
                        tracing::warn!(error = %e, "journal: the stream is not ready; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => {
                        return Err(format!("creating the journal stream {}: {e}", o.stream));
                    }
                }
            };
            let info = s.info().await.map_err(|e| e.to_string())?;
            if info.config.num_replicas != o.replicas {
                tracing::warn!(
                    stream = %o.stream,
                    has = info.config.num_replicas,
                    configured = o.replicas,
                    "the journal stream keeps its own replica count; change it with the nats CLI"
                );
            }
            Ok(())
        })?
    }

    /// The stream's last sequence (its head position).
    pub fn stream_head(&self) -> Result<u64, String> {
        let js = self.js.clone();
        let name = self.options.stream.clone();
        self.run(async move {
            let s = js.get_stream(&name).await.map_err(|e| e.to_string())?;
            let info = s.get_info().await.map_err(|e| e.to_string())?;
            Ok(info.state.last_sequence)
        })?
    }

    /// Whether the local store's record at `position` is the stream's (same bytes, by
    /// hash). `position` must exist in both.
    pub(crate) fn same_record_at(&self, position: u64) -> Result<bool, String> {
        let ours = self
            .local
            .read_raw_after(position - 1, 1)?
            .into_iter()
            .next()
            .filter(|(p, _)| *p == position)
            .map(|(_, b)| record_hash(&b));
        let js = self.js.clone();
        let name = self.options.stream.clone();
        let theirs = self.run(async move {
            let s = js.get_stream(&name).await.map_err(|e| e.to_string())?;
            let m = s
                .get_raw_message(position)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(record_hash(&m.payload))
        })??;
        Ok(ours == Some(theirs))
    }

    /// Publishes each record with `Nats-Expected-Last-Sequence: position - 1` (and a
    /// message id of its position and hash) and waits for every acknowledgement;
    /// errors if the stream refuses one (another process appended first) or does not
    /// acknowledge it within `request_timeout_ms`.
    pub(crate) fn publish(&self, records: &[EncodedRecord]) -> Result<(), String> {
        let js = self.js.clone();
        let messages: Vec<(String, PublishMessage, u64)> = records
            .iter()
            .map(|r| {
                let hash = record_hash(&r.bytes);
                let mut headers = HeaderMap::new();
                if let Some(k) = &r.txn_key {
                    headers.insert(
                        TXN_HEADER,
                        base64::engine::general_purpose::URL_SAFE_NO_PAD
                            .encode(k)
                            .as_str(),
                    );
                }
                let msg = PublishMessage::build()
                    .payload(r.bytes.clone().into())
                    .headers(headers)
                    .message_id(format!(
                        "{}-{}",
                        r.position,
                        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&hash[..12])
                    ))
                    .expected_last_sequence(r.position - 1);
                (self.options.subject(r.room_id.as_deref()), msg, r.position)
            })
            .collect();
        let deadline =
            std::time::Instant::now() + Duration::from_millis(self.options.request_timeout_ms);
        self.run(async move {
            // Pipelined: every record is sent before the first acknowledgement is awaited.
            let mut acks = Vec::with_capacity(messages.len());
            for (subject, msg, position) in &messages {
                acks.push(js.send_publish(subject.clone(), msg.clone()).await.map(|a| (a, *position)));
            }
            // After the first failure every later record is sent again, in order: a
            // pipelined record behind a lost one was refused by the fence only because
            // its predecessor was not stored yet.
            let mut failed = false;
            for ((subject, msg, position), sent) in messages.iter().zip(acks) {
                let mut attempt = if failed {
                    Err(String::from("resending after an earlier failure"))
                } else {
                    match sent {
                        Ok((ack, _)) => ack.await.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    }
                };
                let mut resent = failed;
                if attempt.is_err() {
                    failed = true;
                }
                // A lost acknowledgement or a NATS node going away: send the same record
                // again. Its `Nats-Msg-Id` makes a record the stream already stored come
                // back as a duplicate with its first sequence, never a second copy.
                while let Err(e) = &attempt {
                    let fenced = e.contains("wrong last sequence");
                    if (fenced && resent) || std::time::Instant::now() >= deadline {
                        return Err(format!("appending record {position} to the stream: {e}"));
                    }
                    if !fenced {
                        tracing::warn!(position, error = %e, "journal: appending to the stream failed; retrying");
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    resent = true;
                    attempt = match js.send_publish(subject.clone(), msg.clone()).await {
                        Ok(ack) => ack.await.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                }
                let ack = attempt.expect("the loop leaves only on success");
                if ack.sequence != *position {
                    return Err(format!(
                        "the stream stored record {position} at sequence {}",
                        ack.sequence
                    ));
                }
            }
            Ok(())
        })?
    }

    /// The local store (the mirror, or the embedded journal a copy publishes).
    pub(crate) fn local(&self) -> &FjallStore {
        &self.local
    }

    /// [`NatsStore::stream_head`] without blocking the caller's thread.
    pub(crate) async fn stream_head_async(&self) -> Result<u64, String> {
        let js = self.js.clone();
        let name = self.options.stream.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.handle.spawn(async move {
            let head = async {
                let s = js.get_stream(&name).await.map_err(|e| e.to_string())?;
                let info = s.get_info().await.map_err(|e| e.to_string())?;
                Ok::<_, String>(info.state.last_sequence)
            }
            .await;
            let _ = tx.send(head);
        });
        rx.await
            .map_err(|_| "the NATS client runtime stopped".to_string())?
    }

    /// Copies into the mirror every record the stream has after the mirror's last.
    pub(crate) fn catch_up(&self) -> Result<(), String> {
        let mirrored = self.local.last_position()?;
        let head = self.stream_head()?;
        if mirrored > head {
            return Err(format!(
                "the local journal mirror ends at position {mirrored}, but stream {} ends at \
                 {head}: if this data directory's embedded journal was being copied into the \
                 stream, run `spindle journal copy-to-nats` again to finish the copy; \
                 otherwise it belongs to another stream (or the stream lost records): move \
                 it away to rebuild it from the stream",
                self.options.stream
            ));
        }
        if mirrored > 0 && !self.same_record_at(mirrored)? {
            return Err(format!(
                "the local journal mirror's record {mirrored} differs from stream {}'s: \
                 this data directory belongs to another stream",
                self.options.stream
            ));
        }
        if head == mirrored {
            return Ok(());
        }
        tracing::info!(
            from = mirrored + 1,
            to = head,
            "journal: copying records from the stream into the local mirror"
        );
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Followed>(CATCH_UP_BATCH * 2);
        let stop = self.follow(mirrored, tx)?;
        let mut next = mirrored + 1;
        let mut batch = Vec::with_capacity(CATCH_UP_BATCH);
        while next <= head {
            let Some(f) = rx.blocking_recv() else {
                stop.abort();
                return Err("the stream consumer stopped while catching up".into());
            };
            batch.push(self.encoded(f, next)?);
            next += 1;
            if batch.len() >= CATCH_UP_BATCH || next > head {
                self.local.append_with(&batch, false)?;
                batch.clear();
            }
        }
        stop.abort();
        Ok(())
    }

    /// A received record as the mirror stores it, checked to sit at `expected`.
    pub(crate) fn encoded(&self, f: Followed, expected: u64) -> Result<EncodedRecord, String> {
        let rec = StoredRecord::from_bytes(&f.bytes)
            .map_err(|e| format!("stream message {}: {e}", f.sequence))?;
        if f.sequence != expected || rec.position() != expected {
            return Err(format!(
                "stream message {} holds record {}, expected {expected}",
                f.sequence,
                rec.position()
            ));
        }
        Ok(EncodedRecord {
            position: expected,
            room_id: rec.room_id().map(str::to_owned),
            bytes: f.bytes,
            txn_key: f.txn_key,
        })
    }

    /// Writes records received from the stream into the mirror (handed to the OS, no
    /// fsync).
    pub(crate) fn mirror(&self, records: &[EncodedRecord]) -> Result<(), String> {
        self.local.append_with(records, false)
    }

    /// Checks that this process signs with the deployment's key: the first process
    /// records its public key in the cursor stream (`~server-key`); any other process
    /// with another key is refused, since the writer would refuse every command it
    /// forwards, and a record it appended as the writer would not verify for the rest.
    pub(crate) fn check_signing_key(&self, key_id: &str, public: &str) -> Result<(), String> {
        let ours = format!("{key_id} {public}");
        match self.cursor_get("~server-key")? {
            Some(stored) if stored == ours.as_bytes() => Ok(()),
            Some(stored) => Err(format!(
                "this process's signing.key ({ours}) is not the one the other processes of \
                 stream {} sign with ({}); copy signing.key from one of them into this data \
                 directory (docs/scale-out.md, step 3)",
                self.options.stream,
                String::from_utf8_lossy(&stored)
            )),
            None => self.cursor_put("~server-key", ours.into_bytes()),
        }
    }

    /// Starts an ordered consumer delivering every record after position `after` into
    /// `tx`, in order, until `tx` closes or the returned handle is aborted.
    pub(crate) fn follow(
        &self,
        after: u64,
        tx: tokio::sync::mpsc::Sender<Followed>,
    ) -> Result<tokio::task::AbortHandle, String> {
        let js = self.js.clone();
        let name = self.options.stream.clone();
        let task = self.handle.spawn(async move {
            let mut next = after + 1;
            loop {
                match consume(&js, &name, &mut next, &tx).await {
                    Ok(()) => return,
                    Err(e) => {
                        // A NATS node went away, a heartbeat was missed: start a new
                        // consumer where this one stopped.
                        tracing::warn!(error = %e, next, "journal: following the stream failed; resuming");
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                }
            }
        });
        Ok(task.abort_handle())
    }
}

/// Delivers the stream's records from `*next` on into `tx`, advancing `*next`; `Ok`
/// once `tx` is closed, `Err` when the consumer fails.
async fn consume(
    js: &jetstream::Context,
    name: &str,
    next: &mut u64,
    tx: &tokio::sync::mpsc::Sender<Followed>,
) -> Result<(), String> {
    let s = js.get_stream(name).await.map_err(|e| e.to_string())?;
    let consumer = s
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: *next,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    while let Some(m) = messages.next().await {
        let m = m.map_err(|e| e.to_string())?;
        let sequence = m.info().map_err(|e| e.to_string())?.stream_sequence;
        let txn_key = m
            .headers
            .as_ref()
            .and_then(|h| h.get(TXN_HEADER))
            .and_then(|v| {
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(v.as_str())
                    .ok()
            });
        let f = Followed {
            sequence,
            bytes: m.message.payload.to_vec(),
            txn_key,
        };
        if tx.send(f).await.is_err() {
            return Ok(());
        }
        *next = sequence + 1;
    }
    Err("the stream consumer ended".into())
}

impl JournalStore for NatsStore {
    fn memory_use(&self) -> Option<StorageUse> {
        self.local.memory_use()
    }

    /// Publishes each record (see [`NatsStore::publish`]), then writes the mirror. Any
    /// refusal (another process appended first) or failure is an error: the appender
    /// stops the process.
    fn append(&self, records: &[EncodedRecord]) -> Result<(), String> {
        self.publish(records)?;
        self.local.append_with(records, false)
    }

    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String> {
        self.local.read_raw_after(after, limit)
    }

    fn room_positions(&self, room_id: &str, after: u64, limit: usize) -> Result<Vec<u64>, String> {
        self.local.room_positions(room_id, after, limit)
    }

    /// Only the mirror is truncated (a torn local tail); the stream is never cut.
    fn truncate_from(&self, position: u64) -> Result<(), String> {
        self.local.truncate_from(position)
    }

    fn last_position(&self) -> Result<u64, String> {
        self.local.last_position()
    }

    fn txn_position(&self, key: &[u8]) -> Result<Option<u64>, String> {
        self.local.txn_position(key)
    }

    fn index_txns(&self, entries: &[(Vec<u8>, u64)]) -> Result<(), String> {
        self.local.index_txns(entries)
    }

    fn load_snapshot(&self) -> Result<Option<Vec<u8>>, String> {
        self.local.load_snapshot()
    }

    fn save_snapshot(&self, bytes: &[u8]) -> Result<(), String> {
        self.local.save_snapshot(bytes)
    }

    fn delete_snapshot(&self) -> Result<(), String> {
        self.local.delete_snapshot()
    }
}

impl NatsStore {
    /// The consumers' cursor stream `<stream>_cursors` (one subject per consumer, only
    /// its last message kept), created on first use.
    fn cursor_stream(&self) -> Result<stream::Stream, String> {
        if let Some(s) = self.cursors.get() {
            return Ok(s.clone());
        }
        let js = self.js.clone();
        let name = format!("{}_cursors", self.options.stream);
        let replicas = self.options.replicas;
        let deadline =
            std::time::Instant::now() + Duration::from_millis(self.options.request_timeout_ms);
        self.run(async move {
            loop {
                let attempt = js
                    .get_or_create_stream(stream::Config {
                        name: name.clone(),
                        subjects: vec![format!("{name}.*")],
                        storage: stream::StorageType::File,
                        num_replicas: replicas,
                        max_messages_per_subject: 1,
                        ..Default::default()
                    })
                    .await;
                match attempt {
                    Ok(s) => return Ok(s),
                    // A cluster re-electing leaders (a node just died) times requests
                    // out for a few seconds.
                    Err(e) if std::time::Instant::now() < deadline => {
                        tracing::warn!(error = %e, "journal: the cursor stream is not ready; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(format!("creating the cursor stream {name}: {e}")),
                }
            }
        })?
        .map(|s| self.cursors.get_or_init(|| s).clone())
    }

    fn cursor_subject(&self, consumer: &str) -> String {
        format!(
            "{}_cursors.{}",
            self.options.stream,
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(consumer)
        )
    }

    /// A consumer's cursors (see [`crate::consumer::Cursors`]), `None` before the
    /// first are stored.
    pub(crate) fn cursor_get(&self, consumer: &str) -> Result<Option<Vec<u8>>, String> {
        let stream = self.cursor_stream()?;
        let subject = self.cursor_subject(consumer);
        self.run(async move {
            match stream.get_last_raw_message_by_subject(&subject).await {
                Ok(m) => Ok(Some(m.payload.to_vec())),
                Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => Err(e.to_string()),
            }
        })?
    }

    /// The consumers with cursors in the cursor stream (not the `~`-named entries the
    /// journal keeps there for itself).
    pub(crate) fn cursor_consumers(&self) -> Result<Vec<String>, String> {
        let stream = self.cursor_stream()?;
        let prefix = format!("{}_cursors.", self.options.stream);
        let filter = format!("{prefix}*");
        let subjects = self.run(async move {
            let mut info = stream
                .info_with_subjects(filter)
                .await
                .map_err(|e| e.to_string())?;
            let mut subjects = Vec::new();
            while let Some(s) = info.next().await {
                subjects.push(s.map_err(|e| e.to_string())?.0);
            }
            Ok::<_, String>(subjects)
        })??;
        let mut consumers: Vec<String> = subjects
            .iter()
            .filter_map(|s| s.strip_prefix(&prefix))
            .filter_map(|b| {
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(b)
                    .ok()
            })
            .filter_map(|b| String::from_utf8(b).ok())
            .filter(|c| !c.starts_with('~'))
            .collect();
        consumers.sort();
        Ok(consumers)
    }

    /// Stores a consumer's cursors (acknowledged by the stream's replicas).
    pub(crate) fn cursor_put(&self, consumer: &str, bytes: Vec<u8>) -> Result<(), String> {
        let js = self.js.clone();
        let subject = self.cursor_subject(consumer);
        self.run(async move {
            js.publish(subject, bytes.into())
                .await
                .map_err(|e| e.to_string())?
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })?
    }
}

/// The writer lease: the subject `<stream>_leases.writer` of the stream
/// `<stream>_leases`, which keeps one message per subject for at most `lease_ttl_ms`
/// (`max_age`). Whoever publishes the first message while there is none (expected last
/// subject sequence 0) holds the lease; it refreshes it by publishing again with the
/// sequence of its last message as the expected one (a compare-and-set), and deletes
/// it on a clean stop. A holder that stops refreshing loses it when the message ages
/// out. (The same scheme as a JetStream key-value bucket, built on the stream API:
/// the key-value API of the client does not speak to a 2.9 server.)
pub(crate) struct Lease {
    js: jetstream::Context,
    stream: stream::Stream,
    subject: String,
    holder: String,
}

/// What one lease attempt found.
pub(crate) enum LeaseState {
    /// We hold it: the sequence of our lease message.
    Held(u64),
    /// Someone else does (their name).
    Taken(String),
}

impl Lease {
    /// Opens (creating it if missing) the lease stream.
    pub(crate) async fn open(
        js: &jetstream::Context,
        options: &NatsOptions,
        holder: String,
    ) -> Result<Lease, String> {
        let name = format!("{}_leases", options.stream);
        let stream = js
            .get_or_create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.*")],
                storage: stream::StorageType::File,
                num_replicas: options.replicas,
                max_messages_per_subject: 1,
                max_age: Duration::from_millis(options.lease_ttl_ms),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating the lease stream {name}: {e}"))?;
        Ok(Lease {
            js: js.clone(),
            stream,
            subject: format!("{name}.writer"),
            holder,
        })
    }

    async fn publish(&self, expected: u64) -> Result<u64, String> {
        let msg = PublishMessage::build()
            .payload(self.holder.clone().into_bytes().into())
            .expected_last_subject_sequence(expected);
        let ack = self
            .js
            .send_publish(self.subject.clone(), msg)
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        Ok(ack.sequence)
    }

    /// Tries to take the lease.
    pub(crate) async fn acquire(&self) -> Result<LeaseState, String> {
        match self.publish(0).await {
            Ok(sequence) => Ok(LeaseState::Held(sequence)),
            Err(e) if e.contains("wrong last sequence") => {
                let who = self
                    .stream
                    .get_last_raw_message_by_subject(&self.subject)
                    .await
                    .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
                    .unwrap_or_default();
                Ok(LeaseState::Taken(who))
            }
            Err(e) => Err(e),
        }
    }

    /// Refreshes a held lease; an error means it is lost (`wrong last sequence`:
    /// someone else holds it now) or NATS is unreachable.
    pub(crate) async fn renew(&self, sequence: u64) -> Result<u64, String> {
        match self.publish(sequence).await {
            Err(e) if e.contains("wrong last sequence") => {
                // A refresh that was stored but whose acknowledgement was lost moved the
                // sequence on: the last message is still ours.
                match self
                    .stream
                    .get_last_raw_message_by_subject(&self.subject)
                    .await
                {
                    Ok(m) if m.payload.as_ref() == self.holder.as_bytes() => Ok(m.sequence),
                    _ => Err(e),
                }
            }
            r => r,
        }
    }

    /// Gives a held lease up (a clean stop), so a standby takes over at once.
    pub(crate) async fn release(&self, sequence: u64) -> Result<(), String> {
        self.stream
            .delete_message(sequence)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
