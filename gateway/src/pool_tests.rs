//! Unit tests of the pool view (`pool.rs`); [`view`] is the fixture other modules' tests share.
use super::*;
use crate::store::{OwnershipTerm, ReportPhase, SecretBytes};

pub(crate) fn view() -> View {
    let mut v = View {
        now_ms: 1_000,
        ..View::default()
    };
    for (route, withdrawn) in [("ns/a", false), ("ns/b", false), ("ns/gone", true)] {
        let (namespace, name) = route.split_once('/').unwrap();
        let binding = crate::registration::Binding {
            route,
            namespace,
            name,
            uid: "u",
        };
        v.instances.insert(
            route.into(),
            InstanceRecord {
                route: route.into(),
                namespace: namespace.into(),
                name: name.into(),
                uid: "u".into(),
                generation: 1,
                material: SecretBytes(Material::new(&binding, &[9u8; 32]).encode()),
                registered_at_ms: 0,
                withdrawn,
                last_term: OwnershipTerm::new(0),
                withdrawn_reason: None,
                displaced: None,
                checkpointed: false,
                fence_holder: None,
            },
        );
    }
    for (route, member, term) in [("ns/a", "m1", 3), ("ns/b", "m2", 1), ("ns/gone", "m1", 2)] {
        v.assignments.insert(
            route.into(),
            Assignment {
                route: route.into(),
                member: member.into(),
                process_id: format!("{member}-p"),
                term: OwnershipTerm::new(term),
                phase: AssignmentPhase::Active,
                generation: 1,
                placed_term: OwnershipTerm::new(1),
                coordinator_term: crate::store::CoordinatorTerm::new(1),
                updated_at_ms: 0,
            },
        );
    }
    for (member, expires_at_ms) in [("m1", 5_000), ("m2", 500)] {
        v.members.insert(
            member.into(),
            MemberRecord {
                member: member.into(),
                process_id: format!("{member}-p"),
                epoch: 1,
                runtime_address: format!("http://{member}:7443"),
                capacity: 256,
                served_by: "gw".into(),
                leaving: false,
                expires_at_ms,
                updated_at_ms: 0,
            },
        );
    }
    v
}

/// A report of `route` at `term` by member process `process_id` (of member `member`).
pub(crate) fn report(route: &str, term: OwnershipTerm, member: &str, process_id: &str, phase: ReportPhase) -> Report {
    Report {
        route: route.into(),
        term,
        member: member.into(),
        process_id: process_id.into(),
        phase,
        message: String::new(),
        workload_pid: 7,
        progress: Some(0),
        reported_by: "gw".into(),
        updated_at_ms: 0,
        policy: None,
    }
}

#[test]
fn the_snapshot_revision_changes_exactly_when_a_snapshot_could() {
    let mut first = view();
    first.number_after(None);
    let numbered = |mut next: View, previous: &View| {
        next.number_after(Some(previous));
        next
    };
    // Time passing, member records refreshed, reports and operations: same input.
    let mut later = view();
    later.now_ms += 5_000;
    later.members.values_mut().for_each(|m| m.expires_at_ms += 5_000);
    later.operations.push(crate::operations::tests::op(
        crate::store::OperationKind::Drain,
        "m1",
        1,
    ));
    let later = numbered(later, &first);
    assert_eq!(later.snapshot_revision, first.snapshot_revision);
    assert_eq!(
        later.snapshot_for("m1", "m1-p", 60_000),
        first.snapshot_for("m1", "m1-p", 60_000),
        "equal revisions build equal snapshots"
    );
    // Each input a snapshot is built from moves the revision.
    let mut moved = view();
    moved.assignments.values_mut().for_each(|a| a.term = a.term.next());
    let mut withdrawn = view();
    withdrawn.instances.values_mut().for_each(|i| i.withdrawn = true);
    let mut readdressed = view();
    readdressed
        .members
        .values_mut()
        .for_each(|m| m.runtime_address = "https://elsewhere:1".into());
    for changed in [moved, withdrawn, readdressed] {
        let changed = numbered(changed, &later);
        assert_eq!(changed.snapshot_revision, later.snapshot_revision + 1);
    }
    // A view that was never numbered (read directly from the store) is built from always.
    assert_eq!(View::default().snapshot_revision, 0);
}

#[test]
fn only_a_changed_table_or_member_makes_a_new_plan_input() {
    let first = view();
    let later = View {
        now_ms: first.now_ms + 100,
        ..first.clone()
    };
    assert!(later.same_plan_input(&first), "time alone, tables shared");
    let mut reread = later.clone();
    reread.assignments = (*first.assignments).clone().into();
    assert!(!reread.same_plan_input(&first), "a table read again, even if equal");
    let mut moved = later.clone();
    moved.members.values_mut().next().unwrap().leaving = true;
    assert!(!moved.same_plan_input(&first), "a member changed");
    let expiry = first.members.values().map(|m| m.expires_at_ms).max().unwrap();
    let lapsed = View {
        now_ms: expiry + 1,
        ..first.clone()
    };
    assert!(!lapsed.same_plan_input(&first), "a member's record lapsed");
}

#[test]
fn a_memo_is_worked_out_once_and_a_clone_works_it_out_again() {
    let v = view();
    let runs = std::cell::Cell::new(0);
    let work = || {
        runs.set(runs.get() + 1);
        BTreeMap::from([("ns/a".to_owned(), format!("run {}", runs.get()))])
    };
    assert_eq!(v.unplaced.get_or_init(work)["ns/a"], "run 1");
    assert_eq!(
        v.unplaced.get_or_init(work)["ns/a"],
        "run 1",
        "asked again: not worked out again"
    );
    let changed = v.clone();
    assert_eq!(
        changed.unplaced.get_or_init(work)["ns/a"],
        "run 2",
        "a clone may differ: worked out anew"
    );
    assert_eq!(v, changed, "memos never make views unequal");
}

#[test]
fn snapshot_lists_owned_instances_and_releases_withdrawn_ones() {
    let snapshot = view().snapshot_for("m1", "m1-p", 60_000);
    let owned: Vec<(&str, u64)> = snapshot.instances.iter().map(|i| (i.route.as_str(), i.term)).collect();
    assert_eq!(owned, vec![("ns/a", 3)]);
    assert!(snapshot.stop_routes.is_empty(), "omitted: released, not stopped");
    assert_eq!(view().directory().len(), 2, "withdrawn routes are not in the directory");
    let credentials: Material = serde_json::from_slice(&snapshot.instances[0].credentials).unwrap();
    assert!(credentials.receipt_key.is_empty(), "members never get the receipt key");
    // Another process of the same member owns nothing.
    let other = view().snapshot_for("m1", "m1-other", 60_000);
    assert!(other.instances.is_empty() && other.stop_routes.is_empty());
}

#[test]
fn records_that_lapsed_while_the_store_was_unreachable_count_until_the_grace_passed() {
    // m1's record ran to 5 000 and m2's to 500; the store was unreachable from 1 000 to
    // 40 000 (nobody could refresh anything).
    let grace = i64::try_from(BLACKOUT_GRACE.as_millis()).unwrap();
    let mut v = View {
        now_ms: 40_000,
        blackout: Some((1_000, 40_000)),
        ..view()
    };
    assert!(
        v.live_member("m1").is_some(),
        "lapsed during the blackout: not evidence of silence yet"
    );
    assert!(v.live_member("m2").is_none(), "lapsed before the blackout: gone");
    assert_eq!(v.candidates(&BTreeSet::new()).len(), 1);
    v.now_ms = 40_000 + grace;
    assert!(v.live_member("m1").is_none(), "not refreshed within the grace: gone");
    // Without a blackout an expired record is gone at once.
    let plain = View {
        now_ms: 6_000,
        ..view()
    };
    assert!(plain.live_member("m1").is_none());
}

#[test]
fn a_replica_silent_only_during_a_blackout_orphans_nothing() {
    let silence = Duration::from_millis(3_000);
    let mut v = view();
    v.members.get_mut("m1").unwrap().expires_at_ms = 60_000;
    // gw recorded itself at 900, just before the store went away at 1 000; back at 40 000.
    v.replicas.insert("gw".into(), 900);
    v.now_ms = 40_500;
    v.blackout = Some((1_000, 40_000));
    assert!(
        v.orphaned(silence).is_empty(),
        "its silence counts from the store's return"
    );
    v.now_ms = 43_100;
    assert_eq!(v.orphaned(silence).len(), 1, "still silent 3 s after the return");
    // A replica already silent when the blackout began stays silent.
    v.replicas.insert("gw".into(), -5_000);
    v.now_ms = 40_500;
    assert_eq!(v.orphaned(silence).len(), 1);
}

#[test]
fn members_of_a_silent_replica_are_orphaned() {
    let mut v = view();
    let silence = Duration::from_millis(300);
    // m1 (live) is served by "gw"; m2 expired already.
    assert!(v.orphaned(silence).is_empty(), "a replica that never recorded itself");
    v.replicas.insert("gw".into(), 800);
    assert!(v.orphaned(silence).is_empty(), "recorded 200 ms ago");
    v.replicas.insert("gw".into(), 600);
    let orphaned: Vec<&str> = v.orphaned(silence).iter().map(|m| m.member.as_str()).collect();
    assert_eq!(orphaned, ["m1"], "silent for 400 ms; the expired record is not listed");
    // Attached elsewhere: served by a replica that runs.
    v.replicas.insert("gw-2".into(), 1_000);
    if let Some(m) = v.members.get_mut("m1") {
        m.served_by = "gw-2".into();
    }
    assert!(v.orphaned(silence).is_empty());
}

#[test]
fn liveness_and_candidates_follow_the_ttl() {
    let v = view();
    assert!(v.is_live("m1", "m1-p"));
    assert!(!v.is_live("m2", "m2-p"), "expired record");
    assert!(!v.is_live("m1", "m1-other"), "another process");
    let candidates = v.candidates(&BTreeSet::new());
    assert_eq!(candidates.len(), 1);
    assert!(!candidates[0].excluded);
    assert!(v.candidates(&["m1".to_owned()].into())[0].excluded);
    assert_eq!(v.desired(), ["ns/a".to_owned(), "ns/b".to_owned()].into());
}

#[test]
fn an_assignment_below_the_routes_last_term_is_given_up_and_recovered_above_it() {
    // ns/a is m1's at term 3 (m1 live). Its sidecar registered fence 5: the store lost terms 4
    // and 5, and no sidecar takes term 3 again.
    let mut v = view();
    assert!(!v.owners()["ns/a"].failed);
    v.instances.get_mut("ns/a").unwrap().last_term = OwnershipTerm::new(3);
    assert!(!v.owners()["ns/a"].failed, "the term is the last one");
    v.instances.get_mut("ns/a").unwrap().last_term = OwnershipTerm::new(5);
    assert!(v.owners()["ns/a"].failed);
    let recovered = crate::room::decisions(&v).into_iter().find_map(|d| match d {
        crate::placement::Decision::Recover { route, term, .. } if route == "ns/a" => Some(term),
        _ => None,
    });
    let term = recovered.expect("ns/a is recovered");
    assert_eq!(v.fresh_term("ns/a", term), OwnershipTerm::new(6), "above the fence");
    // An older generation's assignment is stale, not overtaken.
    v.instances.get_mut("ns/a").unwrap().generation = 2;
    assert!(!v.overtaken(&v.assignments["ns/a"]));
}
