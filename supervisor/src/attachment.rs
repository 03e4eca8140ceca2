//! The member's attachment to the gateway, its host stream client: one long-lived `SupervisorHost.Attach` stream to one gateway replica
//! at a time (host.proto is the specification).
//!
//! Per stream: Hello (with a connection epoch one higher than the previous stream's), a
//! Heartbeat every [`timing::HEARTBEAT_INTERVAL`], an Ack after applying each snapshot, a complete
//! StatusReport after each snapshot and at least every 10 s, a partial one (only what changed)
//! after status changes, at most one per [`REPORT_WINDOW`], and
//! Leaving once on graceful shutdown. No gateway message for [`timing::SILENCE_TIMEOUT`]
//! closes the stream. Reconnects rotate over the gateway replicas with
//! [`timing::reconnect_backoff`], each attempt bounded by [`timing::CONNECT_TIMEOUT`] — longer
//! after a round of attempts that all timed out ([`timing::attempt_timeout`]: a slow link
//! degrades, it does not break) — forever:
//! also after the gateway superseded the stream (ABORTED) or refused a hello because another
//! process holds the member name — neither proves this process is not the member's live one
//! (whoever holds the member's token can attach), so neither makes it exit. A closed stream
//! never stops or releases a session by itself.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use plumbing::tls::{ClientTls, ConnectError};
use proto::host::v1::member_message::Kind;
use proto::host::v1::supervisor_host_client::SupervisorHostClient;
use proto::host::v1::{Ack, GatewayMessage, Heartbeat, Hello, Leaving, MemberMessage, gateway_message};
use proto::timing;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status, Streaming};

use crate::config::{self, TokenError};
use crate::health::Readiness;
use crate::sessions::SessionSet;

/// host.proto: a complete StatusReport "at least every 10 s".
const STATUS_REPORT_INTERVAL: Duration = Duration::from_secs(10);
/// host.proto: partial reports "coalesced to at most one per 100 ms".
const REPORT_WINDOW: Duration = Duration::from_millis(100);
/// After the first shutdown signal, how long the member keeps hosting while the gateway moves
/// its instances away.
pub const LEAVE_BOUND: Duration = Duration::from_secs(10);
/// Outbound messages queued towards the gateway; a full queue means the gateway stopped
/// reading, and the member reconnects.
const OUTBOUND_CAPACITY: usize = 64;

/// Who this member process is (the Hello of every stream, except the epoch).
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub member: String,
    pub process_id: String,
    pub runtime_address: String,
    pub capacity: u32,
    pub started_at_ms: i64,
}

/// Ends of the attachment (the host stream) that end the member: only a hello the gateway
/// refuses as invalid (a setting to fix).
#[derive(Debug, thiserror::Error)]
pub enum AttachmentError {
    #[error("the gateway refused this member: {0}")]
    Refused(String),
}

/// Why one connection attempt failed; logged, then the next replica is tried.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Status(#[from] Status),
}

/// A stream left because its gateway fell silent, held open until the next stream is
/// attached: the replica at its other end may still count this member by it, and ends the
/// membership when it ends — a no-op once the newer stream's record is there, a move of every
/// instance before it (make before break).
struct LeftOpen {
    _outbound: Option<mpsc::Sender<MemberMessage>>,
    _inbound: Streaming<GatewayMessage>,
}

/// What the reconnect loop does after a stream or an attempt ended.
enum Flow {
    Reconnect { reason: String, heard: bool },
    Exit,
}

pub(crate) struct Attachment {
    identity: Identity,
    endpoints: Vec<String>,
    token_file: Option<PathBuf>,
    tls: ClientTls,
    shutdown: CancellationToken,
    started: Instant,
    epoch: u64,
    next_endpoint: usize,
    /// Set by the first shutdown signal: hosting continues until then at most.
    leave_by: Option<Instant>,
    /// Attached (a gateway message arrived on the current stream) or not, for `/readyz`.
    readiness: Arc<Readiness>,
    /// The stream left for silence, until the next one is attached.
    left_open: Option<LeftOpen>,
    /// Attempts in a row that timed out (none got an answer): the next one's bound.
    timed_out: u32,
}

impl Attachment {
    pub(crate) fn new(
        identity: Identity,
        endpoints: Vec<String>,
        token_file: Option<PathBuf>,
        tls: ClientTls,
        shutdown: CancellationToken,
        readiness: Arc<Readiness>,
    ) -> Self {
        Self {
            identity,
            endpoints,
            token_file,
            tls,
            shutdown,
            started: Instant::now(),
            epoch: 0,
            next_endpoint: 0,
            leave_by: None,
            readiness,
            left_open: None,
            timed_out: 0,
        }
    }

    /// Keeps the member attached until it has left gracefully, or a stream end that ends the
    /// member (hello refused as invalid).
    pub(crate) async fn run(mut self, sessions: &mut SessionSet) -> Result<(), AttachmentError> {
        let mut failures = 0u32;
        loop {
            let endpoint = self.endpoints[self.next_endpoint % self.endpoints.len()].clone();
            self.next_endpoint += 1;
            self.epoch += 1;
            tracing::debug!(%endpoint, epoch = self.epoch, "attaching to gateway");
            let attempt = self.attach(&endpoint).await;
            self.timed_out = match &attempt {
                Err(AttemptError::Timeout(_) | AttemptError::Connect(ConnectError::Timeout { .. })) => {
                    self.timed_out.saturating_add(1)
                }
                // A gateway answered: the link carries a stream in time.
                Ok(_) | Err(AttemptError::Status(_)) => 0,
                // A refused connection or an unreadable token says nothing of a slow link
                // (one replica down must not keep the bound short for the others).
                Err(_) => self.timed_out,
            };
            let flow = match attempt {
                Ok((outbound, inbound)) => {
                    tracing::info!(%endpoint, epoch = self.epoch, "attached to gateway");
                    if self.left_open.take().is_some() {
                        tracing::debug!("closed the stream left for silence, now that this one is attached");
                    }
                    let served = self.serve(outbound, inbound, sessions).await;
                    self.readiness.set_gateway_attached(false);
                    served?
                }
                Err(AttemptError::Status(status)) => self.on_status(&status, false)?,
                Err(err) => Flow::Reconnect {
                    reason: err.to_string(),
                    heard: false,
                },
            };
            let Flow::Reconnect { reason, heard } = flow else {
                return Ok(());
            };
            if heard {
                failures = 0;
            }
            failures += 1;
            if heard {
                tracing::warn!(%endpoint, %reason, "gateway stream ended; reconnecting");
            } else if failures.is_multiple_of(timing::RECONNECT_ATTEMPTS) {
                tracing::error!(%endpoint, failures, %reason, "no gateway replica reachable; still trying");
            } else {
                tracing::debug!(%endpoint, %reason, "attempt failed; trying the next replica");
            }
            if self.pause(timing::reconnect_backoff(failures - 1), sessions).await {
                return Ok(());
            }
        }
    }

    /// Opens a stream: reads the token, connects (reading the CA bundle again) and sends
    /// Hello, all within the connect timeout.
    async fn attach(
        &self,
        endpoint: &str,
    ) -> Result<(mpsc::Sender<MemberMessage>, Streaming<GatewayMessage>), AttemptError> {
        let token = match &self.token_file {
            Some(path) => Some(config::read_token(path).await?),
            None => None,
        };
        let (outbound, queue) = mpsc::channel(OUTBOUND_CAPACITY);
        let hello = Hello {
            member: self.identity.member.clone(),
            process_id: self.identity.process_id.clone(),
            connection_epoch: self.epoch,
            runtime_address: self.identity.runtime_address.clone(),
            capacity: self.identity.capacity,
            build_version: plumbing::build::version().to_owned(),
            process_started_at_ms: self.identity.started_at_ms,
            directory_deltas: true,
        };
        let _fresh_queue_has_room = outbound.try_send(MemberMessage {
            kind: Some(Kind::Hello(hello)),
        });
        let mut request = tonic::Request::new(ReceiverStream::new(queue));
        if let Some(token) = token {
            token
                .authorize(&mut request)
                .map_err(|_| Status::internal("token is not valid metadata"))?;
        }
        let bound = timing::attempt_timeout(self.timed_out);
        let attempt = async {
            let channel = self.tls.connect(endpoint, bound).await?;
            let mut client = SupervisorHostClient::new(channel)
                .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
            Ok::<_, AttemptError>(client.attach(request).await?)
        };
        let response = tokio::time::timeout(bound, attempt)
            .await
            .map_err(|_| AttemptError::Timeout(bound))??;
        Ok((outbound, response.into_inner()))
    }

    /// Serves one attached stream until it ends.
    async fn serve(
        &mut self,
        outbound: mpsc::Sender<MemberMessage>,
        mut inbound: Streaming<GatewayMessage>,
        sessions: &mut SessionSet,
    ) -> Result<Flow, AttachmentError> {
        let changed = sessions.changed();
        let shutdown = self.shutdown.clone();
        let mut outbound = Some(outbound);
        let mut heartbeat = tokio::time::interval(timing::HEARTBEAT_INTERVAL);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut report_timer = tokio::time::interval(STATUS_REPORT_INTERVAL);
        let mut sequence = 0u64;
        let mut applied = 0u64;
        let mut heard = false;
        let mut last_heard = Instant::now();
        // When the next partial report goes out (set by a status change), and when the last
        // report went: changes within one window share a report.
        let mut report_due: Option<Instant> = None;
        let mut last_report = Instant::now();
        sessions.new_stream();
        let mut pending = Vec::new();
        if self.leave_by.is_some() {
            pending.push(leaving());
        }
        loop {
            for kind in pending.drain(..) {
                let Some(queue) = &outbound else { break };
                if let Err(TrySendError::Full(_)) = queue.try_send(MemberMessage { kind: Some(kind) }) {
                    let reason = "the gateway is not reading the stream".to_owned();
                    return Ok(Flow::Reconnect { reason, heard });
                }
                // A closed queue: the stream ended; its status arrives on `inbound`.
            }
            if self.leave_by.is_some() && sessions.is_idle() && outbound.take().is_some() {
                tracing::info!("nothing hosted any more; closing the stream");
            }
            let leave_by = self.leave_by.unwrap_or_else(|| Instant::now() + LEAVE_BOUND);
            tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(message)) => {
                        last_heard = Instant::now();
                        if !heard {
                            self.readiness.set_gateway_attached(true);
                        }
                        heard = true;
                        if let Some(gateway_message::Kind::Snapshot(snapshot)) = message.kind {
                            if snapshot.revision <= applied {
                                tracing::warn!(revision = snapshot.revision, applied, "ignoring a non-increasing snapshot revision");
                                continue;
                            }
                            sessions.apply(&snapshot);
                            applied = snapshot.revision;
                            tracing::debug!(revision = applied, hosted = sessions.hosted(), "applied snapshot");
                            pending.push(Kind::Ack(Ack { revision: applied }));
                            pending.push(Kind::StatusReport(sessions.report(applied, true)));
                            (report_due, last_report) = (None, Instant::now());
                        }
                    }
                    Ok(None) if outbound.is_none() => return Ok(Flow::Exit),
                    Ok(None) => {
                        let reason = "the gateway closed the stream".to_owned();
                        return Ok(Flow::Reconnect { reason, heard });
                    }
                    Err(status) => return self.on_status(&status, heard),
                },
                _ = heartbeat.tick(), if outbound.is_some() => {
                    sequence += 1;
                    let monotonic_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
                    pending.push(Kind::Heartbeat(Heartbeat { sequence, monotonic_ms }));
                }
                _ = report_timer.tick() => {
                    pending.push(Kind::StatusReport(sessions.report(applied, true)));
                    (report_due, last_report) = (None, Instant::now());
                }
                () = changed.notified() => {
                    report_due.get_or_insert_with(|| (last_report + REPORT_WINDOW).max(Instant::now()));
                }
                () = sleep_until_some(report_due), if report_due.is_some() => {
                    pending.push(Kind::StatusReport(sessions.report(applied, false)));
                    (report_due, last_report) = (None, Instant::now());
                }
                () = tokio::time::sleep_until(last_heard + timing::SILENCE_TIMEOUT) => {
                    let reason = format!("no gateway message for {:?}", timing::SILENCE_TIMEOUT);
                    self.left_open = Some(LeftOpen {
                        _outbound: outbound.take(),
                        _inbound: inbound,
                    });
                    return Ok(Flow::Reconnect { reason, heard });
                }
                () = shutdown.cancelled(), if self.leave_by.is_none() => {
                    self.start_leaving(sessions);
                    pending.push(leaving());
                }
                () = tokio::time::sleep_until(leave_by), if self.leave_by.is_some() => {
                    tracing::warn!(hosted = sessions.hosted(), "leave bound passed; exiting (workloads keep running)");
                    return Ok(Flow::Exit);
                }
            }
        }
    }

    /// Classifies a refusal or stream end (host.proto "Refusals and stream ends").
    fn on_status(&self, status: &Status, heard: bool) -> Result<Flow, AttachmentError> {
        let message = status.message();
        let reason = match status.code() {
            // Another stream of this member name was admitted (the gateway admits another
            // process only once this one's record was gone): attach again, with backoff — the
            // gateway admits this process back once the other one's record is gone, and a
            // stream opened with a stolen token never makes the real member exit.
            Code::Aborted => format!("superseded ({message}); attaching again"),
            Code::InvalidArgument => return Err(AttachmentError::Refused(message.to_owned())),
            Code::Unauthenticated => format!("token refused ({message}); re-reading the token file"),
            Code::FailedPrecondition => {
                format!("hello refused ({message}); attaching again with a new connection epoch")
            }
            code => format!("stream ended with {code:?}: {message}"),
        };
        Ok(Flow::Reconnect { reason, heard })
    }

    /// Waits `delay` before the next attempt. True when the member should exit instead:
    /// leaving with nothing hosted, or past the leave bound.
    async fn pause(&mut self, delay: Duration, sessions: &SessionSet) -> bool {
        let shutdown = self.shutdown.clone();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled(), if self.leave_by.is_none() => self.start_leaving(sessions),
        }
        self.leave_by
            .is_some_and(|by| sessions.is_idle() || Instant::now() >= by)
    }

    fn start_leaving(&mut self, sessions: &SessionSet) {
        tracing::info!(
            hosted = sessions.hosted(),
            "leaving the pool (signal again to exit at once)"
        );
        self.leave_by = Some(Instant::now() + LEAVE_BOUND);
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at).await;
    }
}

fn leaving() -> Kind {
    Kind::Leaving(Leaving {
        reason: "shutdown signal".to_owned(),
    })
}
