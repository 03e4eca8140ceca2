//! The gRPC server of one replica: the member host stream, the instance
//! registry, grants and activation, and the operator API on one listener, with the standard
//! health and reflection services (`proto::standard`, statuses kept by `grpc_health`).

use std::sync::Arc;

use plumbing::listener::Listener;
use proto::host::v1::supervisor_host_server::{self, SupervisorHostServer};
use proto::pool::v1::supervisor_pool_server::{self, SupervisorPoolServer};
use proto::recovery::v1::supervisor_recovery_server::{self, SupervisorRecoveryServer};
use proto::registry::v1::instance_registry_server::{self, InstanceRegistryServer};
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::host::Host;
use crate::operator::Operator;
use crate::recovery::Recovery;
use crate::refusals::{Logged, Refusals};
use crate::registry::Registry;

/// The services of the gRPC port, by their full names.
pub const SERVICES: [&str; 4] = [
    supervisor_host_server::SERVICE_NAME,
    instance_registry_server::SERVICE_NAME,
    supervisor_recovery_server::SERVICE_NAME,
    supervisor_pool_server::SERVICE_NAME,
];

/// Serve until `shutdown`; open streams are told to reconnect elsewhere.
/// Connections come from the shared accept loop (caps, TLS, idle time-outs).
pub async fn serve(listener: Listener, health: Health, shutdown: CancellationToken) -> Result<(), crate::Error> {
    let max = proto::MAX_MESSAGE_BYTES;
    let replica = health.replica.clone();
    // Every refusal of the port is logged in one place, rate-limited per source.
    let refusals = Arc::new(Refusals::new(replica.metrics.refusal_lines_suppressed()));
    let host = SupervisorHostServer::new(Host::new(replica.clone()))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let registry = InstanceRegistryServer::new(Registry::new(replica.clone()))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let recovery = SupervisorRecoveryServer::new(Recovery::new(replica.clone()))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let operator = SupervisorPoolServer::new(Operator::new(replica))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let router = plumbing::listener::grpc_server()
        .add_service(Logged::new(host, refusals.clone()))
        .add_service(Logged::new(registry, refusals.clone()))
        .add_service(Logged::new(recovery, refusals.clone()))
        .add_service(Logged::new(operator, refusals.clone()));
    let (router, status) = proto::standard::add_standard_services(router, &SERVICES).await?;
    let stop = CancellationToken::new();
    let _stop_on_return = stop.clone().drop_guard();
    tokio::spawn(crate::grpc_health::follow(status, health, stop));
    Ok(plumbing::listener::serve_grpc(router, listener, shutdown.cancelled_owned()).await?)
}
