//! Matrix primitives for Spindle. Nothing in this crate does I/O.
//!
//! - [`canonical`]: canonical JSON (spec appendix "Canonical JSON"), via ruma.
//! - [`keys`]: the server's ed25519 signing key and JSON signing/verification.
//! - [`pdu`]: building a PDU (content hash, signature, event id) for room versions 1
//!   to 12, and parsing PDUs of every version.
//! - [`room_version`]: which room versions we serve and their rules.
//! - [`trie`]: the content-addressed state trie (a HAMT addressed by blake3).
//! - [`e2ee`]: signature checks on device and cross-signing keys.
//! - [`auth`]: authorization of an event against room state, delegated to ruma-state-res.
//! - [`acl`]: server access control lists.
//! - [`visibility`]: history visibility, for users and for other servers.

pub mod acl;
pub mod auth;
pub mod canonical;
pub mod e2ee;
pub mod keys;
pub mod pdu;
pub mod room_version;
pub mod trie;
pub mod visibility;

pub use ruma;
