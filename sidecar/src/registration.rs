//! The instance's registration with the gateway's instance registry (registry.v1): Register,
//! Deregister and ReportRecoveryFailed, called with the mounted token (the Pod's
//! ServiceAccount token in Kubernetes, the route's bootstrap token locally). Every call
//! is bounded in time and retried with backoff over the gateway endpoints in turn (the three
//! RPCs are idempotent): Register until it succeeds, Deregister and ReportRecoveryFailed a
//! bounded number of times.

use std::path::PathBuf;
use std::time::Duration;

use plumbing::gateway::{DialError, Gateways};
use plumbing::tls::ClientTls;
use proto::common::v1::WorkloadIdentity;
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest, RegisterRequest, RegisterResponse};
use proto::timing::{CONNECT_TIMEOUT, reconnect_backoff};
use tokio::sync::mpsc;
use tokio::time::timeout;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tracing::warn;

use crate::supervision::read_token;

/// Half the time left until `expires_at_ms` (at least a second; an hour when unknown).
fn renewal_delay(expires_at_ms: i64) -> Duration {
    let now_ms = proto::trust::unix_ms(std::time::SystemTime::now());
    let left_ms = u64::try_from(expires_at_ms.saturating_sub(now_ms)).unwrap_or(0);
    match expires_at_ms {
        0 => Duration::from_secs(3600),
        _ => Duration::from_millis((left_ms / 2).max(1000)),
    }
}

/// Bound on one registry call (connect excluded).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts for Deregister and ReportRecoveryFailed before giving up.
pub const FINAL_CALL_ATTEMPTS: u32 = 8;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error("{0}")]
    Token(#[from] crate::supervision::Error),
    #[error("{0} timed out")]
    Timeout(&'static str),
    #[error("{0} refused: {1:?} {2}")]
    Status(&'static str, tonic::Code, String),
    #[error("gave up after {0} attempts, last: {1}")]
    GaveUp(u32, Box<Error>),
}

/// Where the instance stands, for a registry that may have lost it (its store emptied, or
/// restored from an older backup): the term the fence activated and the workload. Sent with
/// every registration from then on (`RegisterRequest.fence_term`, `workload`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Standing {
    pub fence_term: u64,
    /// The member process that activated `fence_term`, while the fence holds it
    /// ([`crate::fence::Fence::holder`]).
    pub holder: Option<crate::fence::Presenter>,
    pub workload: Option<WorkloadIdentity>,
}

impl Standing {
    /// Where the instance stands by `fence`, with the workload when one was identified.
    pub fn of(fence: &crate::fence::Fence, workload: Option<WorkloadIdentity>) -> Self {
        Self {
            fence_term: fence.activated,
            holder: fence.holder().cloned(),
            workload,
        }
    }

    /// Says it in `request` (`fence_term`, `fence_member`, `fence_process_id`, and the
    /// workload when one was identified).
    pub fn write_into(self, request: &mut RegisterRequest) {
        request.fence_term = self.fence_term;
        let holder = self.holder.unwrap_or_default();
        (request.fence_member, request.fence_process_id) = (holder.member, holder.process_id);
        if self.workload.is_some() {
            request.workload = self.workload;
        }
    }
}

#[derive(Debug)]
pub struct Registration {
    gateways: Gateways,
    supervision_dir: PathBuf,
}

#[derive(Debug, Clone)]
enum Call {
    Register(RegisterRequest),
    Deregister(DeregisterRequest),
    RecoveryFailed(RecoveryFailedRequest),
}

impl Call {
    fn name(&self) -> &'static str {
        match self {
            Call::Register(_) => "Register",
            Call::Deregister(_) => "Deregister",
            Call::RecoveryFailed(_) => "ReportRecoveryFailed",
        }
    }
}

impl Registration {
    /// `endpoints` are verified with `tls` when they are https://.
    pub fn new(endpoints: Vec<String>, tls: ClientTls, supervision_dir: PathBuf) -> Self {
        Self {
            gateways: Gateways::new(&endpoints, tls),
            supervision_dir,
        }
    }

    /// Registers until the gateway answers (the caller bounds it by cancelling).
    pub async fn register(&self, request: RegisterRequest) -> RegisterResponse {
        let call = Call::Register(request);
        let mut attempt = 0u32;
        loop {
            match self.once(&call).await {
                Ok(Some(response)) => return response,
                Ok(None) => {}
                Err(err) => warn!(error = %err, attempt, "registration failed; retrying"),
            }
            tokio::time::sleep(reconnect_backoff(attempt)).await;
            attempt = attempt.saturating_add(1);
        }
    }

    /// Keeps the instance registered until aborted: registers `request`, hands each answer
    /// to `registered`, and registers again (idempotent: same workload, same generation) from
    /// half the instance token's lifetime on, for a new token before the old one expires — or
    /// at once when `again` brings where the instance stands now (a recovering sidecar makes
    /// sure the registry still knows it).
    pub async fn keep_registered(
        self: std::sync::Arc<Self>,
        mut request: RegisterRequest,
        registered: mpsc::Sender<RegisterResponse>,
        mut again: mpsc::Receiver<Standing>,
    ) {
        loop {
            let response = self.register(request.clone()).await;
            let renew_in = renewal_delay(response.instance_token_expires_at_ms);
            // The generation the registry answered is the one to name from now on (a store
            // that lost the instance records it at the one named). Another than the one asked
            // for starts the fence over: it holds no term of that generation.
            let answered = response.instance.as_ref().map_or(0, |i| i.generation);
            let asked = request.instance.as_ref().map_or(0, |i| i.generation);
            if answered != 0 && asked != answered {
                if asked != 0 {
                    Standing::default().write_into(&mut request);
                }
                if let Some(instance) = request.instance.as_mut() {
                    instance.generation = answered;
                }
            }
            if registered.send(response).await.is_err() {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(renew_in) => {}
                Some(standing) = again.recv() => standing.write_into(&mut request),
            }
        }
    }

    pub async fn deregister(&self, request: DeregisterRequest) -> Result<(), Error> {
        self.bounded(Call::Deregister(request)).await
    }

    pub async fn report_recovery_failed(&self, request: RecoveryFailedRequest) -> Result<(), Error> {
        self.bounded(Call::RecoveryFailed(request)).await
    }

    async fn bounded(&self, call: Call) -> Result<(), Error> {
        let mut last = None;
        for attempt in 0..FINAL_CALL_ATTEMPTS {
            match self.once(&call).await {
                Ok(_) => return Ok(()),
                Err(err) => {
                    warn!(error = %err, attempt, call = call.name(), "registry call failed");
                    last = Some(err);
                }
            }
            tokio::time::sleep(reconnect_backoff(attempt)).await;
        }
        let last = last.unwrap_or(Error::Timeout("registry call"));
        Err(Error::GaveUp(FINAL_CALL_ATTEMPTS, Box::new(last)))
    }

    /// One attempt against the next endpoint; `Some` carries a Register answer.
    async fn once(&self, call: &Call) -> Result<Option<RegisterResponse>, Error> {
        // The token first: without one, no connection is worth making.
        let bearer = read_token(&self.supervision_dir)?
            .bearer()
            .map_err(crate::supervision::Error::from)?;
        let mut client = self.client().await?;
        let name = call.name();
        let status = |s: tonic::Status| Error::Status(name, s.code(), plumbing::text::bounded(s.message(), 256));
        let call = async {
            match call.clone() {
                Call::Register(r) => client
                    .register(authorized(r, &bearer))
                    .await
                    .map(|r| Some(r.into_inner()))
                    .map_err(status),
                Call::Deregister(r) => client
                    .deregister(authorized(r, &bearer))
                    .await
                    .map(|_| None)
                    .map_err(status),
                Call::RecoveryFailed(r) => client
                    .report_recovery_failed(authorized(r, &bearer))
                    .await
                    .map(|_| None)
                    .map_err(status),
            }
        };
        let answer = timeout(CALL_TIMEOUT, call).await.map_err(|_| Error::Timeout(name))?;
        if answer.is_err() {
            // The next attempt starts at the next replica.
            self.gateways.skip();
        }
        answer
    }

    async fn client(&self) -> Result<InstanceRegistryClient<Channel>, Error> {
        let channel = self.gateways.connect(CONNECT_TIMEOUT).await?;
        Ok(InstanceRegistryClient::new(channel)
            .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(proto::MAX_MESSAGE_BYTES))
    }
}

fn authorized<T>(message: T, bearer: &MetadataValue<Ascii>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert(proto::AUTHORIZATION_METADATA_KEY, bearer.clone());
    request.set_timeout(CALL_TIMEOUT);
    request
}
