//! Device keys projection (spec: client-server API "End-to-End Encryption", key
//! management): device identity keys, one-time and fallback keys with their counts,
//! and the device-list change logs that `/sync` (`device_lists`) and `/keys/changes`
//! read.
//!
//! A user's device list *changes* when a device is added, renamed or deleted, when a
//! device's keys are uploaded or changed, and when the user's cross-signing keys or a
//! signature by the user on their own keys arrives; for a user of another server, when
//! its server says so ([`Fact::RemoteDeviceListChanged`]). Everyone who shares a room with
//! the user must hear of it, so a change is logged once per room the user is joined to (this
//! projection keeps joined memberships itself, from member events): a syncing user
//! then scans only the logs of their own rooms from their token, never other users'
//! traffic (BRIEF §3.9). Joins and leaves are logged the same way, because a user who
//! newly shares a room is `changed` and one who shares none any more is `left`. A
//! signature on *another* user's key is news only to the signer (as Synapse does: the
//! signer's devices learn that the signed user's keys now carry their signature), so
//! it goes to the signer's own log, naming the signed users.
//!
//! Tables:
//! - `keys`: user, 0x00, device -> the device's signed `DeviceKeys` JSON
//! - `otks`: user, 0x00, device, 0x00, `<algorithm>:<id>` -> one-time key JSON
//! - `otk_counts`: user, 0x00, device, 0x00, algorithm -> u64 BE (unclaimed keys)
//! - `fallback`: user, 0x00, device, 0x00, algorithm -> [`FallbackKey`] JSON
//! - `joined`: user, 0x00, room -> empty (joined memberships)
//! - `room_members`: room, 0x00, user -> empty (joined members)
//! - `room_log`: room, 0x00, position BE -> [`RoomLogEntry`] JSON
//! - `user_log`: user, 0x00, position BE -> [`UserLogEntry`] JSON (own changes)
//! - `cross_signing`: user, 0x00, `master` | `self_signing` | `user_signing` -> key JSON
//! - `signatures`: user, 0x00, key id, 0x00, signer, 0x00, signer key id -> signature
//!   (signatures uploaded on a device key or master key, merged in at query time so a
//!   re-uploaded key keeps them)
//! - `remote_lists`: user -> [`RemoteListMeta`] JSON (our copy of another server's
//!   user's device list: the origin's `stream_id` it is current as of, and whether an
//!   update failed to chain onto it)
//! - `remote_devices`: user, 0x00, device -> [`RemoteDevice`] JSON
//! - `remote_cross_signing`: user, 0x00, `master` | `self_signing` -> key JSON
//!
//! **Remote device lists** (spec: server-server API "Device Management"). A copy
//! starts with a [`Fact::RemoteDeviceListResynced`] (the origin's `/user/devices`
//! answer). An `m.device_list_update` then applies to it when it chains: its
//! `prev_id`s are all at or below the copy's `stream_id` (the copy holds everything
//! up to there); one at or below the copy's `stream_id` itself is already held; any
//! other (a `prev_id` we never saw, or none) marks the copy stale, and a stale copy
//! is not served until the next resync ([`remote_chain`] decides, for the ingest and
//! for this projection alike). An `m.signing_key_update` replaces the cross-signing
//! keys of a fresh copy. When the user leaves a room here the copy goes stale too
//! (they may share no room any more; the next key query resyncs if they still do),
//! and so do the copies of a room's remote members when the room loses its last
//! local member or gains its first (`room_locals`: room -> u32 BE, joined local
//! members), since their servers send us nothing while no local user shares a room.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use spindle_journal::{
    Fact, Interest, RemoteDevice, RemoteDeviceUpdate, RemoteSigningKeys, StoredRecord,
};

use crate::{
    change_index::SortedKeys,
    runtime::Projection,
    store::{ApplyCtx, LastChange, ProjectionDb, Table, key},
};

/// A device's fallback key of one algorithm.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct FallbackKey {
    /// `<algorithm>:<id>`.
    pub key_id: String,
    /// The signed key object.
    pub key: Value,
    /// Handed out by a claim since it was uploaded.
    pub used: bool,
}

/// What happened to a member of a room, as far as device lists go.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RoomLogKind {
    /// The user's device list changed.
    Keys,
    /// The user joined the room.
    Join,
    /// The user left the room (or was kicked or banned).
    Leave,
    /// The user signed other users' keys ([`UserLogEntry::users`]); only in `user_log`.
    Signed,
}

/// One row of `room_log`: `[user, kind]`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RoomLogEntry(pub String, pub RoomLogKind);

/// One row of `user_log`: the user's own device list changed (`room` is `None`), or
/// the user joined or left `room`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct UserLogEntry {
    /// What happened.
    pub kind: RoomLogKind,
    /// The room joined or left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room: Option<String>,
    /// Other users whose keys this user signed (`Keys` or `Signed` entries): they are
    /// `changed` for this user only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub users: Vec<String>,
}

/// Device list changes seen by one user in a window (spec: `device_lists` in `/sync`,
/// and `GET /keys/changes`). Sorted, no duplicates, disjoint.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceListChanges {
    /// Users whose devices changed, or who newly share a room with the user.
    pub changed: Vec<String>,
    /// Users who no longer share any room with the user.
    pub left: Vec<String>,
}

/// A user's cross-signing keys as uploaded.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CrossSigningKeys {
    /// The master key.
    pub master: Option<Value>,
    /// The self-signing key.
    pub self_signing: Option<Value>,
    /// The user-signing key.
    pub user_signing: Option<Value>,
}

/// What this server holds of another server's user's device list (a `remote_lists`
/// row; see the module docs).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RemoteListMeta {
    /// The origin's `stream_id` the copy is current as of.
    pub stream_id: u64,
    /// An update did not chain onto the copy (or there is no copy yet): key queries
    /// ask the origin until a resync replaces it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stale: bool,
    /// The highest `stream_id` of any update heard of for the user: a resync answered
    /// below it predates an update we had and leaves the copy stale.
    #[serde(default)]
    pub seen: u64,
    /// Devices in the copy (at most [`MAX_REMOTE_DEVICES`]: an update that would add
    /// one more makes the copy stale instead).
    #[serde(default)]
    pub devices: u32,
}

/// Most devices a copy of one remote user's list holds (Synapse caps a user's devices
/// at a few thousand too); a fetch keeps the first ones.
pub const MAX_REMOTE_DEVICES: usize = 1_000;

/// How an `m.device_list_update` (origin `stream_id`, `prev_id`s) relates to our copy
/// of the user's device list (`None`: no copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteChain {
    /// It follows what the copy holds: apply it.
    Applies,
    /// The copy already includes it (`stream_id` at or below the copy's).
    Held,
    /// It does not chain (no copy, a stale copy, a `prev_id` above the copy's
    /// `stream_id`, or no `prev_id` at all): the list must be fetched again.
    Gap,
}

/// See [`RemoteChain`]; one rule for the federation ingest (which resyncs on a gap)
/// and for the projection (which marks the copy stale).
pub fn remote_chain(meta: Option<&RemoteListMeta>, stream_id: u64, prev_id: &[u64]) -> RemoteChain {
    match meta {
        Some(m) if !m.stale && stream_id <= m.stream_id => RemoteChain::Held,
        Some(m) if !m.stale && !prev_id.is_empty() && prev_id.iter().all(|p| *p <= m.stream_id) => {
            RemoteChain::Applies
        }
        _ => RemoteChain::Gap,
    }
}

/// A fresh copy of another server's user's device list (see
/// [`DeviceKeys::remote_device_list`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RemoteDeviceList {
    /// The origin's `stream_id` the copy is current as of.
    pub stream_id: u64,
    /// The devices, by device id.
    pub devices: Vec<RemoteDevice>,
    /// The user's master key, if the origin sent one.
    pub master_key: Option<Value>,
    /// The user's self-signing key, if the origin sent one.
    pub self_signing_key: Option<Value>,
}

/// The device keys projection.
pub struct DeviceKeys {
    /// Our server name: whose users are local (a copy of a remote user's list is only
    /// current while one of them shares a room with the user).
    server_name: String,
    remote_lists: Table,
    room_locals: Table,
    remote_devices: Table,
    remote_cross_signing: Table,
    cross_signing: Table,
    signatures: Table,
    keys: Table,
    otks: Table,
    otk_counts: Table,
    fallback: Table,
    joined: Table,
    room_members: Table,
    room_log: Table,
    user_log: Table,
    room_last: LastChange,
    user_last: LastChange,
    device_last: LastChange,
    /// Where the checkpoint is read when the caches start again ([`Projection::reload`]).
    db: ProjectionDb,
}

fn algorithm_of(key_id: &str) -> &str {
    key_id.split_once(':').map(|(a, _)| a).unwrap_or(key_id)
}

fn suffix(k: &[u8], prefix: &[u8]) -> String {
    String::from_utf8_lossy(&k[prefix.len()..]).into_owned()
}

impl DeviceKeys {
    /// Opens the tables for the server called `server_name`.
    pub fn open(db: &ProjectionDb, server_name: &str) -> Result<DeviceKeys, String> {
        let t = |n: &str| db.table("device_keys", n);
        Ok(DeviceKeys {
            server_name: server_name.to_owned(),
            remote_lists: t("remote_lists")?,
            room_locals: t("room_locals")?,
            remote_devices: t("remote_devices")?,
            remote_cross_signing: t("remote_cross_signing")?,
            cross_signing: t("cross_signing")?,
            signatures: t("signatures")?,
            keys: t("keys")?,
            otks: t("otks")?,
            otk_counts: t("otk_counts")?,
            fallback: t("fallback")?,
            joined: t("joined")?,
            room_members: t("room_members")?,
            room_log: t("room_log")?,
            user_log: t("user_log")?,
            room_last: LastChange::known_after(db.checkpoint("device_keys")),
            db: db.clone(),
            user_last: LastChange::default(),
            device_last: LastChange::default(),
        })
    }

    /// The signed device keys of every device of `user_id` that uploaded some, by device id.
    pub fn device_keys(&self, user_id: &str) -> Vec<(String, Value)> {
        let prefix = key::prefix(&[user_id]);
        self.keys
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| Some((suffix(&k, &prefix), serde_json::from_slice(&v).ok()?)))
            .collect()
    }

    /// A user's cross-signing keys (one short scan).
    pub fn cross_signing_keys(&self, user_id: &str) -> CrossSigningKeys {
        let prefix = key::prefix(&[user_id]);
        let mut out = CrossSigningKeys::default();
        for (k, v) in self.cross_signing.scan_prefix(&prefix, 3) {
            let v = serde_json::from_slice(&v).ok();
            match suffix(&k, &prefix).as_str() {
                "master" => out.master = v,
                "self_signing" => out.self_signing = v,
                "user_signing" => out.user_signing = v,
                _ => {}
            }
        }
        out
    }

    /// Uploaded signatures on one key of a user: (signer, signer key id, signature).
    pub fn signatures_on(&self, user_id: &str, key_id: &str) -> Vec<(String, String, String)> {
        let prefix = key::prefix(&[user_id, key_id]);
        self.signatures
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = suffix(&k, &prefix);
                let (signer, signer_key) = rest.split_once('\0')?;
                Some((
                    signer.to_owned(),
                    signer_key.to_owned(),
                    String::from_utf8(v).ok()?,
                ))
            })
            .collect()
    }

    /// `key` (a device's keys, `key_id` its device id, or the master key, `key_id` its
    /// public key) with the uploaded signatures on it merged into `signatures`: the
    /// owner's own for everyone, another signer's only when that signer is `viewer`
    /// (spec: a signature by a user-signing key is visible to its maker only; over
    /// federation there is no viewer, so only the owner's own are shown).
    pub fn with_signatures(
        &self,
        user_id: &str,
        key_id: &str,
        viewer: Option<&str>,
        mut key: Value,
    ) -> Value {
        for (signer, signer_key, sig) in self.signatures_on(user_id, key_id) {
            if signer != user_id && Some(signer.as_str()) != viewer {
                continue;
            }
            let Some(m) = key.as_object_mut() else {
                break;
            };
            let sigs = m
                .entry("signatures")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Some(by) = sigs.as_object_mut().map(|sigs| {
                sigs.entry(signer)
                    .or_insert_with(|| Value::Object(Default::default()))
            }) && let Some(by) = by.as_object_mut()
            {
                by.insert(signer_key, Value::String(sig));
            }
        }
        key
    }

    /// Our copy's state for another server's user (one point read); `None`: no copy.
    pub fn remote_list_meta(&self, user_id: &str) -> Option<RemoteListMeta> {
        serde_json::from_slice(&self.remote_lists.get(user_id.as_bytes())?).ok()
    }

    /// Our copy of another server's user's device list, when it is fresh (a stale
    /// copy or none: `None`, and a key query must ask the origin). Reads: one point
    /// read, one scan of the user's devices, one of their two cross-signing keys.
    pub fn remote_device_list(&self, user_id: &str) -> Option<RemoteDeviceList> {
        let meta = self.remote_list_meta(user_id).filter(|m| !m.stale)?;
        let prefix = key::prefix(&[user_id]);
        let devices = self
            .remote_devices
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect();
        let mut out = RemoteDeviceList {
            stream_id: meta.stream_id,
            devices,
            ..Default::default()
        };
        for (k, v) in self.remote_cross_signing.scan_prefix(&prefix, 2) {
            let v = serde_json::from_slice(&v).ok();
            match suffix(&k, &prefix).as_str() {
                "master" => out.master_key = v,
                "self_signing" => out.self_signing_key = v,
                _ => {}
            }
        }
        Some(out)
    }

    fn is_local(&self, user_id: &str) -> bool {
        user_id
            .split_once(':')
            .is_some_and(|(_, server)| server == self.server_name)
    }

    /// A local member joined (`joined`) or left the room. When the room gains its
    /// first local member or loses its last, our copies of its remote members' lists
    /// go stale: while no local user shared the room, their servers had no reason to
    /// send us their updates (a copy of a user still shared through another room is
    /// refetched needlessly, which is harmless).
    fn count_local(&self, ctx: &mut ApplyCtx, room: &str, joined: bool) {
        let k = room.as_bytes().to_vec();
        let before = ctx
            .get(&self.room_locals, &k)
            .and_then(|v| v.try_into().ok())
            .map(u32::from_be_bytes)
            .unwrap_or(0);
        let after = if joined {
            before + 1
        } else {
            before.saturating_sub(1)
        };
        if after == 0 {
            ctx.delete(&self.room_locals, k);
        } else {
            ctx.put(&self.room_locals, k, after.to_be_bytes().to_vec());
        }
        if (before == 0) != (after == 0) {
            let prefix = key::prefix(&[room]);
            let members: Vec<String> = ctx
                .scan_prefix(&self.room_members, &prefix)
                .into_iter()
                .map(|(k, _)| suffix(&k, &prefix))
                .filter(|u| !self.is_local(u))
                .collect();
            for user in members {
                self.remote_stale(ctx, &user);
            }
        }
    }

    fn put_remote_meta(&self, ctx: &mut ApplyCtx, user_id: &str, meta: &RemoteListMeta) {
        ctx.put(
            &self.remote_lists,
            user_id.as_bytes().to_vec(),
            serde_json::to_vec(meta).expect("rows serialize"),
        );
    }

    fn remote_meta_in(&self, ctx: &ApplyCtx, user_id: &str) -> Option<RemoteListMeta> {
        serde_json::from_slice(&ctx.get(&self.remote_lists, user_id.as_bytes())?).ok()
    }

    /// Marks our copy of the user's list stale, if we hold one.
    fn remote_stale(&self, ctx: &mut ApplyCtx, user_id: &str) {
        if let Some(mut meta) = self.remote_meta_in(ctx, user_id)
            && !meta.stale
        {
            meta.stale = true;
            self.put_remote_meta(ctx, user_id, &meta);
        }
    }

    /// An update that did not chain: the copy (made if there is none) is stale and
    /// remembers the update's `stream_id`.
    fn remote_gap(&self, ctx: &mut ApplyCtx, user_id: &str, stream_id: u64) {
        let mut meta = self.remote_meta_in(ctx, user_id).unwrap_or(RemoteListMeta {
            stream_id: 0,
            stale: true,
            seen: 0,
            devices: 0,
        });
        meta.stale = true;
        meta.seen = meta.seen.max(stream_id);
        self.put_remote_meta(ctx, user_id, &meta);
    }

    fn put_remote_signing(
        &self,
        ctx: &mut ApplyCtx,
        user_id: &str,
        master: Option<&Value>,
        self_signing: Option<&Value>,
    ) {
        for (kind, v) in [("master", master), ("self_signing", self_signing)] {
            if let Some(v) = v {
                ctx.put(
                    &self.remote_cross_signing,
                    key::join(&[user_id, kind]),
                    serde_json::to_vec(v).expect("rows serialize"),
                );
            }
        }
    }

    fn apply_remote_change(
        &self,
        ctx: &mut ApplyCtx,
        user_id: &str,
        stream_id: u64,
        device: Option<&RemoteDeviceUpdate>,
        signing: Option<&RemoteSigningKeys>,
    ) {
        let meta = self.remote_meta_in(ctx, user_id);
        match (device, signing) {
            (Some(d), _) => match remote_chain(meta.as_ref(), stream_id, &d.prev_id) {
                RemoteChain::Applies => {
                    let k = key::join(&[user_id, &d.device_id]);
                    let known = ctx.get(&self.remote_devices, &k).is_some();
                    let mut devices = meta.as_ref().map_or(0, |m| m.devices);
                    if d.deleted {
                        if known {
                            devices = devices.saturating_sub(1);
                        }
                        ctx.delete(&self.remote_devices, k);
                    } else if !known && devices as usize >= MAX_REMOTE_DEVICES {
                        // One device too many: not kept, so the copy is incomplete.
                        self.remote_gap(ctx, user_id, stream_id);
                        return;
                    } else {
                        if !known {
                            devices += 1;
                        }
                        let row = RemoteDevice {
                            device_id: d.device_id.clone(),
                            keys: d.keys.clone(),
                            display_name: d.display_name.clone(),
                        };
                        ctx.put(
                            &self.remote_devices,
                            k,
                            serde_json::to_vec(&row).expect("rows serialize"),
                        );
                    }
                    let seen = meta.map_or(0, |m| m.seen).max(stream_id);
                    self.put_remote_meta(
                        ctx,
                        user_id,
                        &RemoteListMeta {
                            stream_id,
                            stale: false,
                            seen,
                            devices,
                        },
                    );
                }
                RemoteChain::Held => {}
                RemoteChain::Gap => self.remote_gap(ctx, user_id, stream_id),
            },
            (None, Some(keys)) => {
                if meta.is_some_and(|m| !m.stale) {
                    self.put_remote_signing(
                        ctx,
                        user_id,
                        keys.master_key.as_ref(),
                        keys.self_signing_key.as_ref(),
                    );
                }
            }
            (None, None) => self.remote_stale(ctx, user_id),
        }
    }

    fn apply_remote_resync(
        &self,
        ctx: &mut ApplyCtx,
        user_id: &str,
        stream_id: u64,
        devices: &[RemoteDevice],
        master: Option<&Value>,
        self_signing: Option<&Value>,
    ) {
        let prefix = key::prefix(&[user_id]);
        for t in [&self.remote_devices, &self.remote_cross_signing] {
            for (k, _) in ctx.scan_prefix(t, &prefix) {
                ctx.delete(t, k);
            }
        }
        let kept = &devices[..devices.len().min(MAX_REMOTE_DEVICES)];
        for d in kept {
            ctx.put(
                &self.remote_devices,
                key::join(&[user_id, &d.device_id]),
                serde_json::to_vec(d).expect("rows serialize"),
            );
        }
        self.put_remote_signing(ctx, user_id, master, self_signing);
        let seen = self.remote_meta_in(ctx, user_id).map_or(0, |m| m.seen);
        self.put_remote_meta(
            ctx,
            user_id,
            &RemoteListMeta {
                stream_id,
                stale: stream_id < seen,
                seen: seen.max(stream_id),
                devices: kept.len() as u32,
            },
        );
    }

    /// One device's signed device keys (one point read).
    pub fn device_key(&self, user_id: &str, device_id: &str) -> Option<Value> {
        serde_json::from_slice(&self.keys.get(&key::join(&[user_id, device_id]))?).ok()
    }

    /// Unclaimed one-time keys of a device, per algorithm (spec:
    /// `one_time_key_counts`, `device_one_time_keys_count`). One short scan over the
    /// device's algorithms.
    pub fn one_time_key_counts(&self, user_id: &str, device_id: &str) -> BTreeMap<String, u64> {
        let prefix = key::prefix(&[user_id, device_id]);
        self.otk_counts
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let n = u64::from_be_bytes(v.get(..8)?.try_into().ok()?);
                (n > 0).then(|| (suffix(&k, &prefix), n))
            })
            .collect()
    }

    /// Algorithms whose fallback key has not been handed out yet (spec:
    /// `device_unused_fallback_key_types`).
    pub fn unused_fallback_key_types(&self, user_id: &str, device_id: &str) -> Vec<String> {
        let prefix = key::prefix(&[user_id, device_id]);
        self.fallback
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let fk: FallbackKey = serde_json::from_slice(&v).ok()?;
                (!fk.used).then(|| suffix(&k, &prefix))
            })
            .collect()
    }

    /// Position of the latest device-list entry of a room (memory after the first ask).
    pub fn room_last_change(&self, room_id: &str) -> u64 {
        self.room_last.get(room_id, &self.room_log)
    }

    /// Position of the latest own entry of a user (memory after the first ask).
    pub fn user_last_change(&self, user_id: &str) -> u64 {
        self.user_last.get(user_id, &self.user_log)
    }

    /// The version of a user's device list (spec: server-server API, `stream_id` of
    /// `GET /user/devices/{userId}` and of `m.device_list_update`): the journal
    /// position of the latest record that changed the user's devices, their keys or
    /// their cross-signing keys (a [`RoomLogKind::Keys`] entry of `user_log`), 0 when
    /// none did. It only grows, and an `m.device_list_update` EDU sent for a change
    /// carries the position of the record that made it, so the two agree. Joins,
    /// leaves and signatures on other users' keys do not count.
    ///
    /// Memory after the first ask; the first ask reads the user's own log backwards,
    /// a page at a time, down to the latest such entry.
    pub fn device_list_stream_id(&self, user_id: &str) -> u64 {
        const PAGE: usize = 64;
        self.device_last.get_or_find(user_id, || {
            let start = key::prefix(&[user_id]);
            let mut end = start.clone();
            *end.last_mut().expect("non-empty") = 1;
            loop {
                let page = self.user_log.scan_range(&start, &end, true, PAGE);
                for (k, v) in &page {
                    if serde_json::from_slice::<UserLogEntry>(v)
                        .is_ok_and(|e| e.kind == RoomLogKind::Keys)
                    {
                        return key::trailing_pos(k);
                    }
                }
                match page.last() {
                    Some((k, _)) if page.len() == PAGE => end = k.clone(),
                    _ => return 0,
                }
            }
        })
    }

    /// The position of the user's latest device list change before `before` (0: none):
    /// the `prev_id` of the `m.device_list_update` sent for the change at `before`.
    /// Exact only once this projection has applied everything before `before` (the
    /// caller waits for that). Reads the user's own log backwards from `before`, a
    /// page at a time, down to the latest such entry.
    pub fn device_list_stream_id_before(&self, user_id: &str, before: u64) -> u64 {
        const PAGE: usize = 64;
        let start = key::prefix(&[user_id]);
        let mut end = key::with_pos(&[user_id], before);
        loop {
            let page = self.user_log.scan_range(&start, &end, true, PAGE);
            for (k, v) in &page {
                if serde_json::from_slice::<UserLogEntry>(v)
                    .is_ok_and(|e| e.kind == RoomLogKind::Keys)
                {
                    return key::trailing_pos(k);
                }
            }
            match page.last() {
                Some((k, _)) if page.len() == PAGE => end = k.clone(),
                _ => return 0,
            }
        }
    }

    /// Whether anything in `joined_rooms` or the user's own log changed after `after`
    /// (memory only: for waiting long-polls). With `joined_rooms` sorted, the cost
    /// follows the rooms that changed after `after`, not the rooms joined.
    pub fn any_change_after(&self, user_id: &str, joined_rooms: &SortedKeys, after: u64) -> bool {
        self.user_last_change(user_id) > after
            || self
                .rooms_changed_among(joined_rooms, after)
                .into_iter()
                .any(|r| self.room_last_change(r) > after)
    }

    /// Of `joined_rooms`, those with a device-list entry after `after`: from the rooms
    /// that changed when few did (memory, not one lookup per joined room), else all of
    /// them (the caller checks each with [`Self::room_last_change`] either way).
    fn rooms_changed_among<'a>(&self, joined_rooms: &'a SortedKeys, after: u64) -> Vec<&'a str> {
        crate::change_index::changed_or_all(
            self.room_last.changed_after(after, joined_rooms.len()),
            joined_rooms,
        )
    }

    fn is_member(&self, room_id: &str, user_id: &str) -> bool {
        self.room_members
            .get(&key::join(&[room_id, user_id]))
            .is_some()
    }

    fn members(&self, room_id: &str) -> Vec<String> {
        let prefix = key::prefix(&[room_id]);
        self.room_members
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .map(|(k, _)| suffix(&k, &prefix))
            .collect()
    }

    /// Users who came to share a joined room with `user_id` in `(after, upto]`: every
    /// member of a room `user_id` joined in that window, and whoever joined one of
    /// `joined_rooms` in it; only those still joined to one of `joined_rooms`,
    /// `user_id` left out, sorted. `/sync` sends these users' presence even when it
    /// did not change (as Synapse does for newly joined rooms and users). Reads what
    /// [`Self::changes`] reads (the same join log), never other rooms' traffic.
    pub fn newly_shared(
        &self,
        user_id: &str,
        joined_rooms: &SortedKeys,
        after: u64,
        upto: u64,
    ) -> Vec<String> {
        let mut out = BTreeSet::new();
        if upto <= after {
            return Vec::new();
        }
        let range = |parts: &[&str]| {
            (
                key::with_pos(parts, after + 1),
                key::with_pos(parts, upto.saturating_add(1)),
            )
        };
        if self.user_last_change(user_id) > after {
            let (start, end) = range(&[user_id]);
            for (_, v) in self.user_log.scan_range(&start, &end, false, usize::MAX) {
                if let Ok(UserLogEntry {
                    kind: RoomLogKind::Join,
                    room: Some(room),
                    ..
                }) = serde_json::from_slice::<UserLogEntry>(&v)
                {
                    out.extend(self.members(&room));
                }
            }
        }
        for room in self.rooms_changed_among(joined_rooms, after) {
            if self.room_last_change(room) <= after {
                continue;
            }
            let (start, end) = range(&[room]);
            for (_, v) in self.room_log.scan_range(&start, &end, false, usize::MAX) {
                if let Ok(RoomLogEntry(user, RoomLogKind::Join)) = serde_json::from_slice(&v) {
                    out.insert(user);
                }
            }
        }
        out.remove(user_id);
        out.into_iter()
            .filter(|u| joined_rooms.iter().any(|r| self.is_member(r, u)))
            .collect()
    }

    /// Device list changes `user_id` must hear of for `(after, upto]` (spec:
    /// `device_lists` in `/sync`, `GET /keys/changes`). `joined_rooms` are the user's
    /// joined rooms now (sorted: the rooms that changed are found from the in-memory
    /// index, not by asking each joined room). Reads: the device-list log of each
    /// joined room that changed after `after`, the user's own log, and for a room the user
    /// joined or left in the window, its members; then one point lookup per (left
    /// candidate, joined room). Never other rooms' traffic.
    pub fn changes(
        &self,
        user_id: &str,
        joined_rooms: &SortedKeys,
        after: u64,
        upto: u64,
    ) -> DeviceListChanges {
        let mut changed = BTreeSet::new();
        let mut candidates_left = BTreeSet::new();
        // The user itself is `changed` only when its own device list changed (not
        // because it joined a room, which puts it in the member list).
        let mut own_keys_changed = false;
        if upto <= after {
            return DeviceListChanges::default();
        }
        let range = |parts: &[&str]| {
            (
                key::with_pos(parts, after + 1),
                key::with_pos(parts, upto.saturating_add(1)),
            )
        };
        if self.user_last_change(user_id) > after {
            let (start, end) = range(&[user_id]);
            for (_, v) in self.user_log.scan_range(&start, &end, false, usize::MAX) {
                let Ok(e) = serde_json::from_slice::<UserLogEntry>(&v) else {
                    continue;
                };
                changed.extend(e.users);
                match (e.kind, e.room) {
                    (RoomLogKind::Keys, _) => own_keys_changed = true,
                    (RoomLogKind::Join, Some(room)) => changed.extend(self.members(&room)),
                    (RoomLogKind::Leave, Some(room)) => candidates_left.extend(self.members(&room)),
                    _ => {}
                }
            }
        }
        for room in self.rooms_changed_among(joined_rooms, after) {
            if self.room_last_change(room) <= after {
                continue;
            }
            let (start, end) = range(&[room]);
            for (_, v) in self.room_log.scan_range(&start, &end, false, usize::MAX) {
                let Ok(RoomLogEntry(user, kind)) = serde_json::from_slice(&v) else {
                    continue;
                };
                match kind {
                    RoomLogKind::Keys | RoomLogKind::Join => {
                        changed.insert(user);
                    }
                    RoomLogKind::Leave => {
                        candidates_left.insert(user);
                    }
                    RoomLogKind::Signed => {}
                }
            }
        }
        changed.remove(user_id);
        if own_keys_changed {
            changed.insert(user_id.to_owned());
        }
        let mut left = Vec::new();
        for u in candidates_left {
            if u == user_id {
                continue;
            }
            if !joined_rooms.iter().any(|r| self.is_member(r, &u)) {
                changed.remove(&u);
                left.push(u);
            }
        }
        DeviceListChanges {
            changed: changed.into_iter().collect(),
            left,
        }
    }

    /// Logs a device list change of `user_id` in its own log and in every room it is
    /// joined to.
    fn log_keys_change(&self, ctx: &mut ApplyCtx, user_id: &str, position: u64) {
        self.log_keys_change_signing(ctx, user_id, Vec::new(), position);
    }

    /// [`Self::log_keys_change`], with the other users whose keys `user_id` signed in
    /// the same record (one own-log entry per position holds both).
    fn log_keys_change_signing(
        &self,
        ctx: &mut ApplyCtx,
        user_id: &str,
        signed: Vec<String>,
        position: u64,
    ) {
        self.log_user(
            ctx,
            user_id,
            UserLogEntry {
                kind: RoomLogKind::Keys,
                room: None,
                users: signed,
            },
            position,
        );
        let (last, k) = (self.device_last.clone(), user_id.to_owned());
        ctx.after_commit(move || last.bump(k, position));
        let prefix = key::prefix(&[user_id]);
        for (k, _) in ctx.scan_prefix(&self.joined, &prefix) {
            let room = suffix(&k, &prefix);
            self.log_room(
                ctx,
                &room,
                RoomLogEntry(user_id.to_owned(), RoomLogKind::Keys),
                position,
            );
        }
    }

    fn log_user(&self, ctx: &mut ApplyCtx, user_id: &str, e: UserLogEntry, position: u64) {
        ctx.put(
            &self.user_log,
            key::with_pos(&[user_id], position),
            serde_json::to_vec(&e).expect("rows serialize"),
        );
        let (last, k) = (self.user_last.clone(), user_id.to_owned());
        ctx.after_commit(move || last.bump(k, position));
    }

    fn log_room(&self, ctx: &mut ApplyCtx, room_id: &str, e: RoomLogEntry, position: u64) {
        ctx.put(
            &self.room_log,
            key::with_pos(&[room_id], position),
            serde_json::to_vec(&e).expect("rows serialize"),
        );
        let (last, k) = (self.room_last.clone(), room_id.to_owned());
        ctx.after_commit(move || last.bump(k, position));
    }

    fn add_count(
        &self,
        ctx: &ApplyCtx,
        user_id: &str,
        device_id: &str,
        algorithm: &str,
        delta: i64,
    ) {
        let k = key::join(&[user_id, device_id, algorithm]);
        let old = ctx
            .get(&self.otk_counts, &k)
            .and_then(|v| Some(u64::from_be_bytes(v.get(..8)?.try_into().ok()?)))
            .unwrap_or(0);
        let new = old.saturating_add_signed(delta);
        if new == 0 {
            ctx.delete(&self.otk_counts, k);
        } else {
            ctx.put(&self.otk_counts, k, new.to_be_bytes().to_vec());
        }
    }

    fn apply_member(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let pdu = record.room_pdu().ok_or("unreadable PDU")?;
        if pdu.kind.to_string() != "m.room.member" {
            return Ok(());
        }
        let Some(user) = pdu.state_key.clone() else {
            return Ok(());
        };
        let room = pdu.room_id.to_string();
        let joined_now = pdu
            .content_value()
            .get("membership")
            .and_then(|m| m.as_str())
            == Some("join");
        let k = key::join(&[&user, &room]);
        let was_joined = ctx.get(&self.joined, &k).is_some();
        let position = record.position();
        if was_joined != joined_now && self.is_local(&user) {
            self.count_local(ctx, &room, joined_now);
        }
        match (was_joined, joined_now) {
            (false, true) => {
                ctx.put(&self.joined, k, Vec::new());
                ctx.put(&self.room_members, key::join(&[&room, &user]), Vec::new());
                self.log_room(
                    ctx,
                    &room,
                    RoomLogEntry(user.clone(), RoomLogKind::Join),
                    position,
                );
                self.log_user(
                    ctx,
                    &user,
                    UserLogEntry {
                        kind: RoomLogKind::Join,
                        room: Some(room),
                        users: Vec::new(),
                    },
                    position,
                );
            }
            (true, false) => {
                ctx.delete(&self.joined, k);
                ctx.delete(&self.room_members, key::join(&[&room, &user]));
                // They may share no room with us any more (see the module docs).
                self.remote_stale(ctx, &user);
                self.log_room(
                    ctx,
                    &room,
                    RoomLogEntry(user.clone(), RoomLogKind::Leave),
                    position,
                );
                self.log_user(
                    ctx,
                    &user,
                    UserLogEntry {
                        kind: RoomLogKind::Leave,
                        room: Some(room),
                        users: Vec::new(),
                    },
                    position,
                );
            }
            _ => {}
        }
        Ok(())
    }
}

impl Projection for DeviceKeys {
    fn name(&self) -> &'static str {
        "device_keys"
    }

    /// At start, after a failed commit, or on new tables (an online rebuild, whose
    /// rows may not match the remembered positions): start again from the checkpoint.
    fn reload(&self) {
        let checkpoint = self.db.checkpoint("device_keys");
        for last in [&self.room_last, &self.user_last, &self.device_last] {
            last.reset(checkpoint);
        }
    }

    /// Facts and state events (member events): a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS.and(Interest::STATE_EVENTS)
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.remote_lists.clone(),
            self.room_locals.clone(),
            self.remote_devices.clone(),
            self.remote_cross_signing.clone(),
            self.cross_signing.clone(),
            self.signatures.clone(),
            self.keys.clone(),
            self.otks.clone(),
            self.otk_counts.clone(),
            self.fallback.clone(),
            self.joined.clone(),
            self.room_members.clone(),
            self.room_log.clone(),
            self.user_log.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        // Outliers (the state imported on a remote join) and resolved state carry
        // memberships too: without them the members already in a room we joined over
        // federation would never be logged, and their device changes never heard of.
        if record.applies_to_state() {
            return self.apply_member(ctx, record);
        }
        let Some(fact) = record.fact() else {
            return Ok(());
        };
        let position = record.position();
        let json = |v: &Value| serde_json::to_vec(v).expect("rows serialize");
        match fact {
            Fact::DeviceKeysUploaded {
                user_id,
                device_id,
                device_keys,
            } => {
                let k = key::join(&[&user_id, &device_id]);
                let bytes = json(&device_keys);
                if ctx.get(&self.keys, &k).as_deref() != Some(bytes.as_slice()) {
                    ctx.put(&self.keys, k, bytes);
                    self.log_keys_change(ctx, &user_id, position);
                }
            }
            Fact::OneTimeKeysUploaded {
                user_id,
                device_id,
                one_time_keys,
            } => {
                for (key_id, key) in one_time_keys {
                    let k = key::join(&[&user_id, &device_id, &key_id]);
                    if ctx.get(&self.otks, &k).is_none() {
                        self.add_count(ctx, &user_id, &device_id, algorithm_of(&key_id), 1);
                    }
                    ctx.put(&self.otks, k, json(&key));
                }
            }
            Fact::FallbackKeysUploaded {
                user_id,
                device_id,
                fallback_keys,
            } => {
                for (key_id, key) in fallback_keys {
                    let algorithm = algorithm_of(&key_id).to_owned();
                    let row = FallbackKey {
                        key_id,
                        key,
                        used: false,
                    };
                    ctx.put(
                        &self.fallback,
                        key::join(&[&user_id, &device_id, &algorithm]),
                        serde_json::to_vec(&row).expect("rows serialize"),
                    );
                }
            }
            Fact::OneTimeKeysClaimed { claims } => {
                for c in claims {
                    if c.fallback {
                        let k = key::join(&[&c.user_id, &c.device_id, algorithm_of(&c.key_id)]);
                        if let Some(mut fk) = ctx
                            .get(&self.fallback, &k)
                            .and_then(|v| serde_json::from_slice::<FallbackKey>(&v).ok())
                            && fk.key_id == c.key_id
                            && !fk.used
                        {
                            fk.used = true;
                            ctx.put(
                                &self.fallback,
                                k,
                                serde_json::to_vec(&fk).expect("rows serialize"),
                            );
                        }
                    } else {
                        let k = key::join(&[&c.user_id, &c.device_id, &c.key_id]);
                        if ctx.get(&self.otks, &k).is_some() {
                            ctx.delete(&self.otks, k);
                            self.add_count(
                                ctx,
                                &c.user_id,
                                &c.device_id,
                                algorithm_of(&c.key_id),
                                -1,
                            );
                        }
                    }
                }
            }
            // A new device, and a new display name (part of what /keys/query shows),
            // change the device list whether or not the device has keys yet (as
            // Synapse: clients re-query and see the device appear).
            Fact::DeviceCreated { user_id, .. } | Fact::DeviceRenamed { user_id, .. } => {
                self.log_keys_change(ctx, &user_id, position);
            }
            Fact::RemoteDeviceListChanged {
                user_id,
                stream_id,
                device,
                signing_keys,
            } => {
                self.apply_remote_change(
                    ctx,
                    &user_id,
                    stream_id,
                    device.as_ref(),
                    signing_keys.as_ref(),
                );
                self.log_keys_change(ctx, &user_id, position);
            }
            Fact::RemoteDeviceListResynced {
                user_id,
                stream_id,
                devices,
                master_key,
                self_signing_key,
            } => {
                // Not logged as a change: the update that made us fetch it was (a
                // client that asked meanwhile got the origin's own answer).
                self.apply_remote_resync(
                    ctx,
                    &user_id,
                    stream_id,
                    &devices,
                    master_key.as_ref(),
                    self_signing_key.as_ref(),
                );
            }
            Fact::CrossSigningKeysUploaded {
                user_id,
                master_key,
                self_signing_key,
                user_signing_key,
            } => {
                for (kind, v) in [
                    ("master", master_key),
                    ("self_signing", self_signing_key),
                    ("user_signing", user_signing_key),
                ] {
                    if let Some(v) = v {
                        ctx.put(&self.cross_signing, key::join(&[&user_id, kind]), json(&v));
                    }
                }
                self.log_keys_change(ctx, &user_id, position);
            }
            Fact::SignaturesUploaded { signatures } => {
                // signer -> (signed their own keys, other users they signed)
                let mut signers: BTreeMap<String, (bool, BTreeSet<String>)> = BTreeMap::new();
                for sig in signatures {
                    ctx.put(
                        &self.signatures,
                        key::join(&[&sig.user_id, &sig.key_id, &sig.signer, &sig.signer_key_id]),
                        sig.signature.into_bytes(),
                    );
                    let entry = signers.entry(sig.signer.clone()).or_default();
                    if sig.user_id == sig.signer {
                        entry.0 = true;
                    } else {
                        entry.1.insert(sig.user_id);
                    }
                }
                for (signer, (own, others)) in signers {
                    let others: Vec<String> = others.into_iter().collect();
                    if own {
                        self.log_keys_change_signing(ctx, &signer, others, position);
                    } else {
                        self.log_user(
                            ctx,
                            &signer,
                            UserLogEntry {
                                kind: RoomLogKind::Signed,
                                room: None,
                                users: others,
                            },
                            position,
                        );
                    }
                }
            }
            Fact::DeviceDeleted { user_id, device_id } => {
                ctx.delete(&self.keys, key::join(&[&user_id, &device_id]));
                let prefix = key::prefix(&[&user_id, &device_id]);
                for t in [&self.otks, &self.otk_counts, &self.fallback] {
                    for (k, _) in ctx.scan_prefix(t, &prefix) {
                        ctx.delete(t, k);
                    }
                }
                self.log_keys_change(ctx, &user_id, position);
            }
            _ => {}
        }
        Ok(())
    }
}
