//! Spindle's read models. Every projection tails the journal from its own checkpoint
//! ([`runtime`]), keeps its own tables in the projections database ([`store`]) and can
//! be deleted and rebuilt by replay with byte-identical contents (BRIEF §3.2).
//!
//! | projection | job |
//! |---|---|
//! | [`timeline::Timeline`] | events by id, room stream index (room, position), redactions, recency, last bump (`bump_stamp`) |
//! | [`state::State`] | state trie after every event, current state, room metadata |
//! | [`membership::Memberships`] | memberships per user and per room, per-user change log |
//! | [`accounts::Accounts`] | accounts, devices, access tokens (hashed), profiles |
//! | [`user_data::Filters`] | sync filters |
//! | [`user_data::AccountData`] | global and per-room account data |
//! | [`user_data::Receipts`] | receipts, read positions |
//! | [`user_data::Aliases`] | room aliases |
//! | [`audit::Audit`] | audit trails: room state changes, account facts, server admins |
//! | [`room_summary::RoomSummary`] | joined/invited counts and heroes per room |
//! | [`directory::Directory`] | public room directory, public-join rooms, joined counts |
//! | [`directory::EventTimes`] | events by (room, origin_server_ts) |
//! | [`device_keys::DeviceKeys`] | device keys, one-time and fallback keys, device-list change logs |
//! | [`to_device::ToDevice`] | to-device inboxes per device |
//! | [`key_backup::KeyBackup`] | server-side key backup versions and room keys |
//! | [`media::Media`] | media metadata (content hash, type, name) per media id |
//! | [`push::Push`] | push rules, per-recipient evaluation, unread and highlight counts, notifications, the push queue |
//! | [`push::Pushers`] | pushers, by device (removed with it) |
//! | [`delayed::DelayedEvents`] | the delayed-event heap (MSC4140), keyed by deadline |
//! | [`relations::Relations`] | relations by parent, bundled aggregations, threads by activity |
//! | [`search::Search`] | full-text index of room events (tantivy) for `/search` |
//! | [`server_admin::ServerAdmin`] | account creation times, media per uploader, event reports, room shutdowns (the Synapse admin API) |

pub mod accounts;
pub mod audit;
pub mod change_index;
pub mod delayed;
pub mod device_keys;
pub mod directory;
pub mod discovery;
pub mod joins;
pub mod key_backup;
pub mod media;
pub mod membership;
pub mod push;
pub mod push_rules;
pub mod relations;
pub mod render;
pub mod room_summary;
pub mod runtime;
pub mod search;
pub mod server_admin;
pub mod state;
pub mod store;
pub mod timeline;
pub mod to_device;
pub mod user_data;

use std::{path::Path, sync::Arc};

use spindle_journal::Journal;

pub use runtime::{
    Projection, ProjectionHold, ProjectionStatus, RebuildError, RebuildProgress, Runtime,
    TableDiff, diff_outside, diff_tables, render_key,
};
pub use store::ProjectionDb;

/// Every projection, opened on one database, plus the runtime that feeds them.
#[derive(Clone)]
pub struct Projections {
    /// Events and room stream index.
    pub timeline: Arc<timeline::Timeline>,
    /// State trie.
    pub state: Arc<state::State>,
    /// Memberships.
    pub membership: Arc<membership::Memberships>,
    /// Accounts, devices, tokens, profiles.
    pub accounts: Arc<accounts::Accounts>,
    /// Filters.
    pub filters: Arc<user_data::Filters>,
    /// Account data.
    pub account_data: Arc<user_data::AccountData>,
    /// Receipts.
    pub receipts: Arc<user_data::Receipts>,
    /// Aliases.
    pub aliases: Arc<user_data::Aliases>,
    /// Member counts and heroes per room.
    pub room_summary: Arc<room_summary::RoomSummary>,
    /// Audit trails (state changes per room, facts per account, admins).
    pub audit: Arc<audit::Audit>,
    /// Room directory, public-join rooms, joined counts.
    pub directory: Arc<directory::Directory>,
    /// Events by timestamp.
    pub event_times: Arc<directory::EventTimes>,
    /// Device keys and device-list changes.
    pub device_keys: Arc<device_keys::DeviceKeys>,
    /// To-device inboxes.
    pub to_device: Arc<to_device::ToDevice>,
    /// Key backups.
    pub key_backup: Arc<key_backup::KeyBackup>,
    /// Media metadata.
    pub media: Arc<media::Media>,
    /// Push rules, unread counts, notifications.
    pub push: Arc<push::Push>,
    /// Pushers.
    pub pushers: Arc<push::Pushers>,
    /// The delayed-event heap (MSC4140).
    pub delayed: Arc<delayed::DelayedEvents>,
    /// Relations, aggregations, threads.
    pub relations: Arc<relations::Relations>,
    /// Full-text index of room events.
    pub search: Arc<search::Search>,
    /// What the server-admin API lists (creation times, media per user, reports).
    pub server_admin: Arc<server_admin::ServerAdmin>,
    /// The runtime (checkpoints, waiting).
    pub runtime: Runtime,
    /// The database (counters).
    pub db: ProjectionDb,
    /// Our server name (the journal key's), for projections that tell local users apart.
    pub server_name: String,
}

/// Opens a fresh instance of the projection called `name` on `db` (`None`: no such
/// projection). Keep in step with [`Projections::start`].
fn open_by_name(
    name: &str,
    db: &ProjectionDb,
    server_name: &str,
    journal: &Journal,
) -> Option<Result<Arc<dyn Projection>, String>> {
    fn arc<P: Projection>(p: Result<P, String>) -> Result<Arc<dyn Projection>, String> {
        p.map(|p| Arc::new(p) as Arc<dyn Projection>)
    }
    Some(match name {
        "timeline" => arc(timeline::Timeline::open_on(
            db,
            timeline::EVENT_CACHE_BYTES,
            Some(journal.clone()),
        )),
        "state" => arc(state::State::open(db).map(|s| s.with_journal(journal.clone()))),
        "membership" => arc(membership::Memberships::open_local(db, server_name)),
        "accounts" => arc(accounts::Accounts::open(db)),
        "filters" => arc(user_data::Filters::open(db)),
        "account_data" => arc(user_data::AccountData::open(db)),
        "receipts" => arc(user_data::Receipts::open(db)),
        "aliases" => arc(user_data::Aliases::open(db)),
        "room_summary" => arc(room_summary::RoomSummary::open(db)),
        "audit" => arc(audit::Audit::open(db)),
        "directory" => arc(directory::Directory::open(db)),
        "event_times" => arc(directory::EventTimes::open(db)),
        "device_keys" => arc(device_keys::DeviceKeys::open(db, server_name)),
        "to_device" => arc(to_device::ToDevice::open(db)),
        "key_backup" => arc(key_backup::KeyBackup::open(db)),
        "media" => arc(media::Media::open(db)),
        "push" => arc(push::Push::open(db)),
        "pushers" => arc(push::Pushers::open(db)),
        "delayed_events" => arc(delayed::DelayedEvents::open(db)),
        "relations" => arc(relations::Relations::open(db)),
        "server_admin" => arc(server_admin::ServerAdmin::open(db)),
        // The search index lives in its own tantivy directory, not in generations of
        // fjall keyspaces: it is rebuilt offline (see `Projections::rebuild_online`).
        "search" => Err("search".into()),
        _ => return None,
    })
}

/// Settings of the projections that have any.
#[derive(Debug, Clone, Copy)]
pub struct ProjectionOptions {
    /// The search index.
    pub search: search::SearchOptions,
    /// Memory settings of the projections database (`[storage]`).
    pub storage: spindle_journal::StorageMemory,
    /// Bytes of parsed events the timeline keeps by id ([`timeline::EventCache`];
    /// `[caches] timeline_event_bytes`; 0: none).
    pub timeline_event_bytes: usize,
    /// Bytes of state-trie nodes kept by hash for queries ([`state::NodeCache`];
    /// `[caches] state_node_bytes`; 0: none).
    pub state_node_bytes: usize,
}

impl Default for ProjectionOptions {
    fn default() -> Self {
        ProjectionOptions {
            search: Default::default(),
            storage: Default::default(),
            timeline_event_bytes: timeline::EVENT_CACHE_BYTES,
            state_node_bytes: state::NODE_CACHE_BYTES,
        }
    }
}

impl Projections {
    /// Unread notification counts of `user_id` in `room_id` (`thread` as
    /// [`push::Push::unread`]) in `(from, upto]`, with `upto` first lowered to the
    /// room's last event (timeline, in memory): the push projection writes a count row
    /// only at a room event's position, so nothing after the room's last event can
    /// count, and a room read (or last written) up to its last event is answered
    /// without scanning a count row.
    pub fn unread(
        &self,
        room_id: &str,
        user_id: &str,
        thread: &str,
        from: u64,
        upto: u64,
    ) -> push::Counts {
        let upto = self
            .timeline
            .last_activity(room_id)
            .map_or(upto, |last| last.min(upto));
        self.push.unread(room_id, user_id, thread, from, upto)
    }

    /// Starts rebuilding projection `name` online: from position 0 into the next
    /// generation of its tables, beside the live ones that keep serving, then swapped
    /// in (see [`runtime`], "Online rebuild"). Returns the generation being built.
    pub fn rebuild_online(&self, name: &str) -> Result<u32, RebuildError> {
        if name == "search" {
            return Err(RebuildError::OfflineOnly(name.to_owned()));
        }
        let generation = self.runtime.next_generation(name);
        let db = self.db.for_generation(name, generation);
        let shadow = open_by_name(name, &db, &self.server_name, self.runtime.journal())
            .ok_or_else(|| RebuildError::Unknown(name.to_owned()))?
            .map_err(RebuildError::Store)?;
        if shadow.name() != name {
            return Err(RebuildError::Store(format!(
                "opened {:?} for {name:?}",
                shadow.name()
            )));
        }
        self.runtime.rebuild_online(name, shadow, generation)?;
        Ok(generation)
    }

    /// Opens every projection in `dir` with default settings and starts tailing `journal`.
    pub fn start(dir: &Path, journal: Journal) -> Result<Projections, String> {
        Self::start_with(dir, journal, ProjectionOptions::default())
    }

    /// Opens every projection in `dir` and starts tailing `journal`.
    pub fn start_with(
        dir: &Path,
        journal: Journal,
        options: ProjectionOptions,
    ) -> Result<Projections, String> {
        let db = ProjectionDb::open_with(dir, options.storage)?;
        // Projections whose row shapes changed since an earlier release are rebuilt.
        db.ensure_layout("push", push::LAYOUT)?;
        db.ensure_layout("state", state::LAYOUT)?;
        db.ensure_layout("search", search::LAYOUT)?;
        db.ensure_layout("relations", relations::LAYOUT)?;
        db.ensure_layout("event_times", directory::EVENT_TIMES_LAYOUT)?;
        db.ensure_layout("audit", audit::LAYOUT)?;
        let timeline = Arc::new(timeline::Timeline::open_on(
            &db,
            options.timeline_event_bytes,
            Some(journal.clone()),
        )?);
        let state = Arc::new(
            state::State::open_with(&db, options.state_node_bytes)?.with_journal(journal.clone()),
        );
        let membership = Arc::new(membership::Memberships::open_local(
            &db,
            journal.key().server_name(),
        )?);
        let accounts = Arc::new(accounts::Accounts::open(&db)?);
        let filters = Arc::new(user_data::Filters::open(&db)?);
        let account_data = Arc::new(user_data::AccountData::open(&db)?);
        let receipts = Arc::new(user_data::Receipts::open(&db)?);
        let aliases = Arc::new(user_data::Aliases::open(&db)?);
        let room_summary = Arc::new(room_summary::RoomSummary::open(&db)?);
        let audit = Arc::new(audit::Audit::open(&db)?);
        let directory = Arc::new(directory::Directory::open(&db)?);
        let event_times = Arc::new(directory::EventTimes::open(&db)?);
        let server_name = journal.key().server_name().to_owned();
        let device_keys = Arc::new(device_keys::DeviceKeys::open(&db, &server_name)?);
        let to_device = Arc::new(to_device::ToDevice::open(&db)?);
        let key_backup = Arc::new(key_backup::KeyBackup::open(&db)?);
        let media = Arc::new(media::Media::open(&db)?);
        let push = Arc::new(push::Push::open(&db)?);
        let pushers = Arc::new(push::Pushers::open(&db)?);
        let delayed = Arc::new(delayed::DelayedEvents::open(&db)?);
        let relations = Arc::new(relations::Relations::open(&db)?);
        let search = Arc::new(search::Search::open(&db, dir, options.search)?);
        let server_admin = Arc::new(server_admin::ServerAdmin::open(&db)?);
        let all: Vec<Arc<dyn Projection>> = vec![
            timeline.clone(),
            state.clone(),
            membership.clone(),
            accounts.clone(),
            filters.clone(),
            account_data.clone(),
            receipts.clone(),
            aliases.clone(),
            room_summary.clone(),
            audit.clone(),
            directory.clone(),
            event_times.clone(),
            device_keys.clone(),
            to_device.clone(),
            key_backup.clone(),
            media.clone(),
            push.clone(),
            pushers.clone(),
            delayed.clone(),
            relations.clone(),
            search.clone(),
            server_admin.clone(),
        ];
        debug_assert!(
            all.iter()
                .all(|p| open_by_name(p.name(), &db, &server_name, &journal).is_some()),
            "open_by_name knows every projection"
        );
        let runtime = Runtime::start(journal, db.clone(), all);
        Ok(Projections {
            timeline,
            state,
            membership,
            accounts,
            filters,
            account_data,
            receipts,
            aliases,
            room_summary,
            audit,
            directory,
            event_times,
            device_keys,
            to_device,
            key_backup,
            media,
            push,
            pushers,
            delayed,
            relations,
            search,
            server_admin,
            runtime,
            db,
            server_name,
        })
    }
}
