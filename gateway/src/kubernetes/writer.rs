//! The coordinator's hands on the cluster: while this replica holds the lease, it carries out
//! the [`plan`] (token Secrets, withdrawals) and publishes the [`notice`]s of each new pool
//! view, of each instance withdrawn because its Pod finished, and one of each running Pod
//! admitted without supervision (once per term: a new coordinator records them again), and
//! keeps each Pod's `Supervised` condition ([`supervised`]). It talks to the API only while the lease is held, checked before every call; a
//! replica that loses the lease stops at once and the next coordinator starts over (it
//! re-delivers every token once, and publishes nothing about what happened before it).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use futures::StreamExt;
use proto::timing::SECRET_RECHECK_INTERVAL;
use proto::trust;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::cluster::{self, Cluster};
use super::index::Shared;
use super::index::{Pod, Unsupervised};
use super::notice;
use super::plan::{self, Scope, Write};
use super::supervised::{self, Supervised};
use crate::credentials::{self, Issued, Target};
use crate::replica::Replica;
use crate::store::Lease;

/// Pods' `Supervised` conditions patched at once.
pub const CONDITION_CALLS: usize = 16;
/// At most this many condition patches per round of the writer.
pub const CONDITIONS_PER_ROUND: usize = 256;

/// What this term set of the Pods' `Supervised` conditions.
#[derive(Default)]
struct Conditions {
    written: BTreeMap<String, Supervised>,
    /// Pods whose patch failed, and when.
    failed: HashMap<String, Instant>,
}

/// Everything the writer needs.
pub struct Writer<C> {
    pub cluster: C,
    pub shared: Shared,
    pub replica: Arc<Replica>,
    pub scope: Scope,
}

impl<C: Cluster> Writer<C> {
    /// Act whenever this replica holds the lease, until `shutdown`.
    pub async fn run(self, mut lease: watch::Receiver<Option<Lease>>, shutdown: CancellationToken) {
        loop {
            while lease.borrow_and_update().is_none() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = lease.changed() => if changed.is_err() { return },
                }
            }
            info!("coordinator: writing to the cluster");
            self.while_held(&mut lease, &shutdown).await;
            self.replica.metrics.token_secrets_forgotten();
            if shutdown.is_cancelled() {
                return;
            }
        }
    }

    async fn while_held(&self, lease: &mut watch::Receiver<Option<Lease>>, shutdown: &CancellationToken) {
        let held = |lease: &watch::Receiver<Option<Lease>>| lease.borrow().is_some();
        let mut view_rx = self.replica.view.clone();
        // What happened before this term is not ours to report.
        let mut before = view_rx.borrow_and_update().clone();
        let mut sent: BTreeMap<Target, Issued> = BTreeMap::new();
        let mut failed: HashMap<Write, Instant> = HashMap::new();
        let mut ca: Option<String> = None;
        let mut ca_read: Option<Instant> = None;
        // Pods admitted without supervision whose Event this term published.
        let mut announced: BTreeSet<String> = BTreeSet::new();
        // Pods seen running in this term (and those whose instance the plan withdrew because
        // they finished): when they are seen finished, their WorkloadFinished is due.
        let mut finishing: BTreeSet<String> = BTreeSet::new();
        let mut withdrawn_finished: BTreeSet<String> = BTreeSet::new();
        // The Supervised condition this term set on each Pod, by UID.
        let mut conditions = Conditions::default();
        loop {
            if !held(lease) {
                return;
            }
            if ca_read.is_none_or(|at| at.elapsed() >= SECRET_RECHECK_INTERVAL) {
                ca_read = Some(Instant::now());
                match credentials::read_ca(self.scope.ca_file.as_deref()).await {
                    // A new CA bundle: every Secret gets it.
                    Ok(fresh) if fresh != ca => {
                        ca = fresh;
                        sent.clear();
                    }
                    Ok(_) => {}
                    Err(err) => warn!(error = %err, "cannot read the CA bundle to deliver; keeping the last one"),
                }
            }
            let keyring = self.replica.keys.keyring();
            let now_ms = trust::unix_ms(SystemTime::now());
            let view = view_rx.borrow_and_update().clone();
            let due = |target: &Target| {
                keyring.signing_kid().is_some() && credentials::is_due(sent.get(target), &keyring, now_ms)
            };
            let writes = self.shared.with(|index| plan::plan(&self.scope, index, &view, &due));
            let notices = if before.now_ms == 0 {
                Vec::new()
            } else {
                notice::diff(&before, &view, &self.scope.install_namespace)
            };
            before = view;
            failed.retain(|_, at| at.elapsed() < SECRET_RECHECK_INTERVAL);
            // Secrets only while the lease is still ours by the database: a coordinator that
            // was paused past its lease and resumed must not overwrite its successor's
            // Secrets with a stale keyring.
            let current = lease.borrow().clone();
            let mut writes = writes;
            if writes.iter().any(|w| matches!(w, Write::Secret { .. })) {
                let ours = match &current {
                    Some(l) => credentials::still_holds(&self.replica, l).await,
                    None => false,
                };
                if !ours {
                    warn!("no longer the coordinator by the database: no Secret written");
                    writes.retain(|w| !matches!(w, Write::Secret { .. }));
                }
            }
            for write in writes {
                if !held(lease) {
                    return;
                }
                if failed.contains_key(&write) {
                    continue;
                }
                match self.execute(&write, &keyring, ca.as_ref(), &mut sent).await {
                    Ok(()) => {
                        if let Write::Withdraw {
                            uid,
                            cause: plan::Cause::PodFinished,
                            ..
                        } = &write
                        {
                            withdrawn_finished.insert(uid.clone());
                        }
                    }
                    // Gone for good: the plan drops it, nothing to retry or warn about.
                    Err(Error::Cluster(cluster::Error::NamespaceTerminating(namespace))) => {
                        info!(%namespace, "the namespace is being deleted: no more writes there");
                        self.shared.with(|index| index.terminate_namespace(&namespace));
                    }
                    Err(err) => {
                        warn!(?write, error = %err, "cannot write to the cluster; retrying later");
                        failed.insert(write, Instant::now());
                    }
                }
            }
            self.replica
                .metrics
                .token_secrets_delivered(sent.iter().map(|(target, issued)| (target.kind(), issued.issued_at_ms)));
            // A Pod that finished: told once its instance left the pool — the plan withdrew it
            // just now, or its sidecar deregistered it when the workload exited. One that
            // finished after this pass's plan was made waits for the next pass, whose plan
            // withdraws it. Pods already finished when this term began were told by an earlier
            // coordinator (or their instance is withdrawn now, by the plan).
            let finished: Vec<notice::Notice> = self.shared.with(|index| {
                let withdrawn_now = std::mem::take(&mut withdrawn_finished);
                finishing.extend(withdrawn_now.iter().cloned());
                let left = |uid: &str| {
                    withdrawn_now.contains(uid) || before.instances.values().any(|i| i.uid == uid && i.withdrawn)
                };
                let (newly, waiting): (Vec<&String>, Vec<&String>) = finishing
                    .iter()
                    .filter(|uid| index.finished().contains(uid))
                    .partition(|uid| left(uid));
                let told = notice::workloads_finished(newly.into_iter().map(String::as_str), &before);
                let waiting: Vec<String> = waiting.into_iter().cloned().collect();
                finishing = index
                    .pods()
                    .map(|p| p.uid.clone())
                    .filter(|uid| !index.finished().contains(uid))
                    .chain(waiting)
                    .collect();
                told
            });
            // Each running Pod admitted without supervision gets its Event once per term.
            let unsupervised: Vec<Unsupervised> = self.shared.with(|index| {
                announced.retain(|uid| index.unsupervised().contains(uid));
                index
                    .unsupervised_labelled()
                    .filter(|p| !announced.contains(&p.pod.uid))
                    .cloned()
                    .collect()
            });
            let notices = notices
                .into_iter()
                .chain(finished)
                .chain(unsupervised.iter().map(notice::not_supervised));
            for notice in notices {
                if !held(lease) {
                    return;
                }
                self.publish(notice).await;
            }
            announced.extend(unsupervised.into_iter().map(|p| p.pod.uid));
            if !self.keep_conditions(lease, &before, &mut conditions).await {
                return;
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = lease.changed() => {}
                () = self.shared.changed.notified() => {}
                _ = view_rx.changed() => {}
                () = tokio::time::sleep(SECRET_RECHECK_INTERVAL) => {}
            }
        }
    }

    /// Set the `Supervised` condition of every Pod whose condition changed since this term
    /// last set it (the first round of a term sets them all), [`CONDITION_CALLS`] at a time
    /// and at most [`CONDITIONS_PER_ROUND`] per round, so that a large pool delays the other
    /// writes by one bounded batch; a Pod whose patch failed waits [`SECRET_RECHECK_INTERVAL`]
    /// before it is tried again. `false` once the lease is gone.
    async fn keep_conditions(
        &self,
        lease: &watch::Receiver<Option<Lease>>,
        view: &crate::pool::View,
        kept: &mut Conditions,
    ) -> bool {
        if view.now_ms == 0 || !self.shared.with(|index| index.pods_synced()) {
            return true;
        }
        let desired = self.shared.with(|index| supervised::desired(index, view));
        kept.written.retain(|uid, _| desired.contains_key(uid));
        kept.failed.retain(|_, at| at.elapsed() < SECRET_RECHECK_INTERVAL);
        let since = super::pool_status::transition_time(view.now_ms);
        let due: Vec<(String, (Pod, Supervised))> = desired
            .into_iter()
            .filter(|(uid, (_, c))| !kept.written.get(uid).is_some_and(|w| w.same_as(c)))
            .filter(|(uid, _)| !kept.failed.contains_key(uid))
            .take(CONDITIONS_PER_ROUND)
            .collect();
        if due.is_empty() {
            return true;
        }
        if lease.borrow().is_none() {
            return false;
        }
        let since = &since;
        let results: Vec<_> = futures::stream::iter(due)
            .map(|(uid, (pod, condition))| async move {
                let result = self.cluster.set_supervised(&pod, &condition, since).await;
                (uid, pod, condition, result)
            })
            .buffer_unordered(CONDITION_CALLS)
            .collect()
            .await;
        let mut failures = 0;
        for (uid, pod, condition, result) in results {
            match result {
                Ok(()) => {
                    debug!(namespace = %pod.namespace, pod = %pod.name, reason = condition.reason, "Supervised condition set");
                    kept.written.insert(uid, condition);
                }
                Err(err) => {
                    if failures == 0 {
                        warn!(namespace = %pod.namespace, pod = %pod.name, error = %err, "cannot set the Supervised condition; trying again later");
                    }
                    failures += 1;
                    kept.failed.insert(uid, Instant::now());
                }
            }
        }
        if failures > 1 {
            warn!(failures, "Supervised conditions not set this round");
        }
        lease.borrow().is_some()
    }

    /// Record `notice` as an Event (failures are logged: Events are best effort).
    async fn publish(&self, mut notice: notice::Notice) {
        self.name_member_pods(&mut notice);
        match self.cluster.publish(&notice).await {
            Ok(()) => {}
            Err(cluster::Error::NamespaceTerminating(namespace)) => {
                debug!(reason = notice.reason, %namespace, "no event: the namespace is being deleted");
            }
            Err(err) => warn!(reason = notice.reason, error = %err, "cannot record an event"),
        }
    }

    /// Fill in the UIDs of the supervisor Pods a notice is about (or related to), so that
    /// `kubectl describe pod` on them shows it.
    fn name_member_pods(&self, notice: &mut notice::Notice) {
        let install = &self.scope.install_namespace;
        self.shared.with(|index| {
            for pod in std::iter::once(&mut notice.regarding).chain(notice.related.as_mut()) {
                if pod.uid.is_none() && &pod.namespace == install {
                    pod.uid = index.member_pod_uid(&pod.name).map(str::to_owned);
                }
            }
        });
    }

    async fn execute(
        &self,
        write: &Write,
        keyring: &crate::tokens::Keyring,
        ca: Option<&String>,
        sent: &mut BTreeMap<Target, Issued>,
    ) -> Result<(), Error> {
        match write {
            Write::Secret {
                namespace,
                name,
                target,
            } => {
                let now_ms = proto::trust::unix_ms(std::time::SystemTime::now());
                let issued = credentials::issue(keyring, target, now_ms)?;
                let delivered = issued.delivered(keyring, ca);
                // Cleared before the write: a deletion seen meanwhile asks for another one.
                let needed = match target {
                    Target::Namespace(ns) => self.shared.with(|index| index.secret_written(ns)),
                    _ => false,
                };
                let applied = self.cluster.apply_secret(namespace, name, &delivered).await;
                self.replica.metrics.token_secret_written(applied.is_ok());
                if let Err(err) = applied {
                    if needed {
                        self.shared.with(|index| index.need_secret(namespace));
                    }
                    return Err(err.into());
                }
                info!(%namespace, secret = name, kid = %issued.kid, "delivered credentials");
                sent.insert(target.clone(), issued);
            }
            Write::RemoveSecret { namespace } => {
                self.cluster.delete_secret(namespace, plan::NAMESPACE_SECRET).await?;
                info!(%namespace, "namespace left shared supervision: removed its token Secret");
                // Labelled again later, it needs a new one at once.
                sent.remove(&Target::Namespace(namespace.clone()));
                self.shared.with(|index| index.forget_unlabelled(namespace));
            }
            Write::Withdraw { route, uid, cause } => {
                if !self.replica.store.withdraw_instance(route, uid, None).await? {
                    return Ok(());
                }
                self.replica.wake.notify_one();
                match cause {
                    plan::Cause::PodGone => info!(%route, %uid, "the instance's Pod is gone: withdrawn"),
                    plan::Cause::PodFinished => info!(%route, %uid, "the instance's Pod finished: withdrawn"),
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Cluster(#[from] super::cluster::Error),
    #[error(transparent)]
    Token(#[from] crate::tokens::Error),
    #[error(transparent)]
    Store(#[from] crate::store::Error),
}
