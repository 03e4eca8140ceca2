//! What every service of one gateway replica shares.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::auth::Keys;
use crate::pool::View;
use crate::sessions::Sessions;
use crate::store::Store;

/// How long a caller that needs a pool view read after its request waits for the refresh.
pub const FRESH_VIEW_WAIT: Duration = Duration::from_secs(5);

/// No pool read came within [`FRESH_VIEW_WAIT`].
#[derive(Debug, thiserror::Error)]
#[error("no read of the pool within {} s (the store is slow or unreachable); try again", FRESH_VIEW_WAIT.as_secs())]
pub struct ViewBehind;

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
    /// On Kubernetes: the egress policy each Pod runs, for the members' snapshots.
    pub policies: Option<crate::kubernetes::index::Shared>,
    /// Recovery deadline offered to sidecars.
    pub recovery_deadline_ms: u64,
    /// How long a member whose stream a replica ended for silence stays a member.
    pub detached_grace: Duration,
    /// The replica's metrics (served on the health port's `/metrics`).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Writes the member streams' status reports in batches.
    pub reports: Arc<crate::reports::Writer>,
    /// Whether this replica has failed to record itself running for [`proto::timing::STORE_CUT_OFF`]
    /// (from [`crate::refresh::beat`]): it then serves no member streams.
    pub cut_off: watch::Receiver<bool>,
    /// Cancelled when the replica shuts down.
    pub shutdown: CancellationToken,
    /// Pool watches this replica serves at once (`--max-pool-watchers`).
    pub max_pool_watchers: usize,
}

impl Replica {
    /// Run `f` on the session table (never held across an await).
    pub fn sessions<T>(&self, f: impl FnOnce(&mut Sessions) -> T) -> T {
        let mut guard = self.sessions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut guard)
    }

    /// A pool view read after this call began (a member that attached a moment ago, an
    /// instance just registered are in it): wakes the refresh and waits for its next read,
    /// which every caller waiting meanwhile shares — a burst of registrations or status calls
    /// costs one read of the pool, not one each. When no read comes within
    /// [`FRESH_VIEW_WAIT`] the store is slow or unreachable and the caller is told so: it does
    /// not read the pool itself (a slow store would get one more full read per waiting call).
    pub async fn fresh_view(&self) -> Result<Arc<View>, ViewBehind> {
        let asked = Instant::now();
        let mut view = self.view.clone();
        self.wake.notify_one();
        let read_after = view.wait_for(|v| v.read_at.is_some_and(|at| at >= asked));
        match tokio::time::timeout(FRESH_VIEW_WAIT, read_after).await {
            Ok(Ok(view)) => Ok(Arc::clone(&view)),
            _ => Err(ViewBehind),
        }
    }
}
