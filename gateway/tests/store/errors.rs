//! Opening a store fails with one clear error, never a panic, and never
//! shows a password.

use gateway::store::{Error, Options, Store};

async fn open(url: &str) -> Error {
    Store::open(url, &Options::default())
        .await
        .expect_err("opening must fail")
}

#[tokio::test]
async fn a_bad_url_names_what_is_wrong() {
    let err = open("mysql://root:hunter2@db/app").await;
    assert!(matches!(err, Error::Url { .. }), "{err:?}");
    let line = err.to_string();
    assert!(
        line.contains("expected a postgres://") && !line.contains("hunter2"),
        "{line}"
    );
}

#[tokio::test]
async fn an_unreachable_database_is_one_line_without_the_password() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let line = open(&format!("postgres://app:hunter2@127.0.0.1:{port}/app"))
        .await
        .to_string();
    assert!(
        line.starts_with("cannot connect to database postgres://app:***@127.0.0.1"),
        "{line}"
    );
    assert!(!line.contains("hunter2") && !line.contains('\n'), "{line}");
}

#[tokio::test]
async fn a_failing_migration_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("taken.db");
    // A table of the same name with another shape makes the first migration fail.
    let url = format!("sqlite://{}?mode=rwc", path.display());
    {
        use sqlx::{Connection, Executor};
        sqlx::any::install_default_drivers();
        let mut conn = sqlx::AnyConnection::connect(&url).await.unwrap();
        conn.execute("CREATE TABLE coordinator_lease (x INTEGER)")
            .await
            .unwrap();
        conn.close().await.unwrap();
    }
    let err = open(&url).await;
    assert!(matches!(err, Error::Migrate { .. }), "{err:?}");
    assert!(err.to_string().contains("cannot apply database migrations"), "{err}");
}

#[tokio::test]
async fn a_url_without_a_scheme_is_refused_without_its_password() {
    for url in ["user:hunter2@db/app", "user:hunt%32er2@db:5432/app?sslmode=disable"] {
        let err = open(url).await;
        assert!(matches!(err, Error::Url { .. }), "{err:?}");
        let line = err.to_string();
        assert!(!line.contains("hunter2") && !line.contains("hunt%32er2"), "{line}");
        assert!(line.contains("user:***@db"), "{line}");
    }
}

/// Replicas that start together on one fresh SQLite file all open it: the ones that lose the
/// race to migrate it wait and try again (SQLite has no migration lock). Eight at once lost
/// the race repeatedly when a loser retried at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_starting_together_on_one_sqlite_file_all_migrate_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("store.db").display());
    let opens: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { Store::open(&url, &Options::default()).await })
        })
        .collect();
    for open in opens {
        let store = open.await.unwrap().unwrap_or_else(|err| panic!("{err}"));
        store.close().await;
    }
}
