//! Stand-ins for the Kubernetes API in these tests (never in the gateway itself): a cluster
//! that reports each call the writers make on a channel ([`Recording`]), and a token review
//! that takes scripted tokens ([`Scripted`]). The real API calls are tested against captured
//! answers in `tests/kube_api.rs` and on the real cluster.

use gateway::kubernetes::Cluster;
use gateway::kubernetes::cluster::Error;
use gateway::kubernetes::index::Pod;
use gateway::kubernetes::notice::Notice;
use gateway::kubernetes::operation_reconcile::OperationNotice;
use gateway::kubernetes::policy_status::PolicyStatus;
use gateway::kubernetes::pool_operation::OperationStatus;
use gateway::kubernetes::pool_status::PoolStatus;
use gateway::kubernetes::review::{Account, Error as ReviewError, Review, Source};
use gateway::kubernetes::supervised::Supervised;
use gateway::tokens::Delivered;
use tokio::sync::mpsc;

/// One call the writer made, as [`Recording`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    ApplySecret {
        namespace: String,
        name: String,
        delivered: Delivered,
    },
    DeleteSecret {
        namespace: String,
        name: String,
    },
    Publish(Notice),
    ApplyPoolStatus {
        namespace: String,
        name: String,
        status: Box<PoolStatus>,
    },
    ApplyPolicyStatus {
        namespace: String,
        name: String,
        status: PolicyStatus,
    },
    SetOperationFinalizers {
        name: String,
        finalizers: Vec<String>,
    },
    ApplyOperationStatus {
        name: String,
        status: Box<OperationStatus>,
    },
    PublishOperation(OperationNotice),
    SetSupervised {
        pod: Pod,
        condition: Supervised,
    },
    ReplacePoolStatus {
        resource_version: String,
        status: Box<PoolStatus>,
    },
}

/// A cluster that only reports each call on a channel (tests read the intended writes off
/// it; no API mock needed).
#[derive(Clone)]
pub struct Recording {
    calls: mpsc::UnboundedSender<Call>,
    /// Namespaces whose writes are refused as the API server refuses them in a namespace
    /// being deleted.
    terminating: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    /// The pool status last written and how many writes it took (its `resourceVersion`).
    pool: std::sync::Arc<std::sync::Mutex<(u64, Option<PoolStatus>)>>,
}

impl Recording {
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Call>) {
        let (calls, rx) = mpsc::unbounded_channel();
        let terminating = std::sync::Arc::default();
        let pool = std::sync::Arc::default();
        (
            Self {
                calls,
                terminating,
                pool,
            },
            rx,
        )
    }

    /// Replace the pool status as another writer would.
    pub fn set_pool_status(&self, status: PoolStatus) {
        let mut pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *pool = (pool.0 + 1, Some(status));
    }

    /// From now on, refuse writes in `namespace` as in a terminating namespace (the call is
    /// still reported).
    pub fn terminate(&self, namespace: &str) {
        self.terminating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(namespace.to_owned());
    }

    fn refuses(&self, namespace: &str) -> Result<(), Error> {
        let terminating = self
            .terminating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(namespace);
        if terminating {
            Err(Error::NamespaceTerminating(namespace.to_owned()))
        } else {
            Ok(())
        }
    }

    fn send(&self, call: Call) {
        // The test dropped its receiver: nothing to report to.
        let _ = self.calls.send(call);
    }
}

impl Cluster for Recording {
    async fn apply_secret(&self, namespace: &str, name: &str, delivered: &Delivered) -> Result<(), Error> {
        self.send(Call::ApplySecret {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            delivered: delivered.clone(),
        });
        self.refuses(namespace)
    }

    async fn delete_secret(&self, namespace: &str, name: &str) -> Result<(), Error> {
        self.send(Call::DeleteSecret {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        });
        Ok(())
    }

    async fn publish(&self, notice: &Notice) -> Result<(), Error> {
        self.send(Call::Publish(notice.clone()));
        self.refuses(&notice.regarding.namespace)
    }

    async fn publish_distinct(&self, notice: &Notice) -> Result<(), Error> {
        self.send(Call::Publish(notice.clone()));
        self.refuses(&notice.regarding.namespace)
    }

    async fn apply_pool_status(&self, namespace: &str, name: &str, status: &PoolStatus) -> Result<(), Error> {
        self.send(Call::ApplyPoolStatus {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            status: Box::new(status.clone()),
        });
        self.refuses(namespace)?;
        self.set_pool_status(status.clone());
        Ok(())
    }

    async fn apply_policy_status(&self, namespace: &str, name: &str, status: &PolicyStatus) -> Result<(), Error> {
        self.send(Call::ApplyPolicyStatus {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            status: status.clone(),
        });
        self.refuses(namespace)
    }

    async fn read_pool_status(&self, _namespace: &str, _name: &str) -> Result<Option<(String, PoolStatus)>, Error> {
        let pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(pool.1.clone().map(|status| (pool.0.to_string(), status)))
    }

    async fn replace_pool_status(
        &self,
        _namespace: &str,
        _name: &str,
        resource_version: &str,
        status: &PoolStatus,
    ) -> Result<bool, Error> {
        self.send(Call::ReplacePoolStatus {
            resource_version: resource_version.to_owned(),
            status: Box::new(status.clone()),
        });
        let mut pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if pool.0.to_string() != resource_version {
            return Ok(false);
        }
        *pool = (pool.0 + 1, Some(status.clone()));
        Ok(true)
    }

    async fn set_operation_finalizers(
        &self,
        _namespace: &str,
        name: &str,
        _resource_version: &str,
        finalizers: &[String],
    ) -> Result<(), Error> {
        self.send(Call::SetOperationFinalizers {
            name: name.to_owned(),
            finalizers: finalizers.to_vec(),
        });
        Ok(())
    }

    async fn apply_operation_status(
        &self,
        _namespace: &str,
        name: &str,
        status: &OperationStatus,
    ) -> Result<(), Error> {
        self.send(Call::ApplyOperationStatus {
            name: name.to_owned(),
            status: Box::new(status.clone()),
        });
        Ok(())
    }

    async fn publish_operation(&self, _namespace: &str, notice: &OperationNotice) -> Result<(), Error> {
        self.send(Call::PublishOperation(notice.clone()));
        Ok(())
    }

    async fn set_supervised(&self, pod: &Pod, condition: &Supervised, _since: &str) -> Result<(), Error> {
        self.send(Call::SetSupervised {
            pod: pod.clone(),
            condition: condition.clone(),
        });
        Ok(())
    }
}

/// A stand-in for tests without an API server: a token `sa:<namespace>:<account>:<pod>:<uid>`
/// is that Pod's; anything else is refused.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scripted;

impl Scripted {
    /// The token [`Scripted`] takes for `account`.
    pub fn token(account: &Account) -> String {
        format!(
            "sa:{}:{}:{}:{}",
            account.namespace, account.service_account, account.pod_name, account.pod_uid
        )
    }
}

#[async_trait::async_trait]
impl Review for Scripted {
    async fn review(&self, token: &str, _source: Source) -> Result<Account, ReviewError> {
        let parts: Vec<&str> = token.split(':').collect();
        match parts.as_slice() {
            ["sa", namespace, account, pod, uid] => Ok(Account {
                namespace: (*namespace).to_owned(),
                service_account: (*account).to_owned(),
                pod_name: (*pod).to_owned(),
                pod_uid: (*uid).to_owned(),
            }),
            _ => Err(ReviewError::Refused("not a scripted token".into())),
        }
    }
}
