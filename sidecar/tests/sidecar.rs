//! The sidecar driven in-process against a fake supervisor member and a fake registry over
//! real sockets, with real Ed25519 grants and proofs and a real workload process.

#![allow(clippy::expect_used)]

mod support;

use proto::runtime::v1::{
    Alive, Attached, ProgressAccepted, Redirect, Rejected, Release, WorkloadResponse, sidecar_message,
    supervisor_message, workload_request, workload_response,
};
use serde_json::json;
use sidecar::Outcome;
use support::{
    Fixture, RegistryCall, WorkloadClient, agent_command, process_exists, process_of, sleep_command, within,
};

/// Not a test: the workload process the sidecar starts in these tests (see `support`).
#[test]
#[ignore = "helper process started by the sidecar under test"]
fn workload_agent() {
    if let Ok(socket) = std::env::var("OPENSHELL_SIDECAR_SOCKET") {
        support::agent_main(&socket);
    }
}

fn respond(request_id: u64, kind: workload_response::Kind) -> supervisor_message::Kind {
    supervisor_message::Kind::WorkloadResponse(WorkloadResponse {
        request_id,
        kind: Some(kind),
    })
}

fn attached(term: u64, member: &str) -> supervisor_message::Kind {
    supervisor_message::Kind::Attached(Attached {
        route: "team-a/agent".into(),
        term,
        member: member.into(),
        process_id: process_of(member),
        recovery_deadline_ms: 0,
    })
}

async fn expect_request(conn: &mut support::Conn) -> (u64, workload_request::Kind) {
    match conn.recv().await {
        sidecar_message::Kind::WorkloadRequest(r) => (r.request_id, r.kind.expect("request kind")),
        other => panic!("expected a workload request, got {other:?}"),
    }
}

#[tokio::test]
async fn first_placement_receipt_activation_and_relay() {
    let mut fx = Fixture::new(agent_command()).await;
    let (run, _shutdown) = fx.start();
    let key = fx.registered().await;
    let mut conn = fx.member.accept().await;
    let sidecar_message::Kind::Attach(attach) = conn.recv().await else {
        panic!("first message must be Attach")
    };
    assert_eq!(attach.route, "team-a/agent");
    assert_eq!(attach.fence_term, 0);
    assert_eq!(
        attach.instance.as_ref().map(|i| i.generation),
        Some(support::GENERATION)
    );
    let workload = attach.workload.expect("workload identity");
    assert!(workload.pid > 1 && workload.exe_digest.len() == 32);

    // A request made before activation is held, not relayed.
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;
    agent.send(json!({"op": "progress", "value": 1, "id": "a"})).await;
    // The test process itself is not the workload (nor its descendant): refused.
    let mut stranger = WorkloadClient::connect(&fx.config.socket).await;
    let refused = stranger.answer().await;
    assert_eq!(refused["ok"], false, "{refused}");

    let jti = conn.present(&fx.signer, &fx.instance, 1, "m1").await;
    let sidecar_message::Kind::Receipt(receipt) = conn.recv().await else {
        panic!("expected the receipt (nothing relayed before activation)")
    };
    assert!(key.verifies(&receipt), "receipt MAC verifies with the registered key");
    assert_eq!(
        (receipt.term, receipt.fenced_term, receipt.grant_id.as_str()),
        (1, 0, jti.as_str())
    );
    assert_eq!(
        receipt.workload.as_ref(),
        Some(&workload),
        "identity checkpointed in the receipt"
    );
    conn.confirm(&fx.signer, &fx.instance, 1, "m1", &jti, 0).await;

    let (id, kind) = expect_request(&mut conn).await;
    assert_eq!(id, 1);
    assert!(
        matches!(kind, workload_request::Kind::ReportProgress(ref p) if p.value == 1),
        "{kind:?}"
    );
    conn.send(respond(
        id,
        workload_response::Kind::ProgressAccepted(ProgressAccepted { value: 1 }),
    ))
    .await;
    assert_eq!(
        agent.answer().await,
        json!({"ok": true, "op": "progress", "value": 1, "term": 1, "member": "m1", "id": "a"})
    );

    // A workload holds no credential: the sidecar answers itself and asks no owner.
    agent.send(json!({"op": "credential"})).await;
    let answer = agent.answer().await;
    assert_eq!(
        (answer["ok"].as_bool(), answer["error"].as_str()),
        (Some(false), Some(proto::egress::NO_CREDENTIAL))
    );

    agent.send(json!({"op": "liveness"})).await;
    let (id, _) = expect_request(&mut conn).await;
    conn.send(respond(
        id,
        workload_response::Kind::Rejected(Rejected {
            reason: "policy".into(),
        }),
    ))
    .await;
    assert_eq!(agent.answer().await, json!({"ok": false, "error": "policy"}));
    agent.send(json!({"op": "liveness"})).await;
    let (id, _) = expect_request(&mut conn).await;
    conn.send(respond(id, workload_response::Kind::Alive(Alive {}))).await;
    assert_eq!(agent.answer().await["alive"], true);

    // Release by the owner: the workload is stopped, Stopped reported, instance deregistered.
    let release = Release {
        term: 1,
        reason: "deleted".into(),
    };
    conn.send(supervisor_message::Kind::Release(release)).await;
    let sidecar_message::Kind::Stopped(stopped) = conn.recv().await else {
        panic!("expected Stopped")
    };
    assert_eq!(stopped.reason, "released: deleted");
    assert_eq!(stopped.signal, Some(nix::sys::signal::Signal::SIGTERM as i32));
    assert_eq!(within("run to end", run).await.unwrap().unwrap(), Outcome::Released);
    assert!(matches!(fx.registry_call().await, RegistryCall::Deregister(d) if d.reason == "released: deleted"));
    assert!(!process_exists(workload.pid), "the workload was reaped");
}

#[tokio::test]
async fn takeover_fences_the_silent_owner_and_its_later_messages() {
    let mut fx = Fixture::new(agent_command()).await;
    let (run, shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    assert!(matches!(m1.recv().await, sidecar_message::Kind::Attach(_)));
    let (old_grant, _) = fx.signer.grant(&fx.instance, 1, "m1");
    m1.take_over(&fx.signer, &fx.instance, 2, "m1", 0).await;
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;

    // A request reaches m1, then m1 hangs: the request fails towards the workload.
    agent.send(json!({"op": "progress", "value": 10})).await;
    let (id, _) = expect_request(&mut m1).await;
    m1.silence();
    m1.closed().await;
    let failed = agent.answer().await;
    assert_eq!(failed["ok"], false);
    assert!(
        failed["error"].as_str().unwrap_or_default().contains("not replayed"),
        "{failed}"
    );
    // m1's late answer goes nowhere (its stream is closed).
    m1.send(respond(
        id,
        workload_response::Kind::ProgressAccepted(ProgressAccepted { value: 10 }),
    ))
    .await;

    // Recovery: a held request is relayed only to the new owner, after activation.
    let mut m2 = fx.member.accept().await;
    let sidecar_message::Kind::RecoveryHello(hello) = m2.recv().await else {
        panic!("expected RecoveryHello")
    };
    assert_eq!((hello.fence_term, hello.attempt, hello.relinquished), (2, 1, false));
    assert!(hello.deadline_remaining_ms > 0 && hello.deadline_remaining_ms <= 60_000);
    agent.send(json!({"op": "progress", "value": 11})).await;
    let receipt = m2.take_over(&fx.signer, &fx.instance, 3, "m2", 0).await;
    assert_eq!(receipt.fenced_term, 2);
    let (id, kind) = expect_request(&mut m2).await;
    assert_eq!(id, 1, "request ids restart per stream");
    assert!(matches!(kind, workload_request::Kind::ReportProgress(ref p) if p.value == 11));
    m2.send(respond(
        id,
        workload_response::Kind::ProgressAccepted(ProgressAccepted { value: 11 }),
    ))
    .await;
    let answer = agent.answer().await;
    assert_eq!(
        (
            answer["value"].as_u64(),
            answer["term"].as_u64(),
            answer["member"].as_str()
        ),
        (Some(11), Some(3), Some("m2"))
    );

    // m2 goes away; the stale owner m1 resumes and answers the recovery at its old term.
    m2.end();
    let mut stale = fx.member.accept().await;
    assert!(matches!(stale.recv().await, sidecar_message::Kind::RecoveryHello(h) if h.fence_term == 3));
    stale.send(attached(2, "m1")).await;
    stale.closed().await;
    // ... and with its old, valid grant for a lower term: no receipt.
    let mut stale = fx.member.accept().await;
    assert!(matches!(stale.recv().await, sidecar_message::Kind::RecoveryHello(_)));
    stale.present_token(&old_grant, "m1").await;
    assert_eq!(stale.recv_or_closed().await, None, "a fenced grant gets no receipt");
    // A Release for the fenced term from a non-owner stream is ignored too.
    let mut stale = fx.member.accept().await;
    assert!(matches!(stale.recv().await, sidecar_message::Kind::RecoveryHello(_)));
    let release = Release {
        term: 2,
        reason: "stale".into(),
    };
    stale.send(supervisor_message::Kind::Release(release)).await;
    // The current owner re-attaches on that same stream: relay works, the workload lives on.
    stale.send(attached(3, "m2")).await;
    agent.send(json!({"op": "liveness"})).await;
    let (id, _) = expect_request(&mut stale).await;
    stale.send(respond(id, workload_response::Kind::Alive(Alive {}))).await;
    assert_eq!(agent.answer().await["alive"], true);

    shutdown.cancel();
    assert_eq!(within("run to end", run).await.unwrap().unwrap(), Outcome::Shutdown);
}

#[tokio::test(start_paused = true)]
async fn recovery_hello_budget_and_missed_deadline_in_simulated_time() {
    const DEADLINE_MS: u64 = 5_000;
    let mut fx = Fixture::new(sleep_command()).await;
    let (run, _shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    let sidecar_message::Kind::Attach(attach) = m1.recv().await else {
        panic!()
    };
    let pid = attach.workload.map(|w| w.pid).unwrap_or_default();
    assert!(process_exists(pid));
    m1.take_over(&fx.signer, &fx.instance, 1, "m1", DEADLINE_MS).await;

    m1.silence();
    m1.closed().await;

    // Collect every hello until the sidecar gives up. The second stream's member becomes a
    // candidate, gets its receipt and never confirms (lost response): it must not extend the
    // deadline. Times are the sidecar's own (deadline_remaining_ms): in paused time, arrival
    // instants jump with every idle turn of the runtime.
    let mut hellos: Vec<(u32, u64)> = Vec::new();
    let mut receipted = false;
    let report = loop {
        let mut conn = tokio::select! {
            conn = fx.member.accept() => conn,
            call = fx.registry.recv() => match call {
                Some(RegistryCall::RecoveryFailed(report)) => break report,
                other => panic!("unexpected registry call {other:?}"),
            },
        };
        while let Some(kind) = conn.recv_or_closed().await {
            let sidecar_message::Kind::RecoveryHello(hello) = kind else {
                panic!("unexpected {kind:?}")
            };
            hellos.push((hello.attempt, hello.deadline_remaining_ms));
            assert_eq!(hello.fence_term, 1);
            if hellos.len() == 2 && !receipted {
                receipted = true;
                conn.present(&fx.signer, &fx.instance, 2, "m2").await;
                assert!(matches!(conn.recv().await, sidecar_message::Kind::Receipt(_)));
                conn.end(); // the candidate's activation failed: it gives up the stream
            }
        }
    };
    assert!(receipted, "the candidate got its receipt");
    let attempts: Vec<u32> = hellos.iter().map(|h| h.0).collect();
    assert_eq!(
        attempts,
        (1..=attempts.len() as u32).collect::<Vec<_>>(),
        "numbered from 1"
    );
    assert!((3..=5).contains(&hellos.len()), "bounded: {hellos:?}");
    let interval = u64::try_from(proto::timing::RECOVERY_HELLO_INTERVAL.as_millis()).unwrap();
    assert!(
        hellos[0].1 <= DEADLINE_MS && hellos[0].1 + 2 * interval > DEADLINE_MS,
        "first hello at once"
    );
    for pair in hellos.windows(2) {
        // Also: the receipt did not extend the deadline (the remaining time only shrinks).
        assert!(pair[0].1 >= pair[1].1 + interval, "at most one per second: {hellos:?}");
    }
    assert!(hellos.iter().all(|h| h.1 > 0), "never at or past the deadline");
    assert!(
        hellos[hellos.len() - 1].1 <= interval,
        "kept trying until the last slot: {hellos:?}"
    );
    assert_eq!((report.fence_term, report.receipted_term), (1, 2));
    assert_eq!(report.attempts as usize, hellos.len());
    assert_eq!(report.recovery_deadline_ms, DEADLINE_MS);
    assert_eq!(
        within("run to end", run).await.unwrap().unwrap(),
        Outcome::RecoveryFailed
    );
    assert!(!process_exists(pid), "the workload was stopped and reaped");
}

#[tokio::test(start_paused = true)]
async fn release_during_recovery_wins() {
    let mut fx = Fixture::new(sleep_command()).await;
    let (run, _shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    let sidecar_message::Kind::Attach(attach) = m1.recv().await else {
        panic!()
    };
    let pid = attach.workload.map(|w| w.pid).unwrap_or_default();
    m1.take_over(&fx.signer, &fx.instance, 1, "m1", 0).await;
    m1.end();

    let mut m2 = fx.member.accept().await;
    assert!(matches!(m2.recv().await, sidecar_message::Kind::RecoveryHello(_)));
    // Not a candidate yet: its Release is ignored (the grant below still gets a receipt).
    let early = Release {
        term: 2,
        reason: "too early".into(),
    };
    m2.send(supervisor_message::Kind::Release(early)).await;
    m2.present(&fx.signer, &fx.instance, 2, "m2").await;
    assert!(matches!(m2.recv().await, sidecar_message::Kind::Receipt(_)));
    assert!(process_exists(pid));
    // The receipted candidate releases (the instance was deleted) before activating.
    let release = Release {
        term: 2,
        reason: "instance deleted".into(),
    };
    m2.send(supervisor_message::Kind::Release(release)).await;
    let sidecar_message::Kind::Stopped(stopped) = m2.recv().await else {
        panic!("expected Stopped")
    };
    assert_eq!(stopped.reason, "released: instance deleted");
    assert_eq!(within("run to end", run).await.unwrap().unwrap(), Outcome::Released);
    assert!(matches!(fx.registry_call().await, RegistryCall::Deregister(_)));
    assert!(!process_exists(pid));
}

#[tokio::test]
async fn fence_state_survives_a_restart() {
    let mut fx = Fixture::new(agent_command()).await;
    let (run, shutdown) = fx.start();
    let key = fx.registered().await;
    let mut m1 = fx.member.accept().await;
    assert!(matches!(m1.recv().await, sidecar_message::Kind::Attach(_)));
    let (old_grant, _) = fx.signer.grant(&fx.instance, 2, "m0");
    m1.take_over(&fx.signer, &fx.instance, 3, "m1", 0).await;
    // Activated once a request is relayed.
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;
    agent.send(json!({"op": "liveness"})).await;
    let (id, _) = expect_request(&mut m1).await;
    m1.send(respond(id, workload_response::Kind::Alive(Alive {}))).await;
    assert_eq!(agent.answer().await["ok"], true);
    shutdown.cancel();
    assert_eq!(
        within("first run to end", run).await.unwrap().unwrap(),
        Outcome::Shutdown
    );
    assert!(fx.registry.try_recv().is_err(), "a shutdown does not deregister");

    let (run, shutdown) = fx.start();
    assert_eq!(fx.registered().await, key, "the receipt key survives the restart");
    let mut conn = fx.member.accept().await;
    let first = conn.recv().await;
    let sidecar_message::Kind::RecoveryHello(hello) = first else {
        panic!("a restarted sidecar recovers, got {first:?}")
    };
    assert_eq!((hello.fence_term, hello.relinquished), (3, false));
    // The persisted fence still refuses a lower term ...
    conn.present_token(&old_grant, "m0").await;
    assert_eq!(conn.recv_or_closed().await, None);
    // ... and takes the activated owner back.
    let mut conn = fx.member.accept().await;
    assert!(matches!(conn.recv().await, sidecar_message::Kind::RecoveryHello(_)));
    conn.send(attached(3, "m1")).await;
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;
    agent.send(json!({"op": "progress", "value": 5})).await;
    let (id, _) = expect_request(&mut conn).await;
    conn.send(respond(
        id,
        workload_response::Kind::ProgressAccepted(ProgressAccepted { value: 5 }),
    ))
    .await;
    assert_eq!(agent.answer().await["ok"], true);
    shutdown.cancel();
    assert_eq!(
        within("second run to end", run).await.unwrap().unwrap(),
        Outcome::Shutdown
    );
}

#[tokio::test]
async fn redirects_are_followed_unless_below_the_fence() {
    let mut fx = Fixture::new(sleep_command()).await;
    let mut owner = support::Member::start().await;
    let mut stale = support::Member::start().await;
    let (run, shutdown) = fx.start();
    fx.registered().await;
    let mut router = fx.member.accept().await;
    assert!(matches!(router.recv().await, sidecar_message::Kind::Attach(_)));
    let redirect = |address: &str, term| {
        supervisor_message::Kind::Redirect(Redirect {
            route: "team-a/agent".into(),
            runtime_address: address.into(),
            member: "m".into(),
            process_id: "p".into(),
            term,
        })
    };
    router.send(redirect(&owner.address, 4)).await;
    let mut conn = owner.accept().await;
    assert!(matches!(conn.recv().await, sidecar_message::Kind::Attach(a) if a.fence_term == 0));
    conn.take_over(&fx.signer, &fx.instance, 4, "m4", 0).await;
    conn.end();
    // In recovery the route redirects to an owner of a fenced term: ignored, the sidecar
    // comes back to the route instead of dialing the stale member.
    let mut router = fx.member.accept().await;
    assert!(matches!(router.recv().await, sidecar_message::Kind::RecoveryHello(_)));
    router.send(redirect(&stale.address, 3)).await;
    let mut router = fx.member.accept().await;
    assert!(matches!(router.recv().await, sidecar_message::Kind::RecoveryHello(_)));
    assert!(stale.idle(), "a redirect below the fence is not followed");
    shutdown.cancel();
    assert_eq!(within("run to end", run).await.unwrap().unwrap(), Outcome::Shutdown);
}

/// A native sidecar starts before its workload: the instance is placed and activated with no
/// workload known (Attach carries pid 0), and the workload connects afterwards. The owner
/// must then learn which process it is (it reports the PID to the gateway).
#[tokio::test]
async fn a_workload_that_connects_after_activation_is_announced_to_the_owner() {
    let mut fx = Fixture::new(Vec::new()).await;
    let (run, shutdown) = fx.start();
    fx.registered().await;
    let mut conn = fx.member.accept().await;
    let sidecar_message::Kind::Attach(attach) = conn.recv().await else {
        panic!("first message must be Attach")
    };
    assert_eq!(attach.workload.map_or(0, |w| w.pid), 0, "no workload yet");
    let jti = conn.present(&fx.signer, &fx.instance, 1, "m1").await;
    let sidecar_message::Kind::Receipt(_) = conn.recv().await else {
        panic!("expected the receipt")
    };
    conn.confirm(&fx.signer, &fx.instance, 1, "m1", &jti, 0).await;

    // The workload (this test process) connects now.
    let mut agent = WorkloadClient::connect(&fx.config.socket).await;
    agent.send(json!({"op": "progress", "value": 7})).await;
    let sidecar_message::Kind::WorkloadStarted(started) = conn.recv().await else {
        panic!("expected WorkloadStarted before the first relayed request")
    };
    assert_eq!(started.workload.map(|w| w.pid), Some(std::process::id()));
    let (id, kind) = expect_request(&mut conn).await;
    assert!(
        matches!(kind, workload_request::Kind::ReportProgress(ref p) if p.value == 7),
        "{kind:?}"
    );
    conn.send(respond(
        id,
        workload_response::Kind::ProgressAccepted(ProgressAccepted { value: 7 }),
    ))
    .await;
    assert_eq!(agent.answer().await["ok"], true);
    shutdown.cancel();
    within("run to end", run).await.expect("join").expect("sidecar");
}

/// The kubelet restarts a workload's container within a second of the sidecar stopping it at
/// the recovery deadline — while the sidecar is still closing its streams and reporting the
/// failure. The end is dated by when the workload was last seen running, so the restarted
/// process counts as new and the next run supervises it as the next generation (it used to be
/// dated after the report, and such a Pod stayed unsupervised for good).
#[tokio::test]
async fn a_container_restarted_at_once_after_a_deadline_stop_is_the_next_generation() {
    const DEADLINE_MS: u64 = 1_500;
    let mut fx = Fixture::new(Vec::new()).await;
    let (run, _shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    let sidecar_message::Kind::Attach(_) = m1.recv().await else {
        panic!("first message must be Attach")
    };
    m1.take_over(&fx.signer, &fx.instance, 1, "m1", DEADLINE_MS).await;

    // The workload: a process of its own in the "Pod", identified when it talks to the socket.
    let command = agent_command();
    let mut workload = tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .env("OPENSHELL_SIDECAR_SOCKET", &fx.config.socket)
        .kill_on_drop(true)
        .spawn()
        .expect("workload");
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;
    agent.send(json!({"op": "liveness"})).await;
    let sidecar_message::Kind::WorkloadStarted(started) = m1.recv().await else {
        panic!("expected WorkloadStarted")
    };
    assert_eq!(started.workload.map(|w| w.pid), workload.id());
    let (id, _) = expect_request(&mut m1).await;
    m1.send(respond(id, workload_response::Kind::Alive(Alive {}))).await;
    assert_eq!(agent.answer().await["alive"], true);

    // The owner goes silent; the members the sidecar asks next never answer either.
    m1.silence();
    let mut silent = Vec::new();
    let stopped = loop {
        tokio::select! {
            conn = fx.member.accept() => {
                conn.silence();
                silent.push(conn);
            }
            status = workload.wait() => break status.expect("wait"),
        }
    };
    assert!(!stopped.success(), "stopped at the deadline: {stopped}");
    // The kubelet's first restart comes at once (on the next clock tick at the soonest).
    let reaped = sidecar::identity::ticks_since_boot().await;
    within("the clock to move", async {
        while sidecar::identity::ticks_since_boot().await <= reaped {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let restarted = tokio::process::Command::new("sleep")
        .arg("60")
        .kill_on_drop(true)
        .spawn()
        .expect("the restarted workload");
    let restarted_at = sidecar::identity::read_stat(restarted.id().expect("pid"))
        .expect("stat")
        .start_time_ticks;

    loop {
        if let RegistryCall::RecoveryFailed(_) = fx.registry_call().await {
            break;
        }
    }
    assert_eq!(
        within("run to end", run).await.expect("join").expect("sidecar"),
        Outcome::RecoveryFailed
    );
    let state = sidecar::state_file::StateFile::new(&fx.config.state_dir)
        .load()
        .expect("state")
        .expect("a saved state");
    assert!(
        state.next_generation,
        "restartPolicy Always: the next process is supervised"
    );
    assert!(
        state.ended_at_ticks < restarted_at,
        "the end ({}) is dated before the restarted process started ({restarted_at})",
        state.ended_at_ticks
    );

    let (next, shutdown) = fx.start();
    let RegistryCall::Register(again) = fx.registry_call().await else {
        panic!("expected the next generation's Register")
    };
    // The registry gave the first run `fx.instance.generation`.
    let generation = again.instance.map_or(0, |i| i.generation);
    assert_eq!(generation, fx.instance.generation + 1);
    shutdown.cancel();
    within("the next run to end", next)
        .await
        .expect("join")
        .expect("sidecar");
}

/// A workload never identified (it never talked to the socket and the sidecar does not look
/// for it in this test's PID namespace) when its recovery deadline passes: nothing is stopped,
/// the registry is told so, and the next run registers the next generation at once — before,
/// it waited for a new process that never came and the Pod stayed unsupervised for good.
#[tokio::test]
async fn a_missed_deadline_without_an_identified_workload_stops_nothing_and_registers_again() {
    const DEADLINE_MS: u64 = 1_500;
    let mut fx = Fixture::new(Vec::new()).await;
    let (run, _shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    let sidecar_message::Kind::Attach(_) = m1.recv().await else {
        panic!("first message must be Attach")
    };
    m1.take_over(&fx.signer, &fx.instance, 1, "m1", DEADLINE_MS).await;

    // The owner goes silent, and so does every member the sidecar asks next.
    m1.silence();
    let mut silent = Vec::new();
    let failed = loop {
        tokio::select! {
            conn = fx.member.accept() => {
                conn.silence();
                silent.push(conn);
            }
            call = within("a registry call", fx.registry.recv()) => {
                if let Some(RegistryCall::RecoveryFailed(request)) = call {
                    break request;
                }
            }
        }
    };
    assert!(
        failed.reason.contains("nothing was stopped"),
        "the registry hears that nothing was stopped: {:?}",
        failed.reason
    );
    assert_eq!(
        within("run to end", run).await.expect("join").expect("sidecar"),
        Outcome::RecoveryFailed
    );
    let state = sidecar::state_file::StateFile::new(&fx.config.state_dir)
        .load()
        .expect("state")
        .expect("a saved state");
    assert!(state.next_generation && state.ended_at_ticks == 0, "{state:?}");

    let (next, shutdown) = fx.start();
    let RegistryCall::Register(again) = fx.registry_call().await else {
        panic!("expected the next generation's Register")
    };
    assert_eq!(again.instance.map_or(0, |i| i.generation), fx.instance.generation + 1);
    shutdown.cancel();
    within("the next run to end", next)
        .await
        .expect("join")
        .expect("sidecar");
}
