//! Dry runs of drains and rebalances: the moves an operation would make, computed by running
//! the coordinator's own round ([`Round`]) over a copy of the pool view, wave after wave,
//! with every move taken as settled before the next wave. Pure; nothing is written.

use super::Round;
use crate::pool::View;
use crate::store::{AssignmentPhase, FencedWrite, Operation, OperationKind, OperationPhase, OwnershipTerm};

/// One move of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedMove {
    pub route: String,
    pub from: String,
    pub to: String,
    /// The term it moves at (its current term + 1).
    pub term: OwnershipTerm,
    /// Moves of one wave are in flight together; starts at 1.
    pub wave: u32,
}

/// An instance the operation would have to move and would not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub route: String,
    pub from: String,
    pub reason: String,
}

/// What an operation would do to the pool as `view` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Preview {
    pub moves: Vec<PlannedMove>,
    pub refused: Vec<Refusal>,
    /// Whether it would succeed.
    pub completes: bool,
    /// The message it would end with.
    pub message: String,
}

/// Plan `op` (a drain or a rebalance) over `view` without writing anything. Handoffs already
/// in flight on live owners are taken as settled; nothing else changes while it runs.
pub fn preview(view: &View, op: &Operation) -> Preview {
    let mut pool = view.clone();
    // A handoff in flight to a live owner settles; one to a gone owner is recovery's business
    // and no longer holds back the operation's budget.
    for a in pool.assignments.values_mut() {
        a.phase = AssignmentPhase::Active;
    }
    let mut op = Operation {
        phase: OperationPhase::Running,
        deadline_at_ms: None,
        cancel_requested: false,
        ..op.clone()
    };
    pool.operations.retain(|o| o.id != op.id);
    pool.operations.push(op.clone());
    let mut moves = Vec::new();
    let mut refusal = None;
    // Every wave moves at least one instance, and an instance never needs more moves than
    // there are assignments: a bound, not an expectation.
    let waves = u32::try_from(pool.assignments.len())
        .unwrap_or(u32::MAX)
        .saturating_add(1);
    for wave in 1..=waves {
        let mut round = Round::new(&pool);
        round.operation(&op);
        refusal = round.refusal.take();
        let writes: Vec<FencedWrite> = round.batches.into_iter().flatten().collect();
        let mut moved = 0;
        for write in writes {
            match write {
                FencedWrite::Assign { next, .. } => {
                    let from = pool
                        .assignments
                        .get(&next.route)
                        .map(|a| a.member.clone())
                        .unwrap_or_default();
                    moves.push(PlannedMove {
                        route: next.route.clone(),
                        from,
                        to: next.member.clone(),
                        term: next.term,
                        wave,
                    });
                    moved += 1;
                    pool.assignments.insert(
                        next.route.clone(),
                        crate::store::Assignment {
                            phase: AssignmentPhase::Active,
                            ..next
                        },
                    );
                }
                FencedWrite::PutOperation(next) => {
                    if let Some(o) = pool.operations.iter_mut().find(|o| o.id == next.id) {
                        *o = next.clone();
                    }
                    op = next;
                }
                _ => {}
            }
        }
        if op.phase.is_finished() || moved == 0 {
            break;
        }
    }
    let completes = op.phase == OperationPhase::Succeeded;
    let refused = if op.kind == OperationKind::Drain && !completes {
        left_on(&pool, &op.target, refusal.as_deref())
    } else {
        Vec::new()
    };
    Preview {
        moves,
        refused,
        completes,
        message: op.message,
    }
}

/// The instances a drain would leave on `member`, with why.
fn left_on(pool: &View, member: &str, refusal: Option<&str>) -> Vec<Refusal> {
    pool.assignments
        .values()
        .filter(|a| a.member == member && pool.holds_desired(a))
        .map(|a| {
            let reason = if !pool.is_live(&a.member, &a.process_id) {
                "its owner process is gone: recovery places it on another member, not the drain".to_owned()
            } else {
                refusal.unwrap_or("no eligible member can take it").to_owned()
            };
            Refusal {
                route: a.route.clone(),
                from: a.member.clone(),
                reason,
            }
        })
        .collect()
}

/// The recorded operation a request for `kind` on `target` would be answered with instead of
/// a new one (the store's rule: an open one of the same kind and target, or a drain of the
/// member that succeeded and was not cancelled).
pub fn equivalent<'v>(view: &'v View, kind: OperationKind, target: &str) -> Option<&'v Operation> {
    view.operations
        .iter()
        .filter(|o| o.kind == kind && o.target == target)
        .filter(|o| {
            !o.phase.is_finished()
                || (o.kind == OperationKind::Drain && o.phase == OperationPhase::Succeeded && !o.cancel_requested)
        })
        .max_by_key(|o| o.created_at_ms)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{op, pool};
    use super::*;

    fn routes(p: &Preview) -> Vec<(&str, &str, &str, u64, u32)> {
        p.moves
            .iter()
            .map(|m| (m.route.as_str(), m.from.as_str(), m.to.as_str(), m.term.get(), m.wave))
            .collect()
    }

    #[test]
    fn a_drain_preview_lists_every_move_in_waves_of_max_parallel() {
        let v = pool(&["a", "b", "c"], &[("r1", "a"), ("r2", "a"), ("r3", "a"), ("r4", "b")]);
        let before = v.clone();
        let p = preview(&v, &op(OperationKind::Drain, "a", 2));
        assert_eq!(
            routes(&p),
            [("r1", "a", "c", 2, 1), ("r2", "a", "b", 2, 1), ("r3", "a", "c", 2, 2)]
        );
        assert!(p.completes && p.refused.is_empty());
        assert_eq!(p.message, "a drained: 3 instances moved");
        assert_eq!(v, before, "the view is not touched");
        // The first wave is exactly the coordinator's first round.
        let mut running = v.clone();
        running.operations.push(op(OperationKind::Drain, "a", 2));
        let first: Vec<(String, String)> = super::super::plan(&running)
            .into_iter()
            .flatten()
            .filter_map(|w| match w {
                FencedWrite::Assign { next, .. } => Some((next.route, next.member)),
                _ => None,
            })
            .collect();
        let wave_one: Vec<(String, String)> = p
            .moves
            .iter()
            .filter(|m| m.wave == 1)
            .map(|m| (m.route.clone(), m.to.clone()))
            .collect();
        assert_eq!(first, wave_one);
    }

    #[test]
    fn a_drain_with_nowhere_to_go_says_why_for_each_instance() {
        let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "a"), ("r3", "b")]);
        v.members.get_mut("b").unwrap().capacity = 2;
        let p = preview(&v, &op(OperationKind::Drain, "a", 8));
        assert_eq!(routes(&p), [("r1", "a", "b", 2, 1)], "b has room for one");
        assert!(!p.completes);
        assert_eq!(p.refused.len(), 1);
        assert_eq!((p.refused[0].route.as_str(), p.refused[0].from.as_str()), ("r2", "a"));
        assert!(
            p.refused[0].reason.contains("at capacity") && p.refused[0].reason.contains("b holds 2 of 2"),
            "{:?}",
            p.refused
        );
        // The only member: nowhere at all.
        let alone = pool(&["a"], &[("r1", "a")]);
        let p = preview(&alone, &op(OperationKind::Drain, "a", 1));
        assert!(p.moves.is_empty() && !p.completes);
        assert!(p.message.starts_with("waiting:"), "{}", p.message);
        assert!(p.refused[0].reason.contains("leaving or drained") || p.refused[0].reason.contains("no live"));
        // A gone owner's instance is recovery's, not the drain's.
        let mut gone = pool(&["a", "b"], &[("r1", "a")]);
        gone.members.get_mut("a").unwrap().expires_at_ms = 0;
        let p = preview(&gone, &op(OperationKind::Drain, "a", 1));
        assert!(p.moves.is_empty());
        assert!(p.refused[0].reason.contains("recovery"), "{:?}", p.refused);
    }

    #[test]
    fn a_rebalance_preview_evens_out_and_a_balanced_pool_plans_nothing() {
        let v = pool(
            &["a", "b"],
            &[("r1", "a"), ("r2", "a"), ("r3", "a"), ("r4", "a"), ("r5", "a")],
        );
        let p = preview(&v, &op(OperationKind::Rebalance, "", 1));
        assert_eq!(
            routes(&p),
            [("r1", "a", "b", 2, 1), ("r2", "a", "b", 2, 2)],
            "one at a time until the spread is at most one"
        );
        assert!(p.completes, "{}", p.message);
        let even = pool(&["a", "b"], &[("r1", "a"), ("r2", "b")]);
        let p = preview(&even, &op(OperationKind::Rebalance, "", 8));
        assert!(p.moves.is_empty() && p.completes);
    }

    #[test]
    fn an_equivalent_open_drain_is_found() {
        let mut v = pool(&["a", "b"], &[("r1", "a")]);
        assert!(equivalent(&v, OperationKind::Drain, "a").is_none());
        v.operations.push(op(OperationKind::Drain, "a", 1));
        assert_eq!(
            equivalent(&v, OperationKind::Drain, "a").map(|o| o.id.as_str()),
            Some("op")
        );
        v.operations[0].phase = OperationPhase::Failed;
        assert!(equivalent(&v, OperationKind::Drain, "a").is_none());
    }
}
