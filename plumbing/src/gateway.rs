//! Dialing the gateway replicas, the same way in every client (the supervisor's recovery
//! calls, the sidecar's registration calls, poolctl): the endpoints in turn, each connect bounded,
//! staying on a replica that answers. Retries between calls back off with
//! [`proto::timing::reconnect_backoff`] (jittered); the bearer header is
//! [`Token::authorize`](crate::token::Token::authorize). A call a replica provably did not
//! process ([`never_processed`]: a replica shutting down refused it) may go to another even
//! where calls are sent at most once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tonic::transport::Channel;

use crate::tls::ClientTls;

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("no gateway endpoints")]
    NoEndpoints,
    #[error("no gateway replica reachable: {0}")]
    Unreachable(String),
}

/// The gateway replicas a binary dials and how their certificates are verified: the same
/// flags and environment in the supervisor, the sidecar and poolctl.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct GatewayArgs {
    /// Gateway gRPC endpoints, comma-separated (e.g. https://gw-0:8443,https://gw-1:8443),
    /// tried in turn; https:// ones are verified with --tls-ca.
    #[arg(
        long = "gateway-endpoints",
        visible_alias = "gateway",
        env = "OPENSHELL_GATEWAY_ENDPOINTS",
        value_delimiter = ','
    )]
    pub gateway_endpoints: Vec<String>,
    /// PEM CA bundle that https:// addresses are verified against, re-read at every connect
    /// (the sidecar's default: `ca.crt` in its supervision directory).
    #[arg(long, env = "OPENSHELL_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// DNS name the gateway certificates carry, when it is not the endpoints' host.
    #[arg(long, env = "OPENSHELL_GATEWAY_TLS_NAME")]
    pub gateway_tls_name: Option<String>,
}

impl GatewayArgs {
    /// The endpoints, trimmed, empty entries dropped.
    pub fn endpoints(&self) -> Vec<String> {
        endpoint_list(&self.gateway_endpoints)
    }

    /// How the gateways are verified, with `ca` as the CA bundle.
    pub fn tls_with(&self, ca: Option<PathBuf>) -> ClientTls {
        ClientTls {
            ca,
            server_name: self.gateway_tls_name.clone(),
            dialer: None,
        }
    }

    /// How the gateways are verified (`--tls-ca`, `--gateway-tls-name`).
    pub fn tls(&self) -> ClientTls {
        self.tls_with(self.tls_ca.clone())
    }
}

/// Trimmed, non-empty entries of a comma-separated endpoint list.
pub fn endpoint_list<S: AsRef<str>>(list: &[S]) -> Vec<String> {
    list.iter()
        .map(|a| a.as_ref().trim().to_owned())
        .filter(|a| !a.is_empty())
        .collect()
}

/// The gateway replicas and how they are verified.
#[derive(Debug)]
pub struct Gateways {
    endpoints: Vec<String>,
    tls: ClientTls,
    /// Index (modulo the length) of the replica to try first: the one that answered last.
    next: AtomicUsize,
}

impl Gateways {
    /// `endpoints` are trimmed and empty ones dropped; https:// ones are verified with `tls`.
    pub fn new<S: AsRef<str>>(endpoints: &[S], tls: ClientTls) -> Self {
        Self {
            endpoints: endpoint_list(endpoints),
            tls,
            next: AtomicUsize::new(0),
        }
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The replica tried first by the next [`connect`](Self::connect).
    pub fn current(&self) -> &str {
        match self.endpoints.len() {
            0 => "",
            n => &self.endpoints[self.next.load(Ordering::Relaxed) % n],
        }
    }

    /// Makes the next [`connect`](Self::connect) start after the current replica (it failed
    /// after connecting).
    pub fn skip(&self) {
        self.next.fetch_add(1, Ordering::Relaxed);
    }

    /// Makes the next [`connect`](Self::connect) start after replica `index` (as
    /// [`connect_to_one`](Self::connect_to_one) returned it), unless another caller moved it on
    /// already: two calls refused by the same replica move past it once, not back to it.
    pub fn skip_past(&self, index: usize) {
        let _ = self
            .next
            .compare_exchange(index, index + 1, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Connects to the first replica that answers, each attempt bounded by `limit`, starting
    /// at the current one; the replica that answers stays current. Nothing is sent.
    pub async fn connect(&self, limit: Duration) -> Result<Channel, DialError> {
        self.connect_to_one(limit).await.map(|(channel, _)| channel)
    }

    /// [`connect`](Self::connect), also saying which replica answered.
    pub async fn connect_to_one(&self, limit: Duration) -> Result<(Channel, usize), DialError> {
        if self.endpoints.is_empty() {
            return Err(DialError::NoEndpoints);
        }
        let start = self.next.load(Ordering::Relaxed);
        let mut errors = Vec::new();
        for offset in 0..self.endpoints.len() {
            let index = (start + offset) % self.endpoints.len();
            match self.tls.connect(&self.endpoints[index], limit).await {
                Ok(channel) => {
                    self.next.store(index, Ordering::Relaxed);
                    return Ok((channel, index));
                }
                Err(err) => errors.push(err.to_string()),
            }
        }
        Err(DialError::Unreachable(errors.join("; ")))
    }
}

/// Whether the replica provably never handed the call to a handler: the connection closed
/// before the request was handed to it (hyper's "canceled"), the replica refused the call's
/// HTTP/2 stream (`REFUSED_STREAM`), or it sent a graceful `GOAWAY` that left the stream out — a
/// replica shutting down does so for every stream it will not serve, and the client fails a
/// call it had not sent yet the same way. Such a call can be sent to another replica without
/// being processed twice. Any other failure (a reset, a time-out, a broken connection, an
/// answer) may come after the handler ran. For unary and server-streaming calls only: a
/// GOAWAY can fail a call whose headers already left, which is safe because its body (the
/// request message) then never does, so no unary handler runs.
pub fn never_processed(status: &tonic::Status) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(err) = cause {
        // The connection went away before the request was handed to it: nothing was written.
        if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            let refused = h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            let left_out = h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
            return refused || left_out;
        }
        cause = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_refused_stream_counts_as_never_processed() {
        let refused = tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM)));
        assert!(never_processed(&refused), "{refused:?}");
        // What a handler answered, a reset after the request, or no cause at all: it may have run.
        for status in [
            tonic::Status::unavailable("the replica answered"),
            tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::CANCEL))),
            tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::INTERNAL_ERROR))),
            tonic::Status::from_error(Box::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe))),
        ] {
            assert!(!never_processed(&status), "{status:?}");
        }
    }

    #[tokio::test]
    async fn dialing_moves_on_to_the_replica_that_answers_and_stays() -> Result<(), Box<dyn std::error::Error>> {
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let dead_address = format!("http://{}", dead.local_addr()?);
        drop(dead);
        let live_address = format!("http://{}", live.local_addr()?);
        let gateways = Gateways::new(
            &[format!(" {dead_address} "), String::new(), live_address.clone()],
            ClientTls::default(),
        );
        assert_eq!(gateways.endpoints(), [dead_address.clone(), live_address.clone()]);
        assert_eq!(gateways.current(), dead_address);
        gateways.connect(proto::timing::CONNECT_TIMEOUT).await?;
        assert_eq!(gateways.current(), live_address);
        gateways.skip();
        assert_eq!(gateways.current(), dead_address);

        let none = Gateways::new(&[" "], ClientTls::default());
        assert!(matches!(
            none.connect(proto::timing::CONNECT_TIMEOUT).await,
            Err(DialError::NoEndpoints)
        ));
        Ok(())
    }
}
