use super::*;
use proto::pool::v1::{Coordinator, InstanceSummary, Member, PlannedMove, RefusedMove};

fn drain(phase: OperationPhase) -> Operation {
    Operation {
        id: "op-1".into(),
        kind: OperationKind::Drain as i32,
        target: "supervisor-0".into(),
        phase: phase as i32,
        message: "moving 2 instances off supervisor-0".into(),
        moves: 1,
        max_parallel: 2,
        requested_by: "local-operator".into(),
        ..Operation::default()
    }
}

fn pool() -> GetSupervisorPoolStatusResponse {
    GetSupervisorPoolStatusResponse {
        coordinator: Some(Coordinator {
            holder: "gateway-0/abc".into(),
            term: 3,
            expires_at_ms: 0,
        }),
        members: vec![Member {
            name: "supervisor-0".into(),
            process_id: "0123456789".into(),
            state: MemberState::Draining as i32,
            instance_count: 2,
            capacity: 256,
            served_by: "gateway-1".into(),
            ..Member::default()
        }],
        instances: vec![
            InstanceSummary {
                route: "team-a/agent-0".into(),
                owner_member: "supervisor-0".into(),
                term: 4,
                phase: InstancePhase::Active as i32,
                workload_pid: 4242,
                progress: 17,
                ..InstanceSummary::default()
            },
            InstanceSummary {
                route: "team-a/agent-1".into(),
                ..InstanceSummary::default()
            },
        ],
        operations: vec![drain(OperationPhase::Running)],
        served_by: "gateway-0".into(),
        ..GetSupervisorPoolStatusResponse::default()
    }
}

fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

#[test]
fn the_table_shows_coordinator_members_instances_with_their_pid_and_open_operations() {
    let text = status_table(&pool());
    assert!(text.contains("coordinator: gateway-0/abc (term 3)"), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| words(l) == ["supervisor-0", "01234567", "draining", "2", "256", "gateway-1"]),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| words(l) == ["team-a/agent-0", "supervisor-0", "4", "active", "4242", "17"]),
        "{text}"
    );
    // Unplaced, no report yet: no owner, no PID.
    assert!(
        lines
            .iter()
            .any(|l| words(l) == ["team-a/agent-1", "-", "0", "unspecified", "-", "0"]),
        "{text}"
    );
    assert!(
        text.contains("op-1 drain supervisor-0 running moves=1 parallel=2"),
        "{text}"
    );
}

#[test]
fn finished_operations_are_not_listed_but_a_drained_member_is() {
    let mut status = GetSupervisorPoolStatusResponse {
        operations: vec![drain(OperationPhase::Cancelled)],
        ..GetSupervisorPoolStatusResponse::default()
    };
    assert!(!status_table(&status).contains("OPERATIONS"));
    status.operations = vec![drain(OperationPhase::Succeeded)];
    assert!(status_table(&status).contains("op-1 drain supervisor-0 succeeded"));
}

#[test]
fn json_and_yaml_carry_the_same_document() {
    let status = pool();
    let json: Value = serde_json::from_str(&render(Output::Json, || status_json(&status), String::new)).unwrap();
    assert_eq!(json["instances"][0]["workloadPid"], 4242);
    assert_eq!(json["members"][0]["state"], "draining");
    assert_eq!(json["operations"][0]["phase"], "running");
    let yaml = render(Output::Yaml, || status_json(&status), String::new);
    assert!(yaml.starts_with("---\n"), "{yaml}");
    let parsed: Value = serde_yaml_ng::from_str(&yaml).unwrap();
    assert_eq!(parsed, json);
    assert!(
        !render(Output::Json, || status_json(&status), String::new).contains('\n'),
        "one line"
    );
}

#[test]
fn a_started_operation_says_whether_it_is_new() {
    let op = drain(OperationPhase::Pending);
    assert!(started(Output::Table, &op, true).starts_with("started: op-1 drain"));
    assert!(started(Output::Table, &op, false).starts_with("already running: op-1"));
    let json: Value = serde_json::from_str(&started(Output::Json, &op, false)).unwrap();
    assert_eq!(
        (json["created"].as_bool(), json["id"].as_str()),
        (Some(false), Some("op-1"))
    );
}

#[test]
fn a_dry_run_prints_moves_by_wave_and_what_would_not_move() {
    let plan = OperationPlan {
        moves: vec![PlannedMove {
            route: "team-a/agent-0".into(),
            from_member: "supervisor-0".into(),
            to_member: "supervisor-1".into(),
            term: 4,
            wave: 1,
        }],
        refused: vec![RefusedMove {
            route: "team-a/agent-1".into(),
            from_member: "supervisor-0".into(),
            reason: "all 1 eligible pool members are at capacity (supervisor-1 holds 2 of 2)".into(),
        }],
        completes: false,
        message: "waiting: all 1 eligible pool members are at capacity".into(),
        served_by: "gateway-1".into(),
        ..OperationPlan::default()
    };
    let text = plan_table(&plan);
    assert!(
        text.contains("nothing recorded") && text.contains("would not finish"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| words(l) == ["1", "team-a/agent-0", "supervisor-0", "supervisor-1", "4"]),
        "{text}"
    );
    assert!(
        text.contains("team-a/agent-1") && text.contains("holds 2 of 2"),
        "{text}"
    );
    let json = plan_json(&plan);
    assert_eq!(json["moves"][0]["to"], "supervisor-1");
    assert_eq!(json["refused"][0]["route"], "team-a/agent-1");
    assert_eq!(json["completes"], false);
}

#[test]
fn builds_are_counted_by_component_and_version_and_skew_is_a_warning() {
    let build = |component: &str, name: &str, version: &str| proto::pool::v1::Build {
        component: component.into(),
        name: name.into(),
        version: version.into(),
    };
    let mut status = pool();
    assert!(
        !status_table(&status).contains("BUILD"),
        "nothing reported, nothing shown"
    );
    status.builds = vec![
        build("gateway", "gateway-0", "0.2.0+aa"),
        build("member", "supervisor-0", "0.2.0+aa"),
        build("sidecar", "team-a/agent-0", "0.2.0+aa"),
        build("sidecar", "team-a/agent-1", ""),
    ];
    status.build_warnings = vec!["1 sidecar reports no release version (none, or one that is not a version)".into()];
    let text = status_table(&status);
    let lines: Vec<&str> = text.lines().collect();
    for row in [
        ["gateway", "0.2.0+aa", "1"].as_slice(),
        &["member", "0.2.0+aa", "1"],
        &["sidecar", "0.2.0+aa", "1"],
        &["sidecar", "(none", "reported)", "1"],
    ] {
        assert!(lines.iter().any(|l| words(l) == row), "{row:?} in {text}");
    }
    assert!(text.contains("warning: 1 sidecar reports no release version"), "{text}");
}
