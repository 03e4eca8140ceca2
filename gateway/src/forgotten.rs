//! Terms the store forgot. A store restored from an older backup, or one that lost commits it
//! had acknowledged (an asynchronous replica promoted, a server stopped before it wrote them),
//! can hold less than the pool did, and nothing else would ever drive the route again:
//! - an owner reports a term above every term the store reserved for the route (the
//!   reservation was lost), or exactly the route's last term above its assignment (the
//!   reservation was lost and the owner's sidecar registered its fence since, on the owner's
//!   runtime.v1.StoreBehind);
//! - an owner reports active a term the store still shows reserved for it, longer than an
//!   activation takes to be written (the activation was lost; a member reports a reserved
//!   term STARTING until its activation was answered).
//!
//! - the store lost the instance itself (an emptied store, or one restored from a backup older
//!   than the instance): its owner keeps the session ([`unregistered`], for a bound) and tells
//!   the sidecar (runtime.v1.StoreBehind), which registers again with its fence at once; placement
//!   leaves the route alone for a moment ([`awaiting_holder`]) while the owner reports that term.
//!
//! Each such route is reserved anew for the owner that reports it, above that term: a move to
//! the same member through the fenced grant, receipt and activation, so the store catches up
//! with what the sidecar's fence holds and the workload stays where it runs. Until the
//! coordinator wrote it, an owner whose term the store lost keeps the session (the route is in
//! its snapshot's `keep_routes`), never releases it.
//!
//! Pure over the pool view; the coordinator writes what [`plan`] returns.

use std::time::Duration;

use crate::pool::View;
use crate::store::{AssignmentPhase, OwnershipTerm, Report, ReportPhase};

/// A reservation still not active this long after it was written, while its owner reports
/// the term active, lost its activation.
pub const ACTIVATION_LOST_AFTER_MS: i64 = 10_000;

/// How long a member keeps a session whose instance the store does not know at all, for its
/// sidecar to register again (told at once; one that is away registers by itself 5 s into its
/// recovery, `REGISTER_AGAIN_AFTER`). Past it the member lets the session go: a route whose
/// instance the store retired while the member was away has no sidecar left to register.
pub const UNREGISTERED_KEPT_FOR: Duration = Duration::from_secs(10);

/// How long placement leaves alone an instance a sidecar's registration recorded anew above
/// its fence, for the member that kept the session to report it (see [`awaiting_holder`]).
/// Placed all the same after it: the sidecar may be recovering, its owner gone.
pub const HOLDER_REPORT_GRACE_MS: i64 = 3_000;

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
    pub what: Lost,
}

/// What the store lost of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    Reservation,
    Activation,
    /// The instance itself: its sidecar registered it again with its fence.
    Instance,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Reservation => "its owner reports a term above every term the store reserved",
            Self::Activation => "its owner reports active a term the store still shows reserved",
            Self::Instance => "the store lost the instance; its owner reports the term its sidecar registered again",
        })
    }
}

/// Every route whose term the store forgot, in route order.
pub fn plan(view: &View) -> Vec<Forgotten> {
    view.reports
        .values()
        .filter_map(|report| {
            let what = lost(view, report)?;
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

/// Whether `report` is of a term the store forgot reserving — its owner keeps the route in
/// its snapshot meanwhile.
pub fn reported_above(view: &View, report: &Report) -> bool {
    matches!(lost(view, report), Some(Lost::Reservation | Lost::Instance))
}

/// The sessions a member says it runs at an activated term (ACTIVE or RECOVERING), by route:
/// the term and the workload (Pod UID and generation).
pub type Holding = std::collections::BTreeMap<String, (u64, proto::common::v1::InstanceRef)>;

/// Of what a member says it hosts (its latest complete report on its stream, stored or not),
/// the routes at a term the store does not know: above the route's assignment (or with none),
/// for the workload registered under the route. A store that rolled back forgot them; the
/// member keeps them (`keep_routes`) rather than release a session on the word of a store that
/// lost it — the first snapshot of a stream comes after that report. A route the store moved
/// to a higher term, a withdrawn instance or an older workload is not kept: the member lets go.
pub fn held_above<'a>(view: &'a View, holding: &'a Holding) -> impl Iterator<Item = &'a String> {
    holding.iter().filter_map(move |(route, (term, instance))| {
        let registered = view.instances.get(route).filter(|i| !i.withdrawn)?;
        let same_workload = registered.uid == instance.uid
            && u64::try_from(registered.generation).is_ok_and(|g| g == instance.generation);
        let unknown = view.assignments.get(route).is_none_or(|a| *term > a.term.get());
        (same_workload && unknown).then_some(route)
    })
}

/// Of what a member says it hosts, the routes whose instance the store does not know at all:
/// the store was emptied or restored from a backup older than the instance. The member keeps
/// them for [`UNREGISTERED_KEPT_FOR`] (its sidecar, told, registers again with its fence);
/// nothing is written or given on its word.
pub fn unregistered<'a>(view: &'a View, holding: &'a Holding) -> impl Iterator<Item = &'a String> {
    holding
        .keys()
        .filter(|route| !view.instances.contains_key(route.as_str()))
}

/// Whether placement leaves `route` alone for now: a registration recorded the desired
/// instance anew moments ago ([`recorded_anew`]), and no member's report gives it back yet.
/// The member that kept the session reports that term within a round or two, and the route
/// goes back to it ([`plan`]) rather than to whichever member placement would pick.
pub fn awaiting_holder(view: &View, route: &str) -> bool {
    let Some(instance) = view.instances.get(route).filter(|i| !i.withdrawn) else {
        return false;
    };
    recorded_anew(view, instance)
        && view.now_ms.saturating_sub(instance.registered_at_ms) < HOLDER_REPORT_GRACE_MS
        && view.reports.get(route).is_none_or(|r| lost(view, r).is_none())
}

/// Whether the store holds `instance` as its sidecar's registration recorded it anew: no
/// assignment, a term used before (the sidecar's fence), and the workload checkpoint the
/// registration gave. A new workload has used no term; a revived or replaced generation has no
/// checkpoint until its first grant, which takes an assignment.
fn recorded_anew(view: &View, instance: &crate::store::InstanceRecord) -> bool {
    !view.assignments.contains_key(&instance.route) && instance.last_term > OwnershipTerm::ZERO && instance.checkpointed
}

/// Of [`held_above`], the routes whose held term the store or the sidecar proved: at most the
/// route's last term (a sidecar's registration raises it to its fence). Only these statuses are
/// written at the member's own term; a term above it is the member's word alone, and written it
/// would have the route given to that member.
pub fn held_proven<'a>(view: &'a View, holding: &'a Holding) -> impl Iterator<Item = &'a String> {
    held_above(view, holding).filter(move |route| {
        let last = view.instances.get(route.as_str()).map_or(0, |i| i.last_term.get());
        holding.get(route.as_str()).is_some_and(|(term, _)| *term <= last)
    })
}

/// What the store lost of `report`'s route, if anything: only a desired instance's, reported
/// active by a live member process. A report of a term the store knew (such as an earlier
/// generation's owner's, whose last report outlived its withdrawal) is not a lost reservation.
fn lost(view: &View, report: &Report) -> Option<Lost> {
    let instance = view.instances.get(&report.route).filter(|i| !i.withdrawn)?;
    if report.phase != ReportPhase::Active || !view.is_live(&report.member, &report.process_id) {
        return None;
    }
    match view.assignments.get(&report.route) {
        a if a.is_none_or(|a| report.term > a.term) && report.term > instance.last_term => Some(Lost::Reservation),
        // The route's last term is the reported one, above this generation's assignment: the
        // owner's sidecar registered that fence after the store lost its reservation
        // (runtime.v1.StoreBehind). Given back to the owner, not recovered elsewhere.
        Some(a) if report.term > a.term && report.term == instance.last_term && a.generation == instance.generation => {
            Some(Lost::Reservation)
        }
        // The store lost the instance and learned it again from its sidecar's fence; the
        // member reports that very term: given back to it, the member that kept the session.
        None if report.term == instance.last_term && recorded_anew(view, instance) => Some(Lost::Instance),
        Some(a)
            if report.term == a.term
                && a.phase == AssignmentPhase::Reserved
                && a.member == report.member
                && a.process_id == report.process_id
                && view.now_ms.saturating_sub(a.updated_at_ms) > ACTIVATION_LOST_AFTER_MS =>
        {
            Some(Lost::Activation)
        }
        _ => None,
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

    /// ns/b reserved anew for `m1` (process `m1-p`) at `term`, replacing `expected`.
    fn to_m1(expected: Option<Term>, term: u64, what: Lost) -> Forgotten {
        Forgotten {
            route: "ns/b".into(),
            member: "m1".into(),
            process_id: "m1-p".into(),
            expected,
            term: Term::new(term),
            what,
        }
    }

    #[test]
    fn an_owner_reporting_a_term_the_store_forgot_gets_the_route_above_it_and_keeps_it_meanwhile() {
        // The store (restored) says ns/b is m2's at term 1, and reserved up to 4; m1 runs it
        // at term 5.
        let mut v = view();
        active(&mut v, "ns/b", 5);
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(4);
        assert_eq!(plan(&v), [to_m1(Some(Term::new(1)), 6, Lost::Reservation)]);
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        // No assignment at all: reserved above the report.
        let b = v.assignments.remove("ns/b").unwrap();
        v.instances.get_mut("ns/b").unwrap().last_term = Term::ZERO;
        let planned = plan(&v);
        assert_eq!((planned[0].expected, planned[0].term), (None, Term::new(6)));
        // A term the store reserved once (an earlier generation's owner, whose last report
        // outlived the withdrawal; the route registered again since): nothing forgotten.
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(5);
        v.instances.get_mut("ns/b").unwrap().generation = 2;
        assert!(plan(&v).is_empty());
        assert!(v.snapshot_for("m1", "m1-p", 0).keep_routes.is_empty());
        // The same generation's assignment (m2's at 1) below: the owner's sidecar raised the
        // last term to its fence (the store had lost the reservation) — given back to the
        // owner above it, not recovered elsewhere.
        v.instances.get_mut("ns/b").unwrap().generation = 1;
        v.assignments.insert("ns/b".into(), b);
        let planned = plan(&v);
        assert_eq!(
            (planned[0].expected, planned[0].term, planned[0].what),
            (Some(Term::new(1)), Term::new(6), Lost::Reservation)
        );
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        v.assignments.remove("ns/b");
        // The route's owner at the store's term, or a lower one, says nothing forgotten.
        let mut v = view();
        active(&mut v, "ns/a", 3);
        assert!(plan(&v).is_empty());
        active(&mut v, "ns/a", 2);
        assert!(plan(&v).is_empty());
        assert!(v.snapshot_for("m1", "m1-p", 0).keep_routes.is_empty());
    }

    fn assignment<'a>(v: &'a mut View, route: &str) -> &'a mut Assignment {
        v.assignments.get_mut(route).unwrap()
    }

    #[test]
    fn only_a_held_term_the_store_or_the_sidecar_proved_counts_as_held_above() {
        // ns/b is m2's at term 1; a member says it runs ns/b at 5.
        let mut v = view();
        let instance = crate::pool::instance_ref(&v.instances["ns/b"]);
        let holding: Holding = [("ns/b".to_owned(), (5, instance))].into();
        assert_eq!(held_above(&v, &holding).count(), 1, "kept: it keeps what it does");
        assert_eq!(held_proven(&v, &holding).count(), 0, "its word alone");
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(5);
        assert_eq!(held_proven(&v, &holding).count(), 1, "the sidecar registered fence 5");
    }

    #[test]
    fn an_instance_the_store_lost_is_kept_by_its_owner_and_given_back_to_it_once_its_sidecar_registered() {
        // The store was emptied: it knows neither ns/b nor its assignment; m1 runs it at 5.
        let mut v = view();
        let registered = v.instances.remove("ns/b").unwrap();
        v.assignments.remove("ns/b");
        let holding: Holding = [("ns/b".to_owned(), (5, crate::pool::instance_ref(&registered)))].into();
        assert_eq!(unregistered(&v, &holding).collect::<Vec<_>>(), ["ns/b"]);
        assert_eq!(held_above(&v, &holding).count(), 0);
        // Its sidecar registered again: fence 5, its workload checkpoint, 100 ms ago.
        v.instances.insert(
            "ns/b".into(),
            crate::store::InstanceRecord {
                last_term: Term::new(5),
                checkpointed: true,
                registered_at_ms: v.now_ms - 100,
                ..registered
            },
        );
        assert_eq!(unregistered(&v, &holding).count(), 0);
        assert_eq!(held_proven(&v, &holding).count(), 1, "its status is written at 5");
        assert!(awaiting_holder(&v, "ns/b"), "placement waits for the owner's report");
        assert!(plan(&v).is_empty());
        // A report of a lower term (a holder fenced out since) or not active: still waiting.
        active(&mut v, "ns/b", 4);
        assert!(awaiting_holder(&v, "ns/b"));
        active(&mut v, "ns/b", 5);
        v.reports.get_mut("ns/b").unwrap().phase = ReportPhase::Recovering;
        assert!(awaiting_holder(&v, "ns/b"));
        assert!(plan(&v).is_empty());
        // The owner's report of the fence's term: the route goes back to it, above the fence.
        v.reports.get_mut("ns/b").unwrap().phase = ReportPhase::Active;
        assert!(!awaiting_holder(&v, "ns/b"));
        assert_eq!(plan(&v), [to_m1(None, 6, Lost::Instance)]);
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        // Nobody reports it: placed as usual once the grace is over.
        v.reports.remove("ns/b");
        let now = v.now_ms;
        v.instances.get_mut("ns/b").unwrap().registered_at_ms = now - HOLDER_REPORT_GRACE_MS;
        assert!(!awaiting_holder(&v, "ns/b"));
        // A new workload (no term used) or a revived generation (no checkpoint) never waits.
        v.instances.get_mut("ns/b").unwrap().registered_at_ms = now;
        assert!(awaiting_holder(&v, "ns/b"));
        v.instances.get_mut("ns/b").unwrap().checkpointed = false;
        assert!(!awaiting_holder(&v, "ns/b"));
        active(&mut v, "ns/b", 5);
        assert!(
            plan(&v).is_empty(),
            "an earlier generation's owner's report gets nothing"
        );
        v.reports.remove("ns/b");
        let b = v.instances.get_mut("ns/b").unwrap();
        (b.checkpointed, b.last_term) = (true, Term::ZERO);
        assert!(!awaiting_holder(&v, "ns/b"));
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
            (Some(Term::new(3)), Term::new(4), Lost::Activation)
        );
        assert!(
            v.snapshot_for("m1", "m1-p", 0).keep_routes.is_empty(),
            "the reserved route is in its snapshot already"
        );
        // Starting (the activation not answered yet), or another member's reservation: nothing.
        v.reports.get_mut("ns/a").unwrap().phase = ReportPhase::Starting;
        assert!(plan(&v).is_empty());
        v.reports.get_mut("ns/a").unwrap().phase = ReportPhase::Active;
        assignment(&mut v, "ns/a").member = "m2".into();
        assert!(plan(&v).is_empty());
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
