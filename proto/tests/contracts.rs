//! Contract tests: every package round-trips through the wire format, the descriptor set
//! exposes all five services with the expected RPC shapes, and every declared element of the
//! .proto files carries documentation.

use std::collections::BTreeMap;
use std::error::Error;

use prost::Message;
use prost_types::{FileDescriptorProto, FileDescriptorSet, source_code_info::Location};
use proto::common::v1::{InstancePhase, InstanceRef, RouteDirectoryEntry, WorkloadIdentity};
use proto::{host, pool, recovery, registry, runtime};

type TestResult = Result<(), Box<dyn Error>>;

fn instance() -> InstanceRef {
    InstanceRef {
        namespace: "team-a".into(),
        name: "agent-0".into(),
        uid: "5f0c9a4e-0000-4000-8000-000000000001".into(),
        generation: 3,
    }
}

fn workload() -> WorkloadIdentity {
    WorkloadIdentity {
        pid: 42,
        start_time_ticks: 123_456,
        exe_digest: vec![7; 32],
    }
}

fn receipt() -> recovery::v1::Receipt {
    recovery::v1::Receipt {
        route: "team-a/agent-0".into(),
        instance: Some(instance()),
        term: 8,
        grant_id: "grant-1".into(),
        grant_digest: vec![1; 32],
        fenced_term: 7,
        workload: Some(workload()),
        issued_at_ms: 1_700_000_000_000,
        mac: vec![9; 32],
    }
}

/// Encodes and decodes `msg`, asserting equality and a non-trivial encoding.
fn round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(msg: &M) -> TestResult {
    let bytes = msg.encode_to_vec();
    assert!(!bytes.is_empty(), "{msg:?} encoded to nothing");
    assert!(bytes.len() <= proto::MAX_MESSAGE_BYTES);
    let decoded = M::decode(bytes.as_slice())?;
    assert_eq!(&decoded, msg);
    Ok(())
}

#[test]
fn host_snapshot_round_trips() -> TestResult {
    use host::v1::{AssignmentPhase, GatewayMessage, OwnedInstance, Snapshot, gateway_message};
    let msg = GatewayMessage {
        kind: Some(gateway_message::Kind::Snapshot(Snapshot {
            revision: 5,
            instances: vec![OwnedInstance {
                route: "team-a/agent-0".into(),
                instance: Some(instance()),
                term: 8,
                phase: AssignmentPhase::Reserved.into(),
                credentials: b"{\"material\":true}".to_vec(),
                grant: "eyJ.eyJ.sig".into(),
                grant_expires_at_ms: 1_700_000_030_000,
                egress_policy: Some(proto::runtime::v1::EgressPolicy {
                    name: "default".into(),
                    revision: 1_767_225_600_000_002,
                    ..Default::default()
                }),
            }],
            stop_routes: vec!["team-a/old".into()],
            keep_routes: vec!["team-a/pending".into()],
            directory: vec![RouteDirectoryEntry {
                route: "team-a/agent-0".into(),
                member: "supervisor-1".into(),
                process_id: "p-1".into(),
                runtime_address: "http://10.0.0.2:50061".into(),
                term: 8,
            }],
            recovery_deadline_ms: 0,
            gateway_replica: "gateway-0".into(),
            directory_delta: false,
            directory_removed: vec![],
        })),
    };
    round_trip(&msg)?;

    use host::v1::{Hello, MemberMessage, member_message};
    round_trip(&MemberMessage {
        kind: Some(member_message::Kind::Hello(Hello {
            member: "supervisor-1".into(),
            process_id: "p-1".into(),
            connection_epoch: 2,
            runtime_address: "http://10.0.0.2:50061".into(),
            capacity: proto::MAX_INSTANCES_PER_MEMBER,
            build_version: "0.1.0".into(),
            process_started_at_ms: 1_700_000_000_000,
            directory_deltas: true,
        })),
    })
}

#[test]
fn runtime_receipt_round_trips_inside_sidecar_message() -> TestResult {
    use runtime::v1::{SidecarMessage, sidecar_message};
    let msg = SidecarMessage {
        kind: Some(sidecar_message::Kind::Receipt(receipt())),
    };
    round_trip(&msg)?;

    use runtime::v1::{ProgressAccepted, SupervisorMessage, WorkloadResponse, supervisor_message, workload_response};
    round_trip(&SupervisorMessage {
        kind: Some(supervisor_message::Kind::WorkloadResponse(WorkloadResponse {
            request_id: 17,
            kind: Some(workload_response::Kind::ProgressAccepted(ProgressAccepted {
                value: 99,
            })),
        })),
    })
}

#[test]
fn recovery_activate_round_trips() -> TestResult {
    round_trip(&recovery::v1::ActivateRequest {
        receipt: Some(receipt()),
        grant: "eyJ.eyJ.sig".into(),
    })
}

#[test]
fn registry_register_round_trips() -> TestResult {
    round_trip(&registry::v1::RegisterResponse {
        instance: Some(instance()),
        owner: Some(RouteDirectoryEntry {
            route: "team-a/agent-0".into(),
            member: "supervisor-0".into(),
            process_id: "p-0".into(),
            runtime_address: "http://10.0.0.1:50061".into(),
            term: 1,
        }),
        term: 1,
        recovery_deadline_ms: 60_000,
        instance_token: "header.claims.signature".into(),
        instance_token_expires_at_ms: 1_800_000_000_000,
    })
}

#[test]
fn pool_status_round_trips() -> TestResult {
    use pool::v1::{
        Build, Coordinator, GetSupervisorPoolStatusResponse, InstanceSummary, Member, MemberState, Operation,
        OperationKind, OperationPhase,
    };
    round_trip(&GetSupervisorPoolStatusResponse {
        coordinator: Some(Coordinator {
            holder: "gateway-0/abc".into(),
            term: 4,
            expires_at_ms: 1_700_000_005_000,
        }),
        members: vec![Member {
            name: "supervisor-0".into(),
            process_id: "p-0".into(),
            state: MemberState::Draining.into(),
            instance_count: 2,
            capacity: 256,
            last_heartbeat_at_ms: 1_700_000_000_000,
            runtime_address: "http://10.0.0.1:50061".into(),
            served_by: "gateway-1".into(),
            connection_epoch: 1,
            build_version: "0.1.0".into(),
            expires_at_ms: 1_700_000_015_000,
        }],
        instances: vec![InstanceSummary {
            route: "team-a/agent-0".into(),
            instance: Some(instance()),
            owner_member: "supervisor-0".into(),
            owner_process_id: "p-0".into(),
            term: 1,
            reserved: false,
            phase: InstancePhase::Active.into(),
            last_report_at_ms: 1_700_000_000_000,
            message: String::new(),
            workload_pid: 42,
            progress: 7,
        }],
        operations: vec![Operation {
            id: "op-1".into(),
            kind: OperationKind::Drain.into(),
            target: "supervisor-0".into(),
            phase: OperationPhase::Running.into(),
            message: "moving 2 instances".into(),
            attempts: 1,
            moves: 1,
            deadline_at_ms: 1_700_000_600_000,
            max_parallel: 1,
            requested_by: "alice".into(),
            created_at_ms: 1_700_000_000_000,
            updated_at_ms: 1_700_000_001_000,
        }],
        observed_at_ms: 1_700_000_001_500,
        served_by: "gateway-0".into(),
        builds: vec![Build {
            component: "sidecar".into(),
            name: "team-a/agent-0".into(),
            version: "0.1.0+3f1c2ab9e0d4".into(),
        }],
        build_warnings: vec!["1 sidecar reports no build".into()],
    })
}

fn descriptor_set() -> Result<FileDescriptorSet, prost::DecodeError> {
    FileDescriptorSet::decode(proto::FILE_DESCRIPTOR_SET)
}

/// (client streaming, server streaming) per method, keyed by "package.Service/Method".
fn methods(set: &FileDescriptorSet) -> BTreeMap<String, (bool, bool)> {
    let mut out = BTreeMap::new();
    for file in &set.file {
        for service in &file.service {
            for method in &service.method {
                out.insert(
                    format!("{}.{}/{}", file.package(), service.name(), method.name()),
                    (method.client_streaming(), method.server_streaming()),
                );
            }
        }
    }
    out
}

#[test]
fn descriptor_set_contains_all_five_services_with_their_rpcs() -> TestResult {
    let set = descriptor_set()?;
    let services: Vec<String> = set
        .file
        .iter()
        .flat_map(|f| f.service.iter().map(move |s| format!("{}.{}", f.package(), s.name())))
        .collect();
    for name in proto::SERVICE_NAMES {
        assert!(services.iter().any(|s| s == name), "{name} missing from {services:?}");
    }
    assert_eq!(services.len(), 5, "unexpected services: {services:?}");

    let expected: BTreeMap<String, (bool, bool)> = [
        ("openshell.supervisor.host.v1.SupervisorHost/Attach", (true, true)),
        (
            "openshell.supervisor.host.v1.SupervisorHost/RecordAudit",
            (false, false),
        ),
        (
            "openshell.supervisor.runtime.v1.SupervisorRuntime/Connect",
            (true, true),
        ),
        (
            "openshell.supervisor.recovery.v1.SupervisorRecovery/IssueGrant",
            (false, false),
        ),
        (
            "openshell.supervisor.recovery.v1.SupervisorRecovery/Activate",
            (false, false),
        ),
        (
            "openshell.supervisor.recovery.v1.SupervisorRecovery/TrustBundle",
            (false, false),
        ),
        (
            "openshell.supervisor.registry.v1.InstanceRegistry/Register",
            (false, false),
        ),
        (
            "openshell.supervisor.registry.v1.InstanceRegistry/Deregister",
            (false, false),
        ),
        (
            "openshell.supervisor.registry.v1.InstanceRegistry/ReportRecoveryFailed",
            (false, false),
        ),
        (
            "openshell.supervisor.pool.v1.SupervisorPool/GetSupervisorPoolStatus",
            (false, false),
        ),
        (
            "openshell.supervisor.pool.v1.SupervisorPool/StartSupervisorPoolOperation",
            (false, false),
        ),
        (
            "openshell.supervisor.pool.v1.SupervisorPool/CancelSupervisorPoolOperation",
            (false, false),
        ),
        (
            "openshell.supervisor.pool.v1.SupervisorPool/WatchSupervisorPool",
            (false, true),
        ),
        ("openshell.supervisor.pool.v1.SupervisorPool/ListAudit", (false, false)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(methods(&set), expected);
    Ok(())
}

/// Human-readable name of the element a source location path points at, or None for paths
/// that are not declarations we require docs for.
fn element_name(file: &FileDescriptorProto, path: &[i32]) -> Option<String> {
    // FileDescriptorProto: message_type = 4, enum_type = 5, service = 6.
    // DescriptorProto: field = 2, nested_type = 3, enum_type = 4, oneof_decl = 8.
    // EnumDescriptorProto: value = 2. ServiceDescriptorProto: method = 2.
    let idx = |i: usize| path.get(i).and_then(|v| usize::try_from(*v).ok());
    match (path.first()?, path.len()) {
        (4, _) => {
            let mut msg = file.message_type.get(idx(1)?)?;
            let mut name = msg.name().to_owned();
            let mut rest = &path[2..];
            loop {
                match rest {
                    [] => return Some(name),
                    [3, i, tail @ ..] => {
                        msg = msg.nested_type.get(usize::try_from(*i).ok()?)?;
                        name = format!("{name}.{}", msg.name());
                        rest = tail;
                    }
                    [2, i] => {
                        let f = msg.field.get(usize::try_from(*i).ok()?)?;
                        return Some(format!("{name}.{}", f.name()));
                    }
                    [4, i] => {
                        let e = msg.enum_type.get(usize::try_from(*i).ok()?)?;
                        return Some(format!("{name}.{}", e.name()));
                    }
                    [4, i, 2, v] => {
                        let e = msg.enum_type.get(usize::try_from(*i).ok()?)?;
                        let v = e.value.get(usize::try_from(*v).ok()?)?;
                        return Some(format!("{name}.{}.{}", e.name(), v.name()));
                    }
                    _ => return None,
                }
            }
        }
        (5, 2) => Some(file.enum_type.get(idx(1)?)?.name().to_owned()),
        (5, 4) if path[2] == 2 => {
            let e = file.enum_type.get(idx(1)?)?;
            Some(format!("{}.{}", e.name(), e.value.get(idx(3)?)?.name()))
        }
        (6, 2) => Some(file.service.get(idx(1)?)?.name().to_owned()),
        (6, 4) if path[2] == 2 => {
            let s = file.service.get(idx(1)?)?;
            Some(format!("{}.{}", s.name(), s.method.get(idx(3)?)?.name()))
        }
        _ => None,
    }
}

fn documented(loc: &Location) -> bool {
    !loc.leading_comments().trim().is_empty() || !loc.trailing_comments().trim().is_empty()
}

#[test]
fn every_message_field_enum_value_and_rpc_is_documented() -> TestResult {
    let set = descriptor_set()?;
    let mut checked = 0usize;
    let mut undocumented = Vec::new();
    for file in set
        .file
        .iter()
        .filter(|f| f.package().starts_with("openshell.supervisor."))
    {
        let info = file
            .source_code_info
            .as_ref()
            .ok_or("descriptor set lacks source info")?;
        for loc in &info.location {
            if let Some(name) = element_name(file, &loc.path) {
                checked += 1;
                if !documented(loc) {
                    undocumented.push(format!("{}: {name}", file.name()));
                }
            }
        }
    }
    assert!(checked > 200, "only {checked} elements inspected");
    assert!(
        undocumented.is_empty(),
        "undocumented elements:\n{}",
        undocumented.join("\n")
    );
    Ok(())
}

#[test]
fn receipt_mac_input_covers_every_field_but_the_mac() {
    let base = receipt();
    let input = base.mac_input();
    assert!(input.starts_with(&[0, 0, 0, 40]));
    assert!(input[4..].starts_with(recovery::v1::Receipt::MAC_DOMAIN.as_bytes()));

    let mut same = base.clone();
    same.mac = vec![0; 32];
    assert_eq!(same.mac_input(), input, "the mac must not cover itself");

    type Mutation = fn(&mut recovery::v1::Receipt);
    let mutations: [(&str, Mutation); 13] = [
        ("route", |r| r.route.push('x')),
        ("namespace", |r| {
            if let Some(i) = r.instance.as_mut() {
                i.namespace.push('x');
            }
        }),
        ("name", |r| {
            if let Some(i) = r.instance.as_mut() {
                i.name.push('x');
            }
        }),
        ("uid", |r| {
            if let Some(i) = r.instance.as_mut() {
                i.uid.push('x');
            }
        }),
        ("generation", |r| {
            if let Some(i) = r.instance.as_mut() {
                i.generation += 1;
            }
        }),
        ("term", |r| r.term += 1),
        ("grant_id", |r| r.grant_id.push('x')),
        ("grant_digest", |r| r.grant_digest[0] ^= 1),
        ("fenced_term", |r| r.fenced_term += 1),
        ("pid", |r| {
            if let Some(w) = r.workload.as_mut() {
                w.pid += 1;
            }
        }),
        ("start_time_ticks", |r| {
            if let Some(w) = r.workload.as_mut() {
                w.start_time_ticks += 1;
            }
        }),
        ("exe_digest", |r| {
            if let Some(w) = r.workload.as_mut() {
                w.exe_digest[0] ^= 1;
            }
        }),
        ("issued_at_ms", |r| r.issued_at_ms += 1),
    ];
    for (field, mutate) in mutations {
        let mut changed = base.clone();
        mutate(&mut changed);
        assert_ne!(changed.mac_input(), input, "{field} is not covered by the MAC");
    }

    // Length prefixes keep field boundaries unambiguous.
    let mut a = base.clone();
    let mut b = base;
    a.route = "ab".into();
    a.grant_id = "c".into();
    b.route = "a".into();
    b.grant_id = "bc".into();
    assert_ne!(a.mac_input(), b.mac_input());
}

#[test]
fn bearer_helpers() {
    assert_eq!(proto::bearer_value("t0k"), "Bearer t0k");
    assert_eq!(proto::bearer_token("Bearer t0k"), Some("t0k"));
    assert_eq!(proto::bearer_token(" bearer   t0k "), Some("t0k"));
    assert_eq!(proto::bearer_token("Basic t0k"), None);
    assert_eq!(proto::bearer_token("Bearer "), None);
    assert_eq!(proto::bearer_token("Bearer"), None);

    let mut md = tonic::metadata::MetadataMap::new();
    assert_eq!(proto::bearer_token_from_metadata(&md), None);
    if let Ok(v) = proto::bearer_value("abc.def.ghi").parse() {
        md.insert(proto::AUTHORIZATION_METADATA_KEY, v);
    }
    assert_eq!(proto::bearer_token_from_metadata(&md), Some("abc.def.ghi"));
}

#[test]
fn defaults_and_bounds() {
    use pool::v1::StartSupervisorPoolOperationRequest as Start;
    let start = |max_parallel| Start {
        max_parallel,
        ..Start::default()
    };
    assert_eq!(start(0).effective_max_parallel(), Some(1));
    assert_eq!(start(1).effective_max_parallel(), Some(1));
    assert_eq!(start(8).effective_max_parallel(), Some(8));
    assert_eq!(start(9).effective_max_parallel(), None);

    assert_eq!(proto::timing::recovery_deadline(0).as_millis(), 60_000);
    assert_eq!(proto::timing::recovery_deadline(5_000).as_millis(), 5_000);

    assert_eq!(InstancePhase::from_wire(2), InstancePhase::Active);
    assert_eq!(InstancePhase::from_wire(0), InstancePhase::Failed);
    assert_eq!(InstancePhase::from_wire(1_000), InstancePhase::Failed);
    assert!(InstancePhase::Stopped.is_terminal());
    assert!(!InstancePhase::Recovering.is_terminal());
    assert_eq!(InstancePhase::Active.to_string(), "INSTANCE_PHASE_ACTIVE");
    assert_eq!(
        instance().to_string(),
        "team-a/agent-0#3 (5f0c9a4e-0000-4000-8000-000000000001)"
    );
}
