//! Opening the store: the URL (never shown with its password), the SQLite files made
//! private, the connection pool with its session settings and its transaction hygiene,
//! and the repository's migrations.

use sqlx::Connection;
use sqlx::any::AnyPoolOptions;

use super::{Backend, Error, Options, Result, Store, files, liveness, redact_url, scrub};

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
            listen_url: (backend == Backend::Postgres).then(|| std::sync::Arc::from(url)),
            sqlite_wal: files::sqlite_path(url).map(|path| {
                let mut wal = path.into_os_string();
                wal.push("-wal");
                std::sync::Arc::from(std::path::Path::new(&wal))
            }),
        };
        store.migrate(&shown).await?;
        Ok(store)
    }

    /// Apply the migrations again to a database whose schema is gone ([`Error::schema_gone`]):
    /// the database was replaced or emptied under a running gateway (a database Pod replaced
    /// without its volume, a restore into an empty database). The pool then starts empty and
    /// rebuilds itself from the members' streams and the sidecars' registrations.
    pub async fn migrate_again(&self) -> Result<()> {
        self.migrate("the database").await
    }

    async fn migrate(&self, shown: &str) -> Result<()> {
        let mut migrator = match self.backend {
            Backend::Postgres => sqlx::migrate!("./migrations/postgres"),
            Backend::Sqlite => sqlx::migrate!("./migrations/sqlite"),
        };
        // A newer build may have applied migrations this one does not know (a rollback, or
        // an older replica restarting during a rolling upgrade): it runs on, unless the
        // schema says it needs a newer build.
        let ours = migrator.iter().map(|m| m.version).max().unwrap_or(0);
        if let Some(schema) = self.schema_compatibility().await?
            && schema.newest > ours
        {
            if schema.oldest_reader > ours {
                return Err(Error::SchemaTooNew {
                    url: shown.to_owned(),
                    newest: schema.newest,
                    oldest_reader: schema.oldest_reader,
                    ours,
                });
            }
            tracing::warn!(
                schema = schema.newest,
                ours,
                "the database schema is newer than this build (a newer build applied it); it stays compatible, running on"
            );
            migrator.set_ignore_missing(true);
        }
        // PostgreSQL serialises concurrent migrators with an advisory lock;
        // SQLite has none, so a replica that loses the race to another
        // process (it finds a migration recorded or a table there) waits a
        // little and tries again: the winner applies each migration in
        // milliseconds, and an immediate retry could lose the race to its
        // next migration every time.
        let mut attempt = 0;
        loop {
            match migrator.run(&self.pool).await {
                Ok(()) => return Ok(()),
                Err(_) if self.backend == Backend::Sqlite && attempt < MIGRATION_RETRIES => {
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(25 * u64::from(attempt.min(8)))).await;
                }
                Err(source) => {
                    return Err(Error::Migrate {
                        url: shown.to_owned(),
                        source,
                    });
                }
            }
        }
    }
}

impl Error {
    /// The database answered that a table of the schema does not exist (PostgreSQL's
    /// `undefined_table`, SQLite's "no such table"): it was replaced or emptied under the store.
    pub fn schema_gone(&self) -> bool {
        let Error::Database(sqlx::Error::Database(db)) = self else {
            return false;
        };
        db.code().as_deref() == Some("42P01") || db.message().starts_with("no such table")
    }
}

/// What the database says of its schema before this build migrates it.
struct SchemaCompatibility {
    /// The newest migration applied.
    newest: i64,
    /// The oldest newest-migration a build may have to run against it.
    oldest_reader: i64,
}

impl Store {
    /// `None` on a database no migration ran on yet.
    async fn schema_compatibility(&self) -> Result<Option<SchemaCompatibility>> {
        // No table yet (a fresh database) reads as no migration.
        let newest: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations")
            .fetch_one(&self.pool)
            .await
            .ok()
            .flatten();
        let Some(newest) = newest else {
            return Ok(None);
        };
        // Before the marker's migration every build read every schema; after it, a marker
        // that cannot be read is an error, never "any build will do".
        let oldest_reader = if newest < MARKER_MIGRATION {
            0
        } else {
            sqlx::query_scalar("SELECT oldest_reader FROM schema_compatibility WHERE id = 1")
                .fetch_one(&self.pool)
                .await?
        };
        Ok(Some(SchemaCompatibility { newest, oldest_reader }))
    }
}

/// The migration that added `schema_compatibility`.
const MARKER_MIGRATION: i64 = 17;

/// How often a SQLite migrator that lost the race to another process tries again (about
/// 5 s in all).
const MIGRATION_RETRIES: u32 = 30;

pub(super) fn connect_error(url: &str, shown: &str, source: sqlx::Error) -> Error {
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
