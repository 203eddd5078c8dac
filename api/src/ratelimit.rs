//! Rate limits (issue 17 item 2), modelled on Synapse's `rc_*` settings: one token
//! bucket per key (user, address, room, origin) with a refill rate (`per_second`) and
//! a capacity (`burst_count`). An action is allowed while the bucket holds fewer than
//! `burst_count` actions; the bucket drains at `per_second` actions per second. A
//! refusal is 429 `M_LIMIT_EXCEEDED` with `retry_after_ms` (and a `Retry-After`
//! header, see [`crate::error`]): the time until one more action fits.
//!
//! Why not the `governor` crate: two things Synapse's limits need are not in it. The
//! login limits look at a bucket *without* counting (`rc_login.failed_attempts` must
//! refuse a password check once full, but only a failed check counts), and the bucket
//! maps need a hard size bound under an address-spraying attack (below). What is left
//! is thirty lines of arithmetic, pure and driven by an injected [`Clock`], so tests
//! step time instead of sleeping.
//!
//! Memory: each limiter keeps at most `max_keys` buckets. A bucket that has drained to
//! empty is indistinguishable from no bucket and is evicted by a sweep (at most once a
//! minute, or once a second while the map is full). If the map is still full of live
//! buckets, new keys share one overflow bucket: memory stays bounded and a flood of
//! fresh addresses gains nothing over one address.
//!
//! Exemptions: with `exempt_admins`, server admins pass every per-user limit (they
//! still pass through per-address limits before they are known). Application services'
//! senders pass every per-user limit, and so do the users of an application service
//! registered with `rate_limited: false` ([`crate::appservice::AppServices::rate_exempt`]).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::MatrixError;

/// A monotonic clock in milliseconds (any origin). Injected so tests step time.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since an arbitrary, fixed origin; never decreases.
    fn now_ms(&self) -> u64;
}

/// The process's monotonic clock.
pub struct SystemClock {
    origin: std::time::Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            origin: std::time::Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }
}

/// A clock that moves only when told to (tests).
#[derive(Default)]
pub struct ManualClock {
    now_ms: AtomicU64,
}

impl ManualClock {
    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

/// One limit: a refill rate and a capacity (Synapse's `per_second`, `burst_count`).
/// `per_second = 0` turns the limit off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Actions regained per second (may be fractional: 0.003 is one per 333 s).
    pub per_second: f64,
    /// Actions allowed at once from a full bucket.
    pub burst_count: u32,
}

impl Rate {
    /// A limit of `per_second`, `burst_count`.
    pub const fn new(per_second: f64, burst_count: u32) -> Rate {
        Rate {
            per_second,
            burst_count,
        }
    }

    /// No limit.
    pub const OFF: Rate = Rate::new(0.0, 0);

    fn is_off(&self) -> bool {
        self.per_second <= 0.0
    }
}

/// Every limit (`[rate_limits]` in the config). Defaults are Synapse's, which protect
/// a public server; `enabled = false` lifts them all (tests, trusted deployments).
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimitConfig {
    /// Apply the limits at all.
    pub enabled: bool,
    /// Server admins pass every per-user limit.
    pub exempt_admins: bool,
    /// Buckets kept per limit at most (see the module docs).
    pub max_keys: usize,
    /// Events sent (messages, state, redactions) and rooms created, per user
    /// (`rc_message`).
    pub message: Rate,
    /// Login attempts per client address (`rc_login.address`).
    pub login_address: Rate,
    /// Successful logins per account (`rc_login.account`).
    pub login_account: Rate,
    /// Failed logins per account (`rc_login.failed_attempts`).
    pub login_failed_attempts: Rate,
    /// Registrations per client address (`rc_registration`).
    pub registration: Rate,
    /// Registration-token validity checks per client address
    /// (`rc_registration_token_validity`).
    pub registration_token_validity: Rate,
    /// Validation emails asked for (`requestToken`), per client address and per email
    /// address (`rc_3pid_validation`).
    pub threepid_validation: Rate,
    /// Joins per user (`rc_joins.local`).
    pub joins: Rate,
    /// Invites into one room (`rc_invites.per_room`).
    pub invites_per_room: Rate,
    /// Invites received by one user (`rc_invites.per_user`).
    pub invites_per_user: Rate,
    /// Invites sent by one user (`rc_invites.per_issuer`).
    pub invites_per_issuer: Rate,
    /// Media uploads per user.
    pub media_upload: Rate,
    /// Media ids reserved with `POST /media/v1/create` per user (`rc_media_create`).
    pub media_create: Rate,
    /// Inbound federation requests per origin server (applied by the federation
    /// router through [`RateLimits::check_federation_origin`]).
    pub federation_origin: Rate,
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        RateLimitConfig {
            enabled: true,
            exempt_admins: true,
            max_keys: 100_000,
            message: Rate::new(0.2, 10),
            login_address: Rate::new(0.003, 5),
            login_account: Rate::new(0.003, 5),
            login_failed_attempts: Rate::new(0.17, 3),
            registration: Rate::new(0.17, 3),
            registration_token_validity: Rate::new(0.1, 5),
            threepid_validation: Rate::new(0.003, 5),
            joins: Rate::new(0.1, 10),
            invites_per_room: Rate::new(0.3, 10),
            invites_per_user: Rate::new(0.003, 5),
            invites_per_issuer: Rate::new(0.3, 10),
            media_upload: Rate::new(0.2, 20),
            media_create: Rate::new(10.0, 50),
            federation_origin: Rate::new(50.0, 100),
        }
    }
}

/// A refusal: which limit, and how long until one more action fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimited {
    /// The limit's name (its config key).
    pub limit: &'static str,
    /// Milliseconds until the action would be allowed.
    pub retry_after_ms: u64,
}

impl From<RateLimited> for MatrixError {
    fn from(r: RateLimited) -> Self {
        MatrixError::limit_exceeded(
            format!("Too many requests ({}); retry later", r.limit),
            r.retry_after_ms,
        )
    }
}

/// The key every new key shares once a limiter's map is full of live buckets.
const OVERFLOW_KEY: &str = "\u{0}overflow";
/// Drained buckets are swept at most this often (ms)...
const SWEEP_INTERVAL_MS: u64 = 60_000;
/// ...or this often while the map is full.
const FULL_SWEEP_INTERVAL_MS: u64 = 1_000;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Actions in the bucket at `at_ms`.
    level: f64,
    at_ms: u64,
}

struct Buckets {
    map: HashMap<String, Bucket>,
    last_sweep_ms: u64,
}

/// One limit's buckets.
pub struct Limiter {
    name: &'static str,
    rate: Rate,
    max_keys: usize,
    clock: Arc<dyn Clock>,
    buckets: parking_lot::Mutex<Buckets>,
}

impl Limiter {
    /// A limiter named `name` (for errors and logs). `rate` off: every check passes.
    pub fn new(name: &'static str, rate: Rate, max_keys: usize, clock: Arc<dyn Clock>) -> Self {
        Limiter {
            name,
            rate,
            max_keys: max_keys.max(1),
            clock,
            buckets: parking_lot::Mutex::new(Buckets {
                map: HashMap::new(),
                last_sweep_ms: 0,
            }),
        }
    }

    fn level_at(&self, b: &Bucket, now: u64) -> f64 {
        let drained = now.saturating_sub(b.at_ms) as f64 / 1000.0 * self.rate.per_second;
        (b.level - drained).max(0.0)
    }

    fn refusal(&self, level: f64) -> Option<RateLimited> {
        let over = level + 1.0 - f64::from(self.rate.burst_count);
        // A hair of tolerance so 1/per_second steps land exactly on the boundary.
        (over > 1e-9).then(|| RateLimited {
            limit: self.name,
            retry_after_ms: ((over / self.rate.per_second * 1000.0) - 1e-6)
                .ceil()
                .max(1.0) as u64,
        })
    }

    /// The key a bucket is kept under: `key`, or the overflow bucket when the map is
    /// full of live buckets (after a sweep, if one is due). Either has room: the map
    /// holds at most `max_keys` keys plus the overflow bucket.
    fn slot<'a>(&self, b: &mut Buckets, key: &'a str, now: u64) -> &'a str {
        if b.map.contains_key(key) {
            return key;
        }
        let full = b.map.len() >= self.max_keys;
        let since = now.saturating_sub(b.last_sweep_ms);
        if since >= SWEEP_INTERVAL_MS || (full && since >= FULL_SWEEP_INTERVAL_MS) {
            b.last_sweep_ms = now;
            let per_second = self.rate.per_second;
            b.map.retain(|_, bucket| {
                let drained = now.saturating_sub(bucket.at_ms) as f64 / 1000.0 * per_second;
                bucket.level - drained > 1e-9
            });
        }
        if b.map.len() >= self.max_keys {
            OVERFLOW_KEY
        } else {
            key
        }
    }

    /// Counts one action for `key` if it fits; refuses (counting nothing) otherwise.
    pub fn check(&self, key: &str) -> Result<(), RateLimited> {
        if self.rate.is_off() {
            return Ok(());
        }
        let now = self.clock.now_ms();
        let mut b = self.buckets.lock();
        let slot = self.slot(&mut b, key, now);
        let level = b.map.get(slot).map_or(0.0, |x| self.level_at(x, now));
        if let Some(r) = self.refusal(level) {
            return Err(r);
        }
        b.map.insert(
            slot.to_owned(),
            Bucket {
                level: level + 1.0,
                at_ms: now,
            },
        );
        Ok(())
    }

    /// Whether one action for `key` would fit, counting nothing (Synapse's
    /// `update=False`).
    pub fn peek(&self, key: &str) -> Result<(), RateLimited> {
        if self.rate.is_off() {
            return Ok(());
        }
        let now = self.clock.now_ms();
        let b = self.buckets.lock();
        let slot = if b.map.contains_key(key) || b.map.len() < self.max_keys {
            key
        } else {
            OVERFLOW_KEY
        };
        let level = b.map.get(slot).map_or(0.0, |x| self.level_at(x, now));
        match self.refusal(level) {
            Some(r) => Err(r),
            None => Ok(()),
        }
    }

    /// Counts one action for `key` whether or not it fits (a failed login is counted
    /// after the fact; a full bucket only takes longer to drain).
    pub fn record(&self, key: &str) {
        if self.rate.is_off() {
            return;
        }
        let now = self.clock.now_ms();
        let mut b = self.buckets.lock();
        let slot = self.slot(&mut b, key, now);
        let level = b.map.get(slot).map_or(0.0, |x| self.level_at(x, now));
        b.map.insert(
            slot.to_owned(),
            Bucket {
                level: level + 1.0,
                at_ms: now,
            },
        );
    }

    /// Buckets held now (at most `max_keys` + 1, the overflow bucket).
    pub fn len(&self) -> usize {
        self.buckets.lock().map.len()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Every limiter of the server, built from [`RateLimitConfig`].
pub struct RateLimits {
    /// The configuration they were built from.
    pub config: RateLimitConfig,
    /// `message`.
    pub message: Limiter,
    /// `login_address`.
    pub login_address: Limiter,
    /// `login_account`.
    pub login_account: Limiter,
    /// `login_failed_attempts`.
    pub login_failed_attempts: Limiter,
    /// `registration`.
    pub registration: Limiter,
    /// `registration_token_validity`.
    pub registration_token_validity: Limiter,
    /// `threepid_validation`.
    pub threepid_validation: Limiter,
    /// `joins`.
    pub joins: Limiter,
    /// `invites_per_room`.
    pub invites_per_room: Limiter,
    /// `invites_per_user`.
    pub invites_per_user: Limiter,
    /// `invites_per_issuer`.
    pub invites_per_issuer: Limiter,
    /// `media_upload`.
    pub media_upload: Limiter,
    /// `media_create`.
    pub media_create: Limiter,
    /// `federation_origin`.
    pub federation_origin: Limiter,
}

impl RateLimits {
    /// Builds every limiter on `clock`. With `enabled = false` every limit is off.
    pub fn new(config: RateLimitConfig, clock: Arc<dyn Clock>) -> RateLimits {
        let on = config.enabled;
        let max = config.max_keys;
        let make = |name: &'static str, rate: Rate| {
            Limiter::new(name, if on { rate } else { Rate::OFF }, max, clock.clone())
        };
        RateLimits {
            message: make("message", config.message),
            login_address: make("login_address", config.login_address),
            login_account: make("login_account", config.login_account),
            login_failed_attempts: make("login_failed_attempts", config.login_failed_attempts),
            registration: make("registration", config.registration),
            registration_token_validity: make(
                "registration_token_validity",
                config.registration_token_validity,
            ),
            threepid_validation: make("threepid_validation", config.threepid_validation),
            joins: make("joins", config.joins),
            invites_per_room: make("invites_per_room", config.invites_per_room),
            invites_per_user: make("invites_per_user", config.invites_per_user),
            invites_per_issuer: make("invites_per_issuer", config.invites_per_issuer),
            media_upload: make("media_upload", config.media_upload),
            media_create: make("media_create", config.media_create),
            federation_origin: make("federation_origin", config.federation_origin),
            config,
        }
    }

    /// The federation hook: call once per inbound federation request, after its
    /// `X-Matrix` signature names the `origin` server; an `Err` is answered 429
    /// `M_LIMIT_EXCEEDED` with its `retry_after_ms` (convert with `MatrixError::from`).
    /// Counted against `[rate_limits.federation_origin]`.
    pub fn check_federation_origin(&self, origin: &str) -> Result<(), RateLimited> {
        self.federation_origin.check(origin)
    }
}

/// Whether `user_id` passes per-user limits without counting: an admin (with
/// `exempt_admins`), an application service's sender, or a user of an application
/// service registered with `rate_limited: false`.
pub fn exempt(s: &crate::AppState, user_id: &str) -> bool {
    (s.rate_limits.config.exempt_admins && crate::admin::is_admin(s, user_id))
        || s.appservices.rate_exempt(user_id)
}

/// Checks and counts a per-user limit, unless the user is exempt.
pub fn check_user(
    s: &crate::AppState,
    limiter: &Limiter,
    user_id: &str,
) -> Result<(), MatrixError> {
    if exempt(s, user_id) {
        return Ok(());
    }
    limiter.check(user_id).map_err(MatrixError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(rate: Rate, max_keys: usize) -> (Limiter, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::default());
        (Limiter::new("test", rate, max_keys, clock.clone()), clock)
    }

    #[test]
    fn burst_then_one_per_period() {
        // Synapse's rc_message: 10 at once, then one every 5 s.
        let (l, clock) = limiter(Rate::new(0.2, 10), 10);
        for _ in 0..10 {
            l.check("@a:x").unwrap();
        }
        assert_eq!(
            l.check("@a:x"),
            Err(RateLimited {
                limit: "test",
                retry_after_ms: 5000
            })
        );
        clock.advance(4_999);
        assert_eq!(l.check("@a:x").unwrap_err().retry_after_ms, 1);
        clock.advance(1);
        l.check("@a:x").unwrap();
        assert_eq!(l.check("@a:x").unwrap_err().retry_after_ms, 5000);
        // Other keys are independent.
        l.check("@b:x").unwrap();
        // Fully drained after 50 s: a full burst again.
        clock.advance(50_000);
        for _ in 0..10 {
            l.check("@a:x").unwrap();
        }
        assert!(l.check("@a:x").is_err());
    }

    #[test]
    fn peek_counts_nothing_and_record_counts_always() {
        let (l, clock) = limiter(Rate::new(0.17, 3), 10);
        for _ in 0..100 {
            l.peek("k").unwrap();
        }
        assert_eq!(l.len(), 0);
        l.record("k");
        l.record("k");
        l.peek("k").unwrap();
        l.record("k");
        // 3 recorded: the bucket is full; one drains in 1/0.17 s = 5883 ms.
        assert_eq!(l.peek("k").unwrap_err().retry_after_ms, 5883);
        l.record("k"); // counted anyway: now 4, the wait grows
        assert_eq!(l.peek("k").unwrap_err().retry_after_ms, 11765);
        clock.advance(11_765);
        l.peek("k").unwrap();
    }

    #[test]
    fn off_passes_everything_and_keeps_nothing() {
        let (l, _) = limiter(Rate::OFF, 10);
        for _ in 0..1000 {
            l.check("k").unwrap();
            l.record("k");
        }
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn the_map_is_bounded_drained_buckets_are_evicted_and_overflow_shares_one_bucket() {
        let (l, clock) = limiter(Rate::new(1.0, 2), 100);
        for i in 0..100 {
            l.check(&format!("10.0.0.{i}")).unwrap();
        }
        assert_eq!(l.len(), 100);
        // Full of live buckets: 500 new addresses share one overflow bucket (burst 2).
        let refused = (0..500)
            .filter(|i| l.check(&format!("10.1.0.{i}")).is_err())
            .count();
        assert_eq!(refused, 498);
        assert_eq!(l.len(), 101, "100 buckets and the overflow bucket");
        // After every bucket drained (1 s per action), a sweep frees the map.
        clock.advance(2_000);
        l.check("10.2.0.1").unwrap();
        assert_eq!(l.len(), 1);
        // Known keys keep their own bucket.
        l.check("10.2.0.1").unwrap();
        assert!(l.check("10.2.0.1").is_err());
    }
}
