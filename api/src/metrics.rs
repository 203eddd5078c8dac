//! Prometheus metrics (issue 17 item 6), served on their own listener
//! (`[metrics] bind`, off by default) in the Prometheus text format. docs/metrics.md
//! lists every metric.
//!
//! Request metrics are counted by a middleware around every route, labelled with the
//! route *template* (`/_matrix/client/v3/rooms/{room_id}/send/...`, never a concrete
//! path: label sets stay bounded) and the status. Everything else is read when scraped
//! from counters that exist anyway (journal stats, projection checkpoints, the hashing
//! pool, `/proc/self`), so a scrape costs nothing between scrapes.
//!
//! Built on `prometheus-client` (the Prometheus project's Rust client) rather than
//! hand-written text encoding: escaping, histogram buckets and the exposition format
//! are its job.

use std::sync::{
    Arc,
    atomic::{AtomicI64, Ordering},
};

use axum::{
    extract::{MatchedPath, Request},
    middleware::Next,
    response::Response,
};
use prometheus_client::{
    encoding::text::encode,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::AppState;

type Labels = Vec<(&'static str, String)>;

/// The server's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    latency: Family<Labels, Histogram, fn() -> Histogram>,
    /// Long-poll `/sync` requests waiting now.
    pub sync_long_polls: Arc<AtomicI64>,
    long_polls: Gauge,
    journal_head: Gauge,
    journal_appended: Gauge,
    journal_fsyncs: Gauge,
    partial_joins: Gauge,
    partial_completed: Gauge,
    partial_sends: Gauge,
    forks: Family<Labels, Gauge>,
    snapshots: Family<Labels, Gauge>,
    snapshot_position: Gauge,
    snapshot_bytes: Gauge,
    snapshot_duration: Gauge<f64, std::sync::atomic::AtomicU64>,
    restore_duration: Gauge<f64, std::sync::atomic::AtomicU64>,
    restored_records: Gauge,
    txn_index: Family<Labels, Gauge>,
    cache_entries: Family<Labels, Gauge>,
    cache_limit: Family<Labels, Gauge>,
    projection_checkpoint: Family<Labels, Gauge>,
    projection_lag: Family<Labels, Gauge>,
    hashing_queue_depth: Gauge,
    hashing_refused: Gauge,
    hashing_completed: Gauge,
    hashing_buffer_bytes: Gauge,
    rss_bytes: Gauge,
    storage_memory: Family<Labels, Gauge>,
    cpu_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
}

fn latency_histogram() -> Histogram {
    // 0.25 ms to ~8 s, doubling.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Registers every metric (names under `spindle_`).
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("spindle");
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by method, route template and status",
            requests.clone(),
        );
        let latency =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        registry.register(
            "http_request_duration_seconds",
            "Time until the response head was ready, by method and route template",
            latency.clone(),
        );
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            registry.register(name, help, g.clone());
            g
        };
        let long_polls = gauge(
            &mut registry,
            "sync_long_polls",
            "Long-poll /sync requests waiting now",
        );
        let journal_head = gauge(
            &mut registry,
            "journal_head_position",
            "Durable head position of the journal",
        );
        let journal_appended = gauge(
            &mut registry,
            "journal_appended_records",
            "Records appended since start (a counter; rate() it)",
        );
        let journal_fsyncs = gauge(
            &mut registry,
            "journal_fsyncs",
            "fsyncs of the journal since start; appended/fsyncs is the mean group-commit batch",
        );
        let partial_joins = gauge(
            &mut registry,
            "federation_partial_state_joins_total",
            "Remote joins since start answered without member events: rooms that became partial-state (MSC3902)",
        );
        let partial_completed = gauge(
            &mut registry,
            "federation_partial_state_completed_total",
            "Partial-state rooms whose full state was imported since start",
        );
        let partial_sends = gauge(
            &mut registry,
            "federation_partial_state_sends_total",
            "Events our users sent since start into a room whose state was partial",
        );
        let forks = Family::<Labels, Gauge>::default();
        registry.register(
            "journal_forks",
            "Remote events that forked a federated room since start, by how the fork was settled (linear, merged, resolved, failed, beyond_window; a counter)",
            forks.clone(),
        );
        let snapshots = Family::<Labels, Gauge>::default();
        registry.register(
            "journal_snapshots",
            "Write-model snapshots since start, by outcome (saved, failed; a counter)",
            snapshots.clone(),
        );
        let snapshot_position = gauge(
            &mut registry,
            "journal_snapshot_position",
            "Position of the newest write-model snapshot (loaded at start or saved since; 0: none)",
        );
        let snapshot_bytes = gauge(
            &mut registry,
            "journal_snapshot_bytes",
            "Size of the last write-model snapshot saved by this process",
        );
        let f64_gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
            registry.register(name, help, g.clone());
            g
        };
        let snapshot_duration = f64_gauge(
            &mut registry,
            "journal_snapshot_duration_seconds",
            "How long saving the last write-model snapshot took",
        );
        let restore_duration = f64_gauge(
            &mut registry,
            "journal_restore_duration_seconds",
            "How long restoring the write models took at start (snapshot load and replay)",
        );
        let restored_records = gauge(
            &mut registry,
            "journal_restored_records",
            "Records replayed at start to restore the write models (those after the snapshot)",
        );
        let txn_index = Family::<Labels, Gauge>::default();
        registry.register(
            "journal_txn_index",
            "Transaction-id lookups in the on-disk index since start (reads: hot-set misses; hits: retries found there; a counter)",
            txn_index.clone(),
        );
        let cache_entries = Family::<Labels, Gauge>::default();
        registry.register(
            "cache_entries",
            "Entries in each bounded in-memory map now (remote_media_bytes: bytes)",
            cache_entries.clone(),
        );
        let cache_limit = Family::<Labels, Gauge>::default();
        registry.register(
            "cache_limit",
            "The configured bound of each in-memory map (same units as cache_entries)",
            cache_limit.clone(),
        );
        let projection_checkpoint = Family::<Labels, Gauge>::default();
        registry.register(
            "projection_checkpoint_position",
            "Last journal position each projection applied",
            projection_checkpoint.clone(),
        );
        let projection_lag = Family::<Labels, Gauge>::default();
        registry.register(
            "projection_lag_records",
            "Journal head minus the projection's checkpoint",
            projection_lag.clone(),
        );
        let hashing_queue_depth = gauge(
            &mut registry,
            "password_hashing_queue_depth",
            "Password hashes waiting or running in the hashing pool",
        );
        let hashing_refused = gauge(
            &mut registry,
            "password_hashing_refused",
            "Password checks refused with 429 because the queue was full, since start",
        );
        let hashing_completed = gauge(
            &mut registry,
            "password_hashing_completed",
            "Password hashes and checks finished since start",
        );
        let hashing_buffer_bytes = gauge(
            &mut registry,
            "password_hashing_buffer_bytes",
            "Memory held by the hashing pool's argon2 buffers",
        );
        let storage_memory = Family::<Labels, Gauge>::default();
        registry.register(
            "storage_memory_bytes",
            "Memory the storage engine holds now, per database (journal, projections) and kind (memtables: unflushed writes; block_cache: cached table blocks)",
            storage_memory.clone(),
        );
        let rss_bytes = gauge(
            &mut registry,
            "process_resident_memory_bytes",
            "Resident set size of the process",
        );
        let cpu_seconds = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "process_cpu_seconds",
            "User and system CPU time of the process since start",
            cpu_seconds.clone(),
        );
        Metrics {
            registry,
            requests,
            latency,
            sync_long_polls: Arc::default(),
            long_polls,
            journal_head,
            journal_appended,
            journal_fsyncs,
            partial_joins,
            partial_completed,
            partial_sends,
            forks,
            snapshots,
            snapshot_position,
            snapshot_bytes,
            snapshot_duration,
            restore_duration,
            restored_records,
            txn_index,
            cache_entries,
            cache_limit,
            projection_checkpoint,
            projection_lag,
            hashing_queue_depth,
            hashing_refused,
            hashing_completed,
            hashing_buffer_bytes,
            rss_bytes,
            storage_memory,
            cpu_seconds,
        }
    }

    /// Counts one answered request.
    pub fn observe(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let route = route.to_owned();
        self.requests
            .get_or_create(&vec![
                ("method", method.to_owned()),
                ("route", route.clone()),
                ("status", status.to_string()),
            ])
            .inc();
        self.latency
            .get_or_create(&vec![("method", method.to_owned()), ("route", route)])
            .observe(seconds);
    }

    /// The Prometheus text exposition of every metric, read fresh.
    pub fn render(&self, s: &AppState) -> String {
        self.long_polls
            .set(self.sync_long_polls.load(Ordering::Relaxed));
        let head = s.journal.durable_head();
        self.journal_head.set(head as i64);
        let stats = s.journal.stats();
        self.journal_appended
            .set(stats.appended.load(Ordering::Relaxed) as i64);
        self.journal_fsyncs
            .set(stats.fsyncs.load(Ordering::Relaxed) as i64);
        self.partial_joins
            .set(stats.partial_state_joins.load(Ordering::Relaxed) as i64);
        self.partial_completed
            .set(stats.partial_state_completed.load(Ordering::Relaxed) as i64);
        self.partial_sends
            .set(stats.partial_state_sends.load(Ordering::Relaxed) as i64);
        for (case, n) in [
            ("linear", &stats.forks_linear),
            ("merged", &stats.forks_merged),
            ("resolved", &stats.forks_resolved),
            ("failed", &stats.forks_failed),
            ("beyond_window", &stats.forks_beyond_window),
            ("soft_failed", &stats.forks_soft_failed),
        ] {
            self.forks
                .get_or_create(&vec![("case", case.to_owned())])
                .set(n.load(Ordering::Relaxed) as i64);
        }
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        for (outcome, n) in [
            ("saved", &stats.snapshots_saved),
            ("failed", &stats.snapshots_failed),
        ] {
            self.snapshots
                .get_or_create(&vec![("outcome", outcome.to_owned())])
                .set(load(n) as i64);
        }
        self.snapshot_position
            .set(load(&stats.snapshot_position) as i64);
        self.snapshot_bytes.set(load(&stats.snapshot_bytes) as i64);
        self.snapshot_duration
            .set(load(&stats.snapshot_duration_ms) as f64 / 1000.0);
        self.restore_duration
            .set(load(&stats.restore_duration_ms) as f64 / 1000.0);
        self.restored_records.set(load(&stats.restored) as i64);
        for (kind, n) in [
            ("reads", &stats.txn_index_reads),
            ("hits", &stats.txn_index_hits),
        ] {
            self.txn_index
                .get_or_create(&vec![("kind", kind.to_owned())])
                .set(load(n) as i64);
        }
        let caches = &s.config.caches;
        let (txns, txns_max) = s.journal.txn_cache_len();
        for (cache, len, max) in [
            ("journal_txn_ids", txns, txns_max),
            (
                "sliding_sync_connections",
                s.sliding.len(),
                caches.sliding_sync_connections,
            ),
            ("typing_rooms", s.typing.rooms_len(), caches.typing_rooms),
            ("presence_users", s.presence.len(), caches.presence_users),
            (
                "device_last_seen",
                s.last_seen.len(),
                caches.device_last_seen,
            ),
            (
                "sync_room_summaries",
                s.summaries.lock().len(),
                caches.sync_room_summaries,
            ),
            (
                "sync_lazy_loaded_members_devices",
                s.lazy_members.len(),
                caches.sync_lazy_loaded_members_devices,
            ),
            (
                "remote_media_bytes",
                s.remote_media.bytes(),
                s.config.media.remote_cache_bytes,
            ),
            (
                "rendered_state_bytes",
                s.state_render.usage().1,
                caches.rendered_state_bytes,
            ),
            (
                "timeline_event_bytes",
                s.projections.timeline.cache().usage().1,
                s.projections.timeline.cache().budget(),
            ),
            (
                "state_node_bytes",
                s.projections.state.node_cache().bytes(),
                s.projections.state.node_cache().budget(),
            ),
            (
                "timeline_tail_rooms",
                s.projections.timeline.tails_kept(),
                spindle_projections::timeline::TAIL_ROOMS,
            ),
            (
                "receipt_read_positions",
                s.projections.receipts.read_positions_kept(),
                spindle_projections::user_data::READ_POSITIONS_KEPT,
            ),
        ] {
            let labels = vec![("cache", cache.to_owned())];
            self.cache_entries.get_or_create(&labels).set(len as i64);
            self.cache_limit.get_or_create(&labels).set(max as i64);
        }
        for p in s.projections.runtime.status() {
            let labels = vec![("projection", p.name.to_owned())];
            self.projection_checkpoint
                .get_or_create(&labels)
                .set(p.checkpoint as i64);
            self.projection_lag
                .get_or_create(&labels)
                .set(head.saturating_sub(p.checkpoint) as i64);
        }
        self.hashing_queue_depth.set(s.hashing.queue_depth() as i64);
        self.hashing_refused.set(s.hashing.refused() as i64);
        self.hashing_completed.set(s.hashing.completed() as i64);
        self.hashing_buffer_bytes
            .set(s.hashing.buffer_bytes() as i64);
        for (database, used) in [
            ("journal", s.journal.storage_use()),
            ("projections", Some(s.projections.db.storage_use())),
        ] {
            let Some(used) = used else { continue };
            for (kind, bytes) in [
                ("memtables", used.write_buffer_bytes),
                ("block_cache", used.block_cache_bytes),
            ] {
                self.storage_memory
                    .get_or_create(&vec![
                        ("database", database.to_owned()),
                        ("kind", kind.to_owned()),
                    ])
                    .set(bytes as i64);
            }
        }
        if let Some(rss) = proc_rss_bytes() {
            self.rss_bytes.set(rss as i64);
        }
        if let Some(cpu) = proc_cpu_seconds() {
            self.cpu_seconds.set(cpu);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// `VmRSS` from `/proc/self/status`, bytes (Linux; `None` elsewhere).
fn proc_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// utime + stime from `/proc/self/stat`, seconds (assumes the usual 100 ticks/s).
fn proc_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// The middleware: counts each request under its route template.
pub async fn track(
    axum::extract::State(s): axum::extract::State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let started = std::time::Instant::now();
    let method = req.method().as_str().to_owned();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |m| m.as_str().to_owned());
    let resp = next.run(req).await;
    s.metrics.observe(
        &method,
        &route,
        resp.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    resp
}

/// Counts a waiting long-poll while alive.
pub struct LongPollGuard(Arc<AtomicI64>);

impl LongPollGuard {
    /// Counts one more waiting long-poll until dropped.
    pub fn new(s: &AppState) -> LongPollGuard {
        s.metrics.sync_long_polls.fetch_add(1, Ordering::Relaxed);
        LongPollGuard(s.metrics.sync_long_polls.clone())
    }
}

impl Drop for LongPollGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
