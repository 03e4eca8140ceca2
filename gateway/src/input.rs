//! Checks on what callers send, as the gRPC refusal every service gives: shared by the
//! registry, recovery and the member host stream.

use tonic::Status;

/// Routes are printable ASCII without whitespace, bounded.
pub fn check_route(route: &str) -> Result<(), Status> {
    if plumbing::validate::route(route).is_ok() {
        Ok(())
    } else {
        Err(Status::invalid_argument(
            "the route is empty, too long or not printable ASCII",
        ))
    }
}
