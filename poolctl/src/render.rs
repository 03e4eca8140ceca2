//! Pure rendering: every answer as a table (comfy-table) or plain line for people, and as
//! one JSON value for programs, printed as JSON or YAML.

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, Table};
use proto::common::v1::InstancePhase;
use proto::pool::v1::{
    GetSupervisorPoolStatusResponse, MemberState, Operation, OperationKind, OperationPhase, OperationPlan,
};
use serde_json::{Value, json};

use crate::cli::Output;

/// `value` in `output` (`table` for people): JSON on one line, YAML as a `---` document.
pub fn render(output: Output, value: impl FnOnce() -> Value, table: impl FnOnce() -> String) -> String {
    match output {
        Output::Table => table(),
        Output::Json => value().to_string(),
        Output::Yaml => {
            let yaml = serde_yaml_ng::to_string(&value()).unwrap_or_else(|err| format!("# cannot render: {err}\n"));
            format!("---\n{}", yaml.trim_end())
        }
    }
}

/// The name of a protobuf enum value without its type prefix, lower case.
fn enum_name(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase()
}

pub fn phase_name(phase: i32) -> String {
    enum_name(
        OperationPhase::try_from(phase).unwrap_or_default().as_str_name(),
        "OPERATION_PHASE_",
    )
}

fn kind_name(kind: i32) -> String {
    enum_name(
        OperationKind::try_from(kind).unwrap_or_default().as_str_name(),
        "OPERATION_KIND_",
    )
}

fn member_state(state: i32) -> String {
    enum_name(
        MemberState::try_from(state).unwrap_or_default().as_str_name(),
        "MEMBER_STATE_",
    )
}

fn instance_phase(phase: i32) -> String {
    enum_name(
        InstancePhase::try_from(phase).unwrap_or_default().as_str_name(),
        "INSTANCE_PHASE_",
    )
}

pub fn is_finished(op: &Operation) -> bool {
    [
        OperationPhase::Succeeded,
        OperationPhase::Failed,
        OperationPhase::Cancelled,
    ]
    .iter()
    .any(|p| *p as i32 == op.phase)
}

/// A borderless table with `header`, the columns in `right` right-aligned.
fn table(header: &[&str], right: &[usize], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut table = Table::new();
    table.load_preset(NOTHING).set_header(header.to_vec());
    for row in rows {
        table.add_row(row);
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    for index in right {
        if let Some(column) = table.column_mut(*index) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
        .lines()
        .map(|l| l.trim_end().to_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

/// One operation on one line.
pub fn operation_line(op: &Operation) -> String {
    let target = if op.target.is_empty() { "-" } else { op.target.as_str() };
    format!(
        "{} {} {target} {} moves={} parallel={} by={} — {}",
        op.id,
        kind_name(op.kind),
        phase_name(op.phase),
        op.moves,
        op.max_parallel,
        op.requested_by,
        op.message
    )
}

/// One operation for programs.
pub fn operation_json(o: &Operation) -> Value {
    json!({
        "id": o.id,
        "kind": kind_name(o.kind),
        "target": o.target,
        "phase": phase_name(o.phase),
        "moves": o.moves,
        "maxParallel": o.max_parallel,
        "message": o.message,
        "requestedBy": o.requested_by,
        "createdAtMs": o.created_at_ms,
        "updatedAtMs": o.updated_at_ms,
        "deadlineAtMs": o.deadline_at_ms,
    })
}

/// A started (or already running) operation.
pub fn started(output: Output, op: &Operation, created: bool) -> String {
    render(
        output,
        || {
            let mut value = operation_json(op);
            value["created"] = created.into();
            value
        },
        || {
            let verb = if created { "started" } else { "already running" };
            format!("{verb}: {}", operation_line(op))
        },
    )
}

/// Pool status for programs: one document with the same facts as the table.
pub fn status_json(status: &GetSupervisorPoolStatusResponse) -> Value {
    let members: Vec<_> = status
        .members
        .iter()
        .map(|m| {
            json!({
                "name": m.name,
                "processId": m.process_id,
                "state": member_state(m.state),
                "instances": m.instance_count,
                "capacity": m.capacity,
                "runtimeAddress": m.runtime_address,
                "servedBy": m.served_by,
                "build": m.build_version,
            })
        })
        .collect();
    let instances: Vec<_> = status
        .instances
        .iter()
        .map(|i| {
            let instance = i.instance.clone().unwrap_or_default();
            json!({
                "route": i.route,
                "namespace": instance.namespace,
                "name": instance.name,
                "uid": instance.uid,
                "owner": i.owner_member,
                "term": i.term,
                "reserved": i.reserved,
                "phase": instance_phase(i.phase),
                "workloadPid": i.workload_pid,
                "progress": i.progress,
                "message": i.message,
            })
        })
        .collect();
    let operations: Vec<_> = status.operations.iter().map(operation_json).collect();
    json!({
        "coordinator": status.coordinator.as_ref().map(|c| json!({"holder": c.holder, "term": c.term})),
        "servedBy": status.served_by,
        "observedAtMs": status.observed_at_ms,
        "members": members,
        "instances": instances,
        "operations": operations,
        "builds": status.builds.iter().map(|b| json!({
            "component": b.component,
            "name": b.name,
            "version": b.version,
        })).collect::<Vec<_>>(),
        "buildWarnings": status.build_warnings,
    })
}

/// Pool status for people: the coordinator, then tables of members, instances and the
/// operations that matter now.
pub fn status_table(status: &GetSupervisorPoolStatusResponse) -> String {
    let coordinator = status
        .coordinator
        .as_ref()
        .map_or_else(|| "none".to_owned(), |c| format!("{} (term {})", c.holder, c.term));
    let mut out = vec![format!(
        "coordinator: {coordinator}   status from: {}",
        status.served_by
    )];
    out.push(table(
        &["MEMBER", "PROCESS", "STATE", "INSTANCES", "CAPACITY", "SERVED BY"],
        &[3, 4],
        status.members.iter().map(|m| {
            vec![
                m.name.clone(),
                short(&m.process_id).to_owned(),
                member_state(m.state),
                m.instance_count.to_string(),
                m.capacity.to_string(),
                m.served_by.clone(),
            ]
        }),
    ));
    out.extend(builds_table(status));
    if !status.instances.is_empty() {
        out.push(table(
            &["INSTANCE", "OWNER", "TERM", "PHASE", "PID", "PROGRESS"],
            &[2, 4, 5],
            status.instances.iter().map(|i| {
                let phase = instance_phase(i.phase);
                let phase = if i.reserved { format!("{phase}*") } else { phase };
                let pid = if i.workload_pid == 0 {
                    "-".to_owned()
                } else {
                    i.workload_pid.to_string()
                };
                let owner = if i.owner_member.is_empty() {
                    "-"
                } else {
                    i.owner_member.as_str()
                };
                vec![
                    i.route.clone(),
                    owner.to_owned(),
                    i.term.to_string(),
                    phase,
                    pid,
                    i.progress.to_string(),
                ]
            }),
        ));
    }
    let open: Vec<&Operation> = status
        .operations
        .iter()
        // Open ones, and succeeded drains (their member stays out until cancelled).
        .filter(|o| {
            !is_finished(o) || (o.phase == OperationPhase::Succeeded as i32 && o.kind == OperationKind::Drain as i32)
        })
        .collect();
    if !open.is_empty() {
        out.push("OPERATIONS".to_owned());
        out.extend(open.into_iter().map(operation_line));
    }
    out.join("\n")
}

/// The builds the pool runs, counted by component and version, then what is outside the
/// compatibility policy (one `warning:` line each). Nothing when no part reported a build.
fn builds_table(status: &GetSupervisorPoolStatusResponse) -> Vec<String> {
    let mut counts: std::collections::BTreeMap<(&str, &str), usize> = std::collections::BTreeMap::new();
    for build in &status.builds {
        *counts
            .entry((build.component.as_str(), build.version.as_str()))
            .or_default() += 1;
    }
    let mut out = Vec::new();
    if !counts.is_empty() {
        out.push(table(
            &["BUILD", "VERSION", "COUNT"],
            &[2],
            counts.into_iter().map(|((component, version), count)| {
                let version = if version.is_empty() { "(none reported)" } else { version };
                vec![component.to_owned(), version.to_owned(), count.to_string()]
            }),
        ));
    }
    out.extend(status.build_warnings.iter().map(|w| format!("warning: {w}")));
    out
}

/// A dry run for people: the moves by wave, then what would not move.
pub fn plan_table(plan: &OperationPlan) -> String {
    let mut out = vec![format!(
        "dry run (nothing recorded) over the pool as {} read it: {} moves, {}",
        plan.served_by,
        plan.moves.len(),
        if plan.completes {
            "would succeed"
        } else {
            "would not finish"
        }
    )];
    if !plan.moves.is_empty() {
        out.push(table(
            &["WAVE", "INSTANCE", "FROM", "TO", "TERM"],
            &[0, 4],
            plan.moves.iter().map(|m| {
                vec![
                    m.wave.to_string(),
                    m.route.clone(),
                    m.from_member.clone(),
                    m.to_member.clone(),
                    m.term.to_string(),
                ]
            }),
        ));
    }
    if !plan.refused.is_empty() {
        out.push(table(
            &["NOT MOVED", "FROM", "WHY"],
            &[],
            plan.refused
                .iter()
                .map(|r| vec![r.route.clone(), r.from_member.clone(), r.reason.clone()]),
        ));
    }
    out.push(format!("outcome: {}", plan.message));
    if !plan.existing_operation_id.is_empty() {
        out.push(format!(
            "note: operation {} is equivalent: a real request returns it instead of starting another",
            plan.existing_operation_id
        ));
    }
    out.join("\n")
}

/// A dry run for programs.
pub fn plan_json(plan: &OperationPlan) -> Value {
    json!({
        "dryRun": true,
        "completes": plan.completes,
        "message": plan.message,
        "servedBy": plan.served_by,
        "observedAtMs": plan.observed_at_ms,
        "existingOperationId": plan.existing_operation_id,
        "moves": plan.moves.iter().map(|m| json!({
            "route": m.route,
            "from": m.from_member,
            "to": m.to_member,
            "term": m.term,
            "wave": m.wave,
        })).collect::<Vec<_>>(),
        "refused": plan.refused.iter().map(|r| json!({
            "route": r.route,
            "from": r.from_member,
            "reason": r.reason,
        })).collect::<Vec<_>>(),
    })
}

/// One audit record as a line: sequence, time, decision, destination, what and why.
pub fn audit_line(entry: &proto::pool::v1::AuditEntry) -> String {
    let Some(r) = &entry.record else {
        return String::new();
    };
    let what = if r.method.is_empty() {
        String::new()
    } else {
        format!(" {} {}", r.method, r.path)
    };
    let rule = if r.rule.is_empty() { "-" } else { r.rule.as_str() };
    let reason = if r.reason.is_empty() {
        String::new()
    } else {
        format!(" — {}", r.reason)
    };
    format!(
        "{} {} {} {}{what} rule={rule} policy={}@{} sent={} received={} {}ms owner={}@{}{reason}",
        r.sequence,
        r.at_ms,
        r.decision,
        r.destination,
        r.policy,
        r.revision,
        r.bytes_sent,
        r.bytes_received,
        r.duration_ms,
        entry.member,
        entry.term
    )
}

pub fn audit_json(entry: &proto::pool::v1::AuditEntry) -> Value {
    let r = entry.record.clone().unwrap_or_default();
    json!({
        "sequence": r.sequence,
        "atMs": r.at_ms,
        "decision": r.decision,
        "destination": r.destination,
        "method": r.method,
        "path": r.path,
        "rule": r.rule,
        "policy": r.policy,
        "revision": r.revision,
        "reason": r.reason,
        "bytesSent": r.bytes_sent,
        "bytesReceived": r.bytes_received,
        "durationMs": r.duration_ms,
        "uid": entry.uid,
        "member": entry.member,
        "term": entry.term,
        "recordedAtMs": entry.recorded_at_ms,
    })
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

#[cfg(test)]
mod tests;
