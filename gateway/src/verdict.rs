//! The gateway's verdict on one instance, in one place: what its owner's
//! presence and reports say about it. Pure.
//!
//! - an owner that is disconnected (no live membership of its process) is
//!   **Unknown**: the workload may well be fine;
//! - an owner that has not reconciled to the assignment's term yet is
//!   **Degraded**;
//! - only an owner that reconciled past the assignment without hosting the
//!   instance, or reports it ended (stopped, relinquished, failed), makes it
//!   **Unavailable**; an unknown phase reads as a failure.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::pool::View;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The owner hosts the instance at the assigned term.
    Ready,
    Degraded(String),
    Unavailable(String),
    Unknown(String),
}

impl Verdict {
    /// A verdict that waiting will not change by itself.
    pub fn is_final(&self) -> bool {
        matches!(self, Verdict::Ready | Verdict::Unavailable(_))
    }
}

pub fn judge(view: &View, route: &str) -> Verdict {
    match view.instances.get(route) {
        None => return Verdict::Unavailable("no such instance is registered".into()),
        Some(i) if i.withdrawn => return Verdict::Unavailable("the instance was withdrawn".into()),
        Some(_) => {}
    }
    let Some(assignment) = view.current_assignment(route) else {
        return Verdict::Degraded("not placed on a pool member yet".into());
    };
    if !view.is_live(&assignment.member, &assignment.process_id) {
        return Verdict::Unknown(format!("owner {} is disconnected", assignment.member));
    }
    let report = view
        .reports
        .get(route)
        .filter(|r| r.term == assignment.term && r.process_id == assignment.process_id);
    let Some(report) = report else {
        return Verdict::Degraded(format!(
            "owner {} has not reconciled to term {} yet",
            assignment.member, assignment.term
        ));
    };
    match report.phase.as_str() {
        "INSTANCE_PHASE_ACTIVE" => Verdict::Ready,
        "INSTANCE_PHASE_STARTING" | "INSTANCE_PHASE_RECOVERING" => {
            Verdict::Degraded(format!("owner {} reports {}", assignment.member, short(&report.phase)))
        }
        "ABSENT" => Verdict::Unavailable(format!(
            "owner {} reconciled term {} without hosting the instance",
            assignment.member, assignment.term
        )),
        phase => {
            let detail = if report.message.is_empty() {
                String::new()
            } else {
                format!(": {}", report.message)
            };
            Verdict::Unavailable(format!("owner {} reports {}{detail}", assignment.member, short(phase)))
        }
    }
}

fn short(phase: &str) -> String {
    phase
        .strip_prefix("INSTANCE_PHASE_")
        .unwrap_or(phase)
        .to_ascii_lowercase()
}

/// Wait until the instance's verdict is final (ready or unavailable), or
/// `limit` passes; returns the last verdict either way.
pub async fn wait_for_ready(mut view: watch::Receiver<Arc<View>>, route: &str, limit: Duration) -> Verdict {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let verdict = judge(&view.borrow_and_update(), route);
        if verdict.is_final() {
            return verdict;
        }
        match tokio::time::timeout_at(deadline, view.changed()).await {
            Ok(Ok(())) => {}
            _ => return verdict,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Assignment, AssignmentPhase, InstanceRecord, MemberRecord, Report, SecretBytes};

    fn view(report: Option<(&str, i64)>, live: bool) -> View {
        let mut v = View {
            now_ms: 1_000,
            ..View::default()
        };
        v.instances.insert(
            "r".into(),
            InstanceRecord {
                route: "r".into(),
                namespace: "ns".into(),
                name: "n".into(),
                uid: "u".into(),
                generation: 1,
                material: SecretBytes::default(),
                registered_at_ms: 0,
                withdrawn: false,
                last_term: 0,
                withdrawn_reason: None,
            },
        );
        v.assignments.insert(
            "r".into(),
            Assignment {
                route: "r".into(),
                member: "m".into(),
                process_id: "p".into(),
                term: 2,
                phase: AssignmentPhase::Active,
                generation: 1,
                placed_term: 1,
                coordinator_term: 1,
                updated_at_ms: 0,
            },
        );
        v.members.insert(
            "m".into(),
            MemberRecord {
                member: "m".into(),
                process_id: "p".into(),
                epoch: 1,
                runtime_address: String::new(),
                capacity: 1,
                served_by: String::new(),
                leaving: false,
                expires_at_ms: if live { 5_000 } else { 10 },
                updated_at_ms: 0,
            },
        );
        if let Some((phase, term)) = report {
            v.reports.insert(
                "r".into(),
                Report {
                    route: "r".into(),
                    term,
                    member: "m".into(),
                    process_id: "p".into(),
                    phase: phase.into(),
                    message: "boom".into(),
                    workload_pid: 1,
                    progress: 0,
                    reported_by: "gw".into(),
                    updated_at_ms: 0,
                },
            );
        }
        v
    }

    #[test]
    fn disconnected_owner_is_unknown_not_unavailable() {
        assert!(matches!(
            judge(&view(Some(("INSTANCE_PHASE_ACTIVE", 2)), false), "r"),
            Verdict::Unknown(_)
        ));
    }

    #[test]
    fn owner_behind_the_assignment_is_degraded() {
        assert!(matches!(judge(&view(None, true), "r"), Verdict::Degraded(_)));
        assert!(matches!(
            judge(&view(Some(("INSTANCE_PHASE_ACTIVE", 1)), true), "r"),
            Verdict::Degraded(_)
        ));
        assert!(matches!(
            judge(&view(Some(("INSTANCE_PHASE_STARTING", 2)), true), "r"),
            Verdict::Degraded(_)
        ));
    }

    #[test]
    fn only_an_owner_past_the_assignment_makes_it_unavailable() {
        assert_eq!(
            judge(&view(Some(("INSTANCE_PHASE_ACTIVE", 2)), true), "r"),
            Verdict::Ready
        );
        for phase in [
            "ABSENT",
            "INSTANCE_PHASE_STOPPED",
            "INSTANCE_PHASE_FAILED",
            "INSTANCE_PHASE_RELINQUISHED",
        ] {
            assert!(
                matches!(judge(&view(Some((phase, 2)), true), "r"), Verdict::Unavailable(_)),
                "{phase}"
            );
        }
        let unknown = judge(&view(Some(("SOMETHING_NEW", 2)), true), "r");
        assert!(
            matches!(&unknown, Verdict::Unavailable(why) if why.contains("something_new: boom")),
            "{unknown:?}"
        );
    }
}
