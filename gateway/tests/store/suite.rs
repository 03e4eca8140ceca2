//! Backend-independent store tests. Each takes a fresh database.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use gateway::store::{
    self, Acquire, Activation, Assignment, AssignmentPhase, Checkpoint, CoordinatorTerm, Error, Fence, FencedWrite,
    GrantRecord, Lease, LoadedPolicy, MemberUpdate, Operation, OperationKind, OperationPhase, OwnershipTerm,
    Registered, Registration, Report, ReportPhase, SecretBytes, SigningKey, Store, WithdrawnReason,
};
use tokio::sync::Mutex;

use crate::support::{TestDb, wait_until_db_time};

const LONG: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(300);

/// An activation of route `r1` by the member whose process `process_id` is (`m1-p1`: `m1`).
pub fn activation(term: u64, process_id: &str, jti: &str, digest: &[u8], workload: Checkpoint) -> Activation {
    Activation {
        route: "r1".to_owned(),
        term: OwnershipTerm::new(term),
        member: process_id.split('-').next().unwrap_or_default().to_owned(),
        process_id: process_id.to_owned(),
        jti: jti.to_owned(),
        digest: digest.to_vec(),
        workload,
    }
}

/// `m1`'s report of `route` active at term 1.
pub fn active_report(route: &str) -> Report {
    Report {
        route: route.into(),
        term: OwnershipTerm::new(1),
        member: "m1".into(),
        process_id: "m1-p1".into(),
        phase: ReportPhase::Active,
        message: String::new(),
        workload_pid: 42,
        progress: Some(0),
        reported_by: "gw-a".into(),
        updated_at_ms: 0,
        policy: None,
    }
}

pub(crate) async fn acquire(store: &Store, holder: &str, length: Duration) -> Lease {
    match store.acquire_lease(holder, length).await.expect("acquire") {
        Acquire::Acquired(lease) => lease,
        Acquire::HeldBy(row) => panic!("{holder} expected the lease; held by {row:?}"),
    }
}

pub(crate) fn operation(id: &str) -> Operation {
    Operation {
        id: id.into(),
        kind: OperationKind::Drain,
        target: "member-a".into(),
        phase: OperationPhase::Pending,
        message: "queued".into(),
        attempts: 0,
        moves: 0,
        deadline_at_ms: Some(1_000_000),
        max_parallel: 1,
        requested_by: "admin@example".into(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

/// Record each member's live process `<member>-p1` (the process `assignment` reserves for).
pub(crate) async fn live_members(store: &Store, members: &[&str]) {
    for name in members {
        store
            .record_member(&member(name, &format!("{name}-p1")), LONG)
            .await
            .unwrap();
    }
}

pub(crate) fn assignment(route: &str, member: &str, term: u64) -> Assignment {
    Assignment {
        route: route.into(),
        member: member.into(),
        process_id: format!("{member}-p1"),
        term: OwnershipTerm::new(term),
        phase: AssignmentPhase::Reserved,
        generation: 1,
        placed_term: OwnershipTerm::new(1),
        coordinator_term: CoordinatorTerm::new(0),
        updated_at_ms: 0,
    }
}

fn key(kid: &str) -> SigningKey {
    SigningKey {
        kid: kid.into(),
        algorithm: "EdDSA".into(),
        public_pem: format!("public {kid}"),
        private_pem: SecretBytes(format!("private {kid}").into_bytes()),
        created_at_ms: 0,
        retired_at_ms: None,
    }
}

fn assert_fenced(result: Result<(), Error>, want: fn(&Fence) -> bool) {
    match result {
        Err(Error::Fenced(fence)) if want(&fence) => {}
        other => panic!("expected a fenced refusal, got {other:?}"),
    }
}

pub async fn first_acquire_is_term_one_and_logged(db: &TestDb) {
    assert_eq!(db.store.read_lease().await.unwrap(), None);
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    assert_eq!(lease.term, CoordinatorTerm::new(1));
    let now = db.store.now_ms().await.unwrap();
    assert!(
        lease.expires_at_ms > now && lease.expires_at_ms <= now + 30_000,
        "{lease:?} at {now}"
    );
    let history = db.store.lease_history().await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!((history[0].term.get(), history[0].holder.as_str()), (1, "gw-a/1"));
    assert_eq!(history[0].started_at_ms, None);
    db.store.write_fenced(&lease, &[FencedWrite::StartTerm]).await.unwrap();
    let started = db.store.lease_history().await.unwrap()[0]
        .started_at_ms
        .expect("recorded");
    assert!(started >= history[0].acquired_at_ms);
    // Acquiring again while holding keeps the term and logs nothing new.
    assert_eq!(acquire(&db.store, "gw-a/1", LONG).await.term, CoordinatorTerm::new(1));
    assert_eq!(db.store.lease_history().await.unwrap().len(), 1);
}

pub async fn concurrent_contenders_never_share_a_term(db: &TestDb) {
    const CONTENDERS: usize = 12;
    const TERMS: usize = 40;
    let granted = Arc::new(AtomicUsize::new(0));
    // term -> holders that believed they held it
    let seen: Arc<Mutex<BTreeMap<CoordinatorTerm, Vec<String>>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..CONTENDERS {
        let store = if i % 2 == 0 {
            db.store.clone()
        } else {
            db.replica().await
        };
        let (granted, seen) = (granted.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            let holder = format!("gw-{i}/{}", uuid::Uuid::new_v4().simple());
            while granted.load(Ordering::SeqCst) < TERMS {
                let Acquire::Acquired(lease) = store.acquire_lease(&holder, LONG).await.unwrap() else {
                    tokio::task::yield_now().await;
                    continue;
                };
                granted.fetch_add(1, Ordering::SeqCst);
                seen.lock().await.entry(lease.term).or_default().push(holder.clone());
                // Prove the lease with a fenced write, then hand it on.
                // (One open drain per member: each term drains its own.)
                let op = Operation {
                    target: format!("member-{}", lease.term),
                    ..operation(&format!("op-{}", lease.term))
                };
                store
                    .write_fenced(&lease, &[FencedWrite::PutOperation(op)])
                    .await
                    .unwrap();
                assert!(store.release_lease(&lease).await.unwrap());
            }
        }));
    }
    for task in tasks {
        task.await.expect("contender panicked");
    }
    let seen = seen.lock().await;
    for (term, holders) in seen.iter() {
        assert_eq!(holders.len(), 1, "term {term} had holders {holders:?}");
    }
    let history = db.store.lease_history().await.unwrap();
    let terms: Vec<u64> = history.iter().map(|t| t.term.get()).collect();
    let expected: Vec<u64> = (1..=terms.len() as u64).collect();
    assert_eq!(terms, expected, "terms are consecutive and each granted once");
    assert!(terms.len() >= TERMS);
    for t in &history {
        assert_eq!(
            seen.get(&t.term),
            Some(&vec![t.holder.clone()]),
            "log and holders agree on term {}",
            t.term
        );
    }
    assert_eq!(db.store.list_operations().await.unwrap().len(), terms.len());
}

pub async fn live_lease_is_refused_to_others(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    match db.replica().await.acquire_lease("gw-b/1", LONG).await.unwrap() {
        Acquire::HeldBy(row) => {
            assert_eq!((row.holder.as_str(), row.term), ("gw-a/1", lease.term));
            assert!(row.is_live());
        }
        Acquire::Acquired(other) => panic!("a live lease was granted twice: {other:?}"),
    }
}

pub async fn a_dead_holders_live_lease_is_taken_over_at_once(db: &TestDb) {
    let other = db.replica().await;
    let holder = format!("gw-b/{}", other.liveness_key());
    let lease = acquire(&other, &holder, LONG).await;
    assert!(
        db.store.holder_alive(&holder).await.unwrap(),
        "its connections are open"
    );
    let observed = db.store.read_lease().await.unwrap().unwrap();
    // The holder's process goes away (all its connections close).
    other.close().await;
    drop(other);
    crate::support::wait_for("the holder to read as dead", 500, || async {
        (!db.store.holder_alive(&holder).await.unwrap()).then_some(())
    })
    .await;
    let mine = format!("gw-a/{}", db.store.liveness_key());
    assert!(db.store.holder_alive(&mine).await.unwrap());
    // A takeover that observed an older row does nothing.
    let stale = store::LeaseView {
        term: CoordinatorTerm::new(observed.term.get() - 1),
        ..observed.clone()
    };
    assert_eq!(db.store.take_over_lease(&mine, LONG, &stale).await.unwrap(), None);
    let taken = db
        .store
        .take_over_lease(&mine, LONG, &observed)
        .await
        .unwrap()
        .expect("taken over");
    assert_eq!(
        taken.term,
        lease.term.next(),
        "the lease was still live: only the term fence makes this safe"
    );
    assert_fenced(
        db.store
            .write_fenced(&lease, &[FencedWrite::PutOperation(operation("late"))])
            .await,
        |f| matches!(f, Fence::Superseded { .. }),
    );
    assert_eq!(
        db.store.lease_history().await.unwrap().last().map(|t| t.holder.clone()),
        Some(mine)
    );
}

pub async fn renew_extends_the_same_term(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", SHORT).await;
    let renewed = db.store.renew_lease(&lease, LONG).await.unwrap();
    assert_eq!((renewed.term, renewed.holder.as_str()), (lease.term, "gw-a/1"));
    assert!(renewed.expires_at_ms > lease.expires_at_ms);
    // The renewed lease outlives the original length.
    wait_until_db_time(&db.store, lease.expires_at_ms).await;
    db.store
        .write_fenced(&renewed, &[FencedWrite::PutOperation(operation("op-1"))])
        .await
        .expect("renewed lease is live past the first expiry");
    assert_eq!(
        db.store.read_lease().await.unwrap().unwrap().expires_at_ms,
        renewed.expires_at_ms
    );
}

pub async fn renew_by_another_holder_is_refused(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let forged = Lease {
        holder: "gw-b/1".into(),
        ..lease.clone()
    };
    match db.store.renew_lease(&forged, LONG).await {
        Err(Error::Fenced(Fence::Superseded { .. })) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    let future_term = Lease {
        term: lease.term.next(),
        ..lease.clone()
    };
    assert!(matches!(
        db.store.renew_lease(&future_term, LONG).await,
        Err(Error::Fenced(_))
    ));
    assert_eq!(
        db.store.read_lease().await.unwrap().unwrap().expires_at_ms,
        lease.expires_at_ms,
        "unchanged"
    );
}

pub async fn release_expires_at_once_and_keeps_the_term(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    assert!(db.store.release_lease(&lease).await.unwrap());
    let row = db.store.read_lease().await.unwrap().unwrap();
    assert_eq!(row.term, lease.term, "release keeps the term");
    assert!(!row.is_live(), "released lease is expired at once");
    // A standby takes over without waiting, with the next term.
    let next = acquire(&db.replica().await, "gw-b/1", LONG).await;
    assert_eq!(next.term, lease.term.next());
    // The old holder can neither write, renew nor release any more.
    assert_fenced(
        db.store
            .write_fenced(&lease, &[FencedWrite::PutOperation(operation("late"))])
            .await,
        |f| matches!(f, Fence::Superseded { current_term, .. } if *current_term == CoordinatorTerm::new(2)),
    );
    assert!(db.store.renew_lease(&lease, LONG).await.is_err());
    assert!(
        !db.store.release_lease(&lease).await.unwrap(),
        "releasing a lost lease is a no-op"
    );
    assert!(
        db.store.read_lease().await.unwrap().unwrap().is_live(),
        "the new lease was not touched"
    );
    assert!(db.store.list_operations().await.unwrap().is_empty());
}

pub async fn expiry_without_takeover_fences_the_old_holder(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", SHORT).await;
    db.store
        .write_fenced(&lease, &[FencedWrite::PutOperation(operation("before"))])
        .await
        .expect("live lease writes");
    wait_until_db_time(&db.store, lease.expires_at_ms).await;
    assert_fenced(
        db.store
            .write_fenced(&lease, &[FencedWrite::PutOperation(operation("after"))])
            .await,
        |f| matches!(f, Fence::Expired { .. }),
    );
    match db.store.renew_lease(&lease, LONG).await {
        Err(Error::Fenced(Fence::Expired { .. })) => {}
        other => panic!("renewing an expired lease must fail, got {other:?}"),
    }
    // Nobody took over: the row still names the old term, expired.
    let row = db.store.read_lease().await.unwrap().unwrap();
    assert_eq!((row.term, row.is_live()), (lease.term, false));
    let ids: Vec<String> = db
        .store
        .list_operations()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(ids, vec!["before".to_owned()]);
    // Coming back is a new term, even for the same holder.
    assert_eq!(acquire(&db.store, "gw-a/1", LONG).await.term, lease.term.next());
}

pub async fn stale_term_write_is_rejected_and_changes_nothing(db: &TestDb) {
    let old = acquire(&db.store, "gw-a/1", SHORT).await;
    db.store
        .write_fenced(
            &old,
            &[FencedWrite::Assign {
                expected_term: None,
                next: assignment("r1", "m1", 1),
            }],
        )
        .await
        .unwrap();
    wait_until_db_time(&db.store, old.expires_at_ms).await;
    let other = db.replica().await;
    let new = acquire(&other, "gw-b/1", LONG).await;
    assert_eq!(new.term, old.term.next());
    let stale = [
        FencedWrite::Assign {
            expected_term: Some(OwnershipTerm::new(1)),
            next: assignment("r1", "m-stale", 2),
        },
        FencedWrite::PutOperation(operation("stale-op")),
    ];
    assert_fenced(db.store.write_fenced(&old, &stale).await, |f| {
        matches!(f, Fence::Superseded { .. })
    });
    let assignments = db.store.list_assignments().await.unwrap();
    assert_eq!((assignments[0].member.as_str(), assignments[0].term.get()), ("m1", 1));
    assert!(db.store.list_operations().await.unwrap().is_empty());
    // The current holder's identical write goes through and is stamped with its term.
    other.write_fenced(&new, &stale).await.unwrap();
    let assignments = other.list_assignments().await.unwrap();
    assert_eq!(
        (assignments[0].term, assignments[0].coordinator_term),
        (OwnershipTerm::new(2), new.term)
    );
}

pub async fn rollback_leaves_nothing_behind(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let batch = [
        FencedWrite::PutOperation(operation("op-1")),
        FencedWrite::PutSigningKey(key("k1")),
        FencedWrite::Assign {
            expected_term: None,
            next: assignment("r1", "m1", 1),
        },
        // Fails: r2 has no assignment at term 7.
        FencedWrite::Assign {
            expected_term: Some(OwnershipTerm::new(7)),
            next: assignment("r2", "m1", 8),
        },
    ];
    match db.store.write_fenced(&lease, &batch).await {
        Err(Error::Conflict { subject, detail }) => {
            assert!(subject.contains("r2"), "{subject}");
            assert!(
                detail.contains("expected term 7") && detail.contains("no assignment"),
                "{detail}"
            );
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert!(db.store.list_operations().await.unwrap().is_empty());
    assert!(db.store.list_signing_keys().await.unwrap().is_empty());
    assert!(db.store.list_assignments().await.unwrap().is_empty());
    // The same batch without the bad write commits whole.
    db.store.write_fenced(&lease, &batch[..3]).await.unwrap();
    assert_eq!(db.store.list_operations().await.unwrap().len(), 1);
    assert_eq!(db.store.list_signing_keys().await.unwrap().len(), 1);
    assert_eq!(db.store.list_assignments().await.unwrap().len(), 1);
}

pub async fn invalid_writes_are_refused_before_io(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let not_higher = FencedWrite::Assign {
        expected_term: Some(OwnershipTerm::new(3)),
        next: assignment("r1", "m1", 3),
    };
    assert!(matches!(
        db.store.write_fenced(&lease, &[not_higher]).await,
        Err(Error::Invalid(_))
    ));
    for max_parallel in [0, 9] {
        let op = Operation {
            max_parallel,
            ..operation("op")
        };
        assert!(matches!(
            db.store.write_fenced(&lease, &[FencedWrite::PutOperation(op)]).await,
            Err(Error::Invalid(_))
        ));
    }
    assert!(db.store.list_operations().await.unwrap().is_empty());
}

pub async fn assignment_compare_and_set(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let put = |expected_term, next| FencedWrite::Assign { expected_term, next };
    db.store
        .write_fenced(&lease, &[put(None, assignment("r1", "m1", 1))])
        .await
        .unwrap();
    // A second "new" assignment of the same route conflicts.
    assert!(matches!(
        db.store
            .write_fenced(&lease, &[put(None, assignment("r1", "m2", 1))])
            .await,
        Err(Error::Conflict { .. })
    ));
    // Move to m2 at term 2 from term 1; repeating the move from term 1 conflicts.
    db.store
        .write_fenced(&lease, &[put(Some(OwnershipTerm::new(1)), assignment("r1", "m2", 2))])
        .await
        .unwrap();
    assert!(matches!(
        db.store
            .write_fenced(&lease, &[put(Some(OwnershipTerm::new(1)), assignment("r1", "m3", 3))])
            .await,
        Err(Error::Conflict { .. })
    ));
    let a = &db.store.list_assignments().await.unwrap()[0];
    assert_eq!(
        (a.member.as_str(), a.process_id.as_str(), a.term.get()),
        ("m2", "m2-p1", 2)
    );
    assert_eq!((a.phase, a.coordinator_term), (AssignmentPhase::Reserved, lease.term));
    // A later reservation moves the term on; the old term is gone.
    db.store
        .write_fenced(&lease, &[put(Some(OwnershipTerm::new(2)), assignment("r1", "m3", 3))])
        .await
        .unwrap();
    // Unassign needs the current term.
    let unassign = |expected_term| FencedWrite::Unassign {
        route: "r1".into(),
        expected_term,
    };
    assert!(matches!(
        db.store.write_fenced(&lease, &[unassign(OwnershipTerm::new(2))]).await,
        Err(Error::Conflict { .. })
    ));
    db.store
        .write_fenced(&lease, &[unassign(OwnershipTerm::new(3))])
        .await
        .unwrap();
    assert!(db.store.list_assignments().await.unwrap().is_empty());
}

/// An assignment dropped (its instance withdrawn) leaves the route's last term behind: a
/// later placement of the route must start above it.
pub async fn terms_never_repeat_on_a_route(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let registration = |uid: &str| Registration {
        route: "r1".into(),
        namespace: "ns".into(),
        name: "n".into(),
        uid: uid.into(),
        material: SecretBytes(vec![1]),
    };
    db.store.register_instance(&registration("u1")).await.unwrap();
    let put = |expected_term, next| FencedWrite::Assign { expected_term, next };
    db.store
        .write_fenced(&lease, &[put(None, assignment("r1", "m1", 1))])
        .await
        .unwrap();
    db.store
        .write_fenced(&lease, &[put(Some(OwnershipTerm::new(1)), assignment("r1", "m2", 2))])
        .await
        .unwrap();
    assert_eq!(
        db.store.instance("r1").await.unwrap().unwrap().last_term,
        OwnershipTerm::new(2)
    );
    assert!(db.store.withdraw_instance("r1", "u1", None).await.unwrap());
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Unassign {
                route: "r1".into(),
                expected_term: OwnershipTerm::new(2),
            }],
        )
        .await
        .unwrap();
    db.store.register_instance(&registration("u2")).await.unwrap();
    assert_eq!(
        db.store.instance("r1").await.unwrap().unwrap().last_term,
        OwnershipTerm::new(2)
    );
    for used in [1, 2] {
        assert!(
            matches!(
                db.store
                    .write_fenced(&lease, &[put(None, assignment("r1", "m1", used))])
                    .await,
                Err(Error::Conflict { .. })
            ),
            "term {used} was used on the route"
        );
    }
    db.store
        .write_fenced(&lease, &[put(None, assignment("r1", "m1", 3))])
        .await
        .unwrap();
    assert_eq!(
        db.store.instance("r1").await.unwrap().unwrap().last_term,
        OwnershipTerm::new(3)
    );
    // A sidecar registers its fence, 5 (the store had lost terms 4 and 5): a compare-and-set
    // that moves the term, planned on a view read before, may not reuse one of them.
    let resume = store::Resume {
        generation: 2,
        fence: OwnershipTerm::new(5),
        workload: Checkpoint::default(),
        holder: None,
    };
    db.store
        .register_resuming(&registration("u2"), None, &resume)
        .await
        .unwrap();
    for used in [4, 5] {
        let reused = db
            .store
            .write_fenced(
                &lease,
                &[put(Some(OwnershipTerm::new(3)), assignment("r1", "m2", used))],
            )
            .await;
        assert!(
            matches!(reused, Err(Error::Conflict { .. })),
            "term {used} was used on the route: {reused:?}"
        );
    }
    db.store
        .write_fenced(&lease, &[put(Some(OwnershipTerm::new(3)), assignment("r1", "m2", 6))])
        .await
        .unwrap();
}

pub async fn grants_are_single_use_and_activation_is_a_compare_and_set(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let registration = Registration {
        route: "r1".into(),
        namespace: "ns".into(),
        name: "n".into(),
        uid: "u".into(),
        material: SecretBytes(vec![1]),
    };
    db.store.register_instance(&registration).await.unwrap();
    live_members(&db.store, &["m1", "m2"]).await;
    let reserve = |expected_term, next| FencedWrite::Assign { expected_term, next };
    db.store
        .write_fenced(&lease, &[reserve(None, assignment("r1", "m1", 1))])
        .await
        .unwrap();
    let grant = |term: u64, process: &str, jti: &str| GrantRecord {
        route: "r1".into(),
        term: OwnershipTerm::new(term),
        jti: jti.into(),
        member: "m1".into(),
        process_id: process.into(),
        digest: vec![term as u8; 32],
        expires_at_ms: i64::MAX,
    };
    let conflict = |r: Result<(), Error>| matches!(r, Err(Error::Conflict { .. }));
    assert!(
        conflict(db.store.issue_grant(&grant(2, "m1-p1", "j0")).await),
        "not the reserved term"
    );
    assert!(
        conflict(db.store.issue_grant(&grant(1, "other", "j0")).await),
        "not the candidate"
    );
    db.store.issue_grant(&grant(1, "m1-p1", "j1")).await.unwrap();
    assert!(
        conflict(db.store.issue_grant(&grant(1, "m1-p1", "j2")).await),
        "single use"
    );

    let process = Checkpoint {
        pid: 42,
        start_ticks: 7,
        exe_digest: vec![9; 32],
    };
    let activate = |term, process_id: &'static str, jti: &'static str, digest: Vec<u8>, who: Checkpoint| {
        let store = db.store.clone();
        async move { store.activate(activation(term, process_id, jti, &digest, who)).await }
    };
    let refused = |r: Result<i64, Error>, why: &str| match r {
        Err(Error::Conflict { detail, .. }) => assert!(detail.contains(why), "{detail} (wanted {why})"),
        other => panic!("expected a refusal ({why}), got {other:?}"),
    };
    refused(
        activate(1, "m1-p1", "j2", vec![1; 32], process.clone()).await,
        "not bound to the grant",
    );
    refused(
        activate(1, "m1-p1", "j1", vec![0; 32], process.clone()).await,
        "not bound to the grant",
    );
    refused(
        activate(1, "m1-p2", "j1", vec![1; 32], process.clone()).await,
        "term no longer current",
    );
    let activated_at = activate(1, "m1-p1", "j1", vec![1; 32], process.clone()).await.unwrap();
    assert!(activated_at > 0);
    assert_eq!(
        db.store.list_assignments().await.unwrap()[0].phase,
        AssignmentPhase::Active
    );
    refused(
        activate(1, "m1-p1", "j1", vec![1; 32], process.clone()).await,
        "already activated",
    );

    // The next owner must present the same process.
    db.store
        .write_fenced(
            &lease,
            &[reserve(Some(OwnershipTerm::new(1)), assignment("r1", "m2", 2))],
        )
        .await
        .unwrap();
    let mut next = grant(2, "m2-p1", "j3");
    next.member = "m2".into();
    db.store.issue_grant(&next).await.unwrap();
    let impostor = Checkpoint {
        pid: 43,
        ..process.clone()
    };
    refused(
        activate(2, "m2-p1", "j3", vec![2; 32], impostor).await,
        "workload identity differs",
    );
    assert_eq!(
        db.store.list_assignments().await.unwrap()[0].phase,
        AssignmentPhase::Reserved,
        "refusal changes nothing"
    );
    activate(2, "m2-p1", "j3", vec![2; 32], process).await.unwrap();
    // An activation of the superseded term fails.
    refused(
        activate(1, "m1-p1", "j1", vec![1; 32], Checkpoint::default()).await,
        "term no longer current",
    );
}

/// Every member reads every owner's process id in its route directory: naming it gets no
/// grant. A grant is recorded only for the reservation's own member and for the process the
/// store records as that member's live one; an activation only by the member the reservation
/// and the grant row name. A refusal writes nothing.
pub async fn a_member_naming_another_members_process_gets_no_grant_nor_activates_its_term(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    db.store
        .register_instance(&Registration {
            route: "r1".into(),
            ..agent_zero()
        })
        .await
        .unwrap();
    live_members(&db.store, &["m1", "m2"]).await;
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: None,
                next: assignment("r1", "m1", 1),
            }],
        )
        .await
        .unwrap();
    let grant = |member: &str, process: &str, jti: &str| GrantRecord {
        route: "r1".into(),
        term: OwnershipTerm::new(1),
        jti: jti.into(),
        member: member.into(),
        process_id: process.into(),
        digest: vec![1; 32],
        expires_at_ms: i64::MAX,
    };
    let denied = |r: Result<(), Error>| matches!(r, Err(Error::Denied { .. }));
    assert!(
        denied(db.store.issue_grant(&grant("m2", "m1-p1", "taken")).await),
        "m2 naming m1's process"
    );
    // Not even once m2 attached a process under m1's process id.
    assert!(db.store.remove_member("m2", "m2-p1", 1).await.unwrap());
    db.store.record_member(&member("m2", "m1-p1"), LONG).await.unwrap();
    assert!(denied(db.store.issue_grant(&grant("m2", "m1-p1", "taken")).await));
    // m1's own grant needs m1's live process: none while its record is gone.
    assert!(db.store.remove_member("m1", "m1-p1", 1).await.unwrap());
    assert!(matches!(
        db.store.issue_grant(&grant("m1", "m1-p1", "j1")).await,
        Err(Error::Conflict { detail, .. }) if detail.contains("live process")
    ));
    live_members(&db.store, &["m1"]).await;
    // The refusals recorded nothing: the term's single grant is still m1's to take.
    db.store.issue_grant(&grant("m1", "m1-p1", "j1")).await.unwrap();

    // The grant is m1's: m2 activating with it (even naming m1's process) is refused.
    let workload = Checkpoint {
        pid: 42,
        start_ticks: 7,
        exe_digest: vec![9; 32],
    };
    let by_m2 = Activation {
        member: "m2".into(),
        ..activation(1, "m1-p1", "j1", &[1; 32], workload.clone())
    };
    assert!(matches!(db.store.activate(by_m2).await, Err(Error::Denied { .. })));
    assert_eq!(
        db.store.list_assignments().await.unwrap()[0].phase,
        AssignmentPhase::Reserved,
        "the refusal changed nothing"
    );
    db.store
        .activate(activation(1, "m1-p1", "j1", &[1; 32], workload))
        .await
        .unwrap();
}

/// A Pod recreated under the same name (same route, new UID) starts from scratch: its own
/// material, no checkpoint of the old workload, a stale old assignment that can no longer
/// be activated; the old UID can neither register again nor withdraw the new one.
pub async fn a_workload_replaced_under_its_route_starts_fresh(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let registration = |uid: &str| Registration {
        route: "r1".into(),
        namespace: "ns".into(),
        name: "n".into(),
        uid: uid.into(),
        material: SecretBytes(uid.as_bytes().to_vec()),
    };
    let placed = |member: &str, term: u64, generation: i64| Assignment {
        generation,
        placed_term: OwnershipTerm::new(term),
        ..assignment("r1", member, term)
    };
    let grant = |member: &str, term: u64, jti: &str| GrantRecord {
        route: "r1".into(),
        term: OwnershipTerm::new(term),
        jti: jti.into(),
        member: member.into(),
        process_id: format!("{member}-p1"),
        digest: vec![term as u8; 32],
        expires_at_ms: i64::MAX,
    };
    let workload = |pid: i64| Checkpoint {
        pid,
        start_ticks: pid * 10,
        exe_digest: vec![9; 32],
    };
    // The old Pod's workload is placed and activated: its identity is the checkpoint.
    db.store.register_instance(&registration("old-uid")).await.unwrap();
    live_members(&db.store, &["m1", "m2"]).await;
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: None,
                next: placed("m1", 1, 1),
            }],
        )
        .await
        .unwrap();
    db.store.issue_grant(&grant("m1", 1, "j1")).await.unwrap();
    db.store
        .activate(activation(1, "m1-p1", "j1", &[1; 32], workload(100)))
        .await
        .unwrap();
    // A second term is reserved for it, granted, but not activated yet.
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: Some(OwnershipTerm::new(1)),
                next: placed("m2", 2, 1),
            }],
        )
        .await
        .unwrap();
    db.store.issue_grant(&grant("m2", 2, "j2")).await.unwrap();

    // The Pod is recreated: same route, new UID.
    assert_eq!(
        db.store.register_instance(&registration("new-uid")).await.unwrap(),
        Registered::Desired { generation: 2 }
    );
    let instance = db.store.instance("r1").await.unwrap().unwrap();
    assert_eq!(
        (instance.uid.as_str(), instance.material.0.as_slice()),
        ("new-uid", b"new-uid".as_slice())
    );
    // The term reserved for the old workload cannot be activated for anyone now.
    match db
        .store
        .activate(activation(2, "m2-p1", "j2", &[2; 32], workload(100)))
        .await
    {
        Err(Error::Conflict { detail, .. }) => assert!(detail.contains("no longer has"), "{detail}"),
        other => panic!("the replaced workload's reservation activated: {other:?}"),
    }
    // Placed anew at the next term, the new workload activates with its own identity.
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: Some(OwnershipTerm::new(2)),
                next: placed("m1", 3, 2),
            }],
        )
        .await
        .unwrap();
    db.store.issue_grant(&grant("m1", 3, "j3")).await.unwrap();
    db.store
        .activate(activation(3, "m1-p1", "j3", &[3; 32], workload(200)))
        .await
        .expect("a new workload is not held to the old one's checkpoint");
    let assignments = db.store.list_assignments().await.unwrap();
    assert_eq!(
        (
            assignments[0].term.get(),
            assignments[0].generation,
            assignments[0].placed_term.get()
        ),
        (3, 2, 3)
    );

    // The old UID never comes back, never withdraws the new registration.
    assert_eq!(
        db.store.register_instance(&registration("old-uid")).await.unwrap(),
        Registered::Replaced
    );
    assert!(!db.store.withdraw_instance("r1", "old-uid", None).await.unwrap());
    let instance = db.store.instance("r1").await.unwrap().unwrap();
    assert_eq!(
        (instance.uid.as_str(), instance.generation, instance.withdrawn),
        ("new-uid", 2, false)
    );
    // The new workload re-registering (a sidecar restart) keeps its generation.
    assert_eq!(
        db.store.register_instance(&registration("new-uid")).await.unwrap(),
        Registered::Desired { generation: 2 }
    );
}

pub async fn only_ended_operations_can_be_forgotten(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let running = Operation {
        phase: OperationPhase::Running,
        ..operation("running")
    };
    let ended = Operation {
        phase: OperationPhase::Failed,
        target: "member-b".into(),
        ..operation("ended")
    };
    let puts = [FencedWrite::PutOperation(running), FencedWrite::PutOperation(ended)];
    db.store.write_fenced(&lease, &puts).await.unwrap();
    let forget = |id: &str| FencedWrite::DeleteOperation { id: id.into() };
    db.store
        .write_fenced(&lease, &[forget("running"), forget("ended"), forget("never-was")])
        .await
        .unwrap();
    let left: Vec<String> = db
        .store
        .list_operations()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(left, ["running"], "an open operation is never deleted");
}

pub async fn operations_are_adopted_unchanged(db: &TestDb) {
    let first = acquire(&db.store, "gw-a/1", SHORT).await;
    let op = Operation {
        kind: OperationKind::Recover,
        target: "r1".into(),
        deadline_at_ms: Some(123_456_789),
        ..operation("recover-r1")
    };
    db.store
        .write_fenced(&first, &[FencedWrite::PutOperation(op.clone())])
        .await
        .unwrap();
    let created = db.store.list_operations().await.unwrap()[0].clone();
    assert!(created.created_at_ms > 0 && created.updated_at_ms == created.created_at_ms);
    // The coordinator dies; a successor adopts the pending operation as recorded.
    wait_until_db_time(&db.store, first.expires_at_ms).await;
    let successor = db.replica().await;
    let second = acquire(&successor, "gw-b/1", LONG).await;
    let adopted = successor.list_operations().await.unwrap();
    assert_eq!(adopted, vec![created.clone()], "adoption reads the operation unchanged");
    assert_eq!(adopted[0].deadline_at_ms, Some(123_456_789));
    let progressed = Operation {
        phase: OperationPhase::Running,
        attempts: 1,
        moves: 1,
        ..adopted[0].clone()
    };
    successor
        .write_fenced(&second, &[FencedWrite::PutOperation(progressed)])
        .await
        .unwrap();
    let after = &successor.list_operations().await.unwrap()[0];
    assert_eq!(
        (after.phase, after.attempts, after.moves),
        (OperationPhase::Running, 1, 1)
    );
    assert_eq!(
        after.created_at_ms, created.created_at_ms,
        "created_at survives updates"
    );
    assert!(after.updated_at_ms >= created.updated_at_ms);
    assert_eq!(
        after.deadline_at_ms,
        Some(123_456_789),
        "the deadline is never extended by adoption"
    );
}

pub async fn signing_key_rotation_is_fenced(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    db.store
        .write_fenced(&lease, &[FencedWrite::PutSigningKey(key("k1"))])
        .await
        .unwrap();
    let retired = SigningKey {
        retired_at_ms: Some(42),
        ..key("k1")
    };
    db.store
        .write_fenced(
            &lease,
            &[
                FencedWrite::PutSigningKey(key("k2")),
                FencedWrite::PutSigningKey(retired),
            ],
        )
        .await
        .unwrap();
    let keys = db.store.list_signing_keys().await.unwrap();
    assert_eq!(keys.len(), 2);
    let k1 = keys.iter().find(|k| k.kid == "k1").unwrap();
    assert_eq!(
        (k1.retired_at_ms, k1.private_pem.0.as_slice()),
        (Some(42), b"private k1".as_slice())
    );
    db.store
        .write_fenced(&lease, &[FencedWrite::DeleteSigningKey { kid: "k1".into() }])
        .await
        .unwrap();
    let stale = Lease {
        term: CoordinatorTerm::new(lease.term.get() - 1),
        ..lease.clone()
    };
    assert_fenced(
        db.store
            .write_fenced(&stale, &[FencedWrite::PutSigningKey(key("k3"))])
            .await,
        |f| matches!(f, Fence::Superseded { .. }),
    );
    let kids: Vec<String> = db
        .store
        .list_signing_keys()
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.kid)
        .collect();
    assert_eq!(kids, vec!["k2".to_owned()]);
}

fn member(name: &str, process: &str) -> MemberUpdate {
    MemberUpdate {
        member: name.into(),
        process_id: process.into(),
        epoch: 1,
        runtime_address: "127.0.0.1:7443".into(),
        capacity: 256,
        served_by: "gw-a".into(),
        leaving: false,
    }
}

pub async fn members_expire_by_ttl(db: &TestDb) {
    let live = db
        .store
        .record_member(&member("m1", "p1"), Duration::from_secs(15))
        .await
        .unwrap();
    let now = db.store.now_ms().await.unwrap();
    assert!(live.is_live(now) && live.expires_at_ms <= now + 15_000);
    let short = db
        .store
        .record_member(&member("m2", "p2"), Duration::from_millis(200))
        .await
        .unwrap();
    wait_until_db_time(&db.store, short.expires_at_ms).await;
    let (now, members) = db.store.list_members().await.unwrap();
    let state: Vec<(String, bool)> = members.iter().map(|m| (m.member.clone(), m.is_live(now))).collect();
    assert_eq!(state, vec![("m1".into(), true), ("m2".into(), false)]);
    // A refresh brings it back, with the new epoch and the leaving flag.
    let back = MemberUpdate {
        epoch: 2,
        leaving: true,
        ..member("m2", "p2")
    };
    let back = db.store.record_member(&back, Duration::from_secs(15)).await.unwrap();
    assert!(back.is_live(db.store.now_ms().await.unwrap()));
    assert_eq!((back.epoch, back.leaving), (2, true));
}

pub async fn member_removal_needs_the_same_process(db: &TestDb) {
    let short = db
        .store
        .record_member(&member("m1", "p1"), Duration::from_millis(200))
        .await
        .unwrap();
    wait_until_db_time(&db.store, short.expires_at_ms).await;
    // A new process of m1 replaced the expired record: the old process's removal is a no-op.
    db.store.record_member(&member("m1", "p2"), LONG).await.unwrap();
    assert!(!db.store.remove_member("m1", "p1", 1).await.unwrap());
    assert_eq!(db.store.list_members().await.unwrap().1[0].process_id, "p2");
    // So is the removal by an older epoch of the same process.
    db.store
        .record_member(
            &MemberUpdate {
                epoch: 2,
                ..member("m1", "p2")
            },
            LONG,
        )
        .await
        .unwrap();
    assert!(!db.store.remove_member("m1", "p2", 1).await.unwrap());
    assert!(db.store.remove_member("m1", "p2", 2).await.unwrap());
    assert!(db.store.list_members().await.unwrap().1.is_empty());
}

/// A member that announced it was leaving and ended its stream keeps an expired record
/// marked leaving (so the next pool view shows it left, not lost); only its own process
/// and epoch can do that.
pub async fn a_member_that_left_keeps_an_expired_leaving_record(db: &TestDb) {
    db.store.record_member(&member("m1", "p1"), LONG).await.unwrap();
    assert!(!db.store.member_left("m1", "p0", 1).await.unwrap(), "another process");
    assert!(db.store.member_left("m1", "p1", 1).await.unwrap());
    let (now, members) = db.store.list_members().await.unwrap();
    assert_eq!(members.len(), 1);
    assert!(members[0].leaving && !members[0].is_live(now), "{:?}", members[0]);
    // The member's next process replaces it as usual.
    db.store.record_member(&member("m1", "p2"), LONG).await.unwrap();
    let (now, members) = db.store.list_members().await.unwrap();
    assert!(!members[0].leaving && members[0].is_live(now));
}

pub async fn a_superseded_stream_cannot_refresh_over_the_newer_record(db: &TestDb) {
    // A stream refreshes only the record its admission wrote: never one that is gone.
    assert_eq!(db.store.refresh_member(&member("m1", "p1"), LONG).await.unwrap(), None);
    assert!(db.store.list_members().await.unwrap().1.is_empty());
    db.store.record_member(&member("m1", "p1"), LONG).await.unwrap();
    let first = db.store.refresh_member(&member("m1", "p1"), LONG).await.unwrap();
    assert_eq!(first.map(|m| m.process_id), Some("p1".into()));
    // The stream ends; a new process is admitted elsewhere: the old stream's refresh changes
    // nothing.
    assert!(db.store.remove_member("m1", "p1", 1).await.unwrap());
    db.store.record_member(&member("m1", "p2"), LONG).await.unwrap();
    assert_eq!(db.store.refresh_member(&member("m1", "p1"), LONG).await.unwrap(), None);
    // Nor does a refresh from an older epoch of the new process.
    let newer = MemberUpdate {
        epoch: 2,
        ..member("m1", "p2")
    };
    db.store.record_member(&newer, LONG).await.unwrap();
    assert_eq!(db.store.refresh_member(&member("m1", "p2"), LONG).await.unwrap(), None);
    let (_, members) = db.store.list_members().await.unwrap();
    assert_eq!(
        members
            .iter()
            .map(|m| (m.process_id.as_str(), m.epoch))
            .collect::<Vec<_>>(),
        [("p2", 2)]
    );
    // A delayed hello of an older epoch of the recorded process cannot take the record back;
    // nor can another process while the record lives.
    for delayed in [member("m1", "p2"), newer.clone(), member("m1", "p1")] {
        assert!(matches!(
            db.store.record_member(&delayed, LONG).await,
            Err(gateway::store::Error::Conflict { .. })
        ));
    }
    // The current stream still refreshes, leaving flag included.
    let leaving = MemberUpdate { leaving: true, ..newer };
    let refreshed = db.store.refresh_member(&leaving, LONG).await.unwrap().unwrap();
    assert!(refreshed.leaving);
    // Once its stream ended and removed it, an older stream does not bring it back.
    assert!(db.store.remove_member("m1", "p2", 2).await.unwrap());
    assert_eq!(db.store.refresh_member(&member("m1", "p1"), LONG).await.unwrap(), None);
    assert_eq!(db.store.member("m1").await.unwrap().1, None);
}

/// A member name is held by its live process: another process (a stranger with the member's
/// token and a process id of its own, or the member restarted while its old record lives) is
/// admitted only once the record is gone — removed by its stream's end, left, or expired —
/// and a refused hello writes nothing. Nothing remembers the processes that held it before.
pub async fn another_process_takes_a_member_name_only_once_its_live_record_is_gone(db: &TestDb) {
    let held = db.store.record_member(&member("m1", "p1"), LONG).await.unwrap();
    let stranger = MemberUpdate {
        epoch: 9,
        served_by: "gw-b".into(),
        ..member("m1", "intruder")
    };
    match db.store.record_member(&stranger, LONG).await {
        Err(Error::Conflict { detail, .. }) => assert!(detail.contains("another live process"), "{detail}"),
        other => panic!("a stranger took the live member's name: {other:?}"),
    }
    let (now, record) = db.store.member("m1").await.unwrap();
    let record = record.unwrap();
    assert_eq!(record, held, "the refused hello wrote nothing");
    assert!(record.is_live(now));
    // The live process's own stream goes on refreshing its record.
    assert!(
        db.store
            .refresh_member(&member("m1", "p1"), LONG)
            .await
            .unwrap()
            .is_some()
    );

    // Its stream ended: the next process is admitted at once.
    assert!(db.store.remove_member("m1", "p1", 1).await.unwrap());
    db.store.record_member(&member("m1", "p2"), SHORT).await.unwrap();
    // The old process is no stranger for good: it is refused while p2 lives...
    let back = MemberUpdate {
        epoch: 2,
        ..member("m1", "p1")
    };
    assert!(matches!(
        db.store.record_member(&back, LONG).await,
        Err(Error::Conflict { .. })
    ));
    // ...and admitted once p2's record expired.
    let (_, p2) = db.store.member("m1").await.unwrap();
    wait_until_db_time(&db.store, p2.unwrap().expires_at_ms).await;
    let back = db.store.record_member(&back, LONG).await.unwrap();
    assert_eq!((back.process_id.as_str(), back.epoch), ("p1", 2));
}

/// The other replicas expire a member whose serving replica stopped recording that it runs —
/// only while that replica stays silent and the member did not attach elsewhere — and the
/// silent replica's stream can never refresh the expired record back to life.
pub async fn members_of_a_silent_replica_expire_unless_it_runs_or_they_moved(db: &TestDb) {
    let silence = Duration::from_millis(100);
    let record = db.store.record_member(&member("m1", "p1"), LONG).await.unwrap();
    // A replica that never recorded itself: left to the TTL.
    assert!(
        !db.store
            .expire_member_of_silent_replica(&record, silence)
            .await
            .unwrap()
    );
    db.store.refresh_replica("gw-a").await.unwrap();
    let replicas = db.store.list_replicas().await.unwrap();
    assert_eq!(replicas.len(), 1);
    assert!(
        !db.store
            .expire_member_of_silent_replica(&record, silence)
            .await
            .unwrap(),
        "gw-a just recorded itself"
    );
    wait_until_db_time(&db.store, replicas[0].1 + 100).await;
    // The member attached elsewhere (a newer epoch on gw-b): its new record stays.
    let moved = MemberUpdate {
        epoch: 2,
        served_by: "gw-b".into(),
        ..member("m1", "p1")
    };
    db.store.record_member(&moved, LONG).await.unwrap();
    assert!(
        !db.store
            .expire_member_of_silent_replica(&record, silence)
            .await
            .unwrap()
    );
    // Back on gw-a, silent: expired.
    let back = MemberUpdate {
        epoch: 3,
        ..member("m1", "p1")
    };
    let record = db.store.record_member(&back, LONG).await.unwrap();
    assert!(
        db.store
            .expire_member_of_silent_replica(&record, silence)
            .await
            .unwrap()
    );
    let (now, expired) = db.store.member("m1").await.unwrap();
    assert!(!expired.unwrap().is_live(now));
    // gw-a resumes: its stream cannot refresh the record back to life.
    db.store.refresh_replica("gw-a").await.unwrap();
    assert_eq!(db.store.refresh_member(&back, LONG).await.unwrap(), None);
    let (now, still) = db.store.member("m1").await.unwrap();
    assert!(!still.unwrap().is_live(now));
}

/// A gateway replica's build counts while the replica records that it runs, so a replica a
/// rollout replaced drops out of the builds within seconds, not when its build row ages.
pub async fn a_gateways_build_counts_while_its_replica_runs(db: &TestDb) {
    use gateway::store::builds::Component;
    let live = Duration::from_millis(300);
    db.store
        .record_build(Component::Gateway, "gw-a", "0.2.0+a")
        .await
        .unwrap();
    db.store
        .record_build(Component::Gateway, "gw-b", "0.1.0+b")
        .await
        .unwrap();
    db.store.refresh_replica("gw-a").await.unwrap();
    let names = |builds: Vec<gateway::store::builds::Build>| -> Vec<String> {
        builds
            .into_iter()
            .map(|b| format!("{}={}", b.name, b.version))
            .collect()
    };
    assert_eq!(
        names(db.store.builds_within(live).await.unwrap()),
        vec!["gw-a=0.2.0+a"],
        "gw-b never recorded that it runs"
    );
    let replicas = db.store.list_replicas().await.unwrap();
    wait_until_db_time(&db.store, replicas[0].1 + 300).await;
    assert!(
        db.store.builds_within(live).await.unwrap().is_empty(),
        "gw-a stopped recording that it runs: its build no longer counts"
    );
    db.store.refresh_replica("gw-a").await.unwrap();
    assert_eq!(names(db.store.builds_within(live).await.unwrap()), vec!["gw-a=0.2.0+a"]);
}

pub async fn registration_assigns_generations_and_withdrawal_sticks(db: &TestDb) {
    let registration = |uid: &str| Registration {
        route: "team-a/agent-0".into(),
        namespace: "team-a".into(),
        name: "agent-0".into(),
        uid: uid.into(),
        material: SecretBytes(uid.as_bytes().to_vec()),
    };
    assert_eq!(
        db.store.register_instance(&registration("u1")).await.unwrap(),
        Registered::Desired { generation: 1 }
    );
    // Re-registering the same workload (a sidecar restart) keeps its generation.
    assert_eq!(
        db.store.register_instance(&registration("u1")).await.unwrap(),
        Registered::Desired { generation: 1 }
    );
    // A replacement Pod of the same name is the next generation.
    assert_eq!(
        db.store.register_instance(&registration("u2")).await.unwrap(),
        Registered::Desired { generation: 2 }
    );
    let listed = db.store.list_instances().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].uid.as_str(), listed[0].generation, listed[0].withdrawn),
        ("u2", 2, false)
    );
    assert_eq!(listed[0].material.0, b"u2".to_vec());
    assert!(listed[0].registered_at_ms > 0);
    // Withdrawal needs the current workload, and sticks for it.
    assert!(
        !db.store.withdraw_instance("team-a/agent-0", "u1", None).await.unwrap(),
        "an older workload cannot withdraw"
    );
    assert!(db.store.withdraw_instance("team-a/agent-0", "u2", None).await.unwrap());
    assert!(
        !db.store.withdraw_instance("team-a/agent-0", "u2", None).await.unwrap(),
        "idempotent"
    );
    assert_eq!(
        db.store.register_instance(&registration("u2")).await.unwrap(),
        Registered::Withdrawn { generation: 2 }
    );
    assert!(db.store.list_instances().await.unwrap()[0].withdrawn);
    // A new workload on the route comes back desired, at a higher generation.
    assert_eq!(
        db.store.register_instance(&registration("u3")).await.unwrap(),
        Registered::Desired { generation: 3 }
    );
    assert!(!db.store.list_instances().await.unwrap()[0].withdrawn);
}

/// A Pod asks for the next generation (its container restarted): its instance is desired
/// again from scratch, only at the generation after the row's, within the namespace's quota;
/// a late report of the earlier generation leaves the next one alone; a replaced workload
/// never comes back this way either.
pub async fn a_withdrawn_workload_revives_as_the_next_generation_only(db: &TestDb) {
    let registration = |uid: &str, material: &str| Registration {
        route: "team-a/agent-0".into(),
        namespace: "team-a".into(),
        name: "agent-0".into(),
        uid: uid.into(),
        material: SecretBytes(material.as_bytes().to_vec()),
    };
    db.store.register_instance(&registration("u1", "m1")).await.unwrap();
    // Another generation than the row's: the row decides.
    assert_eq!(
        db.store
            .revive_instance_within(&registration("u1", "m1"), 5, None)
            .await
            .unwrap(),
        Registered::Desired { generation: 1 }
    );
    assert!(
        db.store
            .report_recovery_failed("team-a/agent-0", "u1", None, Some(OwnershipTerm::new(3)))
            .await
            .unwrap()
    );
    // Full namespace: refused, nothing changed.
    assert!(matches!(
        db.store
            .revive_instance_within(&registration("u1", "m2"), 1, Some(0))
            .await
            .unwrap(),
        Registered::OverQuota { .. }
    ));
    assert!(db.store.list_instances().await.unwrap()[0].withdrawn);
    // A stale generation changes nothing: the row decides.
    assert_eq!(
        db.store
            .revive_instance_within(&registration("u1", "m2"), 7, None)
            .await
            .unwrap(),
        Registered::Withdrawn { generation: 1 }
    );
    assert_eq!(
        db.store
            .revive_instance_within(&registration("u1", "m2"), 1, None)
            .await
            .unwrap(),
        Registered::Desired { generation: 2 }
    );
    let revived = db.store.list_instances().await.unwrap().remove(0);
    assert_eq!((revived.generation, revived.withdrawn), (2, false));
    assert_eq!(revived.withdrawn_reason, None, "from scratch");
    assert_eq!(revived.material.0, b"m2".to_vec(), "its new material");
    // A late report of generation 1 leaves generation 2 alone; one of 2 withdraws it.
    assert!(
        !db.store
            .withdraw_instance("team-a/agent-0", "u1", Some(1))
            .await
            .unwrap()
    );
    assert!(
        !db.store
            .report_recovery_failed("team-a/agent-0", "u1", Some(1), None)
            .await
            .unwrap()
    );
    assert!(!db.store.list_instances().await.unwrap()[0].withdrawn);
    // A deregistration lost on its way: the row is still desired, and the next generation is
    // taken all the same.
    assert_eq!(
        db.store
            .revive_instance_within(&registration("u1", "m5"), 2, None)
            .await
            .unwrap(),
        Registered::Desired { generation: 3 }
    );
    assert!(
        db.store
            .withdraw_instance("team-a/agent-0", "u1", Some(3))
            .await
            .unwrap()
    );
    // Replaced by another Pod: the old workload cannot revive.
    db.store.register_instance(&registration("u2", "m3")).await.unwrap();
    assert_eq!(
        db.store
            .revive_instance_within(&registration("u1", "m4"), 3, None)
            .await
            .unwrap(),
        Registered::Replaced
    );
}

pub async fn a_missed_recovery_deadline_withdraws_with_the_reason_and_last_owner(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let registration = |route: &str, uid: &str| Registration {
        route: route.into(),
        namespace: "ns".into(),
        name: "n".into(),
        uid: uid.into(),
        material: SecretBytes(vec![1]),
    };
    db.store.register_instance(&registration("r1", "u1")).await.unwrap();
    db.store.register_instance(&registration("r2", "u1")).await.unwrap();
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: None,
                next: assignment("r1", "m1", 3),
            }],
        )
        .await
        .unwrap();
    let reason = |route: &'static str| async move { db.store.instance(route).await.unwrap().unwrap().withdrawn_reason };
    assert_eq!(reason("r1").await, None, "a desired instance has no withdrawal reason");
    assert!(
        !db.store
            .report_recovery_failed("r1", "other", None, Some(OwnershipTerm::new(3)))
            .await
            .unwrap(),
        "only the registered workload reports"
    );
    // The assignment it last had is recorded; without one, the sidecar's last term.
    assert!(
        db.store
            .report_recovery_failed("r1", "u1", None, Some(OwnershipTerm::new(2)))
            .await
            .unwrap()
    );
    assert!(
        db.store
            .report_recovery_failed("r2", "u1", None, Some(OwnershipTerm::new(5)))
            .await
            .unwrap()
    );
    let r1 = db.store.instance("r1").await.unwrap().unwrap();
    assert!(r1.withdrawn);
    assert_eq!(
        r1.withdrawn_reason,
        Some(WithdrawnReason::RecoveryFailed {
            owner: Some("m1".into()),
            term: Some(OwnershipTerm::new(3))
        })
    );
    assert_eq!(
        reason("r2").await,
        Some(WithdrawnReason::RecoveryFailed {
            owner: None,
            term: Some(OwnershipTerm::new(5))
        })
    );
    assert!(
        !db.store.report_recovery_failed("r1", "u1", None, None).await.unwrap(),
        "a repeated report changes nothing"
    );
    assert_eq!(
        reason("r1").await,
        Some(WithdrawnReason::RecoveryFailed {
            owner: Some("m1".into()),
            term: Some(OwnershipTerm::new(3))
        })
    );
    // Any other withdrawal has no reason; a new workload on the route starts without one.
    db.store.register_instance(&registration("r3", "u1")).await.unwrap();
    assert!(db.store.withdraw_instance("r3", "u1", None).await.unwrap());
    assert_eq!(reason("r3").await, None);
    assert!(!db.store.report_recovery_failed("r3", "u1", None, None).await.unwrap());
    assert_eq!(reason("r3").await, None, "already withdrawn: nothing to report");
    assert_eq!(
        db.store.register_instance(&registration("r1", "u2")).await.unwrap(),
        Registered::Desired { generation: 2 }
    );
    let r1 = db.store.instance("r1").await.unwrap().unwrap();
    assert_eq!((r1.withdrawn, r1.withdrawn_reason), (false, None));
}

pub async fn every_write_to_a_table_the_pool_view_reads_is_counted(db: &TestDb) {
    use gateway::pool::View;
    let counts = || async { db.store.pool_writes().await.unwrap() };
    let before = counts().await;
    let first = View::reload(&db.store, None).await.unwrap();
    assert_eq!(first.writes, Some(before));
    // PostgreSQL names the server's incarnation (a restart may have lost commits, after
    // which equal counts say nothing); a SQLite file has none.
    assert_eq!(before.incarnation > 0, db.url.starts_with("postgres"), "{before:?}");
    assert_eq!(counts().await.incarnation, before.incarnation);
    let mut restarted = first.clone();
    restarted.writes = Some(gateway::store::PoolWrites {
        incarnation: before.incarnation + 1,
        ..before
    });
    let unchanged = View::reload(&db.store, Some(&first)).await.unwrap();
    assert!(
        unchanged.assignments.same(&first.assignments),
        "equal counts: not read again"
    );
    if db.url.starts_with("postgres") {
        // Counts equal to those of another incarnation: every table is read again.
        let again = View::reload(&db.store, Some(&restarted)).await.unwrap();
        assert!(!again.assignments.same(&restarted.assignments));
    }

    // A registration counts for instances only; a view re-read after it takes the new row.
    let registration = agent_zero();
    db.store.register_instance(&registration).await.unwrap();
    let after = counts().await;
    assert!(after.instances > before.instances);
    assert_eq!(
        (after.assignments, after.reports, after.operations),
        (before.assignments, before.reports, before.operations)
    );
    let second = View::reload(&db.store, Some(&first)).await.unwrap();
    assert!(
        second.instances.contains_key("team-a/agent-0"),
        "a counted write is read"
    );

    // Nothing written: every table is taken from the previous view — even one that differs
    // from the store (proof that it was not read).
    let mut doctored = second.clone();
    doctored.instances.clear();
    let third = View::reload(&db.store, Some(&doctored)).await.unwrap();
    assert!(third.instances.is_empty(), "an uncounted table is not read again");

    // A fenced placement counts assignments (and instances: the route's last term), a
    // report counts reports, an operation counts operations, and a deletion counts too.
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let assign = FencedWrite::Assign {
        expected_term: None,
        next: assignment("team-a/agent-0", "m1", 1),
    };
    db.store.write_fenced(&lease, &[assign]).await.unwrap();
    let placed = counts().await;
    assert!(placed.assignments > after.assignments && placed.instances > after.instances);
    let report = active_report("team-a/agent-0");
    db.store.record_report(&report).await.unwrap();
    let reported = counts().await;
    assert!(reported.reports > placed.reports);
    // A report that moves only the workload's progress (through another replica, later) is
    // not a change of the pool: not counted. A new phase, PID or message is.
    let counted = |r: Report| async move {
        let before = counts().await.reports;
        db.store.record_report(&r).await.unwrap();
        counts().await.reports > before
    };
    let progressed = Report {
        progress: Some(9),
        reported_by: "gw-b".into(),
        ..report.clone()
    };
    assert!(!counted(progressed.clone()).await, "progress alone");
    assert!(!counted(progressed.clone()).await, "the same report again");
    assert!(
        counted(Report {
            workload_pid: 43,
            ..progressed.clone()
        })
        .await,
        "a new PID"
    );
    assert!(
        counted(Report {
            message: "slow".into(),
            workload_pid: 43,
            ..progressed.clone()
        })
        .await,
        "a message"
    );
    assert!(
        counted(Report {
            phase: ReportPhase::Failed,
            ..report.clone()
        })
        .await,
        "a new phase"
    );
    let reported = counts().await;
    let ended = Operation {
        phase: OperationPhase::Failed,
        ..operation("ended")
    };
    db.store
        .write_fenced(&lease, &[FencedWrite::PutOperation(ended)])
        .await
        .unwrap();
    let recorded = counts().await;
    assert!(recorded.operations > reported.operations);
    let forget = FencedWrite::DeleteOperation { id: "ended".into() };
    db.store.write_fenced(&lease, &[forget]).await.unwrap();
    assert!(counts().await.operations > recorded.operations);
    let fourth = View::reload(&db.store, Some(&third)).await.unwrap();
    assert_eq!(fourth.instances.len(), 1, "changed tables are read again");
    assert!(fourth.assignments.contains_key("team-a/agent-0") && fourth.reports.contains_key("team-a/agent-0"));
}

pub async fn reports_never_regress_in_term(db: &TestDb) {
    let report = |term: u64, phase: ReportPhase| Report {
        route: "team-a/agent-0".into(),
        term: OwnershipTerm::new(term),
        member: format!("m{term}"),
        process_id: "p".into(),
        phase,
        message: String::new(),
        workload_pid: 42,
        progress: Some(7),
        reported_by: "gw-a".into(),
        updated_at_ms: 0,
        policy: None,
    };
    db.store.record_report(&report(2, ReportPhase::Starting)).await.unwrap();
    db.store.record_report(&report(2, ReportPhase::Active)).await.unwrap();
    db.store.record_report(&report(1, ReportPhase::Failed)).await.unwrap();
    let reports = db.store.list_reports().await.unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(
        (
            reports[0].term.get(),
            reports[0].phase.as_str(),
            reports[0].member.as_str()
        ),
        (2, "INSTANCE_PHASE_ACTIVE", "m2")
    );
    assert_eq!(reports[0].progress, Some(7));
    db.store.record_report(&report(3, ReportPhase::Starting)).await.unwrap();
    assert_eq!(db.store.list_reports().await.unwrap()[0].term, OwnershipTerm::new(3));
    // The sidecar's answer to the policy install is kept with the report, and replaced by the
    // next one (absent again: nothing reported in that term yet).
    let loaded = LoadedPolicy {
        name: "default".into(),
        revision: 1_700_000_000_000_003,
        error: "a rule's host is not a DNS name".into(),
    };
    let writes = db.store.pool_writes().await.unwrap();
    db.store
        .record_report(&Report {
            policy: Some(loaded.clone()),
            ..report(3, ReportPhase::Starting)
        })
        .await
        .unwrap();
    assert_eq!(db.store.list_reports().await.unwrap()[0].policy, Some(loaded));
    assert_ne!(
        db.store.pool_writes().await.unwrap(),
        writes,
        "a new answer is a change of the pool"
    );
    db.store.record_report(&report(4, ReportPhase::Starting)).await.unwrap();
    assert_eq!(db.store.list_reports().await.unwrap()[0].policy, None);

    // The store rolled back to term 2 on m2 (term 4's reservation lost): the report of term 4
    // stays above, but the current owner's report of its term counts — it says the term is
    // given up, which the coordinator must see.
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let rolled_back = assignment("team-a/agent-0", "m2", 2);
    let assign = FencedWrite::Assign {
        expected_term: None,
        next: rolled_back.clone(),
    };
    db.store.write_fenced(&lease, &[assign]).await.unwrap();
    let not_owner = Report {
        process_id: "another-process".into(),
        ..report(2, ReportPhase::Failed)
    };
    db.store.record_report(&not_owner).await.unwrap();
    assert_eq!(db.store.list_reports().await.unwrap()[0].term, OwnershipTerm::new(4));
    let owner = Report {
        process_id: rolled_back.process_id.clone(),
        ..report(2, ReportPhase::Failed)
    };
    db.store.record_report(&owner).await.unwrap();
    let reports = db.store.list_reports().await.unwrap();
    assert_eq!((reports[0].term.get(), reports[0].phase), (2, ReportPhase::Failed));

    // A batch of a stream that ended (the member attached again at epoch 2) lands late: not
    // written, and counted; the current stream's is.
    let m2 = MemberUpdate {
        epoch: 2,
        ..member("m2", &rolled_back.process_id)
    };
    db.store.record_member(&m2, LONG).await.unwrap();
    let late = Report {
        progress: Some(1),
        ..owner.clone()
    };
    assert_eq!(
        db.store
            .record_stream_reports(vec![(late.clone(), Some(1))])
            .await
            .unwrap(),
        1
    );
    assert_eq!(db.store.list_reports().await.unwrap()[0].progress, Some(7));
    assert_eq!(db.store.record_stream_reports(vec![(late, Some(2))]).await.unwrap(), 0);
    assert_eq!(db.store.list_reports().await.unwrap()[0].progress, Some(1));
}

/// A move's new owner reports the instance before the workload sent it any progress (first
/// starting, without the workload's PID): the workload's last progress stays, since a move is
/// not a restart — unless the workload stopped or another process runs under the route now.
pub async fn a_moves_first_report_keeps_the_workloads_progress(db: &TestDb) {
    let report = |term: u64, phase: ReportPhase, workload_pid: i64, progress: Option<i64>| Report {
        route: "team-a/agent-0".into(),
        term: OwnershipTerm::new(term),
        member: format!("m{term}"),
        process_id: format!("p{term}"),
        phase,
        message: String::new(),
        workload_pid,
        progress,
        reported_by: "gw-a".into(),
        updated_at_ms: 0,
        policy: None,
    };
    let progress = || async { db.store.list_reports().await.unwrap()[0].progress };
    use ReportPhase::{Active, Starting, Stopped};
    db.store.record_report(&report(1, Starting, 0, None)).await.unwrap();
    assert_eq!(progress().await, Some(0), "a first report without progress");
    db.store
        .record_report(&report(1, Active, 42, Some(3_178)))
        .await
        .unwrap();
    db.store.record_report(&report(2, Starting, 0, None)).await.unwrap();
    assert_eq!(progress().await, Some(3_178), "moved: starting, its PID not known yet");
    db.store.record_report(&report(2, Active, 42, None)).await.unwrap();
    assert_eq!(progress().await, Some(3_178), "moved: the same workload process");
    db.store
        .record_report(&report(2, Active, 42, Some(3_190)))
        .await
        .unwrap();
    assert_eq!(progress().await, Some(3_190), "what the new owner accepted");
    db.store.record_report(&report(3, Active, 77, None)).await.unwrap();
    assert_eq!(progress().await, Some(0), "another process");
    db.store.record_report(&report(3, Active, 77, Some(5))).await.unwrap();
    db.store.record_report(&report(3, Stopped, 77, Some(5))).await.unwrap();
    db.store.record_report(&report(4, Starting, 0, None)).await.unwrap();
    assert_eq!(progress().await, Some(0), "the next process of a stopped workload");
}

pub async fn migrations_are_idempotent_across_replicas(db: &TestDb) {
    // Several replicas opening the same database at once all succeed, and
    // the lease row exists exactly once.
    let opens = (0..4).map(|_| db.replica());
    let stores = futures::future::join_all(opens).await;
    let lease = acquire(&stores[3], "gw-d/1", LONG).await;
    assert_eq!(lease.term, CoordinatorTerm::new(1));
    for store in stores {
        store.close().await;
    }
}

/// A newer build's migrations on the database (a rollback, an older replica restarting during
/// a rolling upgrade): this build runs on while the schema says it may, and otherwise refuses
/// saying which build the schema needs. Before, any unknown migration stopped every replica
/// with sqlx's "previously applied but is missing".
pub async fn a_newer_builds_migrations_are_run_against_within_the_compatibility_marker(db: &TestDb) {
    use sqlx::Connection as _;
    let mut raw = db.raw().await;
    let newer = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
                 VALUES (9001, 'a newer build', TRUE, X'00', 1)";
    let newer = if db.url.starts_with("postgres") {
        newer.replace("X'00'", "'\\x00'::bytea")
    } else {
        newer.to_owned()
    };
    sqlx::query(&newer).execute(&mut raw).await.unwrap();
    let compatible = db.replica().await;
    let lease = acquire(&compatible, "gw-old/1", LONG).await;
    assert_eq!(lease.term, CoordinatorTerm::new(1), "the older build works on");
    compatible.close().await;

    sqlx::query("UPDATE schema_compatibility SET oldest_reader = 9001 WHERE id = 1")
        .execute(&mut raw)
        .await
        .unwrap();
    let refused = Store::open(&db.url, &store::Options::default())
        .await
        .map(|_| ())
        .unwrap_err();
    let said = refused.to_string();
    assert!(
        matches!(
            refused,
            gateway::store::Error::SchemaTooNew {
                newest: 9001,
                oldest_reader: 9001,
                ..
            }
        ),
        "{said}"
    );
    assert!(said.contains("at least 9001") && !said.contains("password"), "{said}");
    raw.close().await.unwrap();
}

pub async fn operation_requests_are_idempotent_and_cancels_wait_for_the_coordinator(db: &TestDb) {
    // Two replicas record the same drain at once: one operation.
    let other = db.replica().await;
    let (one, two) = (operation("op-1"), operation("op-2"));
    let (a, b) = tokio::join!(db.store.request_operation(&one), other.request_operation(&two));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.0.id, b.0.id, "one of them got the other's operation");
    assert!(a.1 != b.1, "exactly one created it");
    let recorded = a.0;
    assert_eq!(recorded.phase, OperationPhase::Pending);
    let now = db.store.now_ms().await.unwrap();
    let deadline = recorded.deadline_at_ms.unwrap();
    assert!(
        deadline > now && deadline <= now + 1_000_000,
        "the budget became a deadline on the database clock"
    );
    // A rebalance is another operation.
    let rebalance = Operation {
        kind: OperationKind::Rebalance,
        target: String::new(),
        ..operation("op-3")
    };
    assert!(db.store.request_operation(&rebalance).await.unwrap().1);

    // A cancellation is recorded, not applied: the coordinator writes the phase.
    let cancelled = db.store.request_cancel(&recorded.id).await.unwrap().unwrap();
    assert!(cancelled.cancel_requested);
    assert_eq!(cancelled.phase, OperationPhase::Pending);
    assert_eq!(db.store.request_cancel("unknown").await.unwrap(), None);
    // The coordinator's own writes keep the request.
    let lease = acquire(&db.store, "coordinator", LONG).await;
    let running = Operation {
        phase: OperationPhase::Running,
        ..cancelled.clone()
    };
    db.store
        .write_fenced(&lease, &[FencedWrite::PutOperation(running)])
        .await
        .unwrap();
    assert!(
        db.store
            .operation(&recorded.id)
            .await
            .unwrap()
            .unwrap()
            .cancel_requested
    );
    // A finished operation cannot be cancelled.
    let failed = Operation {
        phase: OperationPhase::Failed,
        ..rebalance.clone()
    };
    let stored = db.store.list_operations().await.unwrap();
    let rebalance_id = stored
        .iter()
        .find(|o| o.kind == OperationKind::Rebalance)
        .unwrap()
        .id
        .clone();
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::PutOperation(Operation {
                id: rebalance_id.clone(),
                ..failed
            })],
        )
        .await
        .unwrap();
    assert!(
        !db.store
            .request_cancel(&rebalance_id)
            .await
            .unwrap()
            .unwrap()
            .cancel_requested
    );
}

/// PostgreSQL: another replica's committed write to a table the pool view reads is notified at
/// once; a write to no such table, and an uncommitted one, are not. SQLite has no listener.
pub async fn pool_writes_are_notified_to_listening_replicas(db: &TestDb) {
    let Some(listener) = db.store.listen_pool_writes(Duration::from_secs(5)).await else {
        assert_eq!(db.store.backend(), store::Backend::Sqlite);
        return;
    };
    let mut listener = listener.unwrap();
    let other = Store::open(&db.url, &store::Options::default()).await.unwrap();
    // Another replica's liveness record is not in the view's counted tables.
    other.refresh_replica("replica-b").await.unwrap();
    let registration = agent_zero();
    other.register_instance(&registration).await.unwrap();
    let notified = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification within 10 s")
        .unwrap();
    assert_eq!(notified.channel(), "openshell_pool_writes");
    assert_eq!(
        notified.payload(),
        "instances",
        "the first notification is the registration's"
    );
    other.close().await;
}

/// A replica that follows the store's writes while an operation runs is woken by another
/// replica's write: on PostgreSQL by its notification, on SQLite by the polled write counts
/// (a coordinator that does not serve the members otherwise saw each activation only at its
/// next 200 ms read).
pub async fn another_replicas_write_wakes_the_pool_read(db: &TestDb) {
    let wake = Arc::new(tokio::sync::Notify::new());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let draining = gateway::pool::View {
        operations: vec![operation("op-1")].into(),
        ..gateway::pool::View::default()
    };
    let (_views, view) = tokio::sync::watch::channel(Arc::new(draining));
    let following = tokio::spawn(gateway::refresh::follow_writes(
        db.store.clone(),
        view,
        Arc::clone(&wake),
        shutdown.clone(),
    ));
    tokio::time::timeout(LONG, wake.notified())
        .await
        .expect("woken once when it starts following");
    let other = Store::open(&db.url, &store::Options::default()).await.unwrap();
    other.register_instance(&agent_zero()).await.unwrap();
    tokio::time::timeout(LONG, wake.notified())
        .await
        .expect("woken by the other replica's write");
    shutdown.cancel();
    following.await.unwrap();
    other.close().await;
}

/// Route `team-a/agent-0`'s registration.
fn agent_zero() -> Registration {
    Registration {
        route: "team-a/agent-0".into(),
        namespace: "team-a".into(),
        name: "agent-0".into(),
        uid: "u1".into(),
        material: SecretBytes(b"m".to_vec()),
    }
}

/// The audit trail: stored only for the member owning the route at the term named (its
/// ACTIVE assignment), each (uid, sequence) once whatever is sent again, read back by Pod.
pub async fn audit_records_are_stored_once_and_only_for_the_active_owner(db: &TestDb) {
    use gateway::store::AuditEntry;
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    let registration = Registration {
        route: "ns/pod".into(),
        namespace: "ns".into(),
        name: "pod".into(),
        uid: "u-1".into(),
        material: SecretBytes(vec![1]),
    };
    db.store.register_instance(&registration).await.unwrap();
    live_members(&db.store, &["m1", "m2"]).await;
    let record = |sequence: i64| AuditEntry {
        sequence,
        decision: "deny".into(),
        destination: format!("d{sequence}.example:443"),
        ..AuditEntry::default()
    };
    let denied = |r: Result<gateway::store::Recorded, Error>| matches!(r, Err(Error::Denied { .. }));
    assert!(
        denied(
            db.store
                .record_audit("ns/pod", "m1", OwnershipTerm::new(1), vec![record(1)])
                .await
        ),
        "nobody owns it yet"
    );
    let active = Assignment {
        phase: AssignmentPhase::Active,
        ..assignment("ns/pod", "m1", 1)
    };
    db.store
        .write_fenced(
            &lease,
            &[FencedWrite::Assign {
                expected_term: None,
                next: active,
            }],
        )
        .await
        .unwrap();
    assert!(
        denied(
            db.store
                .record_audit("ns/pod", "m2", OwnershipTerm::new(1), vec![record(1)])
                .await
        ),
        "another member"
    );
    assert!(
        denied(
            db.store
                .record_audit("ns/pod", "m1", OwnershipTerm::new(2), vec![record(1)])
                .await
        ),
        "another term"
    );
    let first = db
        .store
        .record_audit("ns/pod", "m1", OwnershipTerm::new(1), vec![record(1), record(2)])
        .await
        .unwrap();
    assert_eq!(
        (first.through, first.new),
        (2, vec!["deny".to_owned(), "deny".to_owned()])
    );
    // Sent again (a handoff, a lost acknowledgement): kept once, as first stored.
    let mut again = record(2);
    again.destination = "changed.example:443".into();
    let allowed = AuditEntry {
        decision: "allow".into(),
        ..record(3)
    };
    let second = db
        .store
        .record_audit("ns/pod", "m1", OwnershipTerm::new(1), vec![again, allowed])
        .await
        .unwrap();
    assert_eq!(
        (second.through, second.new),
        (3, vec!["allow".to_owned()]),
        "only the new record counts"
    );
    let listed = db.store.list_audit("ns", "pod", 0, 0, 100).await.unwrap();
    assert_eq!(listed.iter().map(|e| e.sequence).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(listed[1].destination, "d2.example:443");
    assert_eq!(
        (listed[0].uid.as_str(), listed[0].member.as_str(), listed[0].term.get()),
        ("u-1", "m1", 1)
    );
    assert_eq!(
        db.store.list_audit("ns", "pod", 2, 0, 100).await.unwrap().len(),
        1,
        "after a sequence"
    );
    assert!(db.store.list_audit("ns", "other", 0, 0, 100).await.unwrap().is_empty());

    // Denials counted by destination for the EgressDenied Events, by storing time.
    let twice = |sequence: i64| AuditEntry {
        destination: "d1.example:443".into(),
        ..record(sequence)
    };
    db.store
        .record_audit("ns/pod", "m1", OwnershipTerm::new(1), vec![twice(4), twice(5)])
        .await
        .unwrap();
    let stored = db.store.list_audit("ns", "pod", 0, 0, 100).await.unwrap();
    let (first_ms, last_ms) = (stored[0].recorded_at_ms, stored[4].recorded_at_ms);
    let counted = db.store.audit_denials(first_ms - 1, last_ms, 3, 100).await.unwrap();
    assert_eq!(
        counted
            .iter()
            .map(|d| (
                d.destination.as_str(),
                d.count,
                d.uid.as_str(),
                d.rank,
                d.destinations,
                d.attempts
            ))
            .collect::<Vec<_>>(),
        [
            ("d1.example:443", 3, "u-1", 1, 2, 4),
            ("d2.example:443", 1, "u-1", 2, 2, 4)
        ],
        "denials only (not the allowed record), most first, with the Pod's totals"
    );
    let busiest = db.store.audit_denials(first_ms - 1, last_ms, 1, 100).await.unwrap();
    assert_eq!(
        busiest.iter().map(|d| d.destination.as_str()).collect::<Vec<_>>(),
        ["d1.example:443"],
        "a Pod's busiest destinations only"
    );
    assert!(
        db.store
            .audit_denials(last_ms, last_ms + 60_000, 3, 100)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A store that lost an instance (emptied, or restored from an older backup) hears from its
/// sidecar where it stands: recorded again at the sidecar's generation with its workload as
/// the checkpoint, and no term at or below its fence is reserved again; a sidecar the store
/// knows raises the route's last term to its fence, never lowers it. The member process the
/// sidecar names as its fence's holder is recorded with the fence, unless a later term was
/// used; a new workload under the route starts with none.
pub async fn a_store_that_lost_an_instance_takes_it_back_above_the_sidecars_fence(db: &TestDb) {
    let holder = |member: &str, term: u64| {
        Some(store::FenceHolder {
            member: member.into(),
            process_id: format!("{member}-p"),
            term: OwnershipTerm::new(term),
            generation: 3,
        })
    };
    let registration = agent_zero();
    let resume = store::Resume {
        generation: 3,
        fence: OwnershipTerm::new(7),
        workload: Checkpoint {
            pid: 42,
            start_ticks: 4242,
            exe_digest: vec![1; 32],
        },
        holder: Some(("m1".into(), "m1-p".into())),
    };
    assert_eq!(
        db.store.register_resuming(&registration, None, &resume).await.unwrap(),
        Registered::Desired { generation: 3 }
    );
    let listed = db.store.list_instances().await.unwrap();
    assert_eq!(
        (listed[0].generation, listed[0].last_term, listed[0].checkpointed),
        (3, OwnershipTerm::new(7), true)
    );
    assert_eq!(listed[0].fence_holder, holder("m1", 7));
    let mut raw = db.raw().await;
    let checkpoint: (Option<i64>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT checkpoint_pid, checkpoint_start_ticks FROM instances WHERE route = '{}'",
        registration.route
    ))
    .fetch_one(&mut raw)
    .await
    .unwrap();
    assert_eq!(checkpoint, (Some(42), Some(4242)));
    // The first placement takes a term above the fence.
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    live_members(&db.store, &["m1"]).await;
    let at_fence = FencedWrite::Assign {
        expected_term: None,
        next: assignment(&registration.route, "m1", 7),
    };
    assert!(matches!(
        db.store.write_fenced(&lease, &[at_fence]).await,
        Err(Error::Conflict { .. })
    ));
    // The same sidecar again: the last term goes up to its fence, never down; the holder
    // with it, not with a fence below the last term.
    for (fence, named, last, recorded) in [(9, "m2", 9, holder("m2", 9)), (5, "m3", 9, holder("m2", 9))] {
        let resume = store::Resume {
            fence: OwnershipTerm::new(fence),
            holder: Some((named.into(), format!("{named}-p"))),
            ..resume.clone()
        };
        assert_eq!(
            db.store.register_resuming(&registration, None, &resume).await.unwrap(),
            Registered::Desired { generation: 3 }
        );
        let listed = db.store.list_instances().await.unwrap();
        assert_eq!(
            (listed[0].last_term, listed[0].fence_holder.clone()),
            (OwnershipTerm::new(last), recorded)
        );
    }
    let above = FencedWrite::Assign {
        expected_term: None,
        next: assignment(&registration.route, "m1", 10),
    };
    db.store.write_fenced(&lease, &[above]).await.unwrap();
    // Another workload under the route: its generation starts with no holder.
    let replacing = Registration {
        uid: "u2".into(),
        ..registration.clone()
    };
    db.store.register_instance(&replacing).await.unwrap();
    assert_eq!(db.store.list_instances().await.unwrap()[0].fence_holder, None);
}

/// A database emptied under a running store (a database Pod replaced without its volume): the
/// next statement says the schema is gone, and migrating again brings back a working store.
pub async fn a_store_whose_schema_is_gone_says_so_and_migrates_again(db: &TestDb) {
    use sqlx::Executor as _;
    db.store.register_instance(&agent_zero()).await.unwrap();
    let mut raw = db.raw().await;
    if db.url.starts_with("postgres") {
        raw.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
            .await
            .unwrap();
    } else {
        let tables: Vec<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
                .fetch_all(&mut raw)
                .await
                .unwrap();
        for table in tables {
            raw.execute(format!("DROP TABLE \"{table}\"").as_str()).await.unwrap();
        }
    }
    let gone = db.store.refresh_replica("gw-a").await.unwrap_err();
    assert!(gone.schema_gone(), "{gone}");
    assert!(!Error::Invalid("x".into()).schema_gone());
    db.store.migrate_again().await.unwrap();
    db.store.refresh_replica("gw-a").await.unwrap();
    assert!(db.store.list_instances().await.unwrap().is_empty(), "an empty pool");
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    assert_eq!(lease.term, CoordinatorTerm::new(1));
}
