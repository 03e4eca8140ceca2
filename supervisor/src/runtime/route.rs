//! Where a sidecar stream goes (runtime.proto step 1): the [`RouteTable`] the session set
//! publishes after every snapshot and every session end, and the pure [`RouteTable::decide`].

use std::collections::BTreeMap;
use std::sync::Arc;

use proto::common::v1::{InstanceRef, RouteDirectoryEntry};
use proto::runtime::v1::Redirect;
use tonic::Status;

use tokio::sync::mpsc;

use super::stream::{Opening, SidecarStream};

/// Where the route table hands a session its sidecar streams.
pub(crate) type Sidecars = mpsc::Sender<Box<SidecarStream>>;

/// Who this member process is, as the route directory names owners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Me {
    pub member: String,
    pub process_id: String,
}

/// One session's entry: its instance and where its sidecar streams go.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub instance: InstanceRef,
    /// Hosted (listed in the last snapshot) rather than ending (stopping or relinquishing).
    pub live: bool,
    pub sidecars: Sidecars,
}

/// The sessions of this process by route (a route may carry a live session and an older
/// generation still stopping), the route directory and the recovery deadline of the last
/// snapshot.
#[derive(Debug, Default)]
pub(crate) struct RouteTable {
    pub sessions: BTreeMap<String, Vec<Entry>>,
    pub directory: Arc<BTreeMap<String, RouteDirectoryEntry>>,
    pub recovery_deadline_ms: u64,
}

/// What to do with a sidecar stream now.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Hand it to the session of its instance (the session applies step 1a itself).
    Session(Sidecars),
    /// Another member process owns the route (step 1b).
    Redirect(Redirect),
    /// End it with this status.
    Refuse(Status),
    /// Keep it open until a newer snapshot allows a decision (step 1c).
    Park,
}

impl RouteTable {
    pub(crate) fn decide(&self, opening: &Opening, me: &Me) -> Decision {
        if let Some(entries) = self.sessions.get(&opening.route) {
            let open = || entries.iter().filter(|e| !e.sidecars.is_closed());
            if let Some(entry) = open().find(|e| e.instance == opening.instance) {
                return Decision::Session(entry.sidecars.clone());
            }
            if open().any(|e| e.live) {
                return Decision::Refuse(Status::failed_precondition(format!(
                    "this member holds route {} for another instance",
                    opening.route
                )));
            }
        }
        let Some(owner) = self.directory.get(&opening.route) else {
            return Decision::Park;
        };
        let ours = owner.member == me.member && owner.process_id == me.process_id;
        let reachable = !owner.member.is_empty() && !owner.process_id.is_empty() && !owner.runtime_address.is_empty();
        let current = owner.term > opening.fence_term || (owner.term == opening.fence_term && !opening.relinquished);
        if ours || !reachable || !current {
            return Decision::Park;
        }
        Decision::Redirect(Redirect {
            route: opening.route.clone(),
            runtime_address: owner.runtime_address.clone(),
            member: owner.member.clone(),
            process_id: owner.process_id.clone(),
            term: owner.term,
        })
    }
}

#[cfg(test)]
mod tests {
    use proto::common::v1::WorkloadIdentity;
    use tokio::sync::mpsc;

    use super::*;

    fn instance(generation: u64) -> InstanceRef {
        InstanceRef {
            namespace: "team-a".into(),
            name: "agent".into(),
            uid: format!("uid-{generation}"),
            generation,
        }
    }

    fn opening(fence_term: u64, relinquished: bool) -> Opening {
        Opening {
            route: "team-a/agent".into(),
            instance: instance(1),
            fence_term,
            relinquished,
            recovering: relinquished,
            workload: WorkloadIdentity::default(),
        }
    }

    fn me() -> Me {
        Me {
            member: "m-0".into(),
            process_id: "p-0".into(),
        }
    }

    fn owner(member: &str, process_id: &str, term: u64) -> RouteTable {
        let entry = RouteDirectoryEntry {
            route: "team-a/agent".into(),
            member: member.into(),
            process_id: process_id.into(),
            runtime_address: format!("http://{member}:1"),
            term,
        };
        RouteTable {
            directory: Arc::new(BTreeMap::from([(entry.route.clone(), entry)])),
            ..RouteTable::default()
        }
    }

    #[test]
    fn another_owner_redirects_unless_it_is_behind_the_fence() {
        let table = owner("m-1", "p-1", 5);
        assert!(
            matches!(table.decide(&opening(4, false), &me()), Decision::Redirect(r) if r.term == 5 && r.member == "m-1")
        );
        assert!(matches!(table.decide(&opening(5, false), &me()), Decision::Redirect(_)));
        // The term the sidecar relinquished, or an older one, is no owner any more.
        assert!(matches!(table.decide(&opening(5, true), &me()), Decision::Park));
        assert!(matches!(table.decide(&opening(6, false), &me()), Decision::Park));
    }

    #[test]
    fn unknown_routes_our_own_entry_and_unreachable_owners_park() {
        assert!(matches!(
            RouteTable::default().decide(&opening(0, false), &me()),
            Decision::Park
        ));
        assert!(matches!(
            owner("m-0", "p-0", 5).decide(&opening(0, false), &me()),
            Decision::Park
        ));
        // Another process of our own member name is another owner.
        assert!(matches!(
            owner("m-0", "p-9", 5).decide(&opening(0, false), &me()),
            Decision::Redirect(_)
        ));
        let mut table = owner("m-1", "p-1", 5);
        Arc::make_mut(&mut table.directory)
            .values_mut()
            .for_each(|e| e.runtime_address.clear());
        assert!(matches!(table.decide(&opening(0, false), &me()), Decision::Park));
    }

    #[test]
    fn sessions_are_matched_by_instance_and_win_over_the_directory() {
        let (events, _inbox) = mpsc::channel(1);
        let mut table = owner("m-1", "p-1", 5);
        let entry = |generation, live| Entry {
            instance: instance(generation),
            live,
            sidecars: events.clone(),
        };
        table
            .sessions
            .insert("team-a/agent".into(), vec![entry(2, true), entry(1, false)]);
        assert!(matches!(table.decide(&opening(0, false), &me()), Decision::Session(_)));
        table.sessions.insert("team-a/agent".into(), vec![entry(2, true)]);
        assert!(
            matches!(table.decide(&opening(0, false), &me()), Decision::Refuse(s) if s.code() == tonic::Code::FailedPrecondition)
        );
        // A session that ended no longer counts.
        let (closed, inbox) = mpsc::channel(1);
        drop(inbox);
        table.sessions.insert(
            "team-a/agent".into(),
            vec![Entry {
                instance: instance(1),
                live: true,
                sidecars: closed,
            }],
        );
        assert!(matches!(table.decide(&opening(0, false), &me()), Decision::Redirect(_)));
    }
}
