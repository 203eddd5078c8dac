//! Application service transactions: a journal consumer that pushes the events an
//! application service is interested in to `PUT {url}/_matrix/app/v1/transactions/{txnId}`
//! (spec v1.19: Application Service API, "Pushing events").
//!
//! It lives in the server crate because it reads the journal (the `api` crate may not).
//! Shape, as the federation sender's and the push gateway's (`journal::consumer`):
//!
//! - **One worker per application service with a `url`**, each with its durable cursor
//!   (a journal position, in `<data>/consumers/appservice.json`, named by the
//!   registration's `id`). A new registration starts at the journal head it finds (as
//!   Synapse: an application service gets what happens after it is registered).
//! - A worker reads the journal after its cursor, waits until the projections have
//!   applied what it read, and keeps what the application service is interested in:
//!   room events (sent by, or a member event about, a user of its namespaces or its
//!   sender; or in a room whose id or an alias matches its namespaces, or with a
//!   joined member who matches), and with `receive_ephemeral` (or MSC2409's
//!   `de.sorunome.msc2409.push_ephemeral`) the `m.read` receipts of those rooms and
//!   the to-device messages to its users' devices. A transaction holds at most
//!   `transaction_events_max` events (and as many ephemeral and to-device entries).
//! - **At least once, in order, stable ids.** A transaction's id is the journal
//!   positions it covers (`<first>-<last>`), so a retry carries the same id and the
//!   same body; failures (anything but a 2xx answer) are retried with exponential
//!   backoff from `retry_initial_ms` to `retry_max_ms`, for as long as it takes (an
//!   application service is the server operator's own, as in Synapse). The cursor
//!   moves past a transaction only once it is acknowledged; a restart of either side
//!   repeats at most the transaction in flight (the application service deduplicates
//!   by id).
//!
//! Interest in a room is cached per worker (room id -> bool) and recomputed after any
//! member or alias change of the room: the cost of a room event is one map lookup, a
//! member event pays one scan of the room's members.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::Path,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use serde_json::{Value, json};
use spindle_api::appservice::{APP_SERVICE_PREFIX, AppService, AppServices, urlencode};
use spindle_journal::{Fact, Journal, StoredRecord, consumer::Cursors};
use spindle_projections::Projections;

use crate::config::AppServicesConfig;

/// Records read from the journal per step.
const READ_BATCH: usize = 256;

/// Rooms whose interest a worker remembers before it starts over.
const ROOM_CACHE_MAX: usize = 100_000;

/// Counters (tests and metrics).
#[derive(Debug, Default)]
pub struct AppServiceStats {
    /// Transactions the application services acknowledged.
    pub transactions: std::sync::atomic::AtomicU64,
    /// Room events in acknowledged transactions.
    pub events: std::sync::atomic::AtomicU64,
    /// Ephemeral and to-device entries in acknowledged transactions.
    pub ephemeral: std::sync::atomic::AtomicU64,
    /// Failed attempts (each retry counts).
    pub failures: std::sync::atomic::AtomicU64,
}

/// One transaction's content.
#[derive(Debug, Default)]
struct Txn {
    events: Vec<Value>,
    ephemeral: Vec<Value>,
    to_device: Vec<Value>,
    /// MSC3202 `device_lists.changed` (registrations with `org.matrix.msc3202`).
    changed: BTreeSet<String>,
    /// MSC3202 `device_lists.left`.
    left: BTreeSet<String>,
    /// MSC3202 one-time key counts and unused fallback key types, read when the
    /// transaction is closed ([`key_summary`]).
    keys: Option<(Value, Value)>,
}

impl Txn {
    fn is_empty(&self) -> bool {
        self.events.is_empty()
            && self.ephemeral.is_empty()
            && self.to_device.is_empty()
            && self.changed.is_empty()
            && self.left.is_empty()
    }

    fn full(&self, max: usize) -> bool {
        self.events.len() >= max || self.ephemeral.len() >= max || self.to_device.len() >= max
    }

    /// The body of `PUT /transactions/{txnId}`: `events`, plus the ephemeral and
    /// to-device lists under the keys the registration asked for.
    fn body(&self, a: &AppService) -> Value {
        let mut body = json!({ "events": self.events });
        if a.receive_ephemeral {
            body["ephemeral"] = json!(self.ephemeral);
            body["de.sorunome.msc2409.to_device"] = json!(self.to_device);
        } else if a.receive_ephemeral_unstable {
            body["de.sorunome.msc2409.ephemeral"] = json!(self.ephemeral);
            body["de.sorunome.msc2409.to_device"] = json!(self.to_device);
        }
        if a.msc3202 {
            if !self.changed.is_empty() || !self.left.is_empty() {
                body["org.matrix.msc3202.device_lists"] =
                    json!({ "changed": self.changed, "left": self.left });
            }
            if let Some((otks, fallback)) = &self.keys {
                if otks.as_object().is_some_and(|o| !o.is_empty()) {
                    // Both spellings, as Synapse sends them.
                    body["org.matrix.msc3202.device_one_time_keys_count"] = otks.clone();
                    body["org.matrix.msc3202.device_one_time_key_counts"] = otks.clone();
                }
                if fallback.as_object().is_some_and(|o| !o.is_empty()) {
                    body["org.matrix.msc3202.device_unused_fallback_key_types"] = fallback.clone();
                }
            }
        }
        body
    }
}

/// The running transaction pusher.
#[derive(Clone)]
pub struct AppServiceSender {
    journal: Journal,
    projections: Projections,
    services: Arc<AppServices>,
    config: Arc<AppServicesConfig>,
    cursors: Arc<parking_lot::Mutex<Cursors>>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    wakes: Arc<parking_lot::Mutex<HashMap<String, tokio::sync::watch::Sender<()>>>>,
    typing: spindle_api::typing::Typing,
    presence: spindle_api::presence::Presence,
    /// Counters.
    pub stats: Arc<AppServiceStats>,
}

impl AppServiceSender {
    /// Starts one worker per application service with a `url` (typing and presence are
    /// the in-memory ephemeral sources). Errors on an unreadable cursor file.
    pub fn start(
        journal: Journal,
        projections: Projections,
        services: Arc<AppServices>,
        config: AppServicesConfig,
        consumers_dir: &Path,
        (typing, presence): (spindle_api::typing::Typing, spindle_api::presence::Presence),
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<AppServiceSender, String> {
        let cursors = journal.cursors(consumers_dir, "appservice")?;
        let sender = AppServiceSender {
            journal,
            projections,
            services,
            config: Arc::new(config),
            cursors: Arc::new(parking_lot::Mutex::new(cursors)),
            shutdown,
            wakes: Arc::default(),
            typing,
            presence,
            stats: Arc::default(),
        };
        for a in sender.services.all().iter().filter(|a| a.url.is_some()) {
            let stored = sender.cursors.lock().get(&a.id);
            let cursor = match stored {
                Some(c) => c,
                None => {
                    let head = sender.journal.durable_head();
                    sender.cursors.lock().set(&a.id, head)?;
                    head
                }
            };
            let (tx, rx) = tokio::sync::watch::channel(());
            sender.wakes.lock().insert(a.id.clone(), tx);
            let s = sender.clone();
            let worker = a.clone();
            sender.spawn(async move { s.run_worker(worker, cursor, rx).await });
            if a.wants_ephemeral() {
                let s = sender.clone();
                let a = a.clone();
                sender.spawn(async move { s.run_typing(a).await });
            }
        }
        Ok(sender)
    }

    /// Runs `task` until the server stops.
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
        for tx in self.wakes.lock().values() {
            let _ = tx.send(());
        }
    }

    /// The saved cursor of an application service (tests).
    pub fn cursor(&self, id: &str) -> Option<u64> {
        self.cursors.lock().get(id)
    }

    /// Reads the journal after `after` once the projections have applied what it read
    /// ([`crate::reactor::read_applied`]).
    async fn read(&self, after: u64) -> Option<Vec<std::sync::Arc<StoredRecord>>> {
        crate::reactor::read_applied(
            &self.journal,
            &self.projections,
            after,
            READ_BATCH,
            "appservice",
        )
        .await
    }

    async fn run_worker(
        self,
        a: Arc<AppService>,
        mut cursor: u64,
        mut wake: tokio::sync::watch::Receiver<()>,
    ) {
        let cfg = self.config.clone();
        let max = cfg.transaction_events_max.max(1);
        let mut rooms = RoomInterest::default();
        loop {
            let mut txn = Txn::default();
            let mut covered = cursor;
            'collect: loop {
                let Some(batch) = self.read(covered).await else {
                    return;
                };
                for rec in &batch {
                    if txn.full(max) {
                        break 'collect;
                    }
                    collect(&self.projections, &a, rec, &mut rooms, &mut txn);
                    covered = rec.position();
                }
                if !txn.is_empty() {
                    break;
                }
                cursor = covered;
                if let Err(e) = self.cursors.lock().advance(&a.id, cursor) {
                    tracing::warn!(error = %e, "appservice: cursor not saved");
                }
            }
            let txn_id = format!("{}-{}", cursor + 1, covered);
            if a.msc3202 {
                txn.keys = Some(key_summary(&self.projections, &a, &txn));
            }
            let body = txn.body(&a);
            let path = format!("{APP_SERVICE_PREFIX}/transactions/{}", urlencode(&txn_id));
            let mut backoff_ms = cfg.retry_initial_ms.max(1);
            loop {
                match self
                    .services
                    .request(&a, reqwest::Method::PUT, &path, Some(&body))
                    .await
                {
                    Ok(_) => break,
                    Err(e) => {
                        self.stats.failures.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(appservice = %a.id, txn_id = %txn_id, error = %e, retry_in_ms = backoff_ms, "appservice transaction failed");
                        let _ =
                            tokio::time::timeout(Duration::from_millis(backoff_ms), wake.changed())
                                .await;
                        backoff_ms = backoff_ms.saturating_mul(2).min(cfg.retry_max_ms.max(1));
                    }
                }
            }
            self.stats.transactions.fetch_add(1, Ordering::Relaxed);
            self.stats
                .events
                .fetch_add(txn.events.len() as u64, Ordering::Relaxed);
            self.stats.ephemeral.fetch_add(
                (txn.ephemeral.len() + txn.to_device.len()) as u64,
                Ordering::Relaxed,
            );
            cursor = covered;
            if let Err(e) = self.cursors.lock().set(&a.id, cursor) {
                tracing::warn!(error = %e, "appservice: cursor not saved");
            }
        }
    }
}

impl AppServiceSender {
    /// Typing notifications (in memory, never journaled) of the rooms the application
    /// service is interested in, each change as an `m.typing` entry of `ephemeral`, in
    /// transactions of their own (`t<start ms>-<counter>`: unique per process). Best
    /// effort, like typing itself: one attempt, dropped when the application service
    /// does not take it.
    async fn run_typing(self, a: Arc<AppService>) {
        let mut changes = self.typing.subscribe();
        let mut seen = self.typing.current();
        let started = spindle_api::now_ms();
        loop {
            if changes.changed().await.is_err() {
                return;
            }
            let mut txn = Txn::default();
            let before = seen;
            for (room_id, serial) in self.typing.rooms_changed_after(before) {
                seen = seen.max(serial);
                if room_interests(&self.projections, &a, &room_id) {
                    txn.ephemeral.push(json!({
                        "type": "m.typing",
                        "room_id": room_id,
                        "content": { "user_ids": self.typing.users(&room_id) },
                    }));
                }
            }
            // Presence shares the counter: users joined to a room of interest whose
            // presence changed (Synapse's `is_interested_in_presence`: they share a
            // room with the application service's users).
            let now = spindle_api::now_ms();
            let (changed, presence_upto) = self.presence.changed_after(before);
            seen = seen.max(presence_upto);
            for (user, _) in changed {
                let shares = self
                    .projections
                    .membership
                    .rooms_of(&user)
                    .iter()
                    .any(|(r, m)| {
                        m.membership == "join" && room_interests(&self.projections, &a, r)
                    });
                if shares && let Some(content) = self.presence.content(&user, now) {
                    txn.ephemeral.push(json!({
                        "type": "m.presence",
                        "sender": user,
                        "content": content,
                    }));
                }
            }
            if txn.is_empty() {
                continue;
            }
            let path = format!(
                "{APP_SERVICE_PREFIX}/transactions/{}",
                urlencode(&format!("t{started}-{seen}"))
            );
            match self
                .services
                .request(&a, reqwest::Method::PUT, &path, Some(&txn.body(&a)))
                .await
            {
                Ok(_) => {
                    self.stats
                        .ephemeral
                        .fetch_add(txn.ephemeral.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(appservice = %a.id, error = %e, "appservice: typing update dropped");
                }
            }
        }
    }
}

/// Per-room interest of one application service, recomputed after member and alias
/// changes.
#[derive(Default)]
struct RoomInterest {
    rooms: HashMap<String, bool>,
}

impl RoomInterest {
    fn forget(&mut self, room_id: &str) {
        self.rooms.remove(room_id);
    }

    fn get(&mut self, p: &Projections, a: &AppService, room_id: &str) -> bool {
        if let Some(v) = self.rooms.get(room_id) {
            return *v;
        }
        if self.rooms.len() >= ROOM_CACHE_MAX {
            self.rooms.clear();
        }
        let v = room_interests(p, a, room_id);
        self.rooms.insert(room_id.to_owned(), v);
        v
    }
}

/// Whether the room's id or one of its aliases is in the application service's
/// namespaces, or a joined member is one of its users (Synapse's
/// `is_interested_in_room`).
pub fn room_interests(p: &Projections, a: &AppService, room_id: &str) -> bool {
    a.is_interested_in_room_id(room_id)
        || p.aliases
            .of_room(room_id)
            .iter()
            .any(|alias| a.is_interested_in_alias(alias))
        || p.membership
            .members(room_id)
            .iter()
            .any(|(u, m)| m.membership == "join" && a.is_interested_in_user(u))
}

/// `unsigned` of an invite pushed to an application service: `invite_room_state`, the
/// stripped state the invitee sees (create, join rules, name, avatar, canonical alias,
/// encryption, topic, the inviter's member event), as Synapse sends it. `None` for
/// any other event. Point lookups only.
fn invite_unsigned(p: &Projections, pdu: &spindle_core::pdu::Pdu) -> Option<Value> {
    if pdu.kind.to_string() != "m.room.member"
        || pdu.content_value()["membership"].as_str() != Some("invite")
    {
        return None;
    }
    let mut state = spindle_api::sync::invite_state_of(p, pdu.event_id.as_str())?;
    // The invite itself is the event, not part of its room state.
    state.pop();
    Some(json!({ "invite_room_state": state }))
}

/// Whether the application service hears of `user_id`'s device list (MSC3202, as
/// Synapse's `_is_appservice_interested_in_device_lists_of_user`): the user is one of
/// its users, or is joined to a room it is interested in.
fn device_list_interest(
    p: &Projections,
    a: &AppService,
    rooms: &mut RoomInterest,
    user_id: &str,
) -> bool {
    a.is_interested_in_user(user_id)
        || p.membership
            .rooms_of(user_id)
            .iter()
            .any(|(r, m)| m.membership == "join" && rooms.get(p, a, r))
}

/// MSC3202 `changed`: `user_id`'s device list changed (or they newly share a room).
fn device_list_changed(
    p: &Projections,
    a: &AppService,
    rooms: &mut RoomInterest,
    txn: &mut Txn,
    user_id: &str,
) {
    if device_list_interest(p, a, rooms, user_id) {
        txn.left.remove(user_id);
        txn.changed.insert(user_id.to_owned());
    }
}

/// MSC3202 one-time key counts (`user -> device -> algorithm -> count`, with
/// `signed_curve25519: 0` when a device has none, as Synapse) and unused fallback key
/// types (`user -> device -> [algorithm]`) of the transaction's interesting users, as
/// Synapse picks them: the sender, the application service's joined users in the
/// rooms of the transaction's events and ephemeral entries, and the to-device
/// recipients. Reads each such room's members and, per user, their devices and two
/// short scans per device.
fn key_summary(p: &Projections, a: &AppService, txn: &Txn) -> (Value, Value) {
    let mut users: BTreeSet<String> = BTreeSet::new();
    users.insert(a.sender.clone());
    let rooms: BTreeSet<&str> = txn
        .events
        .iter()
        .chain(txn.ephemeral.iter())
        .filter_map(|e| e["room_id"].as_str())
        .collect();
    for room in rooms {
        for (u, m) in p.membership.members(room) {
            if m.membership == "join" && a.is_interested_in_user(&u) {
                users.insert(u);
            }
        }
    }
    for m in &txn.to_device {
        if let Some(u) = m["to_user_id"].as_str() {
            users.insert(u.to_owned());
        }
    }
    let mut otks: BTreeMap<String, BTreeMap<String, BTreeMap<String, u64>>> = BTreeMap::new();
    let mut fallback: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for u in users {
        for (device, _) in p.accounts.devices(&u) {
            let mut counts = p.device_keys.one_time_key_counts(&u, &device);
            counts.entry("signed_curve25519".into()).or_insert(0);
            otks.entry(u.clone())
                .or_default()
                .insert(device.clone(), counts);
            let types = p.device_keys.unused_fallback_key_types(&u, &device);
            fallback.entry(u.clone()).or_default().insert(device, types);
        }
    }
    (json!(otks), json!(fallback))
}

/// Adds what `rec` holds for the application service to `txn`.
fn collect(
    p: &Projections,
    a: &AppService,
    rec: &StoredRecord,
    rooms: &mut RoomInterest,
    txn: &mut Txn,
) {
    if let Some(pdu) = rec.pdu() {
        let room_id = pdu.room_id.to_string();
        let kind = pdu.kind.to_string();
        if kind == "m.room.member" || kind == "m.room.canonical_alias" {
            rooms.forget(&room_id);
        }
        if a.msc3202
            && kind == "m.room.member"
            && let Some(target) = pdu.state_key.as_deref()
        {
            match pdu.content_value()["membership"].as_str() {
                // A user who joins a room of interest newly shares it.
                Some("join") if rooms.get(p, a, &room_id) => {
                    txn.left.remove(target);
                    txn.changed.insert(target.to_owned());
                }
                // One who leaves and shares no other room of interest is `left`.
                Some("leave" | "ban") if !device_list_interest(p, a, rooms, target) => {
                    txn.changed.remove(target);
                    txn.left.insert(target.to_owned());
                }
                _ => {}
            }
        }
        let about_user = a.is_interested_in_user(pdu.sender.as_str())
            || (kind == "m.room.member"
                && pdu
                    .state_key
                    .as_deref()
                    .is_some_and(|k| a.is_interested_in_user(k)));
        if about_user || rooms.get(p, a, &room_id) {
            let unsigned = invite_unsigned(p, &pdu);
            txn.events.push(pdu.to_client_event(unsigned));
        }
        return;
    }
    match rec.fact() {
        Some(
            Fact::DeviceKeysUploaded { user_id, .. }
            | Fact::DeviceCreated { user_id, .. }
            | Fact::DeviceRenamed { user_id, .. }
            | Fact::DeviceDeleted { user_id, .. }
            | Fact::CrossSigningKeysUploaded { user_id, .. },
        ) if a.msc3202 => device_list_changed(p, a, rooms, txn, &user_id),
        Some(Fact::SignaturesUploaded { signatures }) if a.msc3202 => {
            let own: BTreeSet<String> = signatures
                .into_iter()
                .filter(|s| s.user_id == s.signer)
                .map(|s| s.signer)
                .collect();
            for u in own {
                device_list_changed(p, a, rooms, txn, &u);
            }
        }
        Some(Fact::AliasSet { room_id, .. }) => rooms.forget(&room_id),
        Some(Fact::AliasDeleted { .. }) => rooms.rooms.clear(),
        Some(Fact::ReceiptSet {
            user_id,
            room_id,
            event_id,
            receipt_type,
            thread_id,
            ts,
        }) if a.wants_ephemeral() && receipt_type == "m.read" && rooms.get(p, a, &room_id) => {
            let mut receipt = json!({ "ts": ts });
            if let Some(t) = thread_id {
                receipt["thread_id"] = json!(t);
            }
            txn.ephemeral.push(json!({
                "type": "m.receipt",
                "room_id": room_id,
                "content": { event_id: { "m.read": { user_id: receipt } } },
            }));
        }
        Some(Fact::ToDeviceSent {
            sender,
            event_type,
            messages,
            ..
        }) if a.wants_ephemeral() => {
            for (user, devices) in messages {
                if !a.is_interested_in_user(&user) {
                    continue;
                }
                for (device, content) in devices {
                    let targets = if device == "*" {
                        p.accounts
                            .devices(&user)
                            .into_iter()
                            .map(|(d, _)| d)
                            .collect()
                    } else {
                        vec![device]
                    };
                    for d in targets {
                        txn.to_device.push(json!({
                            "type": event_type,
                            "sender": sender,
                            "to_user_id": user,
                            "to_device_id": d,
                            "content": content,
                        }));
                    }
                }
            }
        }
        _ => {}
    }
}

/// Refuses to start when an application service's `url` names an address literal (or
/// `localhost`) that `[appservices] ip_range_denylist` denies and the allowlist does
/// not exempt: its transactions would fail forever. Names the fix.
pub fn check_urls(services: &AppServices, config: &AppServicesConfig) -> Result<(), String> {
    let policy = spindle_federation::client::IpPolicy::new(
        &config.ip_range_denylist,
        &config.ip_range_allowlist,
    )
    .map_err(|e| format!("[appservices] ip ranges: {e}"))?;
    for a in services.all() {
        let Some(url) = &a.url else { continue };
        let Some(host) = reqwest::Url::parse(url)
            .ok()
            .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_owned()))
        else {
            continue;
        };
        let ips: Vec<std::net::IpAddr> = if host == "localhost" {
            vec![
                std::net::Ipv4Addr::LOCALHOST.into(),
                std::net::Ipv6Addr::LOCALHOST.into(),
            ]
        } else {
            host.parse().into_iter().collect()
        };
        if !ips.is_empty() && ips.iter().all(|ip| !policy.allows(*ip)) {
            return Err(format!(
                "application service {:?}: its url {url} is in [appservices] ip_range_denylist; \
                 add its address to [appservices] ip_range_allowlist (for a bridge on this \
                 machine: [\"127.0.0.1/32\", \"::1/128\"])",
                a.id
            ));
        }
    }
    Ok(())
}
