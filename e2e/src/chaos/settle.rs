//! The end of a trial: waiting until the pool has settled after the heal (the trial's
//! operations finished, every instance active, every agent answered again), and the checks.

use super::*;

impl Driver<'_> {
    /// Wait until the pool has settled after the heal: a working coordinator, every
    /// instance active on a live member, every member live, the trial's operations finished
    /// (a finished drain is cancelled, returning its member to service), and every agent
    /// answered after the heal. A violation past the bound; `None` when it never did.
    pub(super) async fn settle(
        &mut self,
        index: usize,
        healed: u64,
        operations: &[String],
    ) -> Result<Option<u64>, Error> {
        let bound = tokio::time::Instant::now() + self.settings.settle_bound;
        let give_up = bound + WEDGED_AFTER;
        let mut cancelled: Vec<String> = Vec::new();
        let mut late = false;
        loop {
            let ops = self.finish_operations(operations, &mut cancelled).await;
            if ops && let Some(at) = self.settled(healed).await? {
                return Ok(Some(at));
            }
            let now = tokio::time::Instant::now();
            if now > bound && !late {
                late = true;
                let why = self.unsettled(healed).await;
                self.violation(
                    index,
                    format!(
                        "not settled within {} s of the heal: {why}",
                        self.settings.settle_bound.as_secs()
                    ),
                );
            }
            if now > give_up {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the trial's operations are finished; cancels each finished drain once.
    async fn finish_operations(&self, operations: &[String], cancelled: &mut Vec<String>) -> bool {
        let mut all = true;
        for id in operations {
            let op = match self.store.operation(id).await {
                Ok(Some(op)) => op,
                // A store that lost commits may have lost the operation: nothing to wait for.
                Ok(None) => continue,
                Err(_) => {
                    all = false;
                    continue;
                }
            };
            if !op.phase.is_finished() {
                all = false;
            } else if op.kind == gateway::store::OperationKind::Drain
                && op.phase != OperationPhase::Cancelled
                && !cancelled.contains(id)
            {
                // A finished drain keeps its member out of service until cancelled.
                if let Some(mut client) = self.operator().await
                    && let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), client.cancel(id)).await
                {
                    cancelled.push(id.clone());
                }
                all = false;
            } else if cancelled.contains(id) && op.phase != OperationPhase::Cancelled {
                all = false;
            }
        }
        all
    }

    /// The time the pool was seen settled, or `None`.
    async fn settled(&mut self, healed: u64) -> Result<Option<u64>, Error> {
        Ok(self.unsettled(healed).await.is_empty().then(now_ms))
    }

    /// What is not settled yet (empty when everything is).
    pub(super) async fn unsettled(&mut self, healed: u64) -> String {
        let mut missing = Vec::new();
        match self.store.read_lease().await {
            Ok(Some(lease)) if lease.is_live() => {
                let name = lease.holder.split('/').next().unwrap_or_default();
                if !lock(&self.health).gateway_up(name) {
                    missing.push(format!("the lease is held by {name}, which is not running"));
                }
            }
            Ok(_) => missing.push("no coordinator".into()),
            Err(err) => missing.push(format!("store: {err}")),
        }
        let now = self.store.now_ms().await.unwrap_or_default();
        match self.store.list_members().await {
            Ok((_, members)) => {
                for m in &self.pool.members {
                    if !members.iter().any(|r| r.member == m.name && r.is_live(now)) {
                        missing.push(format!("{} not a live member", m.name));
                    }
                }
            }
            Err(err) => missing.push(format!("store: {err}")),
        }
        let assignments = match self.store.list_assignments().await {
            Ok(assignments) => {
                let active = assignments
                    .iter()
                    .filter(|a| a.phase == AssignmentPhase::Active)
                    .count();
                if active < self.pool.sandboxes.len() {
                    missing.push(format!("{active} of {} instances active", self.pool.sandboxes.len()));
                }
                assignments
            }
            Err(err) => {
                missing.push(format!("store: {err}"));
                Vec::new()
            }
        };
        for (name, follower, _) in &mut self.agents {
            let observed = follower.poll().await;
            if observed.last_at_ms() <= healed {
                let refused = match observed.refused.last() {
                    Some((at, answer)) if *at > healed => format!(" (last refused: {answer})"),
                    _ => String::new(),
                };
                missing.push(format!("{name} has no answer since the heal{refused}"));
            } else if let Some(disagrees) = disagreement(name, observed.accepted.last(), &assignments) {
                missing.push(disagrees);
            }
        }
        if !missing.is_empty() {
            missing.push(self.stuck_routes().await);
        }
        missing.join("; ")
    }

    /// What the store says of every route: its assignment, its report and its last term —
    /// what the next engineer needs to see why nothing drove an unsettled one.
    async fn stuck_routes(&self) -> String {
        let (Ok(assignments), Ok(reports), Ok(instances)) = (
            self.store.list_assignments().await,
            self.store.list_reports().await,
            self.store.list_instances().await,
        ) else {
            return "the store could not be read for the routes' state".into();
        };
        let mut said = Vec::new();
        for a in &assignments {
            let report = reports
                .iter()
                .find(|r| r.route == a.route)
                .map_or("no report".into(), |r| {
                    format!(
                        "report term {} {} by {} ({})",
                        r.term,
                        r.phase.as_str(),
                        r.member,
                        r.message
                    )
                });
            let last = instances
                .iter()
                .find(|i| i.route == a.route)
                .map_or(0, |i| i.last_term.get());
            said.push(format!(
                "{} {} at term {} for {} (process {}), last term {last}, {report}",
                a.route,
                a.phase.as_str(),
                a.term,
                a.member,
                a.process_id
            ));
        }
        format!("[{}]", said.join(" | "))
    }

    /// The history checker after a trial: the agents' logs, the sidecars, the PIDs the owners
    /// report.
    pub(super) async fn check(&mut self, index: usize) -> Result<(), Error> {
        let mut found = Vec::new();
        let mut accepted = 0;
        for (name, follower, seen) in &mut self.agents {
            let observed = follower.poll().await;
            accepted += observed.accepted.len();
            found.extend(history::agent(name, observed, seen));
        }
        self.report.accepted = accepted;
        let mut stopped = 0;
        for sandbox in &mut self.pool.sandboxes {
            if sandbox.sidecar.exited() || sandbox.agent.exited() {
                stopped += 1;
                found.push(format!("{}: the sidecar or the workload exited", sandbox.name));
            }
        }
        if stopped > self.report.stopped_workloads {
            self.report.stopped_workloads = stopped;
        }
        let reports = self.store.list_reports().await?;
        for (name, _, seen) in &self.agents {
            let route = format!("default/{name}");
            if let (Some(pid), Some(report)) = (seen.pid, reports.iter().find(|r| r.route == route))
                && report.workload_pid != 0
                && report.workload_pid != i64::from(pid)
            {
                found.push(format!(
                    "{route}: its owner reports workload PID {}, the agent is {pid}",
                    report.workload_pid
                ));
            }
        }
        if let Some(traffic) = self.traffic.as_mut() {
            found.extend(traffic.violations());
        }
        for what in found {
            self.violation(index, what);
        }
        Ok(())
    }

    pub(super) fn violation(&mut self, trial: usize, what: String) {
        eprintln!("  VIOLATION (trial {trial}): {what}");
        self.report.violations.push(Violation { trial, what });
    }
}

/// How an agent's latest answer disagrees with the store: answered by a member or at a term
/// other than the route's active assignment. A store that lost commits can show every instance
/// active while some run elsewhere, at a term it forgot; the pool has not settled until it
/// knows where they run.
fn disagreement(
    name: &str,
    last: Option<&crate::agent_log::Accepted>,
    assignments: &[gateway::store::Assignment],
) -> Option<String> {
    let (term, member) = last.and_then(|a| Some((a.term?, a.member.as_deref()?)))?;
    let route = format!("default/{name}");
    let stored = assignments.iter().find(|a| a.route == route);
    let agrees =
        stored.is_some_and(|a| a.phase == AssignmentPhase::Active && a.term.get() == term && a.member == member);
    (!agrees).then(|| {
        let stored = stored.map_or("no assignment".into(), |a| {
            format!("{} at term {} {}", a.member, a.term, a.phase.as_str())
        });
        format!("{name} is answered by {member} at term {term}; the store has {stored}")
    })
}
