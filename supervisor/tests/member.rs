//! A member driven against in-process fake gateway replicas over real sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;

use proto::common::v1::InstancePhase::{Active, Failed, Relinquished, Starting, Stopped};
use proto::host::v1::AssignmentPhase::{Active as Owned, Reserved};
use proto::host::v1::Snapshot;
use proto::host::v1::member_message::Kind;
use proto::runtime::v1::supervisor_runtime_client::SupervisorRuntimeClient;
use proto::timing;
use support::{FakeGateway, Member, entries, entry, owned, snapshot};
use tokio::time::Instant;
use tonic::{Code, Status};

#[tokio::test]
async fn hello_carries_identity_and_the_token_from_the_file() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start_with("supervisor-0", &[&gateway.endpoint], "token-one", &["--capacity", "7"]);
    let connection = gateway.next_connection().await;
    let hello = &connection.hello;
    assert_eq!(hello.member, "supervisor-0");
    assert_eq!(uuid::Uuid::parse_str(&hello.process_id).unwrap().get_version_num(), 4);
    assert_eq!(hello.connection_epoch, 1);
    assert_eq!(hello.capacity, 7);
    assert_eq!(hello.build_version, plumbing::build::version());
    assert!(hello.process_started_at_ms > 0);
    assert_eq!(connection.token.as_deref(), Some("token-one"));

    // The advertised runtime address is real: the runtime service answers there (and wants a
    // instance token).
    assert!(
        hello.runtime_address.starts_with("http://127.0.0.1:"),
        "{}",
        hello.runtime_address
    );
    let channel = tonic::transport::Endpoint::from_shared(hello.runtime_address.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let refused = SupervisorRuntimeClient::new(channel)
        .connect(tokio_stream::empty())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn snapshots_start_sessions_acks_follow_each_revision_and_reports_carry_terms() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;

    connection
        .send(snapshot(1, vec![owned("a", 1, Owned), owned("b", 2, Reserved)]))
        .await;
    assert_eq!(connection.acks_until(1).await, vec![1]);
    let report = connection.report_where(|r| !r.partial && r.applied_revision == 1).await;
    assert_eq!(entries(&report), vec![entry("a", 1, Active), entry("b", 2, Starting)]);
    let a = report.instances.iter().find(|s| s.route == "a").unwrap();
    assert_eq!(a.instance, Some(support::instance("a")));
    assert!(a.observed_at_ms > 0);

    // b moves to a higher term; a lower term for a is ignored.
    connection
        .send(snapshot(2, vec![owned("a", 1, Owned), owned("b", 3, Owned)]))
        .await;
    connection
        .send(snapshot(3, vec![owned("a", 0, Owned), owned("b", 2, Owned)]))
        .await;
    assert_eq!(connection.acks_until(3).await, vec![2, 3]);
    let report = connection
        .report_where(|r| !r.partial && r.applied_revision == 3 && entries(r).contains(&entry("b", 3, Active)))
        .await;
    assert_eq!(entries(&report), vec![entry("a", 1, Active), entry("b", 3, Active)]);
}

#[tokio::test]
async fn stop_routes_stop_omission_releases_and_keep_routes_keep() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;
    connection
        .send(snapshot(
            1,
            vec![
                owned("stop-me", 1, Owned),
                owned("omit-me", 1, Owned),
                owned("keep-me", 4, Owned),
            ],
        ))
        .await;
    connection.acks_until(1).await;

    connection
        .send(Snapshot {
            stop_routes: vec!["stop-me".into()],
            keep_routes: vec!["keep-me".into()],
            ..snapshot(2, vec![])
        })
        .await;
    connection.acks_until(2).await;
    let mut seen = BTreeSet::new();
    loop {
        let Some(Kind::StatusReport(report)) = connection.next().await.unwrap().kind else {
            continue;
        };
        let now = entries(&report);
        let keep = entry("keep-me", 4, Active);
        // A partial report lists only what changed: the kept route, unchanged, is absent.
        assert!(
            now.contains(&keep) || (report.partial && !now.iter().any(|e| e.0 == keep.0)),
            "kept route changed: {now:?}"
        );
        seen.extend(now.iter().cloned());
        if !report.partial && now == vec![keep] {
            break;
        }
    }
    assert!(seen.contains(&entry("stop-me", 1, Stopped)), "{seen:?}");
    assert!(seen.contains(&entry("omit-me", 1, Relinquished)), "{seen:?}");
    assert!(
        !seen.contains(&entry("omit-me", 1, Stopped)),
        "omission must never stop: {seen:?}"
    );
}

/// A store that rolled back lists a term this process released again: no sidecar takes it
/// any more, so the member reports it FAILED at once (the coordinator then reserves a higher
/// term) instead of waiting for a sidecar that never comes; a higher term is taken up.
#[tokio::test]
async fn a_released_term_listed_again_is_reported_failed_and_a_higher_one_is_taken_up() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;
    connection.send(snapshot(1, vec![owned("a", 3, Owned)])).await;
    connection
        .report_where(|r| entries(r).contains(&entry("a", 3, Active)))
        .await;
    connection.send(snapshot(2, vec![])).await;
    connection
        .report_where(|r| entries(r).contains(&entry("a", 3, Relinquished)))
        .await;

    connection.send(snapshot(3, vec![owned("a", 3, Owned)])).await;
    let report = connection.report_where(|r| entries(r).iter().any(|e| e.0 == "a")).await;
    assert_eq!(entries(&report), vec![entry("a", 3, Failed)]);
    let status = report.instances.iter().find(|s| s.route == "a").unwrap();
    assert!(status.message.contains("released term 3"), "{}", status.message);

    connection.send(snapshot(4, vec![owned("a", 4, Reserved)])).await;
    connection
        .report_where(|r| entries(r).contains(&entry("a", 4, Starting)))
        .await;
}

#[tokio::test]
async fn a_closed_stream_reconnects_with_the_next_epoch_and_keeps_hosting() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut first = gateway.next_connection().await;
    first.send(snapshot(1, vec![owned("a", 2, Owned)])).await;
    first.acks_until(1).await;
    first.close().await;

    let mut second = gateway.next_connection().await;
    assert_eq!(second.hello.connection_epoch, 2);
    assert_eq!(second.hello.process_id, first.hello.process_id);
    // The first report on the new stream still hosts the instance: nothing stopped or released.
    let report = second.report_where(|r| !r.partial).await;
    assert_eq!(entries(&report), vec![entry("a", 2, Active)]);
    assert_eq!(report.applied_revision, 0, "revisions are per stream");
    // Revisions restart at 1 on the new stream and are acked.
    second.send(snapshot(1, vec![owned("a", 2, Owned)])).await;
    assert_eq!(second.acks_until(1).await, vec![1]);
}

#[tokio::test]
async fn retriable_stream_ends_reconnect_with_a_new_epoch_each_time() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let first = gateway.next_connection().await;
    let mut connection = first;
    let process_id = connection.hello.process_id.clone();
    for (code, epoch) in [
        (Code::FailedPrecondition, 2),
        (Code::DeadlineExceeded, 3),
        (Code::Unavailable, 4),
    ] {
        connection.end(Status::new(code, "scripted end")).await;
        connection = gateway.next_connection().await;
        assert_eq!(connection.hello.connection_epoch, epoch, "after {code:?}");
        assert_eq!(connection.hello.process_id, process_id);
    }
}

#[tokio::test]
async fn the_token_file_is_reread_on_reconnect() {
    let mut gateway = FakeGateway::start().await;
    let member = Member::start("supervisor-0", &[&gateway.endpoint], "first-token");
    let first = gateway.next_connection().await;
    assert_eq!(first.token.as_deref(), Some("first-token"));
    member.write_token("rotated-token");
    first.end(Status::unauthenticated("token expired")).await;
    let second = gateway.next_connection().await;
    assert_eq!(second.token.as_deref(), Some("rotated-token"));
    assert_eq!(second.hello.connection_epoch, 2);
}

#[tokio::test]
async fn an_unreachable_replica_is_skipped() {
    let dead = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&dead, &gateway.endpoint], "t");
    let connection = gateway.next_connection().await;
    assert_eq!(connection.hello.connection_epoch, 2, "the failed attempt used epoch 1");
}

/// A link whose every chunk arrives 700 ms late each way: opening a stream takes a round trip
/// or more, beyond the 1 s connect bound. Before, every attempt timed out and the member never
/// attached again for as long as the link stayed slow; now a round of time-outs doubles the
/// bound, and a stream holds (the gateway's snapshot is acknowledged on it).
#[tokio::test]
async fn a_slow_link_still_carries_a_stream_once_attempts_get_longer() {
    let mut gateway = FakeGateway::start().await;
    let upstream = gateway.endpoint.trim_start_matches("http://").to_owned();
    let slow = testkit::fault::Path::start(upstream).await.unwrap();
    slow.slow(std::time::Duration::from_millis(700));
    let endpoint = format!("http://{}", slow.address);
    let _member = Member::start("supervisor-0", &[&endpoint], "t");
    let held = async {
        loop {
            // Attempts that time out reach the gateway too; only a held stream acknowledges.
            let mut connection = gateway.next_connection().await;
            connection.send(snapshot(1, vec![])).await;
            while let Some(message) = connection.next().await {
                if matches!(message.kind, Some(Kind::Ack(ref ack)) if ack.revision == 1) {
                    return connection.hello.connection_epoch;
                }
            }
        }
    };
    let epoch = tokio::time::timeout(std::time::Duration::from_secs(90), held)
        .await
        .expect("a stream held over the slow link");
    assert!(
        epoch > u64::from(timing::RECONNECT_ATTEMPTS),
        "the first round timed out: epoch {epoch}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_silent_gateway_is_left_for_another_replica() {
    let mut silent = FakeGateway::start().await;
    let mut other = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&silent.endpoint, &other.endpoint], "t");
    let mut connection = silent.next_connection().await;
    connection.send(snapshot(1, vec![owned("a", 1, Owned)])).await;
    connection.acks_until(1).await;
    connection.go_silent();
    let went_silent = Instant::now();

    let mut next = other.next_connection().await;
    let waited = went_silent.elapsed();
    assert!(
        waited >= timing::SILENCE_TIMEOUT - timing::HEARTBEAT_INTERVAL,
        "reconnected after {waited:?}"
    );
    assert!(
        waited <= timing::SILENCE_TIMEOUT + timing::CONNECT_TIMEOUT,
        "reconnected after {waited:?}"
    );
    assert_eq!(next.hello.connection_epoch, 2);
    assert!(silent.try_connection().is_none(), "preferred the other replica");
    let report = next.report_where(|r| !r.partial).await;
    assert_eq!(entries(&report), vec![entry("a", 1, Active)], "silence never releases");
    // Make before break: the silent stream stays open until the next one is attached. The
    // silent replica may still count the member by it, and ends the membership when it ends —
    // a no-op once the newer stream's record is there, a move of every instance before it.
    let ended = connection.ended_at().await;
    assert!(
        ended > next.hello_seen,
        "the silent stream ended (event {ended}) only after the next stream's hello (event {})",
        next.hello_seen
    );
}

#[tokio::test(start_paused = true)]
async fn status_reports_repeat_at_least_every_ten_seconds() {
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;
    connection.send(snapshot(1, vec![owned("a", 1, Owned)])).await;
    connection.acks_until(1).await;
    connection.report_where(|r| !r.partial && r.applied_revision == 1).await;
    for _ in 0..3 {
        let since = Instant::now();
        let report = connection.report_where(|r| !r.partial).await;
        assert!(
            since.elapsed() <= std::time::Duration::from_secs(10),
            "{:?}",
            since.elapsed()
        );
        assert_eq!(entries(&report), vec![entry("a", 1, Active)]);
    }
}

/// Whoever holds the member's token can attach under its name: neither an ABORTED stream
/// ("superseded by another process") nor a hello refused because another process holds the
/// name proves this process is not the member's live one, so the member attaches again, with
/// backoff and a new epoch, keeps hosting, and never exits for it.
#[tokio::test]
async fn a_member_superseded_by_a_stranger_reconnects_instead_of_exiting() {
    let mut gateway = FakeGateway::start().await;
    let member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;
    connection.send(snapshot(1, vec![owned("a", 1, Owned)])).await;
    connection.acks_until(1).await;
    connection
        .end(Status::aborted("superseded by a new process of this member"))
        .await;
    let refused = gateway.next_connection().await;
    assert_eq!(refused.hello.connection_epoch, 2);
    refused
        .end(Status::failed_precondition(
            "member supervisor-0 is held by another live process",
        ))
        .await;
    let mut back = gateway.next_connection().await;
    assert_eq!(back.hello.connection_epoch, 3);
    assert_eq!(back.hello.process_id, connection.hello.process_id);
    let report = back.report_where(|r| !r.partial).await;
    assert_eq!(
        entries(&report),
        vec![entry("a", 1, Active)],
        "nothing stopped or released"
    );
    assert!(!member.task.is_finished(), "the member exited");
}

#[tokio::test]
async fn a_refused_hello_is_fatal_with_the_gateways_message() {
    let gateway = FakeGateway::start().await;
    gateway.refuse_next(Status::invalid_argument(
        "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS: runtime_address must be a URI",
    ));
    let member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let err = member.exit().await.unwrap_err().to_string();
    assert!(
        err.contains("OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS: runtime_address must be a URI"),
        "{err}"
    );
}

#[tokio::test]
async fn graceful_shutdown_announces_leaving_and_hosts_until_released() {
    let mut gateway = FakeGateway::start().await;
    let member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;
    connection.send(snapshot(1, vec![owned("a", 1, Owned)])).await;
    connection.acks_until(1).await;

    member.shutdown.cancel();
    while !matches!(connection.next().await.unwrap().kind, Some(Kind::Leaving(_))) {}
    // Still hosting while the gateway has not moved the instance away.
    connection.send(snapshot(2, vec![owned("a", 1, Owned)])).await;
    connection.acks_until(2).await;
    let report = connection.report_where(|r| !r.partial && r.applied_revision == 2).await;
    assert_eq!(entries(&report), vec![entry("a", 1, Active)]);
    assert!(!member.task.is_finished());

    // The snapshot omits it: released (not stopped), reported, then the member leaves.
    connection.send(snapshot(3, vec![])).await;
    connection.acks_until(3).await;
    let mut released = false;
    while let Some(message) = connection.next().await {
        if let Some(Kind::StatusReport(report)) = message.kind {
            released |= entries(&report) == vec![entry("a", 1, Relinquished)];
        }
    }
    assert!(released, "the release was reported before the stream closed");
    member.exit().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn leaving_is_bounded_when_the_gateway_never_releases() {
    let mut gateway = FakeGateway::start().await;
    let member = Member::start("supervisor-0", &[&gateway.endpoint], "t");
    let mut connection = gateway.next_connection().await;
    connection.send(snapshot(1, vec![owned("a", 1, Owned)])).await;
    connection.acks_until(1).await;
    member.shutdown.cancel();
    let asked = Instant::now();
    member.exit().await.unwrap();
    let took = asked.elapsed();
    assert!(took >= supervisor::LEAVE_BOUND, "left after {took:?}");
    let mut left = false;
    while let Some(message) = connection.next().await {
        match message.kind {
            Some(Kind::Leaving(_)) => left = true,
            // Complete reports list it; partial ones list it only if it changed (it does not).
            Some(Kind::StatusReport(report)) if report.partial => assert!(entries(&report).is_empty()),
            Some(Kind::StatusReport(report)) => assert_eq!(entries(&report), vec![entry("a", 1, Active)]),
            _ => {}
        }
    }
    assert!(left, "Leaving was announced");
}

#[tokio::test]
async fn a_bad_member_name_is_refused_naming_the_setting() {
    let mut gateway = FakeGateway::start().await;
    let member = Member::start("Supervisor_0", &[&gateway.endpoint], "t");
    let err = member.exit().await.unwrap_err().to_string();
    assert!(err.contains("OPENSHELL_SUPERVISOR_POOL_MEMBER"), "{err}");
    assert!(err.contains("Supervisor_0"), "{err}");
    assert!(gateway.try_connection().is_none(), "never attached");
}
