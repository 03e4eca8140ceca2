//! A row this gateway cannot read — a phase, kind or withdrawal reason it does not know,
//! as a newer version's migration could allow — is refused as a corrupt record naming the
//! table and the value, and a write that depends on it changes nothing.
//!
//! The tables' `CHECK` constraints keep such values out, so the test first lifts them in
//! its own throwaway database: PostgreSQL drops the constraints, SQLite's connection
//! ignores them (`PRAGMA ignore_check_constraints`).

use std::time::Duration;

use gateway::store::{Backend, Checkpoint, Error, FencedWrite, GrantRecord, OwnershipTerm, Registration, SecretBytes};
use sqlx::{AnyConnection, Connection, Executor};

use crate::suite::{acquire, active_report, assignment, operation};
use crate::support::TestDb;

/// Run `statements` on a connection of its own that writes past the tables' checks.
async fn write_unchecked(db: &TestDb, statements: &[&str]) {
    let mut conn = AnyConnection::connect(&db.url).await.unwrap();
    let lift: &[&str] = match db.store.backend() {
        Backend::Postgres => &[
            "ALTER TABLE assignments DROP CONSTRAINT assignments_phase_check",
            "ALTER TABLE operations DROP CONSTRAINT operations_kind_check",
        ],
        Backend::Sqlite => &["PRAGMA ignore_check_constraints = ON"],
    };
    for statement in lift.iter().chain(statements) {
        conn.execute(*statement).await.unwrap();
    }
    conn.close().await.unwrap();
}

fn registration(route: &str) -> Registration {
    Registration {
        route: route.into(),
        namespace: "ns".into(),
        name: "n".into(),
        uid: "u".into(),
        material: SecretBytes(vec![1]),
    }
}

fn assert_corrupt<T: std::fmt::Debug>(result: Result<T, Error>, want_table: &str, want_value: &str) {
    match result {
        Err(Error::Corrupt { table, detail }) if table == want_table && detail.contains(want_value) => {}
        other => panic!("expected a corrupt {want_table} record naming {want_value:?}, got {other:?}"),
    }
}

pub async fn an_unknown_value_is_a_corrupt_record_and_changes_nothing(db: &TestDb) {
    let store = &db.store;
    let lease = acquire(store, "gw-a/1", Duration::from_secs(30)).await;
    store.register_instance(&registration("r1")).await.unwrap();
    store
        .write_fenced(
            &lease,
            &[
                FencedWrite::Assign {
                    expected_term: None,
                    next: assignment("r1", "m1", 1),
                },
                FencedWrite::PutOperation(operation("op-1")),
            ],
        )
        .await
        .unwrap();
    store.record_report(&active_report("r1")).await.unwrap();

    write_unchecked(
        db,
        &[
            "UPDATE assignments SET phase = 'paused'",
            "UPDATE operations SET kind = 'migrate'",
            "UPDATE instances SET withdrawn = TRUE, withdrawn_reason = 'evicted'",
            "UPDATE instance_reports SET phase = 'INSTANCE_PHASE_PAUSED'",
        ],
    )
    .await;

    assert_corrupt(store.list_assignments().await, "assignments", "paused");
    assert_corrupt(store.list_operations().await, "operations", "migrate");
    assert_corrupt(store.operation("op-1").await, "operations", "migrate");
    assert_corrupt(store.list_instances().await, "instances", "evicted");
    assert_corrupt(store.instance("r1").await, "instances", "evicted");
    assert_corrupt(store.list_reports().await, "instance_reports", "INSTANCE_PHASE_PAUSED");

    // A grant and an activation read the assignment's phase: both refuse, nothing written.
    let grant = GrantRecord {
        route: "r1".into(),
        term: OwnershipTerm::new(1),
        jti: "j1".into(),
        member: "m1".into(),
        process_id: "m1-p1".into(),
        digest: vec![1; 32],
        expires_at_ms: i64::MAX,
    };
    assert_corrupt(store.issue_grant(&grant).await, "assignments", "paused");
    let workload = Checkpoint {
        pid: 42,
        start_ticks: 7,
        exe_digest: vec![9; 32],
    };
    assert_corrupt(
        store
            .activate(super::suite::activation(1, "m1-p1", "j1", &[1; 32], workload))
            .await,
        "assignments",
        "paused",
    );
    let mut conn = AnyConnection::connect(&db.url).await.unwrap();
    let grants: i64 = sqlx::query_scalar("SELECT count(*) FROM grants")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let phase: String = sqlx::query_scalar("SELECT phase FROM assignments WHERE route = 'r1'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    assert_eq!((grants, phase.as_str()), (0, "paused"));
}

/// A negative term (no `CHECK` keeps one out of these columns) is a corrupt record naming
/// the table and the value: never read as a term, never defaulted to 0.
pub async fn a_negative_term_is_a_corrupt_record(db: &TestDb) {
    let store = &db.store;
    let lease = acquire(store, "gw-a/1", Duration::from_secs(30)).await;
    store.register_instance(&registration("r1")).await.unwrap();
    store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: None,
                next: assignment("r1", "m1", 1),
            }],
        )
        .await
        .unwrap();
    store.record_report(&active_report("r1")).await.unwrap();
    assert_eq!(store.list_assignments().await.unwrap()[0].coordinator_term, lease.term);

    write_unchecked(
        db,
        &[
            "UPDATE assignments SET coordinator_term = -1",
            "UPDATE instance_reports SET term = -3",
        ],
    )
    .await;

    assert_corrupt(store.list_assignments().await, "assignments", "negative term -1");
    assert_corrupt(store.list_reports().await, "instance_reports", "negative term -3");
}
