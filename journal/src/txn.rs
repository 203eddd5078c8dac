//! Client transaction ids: idempotent sends without memory that grows with history.
//!
//! The spec asks a server to answer a retried `PUT .../send/{eventType}/{txnId}` (and
//! `PUT /sendToDevice/{eventType}/{txnId}`) with the first answer instead of sending
//! again. Synapse keeps the ids in a 30-minute cache and, for room events, in the
//! `event_txn_id` table for 24 hours; a retry after that sends a second event.
//!
//! Here the truth is on disk and never expires: the store keeps an index
//! ([`crate::JournalStore::txn_position`]) from a transaction key to the position of
//! the record it produced, written in the same atomic batch as the record itself, so
//! a key is on disk exactly when its record is. A retry at any age finds its record
//! (one index read, one record read) and gets the same event id. Memory holds only a
//! bounded hot set ([`TxnCache`], config `journal.txn_ids_cached`) of the most recent
//! keys: retries come soon after the send, and a key must be visible between the
//! moment its record is queued and the moment the batch holding it is durable (the
//! index does not have it yet). Eviction is oldest-inserted first.
//!
//! Keys: a room event's key is (room, user, device, txn id), as Synapse scopes it (the
//! same txn id in another room is another send); a to-device send's is (user, device,
//! txn id). Each part is length-prefixed (a txn id may hold any byte).
//!
//! The write-model snapshot holds no txn ids (before snapshot format 3 it held every
//! one, which made start-up memory grow with history); replaying records at start-up
//! rewrites their index entries, which is how a journal written before the index
//! gets one (the format bump makes its first start replay everything).

use std::collections::{HashMap, VecDeque};

use ruma::OwnedEventId;

/// Default of `journal.txn_ids_cached`: the hot set's size.
pub const DEFAULT_TXN_IDS_CACHED: usize = 10_000;

/// Smallest hot set accepted: it must hold every key queued but not yet durable.
pub const MIN_TXN_IDS_CACHED: usize = 1_024;

fn put(out: &mut Vec<u8>, part: &str) {
    let len = u16::try_from(part.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&part.as_bytes()[..len as usize]);
}

/// The index key of a room event sent with a txn id.
pub fn event_key(room_id: &str, user: &str, device: &str, txn_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(9 + room_id.len() + user.len() + device.len() + txn_id.len());
    k.push(b'e');
    for p in [room_id, user, device, txn_id] {
        put(&mut k, p);
    }
    k
}

/// The index key of a to-device send.
pub fn to_device_key(user: &str, device: &str, txn_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(7 + user.len() + device.len() + txn_id.len());
    k.push(b'd');
    for p in [user, device, txn_id] {
        put(&mut k, p);
    }
    k
}

/// What a send with a txn id produced: its position and, for a room event, its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnHit {
    /// Position of the record.
    pub position: u64,
    /// The event id (room events only).
    pub event_id: Option<OwnedEventId>,
}

/// The bounded hot set: at most `max` keys, the oldest inserted evicted first.
#[derive(Debug)]
pub struct TxnCache {
    max: usize,
    map: HashMap<Vec<u8>, TxnHit>,
    order: VecDeque<Vec<u8>>,
}

impl TxnCache {
    /// An empty hot set of at most `max` keys (raised to [`MIN_TXN_IDS_CACHED`]).
    pub fn new(max: usize) -> TxnCache {
        TxnCache {
            max: max.max(MIN_TXN_IDS_CACHED),
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// The hit for `key`, if the hot set holds it.
    pub fn get(&self, key: &[u8]) -> Option<&TxnHit> {
        self.map.get(key)
    }

    /// Keeps `key` (evicting the oldest keys past the bound).
    pub fn insert(&mut self, key: Vec<u8>, hit: TxnHit) {
        if self.map.insert(key.clone(), hit).is_none() {
            self.order.push_back(key);
        }
        while self.map.len() > self.max {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.map.remove(&old);
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hot_set_keeps_its_bound_evicting_the_oldest() {
        let mut c = TxnCache::new(0);
        assert_eq!(c.max(), MIN_TXN_IDS_CACHED);
        let n = MIN_TXN_IDS_CACHED + 10;
        for i in 0..n {
            c.insert(
                to_device_key("@u:x", "D", &i.to_string()),
                TxnHit {
                    position: i as u64,
                    event_id: None,
                },
            );
        }
        assert_eq!(c.len(), MIN_TXN_IDS_CACHED);
        // The ten oldest are gone, the eleventh is the oldest kept.
        for i in 0..10 {
            assert!(c.get(&to_device_key("@u:x", "D", &i.to_string())).is_none());
        }
        assert_eq!(
            c.get(&to_device_key("@u:x", "D", "10")).map(|h| h.position),
            Some(10)
        );
        // Re-inserting a held key does not grow the set or reorder it.
        c.insert(
            to_device_key("@u:x", "D", "10"),
            TxnHit {
                position: 10,
                event_id: None,
            },
        );
        assert_eq!(c.len(), MIN_TXN_IDS_CACHED);
    }

    #[test]
    fn keys_are_unambiguous() {
        // Length prefixes: moving a byte between parts gives another key.
        assert_ne!(
            event_key("!a", "b", "c", "d"),
            event_key("!", "ab", "c", "d")
        );
        assert_ne!(
            event_key("!r", "@u", "D", "t"),
            to_device_key("@u", "D", "t")
        );
        // A txn id with a NUL byte is its own key.
        assert_ne!(
            to_device_key("@u", "D", "a\0b"),
            to_device_key("@u", "D", "a")
        );
    }
}
