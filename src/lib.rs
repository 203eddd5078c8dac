//! The `spindle` homeserver: wires the journal, the projections, the Client-Server API
//! and the federation key endpoint into one process.

pub mod appservice;
pub mod config;
pub mod federation_edus;
mod guest_kick;
mod ops;
pub mod push_gateway;
mod reactor;
mod relay;

use std::{net::SocketAddr, sync::Arc};

use anyhow::{Context, anyhow};
pub use config::Config;
use spindle_journal::{FjallStore, Journal};
use spindle_projections::Projections;

/// The server name is fixed for a data directory's life: user ids, room ids and
/// signatures all carry it. The first start records it in `<data>/server_name`; a later
/// start with another name refuses to run instead of mixing identities.
fn check_server_name(config: &Config) -> anyhow::Result<()> {
    let path = config.data_dir.join("server_name");
    match std::fs::read_to_string(&path) {
        Ok(stored) if stored.trim() == config.server_name => Ok(()),
        Ok(stored) => Err(anyhow!(
            "{} belongs to server name {:?}, but the config says {:?}; the server name cannot change for a data directory",
            config.data_dir.display(),
            stored.trim(),
            config.server_name
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::write(&path, format!("{}\n", config.server_name))
                .with_context(|| format!("writing {}", path.display()))
        }
        Err(e) => Err(anyhow!("reading {}: {e}", path.display())),
    }
}

/// A running server.
pub struct Server {
    /// The address actually bound (useful with port 0).
    pub addr: SocketAddr,
    /// The journal.
    pub journal: Journal,
    /// The projections.
    pub projections: Projections,
    /// The API's shared state (hashing pool, rate limiters, ...).
    pub state: spindle_api::AppState,
    /// The metrics listener's address, when `[metrics] enabled`.
    pub metrics_addr: Option<SocketAddr>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    wake_long_polls: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    tls: Option<axum_server::Handle>,
    /// The federation sender (`None` with federation disabled).
    pub federation_sender: Option<spindle_federation::sender::FederationSender>,
    /// The federation state (keys, client); tests pin peers' keys through it.
    pub federation: spindle_federation::FedState,
    /// Push delivery to gateways (`None` with `[push] enabled = false`).
    pub push_sender: Option<push_gateway::PushSender>,
    /// Application service transactions (`None` without registrations).
    pub appservice_sender: Option<appservice::AppServiceSender>,
}

impl Server {
    /// Opens the data directory, restores the journal, starts the projections and serves
    /// HTTP on `config.bind`.
    pub async fn start(config: Config) -> anyhow::Result<Server> {
        Self::start_with_clock(
            config,
            Arc::new(spindle_api::ratelimit::SystemClock::default()),
        )
        .await
    }

    /// [`Server::start`] with the rate limiters on `clock` (tests step a
    /// `ManualClock` to drain buckets instead of sleeping).
    pub async fn start_with_clock(
        config: Config,
        clock: Arc<dyn spindle_api::ratelimit::Clock>,
    ) -> anyhow::Result<Server> {
        config.validate().map_err(|e| anyhow!(e))?;
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("creating data directory {}", config.data_dir.display()))?;
        check_server_name(&config)?;
        // Registration files first: a bad one stops the server before anything opens.
        let appservices = Arc::new(
            spindle_api::appservice::AppServices::load(
                &config.appservices.registration_files,
                &config.server_name,
                &config.appservices.to_api(),
            )
            .map_err(|e| anyhow!(e))?,
        );
        appservice::check_urls(&appservices, &config.appservices).map_err(|e| anyhow!(e))?;
        let key = Arc::new(
            spindle_federation::load_or_create_key(&config.data_dir, &config.server_name)
                .map_err(|e| anyhow!(e))?,
        );
        let options = spindle_journal::JournalOptions {
            fork_window: config.federation.fork_window,
            snapshot_every_records: config.journal.snapshot_every_records,
            txn_ids_cached: config.journal.txn_ids_cached,
        };
        let journal_dir = config.data_dir.join("journal");
        let journal = match config.journal.backend {
            config::JournalBackend::Embedded => {
                let store = FjallStore::open_with(&journal_dir, config.storage)
                    .map_err(|e| anyhow!(e))
                    .with_context(|| {
                        format!(
                            "opening the journal in {} (is another spindle using this data_dir?)",
                            config.data_dir.display()
                        )
                    })?;
                Journal::open_with(Arc::new(store), key.clone(), options)
                    .map_err(|e| anyhow!(e.to_string()))?
            }
            config::JournalBackend::Nats => {
                // Connecting and copying the stream's new records block: off the runtime.
                let nats = config.journal.nats.clone();
                let memory = config.storage;
                let store = tokio::task::spawn_blocking(move || {
                    spindle_journal::NatsStore::open(&journal_dir, memory, nats)
                })
                .await?
                .map_err(|e| anyhow!(e))
                .context("opening the journal's JetStream stream (journal.backend = \"nats\")")?;
                Journal::open_shared(Arc::new(store), key.clone(), options)
                    .map_err(|e| anyhow!(e.to_string()))?
            }
        };
        let projections = Projections::start_with(
            &config.data_dir.join("projections"),
            journal.clone(),
            spindle_projections::ProjectionOptions {
                search: spindle_projections::search::SearchOptions {
                    writer_heap_bytes: config.search.writer_heap_bytes,
                },
                storage: config.storage,
                timeline_event_bytes: config.caches.timeline_event_bytes,
                state_node_bytes: config.caches.state_node_bytes,
            },
        )
        .map_err(|e| anyhow!(e))?;
        // Serve only once every projection has caught up with the journal, so no reader
        // ever sees a half-built read model (a fresh `projections/` rebuilds here).
        let head = journal.durable_head();
        let runtime = &projections.runtime;
        if runtime.applied() < head {
            tracing::info!(head, "projections are catching up with the journal");
            let caught_up = catch_up(
                "projections",
                head,
                || runtime.applied(),
                |t| runtime.wait_for(head, t),
            )
            .await;
            if !caught_up {
                return Err(anyhow!("projections did not catch up to position {head}"));
            }
        }
        // Projections that do not gate reads (the search index) catch up too, unless
        // they are backfilling (new in this release: they serve "not yet" meanwhile).
        for p in runtime.status() {
            if p.ready && p.checkpoint < head {
                let checkpoint = || {
                    runtime
                        .status()
                        .iter()
                        .find(|s| s.name == p.name)
                        .map_or(0, |s| s.checkpoint)
                };
                let caught_up = catch_up(p.name, head, checkpoint, |t| {
                    runtime.wait_for_projection(p.name, head, t)
                })
                .await;
                if !caught_up {
                    return Err(anyhow!(
                        "projection {} did not catch up to position {head}",
                        p.name
                    ));
                }
            }
        }
        let listener = tokio::net::TcpListener::bind(config.bind)
            .await
            .with_context(|| format!("binding {}", config.bind))?;
        let addr = listener.local_addr()?;
        let api_config = spindle_api::ApiConfig {
            server_name: config.server_name.clone(),
            public_base_url: if config.public_base_url.is_empty()
                && !config.bind.ip().is_unspecified()
            {
                format!("http://{addr}")
            } else {
                config.base_url()
            },
            registration_open: config.registration_open(),
            registration_tokens: config.registration.tokens.clone(),
            allow_guest_access: config.registration.allow_guest_access,
            max_request_bytes: config.limits.max_request_bytes,
            max_sync_timeout_ms: config.limits.max_sync_timeout_ms,
            request_body_idle_timeout_ms: config.limits.request_body_idle_timeout_ms,
            admins: config.admins.clone(),
            registration_shared_secret: config.registration.shared_secret.clone(),
            refreshable_access_token_lifetime_ms: config
                .sessions
                .refreshable_access_token_lifetime_ms,
            presence_enabled: config.presence.enabled,
            media: spindle_api::MediaConfig {
                dir: config.data_dir.join("media"),
                max_upload_bytes: config.media.max_upload_bytes,
                url_preview: config.media.url_preview,
                url_preview_allow_private: config.media.url_preview_allow_private,
                legacy_unauthenticated: config.media.legacy_unauthenticated,
                remote_cache_bytes: config.media.remote_cache_bytes,
            },
            voip: spindle_api::voip::VoipConfig {
                turn_uris: config.voip.turn_uris.clone(),
                turn_shared_secret: config.voip.turn_shared_secret.clone(),
                turn_username: config.voip.turn_username.clone(),
                turn_password: config.voip.turn_password.clone(),
                turn_ttl_s: config.voip.turn_ttl_s,
            },
            support: support_body(&config.support),
            hashing: config.password_hashing.to_api(),
            rate_limits: config.rate_limits.to_api(),
            trust_x_forwarded_for: config.reverse_proxy.trust_x_forwarded_for,
            keep_client_addresses: config.devices.keep_client_addresses,
            max_event_delay_duration_ms: config.delayed_events.max_event_delay_duration_ms,
            max_scheduled_delays_per_user: config.delayed_events.max_scheduled_per_user,
            caches: config.caches.to_api(),
            email: config.email.to_api(),
            identity: config.identity_servers.to_api(),
        };
        let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
        let state = spindle_api::AppState::new_with_clock(
            journal.clone(),
            projections.clone(),
            api_config,
            shutdown_rx.clone(),
            clock,
        )
        .with_appservices(appservices.clone());
        spindle_api::appservice::register_senders(&state)
            .await
            .map_err(|e| anyhow!("registering application service senders: {}", e.error))?;
        let fed = spindle_federation::FedState::new(
            key.clone(),
            journal.clone(),
            projections.clone(),
            config.federation.clone(),
        )
        .map_err(|e| anyhow!("federation: {e}"))?
        .with_ephemeral(std::sync::Arc::new(federation_edus::Sink {
            typing: state.typing.clone(),
            presence: state.presence.clone(),
            projections: projections.clone(),
        }));
        // `[rate_limits.federation_origin]`: the api crate keeps the limiters; the
        // federation crate counts each authenticated request against its origin.
        let limits = state.rate_limits.clone();
        let fed = fed.with_origin_limit(std::sync::Arc::new(move |origin: &str| {
            limits
                .check_federation_origin(origin)
                .err()
                .map(|r| r.retry_after_ms)
        }));
        let fed_routes = if config.federation.enabled {
            spindle_federation::router(fed.clone())
        } else {
            spindle_federation::key_routes(fed.clone())
        };
        let state = if config.federation.enabled {
            state.with_federation(fed.clone())
        } else {
            state
        };
        // Typing and presence are in memory: shared with the deployment's other processes.
        if let Some(channel) = journal.ephemeral_channel() {
            relay::start(
                channel,
                state.typing.clone(),
                state.presence.clone(),
                projections.clone(),
                config.presence.enabled,
            );
        }
        // The consumers that act on the world run once per deployment: always with the
        // embedded journal; with a shared one on the process holding the writer lease,
        // started when it wins it (their cursors are shared, see `Journal::cursors`).
        let outbound = match config.journal.backend {
            config::JournalBackend::Embedded => start_outbound(
                &config,
                &journal,
                &projections,
                &appservices,
                &state,
                &fed,
                &shutdown_rx,
            )?,
            config::JournalBackend::Nats => {
                let (config, journal, projections, appservices, state, fed, shutdown_rx) = (
                    config.clone(),
                    journal.clone(),
                    projections.clone(),
                    appservices.clone(),
                    state.clone(),
                    fed.clone(),
                    shutdown_rx.clone(),
                );
                tokio::spawn(async move {
                    let mut shutdown = shutdown_rx.clone();
                    while journal.is_writer() != Some(true) {
                        tokio::select! {
                            _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                            _ = shutdown.changed() => return,
                        }
                    }
                    // Retried: a NATS cluster still electing leaders times out the
                    // cursor stream's creation. The consumers start once, after it.
                    while let Err(e) = journal.prepare_cursors() {
                        tracing::warn!(error = %e, "the consumers' cursor stream is not ready; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
                            _ = shutdown.changed() => return,
                        }
                    }
                    match start_outbound(
                        &config,
                        &journal,
                        &projections,
                        &appservices,
                        &state,
                        &fed,
                        &shutdown_rx,
                    ) {
                        Ok(outbound) => {
                            tracing::info!("outbound consumers started on the journal writer");
                            let _ = shutdown.wait_for(|v| *v).await;
                            drop(outbound);
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "starting the outbound consumers failed; restart this process")
                        }
                    }
                });
                Outbound::default()
            }
        };
        let app = spindle_api::router(state.clone())
            .merge(ops::router(state.clone(), config.data_dir.clone()))
            .merge(fed_routes);
        let app = if config.metrics.enabled {
            app.layer(axum::middleware::from_fn_with_state(
                state.clone(),
                spindle_api::metrics::track,
            ))
        } else {
            app
        };
        let (metrics_addr, metrics_task) = if config.metrics.enabled {
            let (addr, task) = serve_metrics(config.metrics.bind, state.clone()).await?;
            (Some(addr), Some(task))
        } else {
            (None, None)
        };
        let app = if config.logging.access_log {
            app.layer(axum::middleware::from_fn(
                spindle_api::access_log::access_log,
            ))
        } else {
            app
        };
        let tls = if config.federation.tls_bind.is_empty() {
            None
        } else {
            let _ = rustls::crypto::ring::default_provider().install_default();
            let tls_addr: SocketAddr = config
                .federation
                .tls_bind
                .parse()
                .context("federation.tls_bind")?;
            let tls_config = axum_server::tls_rustls::RustlsConfig::from_pem_file(
                &config.federation.tls_certificate_path,
                &config.federation.tls_private_key_path,
            )
            .await
            .with_context(|| {
                format!(
                    "loading the federation TLS certificate {} and key {}",
                    config.federation.tls_certificate_path.display(),
                    config.federation.tls_private_key_path.display()
                )
            })?;
            let std_listener = std::net::TcpListener::bind(tls_addr)
                .with_context(|| format!("binding federation.tls_bind {tls_addr}"))?;
            std_listener.set_nonblocking(true)?;
            let handle = axum_server::Handle::new();
            let server =
                axum_server::from_tcp_rustls(std_listener, tls_config).handle(handle.clone());
            let tls_app = app.clone();
            tokio::spawn(async move {
                if let Err(e) = server.serve(tls_app.into_make_service()).await {
                    tracing::error!(error = %e, "federation TLS listener stopped");
                }
            });
            tracing::info!(addr = %tls_addr, "federation TLS listener is serving");
            Some(handle)
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            // The peer address reaches handlers as `ConnectInfo` (per-address rate
            // limits, device `last_seen_ip`).
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
            let serve = axum::serve(listener, app).with_graceful_shutdown(async {
                let _ = rx.await;
            });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "server stopped");
            }
        });
        tracing::info!(%addr, server_name = %config.server_name, "spindle is serving");
        Ok(Server {
            addr,
            journal,
            projections,
            state,
            metrics_addr,
            metrics_task,
            shutdown: Some(tx),
            wake_long_polls: shutdown_tx,
            task,
            tls,
            federation_sender: outbound.federation_sender,
            federation: fed,
            push_sender: outbound.push_sender,
            appservice_sender: outbound.appservice_sender,
        })
    }

    /// Stops accepting requests, answers waiting long-polls at once, and waits for
    /// in-flight requests (at most 10 s).
    pub async fn stop(mut self) {
        let _ = self.wake_long_polls.send(true);
        // A shared journal's writer hands the lease over now, not after its ttl.
        self.journal.step_down().await;
        if let Some(h) = &self.tls {
            h.graceful_shutdown(Some(std::time::Duration::from_secs(10)));
        }
        if let Some(task) = self.metrics_task.take() {
            task.abort();
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(std::time::Duration::from_secs(10), &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("in-flight requests did not finish within 10 s; stopping anyway");
            self.task.abort();
        }
        // Checkpoints idle batches left in memory: the next start resumes from them.
        self.projections.runtime.store_checkpoints();
    }
}

/// The consumers that act on the world: federation sender (and its EDU feed, the
/// partial-state resumption), push delivery, application-service transactions, the
/// guest kicker and the delayed-events worker.
#[derive(Default)]
struct Outbound {
    federation_sender: Option<spindle_federation::sender::FederationSender>,
    push_sender: Option<push_gateway::PushSender>,
    appservice_sender: Option<appservice::AppServiceSender>,
}

fn start_outbound(
    config: &Config,
    journal: &Journal,
    projections: &Projections,
    appservices: &Arc<spindle_api::appservice::AppServices>,
    state: &spindle_api::AppState,
    fed: &spindle_federation::FedState,
    shutdown_rx: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Outbound> {
    let appservice_sender = if appservices.is_empty() {
        None
    } else {
        Some(
            appservice::AppServiceSender::start(
                journal.clone(),
                projections.clone(),
                appservices.clone(),
                config.appservices.clone(),
                &config.data_dir.join("consumers"),
                (state.typing.clone(), state.presence.clone()),
                shutdown_rx.clone(),
            )
            .map_err(|e| anyhow!("appservices: {e}"))?,
        )
    };
    let sender = if config.federation.enabled {
        Some(
            spindle_federation::sender::FederationSender::start(
                fed.clone(),
                &config.data_dir.join("consumers"),
            )
            .map_err(|e| anyhow!("federation sender: {e}"))?,
        )
    } else {
        None
    };
    if config.federation.enabled {
        // Rooms joined with partial state before a restart go on fetching their
        // members (MSC3902).
        let fed = fed.clone();
        tokio::spawn(async move { spindle_federation::partial::resume(&fed).await });
    }
    if let Some(sender) = &sender {
        tokio::spawn(federation_edus::run_feed(
            sender.clone(),
            state.typing.clone(),
            state.presence.clone(),
            config.server_name.clone(),
            config.federation.presence && config.presence.enabled,
            shutdown_rx.clone(),
        ));
    }
    let push_sender = if config.push.enabled {
        Some(
            push_gateway::PushSender::start(
                journal.clone(),
                projections.clone(),
                config.push.clone(),
                &config.data_dir.join("consumers"),
                shutdown_rx.clone(),
            )
            .map_err(|e| anyhow!("push: {e}"))?,
        )
    } else {
        None
    };
    // Always on: guests registered while `allow_guest_access` was on are still
    // guests after it is turned off.
    guest_kick::start(
        journal.clone(),
        projections.clone(),
        config.server_name.clone(),
        &config.data_dir.join("consumers"),
        shutdown_rx.clone(),
    )
    .map_err(|e| anyhow!("guest-kick: {e}"))?;
    tokio::spawn(spindle_api::delayed::run_worker(
        state.clone(),
        shutdown_rx.clone(),
    ));
    Ok(Outbound {
        federation_sender: sender,
        push_sender,
        appservice_sender,
    })
}

/// Serves `GET /metrics` (Prometheus text format) on its own listener.
async fn serve_metrics(
    bind: SocketAddr,
    state: spindle_api::AppState,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .with_context(|| format!("binding the metrics listener {bind}"))?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(
                |axum::extract::State(s): axum::extract::State<spindle_api::AppState>| async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        s.metrics.render(&s),
                    )
                },
            ),
        )
        .with_state(state);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics listener stopped");
        }
    });
    tracing::info!(%addr, "serving metrics");
    Ok((addr, task))
}

/// The `/.well-known/matrix/support` body for the configured contacts and page
/// (empty strings left out); `None` when neither is configured.
fn support_body(support: &config::Support) -> Option<serde_json::Value> {
    let contacts: Vec<serde_json::Value> = support
        .contacts
        .iter()
        .map(|c| {
            let mut o = serde_json::json!({ "role": c.role });
            if !c.matrix_id.is_empty() {
                o["matrix_id"] = c.matrix_id.clone().into();
            }
            if !c.email_address.is_empty() {
                o["email_address"] = c.email_address.clone().into();
            }
            o
        })
        .collect();
    let mut body = serde_json::Map::new();
    if !contacts.is_empty() {
        body.insert("contacts".into(), contacts.into());
    }
    if !support.support_page.is_empty() {
        body.insert("support_page".into(), support.support_page.clone().into());
    }
    (!body.is_empty()).then_some(serde_json::Value::Object(body))
}

/// Waits (up to 24 h) until `wait` reports position `head` reached, logging progress
/// once a second while it takes longer than a second: `what`: done / total records
/// and the rate (issue 17 item 3: no silent start-up step).
async fn catch_up<F: std::future::Future<Output = bool>>(
    what: &str,
    head: u64,
    applied: impl Fn() -> u64,
    wait: impl Fn(std::time::Duration) -> F,
) -> bool {
    let started = std::time::Instant::now();
    let from = applied();
    loop {
        if wait(std::time::Duration::from_secs(1)).await {
            let secs = started.elapsed().as_secs_f64();
            if secs >= 1.0 {
                tracing::info!(
                    head,
                    ms = (secs * 1000.0) as u64,
                    "{what}: caught up, {} records in {secs:.1} s",
                    head - from
                );
            }
            return true;
        }
        let secs = started.elapsed().as_secs_f64();
        if secs >= 24.0 * 3600.0 {
            return false;
        }
        let done = applied();
        let rate = done.saturating_sub(from) as f64 / secs;
        tracing::info!(
            done,
            total = head,
            records_per_s = rate as u64,
            "{what}: catching up: {done} / {head} records ({rate:.0} records/s)"
        );
    }
}
