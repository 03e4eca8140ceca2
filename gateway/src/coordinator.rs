//! The reconciler, on the lease holder only: places new instances, recovers
//! instances of gone owners at term + 1 as durable recover operations with
//! deadlines, drops assignments of withdrawn instances whose owner is gone,
//! and settles recover operations. Every write goes through `write_fenced`
//! with the lease it holds; followers never get here. A new coordinator
//! adopts the open operations it finds without relaunching anything and
//! without extending their deadlines. Every [`FORGET_RETIRED_EVERY`] it forgets the
//! replaced workloads and withdrawn instances retired longer than [`RETIRED_RETENTION`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::operations;
use crate::placement::Decision;
use crate::pool::View;
use crate::replica::Replica;
use crate::room;
use crate::store::{
    self, Assignment, AssignmentPhase, CoordinatorTerm, Displaced, FencedWrite, Lease, Operation, OperationKind,
    OperationPhase, OwnershipTerm,
};

/// Run while the replica runs; reconcile whenever this replica holds the
/// lease and the pool view or the lease changes.
pub async fn run(replica: Arc<Replica>, mut lease: watch::Receiver<Option<Lease>>, shutdown: CancellationToken) {
    let mut view = replica.view.clone();
    let mut unplaced: BTreeMap<String, String> = BTreeMap::new();
    // After a write, wait for a view read after it, so a stale read does
    // not plan the same change twice.
    let mut wrote_at_ms = 0;
    let mut started: Option<CoordinatorTerm> = None;
    // The view last planned, and when: an unchanged pool is planned again only as its
    // deadlines may come.
    let mut planned: Option<(Arc<View>, Instant)> = None;
    let mut forgot: Option<(CoordinatorTerm, Instant)> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = view.changed() => if changed.is_err() { return },
            changed = lease.changed() => if changed.is_err() { return },
        }
        let Some(held) = lease.borrow_and_update().clone() else {
            continue;
        };
        if started != Some(held.term) {
            // The first fenced write of the term: proves it can write, records when.
            match replica.store.write_fenced(&held, &[FencedWrite::StartTerm]).await {
                Ok(()) => {
                    info!(term = held.term.get(), "coordinating");
                    started = Some(held.term);
                    planned = None;
                }
                Err(err) => {
                    warn!(term = held.term.get(), error = %err, "cannot start coordinating");
                    continue;
                }
            }
        }
        let current = view.borrow_and_update().clone();
        if current.now_ms == 0 || current.now_ms <= wrote_at_ms {
            continue;
        }
        if forgot.is_none_or(|(term, at)| term != held.term || at.elapsed() >= FORGET_RETIRED_EVERY) {
            let retention_ms = i64::try_from(RETIRED_RETENTION.as_millis()).unwrap_or(i64::MAX);
            match replica
                .store
                .write_fenced(&held, &[FencedWrite::ForgetRetired { retention_ms }])
                .await
            {
                Ok(()) => forgot = Some((held.term, Instant::now())),
                Err(err) => warn!(error = %err, "cannot forget retired instances; retrying on the next view"),
            }
        }
        let unchanged =
            |(before, at): &(Arc<View>, Instant)| at.elapsed() < REPLAN_EVERY && current.same_plan_input(before);
        if planned.as_ref().is_some_and(unchanged) {
            continue;
        }
        planned = Some((Arc::clone(&current), Instant::now()));
        // Every line of the round (its decisions, each naming its route and member, and its
        // writes) carries the coordinator term it was planned under.
        let round = info_span!("round", term = held.term.get());
        let started = Instant::now();
        let writes = round.in_scope(|| plan(&current, replica.recovery_deadline_ms, &mut unplaced));
        replica.metrics.planned(started.elapsed());
        if writes.is_empty() {
            continue;
        }
        async {
            for batch in writes {
                match replica.store.write_fenced(&held, &batch).await {
                    Ok(()) => replica.metrics.written(&batch),
                    Err(store::Error::Fenced(why)) => {
                        warn!(term = held.term.get(), reason = %why, "coordinator write fenced; stepping back");
                        break;
                    }
                    Err(err) => {
                        warn!(error = %err, "coordinator write failed; will retry on the next view");
                        planned = None;
                    }
                }
            }
        }
        .instrument(round)
        .await;
        wrote_at_ms = replica.store.now_ms().await.unwrap_or(current.now_ms);
        replica.wake.notify_one();
    }
}

/// How often an unchanged pool is planned again: its time-bound decisions (operation and
/// recovery deadlines, retention) come at most this late. A changed pool is planned at once.
pub const REPLAN_EVERY: Duration = Duration::from_secs(1);

/// How long a replaced workload (`replaced_instances`) and a withdrawn instance are kept:
/// longer than every credential or record that can still name them — an instance token
/// bound to the replaced Pod UID (`timing::INSTANCE_TOKEN_LIFETIME`, 1 h; the replaced Pod's
/// own ServiceAccount tokens die with it, its name being taken by the new Pod), a grant of
/// one of their terms (≤ 30 s), an ended operation on the route (≤ 24 h, and any operation
/// record naming the route keeps it regardless), a Pod's termination grace — so no decision
/// made after it needs them. A withdrawn instance with an assignment is kept until the
/// assignment is gone.
pub const RETIRED_RETENTION: Duration = Duration::from_secs(24 * 60 * 60 + 60 * 60);
/// How often the coordinator forgets what retired longer than [`RETIRED_RETENTION`] ago
/// (and at the start of each of its terms).
pub const FORGET_RETIRED_EVERY: Duration = Duration::from_secs(10 * 60);

/// At most this many first placements in one fenced transaction.
pub const PLACEMENTS_PER_WRITE: usize = 128;
/// At most this many recoveries (each a compare-and-set and its operation) in one fenced
/// transaction: a crashed member's sessions are recovered in a few writes, not one each (256
/// sequential transactions took 3–4 s while the workloads waited, frozen).
pub const RECOVERIES_PER_WRITE: usize = 64;

/// One round: the fenced write batches the view calls for. Pure apart from
/// logging; `unplaced` remembers reasons already logged.
pub fn plan(view: &View, recovery_deadline_ms: u64, unplaced: &mut BTreeMap<String, String>) -> Vec<Vec<FencedWrite>> {
    let open_recoveries: BTreeMap<&str, &Operation> = view
        .operations
        .iter()
        .filter(|o| o.kind == OperationKind::Recover && !o.phase.is_finished())
        .map(|o| (o.target.as_str(), o))
        .collect();
    let mut batches = Vec::new();
    // First placements of new routes share fenced transactions (each is a compare-and-set on
    // "no assignment yet"; a conflict fails its batch, which the next round plans again).
    let mut placements = Vec::new();
    // Recoveries share fenced transactions the same way (a conflict fails its batch).
    let mut recoveries: Vec<[FencedWrite; 3]> = Vec::new();
    let mut still_unplaced = BTreeSet::new();
    let generation = |route: &str| view.instances.get(route).map_or(0, |i| i.generation);
    let mut replaced = BTreeSet::new();
    // The same reservation on the same member, above every term the route had, for a route
    // given back to the owner that runs it; placement leaves it alone this round.
    let given_back = |route: &str, member: &str, process_id: &str, term: OwnershipTerm, expected| {
        let placed_term = view.assignments.get(route).map_or(term, |a| a.placed_term);
        FencedWrite::Assign {
            expected_term: expected,
            next: reserved(route, member, process_id, term, generation(route), placed_term),
        }
    };
    // Routes whose term the store forgot go back to the owner that runs them, above it.
    let forgotten = crate::forgotten::plan(view);
    for f in &forgotten {
        warn!(route = %f.route, member = %f.member, term = f.term.get(), forgotten = %f.what,
              "the store forgot this route's term: reserving it anew for the owner that runs it");
        batches.push(vec![given_back(&f.route, &f.member, &f.process_id, f.term, f.expected)]);
    }
    // Routes reserved elsewhere while their owner was cut off from the gateways go back to it
    // once it attaches again, before the sidecar ever left it.
    let returned: Vec<_> = crate::returned::plan(view)
        .into_iter()
        .filter(|r| !forgotten.iter().any(|f| f.route == r.route))
        .collect();
    for r in &returned {
        info!(route = %r.route, member = %r.member, term = r.term.get(),
              "the owner the gateways lost is back and still serves the instance: reserving it anew for that owner");
        // Fails if the reservation was activated meanwhile (the sidecar did leave the owner).
        batches.push(vec![
            FencedWrite::EndDisplacement {
                route: r.route.clone(),
                for_term: r.expected,
            },
            given_back(&r.route, &r.member, &r.process_id, r.term, Some(r.expected)),
        ]);
    }
    let decisions: Vec<Decision> = room::decisions(view)
        .into_iter()
        .filter(|d| !forgotten.iter().any(|f| f.route == d.route()) && !returned.iter().any(|r| r.route == d.route()))
        .collect();
    for decision in decisions {
        let placing = matches!(decision, Decision::Place { .. } | Decision::Recover { .. });
        if placing && crate::forgotten::awaiting_holder(view, decision.route()) {
            debug!(route = %decision.route(), "its sidecar named the member that runs it above the store's term: waiting for that member to report it");
            continue;
        }
        match decision {
            Decision::Place { route, to } => {
                // Above every term the route ever had (a withdrawn generation's included).
                let term = view.fresh_term(&route, OwnershipTerm::new(1));
                info!(%route, member = %to.member, term = term.get(), "placing instance");
                let next = reserved(&route, &to.member, &to.process_id, term, generation(&route), term);
                placements.push(FencedWrite::Assign {
                    expected_term: None,
                    next,
                });
            }
            Decision::Replace { route, from, to, term } => {
                let term = view.fresh_term(&route, term);
                info!(
                    %route, stale_owner = %from.member, member = %to.member, term = term.get(),
                    "another workload registered the route: placing it anew"
                );
                let next = reserved(&route, &to.member, &to.process_id, term, generation(&route), term);
                let mut batch = vec![FencedWrite::Assign {
                    expected_term: Some(from.term),
                    next,
                }];
                // A recovery of the replaced workload has nothing left to recover.
                if let Some(op) = open_recoveries.get(route.as_str())
                    && replaced.insert(route.clone())
                {
                    batch.push(FencedWrite::PutOperation(Operation {
                        phase: OperationPhase::Cancelled,
                        message: "another workload registered the route".into(),
                        ..(*op).clone()
                    }));
                }
                batches.push(batch);
            }
            Decision::Recover { route, from, to, term } => {
                let term = view.fresh_term(&route, term);
                let overtaken = view.assignments.get(&route).is_some_and(|a| view.overtaken(a));
                let message = if from.failed {
                    // A live owner that gave its term up (fenced, a refused grant, or its
                    // sidecar cannot reach it) says why in its report.
                    let why = if overtaken {
                        "the route's sidecar registered a higher term, which the store had lost"
                    } else {
                        view.reports.get(&route).map_or("", |r| r.message.as_str())
                    };
                    info!(%route, from = %from.member, to = %to.member, term = term.get(), why, "recovering instance its owner gave up");
                    format!(
                        "owner {} (process {}) gave term {} up ({why}); moving to {} at term {term}",
                        from.member, from.process_id, from.term, to.member
                    )
                } else {
                    info!(%route, from = %from.member, to = %to.member, term = term.get(), "recovering instance from a gone owner");
                    format!(
                        "owner {} (process {}) is gone; moving to {} at term {term}",
                        from.member, from.process_id, to.member
                    )
                };
                let op = match open_recoveries.get(route.as_str()) {
                    // A further attempt of the same episode keeps its deadline.
                    Some(op) => Operation {
                        attempts: op.attempts + 1,
                        moves: op.moves + 1,
                        message,
                        ..(*op).clone()
                    },
                    None => Operation {
                        id: uuid::Uuid::new_v4().to_string(),
                        kind: OperationKind::Recover,
                        target: route.clone(),
                        phase: OperationPhase::Running,
                        message,
                        attempts: 1,
                        moves: 1,
                        deadline_at_ms: Some(
                            view.now_ms
                                .saturating_add(i64::try_from(recovery_deadline_ms).unwrap_or(i64::MAX)),
                        ),
                        max_parallel: 1,
                        requested_by: "coordinator".into(),
                        cancel_requested: false,
                        created_at_ms: 0,
                        updated_at_ms: 0,
                    },
                };
                let placed_term = view
                    .assignments
                    .get(&route)
                    .map_or(OwnershipTerm::new(1), |a| a.placed_term);
                let next = reserved(
                    &route,
                    &to.member,
                    &to.process_id,
                    term,
                    generation(&route),
                    placed_term,
                );
                // The active owner the gateways lost may only be cut off from them and still
                // serve the instance: recorded, so it gets the route back if it returns first
                // (`returned`). One that gave its term up serves nothing. A reservation never
                // activated displaced nobody new: the owner it displaced waits on this one now.
                let displaced = match view.assignments.get(&route) {
                    Some(a) if a.phase == AssignmentPhase::Active => (!from.failed).then(|| Displaced {
                        member: from.member.clone(),
                        process_id: from.process_id.clone(),
                        term: from.term,
                        for_term: term,
                    }),
                    Some(a) => view
                        .instances
                        .get(&route)
                        .and_then(|i| i.displaced.clone())
                        .filter(|d| d.for_term == a.term)
                        .map(|d| Displaced { for_term: term, ..d }),
                    None => None,
                };
                recoveries.push([
                    FencedWrite::Assign {
                        expected_term: Some(from.term),
                        next,
                    },
                    FencedWrite::Displace {
                        route: route.clone(),
                        displaced,
                    },
                    FencedWrite::PutOperation(op),
                ]);
            }
            Decision::Withdraw { route, term } => {
                info!(%route, term = term.get(), "dropping the assignment of a withdrawn instance; its owner releases it");
                batches.push(vec![FencedWrite::Unassign {
                    route,
                    expected_term: term,
                }]);
            }
            Decision::Unplaced { route, reason } => {
                if unplaced.get(&route) != Some(&reason) {
                    warn!(%route, %reason, "no pool member can take the instance");
                    unplaced.insert(route.clone(), reason);
                }
                still_unplaced.insert(route);
            }
        }
    }
    unplaced.retain(|route, _| still_unplaced.contains(route));
    batches.extend(
        recoveries
            .chunks(RECOVERIES_PER_WRITE)
            .map(<[[FencedWrite; 3]]>::concat),
    );
    batches.extend(placements.chunks(PLACEMENTS_PER_WRITE).map(<[FencedWrite]>::to_vec));
    for op in open_recoveries.values().filter(|op| !replaced.contains(&op.target)) {
        if let Some(settled) = settle(view, op) {
            batches.push(vec![FencedWrite::PutOperation(settled)]);
        }
    }
    // Planned moves only when placement and recovery had nothing to do this round.
    if batches.is_empty() {
        batches = operations::plan(view);
    }
    // Forgetting ended operations waits for a round with nothing else to write.
    if batches.is_empty() {
        let expired = operations::expired(view);
        if !expired.is_empty() {
            batches.push(expired);
        }
    }
    batches
}

/// A recover operation is done when the new owner reports the instance at
/// the assigned term; it fails when its deadline passes first.
fn settle(view: &View, op: &Operation) -> Option<Operation> {
    let (phase, message) = if view.instances.get(&op.target).is_none_or(|i| i.withdrawn) {
        (OperationPhase::Cancelled, "the instance was withdrawn".to_owned())
    } else if let Some((a, r)) = view
        .assignments
        .get(&op.target)
        .zip(view.reports.get(&op.target))
        .filter(|(a, r)| r.term == a.term && r.process_id == a.process_id)
        .filter(|(_, r)| r.phase.hosts())
    {
        (
            OperationPhase::Succeeded,
            format!("{} hosts the instance at term {} ({})", a.member, a.term, r.phase),
        )
    } else if op.deadline_at_ms.is_some_and(|d| view.now_ms > d) {
        (OperationPhase::Failed, "the recovery deadline passed".to_owned())
    } else {
        return None;
    };
    Some(Operation {
        phase,
        message,
        ..op.clone()
    })
}

fn reserved(
    route: &str,
    member: &str,
    process_id: &str,
    term: OwnershipTerm,
    generation: i64,
    placed_term: OwnershipTerm,
) -> Assignment {
    Assignment {
        route: route.to_owned(),
        member: member.to_owned(),
        process_id: process_id.to_owned(),
        term,
        phase: AssignmentPhase::Reserved,
        generation,
        placed_term,
        coordinator_term: crate::store::CoordinatorTerm::ZERO,
        updated_at_ms: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{InstanceRecord, MemberRecord, Report, ReportPhase, SecretBytes};

    fn view() -> View {
        let mut v = View {
            now_ms: 10_000,
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
                last_term: OwnershipTerm::new(0),
                withdrawn_reason: None,
                displaced: None,
                checkpointed: false,
                fence_holder: None,
            },
        );
        for m in ["a", "b"] {
            v.members.insert(
                m.into(),
                MemberRecord {
                    member: m.into(),
                    process_id: format!("{m}-p"),
                    epoch: 1,
                    runtime_address: String::new(),
                    capacity: 256,
                    served_by: String::new(),
                    leaving: false,
                    expires_at_ms: 20_000,
                    updated_at_ms: 0,
                },
            );
        }
        v
    }

    /// `n` more desired routes like `r`; their names.
    fn more_routes(v: &mut View, n: usize) -> Vec<String> {
        let template = v.instances["r"].clone();
        let routes: Vec<String> = (0..n).map(|i| format!("r{i:03}")).collect();
        for route in &routes {
            let instance = InstanceRecord {
                route: route.clone(),
                ..template.clone()
            };
            v.instances.insert(route.clone(), instance);
        }
        routes
    }

    fn assign(v: &mut View, member: &str, term: u64) {
        v.assignments.insert(
            "r".into(),
            reserved(
                "r",
                member,
                &format!("{member}-p"),
                OwnershipTerm::new(term),
                1,
                OwnershipTerm::new(1),
            ),
        );
    }

    #[test]
    fn first_placements_share_fenced_writes() {
        let mut v = view();
        more_routes(&mut v, 300);
        let batches = plan(&v, 60_000, &mut BTreeMap::new());
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(
            sizes,
            [
                PLACEMENTS_PER_WRITE,
                PLACEMENTS_PER_WRITE,
                301 - 2 * PLACEMENTS_PER_WRITE
            ]
        );
        let placed: BTreeSet<&str> = batches
            .iter()
            .flatten()
            .map(|w| match w {
                FencedWrite::Assign {
                    expected_term: None,
                    next,
                } => next.route.as_str(),
                other => panic!("only first placements: {other:?}"),
            })
            .collect();
        assert_eq!(placed.len(), 301, "every route once");
    }

    /// A store restored from an older backup holds an assignment below the term the sidecar
    /// activated since; the sidecar's registration raised the route's last term to its fence.
    /// The recovery reserves above it (the sidecar refuses any term at or below its fence).
    #[test]
    fn a_recovery_reserves_above_the_routes_last_term() {
        let mut v = view();
        assign(&mut v, "gone", 3);
        v.instances.get_mut("r").unwrap().last_term = OwnershipTerm::new(9);
        let batches = plan(&v, 60_000, &mut BTreeMap::new());
        let terms: Vec<(Option<OwnershipTerm>, OwnershipTerm)> = batches
            .iter()
            .flatten()
            .filter_map(|w| match w {
                FencedWrite::Assign { expected_term, next } => Some((*expected_term, next.term)),
                _ => None,
            })
            .collect();
        assert_eq!(terms, [(Some(OwnershipTerm::new(3)), OwnershipTerm::new(10))]);
    }

    #[test]
    fn recoveries_of_a_gone_member_share_fenced_writes() {
        let mut v = view();
        for route in more_routes(&mut v, 150) {
            v.assignments.insert(
                route.clone(),
                reserved(
                    &route,
                    "gone",
                    "gone-p",
                    OwnershipTerm::new(3),
                    1,
                    OwnershipTerm::new(1),
                ),
            );
        }
        assign(&mut v, "gone", 3);
        let batches = plan(&v, 60_000, &mut BTreeMap::new());
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(
            sizes,
            [
                3 * RECOVERIES_PER_WRITE,
                3 * RECOVERIES_PER_WRITE,
                3 * (151 - 2 * RECOVERIES_PER_WRITE)
            ]
        );
        let mut recovered = BTreeSet::new();
        for triple in batches.iter().flat_map(|b| b.chunks(3)) {
            let [
                FencedWrite::Assign {
                    expected_term: Some(expected),
                    next,
                },
                FencedWrite::Displace { .. },
                FencedWrite::PutOperation(op),
            ] = triple
            else {
                panic!("a compare-and-set, the owner it displaced and its operation: {triple:?}");
            };
            assert_eq!(*expected, OwnershipTerm::new(3));
            assert_eq!(
                (op.kind, op.target.as_str()),
                (OperationKind::Recover, next.route.as_str())
            );
            recovered.insert(next.route.clone());
        }
        assert_eq!(recovered.len(), 151, "every route once");
    }

    #[test]
    fn one_more_instance_fits_only_beyond_the_routes_still_to_place() {
        let with_capacity = |capacity: i64| {
            let mut v = view();
            v.members.values_mut().for_each(|m| m.capacity = capacity);
            v
        };
        // Two members of one slot each, one route still to place: room for one more.
        assert!(room::takes_one_more(&with_capacity(1)));
        // The route placed on `a`: `b`'s slot is free.
        let mut placed = with_capacity(1);
        assign(&mut placed, "a", 1);
        assert!(room::takes_one_more(&placed));
        // One member drained: its slot does not count, and the pending route takes the other.
        let mut drained = with_capacity(1);
        drained
            .operations
            .push(crate::operations::tests::op(OperationKind::Drain, "b", 1));
        assert!(!room::takes_one_more(&drained));
        // Nobody live.
        let mut nobody = view();
        nobody.now_ms = 30_000;
        assert!(!room::takes_one_more(&nobody));
        // Something is unplaced already (no capacity at all).
        assert!(!room::takes_one_more(&with_capacity(0)));
    }

    #[test]
    fn recovery_is_a_durable_operation_with_a_deadline_that_records_the_owner_it_displaced() {
        let mut v = view();
        assign(&mut v, "gone", 3);
        v.assignments.get_mut("r").unwrap().phase = AssignmentPhase::Active;
        let batches = plan(&v, 60_000, &mut BTreeMap::new());
        assert_eq!(batches.len(), 1);
        let [
            FencedWrite::Assign {
                expected_term: Some(expected),
                next,
            },
            FencedWrite::Displace { displaced, .. },
            FencedWrite::PutOperation(op),
        ] = batches[0].as_slice()
        else {
            panic!(
                "expected a compare-and-set, the displaced owner and an operation: {:?}",
                batches[0]
            );
        };
        assert_eq!(
            displaced
                .as_ref()
                .map(|d| (d.member.as_str(), d.process_id.as_str(), d.term, d.for_term)),
            Some(("gone", "gone-p", OwnershipTerm::new(3), OwnershipTerm::new(4))),
            "the gateways lost it: it may only be cut off from them"
        );
        assert_eq!(*expected, OwnershipTerm::new(3));
        assert_eq!(
            (next.term, next.phase),
            (OwnershipTerm::new(4), AssignmentPhase::Reserved)
        );
        assert_eq!(
            (op.kind, op.phase, op.deadline_at_ms),
            (OperationKind::Recover, OperationPhase::Running, Some(70_000))
        );
    }

    #[test]
    fn an_adopted_recovery_keeps_its_deadline_on_a_further_attempt() {
        let mut v = view();
        assign(&mut v, "gone", 4);
        let op = Operation {
            id: "op-1".into(),
            kind: OperationKind::Recover,
            target: "r".into(),
            phase: OperationPhase::Running,
            message: String::new(),
            attempts: 1,
            moves: 1,
            deadline_at_ms: Some(12_345),
            max_parallel: 1,
            requested_by: "coordinator".into(),
            cancel_requested: false,
            created_at_ms: 1,
            updated_at_ms: 1,
        };
        v.operations.push(op);
        let batches = plan(&v, 60_000, &mut BTreeMap::new());
        let FencedWrite::PutOperation(next) = &batches[0][2] else {
            panic!("{:?}", batches[0])
        };
        assert_eq!(
            (next.id.as_str(), next.attempts, next.deadline_at_ms),
            ("op-1", 2, Some(12_345))
        );
    }

    #[test]
    fn recoveries_settle_on_the_owners_report_or_the_deadline() {
        let mut v = view();
        assign(&mut v, "b", 4);
        let op = Operation {
            id: "op-1".into(),
            kind: OperationKind::Recover,
            target: "r".into(),
            phase: OperationPhase::Running,
            message: String::new(),
            attempts: 1,
            moves: 1,
            deadline_at_ms: Some(50_000),
            max_parallel: 1,
            requested_by: "coordinator".into(),
            cancel_requested: false,
            created_at_ms: 1,
            updated_at_ms: 1,
        };
        assert_eq!(settle(&v, &op), None, "nothing reported yet");
        v.reports.insert(
            "r".into(),
            Report {
                route: "r".into(),
                term: OwnershipTerm::new(4),
                member: "b".into(),
                process_id: "b-p".into(),
                phase: ReportPhase::Active,
                message: String::new(),
                workload_pid: 1,
                progress: Some(0),
                reported_by: "gw".into(),
                updated_at_ms: 0,
                policy: None,
            },
        );
        assert_eq!(settle(&v, &op).map(|o| o.phase), Some(OperationPhase::Succeeded));
        v.reports.clear();
        v.now_ms = 60_000;
        assert_eq!(settle(&v, &op).map(|o| o.phase), Some(OperationPhase::Failed));
    }
}
