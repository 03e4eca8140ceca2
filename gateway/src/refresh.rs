//! Keeping this replica's pool view fresh: the read loop ([`refresh`]: every
//! [`REFRESH_INTERVAL`], or at once when woken), the other replicas' writes that wake it
//! ([`follow_writes`]: PostgreSQL notifications, or on SQLite a poll of the write counts),
//! and this replica's liveness record ([`beat`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::timing;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::pool::{FULL_READ_EVERY, REFRESH_INTERVAL, View};
use crate::store::Store;

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
        match tokio::time::timeout(REFRESH_INTERVAL * 10, View::reload(&store, since)).await {
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
                warn!("reading the pool timed out");
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

/// SQLite has no notifications: its write counts (one small read of a local file) are
/// polled this often instead.
pub const WRITES_POLL_EVERY: Duration = Duration::from_millis(25);

/// Wake the pool read whenever any replica commits a write to a table the view reads (a
/// planned move's activation on the replica serving the members, seen at once by a
/// coordinator elsewhere instead of at its next [`REFRESH_INTERVAL`] read). PostgreSQL:
/// notifications from the writing transactions, reconnecting with backoff. SQLite: the write
/// counts polled every [`WRITES_POLL_EVERY`]. Either wakes once when it starts following
/// (a write may have landed before).
pub async fn follow_writes(store: Store, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut failures = 0u32;
    loop {
        let connected = tokio::select! {
            () = shutdown.cancelled() => return,
            listener = store.listen_pool_writes(timing::CONNECT_TIMEOUT * 5) => listener,
        };
        match connected {
            None => return poll_writes(store, wake, shutdown).await,
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

/// SQLite: wake the pool read when the write counts move.
async fn poll_writes(store: Store, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(WRITES_POLL_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {}
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

/// Record that replica `name` is running every [`timing::REPLICA_REFRESH`], until `shutdown`.
pub async fn beat(store: Store, name: String, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(timing::REPLICA_REFRESH);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {
                match tokio::time::timeout(timing::REPLICA_REFRESH, store.refresh_replica(&name)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => warn!(error = %err, "cannot record that this replica is running"),
                    Err(_) => warn!("recording that this replica is running timed out"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
