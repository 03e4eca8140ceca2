//! Kubernetes integration (only with `--kubernetes`): the watches feed an in-memory
//! [`index`] on every replica; the coordinator's [`writer`] turns it and the pool view into
//! token Secrets in every labelled namespace, withdrawals of instances whose Pod is gone or
//! finished, events.k8s.io Events ([`notice`], [`denials`]) and the Pods' `Supervised` condition
//! ([`supervised`]). Decisions ([`plan`], [`notice`]) are pure; the API is
//! behind [`cluster::Cluster`].
//!
//! | module | owns |
//! | --- | --- |
//! | `index` | labelled namespaces, supervised Pods (finished ones apart), Pods admitted unsupervised; plain data |
//! | `watch` | the namespace, Pod, supervisor Pod and token Secret watches that feed the index |
//! | `plan` | which Secrets to write or remove, which instances to withdraw (Pod gone or finished) |
//! | `notice` | which Events a change of the pool view makes |
//! | `egress` | the `SandboxPolicy` objects and which one each supervised Pod runs, with its credentials' values; plain data |
//! | `bound_secrets` | reads the Secrets those policies bind, by name, into `egress` |
//! | `denials` | which `EgressDenied` Events the denials stored in the audit trail make |
//! | `denial_writer` | publishes them while the lease is held, every 5 s |
//! | `supervised` | the Pod condition `supervision.openshell.ai/Supervised` each Pod should carry |
//! | `cluster` | the API calls (kube-rs), behind the `Cluster` trait |
//! | `writer` | carries out the plan while the lease is held |
//! | `pool_status` | the `SupervisorPool` object's status: coordinator, members, counts, operations, conditions |
//! | `pool_writer` | applies that status while the lease is held, at most once a second and only when it changed |
//! | `policy_status` | each `SandboxPolicy`'s status: its revision, the Pods that run it, loaded per revision, refusals |
//! | `policy_writer` | applies those statuses while the lease is held, each only when it changed |
//! | `pool_operation` | the `SupervisorPoolOperation` object as plain data, its status shape |
//! | `operation_reconcile` | pure: what to do about those objects (start, cancel on deletion, finalizer, status, Events) |
//! | `operation_writer` | carries that out while the lease is held, once a second |

pub mod bound_secrets;
pub mod cluster;
pub mod denial_writer;
pub mod denials;
pub mod egress;
pub mod index;
pub mod notice;
pub mod operation_reconcile;
pub mod operation_writer;
pub mod plan;
pub mod policy_status;
pub mod policy_writer;
pub mod pool_operation;
pub mod pool_status;
pub mod pool_writer;
pub mod review;
pub mod supervised;
pub mod watch;
pub mod writer;

use std::sync::Arc;

use tokio::sync::watch as channel;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::replica::Replica;
use crate::store::Lease;

pub use cluster::{Absent, Cluster, Kube};
pub use index::Shared;
pub use plan::Scope;

/// Why the integration could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot reach the Kubernetes API (in-cluster config or KUBECONFIG): {0}")]
    Client(#[from] kube::Error),
}

/// The connection to a cluster: what writes and the index it reads.
pub struct Integration<C> {
    pub cluster: C,
    pub shared: Shared,
    pub scope: Scope,
    /// Reviews the ServiceAccount tokens of sidecars and members.
    pub review: Arc<dyn review::Review>,
}

impl Integration<Kube> {
    /// Connect with the in-cluster configuration (or `KUBECONFIG`) and start following
    /// namespaces, Pods and the token Secrets; the watches stop with `shutdown`.
    pub async fn connect(
        scope: Scope,
        instance: &str,
        audience: &str,
        shutdown: &CancellationToken,
    ) -> Result<(Self, Vec<JoinHandle<()>>), Error> {
        let client = kube::Client::try_default().await?;
        let shared = Shared::default();
        let tasks = vec![
            tokio::spawn(watch::namespaces(client.clone(), shared.clone(), shutdown.clone())),
            tokio::spawn(watch::pods(client.clone(), shared.clone(), shutdown.clone())),
            tokio::spawn(watch::finished_pods(client.clone(), shared.clone(), shutdown.clone())),
            tokio::spawn(watch::unsupervised_pods(
                client.clone(),
                shared.clone(),
                shutdown.clone(),
            )),
            tokio::spawn(watch::secrets(client.clone(), shared.clone(), shutdown.clone())),
            tokio::spawn(watch::policies(client.clone(), shared.clone(), shutdown.clone())),
            tokio::spawn(bound_secrets::follow(client.clone(), shared.clone(), shutdown.clone())),
            tokio::spawn(watch::member_pods(
                client.clone(),
                scope.install_namespace.clone(),
                shared.clone(),
                shutdown.clone(),
            )),
            tokio::spawn(watch::operation_objects(
                client.clone(),
                scope.install_namespace.clone(),
                shared.clone(),
                shutdown.clone(),
            )),
        ];
        let integration = Self {
            cluster: Kube::new(client.clone(), instance)
                .owned_by(&scope.install_namespace)
                .await,
            shared,
            scope,
            review: Arc::new(review::Kube::new(client, audience)),
        };
        Ok((integration, tasks))
    }
}

impl<C: Cluster + Clone> Integration<C> {
    /// Spawn the writers (token Secrets, Events and withdrawals; the `SupervisorPool`
    /// status; the `SupervisorPoolOperation` objects; the `SandboxPolicy` statuses; the
    /// `EgressDenied` Events): they act
    /// while `lease` is held. The handle ends when all did.
    pub fn spawn_writer(
        self,
        replica: Arc<Replica>,
        lease: channel::Receiver<Option<Lease>>,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        let pool = pool_writer::PoolWriter {
            cluster: self.cluster.clone(),
            replica: replica.clone(),
            namespace: self.scope.install_namespace.clone(),
            shared: self.shared.clone(),
        };
        let pool = tokio::spawn(pool.run(lease.clone(), shutdown.clone()));
        let operations = operation_writer::OperationWriter {
            cluster: self.cluster.clone(),
            shared: self.shared.clone(),
            replica: replica.clone(),
            namespace: self.scope.install_namespace.clone(),
        };
        let operations = tokio::spawn(operations.run(lease.clone(), shutdown.clone()));
        let policies = policy_writer::PolicyWriter {
            cluster: self.cluster.clone(),
            replica: replica.clone(),
            shared: self.shared.clone(),
        };
        let policies = tokio::spawn(policies.run(lease.clone(), shutdown.clone()));
        let denials = denial_writer::DenialWriter {
            cluster: self.cluster.clone(),
            replica: replica.clone(),
        };
        let denials = tokio::spawn(denials.run(lease.clone(), shutdown.clone()));
        let writer = writer::Writer {
            cluster: self.cluster,
            shared: self.shared,
            replica,
            scope: self.scope,
        };
        let writer = tokio::spawn(writer.run(lease, shutdown));
        tokio::spawn(async move {
            let _ = writer.await;
            let _ = pool.await;
            let _ = operations.await;
            let _ = policies.await;
            let _ = denials.await;
        })
    }
}
