//! A caller that gives up on a store call (a timeout, a dropped request) must
//! not leave a transaction open on a pooled connection. The campaign below is
//! polled by hand and dropped at the moment its `BEGIN` has run in the
//! database but before the transaction was handed back to the store: on
//! SQLite that left the connection inside `BEGIN IMMEDIATE` (the write lock
//! held for good: "database is locked" for every replica, "attempted to call
//! begin_with at non-zero transaction depth" for this one); on PostgreSQL
//! "idle in transaction" with the driver believing otherwise.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use gateway::store::{Acquire, Backend, Lease, Store, liveness};
use sqlx::{AnyConnection, Executor, Row};
use tokio::sync::Notify;

use crate::support::{TestDb, wait_for};

const LEASE: Duration = Duration::from_secs(5);

/// A future polled only when the test says so, with a waker that records
/// that it was woken.
struct Stepped<F: Future> {
    future: Pin<Box<F>>,
    flag: Arc<Flag>,
    waker: Waker,
}

#[derive(Default)]
struct Flag {
    woken: AtomicBool,
    notify: Notify,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }
}

impl<F: Future> Stepped<F> {
    fn new(future: F) -> Self {
        let flag = Arc::new(Flag::default());
        flag.woken.store(true, Ordering::SeqCst);
        Self {
            future: Box::pin(future),
            waker: Waker::from(flag.clone()),
            flag,
        }
    }

    /// Whether it was woken since the last call (and forget it).
    fn take_wake(&self) -> bool {
        self.flag.woken.swap(false, Ordering::SeqCst)
    }

    fn poll(&mut self) -> Option<F::Output> {
        match self.future.as_mut().poll(&mut Context::from_waker(&self.waker)) {
            Poll::Ready(output) => Some(output),
            Poll::Pending => None,
        }
    }

    /// Wait until woken, or for at most `tick` (a re-check interval).
    async fn woken_or(&self, tick: Duration) {
        if self.flag.woken.load(Ordering::SeqCst) {
            return;
        }
        tokio::select! {
            () = self.flag.notify.notified() => {}
            () = tokio::time::sleep(tick) => {}
        }
    }
}

/// Tells from outside whether the store's campaign has begun its transaction.
enum Probe {
    /// Another connection that tries to take SQLite's write lock without waiting.
    Sqlite(AnyConnection),
    /// A connection that reads the store's sessions from `pg_stat_activity`.
    Postgres(AnyConnection, String),
}

impl Probe {
    async fn new(db: &TestDb) -> Self {
        let mut conn = db.raw().await;
        match db.store.backend() {
            Backend::Sqlite => {
                conn.execute("PRAGMA busy_timeout = 0").await.unwrap();
                Self::Sqlite(conn)
            }
            Backend::Postgres => Self::Postgres(conn, liveness::application_name(db.store.liveness_key())),
        }
    }

    /// Whether a connection of the store is inside a transaction. On SQLite,
    /// when none is, the probe holds the write lock until [`Probe::let_go`],
    /// so that no store transaction can begin meanwhile.
    async fn store_in_transaction(&mut self) -> bool {
        match self {
            Self::Sqlite(conn) => match conn.execute("BEGIN IMMEDIATE").await {
                Ok(_) => false,
                Err(err) => {
                    assert!(err.to_string().contains("locked"), "unexpected probe error: {err}");
                    true
                }
            },
            Self::Postgres(conn, application_name) => {
                let row = sqlx::query(
                    "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = $1 \
                       AND (state = 'idle in transaction' OR (state = 'active' AND wait_event_type = 'Lock'))",
                )
                .bind(application_name.as_str())
                .fetch_one(&mut *conn)
                .await
                .unwrap();
                row.try_get::<i64, _>("n").unwrap() > 0
            }
        }
    }

    async fn let_go(&mut self) {
        if let Self::Sqlite(conn) = self {
            conn.execute("ROLLBACK").await.unwrap();
        }
    }
}

async fn campaign_once(store: &Store, holder: &str) -> Lease {
    match store.acquire_lease(holder, LEASE).await {
        Ok(Acquire::Acquired(lease)) => lease,
        other => panic!("{holder} must get the lease, got {other:?}"),
    }
}

pub async fn a_campaign_cancelled_inside_its_transaction_leaves_the_store_usable(db: &TestDb) {
    let mut probe = Probe::new(db).await;
    let mut blocker = db.raw().await;
    if db.store.backend() == Backend::Postgres {
        // The campaign's transaction will wait for the lease row lock.
        blocker.execute("BEGIN").await.unwrap();
        blocker
            .execute("SELECT term FROM coordinator_lease WHERE id = 1 FOR UPDATE")
            .await
            .unwrap();
    }

    // Poll the campaign whenever it is woken, but look first whether it has
    // begun its transaction: a wake for the answer to BEGIN comes only after
    // the database ran it, so the answer is then still unread. (On SQLite the
    // probe holds the write lock while the campaign is polled, so BEGIN cannot
    // also be answered and read within one poll.)
    let mut campaign = Stepped::new(db.store.acquire_lease("gw-a/1", LEASE));
    let mut begun = false;
    for _ in 0..1000 {
        let woken = campaign.take_wake();
        if probe.store_in_transaction().await {
            begun = true;
            if woken {
                campaign.flag.woken.store(true, Ordering::SeqCst);
            }
            break;
        }
        let finished = woken && campaign.poll().is_some();
        probe.let_go().await;
        if finished {
            break;
        }
        campaign.woken_or(Duration::from_millis(10)).await;
    }
    if begun && db.store.backend() == Backend::Sqlite {
        // Read the answer to BEGIN IMMEDIATE, then give up at once.
        wait_for("the campaign to be woken", 1000, || async {
            campaign.flag.woken.load(Ordering::SeqCst).then_some(())
        })
        .await;
        campaign.take_wake();
        let _ = campaign.poll();
    }
    drop(campaign);
    if db.store.backend() == Backend::Postgres {
        blocker.execute("COMMIT").await.unwrap();
    }

    // No connection of the store is left inside a transaction…
    let mut ended = false;
    for _ in 0..1000 {
        if !probe.store_in_transaction().await {
            probe.let_go().await;
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ended, "a connection of the store stayed inside a transaction");
    // …this replica campaigns, renews and releases…
    let lease = campaign_once(&db.store, "gw-a/1").await;
    db.store
        .renew_lease(&lease, LEASE)
        .await
        .expect("renewal after a cancelled campaign");
    assert!(db.store.release_lease(&lease).await.unwrap());
    // …and another replica on the same database takes the lease at the next term.
    let other = db.replica().await;
    let taken = campaign_once(&other, "gw-b/2").await;
    assert_eq!(taken.term, lease.term.next());
    assert!(other.release_lease(&taken).await.unwrap());
    other.close().await;

    if db.store.backend() == Backend::Sqlite {
        // A campaign given up while BEGIN IMMEDIATE waits for the write lock
        // (it may still finish on its own once the lock is free)…
        blocker.execute("BEGIN IMMEDIATE").await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(100), db.store.acquire_lease("gw-a/1", LEASE)).await;
        assert!(waited.is_err(), "the write lock is held elsewhere: {waited:?}");
        blocker.execute("COMMIT").await.unwrap();
        // …does not keep the replica from campaigning again.
        campaign_once(&db.store, "gw-a/1").await;
    }
}
