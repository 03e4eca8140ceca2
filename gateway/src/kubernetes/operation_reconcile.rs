//! What the coordinator does about the `SupervisorPoolOperation` objects (plain data from the
//! index) given the pool view. Pure: [`reconcile`] returns [`Effect`]s, which
//! [`super::operation_writer`] carries out while the lease is held.
//!
//! - A new object is validated as the operator API validates a start request
//!   ([`operations::from_request`]); the coordinator puts its finalizer on it, then records
//!   the durable operation with the object's UID as its id, so a restart or another replica
//!   recording it again finds the same operation. An equivalent operation already open (a
//!   `poolctl drain` of the same member) is adopted instead of a second one.
//! - A dry run plans over the view (`operations::preview`): the moves and refusals in the
//!   status (`Planned`), nothing recorded; planned once per generation.
//! - The status follows the durable operation: phase, moves done/total, message, conditions
//!   `Accepted`, `Complete` (it ended, however) and `Succeeded` (how: `True` only for phase
//!   `Succeeded`, so `kubectl wait --for=condition=Succeeded` fails on a failed, cancelled or
//!   dry-run operation instead of passing); a spec changed after the start is refused in the status, the
//!   operation runs as started.
//! - Deleting the object cancels the operation: the finalizer goes once the cancellation is
//!   recorded (or the operation had already ended). A succeeded drain is cancelled too, which
//!   puts its member back in service.

use proto::pool::v1::{OperationKind as RequestKind, StartSupervisorPoolOperationRequest};
use proto::{DEFAULT_MAX_PARALLEL, MAX_MAX_PARALLEL};

use super::pool_operation::{FINALIZER, MAX_LISTED_MOVES, OperationObject, OperationStatus, PlannedMove, RefusedMove};
use super::pool_status::{Condition, condition, moves_total, stamp, unknown};
use crate::operations;

use crate::pool::View;
use crate::store::{Lease, Operation, OperationKind, OperationPhase};

/// Phases of the object.
pub const PENDING: &str = "Pending";
pub const RUNNING: &str = "Running";
pub const SUCCEEDED: &str = "Succeeded";
pub const FAILED: &str = "Failed";
pub const CANCELLED: &str = "Cancelled";
/// A dry run's phase: planned, nothing recorded.
pub const PLANNED: &str = "Planned";

/// Condition types: the spec was taken (or why not), the operation has ended (in any phase),
/// and whether it did what it was asked: `True` (reason `Succeeded`) only in phase
/// `Succeeded`; `False` once it ended otherwise, with the phase as reason (`Failed`,
/// `Cancelled`, or `Planned` for a dry run, which plans and does nothing); `Unknown` (reason
/// `Pending` or `Running`) while it has not ended.
pub const ACCEPTED: &str = "Accepted";
pub const COMPLETE: &str = "Complete";
pub const SUCCEEDED_CONDITION: &str = "Succeeded";

/// Event reasons on the object.
pub const REASON_STARTED: &str = "Started";

/// One thing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Put the finalizer on the object (before its operation is recorded): set its finalizers
    /// to `finalizers`, valid only at `resource_version`.
    AddFinalizer {
        name: String,
        resource_version: String,
        finalizers: Vec<String>,
    },
    /// Record the durable operation (idempotent: its id is the object's UID).
    Start { name: String, operation: Operation },
    /// The object is being deleted: request the cancellation of `operation_id` (nothing to do
    /// when it was never recorded or has ended), then set the finalizers to `finalizers`
    /// (ours removed). `cancelled` is published once a cancellation was recorded.
    Release {
        name: String,
        operation_id: String,
        resource_version: String,
        finalizers: Vec<String>,
        cancelled: OperationNotice,
    },
    /// Apply this status (server-side apply of the status subresource).
    Status {
        name: String,
        uid: String,
        status: OperationStatus,
    },
    /// Record an Event on the object.
    Event(OperationNotice),
}

impl Effect {
    /// The object it acts on.
    pub fn name(&self) -> &str {
        match self {
            Self::AddFinalizer { name, .. }
            | Self::Start { name, .. }
            | Self::Release { name, .. }
            | Self::Status { name, .. } => name,
            Self::Event(notice) => &notice.name,
        }
    }
}

/// An Event on an operation object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationNotice {
    pub name: String,
    pub uid: String,
    pub warning: bool,
    /// `Started`, `Succeeded`, `Failed` or `Cancelled`.
    pub reason: &'static str,
    pub note: String,
}

/// The effects for `objects` (of `namespace`) over `view`; nothing unless this replica holds
/// the lease. Pure.
pub fn reconcile(objects: &[OperationObject], view: &View, lease: Option<&Lease>, namespace: &str) -> Vec<Effect> {
    let mut effects = Vec::new();
    if lease.is_none() || view.now_ms == 0 {
        return effects;
    }
    for object in objects {
        one(object, view, namespace, &mut effects);
    }
    effects
}

fn one(o: &OperationObject, view: &View, namespace: &str, out: &mut Vec<Effect>) {
    let previous = o.status.clone().unwrap_or_default();
    let known =
        |op: &&Operation| op.id == o.uid || (!previous.operation_id.is_empty() && op.id == previous.operation_id);
    let recorded = view.operations.iter().find(known);
    if o.deleting {
        if o.finalized() {
            let operation_id = recorded.map_or_else(
                || {
                    if previous.operation_id.is_empty() {
                        o.uid.clone()
                    } else {
                        previous.operation_id.clone()
                    }
                },
                |op| op.id.clone(),
            );
            out.push(Effect::Release {
                name: o.name.clone(),
                resource_version: o.resource_version.clone(),
                finalizers: o.finalizers.iter().filter(|f| *f != FINALIZER).cloned().collect(),
                cancelled: notice(o, CANCELLED, format!("deleted: operation {operation_id} cancelled")),
                operation_id,
            });
        }
        return;
    }
    let next = match recorded {
        Some(op) => Some(started(o, op, view, out)),
        None if o.spec.dry_run => planned(o, &previous, view, namespace),
        // Ended, and its record is no longer in the view: nothing to start again.
        None if !previous.operation_id.is_empty() && is_final(&previous.phase) => None,
        None => Some(start(o, view, namespace, out)),
    };
    let Some(mut next) = next else { return };
    stamp(&mut next.conditions, &previous.conditions, view.now_ms);
    if o.status.as_ref() == Some(&next) {
        return;
    }
    if next.phase != previous.phase && is_final(&next.phase) && next.phase != PLANNED {
        let reason = match next.phase.as_str() {
            SUCCEEDED => SUCCEEDED,
            CANCELLED => CANCELLED,
            _ => FAILED,
        };
        let mut event = notice(o, reason, next.message.clone());
        event.warning = reason == FAILED;
        out.push(Effect::Event(event));
    }
    out.push(Effect::Status {
        name: o.name.clone(),
        uid: o.uid.clone(),
        status: next,
    });
}

fn is_final(phase: &str) -> bool {
    matches!(phase, SUCCEEDED | FAILED | CANCELLED | PLANNED)
}

fn notice(o: &OperationObject, reason: &'static str, note: String) -> OperationNotice {
    OperationNotice {
        name: o.name.clone(),
        uid: o.uid.clone(),
        warning: false,
        reason,
        note,
    }
}

/// Why an object's spec cannot start now.
enum Refusal {
    /// Never valid: the user must change the spec.
    Invalid(String),
    /// The drained member is not in the pool (yet): looked at again every round.
    Waiting(String),
}

/// The operation the object asks for, validated as the operator API validates a request.
fn validate(o: &OperationObject, view: &View, namespace: &str) -> Result<Operation, Refusal> {
    let kind = match o.spec.kind.to_ascii_lowercase().as_str() {
        "drain" => RequestKind::Drain,
        "rebalance" => RequestKind::Rebalance,
        _ => return Err(Refusal::Invalid("spec.kind must be Drain or Rebalance".into())),
    };
    let max_parallel = match o.spec.max_parallel {
        None => 0,
        Some(n) => u32::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_MAX_PARALLEL).contains(n))
            .ok_or_else(|| Refusal::Invalid(format!("spec.maxParallel must be between 1 and {MAX_MAX_PARALLEL}")))?,
    };
    let timeout_ms = match o.spec.timeout_seconds {
        None => 0,
        Some(s) => u64::try_from(s)
            .ok()
            .filter(|s| *s > 0)
            .map(|s| s.saturating_mul(1000))
            .ok_or_else(|| Refusal::Invalid("spec.timeoutSeconds must be positive".into()))?,
    };
    let request = StartSupervisorPoolOperationRequest {
        kind: kind as i32,
        target: o.spec.member.clone(),
        max_parallel,
        timeout_ms,
        dry_run: o.spec.dry_run,
    };
    let requested_by = format!("SupervisorPoolOperation {namespace}/{}", o.name);
    match operations::from_request(&request, &requested_by, view) {
        Ok(operation) => Ok(Operation {
            id: o.uid.clone(),
            ..operation
        }),
        Err(refused) if refused.code() == tonic::Code::NotFound => {
            Err(Refusal::Waiting(format!("waiting: {}", refused.message())))
        }
        Err(refused) => Err(Refusal::Invalid(format!("invalid spec: {}", refused.message()))),
    }
}

/// The `Succeeded` condition for `phase`: `True` only for `Succeeded`, `False` for another
/// final phase (the phase is the reason), `Unknown` while the operation has not ended.
fn succeeded(phase: &str) -> Condition {
    match phase {
        SUCCEEDED => condition(SUCCEEDED_CONDITION, true, SUCCEEDED, "the operation succeeded".into()),
        PLANNED => condition(
            SUCCEEDED_CONDITION,
            false,
            PLANNED,
            "a dry run only plans: nothing was moved".into(),
        ),
        _ if is_final(phase) => condition(
            SUCCEEDED_CONDITION,
            false,
            phase,
            format!("the operation ended {}", phase.to_ascii_lowercase()),
        ),
        _ => unknown(
            SUCCEEDED_CONDITION,
            phase,
            format!("the operation is {} and has not ended", phase.to_ascii_lowercase()),
        ),
    }
}

/// A status with the `Accepted`, `Complete` and `Succeeded` conditions for `phase`.
fn status(o: &OperationObject, phase: &str, message: String, accepted: (bool, &str, String)) -> OperationStatus {
    let (taken, reason, why) = accepted;
    let complete = is_final(phase);
    OperationStatus {
        phase: phase.to_owned(),
        moves: "0/0".into(),
        message,
        observed_generation: o.generation,
        conditions: vec![
            condition(ACCEPTED, taken, reason, why),
            condition(
                COMPLETE,
                complete,
                phase,
                format!("the operation is {}", phase.to_ascii_lowercase()),
            ),
            succeeded(phase),
        ],
        ..OperationStatus::default()
    }
}

fn refused(o: &OperationObject, refusal: Refusal) -> OperationStatus {
    match refusal {
        Refusal::Invalid(why) => status(o, FAILED, why.clone(), (false, "InvalidSpec", why)),
        Refusal::Waiting(why) => status(o, PENDING, why.clone(), (false, "NoSuchMember", why)),
    }
}

/// Not recorded yet: record it (or adopt the equivalent open operation).
fn start(o: &OperationObject, view: &View, namespace: &str, out: &mut Vec<Effect>) -> OperationStatus {
    let operation = match validate(o, view, namespace) {
        Ok(operation) => operation,
        Err(refusal) => return refused(o, refusal),
    };
    if !o.finalized() {
        out.push(add_finalizer(o));
    }
    if let Some(existing) = operations::equivalent(view, operation.kind, &operation.target) {
        return started(o, existing, view, out);
    }
    let id = operation.id.clone();
    out.push(Effect::Start {
        name: o.name.clone(),
        operation,
    });
    if o.status.as_ref().is_none_or(|s| s.operation_id.is_empty()) {
        out.push(Effect::Event(notice(
            o,
            REASON_STARTED,
            format!("operation {id} recorded"),
        )));
    }
    let mut next = status(
        o,
        PENDING,
        "recorded; waiting for the coordinator to admit it".into(),
        (true, "Recorded", format!("operation {id}")),
    );
    next.operation_id = id;
    next
}

fn add_finalizer(o: &OperationObject) -> Effect {
    let mut finalizers = o.finalizers.clone();
    finalizers.push(FINALIZER.to_owned());
    Effect::AddFinalizer {
        name: o.name.clone(),
        resource_version: o.resource_version.clone(),
        finalizers,
    }
}

/// The status of a recorded operation.
fn started(o: &OperationObject, op: &Operation, view: &View, out: &mut Vec<Effect>) -> OperationStatus {
    let open = !op.phase.is_finished() || (op.kind == OperationKind::Drain && op.phase == OperationPhase::Succeeded);
    if open
        && !o.finalized()
        && !out
            .iter()
            .any(|e| matches!(e, Effect::AddFinalizer { name, .. } if *name == o.name))
    {
        out.push(add_finalizer(o));
    }
    let phase = match op.phase {
        OperationPhase::Pending => PENDING,
        OperationPhase::Running => RUNNING,
        OperationPhase::Succeeded => SUCCEEDED,
        OperationPhase::Failed => FAILED,
        OperationPhase::Cancelled => CANCELLED,
    };
    let accepted = match changed_spec(o, op) {
        Some(why) => (false, "SpecChanged", why),
        None if op.id == o.uid => (true, "Recorded", format!("operation {}", op.id)),
        None => (
            true,
            "Adopted",
            format!(
                "operation {} was already open for the same {} (requested by {})",
                op.id,
                op.kind.as_str(),
                op.requested_by
            ),
        ),
    };
    let message = if accepted.1 == "SpecChanged" {
        format!("{}; {}", accepted.2, op.message)
    } else {
        op.message.clone()
    };
    let mut next = status(o, phase, message, accepted);
    next.operation_id = op.id.clone();
    next.moves_done = op.moves;
    next.moves_total = moves_total(view, op);
    next.moves = format!("{}/{}", next.moves_done, next.moves_total);
    next
}

/// Why the spec no longer says what was started, if it does not.
fn changed_spec(o: &OperationObject, op: &Operation) -> Option<String> {
    let kind = match o.spec.kind.to_ascii_lowercase().as_str() {
        "drain" => Some(OperationKind::Drain),
        "rebalance" => Some(OperationKind::Rebalance),
        _ => None,
    };
    let target = if op.kind == OperationKind::Drain {
        op.target.as_str()
    } else {
        ""
    };
    let max_parallel = o.spec.max_parallel.unwrap_or(i64::from(DEFAULT_MAX_PARALLEL));
    // An adopted operation keeps its own maxParallel.
    let same = kind == Some(op.kind)
        && o.spec.member == target
        && !o.spec.dry_run
        && (op.id != o.uid || max_parallel == op.max_parallel);
    (!same).then(|| {
        format!(
            "the spec changed after operation {} started ({} {} with maxParallel {}); it runs as started: \
             delete this object and create a new one to change it",
            op.id,
            op.kind.as_str(),
            if target.is_empty() { "of the pool" } else { target },
            op.max_parallel
        )
    })
}

/// A dry run: the moves over the view, planned once per generation.
fn planned(o: &OperationObject, previous: &OperationStatus, view: &View, namespace: &str) -> Option<OperationStatus> {
    if previous.phase == PLANNED && previous.observed_generation == o.generation {
        return None;
    }
    let operation = match validate(o, view, namespace) {
        Ok(operation) => operation,
        Err(refusal) => return Some(refused(o, refusal)),
    };
    let preview = operations::preview(view, &operation);
    let total = preview.moves.len();
    let mut message = preview.message.clone();
    if total > MAX_LISTED_MOVES {
        message.push_str(&format!("; {} more moves not listed", total - MAX_LISTED_MOVES));
    }
    if let Some(existing) = operations::equivalent(view, operation.kind, &operation.target) {
        message.push_str(&format!("; operation {} already does this", existing.id));
    }
    let mut next = status(
        o,
        PLANNED,
        message,
        (true, "DryRun", "planned only; nothing recorded".into()),
    );
    next.moves_total = i64::try_from(total).unwrap_or(i64::MAX);
    next.moves = format!("0/{total}");
    next.planned = preview
        .moves
        .into_iter()
        .take(MAX_LISTED_MOVES)
        .map(|m| PlannedMove {
            instance: m.route,
            from: m.from,
            to: m.to,
        })
        .collect();
    next.refused = preview
        .refused
        .into_iter()
        .take(MAX_LISTED_MOVES)
        .map(|r| RefusedMove {
            instance: r.route,
            from: r.from,
            reason: r.reason,
        })
        .collect();
    Some(next)
}

/// The conditions of a status, by type (tests and callers reading one).
pub fn condition_of<'s>(status: &'s OperationStatus, type_: &str) -> Option<&'s Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
#[path = "operation_reconcile_tests.rs"]
mod tests;
