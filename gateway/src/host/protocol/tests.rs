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
    assert_eq!(complete.iter().filter(|a| a.phase == ReportPhase::Absent).count(), 2);
}

#[test]
fn only_changes_reach_the_writer_and_new_phases_are_urgent() {
    let mut s = HostProtocol::default();
    let status = |term, phase: ReportPhase, progress: u64| Attributed {
        route: "a".into(),
        term,
        phase,
        message: String::new(),
        workload_pid: 7,
        progress: Some(progress),
        policy: None,
    };
    let first = s.changes(vec![status(1, ReportPhase::Starting, 0)]);
    assert_eq!(first.len(), 1);
    assert!(first[0].urgent, "the first status of a route");
    assert!(
        s.changes(vec![status(1, ReportPhase::Starting, 0)]).is_empty(),
        "unchanged"
    );
    let counted = s.changes(vec![status(1, ReportPhase::Starting, 5)]);
    assert_eq!(counted.len(), 1);
    assert!(!counted[0].urgent, "progress only");
    assert!(s.changes(vec![status(1, ReportPhase::Active, 5)])[0].urgent);
    assert!(s.changes(vec![status(2, ReportPhase::Active, 5)])[0].urgent);
    let loaded = Attributed {
        policy: Some(crate::store::LoadedPolicy {
            name: "default".into(),
            revision: 3,
            error: String::new(),
        }),
        ..status(2, ReportPhase::Active, 5)
    };
    let answered = s.changes(vec![loaded.clone()]);
    assert_eq!(answered.len(), 1, "the sidecar's answer to a policy install is written");
    assert!(!answered[0].urgent, "and can wait for the next batch");
    assert!(s.changes(vec![loaded]).is_empty());
}

#[test]
fn progress_is_attributed_only_once_the_owner_accepted_some_at_its_term() {
    let mut s = HostProtocol::default();
    s.next_snapshot(snapshot(&[("a", 1), ("b", 1)]), Arc::default());
    s.on_ack(1).unwrap();
    let mut report = report(1, &[("a", 1, InstancePhase::Active), ("b", 1, InstancePhase::Active)]);
    report.instances[0].counters = Some(proto::host::v1::InstanceCounters::default());
    report.instances[1].counters = Some(proto::host::v1::InstanceCounters {
        last_progress_value: 0,
        last_progress_at_ms: 1_796_510_813_183,
        ..Default::default()
    });
    let progress: Vec<_> = s
        .attribute(&report, 10)
        .unwrap()
        .into_iter()
        .map(|a| a.progress)
        .collect();
    assert_eq!(
        progress,
        [None, Some(0)],
        "a moved instance's new owner has accepted none yet"
    );
}

#[test]
fn after_the_store_lost_writes_every_status_is_handed_over_again_at_once() {
    let mut s = HostProtocol::default();
    s.next_snapshot(snapshot(&[("a", 1), ("b", 1)]), Arc::default());
    s.on_ack(1).unwrap();
    let report = report(1, &[("a", 1, InstancePhase::Active), ("b", 1, InstancePhase::Active)]);
    assert_eq!(s.changes(s.attribute(&report, 10).unwrap()).len(), 2);
    assert!(s.changes(s.attribute(&report, 10).unwrap()).is_empty(), "unchanged");
    s.store_rolled_back();
    let again = s.changes(s.attribute(&report, 10).unwrap());
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(|c| c.urgent));
}

#[test]
fn routes_held_above_the_stores_term_are_reported_at_the_members_own_term() {
    let mut s = HostProtocol::default();
    s.next_snapshot(snapshot(&[("a", 1), ("b", 1)]), Arc::default());
    s.on_ack(1).unwrap();
    s.set_held_above(["a".to_owned(), "z".to_owned()]);
    let statuses = |out: Vec<Attributed>| -> Vec<(String, u64, ReportPhase)> {
        out.into_iter().map(|a| (a.route, a.term, a.phase)).collect()
    };
    let complete = report(
        1,
        &[
            ("a", 2, InstancePhase::Active),
            ("b", 1, InstancePhase::Active),
            ("z", 5, InstancePhase::Active),
        ],
    );
    // a: installed at 1, run at 2 — reported at 2, not ABSENT at 1; z: not installed here.
    assert_eq!(
        statuses(s.attribute(&complete, 10).unwrap()),
        [
            ("b".to_owned(), 1, ReportPhase::Active),
            ("a".to_owned(), 2, ReportPhase::Active),
            ("z".to_owned(), 5, ReportPhase::Active),
        ]
    );
    let partial = StatusReport {
        partial: true,
        ..report(1, &[("z", 5, InstancePhase::Active)])
    };
    assert_eq!(
        statuses(s.attribute(&partial, 10).unwrap()),
        [("z".to_owned(), 5, ReportPhase::Active)]
    );
    // Not held above any more (the store caught up): nothing of z.
    s.set_held_above([]);
    assert!(statuses(s.attribute(&partial, 10).unwrap()).is_empty());
    // What was handed over for a held route survives the next snapshot while still held.
    s.set_held_above(["z".to_owned()]);
    s.changes(s.attribute(&partial, 10).unwrap());
    s.next_snapshot(snapshot(&[("a", 1)]), Arc::default());
    assert!(s.changes(s.attribute(&partial, 10).unwrap()).is_empty(), "unchanged");
}

#[test]
fn a_route_newly_held_above_the_store_gets_a_snapshot_for_the_members_report() {
    let mut s = HostProtocol::default();
    let body = snapshot(&[("a", 1)]);
    assert!(s.next_snapshot(body.clone(), Arc::default()).is_some());
    assert!(
        s.next_snapshot(body.clone(), Arc::default()).is_none(),
        "nothing changed"
    );
    s.set_held_above(["z".to_owned()]);
    assert!(
        s.next_snapshot(body.clone(), Arc::default()).is_some(),
        "the member answers it with a complete report, which carries z"
    );
    s.set_held_above(["z".to_owned()]);
    assert!(s.next_snapshot(body.clone(), Arc::default()).is_none());
    s.set_held_above([]);
    assert!(
        s.next_snapshot(body, Arc::default()).is_none(),
        "one less needs no report"
    );
}

#[test]
fn a_route_the_store_does_not_know_is_kept_for_a_bound() {
    let mut s = HostProtocol::default();
    let keep =
        |s: &mut HostProtocol, routes: &[&str], at| s.keep_unregistered(routes.iter().map(|r| (*r).to_owned()), at);
    let (t0, bound) = (Instant::now(), crate::forgotten::UNREGISTERED_KEPT_FOR);
    assert_eq!(keep(&mut s, &["x"], t0), ["x"]);
    let before_x_bound = t0 + bound - std::time::Duration::from_millis(1);
    assert!(!s.unregistered_bound_passed(before_x_bound));
    assert_eq!(keep(&mut s, &["x", "y"], before_x_bound), ["x", "y"]);
    assert!(
        s.unregistered_bound_passed(t0 + bound),
        "x's bound: a snapshot lets it go"
    );
    assert_eq!(
        keep(&mut s, &["x", "y"], t0 + bound),
        ["y"],
        "x past its bound, y seen later"
    );
    assert!(
        !s.unregistered_bound_passed(t0 + bound),
        "once: x is let go, y's bound is later"
    );
    assert!(s.unregistered_bound_passed(before_x_bound + bound));
    // Registered or let go: forgotten, and unknown again later, kept anew.
    assert!(keep(&mut s, &[], t0 + bound).is_empty());
    assert!(!s.unregistered_bound_passed(t0 + bound * 3));
    assert_eq!(keep(&mut s, &["x"], t0 + bound * 2), ["x"]);
}

#[test]
fn a_store_that_restarted_or_whose_counts_went_down_lost_writes() {
    use crate::store::PoolWrites;
    let before = PoolWrites {
        instances: 10,
        assignments: 20,
        reports: 30,
        operations: 4,
        incarnation: 1_000,
    };
    let later = PoolWrites { reports: 31, ..before };
    assert!(!later.rolled_back_since(&before));
    assert!(!before.rolled_back_since(&before));
    assert!(
        PoolWrites {
            incarnation: 2_000,
            ..later
        }
        .rolled_back_since(&before),
        "restarted"
    );
    assert!(
        PoolWrites {
            assignments: 3,
            reports: 40,
            ..before
        }
        .rolled_back_since(&before),
        "emptied"
    );
}

#[test]
fn what_was_written_is_forgotten_for_routes_that_left_the_member() {
    let mut s = HostProtocol::default();
    s.next_snapshot(snapshot(&[("a", 1), ("b", 1)]), Arc::default());
    s.on_ack(1).unwrap();
    let out = s.attribute(
        &report(1, &[("a", 1, InstancePhase::Active), ("b", 1, InstancePhase::Active)]),
        10,
    );
    assert_eq!(s.changes(out.unwrap()).len(), 2);
    assert_eq!(s.written.len(), 2);
    // b moved away: its last written status goes with it (a long-lived stream of a member
    // whose routes come and go holds only what it hosts).
    s.next_snapshot(snapshot(&[("a", 1)]), Arc::default());
    assert_eq!(s.written.keys().map(String::as_str).collect::<Vec<_>>(), ["a"]);
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
    assert_eq!(out[0].phase, ReportPhase::Absent);
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

#[test]
fn what_a_member_hosts_is_taken_from_its_latest_complete_report_installed_or_not() {
    let with_instances = |mut r: StatusReport| {
        for s in &mut r.instances {
            s.instance = Some(proto::common::v1::InstanceRef {
                uid: format!("uid-{}", s.route),
                ..Default::default()
            });
        }
        r
    };
    let mut p = HostProtocol::default();
    assert!(p.holding().is_none(), "nothing before the first complete report");
    p.hold(&with_instances(partial(0, &[("a", 2, InstancePhase::Active)])));
    assert!(p.holding().is_none(), "a partial report says nothing of what is hosted");
    p.hold(&with_instances(report(
        0,
        &[
            ("a", 2, InstancePhase::Active),
            ("b", 3, InstancePhase::Recovering),
            ("s", 4, InstancePhase::Starting),
            ("c", 1, InstancePhase::Relinquished),
            ("d", 1, InstancePhase::Failed),
        ],
    )));
    let hosted: Vec<(&str, u64)> = p
        .holding()
        .unwrap()
        .iter()
        .map(|(r, (t, _))| (r.as_str(), *t))
        .collect();
    assert_eq!(
        hosted,
        [("a", 2), ("b", 3)],
        "only activated terms: no ended or starting session"
    );
    p.hold(&report(0, &[("a", 2, InstancePhase::Active)]));
    assert!(
        p.holding().unwrap().is_empty(),
        "a status without its workload says nothing"
    );
}
