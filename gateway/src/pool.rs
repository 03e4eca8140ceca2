//! The pool as one replica sees it: an in-memory index re-read from the store
//! on every refresh (and at once when a membership changes), published on a
//! watch channel. Stream tasks turn it into per-member snapshots; the
//! coordinator turns it into placement input. Everything here but `reload` is pure; the tasks
//! that keep the view fresh are in [`crate::refresh`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::common::v1::{InstanceRef, RouteDirectoryEntry};
use proto::host::v1::{AssignmentPhase as WirePhase, OwnedInstance, Snapshot};
use proto::timing;

use crate::placement::{Candidate, Owner};
use crate::registration::Material;
use crate::store::{
    self, Assignment, AssignmentPhase, InstanceRecord, MemberRecord, Operation, PoolWrites, Report, Store,
};

/// How often a replica re-reads the pool when nothing wakes it earlier.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(200);

/// One read of the pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// Database time of the read.
    pub now_ms: i64,
    /// When this replica started the read (`None`: not read from a store): a stream admitted
    /// before it finds its own record in it.
    pub read_at: Option<Instant>,
    /// Every registered instance, withdrawn ones included.
    pub instances: Table<BTreeMap<String, InstanceRecord>>,
    pub assignments: Table<BTreeMap<String, Assignment>>,
    /// Every member record, expired ones included.
    pub members: BTreeMap<String, MemberRecord>,
    pub reports: Table<BTreeMap<String, Report>>,
    pub operations: Table<Vec<Operation>>,
    /// When each replica last recorded that it is running (database time).
    pub replicas: BTreeMap<String, i64>,
    /// The last span this replica could not read the store, as database times (the last
    /// read before, the first read after): nobody's records could be refreshed in it, so a
    /// record that lapsed within it is no evidence of silence until the writers have had
    /// [`BLACKOUT_GRACE`] to refresh it (see [`View::member_is_live`]).
    pub blackout: Option<(i64, i64)>,
    /// Changes whenever what a member's snapshot is built from changes (instances,
    /// assignments, members' processes and addresses); equal revisions build equal snapshots,
    /// so a stream rebuilds only when it changed (0: not numbered, always build).
    pub snapshot_revision: u64,
    /// When the reports were last read from the store: a report that moves only a workload's
    /// progress is not counted as a write, so they are re-read every [`COUNTERS_READ_EVERY`].
    pub reports_read_at: Option<Instant>,
    /// The store's write counts taken just before this view's tables were read (`None`: not
    /// counted); the next refresh re-reads only the tables whose count moved.
    pub writes: Option<PoolWrites>,
    /// Memo of [`crate::room::unplaced`] for this view: placement runs once per view
    /// however many registrations wait on it.
    pub unplaced: Memo<BTreeMap<String, String>>,
    /// Memo of [`crate::room::takes_one_more`] for this view.
    pub room: Memo<bool>,
    /// Memo of [`View::directory`]: built once per view, shared by every member stream.
    pub route_directory: Memo<Arc<Directory>>,
}

/// The route directory (host.v1.Snapshot.directory) by route.
pub type Directory = BTreeMap<String, RouteDirectoryEntry>;

/// One table of a view, shared with the views before it while nobody writes to it: a refresh
/// that finds a table unchanged takes it over without copying it, and comparing two views
/// compares shared tables by address. Changing it (tests, plans) copies it first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table<T>(Arc<T>);

impl<T> std::ops::Deref for Table<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Clone> std::ops::DerefMut for Table<T> {
    fn deref_mut(&mut self) -> &mut T {
        Arc::make_mut(&mut self.0)
    }
}

impl<T> Table<T> {
    /// Whether both are the same read of the table (shared, not merely equal).
    pub fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl<'a, T> IntoIterator for &'a Table<T>
where
    &'a T: IntoIterator,
{
    type Item = <&'a T as IntoIterator>::Item;
    type IntoIter = <&'a T as IntoIterator>::IntoIter;

    fn into_iter(self) -> Self::IntoIter {
        self.0.as_ref().into_iter()
    }
}

impl<T> From<T> for Table<T> {
    fn from(table: T) -> Self {
        Self(Arc::new(table))
    }
}

/// A value worked out from the rest of a view, at most once. A clone starts empty (the clone
/// may be changed before anyone asks), and memos never make two views unequal.
#[derive(Debug)]
pub struct Memo<T>(std::sync::OnceLock<T>);

impl<T> Memo<T> {
    pub fn get_or_init(&self, work: impl FnOnce() -> T) -> &T {
        self.0.get_or_init(work)
    }
}

impl<T> Default for Memo<T> {
    fn default() -> Self {
        Self(std::sync::OnceLock::new())
    }
}

impl<T> Clone for Memo<T> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl<T> PartialEq for Memo<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> Eq for Memo<T> {}

/// How often a refresh reads every table even when no write was counted: a safety net.
pub const FULL_READ_EVERY: Duration = Duration::from_secs(60);

/// How old the workloads' progress counters in a view may be (status and watch show them;
/// nothing decides on them).
pub const COUNTERS_READ_EVERY: Duration = Duration::from_secs(10);

/// After the store was unreachable, how long records that lapsed meanwhile still count as
/// live: two membership refreshes and a pool read, time for every stream to refresh its
/// member's record (or for the member to attach again).
pub const BLACKOUT_GRACE: Duration =
    Duration::from_millis(2 * timing::MEMBERSHIP_REFRESH.as_millis() as u64 + REFRESH_INTERVAL.as_millis() as u64);

impl View {
    /// Read the whole pool.
    pub async fn load(store: &Store) -> store::Result<Self> {
        Self::reload(store, None).await
    }

    /// Read the pool, taking from `previous` the tables nobody wrote since it was read (every
    /// table without one). Members and replicas' liveness are small and always read.
    pub async fn reload(store: &Store, previous: Option<&View>) -> store::Result<Self> {
        let read_at = Some(Instant::now());
        // The view's time first, then the counts: a writer that waits for a view whose time is
        // past its write (the coordinator) gets counts that include it, so no table written
        // since is taken from `previous` (a drain's count of moves was lost that way).
        let (now_ms, members) = store.list_members().await?;
        // Counted before the tables are read: a write committed after the count is either in
        // what is read below or moves the count for the next refresh.
        let writes = store.pool_writes().await?;
        let unchanged = |count: fn(&PoolWrites) -> i64| {
            previous.filter(|p| {
                p.writes
                    .is_some_and(|before| before.incarnation == writes.incarnation && count(&before) == count(&writes))
            })
        };
        let instances = match unchanged(|w| w.instances) {
            Some(p) => p.instances.clone(),
            None => by_route(store.list_instances().await?, |i| &i.route).into(),
        };
        let assignments = match unchanged(|w| w.assignments) {
            Some(p) => p.assignments.clone(),
            None => by_route(store.list_assignments().await?, |a| &a.route).into(),
        };
        let counters_fresh = |p: &&View| p.reports_read_at.is_some_and(|at| at.elapsed() < COUNTERS_READ_EVERY);
        let (reports, reports_read_at) = match unchanged(|w| w.reports).filter(counters_fresh) {
            Some(p) => (p.reports.clone(), p.reports_read_at),
            None => (by_route(store.list_reports().await?, |r| &r.route).into(), read_at),
        };
        let operations = match unchanged(|w| w.operations) {
            Some(p) => p.operations.clone(),
            None => store.list_operations().await?.into(),
        };
        Ok(Self {
            now_ms,
            read_at,
            instances,
            assignments,
            members: members.into_iter().map(|m| (m.member.clone(), m)).collect(),
            reports,
            operations,
            replicas: store.list_replicas().await?.into_iter().collect(),
            blackout: None,
            snapshot_revision: 0,
            reports_read_at,
            writes: Some(writes),
            unplaced: Memo::default(),
            room: Memo::default(),
            route_directory: Memo::default(),
        })
    }

    /// Number this view's snapshot input after `previous`: the same revision when instances,
    /// assignments and members' processes and addresses are unchanged, the next otherwise.
    pub fn number_after(&mut self, previous: Option<&View>) {
        self.snapshot_revision = match previous {
            Some(p) if p.snapshot_revision != 0 && self.same_snapshot_input(p) => p.snapshot_revision,
            Some(p) => p.snapshot_revision.wrapping_add(1).max(1),
            None => 1,
        };
    }

    fn same_snapshot_input(&self, other: &View) -> bool {
        fn address(m: &MemberRecord) -> (&str, &str, &str) {
            (&m.member, &m.process_id, &m.runtime_address)
        }
        self.assignments == other.assignments
            && self.instances == other.instances
            && self.kept().eq(other.kept())
            && self
                .members
                .values()
                .map(address)
                .eq(other.members.values().map(address))
    }

    /// Whether a plan over this view sees what a plan over `other` saw, time aside: the same
    /// reads of instances, assignments, reports and operations, the same blackout, and the same
    /// member processes, each as live as it was. The coordinator plans such a view again only
    /// when its deadlines may have come (see `coordinator::REPLAN_EVERY`).
    pub fn same_plan_input(&self, other: &View) -> bool {
        fn member<'a>(v: &View, m: &'a MemberRecord) -> (&'a str, &'a str, i64, &'a str, i64, &'a str, bool, bool) {
            let (name, process, address, served_by) = (&m.member, &m.process_id, &m.runtime_address, &m.served_by);
            (
                name,
                process,
                m.epoch,
                address,
                m.capacity,
                served_by,
                m.leaving,
                v.member_is_live(m),
            )
        }
        self.instances.same(&other.instances)
            && self.assignments.same(&other.assignments)
            && self.reports.same(&other.reports)
            && self.operations.same(&other.operations)
            && self.blackout == other.blackout
            && self
                .members
                .values()
                .map(|m| member(self, m))
                .eq(other.members.values().map(|m| member(other, m)))
    }

    /// Live member records whose serving replica has not recorded that it is running for
    /// longer than `silence`: the replica is paused, cut off or dead, and cannot tell whether
    /// the member still lives. A member that attached elsewhere has a record served by its
    /// new replica; one whose replica never recorded itself is left to its TTL.
    /// A replica's silence is counted from the end of a blackout when it was still recording
    /// itself when the blackout began (it could not write meanwhile either).
    pub fn orphaned(&self, silence: Duration) -> Vec<&MemberRecord> {
        let silence_ms = i64::try_from(silence.as_millis()).unwrap_or(i64::MAX);
        self.members
            .values()
            .filter(|m| m.is_live(self.now_ms))
            .filter(|m| {
                self.replicas.get(&m.served_by).is_some_and(|at| {
                    let heard = match self.blackout {
                        Some((from, to)) if *at >= from.saturating_sub(silence_ms) => (*at).max(to),
                        _ => *at,
                    };
                    heard < self.now_ms.saturating_sub(silence_ms)
                })
            })
            .collect()
    }

    /// Whether `m` counts as a live member process: its record has not expired, or it
    /// expired during this replica's last blackout and the grace after it has not passed (the
    /// record could not be refreshed; a record that had expired before stays expired).
    pub fn member_is_live(&self, m: &MemberRecord) -> bool {
        if m.is_live(self.now_ms) {
            return true;
        }
        let grace_ms = i64::try_from(BLACKOUT_GRACE.as_millis()).unwrap_or(i64::MAX);
        self.blackout
            .is_some_and(|(from, to)| m.expires_at_ms > from && self.now_ms < to.saturating_add(grace_ms))
    }

    /// The member process with a live record, if `member` is one.
    pub fn live_member(&self, member: &str) -> Option<&MemberRecord> {
        self.members.get(member).filter(|m| self.member_is_live(m))
    }

    /// Whether `process_id` is the live process of `member`.
    pub fn is_live(&self, member: &str, process_id: &str) -> bool {
        self.live_member(member).is_some_and(|m| m.process_id == process_id)
    }

    /// Routes of the desired (registered, not withdrawn) instances.
    pub fn desired(&self) -> BTreeSet<String> {
        self.instances
            .values()
            .filter(|i| !i.withdrawn)
            .map(|i| i.route.clone())
            .collect()
    }

    /// Live member processes as placement candidates; `excluded` members
    /// (drained by an operator) and leaving members take nothing new.
    pub fn candidates(&self, excluded: &BTreeSet<String>) -> Vec<Candidate> {
        self.members
            .values()
            .filter(|m| self.member_is_live(m))
            .map(|m| Candidate {
                member: m.member.clone(),
                process_id: m.process_id.clone(),
                capacity: usize::try_from(m.capacity).unwrap_or(0),
                excluded: m.leaving || excluded.contains(&m.member),
            })
            .collect()
    }

    /// Whether `a` was made for an older workload of its route than the registered one
    /// (a Pod recreated under the same name): its owner must let go, nothing may use it.
    pub fn is_stale(&self, a: &Assignment) -> bool {
        self.instances
            .get(&a.route)
            .is_some_and(|i| a.generation < i.generation)
    }

    /// Whether `a` holds a session of a desired instance: not withdrawn, not stale.
    pub fn holds_desired(&self, a: &Assignment) -> bool {
        self.instances
            .get(&a.route)
            .is_some_and(|i| !i.withdrawn && a.generation >= i.generation)
    }

    /// `proposed`, or the term after the route's last one when that is higher: terms never
    /// repeat on a route, and a sidecar's registration raises the last one to its fence (a
    /// store restored from an older backup may hold an assignment below it).
    pub fn fresh_term(&self, route: &str, proposed: crate::store::OwnershipTerm) -> crate::store::OwnershipTerm {
        match self.instances.get(route) {
            Some(i) if i.last_term >= proposed => i.last_term.next(),
            _ => proposed,
        }
    }

    /// The assignment of `route`, unless it is stale.
    pub fn current_assignment(&self, route: &str) -> Option<&Assignment> {
        self.assignments.get(route).filter(|a| !self.is_stale(a))
    }

    /// Whether `a`'s term is below its route's last term: a sidecar registered a fence above
    /// it (the store lost the terms between, runtime.v1.StoreBehind), so no sidecar takes it up.
    pub fn overtaken(&self, a: &Assignment) -> bool {
        self.instances
            .get(&a.route)
            .is_some_and(|i| i.generation == a.generation && a.term < i.last_term)
    }

    pub fn owners(&self) -> BTreeMap<String, Owner> {
        self.assignments
            .values()
            .map(|a| {
                let failed = self.reports.get(&a.route).is_some_and(|r| {
                    r.term == a.term && r.member == a.member && r.process_id == a.process_id && r.phase.lost()
                }) || self.overtaken(a);
                let owner = Owner {
                    member: a.member.clone(),
                    process_id: a.process_id.clone(),
                    term: a.term,
                    failed,
                    stale: self.is_stale(a),
                };
                (a.route.clone(), owner)
            })
            .collect()
    }

    /// The whole desired state of one member process, without the route
    /// directory (revision left at 0: the stream numbers what it sends and adds
    /// the directory, whole or as a delta). Omitted routes mean release: a stale
    /// assignment (its workload was replaced under the route) is omitted, so
    /// the owner lets the old session go; so is a withdrawn instance (its
    /// workload ended or its Pod is gone: the owner relinquishes the session
    /// until the coordinator drops the assignment).
    pub fn snapshot_for(&self, member: &str, process_id: &str, recovery_deadline_ms: u64) -> Snapshot {
        let mut snapshot = Snapshot {
            recovery_deadline_ms,
            ..Snapshot::default()
        };
        for a in self.assignments.values() {
            if a.member != member || a.process_id != process_id || self.is_stale(a) {
                continue;
            }
            match self.instances.get(&a.route) {
                Some(instance) if !instance.withdrawn => snapshot.instances.push(OwnedInstance {
                    route: a.route.clone(),
                    instance: Some(instance_ref(instance)),
                    term: a.term.get(),
                    phase: match a.phase {
                        AssignmentPhase::Reserved => WirePhase::Reserved,
                        AssignmentPhase::Active => WirePhase::Active,
                    } as i32,
                    credentials: member_credentials(instance),
                    grant: String::new(),
                    grant_expires_at_ms: 0,
                    egress_policy: None,
                }),
                _ => {}
            }
        }
        // A session at a term the store forgot: kept until the coordinator reserved it anew
        // for this member (`forgotten`), never released meanwhile.
        snapshot.keep_routes = self
            .kept()
            .filter(|r| r.member == member && r.process_id == process_id)
            .map(|r| r.route.clone())
            .chain(crate::returned::kept(self, member, process_id).cloned())
            .collect();
        snapshot
    }

    /// The reports of sessions at a term the store forgot, whose owners keep them.
    fn kept(&self) -> impl Iterator<Item = &Report> {
        self.reports
            .values()
            .filter(|r| crate::forgotten::reported_above(self, r))
    }

    /// The current owner of every placed route whose instance is desired: stale
    /// assignments and withdrawn instances are left out. Worked out once per view.
    pub fn directory(&self) -> Arc<Directory> {
        let build = || {
            let entries = self.assignments.values().filter(|a| self.holds_desired(a)).map(|a| {
                let entry = RouteDirectoryEntry {
                    route: a.route.clone(),
                    member: a.member.clone(),
                    process_id: a.process_id.clone(),
                    runtime_address: self
                        .members
                        .get(&a.member)
                        .filter(|m| m.process_id == a.process_id)
                        .map(|m| m.runtime_address.clone())
                        .unwrap_or_default(),
                    term: a.term.get(),
                };
                (a.route.clone(), entry)
            });
            Arc::new(entries.collect())
        };
        Arc::clone(self.route_directory.get_or_init(build))
    }
}

pub fn instance_ref(instance: &InstanceRecord) -> InstanceRef {
    InstanceRef {
        namespace: instance.namespace.clone(),
        name: instance.name.clone(),
        uid: instance.uid.clone(),
        generation: u64::try_from(instance.generation).unwrap_or(0),
    }
}

/// The instance's material as its owner may see it (no receipt key). Material
/// that does not decode is withheld: the member then waits, it never revokes.
fn member_credentials(instance: &InstanceRecord) -> Vec<u8> {
    let binding = crate::registration::Binding {
        route: &instance.route,
        namespace: &instance.namespace,
        name: &instance.name,
        uid: &instance.uid,
    };
    Material::decode(&instance.material.0, &binding)
        .map(|m| m.for_member())
        .unwrap_or_default()
}

fn by_route<T>(items: Vec<T>, route: impl Fn(&T) -> &String) -> BTreeMap<String, T> {
    items.into_iter().map(|item| (route(&item).clone(), item)).collect()
}

#[cfg(test)]
#[path = "pool_tests.rs"]
pub(crate) mod tests;
