//! The standard gRPC services every gRPC port of the pool serves beside its own contracts:
//! `grpc.health.v1.Health` (tonic-health) and server reflection, `grpc.reflection.v1` and
//! `grpc.reflection.v1alpha` (tonic-reflection). They are added to the port's own router, so
//! they are reached through the same accept loop (`plumbing::listener`: TLS, connection caps,
//! time-outs) as the port's services. Both answer without a credential (`AUTHORIZATION.md`):
//! health tells only SERVING or NOT_SERVING per service name, reflection describes only the
//! public contracts of this crate.

use tonic::transport::server::Router;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// The full names of the standard services, as reflection lists them.
pub const STANDARD_SERVICES: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// The compiled descriptors reflection cannot be built from (a build defect, reported at start).
#[derive(Debug, thiserror::Error)]
#[error("gRPC reflection cannot read the compiled descriptors: {0}")]
pub struct ReflectionError(#[from] tonic_reflection::server::Error);

/// The health statuses one port reports: the overall status (service name `""`), each of the
/// port's own services, and any further name the binary sets.
#[derive(Clone, Debug)]
pub struct HealthStatus {
    reporter: HealthReporter,
    services: Vec<&'static str>,
}

impl HealthStatus {
    /// The overall status and every service of the port: SERVING when `ready`, else
    /// NOT_SERVING. Watchers are told only of changes.
    pub async fn set_ready(&self, ready: bool) {
        for service in std::iter::once("").chain(self.services.iter().copied()) {
            self.set(service, ready).await;
        }
    }

    /// The status of one service name.
    pub async fn set(&self, service: &str, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status(service, status).await;
    }
}

/// Adds health and reflection to `router`; reflection lists `services` (the full names of the
/// port's own services) and the standard ones. Every status starts NOT_SERVING: the caller
/// sets them as its readiness changes.
pub async fn add_standard_services(
    router: Router,
    services: &[&'static str],
) -> Result<(Router, HealthStatus), ReflectionError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let status = HealthStatus {
        reporter,
        services: services.to_vec(),
    };
    status.set_ready(false).await;
    let reflection = || {
        let builder = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET);
        services
            .iter()
            .chain(&STANDARD_SERVICES)
            .fold(builder, |builder, name| builder.with_service_name(*name))
    };
    let v1 = reflection().build_v1()?;
    let v1alpha = reflection().build_v1alpha()?;
    let router = router.add_service(health).add_service(v1).add_service(v1alpha);
    Ok((router, status))
}
