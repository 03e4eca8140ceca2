//! The member host stream (`host.v1.SupervisorHost.Attach`), served by every
//! replica: authenticate, admit one session per member, then per stream send
//! whole-state snapshots from the pool view, take acks, heartbeats and
//! reports, keep the membership record fresh, and end the stream on silence,
//! supersession, token expiry or shutdown.
//!
//! [`crate::sessions`] (one session per member) and [`protocol`] (revisions, acks and
//! term attribution) are pure; this file is the I/O around them.

pub mod protocol;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use proto::host::v1::member_message::Kind as MemberKind;
use proto::host::v1::supervisor_host_server::SupervisorHost;
use proto::host::v1::{GatewayMessage, HeartbeatAck, Hello, MemberMessage, gateway_message};
use proto::timing;
use std::collections::HashMap;

use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::kubernetes;
use crate::replica::Replica;
use crate::sessions::{Admission, RecordCheck, Superseded, check_record};
use crate::store::builds::{Component, RECORD_TIMEOUT};
use crate::store::{MemberRecord, MemberUpdate, OwnershipTerm, Report};
use protocol::HostProtocol;

/// The `SupervisorHost` service of one replica.
#[derive(Clone)]
pub struct Host {
    replica: Arc<Replica>,
    /// Per stream id: told (with the reason) when a newer hello supersedes it.
    supersede: Arc<std::sync::Mutex<HashMap<u64, watch::Sender<Option<Superseded>>>>>,
}

impl Host {
    pub fn new(replica: Arc<Replica>) -> Self {
        Self {
            replica,
            supersede: Arc::default(),
        }
    }
}

/// A member's validated hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub member: String,
    pub process_id: String,
    pub epoch: u64,
    pub runtime_address: String,
    pub capacity: u32,
    /// The member applies directory deltas (`Hello.directory_deltas`).
    pub directory_deltas: bool,
}

/// Check a hello; the error names the setting the operator must fix.
pub fn validate_hello(hello: &Hello) -> Result<Identity, Status> {
    let bad = |setting: &str, what: String| {
        Status::invalid_argument(format!(
            "{what}; set OPENSHELL_SUPERVISOR_POOL_{setting} on the supervisor"
        ))
    };
    let member = hello.member.as_str();
    if plumbing::validate::member_name(member).is_err() {
        return Err(bad(
            "MEMBER",
            "the hello has no valid member name (a DNS-1123 subdomain, such as the Pod name)".into(),
        ));
    }
    if hello.process_id.is_empty() || hello.process_id.len() > 64 {
        return Err(Status::invalid_argument(
            "the hello has no valid process_id (1..64 bytes)",
        ));
    }
    if hello.connection_epoch == 0 {
        return Err(Status::invalid_argument(
            "the hello's connection_epoch must be at least 1",
        ));
    }
    let address = &hello.runtime_address;
    if plumbing::validate::address(address, plumbing::validate::MAX_RUNTIME_ADDRESS_BYTES).is_err() {
        return Err(bad(
            "RUNTIME_ADDRESS",
            "the hello's runtime_address is not an http(s) URI with host and port".into(),
        ));
    }
    if !(1..=proto::MAX_INSTANCES_PER_MEMBER).contains(&hello.capacity) {
        return Err(bad(
            "CAPACITY",
            format!(
                "the hello's capacity {} is outside 1..={}",
                hello.capacity,
                proto::MAX_INSTANCES_PER_MEMBER
            ),
        ));
    }
    Ok(Identity {
        member: hello.member.clone(),
        process_id: hello.process_id.clone(),
        epoch: hello.connection_epoch,
        runtime_address: hello.runtime_address.clone(),
        capacity: hello.capacity,
        directory_deltas: hello.directory_deltas,
    })
}

type Outbound = Pin<Box<dyn futures::Stream<Item = Result<GatewayMessage, Status>> + Send>>;

#[tonic::async_trait]
impl SupervisorHost for Host {
    type AttachStream = Outbound;

    async fn record_audit(
        &self,
        request: Request<proto::host::v1::RecordAuditRequest>,
    ) -> Result<Response<proto::host::v1::RecordAuditResponse>, Status> {
        let caller = self.replica.keys.member(&request).await?;
        let request = request.into_inner();
        crate::input::check_route(&request.route)?;
        if let Err(denied) = caller.is(&request.member) {
            self.replica.metrics.call_denied();
            return Err(denied);
        }
        let term = OwnershipTerm::from_wire(request.term).map_err(|err| Status::invalid_argument(err.to_string()))?;
        let rows = crate::audit::rows(&request.records).map_err(Status::invalid_argument)?;
        let stored = self
            .replica
            .store
            .record_audit(&request.route, &caller.member, term, rows)
            .await;
        match stored {
            Ok(recorded) => {
                self.replica
                    .metrics
                    .egress_decisions_stored(recorded.new.iter().map(String::as_str));
                Ok(Response::new(proto::host::v1::RecordAuditResponse {
                    through: u64::try_from(recorded.through).unwrap_or(0),
                }))
            }
            Err(crate::store::Error::Denied { detail, .. }) => Err(Status::failed_precondition(detail)),
            Err(err) => Err(Status::unavailable(format!("cannot store the audit records: {err}"))),
        }
    }

    async fn attach(&self, request: Request<Streaming<MemberMessage>>) -> Result<Response<Outbound>, Status> {
        let caller = self.replica.keys.member(&request).await?;
        let mut inbound = request.into_inner();
        let first = timeout(timing::SILENCE_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello within the silence timeout"))??;
        let Some(MemberMessage {
            kind: Some(MemberKind::Hello(hello)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first message of a host stream must be a hello",
            ));
        };
        let identity = validate_hello(&hello)?;
        // A member attaches only under its own name.
        if let Err(denied) = caller.is(&identity.member) {
            self.replica.metrics.call_denied();
            return Err(denied);
        }

        // The store decides first whether this hello may hold the member's name: a newer
        // epoch of the recorded process, or another process once the recorded one's record is
        // gone. Only then does it supersede a stream here (a stranger with the member's token
        // and a new process id makes the live member's stream end never).
        let record = MemberUpdate {
            member: identity.member.clone(),
            process_id: identity.process_id.clone(),
            epoch: i64::try_from(identity.epoch).unwrap_or(i64::MAX),
            runtime_address: identity.runtime_address.clone(),
            capacity: i64::from(identity.capacity),
            served_by: self.replica.name.clone(),
            leaving: false,
        };
        if *self.replica.cut_off.borrow() {
            return Err(Status::unavailable(CUT_OFF));
        }
        match self.replica.store.record_member(&record, timing::MEMBERSHIP_TTL).await {
            Ok(_) => {}
            Err(err @ crate::store::Error::Conflict { .. }) => {
                return Err(Status::failed_precondition(err.to_string()));
            }
            Err(err) => return Err(Status::unavailable(format!("cannot record membership: {err}"))),
        }
        let admission = self
            .replica
            .sessions(|s| s.admit(&identity.member, &identity.process_id, identity.epoch));
        let (stream_id, supersedes) = match admission {
            Admission::Admitted { stream, supersedes } => (stream, supersedes),
            Admission::Refused(why) => {
                // A newer stream of this process got here first: the record is its, or goes.
                let _ = self
                    .replica
                    .store
                    .remove_member(&record.member, &record.process_id, record.epoch)
                    .await;
                return Err(Status::failed_precondition(why));
            }
        };
        let (tell, superseded) = watch::channel(None);
        {
            let mut table = self.supersede.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((old, why)) = supersedes
                && let Some(old) = table.remove(&old)
            {
                old.send_replace(Some(why));
            }
            table.insert(stream_id, tell);
        }

        // Views read from now on show this admission (or a newer one).
        let admitted_at = std::time::Instant::now();
        self.replica.wake.notify_one();
        info!(member = %identity.member, process = %identity.process_id, epoch = identity.epoch, "member attached");

        let (tx, rx) = mpsc::channel(16);
        let span =
            info_span!("member", member = %identity.member, process = %identity.process_id, epoch = identity.epoch);
        let session = Session {
            host: self.clone(),
            identity,
            stream_id,
            record,
            admitted_at,
            tx,
            superseded,
            token_expires_at_ms: caller.expires_at_ms,
            build_version: hello.build_version.clone(),
        };
        tokio::spawn(session.run(inbound).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx)) as Outbound))
    }
}

impl Host {
    fn end_session(&self, identity: &Identity, stream_id: u64) {
        self.replica.sessions(|s| s.end(&identity.member, stream_id));
        self.supersede
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&stream_id);
    }
}

/// How a stream ended, which decides whether the membership record goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The member closed the stream or it broke: the member is gone.
    MemberClosed,
    /// The member fell silent: a hung process, or a network path to this replica that lost
    /// its messages. Its membership ends after the replica's detached grace
    /// ([`timing::DETACHED_GRACE`] by default) unless it attaches again meanwhile.
    Silent,
    /// Superseded by a newer stream of the member, its token expired, this replica shutting
    /// down or cut off from the store: the member lives on (and attaches again). Never for a
    /// stream the member broke.
    Handover,
}

struct Session {
    host: Host,
    identity: Identity,
    stream_id: u64,
    record: MemberUpdate,
    /// When the admission's record was written: only views read after it can supersede.
    admitted_at: std::time::Instant,
    tx: mpsc::Sender<Result<GatewayMessage, Status>>,
    superseded: watch::Receiver<Option<Superseded>>,
    token_expires_at_ms: i64,
    /// What the member's hello said its build is (recorded once the stream runs).
    build_version: String,
}

impl Session {
    async fn run(mut self, mut inbound: Streaming<MemberMessage>) {
        let replica = self.host.replica.clone();
        // The member's build, for the status: once per admitted stream, bounded, beside the
        // stream (never delaying its first snapshot), and ended with it.
        let recording = tokio::spawn({
            let (store, member, version) = (
                replica.store.clone(),
                self.identity.member.clone(),
                std::mem::take(&mut self.build_version),
            );
            async move {
                let build = store.record_build(Component::Member, &member, &version);
                if !matches!(tokio::time::timeout(RECORD_TIMEOUT, build).await, Ok(Ok(()))) {
                    tracing::debug!("the member's build was not recorded");
                }
            }
        });
        let mut view = replica.view.clone();
        let mut superseded = self.superseded.clone();
        let mut protocol = HostProtocol::new(self.identity.directory_deltas);
        let mut silence = Box::pin(sleep(timing::SILENCE_TIMEOUT));
        let mut refresh = tokio::time::interval(timing::MEMBERSHIP_REFRESH);
        refresh.reset();
        let token_expiry = Instant::now() + until(self.token_expires_at_ms);
        let mut refreshing: Option<tokio::task::JoinHandle<Refreshed>> = None;
        // The snapshot input revision last built from: unchanged input, no rebuild.
        let mut built: Option<u64> = None;
        view.mark_changed();
        // A Pod's egress policy changed: the snapshot is built again from the same view.
        let mut policies = replica.policies.as_ref().map(kubernetes::Shared::egress_changes);
        let mut cut_off = replica.cut_off.clone();
        // Past it the first snapshot is built without the member's report.
        let mut first_report_by = Box::pin(tokio::time::sleep_until((self.admitted_at + FIRST_REPORT_WAIT).into()));
        let mut first_report_waited = false;
        // The store's write counts as last seen: a rollback has the statuses written again.
        let mut store_writes: Option<crate::store::PoolWrites> = None;

        let end = loop {
            tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(message)) => {
                        silence.as_mut().reset(Instant::now() + timing::SILENCE_TIMEOUT);
                        let first_report = protocol.holding().is_none();
                        let handled = self.handle(message, &mut protocol).await;
                        if first_report && protocol.holding().is_some() {
                            // The snapshot waited for it (below): build it now.
                            view.mark_changed();
                        }
                        if !handled {
                            // The member broke the protocol or stopped reading (its connection
                            // is gone): not a handover — no newer stream of it exists, or the
                            // removal below (bound to this stream's process and epoch) is a no-op.
                            break End::MemberClosed;
                        }
                    }
                    Ok(None) => break End::MemberClosed,
                    Err(status) => {
                        // A broken connection, or a message the server refused to decode
                        // (e.g. above the size bound): either way the member must see an
                        // error, never a clean end of the stream.
                        let message = plumbing::text::bounded(status.message(), 256);
                        warn!(code = ?status.code(), %message, "member stream broke");
                        self.close(Status::new(status.code(), format!("member stream refused: {message}"))).await;
                        break End::MemberClosed;
                    }
                },
                () = &mut silence => {
                    warn!("member silent past the silence timeout; closing its stream");
                    self.close(Status::deadline_exceeded("member silent past the silence timeout")).await;
                    break End::Silent;
                }
                changed = view.changed() => {
                    if changed.is_err() {
                        break End::Handover;
                    }
                    let current = view.borrow_and_update().clone();
                    if current.now_ms == 0 {
                        continue; // nothing is sent before the first view
                    }
                    if let Some(writes) = current.writes {
                        if store_writes.is_some_and(|before| writes.rolled_back_since(&before)) {
                            info!("the store lost writes: this member's statuses are written again with its next report");
                            protocol.store_rolled_back();
                        }
                        store_writes = Some(writes);
                    }
                    let read_after_admission = current.read_at.is_some_and(|at| at > self.admitted_at);
                    if let Some(end) = self
                        .judge(current.members.get(&self.identity.member), current.now_ms, read_after_admission)
                        .await
                    {
                        break end;
                    }
                    if !read_after_admission {
                        // A view read before this stream was admitted may predate assignments
                        // made since (after a store outage: by half a minute); a snapshot built
                        // from it would have the member relinquish what it still owns. The next
                        // read (at most a refresh away) is fresh.
                        continue;
                    }
                    if protocol.holding().is_none() && self.admitted_at.elapsed() < FIRST_REPORT_WAIT {
                        // What the member hosts comes first (it reports at once): a store that
                        // rolled back may have forgotten terms it serves, which it must keep.
                        continue;
                    }
                    if current.snapshot_revision != 0
                        && built == Some(current.snapshot_revision)
                        && !protocol.unregistered_bound_passed(std::time::Instant::now())
                    {
                        continue;
                    }
                    built = Some(current.snapshot_revision);
                    let mut body = current.snapshot_for(&self.identity.member, &self.identity.process_id, replica.recovery_deadline_ms);
                    if let Some(holding) = protocol.holding() {
                        let kept = crate::forgotten::held_above(&current, holding)
                            .filter(|route| !body.keep_routes.contains(route))
                            .cloned()
                            .collect::<Vec<_>>();
                        body.keep_routes.extend(kept);
                        let proven: Vec<String> = crate::forgotten::held_proven(&current, (&self.identity.member, &self.identity.process_id), holding).cloned().collect();
                        let unregistered: Vec<String> = crate::forgotten::unregistered(&current, holding).cloned().collect();
                        protocol.set_held_above(proven);
                        body.keep_routes.extend(protocol.keep_unregistered(unregistered, std::time::Instant::now()));
                    }
                    if let Some(shared) = &replica.policies {
                        with_policies(&mut body, shared);
                    }
                    if let Some(snapshot) = protocol.next_snapshot(body, current.directory()) {
                        let snapshot = proto::host::v1::Snapshot { gateway_replica: replica.name.clone(), ..snapshot };
                        replica.metrics.snapshot_sent(snapshot.encoded_len());
                        if !self.send(gateway_message::Kind::Snapshot(snapshot)).await {
                            break End::Silent;
                        }
                    }
                }
                () = first_report_by.as_mut(), if !first_report_waited => {
                    first_report_waited = true;
                    if protocol.holding().is_none() {
                        view.mark_changed();
                    }
                }
                Ok(()) = async {
                    match policies.as_mut() {
                        Some(changes) => changes.changed().await,
                        None => std::future::pending().await,
                    }
                } => {
                    built = None;
                    view.mark_changed();
                }
                _ = refresh.tick() => {
                    if silence.deadline() <= Instant::now() {
                        // This replica may have been the one that stopped (paused): an unanswered
                        // stream never refreshes the record, however late its silence is noticed.
                        warn!("member silent past the silence timeout; closing its stream");
                        self.close(Status::deadline_exceeded("member silent past the silence timeout")).await;
                        break End::Silent;
                    }
                    // In a task of its own: the stream goes on answering heartbeats while the
                    // store is slow or down (one refresh at a time).
                    if refreshing.is_none() {
                        let (store, record) = (replica.store.clone(), self.record.clone());
                        refreshing = Some(tokio::spawn(async move { refresh_membership(&store, &record).await }));
                    }
                }
                done = async {
                    match refreshing.as_mut() {
                        Some(task) => task.await,
                        None => std::future::pending().await,
                    }
                }, if refreshing.is_some() => {
                    refreshing = None;
                    if let Ok(Refreshed::Lapsed(now_ms, record)) = done
                        && let Some(end) = self.judge(record.as_ref(), now_ms, true).await
                    {
                        break end;
                    }
                }
                why = async { superseded.wait_for(Option::is_some).await.ok().and_then(|w| *w) } => {
                    let status = match why {
                        Some(Superseded::NewerProcess) => Status::aborted("superseded by a new process of this member"),
                        _ => Status::aborted("superseded by a newer connection epoch"),
                    };
                    self.close(status).await;
                    break End::Handover;
                }
                () = sleep_until(token_expiry) => {
                    self.close(Status::unauthenticated("the supervisor token that opened this stream expired")).await;
                    break End::Handover;
                }
                () = replica.shutdown.cancelled() => {
                    self.close(Status::unavailable("gateway replica shutting down; reconnect elsewhere")).await;
                    break End::Handover;
                }
                true = async { cut_off.wait_for(|cut| *cut).await.is_ok() } => {
                    // Nothing to write (it could not be): the member attaches through another
                    // replica, which records it, and keeps its instances.
                    self.close(Status::unavailable(CUT_OFF)).await;
                    break End::Handover;
                }
            }
        };
        recording.abort();

        self.host.end_session(&self.identity, self.stream_id);
        replica.reports.forget(self.stream_id);
        // A refresh still in flight would extend the membership past the end written below:
        // it finishes first (waited for one refresh interval at most).
        if let Some(task) = refreshing.take() {
            let _ = tokio::time::timeout(timing::MEMBERSHIP_REFRESH, task).await;
        }
        if end != End::Handover {
            let (member, process_id, epoch) = (&self.identity.member, &self.identity.process_id, self.record.epoch);
            let removed = if self.record.leaving {
                // Announced: keep the record (expired, leaving) so the pool view shows it left.
                replica.store.member_left(member, process_id, epoch).await
            } else if end == End::Silent {
                // Silent to this replica is not gone: a member cut off from it attaches
                // through another within the grace and keeps its instances.
                replica
                    .store
                    .member_detached(member, process_id, epoch, replica.detached_grace)
                    .await
            } else {
                replica.store.remove_member(member, process_id, epoch).await
            };
            match removed {
                Ok(true) if end == End::Silent => info!(
                    grace = ?replica.detached_grace,
                    "member silent; its membership ends after the grace unless it attaches again"
                ),
                Ok(true) => info!(?end, "member gone; membership removed"),
                Ok(false) => debug!(?end, "membership already taken by a newer stream"),
                Err(err) => warn!(error = %err, "cannot end the membership; it will expire"),
            }
            replica.wake.notify_one();
        } else {
            info!("member stream handed over");
        }
    }

    /// Act on the member's record as read at `now_ms`: close a superseded or lapsed stream
    /// (`Some`: how it ended).
    async fn judge(&self, record: Option<&MemberRecord>, now_ms: i64, read_after_admission: bool) -> Option<End> {
        match check_record(
            &self.identity.process_id,
            self.record.epoch,
            record,
            now_ms,
            read_after_admission,
        ) {
            RecordCheck::Current => None,
            RecordCheck::Superseded(why) => {
                let status = match why {
                    Superseded::NewerProcess => "superseded by a new process of this member",
                    Superseded::NewerEpoch => "superseded by a newer stream of this member",
                };
                self.close(Status::aborted(status)).await;
                Some(End::Handover)
            }
            RecordCheck::Lapsed => {
                warn!("membership record expired or removed under this stream; the member must attach again");
                self.close(Status::unavailable(
                    "membership lapsed while this stream was unanswered; attach again",
                ))
                .await;
                Some(End::Handover)
            }
        }
    }

    /// Handle one member message; `false` ends the stream.
    async fn handle(&mut self, message: MemberMessage, protocol: &mut HostProtocol) -> bool {
        let replica = self.host.replica.clone();
        let metrics = &replica.metrics;
        let encoded_len = message.encoded_len();
        if matches!(message.kind, Some(MemberKind::StatusReport(_))) {
            metrics.report_received(encoded_len);
        }
        match message.kind {
            Some(MemberKind::Heartbeat(beat)) => {
                let ack = HeartbeatAck {
                    sequence: beat.sequence,
                    gateway_time_ms: proto::trust::unix_ms(std::time::SystemTime::now()),
                };
                return self.send(gateway_message::Kind::HeartbeatAck(ack)).await;
            }
            Some(MemberKind::Ack(ack)) => match protocol.on_ack(ack.revision) {
                Ok(()) => {}
                Err(dropped) => metrics.dropped(dropped.reason()),
            },
            Some(MemberKind::StatusReport(report)) => match protocol.attribute(&report, encoded_len) {
                Ok(statuses) => {
                    protocol.hold(&report);
                    // Only what changed goes to the writer; the stream never waits for it.
                    let changes = protocol.changes(statuses);
                    let urgent = changes.iter().any(|c| c.urgent);
                    let records = changes
                        .into_iter()
                        .filter_map(|c| {
                            // Attributed to a term this stream installed (from an assignment,
                            // so in the store's range): an out-of-range one is never written.
                            let term = OwnershipTerm::from_wire(c.status.term)
                                .inspect_err(
                                    |err| warn!(route = %c.status.route, error = %err, "status report dropped"),
                                )
                                .ok()?;
                            Some((c, term))
                        })
                        .map(|(c, term)| Report {
                            route: c.status.route,
                            term,
                            member: self.identity.member.clone(),
                            process_id: self.identity.process_id.clone(),
                            phase: c.status.phase,
                            message: c.status.message,
                            workload_pid: i64::from(c.status.workload_pid),
                            progress: c.status.progress.map(|p| i64::try_from(p).unwrap_or(i64::MAX)),
                            reported_by: replica.name.clone(),
                            updated_at_ms: 0,
                            policy: c.status.policy,
                        })
                        .collect();
                    replica
                        .reports
                        .submit((self.stream_id, self.record.epoch), records, urgent);
                }
                Err(dropped) => metrics.dropped(dropped.reason()),
            },
            Some(MemberKind::Leaving(leaving)) => {
                info!(reason = %plumbing::text::bounded(&leaving.reason, 256), "member announced it is leaving");
                self.record.leaving = true;
                // Bounded: heartbeats wait behind it.
                let recorded = timeout(
                    timing::HEARTBEAT_INTERVAL,
                    replica.store.refresh_member(&self.record, timing::MEMBERSHIP_TTL),
                );
                match recorded.await {
                    Ok(Ok(Some(_))) => {}
                    // A newer stream owns the record; the view check ends this one.
                    Ok(Ok(None)) => info!("leaving announcement of a superseded stream ignored"),
                    Ok(Err(err)) => warn!(error = %err, "cannot record the leaving announcement"),
                    Err(_) => {
                        warn!("recording the leaving announcement timed out; the stream's next refresh carries it")
                    }
                }
                replica.wake.notify_one();
            }
            Some(MemberKind::Hello(_)) | None => {
                self.close(Status::invalid_argument("hello is only valid as the first message"))
                    .await;
                return false;
            }
        }
        true
    }

    /// Send a message; a member that does not read within the silence
    /// timeout is dropped (`false`).
    async fn send(&self, kind: gateway_message::Kind) -> bool {
        let message = GatewayMessage { kind: Some(kind) };
        timeout(timing::SILENCE_TIMEOUT, self.tx.send(Ok(message)))
            .await
            .is_ok_and(|sent| sent.is_ok())
    }

    async fn close(&self, status: Status) {
        let _ = timeout(Duration::from_millis(500), self.tx.send(Err(status))).await;
    }
}

/// How long the first snapshot of a stream waits for the member's first complete report (sent
/// right after its hello) before it is built without it.
const FIRST_REPORT_WAIT: std::time::Duration = timing::HEARTBEAT_INTERVAL;

/// Why a replica cut off from the store closes and refuses member streams
/// ([`timing::STORE_CUT_OFF`]).
const CUT_OFF: &str = "this gateway replica cannot reach the pool's store; attach through another replica";

/// What a membership refresh found.
enum Refreshed {
    /// Refreshed, or the store could not be asked (the record's TTL covers a slow store).
    Kept,
    /// Not this stream's live record any more: the record as read, at database time.
    Lapsed(i64, Option<MemberRecord>),
}

/// Refresh the stream's membership record (run as a task: never in the stream loop's way).
async fn refresh_membership(store: &crate::store::Store, record: &MemberUpdate) -> Refreshed {
    match store.refresh_member(record, timing::MEMBERSHIP_TTL).await {
        Ok(Some(_)) => Refreshed::Kept,
        Ok(None) => match store.member(&record.member).await {
            Ok((now_ms, current)) => Refreshed::Lapsed(now_ms, current),
            Err(err) => {
                warn!(error = %err, "cannot read membership");
                Refreshed::Kept
            }
        },
        Err(err) => {
            warn!(error = %err, "cannot refresh membership");
            Refreshed::Kept
        }
    }
}

/// Time from now until a Unix-ms instant (zero when past).
fn until(at_ms: i64) -> Duration {
    let now = proto::trust::unix_ms(std::time::SystemTime::now());
    Duration::from_millis(u64::try_from(at_ms.saturating_sub(now)).unwrap_or(0))
}

#[cfg(test)]
mod tests;

/// Each instance's egress policy, where this replica knows it.
fn with_policies(snapshot: &mut proto::host::v1::Snapshot, shared: &kubernetes::Shared) {
    shared.with(|index| {
        for owned in &mut snapshot.instances {
            let uid = owned.instance.as_ref().map_or("", |i| i.uid.as_str());
            owned.egress_policy = index.egress().policy_for(uid).map(|p| p.as_ref().clone());
        }
    });
}
