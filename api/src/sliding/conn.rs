//! Per-connection state of Simplified Sliding Sync: what each connection (user,
//! device, `conn_id`) has been sent, as of each `pos` the server handed out.
//!
//! In memory only: after a restart every `pos` is unknown and the client is told
//! `M_UNKNOWN_POS` (MSC4186: a server may expire connections at any time), which makes
//! it start a new connection. A `pos` names one [`Snapshot`]; a request with `pos` P
//! starts from P's snapshot, and (MSC4186 "Connections") once P is seen every snapshot
//! older than P is dropped; P itself is kept so that a retried request works.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

use parking_lot::Mutex;

use super::request::RequiredState;

/// Most connections kept per (user, device); the least recently used goes first.
pub const MAX_CONNECTIONS_PER_DEVICE: usize = 10;
/// Most snapshots kept per connection (the acknowledged one plus unacknowledged
/// answers to retried requests).
pub const MAX_SNAPSHOTS_PER_CONNECTION: usize = 4;

/// What the client has been sent for one room.
#[derive(Debug, Clone, Default)]
pub struct RoomSent {
    /// Timeline and state were sent up to this journal position.
    pub upto: u64,
    /// The user's membership when it was sent.
    pub membership: String,
    /// Largest `timeline_limit` the room was sent with.
    pub timeline_limit: usize,
    /// Union of the `required_state` the room was sent with.
    pub required_state: RequiredState,
    /// Members sent because of `$LAZY` (not sent again).
    pub lazy_sent: BTreeSet<String>,
    /// Last values sent (a changed one is sent again).
    pub fields: RoomFields,
}

/// The room fields compared between responses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoomFields {
    /// `name`.
    pub name: Option<String>,
    /// `avatar`.
    pub avatar: Option<String>,
    /// `heroes` (user ids).
    pub heroes: Vec<String>,
    /// `joined_count`, `invited_count`.
    pub counts: (u64, u64),
    /// `notification_count`, `highlight_count`.
    pub unread: (u64, u64),
    /// `bump_stamp`.
    pub bump_stamp: u64,
    /// `is_dm`.
    pub is_dm: bool,
}

/// Everything one connection has been sent, as of one `pos`.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Journal position the response was built at.
    pub upto: u64,
    /// Typing counter when the response was built.
    pub typing: u64,
    /// Rooms sent so far.
    pub rooms: HashMap<String, RoomSent>,
    /// Extensions that were enabled.
    pub extensions: BTreeSet<&'static str>,
    /// List counts sent.
    pub lists: BTreeMap<String, u64>,
    /// The `m.direct` rooms the `is_dm` flags were computed from.
    pub dm_rooms: BTreeSet<String>,
}

struct Conn {
    snapshots: Vec<(u64, Arc<Snapshot>)>,
    /// Tick of the last use (from the same counter as positions).
    used: u64,
}

/// Every live connection, in memory: at most `max` over all devices (the least
/// recently used forgotten first), each device at most [`MAX_CONNECTIONS_PER_DEVICE`],
/// each connection at most [`MAX_SNAPSHOTS_PER_CONNECTION`] snapshots.
pub struct Connections {
    /// Tells this process's `pos` tokens from an earlier process's.
    boot: u64,
    next: std::sync::atomic::AtomicU64,
    by_device: Mutex<Devices>,
    /// Connections kept at most (config `caches.sliding_sync_connections`).
    max: usize,
    /// Room types (`m.room.create` `type`), which never change: room -> type.
    pub(crate) room_types: Mutex<HashMap<String, Option<String>>>,
    /// Entries of `room_types` at most (config `caches.sliding_sync_room_types`).
    pub(crate) room_types_max: usize,
}

#[derive(Default)]
struct Devices {
    map: HashMap<(String, String), HashMap<String, Conn>>,
    /// Connections over all devices.
    count: usize,
}

impl Default for Connections {
    fn default() -> Self {
        let d = crate::CacheLimits::default();
        Connections::with_limits(d.sliding_sync_connections, d.sliding_sync_room_types)
    }
}

impl Connections {
    /// No connection yet; at most `max_connections` connections and `max_room_types`
    /// cached room types (each at least 1).
    pub fn with_limits(max_connections: usize, max_room_types: usize) -> Connections {
        Connections {
            boot: rand::random::<u32>() as u64,
            next: std::sync::atomic::AtomicU64::new(1),
            by_device: Mutex::default(),
            max: max_connections.max(1),
            room_types: Mutex::default(),
            room_types_max: max_room_types.max(1),
        }
    }

    /// Connections kept now, over all devices.
    pub fn len(&self) -> usize {
        self.by_device.lock().count
    }

    /// Whether no connection is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn parse_pos(&self, pos: &str) -> Option<u64> {
        let (boot, n) = pos.split_once('_')?;
        (u64::from_str_radix(boot, 16).ok()? == self.boot)
            .then(|| n.parse().ok())
            .flatten()
    }

    /// The snapshot a `pos` names on this connection; `None` if unknown (expired,
    /// from before a restart, or from another connection).
    pub fn resume(
        &self,
        user: &str,
        device: &str,
        conn_id: &str,
        pos: &str,
    ) -> Option<Arc<Snapshot>> {
        let n = self.parse_pos(pos)?;
        let mut all = self.by_device.lock();
        let conn = all
            .map
            .get_mut(&(user.to_owned(), device.to_owned()))?
            .get_mut(conn_id)?;
        conn.used = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        conn.snapshots
            .iter()
            .find(|(p, _)| *p == n)
            .map(|(_, s)| s.clone())
    }

    /// Forgets a connection (a request without `pos` starts it over).
    pub fn reset(&self, user: &str, device: &str, conn_id: &str) {
        let mut all = self.by_device.lock();
        let key = (user.to_owned(), device.to_owned());
        if let Some(conns) = all.map.get_mut(&key)
            && conns.remove(conn_id).is_some()
        {
            let empty = conns.is_empty();
            all.count -= 1;
            if empty {
                all.map.remove(&key);
            }
        }
    }

    /// Forgets the least recently used connection of all (a scan of every connection:
    /// only when a new one arrives at the bound).
    fn evict_least_recent(all: &mut Devices) {
        let oldest = all
            .map
            .iter()
            .flat_map(|(dev, conns)| conns.iter().map(move |(id, c)| (c.used, dev, id)))
            .min_by_key(|(used, _, _)| *used)
            .map(|(_, dev, id)| (dev.clone(), id.clone()));
        if let Some((dev, id)) = oldest
            && let Some(conns) = all.map.get_mut(&dev)
        {
            conns.remove(&id);
            all.count -= 1;
            if conns.is_empty() {
                all.map.remove(&dev);
            }
        }
    }

    /// Records the snapshot answered to a request that carried `acknowledged` (the
    /// `pos` it resumed from, if any) and returns its new `pos`.
    pub fn record(
        &self,
        user: &str,
        device: &str,
        conn_id: &str,
        acknowledged: Option<&str>,
        snapshot: Snapshot,
    ) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let acked = acknowledged.and_then(|p| self.parse_pos(p));
        let mut guard = self.by_device.lock();
        let all = &mut *guard;
        let key = (user.to_owned(), device.to_owned());
        let known = all.map.get(&key).is_some_and(|c| c.contains_key(conn_id));
        if !known {
            let per_device = all.map.get(&key).map_or(0, |c| c.len());
            if per_device >= MAX_CONNECTIONS_PER_DEVICE {
                let conns = all.map.get_mut(&key).expect("device has connections");
                let oldest = conns
                    .iter()
                    .min_by_key(|(_, c)| c.used)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    conns.remove(&k);
                    all.count -= 1;
                }
            } else if all.count >= self.max {
                Self::evict_least_recent(all);
            }
            all.count += 1;
        }
        let conns = all.map.entry(key).or_default();
        let conn = conns.entry(conn_id.to_owned()).or_insert_with(|| Conn {
            snapshots: Vec::new(),
            used: n,
        });
        conn.used = n;
        if let Some(a) = acked {
            conn.snapshots.retain(|(p, _)| *p >= a);
        }
        conn.snapshots.push((n, Arc::new(snapshot)));
        while conn.snapshots.len() > MAX_SNAPSHOTS_PER_CONNECTION {
            conn.snapshots.remove(0);
        }
        format!("{:x}_{n}", self.boot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pos_resumes_until_a_newer_pos_is_acknowledged() {
        let c = Connections::default();
        let p1 = c.record("@u:x", "D", "", None, Snapshot::default());
        assert!(c.resume("@u:x", "D", "", &p1).is_some());
        // Another device or connection id does not know it.
        assert!(c.resume("@u:x", "E", "", &p1).is_none());
        assert!(c.resume("@u:x", "D", "other", &p1).is_none());
        let p2 = c.record("@u:x", "D", "", Some(&p1), Snapshot::default());
        // A retry with p1 still works until p2 is used.
        assert!(c.resume("@u:x", "D", "", &p1).is_some());
        let _p3 = c.record("@u:x", "D", "", Some(&p2), Snapshot::default());
        assert!(c.resume("@u:x", "D", "", &p1).is_none());
        assert!(c.resume("@u:x", "D", "", &p2).is_some());
        // A pos from another process (other boot id) is unknown.
        assert!(c.resume("@u:x", "D", "", "ffffffffff_2").is_none());
        c.reset("@u:x", "D", "");
        assert!(c.resume("@u:x", "D", "", &p2).is_none());
    }

    #[test]
    fn connections_per_device_are_bounded() {
        let c = Connections::default();
        let first = c.record("@u:x", "D", "c0", None, Snapshot::default());
        for i in 1..=MAX_CONNECTIONS_PER_DEVICE {
            c.record("@u:x", "D", &format!("c{i}"), None, Snapshot::default());
        }
        assert!(c.resume("@u:x", "D", "c0", &first).is_none());
        assert_eq!(c.len(), MAX_CONNECTIONS_PER_DEVICE);
    }

    #[test]
    fn connections_over_all_devices_are_bounded_least_recently_used_first() {
        let c = Connections::with_limits(3, 10);
        let p0 = c.record("@a:x", "D", "", None, Snapshot::default());
        let p1 = c.record("@b:x", "D", "", None, Snapshot::default());
        let p2 = c.record("@c:x", "D", "", None, Snapshot::default());
        // @a's connection is used again: @b's is now the least recently used.
        assert!(c.resume("@a:x", "D", "", &p0).is_some());
        let p3 = c.record("@d:x", "D", "", None, Snapshot::default());
        assert_eq!(c.len(), 3);
        assert!(c.resume("@b:x", "D", "", &p1).is_none());
        for (u, p) in [("@a:x", &p0), ("@c:x", &p2), ("@d:x", &p3)] {
            assert!(c.resume(u, "D", "", p).is_some(), "{u}");
        }
        // A new snapshot of a known connection evicts nothing.
        c.record("@a:x", "D", "", Some(&p0), Snapshot::default());
        assert_eq!(c.len(), 3);
        // 100 more devices: still 3, the 3 most recent.
        let mut last = Vec::new();
        for i in 0..100 {
            last.push(c.record(&format!("@n{i}:x"), "D", "", None, Snapshot::default()));
        }
        assert_eq!(c.len(), 3);
        assert_eq!(c.by_device.lock().map.len(), 3);
        assert!(c.resume("@n97:x", "D", "", &last[97]).is_some());
        assert!(c.resume("@n96:x", "D", "", &last[96]).is_none());
        c.reset("@n97:x", "D", "");
        assert_eq!(c.len(), 2);
    }
}
