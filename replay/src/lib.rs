//! Rebuilding and verifying projections from the journal (BRIEF §3.2: projections are
//! disposable), and checking the journal itself (the hash chain). The verbs here are
//! offline: they open the data directory themselves, so the server must be stopped
//! (fjall's lock file refuses a second opener).

use std::{path::Path, sync::Arc, time::Duration};

use anyhow::{Context, anyhow};
use spindle_journal::{FjallStore, Journal, JournalStore};
use spindle_projections::Projections;

pub mod backup;
pub mod export;
pub mod media;

/// Opens the journal of a data directory (replaying its room aggregates).
pub fn open_journal(data_dir: &Path, server_name: &str) -> anyhow::Result<Journal> {
    if !data_dir.join("journal").is_dir() {
        return Err(anyhow!(
            "no journal in {} (check data_dir in the config)",
            data_dir.display()
        ));
    }
    if let Ok(stored) = std::fs::read_to_string(data_dir.join("server_name"))
        && stored.trim() != server_name
    {
        return Err(anyhow!(
            "{} belongs to server name {:?}, not {:?}",
            data_dir.display(),
            stored.trim(),
            server_name
        ));
    }
    let key =
        spindle_federation::load_or_create_key(data_dir, server_name).map_err(|e| anyhow!(e))?;
    let store = FjallStore::open(&data_dir.join("journal"))
        .map_err(|e| anyhow!(e))
        .with_context(|| {
            format!(
                "opening the journal in {} (is the server still running?)",
                data_dir.display()
            )
        })?;
    Journal::open(Arc::new(store), Arc::new(key)).map_err(|e| anyhow!(e.to_string()))
}

/// Waits until every projection (backfilling ones included) has applied the
/// journal's head.
pub async fn catch_up(projections: &Projections, journal: &Journal) -> anyhow::Result<()> {
    let head = journal.durable_head();
    // Generous: rebuilding a large journal takes a while; progress is in the log.
    if !projections
        .runtime
        .wait_for_all(head, Duration::from_secs(24 * 3600))
        .await
    {
        return Err(anyhow!("projections did not reach position {head}"));
    }
    Ok(())
}

/// Deletes every projection of `data_dir` and rebuilds them from position 0.
/// Returns each projection's digest.
pub async fn rebuild_all(
    data_dir: &Path,
    server_name: &str,
) -> anyhow::Result<Vec<(&'static str, String)>> {
    let dir = data_dir.join("projections");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let journal = open_journal(data_dir, server_name)?;
    let projections = Projections::start(&dir, journal.clone()).map_err(|e| anyhow!(e))?;
    catch_up(&projections, &journal).await?;
    Ok(projections.runtime.digests())
}

/// Deletes one projection's tables and checkpoint and rebuilds it from position 0
/// (the others resume from their checkpoints). Returns its new digest.
pub async fn rebuild_one(data_dir: &Path, server_name: &str, name: &str) -> anyhow::Result<String> {
    let dir = data_dir.join("projections");
    {
        let db = spindle_projections::ProjectionDb::open(&dir).map_err(|e| anyhow!(e))?;
        let (tables, had_checkpoint) = db.reset_projection(name).map_err(|e| anyhow!(e))?;
        if tables == 0 && !had_checkpoint {
            return Err(anyhow!("no projection named {name:?} in {}", dir.display()));
        }
        tracing::info!(
            projection = name,
            tables,
            "deleted; rebuilding from position 0"
        );
    }
    let journal = open_journal(data_dir, server_name)?;
    let projections = Projections::start(&dir, journal.clone()).map_err(|e| anyhow!(e))?;
    catch_up(&projections, &journal).await?;
    projections
        .runtime
        .digests()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, d)| d)
        .ok_or_else(|| anyhow!("no projection named {name:?}"))
}

/// One projection's live digest next to a fresh rebuild's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    /// Projection name.
    pub projection: &'static str,
    /// Digest of the live tables (after catching up).
    pub live: String,
    /// Digest of a rebuild from position 0 in a scratch directory.
    pub rebuilt: String,
    /// When the digests differ: each table that differs and its differing key range
    /// (`<projection>.(outside)` for what the projection keeps outside its tables).
    pub differences: Vec<spindle_projections::TableDiff>,
}

/// Rebuilds every projection into a scratch directory and compares digests with the
/// live ones (both caught up to the same head); where they differ, compares the two
/// copies table by table and reports each differing table's key range.
pub async fn verify(data_dir: &Path, server_name: &str) -> anyhow::Result<Vec<Verification>> {
    let journal = open_journal(data_dir, server_name)?;
    let live = Projections::start(&data_dir.join("projections"), journal.clone())
        .map_err(|e| anyhow!(e))?;
    catch_up(&live, &journal).await?;
    let scratch = tempfile_dir(data_dir)?;
    let rebuilt = Projections::start(&scratch, journal.clone()).map_err(|e| anyhow!(e))?;
    catch_up(&rebuilt, &journal).await?;
    let out = live
        .runtime
        .digests()
        .into_iter()
        .zip(rebuilt.runtime.digests())
        .map(|((name, live_digest), (_, rebuilt_digest))| Verification {
            projection: name,
            differences: if live_digest == rebuilt_digest {
                Vec::new()
            } else {
                let mut d = spindle_projections::diff_tables(
                    &live.runtime.tables(name),
                    &rebuilt.runtime.tables(name),
                );
                d.extend(spindle_projections::diff_outside(
                    name,
                    &live.runtime.outside_rows(name),
                    &rebuilt.runtime.outside_rows(name),
                ));
                d
            },
            live: live_digest,
            rebuilt: rebuilt_digest,
        })
        .collect();
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(out)
}

fn tempfile_dir(data_dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let dir = data_dir.join(format!("verify-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Each projection's checkpoint and the journal head.
pub async fn status(
    data_dir: &Path,
    server_name: &str,
) -> anyhow::Result<(u64, Vec<(&'static str, u64)>)> {
    let journal = open_journal(data_dir, server_name)?;
    let projections = Projections::start(&data_dir.join("projections"), journal.clone())
        .map_err(|e| anyhow!(e))?;
    Ok((journal.durable_head(), projections.runtime.checkpoints()))
}

/// The result of `spindle journal check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// The verified chain (all of it, or up to the break).
    pub head: spindle_journal::ChainHead,
    /// The first bad position, if any.
    pub broken: Option<spindle_journal::ChainBreak>,
}

/// Verifies the journal of `data_dir`: the hash chain and, when `deep`, every record's
/// own content (event ids, content hashes, signatures, fact payloads). Read-only: a
/// torn tail is reported, not truncated (the server truncates it at start-up).
pub fn journal_check(
    data_dir: &Path,
    server_name: &str,
    deep: bool,
) -> anyhow::Result<CheckReport> {
    let key =
        spindle_federation::load_or_create_key(data_dir, server_name).map_err(|e| anyhow!(e))?;
    let store = open_store(data_dir)?;
    let keys = verify_keys(data_dir, &key)?;
    let walked = spindle_journal::chain::walk(&store, |rec| {
        if deep {
            spindle_journal::chain::deep_check(rec, server_name, &keys)
        } else {
            Ok(())
        }
    });
    Ok(match walked {
        Ok(head) => CheckReport { head, broken: None },
        Err(brk) => CheckReport {
            head: brk.good,
            broken: Some(brk),
        },
    })
}

/// File in the data directory listing earlier public signing keys of this server's
/// events (`<key id> <unpadded base64>` per line); `journal import` writes the
/// exporter's key there so `journal check` can still verify imported events.
pub const VERIFY_KEYS_FILE: &str = "verify_keys";

/// The public keys events in `data_dir` may be signed with: the current key and those
/// in [`VERIFY_KEYS_FILE`].
pub fn verify_keys(
    data_dir: &Path,
    key: &spindle_core::keys::ServerKey,
) -> anyhow::Result<spindle_core::ruma::signatures::PublicKeyMap> {
    let mut map = key.public_key_map();
    let set = map.entry(key.server_name().to_owned()).or_default();
    match std::fs::read_to_string(data_dir.join(VERIFY_KEYS_FILE)) {
        Ok(text) => {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let (id, public) = line
                    .split_once(' ')
                    .ok_or_else(|| anyhow!("{VERIFY_KEYS_FILE}: bad line {line:?}"))?;
                set.insert(
                    id.to_owned(),
                    spindle_core::ruma::serde::Base64::parse(public.trim())
                        .map_err(|e| anyhow!("{VERIFY_KEYS_FILE}: {e}"))?,
                );
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(anyhow!("reading {VERIFY_KEYS_FILE}: {e}")),
    }
    Ok(map)
}

/// Opens the journal store of `data_dir` without replaying it (the format must be current).
pub fn open_store(data_dir: &Path) -> anyhow::Result<FjallStore> {
    let dir = data_dir.join("journal");
    if !dir.is_dir() {
        return Err(anyhow!(
            "no journal in {} (check data_dir in the config)",
            data_dir.display()
        ));
    }
    FjallStore::open(&dir)
        .map_err(|e| anyhow!(e))
        .with_context(|| {
            format!(
                "opening the journal in {} (is the server still running?)",
                data_dir.display()
            )
        })
}

/// Rewrites a format-1 journal in the current format (see
/// [`spindle_journal::migrate::migrate_format1`]).
pub fn journal_migrate(data_dir: &Path) -> anyhow::Result<spindle_journal::migrate::Migration> {
    spindle_journal::migrate::migrate_format1(&data_dir.join("journal")).map_err(|e| anyhow!(e))
}

/// Lower-case hex of a hash.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A journal opened offline with its projections caught up to its head.
pub struct Replayed {
    /// The journal (aggregates restored, chain verified).
    pub journal: Journal,
    /// Every projection, caught up.
    pub projections: Projections,
}

/// Opens `data_dir` offline and brings its projections (in `data_dir/projections`,
/// resuming from their checkpoints) up to the journal's head.
pub async fn replay_offline(data_dir: &Path, server_name: &str) -> anyhow::Result<Replayed> {
    let journal = open_journal(data_dir, server_name)?;
    let projections = Projections::start(&data_dir.join("projections"), journal.clone())
        .map_err(|e| anyhow!(e))?;
    catch_up(&projections, &journal).await?;
    Ok(Replayed {
        journal,
        projections,
    })
}

/// `spindle journal export`: writes the journal of `data_dir` to `out` (via a
/// temporary file renamed into place, so `out` is never half-written).
pub fn export_to_file(
    data_dir: &Path,
    server_name: &str,
    out: &Path,
) -> anyhow::Result<export::ExportHeader> {
    let key =
        spindle_federation::load_or_create_key(data_dir, server_name).map_err(|e| anyhow!(e))?;
    let store = open_store(data_dir)?;
    let tmp = out.with_extension("partial");
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    let header = export::export(
        |after, limit| store.read_after(after, limit).map_err(|e| anyhow!(e)),
        server_name,
        export::SigningKey {
            key_id: key.key_id(),
            public_key: key.public_key_base64(),
        },
        &mut w,
    )?;
    w.into_inner()
        .map_err(|e| anyhow!(e.to_string()))?
        .sync_all()?;
    std::fs::rename(&tmp, out).with_context(|| format!("renaming to {}", out.display()))?;
    Ok(header)
}

/// `spindle audit room`: every state change of `room_id` passing `filter`, from the
/// audit projection caught up to the journal's head.
pub async fn audit_room(
    data_dir: &Path,
    server_name: &str,
    room_id: &str,
    filter: &spindle_projections::audit::RoomFilter,
) -> anyhow::Result<Vec<spindle_projections::audit::StateChange>> {
    let r = replay_offline(data_dir, server_name).await?;
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let (page, next) = r
            .projections
            .audit
            .room_changes(room_id, filter, from, 1000);
        out.extend(page);
        match next {
            Some(n) => from = n,
            None => return Ok(out),
        }
    }
}

/// `spindle audit user`: every audit entry of `user_id`.
pub async fn audit_user(
    data_dir: &Path,
    server_name: &str,
    user_id: &str,
) -> anyhow::Result<Vec<spindle_projections::audit::UserEntry>> {
    let r = replay_offline(data_dir, server_name).await?;
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let (page, next) = r.projections.audit.user_entries(user_id, from, 1000);
        out.extend(page);
        match next {
            Some(n) => from = n,
            None => return Ok(out),
        }
    }
}

/// `spindle admin promote`: appends `AdminPromoted` (principal: the server). The
/// journal refuses an account that does not exist. Returns the fact's position.
pub async fn promote_admin(
    data_dir: &Path,
    server_name: &str,
    user_id: &str,
) -> anyhow::Result<u64> {
    let journal = open_journal(data_dir, server_name)?;
    let envelope = spindle_journal::CommandEnvelope {
        principal: server_name.to_owned(),
        device_id: None,
        issued_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        body: spindle_journal::CommandBody::Fact {
            fact: spindle_journal::Fact::AdminPromoted {
                user_id: user_id.to_owned(),
            },
        },
    };
    let cmd =
        spindle_journal::SignedCommand::sign(journal.key(), envelope).map_err(|e| anyhow!(e))?;
    let outcome = journal
        .submit(cmd)
        .await
        .map_err(|e| anyhow!(e.to_string()))?;
    Ok(outcome.position)
}

/// `spindle backup` with the server stopped: a backup of `data_dir` into `out`.
pub fn backup_offline(
    data_dir: &Path,
    server_name: &str,
    out: &Path,
) -> anyhow::Result<backup::Manifest> {
    let key =
        spindle_federation::load_or_create_key(data_dir, server_name).map_err(|e| anyhow!(e))?;
    let store = open_store(data_dir)?;
    backup::backup_with(
        |after, limit| store.read_after(after, limit).map_err(|e| anyhow!(e)),
        data_dir,
        server_name,
        export::SigningKey {
            key_id: key.key_id(),
            public_key: key.public_key_base64(),
        },
        out,
    )
}

/// `spindle verify-media` (server stopped): checks every `MediaUploaded` fact of the
/// journal of `data_dir` against the blobs in `data_dir/media` ([`media::check`]).
pub fn verify_media(data_dir: &Path) -> anyhow::Result<media::MediaReport> {
    let store = open_store(data_dir)?;
    let mut report = media::MediaReport::default();
    let mut after = 0;
    loop {
        let page = store.read_after(after, 1024).map_err(|e| anyhow!(e))?;
        let Some(last) = page.last() else {
            return Ok(report);
        };
        after = last.position();
        let part = media::check(&page, &data_dir.join("media"))?;
        report.uploads += part.uploads;
        report.blobs_checked += part.blobs_checked;
        report.missing.extend(part.missing);
        report.corrupt.extend(part.corrupt);
    }
}
