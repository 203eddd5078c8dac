//! One journal shared by several processes ([`crate::nats`]): following the stream,
//! taking the writer lease over, and forwarding commands to the writer.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use ruma::{OwnedEventId, OwnedRoomId};
use serde::{Deserialize, Serialize};

use crate::{
    ChainHead, ClaimedKey, Fact, Journal, JournalError, KeyClaim, Outcome, PartialState,
    RoomAggregate, SignedCommand, ToAppender, apply_key_fact,
    nats::{Followed, Lease, LeaseState, NatsStore},
    record::StoredRecord,
    send_to_appender,
};

/// What a process that lost the writer role answers to a forwarded command it did not
/// run; the forwarding process sends it again to the next writer.
const NOT_THE_WRITER: &str = "this process is no longer the journal writer";

/// Ephemeral payloads waiting to be published, at most.
pub const EPHEMERAL_QUEUE: usize = 1024;

/// The header naming the process that published an ephemeral payload.
const ORIGIN_HEADER: &str = "Spindle-Origin";

/// See [`Journal::ephemeral_channel`].
pub struct EphemeralChannel {
    /// Payloads for the other processes, at most [`EPHEMERAL_QUEUE`] waiting (send with
    /// `try_send` and drop what does not fit: while NATS is unreachable the queue fills
    /// and later changes are dropped, not kept to be replayed stale).
    pub send: tokio::sync::mpsc::Sender<Vec<u8>>,
    /// Payloads the other processes sent, in the order NATS delivered them.
    pub recv: tokio::sync::mpsc::Receiver<Vec<u8>>,
}

/// Records a follower applies per batch (one mirror write, one head publish).
const FOLLOW_BATCH: usize = 512;

/// How long a new writer waits for its copy to reach the stream's head.
const TAKEOVER_CATCH_UP: Duration = Duration::from_secs(60);

/// The shared-journal part of a [`Journal`].
pub(crate) struct Cluster {
    pub(crate) store: Arc<NatsStore>,
    /// Set while this process holds the writer lease and appends itself.
    writer: AtomicBool,
    /// The head of the chain this process has applied, and whether it stopped
    /// following (it became the writer).
    follow: parking_lot::Mutex<FollowState>,
    /// Asks the lease task to give the lease up (a clean stop).
    stop: tokio::sync::watch::Sender<bool>,
    /// This process's name in the lease (`<hostname>-<pid>-<random>`).
    holder: String,
    /// The consumer following the stream (stopped on takeover).
    consumer: parking_lot::Mutex<Option<tokio::task::AbortHandle>>,
    /// The task answering forwarded commands (while this process is the writer).
    commands: parking_lot::Mutex<Option<tokio::task::AbortHandle>>,
}

struct FollowState {
    chain: ChainHead,
    stopped: bool,
}

impl Cluster {
    pub(crate) fn new(store: Arc<NatsStore>, chain: ChainHead) -> Cluster {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "spindle".into());
        Cluster {
            store,
            writer: AtomicBool::new(false),
            follow: parking_lot::Mutex::new(FollowState {
                chain,
                stopped: false,
            }),
            stop: tokio::sync::watch::channel(false).0,
            holder: format!("{host}-{}-{}", std::process::id(), crate::random_id(6)),
            consumer: parking_lot::Mutex::new(None),
            commands: parking_lot::Mutex::new(None),
        }
    }
}

/// A forwarded command run, as it travels to the writer.
#[derive(Serialize, Deserialize)]
struct WireRequest {
    commands: Vec<SignedCommand>,
}

/// The writer's answer: one result per command.
#[derive(Serialize, Deserialize)]
struct WireReply {
    results: Vec<WireResult>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireResult {
    Ok {
        position: u64,
        room_id: Option<String>,
        event_ids: Vec<String>,
        claimed: Vec<(KeyClaim, serde_json::Value)>,
    },
    Err {
        kind: String,
        message: String,
    },
}

impl WireResult {
    fn from_result(r: Result<Outcome, JournalError>) -> WireResult {
        match r {
            Ok(o) => WireResult::Ok {
                position: o.position,
                room_id: o.room_id.map(|r| r.to_string()),
                event_ids: o.event_ids.iter().map(|e| e.to_string()).collect(),
                claimed: o.claimed.into_iter().map(|c| (c.claim, c.key)).collect(),
            },
            Err(e) => {
                let (kind, message) = match &e {
                    JournalError::Forbidden(m) => ("forbidden", m.clone()),
                    JournalError::BadState(m) => ("bad_state", m.clone()),
                    JournalError::UnknownRoom(m) => ("unknown_room", m.clone()),
                    JournalError::UserInUse => ("user_in_use", String::new()),
                    JournalError::AliasInUse => ("alias_in_use", String::new()),
                    JournalError::TooLarge(m) => ("too_large", m.clone()),
                    JournalError::BadJson(m) => ("bad_json", m.clone()),
                    JournalError::UnsupportedRoomVersion(m) => {
                        ("unsupported_room_version", m.clone())
                    }
                    JournalError::BadSignature => ("bad_signature", String::new()),
                    JournalError::Storage(m) => ("storage", m.clone()),
                    JournalError::MissingPrevEvents(m) => ("missing_prev_events", m.clone()),
                    JournalError::MediaExists(m) => ("media_exists", m.clone()),
                    JournalError::Unavailable(m) => ("unavailable", m.clone()),
                };
                WireResult::Err {
                    kind: kind.into(),
                    message,
                }
            }
        }
    }

    fn into_result(self) -> Result<Outcome, JournalError> {
        match self {
            WireResult::Ok {
                position,
                room_id,
                event_ids,
                claimed,
            } => {
                let bad = |e: String| JournalError::Storage(format!("the writer's answer: {e}"));
                Ok(Outcome {
                    position,
                    room_id: room_id
                        .map(|r| OwnedRoomId::try_from(r).map_err(|e| bad(e.to_string())))
                        .transpose()?,
                    event_ids: event_ids
                        .into_iter()
                        .map(|e| OwnedEventId::try_from(e).map_err(|e| bad(e.to_string())))
                        .collect::<Result<_, _>>()?,
                    claimed: claimed
                        .into_iter()
                        .map(|(claim, key)| ClaimedKey { claim, key })
                        .collect(),
                })
            }
            WireResult::Err { kind, message } => Err(match kind.as_str() {
                "forbidden" => JournalError::Forbidden(message),
                "bad_state" => JournalError::BadState(message),
                "unknown_room" => JournalError::UnknownRoom(message),
                "user_in_use" => JournalError::UserInUse,
                "alias_in_use" => JournalError::AliasInUse,
                "too_large" => JournalError::TooLarge(message),
                "bad_json" => JournalError::BadJson(message),
                "unsupported_room_version" => JournalError::UnsupportedRoomVersion(message),
                "bad_signature" => JournalError::BadSignature,
                "missing_prev_events" => JournalError::MissingPrevEvents(message),
                "media_exists" => JournalError::MediaExists(message),
                "unavailable" => JournalError::Unavailable(message),
                _ => JournalError::Storage(message),
            }),
        }
    }
}

/// Sleeps `period`; true if a stop was asked for meanwhile.
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>, period: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(period) => false,
        r = stop.wait_for(|v| *v) => r.is_ok(),
    }
}

impl Journal {
    fn cluster(&self) -> Option<&Cluster> {
        self.inner.cluster.as_ref()
    }

    /// The shared journal's store, if the journal is shared.
    pub(crate) fn shared_store(&self) -> Option<Arc<NatsStore>> {
        self.cluster().map(|c| c.store.clone())
    }

    /// Whether commands go to another process (a shared journal whose writer lease this
    /// process does not hold).
    pub(crate) fn forwards(&self) -> bool {
        self.cluster()
            .is_some_and(|c| !c.writer.load(Ordering::Acquire))
    }

    /// For a shared journal: a channel to the deployment's other processes over NATS
    /// core on `<stream>.ephemeral` (not stored, at most once; what one process sends,
    /// every other one receives, never the sender itself), for state kept in memory
    /// (typing, presence: SPEC §6). Received payloads beyond 1,024 unread are dropped.
    /// `None` for an embedded journal.
    pub fn ephemeral_channel(&self) -> Option<EphemeralChannel> {
        let c = self.cluster()?;
        let client = c.store.client().clone();
        let subject = format!("{}.ephemeral", c.store.options().stream);
        let origin = c.holder.clone();
        let (send, mut outgoing) = tokio::sync::mpsc::channel::<Vec<u8>>(EPHEMERAL_QUEUE);
        let (incoming, recv) = tokio::sync::mpsc::channel::<Vec<u8>>(1024);
        let (sub_client, sub_subject, ours) = (client.clone(), subject.clone(), origin.clone());
        c.store.spawn(async move {
            let mut sub = match sub_client.subscribe(sub_subject).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "journal: no ephemeral channel (typing and presence stay per process)");
                    return;
                }
            };
            while let Some(m) = sub.next().await {
                let from = m.headers.as_ref().and_then(|h| h.get(ORIGIN_HEADER));
                if from.is_some_and(|v| v.as_str() == ours) {
                    continue;
                }
                if let Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) =
                    incoming.try_send(m.payload.to_vec())
                {
                    return;
                }
            }
        });
        c.store.spawn(async move {
            while let Some(bytes) = outgoing.recv().await {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(ORIGIN_HEADER, origin.as_str());
                if let Err(e) = client
                    .publish_with_headers(subject.clone(), headers, bytes.into())
                    .await
                {
                    tracing::debug!(error = %e, "journal: an ephemeral change was not relayed");
                }
            }
        });
        Some(EphemeralChannel { send, recv })
    }

    /// For a shared journal ([`crate::nats`]): whether this process holds the writer
    /// lease now. `None` for an embedded journal (always its own writer).
    pub fn is_writer(&self) -> Option<bool> {
        self.cluster().map(|c| c.writer.load(Ordering::Acquire))
    }

    /// Waits up to `timeout` for this process's copy of a shared journal to reach
    /// `position` (a token another process handed out); true once it has. An embedded
    /// journal never lags its own tokens: true only if `position` is durable already.
    pub async fn wait_for_head(&self, position: u64, timeout: Duration) -> bool {
        if self.durable_head() >= position {
            return true;
        }
        if self.cluster().is_none() {
            return false;
        }
        let mut rx = self.subscribe();
        matches!(
            tokio::time::timeout(timeout, rx.wait_for(|h| *h >= position)).await,
            Ok(Ok(_))
        )
    }

    /// For a shared journal: the stream's head now (the position of the last record any
    /// process appended), so a reader can wait for its own copy to reach it before it
    /// answers "unknown" about something another process may just have written (a room
    /// created through another process). `None` for an embedded journal (every write is
    /// its own) or when NATS does not answer within `timeout`.
    pub async fn shared_head(&self, timeout: Duration) -> Option<u64> {
        let store = self.cluster()?.store.clone();
        match tokio::time::timeout(timeout, store.stream_head_async()).await {
            Ok(Ok(head)) => Some(head),
            _ => None,
        }
    }

    /// Gives the writer lease up if this process holds it (a clean stop), so a standby
    /// takes over at once instead of after the lease's time to live; then stops
    /// following. Waits at most 2 s. Nothing for an embedded journal.
    pub async fn step_down(&self) {
        let Some(c) = self.cluster() else { return };
        let _ = c.stop.send(true);
        let mut rx = c.stop.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(2), rx.wait_for(|v| !*v)).await;
        // The tasks holding this journal end, so a stopped server lets go of its store.
        if let Some(h) = c.consumer.lock().take() {
            h.abort();
        }
        if let Some(h) = c.commands.lock().take() {
            h.abort();
        }
    }

    /// Sends commands to the writer and waits for this process's copy of the journal
    /// to hold their records (read-your-writes on this process).
    pub(crate) async fn forward(
        &self,
        cmds: &[SignedCommand],
    ) -> Result<Vec<Result<Outcome, JournalError>>, JournalError> {
        let c = self.cluster().expect("forward needs a shared journal");
        let payload = serde_json::to_vec(&WireRequest {
            commands: cmds.to_vec(),
        })
        .map_err(|e| JournalError::BadJson(e.to_string()))?;
        let client = c.store.client();
        let max = client.server_info().max_payload;
        if payload.len() > max {
            return Err(JournalError::TooLarge(format!(
                "this command is {} bytes, more than NATS's max_payload ({max}) lets one \
                 process forward to the journal writer; raise max_payload in nats-server's \
                 configuration",
                payload.len()
            )));
        }
        let options = c.store.options();
        let subject = options.commands_subject();
        let deadline = Instant::now() + Duration::from_millis(options.request_timeout_ms);
        let reply = loop {
            match client
                .request(subject.clone(), payload.clone().into())
                .await
            {
                Ok(msg) => break msg,
                // No writer yet (an election is under way): try again until the deadline.
                Err(e)
                    if e.kind() == async_nats::client::RequestErrorKind::NoResponders
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    return Err(JournalError::Unavailable(format!(
                        "the journal writer did not answer: {e}; try again"
                    )));
                }
            }
        };
        let reply: WireReply = serde_json::from_slice(&reply.payload).map_err(|e| {
            JournalError::Storage(format!("the journal writer's answer is unreadable: {e}"))
        })?;
        // Handed over meanwhile: nothing ran; the next writer gets it.
        if Instant::now() < deadline
            && reply.results.iter().any(
                |r| matches!(r, WireResult::Err { kind, message } if kind == "unavailable" && message == NOT_THE_WRITER),
            )
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
            return Box::pin(self.forward(cmds)).await;
        }
        if reply.results.len() != cmds.len() {
            return Err(JournalError::Storage(format!(
                "the journal writer answered {} results for {} commands",
                reply.results.len(),
                cmds.len()
            )));
        }
        let results: Vec<Result<Outcome, JournalError>> = reply
            .results
            .into_iter()
            .map(WireResult::into_result)
            .collect();
        if let Some(last) = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|o| o.position)
            .max()
        {
            self.wait_durable(last).await?;
        }
        Ok(results)
    }

    /// Starts following the stream (a thread applying what the consumer delivers) and
    /// the lease task.
    pub(crate) fn start_following(&self) -> Result<(), String> {
        let c = self.cluster().expect("a shared journal");
        let key = &self.inner.key;
        c.store
            .check_signing_key(&key.key_id(), &key.public_key_base64())?;
        tracing::info!(
            position = c.follow.lock().chain.position,
            "journal: following the shared stream (commands go to the writer until this process holds the lease)"
        );
        let (tx, rx) = tokio::sync::mpsc::channel::<Followed>(FOLLOW_BATCH * 4);
        let from = c.follow.lock().chain.position;
        *c.consumer.lock() = Some(c.store.follow(from, tx)?);
        let journal = self.clone();
        std::thread::Builder::new()
            .name("journal-follower".into())
            .spawn(move || journal.follower(rx))
            .map_err(|e| e.to_string())?;
        let journal = self.clone();
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| "a shared journal is opened inside a tokio runtime".to_string())?;
        runtime.spawn(async move { journal.lease_task().await });
        Ok(())
    }

    /// The follower thread: applies each delivered record to the mirror and the write
    /// models, then publishes the new head. A record that does not chain onto the last
    /// one stops the process (its models could no longer be trusted).
    fn follower(&self, mut rx: tokio::sync::mpsc::Receiver<Followed>) {
        let c = self.cluster().expect("a shared journal");
        while let Some(first) = rx.blocking_recv() {
            let mut batch = vec![first];
            while batch.len() < FOLLOW_BATCH {
                match rx.try_recv() {
                    Ok(f) => batch.push(f),
                    Err(_) => break,
                }
            }
            let mut state = c.follow.lock();
            if state.stopped {
                return;
            }
            if let Err(e) = self.apply_batch(&mut state.chain, batch) {
                tracing::error!(error = %e, "journal: a record from the stream does not follow; stopping");
                std::process::abort();
            }
        }
    }

    fn apply_batch(&self, chain: &mut ChainHead, batch: Vec<Followed>) -> Result<(), String> {
        let c = self.cluster().expect("a shared journal");
        let mut encoded = Vec::with_capacity(batch.len());
        let mut records = Vec::with_capacity(batch.len());
        let mut head = *chain;
        for f in batch {
            // A consumer restarted from an earlier point delivers some records again.
            if f.sequence <= head.position {
                continue;
            }
            let e = c.store.encoded(f, head.position + 1)?;
            let rec = StoredRecord::from_bytes(&e.bytes).map_err(|e| e.to_string())?;
            if rec.prev_hash() != head.hash {
                return Err(format!(
                    "record {}'s prev_hash is not record {}'s hash",
                    rec.position(),
                    head.position
                ));
            }
            head = ChainHead {
                position: rec.position(),
                hash: crate::record_hash(&e.bytes),
            };
            encoded.push(e);
            records.push(rec);
        }
        if encoded.is_empty() {
            return Ok(());
        }
        c.store.mirror(&encoded)?;
        for rec in &records {
            self.apply_followed(rec)?;
        }
        *chain = head;
        self.inner.enqueue.lock().0 = head.position;
        let last =
            crate::head::last_of_each_class(records.iter().map(|r| (r.position(), r.class())));
        let n = records.len();
        self.inner
            .recent
            .push_records(records.into_iter().map(std::sync::Arc::new).collect(), n);
        self.inner.durable_tx.publish(head.position, last);
        Ok(())
    }

    /// Applies one record another process appended to the live write models: what
    /// [`crate::replay_into`] does to the models it restores, record kind by record
    /// kind (the test `a_follower_holds_the_writers_write_models` compares digests).
    fn apply_followed(&self, rec: &StoredRecord) -> Result<(), String> {
        let inner = &self.inner;
        let stats = &inner.stats;
        let cap = inner.fork_window;
        let room_of = |pdu_room: &OwnedRoomId, version: Option<&str>| {
            let mut rooms = inner.rooms.lock();
            match version {
                Some(v) => Some(
                    rooms
                        .entry(pdu_room.clone())
                        .or_insert_with(|| {
                            Arc::new(tokio::sync::Mutex::new(RoomAggregate::new(v, cap)))
                        })
                        .clone(),
                ),
                None => rooms.get(pdu_room).cloned(),
            }
        };
        if rec.is_outlier() {
            let pdu = rec.room_pdu().ok_or("unreadable outlier PDU")?;
            if let Some(agg) = room_of(&pdu.room_id, Some(pdu.room_version.as_str())) {
                agg.blocking_lock().apply_outlier(pdu);
            }
        } else if rec.is_backfilled() {
            let pdu = rec.any_pdu().ok_or("unreadable backfilled PDU")?;
            if let Some(agg) = room_of(&pdu.room_id, None) {
                agg.blocking_lock().apply_backfilled(pdu);
            }
        } else if rec.is_soft_failed() {
            let pdu = rec.any_pdu().ok_or("unreadable soft-failed PDU")?;
            if let Some(agg) = room_of(&pdu.room_id, None) {
                let mut agg = agg.blocking_lock();
                let before = agg.state_before(&pdu.prev_events, stats);
                agg.apply_soft_failed(pdu, &before);
            }
        } else if rec.is_state_resolved() {
            let pdu = rec.room_pdu().ok_or("unreadable resolved state PDU")?;
            if let Some(agg) = room_of(&pdu.room_id, None) {
                agg.blocking_lock().set_state(pdu);
            }
        } else if rec.is_event() {
            let pdu = rec.pdu().ok_or("unreadable PDU")?;
            if let Some(agg) = room_of(&pdu.room_id, Some(pdu.room_version.as_str())) {
                agg.blocking_lock().apply(pdu, stats);
            }
        } else {
            match rec.fact() {
                Some(Fact::AccountRegistered { user_id, .. }) => {
                    inner.users.lock().insert(user_id);
                }
                Some(Fact::RoomStatePartial {
                    room_id,
                    join_event_id,
                    servers_in_room,
                }) => {
                    let room = OwnedRoomId::try_from(room_id).map_err(|_| "bad room id")?;
                    let join = OwnedEventId::try_from(join_event_id).map_err(|_| "bad event id")?;
                    if let Some(agg) = room_of(&room, None) {
                        agg.blocking_lock().partial = Some(PartialState {
                            join_event_id: join,
                            servers_in_room,
                        });
                    }
                }
                Some(Fact::RoomStateCompleted { room_id }) => {
                    let room = OwnedRoomId::try_from(room_id).map_err(|_| "bad room id")?;
                    if let Some(agg) = room_of(&room, None) {
                        agg.blocking_lock().partial = None;
                    }
                }
                Some(Fact::AliasSet { alias, room_id, .. }) => {
                    inner.aliases.lock().insert(alias, room_id);
                }
                Some(Fact::AliasDeleted { alias }) => {
                    inner.aliases.lock().remove(&alias);
                }
                Some(Fact::TokenRefreshed {
                    old_refresh_token_hash,
                    ..
                }) => {
                    inner
                        .spent_refresh_tokens
                        .lock()
                        .insert(old_refresh_token_hash);
                }
                Some(Fact::AccountDeactivated { user_id, .. }) => {
                    inner.deactivated.lock().insert(user_id);
                }
                Some(Fact::MediaCreated { media_id, uploader }) => {
                    inner.media.lock().insert(media_id, (uploader, false));
                }
                Some(Fact::MediaUploaded {
                    media_id, uploader, ..
                }) => {
                    inner.media.lock().insert(media_id, (uploader, true));
                }
                Some(fact) => apply_key_fact(&mut inner.keys.lock(), &fact, rec.position()),
                None => {}
            }
        }
        Ok(())
    }

    /// Competes for the writer lease; holds and refreshes it once won; gives it up on
    /// [`Journal::step_down`].
    async fn lease_task(self) {
        let c = self.cluster().expect("a shared journal");
        let options = c.store.options().clone();
        let period = Duration::from_millis(options.lease_ttl_ms / 3);
        let mut stop = c.stop.subscribe();
        if !options.writer {
            tracing::info!("journal: this process never writes (journal.nats.writer = false)");
            let _ = stop.wait_for(|v| *v).await;
            let _ = c.stop.send(false);
            return;
        }
        let lease = loop {
            match Lease::open(c.store.jetstream(), &options, c.holder.clone()).await {
                Ok(l) => break l,
                Err(e) => {
                    tracing::warn!(error = %e, "journal: opening the writer lease failed; retrying");
                    if stopped(&mut stop, period).await {
                        let _ = c.stop.send(false);
                        return;
                    }
                }
            }
        };
        loop {
            match lease.acquire().await {
                Ok(LeaseState::Held(revision)) => match self.take_over().await {
                    Ok(()) => {
                        self.hold(&lease, revision, period, &mut stop).await;
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "journal: taking the writer role over failed; giving the lease back");
                        let _ = lease.release(revision).await;
                    }
                },
                Ok(LeaseState::Taken(holder)) => {
                    tracing::debug!(%holder, "journal: the writer lease is held");
                }
                Err(e) => tracing::warn!(error = %e, "journal: the writer lease could not be read"),
            }
            if stopped(&mut stop, period).await {
                let _ = c.stop.send(false);
                return;
            }
        }
    }

    /// Refreshes the held lease until a clean stop. A lease that may have expired (no
    /// refresh for two thirds of its time to live) or that someone else now holds
    /// stops the process: another writer may be appending, and this one's models are
    /// its own.
    async fn hold(
        &self,
        lease: &Lease,
        mut revision: u64,
        period: Duration,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) {
        let c = self.cluster().expect("a shared journal");
        let ttl = Duration::from_millis(c.store.options().lease_ttl_ms);
        let mut refreshed = Instant::now();
        loop {
            let stopping = tokio::select! {
                _ = tokio::time::sleep(period) => false,
                r = stop.wait_for(|v| *v) => r.is_ok(),
            };
            if stopping {
                // Stop appending before the lease goes: a later command is refused.
                c.writer.store(false, Ordering::Release);
                if let Err(e) = lease.release(revision).await {
                    tracing::warn!(error = %e, "journal: releasing the writer lease failed");
                } else {
                    tracing::info!("journal: writer lease released");
                }
                let _ = c.stop.send(false);
                return;
            }
            match lease.renew(revision).await {
                Ok(r) => {
                    revision = r;
                    refreshed = Instant::now();
                }
                Err(e)
                    if refreshed.elapsed() < ttl * 2 / 3 && !e.contains("wrong last sequence") =>
                {
                    tracing::warn!(error = %e, "journal: refreshing the writer lease failed; retrying");
                }
                Err(e) => {
                    tracing::error!(error = %e, "journal: the writer lease is lost; stopping (restart to follow the new writer)");
                    std::process::abort();
                }
            }
        }
    }

    /// Becomes the writer: waits until this process has applied every record in the
    /// stream, stops following, moves the appender's chain to that head and starts
    /// answering forwarded commands.
    async fn take_over(&self) -> Result<(), String> {
        let c = self.cluster().expect("a shared journal");
        let js = c.store.jetstream().clone();
        let name = c.store.options().stream.clone();
        let head = async {
            let s = js.get_stream(&name).await.map_err(|e| e.to_string())?;
            let info = s.get_info().await.map_err(|e| e.to_string())?;
            Ok::<u64, String>(info.state.last_sequence)
        }
        .await?;
        let mut durable = self.subscribe();
        tokio::time::timeout(TAKEOVER_CATCH_UP, durable.wait_for(|h| *h >= head))
            .await
            .map_err(|_| format!("did not reach the stream's head {head} in time"))?
            .map_err(|e| e.to_string())?;
        let chain = {
            let mut state = c.follow.lock();
            state.stopped = true;
            state.chain
        };
        if let Some(h) = c.consumer.lock().take() {
            h.abort();
        }
        {
            let mut enqueue = self.inner.enqueue.lock();
            enqueue.0 = chain.position;
            send_to_appender(&enqueue.1, ToAppender::Rebase(chain));
        }
        c.writer.store(true, Ordering::Release);
        tracing::info!(
            position = chain.position,
            holder = %c.holder,
            "journal: this process is now the writer"
        );
        let journal = self.clone();
        let client = c.store.client().clone();
        let subject = c.store.options().commands_subject();
        let mut commands = client.subscribe(subject).await.map_err(|e| e.to_string())?;
        let task = tokio::spawn(async move {
            while let Some(msg) = commands.next().await {
                let journal = journal.clone();
                let client = client.clone();
                tokio::spawn(async move {
                    let reply = journal.answer_forwarded(&msg.payload).await;
                    if let Some(to) = msg.reply {
                        let _ = client.publish(to, reply.into()).await;
                    }
                });
            }
        });
        *c.commands.lock() = Some(task.abort_handle());
        Ok(())
    }

    /// Runs a forwarded command run here and encodes the answer.
    async fn answer_forwarded(&self, payload: &[u8]) -> Vec<u8> {
        let results = match serde_json::from_slice::<WireRequest>(payload) {
            Ok(req) if !self.forwards() => {
                if req.commands.len() == 1 {
                    let cmd = req.commands.into_iter().next().expect("one command");
                    vec![self.submit_here(cmd).await]
                } else {
                    self.submit_batch_here(req.commands).await
                }
            }
            Ok(req) => req
                .commands
                .iter()
                .map(|_| {
                    Err(JournalError::Storage(
                        "this process is no longer the writer".into(),
                    ))
                })
                .collect(),
            Err(e) => vec![Err(JournalError::BadJson(format!(
                "unreadable forwarded command: {e}"
            )))],
        };
        serde_json::to_vec(&WireReply {
            results: results.into_iter().map(WireResult::from_result).collect(),
        })
        .unwrap_or_default()
    }
}
