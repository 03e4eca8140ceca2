//! What every service of one gateway replica shares.

use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::auth::Keys;
use crate::host::admission::Sessions;
use crate::pool::View;
use crate::store::Store;

pub struct Replica {
    /// This replica's name (its Pod name in Kubernetes).
    pub name: String,
    pub store: Store,
    /// The latest pool view (`now_ms == 0` until the first read).
    pub view: watch::Receiver<Arc<View>>,
    /// Wakes the pool refresh at once (a membership changed).
    pub wake: Arc<Notify>,
    pub sessions: Mutex<Sessions>,
    pub keys: Arc<Keys>,
    /// Which namespaces may register instances, and how many.
    pub quota: crate::quota::Quota,
    /// Recovery deadline offered to sidecars.
    pub recovery_deadline_ms: u64,
    /// The replica's metrics (served on the health port's `/metrics`).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Writes the member streams' status reports in batches.
    pub reports: Arc<crate::reports::Writer>,
    /// Cancelled when the replica shuts down.
    pub shutdown: CancellationToken,
}

impl Replica {
    /// Run `f` on the session table (never held across an await).
    pub fn sessions<T>(&self, f: impl FnOnce(&mut Sessions) -> T) -> T {
        let mut guard = self.sessions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut guard)
    }
}
