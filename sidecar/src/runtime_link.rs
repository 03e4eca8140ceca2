//! One runtime stream to a supervisor member (`SupervisorRuntime.Connect`), run as its own
//! task: dial (bounded), send the first message (Attach, or a RecoveryHello once the episode's
//! budget allows), then heartbeat every `RUNTIME_HEARTBEAT_INTERVAL` and treat
//! `RUNTIME_SILENCE_TIMEOUT` without any message as a dead stream. Everything but heartbeats is
//! handed to the engine, which alone decides; the engine sends through `Link::send`, closes
//! gracefully by dropping the link, or fences at once with `Link::abort`.

use std::sync::Arc;

use plumbing::tls::{ClientTls, ConnectError};
use proto::runtime::v1::supervisor_runtime_client::SupervisorRuntimeClient;
use proto::runtime::v1::{Attach, Heartbeat, SidecarMessage, SupervisorMessage, sidecar_message, supervisor_message};
use proto::timing::{CONNECT_TIMEOUT, RUNTIME_HEARTBEAT_INTERVAL, RUNTIME_SILENCE_TIMEOUT};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior, sleep_until, timeout};
use tokio_stream::wrappers::ReceiverStream;
use tracing::debug;

use crate::episode::{Episode, Slot};
use crate::supervision::Token;

pub type StreamId = u64;

/// Messages queued towards one stream (relayed requests and control answers).
const OUTBOUND_CAPACITY: usize = 64;

/// What a link reports to the engine.
#[derive(Debug)]
pub enum LinkEvent {
    /// The stream is established (the member answered with headers).
    Opened,
    /// A member message other than a heartbeat.
    Message(SupervisorMessage),
    /// The stream ended; `opened` tells a failed dial from a closed stream.
    Closed { opened: bool, reason: String },
}

/// The first message of the stream.
#[derive(Debug)]
pub enum First {
    Attach(Attach),
    /// A RecoveryHello from the episode's budget, sent as soon as it allows.
    Hello(Arc<Episode>),
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("status {0}: {1}")]
    Status(tonic::Code, String),
    #[error("silent for {RUNTIME_SILENCE_TIMEOUT:?}")]
    Silent,
    #[error("recovery deadline reached before a hello could be sent")]
    Over,
    #[error("the stream's request side closed")]
    Gone,
    #[error("{0}")]
    Token(#[from] crate::supervision::Error),
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Self {
        Error::Status(status.code(), plumbing::text::bounded(status.message(), 256))
    }
}

/// The engine's handle on one stream.
#[derive(Debug)]
pub struct Link {
    tx: mpsc::Sender<SidecarMessage>,
    task: JoinHandle<()>,
}

impl Link {
    /// Dials `address` (verified with `tls` when it is https://) and runs the stream.
    pub fn spawn(
        id: StreamId,
        address: String,
        tls: ClientTls,
        first: First,
        token: Token,
        events: mpsc::Sender<(StreamId, LinkEvent)>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(OUTBOUND_CAPACITY);
        let task = tokio::spawn(async move {
            let mut opened = false;
            let dial = Dial {
                id,
                address: &address,
                tls: &tls,
            };
            let result = drive(dial, first, &token, &events, rx, &mut opened).await;
            let reason = match result {
                Ok(()) => "closed".to_owned(),
                Err(err) => err.to_string(),
            };
            debug!(stream = id, %address, %reason, "runtime stream ended");
            let _ = events.send((id, LinkEvent::Closed { opened, reason })).await;
        });
        Self { tx, task }
    }

    /// Queues a message, or says why the stream cannot take it.
    pub fn send(&self, kind: sidecar_message::Kind) -> Result<(), NotSent> {
        self.tx
            .try_send(SidecarMessage { kind: Some(kind) })
            .map_err(|err| match err {
                mpsc::error::TrySendError::Full(_) => NotSent::Congested,
                mpsc::error::TrySendError::Closed(_) => NotSent::Ended,
            })
    }

    /// Closes at once (fencing): the task and the stream are dropped, nothing more is read.
    pub fn abort(self) {
        self.task.abort();
    }

    /// Closes gracefully: queued messages are flushed, then the request side ends. Waits at
    /// most one heartbeat interval for the member to end its side.
    pub async fn close(self) {
        let Self { tx, task } = self;
        drop(tx);
        let abort = task.abort_handle();
        if timeout(RUNTIME_HEARTBEAT_INTERVAL * 2, task).await.is_err() {
            abort.abort();
        }
    }
}

/// Why a message was not queued on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotSent {
    /// The outbound queue is full: the member reads too slowly.
    Congested,
    /// The stream has ended (its `Closed` event follows).
    Ended,
}

/// Which stream dials where.
struct Dial<'a> {
    id: StreamId,
    address: &'a str,
    tls: &'a ClientTls,
}

async fn drive(
    Dial { id, address, tls }: Dial<'_>,
    first: First,
    token: &Token,
    events: &mpsc::Sender<(StreamId, LinkEvent)>,
    mut commands: mpsc::Receiver<SidecarMessage>,
    opened: &mut bool,
) -> Result<(), Error> {
    let channel = tls.connect(address, CONNECT_TIMEOUT).await?;
    let first = match first {
        First::Attach(attach) => sidecar_message::Kind::Attach(attach),
        First::Hello(episode) => loop {
            match episode.take(Instant::now().into_std()) {
                Slot::Ready(hello) => break sidecar_message::Kind::RecoveryHello(hello),
                Slot::Over => return Err(Error::Over),
                Slot::Wait(at) => tokio::select! {
                    () = sleep_until(Instant::from_std(at)) => {}
                    command = commands.recv() => if command.is_none() { return Ok(()) },
                },
            }
        },
    };
    let (out, out_rx) = mpsc::channel(OUTBOUND_CAPACITY);
    out.send(SidecarMessage { kind: Some(first) })
        .await
        .map_err(|_| Error::Gone)?;
    let mut request = tonic::Request::new(ReceiverStream::new(out_rx));
    request.metadata_mut().insert(
        proto::AUTHORIZATION_METADATA_KEY,
        token.bearer().map_err(crate::supervision::Error::from)?,
    );
    let mut client = SupervisorRuntimeClient::new(channel)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    // A live member answers the first message at once; a hung one never.
    let mut inbound = timeout(CONNECT_TIMEOUT, client.connect(request))
        .await
        .map_err(|_| Error::Silent)??
        .into_inner();
    *opened = true;
    if events.send((id, LinkEvent::Opened)).await.is_err() {
        return Ok(());
    }
    let mut beat = tokio::time::interval(RUNTIME_HEARTBEAT_INTERVAL);
    beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sequence = 0u64;
    let mut last_heard = Instant::now();
    loop {
        tokio::select! {
            message = inbound.message() => {
                let Some(message) = message? else { return Ok(()) };
                last_heard = Instant::now();
                if matches!(message.kind, Some(supervisor_message::Kind::Heartbeat(_))) {
                    continue;
                }
                if events.send((id, LinkEvent::Message(message))).await.is_err() {
                    return Ok(());
                }
            }
            command = commands.recv() => match command {
                Some(message) => if out.send(message).await.is_err() {
                    return Err(deliver_rest(id, &mut inbound, events).await);
                },
                None => {
                    // Graceful close: end our side, give the member a moment to end its own.
                    drop(out);
                    let drain = async { while let Ok(Some(_)) = inbound.message().await {} };
                    let _ = timeout(RUNTIME_HEARTBEAT_INTERVAL, drain).await;
                    return Ok(());
                }
            },
            _ = beat.tick() => {
                sequence += 1;
                let heartbeat = sidecar_message::Kind::Heartbeat(Heartbeat { sequence });
                if out.send(SidecarMessage { kind: Some(heartbeat) }).await.is_err() {
                    return Err(deliver_rest(id, &mut inbound, events).await);
                }
            }
            () = sleep_until(last_heard + RUNTIME_SILENCE_TIMEOUT) => return Err(Error::Silent),
        }
    }
}

/// Our side can no longer send: the member ended the stream. What it sent before ending it (a
/// Relinquish above all, which makes the end a planned move rather than a lost owner) is still
/// readable: hand it to the engine before the stream is reported closed.
async fn deliver_rest(
    id: StreamId,
    inbound: &mut tonic::Streaming<SupervisorMessage>,
    events: &mpsc::Sender<(StreamId, LinkEvent)>,
) -> Error {
    let rest = async {
        while let Ok(Some(message)) = inbound.message().await {
            if matches!(message.kind, Some(supervisor_message::Kind::Heartbeat(_))) {
                continue;
            }
            if events.send((id, LinkEvent::Message(message))).await.is_err() {
                return;
            }
        }
    };
    let _ = timeout(RUNTIME_HEARTBEAT_INTERVAL, rest).await;
    Error::Gone
}
