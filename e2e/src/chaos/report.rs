//! What a chaos run found: each trial's figures, the violations, and the recovery table per
//! fault kind.

use std::collections::BTreeMap;

use serde::Serialize;

use super::history;
use super::plan::Fault;

/// One trial's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    pub index: usize,
    pub fault: Fault,
    pub steps: Vec<String>,
    /// Longest time any agent went without an accepted answer, from injection to settled.
    pub workload_gap_ms: u64,
    /// Heal (the last step) → every instance active and every agent answered.
    pub settle_ms: u64,
    /// Longest span without a working coordinator while a replica could have been one.
    pub coordinator_gap_ms: u64,
    /// Answers the agents got that were not `ok` (refusals; not a violation by themselves).
    pub refused: usize,
    /// Instances on another member once settled than before the fault: what a kill, a drain
    /// or a rebalance causes; after a fault every member process lived through, a move nobody
    /// needed.
    pub moved: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub trial: usize,
    pub what: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub backend: String,
    pub seed: u64,
    pub trials: Vec<Trial>,
    pub violations: Vec<Violation>,
    /// Workloads stopped by their sidecars (a sidecar that exited, or answered "stopping").
    pub stopped_workloads: usize,
    /// Accepted answers the checker read.
    pub accepted: usize,
    /// Set when the pool did not settle and the run ended early.
    pub aborted: Option<String>,
    /// What the egress traffic and the audit trails came to (the run's end).
    pub egress: Option<String>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.violations.is_empty() && self.stopped_workloads == 0 && self.aborted.is_none()
    }
}

/// The recovery table: per fault kind, the trials and the spread of what they measured.
pub fn table(report: &Report) -> String {
    let mut by_kind: BTreeMap<Fault, Vec<&Trial>> = BTreeMap::new();
    for t in &report.trials {
        by_kind.entry(t.fault).or_default().push(t);
    }
    let mut out = format!(
        "{:<24} {:>6}  {:>27}  {:>23}  {:>9}  {:>7}  {:>5}\n",
        "FAULT",
        "TRIALS",
        "WORKLOAD GAP ms (min/med/p95/max)",
        "SETTLED ms (med/p95/max)",
        "COORD GAP",
        "REFUSED",
        "MOVED"
    );
    for (fault, trials) in &by_kind {
        let gap = history::spread(&trials.iter().map(|t| t.workload_gap_ms).collect::<Vec<_>>()).unwrap_or_default();
        let settle = history::spread(&trials.iter().map(|t| t.settle_ms).collect::<Vec<_>>()).unwrap_or_default();
        let coordinator = trials.iter().map(|t| t.coordinator_gap_ms).max().unwrap_or(0);
        let refused: usize = trials.iter().map(|t| t.refused).sum();
        let moved: usize = trials.iter().map(|t| t.moved).sum();
        out.push_str(&format!(
            "{:<24} {:>6}  {:>33}  {:>24}  {:>9}  {:>7}  {:>5}\n",
            fault.name(),
            trials.len(),
            format!("{} / {} / {} / {}", gap[0], gap[1], gap[2], gap[3]),
            format!("{} / {} / {}", settle[1], settle[2], settle[3]),
            coordinator,
            refused,
            moved
        ));
    }
    out.push_str(&format!(
        "{} trials ({}, seed {}), {} accepted answers checked, {} violation(s), {} stopped workload(s){}\n",
        report.trials.len(),
        report.backend,
        report.seed,
        report.accepted,
        report.violations.len(),
        report.stopped_workloads,
        report
            .aborted
            .as_deref()
            .map(|a| format!("; ABORTED: {a}"))
            .unwrap_or_default()
    ));
    for v in &report.violations {
        out.push_str(&format!("  trial {}: {}\n", v.trial, v.what));
    }
    out
}
