//! The member side of `runtime.v1.SupervisorRuntime.Connect` (runtime.proto is the
//! specification): authenticate the sidecar's instance token ([`trust`]), read and validate
//! its first message ([`stream`]), then route the stream ([`route`]): to the session of its
//! instance, a Redirect to the owner named by the route directory, a refusal, or a parked
//! stream (heartbeats) until a newer snapshot allows a decision.

pub mod route;
pub mod stream;
pub mod trust;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::supervisor_runtime_server::{SERVICE_NAME, SupervisorRuntime, SupervisorRuntimeServer};
use proto::runtime::v1::{SidecarMessage, SupervisorMessage, sidecar_message};
use proto::standard::ReflectionError;
use proto::timing;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use self::route::{Decision, Me, RouteTable};
use self::stream::{OUTBOUND_CAPACITY, Opening, SidecarStream};
use self::trust::{AuthError, TrustStore};
use crate::health::Readiness;

/// How long a recovering sidecar's stream waits for a snapshot before it is
/// redirected to the owner of the very term it lost.
const REDIRECT_GRACE: std::time::Duration = timing::RECOVERY_HELLO_INTERVAL;

/// Longest a stream stays parked before it is ended with UNAVAILABLE (the sidecar reconnects).
pub const PARK_BOUND: Duration = Duration::from_secs(30);
/// Most streams parked at once; more are refused with UNAVAILABLE.
pub const MAX_PARKED: usize = 1024;

/// The runtime service on `listener` (the shared accept loop: caps, TLS, idle time-outs), with
/// the standard health and reflection services, whose statuses follow `readiness`: the
/// returned future serves until `stop`.
pub(crate) async fn serve(
    listener: plumbing::listener::Listener,
    me: Me,
    trust: TrustStore,
    table: watch::Receiver<Arc<RouteTable>>,
    readiness: Arc<Readiness>,
    stop: CancellationToken,
) -> Result<impl Future<Output = ()> + use<>, ReflectionError> {
    let service = RuntimeService {
        me: Arc::new(me),
        trust: Arc::new(trust),
        table,
        parked: Arc::new(Semaphore::new(MAX_PARKED)),
        stop: stop.clone(),
    };
    let service = SupervisorRuntimeServer::new(service)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    let router = plumbing::listener::grpc_server().add_service(service);
    let (router, status) = proto::standard::add_standard_services(router, &[SERVICE_NAME]).await?;
    Ok(async move {
        tokio::spawn(crate::health::follow_grpc(status, readiness, stop.clone()));
        let served = plumbing::listener::serve_grpc(router, listener, stop.cancelled_owned()).await;
        if let Err(err) = served {
            tracing::error!(error = %err, "runtime service failed");
        }
    })
}

struct RuntimeService {
    me: Arc<Me>,
    trust: Arc<TrustStore>,
    table: watch::Receiver<Arc<RouteTable>>,
    parked: Arc<Semaphore>,
    stop: CancellationToken,
}

type SupervisorStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<SupervisorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl SupervisorRuntime for RuntimeService {
    type ConnectStream = SupervisorStream;

    async fn connect(
        &self,
        request: Request<Streaming<SidecarMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let bound = {
            let token = proto::bearer_token_from_metadata(request.metadata())
                .ok_or_else(|| Status::unauthenticated("a bearer instance token is required"))?;
            self.trust.instance_of(token).await.map_err(|err| match err {
                AuthError::Unavailable(_) => Status::unavailable(err.to_string()),
                AuthError::Token(_) | AuthError::NoRoute => Status::unauthenticated(err.to_string()),
            })?
        };
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(timing::RUNTIME_SILENCE_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::invalid_argument("no Attach or RecoveryHello within the silence timeout"))??;
        let opening = Opening::parse(first)?;
        if !bound.names(&opening.route, &opening.instance) {
            tracing::warn!(token_route = %bound.route, route = %opening.route,
                           "refused: an instance token used for another route or workload");
            return Err(Status::permission_denied(format!(
                "the instance token is for {}, not this route or workload",
                bound.route
            )));
        }
        let (outbound, queue) = mpsc::channel(OUTBOUND_CAPACITY);
        let stream = SidecarStream::new(opening, inbound, outbound);
        let span = tracing::info_span!(
            "sidecar",
            route = %stream.opening.route,
            instance = %stream.opening.instance,
            fence_term = stream.opening.fence_term,
            stream = stream.id,
        );
        let router = Router {
            me: Arc::clone(&self.me),
            table: self.table.clone(),
            parked: Arc::clone(&self.parked),
            stop: self.stop.clone(),
        };
        tokio::spawn(router.run(stream).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(queue))))
    }
}

struct Router {
    me: Arc<Me>,
    table: watch::Receiver<Arc<RouteTable>>,
    parked: Arc<Semaphore>,
    stop: CancellationToken,
}

impl Router {
    /// Decides, and re-decides on every table change while parked.
    async fn run(mut self, mut stream: SidecarStream) {
        let mut permit = None;
        let park_until = Instant::now() + PARK_BOUND;
        // A recovering sidecar just lost the owner of its fence term; our
        // directory may still name that owner only because the snapshot that
        // moves the route has not arrived yet. Wait for it a little before
        // sending the sidecar back to an owner that is probably gone.
        let redirect_after = Instant::now() + REDIRECT_GRACE;
        let mut heartbeat = tokio::time::interval(timing::RUNTIME_HEARTBEAT_INTERVAL);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let decision = self.table.borrow_and_update().decide(&stream.opening, &self.me);
            match decision {
                Decision::Session(sidecars) => match sidecars.try_send(Box::new(stream)) {
                    Ok(()) => return,
                    // The session ended meanwhile: wait for the table to say so.
                    Err(TrySendError::Closed(back)) => stream = *back,
                    Err(TrySendError::Full(back)) => {
                        tracing::info!("the session has too many streams waiting; refusing the sidecar");
                        return back.end(Status::unavailable("the session has too many streams waiting; retry"));
                    }
                },
                Decision::Redirect(redirect)
                    if stream.opening.recovering
                        && redirect.term == stream.opening.fence_term
                        && Instant::now() < redirect_after => {}
                Decision::Redirect(redirect) => {
                    tracing::info!(owner = %redirect.member, term = redirect.term, "redirecting the sidecar");
                    stream.send(Kind::Redirect(redirect));
                    return; // Dropping the stream ends it with OK.
                }
                Decision::Refuse(status) => {
                    tracing::info!(reason = status.message(), "refusing the sidecar");
                    return stream.end(status);
                }
                Decision::Park => {}
            }
            if permit.is_none() {
                match Arc::clone(&self.parked).try_acquire_owned() {
                    Ok(acquired) => permit = Some(acquired),
                    Err(_) => return stream.end(Status::unavailable("too many parked streams; retry")),
                }
                tracing::debug!("parking the sidecar stream until a snapshot decides");
            }
            let silent_at = stream.silent_at();
            tokio::select! {
                changed = self.table.changed() => if changed.is_err() {
                    return stream.end(Status::unavailable("the member is shutting down"));
                },
                _ = heartbeat.tick() => if !stream.heartbeat() {
                    return;
                },
                message = stream.next() => match message {
                    Ok(Some(sidecar_message::Kind::RecoveryHello(hello))) => {
                        // The sidecar's fence may have moved (another owner activated a term).
                        stream.opening.fence_term = hello.fence_term;
                        stream.opening.relinquished = hello.relinquished;
                    }
                    Ok(Some(_)) => {} // Nothing else is meaningful before a decision.
                    Ok(None) | Err(_) => return,
                },
                () = tokio::time::sleep_until(silent_at) => {
                    tracing::debug!("parked sidecar went silent");
                    return;
                }
                () = tokio::time::sleep_until(redirect_after), if Instant::now() < redirect_after => {}
                () = tokio::time::sleep_until(park_until) => {
                    return stream.end(Status::unavailable("parked too long without an owner decision; reconnect"));
                }
                () = self.stop.cancelled() => {
                    return stream.end(Status::unavailable("the member is shutting down"));
                }
            }
        }
    }
}
