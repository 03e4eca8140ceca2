//! The sessions a member hosts: the pure snapshot planner ([`plan`]) and the runtime side that
//! executes its actions, one [`session`] task per instance (a sans-I/O machine and its
//! driver), builds status reports and publishes the route table the runtime service routes sidecar
//! streams with.

pub mod material;
pub mod plan;
pub mod released;
pub mod session;

use std::collections::BTreeMap;
use std::sync::Arc;

use prost::Message;
use proto::common::v1::InstancePhase;
use proto::host::v1::{InstanceStatus, Snapshot, StatusReport};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use self::plan::{Action, Sessions};
use self::session::{SessionEvent, SessionHandle, Shared};
use crate::runtime::route::{Entry, RouteTable};

/// The running sessions of one member process, owned by the host stream loop.
pub(crate) struct SessionSet {
    shared: Arc<Shared>,
    capacity: usize,
    live: BTreeMap<String, SessionHandle>,
    /// Sessions told to stop or relinquish, kept until a report has shown their final phase.
    ending: Vec<(String, SessionHandle)>,
    /// The terms this process released: a session of one of them fails at once.
    released: released::Released,
    changed: Arc<Notify>,
    /// What the reports of the current stream said last, per route: a partial report carries
    /// only what differs from it.
    reported: BTreeMap<String, InstanceStatus>,
    table: watch::Sender<Arc<RouteTable>>,
    directory: Arc<BTreeMap<String, proto::common::v1::RouteDirectoryEntry>>,
    recovery_deadline_ms: u64,
}

impl SessionSet {
    pub(crate) fn new(shared: Arc<Shared>, capacity: u32, table: watch::Sender<Arc<RouteTable>>) -> Self {
        Self {
            shared,
            capacity: usize::try_from(capacity).unwrap_or(usize::MAX),
            live: BTreeMap::new(),
            ending: Vec::new(),
            released: released::Released::default(),
            changed: Arc::new(Notify::new()),
            reported: BTreeMap::new(),
            table,
            directory: Arc::default(),
            recovery_deadline_ms: 0,
        }
    }

    /// Notified whenever a session's status changes.
    pub(crate) fn changed(&self) -> Arc<Notify> {
        Arc::clone(&self.changed)
    }

    /// True when nothing is hosted and every ended session's final phase was reported.
    pub(crate) fn is_idle(&self) -> bool {
        self.live.is_empty() && self.ending.is_empty()
    }

    pub(crate) fn hosted(&self) -> usize {
        self.live.len()
    }

    /// Plans `snapshot` against the held sessions, executes the actions and publishes the new
    /// route table (sessions, directory, recovery deadline).
    pub(crate) fn apply(&mut self, snapshot: &Snapshot) {
        let held: Sessions = self
            .live
            .iter()
            .map(|(route, s)| (route.clone(), s.held().clone()))
            .collect();
        // The deadline first: sessions read it when they answer a sidecar.
        self.recovery_deadline_ms = snapshot.recovery_deadline_ms;
        plan::apply_directory(&mut self.directory, snapshot);
        self.publish_table();
        for action in plan::apply(&held, snapshot) {
            self.execute(action);
        }
        for owned in &snapshot.instances {
            if let (Some(policy), Some(session)) = (&owned.egress_policy, self.live.get(&owned.route)) {
                session.assign_policy(policy);
            }
        }
        // The store is behind the term this process holds: the sidecar registers its standing.
        for (route, named) in plan::store_behind(&held, &self.directory, snapshot) {
            if let Some(session) = self.live.get_mut(route) {
                session.send(SessionEvent::StoreBehind(named));
            }
        }
        self.publish_table();
    }

    fn execute(&mut self, action: Action) {
        match action {
            Action::Stop { route } => self.end(route, SessionEvent::Stop),
            Action::Release { route } => self.end(route, SessionEvent::Relinquish),
            Action::Move { route, assignment } | Action::Update { route, assignment } => {
                if let Some(session) = self.live.get_mut(&route) {
                    session.send(SessionEvent::Ownership(assignment));
                }
            }
            Action::Host {
                route,
                instance,
                assignment,
            } => {
                if self.live.len() >= self.capacity {
                    tracing::warn!(%route, capacity = self.capacity, "snapshot exceeds capacity; not hosting");
                    return;
                }
                let released = self.released.term(&route, &instance);
                let session = SessionHandle::spawn(
                    Arc::clone(&self.shared),
                    &route,
                    (instance, released),
                    assignment,
                    self.changed(),
                );
                self.live.insert(route, session);
            }
        }
    }

    fn end(&mut self, route: String, event: SessionEvent) {
        if let Some(mut session) = self.live.remove(&route) {
            if matches!(event, SessionEvent::Relinquish) {
                let held = session.held();
                self.released.record(&route, &held.instance, held.term);
            }
            session.send(event);
            self.ending.push((route, session));
        }
    }

    /// Publishes which session serves which (route, instance): live sessions first, then
    /// ending ones (an older generation still stopping keeps its sidecar).
    fn publish_table(&self) {
        let mut sessions: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
        let live = self.live.iter().map(|(r, s)| (r, s, true));
        let ending = self.ending.iter().map(|(r, s)| (r, s, false));
        for (route, session, live) in live.chain(ending) {
            sessions.entry(route.clone()).or_default().push(Entry {
                instance: session.held().instance.clone(),
                live,
                sidecars: session.sidecars(),
            });
        }
        self.table.send_replace(Arc::new(RouteTable {
            sessions,
            directory: Arc::clone(&self.directory),
            recovery_deadline_ms: self.recovery_deadline_ms,
        }));
    }

    /// A new stream: its first report is complete and nothing it sends is a difference from
    /// what an earlier stream said.
    pub(crate) fn new_stream(&mut self) {
        self.reported.clear();
    }

    /// The status of this process's instances — all of them (`complete`), or only those that
    /// changed since the previous report of this stream — bounded to
    /// [`proto::MAX_STATUS_REPORT_BYTES`]. Ended sessions appear until one report has shown
    /// their final phase.
    pub(crate) fn report(&mut self, applied_revision: u64, complete: bool) -> StatusReport {
        // Events a full inbox could not take go now, as far as it takes them.
        self.live.values_mut().for_each(SessionHandle::flush);
        self.ending.iter_mut().for_each(|(_, s)| s.flush());
        let mut instances: Vec<InstanceStatus> = self.live.values().map(SessionHandle::status).collect();
        let ending_before = self.ending.len();
        for (route, session) in std::mem::take(&mut self.ending) {
            // Judge the status that goes into this report, not a newer one.
            let status = session.status();
            let reported_final = InstancePhase::from_wire(status.phase).is_terminal();
            if !self.live.contains_key(&route) {
                instances.push(status);
            }
            if !reported_final {
                self.ending.push((route, session));
            }
        }
        if self.ending.len() != ending_before {
            self.publish_table();
            // The next report shows them gone; send it soon rather than in 10 s.
            self.changed.notify_one();
        }
        let instances = if complete {
            self.reported = instances.iter().map(|s| (s.route.clone(), s.clone())).collect();
            instances
        } else {
            let mut changed = Vec::new();
            for status in instances {
                if self.reported.get(&status.route) != Some(&status) {
                    self.reported.insert(status.route.clone(), status.clone());
                    changed.push(status);
                }
            }
            changed
        };
        bounded(StatusReport {
            instances,
            applied_revision,
            partial: !complete,
        })
    }

    /// Ends every session task without stopping or releasing anything (the member exits).
    /// Sessions already stopping complete their stop: await the returned tasks (bounded).
    pub(crate) fn abandon(&mut self) -> Vec<JoinHandle<()>> {
        let live = std::mem::take(&mut self.live).into_values();
        let ending = std::mem::take(&mut self.ending).into_iter().map(|(_, s)| s);
        // The route table keeps their entries: a stopping session's sidecar may reconnect.
        live.chain(ending).map(SessionHandle::abandon).collect()
    }
}

/// Shrinks the free-text messages (never the entries: absence means "not hosted") until the
/// report fits [`proto::MAX_STATUS_REPORT_BYTES`]. Messages are truncated on UTF-8 boundaries.
fn bounded(mut report: StatusReport) -> StatusReport {
    let mut limit = proto::MAX_STATUS_MESSAGE_BYTES;
    loop {
        for status in &mut report.instances {
            truncate_utf8(&mut status.message, limit);
        }
        if report.encoded_len() <= proto::MAX_STATUS_REPORT_BYTES || limit == 0 {
            return report;
        }
        limit /= 2;
    }
}

use plumbing::text::truncate as truncate_utf8;

#[cfg(test)]
mod tests {
    use proto::common::v1::InstanceRef;

    use super::*;

    #[test]
    fn truncation_keeps_utf8_boundaries() {
        let mut text = "ééé".to_owned(); // 6 bytes
        truncate_utf8(&mut text, 3);
        assert_eq!(text, "é");
        let mut short = "ok".to_owned();
        truncate_utf8(&mut short, 512);
        assert_eq!(short, "ok");
    }

    #[test]
    fn oversized_reports_shrink_messages_but_keep_every_entry() {
        let big = |i: usize| InstanceStatus {
            route: format!("{i:0>250}"),
            instance: Some(InstanceRef {
                namespace: "n".repeat(63),
                name: "p".repeat(253),
                uid: "u".repeat(64),
                generation: 1,
            }),
            term: 1,
            phase: 2,
            message: "m".repeat(2000),
            ..Default::default()
        };
        let report = StatusReport {
            instances: (0..256).map(big).collect(),
            applied_revision: 1,
            partial: false,
        };
        assert!(report.encoded_len() > proto::MAX_STATUS_REPORT_BYTES);
        let report = bounded(report);
        assert_eq!(report.instances.len(), 256);
        assert!(report.encoded_len() <= proto::MAX_STATUS_REPORT_BYTES);
        assert!(
            report
                .instances
                .iter()
                .all(|s| s.message.len() <= proto::MAX_STATUS_MESSAGE_BYTES)
        );
    }
}
