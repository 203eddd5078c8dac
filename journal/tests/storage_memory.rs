//! The journal database's memtables stay within `[storage]` (docs/operations.md,
//! "Memory"): with fjall's own defaults (64 MiB memtables, 512 MiB of write-ahead log)
//! every byte written here would still be held in memory.

use spindle_journal::{EncodedRecord, FjallStore, JournalStore, StorageMemory};

/// What the store's memtables hold once they are at most `bound` bytes (polled for at
/// most 30 s: flushes run on the engine's own workers).
fn memtables_settle(store: &FjallStore, bound: u64) -> u64 {
    let held = || {
        store
            .memory_use()
            .expect("fjall reports")
            .write_buffer_bytes
    };
    for _ in 0..300 {
        if held() <= bound {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    held()
}

#[test]
fn memtables_of_the_journal_store_stay_within_the_configured_bound() {
    let dir = tempfile::tempdir().unwrap();
    let memory = StorageMemory {
        memtable_bytes: 1024 * 1024,
        ..StorageMemory::default()
    };
    let store = FjallStore::open_with(dir.path(), memory).unwrap();
    // 24 MiB of 4 KiB values in 96 durable batches. The store keeps bytes, not meaning,
    // so these need not be valid records.
    let mut position = 0u64;
    for _ in 0..96 {
        let batch: Vec<EncodedRecord> = (0..64)
            .map(|i| {
                position += 1;
                EncodedRecord {
                    position,
                    room_id: Some(format!("!r{}:example.org", i % 4)),
                    bytes: vec![(position % 251) as u8; 4096],
                    txn_key: None,
                }
            })
            .collect();
        store.append(&batch).unwrap();
    }
    let held = memtables_settle(&store, 3 * 1024 * 1024);
    assert!(
        held <= 3 * 1024 * 1024,
        "memtables hold {held} bytes after 24 MiB of appends with 1 MiB memtables"
    );
    // Every record is still there, in order, after the flushes.
    let raw = store.read_raw_after(0, 10_000).unwrap();
    assert_eq!(raw.len(), 6144);
    assert_eq!(raw[0], (1, vec![1u8; 4096]));
    assert_eq!(raw[6143], (6144, vec![(6144 % 251) as u8; 4096]));
    assert_eq!(
        store
            .room_positions("!r3:example.org", 0, 10_000)
            .unwrap()
            .len(),
        1536
    );
}
