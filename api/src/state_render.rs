//! The rendered-state cache: a room state (a state root of the state projection)
//! rendered once as client JSON and served again from memory (BRIEF §4: "the `/state`
//! response can be cached keyed by the state root").
//!
//! A state root is content-addressed, so an entry found under a root is provably the
//! same set of state events. What can change a rendering without changing the root is
//! a redaction (of a state event, or of the event a `prev_content` comes from), so an
//! entry also remembers the room's [`RedactionGeneration`], read *before* the events
//! were read; an entry whose generation is not the room's current one is rendered
//! again. Everything that depends on the request is added per request, never cached:
//! `room_id` (written by `/state` and `/members`, not by `/sync`'s
//! `ClientEventWithoutRoomID`), `unsigned.age` (from `origin_server_ts`),
//! `unsigned.transaction_id` for the sending device, and MSC4140's `delay_id` for the
//! sender.
//!
//! Each event is kept as JSON text, so a hit writes the answer by concatenation,
//! without parsing or serializing anything: a `/state` of an unchanged room costs one
//! root lookup, one generation read and the copy of the bytes.
//!
//! Its users: `/state` and `/members`, `/sync`'s `state` section, and sliding sync's
//! non-member `required_state` and room fields (name, avatar). What it is not: a cache
//! of timelines (`/sync`'s or `/messages`' events add bundled aggregations and
//! `unsigned.membership`, which depend on more than the root). The cache is bounded in
//! bytes (`[caches] rendered_state_bytes`); past it the oldest entries are dropped
//! first.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use parking_lot::Mutex;
use serde::Deserialize as _;
use serde_json::Value;
use spindle_core::{pdu::ClientFormat, trie::Root};
use spindle_projections::timeline::{EventRecord, RedactionGeneration};

use crate::AppState;

/// One state event rendered for clients, without its per-request `unsigned` fields.
#[derive(Debug)]
pub struct RenderedStateEvent {
    /// `event_id`.
    pub event_id: String,
    /// `type`.
    pub event_type: String,
    /// `state_key`.
    pub state_key: String,
    /// `content.membership` of an `m.room.member` event (after redaction), else `None`.
    pub membership: Option<String>,
    /// `sender`.
    pub sender: String,
    /// Whether `content.url` is a string (the filters' `contains_url`).
    pub has_url: bool,
    /// Whether a redaction applies (the rendering's content is the redacted one).
    pub redacted: bool,
    /// `origin_server_ts`, ms (for `unsigned.age`).
    origin_server_ts: u64,
    /// The sending device and its transaction id (for `unsigned.transaction_id`).
    device_id: Option<String>,
    txn_id: Option<String>,
    /// The event object's JSON text without `room_id`, without `unsigned` and without
    /// the closing brace (`room_id` is written per answer: `/state` and `/members` have
    /// it, `/sync`'s `ClientEventWithoutRoomID` does not).
    head: Vec<u8>,
    /// The cached `unsigned` members as JSON text (`"k":v,...`, no braces; may be empty):
    /// `prev_content`.
    unsigned: String,
    /// `unsigned.redacted_because` as JSON text without `room_id` and without its
    /// closing brace (the redaction is of the same room: `room_id` is written with the
    /// outer event's, in the same format).
    redacted_because: Option<Vec<u8>>,
}

impl RenderedStateEvent {
    /// Renders `ev` ([`crate::read::render_unbundled`]'s fields, no viewer): also for
    /// a state event that is not part of a cached state (`/sync`'s lazy-loaded members
    /// and state deltas), so every state event a client gets has the same shape.
    pub fn render(s: &AppState, ev: &EventRecord) -> RenderedStateEvent {
        let redaction = crate::read::redaction_of(s, ev);
        let mut unsigned = serde_json::Map::new();
        let mut redacted_because = None;
        let (mut head, peek) = match &redaction {
            // Rare, and the content is rewritten: through a value.
            Some(r) => {
                let mut v = ev.pdu.to_redacted_client_event(&r.pdu);
                crate::read::without_room_id(&mut v);
                if let Some(map) = v.as_object_mut()
                    && let Some(Value::Object(mut u)) = map.remove("unsigned")
                {
                    if let Some(because) = u.remove("redacted_because") {
                        let mut text = serde_json::to_vec(&because).unwrap_or_default();
                        if text.pop() == Some(b'}') {
                            redacted_because = Some(text);
                        }
                    }
                    unsigned.extend(u);
                }
                let peek = ContentPeek::deserialize(&v["content"]).unwrap_or_default();
                (
                    serde_json::to_vec(&v).unwrap_or_else(|_| b"{}".to_vec()),
                    peek,
                )
            }
            // The content is copied as stored; only the two members the filters and
            // `/members` need are read from it.
            None => {
                if let Some(prev) = crate::read::replaced_state(s, ev) {
                    unsigned.insert("prev_content".into(), crate::read::client_content(s, &prev));
                }
                let mut head = Vec::with_capacity(ev.pdu.content.get().len() + 256);
                ev.pdu
                    .write_client_event(&mut head, ClientFormat::WithoutRoomId, None);
                let peek = serde_json::from_str(ev.pdu.content.get()).unwrap_or_default();
                (head, peek)
            }
        };
        head.pop(); // the closing brace: `unsigned` is appended per request
        let membership = (ev.pdu.kind.to_string() == "m.room.member")
            .then(|| {
                peek.membership
                    .as_ref()
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .flatten();
        let has_url = peek.url.as_ref().is_some_and(Value::is_string);
        let unsigned = if unsigned.is_empty() {
            String::new()
        } else {
            let text = serde_json::to_string(&Value::Object(unsigned)).unwrap_or_default();
            text[1..text.len() - 1].to_owned()
        };
        RenderedStateEvent {
            event_id: ev.pdu.event_id.to_string(),
            has_url,
            redacted: redaction.is_some(),
            event_type: ev.pdu.kind.to_string(),
            state_key: ev.pdu.state_key.clone().unwrap_or_default(),
            membership,
            sender: ev.pdu.sender.to_string(),
            origin_server_ts: u64::from(ev.pdu.origin_server_ts.0),
            device_id: ev.device_id.clone(),
            txn_id: ev.txn_id.clone(),
            head,
            unsigned,
            redacted_because,
        }
    }

    fn bytes(&self) -> usize {
        self.event_id.len()
            + self.head.len()
            + self.unsigned.len()
            + self.redacted_because.as_ref().map_or(0, Vec::len)
            + self.event_type.len()
            + self.state_key.len()
            + self.sender.len()
            + 64
    }

    /// Appends the event's JSON for `viewer` (user, device) at `now_ms` to `out`, with
    /// `room_id` when given (spec `ClientEvent`; `None`: `ClientEventWithoutRoomID`).
    pub fn write_to(
        &self,
        out: &mut Vec<u8>,
        room_id: Option<&str>,
        viewer: Option<(&str, &str)>,
        now_ms: u64,
    ) {
        use std::io::Write as _;
        out.extend_from_slice(&self.head);
        if let Some(room_id) = room_id {
            out.extend_from_slice(b",\"room_id\":");
            let _ = serde_json::to_writer(&mut *out, room_id);
        }
        if out.ends_with(b"{") {
            // Never: an event always has fields. Kept valid JSON regardless.
            out.extend_from_slice(b"\"unsigned\":{");
        } else {
            out.extend_from_slice(b",\"unsigned\":{");
        }
        // Writing into a Vec cannot fail.
        let _ = write!(
            out,
            "\"age\":{}",
            now_ms.saturating_sub(self.origin_server_ts)
        );
        if !self.unsigned.is_empty() {
            out.push(b',');
            out.extend_from_slice(self.unsigned.as_bytes());
        }
        if let Some(because) = &self.redacted_because {
            out.extend_from_slice(b",\"redacted_because\":");
            out.extend_from_slice(because);
            if let Some(room_id) = room_id {
                // `because` is an object's text without its closing brace (never empty
                // in practice: a redaction has fields; `{` alone takes no comma).
                if because.len() > 1 {
                    out.push(b',');
                }
                out.extend_from_slice(b"\"room_id\":");
                let _ = serde_json::to_writer(&mut *out, room_id);
            }
            out.push(b'}');
        }
        let delay_id = self
            .txn_id
            .as_deref()
            .and_then(|t| t.strip_prefix(crate::delayed::DELAY_TXN_PREFIX));
        if let (Some((user, _)), Some(id)) = (viewer, delay_id)
            && user == self.sender
        {
            out.extend_from_slice(b",\"org.matrix.msc4140.delay_id\":");
            let _ = serde_json::to_writer(&mut *out, id);
        } else if let (Some((user, device)), Some(dev), Some(txn)) =
            (viewer, &self.device_id, &self.txn_id)
            && user == self.sender
            && device == dev
        {
            out.extend_from_slice(b",\"transaction_id\":");
            let _ = serde_json::to_writer(&mut *out, txn.strip_prefix("redact/").unwrap_or(txn));
        }
        out.extend_from_slice(b"}}");
    }

    /// `content`, parsed from the rendering (redacted when a redaction applies).
    pub fn content(&self) -> Value {
        let mut text = self.head.clone();
        text.push(b'}');
        serde_json::from_slice::<Value>(&text)
            .ok()
            .and_then(|mut v| v.get_mut("content").map(Value::take))
            .unwrap_or(Value::Null)
    }
}

/// The two members of a state event's content that [`RenderedStateEvent`] keeps beside
/// its text (any JSON value; the rest of the content is skipped, not built).
#[derive(Default, serde::Deserialize)]
struct ContentPeek {
    #[serde(default)]
    membership: Option<Value>,
    #[serde(default)]
    url: Option<Value>,
}

/// A room state, rendered: every event of the root, in the state projection's order.
#[derive(Debug)]
pub struct RenderedState {
    generation: RedactionGeneration,
    /// The events.
    pub events: Vec<RenderedStateEvent>,
    bytes: usize,
}

impl RenderedState {
    /// A JSON array of `events` of `room_id` for `viewer` at `now_ms` (spec
    /// `ClientEvent`s: `/state`, `/members`).
    pub fn json_array<'a>(
        events: impl Iterator<Item = &'a RenderedStateEvent>,
        room_id: &str,
        viewer: Option<(&str, &str)>,
        now_ms: u64,
        capacity: usize,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(capacity + 64);
        out.push(b'[');
        for (i, e) in events.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            e.write_to(&mut out, Some(room_id), viewer, now_ms);
        }
        out.push(b']');
        out
    }

    /// Bytes of JSON text held (about the size of an answer with every event).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The cache (see the module doc). Cheap to clone.
#[derive(Clone)]
pub struct StateRenderCache {
    inner: Arc<Mutex<Entries>>,
    limit_bytes: usize,
    renders: Arc<AtomicU64>,
}

#[derive(Default)]
struct Entries {
    map: HashMap<[u8; 32], Arc<RenderedState>>,
    /// Insertion order, oldest first (entries replaced in place keep their slot).
    order: VecDeque<[u8; 32]>,
    bytes: usize,
}

impl StateRenderCache {
    /// An empty cache holding at most `limit_bytes` of rendered JSON (0: nothing is
    /// kept, every request renders).
    pub fn new(limit_bytes: usize) -> StateRenderCache {
        StateRenderCache {
            inner: Arc::default(),
            limit_bytes,
            renders: Arc::default(),
        }
    }

    /// The rendering of `root`, a state of `room_id`: from the cache when current,
    /// else rendered now (one event read per state event) and kept.
    pub fn get(&self, s: &AppState, room_id: &str, root: Root) -> Arc<RenderedState> {
        if let Some(hit) = self.peek(s, room_id, root) {
            return hit;
        }
        let generation = s.projections.timeline.redaction_generation(room_id);
        let entries = s.projections.state.entries(root);
        let wanted = entries.len();
        let events: Vec<RenderedStateEvent> = entries
            .into_iter()
            .filter_map(|(_, _, id)| s.projections.timeline.event(&id))
            .map(|ev| RenderedStateEvent::render(s, &ev))
            .collect();
        self.renders
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        let bytes = events.iter().map(RenderedStateEvent::bytes).sum();
        let complete = events.len() == wanted;
        let rendered = Arc::new(RenderedState {
            generation,
            events,
            bytes,
        });
        // The state projection may be a batch ahead of the timeline's (each tails the
        // journal on its own thread): a root whose newest event the timeline has not
        // applied yet renders without it, and that rendering must not outlive the
        // request (the root would not change again until the next state event).
        if complete {
            self.insert(root, rendered.clone());
        }
        rendered
    }

    /// The rendering of `root` if the cache holds a current one; `None` renders
    /// nothing (for callers with a cheaper way than a whole render).
    pub fn peek(&self, s: &AppState, room_id: &str, root: Root) -> Option<Arc<RenderedState>> {
        let generation = s.projections.timeline.redaction_generation(room_id);
        self.inner
            .lock()
            .map
            .get(&root.0)
            .filter(|hit| hit.generation == generation)
            .cloned()
    }

    fn insert(&self, root: Root, rendered: Arc<RenderedState>) {
        if rendered.bytes > self.limit_bytes {
            return;
        }
        let mut c = self.inner.lock();
        match c.map.insert(root.0, rendered.clone()) {
            Some(old) => c.bytes -= old.bytes,
            None => c.order.push_back(root.0),
        }
        c.bytes += rendered.bytes;
        while c.bytes > self.limit_bytes {
            let Some(oldest) = c.order.pop_front() else {
                break;
            };
            if let Some(old) = c.map.remove(&oldest) {
                c.bytes -= old.bytes;
            }
        }
    }

    /// State events rendered since start (each miss renders every event of its root):
    /// the counting tests' witness that a hit renders nothing.
    pub fn renders(&self) -> u64 {
        self.renders.load(Ordering::Relaxed)
    }

    /// (entries, bytes) held, for the metrics.
    pub fn usage(&self) -> (usize, usize) {
        let c = self.inner.lock();
        (c.map.len(), c.bytes)
    }
}
