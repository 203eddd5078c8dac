//! Server-side key backup projection (spec: client-server API "Server-side key
//! backups"): backup versions and the backed-up room keys of each.
//!
//! A version's id is the journal position of the record that created it (unique,
//! increasing, decided at append). Uploading a session replaces the stored one only
//! when the new one is better (spec: `is_verified` beats unverified, then the lower
//! `first_message_index`, then the lower `forwarded_count`). Every change to a
//! version's keys bumps its `etag`.
//!
//! Tables:
//! - `versions`: user, 0x00, version BE -> [`BackupVersion`] JSON
//! - `sessions`: user, 0x00, version BE, room, 0x00, session -> `KeyBackupData` JSON

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// One backup version.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct BackupVersion {
    /// The version id (the creating record's position).
    pub version: u64,
    /// e.g. `m.megolm_backup.v1.curve25519-aes-sha2`.
    pub algorithm: String,
    /// Algorithm-dependent data (public key, signatures).
    pub auth_data: Value,
    /// Number of sessions stored.
    pub count: u64,
    /// Bumped by every change to the stored sessions.
    pub etag: u64,
}

/// The key backup projection.
pub struct KeyBackup {
    versions: Table,
    sessions: Table,
}

fn version_key(user_id: &str, version: u64) -> Vec<u8> {
    key::with_pos(&[user_id], version)
}

fn session_prefix(user_id: &str, version: u64, room: Option<&str>) -> Vec<u8> {
    let mut k = version_key(user_id, version);
    if let Some(room) = room {
        k.extend_from_slice(room.as_bytes());
        k.push(0);
    }
    k
}

/// Whether `new` should replace `old` (spec: "Server-side key backups", the rules
/// for storing a session that is already backed up).
pub fn is_better(new: &Value, old: &Value) -> bool {
    let verified = |v: &Value| {
        v.get("is_verified")
            .and_then(|x| x.as_bool())
            .unwrap_or(false)
    };
    let num = |v: &Value, f: &str| v.get(f).and_then(|x| x.as_u64()).unwrap_or(u64::MAX);
    if verified(new) != verified(old) {
        return verified(new);
    }
    let (nf, of) = (
        num(new, "first_message_index"),
        num(old, "first_message_index"),
    );
    if nf != of {
        return nf < of;
    }
    num(new, "forwarded_count") < num(old, "forwarded_count")
}

impl KeyBackup {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<KeyBackup, String> {
        Ok(KeyBackup {
            versions: db.table("key_backup", "versions")?,
            sessions: db.table("key_backup", "sessions")?,
        })
    }

    /// A backup version of the user (`None`: the latest).
    pub fn version(&self, user_id: &str, version: Option<u64>) -> Option<BackupVersion> {
        let row = match version {
            Some(v) => self.versions.get(&version_key(user_id, v))?,
            None => {
                let start = key::prefix(&[user_id]);
                let end = version_key(user_id, u64::MAX);
                let mut rows = self.versions.scan_range(&start, &end, true, 1);
                rows.pop()?.1
            }
        };
        serde_json::from_slice(&row).ok()
    }

    /// Stored sessions of a version, optionally one room or one session:
    /// room -> session -> data.
    pub fn sessions(
        &self,
        user_id: &str,
        version: u64,
        room: Option<&str>,
        session: Option<&str>,
    ) -> BTreeMap<String, BTreeMap<String, Value>> {
        let mut out: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
        if let (Some(room), Some(session)) = (room, session) {
            let mut k = session_prefix(user_id, version, Some(room));
            k.extend_from_slice(session.as_bytes());
            if let Some(v) = self
                .sessions
                .get(&k)
                .and_then(|v| serde_json::from_slice(&v).ok())
            {
                out.entry(room.to_owned())
                    .or_default()
                    .insert(session.to_owned(), v);
            }
            return out;
        }
        let base = session_prefix(user_id, version, None);
        let prefix = session_prefix(user_id, version, room);
        for (k, v) in self.sessions.scan_prefix(&prefix, usize::MAX) {
            let rest = String::from_utf8_lossy(&k[base.len()..]).into_owned();
            let Some((room, session)) = rest.split_once('\0') else {
                continue;
            };
            if let Ok(v) = serde_json::from_slice(&v) {
                out.entry(room.to_owned())
                    .or_default()
                    .insert(session.to_owned(), v);
            }
        }
        out
    }

    fn load(&self, ctx: &ApplyCtx, user_id: &str, version: u64) -> Option<BackupVersion> {
        serde_json::from_slice(&ctx.get(&self.versions, &version_key(user_id, version))?).ok()
    }

    fn save(&self, ctx: &ApplyCtx, user_id: &str, v: &BackupVersion) {
        ctx.put(
            &self.versions,
            version_key(user_id, v.version),
            serde_json::to_vec(v).expect("rows serialize"),
        );
    }
}

impl Projection for KeyBackup {
    fn name(&self) -> &'static str {
        "key_backup"
    }

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
    }

    fn tables(&self) -> Vec<Table> {
        vec![self.versions.clone(), self.sessions.clone()]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let Some(fact) = record.fact() else {
            return Ok(());
        };
        match fact {
            Fact::BackupVersionCreated {
                user_id,
                algorithm,
                auth_data,
            } => {
                let v = BackupVersion {
                    version: record.position(),
                    algorithm,
                    auth_data,
                    count: 0,
                    etag: 0,
                };
                self.save(ctx, &user_id, &v);
            }
            Fact::BackupVersionUpdated {
                user_id,
                version,
                auth_data,
            } => {
                if let Some(mut v) = self.load(ctx, &user_id, version) {
                    v.auth_data = auth_data;
                    self.save(ctx, &user_id, &v);
                }
            }
            Fact::BackupVersionDeleted { user_id, version } => {
                ctx.delete(&self.versions, version_key(&user_id, version));
                for (k, _) in
                    ctx.scan_prefix(&self.sessions, &session_prefix(&user_id, version, None))
                {
                    ctx.delete(&self.sessions, k);
                }
            }
            Fact::RoomKeysUploaded {
                user_id,
                version,
                rooms,
            } => {
                let Some(mut v) = self.load(ctx, &user_id, version) else {
                    return Ok(());
                };
                let mut changed = false;
                for (room, sessions) in rooms {
                    for (session, data) in sessions {
                        let mut k = session_prefix(&user_id, version, Some(&room));
                        k.extend_from_slice(session.as_bytes());
                        let old = ctx
                            .get(&self.sessions, &k)
                            .and_then(|o| serde_json::from_slice::<Value>(&o).ok());
                        let replace = match &old {
                            None => {
                                v.count += 1;
                                true
                            }
                            Some(old) => is_better(&data, old),
                        };
                        if replace {
                            ctx.put(
                                &self.sessions,
                                k,
                                serde_json::to_vec(&data).expect("rows serialize"),
                            );
                            changed = true;
                        }
                    }
                }
                if changed {
                    v.etag += 1;
                    self.save(ctx, &user_id, &v);
                }
            }
            Fact::RoomKeysDeleted {
                user_id,
                version,
                room_id,
                session_id,
            } => {
                let Some(mut v) = self.load(ctx, &user_id, version) else {
                    return Ok(());
                };
                let mut prefix = session_prefix(&user_id, version, room_id.as_deref());
                let rows = match (&room_id, &session_id) {
                    (Some(_), Some(s)) => {
                        prefix.extend_from_slice(s.as_bytes());
                        ctx.get(&self.sessions, &prefix)
                            .map(|x| vec![(prefix.clone(), x)])
                            .unwrap_or_default()
                    }
                    _ => ctx.scan_prefix(&self.sessions, &prefix),
                };
                if !rows.is_empty() {
                    for (k, _) in &rows {
                        ctx.delete(&self.sessions, k.clone());
                    }
                    v.count = v.count.saturating_sub(rows.len() as u64);
                    v.etag += 1;
                    self.save(ctx, &user_id, &v);
                }
            }
            _ => {}
        }
        Ok(())
    }
}
