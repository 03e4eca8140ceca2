//! One pool member process: binds the runtime listener (so the advertised address is real),
//! attaches to the gateway and hosts sessions until it leaves or is superseded.

use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use proto::runtime::v1::supervisor_runtime_server::{SupervisorRuntime, SupervisorRuntimeServer};
use proto::runtime::v1::{SidecarMessage, SupervisorMessage};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::config::{Config, ConfigError};
use crate::link::{Identity, Link, LinkError};
use crate::sessions::SessionSet;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen for sidecars on {address} (OPENSHELL_SUPERVISOR_RUNTIME_LISTEN): {source}")]
    Listen { address: String, source: std::io::Error },
    #[error(transparent)]
    Link(#[from] LinkError),
}

/// Runs a member until it has left the pool. The first cancellation of `shutdown` is the
/// graceful shutdown: the member announces Leaving and keeps hosting until the gateway's
/// snapshot omits its instances or [`LEAVE_BOUND`](crate::LEAVE_BOUND) passes. Exiting never
/// stops a workload. Errors: invalid configuration (naming the setting), a refused hello,
/// or another process taking this member's name.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let listen_error = |source| Error::Listen {
        address: config.runtime_listen.to_string(),
        source,
    };
    let listener = TcpListener::bind(config.runtime_listen).await.map_err(listen_error)?;
    let bound = listener.local_addr().map_err(listen_error)?;
    let identity = Identity {
        member: config.member.clone(),
        process_id: uuid::Uuid::new_v4().to_string(),
        runtime_address: config.runtime_address_for(bound)?,
        capacity: config.capacity,
        started_at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
    };
    let span = tracing::info_span!("member", member = %identity.member, process_id = %identity.process_id);
    span.in_scope(
        || tracing::info!(runtime_address = %identity.runtime_address, capacity = identity.capacity, "member starting"),
    );

    let stop_runtime = CancellationToken::new();
    tokio::spawn(serve_runtime(listener, stop_runtime.clone()).instrument(span.clone()));

    let mut sessions = SessionSet::new(&identity.member, identity.capacity);
    let endpoints = config.endpoints().into_iter().map(str::to_owned).collect();
    let link = Link::new(identity, endpoints, config.token_file.clone(), shutdown);
    let result = link.run(&mut sessions).instrument(span.clone()).await;
    sessions.abandon();
    stop_runtime.cancel();
    span.in_scope(|| match &result {
        Ok(()) => tracing::info!("member left the pool"),
        Err(err) => tracing::error!(%err, "member exiting"),
    });
    Ok(result?)
}

/// The sidecar-facing runtime.v1 service. The listener is real so the advertised address is;
/// the protocol (attach, takeover, relay) arrives with the sidecar.
async fn serve_runtime(listener: TcpListener, stop: CancellationToken) {
    let service = SupervisorRuntimeServer::new(RuntimeService)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    let served = tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned())
        .await;
    if let Err(err) = served {
        tracing::error!(%err, "runtime service failed");
    }
}

struct RuntimeService;

type SupervisorStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<SupervisorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl SupervisorRuntime for RuntimeService {
    type ConnectStream = SupervisorStream;

    async fn connect(
        &self,
        _request: Request<Streaming<SidecarMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        Err(Status::unimplemented("this member does not serve runtime.v1 yet"))
    }
}
