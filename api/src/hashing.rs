//! Password hashing with a bounded cost (issue 17 item 1).
//!
//! Every argon2 hash and verification runs on a fixed pool of worker threads
//! (`[password_hashing] pool_size`, default the core count) fed by a bounded queue
//! (`queue_len` jobs waiting). A job that finds the queue full is refused at once with
//! 429 `M_LIMIT_EXCEEDED` (`retry_after_ms`), so an unauthenticated client can neither
//! queue unbounded work nor make the server allocate unbounded memory.
//!
//! Memory: each worker owns one argon2 block buffer, allocated on its first job and
//! reused for every job after it, sized for the largest `m_cost` it has met (the
//! configured one, or a stored hash's own if an older configuration used more). So the
//! hashing memory is `pool_size × m_cost_kib` KiB, whatever the load: before this pool,
//! 200 concurrent logins ran 200 hashes at once on tokio's blocking pool, each with its
//! own 19 MiB buffer, and took the process from 0.5 to 4.1 GB.
//!
//! Invariants: at most `pool_size` jobs run at once (by construction: one job per
//! worker thread; [`HashPool::max_running`] counts it for tests), at most `queue_len`
//! wait, and a refused job costs no hashing.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
    mpsc,
};

use crate::MatrixError;
use argon2::{
    Algorithm, Argon2, Block, Params, Version,
    password_hash::{Output, ParamsString, PasswordHash, SaltString},
};

/// Hashing settings (`[password_hashing]` in the config).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashingConfig {
    /// Worker threads (at most this many hashes run at once). `0`: the core count.
    pub pool_size: usize,
    /// Jobs that may wait for a worker; one more is refused with 429.
    pub queue_len: usize,
    /// argon2id memory cost of new hashes, KiB (OWASP's minimum: 19456 = 19 MiB).
    pub m_cost_kib: u32,
    /// argon2id iterations of new hashes.
    pub t_cost: u32,
    /// argon2id lanes of new hashes (computed on one thread here).
    pub p_cost: u32,
}

impl Default for HashingConfig {
    fn default() -> Self {
        HashingConfig {
            pool_size: 0,
            queue_len: 256,
            m_cost_kib: Params::DEFAULT_M_COST,
            t_cost: Params::DEFAULT_T_COST,
            p_cost: Params::DEFAULT_P_COST,
        }
    }
}

impl HashingConfig {
    /// The argon2 parameters of new hashes; an invalid combination is an error naming
    /// the bound it breaks (checked when the config is validated).
    pub fn params(&self) -> Result<Params, String> {
        Params::new(self.m_cost_kib, self.t_cost, self.p_cost, None).map_err(|e| {
            format!(
                "password_hashing: invalid argon2 parameters (m_cost_kib {}, t_cost {}, p_cost {}): {e}; \
                 m_cost_kib must be at least 8 × p_cost",
                self.m_cost_kib, self.t_cost, self.p_cost
            )
        })
    }

    /// The pool size in effect: `pool_size`, or the core count for `0`.
    pub fn effective_pool_size(&self) -> usize {
        if self.pool_size > 0 {
            self.pool_size
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        }
    }
}

enum Work {
    Hash(String),
    Verify { password: String, hash: String },
}

enum Done {
    Hashed(Result<String, String>),
    Verified(bool),
}

struct Job {
    work: Work,
    reply: tokio::sync::oneshot::Sender<Done>,
}

struct Counters {
    running: AtomicUsize,
    max_running: AtomicUsize,
    queued: AtomicUsize,
    completed: AtomicUsize,
    refused: AtomicUsize,
    buffer_bytes: AtomicUsize,
}

/// The hashing pool. Cloning shares it; the workers stop when the last clone is
/// dropped.
#[derive(Clone)]
pub struct HashPool {
    tx: mpsc::SyncSender<Job>,
    counters: Arc<Counters>,
    size: usize,
}

/// Hashing refused because the queue is full: 429 `M_LIMIT_EXCEEDED`.
pub fn busy() -> MatrixError {
    MatrixError::limit_exceeded(
        "Too many password checks in progress; try again shortly",
        BUSY_RETRY_AFTER_MS,
    )
}

/// `retry_after_ms` of a refusal by a full queue.
pub const BUSY_RETRY_AFTER_MS: u64 = 1_000;

impl HashPool {
    /// Starts `config.effective_pool_size()` worker threads. Panics on invalid argon2
    /// parameters (the config's validation rejects them first).
    pub fn start(config: &HashingConfig) -> HashPool {
        let params = config.params().expect("validated argon2 parameters");
        let size = config.effective_pool_size();
        let (tx, rx) = mpsc::sync_channel::<Job>(config.queue_len);
        let rx = Arc::new(Mutex::new(rx));
        let counters = Arc::new(Counters {
            running: AtomicUsize::new(0),
            max_running: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            buffer_bytes: AtomicUsize::new(0),
        });
        for i in 0..size {
            let rx = rx.clone();
            let counters = counters.clone();
            let params = params.clone();
            std::thread::Builder::new()
                .name(format!("spindle-hash-{i}"))
                .spawn(move || worker(rx, counters, params))
                .expect("spawning a hashing thread");
        }
        HashPool { tx, counters, size }
    }

    fn run(&self, work: Work) -> Result<tokio::sync::oneshot::Receiver<Done>, MatrixError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.counters.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job { work, reply }) {
            Ok(()) => Ok(rx),
            Err(_) => {
                self.counters.queued.fetch_sub(1, Ordering::SeqCst);
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                Err(busy())
            }
        }
    }

    /// Hashes a new password (argon2id, a random 16-byte salt, the configured cost) into
    /// a PHC string. Queue full: 429 `M_LIMIT_EXCEEDED`.
    pub async fn hash(&self, password: String) -> Result<String, MatrixError> {
        match self.run(Work::Hash(password))?.await {
            Ok(Done::Hashed(Ok(h))) => Ok(h),
            Ok(Done::Hashed(Err(e))) => Err(MatrixError::internal(e)),
            _ => Err(MatrixError::internal("the hashing pool stopped")),
        }
    }

    /// Checks a password against a stored PHC hash, with the hash's own parameters.
    /// `Ok(false)` for a wrong password or an unreadable hash; queue full: 429.
    pub async fn verify(&self, password: String, hash: String) -> Result<bool, MatrixError> {
        match self.run(Work::Verify { password, hash })?.await {
            Ok(Done::Verified(ok)) => Ok(ok),
            _ => Err(MatrixError::internal("the hashing pool stopped")),
        }
    }

    /// Worker threads.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The most jobs ever seen running at once (never more than [`HashPool::size`]).
    pub fn max_running(&self) -> usize {
        self.counters.max_running.load(Ordering::SeqCst)
    }

    /// Jobs accepted and not finished yet (waiting or running).
    pub fn queue_depth(&self) -> usize {
        self.counters.queued.load(Ordering::SeqCst)
    }

    /// Jobs finished.
    pub fn completed(&self) -> usize {
        self.counters.completed.load(Ordering::SeqCst)
    }

    /// Jobs refused because the queue was full.
    pub fn refused(&self) -> usize {
        self.counters.refused.load(Ordering::SeqCst)
    }

    /// Bytes held by the workers' argon2 buffers (at most `size × m_cost_kib × 1024`).
    pub fn buffer_bytes(&self) -> usize {
        self.counters.buffer_bytes.load(Ordering::SeqCst)
    }
}

fn worker(rx: Arc<Mutex<mpsc::Receiver<Job>>>, counters: Arc<Counters>, params: Params) {
    let mut blocks: Vec<Block> = Vec::new();
    loop {
        let job = {
            let Ok(rx) = rx.lock() else { return };
            match rx.recv() {
                Ok(job) => job,
                Err(_) => return, // every HashPool clone is gone
            }
        };
        let now = counters.running.fetch_add(1, Ordering::SeqCst) + 1;
        counters.max_running.fetch_max(now, Ordering::SeqCst);
        let done = match job.work {
            Work::Hash(password) => {
                Done::Hashed(hash_with(&params, &password, &mut blocks, &counters))
            }
            Work::Verify { password, hash } => {
                Done::Verified(verify_with(&password, &hash, &mut blocks, &counters))
            }
        };
        counters.running.fetch_sub(1, Ordering::SeqCst);
        counters.queued.fetch_sub(1, Ordering::SeqCst);
        counters.completed.fetch_add(1, Ordering::SeqCst);
        // The requester may have gone away (client disconnected): nothing to tell.
        let _ = job.reply.send(done);
    }
}

/// The worker's buffer, grown (never shrunk) to `count` blocks.
fn memory<'a>(blocks: &'a mut Vec<Block>, count: usize, counters: &Counters) -> &'a mut [Block] {
    if blocks.len() < count {
        let before = blocks.len() * std::mem::size_of::<Block>();
        blocks.resize(count, Block::default());
        let after = blocks.len() * std::mem::size_of::<Block>();
        counters
            .buffer_bytes
            .fetch_add(after - before, Ordering::SeqCst);
    }
    &mut blocks[..count]
}

fn hash_with(
    params: &Params,
    password: &str,
    blocks: &mut Vec<Block>,
    counters: &Counters,
) -> Result<String, String> {
    let salt_bytes: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt_bytes).map_err(|e| e.to_string())?;
    let argon = Argon2::new(Algorithm::Argon2id, Version::V0x13, params.clone());
    let mut out = [0u8; Params::DEFAULT_OUTPUT_LEN];
    argon
        .hash_password_into_with_memory(
            password.as_bytes(),
            &salt_bytes,
            &mut out,
            memory(blocks, params.block_count(), counters),
        )
        .map_err(|e| e.to_string())?;
    let phc = PasswordHash {
        algorithm: Algorithm::Argon2id.ident(),
        version: Some(Version::V0x13.into()),
        params: ParamsString::try_from(params).map_err(|e| e.to_string())?,
        salt: Some(salt.as_salt()),
        hash: Some(Output::new(&out).map_err(|e| e.to_string())?),
    };
    Ok(phc.to_string())
}

fn verify_with(password: &str, hash: &str, blocks: &mut Vec<Block>, counters: &Counters) -> bool {
    let mut check = || -> Option<bool> {
        let phc = PasswordHash::new(hash).ok()?;
        let algorithm = Algorithm::try_from(phc.algorithm).ok()?;
        let version = match phc.version {
            Some(v) => Version::try_from(v).ok()?,
            None => Version::default(),
        };
        let params = Params::try_from(&phc).ok()?;
        let expected = phc.hash?;
        let mut salt_buf = [0u8; 64];
        let salt = phc.salt?.decode_b64(&mut salt_buf).ok()?;
        let mut out = vec![0u8; expected.len()];
        Argon2::new(algorithm, version, params.clone())
            .hash_password_into_with_memory(
                password.as_bytes(),
                salt,
                &mut out,
                memory(blocks, params.block_count(), counters),
            )
            .ok()?;
        // `Output`'s equality is constant-time.
        Some(Output::new(&out).ok()? == expected)
    };
    check().unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn cheap(pool_size: usize, queue_len: usize) -> HashingConfig {
        HashingConfig {
            pool_size,
            queue_len,
            m_cost_kib: 64,
            t_cost: 1,
            p_cost: 1,
        }
    }

    #[tokio::test]
    async fn hash_then_verify_round_trips_and_reads_the_argon2_crate_format() {
        let pool = HashPool::start(&cheap(1, 4));
        let h = pool.hash("hunter2".into()).await.unwrap();
        assert!(h.starts_with("$argon2id$v=19$m=64,t=1,p=1$"), "{h}");
        assert!(pool.verify("hunter2".into(), h.clone()).await.unwrap());
        assert!(!pool.verify("hunter3".into(), h.clone()).await.unwrap());
        assert!(!pool.verify("x".into(), "not a hash".into()).await.unwrap());
        // A hash written by the argon2 crate's own PasswordHasher (what registrations
        // before this pool stored) verifies with its own, different, parameters.
        use argon2::PasswordHasher;
        let salt = SaltString::encode_b64(&[7u8; 16]).unwrap();
        let old = Argon2::default()
            .hash_password(b"old password", &salt)
            .unwrap()
            .to_string();
        assert!(
            pool.verify("old password".into(), old.clone())
                .await
                .unwrap()
        );
        assert!(!pool.verify("new password".into(), old).await.unwrap());
        assert_eq!(pool.completed(), 6);
        // One worker; its buffer grew once to the default 19 MiB and is reused.
        assert_eq!(pool.buffer_bytes(), 19 * 1024 * 1024);
        assert_eq!(pool.max_running(), 1);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_with_limit_exceeded() {
        // One worker and a queue of 2: of 40 jobs submitted at once, at most 3 can be in
        // the pool at a time; the rest are refused without hashing.
        let pool = HashPool::start(&HashingConfig {
            m_cost_kib: 8 * 1024,
            ..cheap(1, 2)
        });
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..40 {
            let pool = pool.clone();
            tasks.spawn(async move { pool.hash(format!("p{i}")).await });
        }
        let results = tasks.join_all().await;
        let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok + refused.len(), 40);
        assert!(ok >= 1, "the first job always finds room");
        assert!(
            !refused.is_empty(),
            "40 jobs cannot all fit in 1 worker + 2 places"
        );
        assert_eq!(pool.refused(), refused.len());
        assert_eq!(pool.completed(), ok);
        for e in refused {
            assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(e.errcode, "M_LIMIT_EXCEEDED");
            assert_eq!(e.extra, Some(serde_json::json!({ "retry_after_ms": 1000 })));
        }
        assert_eq!(pool.queue_depth(), 0);
        assert_eq!(pool.max_running(), 1);
    }

    #[test]
    fn invalid_parameters_are_named() {
        let bad = HashingConfig {
            m_cost_kib: 4,
            ..HashingConfig::default()
        };
        assert!(bad.params().unwrap_err().contains("m_cost_kib 4"));
        assert!(HashingConfig::default().params().is_ok());
    }
}
