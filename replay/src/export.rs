//! Recorded journals: `spindle journal export` / `import`.
//!
//! An export is a text file, one JSON object per line (JSON Lines), so a recorded
//! journal diffs and reviews like code:
//!
//! ```text
//! {"spindle_journal_export":1,"record_format":2,"server_name":"…","signing_key":{…},"records":N,"head":N,"head_hash":"…"}
//! {"position":1,"prev_hash":"00…","appended_at":…,"kind":"fact","principal":"…",…,"payload":{…}}
//! …
//! ```
//!
//! The header names the export format ([`EXPORT_FORMAT`]), the record format, the
//! server name and public signing key the events were signed with, the record count
//! and the head hash. Each following line is one record, field for field, with the
//! payload embedded verbatim (the PDU's canonical JSON, or the fact's JSON: exactly the
//! stored bytes). Deterministic: the same journal gives the same bytes (fields in a
//! fixed order, no whitespace, hashes in lower-case hex).
//!
//! Import rebuilds each record from its line, re-encodes it and checks the chain as
//! it goes: a line whose `prev_hash` is not the hash of the record rebuilt before it
//! is refused, so an edited export cannot be imported silently. The imported records
//! are bit-for-bit the exported ones (`journal check` prints the same head hash).

use std::{
    io::{BufRead, Write},
    path::Path,
};

use anyhow::{Context, anyhow, bail};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use spindle_journal::{
    ChainHead, EncodedRecord, FjallStore, GENESIS_HASH, JournalStore, RECORD_FORMAT, Record,
    RecordKind, StoredRecord, record_hash,
};

use crate::hex;

/// Version of the export file layout. Bump on any change to the header or line shape.
pub const EXPORT_FORMAT: u32 = 1;

/// Records imported per write batch.
const IMPORT_BATCH: usize = 1024;

/// The first line of an export.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ExportHeader {
    /// [`EXPORT_FORMAT`].
    pub spindle_journal_export: u32,
    /// The journal record format of the records ([`RECORD_FORMAT`]).
    pub record_format: u16,
    /// The server name of the exporting server (user and room ids carry it).
    pub server_name: String,
    /// The exporting server's public signing key: `{"key_id": "ed25519:…", "public_key": base64}`.
    pub signing_key: SigningKey,
    /// Number of records.
    pub records: u64,
    /// Position of the last record.
    pub head: u64,
    /// Hash of the last record (hex; zeros for an empty journal).
    pub head_hash: String,
}

/// A public signing key, as in the header.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SigningKey {
    /// `ed25519:<version>`.
    pub key_id: String,
    /// Unpadded base64.
    pub public_key: String,
}

/// One record line (field order is the file's field order).
#[derive(Serialize, Deserialize)]
struct Line<'a> {
    position: u64,
    prev_hash: String,
    appended_at: u64,
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    room_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    event_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    room_version: Option<String>,
    principal: String,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    device_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    txn_id: Option<String>,
    command_signature: String,
    #[serde(borrow)]
    payload: &'a RawValue,
}

fn unhex(s: &str) -> anyhow::Result<[u8; 32]> {
    if s.len() != 64 {
        bail!("hash {s:?} is not 64 hex digits");
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b =
            u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| anyhow!("hash {s:?}: {e}"))?;
    }
    Ok(out)
}

/// Writes an export of `records` (every record from position 1, in order) to `out`.
/// `read` is called with (after, limit) until it returns nothing. Returns the header.
pub fn export(
    mut read: impl FnMut(u64, usize) -> anyhow::Result<Vec<StoredRecord>>,
    server_name: &str,
    signing_key: SigningKey,
    out: &mut dyn Write,
) -> anyhow::Result<ExportHeader> {
    // Two passes: the header needs the count and head hash; the second pass writes.
    // (Both read the same durable prefix: `read` never returns past the head it saw.)
    let mut head = ChainHead {
        position: 0,
        hash: GENESIS_HASH,
    };
    loop {
        let batch = read(head.position, 4096)?;
        if batch.is_empty() {
            break;
        }
        for r in batch {
            if r.position() != head.position + 1 || r.prev_hash() != head.hash {
                bail!(
                    "the journal's chain breaks at position {}; run `spindle journal check`",
                    r.position()
                );
            }
            head = ChainHead {
                position: r.position(),
                hash: r.hash(),
            };
        }
    }
    let header = ExportHeader {
        spindle_journal_export: EXPORT_FORMAT,
        record_format: RECORD_FORMAT,
        server_name: server_name.to_owned(),
        signing_key,
        records: head.position,
        head: head.position,
        head_hash: hex(&head.hash),
    };
    serde_json::to_writer(&mut *out, &header)?;
    out.write_all(b"\n")?;
    let mut after = 0;
    while after < head.position {
        let batch = read(after, 4096.min((head.position - after) as usize))?;
        if batch.is_empty() {
            bail!(
                "the journal ended at {after} while exporting up to {}",
                head.position
            );
        }
        for r in batch {
            let payload: &RawValue = serde_json::from_slice(r.payload())
                .with_context(|| format!("record {}: payload is not JSON", r.position()))?;
            let line = Line {
                position: r.position(),
                prev_hash: hex(&r.prev_hash()),
                appended_at: r.appended_at(),
                kind: if r.is_event() {
                    "event"
                } else if r.is_outlier() {
                    "outlier"
                } else if r.is_state_resolved() {
                    "state_resolved"
                } else if r.is_backfilled() {
                    "backfilled"
                } else if r.is_soft_failed() {
                    "soft_failed"
                } else {
                    "fact"
                },
                room_id: r.room_id().map(str::to_owned),
                event_id: r.event_id().map(str::to_owned),
                room_version: r.room_version().map(str::to_owned),
                principal: r.principal().to_owned(),
                device_id: r.device_id().map(str::to_owned),
                txn_id: r.txn_id().map(str::to_owned),
                command_signature: r.command_signature().to_owned(),
                payload,
            };
            serde_json::to_writer(&mut *out, &line)?;
            out.write_all(b"\n")?;
            after = r.position();
        }
    }
    out.flush()?;
    Ok(header)
}

/// Reads an export and returns its header and records, each re-encoded and checked
/// against the chain (see the module doc).
pub fn read_export(input: impl BufRead) -> anyhow::Result<(ExportHeader, Vec<EncodedRecord>)> {
    let mut lines = input.lines();
    let first = lines.next().ok_or_else(|| anyhow!("empty export"))??;
    let header: ExportHeader =
        serde_json::from_str(&first).context("the first line is not an export header")?;
    if header.spindle_journal_export != EXPORT_FORMAT {
        bail!(
            "export format {} (this release reads {EXPORT_FORMAT})",
            header.spindle_journal_export
        );
    }
    if header.record_format != RECORD_FORMAT {
        bail!(
            "export of record format {} (this release reads {RECORD_FORMAT}; migrate the source journal first)",
            header.record_format
        );
    }
    let mut head = ChainHead {
        position: 0,
        hash: GENESIS_HASH,
    };
    let mut out = Vec::new();
    for (n, line) in lines.enumerate() {
        let line = line?;
        let at = || format!("line {}", n + 2);
        let l: Line = serde_json::from_str(&line).with_context(at)?;
        if l.position != head.position + 1 {
            bail!("{}: position {} after {}", at(), l.position, head.position);
        }
        if unhex(&l.prev_hash).with_context(at)? != head.hash {
            bail!(
                "{}: prev_hash does not match the record before it (edited export?)",
                at()
            );
        }
        let kind = match l.kind {
            "event" => RecordKind::Event,
            "fact" => RecordKind::Fact,
            "outlier" => RecordKind::Outlier,
            "state_resolved" => RecordKind::StateResolved,
            "backfilled" => RecordKind::Backfilled,
            "soft_failed" => RecordKind::SoftFailed,
            other => bail!("{}: unknown kind {other:?}", at()),
        };
        let rec = Record {
            format: RECORD_FORMAT,
            position: l.position,
            prev_hash: head.hash,
            appended_at: l.appended_at,
            kind,
            room_id: l.room_id,
            event_id: l.event_id,
            room_version: l.room_version,
            principal: l.principal,
            device_id: l.device_id,
            txn_id: l.txn_id,
            command_signature: l.command_signature,
            payload: l.payload.get().as_bytes().to_vec(),
        };
        let bytes = rec.encode();
        head = ChainHead {
            position: rec.position,
            hash: record_hash(&bytes),
        };
        // The first start replays an imported journal (no snapshot), which writes its
        // transaction index (journal::txn).
        out.push(EncodedRecord {
            position: rec.position,
            room_id: rec.room_id,
            bytes,
            txn_key: None,
        });
    }
    if head.position != header.head || hex(&head.hash) != header.head_hash {
        bail!(
            "the export ends at {} ({}), its header says {} ({}): truncated or edited",
            head.position,
            hex(&head.hash),
            header.head,
            header.head_hash
        );
    }
    Ok((header, out))
}

/// Imports an export into `data_dir`, which must have no journal yet (a fresh
/// directory). Records the export's server name in `<data>/server_name`.
pub fn import(file: &Path, data_dir: &Path) -> anyhow::Result<ExportHeader> {
    let input = std::io::BufReader::new(
        std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?,
    );
    let (header, records) =
        read_export(input).with_context(|| format!("reading {}", file.display()))?;
    let journal_dir = data_dir.join("journal");
    if journal_dir.exists() {
        bail!(
            "{} already has a journal; import only into a fresh data directory",
            data_dir.display()
        );
    }
    let name_file = data_dir.join("server_name");
    match std::fs::read_to_string(&name_file) {
        Ok(s) if s.trim() != header.server_name => bail!(
            "{} belongs to server name {:?}, the export to {:?}",
            data_dir.display(),
            s.trim(),
            header.server_name
        ),
        Ok(_) => {}
        Err(_) => {
            std::fs::create_dir_all(data_dir)?;
            std::fs::write(&name_file, format!("{}\n", header.server_name))?;
        }
    }
    std::fs::write(
        data_dir.join(crate::VERIFY_KEYS_FILE),
        format!(
            "{} {}\n",
            header.signing_key.key_id, header.signing_key.public_key
        ),
    )?;
    let store = FjallStore::open(&journal_dir).map_err(|e| anyhow!(e))?;
    for chunk in records.chunks(IMPORT_BATCH) {
        store.append(chunk).map_err(|e| anyhow!(e))?;
    }
    Ok(header)
}
