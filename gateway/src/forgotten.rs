//! Terms the store forgot. A store restored from an older backup, or one that lost commits it
//! had acknowledged (an asynchronous replica promoted, a server stopped before it wrote them),
//! or emptied, can hold less than the pool did, and nothing else would ever drive the route
//! again:
//! - the store lost a reservation, or the instance itself: the owner keeps its session
//!   ([`reported_above`], [`unregistered`] for a bound) and tells the sidecar
//!   (runtime.v1.StoreBehind), which registers at once with its fence — the term it activated
//!   and the member process that activated it (`RegisterRequest.fence_member`). The route is
//!   given back to that process above the fence once it reports that term active ([`plan`]);
//!   placement and recovery leave it alone for a moment meanwhile ([`awaiting_holder`]);
//! - an owner reports active a term the store still shows reserved for it, longer than an
//!   activation takes to be written (the activation was lost; a member reports a reserved
//!   term STARTING until its activation was answered).
//!
//! Each such route is reserved anew for its owner, above that term: a move to the same member
//! through the fenced grant, receipt and activation, so the store catches up with what the
//! sidecar's fence holds and the workload stays where it runs.
//!
//! A lost route goes back only where its own sidecar and the member process it names agree: a
//! member's report alone gives it nothing (a member reporting a term it does not hold keeps its
//! own session on its word and pulls no other member's instance), nor does a sidecar's word
//! alone send it to a member that does not run it.
//!
//! Pure over the pool view; the coordinator writes what [`plan`] returns.

use std::time::Duration;

use crate::pool::View;
use crate::store::{AssignmentPhase, InstanceRecord, OwnershipTerm, Report, ReportPhase};

/// A reservation still not active this long after it was written, while its owner reports
/// the term active, lost its activation.
pub const ACTIVATION_LOST_AFTER_MS: i64 = 10_000;

/// How long a member keeps a session whose instance the store does not know at all, for its
/// sidecar to register again (told at once; one that is away registers by itself 5 s into its
/// recovery, `REGISTER_AGAIN_AFTER`). Past it the member lets the session go: a route whose
/// instance the store retired while the member was away has no sidecar left to register.
pub const UNREGISTERED_KEPT_FOR: Duration = Duration::from_secs(10);

/// How long placement and recovery leave alone an instance whose sidecar registered it naming
/// a member process that has not reported it yet (see [`awaiting_holder`]).
pub const HOLDER_GRACE_MS: i64 = 3_000;

/// A route to reserve anew for the member process that runs it.
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
            Self::Reservation => {
                "its sidecar registered a term above every term the store reserved, activated by this owner"
            }
            Self::Activation => "its owner reports active a term the store still shows reserved",
            Self::Instance => "the store lost the instance; its sidecar registered again, naming this owner",
        })
    }
}

/// Every route whose term the store forgot, in route order.
pub fn plan(view: &View) -> Vec<Forgotten> {
    let vouched = view
        .instances
        .values()
        .filter_map(|instance| given_back(view, instance));
    let activations = view.reports.values().filter_map(|report| {
        let assignment = view.assignments.get(&report.route)?;
        (claimed(view, report)? == Lost::Activation).then(|| Forgotten {
            route: report.route.clone(),
            member: report.member.clone(),
            process_id: report.process_id.clone(),
            expected: Some(assignment.term),
            term: view.fresh_term(&report.route, assignment.term.max(report.term).next()),
            what: Lost::Activation,
        })
    });
    let mut planned: Vec<Forgotten> = vouched.chain(activations).collect();
    planned.sort_by(|a, b| a.route.cmp(&b.route));
    planned.dedup_by(|a, b| a.route == b.route);
    planned
}

/// `instance` given back to the member process its sidecar registered as the holder of the
/// route's last term, when the store holds no assignment of it at that term (it lost the
/// reservation, or the instance) and that process, live, reports the term active: the sidecar
/// and the member agree. Neither alone moves the instance.
fn given_back(view: &View, instance: &InstanceRecord) -> Option<Forgotten> {
    let (holder, assignment) = unassigned_holder(view, instance)?;
    let confirmed = view
        .reports
        .get(&instance.route)
        .is_some_and(|r| r.phase == ReportPhase::Active && named(instance, r));
    (confirmed && view.is_live(&holder.member, &holder.process_id)).then(|| Forgotten {
        route: instance.route.clone(),
        member: holder.member.clone(),
        process_id: holder.process_id.clone(),
        expected: assignment.map(|a| a.term),
        term: view.fresh_term(&instance.route, holder.term.next()),
        what: match assignment {
            None => Lost::Instance,
            Some(a) if a.term == holder.term => Lost::Activation,
            Some(_) => Lost::Reservation,
        },
    })
}

/// The holder the sidecar of a desired `instance` registered for the route's last term, in
/// this generation, and the route's assignment — when that is below the holder's term (the
/// store lost the reservation), there is none (it lost the instance, or its first
/// reservation), or it is that very term still reserved for the holder (the store lost the
/// activation the sidecar confirmed, or reserved the number again for the same process after
/// losing it: nothing else would activate it, as the sidecar holds that term already).
fn unassigned_holder<'a>(
    view: &'a View,
    instance: &'a InstanceRecord,
) -> Option<(&'a crate::store::FenceHolder, Option<&'a crate::store::Assignment>)> {
    let holder = holder(instance)?;
    let assignment = view.assignments.get(&instance.route);
    let behind = |a: &crate::store::Assignment| {
        a.generation == instance.generation
            && (a.term < holder.term
                || (a.term == holder.term
                    && a.phase == AssignmentPhase::Reserved
                    && a.member == holder.member
                    && a.process_id == holder.process_id))
    };
    assignment.is_none_or(behind).then_some((holder, assignment))
}

/// The holder the sidecar of a desired `instance` registered for the route's last term, in
/// this generation.
fn holder(instance: &InstanceRecord) -> Option<&crate::store::FenceHolder> {
    instance.fence_holder.as_ref().filter(|h| {
        !instance.withdrawn
            && h.term > OwnershipTerm::ZERO
            && h.term == instance.last_term
            && h.generation == instance.generation
    })
}

/// Whether `report` is of a term the store forgot reserving — its owner keeps the route in
/// its snapshot meanwhile (on its own word: its sidecar vouches for it moments later).
pub fn reported_above(view: &View, report: &Report) -> bool {
    matches!(claimed(view, report), Some(Lost::Reservation | Lost::Instance))
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

/// Whether placement and recovery leave `route` alone for now: its sidecar registered it
/// moments ago naming the member process that activated its fence, above what the store holds,
/// and that process has not reported the term yet (it is attaching again: the store may have
/// lost its membership too). It is given back to it once it has ([`plan`]), rather than placed
/// wherever placement would pick; placed all the same after [`HOLDER_GRACE_MS`] (the
/// sidecar may be recovering, its owner gone).
pub fn awaiting_holder(view: &View, route: &str) -> bool {
    view.instances.get(route).is_some_and(|instance| {
        unassigned_holder(view, instance).is_some()
            && view.now_ms.saturating_sub(instance.registered_at_ms) < HOLDER_GRACE_MS
            && given_back(view, instance).is_none()
    })
}

/// Whether the store holds `instance` as its sidecar's registration recorded it anew: no
/// assignment, a term used before (the sidecar's fence), and the workload checkpoint the
/// registration gave. A new workload has used no term; a revived or replaced generation has no
/// checkpoint until its first grant, which takes an assignment.
fn recorded_anew(view: &View, instance: &InstanceRecord) -> bool {
    !view.assignments.contains_key(&instance.route) && instance.last_term > OwnershipTerm::ZERO && instance.checkpointed
}

/// Of [`held_above`], the routes whose held term the store or the sidecar proved for `member`'s
/// process: at most the route's last term (a sidecar's registration raises it to its fence),
/// and, where the sidecar named the process that activated that term, this one. Only these
/// statuses are written at the member's own term: the route's status in the store is its
/// owner's, never a claimant's.
pub fn held_proven<'a>(
    view: &'a View,
    (member, process_id): (&'a str, &'a str),
    holding: &'a Holding,
) -> impl Iterator<Item = &'a String> {
    held_above(view, holding).filter(move |route| {
        let Some(instance) = view.instances.get(route.as_str()) else {
            return false;
        };
        holding.get(route.as_str()).is_some_and(|(term, _)| {
            *term <= instance.last_term.get()
                && holder(instance).is_none_or(|h| h.is(OwnershipTerm::new(*term), member, process_id))
        })
    })
}

/// Whether the sidecar named `report`'s member process as the holder of the reported term.
fn named(instance: &InstanceRecord, report: &Report) -> bool {
    holder(instance).is_some_and(|h| h.is(report.term, &report.member, &report.process_id))
}

/// What `report`'s member says the store lost of its route, if anything: only a desired
/// instance's, reported active by a live member process. A report of a term the store knew
/// (such as an earlier generation's owner's, whose last report outlived its withdrawal) is not
/// a lost reservation.
fn claimed(view: &View, report: &Report) -> Option<Lost> {
    let instance = view.instances.get(&report.route).filter(|i| !i.withdrawn)?;
    if report.phase != ReportPhase::Active || !view.is_live(&report.member, &report.process_id) {
        return None;
    }
    match view.assignments.get(&report.route) {
        a if a.is_none_or(|a| report.term > a.term) && report.term > instance.last_term => Some(Lost::Reservation),
        // The route's last term is the reported one, above this generation's assignment: the
        // owner's sidecar registered that fence after the store lost its reservation
        // (runtime.v1.StoreBehind). Kept until it is given back to the process it named.
        Some(a) if report.term > a.term && report.term == instance.last_term && a.generation == instance.generation => {
            Some(Lost::Reservation)
        }
        // The store lost the instance (or its first reservation) and learned it again from its
        // sidecar's fence; the member reports that very term: kept likewise.
        None if report.term == instance.last_term && (recorded_anew(view, instance) || named(instance, report)) => {
            Some(Lost::Instance)
        }
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

    /// `route`'s sidecar registered fence `term`, activated by `member`'s process
    /// `<member>-p`.
    fn vouch(v: &mut View, route: &str, term: u64, member: &str) {
        let instance = v.instances.get_mut(route).unwrap();
        instance.last_term = Term::new(term);
        instance.fence_holder = Some(crate::store::FenceHolder {
            member: member.into(),
            process_id: format!("{member}-p"),
            term: Term::new(term),
            generation: instance.generation,
        });
    }

    fn named_holder<'a>(v: &'a mut View, route: &str) -> &'a mut crate::store::FenceHolder {
        v.instances.get_mut(route).unwrap().fence_holder.as_mut().unwrap()
    }

    fn live(v: &mut View, member: &str, live: bool) {
        v.members.get_mut(member).unwrap().expires_at_ms = v.now_ms + if live { 5_000 } else { -1 };
    }

    /// `member`'s (process `<member>-p`) report of `route` active at `term`.
    fn reported(v: &mut View, route: &str, term: u64, member: &str) {
        let report = report(
            route,
            Term::new(term),
            member,
            &format!("{member}-p"),
            ReportPhase::Active,
        );
        v.reports.insert(route.into(), report);
    }

    #[test]
    fn a_lost_reservation_goes_back_where_the_sidecar_and_the_member_it_names_agree() {
        // The store (restored) says ns/b is m2's at term 1, and reserved up to 4; m1 runs it
        // at term 5.
        let mut v = view();
        active(&mut v, "ns/b", 5);
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(4);
        assert!(plan(&v).is_empty(), "m1's word alone moves nothing");
        assert!(!awaiting_holder(&v, "ns/b"));
        assert_eq!(
            v.snapshot_for("m1", "m1-p", 0).keep_routes,
            ["ns/b"],
            "m1 keeps its session"
        );
        // Its sidecar registered fence 5, activated by m1's process: reserved anew for m1,
        // above it, not recovered elsewhere.
        vouch(&mut v, "ns/b", 5, "m1");
        assert_eq!(plan(&v), [to_m1(Some(Term::new(1)), 6, Lost::Reservation)]);
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        // Before m1 reports it: the sidecar's word alone moves nothing either; placement and
        // recovery wait for m1 a moment.
        v.reports.clear();
        assert!(plan(&v).is_empty());
        assert!(awaiting_holder(&v, "ns/b"));
        v.instances.get_mut("ns/b").unwrap().registered_at_ms = v.now_ms - HOLDER_GRACE_MS;
        assert!(!awaiting_holder(&v, "ns/b"), "placed all the same past the grace");
        // The sidecar named m2 while m1 reports it: nothing; m2 reports it too (live): m2's.
        active(&mut v, "ns/b", 5);
        vouch(&mut v, "ns/b", 5, "m2");
        assert!(plan(&v).is_empty(), "a member the sidecar did not name");
        live(&mut v, "m2", true);
        reported(&mut v, "ns/b", 5, "m2");
        let planned = plan(&v);
        assert_eq!(
            (
                planned.len(),
                planned[0].member.as_str(),
                planned[0].process_id.as_str()
            ),
            (1, "m2", "m2-p")
        );
        live(&mut v, "m2", false);
        assert!(plan(&v).is_empty(), "a process no longer live");
        // Another process of m1, an earlier generation's holder, or a term used above the named
        // one since: nothing.
        active(&mut v, "ns/b", 5);
        vouch(&mut v, "ns/b", 5, "m1");
        named_holder(&mut v, "ns/b").process_id = "m1-old".into();
        assert!(plan(&v).is_empty(), "an earlier process of the member");
        vouch(&mut v, "ns/b", 5, "m1");
        named_holder(&mut v, "ns/b").generation = 0;
        assert!(plan(&v).is_empty(), "an earlier generation");
        vouch(&mut v, "ns/b", 5, "m1");
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(6);
        assert!(plan(&v).is_empty());
        // No assignment at all (the store lost the first reservation): given back above it.
        v.assignments.remove("ns/b");
        vouch(&mut v, "ns/b", 5, "m1");
        assert_eq!(plan(&v), [to_m1(None, 6, Lost::Instance)]);
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        // A term the store reserved once (an earlier generation's owner, whose last report
        // outlived the withdrawal; a new workload registered since, naming no holder):
        // nothing forgotten, nothing kept.
        let b = v.instances.get_mut("ns/b").unwrap();
        (b.generation, b.fence_holder) = (2, None);
        assert!(plan(&v).is_empty());
        assert!(v.snapshot_for("m1", "m1-p", 0).keep_routes.is_empty());
        // The route's owner at the store's term, or a lower one, says nothing forgotten.
        let mut v = view();
        active(&mut v, "ns/a", 3);
        vouch(&mut v, "ns/a", 3, "m1");
        assert!(plan(&v).is_empty());
        assert!(!awaiting_holder(&v, "ns/a"));
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
        let m1 = ("m1", "m1-p");
        assert_eq!(held_proven(&v, m1, &holding).count(), 0, "its word alone");
        v.instances.get_mut("ns/b").unwrap().last_term = Term::new(5);
        assert_eq!(
            held_proven(&v, m1, &holding).count(),
            1,
            "the sidecar registered fence 5"
        );
        vouch(&mut v, "ns/b", 5, "m1");
        assert_eq!(held_proven(&v, m1, &holding).count(), 1, "naming m1");
        vouch(&mut v, "ns/b", 5, "m2");
        assert_eq!(held_proven(&v, m1, &holding).count(), 0, "naming another member");
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
        // Its sidecar registered again 100 ms ago: fence 5, activated by m1's process, and its
        // workload checkpoint. m1 has not attached again yet (its membership was lost too).
        v.instances.insert(
            "ns/b".into(),
            crate::store::InstanceRecord {
                checkpointed: true,
                registered_at_ms: v.now_ms - 100,
                ..registered
            },
        );
        vouch(&mut v, "ns/b", 5, "m1");
        live(&mut v, "m1", false);
        assert_eq!(unregistered(&v, &holding).count(), 0);
        assert_eq!(
            held_proven(&v, ("m1", "m1-p"), &holding).count(),
            1,
            "its status is written at 5"
        );
        assert_eq!(held_proven(&v, ("m2", "m2-p"), &holding).count(), 0, "not another's");
        assert!(awaiting_holder(&v, "ns/b"), "placement waits for m1");
        assert!(plan(&v).is_empty());
        // Another live member reporting the fence's term (its sidecar did not name it): nothing.
        live(&mut v, "m2", true);
        reported(&mut v, "ns/b", 5, "m2");
        assert!(plan(&v).is_empty(), "a member the sidecar did not name pulls nothing");
        assert!(awaiting_holder(&v, "ns/b"));
        // m1 attached again and reports the fence's term: the route goes back to it, above.
        live(&mut v, "m1", true);
        active(&mut v, "ns/b", 5);
        assert!(!awaiting_holder(&v, "ns/b"));
        assert_eq!(plan(&v), [to_m1(None, 6, Lost::Instance)]);
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/b"]);
        // m1 does not come back: placed as usual once the grace is over.
        v.reports.clear();
        let now = v.now_ms;
        v.instances.get_mut("ns/b").unwrap().registered_at_ms = now - HOLDER_GRACE_MS;
        assert!(!awaiting_holder(&v, "ns/b"));
        // A sidecar that names no holder (a new workload, or an earlier build) never waits.
        v.instances.get_mut("ns/b").unwrap().registered_at_ms = now;
        assert!(awaiting_holder(&v, "ns/b"));
        v.instances.get_mut("ns/b").unwrap().fence_holder = None;
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
        // The sidecar registered that very term activated by m1, which reports it: no wait.
        let mut v = view();
        assignment(&mut v, "ns/a").phase = AssignmentPhase::Reserved;
        active(&mut v, "ns/a", 3);
        vouch(&mut v, "ns/a", 3, "m1");
        assert_eq!(
            plan(&v),
            [Forgotten {
                route: "ns/a".into(),
                ..to_m1(Some(Term::new(3)), 4, Lost::Activation)
            }]
        );
        // Reserved there for another process (the number reserved again for another member):
        // not the holder's to take back.
        assignment(&mut v, "ns/a").process_id = "m1-old".into();
        assert!(plan(&v).is_empty());
    }

    #[test]
    fn only_a_desired_instance_is_given_back() {
        let mut v = view();
        vouch(&mut v, "ns/gone", 9, "m1");
        active(&mut v, "ns/gone", 9);
        assert!(plan(&v).is_empty(), "withdrawn");
        vouch(&mut v, "ns/b", 9, "m1");
        active(&mut v, "ns/b", 9);
        assert_eq!(plan(&v).len(), 1);
    }
}
