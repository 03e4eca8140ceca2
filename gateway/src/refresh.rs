//! Keeping this replica's pool view fresh: the read loop ([`refresh`]: every
//! [`REFRESH_INTERVAL`], or at once when woken), the other replicas' writes that wake it
//! ([`follow_writes`]: PostgreSQL notifications, or on SQLite a poll of the write counts),
//! and this replica's liveness record ([`beat`]).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::timing;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::operations;
use crate::pool::{FULL_READ_EVERY, REFRESH_INTERVAL, View};
use crate::store::Store;
use crate::store::builds::{Component, GATEWAY_BUILD_EVERY};

/// Re-read the pool every [`REFRESH_INTERVAL`], or at once when `wake` is
/// notified, and publish it, until `shutdown`. Members whose serving replica went silent
/// ([`View::orphaned`]) are expired on the way, and the pool read again at once.
pub async fn refresh(store: Store, publish: watch::Sender<Arc<View>>, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut reads = Reads::default();
    let mut previous: Option<Arc<View>> = None;
    let mut full_read_at = Instant::now();
    loop {
        let mut again = false;
        // Every table now and then, whatever the counts say.
        let full = full_read_at.elapsed() >= FULL_READ_EVERY;
        if full {
            full_read_at = Instant::now();
        }
        let since = previous.as_deref().filter(|_| !full);
        let read = patiently(View::reload(&store, since), || {
            reads.failed();
            warn!(after = ?READ_SLOW, "reading the pool is slow");
        });
        let read = tokio::select! {
            () = shutdown.cancelled() => return,
            read = read => read,
        };
        match read {
            Ok(Ok(mut view)) => {
                view.blackout = reads.succeeded(view.now_ms);
                for m in view.orphaned(timing::replica_silence_bound()) {
                    match store
                        .expire_member_of_silent_replica(m, timing::replica_silence_bound())
                        .await
                    {
                        Ok(true) => {
                            warn!(member = %m.member, process = %m.process_id, replica = %m.served_by,
                                  "the replica serving the member went silent and the member did not attach elsewhere; it counts as gone");
                            again = true;
                        }
                        Ok(false) => {}
                        Err(err) => {
                            warn!(error = %err, member = %m.member, "cannot expire the member of a silent replica")
                        }
                    }
                }
                view.number_after(previous.as_deref());
                let view = Arc::new(view);
                previous = Some(Arc::clone(&view));
                publish.send_replace(view);
            }
            Ok(Err(err)) => {
                reads.failed();
                warn!(error = %err, "cannot read the pool");
            }
            Err(_) => {
                reads.failed();
                warn!(after = ?READ_GIVE_UP, "reading the pool timed out");
            }
        }
        if again {
            continue;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = wake.notified() => {}
            () = tokio::time::sleep(REFRESH_INTERVAL) => {}
        }
    }
}

/// A read of the pool slower than this counts as a blackout (other replicas' silence meanwhile
/// is forgiven, [`View::blackout`]); it is still awaited.
pub const READ_SLOW: Duration = Duration::from_secs(2);
/// A read of the pool is given up after this (a store whose path is cut without a reset).
pub const READ_GIVE_UP: Duration = Duration::from_secs(30);

/// `read`'s output, awaited for up to [`READ_GIVE_UP`]; `slow` is called once it took
/// [`READ_SLOW`]. A slow read (a large pool, a contended store) is still awaited: thrown away
/// at a time-out, it would be started over and never published.
async fn patiently<T>(read: impl Future<Output = T>, slow: impl FnOnce()) -> Result<T, tokio::time::error::Elapsed> {
    tokio::pin!(read);
    match tokio::time::timeout(READ_SLOW, &mut read).await {
        Ok(done) => Ok(done),
        Err(_) => {
            slow();
            tokio::time::timeout(READ_GIVE_UP - READ_SLOW, read).await
        }
    }
}

/// SQLite has no notifications: while another replica's write is awaited
/// ([`awaits_writes`]), its write-ahead log is looked at this often instead, and the write
/// counts read when it changed.
pub const WRITES_POLL_EVERY: Duration = Duration::from_millis(25);

/// Wake the pool read whenever any replica commits a write to a table the view reads (a
/// planned move's activation on the replica serving the members, seen at once by a
/// coordinator elsewhere instead of at its next [`REFRESH_INTERVAL`] read). PostgreSQL:
/// notifications from the writing transactions, reconnecting with backoff. SQLite: the write
/// counts read whenever the write-ahead log changed, looked at every [`WRITES_POLL_EVERY`]
/// while this replica's latest view (`views`) awaits writes. Either wakes once when it starts
/// following
/// (a write may have landed before).
pub async fn follow_writes(
    store: Store,
    views: watch::Receiver<Arc<View>>,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let connected = tokio::select! {
            () = shutdown.cancelled() => return,
            listener = store.listen_pool_writes(timing::CONNECT_TIMEOUT * 5) => listener,
        };
        match connected {
            None => return poll_writes(store, views, wake, shutdown).await,
            Some(Ok(mut listener)) => {
                failures = 0;
                // A write may have landed while this replica was not listening.
                wake.notify_one();
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        received = listener.try_recv() => match received {
                            Ok(Some(_)) => wake.notify_one(),
                            Ok(None) => break, // the connection was lost
                            Err(err) => {
                                warn!(error = %err, "the pool-write notifications broke; listening again");
                                break;
                            }
                        },
                    }
                }
            }
            Some(Err(err)) => {
                failures = failures.saturating_add(1);
                if failures == 1 || failures.is_multiple_of(timing::RECONNECT_ATTEMPTS) {
                    warn!(error = %err, "cannot listen for pool writes; the pool is read every {REFRESH_INTERVAL:?} meanwhile");
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(timing::reconnect_backoff(failures)) => {}
        }
    }
}

/// How long a reserved term's activation is awaited at [`WRITES_POLL_EVERY`]: a sidecar
/// fences and the owner activates within a second or two; a term reserved longer than this
/// is stuck (its owner or sidecar is gone, and its recovery has a deadline) and is left to
/// the read loop.
pub const HANDOFF_AWAITED_MS: i64 = 10_000;

/// Whether the pool waits for writes another replica may make: an operation is open, or a
/// handoff (a term past the one its workload was placed at, see [`operations::in_flight`])
/// was reserved in the last [`HANDOFF_AWAITED_MS`] and has not settled. A pool at rest waits
/// for none, nor does a pool placing new workloads (a first placement waits for nothing
/// sequential); what starts an operation is seen by the read loop's next
/// [`REFRESH_INTERVAL`] read.
pub fn awaits_writes(view: &View) -> bool {
    view.operations.iter().any(|op| !op.phase.is_finished())
        || view.assignments.values().any(|a| {
            a.term > a.placed_term
                && view.now_ms.saturating_sub(a.updated_at_ms) < HANDOFF_AWAITED_MS
                && !operations::settled(view, a)
        })
}

/// SQLite: wake the pool read when the write counts move, while the view
/// [`awaits_writes`]. They are read only when the write-ahead log changed since the last
/// look (its size or modification time: a `stat`, where a count read costs a query). A
/// commit whose log write is seen just before it becomes readable is left to the read
/// loop's next [`REFRESH_INTERVAL`] read, as before.
async fn poll_writes(
    store: Store,
    mut views: watch::Receiver<Arc<View>>,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut every = tokio::time::interval(WRITES_POLL_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut log = None;
    let mut last = None;
    let mut seen = Arc::clone(&views.borrow_and_update());
    let mut awaiting = awaits_writes(&seen);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        if views.has_changed().unwrap_or(false) {
            let view = Arc::clone(&views.borrow_and_update());
            // A pool that awaited nothing awaits nothing while its tables stay the same read
            // (time only ends an await): no walk over every assignment each read at rest.
            let same = view.assignments.same(&seen.assignments)
                && view.reports.same(&seen.reports)
                && view.operations.same(&seen.operations);
            if awaiting || !same {
                awaiting = awaits_writes(&view);
            }
            seen = view;
        }
        if !awaiting {
            continue;
        }
        if let Some(wal) = store.sqlite_wal() {
            let now = tokio::fs::metadata(wal)
                .await
                .ok()
                .map(|m| (m.len(), m.modified().ok()));
            if now.is_some() && std::mem::replace(&mut log, now) == now {
                continue;
            }
        }
        // A failed or slow read is left to the read loop, which reports it.
        if let Ok(Ok(writes)) = tokio::time::timeout(REFRESH_INTERVAL, store.pool_writes()).await
            && last.replace(writes) != Some(writes)
        {
            wake.notify_one();
        }
    }
}

/// This replica's reads of the store: the last that succeeded, whether one failed since, and
/// the last blackout (the span between the last read before a failure and the first after).
#[derive(Debug, Default)]
struct Reads {
    last_ok: Option<i64>,
    failing: bool,
    blackout: Option<(i64, i64)>,
}

impl Reads {
    fn succeeded(&mut self, now_ms: i64) -> Option<(i64, i64)> {
        if std::mem::take(&mut self.failing)
            && let Some(last) = self.last_ok
        {
            self.blackout = Some((last, now_ms));
        }
        self.last_ok = Some(now_ms);
        self.blackout
    }

    fn failed(&mut self) {
        self.failing = true;
    }
}

/// Bound on migrating a store whose schema is gone (every migration, on an empty database).
const MIGRATE_AGAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Record that replica `name` is running every [`timing::REPLICA_REFRESH`], until `shutdown`;
/// `cut_off` says whether the last record that succeeded is [`timing::STORE_CUT_OFF`] old
/// (the member streams let their members go, see [`crate::host`]). A record is given that long
/// to land: a slow store that still takes the writes (a contended SQLite lock) is reached, and
/// cutting every replica's members off over it would move nothing but streams, all at once.
/// A store whose schema is gone (the database emptied or replaced) is migrated again.
pub async fn beat(store: Store, name: String, cut_off: watch::Sender<bool>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(timing::REPLICA_REFRESH);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut recorded_at = Instant::now();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {
                match tokio::time::timeout(timing::STORE_CUT_OFF, store.refresh_replica(&name)).await {
                    Ok(Ok(())) => recorded_at = Instant::now(),
                    Ok(Err(err)) if err.schema_gone() => {
                        warn!(error = %err, "the store's schema is gone (the database was replaced or emptied): \
                              migrating it again; the pool rebuilds from its members and the sidecars' registrations");
                        match tokio::time::timeout(MIGRATE_AGAIN_TIMEOUT, store.migrate_again()).await {
                            Ok(Ok(())) => info!("the store's schema is back"),
                            Ok(Err(err)) => warn!(error = %err, "cannot migrate the store again"),
                            Err(_) => warn!("migrating the store again timed out"),
                        }
                    }
                    Ok(Err(err)) => warn!(error = %err, "cannot record that this replica is running"),
                    Err(_) => warn!("recording that this replica is running timed out"),
                }
                let cut = recorded_at.elapsed() >= timing::STORE_CUT_OFF;
                if cut != *cut_off.borrow() {
                    if cut {
                        warn!(since = ?recorded_at.elapsed(), "this replica cannot reach the store: its member streams are closed so that the members attach through another replica");
                    } else {
                        info!("this replica reaches the store again: members may attach");
                    }
                    cut_off.send_replace(cut);
                }
            }
        }
    }
}

/// Record this replica's build ([`plumbing::build::version`]) for the status, at once and then
/// every [`GATEWAY_BUILD_EVERY`] (every [`timing::REPLICA_REFRESH`] while it fails), until
/// `shutdown`. Its own task: a slow store never delays [`beat`].
pub async fn record_build(store: Store, name: String, shutdown: CancellationToken) {
    loop {
        let record = store.record_build(Component::Gateway, &name, plumbing::build::version());
        let wait = match tokio::time::timeout(timing::STORE_CUT_OFF, record).await {
            Ok(Ok(())) => GATEWAY_BUILD_EVERY,
            Ok(Err(err)) => {
                debug!(error = %err, "cannot record this replica's build; trying again");
                timing::REPLICA_REFRESH
            }
            Err(_) => timing::REPLICA_REFRESH,
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use crate::store::{
        Assignment, AssignmentPhase, Operation, OperationKind, OperationPhase, OwnershipTerm, ReportPhase,
    };

    #[test]
    fn a_pool_awaits_writes_while_an_operation_is_open_or_a_handoff_reserved() {
        let mut view = View::default();
        assert!(!awaits_writes(&view), "at rest");
        let mut op = Operation {
            id: "op-1".into(),
            kind: OperationKind::Drain,
            target: "m1".into(),
            phase: OperationPhase::Running,
            message: String::new(),
            attempts: 0,
            moves: 0,
            deadline_at_ms: None,
            max_parallel: 1,
            requested_by: "admin".into(),
            cancel_requested: false,
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        view.operations = vec![op.clone()].into();
        assert!(awaits_writes(&view), "a drain running");
        op.phase = OperationPhase::Succeeded;
        view.operations = vec![op].into();
        assert!(!awaits_writes(&view), "a drain in force waits for nothing");
        let mut handoff = Assignment {
            route: "r1".into(),
            member: "m2".into(),
            process_id: "m2-p1".into(),
            term: OwnershipTerm::new(2),
            phase: AssignmentPhase::Reserved,
            generation: 1,
            placed_term: OwnershipTerm::new(1),
            coordinator_term: crate::store::CoordinatorTerm::new(1),
            updated_at_ms: 0,
        };
        view.now_ms = 60_000;
        handoff.updated_at_ms = 55_000;
        view.assignments = BTreeMap::from([("r1".to_owned(), handoff.clone())]).into();
        assert!(awaits_writes(&view), "a reserved term waits for its activation");
        let first = Assignment {
            term: OwnershipTerm::new(1),
            ..handoff.clone()
        };
        view.assignments = BTreeMap::from([("r1".to_owned(), first)]).into();
        assert!(!awaits_writes(&view), "a first placement waits for nothing sequential");
        view.assignments = BTreeMap::from([("r1".to_owned(), handoff.clone())]).into();
        view.now_ms = 65_000;
        assert!(
            !awaits_writes(&view),
            "a term reserved 10 s ago is stuck: left to the read loop"
        );
        view.now_ms = 60_000;
        let hosting = crate::pool::tests::report("r1", OwnershipTerm::new(2), "m2", "m2-p1", ReportPhase::Active);
        view.reports = BTreeMap::from([("r1".to_owned(), hosting)]).into();
        assert!(!awaits_writes(&view), "its owner reports hosting it: settled");
        view.reports = BTreeMap::new().into();
        handoff.phase = AssignmentPhase::Active;
        view.assignments = BTreeMap::from([("r1".to_owned(), handoff)]).into();
        assert!(!awaits_writes(&view));
    }

    #[test]
    fn a_blackout_is_the_span_between_the_last_read_before_a_failure_and_the_first_after() {
        let mut reads = Reads::default();
        assert_eq!(reads.succeeded(100), None);
        assert_eq!(reads.succeeded(300), None);
        reads.failed();
        reads.failed();
        assert_eq!(reads.succeeded(30_300), Some((300, 30_300)));
        assert_eq!(
            reads.succeeded(30_500),
            Some((300, 30_300)),
            "kept: the grace runs from its end"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_read_is_awaited_and_said_slow_a_hung_one_given_up() {
        let mut said = 0;
        let quick = patiently(async { 1 }, || said += 1).await;
        assert_eq!((quick, said), (Ok(1), 0));

        let slow = patiently(
            async {
                tokio::time::sleep(READ_SLOW * 3).await;
                2
            },
            || said += 1,
        )
        .await;
        assert_eq!((slow, said), (Ok(2), 1));

        let hung = patiently(std::future::pending::<()>(), || said += 1).await;
        assert!(hung.is_err());
        assert_eq!(said, 2);
    }
}
