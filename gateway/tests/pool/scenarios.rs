//! Pool-control scenarios, each on a fresh database.
use std::collections::BTreeMap;

use gateway::store::{AssignmentPhase, OperationKind, OperationPhase, OwnershipTerm, ReportPhase};
use proto::common::v1::InstancePhase;
use proto::host::v1::member_message::Kind as MemberKind;
use proto::host::v1::{Ack, InstanceStatus, StatusReport};
use tonic::Code;

use proto::host::v1::AssignmentPhase as WirePhase;
use proto::recovery::v1::supervisor_recovery_client::SupervisorRecoveryClient;
use proto::recovery::v1::{ActivateRequest, IssueGrantRequest, IssueGrantResponse, Receipt, TrustBundleRequest};
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest};
use proto::trust::{Claims, DEFAULT_ISSUER, Expectation, GrantClaims, Kind, ProofClaims};

use crate::cluster::{
    Behaviour, Identity, Member, Pausable, Replica, Tokens, channel, identity, instance_ref, receipt, register,
    register_as, start_pausable_replica, start_replica, start_replica_with, take_up, wait_assignments, with_token,
};
use crate::support::{TestDb, wait_for, wait_until_db_time};

/// Two replicas, a credentials directory, and the tokens the coordinator delivered.
struct Pool {
    replicas: Vec<Replica>,
    tokens: Tokens,
    _credentials: tempfile::TempDir,
}

impl Pool {
    async fn start(db: &TestDb) -> Self {
        Self::start_with(db, &[]).await
    }

    /// Both replicas with `extra` arguments.
    async fn start_with(db: &TestDb, extra: &[&str]) -> Self {
        let credentials = tempfile::tempdir().unwrap();
        let dir = credentials.path().to_str().expect("utf-8 path");
        let args: Vec<&str> = ["--credentials-dir", dir]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        let a = start_replica_with("gw-a", &db.url, &args, None).await;
        let b = start_replica_with("gw-b", &db.url, &args, None).await;
        let tokens = Tokens::load(&db.store).await;
        Self {
            replicas: vec![a, b],
            tokens,
            _credentials: credentials,
        }
    }

    fn endpoint(&self, i: usize) -> String {
        self.replicas[i].endpoint()
    }

    async fn member(&self, replica: usize, name: &str, behaviour: Behaviour) -> Member {
        self.member_with(replica, identity(name, &format!("{name}-p1"), 1, 256), behaviour)
            .await
            .unwrap()
    }

    async fn member_with(&self, replica: usize, id: Identity, behaviour: Behaviour) -> Result<Member, tonic::Status> {
        let token = self.tokens.member(&id.member);
        Member::attach(&self.endpoint(replica), &token, id, behaviour).await
    }

    async fn register(&self, name: &str) -> Result<proto::registry::v1::RegisterResponse, tonic::Status> {
        register(
            &self.endpoint(self.replicas.len() - 1),
            &self.tokens.instance(name),
            name,
        )
        .await
    }

    async fn stop(self) {
        for replica in self.replicas {
            replica.stop().await;
        }
    }
}

fn per_member(assignments: &[gateway::store::Assignment]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for a in assignments {
        *counts.entry(a.member.clone()).or_default() += 1;
    }
    counts
}

async fn wait_members(db: &TestDb, n: usize) {
    wait_for("members to be recorded", 2000, || async {
        let (now, members) = db.store.list_members().await.ok()?;
        (members.iter().filter(|m| m.is_live(now)).count() == n).then_some(())
    })
    .await;
}

pub async fn placement_spreads_and_is_stable(db: &TestDb) {
    let pool = Pool::start(db).await;
    // Members on both replicas: placement does not care who serves the stream.
    // m-c is an older member that does not apply directory deltas.
    let older = Identity {
        directory_deltas: false,
        ..identity("m-c", "m-c-p1", 1, 256)
    };
    let mut members = vec![
        pool.member(0, "m-a", Behaviour::Healthy).await,
        pool.member(1, "m-b", Behaviour::Healthy).await,
        pool.member_with(0, older, Behaviour::Healthy).await.unwrap(),
    ];
    wait_members(db, 3).await;
    for i in 0..6 {
        pool.register(&format!("agent-{i}")).await.unwrap();
    }
    let placed = wait_assignments(&db.store, "six instances spread two per member", |a| {
        a.len() == 6 && per_member(a).values().all(|n| *n == 2)
    })
    .await;
    assert!(
        placed
            .iter()
            .all(|a| a.term.get() == 1 && a.phase == AssignmentPhase::Reserved)
    );
    // Every member's snapshot lists exactly its two instances.
    for m in &mut members {
        let name = m.name.clone();
        let snapshot = m
            .wait_snapshot("two owned of six", |s| s.instances.len() == 2 && s.directory.len() == 6)
            .await;
        let mine: Vec<&str> = placed
            .iter()
            .filter(|a| a.member == name)
            .map(|a| a.route.as_str())
            .collect();
        let listed: Vec<&str> = snapshot.instances.iter().map(|o| o.route.as_str()).collect();
        assert_eq!(listed, mine, "{name}'s snapshot");
        assert_eq!(snapshot.directory.len(), 6, "the directory names every placed route");
    }
    // A new member changes nothing (stable), and the next instance goes to it.
    let _late = pool.member(1, "m-d", Behaviour::Healthy).await;
    wait_members(db, 4).await;
    pool.register("agent-6").await.unwrap();
    let after = wait_assignments(&db.store, "the seventh instance placed", |a| a.len() == 7).await;
    assert_eq!(
        after.iter().find(|a| a.route == "default/agent-6").unwrap().member,
        "m-d",
        "least loaded"
    );
    for a in &placed {
        let now = after.iter().find(|b| b.route == a.route).unwrap();
        assert_eq!((&now.member, now.term), (&a.member, a.term), "{} stayed put", a.route);
    }
    // The seventh route reached every member's directory: as a delta where the member applies
    // them (the fixture rebuilds the whole directory from it), whole where it does not.
    for m in &mut members {
        let name = m.name.clone();
        let snapshot = m
            .wait_snapshot("seven in the directory", |s| s.directory.len() == 7)
            .await;
        assert_eq!(snapshot.directory_delta, name != "m-c", "{name}");
        assert!(
            snapshot
                .directory
                .iter()
                .any(|e| e.route == "default/agent-6" && e.member == "m-d")
        );
    }
    pool.stop().await;
}

pub async fn a_killed_member_stream_moves_its_instances_at_term_plus_one(db: &TestDb) {
    let pool = Pool::start(db).await;
    let doomed = pool.member(0, "m-a", Behaviour::Healthy).await;
    let _b = pool.member(1, "m-b", Behaviour::Healthy).await;
    let _c = pool.member(0, "m-c", Behaviour::Healthy).await;
    wait_members(db, 3).await;
    for i in 0..6 {
        pool.register(&format!("agent-{i}")).await.unwrap();
    }
    let before = wait_assignments(&db.store, "six placed", |a| a.len() == 6).await;
    let moved: Vec<String> = before
        .iter()
        .filter(|a| a.member == "m-a")
        .map(|a| a.route.clone())
        .collect();
    assert_eq!(moved.len(), 2);

    doomed.kill();
    let after = wait_assignments(&db.store, "m-a's instances moved", |a| {
        a.iter().all(|a| a.member != "m-a")
    })
    .await;
    for a in &after {
        let old = before.iter().find(|b| b.route == a.route).unwrap();
        if moved.contains(&a.route) {
            assert_eq!(a.term, old.term.next(), "{} moved at term + 1", a.route);
            assert_eq!(a.phase, AssignmentPhase::Reserved);
        } else {
            assert_eq!((&a.member, a.term), (&old.member, old.term), "{} untouched", a.route);
        }
    }
    let ops = wait_for("both recoveries to succeed", 2000, || async {
        let ops = db.store.list_operations().await.ok()?;
        (ops.len() == 2 && ops.iter().all(|o| o.phase == OperationPhase::Succeeded)).then_some(ops)
    })
    .await;
    for op in &ops {
        assert_eq!(op.kind, OperationKind::Recover);
        assert!(moved.contains(&op.target));
        assert!(
            op.deadline_at_ms.unwrap() > op.created_at_ms,
            "recoveries carry a deadline"
        );
    }
    pool.stop().await;
}

/// A stream that ends because the member broke it — here a second hello, which the gateway
/// refuses — is not a handover: no newer stream of that member exists, so its membership goes
/// at once and its instances move, instead of lingering until the membership TTL (15 s).
pub async fn a_stream_ended_by_its_member_removes_the_membership_at_once(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut broken = pool.member(0, "m-a", Behaviour::Healthy).await;
    let _b = pool.member(1, "m-b", Behaviour::Healthy).await;
    wait_members(db, 2).await;
    pool.register("agent-0").await.unwrap();
    pool.register("agent-1").await.unwrap();
    wait_assignments(&db.store, "both placed", |a| a.len() == 2).await;
    broken
        .send(MemberKind::Hello(proto::host::v1::Hello {
            member: "m-a".into(),
            process_id: "m-a-p1".into(),
            connection_epoch: 1,
            runtime_address: "http://127.0.0.1:7001".into(),
            capacity: 256,
            build_version: "test".into(),
            process_started_at_ms: 0,
            directory_deltas: false,
        }))
        .await;
    assert_eq!(broken.wait_ended().await.code(), Code::InvalidArgument);
    // Well inside the 15 s TTL: removed by the stream's end, not expired.
    wait_for("m-a's membership removed", 3000, || async {
        let (_, members) = db.store.list_members().await.ok()?;
        (!members.iter().any(|m| m.member == "m-a")).then_some(())
    })
    .await;
    wait_assignments(&db.store, "everything on m-b", |a| {
        a.len() == 2 && a.iter().all(|a| a.member == "m-b")
    })
    .await;
    pool.stop().await;
}

/// Members m-a (through replica 0) and m-b (through replica 1), four instances placed with
/// some on m-a: both members' streams, and m-a's instances with their terms.
async fn some_instances_on_m_a(pool: &Pool, db: &TestDb) -> (Member, Member, BTreeMap<String, OwnershipTerm>) {
    let a = pool.member(0, "m-a", Behaviour::Healthy).await;
    let b = pool.member(1, "m-b", Behaviour::Healthy).await;
    wait_members(db, 2).await;
    for name in ["agent-0", "agent-1", "agent-2", "agent-3"] {
        pool.register(name).await.unwrap();
    }
    let placed = wait_assignments(&db.store, "all placed, some on m-a", |a| {
        a.len() == 4 && a.iter().any(|a| a.member == "m-a")
    })
    .await;
    let on_a = placed
        .iter()
        .filter(|a| a.member == "m-a")
        .map(|a| (a.route.clone(), a.term))
        .collect();
    (a, b, on_a)
}

/// Every instance of `on_a` is still m-a's, at its term.
async fn still_on_m_a(db: &TestDb, on_a: &BTreeMap<String, OwnershipTerm>) {
    let after = db.store.list_assignments().await.unwrap();
    for (route, term) in on_a {
        let a = after.iter().find(|a| &a.route == route).unwrap();
        assert_eq!(
            (a.member.as_str(), a.term),
            ("m-a", *term),
            "{route} stayed where it was"
        );
    }
}

/// A member that falls silent to the replica serving it — a one-way network cut, a stalled
/// path — is not gone: the replica ends the stream but keeps the membership for
/// `timing::DETACHED_GRACE`, and the member, attached again through another replica within it,
/// keeps every instance at its term. Before, the replica removed the membership at once and
/// every instance moved, though the member process was healthy throughout.
pub async fn a_member_silent_to_its_replica_keeps_its_instances_by_attaching_elsewhere(db: &TestDb) {
    // A grace longer than the default 0.5 s, so that a loaded test machine attaching slowly
    // cannot fail the test: the code path is the same.
    let grace_ms: i64 = 3_000;
    let pool = Pool::start_with(db, &["--detached-grace-ms", "3000"]).await;
    let (cut, _b, on_a) = some_instances_on_m_a(&pool, db).await;

    cut.go_silent();
    let mut cut = cut;
    assert_eq!(cut.wait_ended().await.code(), Code::DeadlineExceeded);
    // The replica writes the stream's end after closing it: wait for that write.
    let (now_ms, kept) = wait_for("m-a's membership removed or detached", 2000, || async {
        let (now, members) = db.store.list_members().await.ok()?;
        match members.into_iter().find(|m| m.member == "m-a") {
            None => Some((now, None)),
            Some(m) if m.expires_at_ms <= now + grace_ms => Some((now, Some(m))),
            Some(_) => None,
        }
    })
    .await;
    let kept = kept.expect("a silent member's record is kept for the grace, not removed");
    assert!(
        kept.is_live(now_ms),
        "still a member during the grace: {kept:?} at {now_ms} ms"
    );

    let again = pool
        .member_with(1, identity("m-a", "m-a-p1", 2, 256), Behaviour::Healthy)
        .await
        .unwrap();
    let mut again = again;
    again
        .wait_snapshot("m-a's instances at their terms", |s| {
            on_a.iter()
                .all(|(route, term)| s.instances.iter().any(|i| &i.route == route && i.term == term.get()))
        })
        .await;
    // Past the grace the ended stream had: nothing moved.
    wait_until_db_time(&db.store, kept.expires_at_ms + 500).await;
    still_on_m_a(db, &on_a).await;
    pool.stop().await;
}

/// A replica cut off from the database (a partition: no reset, nothing delivered) cannot
/// vouch for its members: past `timing::STORE_CUT_OFF` it closes their streams with
/// UNAVAILABLE and refuses new ones until it reaches the store again, so they attach through
/// a replica that can, and keep every instance at its term. Before, it went on answering
/// their heartbeats, they never moved, and once the others counted the silent replica's
/// members gone (`timing::replica_silence_bound`) every instance moved though every member
/// process was healthy.
pub async fn a_replica_cut_off_from_the_store_lets_its_members_attach_elsewhere(db: &TestDb) {
    let parsed = url::Url::parse(&db.url).expect("the database URL parses");
    let upstream = format!(
        "{}:{}",
        parsed.host_str().expect("a host"),
        parsed.port().unwrap_or(5432)
    );
    let path = testkit::fault::Path::start(upstream.clone())
        .await
        .expect("a path to the database");
    let credentials = tempfile::tempdir().unwrap();
    let dir = credentials.path().to_str().expect("utf-8 path");
    let args = ["--credentials-dir", dir];
    let cut_url = db.url.replacen(&upstream, &path.address.to_string(), 1);
    let a = start_replica_with("gw-a", &cut_url, &args, None).await;
    let b = start_replica_with("gw-b", &db.url, &args, None).await;
    let pool = Pool {
        tokens: Tokens::load(&db.store).await,
        replicas: vec![a, b],
        _credentials: credentials,
    };
    let (cut_off, _b, on_a) = some_instances_on_m_a(&pool, db).await;

    path.cut();
    let cut_at = db.store.now_ms().await.unwrap();
    let mut cut_off = cut_off;
    // Bounded only so that a regression fails instead of hanging.
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), cut_off.wait_ended())
        .await
        .expect("the cut-off replica closes its member's stream");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert!(ended.message().contains("cannot reach the pool's store"), "{ended:?}");
    let refused = pool
        .member_with(0, identity("m-a", "m-a-p1", 2, 256), Behaviour::Healthy)
        .await
        .err()
        .expect("the cut-off replica admits no member");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");

    let mut again = pool
        .member_with(1, identity("m-a", "m-a-p1", 3, 256), Behaviour::Healthy)
        .await
        .unwrap();
    again
        .wait_snapshot("m-a's instances at their terms", |s| {
            on_a.iter()
                .all(|(route, term)| s.instances.iter().any(|i| &i.route == route && i.term == term.get()))
        })
        .await;
    // Past the time the others take a silent replica's members for gone: nothing moved.
    let bound = i64::try_from(proto::timing::replica_silence_bound().as_millis()).unwrap();
    wait_until_db_time(&db.store, cut_at + bound + 2_000).await;
    still_on_m_a(db, &on_a).await;
    path.heal();
    pool.stop().await;
}

/// A member silent past the grace (a hung process) is gone: its instances move.
pub async fn a_member_silent_past_the_grace_is_gone_and_its_instances_move(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut hung = pool.member(0, "m-a", Behaviour::Healthy).await;
    let _b = pool.member(1, "m-b", Behaviour::Healthy).await;
    wait_members(db, 2).await;
    pool.register("agent-0").await.unwrap();
    pool.register("agent-1").await.unwrap();
    wait_assignments(&db.store, "one on each", |a| {
        a.len() == 2 && a.iter().any(|a| a.member == "m-a")
    })
    .await;
    hung.go_silent();
    assert_eq!(hung.wait_ended().await.code(), Code::DeadlineExceeded);
    wait_assignments(&db.store, "everything on m-b", |a| {
        a.len() == 2 && a.iter().all(|a| a.member == "m-b")
    })
    .await;
    pool.stop().await;
}

/// A member cut off from every replica is gone to the gateways, and its instance is reserved
/// for another member, recording the owner it displaced; but the member still serves it (its
/// sidecar only dials it). Attached again as the same process before that reservation was
/// activated, it keeps the session (its snapshot's `keep_routes`) and gets the route back at a
/// higher term: the heal moves nothing. Before, its snapshot dropped the route and it released
/// the session, and the sidecar was handed to the other member.
pub async fn a_member_cut_off_from_every_replica_gets_its_instance_back_when_it_returns(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut cut = pool.member(0, "m-a", Behaviour::Healthy).await;
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    let placed = wait_assignments(&db.store, "agent-0 on m-a", |a| a.len() == 1).await;
    let held = placed[0].term;
    take_up(
        &pool.endpoint(0),
        &pool.tokens.member("m-a"),
        ("m-a", "m-a-p1"),
        held.get(),
    )
    .await;
    wait_assignments(&db.store, "agent-0 active", |a| a[0].phase == AssignmentPhase::Active).await;
    let _b = pool.member(1, "m-b", Behaviour::Mute).await;
    wait_members(db, 2).await;

    cut.go_silent();
    assert_eq!(cut.wait_ended().await.code(), Code::DeadlineExceeded);
    let reserved = wait_assignments(&db.store, "agent-0 reserved for m-b", |a| a[0].member == "m-b").await;
    assert_eq!(
        reserved[0].phase,
        AssignmentPhase::Reserved,
        "m-b never sees the sidecar"
    );
    let displaced = db.store.instance("default/agent-0").await.unwrap().unwrap().displaced;
    assert_eq!(
        displaced.map(|d| (d.member, d.process_id, d.term, d.for_term)),
        Some(("m-a".into(), "m-a-p1".into(), held, reserved[0].term))
    );

    let mut back = pool
        .member_with(1, identity("m-a", "m-a-p1", 2, 256), Behaviour::Mute)
        .await
        .unwrap();
    let snapshot = back
        .wait_snapshot("agent-0 kept, or reserved for m-a again", |s| {
            s.keep_routes.iter().any(|r| r == "default/agent-0")
                || s.instances.iter().any(|i| i.route == "default/agent-0")
        })
        .await;
    assert!(
        snapshot.instances.iter().all(|i| i.term > reserved[0].term.get()),
        "never an older term: {snapshot:?}"
    );
    let returned = wait_assignments(&db.store, "agent-0 reserved for m-a again", |a| a[0].member == "m-a").await;
    assert_eq!(
        (returned[0].process_id.as_str(), returned[0].phase),
        ("m-a-p1", AssignmentPhase::Reserved)
    );
    assert!(returned[0].term > reserved[0].term, "above the reservation it replaces");
    back.wait_snapshot("agent-0 reserved for m-a above m-b's term", |s| {
        s.instances
            .iter()
            .any(|i| i.route == "default/agent-0" && i.term == returned[0].term.get())
    })
    .await;
    // Not one snapshot of the returned process left the route out (which would release it).
    for seen in back.seen() {
        assert!(
            seen.keep_routes.iter().any(|r| r == "default/agent-0")
                || seen.instances.iter().any(|i| i.route == "default/agent-0"),
            "a snapshot that releases agent-0: {seen:?}"
        );
    }
    assert_eq!(
        db.store.instance("default/agent-0").await.unwrap().unwrap().displaced,
        None,
        "given back: the displacement ended"
    );
    pool.stop().await;
}

/// `agent-0` registered and placed on the only member, `m-a`: its assignments, and the status
/// of a member that runs it ACTIVE one term above the placement (a term the store lost).
async fn served_above_its_placement(pool: &Pool, db: &TestDb) -> (Vec<gateway::store::Assignment>, InstanceStatus) {
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    let placed = wait_assignments(&db.store, "agent-0 on m-a", |a| a.len() == 1).await;
    let instance = db.store.instance("default/agent-0").await.unwrap().unwrap();
    let serving = InstanceStatus {
        route: "default/agent-0".into(),
        instance: Some(gateway::pool::instance_ref(&instance)),
        term: placed[0].term.get() + 1,
        phase: InstancePhase::Active as i32,
        workload_pid: 4242,
        ..InstanceStatus::default()
    };
    (placed, serving)
}

/// A store that rolled back (lost commits, an older backup) forgot a term a member serves:
/// the member's first snapshot on a new stream keeps the route instead of leaving it out —
/// which would have it relinquish a session nothing else can take up — because the gateway
/// builds it only after the member said what it hosts.
pub async fn a_term_the_store_forgot_is_kept_from_the_first_snapshot_of_a_stream(db: &TestDb) {
    let pool = Pool::start(db).await;
    let _a = pool.member(0, "m-a", Behaviour::Healthy).await;
    let (placed, serving) = served_above_its_placement(&pool, db).await;
    let instance = db.store.instance("default/agent-0").await.unwrap().unwrap();
    let mut b = Member::attach_hosting(
        &pool.endpoint(0),
        &pool.tokens.member("m-b"),
        identity("m-b", "m-b-p1", 1, 256),
        Behaviour::Mute,
        Some(vec![serving.clone()]),
    )
    .await
    .unwrap();
    let first = b.wait_snapshot("a first snapshot", |_| true).await;
    assert_eq!(first.revision, 1);
    assert_eq!(first.keep_routes, ["default/agent-0"], "{first:?}");
    // A member whose report comes a moment after its hello (a slow link): the first snapshot
    // still waits for it.
    let mut e = Member::attach_hosting(
        &pool.endpoint(0),
        &pool.tokens.member("m-e"),
        identity("m-e", "m-e-p1", 1, 256),
        Behaviour::Mute,
        None,
    )
    .await
    .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await; // the link's delay
    let report = StatusReport {
        applied_revision: 0,
        instances: vec![serving.clone()],
        partial: false,
    };
    e.send(MemberKind::StatusReport(report)).await;
    let first = e.wait_snapshot("a first snapshot", |_| true).await;
    assert_eq!(first.keep_routes, ["default/agent-0"], "{first:?}");
    // Another workload under the route, or a term the store knows, is not kept.
    let stale = InstanceStatus {
        instance: Some(proto::common::v1::InstanceRef {
            uid: "another".into(),
            ..gateway::pool::instance_ref(&instance)
        }),
        ..serving.clone()
    };
    let below = InstanceStatus {
        term: placed[0].term.get(),
        ..serving
    };
    for (name, hosting) in [("m-c", stale), ("m-d", below)] {
        let mut m = Member::attach_hosting(
            &pool.endpoint(0),
            &pool.tokens.member(name),
            identity(name, &format!("{name}-p1"), 1, 256),
            Behaviour::Mute,
            Some(vec![hosting]),
        )
        .await
        .unwrap();
        let first = m.wait_snapshot("a first snapshot", |_| true).await;
        assert!(first.keep_routes.is_empty(), "{name}: {first:?}");
    }
    pool.stop().await;
}

/// A store that lost a reservation gives the route back only to the member process the
/// route's own sidecar names as its fence's holder, once that process reports the term: a
/// member (a compromised one, or one mistaken) that reports the same term for another member's
/// instance pulls nothing, and its status does not stand for the route's.
pub async fn a_lost_reservation_goes_back_to_the_member_the_sidecar_names_not_to_a_claimant(db: &TestDb) {
    let pool = Pool::start(db).await;
    let a = pool.member(0, "m-a", Behaviour::Mute).await;
    // m-a took agent-0 up one term above its placement (a reservation the store lost since).
    let (placed, serving) = served_above_its_placement(&pool, db).await;
    take_up(
        &pool.endpoint(0),
        &pool.tokens.member("m-a"),
        ("m-a", "m-a-p1"),
        placed[0].term.get(),
    )
    .await;
    wait_assignments(&db.store, "agent-0 active on m-a", |a| {
        a[0].phase == AssignmentPhase::Active
    })
    .await;
    let b = pool.member(1, "m-b", Behaviour::Mute).await;
    wait_members(db, 2).await;
    // Its sidecar registers that fence, naming m-a's process.
    let mut fenced = crate::cluster::registration("default", "agent-0", "uid-agent-0");
    fenced.fence_term = serving.term;
    (fenced.fence_member, fenced.fence_process_id) = ("m-a".into(), "m-a-p1".into());
    let mut registry = InstanceRegistryClient::new(channel(&pool.endpoint(1)).await);
    registry
        .register(with_token(fenced, &pool.tokens.instance("agent-0")))
        .await
        .unwrap();
    // Both say they run it at that term, at once and in answer to every snapshot, as members
    // do: m-b (the claimant) first.
    let report = StatusReport {
        applied_revision: 0,
        instances: vec![serving.clone()],
        partial: false,
    };
    let answering = |member: Member| {
        let report = report.clone();
        tokio::spawn(async move {
            let mut snapshots = member.snapshots.clone();
            loop {
                member.send(MemberKind::StatusReport(report.clone())).await;
                if snapshots.changed().await.is_err() {
                    return;
                }
            }
        })
    };
    let answering = [answering(b), answering(a)];
    let given = wait_assignments(&db.store, "agent-0 reserved above the fence", |a| {
        a.iter()
            .any(|a| a.route == "default/agent-0" && a.term.get() > serving.term)
    })
    .await;
    assert_eq!(
        (given[0].member.as_str(), given[0].term.get()),
        ("m-a", serving.term + 1),
        "the member the sidecar named, not the one that claimed it"
    );
    let reports = db.store.list_reports().await.unwrap();
    assert!(
        !reports.iter().any(|r| r.member == "m-b"),
        "m-b's claim stood for the route: {reports:?}"
    );
    answering.iter().for_each(tokio::task::JoinHandle::abort);
    pool.stop().await;
}

/// The store lost the statuses a member reported (lost commits, a restore, an emptied store)
/// while its stream lived on: its next report is written again, though nothing in it changed —
/// before, the stream only handed over what changed, and the coordinator never saw what its
/// owner runs (which is how it tells a lost reservation from a failed one).
pub async fn statuses_the_store_lost_are_written_again_with_the_next_report(db: &TestDb) {
    use sqlx::Connection as _;
    let pool = Pool::start(db).await;
    let mut member = pool
        .member_with(0, identity("m-a", "m-a-p1", 1, 256), Behaviour::Mute)
        .await
        .unwrap();
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    wait_assignments(&db.store, "agent-0 on m-a", |a| a.len() == 1).await;
    let snapshot = member
        .wait_snapshot("agent-0 reserved for m-a", |s| s.instances.len() == 1)
        .await;
    let owned = &snapshot.instances[0];
    let report = StatusReport {
        applied_revision: snapshot.revision,
        instances: vec![InstanceStatus {
            route: owned.route.clone(),
            instance: owned.instance.clone(),
            term: owned.term,
            phase: InstancePhase::Starting as i32,
            workload_pid: 4242,
            ..InstanceStatus::default()
        }],
        partial: false,
    };
    let stored = || async {
        let reports = db.store.list_reports().await.ok()?;
        reports.iter().any(|r| r.route == "default/agent-0").then_some(())
    };
    member.send(MemberKind::StatusReport(report.clone())).await;
    wait_for("the report stored", 1000, stored).await;
    // The store loses it, and its write counts go back (as a restore's would).
    let mut raw = db.raw().await;
    for sql in ["DELETE FROM instance_reports", "UPDATE pool_writes SET writes = 0"] {
        sqlx::query(sql).execute(&mut raw).await.unwrap();
    }
    let _ = raw.close().await;
    // The member reports the same again, as it does every few seconds.
    let mut polls = 0;
    wait_for("the same report stored again", 2000, || {
        polls += 1;
        let (member, report, stored) = (&member, &report, &stored);
        async move {
            if polls % 20 == 1 {
                member.send(MemberKind::StatusReport(report.clone())).await;
            }
            stored().await
        }
    })
    .await;
    pool.stop().await;
}

/// The store rolled back to an older stream's membership record of a live member (lost
/// commits): the stream serving it ends ("attach again"), so that the member's next stream
/// writes a record that its replica refreshes — instead of a healthy stream under a record
/// nobody refreshes, which lapses and leaves the member counted gone for good.
pub async fn a_stream_whose_membership_record_the_store_lost_ends_and_the_member_attaches_again(db: &TestDb) {
    use sqlx::Connection as _;
    let pool = Pool::start(db).await;
    let mut member = pool
        .member_with(0, identity("m-a", "m-a-p1", 2, 256), Behaviour::Healthy)
        .await
        .unwrap();
    wait_members(db, 1).await;
    let mut raw = db.raw().await;
    sqlx::query("UPDATE members SET epoch = 1 WHERE member = 'm-a'")
        .execute(&mut raw)
        .await
        .unwrap();
    let _ = raw.close().await;
    // Bounded only so that a regression fails instead of hanging.
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), member.wait_ended())
        .await
        .expect("the stream under a lost record ends");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert!(ended.message().contains("attach again"), "{ended:?}");
    // Attached again (a newer epoch), the member counts as live.
    let _again = pool
        .member_with(0, identity("m-a", "m-a-p1", 3, 256), Behaviour::Healthy)
        .await
        .unwrap();
    let (now_ms, record) = db.store.member("m-a").await.unwrap();
    let record = record.expect("a record");
    assert_eq!(record.epoch, 3);
    assert!(record.is_live(now_ms));
    pool.stop().await;
}

pub async fn newer_epochs_supersede_and_another_process_waits_for_the_live_one_to_end(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut first = pool
        .member_with(0, identity("m", "p1", 1, 256), Behaviour::Healthy)
        .await
        .unwrap();
    let second = pool
        .member_with(0, identity("m", "p1", 2, 256), Behaviour::Healthy)
        .await
        .unwrap();
    assert_eq!(
        first.wait_ended().await.code(),
        Code::Aborted,
        "a newer epoch supersedes"
    );
    let refused = |attempt: Result<Member, tonic::Status>| async move {
        match attempt {
            Ok(mut m) => m.wait_ended().await,
            Err(status) => status,
        }
    };
    let delayed = pool
        .member_with(0, identity("m", "p1", 1, 256), Behaviour::Healthy)
        .await;
    let delayed = refused(delayed).await;
    assert_eq!(delayed.code(), Code::FailedPrecondition, "{delayed:?}");
    // Another process of the member, on either replica, waits while p1's stream lives.
    for replica in [0, 1] {
        let early = pool
            .member_with(replica, identity("m", "p2", 1, 256), Behaviour::Healthy)
            .await;
        let early = refused(early).await;
        assert_eq!(early.code(), Code::FailedPrecondition, "{early:?}");
    }
    assert!(second.ended.borrow().is_none(), "{:?}", second.ended.borrow());
    // p1's stream ends (its record goes with it): p2 is admitted.
    second.kill();
    let _third = wait_for("p2 admitted once p1's stream ended", 3000, || async {
        pool.member_with(1, identity("m", "p2", 2, 256), Behaviour::Healthy)
            .await
            .ok()
    })
    .await;
    // Now p1 waits for p2.
    let back = pool
        .member_with(0, identity("m", "p1", 3, 256), Behaviour::Healthy)
        .await;
    assert_eq!(refused(back).await.code(), Code::FailedPrecondition);
    wait_for("the record to name p2", 500, || async {
        let (_, members) = db.store.list_members().await.ok()?;
        (members.len() == 1 && members[0].process_id == "p2").then_some(())
    })
    .await;
    pool.stop().await;
}

/// Whoever holds a member's token and makes up a process id attaches under the member's
/// name: while the member's process lives, that is refused on every replica and the live
/// stream goes on (before, it was told another process took its name, and its supervisor
/// exited for good).
pub async fn a_stranger_with_a_members_token_cannot_end_its_live_stream(db: &TestDb) {
    let pool = Pool::start(db).await;
    let m = pool.member(0, "m-a", Behaviour::Healthy).await;
    wait_members(db, 1).await;
    for replica in [1, 0] {
        let stranger = pool
            .member_with(replica, identity("m-a", "stranger", 7, 256), Behaviour::Healthy)
            .await;
        let refused = match stranger {
            Ok(mut s) => s.wait_ended().await,
            Err(status) => status,
        };
        assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    }
    // Several pool reads and a membership refresh later, the member's stream is still open.
    tokio::time::sleep(proto::timing::MEMBERSHIP_REFRESH + std::time::Duration::from_millis(500)).await;
    assert!(m.ended.borrow().is_none(), "{:?}", m.ended.borrow());
    let (now, record) = db.store.member("m-a").await.unwrap();
    let record = record.unwrap();
    assert_eq!((record.process_id.as_str(), record.epoch), ("m-a-p1", 1));
    assert!(record.is_live(now));
    pool.stop().await;
}

/// Every member's route directory names every route's owner process: a member that names
/// its own name with another member's process id gets no grant of that member's reserved
/// term, and the rightful owner still gets it (single use was not spent by the taker).
pub async fn a_member_naming_another_members_process_gets_no_grant(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut m_a = pool.member(0, "m-a", Behaviour::Mute).await;
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    let owned = m_a
        .wait_snapshot("agent-0 reserved", |s| s.instances.len() == 1)
        .await
        .instances[0]
        .clone();
    let mut m_b = pool.member(1, "m-b", Behaviour::Mute).await;
    let read = m_b
        .wait_snapshot("agent-0 in m-b's directory", |s| {
            s.directory.iter().any(|d| d.route == owned.route)
        })
        .await
        .directory
        .into_iter()
        .find(|d| d.route == owned.route)
        .unwrap();
    assert_eq!(read.process_id, "m-a-p1");
    let mut recovery = SupervisorRecoveryClient::new(channel(&pool.endpoint(1)).await);
    let taking = IssueGrantRequest {
        route: read.route.clone(),
        term: read.term,
        member: "m-b".into(),
        process_id: read.process_id.clone(),
    };
    let refused = recovery
        .issue_grant(with_token(taking, &pool.tokens.member("m-b")))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let rightful = IssueGrantRequest {
        route: owned.route.clone(),
        term: owned.term,
        member: "m-a".into(),
        process_id: "m-a-p1".into(),
    };
    let grant = recovery
        .issue_grant(auth(&pool, rightful))
        .await
        .expect("the rightful owner still gets its grant")
        .into_inner();
    // And only the owner completes its activation.
    let activate = ActivateRequest {
        receipt: Some(receipt(&grant, owned.term, 0, 4242)),
        grant: grant.grant.clone(),
    };
    let refused = recovery
        .activate(with_token(activate.clone(), &pool.tokens.member("m-b")))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    recovery.activate(auth(&pool, activate)).await.unwrap();
    pool.stop().await;
}

pub async fn reports_count_only_after_the_installing_revision_is_acked(db: &TestDb) {
    let pool = Pool::start(db).await;
    // A mute member acks but never reports; the test reports by hand.
    let mut m = pool.member(0, "m-a", Behaviour::Mute).await;
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    let snapshot = m.wait_snapshot("the instance", |s| s.instances.len() == 1).await;
    let owned = snapshot.instances[0].clone();
    let status = |term| proto::host::v1::InstanceStatus {
        route: owned.route.clone(),
        term,
        phase: proto::common::v1::InstancePhase::Active as i32,
        ..Default::default()
    };
    // Acks of unsent revisions and regressing acks are dropped; a report
    // claiming a revision beyond what was acknowledged is not attributed.
    m.send(MemberKind::Ack(Ack {
        revision: snapshot.revision + 100,
    }))
    .await;
    m.send(MemberKind::Ack(Ack { revision: 0 })).await;
    m.send(MemberKind::StatusReport(StatusReport {
        instances: vec![status(owned.term + 1)],
        applied_revision: snapshot.revision,
        partial: false,
    }))
    .await;
    m.send(MemberKind::StatusReport(StatusReport {
        instances: vec![status(owned.term)],
        applied_revision: snapshot.revision,
        partial: false,
    }))
    .await;
    // The first report may be recorded on its own first: it hosts nothing at the installed
    // term, so the route reads ABSENT until the second report arrives.
    let reports = wait_for("the report of the installed term", 500, || async {
        let reports = db.store.list_reports().await.ok()?;
        reports
            .iter()
            .any(|r| r.phase != ReportPhase::Absent)
            .then_some(reports)
    })
    .await;
    assert_eq!(reports.len(), 1, "one row per route: nothing at term + 1");
    assert_eq!(
        (reports[0].term, reports[0].phase.as_str()),
        (OwnershipTerm::new(owned.term), "INSTANCE_PHASE_ACTIVE")
    );
    assert_eq!(reports[0].member, "m-a");
    pool.stop().await;
}

pub async fn only_the_coordinator_writes_assignments(db: &TestDb) {
    let pool = Pool::start(db).await;
    let _a = pool.member(0, "m-a", Behaviour::Healthy).await;
    let _b = pool.member(1, "m-b", Behaviour::Healthy).await;
    wait_members(db, 2).await;
    for i in 0..4 {
        pool.register(&format!("agent-{i}")).await.unwrap();
    }
    wait_assignments(&db.store, "four placed", |a| a.len() == 4).await;
    let history = db.store.lease_history().await.unwrap();
    let coordinator_terms: BTreeMap<gateway::store::CoordinatorTerm, String> =
        history.iter().map(|t| (t.term, t.holder.clone())).collect();
    let lease = db.store.read_lease().await.unwrap().unwrap();
    for a in db.store.list_assignments().await.unwrap() {
        assert_eq!(
            a.coordinator_term, lease.term,
            "written under the current coordinator term"
        );
        assert!(coordinator_terms[&a.coordinator_term] == lease.holder);
    }
    // Stop the coordinator: the other replica takes over with a new term and
    // its writes carry that term.
    let coordinator = lease.holder.split('/').next().unwrap().to_owned();
    let mut pool = pool;
    let index = pool.replicas.iter().position(|r| r.name == coordinator).unwrap();
    pool.replicas.remove(index).stop().await;
    let next = wait_for("a new coordinator", 1000, || async {
        let l = db.store.read_lease().await.ok()??;
        (l.is_live() && l.term > lease.term).then_some(l)
    })
    .await;
    assert!(!next.holder.starts_with(&coordinator));
    pool.register("agent-9")
        .await
        .unwrap_or_else(|_| panic!("registry on the survivor"));
    let placed = wait_assignments(&db.store, "agent-9 placed", |a| a.len() == 5).await;
    let new = placed.iter().find(|a| a.route == "default/agent-9").unwrap();
    assert_eq!(new.coordinator_term, next.term);
    pool.stop().await;
}

pub async fn coordinator_failover_adopts_a_recovery_without_extending_its_deadline(db: &TestDb) {
    let pool = Pool::start(db).await;
    let doomed = pool.member(0, "m-a", Behaviour::Healthy).await;
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    wait_assignments(&db.store, "placed on m-a", |a| a.len() == 1 && a[0].member == "m-a").await;
    // The only other member never reports, so the recovery stays open.
    let _mute = pool.member(1, "m-b", Behaviour::Mute).await;
    wait_members(db, 2).await;
    doomed.kill();
    let moved = wait_assignments(&db.store, "moved to m-b", |a| a[0].member == "m-b").await;
    let op = wait_for("an open recovery", 500, || async {
        let ops = db.store.list_operations().await.ok()?;
        ops.into_iter().find(|o| o.phase == OperationPhase::Running)
    })
    .await;

    let lease = db.store.read_lease().await.unwrap().unwrap();
    let coordinator = lease.holder.split('/').next().unwrap().to_owned();
    let mut pool = pool;
    let index = pool.replicas.iter().position(|r| r.name == coordinator).unwrap();
    pool.replicas.remove(index).stop().await;
    wait_for("a new coordinator", 1000, || async {
        let l = db.store.read_lease().await.ok()??;
        (l.is_live() && l.term > lease.term).then_some(())
    })
    .await;
    // Give the successor views to act on, then check it adopted, not redid.
    let now = db.store.now_ms().await.unwrap();
    crate::support::wait_until_db_time(&db.store, now + 1000).await;
    let ops = db.store.list_operations().await.unwrap();
    assert_eq!(ops.len(), 1, "no second recovery was launched");
    assert_eq!(ops[0].id, op.id);
    assert_eq!(ops[0].deadline_at_ms, op.deadline_at_ms, "deadline not extended");
    assert_eq!(ops[0].attempts, op.attempts);
    let now = db.store.list_assignments().await.unwrap();
    assert_eq!(
        (now[0].member.as_str(), now[0].term),
        ("m-b", moved[0].term),
        "nothing relaunched"
    );
    pool.stop().await;
}

pub async fn a_member_at_capacity_is_refused_with_the_reason(db: &TestDb) {
    let pool = Pool::start(db).await;
    let _m = pool
        .member_with(0, identity("m-a", "p1", 1, 1), Behaviour::Healthy)
        .await
        .unwrap();
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    wait_assignments(&db.store, "the first instance placed", |a| a.len() == 1).await;
    let refused = pool.register("agent-1").await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("at capacity") && refused.message().contains("m-a"),
        "{}",
        refused.message()
    );
    pool.stop().await;
}

/// A StatefulSet Pod deleted and recreated: same route, new Pod UID. The new workload is
/// placed anew at the next term (not held to the old assignment), and the old UID can
/// neither withdraw it nor report for it.
pub async fn a_pod_recreated_under_its_name_is_placed_anew_and_the_old_uid_changes_nothing(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut m = pool.member(0, "m-a", Behaviour::Healthy).await;
    wait_members(db, 1).await;
    let endpoint = pool.endpoint(1);
    register_as(&endpoint, &pool.tokens.instance("web-0"), "web-0", "uid-old")
        .await
        .unwrap();
    wait_assignments(&db.store, "the first Pod placed", |a| {
        a.len() == 1 && a[0].term.get() == 1 && a[0].generation == 1
    })
    .await;

    let again = register_as(&endpoint, &pool.tokens.instance("web-0"), "web-0", "uid-new")
        .await
        .unwrap();
    let instance = again.instance.unwrap();
    assert_eq!((instance.uid.as_str(), instance.generation), ("uid-new", 2));
    assert!(
        again.owner.as_ref().is_none_or(|o| o.term >= 2),
        "the old workload's owner is not offered to the new one: {:?}",
        again.owner
    );
    let placed = wait_assignments(&db.store, "the new Pod placed anew at the next term", |a| {
        a.len() == 1 && a[0].generation == 2
    })
    .await;
    assert_eq!(
        (placed[0].term.get(), placed[0].placed_term.get(), placed[0].phase),
        (2, 2, AssignmentPhase::Reserved)
    );
    let snapshot = m
        .wait_snapshot("the new workload at term 2", |s| {
            s.instances.len() == 1 && s.instances[0].term == 2
        })
        .await;
    assert_eq!(
        snapshot.instances[0]
            .instance
            .as_ref()
            .map(|i| (i.uid.as_str(), i.generation)),
        Some(("uid-new", 2))
    );

    // The old Pod's sidecar, late: refused or a no-op, never a withdrawal.
    let mut registry = InstanceRegistryClient::new(channel(&endpoint).await);
    let stale = || Some(instance_ref("web-0", "uid-old"));
    let failed = RecoveryFailedRequest {
        route: "default/web-0".into(),
        instance: stale(),
        reason: "deadline".into(),
        ..RecoveryFailedRequest::default()
    };
    let refused = registry
        .report_recovery_failed(with_token(failed, &pool.tokens.instance("web-0")))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let deregister = DeregisterRequest {
        route: "default/web-0".into(),
        instance: stale(),
        reason: "workload ended".into(),
    };
    registry
        .deregister(with_token(deregister, &pool.tokens.instance("web-0")))
        .await
        .unwrap();
    let refused = register_as(&endpoint, &pool.tokens.instance("web-0"), "web-0", "uid-old")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let instance = db.store.instance("default/web-0").await.unwrap().unwrap();
    assert_eq!(
        (instance.uid.as_str(), instance.generation, instance.withdrawn),
        ("uid-new", 2, false)
    );
    pool.stop().await;
}

/// Deregister a workload `default/<name>` with Pod UID `uid`.
async fn deregister(pool: &Pool, name: &str, uid: &str) {
    let mut registry = InstanceRegistryClient::new(channel(&pool.endpoint(1)).await);
    let request = DeregisterRequest {
        route: format!("default/{name}"),
        instance: Some(instance_ref(name, uid)),
        reason: "workload ended".into(),
    };
    registry
        .deregister(with_token(request, &pool.tokens.instance(name)))
        .await
        .unwrap();
}

/// A withdrawn instance leaves its live owner at once: out of its snapshot (released, not
/// stopped), no longer holding its capacity, and the route's terms never repeat.
pub async fn a_withdrawn_instance_leaves_its_live_owner_at_once(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut m = pool
        .member_with(0, identity("m-a", "p1", 1, 1), Behaviour::Healthy)
        .await
        .unwrap();
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    wait_assignments(&db.store, "agent-0 placed", |a| a.len() == 1).await;
    m.wait_snapshot("agent-0 owned", |s| s.instances.len() == 1).await;

    deregister(&pool, "agent-0", "uid-agent-0").await;
    wait_assignments(
        &db.store,
        "agent-0's assignment dropped while m-a lives",
        <[_]>::is_empty,
    )
    .await;
    let snapshot = m.wait_snapshot("agent-0 gone", |s| s.instances.is_empty()).await;
    assert!(snapshot.stop_routes.is_empty(), "released, not stopped: {snapshot:?}");
    assert!(snapshot.directory.is_empty());

    // m-a (capacity 1) takes the next instance.
    pool.register("agent-1")
        .await
        .expect("a withdrawn instance holds no capacity");
    wait_assignments(&db.store, "agent-1 placed on m-a", |a| {
        a.len() == 1 && a[0].route == "default/agent-1" && a[0].member == "m-a"
    })
    .await;

    // A new workload under agent-0's route starts above the term it had.
    deregister(&pool, "agent-1", "uid-agent-1").await;
    register_as(
        &pool.endpoint(1),
        &pool.tokens.instance("agent-0"),
        "agent-0",
        "uid-agent-0-again",
    )
    .await
    .unwrap();
    let placed = wait_assignments(&db.store, "agent-0 placed again", |a| {
        a.len() == 1 && a[0].route == "default/agent-0"
    })
    .await;
    assert_eq!(
        (placed[0].term.get(), placed[0].placed_term.get()),
        (2, 2),
        "never term 1 again"
    );
    pool.stop().await;
}

pub async fn streams_without_a_valid_token_or_identity_are_refused(db: &TestDb) {
    let pool = Pool::start(db).await;
    let id = || identity("m-a", "p1", 1, 256);
    let endpoint = pool.endpoint(0);
    for bad in ["", "not-a-jwt", pool.tokens.instance("agent-0").as_str()] {
        let refused = match Member::attach(&endpoint, bad, id(), Behaviour::Healthy).await {
            Ok(mut m) => m.wait_ended().await,
            Err(status) => status,
        };
        assert_eq!(refused.code(), Code::Unauthenticated, "token {bad:.10}: {refused:?}");
    }
    // A member's credential attaches only under its own name: never as another member
    // (which would supersede it), whatever process id it claims.
    let refused = match Member::attach(&endpoint, &pool.tokens.member("m-b"), id(), Behaviour::Healthy).await {
        Ok(mut m) => m.wait_ended().await,
        Err(status) => status,
    };
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let nameless = identity("", "p1", 1, 256);
    let refused = match Member::attach(&endpoint, &pool.tokens.member("m-a"), nameless, Behaviour::Healthy).await {
        Ok(mut m) => m.wait_ended().await,
        Err(status) => status,
    };
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("OPENSHELL_SUPERVISOR_POOL_MEMBER"),
        "{}",
        refused.message()
    );
    let (_, members) = db.store.list_members().await.unwrap();
    assert!(members.is_empty(), "refused streams leave no membership");
    pool.stop().await;
}

/// A request with member m-a's token.
fn auth<T>(pool: &Pool, message: T) -> tonic::Request<T> {
    with_token(message, &pool.tokens.member("m-a"))
}

pub async fn grants_are_single_use_and_activation_checks_receipt_and_process(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut m = pool.member(0, "m-a", Behaviour::Mute).await;
    wait_members(db, 1).await;
    pool.register("agent-0").await.unwrap();
    let snapshot = m
        .wait_snapshot("the reserved instance", |s| s.instances.len() == 1)
        .await;
    let owned = &snapshot.instances[0];
    assert_eq!(owned.phase, WirePhase::Reserved as i32);

    let mut recovery = SupervisorRecoveryClient::new(channel(&pool.endpoint(1)).await);
    let ask = |process: &str, term: u64| IssueGrantRequest {
        route: owned.route.clone(),
        term,
        member: "m-a".into(),
        process_id: process.into(),
    };
    let code = |r: Result<tonic::Response<IssueGrantResponse>, tonic::Status>| r.unwrap_err().code();
    // Another member's credential never gets m-a's grant (a member acts only for itself).
    let as_m_b = |message| with_token(message, &pool.tokens.member("m-b"));
    assert_eq!(
        code(recovery.issue_grant(as_m_b(ask("m-a-p1", owned.term))).await),
        Code::PermissionDenied
    );
    assert_eq!(
        code(recovery.issue_grant(auth(&pool, ask("m-a-other", owned.term))).await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(recovery.issue_grant(auth(&pool, ask("m-a-p1", owned.term + 1))).await),
        Code::FailedPrecondition
    );
    let grant = recovery
        .issue_grant(auth(&pool, ask("m-a-p1", owned.term)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        code(recovery.issue_grant(auth(&pool, ask("m-a-p1", owned.term))).await),
        Code::FailedPrecondition,
        "single use, even when the first answer was lost"
    );

    // The grant is a real JWS for the sidecar audience.
    let bundle = proto::trust::TrustBundle::from_jwks(
        recovery
            .trust_bundle(auth(&pool, TrustBundleRequest {}))
            .await
            .unwrap()
            .into_inner()
            .jwks_json
            .as_bytes(),
    )
    .unwrap();
    let claims: Claims<GrantClaims> = bundle
        .verify(&grant.grant, &Expectation::kind(Kind::RecoveryGrant, DEFAULT_ISSUER))
        .unwrap();
    assert_eq!(
        (claims.extra.term, claims.extra.process_id.as_str()),
        (owned.term, "m-a-p1")
    );

    let activate = |receipt: Receipt, grant: &str| ActivateRequest {
        receipt: Some(receipt),
        grant: grant.to_owned(),
    };
    let mut forged = receipt(&grant, owned.term, 0, 4242);
    forged.mac[0] ^= 1;
    let err = recovery
        .activate(auth(&pool, activate(forged, &grant.grant)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = recovery
        .activate(auth(&pool, activate(receipt(&grant, owned.term, 0, 4242), "x.y.z")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "receipt bound to another grant");
    // Only the member the grant was issued to completes the activation.
    let err = recovery
        .activate(with_token(
            activate(receipt(&grant, owned.term, 0, 4242), &grant.grant),
            &pool.tokens.member("m-b"),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    let proof = recovery
        .activate(auth(
            &pool,
            activate(receipt(&grant, owned.term, 0, 4242), &grant.grant),
        ))
        .await
        .unwrap()
        .into_inner()
        .activation
        .unwrap();
    let proven: Claims<ProofClaims> = bundle
        .verify(&proof.proof, &Expectation::kind(Kind::ActivationProof, DEFAULT_ISSUER))
        .unwrap();
    assert_eq!(
        (proven.extra.grant_id.as_str(), proven.extra.term),
        (grant.grant_id.as_str(), owned.term)
    );
    let err = recovery
        .activate(auth(
            &pool,
            activate(receipt(&grant, owned.term, 0, 4242), &grant.grant),
        ))
        .await
        .unwrap_err();
    assert!(err.message().contains("already activated"), "{err:?}");
    let active = m
        .wait_snapshot("the active term", |s| {
            s.instances.iter().any(|o| o.phase == WirePhase::Active as i32)
        })
        .await;
    assert_eq!(active.instances[0].term, owned.term);

    // The owner dies; the next owner must present the same workload process.
    let mut next = pool.member(1, "m-b", Behaviour::Mute).await;
    wait_members(db, 2).await;
    m.kill();
    let moved = next
        .wait_snapshot("the moved instance", |s| s.instances.len() == 1)
        .await;
    let term = moved.instances[0].term;
    assert_eq!(term, owned.term + 1);
    let grant = recovery
        .issue_grant(with_token(
            IssueGrantRequest {
                member: "m-b".into(),
                ..ask("m-b-p1", term)
            },
            &pool.tokens.member("m-b"),
        ))
        .await
        .unwrap()
        .into_inner();
    let err = recovery
        .activate(with_token(
            activate(receipt(&grant, term, owned.term, 9999), &grant.grant),
            &pool.tokens.member("m-b"),
        ))
        .await
        .unwrap_err();
    assert!(err.message().contains("workload identity differs"), "{err:?}");
    recovery
        .activate(with_token(
            activate(receipt(&grant, term, owned.term, 4242), &grant.grant),
            &pool.tokens.member("m-b"),
        ))
        .await
        .unwrap();
    pool.stop().await;
}

/// Two replicas: `gw-a` (the coordinator) and `gw-b`, which the test can pause; members
/// `m-a` on `gw-b` and `m-b` on `gw-a`, one instance each. Returns the pool, the tokens, m-a's
/// stream, its route and term.
struct PausedPool {
    a: Replica,
    b: Pausable,
    tokens: Tokens,
    _others: Vec<Member>,
    _credentials: tempfile::TempDir,
}

impl PausedPool {
    async fn start(db: &TestDb) -> (Self, Member, gateway::store::Assignment) {
        let credentials = tempfile::tempdir().unwrap();
        let a = start_replica("gw-a", &db.url, credentials.path()).await;
        // Tokens are delivered by the coordinator: gw-a holds the lease, gw-b never will.
        let tokens = Tokens::load(&db.store).await;
        let b = start_pausable_replica("gw-b", &db.url, credentials.path()).await;
        let on_b = Member::attach(
            &b.replica.endpoint(),
            &tokens.member("m-a"),
            identity("m-a", "m-a-p1", 1, 256),
            Behaviour::Healthy,
        )
        .await
        .unwrap();
        let on_a = Member::attach(
            &a.endpoint(),
            &tokens.member("m-b"),
            identity("m-b", "m-b-p1", 1, 256),
            Behaviour::Healthy,
        )
        .await
        .unwrap();
        wait_members(db, 2).await;
        for name in ["agent-0", "agent-1"] {
            register(&a.endpoint(), &tokens.instance(name), name).await.unwrap();
        }
        let placed = wait_assignments(&db.store, "one instance per member", |x| {
            x.len() == 2 && per_member(x).len() == 2
        })
        .await;
        let held = placed.into_iter().find(|x| x.member == "m-a").unwrap();
        let pool = Self {
            a,
            b,
            tokens,
            _others: vec![on_a],
            _credentials: credentials,
        };
        (pool, on_b, held)
    }

    /// Resume gw-b and wait until it ended every member stream it held.
    async fn resume_until_streams_ended(&mut self) {
        self.b.resume();
        let b = &self.b;
        wait_for("gw-b to end the streams it held", 2000, || async {
            (b.metric("member_streams").await == Some(0)).then_some(())
        })
        .await;
    }

    async fn stop(self) {
        self.b.stop().await;
        self.a.stop().await;
    }
}

async fn wait_recovery_succeeded(db: &TestDb, route: &str) -> gateway::store::Operation {
    wait_for("the recovery to succeed", 2000, || async {
        let ops = db.store.list_operations().await.ok()?;
        ops.into_iter()
            .find(|o| o.kind == OperationKind::Recover && o.target == route && o.phase == OperationPhase::Succeeded)
    })
    .await
}

/// Reliability item 2: the replica holding a member's stream is paused when the member's
/// process dies; the restarted process (same member name) attaches to another replica,
/// refused until the other replicas expired the dead predecessor's record (its replica's
/// silence), then admitted. The instance moves once, at term + 1, to a live member; when the
/// paused replica resumes, its dead stream ends, not the new one.
pub async fn a_restarted_member_supersedes_its_dead_predecessor_behind_a_paused_replica(db: &TestDb) {
    let (mut pool, old, held) = PausedPool::start(db).await;
    pool.b.pause().await;
    old.kill();
    // Refused while the dead predecessor's record lives; admitted once the other replicas
    // expired it for its paused replica's silence (well before the record's TTL).
    let mut epoch = 0;
    let mut new = wait_for("the restarted process admitted", 15_000, || {
        epoch += 1;
        let (endpoint, token) = (pool.a.endpoint(), pool.tokens.member("m-a"));
        async move {
            let attempt = Member::attach(
                &endpoint,
                &token,
                identity("m-a", "m-a-p2", epoch, 256),
                Behaviour::Healthy,
            );
            match attempt.await {
                Ok(member) => Some(member),
                Err(refused) => {
                    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
                    None
                }
            }
        }
    })
    .await;
    let moved = wait_assignments(&db.store, "m-a's instance moved", |x| {
        x.iter().any(|y| y.route == held.route && y.term > held.term)
    })
    .await;
    let moved = moved.into_iter().find(|x| x.route == held.route).unwrap();
    assert_eq!(
        (moved.member.as_str(), moved.term),
        ("m-b", held.term.next()),
        "to the other live member, at term + 1"
    );
    // A snapshot from a view read after the move, so after the new process's admission:
    // that view did not end its stream.
    new.wait_snapshot("the directory names the moved route at its new term", |s| {
        s.directory
            .iter()
            .any(|d| d.route == held.route && d.term == moved.term.get())
    })
    .await;
    assert!(new.ended.borrow().is_none(), "{:?}", new.ended.borrow());
    let op = wait_recovery_succeeded(db, &held.route).await;
    assert_eq!((op.attempts, op.moves), (1, 1), "one decision, one term: {op:?}");

    pool.resume_until_streams_ended().await;
    let (now, record) = db.store.member("m-a").await.unwrap();
    let record = record.expect("m-a's record");
    assert_eq!(record.process_id, "m-a-p2", "the newer process keeps the name");
    assert!(record.is_live(now));
    assert!(new.ended.borrow().is_none(), "{:?}", new.ended.borrow());
    let after = db.store.list_assignments().await.unwrap();
    let after = after.iter().find(|x| x.route == held.route).unwrap();
    assert_eq!((after.member.as_str(), after.term), ("m-b", held.term.next()));
    pool.stop().await;
}

/// Reliability item 3: a member dies while the replica holding its stream is paused. The
/// other replicas notice that replica's silence and expire the member (it did not attach
/// elsewhere), so its instance moves before the record's TTL would have run out; the paused
/// replica, once it resumes, does not write the dead member back as live.
pub async fn a_member_that_dies_behind_a_paused_replica_is_recovered_by_the_others(db: &TestDb) {
    let (mut pool, doomed, held) = PausedPool::start(db).await;
    pool.b.pause().await;
    // What the paused replica last wrote: the record would live until then by its TTL.
    let (_, record) = db.store.member("m-a").await.unwrap();
    let ttl_end = record.expect("m-a's record").expires_at_ms;
    doomed.kill();
    let moved = wait_assignments(&db.store, "m-a's instance moved", |x| {
        x.iter().any(|y| y.route == held.route && y.term > held.term)
    })
    .await;
    let moved = moved.into_iter().find(|x| x.route == held.route).unwrap();
    assert_eq!((moved.member.as_str(), moved.term), ("m-b", held.term.next()));
    assert!(
        moved.updated_at_ms < ttl_end,
        "moved while the paused replica's record of the dead member was still within its TTL \
         ({} vs {ttl_end})",
        moved.updated_at_ms
    );
    let (now, record) = db.store.member("m-a").await.unwrap();
    assert!(!record.expect("m-a's record").is_live(now), "expired by the others");

    pool.resume_until_streams_ended().await;
    let (now, record) = db.store.member("m-a").await.unwrap();
    assert!(
        record.as_ref().is_none_or(|r| !r.is_live(now)),
        "the resumed replica did not write the dead member back: {record:?}"
    );
    let op = wait_recovery_succeeded(db, &held.route).await;
    assert_eq!((op.attempts, op.moves), (1, 1), "{op:?}");
    pool.stop().await;
}

/// A report above the message bound is refused by the server's decoder: the member must see
/// an error (so it knows why), never a clean end of its stream, and the error quotes nothing
/// of the report.
pub async fn an_oversized_report_ends_the_stream_with_an_error(db: &TestDb) {
    let pool = Pool::start(db).await;
    let mut m = pool.member(0, "m-a", Behaviour::Mute).await;
    wait_members(db, 1).await;
    let huge = proto::host::v1::InstanceStatus {
        route: "r".repeat(5 << 20),
        ..Default::default()
    };
    m.send(MemberKind::StatusReport(StatusReport {
        instances: vec![huge],
        applied_revision: 0,
        partial: false,
    }))
    .await;
    let ended = m.wait_ended().await;
    assert_ne!(ended.code(), Code::Ok, "{ended:?}");
    assert!(ended.message().len() < 1024, "{} bytes", ended.message().len());
    pool.stop().await;
}

/// Reliability item 5: the files a coordinator delivered are overwritten behind its back (as
/// a paused coordinator that resumed after losing its lease did, with its stale keyring): the
/// coordinator notices on its next round and delivers them again, instead of leaving members
/// and sidecars with a token their trust bundle does not name until the next renewal.
pub async fn a_local_delivery_overwritten_on_disk_is_delivered_again(db: &TestDb) {
    let credentials = tempfile::tempdir().unwrap();
    let dir = credentials.path().to_str().unwrap().to_owned();
    let replica = start_replica_with("gw-d", &db.url, &["--credentials-dir", &dir, "--members", "m-a"], None).await;
    let member_dir = credentials.path().join("members").join("m-a");
    let delivered = |dir: std::path::PathBuf| async move {
        let jwks = std::fs::read_to_string(dir.join("trust.jwks")).ok()?;
        let token = std::fs::read_to_string(dir.join("token")).ok()?;
        let bundle = proto::trust::TrustBundle::from_jwks(jwks.as_bytes()).ok()?;
        let expected = Expectation::kind(Kind::Supervisor, DEFAULT_ISSUER);
        bundle.verify::<Claims>(token.trim(), &expected).ok().map(|_| jwks)
    };
    let good = wait_for("m-a's token delivered", 2000, || delivered(member_dir.clone())).await;
    // A stale writer's bundle: valid JWKS, but not the keys that signed the token.
    let stale = good.replace("\"kid\":\"", "\"kid\":\"stale-");
    let token = std::fs::read_to_string(member_dir.join("token")).unwrap();
    let expected = Expectation::kind(Kind::Supervisor, DEFAULT_ISSUER);
    let stale_bundle = proto::trust::TrustBundle::from_jwks(stale.as_bytes()).unwrap();
    assert!(
        stale_bundle.verify::<Claims>(token.trim(), &expected).is_err(),
        "with the stale bundle the token does not verify"
    );
    std::fs::write(member_dir.join("trust.jwks"), &stale).unwrap();
    wait_for("m-a's delivery repaired", 2000, || delivered(member_dir.clone())).await;
    replica.stop().await;
}
