//! Terms the store forgot. A store restored from an older backup, or one that lost commits it
//! had acknowledged (an asynchronous replica promoted), can hold less than the pool did: an
//! owner then reports a term above the route's assignment (or a route with no assignment), or
//! reports active a term the store still shows reserved — its activation was lost — and
//! nothing else would ever drive the route again. Each such route is reserved anew for the
//! owner that reports it, above every term it reported: a move to the same member through the
//! fenced grant, receipt and activation, so the store catches up with what the sidecar's fence
//! holds and the workload stays where it runs. Until the coordinator wrote it, the owner keeps
//! the session (the route is in its snapshot's `keep_routes`), never releases it.
//!
//! Pure over the pool view; the coordinator writes what [`plan`] returns.

use crate::pool::View;
use crate::store::{AssignmentPhase, OwnershipTerm, Report, ReportPhase};

/// A reservation still not active this long after it was written, while its owner reports
/// the term active, lost its activation.
pub const ACTIVATION_LOST_AFTER_MS: i64 = 10_000;

/// A route to reserve anew for the member process that reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forgotten {
    pub route: String,
    pub member: String,
    pub process_id: String,
    /// The assignment's term the write replaces (`None`: the store has none).
    pub expected: Option<OwnershipTerm>,
    /// Above every term the route had and the owner reported.
    pub term: OwnershipTerm,
    /// What the store forgot, for the log.
    pub what: &'static str,
}

/// Every route whose term the store forgot, in route order.
pub fn plan(view: &View) -> Vec<Forgotten> {
    view.reports
        .values()
        .filter_map(|report| {
            let what = forgot(view, report)?;
            let assignment = view.assignments.get(&report.route);
            let above = assignment.map_or(report.term, |a| a.term.max(report.term));
            Some(Forgotten {
                route: report.route.clone(),
                member: report.member.clone(),
                process_id: report.process_id.clone(),
                expected: assignment.map(|a| a.term),
                term: view.fresh_term(&report.route, above.next()),
                what,
            })
        })
        .collect()
}

/// Whether the owner reporting a term above the store's keeps `route` in its snapshot.
pub fn reported_above(view: &View, report: &Report) -> bool {
    forgot(view, report) == Some(REPORTED_ABOVE)
}

const REPORTED_ABOVE: &str = "its owner reports a term above the store's";
const ACTIVATION_LOST: &str = "the activation of its reserved term was lost";

/// What the store forgot of `report`'s route, if anything: only a desired instance's, by the
/// live member process that reports it active.
fn forgot(view: &View, report: &Report) -> Option<&'static str> {
    let desired = view.instances.get(&report.route).is_some_and(|i| !i.withdrawn);
    if !desired
        || report.phase != ReportPhase::Active
        || report.term == OwnershipTerm::ZERO
        || !view.is_live(&report.member, &report.process_id)
    {
        return None;
    }
    match view.assignments.get(&report.route) {
        None => Some(REPORTED_ABOVE),
        Some(a) if report.term > a.term => Some(REPORTED_ABOVE),
        Some(a)
            if report.term == a.term
                && a.phase == AssignmentPhase::Reserved
                && a.member == report.member
                && a.process_id == report.process_id
                && view.now_ms.saturating_sub(a.updated_at_ms) > ACTIVATION_LOST_AFTER_MS =>
        {
            Some(ACTIVATION_LOST)
        }
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::tests::{report, view};
    use crate::store::{Assignment, OwnershipTerm as Term};

    /// `m1`'s (live, process `m1-p`) report of `route` active at `term`.
    fn active(v: &mut View, route: &str, term: u64) {
        let report = report(route, Term::new(term), "m1", "m1-p", ReportPhase::Active);
        v.reports.insert(route.into(), report);
    }

    fn assignment<'a>(v: &'a mut View, route: &str) -> &'a mut Assignment {
        v.assignments.get_mut(route).unwrap()
    }

    #[test]
    fn an_owner_reporting_a_term_the_store_forgot_gets_the_route_above_it_and_keeps_it_meanwhile() {
        // The store (restored) says ns/b is m2's at term 1; m1 runs it at term 5.
        let mut v = view();
        active(&mut v, "ns/b", 5);
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(6);
        assert_eq!(
            plan(&v),
            [Forgotten {
                route: "ns/b".into(),
                member: "m1".into(),
                process_id: "m1-p".into(),
                expected: Some(Term::new(1)),
                term: Term::new(7),
                what: REPORTED_ABOVE,
            }]
        );
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        // No assignment at all: reserved above the report.
        v.assignments.remove("ns/b");
        v.instances.get_mut("ns/b").unwrap().last_term = Term::ZERO;
        let planned = plan(&v);
        assert_eq!((planned[0].expected, planned[0].term), (None, Term::new(6)));
        // The route's owner at the store's term, or a lower one, says nothing forgotten.
        let mut v = view();
        active(&mut v, "ns/a", 3);
        assert!(plan(&v).is_empty());
        active(&mut v, "ns/a", 2);
        assert!(plan(&v).is_empty());
        assert!(v.snapshot_for("m1", "m1-p", 0).keep_routes.is_empty());
    }

    #[test]
    fn a_reservation_whose_activation_was_lost_is_reserved_anew_for_its_owner_after_the_bound() {
        let mut v = view();
        assignment(&mut v, "ns/a").phase = AssignmentPhase::Reserved;
        active(&mut v, "ns/a", 3);
        assignment(&mut v, "ns/a").updated_at_ms = v.now_ms - ACTIVATION_LOST_AFTER_MS;
        assert!(plan(&v).is_empty(), "an activation may still be on its way");
        assignment(&mut v, "ns/a").updated_at_ms -= 1;
        let planned = plan(&v);
        assert_eq!(
            (planned[0].expected, planned[0].term, planned[0].what),
            (Some(Term::new(3)), Term::new(4), ACTIVATION_LOST)
        );
        assert!(
            v.snapshot_for("m1", "m1-p", 0).keep_routes.is_empty(),
            "the reserved route is in its snapshot already"
        );
    }

    #[test]
    fn only_a_live_owner_of_a_desired_instance_reporting_it_active_counts() {
        let mut v = view();
        active(&mut v, "ns/gone", 9);
        active(&mut v, "ns/b", 9);
        v.reports.get_mut("ns/b").unwrap().phase = ReportPhase::Recovering;
        assert!(plan(&v).is_empty(), "withdrawn, or not active");
        v.reports.get_mut("ns/b").unwrap().phase = ReportPhase::Active;
        v.reports.get_mut("ns/b").unwrap().process_id = "m1-old".into();
        assert!(plan(&v).is_empty(), "another process of the member");
    }
}
