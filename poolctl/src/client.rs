//! The operator client: one gateway of the list at a time (the next one when a call cannot
//! reach it or a watch stream breaks), every call bounded, the token sent as sensitive
//! metadata (never logged or printed).

use std::time::Duration;

use plumbing::gateway::Gateways;
use plumbing::token::Token;
use proto::pool::v1::Operation;
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::watch_supervisor_pool_response::Event;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, GetSupervisorPoolStatusRequest, GetSupervisorPoolStatusResponse,
    OperationKind, OperationPlan, StartSupervisorPoolOperationRequest, WatchSupervisorPoolRequest,
    WatchSupervisorPoolResponse,
};
use proto::timing;
use tonic::transport::Channel;

use crate::cli::{Connection, RunArgs};
use crate::exit::{Error, worth_reconnecting};

/// Bound on connecting to a gateway and on each call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A connected operator client.
pub struct Client {
    pool: SupervisorPoolClient<Channel>,
    token: Token,
    /// The gateway in use is the current one.
    gateways: Gateways,
}

impl Client {
    /// Read the token and connect to the first of the gateways that answers.
    pub async fn connect(connection: &Connection) -> Result<Self, Error> {
        if connection.gateway.endpoints().is_empty() {
            return Err(Error::Usage(
                "no gateway: give --gateway (or OPENSHELL_GATEWAY_ENDPOINTS)".into(),
            ));
        }
        let path = connection.token_file.as_ref().ok_or_else(|| {
            Error::Usage("no operator token: give --token-file (or OPENSHELL_OPERATOR_TOKEN_FILE)".into())
        })?;
        let token = plumbing::token::read(path).await?;
        token.bearer().map_err(|_| Error::TokenFormat)?;
        let gateways = Gateways::new(&connection.gateway.gateway_endpoints, connection.gateway.tls());
        let channel = gateways.connect(CALL_TIMEOUT).await.map_err(connect_error)?;
        Ok(Self {
            pool: SupervisorPoolClient::new(channel),
            token,
            gateways,
        })
    }

    /// Move to the next gateway of the list that answers (the one in use last).
    async fn reconnect(&mut self) -> Result<(), Error> {
        self.gateways.skip();
        let channel = self.gateways.connect(CALL_TIMEOUT).await.map_err(connect_error)?;
        self.pool = SupervisorPoolClient::new(channel);
        Ok(())
    }

    /// The gateway in use.
    pub fn endpoint(&self) -> &str {
        self.gateways.current()
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        // Checked when the client was made: the header is valid.
        let _ = self.token.authorize(&mut request);
        request
    }

    fn unary<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = self.request(message);
        request.set_timeout(CALL_TIMEOUT);
        request
    }

    /// The pool status, from a fresh read of the gateway's records.
    pub async fn status(&mut self) -> Result<GetSupervisorPoolStatusResponse, Error> {
        let request = self.unary(GetSupervisorPoolStatusRequest {});
        let call = self.pool.get_supervisor_pool_status(request);
        Ok(bounded(call).await?.into_inner())
    }

    fn start_request(
        &self,
        kind: OperationKind,
        target: &str,
        run: &RunArgs,
        dry_run: bool,
    ) -> tonic::Request<StartSupervisorPoolOperationRequest> {
        self.unary(StartSupervisorPoolOperationRequest {
            kind: kind as i32,
            target: target.to_owned(),
            max_parallel: run.max_parallel,
            timeout_ms: run.timeout_secs.saturating_mul(1000),
            dry_run,
        })
    }

    /// Start an operation: it, and whether it is new (false: an equivalent one was running).
    pub async fn start(
        &mut self,
        kind: OperationKind,
        target: &str,
        run: &RunArgs,
    ) -> Result<(Operation, bool), Error> {
        let request = self.start_request(kind, target, run, false);
        let answer = bounded(self.pool.start_supervisor_pool_operation(request))
            .await?
            .into_inner();
        let op = answer
            .operation
            .ok_or_else(|| tonic::Status::internal("the gateway answered without the operation"))?;
        Ok((op, answer.created))
    }

    /// A dry run: the moves the operation would make; nothing is recorded.
    pub async fn plan(&mut self, kind: OperationKind, target: &str, run: &RunArgs) -> Result<OperationPlan, Error> {
        let request = self.start_request(kind, target, run, true);
        let answer = bounded(self.pool.start_supervisor_pool_operation(request))
            .await?
            .into_inner();
        Ok(answer
            .plan
            .ok_or_else(|| tonic::Status::internal("the gateway answered a dry run without a plan"))?)
    }

    /// The stored decisions of Pod `namespace/name` after `after` and made at or after `since_ms`.
    pub async fn audit(
        &mut self,
        namespace: &str,
        name: &str,
        after: u64,
        since_ms: i64,
    ) -> Result<Vec<proto::pool::v1::AuditEntry>, Error> {
        let request = self.unary(proto::pool::v1::ListAuditRequest {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            after_sequence: after,
            since_ms,
            limit: 1000,
        });
        Ok(bounded(self.pool.list_audit(request)).await?.into_inner().entries)
    }

    pub async fn cancel(&mut self, id: &str) -> Result<Operation, Error> {
        let request = self.unary(CancelSupervisorPoolOperationRequest { id: id.to_owned() });
        let answer = bounded(self.pool.cancel_supervisor_pool_operation(request))
            .await?
            .into_inner();
        Ok(answer
            .operation
            .ok_or_else(|| tonic::Status::internal("the gateway answered without the operation"))?)
    }

    /// Follow operation `id` on the status stream until it ends (see [`crate::progress::follow`]).
    pub async fn wait(&mut self, id: &str, progress: &mut crate::Progress) -> Result<Operation, Error> {
        crate::progress::follow(&mut self.watch(), id, progress).await
    }

    /// Follow the pool status as the gateways stream it.
    pub fn watch(&mut self) -> Statuses<'_> {
        Statuses {
            client: self,
            stream: None,
            failures: 0,
        }
    }
}

/// The pool statuses a gateway streams; when a stream breaks (or its gateway shuts down) the
/// next gateway of the list takes over after a jittered backoff, up to
/// [`timing::RECONNECT_ATTEMPTS`] times in a row per gateway of the list.
pub struct Statuses<'a> {
    client: &'a mut Client,
    stream: Option<tonic::Streaming<WatchSupervisorPoolResponse>>,
    failures: u32,
}

impl Statuses<'_> {
    /// The next status (the first one is the status at the time of the call).
    pub async fn next(&mut self) -> Result<GetSupervisorPoolStatusResponse, Error> {
        loop {
            let outcome = match self.stream.as_mut() {
                None => self.open().await.map(|()| None),
                Some(stream) => match tokio::time::timeout(timing::WATCH_SILENCE_TIMEOUT, stream.message()).await {
                    Ok(Ok(Some(message))) => Ok(match message.event {
                        Some(Event::Status(status)) => Some(status),
                        Some(Event::Keepalive(_)) | None => None,
                    }),
                    Ok(Ok(None)) => Err(tonic::Status::unavailable("the gateway ended the stream")),
                    Ok(Err(status)) => Err(status),
                    Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                        "nothing heard for {} s",
                        timing::WATCH_SILENCE_TIMEOUT.as_secs()
                    ))),
                },
            };
            match outcome {
                Ok(Some(status)) => {
                    self.failures = 0;
                    return Ok(status);
                }
                Ok(None) => {}
                Err(status) => self.broken(status).await?,
            }
        }
    }

    async fn open(&mut self) -> Result<(), tonic::Status> {
        let request = self.client.request(WatchSupervisorPoolRequest {});
        let stream = tokio::time::timeout(CALL_TIMEOUT, self.client.pool.watch_supervisor_pool(request))
            .await
            .map_err(|_| tonic::Status::deadline_exceeded("the gateway did not answer the watch"))??;
        self.stream = Some(stream.into_inner());
        Ok(())
    }

    /// The stream broke with `status`: give up, or wait and move to the next gateway.
    async fn broken(&mut self, status: tonic::Status) -> Result<(), Error> {
        self.stream = None;
        if !worth_reconnecting(status.code()) {
            return Err(Error::Call(status));
        }
        let gateways = u32::try_from(self.client.gateways.endpoints().len()).unwrap_or(u32::MAX);
        let budget = timing::RECONNECT_ATTEMPTS.saturating_mul(gateways);
        let mut last = format!("{}: {}", self.client.endpoint(), status.message());
        loop {
            if self.failures >= budget {
                return Err(Error::StreamLost(last));
            }
            tokio::time::sleep(timing::reconnect_backoff(self.failures)).await;
            self.failures += 1;
            match self.client.reconnect().await {
                Ok(()) => return Ok(()),
                Err(err) => last = err.to_string(),
            }
        }
    }
}

/// A unary call within [`CALL_TIMEOUT`].
async fn bounded<T>(
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<tonic::Response<T>, tonic::Status> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| tonic::Status::deadline_exceeded("the gateway did not answer in time"))?
}

/// No gateway of the list answered.
fn connect_error(err: plumbing::gateway::DialError) -> Error {
    match err {
        plumbing::gateway::DialError::NoEndpoints => Error::Connect("no gateway endpoints".into()),
        plumbing::gateway::DialError::Unreachable(errors) => Error::Connect(errors),
    }
}
