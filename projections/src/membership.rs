//! Membership projection: per-user room memberships, per-room member lists, and a
//! per-user log of membership changes, whose latest position tells a waiting `/sync`
//! that the user's room list changed.
//!
//! Every local user's room list is also kept in memory ([`Memberships::rooms_kept`],
//! and [`Memberships::get`] for a local user),
//! so a sync of a user in many rooms reads no row per room: loaded from `user_rooms` at
//! reload (start-up, a rebuild's swap, both before any record is applied to the tables
//! read), then each committed member event or forget replaces that room's entry. It is
//! exact, never stale: the rows the table holds, at most one batch's hooks behind the
//! commit (as every in-memory position here). It costs memory per membership row of a
//! local user (remote users never sync: their rows are not kept) and a scan of
//! `user_rooms` at start-up.
//!
//! Tables:
//! - `user_rooms`: user, 0x00, room -> [`Membership`] JSON
//! - `room_members`: room, 0x00, user -> [`Membership`] JSON
//! - `user_log`: user, 0x00, position BE -> room id

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    change_index::SortedKeys,
    runtime::Projection,
    store::{ApplyCtx, LastChange, ProjectionDb, Table, key},
};

/// A user's membership in a room, as of the latest member event.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Membership {
    /// `join`, `invite`, `leave`, `ban` or `knock`.
    pub membership: String,
    /// Position of the member event.
    pub position: u64,
    /// The member event's id.
    pub event_id: String,
    /// Who sent the member event (differs from the user for invites, kicks, bans).
    pub sender: String,
    /// `displayname` from the member event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub displayname: Option<String>,
    /// `avatar_url` from the member event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avatar_url: Option<String>,
    /// The user forgot the room (spec: `/forget`); cleared by the next member event.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forgotten: bool,
}

/// A user's memberships by room id (the rows of `user_rooms` under that user).
pub type RoomList = Arc<BTreeMap<String, Membership>>;

/// The membership projection.
pub struct Memberships {
    user_rooms: Table,
    room_members: Table,
    user_log: Table,
    last: LastChange,
    kept: Arc<RwLock<HashMap<String, Kept>>>,
    /// `:<server name>`: whose room lists are kept (`None`: everyone's).
    local: Option<Arc<str>>,
}

/// A local user's room list as kept in memory: every room with a membership, and the
/// joined ones' ids apart (sorted), which `/sync` hands to the change indexes.
#[derive(Clone, Default)]
struct Kept {
    rooms: RoomList,
    joined: SortedKeys,
}

impl Kept {
    fn new(rooms: RoomList) -> Kept {
        let joined = joined_of(&rooms);
        Kept { rooms, joined }
    }
}

fn joined_of(rooms: &RoomList) -> SortedKeys {
    SortedKeys::from_map(rooms, |m| m.membership == "join")
}

/// Replaces one room's entry in a user's kept room list. Runs after the commit that
/// wrote the row (a list a reader holds is copied first: readers keep their snapshot).
fn keep(
    kept: &RwLock<HashMap<String, Kept>>,
    local: Option<&str>,
    user: String,
    room: String,
    m: Membership,
) {
    if local.is_some_and(|suffix| !user.ends_with(suffix)) {
        return;
    }
    let mut kept = kept.write();
    let entry = kept.entry(user).or_default();
    let joins = m.membership == "join";
    let was_joined = Arc::make_mut(&mut entry.rooms)
        .insert(room, m)
        .is_some_and(|old| old.membership == "join");
    if joins != was_joined {
        entry.joined = joined_of(&entry.rooms);
    }
}

fn decode(v: &[u8]) -> Option<Membership> {
    serde_json::from_slice(v).ok()
}

impl Memberships {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Memberships, String> {
        Ok(Memberships {
            user_rooms: db.table("membership", "user_rooms")?,
            room_members: db.table("membership", "room_members")?,
            user_log: db.table("membership", "user_log")?,
            last: LastChange::default(),
            kept: Arc::default(),
            local: None,
        })
    }

    /// [`Memberships::open`], keeping in memory only the room lists of the users of
    /// `server_name` (the ones who sync).
    pub fn open_local(db: &ProjectionDb, server_name: &str) -> Result<Memberships, String> {
        Ok(Memberships {
            local: Some(Arc::from(format!(":{server_name}"))),
            ..Self::open(db)?
        })
    }

    /// Every room the user has a membership in, as [`Self::rooms_of`], from memory (no
    /// store read): sync and sliding sync ask it on every request, so a room with
    /// nothing new costs them in-memory comparisons only.
    pub fn rooms_kept(&self, user_id: &str) -> RoomList {
        self.kept
            .read()
            .get(user_id)
            .map(|k| k.rooms.clone())
            .unwrap_or_default()
    }

    /// The rooms a local user is joined to, sorted, from memory: both Arc copies of
    /// one snapshot (`(every membership, the joined room ids)`), so the two agree.
    pub fn joined_kept(&self, user_id: &str) -> (RoomList, SortedKeys) {
        self.kept
            .read()
            .get(user_id)
            .map(|k| (k.rooms.clone(), k.joined.clone()))
            .unwrap_or_default()
    }

    /// Every room the user has a membership in (any state), with that membership.
    pub fn rooms_of(&self, user_id: &str) -> Vec<(String, Membership)> {
        let prefix = key::prefix(&[user_id]);
        self.user_rooms
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k[prefix.len()..]).into_owned(),
                    decode(&v)?,
                ))
            })
            .collect()
    }

    /// The user's current membership in a room: from the kept room list for a local
    /// user (no store read: every event rendered for a viewer asks it, for
    /// `unsigned.membership`), else one point read of `user_rooms`.
    pub fn get(&self, room_id: &str, user_id: &str) -> Option<Membership> {
        if self.keeps(user_id) {
            return self
                .kept
                .read()
                .get(user_id)
                .and_then(|k| k.rooms.get(room_id).cloned());
        }
        decode(&self.user_rooms.get(&key::join(&[user_id, room_id]))?)
    }

    /// Whether `user_id`'s room list is kept in memory (a local user, or everyone when
    /// no server name was given): the same rule [`keep`] applies.
    fn keeps(&self, user_id: &str) -> bool {
        self.local
            .as_deref()
            .is_none_or(|suffix| user_id.ends_with(suffix))
    }

    /// Every member of a room (any membership), ordered by user id.
    pub fn members(&self, room_id: &str) -> Vec<(String, Membership)> {
        let prefix = key::prefix(&[room_id]);
        self.room_members
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k[prefix.len()..]).into_owned(),
                    decode(&v)?,
                ))
            })
            .collect()
    }

    /// Position of the user's latest membership change (memory after the first ask).
    pub fn last_change(&self, user_id: &str) -> u64 {
        self.last.get(user_id, &self.user_log)
    }
}

impl Projection for Memberships {
    fn name(&self) -> &'static str {
        "membership"
    }

    /// Facts (a room forgotten) and state events (member events): a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS.and(Interest::STATE_EVENTS)
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.user_rooms.clone(),
            self.room_members.clone(),
            self.user_log.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if let Some(Fact::RoomForgotten { user_id, room_id }) = record.fact() {
            let k = key::join(&[&user_id, &room_id]);
            if let Some(mut m) = ctx.get(&self.user_rooms, &k).and_then(|v| decode(&v)) {
                m.forgotten = true;
                ctx.put(
                    &self.user_rooms,
                    k,
                    serde_json::to_vec(&m).map_err(|e| e.to_string())?,
                );
                let (kept, local) = (self.kept.clone(), self.local.clone());
                ctx.after_commit(move || keep(&kept, local.as_deref(), user_id, room_id, m));
            }
            return Ok(());
        }
        // Outliers (state imported on a remote join) and resolved state count too.
        if !record.applies_to_state() {
            return Ok(());
        }
        let pdu = record.room_pdu().ok_or("unreadable PDU")?;
        if pdu.kind.to_string() != "m.room.member" {
            return Ok(());
        }
        let Some(user) = pdu.state_key.clone() else {
            return Ok(());
        };
        let content = pdu.content_value();
        let m = Membership {
            membership: content
                .get("membership")
                .and_then(|v| v.as_str())
                .unwrap_or("leave")
                .to_owned(),
            position: record.position(),
            event_id: pdu.event_id.to_string(),
            sender: pdu.sender.to_string(),
            displayname: content
                .get("displayname")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            avatar_url: content
                .get("avatar_url")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            forgotten: false,
        };
        let room = pdu.room_id.to_string();
        let bytes = serde_json::to_vec(&m).map_err(|e| e.to_string())?;
        ctx.put(&self.user_rooms, key::join(&[&user, &room]), bytes.clone());
        ctx.put(&self.room_members, key::join(&[&room, &user]), bytes);
        ctx.put(
            &self.user_log,
            key::with_pos(&[&user], record.position()),
            room.clone().into_bytes(),
        );
        let (last, kept, pos) = (self.last.clone(), self.kept.clone(), record.position());
        let local = self.local.clone();
        ctx.after_commit(move || {
            keep(&kept, local.as_deref(), user.clone(), room, m);
            last.bump(user, pos);
        });
        Ok(())
    }

    fn reload(&self) {
        let mut lists: HashMap<String, BTreeMap<String, Membership>> = HashMap::new();
        for (k, v) in self.user_rooms.all() {
            let Some(sep) = k.iter().position(|b| *b == 0) else {
                continue;
            };
            let Some(m) = decode(&v) else {
                continue;
            };
            if self
                .local
                .as_deref()
                .is_some_and(|suffix| !k[..sep].ends_with(suffix.as_bytes()))
            {
                continue;
            }
            lists
                .entry(String::from_utf8_lossy(&k[..sep]).into_owned())
                .or_default()
                .insert(String::from_utf8_lossy(&k[sep + 1..]).into_owned(), m);
        }
        *self.kept.write() = lists
            .into_iter()
            .map(|(user, rooms)| (user, Kept::new(Arc::new(rooms))))
            .collect();
    }
}
