//! What runs on the accepted connections: gRPC (tonic) or HTTP (hyper, HTTP/1.1 and HTTP/2),
//! with the keep-alive, request and header time-outs, and graceful drain.

use std::future::Future;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio_stream::StreamExt as _;

use super::Listener;

/// HTTP/2 keep-alive ping interval of every server: a live client answers (and so stays out of
/// the idle time-out); a dead one is dropped after [`KEEPALIVE_TIMEOUT`].
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Bound on the answer to a keep-alive ping.
pub const KEEPALIVE_TIMEOUT: Duration = proto::timing::SILENCE_TIMEOUT;
/// Bound on a gRPC handler producing its response (streams then run on their own).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A tonic server builder with the shared settings: keep-alive pings, the request time-out,
/// `TCP_NODELAY`.
pub fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .timeout(REQUEST_TIMEOUT)
        .tcp_nodelay(true)
}

/// Serves `router` on `listener` until `shutdown`, then drains (tonic's graceful shutdown).
pub async fn serve_grpc(
    router: tonic::transport::server::Router,
    listener: Listener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    router.serve_with_incoming_shutdown(listener.incoming(), shutdown).await
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body hyper can send from any task (axum's `Body`, for one).
pub trait HttpBody: http_body::Body<Data: Send, Error: Into<BoxError>> + Send + 'static {}

impl<B> HttpBody for B where B: http_body::Body<Data: Send, Error: Into<BoxError>> + Send + 'static {}

/// An HTTP service [`serve_http`] can run on every connection (an axum `Router`, for one).
pub trait HttpService:
    tower_service::Service<
        http::Request<hyper::body::Incoming>,
        Response = http::Response<Self::Body>,
        Future: Send + 'static,
        Error: Into<BoxError>,
    > + Clone
    + Send
    + 'static
{
    /// The response body.
    type Body: HttpBody;
}

impl<S, B> HttpService for S
where
    S: tower_service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Future: Send + 'static,
            Error: Into<BoxError>,
        > + Clone
        + Send
        + 'static,
    B: HttpBody,
{
    type Body = B;
}

/// Connections still being served after accepting stopped.
#[derive(Debug)]
pub struct Drain(GracefulShutdown);

impl Drain {
    /// Open connections now.
    pub fn open(&self) -> usize {
        self.0.count()
    }

    /// Asks every connection to finish (HTTP/1: after its current request; HTTP/2: GOAWAY) and
    /// waits until all have. Bound it with a time-out; dropping the future leaves the rest to
    /// end with the process.
    pub async fn finish(self) {
        self.0.shutdown().await;
    }
}

/// Serves `service` over HTTP on `listener` until `stop` completes; returns `stop`'s output and
/// the connections to drain.
pub async fn serve_http<S, T>(listener: Listener, service: S, stop: impl Future<Output = T>) -> (T, Drain)
where
    S: HttpService,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(listener.limits.header_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    let graceful = GracefulShutdown::new();
    let service = TowerToHyperService::new(service);
    let mut incoming = listener.incoming();
    let mut stop = std::pin::pin!(stop);
    let stopped = loop {
        let conn = tokio::select! {
            stopped = &mut stop => break stopped,
            conn = incoming.next() => match conn {
                Some(Ok(conn)) => conn,
                Some(Err(_)) => continue,
                // The accept loop ended (it does not, short of a panic): wait for `stop`.
                None => break (&mut stop).await,
            },
        };
        let peer = conn.peer();
        let serving = builder
            .serve_connection(TokioIo::new(conn), service.clone())
            .into_owned();
        let watched = graceful.watch(serving);
        tokio::spawn(async move {
            if let Err(err) = watched.await {
                tracing::debug!(?peer, error = %err, "connection ended with an error");
            }
        });
    };
    // Dropping the stream ends the accept loop and closes the listening socket.
    drop(incoming);
    (stopped, Drain(graceful))
}

/// Longest [`serve_health`] waits for open connections after `stop`.
pub const HEALTH_DRAIN_BOUND: Duration = Duration::from_secs(5);

/// [`serve_http`] for a health/metrics port: until `stop`, then drains for at most
/// [`HEALTH_DRAIN_BOUND`].
pub async fn serve_health(listener: Listener, service: impl HttpService, stop: impl Future<Output = ()>) {
    let ((), drain) = serve_http(listener, service, stop).await;
    let _ = tokio::time::timeout(HEALTH_DRAIN_BOUND, drain.finish()).await;
}
