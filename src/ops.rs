//! Admin operations that need the journal itself. They live in the server crate, not in
//! `api` (which reads only projections, BRIEF §3.3), and are merged into the same
//! router: `POST /_spindle/admin/v1/backup` takes a consistent backup while serving.

use std::{path::PathBuf, sync::Arc};

use axum::{Extension, Json, Router, extract::State, routing::post};
use serde_json::{Value, json};
use spindle_api::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester},
};

/// The admin operations router (state applied).
pub(crate) fn router(state: AppState, data_dir: PathBuf) -> Router {
    Router::new()
        .route("/_spindle/admin/v1/backup", post(backup))
        .layer(Extension(Arc::new(data_dir)))
        .with_state(state)
}

/// `POST /_spindle/admin/v1/backup` `{"out": "/absolute/dir"}`: writes a backup
/// (`spindle_replay::backup`) of everything up to the durable head as of the request
/// into `out` on the server's filesystem (which must not exist or be empty). Server
/// admins only (403 `M_FORBIDDEN`); a relative or unusable `out` is 400
/// `M_INVALID_PARAM`. Answers `{"head", "head_hash", "files"}`.
async fn backup(
    State(s): State<AppState>,
    Extension(data_dir): Extension<Arc<PathBuf>>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    if !spindle_api::admin::is_admin(&s, &r.user_id) {
        return Err(MatrixError::forbidden("You are not a server admin"));
    }
    let out = body
        .get("out")
        .and_then(|v| v.as_str())
        .ok_or_else(|| MatrixError::missing_param("out (an absolute directory) is required"))?;
    let out = PathBuf::from(out);
    if !out.is_absolute() {
        return Err(MatrixError::invalid_param("out must be an absolute path"));
    }
    let journal = s.journal.clone();
    let head = journal.durable_head();
    let manifest = tokio::task::spawn_blocking(move || {
        let key = journal.key().clone();
        spindle_replay::backup::backup_with(
            |after, limit| {
                if after >= head {
                    return Ok(Vec::new());
                }
                Ok(journal.read_after(after, limit.min((head - after) as usize))?)
            },
            &data_dir,
            key.server_name(),
            spindle_replay::export::SigningKey {
                key_id: key.key_id(),
                public_key: key.public_key_base64(),
            },
            &out,
        )
    })
    .await
    .map_err(|e| MatrixError::internal(e.to_string()))?
    .map_err(|e| MatrixError::invalid_param(format!("{e:#}")))?;
    tracing::info!(
        head = manifest.journal.head,
        files = manifest.files.len(),
        "backup written"
    );
    Ok(Json(json!({
        "head": manifest.journal.head,
        "head_hash": manifest.journal.head_hash,
        "files": manifest.files.len(),
    })))
}
