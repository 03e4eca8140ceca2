//! The member's client of the gateway's `recovery.v1.SupervisorRecovery` service (the
//! single-use IssueGrant and Activate calls, and the trust bundle) and of
//! `host.v1.SupervisorHost.RecordAudit` (idempotent: the gateway keeps each record once).
//!
//! Single use (recovery.proto "Retry rule"): a call is processed at most once. Reaching a
//! replica is retried (over the endpoints in turn, each bounded by
//! [`timing::CONNECT_TIMEOUT`], the CA bundle read again for each, and again with backoff for
//! [`REACH_BUDGET`] while none answers), because nothing was sent yet; so is a call the
//! replica provably never processed ([`never_processed`](plumbing::gateway::never_processed):
//! a replica shutting down refused its stream), on the next replica, each replica once (twice
//! with one endpoint: a Service). Any other error once the request is
//! on the wire, including a lost response or [`CALL_TIMEOUT`], is final and the caller reports
//! the instance FAILED for that term.

use std::path::PathBuf;
use std::time::Duration;

use plumbing::gateway::{DialError, Gateways, never_processed};

use plumbing::tls::ClientTls;
use proto::host::v1::supervisor_host_client::SupervisorHostClient;
use proto::host::v1::{RecordAuditRequest, RecordAuditResponse};
use proto::recovery::v1::supervisor_recovery_client::SupervisorRecoveryClient;
use proto::recovery::v1::{
    ActivateRequest, ActivationProof, IssueGrantRequest, IssueGrantResponse, TrustBundleRequest, TrustBundleResponse,
};
use proto::timing;
use tonic::transport::Channel;
use tracing::{debug, warn};

use crate::config::{self, TokenError};

/// Bound on one recovery call once connected (request sent to response received).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call keeps trying to reach a replica while none answers (nothing sent yet): a
/// rollout of the gateways can leave the Service without a replica for a few seconds.
pub const REACH_BUDGET: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Unreachable(#[from] DialError),
    #[error("the token: {0}")]
    Header(#[from] plumbing::token::TokenError),
    #[error("no response within {0:?}")]
    Timeout(Duration),
    #[error("{code:?}: {message}", code = .0.code(), message = .0.message())]
    Status(#[from] tonic::Status),
    #[error("invalid answer: {0}")]
    Invalid(&'static str),
}

/// The gateway replicas, how they are verified and the supervisor token file; shared by every
/// session.
#[derive(Debug)]
pub(crate) struct Gateway {
    gateways: Gateways,
    token_file: Option<PathBuf>,
}

impl Gateway {
    pub(crate) fn new(endpoints: Vec<String>, token_file: Option<PathBuf>, tls: ClientTls) -> Self {
        Self {
            gateways: Gateways::new(&endpoints, tls),
            token_file,
        }
    }

    /// recovery.v1.IssueGrant, processed at most once.
    pub(crate) async fn issue_grant(&self, request: IssueGrantRequest) -> Result<IssueGrantResponse, CallError> {
        let response = self
            .send("IssueGrant", request, |channel, request| async move {
                recovery(channel).issue_grant(request).await
            })
            .await?;
        if response.grant.is_empty() || response.grant.len() > proto::trust::MAX_TOKEN_BYTES {
            return Err(CallError::Invalid("the grant is empty or oversized"));
        }
        Ok(response)
    }

    /// recovery.v1.Activate, processed at most once.
    pub(crate) async fn activate(&self, request: ActivateRequest) -> Result<ActivationProof, CallError> {
        let activation = self
            .send("Activate", request, |channel, request| async move {
                recovery(channel).activate(request).await
            })
            .await?
            .activation
            .ok_or(CallError::Invalid("no activation"))?;
        if activation.proof.is_empty() || activation.proof.len() > proto::trust::MAX_TOKEN_BYTES {
            return Err(CallError::Invalid("the activation proof is empty or oversized"));
        }
        Ok(activation)
    }

    /// recovery.v1.TrustBundle (idempotent, so the caller may ask again later).
    pub(crate) async fn trust_bundle(&self) -> Result<TrustBundleResponse, CallError> {
        self.send("TrustBundle", TrustBundleRequest {}, |channel, request| async move {
            recovery(channel).trust_bundle(request).await
        })
        .await
    }

    /// host.v1.RecordAudit: stores a sidecar's audit records (idempotent).
    pub(crate) async fn record_audit(&self, request: RecordAuditRequest) -> Result<RecordAuditResponse, CallError> {
        self.send("RecordAudit", request, |channel, request| async move {
            SupervisorHostClient::new(channel)
                .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(proto::MAX_MESSAGE_BYTES)
                .record_audit(request)
                .await
        })
        .await
    }

    /// Sends `message` with `call` to the first reachable replica, starting after the one used
    /// last; when that replica provably did not process it, to the next one — each endpoint
    /// once, and with one endpoint (a Service in front of the replicas) once more, on a new
    /// connection, which the Service sends to a replica that is not shutting down.
    async fn send<T, R, F, Fut>(&self, rpc: &str, message: T, call: F) -> Result<R, CallError>
    where
        T: Clone,
        F: Fn(Channel, tonic::Request<T>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let mut attempts_left = self.gateways.endpoints().len().max(2);
        let reaching = tokio::time::Instant::now();
        let mut unreached = 0;
        loop {
            let (channel, index, request) = match self.connect(message.clone()).await {
                Ok(connected) => connected,
                Err(CallError::Unreachable(err)) if reaching.elapsed() < REACH_BUDGET => {
                    let wait =
                        timing::reconnect_backoff(unreached).min(REACH_BUDGET.saturating_sub(reaching.elapsed()));
                    unreached += 1;
                    debug!(rpc, error = %err, "no gateway replica reachable; trying again (nothing was sent)");
                    tokio::time::sleep(wait).await;
                    continue;
                }
                Err(err) => return Err(err),
            };
            attempts_left -= 1;
            match bounded(call(channel, request)).await {
                Err(CallError::Status(status)) if attempts_left > 0 && never_processed(&status) => {
                    warn!(rpc, replica = %self.gateways.endpoints()[index], error = %status.message(),
                        "the gateway replica did not process the call (shutting down?): sending it again elsewhere");
                    self.gateways.skip_past(index);
                }
                outcome => return outcome,
            }
        }
    }

    /// Reads the token and connects to the first reachable replica, starting after the one
    /// used last: the channel and the replica's index. Nothing has been sent when this fails.
    async fn connect<T>(&self, message: T) -> Result<(Channel, usize, tonic::Request<T>), CallError> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(CALL_TIMEOUT);
        if let Some(path) = &self.token_file {
            config::read_token(path).await?.authorize(&mut request)?;
        }
        let (channel, index) = self.gateways.connect_to_one(timing::CONNECT_TIMEOUT).await?;
        Ok((channel, index, request))
    }
}

fn recovery(channel: Channel) -> SupervisorRecoveryClient<Channel> {
    SupervisorRecoveryClient::new(channel)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES)
}

async fn bounded<T>(call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>) -> Result<T, CallError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(response) => Ok(response?.into_inner()),
        Err(_) => Err(CallError::Timeout(CALL_TIMEOUT)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::recovery::v1::supervisor_recovery_server::{SupervisorRecovery, SupervisorRecoveryServer};
    use proto::recovery::v1::{ActivateResponse, IssueGrantResponse};
    use tonic::{Request, Response, Status};

    struct Bundle;

    #[tonic::async_trait]
    impl SupervisorRecovery for Bundle {
        async fn issue_grant(&self, _: Request<IssueGrantRequest>) -> Result<Response<IssueGrantResponse>, Status> {
            Err(Status::unimplemented("not here"))
        }
        async fn activate(&self, _: Request<ActivateRequest>) -> Result<Response<ActivateResponse>, Status> {
            Err(Status::unimplemented("not here"))
        }
        async fn trust_bundle(&self, _: Request<TrustBundleRequest>) -> Result<Response<TrustBundleResponse>, Status> {
            Ok(Response::new(TrustBundleResponse {
                issuer: "test".into(),
                ..TrustBundleResponse::default()
            }))
        }
    }

    #[tokio::test]
    async fn a_replica_unreachable_for_a_moment_is_tried_again_within_the_budget() {
        // The only endpoint (a Service) first drops the connection it accepted, before the
        // TLS handshake — no replica behind it, as for a moment in a rollout of the gateways —
        // then serves: the call, never sent the first time, goes through.
        let dir = tempfile::tempdir().unwrap();
        let ca = testkit::pki::Ca::new();
        let ca_file = ca.write(dir.path().join("ca.crt"));
        let (cert, key) = ca.leaf(&["gateway.test"]).write(dir.path(), "gateway");
        let store = std::sync::Arc::new(plumbing::tls::CertStore::new(cert, key));
        store.reload().unwrap();
        let server_tls = plumbing::tls::server_config(store, &[b"h2"]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("https://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (first, _) = listener.accept().await.unwrap();
            drop(first);
            let router = tonic::transport::Server::builder().add_service(SupervisorRecoveryServer::new(Bundle));
            let listener = plumbing::listener::Listener::new(listener, Default::default(), Default::default())
                .with_tls(Some(server_tls));
            plumbing::listener::serve_grpc(router, listener, std::future::pending()).await
        });
        let tls = ClientTls {
            ca: Some(ca_file),
            server_name: Some("gateway.test".into()),
            dialer: None,
        };
        let gateway = Gateway::new(vec![endpoint], None, tls);
        let answer = gateway.trust_bundle().await;
        server.abort();
        assert!(answer.is_ok(), "{answer:?}");
    }
}
