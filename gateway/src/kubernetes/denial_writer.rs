//! Publishes the [`denials`] Events from the coordinator: while this replica holds the lease,
//! every [`INTERVAL`] it reads the denials the audit trail stored since its last round (any
//! replica stores them) and publishes their Events. A new term starts [`LOOKBACK_MS`] back,
//! so denials its predecessor had no time to report (it died) are reported; one both
//! reported counts twice in its Event's series (the audit trail has each denial once).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::cluster::Cluster;
use super::denials;
use super::pool_writer::{next_round, rounds};
use crate::replica::Replica;
use crate::store::Lease;

/// How often denials are read and published.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Records are read once stored this long ago (by the store's clock): a delivery's
/// transaction stamps its records when it starts and commits a moment later.
pub const SETTLE_MS: i64 = 5_000;
/// How far back (storing time) a new term starts.
pub const LOOKBACK_MS: i64 = 30_000;
/// Groups of denials read in one round at most.
const GROUPS: i64 = 1_000;

/// What the denial task needs.
pub struct DenialWriter<C> {
    pub cluster: C,
    pub replica: Arc<Replica>,
}

impl<C: Cluster> DenialWriter<C> {
    /// Run until `shutdown`, publishing while `lease` is held.
    pub async fn run(self, lease: watch::Receiver<Option<Lease>>, shutdown: CancellationToken) {
        // The term and the storing time up to which its denials were published.
        let mut published: Option<(crate::store::CoordinatorTerm, i64)> = None;
        let mut failing = false;
        let mut every = rounds(INTERVAL);
        while next_round(&mut every, &shutdown).await {
            let Some(term) = lease.borrow().as_ref().map(|l| l.term) else {
                published = None;
                continue;
            };
            let now_ms = self.replica.view.borrow().now_ms;
            if now_ms == 0 {
                continue;
            }
            let upto = now_ms - SETTLE_MS;
            let after = match published {
                Some((held, after)) if held == term => after,
                _ => upto - LOOKBACK_MS,
            };
            if upto <= after {
                continue;
            }
            let denied = match self
                .replica
                .store
                .audit_denials(after, upto, denials::PER_POD as i64, GROUPS)
                .await
            {
                Ok(denied) => denied,
                Err(err) => {
                    warn!(error = %err, "cannot read the egress denials to report; retrying next round");
                    continue;
                }
            };
            published = Some((term, upto));
            for notice in denials::notices(&denied) {
                if shutdown.is_cancelled() || lease.borrow().as_ref().is_none_or(|l| l.term != term) {
                    break;
                }
                match self.cluster.publish_distinct(&notice).await {
                    Ok(()) => failing = false,
                    Err(err) if !failing => {
                        warn!(namespace = %notice.regarding.namespace, pod = %notice.regarding.name, error = %err,
                            "cannot record an EgressDenied Event; the audit trail has the denials");
                        failing = true;
                    }
                    Err(err) => debug!(error = %err, "cannot record an EgressDenied Event"),
                }
            }
        }
    }
}
