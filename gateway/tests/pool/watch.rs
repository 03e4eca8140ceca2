//! The status stream (`WatchSupervisorPool`) and poolctl on it, against real replicas: a
//! change reaches a watcher as a streamed status (the client asks nothing in between), a
//! replica serves at most `--max-pool-watchers` (RESOURCE_EXHAUSTED beyond, and poolctl takes
//! the watch to the next gateway), `--wait` ends when the operation ends — with the exit code
//! of a success, a cancellation or a refusal — and a replica's shutdown ends its watches, which
//! poolctl takes up on another replica.

use std::future::Future;
use std::time::Duration;

use gateway::store::OperationPhase;
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::{GetSupervisorPoolStatusResponse, MemberState, WatchSupervisorPoolRequest};
use tonic::Code;

use crate::cluster::{Tokens, channel, register, start_replica_with, token, wait_assignments, with_token};
use crate::operations::{attach_members, poolctl_cli};
use crate::support::{TestDb, wait_for};

/// A bound on what a test waits for, never a timing assertion.
const PATIENCE: Duration = Duration::from_secs(60);

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("gave up waiting for {what}"))
}

/// The next streamed status that satisfies `check`.
async fn next_where(
    statuses: &mut poolctl::client::Statuses<'_>,
    what: &str,
    check: impl Fn(&GetSupervisorPoolStatusResponse) -> bool,
) -> GetSupervisorPoolStatusResponse {
    within(what, async {
        loop {
            let status = statuses.next().await.expect("the watch goes on");
            if check(&status) {
                return status;
            }
        }
    })
    .await
}

/// The exit code `poolctl ARGS` ends with against `endpoints` (0 when it succeeds).
async fn poolctl(endpoints: &str, credentials: &std::path::Path, args: &[&str]) -> u8 {
    let cli = poolctl_cli(endpoints, credentials, args);
    match within("poolctl", poolctl::run(cli)).await {
        Ok(()) => poolctl::exit::OK,
        Err(err) => err.exit_code(),
    }
}

pub async fn a_watch_streams_changes_and_wait_follows_an_operation_to_its_end(db: &TestDb) {
    let credentials = tempfile::tempdir().unwrap();
    let dir = credentials.path().to_str().unwrap();
    let first = start_replica_with(
        "gw-w1",
        &db.url,
        &["--credentials-dir", dir, "--max-pool-watchers", "2"],
        None,
    )
    .await;
    let second = start_replica_with("gw-w2", &db.url, &["--credentials-dir", dir], None).await;
    let endpoints = format!("{},{}", first.endpoint(), second.endpoint());
    let operator = token(credentials.path(), "operator").await;
    let tokens = Tokens::load(&db.store).await;

    // The status at once, then the change a member attaching makes, as streamed statuses.
    let cli = poolctl_cli(&endpoints, credentials.path(), &["watch"]);
    let mut client = poolctl::Client::connect(&cli.connection).await.unwrap();
    assert_eq!(client.endpoint(), first.endpoint());
    let mut statuses = client.watch();
    let initial = within("the first status", statuses.next()).await.unwrap();
    assert_eq!(initial.served_by, "gw-w1");
    assert!(initial.members.is_empty(), "{initial:?}");
    let members = attach_members(db, &first.endpoint(), &tokens, &[("m-a", 1), ("m-b", 4)]).await;
    next_where(&mut statuses, "both members in the stream", |s| {
        s.members.len() == 2 && s.members.iter().all(|m| m.state == MemberState::Active as i32)
    })
    .await;

    // Two watchers on gw-w1 (its cap): a third is refused with the reason.
    let open = || async {
        SupervisorPoolClient::new(channel(&first.endpoint()).await)
            .watch_supervisor_pool(with_token(WatchSupervisorPoolRequest {}, &operator))
            .await
    };
    let held = open().await.unwrap();
    let refused = open().await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    assert!(refused.message().contains("2 pool watchers"), "{refused}");
    // poolctl takes its watch to the next gateway instead.
    let mut elsewhere = poolctl::Client::connect(&cli.connection).await.unwrap();
    let status = within("a watch on gw-w2", elsewhere.watch().next()).await.unwrap();
    assert_eq!(status.served_by, "gw-w2");
    drop(elsewhere);
    drop(held);
    // The slot comes back once gw-w1 sees the watcher gone.
    wait_for("a free watcher slot on gw-w1", 3000, || async { open().await.ok() }).await;

    for i in 0..2 {
        let name = format!("agent-{i}");
        register(&first.endpoint(), &tokens.instance(&name), &name)
            .await
            .unwrap();
    }
    wait_assignments(&db.store, "one instance on each member", |a| {
        a.len() == 2 && a.iter().any(|a| a.member == "m-a") && a.iter().any(|a| a.member == "m-b")
    })
    .await;
    next_where(&mut statuses, "both instances placed in the stream", |s| {
        s.instances.len() == 2 && s.instances.iter().all(|i| !i.owner_member.is_empty())
    })
    .await;

    // m-a is full: a drain of m-b waits until it is cancelled, and `--wait` then exits 5.
    let waiting = tokio::spawn({
        let endpoints = endpoints.clone();
        let dir = credentials.path().to_owned();
        async move { poolctl(&endpoints, &dir, &["drain", "m-b", "--wait"]).await }
    });
    let drain = next_where(&mut statuses, "the drain running", |s| {
        s.operations
            .iter()
            .any(|o| o.target == "m-b" && o.phase == proto::pool::v1::OperationPhase::Running as i32)
    })
    .await
    .operations
    .into_iter()
    .find(|o| o.target == "m-b")
    .unwrap();
    assert!(!waiting.is_finished(), "--wait ended before its operation");
    assert_eq!(poolctl(&endpoints, credentials.path(), &["cancel", &drain.id]).await, 0);
    assert_eq!(
        within("--wait to end", waiting).await.unwrap(),
        poolctl::exit::OPERATION_CANCELLED
    );
    assert_eq!(
        db.store.operation(&drain.id).await.unwrap().unwrap().phase,
        OperationPhase::Cancelled
    );

    // With room on a new member the drain succeeds, and `--wait` exits 0 once it has.
    let more = attach_members(db, &first.endpoint(), &tokens, &[("m-c", 4)]).await;
    assert_eq!(
        poolctl(
            &endpoints,
            credentials.path(),
            &["drain", "m-b", "--wait", "-o", "json"]
        )
        .await,
        0
    );
    let drains: Vec<_> = db
        .store
        .list_operations()
        .await
        .unwrap()
        .into_iter()
        .filter(|o| o.target == "m-b" && o.id != drain.id)
        .collect();
    assert_eq!(drains.len(), 1, "{drains:?}");
    assert_eq!(drains[0].phase, OperationPhase::Succeeded, "{drains:?}");

    // Refusals: an unknown member (6); a token that is no operator's (3).
    assert_eq!(
        poolctl(&endpoints, credentials.path(), &["drain", "nobody"]).await,
        poolctl::exit::REFUSED
    );
    let member_token = credentials.path().join("not-an-operator");
    std::fs::create_dir_all(member_token.join("operator")).unwrap();
    std::fs::write(member_token.join("operator").join("token"), tokens.member("m-a")).unwrap();
    assert_eq!(
        poolctl(&endpoints, &member_token, &["status"]).await,
        poolctl::exit::UNREACHABLE
    );

    // gw-w1 shuts down: its watches end (the stop returns), and the stream goes on from gw-w2.
    within("gw-w1 to stop", first.stop()).await;
    next_where(&mut statuses, "a status from gw-w2", |s| s.served_by == "gw-w2").await;
    drop(statuses);
    drop((members, more));
    second.stop().await;
}
