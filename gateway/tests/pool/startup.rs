//! A gateway started before its database is reachable, or on a schema too new for its build,
//! waits — alive (`/healthz` 200) but not ready (`/readyz` 503 with the reason) — instead of
//! exiting, and stops at once when shut down while it waits.

use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::support::TestDb;

/// A loopback port nothing listens on (bound once by the kernel, then freed).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Start a gateway on `database_url` with a health port; returns the health
/// address, the shutdown token and the task.
async fn start(
    database_url: &str,
    database_timeout_ms: u64,
) -> (
    String,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), gateway::Error>>,
) {
    let health = format!("127.0.0.1:{}", free_port());
    let kek = crate::support::test_kek_file();
    let settings = gateway::Settings::parse_from([
        "gateway",
        "--key-encryption-key-file",
        kek.to_str().unwrap(),
        "--database-url",
        database_url,
        "--listen",
        "127.0.0.1:0",
        "--health-listen",
        &health,
        "--status-interval-ms",
        "0",
        "--database-timeout-ms",
        &database_timeout_ms.to_string(),
    ]);
    let listener = gateway::bind(&settings).await.unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(gateway::run(settings, listener, shutdown.clone()));
    (health, shutdown, task)
}

/// `GET path` on the health port: the status code and body, `None` while it
/// does not answer yet.
async fn get(address: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(address).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: health\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Wait until `path` answers with `status`.
async fn wait_status(address: &str, path: &str, status: u16) -> String {
    crate::support::wait_for(&format!("{path} to answer {status}"), 3000, || async {
        get(address, path)
            .await
            .filter(|(code, _)| *code == status)
            .map(|(_, body)| body)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_before_its_database_waits_for_it_unready() {
    let Some(db) = TestDb::postgres().await else { return };
    // The gateway reaches the database through a port where nothing listens yet.
    let mut target = url::Url::parse(&db.url).unwrap();
    let upstream = format!("{}:{}", target.host_str().unwrap(), target.port().unwrap_or(5432));
    let port = free_port();
    target.set_port(Some(port)).unwrap();
    target.set_host(Some("127.0.0.1")).unwrap();
    let (health, shutdown, task) = start(target.as_str(), 1000).await;

    let waiting = wait_status(&health, "/readyz", 503).await;
    assert!(waiting.contains("waiting for the database"), "{waiting}");
    assert_eq!(get(&health, "/healthz").await.map(|(code, _)| code), Some(200));
    assert!(
        !task.is_finished(),
        "the gateway must not exit while the database is unreachable"
    );

    // The database becomes reachable: a proxy to it on that port.
    let proxy = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let forwarding = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = proxy.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    wait_status(&health, "/readyz", 200).await;
    assert_eq!(get(&health, "/healthz").await.map(|(code, _)| code), Some(200));

    shutdown.cancel();
    task.await.unwrap().unwrap();
    forwarding.abort();
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_waiting_for_the_database_returns_at_once() {
    // A port that accepts connections but never answers: each attempt to
    // open the store would hang for the whole (minute-long) connect timeout.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let (health, shutdown, task) = start(&format!("postgres://app:hunter2@127.0.0.1:{port}/app"), 60_000).await;
    wait_status(&health, "/readyz", 503).await;
    assert_eq!(get(&health, "/healthz").await.map(|(code, _)| code), Some(200));

    shutdown.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("shutdown while waiting for the database must not wait out the connect timeout");
    outcome.unwrap().unwrap();
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_older_than_the_database_schema_waits_unready_instead_of_exiting() {
    use sqlx::Connection as _;
    let Some(db) = TestDb::postgres().await else { return };
    // A newer build migrated the schema and declared this build unable to read it.
    let mut raw = db.raw().await;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (9001, 'a newer build', TRUE, '\\x00'::bytea, 1)",
    )
    .execute(&mut raw)
    .await
    .unwrap();
    sqlx::query("UPDATE schema_compatibility SET oldest_reader = 9001 WHERE id = 1")
        .execute(&mut raw)
        .await
        .unwrap();
    let (health, shutdown, task) = start(&db.url, 1000).await;

    let waiting = crate::support::wait_for("/readyz to name the schema", 3000, || async {
        get(&health, "/readyz")
            .await
            .filter(|(code, body)| *code == 503 && body.contains("schema"))
            .map(|(_, body)| body)
    })
    .await;
    assert!(
        waiting.contains("at migration 9001") && waiting.contains("at least 9001"),
        "{waiting}"
    );
    assert!(
        !waiting.contains(&db.url) && !waiting.contains("postgres://"),
        "{waiting}"
    );
    assert_eq!(get(&health, "/healthz").await.map(|(code, _)| code), Some(200));
    assert!(!task.is_finished(), "the gateway must not exit on a schema too new");

    shutdown.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("shutdown while waiting on the schema returns at once");
    outcome.unwrap().unwrap();
    raw.close().await.unwrap();
    db.finish().await;
}
