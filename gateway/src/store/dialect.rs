//! The few places where PostgreSQL and SQLite need different SQL. Everything
//! else is shared text (both accept `$N` parameters, upserts and `RETURNING`).

use super::Options;

/// Which database a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// How a transaction locks the lease row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LockMode {
    /// Acquire, renew, release: excludes every other lease transaction.
    Exclusive,
    /// Fenced writes: excludes a takeover (PostgreSQL `FOR SHARE`; not
    /// `FOR KEY SHARE`, which an `UPDATE` of non-key columns would not wait for).
    Shared,
}

impl Backend {
    pub(super) fn from_url(url: &str) -> Option<Self> {
        match url.split_once(':')?.0 {
            "postgres" | "postgresql" => Some(Self::Postgres),
            "sqlite" => Some(Self::Sqlite),
            _ => None,
        }
    }

    /// Statements run on every new connection.
    pub(super) fn session_setup(self, options: &Options, application_name: &str) -> String {
        let timeout_ms = options.statement_timeout.as_millis();
        match self {
            Self::Postgres => format!(
                "SET statement_timeout = {timeout_ms}; SET idle_in_transaction_session_timeout = {}; \
                 SET application_name = '{application_name}'",
                options.idle_in_transaction_timeout.as_millis()
            ),
            Self::Sqlite => format!(
                "PRAGMA busy_timeout = {timeout_ms}; PRAGMA journal_mode = WAL; \
                 PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON"
            ),
        }
    }

    /// How a lease transaction begins. SQLite takes its write lock here
    /// (`IMMEDIATE`), which is its lease row lock.
    pub(super) fn begin_sql(self) -> &'static str {
        match self {
            Self::Postgres => "BEGIN",
            Self::Sqlite => "BEGIN IMMEDIATE",
        }
    }

    /// Statement taking a transaction-scoped lock on one namespace's registrations (bound:
    /// the namespace); SQLite's `BEGIN IMMEDIATE` already serializes every writer.
    pub(super) fn namespace_lock_sql(self) -> Option<&'static str> {
        match self {
            Self::Postgres => Some("SELECT pg_advisory_xact_lock(hashtext($1)) IS NULL"),
            Self::Sqlite => None,
        }
    }

    /// Suffix that locks the selected rows for the rest of the transaction
    /// (SQLite's `BEGIN IMMEDIATE` already holds the write lock).
    pub(super) fn row_lock(self) -> &'static str {
        match self {
            Self::Postgres => " FOR UPDATE",
            Self::Sqlite => "",
        }
    }

    pub(super) fn lock_lease_sql(self, mode: LockMode) -> String {
        let lock = match (self, mode) {
            (Self::Postgres, LockMode::Exclusive) => " FOR UPDATE",
            (Self::Postgres, LockMode::Shared) => " FOR SHARE",
            (Self::Sqlite, _) => "",
        };
        format!("SELECT holder, term, expires_at_ms FROM coordinator_lease WHERE id = 1{lock}")
    }

    /// The database clock in Unix milliseconds, as an SQL expression. On
    /// PostgreSQL `clock_timestamp()`, never `now()`: `now()` is the start of
    /// the transaction, which comes before any lock wait inside it.
    pub(super) fn clock_expr(self) -> &'static str {
        match self {
            Self::Postgres => "CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS BIGINT)",
            Self::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Postgres => "postgresql",
            Self::Sqlite => "sqlite",
        })
    }
}
