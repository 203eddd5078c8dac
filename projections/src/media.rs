//! Media metadata projection (spec: client-server API "Content repository"): which
//! content hash, type and file name each media id of this server names. The bytes are
//! blobs (see `spindle_journal::blobs`); only their hash is here.
//!
//! Table `media`: media id -> [`MediaRecord`] JSON.

use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table},
};

/// What a media id names.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct MediaRecord {
    /// Who created or uploaded it.
    pub uploader: String,
    /// blake3 hex of the bytes; `None` while an async upload (`/create`) is pending.
    pub content_hash: Option<String>,
    /// The uploader's `Content-Type`.
    pub content_type: Option<String>,
    /// The uploader's file name.
    pub filename: Option<String>,
    /// Size in bytes.
    pub size: u64,
    /// When the id was created, ms since the epoch (the record's append time).
    pub created_at: u64,
    /// The admin who quarantined it (`MediaQuarantined`); quarantined media is not served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantined_by: Option<String>,
}

/// The media projection.
pub struct Media {
    media: Table,
}

impl Media {
    /// Opens the table.
    pub fn open(db: &ProjectionDb) -> Result<Media, String> {
        Ok(Media {
            media: db.table("media", "media")?,
        })
    }

    /// A media id's record (one point read).
    pub fn get(&self, media_id: &str) -> Option<MediaRecord> {
        serde_json::from_slice(&self.media.get(media_id.as_bytes())?).ok()
    }
}

impl Projection for Media {
    fn name(&self) -> &'static str {
        "media"
    }

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
    }

    fn tables(&self) -> Vec<Table> {
        vec![self.media.clone()]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let row = match record.fact() {
            Some(Fact::MediaCreated { media_id, uploader }) => (
                media_id,
                MediaRecord {
                    uploader,
                    content_hash: None,
                    content_type: None,
                    filename: None,
                    size: 0,
                    created_at: record.view().appended_at.to_native(),
                    quarantined_by: None,
                },
            ),
            Some(Fact::MediaUploaded {
                media_id,
                uploader,
                content_hash,
                content_type,
                filename,
                size,
            }) => {
                let created_at = ctx
                    .get(&self.media, media_id.as_bytes())
                    .and_then(|v| serde_json::from_slice::<MediaRecord>(&v).ok())
                    .map(|m| m.created_at)
                    .unwrap_or(record.view().appended_at.to_native());
                (
                    media_id,
                    MediaRecord {
                        uploader,
                        content_hash: Some(content_hash),
                        content_type,
                        filename,
                        size,
                        created_at,
                        quarantined_by: None,
                    },
                )
            }
            Some(Fact::MediaQuarantined {
                media_id,
                quarantined_by,
            }) => {
                let Some(mut m) = ctx
                    .get(&self.media, media_id.as_bytes())
                    .and_then(|v| serde_json::from_slice::<MediaRecord>(&v).ok())
                else {
                    return Ok(());
                };
                m.quarantined_by = Some(quarantined_by);
                (media_id, m)
            }
            Some(Fact::MediaDeleted { media_id }) => {
                ctx.delete(&self.media, media_id.into_bytes());
                return Ok(());
            }
            _ => return Ok(()),
        };
        ctx.put(
            &self.media,
            row.0.into_bytes(),
            serde_json::to_vec(&row.1).map_err(|e| e.to_string())?,
        );
        Ok(())
    }
}
