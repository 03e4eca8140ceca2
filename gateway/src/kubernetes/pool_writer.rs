//! Keeps the `SupervisorPool` object's status current from the coordinator only: while this
//! replica holds the lease it computes [`pool_status::desired`] from the pool view once a
//! second and applies it (server-side apply of the status subresource) only when it changed.
//! Never on the hot path: it reads the published view and writes nothing to the store; a
//! failed apply is retried the next second.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::cluster::Cluster;
use super::pool_status::{self, POOL_NAME, PoolStatus};
use super::watch::Shared;
use crate::replica::Replica;
use crate::store::Lease;

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
        let mut failing = false;
        let mut every = rounds(STATUS_INTERVAL);
        while next_round(&mut every, &shutdown).await {
            let Some(held) = lease.borrow().clone() else {
                // Another replica coordinates now; a later term of ours starts over.
                applied = None;
                continue;
            };
            let view = self.replica.view.borrow().clone();
            if view.now_ms == 0 {
                continue;
            }
            let unsupervised = self.shared.with(|index| {
                pool_status::UnsupervisedPods::count(index.unsupervised().values().map(|p| p.reason.as_str()))
            });
            let next = pool_status::desired(&view, Some(&held), unsupervised, applied.as_ref());
            if applied.as_ref() == Some(&next) {
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
                }
                Err(err) if !failing => {
                    warn!(error = %err, "cannot write the SupervisorPool status; retrying every second");
                    failing = true;
                }
                Err(err) => debug!(error = %err, "cannot write the SupervisorPool status"),
            }
        }
    }
}
