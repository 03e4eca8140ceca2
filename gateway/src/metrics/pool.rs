//! The pool-wide gauges the coordinator exports: what [`Figures::of`] reads from a pool view
//! (pure), and [`GaugeSet`]s that take a new set of labelled values at once, dropping the
//! labels that are gone (a member left, an operation finished).

use std::collections::{BTreeMap, HashSet};
use std::hash::Hash;
use std::sync::Mutex;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::operations;
use crate::placement::MAX_INSTANCES_PER_MEMBER;
use crate::pool::View;
use crate::store::{OperationKind, ReportPhase};

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct MemberLabels {
    pub member: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: Phase,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct OpenLabels {
    pub kind: &'static str,
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct OperationLabels {
    pub id: String,
    pub kind: &'static str,
    pub target: String,
}

/// A desired instance's phase as the pool sees it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Phase {
    /// No member holds it (none can take it, or placement has not run yet).
    unplaced,
    /// Assigned; its owner has not reported it at the assigned term yet.
    pending,
    starting,
    active,
    recovering,
    relinquished,
    stopped,
    failed,
}

impl Phase {
    /// The phase of an owner's report; an owner that does not host the instance leaves it
    /// pending.
    fn reported(phase: ReportPhase) -> Self {
        match phase {
            ReportPhase::Starting => Self::starting,
            ReportPhase::Active => Self::active,
            ReportPhase::Recovering => Self::recovering,
            ReportPhase::Relinquished => Self::relinquished,
            ReportPhase::Stopped => Self::stopped,
            ReportPhase::Absent => Self::pending,
            ReportPhase::Failed => Self::failed,
        }
    }
}

/// Labelled gauges replaced as a whole: labels not in the latest values are removed.
#[derive(Debug)]
pub struct GaugeSet<L: Clone + Hash + Eq> {
    family: Family<L, Gauge>,
    present: Mutex<HashSet<L>>,
}

impl<L: Clone + Hash + Eq> Default for GaugeSet<L> {
    fn default() -> Self {
        Self {
            family: Family::default(),
            present: Mutex::default(),
        }
    }
}

impl<L: Clone + Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static> GaugeSet<L> {
    /// The family to register.
    pub fn family(&self) -> Family<L, Gauge> {
        self.family.clone()
    }

    /// Register as a coordinator-only gauge (its help says so).
    pub fn register(&self, registry: &mut Registry, name: &str, help: &str) {
        registry.register(name, format!("Coordinator only: {help}"), self.family());
    }

    /// Exactly `values` from now on.
    pub fn replace(&self, values: impl IntoIterator<Item = (L, i64)>) {
        let mut present = self.present.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut next = HashSet::new();
        for (labels, value) in values {
            self.family.get_or_create(&labels).set(value);
            next.insert(labels);
        }
        for gone in present.difference(&next) {
            self.family.remove(gone);
        }
        *present = next;
    }

    /// No values.
    pub fn clear(&self) {
        self.replace(std::iter::empty());
    }
}

/// What the coordinator's gauges say of one pool view.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Live members by state: `serving`, `leaving`, `drained` (held out by a drain).
    pub members: BTreeMap<StateLabels, i64>,
    /// Desired instances each live member holds, and what it may hold.
    pub member_instances: BTreeMap<MemberLabels, i64>,
    pub member_capacity: BTreeMap<MemberLabels, i64>,
    /// Desired instances by phase.
    pub instances: BTreeMap<PhaseLabels, i64>,
    /// Open (pending or running) operations by kind and phase.
    pub operations: BTreeMap<OpenLabels, i64>,
    /// Per open drain or rebalance: moves made, instances still to move off a drained member
    /// (drains only), and the last write of the operation (Unix seconds).
    pub moves_done: BTreeMap<OperationLabels, i64>,
    pub moves_remaining: BTreeMap<OperationLabels, i64>,
    pub last_progress: BTreeMap<OperationLabels, i64>,
}

impl Figures {
    pub fn of(view: &View) -> Self {
        let mut f = Self::default();
        let drained = operations::drained(view);
        for m in view.members.values().filter(|m| view.member_is_live(m)) {
            let state = if m.leaving {
                "leaving"
            } else if drained.contains(&m.member) {
                "drained"
            } else {
                "serving"
            };
            *f.members.entry(StateLabels { state }).or_default() += 1;
            let member = MemberLabels {
                member: m.member.clone(),
            };
            let capacity = usize::try_from(m.capacity).unwrap_or(0).min(MAX_INSTANCES_PER_MEMBER);
            f.member_capacity
                .insert(member.clone(), i64::try_from(capacity).unwrap_or(i64::MAX));
            f.member_instances.insert(member, 0);
        }
        for route in view.desired() {
            let phase = match view.current_assignment(&route) {
                None => Phase::unplaced,
                Some(a) => {
                    let held = MemberLabels {
                        member: a.member.clone(),
                    };
                    if let Some(n) = f.member_instances.get_mut(&held) {
                        *n += 1;
                    }
                    view.reports
                        .get(&route)
                        .filter(|r| r.term == a.term && r.process_id == a.process_id)
                        .map_or(Phase::pending, |r| Phase::reported(r.phase))
                }
            };
            *f.instances.entry(PhaseLabels { phase }).or_default() += 1;
        }
        for op in view.operations.iter().filter(|op| !op.phase.is_finished()) {
            let open = OpenLabels {
                kind: op.kind.as_str(),
                phase: op.phase.as_str(),
            };
            *f.operations.entry(open).or_default() += 1;
            if !matches!(op.kind, OperationKind::Drain | OperationKind::Rebalance) {
                continue;
            }
            let labels = OperationLabels {
                id: op.id.clone(),
                kind: op.kind.as_str(),
                target: op.target.clone(),
            };
            if op.kind == OperationKind::Drain {
                let remaining = view
                    .assignments
                    .values()
                    .filter(|a| a.member == op.target && view.holds_desired(a))
                    .count();
                f.moves_remaining
                    .insert(labels.clone(), i64::try_from(remaining).unwrap_or(i64::MAX));
            }
            f.moves_done.insert(labels.clone(), op.moves);
            f.last_progress.insert(labels, op.updated_at_ms / 1000);
        }
        f
    }
}

/// The registered pool-wide gauges.
#[derive(Debug, Default)]
pub struct Gauges {
    members: GaugeSet<StateLabels>,
    member_instances: GaugeSet<MemberLabels>,
    member_capacity: GaugeSet<MemberLabels>,
    instances: GaugeSet<PhaseLabels>,
    operations: GaugeSet<OpenLabels>,
    moves_done: GaugeSet<OperationLabels>,
    moves_remaining: GaugeSet<OperationLabels>,
    last_progress: GaugeSet<OperationLabels>,
}

impl Gauges {
    pub fn register(registry: &mut Registry) -> Self {
        let g = Self::default();
        g.members.register(
            registry,
            "members",
            "live pool members by state (serving, leaving, drained)",
        );
        g.member_instances
            .register(registry, "member_instances", "desired instances a live member holds");
        g.member_capacity
            .register(registry, "member_capacity", "instances a live member may hold");
        g.instances
            .register(registry, "instances", "desired instances by phase");
        g.operations
            .register(registry, "operations", "open operations by kind and phase");
        g.moves_done.register(
            registry,
            "operation_moves_done",
            "moves an open drain or rebalance has made",
        );
        g.moves_remaining.register(
            registry,
            "operation_moves_remaining",
            "instances an open drain still has to move off its member",
        );
        g.last_progress.register(
            registry,
            "operation_last_progress_timestamp_seconds",
            "when an open drain or rebalance last changed (a move, a new message; Unix time)",
        );
        g
    }

    pub fn set(&self, f: &Figures) {
        self.members.replace(f.members.clone());
        self.member_instances.replace(f.member_instances.clone());
        self.member_capacity.replace(f.member_capacity.clone());
        self.instances.replace(f.instances.clone());
        self.operations.replace(f.operations.clone());
        self.moves_done.replace(f.moves_done.clone());
        self.moves_remaining.replace(f.moves_remaining.clone());
        self.last_progress.replace(f.last_progress.clone());
    }

    pub fn clear(&self) {
        self.set(&Figures::default());
    }
}
