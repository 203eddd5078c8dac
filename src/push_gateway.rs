//! Push delivery: a journal consumer that sends notifications to push gateways
//! (spec: push gateway API, `POST /_matrix/push/v1/notify`; client-server API "Push
//! Notifications", "HTTP pushers").
//!
//! It lives in the server crate because it reads the journal (the `api` crate may not)
//! and is not federation. Shape, as the federation sender's (`journal::consumer`):
//!
//! - **The push queue is a projection.** The `push` projection evaluates every
//!   recipient's push rules as it applies an event and writes one `queue` row per
//!   notification (position, user). Deciding *whether* to notify is deterministic and
//!   replayable; only the delivery acts on the world.
//! - **One worker per gateway URL**, each with its durable cursor (a journal position,
//!   in `<data>/consumers/push-gateway.json`). A worker reads the journal after its
//!   cursor, waits until the projections have applied what it read, and collects the
//!   notifications for its gateway: for each event, the queued users' HTTP pushers with
//!   that URL as they are *now* (a pusher deleted before delivery gets nothing); for
//!   each `m.read` receipt, a badge-only update (`counts.unread`, no event) to the
//!   reader's pushers, as Synapse sends. A batch holds every notification of each event
//!   it covers, however large the room (the seeds dropped the first phones of a
//!   1,000-member ring to a queue capped at 1,000): `batch_notifications_max` only
//!   stops a batch *between* events, and the journal is the queue, so nothing is ever
//!   dropped for room.
//! - **Concurrent sends, at least once, in order.** A batch is sent with at most
//!   `concurrent_requests_per_gateway` requests in flight. Failures (connection
//!   refused, timeouts, 5xx, 408, 429) are retried, in their original order, with
//!   exponential backoff from `retry_initial_ms` to `retry_max_ms`; a notification
//!   older than `max_notification_age_ms` (from its record's append time) is dropped
//!   with a log line instead. Other 4xx answers drop that one notification. The cursor
//!   moves past a batch only once every notification in it is delivered or dropped, so
//!   a restart of either side repeats at most one batch (the gateway deduplicates by
//!   `event_id`, spec).
//! - **Rejected pushkeys** (`rejected` in the gateway's answer) are removed by a
//!   `PusherDeleted` fact submitted as the pusher's owner (a journal command, like any
//!   change).
//!
//! - **The queue is pruned** ([`PushSender::prune_queue`], every [`PRUNE_INTERVAL`]):
//!   a queue row at position P is done once every reader of the queue (the dispatcher
//!   and each gateway's worker) is past P, that is, once it was delivered, refused
//!   (4xx) or dropped past `max_notification_age_ms`; the sender then journals
//!   `PushQueuePruned { upto }` with `upto` the lowest of their positions, and the
//!   `push` projection deletes the rows at or before it. A reader restarted from an
//!   older saved cursor finds those positions empty, which repeats nothing it had not
//!   already finished. A gateway that stays down holds the queue back at most
//!   `max_notification_age_ms`. With `[push] enabled = false` nothing reads or
//!   prunes the queue (rows of pushered users stay until delivery is turned on and
//!   catches up).
//!
//! Outbound addresses pass the same denylist as federation (`push.ip_range_denylist`,
//! `push.ip_range_allowlist`, Synapse's `ip_range_blacklist`/`ip_range_whitelist`):
//! a pusher URL cannot make the server call into its own network unless allowed.

use std::{
    collections::HashMap,
    net::IpAddr,
    path::Path,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use serde_json::{Value, json};
use spindle_federation::client::{IpPolicy, filtering_resolver};
use spindle_journal::{
    CommandBody, CommandEnvelope, Fact, Journal, SignedCommand, StoredRecord, consumer::Cursors,
};
use spindle_projections::Projections;

use crate::config::Push as PushConfig;

/// Records read from the journal per step.
const READ_BATCH: usize = 256;

/// How often the push queue is pruned ([`PushSender::prune_queue`]); a prune that
/// finds nothing done journals nothing.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(60);

/// Most notifications read for one event (a room's joined members are far fewer).
const QUEUE_READ_MAX: usize = 1_000_000;

/// Counters (tests and metrics).
#[derive(Debug, Default)]
pub struct PushStats {
    /// Notifications the gateway accepted (200).
    pub delivered: std::sync::atomic::AtomicU64,
    /// Failed attempts (each retry counts).
    pub failures: std::sync::atomic::AtomicU64,
    /// Notifications dropped (too old, or refused with a 4xx).
    pub dropped: std::sync::atomic::AtomicU64,
    /// Pushers removed because the gateway rejected their pushkey.
    pub rejected: std::sync::atomic::AtomicU64,
}

/// One notification request to one gateway: one pusher (`devices` has one entry, as
/// Synapse sends).
#[derive(Debug, Clone)]
struct Delivery {
    user_id: String,
    app_id: String,
    pushkey: String,
    /// Append time of the record that caused it, ms.
    created_ms: u64,
    body: Value,
}

/// The running push sender.
#[derive(Clone)]
pub struct PushSender {
    journal: Journal,
    projections: Projections,
    config: Arc<PushConfig>,
    http: reqwest::Client,
    policy: Arc<IpPolicy>,
    cursors: Arc<parking_lot::Mutex<Cursors>>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    workers: Arc<parking_lot::Mutex<HashMap<String, tokio::sync::watch::Sender<()>>>>,
    /// Each reader's position in memory (`""`: the dispatcher; else a gateway URL):
    /// everything at or before it is done. The prune bound is their minimum.
    progress: Arc<parking_lot::Mutex<HashMap<String, u64>>>,
    /// Counters.
    pub stats: Arc<PushStats>,
}

impl PushSender {
    /// Starts a worker per gateway with a stored cursor, and the dispatcher that finds
    /// new gateways. Errors on an unreadable cursor file or a bad IP range.
    pub fn start(
        journal: Journal,
        projections: Projections,
        config: PushConfig,
        consumers_dir: &Path,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<PushSender, String> {
        let policy = Arc::new(IpPolicy::new(
            &config.ip_range_denylist,
            &config.ip_range_allowlist,
        )?);
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .no_proxy()
            .dns_resolver(filtering_resolver(policy.clone()))
            .timeout(Duration::from_millis(config.request_timeout_ms))
            .connect_timeout(Duration::from_millis(config.request_timeout_ms.min(10_000)))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("Spindle/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| e.to_string())?;
        let cursors = journal.cursors(consumers_dir, "push-gateway")?;
        let start = cursors.get("").unwrap_or_else(|| journal.durable_head());
        let stored: Vec<(String, u64)> = cursors
            .all()
            .iter()
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let sender = PushSender {
            journal,
            projections,
            config: Arc::new(config),
            http,
            policy,
            cursors: Arc::new(parking_lot::Mutex::new(cursors)),
            shutdown,
            workers: Arc::default(),
            progress: Arc::default(),
            stats: Arc::default(),
        };
        sender.progress.lock().insert(String::new(), start);
        for (url, cursor) in stored {
            sender.spawn_worker(url, cursor);
        }
        let s = sender.clone();
        sender.spawn(async move { s.dispatch(start).await });
        let s = sender.clone();
        sender.spawn(async move {
            loop {
                tokio::time::sleep(PRUNE_INTERVAL).await;
                if let Err(e) = s.prune_queue().await {
                    tracing::warn!(error = %e, "push: queue not pruned");
                }
            }
        });
        Ok(sender)
    }

    /// Prunes the push queue: journals `PushQueuePruned { upto }` with `upto` the lowest
    /// position of the queue's readers (the dispatcher and every gateway worker: all of
    /// them are done with every row at or before it), when the oldest queue row is at
    /// or before it, and waits until the projection applied it. Returns `upto`, or
    /// `None` when no row was done (nothing journaled). Reads one queue row.
    pub async fn prune_queue(&self) -> Result<Option<u64>, String> {
        let Some(upto) = self.progress.lock().values().copied().min() else {
            return Ok(None);
        };
        match self.projections.push.queue_first() {
            Some(first) if first <= upto => {}
            _ => return Ok(None),
        }
        let envelope = CommandEnvelope {
            principal: String::new(),
            device_id: None,
            issued_at: spindle_api::now_ms(),
            body: CommandBody::Fact {
                fact: Fact::PushQueuePruned { upto },
            },
        };
        let cmd = SignedCommand::sign(self.journal.key(), envelope).map_err(|e| e.to_string())?;
        let o = self.journal.submit(cmd).await.map_err(|e| e.to_string())?;
        if !self
            .projections
            .runtime
            .wait_for(o.position, Duration::from_secs(30))
            .await
        {
            return Err("projections did not apply the prune".into());
        }
        tracing::debug!(upto, "push: queue pruned");
        Ok(Some(upto))
    }

    /// Reads the journal after `after` once the projections have applied what it read
    /// ([`crate::reactor::read_applied`]).
    async fn read(&self, after: u64) -> Option<Vec<std::sync::Arc<StoredRecord>>> {
        crate::reactor::read_applied(&self.journal, &self.projections, after, READ_BATCH, "push")
            .await
    }

    /// The users a record asks to notify: the event's queued notifications, or the
    /// reader of an `m.read` receipt (a badge update).
    fn users_of(
        &self,
        rec: &StoredRecord,
    ) -> Vec<(String, Option<spindle_projections::push::Notification>)> {
        if rec.is_event() {
            return self
                .projections
                .push
                .queued_at(rec.position(), QUEUE_READ_MAX)
                .into_iter()
                .map(|(u, n)| (u, Some(n)))
                .collect();
        }
        match rec.fact() {
            Some(Fact::ReceiptSet {
                user_id,
                receipt_type,
                ..
            }) if receipt_type == "m.read" || receipt_type == "m.read.private" => {
                vec![(user_id, None)]
            }
            _ => Vec::new(),
        }
    }

    async fn dispatch(self, mut after: u64) {
        while let Some(batch) = self.read(after).await {
            for rec in &batch {
                for (user, _) in self.users_of(rec) {
                    for p in self.projections.pushers.http_of_user(&user) {
                        let known = self.workers.lock().contains_key(&p.url);
                        if !known {
                            self.spawn_worker(p.url, rec.position() - 1);
                        }
                    }
                }
                after = rec.position();
            }
            self.progress.lock().insert(String::new(), after);
            if let Err(e) = self.cursors.lock().advance("", after) {
                tracing::warn!(error = %e, "push: cursor not saved");
            }
        }
    }

    fn spawn_worker(&self, url: String, cursor: u64) {
        let (tx, rx) = tokio::sync::watch::channel(());
        self.workers.lock().insert(url.clone(), tx);
        self.progress.lock().insert(url.clone(), cursor);
        if let Err(e) = self.cursors.lock().set(&url, cursor) {
            tracing::warn!(error = %e, "push: cursor not saved");
        }
        let s = self.clone();
        self.spawn(async move { s.run_worker(url, cursor, rx).await });
    }

    /// Runs `task` until the server stops (a stopped server's consumers must not keep
    /// delivering beside a restarted one).
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = task => {}
                _ = shutdown.wait_for(|s| *s) => {}
            }
        });
    }

    /// Wakes every worker now (their backoff is cut short).
    pub fn wake_all(&self) {
        for tx in self.workers.lock().values() {
            let _ = tx.send(());
        }
    }

    /// Unread count for the badge: rooms with unread notifications when
    /// `group_unread_count_by_room` (Synapse's default), else unread notifications.
    fn badge(&self, user_id: &str) -> u64 {
        let p = &self.projections;
        let upto = p.runtime.applied();
        let mut total = 0;
        for (room, m) in p.membership.rooms_of(user_id) {
            if m.membership != "join" {
                continue;
            }
            let from = p
                .receipts
                .read_position(&room, user_id, None)
                .unwrap_or(m.position);
            let n = p.unread(&room, user_id, "", from, upto).notification_count;
            total += if self.config.group_unread_count_by_room {
                u64::from(n > 0)
            } else {
                n
            };
        }
        total
    }

    fn state_content(&self, room_id: &str, kind: &str, state_key: &str) -> Option<Value> {
        let p = &self.projections;
        let root = p.state.current_root(room_id)?;
        let id = p.state.lookup(root, kind, state_key)?;
        Some(p.timeline.event(&id)?.pdu.content_value())
    }

    /// The notification bodies of one record for the pushers at `url`.
    fn deliveries(&self, rec: &StoredRecord, url: &str) -> Vec<Delivery> {
        let mut out = Vec::new();
        let users = self.users_of(rec);
        if users.is_empty() {
            return out;
        }
        let pdu = rec.pdu();
        let mut room_name: Option<Option<String>> = None;
        let mut sender_name: Option<Option<String>> = None;
        for (user, notification) in users {
            let pushers: Vec<_> = self
                .projections
                .pushers
                .http_of_user(&user)
                .into_iter()
                .filter(|p| p.url == url)
                .collect();
            if pushers.is_empty() {
                continue;
            }
            let badge = self.badge(&user);
            for p in pushers {
                let device = |tweaks: Value| {
                    json!({
                        "app_id": p.app_id,
                        "pushkey": p.pushkey,
                        "pushkey_ts": p.ts / 1000,
                        "data": p.data,
                        "tweaks": tweaks,
                    })
                };
                let body = match (&notification, &pdu) {
                    (Some(n), Some(pdu)) => {
                        let tweaks = tweaks_of(&n.actions);
                        let kind = pdu.kind.to_string();
                        let high = n.highlight
                            || tweaks.get("sound").is_some()
                            || kind == "m.room.encrypted";
                        let prio = if high { "high" } else { "low" };
                        let mut notif = json!({
                            "event_id": n.event_id,
                            "room_id": n.room_id,
                            "counts": { "unread": badge },
                            "prio": prio,
                            "devices": [device(Value::Object(tweaks.clone()))],
                        });
                        if !p.event_id_only {
                            let sender = pdu.sender.to_string();
                            notif["type"] = json!(kind);
                            notif["sender"] = json!(sender);
                            let name = sender_name
                                .get_or_insert_with(|| {
                                    self.state_content(&n.room_id, "m.room.member", &sender)
                                        .and_then(|c| c["displayname"].as_str().map(str::to_owned))
                                })
                                .clone();
                            if let Some(name) = name {
                                notif["sender_display_name"] = json!(name);
                            }
                            let rname = room_name
                                .get_or_insert_with(|| {
                                    self.state_content(&n.room_id, "m.room.name", "")
                                        .and_then(|c| c["name"].as_str().map(str::to_owned))
                                        .filter(|s| !s.is_empty())
                                        .or_else(|| {
                                            self.state_content(
                                                &n.room_id,
                                                "m.room.canonical_alias",
                                                "",
                                            )
                                            .and_then(|c| c["alias"].as_str().map(str::to_owned))
                                        })
                                })
                                .clone();
                            if let Some(rname) = rname {
                                notif["room_name"] = json!(rname);
                            }
                            let content = pdu.content_value();
                            if content.as_object().is_some_and(|c| !c.is_empty()) {
                                notif["content"] = content;
                            }
                            if kind == "m.room.member" {
                                notif["user_is_target"] =
                                    json!(pdu.state_key.as_deref() == Some(user.as_str()));
                            }
                        }
                        notif
                    }
                    // A receipt: the badge only (Synapse's `_send_badge`).
                    _ => json!({
                        "id": "",
                        "type": null,
                        "sender": "",
                        "counts": { "unread": badge },
                        "devices": [{
                            "app_id": p.app_id,
                            "pushkey": p.pushkey,
                            "pushkey_ts": p.ts / 1000,
                            "data": p.data,
                        }],
                    }),
                };
                out.push(Delivery {
                    user_id: user.clone(),
                    app_id: p.app_id.clone(),
                    pushkey: p.pushkey.clone(),
                    created_ms: rec.appended_at(),
                    body: json!({ "notification": body }),
                });
            }
        }
        out
    }

    async fn run_worker(
        self,
        url: String,
        mut cursor: u64,
        mut wake: tokio::sync::watch::Receiver<()>,
    ) {
        let cfg = self.config.clone();
        loop {
            let mut pending = Vec::new();
            let mut covered = cursor;
            'collect: loop {
                let Some(batch) = self.read(covered).await else {
                    return;
                };
                for rec in &batch {
                    if pending.len() >= cfg.batch_notifications_max {
                        break 'collect;
                    }
                    pending.extend(self.deliveries(rec, &url));
                    covered = rec.position();
                }
                if !pending.is_empty() {
                    break;
                }
                cursor = covered;
                self.progress.lock().insert(url.clone(), cursor);
                if let Err(e) = self.cursors.lock().advance(&url, cursor) {
                    tracing::warn!(error = %e, "push: cursor not saved");
                }
            }
            let mut backoff_ms = cfg.retry_initial_ms;
            while !pending.is_empty() {
                let now = spindle_api::now_ms();
                pending.retain(|d| {
                    let fresh = now.saturating_sub(d.created_ms) <= cfg.max_notification_age_ms;
                    if !fresh {
                        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(gateway = %url, user = %d.user_id, pushkey = %d.pushkey, "push: notification too old, dropped");
                    }
                    fresh
                });
                let retry = self.send_all(&url, std::mem::take(&mut pending)).await;
                if retry.is_empty() {
                    break;
                }
                pending = retry;
                tracing::info!(gateway = %url, pending = pending.len(), retry_in_ms = backoff_ms, "push: gateway unavailable");
                let _ =
                    tokio::time::timeout(Duration::from_millis(backoff_ms), wake.changed()).await;
                backoff_ms = backoff_ms.saturating_mul(2).min(cfg.retry_max_ms.max(1));
            }
            cursor = covered;
            self.progress.lock().insert(url.clone(), cursor);
            if let Err(e) = self.cursors.lock().set(&url, cursor) {
                tracing::warn!(error = %e, "push: cursor not saved");
            }
        }
    }

    /// Sends every delivery, at most `concurrent_requests_per_gateway` at a time;
    /// returns those to retry, in their original order.
    async fn send_all(&self, url: &str, deliveries: Vec<Delivery>) -> Vec<Delivery> {
        let limit = Arc::new(tokio::sync::Semaphore::new(
            self.config.concurrent_requests_per_gateway.max(1),
        ));
        let mut tasks = tokio::task::JoinSet::new();
        for (i, d) in deliveries.into_iter().enumerate() {
            let permit = limit.clone().acquire_owned().await.expect("semaphore open");
            let s = self.clone();
            let url = url.to_owned();
            tasks.spawn(async move {
                let outcome = s.send_one(&url, &d).await;
                drop(permit);
                (i, d, outcome)
            });
        }
        let mut retry = Vec::new();
        while let Some(done) = tasks.join_next().await {
            let Ok((i, d, outcome)) = done else { continue };
            match outcome {
                Outcome::Delivered(rejected) => {
                    self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    if rejected.contains(&d.pushkey) {
                        self.remove_pusher(&d).await;
                    }
                }
                Outcome::Retry(e) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(gateway = %url, error = %e, "push: attempt failed");
                    retry.push((i, d));
                }
                Outcome::Refused(status) => {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(gateway = %url, status, pushkey = %d.pushkey, "push: gateway refused the notification, dropped");
                }
            }
        }
        retry.sort_by_key(|(i, _)| *i);
        retry.into_iter().map(|(_, d)| d).collect()
    }

    async fn send_one(&self, url: &str, d: &Delivery) -> Outcome {
        if let Some(ip) = reqwest::Url::parse(url)
            .ok()
            .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_owned()))
            .and_then(|h| h.parse::<IpAddr>().ok())
            && !self.policy.allows(ip)
        {
            // An address literal never goes through the resolver: check it here.
            return Outcome::Refused(0);
        }
        let resp = match self.http.post(url).json(&d.body).send().await {
            Ok(r) => r,
            Err(e) => return Outcome::Retry(e.to_string()),
        };
        let status = resp.status().as_u16();
        if resp.status().is_success() {
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            let rejected = body["rejected"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|k| k.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            return Outcome::Delivered(rejected);
        }
        if status >= 500 || status == 408 || status == 429 {
            Outcome::Retry(format!("HTTP {status}"))
        } else {
            Outcome::Refused(status)
        }
    }

    /// `rejected` pushkey: the pusher is removed through the journal, as its owner.
    async fn remove_pusher(&self, d: &Delivery) {
        let envelope = CommandEnvelope {
            principal: d.user_id.clone(),
            device_id: None,
            issued_at: spindle_api::now_ms(),
            body: CommandBody::Fact {
                fact: Fact::PusherDeleted {
                    user_id: d.user_id.clone(),
                    app_id: d.app_id.clone(),
                    pushkey: d.pushkey.clone(),
                },
            },
        };
        let result = match SignedCommand::sign(self.journal.key(), envelope) {
            Ok(cmd) => self.journal.submit(cmd).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(_) => {
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                tracing::info!(user = %d.user_id, app_id = %d.app_id, "push: gateway rejected the pushkey; pusher removed");
            }
            Err(e) => tracing::warn!(error = %e, "push: removing a rejected pusher failed"),
        }
    }
}

enum Outcome {
    /// 200, with the `rejected` pushkeys.
    Delivered(Vec<String>),
    /// Worth retrying (the gateway is down or overloaded).
    Retry(String),
    /// Not worth retrying (a 4xx, or an address the policy denies).
    Refused(u16),
}

/// The `set_tweak` actions as a `tweaks` object (`highlight` without a value is true).
fn tweaks_of(actions: &Value) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for a in actions.as_array().into_iter().flatten() {
        if let Some(name) = a["set_tweak"].as_str() {
            let value = a.get("value").cloned().unwrap_or(Value::Bool(true));
            out.insert(name.to_owned(), value);
        }
    }
    out
}
