//! `HostProtocol`, the protocol state of one member's host stream: snapshot revisions, acks, and
//! which reported statuses can be attributed to which term. Pure.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use proto::common::v1::RouteDirectoryEntry;
use proto::host::v1::{Snapshot, StatusReport};

use crate::forgotten::Holding;
use crate::pool::Directory;
use crate::store::{LoadedPolicy, ReportPhase};

/// Why a member message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// An ack of a revision this stream never sent.
    AckNeverSent,
    /// An ack lower than one already received.
    AckRegressed,
    /// A report larger than `proto::MAX_STATUS_REPORT_BYTES`.
    OversizedReport,
}

impl Dropped {
    /// The `reason` label of `openshell_gateway_member_messages_dropped_total`.
    pub fn reason(self) -> &'static str {
        match self {
            Dropped::AckNeverSent => "ack_never_sent",
            Dropped::AckRegressed => "ack_regressed",
            Dropped::OversizedReport => "report_oversized",
        }
    }
}

/// A status attributed to a term: the member acknowledged the revision that
/// installed the term before it reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributed {
    pub route: String,
    pub term: u64,
    /// `Absent` when the member reconciled past the installing revision without hosting
    /// the route.
    pub phase: ReportPhase,
    pub message: String,
    pub workload_pid: u32,
    /// `None` while the owner has accepted no progress at this term.
    pub progress: Option<u64>,
    /// The sidecar's answer to this term's policy install, as the owner relayed it.
    pub policy: Option<LoadedPolicy>,
}

#[derive(Debug, Default)]
pub struct HostProtocol {
    /// Last revision sent (0 before the first snapshot).
    revision: u64,
    acked: u64,
    /// route -> (term, revision that first carried that term on this stream)
    installs: BTreeMap<String, (u64, u64)>,
    /// Routes whose launch material this stream already carried at their installed term: it
    /// is not sent again while the term stays (host.proto `OwnedInstance.credentials`).
    carried_material: BTreeMap<String, u64>,
    /// The last snapshot sent, before numbering and without its directory.
    last: Option<Snapshot>,
    /// The directory the member holds after the last snapshot sent.
    directory: Option<Arc<Directory>>,
    /// Whether the member applies directory deltas (`Hello.directory_deltas`).
    deltas: bool,
    /// What this stream last handed to the report writer, per route it still installs.
    written: BTreeMap<String, Attributed>,
    /// What the member's latest complete report on this stream says it hosts (`None` before
    /// the first one) — installed here or not.
    holding: Option<Holding>,
    /// Routes the member holds at a term the store does not know (above the route's
    /// assignment, `forgotten::held_above`): their statuses are written at the member's own
    /// term, so the coordinator sees what the owner runs and gives the route back to it.
    held_above: std::collections::BTreeSet<String>,
    /// Routes the member holds whose instance the store does not know at all
    /// (`forgotten::unregistered`), since when this stream saw each so.
    unregistered_since: BTreeMap<String, Instant>,
    /// When the first of those still kept passes its bound.
    unregistered_bound: Option<Instant>,
}

/// A status to write, and whether it must be written at once: a new term, phase or workload
/// PID (the coordinator's operations settle on them); counters and messages can wait for the
/// writer's next batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub status: Attributed,
    pub urgent: bool,
}

impl HostProtocol {
    /// A stream of a member that applies directory deltas (`Hello.directory_deltas`) or not.
    pub fn new(deltas: bool) -> Self {
        Self {
            deltas,
            ..Self::default()
        }
    }

    /// Number `body` (a snapshot without its directory) with `directory` as the next snapshot
    /// if either differs from what was last sent. The directory goes whole in the first
    /// snapshot and to a member without deltas, as the change since the last snapshot
    /// otherwise; launch material already carried at the same term is not sent again.
    pub fn next_snapshot(&mut self, body: Snapshot, directory: Arc<Directory>) -> Option<Snapshot> {
        let delta = self.directory.as_deref().map(|held| diff(held, &directory));
        let directory_unchanged = delta
            .as_ref()
            .is_some_and(|(changed, removed)| changed.is_empty() && removed.is_empty());
        if self.last.as_ref() == Some(&body) && directory_unchanged {
            return None;
        }
        self.revision += 1;
        for owned in &body.instances {
            let carried = self
                .installs
                .get(&owned.route)
                .is_some_and(|(term, _)| *term == owned.term);
            if !carried {
                self.installs.insert(owned.route.clone(), (owned.term, self.revision));
            }
        }
        let carried: std::collections::BTreeSet<&str> = body.instances.iter().map(|o| o.route.as_str()).collect();
        self.installs.retain(|route, _| carried.contains(route.as_str()));
        // A route that left this member is reported no more on this stream.
        self.written
            .retain(|route, _| self.installs.contains_key(route) || self.held_above.contains(route));
        let mut numbered = Snapshot {
            revision: self.revision,
            ..body.clone()
        };
        self.carried_material
            .retain(|route, term| self.installs.get(route).is_some_and(|(installed, _)| installed == term));
        for owned in &mut numbered.instances {
            if owned.credentials.is_empty() {
                continue;
            }
            if self.carried_material.get(&owned.route) == Some(&owned.term) {
                owned.credentials = Vec::new();
            } else {
                self.carried_material.insert(owned.route.clone(), owned.term);
            }
        }
        match delta.filter(|_| self.deltas) {
            Some((changed, removed)) => {
                numbered.directory_delta = true;
                numbered.directory = changed;
                numbered.directory_removed = removed;
            }
            None => numbered.directory = directory.values().cloned().collect(),
        }
        self.last = Some(body);
        self.directory = Some(directory);
        Some(numbered)
    }

    pub fn on_ack(&mut self, revision: u64) -> Result<(), Dropped> {
        if revision > self.revision {
            return Err(Dropped::AckNeverSent);
        }
        if revision < self.acked {
            return Err(Dropped::AckRegressed);
        }
        self.acked = revision;
        Ok(())
    }

    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// The store lost writes ([`PoolWrites::rolled_back_since`](crate::store::PoolWrites)):
    /// what this stream handed to the report writer may be gone, so every status of the next
    /// report is handed over again, at once.
    pub fn store_rolled_back(&mut self) {
        self.written.clear();
    }

    /// Takes what a complete report says the member hosts (a partial one says nothing of it).
    pub fn hold(&mut self, report: &StatusReport) {
        if report.partial {
            return;
        }
        // Activated terms only: a session still taking over holds nothing the store must keep.
        let hosted = report.instances.iter().filter(|s| {
            use proto::common::v1::InstancePhase as P;
            matches!(P::from_wire(s.phase), P::Active | P::Recovering)
        });
        let holding = hosted
            .filter_map(|s| Some((s.route.clone(), (s.term, s.instance.clone()?))))
            .collect();
        self.holding = Some(holding);
    }

    /// What the member's latest complete report on this stream says it hosts (`None` before
    /// the first one).
    pub fn holding(&self) -> Option<&Holding> {
        self.holding.as_ref()
    }

    /// The routes the member holds at a term the store does not know, as the latest view says
    /// (`forgotten::held_above`): reported at the member's own term from now on.
    /// A route new to the set is reported at once: the next snapshot goes out even if nothing
    /// else changed, and the member answers it with a complete report.
    pub fn set_held_above(&mut self, routes: impl IntoIterator<Item = String>) {
        let routes: std::collections::BTreeSet<String> = routes.into_iter().collect();
        if !routes.is_subset(&self.held_above) {
            self.last = None;
        }
        self.held_above = routes;
    }

    /// Whether a kept route the store does not know passed its bound by `now`: the next
    /// snapshot is built even from an unchanged view, so the member lets it go.
    pub fn unregistered_bound_passed(&self, now: Instant) -> bool {
        self.unregistered_bound.is_some_and(|at| now >= at)
    }

    /// Of the routes the member holds whose instance the store does not know at all
    /// (`forgotten::unregistered`, as of `now`), those it keeps: seen so on this stream for less
    /// than `forgotten::UNREGISTERED_KEPT_FOR`.
    pub fn keep_unregistered(&mut self, routes: impl IntoIterator<Item = String>, now: Instant) -> Vec<String> {
        let bound = crate::forgotten::UNREGISTERED_KEPT_FOR;
        let routes: std::collections::BTreeSet<String> = routes.into_iter().collect();
        self.unregistered_since.retain(|route, _| routes.contains(route));
        let kept: Vec<(String, Instant)> = routes
            .into_iter()
            .map(|route| {
                let since = *self.unregistered_since.entry(route.clone()).or_insert(now);
                (route, since + bound)
            })
            .filter(|(_, until)| now < *until)
            .collect();
        self.unregistered_bound = kept.iter().map(|(_, until)| *until).min();
        kept.into_iter().map(|(route, _)| route).collect()
    }

    /// The statuses of `report` that can be attributed to a term — plus, for a complete
    /// report, an `ABSENT` status for every installed route the member acknowledged but does
    /// not host (in a partial report an absent route is unchanged).
    pub fn attribute(&self, report: &StatusReport, encoded_len: usize) -> Result<Vec<Attributed>, Dropped> {
        if encoded_len > proto::MAX_STATUS_REPORT_BYTES {
            return Err(Dropped::OversizedReport);
        }
        let applied = report.applied_revision.min(self.acked);
        let attributed = |route: &String, term: u64, s: &proto::host::v1::InstanceStatus| Attributed {
            route: route.clone(),
            term,
            phase: ReportPhase::of(proto::common::v1::InstancePhase::from_wire(s.phase)),
            message: plumbing::text::prefix(&s.message, proto::MAX_STATUS_MESSAGE_BYTES).to_owned(),
            workload_pid: s.workload_pid,
            progress: s
                .counters
                .as_ref()
                .filter(|c| c.last_progress_at_ms != 0)
                .map(|c| c.last_progress_value),
            policy: s.egress_policy.as_ref().map(|p| LoadedPolicy {
                name: plumbing::text::bounded(&p.name, proto::MAX_POLICY_NAME_BYTES),
                revision: i64::try_from(p.revision).unwrap_or(i64::MAX),
                error: plumbing::text::bounded(&p.error, proto::MAX_STATUS_MESSAGE_BYTES),
            }),
        };
        // A route held above the store's term, at the member's own term (not installed here).
        let held_above = report.instances.iter().filter(|s| {
            self.held_above.contains(&s.route) && self.installs.get(&s.route).is_none_or(|(term, _)| *term != s.term)
        });
        let held_above: Vec<Attributed> = held_above.map(|s| attributed(&s.route, s.term, s)).collect();
        if report.partial {
            let mut out: Vec<Attributed> = report
                .instances
                .iter()
                .filter_map(|s| {
                    let (route, &(term, installed_at)) = self.installs.get_key_value(&s.route)?;
                    (term == s.term && installed_at <= applied).then(|| attributed(route, term, s))
                })
                .collect();
            out.extend(held_above);
            return Ok(out);
        }
        let by_route: BTreeMap<(&str, u64), &proto::host::v1::InstanceStatus> = report
            .instances
            .iter()
            .map(|s| ((s.route.as_str(), s.term), s))
            .collect();
        let above: std::collections::BTreeSet<&str> = held_above.iter().map(|a| a.route.as_str()).collect();
        let mut out = Vec::new();
        for (route, &(term, installed_at)) in &self.installs {
            if installed_at > applied || above.contains(route.as_str()) {
                continue;
            }
            out.push(match by_route.get(&(route.as_str(), term)) {
                Some(s) => attributed(route, term, s),
                None => Attributed {
                    route: route.clone(),
                    term,
                    phase: ReportPhase::Absent,
                    message: "the owner acknowledged the assignment but does not host it".into(),
                    workload_pid: 0,
                    progress: None,
                    policy: None,
                },
            });
        }
        out.extend(held_above);
        Ok(out)
    }

    /// Of `statuses`, those that differ from what this stream last handed to the writer, each
    /// marked urgent when its term, phase or PID changed; remembered as handed over.
    pub fn changes(&mut self, statuses: Vec<Attributed>) -> Vec<Change> {
        let mut out = Vec::new();
        for status in statuses {
            let urgent = match self.written.get(&status.route) {
                Some(last) if *last == status => continue,
                Some(last) => {
                    (last.term, last.phase, last.workload_pid) != (status.term, status.phase, status.workload_pid)
                }
                None => true,
            };
            self.written.insert(status.route.clone(), status.clone());
            out.push(Change { status, urgent });
        }
        out
    }
}

/// What turns directory `held` into `now`: the entries new or changed, and the routes gone.
/// One merge walk over both (sorted) maps; nothing when they are the same map.
fn diff(held: &Directory, now: &Arc<Directory>) -> (Vec<RouteDirectoryEntry>, Vec<String>) {
    let (mut changed, mut removed) = (Vec::new(), Vec::new());
    if std::ptr::eq(held, now.as_ref()) {
        return (changed, removed);
    }
    let (mut before, mut after) = (held.iter().peekable(), now.iter().peekable());
    loop {
        let order = match (before.peek(), after.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((a, _)), Some((b, _))) => a.cmp(b),
        };
        match order {
            Ordering::Less => removed.extend(before.next().map(|(route, _)| route.clone())),
            Ordering::Greater => changed.extend(after.next().map(|(_, entry)| entry.clone())),
            Ordering::Equal => {
                let (old, new) = (before.next().map(|(_, e)| e), after.next().map(|(_, e)| e));
                if old != new {
                    changed.extend(new.cloned());
                }
            }
        }
    }
    (changed, removed)
}

#[cfg(test)]
mod tests;
