//! The gateway's durable state behind one interface, on PostgreSQL or on the
//! embedded SQLite, with the same semantics and one test suite.
//!
//! What lives here: the coordinator lease and its term log, members (with a
//! TTL), the desired instances, assignments (owner, process, term, phase),
//! durable operations and signing keys. Coordinator writes — assignments,
//! operations, key rotation — go only through [`Store::write_fenced`], which
//! checks the caller's lease in the same transaction as the write.
//!
//! Every time the store computes (lease expiry, member TTL, record stamps)
//! comes from the database clock, and inside a lease transaction that clock is
//! sampled only after the lease row is locked: a clock read taken before a
//! lock wait would judge a lease that expired during the wait as still live.
//!
//! No transaction is left open by a cancelled future: every operation that
//! opens one runs in its own task ([`Store::detached`]), so a caller that gives
//! up (a timeout, a dropped request) leaves it to commit or roll back on its
//! own; and a connection that still counts as inside a transaction when it
//! returns to the pool is closed, never reused.
//!
//! One file per aggregate, each an `impl Store` block: `lease.rs` (the lease,
//! its term log, holder liveness), `fenced.rs` (the fenced writes and the
//! assignments they keep), `members.rs` (members and replicas), `instances.rs`
//! (registrations, withdrawals and owners' reports), `grants.rs` (grants and
//! activation), `operations.rs` (operator requests and the operations table),
//! `keys.rs` (signing keys); `open.rs` opens the store; [`sealing`] seals the private keys
//! and registration materials it keeps. Rows are mapped by
//! `sqlx::FromRow` on the records (`types.rs`) with the column types of
//! `columns.rs`.

mod audit;
pub mod builds;
pub mod columns;
mod decide;
mod dialect;
mod fenced;
pub mod files;
mod grants;
mod instances;
mod keys;
mod lease;
pub mod liveness;
mod members;
mod open;
mod operations;
mod redact;
pub mod sealing;
mod term;
mod types;

use std::time::Duration;

use sqlx::AnyPool;

pub use audit::{AUDIT_RETENTION_MS, AuditEntry, Denials, Recorded};
pub use dialect::Backend;
pub use redact::{redact_url, scrub};
pub use term::{CoordinatorTerm, Negative, OutOfRange, OwnershipTerm};
pub use types::*;

/// Errors of the store. `Fenced` and `Conflict` are the expected, typed
/// refusals of a stale writer; the others are operational failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller's coordinator lease is no longer valid. Nothing was written.
    #[error("coordinator lease fenced: {0}")]
    Fenced(#[from] Fence),
    /// A compare-and-set precondition did not hold. Nothing was written.
    #[error("compare-and-set conflict on {subject}: {detail}")]
    Conflict { subject: String, detail: String },
    /// The write acts on what the store records as another party's (a term reserved for
    /// another member, a grant issued to another member). Nothing was written.
    #[error("refused on {subject}: {detail}")]
    Denied { subject: String, detail: String },
    /// The write itself is malformed (for example a term that does not grow).
    #[error("invalid write: {0}")]
    Invalid(String),
    /// The database URL cannot be used. The message never contains secrets.
    #[error("invalid database URL {url}: {reason}")]
    Url { url: String, reason: String },
    /// The database could not be reached.
    #[error("cannot connect to database {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    /// The migrations in the repository could not be applied.
    #[error("cannot apply database migrations on {url}: {source}")]
    Migrate {
        url: String,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    /// A newer build migrated the database past what this build can run against.
    #[error(
        "the database schema on {url} is at migration {newest}, applied by a newer build, and needs a build \
         whose newest migration is at least {oldest_reader}; this build's is {ours}: run the newer build \
         (docs/operate.md, \"Upgrades and rollbacks\")"
    )]
    SchemaTooNew {
        url: String,
        newest: i64,
        oldest_reader: i64,
        ours: i64,
    },
    /// The database answered a statement with an error (or timed out).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A value read back from the database does not parse.
    #[error("corrupt record in {table}: {detail}")]
    Corrupt { table: &'static str, detail: String },
    /// The SQLite database file or its directory cannot be made private.
    #[error("cannot secure the database file {path} (directory 0700, files 0600): {source}")]
    Files {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The runtime shut down under a store operation.
    #[error("the store operation was interrupted by the runtime shutting down")]
    Interrupted,
}

/// Why a fenced call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fence {
    #[error("no coordinator has ever held the lease")]
    NoLease,
    /// Another holder or a later term owns the lease.
    #[error("the lease is at term {current_term}, not term {term}")]
    Superseded {
        term: CoordinatorTerm,
        current_term: CoordinatorTerm,
    },
    /// Same holder and term, but the lease expired by the database clock.
    #[error("lease term {term} expired at {expires_at_ms} (database time {now_ms})")]
    Expired {
        term: CoordinatorTerm,
        expires_at_ms: i64,
        now_ms: i64,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Connection settings shared by both backends.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bound on waiting for a pooled connection (and so on connecting).
    pub connect_timeout: Duration,
    /// Bound on any one statement, lock waits included.
    pub statement_timeout: Duration,
    /// PostgreSQL ends a session of ours that sits inside a transaction this long without
    /// sending a statement, releasing its locks: a replica frozen mid-transaction (stopped,
    /// paused by its host, cut off after `BEGIN`) would otherwise hold the lease row, and so
    /// the pool's leadership, until TCP gives up on it — hours. No transaction of ours waits
    /// on anything but the database between its statements.
    pub idle_in_transaction_timeout: Duration,
    pub max_connections: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(10),
            idle_in_transaction_timeout: Duration::from_secs(3),
            max_connections: 8,
        }
    }
}

/// The channel of migration `0013_pool_writes_notify`.
const POOL_WRITES_CHANNEL: &str = "openshell_pool_writes";

/// The store. Cheap to clone: clones share one connection pool.
#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// This process's liveness key (see [`liveness`]).
    key: String,
    /// SQLite: where liveness locks live, and this process's own lock.
    locks: Option<(std::path::PathBuf, std::sync::Arc<liveness::FileLock>)>,
    /// The key-encryption keys the signing keys' private halves are sealed with (see
    /// [`sealing`]); the store itself only keeps the sealed bytes.
    keks: Option<std::sync::Arc<sealing::Keks>>,
    /// PostgreSQL: where [`Store::listen_pool_writes`] connects (never shown: it may carry a
    /// password).
    listen_url: Option<std::sync::Arc<str>>,
    /// SQLite: the write-ahead log every committed transaction appends to (or restarts).
    sqlite_wal: Option<std::sync::Arc<std::path::Path>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("backend", &self.backend).finish()
    }
}

impl Store {
    /// This store with the key-encryption keys that open its signing keys.
    pub fn with_keks(self, keks: std::sync::Arc<sealing::Keks>) -> Self {
        Self {
            keks: Some(keks),
            ..self
        }
    }

    /// The key-encryption keys, when configured.
    pub fn keks(&self) -> Option<&sealing::Keks> {
        self.keks.as_deref()
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Run an operation that opens a transaction in a task of its own: the
    /// caller may stop waiting (a timeout, a cancelled request), the
    /// transaction still commits or rolls back and its connection returns to
    /// the pool outside any transaction. Cancelling it half-way instead can
    /// leave the connection inside `BEGIN` (sqlx only tracks the transaction
    /// once `begin` returns): on SQLite with the write lock held for good.
    async fn detached<T, F, Fut>(&self, operation: F) -> Result<T>
    where
        F: FnOnce(Store) -> Fut,
        Fut: std::future::Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        match tokio::spawn(operation(self.clone())).await {
            Ok(outcome) => outcome,
            Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
            Err(_) => Err(Error::Interrupted),
        }
    }

    /// SQLite (a file): its write-ahead log, which every commit of any process appends to or
    /// restarts — a cheap sign that [`Store::pool_writes`] may have moved. `None` on
    /// PostgreSQL and for an in-memory database.
    pub fn sqlite_wal(&self) -> Option<&std::path::Path> {
        self.sqlite_wal.as_deref()
    }

    /// PostgreSQL: a connection that receives a notification each time a transaction that
    /// wrote a table the pool view reads commits (migration `0013_pool_writes_notify`); `None`
    /// on SQLite, whose replicas read on their own clock.
    pub async fn listen_pool_writes(&self, within: Duration) -> Option<Result<sqlx::postgres::PgListener>> {
        let url = self.listen_url.as_deref()?;
        let listen = async {
            let mut listener = sqlx::postgres::PgListener::connect(url).await?;
            listener.listen(POOL_WRITES_CHANNEL).await?;
            Ok(listener)
        };
        Some(match tokio::time::timeout(within, listen).await {
            Ok(outcome) => outcome.map_err(|source| open::connect_error(url, &redact_url(url), source)),
            Err(_) => Err(Error::Connect {
                url: redact_url(url),
                source: sqlx::Error::PoolTimedOut,
            }),
        })
    }

    /// The database clock, in Unix milliseconds.
    pub async fn now_ms(&self) -> Result<i64> {
        self.clock(&self.pool).await
    }

    /// The database clock as `executor` (the pool, or a transaction) reads it.
    async fn clock<'e>(&self, executor: impl sqlx::Executor<'e, Database = sqlx::Any>) -> Result<i64> {
        Ok(sqlx::query_scalar(&format!("SELECT {}", self.backend.clock_expr()))
            .fetch_one(executor)
            .await?)
    }

    /// How many writes were committed to each table the pool view reads in full, counted by
    /// triggers in the writing transactions (migration `0011_pool_writes`). Taken before the
    /// tables are read, an equal count at the next read means the table did not change.
    ///
    /// On PostgreSQL the server's start time comes with them (`incarnation`): a server that
    /// restarted may have lost commits (asynchronous commit, a promoted replica), and counts
    /// that rolled back can climb to a value read before, which must not pass for "unchanged".
    pub async fn pool_writes(&self) -> Result<PoolWrites> {
        const COUNTS: &str =
            "SELECT table_name, CAST(SUM(writes) AS BIGINT) AS writes FROM pool_writes GROUP BY table_name";
        let sql = match self.backend {
            Backend::Postgres => format!(
                "{COUNTS} UNION ALL \
                 SELECT 'incarnation', CAST(EXTRACT(EPOCH FROM pg_postmaster_start_time()) * 1000 AS BIGINT)"
            ),
            _ => COUNTS.to_owned(),
        };
        let rows: Vec<(String, i64)> = sqlx::query_as(&sql).fetch_all(&self.pool).await?;
        let mut writes = PoolWrites::default();
        for (table, count) in rows {
            match table.as_str() {
                "instances" => writes.instances = count,
                "assignments" => writes.assignments = count,
                "instance_reports" => writes.reports = count,
                "operations" => writes.operations = count,
                "incarnation" => writes.incarnation = count,
                _ => {}
            }
        }
        Ok(writes)
    }

    /// PostgreSQL: this database's committed and rolled-back transactions and rows read
    /// (returned + fetched) since its statistics were reset; `None` on SQLite. For
    /// measurements (`scenarios scale`).
    pub async fn database_activity(&self) -> Result<Option<(i64, i64)>> {
        if self.backend != Backend::Postgres {
            return Ok(None);
        }
        let activity = sqlx::query_as(
            "SELECT (xact_commit + xact_rollback)::BIGINT AS transactions, (tup_returned + tup_fetched)::BIGINT AS rows_read \
             FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Some(activity))
    }

    /// Close the pool (waits for checked-out connections to return).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// Milliseconds of a duration as the i64 the tables use, saturating.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
