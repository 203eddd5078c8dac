//! The hash chain: walking the journal and proving it is what was appended.
//!
//! Every record carries the blake3 hash of the previous record's stored bytes
//! ([`crate::record::record_hash`]). [`walk`] reads the whole journal in position order
//! and checks, per record: it decodes (bytecheck), its key and its `position` field
//! agree, positions are contiguous from 1, it is in the current format, and its
//! `prev_hash` is the hash of the record before it. [`deep_check`] adds what only a
//! reader with the server key can check: an event's id is the reference hash of its
//! PDU, its content hash matches and our server's signature verifies; a fact's payload
//! parses. The first failure stops the walk and names its position.
//!
//! What the chain proves and what it does not: altering, removing, inserting or
//! reordering any record breaks the chain at the next record. Altering the *last*
//! record, or cutting the tail, leaves a shorter valid chain; to detect that, keep the
//! head hash somewhere else (`spindle journal check` prints it).

use crate::{
    record::{GENESIS_HASH, RECORD_FORMAT, StoredRecord},
    store::JournalStore,
};

/// Records read per store call during a walk.
const WALK_BATCH: usize = 4096;

/// The end of a verified chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainHead {
    /// Position of the last record (0 for an empty journal).
    pub position: u64,
    /// Hash of the last record ([`GENESIS_HASH`] for an empty journal): the next
    /// record's `prev_hash`.
    pub hash: [u8; 32],
}

impl ChainHead {
    /// The head of an empty journal.
    pub const GENESIS: ChainHead = ChainHead {
        position: 0,
        hash: GENESIS_HASH,
    };
}

/// What is wrong at the first bad position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BreakKind {
    /// The stored bytes do not decode as a record (torn or foreign bytes).
    Unreadable(String),
    /// The key's position, the record's `position` and the expected next position disagree.
    Position {
        /// The position the chain expected.
        expected: u64,
        /// What the record says.
        found: u64,
    },
    /// The record is in another envelope format.
    Format(u16),
    /// `prev_hash` is not the previous record's hash.
    PrevHash,
    /// The record decodes and chains, but its content is not what it claims
    /// (event id, content hash, signature, fact payload).
    Content(String),
    /// The store itself failed to read.
    Storage(String),
}

/// The first bad position of a journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// Position (store key) of the first bad record.
    pub position: u64,
    /// What is wrong with it.
    pub kind: BreakKind,
    /// The verified chain before it.
    pub good: ChainHead,
}

impl std::fmt::Display for ChainBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match &self.kind {
            BreakKind::Unreadable(e) => format!("unreadable record ({e})"),
            BreakKind::Position { expected, found } => {
                format!("expected position {expected}, found {found}")
            }
            BreakKind::Format(v) => format!("record format {v}, expected {RECORD_FORMAT}"),
            BreakKind::PrevHash => "prev_hash is not the previous record's hash".into(),
            BreakKind::Content(e) => format!("content does not verify: {e}"),
            BreakKind::Storage(e) => format!("storage error: {e}"),
        };
        write!(f, "journal broken at position {}: {what}", self.position)
    }
}

/// Walks every record from position 1, checking the chain (see the module doc) and
/// calling `visit` with each good record in order. `visit` may refuse a record
/// (reported as [`BreakKind::Content`]). Returns the head of the verified chain or
/// the first break.
pub fn walk(
    store: &dyn JournalStore,
    visit: impl FnMut(&StoredRecord) -> Result<(), String>,
) -> Result<ChainHead, ChainBreak> {
    walk_from(store, ChainHead::GENESIS, u64::MAX, visit)
}

/// [`walk`] from a checkpoint to `end`: the records after `start.position` up to
/// position `end` included (`u64::MAX`: to the last), the first of which must chain to
/// `start.hash` (the caller has checked that the record at the checkpoint has that
/// hash, see [`crate::snapshot`]).
pub fn walk_from(
    store: &dyn JournalStore,
    start: ChainHead,
    end: u64,
    mut visit: impl FnMut(&StoredRecord) -> Result<(), String>,
) -> Result<ChainHead, ChainBreak> {
    let mut head = start;
    loop {
        if head.position >= end {
            return Ok(head);
        }
        let limit = WALK_BATCH.min(usize::try_from(end - head.position).unwrap_or(WALK_BATCH));
        let batch = store
            .read_raw_after(head.position, limit)
            .map_err(|e| ChainBreak {
                position: head.position + 1,
                kind: BreakKind::Storage(e),
                good: head,
            })?;
        if batch.is_empty() {
            return Ok(head);
        }
        for (key_pos, bytes) in batch {
            let brk = |kind| ChainBreak {
                position: key_pos,
                kind,
                good: head,
            };
            let expected = head.position + 1;
            if key_pos != expected {
                return Err(brk(BreakKind::Position {
                    expected,
                    found: key_pos,
                }));
            }
            let rec =
                StoredRecord::from_bytes(&bytes).map_err(|e| brk(BreakKind::Unreadable(e)))?;
            if rec.position() != key_pos {
                return Err(brk(BreakKind::Position {
                    expected,
                    found: rec.position(),
                }));
            }
            if rec.format() != RECORD_FORMAT {
                return Err(brk(BreakKind::Format(rec.format())));
            }
            if rec.prev_hash() != head.hash {
                return Err(brk(BreakKind::PrevHash));
            }
            visit(&rec).map_err(|e| brk(BreakKind::Content(e)))?;
            head = ChainHead {
                position: key_pos,
                hash: rec.hash(),
            };
        }
    }
}

/// The per-record content check of `spindle journal check`: an event's id is the
/// reference hash of its PDU and, for events sent by `server_name`'s users, the
/// content hash and signature verify with one of `keys` (the server's key and any
/// earlier key its events were signed with, e.g. an imported journal's); a fact's
/// payload parses as a [`crate::Fact`].
pub fn deep_check(
    rec: &StoredRecord,
    server_name: &str,
    keys: &ruma::signatures::PublicKeyMap,
) -> Result<(), String> {
    if !rec.carries_pdu() {
        return serde_json::from_slice::<crate::Fact>(rec.payload())
            .map(|_| ())
            .map_err(|e| format!("fact payload: {e}"));
    }
    let version = rec
        .room_version()
        .ok_or("event record without room version")?;
    let room_id = rec
        .room_id()
        .and_then(|r| ruma::OwnedRoomId::try_from(r).ok());
    let pdu = spindle_core::pdu::Pdu::parse(rec.payload(), version, None, room_id)
        .map_err(|e| format!("PDU: {e}"))?;
    if Some(pdu.event_id.as_str()) != rec.event_id() {
        return Err(format!(
            "event id {:?} is not the PDU's reference hash {}",
            rec.event_id(),
            pdu.event_id
        ));
    }
    if pdu.sender.server_name().as_str() == server_name {
        let rules = spindle_core::room_version::rules(version).ok_or("unknown room version")?;
        let obj = spindle_core::canonical::from_bytes(rec.payload()).map_err(|e| e.to_string())?;
        match ruma::signatures::verify_event(keys, &obj, &rules) {
            Ok(ruma::signatures::Verified::All) => {}
            Ok(ruma::signatures::Verified::Signatures) => {
                return Err("content hash does not match the content".into());
            }
            Err(e) => return Err(format!("signature: {e}")),
        }
    }
    Ok(())
}
