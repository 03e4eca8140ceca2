//! Keeps the `SupervisorPool` object's status current from the coordinator: while this
//! replica holds the lease it computes [`pool_status::desired`] from the pool view once a
//! second and applies it (server-side apply of the status subresource) when it changed, and
//! at least every [`pool_status::HEARTBEAT`] so that `observedAt` stays fresh. Never on the
//! hot path: it reads the published view, and the builds that run from the store every
//! [`builds::READ_EVERY`] (bounded); it writes nothing to the store; a failed apply is retried
//! the next second.
//!
//! The one write without the lease: when nobody can hold it because the store is out of
//! reach. A replica that has not read the store for [`pool_status::UNKNOWN_AFTER`] and has
//! seen the same `observedAt` for [`pool_status::UNCHANGED_FOR`] since (on its own clock)
//! marks the status `Unknown`
//! ([`pool_status::unreadable`]), only if the object is still as it read it (a
//! coordinator's write in between wins).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::cluster::Cluster;
use super::index::Shared;
use super::pool_status::{self, POOL_NAME, PoolStatus};
use crate::replica::Replica;
use crate::store::{Lease, builds};

/// At most one status write per this interval.
pub const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// A ticker for rounds every `period`, one at a time (a slow round delays the next).
pub fn rounds(period: Duration) -> tokio::time::Interval {
    let mut every = tokio::time::interval(period);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every
}

/// Wait for the next round; `false` once `shutdown` is cancelled.
pub async fn next_round(every: &mut tokio::time::Interval, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        _ = every.tick() => true,
    }
}

/// What the pool-status task needs.
pub struct PoolWriter<C> {
    pub cluster: C,
    pub replica: Arc<Replica>,
    /// The install namespace, where the pool object lives.
    pub namespace: String,
    /// The index, for the Pods admitted without supervision.
    pub shared: Shared,
}

impl<C: Cluster> PoolWriter<C> {
    /// Run until `shutdown`, writing while `lease` is held.
    pub async fn run(self, lease: watch::Receiver<Option<Lease>>, shutdown: CancellationToken) {
        // The status last applied in this term; `None`: write it whole.
        let mut applied: Option<PoolStatus> = None;
        let mut applied_at = tokio::time::Instant::now();
        let mut failing = false;
        let mut every = rounds(STATUS_INTERVAL);
        // The `observedAt` this replica last read off the object, and since when it has.
        let mut seen: Option<(Option<String>, tokio::time::Instant)> = None;
        let mut latest = builds::Latest::default();
        while next_round(&mut every, &shutdown).await {
            let view = self.replica.view.borrow().clone();
            let unread = view.read_at.is_none_or(|at| at.elapsed() >= pool_status::UNKNOWN_AFTER);
            if unread {
                self.mark_unknown(&mut seen).await;
            } else {
                seen = None;
            }
            let Some(held) = lease.borrow().clone() else {
                // Another replica coordinates now; a later term of ours starts over.
                applied = None;
                continue;
            };
            if view.now_ms == 0 || unread {
                continue;
            }
            let unsupervised = self.shared.with(|index| {
                pool_status::UnsupervisedPods::count(super::supervised::unsupervised_reasons(index, &view))
            });
            let builds = latest.get(&self.replica.store).await;
            let next = pool_status::desired(&view, Some(&held), unsupervised, builds, applied.as_ref());
            let fresh = applied_at.elapsed() < pool_status::HEARTBEAT;
            if applied.as_ref().is_some_and(|a| !pool_status::differs(a, &next)) && fresh {
                continue;
            }
            // Only while the lease is still ours.
            if lease.borrow().as_ref().is_none_or(|l| l.term != held.term) {
                continue;
            }
            match self.cluster.apply_pool_status(&self.namespace, POOL_NAME, &next).await {
                Ok(()) => {
                    if applied.is_none() || failing {
                        info!(namespace = %self.namespace, name = POOL_NAME, "SupervisorPool status written");
                    }
                    debug!(ready = %next.ready_members, instances = %next.ready_instances, "SupervisorPool status applied");
                    failing = false;
                    applied = Some(next);
                    applied_at = tokio::time::Instant::now();
                }
                Err(err) if !failing => {
                    warn!(error = %err, "cannot write the SupervisorPool status; retrying every second");
                    failing = true;
                }
                Err(err) => debug!(error = %err, "cannot write the SupervisorPool status"),
            }
        }
    }

    /// This replica cannot read the store: say so on the pool object if nobody has
    /// refreshed it for as long as this replica has been looking (`seen`).
    async fn mark_unknown(&self, seen: &mut Option<(Option<String>, tokio::time::Instant)>) {
        let current = match self.cluster.read_pool_status(&self.namespace, POOL_NAME).await {
            Ok(Some(current)) => current,
            Ok(None) => return,
            Err(err) => {
                debug!(error = %err, "cannot read the SupervisorPool status");
                return;
            }
        };
        let (version, status) = current;
        let since = match seen.as_ref() {
            Some((observed, since)) if *observed == status.observed_at => *since,
            _ => {
                *seen = Some((status.observed_at.clone(), tokio::time::Instant::now()));
                return;
            }
        };
        let now_ms = proto::trust::unix_ms(std::time::SystemTime::now());
        let Some(marked) = pool_status::unreadable(&status, since.elapsed(), now_ms, &self.replica.name) else {
            return;
        };
        match self
            .cluster
            .replace_pool_status(&self.namespace, POOL_NAME, &version, &marked)
            .await
        {
            Ok(true) => warn!(
                observed_at = status.observed_at.as_deref().unwrap_or("never"),
                "the store is out of reach: SupervisorPool marked Unknown"
            ),
            Ok(false) => debug!("the SupervisorPool changed meanwhile: not marked Unknown"),
            Err(err) => debug!(error = %err, "cannot mark the SupervisorPool Unknown"),
        }
    }
}
