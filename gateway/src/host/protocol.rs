//! `HostProtocol`, the protocol state of one member's host stream: snapshot revisions, acks, and
//! which reported statuses can be attributed to which term. Pure.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;

use proto::common::v1::RouteDirectoryEntry;
use proto::host::v1::{Snapshot, StatusReport};

use crate::pool::Directory;

/// Why a member message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// An ack of a revision this stream never sent.
    AckNeverSent,
    /// An ack lower than one already received.
    AckRegressed,
    /// A report larger than `proto::MAX_STATUS_REPORT_BYTES`.
    OversizedReport,
}

/// A status attributed to a term: the member acknowledged the revision that
/// installed the term before it reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributed {
    pub route: String,
    pub term: u64,
    /// Wire phase name, or `ABSENT` when the member reconciled past the
    /// installing revision without hosting the route.
    pub phase: String,
    pub message: String,
    pub workload_pid: u32,
    pub progress: u64,
}

#[derive(Debug, Default)]
pub struct HostProtocol {
    /// Last revision sent (0 before the first snapshot).
    revision: u64,
    acked: u64,
    /// route -> (term, revision that first carried that term on this stream)
    installs: BTreeMap<String, (u64, u64)>,
    /// Routes whose launch material this stream already carried at their installed term: it
    /// is not sent again while the term stays (host.proto `OwnedInstance.credentials`).
    carried_material: BTreeMap<String, u64>,
    /// The last snapshot sent, before numbering and without its directory.
    last: Option<Snapshot>,
    /// The directory the member holds after the last snapshot sent.
    directory: Option<Arc<Directory>>,
    /// Whether the member applies directory deltas (`Hello.directory_deltas`).
    deltas: bool,
    /// What this stream last handed to the report writer, per route.
    written: BTreeMap<String, Attributed>,
}

/// A status to write, and whether it must be written at once: a new term, phase or workload
/// PID (the coordinator's operations settle on them); counters and messages can wait for the
/// writer's next batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub status: Attributed,
    pub urgent: bool,
}

impl HostProtocol {
    /// A stream of a member that applies directory deltas (`Hello.directory_deltas`) or not.
    pub fn new(deltas: bool) -> Self {
        Self {
            deltas,
            ..Self::default()
        }
    }

    /// Number `body` (a snapshot without its directory) with `directory` as the next snapshot
    /// if either differs from what was last sent. The directory goes whole in the first
    /// snapshot and to a member without deltas, as the change since the last snapshot
    /// otherwise; launch material already carried at the same term is not sent again.
    pub fn next_snapshot(&mut self, body: Snapshot, directory: Arc<Directory>) -> Option<Snapshot> {
        let delta = self.directory.as_deref().map(|held| diff(held, &directory));
        let directory_unchanged = delta
            .as_ref()
            .is_some_and(|(changed, removed)| changed.is_empty() && removed.is_empty());
        if self.last.as_ref() == Some(&body) && directory_unchanged {
            return None;
        }
        self.revision += 1;
        for owned in &body.instances {
            let carried = self
                .installs
                .get(&owned.route)
                .is_some_and(|(term, _)| *term == owned.term);
            if !carried {
                self.installs.insert(owned.route.clone(), (owned.term, self.revision));
            }
        }
        let carried: std::collections::BTreeSet<&str> = body.instances.iter().map(|o| o.route.as_str()).collect();
        self.installs.retain(|route, _| carried.contains(route.as_str()));
        let mut numbered = Snapshot {
            revision: self.revision,
            ..body.clone()
        };
        self.carried_material
            .retain(|route, term| self.installs.get(route).is_some_and(|(installed, _)| installed == term));
        for owned in &mut numbered.instances {
            if owned.credentials.is_empty() {
                continue;
            }
            if self.carried_material.get(&owned.route) == Some(&owned.term) {
                owned.credentials = Vec::new();
            } else {
                self.carried_material.insert(owned.route.clone(), owned.term);
            }
        }
        match delta.filter(|_| self.deltas) {
            Some((changed, removed)) => {
                numbered.directory_delta = true;
                numbered.directory = changed;
                numbered.directory_removed = removed;
            }
            None => numbered.directory = directory.values().cloned().collect(),
        }
        self.last = Some(body);
        self.directory = Some(directory);
        Some(numbered)
    }

    pub fn on_ack(&mut self, revision: u64) -> Result<(), Dropped> {
        if revision > self.revision {
            return Err(Dropped::AckNeverSent);
        }
        if revision < self.acked {
            return Err(Dropped::AckRegressed);
        }
        self.acked = revision;
        Ok(())
    }

    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// The statuses of `report` that can be attributed to a term — plus, for a complete
    /// report, an `ABSENT` status for every installed route the member acknowledged but does
    /// not host (in a partial report an absent route is unchanged).
    pub fn attribute(&self, report: &StatusReport, encoded_len: usize) -> Result<Vec<Attributed>, Dropped> {
        if encoded_len > proto::MAX_STATUS_REPORT_BYTES {
            return Err(Dropped::OversizedReport);
        }
        let applied = report.applied_revision.min(self.acked);
        let attributed = |route: &String, term: u64, s: &proto::host::v1::InstanceStatus| Attributed {
            route: route.clone(),
            term,
            phase: proto::common::v1::InstancePhase::from_wire(s.phase)
                .as_str_name()
                .to_owned(),
            message: plumbing::text::prefix(&s.message, proto::MAX_STATUS_MESSAGE_BYTES).to_owned(),
            workload_pid: s.workload_pid,
            progress: s.counters.as_ref().map_or(0, |c| c.last_progress_value),
        };
        if report.partial {
            return Ok(report
                .instances
                .iter()
                .filter_map(|s| {
                    let (route, &(term, installed_at)) = self.installs.get_key_value(&s.route)?;
                    (term == s.term && installed_at <= applied).then(|| attributed(route, term, s))
                })
                .collect());
        }
        let by_route: BTreeMap<(&str, u64), &proto::host::v1::InstanceStatus> = report
            .instances
            .iter()
            .map(|s| ((s.route.as_str(), s.term), s))
            .collect();
        let mut out = Vec::new();
        for (route, &(term, installed_at)) in &self.installs {
            if installed_at > applied {
                continue;
            }
            out.push(match by_route.get(&(route.as_str(), term)) {
                Some(s) => attributed(route, term, s),
                None => Attributed {
                    route: route.clone(),
                    term,
                    phase: "ABSENT".into(),
                    message: "the owner acknowledged the assignment but does not host it".into(),
                    workload_pid: 0,
                    progress: 0,
                },
            });
        }
        Ok(out)
    }

    /// Of `statuses`, those that differ from what this stream last handed to the writer, each
    /// marked urgent when its term, phase or PID changed; remembered as handed over.
    pub fn changes(&mut self, statuses: Vec<Attributed>) -> Vec<Change> {
        let mut out = Vec::new();
        for status in statuses {
            let urgent = match self.written.get(&status.route) {
                Some(last) if *last == status => continue,
                Some(last) => {
                    (last.term, &last.phase, last.workload_pid) != (status.term, &status.phase, status.workload_pid)
                }
                None => true,
            };
            self.written.insert(status.route.clone(), status.clone());
            out.push(Change { status, urgent });
        }
        out
    }
}

/// What turns directory `held` into `now`: the entries new or changed, and the routes gone.
/// One merge walk over both (sorted) maps; nothing when they are the same map.
fn diff(held: &Directory, now: &Arc<Directory>) -> (Vec<RouteDirectoryEntry>, Vec<String>) {
    let (mut changed, mut removed) = (Vec::new(), Vec::new());
    if std::ptr::eq(held, now.as_ref()) {
        return (changed, removed);
    }
    let (mut before, mut after) = (held.iter().peekable(), now.iter().peekable());
    loop {
        let order = match (before.peek(), after.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((a, _)), Some((b, _))) => a.cmp(b),
        };
        match order {
            Ordering::Less => removed.extend(before.next().map(|(route, _)| route.clone())),
            Ordering::Greater => changed.extend(after.next().map(|(_, entry)| entry.clone())),
            Ordering::Equal => {
                let (old, new) = (before.next().map(|(_, e)| e), after.next().map(|(_, e)| e));
                if old != new {
                    changed.extend(new.cloned());
                }
            }
        }
    }
    (changed, removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::common::v1::InstancePhase;
    use proto::host::v1::{InstanceStatus, OwnedInstance};

    fn snapshot(owned: &[(&str, u64)]) -> Snapshot {
        Snapshot {
            instances: owned
                .iter()
                .map(|(route, term)| OwnedInstance {
                    route: (*route).into(),
                    term: *term,
                    ..OwnedInstance::default()
                })
                .collect(),
            ..Snapshot::default()
        }
    }

    fn report(applied: u64, statuses: &[(&str, u64, InstancePhase)]) -> StatusReport {
        StatusReport {
            applied_revision: applied,
            instances: statuses
                .iter()
                .map(|(route, term, phase)| InstanceStatus {
                    route: (*route).into(),
                    term: *term,
                    phase: *phase as i32,
                    ..InstanceStatus::default()
                })
                .collect(),
            partial: false,
        }
    }

    fn partial(applied: u64, statuses: &[(&str, u64, InstancePhase)]) -> StatusReport {
        StatusReport {
            partial: true,
            ..report(applied, statuses)
        }
    }

    #[test]
    fn a_partial_report_speaks_only_for_the_routes_it_lists() {
        let mut s = HostProtocol::default();
        s.next_snapshot(snapshot(&[("a", 1), ("b", 1), ("c", 2)]), Arc::default());
        s.on_ack(1).unwrap();
        let out = s
            .attribute(&partial(1, &[("b", 1, InstancePhase::Active)]), 10)
            .unwrap();
        assert_eq!(out.len(), 1, "a and c are unchanged, not absent: {out:?}");
        assert_eq!(
            (out[0].route.as_str(), out[0].phase.as_str()),
            ("b", "INSTANCE_PHASE_ACTIVE")
        );
        // A wrong term, an unknown route or a report built before the ack: nothing.
        let s2 = {
            let mut s2 = HostProtocol::default();
            s2.next_snapshot(snapshot(&[("a", 1)]), Arc::default());
            s2
        };
        assert!(
            s2.attribute(&partial(1, &[("a", 1, InstancePhase::Active)]), 10)
                .unwrap()
                .is_empty()
        );
        let none = s
            .attribute(
                &partial(1, &[("c", 1, InstancePhase::Active), ("z", 1, InstancePhase::Active)]),
                10,
            )
            .unwrap();
        assert!(none.is_empty(), "{none:?}");
        // The same report, complete: every other acked route is absent.
        let complete = s.attribute(&report(1, &[("b", 1, InstancePhase::Active)]), 10).unwrap();
        assert_eq!(complete.iter().filter(|a| a.phase == "ABSENT").count(), 2);
    }

    #[test]
    fn only_changes_reach_the_writer_and_new_phases_are_urgent() {
        let mut s = HostProtocol::default();
        let status = |term, phase: &str, progress| Attributed {
            route: "a".into(),
            term,
            phase: phase.into(),
            message: String::new(),
            workload_pid: 7,
            progress,
        };
        let first = s.changes(vec![status(1, "INSTANCE_PHASE_STARTING", 0)]);
        assert_eq!(first.len(), 1);
        assert!(first[0].urgent, "the first status of a route");
        assert!(
            s.changes(vec![status(1, "INSTANCE_PHASE_STARTING", 0)]).is_empty(),
            "unchanged"
        );
        let counted = s.changes(vec![status(1, "INSTANCE_PHASE_STARTING", 5)]);
        assert_eq!(counted.len(), 1);
        assert!(!counted[0].urgent, "progress only");
        assert!(s.changes(vec![status(1, "INSTANCE_PHASE_ACTIVE", 5)])[0].urgent);
        assert!(s.changes(vec![status(2, "INSTANCE_PHASE_ACTIVE", 5)])[0].urgent);
    }

    #[test]
    fn unchanged_snapshots_are_not_resent_and_revisions_grow() {
        let mut s = HostProtocol::default();
        assert_eq!(
            s.next_snapshot(snapshot(&[("a", 1)]), Arc::default())
                .map(|x| x.revision),
            Some(1)
        );
        assert_eq!(s.next_snapshot(snapshot(&[("a", 1)]), Arc::default()), None);
        assert_eq!(
            s.next_snapshot(snapshot(&[("a", 2)]), Arc::default())
                .map(|x| x.revision),
            Some(2)
        );
    }

    fn directory(entries: &[(&str, &str, u64)]) -> Arc<Directory> {
        Arc::new(
            entries
                .iter()
                .map(|(route, member, term)| {
                    let entry = RouteDirectoryEntry {
                        route: (*route).into(),
                        member: (*member).into(),
                        term: *term,
                        ..RouteDirectoryEntry::default()
                    };
                    ((*route).to_owned(), entry)
                })
                .collect(),
        )
    }

    /// What a member holds after applying `snapshot` over `held` (host.proto `Snapshot`).
    fn apply(held: &mut Directory, snapshot: &Snapshot) {
        if !snapshot.directory_delta {
            held.clear();
        }
        for route in &snapshot.directory_removed {
            held.remove(route);
        }
        held.extend(snapshot.directory.iter().map(|e| (e.route.clone(), e.clone())));
    }

    #[test]
    fn a_member_with_deltas_gets_the_whole_directory_first_and_then_only_its_changes() {
        let mut s = HostProtocol::new(true);
        let mut held = Directory::new();
        let first = s
            .next_snapshot(snapshot(&[]), directory(&[("a", "m1", 1), ("b", "m2", 1)]))
            .unwrap();
        assert!(!first.directory_delta, "the first snapshot of a stream is whole");
        apply(&mut held, &first);
        // b moves, c is placed, a leaves.
        let now = directory(&[("b", "m1", 2), ("c", "m2", 1)]);
        let second = s.next_snapshot(snapshot(&[]), Arc::clone(&now)).unwrap();
        assert!(second.directory_delta);
        let changed: Vec<&str> = second.directory.iter().map(|e| e.route.as_str()).collect();
        assert_eq!(changed, ["b", "c"]);
        assert_eq!(second.directory_removed, ["a"]);
        apply(&mut held, &second);
        assert_eq!(held, *now, "the member holds the whole directory");
        // An equal directory (another map with the same entries) and the same body: nothing.
        assert_eq!(
            s.next_snapshot(snapshot(&[]), directory(&[("b", "m1", 2), ("c", "m2", 1)])),
            None
        );
        // A body change alone sends an empty delta.
        let third = s.next_snapshot(snapshot(&[("b", 2)]), now).unwrap();
        assert!(third.directory_delta && third.directory.is_empty() && third.directory_removed.is_empty());
    }

    #[test]
    fn a_member_without_deltas_gets_the_whole_directory_in_every_snapshot() {
        let mut s = HostProtocol::new(false);
        s.next_snapshot(snapshot(&[]), directory(&[("a", "m1", 1)])).unwrap();
        let second = s
            .next_snapshot(snapshot(&[]), directory(&[("a", "m1", 1), ("b", "m1", 1)]))
            .unwrap();
        assert!(!second.directory_delta && second.directory_removed.is_empty());
        assert_eq!(second.directory.len(), 2);
    }

    #[test]
    fn launch_material_is_carried_once_per_term() {
        let with_material = |owned: &[(&str, u64)]| {
            let mut body = snapshot(owned);
            for o in &mut body.instances {
                o.credentials = b"material".to_vec();
            }
            body
        };
        let material = |s: &Snapshot| -> Vec<(String, bool)> {
            s.instances
                .iter()
                .map(|o| (o.route.clone(), !o.credentials.is_empty()))
                .collect()
        };
        let mut s = HostProtocol::new(true);
        let first = s.next_snapshot(with_material(&[("a", 1)]), Arc::default()).unwrap();
        assert_eq!(material(&first), [("a".into(), true)]);
        let second = s
            .next_snapshot(with_material(&[("a", 1), ("b", 1)]), Arc::default())
            .unwrap();
        assert_eq!(
            material(&second),
            [("a".into(), false), ("b".into(), true)],
            "a's was carried"
        );
        // A new term carries it again; so does a route that left and came back.
        let third = s.next_snapshot(with_material(&[("a", 2)]), Arc::default()).unwrap();
        assert_eq!(material(&third), [("a".into(), true)]);
        let back = s
            .next_snapshot(with_material(&[("a", 2), ("b", 1)]), Arc::default())
            .unwrap();
        assert_eq!(
            material(&back),
            [("a".into(), false), ("b".into(), true)],
            "b left and came back"
        );
        // Material this replica had not loaded yet is carried once it has it.
        let mut s = HostProtocol::new(true);
        s.next_snapshot(snapshot(&[("c", 1)]), Arc::default()).unwrap();
        let loaded = s.next_snapshot(with_material(&[("c", 1)]), Arc::default()).unwrap();
        assert_eq!(material(&loaded), [("c".into(), true)]);
        // A new stream of the member carries everything again.
        let mut fresh = HostProtocol::new(true);
        assert_eq!(
            material(&fresh.next_snapshot(with_material(&[("a", 2)]), Arc::default()).unwrap()),
            [("a".into(), true)]
        );
    }

    #[test]
    fn acks_of_unsent_or_regressing_revisions_are_dropped() {
        let mut s = HostProtocol::default();
        assert_eq!(s.on_ack(1), Err(Dropped::AckNeverSent));
        s.next_snapshot(snapshot(&[("a", 1)]), Arc::default());
        s.next_snapshot(snapshot(&[("a", 2)]), Arc::default());
        assert_eq!(s.on_ack(2), Ok(()));
        assert_eq!(s.on_ack(1), Err(Dropped::AckRegressed));
        assert_eq!(s.on_ack(3), Err(Dropped::AckNeverSent));
        assert_eq!(s.acked(), 2);
    }

    #[test]
    fn a_status_counts_for_a_term_only_after_its_revision_was_acked() {
        let mut s = HostProtocol::default();
        s.next_snapshot(snapshot(&[("a", 1)]), Arc::default()); // revision 1 installs term 1
        s.on_ack(1).unwrap();
        s.next_snapshot(snapshot(&[("a", 2)]), Arc::default()); // revision 2 installs term 2, not acked yet
        // The member still reports term 1: nothing attributable for term 2 yet.
        let early = s.attribute(&report(1, &[("a", 1, InstancePhase::Active)]), 10).unwrap();
        assert!(early.is_empty(), "{early:?}");
        s.on_ack(2).unwrap();
        let later = s
            .attribute(&report(2, &[("a", 2, InstancePhase::Starting)]), 10)
            .unwrap();
        assert_eq!(later.len(), 1);
        assert_eq!((later[0].term, later[0].phase.as_str()), (2, "INSTANCE_PHASE_STARTING"));
        // A report built before the ack was applied is not attributed either.
        let stale = s.attribute(&report(1, &[]), 10).unwrap();
        assert!(stale.is_empty());
    }

    #[test]
    fn an_acked_route_missing_from_the_report_is_absent() {
        let mut s = HostProtocol::default();
        s.next_snapshot(snapshot(&[("a", 4)]), Arc::default());
        s.on_ack(1).unwrap();
        let out = s.attribute(&report(1, &[]), 10).unwrap();
        assert_eq!(
            (out[0].route.as_str(), out[0].term, out[0].phase.as_str()),
            ("a", 4, "ABSENT")
        );
        // A status for another term of the route does not count for this one.
        let out = s.attribute(&report(1, &[("a", 3, InstancePhase::Active)]), 10).unwrap();
        assert_eq!(out[0].phase, "ABSENT");
    }

    #[test]
    fn oversized_reports_are_dropped_and_messages_truncated() {
        let s = HostProtocol::default();
        assert_eq!(
            s.attribute(&report(0, &[]), proto::MAX_STATUS_REPORT_BYTES + 1),
            Err(Dropped::OversizedReport)
        );
        assert_eq!(plumbing::text::prefix("héllo", 2), "h");
    }
}
