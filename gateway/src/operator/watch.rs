//! `WatchSupervisorPool`: one feed per replica turns its pool view (and the lease row) into
//! the status while anybody watches, and publishes it only when something the status shows
//! changed; each watcher follows the feed with at most one status per
//! [`timing::WATCH_COALESCE`] and a keepalive after [`timing::WATCH_KEEPALIVE`] of silence.
//! At most `--max-pool-watchers` watchers at once; every watcher ends on the replica's
//! shutdown.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use proto::pool::v1::watch_supervisor_pool_response::Event;
use proto::pool::v1::{GetSupervisorPoolStatusResponse, WatchKeepalive, WatchSupervisorPoolResponse};
use proto::timing;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::replica::Replica;
use crate::store::LeaseView;

/// What a watcher receives.
pub type WatchStream = ReceiverStream<Result<WatchSupervisorPoolResponse, Status>>;

type Shared = Option<Arc<GetSupervisorPoolStatusResponse>>;

/// The replica's status feed and its watcher slots.
pub struct Feed {
    publish: watch::Sender<Shared>,
    /// A watcher joined: publish the status now, changed or not.
    joined: Arc<Notify>,
    slots: Arc<Semaphore>,
    replica: Arc<Replica>,
}

impl Feed {
    /// Start the feed of `replica` (it ends with the replica).
    pub fn start(replica: Arc<Replica>) -> Self {
        let (publish, _) = watch::channel(None);
        let joined = Arc::new(Notify::new());
        tokio::spawn(follow(replica.clone(), publish.clone(), joined.clone()));
        Self {
            publish,
            joined,
            slots: Arc::new(Semaphore::new(replica.max_pool_watchers)),
            replica,
        }
    }

    /// A new watcher's stream, or RESOURCE_EXHAUSTED when every slot is taken.
    pub fn watch(&self) -> Result<WatchStream, Status> {
        let permit = self.slots.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "this replica already serves its {} pool watchers; retry later or ask another replica",
                self.replica.max_pool_watchers
            ))
        })?;
        let statuses = self.publish.subscribe();
        self.joined.notify_one();
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(serve(statuses, permit, tx, self.replica.clone()));
        Ok(ReceiverStream::new(rx))
    }
}

/// The parts of a status a watcher is shown as a change: without the read time, heartbeats
/// and expiries, which move on every refresh.
pub fn shown(status: &GetSupervisorPoolStatusResponse) -> GetSupervisorPoolStatusResponse {
    let mut shown = status.clone();
    shown.observed_at_ms = 0;
    if let Some(c) = shown.coordinator.as_mut() {
        c.expires_at_ms = 0;
    }
    for m in &mut shown.members {
        m.last_heartbeat_at_ms = 0;
        m.expires_at_ms = 0;
    }
    for i in &mut shown.instances {
        i.last_report_at_ms = 0;
    }
    shown
}

/// Publish the status of each new pool view while anybody watches.
async fn follow(replica: Arc<Replica>, publish: watch::Sender<Shared>, joined: Arc<Notify>) {
    let mut views = replica.view.clone();
    let mut lease: Option<LeaseView> = None;
    let mut builds = crate::store::builds::Latest::default();
    let mut forced = false;
    loop {
        tokio::select! {
            () = replica.shutdown.cancelled() => return,
            changed = views.changed() => if changed.is_err() { return },
            () = joined.notified() => forced = true,
        }
        let view = views.borrow_and_update().clone();
        if publish.receiver_count() == 0 || view.now_ms == 0 {
            continue;
        }
        // The last lease read stands while the store does not answer (in time).
        if let Ok(Ok(read)) = tokio::time::timeout(timing::STORE_CUT_OFF, replica.store.read_lease()).await {
            lease = read;
        }
        let builds = builds.get(&replica.store).await;
        let next = crate::summary::status(&view, lease.as_ref(), builds, &replica.name);
        publish.send_if_modified(|current| {
            let changed = forced || current.as_deref().is_none_or(|c| shown(c) != shown(&next));
            if changed {
                *current = Some(Arc::new(next));
            }
            changed
        });
        forced = false;
    }
}

/// One watcher: statuses as the feed publishes them (coalesced), keepalives in between.
/// A client that does not take a message within a keepalive interval is dropped.
async fn serve(
    mut statuses: watch::Receiver<Shared>,
    _slot: OwnedSemaphorePermit,
    tx: mpsc::Sender<Result<WatchSupervisorPoolResponse, Status>>,
    replica: Arc<Replica>,
) {
    let shutdown = replica.shutdown.clone();
    let mut last: Shared = None;
    let mut quiet_since = Instant::now();
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            () = tx.closed() => return,
            changed = statuses.changed() => {
                if changed.is_err() {
                    return;
                }
                let current = statuses.borrow_and_update().clone();
                let Some(current) = current else { continue };
                let repeated = last
                    .as_ref()
                    .is_some_and(|l| Arc::ptr_eq(l, &current) || shown(l) == shown(&current));
                if repeated {
                    continue;
                }
                last = Some(current.clone());
                Event::Status(current.as_ref().clone())
            }
            () = tokio::time::sleep_until(quiet_since + timing::WATCH_KEEPALIVE) => {
                Event::Keepalive(WatchKeepalive { sent_at_ms: now_ms() })
            }
        };
        let message = WatchSupervisorPoolResponse { event: Some(event) };
        match tokio::time::timeout(timing::WATCH_KEEPALIVE, tx.send(Ok(message))).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        quiet_since = Instant::now();
        // Changes published meanwhile wait for the next status.
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(timing::WATCH_COALESCE) => {}
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::pool::v1::{Coordinator, Member};

    #[test]
    fn heartbeats_and_read_times_are_no_change_but_a_member_is() {
        let status = |heartbeat: i64, members: usize| GetSupervisorPoolStatusResponse {
            coordinator: Some(Coordinator {
                holder: "gw-0/abc".into(),
                term: 2,
                expires_at_ms: heartbeat + 5000,
            }),
            members: (0..members)
                .map(|i| Member {
                    name: format!("m-{i}"),
                    last_heartbeat_at_ms: heartbeat,
                    expires_at_ms: heartbeat + 15_000,
                    ..Member::default()
                })
                .collect(),
            observed_at_ms: heartbeat,
            ..GetSupervisorPoolStatusResponse::default()
        };
        assert_eq!(shown(&status(1, 1)), shown(&status(2, 1)));
        assert_ne!(shown(&status(1, 1)), shown(&status(1, 2)));
    }
}
