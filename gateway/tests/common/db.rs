//! Test databases shared by the integration tests (each uses a part of it):
//! a fresh PostgreSQL database per test (on the server named
//! by `DATABASE_URL`) or a fresh SQLite file.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use gateway::store::sealing::{Kek, Keks};
use gateway::store::{Options, Store};
use sqlx::{AnyConnection, Connection, Executor};

/// The key-encryption keys of every test store in this test binary: the key of
/// [`test_kek_file`], which the gateways the tests start read (one pool shares its KEK).
pub fn test_keks() -> Arc<Keks> {
    static KEKS: OnceLock<Arc<Keks>> = OnceLock::new();
    KEKS.get_or_init(|| Arc::new(Keks::load(&test_kek_file(), None).expect("read the test KEK")))
        .clone()
}

/// A KEK file (0600) for gateways started from settings, in a directory that lives as long
/// as the test binary.
pub fn test_kek_file() -> PathBuf {
    static FILE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    FILE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("kek");
        Kek::load_or_create(&path).expect("write a KEK file");
        (dir, path)
    })
    .1
    .clone()
}

pub struct TestDb {
    pub url: String,
    pub store: Store,
    /// Keeps the SQLite file's directory alive for the test.
    _dir: Option<tempfile::TempDir>,
    /// PostgreSQL: the admin URL and the database to drop afterwards.
    cleanup: Option<(String, String)>,
}

impl TestDb {
    /// A new database on the PostgreSQL server of `DATABASE_URL`. Without it
    /// the test is skipped — unless `REQUIRE_POSTGRES=1` (the test command
    /// sets it), where a missing server is a failure.
    pub async fn postgres() -> Option<Self> {
        let Ok(admin_url) = std::env::var("DATABASE_URL") else {
            assert!(
                std::env::var("REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "REQUIRE_POSTGRES=1 but DATABASE_URL is unset"
            );
            eprintln!("skipped: DATABASE_URL is unset (run ./scripts/test to get a PostgreSQL)");
            return None;
        };
        sqlx::any::install_default_drivers();
        let name = format!("store_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = AnyConnection::connect(&admin_url)
            .await
            .expect("connect to DATABASE_URL");
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .expect("create test database");
        admin.close().await.expect("close admin connection");
        let mut url = url::Url::parse(&admin_url).expect("DATABASE_URL parses");
        url.set_path(&format!("/{name}"));
        let url = url.to_string();
        let store = Store::open(&url, &Options::default())
            .await
            .expect("open postgres store")
            .with_keks(test_keks());
        Some(Self {
            url,
            store,
            _dir: None,
            cleanup: Some((admin_url, name)),
        })
    }

    /// A new SQLite file in a temporary directory.
    pub async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("store.db").display());
        let store = Store::open(&url, &Options::default())
            .await
            .expect("open sqlite store")
            .with_keks(test_keks());
        Self {
            url,
            store,
            _dir: Some(dir),
            cleanup: None,
        }
    }

    /// A second, independent store on the same database (another replica).
    pub async fn replica(&self) -> Store {
        Store::open(&self.url, &Options::default())
            .await
            .expect("open second store")
            .with_keks(test_keks())
    }

    /// A raw connection to the same database, outside the store.
    pub async fn raw(&self) -> AnyConnection {
        AnyConnection::connect(&self.url).await.expect("raw connection")
    }

    pub async fn finish(self) {
        self.store.close().await;
        if let Some((admin_url, name)) = self.cleanup
            && let Ok(mut admin) = AnyConnection::connect(&admin_url).await
        {
            let _ = admin
                .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                .await;
            let _ = admin.close().await;
        }
    }
}

/// Poll `check` until it returns `Some`, failing after `polls` polls ([`testkit::wait::until`]).
/// A bound on a wait for a condition, not a timing assertion.
pub async fn wait_for<T, F, Fut>(what: &str, polls: u32, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    testkit::wait::until(what, testkit::wait::POLL * polls, check).await
}

/// Wait until the database clock has passed `at_ms`.
pub async fn wait_until_db_time(store: &Store, at_ms: i64) {
    wait_for("the database clock", 3000, || async {
        (store.now_ms().await.expect("database clock") > at_ms).then_some(())
    })
    .await;
}

/// Instantiate each test of module `$suite` once per backend: `postgres::name`
/// (skipped without `DATABASE_URL` unless `REQUIRE_POSTGRES=1`) and `sqlite::name`.
/// Only on PostgreSQL: for scenarios that freeze a whole replica. On SQLite one file lock
/// serializes every replica, so a replica frozen inside a write transaction stops the others
/// until it resumes — that limit of the embedded store, not the scenario, would decide.
#[allow(unused_macros)]
macro_rules! on_postgres {
    ($suite:ident; $($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(db) = crate::support::TestDb::postgres().await else { return };
                    crate::$suite::$name(&db).await;
                    db.finish().await;
                }
            )*
        }
    };
}

macro_rules! on_both_backends {
    ($suite:ident; $($name:ident),* $(,)?) => {
        on_postgres!($suite; $($name),*);
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = crate::support::TestDb::sqlite().await;
                    crate::$suite::$name(&db).await;
                    db.finish().await;
                }
            )*
        }
    };
}
