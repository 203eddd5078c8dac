//! The durable head, published after each durable write to async waiters (a
//! submitter waiting for its fsync, consumers) through a `watch`, and to blocking
//! tailers (the projection threads) through condition variables.
//!
//! Tailers say which records they read ([`Interest`]) and are woken only when a record
//! of that class becomes durable: a message does not wake the projections that read
//! facts or state events only (accounts, media, membership, room summaries…), and a
//! receipt does not wake those that read room records only (timeline, relations,
//! search…). With [`Heads`] a reader can tell that a tailer which has applied every
//! record of its classes has, in effect, applied everything up to the head
//! ([`Heads::covered`]).
//!
//! The heads change before the `watch` does: a request that read a `watch` head and
//! then asks whether a projection covers it ([`Heads::covered`]) never reads heads
//! older than that head.

use std::time::Duration;

use tokio::sync::watch;

/// Which records a tailer reads: a set of record classes. Every record is in exactly
/// one class: a fact ([`Interest::FACTS`]), a room record whose PDU has a state key
/// ([`Interest::STATE_EVENTS`]: state events, outliers, resolved state), a redaction
/// without one ([`Interest::REDACTIONS`]: type `m.room.redaction`) or any other room
/// record ([`Interest::OTHER_EVENTS`]: messages, reactions, edits; also backfilled and
/// soft-failed events without a state key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interest(u8);

impl Interest {
    /// Fact records ([`crate::RecordKind::Fact`]).
    pub const FACTS: Interest = Interest(1);
    /// Room records whose PDU has a `state_key`.
    pub const STATE_EVENTS: Interest = Interest(2);
    /// Room records whose PDU has no `state_key` and is not a redaction.
    pub const OTHER_EVENTS: Interest = Interest(4);
    /// Room records whose PDU is an `m.room.redaction` without a `state_key`: a
    /// projection that keeps state only (the audit trail) reads these to see a state
    /// event redacted without reading every message.
    pub const REDACTIONS: Interest = Interest(8);
    /// Every room record.
    pub const ROOM: Interest = Interest(2 | 4 | 8);
    /// Every record.
    pub const ALL: Interest = Interest(1 | 2 | 4 | 8);

    /// Both sets together.
    pub const fn and(self, other: Interest) -> Interest {
        Interest(self.0 | other.0)
    }

    /// The index of a single class in [`Heads::last`] (0 facts, 1 state events, 2
    /// other events, 3 redactions).
    pub fn index(self) -> usize {
        self.0.trailing_zeros() as usize
    }

    /// Whether a record of `class` (one class) is in this set.
    pub fn reads(self, class: Interest) -> bool {
        self.0 & class.0 != 0
    }

    /// The class of a record: `fact`, else by whether the PDU JSON in `payload` has a
    /// top-level `state_key`, else whether its `type` is `m.room.redaction` (an
    /// unreadable payload counts as [`Interest::OTHER_EVENTS`]). A scan that skips every
    /// other value; the appender classifies each record with it.
    pub fn class_of(fact: bool, payload: &[u8]) -> Interest {
        #[derive(serde::Deserialize)]
        struct Probe<'a> {
            #[serde(default)]
            state_key: Option<serde::de::IgnoredAny>,
            #[serde(default, rename = "type", borrow)]
            kind: Option<std::borrow::Cow<'a, str>>,
        }
        if fact {
            return Interest::FACTS;
        }
        match serde_json::from_slice::<Probe>(payload) {
            Ok(Probe {
                state_key: Some(_), ..
            }) => Interest::STATE_EVENTS,
            Ok(Probe {
                kind: Some(kind), ..
            }) if kind == "m.room.redaction" => Interest::REDACTIONS,
            _ => Interest::OTHER_EVENTS,
        }
    }
}

/// The durable head and where the last durable record of each class is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Heads {
    /// The highest durable position.
    pub head: u64,
    /// The last durable record of each class ([`Interest::FACTS`],
    /// [`Interest::STATE_EVENTS`], [`Interest::OTHER_EVENTS`],
    /// [`Interest::REDACTIONS`], in that order), or a position at or below which every
    /// record of it is (the head at open).
    pub last: [u64; 4],
}

impl Heads {
    /// The last durable position of a record in `interest`.
    pub fn last_of(&self, interest: Interest) -> u64 {
        (0..4)
            .filter(|i| interest.0 & (1 << i) != 0)
            .map(|i| self.last[i])
            .max()
            .unwrap_or(0)
    }

    /// Where a tailer with `interest` that has applied up to `checkpoint` stands in
    /// effect: the head when no record it reads is after its checkpoint, else the
    /// checkpoint itself.
    pub fn covered(&self, interest: Interest, checkpoint: u64) -> u64 {
        if checkpoint >= self.last_of(interest) {
            checkpoint.max(self.head)
        } else {
            checkpoint
        }
    }
}

/// The last position of each class among `(position, class)` pairs, in
/// [`Heads::last`]'s order (`None`: no record of that class): what
/// [`DurableHead::publish`] takes for a durable group of records.
pub(crate) fn last_of_each_class(
    records: impl IntoIterator<Item = (u64, Interest)>,
) -> [Option<u64>; 4] {
    let mut last = [None; 4];
    for (position, class) in records {
        last[class.index()] = Some(position);
    }
    last
}

/// Condition variables for tailers, one per non-empty interest (indexed by its bits).
const WAIT_SETS: usize = 16;

/// See the module doc.
pub(crate) struct DurableHead {
    /// The heads, and whether the appender has stopped.
    heads: parking_lot::Mutex<(Heads, bool)>,
    waiting: [parking_lot::Condvar; WAIT_SETS],
    watch: watch::Sender<u64>,
}

impl DurableHead {
    /// A head at `head`, every class's last record at or below it.
    pub(crate) fn new(head: u64) -> (DurableHead, watch::Receiver<u64>) {
        let (watch, rx) = watch::channel(head);
        (
            DurableHead {
                heads: parking_lot::Mutex::new((
                    Heads {
                        head,
                        last: [head; 4],
                    },
                    false,
                )),
                waiting: std::array::from_fn(|_| parking_lot::Condvar::new()),
                watch,
            },
            rx,
        )
    }

    /// Publishes a new head: `last[i]` is the last record of class `i` among the ones
    /// made durable with it (`None`: none of that class). The heads change first, then
    /// the async waiters hear of it (a submitter waiting for its fsync goes first),
    /// then the tailers that read one of the classes are woken.
    pub(crate) fn publish(&self, head: u64, last: [Option<u64>; 4]) {
        {
            let mut g = self.heads.lock();
            let h = &mut g.0;
            h.head = h.head.max(head);
            for (slot, p) in h.last.iter_mut().zip(last) {
                if let Some(p) = p {
                    *slot = (*slot).max(p);
                }
            }
            // Under the lock: a tailer that finds the heads moved also finds the
            // records below the watch head (it reads up to that), instead of spinning
            // between an empty read and a wait that returns at once.
            self.watch.send_replace(head);
        }
        let classes = last
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_some())
            .fold(0u8, |bits, (i, _)| bits | (1 << i));
        for (set, cv) in self.waiting.iter().enumerate() {
            if set as u8 & classes != 0 {
                cv.notify_all();
            }
        }
    }

    /// Wakes every blocked tailer for good ([`DurableHead::wait`] returns `None`).
    pub(crate) fn close(&self) {
        self.heads.lock().1 = true;
        for cv in &self.waiting {
            cv.notify_all();
        }
    }

    pub(crate) fn heads(&self) -> Heads {
        self.heads.lock().0
    }

    /// Blocks until a record in `interest` is durable after `after`, at most
    /// `timeout`; returns the heads then (also at the timeout), or `None` once closed.
    pub(crate) fn wait(&self, after: u64, interest: Interest, timeout: Duration) -> Option<Heads> {
        let cv = &self.waiting[usize::from(interest.0) % WAIT_SETS];
        let mut g = self.heads.lock();
        let deadline = std::time::Instant::now() + timeout;
        while !g.1 && g.0.last_of(interest) <= after {
            if cv.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        (!g.1).then_some(g.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covered_is_the_head_only_when_nothing_read_is_pending() {
        let h = Heads {
            head: 10,
            last: [7, 9, 10, 8],
        };
        assert_eq!(h.covered(Interest::FACTS, 7), 10);
        assert_eq!(h.covered(Interest::FACTS, 6), 6);
        assert_eq!(h.covered(Interest::FACTS.and(Interest::STATE_EVENTS), 8), 8);
        assert_eq!(
            h.covered(Interest::FACTS.and(Interest::STATE_EVENTS), 9),
            10
        );
        assert_eq!(h.covered(Interest::ROOM, 9), 9);
        assert_eq!(h.covered(Interest::ROOM, 10), 10);
        assert_eq!(h.covered(Interest::ALL, 9), 9);
        let redactions = Interest::FACTS.and(Interest::REDACTIONS);
        assert_eq!(h.covered(redactions, 7), 7);
        assert_eq!(h.covered(redactions, 8), 10);
    }

    #[test]
    fn the_class_of_a_record_is_whether_its_pdu_has_a_state_key() {
        let state = br#"{"content":{"state_key":1},"state_key":"","type":"m.room.name"}"#;
        let message = br#"{"content":{"state_key":"x"},"type":"m.room.message"}"#;
        assert_eq!(Interest::class_of(false, state), Interest::STATE_EVENTS);
        assert_eq!(Interest::class_of(false, message), Interest::OTHER_EVENTS);
        assert_eq!(
            Interest::class_of(false, b"not json"),
            Interest::OTHER_EVENTS
        );
        assert_eq!(Interest::class_of(true, state), Interest::FACTS);
        let redaction = br#"{"content":{},"redacts":"$x","type":"m.room.redaction"}"#;
        let v11_redaction = br#"{"content":{"redacts":"$x"},"type":"m.room.redaction"}"#;
        let escaped = br#"{"content":{},"type":"m.room.redaction"}"#;
        let state_redaction = br#"{"content":{},"state_key":"","type":"m.room.redaction"}"#;
        assert_eq!(Interest::class_of(false, redaction), Interest::REDACTIONS);
        assert_eq!(
            Interest::class_of(false, v11_redaction),
            Interest::REDACTIONS
        );
        assert_eq!(Interest::class_of(false, escaped), Interest::REDACTIONS);
        assert_eq!(
            Interest::class_of(false, state_redaction),
            Interest::STATE_EVENTS
        );
        assert_eq!(Interest::class_of(true, redaction), Interest::FACTS);
    }

    #[test]
    fn a_tailer_is_woken_only_by_records_it_reads() {
        let (d, _rx) = DurableHead::new(0);
        let d = std::sync::Arc::new(d);
        let waiter = {
            let d = d.clone();
            std::thread::spawn(move || d.wait(0, Interest::FACTS, Duration::from_secs(10)))
        };
        d.publish(3, [None, Some(2), Some(3), None]);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "woken by room records");
        d.publish(4, [Some(4), None, None, None]);
        let h = waiter.join().unwrap().expect("not closed");
        assert_eq!(
            h,
            Heads {
                head: 4,
                last: [4, 2, 3, 0]
            }
        );
        d.close();
        assert_eq!(d.wait(4, Interest::ALL, Duration::from_secs(10)), None);
    }
}
