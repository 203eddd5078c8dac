//! Push notifications (spec: client-server API "Push Notifications"): push rules
//! (`/pushrules/...`), the notification list (`GET /notifications`) and pushers
//! (`GET /pushers`, `POST /pushers/set`).
//!
//! Every rule edit is a journal fact; the push projection materializes each user's
//! ruleset and evaluates it per recipient as events are applied. The API checks an
//! edit against the current ruleset (so a bad edit answers 400/404) before it submits;
//! two racing edits are ordered by the journal and the projection applies them in that
//! order (one that no longer applies changes nothing).

use axum::{
    Json, Router,
    extract::{Path, State},
    routing::{get, post},
};
use ruma::push::{AnyPushRuleRef, RuleKind, Ruleset};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Query, Requester},
};

/// Default `limit` of `GET /notifications`.
pub const NOTIFICATIONS_DEFAULT_LIMIT: usize = 20;
/// Largest `limit` of `GET /notifications`.
pub const NOTIFICATIONS_MAX_LIMIT: usize = 100;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/_matrix/client/v3/pushrules", get(push_rules_no_slash))
        .route("/_matrix/client/v3/pushrules/", get(push_rules))
        // Everything below `/pushrules/` goes through one parser (as Synapse's one
        // servlet does), so a malformed path (unknown scope or kind, no rule id, an
        // unknown attribute, a missing trailing slash) answers 400 `M_UNRECOGNIZED`
        // instead of the router's 404/405.
        .route(
            "/_matrix/client/v3/pushrules/{*path}",
            get(get_path).put(put_path).delete(delete_path),
        )
        .route("/_matrix/client/v3/notifications", get(notifications))
        .route("/_matrix/client/v3/pushers", get(get_pushers))
        .route("/_matrix/client/v3/pushers/set", post(set_pushers))
}

/// What a path below `/pushrules/` names.
#[derive(Debug, PartialEq, Eq)]
enum RulePath {
    /// `global/`: the whole global ruleset.
    Ruleset,
    /// `global/{kind}/`: the rules of one kind, in priority order.
    Kind(&'static str),
    /// `global/{kind}/{ruleId}`.
    Rule(&'static str, String),
    /// `global/{kind}/{ruleId}/{attr}` with `attr` one of [`RuleAttr`].
    Attr(&'static str, String, RuleAttr),
}

/// The attributes of a rule served on their own (spec: `.../enabled`, `.../actions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RuleAttr {
    Enabled,
    Actions,
}

const TRAILING_SLASH: &str = "Unrecognised request: You probably wanted a trailing slash";

fn unrecognized(msg: impl Into<String>) -> MatrixError {
    MatrixError::new(axum::http::StatusCode::BAD_REQUEST, "M_UNRECOGNIZED", msg)
}

/// Parses the (percent-decoded) path below `/pushrules/`, as Synapse's
/// `_rule_spec_from_path`/`_filter_ruleset_with_path` do: every malformed path is 400
/// `M_UNRECOGNIZED`.
fn parse_rule_path(path: &str) -> ApiResult<RulePath> {
    let parts: Vec<&str> = path.split('/').collect();
    if parts[0] != "global" {
        return Err(unrecognized(format!(
            "Unknown push rule scope {:?} (only \"global\")",
            parts[0]
        )));
    }
    let Some(kind) = parts.get(1) else {
        return Err(unrecognized(TRAILING_SLASH));
    };
    if kind.is_empty() && parts.len() == 2 {
        return Ok(RulePath::Ruleset);
    }
    let kind = KINDS
        .iter()
        .copied()
        .find(|k| k == kind)
        .ok_or_else(|| unrecognized(format!("Unknown push rule kind {kind:?}")))?;
    let Some(rule_id) = parts.get(2) else {
        return Err(unrecognized(TRAILING_SLASH));
    };
    match (rule_id.is_empty(), parts.len()) {
        (true, 3) => return Ok(RulePath::Kind(kind)),
        (true, _) => return Err(unrecognized("Missing push rule id")),
        (false, 3) => return Ok(RulePath::Rule(kind, (*rule_id).to_owned())),
        _ => {}
    }
    let attr = match (parts[3], parts.len()) {
        ("enabled", 4) => RuleAttr::Enabled,
        ("actions", 4) => RuleAttr::Actions,
        _ => {
            return Err(unrecognized(format!(
                "Unknown push rule attribute {:?}",
                parts[3..].join("/")
            )));
        }
    };
    Ok(RulePath::Attr(kind, (*rule_id).to_owned(), attr))
}

/// The five kinds, in the spec's priority order.
const KINDS: [&str; 5] = ["override", "content", "room", "sender", "underride"];

/// `GET /pushrules` (no trailing slash): 400 `M_UNRECOGNIZED`, as Synapse answers.
async fn push_rules_no_slash(_r: Requester) -> MatrixError {
    unrecognized(TRAILING_SLASH)
}

/// `GET /pushrules/global/...`: the ruleset (spec: `getPushRulesGlobal`), one kind's
/// list (`global/{kind}/`, an array as Synapse serves it), one rule (`getPushRule`) or
/// one attribute (`isPushRuleEnabled`, `getPushRuleActions`).
async fn get_path(
    State(s): State<AppState>,
    r: Requester,
    Path(path): Path<String>,
) -> ApiResult<Json<Value>> {
    match parse_rule_path(&path)? {
        RulePath::Ruleset => push_rules_global(&s, &r).map(Json),
        RulePath::Kind(kind) => Ok(Json(push_rules_global(&s, &r)?[kind].take())),
        RulePath::Rule(kind, rule_id) => find_rule(&s, &r.user_id, kind, &rule_id).map(Json),
        RulePath::Attr(kind, rule_id, attr) => {
            let rule = find_rule(&s, &r.user_id, kind, &rule_id)?;
            Ok(Json(match attr {
                RuleAttr::Enabled => json!({ "enabled": rule["enabled"] }),
                RuleAttr::Actions => json!({ "actions": rule["actions"] }),
            }))
        }
    }
}

/// `PUT /pushrules/global/{kind}/{ruleId}[/enabled|/actions]` (spec: `setPushRule`,
/// `setPushRuleEnabled`, `setPushRuleActions`).
async fn put_path(
    State(s): State<AppState>,
    r: Requester,
    Path(path): Path<String>,
    q: Query,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    match parse_rule_path(&path)? {
        RulePath::Ruleset | RulePath::Kind(_) => Err(unrecognized("Missing push rule id")),
        RulePath::Rule(kind, rule_id) => put_rule(&s, &r, kind, rule_id, &q, &body).await,
        RulePath::Attr(kind, rule_id, RuleAttr::Enabled) => {
            put_enabled(&s, &r, kind, rule_id, &body).await
        }
        RulePath::Attr(kind, rule_id, RuleAttr::Actions) => {
            put_actions(&s, &r, kind, rule_id, &body).await
        }
    }
}

/// `DELETE /pushrules/global/{kind}/{ruleId}` (spec: `deletePushRule`). An attribute
/// path is 400 `M_UNRECOGNIZED` (Synapse ignores the attribute and deletes the rule).
async fn delete_path(
    State(s): State<AppState>,
    r: Requester,
    Path(path): Path<String>,
) -> ApiResult<Json<Value>> {
    match parse_rule_path(&path)? {
        RulePath::Rule(kind, rule_id) => delete_rule(&s, &r, kind, rule_id).await,
        RulePath::Ruleset | RulePath::Kind(_) => Err(unrecognized("Missing push rule id")),
        RulePath::Attr(..) => Err(unrecognized("Push rule attributes cannot be deleted")),
    }
}

/// A ruleset as the spec's `Ruleset` object: all five kinds, empty lists included.
pub fn ruleset_json(set: &Ruleset) -> Value {
    let mut v = serde_json::to_value(set).unwrap_or_else(|_| json!({}));
    for kind in ["override", "content", "room", "sender", "underride"] {
        if v.get(kind).is_none() {
            v[kind] = json!([]);
        }
    }
    v
}

fn ruleset(s: &AppState, user_id: &str) -> ApiResult<Ruleset> {
    s.projections
        .push
        .ruleset(user_id)
        .ok_or_else(|| MatrixError::internal("no ruleset for this user"))
}

/// `GET /pushrules/` (spec: `getPushRules`).
async fn push_rules(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    Ok(Json(
        json!({ "global": ruleset_json(&ruleset(&s, &r.user_id)?) }),
    ))
}

/// The global ruleset (spec: `getPushRulesGlobal`).
fn push_rules_global(s: &AppState, r: &Requester) -> ApiResult<Value> {
    Ok(ruleset_json(&ruleset(s, &r.user_id)?))
}

fn rule_kind(kind: &str) -> ApiResult<RuleKind> {
    match kind {
        "override" => Ok(RuleKind::Override),
        "underride" => Ok(RuleKind::Underride),
        "sender" => Ok(RuleKind::Sender),
        "room" => Ok(RuleKind::Room),
        "content" => Ok(RuleKind::Content),
        _ => Err(unrecognized(format!("Unknown push rule kind {kind:?}"))),
    }
}

fn rule_not_found() -> MatrixError {
    MatrixError::not_found("The push rule was not found.")
}

fn rule_json(rule: AnyPushRuleRef<'_>) -> Value {
    match rule {
        AnyPushRuleRef::Override(r) | AnyPushRuleRef::Underride(r) => serde_json::to_value(r),
        AnyPushRuleRef::Content(r) => serde_json::to_value(r),
        AnyPushRuleRef::Room(r) => serde_json::to_value(r),
        AnyPushRuleRef::Sender(r) => serde_json::to_value(r),
        _ => Ok(json!({})),
    }
    .unwrap_or_else(|_| json!({}))
}

fn find_rule(s: &AppState, user_id: &str, kind: &str, rule_id: &str) -> ApiResult<Value> {
    let kind = rule_kind(kind)?;
    let set = ruleset(s, user_id)?;
    set.get(kind, rule_id)
        .map(rule_json)
        .ok_or_else(rule_not_found)
}

/// Submits a push-rule fact after checking it applies to the current ruleset.
async fn submit_rule_fact(s: &AppState, r: &Requester, fact: Fact) -> ApiResult<Json<Value>> {
    let mut set = ruleset(s, &r.user_id)?;
    spindle_projections::push::apply_rule_fact(&mut set, &fact)
        .map_err(|e| MatrixError::new(axum::http::StatusCode::BAD_REQUEST, "M_UNKNOWN", e))?;
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({})))
}

/// Checks `actions` as Synapse's `check_actions` does: a list of `notify`, the
/// historical `dont_notify` and `coalesce` (kept as sent), and `set_tweak` objects.
fn check_actions(v: Option<&Value>) -> ApiResult<Value> {
    let v = v.ok_or_else(|| MatrixError::missing_param("actions is required"))?;
    let list = v
        .as_array()
        .ok_or_else(|| MatrixError::bad_json("actions must be a list of actions"))?;
    for a in list {
        let known = match a {
            Value::String(a) => matches!(a.as_str(), "notify" | "dont_notify" | "coalesce"),
            Value::Object(o) => o.get("set_tweak").is_some_and(Value::is_string),
            _ => false,
        };
        if !known {
            return Err(MatrixError::bad_json(format!("Unrecognised action {a}")));
        }
    }
    spindle_projections::push_rules::clean_actions(v)
        .ok_or_else(|| MatrixError::bad_json("actions must be a list of actions"))?;
    Ok(v.clone())
}

/// `PUT /pushrules/global/{kind}/{ruleId}` (spec: `setPushRule`).
async fn put_rule(
    s: &AppState,
    r: &Requester,
    kind: &str,
    rule_id: String,
    q: &Query,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Json<Value>> {
    let rk = rule_kind(kind)?;
    if rule_id.starts_with('.') {
        return Err(MatrixError::invalid_param(
            "Rule ids starting with '.' are reserved for server-default rules",
        ));
    }
    if rule_id.is_empty() || rule_id.contains(['/', '\\']) {
        return Err(MatrixError::invalid_param(
            "Rule ids may not be empty or contain '/' or '\\'",
        ));
    }
    match rk {
        RuleKind::Room if ruma::RoomId::parse(&rule_id).is_err() => {
            return Err(MatrixError::invalid_param("A room rule's id is a room id"));
        }
        RuleKind::Sender if ruma::UserId::parse(&rule_id).is_err() => {
            return Err(MatrixError::invalid_param(
                "A sender rule's id is a user id",
            ));
        }
        _ => {}
    }
    let actions = check_actions(body.get("actions"))?;
    let mut rule = json!({ "actions": actions });
    match rk {
        RuleKind::Override | RuleKind::Underride => {
            if let Some(c) = body.get("conditions").filter(|c| !c.is_null()) {
                if serde_json::from_value::<Vec<ruma::push::PushCondition>>(c.clone()).is_err() {
                    return Err(MatrixError::bad_json(
                        "conditions must be a list of conditions",
                    ));
                }
                rule["conditions"] = c.clone();
            }
        }
        RuleKind::Content => match body.get("pattern") {
            Some(Value::String(p)) => rule["pattern"] = json!(p),
            None | Some(Value::Null) => {
                return Err(MatrixError::missing_param("Content rules need a pattern"));
            }
            Some(_) => return Err(MatrixError::bad_json("pattern must be a string")),
        },
        _ => {}
    }
    let fact = Fact::PushRuleSet {
        user_id: r.user_id.clone(),
        kind: kind.to_owned(),
        rule_id,
        rule,
        before: q.get("before").map(str::to_owned),
        after: q.get("after").map(str::to_owned),
    };
    submit_rule_fact(s, r, fact).await
}

/// `DELETE /pushrules/global/{kind}/{ruleId}` (spec: `deletePushRule`). Server-default
/// rules cannot be deleted (400); disable them instead.
async fn delete_rule(
    s: &AppState,
    r: &Requester,
    kind: &str,
    rule_id: String,
) -> ApiResult<Json<Value>> {
    let rule = find_rule(s, &r.user_id, kind, &rule_id)?;
    if rule["default"] == json!(true) {
        return Err(MatrixError::invalid_param(
            "Server-default rules cannot be deleted",
        ));
    }
    let fact = Fact::PushRuleDeleted {
        user_id: r.user_id.clone(),
        kind: kind.to_owned(),
        rule_id,
    };
    submit_rule_fact(s, r, fact).await
}

/// `PUT /pushrules/global/{kind}/{ruleId}/enabled` (spec: `setPushRuleEnabled`).
async fn put_enabled(
    s: &AppState,
    r: &Requester,
    kind: &str,
    rule_id: String,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Json<Value>> {
    find_rule(s, &r.user_id, kind, &rule_id)?;
    let enabled = match body.get("enabled") {
        Some(Value::Bool(b)) => *b,
        None => return Err(MatrixError::missing_param("enabled is required")),
        Some(_) => return Err(MatrixError::bad_json("enabled must be a boolean")),
    };
    let fact = Fact::PushRuleEnabledSet {
        user_id: r.user_id.clone(),
        kind: kind.to_owned(),
        rule_id,
        enabled,
    };
    submit_rule_fact(s, r, fact).await
}

/// `PUT /pushrules/global/{kind}/{ruleId}/actions` (spec: `setPushRuleActions`).
async fn put_actions(
    s: &AppState,
    r: &Requester,
    kind: &str,
    rule_id: String,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Json<Value>> {
    find_rule(s, &r.user_id, kind, &rule_id)?;
    let actions = check_actions(body.get("actions"))?;
    let fact = Fact::PushRuleActionsSet {
        user_id: r.user_id.clone(),
        kind: kind.to_owned(),
        rule_id,
        actions,
    };
    submit_rule_fact(s, r, fact).await
}

/// `GET /notifications` (spec: `getNotifications`): newest first, `from` is the
/// `next_token` of the previous page, `limit` is clamped to
/// [`NOTIFICATIONS_MAX_LIMIT`], `only=highlight` keeps highlighted ones.
async fn notifications(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
) -> ApiResult<Json<Value>> {
    let limit = q
        .u64("limit")?
        .map(|l| l as usize)
        .unwrap_or(NOTIFICATIONS_DEFAULT_LIMIT)
        .min(NOTIFICATIONS_MAX_LIMIT);
    let before = match q.get("from") {
        None => u64::MAX,
        Some(t) => t
            .parse::<u64>()
            .map_err(|_| MatrixError::invalid_param(format!("Invalid from token {t:?}")))?,
    };
    let highlights_only = match q.get("only") {
        None => false,
        Some("highlight") => true,
        Some(other) => {
            return Err(MatrixError::invalid_param(format!(
                "only must be \"highlight\", not {other:?}"
            )));
        }
    };
    let upto = s.projections.runtime.applied();
    let rows = s.projections.push.notifications(
        &r.user_id,
        before.min(upto.saturating_add(1)),
        limit,
        highlights_only,
    );
    let mut read_at: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut out = Vec::new();
    let mut next = None;
    for (pos, n) in &rows {
        next = Some(*pos);
        let Some(ev) = s.projections.timeline.event(&n.event_id) else {
            continue;
        };
        let read_pos = *read_at.entry(n.room_id.clone()).or_insert_with(|| {
            s.projections
                .receipts
                .read_position(&n.room_id, &r.user_id, None)
                .unwrap_or(0)
                .max(s.projections.push.last_sent(&n.room_id, &r.user_id, ""))
        });
        let mut event = crate::read::render(&s, &ev, Some((&r.user_id, &r.device_id)));
        if let Some(map) = event.as_object_mut() {
            map.remove("room_id");
        }
        out.push(json!({
            "actions": n.actions,
            "event": event,
            "read": *pos <= read_pos,
            "room_id": n.room_id,
            "ts": n.ts,
        }));
    }
    let mut body = json!({ "notifications": out });
    if rows.len() == limit
        && let Some(p) = next
    {
        body["next_token"] = json!(p.to_string());
    }
    Ok(Json(body))
}

/// `GET /pushers` (spec: `getPushers`).
async fn get_pushers(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    Ok(Json(
        json!({ "pushers": s.projections.pushers.of_user(&r.user_id) }),
    ))
}

fn required_str(body: &serde_json::Map<String, Value>, name: &str) -> ApiResult<String> {
    match body.get(name) {
        Some(Value::String(v)) => Ok(v.clone()),
        None | Some(Value::Null) => Err(MatrixError::missing_param(format!("{name} is required"))),
        Some(_) => Err(MatrixError::bad_json(format!("{name} must be a string"))),
    }
}

/// `POST /pushers/set` (spec: `postPusher`). HTTP pushers are stored (delivery to a
/// push gateway comes with the push queue); `email` pushers are refused (400).
async fn set_pushers(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let app_id = required_str(&body, "app_id")?;
    let pushkey = required_str(&body, "pushkey")?;
    if app_id.chars().count() > 64 {
        return Err(MatrixError::invalid_param(
            "app_id is longer than 64 characters",
        ));
    }
    if pushkey.len() > 512 {
        return Err(MatrixError::invalid_param(
            "pushkey is longer than 512 bytes",
        ));
    }
    let kind = match body.get("kind") {
        Some(Value::Null) => None,
        Some(Value::String(k)) => Some(k.clone()),
        None => return Err(MatrixError::missing_param("kind is required")),
        Some(_) => return Err(MatrixError::bad_json("kind must be a string or null")),
    };
    let fact = match kind {
        None => Fact::PusherDeleted {
            user_id: r.user_id.clone(),
            app_id,
            pushkey,
        },
        Some(kind) => {
            if kind != "http" {
                return Err(MatrixError::invalid_param(format!(
                    "Pusher kind {kind:?} is not supported (only \"http\")"
                )));
            }
            let app_display_name = required_str(&body, "app_display_name")?;
            let device_display_name = required_str(&body, "device_display_name")?;
            let lang = required_str(&body, "lang")?;
            let data = match body.get("data") {
                Some(Value::Object(d)) => d.clone(),
                None | Some(Value::Null) => {
                    return Err(MatrixError::missing_param("data is required"));
                }
                Some(_) => return Err(MatrixError::bad_json("data must be an object")),
            };
            if !data.get("url").is_some_and(|u| u.is_string()) {
                return Err(MatrixError::missing_param(
                    "data.url is required for http pushers",
                ));
            }
            let append = match body.get("append") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(MatrixError::bad_json("append must be a boolean")),
            };
            let mut pusher = json!({
                "pushkey": pushkey,
                "kind": kind,
                "app_id": app_id,
                "app_display_name": app_display_name,
                "device_display_name": device_display_name,
                "lang": lang,
                "data": data,
            });
            if let Some(tag) = crate::extract::opt_str(&body, "profile_tag")? {
                pusher["profile_tag"] = json!(tag);
            }
            Fact::PusherSet {
                user_id: r.user_id.clone(),
                pusher,
                append,
            }
        }
    };
    s.submit(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({})))
}
