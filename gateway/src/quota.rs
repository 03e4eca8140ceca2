//! Which namespaces may register instances, and how many each may have: a pool is shared by
//! many teams, and one namespace must not take every member's capacity. The limit is the
//! gateway's default (`--namespace-instance-limit`) or, in Kubernetes, the namespace's
//! `supervision.openshell.ai/max-instances` annotation. In Kubernetes only labelled
//! namespaces take part at all. The count itself is taken by the store, in the registering
//! transaction, so a refused registration stores nothing.

use tonic::Status;

use crate::kubernetes::index::Shared;

#[derive(Debug, Clone)]
pub struct Quota {
    /// Instances a namespace may have registered at once unless its annotation says otherwise.
    pub default_limit: u32,
    /// The Kubernetes index: labelled namespaces and their annotated limits.
    pub namespaces: Option<Shared>,
}

impl Quota {
    /// The limit for `namespace`; PERMISSION_DENIED for a namespace that does not take part
    /// (Kubernetes: not labelled, once the namespace watch has listed them).
    pub fn limit(&self, namespace: &str) -> Result<u32, Status> {
        let Some(namespaces) = &self.namespaces else {
            return Ok(self.default_limit);
        };
        namespaces.with(|index| {
            if !index.namespaces_synced() {
                return Err(Status::unavailable("the gateway has not listed the namespaces yet"));
            }
            if !index.is_labelled(namespace) {
                return Err(Status::permission_denied(format!(
                    "namespace {namespace} is not labelled for shared supervision"
                )));
            }
            Ok(index.limit(namespace).unwrap_or(self.default_limit))
        })
    }
}
