//! PostgreSQL only: a lease that expires while a call waits for the lease
//! row lock. These are the tests that fail if the database clock is sampled
//! before the lock is taken (for example `now()`, the transaction start, or a
//! clock read before `SELECT … FOR SHARE`): the waiting call would then judge
//! the lease by a time from before its expiry and accept it.

use std::time::Duration;

use gateway::store::{Acquire, Error, Fence, FencedWrite, Lease, Operation, OperationKind, OperationPhase};
use sqlx::{AnyConnection, Executor, Row};

use crate::support::{TestDb, wait_until_db_time};

const LEASE: Duration = Duration::from_secs(3);

fn operation() -> Operation {
    Operation {
        id: "written-while-waiting".into(),
        kind: OperationKind::Rebalance,
        target: String::new(),
        phase: OperationPhase::Pending,
        message: String::new(),
        attempts: 0,
        moves: 0,
        deadline_at_ms: None,
        max_parallel: 1,
        requested_by: "test".into(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

/// Hold the lease row lock from a raw connection (as a contender mid-takeover
/// would), start `call`, wait until PostgreSQL reports it blocked on that lock
/// while the lease is still live, let the lease expire, then free the lock.
async fn expire_while_waiting<T: Send + 'static>(
    db: &TestDb,
    lease: &Lease,
    waiting_query: &'static str,
    call: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let mut blocker = db.raw().await;
    blocker.execute("BEGIN").await.unwrap();
    blocker
        .execute("SELECT term FROM coordinator_lease WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();

    let waiting = tokio::spawn(call);
    let mut observer = db.raw().await;
    wait_blocked(&mut observer, waiting_query).await;
    let now = db.store.now_ms().await.unwrap();
    assert!(
        now < lease.expires_at_ms,
        "inconclusive: the call only blocked after the lease expired ({now} >= {})",
        lease.expires_at_ms
    );

    wait_until_db_time(&db.store, lease.expires_at_ms).await;
    blocker.execute("COMMIT").await.unwrap();
    waiting.await.expect("waiting call panicked")
}

/// Wait until PostgreSQL reports a backend of this database waiting for a
/// lock while running a statement containing `query_fragment`.
async fn wait_blocked(observer: &mut AnyConnection, query_fragment: &str) {
    let sql = format!(
        "SELECT count(*) AS n FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%{query_fragment}%'"
    );
    for _ in 0..1000 {
        let row = observer.fetch_one(sql.as_str()).await.unwrap();
        if row.try_get::<i64, _>("n").unwrap() > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no statement with {query_fragment:?} ever waited for the lease row lock");
}

async fn acquire(db: &TestDb) -> Lease {
    match db.store.acquire_lease("gw-a/1", LEASE).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        Acquire::HeldBy(row) => panic!("fresh database, lease held by {row:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_write_waiting_for_the_lock_is_rejected_once_the_lease_expired() {
    let Some(db) = TestDb::postgres().await else { return };
    let lease = acquire(&db).await;
    let (store, held) = (db.store.clone(), lease.clone());
    let result = expire_while_waiting(&db, &lease, "FOR SHARE", async move {
        store
            .write_fenced(&held, &[FencedWrite::PutOperation(operation())])
            .await
    })
    .await;
    match result {
        Err(Error::Fenced(Fence::Expired {
            now_ms, expires_at_ms, ..
        })) => assert!(now_ms >= expires_at_ms),
        other => panic!("a write that waited past the lease's expiry must be fenced, got {other:?}"),
    }
    assert!(
        db.store.list_operations().await.unwrap().is_empty(),
        "nothing was written"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_waiting_for_the_lock_is_rejected_once_the_lease_expired() {
    let Some(db) = TestDb::postgres().await else { return };
    let lease = acquire(&db).await;
    let (store, held) = (db.store.clone(), lease.clone());
    let result = expire_while_waiting(&db, &lease, "FOR UPDATE", async move {
        store.renew_lease(&held, LEASE).await
    })
    .await;
    assert!(
        matches!(result, Err(Error::Fenced(Fence::Expired { .. }))),
        "a renewal that waited past expiry must fail, got {result:?}"
    );
    let row = db.store.read_lease().await.unwrap().unwrap();
    assert!(
        !row.is_live() && row.expires_at_ms == lease.expires_at_ms,
        "the lease was not extended"
    );
    db.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_write_blocks_a_takeover_until_it_commits() {
    // FOR SHARE, not FOR KEY SHARE: a takeover's UPDATE of the lease row must
    // wait for an in-flight fenced write.
    let Some(db) = TestDb::postgres().await else { return };
    let lease = acquire(&db).await;
    let mut writer = db.raw().await;
    writer.execute("BEGIN").await.unwrap();
    writer
        .execute("SELECT term FROM coordinator_lease WHERE id = 1 FOR SHARE")
        .await
        .unwrap();
    let contender = db.replica().await;
    let takeover = tokio::spawn(async move { contender.acquire_lease("gw-b/1", Duration::from_secs(30)).await });
    let mut observer = db.raw().await;
    wait_blocked(&mut observer, "FOR UPDATE").await;
    wait_until_db_time(&db.store, lease.expires_at_ms).await;
    assert!(!takeover.is_finished(), "the takeover waited for the share lock");
    writer.execute("COMMIT").await.unwrap();
    match takeover.await.unwrap().unwrap() {
        Acquire::Acquired(next) => assert_eq!(next.term, lease.term.next()),
        Acquire::HeldBy(row) => panic!("expired lease must be taken, found {row:?}"),
    }
    db.finish().await;
}

/// A replica frozen inside its lease transaction (stopped, paused by its host, or cut off
/// after `BEGIN`) holds the lease row lock as long as its session lives. PostgreSQL must end
/// that session (`Options::idle_in_transaction_timeout`), so another replica takes the lease
/// instead of the whole pool losing its coordinator until TCP gives up on the frozen one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_frozen_inside_its_lease_transaction_does_not_hold_the_lease_row() {
    let Some(db) = TestDb::postgres().await else { return };
    // The frozen replica's campaign first waits for the lock behind a raw connection, so that
    // it is frozen exactly between two statements of its transaction.
    let mut blocker = db.raw().await;
    blocker.execute("BEGIN").await.unwrap();
    blocker
        .execute("SELECT term FROM coordinator_lease WHERE id = 1 FOR UPDATE")
        .await
        .unwrap();
    let (freeze, frozen_rx) = tokio::sync::oneshot::channel::<()>();
    let (frozen, is_frozen) = std::sync::mpsc::channel::<()>();
    let (resume, resumed) = std::sync::mpsc::channel::<()>();
    let url = db.url.clone();
    let replica = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let store = gateway::store::Store::open(&url, &gateway::store::Options::default())
                .await
                .unwrap();
            let campaign = tokio::spawn(async move { store.acquire_lease("gw-frozen/1", LEASE).await });
            let _ = frozen_rx.await;
            // Blocks the runtime's only thread: the campaign's task cannot run on.
            frozen.send(()).unwrap();
            let _ = resumed.recv();
            campaign.await
        })
    });
    let mut observer = db.raw().await;
    wait_blocked(&mut observer, "FOR UPDATE").await;
    freeze.send(()).unwrap();
    is_frozen.recv().unwrap();
    // The frozen campaign gets the lock now, and never sends its next statement.
    blocker.execute("COMMIT").await.unwrap();

    // Bounded below the statement timeout (10 s): without the idle bound, every attempt
    // would wait on the frozen session's lock until that timeout.
    let taken = tokio::time::timeout(Duration::from_secs(9), db.store.acquire_lease("gw-live/1", LEASE))
        .await
        .expect("the lease row was still locked by the frozen replica's session");
    assert!(matches!(taken, Ok(Acquire::Acquired(_))), "{taken:?}");

    resume.send(()).unwrap();
    let frozen_outcome = replica.join().unwrap().unwrap();
    // Its transaction was ended under it (the usual outcome) or, once resumed, it finds the
    // lease held by the live replica (seen once on a loaded machine: how its session came to
    // read after the takeover is not known). Never a second holder.
    assert!(
        matches!(&frozen_outcome, Err(_) | Ok(Acquire::HeldBy(_))),
        "the frozen replica must not take the lease once resumed: {frozen_outcome:?}"
    );
    db.finish().await;
}
