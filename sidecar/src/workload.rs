//! The workload's local endpoint: a Unix socket speaking newline-delimited JSON, one answer
//! line per request line, in order (protocol in the README). Each connection is identified by
//! the kernel (peer credentials), never by what it claims; the engine admits it only if it is
//! the workload process or one of its descendants (or pins the first one in socket mode).

use std::path::Path;
use std::sync::Arc;

use futures::{SinkExt, StreamExt};
use proto::common::v1::WorkloadIdentity;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::codec::{Framed, LinesCodec, LinesCodecError};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::identity;
use crate::supervision::Token;

/// Longest request line (bytes, newline excluded).
pub const MAX_LINE_BYTES: usize = 16 * 1024;
/// Longest progress note (ReportProgress.note).
pub const MAX_NOTE_BYTES: usize = 256;
/// Most simultaneous workload connections.
pub const MAX_CONNECTIONS: usize = 16;

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
    Credential,
    Liveness,
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
    Credential {
        token: Token,
        expires_at_ms: i64,
    },
    Alive,
    Refused(String),
}

/// A request and where its answer goes.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    pub reply: oneshot::Sender<Answer>,
}

/// How the engine judges a connecting process.
#[derive(Debug)]
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
pub async fn serve(listener: UnixListener, engine: mpsc::Sender<Inbound>, cancel: CancellationToken) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
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
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            refuse(stream, "too many connections").await;
            continue;
        };
        let engine = engine.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = cancel.cancelled() => {}
                () = connection(stream, engine) => {}
            }
            drop(permit);
        });
    }
}

async fn refuse(stream: UnixStream, reason: &str) {
    let mut framed = Framed::new(stream, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
    let _ = framed.send(render(None, &Answer::Refused(reason.into()))).await;
}

async fn connection(stream: UnixStream, engine: mpsc::Sender<Inbound>) {
    let pid = stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0);
    let admission = match ask(&engine, |reply| Inbound::Peer { pid, reply }).await {
        Admission::NeedsIdentity => match pid {
            Some(pid) => match tokio::task::spawn_blocking(move || identity::observe(pid)).await {
                Ok(Ok(identity)) => ask(&engine, |reply| Inbound::Pin { identity, reply }).await,
                Ok(Err(err)) => Admission::Refused(format!("cannot observe the connecting process: {err}")),
                Err(_) => Admission::Refused("cannot observe the connecting process".into()),
            },
            None => Admission::Refused("the connecting process is not visible".into()),
        },
        other => other,
    };
    if let Admission::Refused(reason) = admission {
        debug!(?pid, %reason, "workload connection refused");
        refuse(stream, &reason).await;
        return;
    }
    let mut framed = Framed::new(stream, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
    while let Some(line) = framed.next().await {
        let (id, answer) = match line {
            Ok(line) if line.trim().is_empty() => continue,
            Ok(line) => match parse(&line) {
                Ok((id, op)) => {
                    let (reply, answer) = oneshot::channel();
                    let answer = if engine.send(Inbound::Request(Request { op, reply })).await.is_ok() {
                        answer
                            .await
                            .unwrap_or_else(|_| Answer::Refused("the sidecar is stopping".into()))
                    } else {
                        Answer::Refused("the sidecar is stopping".into())
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

async fn ask(engine: &mpsc::Sender<Inbound>, message: impl FnOnce(oneshot::Sender<Admission>) -> Inbound) -> Admission {
    let (reply, answer) = oneshot::channel();
    if engine.send(message(reply)).await.is_err() {
        return Admission::Refused("the sidecar is stopping".into());
    }
    answer
        .await
        .unwrap_or_else(|_| Admission::Refused("the sidecar is stopping".into()))
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
}

/// Parses one request line: the optional `id` (echoed in the answer) and the operation.
pub fn parse(line: &str) -> Result<(Option<Value>, Op), String> {
    let line: Line = serde_json::from_str(line).map_err(|e| {
        format!("invalid request (expected {{\"op\":\"progress\"|\"credential\"|\"liveness\",...}}): {e}")
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
        OpLine::Progress { value, note } => Op::Progress { value, note },
        OpLine::Credential {} => Op::Credential,
        OpLine::Liveness {} => Op::Liveness,
    };
    Ok((line.id, op))
}

/// Renders one answer line (without the newline).
pub fn render(id: Option<&Value>, answer: &Answer) -> String {
    let mut out = match answer {
        Answer::Progress { value, term, member } => {
            json!({"ok": true, "op": "progress", "value": value, "term": term, "member": member})
        }
        Answer::Credential { token, expires_at_ms } => {
            json!({"ok": true, "op": "credential", "token": token.expose(), "expires_at_ms": expires_at_ms})
        }
        Answer::Alive => json!({"ok": true, "op": "liveness", "alive": true}),
        Answer::Refused(error) => json!({"ok": false, "error": error}),
    };
    if let (Some(id), Some(object)) = (id, out.as_object_mut()) {
        object.insert("id".into(), id.clone());
    }
    out.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_operations_and_refuses_the_rest() {
        assert_eq!(
            parse(r#"{"op":"progress","value":5,"note":"hi","id":1}"#).unwrap(),
            (
                Some(json!(1)),
                Op::Progress {
                    value: 5,
                    note: "hi".into()
                }
            )
        );
        assert_eq!(parse(r#"{"op":"credential"}"#).unwrap(), (None, Op::Credential));
        assert_eq!(parse(r#"{"op":"liveness","id":"a"}"#).unwrap().1, Op::Liveness);
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
        let credential = Answer::Credential {
            token: Token::new("t0k"),
            expires_at_ms: 9,
        };
        assert!(!format!("{credential:?}").contains("t0k"), "Debug hides the credential");
        assert!(render(None, &credential).contains("t0k"));
    }
}
