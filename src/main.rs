//! `spindle`: serve (the default), and the offline `replay` verbs.

use std::path::PathBuf;

/// With `--features mimalloc`, mimalloc is the global allocator (docs/benchmarks.md,
/// "Memory soak", measures both).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// jemalloc is the global allocator by default (the `jemalloc` feature), unless
/// `--features mimalloc` asks for mimalloc; `--no-default-features` keeps glibc's.
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use anyhow::{Context, anyhow};
use clap::{Parser, Subcommand};
use spindle::Config;

/// A Matrix homeserver that keeps each room as a linear log.
#[derive(Parser)]
#[command(name = "spindle", version, about)]
struct Cli {
    /// TOML config file (see spindle.example.toml). Without one: localhost:8008 on
    /// 127.0.0.1:8008 with data in ./data.
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the homeserver (the default).
    Serve,
    /// Rebuild or check projections from the journal (stop the server first).
    Replay {
        #[command(subcommand)]
        verb: Replay,
    },
    /// Check, migrate, export or import the journal itself (stop the server first).
    Journal {
        #[command(subcommand)]
        verb: JournalVerb,
    },
    /// Audit trails from the log (stop the server first; the admin API serves the same live).
    Audit {
        #[command(subcommand)]
        verb: Audit,
    },
    /// Server administration (stop the server first).
    Admin {
        #[command(subcommand)]
        verb: Admin,
    },
    /// Copy what cannot be rebuilt (the journal as an export, signing key, server name,
    /// media) into a new directory with a MANIFEST.json of hashes. With the server
    /// stopped it reads the data directory; with `--token` (or SPINDLE_ADMIN_TOKEN) a
    /// running server writes the backup itself, consistent up to its journal head.
    Backup {
        /// The backup directory (must not exist or be empty; absolute when online).
        #[arg(long)]
        out: PathBuf,
        /// An admin's access token: back up through the running server.
        #[arg(long)]
        token: Option<String>,
        /// The running server's base URL (default: http://<bind>, loopback for 0.0.0.0).
        #[arg(long)]
        url: Option<String>,
    },
    /// Check a backup: manifest, every file's size and blake3, media files named by
    /// their hash, the journal export's hash chain, and that every media upload in the
    /// export has its blob.
    VerifyBackup {
        /// The backup directory.
        dir: PathBuf,
    },
    /// Restore a verified backup into the configured data directory (or --data), which
    /// must have no journal; projections are rebuilt at the next start.
    Restore {
        /// The backup directory.
        dir: PathBuf,
        /// Restore into this data directory instead of the config's.
        #[arg(long)]
        data: Option<PathBuf>,
    },
    /// Check that every media upload in the journal (`MediaUploaded` fact) has its blob
    /// in <data_dir>/media and that the blob hashes to its name (server stopped, or
    /// --data on a copy). Prints one line per missing or corrupt blob (`missing|corrupt
    /// <TAB> position <TAB> media id <TAB> blake3 [<TAB> actual blake3]`), then a
    /// summary; exits 1 if any is missing or corrupt.
    VerifyMedia {
        /// Check this data directory instead of the config's.
        #[arg(long)]
        data: Option<PathBuf>,
    },
    /// Bytes on disk per keyspace of the journal and of the projections (server
    /// stopped): one line per keyspace, largest first (`journal|projections <TAB>
    /// keyspace <TAB> bytes <TAB> approximate items`), then `total <TAB>
    /// journal|projections <TAB> table bytes <TAB> directory bytes` and `records <TAB>
    /// <journal head>`. A keyspace's bytes are its compressed table files; what is still
    /// in memtables is only in the directory total (fjall's write-ahead journal).
    Storage {
        /// Report on this data directory instead of the config's.
        #[arg(long)]
        data: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum JournalVerb {
    /// Verify the hash chain and every record's own integrity (event id, content hash,
    /// our signature, fact payload); prints the head position and hash, or the first bad
    /// position (exit status 1).
    Check {
        /// Check only the chain (decoding, positions, prev_hash), not each record's content.
        #[arg(long)]
        chain_only: bool,
    },
    /// Rewrite a journal written in record format 1 (before the hash chain) in the
    /// current format; the old journal is kept as `journal.format1`.
    Migrate,
    /// Write the whole journal to FILE as a versioned, deterministic recorded journal
    /// (JSON Lines: a header, then one record per line; same journal, same bytes).
    Export {
        /// Where to write (replaced atomically).
        #[arg(long)]
        out: PathBuf,
    },
    /// Copy this data directory's embedded journal into the JetStream stream of
    /// `[journal.nats]`, with the outbound consumers' cursors, then start with `backend =
    /// "nats"` (docs/scale-out.md). The server must be stopped. An interrupted copy
    /// resumes; a stream holding another journal is refused.
    CopyToNats,
    /// Copy every record of the `[journal.nats]` stream this data directory lacks into
    /// its journal (fsynced), with the outbound consumers' cursors, then start with
    /// `backend = "embedded"`. Stop every process of the deployment first.
    CopyFromNats,
    /// Load a recorded journal into a fresh data directory (no journal yet). The chain
    /// is checked line by line; start the server on DIR afterwards to build projections.
    Import {
        /// A file written by `journal export`.
        file: PathBuf,
        /// The data directory to create (its `journal/` must not exist).
        #[arg(long)]
        data: PathBuf,
    },
}

#[derive(Subcommand)]
enum Audit {
    /// Every state change of a room from the log: position, origin time, event id,
    /// sender, (type, state key), the previous value and the new one (or a redaction).
    Room {
        /// The room id (`!…`).
        room_id: String,
        /// One JSON object per line instead of tab-separated text.
        #[arg(long)]
        json: bool,
        /// Only this event type (e.g. `m.room.power_levels`).
        #[arg(long = "type")]
        event_type: Option<String>,
        /// Only changes sent by this user.
        #[arg(long)]
        sender: Option<String>,
        /// Only changes with origin_server_ts >= this (ms since the Unix epoch).
        #[arg(long)]
        since_ts: Option<u64>,
        /// Only changes with origin_server_ts < this (ms since the Unix epoch).
        #[arg(long)]
        until_ts: Option<u64>,
    },
    /// An account's journal facts: registration, devices, tokens issued/revoked (never
    /// the token or its hash), password changes, deactivation, membership changes, and
    /// any other fact naming the account.
    User {
        /// The user id (`@…`).
        user_id: String,
        /// One JSON object per line instead of tab-separated text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum Admin {
    /// Make an account a server admin (a journal fact; server stopped). Admins may use
    /// the admin API (`/_spindle/admin/v1/...`). Config `admins` is the other way.
    Promote {
        /// The local user id (`@…`); the account must exist.
        user_id: String,
    },
}

#[derive(Subcommand)]
enum Replay {
    /// Rebuild projections from position 0. Offline (server stopped): deletes their
    /// tables and rebuilds them, printing each digest. Online (--token, or
    /// SPINDLE_ADMIN_TOKEN): the running server rebuilds each one beside the live
    /// tables, which keep serving, and swaps it in once caught up; prints
    /// `name <TAB> generation N <TAB> checkpoint C` when each is live.
    Rebuild {
        /// The projection to rebuild (`replay status` lists them); the others keep
        /// their tables and resume from their checkpoints.
        projection: Option<String>,
        /// Rebuild every projection (online: one after the other).
        #[arg(long, conflicts_with = "projection")]
        all: bool,
        /// An admin's access token: rebuild online through the running server.
        #[arg(long)]
        token: Option<String>,
        /// The running server's base URL (default: http://<bind>).
        #[arg(long)]
        url: Option<String>,
    },
    /// Rebuild every projection into a scratch directory and compare digests with the
    /// live ones. Prints `name <TAB> ok|DIFFERS <TAB> digest` per projection and, under a
    /// projection that differs, one line per differing table: how many keys differ
    /// (only live, only rebuilt, changed) and the first and last differing key. Exits 1
    /// if any differs. Server stopped.
    Verify,
    /// Print each projection's checkpoint, the journal head and the lag. With --token
    /// (an admin's access token, or SPINDLE_ADMIN_TOKEN) ask the running server instead,
    /// which also says which projections are still backfilling.
    Status {
        /// An admin's access token: ask the running server.
        #[arg(long)]
        token: Option<String>,
        /// The running server's base URL (default: http://<bind>).
        #[arg(long)]
        url: Option<String>,
    },
}

fn load_config(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    match path {
        None => Ok(Config::default()),
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Config::from_toml(&text).map_err(|e| anyhow!("{}: {e}", p.display()))
        }
    }
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    if let Err(e) = runtime.block_on(run()) {
        // Operator errors (bad config, locked data dir) read as one line, not a backtrace.
        eprintln!("spindle: {e:#}");
        std::process::exit(1);
    }
}

/// Logs go to stderr: text or JSON lines (`[logging] format`), colours only on a
/// terminal unless told otherwise (a log file must not fill with escape codes).
fn init_logging(config: &Config) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log));
    let ansi = match config.logging.color.as_str() {
        "always" => true,
        "never" => false,
        _ => std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    if config.logging.format == "json" {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config = load_config(cli.config.as_ref())?;
    init_logging(&config);
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            // Handlers go in before the server answers anything: a supervisor (or a
            // test) that sends SIGTERM as soon as the port answers must get a graceful
            // stop, never the default disposition's kill.
            let first_signal = shutdown_signal();
            let server = spindle::Server::start(config).await?;
            eprintln!(
                "spindle: serving on http://{} (stop with Ctrl-C)",
                server.addr
            );
            first_signal.await;
            eprintln!("spindle: shutting down (a second signal exits at once)");
            tokio::spawn(async {
                shutdown_signal().await;
                eprintln!("spindle: second signal, exiting now");
                std::process::exit(130);
            });
            server.stop().await;
        }
        Command::Replay {
            verb:
                Replay::Rebuild {
                    projection,
                    all,
                    token,
                    url,
                },
        } if token.is_some() || std::env::var("SPINDLE_ADMIN_TOKEN").is_ok() => {
            let token = token
                .or_else(|| std::env::var("SPINDLE_ADMIN_TOKEN").ok())
                .unwrap_or_default();
            let base = url.unwrap_or_else(|| local_url(&config));
            let names = match (projection, all) {
                (Some(name), _) => vec![name],
                (None, true) => online_status(&base, &token).await?["projections"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["name"].as_str().map(str::to_owned))
                    .collect(),
                (None, false) => {
                    return Err(anyhow!(
                        "say which projections to rebuild: a name (see `replay status`) or --all"
                    ));
                }
            };
            for name in names {
                let (generation, checkpoint) = rebuild_online(&base, &token, &name).await?;
                out(&format!(
                    "{name}\tgeneration {generation}\tcheckpoint {checkpoint}\n"
                ));
            }
        }
        Command::Replay {
            verb:
                Replay::Rebuild {
                    projection: Some(name),
                    ..
                },
        } => {
            let digest =
                spindle_replay::rebuild_one(&config.data_dir, &config.server_name, &name).await?;
            println!("{name}\t{digest}");
        }
        Command::Replay {
            verb: Replay::Rebuild { all, .. },
        } => {
            if !all {
                return Err(anyhow!(
                    "say which projections to rebuild: a name (see `replay status`) or --all"
                ));
            }
            for (name, digest) in
                spindle_replay::rebuild_all(&config.data_dir, &config.server_name).await?
            {
                println!("{name}\t{digest}");
            }
        }
        Command::Replay {
            verb: Replay::Verify,
        } => {
            let mut failed = false;
            for v in spindle_replay::verify(&config.data_dir, &config.server_name).await? {
                let ok = v.live == v.rebuilt;
                failed |= !ok;
                println!(
                    "{}\t{}\t{}",
                    v.projection,
                    if ok { "ok" } else { "DIFFERS" },
                    v.live
                );
                for d in &v.differences {
                    println!(
                        "\t{}\t{} keys differ ({} only live, {} only rebuilt, {} changed)\tkeys {} .. {}",
                        d.table,
                        d.only_live + d.only_rebuilt + d.changed,
                        d.only_live,
                        d.only_rebuilt,
                        d.changed,
                        spindle_projections::render_key(&d.first_key),
                        spindle_projections::render_key(&d.last_key),
                    );
                }
            }
            if failed {
                return Err(anyhow!("some projections differ from a rebuild"));
            }
        }
        Command::Journal {
            verb: JournalVerb::Check { chain_only },
        } => {
            let report =
                spindle_replay::journal_check(&config.data_dir, &config.server_name, !chain_only)?;
            match report.broken {
                None => println!(
                    "ok\thead {}\t{}",
                    report.head.position,
                    spindle_replay::hex(&report.head.hash)
                ),
                Some(brk) => {
                    println!(
                        "BROKEN\tfirst bad position {}\tverified up to {}\t{}",
                        brk.position,
                        brk.good.position,
                        spindle_replay::hex(&brk.good.hash)
                    );
                    return Err(anyhow!("{brk}"));
                }
            }
        }
        Command::Journal {
            verb: JournalVerb::Migrate,
        } => {
            let m = spindle_replay::journal_migrate(&config.data_dir)?;
            println!(
                "migrated {} records; head {} {}; old journal kept in {}",
                m.records,
                m.head.position,
                spindle_replay::hex(&m.head.hash),
                m.kept.display()
            );
        }
        Command::Journal {
            verb: JournalVerb::Export { out },
        } => {
            let h = spindle_replay::export_to_file(&config.data_dir, &config.server_name, &out)?;
            println!(
                "exported {} records to {}; head {} {}",
                h.records,
                out.display(),
                h.head,
                h.head_hash
            );
        }
        Command::Journal {
            verb: JournalVerb::Import { file, data },
        } => {
            let h = spindle_replay::export::import(&file, &data)?;
            println!(
                "imported {} records of {} into {}; head {} {}",
                h.records,
                h.server_name,
                data.display(),
                h.head,
                h.head_hash
            );
        }
        Command::Journal {
            verb: verb @ (JournalVerb::CopyToNats | JournalVerb::CopyFromNats),
        } => {
            let to_nats = matches!(verb, JournalVerb::CopyToNats);
            let journal_dir = config.data_dir.join("journal");
            if to_nats && !journal_dir.exists() {
                return Err(anyhow!("no journal in {}", config.data_dir.display()));
            }
            // A new key would sign as another server than the records it copies.
            if !to_nats && !config.data_dir.join("signing.key").exists() {
                return Err(anyhow!(
                    "no signing.key in {}: copy it from one of the deployment's processes first",
                    config.data_dir.display()
                ));
            }
            let key = spindle_federation::load_or_create_key(&config.data_dir, &config.server_name)
                .map_err(|e| anyhow!(e))?;
            let nats = config.journal.nats.clone();
            let stream = nats.stream.clone();
            let consumers = config.data_dir.join("consumers");
            let memory = config.storage;
            let c = tokio::task::spawn_blocking(move || {
                let copy = if to_nats {
                    spindle_journal::copy::copy_to_stream
                } else {
                    spindle_journal::copy::copy_from_stream
                };
                copy(
                    &journal_dir,
                    &consumers,
                    memory,
                    nats,
                    &key.key_id(),
                    &key.public_key_base64(),
                )
            })
            .await?
            .map_err(|e| anyhow!(e))
            .with_context(|| {
                format!(
                    "copying the journal {} JetStream (is the server stopped?)",
                    if to_nats { "into" } else { "from" }
                )
            })?;
            let (direction, backend) = if to_nats {
                ("into", "nats")
            } else {
                ("from", "embedded")
            };
            println!(
                "copied {} records {direction} stream {stream}; head {}; cursors of {} \
                 consumers; start with [journal] backend = \"{backend}\" now",
                c.records, c.head, c.cursors
            );
        }
        Command::Audit {
            verb:
                Audit::Room {
                    room_id,
                    json,
                    event_type,
                    sender,
                    since_ts,
                    until_ts,
                },
        } => {
            let filter = spindle_projections::audit::RoomFilter {
                event_type,
                sender,
                since_ts,
                until_ts,
            };
            let changes = spindle_replay::audit_room(
                &config.data_dir,
                &config.server_name,
                &room_id,
                &filter,
            )
            .await?;
            if json {
                for c in &changes {
                    out(&format!("{}\n", serde_json::to_string(c)?));
                }
            } else {
                out(&spindle_projections::audit::render_room_text(&changes));
            }
        }
        Command::Audit {
            verb: Audit::User { user_id, json },
        } => {
            let entries =
                spindle_replay::audit_user(&config.data_dir, &config.server_name, &user_id).await?;
            if json {
                for e in &entries {
                    out(&format!("{}\n", serde_json::to_string(e)?));
                }
            } else {
                out(&spindle_projections::audit::render_user_text(&entries));
            }
        }
        Command::Admin {
            verb: Admin::Promote { user_id },
        } => {
            let position =
                spindle_replay::promote_admin(&config.data_dir, &config.server_name, &user_id)
                    .await?;
            println!("{user_id} is a server admin (journal position {position})");
        }
        Command::Backup { out, token, url } => {
            let token = token.or_else(|| std::env::var("SPINDLE_ADMIN_TOKEN").ok());
            match token {
                None => {
                    let m = spindle_replay::backup_offline(
                        &config.data_dir,
                        &config.server_name,
                        &out,
                    )?;
                    println!(
                        "backup of head {} {} in {} ({} files)",
                        m.journal.head,
                        m.journal.head_hash,
                        out.display(),
                        m.files.len()
                    );
                }
                Some(token) => {
                    let base = url.unwrap_or_else(|| local_url(&config));
                    let out = std::path::absolute(&out)?;
                    let body = admin_call(
                        reqwest::Client::new()
                            .post(format!("{base}/_spindle/admin/v1/backup"))
                            .json(&serde_json::json!({ "out": out })),
                        &base,
                        &token,
                    )
                    .await?;
                    println!(
                        "backup of head {} {} in {} ({} files)",
                        body["head"],
                        body["head_hash"],
                        out.display(),
                        body["files"]
                    );
                }
            }
        }
        Command::VerifyBackup { dir } => {
            let m = spindle_replay::backup::verify(&dir)?;
            println!(
                "ok\thead {}\t{}\t{} files",
                m.journal.head,
                m.journal.head_hash,
                m.files.len()
            );
        }
        Command::Storage { data } => {
            use spindle_journal::JournalStore as _;
            let data = data.unwrap_or_else(|| config.data_dir.clone());
            let journal = spindle_replay::open_store(&data)?;
            let head = journal.last_position().map_err(|e| anyhow!(e))?;
            // Not created when missing (a journal whose projections were never built).
            let projections = if data.join("projections").is_dir() {
                spindle_projections::store::ProjectionDb::open(&data.join("projections"))
                    .map_err(|e| anyhow!(e))
                    .context("opening the projections (is the server still running?)")?
                    .disk_use()
                    .map_err(|e| anyhow!(e))?
            } else {
                Vec::new()
            };
            let mut text = String::new();
            let mut totals = Vec::new();
            for (db, rows) in [
                ("journal", journal.disk_use().map_err(|e| anyhow!(e))?),
                ("projections", projections),
            ] {
                for k in &rows {
                    text.push_str(&format!("{db}\t{}\t{}\t{}\n", k.name, k.bytes, k.items));
                }
                totals.push((db, rows.iter().map(|k| k.bytes).sum::<u64>()));
            }
            for (db, bytes) in totals {
                let dir = dir_bytes(&data.join(db));
                text.push_str(&format!("total\t{db}\t{bytes}\t{dir}\n"));
            }
            text.push_str(&format!("records\t{head}\n"));
            out(&text);
        }
        Command::VerifyMedia { data } => {
            let data = data.unwrap_or_else(|| config.data_dir.clone());
            let report = spindle_replay::verify_media(&data)?;
            for b in &report.missing {
                out(&format!(
                    "missing\t{}\t{}\t{}\n",
                    b.position, b.media_id, b.content_hash
                ));
            }
            for b in &report.corrupt {
                out(&format!(
                    "corrupt\t{}\t{}\t{}\t{}\n",
                    b.position,
                    b.media_id,
                    b.content_hash,
                    b.actual.as_deref().unwrap_or("")
                ));
            }
            let summary = format!(
                "{} uploads\t{} blobs checked\t{} missing\t{} corrupt",
                report.uploads,
                report.blobs_checked,
                report.missing.len(),
                report.corrupt.len()
            );
            if !report.ok() {
                return Err(anyhow!("media blobs are missing or corrupt: {summary}"));
            }
            out(&format!("ok\t{summary}\n"));
        }
        Command::Restore { dir, data } => {
            let data = data.unwrap_or_else(|| config.data_dir.clone());
            let m = spindle_replay::backup::restore(&dir, &data)?;
            println!(
                "restored head {} {} into {} ({} files); start the server to rebuild projections",
                m.journal.head,
                m.journal.head_hash,
                data.display(),
                m.files.len()
            );
        }
        Command::Replay {
            verb: Replay::Status { token, url },
        } if token.is_some() || std::env::var("SPINDLE_ADMIN_TOKEN").is_ok() => {
            let token = token
                .or_else(|| std::env::var("SPINDLE_ADMIN_TOKEN").ok())
                .unwrap_or_default();
            let base = url.unwrap_or_else(|| local_url(&config));
            let body = online_status(&base, &token).await?;
            println!("journal head\t{}", body["head"]);
            for p in body["projections"].as_array().into_iter().flatten() {
                let mut line = format!(
                    "{}\t{}\tlag {}",
                    p["name"].as_str().unwrap_or(""),
                    p["checkpoint"],
                    p["lag"],
                );
                if p["ready"] != true {
                    line.push_str("\tbackfilling");
                }
                if let Some(r) = p["rebuilding"].as_object() {
                    line.push_str(&format!(
                        "\trebuilding generation {} at {} (lag {})",
                        r["generation"], r["checkpoint"], r["lag"]
                    ));
                }
                println!("{line}");
            }
        }
        Command::Replay {
            verb: Replay::Status { .. },
        } => {
            let (head, checkpoints) =
                spindle_replay::status(&config.data_dir, &config.server_name).await?;
            println!("journal head\t{head}");
            for (name, cp) in checkpoints {
                println!("{name}\t{cp}\tlag {}", head.saturating_sub(cp));
            }
        }
    }
    Ok(())
}

/// `GET /_spindle/admin/v1/projections` on the running server.
async fn online_status(base: &str, token: &str) -> anyhow::Result<serde_json::Value> {
    admin_call(
        reqwest::Client::new().get(format!("{base}/_spindle/admin/v1/projections")),
        base,
        token,
    )
    .await
}

/// Sends an admin request with `token`; the JSON body of a 2xx answer, else an error
/// naming the status and body.
async fn admin_call(
    req: reqwest::RequestBuilder,
    base: &str,
    token: &str,
) -> anyhow::Result<serde_json::Value> {
    let resp = req
        .bearer_auth(token)
        .send()
        .await
        .with_context(|| format!("asking the server at {base}"))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    if !status.is_success() {
        return Err(anyhow!("the server answered {status}: {body}"));
    }
    Ok(body)
}

/// Starts an online rebuild of `name` on the running server and waits until the new
/// generation is live, logging its progress. Returns (generation, checkpoint).
async fn rebuild_online(base: &str, token: &str, name: &str) -> anyhow::Result<(u64, u64)> {
    let body = admin_call(
        reqwest::Client::new().post(format!(
            "{base}/_spindle/admin/v1/projections/{name}/rebuild"
        )),
        base,
        token,
    )
    .await?;
    let generation = body["generation"].as_u64().unwrap_or(0);
    let mut last_log = std::time::Instant::now();
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let status = online_status(base, token).await?;
        let Some(p) = status["projections"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == name)
        else {
            return Err(anyhow!("the server no longer lists {name:?}"));
        };
        if p["rebuilding"].is_null() {
            if p["generation"].as_u64() == Some(generation) {
                return Ok((generation, p["checkpoint"].as_u64().unwrap_or(0)));
            }
            return Err(anyhow!(
                "the rebuild of {name:?} stopped before generation {generation} went live (see the server log)"
            ));
        }
        if last_log.elapsed() >= std::time::Duration::from_secs(2) {
            last_log = std::time::Instant::now();
            eprintln!(
                "{name}: rebuilding generation {generation}: position {} of {}",
                p["rebuilding"]["checkpoint"], status["head"]
            );
        }
    }
}

/// Writes to stdout; a closed pipe (`spindle audit room … | head`) ends the program
/// quietly instead of panicking.
/// Bytes of the files under `dir` (0 if it does not exist).
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(0);
    }
}

/// The running server's address as seen from this machine: `http://<bind>`, with a
/// wildcard bind replaced by loopback.
fn local_url(config: &Config) -> String {
    let mut addr = config.bind;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    format!("http://{addr}")
}

/// Installs the Ctrl-C (SIGINT) and SIGTERM (what service managers send) handlers
/// at once, and returns a future that resolves on the first of them. (An `async fn`
/// would install nothing until first polled.)
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
