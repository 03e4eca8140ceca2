//! What keeps the monitoring component honest: every metric name its alert rules and its
//! dashboard use (kustomize/components/monitoring) is one that real processes export — two
//! gateway replicas, a supervisor member, a sandbox and a webhook on loopback, scraped on their
//! health ports — and the pool-wide gauges come from the coordinator only.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use e2e::local::{Config, LocalPool, http_get};
use proto::pool::v1::OperationKind;

/// The `/metrics` text of `address`.
async fn scrape(address: &str) -> String {
    http_get(address, "/metrics", Duration::from_secs(5))
        .await
        .unwrap_or_else(|| panic!("no /metrics from {address}"))
}

/// The sample names an exposition can carry: those of its samples, and those its `# TYPE`
/// lines promise (a labelled family with no sample yet, e.g. the coordinator's gauges on a
/// standby).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(typed) = line.strip_prefix("# TYPE ") {
            let (name, kind) = typed.split_once(' ').unwrap();
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    names
}

/// Every `openshell_…` name in the component's rules and dashboard.
fn used() -> BTreeSet<String> {
    let component = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kustomize/components/monitoring");
    let mut names = BTreeSet::new();
    for file in ["prometheusrule.yaml", "dashboard.json", "rules.test.yaml"] {
        let text = std::fs::read_to_string(component.join(file)).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("openshell_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_owned());
            rest = &tail[end..];
        }
    }
    names
}

/// The value of the sample `series` (name and labels as printed) in `text`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The `/metrics` of the one replica holding the lease and of the other, once the coordinator's
/// says `what` (`done`); panics after a minute.
async fn coordinator_once(pool: &LocalPool, what: &str, done: impl Fn(&str) -> bool) -> (String, String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut texts = Vec::new();
        for gateway in &pool.gateways {
            texts.push(scrape(&gateway.health).await);
        }
        let held: Vec<usize> = (0..texts.len())
            .filter(|&i| value(&texts[i], "openshell_gateway_coordinator") == Some(1.0))
            .collect();
        if let [c] = held[..]
            && done(&texts[c])
        {
            return (texts[c].clone(), texts[1 - c].clone());
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the coordinator never reported {what}; logs in {}",
            pool.logs().display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_and_dashboard_use_only_exported_metrics() {
    let root = tempfile::tempdir().unwrap();
    let config = Config {
        root: root.path().join("pool"),
        database_url: None,
        gateways: 2,
        members: 1,
        sandboxes: 1,
        lease_length_ms: 5000,
        plaintext: false,
        agent_interval_ms: e2e::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: false,
        policy: None,
        secrets: None,
    };
    let pool = LocalPool::start(config).await.unwrap();
    let (_, webhook_health, webhook) = e2e::flood::start_webhook(&pool).await.unwrap();

    coordinator_once(&pool, "the instance active", |text| {
        value(text, "openshell_gateway_instances{phase=\"active\"}") == Some(1.0)
    })
    .await;
    // A drain of the only member cannot move anything: it runs, waiting, with one instance left.
    let name = &pool.members[0].name;
    let mut operator = pool.operator(pool.endpoints()).await.unwrap();
    let run = poolctl::RunArgs {
        max_parallel: 1,
        timeout_secs: 600,
        wait: false,
    };
    let (drain, _) = operator.start(OperationKind::Drain, name, &run).await.unwrap();
    let remaining = format!(
        "openshell_gateway_operation_moves_remaining{{id=\"{}\",kind=\"drain\",target=\"{name}\"}}",
        drain.id
    );
    let (coordinator, standby) = coordinator_once(&pool, "the drain running", |text| {
        value(text, "openshell_gateway_operations{kind=\"drain\",phase=\"running\"}") == Some(1.0)
            && value(text, &remaining) == Some(1.0)
    })
    .await;
    assert!(
        value(
            &coordinator,
            &remaining.replace("moves_remaining", "last_progress_timestamp_seconds")
        )
        .is_some_and(|at| at > 1.7e9),
        "{coordinator}"
    );
    let member = scrape(&pool.members[0].health).await;
    let webhook_text = scrape(&webhook_health.to_string()).await;

    // Pool-wide gauges: the coordinator's view, never a standby's.
    assert_eq!(
        value(
            &coordinator,
            &format!("openshell_gateway_member_capacity{{member=\"{name}\"}}")
        ),
        Some(256.0),
        "{coordinator}"
    );
    assert_eq!(
        value(
            &coordinator,
            &format!("openshell_gateway_member_instances{{member=\"{name}\"}}")
        ),
        Some(1.0)
    );
    assert_eq!(
        value(&coordinator, "openshell_gateway_members{state=\"drained\"}"),
        Some(1.0)
    );
    // Local mode: the token files the coordinator delivered, issued within the token lifetime.
    assert!(
        value(
            &coordinator,
            "openshell_gateway_token_secret_oldest_issued_timestamp_seconds{kind=\"local_files\"}"
        )
        .is_some_and(|at| at > 1.7e9)
    );
    assert!(value(&coordinator, "openshell_gateway_coordinator_term").is_some_and(|t| t > 0.0));
    assert_eq!(value(&standby, "openshell_gateway_coordinator"), Some(0.0));
    assert!(
        !standby.contains("openshell_gateway_member_capacity{") && !standby.contains("openshell_gateway_instances{"),
        "a standby exports pool-wide gauges:\n{standby}"
    );
    // Counters are counters, started at zero so that increase() sees their first event.
    assert!(coordinator.contains("# TYPE openshell_gateway_recoveries_failed counter"));
    assert_eq!(
        value(
            &coordinator,
            "openshell_gateway_recoveries_failed_total{reason=\"deadline_passed\"}"
        ),
        Some(0.0)
    );

    let mut available = exported(&coordinator);
    available.extend(exported(&standby));
    available.extend(exported(&member));
    available.extend(exported(&webhook_text));
    let used = used();
    let missing: Vec<&String> = used.difference(&available).collect();
    assert!(
        missing.is_empty(),
        "the monitoring component uses metrics nothing exports: {missing:?}"
    );
    for prefix in ["openshell_gateway_", "openshell_supervisor_", "openshell_webhook_"] {
        assert!(used.iter().any(|n| n.starts_with(prefix)), "nothing of {prefix}*");
    }
    webhook.stop(Duration::from_secs(5)).await;
    pool.stop().await;
}
