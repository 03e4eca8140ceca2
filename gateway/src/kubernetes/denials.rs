//! Egress denials as Warning Events on the workload's Pod (`EgressDenied`), aggregated: the
//! denials stored in the audit trail since the last round, counted by Pod, destination and
//! policy revision, make one Event each (the busiest [`PER_POD`] destinations of a Pod, and
//! one Event saying there were more), at most [`PER_ROUND`] a round, every Pod's busiest
//! first. The note of a destination's Event does not change while the same revision denies
//! it the same way, so repeats become one Event series whose count grows
//! ([`super::cluster::Cluster::publish_distinct`]). Pure; [`super::denial_writer`] publishes
//! them.

use std::collections::BTreeMap;

use super::notice::{Notice, Regarding, bound_note};
use crate::store::Denials;

/// The Event's reason.
pub const REASON_EGRESS_DENIED: &str = "EgressDenied";
/// Destinations of one Pod with an Event of their own in one round.
pub const PER_POD: usize = 3;
/// Events of one round at most (a namespace of noisy Pods is summed up by their counts).
pub const PER_ROUND: usize = 64;

/// The Events for `denials` ([`crate::store::Store::audit_denials`] with `PER_POD`: each Pod's
/// busiest destinations, every Pod's first before any Pod's second), in that order, then one
/// Event for each Pod that had more; at most [`PER_ROUND`].
pub fn notices(denials: &[Denials]) -> Vec<Notice> {
    let mut out = Vec::new();
    let mut more: BTreeMap<&str, Notice> = BTreeMap::new();
    for d in denials.iter().filter(|d| d.rank <= PER_POD as i64) {
        let regarding = Regarding {
            namespace: d.namespace.clone(),
            name: d.name.clone(),
            uid: Some(d.uid.clone()).filter(|u| !u.is_empty()),
        };
        let audit = format!("`poolctl audit {}/{}` lists every attempt", d.namespace, d.name);
        let policy = if d.policy.is_empty() {
            "no SandboxPolicy applies to the Pod, so every destination is denied".to_owned()
        } else {
            format!("SandboxPolicy {} revision {}", d.policy, d.revision)
        };
        out.push(notice(
            &regarding,
            format!("egress to {} denied: {} ({policy}); {audit}", d.destination, d.reason),
        ));
        if d.destinations > PER_POD as i64 {
            // The same words every round: repeats count in one series.
            more.entry(&d.uid).or_insert_with(|| {
                notice(
                    &regarding,
                    format!("egress to further destinations denied as well; {audit}"),
                )
            });
        }
    }
    out.extend(more.into_values());
    out.truncate(PER_ROUND);
    out
}

fn notice(regarding: &Regarding, mut note: String) -> Notice {
    bound_note(&mut note);
    Notice {
        regarding: regarding.clone(),
        related: None,
        warning: true,
        reason: REASON_EGRESS_DENIED,
        action: "Deny",
        note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn denials(pod: &str, destination: &str, rank: i64, destinations: i64) -> Denials {
        Denials {
            namespace: "team".into(),
            name: pod.into(),
            uid: format!("uid-{pod}"),
            destination: destination.into(),
            policy: "default".into(),
            revision: 3,
            reason: format!("no rule allows {destination}"),
            count: 1,
            rank,
            destinations,
            attempts: destinations,
        }
    }

    #[test]
    fn each_pod_gets_its_busiest_destinations_and_one_event_for_the_rest() {
        // As the store orders them: by rank.
        let rows = [
            denials("agent", "a.example:443", 1, 5),
            denials("other", "z.example:443", 1, 1),
            denials("agent", "b.example:443", 2, 5),
            denials("agent", "c.example:443", 3, 5),
        ];
        let out = notices(&rows);
        let on = |pod: &str| out.iter().filter(|n| n.regarding.name == pod).collect::<Vec<_>>();
        let agent = on("agent");
        assert_eq!(agent.len(), PER_POD + 1);
        assert!(agent.iter().all(|n| n.warning && n.reason == REASON_EGRESS_DENIED));
        assert_eq!(agent[0].regarding.uid.as_deref(), Some("uid-agent"));
        assert_eq!(
            agent[0].note,
            "egress to a.example:443 denied: no rule allows a.example:443 (SandboxPolicy default \
             revision 3); `poolctl audit team/agent` lists every attempt"
        );
        assert_eq!(
            agent[3].note,
            "egress to further destinations denied as well; `poolctl audit team/agent` lists every attempt"
        );
        assert_eq!(on("other").len(), 1);
        assert_eq!(out[1].regarding.name, "other", "every Pod's busiest first");
    }

    #[test]
    fn without_a_policy_the_event_says_so_and_a_round_is_bounded() {
        let none = Denials {
            policy: String::new(),
            revision: 0,
            ..denials("agent", "a.example:443", 1, 1)
        };
        assert!(notices(&[none])[0].note.contains("no SandboxPolicy applies to the Pod"));
        let noisy: Vec<Denials> = (0..100)
            .map(|n| denials(&format!("pod-{n:03}"), &"x".repeat(2000), 1, 1))
            .collect();
        let out = notices(&noisy);
        assert_eq!(out.len(), PER_ROUND);
        assert!(out.iter().all(|n| n.note.len() <= super::super::notice::MAX_NOTE_BYTES));
    }
}
