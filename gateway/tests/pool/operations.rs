//! Drain and rebalance through the operator API of a real replica: requests are recorded
//! (idempotently) by the replica that serves them, the coordinator moves the instances at
//! term + 1 and finishes the operation; cancelling a succeeded drain returns the member; a dry
//! run lists the moves the drain then makes and records nothing.

use clap::Parser;
use gateway::store::{AssignmentPhase, OperationPhase};
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, GetSupervisorPoolStatusRequest, MemberState, Operation, OperationKind,
    StartSupervisorPoolOperationRequest, StartSupervisorPoolOperationResponse,
};
use tonic::Code;

use crate::cluster::{
    Behaviour, Member, channel, identity, register, start_replica, token, wait_assignments, with_token,
};
use crate::support::{TestDb, wait_for};

async fn start(
    endpoint: &str,
    operator: &str,
    kind: OperationKind,
    target: &str,
    max_parallel: u32,
) -> Result<StartSupervisorPoolOperationResponse, tonic::Status> {
    let request = StartSupervisorPoolOperationRequest {
        kind: kind as i32,
        target: target.into(),
        max_parallel,
        timeout_ms: 0,
        dry_run: false,
    };
    SupervisorPoolClient::new(channel(endpoint).await)
        .start_supervisor_pool_operation(with_token(request, operator))
        .await
        .map(tonic::Response::into_inner)
}

async fn member_state(endpoint: &str, operator: &str, member: &str) -> MemberState {
    let status = SupervisorPoolClient::new(channel(endpoint).await)
        .get_supervisor_pool_status(with_token(GetSupervisorPoolStatusRequest {}, operator))
        .await
        .unwrap()
        .into_inner();
    let state = status.members.iter().find(|m| m.name == member).unwrap().state;
    MemberState::try_from(state).unwrap()
}

async fn wait_phase(db: &TestDb, id: &str, phase: OperationPhase) -> gateway::store::Operation {
    wait_for("the operation's phase", 2000, || async {
        let op = db.store.operation(id).await.ok()??;
        (op.phase == phase).then_some(op)
    })
    .await
}

/// `poolctl` with the operator token of `credentials` against `endpoint`, then `args`.
pub fn poolctl_cli(endpoint: &str, credentials: &std::path::Path, args: &[&str]) -> poolctl::Cli {
    let token = credentials.join("operator").join("token");
    let base = [
        "poolctl",
        "--gateway",
        endpoint,
        "--token-file",
        token.to_str().unwrap(),
    ];
    poolctl::Cli::try_parse_from(base.iter().chain(args)).unwrap()
}

/// Members `(name, capacity)` attached to `endpoint` (process `<name>-p1`), once all are live.
pub async fn attach_members(
    db: &TestDb,
    endpoint: &str,
    tokens: &crate::cluster::Tokens,
    members: &[(&str, u32)],
) -> Vec<Member> {
    let mut attached = Vec::new();
    for (name, capacity) in members {
        let id = identity(name, &format!("{name}-p1"), 1, *capacity);
        attached.push(
            Member::attach(endpoint, &tokens.member(name), id, Behaviour::Healthy)
                .await
                .unwrap(),
        );
    }
    wait_for("every member live", 2000, || async {
        let (now, all) = db.store.list_members().await.ok()?;
        let live = |name: &str| all.iter().any(|m| m.member == name && m.is_live(now));
        members.iter().all(|(name, _)| live(name)).then_some(())
    })
    .await;
    attached
}

pub async fn drain_and_rebalance_move_instances_at_term_plus_one(db: &TestDb) {
    let credentials = tempfile::tempdir().unwrap();
    let replica = start_replica("gw-ops", &db.url, credentials.path()).await;
    let endpoint = replica.endpoint();
    let operator = token(credentials.path(), "operator").await;
    let tokens = crate::cluster::Tokens::load(&db.store).await;
    let members = attach_members(db, &endpoint, &tokens, &[("m-a", 16), ("m-b", 16)]).await;
    for i in 0..4 {
        let name = format!("agent-{i}");
        register(&endpoint, &tokens.instance(&name), &name).await.unwrap();
    }
    wait_assignments(&db.store, "two instances on each member", |a| {
        a.len() == 4 && a.iter().filter(|a| a.member == "m-a").count() == 2
    })
    .await;

    // Bad requests are refused with the reason.
    let refused = start(&endpoint, &operator, OperationKind::Drain, "m-a", 9)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    let refused = start(&endpoint, &operator, OperationKind::Drain, "nobody", 1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused}");
    let refused = start(&endpoint, &operator, OperationKind::Rebalance, "m-a", 1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    let refused = start(&endpoint, &operator, OperationKind::Recover, "default/agent-0", 1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    let refused = start(&endpoint, &tokens.member("m-a"), OperationKind::Rebalance, "", 1)
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Code::Unauthenticated,
        "a supervisor token is no operator token"
    );

    // Drain m-a: recorded once, even when asked twice.
    let first = start(&endpoint, &operator, OperationKind::Drain, "m-a", 2)
        .await
        .unwrap();
    assert!(first.created);
    let op: Operation = first.operation.unwrap();
    let again = start(&endpoint, &operator, OperationKind::Drain, "m-a", 2)
        .await
        .unwrap();
    assert!(!again.created, "an equivalent open drain is returned, not duplicated");
    assert_eq!(again.operation.unwrap().id, op.id);

    let moved = wait_assignments(&db.store, "every instance on m-b at term 2", |a| {
        a.len() == 4 && a.iter().all(|a| a.member == "m-b")
    })
    .await;
    let terms: Vec<u64> = moved.iter().map(|a| a.term.get()).collect();
    assert_eq!(
        terms.iter().filter(|t| **t == 2).count(),
        2,
        "the two moved instances are at term 2: {terms:?}"
    );
    assert!(moved.iter().all(|a| a.phase == AssignmentPhase::Reserved));
    let done = wait_phase(db, &op.id, OperationPhase::Succeeded).await;
    assert_eq!(done.moves, 2);
    assert_eq!(member_state(&endpoint, &operator, "m-a").await, MemberState::Drained);

    // A drained member takes nothing new.
    register(&endpoint, &tokens.instance("agent-4"), "agent-4")
        .await
        .unwrap();
    wait_assignments(&db.store, "the new instance on m-b", |a| {
        a.iter().any(|a| a.route == "default/agent-4" && a.member == "m-b")
    })
    .await;

    // Cancelling the succeeded drain returns m-a to service.
    let cancelled = SupervisorPoolClient::new(channel(&endpoint).await)
        .cancel_supervisor_pool_operation(with_token(
            CancelSupervisorPoolOperationRequest { id: op.id.clone() },
            &operator,
        ))
        .await
        .unwrap()
        .into_inner()
        .operation
        .unwrap();
    assert_eq!(cancelled.id, op.id);
    wait_phase(db, &op.id, OperationPhase::Cancelled).await;
    assert_eq!(member_state(&endpoint, &operator, "m-a").await, MemberState::Active);
    let unknown = SupervisorPoolClient::new(channel(&endpoint).await)
        .cancel_supervisor_pool_operation(with_token(
            CancelSupervisorPoolOperationRequest {
                id: "no-such-op".into(),
            },
            &operator,
        ))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    // Rebalance evens out 0 / 5, through poolctl's client (as an operator would).
    let cli = poolctl_cli(
        &endpoint,
        credentials.path(),
        &["rebalance", "--max-parallel", "8", "--wait"],
    );
    let poolctl::Command::Rebalance { run, .. } = &cli.command else {
        panic!("a rebalance")
    };
    let mut client = poolctl::Client::connect(&cli.connection).await.unwrap();
    let (rebalance, created) = client.start(OperationKind::Rebalance, "", run).await.unwrap();
    assert!(created);
    let done = client
        .wait(&rebalance.id, &mut poolctl::Progress::lines(0, poolctl::Output::Table))
        .await
        .expect("the rebalance succeeds");
    assert_eq!(done.moves, 2, "{}", poolctl::render::operation_line(&done));
    let on_a = db
        .store
        .list_assignments()
        .await
        .unwrap()
        .iter()
        .filter(|a| a.member == "m-a")
        .count();
    assert!((2..=3).contains(&on_a), "two or three of five on m-a, got {on_a}");
    drop(members);
    replica.stop().await;
}

/// A dry run over the operator API of a replica that is not the coordinator: the moves it
/// lists are the moves the real drain then makes, and it writes nothing (operations and
/// assignments identical before and after). When no member has room it says why, per instance.
pub async fn a_dry_run_lists_the_moves_a_drain_then_makes_and_writes_nothing(db: &TestDb) {
    let credentials = tempfile::tempdir().unwrap();
    let first = start_replica("gw-one", &db.url, credentials.path()).await;
    let second = start_replica("gw-two", &db.url, credentials.path()).await;
    let operator = token(credentials.path(), "operator").await;
    let tokens = crate::cluster::Tokens::load(&db.store).await;
    let members = attach_members(db, &first.endpoint(), &tokens, &[("m-a", 16), ("m-b", 16), ("m-c", 3)]).await;
    for i in 0..6 {
        let name = format!("agent-{i}");
        register(&first.endpoint(), &tokens.instance(&name), &name)
            .await
            .unwrap();
    }
    wait_assignments(&db.store, "two instances on each member", |a| {
        a.len() == 6
            && ["m-a", "m-b", "m-c"]
                .iter()
                .all(|m| a.iter().filter(|a| a.member == *m).count() == 2)
    })
    .await;
    // Answered by whichever replica does not hold the lease.
    let holder = db.store.read_lease().await.unwrap().unwrap().holder;
    let follower = if holder.starts_with("gw-one") { &second } else { &first };
    let endpoint = follower.endpoint();
    let dry_run = |kind: OperationKind, target: &str| {
        let request = StartSupervisorPoolOperationRequest {
            kind: kind as i32,
            target: target.into(),
            max_parallel: 1,
            timeout_ms: 0,
            dry_run: true,
        };
        let endpoint = endpoint.clone();
        let operator = operator.clone();
        async move {
            SupervisorPoolClient::new(channel(&endpoint).await)
                .start_supervisor_pool_operation(with_token(request, &operator))
                .await
                .map(tonic::Response::into_inner)
        }
    };

    let operations_before = db.store.list_operations().await.unwrap();
    let assignments_before = db.store.list_assignments().await.unwrap();
    let answer = dry_run(OperationKind::Drain, "m-b").await.unwrap();
    assert!(
        answer.operation.is_none() && !answer.created,
        "a dry run records nothing"
    );
    let plan = answer.plan.expect("a dry run answers with the plan");
    assert_eq!(plan.served_by, follower.name);
    assert!(plan.completes, "{}", plan.message);
    assert!(plan.refused.is_empty(), "{:?}", plan.refused);
    let mut on_b: Vec<&gateway::store::Assignment> = assignments_before.iter().filter(|a| a.member == "m-b").collect();
    on_b.sort_by(|x, y| x.route.cmp(&y.route));
    let planned: Vec<(String, String, String, u64, u32)> = plan
        .moves
        .iter()
        .map(|m| {
            (
                m.route.clone(),
                m.from_member.clone(),
                m.to_member.clone(),
                m.term,
                m.wave,
            )
        })
        .collect();
    // Both of m-b's instances, one per wave (max_parallel 1): the first to m-a (a tie with
    // m-c, broken by name), the second to m-c, then at three of three.
    let expected: Vec<(String, String, String, u64, u32)> = on_b
        .iter()
        .zip([("m-a", 1), ("m-c", 2)])
        .map(|(a, (to, wave))| {
            let term = a.term.get() + 1;
            (a.route.clone(), "m-b".to_owned(), to.to_owned(), term, wave)
        })
        .collect();
    assert_eq!(planned, expected);
    // A rebalance of a balanced pool plans nothing and would succeed.
    let balanced = dry_run(OperationKind::Rebalance, "").await.unwrap().plan.unwrap();
    assert!(balanced.moves.is_empty() && balanced.completes, "{balanced:?}");
    // Refused like a real request.
    let refused = dry_run(OperationKind::Drain, "nobody").await.unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused}");
    assert_eq!(db.store.list_operations().await.unwrap(), operations_before);
    assert_eq!(db.store.list_assignments().await.unwrap(), assignments_before);

    // The real drain makes exactly those moves.
    let started = start(&endpoint, &operator, OperationKind::Drain, "m-b", 1)
        .await
        .unwrap();
    let op = started.operation.unwrap();
    let done = wait_phase(db, &op.id, OperationPhase::Succeeded).await;
    assert_eq!(usize::try_from(done.moves).unwrap(), plan.moves.len());
    let after = db.store.list_assignments().await.unwrap();
    for m in &plan.moves {
        let a = after.iter().find(|a| a.route == m.route).unwrap();
        assert_eq!(
            (a.member.as_str(), a.term.get()),
            (m.to_member.as_str(), m.term),
            "{}",
            m.route
        );
    }
    for a in assignments_before.iter().filter(|a| a.member != "m-b") {
        assert!(after.contains(a), "{} did not move", a.route);
    }

    // Now m-b is drained and m-c is full: a dry run of draining m-a says why, per instance,
    // through poolctl (as an operator would), and still writes nothing.
    let operations_before = db.store.list_operations().await.unwrap();
    let cli = poolctl_cli(&endpoint, credentials.path(), &["drain", "m-a", "--dry-run"]);
    let poolctl::Command::Drain { run, .. } = &cli.command else {
        panic!("a drain")
    };
    let mut client = poolctl::Client::connect(&cli.connection).await.unwrap();
    let plan = client.plan(OperationKind::Drain, "m-a", run).await.unwrap();
    assert!(!plan.completes && plan.moves.is_empty(), "{plan:?}");
    let mut on_a: Vec<&str> = after
        .iter()
        .filter(|a| a.member == "m-a")
        .map(|a| a.route.as_str())
        .collect();
    on_a.sort_unstable();
    assert_eq!(plan.refused.iter().map(|r| r.route.as_str()).collect::<Vec<_>>(), on_a);
    for r in &plan.refused {
        assert!(r.reason.contains("m-c holds 3 of 3"), "{r:?}");
    }
    let table = poolctl::render::plan_table(&plan);
    assert!(
        table.contains("would not finish") && table.contains("m-c holds 3 of 3"),
        "{table}"
    );
    assert_eq!(db.store.list_operations().await.unwrap(), operations_before);
    assert_eq!(db.store.list_assignments().await.unwrap(), after);
    drop(members);
    second.stop().await;
    first.stop().await;
}

pub async fn the_status_names_every_live_build_and_what_is_outside_the_policy(db: &TestDb) {
    let credentials = tempfile::tempdir().unwrap();
    let replica = start_replica("gw-builds", &db.url, credentials.path()).await;
    let endpoint = replica.endpoint();
    let operator = token(credentials.path(), "operator").await;
    let tokens = crate::cluster::Tokens::load(&db.store).await;
    // The test member says "test" (not a version); the test sidecar "0.9.0+sidecar".
    let mut members = attach_members(db, &endpoint, &tokens, &[("m-a", 16)]).await;
    register(&endpoint, &tokens.instance("agent-0"), "agent-0")
        .await
        .unwrap();
    let status = |operator: String, endpoint: String| async move {
        SupervisorPoolClient::new(channel(&endpoint).await)
            .get_supervisor_pool_status(with_token(GetSupervisorPoolStatusRequest {}, &operator))
            .await
            .unwrap()
            .into_inner()
    };
    let shown = wait_for("every build in the status", 2000, || async {
        let shown = status(operator.clone(), endpoint.clone()).await;
        (shown.builds.len() == 3).then_some(shown)
    })
    .await;
    let builds: Vec<(&str, &str, &str)> = shown
        .builds
        .iter()
        .map(|b| (b.component.as_str(), b.name.as_str(), b.version.as_str()))
        .collect();
    assert_eq!(
        builds,
        vec![
            ("gateway", "gw-builds", plumbing::build::version()),
            ("member", "m-a", "test"),
            ("sidecar", "default/agent-0", "0.9.0+sidecar"),
        ]
    );
    assert_eq!(shown.members[0].build_version, "test");
    let gateway_line = semver::Version::parse(plumbing::build::version()).unwrap().minor;
    assert_eq!(
        shown.build_warnings,
        vec![
            "1 member reports no release version (none, or one that is not a version)".to_owned(),
            format!("1 sidecar of 0.9 is newer than the pool (0.{gateway_line}): upgrade the pool first"),
        ]
    );
    // A member whose stream ended is not counted any more (a second hello ends it).
    members[0]
        .send(proto::host::v1::member_message::Kind::Hello(proto::host::v1::Hello {
            member: "m-a".into(),
            process_id: "m-a-p1".into(),
            ..Default::default()
        }))
        .await;
    members[0].wait_ended().await;
    wait_for("the member's build gone with it", 2000, || async {
        let shown = status(operator.clone(), endpoint.clone()).await;
        shown.builds.iter().all(|b| b.component != "member").then_some(())
    })
    .await;
    replica.stop().await;
}
