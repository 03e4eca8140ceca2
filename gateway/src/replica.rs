//! What every service of one gateway replica shares.

use std::sync::atomic::{AtomicU64, Ordering};
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
    pub counters: Counters,
    /// Writes the member streams' status reports in batches.
    pub reports: Arc<crate::reports::Writer>,
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
}

/// Messages dropped by the member streams of this replica, and calls refused because a
/// credential was used for another instance or member.
#[derive(Debug, Default)]
pub struct Counters {
    pub acks_never_sent: AtomicU64,
    pub acks_regressed: AtomicU64,
    pub oversized_reports: AtomicU64,
    pub denied: AtomicU64,
}

impl Counters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}
