//! The pure snapshot planner: what applying a snapshot means for the sessions a member holds.
//!
//! [`apply`] compares the held sessions with a snapshot and returns the actions to execute, per
//! route (host.proto `Snapshot`):
//! - listed in `stop_routes` and held: [`Action::Stop`] (stop wins over the same route in
//!   `instances`);
//! - listed in `keep_routes`, or in `instances` with phase UNSPECIFIED or an invalid entry:
//!   nothing (keep what the member does);
//! - listed in `instances` and not held: [`Action::Host`]; held for another instance (another
//!   generation under the route): [`Action::Release`] of the old one, then [`Action::Host`];
//!   at a higher term: [`Action::Move`]; at the same term with a newly active phase or newly
//!   carried material: [`Action::Update`]; at a lower term: nothing (ignored);
//! - held and listed nowhere: [`Action::Release`]. Omission means release, never stop.
//!
//! Empty credentials never revoke held material: the assignment then carries `None`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proto::common::v1::{InstanceRef, RouteDirectoryEntry};
use proto::host::v1::{AssignmentPhase, Snapshot};

pub use super::material::{Credentials, Grant};

/// Whether a term is held as a pending takeover or activated (host.proto `AssignmentPhase`
/// without UNSPECIFIED, which the planner treats as keep).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TermPhase {
    Reserved,
    Active,
}

/// What a snapshot assigns to a route: a term, its phase and (when carried) the material and
/// the recovery grant for a reserved term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub term: u64,
    pub phase: TermPhase,
    pub credentials: Option<Credentials>,
    pub grant: Option<Grant>,
}

/// What the member holds for one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub instance: InstanceRef,
    pub term: u64,
    pub phase: TermPhase,
    pub has_credentials: bool,
    pub has_grant: bool,
}

/// The sessions a member holds, by route (sessions still running; ended ones are not held).
pub type Sessions = BTreeMap<String, Held>;

/// One step of applying a snapshot. Executed in the order returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Stop the workload and end the session (`stop_routes`).
    Stop { route: String },
    /// Give up ownership without stopping the workload, and end the session (omitted route).
    Release { route: String },
    /// Start a session for an instance not held yet.
    Host {
        route: String,
        instance: InstanceRef,
        assignment: Assignment,
    },
    /// Move a held session to a higher term.
    Move { route: String, assignment: Assignment },
    /// Same term: the phase became active, or material or a grant arrived for the first time.
    Update { route: String, assignment: Assignment },
}

/// Plans a snapshot against the held sessions. Pure: no I/O, no clock.
pub fn apply(current: &Sessions, snapshot: &Snapshot) -> Vec<Action> {
    let stops: BTreeSet<&str> = snapshot.stop_routes.iter().map(String::as_str).collect();
    let mut mentioned: BTreeSet<&str> = stops.iter().copied().collect();
    mentioned.extend(snapshot.keep_routes.iter().map(String::as_str));

    let mut stop_actions = Vec::new();
    let mut release_actions = Vec::new();
    let mut moves = Vec::new();
    let mut hosts = Vec::new();

    for route in &stops {
        if current.contains_key(*route) {
            stop_actions.push(Action::Stop {
                route: (*route).to_owned(),
            });
        }
    }

    for owned in &snapshot.instances {
        let route = owned.route.as_str();
        // Stop wins; a duplicate entry is ignored after the first one.
        if !mentioned.insert(route) {
            continue;
        }
        let phase = match AssignmentPhase::try_from(owned.phase) {
            Ok(AssignmentPhase::Reserved) => TermPhase::Reserved,
            Ok(AssignmentPhase::Active) => TermPhase::Active,
            // UNSPECIFIED or unknown: like keep_routes.
            Ok(AssignmentPhase::Unspecified) | Err(_) => continue,
        };
        let Some(instance) = owned.instance.as_ref().filter(|_| owned.term >= 1 && !route.is_empty()) else {
            continue; // An invalid entry never releases or replaces what is held.
        };
        let assignment = Assignment {
            term: owned.term,
            phase,
            credentials: Credentials::from_wire(&owned.credentials),
            grant: (phase == TermPhase::Reserved)
                .then(|| Grant::from_snapshot(&owned.grant, owned.grant_expires_at_ms))
                .flatten(),
        };
        let route = route.to_owned();
        match current.get(&route) {
            None => hosts.push(Action::Host {
                route,
                instance: instance.clone(),
                assignment,
            }),
            Some(held) if held.instance != *instance => {
                release_actions.push(Action::Release { route: route.clone() });
                hosts.push(Action::Host {
                    route,
                    instance: instance.clone(),
                    assignment,
                });
            }
            Some(held) if assignment.term > held.term => moves.push(Action::Move { route, assignment }),
            Some(held) if assignment.term == held.term => {
                let activates = assignment.phase > held.phase;
                let brings_material = assignment.credentials.is_some() && !held.has_credentials;
                let brings_grant = assignment.grant.is_some() && !held.has_grant;
                if activates || brings_material || brings_grant {
                    // Never step back from an activated term to a reserved one.
                    let assignment = Assignment {
                        phase: assignment.phase.max(held.phase),
                        ..assignment
                    };
                    moves.push(Action::Update { route, assignment });
                }
            }
            Some(_) => {} // A lower term than held: ignored.
        }
    }

    for route in current.keys() {
        if !mentioned.contains(route.as_str()) {
            release_actions.push(Action::Release { route: route.clone() });
        }
    }

    stop_actions
        .into_iter()
        .chain(release_actions)
        .chain(moves)
        .chain(hosts)
        .collect()
}

/// The route directory by route (host.proto `Snapshot.directory`).
pub type Directory = BTreeMap<String, RouteDirectoryEntry>;

/// Applies the snapshot's route directory to the one held: replaced when whole, changed when
/// a delta (`directory_delta`). An entry without a route or with term 0 is not an owner: it
/// is left out (in a delta it removes its route's entry).
pub fn apply_directory(held: &mut Arc<Directory>, snapshot: &Snapshot) {
    let valid = |e: &RouteDirectoryEntry| !e.route.is_empty() && e.term >= 1;
    if !snapshot.directory_delta {
        let whole = snapshot.directory.iter().filter(|e| valid(e));
        *held = Arc::new(whole.map(|e| (e.route.clone(), e.clone())).collect());
        return;
    }
    if snapshot.directory.is_empty() && snapshot.directory_removed.is_empty() {
        return;
    }
    let directory = Arc::make_mut(held);
    for route in &snapshot.directory_removed {
        directory.remove(route);
    }
    for entry in &snapshot.directory {
        if valid(entry) {
            directory.insert(entry.route.clone(), entry.clone());
        } else {
            directory.remove(&entry.route);
        }
    }
}

/// The held routes whose store is behind the term held, with the term the store names (0:
/// none): the directory names the route below it (the store lost commits), or names it not
/// at all while the snapshot keeps it (the store lost the instance or its assignment). Their
/// sidecars register their standing (runtime.v1.StoreBehind). Pure.
pub fn store_behind<'a>(held: &'a Sessions, directory: &Directory, snapshot: &Snapshot) -> Vec<(&'a str, u64)> {
    held.iter()
        .filter_map(|(route, session)| {
            let named = match directory.get(route) {
                Some(entry) => entry.term,
                None if snapshot.keep_routes.contains(route) => 0,
                None => return None,
            };
            (named < session.term).then_some((route.as_str(), named))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proto::host::v1::OwnedInstance;

    use super::*;

    fn instance(name: &str, generation: u64) -> InstanceRef {
        InstanceRef {
            namespace: "team-a".into(),
            name: name.into(),
            uid: format!("uid-{name}-{generation}"),
            generation,
        }
    }

    fn owned(route: &str, term: u64, phase: AssignmentPhase, credentials: &[u8]) -> OwnedInstance {
        OwnedInstance {
            route: route.into(),
            instance: Some(instance(route, 1)),
            term,
            phase: phase as i32,
            credentials: credentials.to_vec(),
            ..Default::default()
        }
    }

    fn held(route: &str, term: u64, phase: TermPhase) -> (String, Held) {
        let held = Held {
            instance: instance(route, 1),
            term,
            phase,
            has_credentials: true,
            has_grant: false,
        };
        (route.to_owned(), held)
    }

    fn snapshot(instances: Vec<OwnedInstance>, stop: &[&str], keep: &[&str]) -> Snapshot {
        Snapshot {
            revision: 1,
            instances,
            stop_routes: stop.iter().map(|s| (*s).to_owned()).collect(),
            keep_routes: keep.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        }
    }

    fn assignment(term: u64, phase: TermPhase, credentials: Option<&[u8]>) -> Assignment {
        Assignment {
            term,
            phase,
            credentials: credentials.and_then(Credentials::from_wire),
            grant: None,
        }
    }

    #[test]
    fn a_store_that_names_a_held_route_below_its_term_or_not_at_all_while_keeping_it_is_behind() {
        let held: Sessions = [
            held("ns/lower", 5, TermPhase::Active),
            held("ns/same", 5, TermPhase::Active),
            held("ns/kept", 5, TermPhase::Active),
            held("ns/unnamed", 5, TermPhase::Active),
        ]
        .into();
        let entry = |route: &str, term| {
            let entry = RouteDirectoryEntry {
                route: route.into(),
                term,
                ..RouteDirectoryEntry::default()
            };
            (route.to_owned(), entry)
        };
        let directory: Directory = [entry("ns/lower", 4), entry("ns/same", 5)].into();
        let snapshot = snapshot(Vec::new(), &[], &["ns/kept", "ns/same"]);
        assert_eq!(
            store_behind(&held, &directory, &snapshot),
            [("ns/kept", 0), ("ns/lower", 4)],
            "a route named nowhere and not kept is being released, not behind"
        );
    }

    #[test]
    fn hosts_new_instances_at_their_term() {
        let snap = snapshot(
            vec![
                owned("a", 1, AssignmentPhase::Active, b"cred-a"),
                owned("b", 4, AssignmentPhase::Reserved, b""),
            ],
            &[],
            &[],
        );
        assert_eq!(
            apply(&Sessions::new(), &snap),
            vec![
                Action::Host {
                    route: "a".into(),
                    instance: instance("a", 1),
                    assignment: assignment(1, TermPhase::Active, Some(b"cred-a")),
                },
                Action::Host {
                    route: "b".into(),
                    instance: instance("b", 1),
                    assignment: assignment(4, TermPhase::Reserved, None),
                },
            ]
        );
    }

    #[test]
    fn a_held_instance_at_the_same_term_is_left_alone() {
        let current = Sessions::from([held("a", 2, TermPhase::Active)]);
        let snap = snapshot(vec![owned("a", 2, AssignmentPhase::Active, b"cred")], &[], &[]);
        assert_eq!(apply(&current, &snap), vec![]);
        // A lagging RESERVED view of a term already active does not step it back.
        let snap = snapshot(vec![owned("a", 2, AssignmentPhase::Reserved, b"")], &[], &[]);
        assert_eq!(apply(&current, &snap), vec![]);
    }

    #[test]
    fn a_higher_term_moves_the_existing_session() {
        let current = Sessions::from([held("a", 2, TermPhase::Active)]);
        let snap = snapshot(vec![owned("a", 3, AssignmentPhase::Reserved, b"")], &[], &[]);
        assert_eq!(
            apply(&current, &snap),
            vec![Action::Move {
                route: "a".into(),
                assignment: assignment(3, TermPhase::Reserved, None)
            }]
        );
    }

    #[test]
    fn lower_terms_are_ignored_and_never_release() {
        let current = Sessions::from([held("a", 5, TermPhase::Reserved)]);
        let snap = snapshot(vec![owned("a", 4, AssignmentPhase::Active, b"old")], &[], &[]);
        assert_eq!(apply(&current, &snap), vec![]);
    }

    #[test]
    fn same_term_activation_and_first_material_update_the_session() {
        let current = Sessions::from([held("a", 2, TermPhase::Reserved)]);
        let snap = snapshot(vec![owned("a", 2, AssignmentPhase::Active, b"")], &[], &[]);
        assert_eq!(
            apply(&current, &snap),
            vec![Action::Update {
                route: "a".into(),
                assignment: assignment(2, TermPhase::Active, None)
            }]
        );

        let mut without_material = held("b", 1, TermPhase::Reserved);
        without_material.1.has_credentials = false;
        let current = Sessions::from([without_material]);
        let snap = snapshot(vec![owned("b", 1, AssignmentPhase::Reserved, b"cred")], &[], &[]);
        assert_eq!(
            apply(&current, &snap),
            vec![Action::Update {
                route: "b".into(),
                assignment: assignment(1, TermPhase::Reserved, Some(b"cred"))
            }]
        );
    }

    #[test]
    fn a_snapshot_grant_reaches_the_session_of_a_reserved_term_once() {
        let mut with_grant = owned("a", 3, AssignmentPhase::Reserved, b"cred");
        with_grant.grant = "h.c.s".into();
        with_grant.grant_expires_at_ms = 99;
        let snap = snapshot(vec![with_grant.clone()], &[], &[]);
        let expected = Assignment {
            grant: Grant::from_snapshot("h.c.s", 99),
            ..assignment(3, TermPhase::Reserved, Some(b"cred"))
        };
        let host = Action::Host {
            route: "a".into(),
            instance: instance("a", 1),
            assignment: expected.clone(),
        };
        assert_eq!(apply(&Sessions::new(), &snap), vec![host]);

        // The same term held without a grant: the grant is an update; held with one: nothing.
        let mut current = Sessions::from([held("a", 3, TermPhase::Reserved)]);
        let update = Action::Update {
            route: "a".into(),
            assignment: expected,
        };
        assert_eq!(apply(&current, &snap), vec![update]);
        current.get_mut("a").unwrap().has_grant = true;
        assert_eq!(apply(&current, &snap), vec![]);
        // An active term never carries a grant.
        with_grant.phase = AssignmentPhase::Active as i32;
        let snap = snapshot(vec![with_grant], &[], &[]);
        let host = apply(&Sessions::new(), &snap);
        assert!(matches!(&host[0], Action::Host { assignment, .. } if assignment.grant.is_none()));
    }

    #[test]
    fn empty_credentials_never_revoke_material() {
        let current = Sessions::from([held("a", 1, TermPhase::Active)]);
        let snap = snapshot(vec![owned("a", 1, AssignmentPhase::Active, b"")], &[], &[]);
        assert_eq!(apply(&current, &snap), vec![]);
        let snap = snapshot(vec![owned("a", 2, AssignmentPhase::Active, b"")], &[], &[]);
        // The move carries no material: the session keeps what it holds.
        assert_eq!(
            apply(&current, &snap),
            vec![Action::Move {
                route: "a".into(),
                assignment: assignment(2, TermPhase::Active, None)
            }]
        );
    }

    #[test]
    fn stop_routes_stop_held_sessions_and_win_over_instances() {
        let current = Sessions::from([held("a", 1, TermPhase::Active), held("b", 1, TermPhase::Active)]);
        let snap = snapshot(
            vec![
                owned("a", 2, AssignmentPhase::Reserved, b""),
                owned("b", 1, AssignmentPhase::Active, b""),
            ],
            &["a", "not-held"],
            &[],
        );
        assert_eq!(apply(&current, &snap), vec![Action::Stop { route: "a".into() }]);
    }

    #[test]
    fn omission_releases_and_never_stops() {
        let current = Sessions::from([held("a", 1, TermPhase::Active), held("b", 1, TermPhase::Active)]);
        let snap = snapshot(vec![owned("b", 1, AssignmentPhase::Active, b"")], &[], &[]);
        assert_eq!(apply(&current, &snap), vec![Action::Release { route: "a".into() }]);
        let empty = snapshot(vec![], &[], &[]);
        assert_eq!(
            apply(&current, &empty),
            vec![
                Action::Release { route: "a".into() },
                Action::Release { route: "b".into() }
            ]
        );
    }

    #[test]
    fn keep_routes_and_unspecified_phases_keep_what_is_held() {
        let current = Sessions::from([held("a", 1, TermPhase::Active), held("b", 1, TermPhase::Reserved)]);
        let snap = snapshot(vec![owned("b", 9, AssignmentPhase::Unspecified, b"")], &[], &["a", "c"]);
        assert_eq!(apply(&current, &snap), vec![]);
        // An unspecified phase for a route not held does not host it either.
        let snap = snapshot(vec![owned("c", 1, AssignmentPhase::Unspecified, b"")], &[], &["a", "b"]);
        assert_eq!(apply(&Sessions::new(), &snap), vec![]);
    }

    #[test]
    fn invalid_entries_are_kept_not_released() {
        let current = Sessions::from([held("a", 1, TermPhase::Active), held("b", 1, TermPhase::Active)]);
        let mut no_instance = owned("a", 2, AssignmentPhase::Active, b"");
        no_instance.instance = None;
        let zero_term = owned("b", 0, AssignmentPhase::Active, b"");
        let snap = snapshot(vec![no_instance, zero_term], &[], &[]);
        assert_eq!(apply(&current, &snap), vec![]);
    }

    #[test]
    fn another_generation_under_a_held_route_releases_the_old_one_first() {
        let current = Sessions::from([held("a", 7, TermPhase::Active)]);
        let mut next = owned("a", 1, AssignmentPhase::Reserved, b"new");
        next.instance = Some(instance("a", 2));
        let snap = snapshot(vec![next], &[], &[]);
        assert_eq!(
            apply(&current, &snap),
            vec![
                Action::Release { route: "a".into() },
                Action::Host {
                    route: "a".into(),
                    instance: instance("a", 2),
                    assignment: assignment(1, TermPhase::Reserved, Some(b"new")),
                },
            ]
        );
    }

    #[test]
    fn duplicate_routes_use_the_first_entry() {
        let snap = snapshot(
            vec![
                owned("a", 1, AssignmentPhase::Active, b""),
                owned("a", 9, AssignmentPhase::Active, b""),
            ],
            &[],
            &[],
        );
        let actions = apply(&Sessions::new(), &snap);
        assert_eq!(actions.len(), 1);
        assert!(matches!(&actions[0], Action::Host { assignment, .. } if assignment.term == 1));
    }

    #[test]
    fn actions_come_stops_then_releases_then_moves_then_hosts() {
        let current = Sessions::from([
            held("stop", 1, TermPhase::Active),
            held("gone", 1, TermPhase::Active),
            held("move", 1, TermPhase::Active),
        ]);
        let snap = snapshot(
            vec![
                owned("new", 1, AssignmentPhase::Active, b""),
                owned("move", 2, AssignmentPhase::Active, b""),
            ],
            &["stop"],
            &[],
        );
        let kinds: Vec<&str> = apply(&current, &snap)
            .iter()
            .map(|a| match a {
                Action::Stop { .. } => "stop",
                Action::Release { .. } => "release",
                Action::Move { .. } => "move",
                Action::Update { .. } => "update",
                Action::Host { .. } => "host",
            })
            .collect();
        assert_eq!(kinds, vec!["stop", "release", "move", "host"]);
    }

    #[test]
    fn a_whole_directory_replaces_the_held_one_and_a_delta_changes_it() {
        let entry = |route: &str, term: u64| RouteDirectoryEntry {
            route: route.into(),
            member: "m".into(),
            term,
            ..RouteDirectoryEntry::default()
        };
        let whole = |entries: Vec<RouteDirectoryEntry>| Snapshot {
            directory: entries,
            ..Snapshot::default()
        };
        let delta = |entries: Vec<RouteDirectoryEntry>, removed: &[&str]| Snapshot {
            directory: entries,
            directory_delta: true,
            directory_removed: removed.iter().map(|r| (*r).to_owned()).collect(),
            ..Snapshot::default()
        };
        let routes = |d: &Directory| d.iter().map(|(r, e)| (r.clone(), e.term)).collect::<Vec<_>>();
        let mut held = Arc::new(Directory::new());
        apply_directory(
            &mut held,
            &whole(vec![entry("a", 1), entry("b", 1), entry("", 1), entry("z", 0)]),
        );
        assert_eq!(
            routes(&held),
            [("a".into(), 1), ("b".into(), 1)],
            "invalid entries left out"
        );
        let published = Arc::clone(&held);
        apply_directory(
            &mut held,
            &delta(vec![entry("b", 2), entry("c", 1), entry("a", 0)], &["zz"]),
        );
        assert_eq!(
            routes(&held),
            [("b".into(), 2), ("c".into(), 1)],
            "a's invalid entry removed it"
        );
        assert_eq!(published.len(), 2, "a table already published keeps its directory");
        apply_directory(&mut held, &delta(vec![], &["b"]));
        assert_eq!(routes(&held), [("c".into(), 1)]);
        apply_directory(&mut held, &whole(vec![entry("d", 3)]));
        assert_eq!(routes(&held), [("d".into(), 3)], "whole again: replaced");
    }

    #[test]
    fn credentials_debug_is_redacted() {
        let credentials = Credentials::from_wire(b"super-secret").unwrap();
        let shown = format!("{:?}", assignment(1, TermPhase::Active, Some(credentials.expose())));
        assert!(!shown.contains("super-secret") && shown.contains("12 bytes"), "{shown}");
    }
}
