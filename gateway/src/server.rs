//! The gRPC server of one replica: the member host stream, the instance
//! registry, grants and activation, and the operator API on one listener.

use std::sync::Arc;

use proto::host::v1::supervisor_host_server::SupervisorHostServer;
use proto::listener::Listener;
use proto::pool::v1::supervisor_pool_server::SupervisorPoolServer;
use proto::recovery::v1::supervisor_recovery_server::SupervisorRecoveryServer;
use proto::registry::v1::instance_registry_server::InstanceRegistryServer;
use tokio_util::sync::CancellationToken;

use crate::host::Host;
use crate::operator::Operator;
use crate::recovery::Recovery;
use crate::registry::Registry;
use crate::replica::Replica;

/// Serve until `shutdown`; open streams are told to reconnect elsewhere.
/// Connections come from the shared accept loop (caps, TLS, idle time-outs).
pub async fn serve(
    listener: Listener,
    replica: Arc<Replica>,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let max = proto::MAX_MESSAGE_BYTES;
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
    let router = proto::listener::grpc_server()
        .add_service(host)
        .add_service(registry)
        .add_service(recovery)
        .add_service(operator);
    proto::listener::serve_grpc(router, listener, shutdown.cancelled_owned()).await
}
