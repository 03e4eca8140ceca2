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

mod decide;
mod dialect;
pub mod files;
pub mod liveness;
mod redact;
mod types;

use std::time::Duration;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{Any, AnyPool, Connection, Row, Transaction};

pub use dialect::Backend;
use dialect::LockMode;
pub use redact::{redact_url, scrub};
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
    Superseded { term: i64, current_term: i64 },
    /// Same holder and term, but the lease expired by the database clock.
    #[error("lease term {term} expired at {expires_at_ms} (database time {now_ms})")]
    Expired { term: i64, expires_at_ms: i64, now_ms: i64 },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Connection settings shared by both backends.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bound on waiting for a pooled connection (and so on connecting).
    pub connect_timeout: Duration,
    /// Bound on any one statement, lock waits included.
    pub statement_timeout: Duration,
    pub max_connections: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(10),
            max_connections: 8,
        }
    }
}

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
    /// [`crate::tokens::sealing`]); the store itself only keeps the sealed bytes.
    keks: Option<std::sync::Arc<crate::tokens::Keks>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("backend", &self.backend).finish()
    }
}

impl Store {
    /// Open the store named by `url` (`postgres://…`, `postgresql://…` or
    /// `sqlite:…`) and apply the repository's migrations for that backend.
    pub async fn open(url: &str, options: &Options) -> Result<Self> {
        let shown = redact_url(url);
        let backend = Backend::from_url(url).ok_or_else(|| Error::Url {
            url: shown.clone(),
            reason: "expected a postgres://, postgresql:// or sqlite: URL".into(),
        })?;
        if let Some(path) = files::sqlite_path(url) {
            let secured = path.clone();
            tokio::task::spawn_blocking(move || files::secure_sqlite(&secured))
                .await
                .map_err(|_| Error::Interrupted)?
                .map_err(|source| Error::Files {
                    path: path.display().to_string(),
                    source,
                })?;
        }
        sqlx::any::install_default_drivers();
        // One direct attempt first: a pool only reports that it timed out,
        // while this names the cause (refused, unknown host, bad password).
        let probe = tokio::time::timeout(options.connect_timeout, sqlx::AnyConnection::connect(url)).await;
        match probe {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
            }
            Ok(Err(source)) => return Err(connect_error(url, &shown, source)),
            Err(_) => {
                return Err(Error::Connect {
                    url: shown,
                    source: sqlx::Error::PoolTimedOut,
                });
            }
        }
        let key = liveness::new_key();
        let locks = match liveness::lock_dir(url) {
            Some(dir) if backend == Backend::Sqlite => {
                let lock = liveness::FileLock::take(&dir, &key).map_err(|source| Error::Url {
                    url: shown.clone(),
                    reason: format!("cannot create the liveness lock beside the database: {source}"),
                })?;
                Some((dir, std::sync::Arc::new(lock)))
            }
            _ => None,
        };
        let setup = backend.session_setup(options, &liveness::application_name(&key));
        let pool = AnyPoolOptions::new()
            .max_connections(options.max_connections)
            .min_connections(1)
            .acquire_timeout(options.connect_timeout)
            // A connection that comes back inside a transaction (one whose
            // `BEGIN` was cancelled after it ran, and so has no `Transaction`
            // left to end it) would hold its locks — SQLite's write lock —
            // for as long as it lives: close it. A dropped `Transaction` only
            // queues its rollback; the ping lets it run first.
            .after_release(|conn, _| {
                Box::pin(async move {
                    if conn.is_in_transaction() {
                        conn.ping().await?;
                    }
                    Ok(!conn.is_in_transaction())
                })
            })
            .after_connect(move |conn, _| {
                let setup = setup.clone();
                Box::pin(async move {
                    for statement in setup.split(';') {
                        sqlx::Executor::execute(&mut *conn, statement).await?;
                    }
                    Ok(())
                })
            })
            .connect(url)
            .await
            .map_err(|source| connect_error(url, &shown, source))?;
        let store = Self {
            pool,
            backend,
            key,
            locks,
            keks: None,
        };
        store.migrate(&shown).await?;
        Ok(store)
    }

    async fn migrate(&self, shown: &str) -> Result<()> {
        let migrator = match self.backend {
            Backend::Postgres => sqlx::migrate!("./migrations/postgres"),
            Backend::Sqlite => sqlx::migrate!("./migrations/sqlite"),
        };
        // PostgreSQL serialises concurrent migrators with an advisory lock;
        // SQLite has none, so a replica that loses the race to another
        // process sees its tables appear and tries again.
        let mut attempt = 0;
        loop {
            match migrator.run(&self.pool).await {
                Ok(()) => return Ok(()),
                Err(_) if self.backend == Backend::Sqlite && attempt < 3 => attempt += 1,
                Err(source) => {
                    return Err(Error::Migrate {
                        url: shown.to_owned(),
                        source,
                    });
                }
            }
        }
    }

    /// This store with the key-encryption keys that open its signing keys.
    pub fn with_keks(self, keks: std::sync::Arc<crate::tokens::Keks>) -> Self {
        Self {
            keks: Some(keks),
            ..self
        }
    }

    /// The key-encryption keys, when configured.
    pub fn keks(&self) -> Option<&crate::tokens::Keks> {
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

    /// This process's liveness key: the suffix of its lease holder id.
    pub fn liveness_key(&self) -> &str {
        &self.key
    }

    /// Whether the process of lease holder `holder` is still alive, as far
    /// as the database (or the machine, for SQLite) can tell.
    pub async fn holder_alive(&self, holder: &str) -> Result<bool> {
        let key = liveness::key_of(holder);
        match &self.locks {
            Some((dir, _)) => Ok(liveness::file_holder_alive(dir, key)),
            None => Ok(sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(liveness::application_name(key))
            .fetch_one(&self.pool)
            .await?
                > 0),
        }
    }

    /// Take over a live lease whose holder's process is gone: compare-and-set
    /// on the observed holder and term, to the next term. `None` when the
    /// lease changed since it was observed.
    pub async fn take_over_lease(&self, holder: &str, length: Duration, observed: &LeaseView) -> Result<Option<Lease>> {
        let (holder, observed) = (holder.to_owned(), observed.clone());
        self.detached(move |store| async move { store.take_over_lease_now(&holder, length, &observed).await })
            .await
    }

    async fn take_over_lease_now(&self, holder: &str, length: Duration, observed: &LeaseView) -> Result<Option<Lease>> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        if row.holder != observed.holder || row.term != observed.term {
            return Ok(None);
        }
        let lease = Lease {
            holder: holder.to_owned(),
            term: row.term + 1,
            expires_at_ms: row.now_ms.saturating_add(millis(length)),
        };
        set_lease(&mut tx, &lease).await?;
        sqlx::query("INSERT INTO coordinator_terms (term, holder, acquired_at_ms) VALUES ($1, $2, $3)")
            .bind(lease.term)
            .bind(&lease.holder)
            .bind(row.now_ms)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(lease))
    }

    /// The database clock, in Unix milliseconds.
    pub async fn now_ms(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(&format!("SELECT {}", self.backend.clock_expr()))
            .fetch_one(&self.pool)
            .await?)
    }

    /// How many writes were committed to each table the pool view reads in full, counted by
    /// triggers in the writing transactions (migration `0011_pool_writes`). Taken before the
    /// tables are read, an equal count at the next read means the table did not change.
    pub async fn pool_writes(&self) -> Result<PoolWrites> {
        let rows = sqlx::query(
            "SELECT table_name, CAST(SUM(writes) AS BIGINT) AS writes FROM pool_writes GROUP BY table_name",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut writes = PoolWrites::default();
        for row in &rows {
            let count: i64 = row.try_get("writes")?;
            match row.try_get::<String, _>("table_name")?.as_str() {
                "instances" => writes.instances = count,
                "assignments" => writes.assignments = count,
                "instance_reports" => writes.reports = count,
                "operations" => writes.operations = count,
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
        let row = sqlx::query(
            "SELECT (xact_commit + xact_rollback)::BIGINT AS transactions, (tup_returned + tup_fetched)::BIGINT AS rows_read \
             FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Some((row.try_get("transactions")?, row.try_get("rows_read")?)))
    }

    // ---- coordinator lease -----------------------------------------------

    /// Begin a transaction, lock the lease row, and only then sample the
    /// database clock.
    async fn lock_lease(&self, mode: LockMode) -> Result<(Transaction<'static, Any>, LeaseView)> {
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let row = sqlx::query(&self.backend.lock_lease_sql(mode))
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(Error::Corrupt {
                table: "coordinator_lease",
                detail: "the lease row is missing".into(),
            })?;
        let now_ms: i64 = sqlx::query_scalar(&format!("SELECT {}", self.backend.clock_expr()))
            .fetch_one(&mut *tx)
            .await?;
        let view = LeaseView {
            holder: row.try_get("holder")?,
            term: row.try_get("term")?,
            expires_at_ms: row.try_get("expires_at_ms")?,
            now_ms,
        };
        Ok((tx, view))
    }

    /// Try to become (or stay) the coordinator; see [`decide::acquire`].
    pub async fn acquire_lease(&self, holder: &str, length: Duration) -> Result<Acquire> {
        let holder = holder.to_owned();
        self.detached(move |store| async move { store.acquire_lease_now(&holder, length).await })
            .await
    }

    async fn acquire_lease_now(&self, holder: &str, length: Duration) -> Result<Acquire> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        let outcome = decide::acquire(&row, holder, millis(length));
        if let Acquire::Acquired(lease) = &outcome {
            set_lease(&mut tx, lease).await?;
            if lease.term != row.term {
                sqlx::query("INSERT INTO coordinator_terms (term, holder, acquired_at_ms) VALUES ($1, $2, $3)")
                    .bind(lease.term)
                    .bind(&lease.holder)
                    .bind(row.now_ms)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        }
        Ok(outcome)
    }

    /// Extend the caller's lease: only the same holder and term, before expiry.
    pub async fn renew_lease(&self, lease: &Lease, length: Duration) -> Result<Lease> {
        let lease = lease.clone();
        self.detached(move |store| async move { store.renew_lease_now(&lease, length).await })
            .await
    }

    async fn renew_lease_now(&self, lease: &Lease, length: Duration) -> Result<Lease> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        decide::fence(&row, lease)?;
        let renewed = Lease {
            expires_at_ms: row.now_ms.saturating_add(millis(length)),
            ..lease.clone()
        };
        set_lease(&mut tx, &renewed).await?;
        tx.commit().await?;
        Ok(renewed)
    }

    /// Graceful release: expires the lease at once and keeps its term, so the
    /// next acquire (by anyone) takes the next term without waiting. Returns
    /// `false` when the lease was already lost (nothing changes then).
    pub async fn release_lease(&self, lease: &Lease) -> Result<bool> {
        let lease = lease.clone();
        self.detached(move |store| async move { store.release_lease_now(&lease).await })
            .await
    }

    async fn release_lease_now(&self, lease: &Lease) -> Result<bool> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        if decide::fence(&row, lease).is_err() {
            return Ok(false);
        }
        let released = Lease {
            expires_at_ms: row.now_ms,
            ..lease.clone()
        };
        set_lease(&mut tx, &released).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The lease row as it stands (`None` if never held), with the database
    /// time of the read.
    pub async fn read_lease(&self) -> Result<Option<LeaseView>> {
        let sql = format!(
            "SELECT holder, term, expires_at_ms, ({}) AS now_ms FROM coordinator_lease WHERE id = 1",
            self.backend.clock_expr()
        );
        let row = sqlx::query(&sql).fetch_optional(&self.pool).await?;
        let Some(row) = row else { return Ok(None) };
        let view = LeaseView {
            holder: row.try_get("holder")?,
            term: row.try_get("term")?,
            expires_at_ms: row.try_get("expires_at_ms")?,
            now_ms: row.try_get("now_ms")?,
        };
        Ok((view.term > 0).then_some(view))
    }

    /// Every term ever granted, oldest first.
    pub async fn lease_history(&self) -> Result<Vec<TermRecord>> {
        let rows =
            sqlx::query("SELECT term, holder, acquired_at_ms, started_at_ms FROM coordinator_terms ORDER BY term")
                .fetch_all(&self.pool)
                .await?;
        rows.iter()
            .map(|r| {
                Ok(TermRecord {
                    term: r.try_get("term")?,
                    holder: r.try_get("holder")?,
                    acquired_at_ms: r.try_get("acquired_at_ms")?,
                    started_at_ms: r.try_get("started_at_ms")?,
                })
            })
            .collect()
    }

    /// Apply `writes` in one transaction that first locks the lease row in a
    /// mode that conflicts with a takeover (PostgreSQL `FOR SHARE`; SQLite's
    /// write lock), then checks holder, term and expiry against the database
    /// clock sampled after the lock. All or nothing: a stale holder's batch,
    /// or a batch with one failed compare-and-set, changes nothing.
    pub async fn write_fenced(&self, lease: &Lease, writes: &[FencedWrite]) -> Result<()> {
        decide::validate(writes)?;
        let (lease, writes) = (lease.clone(), writes.to_vec());
        self.detached(move |store| async move { store.write_fenced_now(&lease, &writes).await })
            .await
    }

    async fn write_fenced_now(&self, lease: &Lease, writes: &[FencedWrite]) -> Result<()> {
        let (mut tx, row) = self.lock_lease(LockMode::Shared).await?;
        decide::fence(&row, lease)?;
        for write in writes {
            apply(&mut tx, write, lease.term, row.now_ms).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    // ---- membership (any replica) -----------------------------------------

    /// Record a member process that was just admitted, replacing whatever record the member
    /// had — the record of another process included: the newest admission of a member name
    /// wins, whatever became of the process it replaces. Only a newer connection epoch of the
    /// recorded process is kept (`Error::Conflict`: this hello is a delayed older one). The
    /// record expires at database now + `ttl`.
    pub async fn record_member(&self, m: &MemberUpdate, ttl: Duration) -> Result<MemberRecord> {
        let sql = format!(
            "{} ON CONFLICT (member) DO UPDATE SET process_id = excluded.process_id, epoch = excluded.epoch, \
               runtime_address = excluded.runtime_address, capacity = excluded.capacity, served_by = excluded.served_by, \
               leaving = excluded.leaving, expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms \
             WHERE NOT (members.process_id = excluded.process_id AND members.epoch > excluded.epoch) \
             RETURNING {MEMBER_COLUMNS}",
            self.insert_member_sql()
        );
        let row = bind_member(sqlx::query(&sql), m, ttl)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(row) => member_from_row(&row),
            None => Err(Error::Conflict {
                subject: format!("member {}", m.member),
                detail: format!(
                    "process {} is recorded at a newer connection epoch than {}",
                    m.process_id, m.epoch
                ),
            }),
        }
    }

    /// Extend (and update) the record of a member stream, only if the record still names its
    /// process at its connection epoch and has not expired. Never re-creates a removed or
    /// revives an expired record (the other replicas expire the members of a silent replica:
    /// once it resumes, it must not write them back as live). `None`: the record was
    /// replaced, removed or expired (see [`Store::member`] for which), and this stream must end.
    pub async fn refresh_member(&self, m: &MemberUpdate, ttl: Duration) -> Result<Option<MemberRecord>> {
        let sql = format!(
            "UPDATE members SET runtime_address = $4, capacity = $5, served_by = $6, leaving = $7, \
               expires_at_ms = ({clock}) + $8, updated_at_ms = ({clock}) \
             WHERE member = $1 AND process_id = $2 AND epoch = $3 AND expires_at_ms > ({clock}) \
             RETURNING {MEMBER_COLUMNS}",
            clock = self.backend.clock_expr()
        );
        let row = bind_member(sqlx::query(&sql), m, ttl)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(member_from_row).transpose()
    }

    fn insert_member_sql(&self) -> String {
        format!(
            "INSERT INTO members (member, process_id, epoch, runtime_address, capacity, served_by, leaving, expires_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, ({clock}) + $8, ({clock}))",
            clock = self.backend.clock_expr()
        )
    }

    /// Record that replica `name` is running (database time).
    pub async fn refresh_replica(&self, name: &str) -> Result<()> {
        sqlx::query(&format!(
            "INSERT INTO replicas (replica, refreshed_at_ms) VALUES ($1, ({clock})) \
             ON CONFLICT (replica) DO UPDATE SET refreshed_at_ms = excluded.refreshed_at_ms",
            clock = self.backend.clock_expr()
        ))
        .bind(name)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// When each replica last recorded that it is running.
    pub async fn list_replicas(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT replica, refreshed_at_ms FROM replicas ORDER BY replica")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("replica")?, r.try_get("refreshed_at_ms")?)))
            .collect()
    }

    /// Expire the live record `m` now, only if it is unchanged (same process, epoch and
    /// serving replica: the member did not attach elsewhere) and its serving replica has not
    /// recorded that it is running for longer than `silence` — both checked at database time
    /// in the same statement, so a replica that resumed in the meantime keeps its members.
    pub async fn expire_member_of_silent_replica(&self, m: &MemberRecord, silence: Duration) -> Result<bool> {
        let done = sqlx::query(&format!(
            "UPDATE members SET expires_at_ms = ({clock}), updated_at_ms = ({clock}) \
             WHERE member = $1 AND process_id = $2 AND epoch = $3 AND served_by = $4 \
               AND expires_at_ms > ({clock}) \
               AND EXISTS (SELECT 1 FROM replicas r WHERE r.replica = $4 AND r.refreshed_at_ms < ({clock}) - $5)",
            clock = self.backend.clock_expr()
        ))
        .bind(&m.member)
        .bind(&m.process_id)
        .bind(m.epoch)
        .bind(&m.served_by)
        .bind(millis(silence))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// The record of one member, if it has one, and the database time of the read.
    pub async fn member(&self, member: &str) -> Result<(i64, Option<MemberRecord>)> {
        let now_ms = self.now_ms().await?;
        let row = sqlx::query(&format!("SELECT {MEMBER_COLUMNS} FROM members WHERE member = $1"))
            .bind(member)
            .fetch_optional(&self.pool)
            .await?;
        Ok((now_ms, row.as_ref().map(member_from_row).transpose()?))
    }

    /// Remove a member record, only if it still names `process_id` at
    /// connection `epoch` (a newer stream of the member keeps its record).
    pub async fn remove_member(&self, member: &str, process_id: &str, epoch: i64) -> Result<bool> {
        let done = sqlx::query("DELETE FROM members WHERE member = $1 AND process_id = $2 AND epoch = $3")
            .bind(member)
            .bind(process_id)
            .bind(epoch)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// A member process that announced it was leaving ended its stream: its record stays,
    /// expired now and marked leaving, so whoever reads the pool next knows it left on purpose
    /// (a removed record would look like a member that stopped answering). Only if the
    /// record still names `process_id` at connection `epoch`.
    pub async fn member_left(&self, member: &str, process_id: &str, epoch: i64) -> Result<bool> {
        let done = sqlx::query(&format!(
            "UPDATE members SET leaving = TRUE, expires_at_ms = ({clock}), updated_at_ms = ({clock}) \
             WHERE member = $1 AND process_id = $2 AND epoch = $3",
            clock = self.backend.clock_expr()
        ))
        .bind(member)
        .bind(process_id)
        .bind(epoch)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// All member records, live or expired, and the database time of the read.
    pub async fn list_members(&self) -> Result<(i64, Vec<MemberRecord>)> {
        let now_ms = self.now_ms().await?;
        let rows = sqlx::query(&format!("SELECT {MEMBER_COLUMNS} FROM members ORDER BY member"))
            .fetch_all(&self.pool)
            .await?;
        let members = rows.iter().map(member_from_row).collect::<Result<_>>()?;
        Ok((now_ms, members))
    }

    // ---- desired instances (any replica) ----------------------------------

    /// Register an instance and assign its generation: the same workload (uid) keeps its
    /// generation; another workload on the same route gets the next one and starts fresh —
    /// its own material (receipt key), no workload checkpoint — while the workload it
    /// replaced is remembered and can never register the route again. A withdrawn workload
    /// stays withdrawn.
    pub async fn register_instance(&self, r: &Registration) -> Result<Registered> {
        self.register_instance_within(r, None).await
    }

    /// [`Store::register_instance`], refused ([`Registered::OverQuota`], nothing stored) when
    /// a new workload would give its namespace more than `limit` registered instances. The
    /// same workload registering again is never refused.
    pub async fn register_instance_within(&self, r: &Registration, limit: Option<u32>) -> Result<Registered> {
        let r = r.clone();
        self.detached(move |store| async move { store.register_instance_now(&r, limit).await })
            .await
    }

    async fn register_instance_now(&self, r: &Registration, limit: Option<u32>) -> Result<Registered> {
        /// Whether a newer workload already replaced this one under its route.
        async fn replaced(tx: &mut sqlx::Transaction<'static, sqlx::Any>, r: &Registration) -> Result<bool> {
            let count: i64 =
                sqlx::query_scalar("SELECT count(*) FROM replaced_instances WHERE route = $1 AND uid = $2")
                    .bind(&r.route)
                    .bind(&r.uid)
                    .fetch_one(&mut **tx)
                    .await?;
            Ok(count > 0)
        }
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        if replaced(&mut tx, r).await? {
            return Ok(Registered::Replaced);
        }
        if let Some(limit) = limit {
            // One registration per namespace at a time counts (SQLite: the write lock).
            if let Some(lock) = self.backend.namespace_lock_sql() {
                sqlx::query(lock).bind(&r.namespace).execute(&mut *tx).await?;
            }
            let same: i64 =
                sqlx::query_scalar("SELECT count(*) FROM instances WHERE route = $1 AND uid = $2 AND NOT withdrawn")
                    .bind(&r.route)
                    .bind(&r.uid)
                    .fetch_one(&mut *tx)
                    .await?;
            if same == 0 {
                let registered: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM instances WHERE namespace = $1 AND NOT withdrawn AND route <> $2",
                )
                .bind(&r.namespace)
                .bind(&r.route)
                .fetch_one(&mut *tx)
                .await?;
                if registered >= i64::from(limit) {
                    return Ok(Registered::OverQuota {
                        registered,
                        limit: i64::from(limit),
                    });
                }
            }
        }
        let clock = self.backend.clock_expr();
        let inserted = sqlx::query(&format!(
            "INSERT INTO instances (route, namespace, name, uid, generation, material, registered_at_ms, withdrawn) \
             VALUES ($1, $2, $3, $4, 1, $5, ({clock}), FALSE) ON CONFLICT (route) DO NOTHING"
        ))
        .bind(&r.route)
        .bind(&r.namespace)
        .bind(&r.name)
        .bind(&r.uid)
        .bind(&r.material.0)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() > 0 {
            tx.commit().await?;
            return Ok(Registered::Desired { generation: 1 });
        }
        let row = sqlx::query(&format!(
            "SELECT uid, generation, CASE WHEN withdrawn THEN 1 ELSE 0 END AS withdrawn FROM instances \
             WHERE route = $1{}",
            self.backend.row_lock()
        ))
        .bind(&r.route)
        .fetch_one(&mut *tx)
        .await?;
        let (uid, generation): (String, i64) = (row.try_get("uid")?, row.try_get("generation")?);
        if uid == r.uid {
            if row.try_get::<i64, _>("withdrawn")? != 0 {
                return Ok(Registered::Withdrawn { generation });
            }
            // The same workload again (a sidecar restart): new material, same generation.
            sqlx::query(&format!(
                "UPDATE instances SET namespace = $2, name = $3, material = $4, registered_at_ms = ({clock}) \
                 WHERE route = $1"
            ))
            .bind(&r.route)
            .bind(&r.namespace)
            .bind(&r.name)
            .bind(&r.material.0)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Registered::Desired { generation });
        }
        // Another workload under the route. Checked again under the row lock: a registration
        // that replaced this very workload may have committed while this one waited for the
        // lock (the check above ran before it), and a replaced workload never comes back.
        if replaced(&mut tx, r).await? {
            return Ok(Registered::Replaced);
        }
        // The next generation, from scratch.
        sqlx::query(&format!(
            "INSERT INTO replaced_instances (route, uid, replaced_at_ms) VALUES ($1, $2, ({clock})) \
             ON CONFLICT DO NOTHING"
        ))
        .bind(&r.route)
        .bind(&uid)
        .execute(&mut *tx)
        .await?;
        sqlx::query(&format!(
            "UPDATE instances SET namespace = $2, name = $3, uid = $4, generation = generation + 1, material = $5, \
               registered_at_ms = ({clock}), withdrawn = FALSE, withdrawn_reason = NULL, withdrawn_owner = NULL, \
               withdrawn_term = NULL, checkpoint_pid = NULL, checkpoint_start_ticks = NULL, \
               checkpoint_exe_digest = NULL \
             WHERE route = $1"
        ))
        .bind(&r.route)
        .bind(&r.namespace)
        .bind(&r.name)
        .bind(&r.uid)
        .bind(&r.material.0)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Registered::Desired {
            generation: generation + 1,
        })
    }

    /// Withdraw the instance of `route` if it is still the workload `uid`.
    /// Returns whether a desired instance was withdrawn.
    pub async fn withdraw_instance(&self, route: &str, uid: &str) -> Result<bool> {
        let done = sqlx::query("UPDATE instances SET withdrawn = TRUE WHERE route = $1 AND uid = $2 AND NOT withdrawn")
            .bind(route)
            .bind(uid)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// The sidecar of the workload `uid` stopped it at the recovery deadline: withdraw the
    /// instance of `route` (if it is still that workload and still desired) and record why,
    /// with the assignment it last had — its owner and term — or, without one, `fence_term`
    /// (the last term the sidecar activated, when it reports one). Returns whether a desired
    /// instance was withdrawn: a repeated report changes nothing.
    pub async fn report_recovery_failed(&self, route: &str, uid: &str, fence_term: Option<i64>) -> Result<bool> {
        let current = "FROM assignments a WHERE a.route = instances.route AND a.generation >= instances.generation";
        let done = sqlx::query(&format!(
            "UPDATE instances SET withdrawn = TRUE, withdrawn_reason = $3, \
               withdrawn_owner = (SELECT a.member {current}), \
               withdrawn_term = COALESCE((SELECT a.term {current}), $4) \
             WHERE route = $1 AND uid = $2 AND NOT withdrawn"
        ))
        .bind(route)
        .bind(uid)
        .bind(WithdrawnReason::RECOVERY_FAILED)
        .bind(fence_term)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Record an owner's report unless a report of a higher term is already there.
    pub async fn record_report(&self, r: &Report) -> Result<()> {
        self.record_reports(std::slice::from_ref(r)).await
    }

    /// Record owners' reports in one transaction (a batch from the report writer), each
    /// unless a report of a higher term of its route is already there.
    pub async fn record_reports(&self, reports: &[Report]) -> Result<()> {
        if reports.is_empty() {
            return Ok(());
        }
        let reports = reports.to_vec();
        self.detached(move |store| async move { store.record_reports_now(&reports).await })
            .await
    }

    async fn record_reports_now(&self, reports: &[Report]) -> Result<()> {
        let sql = format!(
            "INSERT INTO instance_reports (route, term, member, process_id, phase, message, workload_pid, reported_by, progress, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, ({})) \
             ON CONFLICT (route) DO UPDATE SET term = excluded.term, member = excluded.member, \
               process_id = excluded.process_id, phase = excluded.phase, message = excluded.message, \
               workload_pid = excluded.workload_pid, reported_by = excluded.reported_by, progress = excluded.progress, \
               updated_at_ms = excluded.updated_at_ms \
             WHERE instance_reports.term <= excluded.term",
            self.backend.clock_expr()
        );
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        for r in reports {
            sqlx::query(&sql)
                .bind(&r.route)
                .bind(r.term)
                .bind(&r.member)
                .bind(&r.process_id)
                .bind(&r.phase)
                .bind(&r.message)
                .bind(r.workload_pid)
                .bind(&r.reported_by)
                .bind(r.progress)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn list_reports(&self) -> Result<Vec<Report>> {
        let rows = sqlx::query(
            "SELECT route, term, member, process_id, phase, message, workload_pid, reported_by, progress, updated_at_ms \
             FROM instance_reports ORDER BY route",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Report {
                    route: r.try_get("route")?,
                    term: r.try_get("term")?,
                    member: r.try_get("member")?,
                    process_id: r.try_get("process_id")?,
                    phase: r.try_get("phase")?,
                    message: r.try_get("message")?,
                    workload_pid: r.try_get("workload_pid")?,
                    progress: r.try_get("progress")?,
                    reported_by: r.try_get("reported_by")?,
                    updated_at_ms: r.try_get("updated_at_ms")?,
                })
            })
            .collect()
    }

    /// One registered instance (withdrawn or not).
    pub async fn instance(&self, route: &str) -> Result<Option<InstanceRecord>> {
        Ok(self.list_instances_where(Some(route)).await?.pop())
    }

    pub async fn list_instances(&self) -> Result<Vec<InstanceRecord>> {
        self.list_instances_where(None).await
    }

    async fn list_instances_where(&self, route: Option<&str>) -> Result<Vec<InstanceRecord>> {
        let filter = if route.is_some() { "WHERE route = $1" } else { "" };
        let sql = format!(
            "SELECT route, namespace, name, uid, generation, material, registered_at_ms, last_term, \
             CASE WHEN withdrawn THEN 1 ELSE 0 END AS withdrawn, withdrawn_reason, withdrawn_owner, withdrawn_term \
             FROM instances {filter} ORDER BY route"
        );
        let mut query = sqlx::query(&sql);
        if let Some(route) = route {
            query = query.bind(route);
        }
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                Ok(InstanceRecord {
                    route: r.try_get("route")?,
                    namespace: r.try_get("namespace")?,
                    name: r.try_get("name")?,
                    uid: r.try_get("uid")?,
                    generation: r.try_get("generation")?,
                    material: SecretBytes(r.try_get("material")?),
                    registered_at_ms: r.try_get("registered_at_ms")?,
                    withdrawn: r.try_get::<i64, _>("withdrawn")? != 0,
                    last_term: r.try_get("last_term")?,
                    withdrawn_reason: withdrawn_reason(r)?,
                })
            })
            .collect()
    }

    /// Record the one grant of a reserved term: only for the route's current
    /// reserved term and its candidate process, and only once per term (a
    /// second call fails even if the first caller lost the response).
    pub async fn issue_grant(&self, grant: &GrantRecord) -> Result<()> {
        let grant = grant.clone();
        self.detached(move |store| async move { store.issue_grant_now(&grant).await })
            .await
    }

    async fn issue_grant_now(&self, grant: &GrantRecord) -> Result<()> {
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let current = sqlx::query(&format!(
            "SELECT term, process_id, phase FROM assignments WHERE route = $1{}",
            self.backend.row_lock()
        ))
        .bind(&grant.route)
        .fetch_optional(&mut *tx)
        .await?;
        let refuse = |detail: String| Error::Conflict {
            subject: format!("grant for {}", grant.route),
            detail,
        };
        let Some(row) = current else {
            return Err(refuse("the route has no assignment".into()));
        };
        let (term, process_id, phase): (i64, String, String) =
            (row.try_get("term")?, row.try_get("process_id")?, row.try_get("phase")?);
        if term != grant.term || phase != AssignmentPhase::Reserved.as_str() {
            return Err(refuse(format!(
                "term {} is not the reserved term (current: term {term}, {phase})",
                grant.term
            )));
        }
        if process_id != grant.process_id {
            return Err(refuse("the term is reserved for another member process".into()));
        }
        let inserted = sqlx::query(&format!(
            "INSERT INTO grants (route, term, jti, member, process_id, digest, issued_at_ms, expires_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, ({}), $7) ON CONFLICT (route, term) DO NOTHING",
            self.backend.clock_expr()
        ))
        .bind(&grant.route)
        .bind(grant.term)
        .bind(&grant.jti)
        .bind(&grant.member)
        .bind(&grant.process_id)
        .bind(&grant.digest)
        .bind(grant.expires_at_ms)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            return Err(refuse(format!(
                "the grant of term {} was already issued (single use)",
                grant.term
            )));
        }
        tx.commit().await?;
        Ok(())
    }

    /// Activate a reserved ownership term by compare-and-set, when a receipt
    /// proves the sidecar fenced for it: the term must still be the route's
    /// reserved term for `process_id`, the receipt must be bound to the grant
    /// minted for it (`jti`, `digest`), and `workload` must equal the
    /// instance's checkpoint (adopted when none is recorded). Returns the
    /// database time of the activation.
    pub async fn activate(
        &self,
        route: &str,
        term: i64,
        process_id: &str,
        jti: &str,
        digest: &[u8],
        workload: &Checkpoint,
    ) -> Result<i64> {
        let (route, process_id, jti) = (route.to_owned(), process_id.to_owned(), jti.to_owned());
        let (digest, workload) = (digest.to_vec(), workload.clone());
        self.detached(move |store| async move {
            store
                .activate_now(&route, term, &process_id, &jti, &digest, &workload)
                .await
        })
        .await
    }

    async fn activate_now(
        &self,
        route: &str,
        term: i64,
        process_id: &str,
        jti: &str,
        digest: &[u8],
        workload: &Checkpoint,
    ) -> Result<i64> {
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let lock = self.backend.row_lock();
        let refuse = |detail: &str| Error::Conflict {
            subject: format!("activation of {route} at term {term}"),
            detail: detail.to_owned(),
        };
        let assignment = sqlx::query(&format!(
            "SELECT term, process_id, phase, generation FROM assignments WHERE route = $1{lock}"
        ))
        .bind(route)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| refuse("term no longer current"))?;
        let (current, owner, phase, generation): (i64, String, String, i64) = (
            assignment.try_get("term")?,
            assignment.try_get("process_id")?,
            assignment.try_get("phase")?,
            assignment.try_get("generation")?,
        );
        if current != term || owner != process_id {
            return Err(refuse("term no longer current"));
        }
        if phase == AssignmentPhase::Active.as_str() {
            return Err(refuse("already activated"));
        }
        let grant = sqlx::query("SELECT jti, digest FROM grants WHERE route = $1 AND term = $2")
            .bind(route)
            .bind(term)
            .fetch_optional(&mut *tx)
            .await?;
        let bound = match &grant {
            Some(g) => g.try_get::<String, _>("jti")? == jti && g.try_get::<Vec<u8>, _>("digest")? == digest,
            None => false,
        };
        if !bound {
            return Err(refuse(
                "the receipt is not bound to the grant minted for this reservation",
            ));
        }
        let instance = sqlx::query(&format!(
            "SELECT generation, checkpoint_pid, checkpoint_start_ticks, checkpoint_exe_digest FROM instances \
             WHERE route = $1{lock}"
        ))
        .bind(route)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| refuse("the instance is not registered"))?;
        if generation < instance.try_get::<i64, _>("generation")? {
            // Reserved for a workload that another one (a new Pod UID) replaced since.
            return Err(refuse("the term was reserved for a workload the route no longer has"));
        }
        let recorded = Checkpoint {
            pid: instance.try_get::<Option<i64>, _>("checkpoint_pid")?.unwrap_or(0),
            start_ticks: instance
                .try_get::<Option<i64>, _>("checkpoint_start_ticks")?
                .unwrap_or(0),
            exe_digest: instance
                .try_get::<Option<Vec<u8>>, _>("checkpoint_exe_digest")?
                .unwrap_or_default(),
        };
        if !recorded.is_empty() && &recorded != workload {
            return Err(refuse("workload identity differs from checkpoint"));
        }
        let now_ms: i64 = sqlx::query_scalar(&format!("SELECT {}", self.backend.clock_expr()))
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query("UPDATE assignments SET phase = 'active', updated_at_ms = $2 WHERE route = $1")
            .bind(route)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        if recorded.is_empty() && !workload.is_empty() {
            sqlx::query(
                "UPDATE instances SET checkpoint_pid = $2, checkpoint_start_ticks = $3, checkpoint_exe_digest = $4 \
                 WHERE route = $1",
            )
            .bind(route)
            .bind(workload.pid)
            .bind(workload.start_ticks)
            .bind(&workload.exe_digest)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(now_ms)
    }

    // ---- coordinator records (written only through `write_fenced`) --------

    pub async fn list_assignments(&self) -> Result<Vec<Assignment>> {
        let rows = sqlx::query(
            "SELECT route, member, process_id, term, phase, generation, placed_term, coordinator_term, updated_at_ms \
             FROM assignments ORDER BY route",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Assignment {
                    route: r.try_get("route")?,
                    member: r.try_get("member")?,
                    process_id: r.try_get("process_id")?,
                    term: r.try_get("term")?,
                    phase: parse(r, "phase", "assignments")?,
                    generation: r.try_get("generation")?,
                    placed_term: r.try_get("placed_term")?,
                    coordinator_term: r.try_get("coordinator_term")?,
                    updated_at_ms: r.try_get("updated_at_ms")?,
                })
            })
            .collect()
    }

    pub async fn list_operations(&self) -> Result<Vec<Operation>> {
        let rows = sqlx::query(&format!(
            "SELECT {OPERATION_COLUMNS} FROM operations ORDER BY created_at_ms, id"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(operation_from_row).collect()
    }

    /// One operation by id.
    pub async fn operation(&self, id: &str) -> Result<Option<Operation>> {
        let row = sqlx::query(&format!("SELECT {OPERATION_COLUMNS} FROM operations WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(operation_from_row).transpose()
    }

    /// Record an operator's request (any replica; the coordinator admits it with a fenced
    /// write). An equivalent operation — an open one of the same kind and target, or a
    /// drain of the member that succeeded and was not cancelled — is returned instead:
    /// `(operation, created)`. The new operation is `Pending`; `op.deadline_at_ms` is taken
    /// as its time budget from now (database clock), which the store turns into the deadline.
    pub async fn request_operation(&self, op: &Operation) -> Result<(Operation, bool)> {
        let equivalent = || async {
            let row = sqlx::query(&format!(
                "SELECT {OPERATION_COLUMNS} FROM operations WHERE kind = $1 AND target = $2 \
                   AND (phase IN ('pending', 'running') \
                        OR (kind = 'drain' AND phase = 'succeeded' AND cancel_requested_at_ms IS NULL)) \
                 ORDER BY created_at_ms DESC LIMIT 1"
            ))
            .bind(op.kind.as_str())
            .bind(&op.target)
            .fetch_optional(&self.pool)
            .await?;
            row.as_ref().map(operation_from_row).transpose()
        };
        if let Some(existing) = equivalent().await? {
            return Ok((existing, false));
        }
        let inserted = sqlx::query(&format!(
            "INSERT INTO operations (id, kind, target, phase, message, attempts, moves, deadline_at_ms, max_parallel, \
               requested_by, coordinator_term, created_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $5, 0, 0, ({clock}) + $6, $7, $8, 0, ({clock}), ({clock})) \
             ON CONFLICT DO NOTHING",
            clock = self.backend.clock_expr()
        ))
        .bind(&op.id)
        .bind(op.kind.as_str())
        .bind(&op.target)
        .bind(OperationPhase::Pending.as_str())
        .bind(&op.message)
        .bind(op.deadline_at_ms)
        .bind(op.max_parallel)
        .bind(&op.requested_by)
        .execute(&self.pool)
        .await?;
        if inserted.rows_affected() == 0 {
            // Another replica recorded an equivalent one first.
            let existing = equivalent().await?;
            return existing
                .map(|e| (e, false))
                .ok_or_else(|| Error::Invalid("an operation request conflicted with nothing".into()));
        }
        let created = self
            .operation(&op.id)
            .await?
            .ok_or_else(|| Error::Invalid("a recorded operation cannot be read back".into()))?;
        Ok((created, true))
    }

    /// Record an operator's cancellation of an open operation (or of a drain that
    /// succeeded: the member returns to service); the coordinator applies it. Returns the
    /// operation as stored, `None` for an unknown id.
    pub async fn request_cancel(&self, id: &str) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "UPDATE operations SET cancel_requested_at_ms = COALESCE(cancel_requested_at_ms, ({clock})) \
             WHERE id = $1 AND (phase IN ('pending', 'running') OR (kind = 'drain' AND phase = 'succeeded'))",
            clock = self.backend.clock_expr()
        ))
        .bind(id)
        .execute(&self.pool)
        .await?;
        self.operation(id).await
    }
}

const OPERATION_COLUMNS: &str = "id, kind, target, phase, message, attempts, moves, deadline_at_ms, max_parallel, \
     requested_by, created_at_ms, updated_at_ms, cancel_requested_at_ms";

fn operation_from_row(r: &sqlx::any::AnyRow) -> Result<Operation> {
    let cancel: Option<i64> = r.try_get("cancel_requested_at_ms")?;
    Ok(Operation {
        id: r.try_get("id")?,
        kind: parse(r, "kind", "operations")?,
        target: r.try_get("target")?,
        phase: parse(r, "phase", "operations")?,
        message: r.try_get("message")?,
        attempts: r.try_get("attempts")?,
        moves: r.try_get("moves")?,
        deadline_at_ms: r.try_get("deadline_at_ms")?,
        max_parallel: r.try_get("max_parallel")?,
        requested_by: r.try_get("requested_by")?,
        created_at_ms: r.try_get("created_at_ms")?,
        updated_at_ms: r.try_get("updated_at_ms")?,
        cancel_requested: cancel.is_some(),
    })
}

impl Store {
    pub async fn list_signing_keys(&self) -> Result<Vec<SigningKey>> {
        let rows = sqlx::query(
            "SELECT kid, algorithm, public_pem, private_pem, created_at_ms, retired_at_ms FROM signing_keys \
             ORDER BY created_at_ms, kid",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(SigningKey {
                    kid: r.try_get("kid")?,
                    algorithm: r.try_get("algorithm")?,
                    public_pem: r.try_get("public_pem")?,
                    private_pem: SecretBytes(r.try_get("private_pem")?),
                    created_at_ms: r.try_get("created_at_ms")?,
                    retired_at_ms: r.try_get("retired_at_ms")?,
                })
            })
            .collect()
    }

    /// Close the pool (waits for checked-out connections to return).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

const MEMBER_COLUMNS: &str = "member, process_id, epoch, runtime_address, capacity, served_by, \
    CASE WHEN leaving THEN 1 ELSE 0 END AS leaving, expires_at_ms, updated_at_ms";

/// Bind a member update as `$1..$8` (member, process, epoch, address, capacity, served by,
/// leaving, TTL in ms).
fn bind_member<'q>(
    query: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>,
    m: &'q MemberUpdate,
    ttl: Duration,
) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>> {
    query
        .bind(&m.member)
        .bind(&m.process_id)
        .bind(m.epoch)
        .bind(&m.runtime_address)
        .bind(m.capacity)
        .bind(&m.served_by)
        .bind(m.leaving)
        .bind(millis(ttl))
}

fn member_from_row(r: &AnyRow) -> Result<MemberRecord> {
    Ok(MemberRecord {
        member: r.try_get("member")?,
        process_id: r.try_get("process_id")?,
        epoch: r.try_get("epoch")?,
        runtime_address: r.try_get("runtime_address")?,
        capacity: r.try_get("capacity")?,
        served_by: r.try_get("served_by")?,
        leaving: r.try_get::<i64, _>("leaving")? != 0,
        expires_at_ms: r.try_get("expires_at_ms")?,
        updated_at_ms: r.try_get("updated_at_ms")?,
    })
}

/// `instances.withdrawn_reason` with the columns that go with it.
fn withdrawn_reason(r: &AnyRow) -> Result<Option<WithdrawnReason>> {
    match r.try_get::<Option<String>, _>("withdrawn_reason")?.as_deref() {
        None => Ok(None),
        Some(WithdrawnReason::RECOVERY_FAILED) => Ok(Some(WithdrawnReason::RecoveryFailed {
            owner: r.try_get("withdrawn_owner")?,
            term: r.try_get("withdrawn_term")?,
        })),
        Some(other) => Err(Error::Corrupt {
            table: "instances",
            detail: format!("unknown withdrawn_reason {other:?}"),
        }),
    }
}

/// Read a text column into one of the store's enums.
fn parse<T: std::str::FromStr<Err = String>>(r: &AnyRow, column: &str, table: &'static str) -> Result<T> {
    let text: String = r.try_get(column)?;
    text.parse().map_err(|detail| Error::Corrupt { table, detail })
}

async fn set_lease(tx: &mut Transaction<'static, Any>, lease: &Lease) -> Result<()> {
    sqlx::query("UPDATE coordinator_lease SET holder = $1, term = $2, expires_at_ms = $3 WHERE id = 1")
        .bind(&lease.holder)
        .bind(lease.term)
        .bind(lease.expires_at_ms)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Apply one fenced write inside the fenced transaction.
async fn apply(
    tx: &mut Transaction<'static, Any>,
    write: &FencedWrite,
    coordinator_term: i64,
    now_ms: i64,
) -> Result<()> {
    match write {
        FencedWrite::Assign { expected_term, next: a } => {
            // Terms never repeat on a route, whatever became of its earlier assignments.
            let last: Option<i64> = sqlx::query_scalar("SELECT last_term FROM instances WHERE route = $1")
                .bind(&a.route)
                .fetch_optional(&mut **tx)
                .await?;
            if let Some(last) = last.filter(|last| a.term <= *last)
                && expected_term.is_none()
            {
                return Err(Error::Conflict {
                    subject: format!("assignment {}", a.route),
                    detail: format!("term {} was already used on the route (last term {last})", a.term),
                });
            }
            let sql = match expected_term {
                None => {
                    "INSERT INTO assignments (route, member, process_id, term, phase, coordinator_term, updated_at_ms, \
                       generation, placed_term) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (route) DO NOTHING"
                }
                Some(_) => {
                    "UPDATE assignments SET member = $2, process_id = $3, term = $4, phase = $5, coordinator_term = $6, \
                     updated_at_ms = $7, generation = $8, placed_term = $9 WHERE route = $1 AND term = $10"
                }
            };
            let mut query = sqlx::query(sql)
                .bind(&a.route)
                .bind(&a.member)
                .bind(&a.process_id)
                .bind(a.term)
                .bind(a.phase.as_str())
                .bind(coordinator_term)
                .bind(now_ms)
                .bind(a.generation)
                .bind(a.placed_term);
            if let Some(expected) = expected_term {
                query = query.bind(*expected);
            }
            let done = query.execute(&mut **tx).await?;
            if done.rows_affected() == 0 {
                return Err(conflict(tx, &a.route, *expected_term).await);
            }
            sqlx::query("UPDATE instances SET last_term = $2 WHERE route = $1 AND last_term < $2")
                .bind(&a.route)
                .bind(a.term)
                .execute(&mut **tx)
                .await?;
        }
        FencedWrite::Unassign { route, expected_term } => {
            let done = sqlx::query("DELETE FROM assignments WHERE route = $1 AND term = $2")
                .bind(route)
                .bind(expected_term)
                .execute(&mut **tx)
                .await?;
            if done.rows_affected() == 0 {
                return Err(conflict(tx, route, Some(*expected_term)).await);
            }
        }
        FencedWrite::PutOperation(op) => {
            sqlx::query(
                "INSERT INTO operations (id, kind, target, phase, message, attempts, moves, deadline_at_ms, max_parallel, \
                   requested_by, coordinator_term, created_at_ms, updated_at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $12) \
                 ON CONFLICT (id) DO UPDATE SET kind = excluded.kind, target = excluded.target, phase = excluded.phase, \
                   message = excluded.message, attempts = excluded.attempts, moves = excluded.moves, \
                   deadline_at_ms = excluded.deadline_at_ms, max_parallel = excluded.max_parallel, \
                   requested_by = excluded.requested_by, coordinator_term = excluded.coordinator_term, \
                   updated_at_ms = excluded.updated_at_ms",
            )
            .bind(&op.id)
            .bind(op.kind.as_str())
            .bind(&op.target)
            .bind(op.phase.as_str())
            .bind(&op.message)
            .bind(op.attempts)
            .bind(op.moves)
            .bind(op.deadline_at_ms)
            .bind(op.max_parallel)
            .bind(&op.requested_by)
            .bind(coordinator_term)
            .bind(now_ms)
            .execute(&mut **tx)
            .await?;
        }
        FencedWrite::PutSigningKey(key) => {
            sqlx::query(
                "INSERT INTO signing_keys (kid, algorithm, public_pem, private_pem, coordinator_term, created_at_ms, retired_at_ms) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (kid) DO UPDATE SET retired_at_ms = excluded.retired_at_ms, \
                   private_pem = excluded.private_pem, coordinator_term = excluded.coordinator_term",
            )
            .bind(&key.kid)
            .bind(&key.algorithm)
            .bind(&key.public_pem)
            .bind(&key.private_pem.0)
            .bind(coordinator_term)
            .bind(now_ms)
            .bind(key.retired_at_ms)
            .execute(&mut **tx)
            .await?;
        }
        FencedWrite::StartTerm => {
            sqlx::query("UPDATE coordinator_terms SET started_at_ms = $2 WHERE term = $1 AND started_at_ms IS NULL")
                .bind(coordinator_term)
                .bind(now_ms)
                .execute(&mut **tx)
                .await?;
        }
        FencedWrite::DeleteSigningKey { kid } => {
            sqlx::query("DELETE FROM signing_keys WHERE kid = $1")
                .bind(kid)
                .execute(&mut **tx)
                .await?;
        }
        FencedWrite::DeleteOperation { id } => {
            sqlx::query("DELETE FROM operations WHERE id = $1 AND phase IN ('succeeded', 'failed', 'cancelled')")
                .bind(id)
                .execute(&mut **tx)
                .await?;
        }
    }
    Ok(())
}

/// Describe a failed compare-and-set on an assignment.
async fn conflict(tx: &mut Transaction<'static, Any>, route: &str, expected: Option<i64>) -> Error {
    let found: Option<i64> = sqlx::query_scalar("SELECT term FROM assignments WHERE route = $1")
        .bind(route)
        .fetch_optional(&mut **tx)
        .await
        .unwrap_or_default();
    let show = |t: Option<i64>| t.map_or_else(|| "no assignment".to_owned(), |t| format!("term {t}"));
    Error::Conflict {
        subject: format!("assignment {route}"),
        detail: format!("expected {}, found {}", show(expected), show(found)),
    }
}

fn connect_error(url: &str, shown: &str, source: sqlx::Error) -> Error {
    match source {
        // The driver's reason may quote parts of the URL.
        sqlx::Error::Configuration(reason) => Error::Url {
            url: shown.to_owned(),
            reason: scrub(&reason.to_string(), url),
        },
        source => Error::Connect {
            url: shown.to_owned(),
            source,
        },
    }
}

/// Milliseconds of a duration as the i64 the tables use, saturating.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
