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
mod request;

pub use preview::{PlannedMove, Preview, Refusal, equivalent, preview};
pub use request::from_request;

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
pub(crate) fn settled(view: &View, a: &Assignment) -> bool {
    a.phase == AssignmentPhase::Active
        || view
            .reports
            .get(&a.route)
            .is_some_and(|r| r.term == a.term && r.process_id == a.process_id && r.phase.hosts())
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
                term: self.view.fresh_term(&a.route, a.term.next()),
                phase: AssignmentPhase::Reserved,
                generation: a.generation,
                placed_term: a.placed_term,
                coordinator_term: crate::store::CoordinatorTerm::ZERO,
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
pub(crate) mod tests;
