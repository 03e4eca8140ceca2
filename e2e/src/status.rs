//! Pool status for people: a compact table. Pure.

use proto::pool::v1::{GetSupervisorPoolStatusResponse, MemberState};

pub fn render(status: &GetSupervisorPoolStatusResponse) -> String {
    let mut out = String::new();
    let coordinator = status
        .coordinator
        .as_ref()
        .map_or_else(|| "none".to_owned(), |c| format!("{} (term {})", c.holder, c.term));
    out.push_str(&format!(
        "coordinator: {coordinator}   status from: {}\n",
        status.served_by
    ));
    out.push_str(&format!(
        "{:<16} {:<10} {:<8} {:>9} {:>8}  {}\n",
        "MEMBER", "PROCESS", "STATE", "INSTANCES", "CAPACITY", "SERVED BY"
    ));
    for m in &status.members {
        let state = MemberState::try_from(m.state).unwrap_or_default().as_str_name();
        out.push_str(&format!(
            "{:<16} {:<10} {:<8} {:>9} {:>8}  {}\n",
            m.name,
            short(&m.process_id),
            state
                .strip_prefix("MEMBER_STATE_")
                .unwrap_or(state)
                .to_ascii_lowercase(),
            m.instance_count,
            m.capacity,
            m.served_by
        ));
    }
    if !status.instances.is_empty() {
        out.push_str(&format!(
            "{:<28} {:<16} {:>5} {:<12} {:>8} {:>9}\n",
            "INSTANCE", "OWNER", "TERM", "PHASE", "PID", "PROGRESS"
        ));
        for i in &status.instances {
            let phase = proto::common::v1::InstancePhase::try_from(i.phase)
                .unwrap_or_default()
                .as_str_name();
            let phase = phase
                .strip_prefix("INSTANCE_PHASE_")
                .unwrap_or(phase)
                .to_ascii_lowercase();
            let phase = if i.reserved { format!("{phase}*") } else { phase };
            out.push_str(&format!(
                "{:<28} {:<16} {:>5} {:<12} {:>8} {:>9}\n",
                i.route, i.owner_member, i.term, phase, i.workload_pid, i.progress
            ));
        }
    }
    out
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::pool::v1::{Coordinator, Member};

    #[test]
    fn shows_coordinator_and_members() {
        let status = GetSupervisorPoolStatusResponse {
            coordinator: Some(Coordinator {
                holder: "gateway-0/abc".into(),
                term: 3,
                expires_at_ms: 0,
            }),
            members: vec![Member {
                name: "supervisor-0".into(),
                process_id: "0123456789".into(),
                state: MemberState::Active as i32,
                instance_count: 2,
                capacity: 256,
                served_by: "gateway-1".into(),
                ..Member::default()
            }],
            served_by: "gateway-0".into(),
            ..GetSupervisorPoolStatusResponse::default()
        };
        let text = render(&status);
        assert!(text.contains("coordinator: gateway-0/abc (term 3)"), "{text}");
        assert!(
            text.contains("supervisor-0") && text.contains("01234567 ") && text.contains("active"),
            "{text}"
        );
    }
}
