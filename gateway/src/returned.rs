//! Owners that come back. A member cut off from every gateway replica (a partition, not a
//! crash) goes on serving its sidecars, which only dial it; the gateways cannot tell that from
//! a death, so its instances are reserved for other members — which wait for sidecars that
//! never come, since nothing is wrong with their owner. The instance records the owner each
//! such reservation displaced ([`Displaced`](crate::store::Displaced)); an activation clears it.
//!
//! When the displaced process attaches again while that reservation is still not activated, it
//! was most likely cut off, not gone, and still serves the instance (a sidecar that left it
//! takes the reservation and activates it, which ends the displacement; the write that gives
//! the route back fails if that happened meanwhile). The route is reserved anew for it, above
//! every term — a move on the same member, through the fenced grant, receipt and activation —
//! and it keeps the session meanwhile (`keep_routes` in its snapshot): the heal moves nothing.
//! Should it no longer hold the session, the takeover waits for the sidecar like any other.
//! Only that process can be given a route back this way, and only one the store says it held
//! active: nothing a member sends can make a route its own.
//!
//! Pure over the pool view; the coordinator writes what [`plan`] returns.

use crate::pool::View;
use crate::store::{AssignmentPhase, Displaced, OwnershipTerm};

/// A route to reserve anew for the owner it was taken from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    pub route: String,
    pub member: String,
    pub process_id: String,
    /// The reservation's term the write replaces.
    pub expected: OwnershipTerm,
    /// Above every term the route had.
    pub term: OwnershipTerm,
}

/// Every route whose displaced owner is live again, in route order.
pub fn plan(view: &View) -> Vec<Returned> {
    view.assignments
        .keys()
        .filter_map(|route| {
            let (displaced, expected) = waiting(view, route)?;
            view.is_live(&displaced.member, &displaced.process_id)
                .then(|| Returned {
                    route: route.clone(),
                    member: displaced.member.clone(),
                    process_id: displaced.process_id.clone(),
                    expected,
                    term: view.fresh_term(route, expected.next()),
                })
        })
        .collect()
}

/// The routes member process `process_id` of `member` keeps while a reservation that displaced
/// it waits: its snapshot must not make it release a session it may still hold.
pub fn kept<'a>(view: &'a View, member: &'a str, process_id: &'a str) -> impl Iterator<Item = &'a String> + 'a {
    view.assignments.keys().filter(move |route| {
        waiting(view, route).is_some_and(|(d, _)| d.member == member && d.process_id == process_id)
    })
}

/// What an operator is told of `route` while its reservation waits on an owner the gateways
/// lost and that has not come back: that owner may well be serving it.
pub fn unreachable_owner(view: &View, route: &str) -> Option<String> {
    let (d, term) = waiting(view, route)?;
    if view.is_live(&d.member, &d.process_id) {
        return None;
    }
    let restarted = view.members.get(&d.member).filter(|m| m.process_id != d.process_id);
    Some(match restarted {
        Some(m) => format!(
            "its owner {} restarted (process {}, was {}): reserved at term {term} until its sidecar comes",
            d.member, m.process_id, d.process_id
        ),
        None => format!(
            "its owner {} (process {}, term {}) is unreachable from the gateways and may still be serving it: \
             reserved at term {term} until its sidecar comes, or back to that owner if it attaches again first",
            d.member, d.process_id, d.term
        ),
    })
}

/// The owner `route`'s reservation displaced and the reservation's term, while it waits: the
/// instance is desired, and its assignment is the very reservation that displaced the owner
/// (not a later one of a drain, a rebalance or a new workload), still not activated.
fn waiting<'a>(view: &'a View, route: &str) -> Option<(&'a Displaced, OwnershipTerm)> {
    let instance = view.instances.get(route).filter(|i| !i.withdrawn)?;
    let displaced = instance.displaced.as_ref()?;
    let assignment = view.assignments.get(route)?;
    let other = assignment.member != displaced.member || assignment.process_id != displaced.process_id;
    (assignment.phase == AssignmentPhase::Reserved
        && assignment.term == displaced.for_term
        && other
        && !view.is_stale(assignment))
    .then_some((displaced, assignment.term))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::tests::view;
    use crate::store::OwnershipTerm as Term;

    /// `ns/a` (m1's at term 3 in the fixture) reserved for m2 at term 4 while m1 was cut off.
    fn displaced_from_m1() -> View {
        let mut v = view();
        let a = v.assignments.get_mut("ns/a").unwrap();
        (a.member, a.process_id, a.term, a.phase) =
            ("m2".into(), "m2-p".into(), Term::new(4), AssignmentPhase::Reserved);
        v.instances.get_mut("ns/a").unwrap().displaced = Some(Displaced {
            member: "m1".into(),
            process_id: "m1-p".into(),
            term: Term::new(3),
            for_term: Term::new(4),
        });
        v
    }

    #[test]
    fn the_displaced_process_live_again_gets_the_route_above_the_reservation_and_keeps_it_meanwhile() {
        let v = displaced_from_m1();
        assert_eq!(
            plan(&v),
            [Returned {
                route: "ns/a".into(),
                member: "m1".into(),
                process_id: "m1-p".into(),
                expected: Term::new(4),
                term: Term::new(5),
            }]
        );
        assert_eq!(kept(&v, "m1", "m1-p").collect::<Vec<_>>(), ["ns/a"]);
        assert_eq!(v.snapshot_for("m1", "m1-p", 0).keep_routes, ["ns/a"]);
        assert!(kept(&v, "m2", "m2-p").next().is_none());
        assert_eq!(unreachable_owner(&v, "ns/a"), None, "m1 is attached: not unreachable");
    }

    #[test]
    fn the_status_says_the_owner_is_unreachable_while_it_has_not_come_back() {
        let mut v = displaced_from_m1();
        v.members.get_mut("m1").unwrap().expires_at_ms = 0;
        let said = unreachable_owner(&v, "ns/a").unwrap();
        assert!(
            said.starts_with("its owner m1 (process m1-p, term 3) is unreachable from the gateways"),
            "{said}"
        );
        assert_eq!(unreachable_owner(&v, "ns/b"), None);
        v.members.get_mut("m1").unwrap().process_id = "m1-q".into();
        let said = unreachable_owner(&v, "ns/a").unwrap();
        assert!(
            said.starts_with("its owner m1 restarted (process m1-q, was m1-p)"),
            "{said}"
        );
    }

    #[test]
    fn nothing_returns_to_another_process_after_an_activation_or_for_a_withdrawn_instance() {
        let mut v = displaced_from_m1();
        v.members.get_mut("m1").unwrap().process_id = "m1-restarted".into();
        assert!(
            plan(&v).is_empty(),
            "a new process of the member holds nothing of the old one"
        );
        assert_eq!(
            kept(&v, "m1", "m1-p").count(),
            1,
            "the old process, if it is attached, keeps it"
        );

        let mut v = displaced_from_m1();
        v.assignments.get_mut("ns/a").unwrap().phase = AssignmentPhase::Active;
        assert!(
            plan(&v).is_empty() && kept(&v, "m1", "m1-p").next().is_none(),
            "the sidecar took the term"
        );

        let mut v = displaced_from_m1();
        let a = v.assignments.get_mut("ns/a").unwrap();
        (a.member, a.process_id) = ("m1".into(), "m1-p".into());
        assert!(plan(&v).is_empty(), "already reserved for it again");

        let mut v = displaced_from_m1();
        v.instances.get_mut("ns/a").unwrap().withdrawn = true;
        assert!(plan(&v).is_empty() && kept(&v, "m1", "m1-p").next().is_none());

        // A later reservation (a drain's move, a new workload's placement) is not the one that
        // displaced m1.
        let mut v = displaced_from_m1();
        v.assignments.get_mut("ns/a").unwrap().term = Term::new(5);
        assert!(plan(&v).is_empty() && kept(&v, "m1", "m1-p").next().is_none());
        let mut v = displaced_from_m1();
        v.instances.get_mut("ns/a").unwrap().generation = 2;
        assert!(plan(&v).is_empty(), "reserved for a workload the route no longer has");
    }
}
