//! Carries out [`operation_reconcile::reconcile`] for the `SupervisorPoolOperation` objects:
//! only while this replica holds the coordinator lease, once a second (never on the hot path:
//! it reads the index and the published view, plans off the runtime's threads), at most
//! [`MAX_WRITES_PER_ROUND`] calls a round. An object's effects run in order and stop at its
//! first failure (a finalizer not added means no operation is recorded); the next round
//! looks again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::cluster::{self, CALL_TIMEOUT, Cluster};
use super::index::Shared;
use super::operation_reconcile::{Effect, reconcile};
use super::pool_operation::OperationStatus;
use super::pool_writer::{next_round, rounds};
use crate::replica::Replica;
use crate::store::{self, Lease};

/// At most one round per this interval.
pub const ROUND_INTERVAL: Duration = Duration::from_secs(1);
/// At most this many API or store calls a round; the rest wait for the next.
pub const MAX_WRITES_PER_ROUND: usize = 32;

/// Why one effect could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Cluster(#[from] cluster::Error),
    #[error("store: {0}")]
    Store(#[from] store::Error),
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("planning failed: {0}")]
    Planning(String),
}

/// What the operation task needs.
pub struct OperationWriter<C> {
    pub cluster: C,
    pub shared: Shared,
    pub replica: Arc<Replica>,
    /// The install namespace, where the objects live.
    pub namespace: String,
}

impl<C: Cluster> OperationWriter<C> {
    /// Run until `shutdown`, acting while `lease` is held.
    pub async fn run(self, lease: watch::Receiver<Option<Lease>>, shutdown: CancellationToken) {
        // The statuses this term applied, by UID: newer than what the watch may show yet.
        let mut applied: BTreeMap<String, OperationStatus> = BTreeMap::new();
        let mut failing = false;
        let mut every = rounds(ROUND_INTERVAL);
        while next_round(&mut every, &shutdown).await {
            let Some(held) = lease.borrow().clone() else {
                applied.clear();
                continue;
            };
            match self.round(&held, &lease, &mut applied).await {
                Ok(()) => {
                    if failing {
                        info!("SupervisorPoolOperation objects written again");
                    }
                    failing = false;
                }
                Err(err) if !failing => {
                    warn!(error = %err, "cannot act on a SupervisorPoolOperation; retrying every second");
                    failing = true;
                }
                Err(err) => debug!(error = %err, "cannot act on a SupervisorPoolOperation"),
            }
        }
    }

    /// One round; the first error, after every object had its turn.
    async fn round(
        &self,
        held: &Lease,
        lease: &watch::Receiver<Option<Lease>>,
        applied: &mut BTreeMap<String, OperationStatus>,
    ) -> Result<(), Error> {
        let mut objects = self.shared.with(|index| index.operation_objects());
        applied.retain(|uid, _| objects.iter().any(|o| &o.uid == uid));
        if objects.is_empty() {
            return Ok(());
        }
        for object in &mut objects {
            if let Some(status) = applied.get(&object.uid) {
                object.status = Some(status.clone());
            }
        }
        let view = self.replica.view.borrow().clone();
        let (namespace, leased) = (self.namespace.clone(), held.clone());
        // Planning walks the whole pool: off the runtime's threads.
        let effects = tokio::task::spawn_blocking(move || reconcile(&objects, &view, Some(&leased), &namespace))
            .await
            .map_err(|err| Error::Planning(err.to_string()))?;
        let mut stopped: BTreeSet<String> = BTreeSet::new();
        let mut first = None;
        for effect in effects.into_iter().take(MAX_WRITES_PER_ROUND) {
            if stopped.contains(effect.name()) {
                continue;
            }
            // Only while the lease is still ours.
            if lease.borrow().as_ref().is_none_or(|l| l.term != held.term) {
                break;
            }
            let name = effect.name().to_owned();
            if let Err(err) = self.carry(effect, applied).await {
                stopped.insert(name);
                first.get_or_insert(err);
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn carry(&self, effect: Effect, applied: &mut BTreeMap<String, OperationStatus>) -> Result<(), Error> {
        let ns = self.namespace.as_str();
        match effect {
            Effect::AddFinalizer {
                name,
                resource_version,
                finalizers,
            } => {
                self.cluster
                    .set_operation_finalizers(ns, &name, &resource_version, &finalizers)
                    .await?;
            }
            Effect::Start { name, operation } => {
                let (recorded, created) = self.store(self.replica.store.request_operation(&operation)).await?;
                if created {
                    info!(object = %name, id = %recorded.id, kind = ?recorded.kind, target = %recorded.target,
                          max_parallel = recorded.max_parallel, "operation requested by a SupervisorPoolOperation");
                    self.replica.wake.notify_one();
                }
            }
            Effect::Release {
                name,
                operation_id,
                resource_version,
                finalizers,
                cancelled,
            } => {
                let found = self.store(self.replica.store.request_cancel(&operation_id)).await?;
                // Recorded now (or before), or the operation had ended: the finalizer can go.
                let cancelling = found.is_some_and(|op| op.cancel_requested);
                if cancelling {
                    info!(object = %name, id = %operation_id, "operation cancellation requested: its SupervisorPoolOperation was deleted");
                    self.replica.wake.notify_one();
                }
                self.cluster
                    .set_operation_finalizers(ns, &name, &resource_version, &finalizers)
                    .await?;
                if cancelling {
                    self.cluster.publish_operation(ns, &cancelled).await?;
                }
            }
            Effect::Status { name, uid, status } => {
                self.cluster.apply_operation_status(ns, &name, &status).await?;
                debug!(object = %name, phase = %status.phase, moves = %status.moves, "SupervisorPoolOperation status applied");
                applied.insert(uid, status);
            }
            Effect::Event(notice) => self.cluster.publish_operation(ns, &notice).await?,
        }
        Ok(())
    }

    async fn store<T>(&self, call: impl Future<Output = store::Result<T>>) -> Result<T, Error> {
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(Error::Timeout(CALL_TIMEOUT)),
        }
    }
}
