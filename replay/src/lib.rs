//! Rebuilding and verifying projections from the journal (BRIEF §3.2: projections are
//! disposable), and checking the journal itself (the hash chain). The verbs here are
//! offline: they open the data directory themselves, so the server must be stopped
//! (fjall's lock file refuses a second opener).

use std::{path::Path, sync::Arc, time::Duration};

use anyhow::{Context, anyhow};
use spindle_journal::{FjallStore, Journal};
use spindle_projections::Projections;

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

/// Waits until every projection has applied the journal's head.
pub async fn catch_up(projections: &Projections, journal: &Journal) -> anyhow::Result<()> {
    let head = journal.durable_head();
    // Generous: rebuilding a large journal takes a while; progress is in the log.
    if !projections
        .runtime
        .wait_for(head, Duration::from_secs(24 * 3600))
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

/// One projection's live digest next to a fresh rebuild's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    /// Projection name.
    pub projection: &'static str,
    /// Digest of the live tables (after catching up).
    pub live: String,
    /// Digest of a rebuild from position 0 in a scratch directory.
    pub rebuilt: String,
}

/// Rebuilds every projection into a scratch directory and compares digests with the
/// live ones (both caught up to the same head).
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
        .map(|((name, live), (_, rebuilt))| Verification {
            projection: name,
            live,
            rebuilt,
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
    let walked = spindle_journal::chain::walk(&store, |rec| {
        if deep {
            spindle_journal::chain::deep_check(rec, &key)
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
