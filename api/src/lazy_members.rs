//! Which member events each lazy-loading device was sent, so an incremental `/sync`
//! sends a timeline sender's membership once and not in every response (spec:
//! "Lazy-loading room members": a server "MAY" leave out members it already sent,
//! unless `include_redundant_members`). Synapse keeps the same per-device record in
//! memory (`LazyLoadedMembersCache`); this follows its rules.
//!
//! An entry `(room, member) -> sent_at` says: the response whose `next_batch` position
//! is `sent_at` gave this device the member's membership (in `state` or in the
//! timeline). From then on the device holds that member's current membership as long
//! as it keeps syncing from each `next_batch`, because every later change of it reaches
//! the device through the timeline or, after a gap (`limited`), through the `state`
//! delta, which always carries member changes. So a request from `since` may leave out
//! a sender whose entry is at or before `since`, with no store read at all.
//!
//! Invariants:
//! - An entry recorded after `since` is forgotten when a request from `since` starts:
//!   the response that carried it was lost (a timed-out request retried, a client
//!   resuming from an older saved token), as in Synapse's `start_request`.
//! - An initial sync forgets the device's entries.
//! - Memory only and bounded: [`PER_DEVICE_MAX`] entries per device and
//!   `[caches] sync_lazy_loaded_members_devices` devices. Anything forgotten (full,
//!   restart) is simply sent again, which is always correct (members may be redundant).

use std::collections::HashMap;

use parking_lot::Mutex;

/// Entries kept per device; full, the older half (by `sent_at`) is forgotten.
pub const PER_DEVICE_MAX: usize = 2000;

/// What one device was sent: `(room, member) -> sent_at`.
#[derive(Debug, Default, Clone)]
pub struct DeviceSent {
    sent: HashMap<(String, String), u64>,
    newest: u64,
}

impl DeviceSent {
    /// Whether the device holds `member`'s membership in `room` as of `since`.
    pub fn was_sent(&self, room: &str, member: &str, since: u64) -> bool {
        self.sent
            .get(&(room.to_owned(), member.to_owned()))
            .is_some_and(|at| *at <= since)
    }

    /// Records that the response ending at `sent_at` carries `member`'s membership.
    pub fn mark_sent(&mut self, room: &str, member: &str, sent_at: u64) {
        if self.sent.len() >= PER_DEVICE_MAX {
            let mut ats: Vec<u64> = self.sent.values().copied().collect();
            ats.sort_unstable();
            let cut = ats[ats.len() / 2];
            self.sent.retain(|_, at| *at > cut);
        }
        self.sent
            .insert((room.to_owned(), member.to_owned()), sent_at);
        self.newest = self.newest.max(sent_at);
    }

    /// Forgets what responses after `since` carried (`None`: everything).
    fn start(&mut self, since: Option<u64>) {
        match since {
            None => {
                self.sent.clear();
                self.newest = 0;
            }
            Some(since) if self.newest > since => {
                self.sent.retain(|_, at| *at <= since);
                self.newest = since;
            }
            Some(_) => {}
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.sent.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }
}

/// Every lazy-loading device's [`DeviceSent`], bounded by a device count.
#[derive(Debug)]
pub struct SentMembers {
    devices: Mutex<HashMap<(String, String), DeviceSent>>,
    devices_max: usize,
}

impl SentMembers {
    /// An empty record for at most `devices_max` devices (full: emptied, so every
    /// device is sent its senders' members once more).
    pub fn with_limit(devices_max: usize) -> SentMembers {
        SentMembers {
            devices: Mutex::new(HashMap::new()),
            devices_max: devices_max.max(1),
        }
    }

    /// Takes the device's record out for one request from `since` (after forgetting
    /// what later responses carried); give it back with [`SentMembers::finish`]. A
    /// request that fails in between loses it: its senders are sent again.
    pub fn start(&self, user: &str, device: &str, since: Option<u64>) -> DeviceSent {
        let mut d = self
            .devices
            .lock()
            .remove(&(user.to_owned(), device.to_owned()))
            .unwrap_or_default();
        d.start(since);
        d
    }

    /// Puts the device's record back after its response was built.
    pub fn finish(&self, user: &str, device: &str, sent: DeviceSent) {
        let mut devices = self.devices.lock();
        if devices.len() >= self.devices_max {
            devices.clear();
        }
        devices.insert((user.to_owned(), device.to_owned()), sent);
    }

    /// Devices with a record now.
    pub fn len(&self) -> usize {
        self.devices.lock().len()
    }

    /// Whether no device has one.
    pub fn is_empty(&self) -> bool {
        self.devices.lock().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_after_since_are_forgotten_and_initial_sync_clears() {
        let m = SentMembers::with_limit(10);
        let mut d = m.start("@a:x", "D", None);
        d.mark_sent("!r", "@b:x", 5);
        d.mark_sent("!r", "@c:x", 9);
        m.finish("@a:x", "D", d);
        // A retry from 5: the response at 9 was lost.
        let d = m.start("@a:x", "D", Some(5));
        assert!(d.was_sent("!r", "@b:x", 5));
        assert!(!d.was_sent("!r", "@c:x", 9));
        assert_eq!(d.len(), 1);
        m.finish("@a:x", "D", d);
        let d = m.start("@a:x", "D", None);
        assert!(d.is_empty());
    }

    #[test]
    fn a_full_device_record_forgets_its_older_half() {
        let mut d = DeviceSent::default();
        for i in 0..PER_DEVICE_MAX as u64 {
            d.mark_sent("!r", &format!("@u{i}:x"), i + 1);
        }
        d.mark_sent("!r", "@new:x", 10_000);
        assert_eq!(d.len(), PER_DEVICE_MAX / 2);
        assert!(d.was_sent("!r", "@new:x", 10_000));
        assert!(!d.was_sent("!r", "@u0:x", 10_000));
    }
}
