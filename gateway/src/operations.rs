//! Planned moves: operator drains and rebalances, and the moves off members that announced
//! they are leaving. Pure state machines over the pool view; the coordinator writes what they
//! decide through `write_fenced`, next to placement and recovery.
//!
//! A move is the same handoff as a recovery — the assignment goes to another member at
//! term + 1 (compare-and-set on the old term) — except that the old owner is alive: it sees
//! the route leave its snapshot and relinquishes, and the new owner takes over through the
//! sidecar's fence. Only settled assignments (active at their term, owner alive) move, and at
//! most `max_parallel` handoffs (pool-wide, recoveries included) are in flight at a time.
//!
//! Lifecycle: an operator's request is recorded `Pending` by any replica; the coordinator
//! admits it (`Running`), finishes it (`Succeeded` when nothing is left to move and no handoff
//! is in flight), fails it at its deadline, and applies cancellations. A succeeded drain keeps
//! its member out of placement until the drain is cancelled.
//!
//! A dry run ([`preview`]) runs the same rounds over a copy of the view and writes nothing.
//!
//! Ended operations are forgotten after their retention ([`expired`]), so the records every
//! replica reads stay proportional to recent activity, not to the pool's history.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

mod preview;

pub use preview::{PlannedMove, Preview, Refusal, equivalent, preview};

use crate::placement::{Candidate, least_loaded};
use crate::pool::View;
use crate::store::{Assignment, AssignmentPhase, FencedWrite, Operation, OperationKind, OperationPhase};

/// Concurrent handoffs off leaving members (no operation asks for them).
pub const LEAVING_PARALLEL: usize = 8;

/// Members that take nothing new because of a drain: running or pending, or succeeded and
/// not cancelled.
pub fn drained(view: &View) -> BTreeSet<String> {
    view.operations
        .iter()
        .filter(|op| op.kind == OperationKind::Drain)
        .filter(|op| !op.phase.is_finished() || (op.phase == OperationPhase::Succeeded && !op.cancel_requested))
        .map(|op| op.target.clone())
        .collect()
}

/// How long an ended recovery stays on record (for `poolctl status` and the pool's status).
pub const ENDED_RECOVERY_RETENTION: Duration = Duration::from_secs(10 * 60);
/// How long an ended drain or rebalance stays on record. A succeeded drain that was not
/// cancelled is still in force (its member takes nothing new) and stays until cancelled.
pub const ENDED_OPERATION_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// At most this many ended operations are forgotten in one fenced write.
pub const EXPIRED_PER_ROUND: usize = 256;

/// Ended operations whose retention passed, oldest first (at most [`EXPIRED_PER_ROUND`]): the
/// coordinator deletes them. Open operations and drains still in force are never among them.
pub fn expired(view: &View) -> Vec<FencedWrite> {
    let retention = |kind: OperationKind| {
        let keep = match kind {
            OperationKind::Drain | OperationKind::Rebalance => ENDED_OPERATION_RETENTION,
            OperationKind::Assign | OperationKind::Recover => ENDED_RECOVERY_RETENTION,
        };
        i64::try_from(keep.as_millis()).unwrap_or(i64::MAX)
    };
    let in_force = |op: &Operation| {
        op.kind == OperationKind::Drain && op.phase == OperationPhase::Succeeded && !op.cancel_requested
    };
    let mut ended: Vec<&Operation> = view
        .operations
        .iter()
        .filter(|op| op.phase.is_finished() && !in_force(op))
        .filter(|op| op.updated_at_ms < view.now_ms.saturating_sub(retention(op.kind)))
        .collect();
    ended.sort_by_key(|op| op.updated_at_ms);
    ended
        .into_iter()
        .take(EXPIRED_PER_ROUND)
        .map(|op| FencedWrite::DeleteOperation { id: op.id.clone() })
        .collect()
}

/// Whether `a` is settled: its owner reported the instance active (or starting) at its term.
fn settled(view: &View, a: &Assignment) -> bool {
    a.phase == AssignmentPhase::Active
        || view.reports.get(&a.route).is_some_and(|r| {
            r.term == a.term
                && r.process_id == a.process_id
                && matches!(r.phase.as_str(), "INSTANCE_PHASE_ACTIVE" | "INSTANCE_PHASE_STARTING")
        })
}

/// Handoffs in flight: assignments past the term their generation was placed at that have
/// not settled.
pub fn in_flight(view: &View) -> usize {
    view.assignments
        .values()
        .filter(|a| a.term > a.placed_term && !settled(view, a))
        .count()
}

/// One round's writes for the open operations and the leaving members.
pub fn plan(view: &View) -> Vec<Vec<FencedWrite>> {
    let mut round = Round::new(view);
    for op in &view.operations {
        round.operation(op);
    }
    round.leaving();
    round.batches
}

struct Round<'v> {
    view: &'v View,
    /// Eligible targets (live, not leaving, not drained).
    candidates: Vec<Candidate>,
    load: BTreeMap<String, usize>,
    in_flight: usize,
    /// Routes given a move this round.
    moved: BTreeSet<String>,
    batches: Vec<Vec<FencedWrite>>,
    /// Why the last move asked for could not be made (no eligible member with room).
    refusal: Option<String>,
}

impl<'v> Round<'v> {
    fn new(view: &'v View) -> Self {
        let candidates = view.candidates(&drained(view));
        let mut load: BTreeMap<String, usize> = candidates.iter().map(|c| (c.member.clone(), 0)).collect();
        for a in view.assignments.values().filter(|a| view.holds_desired(a)) {
            *load.entry(a.member.clone()).or_default() += 1;
        }
        Self {
            view,
            candidates,
            load,
            in_flight: in_flight(view),
            moved: BTreeSet::new(),
            batches: Vec::new(),
            refusal: None,
        }
    }

    fn put(&mut self, op: &Operation, phase: OperationPhase, message: String) {
        if op.phase == phase && op.message == message {
            return;
        }
        self.batches.push(vec![FencedWrite::PutOperation(Operation {
            phase,
            message,
            ..op.clone()
        })]);
    }

    fn operation(&mut self, op: &Operation) {
        if !matches!(op.kind, OperationKind::Drain | OperationKind::Rebalance) {
            return;
        }
        if op.cancel_requested {
            let message = if op.phase == OperationPhase::Succeeded {
                format!("cancelled: {} is back in service", op.target)
            } else {
                "cancelled by an operator; moves already made stay".to_owned()
            };
            if !op.phase.is_finished() || op.phase == OperationPhase::Succeeded {
                self.put(op, OperationPhase::Cancelled, message);
            }
            return;
        }
        if op.phase.is_finished() {
            return;
        }
        if op.deadline_at_ms.is_some_and(|d| self.view.now_ms > d) {
            let message = format!("the deadline passed after {} moves", op.moves);
            self.put(op, OperationPhase::Failed, message);
            return;
        }
        match op.kind {
            OperationKind::Drain => self.drain(op),
            _ => self.rebalance(op),
        }
    }

    /// Settled routes of a live `member`, in route order.
    fn movable(&self, member: &str) -> Vec<Assignment> {
        self.view
            .assignments
            .values()
            .filter(|a| a.member == member && self.view.is_live(&a.member, &a.process_id))
            .filter(|a| settled(self.view, a) && !self.moved.contains(&a.route))
            .filter(|a| self.view.instances.get(&a.route).is_some_and(|i| !i.withdrawn))
            .cloned()
            .collect()
    }

    /// Move `a` to the least-loaded eligible member other than its owner.
    fn move_one(&mut self, a: &Assignment) -> Result<String, String> {
        let others: Vec<Candidate> = self
            .candidates
            .iter()
            .filter(|c| c.member != a.member)
            .cloned()
            .collect();
        let to = least_loaded(&others, &self.load)
            .inspect_err(|reason| self.refusal = Some(reason.clone()))?
            .clone();
        *self.load.entry(to.member.clone()).or_default() += 1;
        if let Some(n) = self.load.get_mut(&a.member) {
            *n = n.saturating_sub(1);
        }
        self.in_flight += 1;
        self.moved.insert(a.route.clone());
        self.batches.push(vec![FencedWrite::Assign {
            expected_term: Some(a.term),
            next: Assignment {
                route: a.route.clone(),
                member: to.member.clone(),
                process_id: to.process_id.clone(),
                term: a.term + 1,
                phase: AssignmentPhase::Reserved,
                generation: a.generation,
                placed_term: a.placed_term,
                coordinator_term: 0,
                updated_at_ms: 0,
            },
        }]);
        Ok(to.member)
    }

    fn budget(&self, max_parallel: i64) -> usize {
        usize::try_from(max_parallel.clamp(1, i64::from(proto::MAX_MAX_PARALLEL)))
            .unwrap_or(1)
            .saturating_sub(self.in_flight)
    }

    fn drain(&mut self, op: &Operation) {
        let member = op.target.as_str();
        let remaining = self
            .view
            .assignments
            .values()
            .filter(|a| a.member == member && self.view.holds_desired(a))
            .count();
        if remaining == 0 && self.in_flight == 0 {
            let message = format!("{member} drained: {} instances moved", op.moves);
            self.put(op, OperationPhase::Succeeded, message);
            return;
        }
        let mut moved = 0;
        let mut waiting = None;
        for a in self.movable(member).into_iter().take(self.budget(op.max_parallel)) {
            match self.move_one(&a) {
                Ok(_) => moved += 1,
                Err(reason) => {
                    waiting = Some(reason);
                    break;
                }
            }
        }
        let message = match waiting {
            Some(reason) if moved == 0 => format!("waiting: {reason}"),
            _ => format!("moving {remaining} instances off {member}"),
        };
        self.progress(op, moved, message);
    }

    fn rebalance(&mut self, op: &Operation) {
        let eligible: Vec<String> = self
            .candidates
            .iter()
            .filter(|c| !c.excluded)
            .map(|c| c.member.clone())
            .collect();
        let mut moved = 0;
        let mut budget = self.budget(op.max_parallel);
        while budget > 0 {
            let by_load = |load: &BTreeMap<String, usize>| {
                let mut members: Vec<(usize, &String)> = eligible
                    .iter()
                    .map(|m| (load.get(m).copied().unwrap_or(0), m))
                    .collect();
                members.sort();
                members
            };
            let members = by_load(&self.load);
            let (Some(&(low, _)), Some(&(high, busiest))) = (members.first(), members.last()) else {
                break;
            };
            if high <= low + 1 {
                break;
            }
            let busiest = busiest.clone();
            let Some(a) = self.movable(&busiest).into_iter().next() else {
                break;
            };
            if self.move_one(&a).is_err() {
                break;
            }
            moved += 1;
            budget -= 1;
        }
        let loads: Vec<usize> = eligible
            .iter()
            .map(|m| self.load.get(m).copied().unwrap_or(0))
            .collect();
        let spread = loads.iter().max().unwrap_or(&0) - loads.iter().min().unwrap_or(&0);
        if moved == 0 && spread <= 1 && self.in_flight == 0 {
            let message = format!("balanced over {} members after {} moves", eligible.len(), op.moves);
            self.put(op, OperationPhase::Succeeded, message);
            return;
        }
        let message = format!("evening out {} members (spread {spread})", eligible.len());
        self.progress(op, moved, message);
    }

    /// Record an admitted or progressing operation.
    fn progress(&mut self, op: &Operation, moved: i64, message: String) {
        if moved == 0 && op.phase == OperationPhase::Running && op.message == message {
            return;
        }
        let next = Operation {
            phase: OperationPhase::Running,
            message,
            attempts: op.attempts + moved,
            moves: op.moves + moved,
            ..op.clone()
        };
        // Written with the moves of this round, so a crash between them is impossible.
        match self.batches.last_mut() {
            Some(batch) if moved > 0 => batch.push(FencedWrite::PutOperation(next)),
            _ => self.batches.push(vec![FencedWrite::PutOperation(next)]),
        }
    }

    /// Instances of live members that announced they are leaving move away.
    fn leaving(&mut self) {
        let leaving: Vec<String> = self
            .view
            .members
            .values()
            .filter(|m| m.leaving && self.view.member_is_live(m))
            .map(|m| m.member.clone())
            .collect();
        for member in leaving {
            let budget = LEAVING_PARALLEL.saturating_sub(self.in_flight);
            for a in self.movable(&member).into_iter().take(budget) {
                if self.move_one(&a).is_err() {
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::{InstanceRecord, MemberRecord, SecretBytes};

    fn member(name: &str) -> MemberRecord {
        MemberRecord {
            member: name.into(),
            process_id: format!("{name}-p"),
            epoch: 1,
            runtime_address: String::new(),
            capacity: 256,
            served_by: String::new(),
            leaving: false,
            expires_at_ms: 100_000,
            updated_at_ms: 0,
        }
    }

    pub(super) fn pool(members: &[&str], placed: &[(&str, &str)]) -> View {
        let mut v = View {
            now_ms: 10_000,
            ..View::default()
        };
        for m in members {
            v.members.insert((*m).into(), member(m));
        }
        for (route, owner) in placed {
            v.instances.insert(
                (*route).into(),
                InstanceRecord {
                    route: (*route).into(),
                    namespace: "ns".into(),
                    name: (*route).into(),
                    uid: format!("uid-{route}"),
                    generation: 1,
                    material: SecretBytes::default(),
                    registered_at_ms: 0,
                    withdrawn: false,
                    last_term: 0,
                    withdrawn_reason: None,
                },
            );
            v.assignments.insert(
                (*route).into(),
                Assignment {
                    route: (*route).into(),
                    member: (*owner).into(),
                    process_id: format!("{owner}-p"),
                    term: 1,
                    phase: AssignmentPhase::Active,
                    generation: 1,
                    placed_term: 1,
                    coordinator_term: 1,
                    updated_at_ms: 0,
                },
            );
        }
        v
    }

    pub(crate) fn op(kind: OperationKind, target: &str, max_parallel: i64) -> Operation {
        Operation {
            id: "op".into(),
            kind,
            target: target.into(),
            phase: OperationPhase::Running,
            message: String::new(),
            attempts: 0,
            moves: 0,
            deadline_at_ms: Some(60_000),
            max_parallel,
            requested_by: "admin".into(),
            cancel_requested: false,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    fn moves(batches: &[Vec<FencedWrite>]) -> Vec<(String, String, i64)> {
        batches
            .iter()
            .flatten()
            .filter_map(|w| match w {
                FencedWrite::Assign {
                    expected_term: Some(_),
                    next,
                } => Some((next.route.clone(), next.member.clone(), next.term)),
                _ => None,
            })
            .collect()
    }

    fn ops(batches: &[Vec<FencedWrite>]) -> Vec<Operation> {
        batches
            .iter()
            .flatten()
            .filter_map(|w| match w {
                FencedWrite::PutOperation(op) => Some(op.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_drain_moves_at_most_max_parallel_at_term_plus_one_to_the_least_loaded() {
        let mut v = pool(&["a", "b", "c"], &[("r1", "a"), ("r2", "a"), ("r3", "a"), ("r4", "b")]);
        v.operations.push(op(OperationKind::Drain, "a", 2));
        let batches = plan(&v);
        assert_eq!(
            moves(&batches),
            [("r1".into(), "c".into(), 2), ("r2".into(), "b".into(), 2)],
            "two at a time, each to the least-loaded other member"
        );
        let recorded = ops(&batches);
        assert_eq!(recorded.len(), 1);
        assert_eq!((recorded[0].phase, recorded[0].moves), (OperationPhase::Running, 2));
    }

    #[test]
    fn a_drain_waits_for_handoffs_in_flight_then_succeeds_and_keeps_the_member_out() {
        let mut v = pool(&["a", "b"], &[("r1", "a")]);
        v.operations.push(op(OperationKind::Drain, "a", 1));
        // r1 moved to b at term 2, not settled yet: nothing more, not done.
        let a = v.assignments.get_mut("r1").unwrap();
        a.member = "b".into();
        a.process_id = "b-p".into();
        a.term = 2;
        a.phase = AssignmentPhase::Reserved;
        let batches = plan(&v);
        assert!(moves(&batches).is_empty());
        assert!(ops(&batches).iter().all(|o| o.phase == OperationPhase::Running));
        // Settled: the drain succeeds, and a succeeded drain still excludes its member.
        v.assignments.get_mut("r1").unwrap().phase = AssignmentPhase::Active;
        let done = ops(&plan(&v));
        assert_eq!(done[0].phase, OperationPhase::Succeeded);
        v.operations[0] = done[0].clone();
        assert!(drained(&v).contains("a"));
        assert!(v.candidates(&drained(&v)).iter().any(|c| c.member == "a" && c.excluded));
        // Cancelling it returns the member to service.
        v.operations[0].cancel_requested = true;
        let cancelled = ops(&plan(&v));
        assert_eq!(cancelled[0].phase, OperationPhase::Cancelled);
        v.operations[0] = cancelled[0].clone();
        assert!(drained(&v).is_empty());
    }

    #[test]
    fn unsettled_or_dead_owners_routes_do_not_move() {
        let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "a")]);
        v.assignments.get_mut("r1").unwrap().phase = AssignmentPhase::Reserved;
        v.operations.push(op(OperationKind::Drain, "a", 8));
        assert_eq!(moves(&plan(&v)), [("r2".into(), "b".into(), 2)]);
        v.members.get_mut("a").unwrap().expires_at_ms = 0;
        assert!(moves(&plan(&v)).is_empty(), "a gone owner is recovery's business");
    }

    #[test]
    fn a_drain_with_nowhere_to_go_waits_and_fails_at_its_deadline() {
        let mut v = pool(&["a"], &[("r1", "a")]);
        v.operations.push(op(OperationKind::Drain, "a", 1));
        let waiting = ops(&plan(&v));
        assert!(waiting[0].message.starts_with("waiting:"), "{}", waiting[0].message);
        v.now_ms = 70_000;
        let failed = ops(&plan(&v));
        assert_eq!(failed[0].phase, OperationPhase::Failed);
    }

    #[test]
    fn a_pending_cancelled_operation_never_runs() {
        let mut v = pool(&["a", "b"], &[("r1", "a")]);
        let mut pending = op(OperationKind::Drain, "a", 1);
        pending.phase = OperationPhase::Pending;
        pending.cancel_requested = true;
        v.operations.push(pending);
        let batches = plan(&v);
        assert!(moves(&batches).is_empty());
        assert_eq!(ops(&batches)[0].phase, OperationPhase::Cancelled);
    }

    #[test]
    fn a_rebalance_evens_out_counts_and_then_succeeds() {
        let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "a"), ("r3", "a"), ("r4", "a")]);
        v.operations.push(op(OperationKind::Rebalance, "", 8));
        let batches = plan(&v);
        assert_eq!(
            moves(&batches),
            [("r1".into(), "b".into(), 2), ("r2".into(), "b".into(), 2)]
        );
        // Once the moves settled, it is balanced and done.
        for (route, _, _) in moves(&batches) {
            let a = v.assignments.get_mut(&route).unwrap();
            a.member = "b".into();
            a.process_id = "b-p".into();
            a.term = 2;
        }
        let done = ops(&plan(&v));
        assert_eq!(done[0].phase, OperationPhase::Succeeded);
    }

    #[test]
    fn leaving_members_are_emptied_without_an_operation() {
        let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "b")]);
        v.members.get_mut("a").unwrap().leaving = true;
        assert_eq!(moves(&plan(&v)), [("r1".into(), "b".into(), 2)]);
    }

    #[test]
    fn ended_operations_are_forgotten_after_their_retention_but_drains_in_force_stay() {
        let hour = 60 * 60 * 1000;
        let mut v = pool(&["a", "b"], &[]);
        v.now_ms = 48 * hour;
        let now = v.now_ms;
        let ended = |id: &str, kind, phase, cancel_requested, hours_ago: i64| Operation {
            id: id.into(),
            phase,
            cancel_requested,
            updated_at_ms: now - hours_ago * hour,
            ..op(kind, "a", 1)
        };
        use OperationKind::{Drain, Rebalance, Recover};
        use OperationPhase::{Cancelled, Failed, Running, Succeeded};
        v.operations = vec![
            ended("recovery-old", Recover, Succeeded, false, 1),
            ended("recovery-new", Recover, Succeeded, false, 0),
            ended("rebalance-old", Rebalance, Succeeded, false, 25),
            ended("rebalance-new", Rebalance, Failed, false, 23),
            ended("drain-in-force", Drain, Succeeded, false, 47),
            ended("drain-cancelled", Drain, Succeeded, true, 47),
            ended("drain-failed", Drain, Cancelled, false, 30),
            ended("running-long", Drain, Running, false, 40),
        ]
        .into();
        let mut forgotten: Vec<String> = expired(&v)
            .into_iter()
            .map(|w| match w {
                FencedWrite::DeleteOperation { id } => id,
                other => panic!("unexpected write {other:?}"),
            })
            .collect();
        forgotten.sort();
        assert_eq!(
            forgotten,
            ["drain-cancelled", "drain-failed", "rebalance-old", "recovery-old"]
        );
        assert!(drained(&v).contains("a"), "the drain in force still holds its member");
    }
}
