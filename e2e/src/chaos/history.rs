//! The history checker's rules, over plain data: what the agents logged
//! (every accepted answer with its term and member, their PIDs, refusals)
//! and the coordinator lease as sampled by the driver. Each check returns
//! the violations it found; the driver calls them after every trial.

use std::collections::BTreeSet;

use crate::agent_log::Observed;

/// What has been reported for one agent already (checks run over the whole history after
/// every trial; only what is new is reported again).
#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub pid: Option<u32>,
    dual_owner: u64,
    resets: usize,
    shared_terms: BTreeSet<u64>,
    stops: usize,
}

/// New violations in one agent's history: an answer from a lower term after a higher one
/// (two owners), a term answered by two members, the counter going back (a restarted
/// workload), another PID, an answer saying the workload is being stopped.
pub fn agent(name: &str, observed: &Observed, seen: &mut Seen) -> Vec<String> {
    let mut out = Vec::new();
    match (seen.pid, observed.pid) {
        (None, pid) => seen.pid = pid,
        (Some(first), Some(now)) if first != now => {
            out.push(format!("{name}: the workload's PID changed from {first} to {now}"));
            seen.pid = Some(now);
        }
        _ => {}
    }
    let dual = observed.dual_owner_violations();
    if dual > seen.dual_owner {
        out.push(format!(
            "{name}: {} answer(s) from a lower term after a higher one",
            dual - seen.dual_owner
        ));
        seen.dual_owner = dual;
    }
    let resets = observed.accepted.windows(2).filter(|w| w[1].value < w[0].value).count();
    if resets > seen.resets {
        out.push(format!(
            "{name}: the counter went back {} time(s)",
            resets - seen.resets
        ));
        seen.resets = resets;
    }
    for (term, members) in observed.terms_with_two_members() {
        if seen.shared_terms.insert(term) {
            out.push(format!("{name}: term {term} answered by {}", members.join(" and ")));
        }
    }
    let stops = observed
        .refused
        .iter()
        .filter(|(_, answer)| answer.contains("stopping"))
        .count();
    if stops > seen.stops {
        out.push(format!("{name}: the sidecar is stopping the workload"));
        seen.stops = stops;
    }
    out
}

/// Spans without a working coordinator, from the driver's samples: a sample is `ok` when
/// a live lease is held by a running replica, `excused` when no replica could be one (every
/// replica stopped or paused, the database down, or its write lock held by a paused replica).
/// An excuse ends the span (what came before it counts); the clock starts again once a
/// replica could coordinate.
#[derive(Debug, Default, Clone)]
pub struct CoordinatorGaps {
    open_since: Option<u64>,
    longest_ms: u64,
}

impl CoordinatorGaps {
    pub fn sample(&mut self, at_ms: u64, ok: bool, excused: bool) {
        if ok || excused {
            if let Some(since) = self.open_since.take() {
                self.longest_ms = self.longest_ms.max(at_ms.saturating_sub(since));
            }
            return;
        }
        self.open_since.get_or_insert(at_ms);
    }

    /// The longest span since the last call (a span still open counts up to `now_ms`).
    pub fn take_longest(&mut self, now_ms: u64) -> u64 {
        let open = self.open_since.map_or(0, |since| now_ms.saturating_sub(since));
        std::mem::take(&mut self.longest_ms).max(open)
    }
}

/// min, median, p95, max (nearest rank) of `values`.
pub fn spread(values: &[u64]) -> Option<[u64; 4]> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = |q: f64| {
        let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        sorted[i - 1]
    };
    (!sorted.is_empty()).then(|| [sorted[0], rank(0.5), rank(0.95), sorted[sorted.len() - 1]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent_log::parse;

    #[test]
    fn each_violation_is_reported_once() {
        let mut seen = Seen::default();
        let clean =
            parse("agent pid=5\naccepted value=1 at_ms=1 term=1 member=a\naccepted value=2 at_ms=2 term=2 member=b\n");
        assert!(agent("s", &clean, &mut seen).is_empty());
        let bad = parse(
            "agent pid=5\naccepted value=1 at_ms=1 term=1 member=a\naccepted value=2 at_ms=2 term=2 member=b\n\
             accepted value=3 at_ms=3 term=1 member=a\naccepted value=0 at_ms=4 term=2 member=c\n\
             refused value=4 at_ms=5 answer={\"ok\":false,\"error\":\"the workload is stopping\"}\n",
        );
        let found = agent("s", &bad, &mut seen);
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(found.iter().any(|v| v.contains("lower term")));
        assert!(found.iter().any(|v| v.contains("went back")));
        assert!(found.iter().any(|v| v.contains("term 2 answered by b and c")));
        assert!(found.iter().any(|v| v.contains("stopping")));
        assert!(agent("s", &bad, &mut seen).is_empty(), "already reported");
        let other = parse("agent pid=6\n");
        assert_eq!(agent("s", &other, &mut seen).len(), 1, "a new PID");
    }

    #[test]
    fn gaps_count_only_while_a_replica_could_coordinate() {
        let mut gaps = CoordinatorGaps::default();
        gaps.sample(0, true, false);
        gaps.sample(100, false, false); // lost
        gaps.sample(900, false, true); // every replica paused: the span ends, nothing counted
        gaps.sample(3000, false, true);
        gaps.sample(5000, false, false); // one back: the clock starts again
        gaps.sample(5600, true, false);
        assert_eq!(gaps.take_longest(6000), 800, "the span before the excuse");
        assert_eq!(gaps.take_longest(6000), 0, "taken");
        gaps.sample(7000, false, false);
        assert_eq!(gaps.take_longest(9000), 2000, "a span still open counts");
    }

    #[test]
    fn spread_is_nearest_rank() {
        assert_eq!(spread(&[]), None);
        assert_eq!(spread(&[5]), Some([5, 5, 5, 5]));
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(spread(&hundred), Some([1, 50, 95, 100]));
    }
}
