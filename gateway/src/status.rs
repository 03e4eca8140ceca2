//! The pool status a replica prints: who coordinates, under which term, and
//! what the store holds.

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::store::{self, Lease, LeaseView, Store};

/// What one status line shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub holder: String,
    pub lease: Option<LeaseView>,
    pub live_members: usize,
    /// Desired (not withdrawn) instances.
    pub instances: usize,
    pub assignments: usize,
    pub open_operations: usize,
}

/// Render a status line. Pure, for tests.
pub fn render(view: &View) -> String {
    let coordinator = match &view.lease {
        Some(l) if l.is_live() && l.holder == view.holder => format!(
            "coordinator: this replica (term {}, {:.1}s left)",
            l.term,
            l.expires_at_ms.saturating_sub(l.now_ms) as f64 / 1000.0
        ),
        Some(l) if l.is_live() => format!("coordinator: {} (term {})", l.holder, l.term),
        Some(l) => format!("coordinator: none (term {} expired)", l.term),
        None => "coordinator: none yet".to_owned(),
    };
    format!(
        "{coordinator} | members: {} | instances: {} | assignments: {} | open operations: {}",
        view.live_members, view.instances, view.assignments, view.open_operations
    )
}

/// Read the store into a [`View`].
pub async fn read(store: &Store, holder: &str) -> store::Result<View> {
    let lease = store.read_lease().await?;
    let (now_ms, members) = store.list_members().await?;
    Ok(View {
        holder: holder.to_owned(),
        lease,
        live_members: members.iter().filter(|m| m.is_live(now_ms)).count(),
        instances: store.list_instances().await?.iter().filter(|i| !i.withdrawn).count(),
        assignments: store.list_assignments().await?.len(),
        open_operations: store
            .list_operations()
            .await?
            .iter()
            .filter(|o| !o.phase.is_finished())
            .count(),
    })
}

/// Print a status line every `interval` until `shutdown`.
pub async fn print_every(
    store: &Store,
    holder: &str,
    lease: &watch::Receiver<Option<Lease>>,
    interval: Duration,
    shutdown: &CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match tokio::time::timeout(interval, read(store, holder)).await {
            Ok(Ok(view)) => {
                let holds = lease.borrow().as_ref().map(|l| l.term);
                let role = if holds.is_some() { "coordinator" } else { "standby" };
                println!("[{role}] {}", render(&view));
            }
            Ok(Err(err)) => warn!(error = %err, "cannot read pool status"),
            Err(_) => warn!("reading pool status timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::CoordinatorTerm;

    fn view(lease: Option<LeaseView>) -> View {
        View {
            holder: "gw/1".into(),
            lease,
            live_members: 2,
            instances: 3,
            assignments: 3,
            open_operations: 1,
        }
    }

    #[test]
    fn names_the_coordinator() {
        let mine = LeaseView {
            holder: "gw/1".into(),
            term: CoordinatorTerm::new(4),
            expires_at_ms: 5000,
            now_ms: 1000,
        };
        assert!(render(&view(Some(mine.clone()))).starts_with("coordinator: this replica (term 4, 4.0s left)"));
        let theirs = LeaseView {
            holder: "gw/2".into(),
            ..mine.clone()
        };
        assert!(render(&view(Some(theirs))).starts_with("coordinator: gw/2 (term 4)"));
        let expired = LeaseView { now_ms: 6000, ..mine };
        assert!(render(&view(Some(expired))).starts_with("coordinator: none (term 4 expired)"));
        assert!(render(&view(None)).contains("members: 2 | instances: 3"));
    }
}
