//! Keeps each `SandboxPolicy`'s status current from the coordinator: while this replica holds
//! the lease it computes [`policy_status::desired`] once a second and applies (server-side,
//! the status subresource) each status that changed since this term last wrote it, at most
//! [`APPLIES_PER_ROUND`] a round. A failed apply is tried again the next round; a policy
//! deleted meanwhile is forgotten. Reads only the published view and the index.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::cluster::Cluster;
use super::index::Shared;
use super::policy_status::{self, PolicyStatus};
use super::pool_writer::{STATUS_INTERVAL, next_round, rounds};
use crate::replica::Replica;
use crate::store::Lease;

/// Status applies per round at most (a namespace full of policies is caught up over rounds).
pub const APPLIES_PER_ROUND: usize = 32;

/// What the policy-status task needs.
pub struct PolicyWriter<C> {
    pub cluster: C,
    pub replica: Arc<Replica>,
    pub shared: Shared,
}

impl<C: Cluster> PolicyWriter<C> {
    /// Run until `shutdown`, writing while `lease` is held.
    pub async fn run(self, lease: watch::Receiver<Option<Lease>>, shutdown: CancellationToken) {
        // What this term applied, by namespace and name.
        let mut applied: BTreeMap<(String, String), PolicyStatus> = BTreeMap::new();
        let mut term = None;
        let mut failing = false;
        let mut every = rounds(STATUS_INTERVAL);
        while next_round(&mut every, &shutdown).await {
            let Some(held) = lease.borrow().as_ref().map(|l| l.term) else {
                term = None;
                continue;
            };
            if term != Some(held) {
                // A new term writes every status again.
                applied.clear();
                term = Some(held);
            }
            let view = self.replica.view.borrow().clone();
            if view.now_ms == 0 {
                continue;
            }
            let desired = self.shared.with(|index| policy_status::desired(index.egress(), &view));
            applied.retain(|key, _| desired.contains_key(key));
            let changed: Vec<_> = desired
                .into_iter()
                .filter(|(key, status)| applied.get(key) != Some(status))
                .take(APPLIES_PER_ROUND)
                .collect();
            for ((namespace, name), status) in changed {
                if lease.borrow().as_ref().is_none_or(|l| l.term != held) {
                    break;
                }
                match self.cluster.apply_policy_status(&namespace, &name, &status).await {
                    Ok(()) => {
                        debug!(%namespace, %name, revision = status.revision, loaded = status.loaded, pods = status.pods, "SandboxPolicy status applied");
                        failing = false;
                        applied.insert((namespace, name), status);
                    }
                    Err(err) if !failing => {
                        warn!(%namespace, %name, error = %err, "cannot write a SandboxPolicy status; retrying every second");
                        failing = true;
                    }
                    Err(err) => debug!(%namespace, %name, error = %err, "cannot write a SandboxPolicy status"),
                }
            }
        }
    }
}
