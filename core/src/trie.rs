//! The content-addressed state trie: "room state after every event".
//!
//! A persistent (immutable, structurally shared) hash array mapped trie (HAMT)
//! mapping a room-state key `(event_type, state_key)` to a value (in practice
//! the bytes of an event id). Nodes are never modified: every update returns a
//! new [`Root`] and writes only the nodes on the path it changed, sharing every
//! other node with the old version. Each node is stored in a [`NodeStore`]
//! under the blake3 hash of its canonical byte encoding, so a root hash names
//! one exact state, and two servers (or two replays) holding the same state
//! compute the same root.
//!
//! # Key hashing
//!
//! The key hash is `blake3("spindle/state-trie/key/v1\0" || u64le(len(event_type))
//! || event_type || u64le(len(state_key)) || state_key)` (see [`key_hash`]). The
//! length prefixes make the encoding unambiguous, so `("a", "bc")` and
//! `("ab", "c")` are different keys with unrelated hashes.
//!
//! The 256-bit key hash is read as a big-endian bit string and cut into 5-bit
//! chunks: the chunk for depth `d` is bits `5d .. 5d+5`. Depths `0..=50` use
//! 5 full bits; depth 51 ([`MAX_BRANCH_DEPTH`]) holds only bit 255 (padded with
//! four zero bits). So a branch can stand at depth 0 to 51 and any two distinct
//! key hashes are told apart by depth 51 at the latest; keys whose whole
//! 256-bit hashes are equal share one leaf (a "collision bucket").
//!
//! # Node kinds and byte encoding (version 1)
//!
//! The first byte of every node is a tag whose high nibble is the encoding
//! version (1) and whose low nibble is the kind. All integers are little-endian.
//!
//! | kind   | bytes |
//! |--------|-------|
//! | empty  | `0x10` (exactly one byte; only ever a root) |
//! | leaf   | `0x11`, `u32 n` (n ≥ 1), then n × (`u32 len`, event_type, `u32 len`, state_key, `u32 len`, value) |
//! | branch | `0x12`, `u32 bitmap` (≠ 0), then `popcount(bitmap)` × 32-byte child hash |
//!
//! Leaf entries are sorted strictly ascending by `(event_type, state_key)`
//! (bytewise) and all share one key hash. Branch bit `i` (least significant bit
//! = chunk value 0) is set when a child exists for chunk value `i`; children
//! follow in ascending chunk order. A leaf's encoding does not depend on its
//! depth, so when a leaf moves up or down during an update it keeps its hash and
//! is not rewritten. Strings must be UTF-8, and nothing may follow the last
//! field. Decoding checks all of this and answers [`TrieError::Corrupt`] for
//! anything else (it never panics); loading also checks that the bytes hash to
//! the hash they were asked for. The node hash is `blake3(bytes)`;
//! [`EMPTY_ROOT`] is `blake3([0x10])` =
//! `b35d4ab392fb952c8d7625efbfaff8af2c8cebf20d1ff9784a8ffe08dc667e12`. The
//! empty node is never read from or written to a store: its hash is recognised.
//!
//! # Canonical form
//!
//! The shape of a trie is a function of its set of entries alone, never of the
//! order of the operations that built it. For the entries `S` whose key hashes
//! start with the chunks of a path `p` at depth `d`:
//!
//! * no entries: no node (the whole trie: the empty node, [`EMPTY_ROOT`]);
//! * exactly one distinct key hash: a single leaf holding all of them (normally
//!   one entry), standing at `p` — i.e. a leaf sits at the shallowest depth at
//!   which its hash prefix is unique;
//! * two or more distinct key hashes: a branch, whose children are the
//!   canonical subtrees for each chunk value present at depth `d`.
//!
//! Consequences: there is no empty branch, no empty node below the root, and no
//! branch whose only child is a leaf (it must have collapsed into that leaf). A
//! branch with a single child whose child is a branch is allowed (it is needed
//! where two keys share a long hash prefix). [`insert`] keeps this shape by
//! splitting a leaf into the shortest chain of branches that separates the two
//! hashes; [`remove`] restores it by collapsing any branch left with one leaf
//! child into that leaf, repeatedly up the path. [`verify`] checks a whole trie
//! against this definition.
//!
//! # Costs
//!
//! With `n` entries the depth of a leaf (branches above it) is about
//! `log32(n)`. Measured with blake3 keys: 10 entries → depth 1–2; 1 000 → 2–4;
//! 10 000 → 3–4 for 99% of keys (max 5–6); 100 000 → 4 for 86% of keys, 3–6
//! for nearly all, with a tail of about 1 in 10 000 at 7–8. A point [`lookup`]
//! reads one node per level (depth + 1 reads, ~5 on average at 100 000
//! entries); [`insert`] reads the same path and writes at most that many new
//! nodes (plus the branches of a leaf split); [`remove`] may read one extra
//! sibling to decide a collapse; [`diff`] reads only subtrees
//! whose hashes differ. A branch node is at most 5 + 32 × 32 = 1029 bytes, and
//! the top two levels of a large trie are full, so one insert into a 100 000
//! entry state writes about 2.5 KB (four or five nodes); the whole state is
//! about 132 000 nodes / 8.5 MB (with ~20-byte keys and values). Nodes of old
//! roots stay in the store: reclaiming them (if ever) is the store's business.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, RwLock};

/// A node's address: the blake3 hash of its canonical encoding.
pub type NodeHash = [u8; 32];

/// Version of the node encoding; the high nibble of every node's first byte.
pub const NODE_VERSION: u8 = 1;
const TAG_EMPTY: u8 = NODE_VERSION << 4;
const TAG_LEAF: u8 = (NODE_VERSION << 4) | 0x1;
const TAG_BRANCH: u8 = (NODE_VERSION << 4) | 0x2;

/// Key-hash bits consumed per trie level (32-way branching).
pub const BITS_PER_LEVEL: usize = 5;

/// The deepest depth (0 = root) at which a branch node may stand. Depth 51 uses
/// bit 255, the last bit of the 256-bit key hash; below it hashes are equal and
/// keys share a collision leaf.
pub const MAX_BRANCH_DEPTH: usize = 51;

/// Domain-separation prefix of [`key_hash`].
const KEY_HASH_DOMAIN: &[u8] = b"spindle/state-trie/key/v1\0";

/// `blake3([0x10])`, the hash of the encoded empty node.
const EMPTY_ROOT_HASH: NodeHash = [
    179, 93, 74, 179, 146, 251, 149, 44, 141, 118, 37, 239, 191, 175, 248, 175, 44, 140, 235, 242,
    13, 31, 249, 120, 74, 143, 254, 8, 220, 102, 126, 18,
];

/// The root of the empty trie: the hash of the one-byte empty node `[0x10]`.
/// Fixed and well known; the empty node never needs to be in a store.
pub const EMPTY_ROOT: Root = Root(EMPTY_ROOT_HASH);

/// The root of a trie: the hash of its root node. Names one exact set of
/// entries (same set, same root, on every server).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct Root(pub NodeHash);

impl Root {
    /// The root of the empty trie, [`EMPTY_ROOT`]. Costs nothing; reading it
    /// touches no store.
    pub const fn empty() -> Root {
        EMPTY_ROOT
    }

    /// Whether this is the empty trie's root.
    pub fn is_empty(&self) -> bool {
        self.0 == EMPTY_ROOT_HASH
    }

    /// The 32 raw hash bytes.
    pub fn as_bytes(&self) -> &NodeHash {
        &self.0
    }

    /// Lowercase hex of the hash: 64 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 64 hex digits (either case) as written by [`Root::to_hex`];
    /// `None` for any other length or a non-hex character.
    pub fn from_hex(s: &str) -> Option<Root> {
        let s = s.as_bytes();
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.chunks_exact(2).enumerate() {
            out[i] = (hex_val(pair[0])? << 4) | hex_val(pair[1])?;
        }
        Some(Root(out))
    }

    /// A root from exactly 32 raw bytes (as stored by a caller); `None` for any
    /// other length. Does not check that the node exists.
    pub fn from_bytes(bytes: &[u8]) -> Option<Root> {
        let arr: NodeHash = bytes.try_into().ok()?;
        Some(Root(arr))
    }
}

impl Default for Root {
    /// The empty trie's root.
    fn default() -> Root {
        EMPTY_ROOT
    }
}

impl fmt::Display for Root {
    /// Writes the lowercase hex of the hash.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Errors reading or updating a trie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrieError {
    /// A node the trie refers to is not in the store (the hash is the missing
    /// node's). The trie (or the store) is incomplete.
    MissingNode(NodeHash),
    /// Stored bytes are not a valid node (bad tag or version, truncated,
    /// trailing bytes, unsorted or non-UTF-8 entries, bytes that do not hash to
    /// their address, a node where the canonical shape forbids it, …). Also
    /// returned by [`insert`] for a key or value longer than `u32::MAX` bytes,
    /// which the encoding cannot hold.
    Corrupt(&'static str),
}

impl fmt::Display for TrieError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrieError::MissingNode(h) => write!(f, "state trie node {} is missing", hex(h)),
            TrieError::Corrupt(why) => write!(f, "corrupt state trie: {why}"),
        }
    }
}

impl std::error::Error for TrieError {}

/// Where trie nodes live, keyed by their hash.
///
/// Content-addressed: the bytes under a hash never change, so `put_node` of a
/// hash already present may be skipped and stores need no invalidation. The
/// trie checks that the bytes it gets hash to the hash it asked for, so a store
/// need not check (a store that does, such as a cache of checked nodes, says so
/// with [`NodeStore::verified`]). Implementations: [`MemStore`]; an on-disk KV
/// store; the state projection's node cache.
pub trait NodeStore {
    /// The encoded node stored under `hash`, or `None` if there is none.
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>>;
    /// Stores `bytes` under `hash` (`hash == blake3(bytes)`). Idempotent.
    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>);
    /// Whether every `get_node` answer was already checked against its hash (a cache
    /// that checks what it admits): the trie then skips its own check. Default `false`.
    fn verified(&self) -> bool {
        false
    }
}

impl<T: NodeStore + ?Sized> NodeStore for &T {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        (**self).get_node(hash)
    }
    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        (**self).put_node(hash, bytes);
    }
    fn verified(&self) -> bool {
        (**self).verified()
    }
}

impl<T: NodeStore + ?Sized> NodeStore for Arc<T> {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        (**self).get_node(hash)
    }
    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        (**self).put_node(hash, bytes);
    }
    fn verified(&self) -> bool {
        (**self).verified()
    }
}

impl<T: NodeStore + ?Sized> NodeStore for Box<T> {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        (**self).get_node(hash)
    }
    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        (**self).put_node(hash, bytes);
    }
}

/// A thread-safe in-memory [`NodeStore`] (an `RwLock<HashMap>`), with counters
/// of `get_node` calls ([`MemStore::reads`]) and `put_node` calls
/// ([`MemStore::writes`]) for tests that count costs.
#[derive(Default)]
pub struct MemStore {
    nodes: RwLock<HashMap<NodeHash, Arc<[u8]>>>,
    reads: AtomicU64,
    writes: AtomicU64,
}

impl MemStore {
    /// An empty store with zeroed counters.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// Number of distinct nodes stored.
    pub fn len(&self) -> usize {
        self.map_read().len()
    }

    /// Whether no node is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of `get_node` calls so far (hits and misses).
    pub fn reads(&self) -> u64 {
        self.reads.load(AtomicOrdering::Relaxed)
    }

    /// Number of `put_node` calls so far (including ones for nodes already
    /// present).
    pub fn writes(&self) -> u64 {
        self.writes.load(AtomicOrdering::Relaxed)
    }

    /// Sets both counters back to zero.
    pub fn reset_counters(&self) {
        self.reads.store(0, AtomicOrdering::Relaxed);
        self.writes.store(0, AtomicOrdering::Relaxed);
    }

    /// Whether a node is stored under `hash` (not counted as a read).
    pub fn contains(&self, hash: &NodeHash) -> bool {
        self.map_read().contains_key(hash)
    }

    /// Fault injection for tests: deletes the node under `hash`; returns
    /// whether it was there.
    pub fn remove_node(&self, hash: &NodeHash) -> bool {
        self.map_write().remove(hash).is_some()
    }

    /// Fault injection for tests: replaces the bytes under `hash` with
    /// arbitrary `bytes`, bypassing content addressing.
    pub fn overwrite_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        self.map_write().insert(hash, bytes.into());
    }

    fn map_read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<NodeHash, Arc<[u8]>>> {
        self.nodes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn map_write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<NodeHash, Arc<[u8]>>> {
        self.nodes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl NodeStore for MemStore {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        self.reads.fetch_add(1, AtomicOrdering::Relaxed);
        self.map_read().get(hash).cloned()
    }

    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        self.writes.fetch_add(1, AtomicOrdering::Relaxed);
        self.map_write().entry(hash).or_insert_with(|| bytes.into());
    }
}

/// One difference between two states, as reported by [`diff`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The key is only in the `to` state.
    Added {
        /// Event type of the key.
        event_type: String,
        /// State key of the key.
        state_key: String,
        /// Value in `to`.
        value: Vec<u8>,
    },
    /// The key is only in the `from` state.
    Removed {
        /// Event type of the key.
        event_type: String,
        /// State key of the key.
        state_key: String,
        /// Value in `from`.
        old: Vec<u8>,
    },
    /// The key is in both with different values.
    Changed {
        /// Event type of the key.
        event_type: String,
        /// State key of the key.
        state_key: String,
        /// Value in `from`.
        old: Vec<u8>,
        /// Value in `to`.
        new: Vec<u8>,
    },
}

impl Change {
    /// The event type of the changed key.
    pub fn event_type(&self) -> &str {
        match self {
            Change::Added { event_type, .. }
            | Change::Removed { event_type, .. }
            | Change::Changed { event_type, .. } => event_type,
        }
    }

    /// The state key of the changed key.
    pub fn state_key(&self) -> &str {
        match self {
            Change::Added { state_key, .. }
            | Change::Removed { state_key, .. }
            | Change::Changed { state_key, .. } => state_key,
        }
    }

    /// The value in the `from` state, if the key was there.
    pub fn old_value(&self) -> Option<&[u8]> {
        match self {
            Change::Added { .. } => None,
            Change::Removed { old, .. } | Change::Changed { old, .. } => Some(old),
        }
    }

    /// The value in the `to` state, if the key is there.
    pub fn new_value(&self) -> Option<&[u8]> {
        match self {
            Change::Removed { .. } => None,
            Change::Added { value, .. } => Some(value),
            Change::Changed { new, .. } => Some(new),
        }
    }
}

/// Figures from [`verify`]: the size and shape of one trie.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrieStats {
    /// Number of entries (keys).
    pub entries: usize,
    /// Number of leaf nodes (fewer than `entries` only with hash collisions).
    pub leaves: usize,
    /// Number of branch nodes.
    pub branches: usize,
    /// Depth of the deepest leaf (0 when the root is a leaf or the trie is
    /// empty); a lookup of that key reads `max_depth + 1` nodes.
    pub max_depth: usize,
}

/// The trie hash of a state key: blake3 over a domain prefix and the
/// length-prefixed `(event_type, state_key)` (see the module docs). Pure; no
/// store access.
pub fn key_hash(event_type: &str, state_key: &str) -> NodeHash {
    let mut h = blake3::Hasher::new();
    h.update(KEY_HASH_DOMAIN);
    h.update(&(event_type.len() as u64).to_le_bytes());
    h.update(event_type.as_bytes());
    h.update(&(state_key.len() as u64).to_le_bytes());
    h.update(state_key.as_bytes());
    *h.finalize().as_bytes()
}

/// The value stored under `(event_type, state_key)` in the trie at `root`,
/// or `None` if the key is absent.
///
/// # Cost
/// Reads only the nodes on that key's path: depth + 1 `get_node` calls (about
/// `log32(n) + 1`; none for the empty root). Writes nothing.
///
/// # Errors
/// [`TrieError::MissingNode`] if a node on the path is absent,
/// [`TrieError::Corrupt`] if one is malformed.
pub fn lookup<S: NodeStore + ?Sized>(
    store: &S,
    root: Root,
    event_type: &str,
    state_key: &str,
) -> Result<Option<Vec<u8>>, TrieError> {
    Ctx::new(store).lookup(root, event_type, state_key)
}

/// The trie `root` with `(event_type, state_key)` set to `value` (added or
/// replaced). The old root stays valid and shares every untouched node.
///
/// # Cost
/// Reads the key's path and writes the new leaf plus one new branch per level
/// on the path (plus, when the key splits an existing leaf, the branches that
/// separate the two: usually one). Setting a key to the value it already has
/// writes nothing and returns `root` itself.
///
/// # Errors
/// [`TrieError::MissingNode`] / [`TrieError::Corrupt`] from nodes on the path;
/// `Corrupt` also if a field is longer than `u32::MAX` bytes. Nothing useful
/// is left behind on error (at most orphan nodes).
pub fn insert<S: NodeStore + ?Sized>(
    store: &S,
    root: Root,
    event_type: &str,
    state_key: &str,
    value: &[u8],
) -> Result<Root, TrieError> {
    Ctx::new(store).insert(root, event_type, state_key, value)
}

/// The trie `root` without `(event_type, state_key)`; `root` itself (nothing
/// written) if the key is absent. The result is in canonical form (a branch
/// left with one leaf child collapses into it, repeatedly up the path), so it
/// equals the root of a trie built without that key; removing the last key
/// gives [`Root::empty`].
///
/// # Cost
/// Reads the key's path, plus one sibling where a branch is left with a single
/// child (to decide whether it collapses); writes at most one node per level.
///
/// # Errors
/// As [`lookup`], for the nodes it reads.
pub fn remove<S: NodeStore + ?Sized>(
    store: &S,
    root: Root,
    event_type: &str,
    state_key: &str,
) -> Result<Root, TrieError> {
    Ctx::new(store).remove(root, event_type, state_key)
}

/// Applies many updates in order and returns the final root: `(event_type,
/// state_key, Some(value))` sets a key, `(event_type, state_key, None)`
/// removes it.
///
/// Gives exactly the root that calling [`insert`] / [`remove`] one by one
/// would, but buffers intermediate nodes in memory and writes to `store` only
/// the new nodes reachable from the final root, children before parents (so a
/// store never holds a node whose children it lacks). Use it to build a state
/// with many keys at once (e.g. the state of a room being joined).
///
/// # Cost
/// Reads as the individual operations would (new nodes come from memory);
/// writes each new live node once.
///
/// # Errors
/// As [`insert`]; on error nothing at all is written to `store`.
pub fn apply<'a, S, I>(store: &S, root: Root, ops: I) -> Result<Root, TrieError>
where
    S: NodeStore + ?Sized,
    I: IntoIterator<Item = (&'a str, &'a str, Option<&'a [u8]>)>,
{
    Ctx::new(store).apply(root, ops)
}

/// All entries of the trie at `root` as `(event_type, state_key, value)`,
/// sorted by `(event_type, state_key)` ascending (bytewise).
///
/// # Cost
/// Reads every node of the trie once; O(n log n) to sort.
///
/// # Errors
/// [`TrieError::MissingNode`] / [`TrieError::Corrupt`] for any node of the
/// trie.
pub fn entries<S: NodeStore + ?Sized>(
    store: &S,
    root: Root,
) -> Result<Vec<(String, String, Vec<u8>)>, TrieError> {
    let mut out = Vec::new();
    Ctx::new(store).collect(root.0, 0, &mut out)?;
    out.sort_by(cmp_entry);
    Ok(out
        .into_iter()
        .map(|e| (e.event_type, e.state_key, e.value))
        .collect())
}

/// The entries whose event type is `event_type`, as `(state_key, value)`
/// sorted by state key.
///
/// # Cost
/// The trie is keyed by hash, so this walks the whole trie (every node read
/// once), like [`entries`].
///
/// # Errors
/// As [`entries`].
pub fn entries_of_type<S: NodeStore + ?Sized>(
    store: &S,
    root: Root,
    event_type: &str,
) -> Result<Vec<(String, Vec<u8>)>, TrieError> {
    let mut out = Vec::new();
    Ctx::new(store).collect(root.0, 0, &mut out)?;
    let mut out: Vec<(String, Vec<u8>)> = out
        .into_iter()
        .filter(|e| e.event_type == event_type)
        .map(|e| (e.state_key, e.value))
        .collect();
    out.sort();
    Ok(out)
}

/// The changes that turn the state at `from` into the state at `to`, sorted by
/// `(event_type, state_key)`. Applying them to `from` gives `to`.
///
/// # Cost
/// Both tries are walked together and any pair of subtrees with equal hashes
/// is skipped unread, so the cost is proportional to the difference (times the
/// depth), not to the size of the state; `diff(x, x)` reads nothing. Where a
/// subtree on one side is a leaf, the other side's subtree is listed whole
/// (it differs anyway, but for at most that leaf's keys).
///
/// # Errors
/// As [`entries`], for the nodes it reads.
pub fn diff<S: NodeStore + ?Sized>(
    store: &S,
    from: Root,
    to: Root,
) -> Result<Vec<Change>, TrieError> {
    let mut out = Vec::new();
    Ctx::new(store).diff(Some(from.0), Some(to.0), 0, &mut out)?;
    out.sort_by(|a, b| (a.event_type(), a.state_key()).cmp(&(b.event_type(), b.state_key())));
    Ok(out)
}

/// Checks the whole trie at `root`: every node present, well formed and hashing
/// to its address, every leaf on the path its key hash selects, and the shape
/// canonical (see the module docs). Returns its [`TrieStats`]. Meant for tests,
/// repair tools and checking tries received from elsewhere.
///
/// # Cost
/// Reads every node once.
///
/// # Errors
/// [`TrieError::MissingNode`], or [`TrieError::Corrupt`] naming the first
/// violation found.
pub fn verify<S: NodeStore + ?Sized>(store: &S, root: Root) -> Result<TrieStats, TrieError> {
    Ctx::new(store).verify(root)
}

// ---------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    event_type: String,
    state_key: String,
    value: Vec<u8>,
}

fn cmp_entry(a: &Entry, b: &Entry) -> Ordering {
    (a.event_type.as_str(), a.state_key.as_str())
        .cmp(&(b.event_type.as_str(), b.state_key.as_str()))
}

fn cmp_key(e: &Entry, event_type: &str, state_key: &str) -> Ordering {
    (e.event_type.as_str(), e.state_key.as_str()).cmp(&(event_type, state_key))
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Node {
    Empty,
    /// Non-empty, sorted, all with one key hash.
    Leaf(Vec<Entry>),
    /// `bitmap != 0`, `children.len() == bitmap.count_ones()`.
    Branch {
        bitmap: u32,
        children: Vec<NodeHash>,
    },
}

/// The 5-bit chunk of `h` used at `depth` (`depth <= MAX_BRANCH_DEPTH`).
fn chunk(h: &NodeHash, depth: usize) -> u32 {
    debug_assert!(depth <= MAX_BRANCH_DEPTH);
    let off = depth * BITS_PER_LEVEL;
    let byte = off / 8;
    let hi = u32::from(h[byte]);
    let lo = if byte + 1 < h.len() {
        u32::from(h[byte + 1])
    } else {
        0
    };
    (((hi << 8) | lo) >> (11 - off % 8)) & 31
}

/// Position of the child for `bit` among the children of a branch.
fn rank(bitmap: u32, bit: u32) -> usize {
    (bitmap & (bit - 1)).count_ones() as usize
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // Lengths are checked against u32::MAX before an entry enters a node.
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn encode(node: &Node) -> Vec<u8> {
    match node {
        Node::Empty => vec![TAG_EMPTY],
        Node::Leaf(entries) => {
            let size: usize = entries
                .iter()
                .map(|e| 12 + e.event_type.len() + e.state_key.len() + e.value.len())
                .sum();
            let mut out = Vec::with_capacity(5 + size);
            out.push(TAG_LEAF);
            out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
            for e in entries {
                put_bytes(&mut out, e.event_type.as_bytes());
                put_bytes(&mut out, e.state_key.as_bytes());
                put_bytes(&mut out, &e.value);
            }
            out
        }
        Node::Branch { bitmap, children } => {
            let mut out = Vec::with_capacity(5 + 32 * children.len());
            out.push(TAG_BRANCH);
            out.extend_from_slice(&bitmap.to_le_bytes());
            for c in children {
                out.extend_from_slice(c);
            }
            out
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TrieError> {
        if self.buf.len() - self.pos < n {
            return Err(TrieError::Corrupt("node truncated"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, TrieError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn bytes(&mut self) -> Result<&'a [u8], TrieError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, TrieError> {
        let b = self.bytes()?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| TrieError::Corrupt("leaf key is not UTF-8"))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
}

/// Decodes node bytes, checking everything that can be checked without other
/// nodes. Never panics.
fn decode(bytes: &[u8], hasher: KeyHasher) -> Result<Node, TrieError> {
    let (&tag, _) = bytes
        .split_first()
        .ok_or(TrieError::Corrupt("empty node bytes"))?;
    let mut r = Reader { buf: bytes, pos: 1 };
    let node = match tag {
        TAG_EMPTY => Node::Empty,
        TAG_LEAF => {
            let n = r.u32()? as usize;
            if n == 0 {
                return Err(TrieError::Corrupt("leaf with no entries"));
            }
            // Every entry takes at least 12 bytes: bound the allocation.
            if n > r.remaining() / 12 {
                return Err(TrieError::Corrupt("node truncated"));
            }
            let mut entries: Vec<Entry> = Vec::with_capacity(n);
            for _ in 0..n {
                let e = Entry {
                    event_type: r.string()?,
                    state_key: r.string()?,
                    value: r.bytes()?.to_vec(),
                };
                if entries
                    .last()
                    .is_some_and(|prev| cmp_entry(prev, &e) != Ordering::Less)
                {
                    return Err(TrieError::Corrupt("leaf entries not strictly sorted"));
                }
                entries.push(e);
            }
            if entries.len() > 1 {
                let h0 = hasher(&entries[0].event_type, &entries[0].state_key);
                if entries[1..]
                    .iter()
                    .any(|e| hasher(&e.event_type, &e.state_key) != h0)
                {
                    return Err(TrieError::Corrupt("leaf entries with different key hashes"));
                }
            }
            Node::Leaf(entries)
        }
        TAG_BRANCH => {
            let bitmap = r.u32()?;
            if bitmap == 0 {
                return Err(TrieError::Corrupt("branch with no children"));
            }
            let n = bitmap.count_ones() as usize;
            if r.remaining() != 32 * n {
                return Err(TrieError::Corrupt(
                    "branch length does not match its bitmap",
                ));
            }
            let children = (0..n)
                .map(|_| r.take(32).map(|s| s.try_into().expect("32 bytes")))
                .collect::<Result<Vec<NodeHash>, _>>()?;
            Node::Branch { bitmap, children }
        }
        _ => return Err(TrieError::Corrupt("unknown node tag or version")),
    };
    if r.remaining() != 0 {
        return Err(TrieError::Corrupt("trailing bytes after node"));
    }
    Ok(node)
}

type KeyHasher = fn(&str, &str) -> NodeHash;

/// A store plus the key-hash function (always [`key_hash`] outside tests,
/// which substitute weak hashes to force collisions and deep paths).
struct Ctx<'a, S: ?Sized> {
    store: &'a S,
    hasher: KeyHasher,
}

enum Removed {
    NotFound,
    /// The subtree became empty.
    Gone,
    /// The subtree's new node, and whether it is a leaf.
    Replaced(NodeHash, bool),
}

/// Write buffer used by [`apply`]: reads fall through to the base store,
/// writes stay in memory until flushed.
struct Overlay<'a, S: ?Sized> {
    base: &'a S,
    new: RefCell<HashMap<NodeHash, Arc<[u8]>>>,
}

impl<S: NodeStore + ?Sized> NodeStore for Overlay<'_, S> {
    fn get_node(&self, hash: &NodeHash) -> Option<Arc<[u8]>> {
        if let Some(b) = self.new.borrow().get(hash) {
            return Some(b.clone());
        }
        self.base.get_node(hash)
    }

    fn put_node(&self, hash: NodeHash, bytes: Vec<u8>) {
        self.new
            .borrow_mut()
            .entry(hash)
            .or_insert_with(|| bytes.into());
    }
}

fn check_len(parts: &[&[u8]]) -> Result<(), TrieError> {
    if parts.iter().any(|p| p.len() > u32::MAX as usize) {
        return Err(TrieError::Corrupt(
            "key or value longer than u32::MAX bytes",
        ));
    }
    Ok(())
}

impl<'a, S: NodeStore + ?Sized> Ctx<'a, S> {
    fn new(store: &'a S) -> Self {
        Ctx {
            store,
            hasher: key_hash,
        }
    }

    /// Loads and decodes the node `hash` standing at `depth`. The empty node
    /// is recognised without a read, and allowed only at depth 0.
    fn load(&self, hash: &NodeHash, depth: usize) -> Result<Node, TrieError> {
        if *hash == EMPTY_ROOT_HASH {
            return if depth == 0 {
                Ok(Node::Empty)
            } else {
                Err(TrieError::Corrupt("empty node below the root"))
            };
        }
        let bytes = self
            .store
            .get_node(hash)
            .ok_or(TrieError::MissingNode(*hash))?;
        if !self.store.verified() && blake3::hash(&bytes).as_bytes() != hash {
            return Err(TrieError::Corrupt("node bytes do not match their hash"));
        }
        match decode(&bytes, self.hasher)? {
            Node::Empty => Err(TrieError::Corrupt("empty node below the root")),
            Node::Branch { .. } if depth > MAX_BRANCH_DEPTH => {
                Err(TrieError::Corrupt("branch deeper than the key hash"))
            }
            node => Ok(node),
        }
    }

    fn save(&self, node: &Node) -> NodeHash {
        let bytes = encode(node);
        let hash = *blake3::hash(&bytes).as_bytes();
        self.store.put_node(hash, bytes);
        hash
    }

    fn leaf_hash(&self, entries: &[Entry]) -> NodeHash {
        (self.hasher)(&entries[0].event_type, &entries[0].state_key)
    }

    fn lookup(
        &self,
        root: Root,
        event_type: &str,
        state_key: &str,
    ) -> Result<Option<Vec<u8>>, TrieError> {
        let kh = (self.hasher)(event_type, state_key);
        let mut cur = root.0;
        let mut depth = 0;
        loop {
            match self.load(&cur, depth)? {
                Node::Empty => return Ok(None),
                Node::Leaf(mut entries) => {
                    return Ok(entries
                        .binary_search_by(|e| cmp_key(e, event_type, state_key))
                        .ok()
                        .map(|i| std::mem::take(&mut entries[i].value)));
                }
                Node::Branch { bitmap, children } => {
                    let bit = 1u32 << chunk(&kh, depth);
                    if bitmap & bit == 0 {
                        return Ok(None);
                    }
                    cur = children[rank(bitmap, bit)];
                    depth += 1;
                }
            }
        }
    }

    fn insert(
        &self,
        root: Root,
        event_type: &str,
        state_key: &str,
        value: &[u8],
    ) -> Result<Root, TrieError> {
        check_len(&[event_type.as_bytes(), state_key.as_bytes(), value])?;
        let kh = (self.hasher)(event_type, state_key);
        let entry = Entry {
            event_type: event_type.to_owned(),
            state_key: state_key.to_owned(),
            value: value.to_vec(),
        };
        Ok(Root(self.insert_at(root.0, 0, &kh, entry)?))
    }

    fn insert_at(
        &self,
        hash: NodeHash,
        depth: usize,
        kh: &NodeHash,
        entry: Entry,
    ) -> Result<NodeHash, TrieError> {
        match self.load(&hash, depth)? {
            Node::Empty => Ok(self.save(&Node::Leaf(vec![entry]))),
            Node::Leaf(mut entries) => {
                let lh = self.leaf_hash(&entries);
                if lh == *kh {
                    match entries.binary_search_by(|e| cmp_entry(e, &entry)) {
                        Ok(i) if entries[i].value == entry.value => return Ok(hash),
                        Ok(i) => entries[i].value = entry.value,
                        Err(i) => entries.insert(i, entry),
                    }
                    Ok(self.save(&Node::Leaf(entries)))
                } else {
                    let new_leaf = self.save(&Node::Leaf(vec![entry]));
                    self.split(depth, (hash, &lh), (new_leaf, kh))
                }
            }
            Node::Branch {
                bitmap,
                mut children,
            } => {
                let bit = 1u32 << chunk(kh, depth);
                let i = rank(bitmap, bit);
                if bitmap & bit != 0 {
                    let old = children[i];
                    let new = self.insert_at(old, depth + 1, kh, entry)?;
                    if new == old {
                        return Ok(hash);
                    }
                    children[i] = new;
                    Ok(self.save(&Node::Branch { bitmap, children }))
                } else {
                    let leaf = self.save(&Node::Leaf(vec![entry]));
                    children.insert(i, leaf);
                    Ok(self.save(&Node::Branch {
                        bitmap: bitmap | bit,
                        children,
                    }))
                }
            }
        }
    }

    /// The canonical subtree at `depth` holding exactly two leaves with
    /// distinct key hashes: a chain of single-child branches down to the first
    /// depth where their chunks differ, then a two-child branch.
    fn split(
        &self,
        depth: usize,
        a: (NodeHash, &NodeHash),
        b: (NodeHash, &NodeHash),
    ) -> Result<NodeHash, TrieError> {
        let mut d = depth;
        while d <= MAX_BRANCH_DEPTH && chunk(a.1, d) == chunk(b.1, d) {
            d += 1;
        }
        if d > MAX_BRANCH_DEPTH {
            // Distinct hashes always differ by depth 51 unless the existing
            // leaf was placed on a path its hash does not select.
            return Err(TrieError::Corrupt("leaf on the wrong path"));
        }
        let (ca, cb) = (chunk(a.1, d), chunk(b.1, d));
        let children = if ca < cb {
            vec![a.0, b.0]
        } else {
            vec![b.0, a.0]
        };
        let mut h = self.save(&Node::Branch {
            bitmap: (1 << ca) | (1 << cb),
            children,
        });
        for dd in (depth..d).rev() {
            h = self.save(&Node::Branch {
                bitmap: 1 << chunk(a.1, dd),
                children: vec![h],
            });
        }
        Ok(h)
    }

    fn remove(&self, root: Root, event_type: &str, state_key: &str) -> Result<Root, TrieError> {
        let kh = (self.hasher)(event_type, state_key);
        Ok(
            match self.remove_at(root.0, 0, &kh, event_type, state_key)? {
                Removed::NotFound => root,
                Removed::Gone => EMPTY_ROOT,
                Removed::Replaced(h, _) => Root(h),
            },
        )
    }

    fn remove_at(
        &self,
        hash: NodeHash,
        depth: usize,
        kh: &NodeHash,
        event_type: &str,
        state_key: &str,
    ) -> Result<Removed, TrieError> {
        match self.load(&hash, depth)? {
            Node::Empty => Ok(Removed::NotFound),
            Node::Leaf(mut entries) => {
                match entries.binary_search_by(|e| cmp_key(e, event_type, state_key)) {
                    Err(_) => Ok(Removed::NotFound),
                    Ok(i) => {
                        entries.remove(i);
                        if entries.is_empty() {
                            Ok(Removed::Gone)
                        } else {
                            Ok(Removed::Replaced(self.save(&Node::Leaf(entries)), true))
                        }
                    }
                }
            }
            Node::Branch {
                bitmap,
                mut children,
            } => {
                let bit = 1u32 << chunk(kh, depth);
                if bitmap & bit == 0 {
                    return Ok(Removed::NotFound);
                }
                let i = rank(bitmap, bit);
                match self.remove_at(children[i], depth + 1, kh, event_type, state_key)? {
                    Removed::NotFound => Ok(Removed::NotFound),
                    Removed::Gone => {
                        children.remove(i);
                        let bitmap = bitmap & !bit;
                        match children.len() {
                            0 => Ok(Removed::Gone),
                            1 => match self.load(&children[0], depth + 1)? {
                                Node::Leaf(_) => Ok(Removed::Replaced(children[0], true)),
                                _ => Ok(Removed::Replaced(
                                    self.save(&Node::Branch { bitmap, children }),
                                    false,
                                )),
                            },
                            _ => Ok(Removed::Replaced(
                                self.save(&Node::Branch { bitmap, children }),
                                false,
                            )),
                        }
                    }
                    Removed::Replaced(h, true) if children.len() == 1 => {
                        Ok(Removed::Replaced(h, true))
                    }
                    Removed::Replaced(h, _) => {
                        children[i] = h;
                        Ok(Removed::Replaced(
                            self.save(&Node::Branch { bitmap, children }),
                            false,
                        ))
                    }
                }
            }
        }
    }

    fn apply<'o, I>(&self, root: Root, ops: I) -> Result<Root, TrieError>
    where
        I: IntoIterator<Item = (&'o str, &'o str, Option<&'o [u8]>)>,
    {
        let overlay = Overlay {
            base: self.store,
            new: RefCell::new(HashMap::new()),
        };
        let ctx = Ctx {
            store: &overlay,
            hasher: self.hasher,
        };
        let mut cur = root;
        for (t, k, v) in ops {
            cur = match v {
                Some(v) => ctx.insert(cur, t, k, v)?,
                None => ctx.remove(cur, t, k)?,
            };
        }
        let mut new = overlay.new.into_inner();
        self.flush(cur.0, &mut new)?;
        Ok(cur)
    }

    /// Writes the buffered nodes reachable from `hash` to the store, children
    /// first. Nodes not in `new` are already in the store.
    fn flush(
        &self,
        hash: NodeHash,
        new: &mut HashMap<NodeHash, Arc<[u8]>>,
    ) -> Result<(), TrieError> {
        let Some(bytes) = new.remove(&hash) else {
            return Ok(());
        };
        if let Node::Branch { children, .. } = decode(&bytes, self.hasher)? {
            for c in children {
                self.flush(c, new)?;
            }
        }
        self.store.put_node(hash, bytes.to_vec());
        Ok(())
    }

    /// Appends every entry under `hash` (at `depth`) to `out`, unsorted.
    fn collect(&self, hash: NodeHash, depth: usize, out: &mut Vec<Entry>) -> Result<(), TrieError> {
        let node = self.load(&hash, depth)?;
        self.collect_node(node, depth, out)
    }

    fn collect_node(
        &self,
        node: Node,
        depth: usize,
        out: &mut Vec<Entry>,
    ) -> Result<(), TrieError> {
        match node {
            Node::Empty => Ok(()),
            Node::Leaf(entries) => {
                out.extend(entries);
                Ok(())
            }
            Node::Branch { children, .. } => {
                for c in children {
                    self.collect(c, depth + 1, out)?;
                }
                Ok(())
            }
        }
    }

    /// Differences between the subtrees `a` and `b` (`None` = absent) at
    /// `depth`, appended unsorted.
    fn diff(
        &self,
        a: Option<NodeHash>,
        b: Option<NodeHash>,
        depth: usize,
        out: &mut Vec<Change>,
    ) -> Result<(), TrieError> {
        if a == b {
            return Ok(());
        }
        let na = match a {
            Some(h) => self.load(&h, depth)?,
            None => Node::Empty,
        };
        let nb = match b {
            Some(h) => self.load(&h, depth)?,
            None => Node::Empty,
        };
        match (na, nb) {
            (
                Node::Branch {
                    bitmap: ba,
                    children: ca,
                },
                Node::Branch {
                    bitmap: bb,
                    children: cb,
                },
            ) => {
                for i in 0..32 {
                    let bit = 1u32 << i;
                    let x = (ba & bit != 0).then(|| ca[rank(ba, bit)]);
                    let y = (bb & bit != 0).then(|| cb[rank(bb, bit)]);
                    if x.is_some() || y.is_some() {
                        self.diff(x, y, depth + 1, out)?;
                    }
                }
                Ok(())
            }
            // At least one side is a leaf or empty: the other side's subtree
            // is part of the difference anyway (all but at most a leaf's
            // worth of it), so list both and merge.
            (na, nb) => {
                let (mut ea, mut eb) = (Vec::new(), Vec::new());
                self.collect_node(na, depth, &mut ea)?;
                self.collect_node(nb, depth, &mut eb)?;
                ea.sort_by(cmp_entry);
                eb.sort_by(cmp_entry);
                merge_diff(ea, eb, out);
                Ok(())
            }
        }
    }

    fn verify(&self, root: Root) -> Result<TrieStats, TrieError> {
        let mut stats = TrieStats::default();
        let mut path = Vec::new();
        self.verify_at(root.0, &mut path, false, &mut stats)?;
        Ok(stats)
    }

    /// `path` holds the chunks leading to this node (its length is the depth);
    /// `only_child` is whether the parent branch has this as its sole child.
    fn verify_at(
        &self,
        hash: NodeHash,
        path: &mut Vec<u32>,
        only_child: bool,
        stats: &mut TrieStats,
    ) -> Result<(), TrieError> {
        let depth = path.len();
        match self.load(&hash, depth)? {
            Node::Empty => Ok(()),
            Node::Leaf(entries) => {
                if only_child {
                    return Err(TrieError::Corrupt(
                        "non-canonical: branch whose only child is a leaf",
                    ));
                }
                let lh = self.leaf_hash(&entries);
                if path.iter().enumerate().any(|(d, &c)| chunk(&lh, d) != c) {
                    return Err(TrieError::Corrupt("leaf on the wrong path"));
                }
                stats.entries += entries.len();
                stats.leaves += 1;
                stats.max_depth = stats.max_depth.max(depth);
                Ok(())
            }
            Node::Branch { bitmap, children } => {
                stats.branches += 1;
                let single = children.len() == 1;
                let chunks = (0..32u32).filter(|i| bitmap & (1 << i) != 0);
                for (c, child) in chunks.zip(children) {
                    path.push(c);
                    self.verify_at(child, path, single, stats)?;
                    path.pop();
                }
                Ok(())
            }
        }
    }
}

/// Merges two sorted entry lists into changes from `a` to `b`.
fn merge_diff(a: Vec<Entry>, b: Vec<Entry>, out: &mut Vec<Change>) {
    let mut a = a.into_iter().peekable();
    let mut b = b.into_iter().peekable();
    loop {
        let ord = match (a.peek(), b.peek()) {
            (None, None) => return,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(x), Some(y)) => cmp_entry(x, y),
        };
        match ord {
            Ordering::Less => {
                let x = a.next().expect("peeked");
                out.push(Change::Removed {
                    event_type: x.event_type,
                    state_key: x.state_key,
                    old: x.value,
                });
            }
            Ordering::Greater => {
                let y = b.next().expect("peeked");
                out.push(Change::Added {
                    event_type: y.event_type,
                    state_key: y.state_key,
                    value: y.value,
                });
            }
            Ordering::Equal => {
                let x = a.next().expect("peeked");
                let y = b.next().expect("peeked");
                if x.value != y.value {
                    out.push(Change::Changed {
                        event_type: y.event_type,
                        state_key: y.state_key,
                        old: x.value,
                        new: y.value,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// splitmix64: a tiny deterministic PRNG.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn shuffle<T>(&mut self, v: &mut [T]) {
            for i in (1..v.len()).rev() {
                let j = self.below(i + 1);
                v.swap(i, j);
            }
        }
    }

    type Kv = (String, String, Vec<u8>);

    /// `n` distinct realistic-looking state entries.
    fn make_entries(n: usize) -> Vec<Kv> {
        const TYPES: [&str; 6] = [
            "m.room.member",
            "m.room.member",
            "m.room.member",
            "m.room.power_levels",
            "m.space.child",
            "org.example.custom",
        ];
        (0..n)
            .map(|i| {
                let t = TYPES[i % TYPES.len()];
                let sk = if t == "m.room.power_levels" {
                    format!("{i}")
                } else {
                    format!("@user{i}:example.org")
                };
                (t.to_owned(), sk, format!("$event{i}").into_bytes())
            })
            .collect()
    }

    fn build<S: NodeStore + ?Sized>(store: &S, items: &[Kv]) -> Root {
        let mut root = Root::empty();
        for (t, k, v) in items {
            root = insert(store, root, t, k, v).unwrap();
        }
        root
    }

    fn sorted(mut items: Vec<Kv>) -> Vec<Kv> {
        items.sort();
        items
    }

    #[test]
    fn empty_root_is_hash_of_empty_node() {
        assert_eq!(encode(&Node::Empty), vec![0x10]);
        assert_eq!(EMPTY_ROOT.0, *blake3::hash(&[0x10]).as_bytes());
        assert_eq!(Root::empty(), EMPTY_ROOT);
        assert_eq!(Root::default(), EMPTY_ROOT);
        assert!(Root::empty().is_empty());
        assert_eq!(
            Root::empty().to_hex(),
            "b35d4ab392fb952c8d7625efbfaff8af2c8cebf20d1ff9784a8ffe08dc667e12"
        );
        let store = MemStore::new();
        assert_eq!(
            lookup(&store, Root::empty(), "m.room.create", "").unwrap(),
            None
        );
        assert!(entries(&store, Root::empty()).unwrap().is_empty());
        assert_eq!(
            remove(&store, Root::empty(), "a", "b").unwrap(),
            Root::empty()
        );
        assert_eq!(verify(&store, Root::empty()).unwrap(), TrieStats::default());
        assert_eq!(store.reads(), 0);
        assert_eq!(store.writes(), 0);
    }

    #[test]
    fn root_hex_and_bytes() {
        let store = MemStore::new();
        let r = insert(&store, Root::empty(), "m.room.create", "", b"$c").unwrap();
        let h = r.to_hex();
        assert_eq!(h.len(), 64);
        assert_eq!(format!("{r}"), h);
        assert_eq!(Root::from_hex(&h), Some(r));
        assert_eq!(Root::from_hex(&h.to_uppercase()), Some(r));
        assert_eq!(Root::from_hex(&h[..62]), None);
        assert_eq!(Root::from_hex(&format!("{}zz", &h[..62])), None);
        assert_eq!(Root::from_bytes(&r.0), Some(r));
        assert_eq!(Root::from_bytes(&r.0[..31]), None);
        assert_eq!(Root::from_bytes(&[0u8; 33]), None);
        assert_eq!(r.as_bytes(), &r.0);
    }

    #[test]
    fn chunking_covers_all_256_bits() {
        let mut h = [0u8; 32];
        h[0] = 0b1010_1100;
        h[1] = 0b0111_0000;
        assert_eq!(chunk(&h, 0), 0b10101);
        assert_eq!(chunk(&h, 1), 0b10001);
        assert_eq!(chunk(&h, 2), 0b11000);
        let mut last = [0u8; 32];
        last[31] = 1;
        for d in 0..MAX_BRANCH_DEPTH {
            assert_eq!(chunk(&last, d), 0);
        }
        assert_eq!(chunk(&last, MAX_BRANCH_DEPTH), 0b10000);
        // Every single bit is seen by exactly one chunk.
        for bit in 0..256 {
            let mut h = [0u8; 32];
            h[bit / 8] = 0x80 >> (bit % 8);
            let nonzero: Vec<usize> = (0..=MAX_BRANCH_DEPTH)
                .filter(|&d| chunk(&h, d) != 0)
                .collect();
            assert_eq!(nonzero, vec![bit / 5]);
        }
    }

    #[test]
    fn key_encoding_is_unambiguous() {
        assert_ne!(key_hash("a", "bc"), key_hash("ab", "c"));
        assert_ne!(key_hash("", "ab"), key_hash("ab", ""));
        assert_eq!(key_hash("m.room.name", ""), key_hash("m.room.name", ""));
        let store = MemStore::new();
        let r = insert(&store, Root::empty(), "a", "bc", b"1").unwrap();
        let r = insert(&store, r, "ab", "c", b"2").unwrap();
        assert_eq!(lookup(&store, r, "a", "bc").unwrap(), Some(b"1".to_vec()));
        assert_eq!(lookup(&store, r, "ab", "c").unwrap(), Some(b"2".to_vec()));
        assert_eq!(entries(&store, r).unwrap().len(), 2);
    }

    #[test]
    fn single_entry_root_is_a_leaf() {
        let store = MemStore::new();
        let r = insert(&store, Root::empty(), "m.room.create", "", b"$create").unwrap();
        assert_eq!(store.len(), 1);
        let mut expected = vec![TAG_LEAF, 1, 0, 0, 0];
        for part in [&b"m.room.create"[..], b"", b"$create"] {
            expected.extend_from_slice(&(part.len() as u32).to_le_bytes());
            expected.extend_from_slice(part);
        }
        assert_eq!(&*store.get_node(&r.0).unwrap(), &expected[..]);
        assert_eq!(r.0, *blake3::hash(&expected).as_bytes());
    }

    #[test]
    fn round_trips_at_several_sizes() {
        for n in [1usize, 2, 1000, 10_000] {
            let store = MemStore::new();
            let items = make_entries(n);
            let root = build(&store, &items);
            let stats = verify(&store, root).unwrap();
            assert_eq!(stats.entries, n);
            assert_eq!(stats.leaves, n);
            for (t, k, v) in &items {
                assert_eq!(
                    lookup(&store, root, t, k).unwrap().as_deref(),
                    Some(&v[..]),
                    "n={n}"
                );
            }
            assert_eq!(
                lookup(&store, root, "m.room.member", "@nobody:example.org").unwrap(),
                None
            );
            assert_eq!(entries(&store, root).unwrap(), sorted(items.clone()));

            // Remove every third key (for n = 1, 2: the first one).
            let (gone, kept): (Vec<_>, Vec<_>) = items
                .iter()
                .cloned()
                .enumerate()
                .partition(|(i, _)| i % 3 == 0);
            let mut r = root;
            for (_, (t, k, _)) in &gone {
                r = remove(&store, r, t, k).unwrap();
            }
            for (_, (t, k, _)) in &gone {
                assert_eq!(lookup(&store, r, t, k).unwrap(), None);
            }
            for (_, (t, k, v)) in &kept {
                assert_eq!(lookup(&store, r, t, k).unwrap().as_deref(), Some(&v[..]));
            }
            let kept: Vec<Kv> = kept.into_iter().map(|(_, e)| e).collect();
            assert_eq!(entries(&store, r).unwrap(), sorted(kept.clone()));
            assert_eq!(verify(&store, r).unwrap().entries, kept.len());
            assert_eq!(
                r,
                build(&MemStore::new(), &kept),
                "n={n}: canonical after removals"
            );
            // The old root is untouched (persistence).
            assert_eq!(entries(&store, root).unwrap().len(), n);
        }
    }

    #[test]
    fn update_replaces_value() {
        let store = MemStore::new();
        let items = make_entries(100);
        let root = build(&store, &items);
        let (t, k, _) = &items[42];
        let r2 = insert(&store, root, t, k, b"$new").unwrap();
        assert_ne!(r2, root);
        assert_eq!(lookup(&store, r2, t, k).unwrap(), Some(b"$new".to_vec()));
        assert_eq!(
            lookup(&store, root, t, k).unwrap(),
            Some(b"$event42".to_vec())
        );
        assert_eq!(entries(&store, r2).unwrap().len(), 100);
        // Setting it back gives the original root exactly.
        assert_eq!(insert(&store, r2, t, k, b"$event42").unwrap(), root);
    }

    #[test]
    fn insert_of_equal_value_writes_nothing() {
        let store = MemStore::new();
        let items = make_entries(1000);
        let root = build(&store, &items);
        let (len, writes) = (store.len(), store.writes());
        for (t, k, v) in items.iter().step_by(37) {
            assert_eq!(insert(&store, root, t, k, v).unwrap(), root);
        }
        assert_eq!(store.writes(), writes);
        assert_eq!(store.len(), len);
        // Removing an absent key writes nothing either.
        assert_eq!(
            remove(&store, root, "m.room.member", "@absent:x").unwrap(),
            root
        );
        assert_eq!(store.writes(), writes);
    }

    #[test]
    fn root_is_independent_of_order() {
        let items = make_entries(3000);
        let mut roots = Vec::new();
        for seed in [1u64, 2, 3] {
            let mut shuffled = items.clone();
            Rng(seed).shuffle(&mut shuffled);
            assert_ne!(shuffled, items);
            roots.push(build(&MemStore::new(), &shuffled));
        }
        assert_eq!(roots[0], roots[1]);
        assert_eq!(roots[1], roots[2]);
        assert_eq!(roots[0], build(&MemStore::new(), &items));

        // Insert everything, then remove everything in another order: empty.
        let store = MemStore::new();
        let mut r = build(&store, &items);
        let mut order = items.clone();
        Rng(99).shuffle(&mut order);
        for (t, k, _) in &order {
            r = remove(&store, r, t, k).unwrap();
        }
        assert_eq!(r, Root::empty());

        // Insert N, remove half == insert only the other half.
        let store = MemStore::new();
        let full = build(&store, &items);
        let mut idx: Vec<usize> = (0..items.len()).collect();
        Rng(7).shuffle(&mut idx);
        let (drop, keep) = idx.split_at(items.len() / 2);
        let mut r = full;
        for &i in drop {
            r = remove(&store, r, &items[i].0, &items[i].1).unwrap();
        }
        let kept: Vec<Kv> = keep.iter().map(|&i| items[i].clone()).collect();
        assert_eq!(r, build(&MemStore::new(), &kept));
        verify(&store, r).unwrap();

        // Values overwritten along the way do not leave a trace.
        let store = MemStore::new();
        let mut r = Root::empty();
        for (t, k, _) in items.iter().take(500) {
            r = insert(&store, r, t, k, b"placeholder").unwrap();
        }
        for (t, k, v) in items.iter().take(500).rev() {
            r = insert(&store, r, t, k, v).unwrap();
        }
        assert_eq!(r, build(&MemStore::new(), &items[..500]));
    }

    #[test]
    fn insert_shares_structure() {
        let store = MemStore::new();
        let items = make_entries(10_000);
        let root = build(&store, &items);
        let stats = verify(&store, root).unwrap();
        eprintln!("10k: {stats:?}");
        assert!(stats.max_depth <= 6, "{stats:?}");
        for i in 0..20 {
            let sk = format!("@newcomer{i}:example.org");
            let before = store.len();
            let r2 = insert(&store, root, "m.room.member", &sk, b"$join").unwrap();
            let new_nodes = store.len() - before;
            store.reset_counters();
            assert_eq!(
                lookup(&store, r2, "m.room.member", &sk).unwrap(),
                Some(b"$join".to_vec())
            );
            let depth = store.reads() as usize - 1; // branches above the new leaf
            assert!(
                new_nodes <= depth + 1,
                "{new_nodes} new nodes for depth {depth}"
            );
            assert!(
                new_nodes >= 2 && depth <= 6,
                "{new_nodes} new nodes, depth {depth}"
            );
            // The old root is unchanged.
            assert_eq!(lookup(&store, root, "m.room.member", &sk).unwrap(), None);
        }
    }

    #[test]
    fn lookup_reads_one_path() {
        // 10 entries.
        let store = MemStore::new();
        let items = make_entries(10);
        let root = build(&store, &items);
        for (t, k, v) in &items {
            store.reset_counters();
            assert_eq!(lookup(&store, root, t, k).unwrap().as_deref(), Some(&v[..]));
            assert!((1..=3).contains(&store.reads()), "{} reads", store.reads());
        }

        // 100 000 entries (built with `apply` to keep the test quick).
        let store = MemStore::new();
        let items = make_entries(100_000);
        let ops = items
            .iter()
            .map(|(t, k, v)| (t.as_str(), k.as_str(), Some(v.as_slice())));
        let root = apply(&store, Root::empty(), ops).unwrap();
        let stats = verify(&store, root).unwrap();
        assert_eq!(stats.entries, 100_000);
        assert!(stats.max_depth <= 7, "{stats:?}");
        let mut total = 0;
        for (t, k, v) in items.iter().step_by(97) {
            store.reset_counters();
            assert_eq!(lookup(&store, root, t, k).unwrap().as_deref(), Some(&v[..]));
            let reads = store.reads();
            assert!(
                reads as usize <= stats.max_depth + 1 && reads <= 8,
                "{reads} reads"
            );
            total += reads;
        }
        let n = items.iter().step_by(97).count() as u64;
        eprintln!(
            "100k: {stats:?}, average lookup reads {:.2}",
            total as f64 / n as f64
        );
        assert!(total <= 6 * n, "average reads {}", total as f64 / n as f64);
        for i in 0..100 {
            store.reset_counters();
            assert_eq!(
                lookup(&store, root, "m.room.member", &format!("@absent{i}:x")).unwrap(),
                None
            );
            assert!(store.reads() <= 8);
        }
    }

    #[test]
    fn diff_reports_exact_changes() {
        let store = MemStore::new();
        let items = make_entries(500);
        let from = build(&store, &items);
        let mut to = from;
        to = insert(&store, to, "m.room.name", "", b"$name").unwrap();
        to = insert(&store, to, "m.room.member", "@zed:example.org", b"$zed").unwrap();
        to = remove(&store, to, &items[10].0, &items[10].1).unwrap();
        to = remove(&store, to, &items[11].0, &items[11].1).unwrap();
        to = insert(&store, to, &items[20].0, &items[20].1, b"$changed20").unwrap();
        to = insert(&store, to, &items[21].0, &items[21].1, b"$changed21").unwrap();
        // A key changed and changed back does not show up.
        to = insert(&store, to, &items[30].0, &items[30].1, b"$tmp").unwrap();
        to = insert(&store, to, &items[30].0, &items[30].1, &items[30].2).unwrap();

        let mut expected = vec![
            Change::Added {
                event_type: "m.room.name".into(),
                state_key: "".into(),
                value: b"$name".to_vec(),
            },
            Change::Added {
                event_type: "m.room.member".into(),
                state_key: "@zed:example.org".into(),
                value: b"$zed".to_vec(),
            },
            Change::Removed {
                event_type: items[10].0.clone(),
                state_key: items[10].1.clone(),
                old: items[10].2.clone(),
            },
            Change::Removed {
                event_type: items[11].0.clone(),
                state_key: items[11].1.clone(),
                old: items[11].2.clone(),
            },
            Change::Changed {
                event_type: items[20].0.clone(),
                state_key: items[20].1.clone(),
                old: items[20].2.clone(),
                new: b"$changed20".to_vec(),
            },
            Change::Changed {
                event_type: items[21].0.clone(),
                state_key: items[21].1.clone(),
                old: items[21].2.clone(),
                new: b"$changed21".to_vec(),
            },
        ];
        expected
            .sort_by(|a, b| (a.event_type(), a.state_key()).cmp(&(b.event_type(), b.state_key())));
        assert_eq!(diff(&store, from, to).unwrap(), expected);

        // The reverse diff is the inverse.
        let reverse: Vec<Change> = expected
            .iter()
            .map(|c| match c.clone() {
                Change::Added {
                    event_type,
                    state_key,
                    value,
                } => Change::Removed {
                    event_type,
                    state_key,
                    old: value,
                },
                Change::Removed {
                    event_type,
                    state_key,
                    old,
                } => Change::Added {
                    event_type,
                    state_key,
                    value: old,
                },
                Change::Changed {
                    event_type,
                    state_key,
                    old,
                    new,
                } => Change::Changed {
                    event_type,
                    state_key,
                    old: new,
                    new: old,
                },
            })
            .collect();
        assert_eq!(diff(&store, to, from).unwrap(), reverse);
        let added = expected
            .iter()
            .find(|c| c.event_type() == "m.room.name")
            .unwrap();
        assert_eq!(
            (added.old_value(), added.new_value()),
            (None, Some(&b"$name"[..]))
        );
        assert!(
            expected
                .iter()
                .all(|c| c.new_value().is_some() || c.old_value().is_some())
        );

        // Identical roots: nothing, and not a single read.
        store.reset_counters();
        assert!(diff(&store, to, to).unwrap().is_empty());
        assert!(
            diff(&store, Root::empty(), Root::empty())
                .unwrap()
                .is_empty()
        );
        assert_eq!(store.reads(), 0);

        // From / to the empty trie: everything added / removed, sorted.
        let all = diff(&store, Root::empty(), from).unwrap();
        assert_eq!(all.len(), 500);
        let listed: Vec<Kv> = all
            .into_iter()
            .map(|c| match c {
                Change::Added {
                    event_type,
                    state_key,
                    value,
                } => (event_type, state_key, value),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(listed, sorted(items.clone()));
        let gone = diff(&store, from, Root::empty()).unwrap();
        assert!(gone.len() == 500 && gone.iter().all(|c| matches!(c, Change::Removed { .. })));
    }

    #[test]
    fn diff_cost_tracks_the_difference() {
        let store = MemStore::new();
        let items = make_entries(10_000);
        let ops = items
            .iter()
            .map(|(t, k, v)| (t.as_str(), k.as_str(), Some(v.as_slice())));
        let from = apply(&store, Root::empty(), ops).unwrap();
        let to = insert(&store, from, "m.room.topic", "", b"$topic").unwrap();
        store.reset_counters();
        let d = diff(&store, from, to).unwrap();
        assert_eq!(
            d,
            vec![Change::Added {
                event_type: "m.room.topic".into(),
                state_key: "".into(),
                value: b"$topic".to_vec()
            }]
        );
        // Two paths of at most 7 nodes each, not 10 000 entries' worth.
        assert!(store.reads() <= 14, "{} reads", store.reads());
    }

    #[test]
    fn entries_of_type_filters_and_sorts() {
        let store = MemStore::new();
        let items = make_entries(300);
        let root = build(&store, &items);
        let got = entries_of_type(&store, root, "m.space.child").unwrap();
        let mut want: Vec<(String, Vec<u8>)> = items
            .iter()
            .filter(|(t, _, _)| t == "m.space.child")
            .map(|(_, k, v)| (k.clone(), v.clone()))
            .collect();
        want.sort();
        assert_eq!(want.len(), 50);
        assert_eq!(got, want);
        assert!(
            entries_of_type(&store, root, "m.room.nothing")
                .unwrap()
                .is_empty()
        );
        assert!(
            entries_of_type(&store, Root::empty(), "m.room.member")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn apply_matches_sequential_and_writes_only_live_nodes() {
        let items = make_entries(2000);
        let seq_store = MemStore::new();
        let mut seq = build(&seq_store, &items);
        let mut ops: Vec<(&str, &str, Option<&[u8]>)> = items
            .iter()
            .map(|(t, k, v)| (t.as_str(), k.as_str(), Some(v.as_slice())))
            .collect();
        for (t, k, _) in items.iter().step_by(4) {
            ops.push((t, k, None));
            seq = remove(&seq_store, seq, t, k).unwrap();
        }
        ops.push(("m.room.name", "", Some(b"$n1")));
        ops.push(("m.room.name", "", Some(b"$n2")));
        seq = insert(&seq_store, seq, "m.room.name", "", b"$n2").unwrap();

        let store = MemStore::new();
        let r = apply(&store, Root::empty(), ops).unwrap();
        assert_eq!(r, seq);
        let stats = verify(&store, r).unwrap();
        // Every stored node is live, and each was written once.
        assert_eq!(store.len(), stats.leaves + stats.branches);
        assert_eq!(store.writes() as usize, store.len());
        assert!(seq_store.len() > 3 * store.len());

        // Applying on top of an existing root writes only the new path.
        let before = store.len();
        store.reset_counters();
        let r2 = apply(&store, r, [("m.room.topic", "", Some(&b"$t"[..]))]).unwrap();
        assert_eq!(
            r2,
            insert(&seq_store, seq, "m.room.topic", "", b"$t").unwrap()
        );
        assert!(store.len() - before <= 8);
        assert_eq!(apply(&store, r2, std::iter::empty()).unwrap(), r2);
        // Failure writes nothing.
        let mut broken = [0u8; 32];
        broken[0] = 1;
        store.reset_counters();
        assert_eq!(
            apply(&store, Root(broken), [("a", "b", Some(&b"c"[..]))]),
            Err(TrieError::MissingNode(broken))
        );
        assert_eq!(store.writes(), 0);
    }

    #[test]
    fn random_operations_match_a_model() {
        let store = MemStore::new();
        let mut model: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
        let mut rng = Rng(2024);
        let mut root = Root::empty();
        for step in 0..4000 {
            let t = ["m.room.member", "m.room.name", "x"][rng.below(3)];
            let k = format!("k{}", rng.below(400));
            if rng.below(3) == 0 {
                root = remove(&store, root, t, &k).unwrap();
                model.remove(&(t.to_owned(), k));
            } else {
                let v = format!("v{}", rng.below(5)).into_bytes();
                root = insert(&store, root, t, &k, &v).unwrap();
                model.insert((t.to_owned(), k), v);
            }
            if step % 500 == 0 {
                assert_eq!(verify(&store, root).unwrap().entries, model.len());
            }
        }
        let want: Vec<Kv> = model
            .iter()
            .map(|((t, k), v)| (t.clone(), k.clone(), v.clone()))
            .collect();
        assert_eq!(entries(&store, root).unwrap(), want);
        assert_eq!(root, build(&MemStore::new(), &want));
        verify(&store, root).unwrap();
    }

    // --- Collisions and depth exhaustion, with weak key hashes -----------

    /// Every key has the same hash: one collision leaf at the root.
    fn const_hash(_: &str, _: &str) -> NodeHash {
        [7u8; 32]
    }

    /// Only the last byte of the real hash survives: all keys share the first
    /// 248 bits, so paths run 49+ levels deep and only 256 hashes exist
    /// (plenty of collisions with a few hundred keys).
    fn last_byte_hash(t: &str, k: &str) -> NodeHash {
        let mut h = [0u8; 32];
        h[31] = key_hash(t, k)[31];
        h
    }

    /// Only the last bit survives: two hashes, told apart at depth 51.
    fn last_bit_hash(t: &str, k: &str) -> NodeHash {
        let mut h = [0u8; 32];
        h[31] = key_hash(t, k)[31] & 1;
        h
    }

    fn build_with(ctx: &Ctx<'_, MemStore>, items: &[Kv]) -> Root {
        let mut r = Root::empty();
        for (t, k, v) in items {
            r = ctx.insert(r, t, k, v).unwrap();
        }
        r
    }

    fn exercise_hasher(hasher: KeyHasher, n: usize) -> TrieStats {
        let items = make_entries(n);
        let store = MemStore::new();
        let ctx = Ctx {
            store: &store,
            hasher,
        };
        let root = build_with(&ctx, &items);
        let stats = ctx.verify(root).unwrap();
        assert_eq!(stats.entries, n);
        for (t, k, v) in &items {
            assert_eq!(ctx.lookup(root, t, k).unwrap().as_deref(), Some(&v[..]));
        }
        let mut all = Vec::new();
        ctx.collect(root.0, 0, &mut all).unwrap();
        assert_eq!(all.len(), n);
        // Order independence.
        for seed in [11u64, 12] {
            let mut shuffled = items.clone();
            Rng(seed).shuffle(&mut shuffled);
            let s2 = MemStore::new();
            assert_eq!(build_with(&Ctx { store: &s2, hasher }, &shuffled), root);
        }
        // Removing half equals building the other half; removing all empties.
        let mut order = items.clone();
        Rng(5).shuffle(&mut order);
        let mut r = root;
        for (i, (t, k, _)) in order.iter().enumerate() {
            r = ctx.remove(r, t, k).unwrap();
            assert_eq!(ctx.lookup(r, t, k).unwrap(), None);
            if i + 1 == n / 2 {
                ctx.verify(r).unwrap();
                let s2 = MemStore::new();
                assert_eq!(build_with(&Ctx { store: &s2, hasher }, &order[n / 2..]), r);
                let mut changes = Vec::new();
                ctx.diff(Some(root.0), Some(r.0), 0, &mut changes).unwrap();
                assert_eq!(changes.len(), n / 2);
                assert!(changes.iter().all(|c| matches!(c, Change::Removed { .. })));
            }
        }
        assert_eq!(r, Root::empty());
        stats
    }

    #[test]
    fn full_hash_collisions_share_a_sorted_leaf() {
        let stats = exercise_hasher(const_hash, 50);
        assert_eq!((stats.leaves, stats.branches, stats.max_depth), (1, 0, 0));
        let store = MemStore::new();
        let ctx = Ctx {
            store: &store,
            hasher: const_hash,
        };
        let r = build_with(&ctx, &make_entries(3));
        match decode(&store.get_node(&r.0).unwrap(), const_hash).unwrap() {
            Node::Leaf(es) => {
                assert_eq!(es.len(), 3);
                assert!(
                    es.windows(2)
                        .all(|w| cmp_entry(&w[0], &w[1]) == Ordering::Less)
                );
            }
            other => panic!("expected a leaf, got {other:?}"),
        }
        // Updating one entry of a collision leaf keeps the others.
        let r2 = ctx
            .insert(r, "m.room.member", "@user0:example.org", b"$x")
            .unwrap();
        assert_eq!(
            ctx.lookup(r2, "m.room.member", "@user1:example.org")
                .unwrap(),
            Some(b"$event1".to_vec())
        );
        assert_eq!(
            ctx.lookup(r2, "m.room.member", "@user0:example.org")
                .unwrap(),
            Some(b"$x".to_vec())
        );
    }

    #[test]
    fn deep_paths_and_collisions_to_depth_exhaustion() {
        let stats = exercise_hasher(last_byte_hash, 600);
        assert!(stats.leaves < 600 && stats.leaves > 200, "{stats:?}");
        assert_eq!(stats.max_depth, MAX_BRANCH_DEPTH + 1, "{stats:?}");
        let stats = exercise_hasher(last_bit_hash, 40);
        assert_eq!(stats.leaves, 2);
        assert_eq!(stats.branches, MAX_BRANCH_DEPTH + 1);
        assert_eq!(stats.max_depth, MAX_BRANCH_DEPTH + 1);

        // Two keys split only at depth 51; removing one collapses the whole
        // 52-branch chain back into a single root leaf.
        let store = MemStore::new();
        let ctx = Ctx {
            store: &store,
            hasher: last_bit_hash,
        };
        let items = make_entries(40);
        let a = items
            .iter()
            .find(|(t, k, _)| last_bit_hash(t, k)[31] == 0)
            .unwrap();
        let b = items
            .iter()
            .find(|(t, k, _)| last_bit_hash(t, k)[31] == 1)
            .unwrap();
        let ra = ctx.insert(Root::empty(), &a.0, &a.1, &a.2).unwrap();
        let rab = ctx.insert(ra, &b.0, &b.1, &b.2).unwrap();
        store.reset_counters();
        assert_eq!(ctx.lookup(rab, &b.0, &b.1).unwrap(), Some(b.2.clone()));
        assert_eq!(store.reads(), MAX_BRANCH_DEPTH as u64 + 2);
        assert_eq!(ctx.remove(rab, &b.0, &b.1).unwrap(), ra);
    }

    // --- Corruption ---------------------------------------------------------

    fn store_raw(store: &MemStore, bytes: &[u8]) -> Root {
        let h = *blake3::hash(bytes).as_bytes();
        store.put_node(h, bytes.to_vec());
        Root(h)
    }

    fn leaf_bytes(entries: &[(&[u8], &[u8], &[u8])]) -> Vec<u8> {
        let mut out = vec![TAG_LEAF];
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        for (t, k, v) in entries {
            for part in [t, k, v] {
                out.extend_from_slice(&(part.len() as u32).to_le_bytes());
                out.extend_from_slice(part);
            }
        }
        out
    }

    #[test]
    fn malformed_nodes_are_corrupt() {
        let store = MemStore::new();
        let good_leaf = leaf_bytes(&[(b"m.room.name", b"", b"$n")]);
        let good_root = store_raw(&store, &good_leaf);
        assert_eq!(
            lookup(&store, good_root, "m.room.name", "").unwrap(),
            Some(b"$n".to_vec())
        );

        let mut trailing = good_leaf.clone();
        trailing.push(0);
        let mut bad_utf8 = leaf_bytes(&[(b"m.room.name", b"\xff\xfe", b"$n")]);
        let mut two_children = vec![TAG_BRANCH, 0b11, 0, 0, 0];
        two_children.extend_from_slice(&good_root.0);
        let mut version2 = good_leaf.clone();
        version2[0] = 0x21;
        let bad = [
            ("no bytes", vec![]),
            ("unknown tag", vec![0x13, 0, 0, 0, 0]),
            ("other version", version2),
            ("empty with trailing", vec![TAG_EMPTY, 0]),
            ("truncated leaf", good_leaf[..good_leaf.len() - 1].to_vec()),
            ("trailing byte", trailing),
            ("zero entries", vec![TAG_LEAF, 0, 0, 0, 0]),
            (
                "huge count",
                vec![TAG_LEAF, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0],
            ),
            (
                "huge length",
                vec![
                    TAG_LEAF, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0,
                ],
            ),
            ("non-utf8 key", std::mem::take(&mut bad_utf8)),
            (
                "unsorted",
                leaf_bytes(&[(b"b", b"", b"1"), (b"a", b"", b"2")]),
            ),
            (
                "duplicate",
                leaf_bytes(&[(b"a", b"", b"1"), (b"a", b"", b"2")]),
            ),
            (
                "mixed hashes",
                leaf_bytes(&[(b"a", b"", b"1"), (b"b", b"", b"2")]),
            ),
            ("empty bitmap", vec![TAG_BRANCH, 0, 0, 0, 0]),
            ("short branch", two_children),
            ("branch header only", vec![TAG_BRANCH, 1, 0]),
        ];
        for (what, bytes) in bad {
            assert!(
                matches!(decode(&bytes, key_hash), Err(TrieError::Corrupt(_))),
                "{what}"
            );
            if bytes.is_empty() || bytes == [TAG_EMPTY] {
                continue;
            }
            let root = store_raw(&store, &bytes);
            assert!(
                matches!(
                    lookup(&store, root, "m.room.name", ""),
                    Err(TrieError::Corrupt(_))
                ),
                "{what}"
            );
            assert!(
                matches!(entries(&store, root), Err(TrieError::Corrupt(_))),
                "{what}"
            );
            assert!(
                matches!(
                    insert(&store, root, "a", "b", b"c"),
                    Err(TrieError::Corrupt(_))
                ),
                "{what}"
            );
        }

        // Every truncation and every single-byte change of real nodes either
        // fails cleanly or decodes to something else; never a panic.
        let real = MemStore::new();
        let root = build(&real, &make_entries(200));
        let mut rng = Rng(3);
        for bytes in real.map_read().values() {
            for cut in 0..bytes.len() {
                assert!(decode(&bytes[..cut], key_hash).is_err());
            }
            for _ in 0..20 {
                let mut b = bytes.to_vec();
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
                let _ = decode(&b, key_hash);
            }
        }
        verify(&real, root).unwrap();
    }

    #[test]
    fn tampered_and_missing_nodes() {
        let store = MemStore::new();
        let items = make_entries(1000);
        let root = build(&store, &items);
        let (t, k, _) = &items[123];

        // Bytes that do not hash to their address.
        let root_bytes = store.get_node(&root.0).unwrap().to_vec();
        let mut tampered = root_bytes.clone();
        *tampered.last_mut().unwrap() ^= 0x55;
        store.overwrite_node(root.0, tampered);
        assert!(matches!(
            lookup(&store, root, t, k),
            Err(TrieError::Corrupt(_))
        ));
        assert!(matches!(
            diff(&store, root, Root::empty()),
            Err(TrieError::Corrupt(_))
        ));
        store.overwrite_node(root.0, root_bytes);
        assert!(lookup(&store, root, t, k).is_ok());

        // A missing node on the path: MissingNode with its hash, from every
        // operation that needs it; other paths still work.
        let kh = key_hash(t, k);
        let (mut cur, mut depth) = (root.0, 0);
        let path_leaf = loop {
            match decode(&store.get_node(&cur).unwrap(), key_hash).unwrap() {
                Node::Branch { bitmap, children } => {
                    cur = children[rank(bitmap, 1 << chunk(&kh, depth))];
                    depth += 1;
                }
                Node::Leaf(_) => break cur,
                Node::Empty => unreachable!(),
            }
        };
        assert!(store.remove_node(&path_leaf));
        assert_eq!(
            lookup(&store, root, t, k),
            Err(TrieError::MissingNode(path_leaf))
        );
        assert_eq!(
            remove(&store, root, t, k),
            Err(TrieError::MissingNode(path_leaf))
        );
        assert_eq!(
            insert(&store, root, t, k, b"$x"),
            Err(TrieError::MissingNode(path_leaf))
        );
        assert_eq!(
            entries(&store, root),
            Err(TrieError::MissingNode(path_leaf))
        );
        assert_eq!(verify(&store, root), Err(TrieError::MissingNode(path_leaf)));
        assert_eq!(
            diff(&store, Root::empty(), root),
            Err(TrieError::MissingNode(path_leaf))
        );
        let (t2, k2, v2) = items
            .iter()
            .find(|(t2, k2, _)| key_hash(t2, k2)[0] >> 3 != key_hash(t, k)[0] >> 3)
            .unwrap();
        assert_eq!(lookup(&store, root, t2, k2).unwrap().as_ref(), Some(v2));

        let missing_root = Root([9u8; 32]);
        assert_eq!(
            lookup(&store, missing_root, t, k),
            Err(TrieError::MissingNode([9u8; 32]))
        );
        let msg = TrieError::MissingNode([0xab; 32]).to_string();
        assert!(msg.contains(&"ab".repeat(32)), "{msg}");
        assert_eq!(TrieError::Corrupt("x").to_string(), "corrupt state trie: x");
    }

    #[test]
    fn non_canonical_shapes_are_reported() {
        let store = MemStore::new();
        let leaf = store_raw(&store, &leaf_bytes(&[(b"m.room.name", b"", b"$n")]));
        // A branch whose only child is a leaf.
        let c = chunk(&key_hash("m.room.name", ""), 0) as usize;
        let mut b = vec![TAG_BRANCH];
        b.extend_from_slice(&(1u32 << c).to_le_bytes());
        b.extend_from_slice(&leaf.0);
        let single = store_raw(&store, &b);
        assert_eq!(
            lookup(&store, single, "m.room.name", "").unwrap(),
            Some(b"$n".to_vec())
        );
        assert!(matches!(verify(&store, single), Err(TrieError::Corrupt(_))));
        // A leaf in the wrong slot.
        let mut b = vec![TAG_BRANCH];
        let other = (c + 1) % 32;
        let leaf2 = store_raw(&store, &leaf_bytes(&[(b"m.room.topic", b"", b"$t")]));
        let (lo, hi) = if c < other {
            (leaf, leaf2)
        } else {
            (leaf2, leaf)
        };
        b.extend_from_slice(&((1u32 << c) | (1u32 << other)).to_le_bytes());
        b.extend_from_slice(&lo.0);
        b.extend_from_slice(&hi.0);
        let misplaced = store_raw(&store, &b);
        assert!(matches!(
            verify(&store, misplaced),
            Err(TrieError::Corrupt(_))
        ));
        // The empty node as a child.
        let mut b = vec![TAG_BRANCH, 1, 0, 0, 0];
        b.extend_from_slice(&EMPTY_ROOT.0);
        let with_empty = store_raw(&store, &b);
        assert!(matches!(
            entries(&store, with_empty),
            Err(TrieError::Corrupt(_))
        ));
        // A correct two-leaf trie passes.
        let good = insert(&store, Root(leaf.0), "m.room.topic", "", b"$t").unwrap();
        assert_eq!(verify(&store, good).unwrap().entries, 2);
    }

    #[test]
    fn stores_behind_references_and_dyn() {
        let store = Arc::new(MemStore::new());
        let dyn_store: &dyn NodeStore = &*store;
        let r = insert(dyn_store, Root::empty(), "m.room.create", "", b"$c").unwrap();
        assert_eq!(
            lookup(&store, r, "m.room.create", "").unwrap(),
            Some(b"$c".to_vec())
        );
        let boxed: Box<dyn NodeStore> = Box::new(MemStore::new());
        let r2 = insert(&boxed, Root::empty(), "m.room.create", "", b"$c").unwrap();
        assert_eq!(r, r2);
        assert!(!store.is_empty() && store.contains(&r.0));
    }
}
