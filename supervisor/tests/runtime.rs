//! The member's runtime.v1 side against a fake gateway (host stream + recovery RPCs minting
//! real Ed25519 grants and proofs) and scripted fake sidecars, all over real sockets.
//!
//! These run on the real clock: a paused clock auto-advances whenever the runtime waits on
//! loopback I/O, which fires the member's gRPC call timeouts spuriously. Every wait is on a
//! condition; the longest is one lost IssueGrant response (the 5 s call timeout).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use proto::common::v1::InstancePhase::{Active, Failed, Relinquished, Starting, Stopped};
use proto::common::v1::{InstanceRef, RouteDirectoryEntry};
use proto::host::v1::AssignmentPhase::{Active as Owned, Reserved};
use proto::host::v1::{OwnedInstance, Snapshot, StatusReport};
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::workload_request::Kind as Request;
use proto::runtime::v1::workload_response::Kind as Response;
use proto::runtime::v1::{FetchCredential, Liveness, ReportProgress, WorkloadRequest, sidecar_message};
use proto::trust::{Claims, DEFAULT_ISSUER, Expectation, Kind as TokenKind, ProofClaims};
use support::recovery::{Call, Keys, Script};
use support::sidecar::{FakeSidecar, WORKLOAD_PID, attach, recovery_hello};
use support::{Connection, FakeGateway, Member, ShuttingDownReplica, placed, shows, status};
use tokio::time::Instant;
use tonic::{Code, Status};

const ROUTE: &str = "team-a/agent";
const DEADLINE_MS: u64 = 45_000;
const SUPERVISOR_TOKEN: &str = "supervisor-token";

fn generation(generation: u64) -> InstanceRef {
    InstanceRef {
        namespace: "team-a".into(),
        name: "agent".into(),
        uid: format!("uid-agent-{generation}"),
        generation,
    }
}

fn directory(route: &str, member: &str, term: u64) -> RouteDirectoryEntry {
    RouteDirectoryEntry {
        route: route.into(),
        member: member.into(),
        process_id: format!("process-of-{member}"),
        runtime_address: format!("http://{member}.pool:50061"),
        term,
    }
}

/// One member attached to one fake gateway replica.
struct Pool {
    gateway: FakeGateway,
    member: Member,
    connection: Connection,
    runtime_address: String,
    revision: u64,
}

impl Pool {
    async fn start() -> Self {
        Self::start_behind(&[]).await
    }

    /// A pool whose member dials `first` before the gateway (fake replicas that fail).
    async fn start_behind(first: &[&str]) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let mut gateway = FakeGateway::start().await;
        gateway.recovery.place(ROUTE, generation(1));
        let endpoints: Vec<&str> = first.iter().copied().chain([gateway.endpoint.as_str()]).collect();
        let member = Member::start("supervisor-0", &endpoints, SUPERVISOR_TOKEN);
        let connection = gateway.next_connection().await;
        let runtime_address = connection.hello.runtime_address.clone();
        Self {
            gateway,
            member,
            connection,
            runtime_address,
            revision: 0,
        }
    }

    /// Sends the next snapshot (recovery deadline [`DEADLINE_MS`]) and waits for its ack.
    async fn send(&mut self, snapshot: Snapshot) {
        self.revision += 1;
        let snapshot = Snapshot {
            revision: self.revision,
            recovery_deadline_ms: DEADLINE_MS,
            ..snapshot
        };
        self.connection.send(snapshot).await;
        self.connection.acks_until(self.revision).await;
    }

    async fn own(&mut self, instances: Vec<OwnedInstance>) {
        self.send(Snapshot {
            instances,
            ..Snapshot::default()
        })
        .await;
    }

    async fn report_where(&mut self, accept: impl Fn(&StatusReport) -> bool) -> StatusReport {
        self.connection.report_where(accept).await
    }

    async fn sidecar(&self, first: sidecar_message::Kind) -> FakeSidecar {
        let token = self.gateway.recovery.keys.instance_token(ROUTE, None);
        FakeSidecar::connect(&self.runtime_address, Some(&token), first)
            .await
            .unwrap()
    }

    /// A sidecar at `fence` attaches and the member takes `instance` over at `term`: grant,
    /// receipt, activation, confirm. Returns the stream, ready to relay.
    async fn take_over(&mut self, instance: &InstanceRef, term: u64, fence: u64) -> FakeSidecar {
        let bundle = self.gateway.recovery.keys.bundle();
        let mut sidecar = self.sidecar(attach(ROUTE, instance, fence)).await;
        let Kind::GrantPresentation(presentation) = sidecar.expect().await else {
            panic!("expected a grant presentation")
        };
        let grant = sidecar.receipt(&presentation, &bundle, fence).await;
        assert_eq!(grant.extra.term, term);
        let Kind::ActivationConfirm(confirm) = sidecar.expect().await else {
            panic!("expected the activation confirm")
        };
        assert_eq!(confirm.term, term);
        let proof: Claims<ProofClaims> = bundle
            .verify(
                &confirm.proof,
                &Expectation::kind(TokenKind::ActivationProof, DEFAULT_ISSUER),
            )
            .unwrap();
        assert_eq!(
            (proof.extra.term, proof.extra.grant_id.as_str()),
            (term, grant.jti.as_str())
        );
        self.report_where(|r| shows(r, ROUTE, term, Active)).await;
        sidecar
    }
}

/// The next message is the Release of `term` (after an Attached when the sidecar returned at
/// the active term: the Release comes from the activated owner's stream).
async fn expect_release(sidecar: &mut FakeSidecar, term: u64) {
    let mut message = sidecar.expect().await;
    if matches!(&message, Kind::Attached(a) if a.term == term) {
        message = sidecar.expect().await;
    }
    assert!(matches!(&message, Kind::Release(r) if r.term == term), "{message:?}");
}

async fn request(sidecar: &mut FakeSidecar, request_id: u64, kind: Request) -> Response {
    sidecar
        .send(sidecar_message::Kind::WorkloadRequest(WorkloadRequest {
            request_id,
            kind: Some(kind),
        }))
        .await;
    let Kind::WorkloadResponse(response) = sidecar.expect().await else {
        panic!("expected a workload response")
    };
    assert_eq!(response.request_id, request_id);
    response.kind.unwrap()
}

#[tokio::test]
async fn first_placement_takes_over_end_to_end_and_relays() {
    let mut pool = Pool::start().await;
    // Trust from the file beside the supervisor token.
    pool.member.write_trust(&pool.gateway.recovery.keys.bundle());
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 1, Reserved)]).await;
    pool.report_where(|r| shows(r, ROUTE, 1, Starting)).await;

    let mut sidecar = pool.sidecar(attach(ROUTE, &instance, 0)).await;
    let Kind::GrantPresentation(presentation) = sidecar.expect().await else {
        panic!("expected a grant presentation")
    };
    assert_eq!(presentation.member, "supervisor-0");
    assert_eq!(presentation.process_id, pool.connection.hello.process_id);
    let bundle = pool.gateway.recovery.keys.bundle();
    let grant = sidecar.receipt(&presentation, &bundle, 0).await;
    assert_eq!((grant.extra.route.as_str(), grant.extra.term), (ROUTE, 1));

    let Kind::ActivationConfirm(confirm) = sidecar.expect().await else {
        panic!("expected the activation confirm")
    };
    assert_eq!((confirm.term, confirm.recovery_deadline_ms), (1, DEADLINE_MS));
    let proof: Claims<ProofClaims> = bundle
        .verify(
            &confirm.proof,
            &Expectation::kind(TokenKind::ActivationProof, DEFAULT_ISSUER),
        )
        .unwrap();
    assert_eq!(proof.extra.grant_id, grant.jti);
    assert_eq!(proof.extra.process_id, pool.connection.hello.process_id);

    // Each single-use call once, with the supervisor token; Activate carried our receipt.
    let (issued, activated) = (pool.gateway.recovery.issued(), pool.gateway.recovery.activated());
    assert_eq!(issued.len(), 1);
    assert_eq!((issued[0].term, issued[0].member.as_str()), (1, "supervisor-0"));
    assert_eq!(activated.len(), 1);
    assert_eq!(activated[0].receipt.as_ref().unwrap().grant_id, grant.jti);
    assert!(
        pool.gateway
            .recovery
            .bearer_tokens()
            .iter()
            .all(|t| t.as_deref() == Some(SUPERVISOR_TOKEN))
    );
    let report = pool.report_where(|r| shows(r, ROUTE, 1, Active)).await;
    assert_eq!(status(&report, ROUTE).unwrap().workload_pid, WORKLOAD_PID);

    // Relaying: exactly one response per request.
    let progress = ReportProgress {
        value: 41,
        note: "counting".into(),
    };
    assert!(matches!(
        request(&mut sidecar, 1, Request::ReportProgress(progress)).await,
        Response::ProgressAccepted(a) if a.value == 41
    ));
    // A workload holds no credential: the owner refuses to hand one out.
    assert!(matches!(
        request(&mut sidecar, 2, Request::FetchCredential(FetchCredential {})).await,
        Response::Rejected(r) if r.reason == proto::egress::NO_CREDENTIAL
    ));
    assert!(matches!(
        request(&mut sidecar, 3, Request::Liveness(Liveness {})).await,
        Response::Alive(_)
    ));
    let report = pool
        .report_where(|r| status(r, ROUTE).is_some_and(|s| s.counters.unwrap_or_default().requests_relayed == 3))
        .await;
    // A change goes out as a partial report (only what changed), not as the complete status.
    assert!(report.partial, "a counter change is reported as a change");
    let counters = status(&report, ROUTE).unwrap().counters.unwrap();
    assert_eq!(counters.last_progress_value, 41);
    assert!(counters.last_progress_at_ms > 0);
    assert_eq!((counters.requests_rejected, counters.sidecar_connects), (1, 1));
}

#[tokio::test]
async fn sidecars_are_authenticated_by_instance_token_and_trust_follows_rotation() {
    let mut pool = Pool::start().await;
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 2, Owned)]).await;
    let connect = |token: Option<String>| {
        let address = pool.runtime_address.clone();
        let first = attach(ROUTE, &instance, 2);
        async move { FakeSidecar::connect(&address, token.as_deref(), first).await }
    };
    let keys = pool.gateway.recovery.keys.clone();
    let refused = |result: Result<FakeSidecar, Status>| result.err().expect("refused").code();

    assert_eq!(refused(connect(None).await), Code::Unauthenticated);
    assert_eq!(refused(connect(Some("not-a-jwt".into())).await), Code::Unauthenticated);
    let forged = Keys::new(9, "gateway-key-1").instance_token(ROUTE, None);
    assert_eq!(refused(connect(Some(forged)).await), Code::Unauthenticated);
    // A token of another namespace, of another workload of the same namespace, or bound to
    // another Pod UID of the same route: never this instance's stream.
    for other in [
        keys.instance_token("team-b/agent", None),
        keys.instance_token("team-a/other", None),
        keys.instance_token(ROUTE, Some("uid-of-another-pod")),
    ] {
        assert_eq!(refused(connect(Some(other)).await), Code::PermissionDenied);
    }
    // A token for the route in the request, but naming another workload in its claims.
    let lying = keys.mint(
        proto::trust::Kind::Instance,
        &proto::trust::instance_subject(ROUTE),
        600,
        serde_json::json!({ "namespace": "team-b", "name": "agent" }),
    );
    assert_eq!(refused(connect(Some(lying)).await), Code::PermissionDenied);
    // The bundle came from the gateway (no trust file yet): a valid token attaches.
    let mut sidecar = connect(Some(keys.instance_token(ROUTE, Some(&instance.uid))))
        .await
        .unwrap();
    assert!(
        matches!(sidecar.expect().await, Kind::Attached(a) if a.term == 2 && a.recovery_deadline_ms == DEADLINE_MS)
    );

    // A rotated key delivered in the trust file is picked up at once (unknown kid).
    let rotated = Keys::new(2, "gateway-key-2");
    pool.member.write_trust(&rotated.bundle());
    let mut again = connect(Some(rotated.instance_token(ROUTE, None))).await.unwrap();
    assert!(matches!(again.expect().await, Kind::Attached(_)));
    // A key the file lacks but the gateway still publishes (the file lags behind it: a
    // kubelet sync, a stale delivery) is looked up at the gateway; a key neither publishes is
    // refused.
    let mut lagging = connect(Some(keys.instance_token(ROUTE, None))).await.unwrap();
    assert!(matches!(lagging.expect().await, Kind::Attached(_)));
    let unknown = Keys::new(7, "gateway-key-7").instance_token(ROUTE, None);
    assert_eq!(refused(connect(Some(unknown)).await), Code::Unauthenticated);
}

#[tokio::test]
async fn a_route_owned_elsewhere_is_redirected_using_the_directory() {
    let mut pool = Pool::start().await;
    pool.own(vec![]).await;
    let instance = generation(1);

    // Not in the directory yet: parked (heartbeats keep it open) until a snapshot decides.
    let mut sidecar = pool.sidecar(recovery_hello(ROUTE, &instance, 3, false)).await;
    pool.send(Snapshot {
        directory: vec![directory(ROUTE, "supervisor-1", 4)],
        ..Snapshot::default()
    })
    .await;
    let Kind::Redirect(redirect) = sidecar.expect().await else {
        panic!("expected a redirect")
    };
    assert_eq!(redirect.route, ROUTE);
    assert_eq!(redirect.runtime_address, "http://supervisor-1.pool:50061");
    assert_eq!(
        (redirect.member.as_str(), redirect.process_id.as_str(), redirect.term),
        ("supervisor-1", "process-of-supervisor-1", 4)
    );
    assert_eq!(sidecar.ended().await, Code::Ok);

    // A directory entry behind the sidecar's fence is no owner: the stream stays parked until
    // an entry at a newer term arrives.
    let mut fenced = pool.sidecar(recovery_hello(ROUTE, &instance, 5, false)).await;
    pool.send(Snapshot {
        directory: vec![directory(ROUTE, "supervisor-1", 4)],
        ..Snapshot::default()
    })
    .await;
    pool.send(Snapshot {
        directory: vec![directory(ROUTE, "supervisor-2", 6)],
        ..Snapshot::default()
    })
    .await;
    let Kind::Redirect(redirect) = fenced.expect().await else {
        panic!("expected a redirect")
    };
    assert_eq!(
        (redirect.member.as_str(), redirect.term),
        ("supervisor-2", 6),
        "never sent behind the fence"
    );
    assert!(pool.gateway.recovery.issued().is_empty());
}

#[tokio::test]
async fn a_stale_term_member_is_refused_with_failed_precondition_and_reports_failed() {
    let mut pool = Pool::start().await;
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 2, Owned)]).await;
    pool.report_where(|r| shows(r, ROUTE, 2, Active)).await;

    let mut sidecar = pool.sidecar(attach(ROUTE, &instance, 3)).await;
    assert_eq!(sidecar.ended().await, Code::FailedPrecondition);
    let report = pool.report_where(|r| shows(r, ROUTE, 2, Failed)).await;
    let message = &status(&report, ROUTE).unwrap().message;
    assert!(message.contains("fenced") && message.contains("term 3"), "{message}");

    // Another generation under a held route is refused too.
    let mut other = pool.sidecar(attach(ROUTE, &generation(2), 0)).await;
    assert_eq!(other.ended().await, Code::FailedPrecondition);
}

#[tokio::test]
async fn issue_grant_and_activate_are_sent_once_even_when_the_response_is_lost() {
    let mut pool = Pool::start().await;
    let instance = generation(1);
    pool.gateway.recovery.script_issue(&[Script::LoseResponse]);
    pool.own(vec![placed(ROUTE, &instance, 1, Reserved)]).await;

    let sidecar = pool.sidecar(attach(ROUTE, &instance, 0)).await;
    assert!(matches!(pool.gateway.next_call().await, Call::Issue(r) if r.term == 1));
    let report = pool.report_where(|r| shows(r, ROUTE, 1, Failed)).await;
    let message = &status(&report, ROUTE).unwrap().message;
    assert!(
        message.contains("IssueGrant") && message.contains("not retried"),
        "{message}"
    );

    // The sidecar comes back on a new stream: the failed term is not asked for again.
    drop(sidecar);
    let _sidecar = pool.sidecar(recovery_hello(ROUTE, &instance, 0, false)).await;
    pool.report_where(|r| status(r, ROUTE).is_some_and(|s| s.counters.unwrap_or_default().sidecar_connects == 2))
        .await;
    assert_eq!(pool.gateway.recovery.issued().len(), 1, "IssueGrant was retried");

    // The coordinator reserves a new term: one grant for it; Activate is processed by the
    // gateway but the connection breaks before the response.
    pool.gateway
        .recovery
        .script_activate(&[Script::Fail(Code::Unavailable, "connection reset after processing")]);
    pool.own(vec![placed(ROUTE, &instance, 2, Reserved)]).await;
    let mut sidecar = pool.sidecar(recovery_hello(ROUTE, &instance, 0, false)).await;
    let Kind::GrantPresentation(presentation) = sidecar.expect().await else {
        panic!("expected a grant presentation")
    };
    sidecar
        .receipt(&presentation, &pool.gateway.recovery.keys.bundle(), 0)
        .await;
    let report = pool.report_where(|r| shows(r, ROUTE, 2, Failed)).await;
    let message = &status(&report, ROUTE).unwrap().message;
    assert!(
        message.contains("Activate") && message.contains("not retried"),
        "{message}"
    );

    // Presenting again on a new stream gets the same receipt: still no second Activate.
    drop(sidecar);
    let _sidecar = pool.sidecar(recovery_hello(ROUTE, &instance, 0, false)).await;
    pool.report_where(|r| status(r, ROUTE).is_some_and(|s| s.counters.unwrap_or_default().sidecar_connects == 2))
        .await;
    let issued: Vec<u64> = pool.gateway.recovery.issued().iter().map(|r| r.term).collect();
    assert_eq!(issued, vec![1, 2], "one IssueGrant per term");
    assert_eq!(pool.gateway.recovery.activated().len(), 1, "Activate was retried");
}

#[tokio::test]
async fn a_call_a_replica_in_shutdown_left_unprocessed_goes_to_the_next_replica() {
    // The first replica is shutting down: its GOAWAY leaves every stream out. IssueGrant and
    // Activate, sent at most once, may go to the next replica because the first provably
    // processed nothing — a planned move meeting a rolling gateway is not a failed term.
    let refusing = ShuttingDownReplica::start().await;
    let mut pool = Pool::start_behind(&[&refusing.endpoint]).await;
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 1, Reserved)]).await;
    let _sidecar = pool.take_over(&instance, 1, 0).await;
    assert!(refusing.refused() > 0, "the shutting-down replica was tried first");
    let issued: Vec<u64> = pool.gateway.recovery.issued().iter().map(|r| r.term).collect();
    assert_eq!(issued, vec![1], "one IssueGrant, processed by the replica that serves");
    assert_eq!(pool.gateway.recovery.activated().len(), 1, "one Activate");
}

#[tokio::test]
async fn omission_relinquishes_at_once_without_stopping_and_the_sidecar_is_sent_on() {
    let mut pool = Pool::start().await;
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 1, Reserved)]).await;
    let mut sidecar = pool.take_over(&instance, 1, 0).await;

    // Planned move: the new owner is reserved at term 2, this member's snapshot omits the route.
    pool.send(Snapshot {
        directory: vec![directory(ROUTE, "supervisor-1", 2)],
        ..Snapshot::default()
    })
    .await;
    let Kind::Relinquish(relinquish) = sidecar.expect().await else {
        panic!("expected Relinquish, never Release")
    };
    assert_eq!(relinquish.term, 1);
    assert_eq!(sidecar.ended().await, Code::Ok);
    pool.report_where(|r| shows(r, ROUTE, 1, Relinquished)).await;

    // The sidecar's recovery starts at once and is sent to the reserved owner.
    let mut recovering = pool.sidecar(recovery_hello(ROUTE, &instance, 1, true)).await;
    let Kind::Redirect(redirect) = recovering.expect().await else {
        panic!("expected a redirect")
    };
    assert_eq!((redirect.member.as_str(), redirect.term), ("supervisor-1", 2));
}

#[tokio::test]
async fn stop_routes_release_and_wait_for_the_workload_to_stop() {
    let mut pool = Pool::start().await;
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 1, Reserved)]).await;
    let mut sidecar = pool.take_over(&instance, 1, 0).await;

    pool.send(Snapshot {
        stop_routes: vec![ROUTE.into()],
        ..Snapshot::default()
    })
    .await;
    let Kind::Release(release) = sidecar.expect().await else {
        panic!("expected Release")
    };
    assert_eq!(release.term, 1);
    // Not stopped until the sidecar says so; relayed requests are refused meanwhile.
    let report = pool
        .report_where(|r| status(r, ROUTE).is_some_and(|s| s.message.contains("stopping")))
        .await;
    assert!(!shows(&report, ROUTE, 1, Stopped));
    assert!(matches!(
        request(&mut sidecar, 1, Request::Liveness(Liveness {})).await,
        Response::Rejected(_)
    ));

    sidecar
        .send(sidecar_message::Kind::Stopped(proto::runtime::v1::Stopped {
            reason: "released: the gateway withdrew the instance".into(),
            exit_code: None,
            signal: Some(15),
        }))
        .await;
    assert_eq!(sidecar.ended().await, Code::Ok);
    let report = pool.report_where(|r| shows(r, ROUTE, 1, Stopped)).await;
    assert!(status(&report, ROUTE).unwrap().message.contains("released"));
    // Shown once, then gone.
    pool.report_where(|r| !r.partial && r.instances.is_empty()).await;
}

/// The seed's stop/start shutdown race: a refusal or fence event must never abandon a session
/// that is already terminating (Release sent, waiting for Stopped), and a new generation of the
/// same route must start at once instead of waiting out the old one's termination grace.
#[tokio::test]
async fn a_terminating_session_survives_refusals_and_the_next_generation_starts_at_once() {
    let mut pool = Pool::start().await;
    let (old, new) = (generation(1), generation(2));
    pool.own(vec![placed(ROUTE, &old, 3, Owned)]).await;
    let mut old_sidecar = pool.sidecar(attach(ROUTE, &old, 3)).await;
    assert!(matches!(old_sidecar.expect().await, Kind::Attached(a) if a.term == 3));

    // Stop: Release sent; the session waits for the workload to exit.
    pool.send(Snapshot {
        stop_routes: vec![ROUTE.into()],
        ..Snapshot::default()
    })
    .await;
    assert!(matches!(old_sidecar.expect().await, Kind::Release(r) if r.term == 3));
    let stopping_since = Instant::now();

    // Refusal: the gateway refuses the member's stream; the member reconnects and the new view
    // places the route's next generation (the old one is omitted).
    pool.connection
        .end(Status::failed_precondition("stale connection epoch"))
        .await;
    pool.connection = pool.gateway.next_connection().await;
    pool.revision = 0;
    pool.gateway.recovery.place(ROUTE, new.clone());
    pool.own(vec![placed(ROUTE, &new, 1, Reserved)]).await;

    // The new generation starts at once, beside the terminating one.
    let _new_sidecar = pool.take_over(&new, 1, 0).await;
    let waited = stopping_since.elapsed();
    assert!(waited < Duration::from_secs(5), "the new generation waited {waited:?}");

    // The old sidecar loses its stream: back in recovery it gets the Release again.
    drop(old_sidecar);
    let mut old_sidecar = pool.sidecar(recovery_hello(ROUTE, &old, 3, false)).await;
    expect_release(&mut old_sidecar, 3).await;

    // Superseded (another stream of this member name): the member attaches again instead of
    // exiting, and the terminating session is not abandoned: it still answers and still
    // releases.
    pool.connection
        .end(Status::aborted("superseded by a new process of this member"))
        .await;
    while pool.connection.next().await.is_some() {}
    pool.connection = pool.gateway.next_connection().await;
    drop(old_sidecar);
    let mut old_sidecar = pool.sidecar(recovery_hello(ROUTE, &old, 3, false)).await;
    expect_release(&mut old_sidecar, 3).await;

    // The workload exits: the stop completes; the member goes on.
    old_sidecar
        .send(sidecar_message::Kind::Stopped(proto::runtime::v1::Stopped {
            reason: "released".into(),
            exit_code: Some(0),
            signal: None,
        }))
        .await;
    assert_eq!(old_sidecar.ended().await, Code::Ok);
    assert!(!pool.member.task.is_finished(), "the member exited");
}

/// A native sidecar's workload connects after the activation: the sidecar announces it with
/// WorkloadStarted and the owner reports that PID from then on.
#[tokio::test]
async fn a_workload_announced_after_activation_is_reported_with_its_pid() {
    let mut pool = Pool::start().await;
    pool.member.write_trust(&pool.gateway.recovery.keys.bundle());
    let instance = generation(1);
    pool.own(vec![placed(ROUTE, &instance, 1, Reserved)]).await;
    let sidecar = pool.take_over(&instance, 1, 0).await;
    let started = proto::runtime::v1::WorkloadStarted {
        workload: Some(proto::common::v1::WorkloadIdentity {
            pid: 7_777,
            ..Default::default()
        }),
    };
    sidecar.send(sidecar_message::Kind::WorkloadStarted(started)).await;
    pool.report_where(|r| status(r, ROUTE).is_some_and(|s| s.workload_pid == 7_777))
        .await;
}
