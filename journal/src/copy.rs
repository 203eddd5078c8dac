//! Copying a journal between the embedded store and a JetStream stream
//! (`spindle journal copy-to-nats` and `copy-from-nats`, SPEC §6, docs/scale-out.md).
//!
//! The JetStream backend's local mirror has the embedded journal's format and the
//! stream's sequence is the journal position, so a copy moves bytes, never re-encodes:
//! - **to the stream**: the embedded journal's records after the stream's head are
//!   published in order, fenced as every append is (`Nats-Expected-Last-Sequence`), with
//!   their transaction keys; the journal's directory then serves as the process's
//!   mirror. A stream that already holds records must hold exactly this journal's first
//!   ones (checked by hash at its head), so an interrupted copy resumes.
//! - **from the stream**: the mirror catches up with every record the stream has (as at
//!   every start) and is fsynced; the embedded backend then serves it.
//!
//! The outbound consumers' cursors go with the records (`<data_dir>/consumers/*.json`
//! to and from the stream `<stream>_cursors`), so federation, push and application
//! services resume where they stopped instead of starting over. Both directions need
//! the process stopped: the journal directory is locked by a running one.

use std::path::Path;

use crate::{
    consumer,
    nats::{NatsOptions, NatsStore},
    record::StoredRecord,
    store::{EncodedRecord, JournalStore, StorageMemory},
};

/// Records published per batch while copying to the stream.
const COPY_BATCH: usize = 512;

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCopy {
    /// Records copied (0 when the destination already had them all).
    pub records: u64,
    /// The journal's head position afterwards, the same on both sides.
    pub head: u64,
    /// Consumers whose cursors were copied.
    pub cursors: usize,
}

/// Publishes the embedded journal in `journal_dir` into the stream of `options` and
/// the cursor files of `consumers_dir` into its cursor stream; records the signing key
/// (`key_id`, `public` base64) as the deployment's, refusing a stream whose processes
/// sign with another. Errors, leaving the stream a prefix of the journal, if NATS is
/// unreachable, if the stream holds records this journal does not, or if it refuses
/// an append (a process is writing into it). Cursors the stream already has are kept
/// (a process that ran on the stream has newer ones); `cursors` counts those copied.
pub fn copy_to_stream(
    journal_dir: &Path,
    consumers_dir: &Path,
    memory: StorageMemory,
    options: NatsOptions,
    key_id: &str,
    public: &str,
) -> Result<StreamCopy, String> {
    let store = NatsStore::connect(journal_dir, memory, options)?;
    let local_head = store.local().last_position()?;
    let stream = store.options().stream.clone();
    let head = store.stream_head()?;
    if head > local_head {
        return Err(format!(
            "stream {stream} holds {head} records, this journal {local_head}: it is not a \
             copy of this journal; use a new stream name"
        ));
    }
    if head > 0 && !store.same_record_at(head)? {
        return Err(format!(
            "stream {stream}'s record {head} is not this journal's: it holds another \
             journal; use a new stream name"
        ));
    }
    store.check_signing_key(key_id, public)?;
    let mut txn_keys = store.local().txn_keys_after(head)?;
    let mut at = head;
    loop {
        let batch = store.local().read_raw_after(at, COPY_BATCH)?;
        let Some(&(last, _)) = batch.last() else {
            break;
        };
        let records = batch
            .into_iter()
            .map(|(position, bytes)| {
                let rec = StoredRecord::from_bytes(&bytes)
                    .map_err(|e| format!("record {position}: {e}"))?;
                Ok(EncodedRecord {
                    position,
                    room_id: rec.room_id().map(str::to_owned),
                    txn_key: txn_keys.remove(&position),
                    bytes,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        store.publish(&records)?;
        at = last;
    }
    // Only cursors the stream does not have yet: once a process ran on the stream its
    // cursors there are newer than these files (which nothing updates any more), and
    // putting the files back would send federation, push and application services'
    // work again from an old position.
    let mut cursors = 0;
    for (name, bytes) in consumer::read_cursor_files(consumers_dir)? {
        if store.cursor_get(&name)?.is_none() {
            store.cursor_put(&name, bytes)?;
            cursors += 1;
        }
    }
    Ok(StreamCopy {
        records: at - head,
        head: at,
        cursors,
    })
}

/// Copies every record of the stream of `options` that the journal in `journal_dir`
/// lacks into it (creating the journal if missing; a missing or empty stream is an
/// error, never created), fsyncs it, and writes the cursor stream's
/// cursors as files in `consumers_dir`. Errors if the local journal holds records the
/// stream does not (another stream's data directory), if the deployment signs with
/// another key than (`key_id`, `public`), or if NATS is unreachable.
pub fn copy_from_stream(
    journal_dir: &Path,
    consumers_dir: &Path,
    memory: StorageMemory,
    options: NatsOptions,
    key_id: &str,
    public: &str,
) -> Result<StreamCopy, String> {
    let store = NatsStore::connect_existing(journal_dir, memory, options)?;
    if store.stream_head()? == 0 {
        return Err(format!(
            "stream {} is empty: nothing to copy (check journal.nats.stream)",
            store.options().stream
        ));
    }
    store.check_signing_key(key_id, public)?;
    let before = store.local().last_position()?;
    store.catch_up()?;
    store.local().sync()?;
    let head = store.local().last_position()?;
    let consumers = store.cursor_consumers()?;
    for name in &consumers {
        if let Some(bytes) = store.cursor_get(name)? {
            consumer::write_cursor_file(consumers_dir, name, &bytes)?;
        }
    }
    Ok(StreamCopy {
        records: head - before,
        head,
        cursors: consumers.len(),
    })
}
