//! The local pool as real processes: gateway replicas and supervisor members
//! on loopback with the embedded SQLite store, over TLS.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use e2e::local::{Config, LocalPool};
use proto::pool::v1::{GetSupervisorPoolStatusResponse, MemberState};

/// A TLS pool on the embedded SQLite store under `root`.
fn config(root: &std::path::Path, gateways: usize, members: usize, sandboxes: usize) -> Config {
    Config {
        root: root.join("pool"),
        database_url: None,
        gateways,
        members,
        sandboxes,
        lease_length_ms: 5000,
        plaintext: false,
        agent_interval_ms: e2e::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: false,
        policy: None,
        secrets: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_show_up_in_the_pool_status() {
    let root = tempfile::tempdir().unwrap();
    let pool = LocalPool::start(config(root.path(), 2, 2, 0)).await.unwrap();
    // TLS by default: https:// everywhere, a private key only its owner reads.
    let tls = pool.tls.clone().expect("TLS by default");
    assert!(pool.endpoints().iter().all(|e| e.starts_with("https://127.0.0.1:")));
    assert!(pool.members.iter().all(|m| m.runtime_address.starts_with("https://")));
    let mode = |path: &std::path::Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).unwrap().permissions()) & 0o777
    };
    assert_eq!(mode(&tls.key), 0o600);
    // Every secret of the pool is its owner's only: the root, the KEK, the database.
    let root_dir = &pool.config.root;
    assert_eq!(mode(root_dir), 0o700);
    for name in ["key-encryption-key", "gateway.db"] {
        assert_eq!(mode(&root_dir.join(name)), 0o600, "{name}");
    }
    // The database URL reaches the gateways through their environment, not their argv.
    for gateway in &pool.gateways {
        let pid = gateway.process.pid().unwrap();
        let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let argv = String::from_utf8_lossy(&argv);
        assert!(argv.contains("--key-encryption-key-file"), "{argv}");
        assert!(!argv.contains("sqlite:") && !argv.contains("database"), "{argv}");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(status) = pool.status().await {
            let active = status
                .members
                .iter()
                .filter(|m| m.state == MemberState::Active as i32)
                .count();
            if active == 2 && status.coordinator.is_some() {
                break status;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "members never became active; logs in {}",
            pool.logs().display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let names: Vec<&str> = status.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, vec!["supervisor-0", "supervisor-1"]);
    let rendered = poolctl::render::status_table(&status);
    assert!(
        rendered.contains("supervisor-0") && rendered.contains("coordinator: gateway-"),
        "{rendered}"
    );
    pool.stop().await;
}

/// The scale scenario's machinery on a small pool: simulated members attach over TLS, every
/// registration is answered, every instance reaches a member's snapshot, no stream breaks,
/// and the figures it prints are filled in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scale_scenario_places_every_registered_instance() {
    let root = tempfile::tempdir().unwrap();
    let settings = e2e::scale::Settings {
        members: 3,
        concurrency: 8,
        rest: Duration::from_secs(1),
        ..e2e::scale::Settings::new(120, root.path().join("scale"), e2e::chaos::Backend::Sqlite)
    };
    let report = e2e::scale::run(&settings).await.unwrap();
    assert_eq!(report.refused, 0);
    assert_eq!(report.streams_ended, 0, "no member stream broke");
    assert!(report.snapshots >= 3 && report.final_snapshot_bytes > 0);
    assert!(report.snapshot_bytes >= report.final_snapshot_bytes);
    assert_eq!(
        report.replicas.iter().filter(|r| r.coordinator).count(),
        1,
        "{report:?}"
    );
    assert!(e2e::scale::table(&[report]).contains("| sqlite | 120 | 3 |"));
}

/// The busy-member scenario's machinery on a few sessions: gathered on one member, drained at
/// max_parallel 8 and 1, and its member killed — every step moves every session without
/// restarting a workload, and the at-rest figures are read. The members attach to the replica
/// started last, so the coordinator is usually another replica (which must learn of each
/// move's activation from the store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_scenario_moves_every_session_without_a_restart() {
    let root = tempfile::tempdir().unwrap();
    let settings = e2e::scale::sessions::Settings {
        sessions: 4,
        root: root.path().join("sessions"),
        backend: e2e::chaos::Backend::Sqlite,
        members_on_standby: true,
    };
    let report = e2e::scale::sessions::run(&settings).await.unwrap();
    let steps: Vec<(&str, usize, bool)> = report
        .steps
        .iter()
        .map(|s| (s.step.split(' ').next().unwrap_or(""), s.moved, s.pids_preserved))
        .collect();
    assert_eq!(steps.len(), 4, "{report:?}");
    assert!(
        steps[1..].iter().all(|(_, moved, kept)| *moved == 4 && *kept),
        "{report:?}"
    );
    assert_eq!(steps[3].0, "SIGKILL");
    assert!(
        report.at_rest.member_rss_mib > 0.0 && report.at_rest.report_bytes_per_s > 0.0,
        "{report:?}"
    );
    assert!(report.coordinator_serves_members.is_some(), "{report:?}");
    assert!(e2e::scale::sessions::table(&[report]).contains("| sqlite | 4 |"));
}

/// The workload PID shows in the pool status from the instance's first placement on: the
/// streamed statuses show no PID until the workload is known (its sidecar may report the
/// instance ACTIVE before the agent first connects to it, or the agent may be identified
/// while the owner still takes it), then the agent's real PID, at term 1 — never another PID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_pid_shows_from_the_first_placement() {
    let root = tempfile::tempdir().unwrap();
    let pool = LocalPool::start(config(root.path(), 1, 1, 1)).await.unwrap();
    let agent = pool.sandboxes[0].agent.pid().unwrap();
    let mut client = pool.operator(pool.endpoints()).await.unwrap();
    let mut statuses = client.watch();
    let shown = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let status = statuses.next().await.unwrap();
            let Some(instance) = status.instances.first() else {
                continue;
            };
            assert!(
                [0, agent].contains(&instance.workload_pid),
                "{instance:?}: the agent is {agent}"
            );
            if instance.workload_pid != 0 {
                assert_eq!(instance.term, 1, "the first placement: {instance:?}");
                if instance.phase == proto::common::v1::InstancePhase::Active as i32 {
                    return instance.clone();
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the PID never showed; logs in {}", pool.logs().display()));
    assert_eq!(shown.term, 1, "the first placement: {shown:?}");
    assert_eq!(shown.owner_member, "supervisor-0", "{shown:?}");
    assert_eq!(
        shown.phase,
        proto::common::v1::InstancePhase::Active as i32,
        "{shown:?}"
    );
    let table = poolctl::render::status_table(&GetSupervisorPoolStatusResponse {
        instances: vec![shown],
        ..GetSupervisorPoolStatusResponse::default()
    });
    assert!(table.contains(&agent.to_string()), "{table}");
    pool.stop().await;
}

/// A move is not a restart in the pool status either: after a drain the instance shows the
/// same workload PID and its progress goes on from where it was, never from 0 (the new owner
/// reports the instance before the agent sent it any progress).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_instance_keeps_its_progress_in_the_status() {
    let root = tempfile::tempdir().unwrap();
    let pool = LocalPool::start(config(root.path(), 1, 2, 1)).await.unwrap();
    let mut client = pool.operator(pool.endpoints()).await.unwrap();
    let logs = pool.logs();
    let mut last = None;
    let before = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let status = client.status().await.unwrap();
            last = status.instances.first().cloned();
            if let Some(i) = status
                .instances
                .first()
                .filter(|i| i.progress > 0 && i.workload_pid != 0)
            {
                return i.clone();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no progress shown: {last:?}; logs in {}", logs.display()));
    let run = poolctl::RunArgs {
        max_parallel: 1,
        timeout_secs: 60,
        wait: true,
    };
    let (op, _) = client
        .start(proto::pool::v1::OperationKind::Drain, &before.owner_member, &run)
        .await
        .unwrap();
    client.wait(&op.id, &mut poolctl::Progress::quiet()).await.unwrap();
    let mut statuses = client.watch();
    let moved = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let status = statuses.next().await.unwrap();
            let Some(i) = status.instances.first() else {
                continue;
            };
            if i.term > before.term && i.phase == proto::common::v1::InstancePhase::Active as i32 {
                return i.clone();
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the move never showed; logs in {}", logs.display()));
    assert_ne!(moved.owner_member, before.owner_member, "{moved:?}");
    assert_eq!(moved.workload_pid, before.workload_pid, "{moved:?}");
    assert!(
        moved.progress >= before.progress,
        "progress went back from {} after the move: {moved:?}",
        before.progress
    );
    pool.stop().await;
}

/// An upstream on loopback answering every request `200 upstream`.
async fn upstream() -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let n = stream.read(&mut buf).await.unwrap_or(0);
                // "upstream", and the Authorization header it got, if any.
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                let auth = head
                    .lines()
                    .find_map(|l| l.strip_prefix("authorization: "))
                    .map(|v| format!(" auth={v}"))
                    .unwrap_or_default();
                let body = format!("upstream{auth}");
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    port
}

/// `GET http://127.0.0.1:<port>/` through the egress proxy at `proxy`: status and body.
async fn through(proxy: &str, port: u16) -> (u16, String) {
    through_with(proxy, port, "").await
}

/// The same with `headers` (each line ending in CRLF).
async fn through_with(proxy: &str, port: u16, headers: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(proxy).await.ok()?;
        let request = format!(
            "GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}Connection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        stream.take(1 << 20).read_to_end(&mut answer).await.ok()?;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n")?;
        let status = head.split(' ').nth(1)?.parse().ok()?;
        Some((status, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(10), ask)
        .await
        .ok()
        .flatten()
        .unwrap_or((0, String::new()))
}

/// A credential through a real local pool: the member reads it from the secrets directory and
/// installs it with the policy; the sidecar puts it into the requests its rule allows and
/// nowhere else; a rotated file reaches the sidecar under the same revision; and it stays in
/// force while the owner is SIGKILLed and another member takes the instance over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_credential_reaches_only_its_bound_upstream_through_an_owner_crash() {
    let root = tempfile::tempdir().unwrap();
    let (bound, other) = (upstream().await, upstream().await);
    let secrets = root.path().join("secrets");
    std::fs::create_dir_all(secrets.join("models")).unwrap();
    std::fs::write(secrets.join("models").join("token"), "sk-local-1\n").unwrap();
    let policy = root.path().join("policy.yaml");
    let document = format!(
        "name: local-default\nrevision: 1\nrules:\n  - name: models\n    host: 127.0.0.1\n    ports: [{bound}]\n    credential: models\n  - name: other\n    host: 127.0.0.1\n    ports: [{other}]\ncredentials:\n  - name: models\n    env: MODELS_API_KEY\n    secretKeyRef: {{name: models, key: token}}\n"
    );
    std::fs::write(&policy, document).unwrap();
    let mut config = config(root.path(), 1, 2, 1);
    config.policy = Some(policy);
    config.secrets = Some(secrets.clone());
    let mut pool = LocalPool::start(config).await.unwrap();
    let proxy = pool.sandboxes[0].egress.clone().expect("an egress proxy");
    let logs = pool.logs().display().to_string();
    let header = format!("Authorization: Bearer {}\r\n", proto::egress::placeholder("models"));
    let sent = |value: &str| (200, format!("upstream auth=Bearer {value}"));

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while through_with(&proxy, bound, &header).await != sent("sk-local-1") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never substituted; logs in {logs}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        through_with(&proxy, other, &header).await,
        sent(&proto::egress::placeholder("models")),
        "another upstream gets the placeholder"
    );

    // Rotated: the same revision, the new value.
    std::fs::write(secrets.join("models").join("token"), "sk-local-2").unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while through_with(&proxy, bound, &header).await != sent("sk-local-2") {
        assert!(tokio::time::Instant::now() < deadline, "never rotated; logs in {logs}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The owner dies: the value is held by the sidecar, not the owner.
    let status = pool.status().await.unwrap();
    let owner = status.instances[0].owner_member.clone();
    let index = pool.members.iter().position(|m| m.name == owner).unwrap();
    pool.members[index].process.kill().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert_eq!(
            through_with(&proxy, bound, &header).await,
            sent("sk-local-2"),
            "substituted during the handoff; logs in {logs}"
        );
        let moved = pool.status().await.ok().and_then(|s| s.instances.first().cloned());
        if moved.is_some_and(|i| {
            i.owner_member != owner
                && !i.owner_member.is_empty()
                && i.phase == proto::common::v1::InstancePhase::Active as i32
        }) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never moved; logs in {logs}");
    }
    assert_eq!(through_with(&proxy, bound, &header).await, sent("sk-local-2"));
    pool.stop().await;
}

/// The policy file as a real pool carries it: each member installs it in the sidecars it owns,
/// stamped with its term; the sidecar's proxy decides from it — and goes on deciding from it,
/// unchanged, while its owner is SIGKILLed and another member takes the instance over. An edit
/// of the file then reaches the sidecar through its new owner: the decisions turn and the
/// tunnel the edit no longer allows is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_policy_is_enforced_by_the_sidecar_through_an_owner_crash() {
    let root = tempfile::tempdir().unwrap();
    let (allowed, denied) = (upstream().await, upstream().await);
    let policy = root.path().join("policy.yaml");
    let document = format!(
        "name: local-default\nrevision: 1\nrules:\n  - name: upstream\n    host: 127.0.0.1\n    ports: [{allowed}]\n"
    );
    std::fs::write(&policy, document).unwrap();
    let mut config = config(root.path(), 1, 2, 1);
    config.policy = Some(policy.clone());
    let mut pool = LocalPool::start(config).await.unwrap();
    let proxy = pool.sandboxes[0].egress.clone().expect("an egress proxy");
    let logs = pool.logs().display().to_string();

    // Every answered request is one decision of the audit trail.
    let mut decided = 0u64;
    let mut count = |status: u16| {
        if status == 200 || status == 403 {
            decided += 1;
        }
        status
    };
    // Denied until the owner's install arrives; then allowed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let answer = through(&proxy, allowed).await;
        count(answer.0);
        if answer == (200, "upstream".into()) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never allowed; logs in {logs}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = through(&proxy, denied).await;
    count(status);
    assert_eq!(status, 403, "{body}");
    let refusal: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (refusal["policy"].as_str(), refusal["revision"].as_u64()),
        (Some("local-default"), Some(1))
    );
    assert_eq!(refusal["ruleNeeded"]["ports"][0], denied);

    // The owner dies; every request meanwhile is decided as before, without an owner.
    let status = pool.status().await.unwrap();
    let owner = status.instances[0].owner_member.clone();
    let index = pool.members.iter().position(|m| m.name == owner).unwrap();
    pool.members[index].process.kill().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut asked = 0;
    loop {
        assert_eq!(
            count(through(&proxy, allowed).await.0),
            200,
            "allowed during the handoff; logs in {logs}"
        );
        assert_eq!(count(through(&proxy, denied).await.0), 403, "denied during the handoff");
        asked += 1;
        let moved = pool.status().await.ok().and_then(|s| s.instances.first().cloned());
        if moved.is_some_and(|i| {
            i.owner_member != owner
                && !i.owner_member.is_empty()
                && i.phase == proto::common::v1::InstancePhase::Active as i32
        }) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never moved; logs in {logs}");
    }
    assert!(asked > 0);

    // A tunnel through the new owner's time, then the edit that revokes it.
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tunnel = tokio::net::TcpStream::connect(&proxy).await.unwrap();
    let connect = format!("CONNECT 127.0.0.1:{allowed} HTTP/1.1\r\nHost: 127.0.0.1:{allowed}\r\n\r\n");
    tunnel.write_all(connect.as_bytes()).await.unwrap();
    let mut head = [0u8; 12];
    tunnel.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let edited = format!(
        "name: local-default\nrevision: 2\nrules:\n  - name: the-other\n    host: 127.0.0.1\n    ports: [{denied}]\n"
    );
    let t0 = tokio::time::Instant::now();
    std::fs::write(&policy, edited).unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tunnel.read_to_end(&mut rest))
        .await
        .unwrap_or_else(|_| panic!("the revoked tunnel stayed open; logs in {logs}"))
        .unwrap();
    let revoked = t0.elapsed();
    assert_eq!(count(through(&proxy, allowed).await.0), 403);
    let answer = through(&proxy, denied).await;
    count(answer.0);
    assert_eq!(answer, (200, "upstream".into()));
    eprintln!("policy edit to revoked tunnel: {} ms", revoked.as_millis());
    // The revoked tunnel is a decision too.
    let decided = decided + 1;

    // The audit trail holds every decision exactly once, through the owner's crash: the
    // records the dead owner had not had stored went to the next one.
    let name = pool.sandboxes[0].name.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let trail = loop {
        let trail = pool.audit(&name).await.unwrap_or_default();
        if trail.len() as u64 >= decided || tokio::time::Instant::now() >= deadline {
            break trail;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let sequences: Vec<u64> = trail
        .iter()
        .filter_map(|e| e.record.as_ref().map(|r| r.sequence))
        .collect();
    assert_eq!(
        sequences,
        (1..=decided).collect::<Vec<_>>(),
        "every decision once, in order; logs in {logs}"
    );
    let owners: std::collections::BTreeSet<&str> = trail.iter().map(|e| e.member.as_str()).collect();
    assert!(owners.len() >= 2, "delivered through both owners: {owners:?}");
    let revoked_tunnel = trail
        .iter()
        .filter_map(|e| e.record.as_ref())
        .find(|r| r.reason.contains("no longer allows"));
    assert!(
        revoked_tunnel.is_some_and(|r| r.decision == "allow" && r.destination.ends_with(&format!(":{allowed}"))),
        "the tunnel's record says why it closed: {revoked_tunnel:?}"
    );
    let exchange = trail
        .iter()
        .filter_map(|e| e.record.as_ref())
        .find(|r| r.decision == "allow" && r.method == "GET");
    assert!(
        exchange.is_some_and(|r| r.bytes_sent == 0 && r.bytes_received == 8),
        "a plain-HTTP exchange carries its body bytes each way (a GET sends none): {exchange:?}"
    );
    eprintln!("audit trail: {decided} decisions, each stored once, delivered by {owners:?}");
    pool.stop().await;
}
