//! The workload's local endpoint: a Unix socket speaking newline-delimited JSON, one answer
//! line per request line, in order (protocol in sidecar/README.md). Each connection is identified by
//! the kernel (peer credentials), never by what it claims; the engine admits it only if it is
//! the workload process or one of its descendants (or pins the first one in socket mode).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use proto::common::v1::WorkloadIdentity;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio_util::codec::{Framed, LinesCodec, LinesCodecError};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::identity;

/// Longest request line (bytes, newline excluded).
pub const MAX_LINE_BYTES: usize = 16 * 1024;
/// Longest progress note (ReportProgress.note).
pub const MAX_NOTE_BYTES: usize = 256;
/// Most admitted connections open at once (the workload's and its descendants').
pub const MAX_CONNECTIONS: usize = 16;
/// Further admitted connections only the pinned workload process itself may open.
pub const RESERVED_FOR_WORKLOAD: usize = 4;
/// Most connections of other processes awaiting the admission decision.
pub const MAX_PENDING: usize = 16;
/// How long a connection may await its admission decision.
pub const ADMISSION_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refusal line may take to write.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);

/// The endpoint's bounds. A connection holds an admitted slot only once the engine admitted
/// it, so processes that are refused (anyone in the Pod who is not the workload or its
/// descendant) can use up only the pending slots, and the pinned workload process skips those
/// and has slots of its own.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub connections: usize,
    pub reserved: usize,
    pub pending: usize,
    pub admission: Duration,
    /// An admitted connection without a request for this long is closed.
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: MAX_CONNECTIONS,
            reserved: RESERVED_FOR_WORKLOAD,
            pending: MAX_PENDING,
            admission: ADMISSION_TIMEOUT,
            idle: Duration::from_secs(300),
        }
    }
}

/// What the endpoint serves with: the engine, the pinned workload's PID (from the engine) and
/// the bounds.
#[derive(Debug)]
pub struct Endpoint {
    pub engine: mpsc::Sender<Inbound>,
    pub workload: watch::Receiver<Option<u32>>,
    pub limits: Limits,
    /// The egress proxy's state, for `{"op":"policy"}` (`None`: no proxy).
    pub egress: Option<crate::egress::View>,
    /// Identifies connecting processes (shared with the search of the Pod's PID namespace).
    pub observer: Observer,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot bind the workload socket {path}: {source}")]
    Bind {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A workload request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Progress { value: u64, note: String },
    Liveness,
}

/// What a request line asks for: an operation relayed to the owner, or something the sidecar
/// answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    Relay(Op),
    /// The egress policy in force and the recent denials (answered without the owner).
    Policy,
    /// The retired `{"op":"credential"}`: a workload holds no credential, only placeholders.
    Credential,
}

/// The answer to one request.
#[derive(Debug)]
pub enum Answer {
    /// Accepted by the owner of `term` (`member`): lets a workload see who supervises it.
    Progress {
        value: u64,
        term: u64,
        member: String,
    },
    Alive,
    /// The sidecar's own answer (`Ask::Policy`).
    Local(Value),
    Refused(String),
}

/// A request and where its answer goes.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    pub reply: oneshot::Sender<Answer>,
}

/// How the engine judges a connecting process.
#[derive(Clone, Debug)]
pub enum Admission {
    Admitted,
    /// No workload is pinned yet: observe this process and pin it.
    NeedsIdentity,
    Refused(String),
}

/// What the endpoint asks the engine.
#[derive(Debug)]
pub enum Inbound {
    /// A process connected; `pid` from its peer credentials (None if not visible).
    Peer {
        pid: Option<u32>,
        reply: oneshot::Sender<Admission>,
    },
    /// Pin the workload to this observed process.
    Pin {
        identity: WorkloadIdentity,
        reply: oneshot::Sender<Admission>,
    },
    Request(Request),
}

/// Binds the socket, replacing a stale one.
pub fn bind(path: &Path) -> Result<UnixListener, Error> {
    let bind_error = |source| Error::Bind {
        path: path.display().to_string(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(bind_error)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(bind_error(err)),
    }
    UnixListener::bind(path).map_err(bind_error)
}

/// Serves connections until `cancel`.
pub async fn serve(listener: UnixListener, endpoint: Endpoint, cancel: CancellationToken) {
    let Endpoint {
        engine,
        workload,
        limits,
        egress,
        observer,
    } = endpoint;
    let slots = Slots {
        admitted: Arc::new(Semaphore::new(limits.connections)),
        reserved: Arc::new(Semaphore::new(limits.reserved)),
    };
    let pending = Arc::new(Semaphore::new(limits.pending));
    loop {
        let stream = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    warn!(error = %err, "workload socket accept failed");
                    continue;
                }
            },
        };
        let pid = peer_pid(&stream);
        let of_workload = pid.is_some() && pid == *workload.borrow();
        let waiting = if of_workload {
            None
        } else {
            match pending.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    // Best effort and never waited on: the accept loop serves the next one.
                    let _ = stream.try_write(refusal("too many connections awaiting admission").as_bytes());
                    continue;
                }
            }
        };
        let engine = engine.clone();
        let cancel = cancel.clone();
        let slots = slots.clone();
        let egress = egress.clone();
        let observer = observer.clone();
        tokio::spawn(async move {
            let peer = Peer {
                pid,
                of_workload,
                waiting,
            };
            let serving = Serving {
                engine: &engine,
                observer: &observer,
                slots: &slots,
                limits,
                egress: egress.as_ref(),
            };
            tokio::select! {
                () = cancel.cancelled() => {}
                () = connection(stream, peer, serving) => {}
            }
        });
    }
}

#[derive(Clone)]
struct Slots {
    admitted: Arc<Semaphore>,
    reserved: Arc<Semaphore>,
}

impl Slots {
    /// A slot for an admitted connection: a shared one, else (the workload process only) a
    /// reserved one.
    fn take(&self, of_workload: bool) -> Option<OwnedSemaphorePermit> {
        self.admitted.clone().try_acquire_owned().ok().or_else(|| {
            of_workload
                .then(|| self.reserved.clone().try_acquire_owned().ok())
                .flatten()
        })
    }
}

fn peer_pid(stream: &UnixStream) -> Option<u32> {
    stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0)
}

fn refusal(reason: &str) -> String {
    let mut line = render(None, &Answer::Refused(reason.into()));
    line.push('\n');
    line
}

async fn refuse(mut stream: UnixStream, reason: &str) {
    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, stream.write_all(refusal(reason).as_bytes())).await;
}

/// Why a connecting process the sidecar cannot observe is refused: when it runs as another
/// UID than the sidecar (an image whose `USER` is root, say), what to change, since the kernel
/// lets the sidecar identify and stop only a process of its own UID.
fn unobservable(err: &identity::Error, peer_uid: Option<u32>, own_uid: Option<u32>) -> String {
    match (peer_uid, own_uid) {
        (Some(peer), Some(own)) if peer != own => format!(
            "the connecting process runs as uid {peer} and the sidecar as uid {own}: the sidecar identifies and stops only a process of its own UID; \
             run the workload's container as uid {own} (runAsUser), or give the Pod one runAsUser for both ({err})"
        ),
        _ => format!("cannot observe the connecting process: {err}"),
    }
}

/// The effective UID of this process (the owner of `/proc/self`).
fn own_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

async fn admission(
    engine: &mpsc::Sender<Inbound>,
    observer: &Observer,
    pid: Option<u32>,
    peer_uid: Option<u32>,
) -> Admission {
    match ask(engine, |reply| Inbound::Peer { pid, reply }).await {
        Admission::NeedsIdentity => match pid {
            Some(pid) => match observer.pin(engine, pid).await {
                Ok(admission) => admission,
                Err(err) => {
                    let reason = unobservable(&err, peer_uid, own_uid());
                    // Once per process: a client reconnecting in a loop would flood the log.
                    static WARNED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                    if WARNED.swap(pid, std::sync::atomic::Ordering::Relaxed) == pid {
                        debug!(pid, %reason, "workload connection refused");
                    } else {
                        warn!(pid, %reason, "workload connection refused");
                    }
                    Admission::Refused(reason)
                }
            },
            None => Admission::Refused("the connecting process is not visible".into()),
        },
        other => other,
    }
}

/// How a process is observed (`identity::observe`; a stand-in in tests).
type Observe = dyn Fn(u32) -> Result<WorkloadIdentity, identity::Error> + Send + Sync;

/// What became of one observation: the engine's admission once pinned, or why the process
/// could not be observed.
type Observed = Result<Admission, Arc<identity::Error>>;

/// Identifies processes for the engine to pin, at most one observation per PID at a time.
/// Observing hashes the process's executable, which can outlast a connection's admission
/// time-out (a large binary, a CPU limit, a busy node). The observation then goes on and its
/// result is pinned all the same, and a connection that comes back joins the observation in
/// flight instead of starting over: the work is never thrown away, so admission converges
/// however slow the hashing is.
#[derive(Clone)]
pub struct Observer {
    observe: Arc<Observe>,
    in_flight: Arc<Mutex<HashMap<u32, watch::Receiver<Option<Observed>>>>>,
}

impl Default for Observer {
    fn default() -> Self {
        Self::new(Arc::new(identity::observe))
    }
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl Observer {
    fn new(observe: Arc<Observe>) -> Self {
        Self {
            observe,
            in_flight: Arc::default(),
        }
    }

    /// Observes process `pid` and asks the engine to pin it; the engine's admission, or why
    /// the process cannot be observed. Joins an observation of `pid` in flight; at most
    /// [`MAX_PENDING`] run at once (more are refused: each holds a blocking thread).
    pub async fn pin(&self, engine: &mpsc::Sender<Inbound>, pid: u32) -> Result<Admission, Arc<identity::Error>> {
        let mut observed = {
            let mut in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
            match in_flight.get(&pid) {
                Some(observed) => observed.clone(),
                None if in_flight.len() >= MAX_PENDING => {
                    return Ok(Admission::Refused("too many processes being identified at once".into()));
                }
                None => {
                    let (done, observed) = watch::channel(None);
                    in_flight.insert(pid, observed.clone());
                    tokio::spawn(self.clone().observe_and_pin(engine.clone(), pid, done));
                    observed
                }
            }
        };
        match observed.wait_for(Option::is_some).await {
            Ok(result) => result
                .clone()
                .unwrap_or_else(|| Ok(Admission::Refused(STOPPING.into()))),
            Err(_) => Ok(Admission::Refused(STOPPING.into())),
        }
    }

    /// One observation, to its end whoever still waits for it.
    async fn observe_and_pin(self, engine: mpsc::Sender<Inbound>, pid: u32, done: watch::Sender<Option<Observed>>) {
        let observe = self.observe.clone();
        let result = match tokio::task::spawn_blocking(move || observe(pid)).await {
            Ok(Ok(identity)) => Ok(ask(&engine, |reply| Inbound::Pin { identity, reply }).await),
            Ok(Err(err)) => Err(Arc::new(err)),
            Err(_) => Ok(Admission::Refused("cannot observe the connecting process".into())),
        };
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&pid);
        done.send_replace(Some(result));
    }
}

/// What a connection is served with.
struct Serving<'a> {
    engine: &'a mpsc::Sender<Inbound>,
    observer: &'a Observer,
    slots: &'a Slots,
    limits: Limits,
    egress: Option<&'a crate::egress::View>,
}

/// Who connected, and the admission slot it waits in (none for the pinned workload).
struct Peer {
    pid: Option<u32>,
    of_workload: bool,
    waiting: Option<OwnedSemaphorePermit>,
}

async fn connection(stream: UnixStream, peer: Peer, serving: Serving<'_>) {
    let Peer {
        pid,
        of_workload,
        waiting,
    } = peer;
    let Serving {
        engine,
        observer,
        slots,
        limits,
        egress,
    } = serving;
    let peer_uid = stream.peer_cred().ok().map(|c| c.uid());
    let admitted = tokio::time::timeout(limits.admission, admission(engine, observer, pid, peer_uid))
        .await
        .unwrap_or_else(|_| Admission::Refused("no admission decision in time".into()));
    drop(waiting);
    if let Admission::Refused(reason) = admitted {
        debug!(?pid, %reason, "workload connection refused");
        refuse(stream, &reason).await;
        return;
    }
    let Some(_slot) = slots.take(of_workload) else {
        let reason = format!("too many connections ({} open)", limits.connections);
        refuse(stream, &reason).await;
        return;
    };
    let mut framed = Framed::new(stream, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
    loop {
        let Ok(line) = tokio::time::timeout(limits.idle, framed.next()).await else {
            debug!(?pid, idle = ?limits.idle, "idle workload connection closed");
            return;
        };
        let Some(line) = line else { return };
        let (id, answer) = match line {
            Ok(line) if line.trim().is_empty() => continue,
            Ok(line) => match parse(&line) {
                Ok((id, Ask::Policy)) => (id, Answer::Local(crate::egress::View::describe(egress))),
                Ok((id, Ask::Credential)) => (
                    id,
                    Answer::Local(json!({"ok": false, "op": "credential", "error": proto::egress::NO_CREDENTIAL})),
                ),
                Ok((id, Ask::Relay(op))) => {
                    let (reply, answer) = oneshot::channel();
                    let answer = if engine.send(Inbound::Request(Request { op, reply })).await.is_ok() {
                        answer.await.unwrap_or_else(|_| Answer::Refused(STOPPING.into()))
                    } else {
                        Answer::Refused(STOPPING.into())
                    };
                    (id, answer)
                }
                Err(error) => (None, Answer::Refused(error)),
            },
            Err(LinesCodecError::MaxLineLengthExceeded) => {
                let answer = Answer::Refused(format!("request line longer than {MAX_LINE_BYTES} bytes"));
                let _ = framed.send(render(None, &answer)).await;
                return;
            }
            Err(LinesCodecError::Io(_)) => return,
        };
        if framed.send(render(id.as_ref(), &answer)).await.is_err() {
            return;
        }
    }
}

const STOPPING: &str = "the sidecar is stopping";

async fn ask(engine: &mpsc::Sender<Inbound>, message: impl FnOnce(oneshot::Sender<Admission>) -> Inbound) -> Admission {
    let (reply, answer) = oneshot::channel();
    if engine.send(message(reply)).await.is_err() {
        return Admission::Refused(STOPPING.into());
    }
    answer.await.unwrap_or_else(|_| Admission::Refused(STOPPING.into()))
}

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    id: Option<Value>,
    #[serde(flatten)]
    op: OpLine,
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum OpLine {
    Progress {
        value: u64,
        #[serde(default)]
        note: String,
    },
    Credential {},
    Liveness {},
    Policy {},
}

/// Parses one request line: the optional `id` (echoed in the answer) and the operation.
pub fn parse(line: &str) -> Result<(Option<Value>, Ask), String> {
    let line: Line = serde_json::from_str(line).map_err(|e| {
        format!("invalid request (expected {{\"op\":\"progress\"|\"credential\"|\"liveness\"|\"policy\",...}}): {e}")
    })?;
    if let Some(id) = &line.id
        && !(id.is_string() || id.is_number())
    {
        return Err("id must be a string or a number".into());
    }
    let op = match line.op {
        OpLine::Progress { note, .. } if note.len() > MAX_NOTE_BYTES => {
            return Err(format!("note longer than {MAX_NOTE_BYTES} bytes"));
        }
        OpLine::Progress { value, note } => Ask::Relay(Op::Progress { value, note }),
        OpLine::Credential {} => Ask::Credential,
        OpLine::Liveness {} => Ask::Relay(Op::Liveness),
        OpLine::Policy {} => Ask::Policy,
    };
    Ok((line.id, op))
}

/// Renders one answer line (without the newline).
pub fn render(id: Option<&Value>, answer: &Answer) -> String {
    let mut out = match answer {
        Answer::Progress { value, term, member } => {
            json!({"ok": true, "op": "progress", "value": value, "term": term, "member": member})
        }
        Answer::Alive => json!({"ok": true, "op": "liveness", "alive": true}),
        Answer::Local(value) => value.clone(),
        Answer::Refused(error) => json!({"ok": false, "error": error}),
    };
    if let (Some(id), Some(object)) = (id, out.as_object_mut()) {
        object.insert("id".into(), id.clone());
    }
    out.to_string()
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncBufReadExt, BufReader};

    use super::*;

    #[test]
    fn a_process_of_another_uid_is_told_what_to_change() {
        let err = identity::Error::Proc {
            pid: 18,
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        let told = unobservable(&err, Some(0), Some(65532));
        assert!(
            told.contains("runs as uid 0 and the sidecar as uid 65532") && told.contains("runAsUser"),
            "{told}"
        );
        let same = unobservable(&err, Some(65532), Some(65532));
        assert!(same.starts_with("cannot observe the connecting process"), "{same}");
        assert!(own_uid().is_some());
    }

    /// An endpoint on a fresh socket with a fake engine; the pinned workload is `workload`.
    struct Fixture {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        engine: mpsc::Receiver<Inbound>,
        workload: watch::Sender<Option<u32>>,
        _cancel: tokio_util::sync::DropGuard,
    }

    impl Fixture {
        fn start(limits: Limits) -> Self {
            Self::observing(limits, Observer::default())
        }

        fn observing(limits: Limits, observer: Observer) -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("workload.sock");
            let listener = bind(&path).expect("bind");
            let (engine_tx, engine) = mpsc::channel(64);
            // Someone else is the workload until a test says otherwise.
            let (workload, pinned) = watch::channel(Some(1));
            let cancel = CancellationToken::new();
            let endpoint = Endpoint {
                engine: engine_tx,
                workload: pinned,
                limits,
                egress: None,
                observer,
            };
            tokio::spawn(serve(listener, endpoint, cancel.clone()));
            Self {
                _dir: dir,
                path,
                engine,
                workload,
                _cancel: cancel.drop_guard(),
            }
        }

        async fn connect(&self) -> BufReader<UnixStream> {
            BufReader::new(UnixStream::connect(&self.path).await.expect("connect"))
        }

        /// The next admission question (a `Peer` event), not yet answered.
        async fn question(&mut self) -> oneshot::Sender<Admission> {
            match self.engine.recv().await {
                Some(Inbound::Peer { pid, reply }) => {
                    assert_eq!(pid, Some(std::process::id()), "the peer's PID from the kernel");
                    reply
                }
                other => panic!("expected an admission question, got {other:?}"),
            }
        }

        /// Admits the next connection and answers its one liveness request.
        async fn admit_and_serve(&mut self, client: &mut BufReader<UnixStream>) -> Value {
            let _ = self.question().await.send(Admission::Admitted);
            let answer = call(client, r#"{"op":"liveness"}"#);
            let served = async {
                match self.engine.recv().await {
                    Some(Inbound::Request(request)) => {
                        let _ = request.reply.send(Answer::Alive);
                    }
                    other => panic!("expected a request, got {other:?}"),
                }
            };
            tokio::join!(answer, served).0
        }
    }

    async fn call(client: &mut BufReader<UnixStream>, request: &str) -> Value {
        client
            .get_mut()
            .write_all(format!("{request}\n").as_bytes())
            .await
            .expect("write");
        line(client).await
    }

    async fn line(client: &mut BufReader<UnixStream>) -> Value {
        let mut line = String::new();
        client.read_line(&mut line).await.expect("read");
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON: {line:?}"))
    }

    #[tokio::test]
    async fn strangers_awaiting_admission_leave_the_workload_its_way_in() {
        let mut fx = Fixture::start(Limits::default());
        // MAX_PENDING connections of another process, their admission stalled (a busy engine).
        let mut strangers = Vec::new();
        let mut stalled = Vec::new();
        for _ in 0..MAX_PENDING {
            strangers.push(fx.connect().await);
            stalled.push(fx.question().await);
        }
        let mut one_more = fx.connect().await;
        assert_eq!(
            line(&mut one_more).await["error"],
            "too many connections awaiting admission"
        );
        // The workload process itself still gets in, and is served.
        fx.workload.send_replace(Some(std::process::id()));
        let mut own = fx.connect().await;
        assert_eq!(fx.admit_and_serve(&mut own).await["alive"], true);
        // A refusal frees its pending slot at once.
        fx.workload.send_replace(Some(1));
        let _ = stalled
            .pop()
            .map(|q| q.send(Admission::Refused("not the workload".into())));
        let refused = strangers.last_mut().map(line).expect("a stranger");
        assert_eq!(refused.await["error"], "not the workload");
        let mut next = fx.connect().await;
        assert_eq!(fx.admit_and_serve(&mut next).await["alive"], true);
    }

    #[tokio::test]
    async fn an_undecided_admission_times_out_and_frees_its_slot() {
        let limits = Limits {
            pending: 1,
            admission: Duration::from_millis(100),
            ..Limits::default()
        };
        let mut fx = Fixture::start(limits);
        let mut stranger = fx.connect().await;
        let _stalled = fx.question().await;
        assert_eq!(line(&mut stranger).await["error"], "no admission decision in time");
        let mut next = fx.connect().await;
        assert_eq!(fx.admit_and_serve(&mut next).await["alive"], true);
    }

    #[tokio::test]
    async fn admitted_slots_are_bounded_with_a_reserve_for_the_workload_process() {
        let limits = Limits {
            connections: 2,
            reserved: 1,
            ..Limits::default()
        };
        let mut fx = Fixture::start(limits);
        // Two descendants of the workload hold the shared slots.
        let mut open = Vec::new();
        for _ in 0..2 {
            let mut client = fx.connect().await;
            assert_eq!(fx.admit_and_serve(&mut client).await["alive"], true);
            open.push(client);
        }
        let mut third = fx.connect().await;
        let _ = fx.question().await.send(Admission::Admitted);
        assert_eq!(line(&mut third).await["error"], "too many connections (2 open)");
        // The workload process itself has its reserve.
        fx.workload.send_replace(Some(std::process::id()));
        let mut own = fx.connect().await;
        assert_eq!(fx.admit_and_serve(&mut own).await["alive"], true);
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed() {
        let limits = Limits {
            idle: Duration::from_millis(300),
            ..Limits::default()
        };
        let mut fx = Fixture::start(limits);
        let mut idle = fx.connect().await;
        let _ = fx.question().await.send(Admission::Admitted);
        let mut rest = String::new();
        let read = tokio::time::timeout(Duration::from_secs(10), idle.read_line(&mut rest)).await;
        assert!(
            matches!(read, Ok(Ok(0))),
            "closed by the sidecar without a line: {read:?} {rest:?}"
        );
    }

    #[test]
    fn parses_the_four_operations_and_refuses_the_rest() {
        assert_eq!(
            parse(r#"{"op":"progress","value":5,"note":"hi","id":1}"#).unwrap(),
            (
                Some(json!(1)),
                Ask::Relay(Op::Progress {
                    value: 5,
                    note: "hi".into()
                })
            )
        );
        assert_eq!(parse(r#"{"op":"credential"}"#).unwrap(), (None, Ask::Credential));
        assert_eq!(
            parse(r#"{"op":"liveness","id":"a"}"#).unwrap().1,
            Ask::Relay(Op::Liveness)
        );
        assert_eq!(parse(r#"{"op":"policy"}"#).unwrap().1, Ask::Policy);
        for bad in [
            r#"{"op":"progress"}"#,
            r#"{"op":"progress","value":-1}"#,
            r#"{"op":"shutdown"}"#,
            r#"{"op":"liveness","id":{"x":1}}"#,
            "not json",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let long = format!(
            r#"{{"op":"progress","value":1,"note":"{}"}}"#,
            "x".repeat(MAX_NOTE_BYTES + 1)
        );
        assert!(parse(&long).unwrap_err().contains("note"));
    }

    #[test]
    fn renders_answers_with_the_echoed_id() {
        let v: Value = serde_json::from_str(&render(
            Some(&json!(7)),
            &Answer::Progress {
                value: 3,
                term: 2,
                member: "m".into(),
            },
        ))
        .unwrap();
        assert_eq!(
            v,
            json!({"ok": true, "op": "progress", "value": 3, "term": 2, "member": "m", "id": 7})
        );
        let v: Value = serde_json::from_str(&render(None, &Answer::Refused("no".into()))).unwrap();
        assert_eq!(v, json!({"ok": false, "error": "no"}));
    }

    /// An observation held until `release` sends (or is dropped), counting its runs.
    fn held_observer() -> (
        Observer,
        std::sync::mpsc::Sender<()>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Mutex::new(gate);
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let observer = Observer::new(Arc::new(move |pid| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = gate.lock().unwrap_or_else(PoisonError::into_inner).recv();
            Ok(WorkloadIdentity {
                pid,
                start_time_ticks: 7,
                exe_digest: vec![1; 32],
            })
        }));
        (observer, release, runs)
    }

    /// Hashing a large executable can take longer than a connection waits for its admission
    /// (a debug build hashing a 36 MB agent, eight sidecars on two cores, never got one
    /// admitted: each retry started the hash over). The connection that gave up is refused,
    /// and the observation still ends in the engine pinning the process.
    #[tokio::test]
    async fn an_observation_slower_than_the_admission_time_out_is_still_pinned() {
        let (observer, release, _) = held_observer();
        let limits = Limits {
            admission: Duration::from_millis(100),
            ..Limits::default()
        };
        let mut fx = Fixture::observing(limits, observer);
        let mut client = fx.connect().await;
        let _ = fx.question().await.send(Admission::NeedsIdentity);
        assert_eq!(line(&mut client).await["error"], "no admission decision in time");
        release.send(()).expect("the observation waits");
        // Bounded only so that a regression fails instead of hanging.
        match tokio::time::timeout(Duration::from_secs(60), fx.engine.recv()).await {
            Ok(Some(Inbound::Pin { identity, .. })) => assert_eq!(identity.pid, std::process::id()),
            other => panic!("expected the observed process to be pinned, got {other:?}"),
        }
    }

    /// A process asked about again while its observation runs joins it: one hash, one pin.
    #[tokio::test]
    async fn a_process_observed_again_joins_the_observation_in_flight() {
        let (observer, release, runs) = held_observer();
        let (engine, mut questions) = mpsc::channel(4);
        let pid = std::process::id();
        let mut gave_up = Box::pin(observer.pin(&engine, pid));
        assert!(futures::poll!(&mut gave_up).is_pending());
        drop(gave_up);
        let mut again = Box::pin(observer.pin(&engine, pid));
        assert!(futures::poll!(&mut again).is_pending());
        drop(release);
        let pinned = async {
            match questions.recv().await {
                Some(Inbound::Pin { reply, .. }) => {
                    let _ = reply.send(Admission::Admitted);
                }
                other => panic!("expected a pin, got {other:?}"),
            }
        };
        let (admission, ()) = tokio::join!(again, pinned);
        assert!(matches!(admission, Ok(Admission::Admitted)), "{admission:?}");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "one observation");
        assert!(questions.try_recv().is_err(), "one pin");
    }
}
