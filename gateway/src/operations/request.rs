//! An operator's start request (drain or rebalance), checked into the operation to record.
//! Pure; the operator API and the `SupervisorPoolOperation` reconciler both call it.

use std::time::Duration;

use proto::pool::v1::StartSupervisorPoolOperationRequest;
use proto::timing::{DEFAULT_OPERATION_TIMEOUT, MAX_OPERATION_TIMEOUT};
use tonic::Status;

use crate::pool::View;
use crate::store::{self, OperationKind, OperationPhase};

/// Longest member name (a Pod name: a DNS subdomain); a longer target is refused without
/// being echoed.
const MAX_MEMBER_NAME_BYTES: usize = 253;

/// Validate a start request into the operation to record.
pub fn from_request(
    request: &StartSupervisorPoolOperationRequest,
    requested_by: &str,
    view: &View,
) -> Result<store::Operation, Status> {
    use proto::pool::v1::OperationKind as K;
    let max_parallel = request.effective_max_parallel().ok_or_else(|| {
        Status::invalid_argument(format!(
            "max_parallel {} is above {}",
            request.max_parallel,
            proto::MAX_MAX_PARALLEL
        ))
    })?;
    let kind = match K::try_from(request.kind) {
        Ok(K::Drain) => {
            if request.target.is_empty() {
                return Err(Status::invalid_argument("a drain names the member to drain"));
            }
            if request.target.len() > MAX_MEMBER_NAME_BYTES {
                return Err(Status::invalid_argument(format!(
                    "the drain target is not a member name (longer than {MAX_MEMBER_NAME_BYTES} bytes)"
                )));
            }
            if !view.members.contains_key(&request.target) {
                return Err(Status::not_found(format!("no pool member {}", request.target)));
            }
            OperationKind::Drain
        }
        Ok(K::Rebalance) => {
            if !request.target.is_empty() {
                return Err(Status::invalid_argument("a rebalance takes no target"));
            }
            OperationKind::Rebalance
        }
        _ => {
            return Err(Status::invalid_argument(
                "only DRAIN and REBALANCE operations can be started",
            ));
        }
    };
    let timeout = match request.timeout_ms {
        0 => DEFAULT_OPERATION_TIMEOUT,
        ms => Duration::from_millis(ms),
    };
    if timeout > MAX_OPERATION_TIMEOUT {
        return Err(Status::invalid_argument(format!(
            "timeout_ms is above {} ms",
            MAX_OPERATION_TIMEOUT.as_millis()
        )));
    }
    Ok(store::Operation {
        id: uuid::Uuid::new_v4().to_string(),
        kind,
        target: request.target.clone(),
        phase: OperationPhase::Pending,
        message: "requested".into(),
        attempts: 0,
        moves: 0,
        // The store turns the budget into a deadline on the database clock.
        deadline_at_ms: Some(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX)),
        max_parallel: i64::from(max_parallel),
        requested_by: plumbing::text::prefix(requested_by, 256).to_owned(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::pool::v1::StartSupervisorPoolOperationRequest;

    #[test]
    fn a_huge_drain_target_is_refused_without_being_echoed() {
        let request = StartSupervisorPoolOperationRequest {
            kind: proto::pool::v1::OperationKind::Drain as i32,
            target: "m".repeat(1 << 20),
            ..Default::default()
        };
        let Err(refused) = from_request(&request, "operator", &crate::pool::View::default()) else {
            panic!("a 1 MiB target must be refused")
        };
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().len() < 256, "{} bytes", refused.message().len());
    }
}
