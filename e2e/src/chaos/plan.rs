//! What a trial does, decided over plain data: a fault kind drawn from the
//! seeded generator, its targets picked from a snapshot of the pool, and the
//! timed steps that inject and heal it. No I/O: the driver (`super`) runs the
//! steps; the same seed over the same snapshots gives the same plans.

use rand::Rng;
use rand::seq::IndexedRandom as _;
use serde::Serialize;
pub use testkit::fault::Way;

/// The kinds of trial, as the recovery table names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Fault {
    /// kill -9 of a member that owns instances, restarted 0–3 s later.
    MemberKill,
    /// SIGSTOP of a member that owns instances for 1–8 s (past its liveness TTL or not).
    MemberPause,
    /// kill -9 of the coordinator's replica, restarted 0–3 s later.
    CoordinatorKill,
    /// SIGSTOP of the coordinator's replica for 2–8 s (around its 5 s lease).
    CoordinatorPause,
    /// kill -9 of a standby replica, restarted 0–3 s later.
    StandbyKill,
    /// SIGSTOP of a standby replica for 2–8 s.
    StandbyPause,
    /// The replica holding a member's stream paused, that member killed and restarted at
    /// once; the replica resumed 3–8 s later.
    StreamHolderPause,
    /// The database server stopped (immediate) for 3–20 s; only on a private PostgreSQL.
    DatabaseOutage,
    /// The path from a busy member's sidecars to its runtime port cut (no reset: a broken
    /// route) for 1–12 s, the member fine towards the gateways.
    SidecarsCutOff,
    /// A busy member cut off from every gateway replica, both ways, for 2–20 s; its sidecars
    /// still reach it.
    MemberCutOff,
    /// One direction of the link between a busy member and the replica holding its stream
    /// cut for 2–15 s (an asymmetric route).
    MemberOneWay,
    /// Every gateway link of a busy member given 0.2–1.2 s of latency each way for 3–15 s: a
    /// round trip of up to 2.4 s, below the 3 s silence timeout, which the member must ride out
    /// without a move.
    MemberSlowLinks,
    /// The store emptied under the pool (every table dropped; on PostgreSQL every connection
    /// closed): a database Pod replaced without its volume.
    StoreEmptied,
    /// A drain of a busy member (max_parallel 1–3) whose moves the store forgets 1–5 s later
    /// (the assignments and last terms written back as they were before it): commits an
    /// asynchronous replica acknowledged and lost, or a restore from an older backup.
    StoreForgetsDrain,
    /// Commits made asynchronous, a drain of a busy member, and the server stopped at once
    /// 0.3–2 s into it (losing what it acknowledged and had not written), started 2–6 s
    /// later; only on a private PostgreSQL.
    DatabaseLosesCommits,
    /// A drain of a busy member (max_parallel 1–3) with one of the faults above during it.
    DrainDuringFault,
    /// A rebalance (max_parallel 1–3) with one of the faults above during it.
    RebalanceDuringFault,
    /// Two of the faults above on different processes, the second 0–3 s after the first.
    Overlapping,
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Self::MemberKill => "member-kill",
            Self::MemberPause => "member-pause",
            Self::CoordinatorKill => "coordinator-kill",
            Self::CoordinatorPause => "coordinator-pause",
            Self::StandbyKill => "standby-kill",
            Self::StandbyPause => "standby-pause",
            Self::StreamHolderPause => "stream-holder-pause",
            Self::DatabaseOutage => "database-outage",
            Self::SidecarsCutOff => "sidecars-cut-off",
            Self::MemberCutOff => "member-cut-off",
            Self::MemberOneWay => "member-one-way",
            Self::MemberSlowLinks => "member-slow-links",
            Self::StoreEmptied => "store-emptied",
            Self::StoreForgetsDrain => "store-forgets-drain",
            Self::DatabaseLosesCommits => "database-loses-commits",
            Self::DrainDuringFault => "drain-during-fault",
            Self::RebalanceDuringFault => "rebalance-during-fault",
            Self::Overlapping => "overlapping",
        }
    }

    /// The kind named `name` (as [`Fault::name`] names it).
    pub fn named(name: &str) -> Option<Self> {
        Self::all().find(|f| f.name() == name)
    }

    fn possible(self, snapshot: &Snapshot) -> bool {
        snapshot.database_outages || !matches!(self, Self::DatabaseOutage | Self::DatabaseLosesCommits)
    }

    /// The single faults, which the composite kinds combine.
    const SINGLE: [Self; 12] = [
        Self::MemberKill,
        Self::MemberPause,
        Self::CoordinatorKill,
        Self::CoordinatorPause,
        Self::StandbyKill,
        Self::StandbyPause,
        Self::StreamHolderPause,
        Self::DatabaseOutage,
        Self::SidecarsCutOff,
        Self::MemberCutOff,
        Self::MemberOneWay,
        Self::MemberSlowLinks,
    ];

    /// Every kind: the single faults, the store's, then the composites (the order the seed
    /// draws from). The store's are never combined: an operation the store forgets cannot be
    /// waited for.
    pub fn all() -> impl Iterator<Item = Self> {
        Self::SINGLE.into_iter().chain([
            Self::StoreEmptied,
            Self::StoreForgetsDrain,
            Self::DatabaseLosesCommits,
            Self::DrainDuringFault,
            Self::RebalanceDuringFault,
            Self::Overlapping,
        ])
    }
}

/// A process of the pool, by its index in the pool's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Gateway(usize),
    Member(usize),
    /// Only to keep two outages out of one trial; never killed or paused.
    Database,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Kill(Target),
    Pause(Target),
    Resume(Target),
    /// Start a killed process again under its name and address.
    Restart(Target),
    HaltDatabase,
    ResumeDatabase,
    /// Drop every table of the store.
    EmptyStore,
    /// Remember the assignments (for `Forget`).
    Remember,
    /// Write the remembered assignments back, with their routes' last terms.
    Forget,
    /// Cut a member's link.
    Cut(Link),
    /// Delay everything on member `member`'s gateway links by `delay_ms` each way.
    Slow {
        member: usize,
        delay_ms: u64,
    },
    /// Open and speed up every link of member `0` again.
    HealLinks(usize),
    /// Make the store's commits asynchronous (acknowledged before they are written).
    CommitsAsynchronous,
    Drain {
        member: usize,
        max_parallel: u32,
    },
    Rebalance {
        max_parallel: u32,
    },
}

/// A member's network link, behind a fault path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// From its sidecars to its runtime port.
    Sidecars(usize),
    /// To every gateway replica, both ways.
    Gateways(usize),
    /// One way of its link to one replica.
    OneWay { member: usize, gateway: usize, way: Way },
}

impl Link {
    pub fn member(self) -> usize {
        match self {
            Self::Sidecars(m) | Self::Gateways(m) | Self::OneWay { member: m, .. } => m,
        }
    }
}

/// An action at a time after the trial's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub at_ms: u64,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub fault: Fault,
    /// Sorted by time.
    pub steps: Vec<Step>,
}

/// What the planner knows of the pool when a trial starts.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub gateways: usize,
    /// The coordinator's replica.
    pub coordinator: Option<usize>,
    /// Instances owned, per member.
    pub load: Vec<usize>,
    /// The replica holding each member's stream.
    pub stream_holder: Vec<Option<usize>>,
    /// Whether the database can be stopped (a private PostgreSQL server).
    pub database_outages: bool,
}

impl Snapshot {
    fn busy_members(&self) -> Vec<usize> {
        let busy: Vec<usize> = (0..self.load.len()).filter(|m| self.load[*m] > 0).collect();
        if busy.is_empty() {
            (0..self.load.len()).collect()
        } else {
            busy
        }
    }

    fn standbys(&self) -> Vec<usize> {
        (0..self.gateways).filter(|g| Some(*g) != self.coordinator).collect()
    }
}

/// Draw the next trial.
pub fn plan(rng: &mut impl Rng, snapshot: &Snapshot) -> Plan {
    let fault = *kinds(snapshot).choose(rng).unwrap_or(&Fault::MemberKill);
    plan_of(rng, fault, snapshot)
}

/// The kinds a trial can draw on this pool (the database stopped only on a private server).
pub fn kinds(snapshot: &Snapshot) -> Vec<Fault> {
    Fault::all().filter(|f| f.possible(snapshot)).collect()
}

/// The next trial of kind `fault`, its targets and timings drawn.
pub fn plan_of(rng: &mut impl Rng, fault: Fault, snapshot: &Snapshot) -> Plan {
    let mut steps = Vec::new();
    let mut used = Vec::new();
    match fault {
        Fault::DrainDuringFault => {
            let member = *snapshot.busy_members().choose(rng).unwrap_or(&0);
            steps.push(Step {
                at_ms: 0,
                action: Action::Drain {
                    member,
                    max_parallel: rng.random_range(1..=3),
                },
            });
            let at = rng.random_range(0..1000);
            let other = random_single(rng, snapshot);
            single(rng, other, snapshot, at, &mut used, &mut steps);
        }
        Fault::RebalanceDuringFault => {
            steps.push(Step {
                at_ms: 0,
                action: Action::Rebalance {
                    max_parallel: rng.random_range(1..=3),
                },
            });
            let at = rng.random_range(0..1000);
            let other = random_single(rng, snapshot);
            single(rng, other, snapshot, at, &mut used, &mut steps);
        }
        Fault::Overlapping => {
            let other = random_single(rng, snapshot);
            single(rng, other, snapshot, 0, &mut used, &mut steps);
            let at = rng.random_range(0..3000);
            let other = random_single(rng, snapshot);
            single(rng, other, snapshot, at, &mut used, &mut steps);
        }
        Fault::StoreEmptied => steps.push(Step {
            at_ms: 0,
            action: Action::EmptyStore,
        }),
        Fault::StoreForgetsDrain => {
            let member = *snapshot.busy_members().choose(rng).unwrap_or(&0);
            let forget_at = rng.random_range(1000..=5000);
            steps.extend([
                Step {
                    at_ms: 0,
                    action: Action::Remember,
                },
                Step {
                    at_ms: 0,
                    action: Action::Drain {
                        member,
                        max_parallel: rng.random_range(1..=3),
                    },
                },
                Step {
                    at_ms: forget_at,
                    action: Action::Forget,
                },
            ]);
        }
        Fault::DatabaseLosesCommits => {
            let member = *snapshot.busy_members().choose(rng).unwrap_or(&0);
            let drain_at = 1000;
            let halt_at = drain_at + rng.random_range(300..=2000);
            steps.extend([
                Step {
                    at_ms: 0,
                    action: Action::CommitsAsynchronous,
                },
                Step {
                    at_ms: drain_at,
                    action: Action::Drain {
                        member,
                        max_parallel: rng.random_range(1..=3),
                    },
                },
                Step {
                    at_ms: halt_at,
                    action: Action::HaltDatabase,
                },
                Step {
                    at_ms: halt_at + rng.random_range(2000..=6000),
                    action: Action::ResumeDatabase,
                },
            ]);
        }
        single_fault => single(rng, single_fault, snapshot, 0, &mut used, &mut steps),
    }
    steps.sort_by_key(|s| s.at_ms);
    Plan { fault, steps }
}

fn random_single(rng: &mut impl Rng, snapshot: &Snapshot) -> Fault {
    let kinds: Vec<Fault> = Fault::SINGLE.into_iter().filter(|f| f.possible(snapshot)).collect();
    *kinds.choose(rng).unwrap_or(&Fault::MemberKill)
}

/// The steps of one single fault starting at `at`, on processes not in `used` (a composite
/// never pauses and kills the same process). A fault with no free target adds nothing.
fn single(
    rng: &mut impl Rng,
    fault: Fault,
    snapshot: &Snapshot,
    at: u64,
    used: &mut Vec<Target>,
    steps: &mut Vec<Step>,
) {
    let free = |targets: Vec<Target>, used: &[Target]| -> Vec<Target> {
        targets.into_iter().filter(|t| !used.contains(t)).collect()
    };
    let members = |list: Vec<usize>| list.into_iter().map(Target::Member).collect::<Vec<_>>();
    let gateways = |list: Vec<usize>| list.into_iter().map(Target::Gateway).collect::<Vec<_>>();
    let pick = |rng: &mut dyn rand::RngCore, targets: Vec<Target>| targets.choose(rng).copied();
    let mut push = |after: u64, action: Action| {
        steps.push(Step {
            at_ms: at + after,
            action,
        });
    };
    match fault {
        Fault::MemberKill | Fault::CoordinatorKill | Fault::StandbyKill => {
            let candidates = match fault {
                Fault::MemberKill => members(snapshot.busy_members()),
                Fault::CoordinatorKill => gateways(snapshot.coordinator.into_iter().collect()),
                _ => gateways(snapshot.standbys()),
            };
            let Some(target) = pick(rng, free(candidates, used)) else {
                return;
            };
            used.push(target);
            push(0, Action::Kill(target));
            push(rng.random_range(0..=3000), Action::Restart(target));
        }
        Fault::MemberPause | Fault::CoordinatorPause | Fault::StandbyPause => {
            let (candidates, range) = match fault {
                Fault::MemberPause => (members(snapshot.busy_members()), 1000..=8000),
                Fault::CoordinatorPause => (gateways(snapshot.coordinator.into_iter().collect()), 2000..=8000),
                _ => (gateways(snapshot.standbys()), 2000..=8000),
            };
            let Some(target) = pick(rng, free(candidates, used)) else {
                return;
            };
            used.push(target);
            push(0, Action::Pause(target));
            push(rng.random_range(range), Action::Resume(target));
        }
        Fault::StreamHolderPause => {
            let pairs: Vec<(usize, usize)> = snapshot
                .busy_members()
                .into_iter()
                .filter_map(|m| Some((m, snapshot.stream_holder.get(m).copied().flatten()?)))
                .filter(|(m, g)| !used.contains(&Target::Member(*m)) && !used.contains(&Target::Gateway(*g)))
                .collect();
            let Some((member, holder)) = pairs.choose(rng).copied() else {
                return;
            };
            used.extend([Target::Member(member), Target::Gateway(holder)]);
            push(0, Action::Pause(Target::Gateway(holder)));
            push(200, Action::Kill(Target::Member(member)));
            push(
                200 + rng.random_range(0..=1000),
                Action::Restart(Target::Member(member)),
            );
            push(rng.random_range(3000..=8000), Action::Resume(Target::Gateway(holder)));
        }
        Fault::DatabaseOutage => {
            if used.contains(&Target::Database) {
                return;
            }
            used.push(Target::Database);
            push(0, Action::HaltDatabase);
            push(rng.random_range(3000..=20_000), Action::ResumeDatabase);
        }
        Fault::SidecarsCutOff | Fault::MemberCutOff | Fault::MemberOneWay | Fault::MemberSlowLinks => {
            let Some(Target::Member(member)) = pick(rng, free(members(snapshot.busy_members()), used)) else {
                return;
            };
            used.push(Target::Member(member));
            let (action, range) = match fault {
                Fault::SidecarsCutOff => (Action::Cut(Link::Sidecars(member)), 1000..=12_000),
                Fault::MemberCutOff => (Action::Cut(Link::Gateways(member)), 2000..=20_000),
                Fault::MemberOneWay => {
                    let gateway = snapshot.stream_holder.get(member).copied().flatten().unwrap_or(0);
                    let way = *[Way::Up, Way::Down].choose(rng).unwrap_or(&Way::Up);
                    (Action::Cut(Link::OneWay { member, gateway, way }), 2000..=15_000)
                }
                _ => {
                    let delay_ms = rng.random_range(200..=1200);
                    (Action::Slow { member, delay_ms }, 3000..=15_000)
                }
            };
            push(0, action);
            push(rng.random_range(range), Action::HealLinks(member));
        }
        Fault::StoreEmptied
        | Fault::StoreForgetsDrain
        | Fault::DatabaseLosesCommits
        | Fault::DrainDuringFault
        | Fault::RebalanceDuringFault
        | Fault::Overlapping => {}
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use rand::SeedableRng as _;
    use rand::rngs::StdRng;

    use super::*;

    fn snapshot(database_outages: bool) -> Snapshot {
        Snapshot {
            gateways: 3,
            coordinator: Some(1),
            load: vec![3, 0, 5],
            stream_holder: vec![Some(0), Some(1), Some(2)],
            database_outages,
        }
    }

    fn plans(seed: u64, n: usize, database_outages: bool) -> Vec<Plan> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| plan(&mut rng, &snapshot(database_outages))).collect()
    }

    #[test]
    fn one_seed_gives_one_sequence_and_every_kind_is_drawn() {
        assert_eq!(plans(7, 200, true), plans(7, 200, true));
        assert_ne!(plans(7, 50, true), plans(8, 50, true));
        let kinds: BTreeSet<Fault> = plans(7, 400, true).iter().map(|p| p.fault).collect();
        assert_eq!(kinds.len(), Fault::all().count(), "{kinds:?}");
        assert!(
            plans(7, 400, false)
                .iter()
                .all(|p| !p.steps.iter().any(|s| s.action == Action::HaltDatabase)),
            "no outage where the database cannot be stopped"
        );
    }

    #[test]
    fn every_kind_is_named_once() {
        assert!(Fault::all().all(|f| Fault::named(f.name()) == Some(f)));
        assert_eq!(Fault::named("member-gone"), None);
        let names: BTreeSet<&str> = Fault::all().map(Fault::name).collect();
        assert_eq!(names.len(), Fault::all().count());
    }

    #[test]
    fn every_injected_fault_is_healed_later_and_targets_are_right() {
        for plan in plans(11, 500, true) {
            let mut open: Vec<Action> = Vec::new();
            for step in &plan.steps {
                match &step.action {
                    Action::Kill(t) => open.push(Action::Restart(*t)),
                    Action::Pause(t) => open.push(Action::Resume(*t)),
                    Action::HaltDatabase => open.push(Action::ResumeDatabase),
                    Action::Cut(link) => open.push(Action::HealLinks(link.member())),
                    Action::Slow { member, .. } => open.push(Action::HealLinks(*member)),
                    heal @ (Action::Restart(_) | Action::Resume(_) | Action::ResumeDatabase | Action::HealLinks(_)) => {
                        let at = open.iter().position(|a| a == heal);
                        assert!(at.is_some(), "{plan:?}: {heal:?} heals nothing");
                        open.remove(at.unwrap_or_default());
                    }
                    Action::Drain { member, .. } => assert_ne!(*member, 1, "member 1 owns nothing"),
                    Action::Rebalance { .. } | Action::EmptyStore | Action::CommitsAsynchronous => {}
                    Action::Remember => open.push(Action::Forget),
                    Action::Forget => {
                        let at = open.iter().position(|a| a == &Action::Forget);
                        assert!(at.is_some(), "{plan:?}: nothing remembered to forget");
                        open.remove(at.unwrap_or_default());
                    }
                }
                match &step.action {
                    Action::Kill(Target::Member(m))
                    | Action::Pause(Target::Member(m))
                    | Action::Cut(Link::Sidecars(m) | Link::Gateways(m))
                    | Action::Slow { member: m, .. } => {
                        assert_ne!(*m, 1, "{plan:?}: member faults hit members that own instances");
                    }
                    Action::Cut(Link::OneWay { member, gateway, .. }) => {
                        assert_ne!(*member, 1, "{plan:?}: member faults hit members that own instances");
                        assert_eq!(
                            *gateway, *member,
                            "{plan:?}: one way of the link to the replica holding its stream"
                        );
                    }
                    _ => {}
                }
                if matches!(plan.fault, Fault::CoordinatorKill | Fault::CoordinatorPause) {
                    assert!(plan.steps.iter().all(|s| !matches!(
                        s.action,
                        Action::Kill(Target::Gateway(g)) | Action::Pause(Target::Gateway(g)) if g != 1
                    )));
                }
            }
            assert!(open.is_empty(), "{plan:?} leaves {open:?}");
            assert!(plan.steps.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        }
    }

    #[test]
    fn composite_faults_never_hit_one_process_twice() {
        for plan in plans(3, 500, true) {
            let hits: Vec<Target> = plan
                .steps
                .iter()
                .filter_map(|s| match s.action {
                    Action::Kill(t) | Action::Pause(t) => Some(t),
                    _ => None,
                })
                .collect();
            let distinct: BTreeSet<String> = hits.iter().map(|t| format!("{t:?}")).collect();
            assert_eq!(distinct.len(), hits.len(), "{plan:?}");
        }
    }
}
